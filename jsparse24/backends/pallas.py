"""The `"pallas"` backend: `pallas_kernels` (fused prune+compress, and the
matmul that reads the compressed operand and expands it on chip).

Runs on NVIDIA GPUs (sm_80+) through Pallas's Triton lowering, and anywhere in
interpret mode (`with interpret_mode(): ...`, for tests on CPU). Its operand is
a `Sparse24`: built once in the forward pass (with the transposed copy when
the mask is transposable) and reused by the backward pass for `dx`.

Transposable pruning (`mask=None` with `transposable=True`) is one fused
kernel too: the exact best of the 90 4x4 patterns per block, then both
compressed copies. The search alone (the mask only) builds
`Mask24.from_weights`'s masks on a GPU (`_pallas_runtime`), and
`rebuild_mask` the mask rebuilds.

The Triton kernels cannot use the sparse tensor cores (Triton cannot issue
`mma.sp`): they save bytes, not FLOPs, so `implementation=None` picks this
backend only for the shapes where it measured faster than dense XLA
(`AUTO_MAX_M`; for a weight already compressed, a `Sparse24` from
`compress_params`, the split-K decode kernel's sweep per GPU,
`DECODE_AUTO_MAX_M`). On Hopper, a compressed weight's product with up to 256
rows (64 on an H200) runs on the sparse tensor cores where that measured faster
(`DECODE_MMA_MAX_M`: `pallas_kernels.decode24_mma`, Pallas Mosaic GPU).

The kernels are written for Pallas's Triton lowering
(`jax.experimental.pallas.triton`, deprecated since JAX 0.11), which their
modules import. Where it cannot be imported, or where the environment sets
`JSPARSE24_DISABLE_PALLAS_TRITON=1` (`DISABLE_ENV`: simulates its removal,
or steps around a Triton bug; read once per process),
`triton_unavailable_reason()` says why, and: this backend is unavailable (in
interpret mode too), so naming it raises `BackendUnavailableError`;
`implementation=None` and the mask builders take the XLA reference; and the
cuSPARSELt backend writes its buffers with XLA code of the same bits, slower
(one `XlaFallbackWarning` per process, `warn_xla_fallback`).
"""

from __future__ import annotations

import contextlib
import functools
import types
import warnings

import jax
import jax.extend
import jax.numpy as jnp
from jax.interpreters import batching, mlir

from jsparse24 import _jax_internals
from jsparse24._format import Mask24, Sparse24, decompress
# Where the kernels run is decided below the formats (`_pallas_runtime`);
# re-exported here, the backend's public module.
from jsparse24._pallas_runtime import (DISABLE_ENV, DTYPES, gpu_unavailable_reason,  # noqa: F401
                                       interpret_mode, interpreting,
                                       triton_unavailable_reason)
from jsparse24._sharding import columns_parallel, partitioning_off, rows_parallel
from jsparse24._sharding import unpartitioned as unpartitioned_scope
from jsparse24.backends._products import matmul
from jsparse24.backends._tensor_parallel import sparse24_roles
from jsparse24.backends.base import (Backend, BackendUnavailableError, Problem,
                                     UnmeasuredChoiceWarning, XlaFallbackWarning, grid_index)
# Triton-free, as the XLA fallback needs.
from pallas_kernels.cusparselt_layout import CUSPARSELT_ALIGN

# implementation=None takes this backend only for M (rows of x) up to this:
# 0, since it measured slower than dense XLA at every shape, M = 16 included:
# benchmarks/results/nvidia-h200.md, "sparse-operand matmul bf16".
AUTO_MAX_M = 0

# A compressed weight (a `Sparse24`: `compress`, `compress_params`) multiplies
# through the decode kernel (`pallas_kernels.decode24`, split-K) for up to
# DECODE_MAX_M rows of x, through `spmm24` above: on an H100 the decode kernel
# was the faster of the two at every point measured, M = 32-256 at the four
# target shapes (nvidia-h100-80gb-hbm3.md, "Decode kernel: K steps of 128 from
# 17 to 128 rows and where N > K", 2026-11-28; not compared on an H200).
DECODE_MAX_M = 256
# implementation=None takes this backend for a compressed bfloat16 weight
# where the decode kernel measured faster than what the weight multiplies
# through otherwise: decompressed, then XLA's product (a compressed weight
# has no dense copy to fall back on). Per GPU (`jax.Device.device_kind`),
# rows K and columns N of DECODE_GRID, the rows of x for which it measured at
# least DECODE_MARGIN times as fast at every M of the sweep (1, 2, 4, ...,
# 256) between them (the margin covers the spread of one timing): an int M
# for 1 to M rows (0: never), a pair (lo, hi) for lo to hi rows, where it
# measured slower below lo. A shape between grid points takes the grid point
# below it, K or N below the grid never; a GPU or grid point not measured
# never (decompress + XLA, with an `UnmeasuredChoiceWarning`).
# H200: the sweep (nvidia-h200.md, "decode kernel sweep bf16 (2026-11-28
# 08:20 UTC)"), except where K = 2048: those cells follow a whole d_model 2048
# model ("Decode: cuDNN's attention in the prefill, and a d_model 2048
# model's products at one row", 2026-12-04), whose steps gained with the
# kernel from one row where the sweep's single points at M = 1 (15-21 us)
# had it slower; (2048, 2048) only up to 64 rows, where the kernel measured
# 0.92-1.53x of decompress + XLA from run to run ("Decode on the sparse tensor
# cores up to 64 rows"). H100: its sweep ("Decode kernel: K steps of 128 ...")
# where K and N are 4096-16384; the cells where K or N is 2048: up to 64 rows
# both decode kernels took at most 1.006x of dense XLA's time at every M of
# 1-64 ("Decode products on the sparse tensor cores: the H100's row",
# 2026-12-05; decompress + XLA takes longer than dense XLA, whose product it
# ends with), and at 64, 128 and 256 rows the kernel 1.40-4.15x as fast as
# decompress + XLA ("Decode kernel against decompress + XLA where K or N =
# 2048, 64-1024 rows", 2026-12-06; 0.50-0.94x of the dense weight's product
# from 128 rows); (4096, 2048), (16384, 2048) and (2048, 16384) by their
# sweep ("The H100's decode cells where K or N = 2048 and the other is 4096
# or 16384", 2026-12-06), where at (4096, 2048) and one row decompress + XLA
# ran as fast as the kernel (0.0128 against 0.0129 ms), as on the H200, so
# that cell starts at 2 rows. What the rows
# give a model, and why a KV cache carried through `nn.scan` must be pinned
# around a product on this kernel: docs/performance.md, "Decode".
DECODE_GRID = (2048, 4096, 8192, 16384)
DECODE_MARGIN = 1.03
DECODE_AUTO_MAX_M: dict[str, tuple[tuple[int | tuple[int, int] | None, ...], ...]] = {
    # columns N = 2048, 4096, 8192, 16384; rows K as marked
    "NVIDIA H200": ((64, 256, 256, 256),     # 2048
                    ((2, 256), 256, 256, 256),        # 4096
                    (256, 256, 256, 256),    # 8192
                    (256, 256, 256, 256)),   # 16384
    "NVIDIA H100 80GB HBM3": ((256, 256, 256, 256),      # 2048
                              ((2, 256), 256, 256, 256),  # 4096
                              (256, 256, 256, 256),      # 8192
                              (256, 256, 256, 256)),     # 16384
}

# Grid points (K, N) where a GPU's measurements stopped short of
# DECODE_MAX_M rows: above these rows the cell decides nothing, and a
# product there decompresses with an `UnmeasuredChoiceWarning` as where no
# cell was measured. Empty while every GPU's measured cells reach
# DECODE_MAX_M rows.
DECODE_SWEPT_M: dict[str, dict[tuple[int, int], int]] = {}


# On Hopper, for the rows of x DECODE_MMA_MAX_M gives, a compressed weight
# multiplies on the sparse tensor cores instead (`pallas_kernels.decode24_mma`:
# Pallas Mosaic GPU, `mma.sp`, the same arrays read in place; up to 256 rows, K
# a multiple of 1024, N of 8, 16-bit dtypes, `decode24_mma.unsupported_reason`).
# Per GPU, cells as DECODE_AUTO_MAX_M's (None: not measured, the Triton
# kernel), each within DECODE_AUTO_MAX_M's cell. H200: every cell, as far as
# its DECODE_AUTO_MAX_M cell reaches: by GPU time, which a busy decode step
# pays, the kernel beat the Triton one at every measured point up to 64 rows,
# 1.25-1.62x (nvidia-h200.md, "Decode products: GPU time against wall time",
# 2026-12-04), and the whole decode steps gained with it ("Decode: GPT-style
# decoder with a KV cache", 2026-12-05); 65-128 rows not measured on an H200
# (the Triton kernel). H100: `tune_decode.py --mma`'s rows by GPU time, every
# cell swept from 1 to 256 rows (nvidia-h100-80gb-hbm3.md: "Decode products
# on the sparse tensor cores: the H100's row", 2026-12-05; "Decode on the
# sparse tensor cores from 65 to 128 rows", "... from 129 to 256 rows", "The
# H100's decode cells where K or N = 2048 and the other is 4096 or 16384" and
# "The H100's last decode cells on the sparse tensor cores", 2026-12-06). The
# kernel takes each cell as far as its DECODE_AUTO_MAX_M cell reaches, but
# - K = 4096, N = 8192-16383 below 32 rows (the Triton kernel): at 4096 x
#   12288, a d_model 4096 model's qkv, it took 1.02-1.11x the Triton kernel's
#   GPU time at 1-16 rows (at 4096 x 8192 0.83-0.89x; a cell holds one run
#   of rows);
# - K = 2048, N = 4096-8191 past 192 rows: at 2048 x 6144 and 256 rows it
#   took 1.04x the Triton kernel's time. That cell takes it at 17-32 rows
#   though it took 1.12x there: one run of rows per cell, and 64-128 rows
#   gain more (the Triton kernel at 0.71-0.99x of dense there, this one
#   0.91-1.38x).
# Elsewhere it took at most 1.02x the Triton kernel's GPU time. From 65 to 128
# rows it ran at 1.07-1.63x of dense XLA's GPU time (2048 x 6144: 0.91-1.33x;
# the Triton kernel 0.68-1.09x); from 129 to 256 rows (passes of 128 rows of
# x, each reading W again) at 0.44-0.96x, the Triton kernel at 0.32-0.92x:
# both slower than dense XLA there.
DECODE_MMA_MAX_M: dict[str, tuple[tuple[int | tuple[int, int] | None, ...], ...]] = {
    # columns N = 2048, 4096, 8192, 16384; rows K as marked
    "NVIDIA H200": ((64, 64, 64, 64),        # 2048
                    ((2, 64), 64, 64, 64),   # 4096
                    (64, 64, 64, 64),        # 8192
                    (64, 64, 64, 64)),       # 16384
    "NVIDIA H100 80GB HBM3": ((256, 192, 256, 256),        # 2048
                              ((2, 256), 256, (32, 256), 256),  # 4096
                              (256, 256, 256, 256),         # 8192
                              (256, 256, 256, 256)),        # 16384
}


def _gpu_kind() -> str:
  """The GPU whose row of the per-GPU tables (`DECODE_AUTO_MAX_M`,
  `DECODE_MMA_MAX_M`) applies."""
  return jax.devices()[0].device_kind


def _decode_cell(k: int, n: int, tables=DECODE_AUTO_MAX_M):
  """This GPU's cell of `tables` (`DECODE_AUTO_MAX_M` or `DECODE_MMA_MAX_M`,
  by GPU kind) for a `[K, N]` weight: 0 below the grid, None where the GPU
  or the cell was not measured."""
  table = tables.get(_gpu_kind())
  if table is None:
    return None
  i, j = grid_index(k, DECODE_GRID), grid_index(n, DECODE_GRID)
  return 0 if i is None or j is None else table[i][j]


def _grid_point(k: int, n: int) -> tuple[int, int]:
  """The DECODE_GRID point whose cell a `[K, N]` weight on the grid takes."""
  return tuple(DECODE_GRID[grid_index(size, DECODE_GRID)] for size in (k, n))


def _cell_rows(cell) -> tuple[int, int]:
  """A table cell's fewest and most rows (`(1, 0)`: none)."""
  if cell is None:
    return 1, 0
  return (1, cell) if isinstance(cell, int) else cell


def decode_auto_rows(k: int, n: int) -> tuple[int, int]:
  """The fewest and the most rows of x for which `implementation=None`
  multiplies a compressed `[K, N]` weight with the decode kernel on this GPU
  (`(1, 0)`: never)."""
  return _cell_rows(_decode_cell(k, n))


def warn_if_unmeasured(m: int, k: int, n: int, dtype) -> None:
  """Warns where `implementation=None` has just multiplied a compressed
  `[K, N]` weight decompressed (decompress + XLA: the whole weight written
  out dense in every call: 0.2-0.4x of the dense weight's own product at one
  row on most of the H200's shapes, 2026-12-04) only because
  `DECODE_AUTO_MAX_M` has no measurement for this GPU, dtype or grid point,
  while the decode kernel could run the product."""
  dtype = jnp.dtype(dtype)
  if (jax.default_backend() != "gpu" or m > DECODE_MAX_M
      or dtype not in (jnp.bfloat16, jnp.float16)):
    return
  kind, cell = _gpu_kind(), _decode_cell(k, n)
  if kind not in DECODE_AUTO_MAX_M:
    what = f"jsparse24.backends.pallas.DECODE_AUTO_MAX_M has no row for this GPU ({kind!r})"
  elif dtype != jnp.bfloat16:
    what = f"the decode kernel was measured on this GPU ({kind!r}) for bfloat16 only, not {dtype}"
  elif cell is None:
    what = (f"jsparse24.backends.pallas.DECODE_AUTO_MAX_M's row for this GPU ({kind!r}) has"
            f" no measurement at its grid point (K, N) = {_grid_point(k, n)}")
  elif cell and m > (swept := DECODE_SWEPT_M.get(kind, {}).get(_grid_point(k, n), DECODE_MAX_M)):
    what = (f"the decode kernel was measured on this GPU ({kind!r}) at its grid point"
            f" (K, N) = {_grid_point(k, n)} up to {swept} rows, not {m}"
            f" (jsparse24.backends.pallas.DECODE_SWEPT_M)")
  else:
    return  # measured: the cell decided
  if PallasBackend().unavailable_reason() is not None:
    return
  _warn_unmeasured(dtype.name, what)


@functools.cache
def _warn_unmeasured(dtype: str, what: str) -> None:
  warnings.warn(
      f"jsparse24: compressed {dtype} weights (Sparse24) multiply decompressed here: {what},"
      f" so implementation=None writes each weight out dense before XLA's product, several"
      f" times slower than the dense weight at decoding's few rows. Pass"
      f" implementation='pallas' (sparse_dot, SparseDense, nnx.SparseLinear) to take the"
      f" decode kernel, or measure a row with benchmarks/sweep_decode.py.",
      UnmeasuredChoiceWarning, stacklevel=5)


@functools.cache
def warn_xla_fallback() -> None:
  """Warns, once per process, that the cuSPARSELt backend's compression runs
  as XLA code because the Pallas kernels cannot (`triton_unavailable_reason`)."""
  warnings.warn(
      f"jsparse24: {triton_unavailable_reason()}. In the 'cusparselt' backend XLA code"
      f" (or cuSPARSELt's own compress) with the same bits replaces every Pallas pass:"
      f" pruning and compressing the weights (prune24.prune_compress,"
      f" masked_compress.compress_with_meta), writing cuSPARSELt's buffers"
      f" (cusparselt_metadata, cusparselt_values), with weight_grad='mvue' pruning the"
      f" output gradient (mvue24.mvue_compress), and with input_sparsity or"
      f" grad_output pruning the activations (input_prune24). Training is correct but"
      f" slower.", XlaFallbackWarning, stacklevel=3)


def kernels() -> types.ModuleType:
  """The `pallas_kernels` package with its kernel modules imported, or
  `BackendUnavailableError` where they cannot run (`triton_unavailable_reason`).
  Imported when first used: they import Pallas's Triton lowering, which the
  XLA fallback must never import."""
  reason = triton_unavailable_reason()
  if reason is not None:
    raise BackendUnavailableError(f"jsparse24.backends.pallas: {reason}.")
  # pylint: disable=g-import-not-at-top,unused-import
  import pallas_kernels.cusparselt_metadata
  import pallas_kernels.cusparselt_values
  import pallas_kernels.decode24
  import pallas_kernels.input_prune24
  import pallas_kernels.mask_rebuild
  import pallas_kernels.masked_compress
  import pallas_kernels.mvue24
  import pallas_kernels.prune24
  import pallas_kernels.spmm24
  return pallas_kernels


@functools.cache
def _prune_fn(transposable: bool, interpret: bool, layout: str):
  prune_compress = kernels().prune24.prune_compress

  def run(w):
    outs = prune_compress(w, transposable=transposable, interpret=interpret, layout=layout)
    return outs if transposable else outs[:2]  # the transposed pair is None
  return run


@functools.cache
def _rebuild_fn(transposable: bool, interpret: bool):
  rebuild = kernels().mask_rebuild.rebuild_mask

  def run(w, old, flags):
    meta, counts = rebuild(w, old, flags, transposable=transposable, interpret=interpret)
    # One row of counts (the kernel's row tiles summed), so that a weight
    # split on K (`columns_parallel`'s k_dims) sums them over its devices.
    return meta, jnp.sum(counts, axis=0, keepdims=True)
  return run


@functools.cache
def _apply_fn(transposed: bool, interpret: bool, layout: str):
  compress_with_meta = kernels().masked_compress.compress_with_meta

  def run(w, meta):
    values, values_t, meta_t = compress_with_meta(
        w, meta, transposed=transposed, interpret=interpret, layout=layout)
    return (values, values_t, meta_t) if transposed else (values,)
  return run


def compress_arrays(w, mask, transposed: bool, layout: str = "sparse24"):
  """The compress kernels on `w` with `mask` (None: prune by magnitude; a
  bool array or a Mask24): `(values, meta, values_t, meta_t)` in `layout`
  (see `pallas_kernels.prune24`), the transposed pair None unless `transposed`.
  Under `jit` with `w` sharded on N (FSDP at rest), each device compresses
  its own columns (`_sharding.columns_parallel`): the compressed arrays are
  what gets gathered for the products, not `w`."""
  interpret = interpreting()
  w = jax.lax.stop_gradient(w)
  if mask is None:  # prune and compress in one pass (transposable: both copies)
    outs = columns_parallel(_prune_fn(transposed, interpret, layout),
                            _values_n_dims(layout, transposed, (0,)),
                            _align(layout, transposed), w)
    return tuple(outs) if transposed else (*outs, None, None)
  meta = (mask if isinstance(mask, Mask24) else Mask24.pack(mask)).meta()
  params = dict(layout=layout, interpret=interpret, lead=0, unpartitioned=partitioning_off())
  if not transposed:
    (values,) = _apply_columns(w, meta, transposed=False, **params)
    return values, meta, None, None
  values, values_t, meta_t = _compress_with_mask_p.bind(w, meta, transposed=True, **params)
  return values, meta, values_t, meta_t


def _align(layout: str, transposed: bool) -> int:
  """Columns per device of the compress kernels: whole column blocks of
  cuSPARSELt's layout, whole bytes of N-groups for the transposed copy."""
  return CUSPARSELT_ALIGN if layout == "cusparselt" else (8 if transposed else 1)


def _values_n_dims(layout: str, transposed: bool, meta_n: tuple[int, ...]) -> tuple[int, ...]:
  """`columns_parallel`'s n_dims: `values` (its N axis: 1 in cuSPARSELt's
  layout, else 0), then `meta_n`, then the transposed pair's."""
  values_n = 1 if layout == "cusparselt" else 0
  return (values_n, *meta_n, 1, 1) if transposed else (values_n, *meta_n)


def _apply_columns(w, meta, *, layout: str, interpret: bool, transposed: bool, lead: int,
                   unpartitioned: bool) -> list:
  """The stored-mask compress kernel on each device's columns of `w`:
  `[values]`, or `[values, values_t, meta_t]` with `transposed` (`lead`:
  leading stack axes of `w`, `meta` and the results; `unpartitioned`: as
  `_sharding.unpartitioned` was where the caller traced it, for the
  lowering rule, which traces this again)."""
  with unpartitioned_scope() if unpartitioned else contextlib.nullcontext():
    outs = columns_parallel(_apply_fn(transposed, interpret, layout),
                            _values_n_dims(layout, transposed, ()), _align(layout, transposed),
                            w, meta, lead=lead)
  return list(outs)


# The compression with a transposable stored mask as a primitive, for one
# reason: its dead-code rule. The fused kernel writes both copies in one
# pass, which is what a training step needs where the backward pass keeps
# the transposed copy (for dx). Under remat (`jax.checkpoint`, `nn.remat`
# with a policy that does not save the compressed operand, such as
# `nothing_saveable`) the forward pass throws the transposed copy away and
# the backward pass compresses again; JAX's dead-code elimination then
# leaves this primitive with only `values` used, and the rule swaps it for
# the plain kernel (0.26 against 0.44 ms for a 16384^2 bf16 weight in
# cuSPARSELt's layout on an H200, benchmarks/results/nvidia-h200.md,
# "prune+compress 16384x16384 bf16"; per step: `jsparse24._jax_internals`).
# A `pallas_call` cannot be narrowed that way: its outputs are one kernel's,
# and JAX keeps the call whole.
_compress_with_mask_p = jax.extend.core.Primitive("jsparse24_compress_with_mask")
_compress_with_mask_p.multiple_results = True
_compress_with_mask_p.def_impl(_apply_columns)


def _compress_with_mask_abstract_eval(w, meta, **params):
  return [jax.core.ShapedArray(o.shape, o.dtype, sharding=o.sharding)
          for o in jax.eval_shape(functools.partial(_apply_columns, **params), w, meta)]


def _compress_with_mask_dce(used_outs, eqn):
  """Only `values` used: the plain kernel; nothing used: gone."""
  if not any(used_outs):
    return [False, False], None
  if eqn.params["transposed"] and not any(used_outs[1:]):
    params = dict(eqn.params, transposed=False)
    return [True, True], jax.extend.core.new_jaxpr_eqn(
        eqn.invars, eqn.outvars[:1], _compress_with_mask_p, params, eqn.effects,
        eqn.source_info, eqn.ctx)
  return [True, True], eqn


def _compress_with_mask_batch(args, dims, *, lead, **params):
  """vmap: one more leading stack axis (the primitive, and its dead-code
  rule, stay)."""
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
  w, meta = (jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
             for a, d in zip(args, dims))
  outs = _compress_with_mask_p.bind(w, meta, lead=lead + 1, **params)
  return outs, [0] * len(outs)


_compress_with_mask_p.def_abstract_eval(_compress_with_mask_abstract_eval)
_jax_internals.register_dce_rule(_compress_with_mask_p, _compress_with_mask_dce)
batching.primitive_batchers[_compress_with_mask_p] = _compress_with_mask_batch
mlir.register_lowering(_compress_with_mask_p,
                       mlir.lower_fun(_apply_columns, multiple_results=True))
# Its lowering holds `columns_parallel`'s custom_partitioning.
_jax_internals.requires_devices_during_lowering(_compress_with_mask_p)


def rebuild_mask(w: jax.Array, old: Mask24, rebuild: jax.Array) -> tuple[Mask24, jax.Array]:
  """`(mask, flips)`: `Mask24.from_weights(w, transposable=old.transposable)`
  if `rebuild` (a bool scalar, traced or not), else `old`, by one kernel call
  without a conditional (`mask_rebuild.rebuild_mask`: a program not asked to
  rebuild copies its block of `old`); `flips`, float32 of the stack's shape,
  the fraction of weights whose kept/pruned state the rebuild changed
  (`optim.flip_fraction(old, mask)`; 0 where nothing is rebuilt), counted
  by the kernel as it writes the mask. Any leading axes (a stack of layers,
  `old` stacked alike); under `jit` with `w` sharded on N or K (in whole
  bytes of the mask) each device handles its own block."""
  k, n = old.dims
  lead = w.ndim - 2
  flags = jnp.broadcast_to(jnp.asarray(rebuild).astype(jnp.int32), w.shape[:-2] + (n,))
  # The stack's axes go to one call (a larger grid): vmapped outside the
  # partitioned call, each layer's float32 kernel was sliced out of the
  # stack (a copy) every step.
  meta, counts = columns_parallel(_rebuild_fn(old.transposable, interpreting()), (0, 1), 8,
                                  jax.lax.stop_gradient(w), old.meta(), flags, lead=lead,
                                  k_dims=(1, "sum"), extra_k_dims=(1, None))
  flips = jnp.sum(counts, axis=(-2, -1)).astype(jnp.float32) / (k * n)
  if (k // 4) % 2 == 0:  # the packed mask is the metadata itself: no re-packing pass
    return Mask24(meta, (k, n), transposable=old.transposable), flips
  return Mask24.from_meta(meta, w.shape, transposable=old.transposable), flips


@functools.cache
def _spmm(k: int, interpret: bool):
  """The per-device product `x[M, K] @ W` from `W`'s values and metadata."""
  return functools.partial(kernels().spmm24.sparse_matmul, k=k, interpret=interpret)


@functools.cache
def _decode(k: int, interpret: bool):
  """The per-device product for few rows of x (`decode24`)."""
  return functools.partial(kernels().decode24.decode_matmul, k=k, interpret=interpret)


@functools.cache
def _decode_mma(k: int):
  """The per-device product on the sparse tensor cores (`decode24_mma`)."""
  return functools.partial(_mma_kernel().decode_matmul, k=k)


def _mma_kernel() -> types.ModuleType:
  """`pallas_kernels.decode24_mma`, imported when first used (it imports
  Pallas Mosaic GPU)."""
  # pylint: disable-next=g-import-not-at-top
  import pallas_kernels.decode24_mma
  return pallas_kernels.decode24_mma


def mma_takes(m: int, k: int, n: int, dtype) -> bool:
  """Whether a compressed `[K, N]` weight's product with `m` rows runs on
  the sparse tensor cores (`decode24_mma`) here: a Hopper GPU whose
  DECODE_MMA_MAX_M cell holds `m` rows, and a shape the kernel takes."""
  if interpreting() or jax.default_backend() != "gpu":
    return False
  lo, hi = _cell_rows(_decode_cell(k, n, DECODE_MMA_MAX_M))
  if not lo <= m <= hi:
    return False
  if getattr(jax.devices()[0], "compute_capability", "9.0").split(".")[0] != "9":
    return False
  try:
    kernel = _mma_kernel()
  except ImportError as e:
    _warn_no_mma(f"{type(e).__name__}: {e}")
    return False
  return kernel.unsupported_reason(m, k, n, dtype) is None


@functools.cache
def _warn_no_mma(why: str) -> None:
  warnings.warn(
      f"jsparse24: the sparse-tensor-core decode kernel (pallas_kernels.decode24_mma) cannot be"
      f" imported with this jax ({why}); compressed weights multiply on the Triton decode"
      f" kernel, which took 0.97-1.77x as long at 1-64 rows on an H200's large shapes."
      f" Use the jax versions pyproject.toml names.", XlaFallbackWarning, stacklevel=4)


class PallasBackend(Backend):
  name = "pallas"

  def unavailable_reason(self) -> str | None:
    # Checked first, in interpret mode too: without the Triton lowering the
    # kernel modules cannot even be imported.
    reason = triton_unavailable_reason()
    if reason is not None:
      return reason
    return None if interpreting() else gpu_unavailable_reason(
        "; on CPU, tests can run it inside jsparse24.backends.pallas.interpret_mode()")

  def check_supported(self, problem: Problem) -> None:
    if problem.input_sparse:
      raise NotImplementedError(
          "2:4 activations (input_sparsity, grad_output) run on the 'xla' and"
          " 'cusparselt' backends; the Pallas backend has no product with an"
          " activation as the sparse operand")
    if problem.dtype not in DTYPES:
      raise NotImplementedError(
          f"dtype {problem.dtype} (supported: {', '.join(jnp.dtype(d).name for d in DTYPES)})")

  def prefers(self, problem: Problem) -> bool:
    if interpreting():
      return False
    if problem.compressed:
      # Only bfloat16 was swept (DECODE_AUTO_MAX_M); elsewhere dense XLA.
      lo, hi = decode_auto_rows(problem.k, problem.n)
      return problem.dtype == jnp.bfloat16 and lo <= problem.m <= hi
    return problem.m <= AUTO_MAX_M and problem.dtype in (jnp.bfloat16, jnp.float16)

  def prepare(self, w, mask, transposable):
    return self.compress(w, mask, transposable)

  def compress(self, w, mask, transposed):
    return Sparse24(*compress_arrays(w, mask, transposed))

  def forward(self, x, operand: Sparse24, precision):
    del precision
    # Partitioned over M under jit with sharded activations (_sharding).
    return rows_parallel(_spmm(operand.shape[0], interpreting()), x, operand.kept_values,
                         operand.meta)

  def backward_dx(self, dy, operand: Sparse24, precision):
    if operand.has_transpose:
      return self.forward(dy, operand.transpose(), precision)
    return matmul(dy, decompress(operand).T, precision)

  def mask_grad(self, dw, operand: Sparse24):
    return jnp.where(operand.mask(), dw, jnp.zeros((), dw.dtype))

  def operand_roles(self, operand: Sparse24):
    # values and meta are [N, K/2] and [N, K/8]; the transposed pair [K, ...].
    return sparse24_roles(operand)

  def split_align(self, transposable):
    # Whole bytes of packed codes along K (two 4-groups per byte), and along
    # N for the transposed copy's codes.
    return 8, (8 if transposable else 1)

  def forward_compressed(self, x, sp: Sparse24, precision):
    del precision
    if x.shape[0] > DECODE_MAX_M:
      return self.forward(x, sp, None)
    # Partitioned over M under jit with sharded activations (_sharding). In
    # cuSPARSELt's layout the kernels read the values' first N rows in place.
    k, n = sp.shape[-2:]
    if mma_takes(x.shape[0], k, n, x.dtype):
      return rows_parallel(_decode_mma(k), x, sp.values, sp.meta)
    return rows_parallel(_decode(k, interpreting()), x, sp.values, sp.meta)
