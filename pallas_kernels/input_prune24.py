"""Fused 2:4 prune + compress of an activation along its contiguous axis
(Pallas, Triton lowering): the sparse operand of `y = prune(x) @ w`.

`prune_compress_rows(x)` reads `x[M, K]` (row-major, K contiguous) once and
writes it pruned 2:4 along K by magnitude (`prune_rule`: the 2 largest |x|
of every 4, ties to the lower index; the rule `prune24` applies to weights)
and compressed, each row's groups staying in that row:

- `layout="sparse24"`: values `[M, K/2]` and metadata `uint8[M, ceil(K/8)]`
  (two 4-bit codes per byte, the lower group in the low nibble): jsparse24's
  `Sparse24` layout of `x^T` read as a `[K, M]` weight, so the plain-`jnp`
  reference is `compress_reference(x.T, prune_24(x.T, axis=0))`.
- `layout="cusparselt"` (bfloat16/float16; M and K multiples of 64): the
  values `[M, K/2]` in the leading M rows of a `[M + M/8, K/2]` buffer and
  the codes `uint8[M, K/8]`, from which the caller writes the buffer's last
  M/8 rows (`cusparselt_metadata.write_cusparselt_metadata(buf, codes,
  row=M)`: R = M rows of G = K/4 groups). This is the byte order of a
  structured operand stored with its sparse axis contiguous: `x` as the
  column-major `K x M` matrix it already is, compressed along K to `K/2 x
  M`, the metadata's 64-row x 8-group blocks taken over (rows M, groups
  along K) as for a weight over (N, groups along K). Which cuSPARSELt
  descriptor reads it (a structured B, op_N; or a structured A, op_T, with
  a row-major output) and whether its metadata blocks are ordered so for
  this orientation is not verified on a GPU here: no product uses this
  layout yet.

Each program compresses a `[bm, bk]` tile along its rows, its last axis,
with no transpose: the row groups are the tile's contiguous lanes
(`_tiles.compress_rows`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _tiles
from pallas_kernels._compress_io import check_layout, with_pad_code
from pallas_kernels.prune_config import PruneConfig, fit_config

# block_k: the tile's extent along K (the compressed axis), block_n: along M.
# The fastest of `benchmarks/tune_prune.py --which rows`'s sweep on an H100
# at 16384^2 (0.300 ms, 95% of copy bandwidth, against 0.359 ms for the
# 64 x 128 tile of `prune24`'s plain pruning; long, flat tiles: each row's
# stretch of K is contiguous): benchmarks/results/nvidia-h100-80gb-hbm3.md,
# "The activations' prune + compress tile".
DEFAULT_CONFIG = PruneConfig(block_k=256, block_n=32, num_warps=8)


def _kernel(x_ref, values_ref, meta_ref):
  values, meta = _tiles.compress_rows(x_ref[...], None)
  values_ref[...] = values
  meta_ref[...] = meta


def _check(fn: str, x: jax.Array, layout: str) -> bool:
  """Checks `x` and `layout`; True for layout="cusparselt"."""
  if x.ndim != 2:
    raise ValueError(f"{fn}: `x` must be 2-D [M, K], got shape {x.shape}.")
  if x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
    raise TypeError(f"{fn}: `x` must be bfloat16, float16 or float32, got {x.dtype}.")
  if x.shape[1] % 4 or not x.shape[1]:
    raise ValueError(f"{fn}: K = x.shape[1] = {x.shape[1]} must be a positive multiple of 4.")
  return check_layout(fn, x, layout, name="x", dims="M and K", fix=" (pad M with zero rows)")


@functools.partial(jax.jit, static_argnames=("config", "interpret", "layout"))
def prune_compress_rows(x: jax.Array, *, config: PruneConfig | None = None,
                        interpret: bool = False, layout: str = "sparse24"):
  """`(values, meta)` of `x[M, K]` pruned 2:4 along K (module docstring):
  `([M, K/2], uint8[M, ceil(K/8)])`, or with layout="cusparselt" `([M +
  M/8, K/2] buffer, codes uint8[M, K/8])`, the buffer's last M/8 rows
  unwritten (the metadata's, written by the caller)."""
  fn = "prune_compress_rows"
  exact = _check(fn, x, layout)
  m, k = x.shape
  cfg = fit_config(config or DEFAULT_CONFIG, k, m, exact=exact)
  bk, bm = cfg.block_k, cfg.block_n
  # Zero groups compress to code 0x4, the format's padding code
  # (`_compress_io.padded`): slicing the outputs back gives the answer.
  xp = x if exact else jnp.pad(x, ((0, -m % bm), (0, -k % bk)))
  mp, kp = xp.shape
  rows = mp + mp // 8 if exact else mp
  values, meta = pl.pallas_call(
      _kernel,
      out_shape=[jax.ShapeDtypeStruct((rows, kp // 2), x.dtype),
                 jax.ShapeDtypeStruct((mp, kp // 8), jnp.uint8)],
      grid=(mp // bm, kp // bk),
      in_specs=[pl.BlockSpec((bm, bk), lambda i, j: (i, j))],
      out_specs=[pl.BlockSpec((bm, bk // 2), lambda i, j: (i, j)),
                 pl.BlockSpec((bm, bk // 8), lambda i, j: (i, j))],
      compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps,
                                              num_stages=cfg.num_stages),
      interpret=interpret,
      name="jsparse24_input_prune_compress",
  )(xp)
  if exact:
    return values, meta
  return values[:m, :k // 2], with_pad_code(meta[:m, :math.ceil(k / 8)], k)
