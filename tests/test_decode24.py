"""The decode kernels: `pallas_kernels.decode24` (Triton) interpreted on CPU
against its reference on odd shapes and compiled on a GPU at real sizes
(`gpu` marker); `decode24_mma` (Mosaic GPU, the sparse tensor cores: no CPU
interpreter) lowered for Hopper on CPU and run on the GPU; and the automatic
choice that sends a compressed weight's small-M products to them."""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import tune_decode
import jsparse24
from jsparse24.backends import pallas as pallas_backend
from jsparse24.backends.pallas import interpret_mode
from pallas_kernels import _prmt, decode24, decode24_mma, spmm24
from pallas_kernels import prune_rule as rule

_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


# The operands and the error are each one jitted program: run eagerly, every
# primitive of the compression and the reference compiled again per shape.
@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _operand(seed, m, k, n, dtype):
  """Fresh random x and a compressed weight pruned by magnitude."""
  kx, kw = jax.random.split(jax.random.key(seed))
  sp = jsparse24.compress(jax.random.normal(kw, (k, n), dtype), implementation="xla")
  return jax.random.normal(kx, (m, k), dtype), sp


@jax.jit
def _finite_and_rel_err(got, x, sp):
  ref = jnp.dot(x.astype(jnp.float32), jsparse24.decompress(sp).astype(jnp.float32),
                precision=jax.lax.Precision.HIGHEST)
  got = got.astype(jnp.float32)
  return jnp.isfinite(got).all(), jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)


def _rel_err(got, x, sp):
  finite, err = _finite_and_rel_err(got, x, sp)
  assert bool(finite)  # an unwritten element reads NaN when interpreted
  return float(err)


# Kept small: each case is interpreted on CPU. K not a multiple of the K
# tile (masked last step) nor of 8 (a padding nibble), N not of the N tile,
# M = 1, 3 and 17 (masked rows), one and several K slices; 16-bit weights
# expand by byte permutes (`_prmt`, run in `jnp` here), float32 by selects.
@pytest.mark.parametrize("m,k,n,dtype,config", [
    (1, 300, 40, jnp.float32, None),
    (1, 260, 33, jnp.bfloat16, decode24.DecodeConfig(block_n=16, splits=2)),
    (3, 388, 20, jnp.bfloat16, None),
    (3, 516, 20, jnp.float16, decode24.DecodeConfig(block_n=16, block_k=128, splits=3)),
    (17, 260, 24, jnp.float16, None),
    (17, 136, 24, jnp.float32, decode24.DecodeConfig(splits=1)),
    (3, 264, 72, jnp.bfloat16, decode24.DecodeConfig(block_n=64, splits=1)),
    # The defaults where N > K: up to 16 rows all of K per program, 17-32
    # rows two K slices (here the second ragged: K is one step of 256 and 4 more).
    (3, 136, 200, jnp.float16, None),
    (20, 260, 300, jnp.bfloat16, None),
])
def test_decode_matmul_matches_reference(m, k, n, dtype, config):
  x, sp = _operand(m * k + n, m, k, n, dtype)
  got = decode24.decode_matmul(x, sp.values, sp.meta, k=k, config=config, interpret=True)
  assert got.shape == (m, n) and got.dtype == dtype
  assert _rel_err(got, x, sp) < _TOL[dtype]
  ref = jax.jit(decode24.decode_matmul_reference, static_argnames="k")(x, sp.values, sp.meta,
                                                                     k=k)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                             rtol=_TOL[dtype] * 10, atol=_TOL[dtype] * 10 * np.sqrt(k))


@pytest.mark.parametrize("k,n", [(12, 7), (1028, 20), (16, 3)])
def test_expand_reference_is_decompress(k, n):
  _, sp = _operand(k, 1, k, n, jnp.float32)
  expand = jax.jit(decode24.expand_reference, static_argnums=2)
  assert np.array_equal(expand(sp.values, sp.meta, k), jax.jit(jsparse24.decompress)(sp))


# Every family of `DecodeConfig.default`'s tiles, on odd shapes too: up to 16
# rows narrow (K >= N, K >= 8192), wide, and (N > K) K steps of 256 in column
# blocks of 32 or 64; 17-32 rows wide, and (N > K) in one or two K slices;
# 33-64 rows K steps of 128 (N <= K and N > K); above 64 rows 128 x 128
# tiles (N <= K) and 128 x 64 (N > K).
TILE_FAMILIES = [(1, 4096, 4096), (16, 8192, 8192), (64, 4096, 16384), (3, 4100, 3000),
                 (3, 8200, 3000), (1, 3000, 4100), (1, 4096, 12288), (17, 2056, 777),
                 (24, 3000, 12300), (32, 4096, 16384), (48, 8200, 3000), (100, 1028, 3000),
                 (200, 4096, 1000), (256, 16384, 4096)]


@pytest.mark.parametrize("m,k,n", TILE_FAMILIES)
def test_default_tiles_fit_in_shared_memory(m, k, n):
  """Every family of `DecodeConfig.default`'s tiles, fitted to the shape,
  keeps its pipelined tiles within the shared memory budget, in 16-bit and
  in float32 (twice the bytes: 128 x 128 output tiles there take a narrower
  `block_n`); no GPU needed."""
  for itemsize in (2, 4):
    cfg, splits, per = decode24._plan(decode24.DecodeConfig.default(m, k, n), m, k, n, itemsize)
    smem = decode24._smem_bytes(cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages, itemsize)
    assert smem <= decode24._SMEM_BUDGET, (itemsize, cfg, smem)
    assert cfg.num_stages >= 2 and splits * per * cfg.block_k >= k


# (M, N, (block_n, splits)) where N > K: on an H200 4096 x 12288 ran at
# 1.39-1.47x of dense XLA in blocks of 32 and 1.14-1.20x in blocks of 64
# (192 blocks of 64 on 132 SMs), 4096 x 16384 fastest in blocks of 64.
@pytest.mark.parametrize("m,n,want", [(1, 12288, (32, 1)), (16, 16384, (64, 1)),
                                      (16, 6144, (64, 1)), (32, 12288, (64, 2)),
                                      (32, 16384, (64, 1))])
def test_column_blocks_balance_over_the_sms(m, n, want):
  assert decode24._balanced(m, n) == want  # pylint: disable=protected-access
  cfg = decode24.DecodeConfig.default(m, 4096, n)
  assert (cfg.block_n, cfg.splits, cfg.block_k, cfg.block_m) == (*want, 256, 16 if m <= 16 else 32)


def test_decode_matmul_reads_only_the_first_n_rows_of_values():
  """Rows after N (cuSPARSELt's metadata in its layout) are not read: NaN
  there changes nothing; fewer rows than N are refused."""
  x, sp = _operand(5, 3, 256, 72, jnp.bfloat16)
  want = decode24.decode_matmul(x, sp.values, sp.meta, k=256, interpret=True)
  tail = jnp.full((9, sp.values.shape[1]), jnp.nan, sp.values.dtype)
  got = decode24.decode_matmul(x, jnp.concatenate([sp.values, tail]), sp.meta, k=256,
                               interpret=True)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  with pytest.raises(ValueError, match=r"decode_matmul: expected values \[N or more, 128\]"):
    decode24.decode_matmul(x, sp.values[:-1], sp.meta, k=256, interpret=True)


def test_decode_matmul_rejects_bad_input():
  x, sp = _operand(0, 2, 16, 8, jnp.float32)
  with pytest.raises(ValueError, match="decode_matmul: x.shape"):
    decode24.decode_matmul(x, sp.values, sp.meta, k=12, interpret=True)
  with pytest.raises(ValueError, match="decode_matmul: expected values"):
    decode24.decode_matmul(x, sp.values, sp.meta.astype(jnp.int32), k=16, interpret=True)
  with pytest.raises(TypeError, match="must share a dtype"):
    decode24.decode_matmul(x.astype(jnp.bfloat16), sp.values, sp.meta, k=16, interpret=True)
  with pytest.raises(ValueError, match="decode_matmul: DecodeConfig.block_k must be at least 128"):
    decode24.decode_matmul(x, sp.values, sp.meta, k=16, interpret=True,
                           config=decode24.DecodeConfig(block_k=64))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_byte_permutes_expand_every_code_of_both_nibbles(dtype):
  """`_prmt.expand_group` (the PTX's selectors and permutes, in `jnp`) on
  every kept pair of 4 and the padding code, in either nibble of a byte."""
  codes = np.array([rule.group_code(*p) for p in rule.PAIRS] + [rule.PAD_CODE])
  low, high = np.meshgrid(codes, codes)
  meta = (low | high << 4).reshape(1, -1).astype(np.uint8)  # every (low, high) pair
  groups = 2 * meta.shape[1]
  values = jax.random.normal(jax.random.key(0), (1, 2 * groups), dtype)
  dense = decode24.expand_reference(values, jnp.asarray(meta), 4 * groups).T  # [1, K]
  pairs = jax.lax.bitcast_convert_type(values.reshape(1, groups, 2), jnp.uint32)
  meta32 = jnp.asarray(meta, jnp.uint32)
  for high, pair in ((False, pairs[:, 0::2]), (True, pairs[:, 1::2])):
    lanes = _prmt.expand_group(pair, meta32, high, dtype, interpret=True)
    for pos, lane in enumerate(lanes):
      want = dense[:, 4 * int(high) + pos::8]
      assert lane.dtype == dtype
      # Bit for bit: -0.0 and NaN payloads included.
      np.testing.assert_array_equal(np.asarray(lane).view(np.uint16),
                                    np.asarray(want).view(np.uint16))


def test_multi_result_inline_asm_rule_is_installed():
  """The decode kernel's PTX has 4 results: this jax's Pallas Triton lowering
  takes the rule `_prmt` registers (else GPUs fail at compile time, which
  CPU tests would not see)."""
  from jax._src.pallas.triton import lowering, primitives  # pylint: disable=g-import-not-at-top
  assert _prmt._RULE_MISSING is None  # pylint: disable=protected-access
  rule_fn = lowering.triton_lowering_rules[primitives.elementwise_inline_asm_p]
  assert getattr(rule_fn, "_jsparse24_multi_result", False)


@pytest.mark.parametrize("kernel", ["decode_matmul", "sparse_matmul"])
def test_both_sparse_operand_kernels_name_themselves_for_an_empty_k(kernel):
  # sparse_matmul used to fail inside its padded slices with a JAX slicing error.
  fn = {"decode_matmul": decode24.decode_matmul, "sparse_matmul": spmm24.sparse_matmul}[kernel]
  x = jnp.ones((2, 0), jnp.bfloat16)
  with pytest.raises(ValueError, match=f"{kernel}: .*k = 0, a positive multiple of 4"):
    fn(x, jnp.ones((3, 0), jnp.bfloat16), jnp.ones((3, 0), jnp.uint8), k=0, interpret=True)


def test_sparse_dot_on_a_sparse24_takes_the_decode_kernel():
  """`implementation="pallas"` on a compressed weight: the decode kernel up to
  DECODE_MAX_M rows, and its gradient in x through the transposed copy."""
  w = jax.random.normal(jax.random.key(1), (136, 24))
  sp = jsparse24.compress(w, transposed=True, implementation="xla")
  x = jax.random.normal(jax.random.key(2), (3, 136))
  f = lambda x: jsparse24.sparse_dot(x, sp, implementation="pallas")
  with interpret_mode():
    assert "jsparse24_decode" in str(jax.make_jaxpr(f)(x))
    last = jnp.ones((pallas_backend.DECODE_MAX_M, 136))
    assert "jsparse24_decode" in str(jax.make_jaxpr(f)(last))
    many = jnp.ones((pallas_backend.DECODE_MAX_M + 1, 136))
    assert "jsparse24_decode" not in str(jax.make_jaxpr(f)(many))
    y, vjp = jax.vjp(f, x)
    (dx,) = vjp(jnp.ones_like(y))
  assert _rel_err(y, x, sp) < 1e-5
  np.testing.assert_allclose(dx, jnp.ones_like(y) @ jsparse24.decompress(sp).T, rtol=1e-5,
                             atol=1e-5)


class _Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(2048, use_bias=False, dtype=jnp.bfloat16)(x)


@pytest.fixture
def decode_gpu(monkeypatch):
  """A GPU whose sweep took the decode kernel up to 16 rows everywhere, the
  Pallas backend counted as runnable (CPU: nothing runs, only traced)."""
  monkeypatch.setattr(pallas_backend, "_gpu_kind", lambda: "Test GPU")
  grid = len(pallas_backend.DECODE_GRID)
  monkeypatch.setitem(pallas_backend.DECODE_AUTO_MAX_M, "Test GPU", ((16,) * grid,) * grid)
  monkeypatch.setattr(pallas_backend.PallasBackend, "unavailable_reason", lambda self: None)


def test_automatic_choice_takes_the_decode_kernel_where_the_sweep_says(decode_gpu):
  del decode_gpu
  pick = lambda m, k, n, dtype=jnp.bfloat16, compressed=True: (
      jsparse24.selected_implementation((m, k), (k, n), dtype, compressed=compressed))
  assert pick(1, 4096, 4096) == "pallas"
  assert pick(16, 2048, 20000) == "pallas"  # between and above grid points: the one below
  assert pick(17, 4096, 4096) == "xla"
  assert pick(4, 1024, 4096) == "xla"  # below the grid
  assert pick(4, 4096, 4096, jnp.float32) == "xla"  # only bfloat16 was swept
  assert pick(4, 4096, 4096, compressed=False) == "xla"  # a dense weight: compressed per call


def test_a_cell_slower_at_few_rows_takes_the_kernel_from_its_first_row(monkeypatch, decode_gpu):
  """A `(lo, hi)` cell: the kernel from lo to hi rows, decompress + XLA below
  lo (where the sweep measured it faster) and above hi."""
  del decode_gpu
  grid = len(pallas_backend.DECODE_GRID)
  table = [[16] * grid for _ in range(grid)]
  table[0][1] = (2, 64)  # K 2048, N 4096
  monkeypatch.setitem(pallas_backend.DECODE_AUTO_MAX_M, "Test GPU", tuple(map(tuple, table)))
  pick = lambda m, k=2048, n=6144: jsparse24.selected_implementation(  # noqa: E731
      (m, k), (k, n), jnp.bfloat16, compressed=True)
  assert [pick(m) for m in (1, 2, 3, 64, 65)] == ["xla", "pallas", "pallas", "pallas", "xla"]
  assert pallas_backend.decode_auto_rows(2048, 6144) == (2, 64)
  assert pallas_backend.decode_auto_rows(4096, 4096) == (1, 16)
  assert pallas_backend.decode_auto_rows(1024, 4096) == (1, 0)  # below the grid: never


def test_compressed_layer_reaches_the_decode_kernel(decode_gpu):
  """`SparseDense` applied to `compress_params` output: its small-M product
  is the decode kernel's pallas_call; large M stays dense."""
  del decode_gpu
  model = jsparse24.sparsify(_Mlp(), {r".*": {"transposable": False}})
  x = jnp.ones((2, 4, 2048), jnp.bfloat16)
  v = model.init(jax.random.key(0), x)
  params = jsparse24.compress_params(v["params"], v["sparsity"])
  small = str(jax.make_jaxpr(lambda p, x: model.apply({"params": p}, x))(params, x))
  assert "jsparse24_decode" in small
  big = jnp.ones((64, 2048), jnp.bfloat16)
  large = str(jax.make_jaxpr(lambda p, x: model.apply({"params": p}, x))(params, big))
  assert "pallas_call" not in large


def test_unmeasured_gpu_stays_dense(monkeypatch):
  monkeypatch.setattr(pallas_backend, "_gpu_kind", lambda: "Unswept GPU")
  monkeypatch.setattr(pallas_backend.PallasBackend, "unavailable_reason", lambda self: None)
  assert jsparse24.selected_implementation((1, 4096), (4096, 4096), jnp.bfloat16,
                                           compressed=True) == "xla"


def _decompressed_warnings(m, dtype, implementation=None, k=256, n=128):
  """The UnmeasuredChoiceWarnings of tracing one compressed product."""
  pallas_backend._warn_unmeasured.cache_clear()  # pylint: disable=protected-access
  sp = jax.eval_shape(lambda w: jsparse24.compress(w, implementation="xla"),
                      jax.ShapeDtypeStruct((k, n), dtype))
  x = jax.ShapeDtypeStruct((m, k), dtype)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    jax.eval_shape(functools.partial(jsparse24.sparse_dot, implementation=implementation), x, sp)
  return [w for w in record if issubclass(w.category, jsparse24.backends.UnmeasuredChoiceWarning)]


def test_decompressing_for_want_of_a_measurement_warns(monkeypatch):
  """A compressed weight that the automatic choice decompresses only because
  DECODE_AUTO_MAX_M has no row for the GPU (or no measurement of the dtype,
  or a None cell) says so once, naming the GPU and the fix; a measured GPU's bfloat16, an
  explicit implementation, and rows above the decode kernel's say nothing."""
  monkeypatch.setattr(pallas_backend.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(pallas_backend.PallasBackend, "unavailable_reason", lambda self: None)
  monkeypatch.setattr(pallas_backend, "_gpu_kind", lambda: "Unswept GPU")
  (w,) = _decompressed_warnings(1, jnp.bfloat16)
  assert "'Unswept GPU'" in str(w.message) and "implementation='pallas'" in str(w.message)
  assert not _decompressed_warnings(1, jnp.bfloat16, implementation="xla")
  assert not _decompressed_warnings(pallas_backend.DECODE_MAX_M + 1, jnp.bfloat16)
  assert not _decompressed_warnings(1, jnp.float32)
  grid = len(pallas_backend.DECODE_GRID)
  monkeypatch.setattr(pallas_backend, "_gpu_kind", lambda: "Test GPU")
  monkeypatch.setitem(pallas_backend.DECODE_AUTO_MAX_M, "Test GPU", ((0,) * grid,) * grid)
  assert not _decompressed_warnings(1, jnp.bfloat16)  # below the grid: decided, never
  assert not _decompressed_warnings(1, jnp.bfloat16, k=4096, n=4096)  # measured: decompress
  (w,) = _decompressed_warnings(1, jnp.float16)
  assert "bfloat16 only, not float16" in str(w.message)
  # Once per process and case: a second product of the same kind is quiet.
  sp = jax.eval_shape(lambda w: jsparse24.compress(w, implementation="xla"),
                      jax.ShapeDtypeStruct((256, 128), jnp.float16))
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    jax.eval_shape(jsparse24.sparse_dot, jax.ShapeDtypeStruct((2, 256), jnp.float16), sp)
  assert not record
  # A row's cell that was not measured (None) is no measurement either.
  table = [[0] * grid for _ in range(grid)]
  table[0][1] = None  # K 2048, N 4096
  monkeypatch.setitem(pallas_backend.DECODE_AUTO_MAX_M, "Test GPU", tuple(map(tuple, table)))
  assert pallas_backend.decode_auto_rows(2048, 6144) == (1, 0)
  (w,) = _decompressed_warnings(1, jnp.bfloat16, k=2048, n=6144)
  assert "(K, N) = (2048, 4096)" in str(w.message)
  assert not _decompressed_warnings(1, jnp.bfloat16, k=4096, n=6144)


def test_rows_above_a_gpus_measurements_decompress_with_a_warning(monkeypatch):
  """Where a GPU's measurements of a grid point stopped short of DECODE_MAX_M
  rows (DECODE_SWEPT_M), more rows decompress with a warning that names the
  rows measured; within them the cell decides, silently."""
  monkeypatch.setattr(pallas_backend.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(pallas_backend.PallasBackend, "unavailable_reason", lambda self: None)
  monkeypatch.setattr(pallas_backend, "_gpu_kind", lambda: "Test GPU")
  grid = len(pallas_backend.DECODE_GRID)
  monkeypatch.setitem(pallas_backend.DECODE_AUTO_MAX_M, "Test GPU", ((16,) * grid,) * grid)
  monkeypatch.setitem(pallas_backend.DECODE_SWEPT_M, "Test GPU", {(2048, 4096): 32})
  assert not _decompressed_warnings(32, jnp.bfloat16, k=2048, n=6144)  # measured slower
  (w,) = _decompressed_warnings(33, jnp.bfloat16, k=2048, n=6144)
  assert "(K, N) = (2048, 4096) up to 32 rows, not 33" in str(w.message)
  assert not _decompressed_warnings(33, jnp.bfloat16, k=4096, n=4096)  # measured to 256


def test_an_h100_multiplies_a_d_model_2048_models_weights_on_the_decode_kernels(monkeypatch):
  """The H100's cells where K or N is 2048 (measured up to 256 rows): the
  products of a d_model 2048 decoder (qkv, out, up, down), and the cells
  swept with the other side 4096 or 16384, take the decode kernels from 1
  (2 at 4096 x 2048, where one row decompressed as fast) to DECODE_MAX_M
  rows, silently."""
  monkeypatch.setattr(pallas_backend.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(pallas_backend.PallasBackend, "unavailable_reason", lambda self: None)
  monkeypatch.setattr(pallas_backend, "_gpu_kind", lambda: "NVIDIA H100 80GB HBM3")
  assert pallas_backend.DECODE_MAX_M == 256
  for k, n in ((2048, 6144), (2048, 2048), (2048, 8192), (8192, 2048), (16384, 2048),
               (2048, 16384), (4096, 2048)):
    for m in (1, 2, 64, 65, 256):
      want = "xla" if (k, n, m) == (4096, 2048, 1) else "pallas"
      assert jsparse24.selected_implementation(
          (m, k), (k, n), jnp.bfloat16, compressed=True) == want, (m, k, n)
      assert not _decompressed_warnings(m, jnp.bfloat16, k=k, n=n)


def test_an_h100_multiplies_the_decoders_weights_on_the_sparse_tensor_cores_up_to_256_rows(
    monkeypatch):
  """The H100's DECODE_MMA_MAX_M row (every cell swept to 256 rows): the
  products of a d_model 2048 and 4096 decoder, and every K, N of 2048-16384,
  take `decode24_mma` from 1 row (32 for 4096 x 12288, where the Triton
  kernel was faster below) to 256 (192 for 2048 x 6144, whose 256 rows the
  Triton kernel ran faster), the Triton kernel above (and from 257 rows no
  decode kernel)."""
  monkeypatch.setattr(pallas_backend.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(pallas_backend, "_gpu_kind", lambda: "NVIDIA H100 80GB HBM3")
  takes = lambda m, k, n: pallas_backend.mma_takes(m, k, n, jnp.bfloat16)  # noqa: E731
  for k, n in ((2048, 2048), (2048, 8192), (8192, 2048), (4096, 4096), (4096, 16384),
               (16384, 4096), (16384, 2048), (2048, 16384), (8192, 4096), (8192, 8192),
               (8192, 16384), (16384, 8192), (16384, 16384), (12288, 12288)):
    assert all(takes(m, k, n) for m in (1, 16, 32, 64, 65, 100, 128, 129, 200, 256)), (k, n)
    assert not takes(257, k, n), (k, n)
  assert not takes(1, 4096, 2048) and takes(2, 4096, 2048) and takes(256, 4096, 2048)
  assert takes(192, 2048, 6144) and not takes(193, 2048, 6144)
  assert not takes(16, 4096, 12288) and takes(32, 4096, 12288) and takes(256, 4096, 12288)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", TILE_FAMILIES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_decode_matmul_on_gpu(m, k, n, dtype):
  x, sp = _operand(m + k + n, m, k, n, dtype)
  got = decode24.decode_matmul(x, sp.values, sp.meta, k=k)
  assert _rel_err(got, x, sp) < _TOL[dtype]
  y = jax.jit(lambda x, sp: jsparse24.sparse_dot(x, sp, implementation="pallas"))(x, sp)
  assert _rel_err(y, x, sp) < _TOL[dtype]


@pytest.mark.parametrize("n,k,want,step,rows", [
    (8192, 8192, (1, 128, 1), 1024, 64),  # one block per CTA, all of K
    (16384, 4096, (1, 128, 2), 1024, 64),  # two blocks per CTA
    (12288, 4096, (2, 128, 3), 1024, 64),  # K in two slices: 6 steps per CTA, not 8
    (4096, 16384, (2, 128, 1), 1024, 64),  # 64 blocks: two K slices of 8 steps
    (4096, 4096, (2, 128, 1), 1024, 64),
    (1000, 2048, (2, 32, 1), 1024, 64),  # 16 blocks (the last one short)
    (4096, 4096, (2, 128, 1), 512, 64),  # steps of 512 (past 16 rows): two slices of 4
    (264, 4096, (8, 40, 1), 512, 64),  # 5 blocks, 8 slices of one step
    (8192, 8192, (2, 128, 1), 256, 128),  # 64 blocks of 128 rows: two slices of 16 steps
    (12288, 4096, (4, 128, 3), 256, 128),  # 96 blocks: 4 slices, 12 steps a CTA, not 16
])
def test_mma_plan_deals_equal_runs_to_at_most_one_cta_per_sm(n, k, want, step, rows):
  splits, ctas, per_cta = decode24_mma.plan(n, k, 132, step, rows=rows)
  assert (splits, ctas, per_cta) == want
  blocks, steps = -(-n // rows), k // step
  assert steps % splits == 0 and ctas * per_cta == blocks * splits and ctas <= 132


def test_mma_kernel_names_what_it_cannot_take():
  reason = decode24_mma.unsupported_reason
  assert reason(16, 4096, 4104, jnp.float16) is None
  assert reason(128, 4096, 4096, jnp.bfloat16) is None
  assert reason(256, 4096, 4096, jnp.bfloat16) is None  # two passes
  assert "M = 257" in reason(257, 4096, 4096, jnp.bfloat16)
  assert "M = 0" in reason(0, 4096, 4096, jnp.bfloat16)
  assert "K = 4100" in reason(1, 4100, 4096, jnp.bfloat16)
  assert "N = 4100" in reason(1, 4096, 4100, jnp.bfloat16)
  assert "float32" in reason(1, 4096, 4096, jnp.float32)
  x, sp = _operand(0, 3, 1028, 16, jnp.bfloat16)
  with pytest.raises(ValueError, match="decode24_mma.decode_matmul: K = 1028 .* decode24"):
    decode24_mma.decode_matmul(x, sp.values, sp.meta, k=1028)


def test_mma_kernel_takes_blocks_of_128_rows_of_w_past_64_rows_on_large_weights():
  rows = decode24_mma.block_rows
  assert rows(128, 8192, 8192) == rows(65, 4096, 16384) == rows(100, 16384, 4096) == 128
  assert rows(64, 8192, 8192) == 64  # steps of 512: two stages would not fit
  assert rows(128, 4096, 12288) == rows(128, 4096, 4096) == rows(128, 2048, 8192) == 64
  x, sp = _operand(0, 64, 4096, 256, jnp.bfloat16)
  with pytest.raises(ValueError, match="decode24_mma.decode_matmul: rows = 128 .*past 64 rows"):
    decode24_mma.decode_matmul(x, sp.values, sp.meta, k=4096, rows=128)
  with pytest.raises(ValueError, match="rows = 32 rows of W per block; pass 64, 128"):
    decode24_mma.decode_matmul(x, sp.values, sp.meta, k=4096, rows=32)
  x, sp = _operand(0, 129, 4096, 256, jnp.bfloat16)
  with pytest.raises(ValueError, match="rows = 128 tune one pass of at most 128 rows of x,"
                                       " and x has 129"):
    decode24_mma.decode_matmul(x, sp.values, sp.meta, k=4096, rows=128)


@pytest.mark.parametrize("m,k,n,dtype,rows_after_n,splits,rows", [
    (1, 2048, 1000, jnp.bfloat16, 0, None, None), (9, 4096, 256, jnp.float16, 32, None, None),
    (17, 2048, 1000, jnp.bfloat16, 0, None, None), (64, 4096, 264, jnp.float16, 64, None, None),
    (65, 2048, 1000, jnp.bfloat16, 0, None, None), (128, 4096, 264, jnp.float16, 64, None, None),
    (65, 2048, 1000, jnp.bfloat16, 0, None, 128), (128, 8192, 8192, jnp.bfloat16, 0, None, None),
    (1, 4096, 4096, jnp.bfloat16, 0, 1, None), (136, 4096, 264, jnp.bfloat16, 64, None, None),
    (256, 8192, 8192, jnp.bfloat16, 0, None, None)])
def test_mma_kernel_lowers_for_hopper(m, k, n, dtype, rows_after_n, splits, rows):
  """The Mosaic GPU program builds (lowered for CUDA on the CPU: its inline
  PTX and swizzled tiles, K split four ways (1 and 9 rows), two (17) and not
  at all (64: steps of 512, the codes' 64-byte swizzle; 65 and 128: steps
  of 256, 24 and 32 rows of x a warp, the codes' 32-byte swizzle; blocks of
  128 rows of W, chosen on 8192 x 8192 and forced on a short N), a values
  buffer with rows after N, one K slice forced where the plan takes two;
  past 128 rows one kernel per 128 rows of x, the last taking the rest: 136
  as 128 + 8, 256 as 128 + 128); what it computes is checked on the GPU
  below."""
  x = jax.ShapeDtypeStruct((m, k), dtype)
  values = jax.ShapeDtypeStruct((n + rows_after_n, k // 2), dtype)
  meta = jax.ShapeDtypeStruct((n, k // 8), jnp.uint8)
  f = jax.jit(functools.partial(decode24_mma.decode_matmul, k=k, splits=splits, rows=rows))
  text = f.trace(x, values, meta).lower(lowering_platforms=("cuda",)).as_text()
  passes = [min(128, m - i) for i in range(0, m, 128)]
  assert "jsparse24_decode_mma" in text
  assert text.count("stablehlo.custom_call @mosaic_gpu") == len(passes)  # a kernel a pass
  sliced = []
  for rows_x in passes:
    # One K slice writes y itself; S slices, float32 partials [S, M, N] that XLA sums.
    slices = splits or decode24_mma.default_slices(rows_x, k, n, rows)
    assert (f"tensor<{slices}x{rows_x}x{n}xf32>" in text) == (slices > 1)
    sliced.append(slices > 1)
  assert ("stablehlo.reduce" in text) == any(sliced)
  assert (f"tensor<{m}x{n}x{jnp.dtype(dtype).name[0]}" in text)


@pytest.fixture
def mma_gpu(monkeypatch, decode_gpu):
  """`decode_gpu` on a Hopper GPU whose sweep took the sparse-tensor-core
  kernel up to 8 rows where K and N = 2048-4095 and where K = 4096 and N =
  4096-8191, 16 where K = 4096 and N >= 16384, from 17 to 64 rows where K >=
  16384 and N = 4096-8191."""
  del decode_gpu
  monkeypatch.setattr(pallas_backend.jax, "default_backend", lambda: "gpu")
  grid = len(pallas_backend.DECODE_GRID)
  table = [[None] * grid for _ in range(grid)]
  table[0][0], table[1][1], table[1][3], table[3][1] = 8, 8, 16, (17, 64)
  monkeypatch.setitem(pallas_backend.DECODE_MMA_MAX_M, "Test GPU", tuple(map(tuple, table)))


@pytest.mark.parametrize("gpu", sorted(pallas_backend.DECODE_MMA_MAX_M))
def test_mma_cells_lie_within_the_rows_the_backend_is_chosen_for(gpu):
  """`implementation=None` picks the Pallas backend for a compressed weight by
  DECODE_AUTO_MAX_M alone; a DECODE_MMA_MAX_M cell reaching past it would be
  ignored without a word."""
  cell_rows = pallas_backend._cell_rows  # pylint: disable=protected-access
  for mma_row, auto_row in zip(pallas_backend.DECODE_MMA_MAX_M[gpu],
                               pallas_backend.DECODE_AUTO_MAX_M[gpu]):
    for mma_cell, auto_cell in zip(mma_row, auto_row):
      lo, hi = cell_rows(mma_cell)
      if lo <= hi:
        auto_lo, auto_hi = cell_rows(auto_cell)
        assert auto_lo <= lo and hi <= auto_hi, (gpu, mma_cell, auto_cell)


def test_mma_kernel_takes_the_rows_and_shapes_its_sweep_measured_faster(mma_gpu):
  del mma_gpu
  takes = pallas_backend.mma_takes
  assert takes(1, 4096, 4096, jnp.bfloat16) and takes(8, 4096, 6144, jnp.float16)
  assert not takes(9, 4096, 4096, jnp.bfloat16)  # above the cell
  assert takes(16, 4096, 16384, jnp.bfloat16) and not takes(17, 4096, 16384, jnp.bfloat16)
  assert not takes(16, 16384, 4096, jnp.bfloat16)  # below a (lo, hi) cell
  assert takes(17, 16384, 4096, jnp.bfloat16) and takes(64, 16384, 4096, jnp.bfloat16)
  assert not takes(1, 8192, 8192, jnp.bfloat16)  # not measured: the Triton kernel
  assert not takes(1, 4096, 4100, jnp.bfloat16)  # a shape the kernel cannot take
  assert not takes(1, 4096, 4096, jnp.float32)
  with interpret_mode():
    assert not takes(1, 4096, 4096, jnp.bfloat16)


def test_mma_cell_takes_the_longest_run_within_the_margin():
  ms = [1, 4, 8, 16, 32, 64]
  cell = lambda mma, triton: tune_decode.mma_cell(ms, mma, triton, 1.03)  # noqa: E731
  assert cell([10] * 6, [10.2] * 6) == 64  # a tie within the margin: every row
  assert cell([10, 10, 10, 11, 10, 10], [10] * 6) == 8  # the longer run
  assert cell([11, 11, 10, 10, 10, 11], [10] * 6) == (8, 32)
  assert cell([11, 10, 11, 11, 10, 10], [10] * 6) == (32, 64)  # as long: more rows
  assert cell([11] * 6, [10] * 6) == 0


@pytest.mark.parametrize("traced", [True, False])
def test_tune_mma_row_follows_gpu_time_where_traced(traced, monkeypatch, capsys):
  # Per product: wall time says the Triton kernel is faster, GPU kernel time
  # the sparse-tensor-core one. Traced, kernel time decides (every row);
  # untraced (a CPU), wall time (no row). --one-slice: the kernel with one K
  # slice too (2048 x 2048: the plan takes two), compared by the same time.
  ran = []
  monkeypatch.setattr(tune_decode.decode24, "decode_matmul",
                      lambda x, v, mt, k: ran.append("triton") or x[:, :1])
  monkeypatch.setattr(tune_decode.decode24_mma, "decode_matmul",
                      lambda x, v, mt, k, splits=None: ran.append(
                          "mma" if splits is None else f"mma{splits}") or x[:, :1])
  monkeypatch.setattr(tune_decode, "ROTATE_BYTES", 1)  # two weights
  wall = {"dense": 10e-6, "triton": 5e-6, "mma": 6e-6, "mma1": 3e-6}
  gpu = {"dense": 10e-6, "triton": 5e-6, "mma": 4e-6, "mma1": 5e-6}

  def times(point, product, operands, kernel=False):
    del ran[:]
    product(point.xs[0], operands[0])
    name = ran[0] if ran else "dense"
    return wall[name], gpu[name] if traced and kernel else None

  monkeypatch.setattr(tune_decode.Point, "times", times)
  # GPU time from the first round.
  tune_decode.mma(1e12, [(2048, 2048)], [1, 2], repeat=2, one_slice=True)
  out = capsys.readouterr().out
  row = out[out.index("DECODE_MMA_MAX_M row"):].splitlines()[1]
  if traced:
    assert "by GPU kernel time" in out and row.startswith("  (2, None")
    assert "| 1 | 2048 | 2048 | 2 | 0.004 | 0.005 | 0.8 |" in out
  else:
    assert "by wall time (no GPU kernel traced)" in out and row.startswith("  (0, None")
    assert "| 2 | 2048 | 2048 | 2 | 0.006 | 0.003 | 2 |" in out


def test_tune_mma_times_the_other_block_of_rows_past_64_rows(monkeypatch, capsys):
  """--other-rows: past 64 rows the kernel with the block of W's rows it does
  not choose (on 2048 x 2048 it chooses 64, so the other is 128), in a table
  of its own; at 64 rows nothing more is timed."""
  ran = []
  monkeypatch.setattr(tune_decode.decode24, "decode_matmul",
                      lambda x, v, mt, k: ran.append("triton") or x[:, :1])
  monkeypatch.setattr(tune_decode.decode24_mma, "decode_matmul",
                      lambda x, v, mt, k, rows=None: ran.append(f"mma{rows or ''}") or x[:, :1])
  monkeypatch.setattr(tune_decode, "ROTATE_BYTES", 1)
  gpu = {"dense": 10e-6, "triton": 5e-6, "mma": 4e-6, "mma128": 8e-6}
  timed = []

  def times(point, product, operands, kernel=False):
    del ran[:]
    product(point.xs[0], operands[0])
    timed.append((point.m, ran[0] if ran else "dense"))
    return gpu[timed[-1][1]], gpu[timed[-1][1]] if kernel else None

  monkeypatch.setattr(tune_decode.Point, "times", times)
  tune_decode.mma(1e12, [(2048, 2048)], [64, 80], repeat=1, other_rows=True)
  out = capsys.readouterr().out
  assert (80, "mma128") in timed and (64, "mma128") not in timed
  assert "| 80 | 2048 | 2048 | 64 | 0.004 | 128 | 0.008 | 0.5 |" in out


def test_mma_kernel_keeps_k_whole_up_to_16_rows_where_k_and_n_reach_4096():
  counts = decode24_mma.slice_counts
  assert counts(1, 4096, 4096) == counts(16, 16384, 4096) == counts(16, 4096, 12288) == (1,)
  assert counts(17, 4096, 4096) == counts(1, 2048, 4096) == counts(1, 8192, 2048) == (1, 2, 4, 8)
  # The plan alone deals two slices at both shapes (4 K steps of 1024 and 2
  # over 64 blocks of W's rows); the lowered kernel writes float32 partials
  # only where K = 2048.
  for k, sliced in ((4096, False), (2048, True)):
    assert decode24_mma.plan(4096, k, 132, 1024)[0] == 2
    f = jax.jit(functools.partial(decode24_mma.decode_matmul, k=k))
    text = f.trace(jax.ShapeDtypeStruct((16, k), jnp.bfloat16),
                   jax.ShapeDtypeStruct((4096, k // 2), jnp.bfloat16),
                   jax.ShapeDtypeStruct((4096, k // 8), jnp.uint8)).lower(
                       lowering_platforms=("cuda",)).as_text()
    assert ("tensor<2x16x4096xf32>" in text) == sliced


def test_mma_kernel_takes_a_number_of_k_slices_for_tuning():
  assert decode24_mma.plan(4096, 4096, 132, 1024, splits_among=(1,)) == (1, 64, 1)
  assert decode24_mma.plan(4096, 4096, 132, 1024, splits_among=(4,)) == (4, 128, 2)
  x, sp = _operand(0, 1, 4096, 64, jnp.bfloat16)
  with pytest.raises(ValueError, match="decode24_mma.decode_matmul: splits = 3 does not divide"
                                       " the 4 K steps of 1024"):
    decode24_mma.decode_matmul(x, sp.values, sp.meta, k=4096, splits=3)


def test_mma_kernel_stays_off_gpus_before_hopper(mma_gpu, monkeypatch):
  del mma_gpu
  ampere = type("Device", (), {"compute_capability": "8.0", "device_kind": "Test GPU"})()
  monkeypatch.setattr(pallas_backend.jax, "devices", lambda *a: [ampere])
  assert not pallas_backend.mma_takes(1, 4096, 4096, jnp.bfloat16)
  hopper = type("Device", (), {"compute_capability": "9.0", "device_kind": "Test GPU"})()
  monkeypatch.setattr(pallas_backend.jax, "devices", lambda *a: [hopper])
  assert pallas_backend.mma_takes(1, 4096, 4096, jnp.bfloat16)


def test_compressed_products_reach_the_sparse_tensor_cores(mma_gpu):
  """sparse_dot on a Sparse24 and SparseDense applied to compress_params
  output take decode24_mma where the table says, the Triton kernel above it."""
  del mma_gpu
  sp = jax.eval_shape(lambda w: jsparse24.compress(w, implementation="xla"),
                      jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16))
  f = lambda x, sp: jsparse24.sparse_dot(x, sp)  # noqa: E731
  few = str(jax.make_jaxpr(f)(jax.ShapeDtypeStruct((8, 4096), jnp.bfloat16), sp))
  assert "jsparse24_decode_mma" in few
  more = str(jax.make_jaxpr(f)(jax.ShapeDtypeStruct((9, 4096), jnp.bfloat16), sp))
  assert "jsparse24_decode_mma" not in more and "jsparse24_decode" in more
  model = jsparse24.sparsify(nn.Dense(2048, use_bias=False, dtype=jnp.bfloat16),
                             {r".*": {"transposable": False}})
  x = jnp.ones((2, 2048), jnp.bfloat16)
  v = model.init(jax.random.key(0), x)
  params = jsparse24.compress_params(v["params"], v["sparsity"])
  applied = str(jax.make_jaxpr(lambda p, x: model.apply({"params": p}, x))(params, x))
  assert "jsparse24_decode_mma" in applied


# Odd shapes the kernel takes: M = 1, 3, 9 (x padded to 16 rows), 15, 16, and
# past 16 rows (steps of 512; x's rows split between the warps) 17, 32, 33,
# 47, 64, and past 64 rows (steps of 256; 24 or 32 rows of x a warp) 65, 100,
# 127, 128; N not a multiple of the 64-row block; K 2048-16384 in one or
# several slices; a cuSPARSELt buffer's values (rows after N).
@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,dtype,cusparselt,rows", [(*case, None)[:6] for case in [
    (1, 4096, 4096, jnp.bfloat16, False), (3, 2048, 1000, jnp.bfloat16, False),
    (9, 8192, 264, jnp.float16, False), (16, 16384, 4096, jnp.bfloat16, False),
    (15, 2048, 2048, jnp.float16, False), (5, 4096, 12288, jnp.bfloat16, False),
    (2, 3072, 5120, jnp.bfloat16, True), (17, 2048, 1000, jnp.bfloat16, False),
    (32, 4096, 4096, jnp.float16, False), (33, 4096, 264, jnp.bfloat16, False),
    (47, 3072, 5120, jnp.bfloat16, True), (64, 8192, 8192, jnp.bfloat16, False),
    (64, 16384, 1032, jnp.float16, False), (65, 2048, 1000, jnp.bfloat16, False),
    (100, 3072, 5120, jnp.bfloat16, True), (127, 16384, 1032, jnp.float16, False),
    (128, 8192, 8192, jnp.bfloat16, False), (128, 4096, 264, jnp.float16, False),
    # Blocks of 128 rows of W forced where block_rows() takes 64: N not a
    # multiple of the block, a cuSPARSELt buffer, float16, one ragged 8-row tile.
    (65, 2048, 1000, jnp.bfloat16, False, 128), (100, 3072, 5120, jnp.bfloat16, True, 128),
    (127, 16384, 1032, jnp.float16, False, 128), (128, 4096, 264, jnp.float16, False, 128),
    # Past 128 rows, passes of 128 rows of x (the last: 1, 72, 128 rows).
    (129, 2048, 1000, jnp.bfloat16, False), (200, 3072, 5120, jnp.bfloat16, True),
    (256, 8192, 8192, jnp.bfloat16, False), (256, 4096, 264, jnp.float16, False)]])
def test_mma_decode_matmul_on_gpu(m, k, n, dtype, cusparselt, rows):
  if decode24_mma.unsupported_reason(m, k, n, dtype) is not None or not str(
      getattr(jax.devices()[0], "compute_capability", "")).startswith("9"):
    pytest.skip("decode24_mma runs on Hopper")
  x, sp = _operand(m + k + n, m, k, n, dtype)
  values = sp.values
  if cusparselt:  # rows after N that the product must not read
    values = jnp.concatenate([values, jnp.full((n // 8, k // 2), jnp.nan, dtype)])
  got = decode24_mma.decode_matmul(x, values, sp.meta, k=k, rows=rows)
  assert got.shape == (m, n) and got.dtype == dtype
  assert _rel_err(got, x, sp) < _TOL[dtype]
  if pallas_backend.mma_takes(m, k, n, dtype):
    y = jax.jit(lambda x, sp: jsparse24.sparse_dot(x, sp, implementation="pallas"))(x, sp)
    assert _rel_err(y, x, sp) < _TOL[dtype]
