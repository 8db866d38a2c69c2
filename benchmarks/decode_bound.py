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
* `split`: the values split into their four slots first
  (`_tiles.split_lanes`), each slot summed;
* `expand`: the tiles expanded to `[bn, bk]` first (`_tiles.expand_rows`,
  the decode kernel's expansion: split, selects, join), then summed;
* `product`: the expanded tile multiplied by x (`[16, bk]`, one tensor-core
  product per step, float32 partial products summed by XLA): the decode
  kernel's work on this grid;
* `dense stream`: the first kernel on the dense `W[N, K]`.

% of the copy bandwidth: the kernel's bytes (the compressed weight, or the
dense one) over the time, against the copy bandwidth measured in the same
run (reads and writes of a copy: a kernel that only reads can pass 100%);
dense XLA / this: the time of dense XLA's product over the kernel's.
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


def _sum_kernel(x_ref, v_ref, m_ref, o_ref, *, bn, bk, per, mode):
  j, s = pl.program_id(0), pl.program_id(1)
  n0 = j * bn

  def body(t, acc):
    step = s * per + t
    v = pltriton.load(v_ref.at[pl.ds(n0, bn), pl.ds(step * (bk // 2), bk // 2)])
    mt = pltriton.load(m_ref.at[pl.ds(n0, bn), pl.ds(step * (bk // 8), bk // 8)])
    meta_sum = jnp.sum(mt.astype(jnp.float32), axis=1, keepdims=True)
    if mode == "stream":
      return acc + jnp.sum(v.astype(jnp.float32), axis=1, keepdims=True) + meta_sum
    if mode == "split":
      return acc + meta_sum + sum(jnp.sum(slot.astype(jnp.float32), axis=1, keepdims=True)
                                  for slot in _tiles.split_lanes(v, 4))
    w = _tiles.expand_rows(v, mt)
    if mode == "expand":
      return acc + jnp.sum(w.astype(jnp.float32), axis=1, keepdims=True)
    x = pltriton.load(x_ref.at[pl.ds(0, x_ref.shape[0]), pl.ds(step * bk, bk)])
    return acc + jnp.dot(x, w.T, preferred_element_type=jnp.float32)

  if mode == "product":
    acc = jax.lax.fori_loop(0, per, body, jnp.zeros((x_ref.shape[0], bn), jnp.float32))
    pltriton.store(o_ref.at[pl.ds(s, 1), pl.ds(0, x_ref.shape[0]), pl.ds(n0, bn)], acc[None])
    return
  acc = jax.lax.fori_loop(0, per, body, jnp.zeros((bn, 1), jnp.float32))
  pltriton.store(o_ref.at[pl.ds(s, 1), pl.ds(0, 1), pl.ds(n0, bn)], acc.reshape(1, 1, bn))


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


def sum_compressed(x, values, meta, k, bn, bk, waves, warps, stages, mode):
  n = values.shape[0]
  splits, per = _grid(n, k, bn, bk, waves)
  rows = x.shape[0] if mode == "product" else 1
  out = pl.pallas_call(
      functools.partial(_sum_kernel, bn=bn, bk=bk, per=per, mode=mode),
      out_shape=jax.ShapeDtypeStruct((splits, rows, n), jnp.float32), grid=(n // bn, splits),
      compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages))(
          x, values, meta)
  return jnp.sum(out, axis=0).astype(x.dtype) if mode == "product" else out


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
    rows.append([k, n, "dense XLA M=16", td * 1e3, 100 * pt.dense_bytes / td / bw, 1.0])
    rows.append([k, n, "decode default M=16", t_def * 1e3, 100 * pt.sparse_bytes / t_def / bw,
                 td / t_def])
    weight_bytes = pt.sparse_bytes - 2 * 16 * (k + n)
    v, mt = pt.ops[0]
    ref = decode24.decode_matmul_reference(pt.x, v, mt, k=k).astype(jnp.float32)
    for cfg, mode in itertools.product(
        ((32, 256, 4, 4, 4), (64, 256, 4, 4, 4), (64, 256, 4, 8, 3), (64, 512, 2, 8, 3)),
        ("stream", "split", "expand", "product")):
      if mode == "product":  # checked against the reference before it is timed
        got = sum_compressed(pt.x, v, mt, k, *cfg, mode).astype(jnp.float32)
        err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
        if not err < 1e-2:
          raise AssertionError(f"decode_bound: product {cfg} off by {err:.3g}")
      f = jax.jit(lambda x, ops, cfg=cfg, mode=mode: [
          sum_compressed(x, v, mt, k, *cfg, mode) for v, mt in ops])
      t = _common.bench(f, pt.x, pt.ops) / pt.r
      bn, bk, waves, warps, stages = cfg
      bytes_ = pt.sparse_bytes if mode == "product" else weight_bytes
      rows.append([k, n, f"{mode} bn{bn} bk{bk} wv{waves} w{warps} st{stages}", t * 1e3,
                   100 * bytes_ / t / bw, td / t])
      print(rows[-1], flush=True)
    ws = [decode24.expand_reference(v, mt, k).T for v, mt in pt.ops]  # [N, K]
    for cfg in ((32, 256, 4, 4, 4), (64, 512, 2, 8, 3)):
      f = jax.jit(lambda ws, cfg=cfg: [sum_dense(w, *cfg) for w in ws])
      t = _common.bench(f, ws) / pt.r
      bn, bk, waves, warps, _ = cfg
      rows.append([k, n, f"dense stream bn{bn} bk{bk} wv{waves} w{warps}", t * 1e3,
                   100 * 2 * k * n / t / bw, td / t])
      print(rows[-1], flush=True)
    del pt, ws
  print(f"[{time.time() - t0:.0f}s] {_common.gpu_name()} copy bw {bw / 1e12:.3f} TB/s")
  body = (f"{env}; copy bandwidth {bw / 1e12:.3f} TB/s.\n"
          "`PYTHONPATH=. python benchmarks/decode_bound.py`\n\n"
          + _common.table(["K", "N", "kernel", "ms", "% copy bw", "dense XLA / this"], rows))
  print(body)
  if not args.no_write:
    print(f"written to {_common.write_section(TITLE, body)}")


if __name__ == "__main__":
  main()
