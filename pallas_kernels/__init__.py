"""Pallas GPU kernels for 2:4 sparsity (no Flax, no optax here).

* `prune24`: fused prune + compress (plain and transposable), one pass over
  the dense weight; `transposable24`: the transposable search, and the mask
  alone (`transposable_mask`); `masked_compress`: compression with a stored
  mask; `mask_rebuild`: a mask rebuilt only where a run-time flag asks;
  `cusparselt_metadata`: cuSPARSELt's metadata written into a compressed
  buffer, `cusparselt_values` a `Sparse24`'s values. Their tiles:
  `prune_config.PruneConfig`.
* `spmm24`: `x @ W` reading the compressed operand and expanding it on chip;
  `decode24` the same for few rows (split-K); `decode24_mma` for up to 256
  rows on the sparse tensor cores (Pallas Mosaic GPU, Hopper: `mma.sp` in
  inline PTX, nothing expanded).
* `mvue24`: a gradient pruned 2:4 by the minimum-variance unbiased rule and
  compressed for cuSPARSELt in one pass (the rule itself, plain `jnp`, in
  `mvue_rule`, shared with jsparse24's reference `mvue_24`).
* `prune_rule`: the magnitude rule's tables and the 2:4 codes (plain Python
  and `jnp`), shared with jsparse24's reference pruning and formats.

Each kernel has a plain-`jnp` `*_reference` beside it and runs on CPU with
`interpret=True` for tests (`decode24_mma`, which Mosaic GPU cannot
interpret, shares `decode24`'s reference and is lowered for CUDA in CPU
tests). The other kernels are written for Pallas's Triton lowering and
import it; `prune_rule`, `mvue_rule` and `cusparselt_layout`
(cuSPARSELt's metadata layout) import no Pallas, so that jsparse24's
reference and the XLA code which replaces the kernels where that lowering
cannot run (in jsparse24's cuSPARSELt backend) can use them.
"""
