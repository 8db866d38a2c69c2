"""benchmarks/sweep_decode.py's `--from-json`: parts of one sweep, run side by
side on several GPUs, joined into one table and the automatic choice's rows
(no GPU needed: the parts are written here)."""

import json

import pytest

from benchmarks import sweep_decode

MS = (1, 16, 64, 256)
SIZES = (2048, 4096)


def _part(path, ks, *, gpu="NVIDIA H200", slow_from=None, cusparselt=False):
  """A part over K in `ks`: the kernel twice as fast as decompress + XLA,
  except from M = `slow_from[k, n]` on (as slow). cuSPARSELt beats both
  from M = 64."""
  points = []
  for k in ks:
    for n in SIZES:
      for m in MS:
        slow = slow_from is not None and m >= slow_from.get((k, n), 1 << 30)
        p = dict(m=m, k=k, n=n, dense_ms=1.0, decompress_ms=2.0,
                 decode_ms=2.0 if slow else 1.0, rotate=2, rel_err=1e-3)
        if cusparselt:
          p["cusparselt_ms"] = 0.5 if m >= 64 else 4.0
        points.append(p)
  path.write_text(json.dumps(dict(environment=f"{gpu}; run 2026-01-02 03:04 UTC", gpu=gpu,
                                  copy_bw=3e12, points=points)))
  return str(path)


def test_parts_join_into_the_rows_of_the_whole_grid(tmp_path, capsys):
  a = _part(tmp_path / "a.json", [2048], slow_from={(2048, 4096): 64}, cusparselt=True)
  b = _part(tmp_path / "b.json", [4096], slow_from={(4096, 2048): 1}, cusparselt=True)
  sweep_decode.main(["--from-json", f"{a},{b}", "--no-write"])
  out = capsys.readouterr().out
  # K 2048: every M up to 256, and up to 16 where M = 64 measured slow;
  # K 4096: never where M = 1 measured slow.
  assert "'NVIDIA H200': ((256, 16), (0, 256))," in out
  # cuSPARSELt: from M = 64 on, against the faster of the other two.
  assert "((64, 64), (64, 64))" in out
  assert "in 2 parts" in out


def test_a_part_missing_gives_no_row(tmp_path, capsys):
  a = _part(tmp_path / "a.json", [2048])
  b = _part(tmp_path / "b.json", [4096])
  data = json.loads((tmp_path / "b.json").read_text())
  data["points"] = data["points"][:-1]
  (tmp_path / "b.json").write_text(json.dumps(data))
  sweep_decode.main(["--from-json", f"{a},{b}", "--no-write"])
  out = capsys.readouterr().out
  assert "No DECODE_AUTO_MAX_M row: 1 points of the grid were not swept" in out
  assert "'NVIDIA H200':" not in out


def test_parts_of_different_gpus_are_refused(tmp_path):
  a = _part(tmp_path / "a.json", [2048])
  b = _part(tmp_path / "b.json", [4096], gpu="NVIDIA H100 80GB HBM3")
  with pytest.raises(SystemExit, match="different GPUs"):
    sweep_decode.main(["--from-json", f"{a},{b}", "--no-write"])
