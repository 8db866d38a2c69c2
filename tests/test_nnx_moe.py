"""`jsparse24.nnx.SparseMoE` against the plain-jnp reference of
tests/test_moe.py (forward, gradients), its masks per expert through
`nnx.rebuild_masks`, `nnx.compress_params`, `sparse=False` and the stored
load-balancing loss."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jsparse24
from jsparse24 import nnx as jnnx
from tests.test_moe import (OUTPUT_DTYPES, TOL, E, D, H, G, S, _reference, _routing, _probs,
                             _x)


def _model(**kw):
  return jnnx.SparseMoE(D, num_experts=E, hidden=H, rngs=nnx.Rngs(0), **kw)


def _params(m):
  return {"router": {"kernel": m.router.kernel[...]},
          "experts": {name: {"kernel": getattr(m.experts, name).kernel[...]}
                      for name in ("up", "down")}}


def _masks(m):
  return {name: np.asarray(getattr(m.experts, name).mask.get_value().unpack())
          for name in ("up", "down")}


def test_forward_and_gradients_match_the_reference():
  m = _model(top_k=2, capacity_factor=0.75)
  x = _x(0)
  params, masks = _params(m), _masks(m)
  keep = _routing(_probs(params, x), 2, jsparse24.moe.expert_capacity(S, E, 2, 0.75))
  np.testing.assert_allclose(m(x), _reference(params, masks, x, keep, gradient="ste"), **TOL)
  cot = _x(2)
  got = nnx.grad(lambda m: jnp.sum(m(x) * cot))(m)
  want = jax.grad(lambda p: jnp.sum(_reference(p, masks, x, keep, gradient="ste") * cot))(params)
  np.testing.assert_allclose(got["router"]["kernel"][...], want["router"]["kernel"], **TOL)
  for name in ("up", "down"):
    np.testing.assert_allclose(got["experts"][name]["kernel"][...],
                               want["experts"][name]["kernel"], **TOL)


def test_masks_are_per_expert_and_rebuild_from_each_experts_kernel():
  m = _model()
  masks = _masks(m)
  for name in ("up", "down"):
    kernel = getattr(m.experts, name).kernel[...]
    assert not np.array_equal(masks[name][0], masks[name][1])
    for e in range(E):
      np.testing.assert_array_equal(masks[name][e],
                                    jsparse24.prune_24(kernel[e], transposable=True))
    getattr(m.experts, name).kernel[...] = jax.random.normal(jax.random.key(5), kernel.shape)
  jnnx.rebuild_masks(m)
  new = _masks(m)
  for name in ("up", "down"):
    kernel = getattr(m.experts, name).kernel[...]
    for e in range(E):
      np.testing.assert_array_equal(new[name][e],
                                    jsparse24.prune_24(kernel[e], transposable=True))


def test_compress_params_per_expert_gives_the_masked_outputs():
  m = _model()
  x = _x(7)
  y = m(x)
  jnnx.compress_params(m)
  kernel = m.experts.up.kernel.get_value()
  assert isinstance(kernel, jsparse24.Sparse24) and tuple(kernel.shape) == (E, D, H)
  np.testing.assert_allclose(m(x), y, **TOL)


def test_sparse_false_is_the_dense_layer_on_the_same_params():
  """`sparse=False`: nnx.Linear experts with the 2:4 layer's Params and
  initial values (same rngs) and no masks; forward and gradients are the
  reference's with every weight kept, and differ from the 2:4 layer's."""
  sparse, dense = _model(top_k=2), _model(top_k=2, sparse=False)
  assert isinstance(dense.experts.up, nnx.Linear)
  assert not jax.tree.leaves(nnx.state(dense, jnnx.SparsityMask))
  jax.tree.map(np.testing.assert_array_equal, nnx.state(dense, nnx.Param),
               nnx.state(sparse, nnx.Param))
  x = _x(11)
  params = _params(dense)
  kept = {name: np.ones(params["experts"][name]["kernel"].shape, bool) for name in ("up", "down")}
  keep = _routing(_probs(params, x), 2, jsparse24.moe.expert_capacity(S, E, 2, 1.25))
  np.testing.assert_allclose(dense(x), _reference(params, kept, x, keep, gradient="masked"),
                             **TOL)
  cot = _x(13)
  got = nnx.grad(lambda m: jnp.sum(m(x) * cot))(dense)
  want = jax.grad(lambda p: jnp.sum(_reference(p, kept, x, keep, gradient="masked") * cot))(
      params)
  for name in ("up", "down"):
    np.testing.assert_allclose(got["experts"][name]["kernel"][...],
                               want["experts"][name]["kernel"], **TOL)
  assert not np.allclose(sparse(x), dense(x), rtol=1e-3, atol=1e-3)


def test_load_balancing_loss_is_reachable_with_its_gradient_and_no_warning():
  """The loss of the last call is on the layer, under nnx.jit and nnx.grad
  (its gradient reaches the router), without sow's DeprecationWarning; it
  comes back after nnx.pop."""
  m = _model(top_k=2)
  x = _x(14)
  params = _params(m)
  probs = _probs(params, x)
  want = jsparse24.moe.load_balancing_loss(probs, jax.lax.top_k(probs, 2)[1])
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    nnx.jit(lambda m, x: m(x))(m, x)
    np.testing.assert_allclose(m.load_balancing_loss[...], want, rtol=1e-6)
    assert float(m.dropped[...]) >= 0.0
    got = nnx.grad(lambda m: m(x).sum() * 0 + m.load_balancing_loss[...])(m)
  want_grad = jax.grad(lambda w: jsparse24.moe.load_balancing_loss(
      jax.nn.softmax(x @ w, axis=-1), jax.lax.top_k(probs, 2)[1]))(params["router"]["kernel"])
  assert np.any(np.asarray(want_grad) != 0)
  np.testing.assert_allclose(got["router"]["kernel"][...], want_grad, rtol=1e-5, atol=1e-7)
  popped = nnx.pop(m, nnx.Intermediate)
  assert set(popped) == {"load_balancing_loss", "dropped"}
  m(x)
  np.testing.assert_allclose(m.load_balancing_loss[...], want, rtol=1e-6)


def test_the_output_dtype_is_nnx_linears():
  """The experts compute in the dtype `nnx.Linear` promotes to
  (tests/test_moe.py's OUTPUT_DTYPES)."""
  x = _x(0).astype(jnp.bfloat16)
  for kw, want in OUTPUT_DTYPES:
    assert _model(**kw)(x).dtype == want, kw
