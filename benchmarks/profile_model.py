"""Profiles one training step of `bench_model.py`'s GPT, dense and 2:4 (defaults),
and prints where the GPU time goes: kernel time by category, the top kernels,
and the step's span (span minus kernel time = GPU idle).

    PYTHONPATH=. python benchmarks/profile_model.py D_MODEL BLOCKS [remat]

Uses `jax.profiler.trace(..., create_perfetto_trace=True)` and reads the
Perfetto JSON it writes under /tmp/profm. What it found is in NOTES.md
("Whole model"): at d_model 2048 the 2:4 step does less kernel work than the
dense one but idles ~19 ms more.
"""
import collections
import glob
import gzip
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import optax

import jsparse24
from benchmarks import bench_model as bm

BATCH, SEQ, VOCAB = 8, 2048, 32768


def gpu_events(path: str) -> list[dict]:
  """The GPU ("X") events of the Perfetto trace written under `path`."""
  trace = glob.glob(os.path.join(path, "**", "perfetto_trace.json.gz"), recursive=True)[0]
  data = json.load(gzip.open(trace))
  events = data["traceEvents"] if isinstance(data, dict) else data
  names = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  return [e for e in events if e.get("ph") == "X" and "GPU" in names.get(e["pid"], "")]


def category(name: str) -> str:
  n = name.lower()
  if "sparse_gemm" in n or "xmma_sparse" in n:
    return "sparse gemm"
  if "nvjet" in n or "gemm_fusion" in n or "cutlass" in n or "sm90_xmma_gemm" in n:
    return "dense gemm"
  if "cudnn" in n or "flash" in n or "fmha" in n or "sdpa" in n:
    return "attention"
  if "memcpy" in n:
    return "memcpy"
  if "jsparse24" in n or "prune" in n or "compress" in n:
    return "pallas compress"
  if "dynamic_update_slice" in n or "dynamic_slice" in n:
    return "dyn slice/update"
  return "other fusions"


def step_of(name: str, d: int, layers: int, remat: bool, tokens):
  """(train step, params, optimizer state) of the dense or the 2:4 model."""
  model = bm.GPT(VOCAB, d, layers, SEQ, "cudnn", remat)
  adamw = optax.adamw(bm.LR, weight_decay=bm.WEIGHT_DECAY)
  if name == "dense":
    params = jax.jit(model.init)(jax.random.key(1), tokens[:, :-1])["params"]
    step = bm.make_train_step(lambda p, _, x: model.apply({"params": p}, x), adamw)
    return step, params, jax.jit(adamw.init)(params)
  sparse = jsparse24.sparsify(model, {bm.SPARSE_LAYERS: {}})
  variables = jax.jit(sparse.init)(jax.random.key(1), tokens[:, :-1])
  tx = optax.chain(jsparse24.optim.mask_update(
      variables["sparsity"], jsparse24.optim.MaskSchedule(rebuild_every=100), decay=bm.MASK_DECAY),
                   adamw)
  step = bm.make_train_step(lambda p, o, x: sparse.apply(
      {"params": p, "sparsity": jsparse24.optim.masks(o)}, x), tx)
  return step, variables["params"], jax.jit(tx.init)(variables["params"])


def main(argv):
  d, layers, remat = int(argv[0]), int(argv[1]), len(argv) > 2
  tokens = jax.random.randint(jax.random.key(0), (BATCH, SEQ + 1), 0, VOCAB, jnp.int32)
  cats = {}
  for name in ("dense", "sparse"):
    step, params, opt = step_of(name, d, layers, remat, tokens)
    for _ in range(3):  # compile and warm up; the profiled step does not rebuild masks
      params, opt, loss = step(params, opt, tokens)
    jax.block_until_ready(loss)
    path = f"/tmp/profm/{name}"
    with jax.profiler.trace(path, create_perfetto_trace=True):
      params, opt, loss = step(params, opt, tokens)
      jax.block_until_ready(loss)
    events = gpu_events(path)
    by, count, cats[name] = (collections.defaultdict(float), collections.Counter(),
                             collections.defaultdict(float))
    for e in events:
      kernel = re.sub(r"\.\d+$", "", e["name"])[:70]
      by[kernel] += e.get("dur", 0)
      count[kernel] += 1
      cats[name][category(e["name"])] += e.get("dur", 0)
    span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    print(f"== {name}: span {span / 1e3:.2f} ms, kernel time {sum(by.values()) / 1e3:.2f} ms,"
          f" {len(events)} kernels")
    for c, t in sorted(cats[name].items(), key=lambda kv: -kv[1]):
      print(f"   {c:18s} {t / 1e3:8.2f} ms")
    for kernel, t in sorted(by.items(), key=lambda kv: -kv[1])[:25]:
      print(f"  {t / 1e3:8.2f} ms x{count[kernel]:4d} {kernel}")
    del step, params, opt
  print("category diffs (2:4 - dense, ms):")
  for c in sorted(set(cats["dense"]) | set(cats["sparse"])):
    print(f"  {c:18s} {(cats['sparse'].get(c, 0) - cats['dense'].get(c, 0)) / 1e3:+8.2f}")


if __name__ == "__main__":
  main(sys.argv[1:])
