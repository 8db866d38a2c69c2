"""Shared benchmark plumbing: timing (`bench`; `threaded` for training steps
that donate their state; `in_turn` for steps compared on a drifting host;
`compile_step`; `kernel_seconds` and `traced_kernels`: GPU kernel time from
a profile), weights in rotation (`rotation`, `rows_per_weight`, `rotated`),
measured ceilings
(`copy_bandwidth`, `dense_peak`), the PyTorch peer (`torch_cuda`,
`torch_bench`), errors (`rel_err`), and the results table under
benchmarks/results/<gpu>.md (`write_section`, `table`, `environment`)."""

from __future__ import annotations

import argparse
import functools
import glob
import gzip
import json
import math
import os
import pathlib
import re
import statistics
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

RESULTS = pathlib.Path(__file__).parent / "results"

# Why the benchmarks time every dense baseline before their process's first
# cuSPARSELt product (the sentence their written results carry).
CUSPARSELT_TAX = ("once a cuSPARSELt matmul (ours, or PyTorch's), or any kernel issuing the"
                  " sparse MMA instruction, has run in a process, that process's compute-bound"
                  " kernels run 2-7% slower until it ends (docs/design_notes.md, \"Dense"
                  " baselines are timed before the first sparse product\"), which a dense run"
                  " in its own process never pays")


ATTENTION_CHOICES = ("auto", "cudnn", "xla")


def attention_implementation(choice: str, cudnn_on_gpu: bool = True) -> str | None:
  """`jax.nn.dot_product_attention`'s `implementation=` for a benchmark's
  `--attention` choice: "auto" is cuDNN's fused attention on a GPU (where
  `cudnn_on_gpu`), else None (XLA's)."""
  if choice == "auto":
    return "cudnn" if cudnn_on_gpu and jax.default_backend() == "gpu" else None
  return choice


def compressed_bytes(k: int, n: int) -> int:
  """Bytes of a 16-bit `Sparse24` of a `[K, N]` weight: values `[N, K/2]`
  and a metadata byte per 8 of K (56.25% of the dense weight's)."""
  return k * n + n * math.ceil(k / 8)


def rotation(nbytes: int, total: float = 200e6, most: int | None = 16) -> int:
  """How many weights of `nbytes` each a timed call multiplies by in turn:
  `total` bytes together (200 MB: 3-4x the L2 cache of an H100 or H200), at
  least 2 and at most `most`. One weight reused call after call is read from
  L2, and one product per call is timed with its call's launch."""
  r = max(2, math.ceil(total / nbytes))
  return r if most is None else min(most, r)


def rows_per_weight(key, m: int, k: int, count: int, dtype=jnp.bfloat16) -> list[jax.Array]:
  """`count` different random `x[m, k]`, one for each weight of a rotation
  (`rotation`), as a model's products each have their own input. XLA's dot
  merger (GPU) merges products of one x by several weights in one program
  into one product over the weights concatenated, sliced apart after: on an
  H200 (2026-12-04, 2048 x 2048 at 8 rows, benchmarks/results/nvidia-h200.md,
  "Decode products: GPU time against wall time") copying the weights together
  took 4.9 of a dense product's 8.9 us."""
  return [jax.random.normal(jax.random.fold_in(key, i), (m, k), dtype) for i in range(count)]


def _int_at_least(text: str, low: int, why: str = "") -> int:
  """`text` as an int >= `low`, else argparse's error (which names the flag)."""
  try:
    value = int(text)
  except ValueError:
    value = low - 1
  if value < low:
    raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= {low}{why}")
  return value


def count(text: str) -> int:
  """argparse `type=` of a flag that takes one int >= 1 (`--batch`,
  `--layers`, ...): a 0 would take the flag's default, or fail far from it
  (a division by zero, a product of no rows). argparse's error names the
  flag: "argument --batch: '0' is not an integer >= 1"."""
  return _int_at_least(text, 1)


def rebuild_period(text: str) -> int:
  """argparse `type=` of `--rebuild-every`: the benchmarks time a step that
  rebuilds no mask, which a period of 1 (every step rebuilds) has none of."""
  return _int_at_least(text, 2, " (with 1 every step rebuilds)")


def counts(p: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
  """A comma-separated list of ints >= 1 (`--widths`, `--ms`, ...), or an
  error through `p` naming `flag`, where int() would raise a bare traceback
  or a 0 fail far from the flag (rows that fail one by one, a division by
  zero)."""
  try:
    values = [int(v) for v in str(text).split(",")]
  except ValueError:
    values = []
  if not values or min(values) < 1:
    p.error(f"{flag} {text!r}: integers >= 1 separated by commas.")
  return values


def rotated(product: Callable) -> Callable:
  """`product(x, w)` over a rotation, jitted: `f(xs, ws)` multiplies each
  `xs[i]` by `ws[i]` (`rows_per_weight`)."""
  return jax.jit(lambda xs, ws: [product(x, w) for x, w in zip(xs, ws)])


def traced_kernels(fn: Callable, *args, calls: int = 3, warmups: int = 1) -> list[dict]:
  """The GPU kernels (`gpu_events`) of `calls` calls of `fn(*args)` (jitted),
  traced by `jax.profiler` after `warmups` untraced ones; none on a CPU."""
  out = None
  for _ in range(warmups):
    out = fn(*args)
  jax.block_until_ready(out)
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for _ in range(calls):
        out = fn(*args)
      jax.block_until_ready(out)
    return gpu_events(trace_dir)


def kernel_seconds(fn: Callable, *args, calls: int = 3) -> float | None:
  """Seconds of GPU kernel time in one call of `fn(*args)` (jitted): the
  durations of its kernels summed (`traced_kernels`), without the idle gaps
  between them that `bench`'s wall time holds; None where no GPU kernel was
  traced (a CPU). A decode step of
  `bench_decode`'s models keeps the GPU busy (its time at most 1.4% over its
  kernels' summed time, d_model 2048 and 4096, batch 1-64; H200,
  2026-12-04), so there a product costs its kernel time; a call of nothing
  but Pallas Mosaic GPU products idled up to 13 us between them (H200,
  2026-12-04, benchmarks/results/nvidia-h200.md, "Decode products: GPU time
  against wall time")."""
  events = traced_kernels(fn, *args, calls=calls)
  if not events:
    return None
  return sum(e.get("dur", 0) for e in events) / 1e6 / calls  # Perfetto's durations are in us


def gpu_name() -> str:
  return jax.devices()[0].device_kind


def gpu_slug(gpu: str | None = None) -> str:
  return re.sub(r"[^a-z0-9]+", "-", (gpu or gpu_name()).lower()).strip("-")


def bench(fn: Callable, *args, min_time: float = 0.05, repeats: int = 7) -> float:
  """Median seconds per call of `fn(*args)` (already jitted), after warm-up.

  Calls are queued asynchronously and the clock stops after the last result
  is ready, so launch overhead is hidden whenever the device is the bottleneck.
  """
  jax.block_until_ready(fn(*args))
  jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  once = max(time.perf_counter() - t0, 1e-6)
  n = max(1, min(1000, int(min_time / once)))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = None
    for _ in range(n):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / n)
  return statistics.median(times)


def copy_bandwidth() -> float:
  """Measured device read+write bandwidth in bytes/s (a 1 GiB bf16 scale)."""
  x = jax.random.normal(jax.random.key(0), (1 << 29,), jnp.bfloat16)
  f = jax.jit(lambda a: a * 2)
  return 2 * x.nbytes / bench(f, x)


def dense_peak(m: int = 16384, k: int = 4096, n: int = 16384) -> float:
  """Measured dense bf16 matmul rate in FLOP/s through XLA."""
  x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(2), (k, n), jnp.bfloat16)
  f = jax.jit(lambda a, b: a @ b)
  return 2 * m * k * n / bench(f, x, w)


def torch_cuda():
  """The torch module if it can run on this GPU, else None."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return torch if torch.cuda.is_available() else None


def torch_bench(fn: Callable, repeats: int = 7) -> float:
  """Median seconds per call of a torch CUDA callable, with CUDA events."""
  import torch  # pylint: disable=g-import-not-at-top
  fn()
  torch.cuda.synchronize()
  start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
  start.record()
  fn()
  end.record()
  torch.cuda.synchronize()
  once = max(start.elapsed_time(end) / 1e3, 1e-6)
  n = max(1, min(1000, int(0.05 / once)))
  times = []
  for _ in range(repeats):
    start.record()
    for _ in range(n):
      fn()
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) / 1e3 / n)
  return statistics.median(times)


def write_section(title: str, body: str, gpu: str | None = None) -> pathlib.Path:
  """Replaces (or appends) the `## title` section of results/<gpu>.md (this
  process's GPU unless `gpu` names another: results measured elsewhere)."""
  RESULTS.mkdir(parents=True, exist_ok=True)
  path = RESULTS / f"{gpu_slug(gpu)}.md"
  text = path.read_text() if path.exists() else f"# Benchmarks on {gpu or gpu_name()}\n"
  section = f"## {title}\n\n{body.rstrip()}\n"
  pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
  text = pattern.sub(lambda _: section + "\n", text) if pattern.search(text) else text.rstrip() + "\n\n" + section
  path.write_text(text)
  return path


def environment() -> str:
  import jaxlib  # pylint: disable=g-import-not-at-top
  torch = torch_cuda()
  return (f"{gpu_name()}, jax {jax.__version__}, jaxlib {jaxlib.__version__}"
          + (f", torch {torch.__version__}" if torch else ", torch not available")
          + f"; run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
          + (f" ({os.environ.get('BENCH_NOTE')})" if os.environ.get("BENCH_NOTE") else ""))


def table(headers: list[str], rows: list[list]) -> str:
  def fmt(v):
    if isinstance(v, float):
      return f"{v:.4g}"
    return str(v)
  lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
  lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
  return "\n".join(lines)


def threaded(step: Callable, params, opt_state, at: Callable | None = None):
  """A callable for `bench`, which calls it again and again with the same
  arguments: it feeds each call of `step(params, opt_state, *args) ->
  (params, opt_state, ...)` the state the previous (donating) call
  returned, passed through `at` first when given (e.g. pinning a step
  count, so that every timed call is the same step). Returns (callable, the
  live state)."""
  state = {"params": params, "opt": opt_state}

  def run(*args):
    opt = state["opt"] if at is None else at(state["opt"])
    state["params"], state["opt"], *_ = step(state["params"], opt, *args)
    return state["params"], state["opt"]  # blocking on these waits for the whole step

  return run, state


def in_turn(runs: dict[str, Callable], *args, rounds: int = 5, min_time: float = 1.0,
            quick: bool = False) -> dict[str, float]:
  """Seconds per call of each of `runs` (callables for `bench`, e.g.
  `threaded` steps), timed one after another `rounds` times (a run of >=
  `min_time` s each), the fastest round of each. Where the host dispatches
  the steps (small models: the host's time per step is the step's), its
  speed drifts by tens of percent over seconds on a shared machine: two
  steps timed minutes apart differ by that drift, two timed in turn see the
  same. The fastest round: drift only slows a round. `quick` (a CPU smoke
  test): one call each."""
  if quick:
    rounds, min_time = 1, 0.0
  best: dict[str, float] = {}
  for _ in range(rounds):
    for name, run in runs.items():
      t = bench(run, *args, min_time=min_time, repeats=1)
      best[name] = min(best.get(name, math.inf), t)
  return best


def timers(quick: bool) -> tuple[Callable, Callable]:
  """(timer, step_timer): `bench` for parts, and for whole training steps
  `bench` in runs of >= 1 s (median of 5), dispatched asynchronously as a
  training loop does. Timed one at a time (a step takes longer than
  `bench`'s default 0.05 s), each step's host dispatch is measured unhidden,
  more of it for the 2:4 step's larger optimizer state (docs/design_notes.md,
  "Steps are timed in runs of at least a second"). `quick` (a CPU smoke
  test): one call each."""
  if quick:
    once = functools.partial(bench, min_time=0.0, repeats=1)
    return once, once
  return bench, functools.partial(bench, min_time=1.0, repeats=5)


def write_json(path: str, obj) -> None:
  """Writes `obj` as JSON (indent 1) to `path`, its folder made if missing,
  and says so: a benchmark's `--json` output."""
  out = pathlib.Path(path)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(obj, indent=1))
  print(f"wrote {out}", flush=True)


def compile_step(step, *args):
  """(the compiled `step` for `args`, seconds its lowering and compilation took)."""
  t0 = time.perf_counter()
  compiled = step.lower(*args).compile()
  return compiled, time.perf_counter() - t0


def rel_err(got, ref) -> float:
  """The relative error of `got` against `ref`, by norm, in float32."""
  got, ref = jnp.asarray(got, jnp.float32), jnp.asarray(ref, jnp.float32)
  return float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))


def gpu_events(path: str) -> list[dict]:
  """The GPU kernels ("X" events of a GPU process) of the Perfetto trace that
  `jax.profiler.trace(path, create_perfetto_trace=True)` wrote under `path`;
  none where no trace or no GPU process is there (a CPU run)."""
  traces = glob.glob(os.path.join(path, "**", "perfetto_trace.json.gz"), recursive=True)
  if not traces:
    return []
  data = json.load(gzip.open(traces[0]))
  events = data["traceEvents"] if isinstance(data, dict) else data
  names = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  return [e for e in events if e.get("ph") == "X" and "GPU" in names.get(e["pid"], "")]


def kernel_category(name: str) -> str:
  """The kind of a GPU kernel, by its name, for the profiles' tables."""
  n = name.lower()
  if "jsparse24_decode" in n:
    return "decode kernel"
  if "sparse_gemm" in n or "xmma_sparse" in n:
    return "sparse gemm"
  if ("nvjet" in n or "gemm_fusion" in n or "cutlass" in n or "sm90_xmma_gemm" in n
      or "gemv" in n):
    return "dense gemm"
  if "cudnn" in n or "flash" in n or "fmha" in n or "sdpa" in n:
    return "attention"
  if "memcpy" in n:
    return "memcpy"
  if "jsparse24" in n or "prune" in n or "compress" in n:
    return "pallas compress"
  if "dynamic_update_slice" in n or "dynamic_slice" in n:
    return "dyn slice/update"
  return "other fusions"
