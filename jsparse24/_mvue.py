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
entries past the last whole group (`size % 4` of them) are kept exactly. A
group holding a NaN or an infinity has no unbiased estimate: what it comes out
as is unspecified (a NaN may be dropped, or moved within its group; an
infinity kept or moved), unlike `prune_24`, which keeps them in place. The
rule spends no operations on them in the GPU kernel, which is bound by such
operations; in `sparse_dot` the input's gradient, exact, carries them on.

The rule itself (`pallas_kernels.mvue_rule`) is shared with the GPU kernel
that prunes and compresses `dy` in one pass for the cuSPARSELt product: the
uniform numbers are a counter-based hash of a seed drawn from `key` and the
group's number (two neighbouring groups along `axis` take the high and the
low 16 bits of one hash), so the kernel and this reference draw the same
groups.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jsparse24 import _checks
from pallas_kernels import mvue_rule as rule


def mvue_24_probabilities(g: Float[Array, "..."], *, axis: int = 0) -> jax.Array:
  """The keep probability of every entry of `g` under `mvue_24` (float32,
  shape of `g`; the entries past the last whole group have probability 1)."""
  g, axis, head, tail = _split(g, axis, "mvue_24_probabilities")
  p = jnp.stack(rule.probabilities(_lanes(_groups(head, axis))), axis=-1)
  return jnp.concatenate([_ungroup(p, axis, head.shape), jnp.ones(tail.shape, jnp.float32)],
                         axis=axis)


def mvue_seeds(key: jax.Array) -> jax.Array:
  """The uint32[2] seed of `mvue_24`'s counter-based numbers for `key`."""
  return jax.random.bits(key, (2,), jnp.uint32)


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
  g, axis, head, tail = _split(g, axis, "mvue_24")
  _checks.check_key("mvue_24", "key", key, "the MVUE rule's draw")
  if head.shape[axis] == 0:
    return g
  groups = _groups(head, axis)  # [..., G, ..., 4] with the group entries last
  seed = mvue_seeds(key)
  # Group number j (row-major over the grouped shape): for a [M, N] gradient
  # pruned along M, group (r, c) is j = r * N + c, as the kernel numbers
  # them; the groups r = 2t and 2t + 1 of a column share one hash (of
  # 2t's number), as the kernel's do.
  index = jnp.arange(groups[..., 0].size, dtype=jnp.uint32).reshape(groups.shape[:-1])
  row = jax.lax.broadcasted_iota(jnp.uint32, index.shape, axis)
  stride = math.prod(index.shape[axis + 1:])
  u = rule.uniform_of_group(seed[0], seed[1], index, row % 2 == 1, stride)
  i0, i1, v0, v1 = rule.sample(_lanes(groups), u)
  out = jnp.stack([jnp.where(i0 == l, v0, jnp.where(i1 == l, v1, 0.0)) for l in range(4)],
                  axis=-1).astype(g.dtype)
  return jnp.concatenate([_ungroup(out, axis, head.shape), tail], axis=axis)


def _lanes(groups: jax.Array) -> list[jax.Array]:
  """The 4 entries of every group (last axis) as 4 float32 arrays."""
  return [groups[..., l].astype(jnp.float32) for l in range(4)]


def _split(g, axis: int, fn: str):
  """(g as an array, axis made non-negative, the whole groups of 4 along
  it, the `size % 4` entries after them); `fn` names the caller in the
  errors for a `g` that is not a float array or an `axis` out of range."""
  _checks.check_float(fn, "g", g)
  g = jnp.asarray(g)
  axis = _checks.normalize_axis(fn, "g", axis, g.ndim)
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
