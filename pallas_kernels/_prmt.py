"""2:4 pairs expanded to dense tiles by PTX byte permutes (Triton lowering).

A group of 4 weights keeps two values, `first` at index `i0` and `second` at
`i1` (`prune_rule`'s code `i0 | i1 << 2`). Two 16-bit values are one 32-bit
word (`first` in the low half), and the group's 4 dense weights are two
words (positions 0-1 and 2-3). PTX's `prmt.b32 d, a, b, s` builds `d` from
4 of the 8 bytes of `b:a`, byte `j` of `d` taken from the byte that nibble
`j` of `s` names. With `a` the pair and `b = 0`, one `prmt` writes two dense
weights, so a group takes two `prmt`s and the few integer operations that
build `s` from its code: byte `l` of `S` below names the bytes of position
`l` (0x10: `first`, 0x32: `second`, 0x44: zero bytes of `b`), and the word of
positions 2-3 is the permute by `S >> 16`.

This is what makes the decode kernel read memory at speed: expanding the
same tile with selects (two compares and two selects per weight, then
packing two 16-bit values per register for the tensor cores) kept the
integer pipe 73% busy and the kernel at 63% of copy bandwidth on an H100
(ncu, M = 16, 8192 x 8192); with the permutes the kernel reads the
compressed weight there at 79-82% at M = 1 and 16
(benchmarks/results/nvidia-h100-80gb-hbm3.md, "decode kernel with
byte-permute expansion", 2026-11-27/28).

Pallas lowers `elementwise_inline_asm` with several results wrongly (jax
0.10.2 to 0.12 return them as one value: "Primitive elementwise_inline_asm_p
has multiple results, but 4 outvars do not match 1 outvals"); importing this
module registers a lowering rule that unpacks them (single-result calls keep
jax's own rule). Interpreted (CPU), the permutes are computed by `jnp` on the
same constants, so the CPU tests check this module's selectors bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import prune_rule as rule

# Byte l of the selector word: bytes of `b` (zeros) for every position, then
# the pair's bytes xor-ed in at i0 (FIRST: 0x44 ^ 0x10) and i1 (SECOND: 0x44 ^ 0x32).
ZERO_SELECTOR = 0x44444444
FIRST = 0x54
SECOND = 0x76


def _asm(high: bool) -> str:
  """PTX: results $0-$3 (16-bit positions 0-3) of pair $4 and meta byte $5
  (the group's code in its low nibble, or in its high one when `high`)."""
  # 8 * i0 and 8 * i1 from the code's two 2-bit fields, without unpacking it.
  i0 = "shr.b32 t0, $5, 1;" if high else "shl.b32 t0, $5, 3;"
  i1 = "shr.b32 t1, $5, 3;" if high else "shl.b32 t1, $5, 1;"
  return f"""{{
  .reg .b32 t0, t1, f, s, lo, hi;
  {i0}
  and.b32 t0, t0, 24;
  {i1}
  and.b32 t1, t1, 24;
  mov.b32 f, {FIRST};
  shl.b32 t0, f, t0;
  mov.b32 f, {SECOND};
  shl.b32 t1, f, t1;
  xor.b32 s, t0, t1;
  xor.b32 s, s, {ZERO_SELECTOR};
  prmt.b32 lo, $4, 0, s;
  shr.b32 s, s, 16;
  prmt.b32 hi, $4, 0, s;
  mov.b32 {{$0, $1}}, lo;
  mov.b32 {{$2, $3}}, hi;
}}"""


_ASM = {False: _asm(False), True: _asm(True)}


def selector(meta: jax.Array, high: bool) -> jax.Array:
  """The selector word `S` of each group (uint32 meta bytes; `high`: the
  group whose code is the byte's high nibble), as the PTX computes it."""
  i0, i1 = rule.code_indices(rule.byte_codes(meta)[int(high)])
  return (jnp.uint32(ZERO_SELECTOR) ^ (jnp.uint32(FIRST) << (i0 * 8))
          ^ (jnp.uint32(SECOND) << (i1 * 8)))


def permute(a: jax.Array, s: jax.Array) -> jax.Array:
  """`prmt.b32 d, a, 0, s` (default mode, selector nibbles below 8) in `jnp`."""
  d = jnp.zeros_like(a)
  for j in range(4):
    nib = (s >> (4 * j)) & 7
    byte = jnp.where(nib < 4, (a >> (8 * (nib & 3))) & 0xFF, 0)
    d = d | (byte << (8 * j))
  return d


def expand_group(pair: jax.Array, meta: jax.Array, high: bool, dtype,
                 interpret: bool) -> list[jax.Array]:
  """The 4 dense positions (tiles of `dtype`, pair's shape) of groups given
  as uint32 pairs (16-bit `first` low, `second` high) and uint32 meta bytes."""
  if not interpret:
    if _RULE_MISSING:
      raise RuntimeError(
          "pallas_kernels._prmt: this jax's Pallas Triton lowering has moved"
          f" ({_RULE_MISSING}), so the decode kernel's multi-result inline PTX cannot"
          " be lowered. Use the jax versions pyproject.toml names.")
    return list(pltriton.elementwise_inline_asm(
        _ASM[high], args=[pair, meta], constraints="=h,=h,=h,=h,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(pair.shape, dtype)] * 4))
  s = selector(meta, high)
  out = []
  for word in (permute(pair, s), permute(pair, s >> 16)):
    for half in (word & 0xFFFF, word >> 16):
      out.append(jax.lax.bitcast_convert_type(half.astype(jnp.uint16), dtype))
  return out


def _install_multi_result_rule() -> str | None:
  """Lower multi-result `elementwise_inline_asm` with its results unpacked.
  Returns why it could not (jax's private names moved), or None."""
  # pylint: disable=g-import-not-at-top,protected-access
  try:
    from jax._src.lib.triton import dialect as tt_dialect
    from jax._src.pallas.triton import lowering
    from jax._src.pallas.triton import primitives
    from jax.interpreters import mlir
    prim = primitives.elementwise_inline_asm_p
    own = lowering.triton_lowering_rules[prim]
  except (ImportError, AttributeError, KeyError) as e:
    return f"{type(e).__name__}: {e}"
  if getattr(own, "_jsparse24_multi_result", False):
    return None

  def rule(ctx, *args, asm, constraints, pack, result_shape_dtypes):
    if len(ctx.avals_out) == 1:
      return own(ctx, *args, asm=asm, constraints=constraints, pack=pack,
                 result_shape_dtypes=result_shape_dtypes)
    results = tt_dialect.elementwise_inline_asm(
        [mlir.aval_to_ir_type(ctx.context.mlir_ctx, a) for a in ctx.avals_out], asm,
        constraints=constraints, pure=True, packed_element=pack, args=args)
    return list(results)

  rule._jsparse24_multi_result = True
  lowering.triton_lowering_rules[prim] = rule
  return None


_RULE_MISSING = _install_multi_result_rule()
