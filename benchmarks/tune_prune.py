"""Sweeps the prune/compress kernels' tile configuration (a developer tool:
calls `pallas_kernels` directly) and reports compile and run times.

    PYTHONPATH=. python benchmarks/tune_prune.py [--size 16384] [--which plain,transposable,apply,apply_t]
        [--layout sparse24|cusparselt] [--check] [--index I]

apply = compress with a stored mask; apply_t also writes the transposed copy;
mask = the transposable mask alone (transposable24.transposable_mask, on a
float32 weight, as the mask rebuilds read the master weights);
mvue = the MVUE pruning + compression of a gradient (pallas_kernels.mvue24,
always in cuSPARSELt's layout); rows = an activation `x[M, K]` pruned along
its contiguous axis (pallas_kernels.input_prune24, x of shape size x size).
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
import numpy as np

import jsparse24
from benchmarks import _common
from pallas_kernels import input_prune24, mvue24, prune24, transposable24
from pallas_kernels.masked_compress import compress_with_meta
from pallas_kernels._compress_io import LAYOUTS
from pallas_kernels.prune_config import PruneConfig


def _candidates(which: str) -> list[PruneConfig]:
  if which == "rows":
    return [PruneConfig(bk, bm, warps, 1)
            for (bk, bm), warps in itertools.product(
                [(256, 32), (128, 64), (64, 128), (512, 16), (512, 32), (256, 16), (1024, 16),
                 (128, 32)], [4, 8, 16])]
  if which == "mvue":
    return [PruneConfig(bk, bn, warps, 1)
            for (bk, bn), warps in itertools.product(
                [(64, 128), (128, 64), (64, 64), (32, 256), (32, 128), (128, 32)], [8, 4])]
  # The transposable search needs many registers per thread (255 at
  # 64x128/4 warps, 12% occupancy, before it became a dynamic program);
  # these go down to one 4x4 block per thread (bk * bn / (16 * 32 * warps)).
  # On an H100 none beat 64x128/4: the search is instruction-bound
  # (docs/design_notes.md, "The pruning kernels are bound by integer
  # operations").
  searched = [((64, 128), 4), ((64, 64), 4), ((128, 128), 8), ((64, 64), 8), ((32, 64), 4),
              ((64, 128), 8), ((32, 128), 4), ((32, 64), 2)]
  if which == "mask":
    return [PruneConfig(bk, bn, warps, 1) for (bk, bn), warps in searched]
  if which == "transposable":
    # strided_lanes: each output lane stored with a strided store (True) or
    # a row's lanes interleaved in registers and stored contiguously.
    return [PruneConfig(bk, bn, warps, 1, strided)
            for strided, ((bk, bn), warps) in itertools.product([False, True], searched)]
  if which == "apply_t":  # strided: each row's keep decoded in place, or the keep tile transposed
    return [PruneConfig(bk, bn, warps, 1, strided)
            for strided, (bk, bn), warps in itertools.product(
                [False, True], [(64, 64), (128, 64), (64, 128), (32, 128)], [8, 4])]
  if which == "plain":  # strided row lanes (no transpose), or the tile transposed
    return [PruneConfig(bk, bn, warps, 1, strided)
            for strided, (bk, bn), warps in itertools.product(
                [False, True], [(128, 64), (64, 128), (256, 32), (128, 32)], [4, 8])]
  return [PruneConfig(bk, bn, warps, 1)
          for (bk, bn), warps in itertools.product([(128, 64), (64, 128), (256, 32), (128, 32)], [4, 8])]


def adversarial(k: int, n: int, dtype) -> jax.Array:
  """Random normal weights with NaN, +-inf, a zero row, a tie, rows of
  equal values, subnormals (float32) and a quarter of the rows rounded to
  multiples of 1/4 (many tied pattern scores)."""
  w = jax.random.normal(jax.random.key(2), (k, n), jnp.float32)
  w = w.at[0, 0].set(jnp.nan).at[1, 1].set(jnp.inf).at[9, 2].set(-jnp.inf)
  w = w.at[3].set(0.0).at[5, 1].set(w[5, 0]).at[100:108].set(1.0)
  w = w.at[200:204, 0:64].set(1e-40)
  w = w.at[k // 4:k // 2].set(jnp.round(w[k // 4:k // 2] * 4) / 4)
  return w.astype(dtype)


def _reference(w, which: str, layout: str):
  """What the transposable kernels must return, bit for bit (XLA)."""
  mask = jsparse24.Mask24.pack(jsparse24.prune_24(w, transposable=True), transposable=True)
  if which == "mask":
    return (mask.meta(),)
  sp = jsparse24.compress(w, mask, transposed=True, implementation="xla")
  return ((sp.values.T if layout == "cusparselt" else sp.values), sp.meta, sp.values_t,
          sp.meta_t)


def _same(got, want) -> bool:
  return all(np.array_equal(np.asarray(a)[:b.shape[0]].view(np.uint8),
                            np.asarray(b).view(np.uint8)) for a, b in zip(got, want))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--size", type=int, default=16384)
  p.add_argument("--which", default="plain,transposable,apply,apply_t")
  p.add_argument("--layout", default="sparse24", choices=LAYOUTS)
  p.add_argument("--budget", type=float, default=200.0, help="seconds for the whole sweep")
  p.add_argument("--index", type=int, default=None, help="run only this candidate")
  p.add_argument("--check", action="store_true",
                 help="transposable, mask, rows: time on adversarial weights (NaN, inf, ties,"
                      " subnormals) and check every candidate bit for bit against the"
                      " XLA reference; apply_t: check against the XLA reference too")
  p.add_argument("--interpret", action="store_true",
                 help="Pallas interpret mode (a CPU smoke test; the timings mean nothing)")
  args = p.parse_args(argv)
  ip = dict(interpret=True) if args.interpret else {}
  start = time.time()
  k = n = args.size
  print(_common.environment(), flush=True)
  bw = _common.copy_bandwidth()
  w = jax.random.normal(jax.random.key(0), (k, n), jnp.bfloat16)
  meta = prune24.prune_compress(w, **ip)[1]
  meta_t = mask_t = None
  if "apply_t" in args.which.split(","):  # a transposable mask
    mask_t = jsparse24.Mask24.from_weights(w, transposable=True)
    meta_t = mask_t.meta()
  for which in args.which.split(","):
    transposable = which == "transposable"
    both = which in ("transposable", "apply_t")
    nbytes = 2 * k * n + (k * n + k * n // 8) * (2 if both else 1)
    w_in, want = w, None
    if which == "mask":  # reads float32, writes the packed mask
      w_in = adversarial(k, n, jnp.float32) if args.check else w.astype(jnp.float32)
      nbytes = 4 * k * n + k * n // 8
    elif (transposable or which == "rows") and args.check:
      w_in = adversarial(k, n, jnp.bfloat16)
    if args.check and which in ("mask", "transposable"):
      want = jax.jit(lambda w: _reference(w, which, args.layout))(w_in)
    if args.check and which == "rows":  # x^T's Sparse24, as a [K, M] weight's
      sp = jax.jit(lambda x: jsparse24.compress(
          x.T, jsparse24.prune_24(x.T), implementation="xla"))(w_in)
      want = (sp.values, sp.meta)
    if args.check and which == "apply_t":
      sp = jsparse24.compress(w, mask_t, transposed=True, implementation="xla")
      want = (sp.values.T if args.layout == "cusparselt" else sp.values, sp.values_t, sp.meta_t)
    results = []
    for i, cfg in enumerate(_candidates(which)):
      if args.index is not None and i != args.index:
        continue
      if time.time() - start > args.budget:
        print("budget spent", flush=True)
        break
      if which == "mvue":
        seed = jnp.array([1, 2], jnp.uint32)
        f = jax.jit(lambda w, cfg=cfg: mvue24.mvue_compress(w, seed, config=cfg, **ip))
        call_args = (w,)
      elif which in ("apply", "apply_t"):
        f = jax.jit(lambda w, m, cfg=cfg, t=which == "apply_t": compress_with_meta(
            w, m, transposed=t, config=cfg, layout=args.layout, **ip))
        call_args = (w, meta_t if which == "apply_t" else meta)
      elif which == "rows":
        f = jax.jit(lambda x, cfg=cfg: input_prune24.prune_compress_rows(
            x, config=cfg, layout=args.layout, **ip))
        call_args = (w_in,)
      elif which == "mask":
        f = jax.jit(lambda w, cfg=cfg: (transposable24.transposable_mask(w, config=cfg, **ip),))
        call_args = (w_in,)
      else:
        f = jax.jit(lambda w, cfg=cfg: prune24.prune_compress(
            w, transposable=transposable, config=cfg, layout=args.layout, **ip))
        call_args = (w_in,)
      t0 = time.time()
      try:
        got = jax.block_until_ready(f(*call_args))
      except Exception as e:  # pylint: disable=broad-except
        print(f"{which} {cfg}: failed {type(e).__name__}: {str(e)[:160]}", flush=True)
        continue
      compile_s = time.time() - t0
      exact = "" if want is None else (", bit-identical to the reference" if _same(got, want)
                                       else ", DIFFERS FROM THE REFERENCE")
      t = _common.bench(f, *call_args, repeats=3, min_time=0.02)
      results.append((t, cfg))
      print(f"{which:13s} {cfg}: {t * 1e3:.3f} ms"
            f" ({nbytes / t / bw * 100:.1f}% of copy bw), first call {compile_s:.1f} s{exact}",
            flush=True)
    if results:
      best = min(results, key=lambda r: r[0])
      print(f"BEST {which}: {best[0] * 1e3:.3f} ms {best[1]}", flush=True)


if __name__ == "__main__":
  main()
