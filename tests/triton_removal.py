"""What a process checks and trains with the Pallas kernels unable to run.

Run as `python -m tests.triton_removal [--checks] [--stand-in] [--mvue]
[--steps N]` from the repository root, with `JSPARSE24_DISABLE_PALLAS_TRITON=1`
(Pallas's Triton lowering as if removed from JAX) or without it; it prints
one JSON line. The switch is read once per process, so the tests
(`test_triton_fallback.py`, and `test_gpu.py` on a GPU) run this in a
subprocess. This module imports nothing that imports the Triton lowering.

* `--checks`: what the Pallas backend reports and raises, and the buffers
  `CusparseltBackend.prepare` writes (against bytes recorded from
  cuSPARSELt, and against the reference compress).
* training: a few optax steps of a small Flax model of `SparseDense` layers
  on the `"cusparselt"` backend (stored transposable and plain masks, a
  mask pruned at every call, `--mvue`: one MVUE weight gradient), with
  `jsparse24.optim.mask_update` rebuilding the masks.
* `--stand-in`: cuSPARSELt's products by XLA (`install_stand_in`), for
  CPUs, which have no cuSPARSELt; everything around them runs as on a GPU.
* `--interpret`: the Pallas kernels in interpret mode (CPUs, switch unset).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jsparse24
from jsparse24 import optim
from jsparse24.backends import XlaFallbackWarning, cusparselt, pallas

ROOT = pathlib.Path(__file__).parents[1]
DATA = ROOT / "tests" / "data" / "cusparselt_layout.npz"
# The modules a process must not import where the Pallas kernels cannot run.
KERNEL_MODULES = ("pallas_kernels.prune24", "pallas_kernels.transposable24",
                  "pallas_kernels.masked_compress", "pallas_kernels.mask_rebuild",
                  "pallas_kernels.cusparselt_metadata", "pallas_kernels.mvue24",
                  "pallas_kernels.spmm24")


def _packed_codes(meta_rows: jax.Array, rows: int, groups: int) -> jax.Array:
  """The packed codes (`Mask24` layout, `uint8[rows, groups/2]`) of
  cuSPARSELt's metadata rows: `cusparselt.metadata_layout` inverted."""
  b = jax.lax.bitcast_convert_type(meta_rows, jnp.uint8).reshape(
      rows // 64, groups // 8, 4, 8, 4, 2).transpose(0, 2, 3, 1, 5, 4)  # [rb, a, b, gb, c, d]
  codes = jnp.stack([b & 0xF, b >> 4], axis=2).reshape(rows, groups)  # h: the nibble
  return codes[:, 0::2] | (codes[:, 1::2] << 4)


def dense_of_buffer(buf: jax.Array, k: int, n: int, *, transpose: bool) -> jax.Array:
  """The masked `w[K, N]` that a cuSPARSELt buffer
  (`cusparselt.buffer_shape(k, n, transpose=...)`) holds."""
  if transpose:  # values [K, N/2]: w^T compressed along its K (our N)
    return jsparse24.decompress(jsparse24.Sparse24(buf[:k], _packed_codes(buf[k:], k, n // 4))).T
  return jsparse24.decompress(
      jsparse24.Sparse24(buf[:k // 2].T, _packed_codes(buf[k // 2:], n, k // 4)))


def _stand_in_product(a, b, shape, *, m, n, k, op_a, op_b, search, alg, batch=1):
  """`cusparselt._sparse_a_matmul` by XLA: the column-major `D[m, n] =
  op(A)[m, k] op(B)[k, n]` is the row-major `[n, m]` array `op(B)^T
  op(A)^T`; A's buffer holds `w` (op N: `A = w^T`, compressed along K = k;
  op T: `A = w`, compressed along N = k). A 3-D `shape`: `batch` products
  stacked on axis 0."""
  if len(shape) == 3:
    assert a.shape[0] == b.shape[0] == shape[0] == batch, (a.shape, b.shape, shape, batch)
    return jax.vmap(functools.partial(_stand_in_product, shape=shape[1:], m=m, n=n, k=k,
                                      op_a=op_a, op_b=op_b, search=search, alg=alg))(a, b)
  del n, search, alg
  if op_a == 0:
    w = dense_of_buffer(a, k, m, transpose=False)
  else:
    w = dense_of_buffer(a, m, k, transpose=True)
  lhs = b if op_b == 0 else b.T
  d = jnp.dot(lhs, w if op_a == 0 else w.T, preferred_element_type=jnp.float32)
  assert d.shape == tuple(shape), (d.shape, shape)
  return d.astype(b.dtype)


def _stand_in_b_product(a, b, shape, *, m, n, k, search, alg):
  """`cusparselt._sparse_b_matmul` by XLA: the column-major `D[m, n] =
  A[m, k] B[k, n]` is the row-major `[n, m]` array `B^T A^T`; A's buffer is
  the row-major `w[k, m]`, B's the pruned `x[n, k]` compressed along k (the
  layout of a weight's backward buffer)."""
  del search, alg
  xm = dense_of_buffer(b, n, k, transpose=True)
  d = jnp.dot(xm, a.reshape(k, m), preferred_element_type=jnp.float32)
  assert d.shape == tuple(shape), (d.shape, shape)
  return d.astype(a.dtype)


def install_stand_in() -> None:
  """Makes the `"cusparselt"` backend run on a CPU: its products by XLA on
  the decoded buffers; the buffers themselves are jsparse24's."""
  cusparselt.CusparseltBackend.unavailable_reason = lambda self: None
  cusparselt._check_size = lambda *args: None  # pylint: disable=protected-access
  cusparselt._sparse_a_matmul = _stand_in_product  # pylint: disable=protected-access
  cusparselt._sparse_b_matmul = _stand_in_b_product  # pylint: disable=protected-access


def _same_bytes(a, b) -> bool:
  return np.array_equal(np.asarray(a).view(np.uint8).reshape(-1),
                        np.asarray(b).view(np.uint8).reshape(-1))


def checks() -> dict:
  """The Pallas backend's reports, and `prepare`'s buffers (jitted)."""
  out = {"available": jsparse24.available_implementations()["pallas"]}
  with pallas.interpret_mode():
    out["interpreted"] = pallas.PallasBackend().unavailable_reason()
  x, w = jnp.ones((8, 64), jnp.bfloat16), jnp.ones((64, 64), jnp.bfloat16)
  for name, call in (("sparse_dot", lambda: jsparse24.sparse_dot(x, w, implementation="pallas")),
                     ("compress", lambda: jsparse24.compress(w, implementation="pallas"))):
    try:
      call()
      out[f"{name}_raised"] = None
    except jsparse24.BackendUnavailableError as e:
      out[f"{name}_raised"] = str(e)
  d = np.load(DATA)
  wr = jax.lax.bitcast_convert_type(jnp.asarray(d["w_bits"]), jnp.float16)
  k, n = wr.shape
  stored = jsparse24.Mask24.pack(
      np.unpackbits(d["mask_bits"])[:k * n].reshape(k, n).astype(bool), transposable=True)
  prepare = jax.jit(cusparselt.CusparseltBackend().prepare, static_argnums=2)
  recorded = []
  for transposable in (True, False):
    op = prepare(wr, stored, transposable)
    recorded.append(_same_bytes(op.fwd, d["fwd"]) and _same_bytes(op.meta, stored.meta())
                    and (_same_bytes(op.bwd, d["bwd"]) if transposable else op.bwd is None))
  out["recorded"] = recorded
  w = jax.random.normal(jax.random.key(5), (192, 320), jnp.bfloat16)
  pruned = []
  for transposable in (True, False):
    op = prepare(w, None, transposable)
    ref = jsparse24.compress(w, transposed=transposable, implementation="xla")
    fwd, bwd = cusparselt.from_sparse24(ref)
    pruned.append(_same_bytes(op.fwd, fwd) and _same_bytes(op.meta, ref.meta)
                  and (_same_bytes(op.bwd, bwd) if transposable else op.bwd is None))
  out["pruned"] = pruned
  return out


class _Net(nn.Module):
  mvue: bool = False

  @nn.compact
  def __call__(self, x):
    dense = functools.partial(jsparse24.SparseDense, implementation="cusparselt",
                              dtype=jnp.bfloat16)
    h = dense(128, transposable=True, name="up")(x)
    h = dense(64, transposable=False, weight_grad="mvue" if self.mvue else "dense",
              name="down")(nn.relu(h))
    h = dense(64, transposable=True, mask_source="dynamic", name="dynamic")(nn.relu(h))
    return nn.Dense(1, name="head")(h).astype(jnp.float32)


def train(steps: int, mvue: bool) -> dict:
  """`steps` Adam steps with masks rebuilt every 2 steps: the losses, and a
  digest of the losses and the final parameters' bytes."""
  model = _Net(mvue)
  x = jax.random.normal(jax.random.key(0), (64, 64), jnp.float32)
  y = jnp.sin(x @ jax.random.normal(jax.random.key(1), (64, 1)) / 8)
  variables = model.init(jax.random.key(2), x)
  tx = optax.chain(optim.mask_update(variables["sparsity"], optim.MaskSchedule(rebuild_every=2)),
                   optax.adam(1e-3))
  params = variables["params"]
  state = tx.init(params)

  @jax.jit
  def step(params, state, i):
    def loss(p):
      pred = model.apply({"params": p, "sparsity": optim.masks(state)}, x,
                         rngs={"mvue": jax.random.fold_in(jax.random.key(3), i)})
      return jnp.mean((pred - y) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

  losses, digest = [], hashlib.sha256()
  for i in range(steps):
    params, state, value = step(params, state, i)
    losses.append(float(value))
    digest.update(np.asarray(value).tobytes())
  for leaf in jax.tree.leaves(params):
    digest.update(np.asarray(leaf).tobytes())
  return {"losses": losses, "digest": digest.hexdigest()}


def run(*args: str, switch: bool, env: dict | None = None) -> dict:
  """This module's JSON line from a subprocess (`args`: its flags) with the
  switch set to 1 (`switch`) or 0, in the repository root (whose jsparse24
  it imports, not an installed one), `env` added to the environment."""
  full = {**os.environ, pallas.DISABLE_ENV: "1" if switch else "0",
          "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
          **(env or {})}
  done = subprocess.run([sys.executable, "-m", "tests.triton_removal", *args], cwd=ROOT,
                        env=full, capture_output=True, text=True, timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-5000:]
  out = json.loads(done.stdout.strip().splitlines()[-1])
  assert pathlib.Path(out["file"]).is_relative_to(ROOT), out["file"]
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--checks", action="store_true")
  parser.add_argument("--stand-in", action="store_true")
  parser.add_argument("--mvue", action="store_true")
  parser.add_argument("--interpret", action="store_true")
  parser.add_argument("--steps", type=int, default=6)
  args = parser.parse_args(argv)
  out = {"file": jsparse24.__file__, "reason": pallas.triton_unavailable_reason()}
  interpret = pallas.interpret_mode() if args.interpret else contextlib.nullcontext()
  with warnings.catch_warnings(record=True) as caught, interpret:
    warnings.simplefilter("always")  # every warning issued, none deduplicated
    if args.stand_in:
      install_stand_in()
    else:  # a timed search may pick another algorithm, hence other bits, in each process
      cusparselt.SEARCH[jnp.dtype(jnp.bfloat16)] = "default"
    if args.checks:
      out.update(checks())
    out.update(train(args.steps, args.mvue))
  out["fallback_warnings"] = [str(w.message) for w in caught
                              if issubclass(w.category, XlaFallbackWarning)]
  out["triton_modules"] = sorted(m for m in sys.modules if "pallas" in m and "triton" in m)
  out["kernel_modules"] = sorted(m for m in sys.modules if m in KERNEL_MODULES)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
