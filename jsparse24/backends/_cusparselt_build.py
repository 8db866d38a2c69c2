"""Builds, caches and loads the cuSPARSELt FFI shim (`cusparselt_ffi.cc`).

The shim is compiled on first use with the machine's C++ compiler, the way
Triton builds its launcher: against the cuSPARSELt and CUDA runtime headers
(from the `nvidia-*` pip wheels that `pip install "jsparse24[cuda]"` brings,
or from a CUDA toolkit) and XLA's FFI headers (`jax.ffi.include_dir()`). The
library lands in `$JSPARSE24_CACHE_DIR` (default `$XDG_CACHE_HOME/jsparse24`,
else `~/.cache/jsparse24`) under a hash of what its bits depend on (the
source, the compiler, the headers' contents, the CUDA runtime it links), so
a change to any of them rebuilds and nothing else does.

The shim links the CUDA runtime (XLA's, shared by the process) but not
cuSPARSELt: `load()` has it `dlopen` the very file that `find_toolchain()`
found, by its path, as a copy whose calls stay inside it (`jsp_cusparselt_open`;
`cusparselt_ffi.cc` says how). Linked by soname, the shim would get any
`libcusparseLt.so.0` already in the process instead -- torch loads its own at
import -- and `$JSPARSE24_CUSPARSELT_HOME` would be ignored without a word.
Opening checks that the library is the header's major.minor version. Another
library file of the header's version needs no rebuild.

Where things are looked for, first hit wins:
  1. `$JSPARSE24_CUSPARSELT_HOME` (a directory with `include/` and `lib/`),
  2. the `nvidia` pip namespace: `nvidia/cu13`, `nvidia/cu12`,
     `nvidia/cusparselt`, `nvidia/cuda_runtime`, `nvidia/cuda_nvcc`,
     `nvidia/cusparse`,
  3. `$CUDA_HOME`, `$CUDA_PATH`, `/usr/local/cuda`.
The compiler is `$CXX`, else `c++`, else `g++`.

Every missing piece raises `BuildError` saying which one and how to get it;
importing jsparse24 never builds anything.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import importlib.util
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile

_SOURCE = pathlib.Path(__file__).with_name("cusparselt_ffi.cc")
_LIBRARY_NAME = "libjsparse24_cusparselt.so"
_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared")
# -ldl: dlopen (part of libc from glibc 2.34 on). -z defs: a direct cuSPARSELt
# call (bound at load time by soname, to whichever copy the process has) fails
# the link instead of slipping into the shim.
_LINK_FLAGS = ("-ldl", "-Wl,-z,defs")
TARGETS = {
    "jsparse24_cusparselt_compress": "JspCusparseltCompress",
    "jsparse24_cusparselt_matmul": "JspCusparseltMatmul",
}
_INSTALL_HINT = ('pip install "jsparse24[cuda]" (it brings nvidia-cusparselt-cu13,'
                 ' nvidia-cuda-runtime and nvidia-cuda-crt), or set'
                 ' JSPARSE24_CUSPARSELT_HOME / CUDA_HOME to a directory with'
                 ' include/ and lib/')

log = logging.getLogger("jsparse24")


class BuildError(RuntimeError):
  """The cuSPARSELt shim cannot be built or loaded here (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Toolchain:
  """What the shim is compiled and linked with."""

  compiler: str
  include_dirs: tuple[str, ...]
  cusparselt_library: str  # path of libcusparseLt.so*, opened by the shim at load
  cudart_library: str  # path of libcudart.so*, linked
  ffi_include_dir: str

  def command(self, source: str, output: str) -> list[str]:
    cmd = [self.compiler, *_FLAGS, source, "-o", output]
    for d in (self.ffi_include_dir, *self.include_dirs):
      cmd += ["-isystem", d]
    directory, name = os.path.split(self.cudart_library)
    cmd += ["-L", directory, f"-l:{name}", f"-Wl,-rpath,{directory}"]
    return cmd + list(_LINK_FLAGS)


def search_roots() -> list[pathlib.Path]:
  """The directories searched for include/ and lib/, in order."""
  roots: list[pathlib.Path] = []
  if os.environ.get("JSPARSE24_CUSPARSELT_HOME"):
    roots.append(pathlib.Path(os.environ["JSPARSE24_CUSPARSELT_HOME"]))
  try:
    spec = importlib.util.find_spec("nvidia")
  except (ImportError, ValueError):
    spec = None
  for base in (spec.submodule_search_locations or []) if spec else []:
    for sub in ("cu13", "cu12", "cusparselt", "cuda_runtime", "cuda_nvcc", "cusparse"):
      roots.append(pathlib.Path(base) / sub)
  for var in ("CUDA_HOME", "CUDA_PATH"):
    if os.environ.get(var):
      roots.append(pathlib.Path(os.environ[var]))
  roots.append(pathlib.Path("/usr/local/cuda"))
  return [r for r in roots if r.is_dir()]


def _find_header(name: str, roots) -> pathlib.Path | None:
  for root in roots:
    path = root / "include" / name
    if path.is_file():
      return root / "include"
  return None


def _find_library(stem: str, roots) -> pathlib.Path | None:
  for root in roots:
    for sub in ("lib", "lib64", "lib/x64", "targets/x86_64-linux/lib"):
      directory = root / sub
      if not directory.is_dir():
        continue
      # Prefer the unversioned name, then the highest soname version
      # (compared as numbers: .so.0.10.1 is above .so.0.8.0).
      hits = list(directory.glob(f"{stem}.so*"))
      if hits:
        return max(hits, key=lambda p: (p.name == f"{stem}.so", _version(p.name, stem)))
  return None


def _version(name: str, stem: str) -> tuple[int, ...]:
  """`lib.so.1.2.3` -> (1, 2, 3) (a non-numeric part counts as -1)."""
  tail = name[len(f"{stem}.so"):].lstrip(".")
  return tuple(int(part) if part.isdigit() else -1 for part in tail.split(".") if part)


def _ffi_include_dir() -> str:
  import jax  # pylint: disable=g-import-not-at-top
  d = jax.ffi.include_dir()
  if not os.path.isfile(os.path.join(d, "xla", "ffi", "api", "ffi.h")):
    raise BuildError(f"XLA's FFI header xla/ffi/api/ffi.h is not under jax.ffi.include_dir() = {d};"
                     f" reinstall jaxlib.")
  return d


def find_toolchain() -> Toolchain:
  """Finds the compiler, headers and libraries, or raises BuildError."""
  compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
  if not compiler or not (os.path.isfile(compiler) or shutil.which(compiler)):
    raise BuildError(
        "no C++ compiler found to build the cuSPARSELt shim: set CXX, or install"
        " g++ (e.g. `apt install g++`).")
  roots = search_roots()
  where = ", ".join(str(r) for r in roots) or "(no candidate directory exists)"
  include_dirs: list[str] = []

  def need_header(name: str, what: str, hint: str = _INSTALL_HINT) -> pathlib.Path:
    d = _find_header(name, roots)
    if d is None:
      raise BuildError(f"{what} header {name} not found (searched {where}); {hint}.")
    if str(d) not in include_dirs:
      include_dirs.append(str(d))
    return d

  lt_dir = need_header("cusparseLt.h", "the cuSPARSELt")
  need_header("cuda_runtime_api.h", "the CUDA runtime")
  need_header("crt/host_defines.h", "the CUDA runtime's")
  lt_header = (lt_dir / "cusparseLt.h").read_text(errors="replace")
  if "cusparseLt_cusparse_stub.h" not in lt_header:
    # cuSPARSELt before 0.10 includes the toolkit's cusparse.h (and, through
    # it, CCCL's <nv/target>); the [cuda] extra's newest cuSPARSELt does not.
    need_header("cusparse.h", f"cuSPARSELt before 0.10 ({lt_dir}) needs the cuSPARSE",
                hint="pip install nvidia-cusparse nvidia-cuda-cccl, or cuSPARSELt 0.10"
                     " (pip install 'nvidia-cusparselt-cu13>=0.10,<0.11')")
  # The library next to the header first, so header and library match.
  lt_lib = _find_library("libcusparseLt", [lt_dir.parent] + roots)
  if lt_lib is None:
    raise BuildError(f"the cuSPARSELt library libcusparseLt.so not found (searched {where}); {_INSTALL_HINT}.")
  cudart = _find_library("libcudart", roots)
  if cudart is None:
    raise BuildError(f"the CUDA runtime library libcudart.so not found (searched {where}); {_INSTALL_HINT}.")
  return Toolchain(compiler=compiler, include_dirs=tuple(include_dirs),
                   cusparselt_library=str(lt_lib), cudart_library=str(cudart),
                   ffi_include_dir=_ffi_include_dir())


def cache_dir() -> pathlib.Path:
  if os.environ.get("JSPARSE24_CACHE_DIR"):
    return pathlib.Path(os.environ["JSPARSE24_CACHE_DIR"])
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "jsparse24"


def _digest(toolchain: Toolchain) -> str:
  h = hashlib.sha256()
  h.update(_SOURCE.read_bytes())
  h.update(repr((_FLAGS, _LINK_FLAGS)).encode())
  try:
    version = subprocess.run([toolchain.compiler, "--version"], capture_output=True,
                             text=True, timeout=60, check=False).stdout
  except OSError as e:
    raise BuildError(f"cannot run the C++ compiler {toolchain.compiler!r}: {e}") from e
  h.update(version.encode())
  # The headers by content, not path: an install with the same cusparseLt.h
  # elsewhere reuses the build. The cuSPARSELt library is not an input (it is
  # opened at load, and checked against the header's version there).
  headers = [os.path.join(toolchain.ffi_include_dir, "xla", "ffi", "api", n)
             for n in ("ffi.h", "api.h", "c_api.h")]
  headers += [os.path.join(d, "cusparseLt.h") for d in toolchain.include_dirs]
  for path in headers:
    if os.path.isfile(path):
      h.update(pathlib.Path(path).read_bytes())
  st = os.stat(toolchain.cudart_library)
  h.update(f"{os.path.realpath(toolchain.cudart_library)}:{st.st_size}:{st.st_mtime_ns}".encode())
  return h.hexdigest()[:20]


def build(toolchain: Toolchain | None = None, directory: os.PathLike | None = None) -> pathlib.Path:
  """Compiles the shim unless a build with the same hash is cached; returns
  the path of the shared library."""
  toolchain = toolchain or find_toolchain()
  root = pathlib.Path(directory) if directory is not None else cache_dir()
  out_dir = root / f"cusparselt-{_digest(toolchain)}"
  library = out_dir / _LIBRARY_NAME
  if library.is_file():
    return library
  try:
    out_dir.mkdir(parents=True, exist_ok=True)
    # Compile to a temporary name and rename: concurrent builds (pytest -n,
    # several processes on one host) never see a half-written library.
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out_dir)
  except OSError as e:
    raise BuildError(
        f"cannot write the cuSPARSELt shim under the cache directory {out_dir}: {e};"
        f" set JSPARSE24_CACHE_DIR to a writable directory.") from e
  os.close(fd)
  cmd = toolchain.command(str(_SOURCE), tmp)
  log.info("jsparse24: building the cuSPARSELt shim: %s", " ".join(cmd))
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
  except (OSError, subprocess.TimeoutExpired) as e:
    os.unlink(tmp)
    raise BuildError(f"compiling the cuSPARSELt shim failed: {e}\ncommand: {' '.join(cmd)}") from e
  if proc.returncode != 0:
    os.unlink(tmp)
    raise BuildError(
        f"compiling the cuSPARSELt shim failed (exit {proc.returncode}).\ncommand:"
        f" {' '.join(cmd)}\n{proc.stderr[-4000:]}")
  os.replace(tmp, library)
  return library


def open_shim(path: os.PathLike, cusparselt_library: str) -> ctypes.CDLL:
  """Loads the shim at `path` and has it open `cusparselt_library` (by that
  path) before anything else is called; returns it with its helpers' argument
  types set. Raises BuildError."""
  try:
    lib = ctypes.CDLL(str(path))
  except OSError as e:
    raise BuildError(f"cannot load the cuSPARSELt shim {path}: {e}") from e
  lib.jsp_cusparselt_open.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
  msg = ctypes.create_string_buffer(2048)
  if lib.jsp_cusparselt_open(os.fsencode(os.path.abspath(cusparselt_library)), msg, len(msg)):
    raise BuildError(msg.value.decode(errors="replace"))
  lib.jsp_cusparselt_compressed_size.argtypes = [
      ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
      ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t), ctypes.c_char_p,
      ctypes.c_size_t]
  lib.jsp_cusparselt_version.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_char_p, ctypes.c_size_t]
  lib.jsp_cusparselt_set_algorithm_cache.argtypes = [ctypes.c_char_p]
  lib.jsp_cusparselt_searches.restype = ctypes.c_int64
  return lib


@functools.cache
def load() -> ctypes.CDLL:
  """Builds (once) and loads the shim, opens in it the cuSPARSELt library that
  `find_toolchain` found, and registers its FFI targets with JAX for CUDA.
  Raises BuildError. Cached: a process uses one cuSPARSELt library (the shim
  refuses to open a second)."""
  toolchain = find_toolchain()
  lib = open_shim(build(toolchain), toolchain.cusparselt_library)
  import jax  # pylint: disable=g-import-not-at-top
  for target, symbol in TARGETS.items():
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="CUDA")
  lib.jsp_cusparselt_set_algorithm_cache(str(algorithm_cache()).encode())
  return lib


def algorithm_cache() -> pathlib.Path:
  """The file where the shim records each matmul algorithm search's result
  (keyed by GPU, cuSPARSELt version and problem), so that later processes
  reuse it instead of searching: a resumed run then computes with the same
  algorithm, bit for bit. Delete it to search again."""
  return cache_dir() / "cusparselt-algorithms.txt"


def version(lib: ctypes.CDLL) -> str:
  """The version string of the cuSPARSELt library the shim opened."""
  v = ctypes.c_int()
  msg = ctypes.create_string_buffer(512)
  if lib.jsp_cusparselt_version(ctypes.byref(v), msg, len(msg)):
    raise BuildError(msg.value.decode(errors="replace"))
  return f"{v.value // 1000000}.{(v.value // 100) % 10000}.{v.value % 100}"
