"""`x @ W` with W 2:4-compressed, expanded on chip (Pallas, Triton lowering).

`W[K, N]` arrives as jsparse24's `Sparse24` layout: values `[N, K/2]` and
metadata `uint8[N, ceil(K/8)]` (K contiguous), ~56% of the dense bytes for
bf16. Each program owns a `[block_m, block_n]` output tile; it walks K in
`block_k` steps, loads the compressed tile, expands it to a dense
`[block_n, block_k]` tile in registers and issues a dense tensor-core product
(Triton cannot issue the sparse `mma.sp`), accumulating in float32. So the
kernel saves memory traffic, not arithmetic: it pays where the product is
bound by reading W (small M), not at large M.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _tiles
from pallas_kernels import prune_rule as rule


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
  """Tile sizes of the sparse-operand matmul (powers of two)."""

  block_m: int = 64
  block_n: int = 64
  block_k: int = 128
  num_warps: int = 4
  num_stages: int = 3
  # True: load x and the value slots with strided loads and issue one dot per
  # lane of 8 (K permuted consistently in both operands), so nothing is
  # shuffled in registers; False: expand W to a dense tile (lane joins) and
  # issue one dot per K step.
  lane_dots: bool = False

  @classmethod
  def default(cls, m: int, k: int, n: int) -> "MatmulConfig":
    del k, n
    if m <= 16:
      return cls(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=4)
    if m <= 64:
      return cls(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4)
    return cls(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)


def _spmm_kernel(x_ref, values_ref, meta_ref, o_ref, *, k_steps: int, block_k: int,
                 lane_dots: bool):
  block_m, block_n = o_ref.shape
  # float32 inputs: full-precision products (Triton's default is TF32).
  precision = jax.lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

  def lanes_body(step, acc):
    k0 = step * block_k
    v0 = step * (block_k // 2)
    meta = meta_ref[:, pl.ds(pl.multiple_of(step * (block_k // 8), block_k // 8), block_k // 8)]
    codes = meta.astype(jnp.int32)
    zero = jnp.zeros((), values_ref.dtype)
    for g, code in enumerate(rule.byte_codes(codes)):
      i0, i1 = rule.code_indices(code)
      first = values_ref[:, pl.ds(v0 + 2 * g, block_k // 8, stride=4)]
      second = values_ref[:, pl.ds(v0 + 2 * g + 1, block_k // 8, stride=4)]
      for l in range(4):
        lane = jnp.where(i0 == l, first, jnp.where(i1 == l, second, zero))  # [bn, bk/8]
        x = x_ref[:, pl.ds(k0 + 4 * g + l, block_k // 8, stride=8)]  # [bm, bk/8]
        acc = acc + jnp.dot(x, lane.T, precision=precision,
                            preferred_element_type=jnp.float32)
    return acc

  def body(step, acc):
    k0 = pl.multiple_of(step * block_k, block_k)
    x = x_ref[:, pl.ds(k0, block_k)]
    values = values_ref[:, pl.ds(pl.multiple_of(step * (block_k // 2), block_k // 2), block_k // 2)]
    meta = meta_ref[:, pl.ds(pl.multiple_of(step * (block_k // 8), block_k // 8), block_k // 8)]
    w_t = _tiles.expand_rows(values, meta)  # [block_n, block_k]
    return acc + jnp.dot(x, w_t.T, precision=precision,
                         preferred_element_type=jnp.float32)

  acc = jax.lax.fori_loop(0, k_steps, lanes_body if lane_dots else body,
                          jnp.zeros((block_m, block_n), jnp.float32))
  o_ref[...] = acc.astype(o_ref.dtype)


def _fit(config: MatmulConfig, m: int, k: int, n: int) -> MatmulConfig:
  bm = min(config.block_m, max(16, pl.next_power_of_2(m)))
  bn = min(config.block_n, max(16, pl.next_power_of_2(n)))
  # lane_dots issues dots of depth block_k/8, which must be at least 16.
  bk = min(config.block_k, max(128 if config.lane_dots else 16, pl.next_power_of_2(k)))
  return dataclasses.replace(config, block_m=bm, block_n=bn, block_k=bk)


@functools.partial(jax.jit, static_argnames=("k", "config", "interpret"))
def sparse_matmul(x: jax.Array, values: jax.Array, meta: jax.Array, *, k: int,
                  config: MatmulConfig | None = None, interpret: bool = False) -> jax.Array:
  """`x[M, K] @ W[K, N]` with W given compressed (values `[N, K/2]`, meta
  `uint8[N, ceil(K/8)]`). float32 accumulation; output in x's dtype.

  M and N can be anything (tails are padded); K must be a multiple of 4 (it is
  zero-padded to whole `block_k` tiles when it is not one).
  """
  m, n = _tiles.check_operands("sparse_matmul", x, values, meta, k)
  cfg = _fit(config or MatmulConfig.default(m, k, n), m, k, n)
  bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
  mp, np_, kp = -m % bm + m, -n % bn + n, -k % bk + k
  if kp != k:  # zero weights in the padded K: the padding codes keep (0, 1) of zeros
    x = jnp.pad(x, ((0, 0), (0, kp - k)))
    values = jnp.pad(values, ((0, 0), (0, (kp - k) // 2)))
    meta = jnp.pad(meta, ((0, 0), (0, kp // 8 - meta.shape[1])), constant_values=rule.PAD_BYTE)
  if mp != m:
    x = jnp.pad(x, ((0, mp - m), (0, 0)))
  if np_ != n:
    values = jnp.pad(values, ((0, np_ - n), (0, 0)))
    meta = jnp.pad(meta, ((0, np_ - n), (0, 0)), constant_values=rule.PAD_BYTE)
  out = pl.pallas_call(
      functools.partial(_spmm_kernel, k_steps=kp // bk, block_k=bk, lane_dots=cfg.lane_dots),
      out_shape=jax.ShapeDtypeStruct((mp, np_), x.dtype),
      grid=(mp // bm, np_ // bn),
      in_specs=[pl.BlockSpec((bm, kp), lambda i, j: (i, 0)),
                pl.BlockSpec((bn, kp // 2), lambda i, j: (j, 0)),
                pl.BlockSpec((bn, kp // 8), lambda i, j: (j, 0))],
      out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
      compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps,
                                              num_stages=cfg.num_stages),
      interpret=interpret,
      name="jsparse24_spmm",
  )(x, values, meta)
  return out[:m, :n]
