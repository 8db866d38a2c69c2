"""2:4 activations (`input_sparsity`, `grad_output`): the product
`prune(x) @ w` and its gradients, and `dx` from the pruned output gradient,
against the plain-`jnp` reference (`jsparse24._input_sparse`) and against
JAX's own derivative of the masked product; the options through the layers;
the combinations that raise."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jsparse24
from jsparse24 import nnx as jnnx
from jsparse24._input_sparse import input_mask, input_sparse_reference

TOL = {jnp.float32: 2e-6, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


def _rand(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _close(a, b, dtype, k):
  tol = TOL[dtype] * math.sqrt(k) * 4
  np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                             rtol=tol, atol=tol)


def _vjp(x, w, dy, gradient, implementation=None, grad_output="dense"):
  y, vjp = jax.vjp(lambda x, w: jsparse24.sparse_dot(
      x, w, input_sparsity=gradient, implementation=implementation, grad_output=grad_output),
                   x, w)
  return (y, *vjp(dy))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("gradient", ["masked", "ste"])
@pytest.mark.parametrize("m,k,n", [(1, 8, 5), (3, 12, 7), (17, 32, 9), (16, 64, 33)])
def test_forward_and_gradients_match_the_reference(dtype, gradient, m, k, n):
  x, w, dy = _rand(m, (m, k), dtype), _rand(k, (k, n), dtype), _rand(n, (m, n), dtype)
  y, dx, dw = jax.jit(_vjp, static_argnums=3)(x, w, dy, gradient)
  ry, rdx, rdw = input_sparse_reference(x, w, dy, gradient=gradient)
  assert y.dtype == dx.dtype == dw.dtype == dtype
  _close(y, ry, dtype, k)
  _close(dx, rdx, dtype, n)
  _close(dw, rdw, dtype, m)


def test_forward_multiplies_the_pruned_input_exactly():
  """Every group of 4 along K keeps its 2 largest |x| (ties to the lower
  index) and only those reach y: integer inputs make the products exact."""
  x = jnp.array([[1., -4., 3., 0., 2., 2., -2., 5.],
                 [0., 0., 0., 0., 7., 1., 1., 1.]])
  w = jnp.arange(24.).reshape(8, 3)
  kept = jnp.array([[0, 1, 1, 0, 1, 0, 0, 1], [1, 1, 0, 0, 1, 1, 0, 0]], bool)
  assert bool(jnp.all(input_mask(x) == kept))
  y = jsparse24.sparse_dot(x, w, input_sparsity="masked")
  np.testing.assert_array_equal(y, jnp.where(kept, x, 0) @ w)
  np.testing.assert_array_equal(y, input_sparse_reference(x, w))


@pytest.mark.parametrize("gradient", ["masked", "ste"])
def test_gradients_are_jax_derivatives_of_the_stated_rule(gradient):
  """An oracle independent of the reference: JAX's own derivative of the
  masked product with the mask held fixed ("masked"), or of a product whose
  input passes the gradient straight through ("ste")."""
  x, w, dy = _rand(0, (5, 16)), _rand(1, (16, 6)), _rand(2, (5, 6))
  m = input_mask(x)
  if gradient == "masked":
    oracle = lambda x, w: jnp.where(m, x, 0) @ w  # noqa: E731
  else:
    oracle = lambda x, w: (x + jax.lax.stop_gradient(jnp.where(m, x, 0) - x)) @ w  # noqa: E731
  y, dx, dw = _vjp(x, w, dy, gradient)
  oy, ovjp = jax.vjp(oracle, x, w)
  odx, odw = ovjp(dy)
  np.testing.assert_allclose(y, oy, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(dx, odx, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(dw, odw, rtol=1e-6, atol=1e-6)
  if gradient == "masked":
    assert bool(jnp.all(jnp.where(m, True, dx == 0)))
  else:
    assert bool(jnp.all(dx[~m] != 0))


def test_leading_axes_vmap_and_grad():
  x, w = _rand(0, (2, 3, 16)), _rand(1, (16, 5))
  f = lambda x, w: jsparse24.sparse_dot(x, w, input_sparsity="masked")  # noqa: E731
  flat = f(x.reshape(6, 16), w).reshape(2, 3, 5)
  np.testing.assert_allclose(f(x, w), flat, rtol=1e-6)
  np.testing.assert_allclose(jax.vmap(f, (0, None))(x, w), flat, rtol=1e-6)
  loss = lambda w, x: (f(x, w) ** 2).sum()  # noqa: E731
  g_batched = jax.grad(lambda w: jax.vmap(loss, (None, 0))(w, x).sum())(w)
  g_flat = jax.grad(loss)(w, x.reshape(6, 16))
  np.testing.assert_allclose(g_batched, g_flat, rtol=1e-5, atol=1e-5)
  per_example = jax.vmap(jax.grad(loss), (None, 0))(w, x)
  np.testing.assert_allclose(per_example.sum(0), g_flat, rtol=1e-5, atol=1e-5)


def test_float32_kernel_with_bfloat16_compute():
  """A layer's float32 kernel in a bfloat16 product: y in bfloat16, dw in
  float32 (the kernel's dtype), as nn.Dense gives them."""
  x, w = _rand(0, (4, 16), jnp.bfloat16), _rand(1, (16, 8))
  layer = jsparse24.SparseDense(8, dtype=jnp.bfloat16, mask_source="none",
                                input_sparsity="masked")
  variables = jax.eval_shape(layer.init, jax.random.key(0), x)
  params = {"params": {"kernel": w, "bias": np.zeros(8, np.float32)}}
  assert set(variables) == {"params"}
  y = jax.jit(layer.apply)(params, x)
  assert y.dtype == jnp.bfloat16
  g = jax.jit(jax.grad(lambda p: layer.apply(p, x).astype(jnp.float32).sum()))(params)
  assert g["params"]["kernel"].dtype == jnp.float32
  _, _, rdw = jax.jit(input_sparse_reference)(x, w.astype(jnp.bfloat16),
                                              np.ones((4, 8), jnp.bfloat16))
  _close(g["params"]["kernel"], rdw, jnp.bfloat16, 4)


def test_layers_and_rules_agree():
  """SparseDense, nnx.SparseLinear and an nn.Dense patched by a sparsify rule
  give the same output for the same kernel, and none keeps a mask."""
  x = _rand(0, (3, 16))
  opts = {"mask_source": "none", "input_sparsity": "ste"}
  dense = nn.Dense(6)
  params = dense.init(jax.random.key(1), x)
  want = input_sparse_reference(x, params["params"]["kernel"]) + params["params"]["bias"]
  got_linen = jsparse24.SparseDense(6, **opts).apply(params, x)
  patched = jsparse24.sparsify(dense, {".*": opts})
  variables = patched.init(jax.random.key(1), x)
  assert set(variables) == {"params"}
  got_rule = patched.apply(params, x)
  layer = jnnx.SparseLinear(16, 6, rngs=nnx.Rngs(1), **opts)
  layer.kernel.set_value(params["params"]["kernel"])
  layer.bias.set_value(params["params"]["bias"])
  assert layer.mask is None and layer.transposable is False
  for got in (got_linen, got_rule, layer(x)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kw,match", [
    ({"input_sparsity": "masked"}, "set mask_source='none'"),
    ({"mask_source": "none"}, "mask_source='none' .* is for layers with input_sparsity"),
    ({"grad_output": "2:4"}, "grad_output='2:4' prunes an activation.*set mask_source='none'"),
    ({"mask_source": "none", "grad_output": "2:4", "gradient": "masked"},
     "with grad_output='2:4' the kernel is dense.*leave gradient at 'ste'"),
    ({"mask_source": "none", "grad_output": "24"}, "unknown grad_output='24'"),
    ({"mask_source": "none", "input_sparsity": "ste", "gradient": "masked"},
     "leave gradient at 'ste'"),
    ({"mask_source": "none", "input_sparsity": "ste", "weight_grad": "mvue"},
     "leave weight_grad at 'dense'"),
    ({"mask_source": "none", "input_sparsity": "ste", "transposable": True},
     "leave transposable at None"),
    ({"mask_source": "none", "input_sparsity": "dense"}, "unknown input_sparsity='dense'"),
])
def test_combinations_that_make_no_sense_raise(kw, match):
  x = jnp.ones((2, 8))
  with pytest.raises(ValueError, match=f"SparseDense: .*{match}"):
    jsparse24.SparseDense(4, **kw).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=f"SparseLinear: .*{match}"):
    jnnx.SparseLinear(8, 4, rngs=nnx.Rngs(0), **kw)
  with pytest.raises(ValueError, match=f"sparsify: rule '.\\*': .*{match}"):
    jsparse24.sparsify(nn.Dense(4), {".*": kw})


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("input_sparsity", ["off", "masked", "ste"])
@pytest.mark.parametrize("m,k,n", [(1, 8, 8), (3, 12, 4), (17, 32, 12), (16, 64, 36)])
def test_grad_output_matches_the_reference(dtype, input_sparsity, m, k, n):
  """`grad_output="2:4"`: `dx` from the output gradient pruned 2:4 along N
  (alone, or with the input pruned too); `y` and `dw` those of the product
  without it. On a random `dy` (not 2:4) the pruning changes `dx`."""
  x, w, dy = _rand(m, (m, k), dtype), _rand(k, (k, n), dtype), _rand(n + 1, (m, n), dtype)
  y, dx, dw = jax.jit(_vjp, static_argnums=(3, 4, 5))(x, w, dy, input_sparsity, None, "2:4")
  ry, rdx, rdw = input_sparse_reference(x, w, dy, gradient=input_sparsity, grad_output="2:4")
  assert y.dtype == dx.dtype == dw.dtype == dtype
  _close(y, ry, dtype, k)
  _close(dx, rdx, dtype, n)
  _close(dw, rdw, dtype, m)
  _, unpruned_dx, _ = input_sparse_reference(x, w, dy, gradient=input_sparsity)
  assert float(jnp.abs(rdx.astype(jnp.float32) - unpruned_dx.astype(jnp.float32)).max()) > 0.1


def test_grad_output_is_exact_behind_a_squared_relu_and_masked_activations():
  """A squared-ReLU feed-forward with its down projection's input pruned
  (`input_sparsity="masked"`): the gradient into the up projection's output
  is 2:4 along the hidden axis, so `grad_output="2:4"` on the up projection
  changes no gradient of the block. Behind `"ste"` it is not 2:4 and changes
  the input's gradient."""
  x, t = _rand(0, (24, 16)), _rand(1, (24, 16))
  p = {"w1": _rand(2, (16, 32)) * 0.5, "w2": _rand(3, (32, 16)) * 0.5}

  def grads(down, up_grad_output):
    def loss(p, x):
      h = (jsparse24.sparse_dot(x, p["w1"], grad_output="2:4") if up_grad_output
           else x @ p["w1"])
      y = jsparse24.sparse_dot(jax.nn.relu(h) ** 2, p["w2"], input_sparsity=down)
      return (y * t).sum()
    return jax.jit(jax.grad(loss, argnums=(0, 1)))(p, x)

  for down in ("masked", "ste"):
    got, ref = grads(down, True), grads(down, False)
    np.testing.assert_allclose(got[0]["w2"], ref[0]["w2"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[0]["w1"], ref[0]["w1"], rtol=1e-5, atol=1e-5)
    dx_gap = float(jnp.abs(got[1] - ref[1]).max())
    assert (dx_gap < 1e-5) if down == "masked" else (dx_gap > 1e-2), (down, dx_gap)


def test_grad_output_through_the_layers():
  """SparseDense, nnx.SparseLinear and a sparsify rule with
  `grad_output="2:4"`: the dense layer's output, and the input gradient of
  the reference."""
  x, dy = _rand(0, (3, 16)), _rand(1, (3, 8))
  opts = {"mask_source": "none", "grad_output": "2:4"}
  dense = nn.Dense(8)
  params = dense.init(jax.random.key(1), x)
  kernel, bias = params["params"]["kernel"], params["params"]["bias"]
  _, want_dx, _ = input_sparse_reference(x, kernel, dy, gradient="off", grad_output="2:4")
  layer = jnnx.SparseLinear(16, 8, rngs=nnx.Rngs(1), **opts)
  layer.kernel.set_value(kernel)
  layer.bias.set_value(bias)
  assert layer.mask is None and layer.grad_output == "2:4"
  calls = {"linen": lambda x: jsparse24.SparseDense(8, **opts).apply(params, x),
           "rule": lambda x: jsparse24.sparsify(dense, {".*": opts}).apply(params, x),
           "nnx": layer}
  for name, f in calls.items():
    y, vjp = jax.vjp(f, x)
    np.testing.assert_allclose(y, x @ kernel + bias, rtol=1e-5, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(vjp(dy)[0], want_dx, rtol=1e-5, atol=1e-5, err_msg=name)
  with pytest.raises(ValueError, match="SparseDense: the output width .*features=6.* not a"):
    jsparse24.SparseDense(6, **opts).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="SparseLinear: out_features=6 is not a multiple of 4"):
    jnnx.SparseLinear(16, 6, rngs=nnx.Rngs(0), **opts)
  # The input width is free: only the output gradient is pruned.
  jsparse24.SparseDense(8, **opts).init(jax.random.key(0), jnp.ones((2, 6)))


def test_sparse_dot_refuses_a_second_sparse_operand():
  x, w = jnp.ones((2, 8)), jnp.ones((8, 4))
  with pytest.raises(ValueError, match="sparse_dot: with input_sparsity='masked' .* mask=None"):
    jsparse24.sparse_dot(x, w, jsparse24.prune_24(w), input_sparsity="masked")
  with pytest.raises(ValueError, match="sparse_dot: with input_sparsity='ste' `w` is the dense"):
    jsparse24.sparse_dot(x, jsparse24.compress(w), input_sparsity="ste")
  with pytest.raises(ValueError, match="sparse_dot: .*leave gradient at 'ste'"):
    jsparse24.sparse_dot(x, w, gradient="masked", input_sparsity="ste")
  with pytest.raises(ValueError, match="multiple of 4"):
    jsparse24.sparse_dot(jnp.ones((2, 6)), jnp.ones((6, 4)), input_sparsity="masked")
  with pytest.raises(ValueError, match="sparse_dot: with grad_output='2:4' the output gradient"
                                       " is pruned 2:4 along N = w.shape.1. = 6"):
    jsparse24.sparse_dot(jnp.ones((2, 8)), jnp.ones((8, 6)), grad_output="2:4")
  with pytest.raises(ValueError, match="sparse_dot: with grad_output='2:4' .* mask=None"):
    jsparse24.sparse_dot(x, w, jsparse24.prune_24(w), grad_output="2:4")


def test_the_pallas_backend_has_no_product_and_says_so():
  from jsparse24.backends.pallas import interpret_mode  # pylint: disable=g-import-not-at-top
  x, w = jnp.ones((64, 64), jnp.bfloat16), jnp.ones((64, 64), jnp.bfloat16)
  with interpret_mode(), pytest.raises(
      jsparse24.BackendUnavailableError,
      match="'pallas'.*no product with an activation as the sparse operand"):
    jsparse24.sparse_dot(x, w, input_sparsity="masked", implementation="pallas")


@pytest.mark.parametrize("dtype,k,n,match", [(jnp.bfloat16, 96, 64, "K=96, N=64.*multiples of 64"),
                                             (jnp.float32, 64, 64, "bfloat16 or float16")])
def test_the_cusparselt_product_refuses_what_cusparselt_cannot_take(monkeypatch, dtype, k, n,
                                                                    match):
  from jsparse24.backends import cusparselt  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(cusparselt.CusparseltBackend, "unavailable_reason", lambda self: None)
  x, w = jnp.ones((8, k), dtype), jnp.ones((k, n), dtype)
  with pytest.raises(jsparse24.BackendUnavailableError, match=f"'cusparselt'.*{match}"):
    jsparse24.sparse_dot(x, w, input_sparsity="masked", implementation="cusparselt")


@pytest.fixture
def cusparselt_b_products(monkeypatch):
  """The "cusparselt" backend made to run on a CPU for its 2:4-activation
  products: the Pallas kernel interpreted, and cuSPARSELt's call
  `tests/triton_removal.py`'s XLA stand-in, which decodes the compressed
  buffer as cuSPARSELt's structured B (the bytes of
  cusparseLtSpMMACompress2: `test_gpu.py`). Yields the list of the calls'
  `(A shape, B shape, D shape, m, n, k)`."""
  from jsparse24.backends import cusparselt  # pylint: disable=g-import-not-at-top
  from jsparse24.backends.pallas import interpret_mode  # pylint: disable=g-import-not-at-top
  from tests import triton_removal  # pylint: disable=g-import-not-at-top
  calls = []

  def recording(a, b, shape, **kw):
    calls.append((a.shape, b.shape, tuple(shape), kw["m"], kw["n"], kw["k"]))
    return triton_removal._stand_in_b_product(a, b, shape, **kw)  # pylint: disable=protected-access

  monkeypatch.setattr(cusparselt.CusparseltBackend, "unavailable_reason", lambda self: None)
  monkeypatch.setattr(cusparselt, "_check_size", lambda *a: None)
  monkeypatch.setattr(cusparselt, "_sparse_b_matmul", recording)
  cusparselt._input_sparse_local.cache_clear()  # pylint: disable=protected-access
  with interpret_mode():
    yield calls
  cusparselt._input_sparse_local.cache_clear()  # pylint: disable=protected-access


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("m,k,n", [(1, 128, 64), (17, 192, 320), (130, 64, 128)])
def test_cusparselt_product_takes_the_kernels_buffer_as_its_sparse_operand(
    cusparselt_b_products, dtype, m, k, n):
  """The "cusparselt" backend's 2:4-activation product on a CPU
  (`cusparselt_b_products`): x pruned and compressed, M padded to 64 rows.
  Forward and gradients equal the "xla" backend's; the call is asked for
  `D[N, Mp] = w^T prune(x)^T`."""
  x, w, dy = _rand(m, (m, k), dtype), _rand(k, (k, n), dtype), _rand(n, (m, n), dtype)
  for gradient in ("masked", "ste"):
    got = jax.jit(_vjp, static_argnums=(3, 4))(x, w, dy, gradient, "cusparselt")
    want = jax.jit(_vjp, static_argnums=(3, 4))(x, w, dy, gradient, "xla")
    for g, r in zip(got, want):
      assert g.dtype == r.dtype == dtype
      _close(g, r, dtype, k)
  mp = m + -m % 64
  calls = cusparselt_b_products
  assert calls and set(calls) == {((k, n), (mp + mp // 8, k // 2), (mp, n), n, mp, k)}, calls


@pytest.mark.parametrize("input_sparsity", ["off", "masked"])
@pytest.mark.parametrize("m,k,n", [(3, 128, 64), (70, 64, 192)])
def test_cusparselt_grad_output_takes_the_output_gradient_as_its_sparse_operand(
    cusparselt_b_products, input_sparsity, m, k, n):
  """`grad_output="2:4"` on the "cusparselt" backend on a CPU
  (`cusparselt_b_products`): `dx` is the product with the pruned `dy[M, N]`
  as the structured B and `w^T` as the dense A (`D[K, Mp] = w
  prune(dy)^T`), and equals the "xla" backend's."""
  dtype = jnp.bfloat16
  x, w, dy = _rand(m, (m, k), dtype), _rand(k, (k, n), dtype), _rand(n, (m, n), dtype)
  vjp = jax.jit(_vjp, static_argnums=(3, 4, 5))
  got = vjp(x, w, dy, input_sparsity, "cusparselt", "2:4")
  want = vjp(x, w, dy, input_sparsity, "xla", "2:4")
  for g, r in zip(got, want):
    assert g.dtype == r.dtype == dtype
    _close(g, r, dtype, max(k, n))
  mp = m + -m % 64
  dx_call = ((n, k), (mp + mp // 8, n // 2), (mp, k), k, mp, n)
  y_call = ((k, n), (mp + mp // 8, k // 2), (mp, n), n, mp, k)
  calls = cusparselt_b_products
  assert set(calls) == ({dx_call, y_call} if input_sparsity == "masked" else {dx_call}), calls
