"""`x @ W` for up to 16 rows of x on the sparse tensor cores (Pallas Mosaic GPU).

The same product as `decode24.decode_matmul` (its reference,
`decode24.decode_matmul_reference`, is this kernel's), on the same arrays: a
`Sparse24`'s values `[N, K/2]` and metadata `uint8[N, K/8]`, read in place.
Where `decode24` expands each compressed tile to a dense one on chip and
multiplies it on the dense tensor cores, this kernel hands the compressed
values and their codes to `mma.sp` (PTX's warp-level sparse product,
`m16n8k32`), which takes a 2:4 operand as it is stored: nothing is expanded.
The weight is the sparse operand `A` (rows: output features), x the dense `B`
(its rows: columns of the `n8` tile, M padded to 8 or 16), so one row of x
costs the same as eight.

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
of 16) and walks K in steps of 1024 (`K_STEP`); its four warps split each
step's K four ways and all own the 4 row tiles, so a warp's x fragment serves
four products. TMA copies each step's tiles swizzled (128 bytes): the values
as uint32 pairs `[64, 256]` (a group's two 16-bit values, as `_prmt` reads
them), the codes `uint8[64, 128]` and x `[8 or 16, 1024]`; with the swizzle
the 8 row groups of a warp read 8 different banks. For `mma.sp`'s `A`, thread
`(g, t)` (lane `4g + t`) holds groups `t` and `t + 4` of rows `g` and `g + 8`
of its 16-row tile: four 32-bit loads. Its metadata register holds the codes
of row `g` (low half) and `g + 8` (high half), 16 bits each: the codes of
groups `4h .. 4h + 3` (h = t % 2), exactly two bytes of `Sparse24`'s metadata
(NVIDIA's code convention is jsparse24's, `prune_rule`). With sparsity
selector 0 threads t = 0, 1 supply the metadata and with selector 1 threads
t = 2, 3 do, so each thread builds one register for two row tiles (one
`prmt` of two 32-bit loads) and every loaded byte is used.

**Splitting the work.** Work units are (64-row block, slice of K); a CTA runs
one pipeline over the K steps of its units (`plan`: as many CTAs as the
units divide into, at most one per SM). Where a K slice ends, the four warps'
partial sums meet in shared memory and each thread writes its outputs; with
one slice per block the kernel writes y itself, with several it writes
float32 partial products that one XLA reduction sums (deterministic: no
atomic adds).

**Measured** (one H200, jax 0.11.2, 2026-12-04 16:39 UTC;
benchmarks/results/nvidia-h200.md, "Decode on the sparse tensor cores";
`benchmarks/tune_decode.py --mma`): at M = 1-16 on 8192 x 8192, 4096 x 16384
and 16384 x 4096 it ran 1.49-1.67x as fast as dense XLA, reading the
compressed weight at 96-110% of copy bandwidth, where the Triton kernel ran
1.25-1.42x as fast; at 4096 x 12288 1.26-1.60x (faster than the
Triton kernel up to 4 rows); at 4096 x 4096 0.86-1.14x, and 0.59-1.97x
where K or N = 2048: products of 8-16 us, where the launch and the K-slice
reduction weigh (at 4096 x 4096 and one row the kernel itself took 6.9-7.4
us, a call 8.5-14.9 us, in two profiles of the same day).

**Limits** (`unsupported_reason`): 1-16 rows, K a multiple of 1024, N a
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

MAX_M = 16
K_STEP = 1024  # K per pipeline step: 32 tiles of mma.sp's K (32), 8 per warp
ROWS = 64  # rows of W per block: 4 tiles of mma.sp's M (16)
_K_TILES = K_STEP // 128  # k32 tiles per warp per step
# Streaming multiprocessors where the device does not say (H100 and H200 SXM).
_SMS = 132
# jax 0.12's pipelines reject a block that passes its array's bounds when it
# is traced; 0.11's copy x's M < 8 rows into the 8-row tile (rows past M stay
# unwritten and their outputs unstored), which spares an XLA pad of x.
_PAD_ROWS = tuple(int(v) for v in jax.__version__.split(".")[:2]) >= (0, 12)
# TMA copies into 128-byte swizzled tiles: 8 rows of 128 bytes.
_X_TF = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
_V_TF = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
_M_TF = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))


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


def plan(n: int, k: int, sms: int = _SMS) -> tuple[int, int, int]:
  """`(splits, ctas, units per CTA)`: each 64-row block's K steps in
  `splits` slices (a divisor of the steps, at most 8), the units (block,
  slice) dealt to `ctas` CTAs (at most `sms`) in equal runs. The plan with
  the fewest K steps per CTA wins; a tie, the fewer slices (each slice past
  the first writes a float32 partial product that XLA then sums)."""
  blocks, steps = pl.cdiv(n, ROWS), k // K_STEP
  best = None
  for splits in (1, 2, 4, 8):
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


def _step_fn(nt: int, acc_layout, acc_width: int, dtype):
  """One pipeline step: the accumulators plus this step's products."""
  ptx_type = "bf16" if jnp.dtype(dtype) == jnp.bfloat16 else "f16"

  def mma_sp(selector: int) -> str:
    return (f"mma.sp.sync.aligned.m16n8k32.row.col.f32.{ptx_type}.{ptx_type}.f32"
            " {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9,$10,$11}, {$12,$13,$14,$15}, $16,"
            f" {selector};")

  @plgpu.inline_mgpu(
      arg_types=(plgpu.RefType(_X_TF), plgpu.RefType(_V_TF), plgpu.RefType(_M_TF), acc_layout),
      return_type=plgpu.ShapeDtypeStruct((128, acc_width), jnp.float32, layout=acc_layout))
  def step(ctx, x_s, v_s, m_s, acc):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    f32 = ir.F32Type.get()
    c, ix, warp, g, t = _thread()
    (reg,) = acc.registers.flat
    accs = [_ext(reg, i) for i in range(acc_width)]
    x_pair = ir.VectorType.get((2,), mgpu_utils.dtype_to_ir_type(dtype))
    four_bytes = ir.VectorType.get((4,), ir.IntegerType.get_signless(8))
    g_ix = ix(g)
    t2 = arith.muli(t, c(2))
    # The metadata register: bytes 2h, 2h + 1 of row g's word (low half) and
    # of row g + 8's (high half), h = t % 2.
    halves = arith.addi(c(0x5410), arith.muli(arith.andi(t, c(1)), c(0x2222)))
    selector_tiles = arith.muli(arith.shrui(t, c(1)), c(2))
    for kk in range(_K_TILES):
      q = arith.addi(arith.muli(warp, c(_K_TILES)), c(kk))  # k32 tile of the step, 0..31
      # B: x[row, 32q + 8i + 2t : +2], i = 0..3, for row g of each 8-row tile.
      b_regs = [[] for _ in range(nt)]
      for i in range(4):
        col = arith.addi(arith.muli(q, c(32)), c(8 * i))
        chunk = arith.xori(arith.andi(arith.shrui(col, c(3)), c(7)), g)
        inner = ix(arith.addi(arith.muli(chunk, c(8)), t2))
        for tile in range(nt):
          pair = vector.load(x_pair, x_s, [ix(c(tile)), ix(arith.shrui(col, c(6))), g_ix, inner],
                             alignment=4)
          b_regs[tile].append(mgpu_utils.bitcast(pair, i32))
      # A: the pair words of groups t and t + 4 of k32 tile q (word columns
      # 8q + 4ci + t), rows g and g + 8 of each 16-row tile.
      v_tile = ix(arith.shrui(q, c(2)))
      v_inner = [ix(arith.addi(arith.muli(arith.xori(
          arith.addi(arith.muli(arith.andi(q, c(3)), c(2)), c(ci)), g), c(4)), t))
                 for ci in range(2)]
      # Metadata: bytes 4q .. 4q + 3 of each row (16 groups' codes).
      m_inner = ix(arith.addi(arith.muli(arith.xori(arith.shrui(q, c(2)), g), c(16)),
                              arith.muli(arith.andi(q, c(3)), c(4))))
      meta_regs = []
      for pair_of_tiles in range(2):
        words = []
        for hi in range(2):
          row_tile = ix(arith.addi(c(4 * pair_of_tiles + hi), selector_tiles))
          word = vector.load(four_bytes, m_s, [row_tile, ix(c(0)), g_ix, m_inner], alignment=4)
          words.append(mgpu_utils.bitcast(word, i32))
        meta_regs.append(_ptx("prmt.b32 $0, $1, $2, $3;", *words, halves, results=[i32]))
      for r in range(4):
        a_regs = [memref.load(v_s, [ix(c(2 * r + i % 2)), v_tile, g_ix, v_inner[i // 2]])
                  for i in range(4)]
        for tile in range(nt):
          base = (r * nt + tile) * 4
          accs[base:base + 4] = _ptx(
              mma_sp(r % 2), *a_regs, *b_regs[tile], *accs[base:base + 4], meta_regs[r // 2],
              results=[f32] * 4)
    new = vector.from_elements(ir.VectorType.get((acc_width,), f32), list(accs))
    return mgpu.FragmentedArray(_registers=np.array([new], dtype=object).reshape(
        acc.registers.shape), _layout=acc.layout, _is_signed=None)

  return step


def _finish_fn(m: int, n: int, nt: int, acc_layout, acc_width: int, out_dtype, split_out: bool):
  """Where a unit ends: the four warps' sums through shared memory, each
  thread storing its outputs (y, or its K slice's float32 partial)."""

  @plgpu.inline_mgpu(arg_types=(acc_layout, plgpu.RefType(), plgpu.RefType(),
                                plgpu.Layout.WG_SPLAT(()), plgpu.Layout.WG_SPLAT(())))
  def finish(ctx, acc, red, out, col0, split):
    del ctx
    f32 = ir.F32Type.get()
    c, ix, warp, g, t = _thread()
    scalar = lambda a: (_ext(a.registers.flat[0], 0)
                        if isinstance(a.registers.flat[0].type, ir.VectorType)
                        else a.registers.flat[0])
    tid = arith.addi(arith.muli(warp, c(32)), arith.addi(arith.muli(g, c(4)), t))
    (reg,) = acc.registers.flat
    mgpu_utils.warpgroup_barrier()  # the previous unit's reads of `red` are done
    vector.store(reg, red, [ix(tid), ix(c(0))])
    mgpu_utils.warpgroup_barrier()
    # Element e = (r * nt + tile) * 4 + reg of a lane's accumulators: this
    # thread sums row tile r = warp over the four warps.
    width = acc_width // 4
    total = None
    for w in range(4):
      part = vector.load(ir.VectorType.get((width,), f32), red,
                         [ix(arith.addi(c(32 * w), arith.subi(tid, arith.muli(warp, c(32))))),
                          ix(arith.muli(warp, c(width)))])
      total = part if total is None else arith.addf(total, part)
    col0, split = scalar(col0), scalar(split)
    # Accumulator register (tile, hi, lo): y[8 tile + 2t + lo, col0 + 16 warp + 8 hi + g].
    for tile in range(nt):
      for hi in range(2):
        col = arith.addi(col0, arith.addi(arith.muli(warp, c(16)), arith.addi(g, c(8 * hi))))
        for lo in range(2):
          row = arith.addi(c(8 * tile + lo), arith.muli(t, c(2)))
          val = _ext(total, tile * 4 + hi * 2 + lo)
          if jnp.dtype(out_dtype) != jnp.float32:
            val = arith.truncf(mgpu_utils.dtype_to_ir_type(out_dtype), val)
          inside = arith.andi(arith.cmpi(arith.CmpIPredicate.ult, row, c(m)),
                              arith.cmpi(arith.CmpIPredicate.ult, col, c(n)))
          with mgpu_utils.when(inside):
            memref.store(val, out, ([ix(split)] if split_out else []) + [ix(row), ix(col)])

  return finish


def _sms() -> int:
  return int(getattr(jax.devices()[0], "core_count", 0) or _SMS)


@functools.partial(jax.jit, static_argnames=("k",))
def decode_matmul(x: jax.Array, values: jax.Array, meta: jax.Array, *, k: int) -> jax.Array:
  """`x[M, K] @ W[K, N]` with W given compressed (values `[N or more, K/2]`,
  meta `uint8[N, K/8]`, `Sparse24`'s layout): float32 accumulation, output in
  x's dtype. `values` rows after the N-th are not read for the product (a
  cuSPARSELt buffer multiplies in place). Limits: `unsupported_reason`."""
  m, n = _tiles.check_operands("decode24_mma.decode_matmul", x, values, meta, k,
                               rows_after_n=True)
  reason = unsupported_reason(m, k, n, x.dtype)
  if reason is not None:
    raise ValueError(f"decode24_mma.decode_matmul: {reason}; decode24.decode_matmul takes"
                     " any shape.")
  nt = pl.cdiv(m, 8)
  splits, ctas, per_cta = plan(n, k, _sms())
  steps = k // K_STEP // splits
  acc_width = 16 * nt  # 4 row tiles x nt column tiles x 4 registers
  acc_layout = plgpu.Layout.WG_STRIDED((128, acc_width), vec_size=acc_width)
  step = _step_fn(nt, acc_layout, acc_width, x.dtype)
  out_dtype = x.dtype if splits == 1 else jnp.float32
  finish = _finish_fn(m, n, nt, acc_layout, acc_width, out_dtype, splits > 1)

  def jsparse24_decode_mma(x_ref, v_ref, m_ref, o_ref, red):
    cta = lax.axis_index("cta")
    unit = lambda j: cta * per_cta + j
    k_step = lambda j, s: (unit(j) % splits) * steps + s
    zeros = plgpu.layout_cast(jnp.zeros((128, acc_width), jnp.float32), acc_layout)

    def body(idx, x_s, v_s, m_s, acc):
      j, s = idx
      acc = step(x_s, v_s, m_s, acc)
      last = s == steps - 1

      @pl.when(last)
      def _():
        u = unit(j)
        finish(acc, red, o_ref, (u // splits) * ROWS, u % splits)

      # A unit's last step starts the next unit from zero (a select: the
      # lowering broadcasts no scalar predicate).
      keep = plgpu.layout_cast(jnp.full(acc.shape, jnp.where(last, 0.0, 1.0), jnp.float32),
                               acc_layout)
      return jnp.where(keep > 0.5, acc, zeros)

    plgpu.emit_pipeline(
        body,
        grid=(per_cta, steps),
        in_specs=[
            plgpu.BlockSpec((8 * nt, K_STEP), lambda j, s: (0, k_step(j, s)), transforms=_X_TF),
            plgpu.BlockSpec((ROWS, K_STEP // 4), lambda j, s: (unit(j) // splits, k_step(j, s)),
                            transforms=_V_TF),
            plgpu.BlockSpec((ROWS, K_STEP // 8), lambda j, s: (unit(j) // splits, k_step(j, s)),
                            transforms=_M_TF),
        ],
        max_concurrent_steps=2,
        init_carry=zeros,
    )(x_ref, v_ref, m_ref)

  # TMA's 8-row tiles take x's rows as they are up to 8, else a multiple of 8.
  if m % 8 and (m > 8 or _PAD_ROWS):
    x = jnp.pad(x, ((0, 8 * nt - m), (0, 0)))
  if values.shape[0] % 8:  # TMA's 8-row tiles; a cuSPARSELt buffer (N % 64 == 0) never is
    values = values[:n]
  pairs = lax.bitcast_convert_type(values.reshape(values.shape[0], k // 4, 2), jnp.uint32)
  out = plgpu.kernel(
      jsparse24_decode_mma,
      out_type=jax.ShapeDtypeStruct((m, n) if splits == 1 else (splits, m, n), out_dtype),
      scratch_types=[plgpu.SMEM((128, acc_width), jnp.float32)],
      grid=(ctas,),
      grid_names=("cta",),
  )(x, pairs, meta)
  return out if splits == 1 else jnp.sum(out, axis=0).astype(x.dtype)
