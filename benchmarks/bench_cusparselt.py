"""The `"cusparselt"` backend against dense XLA and PyTorch's cuSPARSELt path.

    PYTHONPATH=. python benchmarks/bench_cusparselt.py [--sections compress,forward,step,mlp,sweep,fp16]

Sections (one run, side by side; bf16 unless named; tables go to benchmarks/results/<gpu>.md):
  compress  `cusparseLtSpMMACompress2` alone, and the per-step masking and
            compression of `w` both ways (cuSPARSELt's Compress2 vs ours)
            against the byte floor (bytes / measured copy bandwidth), and
            PyTorch's per-step `to_sparse_semi_structured` of `w` and `w^T`.
  forward   `x @ (w*m)` at three shapes: dense XLA, ours with the
            weight already compressed, ours with masking + compression
            included, PyTorch `F.linear` on a cuSPARSELt weight, FLOP floors.
  step      one linear-layer training step (y, dx, dw), masking and compression
            included: dense XLA; ours with a stored transposable `Mask24` (dx on
            the sparse tensor cores), with a plain `Mask24` (dx dense), and with
            `mask=None` (prune every step); PyTorch's plain path (compress `w`
            and `w^T` every step, both products on cuSPARSELt).
  mlp       an MLP block (up-projection, GELU, down-projection) of the
            examples/train_lm.py model at d_model 4096: forward + backward +
            SGD update, dense `nn.Dense` vs `jsparse24.SparseDense`, tokens/s.
  mvue      the training step with weight_grad="mvue" (dw on the sparse tensor
            cores too) beside the dense-dw step and dense XLA.
  sweep     the training step over M at the three (K, N): where it pays.
  fp16      float16 forward and training step (jsparse24's configuration search).

Every dense XLA baseline is timed first (`DenseBaselines`), before any
cuSPARSELt product runs in the process: after one, the process's
compute-bound kernels run 2-7% slower until it ends.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time
import traceback

import jax
import jax.numpy as jnp

import jsparse24
from benchmarks import _common
from jsparse24.backends import cusparselt as cslt

SHAPES = ((16384, 4096, 16384), (16384, 16384, 4096), (8192, 8192, 8192))  # (M, K, N)
SWEEP_MS = (256, 1024, 2048, 4096, 8192, 16384)


def _weights(k, n, transposable=True, dtype=jnp.bfloat16):
  w = jax.random.normal(jax.random.key(k * 31 + n), (k, n), dtype)
  return w, jsparse24.Mask24.from_weights(w, transposable=transposable)


def _step(implementation, mask, transposable=None):
  """jit((x, w, dy) -> (y, dx, dw)) for one linear layer."""
  if implementation == "dense":
    f = lambda x, w: x @ w  # noqa: E731
  else:
    f = lambda x, w: jsparse24.sparse_dot(  # noqa: E731
        x, w, mask, transposable=transposable, implementation=implementation)

  @jax.jit
  def step(x, w, dy):
    y, vjp = jax.vjp(f, x, w)
    return (y,) + vjp(dy)
  return step


def _dense_inputs(m, k, n, dtype=jnp.bfloat16):
  """Random x [M, K], w [K, N], dy [M, N] for a dense baseline (its time does
  not depend on the values)."""
  kx, kw, kd = jax.random.split(jax.random.key(m * 7 + k * 3 + n), 3)
  return (jax.random.normal(kx, (m, k), dtype), jax.random.normal(kw, (k, n), dtype),
          jax.random.normal(kd, (m, n), dtype))


class DenseBaselines:
  """Dense XLA timings, all taken before the first cuSPARSELt product of the
  process: once one has run, the CUDA context's compute-bound kernels (cuBLAS
  GEMMs among them) run 2-7% slower until the process ends (the same after
  PyTorch's `torch._cslt_sparse_mm`: `_common.CUSPARSELT_TAX`), which a
  dense program in its own process never pays. `measure` (before)
  times every dense program the sections need; `ms` (in the sections) looks
  them up and refuses one that was not timed then."""

  def __init__(self):
    self._seconds: dict[tuple, float] = {}

  def measure(self, sections) -> None:
    sections = set(sections)
    fp16 = [jnp.float16] if "fp16" in sections else []
    fwd_dtypes = ([jnp.bfloat16] if "forward" in sections else []) + fp16
    step_dtypes = ([jnp.bfloat16] if {"step", "mvue"} & sections else []) + fp16
    need = ({("fwd", shape, dt) for shape in SHAPES for dt in fwd_dtypes}
            | {("step", shape, dt) for shape in SHAPES for dt in step_dtypes})
    if "sweep" in sections:
      need |= {("step", (m, k, n), jnp.bfloat16) for _, k, n in SHAPES for m in SWEEP_MS}
    for kind, (m, k, n), dt in sorted(need, key=str):
      x, w, dy = _dense_inputs(m, k, n, dt)
      fn, args = ((jax.jit(lambda x, w: x @ w), (x, w)) if kind == "fwd"
                  else (_step("dense", None), (x, w, dy)))
      t = self._seconds[(kind, (m, k, n), jnp.dtype(dt).name)] = _common.bench(fn, *args)
      print(f"dense baseline {kind} {m}x{k}x{n} {jnp.dtype(dt).name}: {t * 1e3:.3f} ms",
            flush=True)
    if "mlp" in sections:
      self._seconds[("mlp",)] = _mlp_time(sparse=False)

  def seconds(self, kind, shape=(), dtype=jnp.bfloat16) -> float:
    key = (kind,) if kind == "mlp" else (kind, tuple(shape), jnp.dtype(dtype).name)
    if key not in self._seconds:
      raise RuntimeError(f"bench_cusparselt: the dense baseline {key} was not timed before the"
                         f" first cuSPARSELt product (DenseBaselines.measure)")
    return self._seconds[key]


# --- PyTorch peer ---------------------------------------------------------------

def _torch_setup():
  torch = _common.torch_cuda()
  if torch is None:
    return None
  from torch.sparse import SparseSemiStructuredTensor  # pylint: disable=g-import-not-at-top
  SparseSemiStructuredTensor._FORCE_CUTLASS = False  # pylint: disable=protected-access
  return torch


def _torch_tensor(torch, a):
  return torch.from_dlpack(jnp.asarray(a, copy=True))


# --- sections ---------------------------------------------------------------------

def section_compress(ctx):
  torch = ctx["torch"]
  backend = cslt.CusparseltBackend()
  rows = []
  for _, k, n in SHAPES:
    w, mask = _weights(k, n)
    masked = jax.jit(lambda w, m: jnp.where(m.unpack(), w, jnp.zeros((), w.dtype)))
    c_fwd = jax.jit(lambda a: cslt.compress(a, transpose=False))
    c_bwd = jax.jit(lambda a: cslt.compress(a, transpose=True))

    ours = jax.jit(lambda w, m: cslt.compress_for_products(w, m, True)[:2])
    theirs = jax.jit(lambda w, m: cslt.compress_for_products_by_cusparselt(w, m, True)[:2])
    wm = masked(w, mask)
    a, b = ours(w, mask), theirs(w, mask)
    bits = lambda t: jax.lax.bitcast_convert_type(t, jnp.uint16)  # noqa: E731
    same = all(bool(jnp.array_equal(bits(x), bits(y))) for x, y in zip(a, b))
    ours_fwd = jax.jit(lambda w, m: backend.prepare(w, m, False).fwd)
    size = cslt.compressed_size(jnp.bfloat16, k, n)
    t_fwd = _common.bench(c_fwd, wm)
    t_bwd = _common.bench(c_bwd, wm)
    t_theirs = _common.bench(theirs, w, mask)
    t_ours = _common.bench(ours, w, mask)
    t_ours_fwd = _common.bench(ours_fwd, w, mask)
    floor_one = (w.nbytes + size) / ctx["bw"]
    floor_all = (w.nbytes + mask.packed.nbytes + 2 * size) / ctx["bw"]
    floor_fwd = (w.nbytes + mask.packed.nbytes + size) / ctx["bw"]
    t_torch = float("nan")
    if torch is not None:
      from torch.sparse import to_sparse_semi_structured  # pylint: disable=g-import-not-at-top
      tw = _torch_tensor(torch, wm.T)  # torch layout [out=N, in=K]
      def per_step():
        to_sparse_semi_structured(tw)
        to_sparse_semi_structured(tw.t().contiguous())
      try:
        t_torch = _common.torch_bench(per_step)
      except Exception as e:  # pylint: disable=broad-except
        print(f"torch to_sparse_semi_structured failed: {e!r}")
    rows.append([f"{k}x{n}", t_fwd * 1e3, t_bwd * 1e3, floor_one * 1e3,
                 t_theirs * 1e3, t_ours * 1e3, floor_all * 1e3, floor_all / t_ours,
                 t_theirs / t_ours, "yes" if same else "NO", t_ours_fwd * 1e3,
                 floor_fwd * 1e3, t_torch * 1e3])
    print(f"compress {k}x{n}: Compress2 along K {t_fwd*1e3:.3f} ms, along N {t_bwd*1e3:.3f} ms"
          f" (floor {floor_one*1e3:.3f}); per step: mask+Compress2 x2 {t_theirs*1e3:.3f} ms,"
          f" ours {t_ours*1e3:.3f} ms (floor {floor_all*1e3:.3f}), identical bytes {same},"
          f" ours forward copy only {t_ours_fwd*1e3:.3f} ms (floor {floor_fwd*1e3:.3f}),"
          f" torch w+w^T {t_torch*1e3:.3f} ms", flush=True)
  headers = ["W (KxN)", "Compress2 along K ms", "Compress2 along N ms", "floor one ms",
             "per step: mask + Compress2 both ms", "per step: ours (Pallas + metadata) ms",
             "floor per step ms", "ours fraction of floor", "ours speedup over Compress2",
             "identical bytes", "ours, forward copy only ms", "its floor ms",
             "torch to_sparse_semi_structured w + w^T ms"]
  return ("cuSPARSELt compression (per training step)",
          "Compress2 alone reads the masked dense weight and writes cuSPARSELt's"
          " compressed form. Per step with a stored transposable Mask24, the weight"
          " is masked and compressed both ways: with cuSPARSELt's own"
          " `cusparseLtSpMMACompress2` (after masking in the Pallas kernel and XLA), or with ours (the"
          " Pallas compress kernel writing both copies' values in cuSPARSELt's format,"
          " then the metadata written after them). `identical bytes`: both give the"
          " same buffers. `forward copy only`: a plain Mask24 (what a forward pass"
          " without a transposed copy compresses)."
          " Floors: bytes (read w + packed mask, write both compressed copies) /"
          " measured copy bandwidth.\n\n" + _common.table(headers, rows))


def section_forward(ctx):
  torch = ctx["torch"]
  rows = []
  for m, k, n in SHAPES:
    w, mask = _weights(k, n, transposable=False)
    x = jax.random.normal(jax.random.key(m + 1), (m, k), jnp.bfloat16)
    wm = jnp.where(mask.unpack(), w, jnp.zeros((), w.dtype))
    c = jax.jit(lambda a: cslt.compress(a, transpose=False))(wm)
    ours_mm = jax.jit(lambda x, c: cslt.matmul(x, c, k=k, n=n))
    ours_all = jax.jit(lambda x, w, mk: jsparse24.sparse_dot(x, w, mk, implementation="cusparselt"))
    ref = jnp.dot(x, wm, preferred_element_type=jnp.float32)
    err = _common.rel_err(ours_mm(x, c), ref)
    t_dense = ctx["dense"].seconds("fwd", (m, k, n))
    t_mm = _common.bench(ours_mm, x, c)
    t_all = _common.bench(ours_all, x, w, mask)
    t_torch = float("nan")
    if torch is not None:
      from torch.sparse import to_sparse_semi_structured  # pylint: disable=g-import-not-at-top
      tx = _torch_tensor(torch, x)
      tws = to_sparse_semi_structured(_torch_tensor(torch, wm.T))
      t_torch = _common.torch_bench(lambda: torch.nn.functional.linear(tx, tws))
    flops = 2 * m * k * n
    ctx["records"].append({"section": "forward", "m": m, "k": k, "n": n, "dense_ms": t_dense * 1e3,
                           "ours_ms": t_mm * 1e3, "ours_with_compress_ms": t_all * 1e3,
                           "rel_err": err})
    rows.append([m, k, n, t_dense * 1e3, t_mm * 1e3, t_dense / t_mm, t_all * 1e3,
                 t_dense / t_all, t_torch * 1e3, t_dense / t_torch,
                 flops / ctx["peak"] * 1e3, flops / 2 / ctx["peak"] * 1e3, err])
    print(f"forward {m}x{k}x{n}: dense {t_dense*1e3:.3f} ms, ours {t_mm*1e3:.3f} ms"
          f" ({t_dense/t_mm:.2f}x), ours+mask+compress {t_all*1e3:.3f} ms"
          f" ({t_dense/t_all:.2f}x), torch {t_torch*1e3:.3f} ms, err {err:.2e}", flush=True)
  headers = ["M", "K", "N", "dense XLA ms", "ours ms (compressed W)", "speedup",
             "ours ms (+mask+compress)", "speedup", "torch cuSPARSELt ms", "torch speedup",
             "dense FLOP floor ms", "2:4 FLOP floor ms", "rel err"]
  return ("cuSPARSELt forward x @ (w*m)",
          "Speedups over dense XLA (>1 = faster). FLOP floors = FLOPs / measured dense"
          " peak (2:4 = half the FLOPs at the same rate).\n\n" + _common.table(headers, rows))


def _torch_step(torch, x, w, mask_t, dy):
  """PyTorch's plain path: compress w and w^T every step, both products on
  cuSPARSELt, dw dense."""
  from torch.sparse import to_sparse_semi_structured  # pylint: disable=g-import-not-at-top
  tx, tdy = _torch_tensor(torch, x), _torch_tensor(torch, dy)
  tw = _torch_tensor(torch, w.T)  # [N, K]
  tm = _torch_tensor(torch, mask_t.unpack().T)

  def step():
    wm = tw * tm
    ws = to_sparse_semi_structured(wm)  # [N, K] sparse along K
    wts = to_sparse_semi_structured(wm.t().contiguous())  # [K, N] sparse along N
    y = torch.nn.functional.linear(tx, ws)
    dx = torch.nn.functional.linear(tdy, wts)
    dw = tdy.t() @ tx
    return y, dx, dw
  return step


def section_step(ctx, shapes=SHAPES, sweep=False):
  torch = None if sweep else ctx["torch"]
  rows = []
  for m, k, n in shapes:
    w, mask_t = _weights(k, n, transposable=True)
    mask = jsparse24.Mask24.from_weights(w)
    x = jax.random.normal(jax.random.key(m + 2), (m, k), jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(m + 3), (m, n), jnp.bfloat16)
    t_dense = ctx["dense"].seconds("step", (m, k, n))
    ours_t = _step("cusparselt", mask_t)
    got, ref = ours_t(x, w, dy), _step("xla", mask_t)(x, w, dy)
    err = max(_common.rel_err(g, r) for g, r in zip(got, ref))
    t_t = _common.bench(ours_t, x, w, dy)
    if sweep:
      rows.append([m, k, n, t_dense * 1e3, t_t * 1e3, t_dense / t_t, err])
      print(f"sweep {m}x{k}x{n}: dense {t_dense*1e3:.3f} ms, ours {t_t*1e3:.3f} ms"
            f" ({t_dense/t_t:.2f}x)", flush=True)
      continue
    t_plain = _common.bench(_step("cusparselt", mask), x, w, dy)
    t_none = _common.bench(_step("cusparselt", None, False), x, w, dy)
    t_torch = float("nan")
    if torch is not None:
      try:
        t_torch = _common.torch_bench(_torch_step(torch, x, w, mask_t, dy))
      except Exception as e:  # pylint: disable=broad-except
        print(f"torch step failed: {e!r}")
    ctx["records"].append({"section": "step", "m": m, "k": k, "n": n, "dense_ms": t_dense * 1e3,
                           "ours_ms": t_t * 1e3, "ours_plain_ms": t_plain * 1e3,
                           "ours_mask_none_ms": t_none * 1e3, "rel_err": err})
    flops = 3 * 2 * m * k * n
    rows.append([m, k, n, t_dense * 1e3, t_t * 1e3, t_dense / t_t, t_plain * 1e3,
                 t_dense / t_plain, t_none * 1e3, t_dense / t_none, t_torch * 1e3,
                 t_dense / t_torch, flops / ctx["peak"] * 1e3,
                 (flops * 2 / 3) / ctx["peak"] * 1e3, err])
    print(f"step {m}x{k}x{n}: dense {t_dense*1e3:.3f} ms, ours(transposable) {t_t*1e3:.3f} ms"
          f" ({t_dense/t_t:.2f}x), ours(plain) {t_plain*1e3:.3f} ({t_dense/t_plain:.2f}x),"
          f" ours(mask=None) {t_none*1e3:.3f} ({t_dense/t_none:.2f}x), torch"
          f" {t_torch*1e3:.3f} ({t_dense/t_torch:.2f}x), err {err:.2e}", flush=True)
  if sweep:
    headers = ["M", "K", "N", "dense step ms", "ours step ms (transposable Mask24)", "speedup",
               "max rel err"]
    return ("cuSPARSELt training step over M",
            "One linear layer, y + dx + dw, masking and compression included.\n\n"
            + _common.table(headers, rows))
  headers = ["M", "K", "N", "dense XLA ms", "ours, transposable Mask24 ms", "speedup",
             "ours, plain Mask24 (dx dense) ms", "speedup", "ours, mask=None ms", "speedup",
             "torch plain path ms", "torch speedup", "dense FLOP floor ms",
             "2:4 FLOP floor ms (fwd+dx sparse)", "max rel err (transposable)"]
  return ("cuSPARSELt linear-layer training step",
          "y = x @ (w*m), dx, dw (dense) per step, masking and compression of `w`"
          " (and `w^T`) included. Speedups over dense XLA. `mask=None` prunes `w`"
          " (plain rule, XLA) every step.\n\n" + _common.table(headers, rows))


def _mvue_step(implementation, mask):
  """jit((x, w, dy, key) -> (y, dx, dw)) with weight_grad="mvue"."""
  f = lambda x, w, key: jsparse24.sparse_dot(  # noqa: E731
      x, w, mask, implementation=implementation, weight_grad="mvue", key=key)

  @jax.jit
  def step(x, w, dy, key):
    y, vjp = jax.vjp(lambda x, w: f(x, w, key), x, w)
    return (y,) + vjp(dy)
  return step


def section_mvue(ctx):
  """The training step with all three products on the sparse tensor cores
  (weight_grad="mvue": dw = x^T mvue_24(dy)) beside the dense-dw one and
  dense XLA, bf16, a stored transposable mask; masking, both compressions
  and the MVUE pruning of dy included."""
  rows = []
  for m, k, n in SHAPES:
    w, mask_t = _weights(k, n, transposable=True)
    x = jax.random.normal(jax.random.key(m + 2), (m, k), jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(m + 3), (m, n), jnp.bfloat16)
    key = jax.random.key(m + 4)
    t_dense = ctx["dense"].seconds("step", (m, k, n))
    t_t = _common.bench(_step("cusparselt", mask_t), x, w, dy)
    ours = _mvue_step("cusparselt", mask_t)
    got, ref = ours(x, w, dy, key), _mvue_step("xla", mask_t)(x, w, dy, key)
    err = [_common.rel_err(g, r) for g, r in zip(got, ref)]
    t_mvue = _common.bench(ours, x, w, dy, key)
    ctx["records"].append({"section": "step", "m": m, "k": k, "n": n, "dense_ms": t_dense * 1e3,
                           "ours_ms": t_t * 1e3, "ours_plain_ms": t_plain * 1e3,
                           "ours_mask_none_ms": t_none * 1e3, "rel_err": err})
    flops = 3 * 2 * m * k * n
    rows.append([m, k, n, t_dense * 1e3, t_t * 1e3, t_dense / t_t, t_mvue * 1e3,
                 t_dense / t_mvue, flops / ctx["peak"] * 1e3, flops / 2 / ctx["peak"] * 1e3,
                 f"{err[0]:.1e} / {err[1]:.1e} / {err[2]:.1e}"])
    print(f"mvue step {m}x{k}x{n}: dense {t_dense*1e3:.3f} ms, ours (dw dense)"
          f" {t_t*1e3:.3f} ms ({t_dense/t_t:.2f}x), ours (dw MVUE, sparse)"
          f" {t_mvue*1e3:.3f} ms ({t_dense/t_mvue:.2f}x); rel err vs xla y/dx/dw {err}",
          flush=True)
  headers = ["M", "K", "N", "dense XLA ms", "ours, dw dense ms", "speedup",
             "ours, dw MVUE on cuSPARSELt ms", "speedup", "dense FLOP floor ms",
             "2:4 FLOP floor ms (all sparse)", "rel err vs xla backend y / dx / dw"]
  return ("cuSPARSELt training step, all three products sparse (MVUE dw)",
          "y, dx and dw per step (bf16) with a stored transposable mask; masking, both"
          " compressions of `w` and the MVUE"
          " pruning + compression of `dy` included. dw's error against the `xla`"
          " backend's MVUE dw (same draws up to an ulp; cuSPARSELt rounds dw to bf16).\n\n"
          + _common.table(headers, rows))


def section_fp16(ctx):
  """float16 picks its algorithm with jsparse24's configuration search
  (cusparseLtMatmulSearch crashes for float16 with cuSPARSELt 0.8.0 on an
  H200; see cusparselt.SEARCH)."""
  rows = []
  dt = jnp.float16
  for m, k, n in SHAPES:
    w, mask_t = _weights(k, n, transposable=True, dtype=dt)
    mask = jsparse24.Mask24.from_weights(w)
    x = jax.random.normal(jax.random.key(m + 1), (m, k), dt)
    dy = jax.random.normal(jax.random.key(m + 3), (m, n), dt)
    fwd_ours = jax.jit(lambda x, w, mk: jsparse24.sparse_dot(x, w, mk, implementation="cusparselt"))
    t_fd = ctx["dense"].seconds("fwd", (m, k, n), dt)
    t_fo = _common.bench(fwd_ours, x, w, mask)
    t_sd = ctx["dense"].seconds("step", (m, k, n), dt)
    ours_t = _step("cusparselt", mask_t)
    got, ref = ours_t(x, w, dy), _step("xla", mask_t)(x, w, dy)
    err = max(_common.rel_err(g, r) for g, r in zip(got, ref))
    t_so = _common.bench(ours_t, x, w, dy)
    rows.append([m, k, n, t_fd * 1e3, t_fo * 1e3, t_fd / t_fo, t_sd * 1e3, t_so * 1e3,
                 t_sd / t_so, err])
    print(f"fp16 {m}x{k}x{n}: forward dense {t_fd*1e3:.3f} ms, ours+mask+compress"
          f" {t_fo*1e3:.3f} ms ({t_fd/t_fo:.2f}x); step dense {t_sd*1e3:.3f} ms, ours"
          f" (transposable) {t_so*1e3:.3f} ms ({t_sd/t_so:.2f}x), err {err:.2e}", flush=True)
  headers = ["M", "K", "N", "dense fwd ms", "ours fwd ms (+mask+compress)", "speedup",
             "dense step ms", "ours step ms (transposable Mask24)", "speedup", "max rel err"]
  return ("cuSPARSELt float16",
          "float16 picks its algorithm with jsparse24's own search (configuration ids"
          " 0-33 timed on the first call of each shape): `cusparseLtMatmulSearch` hits an"
          " illegal instruction for float16 with cuSPARSELt 0.8.0 on an H200. Forward"
          " with a plain Mask24, and the linear-layer training step with a transposable"
          " one, masking and compression included; speedups over dense XLA in float16.\n\n"
          + _common.table(headers, rows))


MLP_SHAPE = {"d_model": 4096, "batch": 8, "seq": 2048}


def _mlp_time(sparse: bool, d_model=MLP_SHAPE["d_model"], batch=MLP_SHAPE["batch"],
              seq=MLP_SHAPE["seq"]) -> float:
  """Seconds per training step (forward + backward + SGD) of
  examples/train_lm.py's MLP block, dense `nn.Dense` or
  `jsparse24.SparseDense(transposable=True, implementation="cusparselt")`."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  class MLP(nn.Module):  # examples/train_lm.py's MLP block
    sparse: bool

    @nn.compact
    def __call__(self, x):
      if self.sparse:
        linear = lambda f, name: jsparse24.SparseDense(  # noqa: E731
            f, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, transposable=True,
            implementation="cusparselt", name=name)
      else:
        linear = lambda f, name: nn.Dense(  # noqa: E731
            f, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, name=name)
      h = nn.gelu(linear(4 * d_model, "up")(x))
      return linear(d_model, "down")(h)

  x = jax.random.normal(jax.random.key(0), (batch, seq, d_model), jnp.bfloat16)
  target = jax.random.normal(jax.random.key(1), (batch, seq, d_model), jnp.bfloat16)
  tx = optax.sgd(1e-3)
  model = MLP(sparse)
  variables = model.init(jax.random.key(2), x)
  params = variables["params"]
  rest = {k: v for k, v in variables.items() if k != "params"}
  opt_state = tx.init(params)

  @jax.jit
  def train_step(params, opt_state, x, target):
    def loss(p):
      y = model.apply({"params": p, **rest}, x)
      return jnp.mean((y.astype(jnp.float32) - target.astype(jnp.float32)) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return _common.bench(lambda p, o: train_step(p, o, x, target), params, opt_state)


def section_mlp(ctx):
  d_model, batch, seq = MLP_SHAPE["d_model"], MLP_SHAPE["batch"], MLP_SHAPE["seq"]
  tokens = batch * seq
  rows = []
  for sparse in (False, True):
    t = _mlp_time(True) if sparse else ctx["dense"].seconds("mlp")
    rows.append(["2:4 (cusparselt)" if sparse else "dense", t * 1e3, tokens / t])
    print(f"mlp {'sparse' if sparse else 'dense'}: {t*1e3:.3f} ms/step, {tokens/t:,.0f} tokens/s",
          flush=True)
  rows.append(["speedup", rows[0][1] / rows[1][1], rows[1][2] / rows[0][2]])
  return (f"MLP block training step (d_model {d_model}, hidden {4 * d_model}, {batch}x{seq} tokens)",
          "examples/train_lm.py's MLP block (Dense up, GELU, Dense down) at GPU size;"
          " forward + backward + SGD update; sparse = `jsparse24.SparseDense(transposable=True,"
          " implementation='cusparselt')` with its stored masks. The dense step is timed"
          " before any cuSPARSELt product of the run (`DenseBaselines`).\n\n"
          + _common.table(["model", "ms / step", "tokens / s"], rows))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--sections", default="compress,forward,step,mvue,mlp,sweep,fp16")
  p.add_argument("--no-write", action="store_true", help="print only; leave results/ alone")
  p.add_argument("--json", default=None,
                 help="also write the forward and step timings (ms per shape) to this JSON file")
  args = p.parse_args(argv)
  print(_common.environment(), flush=True)
  reason = jsparse24.available_implementations()["cusparselt"]
  if reason is not None:
    raise SystemExit(f"the cusparselt backend cannot run here: {reason}")
  from jsparse24.backends import _cusparselt_build  # pylint: disable=g-import-not-at-top
  lib = _cusparselt_build.load()
  print(f"cuSPARSELt {_cusparselt_build.version(lib)}, shim {_cusparselt_build.build()}", flush=True)
  ctx = {"bw": _common.copy_bandwidth(), "peak": _common.dense_peak(), "torch": _torch_setup(),
         "dense": DenseBaselines(), "records": []}
  # Every dense baseline first, before any cuSPARSELt product (DenseBaselines).
  ctx["dense"].measure(args.sections.split(","))
  head = (f"{_common.environment()}; cuSPARSELt {_cusparselt_build.version(lib)}; measured copy"
          f" bandwidth {ctx['bw'] / 1e12:.3f} TB/s, dense bf16 peak {ctx['peak'] / 1e12:.0f}"
          f" TFLOP/s. Every dense XLA baseline is timed before the run's first cuSPARSELt"
          f" product: {_common.CUSPARSELT_TAX}.\n\n")
  print(head, flush=True)
  sections = {
      "compress": section_compress, "forward": section_forward, "step": section_step,
      "mlp": section_mlp, "fp16": section_fp16, "mvue": section_mvue,
      "sweep": lambda ctx: section_step(ctx, [(m, k, n) for _, k, n in SHAPES for m in SWEEP_MS],
                                        sweep=True),
  }
  for name in args.sections.split(","):
    t0 = time.time()
    try:
      title, body = sections[name](ctx)
    except Exception:  # pylint: disable=broad-except
      traceback.print_exc()
      print(f"section {name} FAILED", flush=True)
      continue
    print(f"\n## {title}\n\n{body}\n({time.time() - t0:.0f} s)\n", flush=True)
    if not args.no_write:
      _common.write_section(title, head + body)
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(
        {"cusparselt": _cusparselt_build.version(lib), "environment": _common.environment(),
         "records": ctx["records"]}, indent=1))


if __name__ == "__main__":
  main()
