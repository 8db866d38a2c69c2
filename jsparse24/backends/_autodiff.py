"""The default `Backend.dot` and `Backend.dot_compressed`: the sparse
product with its derivatives, built from a backend's pieces.

`custom_dot` is a `jax.custom_jvp` whose tangent is one linear primitive
(`_tangent_p`): the backend turns `(w, mask)` into an *operand* once per
forward pass (prune and/or compress), multiplies by it, and reuses the same
operand in the backward pass for `dx = dy @ (w*m)^T` (the primitive's
transpose; forward mode evaluates the primitive on the same kernels):
nothing is pruned or compressed twice per step. `compressed_product` is the
product with a `Sparse24` weight (a `jax.custom_vjp`: the Pallas and
cuSPARSELt calls have no transpose rule). Both run the pieces over a mesh
where the call names a split (`_tensor_parallel`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.interpreters import ad, batching, mlir

from jsparse24._format import Mask24, Sparse24, compress_reference, decompress
from jsparse24._phase import is_static_dense
from jsparse24._sharding import product_sharding, unpartitioned
from jsparse24.backends._products import (accumulation_dtype, dense_weight_grad, matmul,
                                          weight_grad)
from jsparse24.backends._tensor_parallel import (backward_dx, forward, forward_compressed,
                                                 mask_grad, prepare)

if TYPE_CHECKING:
  from jsparse24.backends.base import Backend, DotConfig


# The checkpoint name of a product's compressed weight (the residual that
# `prepare` builds from the kernel alone). Under `jax.checkpoint` / `nn.remat`
# a policy that saves it, e.g.
# `jax.checkpoint_policies.save_only_these_names(COMPRESSED)`, keeps the
# backward pass from pruning and compressing every weight again.
COMPRESSED = "jsparse24_compressed"


# The checkpoint name of a product's output `y`. JAX's dot policies
# (`dots_saveable`, `dots_with_no_batch_dims_saveable`) save the outputs of
# `dot_general` only, and the Pallas and cuSPARSELt products are custom
# calls: under those policies the backward pass would recompute every 2:4
# product that a dense model's policy saves. `jsparse24.checkpoint_policies`
# saves this name beside what JAX's policies save.
PRODUCT = "jsparse24_product"


# The product is a custom_jvp whose tangent is one primitive, `_tangent_p`,
# linear in (x_dot, w_dot) and transposed by the backward pass below (the
# body a custom_vjp would have): reverse mode (JAX linearizes, then
# transposes) runs exactly that backward pass on the residuals of the forward
# one, and forward mode (`jax.jvp`, `jax.linearize`, `jacfwd`) evaluates the
# tangent on the backend's kernels. Its w-term is the adjoint of the backward
# pass's dw: `x @ w_dot` with the straight-through gradient, `x @ (w_dot *
# mask)` with "masked" (with MVUE's random dw there is none: forward mode
# raises).
#
# `w` arrives in its own dtype (a layer's float32 kernel) and is cast to x's
# dtype inside (prepare and the dense branch), so that the residual is the
# kernel itself: under nn.scan that is a slice of the stacked parameters,
# which JAX's scan forwards to the backward pass instead of stacking a
# bfloat16 copy of every weight (docs/design_notes.md, "The weight enters the
# product uncast; the cast is its own XLA op").
#
# The dense phase switch (`active`, None: always sparse) lives inside the
# product, so that the residuals are exactly (x, w, operand, key, active): a
# `lax.cond` around two differentiable branches saves both branches'
# residuals, the untaken one as zeros of the size of x, every step (slower,
# and out of memory for large models: docs/design_notes.md, "No branch
# around the product for a schedule's dense phase"). `STATIC_DENSE` (a
# phase known while tracing, `jsparse24._phase`) takes the dense branch's
# computations with no conditional and no operand.
@functools.partial(jax.custom_jvp, nondiff_argnums=(5, 6))
def custom_dot(x, w, mask, active, key, backend: Backend, cfg: DotConfig):
  return _custom_dot_fwd(x, w, mask, active, key, backend, cfg)[0]


def _custom_dot_fwd(x, w, mask, active, key, backend: Backend, cfg: DotConfig):
  # The cast is its own XLA op, not done by a kernel that reads the float32
  # kernel: under nn.scan `w` is a slice of the stacked parameters, which XLA
  # fuses into the cast (4 bytes read, 2 written per weight) but copies whole
  # before a custom call (4 + 4), whose read then costs 4 bytes more
  # (docs/design_notes.md, "The weight enters the product uncast; the cast
  # is its own XLA op").
  if is_static_dense(active):
    # Nothing to prune or compress: the kernel is not 2:4 in this step.
    y = checkpoint_name(matmul(x, w.astype(x.dtype), cfg.precision), PRODUCT)
    return y, (x, w, None, key, active)
  operand = jax.tree.map(lambda a: checkpoint_name(a, COMPRESSED),
                         prepare(backend, w.astype(x.dtype), mask, cfg))
  sparse = lambda: forward(backend, x, operand, cfg)  # noqa: E731
  if active is None:
    y = sparse()
  else:
    y = jax.lax.cond(active, sparse, lambda: matmul(x, w.astype(x.dtype), cfg.precision))
  y = checkpoint_name(y, PRODUCT)
  # w itself is a residual only for its dtype and sharding (dw's) and the
  # dense branch; it costs nothing: the parameter is alive anyway, and
  # nn.scan forwards it.
  return y, (x, w, operand, key, active)


def _custom_dot_jvp(backend: Backend, cfg: DotConfig, primals, tangents):
  y, res = _custom_dot_fwd(*primals, backend, cfg)
  return y, _tangent(res, tangents[0], tangents[1], backend, cfg)


custom_dot.defjvp(_custom_dot_jvp, symbolic_zeros=True)


def _backward(backend: Backend, cfg: DotConfig, res, dy):
  """(dx, dw) of the product from its residuals `(x, w, operand, key,
  active)` (`active` None: always sparse)."""
  x, w, operand, key, active = res
  if is_static_dense(active):  # the dense branch's gradients below, unconditionally
    dx = matmul(dy, w.astype(dy.dtype).T, cfg.precision)
    return dx.astype(x.dtype), dense_weight_grad(x, dy, w, cfg.precision)
  sparse_dx = lambda: backward_dx(backend, dy, operand, cfg)  # noqa: E731
  if active is None:
    dx = sparse_dx()
  else:
    dx = jax.lax.cond(active, sparse_dx,
                      lambda: matmul(dy, w.astype(dy.dtype).T, cfg.precision))
  # dw = x^T dy for every element ("ste"): the pruned weights keep learning.
  dw = weight_grad(x, dy, w, cfg, key, active, backend)
  if cfg.gradient == "masked":
    masked = mask_grad(backend, dw, operand, cfg)
    dw = masked if active is None else jnp.where(active, masked, dw)
  return dx.astype(x.dtype), dw


def _tangent_value(backend: Backend, cfg: DotConfig, res, x_dot, w_dot):
  """The tangent of the product (forward mode): `x_dot @ (w*m) + x @ w_dot`
  (`w_dot * m` with the "masked" gradient); a None tangent is zero."""
  if cfg.weight_grad == "mvue":
    raise TypeError(
        "sparse_dot / SparseDense with weight_grad='mvue': forward-mode autodiff (jax.jvp,"
        " jax.linearize, jax.jacfwd) is not supported: the MVUE weight gradient is a random"
        " estimate of reverse mode only. Use weight_grad='dense' for forward mode.")
  x, w, operand, _, active = res
  dense = is_static_dense(active)
  terms = []
  if x_dot is not None:
    if dense:
      terms.append(matmul(x_dot, w.astype(x.dtype), cfg.precision))
    elif active is None:
      terms.append(forward(backend, x_dot, operand, cfg))
    else:
      terms.append(jax.lax.cond(active, lambda: forward(backend, x_dot, operand, cfg),
                                lambda: matmul(x_dot, w.astype(x.dtype), cfg.precision)))
  if w_dot is not None:
    w_dot = w_dot.astype(x.dtype)
    if cfg.gradient == "masked" and not dense:
      masked = mask_grad(backend, w_dot, operand, cfg)
      w_dot = masked if active is None else jnp.where(active, masked, w_dot)
    terms.append(matmul(x, w_dot, cfg.precision))
  return functools.reduce(jnp.add, terms).astype(x.dtype)


_tangent_p = jax.extend.core.Primitive("jsparse24_sparse_dot_tangent")


def _tangent(res, x_dot, w_dot, backend: Backend, cfg: DotConfig):
  """`_tangent_p` on the non-zero tangents (symbolic zeros are left out)."""
  zero = jax.custom_derivatives.SymbolicZero
  linear = (not isinstance(x_dot, zero), not isinstance(w_dot, zero))
  if not any(linear):
    x, w = res[:2]
    return jnp.zeros((*x.shape[:-1], w.shape[-1]), x.dtype)
  leaves, treedef = jax.tree.flatten(res)
  args = [t for t, on in zip((x_dot, w_dot), linear) if on]
  return _tangent_p.bind(*args, *leaves, backend=backend, cfg=cfg, treedef=treedef,
                         linear=linear)


def _split(args, treedef, linear):
  it = iter(args[:sum(linear)])
  x_dot, w_dot = (next(it) if on else None for on in linear)
  return x_dot, w_dot, jax.tree.unflatten(treedef, args[sum(linear):])


def _tangent_impl(*args, backend, cfg, treedef, linear):
  x_dot, w_dot, res = _split(args, treedef, linear)
  # Also traced inside the lowering rule below, which JAX may emit out of
  # line, with no device assignment: no custom_partitioning in there.
  with unpartitioned():
    return _tangent_value(backend, cfg, res, x_dot, w_dot)


def _tangent_abstract_eval(*args, backend, cfg, treedef, linear):
  del backend
  _, _, (x, w, *_) = _split(args, treedef, linear)
  # Typed like the product (Explicit mesh axes), so that the cotangent
  # reaching the transpose, and the dx it returns, carry x's sharding.
  return jax.core.ShapedArray((*x.shape[:-1], w.shape[-1]), x.dtype,
                              sharding=product_sharding(x, cfg.split))


def _transposed(ct, args, treedef, linear, backward):
  """A tangent primitive's transpose: `backward(res, ct) -> (dx, dw)` for
  the linear arguments, None for the residuals."""
  n_lin = sum(linear)
  _, _, res = _split(args, treedef, linear)
  if type(ct) is ad.Zero:  # pylint: disable=unidiomatic-typecheck
    return [None] * len(args)
  dx, dw = backward(res, ct)
  return [g for g, on in zip((dx, dw), linear) if on] + [None] * (len(args) - n_lin)


def _tangent_transpose(ct, *args, backend, cfg, treedef, linear):
  return _transposed(ct, args, treedef, linear,
                     lambda res, ct: _backward(backend, cfg, res, ct))


def _tangent_batch(args, dims, *, backend, cfg, treedef, linear):
  """Batching: where only the activations (x, x_dot: `[M, K]` each) carry
  the batch axis, it is folded into their rows, so that the product stays
  one call and, in reverse mode of a vmapped function (`grad(vmap(f))`), dw
  is one product over the whole batch. Where everything is batched and the
  product has no run-time dense switch (stacked experts), it is one
  product of the stack (`_stacked_tangent_p`). Otherwise (some of the
  weights, masks or keys batched, or a traced `active` flag, whose
  conditional a vmap would turn into both branches) the slices run one
  after another (`lax.map`)."""
  n_lin = sum(linear)
  x_at = n_lin  # x: the first leaf of the residuals
  activations = {x_at} | ({0} if linear[0] else set())
  mapped = [d is not None for d in dims]  # None: an unbatched argument
  params = {"backend": backend, "cfg": cfg, "treedef": treedef, "linear": linear}
  if all(m == (i in activations) for i, m in enumerate(mapped)):
    vals = list(args)
    for i in activations:  # [B, M, K] -> [B * M, K]
      v = jnp.moveaxis(vals[i], dims[i], 0)
      vals[i] = v.reshape(-1, v.shape[-1])
    b = args[x_at].shape[dims[x_at]]
    out = _tangent_p.bind(*vals, **params)
    return out.reshape(b, -1, out.shape[-1]), 0
  _, _, (*_, active) = _split(args, treedef, linear)
  if all(mapped) and (active is None or is_static_dense(active)):
    moved = [jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    return _stacked_tangent_p.bind(*moved, **params), 0
  return _slice_by_slice(_tangent_p, args, dims, params), 0


def _slice_by_slice(primitive, args, dims, params):
  """`primitive` bound on each slice of the batched `args` in turn (`lax.map`)."""
  mapped = [d is not None for d in dims]
  moved = [jnp.moveaxis(a, d, 0) if m else a for a, d, m in zip(args, dims, mapped)]

  def one(sliced):
    it = iter(sliced)
    return primitive.bind(*[next(it) if m else a for a, m in zip(moved, mapped)], **params)
  return jax.lax.map(one, [a for a, m in zip(moved, mapped) if m])


_tangent_p.def_impl(_tangent_impl)
_tangent_p.def_abstract_eval(_tangent_abstract_eval)
ad.primitive_transposes[_tangent_p] = _tangent_transpose
batching.primitive_batchers[_tangent_p] = _tangent_batch
mlir.register_lowering(_tangent_p, mlir.lower_fun(_tangent_impl, multiple_results=False))


# `_tangent_p` of a stack of products, every argument stacked on axis 0 (the
# experts of a mixture of experts under vmap): the products' own batching
# makes each of its products one call for the stack (cuSPARSELt's
# `_stacked_matmul`), where a loop over the items would copy each one out of
# its stack and each result into one (`benchmarks/results/nvidia-h200.md`,
# "The MoE block's expert products as one call per stack").
_stacked_tangent_p = jax.extend.core.Primitive("jsparse24_sparse_dot_tangent_stacked")


def _stacked_impl(*args, backend, cfg, treedef, linear):
  return jax.vmap(functools.partial(_tangent_impl, backend=backend, cfg=cfg, treedef=treedef,
                                    linear=linear))(*args)


def _stacked_abstract_eval(*args, backend, cfg, treedef, linear):
  del backend, cfg
  _, _, (x, w, *_) = _split(args, treedef, linear)
  return jax.core.ShapedArray((*x.shape[:-1], w.shape[-1]), x.dtype)


def _stacked_transpose(ct, *args, backend, cfg, treedef, linear):
  return _transposed(ct, args, treedef, linear,
                     jax.vmap(lambda res, ct: _backward(backend, cfg, res, ct)))


def _stacked_batch(args, dims, **params):
  """A vmap over a stack of products: one stacked product per slice."""
  return _slice_by_slice(_stacked_tangent_p, args, dims, params), 0


_stacked_tangent_p.def_impl(_stacked_impl)
_stacked_tangent_p.def_abstract_eval(_stacked_abstract_eval)
ad.primitive_transposes[_stacked_tangent_p] = _stacked_transpose
batching.primitive_batchers[_stacked_tangent_p] = _stacked_batch
mlir.register_lowering(_stacked_tangent_p,
                       mlir.lower_fun(_stacked_impl, multiple_results=False))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def compressed_product(x, sp: Sparse24, backend: Backend, precision, split):
  return forward_compressed(backend, x, sp, precision, split)


def _compressed_product_fwd(x, sp, backend: Backend, precision, split):
  return forward_compressed(backend, x, sp, precision, split), (x, sp)


def _compressed_product_bwd(backend: Backend, precision, split, res, dy):
  x, sp = res
  # dx = dy @ W^T: on the sparse kernels where sp holds the transposed copy.
  if sp.has_transpose:
    dx = forward_compressed(backend, dy, sp, precision, split, transposed=True)
  else:
    dx = matmul(dy, decompress(sp).T, precision)
  # d values = (x^T dy) at the kept positions (the forward reads `values` only).
  dw = jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=accumulation_dtype(x.dtype))
  kept = compress_reference(dw, Mask24.from_meta(sp.meta, sp.shape), False)

  def zero(a):  # the metadata and the unread transposed copy get no gradient
    if a is None:
      return None
    if jnp.issubdtype(a.dtype, jnp.inexact):
      return jnp.zeros_like(a)
    return np.zeros(a.shape, jax.dtypes.float0)

  d_values = kept.values.astype(sp.values.dtype)
  if sp.cusparselt:  # cuSPARSELt's metadata rows after the values: bits, no gradient
    tail = sp.values.shape[-2] - d_values.shape[-2]
    d_values = jnp.concatenate([d_values, jnp.zeros((tail, d_values.shape[-1]), d_values.dtype)])
  d_sp = Sparse24(d_values, zero(sp.meta), zero(sp.values_t), zero(sp.meta_t), sp.cusparselt)
  return dx.astype(x.dtype), d_sp


compressed_product.defvjp(_compressed_product_fwd, _compressed_product_bwd)
