"""The reference backend: the masked dense product in plain JAX ops.

Runs everywhere (CPU, GPU, TPU) and defines the contract the other backends are
tested against. It is written as a dense model's layer is, `x @ w` on the
masked weight, and differentiated by JAX itself; only the masking is a
`custom_jvp` (its derivative the identity, straight-through, or the mask).
So XLA sees what it sees for `nn.Dense` plus one AND of the weight's bits
that it fuses into the weight's cast, and a model whose layers fall back to
this backend runs at the dense model's speed; it also supports forward-mode
autodiff, and batching keeps a shared weight's gradient one product.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jsparse24._format import Mask24, Sparse24, compress_reference, decompress
from jsparse24._input_sparse import input_sparse_product
from jsparse24._phase import is_static_dense
from jsparse24._prune import prune_24
from jsparse24._sharding import is_explicit, typed_like
from jsparse24.backends._products import matmul, weight_grad
from jsparse24.backends.base import Backend, DotConfig


def dense_mask(w: jax.Array, mask: jax.Array | Mask24 | None,
               transposable: bool) -> jax.Array:
  if mask is None:
    return prune_24(w, axis=-2, transposable=transposable)
  if isinstance(mask, Mask24):
    return mask.unpack()
  return mask


def _kept(w: jax.Array, mask: jax.Array) -> jax.Array:
  """`jnp.where(mask, w, 0)` as an AND of `w`'s bits with all ones or none:
  exactly 0 where pruned, NaN or inf there included, with no zero array.
  The `where`'s zero is a broadcast that XLA hoisted out of `nn.scan`'s
  loops and wrote to memory, one kernel per layer kind per training step,
  which a step of a few hundred microseconds notices (the GPU program of
  `benchmarks/_gpt.py`'s model at d_model 128). Not differentiable: the
  callers' `custom_jvp`s give the derivative."""
  bits = jnp.dtype(f"uint{8 * jnp.dtype(w.dtype).itemsize}")
  ones = jnp.negative(mask.astype(bits))  # kept: every bit set; pruned: none
  return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(w, bits) & ones, w.dtype)


@jax.custom_jvp
def _mask_ste(w: jax.Array, mask: jax.Array) -> jax.Array:
  """`w * mask` whose derivative in `w` is the identity (straight-through)."""
  return _kept(w, mask)


@_mask_ste.defjvp
def _mask_ste_jvp(primals, tangents):
  w, mask = primals
  return _mask_ste(w, mask), tangents[0]


@jax.custom_jvp
def _mask_exact(w: jax.Array, mask: jax.Array) -> jax.Array:
  """`w * mask` whose derivative in `w` is masked too (`gradient="masked"`)."""
  return _kept(w, mask)


@_mask_exact.defjvp
def _mask_exact_jvp(primals, tangents):
  w, mask = primals
  # A select, not `_kept`: JAX transposes it for the reverse pass.
  return _mask_exact(w, mask), jnp.where(mask, tangents[0], jnp.zeros((), w.dtype))


def _out(cfg: DotConfig, roles: str) -> dict:
  """`out_sharding` for a product under a tensor-parallel split with
  Explicit mesh axes (a contraction over a sharded axis needs it), else
  nothing."""
  if cfg.split is None or not is_explicit(cfg.split.mesh):
    return {}
  return {"out_sharding": NamedSharding(cfg.split.mesh, cfg.split.spec(roles))}


class XlaBackend(Backend):
  name = "xla"

  def compress(self, w, mask, transposed):
    return compress_reference(w, mask, transposed)

  def split_align(self, transposable):
    del transposable  # XLA partitions the plain ops at any split
    return 1, 1

  def dot(self, x, w, mask, active, cfg: DotConfig, key=None):
    if cfg.split is not None and not is_explicit(cfg.split.mesh):
      # Tensor parallelism: XLA partitions the plain ops itself (as for
      # nn.Dense); the weight is only held to its sharding. (With Explicit
      # mesh axes its type carries the sharding already, and the products
      # name their outputs' sharding: `_out`.)
      w = jax.lax.with_sharding_constraint(
          w, NamedSharding(cfg.split.mesh, cfg.split.spec("kn")))
    wc = w.astype(x.dtype)  # nn.Dense's cast (a wider kernel computes in x's dtype)
    if is_static_dense(active):  # known while tracing: nn.Dense's product, no mask
      return jax.lax.dot_general(x, wc, (((x.ndim - 1,), (0,)), ((), ())),
                                 precision=cfg.precision, **_out(cfg, "mn"))
    # One mask for both paths (mask=None prunes the cast kernel, as the
    # layer computes with it); typed like w under Explicit mesh axes.
    m = jax.lax.stop_gradient(typed_like(
        lambda w, mask: dense_mask(w, mask, cfg.transposable), wc, wc, mask))
    if active is not None:
      m = m | ~active  # the dense phase: every weight kept
    if cfg.weight_grad == "mvue":
      return _mvue_dot(x, w, m, active, key, cfg)
    w = wc
    wm = (_mask_ste if cfg.gradient == "ste" else _mask_exact)(w, m)
    # The dtype convention of nn.Dense: the product in x's dtype (XLA
    # accumulates 16-bit products in float32), not a float32 result cast
    # down afterwards, which costs a pass over y.
    return jax.lax.dot_general(x, wm, (((x.ndim - 1,), (0,)), ((), ())),
                               precision=cfg.precision, **_out(cfg, "mn"))

  def forward_compressed(self, x, sp: Sparse24, precision):
    return matmul(x, decompress(sp), precision)

  def dot_input_sparse(self, x, w, cfg):
    return input_sparse_product(x, w, cfg, None)

  def dot_compressed(self, x, sp: Sparse24, precision, split=None):
    # Plain ops: JAX differentiates them itself (forward mode too), and XLA
    # partitions them under any split.
    del split
    return self.forward_compressed(x, sp, precision)


# The MVUE weight gradient needs the output gradient itself (JAX's own
# transpose of the product gives no hook for it): a custom_vjp with the same
# products as the plain path above, and dw = x^T mvue_24(dy) while sparse.
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _mvue_dot(x, w, kept, active, key, cfg: DotConfig):
  """`kept`: the mask with the dense phase folded in; `active` only says
  whether dw is pruned (dense phases keep the exact dw)."""
  return _mvue_dot_fwd(x, w, kept, active, key, cfg)[0]


def _mvue_dot_fwd(x, w, kept, active, key, cfg: DotConfig):
  wm = jnp.where(kept, w.astype(x.dtype), jnp.zeros((), x.dtype))
  y = jax.lax.dot_general(x, wm, (((x.ndim - 1,), (0,)), ((), ())), precision=cfg.precision,
                          **_out(cfg, "mn"))
  return y, (x, w, kept, active, key)


def _mvue_dot_bwd(cfg: DotConfig, res, dy):
  x, w, kept, active, key = res
  wm = jnp.where(kept, w.astype(dy.dtype), jnp.zeros((), dy.dtype))
  # In dy's dtype, as `matmul` (backends/_products.py) says why.
  dx = jax.lax.dot_general(dy, wm, (((dy.ndim - 1,), (1,)), ((), ())), precision=cfg.precision,
                           **_out(cfg, "mk"))
  dw = weight_grad(x, dy, w, cfg, key, active)
  if cfg.gradient == "masked":
    dw = jnp.where(kept, dw, jnp.zeros((), dw.dtype))
  return dx.astype(x.dtype), dw, None, None, None


_mvue_dot.defvjp(_mvue_dot_fwd, _mvue_dot_bwd)
