"""Minimum-variance unbiased 2:4 pruning (MVUE) of a gradient.

`mvue_24(g, key, axis)` keeps 2 of every 4 consecutive entries of `g` along
`axis`, at random, and rescales what it keeps so that the result is an
unbiased estimate of `g`: `E[mvue_24(g, key)] = g` over keys (Chmiel et al.,
"Minimum Variance Unbiased N:M Sparsity for the Neural Gradients", ICLR 2023;
used for the weight gradient by Hu et al., ICML 2024). jsparse24 applies it to
the output gradient `dy` along the token axis M, the contraction axis of
`dw = x^T dy`, so that this third product can run on the sparse tensor cores.

The rule, per group `a` of 4: entry `i` is kept with probability `p_i`, where
`p_i = 2|a_i| / sum|a|` when no entry holds half of the group's magnitude;
otherwise the largest entry is kept always (`p = 1`) and each other with
probability `|a_j| / (sum|a| - max|a|)` (the minimum-variance marginals with
`sum p = 2`, each at most 1). Exactly 2 entries are drawn with these marginals
by systematic sampling (one uniform number per group); a kept entry becomes
`a_i / p_i`. The variance of entry `i` is `a_i^2 (1/p_i - 1)`. A group with at
most 2 non-zero entries is kept exactly; an all-zero group stays zero. The
entries past the last whole group (`size % 4` of them) are kept exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def mvue_24_probabilities(g: Float[Array, "..."], *, axis: int = 0) -> jax.Array:
  """The keep probability of every entry of `g` under `mvue_24` (float32,
  shape of `g`; the entries past the last whole group have probability 1)."""
  g, axis, head, tail = _split(g, axis)
  p = _ungroup(_probabilities(_groups(head, axis)), axis, head.shape)
  return jnp.concatenate([p, jnp.ones(tail.shape, jnp.float32)], axis=axis)


def mvue_24(g: Float[Array, "..."], key: jax.Array, *, axis: int = 0) -> jax.Array:
  """`g` pruned 2:4 along `axis` by the MVUE rule (module docstring), the kept
  entries rescaled; same shape and dtype as `g`. Deterministic for a given
  key. The selection and the rescaling are computed in float32.

  Example:
    >>> import jax, jax.numpy as jnp, jsparse24
    >>> g = jnp.array([4., 3., 2., 1.])
    >>> out = jsparse24.mvue_24(g, jax.random.key(0))
    >>> int((out != 0).sum())
    2
    >>> jsparse24.mvue_24_probabilities(g).tolist()  # kept g_i becomes g_i / p_i
    [0.800000011920929, 0.6000000238418579, 0.4000000059604645, 0.20000000298023224]
  """
  g, axis, head, tail = _split(g, axis)
  if head.shape[axis] == 0:
    return g
  groups = _groups(head, axis)  # [..., G, ..., 4] with the group entries last
  a = groups.astype(jnp.float32)
  p = _probabilities(groups)
  u = jax.random.uniform(key, a.shape[:-1], jnp.float32)
  upper = jnp.cumsum(p, axis=-1)
  # The marginals add up to 2; pin the last bound so that rounding never
  # leaves the second draw (u + 1) outside every interval.
  upper = upper.at[..., 3].set(2.0)
  lower = upper - p
  # Entry i is drawn when u or u + 1 falls in [lower_i, upper_i): exactly 2
  # entries in all (the counts telescope to floor(2 - u) - floor(-u) = 2),
  # entry i with probability p_i (each interval is at most 1 long).
  kept = (jnp.floor(upper - u[..., None]) - jnp.floor(lower - u[..., None])) > 0
  out = jnp.where(kept, a / jnp.where(kept, p, 1.0), 0.0).astype(g.dtype)
  return jnp.concatenate([_ungroup(out, axis, head.shape), tail], axis=axis)


def _split(g, axis: int):
  """(g as an array, axis made non-negative, the whole groups of 4 along
  it, the `size % 4` entries after them)."""
  g = jnp.asarray(g)
  axis = axis % g.ndim
  whole = g.shape[axis] - g.shape[axis] % 4
  return (g, axis, jax.lax.slice_in_dim(g, 0, whole, axis=axis),
          jax.lax.slice_in_dim(g, whole, g.shape[axis], axis=axis))


def _ungroup(groups: jax.Array, axis: int, shape: tuple[int, ...]) -> jax.Array:
  """Inverse of `_groups`: back to `shape`."""
  return jnp.moveaxis(groups, -1, axis + 1).reshape(shape)


def _groups(g: jax.Array, axis: int) -> jax.Array:
  """`g` (its `axis` a multiple of 4) with that axis split into groups of 4,
  the 4 entries of a group on a new last axis."""
  shape = g.shape[:axis] + (g.shape[axis] // 4, 4) + g.shape[axis + 1:]
  return jnp.moveaxis(g.reshape(shape), axis + 1, -1)


def _probabilities(groups: jax.Array) -> jax.Array:
  """Keep probabilities (float32) of groups of 4 on the last axis; each
  group's add up to 2."""
  mag = jnp.abs(groups.astype(jnp.float32))
  total = jnp.sum(mag, axis=-1, keepdims=True)
  top = jnp.max(mag, axis=-1, keepdims=True)
  first_top = jnp.arange(4) == jnp.argmax(mag, axis=-1)[..., None]
  # Summed directly, not `total - top`: with two non-zeros the other one's
  # probability is then exactly 1 (the difference can round above it).
  rest = jnp.sum(jnp.where(first_top, 0.0, mag), axis=-1, keepdims=True)
  # One entry with half the magnitude or more: keep it, draw one of the
  # other three by magnitude (uniformly when they are all zero: their kept
  # value is 0 either way).
  capped = jnp.where(first_top, 1.0,
                     jnp.where(rest > 0, mag / jnp.where(rest > 0, rest, 1.0), 1.0 / 3.0))
  spread = 2.0 * mag / jnp.where(total > 0, total, 1.0)
  # At most 1 each, so that no entry can take both draws.
  return jnp.minimum(jnp.where(2.0 * top >= total, capped, spread), 1.0)
