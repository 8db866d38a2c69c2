"""`x @ W` for up to 256 rows of x on the sparse tensor cores (Pallas Mosaic GPU).

The same product as `decode24.decode_matmul` (its reference,
`decode24.decode_matmul_reference`, is this kernel's), on the same arrays: a
`Sparse24`'s values `[N, K/2]` and metadata `uint8[N, K/8]`, read in place.
Where `decode24` expands each compressed tile to a dense one on chip and
multiplies it on the dense tensor cores, this kernel hands the compressed
values and their codes to `mma.sp` (PTX's warp-level sparse product,
`m16n8k32`), which takes a 2:4 operand as it is stored: nothing is expanded.
The weight is the sparse operand `A` (rows: output features), x the dense `B`
(its rows: columns of the `n8` tile, M padded to a multiple of 8), so one row
of x costs the same as eight.

**Why Mosaic GPU.** The loads decide a decode kernel's speed once nothing is
expanded: persistent CTAs copying K steps of 1024 by TMA in a pipeline that
never drains streamed the compressed weight as fast as dense XLA streams the
dense one (benchmarks/results/nvidia-h200.md, "Decode on Pallas Mosaic GPU",
2026-12-04), faster than Triton's pipelined loads. Pallas Mosaic GPU has no
sparse product on Hopper (its `wgmma` has no sparse form), so the product is
written in PTX through `plgpu.inline_mgpu`, which hands the kernel the
shared-memory tiles as memrefs and each thread's registers, so that every
thread loads exactly the fragment `mma.sp` wants of it. Pallas's Triton
lowering cannot do that: its layouts place elements in threads as it sees fit.

**The layout in shared memory.** Each CTA owns blocks of 64 rows of W (4 tiles
of 16; 128, 8 tiles, past 64 rows of x on a weight of 2^26 elements or more,
`block_rows`) and walks K in steps of 1024 (`K_STEP`; 512 past 16 rows of x,
`K_STEP_WIDE`, and 256 past 64, `K_STEP_TALL`, so that two stages of x's
tile fit beside the weight's). Up to 16 rows its four warps split each
step's K four ways and all own the 4 row tiles, so a warp's x fragment
serves four products; past 16 (`warps`) each warp takes 16 rows of x, so
that its accumulators stay at 32 registers, and K is split the two ways
(17-32 rows) or the one way (33-64) left; past 64 each warp takes 24 or 32
rows (64 accumulator registers, 128 with blocks of 128 rows of W). TMA
copies each step's tiles swizzled: the values as uint32 pairs `[rows, step
/ 4]` (a group's two 16-bit values, as `_prmt` reads them) and x `[8 ..
128, step]` in 128-byte swizzle, the codes `uint8[rows, step / 8]` in 128-,
64- or 32-byte swizzle (steps of 1024, 512, 256); with the swizzle the 8
row groups of a warp read 8 different banks. For `mma.sp`'s `A`, thread
`(g, t)` (lane `4g + t`) holds groups `t` and `t + 4` of rows `g` and `g + 8`
of its 16-row tile: four 32-bit loads. Its metadata register holds the codes
of row `g` (low half) and `g + 8` (high half), 16 bits each: the codes of
groups `4h .. 4h + 3` (h = t % 2), exactly two bytes of `Sparse24`'s metadata
(NVIDIA's code convention is jsparse24's, `prune_rule`). With sparsity
selector 0 threads t = 0, 1 supply the metadata and with selector 1 threads
t = 2, 3 do, so each thread builds one register for two row tiles (one
`prmt` of two 32-bit loads) and every loaded byte is used.

**Splitting the work.** Work units are (block of W's rows, slice of K); a CTA
runs one pipeline over the K steps of its units (`plan`: as many CTAs as the
units divide into, at most one per SM). Where a K slice ends, the partial
sums of the warps that split K meet in shared memory and each thread writes
its outputs; with one slice per block the kernel writes y itself, with
several it writes float32 partial products that one XLA reduction sums
(deterministic: no atomic adds).

**Measured** (one H200, jax 0.11.2, 2026-12-04 19:01 UTC;
benchmarks/results/nvidia-h200.md, "Decode on the sparse tensor cores up to
64 rows"; `benchmarks/tune_decode.py --mma`): on 8192 x 8192, 4096 x 16384
and 16384 x 4096 it ran 1.52-1.69x as fast as dense XLA at M = 1-16
(reading the compressed weight at 98-111% of copy bandwidth), 1.48-1.56x at
32 and 1.32-1.44x at 64, where the Triton kernel ran 1.27-1.44x, 1.19-1.28x
and 0.85-0.90x; at 4096 x 12288 1.21-1.58x. On products of 4-20 us (K or N
= 2048, and 4096 x 4096) the wall time of a call of nothing but these
kernels holds up to 13 us of idle GPU between their launches, and moved by
up to 70% from one sweep to the next; by GPU time, which a busy decode step
pays, the kernel ran 1.25-1.62x as fast as the Triton kernel at 1 and 8 rows
at every such shape, at 70-82% of copy bandwidth (30% at 2048 x 2048;
21:31 UTC, "Decode products: GPU time against wall time"). From 65 to 128
rows (one H100, 2026-12-06, two sweeps by GPU time; nvidia-h100-80gb-hbm3.md,
"Decode on the sparse tensor cores from 65 to 128 rows") it ran at
1.07-1.49x of dense XLA on the three large shapes (60-71% of copy
bandwidth), 1.12-1.29x at 4096 x 4096 and 4096 x 12288, 1.11-1.63x where K
or N = 2048 but 2048 x 6144 (0.91x at 128 rows), where the Triton kernel
ran at 0.68-1.09x. Each block of 64 rows of W reads all of x from L2, N / 64
times in all: 3.6 times the compressed weight's bytes at 128 rows. Blocks
of 128 rows halve that (128 accumulator registers a thread): 1.25-1.53x on
the three large shapes against 1.04-1.44x with blocks of 64 in the same run,
but slower at 4096 x 4096, 4096 x 12288 and where K or N = 2048 (fewer,
longer units per SM; "... from 65 to 128 rows", 05:50 UTC). One pass of
the kernel stops at 128 rows (`PASS_M`: its 128 accumulator registers a
thread leave no room for more rows of x); past it, one pass per 128 rows of
x, each reading W again. On an H100 (2026-12-06, "Decode on the sparse
tensor cores from 129 to 256 rows") the passes took 0.58-0.94x the Triton
kernel's GPU time at 160-256 rows on the swept shapes (1.02-1.04x at 2048 x
2048 and 2048 x 6144 with 256 rows), but ran at only 0.44-0.96x of dense
XLA, whose product at 256 rows takes no longer than at 128 (0.87-1.13x its
time).

**What bounds it past 64 rows** (nvidia-h100-80gb-hbm3.md, "What bounds the
kernel past 64 rows"): not x's reads from L2 (x multicast to the two CTAs of a
cluster by TMA took the same time) nor too few warps (a second warpgroup
multiplying half of each block of W, fed by a third issuing the copies, ran
1-7% slower). At 128 rows on 8192 x 8192 Nsight Compute saw no unit saturated:
the shared pipeline, which carries `mma.sp`, at 50% of its peak, issue slots
26% busy, DRAM 54%, 255 registers a thread. The likely bound, not measured
further, is warp-level `mma` itself, which on Hopper runs below the rate of
`wgmma` (the warpgroup form); Pallas Mosaic GPU has no sparse `wgmma`.

**Limits** (`unsupported_reason`): 1-256 rows, K a multiple of 1024, N a
multiple of 8, bfloat16 or float16; Hopper (TMA, `plgpu.kernel`). There is
no CPU interpreter for it (Mosaic GPU's interprets neither the inline PTX
nor swizzled tiles): CPU tests check the plan, the checks and that the
program lowers for CUDA; GPU tests check the product.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, memref, vector
import numpy as np

from pallas_kernels import _tiles

# Rows of x in one pass of the kernel (its accumulators and x's tiles in
# shared memory hold no more); up to MAX_M rows in passes of PASS_M.
PASS_M = 128
MAX_M = 256
K_STEP = 1024  # K per pipeline step up to 16 rows: 32 tiles of mma.sp's K (32)
# Past 16 rows x's tile would not fit twice in shared memory beside the
# weight's: steps of 512, and of 256 past 64 rows (x's tile up to 128 x 256,
# 64 KiB a stage).
K_STEP_WIDE = 512
K_STEP_TALL = 256
ROWS = 64  # rows of W per block: 4 tiles of mma.sp's M (16)
# Past 64 rows of x, where W has at least TALL_MIN_ELEMENTS, blocks of 128
# rows of W (8 tiles), so that x is read from L2 half as often. On smaller
# weights the fewer, longer units ran slower (H100, 2026-12-06,
# nvidia-h100-80gb-hbm3.md, "Decode on the sparse tensor cores from 65 to 128
# rows").
ROWS_TALL = 128
TALL_MIN_ELEMENTS = 1 << 26
# Streaming multiprocessors where the device does not say (H100 and H200 SXM).
_SMS = 132
# jax 0.12's pipelines reject a block that passes its array's bounds when it
# is traced; 0.11's copy x's M < 8 rows into the 8-row tile (rows past M stay
# unwritten and their outputs unstored), which spares an XLA pad of x.
_PAD_ROWS = tuple(int(v) for v in jax.__version__.split(".")[:2]) >= (0, 12)
# TMA copies into 128-byte swizzled tiles: 8 rows of 128 bytes.
_X_TF = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
_V_TF = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))


def _codes_bytes(step_k: int) -> int:
  """Bytes of codes per row of W in a step: 128, 64 or 32."""
  return step_k // 8


def _codes_transforms(step_k: int):
  """The TMA transforms of a step's codes (`k_step`): rows of B = 128, 64 or
  32 bytes in B-byte swizzle (B / 16 chunks of 16 bytes, XORed with row //
  (128 / B) % (B / 16)), so that a warp's 8 rows hit 8 different banks."""
  row = _codes_bytes(step_k)
  return (plgpu.TilingTransform((8, row)), plgpu.SwizzleTransform(row))


def warps(m: int) -> tuple[int, int, int]:
  """`(ways of K, ways of x's rows, 8-row tiles of x per warp)`: how the
  four warps share a step for `m` rows. Up to 16 rows they split K four ways
  and each holds all of x's tiles; past 16, x's rows in two (17-32) or four
  (33-128) parts, each warp its own outputs, K in the two ways left (17-32
  rows) or one: 16 rows a warp up to 64, 24 or 32 past 64 (64 or 128
  accumulator registers a thread)."""
  tiles = pl.cdiv(m, 8)
  if tiles <= 2:
    return 4, 1, tiles
  if tiles <= 4:
    return 2, 2, 2
  return 1, 4, max(2, pl.cdiv(tiles, 4))


def block_rows(m: int, k: int, n: int) -> int:
  """Rows of W per block for `m` rows of x and a `[K, N]` weight."""
  return ROWS_TALL if m > 64 and k * n >= TALL_MIN_ELEMENTS else ROWS


def k_step(m: int) -> int:
  """K per pipeline step for `m` rows."""
  return K_STEP if m <= 16 else K_STEP_WIDE if m <= 64 else K_STEP_TALL


def unsupported_reason(m: int, k: int, n: int, dtype) -> str | None:
  """Why `decode_matmul` cannot multiply `x[M, K]` by this `[K, N]` weight,
  or None where it can."""
  if not 1 <= m <= MAX_M:
    return f"M = {m} rows (the kernel takes 1 to {MAX_M})"
  if k % K_STEP:
    return f"K = {k} (the kernel takes multiples of {K_STEP})"
  if n % 8:
    return f"N = {n} (the kernel takes multiples of 8)"
  if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
    return f"dtype {jnp.dtype(dtype).name} (the kernel takes bfloat16 and float16)"
  return None


# Up to ONE_SLICE_MAX_M rows of x, a weight whose K and N are both at least
# ONE_SLICE_MIN_KN takes all of K in one slice, where `plan` alone would deal
# two slices to fill more SMs: half the CTAs, each streaming twice the steps,
# ran faster than the two slices and their float32 partial products (at
# 4096 x 4096 8.96 against 9.87 us of GPU time at one row, 10.2 against 11.15
# at 16; 4096 x 12288 and 16384 x 4096 2-6% less), and a d_model 4096 decode
# step gained with them at batch 1-8 (1.016 against 1.026 ms at batch 1),
# though there XLA sums two slices' partials inside a residual add it runs
# anyway. Where K or N is 2048 the kernel alone was faster in one slice too,
# but a d_model 2048 decode step lost 1.6-2.8% at every batch (0.520 against
# 0.507 ms at batch 1), and at 64 rows the d_model 4096 step lost 2% (H100,
# 2026-12-06, benchmarks/results/nvidia-h100-80gb-hbm3.md, "The
# sparse-tensor-core decode kernel in one K slice against its plan's, by GPU
# time" and "Decode steps with the kernel in one K slice"). On an H200 the
# kernel alone was faster in one slice at 4096 x 4096 too, by GPU time (7.78
# against 7.99 us at one row, 2026-12-04, nvidia-h200.md, "Decode products:
# GPU time against wall time"); no H200 decode step was timed with it.
ONE_SLICE_MAX_M = 16
ONE_SLICE_MIN_KN = 4096
SLICE_COUNTS = (1, 2, 4, 8)  # the K slice counts `plan` weighs elsewhere


def slice_counts(m: int, k: int, n: int) -> tuple[int, ...]:
  """The K slice counts `plan` chooses among for `m` rows of x and a `[K, N]`
  weight (`ONE_SLICE_MAX_M`)."""
  return (1,) if m <= ONE_SLICE_MAX_M and min(k, n) >= ONE_SLICE_MIN_KN else SLICE_COUNTS


def default_slices(m: int, k: int, n: int, rows: int | None = None) -> int:
  """The K slices `decode_matmul` runs one pass of `m` rows in by default
  (`plan` among `slice_counts`), with `rows` rows of W per block (None:
  `block_rows`)."""
  return plan(n, k, step=k_step(m), rows=rows or block_rows(m, k, n),
              splits_among=slice_counts(m, k, n))[0]


def plan(n: int, k: int, sms: int | None = None, step: int = K_STEP,
         splits_among=SLICE_COUNTS, rows: int = ROWS) -> tuple[int, int, int]:
  """`(splits, ctas, units per CTA)`: the K steps of each block of `rows` rows
  of W (`block_rows`) in
  `splits` slices (of `splits_among`, dividing the steps), the units (block,
  slice) dealt to `ctas` CTAs (at most `sms`, None: this device's streaming
  multiprocessors) in equal runs. The plan with the fewest K steps per CTA
  wins; a tie, the fewer slices (each slice past the first writes a float32
  partial product that XLA then sums). `step`: K per pipeline step
  (`k_step`)."""
  sms = sms or _sms()
  blocks, steps = pl.cdiv(n, rows), k // step
  best = None
  for splits in splits_among:
    if steps % splits:
      continue
    units = blocks * splits
    per_cta = next(j for j in range(pl.cdiv(units, sms), units + 1) if units % j == 0)
    cost = (per_cta * (steps // splits), splits)
    if best is None or cost < best[0]:
      best = (cost, (splits, units // per_cta, per_cta))
  return best[1]


def _ptx(asm: str, *args, results: list):
  """Inline PTX on 32-bit integer and float registers (written here: jax
  0.10's Mosaic GPU has no `utils.inline_ptx`)."""
  constraint = lambda ty: "f" if isinstance(ty, ir.F32Type) else "r"
  ret = results[0] if len(results) == 1 else llvm.StructType.get_literal(results)
  out = llvm.inline_asm(ret, list(args), asm, ",".join(
      [f"={constraint(r)}" for r in results] + [constraint(a.type) for a in args]),
                        has_side_effects=False)
  if len(results) == 1:
    return out
  return [llvm.extractvalue(r, out, [i]) for i, r in enumerate(results)]


def _ext(vec, i):
  return vector.extract(vec, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i]))


def _thread():
  """(i32 constant maker, index cast, warp, g, t) of this thread in its warpgroup."""
  i32 = ir.IntegerType.get_signless(32)
  c = lambda val: mgpu_utils.c(val, i32)
  ix = lambda val: arith.index_cast(ir.IndexType.get(), val)
  tid = arith.remui(mgpu_utils.thread_idx(), c(128))
  lane = arith.andi(tid, c(31))
  return c, ix, arith.shrui(tid, c(5)), arith.shrui(lane, c(2)), arith.andi(lane, c(3))


def _step_fn(ways_k: int, ntw: int, step_k: int, acc_layout, acc_width: int, dtype,
             w_tiles: int):
  """One pipeline step: the accumulators plus this step's products."""
  ptx_type = "bf16" if jnp.dtype(dtype) == jnp.bfloat16 else "f16"
  k_tiles = step_k // 32 // ways_k  # k32 tiles per warp per step
  chunks = _codes_bytes(step_k) // 16  # 16-byte chunks in a row of codes

  def mma_sp(selector: int) -> str:
    return (f"mma.sp.sync.aligned.m16n8k32.row.col.f32.{ptx_type}.{ptx_type}.f32"
            " {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9,$10,$11}, {$12,$13,$14,$15}, $16,"
            f" {selector};")

  @plgpu.inline_mgpu(
      arg_types=(plgpu.RefType(_X_TF), plgpu.RefType(_V_TF),
                 plgpu.RefType(_codes_transforms(step_k)), acc_layout),
      return_type=plgpu.ShapeDtypeStruct((128, acc_width), jnp.float32, layout=acc_layout))
  def step(ctx, x_s, v_s, m_s, acc):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    f32 = ir.F32Type.get()
    c, ix, warp, g, t = _thread()
    way_k, way_m = arith.remui(warp, c(ways_k)), arith.divui(warp, c(ways_k))
    (reg,) = acc.registers.flat
    accs = [_ext(reg, i) for i in range(acc_width)]
    x_pair = ir.VectorType.get((2,), mgpu_utils.dtype_to_ir_type(dtype))
    four_bytes = ir.VectorType.get((4,), ir.IntegerType.get_signless(8))
    g_ix = ix(g)
    t2 = arith.muli(t, c(2))
    x_tiles = [ix(arith.addi(arith.muli(way_m, c(ntw)), c(j))) for j in range(ntw)]
    # The metadata register: bytes 2h, 2h + 1 of row g's word (low half) and
    # of row g + 8's (high half), h = t % 2.
    halves = arith.addi(c(0x5410), arith.muli(arith.andi(t, c(1)), c(0x2222)))
    selector_tiles = arith.muli(arith.shrui(t, c(1)), c(2))
    # The 16-byte chunks of a row of codes are XORed with row // (8 / chunks)
    # % chunks (`_codes_transforms`): the row itself in 128-byte swizzle.
    m_swizzle = arith.andi(arith.shrui(g, c((8 // chunks).bit_length() - 1)), c(chunks - 1))
    for kk in range(k_tiles):
      q = arith.addi(arith.muli(way_k, c(k_tiles)), c(kk))  # k32 tile of the step
      # B: x[row, 32q + 8i + 2t : +2], i = 0..3, for row g of each 8-row tile.
      b_regs = [[] for _ in range(ntw)]
      for i in range(4):
        col = arith.addi(arith.muli(q, c(32)), c(8 * i))
        chunk = arith.xori(arith.andi(arith.shrui(col, c(3)), c(7)), g)
        inner = ix(arith.addi(arith.muli(chunk, c(8)), t2))
        for tile in range(ntw):
          pair = vector.load(x_pair, x_s, [x_tiles[tile], ix(arith.shrui(col, c(6))), g_ix, inner],
                             alignment=4)
          b_regs[tile].append(mgpu_utils.bitcast(pair, i32))
      # A: the pair words of groups t and t + 4 of k32 tile q (word columns
      # 8q + 4ci + t), rows g and g + 8 of each 16-row tile.
      v_tile = ix(arith.shrui(q, c(2)))
      v_inner = [ix(arith.addi(arith.muli(arith.xori(
          arith.addi(arith.muli(arith.andi(q, c(3)), c(2)), c(ci)), g), c(4)), t))
                 for ci in range(2)]
      # Metadata: bytes 4q .. 4q + 3 of each row (16 groups' codes).
      m_inner = ix(arith.addi(arith.muli(arith.xori(arith.shrui(q, c(2)), m_swizzle), c(16)),
                              arith.muli(arith.andi(q, c(3)), c(4))))
      meta_regs = []
      for pair_of_tiles in range(w_tiles // 2):
        words = []
        for hi in range(2):
          row_tile = ix(arith.addi(c(4 * pair_of_tiles + hi), selector_tiles))
          word = vector.load(four_bytes, m_s, [row_tile, ix(c(0)), g_ix, m_inner], alignment=4)
          words.append(mgpu_utils.bitcast(word, i32))
        meta_regs.append(_ptx("prmt.b32 $0, $1, $2, $3;", *words, halves, results=[i32]))
      for r in range(w_tiles):
        a_regs = [memref.load(v_s, [ix(c(2 * r + i % 2)), v_tile, g_ix, v_inner[i // 2]])
                  for i in range(4)]
        for tile in range(ntw):
          base = (r * ntw + tile) * 4
          accs[base:base + 4] = _ptx(
              mma_sp(r % 2), *a_regs, *b_regs[tile], *accs[base:base + 4], meta_regs[r // 2],
              results=[f32] * 4)
    new = vector.from_elements(ir.VectorType.get((acc_width,), f32), list(accs))
    return mgpu.FragmentedArray(_registers=np.array([new], dtype=object).reshape(
        acc.registers.shape), _layout=acc.layout, _is_signed=None)

  return step


def _finish_fn(m: int, n: int, ways_k: int, ntw: int, acc_layout, acc_width: int, out_dtype,
               split_out: bool, w_tiles: int):
  """Where a unit ends: the sums of the warps that split K (through shared
  memory; none to add with one way of K), each thread storing its outputs
  (y, or its K slice's float32 partial)."""

  @plgpu.inline_mgpu(arg_types=(acc_layout, plgpu.RefType(), plgpu.RefType(),
                                plgpu.Layout.WG_SPLAT(()), plgpu.Layout.WG_SPLAT(())))
  def finish(ctx, acc, red, out, col0, split):
    del ctx
    f32 = ir.F32Type.get()
    c, ix, warp, g, t = _thread()
    way_k, way_m = arith.remui(warp, c(ways_k)), arith.divui(warp, c(ways_k))
    scalar = lambda a: (_ext(a.registers.flat[0], 0)
                        if isinstance(a.registers.flat[0].type, ir.VectorType)
                        else a.registers.flat[0])
    lane = arith.addi(arith.muli(g, c(4)), t)
    (reg,) = acc.registers.flat
    # Element e = (r * ntw + tile) * 4 + reg of a lane's accumulators: of
    # W's `w_tiles` 16-row tiles r this warp writes the `row_tiles` from r0, summed
    # over the `ways_k` warps of its part of x's rows.
    row_tiles = w_tiles // ways_k
    r0 = arith.muli(way_k, c(row_tiles))
    if ways_k == 1:
      total = reg
    else:
      mgpu_utils.warpgroup_barrier()  # the previous unit's reads of `red` are done
      vector.store(reg, red, [ix(arith.addi(arith.muli(warp, c(32)), lane)), ix(c(0))])
      mgpu_utils.warpgroup_barrier()
      width = acc_width // ways_k
      total = None
      for w in range(ways_k):
        other = arith.addi(arith.muli(way_m, c(ways_k)), c(w))
        part = vector.load(ir.VectorType.get((width,), f32), red,
                           [ix(arith.addi(arith.muli(other, c(32)), lane)),
                            ix(arith.muli(r0, c(4 * ntw)))])
        total = part if total is None else arith.addf(total, part)
    col0, split = scalar(col0), scalar(split)
    # Accumulator register (tile, hi, lo) of row tile r:
    # y[8 (way_m ntw + tile) + 2t + lo, col0 + 16 r + 8 hi + g].
    for rr in range(row_tiles):
      for tile in range(ntw):
        for hi in range(2):
          col = arith.addi(col0, arith.addi(arith.muli(arith.addi(r0, c(rr)), c(16)),
                                            arith.addi(g, c(8 * hi))))
          for lo in range(2):
            row = arith.addi(arith.muli(arith.addi(arith.muli(way_m, c(ntw)), c(tile)), c(8)),
                             arith.addi(arith.muli(t, c(2)), c(lo)))
            val = _ext(total, (rr * ntw + tile) * 4 + hi * 2 + lo)
            if jnp.dtype(out_dtype) != jnp.float32:
              val = arith.truncf(mgpu_utils.dtype_to_ir_type(out_dtype), val)
            inside = arith.andi(arith.cmpi(arith.CmpIPredicate.ult, row, c(m)),
                                arith.cmpi(arith.CmpIPredicate.ult, col, c(n)))
            with mgpu_utils.when(inside):
              memref.store(val, out, ([ix(split)] if split_out else []) + [ix(row), ix(col)])

  return finish


def _sms() -> int:
  return int(getattr(jax.devices()[0], "core_count", 0) or _SMS)


@functools.partial(jax.jit, static_argnames=("k", "splits", "rows"))
def decode_matmul(x: jax.Array, values: jax.Array, meta: jax.Array, *, k: int,
                  splits: int | None = None, rows: int | None = None) -> jax.Array:
  """`x[M, K] @ W[K, N]` with W given compressed (values `[N or more, K/2]`,
  meta `uint8[N, K/8]`, `Sparse24`'s layout): float32 accumulation, output in
  x's dtype. `values` rows after the N-th are not read for the product (a
  cuSPARSELt buffer multiplies in place). Past `PASS_M` rows, one pass of the
  kernel per `PASS_M` rows of x (the last takes the rest), each reading W
  again. `splits`: the K slices per block of W's rows (a divisor of the K
  steps, `k_step`), for tuning; None: `plan`'s choice among `slice_counts`.
  `rows`: W's rows per block (`ROWS`, or `ROWS_TALL` past 64 rows of x), for
  tuning; None: `block_rows`. Both tune a single pass (up to `PASS_M` rows).
  Limits: `unsupported_reason`."""
  m, n = _tiles.check_operands("decode24_mma.decode_matmul", x, values, meta, k,
                               rows_after_n=True)
  reason = unsupported_reason(m, k, n, x.dtype)
  if reason is not None:
    raise ValueError(f"decode24_mma.decode_matmul: {reason}; decode24.decode_matmul takes"
                     " any shape.")
  if m > PASS_M:
    if splits is not None or rows is not None:
      raise ValueError(f"decode24_mma.decode_matmul: splits = {splits!r}, rows = {rows!r} tune"
                       f" one pass of at most {PASS_M} rows of x, and x has {m}; pass None for"
                       " both, or time the passes' rows alone.")
    return jnp.concatenate([_one_pass(x[i:i + PASS_M], values, meta, k=k, n=n)
                            for i in range(0, m, PASS_M)], axis=0)
  return _one_pass(x, values, meta, k=k, n=n, splits=splits, rows=rows)


def _one_pass(x, values, meta, *, k: int, n: int, splits: int | None = None,
              rows: int | None = None) -> jax.Array:
  """`decode_matmul` for up to `PASS_M` rows of x: one kernel."""
  m = x.shape[0]
  ways_k, ways_m, ntw = warps(m)
  tiles = ways_m * ntw  # 8-row tiles of x in a step
  step_k = k_step(m)
  if splits is not None and not (isinstance(splits, int) and splits >= 1
                                 and (k // step_k) % splits == 0):
    raise ValueError(f"decode24_mma.decode_matmul: splits = {splits!r} does not divide the"
                     f" {k // step_k} K steps of {step_k} (K = {k}, {m} rows); pass a divisor"
                     " of them, or None for plan()'s choice.")
  if rows not in (None, ROWS, ROWS_TALL) or (rows == ROWS_TALL and m <= 64):
    raise ValueError(f"decode24_mma.decode_matmul: rows = {rows!r} rows of W per block; pass"
                     f" {ROWS}, {ROWS_TALL} (past 64 rows of x: shared memory holds no more),"
                     " or None for block_rows()'s choice.")
  rows = rows or block_rows(m, k, n)
  splits, ctas, per_cta = plan(n, k, step=step_k, rows=rows,
                               splits_among=slice_counts(m, k, n) if splits is None else (splits,))
  steps = k // step_k // splits
  w_tiles = rows // 16
  acc_width = 4 * w_tiles * ntw  # row tiles x ntw column tiles x 4 registers
  acc_layout = plgpu.Layout.WG_STRIDED((128, acc_width), vec_size=acc_width)
  step = _step_fn(ways_k, ntw, step_k, acc_layout, acc_width, x.dtype, w_tiles)
  out_dtype = x.dtype if splits == 1 else jnp.float32
  finish = _finish_fn(m, n, ways_k, ntw, acc_layout, acc_width, out_dtype, splits > 1, w_tiles)

  def jsparse24_decode_mma(x_ref, v_ref, m_ref, o_ref, red):
    cta = lax.axis_index("cta")
    unit = lambda j: cta * per_cta + j
    k_at = lambda j, s: (unit(j) % splits) * steps + s
    zeros = plgpu.layout_cast(jnp.zeros((128, acc_width), jnp.float32), acc_layout)

    def body(idx, x_s, v_s, m_s, acc):
      j, s = idx
      acc = step(x_s, v_s, m_s, acc)
      last = s == steps - 1

      @pl.when(last)
      def _():
        u = unit(j)
        finish(acc, red, o_ref, (u // splits) * rows, u % splits)

      # A unit's last step starts the next unit from zero (a select: the
      # lowering broadcasts no scalar predicate).
      keep = plgpu.layout_cast(jnp.full(acc.shape, jnp.where(last, 0.0, 1.0), jnp.float32),
                               acc_layout)
      return jnp.where(keep > 0.5, acc, zeros)

    plgpu.emit_pipeline(
        body,
        grid=(per_cta, steps),
        in_specs=[
            plgpu.BlockSpec((8 * tiles, step_k), lambda j, s: (0, k_at(j, s)), transforms=_X_TF),
            plgpu.BlockSpec((rows, step_k // 4), lambda j, s: (unit(j) // splits, k_at(j, s)),
                            transforms=_V_TF),
            plgpu.BlockSpec((rows, step_k // 8), lambda j, s: (unit(j) // splits, k_at(j, s)),
                            transforms=_codes_transforms(step_k)),
        ],
        max_concurrent_steps=2,
        init_carry=zeros,
    )(x_ref, v_ref, m_ref)

  # TMA's 8-row tiles take x's rows as they are up to 8, else the kernel's
  # whole tiles.
  if m != 8 * tiles and (m > 8 or _PAD_ROWS):
    x = jnp.pad(x, ((0, 8 * tiles - m), (0, 0)))
  if values.shape[0] % 8:  # TMA's 8-row tiles; a cuSPARSELt buffer (N % 64 == 0) never is
    values = values[:n]
  pairs = lax.bitcast_convert_type(values.reshape(values.shape[0], k // 4, 2), jnp.uint32)
  out = plgpu.kernel(
      jsparse24_decode_mma,
      out_type=jax.ShapeDtypeStruct((m, n) if splits == 1 else (splits, m, n), out_dtype),
      # The warps' partial sums where they split K (unused with one way).
      scratch_types=[plgpu.SMEM((128 if ways_k > 1 else 8, acc_width), jnp.float32)],
      grid=(ctas,),
      grid_names=("cta",),
  )(x, pairs, meta)
  return out if splits == 1 else jnp.sum(out, axis=0).astype(x.dtype)
