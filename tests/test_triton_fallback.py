"""Where Pallas's Triton lowering cannot run (removed from JAX, or
`JSPARSE24_DISABLE_PALLAS_TRITON=1`): the XLA code that replaces the Pallas
kernels in the cuSPARSELt backend writes the kernels' bytes (checked here
against the kernels in interpret mode and against bytes recorded from
cuSPARSELt), and a process with the switch set reports the Pallas backend
unavailable, trains, warns once and never imports the lowering
(`tests/triton_removal.py`, in a subprocess: the switch is read once per
process). The GPU's side is test_gpu.py's
`test_cusparselt_training_is_the_same_without_pallas_triton`."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse24
from jsparse24 import _sharding
from jsparse24._mvue import mvue_seeds
from jsparse24.backends import cusparselt, pallas
from jsparse24.backends.pallas import interpret_mode
from pallas_kernels import mvue_rule
from tests import triton_removal
from tests.test_cusparselt import _recorded


def _same_bytes(a, b) -> bool:
  return np.array_equal(np.asarray(a).view(np.uint8).reshape(-1),
                        np.asarray(b).view(np.uint8).reshape(-1))


# The weights and gradients are each one jitted program: eagerly, every
# `.at[].set` compiled a program per shape and dtype.
@functools.partial(jax.jit, static_argnums=(0, 1))
def _weights(shape, dtype, seed):
  """Random weights with zero groups, ties, NaN and +-inf."""
  w = jax.random.normal(jax.random.key(seed), shape, jnp.float32)
  w = w.at[4:8].set(0.0).at[8:16].set(jnp.round(w[8:16] * 2) / 2)
  w = w.at[17, 3].set(jnp.nan).at[21, 5].set(jnp.inf).at[26, 7].set(-jnp.inf)
  return w.astype(dtype)


def test_the_switch_is_off_here():
  # This process imports the lowering (jax 0.10.2-0.12 have it): the kernels run.
  assert os.environ.get(pallas.DISABLE_ENV, "0") == "0"
  assert pallas.triton_unavailable_reason() is None
  with interpret_mode():
    assert pallas.PallasBackend().unavailable_reason() is None


# Every pair of two of the three arguments' values: all mask kinds x
# transposable, each shape (and dtype) with each of those.
_WIDE, _TALL = ((192, 320), jnp.bfloat16), ((320, 192), jnp.float16)


@pytest.mark.parametrize("shape,dtype,mask_kind,transposable", [
    (*_WIDE, "none", False), (*_TALL, "none", True), (*_TALL, "mask24", False),
    (*_WIDE, "mask24", True), (*_WIDE, "bool", False), (*_TALL, "bool", True)])
def test_compress_fallback_writes_the_kernels_bytes(shape, dtype, mask_kind, transposable):
  """`compress_for_products_xla` against the Pallas path (prune or stored
  mask, one pass, then the metadata pass) in interpret mode: buffers and
  packed mask byte for byte."""
  seed = shape[0] + 2 * transposable + len(mask_kind)
  w = _weights(shape, dtype, seed)
  mask = None
  if mask_kind != "none":
    mask = jsparse24.Mask24.from_weights(jax.random.normal(jax.random.key(seed + 1), shape),
                                         transposable=transposable)
    mask = jax.jit(lambda m: m.unpack())(mask) if mask_kind == "bool" else mask
  with interpret_mode():
    want = cusparselt.compress_for_products(w, mask, transposable)
  got = jax.jit(cusparselt.compress_for_products_xla, static_argnums=2)(w, mask, transposable)
  k, n = shape
  assert got[0].shape == cusparselt.buffer_shape(k, n, transpose=False)
  if transposable:
    assert got[1].shape == cusparselt.buffer_shape(k, n, transpose=True)
  else:
    assert got[1] is None and want[1] is None
  for g, r in zip(got, want):
    if r is not None:
      assert g.dtype == r.dtype and g.shape == r.shape and _same_bytes(g, r)


@pytest.mark.parametrize("transposable", [False, True])
def test_compress_fallback_writes_the_recorded_cusparselt_bytes(transposable):
  w, mask, fwd, bwd = _recorded()
  stored = jsparse24.Mask24.pack(mask, transposable=True)
  got = jax.jit(cusparselt.compress_for_products_xla, static_argnums=2)(w, stored, transposable)
  assert _same_bytes(got[0], fwd) and _same_bytes(got[2], stored.meta())
  assert _same_bytes(got[1], bwd) if transposable else got[1] is None


@functools.partial(jax.jit, static_argnums=(0, 1))
def _gradient(shape, dtype, seed):
  """Random gradient with zero groups, single non-zeros, a dominant entry and ties."""
  g = jax.random.normal(jax.random.key(seed), shape, dtype)
  g = g.at[:8].set(0).at[8:12, :5].set(jnp.array([0, 1, 0, 0], dtype)[:, None])
  g = g.at[12:16, 5:9].set(jnp.array([9, 1, 1, 1], dtype)[:, None])
  return g.at[16:20, 9:12].set(jnp.array([2, -2, 2, 2], dtype)[:, None])


@pytest.mark.parametrize("shape,dtype", [((192, 320), jnp.bfloat16), ((320, 128), jnp.float16)])
@pytest.mark.parametrize("block", [None, (64, 64, 640)])
def test_mvue_fallback_draws_what_the_kernel_draws(shape, dtype, block):
  """`mvue_compress_for_product_xla` against the Pallas path in interpret
  mode, byte for byte: the whole gradient, and a block of a larger one
  (`block`: its first row and column and the whole N: `first_group` traced,
  as each device passes it, and `row_stride`), which draws what the whole
  gradient draws at its place."""
  g = _gradient(shape, dtype, seed=shape[1])
  seed = mvue_seeds(jax.random.key(7))
  first, stride = (0, None) if block is None else (block[0] // 4 * block[2] + block[1], block[2])

  def run(fn):
    return jax.jit(lambda g, seed, first: fn(g, seed, first, row_stride=stride))(
        g, seed, jnp.uint32(first))

  with interpret_mode():
    want = run(cusparselt.mvue_compress_for_product)
  got = run(cusparselt.mvue_compress_for_product_xla)
  m, n = shape
  assert got.shape == cusparselt.buffer_shape(m, n, transpose=False) and got.dtype == dtype
  assert _same_bytes(got, want)
  if block is not None:
    r, c, n_total = block

    @jax.jit
    def reference(g, seed):
      whole = jax.random.normal(jax.random.key(1), (r + m, n_total), dtype)
      return mvue_rule.mvue_compress_reference(whole.at[r:, c:c + n].set(g), seed)[0]

    values = reference(g, seed)
    assert _same_bytes(got[:m // 2], values[r // 2:, c:c + n])


def test_mvue_fallback_traces_inside_a_partitioned_op():
  """The MVUE weight gradient prunes `dy` inside `rows_contracted`
  (`custom_partitioning`, which refuses array constants): the fallback
  traces there, and `x^T` times the buffer's matrix is `x^T mvue_24(dy)`."""
  m, k, n = 128, 64, 192
  x = jax.random.normal(jax.random.key(0), (m, k), jnp.float32)
  dy = _gradient((m, n), jnp.bfloat16, seed=3)
  key = jax.random.key(4)

  def local(x, dy, first_row, first_col, n_total, seed):
    first = (first_row // 4).astype(jnp.uint32) * jnp.uint32(n_total) + first_col.astype(jnp.uint32)
    buf = cusparselt.mvue_compress_for_product_xla(dy, seed, first, row_stride=n_total)
    pruned = triton_removal.dense_of_buffer(buf, dy.shape[0], dy.shape[1], transpose=False)
    return x.T @ pruned.astype(jnp.float32)

  got = jax.jit(lambda x, dy, seed: _sharding.rows_contracted(local, x, dy, seed))(
      x, dy, mvue_seeds(key))
  want = x.T @ jsparse24.mvue_24(dy, key, axis=0).astype(jnp.float32)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("transpose", [False, True])
def test_the_stand_in_reads_cusparselts_buffers(transpose):
  """The CPU stand-in for cuSPARSELt's product (`triton_removal`) reads the
  masked weight back from bytes recorded from cuSPARSELt."""
  w, mask, fwd, bwd = _recorded()
  k, n = w.shape
  buf = np.asarray(bwd if transpose else fwd).view(np.float16).reshape(
      cusparselt.buffer_shape(k, n, transpose=transpose))
  # One program (eagerly, each primitive of the stand-in compiled per shape).
  got = jax.jit(functools.partial(triton_removal.dense_of_buffer, k=k, n=n,
                                  transpose=transpose))(jnp.asarray(buf))
  assert _same_bytes(got, np.where(mask, w, np.zeros((), w.dtype)))


def test_a_missing_triton_lowering_is_the_reason():
  """JAX without the Triton lowering (its module made unimportable): the
  reason names it and the JAX version, and the Pallas backend is
  unavailable with it."""
  script = (
      "import sys; sys.modules['jax.experimental.pallas.triton'] = None\n"
      "import jsparse24\n"
      "from jsparse24.backends import pallas\n"
      "reason = pallas.triton_unavailable_reason()\n"
      "assert jsparse24.available_implementations()['pallas'] == reason, reason\n"
      "print(reason)\n")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", pallas.DISABLE_ENV: "0"}
  done = subprocess.run([sys.executable, "-c", script], cwd=triton_removal.ROOT,
                        env=env, capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  reason = done.stdout.strip().splitlines()[-1]
  assert "jax.experimental.pallas.triton" in reason and "cannot be imported" in reason
  assert f"jax {jax.__version__}" in reason


@pytest.fixture(scope="module")
def switched_off():
  """The subprocess with the switch set: checks, and 6 training steps."""
  return triton_removal.run("--checks", "--stand-in", "--mvue", "--steps", "6", switch=True,
                            env={"JAX_PLATFORMS": "cpu"})


def test_training_with_the_triton_lowering_switched_off(switched_off):
  """The simulated removal, in a subprocess with the switch set: the Pallas
  backend reports the reason (in interpret mode too) and naming it raises
  with it; `prepare` (jitted) writes the recorded cuSPARSELt bytes and the
  reference's; a small SparseDense model trains on the "cusparselt" backend
  (its products by the CPU stand-in; stored and per-call masks, an MVUE
  weight gradient, mask rebuilds); one warning in all, and neither the
  Triton lowering nor a kernel module imported."""
  out = switched_off
  reason = out["reason"]
  assert reason and f"{pallas.DISABLE_ENV}=1" in reason
  assert out["available"] == reason and out["interpreted"] == reason
  for name in ("sparse_dot", "compress"):
    raised = out[f"{name}_raised"]
    assert raised and "implementation='pallas'" in raised and reason in raised, raised
  assert out["recorded"] == [True, True] and out["pruned"] == [True, True]
  losses = np.asarray(out["losses"])
  assert np.isfinite(losses).all() and losses[-1] < 0.8 * losses[0], losses
  (message,) = out["fallback_warnings"]
  assert reason in message and "slower" in message and "mvue24.mvue_compress" in message
  assert out["triton_modules"] == [] and out["kernel_modules"] == []


def test_training_steps_equal_the_kernels_bit_for_bit(switched_off):
  """The same steps with the kernels (interpret mode, switch unset): the
  same losses and parameters, bit for bit, and no fallback warning (the
  CPU's side of test_gpu.py's comparison)."""
  kernels = triton_removal.run("--stand-in", "--mvue", "--interpret", "--steps", "6",
                               switch=False, env={"JAX_PLATFORMS": "cpu"})
  assert kernels["reason"] is None and kernels["fallback_warnings"] == []
  assert "pallas_kernels.prune24" in kernels["kernel_modules"]
  assert kernels["losses"] == switched_off["losses"]
  assert kernels["digest"] == switched_off["digest"]


@pytest.mark.parametrize("name", ["tiles_compress_for_products", "tokens_compress_for_product"])
def test_activation_compress_fallbacks_write_the_kernels_bytes(name, monkeypatch):
  """The 2:4 activations' passes that run XLA code where the kernels cannot
  (the tile rule's two copies and codes; `weight_grad="2:4"`'s groups along
  M) against the kernels in interpret mode, byte for byte."""
  a = _weights((192, 128), jnp.bfloat16, 11)
  fn = jax.jit(getattr(cusparselt, name))
  with interpret_mode():
    want = fn(a)
  monkeypatch.setattr(cusparselt, "_xla_fallback", lambda: True)
  got = fn(a)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert g.dtype == r.dtype and g.shape == r.shape and _same_bytes(g, r)
