"""`train_lm`'s model trained with `jax.jit` on a mesh of all devices of one or
several processes: data parallel, FSDP, tensor parallel or both, dense and
2:4 side by side, with tokens/s and Orbax checkpoints.

The model, data and optimizer are `examples/train_lm.py`'s (byte-level
transformer, MLP layers `jsparse24.SparseDense` in the 2:4 run, `mask_update`
chained before AdamW). One `jax.jit` train step; the layout is only in the
shardings of its inputs (and, for FSDP and 2d, constraints inside the step):

* `--layout data`: each batch split over the devices, params and optimizer
  state replicated. The 2:4 products run on each device's own rows (no
  activation is gathered), and the automatic choice picks each product's
  backend for those rows (`jsparse24.layouts.Layout.kernel_sharding`).
* `--layout fsdp`: params and optimizer state sharded over the devices at
  rest (on the last axis where it divides), gathered whole inside the step for
  the products (`with_sharding_constraint`), gradients reduce-scattered;
  the 2:4 layers' kernels are left sharded: each device prunes and
  compresses its own columns, and the compressed arrays are gathered.
* `--layout tp`: Megatron tensor parallelism of the MLP layers on a
  `data x model` mesh (`--model-devices` devices on `model`, default all):
  `up` column-parallel (kernel sharded on its output axis), `down`
  row-parallel (on its input axis), their optimizer state and masks alike,
  everything else replicated; each batch split over `data`. The 2:4 layers
  name their kernels' sharding (`SparseDense(kernel_sharding=...)`): each
  device prunes, compresses and multiplies its own block, and `down`'s
  partial products are summed over `model` (one all-reduce), as XLA does
  for the dense model's `nn.Dense` layers by itself.
* `--layout 2d`: both on a `data x model` mesh (`--model-devices` on
  `model`, default 2): the MLP layers tensor parallel over `model` as in
  `tp`, and FSDP over `data`: every array of the state sharded over `data`
  at rest (the MLP kernels on their other axis: `up` `P(data, model)`,
  `down` `P(model, data)`), gathered over `data` inside the step; each batch
  split over `data`.

The layouts' shardings are `jsparse24.layouts`' (`Layout`, with the MLP layers
named tensor parallel). The 2:4 run's masks are rebuilt on each device's block
of their kernels and stay there: laid out like the kernels
(`jsparse24.optim.masks_like_kernels`) and kept so by the step's
`out_shardings` (in 2d the products gather a mask over `data` with its kernel,
a 32nd of the kernel's float32 bytes).

Several processes (one per host, or one per GPU) run as JAX's multi-host
programs do: `jax.distributed.initialize` first, then a mesh over every
process's devices (`jax.devices()`, process by process: the `model` axis
runs over consecutive devices, within a host where it fits), the state made
in its shardings by `jax.jit(init, out_shardings=...)`, each batch assembled
from the rows that each process makes for its own devices
(`jax.make_array_from_process_local_data`), and Orbax checkpoints that every
process writes and restores (its own shards). Only process 0 prints.

Checkpoints: `--out`/checkpoints/{dense,sparse}/<step>, every `--eval-every`
steps and at the end (train_lm's flags; nothing is validated here);
`--resume` continues each run from its latest one, bit for bit on the same
devices (the batches are a function of the seed and the step). A checkpoint
restores into any layout and process count (Orbax reads each device's share).

The model and step sizes are a train_lm preset, chosen as train_lm chooses
(the first line printed says which, and why): without `--size`, "gpu" where
JAX finds a GPU (d_model 4096, 2 blocks, 32 x 512 tokens per step over all
devices: 8 sequences on each of 4 data-parallel GPUs), "small" elsewhere
(d_model 128, 16 x 64 tokens). `--batch` counts the sequences of all processes
and devices together, split evenly over the devices on the mesh's data axis (a
multiple of them).

One process, all its devices:

    python examples/sharded_train.py --layout fsdp   # CPU: tiny; GPUs: the gpu preset
    python examples/sharded_train.py --layout data   # GPUs
    python examples/sharded_train.py --layout 2d     # GPUs

On a CPU, ask for fake devices first:
`XLA_FLAGS=--xla_force_host_platform_device_count=8`.

N processes on one machine: every process gets the same flags but its
`--process-id`. 2 processes x 2 CPU devices; 4 processes x 1 GPU each:

    export XLA_FLAGS=--xla_force_host_platform_device_count=2
    for i in 0 1; do
      python examples/sharded_train.py --layout 2d --coordinator localhost:12355 \\
          --num-processes 2 --process-id $i &
    done; wait

    for i in 0 1 2 3; do
      CUDA_VISIBLE_DEVICES=$i python examples/sharded_train.py --layout 2d \\
          --coordinator localhost:12355 --num-processes 4 --process-id $i &
    done; wait

Several hosts: the same command on each, `--coordinator` naming process 0's
host and a free port there, `--process-id` 0 to N-1; `--out` on a file
system every host sees. Under a cluster launcher that JAX detects (Slurm's
`srun`, Open MPI's `mpirun`, Kubernetes, Cloud TPU) pass `--cluster` instead
of the three flags: `jax.distributed.initialize()` takes them from the
launcher:

    srun --nodes 2 --ntasks-per-node 4 --gpus-per-task 1 \\
        python examples/sharded_train.py --layout 2d --cluster

Without the flags or `--cluster` it is one process. CPU devices talk across
processes through gloo (set here); GPUs through NCCL (XLA's default).

4 processes x 1 GPU against 1 process x 4 GPUs, every layout (equal losses;
tokens/s of both; on a machine with 4 GPUs, `-k fsdp` for one layout):

    XLA_PYTHON_CLIENT_PREALLOCATE=false python -m pytest tests/test_multiprocess.py -m gpu -s
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm import tqdm

import jsparse24

# The example beside this one (Python puts a script's folder on its path):
# the model, data, flags, schedule and checkpoints of the runs sharded here.
import train_lm as lm  # pylint: disable=g-bad-import-order

# The layouts (`jsparse24.layouts`): Megatron tensor parallelism of the MLP
# layers, `up` [d, 4d] column-parallel, `down` [4d, d] row-parallel.
LAYOUTS = jsparse24.layouts.LAYOUTS
MLP_ROLES = {"up": "column", "down": "row"}
TENSOR_PARALLEL = {f"mlp/{name}": role for name, role in MLP_ROLES.items()}


def log(*args) -> None:
  """`print` on process 0 only (every process runs this script)."""
  if jax.process_index() == 0:
    print(*args, flush=True)


# --- processes and mesh --------------------------------------------------------


def initialize_distributed(args, parser) -> str:
  """Joins this process to the others (`jax.distributed.initialize`), before
  anything touches a device: with the three flags, or with `--cluster` from
  what the cluster launcher tells JAX, else not at all (one process).
  Returns how."""
  flags = {"--coordinator": args.coordinator, "--num-processes": args.num_processes,
           "--process-id": args.process_id}
  given = [name for name, value in flags.items() if value is not None]
  if given and args.cluster:
    parser.error(f"--cluster takes the coordinator, the number of processes and this"
                 f" process's id from the cluster launcher: drop {', '.join(given)}, or"
                 f" --cluster.")
  if given and len(given) < len(flags):
    missing = [name for name in flags if name not in given]
    parser.error(f"{', '.join(given)} needs {' and '.join(missing)} too: a multi-process run"
                 f" names the coordinator (process 0's host:port), the number of processes"
                 f" and this process's id (0 to N-1), or none of them and --cluster under"
                 f" a cluster launcher (srun, mpirun).")
  if given and not 0 <= args.process_id < args.num_processes:
    parser.error(f"--process-id {args.process_id} must lie in 0..{args.num_processes - 1}"
                 f" (--num-processes {args.num_processes}).")
  if jax.distributed.is_initialized():  # by an earlier main() in this process (tests)
    if given and (jax.process_count(), jax.process_index()) != (args.num_processes,
                                                                args.process_id):
      parser.error(f"this process joined {jax.process_count()} processes as process"
                   f" {jax.process_index()} already; --num-processes {args.num_processes}"
                   f" --process-id {args.process_id} cannot change that.")
    return "joined earlier"
  if not given and not args.cluster:
    return "no jax.distributed"
  # CPU devices' collectives across processes (GPUs use NCCL by themselves).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if given:
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    return f"joined through --coordinator {args.coordinator}"
  # No arguments: JAX reads them from the launcher's environment (Slurm,
  # Open MPI, Kubernetes, Cloud TPU), or says that it found none.
  jax.distributed.initialize()
  return "joined through the cluster launcher (jax.distributed's detection)"


def process_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> slice:
  """The rows of a global `shape` array sharded as `sharding` that this
  process's devices hold: one block, since each process's devices are
  consecutive on the mesh."""
  blocks = {index[0].indices(shape[0])[:2]
            for index in sharding.addressable_devices_indices_map(shape).values()}
  lo, hi = min(b[0] for b in blocks), max(b[1] for b in blocks)
  if sum(b - a for a, b in blocks) != hi - lo:
    raise ValueError(f"process {jax.process_index()}'s devices hold rows {sorted(blocks)} of"
                     f" the batch, not one block: the mesh must list each process's devices"
                     f" together.")
  return slice(lo, hi)


def global_batch(data, step: int, args, sharding: NamedSharding) -> tuple[jax.Array, ...]:
  """Step `step`'s batch (x, y) as global arrays laid out as `sharding`:
  this process makes only the rows its own devices hold."""
  shape = (args.batch, args.seq_len)
  rows = lm.train_batch(data, step, args.batch, args.seq_len, args.seed,
                        process_rows(sharding, shape))
  return tuple(jax.make_array_from_process_local_data(sharding, a, shape) for a in rows)


# --- layouts -------------------------------------------------------------------


def mlp_shardings(layout) -> tuple:
  """The MLP layers' `kernel_sharding` (train_lm's `MLP.shardings`): their
  split under `--layout tp` and `2d`, the whole kernel with the rows split
  under `data` (the automatic choice then sees each device's rows), none
  under `fsdp`."""
  if layout.name == "fsdp":
    return ()
  return tuple((name, layout.kernel_sharding(role)) for name, role in MLP_ROLES.items())


def _sparse_layers(run) -> set[str]:
  """The 2:4 layers' paths in the params tree ("block_0/mlp/up")."""
  return set(jsparse24.optim.stats(run.opt_state)) if run.sparse else set()


# --- training ------------------------------------------------------------------


def make_step(run, layout):
  """The jitted train step. Its outputs keep the state's layout
  (`out_shardings`; left to XLA, the masks that the rebuild kernel makes on
  each device's block could come back replicated, gathered every step)."""
  whole = NamedSharding(layout.mesh, P())
  sparse_layers = _sparse_layers(run)

  def step(params, opt_state, x, y, phase=None):
    def objective(p):
      p = layout.constrain(p, sparse_layers)
      # The phase (dense warm-up or sparse) is static: one program per phase,
      # no run-time switch per product (jsparse24.optim.masks); None while
      # --sparsity-ramp mixes dense and 2:4 layers, whose products then
      # switch at run time (train_lm's Run.static_phase avoids that).
      return lm.loss_fn(run.model, run.variables(p, opt_state, phase), x, y)

    loss, grads = jax.value_and_grad(objective)(params)
    updates, opt_state = run.tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  keep = jax.tree.map(lambda a: a.sharding, (run.params, run.opt_state)) + (whole,)
  return jax.jit(step, donate_argnums=(0, 1), static_argnames="phase", out_shardings=keep)


def open_checkpoints(run, args):
  """The run's Orbax checkpoints, which every process opens, writes and
  reads (each its own shards). `--resume`: `run` restored from the latest,
  in its current layout; otherwise the old ones go."""
  directory = lm.checkpoint_dir(args.out, run.name)
  if not args.resume and jax.process_index() == 0 and os.path.isdir(directory):
    shutil.rmtree(directory)  # a fresh run replaces the old checkpoints
  multihost_utils.sync_global_devices("sharded_train: checkpoints ready")
  mngr = lm.checkpoint_manager(directory)
  if args.resume:
    if mngr.latest_step() is not None:
      lm.restore(mngr, run)
    log(f"{run.name:>5}: resuming from step {run.step}" if run.step else
        f"{run.name:>5}: no checkpoint in {directory}, starting from step 0")
  return mngr


def train(run, args, data, layout) -> dict:
  rows = layout.batch_sharding
  mngr = open_checkpoints(run, args)
  step = make_step(run, layout)
  # Timed from the step after the first sparse one (compilation and
  # cuSPARSELt's algorithm search happen before), as in train_lm, and never
  # through a checkpoint.
  first = run.step
  start = max(first + 1, min(args.mask_warmup + 1, args.steps - 1))
  timed_steps, timed_s, t0 = 0, 0.0, None
  pending = []
  # Progress: steps dispatched (the first step of each phase waits for its
  # compilation, and the first sparse one for cuSPARSELt's algorithm search).
  for i in tqdm(range(first, args.steps), desc=f"{run.name:>5}", unit="step",
                dynamic_ncols=True, disable=jax.process_index() != 0):
    if i == start:
      jax.block_until_ready(run.params)
      t0 = time.perf_counter()
    x, y = global_batch(data, i, args, rows)
    run.params, run.opt_state, loss = step(run.params, run.opt_state, x, y, phase=run.phase(i))
    run.step = i + 1
    pending.append(loss)
    if run.step % args.eval_every == 0 or run.step == args.steps:
      jax.block_until_ready(run.params)
      if t0 is not None:
        timed_steps, timed_s = run.step - start, timed_s + time.perf_counter() - t0
      run.history["train_curve"].extend(float(v) for v in pending)  # replicated scalars
      pending = []
      lm.save(mngr, run)
      t0 = time.perf_counter() if t0 is not None else None
  mngr.wait_until_finished()
  mngr.close()
  if first >= args.steps:
    log(f"{run.name:>5}: NOTHING TO TRAIN: the checkpoint is at step {first} and --steps is"
        f" {args.steps}; pass --steps above {first} to train further.")
  losses = run.history["train_curve"]
  tokens_per_s = (timed_steps * args.batch * args.seq_len / timed_s if timed_steps
                  else float("nan"))
  return {"loss_first": losses[0] if losses else float("nan"),
          "loss_last": float(np.mean(losses[-10:])) if losses else float("nan"),
          "losses": list(losses), "start_step": first, "steps_run": run.step - first,
          "timed_steps": timed_steps, "tokens_per_s": tokens_per_s,
          "params": run.params, "opt_state": run.opt_state}


def main(argv: Sequence[str] | None = None) -> dict:
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      epilog="Every other flag is train_lm.py's (model, data, schedule, --eval-every as the"
             " checkpoint interval, --resume; see its --help).")
  p.add_argument("--layout", choices=LAYOUTS, default="data",
                 help="data parallel, FSDP (params sharded at rest), tensor parallel MLP"
                      " layers, or 2d: FSDP over data x tensor parallel over model"
                      " (default: data)")
  p.add_argument("--model-devices", type=int, default=None,
                 help="--layout tp, 2d: devices on the mesh's model axis (default: all for tp,"
                      " 2 for 2d)")
  p.add_argument("--runs", choices=("both", "dense", "2:4"), default="both",
                 help="train the dense model, the 2:4 one, or both in turn (default: both)")
  p.add_argument("--size", choices=sorted(lm.PRESETS), default=None,
                 help="train_lm's preset (default: 'gpu' where JAX finds a GPU, 'small'"
                      " elsewhere)")
  p.add_argument("--steps", type=int, default=None,
                 help="training steps of each run (default: the preset's)")
  p.add_argument("--batch", type=int, default=None,
                 help="sequences per step, all processes and devices together (a multiple of"
                      " the devices on the mesh's data axis; default: the preset's)")
  p.add_argument("--out", default=os.path.join("runs", "sharded_train"),
                 help="folder of the checkpoints (default: runs/sharded_train)")
  p.add_argument("--coordinator", default=None,
                 help="several processes: process 0's host:port (with --num-processes and"
                      " --process-id; under srun or mpirun, --cluster instead)")
  p.add_argument("--cluster", action="store_true",
                 help="several processes under a cluster launcher that JAX detects (Slurm,"
                      " Open MPI, Kubernetes, Cloud TPU): jax.distributed.initialize() with"
                      " no arguments")
  p.add_argument("--num-processes", type=int, default=None,
                 help="several processes: how many (one per host, or one per GPU)")
  p.add_argument("--process-id", type=int, default=None,
                 help="several processes: this one's id, 0 to --num-processes - 1")
  args, rest = p.parse_known_args(argv)
  joined = initialize_distributed(args, p)  # before anything touches a device
  # After joining: without --size, train_lm's preset follows the platform,
  # which asking JAX for its backend starts.
  lm_args = lm.parse_args(["--out", args.out] + rest
                          + (["--size", args.size] if args.size else [])
                          + (["--steps", str(args.steps)] if args.steps is not None else [])
                          + (["--batch", str(args.batch)] if args.batch is not None else []))
  lm_args.layout = args.layout
  if lm_args.sparse_activations != "off" and args.layout != "fsdp":
    p.error(f"--sparse-activations {lm_args.sparse_activations} runs under --layout fsdp only:"
            f" the 2:4-activation layer (mlp/down, SparseDense(input_sparsity=...)) has no"
            f" tensor-parallel products, and --layout {args.layout} gives the MLP layers a"
            f" kernel_sharding.")
  log(f"preset {lm_args.size} ({lm_args.size_reason})")

  n = jax.device_count()  # every process's devices
  if args.model_devices is not None and args.layout not in ("tp", "2d"):
    p.error("--model-devices applies to --layout tp and 2d only.")
  if args.model_devices is not None and args.model_devices < 1:
    p.error(f"--model-devices {args.model_devices} must be >= 1.")
  model_devices = 1
  if args.layout in ("tp", "2d"):
    model_devices = args.model_devices or (n if args.layout == "tp" else 2)
    if n % model_devices or (4 * lm_args.d_model) % model_devices:
      p.error(f"--model-devices {model_devices} must divide the {n} devices and the MLP's"
              f" hidden size {4 * lm_args.d_model}.")
  data_devices = n // model_devices
  if lm_args.batch % data_devices:
    p.error(f"--batch {lm_args.batch} must be a multiple of the {data_devices} devices on the"
            f" mesh's data axis ({jax.process_count()} processes x {jax.local_device_count()}"
            f" devices, {model_devices} on the model axis): each takes as many rows.")
  # jax.devices() lists every process's devices, process by process: the
  # `model` axis (consecutive devices) stays within a process where it fits.
  layout = jsparse24.layouts.Layout(
      args.layout, jsparse24.layouts.make_mesh(args.layout, jax.devices(), model_devices
                                               if args.layout in ("tp", "2d") else None),
      TENSOR_PARALLEL)
  log(f"{jax.process_count()} process(es) ({joined}) x {jax.local_device_count()}"
      f" {jax.devices()[0].platform} device(s), layout {args.layout}"
      + (f" (mesh data x model = {data_devices} x {model_devices})"
         if args.layout in ("tp", "2d") else "") + ";"
      f" d_model {lm_args.d_model}, {lm_args.layers} layers, batch {lm_args.batch} x"
      f" {lm_args.seq_len} ({lm_args.batch // data_devices} rows on each of the {data_devices}"
      f" devices of the data axis), --steps {lm_args.steps} per run")
  data, _ = lm.load_text(lm.corpus_files(lm_args.corpus))
  sample = jnp.zeros((1, lm_args.seq_len), jnp.int32)

  out = {}
  for name, sparse in (("dense", False), ("2:4", True)):
    if args.runs not in ("both", name):
      continue
    run = lm.make_run(name, sparse, lm_args, sample,
                      mlp_shardings(layout), layout.state_sharding)
    if run.sparse:  # each mask where its kernel's block is (tp, 2d, FSDP's sharded kernels)
      run.opt_state = jsparse24.optim.masks_like_kernels(run.opt_state, run.params)
    out[name] = train(run, lm_args, data, layout)
    r = out[name]
    resumed = f", resumed at step {r['start_step']}" if r["start_step"] else ""
    log(f"{name:>5}: {r['steps_run']} steps run (of --steps {lm_args.steps}{resumed}); loss"
        f" {r['loss_first']:.3f} -> {r['loss_last']:.3f} (mean of the last 10 steps);"
        f" {r['tokens_per_s']:,.0f} tokens/s over the {r['timed_steps']} timed steps")
  ratio = out["2:4"]["tokens_per_s"] / out["dense"]["tokens_per_s"] if len(out) == 2 else math.nan
  if math.isfinite(ratio):
    log(f"2:4 / dense tokens/s: {ratio:.3f}x (timed from the step after the first sparse one)")
  return out


if __name__ == "__main__":
  main()
