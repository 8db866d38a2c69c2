"""The GPU code lowers for CUDA on a CPU, as a GPU would lower it: every
Pallas kernel through Pallas's Triton lowering; the "pallas" backend's
products, compression and fused mask kernels; the "cusparselt" backend's
training products with the kernels around them (cuSPARSELt's calls are FFI
custom calls), a mixture of experts' among them; a training step's mask
rebuild; a whole GPT training step and a compressed weight's products as
the automatic choice makes them on an H200 (the Mosaic GPU decode kernel
among them; `tests/test_decode24.py` lowers it at more shapes).

Interpret mode (the CPU tests of what the kernels compute) never runs the
Triton lowering, so a kernel using an operation it refuses, or a jax release
that changes it, would otherwise first fail on a GPU. Each program is lowered
with `.lower(lowering_platforms=("cuda",))` under the oldest and the newest
jax CI runs, for an H200 that JAX is told of: jax 0.12's Triton lowering asks
the device for its compute capability and takes an abstract device
(`jax.sharding.AbstractDevice`) where none is present. The one question the
cuSPARSELt backend asks the library while tracing, a weight's compressed
size, is answered by the layout jsparse24 writes (on a GPU the two are
checked equal). Nothing is compiled or run: `tests/test_gpu.py` checks the
results on a GPU.
"""

import contextlib
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import jsparse24
from benchmarks import _gpt
from jsparse24 import _pallas_runtime
from jsparse24.backends import cusparselt
from jsparse24.backends import pallas as pallas_backend

pytest.importorskip("jax.experimental.pallas.triton",
                    reason="Pallas's Triton lowering is gone from this jax (the kernels with it)")
# pylint: disable=g-import-not-at-top,wrong-import-position
from pallas_kernels import (cusparselt_metadata, cusparselt_values, decode24, input_prune24,
                            mask_rebuild, masked_compress, mvue24, prune24, spmm24,
                            transposable24)
from pallas_kernels.prune_config import PruneConfig
from pallas_kernels.spmm24 import MatmulConfig

TRITON = "__gpu$xla.gpu.triton"
CUSPARSELT = "jsparse24_cusparselt_matmul"  # cusparselt_ffi.cc's product
S = jax.ShapeDtypeStruct
BF16, F16, F32, U8 = jnp.bfloat16, jnp.float16, jnp.float32, jnp.uint8
K, N = 192, 320  # multiples of 64 (cuSPARSELt's layout), not powers of two


# The GPU the code is lowered for: an H200, whose rows of the per-GPU decode
# tables (`jsparse24.backends.pallas`) the automatic choice reads.
GPU = "NVIDIA H200"


@contextlib.contextmanager
def _hopper():
  """Lowering for the `GPU`: an abstract device of that kind where this jax
  has them (0.12 needs one without a GPU), else nothing (0.10.2's lowering
  asks no device)."""
  if not hasattr(jax.sharding, "AbstractDevice"):
    yield
    return
  device = jax.sharding.AbstractDevice(device_kind=GPU, num_cores=132, platform="cuda")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                                   abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    yield


def _custom_calls(fn, *args) -> list[str]:
  """The custom calls of `jax.jit(fn)` lowered for CUDA at `args`' shapes, in
  order. jsparse24's own warnings are errors (a warning that is issued once
  per process would be spent here), Pallas's Triton deprecation is not."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "The Pallas Triton backend is deprecated")
    warnings.simplefilter("error", jsparse24.backends.UnmeasuredChoiceWarning)
    warnings.simplefilter("error", jsparse24.backends.XlaFallbackWarning)
    with _hopper():
      text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  return re.findall(r"stablehlo\.custom_call @([^(\s]+)\(", text)


KERNELS = {
    "prune_compress": (lambda w: prune24.prune_compress(w), [S((K, N), BF16)]),
    "prune_compress transposable, registers": (
        lambda w: prune24.prune_compress(w, transposable=True,
                                         config=PruneConfig(strided_lanes=False)),
        [S((K, N), F16)]),
    "prune_compress transposable, cusparselt layout": (
        lambda w: prune24.prune_compress(w, transposable=True, layout="cusparselt"),
        [S((K, N), BF16)]),
    "compress_with_meta": (lambda w, m: masked_compress.compress_with_meta(w, m),
                           [S((K, N), BF16), S((N, K // 8), U8)]),
    "compress_with_meta transposed, cusparselt layout": (
        lambda w, m: masked_compress.compress_with_meta(w, m, transposed=True,
                                                        layout="cusparselt"),
        [S((K, N), BF16), S((N, K // 8), U8)]),
    "prune_compress_rows, cusparselt layout": (
        lambda x: input_prune24.prune_compress_rows(x, layout="cusparselt"), [S((K, N), BF16)]),
    "transposable_mask, float32": (lambda w: transposable24.transposable_mask(w),
                                   [S((K, N), F32)]),
    "rebuild_mask": (lambda w, old, r: mask_rebuild.rebuild_mask(w, old, r, transposable=False),
                     [S((K, N), F32), S((N, K // 8), U8), S((N,), jnp.int32)]),
    "rebuild_mask transposable": (
        lambda w, old, r: mask_rebuild.rebuild_mask(w, old, r, transposable=True),
        [S((K, N), BF16), S((N, K // 8), U8), S((N,), jnp.int32)]),
    "mvue_compress": (lambda g, seed: mvue24.mvue_compress(g, seed),
                      [S((K, N), BF16), S((2,), jnp.uint32)]),
    "sparse_matmul, 17 rows": (lambda x, v, m: spmm24.sparse_matmul(x, v, m, k=200),
                               [S((17, 200), BF16), S((72, 100), BF16), S((72, 25), U8)]),
    "sparse_matmul, lane dots": (
        lambda x, v, m: spmm24.sparse_matmul(x, v, m, k=K, config=MatmulConfig(lane_dots=True)),
        [S((256, K), F16), S((N, K // 2), F16), S((N, K // 8), U8)]),
    "decode_matmul, 3 rows": (lambda x, v, m: decode24.decode_matmul(x, v, m, k=1028),
                              [S((3, 1028), BF16), S((72, 514), BF16), S((72, 129), U8)]),
    "write_cusparselt_metadata": (
        lambda buf, m: cusparselt_metadata.write_cusparselt_metadata(buf, m, row=K // 2),
        [S((K // 2 + K // 16, N), BF16), S((N, K // 8), U8)]),
    "values_into_buffer": (lambda v: cusparselt_values.values_into_buffer(v, rows=K // 2 + K // 16),
                           [S((N, K // 2), BF16)]),
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_lowers_through_triton(name):
  fn, args = KERNELS[name]
  calls = _custom_calls(fn, *args)
  assert calls and set(calls) == {TRITON}, calls


def _as_on_a_gpu(monkeypatch):
  """The library's checks answer as on the `GPU` from here on: JAX's backend
  "gpu", the Pallas kernels able to run natively (not interpreted), the
  per-GPU tables read at the `GPU`'s rows, and cuSPARSELt available, the
  compressed size it would report taken as the size of the layout that
  jsparse24 writes. Nothing may run after it, only be lowered: the kernels
  would run compiled, which a CPU refuses.

  What is traced then stays with this test: the library asks these
  questions in Python before it traces (the kernels' `interpret=False` is
  part of their jit and builder keys), never inside a function jitted once
  for the module, so no later test on the CPU finds a program traced here."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  for module in (_pallas_runtime, pallas_backend):
    monkeypatch.setattr(module, "gpu_unavailable_reason", lambda elsewhere="": None)
  monkeypatch.setattr(pallas_backend, "_gpu_kind", lambda: GPU)
  monkeypatch.setattr(cusparselt.CusparseltBackend, "unavailable_reason", lambda self: None)
  monkeypatch.setattr(cusparselt, "_check_size", lambda *args: None)
  assert _pallas_runtime.runs_natively()


def _grads(**options):
  def loss(x, w):
    return jnp.sum(jsparse24.sparse_dot(x, w, **options).astype(jnp.float32) ** 2)
  return jax.grad(loss, argnums=(0, 1))


def _compressed_product(x, w):
  sp = jsparse24.compress(w, jsparse24.Mask24.from_weights(w), implementation="pallas")
  return jsparse24.sparse_dot(x, sp, implementation="pallas")


LIBRARY = {
    # The Pallas backend's products and the prune kernel, forward and backward.
    "sparse_dot pallas, grads": (_grads(implementation="pallas"),
                                 [S((64, K), BF16), S((K, N), BF16)]),
    "sparse_dot pallas, masked gradient, plain mask": (
        _grads(implementation="pallas", gradient="masked", transposable=False),
        [S((64, K), BF16), S((K, N), BF16)]),
    # Compressed with the prune kernel, multiplied by the decode kernel.
    "compress + decode product": (_compressed_product, [S((4, K), BF16), S((K, N), BF16)]),
    # The fused transposable mask kernel (Mask24.from_weights on a GPU).
    "Mask24.from_weights transposable": (
        lambda w: jsparse24.Mask24.from_weights(w, transposable=True).packed, [S((K, N), F32)]),
}


@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_library_gpu_path_lowers_through_triton(monkeypatch, name):
  _as_on_a_gpu(monkeypatch)
  fn, args = LIBRARY[name]
  assert TRITON in _custom_calls(fn, *args)


def test_training_step_rebuilds_masks_with_the_kernel(monkeypatch):
  """A SparseDense MLP's training step with `jsparse24.optim.with_masks` as a
  GPU lowers it: the products are XLA's at these shapes (the automatic
  choice), the masks rebuilt by the rebuild kernel on the run-time flag
  (`mask_rebuild=None`: no conditional), so a Triton call is in the step.
  The state is made on the CPU first."""

  class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = jsparse24.SparseDense(N, name="up")(x)
      return jsparse24.SparseDense(K, name="down")(jax.nn.gelu(h))

  model, x = Mlp(), jnp.zeros((64, K), F32)
  variables = model.init(jax.random.key(0), x)
  tx = jsparse24.optim.with_masks(optax.sgd(0.1), variables["sparsity"],
                                  jsparse24.optim.MaskSchedule(rebuild_every=2))
  params = variables["params"]
  opt_state = tx.init(params)
  _as_on_a_gpu(monkeypatch)

  def step(params, opt_state, x):
    def loss(p):
      masks = jsparse24.optim.masks(opt_state)
      return jnp.mean(model.apply({"params": p, "sparsity": masks}, x) ** 2)
    grads = jax.grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  calls = _custom_calls(step, params, opt_state, x)
  assert calls == [TRITON, TRITON], calls  # one rebuild per layer, the products XLA's


def _cusparselt_grads(**options):
  def loss(x, w, key):
    mvue = dict(key=key) if options.get("weight_grad") == "mvue" else {}
    y = jsparse24.sparse_dot(x, w, implementation="cusparselt", **mvue, **options)
    return jnp.sum(y.astype(jnp.float32) ** 2)
  return jax.grad(loss, argnums=(0, 1))


CUSPARSELT_STEPS = {
    "weights, transposable mask": {},
    "weights, plain mask": {"transposable": False},
    "weights, MVUE weight gradient": {"weight_grad": "mvue"},
    "activations": {"input_sparsity": "masked"},
    "activations on tiles, 2:4 output gradient": {"input_sparsity": "masked",
                                                  "transposable": True, "grad_output": "2:4"},
    "activations, tokens' weight gradient": {"input_sparsity": "masked", "grad_output": "2:4",
                                             "weight_grad": "2:4"},
}


@pytest.mark.parametrize("name", sorted(CUSPARSELT_STEPS))
def test_cusparselt_products_and_their_kernels_lower(monkeypatch, name):
  """A linear layer's products on the "cusparselt" backend (forward and
  gradients) as a GPU lowers them: cuSPARSELt's FFI calls, and the Pallas
  kernels that prune and compress their sparse operands and write
  cuSPARSELt's metadata."""
  _as_on_a_gpu(monkeypatch)
  calls = _custom_calls(_cusparselt_grads(**CUSPARSELT_STEPS[name]), S((256, 512), BF16),
                        S((512, 1024), BF16), jax.random.key(0))
  assert set(calls) == {CUSPARSELT, TRITON}, calls


def test_gpt_training_step_takes_cusparselt_by_the_automatic_choice(monkeypatch):
  """`benchmarks/bench_model.py`'s model at d_model 4096 (2 blocks under
  `nn.scan` and remat, 16,384 tokens per step, every block's linear layers
  2:4 with the default options) and its training step with
  `optim.with_masks`, as a GPU lowers them: the automatic choice puts the
  products on cuSPARSELt (the forward products and `dx` of the four layers
  at least), the masks and compressed operands on the Pallas kernels. The
  model and the state are shapes only (`jax.eval_shape`)."""
  _as_on_a_gpu(monkeypatch)
  d, seq, batch, vocab = 4096, 512, 32, 1024
  model = jsparse24.sparsify(_gpt.GPT(vocab, d, 2, seq, None, remat=True),
                             {r"blocks/(qkv|out|up|down)": {}})
  variables = jax.eval_shape(model.init, jax.random.key(0), S((batch, seq), jnp.int32))
  tx = jsparse24.optim.with_masks(optax.adamw(1e-3), variables["sparsity"],
                                  jsparse24.optim.MaskSchedule(rebuild_every=10))
  opt_state = jax.eval_shape(tx.init, variables["params"])
  assert {jsparse24.selected_implementation((batch * seq, k), (k, n), BF16, transposable=True)
          for k, n in _gpt.layer_shapes(d).values()} == {"cusparselt"}

  def step(params, opt_state, tokens):
    def loss(p):
      masks = jsparse24.optim.masks(opt_state)
      return _gpt.lm_loss(model.apply({"params": p, "sparsity": masks}, tokens[:, :-1]), tokens)
    grads = jax.grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  calls = _custom_calls(step, variables["params"], opt_state, S((batch, seq + 1), jnp.int32))
  assert set(calls) == {CUSPARSELT, TRITON} and calls.count(CUSPARSELT) >= 8, calls


@pytest.mark.parametrize("rows,cusparselt_layout,kernel", [
    (1, False, "mosaic_gpu_v2"), (64, False, "mosaic_gpu_v2"), (128, False, TRITON),
    (2048, True, CUSPARSELT)])
def test_compressed_weights_product_by_the_automatic_choice(monkeypatch, rows,
                                                            cusparselt_layout, kernel):
  """A compressed 4096 x 4096 bf16 weight (`compress`, as `compress_params`
  ships it) multiplied with `implementation=None` as an H200 lowers it: the
  sparse-tensor-core decode kernel (Mosaic GPU) at decoding's few rows, the
  Triton decode kernel at 128, cuSPARSELt on its own layout at a prefill's
  2048 (`benchmarks/bench_decode.py`'s choices)."""
  _as_on_a_gpu(monkeypatch)
  w = S((4096, 4096), BF16)
  sp = jax.eval_shape(lambda w: jsparse24.compress(
      w, jsparse24.Mask24.from_weights(w), cusparselt=cusparselt_layout), w)
  calls = _custom_calls(jsparse24.sparse_dot, S((rows, 4096), BF16), sp)
  assert calls == [kernel], calls


def test_moe_experts_run_on_cusparselt(monkeypatch):
  """`SparseMoE` with `implementation="cusparselt"` (forward and gradients)
  as a GPU lowers it: the experts' stacked products are cuSPARSELt calls,
  their masks and compressed operands the Pallas kernels'. The layer's
  variables are shapes only."""
  _as_on_a_gpu(monkeypatch)
  moe = jsparse24.SparseMoE(num_experts=4, hidden=1024, dtype=BF16, param_dtype=BF16,
                            implementation="cusparselt")
  x = S((2, 256, 512), BF16)
  variables = jax.eval_shape(moe.init, jax.random.key(0), x)

  def loss(params, sparsity, x):
    y = moe.apply({"params": params, "sparsity": sparsity}, x)
    return jnp.sum(y.astype(F32) ** 2)

  calls = _custom_calls(jax.grad(loss, argnums=(0, 2)), variables["params"],
                        variables["sparsity"], x)
  assert set(calls) == {CUSPARSELT, TRITON}, calls
