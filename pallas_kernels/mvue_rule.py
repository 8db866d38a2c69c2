"""The MVUE 2:4 rule on the 4 entries of a group, in plain `jnp` ops.

One definition for the Pallas kernel (`mvue24.mvue_compress`, which applies it
to registers) and for jsparse24's reference (`jsparse24.mvue_24`, which
applies it to whole arrays): the same inputs give the same draws on both
(bit for bit in interpret mode; on the GPU Triton's float32 division and
fused multiply-adds may move a value by an ulp). No Pallas import here.

Per group `a` of 4 (float32 lanes of any one shape):

* `probabilities`: entry `i` is kept with probability `p_i = 2|a_i| / sum|a|`
  when no entry holds half of the group's magnitude; otherwise the first
  largest entry has `p = 1` and each other `|a_j| / (sum of the others)`
  (uniformly 1/3 when they are all zero). These are the minimum-variance
  marginals with `sum p = 2`, each at most 1.
* the draw (`_draw_predicates`): two entries by systematic sampling with
  one uniform number `u`: the entries whose interval `[upper_{i-1},
  upper_i)` of the cumulative sums of `p` holds `u` and `u + 1` (`upper_3`
  = 2). Entry `i` is drawn with probability `p_i`; the two draws are
  distinct (each interval is at most 1 long), and rounding that would break
  that is mended, so that every group always gets two distinct, valid
  indices (its 2:4 code).
* a drawn entry's value becomes `a_i / p_i`: the estimate is unbiased.

The kernel is bound by the GPU's integer/logic pipe (compares, selects,
bit operations; docs/design_notes.md, "The pruning kernels are bound by
integer operations"), so the rule is written to spend few of those and no
divisions (a long instruction sequence on the GPU): `p_i = w_i / S` for
weights `w` and a scale `S` (`_weights`), the draw compares the cumulative
sums of `w` with `u * S` and picks the kept entries by those comparisons,
and `a_i / p_i` is `sign(a_i) * S_i` in closed form (`sample`).
* `uniform_pair`: `u` from a counter-based hash of (a 64-bit seed, a group's
  index), so that a kernel tile computes the numbers of its own groups with
  no random-number state and no extra memory traffic. One hash serves two
  groups (its high and low 16 bits; `uniform_of_group` says which): half
  the hashing per group in a kernel bound by its instruction count. With
  16 bits an entry is drawn with a probability within 2^-15 of its `p_i`
  (its interval of `u` values may be split in two at 1, each part off by
  at most one step of 2^-16), so
  a kept value's expectation is within `2^-15 |a_i / p_i|` of `a_i`: 64
  times below the rounding of the kept value to bfloat16 (2^-9 relative),
  which the estimate carries anyway.

`mvue_compress_reference` applies the rule to a whole gradient, its groups
numbered and its output laid out as the kernel's: the kernel's reference,
and the code that jsparse24's cuSPARSELt backend runs in the kernel's place
where Pallas's Triton lowering cannot run (hence no Pallas import here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import prune_rule
from pallas_kernels.cusparselt_layout import CUSPARSELT_ALIGN


def _mix32(x: jax.Array) -> jax.Array:
  """A bijective avalanche mix of uint32 (the "lowbias32" constants of Chris
  Wellons' hash-prospector, which measured near-ideal avalanche)."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def _bits_to_unit(mantissa: jax.Array) -> jax.Array:
  """float32 `1 + mantissa * 2^-23` minus 1 (exact) for uint32 `mantissa`
  below 2^23: [0, 1) without an int -> float conversion."""
  one_plus_u = jax.lax.bitcast_convert_type(mantissa | jnp.uint32(0x3F800000), jnp.float32)
  return one_plus_u - 1.0


def uniform_pair(seed0: jax.Array, seed1: jax.Array, index: jax.Array):
  """Two float32 numbers in [0, 1) (multiples of 2^-16, so that u + 1 is
  exact in float32) for uint32 `index` under the uint32 seed pair: the high
  and the low 16 bits of two rounds of `_mix32`, each keyed by one seed
  word. The groups are drawn in pairs (`uniform_of_group`): the first of a
  pair, numbered `index`, takes the high half, the second the low half."""
  h = _mix32(_mix32(index ^ seed0) + seed1)
  # Each half as mantissa bits 22..7.
  return (_bits_to_unit((h >> 9) & jnp.uint32(0x007FFF80)),
          _bits_to_unit((h << 7) & jnp.uint32(0x007FFF80)))


def uniform_of_group(seed0: jax.Array, seed1: jax.Array, index: jax.Array,
                     second: jax.Array, stride) -> jax.Array:
  """`u` of the groups numbered `index` (uint32): the groups of rows 2t and
  2t + 1 (rows of groups `stride` numbers apart; `second`: bool, the group
  is in row 2t + 1) share `uniform_pair` of row 2t's number."""
  first = index - jnp.where(second, jnp.uint32(stride), jnp.uint32(0))
  hi, lo = uniform_pair(seed0, seed1, first)
  return jnp.where(second, lo, hi)


def _parts(a: list[jax.Array]):
  """`(m, total, first, rest, capped, none_left)` of 4 float32 lanes: the
  magnitudes, their sum, the first lane holding the largest (bool lanes),
  the others' sum, whether that lane holds half the magnitude or more
  (`capped`), and whether the others are all zero."""
  m = [jnp.abs(x) for x in a]
  total = ((m[0] + m[1]) + m[2]) + m[3]
  top = jnp.maximum(jnp.maximum(m[0], m[1]), jnp.maximum(m[2], m[3]))
  first, seen = [], None
  for x in m:  # the first lane holding the maximum
    hit = x == top
    first.append(hit if seen is None else hit & ~seen)
    seen = hit if seen is None else seen | hit
  # Summed directly, not `total - top`: with two non-zeros the other one's
  # weight then equals `rest` exactly (probability exactly 1).
  rest = ((jnp.where(first[0], 0.0, m[0]) + jnp.where(first[1], 0.0, m[1]))
          + jnp.where(first[2], 0.0, m[2])) + jnp.where(first[3], 0.0, m[3])
  return m, total, first, rest, 2.0 * top >= total, rest == 0


def _weights(a: list[jax.Array]):
  """The rule's unnormalised form: `(w, S, capped_first)` with `p_i = w_i / S`
  (`capped_first`: the bool lanes of the entry kept with probability 1).

  Spread case (no entry holds half the magnitude): `w_i = 2|a_i|`, `S = sum|a|`.
  Capped case: the first largest entry has `w = S`, each other `w_j = |a_j|`,
  `S = rest` (the others' sum); when the others are all zero, `w_j = 1` and
  `S = 3` (one of them uniformly, its value being 0 either way). Written as
  `w_j = |a_j| * k + e` (k = 2 spread, 1 capped; e = 1 when capped with the
  others all zero, else 0), exact, with no select per case.
  """
  m, total, first, rest, capped, none_left = _parts(a)
  scale = jnp.where(capped, jnp.where(none_left, 3.0, rest), total)
  k = jnp.where(capped, 1.0, 2.0)
  e = jnp.where(capped & none_left, 1.0, 0.0)
  capped_first = [f & capped for f in first]
  w = [jnp.where(f, scale, x * k + e) for x, f in zip(m, capped_first)]
  return w, scale, capped_first, capped, rest, total


def probabilities(a: list[jax.Array]) -> list[jax.Array]:
  """The keep probabilities (float32) of 4 float32 lanes `a` (module docstring).
  (Reporting only: `sample` draws without dividing.)"""
  w, scale, *_ = _weights(a)
  safe = jnp.where(scale > 0, scale, 1.0)
  return [jnp.where(scale > 0, x / safe, 0.5) for x in w]


def _draw_predicates(w: list[jax.Array], scale: jax.Array, u: jax.Array):
  """The draws of `u` and `u + 1` from the weights `w` (`p = w / scale`) as
  bool lanes `(p0, p1, r1, r2)`: the first drawn index is `i0 = p0 + p1`,
  the second `i1 = 1 + r1 + r2` (so `p1` means i0 = 2, `r2` means i1 = 3).

  Entry i is drawn by v when `upper_{i-1} <= v < upper_i`, compared as
  `cumsum(w) <= v * scale` (no division). The cumulative sums never
  decrease (w >= 0), so each comparison implies the ones before it and
  counting two of them gives i0 already capped at 2; i1 is at least i0 + 1
  (exact arithmetic gives that always; rounding of the sums can break it,
  and an all-zero group compares false everywhere): every group gets two
  distinct, valid indices (its 2:4 code). Bit for bit the indices of
  counting all three comparisons each and mending to `0 <= i0 < i1 <= 3`.
  """
  c0 = w[0]
  c1 = c0 + w[1]
  c2 = c1 + w[2]
  v0 = u * scale
  v1 = (u + 1.0) * scale
  p0, p1 = c0 <= v0, c1 <= v0
  return p0, p1, (c1 <= v1) | p0, (c2 <= v1) | p1


def _signed(mag: jax.Array, x: jax.Array) -> jax.Array:
  """`mag` (>= 0) with x's sign, 0 where x is 0 or NaN: one bit operation
  and one select (the kernel is bound by such integer-pipe operations)."""
  bits = (jax.lax.bitcast_convert_type(mag, jnp.uint32)
          | (jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0x80000000)))
  return jnp.where(jnp.abs(x) > 0, jax.lax.bitcast_convert_type(bits, jnp.float32), 0.0)


def sample(a: list[jax.Array], u: jax.Array):
  """The compressed MVUE draw of 4 float32 lanes: `(i0, i1, v0, v1)`, the
  kept indices (int32, i0 < i1) and their values `a_i / p_i` (float32),
  computed without division: `sign(a_i) * sum|a| / 2` in the spread case;
  in the capped case `a_i` for the largest entry and `sign(a_j) * rest` for
  the others (0 for a zero entry)."""
  w, scale, capped_first, capped, rest, total = _weights(a)
  p0, p1, r1, r2 = _draw_predicates(w, scale, u)
  # Each kept entry is picked out of 3 lanes by the draw's predicates, with
  # no integer compare of the indices (the kernel is bound by such
  # operations).
  pick0 = lambda lanes: jnp.where(p1, lanes[2], jnp.where(p0, lanes[1], lanes[0]))  # noqa: E731
  pick1 = lambda lanes: jnp.where(r2, lanes[3], jnp.where(r1, lanes[2], lanes[1]))  # noqa: E731
  other = jnp.where(capped, rest, total * 0.5)  # |a_j / p_j| of every entry but a capped top
  out = []
  for pick in (pick0, pick1):
    x = pick(a)
    out.append(_signed(jnp.where(pick(capped_first), jnp.abs(x), other), x))
  i0 = p0.astype(jnp.int32) + p1.astype(jnp.int32)
  i1 = 1 + r1.astype(jnp.int32) + r2.astype(jnp.int32)
  return i0, i1, out[0], out[1]


def check_gradient(fn: str, g: jax.Array, seed: jax.Array) -> None:
  """The arguments of `mvue24.mvue_compress` and its reference, checked
  (`fn` names the caller in the errors)."""
  if g.ndim != 2:
    raise ValueError(f"{fn}: `g` must be 2-D [M, N], got shape {g.shape}.")
  if g.dtype not in (jnp.bfloat16, jnp.float16):
    raise TypeError(f"{fn}: `g` must be bfloat16 or float16 (cuSPARSELt's 2:4"
                    f" formats), got {g.dtype}.")
  m, n = g.shape
  a = CUSPARSELT_ALIGN
  if m % a or n % a:
    raise ValueError(f"{fn}: M and N must be multiples of {a}, got g of shape {g.shape}.")
  if seed.shape != (2,) or seed.dtype != jnp.uint32:
    raise ValueError(f"{fn}: `seed` must be uint32[2], got {seed.dtype}{list(seed.shape)}.")


def mvue_compress_reference(g: jax.Array, seed: jax.Array, first_group=0,
                            row_stride: int | None = None):
  """What `mvue24.mvue_compress` computes, with XLA ops: `(values [M/2, N],
  meta uint8[M/8, N])` (the buffer's value rows, and the packed codes),
  the groups numbered as the kernel numbers them (`first_group`,
  `row_stride`: a block of a larger gradient draws what the whole would)."""
  check_gradient("mvue_compress_reference", g, seed)
  m, n = g.shape
  stride = n if row_stride is None else row_stride
  groups = g.reshape(m // 4, 4, n).astype(jnp.float32)
  rows = jnp.arange(m // 4, dtype=jnp.uint32)[:, None]
  index = (rows * jnp.uint32(stride) + jnp.arange(n, dtype=jnp.uint32)[None, :]
           + jnp.asarray(first_group).astype(jnp.uint32))
  u = uniform_of_group(seed[0], seed[1], index, rows % 2 == 1, stride)
  i0, i1, v0, v1 = sample([groups[:, l] for l in range(4)], u)
  values = jnp.stack([v0, v1], axis=1).reshape(m // 2, n).astype(g.dtype)
  codes = prune_rule.group_code(i0, i1)  # [M/4, N]
  return values, prune_rule.byte_of(codes[0::2], codes[1::2]).astype(jnp.uint8)
