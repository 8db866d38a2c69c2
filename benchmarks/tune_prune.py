"""Sweeps the prune/compress kernels' tile configuration (a developer tool:
calls `pallas_kernels` directly) and reports compile and run times.

    PYTHONPATH=. python benchmarks/tune_prune.py [--size 16384] [--which plain,transposable,apply,apply_t]
        [--layout sparse24|cusparselt]

apply = compress with a stored mask; apply_t also writes the transposed copy;
mvue = the MVUE pruning + compression of a gradient (pallas_kernels.mvue24,
always in cuSPARSELt's layout).
With --layout cusparselt the values are written as cuSPARSELt holds them
(pallas_kernels.prune24's module docstring); its sweep includes both ways of
separating the row lanes (strided loads/stores, or register transposes).
"""

from __future__ import annotations

import argparse
import itertools
import time

import jax
import jax.numpy as jnp

import jsparse24
from benchmarks import _common
from pallas_kernels import mvue24, prune24


def _candidates(which: str, layout: str) -> list[prune24.PruneConfig]:
  if which == "mvue":
    return [prune24.PruneConfig(bk, bn, warps, 1)
            for (bk, bn), warps in itertools.product(
                [(64, 128), (128, 64), (64, 64), (32, 256), (32, 128), (128, 32)], [8, 4])]
  if layout == "cusparselt":
    return [prune24.PruneConfig(bk, bn, warps, 1, strided)
            for strided, (bk, bn), warps in itertools.product(
                [True, False], [(128, 64), (64, 128), (256, 64), (64, 64)], [4, 8])]
  if which == "transposable":
    return [prune24.PruneConfig(bk, bn, warps, 1, strided)
            for strided, (bk, bn), warps in itertools.product(
                [True, False], [(32, 64), (64, 64), (16, 128)], [4, 8])]
  return [prune24.PruneConfig(bk, bn, warps, 1)
          for (bk, bn), warps in itertools.product([(128, 64), (64, 128), (256, 32), (128, 32)], [4, 8])]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--size", type=int, default=16384)
  p.add_argument("--which", default="plain,transposable,apply,apply_t")
  p.add_argument("--layout", default="sparse24", choices=prune24.LAYOUTS)
  p.add_argument("--budget", type=float, default=200.0, help="seconds for the whole sweep")
  p.add_argument("--index", type=int, default=None, help="run only this candidate")
  args = p.parse_args(argv)
  start = time.time()
  k = n = args.size
  print(_common.environment(), flush=True)
  bw = _common.copy_bandwidth()
  w = jax.random.normal(jax.random.key(0), (k, n), jnp.bfloat16)
  meta = prune24.prune_compress(w)[1]
  meta_t = None
  if "apply_t" in args.which.split(","):  # a transposable mask (XLA pattern search)
    meta_t = jsparse24.Mask24.from_weights(w, transposable=True).meta()
  for which in args.which.split(","):
    transposable = which == "transposable"
    both = which in ("transposable", "apply_t")
    nbytes = 2 * k * n + (k * n + k * n // 8) * (2 if both else 1)
    results = []
    for i, cfg in enumerate(_candidates(which, args.layout)):
      if args.index is not None and i != args.index:
        continue
      if time.time() - start > args.budget:
        print("budget spent", flush=True)
        break
      if which == "mvue":
        seed = jnp.array([1, 2], jnp.uint32)
        f = jax.jit(lambda w, cfg=cfg: mvue24.mvue_compress(w, seed, config=cfg))
        call_args = (w,)
      elif which in ("apply", "apply_t"):
        f = jax.jit(lambda w, m, cfg=cfg, t=which == "apply_t": prune24.compress_with_meta(
            w, m, transposed=t, config=cfg, layout=args.layout))
        call_args = (w, meta_t if which == "apply_t" else meta)
      else:
        f = jax.jit(lambda w, cfg=cfg: prune24.prune_compress(
            w, transposable=transposable, config=cfg, layout=args.layout))
        call_args = (w,)
      t0 = time.time()
      try:
        jax.block_until_ready(f(*call_args))
      except Exception as e:  # pylint: disable=broad-except
        print(f"{which} {cfg}: failed {type(e).__name__}: {str(e)[:160]}", flush=True)
        continue
      compile_s = time.time() - t0
      t = _common.bench(f, *call_args, repeats=3, min_time=0.02)
      results.append((t, cfg))
      print(f"{which:13s} {cfg}: {t * 1e3:.3f} ms"
            f" ({nbytes / t / bw * 100:.1f}% of copy bw), first call {compile_s:.1f} s", flush=True)
    if results:
      best = min(results, key=lambda r: r[0])
      print(f"BEST {which}: {best[0] * 1e3:.3f} ms {best[1]}", flush=True)


if __name__ == "__main__":
  main()
