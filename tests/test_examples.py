"""The user-facing examples run end to end (tiny settings) and do what they say.

`examples/` is not a package: each script is imported from its path, with
the folder on `sys.path`, as Python puts it there for a script run from it
(generate.py and sharded_train.py `import train_lm`).
"""

import contextlib
import functools
import importlib.util
import io
import math
import os
import pathlib
import re
import shutil
import sys
import types
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse24

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"

TINY_LM = ["--steps", "30", "--eval-every", "15", "--d-model", "32", "--layers", "1",
           "--heads", "2", "--seq-len", "32", "--batch", "8", "--eval-batches", "2",
           "--lr", "1e-2"]


def load_example(name: str):
  if str(EXAMPLES) not in sys.path:
    sys.path.append(str(EXAMPLES))
  spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses (Flax modules) look their module up
  spec.loader.exec_module(module)
  return module


def sparse_layers_of(sparsity: dict) -> dict[str, dict]:
  """`{"block_0/mlp/up": {"mask": ..., "active": ...}, ...}` of a "sparsity" tree."""
  return {"/".join(path): layer for path, layer in jsparse24.linen.layers_by_path(sparsity).items()}


def at_path(tree: dict, path: str):
  for key in path.split("/"):
    tree = tree[key]
  return tree


def assert_masks_are_24(params: dict, sparsity: dict) -> list[str]:
  """Every sparse layer's mask keeps 2 of 4 along the kernel's input axis, and
  the compressed kernel is exactly `kernel * mask`. Returns the layer paths."""
  layers = sparse_layers_of(sparsity)
  compressed = jsparse24.compress_params(params, sparsity)
  for path, layer in layers.items():
    kernel = at_path(params, path)["kernel"]
    mask = layer["mask"].unpack()
    assert mask.shape == kernel.shape, path
    assert bool(jsparse24.is_24(mask, axis=0)), path
    assert float(mask.mean()) == 0.5, path
    np.testing.assert_array_equal(
        jsparse24.decompress(at_path(compressed, path)["kernel"]), jnp.where(mask, kernel, 0))
  return sorted(layers)


@pytest.fixture(scope="module")
def train_lm(tmp_path_factory):
  """The example's module, its output folder (with `stdout.txt`, what it
  printed) and its result."""
  out = tmp_path_factory.mktemp("train_lm")
  module = load_example("train_lm")
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    result = module.main(TINY_LM + ["--out", str(out)])
  (out / "stdout.txt").write_text(printed.getvalue())
  return module, out, result


def test_train_lm_learns_dense_and_sparse(train_lm):
  _, _, result = train_lm
  assert result["eval_steps"] == [15, 30]
  for run in ("dense", "sparse"):
    val = result[f"val_losses_{run}"]
    assert all(math.isfinite(v) for v in val), (run, val)
    assert math.isfinite(result[f"final_train_loss_{run}"]), run
    assert val[-1] < val[0], (run, val)
    assert val[-1] < math.log(256) - 1.0, (run, val)  # well below chance
  assert result["final_val_loss_sparse"] < result["final_val_loss_dense"] + 0.5
  for run in ("dense", "2:4"):  # the throughput the report prints
    assert result["tokens_per_s"][run] > 0, result["tokens_per_s"]
    assert result["tokens_per_s_sparse_steps"][run] > 0, result["tokens_per_s_sparse_steps"]


def test_train_lm_reports_no_speed_up_where_no_sparse_kernel_ran(train_lm):
  # On a CPU every 2:4 layer runs the masked dense reference: a tokens/s
  # ratio between the runs would be noise presented as a speed-up.
  _, out, result = train_lm
  assert set(result["sparse_layer_backends"].values()) == {"xla"}, result["sparse_layer_backends"]
  printed = (out / "stdout.txt").read_text()
  assert "2:4 / dense tokens/s: no speed-up to report. No 2:4 kernel ran" in printed
  assert not re.search(r"2:4 / dense tokens/s.*\d\.\d{3}x", printed), printed
  assert ("sess" "ion") not in printed.lower()  # runs and steps, no diary words


def test_train_lm_says_why_no_2_4_kernel_ran_where_it_runs(monkeypatch):
  module = load_example("train_lm")
  args = module.parse_args(["--d-model", "32"])
  assert "the gpu preset (the default there)" in module.why_no_kernel(args)
  monkeypatch.setattr(module.jax, "default_backend", lambda: "gpu")
  assert "measured no 2:4 kernel faster than XLA on this GPU" in module.why_no_kernel(args)
  args = module.parse_args(["--d-model", "32", "--ffn-activation", "relu2",
                            "--sparse-activations", "masked"])
  assert "took XLA's masked products for the 2:4 activations" in module.why_no_kernel(args)


def test_train_lm_reports_the_backend_the_choice_gives_a_pruned_activation(monkeypatch):
  """mlp/down's backend with --sparse-activations is the automatic choice's
  answer for a pruned activation (`selected_implementation(...,
  pruned_activations=True)`), not written down beside it: a choice that took
  cuSPARSELt for it would be reported."""
  module = load_example("train_lm")
  args = module.parse_args(["--d-model", "32", "--ffn-activation", "relu2",
                            "--sparse-activations", "masked"])
  assert module.sparse_layer_backends(args)["mlp/down"] == "xla"
  from jsparse24.backends import cusparselt
  monkeypatch.setattr(cusparselt.CusparseltBackend, "check_supported", lambda self, p: None)
  monkeypatch.setattr(cusparselt.CusparseltBackend, "unavailable_reason", lambda self: None)
  monkeypatch.setattr(cusparselt.CusparseltBackend, "prefers", lambda self, p: p.input_sparse)
  assert module.sparse_layer_backends(args) == {"mlp/up": "xla", "mlp/down": "cusparselt"}


def test_train_lm_says_which_preset_it_chose_and_what_its_counts_count(train_lm):
  # On a CPU, without --size: the CPU preset, said first; the final table
  # says what its step count counts.
  _, out, _ = train_lm
  printed = (out / "stdout.txt").read_text()
  assert printed.splitlines()[0] == (
      "preset small (JAX's backend is 'cpu', no GPU; --size gpu for the GPU preset)"), printed
  for run in ("dense", "2:4"):
    row = rf"^\s*{re.escape(run)} \|.*\| 30 steps run \(of 30\), \d"
    assert re.search(row, printed, re.M), (run, printed)


def test_train_lm_takes_the_gpu_preset_on_a_gpu(monkeypatch):
  """Without --size the preset follows JAX's backend; --size, and any flag
  given, win over it."""
  module = load_example("train_lm")
  cpu = module.parse_args([])
  assert (cpu.size, cpu.d_model, cpu.batch * cpu.seq_len) == ("small", 128, 1024)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  gpu = module.parse_args([])
  assert gpu.size == "gpu" and gpu.size_reason == "JAX found a GPU; --size small for the CPU preset"
  assert {k: getattr(gpu, k) for k in module.PRESETS["gpu"]} == module.PRESETS["gpu"]
  small = module.parse_args(["--size", "small"])
  assert (small.size, small.size_reason, small.d_model) == ("small", "--size small", 128)
  narrow = module.parse_args(["--d-model", "256"])
  assert (narrow.size, narrow.d_model, narrow.batch) == ("gpu", 256, module.PRESETS["gpu"]["batch"])


def test_sharded_train_takes_train_lms_preset_for_the_platform(monkeypatch, capsys, tmp_path):
  """Without --size, train_lm's choice for the platform (the gpu preset where
  JAX reports a GPU), said first; --size wins. The gpu preset's 32 sequences
  split evenly over the 8 devices. Stopped where the data would be read."""
  sharded, lm = load_example("sharded_train"), load_example("train_lm")

  class Stop(Exception):
    pass

  corpora = []

  def corpus_files(corpus):
    corpora.append(corpus)
    raise Stop

  monkeypatch.setattr(lm, "corpus_files", corpus_files)
  monkeypatch.setattr(sharded, "lm", lm)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  for flags, size in (([], "gpu"), (["--size", "small"], "small")):
    capsys.readouterr()
    with pytest.raises(Stop):
      sharded.main(flags + ["--out", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("preset gpu (JAX found a GPU; --size small for the CPU preset)"
                        if size == "gpu" else "preset small (--size small)"), lines
    preset = lm.PRESETS[size]
    assert (f"d_model {preset['d_model']}, {preset['layers']} layers, batch {preset['batch']} x"
            f" {preset['seq_len']} ({preset['batch'] // 8} rows on each of the 8 devices of the"
            f" data axis)") in lines[1], lines
  assert corpora == ["stdlib", "small"]


def test_train_lm_throughput_counts_only_the_timed_stretches():
  run = load_example("train_lm").Run("x", None, None, False)
  run.segments = [(1, 3, 1.0), (3, 10, 2.0), (11, 20, 3.0)]  # (first step, end step, s)
  assert run.tokens_per_s(100) == (2 + 7 + 9) * 100 / 6.0
  assert run.tokens_per_s(100, from_step=11) == 9 * 100 / 3.0
  assert math.isnan(run.tokens_per_s(100, from_step=12))


def test_train_lm_sparse_run_used_24_masks(train_lm):
  _, _, result = train_lm
  assert result["sparse_layers"] == ["block_0/mlp/down", "block_0/mlp/up"]
  assert result["masks_are_24"]
  assert result["sparsity"] == 0.5
  layers = assert_masks_are_24(result["params"], result["sparsity_collection"])
  assert layers == result["sparse_layers"]
  assert abs(result["val_loss_compressed"] - result["val_loss_masked"]) < 1e-3
  sizes = result["mlp_kernel_bytes"]
  assert sizes["compressed_float32"] < 0.55 * sizes["dense_float32"]
  assert sizes["compressed_bfloat16"] < 0.57 * sizes["dense_bfloat16"]


def test_train_lm_writes_plot_and_checkpoint(train_lm):
  _, out, result = train_lm
  png = out / "loss_curves.png"
  assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert pathlib.Path(result["loss_curves_png"]) == png
  sparse_ckpt = out / "checkpoints" / "sparse"
  assert pathlib.Path(result["checkpoint_dir"]) == sparse_ckpt
  steps = sorted(int(p.name) for p in sparse_ckpt.iterdir() if p.name.isdigit())
  assert steps[-1] == 30
  assert (out / "checkpoints" / "dense" / "30").is_dir()


def test_train_lm_resume_continues_from_the_saved_step(train_lm, capsys):
  module, out, first = train_lm
  capsys.readouterr()
  # Only what changes: the model's flags come from the first run's
  # train_lm_flags.json, and --steps given here overrides its 30.
  result = module.main(["--steps", "40", "--out", str(out), "--resume"])
  printed = capsys.readouterr().out
  assert f"flags from {out / 'train_lm_flags.json'}" in printed
  assert "| 10 steps run (of 40, resumed at step 30), " in printed
  assert result["start_step_sparse"] == 30
  assert result["start_step_dense"] == 30
  assert result["final_step"] == 40
  assert result["eval_steps"] == [15, 30, 40]
  # The restored history is the first run's; training went on from there.
  assert result["val_losses_sparse"][:2] == first["val_losses_sparse"]
  assert math.isfinite(result["final_val_loss_sparse"])
  assert_masks_are_24(result["params"], result["sparsity_collection"])
  assert sorted(os.listdir(out / "checkpoints" / "sparse"))[-1] == "40"


def test_pmap_train_runs_on_all_devices():
  # 8 fake CPU devices on CPU (tests/conftest.py); the real ones on a GPU host.
  final_loss = load_example("pmap_train").main(["--steps", "40", "--log-every", "20"])
  assert math.isfinite(final_loss)
  assert final_loss < 0.2  # a zero predictor scores ~0.42


def test_patch_model_sparsifies_only_the_mlps():
  result = load_example("patch_model").main(["--dense-steps", "30", "--sparse-steps", "10"])
  assert result["params_tree_identical"]
  assert result["checkpoint_loaded_unchanged"]
  mlps = [f"block_{i}/mlp/{name}" for i in range(2) for name in ("down", "up")]
  assert result["sparse_layers"] == mlps
  assert {"head", "proj_in", "block_0/attn/query"} <= set(result["dense_layers"])
  for key in ("dense_train_loss", "sparse_train_loss", "held_out_loss_pruned",
              "held_out_loss_finetuned"):
    assert math.isfinite(result[key]), key
  assert result["held_out_loss_dense"] < math.log(32)
  assert result["mlp_kernel_bytes_compressed"] < 0.55 * result["mlp_kernel_bytes_dense"]
  assert result["compressed_max_abs_error"] < 1e-4
  for layer in sparse_layers_of(result["masks"]).values():
    assert bool(jsparse24.is_24(layer["mask"].unpack(), axis=0))


# fsdp: its layout's 2:4 shardings and losses are test_bench_layouts.py's
# (the same `jsparse24.layouts`), the example runs it in
# test_sharded_train_24_activations_alone_under_fsdp, and 2d shards over its
# data axis as fsdp does. data: tests/test_multiprocess.py runs the example
# in it (1 process x 4 devices and 2 x 2) and checks its replicated state;
# 2d's data axis is its batch split, and 2d runs the dense model too.
@pytest.mark.parametrize("layout", ["tp", "2d"])
def test_sharded_train_learns_on_a_mesh(layout, monkeypatch, tmp_path, capsys):
  """8 fake CPU devices: the runs learn (2d: the dense and the 2:4 run; tp,
  one of the axes 2d combines: the 2:4 run), and their state stays in the
  layout's shardings (the MLP kernels column- and row-parallel over 4 model
  devices for tp, and over 2 model devices and sharded over 4 data devices
  on their other axis for 2d, and their masks alike). The step rebuilds the
  masks with the mask kernel on a run-time flag, as on a GPU (interpreted
  here), and they stay on each device's block. Only the step's rebuild takes
  the kernel: the masks that init builds come from XLA's search, the same
  bits (test_pallas_kernels), without compiling two more interpreted
  kernels."""
  from jsparse24 import _pallas_runtime, backends  # pylint: disable=g-import-not-at-top
  from jsparse24.backends.pallas import interpret_mode  # pylint: disable=g-import-not-at-top
  kernel_calls = []
  runs = ("dense", "2:4") if layout == "2d" else ("2:4",)

  def applies(w, transposable):
    kernel_calls.append(tuple(w.shape))
    return _pallas_runtime.mask_kernel_takes(w, transposable)
  monkeypatch.setattr(backends, "_mask_kernel_applies", applies)
  with interpret_mode():
    out = load_example("sharded_train").main(
        ["--layout", layout, "--steps", "30", "--batch", "16", "--d-model", "32",
         "--layers", "1", "--heads", "2", "--seq-len", "32", "--lr", "1e-2",
         "--out", str(tmp_path)]
        + (["--model-devices", "4"] if layout == "tp" else [])
        + ["--runs", "both" if len(runs) == 2 else "2:4"])
  printed = capsys.readouterr().out
  assert set(out) >= set(runs) and ("dense" in out) == ("dense" in runs), sorted(out)
  for run in runs:
    r = out[run]
    # Timed from the step after the first sparse one, as train_lm: the
    # warm-up (--steps // 10) runs steps 0-2 dense, step 3 is the first sparse.
    assert r["steps_run"] == 30 and r["timed_steps"] == 30 - 4, r["timed_steps"]
    assert f"{run:>5}: 30 steps run (of --steps 30); loss" in printed, printed
    assert r["loss_last"] < r["loss_first"] - 0.5, (run, r["loss_first"], r["loss_last"])
    assert r["tokens_per_s"] > 0
    kernel = r["params"]["block_0"]["mlp"]["up"]["kernel"]
    assert len(kernel.sharding.device_set) == 8
    spec = lambda a: (tuple(a.sharding.spec) + (None, None))[:2]  # noqa: E731
    want = {"tp": (None, "model"), "2d": ("data", "model")}[layout]
    assert spec(kernel) == want, kernel.sharding
    down = r["params"]["block_0"]["mlp"]["down"]["kernel"]
    assert spec(down) == want[::-1], down.sharding
  # The masks stay sharded like their kernels (packed [N, K/8]), the step
  # having taken the kernel for both MLP kernels ([K, N] of up and down).
  assert {(32, 128), (128, 32)} <= set(kernel_calls), kernel_calls
  masks = jsparse24.optim.masks(out["2:4"]["opt_state"])["block_0"]["mlp"]
  up, down = masks["up"]["mask"].packed, masks["down"]["mask"].packed
  assert spec(up) == want[::-1], up.sharding
  assert spec(down) == want, down.sharding


def test_train_lm_resume_at_or_past_steps_says_so(train_lm, capsys, tmp_path):
  module, out, _ = train_lm
  import shutil
  copy = tmp_path / "copy"
  shutil.copytree(out, copy)  # keep the shared fixture's checkpoints as they are
  capsys.readouterr()
  module.main(TINY_LM + ["--out", str(copy), "--resume"])  # the checkpoint is at --steps
  assert "NOTHING TO TRAIN" in capsys.readouterr().out


def test_train_lm_resume_refuses_a_checkpoint_of_other_flags(train_lm, tmp_path):
  """A checkpoint of another width is refused with the params that differ
  and the fix, before Orbax reads it."""
  module, out, _ = train_lm
  import shutil
  copy = tmp_path / "copy"
  shutil.copytree(out, copy)
  with pytest.raises(ValueError, match=r"train_lm --resume: the checkpoint in .*dense.* does not"
                     r" load into the model these flags describe \(ValueError: its params differ"
                     r" from the model's: block_0/attn/key/bias: \[2, 16\] in the checkpoint,"
                     r" \[2, 8\] in the model; .* more\)\. Resume with the flags it was trained"
                     r" with, or start afresh without --resume\."):
    module.main(["--d-model", "16", "--out", str(copy), "--resume"])


@pytest.mark.parametrize("name,flags,said", [
    # Zeros were dropped as if not given: the preset's 1000-step run started.
    ("sharded_train", ["--steps", "0"], "--steps 0: --steps, --batch"),
    ("sharded_train", ["--batch", "0"], "--batch 0: --steps, --batch"),
    # 0 took the default; -2 passed the divisibility check, then make_mesh raised.
    ("sharded_train", ["--layout", "tp", "--model-devices", "0"], "--model-devices 0 must be >= 1"),
    ("sharded_train", ["--layout", "2d", "--model-devices", "-2"], "--model-devices -2 must be"),
    # UnboundLocalError (no loss to report), after the dense phase for 0 2:4 steps.
    ("patch_model", ["--dense-steps", "0"], "--dense-steps 0 and --sparse-steps 60 must be >= 1"),
    ("patch_model", ["--sparse-steps", "0"], "--dense-steps 100 and --sparse-steps 0 must be"),
])
def test_sizes_below_one_are_refused_before_any_run(name, flags, said, tmp_path, capsys):
  with pytest.raises(SystemExit):
    load_example(name).main([*flags, *(["--out", str(tmp_path)] if name == "sharded_train"
                                       else [])])
  assert said in capsys.readouterr().err


@pytest.mark.parametrize("name", ["pmap_train", "patch_model", "train_lm", "sharded_train",
                                  "generate"])
def test_every_example_flag_has_help_text(name, capsys):
  """Every flag says what it does, and its default once: not a None where
  the help says where the value comes from."""
  import re
  with pytest.raises(SystemExit):
    load_example(name).main(["--help"])
  text = capsys.readouterr().out.split("options:")[1]
  # One entry per option: its flag column, then its description.
  entries = re.split(r"\n  (?=-)", "\n" + text)[1:]
  assert entries, text
  for entry in entries:
    flag, _, rest = entry.partition("  ")
    words = re.sub(r"\(default: [^)]*\)", "", rest).split()
    if flag.startswith("-h"):
      continue
    assert words, f"{name}: no help text for {flag.split()[0]}"
    assert rest.count("(default:") <= 1 and "(default: None)" not in rest, (name, entry)


def test_train_lm_mvue_learns_and_resumes_bit_for_bit(train_lm, tmp_path):
  """--mvue: the 2:4 run's MLP kernels learn from MVUE-pruned output
  gradients; the keys come from the step, so a run resumed from its step-15
  checkpoint ends with the same params as the uninterrupted run."""
  module, _, plain = train_lm
  straight = module.main(TINY_LM + ["--mvue", "--out", str(tmp_path / "a")])
  val = straight["val_losses_sparse"]
  assert val[-1] < val[0] and val[-1] < math.log(256) - 1.0, val
  # The option changes the 2:4 run only (and not its forward pass at step 0).
  assert straight["val_losses_dense"] == plain["val_losses_dense"]
  assert not np.array_equal(straight["params"]["block_0"]["mlp"]["up"]["kernel"],
                            plain["params"]["block_0"]["mlp"]["up"]["kernel"])
  # The 2:4 run resumes from step 15; the dense run, whose results the
  # option does not change (checked above), finds its step-30 checkpoint
  # and trains nothing.
  shutil.rmtree(tmp_path / "a" / "checkpoints" / "sparse" / "30")
  resumed = module.main(TINY_LM + ["--mvue", "--out", str(tmp_path / "a"), "--resume"])
  assert resumed["start_step_sparse"] == 15
  jax.tree.map(np.testing.assert_array_equal, resumed["params"], straight["params"])


def test_train_lm_moe_trains_2_4_experts_and_a_dense_moe(tmp_path, capsys):
  """--moe E,K: every block's MLP is a SparseMoE, 2:4 with masks per expert
  in the 2:4 run, nn.Dense experts (sparse=False, same params) in the dense
  run; both learn."""
  module = load_example("train_lm")
  flags = TINY_LM[:1] + ["10"] + TINY_LM[2:3] + ["5"] + TINY_LM[4:]
  result = module.main(flags + ["--moe", "4,2", "--out", str(tmp_path)])
  assert result["sparse_layers"] == ["block_0/mlp/experts/down", "block_0/mlp/experts/up"]
  masks = result["sparsity_collection"]["block_0"]["mlp"]["experts"]
  for name, shape in (("up", (4, 32, 128)), ("down", (4, 128, 32))):
    mask = np.asarray(masks[name]["mask"].unpack())
    assert mask.shape == shape, name
    for e in range(4):
      assert bool(jsparse24.is_24(mask[e], axis=0)), (name, e)
    assert not np.array_equal(mask[0], mask[1]), name  # each expert its own mask
  assert result["masks_are_24"]
  for run in ("dense", "sparse"):
    val = result[f"val_losses_{run}"]
    assert all(math.isfinite(v) for v in val) and val[-1] < val[0], (run, val)
  assert result["val_loss_compressed"] == pytest.approx(result["val_loss_masked"], abs=1e-4)
  assert "every MLP a SparseMoE of 4 experts, top-2" in capsys.readouterr().out


def test_train_lm_moe_loss_adds_the_load_balancing_loss():
  """The training loss is the cross-entropy plus --moe-aux-weight times the
  mean of the MoE layers' load-balancing losses; the dense run's MoE has no
  masks."""
  module = load_example("train_lm")
  model = module.CharLM(module.VOCAB, 16, 2, 2, 8, False, moe=(4, 2))
  x = jax.random.randint(jax.random.key(0), (3, 8), 0, module.VOCAB)
  y = jnp.roll(x, -1, axis=1)
  # Each call one jitted program, as in training (eagerly, every operation
  # of the model compiled a program of its own).
  variables = jax.jit(model.init)(jax.random.key(1), x)
  assert set(variables) == {"params"}  # sparse=False: nn.Dense experts
  _, state = jax.jit(functools.partial(model.apply, mutable=["intermediates"]))(variables, x)
  aux = [state["intermediates"][f"block_{i}"]["mlp"]["load_balancing_loss"][0] for i in range(2)]
  loss = jax.jit(module.loss_fn, static_argnums=0, static_argnames="aux_weight")
  plain = loss(model, variables, x, y)
  np.testing.assert_allclose(loss(model, variables, x, y, aux_weight=0.5),
                             plain + 0.5 * np.mean(aux), rtol=1e-6)
  assert all(float(a) > 0.5 for a in aux)  # ~K for a balanced router: the term is not zero


def test_train_lm_squared_relu_with_24_activations(tmp_path):
  """--ffn-activation relu2 --sparse-activations masked
  --activation-weight-grad 2:4: both runs train a squared-ReLU MLP; in the
  2:4 run mlp/up keeps 2:4 weights (a mask) and mlp/down takes 2:4
  activations with a dense kernel (no mask) and its weight gradient from
  them pruned along the tokens (SparseDense(weight_grad="2:4")), and both
  learn."""
  module = load_example("train_lm")
  args = ["--steps", "12", "--eval-every", "6", "--d-model", "32", "--layers", "1",
          "--heads", "2", "--seq-len", "32", "--batch", "8", "--eval-batches", "2",
          "--lr", "1e-2", "--ffn-activation", "relu2", "--sparse-activations", "masked",
          "--activation-weight-grad", "2:4", "--out", str(tmp_path)]
  seen = []
  real = jsparse24.SparseDense.__call__

  def spy(self, *a, **kw):
    seen.append((self.name, self.weight_grad))
    return real(self, *a, **kw)

  with mock.patch.object(jsparse24.SparseDense, "__call__", spy), \
      contextlib.redirect_stdout(io.StringIO()) as printed:
    result = module.main(args)
  assert ("MLP activation relu2; 2:4 activations into mlp/down (masked gradient, dense kernel,"
          " weight gradient from them pruned along the tokens)") in printed.getvalue()
  assert set(seen) == {("up", "dense"), ("down", "2:4")}, set(seen)
  with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()) as err:
    module.main(["--activation-weight-grad", "2:4", "--out", str(tmp_path / "x")])
  assert "--activation-weight-grad 2:4 prunes mlp/down's pruned input" in err.getvalue()
  assert result["sparse_layers"] == ["block_0/mlp/up"]
  assert set(result["sparsity_collection"]["block_0"]["mlp"]) == {"up"}
  assert result["sparse_layer_backends"]["mlp/down"] == "xla"
  # Why no 2:4 kernel ran: the choice never takes one for 2:4 activations,
  # on a GPU's preset too (not "the gpu preset ... where the 2:4 kernels run").
  assert "--sparse-activations shows their accuracy here, not their speed" in printed.getvalue()
  assert "the gpu preset" not in printed.getvalue()
  for run in ("dense", "sparse"):
    val = result[f"val_losses_{run}"]
    assert all(math.isfinite(v) for v in val) and val[-1] < val[0], (run, val)


def test_train_lm_ramp_prediction_weighs_each_step_by_its_share_of_2_4_layers():
  """A ramp step with c of 2 layers 2:4 is predicted at the dense run's
  time per step plus c/2 of the way to the fully 2:4 steps' time; the
  prediction covers the stretches that hold such a step, not the warm-up
  or the settled ones."""
  module = load_example("train_lm")
  run = lambda segments, counts: types.SimpleNamespace(segments=segments, sparse_counts=counts)
  dense = run([(0, 2, 2.0), (3, 13, 10.0)], {})  # 1 s per step
  counts = {s: 0 if s < 5 else 1 if s < 7 else 2 for s in range(13)}
  # Steps 3-4 dense (1 s each), 5-6 half 2:4 (0.75 s), 7-12 fully 2:4 (0.5 s).
  exact = [(0, 3, 9.9), (3, 5, 2.0), (5, 7, 1.5), (7, 13, 3.0)]
  assert module.ramp_prediction(dense, run(exact, counts), 3) == (3, 7, 1.0, 2.0)
  slow = [(3, 7, 3.5 * 1.25), (7, 13, 3.0)]
  first, end, share, full = module.ramp_prediction(dense, run(slow, counts), 3)
  assert (first, end, full) == (3, 7, 2.0) and share == pytest.approx(0.8)
  assert module.ramp_prediction(dense, run([(7, 13, 3.0)], counts), 3) is None


def test_train_lm_ramp_jits_a_program_per_set_of_2_4_layers(tmp_path, monkeypatch):
  """--sparsity-ramp: while the ramp mixes dense and 2:4 layers, the 2:4
  run's step is jitted for the set of 2:4 layers (no run-time switch per
  product), read from the optimizer state where the schedule says it
  changes, and for whether its update rebuilds masks (no conditional
  around the rebuild and the scores): 2 MLP layers give 4 programs here
  (of at most 2 x 3), and the losses are those of the run-time flags. No
  step that compiled is timed."""
  module = load_example("train_lm")
  flags = ["--steps", "12", "--eval-every", "6", "--d-model", "32", "--layers", "1",
           "--heads", "2", "--seq-len", "32", "--batch", "8", "--eval-batches", "2",
           "--lr", "1e-2", "--mask-warmup", "2", "--rebuild-every", "4",
           "--sparsity-ramp", "3,9"]
  runs, calls = [], []
  train = module.train
  monkeypatch.setattr(module, "train", lambda run, *a, **k: (runs.append(run), train(run, *a, **k)))
  static_phase, static_rebuild = module.Run.static_phase, module.Run.static_rebuild

  def spy(self, step, held):
    phase, held = static_phase(self, step, held)
    calls.append((self.name, step, phase, static_rebuild(self, step)))
    return phase, held

  monkeypatch.setattr(module.Run, "static_phase", spy)
  static = module.main(flags + ["--out", str(tmp_path / "static")])
  assert static["train_step_programs"] == {"dense": 1, "2:4": 4}
  sparse = [(phase, rebuild) for name, _, phase, rebuild in calls if name == "2:4"]
  # Counts of 2 layers: 0 to step 4, 1 at steps 5 and 6, 2 from step 7;
  # masks rebuilt for steps 2 (the end of the warm-up) and 6 (every 4), and
  # where the count grows (5, 7): by the updates of steps 1, 4, 5 and 6.
  assert [p for p, _ in sparse[:5]] == [False] * 5 and [p for p, _ in sparse[7:]] == [True] * 5
  assert sparse[5][0] == sparse[6][0] and len(sparse[5][0]) == 1, sparse
  assert sparse[5][0] <= {"block_0/mlp/up", "block_0/mlp/down"}
  assert [step for step, (_, r) in enumerate(sparse) if r] == [1, 4, 5, 6]
  assert list(runs[1].sparse_counts.values()) == [0] * 5 + [1, 1] + [2] * 5
  for run in runs:
    seen, compiled = set(), []
    for name, step, phase, rebuild in calls:
      if name == run.name and (phase, rebuild) not in seen:
        seen.add((phase, rebuild))
        compiled.append(step)
    assert compiled == ([0] if run.name == "dense" else [0, 1, 5, 7]), (run.name, compiled)
    assert run.segments, run.name
    for first, end, _ in run.segments:
      assert not any(first <= c < end for c in compiled), (run.name, run.segments, compiled)
  # The same run with the run-time flags (one program while the ramp mixes).
  monkeypatch.setattr(module.Run, "static_phase", lambda self, step, held: (self.phase(step), held))
  monkeypatch.setattr(module.Run, "static_rebuild", lambda self, step: None)
  flagged = module.main(flags + ["--out", str(tmp_path / "flags")])
  assert flagged["train_step_programs"] == {"dense": 1, "2:4": 3}
  for key in ("val_losses_sparse", "val_losses_dense"):
    np.testing.assert_allclose(static[key], flagged[key], rtol=1e-5)
  assert static["final_train_loss_sparse"] == pytest.approx(flagged["final_train_loss_sparse"],
                                                             rel=1e-5)


def test_train_lm_ends_before_the_ramp_makes_a_layer_2_4(tmp_path, capsys):
  """A run that stops while the ramp still has every layer dense finishes
  its report: no kernel ships compressed, and it says so."""
  module = load_example("train_lm")
  out = module.main(["--steps", "4", "--eval-every", "4", "--d-model", "32", "--layers", "1",
                     "--heads", "2", "--seq-len", "32", "--batch", "8", "--eval-batches", "1",
                     "--mask-warmup", "2", "--sparsity-ramp", "3,9", "--out", str(tmp_path)])
  assert out["sparsity"] == 0 and not any(out["mlp_kernel_bytes"].values())
  assert "none is 2:4 at step 4" in capsys.readouterr().out


def test_train_lm_step_donates_params_and_optimizer_state():
  """The jitted train step writes the new params and optimizer state into
  the buffers of the old ones (donated: nothing reads them afterwards), so a
  step holds one copy of the state, not two (the d_model 4096 MoE run ran
  out of memory on an H200 without)."""
  module = load_example("train_lm")
  args = module.parse_args(TINY_LM)
  sample = jnp.zeros((1, args.seq_len), jnp.int32)
  x = jnp.zeros((args.batch, args.seq_len), jnp.int32)
  for sparse in (False, True):
    run = module.make_run("run", sparse, args, sample)
    step, _ = module.make_steps(run)
    memory = step.lower(run.params, run.opt_state, x, x, 0, phase=True if sparse else None
                        ).compile().memory_analysis()
    state = sum(a.nbytes for a in jax.tree.leaves((run.params, run.opt_state)))
    # All but a few bytes (scalars that XLA writes fresh, e.g. step counters).
    assert 0 <= state - memory.alias_size_in_bytes <= 16, (sparse, memory, state)


def test_train_lm_24_activations_alone(tmp_path):
  """--mlp-weights dense: the 2:4 run's mlp/up is an nn.Dense, so the runs
  differ only in mlp/down's pruned activations; the 2:4 run has no masks
  (plain AdamW), checkpoints apart from the dense run's, and learns."""
  module = load_example("train_lm")
  args = ["--steps", "6", "--eval-every", "3", "--d-model", "32", "--layers", "1",
          "--heads", "2", "--seq-len", "32", "--batch", "8", "--eval-batches", "2",
          "--lr", "1e-2", "--ffn-activation", "relu2", "--sparse-activations", "masked",
          "--mlp-weights", "dense", "--out", str(tmp_path)]
  with contextlib.redirect_stdout(io.StringIO()) as printed:
    result = module.main(args)
  assert "no 2:4 weights (--mlp-weights dense)" in printed.getvalue()
  assert "2:4 weights: none (--mlp-weights dense)" in printed.getvalue()
  assert result["sparse_layers"] == []
  assert result["sparse_layer_backends"] == {"mlp/down": "xla"}
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["dense", "sparse"]
  params = result["params"]["block_0"]["mlp"]
  assert set(params) == {"up", "down"}
  for run in ("dense", "sparse"):
    val = result[f"val_losses_{run}"]
    assert all(math.isfinite(v) for v in val) and val[-1] < val[0], (run, val)
  # The pruned activations change the loss: the runs are not the same model.
  assert result["val_losses_sparse"] != result["val_losses_dense"]


@pytest.mark.parametrize("flags", [[], ["--sparse-activations", "masked", "--mvue"]])
def test_train_lm_dense_mlp_weights_need_24_activations_alone(flags, capsys):
  module = load_example("train_lm")
  with pytest.raises(SystemExit):
    module.parse_args(["--mlp-weights", "dense", *flags])
  assert "--mlp-weights dense leaves the 2:4 run no 2:4 weight" in capsys.readouterr().err


@pytest.mark.parametrize("flags,named", [
    (["--eval-batches", "0"], "--eval-batches 0"),  # trained, reporting a NaN loss
    (["--eval-batches", "-1"], "--eval-batches -1"),  # NumPy's error on -2 samples
    (["--heads", "0"], "--heads 0"),  # ZeroDivisionError
    (["--heads", "-4"], "--heads -4"),  # a reshape error in JAX
    (["--d-model", "0"], "--d-model 0"),
])
def test_train_lm_names_sizes_below_one(flags, named, capsys):
  module = load_example("train_lm")
  with pytest.raises(SystemExit):
    module.parse_args(flags)
  assert (f"{named}: --steps, --batch, --seq-len, --eval-every, --eval-batches, --layers,"
          f" --heads and --d-model must be >= 1.") in capsys.readouterr().err


def test_train_lm_refuses_a_ramp_hidden_by_the_warm_up_before_any_run(capsys):
  """--sparsity-ramp ending within --mask-warmup (default: a tenth of the
  steps) would make every layer 2:4 at once; refused by parse_args, not by
  MaskSchedule after the dense run has trained."""
  module = load_example("train_lm")
  with pytest.raises(SystemExit):
    module.parse_args(["--steps", "1000", "--sparsity-ramp", "0,50"])
  assert "the ramp ends at step 50, within the dense warm-up" in capsys.readouterr().err
  assert module.mask_schedule(module.parse_args(["--steps", "1000", "--sparsity-ramp",
                                                 "0,101"])).ramp.end == 101


def test_sharded_train_24_activations_alone_under_fsdp(tmp_path, capsys):
  """sharded_train with --sparse-activations --mlp-weights dense: under FSDP
  the 2:4 run has no masks and checkpoints apart from the dense run; the
  layouts that give the MLP a kernel_sharding refuse the flag by name."""
  module = load_example("sharded_train")
  flags = ["--steps", "6", "--batch", "16", "--d-model", "32", "--layers", "1", "--heads", "2",
           "--seq-len", "32", "--lr", "1e-2", "--out", str(tmp_path), "--ffn-activation",
           "relu2", "--sparse-activations", "masked", "--mlp-weights", "dense"]
  with pytest.raises(SystemExit):
    module.main(["--layout", "data", *flags])
  assert "--sparse-activations masked runs under --layout fsdp only" in capsys.readouterr().err
  out = module.main(["--layout", "fsdp", *flags])
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["dense", "sparse"]
  for run in ("dense", "2:4"):
    assert out[run]["loss_last"] < out[run]["loss_first"], (run, out[run])
    kernel = out[run]["params"]["block_0"]["mlp"]["up"]["kernel"]
    assert (tuple(kernel.sharding.spec) + (None,))[:2] == (None, "data"), kernel.sharding
