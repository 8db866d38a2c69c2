"""Forward-mode autodiff (`jax.jvp`, `jax.linearize`, `jacfwd`) of the sparse
product on every backend that runs on CPU (the Pallas one in interpret mode),
its agreement with reverse mode, and batching: the GPU backends' product is a
custom_jvp whose tangent is one primitive transposed by the backward pass."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse24
from jsparse24.backends import BACKENDS
from jsparse24.backends.base import DotConfig
from jsparse24.backends.pallas import interpret_mode

M, K, N = 6, 16, 12
HI = jax.lax.Precision.HIGHEST


def _data(seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  x, w, xt, wt = (jax.random.normal(k, s) for k, s in zip(ks, [(M, K), (K, N), (M, K), (K, N)]))
  return x, w, xt, wt, jsparse24.Mask24.from_weights(w, transposable=True)


def _dot(impl, gradient, active):
  """The backend's product (with the dense-phase flag `active`, or without)."""
  cfg = DotConfig(gradient=gradient, transposable=True, precision=HI)
  return lambda x, w, mask: BACKENDS[impl].dot(x, w, mask, active, cfg)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("gradient", ["ste", "masked"])
@pytest.mark.parametrize("active", [None, True, False, "static dense"])
def test_jvp_linearize_and_jacfwd_agree_with_reverse_mode(impl, gradient, active):
  """`active`: a traced flag (True, False), None (2:4) or STATIC_DENSE (dense,
  decided while tracing: no conditional, no operand)."""
  x, w, xt, wt, mask = _data()
  if isinstance(active, bool) and impl == "xla":
    pytest.skip("the reference backend has no separate dense-phase path")
  act = (jsparse24.linen.STATIC_DENSE if active == "static dense"
         else None if active is None else jnp.asarray(active))
  f = lambda x, w: _dot(impl, gradient, act)(x, w, mask)  # noqa: E731
  m = np.asarray(mask.unpack()) | (active is False or active == "static dense")
  wm = np.where(m, np.asarray(w), 0.0)
  # The tangent: x_dot @ (w*m) + x @ w_dot, with w_dot * m where the gradient
  # is "masked" (the adjoint of the backward pass's dw), dense in a dense phase.
  wt_used = np.where(m, np.asarray(wt), 0.0) if gradient == "masked" else np.asarray(wt)
  want = np.asarray(xt) @ wm + np.asarray(x) @ wt_used
  # Jitted: eagerly, each primitive of the linearized function and of the
  # Jacobians' batched products was compiled on its own.
  with interpret_mode():
    y, tangent = jax.jit(lambda x, w, xt, wt: jax.jvp(f, (x, w), (xt, wt)))(x, w, xt, wt)
    lin_tangent = jax.jit(lambda x, w, xt, wt: jax.linearize(f, x, w)[1](xt, wt))(x, w, xt, wt)
    jac_fwd, jac_rev = jax.jit(lambda x, w: (jax.jacfwd(f, argnums=(0, 1))(x, w),
                                             jax.jacrev(f, argnums=(0, 1))(x, w)))(x, w)
  np.testing.assert_allclose(y, np.asarray(x) @ wm, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(tangent, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(lin_tangent, want, rtol=1e-5, atol=1e-5)
  for a, b in zip(jac_fwd, jac_rev):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_jvp_in_x_alone_and_in_w_alone():
  x, w, xt, wt, mask = _data(1)
  wm = np.where(mask.unpack(), w, 0.0)
  with interpret_mode():
    f = lambda x, w: jsparse24.sparse_dot(x, w, mask, implementation="pallas")  # noqa: E731
    _, tx = jax.jvp(lambda x: f(x, w), (x,), (xt,))
    _, tw = jax.jvp(lambda w: f(x, w), (w,), (wt,))
  np.testing.assert_allclose(tx, np.asarray(xt) @ wm, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(tw, np.asarray(x) @ np.asarray(wt), rtol=1e-5, atol=1e-5)


def test_sparse_dense_forward_mode_like_nn_dense():
  """The drop-in layer supports jax.jvp in its params, as nn.Dense does."""
  x = jax.random.normal(jax.random.key(2), (4, K))
  layer = jsparse24.SparseDense(N, implementation="pallas")
  with interpret_mode():
    v = layer.init(jax.random.key(3), x)
    t = jax.tree.map(jnp.ones_like, v["params"])
    _, got = jax.jvp(lambda p: layer.apply({**v, "params": p}, x), (v["params"],), (t,))
  # STE tangent in the kernel: x @ ones + the bias tangent.
  want = nn.Dense(N).apply({"params": t}, x)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_grad_of_vmap_folds_the_batch_into_one_product():
  """grad(vmap(f)) over activations with a shared weight: the batch axis is
  folded into the rows, so dw is one product (no per-example [B, K, N] and no
  loop); vmap(grad(f)) still gives per-example gradients."""
  b = 3
  xs = jax.random.normal(jax.random.key(4), (b, M, K))
  _, w, _, _, mask = _data(5)
  f = lambda x, w: jsparse24.sparse_dot(x, w, mask, implementation="pallas")  # noqa: E731
  loss = lambda w: jax.vmap(lambda x: f(x, w).sum())(xs).sum()  # noqa: E731
  with interpret_mode():
    jaxpr = jax.make_jaxpr(jax.grad(loss))(w)
    got = jax.grad(loss)(w)
    per_example = jax.vmap(jax.grad(lambda w, x: f(x, w).sum()), in_axes=(None, 0))(w, xs)
  shapes, prims = set(), set()

  def walk(j):
    for e in j.eqns:
      prims.add(e.primitive.name)
      shapes.update(tuple(v.aval.shape) for v in e.outvars if hasattr(v.aval, "shape"))
      if e.primitive.name == "pallas_call":  # a kernel's body (its grid loops in interpret mode)
        continue
      for p in e.params.values():
        for sub in p if isinstance(p, (tuple, list)) else (p,):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            walk(inner)
  walk(jaxpr.jaxpr)
  assert (b, K, N) not in shapes and not {"scan", "while"} & prims, (prims, shapes)
  want = np.asarray(xs).reshape(-1, K).T @ np.ones((b * M, N))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(per_example.sum(0), want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(per_example[0], np.asarray(xs[0]).T @ np.ones((M, N)),
                             rtol=1e-5, atol=1e-5)


def test_jacfwd_with_batched_weights_runs_slice_by_slice():
  """vmap over weights (and their masks): the tangent runs per slice."""
  ws = jax.random.normal(jax.random.key(6), (2, K, N))
  x, _, xt, _, _ = _data(7)
  masks = jax.vmap(lambda w: jsparse24.Mask24.from_weights(w, transposable=True))(ws)
  with interpret_mode():
    f = jax.vmap(lambda w, m: jax.jvp(
        lambda x: jsparse24.sparse_dot(x, w, m, implementation="pallas"), (x,), (xt,))[1])
    got = f(ws, masks)
  for i in range(2):
    wm = np.where(jax.tree.map(lambda a: a[i], masks).unpack(), ws[i], 0.0)
    np.testing.assert_allclose(got[i], np.asarray(xt) @ wm, rtol=1e-5, atol=1e-5)


def test_jvp_of_a_stack_under_jit_is_one_stacked_product():
  """vmap over activations, tangents, weights and masks together (a stack
  of products, as a mixture of experts has): one stacked tangent product,
  lowered under jit (the eager tests above run its implementation only)."""
  ws = jax.random.normal(jax.random.key(9), (3, K, N))
  xs, xts = (jax.random.normal(jax.random.key(s), (3, M, K)) for s in (10, 11))
  masks = jax.vmap(lambda w: jsparse24.Mask24.from_weights(w, transposable=True))(ws)
  with interpret_mode():
    f = jax.jit(jax.vmap(lambda x, xt, w, m: jax.jvp(
        lambda x: jsparse24.sparse_dot(x, w, m, implementation="pallas"), (x,), (xt,))))
    assert "jsparse24_sparse_dot_tangent_stacked" in str(jax.make_jaxpr(f)(xs, xts, ws, masks))
    ys, tangents = f(xs, xts, ws, masks)
  for i in range(3):
    wm = np.where(jax.tree.map(lambda a: a[i], masks).unpack(), ws[i], 0.0)
    np.testing.assert_allclose(ys[i], np.asarray(xs[i]) @ wm, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tangents[i], np.asarray(xts[i]) @ wm, rtol=1e-5, atol=1e-5)


def test_forward_mode_with_mvue_is_a_clear_error():
  x, w, xt, wt, mask = _data(8)
  f = lambda w: jsparse24.sparse_dot(x, w, mask, implementation="pallas",  # noqa: E731
                                     weight_grad="mvue", key=jax.random.key(0))
  with interpret_mode(), pytest.raises(TypeError, match="weight_grad='mvue'.*forward-mode"):
    jax.jvp(f, (w,), (wt,))


def test_a_tangent_of_x_alone_has_no_term_for_w():
  """Linearized in x alone (w held fixed: a frozen layer, or a gradient with
  respect to the activations only), the tangent is one product of x's
  tangent: w's zero tangent stays symbolic, so nothing multiplies zeros."""
  x, w, xt, _, mask = _data(12)
  with interpret_mode():
    y, lin = jax.linearize(lambda x: jsparse24.sparse_dot(x, w, mask, implementation="pallas"), x)
    jaxpr = str(jax.make_jaxpr(lin)(xt))
    tangent = lin(xt)
  assert jaxpr.count("jsparse24_sparse_dot_tangent") == 1, jaxpr
  assert "linear=(True, False)" in jaxpr, jaxpr
  wm = np.where(mask.unpack(), w, 0.0)
  np.testing.assert_allclose(tangent, np.asarray(xt) @ wm, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(y, np.asarray(x) @ wm, rtol=1e-5, atol=1e-5)
