"""The reference backend: masked dense products in plain `jnp`.

Runs everywhere (CPU, GPU, TPU) and defines the contract the other backends are
tested against. Its operand is `(w * mask, mask)`: the forward builds the
masked weight once and the backward reuses it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jsparse24._format import Mask24, Sparse24, compress_reference, decompress
from jsparse24._prune import prune_24
from jsparse24.backends.base import Backend


def accumulation_dtype(dtype) -> Any:
  return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def matmul(a: jax.Array, b: jax.Array, precision: Any = None) -> jax.Array:
  """`a @ b` over the last axis of a and first of b, fp32 accumulation."""
  out = jax.lax.dot_general(
      a, b, (((a.ndim - 1,), (0,)), ((), ())), precision=precision,
      preferred_element_type=accumulation_dtype(a.dtype))
  return out.astype(jnp.result_type(a.dtype, b.dtype))


def dense_mask(w: jax.Array, mask: jax.Array | Mask24 | None,
               transposable: bool) -> jax.Array:
  if mask is None:
    return prune_24(w, axis=-2, transposable=transposable)
  if isinstance(mask, Mask24):
    return mask.unpack()
  return mask


class XlaBackend(Backend):
  name = "xla"

  def compress(self, w, mask, transposed):
    return compress_reference(w, mask, transposed)

  def prepare(self, w, mask, transposable):
    m = jax.lax.stop_gradient(dense_mask(w, mask, transposable))
    return jnp.where(m, w, jnp.zeros((), w.dtype)), m

  def forward(self, x, operand, precision):
    return matmul(x, operand[0], precision)

  def backward_dx(self, dy, operand, precision):
    return matmul(dy, operand[0].T, precision)

  def mask_grad(self, dw, operand):
    return jnp.where(operand[1], dw, jnp.zeros((), dw.dtype))

  def forward_compressed(self, x, sp: Sparse24, precision):
    return matmul(x, decompress(sp), precision)
