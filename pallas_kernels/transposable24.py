"""The transposable 2:4 search on a tile, and the kernels built on it.

The exact best of the 90 4x4 patterns with 2 kept per row and per column
(`jsparse24._prune`'s rule, `prune_rule`'s plan) for every 4x4 block of a
tile, as a dynamic program over the rows (`_best_pattern`), and the writing
of its outputs: both compressed copies and both metadata
(`prune_transposable_tile`, the kernel of
`prune24.prune_compress(transposable=True)` and of the mask rebuilds), or
the packed mask alone (`transposable_mask`, in two passes).
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _tiles
from pallas_kernels import prune_rule as rule
from pallas_kernels._compress_io import check_weight, padded, with_pad_code
from pallas_kernels.prune_config import PruneConfig, fit_config


_TINY = float(np.finfo(np.float32).tiny)  # subnormal magnitudes score 0


_FLOAT32_MAX = float(np.finfo(np.float32).max)


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
  scoring the 90 patterns one by one takes 216 sums and 89 comparisons
  (docs/design_notes.md, "The pruning kernels are bound by integer
  operations"). Each comparison keeps the
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
  (NaN compares false). The search is bound by the integer/logic pipe, so
  the per-element tests are kept to the fewest operations."""
  return jnp.logical_not(a <= _FLOAT32_MAX)


def _best_pattern_of_tile(lanes: list[list[jax.Array]]) -> jax.Array:
  """`_best_pattern`, counting non-finite elements only in tiles that may
  hold one: the search without the counts runs on every tile, and a tile
  whose magnitudes do not sum to a finite float32 (a NaN or inf, or a
  harmless false alarm where huge finite ones overflow) is searched again
  with them (a branch per tile). The sum comes from pair sums the search
  already has, where testing every element for NaN or inf before the
  search would take ~3 operations per element."""
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


def prune_transposable_tile(w_ref, *out_refs, k_major: bool, with_values: bool,
                            strided_stores: bool, store_meta=None):
  """Transposable prune + compress of a `[bk, bn]` tile in one kernel
  (`prune_compress` and the rebuild kernel; `transposable_mask` runs the
  two passes below). Arguments as `_write_transposable`'s.

  With values (`prune_compress`), the search without the non-finite counts
  runs on each of the four quadrants of the tile's 8x8 regions, from the
  lanes that the outputs are written from, so its pattern words need no
  transposes; a tile whose magnitudes do not sum to a finite float32 is
  searched again whole with the counts (a branch, as
  `_best_pattern_of_tile`): faster than one search of the tile (whose
  words would be split into the quadrants by register transposes), for
  more than twice the compile time (docs/design_notes.md, "The pruning
  kernels are bound by integer operations"). The mask alone (the rebuild
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

  out_refs: with_values: values, meta, values_t, meta_t (see `outputs`);
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
  check_weight(fn, w, True)
  k, n = w.shape
  cfg = fit_config(config or PruneConfig.default(k, n, "prune_transposable"), k, n)
  bk, bn = cfg.block_k, cfg.block_n
  wp = padded(w, bk, bn)
  kp, np_ = wp.shape
  (meta,) = _transposable_passes(
      wp, cfg, [jax.ShapeDtypeStruct((np_, kp // 8), jnp.uint8)],
      [pl.BlockSpec((bn, bk // 8), lambda i, j: (j, i))], interpret=interpret,
      name="jsparse24_transposable_mask", k_major=False, with_values=False,
      strided_stores=True)
  return with_pad_code(meta[:n, :math.ceil(k / 8)], k)


def _transposable_passes(wp: jax.Array, cfg: PruneConfig, out_shape, out_specs, *,
                         interpret: bool, name: str, **kw) -> list[jax.Array]:
  """Transposable pruning of the padded `wp` in two kernels: every tile
  searched without the non-finite counts (`_transposable_common_pass`),
  then only the tiles that may hold a NaN or inf searched again exactly,
  into the same buffers (`_transposable_exact_pass`): faster than one
  kernel choosing per tile (`lax.cond`, as `prune_transposable_tile`)
  (docs/design_notes.md, "The transposable mask alone runs in two
  passes")."""
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
  # and fewer warps per program let more programs fit: 2, since 1 spills
  # registers and compiles three times longer (docs/design_notes.md, "The
  # transposable mask alone runs in two passes").
  exact_params = pltriton.CompilerParams(num_warps=min(cfg.num_warps, 2),
                                         num_stages=cfg.num_stages)
  return pl.pallas_call(
      functools.partial(_transposable_exact_pass, **kw),
      out_shape=out_shape, grid=grid, in_specs=[w_spec, flag_spec, *out_specs],
      out_specs=out_specs, input_output_aliases={2 + i: i for i in range(n)},
      compiler_params=exact_params, interpret=interpret, name=name + "_exact",
  )(wp, suspect, *outs)
