"""Tests of `jsparse24.nnx.compress_params`: an NNX model compressed in place
serves the outputs of its 2:4 model (masked kernels), holds `Sparse24`s,
goes through `nnx.split`/`merge`/`jit`, a decode loop, `nnx.vmap`/`nnx.scan`
stacks and an Orbax save/restore, reaches the decode kernel where the
automatic choice says, and names its errors."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jsparse24
from jsparse24 import nnx as jnnx
from jsparse24.backends.pallas import interpret_mode
from tests.test_decode24 import decode_gpu  # noqa: F401  (a fixture)

# K, N not powers of two: 20 (K/4 odd: the flat packed mask, a padded
# metadata nibble) and 36; 14 is not a multiple of 4 (a plain mask).
K, H, N = 20, 36, 14
# Per dtype: products of the same weights in another order of summation.
TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _x(seed, shape, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _randomize(model, seed):
  """Fresh kernels and biases, the masks left as they were: a mask that is no
  longer the kernel's magnitude mask, so that compressing by magnitude
  instead of with the layer's mask gives other outputs."""
  for i, (_, layer) in enumerate(nnx.iter_modules(model)):
    if isinstance(layer, (jnnx.SparseLinear, nnx.Linear)):
      for var in (layer.kernel, layer.bias):
        if var is not None:
          var.set_value(_x(seed + i, var[...].shape, var[...].dtype))


class _Mlp(nnx.Module):
  """up (transposable: H a multiple of 4), down (plain: N is not), a dense head."""

  def __init__(self, rngs, **kw):
    self.up = jnnx.SparseLinear(K, H, rngs=rngs, **kw)
    self.down = jnnx.SparseLinear(H, N, rngs=rngs, **kw)
    self.head = nnx.Linear(N, 3, rngs=rngs, param_dtype=kw.get("param_dtype", jnp.float32))

  def __call__(self, x):
    return self.head(self.down(jax.nn.relu(self.up(x))))


def _masked_reference(layer):
  """An `nnx.Linear` with `layer`'s params and `kernel * mask` as its kernel."""
  ref = nnx.Linear(layer.in_features, layer.out_features, use_bias=layer.use_bias,
                   dtype=layer.dtype, param_dtype=layer.param_dtype,
                   preferred_element_type=layer.preferred_element_type, rngs=nnx.Rngs(0))
  nnx.update(ref, nnx.state(layer, nnx.Param))
  ref.kernel.set_value(layer.kernel[...] * layer.mask.get_value().unpack())
  return ref


def _kernels(model):
  return [layer.kernel.get_value() for _, layer in nnx.iter_modules(model)
          if isinstance(layer, jnnx.SparseLinear)]


def _bytes(tree):
  return sum(int(a.nbytes) for a in jax.tree.leaves(tree))


# --- outputs ---------------------------------------------------------------------


# Every pair of two of the three arguments' values (all rows x transposed,
# each dtype with each of those).
@pytest.mark.parametrize("rows,transposed,dtype", [
    ((1,), None, jnp.float32), ((1,), False, jnp.bfloat16), ((3,), None, jnp.bfloat16),
    ((3,), False, jnp.float32), ((2, 3), None, jnp.float32), ((2, 3), False, jnp.bfloat16)])
def test_compressed_model_serves_the_masked_models_outputs(dtype, rows, transposed):
  model = _Mlp(nnx.Rngs(0), param_dtype=dtype)
  _randomize(model, 1)
  x = _x(2, (*rows, K), dtype)
  refs = {name: _masked_reference(getattr(model, name)) for name in ("up", "down")}
  want = model.head(refs["down"](jax.nn.relu(refs["up"](x))))
  before = model(x)
  np.testing.assert_allclose(np.asarray(before, np.float32), np.asarray(want, np.float32),
                             **TOL[dtype])
  jnnx.compress_params(model, transposed=transposed)
  got = model(x)
  assert got.shape == (*rows, 3) and got.dtype == before.dtype == dtype
  # The product is the same on the same (masked) weights, bit for bit.
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(before, np.float32))
  # Fresh data after compressing: the model holds the masked weights, not
  # outputs cached from one input.
  x2 = _x(3, (*rows, K), dtype)
  np.testing.assert_allclose(
      np.asarray(model(x2), np.float32),
      np.asarray(model.head(refs["down"](jax.nn.relu(refs["up"](x2)))), np.float32),
      **TOL[dtype])


@pytest.mark.parametrize("dtype,param_dtype,preferred", [
    (jnp.bfloat16, jnp.float32, None),
    (jnp.bfloat16, jnp.float32, jnp.dtype(jnp.float32)),
    (None, jnp.bfloat16, None),
])
def test_compressed_layer_keeps_the_dense_layers_dtypes(dtype, param_dtype, preferred):
  layer = jnnx.SparseLinear(K, H, dtype=dtype, param_dtype=param_dtype,
                            preferred_element_type=preferred, rngs=nnx.Rngs(4))
  _randomize(layer, 5)
  x = _x(6, (3, K))
  before = layer(x)
  jnnx.compress_params(layer)
  got = layer(x)
  assert got.dtype == before.dtype
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(before, np.float32))


def test_named_pallas_backend_multiplies_the_compressed_kernel():
  """`implementation="pallas"` (interpreted on CPU): the decode kernel, the
  masked model's outputs."""
  model = _Mlp(nnx.Rngs(7), implementation="pallas")
  _randomize(model, 8)
  x = _x(9, (3, K))
  with interpret_mode():
    before = model(x)
    jnnx.compress_params(model)
    got = model(x)
    jaxpr = str(jax.make_jaxpr(lambda x: model(x))(x))
  assert jaxpr.count("pallas_call") == 2, jaxpr
  np.testing.assert_allclose(got, before, **TOL[jnp.float32])


def test_automatic_choice_reaches_the_decode_kernel(decode_gpu):  # noqa: F811
  """On a GPU whose sweep takes the decode kernel at up to 16 rows (CPU:
  only traced), a compressed layer's small-M product is the decode kernel
  and its large-M product is not: the layer asks `sparse_dot`'s automatic
  choice about a compressed weight."""
  del decode_gpu
  layer = jnnx.SparseLinear(2048, 2048, use_bias=False, transposable=False,
                            param_dtype=jnp.bfloat16, rngs=nnx.Rngs(10))
  jnnx.compress_params(layer)
  trace = lambda m: str(jax.make_jaxpr(layer)(jnp.ones((m, 2048), jnp.bfloat16)))  # noqa: E731
  assert "jsparse24_decode" in trace(2)
  assert "pallas_call" not in trace(64)


# --- what the model holds --------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_model_holds_sparse24s_and_fewer_bytes(dtype):
  model = _Mlp(nnx.Rngs(11), param_dtype=dtype)
  masks = {name: getattr(model, name).mask.get_value() for name in ("up", "down")}
  kernels = {name: getattr(model, name).kernel[...] for name in ("up", "down")}
  dense_bytes = _bytes(nnx.state(model))
  masks_bytes = _bytes(jnnx.masks_state(model))
  jnnx.compress_params(model, transposed=False)
  size = jnp.dtype(dtype).itemsize
  for name, (k, n) in (("up", (K, H)), ("down", (H, N))):
    layer = getattr(model, name)
    sp = layer.kernel.get_value()
    assert type(layer.kernel) is nnx.Param and isinstance(sp, jsparse24.Sparse24)
    assert sp.shape == (k, n) and sp.dtype == dtype and not sp.has_transpose
    assert layer.mask is None and layer.active is None
    # Compressed with the layer's own mask, exactly.
    np.testing.assert_array_equal(sp.mask(), masks[name].unpack())
    np.testing.assert_array_equal(jsparse24.decompress(sp), kernels[name] * masks[name].unpack())
    assert sp.nbytes == k * n // 2 * size + n * -(-k // 8)
  assert not jax.tree.leaves(jnnx.masks_state(model))
  saved = sum(k * n * jnp.dtype(dtype).itemsize - (k * n // 2 * size + n * -(-k // 8))
              for k, n in ((K, H), (H, N)))
  assert _bytes(nnx.state(model)) == dense_bytes - masks_bytes - saved


def test_transposed_copy_follows_the_mask_kind():
  model = _Mlp(nnx.Rngs(12))
  jnnx.compress_params(model)  # transposed=None: where the mask is transposable
  up, down = (layer.kernel.get_value() for layer in (model.up, model.down))
  assert up.has_transpose and not down.has_transpose
  np.testing.assert_array_equal(jsparse24.decompress(up.transpose()), jsparse24.decompress(up).T)


def test_dense_phase_and_dynamic_layers_keep_their_dense_kernels():
  model = _Mlp(nnx.Rngs(13))
  dynamic = jnnx.SparseLinear(K, H, mask_source="dynamic", rngs=nnx.Rngs(14))
  model.extra = dynamic
  model.down.active.set_value(jnp.array(False))
  x = _x(15, (3, K))
  before, extra_before = model(x), dynamic(x)
  jnnx.compress_params(model)
  assert isinstance(model.up.kernel.get_value(), jsparse24.Sparse24)
  assert not isinstance(model.down.kernel.get_value(), jsparse24.Sparse24)
  assert not bool(model.down.active[...]) and model.down.mask is not None
  assert not isinstance(dynamic.kernel.get_value(), jsparse24.Sparse24)
  np.testing.assert_array_equal(model(x), before)
  np.testing.assert_array_equal(dynamic(x), extra_before)


# --- transforms, a decode loop, stacks, checkpoints ---------------------------------


def test_split_merge_and_jit_carry_the_compressed_model():
  model = _Mlp(nnx.Rngs(16))
  _randomize(model, 17)
  jnnx.compress_params(model)
  x = _x(18, (3, K))
  want = model(x)
  graphdef, state = nnx.split(model)
  assert any(isinstance(leaf, jsparse24.Sparse24) for leaf in jax.tree.leaves(
      state, is_leaf=lambda a: isinstance(a, jsparse24.Sparse24)))
  merged = nnx.merge(graphdef, state)
  assert isinstance(merged.up.kernel.get_value(), jsparse24.Sparse24)
  np.testing.assert_array_equal(merged(x), want)
  np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(merged, x), want, **TOL[jnp.float32])
  np.testing.assert_allclose(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, x), want,
                             **TOL[jnp.float32])


class _Decoder(nnx.Module):
  """h -> h + down(relu(up(h))): a residual block whose output feeds the next step."""

  def __init__(self, rngs):
    self.up = jnnx.SparseLinear(K, H, rngs=rngs)
    self.down = jnnx.SparseLinear(H, K, rngs=rngs)

  def __call__(self, h):
    return jnp.tanh(h + self.down(jax.nn.relu(self.up(h))))


def test_jitted_decode_loop_runs_on_the_compressed_model():
  """One row at a time, each step's output the next step's input: the
  compressed model's tokens follow the masked model's, and the step is
  traced once per model structure, not per token."""
  model = _Decoder(nnx.Rngs(19))
  _randomize(model, 20)
  traced = []

  @nnx.jit
  def step(model, h):
    traced.append(isinstance(model.up.kernel.get_value(), jsparse24.Sparse24))
    return model(h)

  def decode(h, steps=6):
    out = [h]
    for _ in range(steps):
      out.append(step(model, out[-1]))
    return out

  h0 = _x(21, (1, K))
  dense = decode(h0)
  jnnx.compress_params(model, transposed=False)
  compressed = decode(h0)
  assert traced == [False, True]
  assert not (np.asarray(dense[1]) == np.asarray(dense[-1])).all()  # the state moves
  for got, want in zip(compressed, dense):
    np.testing.assert_allclose(got, want, **TOL[jnp.float32])


def test_a_stack_compresses_whole_or_not_at_all():
  layers = 3

  @nnx.split_rngs(splits=layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def create(rngs):
    return _Decoder(rngs)

  @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
  def forward(h, block):
    return block(h)

  blocks = create(nnx.Rngs(22))
  _randomize(blocks, 23)
  x = _x(24, (3, K))
  before = forward(x, blocks)
  blocks.up.active.set_value(jnp.array([True, False, True]))
  state = jax.tree.map(np.asarray, nnx.state(blocks))
  with pytest.raises(ValueError, match=r"nnx.compress_params: layer 'up' is a stack whose"
                                       r" layers are partly sparse"):
    jnnx.compress_params(blocks)
  # Nothing was compressed: down, visited before up, is left as it was too.
  after = jax.tree.map(np.asarray, nnx.state(blocks))
  assert jax.tree.structure(after) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(state)):
    np.testing.assert_array_equal(a, b)
  blocks.up.active.set_value(jnp.array([True, True, True]))
  jnnx.compress_params(blocks)
  up = blocks.up.kernel.get_value()
  assert isinstance(up, jsparse24.Sparse24) and up.shape == (layers, K, H)
  np.testing.assert_allclose(forward(x, blocks), before, **TOL[jnp.float32])


def test_orbax_restores_a_compressed_model(tmp_path):
  model = _Mlp(nnx.Rngs(25))
  _randomize(model, 26)
  jnnx.compress_params(model)
  x = _x(27, (3, K))
  want = model(x)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "served", nnx.state(model))
  ckpt.wait_until_finished()
  # The target: another model, compressed the same way (its own weights).
  target = _Mlp(nnx.Rngs(99))
  jnnx.compress_params(target)
  assert not np.allclose(target(x), want)
  graphdef, state = nnx.split(target)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
  restored = ckpt.restore(tmp_path / "served", abstract)
  served = nnx.merge(graphdef, restored)
  assert isinstance(served.up.kernel.get_value(), jsparse24.Sparse24)
  for a, b in zip(jax.tree.leaves(nnx.state(served)), jax.tree.leaves(nnx.state(model))):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(served(x), want)


# --- gradients and errors ---------------------------------------------------------


def test_gradients_through_a_compressed_layer():
  """`nnx.grad` over the Params stops at the uint8 metadata (JAX's error);
  with `allow_int=True` it differentiates in the kept values, as through
  `decompress`; in the inputs it needs nothing."""
  layer = jnnx.SparseLinear(K, H, rngs=nnx.Rngs(28))
  _randomize(layer, 29)
  jnnx.compress_params(layer)
  x, dy = _x(30, (3, K)), _x(31, (3, H))
  loss = lambda m: jnp.sum(m(x) * dy)  # noqa: E731
  with pytest.raises(TypeError, match=r"uint8.*allow_int"):
    nnx.grad(loss)(layer)
  grads = nnx.grad(loss, allow_int=True)(layer)
  sp = layer.kernel.get_value()
  want = jax.grad(lambda v: jnp.sum(
      (x @ jsparse24.decompress(jsparse24.Sparse24(v, sp.meta, sp.values_t, sp.meta_t))) * dy))(
          sp.values)
  np.testing.assert_allclose(grads["kernel"].get_value().values, want, **TOL[jnp.float32])
  np.testing.assert_allclose(grads["bias"][...], dy.sum(0), **TOL[jnp.float32])
  dx = jax.grad(lambda x: jnp.sum(layer(x) * dy))(x)
  np.testing.assert_allclose(dx, dy @ jsparse24.decompress(sp).T, **TOL[jnp.float32])


def test_errors_name_the_function_and_the_fix():
  model = _Mlp(nnx.Rngs(32))
  with pytest.raises(TypeError, match=r"nnx.compress_params: the 'active' flags of layer 'down'"
                                      r" are traced; call nnx.compress_params outside nnx.jit"):
    nnx.jit(jnnx.compress_params)(model)
  with pytest.raises(ValueError, match=r"nnx.compress_params: transposed=True, but the mask"
                                       r" of layer 'down' is not transposable"):
    jnnx.compress_params(model, transposed=True)
  assert not isinstance(model.up.kernel.get_value(), jsparse24.Sparse24)  # nothing changed
  with pytest.raises(TypeError, match=r"nnx.compress_params: `transposed` must be None"):
    jnnx.compress_params(model, transposed="yes")
  with pytest.raises(TypeError, match=r"nnx.compress_params: `model` must be an nnx.Module"):
    jnnx.compress_params(nnx.state(model))
  with pytest.raises(ValueError, match=r"nnx.compress_params: `model` has no SparseLinear with"
                                       r" a stored mask"):
    jnnx.compress_params(jnnx.SparseLinear(K, H, mask_source="dynamic", rngs=nnx.Rngs(0)))
  jnnx.compress_params(model)
  with pytest.raises(TypeError, match=r"nnx.compress_params: the kernel of layer 'down' is"
                                      r" already a Sparse24 \(was the model compressed twice"):
    jnnx.compress_params(model)
  with pytest.raises(TypeError, match=r"nnx.rebuild_masks: the kernel of layer 'down' is a"
                                      r" Sparse24.*rebuild them before compressing"):
    jnnx.rebuild_masks(model)
  with pytest.raises(ValueError, match=r"SparseLinear: `x.shape\[-1\]` = 24 does not match"):
    model.up(_x(33, (3, K + 4)))
  with pytest.raises(NotImplementedError, match="out_sharding"):
    model.up(_x(33, (3, K)), out_sharding=jax.sharding.PartitionSpec())
  # A dense kernel put back into a compressed layer has no mask to use.
  model.up.kernel = nnx.Param(jsparse24.decompress(model.up.kernel.get_value()))
  with pytest.raises(ValueError, match=r"SparseLinear: this layer takes its 2:4 mask from"
                                       r" `layer.mask`.*but its mask is None"):
    model.up(_x(33, (3, K)))


def test_a_compressed_models_state_in_a_model_not_compressed_is_named():
  """nnx.update(fresh, nnx.state(compressed)) gave layers a Sparse24 kernel
  beside the fresh model's masks and active flags, which the product then
  ignored without a word (`active = False` left the layer compressed)."""
  compressed = _Mlp(nnx.Rngs(40))
  jnnx.compress_params(compressed)
  fresh = _Mlp(nnx.Rngs(41))
  nnx.update(fresh, nnx.state(compressed))
  with pytest.raises(ValueError, match=r"SparseLinear: the kernel is a Sparse24 \(compressed\),"
                     r" but the layer still holds a mask .* Compress the target first,"
                     r" jsparse24.nnx.compress_params\(model\), then update it"):
    fresh(_x(42, (3, K)))
  target = _Mlp(nnx.Rngs(41))  # the fix: compress the target, then update it
  jnnx.compress_params(target)
  nnx.update(target, nnx.state(compressed))
  np.testing.assert_array_equal(target(_x(42, (3, K))), compressed(_x(42, (3, K))))


def test_rebuild_masks_changes_nothing_when_a_later_layer_is_compressed():
  """rebuild_masks rebuilt 'down' from its kernel (layers in order of their
  names), then raised on the compressed 'up': the model was left half
  changed."""
  model = _Mlp(nnx.Rngs(43))
  _randomize(model, 44)  # 'down's magnitude mask is no longer its stored one
  jnnx.compress_params(model.up)
  before = model.down.mask.get_value().packed
  with pytest.raises(TypeError, match=r"nnx.rebuild_masks: the kernel of layer 'up' is a"
                                      r" Sparse24"):
    jnnx.rebuild_masks(model)
  np.testing.assert_array_equal(model.down.mask.get_value().packed, before)
  assert not np.array_equal(jsparse24.Mask24.from_weights(
      model.down.kernel[...], transposable=False).packed, before)  # a rebuild would change it


def test_compress_params_in_cusparselts_layout():
  """`cusparselt=True`: every kernel in cuSPARSELt's layout, the same
  outputs bit for bit; a kernel that cannot take it (K, N not multiples of
  64, float32) raises naming the layer before any layer changes."""
  model = _Mlp(nnx.Rngs(0), param_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match=r"nnx.compress_params: layer '(up|down)': cusparselt=True needs K"
                                       r" and N multiples of 64"):
    jnnx.compress_params(model, cusparselt=True)
  assert not isinstance(model.up.kernel.get_value(), jsparse24.Sparse24)

  class Wide(nnx.Module):
    def __init__(self, rngs):
      self.up = jnnx.SparseLinear(128, 192, rngs=rngs, param_dtype=jnp.bfloat16)
      self.down = jnnx.SparseLinear(192, 64, rngs=rngs, param_dtype=jnp.bfloat16)

    def __call__(self, x):
      return self.down(jax.nn.relu(self.up(x)))

  model = Wide(nnx.Rngs(1))
  _randomize(model, 2)
  x = _x(3, (5, 128), jnp.bfloat16)
  before = model(x)
  jnnx.compress_params(model, transposed=False, cusparselt=True)
  for layer in (model.up, model.down):
    assert layer.kernel.get_value().cusparselt
  np.testing.assert_array_equal(np.asarray(model(x), np.float32), np.asarray(before, np.float32))
