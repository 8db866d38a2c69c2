"""A 2:4 mask rebuilt only where a run-time flag asks (Pallas, Triton lowering).

`rebuild_mask(w, old, rebuild)` writes the packed mask of `w[K, N]`
(transposable, or plain) where the flags are set and copies `old` elsewhere,
counting the weights whose kept/pruned state changed: a mask rebuild
schedule's step without a conditional around the call.
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
from pallas_kernels._compress_io import check_weight, padded, row_lanes, with_pad_code
from pallas_kernels.prune_config import PruneConfig, fit_config
from pallas_kernels.transposable24 import prune_transposable_tile


def _plain_mask_kernel(w_ref, meta_ref, store_meta=None):
  """The plain 2:4 mask (largest 2 magnitudes of each group of 4 along K)
  of a `[bk, bn]` tile, packed metadata only (`meta_ref` `[bn, bk/8]`;
  `store_meta` as for `prune_transposable_tile`)."""
  _, meta = _tiles.compress_lanes(row_lanes(w_ref), None)  # [bk/8, bn]; no values stored
  meta = meta.astype(jnp.int32).T
  if store_meta is None:
    meta_ref[...] = meta.astype(jnp.uint8)
  else:
    store_meta(slice(None), meta)


def _popcount8(x: jax.Array) -> jax.Array:
  """The number of set bits of int32 values below 256."""
  x = x - ((x >> 1) & 0x55)
  x = (x & 0x33) + ((x >> 2) & 0x33)
  return (x + (x >> 4)) & 0x0F


class _Window:
  """`size` entries of a kernel ref along `axis` from a traced `offset`,
  indexed as a ref of that shape (`shape`, `[...]`, slices, `pl.ds`) by
  kernel code written for a whole block: each index is shifted on `axis`.
  (Triton's lowering takes one indexer per load or store, so a `ref.at[...]`
  view cannot be indexed again.)"""

  def __init__(self, ref, axis: int, offset, size: int):
    self.ref, self.axis, self.offset, self.size = ref, axis, offset, size
    self.shape = tuple(size if a == axis else d for a, d in enumerate(ref.shape))

  def _index(self, idx):
    idx = idx if isinstance(idx, tuple) else (idx,)
    if idx == (Ellipsis,):
      idx = ()
    idx = idx + (slice(None),) * (len(self.shape) - len(idx))
    i = idx[self.axis]
    if isinstance(i, slice):
      assert i == slice(None), i
      i = pl.ds(self.offset, self.size)
    else:
      i = pl.ds(self.offset + i.start, i.size, i.stride)
    return idx[:self.axis] + (i,) + idx[self.axis + 1:]

  def __getitem__(self, idx):
    return self.ref[self._index(idx)]

  def __setitem__(self, idx, value):
    self.ref[self._index(idx)] = value


def _rebuild_tile(w_ref, flag_ref, valid_ref, old_ref, meta_ref, flips_ref, *,
                  transposable: bool):
  """The mask kernel (transposable search or plain) on a `[bk, bn]` tile,
  which also counts the weights whose kept/pruned state changed against
  `old_ref` (in the first entry of its `flips_ref` row).

  valid_ref: per metadata byte column, the bits of its groups that lie in
  the unpadded weight (0xFF, 0x0F for the padding nibble, 0 beyond K);
  padded columns have flag 0, which leaves them out of the count."""
  counts = []

  def store(rows, meta):  # rows of meta_ref; meta: int32 bytes [rows, bk/8]
    meta_ref[rows, :] = meta.astype(jnp.uint8)
    valid = (jnp.where(flag_ref[rows] != 0, 0xFF, 0)[:, None]
             & valid_ref[...][None, :])
    changed = (rule.kept_bits(old_ref[rows, :].astype(jnp.int32)) ^ rule.kept_bits(meta)) & valid
    counts.append(jnp.sum(_popcount8(changed)))

  if transposable:
    prune_transposable_tile(w_ref, meta_ref, k_major=False, with_values=False,
                            strided_stores=True, store_meta=store)
  else:
    _plain_mask_kernel(w_ref, meta_ref, store_meta=store)
  first = jax.lax.broadcasted_iota(jnp.int32, flips_ref.shape, 1) == 0
  flips_ref[...] = jnp.where(first, functools.reduce(jnp.add, counts), 0)


def _rebuild_where_flagged(w_ref, flag_ref, valid_ref, old_ref, meta_ref, flips_ref, *,
                           transposable: bool, block_k: int):
  """A program of `rebuild_mask`: when any of its columns is flagged,
  `_rebuild_tile` on each of its `[block_k, bn]` tiles along K (a loop);
  else its block of the old mask copied, and counts of 0 (w is not read).

  Most steps rebuild nothing, and what the call costs then is this copy:
  with one tile per program each program copies rows of 8 bytes
  (`[bn, block_k/8]` of the `[N, K/8]` mask); 8 tiles along K make the rows
  64 bytes (docs/design_notes.md, "Mask rebuilds without a conditional")."""
  tiles = w_ref.shape[0] // block_k
  flagged = jnp.max(flag_ref[...]) != 0

  @pl.when(flagged)
  def _():
    if tiles == 1:
      _rebuild_tile(w_ref, flag_ref, valid_ref, old_ref, meta_ref, flips_ref,
                    transposable=transposable)
      return

    def tile(t, carry):
      bytes_ = block_k // 8
      _rebuild_tile(_Window(w_ref, 0, t * block_k, block_k), flag_ref,
                    _Window(valid_ref, 0, t * bytes_, bytes_),
                    _Window(old_ref, 1, t * bytes_, bytes_),
                    _Window(meta_ref, 1, t * bytes_, bytes_),
                    _Window(flips_ref, 0, t, 1), transposable=transposable)
      return carry

    jax.lax.fori_loop(0, tiles, tile, 0)

  @pl.when(jnp.logical_not(flagged))
  def _():
    meta_ref[...] = old_ref[...]
    flips_ref[...] = jnp.zeros(flips_ref.shape, jnp.int32)


# The fewest programs the rebuild kernel leaves when it puts several tiles
# into one (`rebuild_mask`): about one wave of an H100 or H200, which keeps
# about 2 of them resident per SM (the search's ~255 registers per thread).
_REBUILD_PROGRAMS = 256


@functools.partial(jax.jit, static_argnames=("transposable", "config", "tiles_per_program",
                                             "interpret"))
def rebuild_mask(w: jax.Array, old: jax.Array, rebuild: jax.Array, *, transposable: bool,
                 config: PruneConfig | None = None, tiles_per_program: int | None = None,
                 interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """`(mask, flips)`: the packed 2:4 mask of `w[K, N]` (transposable: as
  `transposable24.transposable_mask`; else the plain one, as
  `prune24.prune_compress` chooses it) where `rebuild` is non-zero, else
  `old` as it is, with no conditional around the call: on a GPU an XLA
  conditional copies its predicate to the host and waits for it, which
  stalls the launch queue once per step. Every program reads its flags; an
  unflagged one copies its block of `old` and does nothing else (w is not
  read).

  old: packed metadata `uint8[N, ceil(K/8)]`; rebuild: `int32[N]`, one flag
  per column of `w` (the caller broadcasts one flag, so that the flags
  shard with w's columns). A tile is rebuilt whole when any of its columns
  is flagged.

  tiles_per_program: the tiles along K that one program takes (a power of
  two dividing the padded K's tiles); None: as many as leave at least
  `_REBUILD_PROGRAMS` programs, at most 8.

  flips: `int32[R, ceil(N/8)]` (R: the kernel's row tiles), whose sum is the
  number of weights of the flagged columns that the new mask keeps and the
  old one prunes or the reverse (0 where nothing is rebuilt): the flip
  statistics of a rebuild, counted while the mask is written, so that a
  step that rebuilds nothing makes no pass over the masks for them.
  """
  fn = "rebuild_mask"
  check_weight(fn, w, transposable)
  k, n = w.shape
  if old.shape != (n, math.ceil(k / 8)) or old.dtype != jnp.uint8:
    raise ValueError(
        f"{fn}: `old` must be uint8[{n}, {math.ceil(k / 8)}] for w of shape {w.shape},"
        f" got {old.dtype}{list(old.shape)}.")
  if rebuild.shape != (n,):
    raise ValueError(f"{fn}: `rebuild` must be [{n}] (one flag per column of w), got"
                     f" {list(rebuild.shape)}.")
  # The plain mask: the plain prune kernel's tile in cuSPARSELt's layout
  # (64x128, strided row lanes), which reads N-contiguous rows as this does.
  cfg = fit_config(config or PruneConfig.default(
      k, n, "prune_transposable" if transposable else "prune", "cusparselt"), k, n)
  bk, bn = cfg.block_k, cfg.block_n
  wp = padded(w, bk, bn)
  kp, np_ = wp.shape
  per = tiles_per_program
  if per is None:
    per = 1
    while per < 8 and (kp // bk) % (2 * per) == 0 and (
        (kp // bk) * (np_ // bn) // (2 * per) >= _REBUILD_PROGRAMS):
      per *= 2
  if per < 1 or per & (per - 1) or (kp // bk) % per:
    raise ValueError(f"{fn}: `tiles_per_program` must be a power of two dividing the"
                     f" {kp // bk} tiles along K, got {tiles_per_program}.")
  bkp = per * bk  # the rows of w of a program
  flags = jnp.pad(rebuild.astype(jnp.int32), (0, np_ - n))
  oldp = jnp.pad(old, ((0, np_ - n), (0, kp // 8 - old.shape[1])))
  # Byte b holds groups 2b and 2b + 1: both real, only the first, or none.
  # (An iota, not an array constant: the call may sit inside a
  # custom_partitioning rule, which refuses constants.)
  groups = 2 * jax.lax.iota(jnp.int32, kp // 8)
  valid = jnp.where(groups + 1 < k // 4, 0xFF, jnp.where(groups < k // 4, 0x0F, 0))
  meta, flips = pl.pallas_call(
      functools.partial(_rebuild_where_flagged, transposable=transposable, block_k=bk),
      out_shape=[jax.ShapeDtypeStruct((np_, kp // 8), jnp.uint8),
                 jax.ShapeDtypeStruct((kp // bk, np_ // 8), jnp.int32)],
      grid=(kp // bkp, np_ // bn),
      in_specs=[pl.BlockSpec((bkp, bn), lambda i, j: (i, j)),
                pl.BlockSpec((bn,), lambda i, j: (j,)),
                pl.BlockSpec((bkp // 8,), lambda i, j: (i,)),
                pl.BlockSpec((bn, bkp // 8), lambda i, j: (j, i))],
      out_specs=[pl.BlockSpec((bn, bkp // 8), lambda i, j: (j, i)),
                 pl.BlockSpec((per, bn // 8), lambda i, j: (i, j))],
      compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps,
                                              num_stages=cfg.num_stages),
      interpret=interpret,
      name="jsparse24_rebuild_mask",
  )(wp, flags, valid, oldp)
  return with_pad_code(meta[:n, :math.ceil(k / 8)], k), flips[:, :math.ceil(n / 8)]
