"""GPU-only checks of the Pallas kernels at realistic sizes (skipped without
an NVIDIA GPU; the README's GPU test command, `python -m pytest -q -m gpu -n 8 tests`,
runs them with the GPU tests of the other modules)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse24

pytestmark = pytest.mark.gpu


def _same_bits(a, b):
  return np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("shape,transposed,dtype", [
    ((4096, 4096), False, jnp.bfloat16), ((1028, 2052), False, jnp.float16),
    ((8192, 1024), False, jnp.float32), ((4096, 4096), True, jnp.bfloat16),
    ((1028, 2052), True, jnp.float32)])
def test_prune_compress_matches_reference(shape, transposed, dtype):
  w = jax.random.normal(jax.random.key(shape[0] + transposed), shape, dtype)
  w = w.at[5, 7].set(jnp.nan).at[9, 3].set(jnp.inf).at[100:108].set(0)
  ref = jsparse24.compress(w, transposed=transposed, implementation="xla")
  got = jsparse24.compress(w, transposed=transposed, implementation="pallas")
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    assert _same_bits(a, b)
  mask = jsparse24.Mask24.from_meta(ref.meta, shape, transposed)
  again = jsparse24.compress(w, mask, transposed=transposed, implementation="pallas")
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(ref)):
    assert _same_bits(a, b)


def _adversarial(shape, dtype, seed=0):
  """Random weights with NaN, +-inf, zeros, equal values, subnormals, a
  quarter of the rows rounded to quarters (tied pattern scores), 8 rows of
  small integers beside 2^24 and 2^25 (patterns that tie only through
  float32 rounding), and huge finite values whose sums overflow."""
  k, n = shape
  w = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
  w = w.at[0, 0].set(jnp.nan).at[1, 1].set(jnp.inf).at[9 % k, 2].set(-jnp.inf)
  w = w.at[3].set(0.0).at[k // 2:k // 2 + 4].set(1.0).at[k - 4:, :64].set(1e-40)
  w = w.at[k // 4:k // 2].set(jnp.round(w[k // 4:k // 2] * 4) / 4)
  big = jnp.asarray([0.0, 1.0, 2.0, 3.0, 2.0**24, 1.5 * 2.0**24, 2.0**25])
  rows = w[k // 2 + 4:k // 2 + 12].shape
  w = w.at[k // 2 + 4:k // 2 + 12].set(jax.random.choice(jax.random.key(seed + 1), big, rows))
  w = w.at[k // 2 + 12:k // 2 + 20, 64:192].set(3e38 * jnp.tanh(w[k // 2 + 12:k // 2 + 20, 64:192]))
  return w.astype(dtype)


@pytest.mark.parametrize("shape,dtype", [
    ((4096, 4096), jnp.bfloat16), ((1028, 2052), jnp.float16), ((8, 12), jnp.bfloat16),
    ((132, 260), jnp.float32)])
def test_fused_transposable_prune_is_bit_identical(shape, dtype):
  """The fused transposable kernel (pattern search, both copies, both
  metadata) against the XLA reference, adversarial data, odd legal shapes;
  the mask alone from float32 master weights through Mask24.from_weights."""
  from pallas_kernels import prune24
  w = _adversarial(shape, dtype, seed=shape[0])
  mask = jsparse24.Mask24.pack(jsparse24.prune_24(w, transposable=True), transposable=True)
  ref = jsparse24.compress(w, mask, transposed=True, implementation="xla")
  got = jsparse24.compress(w, transposed=True, implementation="pallas")
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    assert _same_bits(a, b)
  if shape[0] % 64 == 0 and shape[1] % 64 == 0 and dtype != jnp.float32:
    values, meta, values_t, meta_t = prune24.prune_compress(w, transposable=True,
                                                            layout="cusparselt")
    k = shape[0]
    for a, b in zip((values[:k // 2], meta, values_t[:k], meta_t),
                    (ref.values.T, ref.meta, ref.values_t, ref.meta_t)):
      assert _same_bits(a, b)
  w32 = _adversarial(shape, jnp.float32, seed=shape[1])
  want = jsparse24.Mask24.pack(jsparse24.prune_24(w32, transposable=True), transposable=True)
  got_mask = jsparse24.Mask24.from_weights(w32, transposable=True)
  assert "pallas_call" in str(jax.make_jaxpr(
      lambda w: jsparse24.Mask24.from_weights(w, transposable=True))(w32))
  assert _same_bits(got_mask.packed, want.packed)


@pytest.mark.parametrize("transposable", [True, False])
def test_rebuild_mask_several_tiles_per_program_on_gpu(transposable):
  """The rebuild kernel's loop over tiles along K (1, 2, 8 per program, and
  the automatic choice: 8 at this shape): tiles of flagged columns rebuilt
  with the XLA reference's bits, the others keep `old`; flips counted on
  the flagged columns only. Adversarial float32 weights."""
  from pallas_kernels import mask_rebuild
  shape = (4096, 8192)
  w = _adversarial(shape, jnp.float32, seed=21)
  reference = lambda w: jsparse24.Mask24.pack(  # noqa: E731
      jsparse24.prune_24(w, transposable=transposable), transposable=transposable)
  old, new = reference(-w[::-1]), reference(w)
  cols = np.zeros(shape[1], bool)
  cols[128:1024] = cols[7936:] = True
  want = np.where(cols[:, None], np.asarray(new.meta()), np.asarray(old.meta()))
  changed = int(np.sum((np.asarray(old.unpack()) != np.asarray(new.unpack()))[:, cols]))
  for per in (1, 2, 8, None):
    got, counts = mask_rebuild.rebuild_mask(w, old.meta(), jnp.asarray(cols, jnp.int32),
                                       transposable=transposable, tiles_per_program=per)
    assert _same_bits(got, want), per
    assert int(np.sum(counts)) == changed, per


def test_mask_update_rebuilds_without_a_conditional():
  """mask_update's rebuilds on the GPU: the compiled step has no
  conditional (the flagged mask kernels instead), and over steps with and
  without a rebuild the masks equal the reference's: rebuilt from the
  previous params (adversarial values, float32) exactly when scheduled.
  Transposable masks, a stack of them, and a plain mask with N = 1002."""
  import optax  # pylint: disable=g-import-not-at-top
  from jsparse24 import optim  # pylint: disable=g-import-not-at-top
  w0 = {"a": _adversarial((1028, 2052), jnp.float32, seed=1),
        "b": jnp.stack([_adversarial((256, 512), jnp.float32, seed=s) for s in (2, 3)]),
        "c": _adversarial((260, 1002), jnp.float32, seed=4)}
  kinds = {"a": True, "b": True, "c": False}
  sparsity = {name: {"mask": jsparse24.Mask24.from_weights(w, transposable=kinds[name]),
                     "active": None} for name, w in w0.items()}
  params = {name: {"kernel": w} for name, w in w0.items()}
  tx = optax.chain(optim.mask_update(sparsity, optim.MaskSchedule(rebuild_every=2)),
                   optax.sgd(1.0))
  state = tx.init(params)

  def step(params, state, key):
    noise = jax.tree.map(lambda p: jax.random.normal(key, p.shape), params)
    updates, state = tx.update(noise, state, params)
    return optax.apply_updates(params, updates), state

  hlo = jax.jit(step).lower(params, state, jax.random.key(0)).compile().as_text()
  assert "conditional(" not in hlo
  assert "jsparse24_rebuild_mask" in hlo
  step = jax.jit(step)
  flips_prev = {name: np.zeros(w.shape[:-2], np.float32) for name, w in w0.items()}
  for i in range(1, 5):
    before = params
    masks_before = optim.masks(state)
    params, state = step(params, state, jax.random.key(i))
    flips = state[0].flip_rate
    for name, layer in optim.masks(state).items():
      w = before[name]["kernel"]
      if i % 2 == 0:
        want = jsparse24.Mask24.pack(jsparse24.prune_24(w, transposable=kinds[name]),
                                     transposable=kinds[name])
        # The flip rate, counted by the kernel as it rebuilds.
        want_flips = optim.flip_fraction(masks_before[name]["mask"], want)
        assert float(np.min(want_flips)) > 0, (i, name)
      else:
        want = sparsity[name]["mask"] if i == 1 else want_prev[name]
        want_flips = flips_prev[name]
      assert _same_bits(layer["mask"].packed, want.packed), (i, name)
      np.testing.assert_array_equal(np.asarray(flips[name]), np.asarray(want_flips))
    want_prev = {name: layer["mask"] for name, layer in optim.masks(state).items()}
    flips_prev = {name: np.asarray(f) for name, f in flips.items()}


def test_flags_after_a_dense_warmup_in_a_donating_step():
  """A step that donates params and optimizer state (as examples/train_lm.py
  does) through a dense warm-up: after it every layer's `active` flag is
  True and its sparsity 0.5. On the GPU XLA wrote a value returned at
  several donated places into only some of them (jax-ml/jax#39625), and the
  flags of a GPT's up-projections stayed False (`optim._apart`)."""
  import functools  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from jsparse24 import optim  # pylint: disable=g-import-not-at-top
  shapes = {f"block_{b}": {"up": (256, 1024), "down": (1024, 256)} for b in range(2)}
  params = {b: {name: {"kernel": jax.random.normal(jax.random.key(i), shape)}
                for i, (name, shape) in enumerate(layers.items())} for b, layers in shapes.items()}
  sparsity = {b: {name: {"mask": jsparse24.Mask24.from_weights(layer["kernel"], transposable=True),
                         "active": None} for name, layer in layers.items()}
              for b, layers in params.items()}
  schedule = optim.MaskSchedule(warmup_steps=2, rebuild_every=3)
  tx = optax.chain(optim.mask_update(sparsity, schedule, decay=2e-4), optax.adamw(1e-3))
  state = jax.jit(tx.init)(params)  # as train_lm's

  @functools.partial(jax.jit, donate_argnums=(0, 1), static_argnames="phase")
  def step(params, state, key, phase):
    del phase  # as train_lm's: one program per phase
    noise = jax.tree.map(lambda p: jax.random.normal(key, p.shape), params)
    updates, state = tx.update(noise, state, params)
    return optax.apply_updates(params, updates), state

  for i in range(6):
    params, state = step(params, state, jax.random.key(i), phase=schedule.phase(i))
    want = bool(schedule.sparse(i + 1))
    flags = {path: bool(layer["active"]) for path, layer in
             jsparse24.linen.layers_by_path(optim.masks(state)).items()}
    assert flags == {path: want for path in flags}, (i, flags)
    assert all(float(layer["sparsity"]) == (0.5 if want else 0.0)
               for layer in optim.stats(state).values()), (i, optim.stats(state))


@pytest.mark.parametrize("m", [1, 100, 2048])
@pytest.mark.parametrize("k,n", [(4096, 4096), (1028, 520)])
@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 1e-2), (jnp.float16, 2e-3), (jnp.float32, 1e-5)])
def test_matmul_matches_reference(m, k, n, dtype, tol):
  x = jax.random.normal(jax.random.key(m), (m, k), dtype)
  w = jax.random.normal(jax.random.key(k), (k, n), dtype)
  sp = jsparse24.compress(w, implementation="pallas")
  got = jsparse24.sparse_dot(x, sp, implementation="pallas").astype(jnp.float32)
  ref = jnp.dot(x.astype(jnp.float32), jsparse24.decompress(sp).astype(jnp.float32),
                precision=jax.lax.Precision.HIGHEST)
  assert got.shape == (m, n)
  err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
  assert err < tol, err


@pytest.mark.parametrize("gradient", ["ste", "masked"])
@pytest.mark.parametrize("transposable", [False, True])
def test_sparse_dot_pallas_forward_and_vjp(gradient, transposable):
  x = jax.random.normal(jax.random.key(0), (3, 300, 1024), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (1024, 2048), jnp.bfloat16)
  mask = jsparse24.Mask24.from_weights(w, transposable=transposable)

  f = lambda x, w: jsparse24.sparse_dot(x, w, mask, gradient=gradient, implementation="pallas")  # noqa: E731
  dy = jax.random.normal(jax.random.key(2), (3, 300, 2048), jnp.bfloat16)
  y, vjp = jax.vjp(jax.jit(f), x, w)
  got = (y,) + vjp(dy)
  # Against float32 (not the "xla" backend, whose dw is the same XLA product),
  # within the rounding of the bfloat16 results (_ROUNDING below).
  ref = jax.jit(_dense_reference, static_argnums=1)(
      mask.unpack(), gradient, x.reshape(-1, 1024), w, dy.reshape(-1, 2048))
  for name, g, r in zip(("y", "dx", "dw"), got, ref):
    assert _rel_err(g.reshape(r.shape), r) < 2.0 ** -8, (name, _rel_err(g.reshape(r.shape), r))


# ---------------------------------------------------------------------------
# The cuSPARSELt backend (sparse tensor cores, through the XLA FFI).
# ---------------------------------------------------------------------------

def _rel_err(got, ref):
  got, ref = jnp.asarray(got, jnp.float32), jnp.asarray(ref, jnp.float32)
  return float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))


def _mask_for(kind, w):
  """(mask argument, transposable argument) for sparse_dot."""
  if kind == "mask24_t":
    return jsparse24.Mask24.from_weights(w, transposable=True), None
  if kind == "mask24":
    return jsparse24.Mask24.from_weights(w), None
  if kind == "dense_bool":
    return jsparse24.prune_24(w), None
  if kind == "none_t":
    return None, True
  return None, False


def _fwd_bwd(impl, mask, transposable, gradient, x, w, dy):
  f = lambda x, w: jsparse24.sparse_dot(  # noqa: E731
      x, w, mask, gradient=gradient, transposable=transposable, implementation=impl)
  y, vjp = jax.vjp(jax.jit(f), x, w)
  return (y,) + vjp(dy)


# Result rounding to the output dtype (round to nearest): the relative error
# of one value is at most 2^-8 (bfloat16) or 2^-11 (float16), and over many
# values its root mean square is about a third of that. The inputs are the
# same on both sides and the products accumulate in float32, so the rounding
# of y, dx and dw is all that separates them from the float32 reference: the
# tolerances are that bound (not a looser one).
_ROUNDING = {jnp.dtype(jnp.bfloat16): 2.0 ** -8, jnp.dtype(jnp.float16): 2.0 ** -11}


def _dense_reference(keep, gradient, x, w, dy):
  """(y, dx, dw) of `x @ (w * keep)` in float32 at full precision."""
  hi = jax.lax.Precision.HIGHEST
  wm = jnp.where(keep, w.astype(jnp.float32), 0.0)
  x32, dy32 = x.astype(jnp.float32), dy.astype(jnp.float32)
  dw = jnp.dot(x32.T, dy32, precision=hi)
  return (jnp.dot(x32, wm, precision=hi), jnp.dot(dy32, wm.T, precision=hi),
          jnp.where(keep, dw, 0.0) if gradient == "masked" else dw)


@pytest.mark.parametrize("kind", ["mask24_t", "mask24", "dense_bool", "none", "none_t"])
@pytest.mark.parametrize("gradient", ["ste", "masked"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("m,k,n", [(100, 512, 256), (1, 64, 64), (257, 192, 320),
                                   (4096, 1024, 2048)])
def test_cusparselt_matches_reference(kind, gradient, dtype, m, k, n):
  """y, dx and dw against a float32 reference of the masked product (not the
  "xla" backend, whose dw is the same XLA product), within the rounding of
  the result to `dtype`."""
  key = jax.random.split(jax.random.key(m * 7 + k), 3)
  x = jax.random.normal(key[0], (m, k), dtype)
  w = jax.random.normal(key[1], (k, n), dtype)
  dy = jax.random.normal(key[2], (m, n), dtype)
  mask, transposable = _mask_for(kind, w)
  keep = (mask.unpack() if isinstance(mask, jsparse24.Mask24) else mask) if mask is not None \
      else jsparse24.Mask24.from_weights(w, transposable=transposable).unpack()
  got = _fwd_bwd("cusparselt", mask, transposable, gradient, x, w, dy)
  ref = jax.jit(_dense_reference, static_argnums=1)(keep, gradient, x, w, dy)
  tol = _ROUNDING[jnp.dtype(dtype)]
  for name, g, r in zip(("y", "dx", "dw"), got, ref):
    assert g.shape == r.shape and g.dtype == dtype, name
    assert _rel_err(g, r) < tol, (name, _rel_err(g, r), tol)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("k,n", [(256, 128), (192, 320), (4096, 2048)])
def test_cusparselt_buffers_equal_compress2(dtype, k, n):
  # Our per-step compression (Pallas kernel + metadata) writes exactly what
  # cusparseLtSpMMACompress2 writes, both directions.
  from jsparse24.backends import cusparselt  # pylint: disable=g-import-not-at-top
  w = jax.random.normal(jax.random.key(k + n), (k, n), dtype)
  mask = jsparse24.Mask24.from_weights(w, transposable=True)
  op = jax.jit(cusparselt.CusparseltBackend().prepare, static_argnums=2)(w, mask, True)
  masked = jnp.where(mask.unpack(), w, jnp.zeros((), dtype))
  want_fwd = jax.jit(lambda a: cusparselt.compress(a, transpose=False))(masked)
  want_bwd = jax.jit(lambda a: cusparselt.compress(a, transpose=True))(masked)
  assert _same_bits(op.fwd, want_fwd) and _same_bits(op.bwd, want_bwd)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("k,n", [(256, 128), (192, 320), (4096, 2048)])
def test_compressed_weight_relaid_out_as_compress2_writes_it(dtype, k, n):
  # A Sparse24 re-laid out for cuSPARSELt by the Pallas passes
  # (`forward_buffer`) holds exactly what cusparseLtSpMMACompress2 writes
  # for the weight it stands for.
  from jsparse24.backends import cusparselt  # pylint: disable=g-import-not-at-top
  w = jax.random.normal(jax.random.key(k + n), (k, n), dtype)
  sp = jax.jit(lambda w: jsparse24.compress(w, implementation="pallas"))(w)
  got = jax.jit(cusparselt.forward_buffer)(sp)
  want = jax.jit(lambda a: cusparselt.compress(a, transpose=False))(jsparse24.decompress(sp))
  assert _same_bits(got, want)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("k,n", [(256, 128), (192, 320), (4096, 2048)])
def test_cusparselt_layout_is_what_compress2_writes_for_the_transpose(dtype, k, n):
  # `compress(..., cusparselt=True)`'s values are byte for byte what
  # cusparseLtSpMMACompress2 writes for the structured `[N, K]` operand read
  # transposed (the transposed buffer of w^T), with no transpose of the
  # kept values.
  from jsparse24.backends import cusparselt  # pylint: disable=g-import-not-at-top
  w = jax.random.normal(jax.random.key(k * n), (k, n), dtype)
  sp = jax.jit(lambda w: jsparse24.compress(w, cusparselt=True))(w)
  assert sp.cusparselt and sp.values.shape == cusparselt.buffer_shape(n, k, transpose=True)
  want = jax.jit(lambda a: cusparselt.compress(a, transpose=True))(jsparse24.decompress(sp).T)
  assert _same_bits(sp.values, want)


@pytest.mark.parametrize("implementation", ["pallas", "cusparselt", None])
@pytest.mark.parametrize("m,k,n", [(1, 4096, 4096), (3, 192, 320), (17, 256, 128),
                                   (2048, 1024, 512), (100, 320, 448)])
def test_cusparselt_layout_products_match(implementation, m, k, n):
  """A weight in cuSPARSELt's layout multiplies as its portable Sparse24 does
  on every backend (the decode kernel reads its first N rows in place;
  cuSPARSELt the whole buffer), forward and both gradients."""
  w = jax.random.normal(jax.random.key(m + k), (k, n), jnp.bfloat16)
  x = jax.random.normal(jax.random.key(n), (m, k), jnp.bfloat16)
  sp = jsparse24.compress(w, implementation="pallas")
  sc = jsparse24.compress(w, cusparselt=True)

  def loss(impl):
    return lambda x, s: jnp.sum(jsparse24.sparse_dot(x, s, implementation=impl)
                                .astype(jnp.float32) ** 2)

  got_y = jax.jit(lambda x, s: jsparse24.sparse_dot(x, s, implementation=implementation))(x, sc)
  want_y = jax.jit(lambda x, s: jsparse24.sparse_dot(x, s, implementation="xla"))(x, sp)
  assert _rel_err(got_y, want_y) < 1e-2
  gx, gs = jax.jit(jax.grad(loss(implementation), (0, 1), allow_int=True))(x, sc)
  wx, ws = jax.jit(jax.grad(loss("xla"), (0, 1), allow_int=True))(x, sp)
  assert _rel_err(gx, wx) < 1e-2
  assert _rel_err(gs.values[:n], ws.values) < 1e-2
  assert not np.asarray(gs.values[n:], np.float32).any()  # the metadata rows


@pytest.mark.parametrize("tokens", [8, 512])
def test_moe_compressed_in_cusparselt_layout_matches_portable(tokens):
  """Stacked expert kernels in cuSPARSELt's layout, multiplied under vmap
  (the decode kernel at few rows per expert, cuSPARSELt at many)."""
  e, d, h = 4, 256, 512
  model = jsparse24.SparseMoE(num_experts=e, hidden=h, top_k=2)
  x = jax.random.normal(jax.random.key(0), (2, tokens, d), jnp.bfloat16)
  v = model.init(jax.random.key(1), x)
  params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), v["params"])
  portable = jsparse24.compress_params(params, v["sparsity"])
  laid_out = jsparse24.compress_params(params, v["sparsity"], cusparselt=True)
  assert laid_out["experts"]["up"]["kernel"].cusparselt
  got = jax.jit(model.apply)({"params": laid_out}, x)
  want = jax.jit(model.apply)({"params": portable}, x)
  assert _rel_err(got, want) < 1e-2


@pytest.mark.parametrize("rows,groups", [(4096, 1024), (192, 80), (64, 8)])
@pytest.mark.parametrize("by_groups", [False, True])
def test_cusparselt_metadata_kernel_on_gpu(rows, groups, by_groups):
  """The compiled metadata pass writes the bytes of `metadata_layout` in
  place (`tests.test_cusparselt.check_metadata_pass`), from the packed mask
  or its transpose."""
  from jsparse24.backends import cusparselt  # pylint: disable=g-import-not-at-top
  from tests.test_cusparselt import check_metadata_pass, write_by_groups  # pylint: disable=g-import-not-at-top
  write = jax.jit(write_by_groups if by_groups else cusparselt._with_metadata,  # pylint: disable=protected-access
                  static_argnums=(1, 3))
  check_metadata_pass(write, rows, groups, head=3 * 64, cols=64, dtype=jnp.bfloat16,
                      seed=rows + groups)


def test_cusparselt_matmul_rejects_a_wrong_buffer():
  from jsparse24.backends import cusparselt  # pylint: disable=g-import-not-at-top
  x = jnp.ones((16, 256), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"bfloat16\[144, 128\]"):
    cusparselt.matmul(x, jnp.zeros((128, 128), jnp.bfloat16), k=256, n=128)


def test_cusparselt_under_vmap_checkpoint_pmap():
  x = jax.random.normal(jax.random.key(0), (3, 40, 256), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(1), (256, 128), jnp.bfloat16)
  ws = jax.random.normal(jax.random.key(2), (3, 256, 128), jnp.bfloat16)
  mask = jsparse24.Mask24.from_weights(w, transposable=True)

  def loss(impl):
    return lambda x, w: jnp.sum(jsparse24.sparse_dot(x, w, mask, implementation=impl) ** 2)

  # vmap over activations (folds into M), remat, stacked weights, pmap.
  cases = [
      (jax.vmap(jax.grad(loss("cusparselt"), (0, 1)), (0, None)),
       jax.vmap(jax.grad(loss("xla"), (0, 1)), (0, None)), (x, w)),
      (jax.grad(jax.checkpoint(loss("cusparselt")), (0, 1)),
       jax.grad(jax.checkpoint(loss("xla")), (0, 1)), (x, w)),
  ]
  stacked = lambda impl: jax.vmap(  # noqa: E731
      lambda x, w: jsparse24.sparse_dot(x, w, transposable=True, implementation=impl))
  cases.append((stacked("cusparselt"), stacked("xla"), (x, ws)))
  # Stacked weights' gradients (a mixture of experts): each product one
  # cuSPARSELt call for the whole stack, forward and dx.
  stacked_grad = lambda impl: jax.grad(  # noqa: E731
      lambda x, w: jnp.sum(stacked(impl)(x, w).astype(jnp.float32) ** 2), (0, 1))
  cases.append((stacked_grad("cusparselt"), stacked_grad("xla"), (x, ws)))
  pm = lambda impl: jax.pmap(jax.grad(loss(impl), (0, 1)), in_axes=(0, None))  # noqa: E731
  n_dev = jax.local_device_count()
  cases.append((pm("cusparselt"), pm("xla"), (jnp.broadcast_to(x[0], (n_dev, 40, 256)), w)))
  for got_fn, ref_fn, args in cases:
    got, ref = jax.jit(got_fn)(*args), jax.jit(ref_fn)(*args)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
      assert g.shape == r.shape
      assert _rel_err(g, r) < 1e-2


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("transposable", [False, True])
def test_cusparselt_on_a_one_device_mesh(axis_type, transposable):
  """The cuSPARSELt buffers and the product's gradients on a 1-device mesh
  (x sharded on its rows, w on N) equal the plain call's bit for bit: the
  metadata pass and the products' sharding wiring on the GPU (with
  Explicit axes they run in shard_maps, and the gradients carry the
  arguments' sharding types)."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from jsparse24.backends import cusparselt  # pylint: disable=g-import-not-at-top
  k, n, m = 1024, 2048, 512
  w = jax.random.normal(jax.random.key(0), (k, n), jnp.bfloat16)
  x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
  mask = jsparse24.Mask24.from_weights(w, transposable=transposable)
  prepare = jax.jit(lambda w: cusparselt.compress_for_products(w, mask, transposable))
  loss = lambda x, w: jnp.sum(jsparse24.sparse_dot(  # noqa: E731
      x, w, mask, implementation="cusparselt").astype(jnp.float32) ** 2)
  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  want = prepare(w), grad(x, w)
  mesh = jax.make_mesh((1,), ("d",), axis_types=(getattr(jax.sharding.AxisType, axis_type),),
                       devices=jax.devices()[:1])
  with jax.set_mesh(mesh):
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "d")))
    got = prepare(ws), grad(jax.device_put(x, NamedSharding(mesh, P("d", None))), ws)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert _same_bits(g, r)


def test_cusparselt_rejects_unsupported_calls():
  x = jnp.ones((8, 256), jnp.float32)
  w = jnp.ones((256, 128), jnp.float32)
  with pytest.raises(jsparse24.BackendUnavailableError, match="bfloat16 or float16"):
    jsparse24.sparse_dot(x, w, implementation="cusparselt")
  with pytest.raises(jsparse24.BackendUnavailableError, match="multiples of 64"):
    jsparse24.sparse_dot(jnp.ones((8, 96), jnp.bfloat16), jnp.ones((96, 128), jnp.bfloat16),
                         implementation="cusparselt")
  with pytest.raises(jsparse24.BackendUnavailableError, match="opaque"):
    jsparse24.compress(w.astype(jnp.bfloat16), implementation="cusparselt")
  # float32 falls back to the next backend under implementation=None.
  assert jsparse24.selected_implementation((8, 256), (256, 128), jnp.float32) != "cusparselt"


@pytest.mark.parametrize("implementation", ["pallas", "cusparselt"])
def test_compressed_weight_with_leading_axes(implementation):
  """A Sparse24 weight applied to x[B, T, K] (what a compressed model does)
  gives [B, T, N]; the cusparselt product read x's first axis as M before
  sparse_dot flattened the leading axes."""
  k, n = 256, 128
  w = jax.random.normal(jax.random.key(0), (k, n), jnp.bfloat16)
  x = jax.random.normal(jax.random.key(1), (4, 32, k), jnp.bfloat16)
  sp = jsparse24.compress(w, transposed=True, implementation="pallas")
  got = jsparse24.sparse_dot(x, sp, implementation=implementation)
  assert got.shape == (4, 32, n)
  want = jsparse24.sparse_dot(x, sp, implementation="xla")
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("transposed", [False, True])
def test_cusparselt_grad_through_a_compressed_weight(transposed):
  """Differentiable in x and in the kept values (no transpose rule before)."""
  w = jax.random.normal(jax.random.key(0), (256, 128), jnp.bfloat16)
  x = jax.random.normal(jax.random.key(1), (64, 256), jnp.bfloat16)
  sp = jsparse24.compress(w, transposed=transposed, implementation="pallas")

  def loss(impl):
    return lambda x, v: jnp.sum(jsparse24.sparse_dot(
        x, jsparse24.Sparse24(v, sp.meta, sp.values_t, sp.meta_t),
        implementation=impl).astype(jnp.float32) ** 2)

  got = jax.jit(jax.grad(loss("cusparselt"), (0, 1)))(x, sp.values)
  want = jax.jit(jax.grad(loss("xla"), (0, 1)))(x, sp.values)
  for g, r in zip(got, want):
    g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
    assert np.linalg.norm(g - r) / np.linalg.norm(r) < 1e-2


_RESTART_SCRIPT = """
import hashlib, json, sys
import jax, jax.numpy as jnp, numpy as np
import jsparse24
from jsparse24.backends import cusparselt
x = jax.random.normal(jax.random.key(0), (4096, 1024), jnp.bfloat16)
w = jax.random.normal(jax.random.key(1), (1024, 2048), jnp.bfloat16)
dy = jax.random.normal(jax.random.key(2), (4096, 2048), jnp.bfloat16)
mask = jsparse24.Mask24.from_weights(w, transposable=True)
y, vjp = jax.vjp(lambda x, w: jsparse24.sparse_dot(x, w, mask, implementation="cusparselt"),
                 x, w)
dx, _ = vjp(dy)
digest = hashlib.sha256(np.asarray(y).tobytes() + np.asarray(dx).tobytes()).hexdigest()
print(json.dumps({"searches": cusparselt._library().jsp_cusparselt_searches(),
                  "digest": digest}))
"""


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cusparselt_algorithm_choice_survives_a_restart(tmp_path, dtype):
  """A second process reads the first one's algorithm searches from the cache
  file instead of searching (bfloat16: cusparseLtMatmulSearch's pick timed
  beside the configuration ids; float16: jsparse24's own search), and
  computes the same bits."""
  import json, os, subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-imports
  script = _RESTART_SCRIPT.replace("jnp.bfloat16", f"jnp.{dtype}")
  env = {**os.environ, "JSPARSE24_CACHE_DIR": str(tmp_path)}

  def run():
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=600, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])

  first, second = run(), run()
  assert first["searches"] == 2, first  # the forward and the dx product
  assert (tmp_path / "cusparselt-algorithms.txt").read_text().count("\n") == 2
  assert second["searches"] == 0, second
  assert second["digest"] == first["digest"]


_THREADS_SCRIPT = """
import concurrent.futures, json
import jax, jax.numpy as jnp
from jsparse24.backends import cusparselt
jax.local_devices()  # the backend up, as before any program is compiled
shapes = [(k, n) for k in (2048, 4096, 8192, 16384) for n in (2048, 4096, 8192, 16384)]
with concurrent.futures.ThreadPoolExecutor(16) as pool:
  sizes = list(pool.map(lambda s: cusparselt.compressed_size(jnp.bfloat16, *s), shapes))
print(json.dumps([[k, n, size] for (k, n), size in zip(shapes, sizes)]))
"""


def test_cusparselt_sizes_asked_first_from_other_threads():
  """The first calls into cuSPARSELt from 16 new threads at once (as
  programs compiled in a thread pool make them: `benchmarks/sweep_decode.py`)
  each get the layout's size. Twice such a sweep on an H100 stopped with
  cuSPARSELt 0.8.0 reporting 0 bytes (`_check_size` refused the weight;
  nvidia-h100-80gb-hbm3.md, 2026-12-06 and 2026-12-07), not reproduced
  since; this is the pattern to catch it. A process of its own: the sizes
  are cached once asked."""
  import json, subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-imports
  from jsparse24.backends import cusparselt  # pylint: disable=g-import-not-at-top
  out = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT], capture_output=True, text=True,
                       timeout=300, check=True).stdout
  for k, n, size in json.loads(out.strip().splitlines()[-1]):
    rows, cols = cusparselt.buffer_shape(k, n, transpose=False)
    assert size == rows * cols * 2, (k, n, size)


def test_cusparselt_training_is_the_same_without_pallas_triton():
  """Three training steps of a bfloat16 SparseDense model on the
  "cusparselt" backend (stored transposable and plain masks, a mask pruned
  per call, mask rebuilds; `tests/triton_removal.py`) in a process with
  `JSPARSE24_DISABLE_PALLAS_TRITON=1`, where XLA code writes cuSPARSELt's
  buffers, and in one without: the buffers' bits are the same, so the
  losses and parameters are, bit for bit. Both processes take cuSPARSELt's
  default algorithm (`triton_removal.main`) and XLA's untimed GEMM choices
  (`--xla_gpu_autotune_level=0`): a timed choice may differ between two
  processes. Dense weight gradients: the MVUE kernel's float32 arithmetic
  on the GPU may move a draw (`test_mvue_compress_kernel_on_gpu`)."""
  import os  # pylint: disable=g-import-not-at-top
  from tests import triton_removal  # pylint: disable=g-import-not-at-top
  env = {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0"}
  kernels = triton_removal.run("--steps", "3", switch=False, env=env)
  fallback = triton_removal.run("--steps", "3", switch=True, env=env)
  assert kernels["reason"] is None and kernels["fallback_warnings"] == [], kernels
  assert fallback["reason"] and len(fallback["fallback_warnings"]) == 1, fallback
  assert fallback["kernel_modules"] == [] and fallback["triton_modules"] == [], fallback
  assert np.isfinite(kernels["losses"]).all(), kernels["losses"]
  assert fallback["losses"] == kernels["losses"], (fallback["losses"], kernels["losses"])
  assert fallback["digest"] == kernels["digest"]


# --- weight_grad="mvue": the pruning kernel and the weight-gradient product --------------


@pytest.mark.parametrize("shape,dtype", [((4096, 4096), jnp.bfloat16), ((192, 320), jnp.float16),
                                         ((1024, 2048), jnp.bfloat16)])
def test_mvue_compress_kernel_on_gpu(shape, dtype):
  """The compiled kernel draws the reference's groups. Triton's float32
  division (not correctly rounded) and fused multiply-adds may move a
  probability by an ulp, which can flip a draw whose uniform number lies
  within that ulp of a boundary (about 1e-7 per group), and move a kept
  value by an ulp of float32 before rounding to `dtype`."""
  from pallas_kernels import mvue24, mvue_rule  # pylint: disable=g-import-not-at-top
  g = jax.random.normal(jax.random.key(shape[0]), shape, dtype)
  g = g.at[:8].set(0).at[8:12, :5].set(jnp.array([0, 1, 0, 0], dtype)[:, None])
  seed = jsparse24._mvue.mvue_seeds(jax.random.key(11))
  buf, meta = mvue24.mvue_compress(g, seed, 64)
  values, meta_ref = jax.jit(mvue_rule.mvue_compress_reference)(g, seed, 64)
  codes = lambda m: np.stack([np.asarray(m) & 0xF, np.asarray(m) >> 4], -1)  # noqa: E731
  same = codes(meta) == codes(meta_ref)
  assert 1.0 - same.mean() <= 1e-5, 1.0 - same.mean()
  m = shape[0]
  got = np.asarray(buf[:m // 2], np.float32).reshape(m // 4, 2, -1)
  want = np.asarray(values, np.float32).reshape(m // 4, 2, -1)
  # codes [M/8, N, 2] (byte row r holds group rows 2r, 2r + 1) -> [M/4, 1, N]
  agree = same.transpose(0, 2, 1).reshape(m // 4, -1)[:, None, :]
  np.testing.assert_allclose(np.where(agree, got, 0), np.where(agree, want, 0),
                             rtol=2.0 ** -7 if dtype == jnp.bfloat16 else 2.0 ** -10)


@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 1e-2), (jnp.float16, 2e-3)])
@pytest.mark.parametrize("m,k,n", [(2048, 1024, 512), (1003, 512, 256), (3, 64, 64),
                                   (8192, 4096, 4096)])
def test_cusparselt_mvue_weight_grad(dtype, tol, m, k, n):
  """dw = x^T mvue_24(dy) on the sparse tensor cores against XLA's dense
  product of the reference's pruned dy (float32): they differ by the
  result's rounding to `dtype` (cuSPARSELt writes its input dtype, and the
  result stays in it, so that data parallelism all-reduces 16-bit partial
  sums as for a dense `x^T dy`) and the rare draws of
  test_mvue_compress_kernel_on_gpu. M = 1003 has a tail of 3 rows (kept
  exactly, then rounded with the rest) and pads to 1024; M = 3 is all tail."""
  from jsparse24.backends import cusparselt  # pylint: disable=g-import-not-at-top
  kx, kd, kk = jax.random.split(jax.random.key(m + k + n), 3)
  x = jax.random.normal(kx, (m, k), dtype)
  dy = jax.random.normal(kd, (m, n), dtype)
  got = jax.jit(cusparselt.mvue_weight_grad)(x, dy, kk)
  want = jax.jit(lambda x, dy, kk: jnp.dot(
      x.T.astype(jnp.float32), jsparse24.mvue_24(dy, kk, axis=0).astype(jnp.float32),
      precision=jax.lax.Precision.HIGHEST))(x, dy, kk)
  assert got.shape == (k, n) and got.dtype == dtype
  assert _rel_err(got, want) < tol, _rel_err(got, want)


def test_cusparselt_stacked_mvue_weight_grad():
  """The MVUE weight gradient of stacked experts under `vmap` (one
  compression pass and one cuSPARSELt call for the stack, each expert with
  its own key) equals each expert's own call bit for bit; M = 1003 has a
  tail of 3 rows."""
  from jsparse24.backends import cusparselt  # pylint: disable=g-import-not-at-top
  e, m, k, n = 4, 1003, 512, 256
  kx, kd, kk = jax.random.split(jax.random.key(7), 3)
  x = jax.random.normal(kx, (e, m, k), jnp.bfloat16)
  dy = jax.random.normal(kd, (e, m, n), jnp.bfloat16)
  keys = jax.random.split(kk, e)
  got = jax.jit(jax.vmap(cusparselt.mvue_weight_grad))(x, dy, keys)
  one = jax.jit(cusparselt.mvue_weight_grad)
  assert got.shape == (e, k, n)
  for i in range(e):
    assert _same_bits(got[i], one(x[i], dy[i], keys[i])), i


def test_sparse_moe_with_mvue_weight_grads_on_cusparselt():
  """`SparseMoE(weight_grad="mvue")` on cuSPARSELt: with `"active": None`
  (what `optim.masks` passes outside dense phases) the experts' products
  and MVUE weight gradients run as one call per stack; with a traced
  `active` flag, one expert after another. The two agree on the experts'
  gradients bit for bit, and both are near the reference backend's with
  the same keys (a few MVUE draws flip where the products round
  differently: 2.6-3.7% of the norm on a CPU with XLA's products)."""
  x = jax.random.normal(jax.random.key(0), (2, 128, 256), jnp.bfloat16)

  def grads(impl, active):
    layer = jsparse24.SparseMoE(num_experts=4, hidden=512, dtype=jnp.bfloat16,
                                weight_grad="mvue", implementation=impl)
    variables = layer.init(jax.random.key(1), x)
    if not active:
      variables["sparsity"] = {"experts": {name: {"mask": v["mask"], "active": None}
                                           for name, v in variables["sparsity"]["experts"].items()}}
    loss = lambda p, x: jnp.sum(layer.apply(  # noqa: E731
        {**variables, "params": p}, x, rngs={"mvue": jax.random.key(2)}).astype(jnp.float32) ** 2)
    return jax.jit(jax.grad(loss, (0, 1)))(variables["params"], x)

  stacked, looped, ref = grads("cusparselt", False), grads("cusparselt", True), grads("xla", False)
  for name in ("up", "down"):
    assert _same_bits(stacked[0]["experts"][name]["kernel"], looped[0]["experts"][name]["kernel"])
  for g, r in zip(jax.tree.leaves(stacked), jax.tree.leaves(ref)):
    assert g.shape == r.shape and g.dtype == r.dtype
    assert _rel_err(g, r) < 6e-2, _rel_err(g, r)


@pytest.mark.parametrize("kind", ["mask24_t", "none"])
@pytest.mark.parametrize("gradient", ["ste", "masked"])
def test_cusparselt_sparse_dot_with_mvue_weight_grad(kind, gradient):
  kx, kw, kd = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (4, 256, 1024), jnp.bfloat16)
  w = jax.random.normal(kw, (1024, 2048), jnp.bfloat16)
  dy = jax.random.normal(kd, (4, 256, 2048), jnp.bfloat16)
  mask, transposable = _mask_for(kind, w)

  def run(impl):
    f = lambda x, w: jsparse24.sparse_dot(  # noqa: E731
        x, w, mask, gradient=gradient, transposable=transposable, implementation=impl,
        weight_grad="mvue", key=jax.random.key(5))
    y, vjp = jax.vjp(jax.jit(f), x, w)
    return (y,) + vjp(dy)

  got, ref = run("cusparselt"), run("xla")
  for name, g, r in zip(("y", "dx", "dw"), got, ref):
    assert g.shape == r.shape and g.dtype == r.dtype, name
    assert _rel_err(g, r) < 1e-2, (name, _rel_err(g, r))


def test_sparse_dense_mvue_on_cusparselt_with_a_float32_kernel():
  """The layer (float32 kernel, bfloat16 compute) with weight_grad="mvue":
  the kernel's gradient is float32, close to the reference backend's."""
  x = jax.random.normal(jax.random.key(0), (8, 128, 512), jnp.bfloat16)

  def grads(impl):
    layer = jsparse24.SparseDense(1024, dtype=jnp.bfloat16, weight_grad="mvue",
                                  implementation=impl)
    variables = layer.init(jax.random.key(1), x)
    params, rest = variables["params"], {c: v for c, v in variables.items() if c != "params"}
    loss = lambda p: jnp.sum(layer.apply(  # noqa: E731
        {"params": p, **rest}, x, rngs={"mvue": jax.random.key(2)}).astype(jnp.float32) ** 2)
    return jax.jit(jax.grad(loss))(params)

  got, ref = grads("cusparselt"), grads("xla")
  assert got["kernel"].dtype == jnp.float32
  assert _rel_err(got["kernel"], ref["kernel"]) < 1e-2, _rel_err(got["kernel"], ref["kernel"])
  assert _rel_err(got["bias"], ref["bias"]) < 1e-2


@pytest.mark.parametrize("impl", ["pallas", "cusparselt"])
@pytest.mark.parametrize("gradient", ["ste", "masked"])
def test_forward_mode_on_the_gpu_kernels(impl, gradient):
  """jax.jvp and jax.linearize of the product on the GPU kernels against a
  float32 reference of the tangent (x_dot @ (w*m) + x @ w_dot, w_dot * m when
  "masked"), and jacfwd against jacrev at a small shape."""
  m, k, n = 256, 512, 256
  ks = jax.random.split(jax.random.key(11), 4)
  x, xt = (jax.random.normal(kk, (m, k), jnp.bfloat16) for kk in ks[:2])
  w, wt = (jax.random.normal(kk, (k, n), jnp.float32) for kk in ks[2:])
  mask = jsparse24.Mask24.from_weights(w, transposable=True)
  keep = mask.unpack()
  # bfloat16 weights: with float32 ones the product promotes to float32,
  # which cuSPARSELt does not run (the layers cast; their jvp is tested on CPU).
  w, wt = w.astype(jnp.bfloat16), wt.astype(jnp.bfloat16)
  f = jax.jit(lambda x, w: jsparse24.sparse_dot(x, w, mask, gradient=gradient,
                                                implementation=impl))
  _, tangent = jax.jit(lambda *a: jax.jvp(f, a[:2], a[2:]))(x, w, xt, wt)
  _, lin = jax.linearize(f, x, w)
  hi = jax.lax.Precision.HIGHEST
  wm = jnp.where(keep, w.astype(jnp.bfloat16).astype(jnp.float32), 0.0)
  wt_used = jnp.where(keep, wt, 0.0) if gradient == "masked" else wt
  want = (jnp.dot(xt.astype(jnp.float32), wm, precision=hi)
          + jnp.dot(x.astype(jnp.float32), wt_used.astype(jnp.bfloat16).astype(jnp.float32),
                    precision=hi))
  tol = _ROUNDING[jnp.dtype(jnp.bfloat16)]
  assert tangent.dtype == f(x, w).dtype == jnp.bfloat16
  assert _rel_err(tangent, want) < tol, _rel_err(tangent, want)
  assert _rel_err(lin(xt, wt), want) < tol
  small = (jax.random.normal(ks[0], (64, 64), jnp.float16),
           jax.random.normal(ks[1], (64, 64), jnp.float16))
  g = lambda w: jsparse24.sparse_dot(small[0], w, implementation=impl,  # noqa: E731
                                     transposable=True).astype(jnp.float32).sum(0)
  jf, jr = jax.jacfwd(g)(small[1]), jax.jacrev(g)(small[1])
  assert _rel_err(jf, jr) < _ROUNDING[jnp.dtype(jnp.float16)]


def _cusparselt_products_in_scanned_gradient(policy=None) -> int:
  """The cuSPARSELt products in the compiled gradient of 3 MLP blocks in
  `nn.scan` (with `nn.remat(..., policy=policy)` unless None); each scan
  body is written once in the HLO, so these are per block."""
  return _scanned_gradient_hlo(policy).count('custom_call_target="jsparse24_cusparselt_matmul"')


def _scanned_gradient_hlo(policy=None) -> str:
  """The compiled gradient of `_cusparselt_products_in_scanned_gradient`'s model."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  d, h = 256, 1024

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      up = jsparse24.SparseDense(h, implementation="cusparselt", use_bias=False,
                                 dtype=jnp.bfloat16, name="up")
      down = jsparse24.SparseDense(d, implementation="cusparselt", use_bias=False,
                                   dtype=jnp.bfloat16, name="down")
      return x + down(nn.gelu(up(x))), None

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      block = Block if policy is None else nn.remat(Block, policy=policy, prevent_cse=False)
      stack = nn.scan(block, variable_axes={"params": 0, "sparsity": 0},
                      split_rngs={"params": True}, length=3)
      return stack(name="blocks")(x, None)[0]

  x = jax.random.normal(jax.random.key(0), (2048, d), jnp.bfloat16)
  model = Model()
  variables = model.init(jax.random.key(1), x)

  def loss(params):
    return jnp.sum(model.apply({**variables, "params": params}, x).astype(jnp.float32) ** 2)

  return jax.jit(jax.grad(loss)).lower(variables["params"]).compile().as_text()


def test_cusparselt_product_is_not_computed_twice_under_scan():
  """Blocks in `nn.scan` whose product is both kept for the backward pass
  (the up-projection, GELU's input) and read by the next op: XLA's GPU
  dynamic-slice fusion used to compute such an FFI call a second time, to
  write it straight into the scan's stacked buffer (the d_model 2048 model
  of bench_model.py lost 3% to it). One product per layer and direction:
  up and down forward, their dx backward."""
  assert _cusparselt_products_in_scanned_gradient() == 4


def test_forward_pass_under_remat_compresses_without_the_transposed_copy():
  """With remat saving nothing, the forward pass throws the compressed
  operand away, so its compression writes only the forward copy (the plain
  kernel); the backward pass's writes both (the fused kernel), once per
  weight. Without remat the forward pass keeps both: fused kernels only."""

  def compressions(hlo):  # (fused calls: 3 results, plain calls: 1), per block
    calls = [line for line in hlo.splitlines()
             if "custom-call(" in line and "jsparse24_compress_with_meta" in line]
    fused = sum(bool(re.search(r"= \(\S+, \S+, \S+\) custom-call\(", c)) for c in calls)
    return fused, len(calls) - fused

  assert compressions(_scanned_gradient_hlo()) == (2, 0)
  assert compressions(_scanned_gradient_hlo(jax.checkpoint_policies.nothing_saveable)) == (2, 2)


def test_cusparselt_products_saved_by_jsparse24_dot_policies_under_remat():
  """Under remat, JAX's dot policy does not see the cuSPARSELt products
  (custom calls): the backward pass recomputes up's (5 per block);
  `jsparse24.checkpoint_policies` saves them as JAX's saves dense dots (4)."""
  cp = jax.checkpoint_policies
  assert _cusparselt_products_in_scanned_gradient(cp.dots_with_no_batch_dims_saveable) == 5
  assert _cusparselt_products_in_scanned_gradient(
      jsparse24.checkpoint_policies.dots_with_no_batch_dims_saveable) == 4


# --- the cuSPARSELt library the user chose is the one that runs ---------------------

_TORCH_FIRST_SCRIPT = r"""
import json, re
import torch  # torch loads its own libcusparseLt.so.0 at import
torch.zeros(1, device="cuda")
import jax, jax.numpy as jnp, numpy as np
import jsparse24
from jsparse24.backends import _cusparselt_build as build
lib = build.load()
w = jax.random.normal(jax.random.key(0), (256, 192), jnp.bfloat16)
x = jax.random.normal(jax.random.key(1), (64, 256), jnp.bfloat16)
mask = jsparse24.Mask24.from_weights(w, transposable=True)
got = jsparse24.sparse_dot(x, w, mask, implementation="cusparselt")
ref = jsparse24.sparse_dot(x, w, mask, implementation="xla")
err = float(jnp.linalg.norm((got - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
files = sorted({l.split()[-1] for l in open("/proc/self/maps") if "libcusparseLt.so" in l})
print(json.dumps({"version": build.version(lib), "err": err, "files": files}))
"""


def _header_version(home) -> str:
  text = (home / "include" / "cusparseLt.h").read_text()
  part = lambda name: re.search(rf"#define CUSPARSELT_VER_{name}\s+(\d+)", text).group(1)  # noqa: E731
  return f"{part('MAJOR')}.{part('MINOR')}.{part('PATCH')}"


def test_the_chosen_cusparselt_runs_beside_torchs(tmp_path):
  """A process that imports torch first (which loads its own
  libcusparseLt.so.0) and points JSPARSE24_CUSPARSELT_HOME at another
  cuSPARSELt install computes with that install: both files are mapped, the
  shim reports the chosen one's version, and its products are right. Needs
  JSPARSE24_TEST_CUSPARSELT_HOME: an install (include/, lib/) of a version
  other than torch's."""
  import json, os, pathlib, subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-imports
  other = os.environ.get("JSPARSE24_TEST_CUSPARSELT_HOME")
  if not other:
    pytest.skip("set JSPARSE24_TEST_CUSPARSELT_HOME to a cuSPARSELt install other than torch's")
  want = _header_version(pathlib.Path(other))
  env = {**os.environ, "JSPARSE24_CUSPARSELT_HOME": other, "JSPARSE24_CACHE_DIR": str(tmp_path)}
  out = subprocess.run([sys.executable, "-c", _TORCH_FIRST_SCRIPT], env=env, capture_output=True,
                       text=True, timeout=600, check=True).stdout
  got = json.loads(out.strip().splitlines()[-1])
  assert got["version"] == want, got
  assert len(got["files"]) == 2 and any(f.startswith(os.path.realpath(other)) for f in got["files"]), got
  assert got["err"] < 1e-2, got


@pytest.mark.parametrize("shape,dtype,layout", [
    ((4096, 16384), jnp.bfloat16, "sparse24"), ((17, 36), jnp.float16, "sparse24"),
    ((4096, 16384), jnp.bfloat16, "cusparselt")])
def test_input_prune_compress_matches_reference(shape, dtype, layout):
  """2:4 activations: the compiled kernel writes the bytes of the reference
  (the Sparse24 of x^T), rows of x pruned along K."""
  from jsparse24._format import compress_reference
  from jsparse24._prune import prune_24
  from pallas_kernels import input_prune24
  x = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(dtype)
  values, meta = input_prune24.prune_compress_rows(x, layout=layout)
  ref = compress_reference(x.T, prune_24(x.T, axis=0), False)
  m = shape[0]
  assert _same_bits(values[:m], ref.values)
  assert _same_bits(meta, ref.meta)


@pytest.mark.parametrize("m,k,dtype", [(4096, 16384, jnp.bfloat16), (192, 320, jnp.float16)])
def test_cusparselt_input_sparse_buffer_is_cusparselts(m, k, dtype):
  """2:4 activations: the Pallas pass's compressed x (values, then the
  metadata pass) is byte for byte what cusparseLtSpMMACompress2 writes for
  the pruned x as the product's structured B."""
  from jsparse24._prune import prune_24
  from jsparse24.backends import cusparselt
  x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(dtype)
  # Ties (kept: the lower indices). No kept value is zero: cuSPARSELt's
  # compress then picks its own positions for the zeros, with other codes.
  x = x.at[5, :8].set(1.0)
  xm = jnp.where(prune_24(x, axis=-1), x, 0)
  ours = jax.jit(cusparselt.input_compress_for_product)(x)
  theirs = jax.jit(cusparselt.compress_input)(xm)
  assert ours.shape == theirs.shape == cusparselt.buffer_shape(m, k, transpose=True)
  assert _same_bits(ours, theirs)


@pytest.mark.parametrize("m,k,dtype", [(4096, 4096, jnp.bfloat16), (192, 320, jnp.float16)])
def test_cusparselt_tile_buffers_are_cusparselts(m, k, dtype):
  """2:4 activations on 4x4 tiles: the transposable compress pass's two
  copies of x are byte for byte what cusparseLtSpMMACompress2 writes for
  the pruned x as the input product's structured B (along K) and as a
  weight's structured A contracted over M (along M)."""
  from jsparse24._input_sparse import input_mask
  from jsparse24.backends import cusparselt
  x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(dtype)
  xm = jnp.where(input_mask(x, True), x, 0)
  along_m, along_c, _ = jax.jit(cusparselt.tiles_compress_for_products)(x)
  assert _same_bits(along_c, jax.jit(cusparselt.compress_input)(xm))
  assert _same_bits(along_m, jax.jit(lambda a: cusparselt.compress(a, transpose=False))(xm))


def _activation_products_match_xla(dtype, m, k, n, option_sets):
  """Draws x `[m, k]`, w `[k, n]`, dy `[m, n]` and checks, for each option
  set of `sparse_dot` (a tuple of pairs), forward and gradients on
  "cusparselt" against the "xla" backend's (the same rules, dense
  products). Returns `(vjp, x, w, dy)`, `vjp(impl, options, x, w, dy)`."""
  x = jax.random.normal(jax.random.key(1), (m, k), jnp.float32).astype(dtype)
  w = (jax.random.normal(jax.random.key(2), (k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
  dy = jax.random.normal(jax.random.key(3), (m, n), jnp.float32).astype(dtype)

  # x, w and dy are arguments, not constants of the program: XLA constant-
  # folds products of constants at compile time, on the host (minutes at
  # M = 2000).
  def vjp(impl, options, x, w, dy):
    y, back = jax.vjp(lambda x, w: jsparse24.sparse_dot(x, w, implementation=impl,
                                                        **dict(options)), x, w)
    return (y, *back(dy))

  for options in option_sets:
    got = jax.jit(vjp, static_argnums=(0, 1))("cusparselt", options, x, w, dy)
    want = jax.jit(vjp, static_argnums=(0, 1))("xla", options, x, w, dy)
    for g, r in zip(got, want):
      assert g.dtype == r.dtype == dtype
      err = float(jnp.linalg.norm((g - r).astype(jnp.float32))
                  / jnp.linalg.norm(r.astype(jnp.float32)))
      assert err < 1e-2, (options, err)
  return vjp, x, w, dy


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("m,k,n", [(3, 192, 320), (2000, 1024, 4096)])
def test_cusparselt_pruned_weight_grad_products_match_xla(dtype, m, k, n):
  """`transposable=True`, or `weight_grad="2:4"`, with `input_sparsity`
  and/or `grad_output` on the "cusparselt" backend (y or dx with the pruned
  operand as the structured B, dw with it, pruned along the tokens, as the
  structured A): forward and gradients against the "xla" backend's, M not
  a multiple of 4 or 64."""
  pruned = ((("input_sparsity", "masked"),), (("grad_output", "2:4"),),
            (("input_sparsity", "masked"), ("grad_output", "2:4")))
  _activation_products_match_xla(
      dtype, m, k, n, [p + (("transposable", True),) for p in pruned]
      + [p + (("weight_grad", "2:4"),) for p in pruned])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("m,k,n", [(1, 128, 64), (3, 192, 320), (17, 4096, 1024),
                                   (2000, 1024, 4096)])
def test_cusparselt_input_sparse_product_matches_xla(dtype, m, k, n):
  """`sparse_dot(..., input_sparsity=g, implementation="cusparselt")`: x pruned
  and compressed by the Pallas pass, the product on the sparse tensor cores
  with x as the structured operand; with `grad_output="2:4"` (alone or with
  the input pruned), dx with the pruned output gradient as the structured
  operand. Forward and gradients against the "xla" backend's (the same
  rules, dense products), M not a multiple of 64."""
  vjp, x, w, dy = _activation_products_match_xla(
      dtype, m, k, n, ((("input_sparsity", "masked"),), (("input_sparsity", "ste"),),
                       (("grad_output", "2:4"),),
                       (("input_sparsity", "masked"), ("grad_output", "2:4"))))
  # The products are cuSPARSELt's (the CPU tests
  # test_cusparselt_product_takes_the_kernels_buffer_as_its_sparse_operand
  # and test_cusparselt_grad_output_takes_the_output_gradient_as_its_sparse_
  # operand check the calls' operands and sizes): the forward with the input
  # pruned, the backward with the output gradient pruned.
  hlo = jax.jit(lambda x, w: jsparse24.sparse_dot(
      x, w, input_sparsity="masked", implementation="cusparselt")).lower(x, w).as_text()
  assert "jsparse24_cusparselt_matmul" in hlo
  options = (("grad_output", "2:4"),)
  hlo = jax.jit(vjp, static_argnums=(0, 1)).lower("cusparselt", options, x, w, dy).as_text()
  assert "jsparse24_cusparselt_matmul" in hlo
