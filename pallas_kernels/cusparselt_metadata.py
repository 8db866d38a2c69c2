"""cuSPARSELt's metadata written into a compressed buffer in place (Pallas,
Triton lowering).

`write_cusparselt_metadata(buf, meta, row=...)` writes, after the values of
a buffer in cuSPARSELt's layout (`prune24.prune_compress(...,
layout="cusparselt")`, `mvue24.mvue_compress`), the metadata of its packed
mask. The word arithmetic of a 64-row x 8-group block and its plain-`jnp`
reference are in `cusparselt_layout` (used without Pallas too).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _tiles, cusparselt_layout


def _metadata_halves(lo: jax.Array, hi: jax.Array) -> list[jax.Array]:
  """The output words d1 = 0, 1 of a block from the mask's words of rows
  16a + b (`lo`) and 16a + 8 + b (`hi`), in their layout."""
  spread = cusparselt_layout.spread_nibbles
  return [spread(lo >> (8 * d1)) | (spread(hi >> (8 * d1)) << 4)
          for d1 in range(2)]


def _metadata_kernel(words_ref, buf_ref, out_ref):
  """One 64-row block of the mask (`words_ref` `[64, nb]`: nb 8-group
  blocks) -> its nb 256-byte metadata blocks (`out_ref` `[nb, 64]` words).
  `buf_ref` is the aliased buffer (not read)."""
  del buf_ref
  for a in range(4):
    lo = words_ref[pl.ds(16 * a, 8), :]  # [b, nb]: rows 16a + b
    hi = words_ref[pl.ds(16 * a + 8, 8), :]  # rows 16a + 8 + b
    halves = [h.T for h in _metadata_halves(lo, hi)]  # [nb, b]
    out_ref[:, pl.ds(16 * a, 16)] = _tiles.join_lanes(halves)  # word 16a + 2b + d1


def _metadata_kernel_by_groups(bytes_ref, buf_ref, out_ref):
  """`_metadata_kernel` on the mask's transpose (`bytes_ref` `[4 nb, 64]`:
  a row per byte of 2 groups, a column per mask row): each 8-group block's
  word is four strided rows of bytes, already `[nb, b]` (no transpose)."""
  del buf_ref
  nb = bytes_ref.shape[0] // 4

  def words(col0):  # [nb, 8]: the words of mask rows col0 .. col0 + 7
    parts = [bytes_ref[pl.ds(j, nb, stride=4), pl.ds(col0, 8)].astype(jnp.uint32) << (8 * j)
             for j in range(4)]
    return (parts[0] | parts[1]) | (parts[2] | parts[3])

  for a in range(4):
    halves = _metadata_halves(words(16 * a), words(16 * a + 8))  # [nb, b]
    out_ref[:, pl.ds(16 * a, 16)] = _tiles.join_lanes(halves)  # word 16a + 2b + d1


@functools.partial(jax.jit, static_argnames=("row", "by_groups", "interpret"),
                   donate_argnums=(0,))
def write_cusparselt_metadata(buf: jax.Array, meta: jax.Array, *, row: int,
                              by_groups: bool = False, interpret: bool = False) -> jax.Array:
  """`buf` (a 16-bit `[T, C]` compressed buffer, `layout="cusparselt"`)
  with cuSPARSELt's metadata of the packed mask `meta` (`uint8[R, G/2]`: R
  rows of G groups of 4, R and G multiples of 64 and 8; with `by_groups`
  its transpose `uint8[G/2, R]`, as a kernel that compresses along its
  tile's rows writes it without a transpose) written from row `row` on, in
  place (`buf` is donated; every other element is kept).

  One pass: each program reads a 64-row block of the mask and writes its
  256-byte metadata blocks. (XLA's fusions of the same word arithmetic,
  `cusparselt_layout.metadata_words_reference`, made three passes and an
  in-place update.)
  """
  fn = "write_cusparselt_metadata"
  t, c = buf.shape
  half, r = meta.shape if by_groups else meta.shape[::-1]
  if jnp.dtype(buf.dtype).itemsize != 2 or meta.dtype != jnp.uint8:
    raise TypeError(f"{fn}: `buf` must be 16-bit and `meta` uint8, got {buf.dtype},"
                    f" {meta.dtype}.")
  if r % 64 or half % 4:
    form = "[G/2, R]" if by_groups else "[R, G/2]"
    raise ValueError(f"{fn}: `meta` must be {form} with R a multiple of 64 and G of 8,"
                     f" got {list(meta.shape)}.")
  groups = 2 * half
  blocks = r // 64 * (groups // 8)
  if (row * c) % 128 or row * c // 2 + 64 * blocks > t * c // 2:
    raise ValueError(f"{fn}: {blocks} metadata blocks from row {row} do not fit"
                     f" `buf` {list(buf.shape)} (or row * C is not a multiple of 128).")
  first = row * c // 128  # the first metadata block, in 64-word rows
  nb = math.gcd(32, groups // 8, first)  # blocks per program (gcd(x, 0) = x)
  view = jax.lax.bitcast_convert_type(buf.reshape(t, c // 2, 2), jnp.uint32).reshape(-1, 64)
  per_row = groups // 8 // nb  # output blocks of nb per 64-row block
  spec = pl.BlockSpec((nb, 64), lambda i, j: (first // nb + i * per_row + j, 0))
  if by_groups:
    kernel, codes = _metadata_kernel_by_groups, meta
    codes_spec = pl.BlockSpec((4 * nb, 64), lambda i, j: (j, i))
  else:
    kernel = _metadata_kernel
    codes = jax.lax.bitcast_convert_type(meta.reshape(r, groups // 8, 4), jnp.uint32)
    codes_spec = pl.BlockSpec((64, nb), lambda i, j: (i, j))
  out = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct(view.shape, jnp.uint32),
      grid=(r // 64, per_row),
      in_specs=[codes_spec, spec],
      out_specs=spec,
      input_output_aliases={1: 0},
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="jsparse24_cusparselt_metadata",
  )(codes, view)
  return jax.lax.bitcast_convert_type(out.reshape(t, c // 2), buf.dtype).reshape(t, c)
