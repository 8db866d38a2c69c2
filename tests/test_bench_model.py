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
  # The dense step is timed before and after the 2:4 one; the ratio uses the mean.
  d = r["dense"]
  assert d["step_ms"] == pytest.approx((d["step_ms_before"] + d["step_ms_after"]) / 2)
  assert r["ratio"] == pytest.approx(d["step_ms"] / r["sparse"]["step_ms"])
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


def test_bench_model_data_parallel_on_cpu(capsys):
  """--devices 2: the batch split over a 2-device mesh, params replicated on
  both, no breakdown (its parts are one-device programs)."""
  out = bench_model.main(["--widths", "128", "--layers", str(LAYERS), "--seq", "32",
                          "--batch", "4", "--vocab", "512", "--rebuild-every", "5",
                          "--devices", "2", "--quick", "--no-write"])
  (r,) = out["widths"]
  assert r["status"] == "ok", r.get("error")
  assert out["config"]["devices"] == 2
  assert r["sparse"]["devices"] == 2 and r["sparse"]["batch_split"] == 2
  assert "breakdown" not in r and math.isfinite(r["ratio"]) and r["ratio"] > 0
  assert r["sparse"]["first_loss"] == pytest.approx(r["sparse"]["reference_loss"], rel=1e-2)
  assert capsys.readouterr().out.rstrip().splitlines()[-1].endswith("| n/a | n/a |")


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
