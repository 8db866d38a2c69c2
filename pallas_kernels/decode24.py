"""`x @ W` for few rows of x (decoding), W 2:4-compressed: split-K (Pallas, Triton).

When M (rows of x) is small, the product is bound by reading W, and reading
the compressed W (values `[N, K/2]` and metadata `uint8[N, ceil(K/8)]`, K
contiguous: jsparse24's `Sparse24` layout, 56% of the dense bytes for bf16)
is the whole gain. `spmm24` gives each program a column block of the output
and the whole of K: at M <= 16 that is N/64 programs, about one per SM, each
with one stream of loads, far too few loads in flight to reach memory
bandwidth. Here the grid also splits K (`splits`): program `(j, s, i)` reads
the `block_n` columns `j` over the `s`-th slice of K and writes a float32
partial product, and one XLA reduction sums the slices (deterministic, unlike
atomic adds: the same inputs give the same bits, which greedy decoding relies
on). Each program expands its compressed tile on chip to a dense
`[block_n, block_k]` tile (`_tiles.expand_rows`) and issues one tensor-core
product per K step (`lane_dots=True`: one per lane of 8 instead, which
measured slower).

For one row of x (`fma`) no tensor-core product runs at all: each
compressed value multiplies, in float32 where it lies in registers, the
element of x that the metadata picks.

Backend: Pallas's Triton lowering (`jax.experimental.pallas.triton`,
deprecated since JAX 0.11), because it is the one this package's kernels,
their shared tile helpers (`_tiles`) and their CPU tests (interpret mode)
are written for; Pallas Mosaic GPU was not tried for this kernel
(docs/mosaic_gpu.md: it lacks the lane splits and joins used here). It
does not reach its targets (1.6x over dense XLA and 80% of copy bandwidth
at M <= 16): on an H200 (2026-11-27) it read the
compressed weight at up to 59% of copy bandwidth at M = 16 (0.92-0.93x of
dense XLA at K x N = 8192 x 8192, 4096 x 16384, 16384 x 4096) and 65% at
M = 1 (0.96x at 8192 x 8192), and ran at half the speed of dense XLA at M = 64:
benchmarks/results/nvidia-h200.md, "decode kernel at the target shapes".
What bounds it is the expansion, not the loads: on the same grid, a kernel
that loads the same compressed tiles and only sums them reads them at up to
99-103% of copy bandwidth (1.57-1.64x faster than dense XLA at M = 16 on
8192 x 8192 and 4096 x 16384), also when it splits the values into their
slots (88-98%); expanding the tiles (`_tiles.expand_rows`: the selects and
the joins that move the tile between register layouts) brings it to 55-65%,
and the product to 52-57%, where this kernel is (57-58%): H200, 2026-11-27,
benchmarks/results/nvidia-h200.md, "What bounds the decode kernel: loads or
the expansion" (`benchmarks/decode_bound.py`).
It does beat what a compressed weight multiplies through otherwise
(decompressed, then XLA's product), which is where the automatic choice
takes it (`DECODE_AUTO_MAX_M` in `jsparse24.backends.pallas`).

Odd shapes need no copy of W: the last blocks along N and K are loaded with
masks (`ragged` loads), so the weight is read in place whatever K and N are.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _tiles
from pallas_kernels import prune_rule as rule

# Streaming multiprocessors of the GPUs the defaults were tuned on (H100 and
# H200 SXM: 132), for the number of K slices that keeps each one busy.
_SMS = 132
# Shared memory the pipelined tiles may take (Hopper allows 227 KiB a block;
# the rest is left to Triton's own buffers, e.g. for layout conversions).
_SMEM_BUDGET = 160 * 1024
# The most rows of x the `fma` variant takes: its work grows with each row,
# and from 2 rows on the tensor-core tiles measured faster (H200,
# 2026-11-27, `benchmarks/tune_decode.py --quick`).
FMA_MAX_M = 1


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Tiles of the decode kernel (block sizes powers of two).

  `splits`: slices of K (None: enough for `waves` programs per SM);
  `block_k` a multiple of 128 (each lane's product is `block_k / 8` deep,
  at least 16).
  """

  block_m: int = 16
  block_n: int = 64
  block_k: int = 256
  splits: int | None = None
  waves: int = 4
  num_warps: int = 4
  num_stages: int = 3
  # True: one product per lane of 8 (no expanded tile is interleaved in
  # registers); False: the tile expanded to `[block_n, block_k]` and one
  # product per K step (faster on an H200: benchmarks/results/nvidia-h200.md,
  # "decode kernel at the target shapes").
  lane_dots: bool = False
  # True (M <= FMA_MAX_M): no tensor-core product at all; each row of x
  # multiplies the compressed values in float32 where they lie, with x's
  # elements picked by the metadata, so no expanded tile is ever moved
  # between register layouts (which the tensor-core products need).
  fma: bool = False

  @classmethod
  def default(cls, m: int, k: int, n: int) -> "DecodeConfig":
    """The fastest tiles `benchmarks/tune_decode.py` found on an H200
    (2026-11-27) at 8192 x 8192: M = 1 from `--quick`, 2-16 from the sweep
    at M = 16 (and `--quick` at M = 2 and 4), 17-64 from the sweep at
    M = 64; above 64 untuned (the kernel ran at half the speed
    of dense XLA from M = 64 on: benchmarks/results/nvidia-h200.md)."""
    del k, n
    if m <= FMA_MAX_M:
      return cls(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4, fma=True)
    if m <= 16:
      return cls(block_m=16, block_n=32, block_k=256, num_warps=4, num_stages=4)
    if m <= 64:
      return cls(block_m=64, block_n=32, block_k=512, num_warps=4, num_stages=2, waves=1)
    return cls(block_m=128, block_n=64, block_k=256, num_warps=8, num_stages=3, waves=1)


def _smem_bytes(bm: int, bn: int, bk: int, stages: int, itemsize: int) -> int:
  """Shared memory of the pipelined loads: x, values and metadata tiles per stage."""
  return stages * (bm * bk * itemsize + bn * (bk // 2) * itemsize + bn * (bk // 8))


def _plan(config: DecodeConfig, m: int, k: int, n: int,
          itemsize: int) -> tuple[DecodeConfig, int, int]:
  """The config fitted to the shape: `(config, splits, steps per split)`.
  Fewer stages, then a smaller `block_k`, where the pipelined tiles would
  not fit in shared memory (Hopper: 227 KiB a block; float32 tiles are
  twice the size of the 16-bit ones the defaults are tuned for)."""
  if config.fma and m > FMA_MAX_M:
    raise ValueError(f"decode_matmul: fma=True takes M <= {FMA_MAX_M} rows of x, got M = {m}.")
  # fma: the rows are unrolled, and the grid has one block of them.
  bm = m if config.fma else min(config.block_m, max(16, pl.next_power_of_2(m)))
  bn = min(config.block_n, max(16, pl.next_power_of_2(n)))
  bk = min(config.block_k, max(128, pl.next_power_of_2(k)))
  stages = config.num_stages
  while _smem_bytes(bm, bn, bk, stages, itemsize) > _SMEM_BUDGET and stages > 2:
    stages -= 1
  while _smem_bytes(bm, bn, bk, stages, itemsize) > _SMEM_BUDGET and bk > 128:
    bk //= 2
  cfg = dataclasses.replace(config, block_m=bm, block_n=bn, block_k=bk, num_stages=stages)
  steps = pl.cdiv(k, bk)
  splits = config.splits
  if splits is None:
    blocks = pl.cdiv(n, bn) * pl.cdiv(m, bm)
    splits = max(1, min(steps, pl.cdiv(config.waves * _SMS, blocks)))
  splits = max(1, min(splits, steps))
  per = pl.cdiv(steps, splits)
  return cfg, pl.cdiv(steps, per), per


def _decode_kernel(x_ref, values_ref, meta_ref, o_ref, *, m: int, k: int, n: int,
                   block_m: int, block_n: int, block_k: int, per: int, ragged_k: bool,
                   lane_dots: bool, fma: bool):
  j, s, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  n0 = pl.multiple_of(j * block_n, block_n)
  m0 = pl.multiple_of(i * block_m, block_m)
  rows_m = m0 + jax.lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
  ragged_n = n % block_n != 0
  # float32 inputs: full-precision products (Triton's default is TF32).
  precision = jax.lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None
  zero = jnp.zeros((), values_ref.dtype)

  def load(ref, rows, r0, rows_bound, ragged_rows, c0, width, cols_bound, other):
    """A `[rows, width]` tile at (r0, c0), masked where it can pass the
    bounds (statically known not to elsewhere)."""
    mask = None
    if ragged_rows:
      mask = r0 + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) < rows_bound
    if ragged_k:
      cols = c0 + jax.lax.broadcasted_iota(jnp.int32, (1, width), 1) < cols_bound
      mask = cols if mask is None else mask & cols
    block = ref.at[pl.ds(r0, rows), pl.ds(c0, width)]
    if mask is None:
      return pltriton.load(block)
    return pltriton.load(block, mask=mask, other=other)

  def fma_body(t, accs):
    step = s * per + t
    k0 = pl.multiple_of(step * block_k, block_k)
    v0 = pl.multiple_of(step * (block_k // 2), block_k // 2)
    c0 = pl.multiple_of(step * (block_k // 8), block_k // 8)
    values = load(values_ref, block_n, n0, n, ragged_n, v0, block_k // 2, k // 2, 0)
    meta = load(meta_ref, block_n, n0, n, ragged_n, c0, block_k // 8, meta_ref.shape[1],
                rule.PAD_BYTE)
    slots = [v.astype(jnp.float32) for v in _tiles.split_lanes(values, 4)]
    codes = rule.byte_codes(meta.astype(jnp.int32))
    accs = list(accs)
    for r in range(block_m):
      # One row of x: 8 lanes [1, block_k / 8], broadcast along N.
      x = load(x_ref, 1, r, m, False, k0, block_k, k, 0).astype(jnp.float32)
      xs = _tiles.split_lanes(x, 8)
      for g, code in enumerate(codes):
        i0, i1 = rule.code_indices(code)  # i0 in 0-2, i1 in 1-3
        x0, x1, x2, x3 = xs[4 * g:4 * g + 4]
        first = jnp.where(i0 == 0, x0, jnp.where(i0 == 1, x1, x2))
        second = jnp.where(i1 == 3, x3, jnp.where(i1 == 2, x2, x1))
        accs[r] = accs[r] + slots[2 * g] * first + slots[2 * g + 1] * second
    return tuple(accs)

  if fma:
    accs = jax.lax.fori_loop(
        0, per, fma_body,
        tuple(jnp.zeros((block_n, block_k // 8), jnp.float32) for _ in range(block_m)))
    cols = n0 + jax.lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
    for r, acc in enumerate(accs):
      y = jnp.sum(acc, axis=1)[None, :]  # [1, block_n]
      mask = cols < n if ragged_n else None
      if len(o_ref.shape) == 2:
        pltriton.store(o_ref.at[pl.ds(r, 1), pl.ds(n0, block_n)], y.astype(o_ref.dtype),
                       mask=mask)
      else:
        pltriton.store(o_ref.at[pl.ds(s, 1), pl.ds(r, 1), pl.ds(n0, block_n)],
                       y.astype(o_ref.dtype)[None], mask=None if mask is None else mask[None])
    return

  def body(t, acc):
    step = s * per + t
    k0 = pl.multiple_of(step * block_k, block_k)
    v0 = pl.multiple_of(step * (block_k // 2), block_k // 2)
    c0 = pl.multiple_of(step * (block_k // 8), block_k // 8)
    x = load(x_ref, block_m, m0, m, m % block_m != 0, k0, block_k, k, 0)
    values = load(values_ref, block_n, n0, n, ragged_n, v0, block_k // 2, k // 2, 0)
    # Padding bytes decode to a valid pair (0, 1) of zero weights.
    meta = load(meta_ref, block_n, n0, n, ragged_n, c0, block_k // 8, meta_ref.shape[1],
                rule.PAD_BYTE)
    if not lane_dots:
      w_t = _tiles.expand_rows(values, meta)  # [block_n, block_k]
      return acc + jnp.dot(x, w_t.T, precision=precision, preferred_element_type=jnp.float32)
    xs = _tiles.split_lanes(x, 8)  # lane l: columns k0 + l, k0 + l + 8, ...
    slots = _tiles.split_lanes(values, 4)  # first, second of the even group; of the odd
    for g, code in enumerate(rule.byte_codes(meta.astype(jnp.int32))):
      i0, i1 = rule.code_indices(code)  # i0 < i1: lane 0 can only be first, 3 second
      first, second = slots[2 * g], slots[2 * g + 1]
      lanes = (jnp.where(i0 == 0, first, zero),
               jnp.where(i0 == 1, first, jnp.where(i1 == 1, second, zero)),
               jnp.where(i0 == 2, first, jnp.where(i1 == 2, second, zero)),
               jnp.where(i1 == 3, second, zero))
      for l, lane in enumerate(lanes):
        acc = acc + jnp.dot(xs[4 * g + l], lane.T, precision=precision,
                            preferred_element_type=jnp.float32)
    return acc

  acc = jax.lax.fori_loop(0, per, body, jnp.zeros((block_m, block_n), jnp.float32))
  mask = rows_m < m
  if ragged_n:
    mask = mask & (n0 + jax.lax.broadcasted_iota(jnp.int32, (1, block_n), 1) < n)
  if len(o_ref.shape) == 2:
    pltriton.store(o_ref.at[pl.ds(m0, block_m), pl.ds(n0, block_n)], acc.astype(o_ref.dtype),
                   mask=mask)
  else:
    pltriton.store(o_ref.at[pl.ds(s, 1), pl.ds(m0, block_m), pl.ds(n0, block_n)],
                   acc.astype(o_ref.dtype)[None], mask=mask[None])


@functools.partial(jax.jit, static_argnames=("k", "config", "interpret"))
def decode_matmul(x: jax.Array, values: jax.Array, meta: jax.Array, *, k: int,
                  config: DecodeConfig | None = None, interpret: bool = False) -> jax.Array:
  """`x[M, K] @ W[K, N]` with W given compressed (values `[N, K/2]`, meta
  `uint8[N, ceil(K/8)]`): float32 accumulation, output in x's dtype.

  Any M, N and K (K a multiple of 4), read in place (no padded copy of W).
  Meant for few rows (its defaults are tuned up to M = 64); `spmm24.sparse_matmul`
  is the kernel for larger M.
  """
  m, n = _tiles.check_operands("decode_matmul", x, values, meta, k)
  if not m or not n:
    return jnp.zeros((m, n), x.dtype)
  cfg, splits, per = _plan(config or DecodeConfig.default(m, k, n), m, k, n,
                           jnp.dtype(x.dtype).itemsize)
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  # One slice writes y itself; several write float32 partial products.
  out_shape = (m, n) if splits == 1 else (splits, m, n)
  out_dtype = x.dtype if splits == 1 else jnp.float32
  out = pl.pallas_call(
      functools.partial(_decode_kernel, m=m, k=k, n=n, block_m=bm, block_n=bn, block_k=bk,
                        per=per, ragged_k=splits * per * bk != k, lane_dots=cfg.lane_dots,
                        fma=cfg.fma),
      out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype),
      grid=(pl.cdiv(n, bn), splits, pl.cdiv(m, bm)),
      compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps,
                                              num_stages=cfg.num_stages),
      interpret=interpret,
      name="jsparse24_decode",
  )(x, values, meta)
  return out if splits == 1 else jnp.sum(out, axis=0).astype(x.dtype)


def expand_reference(values: jax.Array, meta: jax.Array, k: int) -> jax.Array:
  """The dense `W[K, N]` of compressed values `[N, K/2]` and metadata
  `uint8[N, ceil(K/8)]`, in plain `jnp` (the codes of `prune_rule`)."""
  n = values.shape[0]
  pairs = values.reshape(n, k // 4, 2)
  low, high = rule.byte_codes(meta.astype(jnp.int32))
  codes = jnp.stack([low, high], axis=-1).reshape(n, -1)[:, :k // 4]
  i0, i1 = rule.code_indices(codes)
  pos = jnp.arange(4)
  dense = jnp.where(pos == i0[..., None], pairs[..., :1],
                    jnp.where(pos == i1[..., None], pairs[..., 1:], jnp.zeros((), values.dtype)))
  return dense.reshape(n, k).T


def decode_matmul_reference(x: jax.Array, values: jax.Array, meta: jax.Array, *,
                            k: int) -> jax.Array:
  """`decode_matmul` in plain `jnp`: the expanded weight, one product
  accumulated in float32 (full precision), in x's dtype."""
  w = expand_reference(values, meta, k)
  return jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST,
                 preferred_element_type=jnp.float32).astype(x.dtype)
