"""What the prune/compress kernels share around their tiles: the input
checks, the zero padding to whole tiles and the padding code, the output
shapes and block specs of both layouts (`LAYOUTS`), and the loads and stores
of a tile's row lanes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _tiles
from pallas_kernels import prune_rule as rule
from pallas_kernels.cusparselt_layout import CUSPARSELT_ALIGN
from pallas_kernels.prune_config import PruneConfig


def check_weight(fn: str, w: jax.Array, need_n4: bool) -> None:
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


def check_layout(fn: str, w: jax.Array, layout: str, *, name: str = "w",
                 dims: str = "K and N", fix: str = "") -> bool:
  """Checks `layout` against the 2-D operand `w` (its argument name `name`,
  its axes `dims` and, for misaligned axes, the `fix` the message names);
  True for layout="cusparselt"."""
  if layout not in LAYOUTS:
    raise ValueError(f"{fn}: layout must be one of {LAYOUTS}, got {layout!r}.")
  if layout == "sparse24":
    return False
  if w.dtype not in (jnp.bfloat16, jnp.float16):
    raise TypeError(f"{fn}: layout='cusparselt' takes a bfloat16 or float16 `{name}`"
                    f" (cuSPARSELt's 2:4 formats), got {w.dtype}.")
  if w.shape[0] % CUSPARSELT_ALIGN or w.shape[1] % CUSPARSELT_ALIGN:
    raise ValueError(f"{fn}: layout='cusparselt' needs {dims} multiples of"
                     f" {CUSPARSELT_ALIGN}{fix}, got {name} of shape {w.shape}.")
  return True


def padded(w: jax.Array, bk: int, bn: int) -> jax.Array:
  """Zero-pads to whole tiles. Zero groups compress to code 0x4 (indices 0, 1),
  which is exactly the format's padding code, so slicing the outputs back
  gives the unpadded answer."""
  k, n = w.shape
  pk, pn = -k % bk, -n % bn
  return jnp.pad(w, ((0, pk), (0, pn))) if pk or pn else w


def with_pad_code(meta: jax.Array, length: int) -> jax.Array:
  """Sets the padding nibble (when `length / 4` groups is odd) to the format's
  padding code 0x4; tiles padded with zeros may hold another valid code."""
  if (length // 4) % 2 == 0:
    return meta
  return meta.at[:, -1].set(rule.byte_of(meta[:, -1] & 0xF, rule.PAD_CODE))


def outputs(wp: jax.Array, cfg: PruneConfig, *, meta: bool, transposed: bool,
            k_major: bool = False, values_rows: int | None = None):
  """Output shapes and block specs on the padded `wp[Kp, Np]` (grid (i over
  K tiles, j over N tiles)): values `[Np, Kp/2]`, then meta `[Np, Kp/8]` if
  `meta`, then values_t `[Kp, Np/2]` and meta_t `[Kp, Np/8]` if `transposed`.
  With `k_major` (layout="cusparselt"): values `[Kp/2 + Kp/16, Np]` (or
  `[values_rows, Np]`) and values_t `[Kp + Kp/8, Np/2]`, the values in their
  leading rows."""
  kp, np_ = wp.shape
  bk, bn = cfg.block_k, cfg.block_n
  if k_major:
    shapes = [jax.ShapeDtypeStruct((values_rows or kp // 2 + kp // 16, np_), wp.dtype)]
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


def row_lanes(w_ref) -> list[jax.Array]:
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


def store_slots(values_ref, slots: list[jax.Array], k_major: bool) -> None:
  """Stores 4 value slots `[bk/8, bn]` of row lanes in either layout:
  cuSPARSELt's (`store_k_major`), or Sparse24's values `[bn, bk/2]`, whose
  column 4r + s is slot s's row r (the slots transposed and joined)."""
  if k_major:
    store_k_major(values_ref, slots)
  else:
    values_ref[...] = _tiles.join_lanes([slot.T for slot in slots])
