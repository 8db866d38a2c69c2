"""benchmarks/bench_moe.py runs end to end on CPU at a tiny size (--quick),
its dense layer is `SparseMoE` with `nn.Dense` products, and the 2:4
layer's expert products reach `sparse_dot` under `vmap` over the experts."""

import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jsparse24
from benchmarks import bench_moe
from jsparse24 import _ops
from jsparse24.backends.pallas import interpret_mode

E, D, H = 4, 16, 32


def test_bench_moe_quick_runs_on_cpu(capsys, tmp_path):
  path = tmp_path / "moe.json"
  out = bench_moe.main(["--quick", "--no-write", "--json", str(path)])
  r, cfg = out["result"], out["config"]
  assert json.loads(path.read_text())["result"] == json.loads(json.dumps(r))
  d, e, hidden = cfg["d_model"], cfg["experts"], cfg["hidden"]
  assert r["mask_shapes"] == {"up": [e, d, hidden], "down": [e, hidden, d]}
  # The 2:4 layer computed the dense layer on its masked kernels.
  assert r["sparse"]["first_loss"] == pytest.approx(r["sparse"]["reference_loss"], rel=1e-2)
  assert r["dense"]["first_loss"] != r["sparse"]["first_loss"]  # the dense one is dense
  for key in ("step_ms", "routing_ms", "tokens_per_s"):
    assert r["dense"][key] > 0 and r["sparse"][key] > 0, key
  assert r["speedup"] == pytest.approx(r["dense"]["step_ms"] / r["sparse"]["step_ms"])
  assert math.isfinite(r["routing_ratio"]) and math.isfinite(r["speedup_with_rebuilds"])
  lines = capsys.readouterr().out.rstrip().splitlines()
  assert lines[-6].startswith("| dense | ") and lines[-5].startswith("| 2:4 | ")
  assert lines[-1].startswith("| dense again, after the 2:4 steps")


def test_bench_moe_rejects_shapes_it_cannot_route():
  with pytest.raises(SystemExit):
    bench_moe.main(["--quick", "--no-write", "--tokens", "100", "--group", "64"])
  with pytest.raises(SystemExit):
    bench_moe.main(["--quick", "--no-write", "--top-k", "5", "--experts", "4"])


def _layer_and_variables(capacity_factor=1.25):
  model = jsparse24.SparseMoE(num_experts=E, hidden=H, top_k=2, capacity_factor=capacity_factor)
  x = jax.random.normal(jax.random.key(0), (2, 8, D))
  return model, x, model.init(jax.random.key(1), x)


def test_the_dense_reference_is_the_2_4_layer_on_its_masked_kernels():
  """What the benchmark checks its 2:4 step's first loss against."""
  model, x, v = _layer_and_variables()
  dense = model.clone(sparse=False)
  y_dense, _ = bench_moe.moe_apply(dense)(bench_moe.masked_params(v["params"], v["sparsity"]),
                                          None, x)
  np.testing.assert_allclose(y_dense, model.apply(v, x), rtol=2e-5, atol=2e-5)
  y_unmasked, _ = bench_moe.moe_apply(dense)(v["params"], None, x)
  assert not np.allclose(y_unmasked, y_dense, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("sparse", [True, False])
def test_identity_products_leave_the_router_alone(sparse):
  """Routing alone: the experts are gelu(x), and of the params only the
  router's exist, for the 2:4 layer and for the dense one."""
  model, x, v = _layer_and_variables(capacity_factor=E / 2)  # room for every choice
  model = model.clone(sparse=sparse)
  with nn.intercept_methods(bench_moe.identity_products):
    params = model.init(jax.random.key(1), x)["params"]
  assert set(params) == {"router"}
  y, _ = bench_moe.moe_apply(model, bench_moe.identity_products)(params, None, x)
  # Top-2, nothing dropped: y = (p_1 + p_2) * gelu(x) per token.
  probs = jax.nn.softmax(x @ params["router"]["kernel"], axis=-1)
  gates = jnp.sum(jax.lax.top_k(probs, 2)[0], axis=-1, keepdims=True)
  np.testing.assert_allclose(y, gates * nn.gelu(x), rtol=1e-5, atol=1e-5)
  jax.tree.map(np.testing.assert_array_equal, params["router"], v["params"]["router"])


def _scans_of_length(jaxpr, length: int, name: str) -> int:
  """How many `scan`s of `length` iterations hold a call named `name`."""

  def subjaxprs(eqn):
    for p in eqn.params.values():
      for q in (p if isinstance(p, (list, tuple)) else [p]):
        if hasattr(q, "eqns"):
          yield q
        elif hasattr(q, "jaxpr") and hasattr(q.jaxpr, "eqns"):
          yield q.jaxpr

  def holds(j):
    return any(e.params.get("name") == name or any(holds(s) for s in subjaxprs(e))
               for e in j.eqns)

  count = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan" and eqn.params["length"] == length and holds(
        eqn.params["jaxpr"].jaxpr):
      count += 1
    else:
      count += sum(_scans_of_length(s, length, name) for s in subjaxprs(eqn))
  return count


def test_expert_products_reach_sparse_dot_under_vmap(monkeypatch):
  """Each expert kernel reaches the product as its own `[K, N]` weight under
  `vmap` (one traced call per kernel), and with a backend whose batching
  rule maps over batched weights (Pallas here, cuSPARSELt on a GPU) the
  training gradient runs one product per expert: a `lax.map` (scan) of E
  steps for each kernel's forward product and each `dx`."""
  calls = []
  real = _ops._dot

  def spy(fn, x, w, *args, **kwargs):
    calls.append((tuple(w.shape), isinstance(w, jax.core.Tracer)))
    return real(fn, x, w, *args, **kwargs)

  monkeypatch.setattr(_ops, "_dot", spy)
  model = jsparse24.SparseMoE(num_experts=E, hidden=H, top_k=2, implementation="pallas")
  x = jnp.ones((2, 8, D))
  with interpret_mode():
    v = model.init(jax.random.key(0), x)
    calls.clear()
    # The training masks: an always-sparse schedule has no dense-phase switch.
    masks = jsparse24.optim.masks(
        jsparse24.optim.with_masks(optax.sgd(0.1), v["sparsity"]).init(v["params"]))
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(
        model.apply({"params": p, "sparsity": masks}, x))))(v["params"])
  assert calls == [((D, H), True), ((H, D), True)]
  assert _scans_of_length(jaxpr.jaxpr, E, "sparse_matmul") == 4


def test_moe_apply_draws_a_new_mvue_key_per_step():
  """`--weight-grad mvue`: the 2:4 step passes the layer a "mvue" key made
  from the optimizer's count (without one the layer's weight gradient
  would be dense), a new one each step."""
  model = jsparse24.SparseMoE(num_experts=E, hidden=H, top_k=2, capacity_factor=E / 2,
                              weight_grad="mvue")
  x = jax.random.normal(jax.random.key(0), (2, 8, D))
  v = model.init(jax.random.key(1), x)
  tx = jsparse24.optim.with_masks(optax.sgd(0.1), v["sparsity"])
  opt = tx.init(v["params"])
  apply = bench_moe.moe_apply(model)
  grad = jax.jit(lambda p, o: jax.grad(lambda p: jnp.sum(apply(p, o, x)[0] ** 2))(p))
  dense_grad = jax.grad(lambda p: jnp.sum(bench_moe.moe_apply(model.clone(weight_grad="dense"))(
      p, opt, x)[0] ** 2))(v["params"])
  first = grad(v["params"], opt)
  # at_count consumes the count it is given: a copy, as `opt` is used again.
  later = grad(v["params"], bench_moe.at_count(jax.tree.map(jnp.copy, opt), count=1))
  up = lambda g: np.asarray(g["experts"]["up"]["kernel"])  # noqa: E731
  assert not np.allclose(up(first), up(dense_grad))  # MVUE-pruned, not dense
  assert not np.allclose(up(first), up(later))  # another key at another count
  np.testing.assert_allclose(up(first), up(grad(v["params"], opt)))  # the same at the same count
