"""Fused 2:4 prune + compress in one pass over memory (Pallas, Triton lowering).

`prune_compress(w)` reads a dense weight `w[K, N]` once and writes, per tile,
the compressed values and metadata (jsparse24's `Sparse24` layout: values
`[N, K/2]`, meta `uint8[N, ceil(K/8)]`, K contiguous), and with
`transposable=True` also those of `w^T` (`[K, N/2]`, `[K, ceil(N/8)]`), using
the exact best of the 90 4x4 patterns (in either layout);
`transposable_mask(w)` runs that search alone and writes only the packed
mask, and `rebuild_mask(w, old, rebuild)` builds a mask (transposable or
plain) only where a run-time flag asks (a mask rebuild schedule without a
conditional). `compress_with_meta(w, meta)` applies a stored packed mask instead of
pruning. `write_cusparselt_metadata(buf, meta, row=...)` writes cuSPARSELt's
metadata into a compressed buffer after its values, in place. Results are
bit-identical to the plain `jnp` references below (which define the contract
through jsparse24's reference format code).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _tiles, cusparselt_layout
from pallas_kernels import prune_rule as rule
from pallas_kernels.cusparselt_layout import CUSPARSELT_ALIGN


@dataclasses.dataclass(frozen=True)
class PruneConfig:
  """Tile sizes of the prune/compress kernels (powers of two)."""

  block_k: int = 64
  block_n: int = 64
  num_warps: int = 4
  num_stages: int = 1
  # Load the lanes of the tile with strided loads (True) or separate them in
  # registers after one contiguous load (False): the 8 row lanes of the
  # K-compressed values (plain pruning and compression with a stored mask,
  # in either layout; the values are then stored with strided stores in
  # the cuSPARSELt layout, their slots transposed and joined in registers in
  # the Sparse24 layout).
  # With a stored mask's transposed copy (either layout), True also decodes
  # each row's keep from its code byte (`_tiles.keep_rows`) where False
  # joins the keep lanes and transposes the tile.
  # Transposable pruning always loads its lanes strided, and
  # this says how it stores them: each lane with a strided store (True), or
  # a row's lanes interleaved in registers and stored contiguously (False).
  strided_lanes: bool = True

  @classmethod
  def default(cls, k: int, n: int, kind: str, layout: str = "sparse24") -> "PruneConfig":
    """kind: "prune", "prune_transposable", "apply" (compress with a mask) or
    "apply_transposed" (and write the transposed copy). The tiles were the
    fastest of a sweep on an H200; "prune" and "prune_transposable" (also
    the tile of `transposable_mask`) on an H100 (benchmarks/NOTES.md)."""
    del k, n
    if kind == "prune_transposable":  # either layout; rows stored contiguously
      # Still the fastest with the search as a dynamic program, one search
      # per tile (H200, cuSPARSELt layout: 0.653 ms; 64x64/4, 32x128/4,
      # 128x128/8, 32x64/2 0.87-0.90 ms, 64x128/8 1.28 ms, strided stores
      # 1.00 ms); not swept again since prune_compress searches per quadrant.
      return cls(block_k=64, block_n=128, num_warps=4, strided_lanes=False)
    if kind == "prune":  # either layout: strided row lanes, no transpose of the tile
      # (Sparse24 layout on an H100: 0.308 ms at 16384^2 against 0.426 ms
      # for the tile transposed in registers, the best of that way).
      return cls(block_k=64, block_n=128, num_warps=8, strided_lanes=True)
    # Both layouts from the codes transposed by XLA and the row lanes
    # (`_apply_kernel`); `tune_prune.py --layout cusparselt` on an H200,
    # 16384^2, kernel alone (fifteenth session), and a sweep of the Sparse24
    # layout (twentieth session).
    if kind == "apply_transposed":  # row lanes forward, each row's keep decoded in place
      # cuSPARSELt layout: 0.410 ms against 0.424 ms for 64x128, 8 warps
      # (0.53 ms with the codes transposed in the kernel). Sparse24: 0.402
      # ms (64x128/8 0.411, 128x64/8 0.447), where the weight tile
      # transposed in registers took 0.433 ms at 128x64/8.
      return cls(block_k=32, block_n=128, num_warps=4, strided_lanes=True)
    if layout == "cusparselt":
      # Strided row lanes, no transpose: 0.235 ms (the tile transposed in
      # registers, 128x64, 8 warps, the default before: 0.34-0.35 ms on an
      # H100, benchmarks/NOTES.md).
      return cls(block_k=64, block_n=128, num_warps=4, strided_lanes=True)
    # Sparse24, the four value slots transposed: 0.2375 ms (0.2457 ms with
    # the weight tile transposed in registers at 128x64/8).
    return cls(block_k=64, block_n=128, num_warps=8, strided_lanes=True)


_TINY = float(np.finfo(np.float32).tiny)  # subnormal magnitudes score 0
_FLOAT32_MAX = float(np.finfo(np.float32).max)


# --- kernels -----------------------------------------------------------------


def _block_lanes(w_ref, stride: int, row0: int = 0, col0: int = 0) -> list[list[jax.Array]]:
  """lanes[r][c] `[bk/stride, bn/stride]`: element (row0 + r, col0 + c) of
  every `stride x stride` block of the `[bk, bn]` tile, loaded with strided
  loads (the tile is in the cache after the first)."""
  bk, bn = w_ref.shape
  return [[w_ref[pl.ds(row0 + r, bk // stride, stride=stride),
                 pl.ds(col0 + c, bn // stride, stride=stride)]
           for c in range(4)] for r in range(4)]


def _pattern_word(rows: tuple[int, int, int, int]) -> int:
  """A 4x4 pattern (row r keeps the pair `rule.PAIRS[rows[r]]`) as the
  metadata codes it writes: bits `4c..4c+3` hold column c's code (its two
  kept rows i0 < i1 as `i0 | i1 << 2`, the K-compressed copy's nibble), bits
  `16 + 4r..` row r's (`rule.PAIR_CODES`, the N-compressed copy's). The
  search selects these constants, so the outputs need no decoding of the
  pattern (a shift and a mask per nibble)."""
  word = 0
  for r, q in enumerate(rows):
    word |= rule.PAIR_CODES[q] << (16 + 4 * r)
  for c in range(4):
    i0, i1 = (r for r, q in enumerate(rows) if c in rule.PAIRS[q])
    word |= rule.group_code(i0, i1) << (4 * c)
  return word


def _nibble(word: jax.Array, shift: int) -> jax.Array:
  """The int32 nibble at bit `shift` of `_pattern_word` words."""
  return ((word >> shift) & 0xF).astype(jnp.int32)


def _row_bits(r: int, q: int, below) -> int:
  """The bits of `_pattern_word` that row `r` keeping pair `q` sets, given
  the kept counts of each column in rows r+1..3 (`below`): its pair code,
  and for each of its columns the row as that column's i1 (nothing kept
  below) or its i0 (one kept below)."""
  word = rule.PAIR_CODES[q] << (16 + 4 * r)
  for c in rule.PAIRS[q]:
    assert below[c] in (0, 1), (r, q, below)
    word |= r << (4 * c + (2 if below[c] == 0 else 0))
  return word


def _search_tables():
  """`prune_rule`'s plan of `_best_pattern`'s dynamic program (rows 3, 2,
  then 1, then 0) with the pattern word bits each choice sets. LOW[i]: the
  (q2, q3) choices of rows 2-3 with column counts `LOW_COUNTS[i]`, with the
  word bits of rows 2-3; ROW1[q0][q1]: (the index i that rows 2-3 must have,
  word bits of row 1); ROW0[q0]: word bits of row 0."""
  low = [[(q2, q3, _row_bits(3, q3, (0,) * 4) | _row_bits(2, q2, rule.column_counts(q3)))
          for q2, q3 in choices] for choices in rule.LOW_CHOICES]
  row1 = [[(i, _row_bits(1, q1, rule.LOW_COUNTS[i])) for q1, i in enumerate(row)]
          for row in rule.ROW1_LOW]
  row0 = [_row_bits(0, q0, [2 - c for c in rule.column_counts(q0)]) for q0 in range(6)]
  built = 0  # the plan builds each of the 90 patterns once, with its word
  for q0, q1, q2, q3 in itertools.product(range(6), repeat=4):
    i, bits1 = row1[q0][q1]
    match = [b for a2, a3, b in low[i] if (a2, a3) == (q2, q3)]
    if match:
      assert match[0] | bits1 | row0[q0] == _pattern_word((q0, q1, q2, q3))
      built += 1
  assert built == len(rule.TRANSPOSABLE_PATTERNS)
  return low, row1, row0


_LOW, _ROW1, _ROW0 = _search_tables()


def _best_pattern(lanes: list[list[jax.Array]], count_nonfinite: bool,
                  with_total: bool = False):
  """The best 4x4 pattern of every block -> its uint32 `_pattern_word`.

  lanes[r][c]: element (r, c) of every block. The rule and the float32
  arithmetic of jsparse24._prune._prune_transposable: most kept non-finite
  elements, then the per-row sums of kept finite magnitudes added from row
  3 up, ties to the first pattern in lexicographic row-pair order (with
  float32 rounding: the first row 0 pair, then the first row 1 pair, ...
  among those whose remaining rows sum the most). `count_nonfinite=False`
  leaves out the first criterion: exact only for blocks without NaN or inf
  (every count is 0 there), and about half the work. `with_total` (with
  count_nonfinite=False) also returns the float32 sum of each block's
  magnitudes (subnormals flushed), from two of each row's pair sums: not
  finite where the block holds a NaN or inf (or where finite magnitudes
  overflow the sum).

  The search is a dynamic program over the rows, from row 3 up: the best
  rows 2-3 for each of the 19 column counts they can have (36 choices),
  then for each row 0 pair the best row 1 pair with its best rows 2-3
  (36), then the best row 0 pair (6): 78 sums and 52 comparisons, where
  scoring the 90 patterns one by one took 216 sums and 89 comparisons
  (benchmarks/NOTES.md, twentieth session). Each comparison keeps the
  earlier candidate on ties, and every candidate list is in lexicographic
  order, which gives the tie rule above.
  """
  mag = [[None] * 4 for _ in range(4)]
  nonfinite = [[None] * 4 for _ in range(4)]
  for r, c in itertools.product(range(4), range(4)):
    a = jnp.abs(lanes[r][c].astype(jnp.float32))
    if count_nonfinite:
      bad = _nonfinite(a)
      mag[r][c] = jnp.where(bad | (a < _TINY), 0.0, a)
      nonfinite[r][c] = bad.astype(jnp.int32)
    else:  # no NaN or inf here: only the subnormals to flush (2 operations, not 6)
      mag[r][c] = jnp.where(a < _TINY, 0.0, a)
  pair_sum = [[mag[r][i] + mag[r][j] for i, j in rule.PAIRS] for r in range(4)]
  pair_cnt = ([[nonfinite[r][i] + nonfinite[r][j] for i, j in rule.PAIRS] for r in range(4)]
              if count_nonfinite else None)
  shape = pair_sum[0][0].shape

  # A candidate: ((count,) sum, word); a word is a Python int until a
  # comparison has to select it.
  def word_array(w):
    return jnp.full(shape, w, jnp.uint32) if isinstance(w, int) else w

  def merge(a, b):  # the better of two candidates, `a` (the earlier) on ties
    if a is None:
      return b
    if count_nonfinite:
      take_b = (b[0] > a[0]) | ((b[0] == a[0]) & (b[1] > a[1]))
    else:
      take_b = b[1] > a[1]
    word = jnp.where(take_b, word_array(b[2]), word_array(a[2]))
    return (jnp.where(take_b, b[0], a[0]) if count_nonfinite else None,
            jnp.where(take_b, b[1], a[1]), word)

  def extend(r, q, cand, bits):  # row r keeps pair q on top of `cand`
    count = pair_cnt[r][q] + cand[0] if count_nonfinite else None
    return count, pair_sum[r][q] + cand[1], cand[2] | bits

  # Rows 2-3: computed when first needed, dropped after their last use, so
  # that few of the 19 are live at once (the search is register-bound).
  uses = {}
  for q0, q1 in itertools.product(range(6), repeat=2):
    uses[_ROW1[q0][q1][0]] = uses.get(_ROW1[q0][q1][0], 0) + 1
  low = {}

  def rows23(u):
    if u not in low:
      best = None
      for q2, q3, bits in _LOW[u]:
        start = (pair_cnt[3][q3] if count_nonfinite else None, pair_sum[3][q3], 0)
        best = merge(best, extend(2, q2, start, bits))
      low[u] = best
    cand = low[u]
    uses[u] -= 1
    if not uses[u]:
      del low[u]
    return cand

  best = None
  for q0 in range(6):
    best1 = None
    for q1 in range(6):
      u, bits = _ROW1[q0][q1]
      best1 = merge(best1, extend(1, q1, rows23(u), bits))
    best = merge(best, extend(0, q0, best1, _ROW0[q0]))
  word = word_array(best[2])
  if with_total:
    assert not count_nonfinite
    whole = rule.PAIRS.index((0, 1)), rule.PAIRS.index((2, 3))
    block_sum = functools.reduce(jnp.add, [pair_sum[r][q] for r in range(4) for q in whole])
    return word, block_sum
  return word


def _nonfinite(a: jax.Array) -> jax.Array:
  """NaN or +-inf, for magnitudes `a = |x|` or sums of them: one comparison
  (NaN compares false). The search is bound by the integer/logic pipe
  (benchmarks/NOTES.md), so the per-element tests are kept to the fewest
  operations."""
  return jnp.logical_not(a <= _FLOAT32_MAX)


def _best_pattern_of_tile(lanes: list[list[jax.Array]]) -> jax.Array:
  """`_best_pattern`, counting non-finite elements only in tiles that may
  hold one: the search without the counts runs on every tile, and a tile
  whose magnitudes do not sum to a finite float32 (a NaN or inf, or a
  harmless false alarm where huge finite ones overflow) is searched again
  with them (a branch per tile). The sum comes from pair sums the search
  already has, where testing every element for NaN or inf before the
  search took ~3 operations per element (benchmarks/NOTES.md, twentieth
  session)."""
  words, block_sum = _best_pattern(lanes, False, with_total=True)
  suspect = _nonfinite(jnp.sum(block_sum))
  return jax.lax.cond(suspect, lambda: _best_pattern(lanes, True), lambda: words)


def _quadrants(code: jax.Array) -> list[list[jax.Array]]:
  """code `[R, C]` of the tile's 4x4 blocks -> quads[t][b] `[R/2, C/2]`:
  the blocks of even (t=0) / odd (t=1) block rows and even (b=0) / odd
  (b=1) block columns, i.e. of the 8x8 regions' four quadrants."""
  quads = [[None, None], [None, None]]
  for b, half in enumerate(_tiles.split_lanes(code, 2)):  # [R, C/2]
    for t, part in enumerate(_tiles.split_lanes(half.T, 2)):  # [C/2, R/2]
      quads[t][b] = part.T
  return quads


def _prune_transposable_kernel(w_ref, *out_refs, k_major: bool, with_values: bool,
                               strided_stores: bool, store_meta=None):
  """Transposable prune + compress of a `[bk, bn]` tile in one kernel
  (`prune_compress` and the rebuild kernel; `transposable_mask` runs the
  two passes below). Arguments as `_write_transposable`'s.

  With values (`prune_compress`), the search without the non-finite counts
  runs on each of the four quadrants of the tile's 8x8 regions, from the
  lanes that the outputs are written from, so its pattern words need no
  transposes; a tile whose magnitudes do not sum to a finite float32 is
  searched again whole with the counts (a branch, as
  `_best_pattern_of_tile`). At 16384^2 bf16 on an H200 that took 0.516 ms
  against 0.629 ms for one search of the tile (its words split into the
  quadrants by register transposes), and 26 s to compile against 11 s
  (benchmarks/NOTES.md, twentieth session). The mask alone (the rebuild
  kernel, compiled into every training step, which rebuilds once in many
  steps) keeps the one search."""
  if not with_values:
    _write_transposable(w_ref, _quadrants(_best_pattern_of_tile(_block_lanes(w_ref, 4))),
                        out_refs, k_major=k_major, with_values=False,
                        strided_stores=strided_stores, store_meta=store_meta)
    return
  lanes = [[_block_lanes(w_ref, 8, 4 * t, 4 * b) for b in range(2)] for t in range(2)]
  found = [[_best_pattern(lanes[t][b], False, with_total=True) for b in range(2)]
           for t in range(2)]
  region_sum = functools.reduce(jnp.add, [found[t][b][1] for t in range(2) for b in range(2)])
  suspect = _nonfinite(jnp.sum(region_sum))
  quads = jax.lax.cond(suspect, lambda: _quadrants(_best_pattern(_block_lanes(w_ref, 4), True)),
                       lambda: [[found[t][b][0] for b in range(2)] for t in range(2)])
  _write_transposable(w_ref, quads, out_refs, k_major=k_major, with_values=True,
                      strided_stores=strided_stores, store_meta=store_meta, lanes=lanes)


def _transposable_common_pass(w_ref, *refs, **kw):
  """Pass 1 of transposable pruning, every tile: the search without the
  non-finite counts (`_best_pattern(lanes, False)`, exact where the tile
  holds no NaN or inf) and the outputs written from it, and in the first
  entry of the program's `suspect_ref` block 1 where the tile's magnitudes
  do not sum to a finite float32 (a NaN or inf, or a harmless false alarm
  where huge finite ones overflow), else 0."""
  *out_refs, suspect_ref = refs
  words, block_sum = _best_pattern(_block_lanes(w_ref, 4), False, with_total=True)
  suspect = _nonfinite(jnp.sum(block_sum)).astype(jnp.int32)
  first = jax.lax.broadcasted_iota(jnp.int32, suspect_ref.shape, 1) == 0
  suspect_ref[...] = jnp.where(first, suspect, 0)
  _write_transposable(w_ref, _quadrants(words), out_refs, **kw)


def _transposable_exact_pass(w_ref, suspect_ref, *refs, **kw):
  """Pass 2, the outputs of pass 1 aliased in and out: a program whose tile
  pass 1 flagged writes its outputs again from the exact search (non-finite
  counts first); every other program returns at once."""
  out_refs = refs[len(refs) // 2:]  # the aliased inputs come first

  @pl.when(jnp.max(suspect_ref[...]) != 0)
  def _():
    _write_transposable(w_ref, _quadrants(_best_pattern(_block_lanes(w_ref, 4), True)), out_refs,
                        **kw)


def _write_transposable(w_ref, quads: list[list[jax.Array]], out_refs, *, k_major: bool,
                        with_values: bool, strided_stores: bool, store_meta=None,
                        lanes=None):
  """Writes transposable pruning's outputs for a `[bk, bn]` tile (bk, bn
  multiples of 8) whose 4x4 blocks chose the patterns `quads` (`_pattern_word`s,
  as `_quadrants` splits them: quads[t][b] `[bk/8, bn/8]`): both compressed
  copies and both metadata, from the lanes of the four quadrants of the
  tile's 8x8 regions (`lanes[t][b]`, `_block_lanes(w_ref, 8, 4t, 4b)`;
  loaded here if not given), so that every output row is made of whole lanes:
  `strided_stores` stores each lane with a strided store, else the lanes
  of a row are interleaved in registers (`join_lanes`) and stored
  contiguously.

  out_refs: with_values: values, meta, values_t, meta_t (see `_outputs`);
  else meta only (the mask). `store_meta(rows, tile)`, if given, stores the
  mask's rows `rows` of meta (int32 bytes `[bn/8, bk/8]`) instead."""
  if with_values:
    values_ref, meta_ref, values_t_ref, meta_t_ref = out_refs
  else:
    (meta_ref,) = out_refs
  bk, bn = w_ref.shape
  rows8, cols8 = bk // 8, bn // 8
  if with_values and lanes is None:
    lanes = [[_block_lanes(w_ref, 8, 4 * t, 4 * b) for b in range(2)] for t in range(2)]

  if with_values:  # the N-compressed copy: row r keeps its pair's columns
    for t, r in itertools.product(range(2), range(4)):
      slots, nibbles = [], []
      for b in range(2):
        nibble = _nibble(quads[t][b], 16 + 4 * r)
        slots += _tiles.pick_pair(lanes[t][b][r], *rule.code_indices(nibble))
        nibbles.append(nibble)
      rows = pl.ds(4 * t + r, rows8, stride=8)
      if strided_stores:
        for l, slot in enumerate(slots):  # slot l = 2b + s: column 4j + l
          values_t_ref[rows, pl.ds(l, cols8, stride=4)] = slot
      else:
        values_t_ref[rows, :] = _tiles.join_lanes(slots)
      meta_t_ref[rows, :] = rule.byte_of(nibbles[0], nibbles[1]).astype(jnp.uint8)

  # The K-compressed copy: column c keeps the rows whose pair holds c.
  k_slots = [[None] * 8 for _ in range(4)]  # [2t + s][4b + c] (k_major, joined)
  for b, c in itertools.product(range(2), range(4)):
    slots, nibbles = [], []
    for t in range(2):
      nibble = _nibble(quads[t][b], 4 * c)
      nibbles.append(nibble)
      if with_values:
        col = [lanes[t][b][r][c] for r in range(4)]
        slots += _tiles.pick_pair(col, *rule.code_indices(nibble))  # slot l = 2t + s
    cols = pl.ds(4 * b + c, cols8, stride=8)
    meta_tile = rule.byte_of(nibbles[0], nibbles[1]).T
    if store_meta is None:
      meta_ref[cols, :] = meta_tile.astype(jnp.uint8)
    else:
      store_meta(cols, meta_tile)
    if not with_values:
      continue
    for l, slot in enumerate(slots):  # row 4i + l of the K-compressed values
      if k_major and strided_stores:
        values_ref[pl.ds(l, rows8, stride=4), cols] = slot
      elif k_major:
        k_slots[l][4 * b + c] = slot
      elif strided_stores:
        values_ref[cols, pl.ds(l, rows8, stride=4)] = slot.T
    if not k_major and not strided_stores:
      values_ref[cols, :] = _tiles.join_lanes([slot.T for slot in slots])
  if with_values and k_major and not strided_stores:
    for l in range(4):
      values_ref[pl.ds(l, rows8, stride=4), :] = _tiles.join_lanes(k_slots[l])


def _row_lanes(w_ref) -> list[jax.Array]:
  """The 8 row lanes `[bk/8, bn]` of a `[bk, bn]` tile (lane l = rows l,
  l+8, ...), loaded with strided loads: groups of 4 along K are lanes 0-3
  and 4-7, and every load is contiguous along N."""
  bk = w_ref.shape[0]
  return [w_ref[pl.ds(l, bk // 8, stride=8), :] for l in range(8)]


def store_k_major(values_ref, slots: list[jax.Array]) -> None:
  """Stores 4 value slots `[bk/8, bn]` (from `compress_lanes` on row lanes)
  as the K-compressed `[bk/2, bn]` tile: row 4r + s is slot s's row r."""
  rows = values_ref.shape[0] // 4
  for s, slot in enumerate(slots):
    values_ref[pl.ds(s, rows, stride=4), :] = slot


def _store_slots(values_ref, slots: list[jax.Array], k_major: bool) -> None:
  """Stores 4 value slots `[bk/8, bn]` of row lanes in either layout:
  cuSPARSELt's (`store_k_major`), or Sparse24's values `[bn, bk/2]`, whose
  column 4r + s is slot s's row r (the slots transposed and joined)."""
  if k_major:
    store_k_major(values_ref, slots)
  else:
    values_ref[...] = _tiles.join_lanes([slot.T for slot in slots])


def _prune_kernel(w_ref, values_ref, meta_ref, *, strided_lanes: bool, k_major: bool):
  if strided_lanes:  # row lanes by strided loads: compressed along K with no transpose
    slots, meta = _tiles.compress_lanes(_row_lanes(w_ref), None)  # meta [bk/8, bn]
    _store_slots(values_ref, slots, k_major)
    meta_ref[...] = meta.astype(jnp.int32).T.astype(jnp.uint8)
    return
  values, meta = _tiles.compress_rows(w_ref[...].T, None)
  values_ref[...] = values.T if k_major else values
  meta_ref[...] = meta


def _apply_kernel(w_ref, meta_in_ref, values_ref, *rest, transposed: bool,
                  k_major: bool, strided_lanes: bool):
  if strided_lanes:
    # The codes arrive transposed (`[bk/8, bn]`, by XLA before the call):
    # transposed here, the code tile went through shared memory, and the
    # transposable kernel with its metadata passes took 0.533 ms at 16384^2
    # on an H200 against 0.447 ms with XLA's transpose (benchmarks/NOTES.md,
    # fifteenth session). The K-compressed copy comes from the row lanes, as
    # plain pruning's does: in the cuSPARSELt layout nothing transposes a
    # tile; in the Sparse24 layout only its four value slots are transposed
    # (`_prune_kernel`), not the whole weight tile.
    meta_kn = meta_in_ref[...].astype(jnp.int32)
    keep_kn = _tiles.keep_from_meta(meta_kn)  # 8 x [bk/8, bn]
    slots, _ = _tiles.compress_lanes(_row_lanes(w_ref), keep_kn)
    _store_slots(values_ref, slots, k_major)
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


# --- wrappers ----------------------------------------------------------------


def _check_weight(fn: str, w: jax.Array, need_n4: bool) -> None:
  if w.ndim != 2:
    raise ValueError(f"{fn}: `w` must be 2-D [K, N], got shape {w.shape}.")
  if w.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
    raise TypeError(f"{fn}: `w` must be bfloat16, float16 or float32, got {w.dtype}.")
  if w.shape[0] % 4:
    raise ValueError(f"{fn}: K = w.shape[0] = {w.shape[0]} is not a multiple of 4.")
  if need_n4 and w.shape[1] % 4:
    raise ValueError(
        f"{fn}: N = w.shape[1] = {w.shape[1]} is not a multiple of 4, needed for"
        f" a transposable mask / transposed copy.")


LAYOUTS = ("sparse24", "cusparselt")  # layout="cusparselt": K, N multiples of CUSPARSELT_ALIGN


def _check_layout(fn: str, w: jax.Array, layout: str) -> bool:
  """Checks `layout` against `w`; True for layout="cusparselt"."""
  if layout not in LAYOUTS:
    raise ValueError(f"{fn}: layout must be one of {LAYOUTS}, got {layout!r}.")
  if layout == "sparse24":
    return False
  if w.dtype not in (jnp.bfloat16, jnp.float16):
    raise TypeError(f"{fn}: layout='cusparselt' takes bfloat16 or float16 weights"
                    f" (cuSPARSELt's 2:4 formats), got {w.dtype}.")
  k, n = w.shape
  if k % CUSPARSELT_ALIGN or n % CUSPARSELT_ALIGN:
    raise ValueError(f"{fn}: layout='cusparselt' needs K and N multiples of"
                     f" {CUSPARSELT_ALIGN}, got w of shape {w.shape}.")
  return True


def _padded(w: jax.Array, bk: int, bn: int) -> jax.Array:
  """Zero-pads to whole tiles. Zero groups compress to code 0x4 (indices 0, 1),
  which is exactly the format's padding code, so slicing the outputs back
  gives the unpadded answer."""
  k, n = w.shape
  pk, pn = -k % bk, -n % bn
  return jnp.pad(w, ((0, pk), (0, pn))) if pk or pn else w


def _with_pad_code(meta: jax.Array, length: int) -> jax.Array:
  """Sets the padding nibble (when `length / 4` groups is odd) to the format's
  padding code 0x4; tiles padded with zeros may hold another valid code."""
  if (length // 4) % 2 == 0:
    return meta
  return meta.at[:, -1].set(rule.byte_of(meta[:, -1] & 0xF, rule.PAD_CODE))


def _outputs(wp: jax.Array, cfg: PruneConfig, *, meta: bool, transposed: bool,
             k_major: bool = False):
  """Output shapes and block specs on the padded `wp[Kp, Np]` (grid (i over
  K tiles, j over N tiles)): values `[Np, Kp/2]`, then meta `[Np, Kp/8]` if
  `meta`, then values_t `[Kp, Np/2]` and meta_t `[Kp, Np/8]` if `transposed`.
  With `k_major` (layout="cusparselt"): values `[Kp/2 + Kp/16, Np]` and
  values_t `[Kp + Kp/8, Np/2]`, the values in their leading rows."""
  kp, np_ = wp.shape
  bk, bn = cfg.block_k, cfg.block_n
  if k_major:
    shapes = [jax.ShapeDtypeStruct((kp // 2 + kp // 16, np_), wp.dtype)]
    specs = [pl.BlockSpec((bk // 2, bn), lambda i, j: (i, j))]
  else:
    shapes = [jax.ShapeDtypeStruct((np_, kp // 2), wp.dtype)]
    specs = [pl.BlockSpec((bn, bk // 2), lambda i, j: (j, i))]
  if meta:
    shapes.append(jax.ShapeDtypeStruct((np_, kp // 8), jnp.uint8))
    specs.append(pl.BlockSpec((bn, bk // 8), lambda i, j: (j, i)))
  if transposed:
    shapes += [jax.ShapeDtypeStruct((kp + (kp // 8 if k_major else 0), np_ // 2), wp.dtype),
               jax.ShapeDtypeStruct((kp, np_ // 8), jnp.uint8)]
    specs += [pl.BlockSpec((bk, bn // 2), lambda i, j: (i, j)),
              pl.BlockSpec((bk, bn // 8), lambda i, j: (i, j))]
  return shapes, specs


def fit_config(config: PruneConfig, k: int, n: int, exact: bool = False) -> PruneConfig:
  """Shrinks tiles for small inputs (never below 8: a byte packs 2 groups).
  With `exact`, tiles also divide K and N (no padding: layout="cusparselt",
  whose outputs are used whole)."""
  if exact:
    bk = min(config.block_k, k & -k)
    bn = min(config.block_n, n & -n)
  else:
    bk = min(config.block_k, max(8, pl.next_power_of_2(k)))
    bn = min(config.block_n, max(8, pl.next_power_of_2(n)))
  return dataclasses.replace(config, block_k=bk, block_n=bn)


@functools.partial(jax.jit, static_argnames=("transposable", "config", "interpret", "layout"))
def prune_compress(w: jax.Array, *, transposable: bool = False,
                   config: PruneConfig | None = None, interpret: bool = False,
                   layout: str = "sparse24"):
  """Prunes `w[K, N]` by magnitude (2:4 along K) and compresses, in one pass.

  Returns `(values [N, K/2], meta uint8[N, ceil(K/8)], values_t, meta_t)`;
  the last two are `[K, N/2]`, `uint8[K, ceil(N/8)]` with
  `transposable=True`, else None. With layout="cusparselt" (bfloat16/float16,
  K and N multiples of 64) `values` is `[K/2 + K/16, N]`: the values
  `[K/2, N]` in its first K/2 rows, and `values_t` `[K + K/8, N/2]`, the
  values in its first K rows; the rest unwritten (see the module
  docstring).
  """
  fn = "prune_compress"
  _check_weight(fn, w, transposable)
  k_major = _check_layout(fn, w, layout)
  k, n = w.shape
  cfg = fit_config(config or PruneConfig.default(
      k, n, "prune_transposable" if transposable else "prune", layout), k, n, exact=k_major)
  bk, bn = cfg.block_k, cfg.block_n
  wp = _padded(w, bk, bn)
  kp, np_ = wp.shape
  out_shape, out_specs = _outputs(wp, cfg, meta=True, transposed=transposable,
                                  k_major=k_major)
  if transposable:
    # One kernel choosing the search per tile, not `_transposable_passes`:
    # with every output written by both passes that took 37.5 s to compile
    # against 17.8 s, for 0.07 ms (8%) at 16384^2 on an H100
    # (benchmarks/NOTES.md, twelfth session).
    kernel = functools.partial(_prune_transposable_kernel, k_major=k_major, with_values=True,
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
  meta = _with_pad_code(outs[1][:n, :math.ceil(k / 8)], k)
  if not transposable:
    return values, meta, None, None
  return values, meta, outs[2][:k, :n // 2], _with_pad_code(outs[3][:k, :math.ceil(n / 8)], n)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def transposable_mask(w: jax.Array, *, config: PruneConfig | None = None,
                      interpret: bool = False) -> jax.Array:
  """The transposable 2:4 mask of `w[K, N]` (the exact best of the 90 4x4
  patterns per block, as `prune_compress(transposable=True)` chooses it), as
  packed metadata `uint8[N, ceil(K/8)]` only: one read of `w` in its own
  dtype (float32 master weights included), no values written; a second
  kernel reads again only the tiles that may hold a NaN or inf
  (`_transposable_passes`)."""
  fn = "transposable_mask"
  _check_weight(fn, w, True)
  k, n = w.shape
  cfg = fit_config(config or PruneConfig.default(k, n, "prune_transposable"), k, n)
  bk, bn = cfg.block_k, cfg.block_n
  wp = _padded(w, bk, bn)
  kp, np_ = wp.shape
  (meta,) = _transposable_passes(
      wp, cfg, [jax.ShapeDtypeStruct((np_, kp // 8), jnp.uint8)],
      [pl.BlockSpec((bn, bk // 8), lambda i, j: (j, i))], interpret=interpret,
      name="jsparse24_transposable_mask", k_major=False, with_values=False,
      strided_stores=True)
  return _with_pad_code(meta[:n, :math.ceil(k / 8)], k)


def _transposable_passes(wp: jax.Array, cfg: PruneConfig, out_shape, out_specs, *,
                         interpret: bool, name: str, **kw) -> list[jax.Array]:
  """Transposable pruning of the padded `wp` in two kernels: every tile
  searched without the non-finite counts (`_transposable_common_pass`),
  then only the tiles that may hold a NaN or inf searched again exactly,
  into the same buffers (`_transposable_exact_pass`). For the mask alone
  at 16384^2 on an H100 that took 0.525 ms against 0.620 for one kernel
  choosing per tile (`lax.cond`, as `_prune_transposable_kernel`), and
  9-10 s to compile (benchmarks/NOTES.md, twelfth session)."""
  kp, np_ = wp.shape
  bk, bn = cfg.block_k, cfg.block_n
  grid = (kp // bk, np_ // bn)
  w_spec = pl.BlockSpec((bk, bn), lambda i, j: (i, j))
  # One int32 flag per program (the first of a block of bn/8).
  flag_shape = jax.ShapeDtypeStruct((grid[0], np_ // 8), jnp.int32)
  flag_spec = pl.BlockSpec((1, bn // 8), lambda i, j: (i, j))
  params = pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
  *outs, suspect = pl.pallas_call(
      functools.partial(_transposable_common_pass, **kw),
      out_shape=[*out_shape, flag_shape], grid=grid, in_specs=[w_spec],
      out_specs=[*out_specs, flag_spec], compiler_params=params, interpret=interpret,
      name=name,
  )(wp)
  n = len(outs)
  # Pass 2's programs nearly all return at once, so what it costs is how
  # many are resident: its exact search takes ~255 registers per thread,
  # and fewer warps per program let more programs fit. For the mask at
  # 16384^2 on an H100: 0.562 ms in all at 4 warps, 0.525 at 2, 0.503 at
  # 1, whose compile (register spills) took 24-29 s against 9-10 s at 2
  # and 4-5 at 4 (benchmarks/NOTES.md, twelfth session).
  exact_params = pltriton.CompilerParams(num_warps=min(cfg.num_warps, 2),
                                         num_stages=cfg.num_stages)
  return pl.pallas_call(
      functools.partial(_transposable_exact_pass, **kw),
      out_shape=out_shape, grid=grid, in_specs=[w_spec, flag_spec, *out_specs],
      out_specs=out_specs, input_output_aliases={2 + i: i for i in range(n)},
      compiler_params=exact_params, interpret=interpret, name=name + "_exact",
  )(wp, suspect, *outs)


def _plain_mask_kernel(w_ref, meta_ref, store_meta=None):
  """The plain 2:4 mask (largest 2 magnitudes of each group of 4 along K)
  of a `[bk, bn]` tile, packed metadata only (`meta_ref` `[bn, bk/8]`;
  `store_meta` as for `_prune_transposable_kernel`)."""
  _, meta = _tiles.compress_lanes(_row_lanes(w_ref), None)  # [bk/8, bn]; no values stored
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
    _prune_transposable_kernel(w_ref, meta_ref, k_major=False, with_values=False,
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
  with one tile per program each program copied rows of 8 bytes
  (`[bn, block_k/8]` of the `[N, K/8]` mask), and the calls of a d_model
  4096 x 8 model took 1.0 ms of its step on an H200 (benchmarks/NOTES.md,
  sixteenth session); 8 tiles along K make the rows 64 bytes."""
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
  `transposable_mask`; else the plain one, as `prune_compress` chooses it)
  where `rebuild` is non-zero, else `old` as it is, with no conditional
  around the call: on a GPU an XLA conditional copies its predicate to the
  host and waits for it, which stalls the launch queue once per step. Every
  program reads its flags; an unflagged one copies its block of `old` and
  does nothing else (w is not read).

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
  _check_weight(fn, w, transposable)
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
  wp = _padded(w, bk, bn)
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
  return _with_pad_code(meta[:n, :math.ceil(k / 8)], k), flips[:, :math.ceil(n / 8)]


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
  leading rows, the rest unwritten (see the module docstring).
  """
  fn = "compress_with_meta"
  _check_weight(fn, w, transposed)
  k_major = _check_layout(fn, w, layout)
  k, n = w.shape
  if meta.shape != (n, math.ceil(k / 8)) or meta.dtype != jnp.uint8:
    raise ValueError(
        f"{fn}: `meta` must be uint8[{n}, {math.ceil(k / 8)}] for w of shape"
        f" {w.shape}, got {meta.dtype}{list(meta.shape)}.")
  cfg = fit_config(config or PruneConfig.default(
      k, n, "apply_transposed" if transposed else "apply", layout), k, n, exact=k_major)
  bk, bn = cfg.block_k, cfg.block_n
  wp = _padded(w, bk, bn)
  kp, np_ = wp.shape
  # Padding groups get the padding code 0x4 (indices 0, 1) on zero weights.
  mp = jnp.pad(meta, ((0, np_ - n), (0, kp // 8 - meta.shape[1])),
               constant_values=rule.PAD_BYTE)
  out_shape, out_specs = _outputs(wp, cfg, meta=False, transposed=transposed,
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
  return values, outs[1][:k, :n // 2], _with_pad_code(outs[2][:k, :math.ceil(n / 8)], n)


# --- cuSPARSELt's metadata, written into the compressed buffer in place -------
#
# The word arithmetic of a 64-row x 8-group block and its plain-`jnp`
# reference are in `cusparselt_layout` (used without Pallas too).


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
