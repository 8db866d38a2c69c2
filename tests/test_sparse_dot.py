"""Tests of `jsparse24.sparse_dot`: forward, both gradient modes, transforms
(jit, vmap, pmap, checkpoint), mixed dtypes, compressed weights, argument
errors and backend dispatch.

References are computed in float64 numpy from the (upcast) inputs, or with
`jax.vjp` of the masked-dense product `x @ (w * m)` in float32; tolerances are
per dtype and scaled with the square root of the contraction length.
"""

import contextlib
import functools
import re
import sys
import zlib
from unittest import mock

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jsparse24

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
DTYPES = [BF16, F16, F32]
DTYPE_IDS = ["bf16", "f16", "f32"]
TOL = {BF16: 1e-2, F16: 2e-3, F32: 1e-5}
PAIRS = np.array([(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)])


def _rng(*parts) -> np.random.Generator:
  """A fresh generator per test and parametrization (reproducible)."""
  return np.random.default_rng(zlib.crc32(repr(parts).encode()))


def _normal(rng, shape, dtype):
  return rng.standard_normal(shape).astype(dtype)


def _f64(a) -> np.ndarray:
  return np.asarray(a).astype(np.float64)


def assert_close(got, want, dtype, contraction: int, what=""):
  """|got - want| <= tol * (|want| + sqrt(contraction)), inputs ~ N(0, 1)."""
  got = _f64(got)
  want = np.asarray(want, np.float64)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  assert np.isfinite(got).all(), f"{what}: non-finite values for finite inputs"
  tol = TOL[np.dtype(dtype)]
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.sqrt(contraction),
                             err_msg=what)


def random_24_mask(rng, k, n) -> np.ndarray:
  """A random valid 2:4 mask along K (not derived from the weights)."""
  m = np.zeros((n, k // 4, 4), bool)
  np.put_along_axis(m, PAIRS[rng.integers(0, 6, (n, k // 4))], True, axis=-1)
  return m.reshape(n, k).T.copy()


def random_transposable_mask(rng, k, n) -> np.ndarray:
  """A random 2:4 mask along both K and N: in each 4x4 block, row i keeps
  columns p[i] and q[i], two permutations with p[i] != q[i]."""
  m = np.zeros((k, n), bool)
  for bi in range(k // 4):
    for bj in range(n // 4):
      p = rng.permutation(4)
      q = p[(np.arange(4) + rng.integers(1, 4)) % 4]  # q[i] != p[i]
      block = np.zeros((4, 4), bool)
      block[np.arange(4), p] = True
      block[np.arange(4), q] = True
      m[4 * bi:4 * bi + 4, 4 * bj:4 * bj + 4] = block
  assert (m.reshape(k // 4, 4, n).sum(1) == 2).all()
  assert (m.reshape(k, n // 4, 4).sum(2) == 2).all()
  return m


_pack = jax.jit(jsparse24.Mask24.pack, static_argnames=("transposable",))
_prune = jax.jit(jsparse24.prune_24, static_argnames=("axis", "transposable"))


def make_mask(kind, w, rng):
  """-> (mask argument, transposable argument, dense reference mask)."""
  k, n = w.shape
  if kind == "dense":
    m = random_24_mask(rng, k, n)
    return m, None, m
  if kind == "dense_t":
    m = random_transposable_mask(rng, k, n)
    return m, True, m
  if kind == "mask24":
    m = random_24_mask(rng, k, n)
    return _pack(m), None, m
  if kind == "mask24_t":
    m = random_transposable_mask(rng, k, n)
    return _pack(m, transposable=True), None, m
  if kind == "none":
    return None, False, np.asarray(_prune(w))
  if kind == "none_t":
    return None, True, np.asarray(_prune(w, transposable=True))
  raise AssertionError(kind)


@functools.lru_cache(maxsize=None)
def fwd_bwd(gradient="ste", transposable=None, implementation=None, jit=True):
  """(x, w, mask, dy) -> (y, dx, dw) through `jax.vjp` of sparse_dot."""
  def f(x, w, mask, dy):
    y, vjp = jax.vjp(lambda x, w: jsparse24.sparse_dot(
        x, w, mask, gradient=gradient, transposable=transposable,
        implementation=implementation), x, w)
    return (y, *vjp(dy))
  return jax.jit(f) if jit else f


def ref_fwd_bwd(x, w, m, dy, gradient):
  """float64 references: y = x @ (w*m), dx = dy @ (w*m)^T, dw per mode."""
  x64, dy64 = _f64(x), _f64(dy)
  wm = np.where(m, _f64(w), 0.0)
  k = wm.shape[0]
  xf = x64.reshape(-1, k)
  dyf = dy64.reshape(-1, wm.shape[1])
  y = (xf @ wm).reshape(*x64.shape[:-1], wm.shape[1])
  dx = (dyf @ wm.T).reshape(x64.shape)
  dw = xf.T @ dyf
  if gradient == "masked":
    dw = np.where(m, dw, 0.0)
  return y, dx, dw


def check_against_reference(x, w, m, dy, out, gradient, what=""):
  y, dx, dw = out
  ry, rdx, rdw = ref_fwd_bwd(x, w, m, dy, gradient)
  dtype = jnp.result_type(x.dtype, w.dtype)
  k, n = m.shape
  rows = int(np.prod(x.shape[:-1]))
  assert y.dtype == dtype and dx.dtype == x.dtype and dw.dtype == w.dtype
  assert_close(y, ry, dtype, k, f"{what} y")
  assert_close(dx, rdx, dtype, n, f"{what} dx")
  assert_close(dw, rdw, dtype, rows, f"{what} dw")
  if gradient == "masked":
    assert (np.asarray(dw)[~m] == 0).all(), f"{what}: masked mode leaks gradient to pruned weights"
  else:
    assert (np.asarray(dw)[~m] != 0).any(), f"{what}: ste mode must give pruned weights a gradient"


# ---------------------------------------------------------------------------
# Forward and gradients against references.
# ---------------------------------------------------------------------------

CASES = [  # (kind, x shape, w shape): odd M and N, K in 12/20/36, batch dims.
    ("dense", (5, 12), (12, 7)),
    ("dense_t", (3, 20), (20, 8)),
    ("mask24", (2, 3, 36), (36, 5)),
    ("mask24_t", (7, 12), (12, 12)),
    ("none", (20,), (20, 3)),
    ("none_t", (2, 5, 12), (12, 8)),
]


@pytest.mark.parametrize("gradient", ["ste", "masked"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind,x_shape,w_shape", CASES, ids=[c[0] for c in CASES])
def test_forward_and_vjp(kind, x_shape, w_shape, dtype, gradient):
  rng = _rng("fb", kind, str(dtype), gradient)
  x = _normal(rng, x_shape, dtype)
  w = _normal(rng, w_shape, dtype)
  mask, transposable, m = make_mask(kind, w, rng)
  dy = _normal(rng, x_shape[:-1] + w_shape[1:], dtype)
  out = fwd_bwd(gradient, transposable)(x, w, mask, dy)
  check_against_reference(x, w, m, dy, out, gradient, f"{kind}/{gradient}")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_masked_mode_equals_vjp_of_masked_dense(dtype):
  rng = _rng("masked_ref", str(dtype))
  x, w = _normal(rng, (9, 20), dtype), _normal(rng, (20, 11), dtype)
  m = random_24_mask(rng, 20, 11)
  dy = _normal(rng, (9, 11), dtype)
  y, dx, dw = fwd_bwd("masked")(x, w, m, dy)

  def dense(x, w):  # the masked-dense product, in float32
    return jnp.dot(x, w * m, precision=jax.lax.Precision.HIGHEST)
  ry, vjp = jax.vjp(dense, x.astype(np.float32), w.astype(np.float32))
  rdx, rdw = vjp(dy.astype(np.float32))
  assert_close(y, ry, dtype, 20, "y")
  assert_close(dx, rdx, dtype, 11, "dx")
  assert_close(dw, rdw, dtype, 9, "dw")
  # ste differs from masked exactly on the pruned weights.
  _, dx2, dw2 = fwd_bwd("ste")(x, w, m, dy)
  np.testing.assert_array_equal(np.asarray(dx2), np.asarray(dx))
  np.testing.assert_array_equal(np.asarray(dw2)[m], np.asarray(dw)[m])
  assert_close(dw2, _f64(x).T @ _f64(dy), dtype, 9, "ste dw")


def test_eager_no_jit():
  rng = _rng("eager")
  x, w = _normal(rng, (3, 12), F32), _normal(rng, (12, 5), F32)
  dy = _normal(rng, (3, 5), F32)
  m = random_24_mask(rng, 12, 5)
  for gradient in ("ste", "masked"):
    out = fwd_bwd(gradient, jit=False)(x, w, m, dy)
    check_against_reference(x, w, m, dy, out, gradient, f"eager {gradient}")
  out = fwd_bwd("ste", jit=False)(x, w, None, dy)
  check_against_reference(x, w, np.asarray(_prune(w)), dy, out, "ste", "eager none")


def test_mask_none_equals_prune():
  rng = _rng("none")
  x, w = _normal(rng, (4, 20), F32), _normal(rng, (20, 8), F32)
  f = jax.jit(jsparse24.sparse_dot, static_argnames=("transposable",))
  for transposable in (False, True):
    m = _prune(w, transposable=transposable)
    np.testing.assert_array_equal(np.asarray(f(x, w, None, transposable=transposable)),
                                  np.asarray(f(x, w, m)))
    mk = _pack(m, transposable=transposable)
    np.testing.assert_array_equal(np.asarray(f(x, w, mk)), np.asarray(f(x, w, m)))


def test_precision_argument():
  rng = _rng("precision")
  x, w = _normal(rng, (4, 12), F32), _normal(rng, (12, 6), F32)
  m = random_24_mask(rng, 12, 6)
  y = jax.jit(functools.partial(jsparse24.sparse_dot, precision=jax.lax.Precision.HIGHEST))(x, w, m)
  assert_close(y, _f64(x) @ np.where(m, _f64(w), 0), F32, 12)
  # The argument reaches every product of the step (forward and both
  # gradients): on CPU the numbers alone cannot tell (f32 is exact there).
  for precision in (jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT):
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: jsparse24.sparse_dot(
        x, w, m, precision=precision).sum(), (0, 1)))(x, w)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 3, dots
    for e in dots:
      got = e.params["precision"]
      got = got if isinstance(got, tuple) else (got, got)
      want = None if precision == jax.lax.Precision.DEFAULT else precision
      assert all(p == want or (want is None and p in (None, jax.lax.Precision.DEFAULT))
                 for p in got), (precision, got)


def test_nonfinite_weights_pruned_do_not_leak():
  """NaN/inf in pruned weights must not reach y or dx (masking, not x*0)."""
  rng = _rng("nonfinite")
  x, w = _normal(rng, (3, 12), F32), _normal(rng, (12, 5), F32)
  m = random_24_mask(rng, 12, 5)
  w_bad = np.where(m, w, np.where(rng.random(w.shape) < 0.5, np.nan, np.inf)).astype(F32)
  dy = _normal(rng, (3, 5), F32)
  for gradient in ("ste", "masked"):
    out = fwd_bwd(gradient)(x, w_bad, m, dy)
    check_against_reference(x, w, m, dy, out, gradient, gradient)


def _eqns(jaxpr):
  """Every equation of `jaxpr` and of the jaxprs inside its equations."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _eqns(inner)


def test_reference_masking_makes_no_weight_sized_zeros():
  """The reference backend masks a weight with no array of zeros of its
  shape, forward and backward (the default straight-through gradient): XLA
  hoisted `where(mask, w, 0)`'s broadcast zero out of `nn.scan`'s loops
  and wrote it every step, a kernel per layer kind."""
  rng = _rng("no-zeros")
  x, w = _normal(rng, (3, 16), F32), _normal(rng, (16, 8), F32)
  mask = jsparse24.Mask24.pack(random_24_mask(rng, 16, 8))
  for gradient in ("ste", "masked"):
    def loss(w, gradient=gradient):
      return jsparse24.sparse_dot(x, w, mask, gradient=gradient, implementation="xla").sum()
    programs = {"forward": jax.make_jaxpr(loss)(w).jaxpr}
    if gradient == "ste":
      programs["gradient"] = jax.make_jaxpr(jax.grad(loss))(w).jaxpr
    for name, jaxpr in programs.items():
      zeros = [e for e in _eqns(jaxpr) if e.primitive.name == "broadcast_in_dim"
               and e.outvars[0].aval.shape == w.shape
               and e.outvars[0].aval.dtype != jax.dtypes.float0]  # a symbolic zero tangent
      assert not zeros, (gradient, name, zeros)


# ---------------------------------------------------------------------------
# Transforms: jit (above), vmap, pmap, checkpoint.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("gradient", ["ste", "masked"])
def test_vmap_over_x(gradient):
  rng = _rng("vmapx", gradient)
  b, mm, k, n = 3, 5, 12, 7
  xb, w = _normal(rng, (b, mm, k), F32), _normal(rng, (k, n), F32)
  dyb = _normal(rng, (b, mm, n), F32)
  m = random_24_mask(rng, k, n)

  def f(xb, w):
    return jax.vmap(lambda x: jsparse24.sparse_dot(x, w, m, gradient=gradient))(xb)
  y, vjp = jax.vjp(jax.jit(f), xb, w)
  dx, dw = jax.jit(vjp)(dyb)
  check_against_reference(xb, w, m, dyb, (y, dx, dw), gradient, "vmap x")


@pytest.mark.parametrize("gradient", ["ste", "masked"])
@pytest.mark.parametrize("kind", ["dense", "mask24_t", "none"])
def test_vmap_over_stacked_weights(kind, gradient):
  rng = _rng("vmapw", kind, gradient)
  b, mm, k, n = 3, 5, 20, 8
  x = _normal(rng, (mm, k), F32)
  ws = _normal(rng, (b, k, n), F32)
  dys = _normal(rng, (b, mm, n), F32)
  made = [make_mask(kind, ws[i], rng) for i in range(b)]
  transposable = made[0][1]
  masks = jax.tree.map(lambda *a: jnp.stack(a), *[mk for mk, _, _ in made]) if made[0][0] is not None else None
  refs = [r for _, _, r in made]

  @jax.jit
  def run(x, ws, masks, dys):
    def one(w, mask, dy):
      return fwd_bwd(gradient, transposable, jit=False)(x, w, mask, dy)
    return jax.vmap(one)(ws, masks, dys)
  y, dx, dw = run(x, ws, masks, dys)
  for i in range(b):
    check_against_reference(x, ws[i], refs[i], dys[i], (y[i], dx[i], dw[i]), gradient, f"vmap w[{i}]")


@pytest.mark.parametrize("gradient", ["ste", "masked"])
def test_pmap(gradient):
  nd = jax.local_device_count()
  rng = _rng("pmap", gradient)
  mm, k, n = 3, 12, 5
  xs = _normal(rng, (nd, mm, k), BF16)
  ws = _normal(rng, (nd, k, n), BF16)
  dys = _normal(rng, (nd, mm, n), BF16)
  m = random_24_mask(rng, k, n)
  # Shared mask (broadcast), per-device weights; and dynamic pruning.
  f = jax.pmap(fwd_bwd(gradient, jit=False), in_axes=(0, 0, None, 0))
  y, dx, dw = f(xs, ws, m, dys)
  fn = jax.pmap(lambda x, w, dy: fwd_bwd(gradient, jit=False)(x, w, None, dy))
  y2, dx2, dw2 = fn(xs, ws, dys)
  for i in range(nd):
    check_against_reference(xs[i], ws[i], m, dys[i], (y[i], dx[i], dw[i]), gradient, f"pmap[{i}]")
    m_i = np.asarray(_prune(ws[i]))
    check_against_reference(xs[i], ws[i], m_i, dys[i], (y2[i], dx2[i], dw2[i]), gradient,
                            f"pmap none[{i}]")


@pytest.mark.parametrize("gradient", ["ste", "masked"])
def test_checkpoint(gradient):
  rng = _rng("remat", gradient)
  x, w = _normal(rng, (5, 12), F32), _normal(rng, (12, 8), F32)
  dy = _normal(rng, (5, 8), F32)
  for mask, transposable, m in [make_mask("dense", w, rng), make_mask("none_t", w, rng)]:
    def loss(x, w):
      f = jax.checkpoint(lambda x, w: jsparse24.sparse_dot(
          x, w, mask, gradient=gradient, transposable=transposable))
      return jnp.sum(jnp.tanh(f(x, w)) * dy)
    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    # Reference: chain rule through tanh, in float64.
    ry, _, _ = ref_fwd_bwd(x, w, m, dy, gradient)
    g = dy * (1 - np.tanh(ry) ** 2)
    _, rdx, rdw = ref_fwd_bwd(x, w, m, g, gradient)
    assert_close(dx, rdx, F32, 8, "remat dx")
    assert_close(dw, rdw, F32, 5, "remat dw")


# ---------------------------------------------------------------------------
# Mixed dtypes, compressed weights.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("x_dtype,w_dtype", [(BF16, F32), (F32, BF16), (F16, F32), (BF16, F16)],
                         ids=["x_bf16-w_f32", "x_f32-w_bf16", "x_f16-w_f32", "x_bf16-w_f16"])
@pytest.mark.parametrize("gradient", ["ste", "masked"])
def test_mixed_dtypes(x_dtype, w_dtype, gradient):
  rng = _rng("mixed", str(x_dtype), str(w_dtype), gradient)
  x, w = _normal(rng, (5, 12), x_dtype), _normal(rng, (12, 7), w_dtype)
  out_dtype = jnp.result_type(x_dtype, w_dtype)
  dy = _normal(rng, (5, 7), out_dtype)
  m = random_24_mask(rng, 12, 7)
  y, dx, dw = fwd_bwd(gradient)(x, w, m, dy)
  assert y.dtype == out_dtype and dx.dtype == x_dtype and dw.dtype == w_dtype
  ry, rdx, rdw = ref_fwd_bwd(x, w, m, dy, gradient)
  # Products run in the promoted dtype; each result is rounded to its own.
  assert_close(y, ry, out_dtype, 12, "y")
  assert_close(dx, rdx, x_dtype, 7, "dx")
  assert_close(dw, rdw, w_dtype, 5, "dw")


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_a_dense_phase_multiplies_as_nn_dense(impl):
  """A layer in a dense phase known while tracing (`STATIC_DENSE`) runs
  nn.Dense's products: a bfloat16 input and a float32 kernel give bfloat16
  products in the forward and backward passes, as nn.Dense's are, not
  float32 products cast down (a second pass over each output: 2.3 ms per
  step at train_lm's gpu preset)."""
  from jsparse24.backends import BACKENDS  # pylint: disable=g-import-not-at-top
  from jsparse24.backends.base import DotConfig  # pylint: disable=g-import-not-at-top
  from jsparse24.backends.pallas import interpret_mode  # pylint: disable=g-import-not-at-top
  rng = _rng("dense phase", impl)
  x, w = _normal(rng, (8, 64), BF16), _normal(rng, (64, 32), F32)
  cfg = DotConfig(gradient="ste", transposable=True, precision=None)
  sparse = lambda x, w: BACKENDS[impl].dot(x, w, None, jsparse24.linen.STATIC_DENSE, cfg)
  dense = lambda x, w: jax.lax.dot_general(x, w.astype(x.dtype), (((1,), (0,)), ((), ())))

  def products(f):
    """The element types of the gradient's products (y, dx, dw)."""
    loss = lambda x, w: jnp.sum(jnp.square(f(x, w).astype(jnp.float32)))  # noqa: E731
    with interpret_mode():
      text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).as_text()
    return re.findall(r"stablehlo.dot_general .*?-> tensor<\S*x(\w+)>", text)

  assert products(dense) == ["bf16"] * 3
  assert products(sparse) == products(dense)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("transposed", [False, True])
def test_sparse24_weight(dtype, transposed):
  rng = _rng("sp24", str(dtype), transposed)
  k, n = 20, 8
  x, w = _normal(rng, (2, 3, k), dtype), _normal(rng, (k, n), dtype)
  m = random_transposable_mask(rng, k, n) if transposed else random_24_mask(rng, k, n)
  sp = jax.jit(functools.partial(jsparse24.compress, transposed=transposed))(w, m)
  dy = _normal(rng, (2, 3, n), dtype)

  @jax.jit
  def run(x, sp, dy):
    y, vjp = jax.vjp(lambda x: jsparse24.sparse_dot(x, sp), x)
    return y, vjp(dy)[0], jsparse24.decompress(sp)
  y, dx, dense = run(x, sp, dy)
  np.testing.assert_array_equal(np.asarray(dense), np.where(m, w, np.zeros((), dtype)))
  ry, rdx, _ = ref_fwd_bwd(x, w, m, dy, "ste")
  assert y.dtype == dtype and dx.dtype == dtype
  assert_close(y, ry, dtype, k, "y")
  assert_close(dx, rdx, dtype, n, "dx")
  # Same result as the dense weight with the same mask.
  y2 = jax.jit(jsparse24.sparse_dot)(x, w, m)
  assert_close(y, _f64(y2), dtype, k, "y vs dense")
  # Mixed: x in another dtype promotes like the dense path.
  if dtype == BF16:
    y3 = jax.jit(jsparse24.sparse_dot)(x.astype(F32), sp)
    assert y3.dtype == F32
    assert_close(y3, ry, BF16, k, "mixed")


# ---------------------------------------------------------------------------
# One prune per step (the backward reuses the forward's operand).
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("gradient,transposable", [("ste", True), ("masked", False)])
def test_backward_does_not_prune_again(gradient, transposable):
  original = sys.modules["jsparse24._prune"].prune_24
  calls = []

  def counting(*args, **kwargs):
    calls.append(kwargs.get("transposable"))
    return original(*args, **kwargs)

  targets = [mod for name, mod in list(sys.modules.items())
             if name.startswith("jsparse24") and getattr(mod, "prune_24", None) is original]
  assert sys.modules["jsparse24.backends.xla"] in targets
  rng = _rng("count", gradient, transposable)
  # Shapes used nowhere else, so that no trace can come from a cache.
  k, n = (28 if gradient == "ste" else 44), (4 if transposable else 9)
  x, w = _normal(rng, (3, k), F32), _normal(rng, (k, n), F32)
  with contextlib.ExitStack() as stack:
    for mod in targets:
      stack.enter_context(mock.patch.object(mod, "prune_24", counting))
    loss = lambda w: jnp.sum(jsparse24.sparse_dot(x, w, gradient=gradient, transposable=transposable) ** 2)
    value, dw = jax.value_and_grad(loss)(w)
  assert calls == [transposable], calls
  m = np.asarray(_prune(w, transposable=transposable))
  y = _f64(x) @ np.where(m, _f64(w), 0)
  assert value == pytest.approx(np.sum(y ** 2), rel=1e-5)
  assert_close(dw, ref_fwd_bwd(x, w, m, 2 * y, gradient)[2], F32, 3, "dw")


def bool_transposes(fn, *args) -> list[str]:
  """The transposes of bool tensors in `fn`'s lowered program. Expanding a
  `Mask24` must never transpose a weight-sized bool mask: XLA then writes
  it to memory in a separate pass instead of fusing the expansion into its
  consumer (measured slower than a dense product on the GPU)."""
  text = jax.jit(fn).lower(*args).as_text()
  return [line.strip() for line in text.splitlines()
          if "transpose" in line and re.search(r"x\s*i1>", line)]


@pytest.mark.parametrize("transposable,k", [(False, 64), (True, 64), (False, 44)])
def test_mask24_expands_without_a_bool_transpose(transposable, k):
  rng = _rng("fuse", transposable, k)
  x, w = _normal(rng, (16, k), F32), _normal(rng, (k, 32), F32)
  m = jsparse24.Mask24.from_weights(w, transposable=transposable)

  def step(x, w, m):
    y, vjp = jax.vjp(lambda x, w: jsparse24.sparse_dot(x, w, m, implementation="xla",
                                                       gradient="masked"), x, w)
    return vjp(y)

  assert bool_transposes(step, x, w, m) == []
  assert bool_transposes(lambda m: m.unpack(), m) == []
  np.testing.assert_array_equal(m.unpack(), _prune(w, transposable=transposable))


# ---------------------------------------------------------------------------
# Dispatch.
# ---------------------------------------------------------------------------


def test_available_implementations():
  avail = jsparse24.available_implementations()
  assert set(avail) >= {"xla", "pallas", "cusparselt"}
  assert avail["xla"] is None
  if jax.default_backend() == "cpu":
    for name in ("pallas", "cusparselt"):
      assert isinstance(avail[name], str) and len(avail[name]) > 10, (name, avail[name])


@pytest.mark.parametrize("gradient", ["ste", "masked"])
def test_implementation_none_equals_xla_on_cpu(gradient):
  if jax.default_backend() != "cpu":
    pytest.skip("the automatic choice is only known to be 'xla' on CPU")
  rng = _rng("dispatch", gradient)
  x, w = _normal(rng, (5, 12), BF16), _normal(rng, (12, 8), BF16)
  dy = _normal(rng, (5, 8), BF16)
  for mask, transposable, _ in [make_mask("dense", w, rng), make_mask("none_t", w, rng)]:
    auto = fwd_bwd(gradient, transposable, None)(x, w, mask, dy)
    xla = fwd_bwd(gradient, transposable, "xla")(x, w, mask, dy)
    for a, b in zip(auto, xla):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", ["pallas", "cusparselt"])
def test_unavailable_backend_raises(name):
  if jsparse24.available_implementations()[name] is None:
    pytest.skip(f"{name} is available here")
  x, w = np.ones((2, 8), np.float32), np.ones((8, 4), np.float32)
  reason = jsparse24.available_implementations()[name]
  with pytest.raises(jsparse24.BackendUnavailableError,
                     match=rf"^sparse_dot: implementation='{name}' cannot run here: .+") as info:
    jsparse24.sparse_dot(x, w, implementation=name)
  assert reason in str(info.value)
  assert isinstance(info.value, ValueError)
  sp = jax.jit(jsparse24.compress)(w, M)
  with pytest.raises(jsparse24.BackendUnavailableError, match=rf"implementation='{name}'"):
    jsparse24.sparse_dot(x, sp, implementation=name)


# ---------------------------------------------------------------------------
# Argument errors.
# ---------------------------------------------------------------------------

X = np.ones((3, 8), np.float32)
W = np.ones((8, 4), np.float32)
M = np.tile(np.array([[1], [0], [1], [0]], bool), (2, 4))  # 2:4 along K only


@pytest.mark.parametrize("call,exc,pattern", [
    (lambda: jsparse24.sparse_dot(np.ones((3, 6), np.float32), np.ones((6, 4), np.float32)),
     ValueError, r"sparse_dot: `w\.shape\[0\]` = 6 .*not a multiple of 4"),
    (lambda: jsparse24.sparse_dot(X, np.ones((8,), np.float32)),
     ValueError, r"sparse_dot: `w` must be 2-D \[K, N\], got shape \(8,\)"),
    (lambda: jsparse24.sparse_dot(X, np.ones((2, 8, 4), np.float32)),
     ValueError, r"sparse_dot: `w` must be 2-D \[K, N\], got shape \(2, 8, 4\)"),
    (lambda: jsparse24.sparse_dot(np.ones((3, 12), np.float32), W),
     ValueError, r"sparse_dot: `x\.shape\[-1\]` = 12 does not match K = `w\.shape\[0\]` = 8"),
    (lambda: jsparse24.sparse_dot(np.float32(1.0), W),
     ValueError, r"sparse_dot: `x` must be \[\.\.\., K\]"),
    (lambda: jsparse24.sparse_dot(X.astype(np.int32), W),
     TypeError, r"sparse_dot: `x` must have a floating dtype"),
    (lambda: jsparse24.sparse_dot(X.astype(bool), W),
     TypeError, r"sparse_dot: `x` must have a floating dtype"),
    (lambda: jsparse24.sparse_dot(X, W.astype(np.int8)),
     TypeError, r"sparse_dot: `w` must have a floating dtype"),
    (lambda: jsparse24.sparse_dot(X, W.astype(bool)),
     TypeError, r"sparse_dot: `w` must have a floating dtype"),
    (lambda: jsparse24.sparse_dot(X, W, M.astype(np.float32)),
     TypeError, r"sparse_dot: `mask` must be a bool array"),
    (lambda: jsparse24.sparse_dot(X, W, M.astype(np.int32)),
     TypeError, r"sparse_dot: `mask` must be a bool array"),
    (lambda: jsparse24.sparse_dot(X, W, M[:, :3]),
     ValueError, r"sparse_dot: `mask` has shape \(8, 3\), expected \(8, 4\)"),
    (lambda: jsparse24.sparse_dot(X, W, M.T),
     ValueError, r"sparse_dot: `mask` has shape \(4, 8\)"),
    (lambda: jsparse24.sparse_dot(X, W, np.ones((8, 4), bool)),
     ValueError, r"sparse_dot: `mask` is not 2:4 along axis 0.*keeping 4"),
    (lambda: jsparse24.sparse_dot(X, W, np.where(np.arange(8)[:, None] == 0, False, M)),
     ValueError, r"sparse_dot: `mask` is not 2:4 along axis 0.*keeping 1"),
    (lambda: jsparse24.sparse_dot(X, W, M, transposable=True),
     ValueError, r"sparse_dot: `mask` is not 2:4 along axis 1"),
    (lambda: jsparse24.sparse_dot(X, np.ones((8, 6), np.float32), transposable=True),
     ValueError, r"sparse_dot: `w\.shape\[1\]` = 6 \(N, for a transposable mask\)"),
    (lambda: jsparse24.sparse_dot(X, W, M, gradient="dense"),
     ValueError, r"sparse_dot: unknown gradient='dense'"),
    (lambda: jsparse24.sparse_dot(X, W, M, gradient=None),
     ValueError, r"unknown gradient=None"),
    (lambda: jsparse24.sparse_dot(X, W, M, implementation="triton"),
     ValueError, r"sparse_dot: unknown implementation='triton'"),
    (lambda: jsparse24.sparse_dot(X, W, M, implementation="XLA"),
     ValueError, r"sparse_dot: unknown implementation='XLA'"),
])
def test_argument_errors(call, exc, pattern):
  with pytest.raises(exc, match=pattern):
    call()


def test_mask24_errors():
  m_t = np.tile(np.array([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]], bool), (2, 1))
  mk_t = _pack(m_t, transposable=True)
  mk = _pack(M)
  with pytest.raises(ValueError, match=r"sparse_dot: transposable=False contradicts the Mask24.*transposable=True"):
    jsparse24.sparse_dot(X, W, mk_t, transposable=False)
  with pytest.raises(ValueError, match=r"sparse_dot: transposable=True contradicts the Mask24.*transposable=False"):
    jsparse24.sparse_dot(X, W, mk, transposable=True)
  with pytest.raises(ValueError, match=r"sparse_dot: `mask` has shape \(8, 4\), expected \(8, 8\)"):
    jsparse24.sparse_dot(X, np.ones((8, 8), np.float32), mk)
  # Agreeing (or unset) transposable is fine.
  f = jax.jit(jsparse24.sparse_dot, static_argnames=("transposable",))
  for mask, t in [(mk_t, True), (mk_t, None), (mk, False), (mk, None)]:
    y = f(X, W, mask, transposable=t)
    np.testing.assert_array_equal(np.asarray(y), np.full((3, 4), 4.0, np.float32))


def test_sparse24_weight_errors():
  sp = jax.jit(jsparse24.compress)(W, M)
  with pytest.raises(ValueError, match=r"sparse_dot: `w` is a Sparse24.*pass mask=None"):
    jsparse24.sparse_dot(X, sp, M)
  with pytest.raises(ValueError, match=r"sparse_dot: `w` is a Sparse24"):
    jsparse24.sparse_dot(X, sp, _pack(M))
  with pytest.raises(ValueError, match=r"sparse_dot: `x\.shape\[-1\]` = 12 does not match K"):
    jsparse24.sparse_dot(np.ones((3, 12), np.float32), sp)
  with pytest.raises(TypeError, match=r"sparse_dot: `x` must have a floating dtype"):
    jsparse24.sparse_dot(X.astype(np.int32), sp)
  stacked = jax.jit(jsparse24.compress)(np.ones((2, 8, 4), np.float32), np.stack([M, M]))
  with pytest.raises(ValueError, match=r"sparse_dot: `w` must be a \[K, N\] Sparse24"):
    jsparse24.sparse_dot(X, stacked)


def test_selected_implementation_reports_the_automatic_choice(monkeypatch):
  """It names the backend that sparse_dot(implementation=None) then runs: the
  reference on CPU, and the Pallas one where that backend prefers the shape
  (made available in interpret mode and made to prefer it here)."""
  from jsparse24.backends import pallas
  assert jsparse24.selected_implementation((16, 64), (64, 32), jnp.bfloat16) == "xla"
  assert jsparse24.selected_implementation((3, 5, 64), (64, 32), jnp.float32, transposable=True) == "xla"
  x, w = jnp.ones((16, 64)), jnp.ones((64, 32))

  def kernels_of(fn):
    return str(jax.make_jaxpr(fn)(x, w))

  with pallas.interpret_mode():
    monkeypatch.setattr(pallas.PallasBackend, "prefers", lambda self, problem: problem.m <= 16)
    assert jsparse24.selected_implementation((16, 64), (64, 32), jnp.float32) == "pallas"
    assert jsparse24.selected_implementation((32, 64), (64, 32), jnp.float32) == "xla"
    auto = kernels_of(lambda x, w: jsparse24.sparse_dot(x, w))
    assert kernels_of(lambda x, w: jsparse24.sparse_dot(x, w, implementation="pallas")) == auto
    assert kernels_of(lambda x, w: jsparse24.sparse_dot(x, w, implementation="xla")) != auto


@pytest.mark.parametrize("shared", [True, False])
def test_vmap_over_the_pallas_products(shared):
  """vmap over activations (a shared weight) or over weights too: the Pallas
  products (custom-partitioned ops, which have no batching rule of their own)
  give the reference's values and gradients."""
  from jsparse24.backends.pallas import interpret_mode
  rng = _rng("vmap-pallas")
  x = jnp.asarray(_normal(rng, (3, 8, 64), F32))
  w = jnp.asarray(_normal(rng, (64, 32), F32) if shared else _normal(rng, (3, 64, 32), F32))

  def loss(impl):
    def one(xb, wb):
      return jsparse24.sparse_dot(xb, wb, transposable=True, implementation=impl)
    f = jax.vmap(one, in_axes=(0, None if shared else 0))
    return lambda x, w: (f(x, w) ** 2).sum()

  with interpret_mode():
    got = jax.jit(jax.value_and_grad(loss("pallas"), (0, 1)))(x, w)
  want = jax.jit(jax.value_and_grad(loss("xla"), (0, 1)))(x, w)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-3)


def test_batched_x_and_vmap_over_x_make_dw_one_product():
  """The documented behaviour (sparse_dot's docstring): x with leading axes
  makes dw one product, and so does jax.vmap over x with a shared w (the
  tangent primitive folds the batch into the rows; a custom_vjp computed dw
  per element, [B, K, N], and summed it). Same values."""
  import re  # pylint: disable=g-import-not-at-top
  from jsparse24.backends.pallas import interpret_mode  # pylint: disable=g-import-not-at-top
  b, m, k, n = 3, 16, 32, 24
  xs = jax.random.normal(jax.random.key(0), (b, m, k))
  w = jax.random.normal(jax.random.key(1), (k, n))
  mask = jsparse24.Mask24.from_weights(w)

  def whole(w):
    return jnp.sum(jsparse24.sparse_dot(xs, w, mask, implementation="pallas") ** 2)

  def mapped(w):
    return jnp.sum(jax.vmap(lambda x: jsparse24.sparse_dot(
        x, w, mask, implementation="pallas"))(xs) ** 2)

  with interpret_mode():
    shapes, grads = {}, {}
    for name, f in (("whole", whole), ("mapped", mapped)):
      compiled = jax.jit(jax.grad(f)).lower(w).compile()
      shapes[name] = set(re.findall(r"f32\[(\d+),(\d+),(\d+)\]", compiled.as_text()))
      grads[name] = compiled(w)  # the program whose shapes are checked
    np.testing.assert_allclose(grads["whole"], grads["mapped"], rtol=1e-5, atol=1e-4)
  assert (str(b), str(k), str(n)) not in shapes["whole"]
  assert (str(b), str(k), str(n)) not in shapes["mapped"]


def test_interpret_mode_is_part_of_jits_cache_key():
  """A function jitted outside `interpret_mode` is traced again inside it
  (and the other way round): the setting keys jit's cache, so a trace made
  in one mode is never run in the other. On CPU the Pallas backend runs only
  interpreted, so a reused trace would show as a call that does not raise."""
  from jsparse24.backends.pallas import interpret_mode  # pylint: disable=g-import-not-at-top
  x, w = jnp.ones((4, 16)), jnp.arange(64.0).reshape(16, 4)
  f = jax.jit(lambda x, w: jsparse24.sparse_dot(x, w, implementation="pallas"))
  with interpret_mode():
    y = f(x, w)
  np.testing.assert_allclose(y, x @ (w * jsparse24.prune_24(w)))
  with pytest.raises(jsparse24.BackendUnavailableError, match="interpret_mode"):
    f(x, w)
  with interpret_mode():
    np.testing.assert_array_equal(f(x, w), y)


def test_float64_computes_in_float64():
  """With x64 on, float64 inputs give y, dx and dw of float64 accuracy, and
  so does a compressed float64 weight, its values' gradient included
  (sparse_dot's docstring: "accumulated in float32 (float64 for float64
  inputs)"): a float32 accumulation is off by ~1e-7 of the result; this
  checks 1e-12. (The "xla" backend: the others refuse float64 by name.)"""
  with jax.enable_x64(True):
    ks = jax.random.split(jax.random.key(21), 3)
    x, w, dy = (jax.random.normal(k, s, jnp.float64)
                for k, s in zip(ks, [(8, 64), (64, 32), (8, 32)]))
    m = jsparse24.prune_24(w)
    out = fwd_bwd("ste", None, "xla", jit=True)(x, w, jsparse24.Mask24.pack(m), dy)
    sp = jsparse24.compress(w, m)
    y_compressed, vjp = jax.vjp(jax.jit(jsparse24.sparse_dot), x, sp)
    d_values = vjp(dy)[1].values
    want_values = jsparse24.compress(jnp.asarray(np.asarray(x).T @ np.asarray(dy)), m).values
  want = ref_fwd_bwd(x, w, np.asarray(m), dy, "ste")
  for got, ref in zip((*out, y_compressed, d_values), (*want, want[0], want_values)):
    assert got.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-12, atol=1e-12)
