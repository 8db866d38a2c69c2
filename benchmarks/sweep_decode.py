"""The `"pallas"` backend's product on a compressed weight (the decode
kernel at few rows) against dense XLA and against what a compressed weight
multiplies through otherwise (decompressed, then XLA's product), over M and
(K, N): the sweep behind the automatic choice
(`jsparse24.backends.pallas.DECODE_AUTO_MAX_M`, which compares the kernel
with the decompressing product: a compressed weight has no dense copy).

    PYTHONPATH=. python benchmarks/sweep_decode.py [--ms 1,2,4,...,256]
        [--sizes 2048,...,16384] [--ks K,...] [--ns N,...] [--no-write]
        [--json PATH] [--cusparselt] [--cusparselt-layout]
    PYTHONPATH=. python benchmarks/sweep_decode.py --from-json A.json,B.json

`--ks` / `--ns` sweep part of the grid (K or N from `--sizes` otherwise), so
that parts run side by side on several GPUs with `--json`; `--from-json`
joins such parts (measured on one kind of GPU) into one table and row
without timing anything.

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
`--cusparselt` also times `implementation="cusparselt"` on the `Sparse24`
(re-laid out for cuSPARSELt in every call) and prints the
`AUTO_MIN_M_COMPRESSED` row; `--cusparselt-layout` on the weights in
cuSPARSELt's layout (`compress(..., cusparselt=True)`, multiplied in place)
and prints the `AUTO_MIN_M_CUSPARSELT_LAYOUT` row.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re

import jax
import jax.numpy as jnp

import jsparse24
from benchmarks import _common
from jsparse24.backends import cusparselt as cusparselt_backend
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
  p.add_argument("--ks", default=None, help="K values to sweep (default: --sizes)")
  p.add_argument("--ns", default=None, help="N values to sweep (default: --sizes)")
  p.add_argument("--cusparselt", action="store_true",
                 help="also time sparse_dot(..., implementation='cusparselt') (large M, prefill)"
                      " and print the cuSPARSELt AUTO_MIN_M_COMPRESSED row")
  p.add_argument("--cusparselt-layout", action="store_true",
                 help="also time it on the weights in cuSPARSELt's layout (compress(...,"
                      " cusparselt=True)) and print the AUTO_MIN_M_CUSPARSELT_LAYOUT row")
  p.add_argument("--from-json", default=None,
                 help="comma-separated --json files of parts of one sweep: join them")
  args = p.parse_args(argv)
  if args.from_json:
    parts = []
    for path in args.from_json.split(","):
      with open(path) as f:
        parts.append(json.load(f))
    gpus = {part["gpu"] for part in parts}
    if len(gpus) != 1:
      raise SystemExit(f"sweep_decode.py --from-json: the parts ran on different GPUs"
                       f" {sorted(gpus)}; join the parts of one sweep on one kind of GPU")
    # The parts' own copy bandwidths differ by a timing's spread; the
    # lowest keeps "% of copy bandwidth" from overstating.
    bw = min(part["copy_bw"] for part in parts)
    points = [point for part in parts for point in part["points"]]
    environments = "; ".join(part["environment"] for part in parts)
    report(environments, gpus.pop(), bw, points,
           command=f"`sweep_decode.py --ks ... --json PART` in {len(parts)} parts (on GPUs of"
                   f" one kind), joined by `--from-json`", no_write=args.no_write)
    return
  ms = [int(v) for v in args.ms.split(",")]
  sizes = [int(v) for v in args.sizes.split(",")]
  ks = [int(v) for v in args.ks.split(",")] if args.ks else sizes
  ns = [int(v) for v in args.ns.split(",")] if args.ns else sizes
  environment = _common.environment()
  print(environment, flush=True)
  bw = _common.copy_bandwidth()
  print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
  # Each weight of a rotation has its own x (`_common.rows_per_weight` says why).
  dense_f = _common.rotated(lambda x, w: x @ w)
  sparse_f = _common.rotated(lambda x, sp: jsparse24.sparse_dot(x, sp, implementation="pallas"))
  # What a compressed weight multiplies through without the decode kernel:
  # decompressed, then XLA's product (the automatic choice's alternative).
  decompress_f = _common.rotated(lambda x, sp: jsparse24.sparse_dot(x, sp, implementation="xla"))
  cusparselt_f = _common.rotated(
      lambda x, sp: jsparse24.sparse_dot(x, sp, implementation="cusparselt"))
  kinds = [("dense", dense_f, "ws"), ("sparse", sparse_f, "sps"),
           ("decompress", decompress_f, "sps")]
  if args.cusparselt:
    kinds.append(("cusparselt", cusparselt_f, "sps"))
  if args.cusparselt_layout:
    kinds.append(("cusparselt_layout", cusparselt_f, "sps_layout"))
  raw = []
  pool = concurrent.futures.ThreadPoolExecutor(16)
  for k in ks:
    for n in ns:
      sparse_bytes = _common.compressed_bytes(k, n)
      r = _common.rotation(sparse_bytes)
      key = jax.random.key(k * 7 + n)
      sps = [random_sparse(jax.random.fold_in(key, i), k, n) for i in range(r)]
      ws = [jsparse24.decompress(sp) for sp in sps]
      xs = {m: _common.rows_per_weight(jax.random.fold_in(key, 1000 + m), m, k, r) for m in ms}
      # Compiled side by side: compilation, not the GPU, bounds the sweep.
      operands = {"ws": ws, "sps": sps}
      if args.cusparselt_layout:
        operands["sps_layout"] = [jsparse24.compress(w, sp.mask(), cusparselt=True)
                                  for w, sp in zip(ws, sps)]
      futures = {(m, kind): pool.submit(lambda f, a: f.lower(*a).compile(), f,
                                        (xs[m], operands[ops]))
                 for m in ms for kind, f, ops in kinds}
      # All compiled before any is timed: a compilation running beside a
      # timing slows its dispatch.
      compiled = {key: future.result() for key, future in futures.items()}
      for m in ms:
        dense_c, sparse_c = compiled[m, "dense"], compiled[m, "sparse"]
        got = sparse_c(xs[m], sps)[0].astype(jnp.float32)
        ref = jnp.dot(xs[m][0].astype(jnp.float32), ws[0].astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
        err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
        if not err < 1e-2:
          raise SystemExit(f"M={m} K={k} N={n}: relative error {err:.3g}")
        t_dense = _common.bench(dense_c, xs[m], ws, min_time=0.02, repeats=5) / r
        t_sparse = _common.bench(sparse_c, xs[m], sps, min_time=0.02, repeats=5) / r
        t_decompress = _common.bench(compiled[m, "decompress"], xs[m], sps, min_time=0.02,
                                     repeats=5) / r
        io = moved_bytes(m, k, n)
        raw.append(dict(m=m, k=k, n=n, dense_ms=t_dense * 1e3, decompress_ms=t_decompress * 1e3,
                        decode_ms=t_sparse * 1e3, rotate=r, rel_err=err))
        print(f"M={m:4d} K={k:5d} N={n:5d}: dense {t_dense * 1e3:.4f} ms, decompress + XLA"
              f" {t_decompress * 1e3:.4f} ms, decode"
              f" {t_sparse * 1e3:.4f} ms ({t_dense / t_sparse:.2f}x), {io / t_sparse / 1e9:.0f}"
              f" GB/s = {100 * io / t_sparse / bw:.0f}% of copy; rel err {err:.2g}", flush=True)
        for kind, ops in (("cusparselt", "sps"), ("cusparselt_layout", "sps_layout")):
          if (m, kind) not in compiled:
            continue
          got = compiled[m, kind](xs[m], operands[ops])[0].astype(jnp.float32)
          err_c = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
          if not err_c < 1e-2:
            raise SystemExit(f"M={m} K={k} N={n}: {kind} relative error {err_c:.3g}")
          raw[-1][f"{kind}_ms"] = 1e3 * _common.bench(
              compiled[m, kind], xs[m], operands[ops], min_time=0.02, repeats=5) / r
          print(f"M={m:4d} K={k:5d} N={n:5d}: {kind} {raw[-1][f'{kind}_ms']:.4f} ms"
                f" ({t_dense * 1e3 / raw[-1][f'{kind}_ms']:.2f}x of dense)", flush=True)
      del sps, ws, operands
      if args.json:  # after every (K, N): a run stopped by a time limit keeps its points
        with open(args.json, "w") as f:
          json.dump(dict(environment=environment, gpu=_common.gpu_name(), copy_bw=bw,
                         points=raw), f, indent=1)
  report(environment, _common.gpu_name(), bw, raw,
         command="`PYTHONPATH=. python benchmarks/sweep_decode.py`", no_write=args.no_write)


def moved_bytes(m: int, k: int, n: int) -> int:
  """What one product moves at least: the compressed weight, x and y (bf16)."""
  return _common.compressed_bytes(k, n) + 2 * (m * k + m * n)


def report(environment: str, gpu: str, bw: float, points: list[dict], *, command: str,
           no_write: bool) -> None:
  """Prints (and unless `no_write`, writes to results/) the sweep's table and
  the `DECODE_AUTO_MAX_M` row literal it implies (a cell per (K, N):
  `decode_rows`). A row needs the whole grid."""
  ks = sorted({p["k"] for p in points})
  ns = sorted({p["n"] for p in points})
  ms = sorted({p["m"] for p in points})
  by_point = {(p["m"], p["k"], p["n"]): p for p in points}
  rows = []
  for p in sorted(points, key=lambda p: (p["k"], p["n"], p["m"])):
    m, k, n = p["m"], p["k"], p["n"]
    io = moved_bytes(m, k, n)
    t_sparse = p["decode_ms"] / 1e3
    rows.append([m, k, n, p["dense_ms"], p["decompress_ms"], p["decode_ms"],
                 p["dense_ms"] / p["decode_ms"], p["decompress_ms"] / p["decode_ms"],
                 io / t_sparse / 1e9, 100 * io / t_sparse / bw])
  body = (f"{environment}; measured copy bandwidth {bw / 1e12:.3f} TB/s.\n"
          f"Command: {command}. bf16, `sparse_dot(x, sp,"
          f" implementation=\"pallas\")` on a `Sparse24` (the decode kernel,"
          f" `pallas_kernels/decode24.py`, default tiles, up to DECODE_MAX_M ="
          f" {pallas_backend.DECODE_MAX_M} rows) against XLA's `x @ w` and against"
          f" decompress + XLA;"
          f" each timed call cycles through several weights (200 MB together, at most 16). GB/s and % copy"
          f" count compressed values + metadata + x + y.\n\n"
          + _common.table(["M", "K", "N", "dense XLA ms", "decompress + XLA ms", "decode ms",
                           "decode over dense", "decode over decompress", "GB/s",
                           "% copy bw"], rows))
  missing = [(m, k, n) for m in ms for k in ks for n in ns if (m, k, n) not in by_point]
  if missing:
    body += (f"\n\nNo DECODE_AUTO_MAX_M row: {len(missing)} points of the grid were not"
             f" swept (first: M, K, N = {missing[0]}).\n")
  else:
    table = tuple(tuple(decode_rows([by_point[m, k, n] for m in ms]) for n in ns) for k in ks)
    literal = f"    {gpu!r}: {table!r},"
    body += (f"\n\nDECODE_AUTO_MAX_M row (the rows of x for which the decode kernel measured"
             f" >= {pallas_backend.DECODE_MARGIN}x of decompress + XLA at every swept M between"
             f" them: M for 1 to M, (lo, hi) for lo to hi, 0 for never; rows K = {ks}, columns"
             f" N = {ns}):\n\n"
             f"```\n{literal}\n```\n")
  body += cusparselt_report(points, ks, ns, ms)
  body += cusparselt_report(points, ks, ns, ms, layout=True)
  print("\n" + body)
  if not no_write:
    # Dated: a later sweep adds its own section, and the tables that the
    # library's comments cite stay.
    started = re.search(r"run (\d{4}-\d\d-\d\d \d\d:\d\d UTC)", environment)
    what = ("cuSPARSELt on compressed weights in its layout"
            if any("cusparselt_layout_ms" in p for p in points)
            else "cuSPARSELt on compressed weights" if any("cusparselt_ms" in p for p in points)
            else "decode kernel sweep bf16")
    title = f"{what} ({started.group(1) if started else 'undated'})"
    print(f"\nwritten to {_common.write_section(title, body, gpu)}")


def decode_rows(points: list[dict]) -> int | tuple[int, int]:
  """A `DECODE_AUTO_MAX_M` cell from one (K, N)'s points (M ascending): the
  longest run of swept Ms at which the kernel measured at least
  DECODE_MARGIN times as fast as decompress + XLA (the lowest of equally
  long runs), as M when it starts at M = 1, as (lo, hi) when it starts
  higher, 0 when there is none."""
  runs, start = [], None
  for i, p in enumerate(points + [None]):
    fast = p is not None and p["decompress_ms"] / p["decode_ms"] >= pallas_backend.DECODE_MARGIN
    if fast and start is None:
      start = i
    elif not fast and start is not None:
      runs.append((start, i - 1))
      start = None
  if not runs:
    return 0
  first, last = max(runs, key=lambda r: (r[1] - r[0], -r[0]))
  lo, hi = points[first]["m"], points[last]["m"]
  return hi if lo == 1 else (lo, hi)


def cusparselt_report(points: list[dict], ks: list[int], ns: list[int], ms: list[int],
                      layout: bool = False) -> str:
  """The cuSPARSELt table of a `--cusparselt` sweep (`layout`: of a
  `--cusparselt-layout` one, on weights in cuSPARSELt's layout), and the
  `AUTO_MIN_M_COMPRESSED` (`AUTO_MIN_M_CUSPARSELT_LAYOUT`) row it implies:
  for each (K, N), the smallest M from which cuSPARSELt measured at least
  `AUTO_MARGIN` times as fast as the faster of decompress + XLA and, up to
  DECODE_MAX_M rows, the decode kernel (what a compressed weight multiplies
  through otherwise), at that M and every larger M swept (None: at none);
  `first_cusparselt_m` says where a cell starts between two swept Ms."""
  key, name = (("cusparselt_layout_ms", "AUTO_MIN_M_CUSPARSELT_LAYOUT") if layout
               else ("cusparselt_ms", "AUTO_MIN_M_COMPRESSED"))
  if not any(key in p for p in points):
    return ""
  by_point = {(p["m"], p["k"], p["n"]): p for p in points}

  rows = [[p["m"], p["k"], p["n"], p["dense_ms"], _rival_ms(p), p[key],
           p["dense_ms"] / p[key], _rival_ms(p) / p[key]]
          for p in sorted(points, key=lambda p: (p["k"], p["n"], p["m"])) if key in p]
  what = ("the `Sparse24` in cuSPARSELt's layout (`compress(..., cusparselt=True)`), multiplied"
          " in place" if layout else
          "the `Sparse24` re-laid out for cuSPARSELt in every call, then its product")
  body = (f"\n\ncuSPARSELt on the compressed weight (`implementation=\"cusparselt\"`: {what})"
          " against dense XLA and against the faster of decompress + XLA and the decode kernel"
          f" (up to {pallas_backend.DECODE_MAX_M} rows):\n\n"
          + _common.table(["M", "K", "N", "dense XLA ms", "other compressed ms",
                           "cuSPARSELt ms", "cuSPARSELt over dense",
                           "cuSPARSELt over other"], rows))
  if not all(key in by_point.get((m, k, n), {}) for k in ks for n in ns for m in ms):
    return body + f"\n\nNo {name} row: cuSPARSELt was not timed on the whole grid.\n"
  table = tuple(tuple(first_cusparselt_m([by_point[m, k, n] for m in ms], key) for n in ns)
                for k in ks)
  return (body + f"\n\n{name} row (smallest M from which cuSPARSELt measured >="
          f" {cusparselt_backend.AUTO_MARGIN}x of the other compressed product at that and every"
          f" larger swept M, {pallas_backend.DECODE_MAX_M + 1} where that is the first M swept"
          f" past the decode kernels and cuSPARSELt measured as fast against decompress + XLA"
          f" at the last M before; rows K = {ks}, columns N = {ns}):\n\n```\n    {table!r}\n```\n")


def _rival_ms(p: dict) -> float:
  """What a compressed weight multiplies through at `p`'s rows if not
  cuSPARSELt: the faster of decompress + XLA and, up to DECODE_MAX_M rows,
  the decode kernels."""
  if p["m"] <= pallas_backend.DECODE_MAX_M:
    return min(p["decompress_ms"], p["decode_ms"])
  return p["decompress_ms"]


def first_cusparselt_m(points: list[dict], key: str = "cusparselt_ms") -> int | None:
  """One cell of the cuSPARSELt row from its points (one per swept M): the
  smallest M from which cuSPARSELt (`p[key]` ms) measured at least
  `AUTO_MARGIN` times as fast as `_rival_ms` at that and every larger M
  (None: at none).

  Where that M is the first swept past the decode kernels (DECODE_MAX_M)
  and at the last M swept before it cuSPARSELt also measured that fast
  against decompress + XLA, the cell starts at DECODE_MAX_M + 1: the rows
  between the two swept Ms have no decode kernel, and cuSPARSELt beat their
  one other product, decompress + XLA, on both sides of them. Without it a
  sweep of 256 and 512 rows left 257-511 rows decompressed where
  decompress + XLA took 1.19-2.18x cuSPARSELt's time at both (H200,
  2026-12-03, benchmarks/results/nvidia-h200.md, "cuSPARSELt on compressed
  weights, re-laid out by Pallas")."""
  points = sorted(points, key=lambda p: p["m"])
  margin = cusparselt_backend.AUTO_MARGIN
  first = None
  for p in reversed(points):
    if _rival_ms(p) / p[key] < margin:
      break
    first = p["m"]
  limit = pallas_backend.DECODE_MAX_M
  below = [p for p in points if p["m"] <= limit]
  above = [p for p in points if p["m"] > limit]
  if (first is not None and below and above and first == above[0]["m"]
      and below[-1]["decompress_ms"] / below[-1][key] >= margin):
    return limit + 1
  return first


if __name__ == "__main__":
  main()
