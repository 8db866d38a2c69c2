"""The forward pass shared by the Linen and NNX sparse dense layers."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jsparse24._format import Mask24, Sparse24
from jsparse24._ops import sparse_or_dense_dot
from jsparse24._options import SparsityOptions


def sparse_dense_forward(inputs: jax.Array, kernel: jax.Array | Sparse24, bias: jax.Array | None,
                         mask: Mask24 | None, active: jax.Array | None, opts: SparsityOptions,
                         *, precision: Any, preferred_element_type: Any = None,
                         key: jax.Array | None = None, fn: str = "SparseDense") -> jax.Array:
  """`inputs @ (kernel * mask) + bias`; the plain dense product while `active`
  is False (dense phases of a schedule). `mask=None, active=None` prunes
  `kernel` by magnitude now. `inputs` and `bias` are already promoted to the
  compute dtype; `kernel` is in its parameter dtype (float32 in mixed
  precision) and is cast to the compute dtype inside the product, which then
  returns its gradient in the parameter dtype directly. `kernel` may also be
  a `Sparse24` in the compute dtype (a compressed layer: `mask` and `active`
  None, `opts.weight_grad` "dense"). `opts`: the layer's
  options, `transposable` resolved (`resolve_transposable`); `key`: as in
  `sparse_dot`; `fn`: the layer, for errors."""
  out_dtype = inputs.dtype if preferred_element_type is None else preferred_element_type
  y = sparse_or_dense_dot(inputs, kernel, mask, active, opts, precision=precision,
                          dtype=inputs.dtype, key=key, fn=fn)
  y = y.astype(out_dtype)
  if bias is not None:
    y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
  return y
