"""benchmarks/bench_model.py --layouts on 4 fake CPU devices (of
tests/conftest.py's 8): every layout's dense and 2:4 models compute the
first-step loss of the same model on one device, and their state lies in
the layout's shardings; the harness runs every placement and derives the
ratios and the scaling from one device."""

import functools

import jax
import jax.numpy as jnp
import pytest

from benchmarks import _common, bench_model
# bench_model.attempt's gc and cache clearing skipped here too (autouse).
from tests.test_bench_model import no_cleanup_between_widths  # noqa: F401  pylint: disable=unused-import

D, LAYERS, SEQ, BATCH, VOCAB = 128, 1, 16, 4, 256
ARGS = ["--widths", str(D), "--layers", str(LAYERS), "--seq", str(SEQ), "--batch", str(BATCH),
        "--vocab", str(VOCAB), "--rebuild-every", "5", "--devices", "4", "--quick",
        "--no-write"]
CFG = {"widths": [D], "seq": SEQ, "batch": BATCH, "vocab": VOCAB, "rebuild_every": 5,
       "rebuild_flag": False,
       "attention": None, "mask": "plain", "weight_grad": "dense", "devices": 4,
       "remat_policy": "nothing", "layouts": [], "model_devices": None}
TOLERANCE = 5e-4  # relative, of a first-step loss against one device's
H = 4 * D
# Plain masks: the layouts lay out every mask kind alike (packed [N, K/8]),
# and the transposable kind's pruning takes 40% more of the 2:4 placement's
# CPU time to compile.
# Device 0's block of each array, per layout on 4 devices: data parallel holds
# everything whole; FSDP splits every last axis over 4; tp (1 x 4) splits the
# block's kernels (qkv and up on their outputs, out and down on their inputs)
# and their AdamW moments and masks (packed [N, K/8]) alike, nothing else; 2d
# (2 x 2) splits them over model on one axis and over data on the other, the
# rest over data.
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
    "tp": {**WHOLE, "params/blocks/qkv/kernel": [LAYERS, D, 3 * D // 4],
           "params/blocks/up/kernel": [LAYERS, D, H // 4],
           "params/blocks/down/kernel": [LAYERS, H // 4, D],
           "adamw_mu/blocks/up/kernel": [LAYERS, D, H // 4],
           "mask/blocks/up": [LAYERS, H // 4, D // 8]},
    "2d": {**WHOLE, "params/blocks/qkv/kernel": [LAYERS, D // 2, 3 * D // 2],
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


# The dense model in 2d alone: its shardings are the 2:4 model's less the
# masks, and 2d takes the axes of fsdp and tp (data's: the batch split).
@pytest.mark.parametrize("layout,model", [
    ("2d", "dense"),
    *((layout, "2:4") for layout in ("data", "fsdp", "tp", "2d"))])
def test_layout_computes_the_one_device_loss_in_its_shardings(width, layout, model):
  timer = functools.partial(_common.bench, min_time=0.0, repeats=1)
  one, out = width["one_device_losses"], {}
  bench_model.time_placement(CFG, timer, width, bench_model.make_layout(
      layout, jax.local_devices()[:4], None), BATCH, model == "2:4", out)
  # The same model on one device, same tokens: equal to the rounding of
  # another order of bf16 sums (up to 1.7e-4 relative, in 2d). The masks prune
  # half the weights: the dense and 2:4 losses lie 5 tolerances apart, so a
  # model that ran unmasked would fail.
  assert abs(one["dense"] - one["2:4"]) > 5 * TOLERANCE * one["dense"]
  assert out["first_loss"] == pytest.approx(one[model], rel=TOLERANCE), (out, one)
  assert out["devices"] == 4 and out["step_ms"] > 0
  want = {k: v for k, v in BLOCKS[layout].items() if model == "2:4" or not k.startswith("mask/")}
  assert out["shards"] == want  # after the timed steps: the step's out_shardings kept them


@pytest.mark.parametrize("layout", ["data", "fsdp", "tp", "2d"])
def test_the_head_runs_on_each_devices_own_rows(width, layout):
  """Every layout splits the logits [batch, seq, vocab] by rows over the 4
  devices: data and fsdp by the batch sharding, tp (1 x 4) and 2d (2 x 2)
  through `logits_sharding`, without which each device of the model axis
  would multiply the output head on every row of its data shard."""
  place = bench_model.make_layout(layout, jax.local_devices()[:4], None)
  model, sample = width["model"], jnp.zeros((1, SEQ), jnp.int32)
  params = jax.jit(model.init, out_shardings=place.state_shardings(
      jax.eval_shape(model.init, width["key_init"], sample)))(width["key_init"], sample)["params"]
  tokens = jax.device_put(width["tokens"][:BATCH, :-1], place.batch_sharding)
  apply = bench_model.make_apply(CFG, model, place, ())
  logits = jax.jit(apply).lower(params, None, tokens).compile().output_shardings
  assert logits.shard_shape((BATCH, SEQ, VOCAB)) == (BATCH // 4, SEQ, VOCAB)


def test_layouts_harness_runs_every_placement_and_derives_its_table(capsys, monkeypatch):
  """main() with every layout, each placement's timing replaced by a fake
  one (the test above runs the real one): the one-device placement gets
  --batch / --devices rows and the layouts --batch on 4 devices, every dense
  placement runs before any 2:4 one, and the ratios, scalings and the table
  follow from the timings."""
  calls = []
  ms = {"dense": {bench_model.ONE_GPU: 10.0, "data": 12.0, "fsdp": 13.0, "tp": 16.0, "2d": 14.0},
        "2:4": {bench_model.ONE_GPU: 8.0, "data": 10.0, "fsdp": 10.0, "tp": 16.0, "2d": 12.0}}

  def fake(cfg, step_timer, ctx, layout, batch, sparse, out):
    del cfg, step_timer, ctx
    model = "2:4" if sparse else "dense"
    name = bench_model.ONE_GPU if layout.mesh.size == 1 else layout.name
    calls.append((model, name, dict(layout.mesh.shape), batch))
    out.update(step_ms=ms[model][name], tokens_per_s=batch * SEQ / ms[model][name] * 1e3,
               first_loss=5.0, compile_s=1.0,
               shards={f"params/blocks/{k}/kernel": [] for k in ("up", "down")})

  monkeypatch.setattr(bench_model, "time_placement", fake)
  monkeypatch.setattr(bench_model, "one_device_losses", lambda cfg, ctx: {})
  out = bench_model.main(ARGS + ["--layouts", "data,fsdp,tp,2d"])
  meshes = {bench_model.ONE_GPU: {"data": 1}, "data": {"data": 4}, "fsdp": {"data": 4},
            "tp": {"data": 1, "model": 4}, "2d": {"data": 2, "model": 2}}
  assert calls == [(model, name, meshes[name], 1 if name == bench_model.ONE_GPU else BATCH)
                   for model in ("dense", "2:4") for name in meshes]
  (r,) = out["widths"]
  assert r["status"] == "ok", r.get("error")
  tp = r["layouts"]["tp"]
  assert tp["ratio"] == pytest.approx(1.0)
  assert tp["scaling_dense"] == pytest.approx(4 * 10 / 16)
  assert tp["scaling_2:4"] == pytest.approx(4 * 8 / 16)
  assert tp["scaling_gap"] == pytest.approx(0.8 - 1)
  assert r["layouts"]["fsdp"]["ratio"] == pytest.approx(1.3)
  lines = capsys.readouterr().out.rstrip().splitlines()
  assert lines[-5].startswith(f"| {bench_model.ONE_GPU} | 1 | {BATCH // 4}x{SEQ} | 10 | 8 | 1.25 |")
  assert lines[-2] == f"| tp | 1 x 4 | {BATCH}x{SEQ} | 16 | 16 | 1 | 2.5 | 2 | -20.0% |"


@pytest.mark.parametrize("argv,message", [
    (["--layouts", "pp"], "--layouts: unknown ['pp']"),
    (["--layouts", "data", "--model-devices", "2"], "--model-devices applies to --layouts tp"),
    (["--layouts", "tp", "--model-devices", "3"], "model_devices=3 must divide the 4 devices"),
])
def test_layouts_flag_errors(capsys, argv, message):
  with pytest.raises(SystemExit):
    bench_model.main(ARGS + argv)
  assert message in capsys.readouterr().err
