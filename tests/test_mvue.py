"""MVUE 2:4 pruning of the output gradient (`weight_grad="mvue"`): the
estimator's statistics against its formula, its edge cases, and the weight
gradient of `sparse_dot` and the layers on every CPU-testable backend."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jsparse24
from jsparse24 import nnx as jnnx
from jsparse24.backends.pallas import interpret_mode
from pallas_kernels import mvue_rule


# The estimator and the kernel's reference, jitted: called outside jit they
# run op by op, and each call of a new shape compiles dozens of one-operation
# programs (most of this module's time on a CPU). The tests check values;
# `test_deterministic_for_a_key` checks the op-by-op call against these.
_mvue_24 = jax.jit(jsparse24.mvue_24, static_argnames="axis")
_probabilities = jax.jit(jsparse24.mvue_24_probabilities, static_argnames="axis")
_compress_reference = jax.jit(mvue_rule.mvue_compress_reference, static_argnames="row_stride")


def _groups_last(a):
  """[M, N] (M a multiple of 4) -> [M/4, N, 4]."""
  return np.moveaxis(np.asarray(a).reshape(a.shape[0] // 4, 4, -1), 1, -1)


def test_probabilities_are_the_minimum_variance_marginals():
  g = jnp.array([[1., 2., 3., 4.],      # spread: 2|a| / sum
                 [8., 1., 1., 2.],      # one entry >= half: kept, others by magnitude
                 [3., -1., 0., 0.],     # two non-zeros: both kept
                 [0., 0., 5., 0.],      # one non-zero: kept, one zero drawn among 3
                 [0., 0., 0., 0.],
                 [-2., 2., 2., 2.]]).T
  p = np.asarray(_probabilities(g, axis=0)).T
  np.testing.assert_allclose(p, [[0.2, 0.4, 0.6, 0.8], [1, 0.25, 0.25, 0.5], [1, 1, 0, 0],
                                 [1 / 3, 1 / 3, 1, 1 / 3], [1, 1 / 3, 1 / 3, 1 / 3],
                                 [0.5, 0.5, 0.5, 0.5]], rtol=1e-6)
  rng = np.random.default_rng(0)
  g = rng.standard_normal((36, 7)) * (rng.random((36, 7)) < 0.7)
  p = _groups_last(_probabilities(g, axis=0))
  np.testing.assert_allclose(p.sum(-1), 2.0, rtol=1e-6)
  assert p.max() <= 1.0 and p.min() >= 0.0


def test_two_kept_per_group_each_rescaled_by_its_probability():
  rng = np.random.default_rng(1)
  g = (rng.standard_normal((40, 9)) * (rng.random((40, 9)) < 0.8)).astype(np.float32)
  p = _groups_last(_probabilities(g, axis=0))
  nonzero = (_groups_last(g) != 0).sum(-1)
  for seed in range(20):
    out = np.asarray(_mvue_24(jnp.asarray(g), jax.random.key(seed), axis=0))
    kept = _groups_last(out) != 0
    # Exactly 2 drawn per group: the non-zeros among them show.
    np.testing.assert_array_equal(kept.sum(-1), np.minimum(nonzero, 2) * (nonzero <= 2)
                                  + np.where(nonzero > 2, kept.sum(-1), 0))
    assert (kept.sum(-1) <= 2).all() and (kept.sum(-1)[nonzero >= 2] == 2).all()
    np.testing.assert_allclose(_groups_last(out)[kept], (_groups_last(g) / np.where(
        p > 0, p, 1))[kept], rtol=1e-6)


@jax.jit
def _rule_spec(a, u):
  """The MVUE rule as first written (float32 jnp ops under jit, so with
  the reference's arithmetic, subnormals flushed as XLA does): the weights
  case by case, each index by counting the cumulative sums at or below its
  point and mending to 0 <= i0 < i1 <= 3, each value `a_i / p_i` by cases.
  The kernel's form (`pallas_kernels.mvue_rule.sample`) computes the same
  things with fewer operations and must give the same bits."""
  f32 = jnp.float32
  m = jnp.abs(a)
  total = ((m[:, 0] + m[:, 1]) + m[:, 2]) + m[:, 3]
  top = jnp.maximum(jnp.maximum(m[:, 0], m[:, 1]), jnp.maximum(m[:, 2], m[:, 3]))
  hit = m == top[:, None]
  first = hit & (jnp.cumsum(hit, axis=1) == 1)
  r = jnp.where(first, f32(0), m)
  rest = ((r[:, 0] + r[:, 1]) + r[:, 2]) + r[:, 3]
  capped, none_left = f32(2) * top >= total, rest == 0
  scale = jnp.where(capped, jnp.where(none_left, f32(3), rest), total)
  w = jnp.where(capped[:, None], jnp.where(first, scale[:, None],
                                         jnp.where(none_left[:, None], f32(1), m)), f32(2) * m)
  c = [w[:, 0], w[:, 0] + w[:, 1]]
  c.append(c[1] + w[:, 2])
  v0, v1 = u * scale, (u + f32(1)) * scale
  i0 = jnp.minimum(sum((x <= v0).astype(jnp.int32) for x in c), 2)
  i1 = jnp.minimum(jnp.maximum(sum((x <= v1).astype(jnp.int32) for x in c), i0 + 1), 3)
  rows = jnp.arange(len(a))
  out = []
  for i in (i0, i1):
    x = a[rows, i]
    mag = jnp.where(capped, jnp.where(first[rows, i], jnp.abs(x), rest), total * f32(0.5))
    out.append(jnp.where(x > 0, mag, jnp.where(x < 0, -mag, f32(0))))
  return i0, i1, out[0], out[1]


def test_the_kernels_rule_gives_the_bits_of_the_rule_as_first_written():
  """`mvue_rule.sample` against `_rule_spec` on groups that reach every
  case: spread, capped, ties, zeros, one and two non-zeros, NaN, +-inf,
  -0, subnormals, values near the float32 maximum (NaN outputs compared as
  NaN, whatever their sign)."""
  rng = np.random.default_rng(7)
  n = 1 << 16
  g = rng.standard_normal((n, 4)).astype(np.float32)
  special = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-40, -1e-45, 3e38, -3e38, 1.0,
                      -1.0, 0.5], np.float32)
  cases = [g, g * (rng.random((n, 4)) < 0.5), np.round(g * 2) / 2, g * np.float32(1e-39),
           np.where(rng.random((n, 4)) < 0.5, special[rng.integers(0, 12, (n, 4))], g),
           g * np.float32([10, 1, 1, 1])[rng.permutation(4)],
           np.where(rng.random((n, 4)) < 0.75, np.float32(0), np.round(g))]
  a = np.concatenate(cases).astype(np.float32)
  u = np.asarray(mvue_rule.uniform_pair(jnp.uint32(5), jnp.uint32(9),
                                        jnp.arange(len(a), dtype=jnp.uint32))[0])
  got = jax.jit(lambda a, u: mvue_rule.sample([a[:, l] for l in range(4)], u))(a, u)
  for name, x, y in zip(("i0", "i1", "v0", "v1"), got, _rule_spec(a, u)):
    x, y = np.asarray(x), np.asarray(y)
    if x.dtype == np.float32:
      same = (np.isnan(x) & np.isnan(y)) | (x.view(np.uint32) == y.view(np.uint32))
    else:
      same = x == y
    assert same.all(), (name, a[~same][:3], x[~same][:3], y[~same][:3])


def test_the_draw_mends_what_rounding_breaks_as_first_written():
  """The draw's indices from any non-negative weights (also ones whose
  cumulative sums jump past both points, as rounding can make them, and
  all-zero or NaN ones): the counts of the cumulative sums at or below
  `u * S` and `(u + 1) * S`, mended to 0 <= i0 < i1 <= 3."""
  rng = np.random.default_rng(8)
  n = 1 << 14
  w = rng.choice(np.float32([0, 0.25, 1, 3, 10, np.inf, np.nan]), (n, 3))
  scale = rng.choice(np.float32([0, 1, 2, 3, np.inf]), n)
  u = rng.choice(np.float32([0, 0.25, 0.5, 0.75, 1 - 2 ** -23]), n)

  @jax.jit
  def indices(w, scale, u):
    draw = mvue_rule._draw_predicates  # pylint: disable=protected-access
    p0, p1, r1, r2 = draw([w[:, 0], w[:, 1], w[:, 2]], scale, u)
    i = lambda *b: sum(x.astype(jnp.int32) for x in b)  # noqa: E731
    return i(p0, p1), 1 + i(r1, r2)

  i0, i1 = map(np.asarray, indices(w, scale, u))
  with np.errstate(invalid="ignore"):  # 0 * inf and inf - inf are NaN here, as on the GPU
    c = np.cumsum(w, axis=1, dtype=np.float32)
    want0 = np.minimum((c <= (u * scale)[:, None]).sum(1), 2)
    want1 = np.minimum(np.maximum((c <= ((u + 1) * scale)[:, None]).sum(1), want0 + 1), 3)
  np.testing.assert_array_equal(i0, want0)
  np.testing.assert_array_equal(i1, want1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_unbiased_with_the_formula_variance(dtype):
  """Over many keys, the mean is g and the variance g^2 (1/p - 1), each
  within 6 standard errors derived from the sample size."""
  g = jnp.asarray(np.random.default_rng(2).standard_normal((8, 6)), dtype)
  n = 4000
  outs = np.asarray(jax.jit(jax.vmap(lambda k: jsparse24.mvue_24(g, k, axis=0)))(
      jax.random.split(jax.random.key(3), n)).astype(jnp.float32)).astype(np.float64)
  a = np.asarray(g.astype(jnp.float32), np.float64)
  p = np.asarray(_probabilities(g, axis=0), np.float64)
  var = a * a * (1 / p - 1)
  # The kept value is rounded to g's dtype: allow that bias too.
  rounding = np.abs(a / p) * (2.0 ** -8 if dtype == jnp.bfloat16 else 2.0 ** -23)
  assert (np.abs(outs.mean(0) - a) <= 6 * np.sqrt(var / n) + rounding + 1e-12).all()
  # Central fourth moment of the two-point estimator, for the sample variance's error.
  mu4 = p * (a * (1 - p) / p) ** 4 + (1 - p) * a ** 4
  tol = 6 * np.sqrt(np.maximum(mu4 - var ** 2, 0) / n) + 4 * rounding * np.abs(a / p) + 1e-12
  assert (np.abs(outs.var(0) - var) <= tol).all()


def test_zero_single_nonzero_and_tail_are_exact():
  g = jnp.array([[0., 0., 0., 0., 1.5, -2.], [0., 7., 0., 0., 3., 0.]]).T  # rows 4, 5: tail
  for seed in range(10):
    out = _mvue_24(g, jax.random.key(seed), axis=0)
    np.testing.assert_array_equal(out, g)
  # axis=1, and a size below one group: unchanged.
  x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 10)), jnp.float32)
  out = _mvue_24(x, jax.random.key(0), axis=1)
  np.testing.assert_array_equal(out[:, 8:], x[:, 8:])
  assert ((np.asarray(out[:, :8]).reshape(3, 2, 4) != 0).sum(-1) == 2).all()
  np.testing.assert_array_equal(_mvue_24(x[:, :3], jax.random.key(0), axis=1), x[:, :3])


def test_deterministic_for_a_key():
  g = jnp.asarray(np.random.default_rng(5).standard_normal((64, 32)), jnp.bfloat16)
  # Op by op and jitted: the same bits.
  a, b = jsparse24.mvue_24(g, jax.random.key(7)), _mvue_24(g, jax.random.key(7))
  assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  assert np.asarray(b).tobytes() == np.asarray(_mvue_24(g, jax.random.key(7))).tobytes()
  assert not np.array_equal(a, _mvue_24(g, jax.random.key(8)))
  raw = jax.random.PRNGKey(7)  # raw uint32[2] keys work too
  assert _mvue_24(g, raw).shape == g.shape


def test_neighbouring_groups_draw_independently():
  """Groups 2t and 2t + 1 along the axis share one hash (its two 16-bit
  halves): their draws must still be independent. Equal groups [1, 2, 3, 4]
  (p = 0.2, 0.4, 0.6, 0.8) draw (0, 2), (1, 3) or (2, 3) with probability
  0.2, 0.4, 0.4; two independent draws agree with probability 0.36 (the
  same number would always agree)."""
  g = jnp.tile(jnp.array([1., 2., 3., 4.])[:, None], (64, 256))  # 64 x 256 equal groups
  codes = []
  for seed in range(4):
    out = np.asarray(_mvue_24(g, jax.random.key(seed), axis=0)).reshape(64, 4, 256)
    codes.append((out != 0).transpose(0, 2, 1) @ np.array([1, 2, 4, 8]))  # [64, 256]
  codes = np.stack(codes)
  patterns = np.bincount(codes.ravel(), minlength=16) / codes.size
  np.testing.assert_allclose(patterns[[5, 10, 12]], [0.2, 0.4, 0.4], atol=0.015)
  # 32768 pairs per comparison: the agreement's standard error is 0.0027.
  assert abs((codes[:, 0::2] == codes[:, 1::2]).mean() - 0.36) < 0.015  # the hash's pairs
  assert abs((codes[:, :, 0::2] == codes[:, :, 1::2]).mean() - 0.36) < 0.015  # columns
  assert abs((codes[0] == codes[1]).mean() - 0.36) < 0.02  # keys


def _data(m=22, k=16, n=12, dtype=jnp.float32):
  rng = np.random.default_rng(m + k + n)
  x = jnp.asarray(rng.standard_normal((2, m // 2, k)), dtype)
  w = jnp.asarray(rng.standard_normal((k, n)), dtype)
  dy = jnp.asarray(rng.standard_normal((2, m // 2, n)), dtype)
  return x, w, dy


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("gradient", ["ste", "masked"])
def test_sparse_dot_weight_grad_is_x_transposed_times_mvue_dy(implementation, gradient):
  x, w, dy = _data()
  mask = jsparse24.Mask24.from_weights(w, transposable=True)
  key = jax.random.key(11)

  def vjp(weight_grad):
    f = lambda x, w: jsparse24.sparse_dot(  # noqa: E731
        x, w, mask, gradient=gradient, implementation=implementation,
        weight_grad=weight_grad, key=key if weight_grad == "mvue" else None)

    @jax.jit
    def run(x, w, dy):
      y, back = jax.vjp(f, x, w)
      return (y,) + back(dy)
    with interpret_mode():
      return run(x, w, dy)

  y, dx, dw = vjp("mvue")
  y0, dx0, dw0 = vjp("dense")
  np.testing.assert_array_equal(y, y0)
  np.testing.assert_array_equal(dx, dx0)  # dx stays exact
  pruned = _mvue_24(dy.reshape(-1, dy.shape[-1]), key, axis=0)
  expected = x.reshape(-1, x.shape[-1]).T @ pruned
  if gradient == "masked":
    expected = expected * mask.unpack()
  np.testing.assert_allclose(dw, expected, rtol=1e-5, atol=1e-5)
  assert not np.allclose(dw, dw0)


def test_dense_phase_keeps_the_dense_weight_grad():
  """While a layer is dense (`active` False) its dw is the exact one."""
  from jsparse24._ops import sparse_or_dense_dot  # pylint: disable=g-import-not-at-top
  from jsparse24.linen import SparsityOptions  # pylint: disable=g-import-not-at-top
  x, w, dy = _data()
  mask = jsparse24.Mask24.from_weights(w)
  for implementation in ("xla", "pallas"):
    def dw(active, weight_grad):
      opts = SparsityOptions(gradient="ste", transposable=False,
                             implementation=implementation, weight_grad=weight_grad)
      f = lambda w, active: sparse_or_dense_dot(  # noqa: E731
          x, w, mask, active, opts, precision=None, key=jax.random.key(0))
      with interpret_mode():  # the flag a run-time value, as in a train step
        return jax.jit(lambda w, active: jax.vjp(lambda w: f(w, active), w)[1](dy)[0])(
            w, jnp.asarray(active))
    np.testing.assert_allclose(dw(False, "mvue"), dw(False, "dense"), rtol=1e-6)
    assert not np.allclose(dw(True, "mvue"), dw(True, "dense"))


def test_under_jit_vmap_and_remat():
  x, w, dy = _data()
  mask = jsparse24.Mask24.from_weights(w)
  key = jax.random.key(2)
  f = lambda x, w: jnp.vdot(jsparse24.sparse_dot(  # noqa: E731
      x, w, mask, weight_grad="mvue", key=key), dy)
  eager = jax.grad(f, (0, 1))(x, w)
  for transformed in (jax.jit(jax.grad(f, (0, 1))), jax.grad(jax.checkpoint(f), (0, 1))):
    for a, b in zip(transformed(x, w), eager):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  # vmap over activations with a shared weight: each example prunes its own dy.
  def dw(x, dy):
    return jax.grad(lambda w: jnp.vdot(jsparse24.sparse_dot(
        x, w, mask, weight_grad="mvue", key=key), dy))(w)

  per = jax.jit(jax.vmap(dw))(x, dy)
  one = jax.jit(dw)
  loop = jnp.stack([one(x[i], dy[i]) for i in range(x.shape[0])])
  np.testing.assert_allclose(per, loop, rtol=1e-5, atol=1e-5)


def test_pmap_each_device_prunes_its_own_gradient():
  n = 2
  x, w, dy = _data(m=2 * n * 8)
  mask = jsparse24.Mask24.from_weights(w)
  keys = jax.random.split(jax.random.key(4), n)
  xs = x.reshape(n, -1, x.shape[-1])
  dys = dy.reshape(n, -1, dy.shape[-1])

  def dw(x, dy, key):
    f = lambda w: jsparse24.sparse_dot(x, w, mask, weight_grad="mvue", key=key)  # noqa: E731
    return jax.vjp(f, w)[1](dy)[0]

  got = jax.pmap(dw, in_axes=(0, 0, 0), devices=jax.devices()[:n])(xs, dys, keys)
  one = jax.jit(dw)
  for i in range(n):
    np.testing.assert_allclose(got[i], one(xs[i], dys[i], keys[i]), rtol=1e-5, atol=1e-5)


def test_linen_layer_draws_from_the_mvue_stream():
  x, _, _ = _data()
  layer = jsparse24.SparseDense(12, weight_grad="mvue")
  variables = layer.init(jax.random.key(0), x)

  def dw(seed):
    return jax.grad(lambda p: layer.apply({**variables, "params": p}, x,
                                          rngs={"mvue": jax.random.key(seed)}).sum())(
                                              variables["params"])["kernel"]

  assert np.asarray(dw(1)).tobytes() == np.asarray(dw(1)).tobytes()
  assert not np.array_equal(dw(1), dw(2))
  # Inference needs no rng; the gradient names the stream it needs.
  np.testing.assert_array_equal(
      layer.apply(variables, x),
      jsparse24.SparseDense(12).apply(variables, x))
  with pytest.raises(ValueError, match=r"weight_grad='mvue'.*rngs=\{'mvue': key\}"):
    jax.grad(lambda p: layer.apply({**variables, "params": p}, x).sum())(variables["params"])
  # sparsify rules take the option too.
  model = nn.Dense(12, name="up")
  sparse = jsparse24.sparsify(nn.Sequential([model]), {r".*": {"weight_grad": "mvue"}})
  with pytest.raises(ValueError, match="weight_grad"):
    jsparse24.sparsify(nn.Sequential([model]), {r".*": {"weight_grad": "sparse"}})
  v = sparse.init(jax.random.key(0), x)
  sparse.apply(v, x, rngs={"mvue": jax.random.key(0)})


def test_nnx_layer_draws_a_new_key_per_call():
  x, _, _ = _data()
  layer = jnnx.SparseLinear(16, 12, weight_grad="mvue", rngs=nnx.Rngs(params=0, mvue=1))
  dense = nnx.Linear(16, 12, rngs=nnx.Rngs(params=0))
  np.testing.assert_array_equal(layer.kernel[...], dense.kernel[...])  # same params
  grads = [nnx.grad(lambda m: m(x).sum())(layer).kernel[...] for _ in range(2)]
  assert not np.array_equal(*grads)
  with pytest.raises(ValueError, match="'mvue'"):
    jnnx.SparseLinear(16, 12, weight_grad="mvue", rngs=nnx.Rngs(params=0))


def test_bad_arguments_are_named():
  x, w, _ = _data()
  with pytest.raises(ValueError, match=r"sparse_dot: weight_grad='mvue' needs `key`"):
    jsparse24.sparse_dot(x, w, weight_grad="mvue")
  with pytest.raises(TypeError, match=r"sparse_dot: `key` must be one PRNG key"):
    jsparse24.sparse_dot(x, w, weight_grad="mvue", key=jax.random.split(jax.random.key(0)))
  with pytest.raises(ValueError, match=r"sparse_dot: unknown weight_grad='sparse'"):
    jsparse24.sparse_dot(x, w, weight_grad="sparse")
  with pytest.raises(ValueError, match=r"sparse_dot: weight_grad='mvue' needs a dense `w`"):
    jsparse24.sparse_dot(x, jsparse24.compress(w), weight_grad="mvue", key=jax.random.key(0))
  # A key without weight_grad="mvue" was ignored: the dense weight gradient.
  for weight_grad, kw in (("dense", {}), ("2:4", dict(input_sparsity="masked"))):
    with pytest.raises(ValueError, match=r"sparse_dot: `key` is drawn from only with"
                       rf" weight_grad='mvue', got weight_grad='{weight_grad}'"):
      jsparse24.sparse_dot(x, w, weight_grad=weight_grad, key=jax.random.key(0), **kw)


def test_scanned_layers_with_a_split_stream():
  """Under nn.scan with "mvue" in split_rngs the stacked layers train with
  MVUE gradients, deterministically for a given key."""

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return jsparse24.SparseDense(16, weight_grad="mvue", use_bias=False)(x), None

  stack = nn.scan(Block, variable_axes={"params": 0, "sparsity": 0},
                  split_rngs={"params": True, "mvue": True}, length=2)()
  x = jnp.asarray(np.random.default_rng(6).standard_normal((8, 16)), jnp.float32)
  variables = stack.init(jax.random.key(0), x, None)
  params, sparsity = variables["params"], variables["sparsity"]

  @jax.jit
  def dw(seed):
    return jax.grad(lambda p: stack.apply({"params": p, "sparsity": sparsity}, x, None,
                                          rngs={"mvue": jax.random.key(seed)})[0].sum())(
                                              params)["SparseDense_0"]["kernel"]

  a = dw(3)
  assert np.asarray(a).tobytes() == np.asarray(dw(3)).tobytes()
  assert a.shape[0] == 2 and np.isfinite(np.asarray(a)).all()


def test_mvue_layer_computes_what_the_dense_grad_layer_computes():
  """Same forward with either weight_grad, also where pruning sees the
  compute dtype: magnitudes that tie only after the bfloat16 cast (the MVUE
  path once pruned the float32 kernel instead)."""
  x = jnp.asarray(np.random.default_rng(7).standard_normal((8, 64)), jnp.float32)

  def run(weight_grad):
    layer = jsparse24.SparseDense(32, dtype=jnp.bfloat16, mask_source="dynamic",
                                  weight_grad=weight_grad)
    kernel = layer.init(jax.random.key(0), x)["params"]["kernel"]
    kernel = kernel.at[::4].set(kernel[1::4] * (1 + 2 ** -12))
    return layer.apply({"params": {"kernel": kernel, "bias": jnp.zeros(32)}}, x,
                       rngs={"mvue": jax.random.key(1)})

  np.testing.assert_array_equal(run("mvue"), run("dense"))


# --- the GPU path's kernel and layout, in interpret mode -----------------------------


@pytest.mark.parametrize("shape,dtype", [((128, 192), jnp.bfloat16), ((64, 320), jnp.float16),
                                         ((192, 64), jnp.bfloat16)])
def test_mvue_compress_kernel_equals_the_reference(shape, dtype):
  from pallas_kernels import mvue24  # pylint: disable=g-import-not-at-top

  @jax.jit
  def gradient():
    g = jax.random.normal(jax.random.key(shape[0]), shape, dtype)
    # Zero groups, single non-zeros, a dominant entry, ties.
    g = g.at[:8].set(0).at[8:12, :5].set(jnp.array([0, 1, 0, 0], dtype)[:, None])
    g = g.at[12:16, 5:9].set(jnp.array([9, 1, 1, 1], dtype)[:, None])
    return g.at[16:20, 9:12].set(jnp.array([2, -2, 2, 2], dtype)[:, None])

  g = gradient()
  key = jax.random.key(7)
  seed = jsparse24._mvue.mvue_seeds(key)
  buf, meta = mvue24.mvue_compress(g, seed, 12, interpret=True)
  values, meta_ref = _compress_reference(g, seed, 12)
  m = shape[0]
  assert buf.shape == (m // 2 + m // 16, shape[1]) and meta.shape == (m // 8, shape[1])
  np.testing.assert_array_equal(np.asarray(buf[:m // 2]).view(np.uint16),
                                np.asarray(values).view(np.uint16))
  np.testing.assert_array_equal(meta, meta_ref)
  # With the first group numbered 0 it is mvue_24 itself, compressed.
  values, meta = _compress_reference(g, seed)
  # codes: Mask24's, transposed
  dense = jax.jit(lambda v, m: jsparse24.decompress(jsparse24.Sparse24(v.T, m.T)))(values, meta)
  np.testing.assert_array_equal(np.asarray(dense, np.float32),
                                np.asarray(_mvue_24(g, key, axis=0), np.float32))


def test_mvue_compress_of_row_blocks_draws_what_the_whole_does():
  # How each device of a data-parallel mesh prunes its own rows.
  from pallas_kernels import mvue24  # pylint: disable=g-import-not-at-top
  g = jax.random.normal(jax.random.key(0), (256, 128), jnp.bfloat16)
  seed = jsparse24._mvue.mvue_seeds(jax.random.key(1))
  whole, whole_meta = _compress_reference(g, seed)
  parts = [mvue24.mvue_compress(g[r:r + 64], seed, r // 4 * 128, interpret=True)
           for r in range(0, 256, 64)]
  np.testing.assert_array_equal(jnp.concatenate([b[:32] for b, _ in parts]), whole)
  np.testing.assert_array_equal(jnp.concatenate([m for _, m in parts]), whole_meta)


def test_mvue_compress_of_blocks_draws_what_the_whole_does():
  # How each device of a data x model mesh prunes its block (tensor
  # parallelism: dy split on N too): `row_stride` is the whole gradient's N.
  from pallas_kernels import mvue24  # pylint: disable=g-import-not-at-top
  g = jax.random.normal(jax.random.key(0), (128, 256), jnp.bfloat16)
  seed = jsparse24._mvue.mvue_seeds(jax.random.key(1))
  whole, whole_meta = _compress_reference(g, seed)
  for r in (0, 64):
    for c in (0, 64, 128, 192):
      block = g[r:r + 64, c:c + 64]
      buf, meta = mvue24.mvue_compress(block, seed, r // 4 * 256 + c, row_stride=256,
                                       interpret=True)
      np.testing.assert_array_equal(buf[:32], whole[r // 2:r // 2 + 32, c:c + 64])
      np.testing.assert_array_equal(meta, whole_meta[r // 8:r // 8 + 8, c:c + 64])
      ref, _ = _compress_reference(block, seed, r // 4 * 256 + c, row_stride=256)
      np.testing.assert_array_equal(ref, buf[:32])


def test_mvue_compress_rejects_bad_input():
  from pallas_kernels import mvue24
  seed = jnp.zeros((2,), jnp.uint32)
  with pytest.raises(ValueError, match="mvue_compress: M and N must be multiples of 64"):
    mvue24.mvue_compress(jnp.zeros((96, 64), jnp.bfloat16), seed, interpret=True)
  with pytest.raises(TypeError, match="mvue_compress: `g` must be bfloat16 or float16"):
    mvue24.mvue_compress(jnp.zeros((64, 64), jnp.float32), seed, interpret=True)
  with pytest.raises(ValueError, match=r"mvue_compress: `seed` must be uint32\[2\]"):
    mvue24.mvue_compress(jnp.zeros((64, 64), jnp.bfloat16), seed[:1], interpret=True)


def test_cusparselt_operand_of_the_pruned_gradient():
  # The buffer the cuSPARSELt weight-gradient product reads: mvue_24(dy)
  # compressed along M in cuSPARSELt's layout (values, then metadata), as
  # from_sparse24 lays out a weight compressed along K.
  from jsparse24.backends import cusparselt
  dy = jax.random.normal(jax.random.key(2), (192, 128), jnp.bfloat16)
  key = jax.random.key(3)
  with interpret_mode():
    buf = cusparselt.mvue_compress_for_product(dy, jsparse24._mvue.mvue_seeds(key))
  want, _ = jax.jit(lambda dy: cusparselt.from_sparse24(jsparse24.compress(
      jsparse24.mvue_24(dy, key, axis=0), jsparse24.mvue_24(dy, key, axis=0) != 0,
      implementation="xla")))(dy)
  assert buf.shape == cusparselt.buffer_shape(192, 128, transpose=False)
  np.testing.assert_array_equal(np.asarray(buf).view(np.uint16), np.asarray(want).view(np.uint16))


def test_mvue_24_names_a_bad_key_gradient_or_axis():
  """Were JAX's own errors ("unexpected PRNG key type <class 'NoneType'>"),
  or no error at all: an integer `g` came back with truncated rescaled
  values, and an `axis` past the rank was taken modulo the rank."""
  g, key = jnp.arange(8.0), jax.random.key(0)
  with pytest.raises(ValueError, match=r"mvue_24: the MVUE rule's draw needs `key`, a PRNG"
                     r" key \(jax.random.key\(...\)\)"):
    jsparse24.mvue_24(g, None)
  for bad in (3, jnp.ones(3), jax.random.split(key)):
    with pytest.raises(TypeError, match=r"mvue_24: `key` must be one PRNG key"):
      jsparse24.mvue_24(g, bad)
  assert jsparse24.mvue_24(g, jax.random.PRNGKey(0)).shape == (8,)  # a raw uint32[2] key
  for fn, call in (("mvue_24", lambda g, **kw: jsparse24.mvue_24(g, key, **kw)),
                   ("mvue_24_probabilities", jsparse24.mvue_24_probabilities)):
    with pytest.raises(TypeError, match=rf"{fn}: `g` must have a floating dtype .* got int32"):
      call(jnp.arange(8))
    with pytest.raises(ValueError, match=rf"{fn}: `axis=3` is out of range for `g` of rank 1"):
      call(g, axis=3)
    assert call(g, axis=-1).shape == (8,)
