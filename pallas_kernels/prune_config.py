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
    "apply_transposed" (and write the transposed copy). Each tile is the
    fastest of `benchmarks/tune_prune.py`'s sweep for its kernel and layout
    at 16384^2 (docs/design_notes.md, "Prune and compress tiles"; the
    kernels' times: benchmarks/results/nvidia-h200.md, "prune+compress
    16384x16384 bf16")."""
    del k, n
    if kind == "prune_transposable":  # either layout; also the mask alone
      # The search needs ~255 registers per thread: 4 warps, and a row's
      # lanes interleaved in registers and stored contiguously.
      return cls(block_k=64, block_n=128, num_warps=4, strided_lanes=False)
    if kind == "prune":  # either layout: strided row lanes, no transpose of the tile
      return cls(block_k=64, block_n=128, num_warps=8, strided_lanes=True)
    # Compression with a stored mask, both layouts: the codes transposed by
    # XLA, the K-compressed copy from the row lanes
    # (`masked_compress._apply_kernel`).
    if kind == "apply_transposed":  # row lanes forward, each row's keep decoded in place
      return cls(block_k=32, block_n=128, num_warps=4, strided_lanes=True)
    if layout == "cusparselt":  # strided row lanes: nothing transposes a tile
      return cls(block_k=64, block_n=128, num_warps=4, strided_lanes=True)
    # Sparse24: only the four value slots are transposed.
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
