"""Test setup: 8 fake CPU devices (for pmap / sharding tests), x64 off, the
`gpu` marker skipped where no GPU is present (and on a GPU, without `-m`,
the tests not marked `gpu`), XLA's CPU code unoptimised, one
persistent compilation cache for the whole run, GPU memory taken as needed
(not preallocated), the slowest modules first, and the garbage collector's
thresholds raised.

The cache: on a CPU most of the suite's time is XLA compiling (59 programs,
~85% of `test_bench_model_runs_on_cpu`'s time), and many programs are
compiled again and again: each call of an example's or a benchmark's `main`
builds new jitted closures that JAX's in-memory cache cannot recognise, and
the xdist workers and the subprocesses (`tests/triton_removal.py`) each
compile the programs the others have. A folder made here, in the process
that pytest starts, and named by an environment variable that the workers
and the subprocesses inherit, lets each program compile once per run. JAX
keys an entry on the program and the compile options, so a hit runs what a
compilation would have produced; programs with host callbacks are never
cached, and a custom-partitioned program's key holds its callback's address
(found again only in the process that wrote it). A folder named by the caller
(`JAX_COMPILATION_CACHE_DIR` set before pytest starts) is used instead and
kept.
"""

import atexit
import gc
import os
import shutil
import subprocess
import sys
import tempfile

# Must be set before jax initialises its backends.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# LLVM's optimisation of the CPU code off: the tests' programs run for
# milliseconds, and their compilation is most of the suite's time
# (test_bench_model_runs_on_cpu[dense]: 45 s of CPU time instead of 61-69 s,
# test_pallas_kernels.py, its kernels interpreted, faster too; 2026-11-27 on
# the 2-core CPU machine). The workers and subprocesses inherit it, so
# programs compared across processes are compiled alike.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
# Each program's machine code generated in one piece, not split for threads
# that the two cores, both busy with a test each, cannot run side by side:
# tests/test_sharding.py and test_optim.py in one process took 194.7 and
# 173.5 s of CPU time against 207.6 and 187.6 s (alternating runs,
# 2026-11-28 on the 2-core CPU machine).
if "xla_cpu_parallel_codegen_split_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_cpu_parallel_codegen_split_count=1"
# XLA's CPU fusion emitters off where this jaxlib has the switch (jax 0.10.2
# does, 0.12 dropped it): their fusions take twice as long to compile as the
# older emitters' (test_bench_model_runs_on_cpu[dense]: 26 s instead of 16.5
# s; one launch of tests/multiprocess_worker.py: 20 s of compilation instead
# of 10; 2026-11-27 on the 2-core CPU machine). XLA aborts the process on a
# flag it does not know, hence the question to a child process first.
FUSION_EMITTERS_OFF = "--xla_cpu_use_fusion_emitters=false"


def _xla_knows(flag: str) -> bool:
  """Whether this jaxlib's XLA starts with `flag` in XLA_FLAGS."""
  env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                        capture_output=True, timeout=120, check=False).returncode == 0


if ("xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]
    and _xla_knows(FUSION_EMITTERS_OFF)):
  os.environ["XLA_FLAGS"] += " " + FUSION_EMITTERS_OFF

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _CACHE = tempfile.mkdtemp(prefix="jsparse24-tests-xla-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
  atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
# Every program, however quick to compile: the many small ones add up.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# On a GPU, each process takes device memory as it needs it instead of 75%
# of the GPU at start: `pytest -m gpu -n 8` runs eight workers on one GPU,
# and tests/test_multiprocess.py's GPU test starts runs of its own beside
# the pytest process. A caller's own setting is kept.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Python's cyclic garbage collector runs less often: tracing and lowering
# allocate millions of short-lived objects, and with the default thresholds
# (700, 10, 10) the collector walks the growing heap again and again.
# tests/test_sharding.py and test_optim.py under `-n 2`: 75.9-83.5 s against
# 83.1-88.9 s (alternating runs); the whole suite 484 s against 502 s, the
# same peak memory (12.3 GB over all its processes, 6.5 GB against 6.3 GB the
# largest one); 2026-12-06 on the 2-core CPU machine.
gc.set_threshold(100_000, 50, 1000)

import jax  # noqa: E402
import pytest  # noqa: E402


# The modules whose tests take longest on a CPU, longest first: the one test
# of about a minute (test_multiprocess.py), then by the summed `--durations`
# of their tests (a run of the whole suite on the 2-core CPU machine,
# 2026-12-05). They run first: under `--dist worksteal` the worker that
# finishes early takes over the other's queue from its end, so the run ends
# on short tests instead of one worker waiting for the other's last long one.
SLOWEST_FIRST = ("test_multiprocess.py", "test_examples.py", "test_sharding.py",
                 "test_input_sparse.py", "test_pallas_kernels.py", "test_generate.py",
                 "test_cusparselt.py", "test_optim.py", "test_bench_model.py",
                 "test_triton_fallback.py", "test_stacked.py", "test_bench_layouts.py",
                 "test_sparse_dot.py", "test_bench_sharded.py", "test_cuda_lowering.py",
                 "test_mvue.py", "test_moe.py", "test_prune_format.py")


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
  # A stable sort by module: each module's tests stay together, in order,
  # so a module-scoped fixture is built once per worker.
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
  # On a CPU the `gpu` tests are skipped. On a GPU, without a marker
  # expression, the others are: they are the CPU suite, written for the 8
  # fake CPU devices above, the automatic choice where cuSPARSELt does not
  # run and XLA's float32 CPU product, and on one H100 10 of 399 in six
  # modules failed for those premises alone (nvidia-h100-80gb-hbm3.md, "The
  # small end at d_model 128 again", 2026-12-07).
  on_gpu = jax.default_backend() == "gpu"
  if on_gpu and config.getoption("markexpr"):
    return
  skip = pytest.mark.skip(reason="a CPU test: on a GPU machine run the CPU suite with"
                                 " JAX_PLATFORMS=cpu; the GPU's tests are -m gpu" if on_gpu
                          else "needs an NVIDIA GPU")
  for item in items:
    if ("gpu" in item.keywords) != on_gpu:
      item.add_marker(skip)
