"""`train_lm`'s model trained with `jax.jit` on a mesh of all local devices:
data parallel or FSDP, dense and 2:4 side by side, with tokens/s.

The model, data and optimizer are `examples/train_lm.py`'s (byte-level
transformer, MLP layers `jsparse24.SparseDense` in the 2:4 run, `mask_update`
chained before AdamW). One `jax.jit` train step; the layout is only in the
shardings of its inputs (and, for FSDP, one constraint inside the step):

* `--layout data`: each batch split over the devices, params and optimizer
  state replicated. The 2:4 products run on each device's own rows (no
  activation is gathered; `jsparse24` gives its custom calls a sharding rule).
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

    python examples/sharded_train.py --layout fsdp              # CPU, tiny
    python examples/sharded_train.py --size gpu --layout data   # GPUs
    python examples/sharded_train.py --size gpu --layout tp     # GPUs

On a CPU, ask for fake devices first:
`XLA_FLAGS=--xla_force_host_platform_device_count=8`.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import pathlib
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm import tqdm

import jsparse24


def _train_lm():
  path = pathlib.Path(__file__).with_name("train_lm.py")
  spec = importlib.util.spec_from_file_location("train_lm", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules.setdefault("train_lm", module)
  spec.loader.exec_module(module)
  return module


def _param_spec(a, n: int) -> P:
  """FSDP at rest: the last axis over the devices where it divides."""
  if a.ndim >= 1 and a.shape[-1] % n == 0:
    return P(*([None] * (a.ndim - 1)), "data")
  return P()


def _tp_specs(d_model: int) -> dict[tuple[int, ...], P]:
  """`--layout tp`, by array shape: the MLP kernels `up [d, 4d]` (column-
  parallel) and `down [4d, d]` (row-parallel) and their AdamW moments alike
  (their masks follow them: `jsparse24.optim.masks_like_kernels`)."""
  d, h = d_model, 4 * d_model
  return {(d, h): P(None, "model"), (h, d): P("model", None)}


def tp_shardings(mesh) -> tuple:
  """The MLP layers' `kernel_sharding` under `--layout tp`."""
  return (("up", NamedSharding(mesh, P(None, "model"))),
          ("down", NamedSharding(mesh, P("model", None))))


def _sparse_kernel_paths(run) -> set:
  """Paths (tuples of keys) of the 2:4 layers' kernels in the params tree."""
  if not run.sparse:
    return set()
  # optim.stats is keyed by each 2:4 layer's path ("block_0/mlp/up").
  return {tuple(path.split("/")) + ("kernel",) for path in jsparse24.optim.stats(run.opt_state)}


def make_step(lm, run, layout: str, mesh, state):
  """The jitted train step; `state` = (params, opt_state) as laid out, which
  the step's outputs keep (left to XLA, the masks that the rebuild kernel
  makes on each device's block could come back replicated, gathered every
  step)."""
  whole = NamedSharding(mesh, P())
  sparse_kernels = _sparse_kernel_paths(run)

  def gather(path, a):
    # FSDP: whole weights for the products, sharded at rest. The 2:4 kernels
    # stay sharded: each device compresses its own columns and the
    # compressed arrays are gathered (half the bytes, 1/n of the work).
    if tuple(k.key for k in path) in sparse_kernels:
      return a
    return jax.lax.with_sharding_constraint(a, whole)

  def step(params, opt_state, x, y, phase=None):
    def objective(p):
      if layout == "fsdp":
        p = jax.tree_util.tree_map_with_path(gather, p)
      # The phase (dense warm-up or sparse) is static: one program per phase,
      # no run-time switch per product (jsparse24.optim.masks).
      return lm.loss_fn(run.model, run.variables(p, opt_state, phase), x, y)

    loss, grads = jax.value_and_grad(objective)(params)
    updates, opt_state = run.tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  keep = jax.tree.map(lambda a: a.sharding, state) + (whole,)
  return jax.jit(step, donate_argnums=(0, 1), static_argnames="phase", out_shardings=keep)


def train(lm, run, args, data, mesh) -> dict:
  n = mesh.size
  rows = NamedSharding(mesh, P("data"))
  if args.layout == "fsdp":
    state_sharding = lambda a: NamedSharding(mesh, _param_spec(a, n))  # noqa: E731
  elif args.layout == "tp":
    specs = _tp_specs(args.d_model)
    state_sharding = lambda a: NamedSharding(mesh, specs.get(tuple(a.shape), P()))  # noqa: E731
  else:
    state_sharding = lambda a: NamedSharding(mesh, P())  # noqa: E731
  params = jax.tree.map(lambda a: jax.device_put(a, state_sharding(a)), run.params)
  opt_state = jax.tree.map(lambda a: jax.device_put(a, state_sharding(a)), run.opt_state)
  if run.sparse:  # each mask where its kernel's block is (tp, FSDP's sharded kernels)
    opt_state = jsparse24.optim.masks_like_kernels(opt_state, params)
  step = make_step(lm, run, args.layout, mesh, (params, opt_state))
  # Timed from the step after the first sparse one (compilation and
  # cuSPARSELt's algorithm search happen before), as in train_lm.
  start = min(args.mask_warmup + 2, args.steps - 1)
  losses, t0 = [], None
  # Progress: steps dispatched (the first step of each phase waits for its
  # compilation, and the first sparse one for cuSPARSELt's algorithm search).
  for i in tqdm(range(args.steps), desc=f"{run.name:>5}", unit="step", dynamic_ncols=True):
    if i == start:
      jax.block_until_ready(params)
      t0 = time.perf_counter()
    x, y = lm.train_batch(data, i, args.batch, args.seq_len, args.seed)
    x, y = jax.device_put(x, rows), jax.device_put(y, rows)
    params, opt_state, loss = step(params, opt_state, x, y, phase=run.phase(i))
    losses.append(loss)
  jax.block_until_ready(params)
  timed = args.steps - start if t0 is not None else 0
  tokens_per_s = (timed * args.batch * args.seq_len / (time.perf_counter() - t0)
                  if timed else float("nan"))
  losses = [float(v) for v in losses]
  return {"loss_first": losses[0], "loss_last": float(np.mean(losses[-10:])),
          "tokens_per_s": tokens_per_s, "params": params, "opt_state": opt_state}


def main(argv: Sequence[str] | None = None) -> dict:
  lm = _train_lm()
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      epilog="Every other flag is train_lm.py's (model, data, schedule; see its --help).")
  p.add_argument("--layout", choices=("data", "fsdp", "tp"), default="data",
                 help="data parallel, FSDP (params sharded at rest), or tensor parallel"
                      " MLP layers (default: data)")
  p.add_argument("--model-devices", type=int, default=None,
                 help="--layout tp: devices on the mesh's model axis (default: all)")
  p.add_argument("--size", choices=sorted(lm.PRESETS), default="small",
                 help="train_lm's preset (default: small)")
  p.add_argument("--steps", type=int, default=None,
                 help="training steps of each run (default: the preset's)")
  p.add_argument("--batch", type=int, default=None,
                 help="sequences per step, all devices together (a multiple of their"
                      " number; default: the preset's)")
  args, rest = p.parse_known_args(argv)
  lm_args = lm.parse_args(["--size", args.size] + rest
                          + (["--steps", str(args.steps)] if args.steps else [])
                          + (["--batch", str(args.batch)] if args.batch else []))
  lm_args.layout = args.layout
  devices = jax.devices()
  model_devices = 1
  if args.layout == "tp":
    model_devices = args.model_devices or len(devices)
    if len(devices) % model_devices or (4 * lm_args.d_model) % model_devices:
      p.error(f"--model-devices {model_devices} must divide the {len(devices)} devices and"
              f" the MLP's hidden size {4 * lm_args.d_model}.")
  elif args.model_devices is not None:
    p.error("--model-devices applies to --layout tp only.")
  data_devices = len(devices) // model_devices
  if lm_args.batch % data_devices:
    p.error(f"--batch {lm_args.batch} must be a multiple of the {data_devices} devices"
            f" it is split over.")
  if args.layout == "tp":
    mesh = jax.sharding.Mesh(np.array(devices).reshape(data_devices, model_devices),
                             ("data", "model"))
  else:
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
  data, _ = lm.load_text(lm.corpus_files(lm_args.corpus))
  sample = jnp.zeros((1, lm_args.seq_len), jnp.int32)
  print(f"{len(devices)} devices ({devices[0].platform}), layout {args.layout}"
        + (f" (mesh data x model = {data_devices} x {model_devices})" if args.layout == "tp"
           else "") + ";"
        f" d_model {lm_args.d_model}, {lm_args.layers} layers, batch {lm_args.batch} x"
        f" {lm_args.seq_len}, {lm_args.steps} steps")
  out = {}
  for name, sparse in (("dense", False), ("2:4", True)):
    run = lm.make_run(name, sparse, lm_args, sample,
                      tp_shardings(mesh) if args.layout == "tp" else ())
    out[name] = train(lm, run, lm_args, data, mesh)
    r = out[name]
    print(f"{name:>5}: loss {r['loss_first']:.3f} -> {r['loss_last']:.3f} (mean of the last"
          f" 10 steps), {r['tokens_per_s']:,.0f} tokens/s")
  ratio = out["2:4"]["tokens_per_s"] / out["dense"]["tokens_per_s"]
  if math.isfinite(ratio):
    print(f"2:4 / dense tokens/s: {ratio:.3f}x (timed from the step after the first sparse one)")
  return out


if __name__ == "__main__":
  main()
