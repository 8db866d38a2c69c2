"""benchmarks/sweep_decode.py's `--from-json`: parts of one sweep, run side by
side on several GPUs, joined into one table and the automatic choice's rows
(no GPU needed: the parts are written here)."""

import json

import pytest

from benchmarks import sweep_decode

MS = (1, 16, 64, 256)
SIZES = (2048, 4096)


def _part(path, ks, *, gpu="NVIDIA H200", slow=None, cusparselt=False):
  """A part over K in `ks`: the kernel twice as fast as decompress + XLA,
  except at the Ms of `slow[k, n]` (as slow). cuSPARSELt beats both from
  M = 64."""
  points = []
  for k in ks:
    for n in SIZES:
      for m in MS:
        is_slow = slow is not None and m in slow.get((k, n), ())
        p = dict(m=m, k=k, n=n, dense_ms=1.0, decompress_ms=2.0,
                 decode_ms=2.0 if is_slow else 1.0, rotate=2, rel_err=1e-3)
        if cusparselt:
          p["cusparselt_ms"] = 0.5 if m >= 64 else 4.0
        points.append(p)
  path.write_text(json.dumps(dict(environment=f"{gpu}; run 2026-01-02 03:04 UTC", gpu=gpu,
                                  copy_bw=3e12, points=points)))
  return str(path)


def test_parts_join_into_the_rows_of_the_whole_grid(tmp_path, capsys):
  a = _part(tmp_path / "a.json", [2048], slow={(2048, 4096): (64, 256)}, cusparselt=True)
  b = _part(tmp_path / "b.json", [4096], slow={(4096, 2048): MS, (4096, 4096): (1, 64)},
            cusparselt=True)
  sweep_decode.main(["--from-json", f"{a},{b}", "--no-write"])
  out = capsys.readouterr().out
  # (2048, 2048): every M up to 256; (2048, 4096): up to 16 (slow from 64);
  # (4096, 2048): never (slow at every M); (4096, 4096): fast at 16 and 256
  # only, the lower of two equal runs.
  assert "'NVIDIA H200': ((256, 16), (0, (16, 16)))," in out
  # cuSPARSELt: from M = 64 on, against the faster of the other two.
  assert "((64, 64), (64, 64))" in out
  assert "in 2 parts" in out


def test_a_cell_slow_at_few_rows_starts_where_it_is_fast():
  points = [dict(m=m, decompress_ms=2.0, decode_ms=1.0) for m in (1, 2, 4, 8, 16, 32)]
  assert sweep_decode.decode_rows(points) == 32
  points[0]["decode_ms"] = 4.0  # slower than decompressing at M = 1 only
  assert sweep_decode.decode_rows(points) == (2, 32)
  points[4]["decode_ms"] = 4.0  # and at M = 16: the longer run, 2-8
  assert sweep_decode.decode_rows(points) == (2, 8)
  points[1]["decode_ms"] = 2.0 / 1.02  # below the margin at M = 2
  assert sweep_decode.decode_rows(points) == (4, 8)  # 4-8 and 32: the longer
  assert sweep_decode.decode_rows([dict(m=1, decompress_ms=1.0, decode_ms=1.0)]) == 0


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


def test_cusparselt_missing_at_one_point_gives_no_cusparselt_row(tmp_path, capsys):
  a = _part(tmp_path / "a.json", [2048], cusparselt=True)
  b = _part(tmp_path / "b.json", [4096], cusparselt=True)
  data = json.loads((tmp_path / "b.json").read_text())
  del data["points"][0]["cusparselt_ms"]
  (tmp_path / "b.json").write_text(json.dumps(data))
  sweep_decode.main(["--from-json", f"{a},{b}", "--no-write"])
  out = capsys.readouterr().out
  assert "No AUTO_MIN_M_COMPRESSED row" in out
  assert "'NVIDIA H200': ((256, 256), (256, 256))," in out  # the kernel's row is whole


def test_a_cusparselt_cell_starts_past_the_decode_kernels_where_it_beat_decompressing():
  """`first_cusparselt_m`: swept at 128, 256 and 512 rows, cuSPARSELt slower
  than the decode kernel up to 256 and faster than decompress + XLA from
  512: the cell starts at 257 where cuSPARSELt also beat decompress + XLA at
  256 (the rows between have no decode kernel), at 512 where it did not."""
  limit = sweep_decode.pallas_backend.DECODE_MAX_M
  assert limit == 256

  def cell(decompress_at_256):
    return [dict(m=128, decompress_ms=2.0, decode_ms=1.0, cusparselt_ms=1.5),
            dict(m=256, decompress_ms=decompress_at_256, decode_ms=1.0, cusparselt_ms=1.5),
            dict(m=512, decompress_ms=2.0, cusparselt_ms=1.5)]

  assert sweep_decode.first_cusparselt_m(cell(2.0)) == 257
  assert sweep_decode.first_cusparselt_m(cell(1.5)) == 512  # decompressing as fast at 256
  assert sweep_decode.first_cusparselt_m(cell(1.5 * 1.04)) == 512  # within the margin
  # cuSPARSELt from the first M swept: as it measured.
  points = cell(2.0)
  points[0]["cusparselt_ms"] = points[1]["cusparselt_ms"] = 0.5
  assert sweep_decode.first_cusparselt_m(points) == 128
  # Slower than decompressing at 512, faster at 1024: past a swept M that
  # lost to decompress + XLA, the cell keeps the M it measured.
  points = cell(2.0) + [dict(m=1024, decompress_ms=2.0, cusparselt_ms=1.5)]
  points[2]["cusparselt_ms"] = 2.5
  assert sweep_decode.first_cusparselt_m(points) == 1024
  assert sweep_decode.first_cusparselt_m(
      [dict(m=512, decompress_ms=1.0, cusparselt_ms=1.5)]) is None
  # The layout's sweep reads its own column.
  layout = [dict(p, cusparselt_layout_ms=p.pop("cusparselt_ms")) for p in cell(2.0)]
  assert sweep_decode.first_cusparselt_m(layout, "cusparselt_layout_ms") == 257
