"""benchmarks/bench_model.py runs end to end on CPU at a tiny size: init under
nn.scan, sparsify, mask_update, the timed steps, the breakdown and the tables."""

import math
import types

import jax
import jax.numpy as jnp
import optax
import pytest

import jsparse24
from benchmarks import _common, _gpt, bench_model

LAYERS = 2


@pytest.fixture(autouse=True)
def no_cleanup_between_widths(monkeypatch):
  """`bench_model.attempt` collects garbage and clears JAX's caches after
  each width or placement, so that a GPU's next model finds the last one's
  buffers and programs freed (tests/test_bench_layouts.py imports this
  fixture for its placements). These tiny models free nothing that matters,
  and in a test process full of traced programs the collections cost CPU
  time (the --small test below makes 22: 2.9 s) while the cleared caches
  make every later call trace again what it had traced (this file: 61 s of
  CPU time instead of 66 s; 2026-11-27 on the 2-core CPU machine)."""
  monkeypatch.setattr(bench_model, "gc", types.SimpleNamespace(collect=lambda: 0))
  monkeypatch.setattr(bench_model.jax, "clear_caches", lambda: None)


@pytest.mark.parametrize("weight_grad,rebuilds,cusparselt",
                         [("dense", "host", False), ("mvue", "run-time flag", True)])
def test_bench_model_runs_on_cpu(capsys, monkeypatch, weight_grad, rebuilds, cusparselt):
  """Both weight gradients, and both ways of deciding a mask rebuild: the
  host's schedule (the default: one program with and one without the
  rebuild) and mask_update's run-time flag (--rebuild-flag, one program).
  The benchmark checks that the timed plain step rebuilt no mask and the
  timed rebuild step did. Both ways of timing the dense step the ratio
  uses: in turn with the 2:4 step (no cuSPARSELt product, as on a CPU) and
  before any 2:4 step (a row taken to run one)."""
  if cusparselt:
    monkeypatch.setattr(bench_model, "uses_cusparselt", lambda result: True)
  # The `at` each timed 2:4 step is fed through: the plain step runs as a
  # training loop runs it (no extra program per step) unless the count
  # decides its rebuild (--rebuild-flag); the rebuild step is pinned.
  threaded, pins = bench_model._common.threaded, []
  def recording(step, params, opt_state, at=None):
    if isinstance(opt_state, tuple) and hasattr(opt_state[0], "last_rebuild"):
      pins.append(None if at is None else at.keywords["count"])
    return threaded(step, params, opt_state, at)
  monkeypatch.setattr(bench_model._common, "threaded", recording)
  out = bench_model.main(["--widths", "128", "--layers", str(LAYERS), "--seq", "32",
                          "--batch", "2", "--vocab", "512", "--rebuild-every", "5",
                          "--weight-grad", weight_grad, "--quick", "--no-write"]
                         + (["--rebuild-flag"] if rebuilds == "run-time flag" else []))
  (r,) = out["widths"]
  assert r["status"] == "ok", r.get("error")
  assert r["sparse"]["rebuilds"] == rebuilds
  # The plain step, the rebuild step (count R - 1), mask_update + AdamW alone.
  assert pins == [0 if rebuilds == "run-time flag" else None, 4, 0]
  assert r["dense"]["tokens_per_s"] > 0 and r["sparse"]["tokens_per_s"] > 0
  assert math.isfinite(r["ratio"]) and r["ratio"] > 0
  # With a cuSPARSELt product the ratio uses the dense step timed before any
  # 2:4 step, its timing after them reported beside it; without, the dense
  # step timed in turn with the 2:4 one, which is its timing after them.
  d, sp = r["dense"], r["sparse"]
  assert r["ratio_dense"] == ("first" if cusparselt else "in turn")
  assert ("step_ms_in_turn" in d) == (not cusparselt)
  ratio_ms = d["step_ms"] if cusparselt else d["step_ms_in_turn"]
  assert r["ratio"] == pytest.approx(ratio_ms / sp["step_ms"])
  assert r["ratio_with_rebuilds"] == pytest.approx(
      ratio_ms / (sp["step_ms"] + sp["rebuild_extra_ms_per_step"]))
  if not cusparselt:
    assert d["step_ms_after_sparse"] == d["step_ms_in_turn"]
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


def test_bench_model_data_parallel_on_cpu(capsys):
  """--devices 2: the batch split over a 2-device mesh, params replicated on
  both, no breakdown (its parts are one-device programs); the dense model
  timed before the 2:4 one (the order over several widths:
  `test_bench_model_times_every_dense_model_first`)."""
  out = bench_model.main(["--widths", "128", "--layers", "1", "--seq", "32",
                          "--batch", "4", "--vocab", "512", "--rebuild-every", "5",
                          "--devices", "2", "--quick", "--no-write"])
  (r,) = out["widths"]
  assert r["status"] == "ok", r.get("error")
  assert r["sparse"]["devices"] == 2 and r["sparse"]["batch_split"] == 2
  assert "breakdown" not in r and math.isfinite(r["ratio"]) and r["ratio"] > 0
  assert r["sparse"]["first_loss"] == pytest.approx(r["sparse"]["reference_loss"], rel=1e-2)
  assert out["config"]["devices"] == 2
  lines = capsys.readouterr().out.rstrip().splitlines()
  assert lines[-1].endswith("| n/a | n/a |")
  timed = [line for line in lines
           if line.endswith((" dense: timing", "2:4: timing (no rebuild)"))]
  assert [line.split(" 2:4")[0].split(" dense")[0] for line in timed] == ["[d_model 128]"] * 2
  assert [("2:4" in line) for line in timed] == [False, True]


def test_bench_model_times_every_dense_model_first(monkeypatch):
  """Two widths over 2 devices, each model's timing replaced by a fake (the
  test above runs the real ones): every dense model is timed before the
  first 2:4 step runs (a process that has run a cuSPARSELt matmul runs
  dense GEMMs slower from then on), and the 2:4 models without a cuSPARSELt
  product before those with one (here the automatic choice is made to report
  cuSPARSELt at d_model 128 only)."""
  real = bench_model.jsparse24.selected_implementation
  monkeypatch.setattr(
      bench_model.jsparse24, "selected_implementation",
      lambda x, w, dtype, **kw: "cusparselt" if w[0] in (128, 512) else real(x, w, dtype, **kw))
  calls = []

  def fake_dense(cfg, timer, result, ctx, step_timer=None):
    del cfg, timer, ctx, step_timer
    calls.append(("dense", result["d_model"]))
    result["dense"] = {"step_ms": 1.0, "tokens_per_s": 1e6}

  def fake_sparse(cfg, timer, result, ctx, step_timer=None):
    del cfg, timer, ctx, step_timer
    calls.append(("2:4", result["d_model"]))
    result["sparse"] = {"step_ms": 2.0, "tokens_per_s": 5e5}

  monkeypatch.setattr(bench_model, "run_dense", fake_dense)
  monkeypatch.setattr(bench_model, "run_sparse", fake_sparse)
  out = bench_model.main(["--widths", "128,256", "--layers", "1", "--seq", "32",
                          "--batch", "4", "--vocab", "512", "--devices", "2", "--quick",
                          "--no-write"])
  assert [r["d_model"] for r in out["widths"]] == [128, 256]
  assert [r["implementations"]["up"] for r in out["widths"]] == ["cusparselt", "xla"]
  assert calls == [("dense", 128), ("dense", 256), ("2:4", 256), ("2:4", 128)]


def test_bench_model_rejects_more_devices_than_there_are():
  with pytest.raises(SystemExit):
    bench_model.main(["--widths", "128", "--layers", "1", "--devices", "1000", "--no-write"])


@pytest.mark.parametrize("policy", ["dots-compressed"])
def test_bench_model_remat_policy_that_saves_something(capsys, policy):
  """--remat --remat-policy dots-compressed (the 2:4 model's remat keeps
  its compressed weights, jsparse24.CHECKPOINT_NAME, and the matmul
  outputs, jsparse24.checkpoint_policies): no breakdown (its parts would
  time a whole recomputed forward pass); the notes name the policy. The
  other policies are the same lookup in `_gpt.REMAT_POLICIES`: what each
  saves is tests/test_stacked.py's."""
  out = bench_model.main(["--widths", "128", "--layers", "1", "--seq", "32", "--batch", "2",
                          "--vocab", "512", "--rebuild-every", "5", "--remat",
                          "--remat-policy", policy, "--quick", "--no-write"])
  (r,) = out["widths"]
  assert r["status"] == "ok", r.get("error")
  assert r["remat"] and out["config"]["remat_policy"] == policy and "breakdown" not in r
  assert bench_model.POLICY_NOTES[policy] in bench_model.notes(out["config"])
  assert r["sparse"]["first_loss"] == pytest.approx(r["sparse"]["reference_loss"], rel=1e-2)
  assert capsys.readouterr().out.rstrip().splitlines()[-1].endswith("| n/a | n/a |")


def test_bench_model_small_rows_are_the_small_end_and_the_examples_defaults():
  """--small: d_model 128 and 256 at 1k-4k tokens per step, and the shapes of
  the examples' defaults, read from train_lm's presets (one of the small end's
  rows is train_lm's CPU preset)."""
  rows, vocab = bench_model.small_rows()
  from examples import train_lm as lm  # pylint: disable=g-import-not-at-top
  assert vocab == lm.VOCAB == 256
  assert all(r["layers"] == 2 for r in rows)
  small_end = [r for r in rows if r["d_model"] in (128, 256)]
  assert sorted((r["d_model"], r["batch"] * r["seq"]) for r in small_end) == [
      (d, t) for d in (128, 256) for t in (1024, 2048, 4096)]
  shape = lambda r: (r["d_model"], r["layers"], r["batch"], r["seq"])  # noqa: E731
  cpu = [r for r in rows if r["label"] == "train_lm's CPU default (--size small)"]
  small = lm.PRESETS["small"]
  assert [shape(r) for r in cpu] == [(small["d_model"], small["layers"], small["batch"],
                                      small["seq_len"])]
  gpu = lm.PRESETS[lm.DEFAULT_SIZES["gpu"]]
  assert [shape(r) for r in rows[len(small_end):]] == [
      (gpu["d_model"], gpu["layers"], batch, gpu["seq_len"])
      for batch in (gpu["batch"], gpu["batch"] // bench_model.SHARDED_GPUS)]
  assert rows[-2]["label"] == "train_lm's GPU default (--size gpu)"
  assert rows[-1]["label"] == "sharded_train's GPU default (--size gpu), the rows of 1 of 4 GPUs"


def test_in_turn_alternates_the_runs_and_keeps_each_ones_fastest_round(monkeypatch):
  """`_common.in_turn`: the runs timed one after another in every round, each
  run's figure its fastest round (drift only slows a round)."""
  order = []
  fake = {"dense": iter([3.0, 1.0, 2.0]), "2:4": iter([5.0, 6.0, 4.0])}

  def bench(run, *args, min_time, repeats):
    assert args == ("tokens",) and min_time == 1.0 and repeats == 1
    order.append(run)
    return next(fake[run])

  monkeypatch.setattr(_common, "bench", bench)
  times = _common.in_turn({"dense": "dense", "2:4": "2:4"}, "tokens", rounds=3)
  assert order == ["dense", "2:4"] * 3
  assert times == {"dense": 1.0, "2:4": 4.0}


def test_bench_model_small_times_each_row_at_its_own_tokens(capsys, monkeypatch):
  """--small through main(), each model's timing replaced by a fake (the tests
  above run the real ones): every row is set up at its own batch x seq
  (rows share a width) on the examples' vocabulary, every dense model runs
  before any 2:4 one, and the tables say each row's shape and label."""
  calls = []

  def fake_dense(cfg, timer, result, ctx, step_timer=None):
    del timer, step_timer
    calls.append(("dense", result["d_model"], tuple(ctx["tokens"].shape), cfg["vocab"]))
    ms = 1e-3 * cfg["batch"] * cfg["seq"]
    result["dense"] = {"step_ms": ms, "tokens_per_s": 1e6, "step_ms_after_sparse": ms,
                       "after_sparse": 0.0}

  def fake_sparse(cfg, timer, result, ctx, step_timer=None):
    del timer, step_timer
    calls.append(("2:4", result["d_model"], tuple(ctx["tokens"].shape), cfg["vocab"]))
    ms = 2e-3 * cfg["batch"] * cfg["seq"]
    result["sparse"] = {"step_ms": ms, "tokens_per_s": 5e5, "rebuild_step_ms": ms,
                        "rebuild_extra_ms_per_step": 0.0}
    result["ratio"] = result["ratio_with_rebuilds"] = result["dense"]["step_ms"] / ms

  monkeypatch.setattr(bench_model, "run_dense", fake_dense)
  monkeypatch.setattr(bench_model, "run_sparse", fake_sparse)
  out = bench_model.main(["--small", "--quick", "--no-write"])
  rows, _ = bench_model.small_rows()
  want = [(r["d_model"], (r["batch"], r["seq"] + 1), 256) for r in rows]
  assert [c[1:] for c in calls] == want + want  # on CPU no row has a cuSPARSELt product
  assert [c[0] for c in calls] == ["dense"] * len(rows) + ["2:4"] * len(rows)
  assert [(r["d_model"], r["batch"], r["seq"], r["remat"]) for r in out["widths"]] == [
      (r["d_model"], r["batch"], r["seq"], False) for r in rows]
  assert all(r["status"] == "ok" and r["ratio"] == 0.5 for r in out["widths"])
  assert out["config"]["small"] and out["config"]["vocab"] == 256
  lines = capsys.readouterr().out.rstrip().splitlines()
  assert lines[-len(rows) - 2].startswith("| row | d_model | blocks | tokens per step")
  assert lines[-len(rows)].startswith("| train_lm's CPU default (--size small) | 128 | 2 | 16x64 |")
  assert lines[-1].startswith("| sharded_train's GPU default (--size gpu), the rows of 1 of 4"
                              " GPUs | 4096 | 2 | 8x512 |")
  # --widths picks rows of --small; its rows' shapes cannot be changed.
  calls.clear()
  bench_model.main(["--small", "--widths", "256", "--quick", "--no-write"])
  assert [c[1:3] for c in calls if c[0] == "dense"] == [(256, (b, 65)) for b in (16, 32, 64)]
  for flags in (["--batch", "4"], ["--widths", "512"]):
    with pytest.raises(SystemExit):
      bench_model.main(["--small", *flags, "--no-write"])


def test_pinning_the_count_copies_nothing_from_the_host():
  """`_gpt.at_count` sets mask_update's count from the device's own count: a
  count copied from the host before every timed 2:4 step would wait, on a
  GPU, for the steps queued before it, and time the 2:4 steps one at a time
  against queued dense steps. The new count takes the old one's buffer, as
  a training step's count does."""
  layer = jsparse24.SparseDense(4)
  variables = layer.init(jax.random.key(0), jnp.ones((1, 8)))
  tx = optax.chain(jsparse24.optim.mask_update(variables["sparsity"]), optax.sgd(0.1))
  state = jax.jit(tx.init)(variables["params"])
  address = state[0].count.unsafe_buffer_pointer()
  with jax.transfer_guard("disallow"):
    pinned = _gpt.at_count(state, 7)
  assert int(pinned[0].count) == 7 and pinned[0].count.dtype == state[0].count.dtype
  assert pinned[0].count.unsafe_buffer_pointer() == address
  assert pinned[1:] == state[1:] and pinned[0].masks is state[0].masks


def test_attention_choice_is_cudnn_on_a_gpu_unless_told(monkeypatch):
  # One mapping of --attention for bench_model and bench_decode: auto is
  # cuDNN on a GPU (not for bench_model --small), XLA's elsewhere.
  pick = _common.attention_implementation
  assert [pick("auto"), pick("cudnn"), pick("xla")] == [None, "cudnn", "xla"]
  monkeypatch.setattr(_common.jax, "default_backend", lambda: "gpu")
  assert pick("auto") == "cudnn" and pick("auto", cudnn_on_gpu=False) is None
  assert pick("xla") == "xla"
