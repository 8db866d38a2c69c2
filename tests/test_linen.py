"""SparseDense (drop-in for nn.Dense), the sparsify patcher, mask-tree helpers."""

import dataclasses

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse24
from jsparse24._format import Mask24
from jsparse24.backends.pallas import interpret_mode


def _rand(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, dtype)


def test_fields_and_defaults_match_dense():
  dense = {f.name: f for f in dataclasses.fields(nn.Dense)}
  sparse = {f.name: f for f in dataclasses.fields(jsparse24.SparseDense)}
  for name, field in dense.items():
    assert name in sparse, name
    assert sparse[name].default == field.default, name
  extra = set(sparse) - set(dense)
  assert extra == {"gradient", "transposable", "implementation", "mask_source", "weight_grad",
                   "kernel_sharding", "input_sparsity", "grad_output"}


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("k,n", [(16, 8), (12, 5), (20, 3)])
def test_dense_checkpoint_loads_and_matches_masked_dense(use_bias, k, n):
  x = _rand(1, (3, 7, k))
  dense = nn.Dense(n, use_bias=use_bias)
  sparse = jsparse24.SparseDense(n, use_bias=use_bias)
  dense_params = dense.init(jax.random.key(2), x)["params"]
  if use_bias:
    dense_params = {**dense_params, "bias": _rand(3, (n,))}
  sparse_vars = sparse.init(jax.random.key(5), x)
  # Same params tree (names, shapes, dtypes) as nn.Dense.
  assert jax.tree.structure(sparse_vars["params"]) == jax.tree.structure(dense_params)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), sparse_vars["params"]) == \
      jax.tree.map(lambda a: (a.shape, a.dtype), dense_params)
  # Load the dense checkpoint; masks rebuilt from it. The default mask kind:
  # transposable where the output size allows it (n % 4 == 0), else plain.
  sparsity = jsparse24.rebuild_masks(dense_params, sparse_vars["sparsity"])
  assert sparsity["mask"].transposable == (n % 4 == 0)
  y = sparse.apply({"params": dense_params, "sparsity": sparsity}, x)
  mask = jsparse24.prune_24(dense_params["kernel"], transposable=n % 4 == 0)
  np.testing.assert_array_equal(sparsity["mask"].unpack(), mask)
  masked = {**dense_params, "kernel": dense_params["kernel"] * mask}
  np.testing.assert_allclose(y, dense.apply({"params": masked}, x), rtol=1e-5, atol=1e-5)


def test_init_mask_is_pruned_init_kernel_and_dtype_promotion():
  x = _rand(0, (4, 16)).astype(jnp.bfloat16)
  layer = jsparse24.SparseDense(8, dtype=jnp.bfloat16, transposable=True)
  v = layer.init(jax.random.key(1), x)
  np.testing.assert_array_equal(
      v["sparsity"]["mask"].unpack(),
      jsparse24.prune_24(v["params"]["kernel"], transposable=True))
  assert v["sparsity"]["mask"].transposable
  y = layer.apply(v, x)
  assert y.dtype == jnp.bfloat16
  ref = nn.Dense(8, dtype=jnp.bfloat16).apply(
      {"params": {**v["params"], "kernel": v["params"]["kernel"] * v["sparsity"]["mask"].unpack()}}, x)
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref, np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("gradient", ["ste", "masked"])
def test_gradient_modes_through_the_layer(gradient):
  x = _rand(0, (5, 16))
  layer = jsparse24.SparseDense(8, gradient=gradient, use_bias=False)
  v = layer.init(jax.random.key(1), x)
  g = jax.grad(lambda p: jnp.sum(layer.apply({**v, "params": p}, x) ** 2))(v["params"])["kernel"]
  y = layer.apply(v, x)
  full = x.T @ (2 * y)
  mask = v["sparsity"]["mask"].unpack()
  want = full if gradient == "ste" else full * mask
  np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)
  if gradient == "ste":
    assert np.abs(np.asarray(g)[~np.asarray(mask)]).max() > 0


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("active", [True, False])
def test_mixed_precision_kernel_gradient_is_nn_dense_gradient(implementation, active):
  """bfloat16 compute with float32 params: the kernel's gradient ("ste") is
  bit for bit nn.Dense's (x^T dy in bfloat16, cast to float32), on every
  backend and in the dense phase. A float32 product would cost, under
  nn.scan, a copy of every weight's gradient (docs/design_notes.md, "The
  weight gradient in the input's dtype")."""
  x = _rand(0, (32, 64)).astype(jnp.bfloat16)
  c = _rand(2, (32, 16)).astype(jnp.bfloat16)
  layer = jsparse24.SparseDense(16, dtype=jnp.bfloat16, use_bias=False,
                                implementation=implementation)
  with interpret_mode():
    v = layer.init(jax.random.key(1), x)
    v = {**v, "sparsity": {**v["sparsity"], "active": jnp.array(active)}}
    g = jax.grad(lambda p: jnp.sum(
        layer.apply({**v, "params": p}, x).astype(jnp.float32) * c.astype(jnp.float32)))(
            v["params"])["kernel"]
  assert g.dtype == jnp.float32
  ref = jax.grad(lambda k: jnp.sum(nn.Dense(16, dtype=jnp.bfloat16, use_bias=False).apply(
      {"params": {"kernel": k}}, x).astype(jnp.float32) * c.astype(jnp.float32)))(
          v["params"]["kernel"])
  np.testing.assert_array_equal(g, ref)
  want = np.asarray(x, np.float32).T @ np.asarray(c, np.float32)
  np.testing.assert_allclose(g, want, rtol=2 ** -7, atol=1e-6)


def test_dynamic_mask_source_follows_the_kernel():
  x = _rand(0, (2, 8))
  layer = jsparse24.SparseDense(4, mask_source="dynamic", use_bias=False)
  v = layer.init(jax.random.key(1), x)
  assert "sparsity" not in v
  kernel = _rand(7, (8, 4))
  y = layer.apply({"params": {"kernel": kernel}}, x)
  np.testing.assert_allclose(y, x @ (kernel * jsparse24.prune_24(kernel, transposable=True)),
                             rtol=1e-5, atol=1e-6)


def test_inactive_layer_is_dense():
  x = _rand(0, (2, 8))
  layer = jsparse24.SparseDense(4)
  v = layer.init(jax.random.key(1), x)
  off = {**v, "sparsity": {**v["sparsity"], "active": jnp.array(False)}}
  np.testing.assert_allclose(layer.apply(off, x), nn.Dense(4).apply({"params": v["params"]}, x), rtol=1e-6)


@pytest.mark.parametrize("active", [True, False])
def test_a_flag_known_while_tracing_leaves_no_conditional(active):
  """An `active` flag that is a constant of the program (a NumPy bool closed
  over by the traced function) picks its product while tracing: the program
  has no `cond` (a traced flag gives the Pallas product one), and computes
  that product (the 2:4 one, or nn.Dense's)."""
  x = _rand(0, (2, 8))
  layer = jsparse24.SparseDense(4, use_bias=False, implementation="pallas")
  with interpret_mode():
    v = layer.init(jax.random.key(1), x)
    v = {**v, "sparsity": {**v["sparsity"], "active": np.bool_(active)}}
    f = lambda x: layer.apply(v, x)  # noqa: E731
    traced = lambda x, flag: layer.apply(  # noqa: E731
        {**v, "sparsity": {**v["sparsity"], "active": flag}}, x)
    assert " cond[" in str(jax.make_jaxpr(traced)(x, jnp.array(active)))
    assert " cond[" not in str(jax.make_jaxpr(f)(x))
    y = jax.jit(f)(x)
  kernel = v["params"]["kernel"]
  want = x @ (kernel * v["sparsity"]["mask"].unpack()) if active else x @ kernel
  np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)


def test_clear_errors():
  x = _rand(0, (2, 8))
  layer = jsparse24.SparseDense(4)
  v = layer.init(jax.random.key(1), x)
  with pytest.raises(ValueError, match="sparsity.*collection"):
    layer.apply({"params": v["params"]}, x)
  with pytest.raises(ValueError, match="does not fit this layer"):
    jsparse24.SparseDense(4, transposable=False).apply(v, x)
  with pytest.raises(ValueError, match="multiple of 4"):
    jsparse24.SparseDense(4).init(jax.random.key(0), _rand(0, (2, 6)))
  with pytest.raises(ValueError, match="dot_general"):
    jsparse24.SparseDense(4, dot_general=jax.lax.dot_general).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="gradient"):
    jsparse24.SparseDense(4, gradient="sparse").init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="mask_source"):
    jsparse24.SparseDense(4, mask_source="file").init(jax.random.key(0), x)


class _Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(16, name="down")(nn.gelu(nn.Dense(32, name="up")(x)))


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(16, name="attn_out")(x)
    return h + _Mlp(name="mlp")(h)


class _Model(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(2):
      x = _Block(name=f"block_{i}")(x)
    return nn.Dense(4, name="head")(x)


def test_sparsify_patches_matching_dense_layers_only():
  x = _rand(0, (3, 16))
  model = _Model()
  dense_vars = model.init(jax.random.key(0), x)
  patched = jsparse24.sparsify(model, [
      (r"block_0/mlp/.*", {"gradient": "masked", "transposable": True}),
      (r".*/mlp/.*", {"transposable": False}),
  ])
  v = patched.init(jax.random.key(0), x)
  # The params tree is the dense model's, unchanged.
  assert jax.tree.structure(v["params"]) == jax.tree.structure(dense_vars["params"])
  paths = {"/".join(str(k.key) for k in p[:-1])
           for p, _ in jax.tree_util.tree_leaves_with_path(v["sparsity"])
           if getattr(p[-1], "key", None) == "active"}
  assert paths == {"block_0/mlp/up", "block_0/mlp/down", "block_1/mlp/up", "block_1/mlp/down"}
  assert v["sparsity"]["block_0"]["mlp"]["up"]["mask"].transposable
  assert not v["sparsity"]["block_1"]["mlp"]["down"]["mask"].transposable
  # Dense params load unchanged; output equals the dense model with masked MLP kernels.
  sparsity = jsparse24.rebuild_masks(dense_vars["params"], v["sparsity"])
  y = patched.apply({"params": dense_vars["params"], "sparsity": sparsity}, x)

  def mask_mlp(params, sparsity):
    out = jax.tree.map(lambda a: a, params)
    for b in ("block_0", "block_1"):
      for name, layer in sparsity[b]["mlp"].items():
        out[b]["mlp"][name]["kernel"] = params[b]["mlp"][name]["kernel"] * layer["mask"].unpack()
    return out

  want = model.apply({"params": mask_mlp(dense_vars["params"], sparsity)}, x)
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
  assert not np.allclose(y, model.apply(dense_vars, x), atol=1e-3)


def test_a_rule_matches_a_layers_whole_path_not_a_prefix_of_it():
  """A rule fully matches a path, as `sparsify` says: "block_0/attn" is not
  the layer "block_0/attn_out", nor "block_0/mlp" its "up" and "down"; each
  matches no nn.Dense, which `init` says."""
  x = _rand(0, (3, 16))
  for rule in (r"block_0/attn", r"block_0/mlp"):
    with pytest.raises(ValueError, match="matched no nn.Dense"):
      jsparse24.sparsify(_Model(), {rule: {}}).init(jax.random.key(0), x)
  # The rule's first alternative is a prefix of "block_0/attn_out", which
  # stays dense; the second is a whole path.
  v = jsparse24.sparsify(_Model(), {r"block_0/attn|block_1/mlp/up": {}}).init(
      jax.random.key(0), x)
  assert list(jsparse24.optim.stats(jsparse24.optim.mask_update(v["sparsity"]).init(
      v["params"]))) == ["block_1/mlp/up"]


def test_sparsify_rejects_rules_that_match_nothing_and_bad_options():
  x = _rand(0, (3, 16))
  with pytest.raises(ValueError, match="matched no nn.Dense"):
    jsparse24.sparsify(_Model(), {r"decoder/.*": {}}).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="unknown option"):
    jsparse24.sparsify(_Model(), {r".*": {"sparsity": 0.5}})


def test_compress_params_serves_the_same_outputs():
  x = _rand(0, (3, 16))
  patched = jsparse24.sparsify(_Model(), {r".*/mlp/.*": {"transposable": True}})
  v = patched.init(jax.random.key(0), x)
  # Non-zero biases (init makes them 0), so that a dropped bias shows.
  v = {**v, "params": jax.tree_util.tree_map_with_path(
      lambda path, a: _rand(len(path), a.shape) if path[-1].key == "bias" else a, v["params"])}
  compressed = jsparse24.compress_params(v["params"], v["sparsity"])
  kernels = [leaf for leaf in jax.tree.leaves(compressed, is_leaf=lambda a: isinstance(a, jsparse24.Sparse24))
             if isinstance(leaf, jsparse24.Sparse24)]
  assert len(kernels) == 4 and all(k.has_transpose for k in kernels)
  y = patched.apply({"params": compressed}, x)
  np.testing.assert_allclose(y, patched.apply(v, x), rtol=1e-6, atol=1e-6)
  dense_bytes = sum(k.shape[0] * k.shape[1] * 4 for k in kernels)
  assert sum(k.nbytes for k in kernels) <= 0.57 * dense_bytes
  # FrozenDict params keep their type; under jit the per-layer choice cannot
  # be made (traced 'active' flags): a named error, documented.
  frozen = jsparse24.compress_params(flax.core.freeze(v["params"]), v["sparsity"])
  assert isinstance(frozen, flax.core.FrozenDict)
  with pytest.raises(TypeError, match="compress_params: the 'active' flags .* traced"):
    jax.jit(jsparse24.compress_params)(v["params"], v["sparsity"])


def test_a_compressed_layer_promotes_as_nn_dense_does():
  """A bfloat16 compressed kernel beside a float32 bias: the product runs in
  the dtype nn.Dense's promotion gives (the bias counts), and equals
  nn.Dense's on the masked kernel."""
  x = _rand(0, (3, 16)).astype(jnp.bfloat16)
  layer = jsparse24.SparseDense(8)
  v = layer.init(jax.random.key(0), x)
  params = {"kernel": v["params"]["kernel"].astype(jnp.bfloat16),
            "bias": _rand(1, (8,))}
  compressed = jsparse24.compress_params(params, v["sparsity"])
  y = layer.apply({"params": compressed}, x)
  masked = params["kernel"] * v["sparsity"]["mask"].unpack()
  want = nn.Dense(8).apply({"params": {**params, "kernel": masked}}, x)
  assert y.dtype == want.dtype == jnp.float32
  np.testing.assert_allclose(y, want, rtol=1e-2, atol=1e-2)


def test_compress_params_in_cusparselts_layout():
  """`cusparselt=True`: the kernels in cuSPARSELt's layout, the outputs of
  the portable ones exactly; a kernel that cannot take it raises naming
  the layer."""

  class Wide(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(64, name="down")(nn.relu(nn.Dense(192, name="up")(x)))

  patched = jsparse24.sparsify(Wide(), {".*": {"transposable": False}})
  x = _rand(0, (3, 128)).astype(jnp.bfloat16)
  v = patched.init(jax.random.key(0), x)
  params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), v["params"])
  portable = jsparse24.compress_params(params, v["sparsity"])
  laid_out = jsparse24.compress_params(params, v["sparsity"], cusparselt=True)
  assert all(laid_out[name]["kernel"].cusparselt for name in ("up", "down"))
  np.testing.assert_array_equal(
      np.asarray(patched.apply({"params": laid_out}, x), np.float32),
      np.asarray(patched.apply({"params": portable}, x), np.float32))
  with pytest.raises(ValueError, match=r"compress_params: layer '(up|down)': cusparselt=True needs"
                                       r" bfloat16 or float16 weights"):
    jsparse24.compress_params(v["params"], v["sparsity"], cusparselt=True)


def test_sparse_dense_works_under_jit_vmap_and_remat():
  """Against the formula, not against itself: y = x @ (kernel * mask) + bias,
  and the straight-through gradients (dkernel = x^T dy for every weight)."""
  x = _rand(0, (4, 3, 16))
  layer = jsparse24.SparseDense(8)
  v = layer.init(jax.random.key(1), x[0])
  v = {**v, "params": {"kernel": _rand(5, (16, 8)), "bias": _rand(6, (8,))}}
  mask = v["sparsity"]["mask"].unpack()
  want = x @ jnp.where(mask, v["params"]["kernel"], 0) + v["params"]["bias"]
  got = jax.jit(jax.vmap(lambda xi: layer.apply(v, xi)))(x)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  remat = nn.remat(jsparse24.SparseDense)(8)
  c = _rand(7, (4, 3, 8))
  g = jax.grad(lambda p: (remat.apply({**v, "params": p}, x) * c).sum())(v["params"])
  np.testing.assert_allclose(g["kernel"], jnp.einsum("btk,btn->kn", x, c), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(g["bias"], c.sum((0, 1)), rtol=1e-5, atol=1e-5)


def test_mask24_in_collection_is_packed():
  layer = jsparse24.SparseDense(64)
  v = layer.init(jax.random.key(1), jnp.ones((1, 128)))
  mask = v["sparsity"]["mask"]
  assert isinstance(mask, Mask24)
  assert mask.packed.dtype == jnp.uint8 and mask.packed.size * 8 <= 128 * 64


def test_compressed_params_compute_in_the_module_dtype():
  x = _rand(0, (3, 16))
  layer = jsparse24.SparseDense(8, dtype=jnp.bfloat16)
  v = layer.init(jax.random.key(1), x)
  compressed = jsparse24.compress_params(v["params"], v["sparsity"])
  y = layer.apply({"params": compressed}, x)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(layer.apply(v, x), np.float32))
