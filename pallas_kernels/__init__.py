"""Pallas GPU kernels for 2:4 sparsity (no Flax, no optax here).

* `prune24`: fused prune + compress (plain and transposable) and
  compress-with-a-stored-mask, one pass over the dense weight.
* `spmm24`: `x @ W` reading the compressed operand and expanding it on chip.

Each kernel has a plain-`jnp` `*_reference` beside it and runs on CPU with
`interpret=True` for tests.
"""
