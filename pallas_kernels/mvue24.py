"""MVUE 2:4 pruning + compression of a gradient in one pass (Pallas, Triton lowering).

`mvue_compress(g, seed)` reads `g[M, N]` (bfloat16/float16) once and writes
it pruned 2:4 along M by the minimum-variance unbiased rule
(`pallas_kernels.mvue_rule`), the kept values rescaled, compressed in
cuSPARSELt's layout for a structured operand compressed along M (the layout
`prune24.prune_compress(..., layout="cusparselt")` writes for a weight
compressed along K): values `[M/2, N]` in the leading rows of a
`[M/2 + M/16, N]` buffer, and the packed codes `uint8[M/8, N]` (the
`Mask24` layout transposed: a byte per two groups along M) from which the
caller writes the buffer's metadata rows
(`cusparselt_metadata.write_cusparselt_metadata(..., by_groups=True)`). The random
numbers come from a counter-based hash of `seed` and the group's number
`first_group + (m // 4) * N + n` (group rows 2t and 2t + 1 taking the two
halves of one hash, `mvue_rule.uniform_of_group`), so the result equals
`mvue_rule.mvue_compress_reference` (the same rule applied by XLA ops) for
the same seed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import mvue_rule
from pallas_kernels import prune_rule as rule
from pallas_kernels._compress_io import store_k_major
from pallas_kernels.prune_config import PruneConfig, fit_config


def _kernel(seed_ref, g_ref, values_ref, meta_ref, *, n: int):
  # seed_ref: uint32[4] = (seed word 0, seed word 1, number of the first group, 0).
  bm, bn = g_ref.shape
  rows = bm // 8
  lanes = [g_ref[pl.ds(l, rows, stride=8), :].astype(jnp.float32) for l in range(8)]
  # Group row of lane group h in stripe r: (i*bm + 8r + 4h) / 4.
  first_row = pl.program_id(0) * (bm // 4)
  stripe = jax.lax.broadcasted_iota(jnp.int32, (rows, bn), 0)
  col = pl.program_id(1) * bn + jax.lax.broadcasted_iota(jnp.int32, (rows, bn), 1)
  seed0, seed1, first_group = seed_ref[0], seed_ref[1], seed_ref[2]
  # The stripe's two groups (group rows 2r and 2r + 1 from an even first
  # row) are a pair of `mvue_rule.uniform_pair`: one hash of the first's number.
  index = ((first_row + 2 * stripe) * n + col).astype(jnp.uint32) + first_group
  uniforms = mvue_rule.uniform_pair(seed0, seed1, index)
  slots, codes = [], []
  for h in (0, 1):
    i0, i1, v0, v1 = mvue_rule.sample(lanes[4 * h:4 * h + 4], uniforms[h])
    slots += [v0.astype(g_ref.dtype), v1.astype(g_ref.dtype)]
    codes.append(rule.group_code(i0, i1))
  store_k_major(values_ref, slots)
  # The codes as the tile holds them, [M/8, N]: a transpose to the Mask24
  # layout [N, M/8] here would go through shared memory (docs/design_notes.md,
  # "Layout choices inside the compress kernels"); the metadata pass reads
  # this layout as it is (`write_cusparselt_metadata(by_groups=True)`).
  meta_ref[...] = rule.byte_of(codes[0], codes[1]).astype(jnp.uint8)


# The fastest tile of `benchmarks/tune_prune.py --which mvue` (docs/design_notes.md,
# "Prune and compress tiles"); the kernel is bound by integer-pipe operations.
DEFAULT_CONFIG = PruneConfig(block_k=32, block_n=128, num_warps=4)


def _seed_words(seed: jax.Array, first_group) -> jax.Array:
  first = jnp.asarray(first_group).astype(jnp.uint32).reshape(1)
  return jnp.concatenate([seed, first, jnp.zeros((1,), jnp.uint32)])


@functools.partial(jax.jit, static_argnames=("row_stride", "config", "interpret"))
def mvue_compress(g: jax.Array, seed: jax.Array, first_group=0, *, row_stride: int | None = None,
                  config: PruneConfig | None = None, interpret: bool = False):
  """`(buffer [M/2 + M/16, N], codes uint8[M/8, N])` for `g[M, N]` (module
  docstring); M and N multiples of 64, `seed` uint32[2], `first_group` the
  number (a uint32 scalar, may be traced) of g's first group: a shard of a
  larger gradient that starts at row r (a multiple of 8: the group rows
  pair up from there) passes `r // 4 * N` and draws what the whole gradient
  would. `row_stride` (static; default N): the group number's
  step from one group row to the next, so that a block of columns of a
  wider gradient (`row_stride` = its N, `first_group` = `r // 4 * N` plus the
  block's first column) draws what the whole would too. The buffer's last
  M/16 rows are left unwritten for the caller's metadata."""
  mvue_rule.check_gradient("mvue_compress", g, seed)
  m, n = g.shape
  cfg = fit_config(config or DEFAULT_CONFIG, m, n, exact=True)
  bm, bn = cfg.block_k, cfg.block_n
  return pl.pallas_call(
      functools.partial(_kernel, n=n if row_stride is None else row_stride),
      out_shape=[jax.ShapeDtypeStruct((m // 2 + m // 16, n), g.dtype),
                 jax.ShapeDtypeStruct((m // 8, n), jnp.uint8)],
      grid=(m // bm, n // bn),
      in_specs=[pl.BlockSpec((4,), lambda i, j: (0,)),
                pl.BlockSpec((bm, bn), lambda i, j: (i, j))],
      out_specs=[pl.BlockSpec((bm // 2, bn), lambda i, j: (i, j)),
                 pl.BlockSpec((bm // 8, bn), lambda i, j: (i, j))],
      compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps,
                                              num_stages=cfg.num_stages),
      interpret=interpret,
      name="jsparse24_mvue_compress",
  )(_seed_words(seed, first_group), g)
