"""In-kernel tile helpers shared by the 2:4 kernels (Triton lowering).

Everything here works on values already loaded into registers, with the
contraction axis last. Pallas's Triton lowering supports 2-way `jnp.stack`
(`tt.join`), power-of-two `jnp.split` (`tt.split`) and `reshape`, so lanes are
separated and merged with those: lane `l` of a `[R, C]` tile split into `n`
lanes is the `[R, C/n]` tile of columns `l, l+n, l+2n, ...`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import prune_rule as rule


def split_lanes(t: jax.Array, n: int) -> list[jax.Array]:
  """`[R, C]` -> n lanes `[R, C/n]` (lane l = columns l, l+n, ...)."""
  if n == 1:
    return [t]
  rows, cols = t.shape
  pair = t.reshape(rows, cols // 2, 2)
  even, odd = jnp.split(pair, 2, axis=-1)
  even, odd = even.reshape(rows, cols // 2), odd.reshape(rows, cols // 2)
  # Lanes of the even half are 0, 2, 4, ...; of the odd half 1, 3, 5, ...
  ev, od = split_lanes(even, n // 2), split_lanes(odd, n // 2)
  return [x for pair_ in zip(ev, od) for x in pair_]


def join_lanes(lanes: list[jax.Array]) -> jax.Array:
  """Inverse of `split_lanes`: n lanes `[R, C]` -> `[R, n*C]`."""
  if len(lanes) == 1:
    return lanes[0]
  even, odd = join_lanes(lanes[0::2]), join_lanes(lanes[1::2])
  rows, cols = even.shape
  return jnp.stack([even, odd], axis=-1).reshape(rows, 2 * cols)


def first_last(keep: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
  """(i0, i1) int32: the first and last kept lane of 4 (exactly 2 kept)."""
  i0 = jnp.where(keep[0], 0, jnp.where(keep[1], 1, 2)).astype(jnp.int32)
  i1 = jnp.where(keep[3], 3, jnp.where(keep[2], 2, 1)).astype(jnp.int32)
  return i0, i1


def pick(lanes: list[jax.Array], idx: jax.Array) -> jax.Array:
  out = lanes[3]
  for l in (2, 1, 0):
    out = jnp.where(idx == l, lanes[l], out)
  return out


def pick_pair(lanes: list[jax.Array], i0: jax.Array, i1: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(lanes[i0], lanes[i1]) for the kept pair i0 < i1 of 4 lanes: i0 is one
  of 0-2 and i1 one of 1-3, so each takes two selects (`pick`: three)."""
  first = jnp.where(i0 == 0, lanes[0], jnp.where(i0 == 1, lanes[1], lanes[2]))
  second = jnp.where(i1 == 3, lanes[3], jnp.where(i1 == 2, lanes[2], lanes[1]))
  return first, second


def compress_lanes(lanes: list[jax.Array], keep: list[jax.Array] | None):
  """Compresses 8 lanes (two groups of 4: lanes 0-3, then 4-7), any tile shape.

  `keep`: 8 bool lanes of the same shape, or None to prune by magnitude.
  Returns (4 value slots: first and second kept of group 0, then of group 1;
  meta uint8 = code0 | code1 << 4).
  """
  if keep is None:
    keys = [rule.magnitude_key(x) for x in lanes]
    keep = rule.keep_two_of_four(keys[:4]) + rule.keep_two_of_four(keys[4:])
  slots, codes = [], []
  for g in (0, 4):
    i0, i1 = first_last(keep[g:g + 4])
    # The values are picked by the indices, not by the keeps themselves
    # (docs/design_notes.md, "The pruning kernels are bound by integer
    # operations").
    slots += [pick(lanes[g:g + 4], i0), pick(lanes[g:g + 4], i1)]
    codes.append(rule.group_code(i0, i1))
  return slots, rule.byte_of(codes[0], codes[1]).astype(jnp.uint8)


def compress_rows(w: jax.Array, keep: list[jax.Array] | None):
  """Compresses a `[R, C]` tile along its last axis (C a multiple of 8).

  `keep`: 8 bool lanes `[R, C/8]` (as from `split_lanes(mask, 8)`), or None
  to prune by magnitude. Returns (values `[R, C/2]`, meta uint8 `[R, C/8]`).
  """
  slots, meta = compress_lanes(split_lanes(w, 8), keep)
  return join_lanes(slots), meta


def expand_rows(values: jax.Array, meta: jax.Array) -> jax.Array:
  """Inverse of `compress_rows`: values `[R, C/2]`, meta `[R, C/8]` -> `[R, C]`."""
  slots = split_lanes(values, 4)
  codes = meta.astype(jnp.int32)
  zero = jnp.zeros((), values.dtype)
  dense = []
  for g, code in enumerate(rule.byte_codes(codes)):
    i0, i1 = rule.code_indices(code)
    first, second = slots[2 * g], slots[2 * g + 1]
    for l in range(4):
      dense.append(jnp.where(i0 == l, first, jnp.where(i1 == l, second, zero)))
  return join_lanes(dense)


def keep_rows(codes: jax.Array) -> jax.Array:
  """The bool keep tile `[8R, C]` of 2:4 groups along the rows from their
  code bytes `[R, C]` (int32; byte (q, c): the groups of rows 8q..8q+7 of
  column c, low nibble first): each byte broadcast to its 8 rows and
  decoded there, so that no `[8R, C]` tile is transposed or interleaved
  (those go through shared memory in Triton's lowering)."""
  rows, cols = codes.shape
  codes = jnp.broadcast_to(codes[:, None, :], (rows, 8, cols)).reshape(8 * rows, cols)
  r = jax.lax.broadcasted_iota(jnp.int32, (8 * rows, cols), 0) % 8
  i0, i1 = rule.code_indices(jnp.where(r >= 4, codes >> 4, codes) & 0xF)
  pos = r % 4
  return (i0 == pos) | (i1 == pos)


def keep_from_meta(meta: jax.Array) -> list[jax.Array]:
  """meta `[R, C/8]` -> 8 bool lanes `[R, C/8]` of the kept positions."""
  codes = meta.astype(jnp.int32)
  keep = []
  for code in rule.byte_codes(codes):
    i0, i1 = rule.code_indices(code)
    keep += [(i0 == l) | (i1 == l) for l in range(4)]
  return keep


def check_operands(fn: str, x: jax.Array, values: jax.Array, meta: jax.Array,
                   k: int, rows_after_n: bool = False) -> tuple[int, int]:
  """The checks both sparse-operand matmuls (`spmm24`, `decode24`) make of
  `x [M, K]` and a compressed weight's arrays (values `[N, K/2]`, metadata
  `uint8[N, ceil(K/8)]`): shapes that agree and one supported dtype, each
  failure named by `fn`. `rows_after_n`: values may have more rows than N
  (other data after the values, read by nobody here). Returns `(M, N)`."""
  if x.ndim != 2:
    raise ValueError(f"{fn}: `x` must be [M, K], got shape {x.shape}.")
  m, kx = x.shape
  n = meta.shape[0] if meta.ndim == 2 else values.shape[0]
  if kx != k or k % 4 or not k:
    raise ValueError(f"{fn}: x.shape[1] = {kx} must equal k = {k}, a positive multiple of 4.")
  rows_ok = values.shape[0] >= n if rows_after_n else values.shape[0] == n
  if (values.ndim != 2 or not rows_ok or values.shape[1] != k // 2
      or meta.shape != (n, math.ceil(k / 8)) or meta.dtype != jnp.uint8):
    raise ValueError(
        f"{fn}: expected values [N{' or more' if rows_after_n else ''}, {k // 2}] and uint8"
        f" meta [N, {math.ceil(k / 8)}], got {values.dtype}{list(values.shape)} and"
        f" {meta.dtype}{list(meta.shape)}.")
  if x.dtype != values.dtype:
    raise TypeError(f"{fn}: x ({x.dtype}) and values ({values.dtype}) must share a dtype.")
  if x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
    raise TypeError(f"{fn}: dtype must be bfloat16, float16 or float32, got {x.dtype}.")
  return m, n
