"""`jsparse24.SparseMoE`: the 2:4 mixture-of-experts layer against a plain-jnp
reference whose routing is a token-by-token loop (forward and gradients),
its masks per expert through `init`, `optim.mask_update` and
`compress_params`, and what capacity drops.
"""

import dataclasses
import functools
import math
import typing

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

import jsparse24
from jsparse24 import moe, optim
from jsparse24._options import SparsityOptions
from tests.test_sharding import _collectives
from tests.test_stacked import _all_eqns

E, D, H = 4, 12, 20  # experts, model width, expert hidden width (multiples of 4)
G, S = 3, 7          # routing groups, tokens per group
TOL = dict(rtol=2e-5, atol=2e-5)


def _x(seed, shape=(G, S, D)):
  return jax.random.normal(jax.random.key(seed), shape)


def _masks(sparsity):
  """Each expert's dense bool masks, unpacked from its own slice of the stack."""
  return {name: np.stack([np.asarray(jax.tree.map(lambda a: a[e], layer["mask"]).unpack())
                          for e in range(E)])
          for name, layer in sparsity["experts"].items()}


def _routing(probs, top_k, capacity):
  """bool [G, S, E]: which (token, expert) choices are kept, one token at a
  time: all first choices in token order, then all second choices, each
  taking a slot while its expert has one."""
  probs = np.asarray(probs)
  keep = np.zeros(probs.shape, bool)
  for g in range(probs.shape[0]):
    order = np.argsort(-probs[g], axis=-1, kind="stable")[:, :top_k]
    used = np.zeros(probs.shape[-1], int)
    for rank in range(top_k):
      for s in range(probs.shape[1]):
        e = order[s, rank]
        if used[e] < capacity:
          keep[g, s, e] = True
          used[e] += 1
  return keep


@jax.jit
def _probs(params, x):
  return jax.nn.softmax(x @ params["router"]["kernel"], axis=-1)


# Jitted, as every computation here: run op by op, the layer and the
# reference compiled hundreds of one-operation programs per test.
def _init(model, seed, x):
  return jax.jit(model.init)(jax.random.key(seed), x)


@functools.partial(jax.jit, static_argnums=1)
def _fresh(params, first_seed):
  """Fresh values everywhere (biases are zero at init)."""
  leaves, tree = jax.tree.flatten(params)
  return tree.unflatten([jax.random.normal(jax.random.key(first_seed + i), a.shape) * 0.5
                         for i, a in enumerate(leaves)])


def _reference(params, masks, x, keep, *, gradient, activation=nn.gelu):
  """sum over kept experts e of p_e(x) * expert_e(x), each expert's kernels
  masked; with "ste" the masked kernel's gradient is the dense one."""
  def kernel(name, e):
    w, m = params["experts"][name]["kernel"][e], masks[name][e]
    return w + jax.lax.stop_gradient(w * m - w) if gradient == "ste" else w * m

  def bias(name, e):
    b = params["experts"][name].get("bias")
    return 0.0 if b is None else b[e]

  probs = _probs(params, x)
  out = jnp.zeros_like(x)
  for e in range(E):
    h = activation(x @ kernel("up", e) + bias("up", e))
    y = h @ kernel("down", e) + bias("down", e)
    out = out + (keep[..., e] * probs[..., e])[..., None] * y
  return out


@pytest.mark.parametrize("top_k,capacity_factor,gradient,use_bias", [
    (1, 1.0, "ste", False),
    (2, 0.75, "masked", True),  # tight: second choices and some first ones dropped
    (2, 2.0, "ste", False),     # room for every choice
    (E, 1.0, "ste", False),     # every expert for every token (top_k = num_experts)
])
def test_forward_and_gradients_match_the_reference(top_k, capacity_factor, gradient, use_bias):
  model = jsparse24.SparseMoE(num_experts=E, hidden=H, top_k=top_k,
                              capacity_factor=capacity_factor, gradient=gradient,
                              use_bias=use_bias)
  x = _x(0)
  v = _init(model, 1, x)
  params = _fresh(v["params"], 10)
  variables = {"params": params, "sparsity": v["sparsity"]}
  masks = _masks(v["sparsity"])
  capacity = jsparse24.moe.expert_capacity(S, E, top_k, capacity_factor)
  keep = _routing(_probs(params, x), top_k, capacity)
  choices = G * S * top_k
  if capacity_factor < 1:
    assert keep.sum() < choices  # the case does drop
  elif capacity_factor >= E / top_k:
    assert keep.sum() == choices

  cot = _x(2)

  # The layer and the reference each in one program (run op by op, they
  # compiled hundreds of one-operation programs).
  @jax.jit
  def layer(params, x):
    y, state = model.apply({**variables, "params": params}, x, mutable=["intermediates"])
    grads = jax.grad(lambda p, x: jnp.sum(model.apply({"params": p, "sparsity": v["sparsity"]}, x)
                                          * cot), (0, 1))(params, x)
    return y, state["intermediates"]["dropped"][0], grads

  @jax.jit
  def reference(params, x, masks, keep):
    y = _reference(params, masks, x, keep, gradient=gradient)
    grads = jax.grad(lambda p, x: jnp.sum(_reference(p, masks, x, keep, gradient=gradient)
                                          * cot), (0, 1))(params, x)
    return y, grads

  y, dropped, got = layer(params, x)
  want_y, want = reference(params, x, masks, keep)
  np.testing.assert_allclose(y, want_y, **TOL)
  np.testing.assert_allclose(dropped, 1 - keep.sum() / choices, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got, want)


def test_a_token_over_capacity_contributes_nothing():
  """Every token prefers expert 0 (capacity 2 of the group's 7): the first
  two come out as that expert's output times its gate, the others as 0."""
  model = jsparse24.SparseMoE(num_experts=E, hidden=H, top_k=1, capacity_factor=1.0)
  x = jnp.abs(_x(3, (1, S, D))) + 0.1
  v = _init(model, 4, x)
  params = jax.tree.map(lambda a: a, v["params"])
  params["router"]["kernel"] = jnp.zeros((D, E)).at[:, 0].set(1.0)
  y, state = jax.jit(lambda p, x: model.apply({"params": p, "sparsity": v["sparsity"]}, x,
                                              mutable=["intermediates"]))(params, x)
  capacity = jsparse24.moe.expert_capacity(S, E, 1, 1.0)
  assert capacity == 2
  keep = np.zeros((1, S, E), bool)
  keep[0, :capacity, 0] = True
  want = jax.jit(lambda p, x, masks, keep: _reference(p, masks, x, keep, gradient="ste"))(
      params, x, _masks(v["sparsity"]), keep)
  np.testing.assert_allclose(y, want, **TOL)
  assert np.all(np.abs(np.asarray(y[0, :capacity])) > 0)
  np.testing.assert_array_equal(y[0, capacity:], 0.0)
  np.testing.assert_allclose(state["intermediates"]["dropped"][0], (S - capacity) / S, rtol=1e-6)


def test_route_gives_the_slots_of_the_token_loop_and_dispatch_combine_move_rows_by_them():
  """`route`'s slots are those the token-by-token loop hands out (rank, then
  token, in order of arrival); `choice` is their inverse; `dispatch` puts
  each kept token in its slot (empty slots zero) and `combine` adds the
  gated rows back per token."""
  top_k, capacity = 2, 3  # tight: 42 choices for 36 slots
  probs = jax.nn.softmax(_x(7, (G, S, E)), axis=-1)
  routing = jax.jit(jsparse24.moe.route, static_argnums=(1, 2))(probs, top_k, capacity)
  want_slot = np.full((G, S, top_k), E * capacity)
  order = np.argsort(-np.asarray(probs), axis=-1, kind="stable")[..., :top_k]
  for g in range(G):
    used = np.zeros(E, int)
    for rank in range(top_k):
      for s in range(S):
        e = order[g, s, rank]
        if used[e] < capacity:
          want_slot[g, s, rank] = e * capacity + used[e]
          used[e] += 1
  np.testing.assert_array_equal(routing.experts, order)
  np.testing.assert_array_equal(routing.slot, want_slot)
  np.testing.assert_array_equal(routing.kept, want_slot < E * capacity)
  want_choice = np.full((G, E * capacity), S * top_k)
  for g, s, rank in zip(*np.nonzero(want_slot < E * capacity)):
    want_choice[g, want_slot[g, s, rank]] = s * top_k + rank
  np.testing.assert_array_equal(routing.choice.reshape(G, -1), want_choice)

  x = _x(8)
  buffers = np.asarray(jax.jit(jsparse24.moe.dispatch)(x, routing))
  want = np.zeros((E, G, capacity, D), np.float32)
  for g, s, rank in zip(*np.nonzero(want_slot < E * capacity)):
    e, c = divmod(want_slot[g, s, rank], capacity)
    want[e, g, c] = x[g, s]
  np.testing.assert_array_equal(buffers, want)
  out = _x(9, (E, G, capacity, D))
  y = np.asarray(jax.jit(jsparse24.moe.combine)(out, routing))
  want = np.zeros((G, S, D), np.float32)
  for g, s, rank in zip(*np.nonzero(want_slot < E * capacity)):
    e, c = divmod(want_slot[g, s, rank], capacity)
    want[g, s] += np.asarray(routing.gates)[g, s, rank] * np.asarray(out)[e, g, c]
  np.testing.assert_allclose(y, want, **TOL)


def test_routing_and_its_gradient_hold_nothing_of_size_tokens_times_slots():
  """The layer's forward and backward pass move tokens by index: no array in
  them is as large as the one-hot `[G, S, E, C]` dispatch tensor (which
  costs a product as large as the experts' own at d_model 4096)."""
  s, capacity_factor = 256, 2.0  # S much larger than the widths D, H
  capacity = jsparse24.moe.expert_capacity(s, E, 2, capacity_factor)
  model = jsparse24.SparseMoE(num_experts=E, hidden=H, top_k=2, capacity_factor=capacity_factor,
                              sparse=False)
  x = _x(10, (G, s, D))
  v = _init(model, 11, x)
  jaxpr = jax.make_jaxpr(jax.grad(lambda p, x: jnp.sum(model.apply({"params": p}, x) ** 2),
                                  (0, 1)))(v["params"], x)
  sizes = [math.prod(var.aval.shape) for e in _all_eqns(jaxpr.jaxpr) for var in e.outvars
           if hasattr(var.aval, "shape")]
  one_hot = G * s * E * capacity
  assert max(sizes) < one_hot // 4, (max(sizes), one_hot)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_groups_split_over_devices_compute_what_one_device_does_and_move_no_token(axis_type):
  """Data parallelism over the routing groups (4 devices, 2 groups each):
  the layer's output and gradients equal one device's, and the only
  collectives are the gradients' sums and routing-sized gathers: no token
  row (d-wide or hidden-wide) crosses devices, as each group's dispatch
  and combine gather within the group."""
  mesh = jax.make_mesh((4,), ("data",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
  model = jsparse24.SparseMoE(num_experts=E, hidden=H, top_k=2)
  x, cot = _x(12, (8, S, D)), _x(13, (8, S, D))
  v = _init(model, 14, x)

  @jax.jit
  def step(params, x):
    def loss(p, x):
      return jnp.sum(model.apply({"params": p, "sparsity": v["sparsity"]}, x) * cot)
    return jax.value_and_grad(loss, (0, 1))(params, x)

  want = step(v["params"], x)
  params = jax.device_put(v["params"], jax.sharding.NamedSharding(mesh, P()))
  xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))
  got = step(params, xs)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got, want)
  assert got[1][1].sharding.spec[0] == "data"
  coll = _collectives(step.lower(params, xs).compile().as_text())
  assert not coll["all-to-all"] and not coll["collective-permute"], coll
  assert all(D not in shape and H not in shape for shape in coll["all-gather"]), coll
  assert coll["all-reduce"], coll  # the gradients of the replicated params


def test_load_balancing_loss_is_switch_transformers():
  """E * sum_e (share of tokens choosing e) * (mean probability of e), per
  group, averaged; 1 for top-1 routing that is uniform in both."""
  probs = jax.nn.softmax(_x(5, (2, S, E)), axis=-1)
  _, experts = jax.lax.top_k(probs, 2)
  chose = np.zeros((2, S, E))
  for g in range(2):
    for s in range(S):
      chose[g, s, np.asarray(experts[g, s])] = 1
  want = E * np.mean(np.sum(chose.mean(1) * np.asarray(probs).mean(1), axis=-1))
  np.testing.assert_allclose(jsparse24.moe.load_balancing_loss(probs, experts), want, rtol=1e-6)
  uniform = jnp.full((1, E, E), 1.0 / E)
  np.testing.assert_allclose(
      jsparse24.moe.load_balancing_loss(uniform, jnp.arange(E).reshape(1, E, 1)), 1.0, rtol=1e-6)


def test_masks_are_per_expert_and_mask_update_rebuilds_each_from_its_weights():
  model = jsparse24.SparseMoE(num_experts=E, hidden=H, top_k=2)
  v = _init(model, 6, _x(0))
  params = v["params"]
  old = _masks(v["sparsity"])
  for name in ("up", "down"):
    assert v["sparsity"]["experts"][name]["mask"].shape == params["experts"][name]["kernel"].shape
    # Each expert its own initial weights (split rngs), hence its own masks.
    assert not np.array_equal(old[name][0], old[name][1]), name
    for e in range(E):
      np.testing.assert_array_equal(
          old[name][e], jsparse24.prune_24(params["experts"][name]["kernel"][e], transposable=True))

  tx = optax.chain(optim.mask_update(v["sparsity"], optim.MaskSchedule(rebuild_every=1)),
                   optax.sgd(0.1))
  state = tx.init(params)
  # New weights, different for every expert: the step's rebuild reads them.
  moved = jax.tree.map(lambda a: a, params)
  for i, name in enumerate(("up", "down")):
    kernel = params["experts"][name]["kernel"]
    moved["experts"][name]["kernel"] = jax.random.normal(jax.random.key(20 + i), kernel.shape)
  _, state = jax.jit(tx.update)(jax.tree.map(jnp.zeros_like, params), state, moved)
  new = _masks(optim.masks(state))
  for name in ("up", "down"):
    for e in range(E):
      kernel = moved["experts"][name]["kernel"][e]
      np.testing.assert_array_equal(new[name][e], jsparse24.prune_24(kernel, transposable=True))
      assert np.any(new[name][e] != old[name][e]), (name, e)
  assert optim.stats(state)["experts/up"]["flip_rate"].shape == (E,)


def test_compress_params_per_expert_gives_the_masked_outputs():
  model = jsparse24.SparseMoE(num_experts=E, hidden=H, top_k=2, use_bias=True)
  x = _x(7)
  v = _init(model, 8, x)
  compressed = jsparse24.compress_params(v["params"], v["sparsity"])
  for name, shape in (("up", (E, D, H)), ("down", (E, H, D))):
    kernel = compressed["experts"][name]["kernel"]
    assert isinstance(kernel, jsparse24.Sparse24) and tuple(kernel.shape) == shape
    assert kernel.has_transpose
    for e in range(E):
      np.testing.assert_array_equal(
          jsparse24.decompress(jax.tree.map(lambda a: a[e], kernel)),  # pylint: disable=cell-var-from-loop
          v["params"]["experts"][name]["kernel"][e] * _masks(v["sparsity"])[name][e])
  np.testing.assert_allclose(jax.jit(model.apply)({"params": compressed}, x),
                             jax.jit(model.apply)(v, x), **TOL)


def test_sparsity_fields_are_sparse_dense_ones():
  """The options of both expert kernels keep SparseDense's names, defaults
  and types: all of SparsityOptions but kernel_sharding (sharding experts is
  expert parallelism), input_sparsity and grad_output (no 2:4 activations in
  the experts, so no mask_source="none" and no weight_grad="2:4" either)."""
  fields = {f.name: f for f in dataclasses.fields(jsparse24.SparseMoE)}
  hints = typing.get_type_hints(jsparse24.SparseMoE)
  option_hints = typing.get_type_hints(SparsityOptions)
  option_hints["mask_source"] = typing.Literal["collection", "dynamic"]
  option_hints["weight_grad"] = typing.Literal["dense", "mvue"]
  for option in dataclasses.fields(SparsityOptions):
    if option.name in ("kernel_sharding", "input_sparsity", "grad_output"):
      assert option.name not in fields
      continue
    assert fields[option.name].default == option.default, option.name
    assert hints[option.name] == option_hints[option.name], option.name


def test_errors_name_the_layer_and_the_fix():
  with pytest.raises(ValueError, match=r"SparseDense 'experts/up'.*input width 10"):
    jsparse24.SparseMoE(num_experts=E, hidden=H).init(jax.random.key(0), _x(0, (2, 5, 10)))
  with pytest.raises(ValueError, match=r"SparseMoE: top_k=5 must lie in \[1, num_experts=4\]"):
    jsparse24.SparseMoE(num_experts=E, hidden=H, top_k=5).init(jax.random.key(0), _x(0))
  with pytest.raises(ValueError, match=r"SparseMoE: `inputs` must be \[..., S, d\]"):
    jsparse24.SparseMoE(num_experts=E, hidden=H).init(jax.random.key(0), jnp.ones(D))


def test_sparse_false_is_the_dense_layer_on_the_same_params():
  """`sparse=False`: the experts are nn.Dense, with the 2:4 layer's params
  tree and initial values (same key) and no masks; forward and gradients
  are the reference's with every weight kept."""
  sparse = jsparse24.SparseMoE(num_experts=E, hidden=H, top_k=2, use_bias=True)
  dense = sparse.clone(sparse=False)
  x = _x(11)
  # Op by op, as a user's init runs (jitted, the two programs' initialisers
  # can round differently).
  v = sparse.init(jax.random.key(12), x)
  dv = dense.init(jax.random.key(12), x)
  assert set(dv) == {"params"}
  jax.tree.map(np.testing.assert_array_equal, dv["params"], v["params"])
  params = _fresh(v["params"], 30)
  kept = {name: np.ones((E, *params["experts"][name]["kernel"].shape[1:]), bool)
          for name in ("up", "down")}
  capacity = jsparse24.moe.expert_capacity(S, E, 2, 1.25)
  keep = _routing(_probs(params, x), 2, capacity)
  cot = _x(13)
  reference = lambda p: _reference(p, kept, x, keep, gradient="masked")  # noqa: E731
  dense_apply = jax.jit(lambda p: dense.apply({"params": p}, x))
  np.testing.assert_allclose(dense_apply(params), jax.jit(reference)(params), **TOL)
  got = jax.jit(jax.grad(lambda p: jnp.sum(dense.apply({"params": p}, x) * cot)))(params)
  want = jax.jit(jax.grad(lambda p: jnp.sum(reference(p) * cot)))(params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL), got, want)
  # ... and the 2:4 layer differs from it on the same params.
  assert not np.allclose(jax.jit(sparse.apply)({"params": params, "sparsity": v["sparsity"]}, x),
                         dense_apply(params), rtol=1e-3, atol=1e-3)


def test_the_routing_functions_name_what_does_not_fit_the_routing():
  """Were silent (a buffer of another capacity combined into wrong values,
  tokens of another group size dispatched as zeros) or failed inside JAX or
  Python (an infinite capacity_factor: OverflowError; a float capacity)."""
  probs = jax.nn.softmax(jax.random.normal(jax.random.key(0), (2, 8, 4)))
  routing = moe.route(probs, 2, 5)
  x = jax.random.normal(jax.random.key(1), (2, 8, 6))
  h = moe.dispatch(x, routing)
  assert h.shape == (4, 2, 5, 6) and moe.combine(h, routing).shape == x.shape
  cases = [
      (lambda: moe.combine(h[:, :, :4], routing), ValueError,
       r"combine: `expert_out` must be \[E, G, C, d\] with \(E, G, C\) = \(4, 2, 5\) as routed,"
       r" got shape \(4, 2, 4, 6\)"),
      (lambda: moe.dispatch(x[:, :6], routing), ValueError,
       r"dispatch: `x` must be \[G, S, d\] with \(G, S\) = \(2, 8\) as routed"),
      (lambda: moe.dispatch(routing, x), TypeError, r"dispatch: `routing` must be the Routing"),
      (lambda: moe.route(probs[0], 2, 5), ValueError, r"route: `probs` must be \[G, S, E\]"),
      (lambda: moe.route(probs, 2, 2.5), ValueError, r"route: capacity must be an int >= 1"),
      (lambda: moe.route(probs, 5, 2), ValueError, r"route: top_k=5 must lie in \[1, num_experts=4\]"),
      (lambda: moe.expert_capacity(8, 4, 2, float("inf")), ValueError,
       r"expert_capacity: capacity_factor=inf must be a finite number > 0"),
      (lambda: moe.expert_capacity(8, 0, 2, 1.25), ValueError,
       r"expert_capacity: num_experts must be an int >= 1"),
  ]
  for call, error, match in cases:
    with pytest.raises(error, match=match):
      call()


# (layer arguments, the output dtype for bfloat16 inputs): bfloat16 params
# and inputs give bfloat16 (not float32), float32 params promote bfloat16
# inputs, and `dtype` overrides both, as for nn.Dense and nnx.Linear.
OUTPUT_DTYPES = (({"param_dtype": jnp.bfloat16}, jnp.bfloat16), ({}, jnp.float32),
                 ({"param_dtype": jnp.bfloat16, "dtype": jnp.float32}, jnp.float32))


def test_the_output_dtype_is_nn_denses():
  """The experts compute in the dtype `nn.Dense` promotes to (OUTPUT_DTYPES)."""
  x = _x(0).astype(jnp.bfloat16)
  for kw, want in OUTPUT_DTYPES:
    model = jsparse24.SparseMoE(num_experts=E, hidden=H, **kw)
    assert model.apply(model.init(jax.random.key(0), x), x).dtype == want, kw
