"""Sweeps the Pallas sparse matmul's tile configuration per (M, K, N).

    PYTHONPATH=. python benchmarks/tune_matmul.py [--ms 16,64,256,2048]

A developer tool (it calls `pallas_kernels` directly): prints the best
`MatmulConfig` per shape and the time of the current default, so that
`MatmulConfig.default` can be updated from measurements.
"""

from __future__ import annotations

import argparse
import itertools
import time

import jax
import jax.numpy as jnp

import jsparse24
from benchmarks import _common
from pallas_kernels import spmm24


def candidates(m: int):
  bms = [16] if m <= 16 else [64] if m <= 64 else [128]
  for lane_dots, bm, bn, bk, warps, stages in itertools.product(
      [False, True], bms, [32, 64, 128], [128, 256], [4, 8], [3, 4]):
    if bm * bn >= 128 * 128 and warps == 4:
      continue
    yield spmm24.MatmulConfig(bm, bn, bk, warps, stages, lane_dots)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--ms", default="16,64,256,2048")
  p.add_argument("--shapes", default="8192x8192,4096x16384")
  p.add_argument("--budget", type=float, default=240.0, help="seconds for the whole sweep")
  args = p.parse_args(argv)
  start = time.time()
  print(_common.environment(), flush=True)
  for shape in args.shapes.split(","):
    k, n = (int(v) for v in shape.split("x"))
    w = jax.random.normal(jax.random.key(0), (k, n), jnp.bfloat16)
    sp = jsparse24.compress(w, implementation="pallas")
    for m in (int(v) for v in args.ms.split(",")):
      x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
      t_dense = _common.bench(jax.jit(lambda x, w: x @ w), x, w)
      results = []
      for cfg in candidates(m):
        if time.time() - start > args.budget:
          print("budget spent", flush=True)
          break
        f = jax.jit(lambda x, v, meta, cfg=cfg: spmm24.sparse_matmul(x, v, meta, k=k, config=cfg))
        try:
          t = _common.bench(f, x, sp.values, sp.meta, repeats=3, min_time=0.02)
        except Exception as e:  # pylint: disable=broad-except
          print(f"  {cfg}: failed {type(e).__name__}: {str(e)[:120]}", flush=True)
          continue
        results.append((t, cfg))
      if not results:
        continue
      results.sort(key=lambda r: r[0])
      default = spmm24.MatmulConfig.default(m, k, n)
      t_default = next((t for t, c in results if c == default), float("nan"))
      print(f"M={m} K={k} N={n}: dense {t_dense * 1e3:.4f} ms; default {t_default * 1e3:.4f} ms;"
            f" best {results[0][0] * 1e3:.4f} ms ({t_dense / results[0][0]:.2f}x) {results[0][1]}",
            flush=True)
      for t, cfg in results[1:4]:
        print(f"    {t * 1e3:.4f} ms {cfg}", flush=True)


if __name__ == "__main__":
  main()
