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
from jsparse24._input_sparse import input_mask, input_sparse_reference, token_mask

TOL = {jnp.float32: 2e-6, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _pairwise(shapes, options, cycled=DTYPES):
  """`(c, option, shape)` cases, `c` from `cycled`: every shape with every
  option, and each `c` with every shape and with every option (a Latin
  square, given at least as many shapes and options as `cycled` holds):
  every pair of two arguments' values, in a fraction of all combinations
  (each case compiles programs of its own)."""
  assert min(len(shapes), len(options)) >= len(cycled)
  name = lambda v: (jnp.dtype(v).name if isinstance(v, type)  # noqa: E731
                    else "x".join(map(str, v)) if isinstance(v, tuple) and isinstance(v[0], int)
                    else ",".join(v) if isinstance(v, tuple) else v)
  return [pytest.param(c, option, shape, id="-".join(map(name, (c, option, shape))))
          for i, shape in enumerate(shapes) for j, option in enumerate(options)
          for c in [cycled[(i + j) % len(cycled)]]]


def _rand(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _close(a, b, dtype, k):
  tol = TOL[dtype] * math.sqrt(k) * 4
  np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                             rtol=tol, atol=tol)


def _vjp(x, w, dy, gradient, implementation=None, grad_output="dense", transposable=None,
         weight_grad="dense"):
  y, vjp = jax.vjp(lambda x, w: jsparse24.sparse_dot(
      x, w, input_sparsity=gradient, implementation=implementation, grad_output=grad_output,
      transposable=transposable, weight_grad=weight_grad), x, w)
  return (y, *vjp(dy))


@pytest.mark.parametrize("gradient,dtype,shape", _pairwise(
    [(1, 8, 5), (3, 12, 7), (17, 32, 9), (16, 64, 33)], DTYPES, ("masked", "ste")))
def test_forward_and_gradients_match_the_reference(dtype, gradient, shape):
  m, k, n = shape
  x, w, dy = _rand(m, (m, k), dtype), _rand(k, (k, n), dtype), _rand(n, (m, n), dtype)
  y, dx, dw = jax.jit(_vjp, static_argnums=3)(x, w, dy, gradient)
  ry, rdx, rdw = input_sparse_reference(x, w, dy, input_sparsity=gradient)
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


@pytest.mark.parametrize("kw", [{"input_sparsity": "dense"}, {"grad_output": "24"},
                                {"weight_grad": "mvue"}])
def test_the_reference_refuses_an_option_it_does_not_compute(kw):
  """Each option alone: a misspelt one would otherwise compute another
  product than the one named (an unknown `weight_grad` as "dense")."""
  x, w = jnp.ones((4, 8)), jnp.ones((8, 4))
  with pytest.raises(ValueError, match=r"^input_sparse_reference: .*expected one of"):
    input_sparse_reference(x, w, jnp.ones((4, 4)), **kw)


@pytest.mark.parametrize("dtype,input_sparsity,shape", _pairwise(
    [(1, 8, 8), (3, 12, 4), (17, 32, 12), (16, 64, 36)], ["off", "masked", "ste"]))
def test_grad_output_matches_the_reference(dtype, input_sparsity, shape):
  """`grad_output="2:4"`: `dx` from the output gradient pruned 2:4 along N
  (alone, or with the input pruned too); `y` and `dw` those of the product
  without it. On a random `dy` (not 2:4) the pruning changes `dx`."""
  m, k, n = shape
  x, w, dy = _rand(m, (m, k), dtype), _rand(k, (k, n), dtype), _rand(n + 1, (m, n), dtype)
  y, dx, dw = jax.jit(_vjp, static_argnums=(3, 4, 5))(x, w, dy, input_sparsity, None, "2:4")
  ry, rdx, rdw = input_sparse_reference(x, w, dy, input_sparsity=input_sparsity, grad_output="2:4")
  assert y.dtype == dx.dtype == dw.dtype == dtype
  _close(y, ry, dtype, k)
  _close(dx, rdx, dtype, n)
  _close(dw, rdw, dtype, m)
  _, unpruned_dx, _ = input_sparse_reference(x, w, dy, input_sparsity=input_sparsity)
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
  _, want_dx, _ = input_sparse_reference(x, kernel, dy, input_sparsity="off", grad_output="2:4")
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


def test_tensor_parallelism_is_refused_by_the_arguments_name():
  """sparse_dot calls the weight's sharding `weight_sharding`, the layers
  `kernel_sharding`: each error names the one its caller passed."""
  mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "model"))
  x, w = jnp.ones((2, 8)), jnp.ones((8, 4))
  with pytest.raises(ValueError, match="sparse_dot: input_sparsity='masked' has no"
                                       " tensor-parallel products; pass weight_sharding=None"):
    jsparse24.sparse_dot(x, w, input_sparsity="masked", weight_sharding=sharding)
  layer = jsparse24.SparseDense(4, input_sparsity="masked", mask_source="none",
                                kernel_sharding=sharding)
  with pytest.raises(ValueError, match="SparseDense: .*; pass kernel_sharding=None"):
    layer.init(jax.random.key(0), x)


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


# --- transposable=True: the activations pruned on 4x4 tiles ---------------------


def _tiles_are_24(m: jax.Array) -> bool:
  """Whether every 4x4 tile of `m[M, C]` (M padded with False rows) keeps at
  most 2 per row and per column."""
  mp = jnp.pad(m, ((0, -m.shape[0] % 4), (0, 0))).astype(jnp.int32)
  tiles = mp.reshape(mp.shape[0] // 4, 4, mp.shape[1] // 4, 4)
  return bool((tiles.sum(axis=1) <= 2).all() and (tiles.sum(axis=3) <= 2).all())


def test_transposable_mask_is_the_best_tile_pattern_and_differs_from_the_rows():
  """`input_mask(x, transposable=True)` keeps 2 per row and per column of
  each 4x4 tile (M = 6: the last tile padded with zero rows), the patterns
  of `prune_24(transposable=True)`; the plain mask of the same x does not
  (its rows all pick the same two columns)."""
  x = jnp.array([[9., 8., 1., 0.], [9., 8., 0., 1.], [9., 8., 1., 1.], [9., 8., 2., 3.],
                 [5., 1., 1., 5.], [0., 2., 3., 4.]])
  m = input_mask(x, transposable=True)
  assert _tiles_are_24(m)
  np.testing.assert_array_equal(
      m[:4], jsparse24.prune_24(x[:4], transposable=True))
  np.testing.assert_array_equal(
      m[4:], jsparse24.prune_24(jnp.pad(x[4:], ((0, 2), (0, 0))), transposable=True)[:2])
  assert not _tiles_are_24(input_mask(x))
  assert bool(jnp.all(m.sum(axis=1) == 2))


@pytest.mark.parametrize("dtype,gradients,shape", _pairwise(
    [(3, 12, 4), (17, 32, 12)],
    [("masked", "dense"), ("ste", "dense"), ("off", "2:4"), ("masked", "2:4")],
    DTYPES[:2]))
def test_transposable_matches_the_reference(dtype, gradients, shape):
  """`transposable=True` on the "xla" backend: the input and/or the output
  gradient pruned on tiles, `dw` from the pruned operands, against the
  plain-`jnp` reference; the tile masks differ from the rows' (so y or dw
  differs from the row-pruned product's), and the reference's dw is JAX's
  derivative of the masked product."""
  (input_sparsity, grad_output), (m, k, n) = gradients, shape
  x, w, dy = _rand(m, (m, k), dtype), _rand(k, (k, n), dtype), _rand(n + 2, (m, n), dtype)
  got = jax.jit(_vjp, static_argnums=(3, 4, 5, 6))(x, w, dy, input_sparsity, "xla",
                                                     grad_output, True)
  want = input_sparse_reference(x, w, dy, input_sparsity=input_sparsity, grad_output=grad_output,
                                transposable=True)
  for g, r, size in zip(got, want, (k, n, m)):
    assert g.dtype == r.dtype == dtype
    _close(g, r, dtype, size)
  rows = input_sparse_reference(x, w, dy, input_sparsity=input_sparsity, grad_output=grad_output)
  if m > 1:
    gap = max(float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())
              for a, b in zip(want, rows))
    assert gap > 0.05, gap
  xm = jnp.where(input_mask(x, True), x, 0) if input_sparsity != "off" else x
  dym = jnp.where(input_mask(dy, True), dy, 0) if grad_output == "2:4" else dy
  want_dw = jax.vjp(lambda w: xm.astype(jnp.float32) @ w, w.astype(jnp.float32))[1](
      dym.astype(jnp.float32))[0]
  _close(want[2], want_dw, dtype, m)


def test_transposable_makes_the_whole_feed_forward_backward_exact():
  """A squared-ReLU feed-forward, its down projection's input pruned on
  tiles (`input_sparsity="masked", transposable=True`): the gradient into
  the up projection's output is tile-2:4, so the up projection's
  `grad_output="2:4", transposable=True` (dx and dw from it pruned on
  tiles) changes no gradient of the block. Behind a down projection pruned
  along the rows only, the same up projection changes its weight's
  gradient."""
  x, t = _rand(0, (24, 16)), _rand(1, (24, 16))
  p = {"w1": _rand(2, (16, 32)) * 0.5, "w2": _rand(3, (32, 16)) * 0.5}

  def grads(down_tiles, up_pruned):
    def loss(p, x):
      h = (jsparse24.sparse_dot(x, p["w1"], grad_output="2:4", transposable=True)
           if up_pruned else x @ p["w1"])
      y = jsparse24.sparse_dot(jax.nn.relu(h) ** 2, p["w2"], input_sparsity="masked",
                               transposable=down_tiles)
      return (y * t).sum()
    return jax.jit(jax.grad(loss, argnums=(0, 1)))(p, x)

  got, ref = grads(True, True), grads(True, False)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
  rows, rows_ref = grads(False, True), grads(False, False)
  assert float(jnp.abs(rows[0]["w1"] - rows_ref[0]["w1"]).max()) > 1e-2


def test_transposable_through_the_layers():
  """SparseDense, nnx.SparseLinear and a sparsify rule take
  `transposable=True` with `input_sparsity`: the reference's output and
  gradients; an output width that is not a multiple of 4 is fine (only the
  input is pruned)."""
  x, dy = _rand(0, (6, 16)), _rand(1, (6, 8))
  opts = {"mask_source": "none", "input_sparsity": "masked", "transposable": True}
  dense = nn.Dense(8)
  params = dense.init(jax.random.key(1), x)
  kernel, bias = params["params"]["kernel"], params["params"]["bias"]
  want_y, want_dx, want_dw = input_sparse_reference(x, kernel, dy, transposable=True)
  layer = jnnx.SparseLinear(16, 8, rngs=nnx.Rngs(1), **opts)
  layer.kernel.set_value(kernel)
  layer.bias.set_value(bias)
  calls = {"linen": lambda x, k: jsparse24.SparseDense(8, **opts).apply(
               {"params": {"kernel": k, "bias": bias}}, x),
           "rule": lambda x, k: jsparse24.sparsify(dense, {".*": opts}).apply(
               {"params": {"kernel": k, "bias": bias}}, x)}
  for name, f in calls.items():
    y, vjp = jax.vjp(f, x, kernel)
    dx, dw = vjp(dy)
    np.testing.assert_allclose(y, want_y + bias, rtol=1e-5, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-5, err_msg=name)
  y, vjp = jax.vjp(layer, x)
  np.testing.assert_allclose(y, want_y + bias, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(vjp(dy)[0], want_dx, rtol=1e-5, atol=1e-5)
  jsparse24.SparseDense(6, **opts).init(jax.random.key(0), x)


@pytest.fixture
def cusparselt_products(monkeypatch):
  """`cusparselt_b_products` for both of cuSPARSELt's calls: the structured
  A (`_sparse_a_matmul`, the weight gradients) and B. Yields the list of
  `("a" or "b", A shape, B shape, D shape, m, n, k)`."""
  from jsparse24.backends import cusparselt  # pylint: disable=g-import-not-at-top
  from jsparse24.backends.pallas import interpret_mode  # pylint: disable=g-import-not-at-top
  from tests import triton_removal  # pylint: disable=g-import-not-at-top
  calls = []

  def recording(which, stand_in):
    def call(a, b, shape, **kw):
      calls.append((which, a.shape, b.shape, tuple(shape), kw["m"], kw["n"], kw["k"]))
      return stand_in(a, b, shape, **kw)
    return call

  monkeypatch.setattr(cusparselt.CusparseltBackend, "unavailable_reason", lambda self: None)
  monkeypatch.setattr(cusparselt, "_check_size", lambda *a: None)
  monkeypatch.setattr(cusparselt, "_sparse_a_matmul",
                      recording("a", triton_removal._stand_in_product))  # pylint: disable=protected-access
  monkeypatch.setattr(cusparselt, "_sparse_b_matmul",
                      recording("b", triton_removal._stand_in_b_product))  # pylint: disable=protected-access
  caches = (cusparselt._input_sparse_local, cusparselt._tiles_times_local,  # pylint: disable=protected-access
            cusparselt._pruned_weight_grad_local)  # pylint: disable=protected-access
  for c in caches:
    c.cache_clear()
  with interpret_mode():
    yield calls
  for c in caches:
    c.cache_clear()


@pytest.mark.parametrize("rule,input_sparsity,grad_output,m,k,n", [
    ("tiles", "masked", "dense", 3, 64, 128), ("tiles", "off", "2:4", 70, 128, 64),
    ("tokens", "masked", "2:4", 70, 64, 128), ("tokens", "off", "2:4", 3, 64, 128)])
def test_cusparselt_pruned_weight_grad_runs_on_the_sparse_operand(
    cusparselt_products, rule, input_sparsity, grad_output, m, k, n):
  """`transposable=True` (`rule="tiles"`) or `weight_grad="2:4"`
  (`"tokens"`) on the "cusparselt" backend on a CPU (the Pallas passes
  interpreted, cuSPARSELt's calls by `triton_removal`'s stand-ins, which
  decode the buffers): y, dx and dw equal the "xla" backend's; `dw` is the
  product with the pruned operand compressed along M as the structured A
  (`D[K, N] = prune(x)^T dy` read as `[N, K]`, or `D[N, K] = prune(dy)^T
  x`), and the forward (or `dx`) the one with the operand compressed along
  the features as the structured B."""
  dtype = jnp.bfloat16
  x, w, dy = _rand(m, (m, k), dtype), _rand(k, (k, n), dtype), _rand(n, (m, n), dtype)
  vjp = jax.jit(_vjp, static_argnums=(3, 4, 5, 6, 7))
  options = (True, "dense") if rule == "tiles" else (None, "2:4")
  got = vjp(x, w, dy, input_sparsity, "cusparselt", grad_output, *options)
  want = vjp(x, w, dy, input_sparsity, "xla", grad_output, *options)
  for g, r in zip(got, want):
    assert g.dtype == r.dtype == dtype
    _close(g, r, dtype, max(k, n, m))
  mp = m + -m % 64
  along_m = lambda c: (mp // 2 + mp // 16, c)  # noqa: E731
  along_c = lambda c: (mp + mp // 8, c // 2)  # noqa: E731
  want_calls = set()
  if input_sparsity != "off":
    want_calls.add(("b", (k, n), along_c(k), (mp, n), n, mp, k))  # y
    want_calls.add(("a", along_m(k), (mp, n), (n, k), k, n, mp))  # dw, x pruned
  else:
    want_calls.add(("a", along_m(n), (mp, k), (k, n), n, k, mp))  # dw, dy pruned
  if grad_output == "2:4":
    want_calls.add(("b", (n, k), along_c(n), (mp, k), k, mp, n))  # dx
  assert set(cusparselt_products) == want_calls, cusparselt_products


@pytest.fixture
def counted_tile_passes(cusparselt_products, monkeypatch):
  """`cusparselt_products`, with the tile rule's passes counted: yields a
  dict of the calls of `tiles_compress_for_products` (the Pallas pass that
  prunes an operand on tiles and writes both its copies) and of the tile
  mask's own pass (`input_mask(..., transposable=True)`), and the list of
  cuSPARSELt calls. `KEEP_MIN_ROWS` is 16 here, so that 128 rows over the
  tests' 8 devices take `times_keeping`."""
  from jsparse24 import _input_sparse  # pylint: disable=g-import-not-at-top
  from jsparse24.backends import cusparselt  # pylint: disable=g-import-not-at-top
  counts = {"compress": 0, "mask": 0}
  compress, mask = cusparselt.tiles_compress_for_products, _input_sparse.input_mask

  def counted_compress(*args, **kw):
    counts["compress"] += 1
    return compress(*args, **kw)

  def counted_mask(x, transposable=False):
    counts["mask"] += bool(transposable)
    return mask(x, transposable)

  monkeypatch.setattr(cusparselt, "tiles_compress_for_products", counted_compress)
  monkeypatch.setattr(_input_sparse, "input_mask", counted_mask)
  monkeypatch.setattr(_input_sparse, "KEEP_MIN_ROWS", 16)
  yield counts, cusparselt_products


@pytest.mark.parametrize("input_sparsity,grad_output,m", [
    ("off", "2:4", 128), ("masked", "2:4", 200)])
def test_cusparselt_tiles_prune_each_operand_once_for_both_its_products(
    counted_tile_passes, input_sparsity, grad_output, m):
  """With rows enough (`KEEP_MIN_ROWS` per device), a tile-pruned operand
  is pruned and compressed once for its two products (`times_keeping`): the
  input's forward pass writes the copy along M that dw reads, and the mask
  that masks dx comes from its codes (no second pass over x, no mask pass);
  the output gradient's pass serves dx and dw. y, dx and dw equal the "xla"
  backend's; dw is the product with the kept copy (its buffer's shape) as
  the structured A. Where both are pruned, dy's tile mask for dw is its own
  pass, as before."""
  counts, calls = counted_tile_passes
  k, n, dtype = 128, 64, jnp.bfloat16
  x, w, dy = _rand(m, (m, k), dtype), _rand(k, (k, n), dtype), _rand(n, (m, n), dtype)
  vjp = jax.jit(_vjp, static_argnums=(3, 4, 5, 6))
  want = vjp(x, w, dy, input_sparsity, "xla", grad_output, True)
  counts.update(compress=0, mask=0)
  got = vjp(x, w, dy, input_sparsity, "cusparselt", grad_output, True)
  for g, r in zip(got, want):
    assert g.dtype == r.dtype == dtype
    _close(g, r, dtype, max(k, n, m))
  pruned = (input_sparsity != "off") + (grad_output == "2:4")
  assert counts == {"compress": pruned, "mask": int(pruned == 2)}, counts
  mp = m + -m % 64
  sparse_a = [c for c in calls if c[0] == "a"]
  rows = k if input_sparsity != "off" else n
  assert [c[1] for c in sparse_a] == [(mp // 2 + mp // 16, rows)], calls


def test_tiles_times_keeping_keeps_the_copy_along_m_and_the_mask(cusparselt_products):
  """`tiles_times_keeping`: the product of the tile-pruned `a` with `b`; the
  kept copy's leading rows byte for byte the copy along M of
  `tiles_compress_for_products` (rows padded to 64), its codes the tile
  mask of `input_mask(a, True)`; too few rows on a device are refused with
  the rows it needs."""
  del cusparselt_products
  from jsparse24.backends import cusparselt  # pylint: disable=g-import-not-at-top
  a, b = _rand(1, (200, 128), jnp.bfloat16), _rand(2, (128, 64), jnp.bfloat16)
  y, kept, codes = jax.jit(cusparselt.tiles_times_keeping)(a, b)
  assert kept.shape == a.shape and kept.dtype == a.dtype and codes.shape == (200, 16)
  mask = input_mask(a, True)
  _close(y, jnp.matmul(jnp.where(mask, a, 0), b, preferred_element_type=jnp.float32),
         jnp.bfloat16, 128)
  along_m = jax.jit(cusparselt.tiles_compress_for_products)(jnp.pad(a, ((0, 56), (0, 0))))[0]
  np.testing.assert_array_equal(np.asarray(kept[:144]).view(np.uint16),
                                np.asarray(along_m).view(np.uint16))
  np.testing.assert_array_equal(cusparselt.kept_tile_mask(codes), mask)
  with pytest.raises(ValueError, match="65 rows on a device hold no copy of 72 rows"):
    cusparselt.tiles_times_keeping(a[:65], b)


def test_tile_buffer_along_the_features_is_the_input_products_buffer():
  """The copy of a tile-pruned activation compressed along its features
  (`tiles_compress_for_products`, the transposable compress kernel) is byte
  for byte the buffer the input product's own kernel writes for the same
  pruned array (`input_compress_for_product`, whose bytes are
  cusparseLtSpMMACompress2's as structured B: test_gpu.py), both kernels
  interpreted; the copy along M is a weight's forward buffer of it."""
  from jsparse24.backends import cusparselt  # pylint: disable=g-import-not-at-top
  from jsparse24.backends.pallas import interpret_mode  # pylint: disable=g-import-not-at-top
  x = _rand(5, (128, 192), jnp.bfloat16)
  xm = jnp.where(input_mask(x, True), x, jnp.zeros((), x.dtype))
  with interpret_mode():
    along_m, along_c, _ = jax.jit(cusparselt.tiles_compress_for_products)(x)
    rows = jax.jit(cusparselt.input_compress_for_product)(xm)
  want_m, _, _ = jax.jit(cusparselt.compress_for_products_xla, static_argnums=2)(xm, None, False)
  for got, want in ((along_c, rows), (along_m, want_m)):
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16),
                                  np.asarray(want).view(np.uint16))


# --- weight_grad="2:4": dw from the pruned activation pruned along the tokens ----


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("input_sparsity,grad_output", [
    ("masked", "dense"), ("ste", "dense"), ("off", "2:4"), ("masked", "2:4")])
@pytest.mark.parametrize("m,k,n", [(130, 32, 12)])
def test_weight_grad_24_matches_the_reference(dtype, input_sparsity, grad_output, m, k, n):
  """`weight_grad="2:4"` on the "xla" backend: y and dx those of the rows'
  masks, dw from the pruned activation (the input, else dy) pruned again
  along M, against the reference; the reference's dw is the dense product
  of those operands, and differs from the exact dw on random data."""
  x, w, dy = _rand(m, (m, k), dtype), _rand(k, (k, n), dtype), _rand(n + 3, (m, n), dtype)
  got = jax.jit(_vjp, static_argnums=(3, 4, 5, 6, 7))(x, w, dy, input_sparsity, "xla",
                                                        grad_output, None, "2:4")
  want = input_sparse_reference(x, w, dy, input_sparsity=input_sparsity, grad_output=grad_output,
                                weight_grad="2:4")
  for g, r, size in zip(got, want, (k, n, m)):
    assert g.dtype == r.dtype == dtype
    _close(g, r, dtype, size)
  exact = input_sparse_reference(x, w, dy, input_sparsity=input_sparsity, grad_output=grad_output)
  for a, b in zip(want[:2], exact[:2]):
    np.testing.assert_array_equal(a, b)
  f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
  if input_sparsity != "off":
    xm = jnp.where(input_mask(x), x, 0)
    lhs, rhs = jnp.where(token_mask(xm), xm, 0), dy
  else:
    dym = jnp.where(input_mask(dy), dy, 0)
    lhs, rhs = x, jnp.where(token_mask(dym), dym, 0)
  _close(want[2], f32(lhs).T @ f32(rhs), dtype, m)
  assert float(jnp.abs(f32(want[2]) - f32(exact[2])).max()) > 0.05


def test_token_mask_groups_tokens_16_rows_apart():
  """`token_mask` keeps, per column, the 2 largest of each group of 4 rows
  `64b + j + 16i` (i = 0..3), M padded to 64 rows: neighbours are in
  different groups. `token_groups` makes each group 4 consecutive rows."""
  from jsparse24._input_sparse import token_groups  # pylint: disable=g-import-not-at-top
  m = 80  # a block of 64 rows, and 16 rows of a block padded with zeros
  a = _rand(0, (m, 3))
  got = token_mask(a)
  ap = jnp.pad(a, ((0, 48), (0, 0)))
  for b in range(2):
    for j in range(16):
      rows = [64 * b + j + 16 * i for i in range(4)]
      want = jsparse24.prune_24(ap[jnp.array(rows)], axis=0)
      for r, keep in zip(rows, want):
        if r < m:
          np.testing.assert_array_equal(got[r], keep, err_msg=str((b, j, r)))
  grouped = token_groups(ap)
  np.testing.assert_array_equal(grouped[4 * 17 + 2], ap[64 + 1 + 16 * 2])


def test_weight_grad_24_is_exact_where_the_activation_is_24_along_the_tokens():
  """Where each feature of the pruned activation holds at most 2 nonzeros
  per group of 4 tokens (mostly-zero squared-ReLU outputs), the pruning
  along the tokens drops nothing: dw equals the exact one, for the input
  and for the output gradient."""
  m, k, n = 64, 32, 8
  x, w, dy = _rand(0, (m, k)), _rand(1, (k, n)), _rand(2, (m, n))
  # Each group of 4 tokens (rows j + 16i) keeps 2 per feature: i = 0, 1 for
  # even features, i = 2, 3 for odd ones (x: all K; dy: all N).
  first_half = (jnp.arange(m)[:, None] // 16) < 2
  x = jnp.where(first_half == (jnp.arange(k)[None] % 2 == 0), x, 0)
  dy = jnp.where(first_half == (jnp.arange(n)[None] % 2 == 0), dy, 0)
  for input_sparsity, grad_output in (("masked", "dense"), ("off", "2:4")):
    got = jax.jit(_vjp, static_argnums=(3, 4, 5, 6, 7))(x, w, dy, input_sparsity, "xla",
                                                          grad_output, None, "2:4")
    exact = input_sparse_reference(x, w, dy, input_sparsity=input_sparsity, grad_output=grad_output)
    np.testing.assert_allclose(got[2], exact[2], rtol=1e-6, atol=1e-6)


def test_tiles_see_later_tokens_and_weight_grad_24_does_not():
  """With `transposable=True` a token's mask depends on the other 3 tokens
  of its tile, later ones included, so its output does (no causal model
  should use it); the rows' masks and `weight_grad="2:4"` prune each token
  alone, so a token's output is unchanged by a change to a later one."""
  x, w = _rand(0, (4, 16)), _rand(1, (16, 8))
  later = x.at[3].set(x[0] * 10)  # token 3 made to compete for token 0's columns
  for options, moves in (({"transposable": True}, True), ({"weight_grad": "2:4"}, False),
                         ({}, False)):
    f = lambda x: jsparse24.sparse_dot(x, w, input_sparsity="masked", **options)  # noqa: E731
    gap = float(jnp.abs(f(later)[0] - f(x)[0]).max())
    assert (gap > 1e-3) if moves else (gap == 0), (options, gap)


def test_weight_grad_24_options():
  """`weight_grad="2:4"` goes with an activation-pruning layer and without
  tiles; through SparseDense it gives the reference's dw."""
  x, dy = _rand(0, (6, 16)), _rand(1, (6, 8))
  with pytest.raises(ValueError, match="SparseDense: weight_grad='2:4' prunes an activation"):
    jsparse24.SparseDense(8, weight_grad="2:4").init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="sparse_dot: weight_grad='2:4' with transposable=True"):
    jsparse24.sparse_dot(x, jnp.ones((16, 8)), input_sparsity="masked", transposable=True,
                         weight_grad="2:4")
  with pytest.raises(ValueError, match="leave weight_grad at 'dense' .or '2:4'"):
    jsparse24.sparse_dot(x, jnp.ones((16, 8)), input_sparsity="masked", weight_grad="mvue",
                         key=jax.random.key(0))
  opts = {"mask_source": "none", "input_sparsity": "masked", "weight_grad": "2:4"}
  kernel = _rand(2, (16, 8))
  params = {"params": {"kernel": kernel, "bias": jnp.zeros(8)}}
  _, vjp = jax.vjp(lambda k: jsparse24.SparseDense(8, **opts).apply(
      {"params": {"kernel": k, "bias": jnp.zeros(8)}}, x), kernel)
  del params
  np.testing.assert_allclose(vjp(dy)[0], input_sparse_reference(x, kernel, dy,
                                                               weight_grad="2:4")[2],
                             rtol=1e-5, atol=1e-5)
  layer = jnnx.SparseLinear(16, 8, rngs=nnx.Rngs(1), **opts)
  assert layer.weight_grad == "2:4"
