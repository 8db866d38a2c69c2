"""The mask-update transform: schedules step by step, decay, state, pmap,
and Orbax checkpoint/resume bit for bit."""

import contextlib
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jsparse24
from jsparse24 import optim


class _Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = jsparse24.SparseDense(32, name="up", transposable=False)(x)
    x = jsparse24.SparseDense(8, name="down", transposable=True, gradient="masked")(nn.relu(x))
    return nn.Dense(1, name="head")(x)


def _setup(schedule, decay=0.0, lr=1e-2):
  model = _Net()
  x = jax.random.normal(jax.random.key(0), (16, 16))
  y = jax.random.normal(jax.random.key(1), (16, 1))
  variables = model.init(jax.random.key(2), x)
  tx = optax.chain(optim.mask_update(variables["sparsity"], schedule, decay=decay), optax.adam(lr))
  return model, tx, variables, x, y


def _loss(model, params, masks, x, y):
  return jnp.mean((model.apply({"params": params, "sparsity": masks}, x) - y) ** 2)


def _train_step(model, tx, x, y):
  """`(params, state) -> (params, state)`: one step on `_loss`, the masks
  from the state's flags."""
  def step(params, state):
    grads = jax.grad(_loss, argnums=1)(model, params, optim.masks(state), x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return step


def _mask_leaves(masks):
  return {"/".join(str(k.key) for k in path[:-1]): np.asarray(leaf.unpack())
          for path, leaf in jax.tree_util.tree_leaves_with_path(
              masks, is_leaf=lambda a: isinstance(a, jsparse24.Mask24))
          if isinstance(leaf, jsparse24.Mask24)}


@pytest.fixture
def flagged_rebuilds(monkeypatch):
  """The GPU's rebuild path on CPU: `backends.rebuild_where` takes the fused
  mask kernel (interpret mode) as it does where the kernel runs natively, so
  transposable masks are rebuilt without a conditional."""
  from jsparse24 import _pallas_runtime  # pylint: disable=g-import-not-at-top
  from jsparse24.backends.pallas import interpret_mode  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(_pallas_runtime, "runs_natively", lambda: True)
  with interpret_mode():
    yield


def _count_outside_kernels(jaxpr, primitive: str = "cond") -> int:
  """The `primitive` equations (`cond` by default) of a jaxpr and its
  sub-jaxprs, not counting those inside Pallas kernels (interpret mode
  traces their bodies, which branch per tile)."""
  from tests.test_pallas_kernels import sub_jaxprs  # pylint: disable=g-import-not-at-top
  count = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      continue
    count += eqn.primitive.name == primitive
    count += sum(_count_outside_kernels(sub, primitive) for sub in sub_jaxprs(eqn))
  return count


@pytest.mark.parametrize("kw,rebuilds,sparse", [
    (dict(warmup_steps=3, rebuild_every=4, freeze_after=12, dense_after=20),
     [3, 7, 11], list(range(3, 20))),
    (dict(), [], list(range(25))),                       # one-shot at init
    (dict(rebuild_every=5), [5, 10, 15, 20], list(range(25))),
    (dict(warmup_steps=6), [6], list(range(6, 25))),     # one-shot after warm-up
    (dict(rebuild_every=1, freeze_after=4), [1, 2, 3], list(range(25))),
])
def test_schedule_values(kw, rebuilds, sparse):
  s = optim.MaskSchedule(**kw)
  # A host step is answered on the host: a training loop's
  # `bool(schedule.sparse(i))` must not wait for the steps queued on the
  # device (a device-to-host transfer would).
  with jax.transfer_guard("disallow"):
    assert [i for i in range(25) if bool(s.rebuild(i))] == rebuilds
    assert [i for i in range(25) if bool(s.sparse(np.int64(i)))] == sparse
  # Traced steps agree with Python ints.
  traced = jax.jit(jax.vmap(lambda i: (s.rebuild(i), s.sparse(i))))(jnp.arange(25))
  assert [i for i in range(25) if bool(traced[0][i])] == rebuilds
  assert [i for i in range(25) if bool(traced[1][i])] == sparse


def test_schedule_rejects_bad_values():
  with pytest.raises(ValueError, match="rebuild_every"):
    optim.MaskSchedule(rebuild_every=0)
  with pytest.raises(ValueError, match="warmup_steps"):
    optim.MaskSchedule(warmup_steps=-1)
  with pytest.raises(ValueError, match="dense_after"):
    optim.MaskSchedule(warmup_steps=10, dense_after=5)


@pytest.mark.parametrize("kw", [
    dict(warmup_steps=2, rebuild_every=3, freeze_after=11, dense_after=14),
    dict(rebuild_every=2),
])
def test_masks_rebuilt_exactly_when_scheduled(kw):
  """Step by step: with random large updates the weight ranking reshuffles
  every step, so a rebuild always changes the mask; the masks must change
  exactly at the scheduled steps, equal prune_24 of the weights of the
  previous step, and the `active` flags must follow `sparse(step)`."""
  schedule = optim.MaskSchedule(**kw)
  _, tx, variables, _, _ = _setup(schedule, lr=1.0)
  tx = optax.chain(optim.mask_update(variables["sparsity"], schedule), optax.sgd(1.0))
  params = variables["params"]
  state = tx.init(params)
  update = jax.jit(tx.update)
  masks = _mask_leaves(optim.masks(state))
  for name, m in masks.items():
    kernel = params
    for key in name.split("/"):
      kernel = kernel[key]
    np.testing.assert_array_equal(m, jsparse24.prune_24(kernel["kernel"], transposable=name == "down"))
  for step in range(1, 18):
    grads = jax.tree.map(lambda p, k=step: jax.random.normal(jax.random.key(k), p.shape), params)
    updates, new_state = update(grads, state, params)
    new_masks = _mask_leaves(optim.masks(new_state))
    expected_rebuild = bool(schedule.rebuild(step))
    for name in masks:
      changed = not np.array_equal(masks[name], new_masks[name])
      assert changed == expected_rebuild, (step, name)
      if expected_rebuild:
        np.testing.assert_array_equal(
            new_masks[name],
            jsparse24.prune_24(params[name]["kernel"], transposable=name == "down"))
    actives = jax.tree.leaves({k: v["active"] for k, v in optim.masks(new_state).items()})
    assert all(bool(a) == bool(schedule.sparse(step)) for a in actives), step
    assert int(new_state[0].count) == step
    if expected_rebuild:
      assert int(new_state[0].last_rebuild) == step
      for name, layer in optim.stats(new_state).items():
        # The fraction of mask entries that changed at this rebuild, exactly.
        want = float(np.mean(masks[name] != new_masks[name]))
        assert want > 0
        np.testing.assert_allclose(float(layer["flip_rate"]), want, rtol=1e-6)
    params = optax.apply_updates(params, updates)
    state, masks = new_state, new_masks


def test_masked_decay_adds_to_pruned_kernel_gradients_only():
  lam = 0.25
  _, _, variables, _, _ = _setup(optim.MaskSchedule())
  tx = optim.mask_update(variables["sparsity"], optim.MaskSchedule(dense_after=2), decay=lam)
  params = variables["params"]
  state = tx.init(params)
  grads = jax.tree.map(jnp.zeros_like, params)
  for step in range(3):
    updates, new_state = tx.update(grads, state, params)
    for name in ("up", "down"):
      mask = optim.masks(state)[name]["mask"].unpack()
      w = params[name]["kernel"]
      want = lam * w * (~mask) if step < 2 else jnp.zeros_like(w)
      np.testing.assert_allclose(updates[name]["kernel"], want, rtol=1e-6)
      np.testing.assert_array_equal(updates[name]["bias"], 0)
    np.testing.assert_array_equal(updates["head"]["kernel"], 0)
    state = new_state
  with pytest.raises(ValueError, match="params"):
    tx.update(grads, state)


def test_decay_as_an_injected_hyperparameter_under_jit():
  """optax.inject_hyperparams passes `decay` as a traced array under jit (it
  failed: `decay != 0.0` on a tracer); the decay it adds is the one given."""
  _, _, variables, _, _ = _setup(optim.MaskSchedule())
  params = variables["params"]
  tx = optax.inject_hyperparams(optim.mask_update, static_args=("sparsity", "schedule"))(
      variables["sparsity"], optim.MaskSchedule(), decay=0.25)
  state = tx.init(params)
  grads = jax.tree.map(jnp.zeros_like, params)
  updates, state = jax.jit(tx.update)(grads, state, params)
  mask = optim.masks(state.inner_state)["up"]["mask"].unpack()
  np.testing.assert_allclose(updates["up"]["kernel"], 0.25 * params["up"]["kernel"] * (~mask),
                             rtol=1e-6)
  state.hyperparams["decay"] = jnp.asarray(0.0)
  updates, _ = jax.jit(tx.update)(grads, state, params)
  np.testing.assert_array_equal(updates["up"]["kernel"], 0)


@pytest.mark.parametrize("decay", ["0.1", None, [0.1], True, jnp.ones(3)])
def test_decay_of_a_wrong_type_is_refused_at_construction(decay):
  _, _, variables, _, _ = _setup(optim.MaskSchedule())
  with pytest.raises(TypeError, match="mask_update: `decay`"):
    optim.mask_update(variables["sparsity"], decay=decay)


@pytest.mark.parametrize("decay", [-1e-4, float("nan"), -1, float("inf"), np.float32(-1e-4),
                                   jnp.array(-1e-4), np.array(float("inf"))])
def test_a_negative_nan_or_infinite_decay_is_refused_at_construction(decay):
  """Was accepted: a negative decay pushes the pruned weights away from 0, an
  infinite one makes their updates infinite; scalar arrays of
  numpy and jax too, not only Python numbers."""
  _, _, variables, _, _ = _setup(optim.MaskSchedule())
  with pytest.raises(ValueError, match=r"mask_update: `decay` must be >= 0 and finite, got"):
    optim.mask_update(variables["sparsity"], decay=decay)
  with pytest.raises(ValueError, match=r"mask_update: `decay` must be >= 0"):
    optim.with_masks(optax.sgd(0.1), variables["sparsity"], decay=decay)


def test_masked_decay_keeps_frozendict_and_fuses():
  """Decay on FrozenDict params returns FrozenDict updates (apply_updates
  works), names a layer missing from the gradients, and expands the masks
  without a bool transpose (so XLA fuses the term into the optimizer)."""
  from flax.core import freeze  # pylint: disable=g-import-not-at-top
  from tests.test_sparse_dot import bool_transposes  # pylint: disable=g-import-not-at-top
  _, _, variables, _, _ = _setup(optim.MaskSchedule())
  params = freeze(variables["params"])
  tx = optax.chain(optim.mask_update(variables["sparsity"], decay=0.5), optax.sgd(1.0))
  state = tx.init(params)
  grads = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(grads, state, params)
  assert type(updates) is type(params)
  new = optax.apply_updates(params, updates)
  mask = optim.masks(state)["up"]["mask"].unpack()
  np.testing.assert_allclose(new["up"]["kernel"],
                             params["up"]["kernel"] * (1 - 0.5 * ~mask), rtol=1e-6)
  # The decay term alone: the update also holds the rebuild branch, whose
  # pattern search transposes bool masks on rebuild steps only.
  masks = optim.masks(state)
  assert bool_transposes(lambda g, p: optim._add_masked_decay(  # pylint: disable=protected-access
      g, p, masks, jnp.float32(0.5), jnp.bool_(True)), grads, params) == []
  missing = {k: v for k, v in variables["params"].items() if k != "down"}
  with pytest.raises(ValueError, match=r"mask_update: .*\['down'\]"):
    optim.mask_update(variables["sparsity"], decay=0.5).update(missing, state[0], missing)


@pytest.mark.parametrize("ramp", [None, optim.SparsityRamp(start=2, end=6)])
@pytest.mark.parametrize("decay", [0.0, 0.1])
def test_donated_train_step_copies_no_kernel(monkeypatch, decay, ramp):
  """A jitted train step that donates params and optimizer state (as training
  loops do) copies no sparse kernel: the optimizer's in-place write of the new
  params is ordered after the rebuild's read of the old ones (inside the
  conditional, and in the flagged kernel's path, `flagged_rebuilds`). Without
  that order XLA copied every kernel before each step. With a ramp, the
  scores' read of the kernels is ordered too.

  Both rebuild paths in one test: they share the reference, the step run op
  by op (the conditional path's; the two paths give the same bits,
  `test_flagged_rebuild_equals_the_conditional_one`), which costs more than
  compiling either step."""
  import re  # pylint: disable=g-import-not-at-top
  from jsparse24 import _pallas_runtime  # pylint: disable=g-import-not-at-top
  from jsparse24.backends.pallas import interpret_mode  # pylint: disable=g-import-not-at-top
  model, tx, variables, x, y = _setup(optim.MaskSchedule(rebuild_every=4, ramp=ramp),
                                      decay=decay)
  params = variables["params"]

  step = _train_step(model, tx, x, y)

  state = tx.init(params)
  # The order changes no value: each donating step equals the step op by op.
  with jax.disable_jit():
    expected, _ = step(params, state)
  for flagged in (False, True):
    with monkeypatch.context() as patch, contextlib.ExitStack() as stack:
      if flagged:  # as the `flagged_rebuilds` fixture does
        patch.setattr(_pallas_runtime, "runs_natively", lambda: True)
        stack.enter_context(interpret_mode())
      compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state).compile()
      hlo = compiled.as_text()
      entry = hlo[hlo.index("\nENTRY "):]
      numbers = {int(n): name for name, n in re.findall(r"%(\S+) = \S+ parameter\((\d+)\)", entry)}
      leaves = jax.tree_util.tree_leaves_with_path(params)
      kernels = {numbers[i] for i, (path, _) in enumerate(leaves)
                 if jax.tree_util.keystr(path) in ("['up']['kernel']", "['down']['kernel']")}
      assert len(kernels) == 2, flagged
      copied = set(re.findall(r"= \S+ copy\(%([^),]+)\)", entry))
      assert not kernels & copied, f"flagged={flagged}: kernels copied before the step: {kernels & copied}"
      # The program checked above, run (on copies: it consumes its inputs).
      new_params, _ = compiled(*jax.tree.map(jnp.copy, (params, state)))
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5), new_params, expected)


@pytest.mark.parametrize("ramp", [None, optim.SparsityRamp(start=1, end=3)])
def test_donated_step_returns_no_value_twice(ramp):
  """No value is returned at two places of a donating step: the layers'
  `active` flags (one value without a ramp) and their sparsity are each
  their own. On a GPU XLA writes a value returned at three or more donated
  places into only some of them (jax-ml/jax#39625): a GPT trained with a
  dense warm-up kept half its layers' flags False (`optim._apart`). And
  `init`, called outside `jit`, shares no array between two leaves, which
  a donating step refuses ("donate the same buffer twice")."""
  import re  # pylint: disable=g-import-not-at-top
  model, tx, variables, x, y = _setup(
      optim.MaskSchedule(warmup_steps=2, rebuild_every=4, ramp=ramp))
  params = variables["params"]

  step = _train_step(model, tx, x, y)

  state = tx.init(params)
  # What JAX hands XLA: the returned values of the program's main function.
  donating = jax.jit(step, donate_argnums=(0, 1))
  text = donating.lower(params, state).as_text()
  main = text[text.index("func.func public @main"):]
  main = main[:main.index("\n  }")]  # its body, to the brace that closes it
  returned = re.findall(r"\n\s*(?:stablehlo\.|func\.)?return (.*?) :", main)[-1]
  operands = [o.strip() for o in returned.split(",")]
  assert len(operands) == len(jax.tree.leaves((params, state))), returned
  twice = sorted({o for o in operands if operands.count(o) > 1})
  assert not twice, f"values returned twice: {twice}"
  for _ in range(3):
    params, state = donating(params, state)
  assert int(optim.masks(state)["up"]["active"]) == int(optim.masks(state)["down"]["active"]) == 1


@pytest.mark.parametrize("schedule,mask_rebuild", [
    (optim.MaskSchedule(rebuild_every=4), None),
    (optim.MaskSchedule(rebuild_every=4), False),
    (optim.MaskSchedule(warmup_steps=2, rebuild_every=4), False),
    (optim.MaskSchedule(rebuild_every=4, ramp=optim.SparsityRamp(start=1, end=3)), None),
    (optim.MaskSchedule(rebuild_every=4, ramp=optim.SparsityRamp(start=1, end=3)), False),
])
def test_donating_step_writes_the_state_in_place(schedule, mask_rebuild):
  """A jitted step that donates params and optimizer state writes every new
  leaf into the buffer of the old one: each leaf of mask_update's state is
  read by its update. A leaf written without being read is an input that
  `jax.jit` drops (`keep_unused=False`); its output then cannot alias the
  donated buffer and lands at a new address every step (so the per-layer
  sparsity is not a leaf: `stats` derives it from the flags)."""
  model, tx, variables, x, y = _setup(schedule, decay=0.1)
  params = variables["params"]

  def step(params, state):
    grads = jax.grad(_loss, argnums=1)(model, params, optim.masks(state), x, y)
    updates, state = tx.update(grads, state, params, mask_rebuild=mask_rebuild)
    return optax.apply_updates(params, updates), state

  def addresses(tree):
    return {jax.tree_util.keystr(path): leaf.unsafe_buffer_pointer()
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}

  donating = jax.jit(step, donate_argnums=(0, 1))
  state = donating(params, tx.init(params))  # the leaves' buffers from now on
  before = addresses(state)
  state = donating(*state)
  moved = sorted(path for path, address in addresses(state).items() if address != before[path])
  assert not moved, f"leaves written to new buffers: {moved}"


class _ScannedMixedNet(nn.Module):
  """Transposable layers stacked with nn.scan, and one plain-mask layer."""

  @nn.compact
  def __call__(self, x):
    class Block(nn.Module):
      @nn.compact
      def __call__(self, h, _):
        return jnp.tanh(jsparse24.SparseDense(16, transposable=True)(h)), None
    h = nn.scan(Block, variable_axes={"params": 0, "sparsity": 0},
                split_rngs={"params": True}, length=3)()(x, None)[0]
    return jsparse24.SparseDense(8, name="plain", transposable=False)(h)


@pytest.mark.parametrize("with_plain", [False, True])
def test_flagged_rebuild_has_no_conditional(flagged_rebuilds, with_plain):
  """Where the mask kernels take a run-time flag (a GPU), masks (transposable
  and plain) are rebuilt with no conditional in the step: on a GPU each one
  copies its predicate to the host and stalls the launch queue. Nor does the
  step count flips over the masks (`flip_fraction`'s popcount): the kernel
  counts them where it rebuilds."""
  del flagged_rebuilds
  model = _ScannedMixedNet() if with_plain else _ScannedNet()
  x = jax.random.normal(jax.random.key(0), (8, 16))
  # Shapes only: the jaxpr depends on the shapes and the state's structure,
  # not on the values, so nothing is compiled or run.
  variables = jax.eval_shape(model.init, jax.random.key(1), x)
  tx = optax.chain(optim.mask_update(variables["sparsity"], optim.MaskSchedule(rebuild_every=4),
                                     decay=1e-3), optax.sgd(0.1))
  state = jax.eval_shape(tx.init, variables["params"])

  def step(params, state):
    loss = lambda p: jnp.sum(model.apply({"params": p, "sparsity": optim.masks(state)}, x) ** 2)  # noqa: E731
    updates, state = tx.update(jax.grad(loss)(params), state, params)
    return optax.apply_updates(params, updates), state

  jaxpr = jax.make_jaxpr(step)(variables["params"], state)
  assert _count_outside_kernels(jaxpr.jaxpr) == 0
  assert _count_outside_kernels(jaxpr.jaxpr, "population_count") == 0


def test_flagged_rebuild_equals_the_conditional_one(request):
  """A stacked model (nn.scan) with transposable and plain masks, trained
  with rebuilds every 2 steps and large updates (masks change at every
  rebuild): the flagged kernel path gives the reference path's params,
  masks, flip rates and rebuild steps, bit for bit, as does the reference
  path built a second time (so a difference is the flagged path's). One
  reference run serves both comparisons."""

  def run():
    model = _ScannedMixedNet()
    x = jax.random.normal(jax.random.key(0), (8, 16))
    variables = model.init(jax.random.key(1), x)
    tx = optax.chain(optim.mask_update(variables["sparsity"],
                                       optim.MaskSchedule(rebuild_every=2), decay=1e-2),
                     optax.sgd(0.5))

    @jax.jit
    def step(params, state, key):
      noise = jax.tree.map(lambda p: jax.random.normal(key, p.shape), params)
      updates, state = tx.update(noise, state, params)
      return optax.apply_updates(params, updates), state

    params, state = variables["params"], tx.init(variables["params"])
    out = []
    for i in range(5):
      params, state = step(params, state, jax.random.key(10 + i))
      out.append(jax.device_get((params, optim.masks(state), optim.stats(state),
                                 state[0].last_rebuild)))
    return out

  ref = run()  # the reference masks inside lax.cond (this CPU's path)
  runs = {False: run()}
  request.getfixturevalue("flagged_rebuilds")
  runs[True] = run()
  for flagged, got in runs.items():
    flips = [float(s["plain"]["flip_rate"]) for _, _, s, _ in got]
    # Rebuilt at steps 2 and 4.
    assert flips[1] > 0 and flips[3] > 0 and flips[3] != flips[1], flagged
    for a, b in zip(ref, got):
      for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v), err_msg=f"flagged={flagged}")


@pytest.mark.parametrize("shape", [(16, 24), (12, 8), (3, 32, 16), (2, 20, 12)])
def test_flip_fraction_counts_changed_weights(shape):
  """From the packed codes, per mask of a stack: the fraction of weights
  whose kept/pruned state differs (K/4 odd: flat packing, a padding nibble)."""
  keys = jax.random.split(jax.random.key(sum(shape)), 2)

  @jax.jit  # one program, not one per operation
  def run(keys):
    a, b = (jsparse24.Mask24.from_weights(jax.random.normal(k, shape), transposable=True)
            for k in keys)
    return (optim.flip_fraction(a, b), jnp.mean(a.unpack() != b.unpack(), axis=(-2, -1)),
            optim.flip_fraction(a, a))

  got, want, same = run(keys)
  assert got.shape == shape[:-2] and got.dtype == jnp.float32
  assert float(jnp.min(want)) > 0
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(same), np.zeros(shape[:-2]))


def test_state_fields_and_lookup():
  _, tx, variables, _, _ = _setup(optim.MaskSchedule(warmup_steps=1))
  state = tx.init(variables["params"])
  inner = state[0]
  assert isinstance(inner, optim.MaskUpdateState)
  assert set(optim.stats(state)) == {"up", "down"}
  assert float(optim.stats(state)["up"]["sparsity"]) == 0.0  # warm-up: dense
  packed = [leaf for leaf in jax.tree.leaves(inner.masks) if leaf.dtype == jnp.uint8]
  assert sum(p.size for p in packed) * 8 <= 16 * 32 + 32 * 8
  with pytest.raises(ValueError, match="exactly one"):
    optim.masks(optax.adam(1e-3).init(variables["params"]))
  with pytest.raises(TypeError, match="sparsity"):
    optim.mask_update(variables["params"]["up"]["kernel"])


def _train(model, tx, params, state, x, y, steps):
  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(_loss, argnums=1)(model, params, optim.masks(state), x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for _ in range(steps):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  return params, state, losses


def test_training_reduces_loss_with_rebuilds():
  model, tx, variables, x, y = _setup(optim.MaskSchedule(warmup_steps=2, rebuild_every=5), decay=1e-4)
  _, state, losses = _train(model, tx, variables["params"], tx.init(variables["params"]), x, y, 30)
  assert losses[-1] < 0.5 * losses[0]
  assert int(state[0].last_rebuild) == 27


def check_orbax_resume_bit_for_bit(tmp_path, model, tx, params0, x, y):
  """6 steps straight against 3, an Orbax save/restore, then 3 more: the same
  losses, params and optimizer state bit for bit. Returns the 6-step
  (params, opt_state). Shared with the stacked-layer tests."""
  state0 = tx.init(params0)
  p_full, s_full, l_full = _train(model, tx, params0, state0, x, y, 6)
  p3, s3, l3 = _train(model, tx, params0, state0, x, y, 3)

  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "step3", {"params": p3, "opt_state": s3})
  ckpt.wait_until_finished()
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": p3, "opt_state": s3})
  restored = ckpt.restore(tmp_path / "step3", abstract)
  assert jax.tree.structure(restored) == jax.tree.structure(abstract)
  p_res, s_res, l_res = _train(model, tx, restored["params"], restored["opt_state"], x, y, 3)

  assert l3 + l_res == l_full
  for a, b in zip(jax.tree.leaves((p_res, s_res)), jax.tree.leaves((p_full, s_full))):
    np.testing.assert_array_equal(a, b)
  return p_full, s_full


def test_checkpoint_restore_resumes_bit_for_bit(tmp_path):
  model, tx, variables, x, y = _setup(optim.MaskSchedule(warmup_steps=1, rebuild_every=2), decay=1e-3)
  check_orbax_resume_bit_for_bit(tmp_path, model, tx, variables["params"], x, y)


def test_pmap_step_matches_single_device_step():
  n = jax.local_device_count()
  assert n == 8, "tests/conftest.py sets 8 fake CPU devices"
  model, tx, variables, x, y = _setup(optim.MaskSchedule(rebuild_every=2))
  params, state = variables["params"], tx.init(variables["params"])

  def grads_of(params, state, x, y):
    return jax.value_and_grad(_loss, argnums=1)(model, params, optim.masks(state), x, y)

  @jax.jit
  def single(params, state):
    loss, grads = grads_of(params, state, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  def per_device(params, state, xs, ys):
    loss, grads = grads_of(params, state, xs, ys)
    loss, grads = jax.lax.pmean((loss, grads), "d")
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  parallel = jax.pmap(per_device, axis_name="d")
  rep = lambda t: jax.tree.map(lambda a: jnp.broadcast_to(a, (n,) + a.shape), t)  # noqa: E731
  pp, ps = rep(params), rep(state)
  xs, ys = x.reshape(n, -1, x.shape[-1]), y.reshape(n, -1, 1)
  sp, ss = params, state
  for _ in range(5):
    sp, ss, sl = single(sp, ss)
    pp, ps, pl = parallel(pp, ps, xs, ys)
    np.testing.assert_allclose(np.asarray(pl), float(sl), rtol=1e-5)
    single_masks = _mask_leaves(optim.masks(ss))
    for d in range(n):
      device_masks = _mask_leaves(jax.tree.map(lambda a, d=d: a[d], optim.masks(ps)))
      for name in single_masks:
        np.testing.assert_array_equal(device_masks[name], single_masks[name])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a[0], b, rtol=1e-4, atol=1e-6), pp, sp)


def test_jitted_update_compiles_once():
  # init (Python step 0) and update (traced step) must give identically typed
  # states, or every train step compiles twice.
  _, tx, variables, _, _ = _setup(optim.MaskSchedule(warmup_steps=1, rebuild_every=2))
  params = variables["params"]
  update = jax.jit(tx.update)
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  for _ in range(3):
    _, state = update(grads, state, params)
  assert update._cache_size() == 1  # pylint: disable=protected-access


def test_multisteps_counts_optimizer_steps_not_micro_steps():
  """Gradient accumulation with optax.MultiSteps(k): mask_update runs once per
  k micro-steps, so its schedule counts optimizer steps (documented)."""
  schedule = optim.MaskSchedule(rebuild_every=2)
  model, _, variables, x, y = _setup(schedule)
  k = 3
  tx = optax.MultiSteps(optax.chain(optim.mask_update(variables["sparsity"], schedule),
                                    optax.adam(1e-2)), every_k_schedule=k)
  params, state = variables["params"], tx.init(variables["params"])
  step = jax.jit(lambda p, s: tx.update(jax.grad(lambda q: _loss(
      model, q, optim.masks(s), x, y))(p), s, p))
  for micro in range(1, 4 * k + 1):
    updates, state = step(params, state)
    params = optax.apply_updates(params, updates)
    assert int(state.inner_opt_state[0].count) == micro // k, micro
  assert int(state.inner_opt_state[0].last_rebuild) == 4  # optimizer step 4, micro-step 12


class _ScannedNet(nn.Module):
  """Blocks stacked with nn.scan, products on a custom_vjp backend (the
  GPU backends' structure; "pallas" in interpret mode here)."""

  @nn.compact
  def __call__(self, x):
    class Block(nn.Module):
      @nn.compact
      def __call__(self, h, _):
        return jsparse24.SparseDense(16, implementation="pallas")(h), None
    return nn.scan(Block, variable_axes={"params": 0, "sparsity": 0},
                   split_rngs={"params": True}, length=3)()(x, None)[0]


@pytest.mark.parametrize("schedule,layer_conds", [
    (optim.MaskSchedule(rebuild_every=4), False),
    (optim.MaskSchedule(), False),
    (optim.MaskSchedule(warmup_steps=2, rebuild_every=4), True),
    (optim.MaskSchedule(rebuild_every=4, dense_after=8), True)])
def test_always_sparse_schedule_compiles_no_conditional_per_product(schedule, layer_conds):
  """With no dense phase in the schedule the layers get `active=None`, so the
  train step has no conditional around each product (on a GPU each one
  copies its predicate to the host and stalls the launch queue); a schedule
  with dense phases keeps them, and the rebuild's conditional stays."""
  from jsparse24.backends.pallas import interpret_mode  # pylint: disable=g-import-not-at-top
  model = _ScannedNet()
  x = jax.random.normal(jax.random.key(0), (8, 16))
  with interpret_mode():
    variables = model.init(jax.random.key(1), x)
  tx = optax.chain(optim.mask_update(variables["sparsity"], schedule, decay=1e-3),
                   optax.sgd(0.1))
  state = tx.init(variables["params"])
  assert all((layer["active"] is None) == schedule.always_sparse
             for layer in jsparse24.linen.layers_by_path(optim.masks(state)).values())

  def step(params, state):
    loss = lambda p: jnp.sum(model.apply({"params": p, "sparsity": optim.masks(state)}, x) ** 2)  # noqa: E731
    updates, state = tx.update(jax.grad(loss)(params), state, params)
    return optax.apply_updates(params, updates), state

  with interpret_mode():
    jaxpr = str(jax.make_jaxpr(step)(variables["params"], state))
    params, state = jax.jit(step)(variables["params"], state)  # runs, and keeps its structure
    jax.jit(step)(params, state)
  conds = jaxpr.count(" cond[")
  if layer_conds:
    assert conds > 1, conds  # the rebuild's, and the layers' forward/backward switches
  else:
    assert conds == 1, conds  # the rebuild's only


def test_masks_with_a_static_phase_drop_the_run_time_switch():
  """With a warm-up the state's flags are run-time values (a conditional per
  product); `masks(state, sparse=phase)` with the host's phase removes them
  and computes the same step."""
  from jsparse24.backends.pallas import interpret_mode  # pylint: disable=g-import-not-at-top
  model = _ScannedNet()
  x = jax.random.normal(jax.random.key(0), (8, 16))
  schedule = optim.MaskSchedule(warmup_steps=2, rebuild_every=4)
  with interpret_mode():
    variables = model.init(jax.random.key(1), x)
  tx = optax.chain(optim.mask_update(variables["sparsity"], schedule, decay=1e-3),
                   optax.sgd(0.1))

  def step(params, state, sparse):
    loss = lambda p: jnp.sum(model.apply(  # noqa: E731
        {"params": p, "sparsity": optim.masks(state, sparse)}, x) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  params, state = variables["params"], tx.init(variables["params"])
  with interpret_mode():
    for i in range(4):  # dense, dense, sparse, sparse
      phase = bool(schedule.sparse(i))
      assert phase == (i >= 2)
      conds = {p: jax.jit(step, static_argnums=2).lower(params, state, p).compile()
               .as_text().count(" conditional(") for p in (None, phase)}
      # Only the rebuild's conditional is left (False: STATIC_DENSE, the
      # dense product with no switch in the forward or backward pass).
      assert conds == {None: 3, phase: 1}, conds
      new = jax.jit(step, static_argnums=2)(params, state, phase)
      ref = jax.jit(step, static_argnums=2)(params, state, None)
      jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-6),
                   (new[0], new[2]), (ref[0], ref[2]))
      params, state = new[0], new[1]
  with pytest.raises(TypeError, match="masks: `sparse` must be None, a Python bool"):
    optim.masks(state, jnp.array(True))


# --- gradual sparsity (SparsityRamp) -------------------------------------------


def test_ramp_share_and_count_follow_the_cosine():
  ramp = optim.SparsityRamp(start=2, end=10, initial=0.25, target=1.0)
  steps = np.arange(14)
  t = np.clip((steps - 2) / 8, 0, 1)
  want_share = 0.25 + 0.75 * (1 - np.cos(np.pi * t)) / 2
  with jax.transfer_guard("disallow"):  # host steps answered on the host
    share = np.array([float(ramp.share(int(i))) for i in steps])
    counts = {n: [int(ramp.count(int(i), n)) for i in steps] for n in (1, 3, 7, 48)}
  np.testing.assert_allclose(share, want_share, rtol=1e-6)
  assert share[2] == 0.25 and share[10] == 1.0 and share[6] == 0.625  # ends, mid-point
  for n, c in counts.items():
    np.testing.assert_array_equal(c, np.floor(want_share * n + 0.5))
    assert c[0] == round(0.25 * n) and c[-1] == n  # reaches the target: every layer
    assert all(a <= b for a, b in zip(c, c[1:]))  # monotone
  assert counts[7] == [2, 2, 2, 2, 3, 3, 4, 5, 6, 7, 7, 7, 7, 7]
  # Traced steps compare with the host's first step of each count: the same
  # counts, exactly.
  traced = jax.jit(jax.vmap(lambda i: ramp.count(i, 7)))(jnp.arange(-3, 20))
  np.testing.assert_array_equal(traced, [2] * 3 + counts[7] + [7] * 6)
  half = optim.SparsityRamp(start=0, end=4, target=0.5)
  assert [int(half.count(i, 6)) for i in range(6)] == [0, 0, 2, 3, 3, 3]


def test_a_traced_ramp_count_holds_a_number_per_layer_however_long_the_ramp():
  """A traced step's count reads `layers` + 1 numbers at most: a table of
  every step's count put `end - start + 1` of them in the program (10**6
  here; 5 GB and 9 s for a ramp of 10**8 steps). The counts are still the
  host's, at every step where one changes and around it."""
  ramp = optim.SparsityRamp(start=1_000, end=1_001_000, initial=0.1, target=0.9)
  closed = jax.make_jaxpr(lambda i: ramp.count(i, 12))(0)
  sizes = [np.size(c) for c in closed.consts] + [
      v.aval.size for e in closed.jaxpr.eqns for v in e.invars if hasattr(v, "val")]
  assert max(sizes, default=0) <= 13, sizes
  host = np.array([ramp.count(int(i), 12) for i in range(0, 1_002_000, 997)])
  changes = [0, 999, 1_000, 1_001, 1_000_999, 1_001_000, 1_001_001]
  for first in ramp._first_steps(12)[1]:
    changes += [int(first) - 1, int(first)]
  steps = np.concatenate([np.arange(0, 1_002_000, 997), changes])
  want = np.array([ramp.count(int(i), 12) for i in steps])
  traced = jax.jit(jax.vmap(lambda i: ramp.count(i, 12)))(jnp.asarray(steps))
  np.testing.assert_array_equal(traced, want)
  assert host[0] == 1 and host[-1] == 11 and np.all(np.diff(host) >= 0)


def test_schedule_phase_with_a_ramp():
  """`phase` is the static phase for `masks(opt_state, sparse=...)`: False
  where no layer is 2:4, True where all are, None while the ramp mixes."""
  ramp = optim.SparsityRamp(start=4, end=8)
  s = optim.MaskSchedule(warmup_steps=2, dense_after=12, ramp=ramp)
  assert [s.phase(i) for i in range(14)] == [False] * 5 + [None] * 3 + [True] * 4 + [False] * 2
  assert not s.always_sparse
  assert [optim.MaskSchedule(warmup_steps=2).phase(i) for i in range(4)] == [False, False, True, True]
  partial = optim.MaskSchedule(ramp=optim.SparsityRamp(start=0, end=2, initial=0.5, target=0.5))
  assert [partial.phase(i) for i in range(3)] == [None] * 3
  with pytest.raises(TypeError, match="MaskSchedule.phase: `step` must be a host int"):
    s.phase(jnp.int32(3))


@pytest.mark.parametrize("kw,match", [
    (dict(start=5, end=5), "start < end"), (dict(start=-1, end=5), "start < end"),
    (dict(start=0, end=5, initial=0.6, target=0.5), "initial <= target"),
    (dict(start=0, end=5, target=1.5), "initial <= target"),
    (dict(start=0, end=5, target=0.0), r"target > 0 .* with target 0 no layer is ever 2:4"),
])
def test_ramp_rejects_bad_values(kw, match):
  with pytest.raises(ValueError, match=match):
    optim.SparsityRamp(**kw)
  with pytest.raises(TypeError, match="SparsityRamp: end must be an int"):
    optim.SparsityRamp(start=0, end=5.0)
  with pytest.raises(TypeError, match="MaskSchedule: ramp must be a SparsityRamp"):
    optim.MaskSchedule(ramp=(0, 5))
  # Counts of layers (were truncated, or negative counts came back).
  with pytest.raises(ValueError, match=r"SparsityRamp.count: `layers` must be an int >= 0"):
    optim.SparsityRamp(0, 5).count(3, 4.5)
  with pytest.raises(ValueError, match=r"MaskSchedule.sparse_count: `layers` must be an int >= 0"):
    optim.MaskSchedule().sparse_count(3, -2)


def near_24(w, transposable: bool, eps: float = 1e-3):
  """`w` with the weights that its 2:4 mask prunes scaled by `eps`: its mask
  stays the same and removes almost nothing (a score near `eps`)."""
  mask = jsparse24.prune_24(w, transposable=transposable)
  return jnp.where(mask, w, eps * w)


def _score(kernel, mask) -> np.ndarray:
  """`||w * (1 - mask)|| / ||w||` per layer of a stack, in numpy."""
  w = np.asarray(kernel, np.float64)
  m = np.asarray(mask.unpack())
  return np.sqrt(np.sum((w * ~m) ** 2, axis=(-2, -1)) / np.sum(w ** 2, axis=(-2, -1)))


@pytest.mark.parametrize("first", ["up", "down"])
def test_ramp_sparsifies_the_layer_whose_mask_removes_least_first(first):
  """Of the two layers, the one built to be nearly 2:4 goes 2:4 when the
  ramp's count reaches 1, whichever it is (not the tree's order); the other
  when it reaches 2. Scores are the removed share of the norm."""
  ramp = optim.SparsityRamp(start=0, end=4)  # 2 layers: counts 0, 0, 1, 2, 2
  schedule = optim.MaskSchedule(ramp=ramp)
  _, _, variables, _, _ = _setup(schedule)
  params = jax.tree.map(lambda a: a, variables["params"])
  params[first]["kernel"] = near_24(params[first]["kernel"], transposable=first == "down")
  tx = optim.mask_update(variables["sparsity"], schedule)
  state = tx.init(params)
  grads = jax.tree.map(jnp.zeros_like, params)
  other = {"up": "down", "down": "up"}[first]
  seen = []
  for step in range(5):
    stats = optim.stats(state)
    for name in ("up", "down"):
      np.testing.assert_allclose(float(stats[name]["score"]),
                                 _score(params[name]["kernel"], optim.masks(state)[name]["mask"]),
                                 rtol=1e-5)
    assert float(stats[first]["score"]) < 2e-3 < 0.2 < float(stats[other]["score"])
    seen.append(sorted(n for n in ("up", "down") if bool(optim.masks(state)[n]["active"])))
    assert [float(stats[n]["sparsity"]) for n in seen[-1]] == [0.5] * len(seen[-1])
    _, state = jax.jit(tx.update)(grads, state, params)
  assert seen == [[], [], [first], ["down", "up"], ["down", "up"]]


def test_ramp_keeps_sparse_layers_sparse_and_reorders_dense_ones_at_rebuilds():
  """A layer once 2:4 stays 2:4 when its weights later make it the most
  sensitive; the order of the dense layers follows their latest scores. At a
  step where a layer enters 2:4 (no scheduled rebuild), the dense layers'
  masks are rebuilt from the current weights and the 2:4 layers' are kept;
  at a scheduled rebuild every mask is."""
  ramp = optim.SparsityRamp(start=0, end=2)  # 2 layers: counts 0, 1, 2
  schedule = optim.MaskSchedule(rebuild_every=3, ramp=ramp)
  _, _, variables, _, _ = _setup(schedule)
  base = variables["params"]

  def with_easy(name, scale=1.0):
    p = jax.tree.map(lambda a: a * scale, base)
    p[name]["kernel"] = near_24(p[name]["kernel"], transposable=name == "down")
    return p

  tx = optim.mask_update(variables["sparsity"], schedule)
  update = jax.jit(tx.update)
  grads = jax.tree.map(jnp.zeros_like, base)
  state = tx.init(with_easy("up"))  # at init "up" would go first ...
  # ... but before the step where the count reaches 1, "down" is the easy one.
  params = with_easy("down", scale=-1.5)
  _, state = update(grads, state, params)
  masks = optim.masks(state)
  assert bool(masks["down"]["active"]) and not bool(masks["up"]["active"])
  for name in ("up", "down"):  # both rebuilt: both were dense
    np.testing.assert_array_equal(masks[name]["mask"].unpack(), jsparse24.prune_24(
        params[name]["kernel"], transposable=name == "down"))
  # "down" is now the sensitive one; it stays 2:4 and its mask is kept while
  # "up" enters with a mask of the current weights.
  held_down = masks["down"]["mask"].unpack()
  params = with_easy("up", scale=0.5)
  params["down"]["kernel"] = jax.random.normal(jax.random.key(9), params["down"]["kernel"].shape)
  _, state = update(grads, state, params)
  masks = optim.masks(state)
  assert bool(masks["down"]["active"]) and bool(masks["up"]["active"])
  np.testing.assert_array_equal(masks["down"]["mask"].unpack(), held_down)
  np.testing.assert_array_equal(masks["up"]["mask"].unpack(),
                                jsparse24.prune_24(params["up"]["kernel"]))
  assert float(optim.stats(state)["down"]["score"]) < 2e-3  # its score of step 1, kept
  assert int(state.last_rebuild) == 2
  _, state = update(grads, state, params)  # step 3: the scheduled rebuild, every mask
  masks = optim.masks(state)
  assert bool(masks["down"]["active"]) and bool(masks["up"]["active"])
  np.testing.assert_array_equal(masks["down"]["mask"].unpack(), jsparse24.prune_24(
      params["down"]["kernel"], transposable=True))
  assert float(optim.stats(state)["down"]["score"]) > 0.2  # rescored at the rebuild
  assert int(state.last_rebuild) == 3


def test_ramp_training_step_compiles_once_and_the_static_phase_agrees():
  """init and update give identically typed states (one compilation), and
  after the ramp `masks(state, sparse=schedule.phase(i))` computes what the
  run-time flags compute."""
  ramp = optim.SparsityRamp(start=1, end=4)
  schedule = optim.MaskSchedule(rebuild_every=2, ramp=ramp)
  model, tx, variables, x, y = _setup(schedule, decay=1e-3)

  @functools.partial(jax.jit, static_argnums=2)
  def step(params, state, sparse):
    loss, grads = jax.value_and_grad(_loss, argnums=1)(
        model, params, optim.masks(state, sparse), x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  params, state = variables["params"], tx.init(variables["params"])
  for i in range(6):
    phase = schedule.phase(i)
    new = step(params, state, phase)
    if phase is not None:
      ref = step(params, state, None)
      for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    params, state = new[0], new[1]
  assert step._cache_size() == 3  # pylint: disable=protected-access  # None, False, True
  assert [float(s["sparsity"]) for s in optim.stats(state).values()] == [0.5, 0.5]


def test_ramp_checkpoint_restore_resumes_bit_for_bit(tmp_path):
  """Through the ramp (layers entering 2:4 at steps 2 and 4, a rebuild at
  3): 6 steps straight equal 3, an Orbax save/restore, and 3 more."""
  schedule = optim.MaskSchedule(rebuild_every=3, ramp=optim.SparsityRamp(start=1, end=5))
  model, tx, variables, x, y = _setup(schedule, decay=1e-3)
  _, state = check_orbax_resume_bit_for_bit(tmp_path, model, tx, variables["params"], x, y)
  assert [float(s["sparsity"]) for s in optim.stats(state).values()] == [0.5, 0.5]


# --- static sets of 2:4 layers (masks(opt_state, sparse=frozenset)) --------------


class _MixedNet(nn.Module):
  """Two single layers and a stack of two (nn.scan), on a custom_vjp backend
  ("pallas" in interpret mode): four 2:4 layers for a ramp, one of them
  with the masked gradient."""

  @nn.compact
  def __call__(self, x):
    x = jsparse24.SparseDense(16, name="a", implementation="pallas")(x)
    x = jsparse24.SparseDense(16, name="b", implementation="pallas", gradient="masked")(
        nn.relu(x))

    class Block(nn.Module):
      @nn.compact
      def __call__(self, h, _):
        return jsparse24.SparseDense(16, implementation="pallas")(nn.relu(h)), None
    return nn.scan(Block, variable_axes={"params": 0, "sparsity": 0},
                   split_rngs={"params": True}, length=2)(name="stack")(x, None)[0]


def test_static_layer_set_computes_what_the_flags_do_with_no_conditional():
  """Through a ramp over 4 layers (a stack of 2 among them), at each step
  `masks(state, sparse=sparse_layers(state))` gives the loss and gradients
  of the state's run-time flags, and the gradient's jaxpr has no `cond`
  where no stack is partly 2:4 (the run-time flags have a forward and a
  backward one per product); a partly 2:4 stack keeps its own, fewer."""
  from jsparse24.backends.pallas import interpret_mode  # pylint: disable=g-import-not-at-top
  model = _MixedNet()
  x = jax.random.normal(jax.random.key(0), (8, 16))
  schedule = optim.MaskSchedule(warmup_steps=1, rebuild_every=3,
                                ramp=optim.SparsityRamp(start=1, end=6))
  with interpret_mode():
    variables = model.init(jax.random.key(1), x)
  tx = optax.chain(optim.mask_update(variables["sparsity"], schedule, decay=1e-3),
                   optax.sgd(0.1))
  names = optim.layer_names(tx.init(variables["params"]))
  assert names == ("a", "b", "stack/SparseDense_0[0]", "stack/SparseDense_0[1]")
  stacked = variables["params"]["stack"]["SparseDense_0"]["kernel"]
  params = {**variables["params"], "stack": {"SparseDense_0": {
      **variables["params"]["stack"]["SparseDense_0"],
      "kernel": stacked.at[0].set(near_24(stacked[0], transposable=True))}}}

  def loss(params, masks):
    return jnp.sum(model.apply({"params": params, "sparsity": masks}, x) ** 2)

  @jax.jit
  def advance(params, state):
    updates, state = tx.update(jax.grad(loss)(params, optim.masks(state)), state, params)
    return optax.apply_updates(params, updates), state

  grad = jax.value_and_grad(loss)
  static = jax.jit(lambda p, s, sparse: grad(p, optim.masks(s, sparse)), static_argnums=2)
  # One program for the run-time flags' gradient, built once for all steps.
  runtime = jax.jit(lambda p, s: grad(p, optim.masks(s)))
  # The jaxpr's conditionals depend on the static set only (`held`), not on
  # the values: traced once per set (4 sets over the 8 steps).
  conds_of = {}
  state = tx.init(params)
  seen = []
  with interpret_mode():
    runtime_conds = _count_outside_kernels(
        jax.make_jaxpr(lambda p, s: grad(p, optim.masks(s)))(params, state).jaxpr)
    # A forward and a backward conditional per product (the stack's body once).
    assert runtime_conds == 6, runtime_conds
    for step in range(8):
      held = optim.sparse_layers(state)
      assert len(held) == schedule.sparse_count(step, len(names))
      seen.append(held)
      ref = runtime(params, state)
      got = static(params, state, held)
      jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-6),
                   got, ref)
      if held not in conds_of:
        conds_of[held] = _count_outside_kernels(jax.make_jaxpr(
            lambda p, s, held=held: grad(p, optim.masks(s, held)))(params, state).jaxpr)
      conds = conds_of[held]
      stack = {n for n in held if n.startswith("stack/")}
      if len(stack) == 1:  # the stack is partly 2:4: its products keep their flags
        assert conds == 2, (held, conds)
      else:
        assert conds == 0, (held, conds)
      params, state = advance(params, state)
  assert [len(s) for s in seen] == [0, 0, 0, 1, 3, 4, 4, 4]
  assert seen[3] == {"stack/SparseDense_0[0]"}  # nearly 2:4: first, the stack partly 2:4
  assert all(a <= b for a, b in zip(seen, seen[1:]))  # layers never leave while sparse


def test_static_layer_set_names_and_refusals():
  """`masks(state, sparse=frozenset)`: whole stacks take None or
  STATIC_DENSE (no leaves, so jit and nn.scan pass them as static data), a
  partly 2:4 stack its constant flags; unknown names and other containers
  are refused."""
  model = _ScannedNet()
  x = jnp.ones((8, 16))
  from jsparse24.backends.pallas import interpret_mode  # pylint: disable=g-import-not-at-top
  with interpret_mode():
    variables = model.init(jax.random.key(1), x)
  tx = optim.mask_update(variables["sparsity"], optim.MaskSchedule(warmup_steps=2))
  state = tx.init(variables["params"])
  names = optim.layer_names(state)
  assert names == tuple(f"ScanBlock_0/SparseDense_0[{i}]" for i in range(3))
  assert optim.sparse_layers(state) == frozenset()  # the warm-up
  active = lambda sparse: optim.masks(state, sparse)["ScanBlock_0"]["SparseDense_0"]["active"]  # noqa: E731
  assert active(frozenset(names)) is None
  assert active(frozenset()) is jsparse24.linen.STATIC_DENSE
  assert active(False) is jsparse24.linen.STATIC_DENSE
  np.testing.assert_array_equal(active(frozenset(names[1:2])), [False, True, False])
  assert not jax.tree.leaves(jsparse24.linen.STATIC_DENSE)
  with pytest.raises(ValueError, match=r"masks: `sparse` names layers the model does not have:"
                                       r" \['ScanBlock_0/SparseDense_0'\].*layer_names"):
    optim.masks(state, frozenset({"ScanBlock_0/SparseDense_0"}))
  with pytest.raises(TypeError, match="masks: `sparse` must be None, a Python bool .* or a"
                                      " frozenset"):
    optim.masks(state, set(names))
  with pytest.raises(TypeError, match="MaskSchedule.changes: `step` must be a host int"):
    optim.MaskSchedule().changes(jnp.int32(3), 3)
  with pytest.raises(TypeError, match="sparse_layers: the state's 'active' flags are traced"):
    jax.jit(optim.sparse_layers)(state)


@pytest.mark.parametrize("schedule", [
    optim.MaskSchedule(warmup_steps=2, rebuild_every=4, dense_after=14,
                       ramp=optim.SparsityRamp(start=3, end=11)),
    optim.MaskSchedule(rebuild_every=3, ramp=optim.SparsityRamp(start=0, end=6, initial=0.2)),
    optim.MaskSchedule(warmup_steps=3, dense_after=6)])
def test_host_count_of_sparse_layers_matches_the_device_flags(schedule):
  """`schedule.sparse_count(step, n)` on the host is the number of 2:4 flags
  that `mask_update` holds at each step (5 stacked layers), and
  `schedule.changes(step, n)` is True exactly where the set changes."""

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
          return jsparse24.SparseDense(8)(h), None
      return nn.scan(Block, variable_axes={"params": 0, "sparsity": 0},
                     split_rngs={"params": True}, length=5)()(x, None)[0]

  variables = Stack().init(jax.random.key(0), jnp.ones((2, 8)))
  tx = optim.mask_update(variables["sparsity"], schedule)
  params = variables["params"]
  grads = jax.tree.map(jnp.zeros_like, params)
  state = tx.init(params)
  update = jax.jit(tx.update)
  n = len(optim.layer_names(state))
  assert n == 5
  previous = None
  for step in range(16):
    held = optim.sparse_layers(state)
    flags = int(np.sum(state.masks["ScanBlock_0"]["SparseDense_0"]["active"]))
    assert len(held) == flags == int(schedule.sparse_count(step, n)), step
    assert schedule.changes(step, n) == (held != previous), step
    previous = held
    params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(step), p.shape),
                          params)  # new weights, so that rebuilds and scores move
    _, state = update(grads, state, params)
  traced = jax.jit(jax.vmap(lambda i: schedule.sparse_count(i, n)))(jnp.arange(16))
  np.testing.assert_array_equal(traced, [schedule.sparse_count(i, n) for i in range(16)])


def test_host_known_phase_adds_the_decay_to_the_2_4_layers_only():
  """`update(..., sparse=...)`, the static phase that `masks` takes: at every
  step of a ramp the same updates and state as the run-time flags; a layer
  dense this step gets no term at all (its update is the gradient itself
  in the jaxpr), and with `mask_rebuild=False` no ordering select either."""
  schedule = optim.MaskSchedule(warmup_steps=2, rebuild_every=3, freeze_after=10,
                                ramp=optim.SparsityRamp(start=2, end=8))
  _, _, variables, _, _ = _setup(schedule)
  tx = optim.mask_update(variables["sparsity"], schedule, decay=1e-2)
  params = variables["params"]
  state = tx.init(params)
  names = optim.layer_names(state)
  assert len(names) == 2
  update = jax.jit(tx.update, static_argnames=("mask_rebuild", "sparse"))
  phases = []
  for step in range(12):
    leaves, tree = jax.tree.flatten(params)
    grads = tree.unflatten([jax.random.normal(jax.random.key(100 * step + i), a.shape)
                            for i, a in enumerate(leaves)])
    phase = schedule.phase(step)
    if phase is None:
      phase = optim.sparse_layers(state)
    host = schedule.update_rebuilds(step, len(names))
    ref_updates, ref = update(grads, state, params)
    updates, state = update(grads, state, params, mask_rebuild=host, sparse=phase)
    for a, b in zip(jax.tree.leaves((updates, state)), jax.tree.leaves((ref_updates, ref))):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)
    phases.append(phase if isinstance(phase, bool) else len(phase))
    params = optax.apply_updates(params, jax.tree.map(lambda u: -0.1 * u, updates))
  assert phases[:3] == [False] * 3 and 1 in phases and phases[-1] is True, phases

  def passed_through(sparse):
    """Which gradient leaves come out of the update as they went in."""
    jaxpr = jax.make_jaxpr(functools.partial(tx.update, mask_rebuild=False, sparse=sparse))(
        grads, state, params).jaxpr
    n = len(jax.tree.leaves(grads))
    return [o is i for o, i in zip(jaxpr.outvars[:n], jaxpr.invars[:n])]

  kernels = [i for i, (path, _) in enumerate(jax.tree_util.tree_leaves_with_path(grads))
             if path[-1].key == "kernel" and "/".join(k.key for k in path[:-1]) in names]
  assert len(kernels) == 2
  assert all(passed_through(False))
  one = passed_through(frozenset(names[:1]))
  assert sorted(one[i] for i in kernels) == [False, True] and sum(one) == len(one) - 1
  assert not any(passed_through(True)[i] for i in kernels)
  with pytest.raises(TypeError, match="mask_update: `sparse` must be None, a Python bool"):
    tx.update(grads, state, params, sparse=jnp.array(True))
  with pytest.raises(ValueError, match="mask_update: `sparse` names layers the model does not"):
    tx.update(grads, state, params, sparse=frozenset({"no/such/layer"}))


@pytest.mark.parametrize("schedule", [
    optim.MaskSchedule(warmup_steps=2, rebuild_every=3, freeze_after=10,
                       ramp=optim.SparsityRamp(start=2, end=8)),
    optim.MaskSchedule(warmup_steps=2, rebuild_every=4, dense_after=9)])
def test_host_known_rebuilds_leave_the_conditionals_out(schedule):
  """`schedule.update_rebuilds(step, n)` on the host says which updates
  rebuild masks (`last_rebuild` moves exactly there); passed as the static
  `mask_update(...).update(..., mask_rebuild=...)`, the update has no
  conditional (the run-time flag has the rebuild's, and with a ramp the
  scores') and computes the same state."""
  model, tx, variables, x, y = _setup(schedule, decay=1e-3)
  params, state = variables["params"], tx.init(variables["params"])
  n = len(optim.layer_names(state))
  update = jax.jit(tx.update, static_argnames="mask_rebuild")
  grads_of = jax.jit(jax.grad(lambda p, s: _loss(model, p, optim.masks(s), x, y)))
  conds = lambda **kw: str(jax.make_jaxpr(functools.partial(tx.update, **kw))(  # noqa: E731
      grads_of(params, state), state, params)).count(" cond[")
  assert conds() == (2 if schedule.ramp is not None else 1)
  assert conds(mask_rebuild=True) == conds(mask_rebuild=False) == 0
  rebuilt = []
  for step in range(12):
    grads = grads_of(params, state)
    host = schedule.update_rebuilds(step, n)
    ref_updates, ref = update(grads, state, params)
    updates, state = update(grads, state, params, mask_rebuild=host)
    # The same masks; values to the rounding of a differently fused decay term.
    for a, b in zip(jax.tree.leaves((updates, state)), jax.tree.leaves((ref_updates, ref))):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)
    assert (int(state[0].last_rebuild) == step + 1) == host, step
    rebuilt += [step + 1] * host
    params = optax.apply_updates(params, updates)
  if schedule.ramp is None:
    assert rebuilt == [2, 6]  # the end of the warm-up, then every 4 (none after dense_after)
  else:
    assert {2, 5} <= set(rebuilt) and 11 not in rebuilt, rebuilt  # and where the count grows
  with pytest.raises(TypeError, match="mask_update: `mask_rebuild` must be None or a Python"):
    tx.update(grads, state, params, mask_rebuild=jnp.array(True))


@pytest.mark.parametrize("kw,match", [
    (dict(warmup_steps=4, dense_after=4), r"dense_after=4 is where the dense warm-up ends .* no"
                                          r" step would be 2:4"),
    (dict(dense_after=0), r"dense_after=0 is where the dense warm-up ends"),
    (dict(warmup_steps=1000, ramp=optim.SparsityRamp(0, 800)),
     r"the ramp ends at step 800, within the dense warm-up \(warmup_steps=1000\): its layers"
     r" would all go 2:4 at once at step 1000"),
    (dict(dense_after=10, ramp=optim.SparsityRamp(10, 20)),
     r"the ramp starts at step 10, in the dense tail \(dense_after=10\)"),
])
def test_a_schedule_whose_fields_cancel_out_is_refused(kw, match):
  """Were accepted: runs that are never 2:4, or whose ramp is hidden by the
  warm-up (every layer 2:4 at once where it ends) or the dense tail."""
  with pytest.raises(ValueError, match="MaskSchedule: " + match):
    optim.MaskSchedule(**kw)
  # The boundaries that still mean something run.
  optim.MaskSchedule(warmup_steps=4, dense_after=5)
  optim.MaskSchedule(warmup_steps=800, ramp=optim.SparsityRamp(0, 801))
  optim.MaskSchedule(dense_after=11, ramp=optim.SparsityRamp(10, 20))
