"""2:4 compression with a stored mask, in one pass (Pallas, Triton lowering).

`compress_with_meta(w, meta)` applies a stored packed mask (the `Mask24`
layout) to a dense weight `w[K, N]` instead of pruning it, and writes what
`prune24.prune_compress` writes: the K-compressed values, and with
`transposed=True` the N-compressed copy and its metadata, in either layout.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _tiles
from pallas_kernels import prune_rule as rule
from pallas_kernels._compress_io import (check_layout, check_weight, outputs, padded,
                                         row_lanes, store_slots, with_pad_code)
from pallas_kernels.prune_config import PruneConfig, fit_config


def _apply_kernel(w_ref, meta_in_ref, values_ref, *rest, transposed: bool,
                  k_major: bool, strided_lanes: bool):
  if strided_lanes:
    # The codes arrive transposed (`[bk/8, bn]`, by XLA before the call):
    # transposed here, the code tile would go through shared memory
    # (docs/design_notes.md, "Layout choices inside the compress kernels").
    # The K-compressed copy comes from the row lanes, as
    # plain pruning's does: in the cuSPARSELt layout nothing transposes a
    # tile; in the Sparse24 layout only its four value slots are transposed
    # (`prune24._prune_kernel`), not the whole weight tile.
    meta_kn = meta_in_ref[...].astype(jnp.int32)
    keep_kn = _tiles.keep_from_meta(meta_kn)  # 8 x [bk/8, bn]
    slots, _ = _tiles.compress_lanes(row_lanes(w_ref), keep_kn)
    store_slots(values_ref, slots, k_major)
  else:
    meta_in = meta_in_ref[...]  # [bn, bk/8]
    values, _ = _tiles.compress_rows(w_ref[...].T, _tiles.keep_from_meta(meta_in))
    values_ref[...] = values.T if k_major else values
  if transposed:
    values_t_ref, meta_t_ref = rest
    if strided_lanes:  # each row's keep decoded from its code byte, no tile transpose
      keep = _tiles.keep_rows(meta_kn)
    else:  # the keep lanes joined into a [bn, bk] tile, then transposed
      keep_lanes = _tiles.keep_from_meta(meta_in)  # 8 x [bn, bk/8]
      keep = _tiles.join_lanes([k.astype(jnp.int32) for k in keep_lanes]).T  # [bk, bn]
    values_t, meta_t = _tiles.compress_rows(
        w_ref[...], [k != 0 for k in _tiles.split_lanes(keep.astype(jnp.int32), 8)])
    values_t_ref[...] = values_t
    meta_t_ref[...] = meta_t


@functools.partial(jax.jit, static_argnames=("transposed", "config", "interpret", "layout"))
def compress_with_meta(w: jax.Array, meta: jax.Array, *, transposed: bool = False,
                       config: PruneConfig | None = None, interpret: bool = False,
                       layout: str = "sparse24"):
  """Compresses `w[K, N]` with a stored packed mask `meta` (the `Mask24`
  layout, `uint8[N, ceil(K/8)]`), in one pass.

  Returns `(values [N, K/2], values_t, meta_t)`; the transposed pair (the
  mask must be transposable) only with `transposed=True`, else None. With
  layout="cusparselt" (bfloat16/float16, K and N multiples of 64) `values` is
  `[K/2 + K/16, N]` and `values_t` `[K + K/8, N/2]`, the values in their
  leading rows, the rest unwritten (the metadata rows, for
  `cusparselt_metadata.write_cusparselt_metadata`).
  """
  fn = "compress_with_meta"
  check_weight(fn, w, transposed)
  k_major = check_layout(fn, w, layout)
  k, n = w.shape
  if meta.shape != (n, math.ceil(k / 8)) or meta.dtype != jnp.uint8:
    raise ValueError(
        f"{fn}: `meta` must be uint8[{n}, {math.ceil(k / 8)}] for w of shape"
        f" {w.shape}, got {meta.dtype}{list(meta.shape)}.")
  cfg = fit_config(config or PruneConfig.default(
      k, n, "apply_transposed" if transposed else "apply", layout), k, n, exact=k_major)
  bk, bn = cfg.block_k, cfg.block_n
  wp = padded(w, bk, bn)
  kp, np_ = wp.shape
  # Padding groups get the padding code 0x4 (indices 0, 1) on zero weights.
  mp = jnp.pad(meta, ((0, np_ - n), (0, kp // 8 - meta.shape[1])),
               constant_values=rule.PAD_BYTE)
  out_shape, out_specs = outputs(wp, cfg, meta=False, transposed=transposed,
                                 k_major=k_major)
  if cfg.strided_lanes:  # the codes transposed for the kernel (`_apply_kernel`)
    mp, codes_spec = mp.T, pl.BlockSpec((bk // 8, bn), lambda i, j: (i, j))
  else:
    codes_spec = pl.BlockSpec((bn, bk // 8), lambda i, j: (j, i))
  outs = pl.pallas_call(
      functools.partial(_apply_kernel, transposed=transposed, k_major=k_major,
                        strided_lanes=cfg.strided_lanes),
      out_shape=out_shape,
      grid=(kp // bk, np_ // bn),
      in_specs=[pl.BlockSpec((bk, bn), lambda i, j: (i, j)), codes_spec],
      out_specs=out_specs,
      compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps,
                                              num_stages=cfg.num_stages),
      interpret=interpret,
      name="jsparse24_compress_with_meta",
  )(wp, mp)
  if k_major:
    return outs[0], (outs[1] if transposed else None), (outs[2] if transposed else None)
  values = outs[0][:n, :k // 2]
  if not transposed:
    return values, None, None
  return values, outs[1][:k, :n // 2], with_pad_code(outs[2][:k, :math.ceil(n / 8)], n)
