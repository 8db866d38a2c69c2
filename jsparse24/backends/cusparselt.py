"""The `"cusparselt"` backend: NVIDIA cuSPARSELt on the sparse tensor cores,
called through the XLA FFI (`cusparselt_ffi.cc`, built on first use by
`_cusparselt_build`).

Per training step, `prepare` applies (or finds) the mask and compresses `w`
with the Pallas compress kernel -- one pass over `w` writing, in cuSPARSELt's
compressed format, the K-compressed copy and, for transposable masks, the
N-compressed one -- then writes each copy's metadata after its values
(`compress_for_products`). Both products, `y = x @ (w*m)` and `dx = dy @ (w*m)^T`, then
run on the sparse tensor cores; `dw = x^T @ dy` is dense (XLA), or, with
`weight_grad="mvue"`, `x^T @ mvue_24(dy)` on the sparse tensor cores too (dy
pruned and compressed by one Pallas pass, `mvue_weight_grad`). Without a
transposable mask, `dx` is a dense XLA product with the decompressed weight.

Where the Pallas kernels cannot run (Pallas's Triton lowering missing, or
`JSPARSE24_DISABLE_PALLAS_TRITON=1`: `pallas.triton_unavailable_reason`),
XLA code writes the same bytes, slower (`compress_for_products_xla`: the
reference compress laid out by `from_sparse24`;
`mvue_compress_for_product_xla`: the MVUE kernel's reference), chosen in
Python at trace time, with one `XlaFallbackWarning` per process; it imports
only Triton-free modules of `pallas_kernels`.

The weight buffer `w[K, N]` (row-major, N contiguous) is cuSPARSELt's
structured operand A, described as the column-major `N x K` matrix it already
is: forward `y^T = op_N(A) x^T`, backward `dx^T = op_T(A) dy^T`, activations
and results being the row-major JAX arrays read as column-major transposes.
No transposed copy of `w` is ever materialised. M is padded to a multiple of
16 inside each product.

2:4 activations (`input_sparsity`): `input_sparse_matmul` prunes and
compresses `x` (one Pallas pass) and multiplies it, as cuSPARSELt's
structured B, by the dense weight; under `grad_output="2:4"` the same
product takes the output gradient and `w^T` (a transposed copy of the dense
weight) for `dx`; `dw` is XLA's. With `transposable=True` the activations
are pruned on 4x4 tiles and compressed both ways by one Pallas pass
(`tiles_compress_for_products`): the copy along the features is the
forward's (or `dx`'s) structured B, the copy along the tokens the
structured A of `dw` (`pruned_weight_grad`). With `weight_grad="2:4"` the
pruned activation is pruned again along the tokens by the weights' compress
pass (`tokens_compress_for_product`) for that same product, both operands'
rows reordered so that each group of tokens is 4 consecutive rows
(`token_groups`).

Supported: bfloat16 and float16 (cuSPARSELt's float32 mode is 1:2 sparsity on
TF32, which 2:4 masks do not fit), K and N multiples of 64, any M, NVIDIA GPUs
of compute capability 8.0+. The matmul plans and the algorithm picked on the
first call of each shape (`SEARCH`) are cached per process. Under `vmap`, a
batch of activations against one weight folds into M; batched weights (a
mixture of experts' stacked kernels) run as one FFI call for the stack, which
multiplies each item at its offset into the stacked buffers.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jsparse24._format import Mask24, Sparse24, compress_reference, decompress
from jsparse24._input_sparse import (KEEP_MIN_ROWS, TOKEN_BLOCK, SparseProducts,
                                     input_sparse_product, token_groups)
from jsparse24._mvue import mvue_seeds
from jsparse24._prune import prune_24
from jsparse24._sharding import (one_call_per_element, partitioning_off, rows_contracted,
                                 rows_parallel, stack_rows_parallel, whole_on_each_device)
from jsparse24.backends import _cusparselt_build as build
from jsparse24.backends import pallas as pallas_backend
from jsparse24.backends._products import as_weight_grad
from jsparse24.backends._products import matmul as xla_matmul
from jsparse24.backends.base import Backend, Problem, grid_index
from jsparse24.backends.pallas import PallasBackend, compress_arrays
# Triton-free: the XLA code that replaces the Pallas kernels uses them.
from pallas_kernels import cusparselt_layout, mvue_rule

_DTYPE_CODES = {jnp.dtype(jnp.bfloat16): 0, jnp.dtype(jnp.float16): 1}
# K and N must be multiples of this (cuSPARSELt's structured-matrix minimum
# for 16-bit types is 32 x 64; 64 on both sides keeps transposable masks legal):
# the buffers' layout (`pallas_kernels.cusparselt_layout`) is built on it.
ALIGN_KN = cusparselt_layout.CUSPARSELT_ALIGN
# M is padded to a multiple of this inside each product.
PAD_M = 16
# implementation=None takes this backend where benchmarks/bench_auto.py measured
# the linear-layer training step at least 5% faster than dense XLA (y, dx, dw; a
# float32 kernel cast to bfloat16 in the step, as nn.Dense(dtype=bfloat16) does;
# masking and compression included), every dense step timed before the
# process ran a sparse product: benchmarks/results/nvidia-h200.md,
# "Automatic backend choice: training-step sweep" (raw numbers in
# benchmarks/results/data/auto_sweep_h200.json). Per mask kind (transposable
# or not), rows K and columns N of AUTO_GRID: the smallest M (rows of x) from
# which it did at that M and every larger M of the sweep (M = 1024 ... 16384);
# None: at none. A shape between grid points takes the grid point below it (a
# smaller product gains less); K or N below the grid never. The margin is 5%,
# not 1%: the dense step's timing rounds spread by ~11% (median), and once any
# sparse MMA has run, the whole process's compute-bound kernels run 2-7%
# slower, a cost a layer that gains a few percent does not pay back
# (docs/design_notes.md, "Dense baselines are timed before the first sparse
# product"). Without a transposable mask dx is dense and the step gained at
# most 1.06x, so one cell qualifies. K = 1024 and N = 1024 are None although
# some cells measured 1.05-1.11x at M = 16384: inside a model those products
# measured no faster than XLA's dense ones (docs/design_notes.md, "What the
# automatic choice leaves to dense").
# Only bfloat16: float16 picks its algorithm with configuration ids checked on
# an H200 (cuSPARSELt 0.8.0) and an H100 (0.8.0, 0.10.0) only (SEARCH), and a
# wrong id kills the process, which an automatic choice must not risk; name
# it explicitly.
AUTO_GRID = (1024, 2048, 4096, 8192, 16384)
# How much faster a sparse product must measure than the alternative (above).
AUTO_MARGIN = 1.05
AUTO_MIN_M: dict[bool, tuple[tuple[int | None, ...], ...]] = {
    True: (  # transposable masks: y and dx on the sparse tensor cores
        (None, None, None, None, None),
        (None, 16384, 16384, 8192, 4096),
        (None, 16384, 4096, 4096, 4096),
        (None, 4096, 4096, 2048, 2048),
        (None, 16384, 2048, 4096, 2048),
    ),
    False: (  # plain masks: y sparse, dx dense
        (None, None, None, None, None),
        (None, None, None, None, None),
        (None, None, None, None, None),
        (None, None, None, None, 16384),
        (None, None, None, None, None),
    ),
}

# A compressed weight (a `Sparse24`: `compress`, `compress_params`) has no
# dense copy: without cuSPARSELt it multiplies through the decode kernel (up
# to the `"pallas"` backend's DECODE_AUTO_MAX_M rows) or is decompressed for
# XLA's product. implementation=None takes cuSPARSELt for it (the Sparse24
# re-laid out for cuSPARSELt in every call, `forward_buffer`, then its
# product: a prefill's products, a decode step's from a few hundred rows)
# from the M of this table on, rows K and columns N of AUTO_GRID as above:
# the smallest M from which it measured at least AUTO_MARGIN times as fast
# as the faster of those two at that M and every larger M of the sweep;
# 257 (DECODE_MAX_M + 1) where that M was 512, the first swept past the
# decode kernels, and at 256 rows cuSPARSELt also measured AUTO_MARGIN times
# as fast as decompress + XLA: the rows between have no decode kernel, and
# cuSPARSELt beat their only other product on both sides of them (H200:
# decompress + XLA took 1.19-1.32x cuSPARSELt's time at 256 rows and
# 1.31-2.18x at 512 in the four cells of 257; `benchmarks/sweep_decode.py`'s
# `first_cusparselt_m`). Between them, at 384 rows, an H100 measured it 1.15-
# 1.40x as fast as the faster other product at 4096 x 4096 and 4096 x 16384
# (nvidia-h100-80gb-hbm3.md, "cuSPARSELt's sizes asked from threads; ...",
# 2026-12-07).
# Measured on an NVIDIA H200 with `forward_buffer`'s re-layout, M = 128 ...
# 1024 (2026-12-03, benchmarks/results/nvidia-h200.md, "cuSPARSELt on
# compressed weights, re-laid out by Pallas", `sweep_decode.py --cusparselt`),
# and above 1024 rows by a sweep of M = 256 ... 8192 with XLA's re-layout,
# slower than `forward_buffer`'s, so a bound from above (2026-11-28,
# "cuSPARSELt on compressed weights (2026-11-28 08:26 UTC)"): it alone gives
# (2048, 2048) its 2048. Taken for every GPU as AUTO_MIN_M is. At M = 1024
# cuSPARSELt took 1.7-2.0x less time than the other compressed products where
# K and N >= 4096. K or N = 1024: not swept, None.
AUTO_MIN_M_COMPRESSED: tuple[tuple[int | None, ...], ...] = (
    (None, None, None, None, None),   # K 1024
    (None, 2048, 1024, 257, 256),     # K 2048
    (None, 1024, 257, 256, 256),      # K 4096
    (None, 257, 256, 256, 256),       # K 8192
    (None, 257, 256, 256, 256),       # K 16384
)

# Per GPU (`jax.Device.device_kind`), the grid points (K, N) of AUTO_GRID
# where that GPU's own sweep against its products of compressed weights
# moved AUTO_MIN_M_COMPRESSED's cell. H100: the `"pallas"` backend multiplies
# a compressed weight on the sparse tensor cores up to 256 rows
# (DECODE_MMA_MAX_M), where the H200's cells compared cuSPARSELt with the
# Triton kernel; at 256 rows those passes ran 1.19x (4096 x 16384) and 1.28x
# (16384 x 4096) as fast as cuSPARSELt, which won from 512 rows (1.79x,
# 1.71x); so at (8192, 8192): 1.17x, and 1.84x from 512 rows; at (8192,
# 4096), swept while its 256 rows multiplied on the Triton kernel, that
# kernel ran 1.07x as fast as cuSPARSELt, which won from 512 rows (1.48x);
# those rows now take the sparse-tensor-core kernel, which took 0.83x the
# Triton kernel's GPU time there ("The H100's last decode cells on the
# sparse tensor cores", 2026-12-06). So those cells start at 257, past the
# decode kernels, as the table above does where cuSPARSELt beat decompress
# + XLA at both 256 and 512 rows (on the H200 at 256 rows: 1.44-2.12x in
# these four cells). Every other cell of K, N =
# 2048-16384 (swept 2026-12-06) kept its own (nvidia-h100-80gb-hbm3.md,
# "cuSPARSELt against the passes at 256 and 512 rows", "The cells where K or
# N = 2048 or K = 8192; ..." and "The H100's last cells of
# AUTO_MIN_M_COMPRESSED").
AUTO_MIN_M_COMPRESSED_BY_GPU: dict[str, dict[tuple[int, int], int | None]] = {
    "NVIDIA H100 80GB HBM3": {(4096, 16384): 257, (8192, 4096): 257, (8192, 8192): 257,
                              (16384, 4096): 257},
}

# The same for a `Sparse24` in cuSPARSELt's layout (`compress(...,
# cusparselt=True)`), which cuSPARSELt multiplies in place, so from fewer
# rows. Measured on an NVIDIA H200, M = 128, 256, 512 (2026-12-04,
# benchmarks/results/nvidia-h200.md, "cuSPARSELt on compressed weights in its
# layout", `sweep_decode.py --cusparselt-layout`); above 512 rows the table
# above's sweeps, where the re-layout in every call already paid, stand for
# it: so (2048, 2048), which did not pay by 512 rows, keeps 2048. 257 as in
# AUTO_MIN_M_COMPRESSED: at (4096, 2048) and (8192, 2048) decompress + XLA
# took 1.55x cuSPARSELt's time at 256 rows and 1.32x and 1.81x at 512.
AUTO_MIN_M_CUSPARSELT_LAYOUT: tuple[tuple[int | None, ...], ...] = (
    (None, None, None, None, None),   # K 1024
    (None, 2048, 256, 256, 256),      # K 2048
    (None, 257, 256, 128, 256),       # K 4096
    (None, 257, 256, 128, 128),       # K 8192
    (None, 256, 256, 128, 128),       # K 16384
)


# Per dtype, how the first call of each shape picks cuSPARSELt's algorithm
# (the choice is cached for the process and in the algorithm cache file):
# "cusparselt" runs cusparseLtMatmulSearch; ("configs", n) times configuration
# ids 0..n-1 on the real buffers and keeps the fastest (jsparse24's search, in
# the shim); ("both", n) times cusparseLtMatmulSearch's pick (which may split K)
# beside those ids and keeps the fastest; "default" takes cuSPARSELt's default.
# bfloat16 takes "both": the modes gain the same on average, but
# cusparseLtMatmulSearch alone once picked an algorithm slower than dense,
# which the algorithm cache file would then keep for later runs too; "both"
# guards against that outlier: benchmarks/results/nvidia-h100-80gb-hbm3.md,
# "cuSPARSELt algorithm search modes" (`benchmarks/tune_cusparselt.py`).
# float16 takes ("configs", 34): cusparseLtMatmulSearch tries every id, and
# with cuSPARSELt 0.8.0 on an H200 the float16 ids from 34 on hit an illegal
# instruction, which kills the process; cuSPARSELt's default algorithm is
# slower than dense XLA there, the search faster: benchmarks/results/
# nvidia-h200.md, "cuSPARSELt float16 (default algorithm)" and "cuSPARSELt
# float16". The search makes the first call of each float16 shape and
# direction slow (seconds), then costs nothing (docs/design_notes.md,
# "cuSPARSELt: how an algorithm is picked").
SEARCH: dict[Any, Any] = {jnp.dtype(jnp.bfloat16): ("both", 20),
                          jnp.dtype(jnp.float16): ("configs", 34)}


def _search_attrs(dtype) -> tuple[int, int]:
  """(search, alg) attributes of the matmul FFI call (cusparselt_ffi.cc)."""
  mode = SEARCH[jnp.dtype(dtype)]
  if mode == "cusparselt":
    return 1, -1
  if mode == "default":
    return 0, -1
  kind, count = mode
  if kind not in ("configs", "both") or count < 1:
    raise ValueError(f"cusparselt.SEARCH: unknown mode {mode!r}")
  return (2 if kind == "configs" else 3), int(count)


_COL = 1
_N, _T = 0, 1


# cuSPARSELt versions (major.minor) on which jsparse24's own writing of the
# compressed layout (byte-identical to cusparseLtSpMMACompress2) and the
# products in bfloat16 and float16 (SEARCH's configuration ids) passed the GPU
# tests, 0.8.0 and 0.10.0 on an H100: benchmarks/results/nvidia-h100-80gb-hbm3.md,
# "cuSPARSELt versions" (`benchmarks/cusparselt_versions.py`; 0.9 has not been
# run). Another version may lay its buffers out differently, which would give
# wrong products without any error, so it is refused; pyproject.toml's range
# matches.
VERIFIED_VERSIONS = ("0.8", "0.10")


@functools.cache
def _load_or_reason() -> tuple[Any, str | None]:
  try:
    lib = build.load()
  except build.BuildError as e:
    return None, str(e)
  loaded = build.version(lib)
  if ".".join(loaded.split(".")[:2]) not in VERIFIED_VERSIONS:
    return None, (
        f"cuSPARSELt {loaded} is loaded, but jsparse24 writes cuSPARSELt's compressed"
        f" layout itself and checked it on cuSPARSELt"
        f" {', '.join(v + '.x' for v in VERIFIED_VERSIONS)} only (another layout would"
        f" give wrong products silently); install the newest of those (`pip install"
        f" 'nvidia-cusparselt-cu13>=0.10,<0.11'`, as the [cuda] extra does) or point"
        f" JSPARSE24_CUSPARSELT_HOME at such an install")
  return lib, None


def _library():
  lib, reason = _load_or_reason()
  if lib is None:
    raise build.BuildError(reason)
  return lib


def _device_ordinal() -> int:
  return int(getattr(jax.local_devices()[0], "local_hardware_id", 0) or 0)


@functools.cache
def _compressed_size(dtype, k: int, n: int) -> int:
  lib = _library()
  size, buffer_size = ctypes.c_size_t(), ctypes.c_size_t()
  msg = ctypes.create_string_buffer(1024)
  if lib.jsp_cusparselt_compressed_size(_device_ordinal(), _DTYPE_CODES[jnp.dtype(dtype)], n, k,
                                        _COL, ctypes.byref(size), ctypes.byref(buffer_size),
                                        msg, len(msg)):
    raise RuntimeError(f"cuSPARSELt: {msg.value.decode(errors='replace')}")
  return size.value


def compressed_size(dtype, k: int, n: int) -> int:
  """Bytes of cuSPARSELt's compressed form of a `[K, N]` weight (either direction)."""
  return _compressed_size(jnp.dtype(dtype), k, n)


def buffer_shape(k: int, n: int, *, transpose: bool) -> tuple[int, int]:
  """Shape (in the weight's dtype) of the compressed buffers jsparse24 keeps:
  the values in the dense buffer's orientation -- `[K/2, N]` (forward, 2:4
  along K) or `[K, N/2]` (backward, along N) -- then the metadata, one byte
  per 8 weights: `K/16` more rows of `N`, or `K/8` more rows of `N/2`."""
  return (k + k // 8, n // 2) if transpose else (k // 2 + k // 16, n)


def _check_size(dtype, k: int, n: int) -> None:
  rows, cols = buffer_shape(k, n, transpose=False)
  size = compressed_size(dtype, k, n)
  if size != rows * cols * jnp.dtype(dtype).itemsize:
    raise RuntimeError(
        f"cuSPARSELt {build.version(_library())} reports {size} compressed bytes for a"
        f" {k}x{n} {jnp.dtype(dtype).name} weight; jsparse24 writes the layout of"
        f" cuSPARSELt {'/'.join(VERIFIED_VERSIONS)} ({rows * cols * jnp.dtype(dtype).itemsize}"
        f" bytes). Please report this, and use cuSPARSELt 0.10 meanwhile.")


def compress(masked: jax.Array, *, transpose: bool) -> jax.Array:
  """cuSPARSELt's compressed form of a 2:4-masked `[K, N]` weight, by
  `cusparseLtSpMMACompress2`: along K for `x @ w` (transpose=False), along N
  for `dy @ w^T` (transpose=True; the mask must be transposable). Entries
  outside the mask must be zero. Returns the buffer as a `buffer_shape`
  array of the weight's dtype."""
  k, n = masked.shape
  _check_size(masked.dtype, k, n)
  # The weight buffer w[K, N] is the column-major N x K structured matrix
  # A; op N compresses along K (forward), op T along N (backward).
  return _ffi_compress(masked, buffer_shape(k, n, transpose=transpose), rows=n, cols=k,
                       op=_T if transpose else _N, sparse_a=1)


def _ffi_compress(dense, shape, *, rows, cols, op, sparse_a):
  """`cusparseLtSpMMACompress2` of the column-major `rows x cols` matrix that
  `dense`'s buffer is, as operand A (`sparse_a`) or B, op `op`."""
  call = jax.ffi.ffi_call("jsparse24_cusparselt_compress",
                          jax.ShapeDtypeStruct(shape, dense.dtype), vmap_method="sequential")
  return call(dense, rows=np.int64(rows), cols=np.int64(cols), order=np.int64(_COL),
              op=np.int64(op), sparse_a=np.int64(sparse_a))


# --- cuSPARSELt's compressed layout, written from jsparse24's own kernels ---------
#
# Decoded from cusparseLtSpMMACompress2's output on an H200 (cuSPARSELt 0.8,
# 16-bit types; tests/data/cusparselt_layout.npz keeps one recorded case): the
# buffer is the kept values, then the metadata.
#  * Values keep the dense buffer's memory order with the compressed axis
#    halved: `[K/2, N]` for the forward operand (2:4 along K), `[K, N/2]` for
#    the backward one (2:4 along N) -- our Sparse24 `values.T` and `values_t`.
#  * Metadata: one 4-bit code `i0 | i1 << 2` per group of 4 (our code), for a
#    matrix of R rows x G groups (forward: R = N, G = K/4; backward: R = K,
#    G = N/4), in blocks of 64 rows x 8 groups = 256 bytes, blocks ordered
#    row-block major. Inside a block, row r = 16*a + 8*h + b and group
#    g = 4*c + d land in byte 64*a + 8*b + 2*d + c, in the low nibble when
#    h = 0 and the high nibble when h = 1.
# So the Pallas compress kernel (layout="cusparselt") writes the values straight
# into these buffers, in one pass over `w` (mask applied, both copies), and
# `_with_metadata` writes the metadata after them in place (a second, small
# Pallas pass); cusparseLtSpMMACompress2 writes the same bytes, slower:
# benchmarks/results/nvidia-h200.md, "cuSPARSELt compression (per training
# step)".


def metadata_layout(codes: jax.Array) -> jax.Array:
  """cuSPARSELt's metadata bytes for `[R, G]` 4-bit codes (R % 64 == 0, G % 8 == 0):
  the layout above, byte by byte. The definition the tests check against
  recorded cuSPARSELt bytes; `_metadata_rows` computes the same on words."""
  r, g = codes.shape
  c = codes.reshape(r // 64, 4, 2, 8, g // 8, 2, 4)  # [rb, a, h, b, gb, c, d]
  byte = c[:, :, 0] | (c[:, :, 1] << 4)  # [rb, a, b, gb, c, d]
  return byte.transpose(0, 3, 1, 2, 5, 4).reshape(-1)


def _metadata_rows(meta: jax.Array, groups: int, cols: int, dtype) -> jax.Array:
  """The metadata of packed `meta` (`[R, G/2]`) as `[R*G/(4*cols), cols]`
  elements of `dtype` (16-bit): `metadata_layout` of its codes, computed by
  XLA on 32-bit words (`cusparselt_layout.metadata_words_reference`: four
  bytes of a mask row are one 8-group block's codes, and each output word
  is shifts and masks of two of them). The reference of the Pallas pass
  that `_with_metadata` runs; used where the metadata goes into a new buffer
  (`from_sparse24`, and the XLA code that replaces the Pallas kernels)."""
  r = meta.shape[0]
  words = jax.lax.bitcast_convert_type(meta[:, :groups // 2].reshape(r, groups // 8, 4),
                                       jnp.uint32)  # [R, G/8]: row r, block gb
  out = cusparselt_layout.metadata_words_reference(words)
  return jax.lax.bitcast_convert_type(out, dtype).reshape(-1, cols)


def _with_metadata(buf: jax.Array, rows: int, meta: jax.Array, groups: int,
                   by_groups: bool = False, interpret: bool | None = None) -> jax.Array:
  """`buf` with the metadata of `meta` written from row `rows` on, in place
  (`buf` is the compress kernel's output, used nowhere else), by one Pallas
  pass (`cusparselt_metadata.write_cusparselt_metadata`; the bytes of
  `_metadata_rows`, the XLA fallback's three passes and an in-place update:
  docs/design_notes.md, "cuSPARSELt: who writes the compressed buffers").
  `by_groups`: `meta` is the packed mask transposed (`uint8[groups/2, R]`).
  `interpret`: None, `pallas.interpreting()`."""
  kernel = pallas_backend.kernels().cusparselt_metadata.write_cusparselt_metadata
  if interpret is None:
    interpret = pallas_backend.interpreting()
  write = functools.partial(kernel, row=rows, by_groups=by_groups, interpret=interpret)
  # The pass needs the whole buffer and mask: with Auto mesh axes XLA gathers
  # sharded ones itself (the compressed arrays, never the weight); with
  # Explicit axes the call runs on replicated per-device arrays, as the
  # compress kernels do.
  return whole_on_each_device(write, buf, meta[:groups // 2] if by_groups
                              else meta[:, :groups // 2])


def _check_aligned(k: int, n: int) -> None:
  if k % ALIGN_KN or n % ALIGN_KN:
    raise ValueError(f"cuSPARSELt layout: K={k} and N={n} must be multiples of {ALIGN_KN}")


def from_sparse24(sp: Sparse24) -> tuple[jax.Array, jax.Array | None]:
  """cuSPARSELt's compressed buffers (`buffer_shape`; forward, and backward
  when `sp` has its transposed copy) from a `[K, N]` Sparse24; byte-identical
  to `compress(decompress(sp), ...)` when no kept value is zero."""
  k, n = sp.shape
  _check_aligned(k, n)
  fwd = jnp.concatenate([sp.values.T, _metadata_rows(sp.meta, k // 4, n, sp.dtype)])
  bwd = None
  if sp.has_transpose:
    bwd = jnp.concatenate([sp.values_t, _metadata_rows(sp.meta_t, n // 4, n // 2, sp.dtype)])
  return fwd, bwd


def forward_buffer(sp: Sparse24) -> jax.Array:
  """`from_sparse24(sp)[0]` in two Pallas passes: the values transposed
  straight into the buffer (`cusparselt_values.values_into_buffer`), then
  the metadata written in place (`_with_metadata`). `from_sparse24`, XLA's
  concatenate of the transposed values and the metadata, copies the values
  twice: in a 2:4 model's prefill (H200, d_model 4096 x 8 blocks, 2048
  tokens) its copies took 1.96 of 15.67 ms; these passes run at 74-97% of
  copy bandwidth on its large shapes, XLA's at 47-49% (2026-12-03,
  benchmarks/results/nvidia-h200.md, "Decode: the steps timed over longer
  runs, ..."). Where the kernels cannot run, `from_sparse24`."""
  k, n = sp.shape
  _check_aligned(k, n)
  if _xla_fallback():
    return from_sparse24(sp)[0]
  write = functools.partial(pallas_backend.kernels().cusparselt_values.values_into_buffer,
                            rows=buffer_shape(k, n, transpose=False)[0],
                            interpret=pallas_backend.interpreting())
  return _with_metadata(whole_on_each_device(write, sp.values), k // 2, sp.meta, k // 4)


def cusparselt_layout_unfit(shape: tuple[int, ...], dtype,
                            off: str = "cusparselt=False") -> str | None:
  """Why a `[..., K, N]` weight of `dtype` cannot take cuSPARSELt's layout
  (`to_cusparselt_layout`), with the fix (`off`: the argument that asks for
  the portable layout instead); None: it can."""
  k, n = shape[-2:]
  if jnp.dtype(dtype) not in _DTYPE_CODES:
    return (f"needs bfloat16 or float16 weights (cuSPARSELt's 2:4 products), got"
            f" {jnp.dtype(dtype)}; cast the weight first or pass {off}.")
  if k % ALIGN_KN or n % ALIGN_KN:
    return (f"needs K and N multiples of {ALIGN_KN} (cuSPARSELt's layout), got K={k},"
            f" N={n}; pass {off} for this weight.")
  return None


def to_cusparselt_layout(sp: Sparse24, fn: str = "compress") -> Sparse24:
  """`sp` in cuSPARSELt's layout (`Sparse24.cusparselt`): its kept values,
  then the metadata cuSPARSELt reads, in one `[..., N + N/8, K/2]` array.

  cuSPARSELt's structured operand declared as the row-major `[N, K]` a
  Sparse24's values describe (op T: the transposed buffer of `w^T`,
  `buffer_shape(N, K, transpose=True)`) compresses to those values followed
  by `_metadata_rows` of the same codes: `from_sparse24`'s buffers without
  the transpose of the values (checked byte for byte against
  cusparseLtSpMMACompress2 on the GPU, tests/test_gpu.py). Products then
  read the weight in place: on an H200 at 2048 rows, 1.41-1.66x of dense XLA
  against 1.26-1.45x with `forward_buffer` in every call (2026-12-03,
  benchmarks/results/nvidia-h200.md, "Where the re-layout goes, and what is
  left without it"). Costs N*K/8 bytes more (1/9 of the values for 16-bit
  weights); the decode kernel reads the first N rows and the 4-bit `meta`."""
  if sp.cusparselt:
    return sp
  *lead, k, n = sp.shape
  reason = cusparselt_layout_unfit(sp.shape, sp.dtype)
  if reason:
    raise ValueError(f"{fn}: cusparselt=True {reason}")

  def one(values, meta):
    return jnp.concatenate([values, _metadata_rows(meta, k // 4, k // 2, values.dtype)])

  for _ in lead:
    one = jax.vmap(one)
  return dataclasses.replace(sp, values=one(sp.values, sp.meta), cusparselt=True)


def _xla_fallback() -> bool:
  """Whether XLA code replaces the Pallas kernels here (they cannot run:
  `pallas.triton_unavailable_reason`); warns once per process when it does.
  Decided in Python at trace time, so a traced step holds one path only."""
  if pallas_backend.triton_unavailable_reason() is None:
    return False
  pallas_backend.warn_xla_fallback()
  return True


def compress_for_products_xla(w: jax.Array, mask, transposable: bool):
  """`compress_for_products` by XLA code, byte for byte (for the Pallas
  kernels' place where they cannot run): the reference compress, laid out
  by `from_sparse24`. Several passes over `w` and the compressed arrays
  where the kernels make one and a small one."""
  if mask is not None and not isinstance(mask, Mask24):
    mask = Mask24.pack(mask)  # a bool mask read as the kernels read it
  sp = compress_reference(w, mask, transposable)
  fwd, bwd = from_sparse24(sp)
  return fwd, bwd, sp.meta


def compress_for_products(w: jax.Array, mask, transposable: bool):
  """Masks (or prunes, `mask=None`) and compresses `w[K, N]` for cuSPARSELt
  with jsparse24's Pallas kernel: `(fwd, bwd, meta)`, the buffers of
  `buffer_shape` (bwd None unless `transposable`) and the mask's packed
  codes (`Mask24` layout) -- one pass over `w`, then the metadata writes
  (where the kernels cannot run, `compress_for_products_xla`)."""
  k, n = w.shape
  _check_aligned(k, n)
  if _xla_fallback():
    return compress_for_products_xla(w, mask, transposable)
  fwd, meta, bwd, meta_t = compress_arrays(w, mask, transposable, layout="cusparselt")
  fwd = _with_metadata(fwd, k // 2, meta, k // 4)
  if bwd is not None:
    bwd = _with_metadata(bwd, k, meta_t, n // 4)
  return fwd, bwd, meta


def compress_for_products_by_cusparselt(w: jax.Array, mask, transposable: bool):
  """`compress_for_products`'s buffers written by cuSPARSELt itself, for
  comparisons (`benchmarks/bench_cusparselt.py`): the mask found or applied
  by the Pallas kernel (where it cannot run, the reference), the masked
  weight decompressed by XLA, then `compress` (cusparseLtSpMMACompress2) in
  each direction. The same bytes as `compress_for_products`, in more passes
  over memory."""
  sp = (compress_reference(w, mask, transposable) if _xla_fallback()
        else PallasBackend().compress(w, mask, transposable))
  masked = decompress(sp)
  fwd = compress(masked, transpose=False)
  bwd = compress(masked, transpose=True) if transposable else None
  return fwd, bwd, sp.meta


def _matmul_2d(x: jax.Array, c: jax.Array, k: int, n: int, transpose: bool) -> jax.Array:
  if c.ndim != 2:
    raise ValueError(f"cusparselt matmul: one compressed operand {list(c.shape)} must be 2-D")
  _check_buffer(x, c, k, n, transpose)
  # Partitioned over M under jit with sharded activations (the FFI call
  # itself has no sharding rule): each device multiplies its own rows.
  return rows_parallel(_ffi_matmul(k, n, transpose, *_search_attrs(x.dtype)), x, c)


def _sparse_a_matmul(a: jax.Array, b: jax.Array, shape: tuple[int, ...], *, m: int, n: int,
                     k: int, op_a: int, op_b: int, search: int, alg: int,
                     batch: int = 1) -> jax.Array:
  """cuSPARSELt's column-major `D[m, n] = op(A)[m, k] @ op(B)[k, n]`, `A` the
  compressed structured buffer `a`, `B` the dense `b`; `D` is returned as
  the row-major `shape` array of b's dtype that its buffer is. `batch` > 1:
  that many products of these sizes, `a`, `b` and `D` stacked on axis 0
  (`shape` includes it), run by one call."""
  return _ffi_product(a, b, shape, b.dtype, m=m, n=n, k=k, op_a=op_a, op_b=op_b, sparse_a=1,
                      search=search, alg=alg, batch=batch)


def _sparse_b_matmul(a: jax.Array, b: jax.Array, shape: tuple[int, ...], *, m: int, n: int,
                     k: int, search: int, alg: int) -> jax.Array:
  """`_sparse_a_matmul` with the roles swapped: `D[m, n] = A[m, k] @ B[k, n]`
  (column-major, op N on both), `A` the dense `a`, `B` the compressed
  structured buffer `b` (2:4 along k); `D` in a's dtype."""
  return _ffi_product(a, b, shape, a.dtype, m=m, n=n, k=k, op_a=_N, op_b=_N, sparse_a=0,
                      search=search, alg=alg, batch=1)


def _ffi_product(a, b, shape, dtype, *, m, n, k, op_a, op_b, sparse_a, search, alg, batch):
  call = jax.ffi.ffi_call("jsparse24_cusparselt_matmul", jax.ShapeDtypeStruct(shape, dtype))
  d = call(a, b, m=np.int64(m), n=np.int64(n), k=np.int64(k), op_a=np.int64(op_a),
           op_b=np.int64(op_b), sparse_a=np.int64(sparse_a), order_a=np.int64(_COL),
           order_b=np.int64(_COL), order_d=np.int64(_COL), search=np.int64(search),
           alg=np.int64(alg), batch=np.int64(batch))
  # Where the product is also written into a stacked buffer (an `nn.scan`
  # keeping it for the backward pass) and read by another op, XLA's GPU
  # dynamic-slice fusion computed the call twice, once into the stack
  # (docs/design_notes.md, "cuSPARSELt: an optimization barrier behind each
  # product"). Behind the barrier the stack gets a copy, as a dense dot's
  # output does.
  return jax.lax.optimization_barrier(d)


@functools.cache
def _ffi_matmul(k: int, n: int, transpose: bool, search: int, alg: int):
  """The per-device product `x[M, K or N] -> [M, N or K]` on buffer `c`; or
  a stack of them, `x[B, M, .]` on `c[B, ...]` (one call for the stack)."""

  def run(x, c):
    stack = x.shape[:-2]  # () or (B,)
    m = x.shape[-2]
    pad = -m % PAD_M
    if pad:
      x = jnp.pad(x, [(0, 0)] * len(stack) + [(0, pad), (0, 0)])
    mp = m + pad
    out = k if transpose else n  # columns of the result
    inner = n if transpose else k  # contraction length
    # Column-major GEMM D[out, M] = op(A)[out, inner] @ B[inner, M]: A is the
    # structured W^T (N x K column-major: the w buffer), B = x^T and D = y^T
    # (the row-major x and y buffers).
    y = _sparse_a_matmul(c, x, (*stack, mp, out), m=out, n=mp, k=inner,
                         op_a=_T if transpose else _N, op_b=_N, search=search, alg=alg,
                         batch=stack[0] if stack else 1)
    return y[..., :m, :] if pad else y

  return run


def _check_buffer(x: jax.Array, c: jax.Array, k: int, n: int, transpose: bool) -> None:
  want = buffer_shape(k, n, transpose=transpose)
  if c.shape[-2:] != want or c.dtype != x.dtype:
    raise ValueError(
        f"cusparselt matmul: the compressed operand must be {x.dtype.name}{list(want)}"
        f" (buffer_shape of a {k}x{n} weight, x's dtype), got {c.dtype.name}{list(c.shape)}")
  _check_size(x.dtype, k, n)


@functools.cache
def _stacked_matmul(k: int, n: int, transpose: bool, unpartitioned: bool):
  """`x[B, M, .] @ W_b` for stacked buffers `c[B, ...]` (the experts of a
  mixture of experts under `vmap`): one cuSPARSELt call for the stack,
  partitioned over B and M (`stack_rows_parallel`). Under a further `vmap`,
  one such call per element of that axis. `unpartitioned`: as for
  `_batched_matmul`."""
  del unpartitioned

  @jax.custom_batching.custom_vmap
  def mm(x, c):
    _check_buffer(x, c, k, n, transpose)
    return stack_rows_parallel(_ffi_matmul(k, n, transpose, *_search_attrs(x.dtype)), x, c)

  @mm.def_vmap
  def _rule(axis_size, in_batched, x, c):
    return one_call_per_element(mm, axis_size, in_batched, (x, c))

  return mm


@functools.cache
def _batched_matmul(k: int, n: int, transpose: bool, unpartitioned: bool):
  """`x[M, K] @ W` (or `x[M, N] @ W^T`) for compressed `c`, with a vmap rule:
  batched activations fold into M; batched weights (stacked experts) run as
  one call for the stack (`_stacked_matmul`).

  `unpartitioned` (`_sharding.partitioning_off()`) only keys the cache: on
  jax 0.11 `custom_vmap` reuses the trace of its function (0.10 traces
  again), so the product traced inside a lowering rule (forward mode's
  tangent) needs its own `mm`, or it gets the earlier trace with
  `custom_partitioning` in it, which cannot be lowered there (seen on an
  H100: `jax.linearize` of a jitted product failed)."""
  del unpartitioned

  @jax.custom_batching.custom_vmap
  def mm(x, c):
    return _matmul_2d(x, c, k, n, transpose)

  @mm.def_vmap
  def _rule(axis_size, in_batched, x, c):
    x_batched, c_batched = in_batched
    if not c_batched:
      b, m = x.shape[0], x.shape[1]
      y = mm(x.reshape(b * m, x.shape[2]), c)
      return y.reshape(b, m, y.shape[-1]), True
    if not x_batched:
      x = jnp.broadcast_to(x, (axis_size, *x.shape))
    return _stacked_matmul(k, n, transpose, partitioning_off())(x, c), True

  return mm


def matmul(x: jax.Array, c: jax.Array, *, k: int, n: int, transpose: bool = False) -> jax.Array:
  """`x @ (w*m)` (x `[M, K]`), or `x @ (w*m)^T` with transpose=True (x
  `[M, N]`), from `c = compress(w*m, transpose=...)` (or the buffers of
  `compress_for_products` / `from_sparse24`); fp32 accumulation, result in
  x's dtype."""
  return _batched_matmul(k, n, transpose, partitioning_off())(x, c)


# --- the weight gradient on the sparse tensor cores (weight_grad="mvue") ----------
#
# dw[K, N] = x^T mvue_24(dy): the pruned dy[M, N] (2:4 along M, its
# contraction axis) is cuSPARSELt's structured operand A, the column-major
# N x M matrix its row-major buffer already is -- the same layout as a weight
# w[K, N] compressed along K for the forward product, with M for K -- so the
# MVUE kernel writes it in that layout (values, then the metadata). B = x^T
# (the row-major x read as column-major K x M, op T) and D = dw^T (column-major
# N x K: the row-major dw). cuSPARSELt writes D in the input dtype (float32
# accumulation, rounded once to bfloat16/float16), which is then cast to w's
# dtype.


def mvue_compress_for_product_xla(dy: jax.Array, seed: jax.Array, first_group=0,
                                  row_stride: int | None = None) -> jax.Array:
  """`mvue_compress_for_product` by XLA code, byte for byte (for the Pallas
  kernel's place where it cannot run): the kernel's reference, drawing what
  the kernel draws for the same `first_group` and `row_stride`, then the
  metadata rows (`_metadata_rows` of the codes transposed to the `Mask24`
  layout)."""
  m, n = dy.shape
  values, codes = mvue_rule.mvue_compress_reference(dy, seed, first_group, row_stride)
  return jnp.concatenate([values, _metadata_rows(codes.T, m // 4, n, dy.dtype)])


def mvue_compress_for_product(dy: jax.Array, seed: jax.Array, first_group=0,
                              row_stride: int | None = None,
                              interpret: bool | None = None) -> jax.Array:
  """`mvue_24` of `dy[M, N]` (M, N multiples of 64) along M, compressed for
  cuSPARSELt (`buffer_shape(M, N, transpose=False)`), by one Pallas pass then
  the metadata write (where the kernels cannot run,
  `mvue_compress_for_product_xla`). `seed`: `mvue_seeds(key)`;
  `first_group`, `row_stride` as in `pallas_kernels.mvue24.mvue_compress`;
  `interpret`: None, `pallas.interpreting()` (a partitioned op's body is
  traced when XLA partitions it, outside the caller's `interpret_mode`)."""
  m, n = dy.shape
  _check_aligned(m, n)
  if _xla_fallback():
    return mvue_compress_for_product_xla(dy, seed, first_group, row_stride)
  if interpret is None:
    interpret = pallas_backend.interpreting()
  buf, codes = pallas_backend.kernels().mvue24.mvue_compress(
      dy, seed, first_group, row_stride=row_stride, interpret=interpret)
  return _with_metadata(buf, m // 2, codes, m // 4, by_groups=True, interpret=interpret)


@functools.cache
def _mvue_weight_grad_local(search: int, alg: int, interpret: bool):
  """The per-device `fn(x, dy, first_row, first_col, n_total, seed) -> [K, N]`
  of `rows_contracted` (dy's block draws what the whole `[M, n_total]`
  gradient would), in x's dtype: the partial sums are all-reduced in the
  dtype the product writes, as XLA reduces the dense model's `x^T dy` (and
  the reference backend's MVUE product). A float32 result would double the
  all-reduce's bytes (docs/design_notes.md, "cuSPARSELt: the MVUE weight
  gradient all-reduced in the input's dtype"). It also takes a stack
  (x `[B, M, K]`, dy `[B, M, N]`, seed `[B, 2]` -> `[B, K, N]`, the experts
  of a mixture of experts): one compression pass and one cuSPARSELt call
  for all of it, each item with its own seed."""

  def run(x, dy, first_row, first_col, n_total, seed):
    stack = x.shape[:-2]  # () or (B,)
    m, k = x.shape[-2:]
    n = dy.shape[-1]
    head = m - m % 4  # the last M % 4 rows are kept exactly (as mvue_24 does)
    dw = jnp.zeros((*stack, k, n), jnp.float32)
    if head:
      pad = [(0, 0)] * len(stack) + [(0, -head % ALIGN_KN), (0, 0)]
      xh = jnp.pad(x[..., :head, :], pad)
      dyh = jnp.pad(dy[..., :head, :], pad)
      mp = xh.shape[-2]
      _check_size(x.dtype, mp, n)
      first_group = ((first_row // 4).astype(jnp.uint32) * jnp.uint32(n_total)
                     + first_col.astype(jnp.uint32))
      compress = functools.partial(mvue_compress_for_product, first_group=first_group,
                                   row_stride=n_total, interpret=interpret)
      # A stack is one Pallas call with a larger grid.
      c = (jax.vmap(compress) if stack else compress)(dyh, seed)
      # D[N, K] (column-major) = A[N, Mp] (structured, op N) @ op_T(B)[Mp, K].
      dw = _sparse_a_matmul(c, xh, (*stack, k, n), m=n, n=k, k=mp, op_a=_N, op_b=_T,
                            search=search, alg=alg,
                            batch=stack[0] if stack else 1).astype(jnp.float32)
    if head < m:
      dw = dw + jnp.einsum("...mk,...mn->...kn", x[..., head:, :], dy[..., head:, :],
                           preferred_element_type=jnp.float32)
    return dw.astype(x.dtype)  # exact where M % 4 == 0 (the product's own dtype)

  return run


def mvue_weight_grad(x: jax.Array, dy: jax.Array, key: jax.Array) -> jax.Array:
  """`x[M, K]^T mvue_24(dy[M, N], key)` (`[K, N]` in x's dtype) with the product on
  the sparse tensor cores; under `jit` with rows sharded, each device prunes
  and multiplies its own rows (drawing what the whole `dy` would, for M a
  multiple of 8 per device: two group rows share one hash) and the partial
  sums are all-reduced; with x split on K or dy on N (tensor parallelism,
  64-aligned), each device makes its block of the result."""
  fn = _mvue_weight_grad_local(*_search_attrs(x.dtype), pallas_backend.interpreting())
  return rows_contracted(fn, x, dy, mvue_seeds(key), align=ALIGN_KN, stacks=True)


# --- 2:4 activations (input_sparsity="masked" | "ste") ---------------------------
#
# y[M, N] = prune(x)[M, K] @ w[K, N]: the pruned x is cuSPARSELt's structured
# operand B, the column-major K x M matrix its row-major buffer already is (2:4
# along K: each column one row of x); w is the dense A, the column-major N x K
# matrix its buffer is; D = y^T column-major, the row-major y. The compressed
# B has the layout of a weight's backward buffer (`buffer_shape(M, K,
# transpose=True)`: values [M, K/2], then M/8 rows of metadata), which
# `input_prune24.prune_compress_rows(layout="cusparselt")` writes in one pass
# over x, byte for byte what cusparseLtSpMMACompress2 writes (GPU test
# `test_cusparselt_input_sparse_buffer_is_cusparselts`). The same product
# gives `dx = prune(dy) @ w^T` under `grad_output="2:4"`. dw contracts over M,
# along which these masks are not 2:4: it is XLA's product, unless the operand
# is pruned along M too (tiles, `transposable=True`, or token groups,
# `weight_grad="2:4"`: the sections below).


def compress_input(xm: jax.Array) -> jax.Array:
  """cuSPARSELt's compressed form of a pruned activation `xm[M, K]` (2:4
  along K; M, K multiples of 64) as the structured B of `input_sparse_matmul`,
  by `cusparseLtSpMMACompress2`: a `buffer_shape(M, K, transpose=True)` array."""
  m, k = xm.shape
  _check_size(xm.dtype, m, k)
  return _ffi_compress(xm, buffer_shape(m, k, transpose=True), rows=k, cols=m, op=_N,
                       sparse_a=0)


def input_compress_for_product(x: jax.Array, interpret: bool | None = None) -> jax.Array:
  """`x[M, K]` (M, K multiples of 64) pruned 2:4 along K by magnitude and
  compressed for `input_sparse_matmul`: one Pallas pass, then the metadata
  write; where the kernels cannot run, XLA's pruning and
  `compress_input` (the same bytes, more passes). `interpret`: None,
  `pallas.interpreting()`."""
  m, k = x.shape
  _check_aligned(m, k)
  if _xla_fallback():
    return compress_input(jnp.where(prune_24(x, axis=-1), x, jnp.zeros((), x.dtype)))
  if interpret is None:
    interpret = pallas_backend.interpreting()
  buf, codes = pallas_backend.kernels().input_prune24.prune_compress_rows(
      x, layout="cusparselt", interpret=interpret)
  return _with_metadata(buf, m, codes, k // 4, interpret=interpret)


def _padded_rows(a: jax.Array) -> jax.Array:
  """`a` with rows of zeros to a multiple of ALIGN_KN rows (zeros prune to
  zeros, and the products' rows beyond `a`'s are dropped)."""
  pad = -a.shape[0] % ALIGN_KN
  return jnp.pad(a, ((0, pad), (0, 0))) if pad else a


@functools.cache
def _input_sparse_local(search: int, alg: int, interpret: bool):
  """The per-device `fn(x[M, K], w[K, N]) -> prune(x) @ w` (w in x's dtype):
  M padded with zero rows to a multiple of 64 (zeros prune to zeros)."""

  def run(x, w):
    m, k = x.shape
    n = w.shape[1]
    xp = _padded_rows(x)
    mp = xp.shape[0]
    _check_size(x.dtype, mp, k)
    buf = input_compress_for_product(xp, interpret)
    # Column-major D[N, Mp] = A[N, K] (w) @ B[K, Mp] (the pruned x^T): the
    # row-major y.
    y = _sparse_b_matmul(w, buf, (mp, n), m=n, n=mp, k=k, search=search, alg=alg)
    return y[:m] if mp != m else y

  return run


def input_sparse_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """`prune_24(x, axis=-1) * x @ w` for `x[M, K]` and `w[K, N]` of one 16-bit
  dtype (K and N multiples of 64, any M), on the sparse tensor cores, float32
  accumulation, in x's dtype; under `jit` with x's rows sharded each device
  prunes and multiplies its own rows (the weight whole on each)."""
  fn = _input_sparse_local(*_search_attrs(x.dtype), pallas_backend.interpreting())
  return rows_parallel(fn, x, w)


# --- 2:4 activations on 4x4 tiles (transposable=True) ----------------------------
#
# An activation a[M, C] (M padded with zero rows to a multiple of 64) is pruned
# and compressed as a transposable weight [M, C] is, by the same Pallas pass
# (`prune24.prune_compress(transposable=True)`, both copies). The copy
# compressed along C has the layout of the input product's structured B above
# (a weight's backward buffer: values [M, C/2], then M/8 rows of metadata),
# so `y = prune(a) @ b` is that product. The copy compressed along M is a
# weight's forward buffer: cuSPARSELt's structured A, the column-major C x M
# matrix, 2:4 along M, for the weight gradients contracted over M, as the MVUE
# weight gradient's A is. Tiles are 4 consecutive rows of each device's block:
# the whole array's tiles where each device holds a multiple of 4 rows.


def tiles_compress_for_products(a: jax.Array, interpret: bool | None = None,
                                along_m_rows: int | None = None):
  """`a[M, C]` (M, C multiples of 64) pruned by the transposable rule on
  4x4 tiles and compressed for cuSPARSELt: `(along_m, along_c, codes)`,
  the buffers of a transposable `[M, C]` weight (`buffer_shape(M, C,
  transpose=False)` and `transpose=True`) and the tile mask's codes along
  C, `uint8[M, C/8]` (`Mask24` codes of the mask as a `[C, M]` weight's:
  `kept_tile_mask`). One Pallas pass, then the metadata writes; where the
  kernels cannot run, `compress_for_products_xla`. `along_m_rows`:
  `along_m` is `[along_m_rows, C]`, its buffer in the leading rows
  (`tiles_times_keeping`). Callers run it under `jit`, which drops the
  outputs they leave unused (the kernel writes the codes anyway)."""
  m, c = a.shape
  _check_aligned(m, c)
  if _xla_fallback():
    along_m, along_c, meta = compress_for_products_xla(a, None, True)
    if along_m_rows is not None:
      along_m = jnp.pad(along_m, ((0, along_m_rows - along_m.shape[0]), (0, 0)))
    mask = Mask24.from_meta(meta, (m, c), transposable=True).unpack()
    return along_m, along_c, Mask24.pack(mask.T).packed
  if interpret is None:
    interpret = pallas_backend.interpreting()
  values, meta, values_t, meta_t = pallas_backend.kernels().prune24.prune_compress(
      a, transposable=True, layout="cusparselt", interpret=interpret, values_rows=along_m_rows)
  return (_with_metadata(values, m // 2, meta, m // 4, interpret=interpret),
          _with_metadata(values_t, m, meta_t, c // 4, interpret=interpret), meta_t)


def tokens_compress_for_product(a: jax.Array, interpret: bool | None = None) -> jax.Array:
  """`a[M, C]` (M, C multiples of 64) pruned 2:4 along M by magnitude (groups
  of 4 consecutive rows: `weight_grad="2:4"`'s groups where `a`'s rows are
  in `token_groups` order) and compressed for cuSPARSELt as a `[M, C]`
  weight's forward buffer (`buffer_shape(M, C, transpose=False)`): the
  weights' prune + compress kernel, then the metadata write; where the
  kernels cannot run, `compress_for_products_xla`. Like
  `tiles_compress_for_products`, it calls the kernel itself, not
  `compress_for_products` (whose `columns_parallel` splits a weight over
  devices): it runs inside each device's product, with `interpret` passed
  in as `input_compress_for_product` takes it."""
  m, c = a.shape
  _check_aligned(m, c)
  if _xla_fallback():
    return compress_for_products_xla(a, None, False)[0]
  if interpret is None:
    interpret = pallas_backend.interpreting()
  values, meta, _, _ = pallas_backend.kernels().prune24.prune_compress(
      a, layout="cusparselt", interpret=interpret)
  return _with_metadata(values, m // 2, meta, m // 4, interpret=interpret)


# The tokens' groups of weight_grad="2:4" lie inside the rows padded to 64.
assert ALIGN_KN % TOKEN_BLOCK == 0


# Where a tile-pruned operand a[M, C] feeds both its products in one step (the
# forward and dw of a pruned input; dx and dw of a pruned output gradient), the
# pass that writes both copies runs once: `tiles_times_keeping` returns, beside
# prune(a) @ b, `kept`, an a-shaped array whose leading rows hold each device's
# copy along M (for its rows padded to 64: 9/16 of them), and the tile mask's
# codes along C. a-shaped, so that the row-partitioned wrappers carry it as
# they carry the activation it stands for; `pruned_weight_grad(...,
# rule="kept")` takes it. The copy fits where a device holds at least
# KEEP_MIN_ROWS rows (`jsparse24._input_sparse`). cuSPARSELt's call takes a
# buffer of exactly its bytes, so the weight gradient reads a slice of `kept`
# (a copy of 9/16 of it): still less than the pass it replaces, which read
# the operand, wrote both copies and found the mask again.


@functools.cache
def _tiles_times_local(search: int, alg: int, interpret: bool, keep: bool = False):
  """The per-device `fn(a[M, C], b[C, N]) -> prune_tiles(a) @ b`; with
  `keep`, `(that, kept [M, C], codes uint8[M, C/8])` (`tiles_times_keeping`)."""

  def run(a, b):
    m, c = a.shape
    ap = _padded_rows(a)
    mp = ap.shape[0]
    _check_size(a.dtype, mp, c)
    kept_rows = buffer_shape(mp, c, transpose=False)[0]  # the copy along M
    if keep and kept_rows > m:
      raise ValueError(f"tiles_times_keeping: {m} rows on a device hold no copy of"
                       f" {kept_rows} rows; it needs at least {KEEP_MIN_ROWS}.")
    along_m, along_c, codes = tiles_compress_for_products(
        ap, interpret, along_m_rows=m if keep else None)
    y = _sparse_b_matmul(b, along_c, (mp, b.shape[1]), m=b.shape[1], n=mp, k=c,
                         search=search, alg=alg)
    y = y[:m] if mp != m else y
    return (y, along_m, codes[:m]) if keep else y

  return run


def tiles_times_keeping(a: jax.Array, b: jax.Array):
  """`(prune_tiles(a) @ b, kept, codes)` for `a[M, C]`, `b[C, N]` of one
  16-bit dtype (C and N multiples of 64, at least `KEEP_MIN_ROWS` rows of a
  on each device): the product of `pruned_matmul(a, b, True)`, `kept` the
  copy of the pruned `a` compressed along M in the leading rows of an
  a-shaped array (per device), for `pruned_weight_grad(..., rule="kept")`,
  and `codes` the tile mask's (`kept_tile_mask`)."""
  fn = _tiles_times_local(*_search_attrs(a.dtype), pallas_backend.interpreting(), True)
  return rows_parallel(fn, a, b, outputs=3)


def kept_tile_mask(codes: jax.Array) -> jax.Array:
  """The bool `[M, C]` tile mask of `tiles_times_keeping`'s `codes`
  (`uint8[M, C/8]`): elementwise, so XLA fuses it into its consumer."""
  m, c = codes.shape[0], codes.shape[1] * 8
  return Mask24.from_meta(codes, (c, m)).unpack().T


@functools.cache
def _pruned_weight_grad_local(pruned: str, rule: str, search: int, alg: int, interpret: bool):
  """The per-device `fn(x[M, K], dy[M, N], ...) -> [K, N]` of
  `rows_contracted`: `prune(x)^T @ dy` (`pruned="x"`) or `x^T @ prune(dy)`
  (`pruned="dy"`), pruned on tiles (`rule="tiles"`) or along M
  (`"tokens"`), or the pruned operand `tiles_times_keeping`'s `kept`
  (`"kept"`), the pruned operand cuSPARSELt's structured A (compressed
  along M), the other the dense B read transposed; in x's dtype, as
  `_mvue_weight_grad_local`'s (it says why)."""

  def run(x, dy, first_row, first_col, n_total):
    del first_row, first_col, n_total  # each device's own tiles and columns
    sparse, dense = (x, dy) if pruned == "x" else (dy, x)
    rows, cols = sparse.shape[1], dense.shape[1]
    dense = _padded_rows(dense)
    mp = dense.shape[0]
    _check_size(x.dtype, mp, rows)
    if rule == "kept":
      along_m = sparse[:buffer_shape(mp, rows, transpose=False)[0]]
    elif rule == "tiles":
      along_m = tiles_compress_for_products(_padded_rows(sparse), interpret)[0]
    else:  # each group of 4 tokens 4 consecutive rows of both operands
      dense = token_groups(dense)
      along_m = tokens_compress_for_product(token_groups(_padded_rows(sparse)), interpret)
    # Column-major D[rows, cols] = A[rows, Mp] (structured, op N) @
    # op_T(B)[Mp, cols]: the row-major [cols, rows] array.
    d = _sparse_a_matmul(along_m, dense, (cols, rows), m=rows, n=cols, k=mp, op_a=_N,
                         op_b=_T, search=search, alg=alg)
    return (d.T if pruned == "x" else d).astype(x.dtype)

  return run


def pruned_matmul(a: jax.Array, b: jax.Array, transposable: bool) -> jax.Array:
  """`prune(a) @ b` for `a[M, C]`, `b[C, N]` of one 16-bit dtype (C and N
  multiples of 64, any M) on the sparse tensor cores: `a` pruned on 4x4
  tiles where `transposable`, else along C (`input_sparse_matmul`)."""
  if not transposable:
    return input_sparse_matmul(a, b)
  fn = _tiles_times_local(*_search_attrs(a.dtype), pallas_backend.interpreting())
  return rows_parallel(fn, a, b)


def pruned_weight_grad(x: jax.Array, dy: jax.Array, pruned: str, rule: str) -> jax.Array:
  """`prune(x)^T @ dy` (`pruned="x"`) or `x^T @ prune(dy)` (`pruned="dy"`),
  the operand pruned on 4x4 tiles (`rule="tiles"`) or 2:4 along M
  (`"tokens"`), or given as `tiles_times_keeping`'s `kept` (`"kept"`),
  `[K, N]` in x's dtype, on the sparse tensor cores (x
  `[M, K]`, dy `[M, N]`, K and N multiples of 64, any M); under `jit` with
  the rows sharded, each device multiplies its own rows and the partial
  sums are all-reduced."""
  fn = _pruned_weight_grad_local(pruned, rule, *_search_attrs(x.dtype),
                                 pallas_backend.interpreting())
  return rows_contracted(fn, x, dy, align=ALIGN_KN)


SPARSE_PRODUCTS = SparseProducts(pruned_matmul, pruned_weight_grad, tiles_times_keeping,
                                 kept_tile_mask)


@dataclasses.dataclass(frozen=True)
class Operand:
  """What the forward pass builds once and the backward pass reuses (the
  residual of `sparse_dot` on this backend: the two buffers and the mask)."""

  fwd: jax.Array  # buffer_shape(K, N, transpose=False): 2:4 along K
  bwd: jax.Array | None  # buffer_shape(K, N, transpose=True) (transposable masks)
  meta: jax.Array  # the mask, packed codes uint8[N, K/8] (Mask24 layout)
  shape: tuple[int, int]  # (K, N), static


jax.tree_util.register_dataclass(Operand, data_fields=["fwd", "bwd", "meta"],
                                 meta_fields=["shape"])


class CusparseltBackend(Backend):
  name = "cusparselt"
  no_sparse24_reason = (
      "jsparse24.compress returns the portable Sparse24 format, which the 'xla'"
      " and 'pallas' backends build; cuSPARSELt's compressed layout is opaque"
      " and is built inside sparse_dot(..., implementation='cusparselt')")

  def unavailable_reason(self) -> str | None:
    return pallas_backend.gpu_unavailable_reason() or _load_or_reason()[1]

  def check_supported(self, problem: Problem) -> None:
    if problem.dtype not in _DTYPE_CODES:
      raise NotImplementedError(
          f"dtype {problem.dtype}: cuSPARSELt's 2:4 products take bfloat16 or float16"
          f" (its float32 mode is 1:2 sparsity on TF32, which 2:4 masks do not fit)")
    if problem.k % ALIGN_KN or problem.n % ALIGN_KN:
      raise NotImplementedError(
          f"K={problem.k}, N={problem.n}: the cusparselt backend needs K and N"
          f" multiples of {ALIGN_KN}")

  def prefers(self, problem: Problem) -> bool:
    if problem.input_sparse:
      # Named explicitly only. With input_sparsity only the forward product
      # is sparse, and the layer's step (y, dx, dw) measured 1.02-1.055x as
      # fast as the same step on XLA's masked products over M = 4096-16384,
      # K, N = 4096-16384 (bf16, H200): short of AUTO_MARGIN at all but one
      # point, with the process's dense products slowed once a sparse MMA has
      # run (benchmarks/results/nvidia-h200.md, "2:4 activations: the layer
      # against XLA's masked product, the block with its input's gradient").
      # grad_output="2:4" adds one sparse product (dx): the feed-forward
      # block with both measured 1.025x of dense ("2:4 activations: the up
      # projection's dx from its 2:4 output gradient; ...", 2026-12-03).
      return False
    i, j = grid_index(problem.k, AUTO_GRID), grid_index(problem.n, AUTO_GRID)
    if problem.dtype != jnp.dtype(jnp.bfloat16) or i is None or j is None:
      return False
    if problem.cusparselt_layout:
      min_m = AUTO_MIN_M_CUSPARSELT_LAYOUT[i][j]
    elif problem.compressed:
      gpu = pallas_backend._gpu_kind()  # pylint: disable=protected-access
      min_m = AUTO_MIN_M_COMPRESSED_BY_GPU.get(gpu, {}).get(
          (AUTO_GRID[i], AUTO_GRID[j]), AUTO_MIN_M_COMPRESSED[i][j])
    else:
      min_m = AUTO_MIN_M[problem.transposable][i][j]
    return min_m is not None and problem.m >= min_m

  def prepare(self, w, mask, transposable):
    fwd, bwd, meta = compress_for_products(jax.lax.stop_gradient(w), mask, transposable)
    return Operand(fwd, bwd, meta, tuple(w.shape))

  def forward(self, x, operand: Operand, precision):
    del precision  # cuSPARSELt accumulates in float32
    k, n = operand.shape
    return matmul(x, operand.fwd, k=k, n=n)

  def backward_dx(self, dy, operand: Operand, precision):
    k, n = operand.shape
    if operand.bwd is not None:
      return matmul(dy, operand.bwd, k=k, n=n, transpose=True)
    # The forward buffer's values ([K/2, N]) are Sparse24's values transposed.
    sp = Sparse24(operand.fwd[:k // 2].T, operand.meta)
    return xla_matmul(dy, decompress(sp).T, precision)

  def mask_grad(self, dw, operand: Operand):
    mask = Mask24(operand.meta, operand.shape).unpack()
    return jnp.where(mask, dw, jnp.zeros((), dw.dtype))

  def operand_roles(self, operand: Operand):
    # A weight block's buffers are cuSPARSELt's buffers of that block (the
    # metadata of a block is not a block of the whole weight's metadata):
    # read only inside the tensor-parallel maps (`backends._tensor_parallel`).
    return dataclasses.replace(operand, fwd="kn", bwd=None if operand.bwd is None else "kn",
                               meta="nk")

  def split_align(self, transposable):
    del transposable
    return ALIGN_KN, ALIGN_KN

  def mvue_weight_grad(self, x, dy, w, key, precision):
    del precision  # cuSPARSELt accumulates in float32
    return as_weight_grad(mvue_weight_grad(x, dy, key), w, x, dy)

  def dot_input_sparse(self, x, w, cfg):
    return input_sparse_product(x, w, cfg, SPARSE_PRODUCTS)

  def forward_compressed(self, x, sp: Sparse24, precision):
    del precision
    k, n = sp.shape
    if sp.cusparselt:  # the values are cuSPARSELt's buffer (`to_cusparselt_layout`)
      return matmul(x, sp.values, k=n, n=k, transpose=True)
    # The portable format, re-laid out for cuSPARSELt on every call.
    return matmul(x, forward_buffer(sp), k=k, n=n)
