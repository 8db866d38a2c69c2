"""2:4 masks by magnitude: the plain rule and the transposable 4x4 rule.

This module is the contract every backend's pruning must reproduce bit for
bit (the Pallas kernels are tested against it).

Ranking rule (plain 2:4). Inside each group of 4 consecutive elements along
`axis`, elements are ranked by magnitude `|w|` and the two largest are kept.
The order is total, so exactly two are kept in every group, whatever the
values are:

* larger magnitude first; `-0.0` and `+0.0` are equal, `-inf` and `+inf` are
  equal and larger than every finite value;
* NaN ranks above everything (all NaNs equal): a NaN weight is *kept*, so it
  stays visible in the output instead of being silently pruned away;
* equal magnitudes go to the lower index.

Transposable rule. Inside every 4x4 block of the last two axes, the kept set
must hold exactly 2 per row and 2 per column (90 such patterns). The chosen
pattern maximises, in this order: (1) the number of kept non-finite elements
(NaN or +-inf), (2) the float32 sum of the kept finite magnitudes, each row's
two added first and the rows added from the last up, row0 + (row1 + (row2 +
row3)) (magnitudes below the smallest normal float32, 1.2e-38, count as 0; a
sum that overflows is +inf and ties); (3) ties go to the first pattern in
`prune_rule.TRANSPOSABLE_PATTERNS` (lexicographic in the row pairs, pairs
ordered (0,1) (0,2) (0,3) (1,2) (1,3) (2,3)), which prefers lower indices in
earlier rows.
Where only float32 rounding makes patterns tie, the rule is applied row by row:
the first row 0 pair among the best patterns, then, among its patterns, the
first row 1 pair whose rows 1-3 sum the most, then the first rows 2-3 pairs
whose sum is the largest. (That is the order in which a search over the rows
from the last up, a dynamic program over the column counts, decides; it does
a third of the work of scoring the 90 patterns one by one.)

The tables and bit codes of both rules are `pallas_kernels.prune_rule`'s,
which the Pallas kernels import too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from jsparse24 import _checks
from jsparse24._sharding import typed_like
from pallas_kernels import prune_rule as rule


# The implementations are jitted so that eager calls (model init, mask
# rebuilds outside jit) run one compiled program, not dozens of small ones.
@functools.partial(jax.jit, static_argnums=1)
def _prune_plain(w: jax.Array, axis: int) -> jax.Array:
  wt = jnp.moveaxis(w, axis, -1)
  groups = wt.reshape(wt.shape[:-1] + (wt.shape[-1] // 4, 4))
  key = rule.magnitude_key(groups)
  keep = jnp.stack(rule.keep_two_of_four([key[..., i] for i in range(4)]), axis=-1)
  return jnp.moveaxis(keep.reshape(wt.shape), -1, axis)


def _search_tables() -> tuple[np.ndarray, np.ndarray]:
  """The dynamic program's tables (`prune_rule`'s plan) as index arrays. LOW:
  for each of the 19 column counts that rows 2-3 can have, their choices
  (q2, q3) as indices 6 q2 + q3 in lexicographic order, padded to 6 with 36
  (a slot that never wins); ROW1[q0, q1]: which of the 19 rows 2-3 must have
  under rows 0-1 (q0, q1)."""
  low = np.full((len(rule.LOW_CHOICES), 6), 36, np.int32)
  for i, choices in enumerate(rule.LOW_CHOICES):
    low[i, :len(choices)] = [6 * q2 + q3 for q2, q3 in choices]
  return low, np.asarray(rule.ROW1_LOW, np.int32)


_LOW, _ROW1 = _search_tables()
_PAIRS = np.asarray(rule.PAIRS)


def _first_best(count: jax.Array, score: jax.Array) -> jax.Array:
  """Index of the first maximum of (count, score) along the last axis
  (scores are >= 0 or +inf, so -1 rules an entry out)."""
  best = count.max(axis=-1, keepdims=True)
  return jnp.argmax(jnp.where(count == best, score, -1.0), axis=-1)


def _take(a: jax.Array, i: jax.Array) -> jax.Array:
  """a[..., i] for one index per row: `a` [..., n], `i` [...] -> [...]."""
  return jnp.take_along_axis(a, i[..., None], axis=-1)[..., 0]


@jax.jit
def _prune_transposable(w: jax.Array) -> jax.Array:
  *lead, rows, cols = w.shape
  blocks = w.reshape(*lead, rows // 4, 4, cols // 4, 4)
  blocks = jnp.moveaxis(blocks, -3, -2)  # [..., R/4, C/4, 4, 4]
  finite = jnp.isfinite(blocks)
  mag = jnp.where(finite, jnp.abs(blocks), 0).astype(jnp.float32)
  # Subnormal magnitudes count as 0: some platforms flush them in float32
  # arithmetic (XLA on CPU does), so flushing explicitly keeps the choice
  # identical everywhere.
  mag = jnp.where(mag < np.finfo(np.float32).tiny, 0.0, mag)
  nonfinite = (~finite).astype(jnp.int32)
  i_idx, j_idx = _PAIRS[:, 0], _PAIRS[:, 1]
  ps = mag[..., i_idx] + mag[..., j_idx]  # [..., 4 rows, 6 pairs]
  pc = nonfinite[..., i_idx] + nonfinite[..., j_idx]
  # Rows 2-3: the best of each of the 19 column counts (slot 36 never wins).
  a, b = np.repeat(np.arange(6), 6), np.tile(np.arange(6), 6)  # index 6 q + q'
  pad = ((0, 0),) * (ps.ndim - 2) + ((0, 1),)
  low_sum = jnp.pad(ps[..., 2, a] + ps[..., 3, b], pad, constant_values=-1.0)[..., _LOW]
  low_cnt = jnp.pad(pc[..., 2, a] + pc[..., 3, b], pad, constant_values=-1)[..., _LOW]
  pick = _first_best(low_cnt, low_sum)  # [..., 19]
  low = _take(jnp.broadcast_to(_LOW, low_sum.shape), pick)
  low_sum, low_cnt = _take(low_sum, pick), _take(low_cnt, pick)
  # Row 1 on top, for each row 0 pair: [..., 6 (q0), 6 (q1)].
  s1 = ps[..., 1, None, :] + low_sum[..., _ROW1]
  c1 = pc[..., 1, None, :] + low_cnt[..., _ROW1]
  q1 = _first_best(c1, s1)  # [..., 6]
  s1, c1 = _take(s1, q1), _take(c1, q1)
  q0 = _first_best(pc[..., 0, :] + c1, ps[..., 0, :] + s1)  # [...]
  q1 = _take(q1, q0)
  low = _take(low, jnp.asarray(_ROW1)[q0, q1])
  row_pairs = jnp.stack([q0, q1, low // 6, low % 6], axis=-1)  # [..., 4]
  pair_masks = np.asarray([rule.column_counts(q) for q in range(6)], bool)
  keep = jnp.asarray(pair_masks)[row_pairs]  # [..., R/4, C/4, 4, 4]
  keep = jnp.moveaxis(keep, -2, -3)
  return keep.reshape(w.shape)


def prune_24(
    w: Float[Array, "..."],
    *,
    axis: int = -2,
    transposable: bool = False,
) -> Bool[Array, "..."]:
  """The 2:4 mask of `w` by magnitude (True = kept).

  Args:
    w: floating weights. For a Flax kernel `[in, out] = [K, N]` the default
      `axis=-2` is the contraction axis K.
    axis: the axis along which every 4 consecutive elements keep 2.
    transposable: if True, choose the exact best of the 90 patterns with 2
      kept per row and per column in every 4x4 block of the last two axes, so
      that the mask is 2:4 along both of them (then `axis` must be one of the
      last two axes, and both must be multiples of 4).

  Returns:
    A bool array shaped like `w` with exactly 2 True in every group of 4.
    The ranking rule (NaN, inf, zeros, ties) is in this module's docstring.

  Example:
    >>> import jax.numpy as jnp, jsparse24
    >>> w = jnp.array([[1., -4.], [-3., 0.], [2., 2.], [0., 1.]])
    >>> jsparse24.prune_24(w).T.astype(int)
    Array([[0, 1, 1, 0],
           [1, 0, 1, 0]], dtype=int32)
  """
  fn = "prune_24"
  _checks.check_flag(fn, "transposable", transposable)
  _checks.check_float(fn, "w", w)
  w = jnp.asarray(w)
  if w.ndim == 0:
    raise ValueError(f"{fn}: `w` must have at least one axis, got a scalar.")
  ax = _checks.normalize_axis(fn, "w", axis, w.ndim)
  if not transposable:
    _checks.check_multiple_of_4(fn, "w", w.shape, ax)
    # (Explicit mesh axes: a sharded w's group reshapes are partitioned by XLA.)
    return typed_like(lambda w: _prune_plain(w, ax), w, w)
  if w.ndim < 2:
    raise ValueError(
        f"{fn}: transposable=True needs `w` with at least 2 axes, got shape"
        f" {w.shape}.")
  if ax < w.ndim - 2:
    raise ValueError(
        f"{fn}: transposable=True makes 4x4 blocks of the last two axes, so"
        f" `axis` must be one of them; got axis={axis} for rank {w.ndim}.")
  _checks.check_multiple_of_4(fn, "w", w.shape, w.ndim - 2,
                              "transposable masks need both of the last two axes")
  _checks.check_multiple_of_4(fn, "w", w.shape, w.ndim - 1,
                              "transposable masks need both of the last two axes")
  return typed_like(_prune_transposable, w, w)


def is_24(mask: Bool[Array, "..."], *, axis: int = -2) -> jax.Array:
  """True iff every group of 4 along `axis` keeps exactly 2 (a scalar bool)."""
  _checks.check_dense_array("is_24", "mask", mask)
  mask = jnp.asarray(mask)
  _checks.check_mask_dtype("is_24", mask)
  ax = _checks.normalize_axis("is_24", "mask", axis, mask.ndim)
  _checks.check_multiple_of_4("is_24", "mask", mask.shape, ax)
  m = jnp.moveaxis(mask, ax, -1)
  counts = m.reshape(m.shape[:-1] + (-1, 4)).sum(-1)
  return jnp.all(counts == 2)
