"""benchmarks/bench_auto.py on CPU: the dense and xla steps of every point are
timed before the first cuSPARSELt step of the run (a process that has run a
cuSPARSELt product runs cuBLAS's GEMMs slower from then on). cuSPARSELt is
stood in for by the xla step, so the whole sweep runs here."""

import json

from benchmarks import bench_auto


def test_dense_and_xla_are_timed_before_any_cusparselt_step(monkeypatch, tmp_path):
  order = []
  real_round_robin, real_step = bench_auto._round_robin, bench_auto._step
  real_available = bench_auto.jsparse24.available_implementations

  def round_robin(calls, opts):
    order.extend(calls)
    return real_round_robin(calls, opts)

  monkeypatch.setattr(bench_auto, "_round_robin", round_robin)
  monkeypatch.setattr(bench_auto, "_step",
                      lambda impl: real_step("xla" if impl == "cusparselt" else impl))
  monkeypatch.setattr(bench_auto.jsparse24, "available_implementations",
                      lambda: {**real_available(), "cusparselt": None})
  out = tmp_path / "auto.json"
  bench_auto.main(["--kn", "64,128", "--ms", "64,128", "--no-write", "--repeats", "1",
                   "--min-time", "0", "--json", str(out)])
  first = order.index("cusparselt plain")
  assert order[:first] == ["dense", "xla"] * 8
  assert order[first:] == ["cusparselt plain", "cusparselt transposable"] * 8
  points = json.loads(out.read_text())["points"]
  assert len(points) == 8 and all(bench_auto._complete(r) for r in points)
  # Checked against xla at the first M of each (K, N), both mask kinds.
  errs = [r["err"] for r in points if "err" in r]
  assert len(errs) == 4 and all(set(e) == {"plain", "transposable"} for e in errs)
  assert all(v == 0 for e in errs for v in e.values())


def test_a_resumed_sweep_reports_the_rule_as_it_is_now(monkeypatch, tmp_path):
  # A sweep resumed with nothing left to measure only reports: the "auto"
  # columns name what implementation=None picks now (not what it picked when
  # the point was measured), and the report adds no run to the list of runs.
  real_step = bench_auto._step
  real_available = bench_auto.jsparse24.available_implementations
  monkeypatch.setattr(bench_auto, "_step",
                      lambda impl: real_step("xla" if impl == "cusparselt" else impl))
  monkeypatch.setattr(bench_auto.jsparse24, "available_implementations",
                      lambda: {**real_available(), "cusparselt": None})
  args = ["--kn", "64", "--ms", "64", "--no-write", "--repeats", "1", "--min-time", "0"]
  first = tmp_path / "first.json"
  bench_auto.main(args + ["--json", str(first)])
  state = json.loads(first.read_text())
  assert len(state["runs"]) == 1
  for rec in state["points"]:
    rec["auto"] = {"plain": "stale", "transposable": "stale"}
  first.write_text(json.dumps(state))
  monkeypatch.setattr(bench_auto, "_measure", lambda *a, **k: 1 / 0)  # nothing to measure
  again = tmp_path / "again.json"
  bench_auto.main(args + ["--resume", str(first), "--json", str(again)])
  state = json.loads(again.read_text())
  assert len(state["runs"]) == 1
  assert [r["auto"] for r in state["points"]] == [{"plain": "xla", "transposable": "xla"}]
