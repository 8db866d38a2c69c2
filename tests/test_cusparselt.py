"""The parts of the cuSPARSELt backend that need no GPU: the compressed layout
(against bytes recorded from cusparseLtSpMMACompress2 on an H200), building
the FFI shim from pip-installed headers, the build's error messages, and the
dispatch rules. The products themselves are tested in tests/test_gpu.py."""

import dataclasses
import functools
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse24
from jsparse24 import backends
from jsparse24.backends import _cusparselt_build as build
from jsparse24.backends import cusparselt
from jsparse24.backends.pallas import interpret_mode
from pallas_kernels import cusparselt_metadata, cusparselt_values

DATA = pathlib.Path(__file__).parent / "data" / "cusparselt_layout.npz"


def _recorded():
  d = np.load(DATA)
  w = jax.lax.bitcast_convert_type(jnp.asarray(d["w_bits"]), jnp.float16)
  k, n = w.shape
  mask = np.unpackbits(d["mask_bits"])[: k * n].reshape(k, n).astype(bool)
  return w, mask, d["fwd"], d["bwd"]


def _bytes(buf):
  return np.asarray(buf).view(np.uint8).reshape(-1)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_layout_matches_recorded_cusparselt_bytes(implementation):
  w, mask, fwd, bwd = _recorded()
  k, n = w.shape
  with interpret_mode():
    sp = jsparse24.compress(w, mask, transposed=True, implementation=implementation)
  got_fwd, got_bwd = cusparselt.from_sparse24(sp)
  assert got_fwd.shape == cusparselt.buffer_shape(k, n, transpose=False) == (k // 2 + k // 16, n)
  assert got_bwd.shape == cusparselt.buffer_shape(k, n, transpose=True) == (k + k // 8, n // 2)
  np.testing.assert_array_equal(_bytes(got_fwd), fwd)
  np.testing.assert_array_equal(_bytes(got_bwd), bwd)
  # Without the transposed copy there is no backward buffer.
  assert cusparselt.from_sparse24(jsparse24.compress(w, mask))[1] is None


@pytest.mark.parametrize("transposable", [True, False])
def test_prepare_writes_the_recorded_bytes(transposable):
  # The per-step path: the Pallas kernel writes the values straight into the
  # buffers, then the metadata lands after them.
  w, mask, fwd, bwd = _recorded()
  stored = jsparse24.Mask24.pack(mask, transposable=True)
  with interpret_mode():
    op = jax.jit(cusparselt.CusparseltBackend().prepare, static_argnums=2)(w, stored, transposable)
  np.testing.assert_array_equal(_bytes(op.fwd), fwd)
  if transposable:
    np.testing.assert_array_equal(_bytes(op.bwd), bwd)
  else:
    assert op.bwd is None
  np.testing.assert_array_equal(np.asarray(op.meta), np.asarray(stored.meta()))
  assert op.shape == w.shape


@pytest.mark.parametrize("transposable", [False, True])
def test_prepare_prunes_like_the_reference(transposable):
  w = jax.random.normal(jax.random.key(5), (128, 192), jnp.bfloat16)
  with interpret_mode():
    op = cusparselt.CusparseltBackend().prepare(w, None, transposable)
  ref = jsparse24.compress(w, transposed=transposable, implementation="xla")
  want_fwd, want_bwd = cusparselt.from_sparse24(ref)
  np.testing.assert_array_equal(_bytes(op.fwd), _bytes(want_fwd))
  if transposable:
    np.testing.assert_array_equal(_bytes(op.bwd), _bytes(want_bwd))
  np.testing.assert_array_equal(np.asarray(op.meta), np.asarray(ref.meta))


def test_dense_dx_and_mask_grad_from_the_residual():
  # Without a transposed copy, dx is dense (XLA) from the forward buffer;
  # dw is masked with the residual's codes. Both run without a GPU.
  w = jax.random.normal(jax.random.key(6), (192, 128), jnp.float16)
  mask = jsparse24.Mask24.from_weights(jax.random.normal(jax.random.key(7), w.shape))
  backend = cusparselt.CusparseltBackend()
  with interpret_mode():
    op = backend.prepare(w, mask, False)
  masked = jnp.where(mask.unpack(), w, jnp.zeros((), w.dtype))
  dy = jax.random.normal(jax.random.key(8), (5, 128), jnp.float16)
  np.testing.assert_array_equal(np.asarray(backend.backward_dx(dy, op, None)),
                                np.asarray(jnp.dot(dy, masked.T)))
  dw = jax.random.normal(jax.random.key(9), w.shape, jnp.float32)
  np.testing.assert_array_equal(np.asarray(backend.mask_grad(dw, op)),
                                np.asarray(jnp.where(mask.unpack(), dw, 0.0)))


def test_metadata_layout_is_a_permutation_of_nibbles():
  rng = np.random.default_rng(0)
  r, g = 192, 48
  codes = rng.integers(0, 16, (r, g), dtype=np.uint8)
  out = np.asarray(cusparselt.metadata_layout(jnp.asarray(codes)))
  assert out.shape == (r * g // 2,)
  nibbles = np.concatenate([out & 0xF, out >> 4])
  np.testing.assert_array_equal(np.sort(nibbles), np.sort(codes.reshape(-1)))
  # Spot-check the rule: row 16a + 8h + b, group 4c + d -> byte 64a + 8b + 2d + c
  # of its 64x8 block, nibble h; blocks row-block major.
  for row, grp in [(0, 0), (9, 5), (63, 7), (64, 8), (150, 45), (191, 47)]:
    rb, rr = divmod(row, 64)
    gb, gg = divmod(grp, 8)
    a, h, b = rr // 16, (rr // 8) % 2, rr % 8
    c, d = gg // 4, gg % 4
    byte = (rb * (g // 8) + gb) * 256 + 64 * a + 8 * b + 2 * d + c
    assert (out[byte] >> (4 * h)) & 0xF == codes[row, grp]


@pytest.mark.parametrize("r,g,cols", [(64, 16, 64), (192, 48, 64), (256, 512, 1024)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_metadata_rows_equal_the_bytewise_layout(r, g, cols, dtype):
  """`_metadata_rows` (32-bit word arithmetic) writes exactly the bytes of
  `metadata_layout` (the definition, checked above and against recorded
  cuSPARSELt bytes), on random codes."""
  codes = np.random.default_rng(r + g).integers(0, 16, (r, g), dtype=np.uint8)
  meta = jnp.asarray(codes[:, 0::2] | (codes[:, 1::2] << 4))
  got = cusparselt._metadata_rows(meta, g, cols, dtype)  # pylint: disable=protected-access
  assert got.shape == (r * g // (4 * cols), cols) and got.dtype == dtype
  want = np.asarray(_metadata_layout(codes))
  np.testing.assert_array_equal(np.asarray(got).view(np.uint8).reshape(-1), want)


# The definition of the layout, compiled once per shape: the expected bytes of
# the writers' tests (the definition itself is checked op by op above).
_metadata_layout = jax.jit(cusparselt.metadata_layout)


def check_metadata_pass(write, rows: int, groups: int, head: int, cols: int, dtype,
                        seed: int) -> None:
  """`write(buf, head, meta, groups)` (a metadata writer, `_with_metadata`)
  on random codes of `rows x groups` groups and a `[head + ..., cols]`
  buffer of random value bits must write exactly the bytes of
  `metadata_layout` (the definition, checked against recorded cuSPARSELt
  bytes) from row `head` on and leave every row before it alone. Compared
  as bytes, so that no NaN pattern is canonicalised on the way."""
  rng = np.random.default_rng(seed)
  codes = rng.integers(0, 16, (rows, groups), dtype=np.uint8)
  meta = jnp.asarray(codes[:, 0::2] | (codes[:, 1::2] << 4))
  bits = rng.integers(0, 1 << 16, (head + rows * groups // (4 * cols), cols), dtype=np.uint16)
  # NumPy views, not bitcasts on the device: the same bytes, no program to compile.
  got = write(jnp.asarray(bits.view(jnp.dtype(dtype))), head, meta, groups)
  got = np.asarray(got).view(np.uint16)
  np.testing.assert_array_equal(got[:head], bits[:head])
  np.testing.assert_array_equal(got[head:].view(np.uint8).reshape(-1),
                                np.asarray(_metadata_layout(codes)))


def write_by_groups(buf, head, meta, groups):
  """`_with_metadata` given the mask transposed, as the MVUE kernel writes it."""
  return cusparselt._with_metadata(buf, head, meta.T, groups, by_groups=True)  # pylint: disable=protected-access


@pytest.mark.parametrize("k,n,dtype", [(64, 64, jnp.bfloat16), (128, 192, jnp.float16),
                                       (256, 64, jnp.bfloat16), (640, 320, jnp.float16),
                                       (192, 1024, jnp.bfloat16)])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("by_groups", [False, True])
def test_metadata_kernel_writes_the_bytewise_layout_in_place(k, n, transpose, dtype, by_groups):
  """The Pallas metadata pass (`_with_metadata`) on both buffers of a
  `[K, N]` weight (`buffer_shape`), from the packed mask or its transpose;
  both 16-bit dtypes (the pass moves their bits alike), each on some shapes."""
  rows, groups = (k, n // 4) if transpose else (n, k // 4)
  cols = cusparselt.buffer_shape(k, n, transpose=transpose)[1]
  head = k if transpose else k // 2  # the value rows
  # One compiled program per case (as tests/test_gpu.py runs it), not op by op.
  write = jax.jit(write_by_groups if by_groups else cusparselt._with_metadata,  # pylint: disable=protected-access
                  static_argnums=(1, 3))
  with interpret_mode():
    check_metadata_pass(write, rows, groups, head, cols, dtype, seed=k + n + transpose)


@pytest.mark.parametrize("k,n,dtype", [(64, 64, jnp.bfloat16), (192, 320, jnp.float16),
                                       (640, 128, jnp.bfloat16)])
def test_forward_buffer_has_from_sparse24s_bytes(k, n, dtype):
  """The Pallas re-layout of a compressed weight for cuSPARSELt (values
  transposed into the buffer, then the metadata in place) writes the bytes
  of the XLA one, `from_sparse24`; K = 192 (K/2 = 96) takes K/2 tiles of 32,
  the others tiles of 64."""
  w = jax.random.normal(jax.random.key(k + n), (k, n), dtype)
  sp = jax.jit(lambda w: jsparse24.compress(w, implementation="xla"))(w)
  want = jax.jit(lambda sp: cusparselt.from_sparse24(sp)[0])(sp)
  with interpret_mode():
    got = jax.jit(cusparselt.forward_buffer)(sp)
    if backends.pallas.triton_unavailable_reason() is None:  # the kernels, not the fallback
      passes = str(jax.make_jaxpr(cusparselt.forward_buffer)(sp))
      assert "jsparse24_cusparselt_values" in passes and "concatenate" not in passes
  assert got.shape == want.shape == cusparselt.buffer_shape(k, n, transpose=False)
  np.testing.assert_array_equal(_bytes(got), _bytes(want))


@pytest.mark.parametrize("n,h,rows,dtype", [(64, 32, 36, jnp.bfloat16),
                                            (320, 96, 108, jnp.float16),
                                            (96, 160, 160, jnp.bfloat16)])
def test_values_into_buffer_writes_the_transpose_in_the_leading_rows(n, h, rows, dtype):
  values = jax.random.normal(jax.random.key(n + h), (n, h), dtype)
  got = jax.jit(functools.partial(cusparselt_values.values_into_buffer, rows=rows,
                                  interpret=True))(values)
  want = cusparselt_values.values_into_buffer_reference(values, rows)
  assert got.shape == want.shape == (rows, n) and got.dtype == dtype
  np.testing.assert_array_equal(_bytes(got[:h]), _bytes(want[:h]))
  np.testing.assert_array_equal(_bytes(want[:h]), _bytes(values.T))


def test_values_into_buffer_rejects_bad_shapes():
  with pytest.raises(ValueError, match=r"values_into_buffer: .*multiples of 32 .* \[48, 32\]"):
    cusparselt_values.values_into_buffer(jnp.zeros((48, 32), jnp.bfloat16), rows=40)
  with pytest.raises(ValueError, match="rows >= H"):
    cusparselt_values.values_into_buffer(jnp.zeros((64, 64), jnp.bfloat16), rows=32)
  with pytest.raises(TypeError, match="values_into_buffer: `values` must be 16-bit"):
    cusparselt_values.values_into_buffer(jnp.zeros((64, 64), jnp.float32), rows=64)


def test_metadata_kernel_rejects_bad_shapes():
  buf = jnp.zeros((36, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="write_cusparselt_metadata: `meta` must be"):
    cusparselt_metadata.write_cusparselt_metadata(buf, jnp.zeros((48, 8), jnp.uint8), row=32,
                                      interpret=True)
  with pytest.raises(ValueError, match="write_cusparselt_metadata: 16 metadata blocks"):
    cusparselt_metadata.write_cusparselt_metadata(buf, jnp.zeros((64, 64), jnp.uint8), row=32,
                                      interpret=True)
  with pytest.raises(ValueError, match=r"write_cusparselt_metadata: `meta` must be \[G/2, R\]"):
    cusparselt_metadata.write_cusparselt_metadata(buf, jnp.zeros((8, 48), jnp.uint8), row=32,
                                      by_groups=True, interpret=True)


def _contract_with_metadata(x, dy, first_row, first_col, n_total, meta, writer="xla"):
  """A `rows_contracted` function that writes metadata rows, as the MVUE
  weight gradient does inside its partitioned op (by the XLA reference or
  the Pallas pass)."""
  del first_row, first_col, n_total
  if writer == "xla":
    rows = cusparselt._metadata_rows(meta, 16, 64, jnp.bfloat16)  # pylint: disable=protected-access
  else:
    rows = cusparselt._with_metadata(jnp.zeros((36, 64), jnp.bfloat16), 32, meta, 16)  # pylint: disable=protected-access
  bits = jax.lax.bitcast_convert_type(rows, jnp.uint16).astype(jnp.int32)
  return x.T @ dy + (jnp.sum(bits) % 1000).astype(jnp.float32)


@pytest.mark.parametrize("writer", ["xla", "pallas"])
def test_metadata_rows_trace_inside_a_partitioned_op(writer):
  """custom_partitioning refuses a function with array constants (an
  assertion at trace time): the metadata writers must build none, or
  weight_grad="mvue" on cuSPARSELt, which writes the metadata of the pruned
  dy inside `rows_contracted`, fails to trace (seen on an H100)."""
  from jsparse24 import _sharding  # pylint: disable=g-import-not-at-top
  meta = jnp.asarray(np.random.default_rng(0).integers(0, 256, (64, 8), dtype=np.uint8))
  x, dy = jnp.ones((8, 4)), jnp.ones((8, 6))
  fn = functools.partial(_contract_with_metadata, writer=writer)
  with interpret_mode():
    got = jax.jit(lambda x, dy, m: _sharding.rows_contracted(fn, x, dy, m))(x, dy, meta)
    np.testing.assert_allclose(got, fn(x, dy, 0, 0, 6, meta))


def test_from_sparse24_rejects_unaligned_shapes():
  w = jnp.ones((96, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="multiples of 64"):
    cusparselt.from_sparse24(jsparse24.compress(w))


# ---------------------------------------------------------------------------
# Building the shim.
# ---------------------------------------------------------------------------

_LINUX_X86 = platform.system() == "Linux" and platform.machine() == "x86_64"


@pytest.mark.skipif(not _LINUX_X86, reason="the test extra installs the CUDA header wheels on Linux x86-64 only")
def test_shim_builds_from_pip_headers_and_loads(shim_cache):
  """In the module's one build folder (`shim_cache`): the first of its tests
  to run builds the shim there, with the same `build.build`, and the others
  find it (a build is ~6 s of g++)."""
  toolchain = build.find_toolchain()
  path = build.build(toolchain, shim_cache)
  assert path.is_file() and path.stat().st_size > 0
  # Cached: a second build with the same inputs returns the same file untouched.
  mtime = path.stat().st_mtime_ns
  assert build.build(toolchain, shim_cache) == path and path.stat().st_mtime_ns == mtime
  import ctypes  # pylint: disable=g-import-not-at-top
  lib = ctypes.CDLL(str(path))
  for symbol in list(build.TARGETS.values()) + ["jsp_cusparselt_open",
                                                 "jsp_cusparselt_compressed_size",
                                                 "jsp_cusparselt_version",
                                                 "jsp_cusparselt_set_algorithm_cache",
                                                 "jsp_cusparselt_searches"]:
    assert hasattr(lib, symbol), symbol
  lib = build.open_shim(path, toolchain.cusparselt_library)
  assert build.version(lib).startswith("0.")


def test_build_error_without_compiler(monkeypatch):
  monkeypatch.setenv("CXX", "/nonexistent/c++")
  monkeypatch.setattr(build.shutil, "which", lambda name: None)
  with pytest.raises(build.BuildError, match=r"no C\+\+ compiler found .*set CXX, or install g\+\+"):
    build.find_toolchain()


def test_build_error_without_headers(monkeypatch, tmp_path):
  monkeypatch.setattr(build, "search_roots", lambda: [tmp_path])
  with pytest.raises(build.BuildError, match=r"cuSPARSELt header cusparseLt.h not found .*jsparse24\[cuda\]"):
    build.find_toolchain()


def test_build_error_without_library(monkeypatch, tmp_path):
  (tmp_path / "include" / "crt").mkdir(parents=True)
  for name in ("cusparseLt.h", "cuda_runtime_api.h", "crt/host_defines.h"):
    (tmp_path / "include" / name).write_text("// cusparseLt_cusparse_stub.h\n")
  monkeypatch.setattr(build, "search_roots", lambda: [tmp_path])
  with pytest.raises(build.BuildError, match=r"cuSPARSELt library libcusparseLt.so not found"):
    build.find_toolchain()
  (tmp_path / "lib").mkdir()
  (tmp_path / "lib" / "libcusparseLt.so.0").write_bytes(b"")
  with pytest.raises(build.BuildError, match=r"CUDA runtime library libcudart.so not found"):
    build.find_toolchain()


def test_build_error_for_an_old_cusparselt_without_the_cusparse_header(monkeypatch, tmp_path):
  # cuSPARSELt 0.8 and 0.9 include cusparse.h, which the [cuda] extra no
  # longer brings (0.10 does not need it): the error says what to install.
  (tmp_path / "include" / "crt").mkdir(parents=True)
  (tmp_path / "include" / "cusparseLt.h").write_text("#include <cusparse.h>\n")
  for name in ("cuda_runtime_api.h", "crt/host_defines.h"):
    (tmp_path / "include" / name).write_text("\n")
  monkeypatch.setattr(build, "search_roots", lambda: [tmp_path])
  with pytest.raises(build.BuildError, match=r"cuSPARSELt before 0\.10 .* needs the cuSPARSE header"
                     r" cusparse\.h not found .*pip install nvidia-cusparse nvidia-cuda-cccl"):
    build.find_toolchain()


def test_compile_error_is_reported_with_the_command(monkeypatch, tmp_path):
  bad = tmp_path / "broken.cc"
  bad.write_text("this is not C++\n")
  monkeypatch.setattr(build, "_SOURCE", bad)
  toolchain = build.Toolchain(compiler=build.shutil.which("c++") or "g++", include_dirs=(),
                              cusparselt_library=str(tmp_path / "libcusparseLt.so"),
                              cudart_library=str(tmp_path / "libcudart.so"),
                              ffi_include_dir=str(tmp_path))
  (tmp_path / "libcusparseLt.so").write_bytes(b"")
  (tmp_path / "libcudart.so").write_bytes(b"")
  with pytest.raises(build.BuildError, match=r"compiling the cuSPARSELt shim failed \(exit \d+\)\.\ncommand: .*broken\.cc"):
    build.build(toolchain, tmp_path / "cache")
  assert not list((tmp_path / "cache").rglob("*.so"))  # no half-written library left


# ---------------------------------------------------------------------------
# Which cuSPARSELt runs: the file find_toolchain() found, whatever else the
# process loaded first. Each case runs in a fresh process (a process opens one
# cuSPARSELt library), against stand-in libraries compiled here.
# ---------------------------------------------------------------------------

# The cuSPARSELt functions the shim calls (the types, `..._t`, left out).
_ENTRY_POINTS = sorted({name for name in re.findall(r"\bcusparseLt\w+\b", build._SOURCE.read_text())
                        if not name.endswith("_t")})


@pytest.fixture(scope="module")
def toolchain():
  if not _LINUX_X86:
    pytest.skip("the test extra installs the CUDA header wheels on Linux x86-64 only")
  try:
    return build.find_toolchain()
  except build.BuildError as e:
    pytest.skip(f"no toolchain to build the shim here: {e}")


@pytest.fixture(scope="module")
def shim_cache(tmp_path_factory):
  """One build directory for the module: every case compiles the same source
  against the same header, so the shim is built once."""
  return tmp_path_factory.mktemp("shim-cache")


def _header_dir(toolchain) -> str:
  return next(d for d in toolchain.include_dirs if pathlib.Path(d, "cusparseLt.h").is_file())


def _header_version(toolchain) -> tuple[int, int, int]:
  header = pathlib.Path(_header_dir(toolchain), "cusparseLt.h").read_text()
  return tuple(int(re.search(rf"#define CUSPARSELT_VER_{part} (\d+)", header).group(1))
               for part in ("MAJOR", "MINOR", "PATCH"))


def _fake_cusparselt(directory: pathlib.Path, version, toolchain, *, leave_out=()) -> pathlib.Path:
  """Compiles `directory/libcusparseLt.so.0` (soname libcusparseLt.so.0): every
  entry point of `_ENTRY_POINTS` but `leave_out`, each returning
  CUSPARSE_STATUS_NOT_SUPPORTED, except cusparseLtGetProperty, which reports
  `version` (major, minor, patch). With cusparseLtMatmul present, the patch
  level is what the library's own cusparseLtMatmul returns, called through its
  PLT as the real libcusparseLt.so.0 calls its cusparseLtMatmul from
  cusparseLtMatmulSearch: a copy loaded earlier into the global scope can
  interpose on it."""
  major, minor, patch = version
  has_matmul = "cusparseLtMatmul" not in leave_out
  lines = ['extern "C" {', "int cusparseLtMatmul(...);" if has_matmul else ""]
  for name in _ENTRY_POINTS:
    if name in leave_out:
      continue
    if name == "cusparseLtGetProperty":  # MAJOR_VERSION = 0, MINOR_VERSION = 1, PATCH_LEVEL = 2
      lines.append(f"int {name}(int type, int* value) {{"
                   f" if (type == 0) *value = {major}; else if (type == 1) *value = {minor};"
                   f" else if (type == 2) *value = {'cusparseLtMatmul()' if has_matmul else patch};"
                   f" else return 3; return 0; }}")
    elif name in ("cusparseLtGetErrorName", "cusparseLtGetErrorString"):
      lines.append(f'const char* {name}(int) {{ return "stand-in"; }}')
    elif name == "cusparseLtMatmul":
      lines.append(f"int {name}(...) {{ return {patch}; }}")
    else:
      lines.append(f"int {name}(...) {{ return 10; }}")
  lines.append("}")
  directory.mkdir(parents=True, exist_ok=True)
  source = directory / "fake_cusparselt.cc"
  source.write_text("\n".join(lines) + "\n")
  library = directory / "libcusparseLt.so.0"
  out = subprocess.run([toolchain.compiler, "-shared", "-fPIC", "-Wl,-soname,libcusparseLt.so.0",
                        str(source), "-o", str(library)], capture_output=True, text=True)
  assert out.returncode == 0, out.stderr
  return library


def _home_with(directory: pathlib.Path, library: pathlib.Path, toolchain) -> pathlib.Path:
  """A JSPARSE24_CUSPARSELT_HOME: the real cuSPARSELt header (include/, linked)
  and `library` in lib/."""
  (directory / "lib").mkdir(parents=True)
  (directory / "include").symlink_to(_header_dir(toolchain))
  shutil.copy(library, directory / "lib" / "libcusparseLt.so.0")
  return directory


def _fresh_env(**variables) -> dict[str, str]:
  """The environment of a fresh process that imports the jsparse24 under test,
  with `variables` set and no JSPARSE24_CUSPARSELT_HOME unless given."""
  checkout = str(pathlib.Path(jsparse24.__file__).resolve().parents[1])
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([checkout, os.environ.get("PYTHONPATH", "")])}
  env.pop("JSPARSE24_CUSPARSELT_HOME", None)
  return {**env, **variables}


_LOAD_SCRIPT = """
import ctypes, sys
if sys.argv[1]:
  ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
from jsparse24.backends import _cusparselt_build as build
try:
  print("version", build.version(build.load()))
except build.BuildError as e:
  print("error", str(e).replace("\\n", " "))
"""


def _load_in_new_process(cache, *, preload="", home=None) -> str:
  """`build.load()` then `build.version()` in a fresh process, after loading
  `preload` with RTLD_GLOBAL (as torch loads its own libcusparseLt.so.0):
  "version X.Y.Z", or "error <the BuildError's message>"."""
  env = _fresh_env(JSPARSE24_CACHE_DIR=str(cache))
  if home is not None:
    env["JSPARSE24_CUSPARSELT_HOME"] = str(home)
  out = subprocess.run([sys.executable, "-c", _LOAD_SCRIPT, str(preload)], env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-4000:]
  return out.stdout.strip().splitlines()[-1]


def test_the_found_library_runs_when_another_was_loaded_first(tmp_path, toolchain, shim_cache):
  """Another libcusparseLt.so.0 already in the process (torch imported first)
  does not serve the shim's calls: the library `find_toolchain` found does."""
  major, minor, _ = _header_version(toolchain)
  other = _fake_cusparselt(tmp_path / "torch", (9, 9, 9), toolchain)
  got = _load_in_new_process(shim_cache, preload=other)
  assert got.startswith(f"version {major}.{minor}."), got


def test_the_home_library_runs_and_calls_itself(tmp_path, toolchain, shim_cache):
  """JSPARSE24_CUSPARSELT_HOME's library (another file, of the header's
  major.minor) is the one that runs, also where it calls one of its own entry
  points while another copy is loaded into the global scope."""
  major, minor, _ = _header_version(toolchain)
  chosen = _fake_cusparselt(tmp_path / "chosen", (major, minor, 77), toolchain)
  home = _home_with(tmp_path / "home", chosen, toolchain)
  assert _load_in_new_process(shim_cache, home=home) == f"version {major}.{minor}.77"
  other = _fake_cusparselt(tmp_path / "torch", (major, minor, 9), toolchain)
  assert _load_in_new_process(shim_cache, preload=other, home=home) == f"version {major}.{minor}.77"


def test_the_build_depends_on_the_header_not_the_library(tmp_path, toolchain):
  """The library is opened at load, not linked: another library file reuses
  the build, and so does the same cusparseLt.h elsewhere; another header
  (another cuSPARSELt install) gets its own build."""
  header_dir = _header_dir(toolchain)
  header = pathlib.Path(header_dir, "cusparseLt.h").read_text()

  def with_header(name, text):
    (tmp_path / name).mkdir()
    (tmp_path / name / "cusparseLt.h").write_text(text)
    dirs = tuple(str(tmp_path / name) if d == header_dir else d for d in toolchain.include_dirs)
    return dataclasses.replace(toolchain, include_dirs=dirs)

  digest = build._digest(toolchain)  # pylint: disable=protected-access
  other_library = _fake_cusparselt(tmp_path / "lib", _header_version(toolchain), toolchain)
  assert build._digest(dataclasses.replace(toolchain, cusparselt_library=str(other_library))) == digest  # pylint: disable=protected-access
  assert build._digest(with_header("same", header)) == digest  # pylint: disable=protected-access
  newer = re.sub(r"#define CUSPARSELT_VER_MINOR \d+", "#define CUSPARSELT_VER_MINOR 99", header)
  assert newer != header
  assert build._digest(with_header("newer", newer)) != digest  # pylint: disable=protected-access


_OPEN_SCRIPT = """
import ctypes, sys
from jsparse24.backends import _cusparselt_build as build
shim, real, other = sys.argv[1:]
lib = ctypes.CDLL(shim)
lib.jsp_cusparselt_compressed_size.argtypes = [
    ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
    ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t), ctypes.c_char_p,
    ctypes.c_size_t]
lib.jsp_cusparselt_version.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_char_p,
                                       ctypes.c_size_t]
msg, size = ctypes.create_string_buffer(2048), ctypes.c_size_t()
print(lib.jsp_cusparselt_compressed_size(0, 0, 64, 64, 1, ctypes.byref(size),
                                         ctypes.byref(size), msg, len(msg)), msg.value.decode())
try:
  build.version(lib)
except build.BuildError as e:
  print("error", e)
lib = build.open_shim(shim, real)
assert build.open_shim(shim, real) is not None  # the same file again: already open
try:
  build.open_shim(shim, other)
except build.BuildError as e:
  print("error", e)
print("version", build.version(lib))
"""


def test_shim_calls_nothing_before_opening_and_opens_one_library(tmp_path, toolchain, shim_cache):
  """Before jsp_cusparselt_open, every helper returns an error saying so;
  after it, opening the same file again is fine, another one is refused."""
  major, minor, _ = _header_version(toolchain)
  other = _fake_cusparselt(tmp_path / "other", (major, minor, 77), toolchain)
  shim = build.build(toolchain, shim_cache)
  out = subprocess.run([sys.executable, "-c", _OPEN_SCRIPT, str(shim), toolchain.cusparselt_library,
                        str(other)], env=_fresh_env(),
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-4000:]
  size, version, second, opened = out.stdout.strip().splitlines()
  assert size.startswith("1 ") and "no cuSPARSELt library is open" in size, size
  assert version.startswith("error ") and "no cuSPARSELt library is open" in version, version
  assert second.startswith("error ") and toolchain.cusparselt_library in second, second
  assert str(other) in second, second
  assert opened.startswith(f"version {major}.{minor}.") and opened != f"version {major}.{minor}.77"


def test_a_library_of_another_version_than_the_header_is_refused(tmp_path, toolchain, shim_cache):
  major, minor, patch = _header_version(toolchain)
  chosen = _fake_cusparselt(tmp_path / "chosen", (major, minor + 2, 0), toolchain)
  home = _home_with(tmp_path / "home", chosen, toolchain)
  got = _load_in_new_process(shim_cache, home=home)
  assert got.startswith("error "), got
  assert f"{major}.{minor + 2}.0" in got and f"{major}.{minor}.{patch}" in got, got
  assert str(home / "lib" / "libcusparseLt.so.0") in got, got


def test_a_library_without_a_function_the_shim_calls_is_refused(tmp_path, toolchain, shim_cache):
  major, minor, _ = _header_version(toolchain)
  chosen = _fake_cusparselt(tmp_path / "chosen", (major, minor, 0), toolchain,
                            leave_out=("cusparseLtMatmul",))
  home = _home_with(tmp_path / "home", chosen, toolchain)
  got = _load_in_new_process(shim_cache, home=home)
  assert got.startswith("error ") and "cusparseLtMatmul" in got, got
  assert str(home / "lib" / "libcusparseLt.so.0") in got, got


# ---------------------------------------------------------------------------
# Dispatch.
# ---------------------------------------------------------------------------

def _problem(m=4096, k=4096, n=4096, dtype=jnp.bfloat16, transposable=True):
  return backends.Problem(m=m, k=k, n=n, dtype=jnp.dtype(dtype), transposable=transposable,
                          platform="gpu")


def test_check_supported_names_the_limits():
  backend = cusparselt.CusparseltBackend()
  backend.check_supported(_problem())
  backend.check_supported(_problem(dtype=jnp.float16, m=1))
  with pytest.raises(NotImplementedError, match="bfloat16 or float16.*1:2"):
    backend.check_supported(_problem(dtype=jnp.float32))
  with pytest.raises(NotImplementedError, match="K=96, N=4096.*multiples of 64"):
    backend.check_supported(_problem(k=96))
  with pytest.raises(NotImplementedError, match="multiples of 64"):
    backend.check_supported(_problem(n=4100))


def test_a_compressed_weights_prefill_takes_cusparselt(monkeypatch):
  """`compress_params` output at many rows (a prefill): cuSPARSELt from the
  compressed table's M on, where the same dense weight stays on XLA."""
  monkeypatch.setattr(cusparselt.CusparseltBackend, "unavailable_reason", lambda self: None)
  pick = lambda m, compressed: jsparse24.selected_implementation(  # noqa: E731
      (m, 4096), (4096, 8192), jnp.bfloat16, compressed=compressed)
  min_m = cusparselt.AUTO_MIN_M_COMPRESSED[2][3]
  assert pick(min_m, True) == "cusparselt" and pick(min_m - 1, True) != "cusparselt"
  assert pick(1 << 14, False) == "xla"


def test_selected_implementation_asks_for_a_layer_with_a_pruned_activation(monkeypatch):
  """`pruned_activations=True` asks what sparse_dot runs with `input_sparsity`
  or `grad_output` (a dense weight, the activation pruned): where a masked
  weight takes cuSPARSELt, that layer takes XLA's masked products
  (`CusparseltBackend.prefers`); a compressed weight cannot be one."""
  monkeypatch.setattr(cusparselt.CusparseltBackend, "unavailable_reason", lambda self: None)
  m = cusparselt.AUTO_MIN_M[True][2][3]  # K 4096, N 8192, transposable
  pick = lambda **kw: jsparse24.selected_implementation(  # noqa: E731
      (m, 4096), (4096, 8192), jnp.bfloat16, transposable=True, **kw)
  assert pick() == "cusparselt"
  assert pick(pruned_activations=True) == "xla"
  with pytest.raises(ValueError, match="selected_implementation: pruned_activations=True"
                                       " describes a dense weight"):
    pick(pruned_activations=True, compressed=True)


def test_prefers_follows_the_measured_table():
  backend = cusparselt.CusparseltBackend()
  table = cusparselt.AUTO_MIN_M
  # Every grid cell: from its M on, not below it; never where it is None.
  for transposable in (True, False):
    for i, k in enumerate(cusparselt.AUTO_GRID):
      for j, n in enumerate(cusparselt.AUTO_GRID):
        min_m = table[transposable][i][j]
        p = functools.partial(_problem, k=k, n=n, transposable=transposable)
        if min_m is None:
          assert not backend.prefers(p(m=1 << 20)), (k, n, transposable)
        else:
          assert backend.prefers(p(m=min_m)) and not backend.prefers(p(m=min_m - 1)), (k, n)
  # Between grid points: the cell below (3072 -> 2048); below the grid: never.
  assert table[True][0][1] is None and not backend.prefers(_problem(m=1 << 20, k=1024, n=3072))
  assert backend.prefers(_problem(m=table[True][1][1], k=3072, n=3072))
  assert not backend.prefers(_problem(m=1 << 20, k=512, n=16384))
  assert backend.prefers(_problem(m=1 << 20, k=65536, n=65536))
  # A model of width 1024 stays on the reference (measured no faster there).
  assert not any(backend.prefers(_problem(m=1 << 20, k=k, n=n))
                 for k, n in ((1024, 3072), (1024, 1024), (1024, 4096), (4096, 1024)))
  # bfloat16 only (float16 only when named: its algorithm search is unsafe).
  assert not backend.prefers(_problem(m=1 << 20, dtype=jnp.float16))
  # A compressed weight's own table (forward only; set apart from the
  # training step's): cells where it differs from both training tables.
  assert any(table[False][i][j] != cusparselt.AUTO_MIN_M_COMPRESSED[i][j]
             and table[True][i][j] != cusparselt.AUTO_MIN_M_COMPRESSED[i][j]
             for i in range(len(cusparselt.AUTO_GRID)) for j in range(len(cusparselt.AUTO_GRID)))
  for i, k in enumerate(cusparselt.AUTO_GRID):
    for j, n in enumerate(cusparselt.AUTO_GRID):
      min_m = cusparselt.AUTO_MIN_M_COMPRESSED[i][j]
      for transposable in (True, False):
        p = functools.partial(backends.Problem, k=k, n=n, dtype=jnp.dtype(jnp.bfloat16),
                              transposable=transposable, platform="gpu", compressed=True)
        if min_m is None:
          assert not backend.prefers(p(m=1 << 20)), (k, n)
        else:
          assert backend.prefers(p(m=min_m)) and not backend.prefers(p(m=min_m - 1)), (k, n)
  # The measured fact the table encodes: with dx dense (plain) a cell needs at
  # least the M a transposable mask needs, and most cells never pay.
  inf = float("inf")
  for i in range(len(cusparselt.AUTO_GRID)):
    for j in range(len(cusparselt.AUTO_GRID)):
      plain, transposable = table[False][i][j], table[True][i][j]
      assert (plain or inf) >= (transposable or inf), (i, j)
  assert table[True][2][2] == 4096 and table[False][2][2] is None


def test_algorithm_choice_per_dtype(monkeypatch):
  # bfloat16: cusparseLtMatmulSearch's pick timed beside the configuration
  # ids (its pick alone was once 2.2x slower than the best id); float16:
  # jsparse24's search over the ids that ran (the library's own search
  # crashes there).
  assert cusparselt._search_attrs(jnp.bfloat16) == (3, 20)
  assert cusparselt._search_attrs(jnp.float16) == (2, 34)
  monkeypatch.setitem(cusparselt.SEARCH, jnp.dtype(jnp.bfloat16), "cusparselt")
  assert cusparselt._search_attrs(jnp.bfloat16) == (1, -1)
  monkeypatch.setitem(cusparselt.SEARCH, jnp.dtype(jnp.float16), "default")
  assert cusparselt._search_attrs(jnp.float16) == (0, -1)
  monkeypatch.setitem(cusparselt.SEARCH, jnp.dtype(jnp.float16), ("fastest", 3))
  with pytest.raises(ValueError, match="unknown mode"):
    cusparselt._search_attrs(jnp.float16)


def test_unavailable_on_cpu_without_building(monkeypatch):
  if jax.default_backend() != "cpu":
    pytest.skip("checks the CPU message")
  monkeypatch.setattr(build, "load", lambda: pytest.fail("must not build on CPU"))
  reason = cusparselt.CusparseltBackend().unavailable_reason()
  assert "NVIDIA GPU" in reason and "'cpu'" in reason
  assert jsparse24.selected_implementation((4096, 4096), (4096, 4096), jnp.bfloat16) == "xla"


def test_auto_choice_checks_availability_only_for_shapes_it_would_take(monkeypatch):
  # Asking whether cuSPARSELt is available builds its shim on a GPU, so the
  # automatic choice must not ask for calls it would not take anyway.
  monkeypatch.setattr(cusparselt.CusparseltBackend, "unavailable_reason",
                      lambda self: pytest.fail("availability asked for a call it would not take"))
  for problem in (_problem(m=16), _problem(dtype=jnp.float32, m=1 << 16)):
    assert backends.select(None, problem).name != "cusparselt"


@pytest.mark.parametrize("loaded,refused", [("0.8.0", False), ("0.8.1", False), ("0.9.1", True),
                                            ("0.10.0", False), ("0.11.0", True), ("0.7.1", True),
                                            ("1.0.0", True)])
def test_only_a_verified_cusparselt_version_is_used(monkeypatch, loaded, refused):
  """jsparse24 writes cuSPARSELt's compressed layout itself: a library version
  whose layout was not checked is refused with a reason naming both versions
  (the backend is then unavailable: explicit requests raise, the automatic
  choice falls back)."""
  monkeypatch.setattr(build, "load", lambda: "a library")
  monkeypatch.setattr(build, "version", lambda lib: loaded)
  cusparselt._load_or_reason.cache_clear()
  try:
    lib, reason = cusparselt._load_or_reason()
  finally:
    cusparselt._load_or_reason.cache_clear()
  if refused:
    assert lib is None and f"cuSPARSELt {loaded} is loaded" in reason
    assert "0.8.x, 0.10.x only" in reason
    assert "nvidia-cusparselt-cu13>=0.10,<0.11" in reason
  else:
    assert lib == "a library" and reason is None


def test_product_traced_inside_unpartitioned_has_no_custom_partitioning(monkeypatch):
  """Forward mode traces the product inside `_tangent_p`'s lowering rule,
  under `_sharding.unpartitioned()`, where `custom_partitioning` cannot be
  lowered. The product's `custom_vmap` is cached, and reused its first trace
  (made outside, partitioned) there on jax 0.11 (0.10 traces it again): on a
  GPU `jax.linearize` of a jitted `sparse_dot` then failed in lowering. The
  FFI call is replaced by a plain function here; only the traced structure
  is checked."""
  monkeypatch.setattr(cusparselt, "_check_size", lambda *a: None)
  monkeypatch.setattr(cusparselt, "_ffi_matmul", functools.cache(
      lambda k, n, transpose, search, alg: lambda x, c: jnp.zeros((x.shape[0], n), x.dtype)))
  cusparselt._batched_matmul.cache_clear()  # pylint: disable=protected-access
  k, n = 128, 64
  x = jnp.ones((64, k), jnp.bfloat16)
  c = jnp.ones(cusparselt.buffer_shape(k, n, transpose=False), jnp.bfloat16)

  def traced():  # a new function each time: make_jaxpr caches by function
    return str(jax.make_jaxpr(lambda x, c: cusparselt.matmul(x, c, k=k, n=n))(x, c))

  assert "custom_partitioning" in traced()
  with jsparse24._sharding.unpartitioned():  # pylint: disable=protected-access
    assert "custom_partitioning" not in traced()
  assert "custom_partitioning" in traced()
  cusparselt._batched_matmul.cache_clear()  # pylint: disable=protected-access


def test_stacked_experts_run_as_one_call_per_device(monkeypatch):
  """Stacked weights under `vmap` (a mixture of experts' expert kernels):
  each product of the stack, forward and backward, is one cuSPARSELt call
  for all the stack's items (`_stacked_matmul`), not one per item in a loop
  that copies each item out of its stack; under a mesh that splits the
  stack, each device's call holds its own items only. The call is
  `tests/triton_removal.py`'s XLA stand-in, recording what it was asked;
  the values and gradients equal the "xla" backend's."""
  from tests import triton_removal  # pylint: disable=g-import-not-at-top
  calls = []

  def recording(a, b, shape, **kw):
    calls.append((tuple(shape), kw.get("batch", 1)))
    return triton_removal._stand_in_product(a, b, shape, **kw)  # pylint: disable=protected-access

  monkeypatch.setattr(cusparselt.CusparseltBackend, "unavailable_reason", lambda self: None)
  monkeypatch.setattr(cusparselt, "_check_size", lambda *a: None)
  monkeypatch.setattr(cusparselt, "_sparse_a_matmul", recording)
  cusparselt._batched_matmul.cache_clear()  # pylint: disable=protected-access
  cusparselt._stacked_matmul.cache_clear()  # pylint: disable=protected-access
  e, m, k, n = 4, 40, 64, 64  # 40 rows: padded to a multiple of PAD_M inside
  x = jax.random.normal(jax.random.key(0), (e, m, k), jnp.bfloat16)
  ws = jax.random.normal(jax.random.key(1), (e, k, n), jnp.bfloat16)

  def loss(impl):
    product = jax.vmap(lambda x, w: jsparse24.sparse_dot(x, w, transposable=True,
                                                         implementation=impl))
    return lambda x, w: jnp.sum(product(x, w).astype(jnp.float32) ** 2)

  grad = jax.value_and_grad(loss("cusparselt"), (0, 1))
  with interpret_mode():
    want = jax.jit(jax.value_and_grad(loss("xla"), (0, 1)))(x, ws)
    got = jax.jit(grad)(x, ws)
    # The forward product and dx, each one call of the whole stack (the
    # unstacked calls recorded are custom_vmap's traces of the function it
    # batches, not in the program), and no loop over the stack's items in
    # the step, its compression included.
    assert {((e, 48, n), e), ((e, 48, k), e)} <= set(calls), calls
    jaxpr = str(jax.make_jaxpr(grad)(x, ws))
    assert "scan[" not in jaxpr and "while[" not in jaxpr, jaxpr
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    stack = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    calls.clear()
    split = jax.jit(grad)(jax.device_put(x, stack), jax.device_put(ws, stack))
  # Under the mesh each device's calls hold its own item of the stack.
  assert {((e // 4, 48, n), e // 4), ((e // 4, 48, k), e // 4)} <= set(calls), calls
  for g, s, r in zip(jax.tree.leaves(got), jax.tree.leaves(split), jax.tree.leaves(want)):
    for a in (g, s):
      err = float(jnp.linalg.norm((a - r).astype(jnp.float32))
                  / jnp.linalg.norm(r.astype(jnp.float32)))
      assert err < 1e-2, err
  cusparselt._batched_matmul.cache_clear()  # pylint: disable=protected-access
  cusparselt._stacked_matmul.cache_clear()  # pylint: disable=protected-access


def test_stacked_mvue_weight_grads_run_as_one_call_per_device(monkeypatch):
  """The MVUE weight gradient of stacked experts under `vmap` (each with its
  own key): one cuSPARSELt call for the whole stack (`stacks=True` of
  `rows_contracted`), no loop over the items, each item what the unstacked
  call makes with its key (the tail of M % 4 rows included); under a mesh
  that splits the stack and the rows, each device's call holds its own
  items and rows, and the sums over the rows equal the whole's. The call is
  `tests/triton_removal.py`'s XLA stand-in, recording what it was asked."""
  from tests import triton_removal  # pylint: disable=g-import-not-at-top
  calls = []

  def recording(a, b, shape, **kw):
    calls.append((tuple(shape), kw.get("batch", 1)))
    return triton_removal._stand_in_product(a, b, shape, **kw)  # pylint: disable=protected-access

  monkeypatch.setattr(cusparselt, "_check_size", lambda *a: None)
  monkeypatch.setattr(cusparselt, "_sparse_a_matmul", recording)
  e, k, n = 2, 64, 64
  stacked = jax.vmap(cusparselt.mvue_weight_grad)
  one = jax.jit(cusparselt.mvue_weight_grad)
  keys = jax.random.split(jax.random.key(2), e)
  for m in (42, 64):  # 42: 40 rows padded to 64 and a tail of 2 rows
    x = jax.random.normal(jax.random.key(0), (e, m, k), jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(1), (e, m, n), jnp.bfloat16)
    with interpret_mode():
      calls.clear()
      got = jax.jit(stacked)(x, dy, keys)
      # (An unstacked call recorded is custom_vmap's trace of the function it
      # batches, not in the program; the jaxpr has no loop.)
      assert ((e, k, n), e) in calls, calls
      jaxpr = str(jax.make_jaxpr(stacked)(x, dy, keys))
      assert "scan[" not in jaxpr and "while[" not in jaxpr, jaxpr
      want = jnp.stack([one(x[i], dy[i], keys[i]) for i in range(e)])
    assert got.shape == (e, k, n) and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  # m = 64: 2 x 2 devices, the stack on one axis, the rows (32 each) on the
  # other; Auto axes (custom_partitioning) and Explicit ones (shard_map).
  for axis_type in (jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit):
    mesh = jax.make_mesh((2, 2), ("expert", "data"), axis_types=(axis_type,) * 2,
                         devices=jax.devices()[:4])
    split = lambda a, spec: jax.device_put(a, jax.sharding.NamedSharding(  # noqa: E731
        mesh, jax.sharding.PartitionSpec(*spec)))
    with interpret_mode():
      calls.clear()
      parts = jax.jit(stacked)(split(x, ("expert", "data")), split(dy, ("expert", "data")),
                               split(keys, ("expert",)))
    # (On Auto axes the whole stack's call recorded is the trace of the op
    # before XLA splits it.)
    assert ((e // 2, k, n), e // 2) in calls, (axis_type, calls)
    # The same draws; the two halves' sums are rounded to bfloat16 before they are added.
    np.testing.assert_allclose(np.asarray(parts, np.float32), np.asarray(want, np.float32),
                               rtol=2e-2, atol=2e-2 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("transposable", [False, True])
def test_operand_roles_fit_the_operand(transposable):
  """Tensor parallelism reads the operand's blocks by `operand_roles`: one
  roles string per array, its letters one per axis, the same structure and
  static shape as the operand (or `shard_map` refuses the specs)."""
  k, n = 128, 64
  op = cusparselt.Operand(jnp.zeros(cusparselt.buffer_shape(k, n, transpose=False)),
                          jnp.zeros(cusparselt.buffer_shape(k, n, transpose=True))
                          if transposable else None,
                          jnp.zeros((n, k // 8), jnp.uint8), (k, n))
  roles = cusparselt.CusparseltBackend().operand_roles(op)
  assert jax.tree.structure(roles) == jax.tree.structure(op)
  assert roles.meta == "nk" and roles.fwd == "kn"
  for a, r in zip(jax.tree.leaves(op), jax.tree.leaves(roles)):
    assert len(r) == a.ndim


def test_cusparselt_product_sits_behind_an_optimization_barrier():
  """The cuSPARSELt matmul's result goes through an optimization barrier
  (so that XLA's GPU dynamic-slice fusion cannot compute it twice; the
  effect itself is checked on a GPU by
  test_gpu.py::test_cusparselt_product_is_not_computed_twice_under_scan).
  Lowered only: the FFI target needs a GPU to compile."""
  a = jnp.zeros((576, 128), jnp.bfloat16)
  b = jnp.zeros((256, 128), jnp.bfloat16)
  f = lambda a, b: cusparselt._sparse_a_matmul(  # noqa: E731
      a, b, (256, 128), m=128, n=256, k=512, op_a=0, op_b=0, search=0, alg=0)
  text = jax.jit(f).lower(a, b).as_text()
  call = re.search(r"(%\S+) = stablehlo.custom_call @jsparse24_cusparselt_matmul", text)
  assert call, text
  assert re.search(rf"stablehlo.optimization_barrier {re.escape(call.group(1))}\b", text), text


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_mvue_weight_grad_partial_sums_are_in_the_products_dtype(dtype, monkeypatch):
  """The MVUE weight gradient's per-device partial sums, which data
  parallelism all-reduces, are in x's dtype (what the sparse product
  writes), as XLA's dense `x^T dy` is: a float32 result doubles the
  all-reduce's bytes (docs/design_notes.md, "cuSPARSELt: the MVUE weight
  gradient all-reduced in the input's dtype"). Traced
  only: the FFI target needs a GPU to run, and cuSPARSELt's size query a
  GPU too (skipped here)."""
  monkeypatch.setattr(cusparselt, "_check_size", lambda *a: None)
  x = jax.ShapeDtypeStruct((256, 128), dtype)
  dy = jax.ShapeDtypeStruct((256, 192), dtype)
  local = cusparselt._mvue_weight_grad_local(0, 0, True)
  seed = jax.ShapeDtypeStruct((2,), jnp.uint32)
  i = jax.ShapeDtypeStruct((), jnp.int32)
  for m in (256, 254):  # with and without the exact tail of M % 4 rows
    xm, dym = (jax.ShapeDtypeStruct((m,) + a.shape[1:], dtype) for a in (x, dy))
    with interpret_mode():
      out = jax.eval_shape(lambda *a: local(*a[:4], 192, a[4]), xm, dym, i, i, seed)
    assert out.shape == (128, 192) and out.dtype == dtype, out
  with interpret_mode():
    whole = jax.eval_shape(cusparselt.mvue_weight_grad, x, dy, jax.random.key(0))
  assert whole.dtype == dtype, whole


# --- a Sparse24 in cuSPARSELt's layout (`compress(..., cusparselt=True)`) ----------


def _codes(sp):
  """The 4-bit codes `[..., N, K/4]` of a Sparse24's metadata."""
  low, high = sp.meta & 0xF, sp.meta >> 4
  return jnp.stack([low, high], axis=-1).reshape(*sp.meta.shape[:-1], -1)[..., :sp.shape[-2] // 4]


@pytest.mark.parametrize("shape,dtype", [((64, 64), jnp.bfloat16), ((192, 320), jnp.float16),
                                         ((3, 256, 128), jnp.bfloat16)])
def test_cusparselt_layout_holds_the_values_then_cusparselts_metadata(shape, dtype):
  """The kept values unchanged in the first N rows, then the metadata bytes
  of `metadata_layout` (the byte-by-byte definition checked against
  cusparseLtSpMMACompress2's recorded bytes) for the `[N, K/4]` codes: the
  transposed buffer of `w^T` (`buffer_shape(N, K, transpose=True)`)."""
  w = jax.random.normal(jax.random.key(sum(shape)), shape, dtype)
  sp = jsparse24.compress(w)
  sc = jsparse24.compress(w, cusparselt=True)
  *lead, k, n = shape
  assert sc.cusparselt and not sp.cusparselt and sc.shape == sp.shape == tuple(shape)
  assert sc.values.shape == (*lead, *cusparselt.buffer_shape(n, k, transpose=True))
  assert sc.nbytes == sp.nbytes + int(np.prod(lead, dtype=int)) * n * k // 8
  np.testing.assert_array_equal(_bytes(sc.values[..., :n, :]), _bytes(sp.values))
  np.testing.assert_array_equal(_bytes(sc.meta), _bytes(sp.meta))
  for i in np.ndindex(*lead):
    tail = _bytes(sc.values[i][n:])
    np.testing.assert_array_equal(tail, np.asarray(cusparselt.metadata_layout(_codes(sp)[i])))
  np.testing.assert_array_equal(jsparse24.decompress(sc), jsparse24.decompress(sp))


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_cusparselt_layout_multiplies_as_the_portable_one(m, implementation):
  """The decode kernel reads the first N rows of the buffer in place: the
  same bits as on the portable Sparse24; the gradient in the buffer is the
  kept values' in its first N rows and zero on the metadata rows."""
  k, n = 192, 320
  w = jax.random.normal(jax.random.key(m), (k, n), jnp.bfloat16)
  x = jax.random.normal(jax.random.key(m + 1), (m, k), jnp.bfloat16)
  sp, sc = jsparse24.compress(w), jsparse24.compress(w, cusparselt=True)

  def loss(x, s):
    return jnp.sum(jsparse24.sparse_dot(x, s, implementation=implementation)
                   .astype(jnp.float32) ** 2)

  with interpret_mode():
    y = jax.jit(lambda x, s: jsparse24.sparse_dot(x, s, implementation=implementation))
    np.testing.assert_array_equal(_bytes(y(x, sc)), _bytes(y(x, sp)))
    (gx, gc), (wx, wp) = [jax.jit(jax.grad(loss, (0, 1), allow_int=True))(x, s)
                          for s in (sc, sp)]
  np.testing.assert_array_equal(_bytes(gx), _bytes(wx))
  assert gc.values.shape == sc.values.shape
  np.testing.assert_array_equal(_bytes(gc.values[:n]), _bytes(wp.values))
  assert not np.asarray(gc.values[n:], np.float32).any()


def test_cusparselt_layout_errors_name_the_fix():
  w = jax.random.normal(jax.random.key(0), (128, 64), jnp.float32)
  with pytest.raises(ValueError, match=r"compress: cusparselt=True needs bfloat16 or float16"
                                       r" .*got float32; cast the weight"):
    jsparse24.compress(w, cusparselt=True)
  with pytest.raises(ValueError, match=r"compress: cusparselt=True needs K and N multiples of"
                                       r" 64 .*got K=96, N=64; pass cusparselt=False"):
    jsparse24.compress(w[:96].astype(jnp.bfloat16), cusparselt=True)
  with pytest.raises(ValueError, match="compressed must be False, True or 'cusparselt'"):
    jsparse24.selected_implementation((1, 128), (128, 64), jnp.bfloat16, compressed="yes")
  sc = jsparse24.compress(w.astype(jnp.bfloat16), cusparselt=True)
  mesh = jax.make_mesh((8,), ("model",))
  with pytest.raises(ValueError, match=r"sparse_dot: a Sparse24 in cuSPARSELt's layout"
                                       r" .*cannot be split across devices \(weight_sharding\)"):
    jsparse24.sparse_dot(jnp.ones((8, 128), jnp.bfloat16), sc, implementation="xla",
                         weight_sharding=jax.sharding.NamedSharding(
                             mesh, jax.sharding.PartitionSpec(None, "model")))


def test_cusparselt_layout_cast_keeps_the_kept_values():
  """A cast (a layer computing in another dtype) gives the portable layout:
  the metadata rows are bits, not numbers."""
  w = jax.random.normal(jax.random.key(0), (128, 64), jnp.bfloat16)
  sc = jsparse24.compress(w, cusparselt=True)
  assert sc.astype(jnp.bfloat16) is sc
  f32 = sc.astype(jnp.float32)
  assert not f32.cusparselt and f32.values.shape == (64, 64) and f32.dtype == jnp.float32
  np.testing.assert_array_equal(jsparse24.decompress(f32),
                                jsparse24.decompress(sc).astype(jnp.float32))


def test_an_h100_keeps_256_row_products_of_compressed_ffn_weights_off_cusparselt(monkeypatch):
  """On an H100 a compressed 4096 x 16384, 8192 x 4096, 8192 x 8192 or
  16384 x 4096 weight takes cuSPARSELt from 257 rows (its decode kernel ran
  faster at 256; past 256 rows only decompress + XLA is left), elsewhere and
  on other GPUs from AUTO_MIN_M_COMPRESSED's 256."""
  backend = cusparselt.CusparseltBackend()
  problem = lambda m, k, n: backends.Problem(  # noqa: E731
      m=m, k=k, n=n, dtype=jnp.dtype(jnp.bfloat16), transposable=False, platform="gpu",
      compressed=True)
  table = cusparselt.AUTO_MIN_M_COMPRESSED
  assert table[2][4] == table[3][2] == table[3][3] == table[4][2] == 256
  for kind, h100 in (("NVIDIA H100 80GB HBM3", True), ("NVIDIA H200", False)):
    monkeypatch.setattr(cusparselt.pallas_backend, "_gpu_kind", lambda kind=kind: kind)
    for k, n in ((4096, 16384), (8192, 4096), (8192, 8192), (16384, 4096)):
      assert backend.prefers(problem(256, k, n)) is not h100, (kind, k, n)
      assert backend.prefers(problem(257, k, n)), (kind, k, n)
    assert backend.prefers(problem(256, 4096, 12288))  # cells the H100 kept
    assert backend.prefers(problem(256, 8192, 16384))


@pytest.mark.parametrize("gpu", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"])
@pytest.mark.parametrize("cusparselt_layout", [False, True])
def test_a_compressed_weight_past_the_decode_kernels_multiplies_decompressed_only_where_it_won(
    monkeypatch, gpu, cusparselt_layout):
  """Past the decode kernels' last row (DECODE_MAX_M) a compressed weight
  multiplies on cuSPARSELt or decompressed. In every cell of K, N =
  2048-16384 where its table starts cuSPARSELt after a sweep's 256 rows,
  cuSPARSELt measured no faster than decompress + XLA (by AUTO_MARGIN) at
  256 rows or at a swept M before its start (K, N = (2048, 2048), (2048,
  4096), (4096, 2048) re-laid out; (2048, 2048) in cuSPARSELt's layout);
  elsewhere cuSPARSELt takes every row past the kernels: a d_model 4096
  model's out, up and down projections (4096 x 4096, 4096 x 16384, 16384 x
  4096) at 257-511 rows, say, on both GPUs."""
  monkeypatch.setattr(cusparselt.CusparseltBackend, "unavailable_reason", lambda self: None)
  monkeypatch.setattr(cusparselt.pallas_backend, "_gpu_kind", lambda: gpu)
  rows = cusparselt.pallas_backend.DECODE_MAX_M + 1
  decompressed_won = ({(2048, 2048)} if cusparselt_layout
                      else {(2048, 2048), (2048, 4096), (4096, 2048)})
  compressed = "cusparselt" if cusparselt_layout else True
  for k in (2048, 4096, 8192, 16384):
    for n in (2048, 4096, 8192, 16384):
      pick = lambda m: jsparse24.selected_implementation(  # noqa: E731, B023
          (m, k), (k, n), jnp.bfloat16, compressed=compressed)
      picked = pick(rows)
      assert picked == ("xla" if (k, n) in decompressed_won else "cusparselt"), (k, n, picked)
      # The rows between the sweep's 256 and 512 follow the row past the kernels.
      assert pick(511) == picked, (k, n)


def test_automatic_choice_reads_the_cusparselt_layout_table():
  """A weight in cuSPARSELt's layout takes cuSPARSELt from its own table's
  rows (no re-layout per call), the portable one from AUTO_MIN_M_COMPRESSED."""
  backend = cusparselt.CusparseltBackend()
  problem = backends.Problem(m=128, k=4096, n=8192, dtype=jnp.dtype(jnp.bfloat16),
                             transposable=False, platform="gpu", compressed=True)
  assert cusparselt.AUTO_MIN_M_CUSPARSELT_LAYOUT[2][3] == 128
  assert cusparselt.AUTO_MIN_M_COMPRESSED[2][3] == 256
  assert backend.prefers(dataclasses.replace(problem, cusparselt_layout=True))
  assert not backend.prefers(problem)
  assert backend.prefers(dataclasses.replace(problem, m=256))
