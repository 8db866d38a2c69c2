"""cuSPARSELt's compressed layout in plain `jnp` (no Pallas import here).

The parts of the layout that the Pallas kernels (`prune24`, `mvue24`) and
the XLA code replacing them share: jsparse24's cuSPARSELt backend runs that
code where Pallas's Triton lowering cannot run, so this module must import
nothing that imports `jax.experimental.pallas.triton`.

cuSPARSELt (0.8) keeps the 4-bit codes of an R x G matrix of groups after
the values, in 256-byte blocks of 64 rows x 8 groups (the byte-wise
definition, checked against recorded bytes, is
jsparse24.backends.cusparselt.metadata_layout). On 32-bit words: four bytes
of a row of the packed mask are the codes of one 8-group block (nibble j:
group 8*gb + j), and output word 16a + 2b + d1 of a block holds groups
4c + 2*d1 + d0 of rows 16a + b (low nibbles) and 16a + 8 + b (high) at
byte 2*d0 + c: shifts and masks of two input words.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# K and N (M and N for a gradient) must be multiples of this: cuSPARSELt's
# own minimum for 16-bit structured operands, and whole 64 x 8-group
# metadata blocks both ways.
CUSPARSELT_ALIGN = 64


def spread_nibbles(t: jax.Array) -> jax.Array:
  """Nibbles 0, 1, 4, 5 of uint32 `t` to bits 0, 16, 8, 24 (the rest dropped)."""
  return (t & 0xF) | ((t & 0xF0) << 12) | ((t & 0xF0000) >> 8) | ((t & 0xF00000) << 4)


def metadata_words_reference(words: jax.Array) -> jax.Array:
  """Plain-`jnp` reference of the metadata kernel
  (`cusparselt_metadata.write_cusparselt_metadata`): uint32 words `[R, G/8]` (row r,
  8-group block gb; R % 64 == 0) -> the blocks' output words
  `[R/64 * G/8, 64]`, row-block major."""
  r, gb = words.shape
  w = words.reshape(r // 64, 4, 2, 8, gb).transpose(0, 4, 1, 3, 2)  # [rb, gb, a, b, h]
  # d1 (the half of the output word) as a broadcast axis: XLA makes a
  # transpose fusion per h and one elementwise fusion of this. An iota, not
  # an array constant: jsparse24 traces this inside custom_partitioning,
  # which refuses constants.
  shift = jax.lax.iota(jnp.uint32, 2) * jnp.uint32(8)  # [d1]: 0, 8
  out = (spread_nibbles(w[..., 0, None] >> shift)
         | (spread_nibbles(w[..., 1, None] >> shift) << 4))  # [rb, gb, a, b, d1]
  return out.reshape(-1, 64)
