"""Bad input gets a clear error naming the function and the argument, and
failures of the environment are reported once, not crashed on (issue 11)."""

import dataclasses

import jax
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


@pytest.mark.parametrize("w,kw,error,match", [
    (jnp.ones((8, 8), jnp.int32), {}, TypeError, r"`w` must have a floating dtype"),
    (jnp.ones((8,)), {}, ValueError, r"`w` must be \[\.\.\., K, N\] \(rank >= 2\)"),
    (jnp.ones((6, 8)), {}, ValueError, r"`w.shape\[0\]` = 6 \(the contraction axis\)"),
    (jnp.ones((8, 6)), {"transposable": True}, ValueError,
     r"`w.shape\[1\]` = 6 \(N, for a transposable mask\)"),
])
def test_mask24_from_weights_names_itself(w, kw, error, match):
  """Its errors named `prune_24`, which it calls."""
  with pytest.raises(error, match=r"Mask24.from_weights: " + match):
    jsparse24.Mask24.from_weights(w, **kw)


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


def _net_and_vars():
  import flax.linen as nn

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return jsparse24.SparseDense(8, name="up")(x)

  net = Net()
  return net, net.init(jax.random.key(1), jnp.ones((2, 16)))


def _plain():
  import flax.linen as nn

  class Plain(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(8, name="up")(x)

  return Plain()


def _bad_calls():
  from jsparse24 import optim
  w = jax.random.normal(jax.random.key(0), (16, 8))
  sp, m = jsparse24.compress(w), jsparse24.Mask24.from_weights(w)
  _, v = _net_and_vars()
  x = jnp.ones((2, 16))
  return [
      (lambda: jsparse24.prune_24(sp), TypeError, r"prune_24: `w` is a Sparse24"),
      (lambda: jsparse24.prune_24(m), TypeError, r"prune_24: `w` is a Mask24"),
      (lambda: jsparse24.compress(sp), TypeError, r"compress: `w` is a Sparse24"),
      (lambda: jsparse24.sparse_dot(x, m), TypeError, r"sparse_dot: `w` is a Mask24"),
      (lambda: jsparse24.sparse_dot(sp, w), TypeError, r"sparse_dot: `x` is a Sparse24"),
      (lambda: jsparse24.rebuild_masks(v["sparsity"], v["sparsity"]), ValueError,
       r"rebuild_masks: `params` has no kernel for the sparse layer 'up'"),
      (lambda: jsparse24.compress_params(
          jsparse24.compress_params(v["params"], v["sparsity"]), v["sparsity"]),
       TypeError, r"compress_params: the kernel of layer 'up' is already a Sparse24"),
      (lambda: optim.mask_update(v["params"]), ValueError, r"mask_update: `sparsity` holds no Mask24"),
      (lambda: optim.mask_update(v["sparsity"], 100), TypeError,
       r"mask_update: `schedule` must be a MaskSchedule"),
      (lambda: jsparse24.sparsify(_plain(), "up"), TypeError, r"sparsify: `rules` must be"),
      (lambda: jsparse24.sparsify(_plain(), {"up": None}), TypeError,
       r"sparsify: rule 'up': options must be"),
      (lambda: jsparse24.sparsify(_plain(), {"up[": {}}), ValueError,
       r"sparsify: rule 'up\[' is not a valid regex"),
      (lambda: optim.MaskSchedule(warmup_steps="3"), TypeError, r"MaskSchedule: warmup_steps must be an int"),
      (lambda: optim.MaskSchedule(rebuild_every=2.5), TypeError, r"MaskSchedule: rebuild_every must be an int"),
      (lambda: optim.MaskSchedule(rebuild_every=True), TypeError, r"MaskSchedule: rebuild_every must be an int"),
      (lambda: jsparse24.selected_implementation((2, 16), (16, 8), jnp.int32), TypeError,
       r"selected_implementation: `dtype`"),
      (lambda: jsparse24.selected_implementation((2, 15), (15, 8), jnp.float32), ValueError,
       r"selected_implementation: `w.shape\[0\]` = 15"),
      (lambda: jsparse24.is_24(jnp.ones((8, 4))), TypeError, r"is_24: `mask` must be a bool"),
      (lambda: jsparse24.nnx.rebuild_masks({"a": 1}), TypeError, r"rebuild_masks: `model` must be an nnx.Module"),
      (lambda: (lambda tx: tx.update({"up": {"bias": jnp.zeros(8)}}, tx.init(v["params"]), v["params"]))(
          optim.mask_update(v["sparsity"], decay=0.1)), ValueError,
       r"mask_update: the gradients and the params differ in structure \(missing from the"
       r" gradients: \[\"\['up'\]\['kernel'\]\"\]"),
  ]


@pytest.mark.parametrize("index", range(20))
def test_wrong_objects_and_types_get_errors_that_name_function_and_argument(index):
  call, kind, match = _bad_calls()[index]
  with pytest.raises(kind, match=match):
    call()


def test_a_non_24_bool_mask_inside_jit_gives_one_answer_on_every_path():
  """Documented: inside jit a bool mask is read as Mask24.pack reads it, on
  every backend and through compress (the "xla" product used the raw mask,
  the compressed paths pack's reading)."""
  import numpy as np
  from jsparse24.backends.pallas import interpret_mode
  w = jax.random.normal(jax.random.key(0), (16, 8))
  x = jax.random.normal(jax.random.key(1), (4, 16))
  m = np.array(jsparse24.prune_24(w))
  m[0:4, 0] = [True, True, True, False]  # 3 kept
  m[4:8, 1] = [False, False, False, True]  # 1 kept
  m[8:12, 2] = False  # none kept
  m = jnp.asarray(m)
  packed = jax.jit(lambda m: jsparse24.Mask24.pack(m).unpack())(m)
  assert bool(jsparse24.is_24(packed, axis=0))  # every group read as a valid 2:4 pattern
  np.testing.assert_array_equal(packed[0:4, 0], [True, False, True, False])  # first, last
  np.testing.assert_array_equal(packed[4:8, 1], [True, False, False, True])  # + lowest other
  np.testing.assert_array_equal(packed[8:12, 2], [True, False, False, True])  # none: 0 and 3
  with interpret_mode():
    outs = {
        impl: jax.jit(lambda x, w, m, impl=impl: jsparse24.sparse_dot(x, w, m, implementation=impl))(x, w, m)
        for impl in ("xla", "pallas")}
    outs["compress"] = jax.jit(lambda x, w, m: jsparse24.sparse_dot(
        x, jsparse24.compress(w, m, implementation="xla")))(x, w, m)
  want = x @ jnp.where(packed, w, 0)
  for name, y in outs.items():
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5, err_msg=name)
  with pytest.raises(ValueError, match="not 2:4"):  # outside jit: checked
    jsparse24.sparse_dot(x, w, m)


def test_compressed_params_with_a_dense_phase_layer_say_what_is_missing():
  """compress_params keeps the dense kernel of a layer in a dense phase
  (documented); applying such params without the collection names why."""
  net, v = _net_and_vars()
  off = {"up": {**v["sparsity"]["up"], "active": jnp.array(False)}}
  compressed = jsparse24.compress_params(v["params"], off)
  assert not isinstance(compressed["up"]["kernel"], jsparse24.Sparse24)
  with pytest.raises(ValueError, match=r"SparseDense 'up' takes its 2:4 mask.*dense phase, active=False"):
    net.apply({"params": compressed}, jnp.ones((2, 16)))
  y = net.apply({"params": compressed, "sparsity": off}, jnp.ones((2, 16)))
  assert y.shape == (2, 8)


def _malformed_sparse24():
  """A compressed [16, 8] weight (with its transpose) and misassembled
  copies of it: what a hand-built Sparse24, or one restored against another
  template, may hold."""
  w = jax.random.normal(jax.random.key(0), (16, 8))
  sp = jsparse24.compress(w, transposed=True)
  bad = {
      "meta int32": (dataclasses.replace(sp, meta=sp.meta.astype(jnp.int32)), TypeError,
                     r"`{}.meta` must be uint8 .* got int32"),
      "values int": (dataclasses.replace(sp, values=sp.values.astype(jnp.int32)), TypeError,
                     r"`{}.values` must have a floating dtype"),
      "meta of 4 rows": (dataclasses.replace(sp, meta=sp.meta[:4]), ValueError,
                         r"N = 4 \(meta's rows\) and K = 16 .* want values \(4, 8\)"),
      "meta of 1 column": (dataclasses.replace(sp, meta=sp.meta[:, :1]), ValueError,
                           r"want values \(8, 8\) and meta \(8, 2\)"),
      "values 1-D": (dataclasses.replace(sp, values=sp.values[0], meta=sp.meta[0]), ValueError,
                     r"must hold values \[..., N, K/2\] and meta"),
      "meta_t alone": (dataclasses.replace(sp, values_t=None), ValueError,
                       r"one of values_t and meta_t without the other"),
      "values_t of another weight": (
          dataclasses.replace(sp, values_t=sp.values_t[:8]), ValueError,
          r"`{}.values_t` must be float32\[16, 4\] .* got float32\[8, 4\]"),
  }
  return sp, bad


@pytest.mark.parametrize("case", list(_malformed_sparse24()[1]))
def test_a_malformed_sparse24_is_named_before_any_op_runs(case):
  """Was a broadcasting error from inside `decompress` (values and meta of
  different N or K), or ran on (int32 metadata, integer values)."""
  sp, bad = _malformed_sparse24()
  x = jnp.ones((2, 16))
  assert jnp.array_equal(jsparse24.sparse_dot(x, sp), x @ jsparse24.decompress(sp))  # well formed
  broken, error, match = bad[case]
  with pytest.raises(error, match="decompress: .*" + match.format("sp")):
    jsparse24.decompress(broken)
  with pytest.raises(error, match="sparse_dot: .*" + match.format("w")):
    jax.jit(jsparse24.sparse_dot)(x, broken)
  if case == "values int":
    return  # a layer promotes its kernel to its dtype first, as nn.Dense does
  layer = jsparse24.SparseDense(8)
  variables = layer.init(jax.random.key(0), x)
  params = {"params": {**variables["params"], "kernel": broken}}
  with pytest.raises(error, match="SparseDense: .*" + match.format("kernel")):
    layer.apply(params, x)
