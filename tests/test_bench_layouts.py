"""benchmarks/bench_model.py --layouts on 4 fake CPU devices (of
tests/conftest.py's 8): every layout's dense and 2:4 models compute the
first-step loss of the same model on one device, and their state lies in
the layout's shardings; the harness prints its table with the scaling from
one device."""

import functools
import math

import jax
import pytest

from benchmarks import _common, bench_model

D, LAYERS, SEQ, BATCH, VOCAB = 128, 1, 16, 4, 256
ARGS = ["--widths", str(D), "--layers", str(LAYERS), "--seq", str(SEQ), "--batch", str(BATCH),
        "--vocab", str(VOCAB), "--rebuild-every", "5", "--devices", "4", "--quick",
        "--no-write"]
CFG = {"widths": [D], "seq": SEQ, "batch": BATCH, "vocab": VOCAB, "rebuild_every": 5,
       "attention": None, "mask": "default", "weight_grad": "dense", "devices": 4,
       "remat_policy": "nothing", "layouts": [], "model_devices": None}
H = 4 * D
# Device 0's block of each array, per layout on 4 devices: data parallel holds
# everything whole; FSDP splits every last axis over 4; tp (1 x 4) splits the
# MLP kernels (up on its outputs, down on its inputs) and their AdamW moments
# and masks (packed [N, K/8]) alike, nothing else; 2d (2 x 2) splits the MLP
# kernels over model on one axis and over data on the other, the rest over
# data.
WHOLE = {"params/blocks/qkv/kernel": [LAYERS, D, 3 * D], "params/blocks/up/kernel": [LAYERS, D, H],
         "params/blocks/down/kernel": [LAYERS, H, D], "params/embed/embedding": [VOCAB, D],
         "adamw_mu/blocks/up/kernel": [LAYERS, D, H], "mask/blocks/up": [LAYERS, H, D // 8]}
BLOCKS = {
    "data": WHOLE,
    "fsdp": {**WHOLE, "params/blocks/qkv/kernel": [LAYERS, D, 3 * D // 4],
             "params/blocks/up/kernel": [LAYERS, D, H // 4],
             "params/blocks/down/kernel": [LAYERS, H, D // 4],
             "params/embed/embedding": [VOCAB, D // 4],
             "adamw_mu/blocks/up/kernel": [LAYERS, D, H // 4],
             "mask/blocks/up": [LAYERS, H // 4, D // 8]},
    "tp": {**WHOLE, "params/blocks/up/kernel": [LAYERS, D, H // 4],
           "params/blocks/down/kernel": [LAYERS, H // 4, D],
           "adamw_mu/blocks/up/kernel": [LAYERS, D, H // 4],
           "mask/blocks/up": [LAYERS, H // 4, D // 8]},
    "2d": {**WHOLE, "params/blocks/qkv/kernel": [LAYERS, D, 3 * D // 2],
           "params/blocks/up/kernel": [LAYERS, D // 2, H // 2],
           "params/blocks/down/kernel": [LAYERS, H // 2, D // 2],
           "params/embed/embedding": [VOCAB, D // 2],
           "adamw_mu/blocks/up/kernel": [LAYERS, D // 2, H // 2],
           "mask/blocks/up": [LAYERS, H // 2, D // 16]},
}


@pytest.fixture(scope="module")
def width():
  """The model, its tokens and its one-device losses, shared by the layouts."""
  result = {"d_model": D, "layers": LAYERS, "remat": False}
  ctx = bench_model.setup_width(CFG, result)
  ctx["one_device_losses"] = bench_model.one_device_losses(CFG, ctx)
  return ctx


@pytest.mark.parametrize("layout", ["data", "fsdp", "tp", "2d"])
def test_layout_computes_the_one_device_loss_in_its_shardings(width, layout):
  timer = functools.partial(_common.bench, min_time=0.0, repeats=1)
  one = width["one_device_losses"]
  for sparse, name in ((False, "dense"), (True, "2:4")):
    out = {}
    bench_model.time_placement(CFG, timer, width, bench_model.make_layout(
        layout, jax.local_devices()[:4], None), BATCH, sparse, out)
    # The same model on one device, same tokens: equal to bf16 rounding
    # (a lost all-reduce of tp's row-parallel products moves it by far more).
    assert out["first_loss"] == pytest.approx(one[name], rel=2e-3), (name, out, one)
    assert out["devices"] == 4 and out["step_ms"] > 0
    want = {k: v for k, v in BLOCKS[layout].items() if sparse or not k.startswith("mask/")}
    assert out["shards"] == want, name  # after the timed steps: out_shardings kept them
  # Dense and 2:4 differ (the masks prune half the weights): the check can fail.
  assert abs(one["dense"] - one["2:4"]) > 1e-3


def test_layouts_harness_prints_the_table_with_one_device_scaling(capsys):
  """End to end through main(): the 1-device placement at --batch / --devices
  rows and the 2d layout (tensor parallel and FSDP together), each with its
  ratio and scaling, one table row each."""
  out = bench_model.main(ARGS + ["--layouts", "2d"])
  (r,) = out["widths"]
  assert r["status"] == "ok", r.get("error")
  assert list(r["layouts"]) == [bench_model.ONE_GPU, "2d"]
  one, two_d = r["layouts"][bench_model.ONE_GPU], r["layouts"]["2d"]
  for name in ("dense", "2:4"):
    assert one[name]["status"] == two_d[name]["status"] == "ok"
    assert "reference_loss" not in one[name]  # a quarter of the batch: not comparable
    assert two_d[name]["first_loss"] == pytest.approx(two_d[name]["reference_loss"], rel=2e-3)
    assert two_d[f"scaling_{name}"] == pytest.approx(
        4 * one[name]["step_ms"] / two_d[name]["step_ms"])
  assert two_d["ratio"] == pytest.approx(two_d["dense"]["step_ms"] / two_d["2:4"]["step_ms"])
  assert math.isfinite(two_d["scaling_gap"]) and "scaling_dense" not in one
  lines = capsys.readouterr().out.rstrip().splitlines()
  assert lines[-2].startswith(f"| {bench_model.ONE_GPU} | 1 | {BATCH // 4}x{SEQ} |")
  assert lines[-1].startswith(f"| 2d | 2 x 2 | {BATCH}x{SEQ} |")


@pytest.mark.parametrize("argv,message", [
    (["--layouts", "pp"], "--layouts: unknown ['pp']"),
    (["--layouts", "data", "--model-devices", "2"], "--model-devices applies to --layouts tp"),
    (["--layouts", "tp", "--model-devices", "3"], "model_devices=3 must divide the 4 devices"),
])
def test_layouts_flag_errors(capsys, argv, message):
  with pytest.raises(SystemExit):
    bench_model.main(ARGS + argv)
  assert message in capsys.readouterr().err
