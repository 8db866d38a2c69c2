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
* `draw`: two entries by systematic sampling with one uniform number `u`:
  the entries whose interval `[upper_{i-1}, upper_i)` of the cumulative sums
  of `p` holds `u` and `u + 1` (`upper_3` = 2). Entry `i` is drawn with
  probability `p_i`; the two draws are distinct (each interval is at most 1
  long), and rounding that would break that is mended, so that every group
  always gets two distinct, valid indices (its 2:4 code).
* a drawn entry's value becomes `a_i / p_i`: the estimate is unbiased.

The kernel is bound by the GPU's integer/logic pipe (compares, selects,
bit operations; benchmarks/NOTES.md, fifth session), so the rule is written
to spend few of those and no divisions (a long instruction sequence on the
GPU): `p_i = w_i / S` for weights `w` and a scale `S` (`_weights`), the draw
compares the cumulative sums of `w` with `u * S`, and `a_i / p_i` is
`sign(a_i) * S_i` in closed form (`sample`).
* `uniform`: `u` from a counter-based hash of (a 64-bit seed, the group's
  index), so that a kernel tile computes the numbers of its own groups with no
  random-number state and no extra memory traffic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _mix32(x: jax.Array) -> jax.Array:
  """A bijective avalanche mix of uint32 (the "lowbias32" constants of Chris
  Wellons' hash-prospector, which measured near-ideal avalanche)."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def uniform(seed0: jax.Array, seed1: jax.Array, index: jax.Array) -> jax.Array:
  """float32 in [0, 1) (multiples of 2^-23: 23 random bits, so that u + 1
  is exact in float32) for uint32 `index` under the uint32 seed pair: two
  rounds of `_mix32`, each keyed by one seed word."""
  h = _mix32(_mix32(index ^ seed0) + seed1)
  # (h >> 9) * 2^-23 without an int -> float conversion: the 23 bits as the
  # mantissa of a float in [1, 2), minus 1 (exact, so the same bits).
  one_plus_u = jax.lax.bitcast_convert_type((h >> 9) | jnp.uint32(0x3F800000), jnp.float32)
  return one_plus_u - 1.0


def _weights(a: list[jax.Array]):
  """The rule's unnormalised form: `(m, w, S, capped, rest)` with `p_i = w_i / S`.

  Spread case (no entry holds half the magnitude): `w_i = 2|a_i|`, `S = sum|a|`.
  Capped case: the first largest entry has `w = S`, each other `w_j = |a_j|`,
  `S = rest` (the others' sum); when the others are all zero, `w_j = 1` and
  `S = 3` (one of them uniformly, its value being 0 either way).
  """
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
  capped = 2.0 * top >= total
  none_left = rest == 0
  scale = jnp.where(capped, jnp.where(none_left, 3.0, rest), total)
  w = [jnp.where(capped, jnp.where(f, scale, jnp.where(none_left, 1.0, x)), 2.0 * x)
       for x, f in zip(m, first)]
  return m, w, scale, capped, first, rest, total


def probabilities(a: list[jax.Array]) -> list[jax.Array]:
  """The keep probabilities (float32) of 4 float32 lanes `a` (module docstring).
  (Reporting only: `sample` draws without dividing.)"""
  _, w, scale, *_ = _weights(a)
  safe = jnp.where(scale > 0, scale, 1.0)
  return [jnp.where(scale > 0, x / safe, 0.5) for x in w]


def draw(w: list[jax.Array], scale: jax.Array, u: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(i0, i1) int32, i0 < i1: the entries drawn by `u` and `u + 1` from the
  weights `w` (`p = w / scale`): entry i is drawn by v when
  `upper_{i-1} <= v < upper_i`, compared as `cumsum(w) <= v * scale` (no
  division)."""
  c0 = w[0]
  c1 = c0 + w[1]
  c2 = c1 + w[2]
  v0 = u * scale
  v1 = (u + 1.0) * scale
  i0 = (c0 <= v0).astype(jnp.int32) + (c1 <= v0).astype(jnp.int32) + (c2 <= v0).astype(jnp.int32)
  i1 = (c0 <= v1).astype(jnp.int32) + (c1 <= v1).astype(jnp.int32) + (c2 <= v1).astype(jnp.int32)
  # Exact arithmetic gives i0 < i1 always; rounding of the sums can (rarely)
  # give equal draws or i0 = 3, and an all-zero group draws (3, 3). Mend to a
  # valid pair.
  i0 = jnp.minimum(i0, 2)
  i1 = jnp.minimum(jnp.maximum(i1, i0 + 1), 3)
  return i0, i1


def _pick3(lanes: list[jax.Array], i: jax.Array, lo: int) -> jax.Array:
  """`lanes[i]` for i in {lo, lo + 1, lo + 2}."""
  return jnp.where(i == lo, lanes[lo], jnp.where(i == lo + 1, lanes[lo + 1], lanes[lo + 2]))


def sample(a: list[jax.Array], u: jax.Array):
  """The compressed MVUE draw of 4 float32 lanes: `(i0, i1, v0, v1)`, the
  kept indices (int32, i0 < i1) and their values `a_i / p_i` (float32),
  computed without division: `sign(a_i) * sum|a| / 2` in the spread case;
  in the capped case `a_i` for the largest entry and `sign(a_j) * rest` for
  the others (0 for a zero entry)."""
  _, w, scale, capped, first, rest, total = _weights(a)
  i0, i1 = draw(w, scale, u)
  half = total * 0.5
  out = []
  # i0 is 0, 1 or 2 and i1 is 1, 2 or 3 (`draw`): each picks from 3 lanes,
  # two selects instead of `pick`'s three (the kernel is bound by these
  # integer-pipe operations, benchmarks/NOTES.md).
  for i, lo in ((i0, 0), (i1, 1)):
    x = _pick3(a, i, lo)
    mag = jnp.where(capped, jnp.where(_pick3(first, i, lo), jnp.abs(x), rest), half)
    out.append(jnp.where(x > 0, mag, jnp.where(x < 0, -mag, 0.0)))
  return i0, i1, out[0], out[1]
