"""A layer's phase fixed when the step is traced: `STATIC_DENSE`, and how a
product reads its `active` argument.

A layer's `"active"` entry in the `"sparsity"` collection is one of:
- None: 2:4, decided at trace time (no run-time switch);
- `STATIC_DENSE`: dense, decided at trace time (no run-time switch, and no
  pruning or compression of the kernel);
- a bool array: a run-time flag, for which every product carries a
  conditional between its 2:4 and dense computations (on a GPU each one
  copies its predicate to the host and stalls the launch queue:
  docs/design_notes.md, "No branch around the product for a schedule's
  dense phase").

`STATIC_DENSE` is a pytree with no leaves, so that it passes through
`jax.jit`, `nn.scan` and `nn.vmap` as static data: a Python or NumPy
`False` would be a leaf, which `nn.scan` slices into a traced value.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jsparse24._checks import is_concrete


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _StaticDense:

  def __repr__(self) -> str:
    return "jsparse24.linen.STATIC_DENSE"


STATIC_DENSE = _StaticDense()


def is_static_dense(active) -> bool:
  return isinstance(active, _StaticDense)


def resolve(active):
  """`active` as the products take it: None (2:4), `STATIC_DENSE`, or a
  traced bool scalar. A concrete scalar flag (a NumPy constant made while
  tracing, or an array outside `jax.jit`) is decided here, so that no
  conditional is traced for it."""
  if active is None or is_static_dense(active):
    return active
  if not is_concrete(active) or jnp.ndim(active) != 0:
    return jnp.asarray(active, jnp.bool_)
  return None if bool(active) else STATIC_DENSE
