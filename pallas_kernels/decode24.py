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
`[block_n, block_k]` tile and issues one tensor-core product per K step.

The expansion decides the speed, not the loads: on the same grid, loading
the compressed tiles and only summing them reads them at 94-103% of copy
bandwidth, and expanding them with selects (`_tiles.expand_rows`) brought
the kernel to 57-63% (benchmarks/results/nvidia-h200.md, "What bounds the
decode kernel: loads or the expansion"). 16-bit weights are therefore read
as 32-bit pairs (the values array reinterpreted, no copy) and expanded by
two PTX byte permutes per group (`_prmt`). On an H100 at its defaults the
kernel then reads the compressed weight at 80-84% of copy bandwidth at
M = 1 and 16 on 8192 x 8192, 16384 x 4096 and 4096 x 16384 (1.48-1.63x
dense XLA), 43-56% on 4096 x 4096 (0.90-1.19x: 13-15 us, where the launches
and the reduction of the slices weigh), 56-62% at M = 64 on the three large
shapes (1.15-1.26x), and 0.82-0.97x of dense XLA at M = 128
(benchmarks/results/nvidia-h100-80gb-hbm3.md, "Decode kernel: K steps of
128 from 17 to 128 rows and where N > K", 2026-11-28). On an H200, whose
memory is faster, the same tiles at M = 64 ran at 0.70-0.95x of dense XLA,
bound on chip: L1/shared memory 86% busy and DRAM 29% at 4096 x 16384, where
M = 16 had DRAM 52% busy (benchmarks/results/nvidia-h200.md, "Decode:
`bench_decode --profile`, and the weight as the first operand of the
product", 2026-12-03). float32 weights keep the select expansion.

Backend: Pallas's Triton lowering (`jax.experimental.pallas.triton`,
deprecated since JAX 0.11), because this package's kernels, their shared
tile helpers and their CPU tests (interpret mode) are written for it, and
because its inline PTX is what the expansion needs; Pallas Mosaic GPU has
no lowering for the lane splits and joins used here. On Hopper, up to 16
rows, `decode24_mma` (Pallas Mosaic GPU) multiplies the same arrays on the
sparse tensor cores without expanding them, 1.13-1.25x faster than this
kernel on the large shapes (H200, 2026-12-04); this kernel keeps more rows,
float32, shapes that one does not take (K not a multiple of 1024) and GPUs
before Hopper. Rebuilding the dense tile in Mosaic GPU instead (warpgroup
products, the weight rebuilt by selects) ran at 0.86-0.91x of dense XLA
(benchmarks/results/nvidia-h200.md, "Decode on Pallas Mosaic GPU",
2026-12-04; docs/mosaic_gpu.md).

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

from pallas_kernels import _prmt, _tiles
from pallas_kernels import prune_rule as rule

# Streaming multiprocessors of the GPUs the defaults were tuned on (H100 and
# H200 SXM: 132), for the number of K slices that keeps each one busy.
_SMS = 132
# Shared memory the pipelined tiles may take (Hopper allows 227 KiB a block;
# the rest is left to Triton's own buffers, e.g. for layout conversions).
_SMEM_BUDGET = 160 * 1024


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
  """Tiles of the decode kernel (block sizes powers of two, `block_k` at
  least 128: the pairs and metadata tiles are `block_k / 4` and
  `block_k / 8` wide).

  `splits`: slices of K (None: about `waves` programs per SM, rounded down
  to a divisor of the K steps where one is near, so that no slice is
  ragged).
  """

  block_m: int = 16
  block_n: int = 64
  block_k: int = 256
  splits: int | None = None
  waves: int = 2
  num_warps: int = 4
  num_stages: int = 3

  @classmethod
  def default(cls, m: int, k: int, n: int) -> "DecodeConfig":
    """Tiles from `benchmarks/tune_decode.py` on an H100 (2026-11-28, the
    four target shapes at M = 1, 16, 32, 64 and 128;
    benchmarks/results/nvidia-h100-80gb-hbm3.md, "Decode kernel: K steps
    of 128 from 17 to 128 rows and where N > K") and, where N > K up to 32
    rows, on an H200 at a d_model 4096 model's shapes
    (benchmarks/results/nvidia-h200.md, "Decode: where the step's time
    goes, and the kernel's tiles where N > K", 2026-12-03; not re-measured
    on an H100).

    Where N > K (e.g. 4096 x 12288 and 4096 x 16384), up to 32 rows: K
    steps of 256 at three stages, all of K per program where the column
    blocks balance over the SMs (`_balanced`): on the H200 1.37-1.52x of
    dense XLA at M = 1-16 where K steps of 128 at four stages ran at
    1.06-1.46x (4096 x 12288: 192 blocks of 64 columns leave 60 SMs two
    and 72 one, so blocks of 32 there). From 33 to 64 rows: K steps of
    128, four stages, all of K per program (1.26x on the H100 at 4096 x
    16384, against 0.79x with the wide tiles below). The expanded
    `[block_n, block_k]` weight tile and x's `[block_m, block_k]` tile
    live in registers together, so more rows want shorter K steps: with
    64 rows, K steps of 256 ran at 0.79-0.85x of dense XLA, K steps of
    128 at 1.04-1.19x (two K slices per column block where N <= K).
    Up to 16 rows, where K >= N and K >= 8192: column blocks of 32 with
    all of K per program (`block_n=32, block_k=512, waves=1`; 80-87% of
    copy bandwidth); elsewhere up to 32 rows column blocks of 64, K steps
    of 256 and about two K slices per block (at 4096 x 4096, M = 1, one
    short program per SM ran at 0.89x of dense XLA against 1.22x on an
    H200). Above 64 rows, where N <= K: 128 x 128 output tiles, K steps of
    128, 3 stages, 8 warps (0.88-0.97x of dense XLA at M = 128, against
    0.55-0.85x with 128 x 64 tiles at 2 stages, which are kept where N > K:
    0.81x against 0.75x). 128-row tiles with K steps of 256 do not fit in
    shared memory at 16 bits (164 KiB at 2 stages): `_plan` would fit them
    to K steps of 128."""
    if n > k and m <= 32:
      block_n, splits = _balanced(m, n)
      return cls(block_m=16 if m <= 16 else 32, block_n=block_n, splits=splits)
    if n > k and m <= 64:
      return cls(block_m=64, block_k=128, num_stages=4, waves=1)
    if m <= 16:
      return cls(block_n=32, block_k=512, waves=1) if k >= max(n, 8192) else cls()
    if m <= 32:
      return cls(block_m=32)
    if m <= 64:
      return cls(block_m=64, block_k=128, num_stages=4)
    if n > k:
      return cls(block_m=128, block_n=64, block_k=128, num_warps=8, num_stages=2, waves=1)
    return cls(block_m=128, block_n=128, block_k=128, num_warps=8, waves=1)


def _balanced(m: int, n: int) -> tuple[int, int]:
  """`(block_n, splits)` for N > K: column blocks of 64 with all of K each,
  unless narrower blocks (up to 16 rows) or two K slices (more rows: blocks
  of 32 ran at 0.65-1.0x of dense XLA at M = 32) spread the work more evenly
  over the SMs. A program's work is `block_n / splits` and the busiest SM
  runs `ceil(programs / SMs)` of them; ties keep the earlier option (wide
  blocks, no reduction of K slices). On an H200, 4096 x 12288 at M = 1-16:
  blocks of 32 1.39-1.47x of dense XLA, of 64 1.14-1.20x, of 64 in two K
  slices 1.32-1.36x; at 4096 x 16384 blocks of 64 1.39-1.50x, of 32
  1.35-1.45x."""
  options = ((64, 1), (32, 1), (64, 2)) if m <= 16 else ((64, 1), (64, 2))
  return min(options, key=lambda o: pl.cdiv(pl.cdiv(n, o[0]) * o[1], _SMS) * o[0] / o[1])


def _smem_bytes(bm: int, bn: int, bk: int, stages: int, itemsize: int) -> int:
  """Shared memory of the pipelined loads: x, values and metadata tiles per stage."""
  return stages * (bm * bk * itemsize + bn * (bk // 2) * itemsize + bn * (bk // 8))


def _splits(steps: int, target: int) -> int:
  """`target` slices of `steps` K steps, or the largest divisor of `steps`
  below it when that keeps at least half as many (whole slices need no
  masked loads)."""
  target = max(1, min(target, steps))
  divisor = max(d for d in range(1, target + 1) if steps % d == 0)
  return divisor if 2 * divisor >= target else target


def _plan(config: DecodeConfig, m: int, k: int, n: int,
          itemsize: int) -> tuple[DecodeConfig, int, int]:
  """The config fitted to the shape: `(config, splits, steps per split)`.
  Fewer stages, then a smaller `block_k`, then a narrower `block_n`, where
  the pipelined tiles would not fit in shared memory (Hopper: 227 KiB a
  block; float32 tiles are twice the size of the 16-bit ones the defaults
  are tuned for: 128 x 128 output tiles in float32 need 196 KiB at two
  stages and K steps of 128)."""
  if config.block_k < 128:
    raise ValueError(f"decode_matmul: DecodeConfig.block_k must be at least 128, got"
                     f" {config.block_k}.")
  bm = min(config.block_m, max(16, pl.next_power_of_2(m)))
  bn = min(config.block_n, max(16, pl.next_power_of_2(n)))
  # At least 128: pairs tiles of 32 words and metadata tiles of 16 bytes a row.
  bk = min(config.block_k, max(128, pl.next_power_of_2(k)))
  stages = config.num_stages
  while _smem_bytes(bm, bn, bk, stages, itemsize) > _SMEM_BUDGET and stages > 2:
    stages -= 1
  while _smem_bytes(bm, bn, bk, stages, itemsize) > _SMEM_BUDGET and bk > 128:
    bk //= 2
  while _smem_bytes(bm, bn, bk, stages, itemsize) > _SMEM_BUDGET and bn > 16:
    bn //= 2
  cfg = dataclasses.replace(config, block_m=bm, block_n=bn, block_k=bk, num_stages=stages)
  steps = pl.cdiv(k, bk)
  splits = config.splits
  if splits is None:
    blocks = pl.cdiv(n, bn) * pl.cdiv(m, bm)
    splits = _splits(steps, pl.cdiv(config.waves * _SMS, blocks))
  splits = max(1, min(splits, steps))
  per = pl.cdiv(steps, splits)
  return cfg, pl.cdiv(steps, per), per


def _decode_kernel(x_ref, w_ref, meta_ref, o_ref, *, m: int, k: int, n: int,
                   block_m: int, block_n: int, block_k: int, per: int, ragged_k: bool,
                   pairs: bool, interpret: bool):
  """`w_ref`: uint32 pairs `[N, K/4]` (`pairs`: 16-bit weights) or the
  values `[N, K/2]` (float32)."""
  j, s, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  n0 = pl.multiple_of(j * block_n, block_n)
  m0 = pl.multiple_of(i * block_m, block_m)
  rows_m = m0 + jax.lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
  ragged_n = n % block_n != 0
  # float32 inputs: full-precision products (Triton's default is TF32).
  precision = jax.lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None
  per_w = 4 if pairs else 2  # weights per element of w_ref

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

  def body(t, acc):
    step = s * per + t
    k0 = pl.multiple_of(step * block_k, block_k)
    w0 = pl.multiple_of(step * (block_k // per_w), block_k // per_w)
    c0 = pl.multiple_of(step * (block_k // 8), block_k // 8)
    x = load(x_ref, block_m, m0, m, m % block_m != 0, k0, block_k, k, 0)
    w = load(w_ref, block_n, n0, n, ragged_n, w0, block_k // per_w, k // per_w, 0)
    # Padding bytes decode to a valid pair (0, 1) of zero weights.
    meta = load(meta_ref, block_n, n0, n, ragged_n, c0, block_k // 8, meta_ref.shape[1],
                rule.PAD_BYTE)
    if pairs:
      # Even and odd groups: a meta byte's low and high nibble.
      even, odd = _tiles.split_lanes(w, 2)
      meta = meta.astype(jnp.uint32)
      lanes = (_prmt.expand_group(even, meta, False, x_ref.dtype, interpret)
               + _prmt.expand_group(odd, meta, True, x_ref.dtype, interpret))
      w_t = _tiles.join_lanes(lanes)  # [block_n, block_k]
    else:
      w_t = _tiles.expand_rows(w, meta)
    return acc + jnp.dot(x, w_t.T, precision=precision, preferred_element_type=jnp.float32)

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
  `values` may have rows after its N (N is meta's): they are not read, so a
  buffer holding other data after the values (cuSPARSELt's metadata) is
  multiplied without a copy. Meant for few rows (its defaults are tuned up to
  M = 64); `spmm24.sparse_matmul` is the kernel for larger M.
  """
  m, n = _tiles.check_operands("decode_matmul", x, values, meta, k, rows_after_n=True)
  if not m or not n:
    return jnp.zeros((m, n), x.dtype)
  itemsize = jnp.dtype(x.dtype).itemsize
  cfg, splits, per = _plan(config or DecodeConfig.default(m, k, n), m, k, n, itemsize)
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  pairs = itemsize == 2
  # A group's two 16-bit values as one 32-bit word (a bitcast: no copy of W).
  w = (jax.lax.bitcast_convert_type(values.reshape(values.shape[0], k // 4, 2), jnp.uint32)
       if pairs else values)
  # One slice writes y itself; several write float32 partial products.
  out_shape = (m, n) if splits == 1 else (splits, m, n)
  out_dtype = x.dtype if splits == 1 else jnp.float32
  out = pl.pallas_call(
      functools.partial(_decode_kernel, m=m, k=k, n=n, block_m=bm, block_n=bn, block_k=bk,
                        per=per, ragged_k=splits * per * bk != k, pairs=pairs,
                        interpret=interpret),
      out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype),
      grid=(pl.cdiv(n, bn), splits, pl.cdiv(m, bm)),
      compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps,
                                              num_stages=cfg.num_stages),
      interpret=interpret,
      name="jsparse24_decode",
  )(x, w, meta)
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
