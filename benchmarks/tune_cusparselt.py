"""How cuSPARSELt's matmul algorithm is picked, compared (a developer tool: calls
`jsparse24.backends.cusparselt` internals).

    PYTHONPATH=. python benchmarks/tune_cusparselt.py [--shapes 2048x6144,...] [--m 16384]
        [--ids 20] [--per-id] [--repeat R]

For each weight shape K x N (default: the linear layers of `bench_model.py`
at d_model 2048 and 4096) and each product the backend runs -- forward
`x[M, K] @ w` and dx `dy[M, N] @ w^T` -- times dense XLA and the product with
the algorithm chosen by each search mode of `cusparselt.SEARCH` (the first
call searches: its time, compilation included, is printed separately and
left out of the product's time); with
`--per-id`, every configuration id on its own too. The algorithm cache file
is switched off, so every mode searches afresh in this process; with
`--repeat R` each shape is measured R times, each time with M 16 rows larger
(a new plan, so a new search), to show how much the searches' picks vary.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import _common
from jsparse24.backends import cusparselt as cs

# bench_model.py's layers at d_model 2048 and 4096: qkv, out, up, down.
DEFAULT_SHAPES = ("2048x6144,2048x2048,2048x8192,8192x2048,"
                  "4096x12288,4096x4096,4096x16384,16384x4096")
MODES = {"cusparselt": (1, -1), "configs": (2, None), "both": (3, None)}


def _product(k: int, n: int, m: int, transpose: bool, search: int, alg: int):
  inner, out = (n, k) if transpose else (k, n)
  return jax.jit(lambda x, c: cs._sparse_a_matmul(  # pylint: disable=protected-access
      c, x, (m, out), m=out, n=m, k=inner, op_a=1 if transpose else 0, op_b=0,
      search=search, alg=alg))


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shapes", default=DEFAULT_SHAPES)
  p.add_argument("--m", type=int, default=16384)
  p.add_argument("--ids", type=int, default=20, help="configuration ids 0..ids-1 searched")
  p.add_argument("--per-id", action="store_true", help="also time every id on its own")
  p.add_argument("--repeat", type=int, default=1, help="searches per shape (M + 16 each)")
  args = p.parse_args()
  lib = cs._library()  # pylint: disable=protected-access
  lib.jsp_cusparselt_set_algorithm_cache(b"")  # every mode searches here
  print(_common.environment(), flush=True)
  rows = []
  for shape, rep in ((s, r) for s in args.shapes.split(",") for r in range(args.repeat)):
    k, n = map(int, shape.split("x"))
    m = args.m + 16 * rep
    kw, kx = jax.random.split(jax.random.key(k * 7 + n))
    w = jax.random.normal(kw, (k, n), jnp.bfloat16)
    fwd, bwd, _ = jax.jit(lambda w: cs.compress_for_products(w, None, True))(w)
    for transpose in (False, True):
      x = jax.random.normal(kx, (m, k if not transpose else n), jnp.bfloat16)
      c = bwd if transpose else fwd
      wd = w.T if transpose else w
      name = f"{k}x{n} {'dx' if transpose else 'forward'}" + (f" (M {m})" if rep else "")
      dense = _common.bench(jax.jit(lambda x, w: x @ w), x, wd)
      row = [name, dense * 1e3]
      ref = None
      for mode, (search, alg) in MODES.items():
        f = _product(k, n, m, transpose, search, args.ids if alg is None else alg)
        # Each mode has its own plan key, so its first call searches (and
        # compiles the small jitted call).
        t0 = time.perf_counter()
        jax.block_until_ready(f(x, c))
        first = time.perf_counter() - t0
        y = np.asarray(f(x, c), np.float32)
        if ref is None:
          ref = y
        err = float(np.max(np.abs(y - ref)) / (np.max(np.abs(ref)) + 1e-30))
        t = _common.bench(f, x, c)
        print(f"{name}: {mode}: {t * 1e3:.4f} ms (dense {dense * 1e3:.4f}; first call"
              f" (search) {first:.2f} s; max rel. difference to the first mode {err:.1e})", flush=True)
        row += [t * 1e3, dense / t]
      if args.per_id and rep == 0:
        times = []
        for i in range(args.ids):
          try:
            times.append(f"{i}:{_common.bench(_product(k, n, m, transpose, 0, i), x, c) * 1e3:.4f}")
          except Exception as e:  # pylint: disable=broad-except
            times.append(f"{i}:failed ({type(e).__name__})")
        print(f"{name}: per id (ms): {' '.join(times)}", flush=True)
      rows.append(row)
  headers = ["product (K x N)", "dense ms"]
  for mode in MODES:
    headers += [f"{mode} ms", f"{mode} speedup"]
  print(f"\nM = {args.m}, bfloat16; modes of cusparselt.SEARCH (ids 0..{args.ids - 1})\n")
  print(_common.table(headers, rows))


if __name__ == "__main__":
  main()
