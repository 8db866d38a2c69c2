"""GPU-only checks of the Pallas kernels at realistic sizes (skipped without
an NVIDIA GPU; run on the device with `python -m pytest -m gpu tests/test_gpu.py`)."""

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

  def run(impl):
    f = lambda x, w: jsparse24.sparse_dot(x, w, mask, gradient=gradient, implementation=impl)  # noqa: E731
    y, vjp = jax.vjp(jax.jit(f), x, w)
    return (y,) + vjp(jnp.ones_like(y))

  for got, ref in zip(run("pallas"), run("xla")):
    got, ref = got.astype(jnp.float32), ref.astype(jnp.float32)
    err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
    assert err < 1e-2, err
