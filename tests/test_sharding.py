"""Training under `jax.jit` on a mesh (8 fake CPU devices): data parallel and
FSDP layouts give the single-device step's results, and the compiled program
holds only the collectives the layout needs (no activation is gathered).

The "pallas" backend runs in interpret mode here, so its products are the
same custom-partitioned ops as on a GPU (`jsparse24._sharding`); without
their rule XLA gathered the activations onto every device.
"""

import contextlib
import functools
import re
from typing import Any
from unittest import mock

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jsparse24
from jsparse24 import _pallas_runtime, optim
from jsparse24.backends.pallas import interpret_mode

D, H, B, T = 64, 128, 8, 12  # B*T differs from D and H: shapes tell activations from weights


class _MLP(nn.Module):
  implementation: str
  up_sharding: Any = None  # kernel_sharding of the layers (tensor parallelism)
  down_sharding: Any = None

  @nn.compact
  def __call__(self, x):
    kw = dict(implementation=self.implementation, use_bias=False)
    h = nn.relu(jsparse24.SparseDense(H, name="up", kernel_sharding=self.up_sharding, **kw)(x))
    return jsparse24.SparseDense(D, name="down", kernel_sharding=self.down_sharding, **kw)(h)


def _setup(implementation, gather_params=None, model=None):
  model = _MLP(implementation) if model is None else model
  x = jax.random.normal(jax.random.key(0), (B, T, D))
  y = jax.random.normal(jax.random.key(1), (B, T, D))
  v = _MLP(implementation).init(jax.random.key(2), x)  # same params for every model
  tx = optax.chain(optim.mask_update(v["sparsity"], optim.MaskSchedule(rebuild_every=2),
                                     decay=1e-3), optax.adam(1e-2))

  def step(params, opt_state, x, y):
    def loss_fn(p):
      if gather_params is not None:  # FSDP: whole weights for the products
        p = jax.lax.with_sharding_constraint(p, gather_params)
      out = model.apply({"params": p, "sparsity": optim.masks(opt_state)}, x)
      return jnp.mean((out - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step), v["params"], tx.init(v["params"]), x, y


def _collectives(hlo: str) -> dict[str, list[tuple[int, ...]]]:
  """Result shapes of each collective in the compiled HLO, by kind."""
  out = {}
  for kind in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
               "collective-permute"):
    shapes = re.findall(r"= \(?\w+\[([\d,]*)\][^=]*? " + kind + r"(?:-start)?\(", hlo)
    out[kind] = [tuple(int(d) for d in s.split(",") if d) for s in shapes]
  return out


# One-device results that several tests compare their sharded calls with,
# computed once per module: the same program on every mesh, and on a CPU
# each is a trace, a lowering and a compilation of interpreted Pallas
# kernels (most of a test's time). Keyed on what changes the program: the
# arguments, and whether the kernels are interpreted and taken for native
# (`_as_on_a_gpu`).
_REFERENCES = {}


def _reference(key, compute):
  """`compute()`, once per `key` and Pallas mode (see `_REFERENCES`)."""
  key = (key, _pallas_runtime.interpreting(), _pallas_runtime.runs_natively())
  if key not in _REFERENCES:
    _REFERENCES[key] = compute()
  return _REFERENCES[key]


@contextlib.contextmanager
def _as_on_a_gpu(enabled):
  """Within (if `enabled`): what is traced rebuilds the masks as on a GPU,
  by the mask kernel on a run-time flag (`backends.rebuild_where`), the
  kernels taken for native ones."""
  if not enabled:
    yield
    return
  with mock.patch.object(_pallas_runtime, "runs_natively", lambda: True):
    yield


def _run(implementation, mesh, param_spec, steps=3, gather=False, model=None, shared=True,
         flagged=False):
  """(single-device results, sharded results, compiled HLO of the sharded
  step). `model`: the sharded step's model (same parameters). `shared`: the
  single-device results from `_reference` (False: computed here, for a test
  that watches what they run). `flagged`: the sharded step traced
  `_as_on_a_gpu`, and compared with the single-device step of the
  conditional path, whose bits the flagged path gives
  (`test_optim.test_flagged_rebuild_equals_the_conditional_one`): one
  reference for both, and a flagged path wrong everywhere fails here too."""
  step, params, opt_state, x, y = _setup(implementation)

  def reference(step):
    ref = []
    p, o = params, opt_state
    for _ in range(steps):
      p, o, loss = step(p, o, x, y)
      ref.append((loss, p, optim.masks(o)))
    return ref

  # Shared: one reference for both backends (`_reference_step`).
  ref = (_reference(("step", steps), lambda: reference(_reference_step()))
         if shared else reference(step))
  if gather or model is not None or flagged:  # a new jit: traced again, not the reference's
    step = _setup(implementation, NamedSharding(mesh, P()) if gather else None, model)[0]

  data = NamedSharding(mesh, P("data"))
  put_param = lambda a: jax.device_put(  # noqa: E731
      a, NamedSharding(mesh, param_spec(a)))
  sp = jax.tree.map(put_param, params)
  so = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P())), opt_state)
  sx, sy = jax.device_put(x, data), jax.device_put(y, data)
  got = []
  placed = jax.tree.map(lambda a: a.sharding, (sp, so))
  with _as_on_a_gpu(flagged):
    hlo = step.lower(sp, so, sx, sy).compile().as_text()
    for _ in range(steps):
      new_p, new_o, loss = step(sp, so, sx, sy)
      got.append((loss, new_p, optim.masks(new_o)))
      # The next step's inputs placed as the first's: XLA lays some outputs
      # out otherwise (the masks and moments like their kernels), and each
      # new placement would compile the step again.
      sp, so = jax.device_put((new_p, new_o), placed)
  return ref, got, hlo


def _reference_step():
  """The single-device step on the "xla" backend: "pallas" computes the same
  losses and params (to float32 rounding, within `_assert_same`'s
  tolerances) and the same masks, so one reference serves both backends (an
  interpreted single-device step less to compile)."""
  return _setup("xla")[0]


def _assert_same(ref, got):
  for (l0, p0, m0), (l1, p1, m1) in zip(ref, got):
    np.testing.assert_allclose(l1, l0, rtol=1e-5, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-4), p0, p1)
    for a, b in zip(jax.tree.leaves(m0), jax.tree.leaves(m1)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _activation_shapes():
  return {(B, T, D), (B, T, H), (B * T, D), (B * T, H), (B, T, H // 2), (B * T, H // 2)}


def _mesh(axis_type):
  return jax.make_mesh((8,), ("data",), axis_types=(axis_type,))


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_data_parallel_equals_one_device_and_gathers_nothing(implementation, axis_type):
  mesh = _mesh(getattr(jax.sharding.AxisType, axis_type))
  with interpret_mode():
    ref, got, hlo = _run(implementation, mesh, lambda a: P())
  _assert_same(ref, got)
  coll = _collectives(hlo)
  assert coll["all-gather"] == [], coll  # nothing is gathered: not x, not dy
  assert coll["all-reduce"], coll  # the gradients (and the loss) are summed


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_data_layout_choice_sees_each_devices_rows(implementation, monkeypatch):
  """`jsparse24.layouts`' "data" layout gives the 2:4 layers a kernel
  sharding (kernel whole, rows split): the backend is chosen for the B*T/8
  rows one device multiplies, not for all B*T, and the step still computes
  what one device does, gathering nothing."""
  rows = []
  select = jsparse24.backends.select
  monkeypatch.setattr(jsparse24.backends, "select",
                      lambda impl, problem, fn=None: (rows.append(problem.m),
                                                      select(impl, problem, fn))[1])
  mesh = _mesh(jax.sharding.AxisType.Auto)
  whole = jsparse24.layouts.Layout("data", mesh).kernel_sharding("column")
  with interpret_mode():
    ref, got, hlo = _run(implementation, mesh, lambda a: P(),
                         model=_MLP(implementation, whole, whole), shared=False)
  _assert_same(ref, got)
  assert _collectives(hlo)["all-gather"] == []
  # The single-device reference chose for all rows, the layout for its share.
  assert sorted(set(rows)) == [B * T // 8, B * T], rows


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_fsdp_gathers_weights_only(implementation):
  """Weights sharded on their output axis at rest and gathered for the
  products (the step constrains them whole, as an FSDP step does for
  nn.Dense): only weights are gathered, never an activation."""
  mesh = _mesh(jax.sharding.AxisType.Auto)
  spec = lambda a: P(*([None] * (a.ndim - 1)), "data")  # noqa: E731
  with interpret_mode():
    ref, got, hlo = _run(implementation, mesh, spec, gather=True)
  _assert_same(ref, got)
  coll = _collectives(hlo)
  gathered = set(coll["all-gather"])
  assert not gathered & _activation_shapes(), coll
  assert gathered <= {(D, H), (H, D), (H, D // 8), (D, H // 8), (H,), (D,)}, coll


@pytest.mark.parametrize("flagged", [False, True])
def test_fsdp_without_gathering_weights_compresses_each_shard(flagged):
  """Weights sharded on their output axis N and left sharded in the step:
  each device prunes and compresses its own columns (the compress kernels'
  sharding rule), and XLA gathers the half-size compressed arrays for the
  products, never a weight. Same results as one device. `flagged`: the
  masks are rebuilt as on a GPU, by the mask kernel on a run-time flag
  (`backends.rebuild_where`), each device its own columns."""
  mesh = _mesh(jax.sharding.AxisType.Auto)
  spec = lambda a: P(*([None] * (a.ndim - 1)), "data")  # noqa: E731
  with interpret_mode():
    ref, got, hlo = _run("pallas", mesh, spec, flagged=flagged)
  _assert_same(ref, got)
  gathered = set(_collectives(hlo)["all-gather"])
  assert not gathered & {(D, H), (H, D)}, gathered  # no weight
  compressed = {(H, D // 2), (D, H // 2), (H, D // 8), (D, H // 8),  # up: values, values_t, meta, meta_t
                (D, H // 2), (H, D // 2), (D, H // 8), (H, D // 8)}  # down
  if flagged:  # the rebuild kernel's flip counts (int32 [1, N/8]), summed whole
    compressed |= {(1, H // 8), (1, D // 8)}
  assert gathered and gathered <= compressed, gathered


@pytest.mark.parametrize("transposable", [False, True])
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("axis", ["n", "k"])
def test_cusparselt_compression_of_a_sharded_weight(transposable, axis_type, axis):
  """What the "cusparselt" backend prepares from a sharded weight (its
  compress kernel, then the metadata pass into the buffers) equals the
  unsharded result with Auto and Explicit mesh axes. With Auto axes and the
  weight sharded on N (FSDP), each device compresses its own columns and
  XLA gathers the compressed arrays, never the weight."""
  from jsparse24.backends import cusparselt  # pylint: disable=g-import-not-at-top
  k, n = 256, 512
  w = jax.random.normal(jax.random.key(3), (k, n), jnp.bfloat16)
  mask = jsparse24.Mask24.from_weights(w, transposable=transposable)
  prepare = jax.jit(lambda w: cusparselt.compress_for_products(w, mask, transposable))
  mesh = _mesh(getattr(jax.sharding.AxisType, axis_type))
  spec = P(None, "data") if axis == "n" else P("data", None)
  # The unsharded buffers by the XLA code that writes the kernels' bytes
  # (test_triton_fallback): an interpreted unsharded program less to compile.
  reference = jax.jit(lambda w: cusparselt.compress_for_products_xla(w, mask, transposable))
  with interpret_mode():
    want = _reference(("cusparselt", transposable), lambda: reference(w))
    with jax.set_mesh(mesh):
      ws = jax.device_put(w, NamedSharding(mesh, spec))
      got = prepare(ws)
      hlo = prepare.lower(ws).compile().as_text()
  assert (got[1] is None) == (not transposable)
  for g, r in zip(got, want):
    if r is not None:
      np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
  if axis_type == "Auto" and axis == "n":
    gathered = set(_collectives(hlo)["all-gather"])
    # The buffers, and (jax 0.12.1 shards it beside w, then gathers it for
    # the kernel) the stored mask's codes as 32-bit words, [n, k/32]: k n / 8
    # bytes, a sixteenth of w's.
    buffers = {(k // 2 + k // 16, n), (n, k // 32)} | ({(k + k // 8, n // 2), (k, n // 8)}
                                                      if transposable else set())
    assert gathered and gathered <= buffers, gathered  # never w [k, n]


def _explicit_dp_loss(implementation):
  """A loss whose first sparse product's input is computed (`x @ w0`), so
  that its gradient flows into an activation, as after an embedding."""
  masks = [jsparse24.Mask24.from_weights(jax.random.normal(jax.random.key(i), s),
                                         transposable=True)
           for i, s in ((5, (D, H)), (6, (H, D)))]

  def loss(w0, w1, w2, x):
    h = jax.nn.relu(jsparse24.sparse_dot(x @ w0, w1, masks[0], implementation=implementation))
    return jnp.mean(jsparse24.sparse_dot(h, w2, masks[1], implementation=implementation) ** 2)
  return loss


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_explicit_axes_gradient_through_a_computed_activation(implementation):
  """Data parallel with Explicit mesh axes, the gradient taken through the
  sparse products into the activations (and x): the same loss and
  gradients as one device, dx typed like x; also with the weights as
  constants (frozen, not typed with the mesh) and the gradient of x alone,
  where dw's products need an explicit result type (JAX refused that step:
  "Contracting dimensions are sharded and it is ambiguous how the output
  should be sharded")."""
  mesh = _mesh(jax.sharding.AxisType.Explicit)
  ks = jax.random.split(jax.random.key(4), 4)
  args = (jax.random.normal(ks[0], (D, D)) / 8, jax.random.normal(ks[1], (D, H)),
          jax.random.normal(ks[2], (H, D)), jax.random.normal(ks[3], (B * T, D)))
  loss = _explicit_dp_loss(implementation)
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
  frozen = jax.jit(jax.grad(lambda x: loss(*args[:3], x)))
  # Unsplit, on the reference backend for both ("pallas" computes the same
  # products, to float32 rounding within the tolerance below), and the
  # frozen weights' dx is the step's (the same products): interpreted
  # programs less to compile.
  reference = jax.jit(jax.value_and_grad(_explicit_dp_loss("xla"), argnums=(0, 1, 2, 3)))
  with interpret_mode():
    want = _reference(("explicit_dp",), lambda: reference(*args))
    want = want, want[1][3]
    with jax.set_mesh(mesh):
      put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
      x = put(args[3], P("data", None))
      got = step(*(put(a, P()) for a in args[:3]), x), frozen(x)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    # (dw sums 8 partial products: another order of float32 additions)
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-6)
  for dx in (got[0][1][3], got[1]):
    assert dx.sharding.spec == P("data", None), dx.sharding


def test_cusparselt_backend_under_explicit_axes_types_its_gradients(monkeypatch):
  """The "cusparselt" backend's step with Explicit mesh axes (the weights
  sharded on N, x on its rows), its cuSPARSELt call replaced by a stand-in
  of the right shape and dtype: no cuSPARSELt on CPU, so only the wiring
  around it runs (compression, metadata pass, the batched and
  row-partitioned product, the transpose); the values are the GPU tests'.
  The gradients come out typed like their arguments."""
  from jsparse24.backends import cusparselt  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(cusparselt.CusparseltBackend, "unavailable_reason", lambda self: None)
  monkeypatch.setattr(cusparselt, "_check_size", lambda *a: None)
  monkeypatch.setattr(cusparselt, "_sparse_a_matmul",
                      lambda a, b, shape, **kw: jnp.zeros(shape, b.dtype) + 0 * a[0, 0] * b[0, 0])
  mesh = _mesh(jax.sharding.AxisType.Explicit)
  k, n, m = 256, 512, 64
  w = jax.random.normal(jax.random.key(0), (k, n), jnp.bfloat16)
  x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
  mask = jsparse24.Mask24.from_weights(w, transposable=True)
  loss = lambda x, w: jnp.sum(jsparse24.sparse_dot(  # noqa: E731
      x, w, mask, implementation="cusparselt").astype(jnp.float32) ** 2)
  with interpret_mode(), jax.set_mesh(mesh):
    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(
        jax.device_put(x, NamedSharding(mesh, P("data", None))),
        jax.device_put(w, NamedSharding(mesh, P(None, "data"))))
  assert dx.sharding.spec == P("data", None) and dw.sharding.spec == P(None, "data")


@pytest.mark.parametrize("rule,m,axis_type", [("tiles", 1024, "Auto"), ("tokens", 512, "Auto")])
def test_cusparselt_activation_weight_grads_under_data_parallelism(monkeypatch, rule, m,
                                                                   axis_type):
  """2:4 activations with both weight gradients sparse (`input_sparsity=
  "masked", grad_output="2:4"`, and `transposable=True` or
  `weight_grad="2:4"`) on the "cusparselt" backend with x's rows split over 8
  devices: y, dx and dw equal the unsharded "xla" backend's (each device's
  tiles, and token groups, are the whole array's where it holds a multiple
  of 4, resp. 64, rows), and y and dx keep x's partition. On tiles with 128
  rows per device (`KEEP_MIN_ROWS`) each device's pass keeps its copy along
  the tokens and its mask for the backward (`times_keeping`, a
  row-partitioned op with three results; with Explicit axes:
  `test_rows_parallel_with_several_results_splits_each_over_rows`).
  cuSPARSELt's calls by
  `triton_removal`'s stand-ins."""
  from jsparse24.backends import cusparselt  # pylint: disable=g-import-not-at-top
  from tests import triton_removal  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(cusparselt.CusparseltBackend, "unavailable_reason", lambda self: None)
  monkeypatch.setattr(cusparselt, "_check_size", lambda *a: None)
  monkeypatch.setattr(cusparselt, "_sparse_a_matmul", triton_removal._stand_in_product)  # pylint: disable=protected-access
  monkeypatch.setattr(cusparselt, "_sparse_b_matmul", triton_removal._stand_in_b_product)  # pylint: disable=protected-access
  kept = []
  keeping = cusparselt.tiles_times_keeping
  monkeypatch.setattr(cusparselt, "SPARSE_PRODUCTS", cusparselt.SPARSE_PRODUCTS._replace(
      times_keeping=lambda a, b: kept.append(a.shape) or keeping(a, b)))
  k, n = 128, 64
  x, w, dy = (jax.random.normal(jax.random.key(i), shape, jnp.bfloat16)
              for i, shape in enumerate(((m, k), (k, n), (m, n))))
  options = ({"transposable": True} if rule == "tiles" else {"weight_grad": "2:4"})

  def vjp(x, w, dy, implementation):
    y, back = jax.vjp(lambda x, w: jsparse24.sparse_dot(
        x, w, input_sparsity="masked", grad_output="2:4", implementation=implementation,
        **options), x, w)
    return (y, *back(dy))

  with interpret_mode():
    want = jax.jit(functools.partial(vjp, implementation="xla"))(x, w, dy)
    mesh = _mesh(getattr(jax.sharding.AxisType, axis_type))
    rows = NamedSharding(mesh, P("data", None))
    with jax.set_mesh(mesh):
      got = jax.jit(functools.partial(vjp, implementation="cusparselt"))(
          jax.device_put(x, rows), jax.device_put(w, NamedSharding(mesh, P())),
          jax.device_put(dy, rows))
  # The input's pass kept where there are rows enough (dy, pruned too, is dw's dense side).
  assert kept == ([(m, k)] if rule == "tiles" and m >= 1024 else []), kept
  for g, r in zip(got, want):  # bf16 results: relative error by norm
    g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
    assert np.linalg.norm(g - r) <= 1e-2 * np.linalg.norm(r)
  assert got[0].sharding.spec[0] == "data" and got[1].sharding.spec[0] == "data"


def test_tensor_parallel_reference_backend_partitions_like_nn_dense():
  """Megatron-style tensor parallelism on a data x model mesh (up
  column-parallel, down row-parallel) with the reference backend: XLA
  partitions its masked products itself, so the step equals one device's,
  nothing is gathered, and the activations' only collective is the
  all-reduce of down's partial products (`[rows per data shard, D]`)."""
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

  def spec(a):
    return {(D, H): P(None, "model"), (H, D): P("model", None)}.get(tuple(a.shape), P())

  # Interpret mode changes nothing on "xla" but the caches' keys: within, the
  # one-device reference and the eager init's programs are the data-parallel
  # tests'.
  with interpret_mode():
    ref, got, hlo = _run("xla", mesh, spec)
  _assert_same(ref, got)
  coll = _collectives(hlo)
  assert coll["all-gather"] == [] and coll["reduce-scatter"] == [], coll
  reduced = set(coll["all-reduce"])
  assert (B * T // 2, D) in reduced, coll  # down's partial sums
  assert not reduced & (_activation_shapes() | {(B * T // 2, H), (B * T // 2, H // 4)}), coll


def _megatron_mesh(axis_type="Auto"):
  return jax.make_mesh((2, 4), ("data", "model"),
                       axis_types=(getattr(jax.sharding.AxisType, axis_type),) * 2)


def _megatron_spec(a):
  return {(D, H): P(None, "model"), (H, D): P("model", None)}.get(tuple(a.shape), P())


@pytest.mark.parametrize("implementation,flagged,axis_type", [
    ("xla", False, "Auto"), ("pallas", False, "Auto"), ("pallas", True, "Auto"),
    ("xla", False, "Explicit"), ("pallas", False, "Explicit")])
def test_tensor_parallel_kernel_sharding_equals_one_device_and_gathers_nothing(
    implementation, flagged, axis_type):
  """Megatron tensor parallelism named on the layers (`kernel_sharding`: up
  column-parallel, down row-parallel) on a data x model mesh: each device
  prunes, compresses and multiplies its own block of each weight, so the
  step equals one device's (loss, params, masks) and compiles to no
  all-gather at all; the activations' one collective is the all-reduce of
  down's partial products. (Without `kernel_sharding` the "pallas" step
  gathered both weights and down's input `[48, 128]`.) `flagged`: the masks
  rebuilt by the mask kernel on a run-time flag, every step, as on a GPU:
  on each device's block too (down's rows; before, down's weight was
  gathered for it). Explicit mesh axes: the same step, the masks rebuilt
  by XLA with the axes made Auto inside (`_sharding.typed_like`)."""
  mesh = _megatron_mesh(axis_type)
  model = _MLP(implementation, NamedSharding(mesh, P(None, "model")),
               NamedSharding(mesh, P("model", None)))
  with interpret_mode():
    ref, got, hlo = _run(implementation, mesh, _megatron_spec, model=model, flagged=flagged)
  _assert_same(ref, got)
  coll = _collectives(hlo)
  # Flagged (or with Explicit axes), the rebuilt masks (sharded like their
  # weights) are gathered back to the replicated mask state of this test,
  # with up's flip counts: 1 bit per weight, never a weight or an activation.
  masks = ({(H, D // 8), (D, H // 8), (1, H // 8), (1, D // 8)}
           if flagged or axis_type == "Explicit" else set())
  assert set(coll["all-gather"]) <= masks and coll["reduce-scatter"] == [], coll
  reduced = set(coll["all-reduce"])
  assert (B * T // 2, D) in reduced, coll  # down's partial sums
  assert not reduced & (_activation_shapes() | {(B * T // 2, H), (B * T // 2, H // 4)}), coll


def test_tensor_parallel_with_fsdp_on_a_2d_mesh():
  """Tensor parallelism combined with FSDP on the data x model mesh: the
  MLP kernels sharded at rest on both axes (FSDP's data on the axis the
  model axis leaves, e.g. up `P("data", "model")`), `kernel_sharding` over
  model only. The step gathers each weight's FSDP shards over data (a
  float32 block of `[D, H/4]` or `[H/4, D]`, as FSDP does for nn.Dense),
  never an activation, and equals the one-device step."""
  mesh = _megatron_mesh()
  model = _MLP("pallas", NamedSharding(mesh, P(None, "model")),
               NamedSharding(mesh, P("model", None)))

  def spec(a):
    return {(D, H): P("data", "model"), (H, D): P("model", "data")}.get(tuple(a.shape), P())

  with interpret_mode():
    ref, got, hlo = _run("pallas", mesh, spec, model=model)
  _assert_same(ref, got)
  coll = _collectives(hlo)
  assert coll["all-gather"] and set(coll["all-gather"]) <= {(D, H // 4), (H // 4, D)}, coll
  assert (B * T // 2, D) in set(coll["all-reduce"]), coll


def _tp_loss(implementation, shardings, gradient, mask_kind):
  """A column-parallel product then a row-parallel one, differentiable in x
  and both weights (x's gradient goes through the column-parallel dx)."""
  def loss(x, w1, w2, m1, m2):
    kw = dict(implementation=implementation, gradient=gradient)
    if mask_kind == "dynamic":
      m1 = m2 = None
      kw["transposable"] = True
    h = jsparse24.sparse_dot(x, w1, m1, weight_sharding=shardings[0], **kw)
    y = jsparse24.sparse_dot(jnp.tanh(h), w2, m2, weight_sharding=shardings[1], **kw)
    return jnp.sum(jnp.sin(y))
  return loss


@pytest.mark.parametrize("implementation,axis_type", [("xla", "Auto"), ("pallas", "Auto"),
                                                     ("pallas", "Explicit")])
@pytest.mark.parametrize("gradient,mask_kind", [("ste", "mask24"), ("masked", "mask24"),
                                                ("masked", "dense"), ("ste", "dynamic")])
def test_tensor_parallel_sparse_dot_gradients_equal_the_unsplit_ones(implementation, axis_type,
                                                                    gradient, mask_kind):
  """`sparse_dot(..., weight_sharding=)`: value and gradients (x, w1, w2)
  equal the unsplit call's on "xla", for each mask kind and gradient mode;
  x's gradient needs the column-parallel dx summed over the model axis. Also
  with Explicit mesh axes (the products; a training step's mask update
  there is not supported yet)."""
  mesh = _megatron_mesh(axis_type)
  k = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(k[0], (B * T, D))
  w1, w2 = jax.random.normal(k[1], (D, H)), jax.random.normal(k[2], (H, D))
  m1, m2 = (jsparse24.Mask24.from_weights(w, transposable=True) for w in (w1, w2))
  if mask_kind == "dense":
    m1, m2 = m1.unpack(), m2.unpack()
  # The unsplit call on the reference backend: "pallas" computes the same
  # products (to float32 rounding, within the tolerance below), and one
  # reference per case serves both backends (an interpreted unsplit program
  # less to compile per case).
  grad = jax.value_and_grad(_tp_loss("xla", (None, None), gradient, mask_kind),
                            argnums=(0, 1, 2))
  split = jax.value_and_grad(_tp_loss(
      implementation, (NamedSharding(mesh, P(None, "model")), NamedSharding(mesh, P("model", None))),
      gradient, mask_kind), argnums=(0, 1, 2))
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
  args = (put(x, P("data")), put(w1, P(None, "model")), put(w2, P("model", None)),
          jax.tree.map(lambda a: put(a, P()), m1), jax.tree.map(lambda a: put(a, P()), m2))
  with interpret_mode():
    want = _reference(("sparse_dot", gradient, mask_kind),
                      lambda: jax.jit(grad)(x, w1, w2, m1, m2))
    got = jax.jit(split)(*args)
    hlo = jax.jit(split).lower(*args).compile().as_text()
  # Float32 sums in another order (partial products summed over devices).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      b, a, rtol=1e-4, atol=1e-5 * float(jnp.abs(a).max())), want, got)
  assert _collectives(hlo)["all-gather"] == [], _collectives(hlo)


@pytest.mark.parametrize("implementation,axis_type", [("xla", "Auto"), ("xla", "Explicit"),
                                                     ("pallas", "Auto"), ("pallas", "Explicit")])
def test_tensor_parallel_with_the_mvue_weight_gradient(implementation, axis_type):
  """`weight_grad="mvue"` under a split: the same draws and gradients as the
  unsplit call (the pruned dy's random numbers are those of the whole dy),
  and no all-gather."""
  mesh = _megatron_mesh(axis_type)
  k = jax.random.split(jax.random.key(3), 4)
  x = jax.random.normal(k[0], (B * T, D))
  w1, w2 = jax.random.normal(k[1], (D, H)), jax.random.normal(k[2], (H, D))

  def loss(x, w1, w2, key, s1, s2):
    kw = dict(implementation=implementation, weight_grad="mvue", transposable=True)
    h = jsparse24.sparse_dot(x, w1, weight_sharding=s1, key=jax.random.fold_in(key, 1), **kw)
    y = jsparse24.sparse_dot(jnp.tanh(h), w2, weight_sharding=s2,
                             key=jax.random.fold_in(key, 2), **kw)
    return jnp.sum(jnp.sin(y))

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=(4, 5))
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
  args = (put(x, P("data")), put(w1, P(None, "model")), put(w2, P("model", None)), k[3],
          NamedSharding(mesh, P(None, "model")), NamedSharding(mesh, P("model", None)))
  with interpret_mode():
    want = _reference(("mvue", implementation), lambda: grad(x, w1, w2, k[3], None, None))
    got = grad(*args)
    hlo = grad.lower(*args).compile().as_text()
  for a, b in zip(want, got):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5 * float(jnp.abs(a).max()))
  assert _collectives(hlo)["all-gather"] == [], _collectives(hlo)


def test_tensor_parallel_rejects_a_bad_weight_sharding():
  """Errors name the function, the argument and what each device would get."""
  mesh = _megatron_mesh()
  x, w = jnp.ones((8, D)), jnp.ones((D, H))
  with pytest.raises(TypeError, match="sparse_dot: `weight_sharding` must be a jax.sharding"):
    jsparse24.sparse_dot(x, w, weight_sharding=P(None, "model"))
  with pytest.raises(ValueError, match=r"sparse_dot: `weight_sharding` .* splits K = 48 over"
                                       r" mesh axes \('model',\).*'pallas'.*multiple of 8,"
                                       r" got 12\b"):
    with interpret_mode():
      jsparse24.sparse_dot(x[:, :48], w[:48], implementation="pallas",
                           weight_sharding=NamedSharding(mesh, P("model", None)))
  # A transposable mask's codes along N: 32 columns over 8 devices is 4 each.
  layer = jsparse24.SparseDense(32, implementation="pallas", kernel_sharding=NamedSharding(
      jax.make_mesh((8,), ("model",)), P(None, "model")))
  with pytest.raises(ValueError, match=r"SparseDense: `kernel_sharding` .*splits N = 32 .*multiple of"
                                       r" 8, got 4\b"):
    with interpret_mode():
      layer.init(jax.random.key(0), jnp.ones((8, D)))
  with pytest.raises(ValueError, match=r"sparse_dot: `weight_sharding` .* splits N = 32 over"):
    # A Sparse24 weight (inference) is checked alike.
    with interpret_mode():
      jsparse24.sparse_dot(x, jsparse24.compress(w[:, :32], transposed=True),
                           implementation="pallas",
                           weight_sharding=NamedSharding(jax.make_mesh((8,), ("model",)),
                                                         P(None, "model")))


@functools.partial(jax.jit, static_argnums=2)
def _rebuilt(w, old, flag):
  """What `pallas.rebuild_mask(w, old, flag)` returns, by the XLA reference:
  the mask of `w` (`old` where not flagged) and each layer's flip rate
  against `old`, bit for bit (test_pallas_kernels'
  `test_backend_mask_update_on_a_stack_under_jit`); an interpreted
  unsharded kernel program less to compile."""
  new = jsparse24.Mask24.from_weights(w, transposable=old.transposable) if flag else old
  return new, optim.flip_fraction(old, new)


def _rebuild_sharded(w_spec, packed_spec, transposable):
  """`pallas.rebuild_mask` on a stack of kernels `[3, D, H]` and its masks
  laid out as given, flagged and not: equal to the unsharded results, the
  flag respected. Returns the sharded kernels and the flagged call's HLO."""
  from jsparse24.backends import pallas as backend  # pylint: disable=g-import-not-at-top
  mesh = _mesh(jax.sharding.AxisType.Auto)
  w = jax.random.normal(jax.random.key(0), (3, D, H))
  old = jsparse24.Mask24.from_weights(jax.random.normal(jax.random.key(1), w.shape),
                                      transposable=transposable)
  sw = jax.device_put(w, NamedSharding(mesh, w_spec))
  sold = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, packed_spec)), old)
  update = jax.jit(backend.rebuild_mask)
  with interpret_mode():
    for flag in (True, False):
      want, want_flips = _reference(("rebuild_mask", transposable, flag),
                                    lambda flag=flag: _rebuilt(w, old, flag))
      got, flips = update(sw, sold, jnp.asarray(flag))
      np.testing.assert_array_equal(np.asarray(got.packed), np.asarray(want.packed))
      np.testing.assert_array_equal(np.asarray(flips), np.asarray(want_flips))
      assert (np.asarray(flips) > 0).all() == flag
    return sw, update.lower(sw, sold, jnp.asarray(True)).compile().as_text()


def test_stacked_mask_update_keeps_each_devices_columns():
  """A stack of layers' kernels (nn.scan's `[L, K, N]`) sharded on N: the
  flagged mask update (one kernel call for the stack) runs on each device's
  own columns, never gathers w, and equals the unsharded result."""
  # The packed mask is [L, N, K/8]: N is its axis 1.
  _, hlo = _rebuild_sharded(P(None, None, "data"), P(None, "data", None), True)
  # Each device searches its 16 columns of every layer; w is never gathered
  # (the jit's result, the packed mask, is replicated by XLA's choice; so
  # are the kernel's flip counts, int32 [3, 1, N/8], summed whole).
  assert "f32[3,64,16]" in hlo
  coll = _collectives(hlo)
  assert set(coll["all-gather"]) <= {(3, H, D // 8), (3, 1, H // 8)} and not coll["all-reduce"], coll


@pytest.mark.parametrize("transposable", [True, False])
def test_stacked_mask_update_keeps_each_devices_rows(transposable):
  """The same with the stack's kernels sharded on K (row-parallel layers of
  tensor parallelism): each device searches its own rows (whole bytes of
  the packed mask), the flip counts are summed over the devices, w is never
  gathered, and the result equals the unsharded one."""
  from jsparse24._pallas_runtime import transposable_mask_meta  # pylint: disable=g-import-not-at-top
  # K: 8 rows per device; the packed mask [L, N, K/8]: one byte per device.
  sw, hlo = _rebuild_sharded(P(None, "data", None), P(None, None, "data"), transposable)
  with interpret_mode():
    mask_hlo = jax.jit(transposable_mask_meta).lower(sw).compile().as_text()
  assert "f32[3,8,128]" in hlo  # each device's rows of every layer
  coll = _collectives(hlo)
  assert not set(coll["all-gather"]) & {(3, D, H), (3, D // 8, H)}, coll  # w is not gathered
  assert (3, 1, H // 8) in set(coll["all-reduce"]), coll  # the flip counts, summed
  assert not set(_collectives(mask_hlo)["all-gather"]) & {(3, D, H)}, mask_hlo


def test_rows_parallel_splits_a_custom_call_over_rows():
  """An op XLA cannot partition (a host callback stands in for the Pallas and
  FFI custom calls of a GPU) compiles to each device's own rows under
  `rows_parallel`, with no collective; called directly, x is gathered.
  (Compiled only: XLA's CPU runtime crashes running a host callback inside a
  custom-partitioned op. The products' results under sharding are checked
  by the training tests above.)"""
  from jsparse24._sharding import rows_parallel

  def kernel(x, w):
    return jax.pure_callback(lambda a, b: np.tanh(a @ b),
                             jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype), x, w)

  mesh = _mesh(jax.sharding.AxisType.Auto)
  x = jax.device_put(jax.random.normal(jax.random.key(0), (64, 16)), NamedSharding(mesh, P("data")))
  w = jax.device_put(jax.random.normal(jax.random.key(1), (16, 8)), NamedSharding(mesh, P()))
  compiled = jax.jit(lambda x, w: rows_parallel(kernel, x, w)).lower(x, w).compile()
  assert compiled.output_shardings.spec[0] == "data"
  coll = _collectives(compiled.as_text())
  assert not any(coll.values()), coll
  # Without the rule, XLA gathers x for the callback.
  plain = _collectives(jax.jit(kernel).lower(x, w).compile().as_text())
  assert plain["all-gather"], plain


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_rows_parallel_with_several_results_splits_each_over_rows(axis_type):
  """`rows_parallel(..., outputs=3)`: each result computed from each
  device's own rows and split like x's rows (a `custom_partitioning` rule
  with three results on Auto axes, a `shard_map` on Explicit ones), equal to
  the unsharded results."""
  from jsparse24._sharding import rows_parallel  # pylint: disable=g-import-not-at-top

  def fn(x, w):
    return x @ w, x * 2, jnp.cumsum(x, axis=0)  # the last one sees only its device's rows

  mesh = _mesh(getattr(jax.sharding.AxisType, axis_type))
  x = jax.random.normal(jax.random.key(0), (64, 16))
  w = jax.random.normal(jax.random.key(1), (16, 8))
  with jax.set_mesh(mesh):
    got = jax.jit(lambda x, w: rows_parallel(fn, x, w, outputs=3))(
        jax.device_put(x, NamedSharding(mesh, P("data"))),
        jax.device_put(w, NamedSharding(mesh, P())))
  want = (x @ w, x * 2, jnp.cumsum(x.reshape(8, 8, 16), axis=1).reshape(64, 16))
  for g, r in zip(got, want):
    assert g.sharding.spec[0] == "data"
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


def test_unpartitioned_is_part_of_jits_cache_key():
  """`_sharding.unpartitioned()` keys jit's cache: a jitted function first
  traced outside it (with the custom_partitioning rule) is traced again
  inside it, without the rule, and the outside trace is kept for outside."""
  from jsparse24._sharding import rows_parallel, unpartitioned  # pylint: disable=g-import-not-at-top
  f = jax.jit(lambda x, w: rows_parallel(jnp.matmul, x, w))
  x, w = jnp.ones((8, 4)), jnp.ones((4, 2))
  assert "custom_partitioning" in str(jax.make_jaxpr(f)(x, w))
  with unpartitioned():
    assert "custom_partitioning" not in str(jax.make_jaxpr(f)(x, w))
  assert "custom_partitioning" in str(jax.make_jaxpr(f)(x, w))


def test_sharded_state_checkpoints_and_resumes_bit_for_bit(tmp_path):
  """FSDP layout with the optimizer state sharded like the params and each
  packed mask sharded on its N axis like its weight: an Orbax save/restore
  keeps every leaf's sharding and value, and training resumes bit for bit."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  mesh = _mesh(jax.sharding.AxisType.Auto)
  with interpret_mode():  # nothing to interpret on "xla": the other tests' eager init programs
    step, params, opt_state, x, y = _setup("xla", NamedSharding(mesh, P()))

  def spec(a):
    if a.ndim == 0 or a.shape[0] % 8:
      return P()
    if a.ndim == 2 and a.dtype == jnp.uint8:  # packed mask [N, K/8]: N like the weight's
      return P("data", None)
    return P(*([None] * (a.ndim - 1)), "data")

  put = lambda a: jax.device_put(a, NamedSharding(mesh, spec(a)))  # noqa: E731
  p, o = jax.tree.map(put, params), jax.tree.map(put, opt_state)
  packed = [m.packed for m in jax.tree.leaves(optim.masks(o), is_leaf=lambda a: isinstance(
      a, jsparse24.Mask24)) if isinstance(m, jsparse24.Mask24)]
  assert packed and all(m.sharding.spec == P("data", None) for m in packed)
  sx, sy = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
  for _ in range(2):
    p, o, _ = step(p, o, sx, sy)

  ckpt = ocp.StandardCheckpointer()
  ckpt.save(tmp_path / "step2", {"params": p, "opt_state": o})
  ckpt.wait_until_finished()
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": p, "opt_state": o})
  restored = ckpt.restore(tmp_path / "step2", abstract)
  for a, b in zip(jax.tree.leaves({"params": p, "opt_state": o}), jax.tree.leaves(restored)):
    assert b.sharding.is_equivalent_to(a.sharding, a.ndim), (a.sharding, b.sharding)
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))

  p1, o1, p2, o2 = p, o, restored["params"], restored["opt_state"]
  for _ in range(3):  # step 4 rebuilds the masks (rebuild_every=2)
    p1, o1, l1 = step(p1, o1, sx, sy)
    p2, o2, l2 = step(p2, o2, sx, sy)
    assert float(l1) == float(l2)
  for a, b in zip(jax.tree.leaves((p1, o1)), jax.tree.leaves((p2, o2))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _weighted_rows(x, dy, first_row, first_col, n_total, scale):
  """x^T (dy * (global row index + 1) * (global column index + 1)) * scale
  / n_total: wrong unless every device knows where its rows and columns
  start and how many columns the whole has."""
  rows = (first_row + 1 + jnp.arange(x.shape[0])).astype(jnp.float32)
  cols = (first_col + 1 + jnp.arange(dy.shape[1])).astype(jnp.float32)
  return scale[0] / n_total * jnp.einsum("mk,mn->kn", x, dy * rows[:, None] * cols,
                                         preferred_element_type=jnp.float32)


def _contracted_case(axis_type, x_spec, dy_spec):
  """x `[64, 16]`, dy `[64, 24]`, the two laid out on a 4 x 2 data x model
  mesh, `_weighted_rows`' scale operand and its unsplit result."""
  mesh = jax.make_mesh((4, 2), ("data", "model"),
                       axis_types=(getattr(jax.sharding.AxisType, axis_type),) * 2)
  x = jax.random.normal(jax.random.key(0), (64, 16))
  dy = jax.random.normal(jax.random.key(1), (64, 24))
  scale = jnp.array([3.0])
  want = _weighted_rows(x, dy, jnp.int32(0), jnp.int32(0), 24, scale)
  xs = jax.device_put(x, NamedSharding(mesh, x_spec))
  dys = jax.device_put(dy, NamedSharding(mesh, dy_spec))
  return x, dy, xs, dys, scale, want


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("spec", [P("data"), P(("data", "model")), P(None)])
def test_rows_contracted_sums_each_devices_rows_with_one_all_reduce(axis_type, spec):
  """The weight gradient's sparse product (`x^T mvue_24(dy)` on cuSPARSELt)
  contracts over M: each device contracts its own rows, then one all-reduce,
  as XLA does for the dense `x^T dy`; no activation is gathered."""
  from jsparse24._sharding import rows_contracted
  x, dy, xs, dys, scale, want = _contracted_case(axis_type, spec, spec)
  f = jax.jit(lambda a, b: rows_contracted(_weighted_rows, a, b, scale))
  np.testing.assert_allclose(f(xs, dys), want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
  coll = _collectives(f.lower(xs, dys).compile().as_text())
  assert coll["all-gather"] == [], coll
  assert coll["all-reduce"] == ([] if spec == P(None) else [(16, 24)]), coll
  # Under vmap: one contraction per batch element.
  got = jax.vmap(lambda a, b: rows_contracted(_weighted_rows, a, b, scale), in_axes=(0, None))(
      jnp.stack([x, 2 * x]), dy)
  np.testing.assert_allclose(got, jnp.stack([want, 2 * want]), rtol=1e-5,
                             atol=2e-5 * float(jnp.abs(want).max()))


def test_tensor_parallel_under_jvp_vmap_scan_and_nnx():
  """A column-parallel product under forward mode, vmap, nn.scan (its
  gradient) and NNX's `SparseLinear(kernel_sharding=)`: the unsplit results."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jsparse24 import nnx as jnnx  # pylint: disable=g-import-not-at-top
  mesh = _megatron_mesh()
  col = NamedSharding(mesh, P(None, "model"))
  x = jax.random.normal(jax.random.key(0), (16, D))
  w = jax.random.normal(jax.random.key(1), (D, H))
  m = jsparse24.Mask24.from_weights(w, transposable=True)
  f = lambda x, w, s: jsparse24.sparse_dot(x, w, m, implementation="pallas",  # noqa: E731
                                           weight_sharding=s)
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)  # noqa: E731

  class Block(nn.Module):
    sharding: Any

    @nn.compact
    def __call__(self, h, _):
      return jsparse24.SparseDense(D, implementation="pallas", use_bias=False,
                                   kernel_sharding=self.sharding)(h), None

  def stack(sharding):
    scan = nn.scan(Block, variable_axes={"params": 0, "sparsity": 0},
                   split_rngs={"params": True}, length=3)
    return scan(sharding, name="blocks")

  class Stack(nn.Module):
    sharding: Any = None

    @nn.compact
    def __call__(self, h):
      return stack(self.sharding)(h, None)[0]

  with interpret_mode():
    jvp = lambda s: jax.jvp(lambda a, b: f(a, b, s), (x, w), (x, w))[1]  # noqa: E731
    close(jax.jit(lambda: jvp(col))(), jvp(None))
    vm = lambda s: jax.vmap(lambda a: f(a, w, s))(x.reshape(2, 8, D))  # noqa: E731
    close(vm(col), vm(None))
    v = Stack().init(jax.random.key(2), x)
    grads = [jax.jit(jax.grad(lambda p, s=s: jnp.sum(
        Stack(s).apply({**v, "params": p}, x) ** 2)))(v["params"]) for s in (None, col)]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-3), *grads)
    layers = [jnnx.SparseLinear(D, H, rngs=nnx.Rngs(0), implementation="pallas",
                                kernel_sharding=s) for s in (None, col)]
    close(nnx.jit(lambda layer, x: layer(x))(layers[1], x), layers[0](x))


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("x_spec,dy_spec,block", [
    (P("data", "model"), P("data"), (8, 24)),  # row-parallel: x split on K
    (P("data"), P("data", "model"), (16, 12))])  # column-parallel: dy split on N
def test_rows_contracted_gives_each_device_its_block(axis_type, x_spec, dy_spec, block):
  """With x split on K or dy on N (tensor parallelism), each device
  contracts its rows into its block of the result (knowing its first row
  and column and the whole N); one all-reduce of the block over the rows'
  axes; nothing gathered."""
  from jsparse24._sharding import rows_contracted
  _, _, xs, dys, scale, want = _contracted_case(axis_type, x_spec, dy_spec)
  f = jax.jit(lambda a, b: rows_contracted(_weighted_rows, a, b, scale, align=4))
  got = f(xs, dys)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
  coll = _collectives(f.lower(xs, dys).compile().as_text())
  assert coll["all-gather"] == [], coll
  assert coll["all-reduce"] == [block], coll


def test_tensor_parallel_through_sparsify_rules():
  """`kernel_sharding` as a `sparsify` rule option on an unmodified dense
  model: the patched layers split like `SparseDense(kernel_sharding=)`, the
  output and gradients equal the unsplit patched model's, no all-gather."""
  mesh = _megatron_mesh()

  class Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.relu(nn.Dense(H, use_bias=False, name="up")(x))
      return nn.Dense(D, use_bias=False, name="down")(h)

  def patched(split):
    opts = lambda s: {"implementation": "pallas", "kernel_sharding": s}  # noqa: E731
    return jsparse24.sparsify(Dense(), {
        "up": opts(NamedSharding(mesh, P(None, "model")) if split else None),
        "down": opts(NamedSharding(mesh, P("model", None)) if split else None)})

  x = jax.random.normal(jax.random.key(0), (B * T, D))
  with interpret_mode():
    v = patched(False).init(jax.random.key(1), x)

    def loss(model):
      return lambda p, x: jnp.sum(jnp.sin(model.apply({**v, "params": p}, x)))
    want = jax.jit(jax.value_and_grad(loss(patched(False))))(v["params"], x)
    f = jax.jit(jax.value_and_grad(loss(patched(True))))
    sp = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, _megatron_spec(a))),
                      v["params"])
    sx = jax.device_put(x, NamedSharding(mesh, P("data")))
    got = f(sp, sx)
    hlo = f.lower(sp, sx).compile().as_text()
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      b, a, rtol=1e-4, atol=1e-5 * float(jnp.abs(a).max())), want, got)
  coll = _collectives(hlo)
  assert coll["all-gather"] == [] and (B * T // 2, D) in set(coll["all-reduce"]), coll


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("transposed", [True, False])
def test_tensor_parallel_on_a_compressed_weight(implementation, transposed):
  """Inference (and fine-tuning of the kept values) on `Sparse24` weights
  under a split: column- then row-parallel, value and gradients in x and
  both weights' values equal the unsplit call's; no all-gather."""
  mesh = _megatron_mesh()
  k = jax.random.split(jax.random.key(5), 3)
  x = jax.random.normal(k[0], (B * T, D))
  sp1 = jsparse24.compress(jax.random.normal(k[1], (D, H)), transposed=transposed)
  sp2 = jsparse24.compress(jax.random.normal(k[2], (H, D)), transposed=transposed)

  def loss_on(impl, x, sp1, sp2, s1=None, s2=None):
    kw = dict(implementation=impl)
    h = jsparse24.sparse_dot(x, sp1, weight_sharding=s1, **kw)
    return jnp.sum(jnp.sin(jsparse24.sparse_dot(jnp.tanh(h), sp2, weight_sharding=s2, **kw)))

  grad = jax.jit(jax.value_and_grad(functools.partial(loss_on, implementation),
                                    argnums=(0, 1, 2), allow_int=True), static_argnums=(3, 4))
  splits = (NamedSharding(mesh, P(None, "model")), NamedSharding(mesh, P("model", None)))
  sx = jax.device_put(x, NamedSharding(mesh, P("data")))
  # The unsplit call on the reference backend, one for both backends
  # ("pallas" multiplies the same kept values, to float32 rounding within
  # the tolerance below): an interpreted unsplit program less to compile.
  reference = jax.jit(jax.value_and_grad(functools.partial(loss_on, "xla"),
                                         argnums=(0, 1, 2), allow_int=True))
  with interpret_mode():
    want = _reference(("compressed", transposed), lambda: reference(x, sp1, sp2))
    got = grad(sx, sp1, sp2, *splits)
    hlo = grad.lower(sx, sp1, sp2, *splits).compile().as_text()
  (lw, (gx_w, g1_w, g2_w)), (lg, (gx_g, g1_g, g2_g)) = want, got
  close = lambda a, b: np.testing.assert_allclose(  # noqa: E731
      b, a, rtol=1e-4, atol=1e-5 * float(jnp.abs(a).max()))
  close(lw, lg)
  for a, b in ((gx_w, gx_g), (g1_w.values, g1_g.values), (g2_w.values, g2_g.values)):
    close(a, b)
  assert _collectives(hlo)["all-gather"] == [], _collectives(hlo)


def test_tensor_parallel_layers_on_compressed_params():
  """`SparseDense(kernel_sharding=)` applied to `compress_params`' output
  (inference on Sparse24 kernels) splits its products like the dense-kernel
  step: the unsplit model's output, no all-gather."""
  mesh = _megatron_mesh()
  x = jax.random.normal(jax.random.key(0), (B, T, D))
  split = _MLP("pallas", NamedSharding(mesh, P(None, "model")),
               NamedSharding(mesh, P("model", None)))
  with interpret_mode():
    v = _MLP("pallas").init(jax.random.key(1), x)
    params = jsparse24.compress_params(v["params"], v["sparsity"])
    want = jax.jit(_MLP("pallas").apply)({"params": params}, x)
    f = jax.jit(split.apply)
    sx = jax.device_put(x, NamedSharding(mesh, P("data")))
    got = f({"params": params}, sx)
    hlo = f.lower({"params": params}, sx).compile().as_text()
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
  coll = _collectives(hlo)
  assert coll["all-gather"] == [] and (B * T // 2, D) in set(coll["all-reduce"]), coll



class _Stack(nn.Module):
  """Two SparseDense layers (64 -> 128 -> 64), then a stack of 3 under nn.scan."""

  @nn.compact
  def __call__(self, h):
    h = jsparse24.SparseDense(H, use_bias=False, name="up")(h)
    h = jsparse24.SparseDense(D, use_bias=False, name="down")(h)

    class Body(nn.Module):
      @nn.compact
      def __call__(self, c, _):
        return jsparse24.SparseDense(D, use_bias=False, name="layer")(c), None

    scan = nn.scan(Body, variable_axes={"params": 0, "sparsity": 0},
                   split_rngs={"params": True}, length=3)
    return scan(name="blocks")(h, None)[0]


def test_masks_like_kernels_follows_each_kernels_sharding():
  """Each packed mask `[..., N, K/8]` takes its kernel's `P(..., k, n)` as
  `P(..., n, k)` (column-, row-parallel and a stack under nn.scan), with the
  same bits; `optim.masks_like_kernels` does it to a mask_update state and
  leaves the rest of the state alone; an unsharded kernel leaves its mask."""
  mesh = _megatron_mesh()
  v = _Stack().init(jax.random.key(0), jnp.ones((4, D)))
  put = lambda a, spec: {"kernel": jax.device_put(a["kernel"], NamedSharding(mesh, spec))}  # noqa: E731
  params = {"up": put(v["params"]["up"], P(None, "model")),
            "down": put(v["params"]["down"], P("model", None)),
            "blocks": {"layer": put(v["params"]["blocks"]["layer"], P(None, "data", "model"))}}
  placed = jsparse24.masks_like_kernels(v["sparsity"], params)
  want = {"up": P("model", None), "down": P(None, "model"), "blocks": P(None, "model", "data")}
  for name, spec in want.items():
    layer = placed[name] if name != "blocks" else placed["blocks"]["layer"]
    old = v["sparsity"][name] if name != "blocks" else v["sparsity"]["blocks"]["layer"]
    assert layer["mask"].packed.sharding.spec == spec, (name, layer["mask"].packed.sharding)
    np.testing.assert_array_equal(np.asarray(layer["mask"].packed), np.asarray(old["mask"].packed))
    assert layer["mask"].dims == old["mask"].dims and layer["active"] is old["active"]

  tx = optax.chain(optim.mask_update(v["sparsity"]), optax.sgd(0.1))
  opt_state = tx.init(v["params"])
  placed = optim.masks_like_kernels(opt_state, {**v["params"], "up": params["up"]})
  masks = optim.masks(placed)
  assert masks["up"]["mask"].packed.sharding.spec == P("model", None)
  assert masks["down"]["mask"].packed is optim.masks(opt_state)["down"]["mask"].packed
  assert jax.tree.structure(placed) == jax.tree.structure(opt_state)
  assert placed[0].count is opt_state[0].count and placed[0].flip_rate is opt_state[0].flip_rate


def test_masks_like_kernels_names_the_layer_whose_mask_cannot_split():
  """K = 16 split over 8 devices: 2 rows each, a quarter of a packed byte
  (8 rows): an error that names the layer (here the root module, '')."""
  mesh = jax.make_mesh((8,), ("model",))
  v = jsparse24.SparseDense(8, use_bias=False).init(jax.random.key(0), jnp.ones((2, 16)))
  kernel = jax.device_put(v["params"]["kernel"], NamedSharding(mesh, P("model", None)))
  with pytest.raises(ValueError, match=r"masks_like_kernels: the mask of layer ''.*multiples of 8"):
    jsparse24.masks_like_kernels(v["sparsity"], {"kernel": kernel})
  # K/4 odd: the codes are packed flat, so the mask stays whole on each device.
  v = jsparse24.SparseDense(8, use_bias=False).init(jax.random.key(0), jnp.ones((2, 12)))
  kernel = jax.device_put(v["params"]["kernel"], NamedSharding(mesh, P(None, "model")))
  flat = jsparse24.masks_like_kernels(v["sparsity"], {"kernel": kernel})["mask"].packed
  assert flat.ndim == 1 and flat.sharding.spec == P(None), flat.sharding


def test_nnx_masks_like_kernels():
  """`jsparse24.nnx.masks_like_kernels`: each SparseLinear's stored mask laid
  out like its kernel, the bits unchanged; an unsharded kernel leaves it."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jsparse24 import nnx as jnnx  # pylint: disable=g-import-not-at-top
  mesh = _megatron_mesh()

  class Two(nnx.Module):
    def __init__(self):
      self.up = jnnx.SparseLinear(D, H, use_bias=False, rngs=nnx.Rngs(0))
      self.down = jnnx.SparseLinear(H, D, use_bias=False, rngs=nnx.Rngs(1))

  model = Two()
  before = np.asarray(model.up.mask.get_value().packed)
  model.up.kernel.set_value(jax.device_put(model.up.kernel.get_value(),
                                           NamedSharding(mesh, P(None, "model"))))
  jnnx.masks_like_kernels(model)
  packed = model.up.mask.get_value().packed
  assert packed.sharding.spec == P("model", None), packed.sharding
  np.testing.assert_array_equal(np.asarray(packed), before)
  assert len(model.down.mask.get_value().packed.sharding.device_set) == 1
  with pytest.raises(TypeError, match="masks_like_kernels: `model` must be an nnx.Module"):
    jnnx.masks_like_kernels({"up": model.up})


def test_a_weight_split_into_part_column_blocks_is_gathered_before_compressing():
  """FSDP with 32 columns per device, half a column block of cuSPARSELt's
  layout (64): a block's buffers would not be a block of the whole weight's,
  so the compress kernels' rule gathers w first and compresses it whole;
  the buffers equal the unsharded ones."""
  from jsparse24.backends import cusparselt  # pylint: disable=g-import-not-at-top
  k, n = 256, 256
  w = jax.random.normal(jax.random.key(4), (k, n), jnp.bfloat16)
  mask = jsparse24.Mask24.from_weights(w)
  prepare = jax.jit(lambda w: cusparselt.compress_for_products(w, mask, False))
  want = jax.jit(lambda w: cusparselt.compress_for_products_xla(w, mask, False))(w)
  mesh = _mesh(jax.sharding.AxisType.Auto)
  with interpret_mode(), jax.set_mesh(mesh):
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "data")))
    got = prepare(ws)
    hlo = prepare.lower(ws).compile().as_text()
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  assert (k, n) in set(_collectives(hlo)["all-gather"])  # w, whole
