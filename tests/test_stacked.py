"""Stacked layers: blocks stacked with Linen `nn.scan` / `nn.vmap` and NNX
`nnx.vmap` / `nnx.scan` keep one mask and one `active` flag per layer through
`init`, `apply`, `rebuild_masks`, `mask_update`, `compress_params`, `sparsify`
and an Orbax save/restore.

Every check compares the stacked model with the same computation written
layer by layer (`_unrolled`), so a stack that mixes up layers, or a mask of
the stacked shape, fails.
"""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jsparse24
from jsparse24 import nnx as jnnx
from jsparse24 import optim
from tests.test_optim import check_orbax_resume_bit_for_bit

L, D, H = 3, 8, 16
TOL = dict(rtol=1e-5, atol=1e-5)


class _Block(nn.Module):
  """x + down(relu(up(x))); `dense=True` builds it from plain `nn.Dense`."""

  dense: bool = False

  @nn.compact
  def __call__(self, x, _):
    if self.dense:
      up, down = nn.Dense(H, name="up"), nn.Dense(D, name="down")
    else:
      up = jsparse24.SparseDense(H, name="up", transposable=False)
      down = jsparse24.SparseDense(D, name="down")  # the default kind: transposable
    return x + down(nn.relu(up(x))), None


class _Scanned(nn.Module):
  dense: bool = False

  @nn.compact
  def __call__(self, x):
    stack = nn.scan(_Block, variable_axes={"params": 0, "sparsity": 0},
                    split_rngs={"params": True}, length=L)
    return stack(self.dense, name="blocks")(x, None)[0]


def _x(seed=0, shape=(5, D)):
  return jax.random.normal(jax.random.key(seed), shape)


def _unrolled(params, masks, x):
  """The stacked model layer by layer with numpy masks: `masks[name][i]` is
  layer i's dense bool mask (None: dense)."""
  x = np.asarray(x, np.float64)
  for i in range(L):
    def lin(name, h):
      w = np.asarray(params[name]["kernel"][i], np.float64)
      if masks[name] is not None:
        w = w * masks[name][i]
      return h @ w + np.asarray(params[name]["bias"][i])
    x = x + lin("down", np.maximum(lin("up", x), 0))
  return x


def _slices(mask: jsparse24.Mask24) -> list[np.ndarray]:
  """Each layer's dense mask, unpacked from its own slice of the stack."""
  return [np.asarray(jax.tree.map(lambda a: a[i], mask).unpack()) for i in range(L)]


def _stack_masks(sparsity):
  return {name: _slices(sparsity["blocks"][name]["mask"]) for name in ("up", "down")}


def test_scan_init_keeps_one_mask_and_flag_per_layer():
  model = _Scanned()
  v = jax.jit(model.init)(jax.random.key(1), _x())
  for name, (k, n), transposable in (("up", (D, H), False), ("down", (H, D), True)):
    layer = v["sparsity"]["blocks"][name]
    assert layer["mask"].shape == (L, k, n) and layer["active"].shape == (L,)
    for i, m in enumerate(_slices(layer["mask"])):
      want = jsparse24.prune_24(v["params"]["blocks"][name]["kernel"][i], transposable=transposable)
      np.testing.assert_array_equal(m, want)
  np.testing.assert_allclose(jax.jit(model.apply)(v, _x()),
                             _unrolled(v["params"]["blocks"], _stack_masks(v["sparsity"]), _x()),
                             **TOL)


def test_scan_rebuild_masks_per_layer_and_dense_phase():
  model = _Scanned()
  v = jax.jit(model.init)(jax.random.key(1), _x())
  params = jax.tree.map(lambda a: a + 0.3 * jax.random.normal(jax.random.key(7), a.shape), v["params"])
  sparsity = jsparse24.rebuild_masks(params, v["sparsity"])
  masks = _stack_masks(sparsity)
  for name, transposable in (("up", False), ("down", True)):
    for i in range(L):
      np.testing.assert_array_equal(
          masks[name][i],
          jsparse24.prune_24(params["blocks"][name]["kernel"][i], transposable=transposable))
  np.testing.assert_allclose(jax.jit(model.apply)({"params": params, "sparsity": sparsity}, _x()),
                             _unrolled(params["blocks"], masks, _x()), **TOL)
  # Layer 1 of "up" dense, the others sparse: the flag is per layer.
  active = jnp.array([True, False, True])
  mixed = jax.tree.map(lambda a: a, sparsity)
  mixed["blocks"]["up"]["active"] = active
  up = [m if bool(a) else np.ones_like(m) for m, a in zip(masks["up"], active)]
  np.testing.assert_allclose(jax.jit(model.apply)({"params": params, "sparsity": mixed}, _x()),
                             _unrolled(params["blocks"], {**masks, "up": up}, _x()), **TOL)


def test_sparsify_a_scanned_dense_model():
  dense = _Scanned(dense=True)
  sparse = jsparse24.sparsify(dense, {r"blocks/up": {"transposable": False}, r"blocks/down": {}})
  v = sparse.init(jax.random.key(1), _x())
  ref = _Scanned().init(jax.random.key(1), _x())
  assert jax.tree.structure(v) == jax.tree.structure(ref)
  for a, b in zip(jax.tree.leaves(v), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(jax.jit(sparse.apply)(v, _x()),
                             _unrolled(v["params"]["blocks"], _stack_masks(v["sparsity"]), _x()),
                             **TOL)


def _setup(schedule, decay):
  model = _Scanned()
  x, y = _x(0), _x(1)
  v = jax.jit(model.init)(jax.random.key(2), x)
  tx = optax.chain(optim.mask_update(v["sparsity"], schedule, decay=decay), optax.sgd(0.05))
  return model, tx, v["params"], x, y


def test_mask_update_on_a_stack_rebuilds_flags_and_decays_per_layer():
  lam = 0.5
  schedule = optim.MaskSchedule(warmup_steps=1, rebuild_every=2)
  model, tx, params, x, y = _setup(schedule, lam)
  state = tx.init(params)
  assert optim.masks(state)["blocks"]["up"]["active"].shape == (L,)
  for step in range(5):
    old = _stack_masks(optim.masks(state))
    grads = jax.tree.map(jnp.zeros_like, params)
    updates, new_state = jax.jit(tx.update)(grads, state, params)
    inner = new_state[0]
    for name in ("up", "down"):
      layer = optim.masks(new_state)["blocks"][name]
      assert layer["active"].shape == (L,) and layer["mask"].shape[0] == L
      np.testing.assert_array_equal(layer["active"], np.full(L, bool(schedule.sparse(step + 1))))
      # The decay of step `step`: per layer, from that layer's held mask.
      w = np.asarray(params["blocks"][name]["kernel"])
      on = bool(schedule.sparse(step))
      want = np.stack([lam * on * w[i] * ~old[name][i] for i in range(L)])
      np.testing.assert_allclose(-updates["blocks"][name]["kernel"] / 0.05, want, rtol=1e-5, atol=1e-7)
      new = _slices(layer["mask"])
      if bool(schedule.rebuild(step + 1)):
        transposable = name == "down"
        for i in range(L):
          np.testing.assert_array_equal(new[i], jsparse24.prune_24(w[i], transposable=transposable))
        want_flip = [np.mean(new[i] != old[name][i]) for i in range(L)]
        np.testing.assert_allclose(inner.flip_rate["blocks"][name], want_flip, rtol=1e-6)
      else:
        for a, b in zip(new, old[name]):
          np.testing.assert_array_equal(a, b)
    state = new_state
    params = jax.tree.map(lambda p: p + 0.2 * jax.random.normal(jax.random.key(step), p.shape),
                          params)
  stats = optim.stats(state)
  assert stats["blocks/up"]["sparsity"].shape == (L,)


def test_compress_params_on_a_stack_and_orbax_resume(tmp_path):
  schedule = optim.MaskSchedule(warmup_steps=1, rebuild_every=2)
  model, tx, params0, x, y = _setup(schedule, 1e-3)
  p_full, s_full = check_orbax_resume_bit_for_bit(tmp_path, model, tx, params0, x, y)

  masks = optim.masks(s_full)
  compressed = jsparse24.compress_params(p_full, masks)
  up = compressed["blocks"]["up"]["kernel"]
  assert isinstance(up, jsparse24.Sparse24) and up.shape == (L, D, H)
  assert compressed["blocks"]["down"]["kernel"].has_transpose
  np.testing.assert_allclose(jax.jit(model.apply)({"params": compressed}, x),
                             jax.jit(model.apply)({"params": p_full, "sparsity": masks}, x), **TOL)
  mixed = jax.tree.map(lambda a: a, masks)
  mixed["blocks"]["up"]["active"] = jnp.array([True, False, True])
  with pytest.raises(ValueError, match="blocks/up.*partly sparse"):
    jsparse24.compress_params(p_full, mixed)


class _VmappedLayer(nn.Module):
  """Three independent layers applied to three inputs (an ensemble)."""

  @nn.compact
  def __call__(self, xs):
    ensemble = nn.vmap(jsparse24.SparseDense, variable_axes={"params": 0, "sparsity": 0},
                       split_rngs={"params": True}, in_axes=0, out_axes=0)
    return ensemble(H, transposable=False, name="layers")(xs)


def test_nn_vmap_stack_and_rebuild():
  model = _VmappedLayer()
  xs = _x(3, (L, 5, D))
  v = jax.jit(model.init)(jax.random.key(4), xs)
  layer = v["sparsity"]["layers"]
  assert layer["mask"].shape == (L, D, H) and layer["active"].shape == (L,)
  params = jax.tree.map(lambda a: -a, v["params"])
  sparsity = jsparse24.rebuild_masks(params, v["sparsity"])
  masks = _slices(sparsity["layers"]["mask"])
  kernel = np.asarray(params["layers"]["kernel"])
  want = np.stack([xs[i] @ (kernel[i] * masks[i]) + params["layers"]["bias"][i] for i in range(L)])
  for i in range(L):
    np.testing.assert_array_equal(masks[i], jsparse24.prune_24(kernel[i]))
  np.testing.assert_allclose(jax.jit(model.apply)({"params": params, "sparsity": sparsity}, xs), want, **TOL)


class _NnxBlock(nnx.Module):
  def __init__(self, rngs):
    self.up = jnnx.SparseLinear(D, H, rngs=rngs, transposable=False)
    self.down = jnnx.SparseLinear(H, D, rngs=rngs)  # the default kind: transposable

  def __call__(self, x):
    return x + self.down(nnx.relu(self.up(x)))


def test_nnx_vmap_and_scan_stack():
  @nnx.split_rngs(splits=L)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def create(rngs):
    return _NnxBlock(rngs)

  @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
  def forward(x, block):
    return block(x)

  blocks = create(nnx.Rngs(0))
  assert blocks.up.mask.get_value().shape == (L, D, H) and blocks.up.active[...].shape == (L,)

  def reference(x):
    params = {name: {"kernel": getattr(blocks, name).kernel[...],
                     "bias": getattr(blocks, name).bias[...]} for name in ("up", "down")}
    masks = {name: _slices(getattr(blocks, name).mask.get_value()) for name in ("up", "down")}
    return _unrolled(params, masks, x)

  x = _x()
  np.testing.assert_allclose(forward(x, blocks), reference(x), **TOL)
  blocks.up.kernel.set_value(-2.0 * blocks.up.kernel[...] ** 3)
  jnnx.rebuild_masks(blocks)
  for i, m in enumerate(_slices(blocks.up.mask.get_value())):
    np.testing.assert_array_equal(m, jsparse24.prune_24(blocks.up.kernel[...][i]))
  np.testing.assert_allclose(forward(x, blocks), reference(x), **TOL)
  blocks.down.active.set_value(jnp.array([False, True, False]))
  dense_down = [np.ones((H, D), bool), _slices(blocks.down.mask.get_value())[1], np.ones((H, D), bool)]
  params = {name: {"kernel": getattr(blocks, name).kernel[...], "bias": getattr(blocks, name).bias[...]}
            for name in ("up", "down")}
  want = _unrolled(params, {"up": _slices(blocks.up.mask.get_value()), "down": dense_down}, x)
  np.testing.assert_allclose(forward(x, blocks), want, **TOL)


def test_scan_backward_reads_the_stacked_kernels_without_a_copy():
  """Under nn.scan the custom_vjp products keep the (float32) kernel itself as
  their residual, which JAX's scan forwards from the stacked params: the
  forward scan returns no weight-shaped stack. (A bfloat16 copy of every
  kernel, [L, K, N], was stacked there when the layer cast it before the
  product: a write and a read of 2 bytes per weight per step.)"""
  from jsparse24.backends.pallas import interpret_mode

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      up = jsparse24.SparseDense(H, name="up", implementation="pallas", dtype=jnp.bfloat16)
      down = jsparse24.SparseDense(D, name="down", implementation="pallas", dtype=jnp.bfloat16)
      return x + down(nn.relu(up(x))), None

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      blocks = nn.scan(Block, variable_axes={"params": 0, "sparsity": 0},
                       split_rngs={"params": True}, length=L)
      return blocks(name="blocks")(x, None)[0]

  model, x = Model(), jnp.ones((4, D), jnp.bfloat16)
  with interpret_mode():
    v = jax.jit(model.init)(jax.random.key(0), x)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: model.apply(
        {"params": p, "sparsity": v["sparsity"]}, x).astype(jnp.float32).sum()))(v["params"])
  scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
  assert len(scans) == 2  # forward (with residuals), backward
  stacked = {tuple(o.aval.shape) for o in scans[0].outvars}
  for kernel in ((L, D, H), (L, H, D)):
    assert kernel not in stacked, (kernel, stacked)


def test_scan_masks_weights_without_weight_sized_constants_outside_the_loop():
  """The reference backend masks each layer's kernel inside nn.scan's loop by
  expanding its packed mask; nothing weight-sized is computed once per step
  outside the loop for it. (The expansion's row-dependent shifts were a
  `[K, N]` iota, which XLA hoisted out of the loop as two `uint8[K, N]`
  arrays, written every step and read by every layer.)"""
  model, x = _Scanned(), _x()
  v = jax.jit(model.init)(jax.random.key(0), x)

  def loss(p):
    return model.apply({"params": p, "sparsity": v["sparsity"]}, x).sum()

  hlo = jax.jit(jax.grad(loss)).lower(v["params"]).compile().as_text()
  entry = hlo[hlo.index("\nENTRY"):]
  hoisted = re.findall(r"= (?:u8|pred|s8|s32)\[(\d+),(\d+)\]", entry)
  weight_shaped = {(D, H), (H, D)}
  assert not {(int(a), int(b)) for a, b in hoisted} & weight_shaped, hoisted


def _all_eqns(jaxpr):
  """The equations of `jaxpr`, those of the jaxprs nested in them included."""
  for e in jaxpr.eqns:
    yield e
    for v in e.params.values():
      for j in v if isinstance(v, (list, tuple)) else [v]:
        if isinstance(j, jax.extend.core.ClosedJaxpr):
          yield from _all_eqns(j.jaxpr)
        elif isinstance(j, jax.extend.core.Jaxpr):
          yield from _all_eqns(j)


def _count_eqns(jaxpr, pred) -> int:
  return sum(bool(pred(e)) for e in _all_eqns(jaxpr))


def _count_pallas_calls(jaxpr, part: str) -> int:
  """The Pallas calls in `jaxpr` (nested ones included) whose kernel name holds `part`."""
  return _count_eqns(jaxpr, lambda e: e.primitive.name == "pallas_call"
                     and part in str(e.params.get("name", "")))


def _compressions(jaxpr) -> list[bool]:
  """The stored-mask compressions in `jaxpr` (nested ones included), as
  whether each writes the transposed copy: the transposable ones are
  `jsparse24_compress_with_mask` equations, the plain ones the kernel's."""
  found = []
  for e in _all_eqns(jaxpr):
    if e.primitive.name == "jsparse24_compress_with_mask":
      found.append(e.params["transposed"])
    elif e.primitive.name == "pallas_call" and "compress_with_meta" in str(e.params.get("name", "")):
      found.append(False)
  return sorted(found)


@pytest.mark.parametrize("save", [False, True])
def test_remat_policy_can_keep_the_compressed_weights(save):
  """Under nn.scan(nn.remat(...)) the backward pass recomputes the forward
  one, compression included (2 compressions in the gradient's program: the
  forward pass's without the transposed copy, which it would throw away,
  the backward pass's with it); a policy saving `jsparse24.CHECKPOINT_NAME`
  keeps the compressed weights instead (1, both copies), with the same
  gradient."""
  from jsparse24.backends.pallas import interpret_mode  # pylint: disable=g-import-not-at-top

  class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
      return h + jsparse24.SparseDense(64, use_bias=False, implementation="pallas")(h), None

  def grad_of(policy):
    scan = nn.scan(nn.remat(Block, policy=policy, prevent_cse=False),
                   variable_axes={"params": 0, "sparsity": 0}, split_rngs={"params": True},
                   length=3)()
    v = scan.init(jax.random.key(0), x, None)
    g = jax.grad(lambda p: jnp.sum(scan.apply({**v, "params": p}, x, None)[0] ** 2))
    return g, v["params"]

  x = jax.random.normal(jax.random.key(1), (16, 64))
  nothing = jax.checkpoint_policies.nothing_saveable
  policy = (jax.checkpoint_policies.save_only_these_names(jsparse24.CHECKPOINT_NAME)
            if save else nothing)
  with interpret_mode():
    g, params = grad_of(policy)
    jaxpr = jax.make_jaxpr(g)(params)
    compress = _compressions(jaxpr.jaxpr)
    assert compress == ([True] if save else [False, True]), compress
    if save:
      want = grad_of(nothing)[0](params)
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6),
                   g(params), want)


class _MlpBlock(nn.Module):
  """h + down(gelu(up(h))), 2:4 on the Pallas products (`sparse`) or `nn.Dense`."""

  sparse: bool

  @nn.compact
  def __call__(self, h, _):
    if self.sparse:
      layer = lambda n: jsparse24.SparseDense(n, use_bias=False, implementation="pallas")  # noqa: E731
    else:
      layer = lambda n: nn.Dense(n, use_bias=False)  # noqa: E731
    return h + layer(64)(nn.gelu(layer(128)(h))), None


@functools.cache
def _remat_gradient(sparse: bool, policy):
  """(the gradient function, params, its jaxpr) of 3 `_MlpBlock`s under
  `nn.scan(nn.remat(..., policy=policy))`. Built once per policy (the
  params come from fixed keys): `nothing_saveable` serves its own case and
  every saving policy's reference, and a policy under two names (JAX's
  aliases) is traced once."""
  scan = nn.scan(nn.remat(_MlpBlock, policy=policy, prevent_cse=False),
                 variable_axes={"params": 0, "sparsity": 0}, split_rngs={"params": True},
                 length=3)(sparse)
  x = jax.random.normal(jax.random.key(1), (16, 64))
  v = scan.init(jax.random.key(0), x, None)
  g = jax.grad(lambda p: jnp.sum(scan.apply({**v, "params": p}, x, None)[0] ** 2))
  return g, v["params"], jax.make_jaxpr(g)(v["params"]).jaxpr


_JAX_DOTS = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
_CP = jsparse24.checkpoint_policies


@functools.cache
def _gradient_saving_nothing():
  """The remat gradient that saves nothing, which every saving policy must
  equal: computed once for them all (the params come from fixed keys, so
  every `_remat_gradient` has the same)."""
  from jsparse24.backends.pallas import interpret_mode  # pylint: disable=g-import-not-at-top

  with interpret_mode():
    g, params, _ = _remat_gradient(True, jax.checkpoint_policies.nothing_saveable)
    return g(params)


@pytest.mark.parametrize("policy, products", [
    (jax.checkpoint_policies.nothing_saveable, 5),
    (_JAX_DOTS, 5),  # JAX's dot policy does not see the 2:4 products: recomputed
    (_CP.dots_with_no_batch_dims_saveable, 4),
    (_CP.dots_saveable, 4),
    (_CP.checkpoint_dots_with_no_batch_dims, 4),
    (_CP.saving_products(jax.checkpoint_policies.nothing_saveable), 4),
], ids=["nothing", "jax-dots", "dots_no_batch", "dots", "alias", "saving_products"])
def test_checkpoint_policies_save_the_sparse_products(policy, products):
  """Per block, 2 forward products and 2 dx products; a policy that saves
  the products' outputs keeps the backward pass from recomputing `up`'s
  (GELU needs its output): 5 -> 4 Pallas products in the gradient's
  program, as JAX's dot policy takes a dense block's dots 7 -> 6. The
  gradient is the one that saves nothing."""
  from jsparse24.backends.pallas import interpret_mode  # pylint: disable=g-import-not-at-top

  with interpret_mode():
    g, params, jaxpr = _remat_gradient(True, policy)
    got = _count_pallas_calls(jaxpr, "spmm")
    assert got == products, got
    if products == 4:
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6),
                   g(params), _gradient_saving_nothing())


def test_checkpoint_policies_save_what_jax_saves_on_a_dense_model():
  dots = lambda jaxpr: _count_eqns(jaxpr, lambda e: e.primitive.name == "dot_general")  # noqa: E731
  assert dots(_remat_gradient(False, jax.checkpoint_policies.nothing_saveable)[2]) == 7
  assert dots(_remat_gradient(False, _JAX_DOTS)[2]) == 6
  assert dots(_remat_gradient(False, _CP.dots_with_no_batch_dims_saveable)[2]) == 6
  assert dots(_remat_gradient(False, _CP.dots_saveable)[2]) == 6


def test_saving_products_rejects_a_non_policy():
  with pytest.raises(TypeError, match=r"saving_products: `policy` must be a jax.checkpoint"):
    _CP.saving_products("dots")
  # A factory of policies, not called (was accepted, then failed inside remat).
  with pytest.raises(TypeError, match=r"saving_products: `policy` is save_only_these_names,"
                                      r" which makes a policy; pass the policy it returns"):
    _CP.saving_products(jax.checkpoint_policies.save_only_these_names)


@pytest.mark.parametrize("policy, products", [
    (_JAX_DOTS, 5), (_CP.dots_with_no_batch_dims_saveable, 4)], ids=["jax-dots", "jsparse24"])
def test_checkpoint_policies_under_nnx_remat(policy, products):
  """The same policies under `nnx.remat` with `jsparse24.nnx.SparseLinear`:
  JAX's recomputes up's product in the backward pass, jsparse24's saves it."""
  from jsparse24.backends.pallas import interpret_mode  # pylint: disable=g-import-not-at-top

  class Mlp(nnx.Module):
    def __init__(self, rngs):
      self.up = jnnx.SparseLinear(64, 128, use_bias=False, implementation="pallas", rngs=rngs)
      self.down = jnnx.SparseLinear(128, 64, use_bias=False, implementation="pallas", rngs=rngs)

    def __call__(self, h):
      return h + self.down(jax.nn.gelu(self.up(h)))

  x = jax.random.normal(jax.random.key(1), (16, 64))

  @nnx.remat(policy=policy, prevent_cse=False)
  def forward(model, h):
    return model(h)

  with interpret_mode():
    graphdef, state = nnx.split(Mlp(nnx.Rngs(0)))
    grads = lambda st: nnx.state(nnx.grad(  # noqa: E731
        lambda m: jnp.sum(forward(m, x) ** 2))(nnx.merge(graphdef, st)))
    jaxpr = jax.make_jaxpr(lambda st: jax.tree.leaves(grads(st)))(state).jaxpr
  got = _count_pallas_calls(jaxpr, "spmm")
  assert got == products, got


def _layer_scores(params, sparsity) -> dict[tuple[str, int], float]:
  """`||w * (1 - mask)|| / ||w||` of every stacked layer, in numpy."""
  out = {}
  for name in ("up", "down"):
    for i, m in enumerate(_slices(sparsity["blocks"][name]["mask"])):
      w = np.asarray(params["blocks"][name]["kernel"][i], np.float64)
      out[name, i] = float(np.sqrt(np.sum((w * ~m) ** 2) / np.sum(w ** 2)))
  return out


def _with_eps(params, eps: dict[tuple[str, int], float]):
  """`params` with layer (name, i)'s pruned weights scaled by eps[name, i]
  (its 2:4 mask unchanged, removing less the smaller eps is)."""
  params = jax.tree.map(lambda a: a, params)
  for name in ("up", "down"):
    kernel = params["blocks"][name]["kernel"]
    layers = []
    for i in range(L):
      mask = jsparse24.prune_24(kernel[i], transposable=name == "down")
      layers.append(jnp.where(mask, kernel[i], eps.get((name, i), 1.0) * kernel[i]))
    params["blocks"][name]["kernel"] = jnp.stack(layers)
  return params


def test_ramp_on_a_stack_counts_each_layer_and_keeps_sparse_layers_sparse():
  """A stack of 3 blocks (6 stacked 2:4 layers) under a ramp with a rebuild
  every step (every layer rescored): each stacked layer is a layer of the
  count, the lowest scores go 2:4 first, per element of the stack; layers
  once 2:4 stay 2:4 when new weights make them the most sensitive, and the
  mixed stack computes what the layers do one by one."""
  schedule = optim.MaskSchedule(rebuild_every=1, ramp=optim.SparsityRamp(start=0, end=8))
  model, tx, params, x, _ = _setup(schedule, 0.0)
  grads = jax.tree.map(jnp.zeros_like, params)
  update = jax.jit(tx.update)

  def sparse_layers(state):
    masks = optim.masks(state)["blocks"]
    return {(name, i) for name in ("up", "down") for i in range(L)
            if bool(masks[name]["active"][i])}

  p0 = _with_eps(params, {("down", 2): 0.01, ("up", 1): 0.05, ("down", 0): 0.2})
  state = tx.init(p0)
  for _ in range(3):  # counts 0, 0, 1, 2
    _, state = update(grads, state, p0)
  scores = _layer_scores(p0, optim.masks(state))
  first = set(sorted(scores, key=scores.get)[:2])
  assert first == {("down", 2), ("up", 1)}  # not the tree's or the stack's order
  assert sparse_layers(state) == first
  stats = optim.stats(state)
  for name in ("up", "down"):
    np.testing.assert_allclose(stats[f"blocks/{name}"]["score"],
                               [scores[name, i] for i in range(L)], rtol=1e-5)
    np.testing.assert_array_equal(stats[f"blocks/{name}"]["sparsity"],
                                  [0.5 * ((name, i) in first) for i in range(L)])

  # The 2:4 layers become the most sensitive (plain random weights), the
  # dense ones nearly 2:4 in a new order.
  p1 = _with_eps(p0, {("up", 0): 0.3, ("up", 2): 0.02, ("down", 1): 0.01, ("down", 0): 0.1})
  p1["blocks"]["up"]["kernel"] = p1["blocks"]["up"]["kernel"].at[1].set(
      jax.random.normal(jax.random.key(5), (D, H)))
  p1["blocks"]["down"]["kernel"] = p1["blocks"]["down"]["kernel"].at[2].set(
      jax.random.normal(jax.random.key(6), (H, D)))
  for _ in range(2):  # counts 3, 4
    _, state = update(grads, state, p1)
  scores = _layer_scores(p1, optim.masks(state))
  assert set(sorted(scores, key=scores.get)[-2:]) == first  # now the most sensitive ...
  assert sparse_layers(state) == first | {("down", 1), ("up", 2)}  # ... and still 2:4
  masks = _stack_masks(optim.masks(state))
  active = sparse_layers(state)
  mixed = {name: [m if (name, i) in active else np.ones_like(m) for i, m in enumerate(masks[name])]
           for name in masks}
  np.testing.assert_allclose(
      jax.jit(model.apply)({"params": p1, "sparsity": optim.masks(state)}, x),
      _unrolled(p1["blocks"], mixed, x), **TOL)
  for _ in range(3):  # counts 5, 6, 6
    _, state = update(grads, state, p1)
  assert len(sparse_layers(state)) == 2 * L


def test_ramp_on_a_stack_resumes_bit_for_bit(tmp_path):
  schedule = optim.MaskSchedule(rebuild_every=2, ramp=optim.SparsityRamp(start=0, end=6))
  model, tx, params0, x, y = _setup(schedule, 1e-3)
  _, state = check_orbax_resume_bit_for_bit(tmp_path, model, tx, params0, x, y)
  assert [np.asarray(s["sparsity"]).tolist() for s in optim.stats(state).values()] == [
      [0.5] * L, [0.5] * L]
