"""The dense XLA products that every backend shares: `matmul` (float32
accumulation), and the weight gradient `dw = x^T dy` (`weight_grad`: as
nn.Dense's autodiff computes it, or from the MVUE-pruned `dy`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from jsparse24._mvue import mvue_24
from jsparse24._phase import is_static_dense
from jsparse24._sharding import weight_grad_sharding

if TYPE_CHECKING:
  from jsparse24.backends.base import Backend, DotConfig


def accumulation_dtype(dtype) -> Any:
  return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def matmul(a: jax.Array, b: jax.Array, precision: Any = None) -> jax.Array:
  """`a @ b` over the last axis of a and first of b, written in their
  result dtype as nn.Dense's product is (XLA accumulates 16-bit products in
  float32 on the GPU and rounds once, so the bits are those of a float32
  product cast down).

  Asking XLA for a float32 product instead writes the float32 output and
  casts it in a second kernel wherever the cast is not fused into the
  product's epilogue (cuBLAS's does not): for a bfloat16 [16384, 16384]
  output, 1 GiB written, read and 0.5 GiB written again. At train_lm's
  gpu preset it made the step of a 2:4 model whose 4 MLP layers were all
  in a dense phase 2.3 ms slower than the dense model's
  (benchmarks/results/nvidia-h200.md, "A dense layer of a 2:4 model costs
  what nn.Dense costs")."""
  return jax.lax.dot_general(
      a, b, (((a.ndim - 1,), (0,)), ((), ())), precision=precision,
      preferred_element_type=jnp.result_type(a.dtype, b.dtype))


def weight_grad(x: jax.Array, dy: jax.Array, w: jax.Array, cfg: DotConfig,
                key: jax.Array | None = None, active: jax.Array | None = None,
                backend: Backend | None = None) -> jax.Array:
  """`dw = x^T dy` in w's own dtype (`dense_weight_grad`: as nn.Dense's
  autodiff computes it); with `cfg.weight_grad == "mvue"`, `x^T
  mvue_24(dy, key)` (dy pruned 2:4 along M, unbiased;
  `backend.mvue_weight_grad`, by default XLA's dense product of the pruned
  dy) where `active` (None: always; `STATIC_DENSE`: never) is True.
  """
  if cfg.weight_grad != "mvue" or is_static_dense(active):
    return dense_weight_grad(x, dy, w, cfg.precision)
  if key is None:
    # A layer applied without its rng stream: fine for inference, but the
    # gradient needs the key. (Raised while JAX traces the gradient.)
    raise ValueError(
        "SparseDense / SparseLinear with weight_grad='mvue': its gradient draws from the"
        " 'mvue' rng stream, and the layer was applied without it; pass"
        " rngs={'mvue': key} to `apply` (a new key per step, e.g."
        " jax.random.fold_in(key, step)), or give an NNX layer an 'mvue' stream.")
  if backend is None:  # the reference backend's products
    pruned = lambda: mvue_weight_grad_xla(x, dy, w, key, cfg.precision)  # noqa: E731
  else:
    pruned = lambda: backend.mvue_weight_grad(x, dy, w, key, cfg.precision)  # noqa: E731
  if active is None:
    return pruned()
  # A schedule's dense phase keeps the exact gradient.
  return jax.lax.cond(active, pruned, lambda: dense_weight_grad(x, dy, w, cfg.precision))


def mvue_weight_grad_xla(x, dy, w, key, precision) -> jax.Array:
  return dense_weight_grad(x, mvue_24(dy, key, axis=0), w, precision)


def dense_weight_grad(x: jax.Array, dy: jax.Array, w: jax.Array, precision: Any) -> jax.Array:
  """`x^T dy` by XLA in x's dtype (accumulated in float32 on the GPU), then
  cast to w's dtype (and sharding, where the mesh axes are Explicit): the
  same operations, and so the same bits, as the gradient of nn.Dense's
  kernel.

  A float32 product would keep the bits that the rounding to x's dtype
  drops, but under nn.scan it costs more than it gives: the stacked
  gradient takes each layer's float32 product by a copy (4 bytes read and
  4 written per weight), where a 16-bit product is converted in the
  fusion that writes the stack (2 read, 4 written), as the dense model's
  is (docs/design_notes.md, "The weight gradient in the input's dtype")."""
  sharding = weight_grad_sharding(w, x, dy)  # Explicit mesh axes: dw sharded like w
  kw = {} if sharding is None else {"out_sharding": sharding}
  out = jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())), precision=precision, **kw)
  return out.astype(w.dtype)


def as_weight_grad(dw: jax.Array, w: jax.Array, *operands: jax.Array) -> jax.Array:
  """A weight gradient that a backend's own product computed (from
  `operands`), typed as `dense_weight_grad`'s: w's dtype, and w's sharding
  where its mesh axes are Explicit."""
  dw = dw.astype(w.dtype)
  sharding = weight_grad_sharding(w, *operands)
  return dw if sharding is None else jax.sharding.reshard(dw, sharding)
