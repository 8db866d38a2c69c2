"""Tests of `jsparse24.nnx`: `SparseLinear` as a drop-in `nnx.Linear`, its
`SparsityMask` state, the gradient modes, and the mask helpers."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jsparse24
from jsparse24 import nnx as jnnx

IN, OUT = 12, 20  # K = 12: three groups of 4; both multiples of 4 (transposable)
BATCH = (3, 5)
TOL = dict(rtol=1e-5, atol=1e-5)
# The reference masks; jitted, as eager dispatch compiles each op per shape (slow).
_prune_24 = jax.jit(jsparse24.prune_24, static_argnames=("axis", "transposable"))


def _x(seed, shape=(*BATCH, IN), dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _layer(seed=0, **kw):
  return jnnx.SparseLinear(IN, OUT, rngs=nnx.Rngs(seed), **kw)


def _mask(layer):
  return np.asarray(layer.mask.get_value().unpack())


def _linear_with_kernel(layer, kernel):
  """An `nnx.Linear` holding `layer`'s params, with `kernel` as its kernel."""
  ref = nnx.Linear(layer.in_features, layer.out_features, use_bias=layer.use_bias,
                   dtype=layer.dtype, param_dtype=layer.param_dtype,
                   preferred_element_type=layer.preferred_element_type,
                   rngs=nnx.Rngs(123))
  nnx.update(ref, nnx.state(layer, nnx.Param))
  ref.kernel.set_value(jnp.asarray(kernel, ref.kernel[...].dtype))
  return ref


def _randomize_kernel(layer, seed):
  layer.kernel.set_value(_x(seed, layer.kernel[...].shape, layer.kernel[...].dtype))


# --- drop-in parity with nnx.Linear --------------------------------------------


def test_signature_matches_nnx_linear():
  linear = inspect.signature(nnx.Linear.__init__).parameters
  sparse = inspect.signature(jnnx.SparseLinear.__init__).parameters
  for name, p in linear.items():
    assert name in sparse, f"SparseLinear lacks nnx.Linear's argument {name!r}"
    assert sparse[name].kind == p.kind, name
    if name != "rngs":
      assert sparse[name].default is p.default or sparse[name].default == p.default, name
  assert sparse["rngs"].default is inspect.Parameter.empty
  extra = {"gradient": "ste", "transposable": None, "implementation": None,
           "mask_source": "collection", "weight_grad": "dense", "kernel_sharding": None,
           "input_sparsity": "off", "grad_output": "dense"}
  for name, default in extra.items():
    assert sparse[name].kind == inspect.Parameter.KEYWORD_ONLY, name
    assert sparse[name].default == default, name
  assert set(sparse) == set(linear) | set(extra)
  call_linear = inspect.signature(nnx.Linear.__call__).parameters
  call_sparse = inspect.signature(jnnx.SparseLinear.__call__).parameters
  assert list(call_sparse) == list(call_linear)


@pytest.mark.parametrize("use_bias,param_dtype", [(True, jnp.float32), (False, jnp.bfloat16)])
def test_params_structure_and_init_match_nnx_linear(use_bias, param_dtype):
  kw = dict(use_bias=use_bias, param_dtype=param_dtype)
  sparse = nnx.state(jnnx.SparseLinear(IN, OUT, rngs=nnx.Rngs(7), **kw), nnx.Param)
  dense = nnx.state(nnx.Linear(IN, OUT, rngs=nnx.Rngs(7), **kw), nnx.Param)
  assert jax.tree.structure(sparse) == jax.tree.structure(dense)
  flat_s = jax.tree_util.tree_leaves_with_path(sparse)
  flat_d = jax.tree_util.tree_leaves_with_path(dense)
  assert [p for p, _ in flat_s] == [p for p, _ in flat_d]
  for (path, a), (_, b) in zip(flat_s, flat_d):
    assert a.shape == b.shape and a.dtype == b.dtype, path
    np.testing.assert_array_equal(a, b)  # same rng draws as nnx.Linear


def test_dense_params_load_then_rebuild():
  linear = nnx.Linear(IN, OUT, bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(1))
  layer = _layer(seed=2)
  stale = _mask(layer)
  nnx.update(layer, nnx.state(linear, nnx.Param))
  kernel = np.asarray(linear.kernel[...])
  np.testing.assert_array_equal(layer.kernel[...], kernel)
  x = _x(3)
  # The mask is still the one built from the initial kernel ...
  np.testing.assert_array_equal(_mask(layer), stale)
  np.testing.assert_allclose(layer(x), _linear_with_kernel(layer, kernel * stale)(x), **TOL)
  # ... until it is rebuilt from the loaded kernel.
  new = np.asarray(_prune_24(linear.kernel[...], transposable=True))  # the default kind
  assert (new != stale).any()
  jnnx.rebuild_masks(layer)
  np.testing.assert_array_equal(_mask(layer), new)
  np.testing.assert_allclose(layer(x), _linear_with_kernel(layer, kernel * new)(x), **TOL)


@pytest.mark.parametrize("transposable", [False, True])
def test_stored_mask_is_prune_24_of_kernel(transposable):
  layer = _layer(seed=4, transposable=transposable)
  mask = layer.mask.get_value()
  assert isinstance(mask, jsparse24.Mask24)
  assert mask.transposable == transposable and mask.shape == (IN, OUT)
  want = _prune_24(layer.kernel[...], transposable=transposable)
  np.testing.assert_array_equal(mask.unpack(), want)
  assert layer.active[...].dtype == jnp.bool_ and bool(layer.active[...])


def test_default_mask_kind_is_transposable_where_out_features_allow():
  assert _layer(seed=5).mask.get_value().transposable  # OUT = 20
  odd = jnnx.SparseLinear(IN, 10, rngs=nnx.Rngs(5))
  assert not odd.mask.get_value().transposable
  with pytest.raises(ValueError, match="out_features=10"):
    jnnx.SparseLinear(IN, 10, transposable=True, rngs=nnx.Rngs(5))


def test_transposable_mask_is_24_along_both_axes():
  both = _layer(seed=5, transposable=True).mask.get_value().unpack()
  assert bool(jsparse24.is_24(both, axis=0)) and bool(jsparse24.is_24(both, axis=1))
  plain = _layer(seed=5, transposable=False).mask.get_value().unpack()
  assert bool(jsparse24.is_24(plain, axis=0)) and not bool(jsparse24.is_24(plain, axis=1))


@pytest.mark.parametrize("dtype,param_dtype,preferred", [
    (jnp.bfloat16, jnp.float32, None),
    (None, jnp.bfloat16, None),
    (jnp.bfloat16, jnp.float32, jnp.dtype(jnp.float32)),
])
def test_dtypes_match_nnx_linear(dtype, param_dtype, preferred):
  layer = _layer(seed=6, dtype=dtype, param_dtype=param_dtype, preferred_element_type=preferred)
  ref = _linear_with_kernel(layer, layer.kernel[...] * _mask(layer))
  x = _x(7)
  y, want = layer(x), ref(x)
  assert y.dtype == want.dtype
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want, np.float32),
                             rtol=2e-2, atol=2e-2)


# --- gradients ------------------------------------------------------------------


@pytest.mark.parametrize("gradient", ["ste", "masked"])
@pytest.mark.parametrize("transposable", [False, True])
def test_gradient_modes(gradient, transposable):
  layer = _layer(seed=8, gradient=gradient, transposable=transposable)
  x, dy = _x(9), _x(10, (*BATCH, OUT))
  grads = nnx.grad(lambda m: jnp.sum(m(x) * dy))(layer)
  assert jax.tree.structure(grads) == jax.tree.structure(nnx.state(layer, nnx.Param))
  x2, dy2 = np.asarray(x).reshape(-1, IN), np.asarray(dy).reshape(-1, OUT)
  dense_dw = x2.T @ dy2
  mask = _mask(layer)
  want = dense_dw if gradient == "ste" else dense_dw * mask
  assert np.abs(dense_dw * ~mask).max() > 1e-3  # the two modes differ here
  np.testing.assert_allclose(grads["kernel"][...], want, **TOL)
  np.testing.assert_allclose(grads["bias"][...], dy2.sum(0), **TOL)
  dx = jax.grad(lambda x: jnp.sum(layer(x) * dy))(x)
  w_masked = np.asarray(layer.kernel[...]) * mask
  np.testing.assert_allclose(dx, (dy2 @ w_masked.T).reshape(x.shape), **TOL)


@pytest.mark.parametrize("inactive", [jnp.array(False), False], ids=["array", "python-bool"])
def test_inactive_runs_dense_forward_and_gradient(inactive):
  """`active` as a Python bool too, as Linen's collection takes it (was
  TypeError: 'bool' object is not subscriptable, inside Flax)."""
  layer = _layer(seed=11, gradient="masked")
  x, dy = _x(12), _x(13, (*BATCH, OUT))
  kernel = np.asarray(layer.kernel[...])
  layer.active.set_value(inactive)
  np.testing.assert_allclose(layer(x), _linear_with_kernel(layer, kernel)(x), **TOL)
  grads = nnx.grad(lambda m: jnp.sum(m(x) * dy))(layer)
  x2, dy2 = np.asarray(x).reshape(-1, IN), np.asarray(dy).reshape(-1, OUT)
  np.testing.assert_allclose(grads["kernel"][...], x2.T @ dy2, **TOL)
  layer.active.set_value(jnp.array(True))
  np.testing.assert_allclose(layer(x), _linear_with_kernel(layer, kernel * _mask(layer))(x),
                             **TOL)


# --- dynamic masks, rebuilds, optimizer, jit -------------------------------------


def test_dynamic_mask_follows_kernel():
  layer = _layer(seed=14, mask_source="dynamic")
  stored = _layer(seed=14)  # same kernel, mask kept in a SparsityMask
  assert layer.mask is None and layer.active is None
  assert not jax.tree.leaves(jnnx.masks_state(layer))
  x = _x(15)
  np.testing.assert_allclose(layer(x), stored(x), **TOL)
  _randomize_kernel(layer, 16)
  stored.kernel.set_value(layer.kernel[...])
  kernel = layer.kernel[...]
  want = _linear_with_kernel(layer, kernel * _prune_24(kernel, transposable=True))(x)
  np.testing.assert_allclose(layer(x), want, **TOL)
  assert not np.allclose(stored(x), want, **TOL)  # the stored mask is stale


class _Model(nnx.Module):

  def __init__(self, rngs):
    self.up = jnnx.SparseLinear(IN, OUT, rngs=rngs)
    self.blocks = nnx.List([jnnx.SparseLinear(OUT, IN, transposable=True, rngs=rngs),
                            jnnx.SparseLinear(IN, OUT, mask_source="dynamic", rngs=rngs)])
    self.head = nnx.Linear(OUT, 3, rngs=rngs)

  def __call__(self, x):
    x = jax.nn.relu(self.up(x))
    x = jax.nn.relu(self.blocks[0](x))
    return self.head(self.blocks[1](x))


def test_rebuild_masks_updates_every_layer():
  model = _Model(nnx.Rngs(17))
  stored = [model.up, model.blocks[0]]
  for seed, layer in enumerate(stored, 18):
    _randomize_kernel(layer, seed)
    assert (_mask(layer) != _prune_24(layer.kernel[...], transposable=layer.transposable)).any()
  jnnx.rebuild_masks(model)
  for layer in stored:
    assert layer.mask.get_value().transposable == layer.transposable
    want = _prune_24(layer.kernel[...], transposable=layer.transposable)
    np.testing.assert_array_equal(_mask(layer), want)
  assert model.blocks[1].mask is None
  masks = jnnx.masks_state(model)
  assert len(jax.tree.leaves(masks)) == 4  # (packed mask, active) for 2 layers
  assert not any(isinstance(v, jnnx.SparsityMask)
                 for v in jax.tree.leaves(nnx.state(model, nnx.Param),
                                          is_leaf=lambda v: isinstance(v, nnx.Variable)))


def _loss(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


def test_optimizer_leaves_masks_alone():
  model = _layer(seed=20)
  optimizer = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
  opt_state = jax.tree.leaves(nnx.state(optimizer, nnx.OptState))
  # The momentum traces: one per Param (kernel, bias), none for the masks.
  assert sorted(leaf.shape for leaf in opt_state if leaf.ndim) == [(IN, OUT), (OUT,)]
  before = jax.tree.map(np.asarray, jnnx.masks_state(model))
  kernel = np.asarray(model.kernel[...])
  x, y = _x(21), _x(22, (*BATCH, OUT))
  grads = nnx.grad(_loss)(model, x, y)
  optimizer.update(model, grads)
  np.testing.assert_allclose(model.kernel[...], kernel - 0.1 * grads["kernel"][...], **TOL)
  after = jax.tree.map(np.asarray, jnnx.masks_state(model))
  assert jax.tree.structure(after) == jax.tree.structure(before)
  for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
    np.testing.assert_array_equal(a, b)


def test_jit_train_step_matches_eager():

  def step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(_loss)(model, x, y)
    optimizer.update(model, grads)
    jnnx.rebuild_masks(model)
    return loss

  jit_step = nnx.jit(step)
  models = [_Model(nnx.Rngs(23)) for _ in range(2)]
  opts = [nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param) for m in models]
  x, y = _x(24), _x(25, (*BATCH, 3))
  losses = [float(jit_step(models[0], opts[0], x, y))]
  np.testing.assert_allclose(losses[0], float(step(models[1], opts[1], x, y)), **TOL)
  jitted, eager = (nnx.state(m) for m in models)
  assert jax.tree.structure(jitted) == jax.tree.structure(eager)
  for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)):
    np.testing.assert_allclose(a, b, **TOL)
  losses += [float(jit_step(models[0], opts[0], x, y)) for _ in range(2)]
  assert losses[-1] < losses[0]
  # The masks were rebuilt inside the jitted step from the updated kernels.
  for layer in (models[0].up, models[0].blocks[0]):
    want = _prune_24(layer.kernel[...], transposable=layer.transposable)
    np.testing.assert_array_equal(_mask(layer), want)


def test_abstract_init():
  abstract = nnx.eval_shape(lambda: _layer(transposable=True))
  mask = abstract.mask.get_value()
  assert isinstance(mask, jsparse24.Mask24) and mask.transposable
  # K/4 = IN/4 groups per column, 4 bits each: the packed mask holds 1 bit per weight.
  assert mask.packed.size * 8 == IN * OUT and mask.packed.dtype == jnp.uint8


# --- errors ----------------------------------------------------------------------


def test_bad_arguments_raise():
  with pytest.raises(ValueError, match="in_features=6"):
    jnnx.SparseLinear(6, 8, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="gradient='dense'"):
    _layer(gradient="dense")
  with pytest.raises(ValueError, match="mask_source='params'"):
    _layer(mask_source="params")
  with pytest.raises(ValueError, match="out_features=6"):
    jnnx.SparseLinear(8, 6, transposable=True, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="dot_general"):
    _layer(dot_general=lambda *a, **k: jax.lax.dot_general(*a, **k))
  with pytest.raises(ValueError, match="implementation='nope'"):
    _layer(implementation="nope")(_x(0))
  with pytest.raises(NotImplementedError, match="out_sharding"):
    _layer()(_x(0), out_sharding=jax.sharding.PartitionSpec())
  with pytest.raises(ValueError, match="x.shape"):
    _layer()(_x(0, (2, IN + 4)))
