"""Fused 2:4 prune + compress in one pass over memory (Pallas, Triton lowering).

`prune_compress(w)` reads a dense weight `w[K, N]` once and writes, per tile,
the compressed values and metadata (jsparse24's `Sparse24` layout: values
`[N, K/2]`, meta `uint8[N, ceil(K/8)]`, K contiguous; or cuSPARSELt's,
`layout="cusparselt"`), and with `transposable=True` also those of `w^T`
(`[K, N/2]`, `[K, ceil(N/8)]`), using the exact best of the 90 4x4 patterns
(`transposable24`). Results are bit-identical to jsparse24's plain `jnp`
reference (`jsparse24._prune`, `jsparse24._format`), which defines the
contract.

The other kernels of the family, one file each: `transposable24` (the
transposable search; `transposable_mask`, the mask alone),
`masked_compress` (`compress_with_meta`: a stored mask applied instead of
pruning), `mask_rebuild` (`rebuild_mask`: a mask rebuilt only where a
run-time flag asks) and `cusparselt_metadata`
(`write_cusparselt_metadata`: cuSPARSELt's metadata written after the
values of a compressed buffer, in place).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _tiles
from pallas_kernels._compress_io import (check_layout, check_weight, outputs, padded,
                                         row_lanes, store_slots, with_pad_code)
from pallas_kernels.prune_config import PruneConfig, fit_config
from pallas_kernels.transposable24 import prune_transposable_tile


def _prune_kernel(w_ref, values_ref, meta_ref, *, strided_lanes: bool, k_major: bool):
  if strided_lanes:  # row lanes by strided loads: compressed along K with no transpose
    slots, meta = _tiles.compress_lanes(row_lanes(w_ref), None)  # meta [bk/8, bn]
    store_slots(values_ref, slots, k_major)
    meta_ref[...] = meta.astype(jnp.int32).T.astype(jnp.uint8)
    return
  values, meta = _tiles.compress_rows(w_ref[...].T, None)
  values_ref[...] = values.T if k_major else values
  meta_ref[...] = meta


@functools.partial(jax.jit, static_argnames=("transposable", "config", "interpret", "layout",
                                                   "values_rows"))
def prune_compress(w: jax.Array, *, transposable: bool = False,
                   config: PruneConfig | None = None, interpret: bool = False,
                   layout: str = "sparse24", values_rows: int | None = None):
  """Prunes `w[K, N]` by magnitude (2:4 along K) and compresses, in one pass.

  Returns `(values [N, K/2], meta uint8[N, ceil(K/8)], values_t, meta_t)`;
  the last two are `[K, N/2]`, `uint8[K, ceil(N/8)]` with
  `transposable=True`, else None. With layout="cusparselt" (bfloat16/float16,
  K and N multiples of 64) `values` is `[K/2 + K/16, N]`: the values
  `[K/2, N]` in its first K/2 rows, and `values_t` `[K + K/8, N/2]`, the
  values in its first K rows; the rest unwritten (the metadata rows, for
  `cusparselt_metadata.write_cusparselt_metadata`). `values_rows`
  (layout="cusparselt" only, at least K/2 + K/16): `values` has that many
  rows, those past K/2 unwritten, so that a caller can keep the buffer
  inside an array of another shape without a copy.
  """
  fn = "prune_compress"
  check_weight(fn, w, transposable)
  k_major = check_layout(fn, w, layout)
  k, n = w.shape
  if values_rows is not None and (not k_major or values_rows < k // 2 + k // 16):
    raise ValueError(f"{fn}: values_rows={values_rows} needs layout='cusparselt' and at least"
                     f" K/2 + K/16 = {k // 2 + k // 16} rows (w of shape {w.shape}).")
  cfg = fit_config(config or PruneConfig.default(
      k, n, "prune_transposable" if transposable else "prune", layout), k, n, exact=k_major)
  bk, bn = cfg.block_k, cfg.block_n
  wp = padded(w, bk, bn)
  kp, np_ = wp.shape
  out_shape, out_specs = outputs(wp, cfg, meta=True, transposed=transposable,
                                 k_major=k_major, values_rows=values_rows)
  if transposable:
    # One kernel choosing the search per tile, not `transposable_mask`'s two
    # passes: with every output written by both passes, the compile time
    # doubles for a few percent of the kernel's time (docs/design_notes.md,
    # "The transposable mask alone runs in two passes").
    kernel = functools.partial(prune_transposable_tile, k_major=k_major, with_values=True,
                               strided_stores=cfg.strided_lanes)
  else:
    kernel = functools.partial(_prune_kernel, strided_lanes=cfg.strided_lanes, k_major=k_major)
  outs = pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(kp // bk, np_ // bn),
      in_specs=[pl.BlockSpec((bk, bn), lambda i, j: (i, j))],
      out_specs=out_specs,
      compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps,
                                              num_stages=cfg.num_stages),
      interpret=interpret,
      name="jsparse24_prune_compress_t" if transposable else "jsparse24_prune_compress",
  )(wp)
  if k_major:
    if not transposable:
      return outs[0], outs[1], None, None
    return outs[0], outs[1], outs[2], outs[3]
  values = outs[0][:n, :k // 2]
  meta = with_pad_code(outs[1][:n, :math.ceil(k / 8)], k)
  if not transposable:
    return values, meta, None, None
  return values, meta, outs[2][:k, :n // 2], with_pad_code(outs[3][:k, :math.ceil(n / 8)], n)
