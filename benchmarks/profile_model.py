"""Profiles one training step of `bench_model.py`'s GPT in several variants and
prints where the GPU time goes: interleaved step timings, kernel time by
category, the kernels whose time differs most from the dense step's, the
Pallas, FFI and custom-call kernels by kernel name, and the step's span (span
minus kernel time = GPU idle).

    PYTHONPATH=. python benchmarks/profile_model.py D_MODEL BLOCKS [--remat]
        [--variants dense,sparse,fixed,nodecay] [--out DIR] [--weight-grad mvue]

Variants (same model, same init params; `NAME@POLICY` uses that remat policy of
`bench_model.py`'s `--remat-policy`, e.g. `sparse@dots`; default `nothing`):
  dense    `nn.Dense` layers, AdamW;
  sparse   `sparsify` defaults + `mask_update(rebuild_every=100, decay)` + AdamW
           (what `bench_model.py` times);
  fixed    the 2:4 model with the init masks held fixed, plain AdamW (no
           `mask_update`): the model's own cost;
  nodecay  as `sparse` with decay 0.

The dense variants are built, timed and profiled first, before any 2:4
variant runs (a process that has run a cuSPARSELt product runs its
compute-bound kernels 2-7% slower from then on: docs/design_notes.md, "Dense
baselines are timed before the first sparse product"), and timed again after
the 2:4 variants for reference.

Uses `jax.profiler.trace(..., create_perfetto_trace=True)` and reads the
Perfetto JSON it writes. Run it with XLA's command buffers off
(`XLA_FLAGS=--xla_gpu_enable_command_buffer=`) so that every kernel carries its
HLO op. With `--out`, the optimised HLO of each variant's step is written there.
"""
import argparse
import collections
import pathlib
import re
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import jsparse24
from benchmarks import _gpt
from benchmarks._common import count, gpu_events, kernel_category


def kernel_key(event: dict) -> str:
  """A name that is stable across two compiled programs: the HLO op's name
  (or the kernel's) without XLA's numeric suffixes."""
  args = event.get("args", {})
  name = args.get("hlo_op") or args.get("long_name") or event["name"]
  return re.sub(r"[._]\d+", "", name)[:80]


def step_of(variant: str, d: int, layers: int, remat: bool, tokens, vocab: int, attention,
            weight_grad: str = "dense"):
  """(train step, params, optimizer state) of one variant (`name[@policy]`,
  the policy a key of `_gpt.REMAT_POLICIES`)."""
  name, _, policy = variant.partition("@")
  if name not in ("dense", "sparse", "fixed", "nodecay"):
    raise SystemExit(f"profile_model: unknown variant {variant!r} (dense, sparse, fixed, nodecay,"
                     f" each optionally @ a remat policy)")
  if policy and policy not in _gpt.REMAT_POLICIES:
    raise SystemExit(f"profile_model: unknown remat policy in {variant!r}; one of"
                     f" {sorted(_gpt.REMAT_POLICIES)}")
  model = _gpt.GPT(vocab, d, layers, tokens.shape[1] - 1, attention, remat,
                 remat_policy=policy or "nothing")
  adamw = optax.adamw(_gpt.LR, weight_decay=_gpt.WEIGHT_DECAY)
  if name == "dense":
    params = jax.jit(model.init)(jax.random.key(1), tokens[:, :-1])["params"]
    step = _gpt.make_train_step(lambda p, _, x: model.apply({"params": p}, x), adamw)
    return step, params, jax.jit(adamw.init)(params)
  cfg = {"mask": "default", "weight_grad": weight_grad}
  sparse = jsparse24.sparsify(model, {_gpt.SPARSE_LAYERS: _gpt.sparse_options(cfg)})
  variables = jax.jit(sparse.init)(jax.random.key(1), tokens[:, :-1])
  if name == "fixed":
    masks = variables["sparsity"]
    step = _gpt.make_train_step(
        lambda p, _, x: sparse.apply({"params": p, "sparsity": masks}, x,
                                     rngs=_gpt.mvue_rngs(cfg, 0)), adamw)
    return step, variables["params"], jax.jit(adamw.init)(variables["params"])
  decay = 0.0 if name == "nodecay" else _gpt.MASK_DECAY
  tx = optax.chain(jsparse24.optim.mask_update(
      variables["sparsity"], jsparse24.optim.MaskSchedule(rebuild_every=100), decay=decay),
                   adamw)
  step = _gpt.make_train_step(lambda p, o, x: sparse.apply(
      {"params": p, "sparsity": jsparse24.optim.masks(o)}, x,
      rngs=_gpt.mvue_rngs(cfg, o[0].count)), tx)
  return step, variables["params"], jax.jit(tx.init)(variables["params"])


def profile(name, state, tokens, trace_dir):
  """Kernel times of one step: ({key: (us, count)}, {category: us}, span us,
  {kernel name: (us, count)} of the Pallas, FFI and custom-call kernels)."""
  step, params, opt = state["step"], state["params"], state["opt"]
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    params, opt, loss = step(params, opt, tokens)
    jax.block_until_ready(loss)
  state["params"], state["opt"] = params, opt
  events = gpu_events(trace_dir)
  if not events:
    return {}, {}, 0.0, {}
  print(f"   ({name}) first kernel event args: {sorted(events[0].get('args', {}))}")
  by, cats = collections.defaultdict(lambda: [0.0, 0]), collections.defaultdict(float)
  calls = collections.defaultdict(lambda: [0.0, 0])
  for e in events:
    key = kernel_key(e)
    tables = [(by, key)]
    if key.startswith(("pallas_call", "ffi_call", "custom-call")):
      tables.append((calls, e["name"][:70]))
    for table, k in tables:
      table[k][0] += e.get("dur", 0)
      table[k][1] += 1
    cats[kernel_category(e["name"])] += e.get("dur", 0)
  span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
  return dict(by), dict(cats), span, dict(calls)


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("d_model", type=count)
  p.add_argument("blocks", type=count)
  p.add_argument("--remat", action="store_true")
  p.add_argument("--variants", default="dense,sparse,fixed")
  p.add_argument("--rounds", type=count, default=5, help="interleaved timing rounds")
  p.add_argument("--steps", type=count, default=5, help="steps per variant per round")
  p.add_argument("--batch", type=count, default=8)
  p.add_argument("--seq", type=count, default=2048)
  p.add_argument("--vocab", type=count, default=32768)
  p.add_argument("--out", default=None, help="write each variant's optimised HLO here")
  p.add_argument("--weight-grad", default="dense", choices=("dense", "mvue"),
                 help="the 2:4 variants' weight_grad")
  args = p.parse_args()
  d, layers = args.d_model, args.blocks
  variants = args.variants.split(",")
  tokens = jax.random.randint(jax.random.key(0), (args.batch, args.seq + 1), 0, args.vocab,
                              jnp.int32)
  attention = "cudnn" if jax.default_backend() == "gpu" else None

  def build(name):
    step, params, opt = step_of(name, d, layers, args.remat, tokens, args.vocab, attention,
                                 args.weight_grad)
    t0 = time.perf_counter()
    compiled = step.lower(params, opt, tokens).compile()
    print(f"{name}: compiled in {time.perf_counter() - t0:.1f} s", flush=True)
    if args.out:
      out = pathlib.Path(args.out)
      out.mkdir(parents=True, exist_ok=True)
      (out / f"hlo_{d}_{name}.txt").write_text(compiled.as_text())
    for _ in range(2):  # warm up; no step rebuilds masks (the first rebuild is at 100)
      params, opt, loss = compiled(params, opt, tokens)
    jax.block_until_ready(loss)
    return {"step": compiled, "params": params, "opt": opt}

  def rounds(names, times):
    for _ in range(args.rounds):
      for name in names:
        s = states[name]
        t0 = time.perf_counter()
        for _ in range(args.steps):
          s["params"], s["opt"], loss = s["step"](s["params"], s["opt"], tokens)
        jax.block_until_ready(loss)
        times[name].append((time.perf_counter() - t0) / args.steps * 1e3)

  # The dense variants are built, timed and profiled before any 2:4 variant
  # runs: once a cuSPARSELt product has run in the process, its compute-bound
  # kernels run 2-7% slower until it ends (`_common.CUSPARSELT_TAX`), which a
  # dense model in its own process never pays. They are timed again among
  # the 2:4 variants ("taxed"), to show that.
  dense_names = [v for v in variants if v.partition("@")[0] == "dense"]
  sparse_names = [v for v in variants if v not in dense_names]
  states, times, taxed = {}, collections.defaultdict(list), collections.defaultdict(list)
  prof = {}
  for name in dense_names:
    states[name] = build(name)
  rounds(dense_names, times)
  for name in dense_names:
    prof[name] = profile(name, states[name], tokens, f"/tmp/profm/{d}_{name}")
  for name in sparse_names:
    states[name] = build(name)
  rounds(sparse_names, times)
  if dense_names and sparse_names:
    rounds(dense_names, taxed)
  for name in sparse_names:
    prof[name] = profile(name, states[name], tokens, f"/tmp/profm/{d}_{name}")
  base = statistics.median(times[variants[0]])
  print(f"\nstep time, median of {args.rounds} interleaved rounds of {args.steps} steps (dense"
        f" variants first, in rounds of their own before any 2:4 variant ran):")
  for name in variants:
    med = statistics.median(times[name])
    print(f"  {name:8s} {med:8.2f} ms  ({base / med:.3f}x of {variants[0]} speed;"
          f" rounds {', '.join(f'{t:.1f}' for t in times[name])})")
  for name in taxed:
    med = statistics.median(taxed[name])
    print(f"  {name:8s} {med:8.2f} ms  again after the 2:4 variants ran (not used above;"
          f" rounds {', '.join(f'{t:.1f}' for t in taxed[name])})")

  for name in variants:
    by, cats, span, _ = prof[name]
    total = sum(t for t, _ in by.values())
    print(f"\n== {name}: span {span / 1e3:.2f} ms, kernel time {total / 1e3:.2f} ms,"
          f" idle {(span - total) / 1e3:.2f} ms, {sum(c for _, c in by.values())} kernels")
    for c, t in sorted(cats.items(), key=lambda kv: -kv[1]):
      print(f"   {c:18s} {t / 1e3:8.2f} ms")
  ref = prof[variants[0]][0]
  for name in variants[1:]:
    by = prof[name][0]
    diffs = {k: (by.get(k, (0, 0))[0] - ref.get(k, (0, 0))[0],
                 by.get(k, (0, 0))[1] - ref.get(k, (0, 0))[1]) for k in set(by) | set(ref)}
    print(f"\nkernels that differ most, {name} - {variants[0]} (ms, count):")
    for k, (t, c) in sorted(diffs.items(), key=lambda kv: -abs(kv[1][0]))[:30]:
      print(f"  {t / 1e3:+8.3f} ms {c:+5d}  {k}")
  for name in variants:
    calls = prof[name][3]
    if calls:
      print(f"\nPallas, FFI and custom-call kernels of {name} by kernel name (ms, count,"
            " us per call):")
      for k, (t, c) in sorted(calls.items(), key=lambda kv: -kv[1][0])[:20]:
        print(f"  {t / 1e3:8.3f} ms {c:5d} {t / c:8.1f} us  {k}")


if __name__ == "__main__":
  main()
