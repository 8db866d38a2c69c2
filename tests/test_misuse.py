"""Misuse that used to run on silently, or fail far from its cause, gets an
error naming the function, the argument and the fix, or cannot be written
(issue 39): the mask transform chained after the optimizer, a wrong second
argument to the mask-tree helpers, the whole variables where the params (or
their gradients) go, a model patched by `sparsify` applied with
rules that match nothing or without its masks, a `"sparsity"` collection
holding something else than masks, and a layer whose width cannot be 2:4."""

import contextlib
import re
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jsparse24
from jsparse24 import nnx as jnnx
from jsparse24 import optim

X = jnp.ones((2, 16))
PLAIN = {"transposable": False}  # sparsify's options: compiles faster than the search
PLAIN_RULES = {".*": PLAIN}


class _Net(nn.Module):
  """One SparseDense named "up" (errors name it); plain masks unless told,
  which compile faster than the transposable search."""

  features: int = 8
  transposable: bool | None = False

  @nn.compact
  def __call__(self, x):
    return jsparse24.SparseDense(self.features, transposable=self.transposable, name="up")(x)


class _Mlp(nn.Module):
  """Two nn.Dense layers, and a method that runs only the first."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(8, name="down")(self.encode(x))

  @nn.compact
  def encode(self, x):
    return nn.relu(nn.Dense(16, name="up")(x))


def _variables():
  return _Net().init(jax.random.key(1), X)


# --- the mask transform and the optimizer ------------------------------------


def test_with_masks_chains_the_mask_transform_before_the_optimizer():
  """The decay of the pruned weights enters as a gradient, so the optimizer
  scales it: with zero gradients and SGD at rate 0.5 each pruned weight moves
  by -0.5 * decay * w. Chained after the optimizer it would move by
  +decay * w (the wrong sign, no rate)."""
  v = _variables()
  tx = optim.with_masks(optax.sgd(0.5), v["sparsity"], decay=0.1)
  state = tx.init(v["params"])
  assert isinstance(state[0], optim.MaskUpdateState)
  grads = jax.tree.map(jnp.zeros_like, v["params"])
  updates, _ = jax.jit(tx.update)(grads, state, v["params"])
  w = v["params"]["up"]["kernel"]
  pruned = ~optim.masks(state)["up"]["mask"].unpack()
  np.testing.assert_allclose(updates["up"]["kernel"], jnp.where(pruned, -0.5 * 0.1 * w, 0.0),
                             rtol=1e-6)


def test_with_masks_refuses_its_arguments_swapped():
  v = _variables()
  with pytest.raises(TypeError, match=r"with_masks: `optimizer` must be an optax transform"
                     r".*'sparsity' collection comes second"):
    optim.with_masks(v["sparsity"], optax.sgd(0.1))
  # MultiSteps is no transform: the fix is to wrap with_masks, not to swap arguments.
  with pytest.raises(TypeError, match=r"with_masks: `optimizer` is an optax.MultiSteps.*"
                     r"optax.MultiSteps\(jsparse24.optim.with_masks\("):
    optim.with_masks(optax.MultiSteps(optax.sgd(0.1), 2), v["sparsity"])


def _chains(sparsity):
  mu = lambda: optim.mask_update(sparsity)  # noqa: E731
  after = {
      "chain(adam, mask_update)": optax.chain(optax.adam(1e-3), mu()),
      "MultiSteps(chain(adam, mask_update))": optax.MultiSteps(
          optax.chain(optax.adam(1e-3), mu()), 2),
      "chain(inject_hyperparams(adam), mask_update)": optax.chain(
          optax.inject_hyperparams(optax.adam)(1e-3), mu()),
      # The decay then grew the pruned weights 1.1x a step at decay=0.1.
      "named_chain(adam, mask_update)": optax.named_chain(("opt", optax.adam(1e-3)),
                                                          ("mask", mu())),
      "chain(adam, mask_update, identity)": optax.chain(optax.adam(1e-3), mu(),
                                                        optax.identity()),
      "chain(chain(adam, mask_update), clip)": optax.chain(
          optax.chain(optax.adam(1e-3), mu()), optax.clip(1.0)),
      "chain(scale_by_adam, mask_update, scale)": optax.chain(
          optax.scale_by_adam(), mu(), optax.scale(-1e-3)),
      "chain(sgd with momentum, mask_update, clip)": optax.chain(
          optax.sgd(0.1, momentum=0.9), mu(), optax.clip(1.0)),
  }
  first = {
      "with_masks(adam)": optim.with_masks(optax.adam(1e-3), sparsity),
      "chain(mask_update, adam)": optax.chain(mu(), optax.adam(1e-3)),
      "chain(clip, mask_update, adam)": optax.chain(optax.clip(1.0), mu(), optax.adam(1e-3)),
      "chain(chain(clip, mask_update), adam)": optax.chain(optax.chain(optax.clip(1.0), mu()),
                                                           optax.adam(1e-3)),
      "MultiSteps(with_masks(adam))": optax.MultiSteps(optim.with_masks(optax.adam(1e-3),
                                                                        sparsity), 2),
      "mask_update alone": mu(),
      "named_chain(clip, mask_update, adam)": optax.named_chain(
          ("clip", optax.clip(1.0)), ("mask", mu()), ("opt", optax.adam(1e-3))),
      "chain(zero_nans, mask_update, adam)": optax.chain(optax.zero_nans(), mu(),
                                                         optax.adam(1e-3)),
      # The groups of multi_transform are no chain: the last group is not "after".
      "multi_transform(adam, with_masks(adam))": optax.multi_transform(
          {"a": optax.adam(1e-3), "z": optim.with_masks(optax.adam(1e-3), sparsity)},
          lambda params: jax.tree.map(lambda _: "z", params)),
  }
  return after, first


@pytest.mark.parametrize("fn", ["masks", "stats", "masks_like_kernels"])
def test_a_mask_transform_chained_after_the_optimizer_is_refused(fn):
  v = _variables()
  after, first = _chains(v["sparsity"])
  call = {"masks": optim.masks, "stats": optim.stats,
          "masks_like_kernels": lambda s: optim.masks_like_kernels(s, v["params"])}[fn]
  for name, tx in after.items():
    with pytest.raises(ValueError, match=rf"{fn}: the jsparse24.optim.mask_update transform is"
                       r" chained after the optimizer.*jsparse24.optim.with_masks\(optimizer"):
      call(tx.init(v["params"]))
      pytest.fail(f"{name} was accepted")
  for name, tx in first.items():
    call(tx.init(v["params"]))  # accepted: the transform sees (clipped) gradients


def test_the_misordered_chain_is_refused_inside_jit_too():
  v = _variables()
  tx = optax.chain(optax.sgd(0.1), optim.mask_update(v["sparsity"]))
  with pytest.raises(ValueError, match=r"masks: the jsparse24.optim.mask_update transform is"
                     r" chained after"):
    jax.jit(optim.masks)(tx.init(v["params"]))


def test_mask_update_given_the_whole_variables_names_the_collection():
  v = _variables()
  with pytest.raises(ValueError, match=r"mask_update: `sparsity` is the whole variables \(it"
                     r" holds 'params' and 'sparsity'\); pass variables\['sparsity'\]"):
    optim.mask_update(v)  # was: a tree mismatch at `init`, no fix
  with pytest.raises(ValueError, match=r"with_masks: `sparsity` is the whole variables"):
    optim.with_masks(optax.sgd(0.1), v)


# --- the mask-tree helpers' `sparsity` argument ------------------------------


def _helpers():
  return {
      "compress_params": lambda p, s: jsparse24.compress_params(p, s),
      "rebuild_masks": lambda p, s: jsparse24.rebuild_masks(p, s),
      "masks_like_kernels": lambda p, s: jsparse24.masks_like_kernels(s, p),
  }


@pytest.mark.parametrize("fn", list(_helpers()))
def test_an_empty_sparsity_collection_is_refused(fn):
  """`compress_params(params, {})` returned the dense params unchanged."""
  v = _variables()
  with pytest.raises(ValueError, match=rf"{fn}: `sparsity` is empty, so there is no sparse"
                     r" layer to work on; pass the model's 'sparsity' collection:"
                     r" variables\['sparsity'\] from `init`, or"
                     r" jsparse24.optim.masks\(opt_state\)"):
    _helpers()[fn](v["params"], {})


@pytest.mark.parametrize("fn", list(_helpers()))
def test_a_sparsity_argument_of_the_wrong_kind_says_what_to_pass(fn):
  v = _variables()
  call = _helpers()[fn]
  with pytest.raises(TypeError, match=rf"{fn}: `sparsity` must be a dict, got None;.*"
                     r"variables\['sparsity'\]"):  # was AttributeError: ... 'get'
    call(v["params"], None)
  opt_state = optim.with_masks(optax.adam(1e-3), v["sparsity"]).init(v["params"])
  with pytest.raises(TypeError, match=rf"{fn}: `sparsity` is an optimizer state; pass"
                     r" jsparse24.optim.masks\(opt_state\)"):  # was AttributeError
    call(v["params"], opt_state)
  with pytest.raises(ValueError, match=rf"{fn}: `sparsity` is the whole variables.*pass"
                     r" variables\['sparsity'\]"):
    call(v["params"], v)
  with pytest.raises(ValueError, match=rf"{fn}: `sparsity` holds no Mask24 \(keys \['up'\]\).*"
                     r"the params come first"):
    call(v["params"], v["params"])


# --- the `params` argument: the whole variables, or another model's ---------


def _params_takers():
  """Each public function that reads a model's params beside its 'sparsity'
  collection, called as `call(variables, params)`."""
  def init(v, p):
    return optim.with_masks(optax.sgd(0.1), v["sparsity"]).init(p)

  def update(v, p):
    tx = optim.with_masks(optax.sgd(0.1), v["sparsity"])
    return tx.update(jax.tree.map(jnp.zeros_like, v["params"]), tx.init(v["params"]), p)

  def opt_masks_like_kernels(v, p):
    state = optim.with_masks(optax.sgd(0.1), v["sparsity"]).init(v["params"])
    return optim.masks_like_kernels(state, p)

  return {
      "compress_params": lambda v, p: jsparse24.compress_params(p, v["sparsity"]),
      "rebuild_masks": lambda v, p: jsparse24.rebuild_masks(p, v["sparsity"]),
      "masks_like_kernels": lambda v, p: jsparse24.masks_like_kernels(v["sparsity"], p),
      "mask_update (init)": init,
      "mask_update (update)": update,
      "optim.masks_like_kernels": opt_masks_like_kernels,
  }


@pytest.mark.parametrize("call", list(_params_takers()))
def test_the_whole_variables_in_place_of_the_params_are_named(call):
  """Was: a tree mismatch that named no function (`the 'sparsity' tree has a
  layer at 'up' that the matching tree (params) does not have`), or
  `compress_params`'s "no kernel in params", with no word of the
  variables."""
  v = _variables()
  fn = call.split(" ")[0].split(".")[-1]
  for wrong in (v, {"params": v["params"]}):
    with pytest.raises(ValueError, match=rf"{fn}: `params` is the whole variables \(it holds"
                       rf" {re.escape(str(sorted(wrong)))}\), not the 'params' collection;"
                       r" pass variables\['params'\]"):
      _params_takers()[call](v, wrong)


def test_gradients_of_the_whole_variables_are_named():
  v = _variables()
  tx = optim.with_masks(optax.sgd(0.1), v["sparsity"])
  grads = jax.tree.map(jnp.zeros_like, v)  # jax.grad over the variables, not the params
  with pytest.raises(ValueError, match=r"mask_update: the gradients are of the whole variables"
                     r" \(they hold \['params', 'sparsity'\]\); pass the gradients of"
                     r" variables\['params'\] alone"):  # was: "differ in structure"
    tx.update(grads, tx.init(v["params"]), v["params"])


class _Owner(nn.Module):
  """A model with a submodule named "params": its params hold a 'params'
  entry that is a layer, not a collection."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8, name="params")(x)
    return _Net(name="net")(x)


def test_params_of_another_model_name_the_function_and_the_layer():
  v = _variables()
  other = {"down": v["params"]["up"]}  # the layer under another name
  with pytest.raises(ValueError, match=r"rebuild_masks: the 'sparsity' collection has a layer"
                     r" at 'up' that `params` does not have: pass the params of the model"):
    jsparse24.rebuild_masks(other, v["sparsity"])
  # A submodule named "params" is a layer, not the variables: accepted.
  owner = _Owner().init(jax.random.key(2), X)
  rebuilt = jsparse24.rebuild_masks(owner["params"], owner["sparsity"])
  assert sorted(rebuilt) == ["net"]
  jsparse24.compress_params(owner["params"], owner["sparsity"])
  # The same layer of a wider model: named by compress_params and the layer
  # (was compress's error on its `mask` argument).
  wider = _Net(features=12).init(jax.random.key(3), X)
  with pytest.raises(ValueError, match=r"compress_params: the mask of layer 'up' is for a kernel"
                     r" of shape \(16, 12\), and its kernel in `params` has shape \(16, 8\)"):
    jsparse24.compress_params(v["params"], wider["sparsity"])


@pytest.mark.parametrize("fn,verb", [("rebuild_masks", "rebuild"),
                                     ("masks_like_kernels", "lay out"),
                                     ("compress_params", "compress")])
def test_the_nnx_helpers_refuse_a_model_without_a_stored_mask(fn, verb):
  """`nnx.rebuild_masks` and `nnx.masks_like_kernels` returned in silence on
  a model of nnx.Linear layers (a model whose layers were never swapped),
  where the Linen helpers refuse an empty 'sparsity' collection."""
  call = getattr(jnnx, fn)
  models = {"nnx.Linear": nnx.Linear(8, 8, rngs=nnx.Rngs(0)),
            "dynamic": jnnx.SparseLinear(8, 8, mask_source="dynamic", rngs=nnx.Rngs(0))}
  for name, model in models.items():
    with pytest.raises(ValueError, match=rf"^nnx.{fn}: `model` has no SparseLinear with a stored"
                       rf" mask \(mask_source='collection'\), so there is nothing to {verb};"):
      call(model)
      pytest.fail(f"{name} was accepted")
  call(jnnx.SparseLinear(8, 8, rngs=nnx.Rngs(0)))  # one stored mask is enough


def test_compress_params_with_the_masks_of_the_optimizer_state_still_works():
  v = _variables()
  opt_state = optim.with_masks(optax.adam(1e-3), v["sparsity"]).init(v["params"])
  out = jsparse24.compress_params(v["params"], optim.masks(opt_state))
  assert isinstance(out["up"]["kernel"], jsparse24.Sparse24)


# --- sparsify ------------------------------------------------------------------


def test_sparsify_rules_that_match_nothing_are_refused_in_apply_and_init_with_output():
  """`apply` ran the model dense without a word when no rule matched (no
  `init` of the patched model, whose check would have caught it)."""
  x = jnp.ones((2, 8))
  dense = _Mlp().init(jax.random.key(0), x)
  sparse = jsparse24.sparsify(_Mlp(), {"upp": PLAIN})
  match = (r"sparsify: rule\(s\) \['upp'\] matched no nn.Dense layer in `{}`; the model's"
           r" layers are \['down', 'up'\]")
  with pytest.raises(ValueError, match=match.format("apply")):
    sparse.apply(dense, x)
  with pytest.raises(ValueError, match=match.format("init_with_output")):
    sparse.init_with_output(jax.random.key(0), x)


def test_sparsify_names_a_model_that_is_one_dense_layer_in_its_no_match_error():
  """The layer list read `['']` where the model is one nn.Dense."""
  with pytest.raises(ValueError, match=r"the model's layers are \[\'\' \(the model itself\)\]"):
    jsparse24.sparsify(nn.Dense(8), {"up": PLAIN}).init(jax.random.key(0), jnp.ones((2, 8)))


def test_sparsify_apply_of_one_method_accepts_rules_for_layers_it_does_not_run():
  """A rule is checked against the variables' layers too, so `apply(...,
  method=...)` running part of the model is not refused."""
  x = jnp.ones((2, 8))
  sparse = jsparse24.sparsify(_Mlp(), {"down": PLAIN})
  v = sparse.init(jax.random.key(0), x)
  assert sparse.apply(v, x, method=_Mlp.encode).shape == (2, 16)
  # With the params only (no masks: "down" does not run), the params name it.
  assert sparse.apply({"params": v["params"]}, x, method=_Mlp.encode).shape == (2, 16)


def test_sparsify_apply_without_the_masks_names_apply_the_collection_and_init():
  x = jnp.ones((2, 8))
  dense = _Mlp().init(jax.random.key(0), x)
  sparse = jsparse24.sparsify(_Mlp(), {"up": PLAIN})
  with pytest.raises(ValueError, match=r"^nn.Dense 'up' \(patched by jsparse24.sparsify\) takes"
                     r" its 2:4 mask from the 'sparsity'"
                     r" collection, but no 'sparsity' collection was passed to `apply`.*"
                     r"from the patched model's `init`"):
    sparse.apply(dense, x)


def test_a_top_level_layer_without_its_masks_is_named_by_its_type():
  """A SparseDense that is the whole model has an empty path: the error names
  the layer by its type, not as "layer ''"."""
  layer = jsparse24.SparseDense(8)
  v = layer.init(jax.random.key(0), X)
  with pytest.raises(ValueError, match=r"^SparseDense takes its 2:4 mask from the 'sparsity'"
                     r" collection, but no 'sparsity' collection was passed to `apply`"):
    layer.apply({"params": v["params"]}, X)


# --- what the "sparsity" collection holds ----------------------------------


def _apply_with(sparsity):
  v = _variables()
  return _Net().apply({"params": v["params"], "sparsity": sparsity}, X)


def test_an_array_in_place_of_a_layers_masks_is_named():
  """A numpy array at the layer's path was reported as no collection passed."""
  v = _variables()
  bool_mask = np.asarray(v["sparsity"]["up"]["mask"].unpack())
  with pytest.raises(ValueError, match=r"^SparseDense 'up' takes its 2:4 mask from the 'sparsity'"
                     r" collection, but the 'sparsity' collection passed to `apply` holds a"
                     r" numpy.ndarray bool\[16, 8\] at its path, where a dict \{'mask':"
                     r" jsparse24.Mask24, 'active': ...\} belongs"):
    _apply_with({"up": bool_mask})


PACK = r"jsparse24.Mask24.pack\(mask, transposable=...\)"


@pytest.mark.parametrize("mask,found,fix", [
    (lambda m: np.asarray(m.unpack()), r"a numpy.ndarray bool\[16, 8\]", PACK),
    (lambda m: np.asarray(m.packed), r"a numpy.ndarray uint8\[8, 2\]", PACK),
    # As Orbax restores a Mask24 without a template: shape and flag lost.
    (lambda m: {"packed": m.packed}, r"a dict with keys \['packed'\]",
     r"restored from a checkpoint without a template"),
])
def test_a_mask_that_is_not_a_mask24_is_named_with_the_conversion(mask, found, fix):
  """Was AttributeError: ... has no attribute 'transposable'."""
  v = _variables()
  layer = {"mask": mask(v["sparsity"]["up"]["mask"]), "active": np.array(True)}
  with pytest.raises(TypeError, match=r"SparseDense 'up': the 'mask' in the 'sparsity'"
                     rf" collection passed to `apply` is {found}; expected a jsparse24.Mask24.*"
                     + fix):
    _apply_with({"up": layer})


def test_a_sparsity_collection_without_the_layer_or_with_everything_is_named():
  v = _variables()
  with pytest.raises(ValueError, match=r"SparseDense 'up' .*has no entry for it \(at its top level:"
                     r" \['down'\]\)"):
    _apply_with({"down": v["sparsity"]["up"]})
  with pytest.raises(ValueError, match=r"SparseDense 'up' .*is the whole variables \(it holds 'params'"
                     r" and 'sparsity'\): pass variables\['sparsity'\] there"):
    _apply_with(v)


class _Scanned(nn.Module):
  """Two `_Net` layers under `nn.scan`, whose body sees only its own part of
  the variables."""

  @nn.compact
  def __call__(self, x):
    body = lambda net, x, _: (net(x), None)  # noqa: E731
    return nn.scan(body, variable_axes={"params": 0, "sparsity": 0},
                   split_rngs={"params": True}, length=2)(_Net(features=16, name="blocks"), x,
                                                          None)[0]


def test_the_sparsity_collection_is_described_from_inside_nn_scan():
  """An array at a scanned layer's path crashed in `jax.Array.__contains__`
  (Flax's `has_variable`); inside the scan the variables start at
  "blocks", which the message says instead of "no collection"."""
  v = _Scanned().init(jax.random.key(0), X)

  def apply(sparsity):
    return _Scanned().apply({"params": v["params"], "sparsity": sparsity}, X)

  with pytest.raises(ValueError, match=r"SparseDense 'blocks/up' .*holds a jax.Array bool\[16, 16\] at"
                     r" its path"):
    apply({"blocks": {"up": np.ones((2, 16, 16), bool)}})
  with pytest.raises(ValueError, match=r"SparseDense 'blocks/up' .*has no entry for it \(at 'blocks':"
                     r" \['down'\]\)"):
    apply({"blocks": {"down": v["sparsity"]["blocks"]["up"]}})
  with pytest.raises(ValueError, match=r"SparseDense 'blocks/up' .*has nothing under 'blocks'"):
    apply({})


# --- widths that cannot be 2:4 ----------------------------------------------


def test_an_input_width_not_a_multiple_of_4_names_the_layer_and_the_fix():
  """It blamed `prune_24` and spoke of transposable masks."""
  x = jnp.ones((2, 6))
  with pytest.raises(ValueError, match=r"^SparseDense 'up': the input width 6 is not a"
                     r" multiple of 4;.*Pad the inputs' last axis to 8, or make this layer an"
                     r" nn.Dense\."):
    _Net().init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"^nn.Dense 'up' \(patched by jsparse24.sparsify\): the"
                     r" input width 6 .*Pad the inputs' last axis to 8, or leave this layer"
                     r" dense: give jsparse24.sparsify rules that do not match 'up'\."):
    jsparse24.sparsify(_Mlp(), {"up": PLAIN}).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"^SparseDense 'up': the input width 6"):
    _Net(transposable=None).init(jax.random.key(0), x)


def test_transposable_with_an_output_width_not_a_multiple_of_4_names_the_layer():
  with pytest.raises(ValueError, match=r"^SparseDense 'up': the output width \(features=6\) is"
                     r" not a multiple of 4, which a transposable mask .*Set transposable=None"):
    _Net(features=6, transposable=True).init(jax.random.key(0), X)
  # transposable=None makes a plain mask there: no error.
  v = _Net(features=6, transposable=None).init(jax.random.key(0), X)
  assert not v["sparsity"]["up"]["mask"].transposable


def test_nnx_widths_not_a_multiple_of_4_say_the_fix():
  with pytest.raises(ValueError, match=r"SparseLinear: in_features=6 .*Pad the inputs' last axis"
                     r" to 8, or make this layer an nnx.Linear"):
    jnnx.SparseLinear(6, 8, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"SparseLinear: out_features=6 .*Set transposable=None"):
    jnnx.SparseLinear(8, 6, transposable=True, rngs=nnx.Rngs(0))


_MLP_PARAMS = {"mlp": {"up": {"kernel": jnp.ones((8, 16)), "bias": jnp.ones(16)},
                       "down": {"kernel": jnp.ones((16, 8))}}}


def test_a_tensor_parallel_rule_that_matches_no_kernel_is_named():
  """Was silent: every array replicated, no tensor parallelism (a rule that
  names the kernel itself matches no layer path)."""
  mesh = jsparse24.layouts.make_mesh("tp")
  bad = jsparse24.layouts.Layout("tp", mesh, {r".*/up/kernel": "column", r"down": "row"})
  with pytest.raises(ValueError, match=r"Layout.state_shardings: tensor_parallel rule\(s\)"
                                       r" \['\.\*/up/kernel'\] match no kernel .* layers:"
                                       r" \['mlp/down', 'mlp/up'\]"):
    bad.state_shardings(_MLP_PARAMS)
  good = jsparse24.layouts.Layout("tp", mesh, {r"up": "column", r"down": "row"})
  specs = jax.tree.map(lambda s: s.spec, good.state_shardings(_MLP_PARAMS))
  assert specs["mlp"]["up"]["kernel"] == P(None, "model")
  assert specs["mlp"]["down"]["kernel"] == P("model", None)
  # A rule fully matches a layer's path or a tail of it: "up" is not "up_proj".
  wider = {"mlp": {**_MLP_PARAMS["mlp"], "up_proj": {"kernel": jnp.ones((8, 16))}}}
  assert good.state_shardings(wider)["mlp"]["up_proj"]["kernel"].spec == P()
  # A tree without kernels (an optimizer's empty state) has nothing to match.
  assert good.state_shardings({"count": jnp.zeros(())})["count"].spec == P()


@pytest.mark.parametrize("rules,error,match", [
    (["up", "column"], TypeError, r"Layout: tensor_parallel must be a \{layer path regex: role\}"
                                  r" mapping or \(regex, role\) pairs, got the entry 'up'"),
    ({"up[": "column"}, ValueError, r"Layout: tensor_parallel rule 'up\[' is not a valid regex"),
])
def test_tensor_parallel_rules_of_the_wrong_form_are_named(rules, error, match):
  """Were "rule 'u' has role 'p'" and a bare re.error at the first use."""
  with pytest.raises(error, match=match):
    jsparse24.layouts.Layout("tp", jsparse24.layouts.make_mesh("tp"), rules)


@pytest.mark.parametrize("layout", ["fsdp", "2d"])
def test_fsdp_lays_out_a_train_state_with_a_python_step(layout):
  """Was AttributeError: 'int' object has no attribute 'ndim' (a flax
  TrainState's step is a Python int); it stays whole."""
  from flax.training import train_state
  state = train_state.TrainState.create(apply_fn=None, params=_MLP_PARAMS, tx=optax.adam(1e-3))
  place = jsparse24.layouts.Layout(layout, jsparse24.layouts.make_mesh(layout),
                                   {r"up": "column", r"down": "row"})
  shardings = place.state_shardings(state)
  assert shardings.step.spec == P()
  assert shardings.params["mlp"]["up"]["bias"].spec == P("data")


def test_constrain_names_sparse_layers_that_params_lacks():
  """Was silent under FSDP: the 2:4 kernels gathered whole instead of left
  sharded. A stack's layers as `optim.sparse_layers` names them
  ("mlp/up[0]") are its stacked kernel."""
  place = jsparse24.layouts.Layout("fsdp", jsparse24.layouts.make_mesh("fsdp"))
  for names, params in (({"mlp/up/kernel"}, _MLP_PARAMS), ({"mlp/up"}, {"params": _MLP_PARAMS})):
    with pytest.raises(ValueError, match=r"Layout.constrain: sparse_layers names \['mlp/up"):
      jax.jit(lambda p, names=names: place.constrain(p, names))(params)
  def constraints(names):
    hlo = jax.jit(lambda p: place.constrain(p, names)).lower(_MLP_PARAMS).as_text()
    return hlo.count("sdy.sharding_constraint") + hlo.count("@Sharding")  # Shardy, GSPMD

  assert constraints(set()) == 3  # every array gathered whole
  assert constraints({"mlp/up[0]"}) == 2  # up's kernel left sharded


def test_mask_update_names_a_state_or_params_of_something_else():
  """Were AttributeError: 'ScaleByAdamState' object has no attribute 'masks'
  (another optimizer's state), and a broadcasting error inside XLA (params
  of a model of another width)."""
  x = jnp.ones((2, 16))
  v = _Net(8).init(jax.random.key(0), x)
  wider = _Net(12).init(jax.random.key(0), x)["params"]
  tx = optim.with_masks(optax.adam(1e-3), v["sparsity"])
  state = tx.init(v["params"])
  grads = jax.tree.map(jnp.ones_like, v["params"])
  tx.update(grads, state, v["params"])  # the right ones
  with pytest.raises(TypeError, match=r"mask_update: `state` is a ScaleByAdamState, not this"
                                      r" transform's MaskUpdateState"):
    tx.update(grads, optax.adam(1e-3).init(v["params"]), v["params"])
  with pytest.raises(ValueError, match=r"mask_update: the kernel of layer 'up' has shape"
                                       r" \(16, 12\), and its mask in the state is for \(16, 8\)"):
    tx.update(jax.tree.map(jnp.ones_like, wider), state, wider)


def test_with_masks_takes_a_collection_whose_active_flag_is_a_python_bool():
  """The layers take `"active": False`; the mask transform failed on it
  (AttributeError: 'bool' object has no attribute 'shape')."""
  v = _Net(8).init(jax.random.key(0), X)
  sparsity = {"up": {**v["sparsity"]["up"], "active": False}}
  tx = optim.with_masks(optax.adam(1e-3), sparsity, optim.MaskSchedule(warmup_steps=2))
  state = tx.init(v["params"])
  _, state = tx.update(jax.tree.map(jnp.ones_like, v["params"]), state, v["params"])
  assert not bool(optim.masks(state)["up"]["active"])  # step 1 of a 2-step warm-up


def test_gradients_and_params_in_containers_of_other_types_are_named():
  """Was "the gradients and the params differ in structure (missing from the
  gradients: []; not in the params: [])": nothing missing, no hint."""
  import flax
  v = _Net(8).init(jax.random.key(0), X)
  frozen = flax.core.freeze(v["params"])
  tx = optim.with_masks(optax.adam(1e-3), v["sparsity"])
  with pytest.raises(ValueError, match=r"mask_update: the gradients and the params hold the same"
                                       r" leaves in containers of other types \(gradients: dict,"
                                       r" params: FrozenDict"):
    tx.update(jax.tree.map(jnp.ones_like, v["params"]), tx.init(frozen), frozen)


def test_zero_or_fractional_sizes_are_named():
  """Were silent (make_mesh's model_devices=0 took every device) or failed
  inside JAX (a width of 0: ZeroDivisionError in the initializer; 32.0:
  "Shapes must be 1D sequences of concrete values of integer type")."""
  with pytest.raises(ValueError, match=r"make_mesh: model_devices=0 must divide the 8 devices"):
    jsparse24.layouts.make_mesh("tp", model_devices=0)
  x = jnp.ones((1, 4, 8))
  for hidden in (0, 32.0):
    with pytest.raises(ValueError, match=r"SparseMoE: hidden must be an int >= 1"):
      jsparse24.SparseMoE(num_experts=4, hidden=hidden).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"nnx.SparseMoE: hidden must be an int >= 1"):
      jnnx.SparseMoE(8, num_experts=4, hidden=hidden, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"SparseMoE: num_experts must be an int >= 1, got float"):
    jsparse24.SparseMoE(num_experts=4.0, hidden=16).init(jax.random.key(0), x)
  with pytest.raises(TypeError, match=r"SparseMoE: activation must be a function"):
    jsparse24.SparseMoE(num_experts=4, hidden=16, activation="gelu").init(jax.random.key(0), x)
  with pytest.raises(TypeError, match=r"nnx.SparseMoE: activation must be a function"):
    jnnx.SparseMoE(8, num_experts=4, hidden=16, activation="gelu", rngs=nnx.Rngs(0))


def test_meshes_of_no_device_or_a_device_twice_and_kernels_a_mesh_cannot_split_are_named():
  """make_mesh took no devices (a modulo by zero at the first sharding) and
  a device listed twice (a bare AssertionError in device_put); a kernel that
  the tensor-parallel split does not divide failed with JAX's
  IndivisibleError at device_put, naming neither the layer nor the rule."""
  layouts = jsparse24.layouts
  with pytest.raises(ValueError, match=r"make_mesh: `devices` is empty"):
    layouts.make_mesh("fsdp", [d for d in jax.devices() if d.platform == "no such platform"])
  with pytest.raises(ValueError, match=r"make_mesh: `devices` lists a device more than once"
                     r" \(2 entries, 1 devices\)"):
    layouts.make_mesh("data", jax.devices()[:1] * 2)
  rules = {"up": "column", "down": "row"}
  tp = layouts.Layout("tp", layouts.make_mesh("tp", model_devices=4), rules)
  params = {"mlp": {"up": {"kernel": jnp.ones((8, 6))}, "down": {"kernel": jnp.ones((6, 8))}}}
  with pytest.raises(ValueError, match=r"Layout.state_shardings: the kernel of layer 'mlp/down'"
                     r" \(6, 8\) is split over 4 devices of mesh axis 'model' along an axis of 6"
                     r" \('tp', tensor_parallel rule 'down': 'row'\)"):
    tp.state_shardings(params)
  params = {"mlp": {"up": {"kernel": jnp.ones((8, 16))}, "down": {"kernel": jnp.ones((16, 8))}}}
  specs = jax.tree.map(lambda s: s.spec, tp.state_shardings(params))
  assert specs["mlp"]["down"]["kernel"] == P("model", None)  # a width 4 divides: split
  with pytest.raises(TypeError, match=r"Layout.constrain: sparse_layers must be a collection of"
                     r" layer paths, got the string 'mlp/up'; pass \['mlp/up'\]"):
    tp.constrain(params, "mlp/up")  # was: no kernel for the layers '/', 'l', 'm', 'p', 'u'
  two_d = layouts.Layout("2d", layouts.make_mesh("2d"), rules)  # 4 data x 2 model
  with pytest.raises(ValueError, match=r"the kernel of layer 'mlp/up' \(6, 16\) is split over 4"
                     r" devices of mesh axis 'data'"):
    two_d.state_shardings({"mlp": {"up": {"kernel": jnp.ones((6, 16))},
                                   "down": {"kernel": jnp.ones((16, 8))}}})


def test_a_mask24_sliced_along_an_axis_it_does_not_stack_is_named():
  """A pytree map that slices masks (`a[0]`, `a[:4]`) cut the packed codes
  of a mask that is no stack, which kept its dims: its `shape` still passed
  the shape checks, and the product failed inside JAX ("cannot reshape",
  "incompatible shapes for broadcasting", an IndexError)."""
  w = jax.random.normal(jax.random.key(0), (8, 8))
  mask = jsparse24.Mask24.from_weights(w)
  for cut in (lambda a: a[:4], lambda a: a[0]):
    bad = jax.tree.map(cut, mask)
    assert bad.shape == (8, 8)  # why the shape checks let it through
    for fn, call in (("compress", lambda: jsparse24.compress(w, bad)),  # noqa: B023
                     ("sparse_dot", lambda: jsparse24.sparse_dot(X[:, :8], w, mask=bad))):  # noqa: B023
      with pytest.raises(ValueError, match=rf"{fn}: `mask` is a Mask24 of dims \(K, N\) = \(8,"
                         r" 8\) whose packed codes are uint8\(.*\), not uint8\[..., 8, 1\]"):
        call()
  variables = _Net().init(jax.random.key(0), X)
  sparsity = variables["sparsity"]
  cut = {"up": {**sparsity["up"], "mask": jax.tree.map(lambda a: a[:4], sparsity["up"]["mask"])}}
  with pytest.raises(ValueError, match=r"SparseDense 'up': `sparsity/mask` is a Mask24 of dims"):
    _Net().apply({**variables, "sparsity": cut}, X)
  # Stacks slice like arrays; a mask whose K/4 is odd packs flat.
  stack = jsparse24.Mask24.from_weights(jnp.ones((3, 12, 8)))
  one = jax.tree.map(lambda a: a[1], stack)
  assert jsparse24.sparse_dot(jnp.ones((2, 12)), jnp.ones((12, 8)), mask=one).shape == (2, 8)


def test_comparing_masks_or_compressed_weights_says_how():
  """`==` between two Mask24s or two Sparse24s compared their arrays: an
  ambiguous truth value (a ValueError naming neither class), or a
  broadcasting error for another size."""
  w = jax.random.normal(jax.random.key(0), (8, 8))
  a, b = jsparse24.Mask24.from_weights(w), jsparse24.Mask24.from_weights(w)
  with pytest.raises(TypeError, match=r"Mask24: `==` would compare arrays elementwise; compare"
                     r" the codes, jnp.array_equal\(a.packed, b.packed\)"):
    _ = a == b
  with pytest.raises(TypeError, match=r"Sparse24: `==` would compare arrays.*jnp.array_equal"
                     r"\(decompress\(a\), decompress\(b\)\)"):
    _ = jsparse24.compress(w) != jsparse24.compress(w)
  with pytest.raises(TypeError, match=r"unhashable type: 'Mask24'"):
    hash(a)
  assert a is not None and a not in (None, jsparse24.linen.STATIC_DENSE) and a in [a]


def test_casting_a_compressed_weight_to_integers_is_refused():
  """`Sparse24.astype(jnp.int8)` truncated the values to integers; every
  product refused the result later, naming its values, not the cast."""
  sp = jsparse24.compress(jax.random.normal(jax.random.key(0), (8, 8)))
  with pytest.raises(TypeError, match=r"Sparse24.astype: `dtype` must have a floating dtype"
                     r" \(bfloat16, float16, float32 or float64\), got int8"):
    sp.astype(jnp.int8)
  assert sp.astype(jnp.bfloat16).dtype == jnp.bfloat16


def test_compressed_params_of_another_width_or_without_their_bias_are_named():
  """A layer on compressed params (`compress_params`) ran with a kernel of
  another width (the output was the kernel's width, not `features`),
  dropped a missing bias, broadcast a bias of one element and failed inside
  JAX on one of another length. `nn.Dense` refuses each on dense params."""
  x = jnp.ones((4, 16))
  variables = _Net().init(jax.random.key(0), x)
  params = jsparse24.compress_params(variables["params"], variables["sparsity"])
  up = params["up"]
  with pytest.raises(ValueError, match=r"SparseDense 'up': its compressed kernel \(a Sparse24\)"
                     r" has 8 outputs .* features=4: the params were compressed from another"):
    _Net(features=4).apply({"params": params}, x)
  with pytest.raises(ValueError, match=r"SparseDense 'up': use_bias=True, but the params hold"
                     r" a compressed kernel and no 'bias'"):
    _Net().apply({"params": {"up": {"kernel": up["kernel"]}}}, x)
  for bias in (jnp.ones(1), jnp.ones(3)):
    with pytest.raises(ValueError, match=r"SparseDense 'up': its 'bias' has shape \(\d,\),"
                       r" want \(8,\)"):
      _Net().apply({"params": {"up": {**up, "bias": bias}}}, x)
  assert _Net().apply({"params": params}, x).shape == (4, 8)


@pytest.mark.parametrize("call,match", [
    (lambda w, x: jsparse24.prune_24(w, transposable="no"), r"prune_24: transposable"),
    (lambda w, x: jsparse24.Mask24.from_weights(w, transposable="no"),
     r"Mask24.from_weights: transposable"),
    (lambda w, x: jsparse24.Mask24.pack(jsparse24.prune_24(w), transposable=1),
     r"Mask24.pack: transposable"),
    (lambda w, x: jsparse24.compress(w, cusparselt="no"), r"compress: cusparselt"),
    (lambda w, x: jsparse24.compress(w, transposed="no"), r"compress: transposed"),
    (lambda w, x: jsparse24.sparse_dot(x, w, transposable="False"),
     r"sparse_dot: transposable must be True, False or None \(transposable wherever"),
    (lambda w, x: jsparse24.SparseDense(16, transposable="False").init(jax.random.key(0), x),
     r"SparseDense: transposable must be True, False or None"),
    (lambda w, x: jsparse24.sparsify(nn.Dense(16), {".*": {"transposable": "False"}}).init(
        jax.random.key(0), x), r"sparsify: rule '\.\*': transposable must be True"),
    (lambda w, x: jnnx.SparseLinear(16, 16, transposable="False", rngs=nnx.Rngs(0)),
     r"SparseLinear: transposable must be True"),
])
def test_a_flag_given_as_a_string_is_refused(call, match):
  """Any string is true: `transposable="False"` built transposable masks and
  `cusparselt="no"` laid a weight out for cuSPARSELt."""
  w = jax.random.normal(jax.random.key(1), (16, 16))
  with pytest.raises(TypeError, match=match + r".*got (str|int) '?(no|False|1)'?\."):
    call(w, X)


def test_sparsify_apply_names_masked_layers_that_no_rule_matches():
  """Applied with rules that left out a layer the model was initialised
  with, the layer ran dense and its trained mask was ignored without a
  word: the output was not the trained model's."""
  variables = jsparse24.sparsify(_Mlp(), {"up|down": PLAIN}).init(jax.random.key(0), X)
  with pytest.raises(ValueError, match=r"sparsify: `apply` ran the nn.Dense layer\(s\)"
                     r" \['down'\] dense, as no rule matches them, but the 'sparsity'"
                     r" collection holds their masks"):
    jsparse24.sparsify(_Mlp(), {"up": PLAIN}).apply(variables, X)
  # Without that layer's mask, it runs dense as asked.
  only_up = {**variables, "sparsity": {"up": variables["sparsity"]["up"]}}
  jsparse24.sparsify(_Mlp(), {"up": PLAIN}).apply(only_up, X)


class _MyDense(nn.Dense):
  pass


@pytest.mark.parametrize("layer,kind", [
    (lambda: nn.DenseGeneral((2, 4), name="p"), "DenseGeneral"),
    (lambda: _MyDense(8, name="p"), "_MyDense"),
    (lambda: nn.Conv(8, (3,), name="p"), "Conv"),
])
def test_sparsify_names_a_rule_for_a_layer_that_is_not_nn_dense(layer, kind):
  """A rule for a subclass of nn.Dense, a DenseGeneral or a Conv: `apply`
  ran the layer dense and counted the rule as matching its kernel, and
  `init`'s error spoke of experts only."""

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return layer()(x)

  x = jnp.ones((2, 4, 16))
  variables = Net().init(jax.random.key(0), x)
  sparse = jsparse24.sparsify(Net(), {"p": {"mask_source": "dynamic"}})
  for call in (lambda: sparse.apply(variables, x), lambda: sparse.init(jax.random.key(0), x)):
    with pytest.raises(ValueError, match=rf"(?s)sparsify: rule 'p' matches no nn.Dense layer"
                       rf" .* the parameter 'p/kernel' .* of module 'p' \({kind}\).*not a"
                       r" subclass, nn.DenseGeneral or nn.Conv.*use jsparse24.SparseDense"):
      call()


def test_a_bool_mask_in_the_collection_is_named_by_the_helpers():
  """One layer's mask as a dense bool array: compress_params failed with
  "'ArrayImpl' object has no attribute 'get'", rebuild_masks said the
  collection had a layer at 'up/mask' that the params lacked."""
  v = _variables()
  sparsity = {"up": {**v["sparsity"]["up"], "mask": v["sparsity"]["up"]["mask"].unpack()}}
  for fn, call in (("compress_params", jsparse24.compress_params),
                   ("rebuild_masks", jsparse24.rebuild_masks),
                   ("masks_like_kernels", lambda p, s: jsparse24.masks_like_kernels(s, p))):
    with pytest.raises(TypeError, match=rf"{fn}: the mask of layer 'up' in `sparsity` is a"
                       r" jax.Array bool\[16, 8\]; expected a jsparse24.Mask24 \(a bool 2:4"
                       r" mask \[in, out\] converts with jsparse24.Mask24.pack"):
      call(v["params"], sparsity)


def test_masks_restored_without_a_template_say_how_to_restore_them(tmp_path):
  """Orbax restores a tree without a template as dicts: each Mask24 came
  back as {'packed': ...}, and the helpers said the collection held no mask
  (pass the model's collection: the user had), `apply` to convert with
  Mask24.pack (which cannot: shape and transposable are lost)."""
  ocp = pytest.importorskip("orbax.checkpoint")
  variables = _variables()
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "ckpt", variables)
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(tmp_path / "ckpt")
  fix = r"a dict \{'packed': ...\} is a Mask24 restored from a checkpoint without a template"
  for fn, call in (("compress_params", jsparse24.compress_params),
                   ("rebuild_masks", jsparse24.rebuild_masks),
                   ("with_masks", lambda p, s: optim.with_masks(optax.sgd(0.1), s))):
    with pytest.raises(TypeError, match=rf"{fn}: the mask of layer 'up' in `sparsity` is a"
                       rf" dict with keys \['packed'\]; expected a jsparse24.Mask24 \({fix}"):
      call(restored["params"], restored["sparsity"])
  with pytest.raises(TypeError, match=rf"SparseDense 'up': the 'mask' .* is a dict with keys"
                     rf" \['packed'\]; .*\({fix}"):
    _Net().apply(restored, X)
  with ocp.StandardCheckpointer() as checkpointer:  # the fix the errors give
    restored = checkpointer.restore(tmp_path / "ckpt", jax.tree.map(
        ocp.utils.to_shape_dtype_struct, jax.eval_shape(_Net().init, jax.random.key(1), X)))
  np.testing.assert_array_equal(_Net().apply(restored, X), _Net().apply(variables, X))


def test_the_mask24_constructor_refuses_a_dense_mask_without_a_shape():
  """`Mask24(mask)` in place of `Mask24.pack(mask)` took the bool mask as
  the packed codes: a mask of shape (0, 0), which failed far from here."""
  mask = jsparse24.prune_24(jnp.arange(128.0).reshape(16, 8))
  for dims in ((0, 0), (16,), (0, 8)):
    with pytest.raises(ValueError, match=r"Mask24: dims=\(.*\) must be the weight's \(K, N\),"
                       r" both >= 1; a mask is made with Mask24.pack\(mask\)"):
      jsparse24.Mask24(mask, dims)
  with pytest.raises(ValueError, match=r"Mask24: dims=\(0, 0\)"):
    jsparse24.Mask24(mask)
  packed = jsparse24.Mask24.pack(mask)
  rebuilt = jsparse24.Mask24(np.asarray(packed.packed), (16, 8))
  np.testing.assert_array_equal(rebuilt.unpack(), mask)


def test_sparsify_names_a_rule_that_an_earlier_rule_shadows():
  """`{".*": ..., "up": ...}`: "up" was matched by ".*" first, so its options
  never applied, without a word."""
  rules = {".*": PLAIN, "up": {"transposable": True}}
  for call in (lambda s: s.init(jax.random.key(0), X),
               lambda s: s.apply(jsparse24.sparsify(_Mlp(), PLAIN_RULES).init(
                   jax.random.key(0), X), X)):
    with pytest.raises(ValueError, match=r"sparsify: rule 'up' never applies in `(init|apply)`:"
                       r" every layer it matches is matched by an earlier rule first"
                       r" \(\{'up': '\.\*'\}\)"):
      call(jsparse24.sparsify(_Mlp(), rules))
  # In the other order each rule takes layers of its own.
  jsparse24.sparsify(_Mlp(), {"up": PLAIN, ".*": PLAIN}).init(jax.random.key(0), X)


def test_lists_axes_and_rule_sets_of_the_wrong_kind_are_named():
  """A nested list failed with JAX's "Cannot determine dtype of [[...]]", an
  axis of None or 1.0 with a bare Python TypeError, and a set of rules was
  answered with a fix that is not Python (`{{'up'}: {}}`)."""
  rows = [[1.0, 2.0]] * 4
  for fn, call in (("prune_24", jsparse24.prune_24), ("compress", jsparse24.compress)):
    with pytest.raises(TypeError, match=rf"{fn}: `w` must be an array, got a list: pass"
                       r" jnp.asarray\(w\)"):
      call(rows)
  for axis in (None, 1.0, True):
    with pytest.raises(TypeError, match=rf"prune_24: `axis` must be an int, got"
                       rf" {type(axis).__name__} {axis}"):
      jsparse24.prune_24(jnp.ones((4, 4)), axis=axis)
  with pytest.raises(TypeError, match=r"with default options: \{'down': \{\}, 'up': \{\}\}\)"):
    jsparse24.sparsify(_Mlp(), {"up", "down"})


def test_sparsify_names_a_compressed_layer_that_no_rule_matches():
  """Was Flax's ScopeParamShapeError quoting the shape of the compressed
  values, which the user never sees."""
  variables = jsparse24.sparsify(_Mlp(), {"up|down": PLAIN}).init(jax.random.key(0), X)
  params = jsparse24.compress_params(variables["params"], variables["sparsity"])
  with pytest.raises(ValueError, match=r"sparsify: nn.Dense 'down' holds a compressed kernel"
                     r" \(a Sparse24, from compress_params\) but no rule matches it"):
    jsparse24.sparsify(_Mlp(), {"up": PLAIN}).apply({"params": params}, X)
  jsparse24.sparsify(_Mlp(), {"up|down": PLAIN}).apply({"params": params}, X)


def test_selected_implementation_names_arguments_it_would_misread(monkeypatch):
  """dtype=None (a layer's default) was answered for float64, flags given
  as strings were true, arrays in place of shapes failed inside NumPy; and
  transposable=None (the layers' default) was read as False, where a layer
  reads it as transposable wherever N is a multiple of 4."""
  f = jsparse24.selected_implementation
  cases = [(dict(dtype=None), r"dtype must be the product's compute dtype .* got None"),
           (dict(transposable="False"), r"transposable must be True, False or None"),
           (dict(pruned_activations="no"), r"pruned_activations must be True or False"),
           (dict(x_shape=jnp.ones((8, 64))), r"`x_shape` must be a shape .* got an array;"
                                            r" pass its .shape"),
           (dict(x_shape=8), r"`x_shape` must be a shape \(a tuple of ints >= 0\), got int 8"),
           (dict(w_shape=(64, 32.0)), r"`w_shape` must be a shape .* got tuple \(64, 32.0\)")]
  for kw, match in cases:
    args = {"x_shape": (8, 64), "w_shape": (64, 32), "dtype": jnp.bfloat16, **kw}
    with pytest.raises(TypeError, match=r"selected_implementation: " + match):
      f(args.pop("x_shape"), args.pop("w_shape"), args.pop("dtype"), **args)
  # None is resolved by N as the layers resolve it.
  seen = []
  monkeypatch.setattr(jsparse24._ops.backends, "select",
                      lambda impl, problem: seen.append(problem.transposable) or
                      types.SimpleNamespace(name="xla"))
  for n, want in ((32, True), (30, False)):
    f((8, 64), (64, n), jnp.bfloat16, transposable=None)
    assert seen[-1] is want, (n, seen)


def test_selected_implementation_answers_for_cusparselts_layout_as_sparse_dot_runs(monkeypatch):
  """compressed='cusparselt' was answered for weights compress cannot lay
  out that way (K = 60), and for a float32 product as for a bfloat16 one,
  where sparse_dot converts the weight to the portable layout first."""
  f = jsparse24.selected_implementation
  with pytest.raises(ValueError, match=r"selected_implementation: compressed='cusparselt' .* needs"
                     r" K and N multiples of 64 .* got K=60, N=64; pass compressed=True"):
    f((8, 60), (60, 64), jnp.bfloat16, compressed="cusparselt")
  seen = []
  monkeypatch.setattr(jsparse24._ops.backends, "select",
                      lambda impl, problem, *fn: seen.append(problem) or
                      types.SimpleNamespace(name="xla", split_align=None))
  w = jsparse24.compress(jnp.ones((128, 64), jnp.bfloat16), cusparselt=True)
  for dtype, layout in ((jnp.float32, False), (jnp.bfloat16, True)):
    f((8, 128), (128, 64), dtype, compressed="cusparselt")
    with contextlib.suppress(AttributeError):  # the stand-in backend runs nothing
      jsparse24.sparse_dot(jnp.ones((8, 128), dtype), w)
    asked, ran = seen[-2:]
    assert asked == ran and asked.cusparselt_layout is layout and asked.compressed, seen


def test_moe_experts_and_capacities_that_cannot_be_used_are_named():
  """2:4 experts with a hidden width that is not a multiple of 4 were named
  by the down-projection, asking to pad the inputs; a capacity_factor given
  as a jax scalar was 'must be a finite number > 0' though it was one; and
  a capacity past the group's tokens built buffers whose extra slots stay
  empty (16,000 slots per expert for 64 tokens)."""
  with pytest.raises(ValueError, match=r"SparseMoE: hidden=30 must be a multiple of 4 for 2:4"
                     r" experts .*pass hidden=32"):
    jsparse24.SparseMoE(num_experts=4, hidden=30, transposable=False).init(
        jax.random.key(0), jnp.ones((1, 8, 16)))
  with pytest.raises(ValueError, match=r"nnx.SparseMoE: hidden=30 must be a multiple of 4"):
    jnnx.SparseMoE(16, num_experts=4, hidden=30, rngs=nnx.Rngs(0))
  dense = jsparse24.SparseMoE(num_experts=4, hidden=30, sparse=False)  # nn.Dense experts: fine
  assert dense.apply(dense.init(jax.random.key(0), jnp.ones((1, 8, 16))),
                     jnp.ones((1, 8, 16))).shape == (1, 8, 16)
  with pytest.raises(TypeError, match=r"SparseMoE: capacity_factor must be a Python or NumPy"
                     r" number .* got a jax.Array; pass float\(capacity_factor\)"):
    jnnx.SparseMoE(16, num_experts=4, hidden=32, capacity_factor=jnp.float32(1.25),
                   rngs=nnx.Rngs(0))
  assert jsparse24.moe.expert_capacity(64, 8, 2, 1000.0) == 64  # was 16,000
  assert jsparse24.moe.expert_capacity(64, 8, 2, 1.25) == 20


def test_route_refuses_probabilities_that_are_not_floats():
  """Integer or bool probs were routed, and became integer or bool gates."""
  for probs in (jnp.ones((1, 4, 4), jnp.int32), jnp.ones((1, 4, 4), bool)):
    with pytest.raises(TypeError, match=r"route: `probs` must have a floating dtype"):
      jsparse24.moe.route(probs, 2, 2)
  assert jsparse24.moe.route(jnp.full((1, 4, 4), 0.25), 2, 2).gates.dtype == jnp.float32


def test_moe_layers_name_inputs_of_another_width_or_without_tokens():
  """nnx.SparseMoE on inputs of another width failed in JAX's dot_general
  ("contracting dimensions ... (12,) and (16,)"), both layers on groups of no
  tokens with a ZeroDivisionError inside a reshape."""
  moe = jnnx.SparseMoE(16, num_experts=4, hidden=32, transposable=False, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"nnx.SparseMoE: `inputs` \(2, 6, 12\) has width 12, and"
                     r" the layer was built with in_features=16"):
    moe(jnp.ones((2, 6, 12)))
  with pytest.raises(ValueError, match=r"nnx.SparseMoE: `inputs` \(2, 0, 16\) has no tokens"):
    moe(jnp.ones((2, 0, 16)))
  with pytest.raises(ValueError, match=r"SparseMoE: `inputs` \(2, 0, 16\) has no tokens"):
    jsparse24.SparseMoE(num_experts=4, hidden=32, transposable=False).init(
        jax.random.key(0), jnp.ones((2, 0, 16)))
  assert moe(jnp.ones((2, 8, 16))).shape == (2, 8, 16)
