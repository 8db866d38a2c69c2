"""MoE block: `jsparse24.SparseMoE` trained dense and 2:4 sparse, side by side.

    PYTHONPATH=. python benchmarks/bench_moe.py [--d-model 4096] [--experts 8] [--top-k 2]
        [--tokens 16384] [--group 2048] [--weight-grad {dense,mvue}] [--json PATH] [--no-write]
    PYTHONPATH=. python benchmarks/bench_moe.py --quick --no-write   # CPU smoke test

The block is one `jsparse24.SparseMoE` feed-forward layer (issue 43's
shape by default: 8 experts, top-2, d_model 4096, hidden 4 x d_model,
16,384 tokens per step in routing groups of `--group` tokens, capacity
factor 1.25), bfloat16 compute, float32 params. A training step is the
forward pass, the gradients of the loss (mean squared error against a
random target plus 0.01 x the sown load-balancing loss, as Switch
Transformer weights it) with respect to the params and to the input (a
layer inside a model passes its input gradient on), and an AdamW update.

* 2:4: `SparseMoE` as it is, trained with `jsparse24.optim.with_masks(
  adamw, sparsity, MaskSchedule(rebuild_every=R), decay=2e-4)`; the
  forward pass reads `jsparse24.optim.masks(opt_state)`. Its expert
  products are `sparse_dot` under `jax.vmap` over the stacked `[E, K, N]`
  expert kernels (`nn.vmap`); on a GPU, where the automatic choice is
  cuSPARSELt, each product (forward, dx) is one cuSPARSELt FFI call for
  all the experts, and each compression one Pallas call.
  tests/test_bench_moe.py checks on CPU that the products reach
  `sparse_dot` under that vmap. `--weight-grad mvue` makes the experts'
  weight gradients 2:4 too (`SparseMoE(weight_grad="mvue")`, a new "mvue"
  key per step from the optimizer's count).
* dense: the same layer with `sparse=False` (its experts `nn.Dense`): the
  router, the routing, dispatch and combine are the same code in
  both, the params tree and the init params the same. Under `nn.vmap` the
  dense products are one batched XLA matmul each.
* routing alone: either model's step with each expert's two products
  replaced by their input (`identity_products`; each expert is then
  `gelu(x)`), gradients and AdamW on the router only: router, softmax,
  top-k, slots, dispatch, combine, loss. Timed for the dense model before
  any 2:4 product has run and for the 2:4 model after, so that the table
  shows whether dispatch and combine pay the cuSPARSELt tax.

The 2:4 steps are timed with mask_update's count pinned to a step that does
not rebuild, and once pinned to one that does (its extra cost amortised over
R steps). Steps donate their state and run back to back for >= 1 s per
timing (median of 5). The dense model is timed before the first 2:4 product:
a process that has run a cuSPARSELt matmul runs its other compute-bound
kernels slower (`_common.CUSPARSELT_TAX`); it is timed again after the 2:4
steps, beside (not in) the ratio. Unless --no-write, the table is written to
benchmarks/results/<gpu>.md under a dated title.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jsparse24
from benchmarks import _common
from benchmarks._gpt import LR, MASK_DECAY, MVUE, WEIGHT_DECAY, at_count

AUX_WEIGHT = 0.01  # Switch Transformer's weight of the load-balancing loss
QUICK_SHAPE = {"d_model": 32, "experts": 4, "top_k": 2, "tokens": 128, "group": 32}
EXPERT_LAYERS = ("up", "down")  # SparseMoE's expert kernels (the router is "router")
FULL_SHAPE = {"d_model": 4096, "experts": 8, "top_k": 2, "tokens": 16384, "group": 2048}


def identity_products(next_fun, args, kwargs, context):
  """`nn.intercept_methods` interceptor: each expert's `up` and `down`
  (`jsparse24.SparseDense`, or `nn.Dense` with `sparse=False`) returns its
  input, creating no params: the experts of a `SparseMoE` become
  `activation(x)`, which leaves the router, routing, dispatch and combine."""
  module = context.module
  if (type(module) not in (jsparse24.SparseDense, nn.Dense) or module.name not in EXPERT_LAYERS
      or context.method_name != "__call__"):
    return next_fun(*args, **kwargs)
  return args[0]


def make_step(apply, tx):
  """jit((params, opt_state, x, target) -> (params, opt_state, loss, dx)),
  donating the state. `apply(params, opt_state, x) -> (y, load_balancing_loss)`."""

  def loss_fn(params, opt_state, x, target):
    y, aux = apply(params, opt_state, x)
    mse = jnp.mean(jnp.square(y.astype(jnp.float32) - target.astype(jnp.float32)))
    return mse + AUX_WEIGHT * aux

  def step(params, opt_state, x, target):
    loss, (grads, dx) = jax.value_and_grad(loss_fn, argnums=(0, 2))(params, opt_state, x, target)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, dx

  return jax.jit(step, donate_argnums=(0, 1))


def moe_apply(model, interceptor=None):
  """`apply(params, opt_state, x) -> (y, load_balancing_loss)` of `model`:
  with the 2:4 masks of `opt_state` when `model.sparse`, under `interceptor`
  when given (the products are traced inside its context)."""

  def apply(params, opt_state, x):
    variables, rngs = {"params": params}, None
    if model.sparse and interceptor is None:
      variables["sparsity"] = jsparse24.optim.masks(opt_state)
      if model.weight_grad == "mvue":  # a new key per step, as a training loop derives it
        rngs = {MVUE: jax.random.fold_in(jax.random.key(1), opt_state[0].count)}
    with nn.intercept_methods(interceptor) if interceptor else contextlib.nullcontext():
      y, state = model.apply(variables, x, mutable=["intermediates"], rngs=rngs)
    (aux,) = state["intermediates"]["load_balancing_loss"]
    return y, aux

  return apply


_fingerprint = jax.jit(lambda tree: jax.tree.map(
    lambda a: jnp.sum(jnp.abs(a.astype(jnp.float32))), tree))


def masked_params(params, sparsity):
  """`params` with each expert kernel times its expert's mask: the dense
  model applied to them computes what the 2:4 model computes."""

  def mask(path, a):
    keys = tuple(k.key for k in path)
    if keys[0] != "experts" or keys[-1] != "kernel":
      return a
    return jnp.where(jax.vmap(lambda m: m.unpack())(sparsity["experts"][keys[1]]["mask"]), a, 0)

  return jax.tree_util.tree_map_with_path(mask, params)


def time_routing(model, params, timer, x, target) -> float:
  """Seconds per routing-alone step (`identity_products`): the router of
  `params` (a copy: the step donates it) and its own AdamW."""
  adamw = optax.adamw(LR, weight_decay=WEIGHT_DECAY)
  router = {"router": jax.tree.map(jnp.copy, params["router"])}
  step = make_step(moe_apply(model, identity_products), adamw)
  runner, _ = _common.threaded(step, router, adamw.init(router))
  return timer(runner, x, target)


def run(cfg: dict, timer, step_timer) -> dict:
  d, e, k, hidden = cfg["d_model"], cfg["experts"], cfg["top_k"], cfg["hidden"]
  groups, group = cfg["tokens"] // cfg["group"], cfg["group"]
  model = jsparse24.SparseMoE(num_experts=e, hidden=hidden, top_k=k,
                              capacity_factor=cfg["capacity_factor"], dtype=jnp.bfloat16,
                              implementation=cfg["implementation"],
                              weight_grad=cfg["weight_grad"])
  dense_model = model.clone(sparse=False)
  key_x, key_t, key_init = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(key_x, (groups, group, d), jnp.bfloat16)
  target = jax.random.normal(key_t, (groups, group, d), jnp.bfloat16)
  capacity = jsparse24.moe.expert_capacity(group, e, k, cfg["capacity_factor"])
  rows = groups * capacity  # each expert's tokens per product
  out = {"capacity": capacity, "expert_rows": rows, "implementations": {
      name: jsparse24.selected_implementation((rows, kk), (kk, n), jnp.bfloat16,
                                              transposable=n % 4 == 0)
      for name, (kk, n) in (("up", (d, hidden)), ("down", (hidden, d)))}}
  if cfg["implementation"]:
    out["implementations"] = {name: cfg["implementation"] for name in out["implementations"]}
  print(f"capacity {capacity} tokens per expert and group, {rows} rows per expert product;"
        f" 2:4 backend per expert product: {out['implementations']}", flush=True)
  tokens = cfg["tokens"]
  adamw = optax.adamw(LR, weight_decay=WEIGHT_DECAY)

  # Dense, before any 2:4 product has run in this process.
  print("dense: init, compile, first step", flush=True)
  params = jax.jit(dense_model.init)(key_init, x)["params"]
  out["params"] = sum(math.prod(a.shape) for a in jax.tree.leaves(params))
  fingerprint = jax.tree.leaves(jax.tree.map(float, _fingerprint(params)))
  shapes = jax.tree.map(lambda a: (a.shape, a.dtype), params)
  opt_state = jax.jit(adamw.init)(params)
  dense_step, compile_s = _common.compile_step(
      make_step(moe_apply(dense_model), adamw), params, opt_state, x, target)
  params, opt_state, loss, _ = dense_step(params, opt_state, x, target)
  dense = out["dense"] = {"compile_s": compile_s, "first_loss": float(loss)}
  print(f"dense: compiled in {compile_s:.1f} s, first-step loss {dense['first_loss']:.4f}",
        flush=True)
  print("dense: timing", flush=True)
  runner, state = _common.threaded(dense_step, params, opt_state)
  dense["step_ms"] = step_timer(runner, x, target) * 1e3
  dense["tokens_per_s"] = tokens / dense["step_ms"] * 1e3
  print(f"dense: {dense['step_ms']:.2f} ms/step, {dense['tokens_per_s']:,.0f} tokens/s",
        flush=True)
  print("dense: routing alone", flush=True)
  dense["routing_ms"] = time_routing(dense_model, state["params"], step_timer, x, target) * 1e3
  print(f"dense: routing + dispatch + combine alone {dense['routing_ms']:.2f} ms/step",
        flush=True)
  del params, opt_state, runner, state

  # 2:4, then the dense step again.
  print("2:4: init, compile, first step", flush=True)
  variables = jax.jit(model.init)(key_init, x)
  params = variables["params"]
  if jax.tree.map(lambda a: (a.shape, a.dtype), params) != shapes:
    raise AssertionError("the 2:4 layer's params tree differs from the dense layer's")
  if not all(math.isclose(a, b, rel_tol=1e-5) for a, b in
             zip(jax.tree.leaves(jax.tree.map(float, _fingerprint(params))), fingerprint)):
    raise AssertionError("the 2:4 layer's initial params differ from the dense layer's")
  out["mask_shapes"] = {name: list(layer["mask"].shape)
                        for name, layer in variables["sparsity"]["experts"].items()}
  schedule = jsparse24.optim.MaskSchedule(rebuild_every=cfg["rebuild_every"])
  tx = jsparse24.optim.with_masks(adamw, variables["sparsity"], schedule, decay=MASK_DECAY)
  opt_state = jax.jit(tx.init)(params)
  del variables
  # The 2:4 layer must compute the dense layer on the masked kernels.
  dense_apply = moe_apply(dense_model)

  def reference_loss(p, o, x, target):
    y, aux = dense_apply(masked_params(p, jsparse24.optim.masks(o)), o, x)
    return (jnp.mean(jnp.square(y.astype(jnp.float32) - target.astype(jnp.float32)))
            + AUX_WEIGHT * aux)

  reference = float(jax.jit(reference_loss)(params, opt_state, x, target))
  sparse_step, compile_s = _common.compile_step(
      make_step(moe_apply(model), tx), params, opt_state, x, target)
  params, opt_state, loss, _ = sparse_step(params, opt_state, x, target)
  sp = out["sparse"] = {"compile_s": compile_s, "first_loss": float(loss),
                        "reference_loss": reference}
  print(f"2:4: compiled in {compile_s:.1f} s, first-step loss {sp['first_loss']:.4f} (dense"
        f" layer on the masked kernels {reference:.4f})", flush=True)
  if not (math.isfinite(sp["first_loss"])
          and abs(sp["first_loss"] - reference) <= 1e-2 * abs(reference)):
    raise AssertionError(f"2:4 first-step loss {sp['first_loss']} is not finite or differs from"
                         f" the dense layer's on the masked kernels ({reference}) by over 1%")
  plain, rebuild = 0, cfg["rebuild_every"] - 1
  print(f"2:4: timing (mask_update count pinned at {plain}: no rebuild)", flush=True)
  runner, state = _common.threaded(sparse_step, params, opt_state,
                                   functools.partial(at_count, count=plain))
  sp["step_ms"] = step_timer(runner, x, target) * 1e3
  sp["tokens_per_s"] = tokens / sp["step_ms"] * 1e3
  if int(state["opt"][0].last_rebuild) != 0:
    raise AssertionError("a timed 2:4 step rebuilt the masks")
  out["speedup"] = dense["step_ms"] / sp["step_ms"]
  print(f"2:4: {sp['step_ms']:.2f} ms/step, {sp['tokens_per_s']:,.0f} tokens/s,"
        f" {out['speedup']:.3f}x dense", flush=True)
  print(f"2:4: timing a rebuild step (count pinned at {rebuild})", flush=True)
  runner, state = _common.threaded(sparse_step, state["params"], state["opt"],
                                   functools.partial(at_count, count=rebuild))
  sp["rebuild_step_ms"] = step_timer(runner, x, target) * 1e3
  if int(state["opt"][0].last_rebuild) != cfg["rebuild_every"]:
    raise AssertionError("the rebuild step did not rebuild the masks")
  sp["rebuild_extra_ms_per_step"] = (sp["rebuild_step_ms"] - sp["step_ms"]) / cfg["rebuild_every"]
  out["speedup_with_rebuilds"] = dense["step_ms"] / (sp["step_ms"]
                                                     + sp["rebuild_extra_ms_per_step"])
  print("2:4: routing alone", flush=True)
  sp["routing_ms"] = time_routing(model, state["params"], step_timer, x, target) * 1e3
  out["routing_ratio"] = dense["routing_ms"] / sp["routing_ms"]
  print(f"2:4: routing + dispatch + combine alone {sp['routing_ms']:.2f} ms/step", flush=True)
  del params, opt_state, runner, state, sparse_step

  print("dense: timing again, after the 2:4 steps", flush=True)
  params = jax.jit(dense_model.init)(key_init, x)["params"]
  runner, _ = _common.threaded(dense_step, params, jax.jit(adamw.init)(params))
  dense["step_ms_after_sparse"] = step_timer(runner, x, target) * 1e3
  dense["after_sparse"] = dense["step_ms_after_sparse"] / dense["step_ms"] - 1
  print(f"dense again: {dense['step_ms_after_sparse']:.2f} ms/step"
        f" ({dense['after_sparse']:+.1%}; not in the ratio)", flush=True)
  return out


def results_table(cfg: dict, r: dict) -> str:
  dense, sp, tokens, every = r["dense"], r["sparse"], cfg["tokens"], cfg["rebuild_every"]
  amortised = sp["step_ms"] + sp["rebuild_extra_ms_per_step"]
  rows = [
      ["dense", dense["step_ms"], tokens / dense["step_ms"] * 1e3, 1.0],
      ["2:4", sp["step_ms"], sp["tokens_per_s"], r["speedup"]],
      [f"2:4, a rebuild every {every} steps (amortised)", amortised,
       tokens / amortised * 1e3, r["speedup_with_rebuilds"]],
      ["routing + dispatch + combine alone, dense", dense["routing_ms"],
       tokens / dense["routing_ms"] * 1e3, 1.0],
      ["routing + dispatch + combine alone, 2:4 (after 2:4 products ran)", sp["routing_ms"],
       tokens / sp["routing_ms"] * 1e3, r["routing_ratio"]],
      ["dense again, after the 2:4 steps (not in the ratios)", dense["step_ms_after_sparse"],
       tokens / dense["step_ms_after_sparse"] * 1e3,
       dense["step_ms"] / dense["step_ms_after_sparse"]],
  ]
  return _common.table(["step", "ms / step", "tokens / s", "dense ms / this ms"], rows)


def notes(cfg: dict, r: dict) -> str:
  return (
      f"`benchmarks/bench_moe.py`: one `jsparse24.SparseMoE` layer, {cfg['experts']} experts,"
      f" top-{cfg['top_k']}, d_model {cfg['d_model']}, hidden {cfg['hidden']}, capacity factor"
      f" {cfg['capacity_factor']} ({r['capacity']} slots per expert and group),"
      f" {cfg['tokens']:,} random tokens per step in {cfg['tokens'] // cfg['group']} routing"
      f" groups of {cfg['group']}; {r['params'] / 1e6:,.0f}M params; bf16 compute, f32"
      f" params; forward, gradients of MSE + {AUX_WEIGHT} x load-balancing loss with respect to"
      f" the params and the input, AdamW (lr {LR}, weight decay {WEIGHT_DECAY}). 2:4 ="
      f" the layer as it is (expert products on {r['implementations']}, `sparse_dot` under"
      f" `vmap` over the experts: on cuSPARSELt one call for all the experts per product;"
      f" weight gradients {cfg['weight_grad']}) with"
      f" `with_masks(adamw, MaskSchedule(rebuild_every={cfg['rebuild_every']}),"
      f" decay={MASK_DECAY})`; dense = the same layer with `sparse=False` (`nn.Dense`"
      f" experts): identical routing code and init params. Routing"
      f" alone = the step with each expert's products replaced by their input (router"
      f" gradients and AdamW only). Steps donate their state and are timed in runs of >= 1 s"
      f" (median of 5); the 2:4 steps with mask_update's count pinned to a step that does not"
      f" rebuild (and once to one that does). The dense step and dense routing are timed"
      f" before the first 2:4 product: {_common.CUSPARSELT_TAX}.")


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--d-model", type=_common.count, default=None, help="model width (default 4096)")
  p.add_argument("--experts", type=_common.count, default=None, help="E (default 8)")
  p.add_argument("--top-k", type=_common.count, default=None, help="experts per token (default 2)")
  p.add_argument("--tokens", type=_common.count, default=None,
                 help="tokens per step (default 16384)")
  p.add_argument("--group", type=_common.count, default=None,
                 help="tokens per routing group, each with its own capacity per expert"
                      " (default 2048)")
  p.add_argument("--hidden", type=_common.count, default=None,
                 help="expert hidden width (4 x d_model)")
  p.add_argument("--capacity-factor", type=float, default=1.25)
  p.add_argument("--implementation", default=None, choices=("xla", "pallas", "cusparselt"),
                 help="the expert products' 2:4 backend (default: the automatic choice)")
  p.add_argument("--rebuild-every", type=_common.rebuild_period, default=100,
                 help="R: mask rebuild period (>= 2)")
  p.add_argument("--weight-grad", choices=("dense", "mvue"), default="dense",
                 help="the 2:4 experts' weight gradients: dense (default) or MVUE-pruned 2:4")
  p.add_argument("--quick", action="store_true",
                 help=f"one timing repeat, and tiny default shapes {QUICK_SHAPE} (CPU smoke test)")
  p.add_argument("--json", default=None, help="also write every number to this JSON file")
  p.add_argument("--no-write", action="store_true", help="print only; leave results/ alone")
  args = p.parse_args(argv)

  shape = QUICK_SHAPE if args.quick else FULL_SHAPE
  cfg = {name: getattr(args, name) if getattr(args, name) is not None else default
         for name, default in shape.items()}
  if not 0 < args.capacity_factor < math.inf:
    p.error(f"--capacity-factor {args.capacity_factor} must be a finite number > 0.")
  cfg["hidden"] = args.hidden or 4 * cfg["d_model"]
  cfg.update(capacity_factor=args.capacity_factor, implementation=args.implementation,
             rebuild_every=args.rebuild_every, weight_grad=args.weight_grad)
  if cfg["d_model"] % 4 or cfg["hidden"] % 4:
    p.error("--d-model and --hidden must be multiples of 4 (2:4 along both kernel axes)")
  if cfg["tokens"] % cfg["group"]:
    p.error(f"--tokens {cfg['tokens']} must be a multiple of --group {cfg['group']}")
  if not 1 <= cfg["top_k"] <= cfg["experts"]:
    p.error(f"--top-k {cfg['top_k']} must lie in [1, --experts {cfg['experts']}]")
  timer, step_timer = _common.timers(args.quick)
  env = _common.environment()
  print(env, flush=True)
  print(f"backends: {jsparse24.available_implementations()}", flush=True)
  result = run(cfg, timer, step_timer)
  table = results_table(cfg, result)
  out = {"environment": env, "config": cfg, "result": result}
  if args.json:
    _common.write_json(args.json, out)
  if not args.no_write:
    title = (f"MoE block training step ({time.strftime('%Y-%m-%d', time.gmtime())}):"
             f" {cfg['experts']} experts, top-{cfg['top_k']}, d_model {cfg['d_model']},"
             f" hidden {cfg['hidden']}, {cfg['tokens']:,} tokens per step")
    path = _common.write_section(title, f"{env}\n\n{notes(cfg, result)}\n\n{table}\n")
    print(f"wrote {path}", flush=True)
  print(f"\n{table}", flush=True)
  return out


if __name__ == "__main__":
  main()
