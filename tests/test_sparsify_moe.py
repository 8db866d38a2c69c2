"""`jsparse24.sparsify` on existing Flax MoE layers: experts written as
`nn.Dense` stacked with an `nn.vmap` that maps only `"params"` (as
flaxformer's MoE layer stacks them, by module class or by function) run
2:4 with masks per expert, and match the same MoE applied to masked
kernels (forward, gradients); masks are rebuilt and compressed per
expert; a MoE whose expert kernels are raw params in an einsum (as
maxtext writes them) raises at init, naming the layer and the fix.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jsparse24
from jsparse24 import optim

E, D, H = 4, 12, 20  # experts, model width, expert hidden width
G, S = 2, 6          # routing groups, tokens per group
TOL = dict(rtol=2e-5, atol=2e-5)
RULES = {r"moe/experts/(wi|wo)": {}}


class Expert(nn.Module):

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(H, use_bias=False, name="wi")(x))
    return nn.Dense(D, use_bias=False, name="wo")(h)


class MoE(nn.Module):
  """Top-2 routing, dispatch and combine (`jsparse24.moe`'s), experts under `nn.vmap` mapping
  `"params"` only; `by_function`: the vmap of a function taking the expert
  module (flaxformer's form), else of the expert class."""
  by_function: bool = False

  @nn.compact
  def __call__(self, x):
    probs = jax.nn.softmax(nn.Dense(E, use_bias=False, name="router")(x), axis=-1)
    routing = jsparse24.moe.route(probs, 2, S)
    expert_in = jsparse24.moe.dispatch(x, routing).reshape(E, -1, D)
    if self.by_function:
      run = nn.vmap(lambda expert, y: expert(y), variable_axes={"params": 0},
                    split_rngs={"params": True}, in_axes=0, out_axes=0)
      out = run(Expert(name="experts"), expert_in)
    else:
      stack = nn.vmap(Expert, variable_axes={"params": 0}, split_rngs={"params": True},
                      in_axes=0, out_axes=0)
      out = stack(name="experts")(expert_in)
    return jsparse24.moe.combine(out.reshape(E, G, S, D), routing)


class Model(nn.Module):
  by_function: bool = False

  @nn.compact
  def __call__(self, x):
    return x + MoE(self.by_function, name="moe")(x)


def _x(seed):
  return jax.random.normal(jax.random.key(seed), (G, S, D))


def _masks(sparsity):
  return {name: np.asarray(layer["mask"].unpack())
          for name, layer in sparsity["moe"]["experts"].items()}


def _masked(params, masks):
  """params with each expert kernel times its expert's mask."""
  out = jax.tree.map(lambda a: a, params)
  for name, mask in masks.items():
    out["moe"]["experts"][name]["kernel"] = params["moe"]["experts"][name]["kernel"] * mask
  return out


@pytest.mark.parametrize("by_function", [False, True])
@pytest.mark.parametrize("gradient", ["ste", "masked"])
def test_vmapped_dense_experts_match_the_moe_on_masked_kernels(by_function, gradient):
  model = Model(by_function)
  sparse = jsparse24.sparsify(model, {r"moe/experts/(wi|wo)": {"gradient": gradient}})
  x = _x(0)
  v = sparse.init(jax.random.key(1), x)
  assert jax.tree.map(jnp.shape, v["params"]) == jax.tree.map(
      jnp.shape, model.init(jax.random.key(1), x)["params"])
  masks = _masks(v["sparsity"])
  for name in ("wi", "wo"):
    kernel = v["params"]["moe"]["experts"][name]["kernel"]
    assert masks[name].shape == kernel.shape
    assert v["sparsity"]["moe"]["experts"][name]["active"].shape == (E,)
    for e in range(E):
      np.testing.assert_array_equal(masks[name][e],
                                    jsparse24.prune_24(kernel[e], transposable=True))
    assert not np.array_equal(masks[name][0], masks[name][1]), name

  masked = _masked(v["params"], masks)
  y = jax.jit(sparse.apply)(v, x)
  np.testing.assert_allclose(y, model.apply({"params": masked}, x), **TOL)

  cot = _x(2)
  got = jax.grad(lambda p: jnp.sum(sparse.apply({**v, "params": p}, x) * cot))(v["params"])
  want = jax.grad(lambda p: jnp.sum(model.apply({"params": p}, x) * cot))(masked)
  if gradient == "masked":
    want = _masked(want, masks)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got, want)


def test_mask_update_rebuild_and_compress_work_per_expert():
  model = Model()
  sparse = jsparse24.sparsify(model, RULES)
  x = _x(3)
  v = sparse.init(jax.random.key(4), x)
  params = v["params"]
  tx = optax.chain(optim.mask_update(v["sparsity"], optim.MaskSchedule(rebuild_every=1)),
                   optax.sgd(0.1))
  state = tx.init(params)
  moved = jax.tree.map(lambda a: a, params)
  for i, name in enumerate(("wi", "wo")):
    shape = params["moe"]["experts"][name]["kernel"].shape
    moved["moe"]["experts"][name]["kernel"] = jax.random.normal(jax.random.key(20 + i), shape)
  _, state = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), state, moved)
  updated = optim.masks(state)
  rebuilt = jsparse24.rebuild_masks(moved, v["sparsity"])
  new = _masks(updated)
  jax.tree.map(np.testing.assert_array_equal, _masks(rebuilt), new)
  for name in ("wi", "wo"):
    for e in range(E):
      np.testing.assert_array_equal(
          new[name][e], jsparse24.prune_24(moved["moe"]["experts"][name]["kernel"][e],
                                           transposable=True))
  # The stored masks, not the current kernels' magnitudes, decide: the old
  # masks on the moved kernels, then the rebuilt ones.
  np.testing.assert_allclose(
      sparse.apply({"params": moved, "sparsity": v["sparsity"]}, x),
      model.apply({"params": _masked(moved, _masks(v["sparsity"]))}, x), **TOL)
  y = sparse.apply({"params": moved, "sparsity": updated}, x)
  np.testing.assert_allclose(y, model.apply({"params": _masked(moved, new)}, x), **TOL)

  compressed = jsparse24.compress_params(moved, updated)
  assert isinstance(compressed["moe"]["experts"]["wi"]["kernel"], jsparse24.Sparse24)
  np.testing.assert_allclose(sparse.apply({"params": compressed}, x), y, **TOL)


class RawParamMoE(nn.Module):
  """Expert kernels as `[E, K, N]` params multiplied in einsums."""

  @nn.compact
  def __call__(self, x):
    wi = self.param("wi", nn.initializers.lecun_normal(), (E, D, H))
    wo = self.param("wo", nn.initializers.lecun_normal(), (E, H, D))
    return jnp.einsum("gsh,ehd->gsd", nn.gelu(jnp.einsum("gsd,edh->gsh", x, wi)), wo)


class RawModel(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(D, name="proj")(RawParamMoE(name="moe")(x))


@pytest.mark.parametrize("rule", [r"moe/(wi|wo)", r"moe"])
def test_raw_param_experts_raise_naming_the_layer_and_the_fix(rule):
  sparse = jsparse24.sparsify(RawModel(), {rule: {}})
  with pytest.raises(ValueError, match=r"(?s)sparsify: rule .* the parameter 'moe/wi'"
                     r" \(float32\[4, 12, 20\]\) of module 'moe' \(RawParamMoE\).*nn\.Dense"
                     r" layers stacked with nn\.vmap.*jsparse24\.SparseMoE"):
    sparse.init(jax.random.key(0), _x(0))


def test_masks_of_another_number_of_experts_are_named():
  """The experts' masks stacked for 2 experts under a vmap of 4 (a checkpoint
  of another model, a pytree map that sliced them): an error naming the
  layer and both counts, not XLA's buffer-size error from inside the
  product."""
  model = jsparse24.sparsify(Model(), RULES)
  v = model.init(jax.random.key(1), _x(0))
  cut = jax.tree.map(lambda a: a[:2], v["sparsity"])
  with pytest.raises(ValueError, match=r"nn.Dense 'moe/experts/wi' .* its mask in the 'sparsity'"
                                       r" collection is a stack of 2, but the vmap around the"
                                       r" layer maps 4 elements"):
    model.apply({"params": v["params"], "sparsity": cut}, _x(0))
