"""Prune + compress of a 16384x16384 bf16 weight: ours against the floor and
PyTorch's fused tile kernel.

    PYTHONPATH=. python benchmarks/bench_prune.py [--size 16384] [--no-write]

Prints one table (and writes it to benchmarks/results/<gpu>.md unless
--no-write): the reference
(`implementation="xla"`), the Pallas kernels (prune+compress, and compress
with a stored mask, and the transposable mask alone from float32 weights, as
the mask rebuilds make it), PyTorch's `_sparse_semi_structured_tile` (which always
builds the transposable mask and both compressed copies), and the byte floor
(fewest bytes moved / measured copy bandwidth).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jsparse24
from benchmarks import _common


DEFAULT_VARIANTS = "plain,transposable,mvue"


def _bytes(k: int, n: int, transposed: bool, reads_mask: bool = False) -> int:
  dense = 2 * k * n
  one_copy = k * n // 2 * 2 + k * n // 8  # values + meta
  return dense + one_copy * (2 if transposed else 1) + (k * n // 8 if reads_mask else 0)


def section_mvue(g, add, bw, rows):
  """weight_grad="mvue": the output gradient `g[M, N]` pruned 2:4 along M by
  the MVUE rule and compressed for cuSPARSELt's weight-gradient product (the
  Pallas kernel, then the metadata rows), against XLA's `mvue_24` alone
  (pruned dense, not compressed) and the byte floor."""
  from jsparse24.backends import cusparselt as cslt  # pylint: disable=g-import-not-at-top
  m, n = g.shape
  nbytes = _bytes(m, n, False)
  key = jax.random.key(1)
  f_pal = jax.jit(lambda g, key: cslt.mvue_compress_for_product(g, cslt.mvue_seeds(key)))
  f_xla = jax.jit(lambda g, key: jsparse24.mvue_24(g, key, axis=0))
  buf = f_pal(g, key)
  # Decode the buffer's values against the reference's (the draws may differ
  # by an ulp of a boundary: report the fraction that agree).
  kept = np.asarray(buf[:m // 2], np.float32).reshape(m // 4, 2, n)
  ref = np.asarray(f_xla(g, key), np.float32).reshape(m // 4, 4, n)
  ref_kept = np.sort(np.abs(ref), axis=1)[:, 2:]  # the 2 largest |kept| (others are 0)
  agree = float(np.mean(np.all(np.isclose(np.sort(np.abs(kept), axis=1), ref_kept,
                                          rtol=2 ** -7), axis=1)))
  print(f"mvue: kernel groups whose kept values match the reference: {agree:.6f}", flush=True)
  if agree < 0.999:
    raise SystemExit("mvue: the kernel's draws differ from the reference's")
  add("xla mvue_24 (pruned dense g, no compression)", _common.bench(f_xla, g, key),
      2 * 2 * m * n, "reads g, writes g")
  add("pallas MVUE prune+compress (cuSPARSELt layout)", _common.bench(f_pal, g, key), nbytes)
  rows.append(["floor (mvue): bytes / copy bw", nbytes / bw * 1e3, bw / 1e12, 1.0, ""])


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--size", type=_common.count, default=16384)
  p.add_argument("--variants", default=DEFAULT_VARIANTS,
                 help="plain, transposable (prune+compress a weight), mvue (a gradient)")
  p.add_argument("--no-write", action="store_true", help="print only; leave results/ alone")
  args = p.parse_args(argv)
  k = n = args.size
  print(_common.environment(), flush=True)
  bw = _common.copy_bandwidth()
  print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
  w = jax.random.normal(jax.random.key(0), (k, n), jnp.bfloat16)

  rows = []

  def add(name, seconds, nbytes, note=""):
    floor = nbytes / bw
    rows.append([name, seconds * 1e3, nbytes / seconds / 1e12, floor / seconds, note])
    print(f"{name:48s} {seconds * 1e3:8.3f} ms  {nbytes / seconds / 1e12:6.3f} TB/s"
          f"  {100 * floor / seconds:5.1f}% of copy bw", flush=True)

  for tag in args.variants.split(","):
    if tag == "mvue":
      section_mvue(w, add, bw, rows)
      continue
    transposed = tag == "transposable"
    nbytes = _bytes(k, n, transposed)
    f_xla = jax.jit(lambda w, t=transposed: jsparse24.compress(w, transposed=t, implementation="xla"))
    f_pal = jax.jit(lambda w, t=transposed: jsparse24.compress(w, transposed=t, implementation="pallas"))
    ref, got = f_xla(w), f_pal(w)
    same = all(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
               for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)))
    print(f"{tag}: pallas == xla reference, bit for bit: {same}", flush=True)
    if not same:
      raise SystemExit(f"{tag}: the Pallas result differs from the reference")
    add(f"xla reference, prune+compress ({tag})", _common.bench(f_xla, w), nbytes)
    add(f"pallas, prune+compress ({tag})", _common.bench(f_pal, w), nbytes)
    mask = jsparse24.Mask24.from_meta(ref.meta, (k, n), transposed)
    f_apply = jax.jit(lambda w, m, t=transposed: jsparse24.compress(w, m, transposed=t, implementation="pallas"))
    add(f"pallas, compress with stored mask ({tag})", _common.bench(f_apply, w, mask),
        _bytes(k, n, transposed, reads_mask=True) - k * n // 8)  # meta is read, not written
    if jax.default_backend() == "gpu":
      # What the "cusparselt" backend (the default for large layers on a GPU)
      # runs in training: the same kernels writing cuSPARSELt's layout, then
      # its metadata rows (a second Pallas pass per copy). A backend internal, as in
      # section_mvue: no public function compresses into that layout alone.
      from jsparse24.backends import cusparselt as cslt  # pylint: disable=g-import-not-at-top
      f_cp = jax.jit(lambda w, m, t=transposed: cslt.compress_for_products(w, m, t))
      add(f"cusparselt backend: prune+compress ({tag}), its layout", _common.bench(f_cp, w, None),
          nbytes, "kernel + metadata rows")
      # Without the mask it returns: returning the stored mask from the jit
      # would add a copy of it (33.6 MB at 16384^2) that training does not have.
      f_cs = jax.jit(lambda w, m, t=transposed: cslt.compress_for_products(w, m, t)[:2])
      add(f"cusparselt backend: compress with stored mask ({tag}), its layout",
          _common.bench(f_cs, w, mask), _bytes(k, n, transposed, reads_mask=True) - k * n // 8,
          "kernel + metadata rows")
    rows.append([f"floor ({tag}): bytes / copy bw", nbytes / bw * 1e3, bw / 1e12, 1.0, ""])
    if transposed:  # the mask alone, from float32 master weights (the rebuilds)
      w32 = w.astype(jnp.float32)
      mask_bytes = 4 * k * n + k * n // 8
      f_ref = jax.jit(lambda w: jsparse24.Mask24.pack(
          jsparse24.prune_24(w, transposable=True), transposable=True))
      f_fast = jax.jit(lambda w: jsparse24.Mask24.from_weights(w, transposable=True))
      same = np.array_equal(np.asarray(f_ref(w32).packed), np.asarray(f_fast(w32).packed))
      print(f"mask: Mask24.from_weights == reference, bit for bit: {same}", flush=True)
      if not same:
        raise SystemExit("mask: Mask24.from_weights differs from the reference")
      add("xla reference, transposable mask only (f32 w)", _common.bench(f_ref, w32), mask_bytes)
      add("Mask24.from_weights, transposable (f32 w; fused kernel on a GPU)",
          _common.bench(f_fast, w32), mask_bytes)

  torch = _common.torch_cuda()
  if torch is not None:
    tw = torch.randn(k, n, dtype=torch.bfloat16, device="cuda")
    try:
      t = _common.torch_bench(lambda: torch._sparse_semi_structured_tile(tw, "", False))  # pylint: disable=protected-access
      add("torch _sparse_semi_structured_tile (cuSPARSELt layout, w and w^T)", t,
          _bytes(k, n, True), "peer")
    except Exception as e:  # pylint: disable=broad-except
      rows.append(["torch _sparse_semi_structured_tile", "error", "", "", repr(e)[:80]])
  else:
    rows.append(["torch", "not available", "", "", ""])

  body = (f"{_common.environment()}; measured copy bandwidth {bw / 1e12:.3f} TB/s.\n"
          f"Weight {k}x{n} bf16. Bytes counted: read w once, write values + meta"
          f" (and the transposed pair); fraction = floor time / time.\n\n"
          + _common.table(["what", "ms", "TB/s", "fraction of copy bw", "note"], rows))
  # A run of some of the variants gets its own section: it must not replace
  # the whole table of a full run.
  title = f"prune+compress {k}x{n} bf16"
  if args.variants != DEFAULT_VARIANTS:
    title += f" ({args.variants})"
  print("\n" + body)
  if not args.no_write:
    print(f"\nwritten to {_common.write_section(title, body)}")


if __name__ == "__main__":
  main()
