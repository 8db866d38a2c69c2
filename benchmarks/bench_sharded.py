"""Multi-GPU training steps with `jax.jit` over a mesh: dense vs 2:4, 1 and N GPUs.

    PYTHONPATH=. python benchmarks/bench_sharded.py [--d 4096] [--tokens 16384]

An MLP block (`x + down(gelu(up(x)))`, d_model `--d`, hidden 4d, bf16
compute, f32 params, `--tokens` tokens per step), trained with one `jax.jit`
step (`mask_update` + SGD for 2:4, SGD for dense). The 2:4 layers are
`SparseDense(transposable=True, implementation="cusparselt")`. Layouts over a
1-D mesh of all local GPUs:

* data parallel: tokens sharded, params and optimizer state replicated;
* FSDP: tokens sharded, params (and SGD's state) sharded on their output axis,
  gathered whole inside the step (`with_sharding_constraint`);
* FSDP with the 2:4 kernels left sharded (`fsdp-sharded`): as FSDP, but the
  2:4 layers' kernels are not gathered: each device compresses its own
  columns and the compressed arrays are gathered (the dense model is the
  FSDP one);
* tensor parallel (`tp`, a `data x model` mesh of 1 x all GPUs): Megatron's
  MLP, `up` column-parallel (kernel sharded on its output axis) and `down`
  row-parallel (on its input axis), tokens replicated. The 2:4 layers name
  their kernels' sharding (`kernel_sharding`): each device prunes,
  compresses and multiplies its own block; XLA partitions the dense model
  the same way by itself.

Per layout and model: ms per step on 1 GPU and on all, the scaling, and the
collectives in the compiled HLO by kind. Written to results/<gpu>.md.
"""

from __future__ import annotations

import argparse
import json
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import jsparse24
from benchmarks import _common


class Block(nn.Module):
  d: int
  sparse: bool
  implementation: str = "cusparselt"
  shardings: tuple | None = None  # tensor parallel: {name: kernel NamedSharding}
  weight_grad: str = "dense"

  @nn.compact
  def __call__(self, x):
    kernel_sharding = dict(self.shardings or ())
    if self.sparse:
      layer = lambda n, name: jsparse24.SparseDense(  # noqa: E731
          n, name=name, dtype=jnp.bfloat16, use_bias=False, transposable=True,
          implementation=self.implementation, kernel_sharding=kernel_sharding.get(name),
          weight_grad=self.weight_grad)
    else:
      layer = lambda n, name: nn.Dense(n, name=name, dtype=jnp.bfloat16, use_bias=False)  # noqa: E731
    return x + layer(self.d, "down")(nn.gelu(layer(4 * self.d, "up")(x)))


def collectives(hlo: str) -> dict[str, int]:
  return {k: len(re.findall(r" " + k + r"(?:-start)?\(", hlo))
          for k in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all")}


def tp_specs(d: int) -> dict[str, P]:
  """Megatron's MLP: up column-parallel, down row-parallel."""
  del d
  return {"up": P(None, "model"), "down": P("model", None)}


def make(sparse: bool, d: int, tokens: int, mesh, layout: str, implementation: str,
         weight_grad: str = "dense"):
  shardings = (tuple((k, NamedSharding(mesh, v)) for k, v in tp_specs(d).items())
               if layout == "tp" else None)
  model = Block(d, sparse, implementation, shardings, weight_grad)
  x = jax.random.normal(jax.random.key(0), (tokens, d), jnp.bfloat16)
  v = model.init(jax.random.key(1), x)
  sgd = optax.sgd(1e-3)
  if sparse:
    tx = optax.chain(jsparse24.optim.mask_update(
        v["sparsity"], jsparse24.optim.MaskSchedule(rebuild_every=1000), decay=2e-4), sgd)
  else:
    tx = sgd
  gather = NamedSharding(mesh, P()) if layout.startswith("fsdp") else None
  keep_sharded = sparse and layout == "fsdp-sharded"

  def constrain(path, a):
    if keep_sharded and path[-1].key == "kernel":  # both layers are 2:4
      return a
    return jax.lax.with_sharding_constraint(a, gather)

  def step(params, opt_state, x):
    def loss(p):
      if gather is not None:
        p = jax.tree_util.tree_map_with_path(constrain, p)
      variables, rngs = {"params": p}, None
      if sparse:
        variables["sparsity"] = jsparse24.optim.masks(opt_state)
        if weight_grad == "mvue":  # a new key per step, from mask_update's count
          rngs = {jsparse24.linen.MVUE_RNG: jax.random.fold_in(jax.random.key(2),
                                                               opt_state[0].count)}
      return jnp.mean(model.apply(variables, x, rngs=rngs).astype(jnp.float32) ** 2)

    grads = jax.grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params = v["params"]
  opt_state = tx.init(params)
  rows = NamedSharding(mesh, P("data"))
  if layout.startswith("fsdp"):
    put = lambda a: jax.device_put(a, NamedSharding(  # noqa: E731
        mesh, P(*([None] * (a.ndim - 1)), "data") if a.ndim >= 1 and a.shape[-1] % mesh.size == 0
        else P()))
  elif layout == "tp":
    params = {k: {"kernel": jax.device_put(v["kernel"], NamedSharding(mesh, tp_specs(d)[k]))}
              for k, v in params.items()}
    put = lambda a: a  # noqa: E731
  else:
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P()))  # noqa: E731
  params = jax.tree.map(put, params)
  opt_state = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P())), opt_state)
  if sparse:  # the masks where each device's block of its kernel is (tp)
    opt_state = jsparse24.optim.masks_like_kernels(opt_state, params)
  # The state keeps its layout from step to step (as a training loop's
  # does); left to XLA, the rebuilt masks could come back replicated.
  keep = jax.tree.map(lambda a: a.sharding, (params, opt_state))
  return jax.jit(step, out_shardings=keep), params, opt_state, jax.device_put(x, rows)


def run(sparse, d, tokens, devices, layout, implementation, weight_grad="dense"):
  if layout == "tp":
    mesh = jax.sharding.Mesh(np.array(devices).reshape(1, -1), ("data", "model"))
  else:
    mesh = jax.sharding.Mesh(devices, ("data",))
  step, params, opt_state, x = make(sparse, d, tokens, mesh, layout, implementation, weight_grad)
  hlo = step.lower(params, opt_state, x).compile().as_text()
  call, _ = _common.threaded(step, params, opt_state)
  ms = _common.bench(call, x) * 1e3
  return ms, collectives(hlo)


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--d", type=_common.count, default=4096)
  p.add_argument("--tokens", type=_common.count, default=16384)
  p.add_argument("--implementation", default="cusparselt",
                 help="the 2:4 layers' backend ('xla' for a CPU smoke test)")
  p.add_argument("--layouts", default="data,fsdp,fsdp-sharded,tp")
  p.add_argument("--weight-grad", default="dense",
                 help="the 2:4 layers' weight_grad, comma-separated for one 2:4 row each"
                      " ('dense,mvue': also dw = x^T MVUE24(dy) on the sparse tensor cores)")
  p.add_argument("--json", default=None)
  p.add_argument("--no-write", action="store_true")
  args = p.parse_args(argv)
  grads = args.weight_grad.split(",")
  if not set(grads) <= {"dense", "mvue"}:
    p.error(f"--weight-grad: expected 'dense' and/or 'mvue', got {args.weight_grad!r}")
  devs = jax.local_devices()
  n = len(devs)
  models = [("dense", False, "dense")] + [
      ("2:4" if g == "dense" else "2:4 MVUE", True, g) for g in grads]
  layouts = args.layouts.split(",")
  # The dense model at every layout first: once a cuSPARSELt product has run
  # in the process, its compute-bound kernels run 2-7% slower until it ends
  # (`_common.CUSPARSELT_TAX`), which a dense run never pays.
  res = {layout: {} for layout in layouts}
  out = []
  for name, sparse, grad in models:
    for layout in layouts:
      one, _ = run(sparse, args.d, args.tokens, devs[:1], layout, args.implementation, grad)
      many, coll = run(sparse, args.d, args.tokens, devs, layout, args.implementation, grad)
      res[layout][name] = (one, many, coll)
      dense_many = res[layout]["dense"][1]
      print(f"{layout:5s} {name:8s}: 1 GPU {one:.2f} ms, {n} GPUs {many:.2f} ms,"
            f" scaling {one / many:.2f}x, dense {n}-GPU / this {dense_many / many:.3f}x,"
            f" collectives {coll}", flush=True)
      out.append({"layout": layout, "model": name, "ms_1": one, f"ms_{n}": many,
                  "scaling": one / many, "collectives": coll})
  rows = [[layout, name, *res[layout][name][:2], res[layout][name][0] / res[layout][name][1],
           res[layout]["dense"][1] / res[layout][name][1],
           ", ".join(f"{v} {k}" for k, v in res[layout][name][2].items() if v) or "none"]
          for layout in layouts for name, _, _ in models]
  body = (f"{_common.environment()}\n\nMLP block d_model {args.d}, hidden {4 * args.d},"
          f" {args.tokens} tokens per step, bf16 compute / f32 params; 2:4 ="
          f" SparseDense(transposable=True, implementation={args.implementation!r}) + mask_update"
          + ("; 2:4 MVUE = the same with weight_grad='mvue'" if "mvue" in grads else "") + ";"
          f" one jax.jit step over a mesh of {n} GPUs (`tp`: data x model = 1 x {n}, up"
          f" column-parallel, down row-parallel; otherwise 1-D)"
          f" (`benchmarks/bench_sharded.py`); the dense model timed at every layout before"
          f" any 2:4 step ran ({_common.CUSPARSELT_TAX}).\n\n"
          + _common.table(["layout", "model", "1 GPU ms", f"{n} GPUs ms", "scaling",
                           f"dense {n}-GPU ms / this", f"collectives ({n} GPUs)"], rows))
  print(body)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"environment": _common.environment(), "results": out}, f, indent=1)
  if not args.no_write:
    print("wrote", _common.write_section(f"Multi-GPU: jit over a mesh of {n}, MLP block", body))


if __name__ == "__main__":
  main()
