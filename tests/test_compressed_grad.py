"""Gradients through a compressed (`Sparse24`) weight: in x and in its kept
values, on every backend (the "pallas" and "cusparselt" products had no
transpose rule; issue 11)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse24
from jsparse24.backends.pallas import interpret_mode


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("transposed", [False, True])
def test_grad_through_a_compressed_weight(implementation, transposed):
  w = jax.random.normal(jax.random.key(0), (64, 32))
  x = jax.random.normal(jax.random.key(1), (2, 8, 64))
  with interpret_mode():
    sp = jsparse24.compress(w, transposed=transposed, implementation="xla")

    def with_values(v):
      return jsparse24.Sparse24(v, sp.meta, sp.values_t, sp.meta_t)

    def loss(x, v):
      y = jsparse24.sparse_dot(x, with_values(v), implementation=implementation)
      return (y ** 2).sum()

    got = jax.jit(jax.grad(loss, (0, 1)))(x, sp.values)
  ref = jax.grad(lambda x, v: ((x @ jsparse24.decompress(with_values(v))) ** 2).sum(),
                 (0, 1))(x, sp.values)
  for g, r in zip(got, ref):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)
  assert jnp.abs(got[1]).max() > 0


def test_forward_mode_through_a_compressed_weight_on_the_reference():
  w = jax.random.normal(jax.random.key(0), (64, 32))
  x = jax.random.normal(jax.random.key(1), (8, 64))
  sp = jsparse24.compress(w, implementation="xla")
  _, tangent = jax.jvp(lambda x: jsparse24.sparse_dot(x, sp, implementation="xla"), (x,), (x,))
  np.testing.assert_allclose(tangent, x @ jsparse24.decompress(sp), rtol=1e-5, atol=1e-5)
