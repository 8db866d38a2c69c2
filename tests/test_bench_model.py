"""benchmarks/bench_model.py runs end to end on CPU at a tiny size: init under
nn.scan, sparsify, mask_update, the timed steps, the breakdown and the tables."""

import math

import pytest

from benchmarks import bench_model

LAYERS = 2


@pytest.mark.parametrize("weight_grad", ["dense", "mvue"])
def test_bench_model_runs_on_cpu(capsys, weight_grad):
  out = bench_model.main(["--widths", "128", "--layers", str(LAYERS), "--seq", "32",
                          "--batch", "2", "--vocab", "512", "--rebuild-every", "5",
                          "--weight-grad", weight_grad, "--quick", "--no-write"])
  (r,) = out["widths"]
  assert r["status"] == "ok", r.get("error")
  assert r["dense"]["tokens_per_s"] > 0 and r["sparse"]["tokens_per_s"] > 0
  assert math.isfinite(r["ratio"]) and r["ratio"] > 0
  # The ratio uses the dense step timed before any 2:4 step; its timing after
  # the 2:4 steps is reported beside it.
  d = r["dense"]
  assert r["ratio"] == pytest.approx(d["step_ms"] / r["sparse"]["step_ms"])
  assert d["step_ms_after_sparse"] > 0
  assert d["after_sparse"] == pytest.approx(d["step_ms_after_sparse"] / d["step_ms"] - 1)
  # One stacked mask per layer kind, leading axis = blocks (nn.scan).
  assert r["mask_shapes"] == {f"blocks/{kind}": [LAYERS, kin, kout] for kind, (kin, kout)
                              in bench_model.layer_shapes(128).items()}
  assert r["sparse"]["first_loss"] == pytest.approx(r["sparse"]["reference_loss"], rel=1e-2)
  b = r["breakdown"]
  assert set(b["layers"]) == {"qkv", "out", "up", "down"}
  assert b["compress_ms"] is None  # no GPU backend on CPU
  assert all(math.isfinite(b[key]) for key in ("ceiling_bound", "ceiling_measured",
                                               "mask_update_pct"))
  printed = capsys.readouterr().out
  assert printed.rstrip().splitlines()[-1].startswith("| 128 | 2 |")  # the summary table, last


def test_bench_model_data_parallel_on_cpu(capsys, monkeypatch):
  """--devices 2: the batch split over a 2-device mesh, params replicated on
  both, no breakdown (its parts are one-device programs). Two widths: every
  dense model is timed before the first 2:4 step runs (a process that has
  run a cuSPARSELt matmul runs dense GEMMs slower from then on), and the 2:4
  models without a cuSPARSELt product before those with one (here the
  automatic choice is made to report cuSPARSELt at d_model 128 only)."""
  real = bench_model.jsparse24.selected_implementation
  monkeypatch.setattr(
      bench_model.jsparse24, "selected_implementation",
      lambda x, w, dtype, **kw: "cusparselt" if w[0] in (128, 512) else real(x, w, dtype, **kw))
  out = bench_model.main(["--widths", "128,256", "--layers", "1", "--seq", "32",
                          "--batch", "4", "--vocab", "512", "--rebuild-every", "5",
                          "--devices", "2", "--quick", "--no-write"])
  assert [r["d_model"] for r in out["widths"]] == [128, 256]
  for r in out["widths"]:
    assert r["status"] == "ok", r.get("error")
    assert r["sparse"]["devices"] == 2 and r["sparse"]["batch_split"] == 2
    assert "breakdown" not in r and math.isfinite(r["ratio"]) and r["ratio"] > 0
    assert r["sparse"]["first_loss"] == pytest.approx(r["sparse"]["reference_loss"], rel=1e-2)
  assert out["config"]["devices"] == 2
  lines = capsys.readouterr().out.rstrip().splitlines()
  assert lines[-1].endswith("| n/a | n/a |")
  timed = [line for line in lines
           if line.endswith((" dense: timing", "2:4: timing (mask_update count pinned at 0: no"
                                              " rebuild)"))]
  assert [line.split(" 2:4")[0].split(" dense")[0] for line in timed] == [
      "[d_model 128]", "[d_model 256]", "[d_model 256]", "[d_model 128]"]
  assert [("2:4" in line) for line in timed] == [False, False, True, True]


def test_bench_model_rejects_more_devices_than_there_are():
  with pytest.raises(SystemExit):
    bench_model.main(["--widths", "128", "--layers", "1", "--devices", "1000", "--no-write"])


@pytest.mark.parametrize("policy", ["compressed", "dots", "dots-compressed"])
def test_bench_model_remat_policy_that_saves_something(capsys, policy):
  """--remat --remat-policy compressed (the 2:4 model's remat keeps its
  compressed weights, jsparse24.CHECKPOINT_NAME) or dots (the matmul
  outputs, jsparse24.checkpoint_policies): no breakdown (its parts would
  time a whole recomputed forward pass); the notes name the policy."""
  out = bench_model.main(["--widths", "128", "--layers", "1", "--seq", "32", "--batch", "2",
                          "--vocab", "512", "--rebuild-every", "5", "--remat",
                          "--remat-policy", policy, "--quick", "--no-write"])
  (r,) = out["widths"]
  assert r["status"] == "ok", r.get("error")
  assert r["remat"] and out["config"]["remat_policy"] == policy and "breakdown" not in r
  assert bench_model.POLICY_NOTES[policy] in bench_model.notes(out["config"])
  assert r["sparse"]["first_loss"] == pytest.approx(r["sparse"]["reference_loss"], rel=1e-2)
  assert capsys.readouterr().out.rstrip().splitlines()[-1].endswith("| n/a | n/a |")
