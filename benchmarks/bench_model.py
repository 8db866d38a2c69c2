"""Whole model: a GPT-style decoder trained dense and 2:4 sparse, side by side.

    PYTHONPATH=. python benchmarks/bench_model.py [--widths 1024,2048] [--remat] [--json PATH]
    PYTHONPATH=. python benchmarks/bench_model.py --small

The model (`benchmarks/_gpt.py`, shared with `profile_model.py`) is written
the way LLM users write one, and made sparse without editing it:

* `GPT`: token + learned position embeddings, `--layers` pre-LayerNorm blocks
  stacked with `nn.scan` (optionally `nn.remat` inside the scan), a final
  LayerNorm and a dense output head over `--vocab` tokens. Each block has
  exactly four `nn.Dense` layers, `qkv` (d -> 3d), `out` (d -> d), `up`
  (d -> 4d) and `down` (4d -> d), all without bias (as most current LLMs),
  causal attention through `jax.nn.dot_product_attention` (cuDNN on a GPU,
  XLA elsewhere; `--attention`) with heads of 128 and a GELU MLP. bfloat16
  compute, float32 params.
* dense: AdamW (lr 1e-4, weight decay 0.1) on softmax cross-entropy of random
  tokens (`--batch` x `--seq` = 16,384 tokens per step by default).
* 2:4: the same model through `jsparse24.sparsify(model, {r".*/(qkv|out|up|down)": {}})`
  (default options: the library picks the backend; `--mask` overrides only the
  mask kind), with
  `jsparse24.optim.mask_update(..., MaskSchedule(rebuild_every=R), decay=2e-4)`
  chained before the same AdamW; the forward pass reads
  `jsparse24.optim.masks(opt_state)`. Same init key, same params. As
  examples/train_lm.py trains, the host's schedule says which updates rebuild
  masks (`mask_update`'s static `mask_rebuild`): a 2:4 program without the
  rebuild and one with it (`--rebuild-flag`: one program deciding on
  mask_update's run-time flag).

Per width it times the whole training step of both (steps that do not rebuild
the masks), one rebuild step, and a breakdown of where the 2:4 step's time
goes (linear layers, compression, attention, optimizer, the rest), each part
its own jitted program at the model's shapes; then the ceilings the breakdown
implies. Every width's dense model (and its parts) is timed before any 2:4
model runs: a process that has run a cuSPARSELt matmul runs its other
compute-bound kernels slower from then on (see `setup_width`), which a dense
model in its own process never pays. A width whose 2:4 model runs no
cuSPARSELt product has no such tax: its dense step is timed again in turn
with the 2:4 step (`_common.in_turn`), and that pair gives its ratio, since
at the small end the host's dispatch bounds both steps and the host's speed
drifts between timings minutes apart. Tables are printed and written to
benchmarks/results/<gpu>.md.

`--small`: where users start, a row per shape in place of a row per width:
d_model 128 and 256 x 2 blocks at 1,024 to 4,096 tokens per step, then the
shapes that examples/train_lm.py and examples/sharded_train.py train by
default on a GPU, on the examples' byte vocabulary (`small_rows`).

`--devices N` alone: data parallel over N GPUs, the same tables.
`--devices N --layouts data,fsdp,tp,2d`: per width, the dense and 2:4 models
in each layout of `jsparse24.layouts` over N GPUs (`--batch` rows) and on
one GPU (`--batch` / N rows: data parallelism's rows per GPU): ms per step,
2:4 over dense, and each model's scaling from one GPU (`run_layouts`).

Default depths (`DEFAULTS`) fit JAX's default GPU memory pool on an 80 GB
H100 (75% of it, about 58 GiB); `memory_estimate` says what is counted.
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import time
import traceback
from collections.abc import Collection
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec as P

import jsparse24
from benchmarks import _common
from benchmarks._gpt import (GPT, HEAD_DIM, LR, MASK_DECAY, MASK_KINDS, POLICY_NOTES,
                             REMAT_POLICIES, SPARSE_LAYERS, WEIGHT_DECAY, at_count, layer_shapes,
                             lm_loss, make_train_step, make_update, mvue_rngs, sparse_options)

# d_model -> (blocks, remat) that fit the H100's default pool (`memory_estimate`).
# 2048 x 16 was the first choice by `memory_estimate`, but its 2:4 step needed
# 62 GiB on the H100 (XLA's rematerialization could not bring it under the
# 57 GiB pool), more than the estimate counts: 12 blocks fit both models.
DEFAULTS = {512: (8, False), 1024: (24, False), 2048: (12, False), 4096: (8, True), 8192: (2, True)}
POOL_GIB = 0.75 * 78  # JAX preallocates 75% of the GPU; an 80 GB H100 shows JAX ~78 GiB

# --small: where users start. d_model 128 and 256 with the examples' 2 blocks at
# 1,024, 2,048 and 4,096 tokens per step (sequences of 64 bytes, as in
# train_lm's CPU preset, which is the first d_model 128 row), then the shapes
# that examples/train_lm.py and examples/sharded_train.py train by default on
# a GPU (`small_rows`), all on the examples' byte vocabulary.
SMALL_WIDTHS = (128, 256)
SMALL_BATCHES = (16, 32, 64)
SMALL_SEQ = 64
SMALL_LAYERS = 2
# sharded_train's row: one GPU's share of its default run, data parallel over
# this many GPUs (each multiplies its own rows of every product).
SHARDED_GPUS = 4
# Rounds of `_common.in_turn` for the rows whose dense and 2:4 steps are
# timed in turn (no cuSPARSELt product in the 2:4 model): 5 x 2 runs of >= 1 s.
IN_TURN_ROUNDS = 5


def small_rows() -> tuple[list[dict], int]:
  """(rows, vocabulary) of `--small`: each row {"d_model", "layers", "batch",
  "seq", "label"}. The examples' rows take train_lm's preset for a GPU
  (`DEFAULT_SIZES`), so that they follow the examples' defaults."""
  # Imported here: only --small needs the examples (and their extra, tqdm).
  from examples import train_lm as lm  # pylint: disable=g-import-not-at-top
  small = lm.PRESETS["small"]
  rows = []
  for d in SMALL_WIDTHS:
    for batch in SMALL_BATCHES:
      shape = (d, SMALL_LAYERS, batch, SMALL_SEQ)
      example = shape == (small["d_model"], small["layers"], small["batch"], small["seq_len"])
      rows.append({"d_model": d, "layers": SMALL_LAYERS, "batch": batch, "seq": SMALL_SEQ,
                   "label": "train_lm's CPU default (--size small)" if example else "small end"})
  size = lm.DEFAULT_SIZES["gpu"]
  gpu = lm.PRESETS[size]
  if gpu["batch"] % SHARDED_GPUS:
    raise ValueError(f"small_rows: train_lm's {size!r} preset has {gpu['batch']} sequences per"
                     f" step, not a multiple of SHARDED_GPUS {SHARDED_GPUS}: choose a divisor.")
  for batch, label in ((gpu["batch"], f"train_lm's GPU default (--size {size})"),
                       (gpu["batch"] // SHARDED_GPUS,
                        f"sharded_train's GPU default (--size {size}), the rows of 1 of"
                        f" {SHARDED_GPUS} GPUs")):
    rows.append({"d_model": gpu["d_model"], "layers": gpu["layers"], "batch": batch,
                 "seq": gpu["seq_len"], "label": label})
  return rows, lm.VOCAB


def memory_estimate(params: int, d: int, layers: int, remat: bool, tokens: int,
                    vocab: int, saves_dots: bool = False,
                    saves_compressed: bool = False) -> dict[str, float]:
  """Peak device bytes of the 2:4 training step (the larger of the two), by part.

  The timed steps donate their params and optimizer state, so the state is
  held once. Activations: a block saves about 18 bf16 `[tokens, d]` tensors
  for its backward pass (LayerNorm inputs and outputs, q/k/v, the attention
  output, the residual, and the 4d-wide MLP input and GELU output); with remat
  only its input, plus one block's worth while it is recomputed, and with a
  policy that saves the matmul outputs (`saves_dots`) those too: 9 bf16
  `[tokens, d]` per block (qkv 3d, out d, up 4d, down d). The compressed
  weights: with remat one block's, unless the policy saves them
  (`saves_compressed`), then every block's, as without remat.
  """
  linear = 12 * d * d * layers
  parts = {
      "state": 16 * params,  # f32 params, AdamW's two moments, grads
      "masks": 2 * linear / 8,  # packed, 1 bit/weight: held, and the update's new ones
      "weights": 2 * linear,  # bf16 copies of the kernels the products read
      # 2:4 operands kept for dx
      "compressed": (1 if remat and not saves_compressed else layers) * 12 * d * d * 1.2,
      "activations": ((2 + 18 * saves_dots) * layers + 36) * d * tokens if remat
                     else 36 * d * tokens * layers,
      "logits": 12 * tokens * vocab,  # bf16 logits, their f32 upcast and its gradient
  }
  return {**parts, "total": sum(parts.values())}


# --- training steps ------------------------------------------------------------------


_fingerprint = jax.jit(lambda tree: jax.tree.map(
    lambda a: jnp.sum(jnp.abs(a.astype(jnp.float32))), tree))


def _signature(tree):
  shapes = jax.tree.map(lambda a: (tuple(a.shape), jnp.dtype(a.dtype)), tree)
  return jax.tree.structure(tree), shapes


def masks_by_layer(sparsity) -> dict[str, jsparse24.Mask24]:
  """{"blocks/qkv": Mask24, ...} of a "sparsity" collection."""
  flat = traverse_util.flatten_dict(sparsity, sep="/")
  return {path.removesuffix("/mask"): m for path, m in flat.items() if path.endswith("/mask")}


def masked_params(params, sparsity):
  """`params` with every sparse layer's kernel times its mask: the dense model
  applied to them computes what the 2:4 model computes."""
  masks = masks_by_layer(sparsity)

  def mask(path, a):
    layer = "/".join(k.key for k in path).removesuffix("/kernel")
    return jnp.where(masks[layer].unpack(), a, 0) if layer in masks else a

  return jax.tree_util.tree_map_with_path(mask, params)


# --- breakdown parts ---------------------------------------------------------------------


def time_fwd_bwd(timer, fn, params, rest, x, dy, passes: int) -> float:
  """Seconds per step of `fn(params, rest, x)`: forward + `jax.vjp` with
  respect to `params` and `x`, plus `passes - 1` more forwards (remat's
  recomputation)."""

  @jax.jit
  def fwd_bwd(params, rest, x, dy):
    y, vjp = jax.vjp(lambda p, x: fn(p, rest, x), params, x)
    return y, *vjp(dy)

  t = timer(fwd_bwd, params, rest, x, dy)
  return t + (passes - 1) * timer(jax.jit(fn), params, rest, x) if passes > 1 else t


def time_linear(timer, layer, k: int, n: int, batch: int, seq: int,
                passes: int, rngs: dict | None = None) -> dict[str, float]:
  """Seconds per step of one linear layer (y, dx, dw) on bf16 activations,
  with its float32 kernel (and, for SparseDense, the stored mask from
  `init`); and of compressing its kernel, where a GPU backend can."""
  kx, kd, kp = jax.random.split(jax.random.key(k * 7 + n), 3)
  x = jax.random.normal(kx, (batch, seq, k), jnp.bfloat16)
  dy = jax.random.normal(kd, (batch, seq, n), jnp.bfloat16)
  variables = jax.jit(layer.init)(kp, x)
  params, rest = variables["params"], {c: v for c, v in variables.items() if c != "params"}
  out = {"step": time_fwd_bwd(timer, lambda p, r, x: layer.apply({"params": p, **r}, x,
                                                                 rngs=rngs),
                              params, rest, x, dy, passes)}
  if "sparsity" in rest and jsparse24.available_implementations()["pallas"] is None:
    mask = rest["sparsity"]["mask"]
    compress = jax.jit(lambda w, m: jsparse24.compress(w, m, transposed=m.transposable))
    out["compress"] = timer(compress, params["kernel"].astype(jnp.bfloat16), mask) * passes
  return out


def time_attention(timer, d: int, batch: int, seq: int, implementation, passes: int) -> float:
  """Seconds per step of the model's attention call (q, k, v -> dq, dk, dv)."""
  shape = (batch, seq, d // HEAD_DIM, HEAD_DIM)
  kq, kk, kv, kd = jax.random.split(jax.random.key(d), 4)
  q, k, v, do = (jax.random.normal(key, shape, jnp.bfloat16) for key in (kq, kk, kv, kd))

  def attention(kv, _, q):
    return jax.nn.dot_product_attention(q, *kv, is_causal=True, implementation=implementation)

  return time_fwd_bwd(timer, attention, (k, v), None, q, do, passes)


def time_optimizer(timer, tx, params, opt_state, count: int | None = None,
                   **update_args) -> float:
  """Seconds of `tx.update` + `optax.apply_updates` over the whole params tree
  (`update_args`: `make_update`'s)."""
  grads = jax.jit(lambda t: jax.tree.map(lambda a: jnp.full_like(a, 1e-3), t))(params)
  at = None if count is None else functools.partial(at_count, count=count)
  run, _ = _common.threaded(make_update(tx, **update_args), params, opt_state, at)
  return timer(run, grads)


# --- one width --------------------------------------------------------------------------


# cuSPARSELt taxes the rest of its process: once a cuSPARSELt matmul has run
# in a CUDA context, that context's compute-bound kernels (cuBLAS GEMMs, cuDNN
# attention) run 2-7% slower until the process ends, memory-bound ones do not,
# and the idle GPU draws ~13 W more (the same with PyTorch's
# `torch._cslt_sparse_mm`: it is the sparse MMA instruction's;
# docs/design_notes.md, "Dense baselines are timed before the first sparse
# product"). The dense model of a user's dense run never pays it; timed
# after a 2:4 step in the same process it would, and the ratio would flatter
# the 2:4 model by ~4%. So every width's dense model is timed first (`run_dense`, all
# widths), then every 2:4 model (`run_sparse`; those without a cuSPARSELt
# product first), and the dense step's timing once the 2:4 steps have run is
# reported beside the ratio, not used in it.


def setup_width(cfg: dict, result: dict) -> dict:
  """What both models of one width share: the models, tokens, mesh; prints
  the memory estimate and the automatic backend per layer."""
  d, layers, remat = result["d_model"], result["layers"], result["remat"]
  batch, seq, vocab = cfg["batch"], cfg["seq"], cfg["vocab"]
  # --devices N: data parallel over a 1-D mesh of N GPUs, the batch split over
  # them, params and optimizer state replicated; one jax.jit step partitioned
  # by XLA (jsparse24's products keep each device's rows).
  mesh = jax.sharding.Mesh(jax.local_devices()[:cfg["devices"]], ("data",))
  model = GPT(vocab, d, layers, seq, cfg["attention"], remat, remat_policy=cfg["remat_policy"])
  key_data, key_init = jax.random.split(jax.random.key(0))
  tokens = jax.device_put(jax.random.randint(key_data, (batch, seq + 1), 0, vocab, jnp.int32),
                          NamedSharding(mesh, P("data")))
  dense_shapes = jax.eval_shape(model.init, key_init, tokens[:, :-1])["params"]
  n_params = sum(math.prod(a.shape) for a in jax.tree.leaves(dense_shapes))
  mem = memory_estimate(n_params, d, layers, remat, batch * seq, vocab,
                        saves_dots=cfg["remat_policy"].startswith("dots"),
                        saves_compressed=cfg["remat_policy"].endswith("compressed"))
  result.update(params=n_params, sparse_weights=12 * d * d * layers,
                memory_estimate_gib={k: v / 2**30 for k, v in mem.items()})
  limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
  pool, whose = (limit / 2**30, "this device's") if limit else (POOL_GIB, "an 80 GB H100's")
  parts = ", ".join(f"{k} {v / 2**30:.1f}" for k, v in mem.items() if k != "total")
  print(f"{_tag(result)} {layers} blocks{' (remat)' if remat else ''}, {d // HEAD_DIM} heads,"
        f" {n_params / 1e6:,.0f}M params; memory estimate {mem['total'] / 2**30:.1f} GiB"
        f" ({parts}); {whose} pool {pool:.1f} GiB"
        + (": MAY NOT FIT" if mem["total"] / 2**30 > pool else ""), flush=True)
  # The layers' mask kind: --mask, or the library's default (transposable
  # where the output size is a multiple of 4: every layer here).
  transposable = MASK_KINDS[cfg["mask"]].get("transposable")
  result["implementations"] = {
      kind: jsparse24.selected_implementation(
          (batch // cfg["devices"], seq, k), (k, n), jnp.bfloat16, transposable=transposable)
      for kind, (k, n) in layer_shapes(d).items()}
  print(f"{_tag(result)} automatic 2:4 backend per layer: {result['implementations']}", flush=True)
  return {"model": model, "key_init": key_init, "tokens": tokens, "dense_shapes": dense_shapes,
          "whole": functools.partial(jax.device_put, device=NamedSharding(mesh, P())),
          "adamw": optax.adamw(LR, weight_decay=WEIGHT_DECAY),
          # One jitted init of the dense model for its first timing and the one
          # after the 2:4 steps (`run_sparse`): traced once where caches are kept.
          "dense_init": jax.jit(model.init)}


def _phase(result: dict, name: str) -> None:
  result["phase"] = name
  print(f"{_tag(result)} {name}", flush=True)


def run_dense(cfg: dict, timer, result: dict, ctx: dict, step_timer=None) -> None:
  """The dense model of one width (before any 2:4 step has run in this
  process): its training step and, where the width has a breakdown, AdamW
  alone and the breakdown's other dense parts. Fills `result["dense"]`;
  keeps the compiled step in `ctx`."""
  step_timer = step_timer or timer
  d, tokens, whole, adamw = result["d_model"], ctx["tokens"], ctx["whole"], ctx["adamw"]
  model, key_init = ctx["model"], ctx["key_init"]
  _phase(result, "dense: init, compile, first step")
  params = whole(ctx["dense_init"](key_init, tokens[:, :-1])["params"])
  ctx["fingerprint"] = jax.tree.leaves(jax.tree.map(float, _fingerprint(params)))
  opt_state = jax.jit(adamw.init)(params)
  step, compile_s = _common.compile_step(
      make_train_step(lambda p, _, x: model.apply({"params": p}, x), adamw),
      params, opt_state, tokens)
  params, opt_state, loss = step(params, opt_state, tokens)
  dense = result["dense"] = {"compile_s": compile_s, "first_loss": float(loss)}
  print(f"{_tag(result)} dense: train step compiled in {compile_s:.1f} s, first-step loss"
        f" {dense['first_loss']:.4f}", flush=True)

  _phase(result, "dense: timing")
  run, state = _common.threaded(step, params, opt_state)
  dense["step_ms"] = step_timer(run, tokens) * 1e3
  dense["tokens_per_s"] = cfg["batch"] * cfg["seq"] / dense["step_ms"] * 1e3
  print(f"{_tag(result)} dense: {dense['step_ms']:.2f} ms/step, {dense['tokens_per_s']:,.0f}"
        f" tokens/s", flush=True)
  # AdamW alone is a part of the breakdown, and read by it only: a width
  # without one (several devices, or a remat policy that saves something)
  # compiles no optimizer-only program.
  breaks_down = has_breakdown(cfg, result["remat"])
  if breaks_down:
    _phase(result, "dense: AdamW alone")
    dense["optimizer_ms"] = time_optimizer(timer, adamw, state["params"], state["opt"]) * 1e3
  ctx["dense_step"] = step  # timed again after the 2:4 step (`run_sparse`)
  del params, opt_state, run, state
  if breaks_down:
    _phase(result, "dense: breakdown parts (linear layers, attention)")
    result["breakdown_dense"] = breakdown_parts(cfg, timer, result, sparse=False)
  del result["phase"]


def plain_update_args(cfg: dict) -> dict:
  """mask_update's extra `update` argument for a step that rebuilds no mask:
  the host's answer (`mask_rebuild=False`, no rebuild work in the program),
  or none under --rebuild-flag (the run-time flag decides)."""
  return {} if cfg["rebuild_flag"] else {"mask_rebuild": False}


def count_pin(cfg: dict, count: int):
  """`_common.threaded`'s `at` for timing a 2:4 step that rebuilds no mask:
  mask_update's count pinned at `count` under --rebuild-flag, where the
  step reads the count to decide a rebuild; else None. A step compiled with
  `mask_rebuild=False` computes the same at any count, and pinning it would
  add a program dispatch per step that a training loop does not make (at
  the small end the host's time per step is the step's time)."""
  return functools.partial(at_count, count=count) if cfg["rebuild_flag"] else None


def sparse_steps(cfg: dict, schedule, apply, tx, params, opt_state, tokens,
                 out_shardings=None, rebuilds: bool = True):
  """(plain step, rebuild step, first step, compile seconds) of a 2:4 model,
  compiled for `params, opt_state, tokens`. As examples/train_lm.py trains,
  the host's schedule says which updates rebuild masks
  (`MaskSchedule.update_rebuilds`, mask_update's static `mask_rebuild`): a
  step that rebuilds none carries none of the rebuild's work or
  conditionals, and one that does is a program of its own (compiled only
  where `rebuilds`, else None). The first step (count 0) is whichever the
  schedule asks for. --rebuild-flag: one program for all three, deciding
  on mask_update's run-time flag, as a step written without `mask_rebuild`
  does."""
  def compiled(**update_args):
    return _common.compile_step(make_train_step(apply, tx, out_shardings, **update_args),
                                params, opt_state, tokens)
  if cfg["rebuild_flag"]:
    step, seconds = compiled()
    return step, step, step, seconds
  first_rebuilds = schedule.update_rebuilds(0, len(jsparse24.optim.layer_names(opt_state)))
  plain, seconds = compiled(**plain_update_args(cfg))
  rebuild = None
  if rebuilds or first_rebuilds:
    rebuild, rebuild_s = compiled(mask_rebuild=True)
    seconds += rebuild_s
  return plain, rebuild, rebuild if first_rebuilds else plain, seconds


def run_sparse(cfg: dict, timer, result: dict, ctx: dict, step_timer=None) -> None:
  """The 2:4 model of one width, after `run_dense` of every width: its
  training step (one that rebuilds nothing, and one that rebuilds), where
  the width has a breakdown mask_update + AdamW alone and the 2:4 parts of
  the breakdown; then the dense step again, in this process that has now
  run the 2:4 steps. Fills `result["sparse"]`, the ratios and the
  breakdown."""
  step_timer = step_timer or timer
  d, tokens, whole, adamw = result["d_model"], ctx["tokens"], ctx["whole"], ctx["adamw"]
  model, key_init, dense = ctx["model"], ctx["key_init"], result["dense"]
  tokens_per_step = cfg["batch"] * cfg["seq"]
  sparse = jsparse24.sparsify(model, {SPARSE_LAYERS: sparse_options(cfg)})
  _phase(result, "2:4: init, compile, first step")
  variables = whole(jax.jit(sparse.init)(key_init, tokens[:, :-1]))
  params = variables["params"]
  if _signature(params) != _signature(ctx["dense_shapes"]):
    raise AssertionError("the 2:4 model's params tree differs from the dense model's")
  # Two compiled init programs may round an initializer differently by an ulp.
  if not all(math.isclose(a, b, rel_tol=1e-5) for a, b in
             zip(jax.tree.leaves(jax.tree.map(float, _fingerprint(params))), ctx["fingerprint"])):
    raise AssertionError("the 2:4 model's initial params differ from the dense model's")
  result["mask_shapes"] = {path: list(m.shape)
                           for path, m in masks_by_layer(variables["sparsity"]).items()}
  print(f"{_tag(result)} 2:4 masks (path: stacked shape): {result['mask_shapes']}", flush=True)
  rebuild_every = cfg["rebuild_every"]
  schedule = jsparse24.optim.MaskSchedule(rebuild_every=rebuild_every)
  tx = optax.chain(jsparse24.optim.mask_update(variables["sparsity"], schedule, decay=MASK_DECAY),
                   adamw)
  opt_state = jax.jit(tx.init)(params)
  del variables
  # The 2:4 model must compute the dense model on the masked kernels. (Against
  # the dense model itself its loss agrees only statistically: the final
  # LayerNorm makes any model's loss at init about ln(vocab) + 1/2.)
  reference = float(jax.jit(lambda p, s, t: lm_loss(
      model.apply({"params": masked_params(p, s)}, t[:, :-1]), t))(
          params, jsparse24.optim.masks(opt_state), tokens))
  step, rebuild_step, first, compile_s = sparse_steps(
      cfg, schedule, lambda p, o, x: sparse.apply(
          {"params": p, "sparsity": jsparse24.optim.masks(o)}, x, rngs=mvue_rngs(cfg, o[0].count)),
      tx, params, opt_state, tokens)
  params, opt_state, loss = first(params, opt_state, tokens)
  sp = result["sparse"] = {"compile_s": compile_s, "first_loss": float(loss),
                           "reference_loss": reference,
                           "rebuilds": "run-time flag" if cfg["rebuild_flag"] else "host"}
  print(f"{_tag(result)} 2:4: train step compiled in {compile_s:.1f} s, first-step loss"
        f" {sp['first_loss']:.4f} (dense model on the masked kernels {reference:.4f};"
        f" dense model {dense['first_loss']:.4f})", flush=True)
  if not (math.isfinite(sp["first_loss"])
          and abs(sp["first_loss"] - reference) <= 1e-2 * reference):
    raise AssertionError(f"2:4 first-step loss {sp['first_loss']} is not finite or differs from"
                         f" the dense model's on the masked kernels ({reference}) by more than 1%")

  # The timed calls check it: `last_rebuild` stays 0, then becomes R.
  plain, rebuild = 0, rebuild_every - 1
  _phase(result, "2:4: timing (no rebuild" + (f"; mask_update count pinned at {plain})"
                                              if cfg["rebuild_flag"] else ")"))
  run, state = _common.threaded(step, params, opt_state, count_pin(cfg, plain))
  # No cuSPARSELt product, no tax to keep the dense step from (the comment
  # above `setup_width`): the two steps are timed in turn, so that the
  # host's drift between a timing and the next (small models are bound by
  # the host) is not read as a difference between the models.
  in_turn = not uses_cusparselt(result)
  if in_turn:
    dense_params = whole(ctx["dense_init"](key_init, tokens[:, :-1])["params"])
    dense_run, _ = _common.threaded(ctx["dense_step"], dense_params,
                                    jax.jit(adamw.init)(dense_params))
    del dense_params
    times = _common.in_turn({"dense": dense_run, "2:4": run}, tokens, rounds=IN_TURN_ROUNDS,
                            quick=cfg["quick"])
    sp["step_ms"], dense["step_ms_in_turn"] = times["2:4"] * 1e3, times["dense"] * 1e3
    del dense_run
  else:
    sp["step_ms"] = step_timer(run, tokens) * 1e3
  sp["tokens_per_s"] = tokens_per_step / sp["step_ms"] * 1e3
  # Where the step ran: the devices holding its params, and the split of its batch.
  sp["devices"] = len(jax.tree.leaves(state["params"])[0].sharding.device_set)
  sp["batch_split"] = len(tokens.sharding.device_set)
  last = int(state["opt"][0].last_rebuild)
  if last != 0:
    raise AssertionError(f"a timed 2:4 step rebuilt the masks (last_rebuild={last})")
  result["ratio_dense"] = "in turn" if in_turn else "first"
  result["ratio"] = (dense["step_ms_in_turn"] if in_turn else dense["step_ms"]) / sp["step_ms"]
  print(f"{_tag(result)} 2:4: {sp['step_ms']:.2f} ms/step, {sp['tokens_per_s']:,.0f} tokens/s,"
        f" {result['ratio']:.3f}x dense"
        + (f" (dense timed in turn with it: {dense['step_ms_in_turn']:.2f} ms/step)"
           if in_turn else ""), flush=True)

  _phase(result, f"2:4: timing a rebuild step (count pinned at {rebuild})")
  run, state = _common.threaded(rebuild_step, state["params"], state["opt"],
                                functools.partial(at_count, count=rebuild))
  sp["rebuild_step_ms"] = step_timer(run, tokens) * 1e3
  last = int(state["opt"][0].last_rebuild)
  if last != rebuild_every:
    raise AssertionError(f"the rebuild step did not rebuild (last_rebuild={last})")
  sp["rebuild_extra_ms_per_step"] = (sp["rebuild_step_ms"] - sp["step_ms"]) / rebuild_every
  result["ratio_with_rebuilds"] = result["ratio"] * sp["step_ms"] / (
      sp["step_ms"] + sp["rebuild_extra_ms_per_step"])
  print(f"{_tag(result)} 2:4 rebuild step: {sp['rebuild_step_ms']:.2f} ms, amortised over"
        f" {rebuild_every} steps {sp['rebuild_extra_ms_per_step']:.3f} ms/step", flush=True)
  if "breakdown_dense" in result:  # a part of the breakdown, as AdamW alone in `run_dense`
    _phase(result, "2:4: mask_update + AdamW alone")
    sp["optimizer_ms"] = time_optimizer(timer, tx, state["params"], state["opt"], plain,
                                        **plain_update_args(cfg)) * 1e3
  del params, opt_state, run, state, step, rebuild_step

  if in_turn:  # timed after 2:4 steps already
    dense["step_ms_after_sparse"] = dense["step_ms_in_turn"]
    ctx.pop("dense_step")
  else:
    _phase(result, "dense: timing again, in this process after the 2:4 steps")
    params = whole(ctx["dense_init"](key_init, tokens[:, :-1])["params"])
    run, state = _common.threaded(ctx.pop("dense_step"), params, jax.jit(adamw.init)(params))
    dense["step_ms_after_sparse"] = step_timer(run, tokens) * 1e3
    del params, run, state
  dense["after_sparse"] = dense["step_ms_after_sparse"] / dense["step_ms"] - 1
  print(f"{_tag(result)} dense again: {dense['step_ms_after_sparse']:.2f} ms/step"
        f" ({dense['after_sparse']:+.1%} over its timing before any 2:4 step; "
        + ("timed in turn with the 2:4 step, used in the ratio)" if in_turn else
           "not used in the ratio)"), flush=True)

  if "breakdown_dense" in result:
    _phase(result, "2:4: breakdown parts (linear layers, attention)")
    result["breakdown"] = breakdown(cfg, result, breakdown_parts(cfg, timer, result, sparse=True))
  del result["phase"]


def attempt(result: dict, fn, *args, label: str | None = None) -> bool:
  """`fn(*args)`; an exception (an out-of-memory too) is recorded in
  `result` ("status", "error") and printed, and the run goes on to the next
  width or layout. Frees the buffers and compiled programs after."""
  label = label or _tag(result)
  t0 = time.time()
  try:
    fn(*args)
    ok = True
  except Exception as e:  # pylint: disable=broad-except  (OOM too: on to the next width)
    traceback.print_exc()
    result["status"] = f"FAILED in {result.get('phase', 'setup')}: {type(e).__name__}"
    result["error"] = traceback.format_exc()
    print(f"{label} {result['status']}", flush=True)
    ok = False
  print(f"{label} {fn.__name__} done in {time.time() - t0:.0f} s", flush=True)
  gc.collect()
  jax.clear_caches()
  return ok


def uses_cusparselt(result: dict) -> bool:
  """Whether the automatic choice runs a product of this row's 2:4 model on cuSPARSELt."""
  return "cusparselt" in result.get("implementations", {}).values()


def run_widths(cfg: dict, rows: list[dict], timer, step_timer) -> list[dict]:
  """Every row's dense model, then every row's 2:4 model (the comment above
  `setup_width` says why). `rows`: {"d_model", "layers", "remat", "batch",
  "seq"} and, under --small, "label"; a row's batch x seq replaces `cfg`'s
  (several rows may share a width)."""
  results, contexts, row_cfgs = [], {}, {}

  def dense_part(i, result):
    contexts[i] = setup_width(row_cfgs[i], result)
    run_dense(row_cfgs[i], timer, result, contexts[i], step_timer)

  for i, row in enumerate(rows):
    result = {**row, "status": "ok"}
    results.append(result)
    row_cfgs[i] = {**cfg, "batch": row["batch"], "seq": row["seq"]}
    if not attempt(result, dense_part, i, result):
      contexts.pop(i, None)
  # The 2:4 models that run no cuSPARSELt product (the automatic choice at
  # the narrow widths) first, in a process that has not paid the tax either.
  for i in sorted(range(len(results)), key=lambda i: uses_cusparselt(results[i])):
    if i in contexts:
      attempt(results[i], run_sparse, row_cfgs[i], timer, results[i], contexts.pop(i),
              step_timer)
  return results


def _tag(result: dict) -> str:
  """The prefix of a row's progress lines: its width, and under --small (rows
  that share a width) its batch x seq too."""
  shape = f", {result['batch']}x{result['seq']}" if "label" in result else ""
  return f"[d_model {result['d_model']}{shape}]"


def has_breakdown(cfg: dict, remat: bool) -> bool:
  """Whether a width gets the breakdown: its parts are one-device programs,
  and they time remat's recomputed forward pass as a whole forward pass
  (products and compression included), which a policy that saves anything
  does not run."""
  return cfg["devices"] == 1 and not (remat and cfg["remat_policy"] != "nothing")


def breakdown_parts(cfg: dict, timer, result: dict, sparse: bool) -> dict:
  """One model's parts at the model's shapes, each its own jitted program:
  every layer kind's fwd+bwd (nn.Dense, or SparseDense with the width's
  sparse options) and the attention call, per block."""
  d, remat = result["d_model"], result["remat"]
  batch, seq = cfg["batch"], cfg["seq"]
  passes = 2 if remat else 1  # forward passes per step: remat recomputes each block's
  layers = {}
  for kind, (k, n) in layer_shapes(d).items():
    if sparse:
      t = time_linear(timer, jsparse24.SparseDense(n, use_bias=False, dtype=jnp.bfloat16,
                                                   **sparse_options(cfg)),
                      k, n, batch, seq, passes, mvue_rngs(cfg, 0))
    else:
      t = time_linear(timer, nn.Dense(n, use_bias=False, dtype=jnp.bfloat16), k, n, batch, seq,
                      passes)
    layers[kind] = {"ms": t["step"] * 1e3,
                    "compress_ms": t["compress"] * 1e3 if "compress" in t else None}
    print(f"{_tag(result)} {'2:4' if sparse else 'dense'} {kind} {k}x{n}: {t['step'] * 1e3:.3f} ms"
          + (f" ({result['implementations'][kind]})" if sparse else ""), flush=True)
  attention = time_attention(timer, d, batch, seq, cfg["attention"], passes) * 1e3
  print(f"{_tag(result)} {'2:4' if sparse else 'dense'} model's process: attention"
        f" {attention:.3f} ms per block", flush=True)
  return {"layers": layers, "attention_ms": attention * result["layers"]}


def breakdown(cfg: dict, result: dict, sparse_parts: dict) -> dict:
  """Splits both steps into the parts (`breakdown_parts` of each model,
  timed in its model's phase) and derives the ceilings."""
  layers, remat = result["layers"], result["remat"]
  passes = 2 if remat else 1
  dense_parts = result.pop("breakdown_dense")
  per_layer = {
      kind: {"k": k, "n": n, "implementation": result["implementations"][kind],
             "dense_ms": dense_parts["layers"][kind]["ms"],
             "sparse_ms": sparse_parts["layers"][kind]["ms"],
             "compress_ms": sparse_parts["layers"][kind]["compress_ms"]}
      for kind, (k, n) in layer_shapes(result["d_model"]).items()}
  dense_step, sparse_step = result["dense"]["step_ms"], result["sparse"]["step_ms"]
  out = {"layers": per_layer, "attention_dense_ms": dense_parts["attention_ms"],
         "attention_sparse_ms": sparse_parts["attention_ms"]}
  out["linear_dense_ms"] = sum(p["dense_ms"] for p in per_layer.values()) * layers
  out["linear_sparse_ms"] = sum(p["sparse_ms"] for p in per_layer.values()) * layers
  compress = [p["compress_ms"] for p in per_layer.values()]
  out["compress_ms"] = None if None in compress else sum(compress) * layers
  opt_dense, opt_sparse = result["dense"]["optimizer_ms"], result["sparse"]["optimizer_ms"]
  out["mask_update_ms"] = opt_sparse - opt_dense
  out["mask_update_pct"] = 100 * out["mask_update_ms"] / sparse_step
  out["other_dense_ms"] = (dense_step - out["linear_dense_ms"] - out["attention_dense_ms"]
                           - opt_dense)
  out["other_sparse_ms"] = (sparse_step - out["linear_sparse_ms"] - out["attention_sparse_ms"]
                            - opt_sparse)
  # (a) y (every forward pass, the recomputed one too) and dx at half cost,
  # dw dense: 1.5x on the products without remat, 1.6x with.
  # With the MVUE weight gradient dw is at half cost too: 2x.
  dw_cost = 0.5 if cfg["weight_grad"] == "mvue" else 1.0
  products = (0.5 * passes + 0.5 + dw_cost) / (passes + 2)
  linear = out["linear_dense_ms"]
  out["ceiling_bound"] = dense_step / (dense_step - linear + linear * products)
  # (b) the dense step with its linear layers, attention and optimizer
  # swapped for the ones measured in the 2:4 model's phase.
  out["ceiling_measured"] = dense_step / (
      dense_step - linear - out["attention_dense_ms"] - opt_dense
      + out["linear_sparse_ms"] + out["attention_sparse_ms"] + opt_sparse)
  return out


# --- layouts (--layouts) ----------------------------------------------------------------


# Megatron tensor parallelism of each block under the layouts "tp" and "2d"
# (`jsparse24.layouts`): `qkv` and `up` column-parallel (attention splits by
# heads, as `_gpt`'s head-major `qkv` columns allow), `out` and `down`
# row-parallel: two all-reduces per block.
TENSOR_PARALLEL = {"blocks/qkv": "column", "blocks/out": "row", "blocks/up": "column",
                   "blocks/down": "row"}
ONE_GPU = "1 GPU"  # the placement every layout's scaling is measured against


def make_layout(name: str, devices, model_devices: int | None) -> jsparse24.layouts.Layout:
  """Layout `name` over `devices` (`model_devices` on the model axis of
  "tp" and "2d"; None: `jsparse24.layouts.make_mesh`'s default)."""
  mesh = jsparse24.layouts.make_mesh(name, devices,
                                     model_devices if name in ("tp", "2d") else None)
  return jsparse24.layouts.Layout(name, mesh, TENSOR_PARALLEL)


def logits_sharding(layout: jsparse24.layouts.Layout) -> NamedSharding | None:
  """Under "tp" and "2d", the logits' rows split over every GPU of the mesh
  (None otherwise: the batch sharding already splits them). Megatron's
  blocks leave the activations whole on each GPU of the model axis, and the
  output head after them is the largest product of the model (d_model x
  vocab: at 4096 x 32768 twice `up`'s): left to follow the activations, every
  GPU of the model axis would multiply it, and run the loss, on every row.
  Split by rows, each GPU takes its own rows of the activations it holds (no
  exchange) and the head's weight gradient is summed over the mesh."""
  if layout.name not in ("tp", "2d"):
    return None
  return NamedSharding(layout.mesh, P(("data", "model")))


def make_apply(cfg: dict, net: nn.Module, layout: jsparse24.layouts.Layout,
               sparse_layers: Collection[str]):
  """(params, opt_state, tokens) -> logits of `net` in `layout`: the params
  constrained to the layout inside the step (`Layout.constrain`), the masks
  read from mask_update's state when `sparse_layers` (the 2:4 layers' paths)
  is not empty, the logits laid out by `logits_sharding`."""
  rows = logits_sharding(layout)

  def apply(p, o, x):
    p = layout.constrain(p, sparse_layers)
    if not sparse_layers:
      logits = net.apply({"params": p}, x)
    else:
      logits = net.apply({"params": p, "sparsity": jsparse24.optim.masks(o)}, x,
                         rngs=mvue_rngs(cfg, o[0].count))
    return logits if rows is None else jax.lax.with_sharding_constraint(logits, rows)

  return apply


def sparse_model(cfg: dict, model: nn.Module, layout: jsparse24.layouts.Layout):
  """The 2:4 model: the four layers of every block 2:4, each with the
  layout's `kernel_sharding` for its tensor-parallel role (each device
  prunes, compresses and multiplies its own block under "tp" and "2d";
  under "data" the whole kernel, so that each device's backend is chosen
  for its own rows; None under "fsdp")."""
  options = sparse_options(cfg)
  return jsparse24.sparsify(model, [
      (rf".*/{path.split('/')[-1]}",
       {**options, "kernel_sharding": layout.kernel_sharding(role)})
      for path, role in TENSOR_PARALLEL.items()])


def one_device_losses(cfg: dict, ctx: dict) -> dict[str, float]:
  """The first-step losses every layout must reproduce, on one device and
  the whole global batch: the dense model's, and the dense model's on the
  2:4 model's initial masked kernels (what the 2:4 model computes)."""
  device = jax.local_devices()[0]
  model, tokens = ctx["model"], jax.device_put(ctx["tokens"], device)
  sample = jnp.zeros((1, cfg["seq"]), jnp.int32)
  variables = jax.jit(jsparse24.sparsify(model, {SPARSE_LAYERS: sparse_options(cfg)}).init,
                      out_shardings=jax.sharding.make_single_device_sharding(device))(
                          ctx["key_init"], sample)
  loss = jax.jit(lambda p, t: lm_loss(model.apply({"params": p}, t[:, :-1]), t))
  params = variables["params"]
  return {"dense": float(loss(params, tokens)),
          "2:4": float(loss(jax.jit(masked_params)(params, variables["sparsity"]), tokens))}


def _shard_shapes(params, opt_state) -> dict[str, list[int]]:
  """Each device's block of a few arrays of the state (device 0's), to see
  the layout: the MLP and attention kernels, the token embedding, AdamW's
  first moment of `up`'s kernel and, for the 2:4 model, `up`'s packed mask."""
  def block(a):
    return list(a.addressable_shards[0].data.shape)

  blocks = params["blocks"]
  out = {f"params/blocks/{name}/kernel": block(blocks[name]["kernel"])
         for name in ("qkv", "up", "down")}
  out["params/embed/embedding"] = block(params["embed"]["embedding"])
  out["adamw_mu/blocks/up/kernel"] = block(
      optax.tree_utils.tree_get(opt_state, "mu")["blocks"]["up"]["kernel"])
  if isinstance(opt_state[0], jsparse24.optim.MaskUpdateState):
    out["mask/blocks/up"] = block(jsparse24.optim.masks(opt_state)["blocks"]["up"]["mask"].packed)
  return out


def time_placement(cfg: dict, step_timer, ctx: dict, layout: jsparse24.layouts.Layout,
                   batch: int, sparse: bool, out: dict) -> None:
  """One model (dense, or 2:4 when `sparse`) in one layout, on `batch` rows
  of the width's tokens: its params and optimizer state made in the layout's
  shardings and kept there by the step (`out_shardings`; the masks laid out
  like their kernels), the params constrained inside the step
  (`Layout.constrain`), the first step's loss checked against one device's
  (`one_device_losses`, on the whole global batch), then the step timed (a
  2:4 step that rebuilds no mask). Fills `out`."""
  name = "2:4" if sparse else "dense"
  out["phase"] = f"{name}: init, compile, first step"
  model, mesh = ctx["model"], layout.mesh
  tokens = jax.device_put(ctx["tokens"][:batch], layout.batch_sharding)
  net = sparse_model(cfg, model, layout) if sparse else model
  sample = jnp.zeros((1, cfg["seq"]), jnp.int32)
  variables = jax.jit(net.init, out_shardings=layout.state_shardings(
      jax.eval_shape(net.init, ctx["key_init"], sample)))(ctx["key_init"], sample)
  params, tx = variables["params"], ctx["adamw"]
  if sparse:
    schedule = jsparse24.optim.MaskSchedule(rebuild_every=cfg["rebuild_every"])
    tx = optax.chain(jsparse24.optim.mask_update(variables["sparsity"], schedule,
                                                 decay=MASK_DECAY), tx)
  del variables
  opt_state = jax.jit(tx.init, out_shardings=layout.state_shardings(
      jax.eval_shape(tx.init, params)))(params)
  sparse_layers = set()
  if sparse:  # each mask where its kernel's block is
    opt_state = jsparse24.optim.masks_like_kernels(opt_state, params)
    sparse_layers = set(jsparse24.optim.stats(opt_state))

  apply = make_apply(cfg, net, layout, sparse_layers)
  keep = jax.tree.map(lambda a: a.sharding, (params, opt_state)) + (NamedSharding(mesh, P()),)
  if sparse:  # no rebuild step timed here
    step, _, first, out["compile_s"] = sparse_steps(cfg, schedule, apply, tx, params, opt_state,
                                                    tokens, keep, rebuilds=False)
  else:
    step, out["compile_s"] = _common.compile_step(make_train_step(apply, tx, keep), params,
                                                  opt_state, tokens)
    first = step
  params, opt_state, loss = first(params, opt_state, tokens)
  out["first_loss"] = float(loss)
  if batch == len(ctx["tokens"]):
    reference = out["reference_loss"] = ctx["one_device_losses"][name]
    if not (math.isfinite(out["first_loss"])
            and abs(out["first_loss"] - reference) <= 1e-2 * reference):
      raise AssertionError(f"{name} first-step loss {out['first_loss']} in layout {layout.name!r}"
                           f" is not finite or differs from the same model's on one device"
                           f" ({reference}) by more than 1%")
  out["phase"] = f"{name}: timing"
  run, state = _common.threaded(step, params, opt_state, count_pin(cfg, 0) if sparse else None)
  del params, opt_state
  out["step_ms"] = step_timer(run, tokens) * 1e3
  out["tokens_per_s"] = batch * cfg["seq"] / out["step_ms"] * 1e3
  if sparse and int(state["opt"][0].last_rebuild) != 0:
    raise AssertionError("a timed 2:4 step rebuilt the masks")
  out["devices"] = len(jax.tree.leaves(state["params"])[0].sharding.device_set)
  out["shards"] = _shard_shapes(state["params"], state["opt"])
  del out["phase"]


def run_layouts(cfg: dict, widths: dict[int, dict], step_timer) -> list[dict]:
  """Per width, the dense and the 2:4 model on one GPU (`--batch` /
  `--devices` rows: the same rows per GPU as the data-parallel layout) and
  in every layout of `cfg["layouts"]` over `--devices` GPUs (`--batch`
  rows). Every width's dense placements run before any 2:4 one (the comment
  above `setup_width` says why)."""
  n, batch = cfg["devices"], cfg["batch"]
  devices = jax.local_devices()[:n]
  placements = [(ONE_GPU, batch // n)] + [(name, batch) for name in cfg["layouts"]]
  results, contexts = [], {}
  for d, shape in widths.items():
    result = {"d_model": d, **shape, "status": "ok", "layouts": {}}
    results.append(result)

    def prepare(result=result):
      ctx = contexts[result["d_model"]] = setup_width(cfg, result)
      _phase(result, "one-device losses")
      ctx["one_device_losses"] = result["one_device_losses"] = one_device_losses(cfg, ctx)
      del result["phase"]

    if not attempt(result, prepare):
      contexts.pop(d, None)
  for sparse in (False, True):
    for result in results:
      if result["d_model"] not in contexts:
        continue
      for name, rows in placements:
        layout = make_layout("data" if name == ONE_GPU else name,
                             devices[:1] if name == ONE_GPU else devices, cfg["model_devices"])
        out = result["layouts"].setdefault(name, {}).setdefault("2:4" if sparse else "dense",
                                                                {"status": "ok"})
        label = f"[d_model {result['d_model']}] {name} {'2:4' if sparse else 'dense'}:"
        if attempt(out, time_placement, cfg, step_timer, contexts[result["d_model"]], layout,
                   rows, sparse, out, label=label):
          print(f"{label} {out['step_ms']:.2f} ms/step, {out['tokens_per_s']:,.0f} tokens/s,"
                f" first loss {out['first_loss']:.4f} (compiled in {out['compile_s']:.0f} s);"
                f" device 0's MLP kernel blocks up"
                f" {out['shards']['params/blocks/up/kernel']}, down"
                f" {out['shards']['params/blocks/down/kernel']}", flush=True)
  for result in results:
    contexts.pop(result["d_model"], None)
    for name, models in result["layouts"].items():
      models.update(layout_ratios(models, result["layouts"].get(ONE_GPU, {}), n))
  return results


def layout_ratios(models: dict, one_gpu: dict, n: int) -> dict:
  """2:4 over dense (dense ms / 2:4 ms) in one placement, and each model's
  scaling from one GPU: its tokens/s over the one-GPU tokens/s (the one-GPU
  run has 1/n of the rows, so this is n x 1-GPU ms / n-GPU ms)."""
  def ms(m, model):
    v = m.get(model, {}).get("step_ms")
    return v if isinstance(v, float) else None

  out = {}
  if ms(models, "dense") and ms(models, "2:4"):
    out["ratio"] = ms(models, "dense") / ms(models, "2:4")
  for model in ("dense", "2:4"):
    if ms(models, model) and ms(one_gpu, model) and models is not one_gpu:
      out[f"scaling_{model}"] = (models[model]["tokens_per_s"]
                                 / one_gpu[model]["tokens_per_s"])
  if "scaling_dense" in out and "scaling_2:4" in out:
    out["scaling_gap"] = out["scaling_2:4"] / out["scaling_dense"] - 1
  return out


def layouts_table(r: dict, cfg: dict) -> str:
  n, batch = cfg["devices"], cfg["batch"]

  def cell(models, model):
    m = models.get(model, {})
    return m["step_ms"] if "step_ms" in m else m.get("status", "n/a")

  def mesh(name):
    if name == ONE_GPU:
      return "1"
    if name in ("tp", "2d"):
      model = cfg["model_devices"] or (n if name == "tp" else 2)
      return f"{n // model} x {model}"
    return str(n)

  rows = [[name, mesh(name), f"{batch // n if name == ONE_GPU else batch}x{cfg['seq']}",
           cell(m, "dense"), cell(m, "2:4"), m.get("ratio", "n/a"),
           m.get("scaling_dense", "n/a"), m.get("scaling_2:4", "n/a"),
           _percent(m.get("scaling_gap", "n/a"))]
          for name, m in r["layouts"].items()]
  return (f"d_model {r['d_model']}, {_blocks(r)} blocks:\n\n"
          + _common.table(["layout", "GPUs (data x model)", "tokens per step", "dense ms/step",
                           "2:4 ms/step",
                           "2:4 / dense (dense ms / 2:4 ms)", f"scaling 1 -> {n} GPUs dense",
                           f"scaling 1 -> {n} GPUs 2:4", "2:4 scaling / dense scaling - 1"],
                          rows))


def layouts_notes(cfg: dict) -> str:
  n, batch, seq = cfg["devices"], cfg["batch"], cfg["seq"]
  return (
      f"Layouts over {n} GPUs (`bench_model.py --layouts`): one `jax.jit` train step per"
      f" model and layout, the state made in the layout's shardings and kept there"
      f" (`out_shardings`), shardings from `jsparse24.layouts`. data: the batch split over"
      f" the GPUs, params and optimizer state replicated. fsdp: params and AdamW state sharded"
      f" over the GPUs at rest (last axis), gathered inside the step; the 2:4 kernels stay"
      f" sharded (each GPU compresses its own columns, the compressed arrays are gathered)."
      f" tp: Megatron tensor parallelism of each block (`qkv` and `up` column-parallel, so"
      f" attention splits by heads; `out` and `down` row-parallel; the 2:4 layers'"
      f" `kernel_sharding`), everything else replicated, the"
      f" batch split over the data axis, the output head and the loss on the rows split"
      f" over every GPU (`logits_sharding`). 2d: tp over the model axis and FSDP over the data"
      f" axis. {ONE_GPU}: the same model on one GPU at {batch // n}x{seq} tokens per step,"
      f" the rows per GPU of data parallelism; scaling = tokens/s over {n} GPUs ({batch}x{seq}"
      f" per step) / tokens/s on one GPU. Every first-step loss on the {batch}x{seq} batch"
      f" is checked against the same model's on one GPU (within 1%). The 2:4 steps rebuild"
      f" no mask" + (" (mask_update's count pinned)" if cfg["rebuild_flag"] else "")
      + "; no rebuild step or breakdown is timed here."
      f" Every dense placement runs before any 2:4 one (the cuSPARSELt tax above).")


# --- report -----------------------------------------------------------------------------


def _na(v):
  return "n/a" if v is None else v


def _get(r: dict, *keys):
  """r[k0][k1]..., or "FAILED" where the width stopped before measuring it."""
  for k in keys:
    if not isinstance(r, dict) or k not in r:
      return "FAILED"
    r = r[k]
  return r


def _percent(v):
  return f"{v:+.1%}" if isinstance(v, float) else v


def _blocks(r: dict) -> str:
  return f"{r['layers']}{' (remat)' if r['remat'] else ''}"


def _millions(n: int) -> str:
  """A parameter count in millions, to 2 decimals below 10M (--small's narrow
  models have less than 1M)."""
  return f"{n / 1e6:,.{0 if n >= 1e7 else 2}f}M"


def _shape_cells(r: dict) -> list:
  return [r["d_model"], _blocks(r), f"{r['batch']}x{r['seq']}"]


def _labelled(headers: list[str], rows: list[list], results: list[dict]) -> str:
  """`_common.table`, with each row's label first where the rows have one
  (--small: what each shape stands for)."""
  if not any("label" in r for r in results):
    return _common.table(headers, rows)
  return _common.table(["row"] + headers,
                       [[r.get("label", "")] + row for r, row in zip(results, rows)])


def main_table(results: list[dict]) -> str:
  rows = [[*_shape_cells(r), _get(r, "dense", "step_ms"),
           _get(r, "dense", "tokens_per_s"), _get(r, "dense", "step_ms_after_sparse"),
           _percent(_get(r, "dense", "after_sparse")),
           _get(r, "sparse", "step_ms"), _get(r, "sparse", "tokens_per_s"), _get(r, "ratio"),
           _get(r, "ratio_dense"), _get(r, "sparse", "rebuild_step_ms"),
           _get(r, "sparse", "rebuild_extra_ms_per_step"),
           _get(r, "ratio_with_rebuilds"), r["status"]]
          for r in results]
  return _labelled(["d_model", "blocks", "tokens per step (batch x seq)", "dense ms/step",
                    "dense tokens/s",
                    "dense ms/step again, after the 2:4 steps",
                    "again / first - 1", "2:4 ms/step",
                    "2:4 tokens/s", "ratio (2:4 / dense tokens/s)", "ratio's dense timing",
                    "2:4 rebuild step ms",
                    "rebuild extra ms/step (amortised)", "ratio with rebuilds", "status"],
                   rows, results)


def breakdown_tables(r: dict) -> str:
  b = r["breakdown"]
  dense_step, sparse_step = r["dense"]["step_ms"], r["sparse"]["step_ms"]
  recompute = " + recomputed fwd" if r["remat"] else ""
  parts = [
      ["full training step", dense_step, sparse_step],
      [f"linear layers (qkv, out, up, down) fwd+bwd{recompute}", b["linear_dense_ms"],
       b["linear_sparse_ms"]],
      ["  of which compression (proxy)", "", _na(b["compress_ms"])],
      [f"attention fwd+bwd{recompute} (timed in each model's phase)", b["attention_dense_ms"],
       b["attention_sparse_ms"]],
      ["optimizer (dense: AdamW; 2:4: mask_update + AdamW)", r["dense"]["optimizer_ms"],
       r["sparse"]["optimizer_ms"]],
      ["everything else (step - parts above)", b["other_dense_ms"], b["other_sparse_ms"]],
  ]
  rows = [p + [p[2] - p[1] if isinstance(p[1], float) and isinstance(p[2], float) else ""]
          for p in parts]
  layer_rows = [[kind, f"{p['k']}x{p['n']}", r["layers"], p["implementation"], p["dense_ms"],
                 p["sparse_ms"], p["dense_ms"] / p["sparse_ms"], _na(p["compress_ms"])]
                for kind, p in b["layers"].items()]
  return (f"d_model {r['d_model']}, {r['layers']} blocks{' with remat' if r['remat'] else ''},"
          f" {r['batch']}x{r['seq']} tokens per step"
          + (f" ({r['label']})" if "label" in r else "") + ","
          f" {_millions(r['params'])} params"
          f" (memory estimate {r['memory_estimate_gib']['total']:.1f} GiB); ms per step, summed"
          f" over all blocks:\n\n"
          + _common.table(["part", "dense ms", "2:4 ms", "2:4 - dense ms"], rows)
          + f"\n\nmask_update per-step overhead {b['mask_update_ms']:.3f} ms"
          f" ({b['mask_update_pct']:.2f}% of the 2:4 step); ceilings: (a) bound"
          f" {b['ceiling_bound']:.3f}x, (b) with measured parts {b['ceiling_measured']:.3f}x;"
          f" measured {r['ratio']:.3f}x.\n\nPer layer, one block (fwd+bwd{recompute}; ms):\n\n"
          + _common.table(["layer", "K x N", "count", "2:4 backend (automatic)", "dense",
                           "2:4", "speedup", "compress (proxy)"], layer_rows))


def summary_table(results: list[dict]) -> str:
  rows = [[*_shape_cells(r),
           _millions(r["params"]) if "params" in r else "FAILED",
           _get(r, "dense", "tokens_per_s"), _get(r, "sparse", "tokens_per_s"), _get(r, "ratio"),
           *((_get(r, "breakdown", "mask_update_pct"), _get(r, "breakdown", "ceiling_measured"))
             if "breakdown" in r or r["status"] != "ok" else ("n/a", "n/a"))]
          for r in results]
  return _labelled(["d_model", "blocks", "tokens per step (batch x seq)", "params",
                    "dense tokens/s", "2:4 tokens/s", "ratio",
                    "mask_update overhead % of 2:4 step", "ceiling (b)"], rows, results)


SMALL_NOTES = (
    "random tokens, batch x seq per row as the tables say (`--small`: d_model"
    f" {' and '.join(map(str, SMALL_WIDTHS))} x {SMALL_LAYERS} blocks at"
    f" {', '.join(f'{b * SMALL_SEQ:,}' for b in SMALL_BATCHES)} tokens per step, then the"
    " shapes that `examples/train_lm.py` and `examples/sharded_train.py` train by default on"
    " a GPU, read from train_lm's presets: train_lm's whole step, and sharded_train's rows"
    f" on one GPU of a data-parallel run over {SHARDED_GPUS}). The rows share the examples'"
    " width, depth, tokens per step and byte vocabulary, not their model: here all four"
    " linear layers of a block are 2:4 (there the MLP's two), heads of 128, no biases, bf16"
    " compute.")


def notes(cfg: dict) -> str:
  return (
      f"GPT-style decoder (`benchmarks/bench_model.py`): pre-LayerNorm blocks stacked with"
      f" `nn.scan`, four bias-free `nn.Dense` per block (qkv d->3d, out d->d, up d->4d,"
      f" down 4d->d), causal `jax.nn.dot_product_attention` (implementation"
      f" {cfg['attention'] or 'None: XLA'}), heads of {HEAD_DIM}, GELU MLP, vocabulary"
      f" {cfg['vocab']},"
      f" dense output head; bf16 compute, f32 params; AdamW (lr {LR}, weight decay"
      f" {WEIGHT_DECAY}); "
      + (SMALL_NOTES if cfg["small"] else
         f"{cfg['batch']}x{cfg['seq']} = {cfg['batch'] * cfg['seq']:,} random tokens per step.")
      + f" Remat: `nn.remat` around the block, policy"
      f" {POLICY_NOTES[cfg['remat_policy']]}."
      + ("" if cfg["small"] else f" Default depths fit JAX's default memory pool on"
                                 f" an 80 GB H100 ({POOL_GIB:.1f} GiB) by `memory_estimate`.")
      + f" 2:4 = the same model through `jsparse24.sparsify(model,"
      f" {{{SPARSE_LAYERS!r}: {sparse_options(cfg)}}})` (mask kind: {cfg['mask']}; the"
      f" backend is the automatic choice{', named per layer below' if cfg['devices'] == 1 else ''})"
      f" and"
      f" `mask_update(MaskSchedule(rebuild_every={cfg['rebuild_every']}), decay={MASK_DECAY})`"
      f" chained before AdamW"
      + ("; one 2:4 step program, mask rebuilds decided on mask_update's run-time flag"
         " (--rebuild-flag)" if cfg["rebuild_flag"] else
         "; the host's schedule passes mask_update's `mask_rebuild` (a 2:4 program with and"
         " one without the rebuild, as examples/train_lm.py trains)")
      + f"; same init params. Steps donate their state (a training"
      f" loop does); the 2:4 step that rebuilds nothing is timed as a training loop runs it"
      + (" (under --rebuild-flag with mask_update's count pinned to a step that does not"
         " rebuild)" if cfg["rebuild_flag"] else "")
      + ("" if cfg["layouts"] else f", and a rebuild step with the count pinned to one that"
                                   f" rebuilds (its extra cost shown amortised over"
                                   f" {cfg['rebuild_every']} steps)")
      + f". Whole steps are timed in runs of >= 1 s of"
      f" consecutive steps, dispatched asynchronously as in a training loop (median of 5"
      f" runs). Every width's dense model is timed before any 2:4 step runs in the"
      f" process: {_common.CUSPARSELT_TAX}."
      + ("" if cfg["layouts"] else
         " The dense step timed again after the 2:4 steps shows that; the ratio uses the first"
         " timing (\"first\" in the table) where the 2:4 model runs a cuSPARSELt product,"
         " else the timing again (\"in turn\"): there the dense and 2:4 steps are timed in"
         f" turn, {IN_TURN_ROUNDS} rounds of a >= 1 s run each, the fastest round of each"
         " (a host's speed drifts by tens of percent over seconds, which a model bound by"
         " its host's dispatch shows whole; timed in turn, both see the same drift).")
      + (f" Data parallel: one `jax.jit` step over a mesh of {cfg['devices']} GPUs, the"
         f" batch split over them, params and optimizer state replicated (no breakdown)."
         if cfg["devices"] > 1 and not cfg["layouts"] else "")
      + ("" if cfg["devices"] > 1 else "\n\n"
      + ("(No breakdown for the widths with remat: with this policy their recomputed"
         " forward pass is not a whole forward pass, which the parts below would count.) "
         if cfg["remat_policy"] != "nothing" else "")
      + f"Breakdown: each part is its own jitted program at the model's shapes, summed over"
      f" the blocks (with remat the recomputed forward is added): linear layers = `nn.Dense`"
      f" vs `jsparse24.SparseDense` forward + `jax.vjp` (y, dx, dw) from f32 params on bf16"
      f" activations, masking and compression included; compression = `jsparse24.compress`"
      f" of each bf16 kernel with its mask, a proxy for the per-step compression inside the"
      f" product (the same Pallas kernel family; n/a without a GPU); optimizer = `tx.update`"
      f" + `optax.apply_updates` alone on the whole params tree; everything else"
      f" (embeddings, head, norms, loss, residuals) = the full step minus those parts, and"
      f" goes negative where the parts overlap inside the whole step. Ceilings: (a) the"
      f" dense step with its linear layers at the 2:4 products bound (y and dx at half"
      f" cost, dw dense: 1.5x, 1.6x with remat; every product at half cost with the MVUE"
      f" weight gradient: 2x); (b) the dense step with its linear layers, attention"
      f" and optimizer replaced by the ones measured in the 2:4 model's phase."))


def _rows(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[dict]:
  """The rows to time, {"d_model", "layers", "remat", "batch", "seq"} (and
  "label" under --small): --small's, or every --widths at --batch x --seq,
  blocks and remat per width by --layers, --remat and `DEFAULTS`. Fills in
  the defaults of --widths, --batch, --seq and --vocab; errors through `p`."""
  if args.small:
    fixed = [flag for flag, value in (("--layers", args.layers), ("--batch", args.batch),
                                      ("--seq", args.seq), ("--layouts", args.layouts))
             if value is not None]
    if fixed:
      p.error(f"--small times its own rows (blocks, batch x seq): drop {', '.join(fixed)},"
              f" or --small.")
    small, vocab = small_rows()
    args.vocab = args.vocab or vocab
    widths = sorted({r["d_model"] for r in small})
    chosen = _common.counts(p, "--widths", args.widths) if args.widths else widths
    if set(chosen) - set(widths):
      p.error(f"--widths {args.widths}: --small has rows of d_model {widths} only.")
    # The examples train without remat.
    return [{**r, "remat": args.remat == "on"} for r in small if r["d_model"] in chosen]
  args.widths = args.widths or "512,1024,2048,4096,8192"
  for name, default in (("seq", 2048), ("batch", 8), ("vocab", 32768)):
    if getattr(args, name) is None:
      setattr(args, name, default)
  widths = _common.counts(p, "--widths", args.widths)
  if args.layers is None and any(w not in DEFAULTS for w in widths):
    p.error(f"--layers is needed for widths without a default depth ({sorted(DEFAULTS)})")
  if args.layers is None:
    layers = {w: DEFAULTS[w][0] for w in widths}
  else:
    values = _common.counts(p, "--layers", args.layers)
    if len(values) not in (1, len(widths)):
      p.error(f"--layers: give one value, or one per width ({len(widths)})")
    layers = dict(zip(widths, values * len(widths) if len(values) == 1 else values))
  return [{"d_model": w, "layers": layers[w],
           "remat": args.remat == "on" or (args.remat == "auto" and DEFAULTS.get(w, (0, False))[1]),
           "batch": args.batch, "seq": args.seq} for w in widths]


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--widths", default=None,
                 help="d_model values, comma-separated (default: 512,1024,2048,4096,8192; with"
                      " --small: its rows of these widths, default all)")
  p.add_argument("--layers", default=None,
                 help="blocks: one value for every width, or one per width (default: " + ", ".join(
                     f"{d}: {n}{' with remat' if r else ''}" for d, (n, r) in DEFAULTS.items())
                 + ")")
  p.add_argument("--remat", nargs="?", const="on", default="auto", choices=("auto", "on", "off"),
                 help="nn.remat around each block (auto: per DEFAULTS, off for other widths)")
  p.add_argument("--remat-policy", default="nothing", choices=sorted(REMAT_POLICIES),
                 help="with remat: 'nothing' saves nothing; 'compressed' keeps the 2:4"
                      " products' compressed weights (jsparse24.CHECKPOINT_NAME); 'dots' keeps"
                      " the matmul outputs, the 2:4 products' included"
                      " (jsparse24.checkpoint_policies); 'dots-jax' is JAX's dot policy, under"
                      " which the 2:4 model recomputes its products; 'dots-compressed' is"
                      " 'dots' and 'compressed' together")
  p.add_argument("--seq", type=_common.count, default=None, help="tokens per sequence (default: 2048)")
  p.add_argument("--batch", type=_common.count, default=None, help="sequences per step (default: 8)")
  p.add_argument("--vocab", type=_common.count, default=None,
                 help="vocabulary (default: 32768; with --small, the examples' 256 bytes)")
  p.add_argument("--small", action="store_true",
                 help="the small end instead of --widths x --batch x --seq: d_model"
                      f" {' and '.join(map(str, SMALL_WIDTHS))} x {SMALL_LAYERS} blocks at"
                      f" {', '.join(str(b * SMALL_SEQ) for b in SMALL_BATCHES)} tokens per step,"
                      " then the shapes examples/train_lm.py and examples/sharded_train.py"
                      " train by default on a GPU (one row each); no remat unless --remat on")
  p.add_argument("--rebuild-every", type=_common.rebuild_period, default=100,
                 help="R: mask rebuild period (>= 2)")
  p.add_argument("--rebuild-flag", action="store_true",
                 help="one 2:4 step program deciding mask rebuilds on mask_update's run-time"
                      " flag, instead of the host's schedule passing `mask_rebuild` (a program"
                      " with and one without the rebuild, as examples/train_lm.py trains)")
  p.add_argument("--attention", default="auto", choices=_common.ATTENTION_CHOICES,
                 help="dot_product_attention implementation (auto: cudnn on a GPU, XLA under"
                      " --small (the examples' flax attention) or elsewhere)")
  p.add_argument("--mask", default="default", choices=sorted(MASK_KINDS),
                 help="2:4 mask kind of the sparse layers (default: the library's default)")
  p.add_argument("--weight-grad", default="dense", choices=("dense", "mvue"),
                 help="the sparse layers' weight_grad (mvue: dw on the sparse tensor cores too)")
  p.add_argument("--devices", type=_common.count, default=1,
                 help="data parallel over this many local GPUs (--batch is split over them;"
                      " no breakdown)")
  p.add_argument("--layouts", default=None,
                 help="comma-separated layouts of jsparse24.layouts (data, fsdp, tp, 2d): each"
                      " width's dense and 2:4 models in each layout over --devices GPUs and on"
                      " one GPU at --batch / --devices rows, timed with their scaling (no"
                      " breakdown, no rebuild step)")
  p.add_argument("--model-devices", type=_common.count, default=None,
                 help="--layouts tp, 2d: GPUs on the mesh's model axis (default: all for tp,"
                      " 2 for 2d)")
  p.add_argument("--quick", action="store_true", help="one timing repeat (CPU smoke test)")
  p.add_argument("--json", default=None, help="also write every number to this JSON file")
  p.add_argument("--no-write", action="store_true", help="print only; leave results/ alone")
  args = p.parse_args(argv)

  rows = _rows(p, args)
  widths = list(dict.fromkeys(r["d_model"] for r in rows))
  if any(w % HEAD_DIM for w in widths):
    p.error(f"--widths: every d_model must be a multiple of the head size {HEAD_DIM}")
  if args.devices > len(jax.local_devices()):
    p.error(f"--devices {args.devices}: this machine has {len(jax.local_devices())}")
  indivisible = sorted({r["batch"] for r in rows if r["batch"] % args.devices})
  if indivisible:
    p.error(f"--batch {', '.join(map(str, indivisible))} must be a multiple of --devices"
            f" {args.devices}")
  layouts = args.layouts.split(",") if args.layouts else []
  unknown = [name for name in layouts if name not in jsparse24.layouts.LAYOUTS]
  if unknown:
    p.error(f"--layouts: unknown {unknown}; expected some of {jsparse24.layouts.LAYOUTS}")
  if layouts and args.devices < 2:
    p.error("--layouts compares layouts over several GPUs: pass --devices 2 or more")
  if args.model_devices is not None and not {"tp", "2d"} & set(layouts):
    p.error("--model-devices applies to --layouts tp and 2d only")
  for name in {"tp", "2d"} & set(layouts):
    try:
      mesh = jsparse24.layouts.make_mesh(name, jax.local_devices()[:args.devices],
                                         args.model_devices)
    except ValueError as e:
      p.error(f"--layouts {name} over --devices {args.devices}: {e}")
    if args.batch % mesh.shape["data"]:
      p.error(f"--batch {args.batch} must be a multiple of the {mesh.shape['data']} devices on"
              f" the data axis of --layouts {name}")
  # --small stands for the examples, whose attention is flax's
  # `nn.MultiHeadDotProductAttention` (XLA's ops), and whose small steps
  # are bound by the host, where cuDNN's attention costs more per call.
  attention = _common.attention_implementation(args.attention, cudnn_on_gpu=not args.small)
  # Under --small each row has its own batch x seq (the rows' "batch", "seq").
  cfg = {"widths": widths, "small": args.small, "seq": args.seq, "batch": args.batch,
         "vocab": args.vocab,
         "rebuild_every": args.rebuild_every, "rebuild_flag": args.rebuild_flag,
         "attention": attention, "mask": args.mask,
         "weight_grad": args.weight_grad, "devices": args.devices,
         "remat_policy": args.remat_policy, "layouts": layouts,
         "model_devices": args.model_devices, "quick": args.quick}
  timer, step_timer = _common.timers(args.quick)
  env = _common.environment()
  print(env, flush=True)
  print(f"backends: {jsparse24.available_implementations()}", flush=True)

  if layouts:
    shapes = {r["d_model"]: {"layers": r["layers"], "remat": r["remat"]} for r in rows}
    results = run_layouts(cfg, shapes, step_timer)
    tables = "".join(f"{layouts_table(r, cfg)}\n\n" for r in results)
  else:
    results = run_widths(cfg, rows, timer, step_timer)
    tables = (f"{main_table(results)}\n\n"
              + "".join(f"{breakdown_tables(r)}\n\n" for r in results if "breakdown" in r)
              + f"Summary:\n\n{summary_table(results)}\n")
  out = {"environment": env, "config": cfg, "widths": results}
  if args.json:
    _common.write_json(args.json, out)
  if not args.no_write:
    tokens = sorted({r["batch"] * r["seq"] for r in rows})
    title = (f"Whole model: GPT-style decoder, d_model {','.join(map(str, widths))},"
             + (f" the small end and the examples' GPU defaults (--small), {tokens[0]:,} to"
                f" {tokens[-1]:,} tokens per step" if args.small
                else f" {args.batch}x{args.seq} tokens per step")
             + f", {args.mask} masks"
             + (", MVUE weight gradient" if args.weight_grad == "mvue" else "")
             + (f", layouts {args.layouts} over {args.devices} GPUs" if layouts
                else f", data parallel over {args.devices} GPUs" if args.devices > 1 else "")
             + (f", remat policy {args.remat_policy}" if args.remat_policy != "nothing" else ""))
    body = (f"{env}\n\n{notes(cfg)}\n\n"
            + (f"{layouts_notes(cfg)}\n\n" if layouts else "") + tables)
    path = _common.write_section(title, body)
    print(f"wrote {path}", flush=True)
  print(f"\n{tables}", flush=True)
  return out


if __name__ == "__main__":
  main()
