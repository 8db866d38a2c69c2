"""A compressed weight's values written into a cuSPARSELt buffer (Pallas,
Triton lowering).

A `Sparse24` keeps its values `[N, K/2]` (each output column's kept values
in K order, as the decode kernel reads them); cuSPARSELt's forward buffer
holds them `[K/2, N]`, then the metadata rows (`write_cusparselt_metadata`
fills those in place). `values_into_buffer` writes the transpose straight
into a buffer with room for the metadata: one pass over the values, where
XLA's `concatenate([values.T, metadata])` made two (the transpose, then the
copy into the joined buffer).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

# Tile edge: 64 x 64 16-bit values per program (8 KB). cuSPARSELt's
# alignment makes N a multiple of 64 but K/2 only of 32: an edge that 64
# does not divide takes its gcd with 64.
TILE = 64


def values_into_buffer_reference(values: jax.Array, rows: int) -> jax.Array:
  """Plain-`jnp` reference: `[rows, N]` with `values.T` (`values [N, H]`) in
  rows 0 .. H - 1 and zeros after (the kernel leaves those rows unwritten)."""
  n, h = values.shape
  return jnp.zeros((rows, n), values.dtype).at[:h].set(values.T)


def _transpose_kernel(v_ref, out_ref):
  out_ref[...] = v_ref[...].T


def values_into_buffer(values: jax.Array, *, rows: int, interpret: bool = False) -> jax.Array:
  """A new `[rows, N]` buffer with `values.T` (`values [N, H]`, 16-bit) in
  its first H rows; rows H .. rows - 1 are left unwritten, for the metadata
  (`cusparselt_metadata.write_cusparselt_metadata`, in place). N and H must
  be multiples of 32 (cuSPARSELt's alignment makes N a multiple of 64 and
  H = K/2 of 32)."""
  fn = "values_into_buffer"
  n, h = values.shape
  if jnp.dtype(values.dtype).itemsize != 2:
    raise TypeError(f"{fn}: `values` must be 16-bit, got {values.dtype}.")
  if n % 32 or h % 32 or rows < h:
    raise ValueError(f"{fn}: `values` [N, H] needs N and H multiples of 32 and rows >= H,"
                     f" got {list(values.shape)} and rows={rows}.")
  bn, bh = math.gcd(n, TILE), math.gcd(h, TILE)
  return pl.pallas_call(
      _transpose_kernel,
      out_shape=jax.ShapeDtypeStruct((rows, n), values.dtype),
      grid=(n // bn, h // bh),
      in_specs=[pl.BlockSpec((bn, bh), lambda i, j: (i, j))],
      out_specs=pl.BlockSpec((bh, bn), lambda i, j: (j, i)),
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="jsparse24_cusparselt_values",
  )(values)
