"""The 2:4 pruning rule's tables and bit codes, in plain Python and `jnp`.

One definition for jsparse24's reference (`jsparse24._prune`,
`jsparse24._format`, which apply it to whole arrays) and for the Pallas
kernels (which apply it to registers): the same inputs give the same bits on
both. No Pallas import here: jsparse24's reference and the XLA code that
replaces the kernels where Pallas's Triton lowering cannot run import this
module too.

* The codes. A group of 4 that keeps indices `i0 < i1` has the 4-bit code
  `i0 | i1 << 2` (`group_code`; NVIDIA's sparse tensor-core convention:
  two 2-bit indices, the first in the low bits); two groups share a byte,
  the lower group in the low nibble (`byte_of`). `PAD_CODE` (indices 0 and
  1) fills a padding nibble, so that decoders need no special case.
* `PAIRS`: the 6 ways to keep 2 of 4, in lexicographic order, and their
  codes (`PAIR_CODES`).
* The plain rule: `magnitude_key` orders elements by `|w|` (NaN above inf,
  all NaNs equal, -0.0 equal to +0.0) and `keep_two_of_four` keeps the two
  largest of 4, ties to the lower index.
* The transposable rule: `TRANSPOSABLE_PATTERNS`, the 90 4x4 patterns with 2
  kept per row and per column (as row-pair indices, in lexicographic
  order), and the plan of the search over them as a dynamic program over
  the rows from the last up: `LOW_COUNTS`, the 19 column counts that rows
  2-3 can keep together, `LOW_CHOICES`, their (q2, q3) pair choices in
  lexicographic order, and `ROW1_LOW[q0][q1]`, the count that rows 2-3 must
  then keep (an index of `LOW_COUNTS`). The rule itself (what ties go
  where) is in `jsparse24._prune`'s docstring.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp

# --- the codes -----------------------------------------------------------------

PAIRS: tuple[tuple[int, int], ...] = tuple(itertools.combinations(range(4), 2))
PAD_CODE = 0x4  # indices (0, 1): a valid code, for the padding nibble
PAD_BYTE = PAD_CODE | PAD_CODE << 4  # two padding groups (zero weights padded to whole tiles)


def group_code(i0, i1):
  """The 4-bit code of a group keeping indices `i0 < i1` (ints or arrays)."""
  return i0 | (i1 << 2)


def code_indices(code):
  """`(i0, i1)` of 4-bit codes (the inverse of `group_code`; integer arrays
  holding nothing above the code's 4 bits, as `byte_codes` returns them)."""
  return code & 3, code >> 2


def byte_of(low, high):
  """The byte of two groups' codes, the lower group in the low nibble."""
  return low | (high << 4)


def byte_codes(byte):
  """`(low, high)`: the two codes of bytes of packed codes (int arrays)."""
  return byte & 0xF, byte >> 4


def kept_bits(byte):
  """The kept positions of a byte's 8 weights (two groups of 4) as 8 bits,
  the low group's in bits 0-3 (int arrays of codes below 256)."""
  return ((1 << (byte & 3)) | (1 << ((byte >> 2) & 3))
          | (16 << ((byte >> 4) & 3)) | (16 << ((byte >> 6) & 3)))


PAIR_CODES: tuple[int, ...] = tuple(group_code(a, b) for a, b in PAIRS)


def column_counts(q: int) -> tuple[int, int, int, int]:
  """Which of the 4 columns pair `q` keeps (0 or 1 each)."""
  return tuple(int(c in PAIRS[q]) for c in range(4))


# --- the plain rule ---------------------------------------------------------------


def magnitude_key(w: jax.Array) -> jax.Array:
  """An integer key whose order is the ranking order of `|w|`: the IEEE bits
  of `|w|`, which grow with the value, NaNs (above +inf) all mapped to the
  largest key so that they tie. int32 for 16- and 32-bit floats (the
  kernels' registers), int64 for float64."""
  bits = 8 * jnp.dtype(w.dtype).itemsize
  itype = {16: jnp.int16, 32: jnp.int32, 64: jnp.int64}[bits]
  top = (1 << (bits - 1)) - 1
  key = jax.lax.bitcast_convert_type(w, itype).astype(jnp.int64 if bits == 64 else jnp.int32)
  return jnp.where(w != w, top, key & top)


def keep_two_of_four(keys: list[jax.Array]) -> list[jax.Array]:
  """Exactly 2 True of 4 lanes of keys: the largest, ties to the lower lane.

  Lane i is beaten by lane j when key_j > key_i, or key_j == key_i and j < i;
  for j < i that is `key_j >= key_i`, so 6 comparisons decide all 12 pairs.
  """
  ge = {(j, i): keys[j] >= keys[i] for i in range(4) for j in range(i)}
  keep = []
  for i in range(4):
    beaten = [ge[(j, i)] for j in range(i)] + [~ge[(i, j)] for j in range(i + 1, 4)]
    count = functools.reduce(jnp.add, [b.astype(jnp.int32) for b in beaten])
    keep.append(count < 2)
  return keep


# --- the transposable rule ------------------------------------------------------------


def _transposable_patterns() -> tuple[tuple[int, int, int, int], ...]:
  out = []
  for rows in itertools.product(range(len(PAIRS)), repeat=4):
    if all(sum(column_counts(q)[c] for q in rows) == 2 for c in range(4)):
      out.append(rows)
  return tuple(out)


TRANSPOSABLE_PATTERNS = _transposable_patterns()


def _search_plan():
  choices: dict[tuple[int, ...], list[tuple[int, int]]] = {}
  for q2, q3 in itertools.product(range(6), repeat=2):
    u = tuple(a + b for a, b in zip(column_counts(q2), column_counts(q3)))
    choices.setdefault(u, []).append((q2, q3))
  counts = tuple(choices)
  # Rows 0-1 keep at most 2 per column, so rows 2-3 always have a count left.
  row1 = tuple(tuple(counts.index(tuple(2 - a - b for a, b in zip(column_counts(q0),
                                                                   column_counts(q1))))
                     for q1 in range(6)) for q0 in range(6))
  return counts, tuple(tuple(choices[u]) for u in counts), row1


LOW_COUNTS, LOW_CHOICES, ROW1_LOW = _search_plan()
assert len(TRANSPOSABLE_PATTERNS) == 90
assert len(LOW_COUNTS) == 19 and sum(len(c) for c in LOW_CHOICES) == 36
