"""`examples/sharded_train.py` as several processes (`jax.distributed`) computes
what one process computes, across a checkpoint and restart.

CPU (CI): data parallel and 2d (its mesh's data and model axes are the ones
fsdp and tp shard over, each alone) as 2 processes x 2 CPU devices (gloo
collectives) against 1 process x 4 devices, with a restart in the middle:
the 2-process run's step-4 checkpoint of 2d restored by a fresh pair of
processes, which train to the end. GPU (`-m gpu`, 4 GPUs): every layout, 4
processes x 1 GPU against 1 process x 4 GPUs at the GPU preset, losses and
tokens/s.

The processes are `tests/multiprocess_worker.py` (all layouts in one launch:
JAX starts and compiles once per process), on a free localhost port; each
in its own process group, killed whole on a failure or a timeout.
"""

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests.test_examples import load_example

ROOT = pathlib.Path(__file__).resolve().parent.parent

LAYOUTS = ("data", "fsdp", "tp", "2d")
# On the CPU, where each layout's compilation in each of the three launches
# is most of the test's minute: a replicated state and one sharded over both
# kinds of mesh axis.
CPU_LAYOUTS = ("data", "2d")
RESTARTED = "2d"
STEPS, RESTART = 8, 4
# The 2:4 run only (the dense one runs the same code with nn.Dense MLP layers,
# and would double the compilations), sparse from step 0: masks rebuilt at
# steps 2 and 4, frozen from 6 (MaskSchedule(freeze_after=0.8 * steps));
# checkpoints at 4 and 8.
TINY = ["--runs", "2:4", "--steps", str(STEPS), "--eval-every", str(RESTART),
        "--mask-warmup", "0", "--rebuild-every", "2", "--batch", "8", "--seq-len", "16",
        "--d-model", "32", "--layers", "1", "--heads", "2"]
# A launch: JAX's start and the compilation of its layouts (~40-60 s for four
# on a loaded 2-core machine), the steps.
LAUNCH_TIMEOUT_S = 600


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _launch(tmp_path: pathlib.Path, name: str, processes: int, *, env_of, distributed: bool,
            layouts=CPU_LAYOUTS, checkpoints: str | None = None, worker_flags=(), flags=(),
            timeout_s: float = LAUNCH_TIMEOUT_S) -> pathlib.Path:
  """Runs the worker (`layouts` in turn) as `processes` processes
  (`env_of(i, port)`: process i's extra environment; `distributed`: with
  sharded_train's --coordinator flags, else the environment joins them), with
  checkpoints under `tmp_path/checkpoints/<checkpoints or name>`, and waits
  for all. Returns the results folder. On a failure or timeout every
  process group is killed (SIGKILL: JAX catches SIGTERM) and the logs'
  tails are shown."""
  results = tmp_path / name
  port = _free_port()
  procs, logs = [], []
  try:
    for i in range(processes):
      cmd = [sys.executable, "-m", "tests.multiprocess_worker", "--results", str(results),
             "--checkpoints", str(tmp_path / "checkpoints" / (checkpoints or name)),
             "--layouts", ",".join(layouts), *worker_flags]
      if distributed:
        cmd += ["--distributed", f"--coordinator localhost:{port} --num-processes {processes}"
                                 f" --process-id {i}"]
      env = {**os.environ, "PYTHONPATH": os.pathsep.join(
          [str(ROOT), os.environ.get("PYTHONPATH", "")]), **env_of(i, port)}
      log = open(tmp_path / f"{name}-{i}.log", "w")  # pylint: disable=consider-using-with
      logs.append(log)
      procs.append(subprocess.Popen(cmd + ["--", *flags], cwd=ROOT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, process_group=0))
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
      if any(p.returncode for p in procs) or time.monotonic() > deadline:
        break  # one failed (the others would wait for it), or too long
      time.sleep(0.5)
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
      p.wait()
    for log in logs:
      log.close()
  if any(p.returncode for p in procs):
    tails = "\n".join(
        f"--- {name} process {i} (exit {p.returncode}):\n"
        + "\n".join(line for line in (tmp_path / f"{name}-{i}.log").read_text().splitlines()
                    if "[Gloo]" not in line)[-3000:]
        for i, p in enumerate(procs))
    pytest.fail(f"{name}: {processes} process(es) failed or ran past {timeout_s:.0f} s:\n{tails}")
  return results


def _cpu_env(devices: int, cache: pathlib.Path):
  """`devices` CPU devices per process. This process's XLA flags but its
  device count (tests/conftest.py's: the compilations are most of a
  launch's time; every launch compiles alike, so their bits compare), and a
  persistent compilation cache: the restart's processes find the first
  pair's programs there (each process's programs have keys of their own;
  JAX writes from process 0 only, the worker's --cache-every-process from
  each)."""
  compile_flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                           if "device_count" not in f)

  def env_of(i, port):
    del i, port
    return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {compile_flags}",
            "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(cache)}
  return env_of


def _slurm_env(processes: int, devices: int, cache: pathlib.Path):
  """What `srun --ntasks N` sets for each task (JAX's Slurm detection reads
  these), plus the coordinator's port."""
  def env_of(i, port):
    return {**_cpu_env(devices, cache)(i, port), "SLURM_JOB_ID": "1",
            "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_NUM_NODES": "1",
            "SLURM_NTASKS": str(processes), "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i),
            "JAX_COORDINATOR_PORT": str(port)}
  return env_of


def _results(folder: pathlib.Path, layout: str):
  meta = json.loads((folder / f"{layout}.json").read_text())
  npz = folder / f"{layout}.npz"
  return meta, (dict(np.load(npz)) if npz.exists() else None)


def _differences(a: dict, b: dict, shown: int = 4) -> list[str]:
  """The arrays of two final states that are not bit for bit equal (the
  first `shown` of them, and how many)."""
  if a.keys() != b.keys():
    return [f"different arrays: {sorted(a.keys() ^ b.keys())}"]
  out = []
  for key in a:
    if not np.array_equal(a[key], b[key]):
      diff = np.max(np.abs(a[key].astype(np.float64) - b[key].astype(np.float64)))
      out.append(f"{key} (max |difference| {diff:.3g})")
  return out[:shown] + ([f"... {len(out)} of {len(a)} arrays differ"] if len(out) > shown else [])


# The layout of the MLP kernels at the end (their masks' alike).
KERNEL_SPECS = {
    "data": {"up": [None, None], "down": [None, None]},
    "2d": {"up": ["data", "model"], "down": ["model", "data"]},
}


def test_two_processes_compute_what_one_does_across_a_restart(tmp_path):
  """Per layout: the 2-process run's losses, params and optimizer state (2:4
  masks and mask statistics included) equal the 1-process run's bit for bit
  at every step; a fresh pair of processes restoring 2d's step-4 checkpoint
  ends bit for bit where the uninterrupted run did (its first 4 losses come
  from the checkpoint); the state is laid out over all 4 devices as the
  layout says.

  Both runs sum over devices with gloo: the 1-process run, too, joins
  `jax.distributed` (as 1 of 1 processes), so that its collectives are the
  2-process run's. Without it XLA's in-process all-reduce adds the 4
  devices' partial sums in another order than gloo's ring does: losses then
  differ in the last bit (~5e-7) from the first step, and AdamW turns such
  differences in gradients that are zero but for rounding (the attention
  key bias: softmax ignores it) into updates of the learning rate's size, so
  no tight tolerance on the params would hold.

  The restart's pair of processes joins through `--cluster`
  (`jax.distributed.initialize()` reading Slurm's variables), the other runs
  through sharded_train's --coordinator flags."""
  cache = tmp_path / "compilation-cache"
  cached = ["--cache-every-process"]
  one = _launch(tmp_path, "one", 1, env_of=_cpu_env(4, cache), distributed=True, flags=TINY)
  two = _launch(tmp_path, "two", 2, env_of=_cpu_env(2, cache), distributed=True, flags=TINY,
                worker_flags=cached)
  # The restart: a fresh pair resumes 2d from step 4 (its state sharded over
  # both mesh axes, so each process restores its own blocks; data's
  # replicated state restores through the same calls).
  shutil.rmtree(tmp_path / "checkpoints" / "two" / RESTARTED / "checkpoints" / "sparse"
                / str(STEPS))
  resumed = _launch(tmp_path, "resumed", 2, env_of=_slurm_env(2, 2, cache), distributed=False,
                    layouts=(RESTARTED,), checkpoints="two", worker_flags=cached,
                    flags=TINY + ["--resume", "--cluster"])

  failures = []
  for layout in CPU_LAYOUTS:
    (m1, s1), (m2, s2) = (_results(f, layout) for f in (one, two))
    m1, m2 = ({**m, **m["2:4"]} for m in (m1, m2))
    runs = [(m1, 1), (m2, 2)]
    if m2["losses"] != m1["losses"]:
      failures.append(f"{layout}: 2 processes' losses {m2['losses']} != 1 process's"
                      f" {m1['losses']}")
    failures += [f"{layout}: 2 processes != 1 process: {d}" for d in _differences(s2, s1)]
    if layout == RESTARTED:
      mr, sr = _results(resumed, layout)
      mr = {**mr, **mr["2:4"]}
      runs.append((mr, 2))
      if mr["start_step"] != RESTART or mr["losses"] != m2["losses"]:
        failures.append(f"{layout}: restarted from step {mr['start_step']} (not {RESTART}),"
                        f" losses {mr['losses']} != {m2['losses']}")
      failures += [f"{layout}: restarted != uninterrupted: {d}" for d in _differences(sr, s2)]
    kernels = {name: _padded(spec) for name, spec in KERNEL_SPECS[layout].items()}
    masks = {name: spec[::-1] for name, spec in kernels.items()}  # packed [N, K/8]
    for meta, processes in runs:
      got = (meta["process_count"], meta["device_count"], meta["kernel_devices"],
             _padded(meta["kernel_specs"]), _padded(meta["mask_specs"]))
      if got != (processes, 4, 4, kernels, masks):
        failures.append(f"{layout}: (processes, devices, devices of a kernel, kernels'"
                        f" specs, masks' specs) {got} != {(processes, 4, 4, kernels, masks)}")
  assert not failures, "\n".join(failures)


def _padded(spec):
  """A [K, N] array's spec (or a dict of them) with both axes named."""
  if isinstance(spec, dict):
    return {name: _padded(s) for name, s in spec.items()}
  return (list(spec) + [None, None])[:2]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_processes_compute_what_one_process_does(tmp_path, layout):
  """4 processes x 1 GPU against 1 process x 4 GPUs at the GPU preset, 100
  steps of each run: equal losses; prints the tokens/s of both. Needs
  `XLA_PYTHON_CLIENT_PREALLOCATE=false` (tests/conftest.py sets it unless the
  caller set it): else this pytest process holds 75% of every GPU before the
  runs start."""
  if jax.device_count() < 4:
    pytest.skip(f"needs 4 GPUs, found {jax.device_count()}")
  if os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") != "false":
    pytest.fail("run with XLA_PYTHON_CLIENT_PREALLOCATE=false (or unset; tests/conftest.py then"
                " sets it): this pytest process has already taken 75% of every GPU's memory"
                " for itself.")
  flags = ["--size", "gpu", "--steps", "100", "--eval-every", "100"]
  launch = dict(layouts=(layout,), worker_flags=["--losses-only"], flags=flags, timeout_s=1800)
  # Bit-equal runs need the same kernels in both: XLA's autotuner picks GEMM
  # algorithms by timing them (run to run, the pick can change), and its
  # scatters (the embedding's gradient) add with atomics unless deterministic.
  # The cuSPARSELt algorithms come from one algorithm cache file
  # (`jsparse24.backends._cusparselt_build.algorithm_cache`): the first run
  # records its searches there, the 4 processes read them.
  xla = {"XLA_FLAGS": "--xla_gpu_autotune_level=0 --xla_gpu_deterministic_ops=true"}
  one = _launch(tmp_path, "one", 1, env_of=lambda i, port: xla, distributed=False, **launch)
  four = _launch(tmp_path, "four", 4,
                 env_of=lambda i, port: {**xla, "CUDA_VISIBLE_DEVICES": str(i)},
                 distributed=True, **launch)
  (m1, _), (m4, _) = _results(one, layout), _results(four, layout)
  failures = []
  print(f"\n{'layout':>6} {'run':>5} | {'1 x 4 GPUs tokens/s':>20} {'4 x 1 GPU tokens/s':>19}"
        f" {'ratio':>6} | losses")
  for run in ("dense", "2:4"):
    l1, l4 = np.array(m1[run]["losses"]), np.array(m4[run]["losses"])
    t1, t4 = m1[run]["tokens_per_s"], m4[run]["tokens_per_s"]
    differ = np.flatnonzero(l1 != l4)
    same = ("equal" if np.array_equal(l1, l4) else
            f"max |diff| {np.max(np.abs(l1 - l4)):.3g}, first at loss {differ[0]} of {len(l1)}"
            f" ({l1[differ[0]]!r} against {l4[differ[0]]!r})")
    print(f"{layout:>6} {run:>5} | {t1:>20,.0f} {t4:>19,.0f} {t4 / t1:>6.3f} | {same}")
    if same != "equal":
      failures.append(f"{layout} {run}: losses differ, {same}")
  assert not failures, "\n".join(failures)


def test_flag_errors_name_the_flag_and_the_fix(capsys):
  example = load_example("sharded_train")

  def error(argv):
    with pytest.raises(SystemExit):
      example.main(TINY + argv)
    return capsys.readouterr().err

  assert "--num-processes and --process-id too" in error(["--coordinator", "localhost:1"])
  assert "drop --coordinator, --num-processes, --process-id, or --cluster" in error(
      ["--cluster", "--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "0"])
  assert "--process-id 2 must lie in 0..1" in error(
      ["--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "2"])
  # 8 devices (tests/conftest.py) on the data axis: 6 rows do not split.
  err = error(["--batch", "6"])
  assert "--batch 6 must be a multiple of the 8 devices" in err, err
  assert not jax.distributed.is_initialized()
