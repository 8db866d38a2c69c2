"""2:4 activations: the product `y = prune(x) @ w` whose input is pruned 2:4
along K at every call (`SparsityOptions.input_sparsity`), its gradients, and
their plain-`jnp` reference.

Where it comes from. Haziza et al., "Accelerating Transformer Inference and
Training with 2:4 Activation Sparsity" (Meta, 2025; arXiv 2503.16672,
https://arxiv.org/html/2503.16672v1; OpenReview O5feVk7p6Y). What the
sources read for this module establish (2026-11-27):

- The abstract: 2:4 sparsity applied to activations, exploiting the
  intrinsic sparsity of Squared-ReLU activations "with no accuracy loss";
  up to 1.3x faster feed-forward networks (FFNs) in the forward and the
  backward pass. The pruned activation is the input of the FFN's second
  (down) projection, the output of the squared ReLU.
- One of its authors (pytorch/ao issue #1920, 2025-03-18): squared-ReLU
  FFNs reach > 85% activation sparsity with minimal to no accuracy loss
  against SwiGLU; the forward pass is sparsified "naively, dropping values
  to fit the 2:4 constraint if they do not fit", and "for the backwards
  pass, we need some special sauce to maintain accuracy".
- A third-party summary of the paper (sciencestack.ai) names that sauce: an
  FP8 three-kernel FFN path, a 95/5 feature split and a token permutation
  "to enable effective backward sparsity". The paper's method section
  itself could not be read here, so those two are not implemented: they
  serve to run the weight gradient, whose contraction runs over the tokens,
  on the sparse tensor cores (a 2:4 pattern along the tokens), which this
  module does not do.
- xformers (facebookresearch/xformers, `xformers/ops/sp24.py`), the
  authors' library: `sparsify24(x, gradient=...)` gives the pruned input's
  gradient either the forward's own 2:4 pattern (`"24sparse"`, the default,
  and `"24dense"`: the same values, dense) or passes it through unpruned
  (`sparsify24_ste`, "the gradient is *not* sparsified").

The gradients here, for `y = (x * m) @ w` with `m = prune_24(x, axis=-1)`
(the magnitude rule of `jsparse24.prune_24`: the 2 largest `|x|` of every 4
consecutive along K, ties to the lower index):

- `dw = (x * m)^T @ dy`: exact (the gradient of the product that ran; no
  approximation of the paper's sparse weight gradient is made).
- `dx`, `"masked"`: `(dy @ w^T) * m`, the derivative of the pruned product
  (the mask held fixed, as a ReLU's is), and xformers' default. Behind a
  squared ReLU its zeros carry on: the gradient into the up projection is
  2:4 along the same axis, which lets the up projection's `dx` run on the
  sparse tensor cores too (`grad_output`, below).
- `dx`, `"ste"`: `dy @ w^T` (straight-through: pruned inputs receive the
  gradient they would have had unpruned).
- `dx` under `grad_output="2:4"` (`SparsityOptions.grad_output`; any of the
  input options, `"off"` included): `prune_24(dy, axis=-1) * dy @ w^T`, the
  output gradient pruned 2:4 along N by magnitude, on `"cusparselt"` with
  the pruned `dy` as the sparse operand. It equals `dy @ w^T` wherever `dy`
  is 2:4 already, which is the case on the layer before one with
  `input_sparsity="masked"` and an elementwise activation between them (a
  feed-forward's up projection: the masked `dx` of the down projection is
  zero where its input was pruned, and the activation's derivative keeps
  those zeros); on any other `dy` it is an approximation of `dx`. `y` and
  `dw` are the product's without it (`dw` from the whole `dy`).

The operation is a `jax.custom_vjp` so that the backends' kernels slot into
its forward (prune + compress `x` once) and `dx` products; its
residuals are `x` and `w`, and the mask is recomputed from `x` in the
backward pass (one elementwise pass that XLA fuses into the products'
operands) rather than stored. Reverse mode only: `jax.jvp` of it raises
JAX's error for a `custom_vjp`. Under `jax.vmap` over `x` with a shared `w`
the backward is batched by JAX: `dw` is formed per example and summed.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jsparse24._options import GRAD_OUTPUTS, INPUT_SPARSITY
from jsparse24._prune import prune_24
from jsparse24.backends._products import accumulation_dtype, dense_weight_grad


def input_mask(x: jax.Array) -> jax.Array:
  """The bool 2:4 mask of `x[..., K]` along K by magnitude (`prune_24`)."""
  return prune_24(x, axis=-1)


def _contract_last(a: jax.Array, b: jax.Array, b_axis: int, precision: Any,
                   preferred=None) -> jax.Array:
  return jax.lax.dot_general(a, b, (((a.ndim - 1,), (b_axis,)), ((), ())),
                             precision=precision, preferred_element_type=preferred)


def input_sparse_reference(x: jax.Array, w: jax.Array, dy: jax.Array | None = None, *,
                           gradient: str = "masked", grad_output: str = "dense",
                           precision: Any = None):
  """The contract, in plain `jnp`: `y = (x * m) @ w` and, given `dy`, the
  `(dx, dw)` of the module docstring, all accumulated in float32 (float64
  for float64) and returned in x's dtype (`dw` in w's). `x` is `[M, K]`,
  `w` `[K, N]`. `gradient`: `"masked"`, `"ste"` or `"off"` (the input is
  not pruned: `m` all ones); `grad_output`: `"dense"` or `"2:4"` (`dx`
  from `prune_24(dy, axis=-1) * dy`). Returns `y`, or `(y, dx, dw)` with
  `dy`."""
  if gradient not in INPUT_SPARSITY or grad_output not in GRAD_OUTPUTS:
    raise ValueError(f"input_sparse_reference: gradient={gradient!r},"
                     f" grad_output={grad_output!r}; expected one of {INPUT_SPARSITY}"
                     f" and one of {GRAD_OUTPUTS}.")
  acc = accumulation_dtype(x.dtype)
  m = input_mask(x) if gradient != "off" else jnp.ones(x.shape, bool)
  xm = jnp.where(m, x, 0).astype(acc)
  y = jnp.matmul(xm, w.astype(x.dtype).astype(acc), precision=precision).astype(x.dtype)
  if dy is None:
    return y
  dy_dx = jnp.where(input_mask(dy), dy, 0) if grad_output == "2:4" else dy
  dx = jnp.matmul(dy_dx.astype(acc), w.astype(x.dtype).astype(acc).T, precision=precision)
  if gradient == "masked":
    dx = jnp.where(m, dx, 0)
  dw = jnp.matmul(xm.T, dy.astype(acc), precision=precision)
  return y, dx.astype(x.dtype), dw.astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def input_sparse_product(x: jax.Array, w: jax.Array, input_sparsity: str, grad_output: str,
                         precision: Any,
                         forward: Callable[[jax.Array, jax.Array], jax.Array] | None):
  """`prune(x) @ w` for `x[M, K]` (the compute dtype) and `w[K, N]` (any
  float dtype, cast to x's inside, so that `dw` comes back in w's dtype as
  the dense layer's does), with the gradients of the module docstring.
  `input_sparsity`: `"masked"`, `"ste"`, or `"off"` (`x @ w`, unpruned);
  `grad_output`: `"dense"` or `"2:4"` (`dx` from the output gradient
  pruned 2:4 along N). At least one of them prunes.

  `forward`: None for the XLA backend's products (masked dense arrays and
  XLA's dense product), or a backend's `forward(a, b) -> prune(a) @ b` that
  prunes `a` along its last axis itself and multiplies on the sparse tensor
  cores (`b` already in a's dtype; hashable: a module-level function): the
  forward product where the input is pruned, and `dx = prune(dy) @ w^T`
  under `grad_output="2:4"`. `dw` is XLA's either way: its contraction runs
  over M, and neither pruned operand is 2:4 along M."""
  return _fwd(x, w, input_sparsity, grad_output, precision, forward)[0]


def _pruned(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  m = input_mask(x)
  return m, jnp.where(m, x, jnp.zeros((), x.dtype))


def _sparse_times(a: jax.Array, b: jax.Array, precision, forward) -> jax.Array:
  """`prune(a) @ b` (a's last axis pruned 2:4): `forward`'s sparse product,
  or XLA's of the masked `a`."""
  if forward is not None:
    return forward(a, b)
  # nn.Dense's dtype convention: the product in a's dtype, accumulated in
  # float32 by XLA for 16-bit inputs.
  return _contract_last(_pruned(a)[1], b, 0, precision)


def _fwd(x, w, input_sparsity, grad_output, precision, forward):
  del grad_output
  if input_sparsity == "off":
    return _contract_last(x, w.astype(x.dtype), 0, precision), (x, w)
  return _sparse_times(x, w.astype(x.dtype), precision, forward), (x, w)


def _bwd(input_sparsity, grad_output, precision, forward, res, dy):
  x, w = res
  m, xm = _pruned(x) if input_sparsity != "off" else (None, x)
  if grad_output == "2:4":
    # w^T laid out by XLA (one copy of the kernel, a pass at memory speed):
    # the backends' sparse product takes its dense operand as `[K, N]`.
    dx = _sparse_times(dy, w.astype(dy.dtype).T, precision, forward)
  else:
    # In dy's dtype (backends/_products.py's `matmul` says why): zeroing
    # commutes with the rounding, so the masked dx has the reference's bits.
    dx = _contract_last(dy, w.astype(dy.dtype), 1, precision)
  if input_sparsity == "masked":
    dx = jnp.where(m, dx, jnp.zeros((), dx.dtype))
  dw = dense_weight_grad(xm, dy, w, precision)
  return dx.astype(x.dtype), dw


input_sparse_product.defvjp(_fwd, _bwd)
