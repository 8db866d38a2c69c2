"""The interface every `implementation=` backend of `sparse_dot` provides.

`Backend.dot` is the product with its derivatives. By default it is a
`jax.custom_jvp` built from the backend's pieces: the backend turns `(w, mask)`
into an *operand* once per forward pass (prune and/or compress), multiplies by
it, and reuses the same operand in the backward pass for `dx = dy @ (w*m)^T`
(the transpose of the tangent primitive `_tangent_p`; forward mode evaluates
that primitive on the same kernels): nothing is pruned or compressed twice
per step. `dw = x^T @ dy` is a dense
XLA product; with `weight_grad="mvue"` it is `Backend.mvue_weight_grad` (XLA's
dense product of the pruned `dy` unless the backend has a sparse one). The
reference backend overrides `dot` with plain JAX ops.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.interpreters import ad, batching, mlir

from jsparse24._format import Mask24, Sparse24, compress_reference, decompress
from jsparse24._mvue import mvue_24
from jsparse24._sharding import (Split, product_sharding, psum_over, split_map,
                                 unpartitioned, weight_grad_sharding)


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


def accumulation_dtype(dtype) -> Any:
  return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def matmul(a: jax.Array, b: jax.Array, precision: Any = None) -> jax.Array:
  """`a @ b` over the last axis of a and first of b, fp32 accumulation."""
  out = jax.lax.dot_general(
      a, b, (((a.ndim - 1,), (0,)), ((), ())), precision=precision,
      preferred_element_type=accumulation_dtype(a.dtype))
  return out.astype(jnp.result_type(a.dtype, b.dtype))


@dataclasses.dataclass(frozen=True)
class DotConfig:
  """The static settings of one `sparse_dot` call."""

  gradient: str  # "ste" or "masked"
  transposable: bool
  precision: Any
  weight_grad: str = "dense"  # "dense" or "mvue" (dw from the MVUE-pruned dy)
  # Tensor parallelism: the products run on each device's block of the
  # weight (`_sharding.Split`, from `sparse_dot`'s `weight_sharding`).
  split: Split | None = None


class BackendUnavailableError(ValueError):
  """An explicitly requested backend cannot run here (the message says why)."""


class XlaFallbackWarning(UserWarning):
  """XLA code with the same bits replaces kernels that cannot run here
  (slower, still correct; the message says which and why). Issued once per
  process."""


@dataclasses.dataclass(frozen=True)
class Problem:
  """The static facts a backend needs to decide whether it can run a call."""

  m: int  # rows of x after flattening leading axes
  k: int
  n: int
  dtype: Any
  transposable: bool
  platform: str  # jax.default_backend() at trace time


class Backend(abc.ABC):
  """One implementation of the sparse product."""

  name: str
  # Why `jsparse24.compress(..., implementation=name)` cannot use this backend
  # (None: it can).
  no_sparse24_reason: str | None = None

  def unavailable_reason(self) -> str | None:
    """None when this backend can run on this machine, else why not."""
    return None

  def check_supported(self, problem: Problem) -> None:
    """Raises NotImplementedError (with the reason) for inputs it cannot run."""

  def prefers(self, problem: Problem) -> bool:
    """Whether `implementation=None` should take this backend for `problem`:
    only where it measured faster than dense XLA."""
    del problem
    return True

  def compress(self, w: jax.Array, mask: jax.Array | Mask24 | None,
               transposed: bool) -> Sparse24:
    """`jsparse24.compress` (arguments already checked)."""
    raise NotImplementedError(f"the {self.name!r} backend has no compress")

  def dot(self, x: jax.Array, w: jax.Array, mask: jax.Array | Mask24 | None,
          active: jax.Array | None, cfg: DotConfig, key: jax.Array | None = None) -> jax.Array:
    """`x[M, K] @ (w*mask)[K, N]` computed in x's dtype, differentiable in
    `x` and `w` with `cfg.gradient`'s `dw` (in w's dtype; `w` may be wider
    than x, e.g. a float32 kernel with bfloat16 compute, and is cast inside).
    `active`: None, or a bool scalar; where it is False the product is the
    plain dense `x @ w` (full `dw`): a schedule's dense phase. With
    `cfg.weight_grad == "mvue"`, `dw = x^T mvue_24(dy, key)` while sparse."""
    return _custom_dot(x, w, mask, active, key, self, cfg)

  # The pieces of the default `dot` (a backend that overrides `dot` needs none).

  def prepare(self, w: jax.Array, mask: jax.Array | Mask24 | None,
              transposable: bool) -> Any:
    """Masks/compresses `w`: returns the operand (a pytree of arrays).

    `mask=None` means prune `w` by magnitude now (`transposable` says how).
    """
    raise NotImplementedError

  def forward(self, x: jax.Array, operand: Any, precision: Any) -> jax.Array:
    """`x[M, K] @ (w*m)[K, N]`, accumulated in float32, in x's dtype."""
    raise NotImplementedError

  def backward_dx(self, dy: jax.Array, operand: Any, precision: Any) -> jax.Array:
    """`dy[M, N] @ (w*m)^T`, accumulated in float32, in dy's dtype."""
    raise NotImplementedError

  def mask_grad(self, dw: jax.Array, operand: Any) -> jax.Array:
    """`dw * mask` for the "masked" gradient mode."""
    raise NotImplementedError

  def operand_roles(self, operand: Any) -> Any:
    """`operand`'s structure with, for each array, which axis runs over K
    and which over N (a string such as "nk"; `_sharding.Split.spec`): how a
    weight block's operand sits in the whole one, for tensor parallelism."""
    raise NotImplementedError(f"the {self.name!r} backend has no tensor-parallel products")

  def split_align(self, transposable: bool) -> tuple[int, int]:
    """What each device's block of `[K, N]` must be a multiple of, along K
    and along N, for this backend's tensor-parallel products."""
    del transposable
    return 8, 8

  def mvue_weight_grad(self, x: jax.Array, dy: jax.Array, w: jax.Array, key: jax.Array,
                       precision: Any) -> jax.Array:
    """`x[M, K]^T mvue_24(dy[M, N], key)` in w's dtype: here XLA's dense
    product of the pruned `dy` (the reference; a backend with a sparse
    product for it overrides this)."""
    del self
    return _mvue_weight_grad_xla(x, dy, w, key, precision)

  @abc.abstractmethod
  def forward_compressed(self, x: jax.Array, sp: Sparse24, precision: Any) -> jax.Array:
    """`x @ decompress(sp)` for inference on a compressed weight."""

  def dot_compressed(self, x: jax.Array, sp: Sparse24, precision: Any,
                     split: Split | None = None) -> jax.Array:
    """`x[M, K] @ decompress(sp)`, differentiable in `x` and in `sp.values`.
    By default a custom_vjp around `forward_compressed` (the Pallas and
    cuSPARSELt calls have no transpose rule); the reference backend
    overrides it with its plain ops. `split`: tensor parallelism, each
    device multiplying by its block of `sp` (`_sharding.split_map`)."""
    return _compressed_product(x, sp, self, precision, split)


def weight_grad(x: jax.Array, dy: jax.Array, w: jax.Array, cfg: DotConfig,
                key: jax.Array | None = None, active: jax.Array | None = None,
                backend: "Backend | None" = None) -> jax.Array:
  """`dw = x^T dy` in w's own dtype (`dense_weight_grad`: as nn.Dense's
  autodiff computes it); with `cfg.weight_grad == "mvue"`, `x^T
  mvue_24(dy, key)` (dy pruned 2:4 along M, unbiased;
  `backend.mvue_weight_grad`, by default XLA's dense product of the pruned
  dy) where `active` (None: always) is True.
  """
  if cfg.weight_grad != "mvue":
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
    pruned = lambda: _mvue_weight_grad_xla(x, dy, w, key, cfg.precision)  # noqa: E731
  else:
    pruned = lambda: backend.mvue_weight_grad(x, dy, w, key, cfg.precision)  # noqa: E731
  if active is None:
    return pruned()
  # A schedule's dense phase keeps the exact gradient.
  return jax.lax.cond(active, pruned, lambda: dense_weight_grad(x, dy, w, cfg.precision))


def _mvue_weight_grad_xla(x, dy, w, key, precision) -> jax.Array:
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
  is. On an H100 that copy was 5.5 ms of bench_model.py's d_model 4096
  step (benchmarks/NOTES.md, "Tenth session")."""
  sharding = weight_grad_sharding(w, x, dy)  # Explicit mesh axes: dw sharded like w
  kw = {} if sharding is None else {"out_sharding": sharding}
  out = jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ())), precision=precision, **kw)
  return out.astype(w.dtype)


# Tensor parallelism (`cfg.split`): the backend's pieces on each device's
# block of the weight, in `shard_map`s over the mesh (`_sharding.split_map`).
# The operand of a block is built and read only inside them.


def _prepare(backend: Backend, w, mask, cfg: DotConfig):
  split = cfg.split
  if split is None:
    return backend.prepare(w, mask, cfg.transposable)
  if isinstance(mask, Mask24):
    # Each device's mask block: the packed codes ([N, K/8]; K a multiple of
    # 8 per device) sliced like the weight.
    args, roles = (w, mask.meta()), ("kn", "nk")
    local = lambda w, packed: backend.prepare(  # noqa: E731
        w, Mask24(packed, w.shape, mask.transposable), cfg.transposable)
  elif mask is None:
    args, roles = (w,), ("kn",)
    local = lambda w: backend.prepare(w, None, cfg.transposable)  # noqa: E731
  else:  # a dense bool mask, [K, N]
    args, roles = (w, mask), ("kn", "kn")
    local = lambda w, m: backend.prepare(w, m, cfg.transposable)  # noqa: E731
  blocks = [jax.ShapeDtypeStruct(
      tuple(d // split.size(r) for d, r in zip(a.shape, rs)), a.dtype)
      for a, rs in zip(args, roles)]
  with unpartitioned():
    shape = jax.eval_shape(local, *blocks)
  return split_map(split, local, roles, backend.operand_roles(shape), *args)


def _on_blocks(split: Split, product, x, operand, roles, transposed: bool):
  """`product(x, operand)` on each device's block: `x @ W` (x `[M, K]`,
  the partial products summed over K's mesh axes), or with `transposed`
  `x @ W^T` (x `[M, N]`, summed over N's)."""
  contracted, x_roles, y_roles = ((split.n, "mn", "mk") if transposed
                                  else (split.k, "mk", "mn"))
  local = lambda x, op: psum_over(product(x, op), contracted)  # noqa: E731
  return split_map(split, local, (x_roles, roles), y_roles, x, operand)


def _forward(backend: Backend, x, operand, cfg: DotConfig):
  product = lambda x, op: backend.forward(x, op, cfg.precision)  # noqa: E731
  if cfg.split is None:
    return product(x, operand)
  return _on_blocks(cfg.split, product, x, operand, backend.operand_roles(operand), False)


def _backward_dx(backend: Backend, dy, operand, cfg: DotConfig):
  product = lambda dy, op: backend.backward_dx(dy, op, cfg.precision)  # noqa: E731
  if cfg.split is None:
    return product(dy, operand)
  return _on_blocks(cfg.split, product, dy, operand, backend.operand_roles(operand), True)


def _mask_grad(backend: Backend, dw, operand, cfg: DotConfig):
  if cfg.split is None:
    return backend.mask_grad(dw, operand)
  return split_map(cfg.split, backend.mask_grad, ("kn", backend.operand_roles(operand)), "kn",
                   dw, operand)


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
# bfloat16 copy of every weight (benchmarks/NOTES.md, "Whole model").
#
# The dense phase switch (`active`, None: always sparse) lives inside the
# product, so that the residuals are exactly (x, w, operand, key, active): a
# `lax.cond` around two differentiable branches saves both branches'
# residuals, the untaken one as zeros of the size of x, every step. Measured
# on an H100 that way, a scan of 24 d_model 1024 MLP blocks ran 3.9% slower,
# and the d_model 2048 x 16 model of bench_model.py ran out of memory
# (benchmarks/NOTES.md).
@functools.partial(jax.custom_jvp, nondiff_argnums=(5, 6))
def _custom_dot(x, w, mask, active, key, backend: Backend, cfg: DotConfig):
  return _custom_dot_fwd(x, w, mask, active, key, backend, cfg)[0]


def _custom_dot_fwd(x, w, mask, active, key, backend: Backend, cfg: DotConfig):
  # The cast is its own XLA op, not done by a kernel that reads the float32
  # kernel: under nn.scan `w` is a slice of the stacked parameters, which XLA
  # fuses into the cast (4 bytes read, 2 written per weight) but copies whole
  # before a custom call (4 + 4), whose read then costs 4 bytes more. On an
  # H100 the d_model 4096 x 6 block step of bench_model.py went 258.5 ->
  # 255.6 ms this way (benchmarks/NOTES.md, "The cast before the compress
  # kernel").
  operand = jax.tree.map(lambda a: checkpoint_name(a, COMPRESSED),
                         _prepare(backend, w.astype(x.dtype), mask, cfg))
  sparse = lambda: _forward(backend, x, operand, cfg)  # noqa: E731
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


_custom_dot.defjvp(_custom_dot_jvp, symbolic_zeros=True)


def _backward(backend: Backend, cfg: DotConfig, res, dy):
  """(dx, dw) of the product from its residuals `(x, w, operand, key,
  active)` (`active` None: always sparse)."""
  x, w, operand, key, active = res
  sparse_dx = lambda: _backward_dx(backend, dy, operand, cfg)  # noqa: E731
  if active is None:
    dx = sparse_dx()
  else:
    dx = jax.lax.cond(active, sparse_dx,
                      lambda: matmul(dy, w.astype(dy.dtype).T, cfg.precision))
  # dw = x^T dy for every element ("ste"): the pruned weights keep learning.
  dw = weight_grad(x, dy, w, cfg, key, active, backend)
  if cfg.gradient == "masked":
    masked = _mask_grad(backend, dw, operand, cfg)
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
  terms = []
  if x_dot is not None:
    if active is None:
      terms.append(_forward(backend, x_dot, operand, cfg))
    else:
      terms.append(jax.lax.cond(active, lambda: _forward(backend, x_dot, operand, cfg),
                                lambda: matmul(x_dot, w.astype(x.dtype), cfg.precision)))
  if w_dot is not None:
    w_dot = w_dot.astype(x.dtype)
    if cfg.gradient == "masked":
      masked = _mask_grad(backend, w_dot, operand, cfg)
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


def _tangent_transpose(ct, *args, backend, cfg, treedef, linear):
  n_lin = sum(linear)
  _, _, res = _split(args, treedef, linear)
  if type(ct) is ad.Zero:  # pylint: disable=unidiomatic-typecheck
    return [None] * len(args)
  dx, dw = _backward(backend, cfg, res, ct)
  return [g for g, on in zip((dx, dw), linear) if on] + [None] * (len(args) - n_lin)


def _tangent_batch(args, dims, *, backend, cfg, treedef, linear):
  """Batching: where only the activations (x, x_dot: `[M, K]` each) carry
  the batch axis, it is folded into their rows, so that the product stays
  one call and, in reverse mode of a vmapped function (`grad(vmap(f))`), dw
  is one product over the whole batch. Otherwise (batched weights, masks or
  keys) the slices run one after another (`lax.map`)."""
  n_lin = sum(linear)
  x_at = n_lin  # x: the first leaf of the residuals
  activations = {x_at} | ({0} if linear[0] else set())
  mapped = [d is not None for d in dims]  # None: an unbatched argument
  if all(m == (i in activations) for i, m in enumerate(mapped)):
    vals = list(args)
    for i in activations:  # [B, M, K] -> [B * M, K]
      v = jnp.moveaxis(vals[i], dims[i], 0)
      vals[i] = v.reshape(-1, v.shape[-1])
    b = args[x_at].shape[dims[x_at]]
    out = _tangent_p.bind(*vals, backend=backend, cfg=cfg, treedef=treedef, linear=linear)
    return out.reshape(b, -1, out.shape[-1]), 0
  moved = [jnp.moveaxis(a, d, 0) if m else a for a, d, m in zip(args, dims, mapped)]

  def one(sliced):
    it = iter(sliced)
    vals = [next(it) if m else a for a, m in zip(moved, mapped)]
    return _tangent_p.bind(*vals, backend=backend, cfg=cfg, treedef=treedef, linear=linear)
  return jax.lax.map(one, [a for a, m in zip(moved, mapped) if m]), 0


_tangent_p.def_impl(_tangent_impl)
_tangent_p.def_abstract_eval(_tangent_abstract_eval)
ad.primitive_transposes[_tangent_p] = _tangent_transpose
batching.primitive_batchers[_tangent_p] = _tangent_batch
mlir.register_lowering(_tangent_p, mlir.lower_fun(_tangent_impl, multiple_results=False))


def sparse24_roles(sp: Sparse24) -> Sparse24:
  """`operand_roles` of a `Sparse24`: values and meta `[N, ...]`, the
  transposed pair `[K, ...]`."""
  t = sp.values_t is not None
  return Sparse24("nk", "nk", "kn" if t else None, "kn" if t else None)


def _forward_compressed(backend: Backend, x, sp: Sparse24, precision, split: Split | None,
                        transposed: bool = False):
  """`x @ decompress(sp)` (`transposed`: `x @ decompress(sp)^T` from the
  transposed copy), on each device's block of `sp` under a `split`."""
  product = lambda x, sp: backend.forward_compressed(  # noqa: E731
      x, sp.transpose() if transposed else sp, precision)
  if split is None:
    return product(x, sp)
  return _on_blocks(split, product, x, sp, sparse24_roles(sp), transposed)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _compressed_product(x, sp: Sparse24, backend: Backend, precision, split):
  return _forward_compressed(backend, x, sp, precision, split)


def _compressed_product_fwd(x, sp, backend: Backend, precision, split):
  return _forward_compressed(backend, x, sp, precision, split), (x, sp)


def _compressed_product_bwd(backend: Backend, precision, split, res, dy):
  x, sp = res
  # dx = dy @ W^T: on the sparse kernels where sp holds the transposed copy.
  if sp.has_transpose:
    dx = _forward_compressed(backend, dy, sp, precision, split, transposed=True)
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

  d_sp = Sparse24(kept.values.astype(sp.values.dtype), zero(sp.meta), zero(sp.values_t),
                  zero(sp.meta_t))
  return dx.astype(x.dtype), d_sp


_compressed_product.defvjp(_compressed_product_fwd, _compressed_product_bwd)
