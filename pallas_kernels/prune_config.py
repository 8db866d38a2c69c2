"""Tile sizes of the prune/compress kernels: `PruneConfig` and its per-kernel
defaults, and `fit_config`, which shrinks a tile for small inputs."""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl


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
    the tile of `transposable24.transposable_mask`) on an H100 (benchmarks/NOTES.md)."""
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
    # (`masked_compress._apply_kernel`); `tune_prune.py --layout cusparselt` on an H200,
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
