"""Bad input gets a clear error naming the function and the argument, and
failures of the environment are reported once, not crashed on (issue 11)."""

import jax.numpy as jnp
import pytest

import jsparse24
from jsparse24.backends import _cusparselt_build as build
from jsparse24.backends import cusparselt


@pytest.mark.parametrize("call,match", [
    (lambda: jsparse24.sparse_dot(jnp.ones((2, 0)), jnp.ones((0, 4))),
     r"sparse_dot: `w.shape\[0\]` = 0"),
    (lambda: jsparse24.sparse_dot(jnp.ones((2, 8)), jnp.ones((8, 0))),
     r"sparse_dot: `w.shape\[1\]` = 0"),
    (lambda: jsparse24.compress(jnp.ones((8, 0))), r"compress: `w.shape\[1\]` = 0"),
    (lambda: jsparse24.compress(jnp.ones((0, 4))), r"compress: `w.shape\[0\]` = 0"),
])
def test_zero_size_weights_are_refused_by_name(call, match):
  with pytest.raises(ValueError, match=match):  # was ZeroDivisionError
    call()


@pytest.mark.parametrize("call,fn", [
    (lambda w: jsparse24.sparse_dot(jnp.ones((2, 8)), w), "sparse_dot"),
    (lambda w: jsparse24.compress(w), "compress"),
    (lambda w: jsparse24.prune_24(w), "prune_24"),
])
def test_float8_weights_are_refused_by_name(call, fn):
  w = jnp.ones((8, 4), jnp.float8_e4m3fn)
  with pytest.raises(TypeError, match=rf"{fn}: `w` must have a floating dtype"):  # was KeyError
    call(w)


def test_unwritable_cache_directory_is_a_build_error_remembered(tmp_path, monkeypatch):
  """A cache path that is not a directory made the automatic choice crash
  (NotADirectoryError) on every trace; now the backend is unavailable with
  the reason, and the build is not retried."""
  try:
    toolchain = build.find_toolchain()
  except build.BuildError as e:
    pytest.skip(f"no toolchain to build the shim here: {e}")
  not_a_dir = tmp_path / "file"
  not_a_dir.write_text("")
  with pytest.raises(build.BuildError, match="JSPARSE24_CACHE_DIR"):
    build.build(toolchain, not_a_dir)
  monkeypatch.setenv("JSPARSE24_CACHE_DIR", str(not_a_dir))
  calls = []
  real = build.load
  monkeypatch.setattr(build, "load", lambda: calls.append(1) or real())
  cusparselt._load_or_reason.cache_clear()
  try:
    lib, reason = cusparselt._load_or_reason()
    assert lib is None and "JSPARSE24_CACHE_DIR" in reason, reason
    assert cusparselt._load_or_reason()[1] == reason
    assert len(calls) == 1
  finally:
    cusparselt._load_or_reason.cache_clear()


def test_find_library_prefers_unversioned_then_the_highest_version(tmp_path):
  lib = tmp_path / "lib"
  lib.mkdir()
  for name in ("libfoo.so.0", "libfoo.so.0.8.0", "libfoo.so.0.10.1"):
    (lib / name).write_text("")
  assert build._find_library("libfoo", [tmp_path]).name == "libfoo.so.0.10.1"  # not 0.8.0
  (lib / "libfoo.so").write_text("")
  assert build._find_library("libfoo", [tmp_path]).name == "libfoo.so"


def test_freeze_at_the_end_of_the_warmup_still_builds_the_masks_once():
  """Documented: the warm-up's closing build is not a periodic rebuild."""
  from jsparse24.optim import MaskSchedule
  s = MaskSchedule(warmup_steps=3, rebuild_every=2, freeze_after=3)
  assert [t for t in range(12) if bool(s.rebuild(t))] == [3]


def test_the_formats_import_no_backend():
  """Layering: the dispatch (`_ops`) sits above the formats; `_format` and
  `_prune` import no backend (the import cycle through `compress` is gone)."""
  import ast
  import pathlib
  root = pathlib.Path(jsparse24.__file__).parent
  for name in ("_format.py", "_prune.py", "_checks.py"):
    for node in ast.walk(ast.parse((root / name).read_text())):
      mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
              [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
              if isinstance(node, ast.ImportFrom) else [])
      assert not any("backends" in m or m.endswith("_ops") for m in mods), (name, mods)
