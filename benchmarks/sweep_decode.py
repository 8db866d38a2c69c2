"""The `"pallas"` backend's product on a compressed weight (the decode
kernel at few rows) against dense XLA and against what a compressed weight
multiplies through otherwise (decompressed, then XLA's product), over M and
(K, N): the sweep behind the automatic choice
(`jsparse24.backends.pallas.DECODE_AUTO_MAX_M`, which compares the kernel
with the decompressing product: a compressed weight has no dense copy).

    PYTHONPATH=. python benchmarks/sweep_decode.py [--ms 1,2,4,...,256]
        [--sizes 2048,...,16384] [--no-write] [--json PATH]

For every M and (K, N) in sizes x sizes: dense XLA `x @ w` (bf16),
`jsparse24.sparse_dot(x, sp, implementation="xla")` (decompress + XLA) and
`jsparse24.sparse_dot(x, sp, implementation="pallas")` on the compressed
weight (`Sparse24`; the decode kernel up to `DECODE_MAX_M` rows, `spmm24`
above), in ms, the product's GB/s (compressed values + metadata + x + y),
its % of the copy bandwidth measured in the same run, and its speedups over
dense and over decompress + XLA. Each timed call multiplies by several weights in turn (one jitted
function), 200 MB together (3-4x the L2 cache of an H100 or H200), as a
model's layers do: one weight reused call after call would be read from L2.
At most 16 weights: the smallest shapes' compressed weights then fit in L2
together, their dense ones barely. Prints the `DECODE_AUTO_MAX_M` row
literal for this GPU, and writes the table to benchmarks/results/<gpu>.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json

import jax
import jax.numpy as jnp

import jsparse24
from benchmarks import _common
from jsparse24.backends import pallas as pallas_backend

CODES = (0x4, 0x8, 0xC, 0x9, 0xD, 0xE)  # the six 2:4 group codes (i0 | i1 << 2)


def random_sparse(key, k: int, n: int) -> jsparse24.Sparse24:
  """A random bf16 `Sparse24` ([K, N], K a multiple of 8): normal values,
  uniformly drawn kept pairs."""
  kv, km = jax.random.split(key)
  values = jax.random.normal(kv, (n, k // 2), jnp.bfloat16)
  groups = jnp.asarray(CODES, jnp.uint8)[jax.random.randint(km, (n, k // 4), 0, 6)]
  return jsparse24.Sparse24(values, groups[:, 0::2] | (groups[:, 1::2] << 4))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--ms", default="1,2,4,8,16,32,64,128,256")
  p.add_argument("--sizes", default="2048,4096,8192,16384")
  p.add_argument("--no-write", action="store_true", help="print only; leave results/ alone")
  p.add_argument("--json", default=None, help="also write the raw numbers here")
  args = p.parse_args(argv)
  ms = [int(v) for v in args.ms.split(",")]
  sizes = [int(v) for v in args.sizes.split(",")]
  print(_common.environment(), flush=True)
  bw = _common.copy_bandwidth()
  print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
  dense_f = jax.jit(lambda x, ws: [x @ w for w in ws])
  sparse_f = jax.jit(lambda x, sps: [jsparse24.sparse_dot(x, sp, implementation="pallas")
                                     for sp in sps])
  # What a compressed weight multiplies through without the decode kernel:
  # decompressed, then XLA's product (the automatic choice's alternative).
  decompress_f = jax.jit(lambda x, sps: [jsparse24.sparse_dot(x, sp, implementation="xla")
                                         for sp in sps])
  rows, raw = [], []
  speedups = {}
  pool = concurrent.futures.ThreadPoolExecutor(16)
  for k in sizes:
    for n in sizes:
      sparse_bytes = _common.compressed_bytes(k, n)
      r = _common.rotation(sparse_bytes)
      key = jax.random.key(k * 7 + n)
      sps = [random_sparse(jax.random.fold_in(key, i), k, n) for i in range(r)]
      ws = [jsparse24.decompress(sp) for sp in sps]
      xs = {m: jax.random.normal(jax.random.fold_in(key, 1000 + m), (m, k), jnp.bfloat16)
            for m in ms}
      # Compiled side by side: compilation, not the GPU, bounds the sweep.
      futures = {(m, kind): pool.submit(lambda f, a: f.lower(*a).compile(), f, (xs[m], ops))
                 for m in ms for kind, f, ops in (("dense", dense_f, ws),
                                                 ("sparse", sparse_f, sps),
                                                 ("decompress", decompress_f, sps))}
      # All compiled before any is timed: a compilation running beside a
      # timing slows its dispatch.
      compiled = {key: future.result() for key, future in futures.items()}
      for m in ms:
        dense_c, sparse_c = compiled[m, "dense"], compiled[m, "sparse"]
        got = sparse_c(xs[m], sps)[0].astype(jnp.float32)
        ref = jnp.dot(xs[m].astype(jnp.float32), ws[0].astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
        err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
        if not err < 1e-2:
          raise SystemExit(f"M={m} K={k} N={n}: relative error {err:.3g}")
        t_dense = _common.bench(dense_c, xs[m], ws, min_time=0.02, repeats=5) / r
        t_sparse = _common.bench(sparse_c, xs[m], sps, min_time=0.02, repeats=5) / r
        t_decompress = _common.bench(compiled[m, "decompress"], xs[m], sps, min_time=0.02,
                                     repeats=5) / r
        io = sparse_bytes + 2 * (m * k + m * n)
        speedups[m, k, n] = t_decompress / t_sparse
        rows.append([m, k, n, t_dense * 1e3, t_decompress * 1e3, t_sparse * 1e3,
                     t_dense / t_sparse, t_decompress / t_sparse,
                     io / t_sparse / 1e9, 100 * io / t_sparse / bw])
        raw.append(dict(m=m, k=k, n=n, dense_ms=t_dense * 1e3, decompress_ms=t_decompress * 1e3,
                        decode_ms=t_sparse * 1e3, rotate=r, rel_err=err))
        print(f"M={m:4d} K={k:5d} N={n:5d}: dense {t_dense * 1e3:.4f} ms, decompress + XLA"
              f" {t_decompress * 1e3:.4f} ms, decode"
              f" {t_sparse * 1e3:.4f} ms ({t_dense / t_sparse:.2f}x), {io / t_sparse / 1e9:.0f}"
              f" GB/s = {100 * io / t_sparse / bw:.0f}% of copy; rel err {err:.2g}", flush=True)
      del sps, ws
  table = []
  for k in sizes:
    row = []
    for n in sizes:
      best = 0
      for m in sorted(ms):
        if speedups[m, k, n] < pallas_backend.DECODE_MARGIN:
          break
        best = m
      row.append(best)
    table.append(tuple(row))
  literal = f"    {_common.gpu_name()!r}: {tuple(table)!r},"
  body = (f"{_common.environment()}; measured copy bandwidth {bw / 1e12:.3f} TB/s.\n"
          f"Command: `PYTHONPATH=. python benchmarks/sweep_decode.py`. bf16, `sparse_dot(x, sp,"
          f" implementation=\"pallas\")` on a `Sparse24` (the decode kernel,"
          f" `pallas_kernels/decode24.py`, default tiles, up to DECODE_MAX_M ="
          f" {pallas_backend.DECODE_MAX_M} rows) against XLA's `x @ w` and against"
          f" decompress + XLA;"
          f" each timed call cycles through several weights (200 MB together, at most 16). GB/s and % copy"
          f" count compressed values + metadata + x + y.\n\n"
          + _common.table(["M", "K", "N", "dense XLA ms", "decompress + XLA ms", "decode ms",
                           "decode over dense", "decode over decompress", "GB/s",
                           "% copy bw"], rows)
          + f"\n\nDECODE_AUTO_MAX_M row (largest M up to which the decode kernel measured >="
          f" {pallas_backend.DECODE_MARGIN}x of decompress + XLA at every swept M; rows K,"
          f" columns N = {sizes}):\n\n"
          f"```\n{literal}\n```\n")
  print("\n" + body)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(environment=_common.environment(), copy_bw=bw, points=raw), f, indent=1)
  if not args.no_write:
    print(f"\nwritten to {_common.write_section('decode kernel sweep bf16', body)}")


if __name__ == "__main__":
  main()
