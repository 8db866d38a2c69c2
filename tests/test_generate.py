"""examples/generate.py and benchmarks/bench_decode.py at tiny sizes on CPU:
generation with a KV cache (trained first when no checkpoint exists), its
logits against the full forward, deterministic sampling, and the decode
benchmark with its logits check."""

import contextlib
import dataclasses
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse24
from benchmarks import _common, _gpt, bench_decode
from tests.test_examples import load_example


# train_lm's flags for a model that trains in seconds (sparse from the first step).
TINY = ["--steps", "4", "--eval-every", "4", "--d-model", "32", "--layers", "1", "--heads", "2",
        "--seq-len", "16", "--batch", "4", "--eval-batches", "1", "--mask-warmup", "0"]


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
  """(the module, its train_lm flags, what the first run printed, its result):
  a run with no checkpoint, which trains first."""
  gen = load_example("generate")
  argv = TINY + ["--out", str(tmp_path_factory.mktemp("generate")), "--tokens", "4",
                 "--batches", "1", "--repeats", "1"]
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    result = gen.main(argv)
  return gen, argv, printed.getvalue(), result


@pytest.fixture(scope="module")
def shipped(generated):
  """The dense and the compressed 2:4 model loaded from the checkpoints (what
  loading printed under "printed")."""
  gen, argv, _, _ = generated
  args, targs, train_argv = gen.parse_args(argv)
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    dense, sparse = gen.load_runs(targs, train_argv)
  compressed = jsparse24.compress_params(
      sparse.params, gen.serving_masks(jsparse24.optim.masks(sparse.opt_state)))
  return {"gen": gen, "args": args, "printed": printed.getvalue(),
          "dense": (gen.decode_model(dense.model), dense.params, dense.model),
          "2:4": (gen.decode_model(sparse.model), compressed, sparse.model)}


def test_generate_trains_when_no_checkpoint_then_generates(generated):
  _, _, printed, result = generated
  assert "training them first" in printed
  assert result["steps"] == {"dense": 4, "2:4": 4}
  assert set(result["texts"]) == {"dense", "2:4"}
  assert set(result["backends"][1]) == {"mlp/up", "mlp/down"}  # both MLP layers compressed
  assert result["tokens_per_s"][1]["dense"] > 0 and result["tokens_per_s"][1]["2:4"] > 0
  # On a CPU no 2:4 kernel runs: a ratio would be noise shown as a speed-up.
  assert "no speed-up to report" in printed and "2:4 / dense tokens/s 0" not in printed
  # The 2:4 kernels ship at about half their dense bytes (float32: values + 1/16 metadata).
  dense_bytes, compressed_bytes = result["sparse_kernel_bytes"]
  assert compressed_bytes / dense_bytes == pytest.approx(0.5 + 1 / 32)
  assert result["weight_bytes"]["2:4"] < result["weight_bytes"]["dense"]


def test_cached_logits_equal_the_full_forward(generated):
  # The run checked its cache: prefill of the prompt, then one token per step,
  # against train_lm's CharLM on the whole sequence (float32), both models.
  diffs = generated[3]["logit_diffs"]
  assert len(diffs) == 3 and all(v < 1e-5 for v in diffs.values()), diffs


def test_generate_loads_the_checkpoint_and_greedy_repeats(generated, shipped):
  gen, _, _, first = generated
  assert "training them first" not in shipped["printed"]
  prompt = jnp.asarray([list(b"def ")], jnp.int32)
  for name in ("dense", "2:4"):
    model, params, _ = shipped[name]
    fn = gen.make_generate(model, 4, 0.0)
    out, _ = fn(params, prompt, model.empty_cache(1), jax.random.key(7))
    assert bytes(np.asarray(out[0]).astype(np.uint8).tolist()).decode(
        "utf-8", "replace") == first["texts"][name], name


def test_generate_refuses_a_checkpoint_of_other_flags(generated):
  """Refused before Orbax reads the checkpoint, naming params that differ
  (three of them, then how many more), not Orbax's list of every key."""
  gen, argv, _, _ = generated
  with pytest.raises(ValueError, match="does not load into the model") as refused:
    gen.main([*argv, "--d-model", "64"])  # flags given override the saved ones
  message = str(refused.value)
  assert "its params differ from the model's: block_0/attn/key/bias: [2, 16] in the checkpoint," \
         " [2, 32] in the model;" in message, message
  assert message.count("in the checkpoint") == 3 and " more)" in message, message
  assert len(message) < 1200, len(message)


def test_generate_reads_the_flags_train_lm_saved(generated):
  """With only --out, generate loads the tiny model that its first run
  trained there: train_lm saved those flags (the preset made explicit,
  without --out), and they come first."""
  gen, argv, _, _ = generated
  out = argv[argv.index("--out") + 1]
  _, saved = gen.lm.with_saved_flags(out, [])
  assert saved[:2] == ["--size", gen.lm.choose_size(None)[0]] and "--out" not in saved
  assert saved[2:] == TINY
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    result = gen.main(["--out", out, "--tokens", "4", "--batches", "1", "--repeats", "1"])
  assert "training them first" not in printed.getvalue()
  assert f"train_lm's flags from {out}" in printed.getvalue()
  assert result["steps"] == {"dense": 4, "2:4": 4}


def test_check_cache_fails_on_a_perturbed_compressed_weight(shipped):
  gen = shipped["gen"]
  model, compressed, _ = shipped["2:4"]
  dense_model, dense_params, _ = shipped["dense"]
  tokens = jax.random.randint(jax.random.key(1), (1, 16), 0, 256, jnp.int32)
  sp = compressed["block_0"]["mlp"]["up"]["kernel"]
  bad = jax.tree.map(lambda a: a, compressed)
  bad["block_0"]["mlp"]["up"]["kernel"] = dataclasses.replace(sp, values=sp.values * 1.5)
  masked = gen.masked_params(compressed)  # the dense reference keeps the true weights
  with pytest.raises(AssertionError, match="compressed vs its masked kernels uncompressed"):
    gen.check_cache(dense_model, model, dense_params, bad, tokens, 4, 1e-4, masked=masked)


def test_sampling_is_deterministic_for_a_key(shipped):
  gen = shipped["gen"]
  model, params, _ = shipped["2:4"]
  prompt = jnp.asarray([list(b"def ")] * 2, jnp.int32)

  fns = {t: gen.make_generate(model, 8, t) for t in (0.0, 1.0)}

  def run(temperature, seed):
    out, _ = fns[temperature](params, prompt, model.empty_cache(2), jax.random.key(seed))
    return np.asarray(out)

  np.testing.assert_array_equal(run(1.0, 3), run(1.0, 3))
  assert not np.array_equal(run(1.0, 3), run(1.0, 4))
  np.testing.assert_array_equal(run(0.0, 3), run(0.0, 4))  # greedy ignores the key


# --- bench_decode ------------------------------------------------------------------


def test_bench_decode_runs_quick_on_cpu(capsys, monkeypatch):
  # --profile's GPU time per product faked (a CPU traces none: `kernel_seconds`
  # gives None, tested below): 4 us per call of a dense rotation, 2 us per call
  # of a 2:4 one (the dense products run first).
  calls = []
  monkeypatch.setattr(bench_decode._common, "kernel_seconds",  # pylint: disable=protected-access
                      lambda fn, *args: calls.append(1) or (4e-6 if len(calls) <= 4 else 2e-6))
  out = bench_decode.main(["--quick", "--no-write", "--layers", "1", "--batches", "1",
                           "--context", "16", "--prefill", "8", "--vocab", "256",
                           "--kernel-ms", "2", "--profile"])
  assert not out["failures"]
  assert out["config"]["blocks"] == "loop" and out["config"]["attention"] is None  # CPU: XLA's
  (r,) = out["widths"]
  assert set(r["decode"]) == {1}
  for part in (*r["decode"].values(), r["prefill"]):
    assert part["dense_ms"] > 0 and part["sparse_ms"] > 0
    assert part["logits_rel_err"] <= bench_decode.LOGITS_TOL
    assert part["backends"] == ["xla"]
  labels = {row["implementation"] for row in r["kernels_2:4"]}
  assert labels == {"auto (xla)"}  # forced: only the others that run here (none on CPU)
  assert {row["rotation"] for row in r["kernels_2:4"] + r["kernels_dense"]} == {2}
  assert [(row["m"], row["layer"]) for row in r["kernels_dense"]] == [
      (2, layer) for layer in _gpt.layer_shapes(128)]
  printed = capsys.readouterr().out
  assert "No 2:4 kernel ran" in printed and "Not run here: `pallas`" in printed
  # Each model's steps printed as soon as they are timed (a run cut short keeps them).
  d, s = r["dense"], r["2:4"]
  assert (f"[d_model 128] dense: batch 1 {d['decode'][1]['ms']:.4g} ms, prefill 8"
          f" {d['prefill']['ms']:.4g} ms\n") in printed
  assert (f"[d_model 128] 2:4: batch 1 {s['decode'][1]['ms']:.4g} ms"
          f" ({d['decode'][1]['ms'] / s['decode'][1]['ms']:.3f}x)") in printed
  # A CPU traces no GPU kernel: the profile section says so instead of a table.
  assert r["dense"]["decode"][1]["profile"] is None and r["2:4"]["decode"][1]["profile"] is None
  assert "`--profile`: no GPU kernel was traced" in printed
  # --profile's GPU time per product (of the rotation of 2) and the speed-up by it.
  assert len(calls) == 8  # 4 layers, dense and 2:4
  np.testing.assert_allclose([row["gpu_ms"] for row in r["kernels_dense"]], [2e-3] * 4)
  np.testing.assert_allclose([row["gpu_ms"] for row in r["kernels_2:4"]], [1e-3] * 4)
  np.testing.assert_allclose([row["gpu_speedup"] for row in r["kernels_2:4"]], [2.0] * 4)
  assert "| GPU ms | GPU speedup |" in printed


def test_decode_profile_sums_kernels_per_step_by_kind(monkeypatch):
  # The traced steps' kernels as a GPU trace lists them: each kind summed and
  # divided by the steps traced.
  steps = bench_decode.PROFILED_STEPS
  names = ["jsparse24_decode", "jsparse24_decode__1", "gemm_fusion_dot_67",
           "sm90_xmma_sparse_gemm_f16", "input_reduce_fusion_24", "loop_add_fusion"]
  events = [{"name": n, "dur": 30.0 * (i + 1)} for i, n in enumerate(names)] * steps
  monkeypatch.setattr(bench_decode._common, "gpu_events", lambda path: events)  # pylint: disable=protected-access
  calls = []
  prof = bench_decode.profile_steps(lambda: calls.append(1) or jnp.zeros(()))
  assert len(calls) == 2 + steps  # two untraced, then the traced ones
  assert prof["kernels"] == len(names)
  np.testing.assert_allclose([prof[k] for k in bench_decode.KERNEL_KINDS],
                             [0.09, 0.12, 0.09, 0.33])  # (30 + 60), 120, 90, (150 + 180) us
  np.testing.assert_allclose(prof["ms"], 0.63)
  table = bench_decode.profile_section([[4096, 1, "2:4", 1.1, *prof.values()]])
  assert "| 4096 | 1 | 2:4 | 1.1 | 6 | 0.63 | 0.09 | 0.12 | 0.09 | 0.33 |" in table


def test_product_table_rotates_about_200_mb_of_weights():
  # Weights in turn, about 200 MB compressed, 2 to 16 (a single weight would
  # be timed from L2 and by its call's launch).
  assert _common.compressed_bytes(4096, 16384) == 4096 * 16384 * 9 // 8  # 75.5 MB
  assert bench_decode.rotation(4096, 16384, quick=False) == 3
  assert bench_decode.rotation(16384, 16384, quick=False) == 2
  assert bench_decode.rotation(2048, 2048, quick=False) == 16
  assert bench_decode.rotation(4096, 16384, quick=True) == 2
  assert _common.rotation(10e6, total=400e6, most=None) == 40  # tune_decode's


def test_rotation_gives_each_weight_its_own_rows():
  # Products sharing one x would be merged by XLA's dot merger (GPU).
  xs = _common.rows_per_weight(jax.random.key(0), 3, 8, 4)
  assert len(xs) == 4 and all(x.shape == (3, 8) and x.dtype == jnp.bfloat16 for x in xs)
  assert len({np.asarray(x, np.float32).tobytes() for x in xs}) == 4
  ws = [jax.random.normal(jax.random.key(i), (8, 5), jnp.bfloat16) for i in range(4)]
  got = _common.rotated(lambda x, w: x @ w)(xs, ws)
  for x, w, y in zip(xs, ws, got):
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(x @ w, np.float32))


def test_kernel_seconds_sums_the_traced_kernels_per_call(monkeypatch):
  # A CPU traces no GPU kernel: None. Traced kernels (Perfetto: microseconds)
  # are summed and divided by the calls.
  f = jax.jit(lambda x: x * 2)
  assert _common.kernel_seconds(f, jnp.ones(4)) is None
  events = [{"name": "a", "dur": 5.0}, {"name": "b", "dur": 7.0}, {"name": "a", "dur": 6.0}]
  monkeypatch.setattr(_common, "gpu_events", lambda path: events)
  calls = []
  g = lambda x: calls.append(1) or x  # noqa: E731
  np.testing.assert_allclose(_common.kernel_seconds(g, jnp.ones(4), calls=3), 6e-6)
  assert len(calls) == 1 + 3  # a warm-up, then the traced calls


def test_decode_gpt_has_gpt_params_and_its_logits():
  # Two heads: with one, the two orders of qkv's columns coincide, and a
  # decode model that mixes up heads in the cache would pass too.
  gpt = _gpt.GPT(64, 256, 2, 16, None, dtype=jnp.float32)
  gpt_params = jax.jit(gpt.init)(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))["params"]
  params = bench_decode.qkv_as_blocks(gpt_params)
  d, tokens = 256, jax.random.randint(jax.random.key(1), (2, 16), 0, 64, jnp.int32)
  prefill = bench_decode.DecodeGPT(64, d, 2, 16, True, jnp.float32)
  step = bench_decode.DecodeGPT(64, d, 2, 16, False, jnp.float32)
  # [layers, batch, heads, context, 128]
  cache = {"k": jnp.zeros((2, 2, 2, 16, 128)), "v": jnp.zeros((2, 2, 2, 16, 128))}
  shapes = jax.eval_shape(prefill.init, jax.random.key(0), tokens, cache, 0)["params"]
  assert jax.tree.map(jnp.shape, shapes) == jax.tree.map(jnp.shape, params)
  step_fn = jax.jit(step.apply)
  with jax.default_matmul_precision("highest"):
    full = jax.jit(gpt.apply)({"params": gpt_params}, tokens)
    logits, cache = jax.jit(prefill.apply)({"params": params}, tokens[:, :10], cache, 0)
    np.testing.assert_allclose(logits, full[:, 9:10], atol=1e-5, rtol=1e-5)  # the last token's
    for t in range(10, 16):  # then one token per step, through the cache
      logits, cache = step_fn({"params": params}, tokens[:, t:t + 1], cache, t)
      np.testing.assert_allclose(logits[:, 0], full[:, t], atol=1e-5, rtol=1e-5, err_msg=t)


def test_decode_gpt_prefill_takes_its_attention_and_returns_the_last_logits(monkeypatch):
  # --attention reaches the prefill's dot_product_attention (cuDNN on a GPU:
  # recorded here and run as XLA's on the CPU), in the scan and in the loop.
  calls = []
  xla = jax.nn.dot_product_attention

  def recording(*args, implementation=None, **kwargs):
    calls.append(implementation)
    return xla(*args, implementation=None, **kwargs)

  monkeypatch.setattr(bench_decode.jax.nn, "dot_product_attention", recording)
  tokens = jax.random.randint(jax.random.key(3), (1, 8), 0, 64, jnp.int32)
  cache = {"k": jnp.zeros((2, 1, 1, 16, 128)), "v": jnp.zeros((2, 1, 1, 16, 128))}
  for scan in (True, False):
    model = bench_decode.DecodeGPT(64, 128, 2, 16, True, jnp.float32, scan=scan,
                                   attention="cudnn")
    params = jax.jit(model.init)(jax.random.key(0), tokens, cache, 0)
    logits, _ = model.apply(params, tokens, cache, 0)
    assert logits.shape == (1, 1, 64)
  assert calls and set(calls) == {"cudnn"}


def test_decode_gpt_loop_of_blocks_matches_the_scan():
  # --blocks loop: the same function as the scanned model on the same
  # weights, split per block by unstack_blocks (a wrong block order or a
  # block reading another's cache slot breaks it).
  d, tokens = 128, jax.random.randint(jax.random.key(2), (2, 1), 0, 64, jnp.int32)
  cache = {k: jax.random.normal(jax.random.key(i), (3, 2, 1, 16, 128))
           for i, k in enumerate("kv")}
  scanned = bench_decode.DecodeGPT(64, d, 3, 16, False, jnp.float32)
  params = jax.jit(scanned.init)(jax.random.key(0), tokens, cache, 5)["params"]
  loop = bench_decode.DecodeGPT(64, d, 3, 16, False, jnp.float32, scan=False)
  per_block = bench_decode.unstack_blocks(params, 3)
  shapes = jax.eval_shape(loop.init, jax.random.key(0), tokens, cache, 5)["params"]
  assert jax.tree.map(jnp.shape, shapes) == jax.tree.map(jnp.shape, per_block)
  with jax.default_matmul_precision("highest"):
    want = jax.jit(scanned.apply)({"params": params}, tokens, cache, 5)
    got = jax.jit(loop.apply)({"params": per_block}, tokens, cache, 5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5), got, want)


def test_bench_decode_logits_check_fails_on_a_perturbed_weight():
  # The model and the decode step of test_bench_decode_runs_quick_on_cpu's
  # run (its flags), whose compiled programs the run's cache then holds.
  cfg = {"layers": 1, "context": 16, "vocab": 256, "batches": [1], "prefill": 8}
  models = bench_decode.make_models(cfg, 128)
  tokens = jnp.asarray([[3]], jnp.int32)
  pos = jnp.asarray(15, jnp.int32)

  def logits(name, params):
    out, _ = models["steps"][name, False](params, tokens, bench_decode.random_cache(cfg, 128, 1),
                                         pos)
    return out[:, -1]

  dense = logits("dense", models["masked"])
  assert bench_decode.logits_match(logits("2:4", models["compressed"]), dense)[0]
  sp = models["compressed"]["block_0"]["down"]["kernel"]  # --blocks loop, the default
  bad = jax.tree.map(lambda a: a, models["compressed"])
  bad["block_0"]["down"]["kernel"] = dataclasses.replace(sp, values=sp.values * 1.5)
  ok, err = bench_decode.logits_match(logits("2:4", bad), dense)
  assert not ok and err > bench_decode.LOGITS_TOL


@pytest.mark.parametrize("mlp_weights", ["2:4", "dense"])
def test_generate_decodes_a_squared_relu_model_with_24_activations(tmp_path, mlp_weights):
  """A run of train_lm --ffn-activation relu2 --sparse-activations masked
  (with 2:4 `up` weights, or --mlp-weights dense: no mask at all): generate
  trains it, ships it and generates; its decode model has the run's
  feed-forward, and its cached logits equal those of the run's own CharLM on
  the trained variables."""
  gen = load_example("generate")
  out = str(tmp_path)
  flags = TINY + ["--ffn-activation", "relu2", "--sparse-activations", "masked",
                  "--mlp-weights", mlp_weights, "--out", out]
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    result = gen.main(flags + ["--tokens", "4", "--batches", "1", "--repeats", "1"])
  assert result["steps"] == {"dense": 4, "2:4": 4}
  assert ("no compressed weight" in printed.getvalue()) == (mlp_weights == "dense")
  # The layers shipped compressed: `up` with 2:4 weights; the pruned `down` keeps its kernel.
  assert set(result["backends"][1]) == ({"mlp/up"} if mlp_weights == "2:4" else set())
  _, targs, train_argv = gen.parse_args(["--out", out])  # the flags train_lm saved
  with contextlib.redirect_stdout(io.StringIO()):
    _, sparse = gen.load_runs(targs, train_argv)
  model = gen.decode_model(sparse.model)
  assert (model.activation, model.input_sparsity, model.mlp_weights) == (
      "relu2", "masked", mlp_weights)
  variables, shipped = {"params": sparse.params}, sparse.params
  if sparse.sparse:
    variables["sparsity"] = jsparse24.optim.masks(sparse.opt_state)
    shipped = jsparse24.compress_params(sparse.params,
                                        gen.serving_masks(variables["sparsity"]))
  tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 256, jnp.int32)
  want = sparse.model.apply(variables, tokens)
  got = gen.cached_logits(model, shipped, tokens, 5)
  assert gen.max_rel_diff(got, want) < 1e-5


def test_decode_model_refuses_a_moe_model_by_name():
  gen = load_example("generate")
  moe = gen.lm.CharLM(256, 32, 1, 2, 16, True, moe=(4, 2))
  with pytest.raises(ValueError, match="SparseMoEs .*--moe 4,2"):
    gen.decode_model(moe)


@pytest.mark.parametrize("flags,said", [
    (["--batches", "abc"], "--batches 'abc': batch sizes as integers separated by commas"),
    (["--batches", "1,,8"], "--batches '1,,8': batch sizes as integers"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
    (["--temperature", "inf"], "--temperature must be a finite number >= 0, got inf"),
    (["--prompt", "\udcff"], "is not valid UTF-8 text"),  # a byte 0xff on the command line
])
def test_generate_names_flags_it_cannot_use(flags, said, tmp_path, capsys):
  """Were a ValueError traceback from int(), NUL bytes sampled at a NaN
  temperature, a UnicodeEncodeError traceback."""
  gen = load_example("generate")
  with pytest.raises(SystemExit):
    gen.parse_args([*flags, "--out", str(tmp_path)])
  assert said in capsys.readouterr().err
