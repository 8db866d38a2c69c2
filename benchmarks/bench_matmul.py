"""Sparse-operand matmul `y = x @ W` (W 2:4, compressed) against dense XLA,
PyTorch cuSPARSELt and the two floors, over M.

    PYTHONPATH=. python benchmarks/bench_matmul.py [--ms 16,64,256,2048,16384] [--no-write]

For (K, N) in {(8192, 8192), (4096, 16384)} and each M: dense XLA `x @ w`
(bf16), the `"pallas"` backend reading the compressed weight
(`jsparse24.sparse_dot(x, sp, implementation="pallas")`), PyTorch's
`to_sparse_semi_structured` + `F.linear` on cuSPARSELt, and the floors: FLOPs /
measured dense peak, and bytes (x, y, and W dense or compressed) / measured
copy bandwidth. Writes the table to benchmarks/results/<gpu>.md (unless
--no-write).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jsparse24
from benchmarks import _common

SHAPES = ((8192, 8192), (4096, 16384))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--ms", default="16,64,256,2048,16384")
  p.add_argument("--no-write", action="store_true", help="print only; leave results/ alone")
  args = p.parse_args(argv)
  ms = _common.counts(p, "--ms", args.ms)  # before the bandwidth runs, which take seconds
  print(_common.environment(), flush=True)
  bw = _common.copy_bandwidth()
  peak = _common.dense_peak()
  print(f"copy bandwidth {bw / 1e12:.3f} TB/s, dense bf16 peak {peak / 1e12:.0f} TFLOP/s", flush=True)
  torch = _common.torch_cuda()
  if torch is not None:
    from torch.sparse import SparseSemiStructuredTensor, to_sparse_semi_structured  # pylint: disable=g-import-not-at-top
    SparseSemiStructuredTensor._FORCE_CUTLASS = False  # pylint: disable=protected-access

  dense_mm = jax.jit(lambda x, w: x @ w)
  sparse_mm = jax.jit(lambda x, sp: jsparse24.sparse_dot(x, sp, implementation="pallas"))
  rows = []
  for k, n in SHAPES:
    w = jax.random.normal(jax.random.key(k), (k, n), jnp.bfloat16)
    sp = jax.jit(lambda w: jsparse24.compress(w, implementation="pallas"))(w)
    w_masked = jsparse24.decompress(sp)
    tw = None
    if torch is not None:
      # torch keeps weights as [out, in] and prunes along `in` = our K.
      tw_dense = torch.from_dlpack(jnp.asarray(w_masked.T, copy=True))
      try:
        tw = to_sparse_semi_structured(tw_dense.contiguous())
      except Exception as e:  # pylint: disable=broad-except
        print(f"torch to_sparse_semi_structured failed: {e!r}")
    for m in ms:
      x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
      got = sparse_mm(x, sp)
      ref = jnp.dot(x, w_masked, preferred_element_type=jnp.float32)
      err = float(jnp.linalg.norm(got.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
      if not err < 1e-2:
        raise SystemExit(f"M={m} K={k} N={n}: relative error {err:.3g}")
      t_dense = _common.bench(dense_mm, x, w)
      t_sparse = _common.bench(sparse_mm, x, sp)
      t_torch = float("nan")
      if tw is not None:
        tx = torch.from_dlpack(jnp.asarray(x, copy=True))
        try:
          t_torch = _common.torch_bench(lambda: torch.nn.functional.linear(tx, tw))
        except Exception as e:  # pylint: disable=broad-except
          print(f"torch cuSPARSELt M={m}: {e!r}")
      flops = 2 * m * k * n
      io = 2 * (m * k + m * n)
      floor_dense = max(flops / peak, (io + 2 * k * n) / bw)
      floor_sparse_bytes = (io + sp.nbytes) / bw
      row = [m, k, n, t_dense * 1e3, t_sparse * 1e3, t_dense / t_sparse,
             t_torch * 1e3, t_dense / t_torch, floor_dense * 1e3,
             floor_sparse_bytes * 1e3, flops / t_dense / 1e12, err]
      rows.append(row)
      print(f"M={m:6d} K={k} N={n}: dense {t_dense * 1e3:.4f} ms, pallas {t_sparse * 1e3:.4f} ms"
            f" ({t_dense / t_sparse:.2f}x), torch cuSPARSELt {t_torch * 1e3:.4f} ms"
            f" ({t_dense / t_torch:.2f}x); floors dense {floor_dense * 1e3:.4f}"
            f" sparse-bytes {floor_sparse_bytes * 1e3:.4f} ms; rel err {err:.2g}", flush=True)

  body = (f"{_common.environment()}; measured copy bandwidth {bw / 1e12:.3f} TB/s,"
          f" dense bf16 peak {peak / 1e12:.0f} TFLOP/s (16384x4096x16384 through XLA).\n"
          "Speedups are over dense XLA (>1 = faster). `floor dense` = max(FLOPs/peak,"
          " dense bytes/bw); `floor sparse bytes` = (x + y + compressed W bytes)/bw,"
          " the best a kernel that reads the compressed weight can do when memory-bound.\n\n"
          + _common.table(["M", "K", "N", "dense XLA ms", "pallas ms", "pallas speedup",
                           "torch cuSPARSELt ms", "torch speedup", "floor dense ms",
                           "floor sparse bytes ms", "dense TFLOP/s", "rel err"], rows))
  print("\n" + body)
  if not args.no_write:
    print(f"\nwritten to {_common.write_section('sparse-operand matmul bf16', body)}")


if __name__ == "__main__":
  main()
