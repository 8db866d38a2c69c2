"""What bounds the decode kernel: its loads, or the expansion of each tile.

    PYTHONPATH=. python benchmarks/decode_bound.py [--no-write]

A developer tool (it calls `pallas_kernels` and Pallas directly). At M = 16
and (K, N) = (8192, 8192) and (4096, 16384), bf16, each timed call cycling
through several compressed weights (over the L2 cache together, as
`tune_decode.py` does), it times:

* dense XLA `x @ W` and the decode kernel at its defaults (`decode24`);
* `stream`: a Pallas Triton kernel on the decode kernel's grid (column
  blocks of `bn` times `waves` x 132 / blocks slices of K) that loads the
  same compressed tiles (values `[bn, bk/2]`, metadata `[bn, bk/8]`) and
  only sums them: what loading the bytes costs;
* `expand`: the same, the tiles expanded to `[bn, bk]` first
  (`_tiles.expand_rows`, the decode kernel's expansion), then summed;
* `dense stream`: the first kernel on the dense `W[N, K]`.

% of the copy bandwidth: the kernel's bytes (the compressed weight, or the
dense one) over the time, against the copy bandwidth measured in the same
run (reads and writes of a copy: a kernel that only reads can pass 100%).
Writes its table to benchmarks/results/<gpu>.md.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from benchmarks import _common
from benchmarks.tune_decode import Point
from pallas_kernels import _tiles, decode24

TITLE = "What bounds the decode kernel: loads or the expansion"
SMS = 132


def _sum_kernel(v_ref, m_ref, o_ref, *, bn, bk, per, expand):
  j, s = pl.program_id(0), pl.program_id(1)
  n0 = j * bn

  def body(t, acc):
    step = s * per + t
    v = pltriton.load(v_ref.at[pl.ds(n0, bn), pl.ds(step * (bk // 2), bk // 2)])
    mt = pltriton.load(m_ref.at[pl.ds(n0, bn), pl.ds(step * (bk // 8), bk // 8)])
    if not expand:
      return (acc + jnp.sum(v.astype(jnp.float32), axis=1, keepdims=True)
              + jnp.sum(mt.astype(jnp.float32), axis=1, keepdims=True))
    w = _tiles.expand_rows(v, mt)
    return acc + jnp.sum(w.astype(jnp.float32), axis=1, keepdims=True)

  acc = jax.lax.fori_loop(0, per, body, jnp.zeros((bn, 1), jnp.float32))
  pltriton.store(o_ref.at[pl.ds(s, 1), pl.ds(n0, bn)], acc.reshape(1, bn))


def _dense_sum_kernel(w_ref, o_ref, *, bn, bk, per):
  j, s = pl.program_id(0), pl.program_id(1)
  n0 = j * bn

  def body(t, acc):
    w = pltriton.load(w_ref.at[pl.ds(n0, bn), pl.ds((s * per + t) * bk, bk)])
    return acc + jnp.sum(w.astype(jnp.float32), axis=1, keepdims=True)

  acc = jax.lax.fori_loop(0, per, body, jnp.zeros((bn, 1), jnp.float32))
  pltriton.store(o_ref.at[pl.ds(s, 1), pl.ds(n0, bn)], acc.reshape(1, bn))


def _grid(n, k, bn, bk, waves):
  """(splits, steps per split): as the decode kernel's, slices of whole steps."""
  steps = k // bk
  splits = max(1, min(steps, -(-waves * SMS // (n // bn))))
  while steps % splits:
    splits -= 1
  return splits, steps // splits


def sum_compressed(values, meta, k, bn, bk, waves, warps, stages, expand):
  n = values.shape[0]
  splits, per = _grid(n, k, bn, bk, waves)
  return pl.pallas_call(
      functools.partial(_sum_kernel, bn=bn, bk=bk, per=per, expand=expand),
      out_shape=jax.ShapeDtypeStruct((splits, n), jnp.float32), grid=(n // bn, splits),
      compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages))(values, meta)


def sum_dense(w, bn, bk, waves, warps, stages):
  n, k = w.shape
  splits, per = _grid(n, k, bn, bk, waves)
  return pl.pallas_call(
      functools.partial(_dense_sum_kernel, bn=bn, bk=bk, per=per),
      out_shape=jax.ShapeDtypeStruct((splits, n), jnp.float32), grid=(n // bn, splits),
      compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages))(w)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--no-write", action="store_true")
  args = p.parse_args(argv)
  t0 = time.time()
  env = _common.environment()
  print(env, flush=True)
  bw = _common.copy_bandwidth()
  rows = []
  for k, n in ((8192, 8192), (4096, 16384)):
    pt = Point(16, k, n)
    td, t_def = pt.dense(), pt.sparse(None)
    rows.append([k, n, "dense XLA M=16", td * 1e3, 100 * pt.dense_bytes / td / bw])
    rows.append([k, n, "decode default M=16", t_def * 1e3, 100 * pt.sparse_bytes / t_def / bw])
    weight_bytes = pt.sparse_bytes - 2 * 16 * (k + n)
    for (bn, bk, waves, warps, stages), expand in itertools.product(
        ((32, 256, 4, 4, 4), (64, 256, 4, 4, 4), (128, 256, 2, 4, 3), (64, 512, 2, 8, 3)),
        (False, True)):
      cfg = (bn, bk, waves, warps, stages)
      f = jax.jit(lambda ops, cfg=cfg, expand=expand: [
          sum_compressed(v, mt, k, *cfg, expand) for v, mt in ops])
      t = _common.bench(f, pt.ops) / pt.r
      name = "expand" if expand else "stream"
      rows.append([k, n, f"{name} bn{bn} bk{bk} wv{waves} w{warps} st{stages}", t * 1e3,
                   100 * weight_bytes / t / bw])
      print(rows[-1], flush=True)
    ws = [decode24.expand_reference(v, mt, k).T for v, mt in pt.ops]  # [N, K]
    for cfg in ((32, 256, 4, 4, 4), (64, 512, 2, 8, 3), (64, 256, 4, 4, 4)):
      f = jax.jit(lambda ws, cfg=cfg: [sum_dense(w, *cfg) for w in ws])
      t = _common.bench(f, ws) / pt.r
      bn, bk, waves, warps, _ = cfg
      rows.append([k, n, f"dense stream bn{bn} bk{bk} wv{waves} w{warps}", t * 1e3,
                   100 * 2 * k * n / t / bw])
      print(rows[-1], flush=True)
    del pt, ws
  print(f"[{time.time() - t0:.0f}s] {_common.gpu_name()} copy bw {bw / 1e12:.3f} TB/s")
  body = (f"{env}; copy bandwidth {bw / 1e12:.3f} TB/s.\n"
          "`PYTHONPATH=. python benchmarks/decode_bound.py`\n\n"
          + _common.table(["K", "N", "kernel", "ms", "% copy bw"], rows))
  print(body)
  if not args.no_write:
    print(f"written to {_common.write_section(TITLE, body)}")


if __name__ == "__main__":
  main()
