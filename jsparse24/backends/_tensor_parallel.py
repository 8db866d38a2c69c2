"""Tensor parallelism (`DotConfig.split`): a backend's pieces (`prepare`,
`forward`, `backward_dx`, `mask_grad`, `forward_compressed`) on each
device's block of the weight, in `shard_map`s over the mesh
(`_sharding.split_map`); without a split, the pieces themselves. The operand
of a block is built and read only inside the maps (a block's cuSPARSELt
buffers are not a block of the whole weight's)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from jsparse24._format import Mask24, Sparse24
from jsparse24._sharding import Split, psum_over, split_map, unpartitioned

if TYPE_CHECKING:
  from jsparse24.backends.base import Backend, DotConfig


def prepare(backend: Backend, w, mask, cfg: DotConfig):
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


def on_blocks(split: Split, product, x, operand, roles, transposed: bool):
  """`product(x, operand)` on each device's block: `x @ W` (x `[M, K]`,
  the partial products summed over K's mesh axes), or with `transposed`
  `x @ W^T` (x `[M, N]`, summed over N's)."""
  contracted, x_roles, y_roles = ((split.n, "mn", "mk") if transposed
                                  else (split.k, "mk", "mn"))
  local = lambda x, op: psum_over(product(x, op), contracted)  # noqa: E731
  return split_map(split, local, (x_roles, roles), y_roles, x, operand)


def forward(backend: Backend, x, operand, cfg: DotConfig):
  product = lambda x, op: backend.forward(x, op, cfg.precision)  # noqa: E731
  if cfg.split is None:
    return product(x, operand)
  return on_blocks(cfg.split, product, x, operand, backend.operand_roles(operand), False)


def backward_dx(backend: Backend, dy, operand, cfg: DotConfig):
  product = lambda dy, op: backend.backward_dx(dy, op, cfg.precision)  # noqa: E731
  if cfg.split is None:
    return product(dy, operand)
  return on_blocks(cfg.split, product, dy, operand, backend.operand_roles(operand), True)


def mask_grad(backend: Backend, dw, operand, cfg: DotConfig):
  if cfg.split is None:
    return backend.mask_grad(dw, operand)
  return split_map(cfg.split, backend.mask_grad, ("kn", backend.operand_roles(operand)), "kn",
                   dw, operand)


def sparse24_roles(sp: Sparse24) -> Sparse24:
  """`operand_roles` of a `Sparse24`: values and meta `[N, ...]`, the
  transposed pair `[K, ...]`."""
  t = sp.values_t is not None
  return Sparse24("nk", "nk", "kn" if t else None, "kn" if t else None)


def forward_compressed(backend: Backend, x, sp: Sparse24, precision, split: Split | None,
                       transposed: bool = False):
  """`x @ decompress(sp)` (`transposed`: `x @ decompress(sp)^T` from the
  transposed copy), on each device's block of `sp` under a `split`."""
  product = lambda x, sp: backend.forward_compressed(  # noqa: E731
      x, sp.transpose() if transposed else sp, precision)
  if split is None:
    return product(x, sp)
  return on_blocks(split, product, x, sp, sparse24_roles(sp), transposed)
