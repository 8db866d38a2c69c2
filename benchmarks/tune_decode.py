"""Checks the decode kernel and sweeps its tile configuration.

    PYTHONPATH=. python benchmarks/tune_decode.py [--budget 240]
    PYTHONPATH=. python benchmarks/tune_decode.py --quick   # the defaults only
    PYTHONPATH=. python benchmarks/tune_decode.py --mma [--cells K:N,...] [--ms 1,4,...,128]
        [--repeat 3] [--one-slice] [--other-rows]

A developer tool (it calls `pallas_kernels` directly, and needs neither
jsparse24 nor Flax): checks `decode24.decode_matmul` against its reference
on odd shapes, then times candidate `DecodeConfig`s at (K, N) = 8192 x 8192
for M = 16 and M = 64 against dense XLA, and prints the best ones at the
four target shapes (4096², 4096 x 16384, 16384 x 4096, 8192²), with the
measured copy bandwidth. Each timed
call multiplies by several weights in turn (one jitted function), together
well over the L2 cache, as the layers of a model do: one weight reused call
after call would be read from L2. Each weight has its own x, as in a model
(`_common.rows_per_weight` says what XLA does to products that share one).
`--quick` times only the defaults at the
four target shapes (M = 1, 16, 32, 64, 128) against the wide tiles.
`--mma` times the sparse-tensor-core kernel (`decode24_mma`, Hopper) against
the Triton kernel's defaults and dense XLA at the (K, N) of `--cells` (by
default the d_model 2048 and 4096 models' products and 8192 x 8192), wall
time and GPU kernel time per product (`_common.kernel_seconds`), and prints
`jsparse24.backends.pallas.DECODE_MMA_MAX_M`'s row: per grid cell, the
longest run of swept Ms where the kernel took at most `MMA_MARGIN` times the
Triton kernel's GPU time (`mma_cell`; wall time where no GPU kernel was
traced). Kernel time, because a model's decode step keeps the GPU busy and
pays that, while the wall time of a call of nothing but these products
holds the gaps between their launches. `--one-slice` also times the kernel
with one K slice where its plan (`decode24_mma.plan`) splits K, against the
plan's; `--other-rows`, from 65 to 128 rows (one pass), with the block of W's rows
(`decode24_mma.block_rows`: 64 or 128) that the kernel does not choose there.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks import _common
from pallas_kernels import decode24, decode24_mma
from pallas_kernels import prune_rule as rule

TARGETS = ((4096, 4096), (4096, 16384), (16384, 4096), (8192, 8192))
ROTATE_BYTES = 400e6


def random_operand(key, k: int, n: int, dtype):
  """Random compressed weight: values `[N, K/2]` and valid metadata."""
  kv, km = jax.random.split(key)
  values = jax.random.normal(kv, (n, k // 2), dtype)
  codes = jnp.asarray([rule.group_code(*p) for p in rule.PAIRS], jnp.int32)
  groups = codes[jax.random.randint(km, (n, 2 * pl_cdiv(k, 8)), 0, 6)]
  meta = rule.byte_of(groups[:, 0::2], groups[:, 1::2]).astype(jnp.uint8)
  if k % 8:  # the last byte's high nibble pads
    meta = meta.at[:, -1].set((meta[:, -1] & 0xF) | (rule.PAD_CODE << 4))
  return values, meta


def pl_cdiv(a: int, b: int) -> int:
  return -(-a // b)


def check(configs) -> None:
  shapes = [(1, 4100, 3000), (3, 1028, 520), (17, 2056, 777), (16, 8192, 8192),
            (64, 4096, 4096), (200, 4096, 1000), (5, 12, 7), (2, 20, 9)]
  failed = []
  for (m, k, n), dtype in itertools.product(shapes, (jnp.bfloat16, jnp.float16, jnp.float32)):
    key = jax.random.key(m * 7 + k + n)
    values, meta = random_operand(key, k, n, dtype)
    x = jax.random.normal(jax.random.fold_in(key, 1), (m, k), dtype)
    w = decode24.expand_reference(values, meta, k).astype(jnp.float32)
    ref = jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    for cfg in [None, *configs] if dtype == jnp.bfloat16 else [None]:
      try:
        got = decode24.decode_matmul(x, values, meta, k=k, config=cfg).astype(jnp.float32)
      except Exception as e:  # pylint: disable=broad-except
        failed.append(f"M={m} K={k} N={n} {jnp.dtype(dtype).name} {cfg}: {str(e)[:200]}")
        print(f"CHECK FAILED {failed[-1]}", flush=True)
        continue
      err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
      tol = 1e-5 if dtype == jnp.float32 else 1e-2
      ok = err < tol and bool(jnp.isfinite(got).all())
      if not ok:
        failed.append(f"M={m} K={k} N={n} {jnp.dtype(dtype).name} {cfg}: error {err:.3g}")
        print(f"CHECK FAILED {failed[-1]}", flush=True)
  print(f"check: {len(failed)} of {len(shapes) * (len(configs) + 3)} cases failed", flush=True)
  return failed


class Point:
  """One (M, K, N): R weights in rotation, each with its own x
  (`_common.rows_per_weight`), dense and compressed."""

  def __init__(self, m: int, k: int, n: int):
    self.m, self.k, self.n = m, k, n
    sparse_bytes = _common.compressed_bytes(k, n)
    self.r = _common.rotation(sparse_bytes, ROTATE_BYTES, most=None)
    key = jax.random.key(k * 31 + n)
    self.ops = [random_operand(jax.random.fold_in(key, i), k, n, jnp.bfloat16)
                for i in range(self.r)]
    self.xs = _common.rows_per_weight(jax.random.fold_in(key, 99), m, k, self.r)
    self.sparse_bytes = sparse_bytes + 2 * (m * k + m * n)
    self.dense_bytes = 2 * (k * n + m * k + m * n)

  def times(self, product, operands, kernel: bool = False):
    """(wall seconds per product, GPU kernel seconds per product or None)
    of `product(x, operand)` over the rotation; the kernel time only with
    `kernel` (`_common.kernel_seconds`)."""
    f = _common.rotated(product)
    wall = _common.bench(f, self.xs, operands) / self.r
    t_kernel = _common.kernel_seconds(f, self.xs, operands) if kernel else None
    return wall, None if t_kernel is None else t_kernel / self.r

  def dense_weights(self) -> list[jax.Array]:
    return [decode24.expand_reference(v, mt, self.k) for v, mt in self.ops]

  def dense(self) -> float:
    return self.times(lambda x, w: x @ w, self.dense_weights())[0]

  def sparse(self, cfg) -> float:
    return self.times(lambda x, op: decode24.decode_matmul(x, *op, k=self.k, config=cfg),
                      self.ops)[0]


def rows_block(m: int) -> int:
  """The `block_m` the tiles of M rows are swept with."""
  return 16 if m <= 16 else 64 if m <= 64 else 128


def candidates(m: int):
  bm = rows_block(m)
  for bn, bk, warps, waves in itertools.product([32, 64, 128], [128, 256, 512], [4, 8], [1, 2]):
    yield decode24.DecodeConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps,
                                num_stages=4 if bk == 128 else 3, waves=waves)


def refine(best):
  for stages, waves in itertools.product([2, 3, 4, 5], [1, 2, 3, 4]):
    yield dataclasses.replace(best, num_stages=stages, waves=waves)


def sweep(point: Point, cands, t_dense: float, deadline: float, tag: str):
  results = []
  for cfg in cands:
    if time.time() > deadline:
      print(f"{tag}: budget reached", flush=True)
      break
    try:
      t = point.sparse(cfg)
    except Exception as e:  # pylint: disable=broad-except
      print(f"{tag} {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
      continue
    results.append((t, cfg))
    print(f"{tag} {t * 1e3:.4f} ms ({t_dense / t:.2f}x) {cfg}", flush=True)
  results.sort(key=lambda r: r[0])
  return results


def quick(bw: float) -> None:
  """The defaults at the four target shapes (M = 1, 16, 32, 64 and 128)
  against the wide tiles (`DecodeConfig(block_m=...)`: column blocks of 64,
  K steps of 256, about two K slices per column block; with 128 rows fitted
  to shared memory as K steps of 128 at 2 stages), where they differ."""
  rows = []
  for (k, n), m in itertools.product(TARGETS, (1, 16, 32, 64, 128)):
    point = Point(m, k, n)
    t_dense = point.dense()
    default = decode24.DecodeConfig.default(m, k, n)
    wide = decode24.DecodeConfig(block_m=rows_block(m))
    for v in (None,) if default == wide else (None, wide):
      t = point.sparse(v)
      rows.append([m, k, n, t_dense * 1e3, t * 1e3, t_dense / t,
                   100 * point.sparse_bytes / t / bw,
                   f"default {str(default)[12:]}" if v is None else "wide"])
      print(rows[-1], flush=True)
    del point
  print(_common.table(["M", "K", "N", "dense ms", "decode ms", "speedup", "% copy bw",
                       "config"], rows))


MMA_CELLS = ((2048, 2048), (2048, 6144), (2048, 8192), (8192, 2048), (4096, 4096),
             (4096, 12288), (4096, 16384), (16384, 4096), (8192, 8192))
GRID = (2048, 4096, 8192, 16384)  # jsparse24.backends.pallas.DECODE_GRID
# A tie within this ratio goes to the sparse-tensor-core kernel. The GPU time
# of one product and plan, timed twice in one process, agreed within 1%, its
# wall time not (4096 x 4096, one row: 7.99 and 8.00 us of GPU time, 13.2-
# 14.4 and 20.5-20.8 us of wall time; H200, 2026-12-04,
# benchmarks/results/nvidia-h200.md, "Decode products: GPU time against wall
# time").
MMA_MARGIN = 1.03


def mma_cell(ms, mma_t, triton_t, margin: float):
  """`DECODE_MMA_MAX_M`'s cell from one cell's timings: the longest run of
  consecutive swept Ms where the sparse-tensor-core kernel took at most
  `margin` times the Triton kernel's time, the run of more rows where two
  are as long: its last M where it starts at the first (an int: 1 to M rows),
  else `(first, last)`; 0 where there is none."""
  best, run = None, []
  for m, a, b in zip(ms, mma_t, triton_t):
    run = run + [m] if a <= margin * b else []
    if run and (best is None or len(run) >= len(best)):
      best = run
  if best is None:
    return 0
  return best[-1] if best[0] == ms[0] else (best[0], best[-1])


def mma(bw: float, cells, ms, repeat: int, one_slice: bool = False,
        other_rows: bool = False) -> None:
  """The sparse-tensor-core kernel against the Triton kernel and dense XLA:
  wall time per product (the median of `repeat` timings, taken in turn) and,
  on a GPU, GPU kernel time per product (the first round's), which decides
  the row. `one_slice`: also the kernel with one K slice where its plan
  takes more (no XLA sum of partial products). `other_rows`: past 64 rows,
  also the kernel with the other block of W's rows."""
  rows, times, basis, slices, blocks = [], {}, "GPU kernel time", [], []
  for (k, n), m in itertools.product(cells, ms):
    point = Point(m, k, n)
    impls = {"dense": (lambda x, w: x @ w, point.dense_weights()),
             "triton": (lambda x, op, k=k: decode24.decode_matmul(x, *op, k=k), point.ops),
             "mma": (lambda x, op, k=k: decode24_mma.decode_matmul(x, *op, k=k), point.ops)}
    split = decode24_mma.default_slices(m, k, n)
    chosen = decode24_mma.block_rows(m, k, n)
    if one_slice and split > 1:
      impls["mma, 1 slice"] = (
          lambda x, op, k=k: decode24_mma.decode_matmul(x, *op, k=k, splits=1), point.ops)
    other = decode24_mma.ROWS + decode24_mma.ROWS_TALL - chosen
    if other_rows and 64 < m <= decode24_mma.PASS_M:
      impls["mma, other rows"] = (
          lambda x, op, k=k, r=other: decode24_mma.decode_matmul(x, *op, k=k, rows=r), point.ops)
    # GPU time from the first round only: it held within 1% where timed twice.
    runs = [{name: point.times(f, ops, kernel=i == 0) for name, (f, ops) in impls.items()}
            for i in range(repeat)]
    wall = {name: statistics.median(r[name][0] for r in runs) for name in impls}
    if any(runs[0][name][1] is None for name in impls):
      kern, basis = dict.fromkeys(impls, float("nan")), "wall time (no GPU kernel traced)"
    else:
      kern = {name: runs[0][name][1] for name in impls}
    by = wall if math.isnan(kern["mma"]) else kern
    rows.append([m, k, n, wall["dense"] * 1e3, wall["triton"] * 1e3, wall["mma"] * 1e3,
                 kern["dense"] * 1e3, kern["triton"] * 1e3, kern["mma"] * 1e3,
                 by["dense"] / by["triton"], by["dense"] / by["mma"],
                 100 * point.sparse_bytes / by["mma"] / bw])
    times[(k, n, m)] = by["mma"], by["triton"]
    if "mma, 1 slice" in impls:
      one = by["mma, 1 slice"]
      slices.append([m, k, n, split, by["mma"] * 1e3, one * 1e3, by["mma"] / one])
    if "mma, other rows" in impls:
      alt = by["mma, other rows"]
      blocks.append([m, k, n, chosen, by["mma"] * 1e3, other, alt * 1e3, by["mma"] / alt])
    print(rows[-1], flush=True)
    del point, impls
  cell = {}
  for k, n in cells:
    cell[(max(g for g in GRID if g <= k), max(g for g in GRID if g <= n))] = mma_cell(
        ms, [times[(k, n, m)][0] for m in ms], [times[(k, n, m)][1] for m in ms], MMA_MARGIN)
  print("Per product: wall ms (a call of R products, over R), GPU kernel ms; the ratios and"
        f" % of copy bandwidth by {basis}.")
  print(_common.table(["M", "K", "N", "dense ms", "Triton ms", "mma.sp ms", "dense kernel ms",
                       "Triton kernel ms", "mma.sp kernel ms", "Triton x dense",
                       "mma.sp x dense", "mma.sp % copy bw"], rows))
  if one_slice:
    print(f"One K slice against the plan's slices, ms by {basis} (> 1: one slice faster):")
    print(_common.table(["M", "K", "N", "plan's slices", "mma.sp ms", "one slice ms",
                         "plan / one slice"], slices))
  if blocks:
    print(f"The block of W's rows the kernel chooses against the other, ms by {basis} (> 1:"
          " the other faster):")
    print(_common.table(["M", "K", "N", "chosen rows", "mma.sp ms", "other rows", "other ms",
                         "chosen / other"], blocks))
  print(f"DECODE_MMA_MAX_M row by {basis} (columns N = 2048 ... 16384, rows K; None: not"
        " swept):")
  for k in GRID:
    print(f"  ({', '.join(str(cell.get((k, n))) for n in GRID)}),  # {k}")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--budget", type=float, default=240.0)
  p.add_argument("--quick", action="store_true",
                 help="only the defaults at the target shapes against the other tiles"
                      " (no checks: tests/test_decode24.py's gpu tests run odd shapes)")
  p.add_argument("--mma", action="store_true",
                 help="the sparse-tensor-core kernel against the Triton kernel (no checks:"
                      " tests/test_decode24.py's gpu tests run it on odd shapes)")
  p.add_argument("--cells", default=",".join(f"{k}:{n}" for k, n in MMA_CELLS),
                 help="--mma: the (K, N) to time, as K:N,...")
  p.add_argument("--ms", default="1,4,8,16,32,64", help="--mma: the rows of x to time")
  p.add_argument("--repeat", type=int, default=1,
                 help="--mma: time each point this many times in turn, report the medians")
  p.add_argument("--one-slice", action="store_true",
                 help="--mma: also time the kernel with one K slice where its plan splits K"
                      " (decode24_mma.plan)")
  p.add_argument("--other-rows", action="store_true",
                 help="--mma: past 64 rows, also time the kernel with the block of W's rows"
                      " it does not choose (decode24_mma.block_rows)")
  args = p.parse_args(argv)
  start = time.time()
  print(_common.environment(), flush=True)
  bw = _common.copy_bandwidth()
  print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
  if args.mma:
    mma(bw, [tuple(map(int, c.split(":"))) for c in args.cells.split(",")],
        [int(m) for m in args.ms.split(",")], args.repeat, args.one_slice, args.other_rows)
    return
  if args.quick:
    quick(bw)
    return
  failed = check([decode24.DecodeConfig(splits=1), decode24.DecodeConfig(block_k=128, splits=3),
                  decode24.DecodeConfig(block_m=64, block_n=128, block_k=512, num_warps=8),
                  decode24.DecodeConfig(block_n=128, splits=1)])
  print(f"[{time.time() - start:.0f}s]", flush=True)
  best = {}
  for m, share in ((16, 0.45), (64, 0.3)):
    point = Point(m, 8192, 8192)
    t_dense = point.dense()
    print(f"M={m} 8192x8192 dense {t_dense * 1e3:.4f} ms; default"
          f" {point.sparse(None) * 1e3:.4f} ms", flush=True)
    deadline = time.time() + args.budget * share
    res = sweep(point, candidates(m), t_dense, deadline - args.budget * share * 0.35, f"M={m}")
    res += sweep(point, refine(res[0][1]), t_dense, deadline, f"M={m} refine")
    res.sort(key=lambda r: r[0])
    best[m] = [cfg for _, cfg in res[:2]]
    del point
  rows = []
  for (k, n), m in itertools.product(TARGETS, (1, 16, 64)):
    point = Point(m, k, n)
    t_dense = point.dense()
    for cfg in [None, *best[16 if m <= 16 else 64]]:
      t = point.sparse(cfg)
      rows.append([m, k, n, t_dense * 1e3, t * 1e3, t_dense / t, point.sparse_bytes / t / 1e9,
                   100 * point.sparse_bytes / t / bw, "default" if cfg is None else str(cfg)])
    del point
  for f in failed:
    print(f"CHECK FAILED {f}")
  print(f"\n[{time.time() - start:.0f}s] copy bandwidth {bw / 1e12:.3f} TB/s; {_common.gpu_name()}")
  print(_common.table(["M", "K", "N", "dense ms", "decode ms", "speedup", "GB/s", "% copy bw",
                       "config"], rows))


if __name__ == "__main__":
  main()
