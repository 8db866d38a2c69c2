"""Generate text with the byte-level LMs that examples/train_lm.py trained,
dense and 2:4 compressed, with a KV cache under `jax.jit`.

What it does:

1. loads the dense and the 2:4 run's latest Orbax checkpoints from
   `--out/checkpoints/{dense,sparse}` (train_lm's layout). Where either is
   missing it first trains both by calling `train_lm.main` with the same
   flags, so `--size`, `--steps`, `--d-model`, ... are train_lm's (see its
   `--help`; without `--size`, the preset train_lm picks on this platform):
   the checkpoint only loads into the model those flags describe. train_lm
   saves its flags as `--out/train_lm_flags.json`; where that file exists
   they come first and the flags given here override them, so
   `generate.py --out DIR` loads whatever train_lm trained into DIR;
2. ships the 2:4 model as a user would: its params cast to the compute dtype
   and compressed by `jsparse24.compress_params` (each MLP kernel becomes a
   `Sparse24`, values + 4-bit metadata); the layers' default implementation
   then picks the product for every shape (`implementation=None`);
3. generates from `--prompt` (bytes: train_lm's vocabulary) with both
   models: one prefill of the prompt, then `jax.lax.fori_loop` over the new
   tokens, each step writing its key and value into the cache in place
   (`jax.lax.dynamic_update_slice` in the loop; the cache buffer is donated to
   the jitted call, `donate_argnums`, so calls reuse it). Greedy with
   `--temperature 0`, else sampling from `softmax(logits / T)` with keys split
   from `--seed`: the same seed gives the same text;
4. checks the cache: the logits of the cached decode (prefill, then one token
   per step) equal those of train_lm's full-sequence forward, for both models;
   and the compressed model's logits equal those of its kernels given dense
   (`kernel * mask`; the dense model's on the masked weights, where the run's
   only 2:4 operands are weights);
5. prints the generated text, the tokens/s of both models at batch 1, 8 and 32
   (`--batches`), and the bytes of the weights, dense and compressed.

The decode model (`DecodeLM`) is train_lm's `CharLM` written for a cache: the
same params tree (it loads train_lm's params unchanged), the same layers
(train_lm's `MLP` with the run's activation, 2:4 activations and kind of
`up` weight, so the 2:4 layers are `jsparse24.SparseDense`), attention over
the cached keys and values. Runs of train_lm --moe have no decode model.

Run:

    python examples/generate.py --prompt "def main(" --temperature 0.8
    python examples/generate.py --size gpu --steps 40 --eval-every 40 --eval-batches 2 \
        --tokens 256 --out runs/generate_gpu   # a GPU: trains briefly first

On CPU the 2:4 product is the masked dense reference (`"xla"`): the script
says so instead of printing a speed-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jsparse24

# The example beside this one (Python puts a script's folder on its path):
# the model, data, flags and checkpoints of the runs generated from.
import train_lm as lm  # pylint: disable=g-bad-import-order


# --- the model with a KV cache -------------------------------------------------


def init_cache(layers: int, batch: int, max_len: int, heads: int, head_dim: int,
               dtype) -> list[dict[str, jax.Array]]:
  """An empty cache: per block, keys and values `[batch, max_len, heads, head_dim]`."""
  shape = (batch, max_len, heads, head_dim)
  return [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(layers)]


class CachedAttention(nn.Module):
  """`nn.MultiHeadDotProductAttention`'s params (`query`, `key`, `value`,
  `out`) and computation, over the keys and values of a cache.

  The `S` new tokens sit at positions `pos .. pos + S - 1`: their keys and
  values are written into the cache there, and each attends to the cache up to
  its own position. Entries past it are masked, so whatever they hold (zeros,
  or a previous call's tokens) never counts: a donated cache is reused as is.
  """

  heads: int
  dtype: Any = None

  @nn.compact
  def __call__(self, x, cache: dict[str, jax.Array], pos):
    d = x.shape[-1]
    dense = lambda name: nn.DenseGeneral((self.heads, d // self.heads), dtype=self.dtype,
                                         name=name)
    q, k, v = dense("query")(x), dense("key")(x), dense("value")(x)
    start = (0, pos, 0, 0)
    cache = {"k": jax.lax.dynamic_update_slice(cache["k"], k.astype(cache["k"].dtype), start),
             "v": jax.lax.dynamic_update_slice(cache["v"], v.astype(cache["v"].dtype), start)}
    query_pos = pos + jnp.arange(x.shape[-2])
    mask = jnp.arange(cache["k"].shape[1])[None, :] <= query_pos[:, None]  # [S, max_len]
    a = nn.dot_product_attention(q, cache["k"], cache["v"], mask=mask[None, None],
                                 dtype=self.dtype)
    out = nn.DenseGeneral(d, axis=(-2, -1), dtype=self.dtype, name="out")(a)
    return out, cache


class CachedBlock(nn.Module):
  """train_lm's `Block` over a cache (same names: `ln_attn`, `attn`, `ln_mlp`, `mlp`)."""

  d_model: int
  heads: int
  sparse_mlp: bool
  dtype: Any = None
  activation: str = "gelu"  # train_lm's MLP.activation
  input_sparsity: str = "off"  # MLP.input_sparsity
  mlp_weights: str = "2:4"  # MLP.weights

  @nn.compact
  def __call__(self, x, cache, pos):
    h = nn.LayerNorm(dtype=self.dtype, name="ln_attn")(x)
    a, cache = CachedAttention(self.heads, self.dtype, name="attn")(h, cache, pos)
    x = x + a
    h = nn.LayerNorm(dtype=self.dtype, name="ln_mlp")(x)
    mlp = lm.MLP(4 * self.d_model, self.sparse_mlp, self.dtype, activation=self.activation,
                 input_sparsity=self.input_sparsity, weights=self.mlp_weights, name="mlp")
    return x + mlp(h), cache


class DecodeLM(nn.Module):
  """train_lm's `CharLM` with a KV cache: the same params tree.

  `__call__(tokens [B, S], cache, pos)` runs the `S` tokens at positions
  `pos ..` (`pos` may be traced) and returns their logits `[B, S, vocab]`
  (float32) and the cache with their keys and values written in."""

  vocab: int
  d_model: int
  layers: int
  heads: int
  max_len: int
  sparse_mlp: bool
  dtype: Any = None
  activation: str = "gelu"  # CharLM's fields of the same names
  input_sparsity: str = "off"
  mlp_weights: str = "2:4"

  @nn.compact
  def __call__(self, tokens, cache, pos):
    init = nn.initializers.normal(0.02)
    x = nn.Embed(self.vocab, self.d_model, embedding_init=init, name="embed")(tokens)
    pos_embed = self.param("pos_embed", init, (self.max_len, self.d_model))
    x = x + jax.lax.dynamic_slice_in_dim(pos_embed, pos, tokens.shape[-1])
    x = x.astype(self.dtype or jnp.float32)
    new_cache = []
    for i in range(self.layers):
      x, c = CachedBlock(self.d_model, self.heads, self.sparse_mlp, self.dtype, self.activation,
                         self.input_sparsity, self.mlp_weights, name=f"block_{i}")(x, cache[i],
                                                                                   pos)
      new_cache.append(c)
    x = nn.LayerNorm(dtype=self.dtype, name="ln_final")(x)
    return nn.Dense(self.vocab, dtype=self.dtype, name="head")(x).astype(jnp.float32), new_cache

  def empty_cache(self, batch: int) -> list[dict[str, jax.Array]]:
    return init_cache(self.layers, batch, self.max_len, self.heads, self.d_model // self.heads,
                      self.dtype or jnp.float32)


def decode_model(model) -> DecodeLM:
  """The `DecodeLM` of a train_lm `CharLM`: the same feed-forward (its
  activation, 2:4 activations and kind of `up` weight). A model with
  SparseMoE feed-forwards (train_lm --moe) has no decode model here."""
  if model.moe is not None:
    raise ValueError(f"generate: the checkpoint's MLPs are SparseMoEs (train_lm --moe"
                     f" {model.moe[0]},{model.moe[1]}); DecodeLM has no cached path for them:"
                     f" generate from a run trained without --moe.")
  return DecodeLM(model.vocab, model.d_model, model.layers, model.heads, model.max_len,
                  model.sparse_mlp, model.dtype, model.activation, model.input_sparsity,
                  model.mlp_weights)


# --- generation ----------------------------------------------------------------


def sample(logits, key, temperature: float):
  """Next tokens `[B]`: argmax at temperature 0, else drawn from softmax(logits / T)."""
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


def make_generate(model: DecodeLM, new_tokens: int, temperature: float):
  """jit((params, prompt [B, P], cache, key) -> (tokens [B, new_tokens], cache)).

  One call: the prompt's prefill, then `new_tokens - 1` decode steps in a
  `fori_loop`. The cache is donated: XLA writes each step's keys and values
  into the caller's buffer, and the returned cache is that buffer, ready for
  the next call."""
  if new_tokens < 1:
    raise ValueError(f"make_generate: new_tokens must be >= 1, got {new_tokens}.")

  def generate(params, prompt, cache, key):
    variables = {"params": params}
    keys = jax.random.split(key, new_tokens)
    logits, cache = model.apply(variables, prompt, cache, 0)
    out = jnp.zeros((prompt.shape[0], new_tokens), jnp.int32)
    out = out.at[:, 0].set(sample(logits[:, -1], keys[0], temperature))

    def step(i, carry):
      out, cache = carry
      token = jax.lax.dynamic_slice_in_dim(out, i - 1, 1, axis=1)
      logits, cache = model.apply(variables, token, cache, prompt.shape[1] + i - 1)
      nxt = sample(logits[:, 0], keys[i], temperature)
      return jax.lax.dynamic_update_slice_in_dim(out, nxt[:, None], i, axis=1), cache

    return jax.lax.fori_loop(1, new_tokens, step, (out, cache))

  return jax.jit(generate, donate_argnums=2)


def cached_logits(model: DecodeLM, params, tokens, prefill: int) -> jax.Array:
  """Logits `[B, T, vocab]` of `tokens [B, T]` through the cache: the first
  `prefill` tokens in one call, then one token per call (teacher-forced). They
  must equal the full-sequence forward's: `check_cache`."""

  @jax.jit
  def run(params, tokens):
    cache = model.empty_cache(tokens.shape[0])
    first, cache = model.apply({"params": params}, tokens[:, :prefill], cache, 0)

    def step(cache, t):
      token = jax.lax.dynamic_slice_in_dim(tokens, t, 1, axis=1)
      logits, cache = model.apply({"params": params}, token, cache, t)
      return cache, logits[:, 0]

    _, rest = jax.lax.scan(step, cache, jnp.arange(prefill, tokens.shape[1]))
    return jnp.concatenate([first, jnp.swapaxes(rest, 0, 1)], axis=1)

  return run(params, tokens)


def time_generate(fn, params, prompt, cache, key, repeats: int) -> tuple[float, Any]:
  """(median seconds per call of `fn` after a warm-up call, the live cache):
  each call is given the cache the previous one returned (donation)."""
  out, cache = fn(params, prompt, cache, key)
  jax.block_until_ready(out)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out, cache = fn(params, prompt, cache, key)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - t0)
  return statistics.median(times), cache


# --- loading, shipping -----------------------------------------------------------


def checkpoint_dirs(out: str) -> dict[str, str]:
  return {name: lm.checkpoint_dir(out, name) for name in ("dense", "2:4")}


def has_checkpoint(directory: str) -> bool:
  if not os.path.isdir(directory):
    return False
  with lm.checkpoint_manager(directory) as mngr:
    return mngr.latest_step() is not None


def abstract_run(name: str, sparse: bool, targs, sample_tokens):
  """train_lm's `Run` with shapes in place of its arrays (`jax.eval_shape`):
  all that restoring a checkpoint needs, without compiling the init."""
  made = []

  def build():
    made.append(lm.make_run(name, sparse, targs, sample_tokens))
    return made[0].params, made[0].opt_state

  params, opt_state = jax.eval_shape(build)
  return dataclasses.replace(made[0], params=params, opt_state=opt_state)


def load_runs(targs, train_argv: Sequence[str]):
  """train_lm's (dense, 2:4) runs at their latest checkpoints in `targs.out`,
  after training them with `train_argv` where either has none."""
  dirs = checkpoint_dirs(targs.out)
  if not all(has_checkpoint(d) for d in dirs.values()):
    print(f"no checkpoint of both runs in {os.path.join(targs.out, 'checkpoints')}:"
          f" training them first (examples/train_lm.py {' '.join(train_argv)})", flush=True)
    lm.main(list(train_argv))
  sample_tokens = jnp.zeros((1, targs.seq_len), jnp.int32)
  runs = []
  for name, sparse in (("dense", False), ("2:4", True)):
    run = abstract_run(name, sparse, targs, sample_tokens)
    with lm.checkpoint_manager(dirs[name]) as mngr:
      try:
        lm.restore(mngr, run)
      except Exception as e:  # pylint: disable=broad-except
        raise ValueError(
            f"generate: the checkpoint in {dirs[name]!r} does not load into the model that"
            f" train_lm's flags {list(train_argv)} describe ({lm.short_reason(e)}). Pass the"
            f" flags it was trained with, or another --out.") from e
    runs.append(run)
  return runs


def serving_masks(sparsity):
  """The masks as plain 2:4 masks: a transposable mask's transposed copy
  serves training's `dx` only, so `compress_params` then ships the forward
  operand alone."""
  return jax.tree.map(
      lambda m: dataclasses.replace(m, transposable=False) if isinstance(m, jsparse24.Mask24)
      else m, sparsity, is_leaf=lambda a: isinstance(a, jsparse24.Mask24))


@jax.jit
def masked_params(compressed):
  """Dense params holding `kernel * mask` where `compressed` holds a `Sparse24`."""
  return jax.tree.map(
      lambda a: jsparse24.decompress(a) if isinstance(a, jsparse24.Sparse24) else a,
      compressed, is_leaf=lambda a: isinstance(a, jsparse24.Sparse24))


def weight_bytes(params) -> int:
  return sum(int(a.nbytes) for a in jax.tree.leaves(params))


def decode_backends(compressed, batches: Sequence[int]) -> dict[int, dict[str, str]]:
  """Per batch, the implementation `implementation=None` picks for the decode
  product (M = batch rows) of each layer that `compressed` (the shipped 2:4
  params) holds as a `Sparse24`, by its path within a block (the blocks
  are alike): both MLP layers; with 2:4 activations `up` alone (the pruned
  `down` keeps a dense kernel); none with --mlp-weights dense."""
  is_sparse = lambda a: isinstance(a, jsparse24.Sparse24)  # noqa: E731
  kernels = {"/".join(str(getattr(k, "key", k)) for k in path[1:-1]): sp
             for path, sp in jax.tree_util.tree_leaves_with_path(compressed, is_leaf=is_sparse)
             if is_sparse(sp) and getattr(path[0], "key", None) == "block_0"}
  return {b: {name: jsparse24.selected_implementation((b, sp.shape[-2]), sp.shape, sp.dtype,
                                                      compressed=True)
              for name, sp in kernels.items()}
          for b in batches}


def max_rel_diff(got, ref) -> float:
  """max |got - ref| over max |ref|: logits of a bf16 model differ by an ulp
  of the largest ones, not of each."""
  return float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))


def check_cache(dense_model, sparse_model, dense_params, compressed, tokens, prefill: int,
                tol: float, masked=None) -> dict[str, float]:
  """`max_rel_diff` of the logits: cached decode against train_lm's full
  forward (both models), and the compressed model against its kernels
  given dense (`masked`, each `kernel * mask`; None: those `compressed`
  holds), with `nn.Dense` for its 2:4 weights and its activations pruned
  as they are: for a model of 2:4 weights alone, the dense model on the
  masked weights. Raises where one exceeds `tol`."""

  def full(model, params, kernels_dense: bool = False):
    sparse = model.sparse_mlp and not (kernels_dense and model.input_sparsity == "off")
    charlm = lm.CharLM(model.vocab, model.d_model, model.layers, model.heads, model.max_len,
                       sparse, model.dtype, activation=model.activation,
                       input_sparsity=model.input_sparsity,
                       mlp_weights="dense" if kernels_dense else model.mlp_weights)
    return jax.jit(charlm.apply)({"params": params}, tokens)

  masked = masked_params(compressed) if masked is None else masked
  dense_full = full(dense_model, dense_params)
  sparse_full = full(sparse_model, compressed)
  diffs = {
      "dense: cached vs full forward": max_rel_diff(
          cached_logits(dense_model, dense_params, tokens, prefill), dense_full),
      "2:4: cached vs full forward": max_rel_diff(
          cached_logits(sparse_model, compressed, tokens, prefill), sparse_full),
      "2:4 compressed vs its masked kernels uncompressed": max_rel_diff(
          sparse_full, full(sparse_model, masked, kernels_dense=True)),
  }
  bad = {k: v for k, v in diffs.items() if not v <= tol}
  if bad:
    raise AssertionError(f"generate: logits differ by more than {tol} (max |difference| over"
                         f" max |logit|): {bad}")
  return diffs


# --- main ------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None):
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=lm.HelpFormatter,
      allow_abbrev=False,  # --batch is train_lm's, not --batches
      epilog="Every other flag is train_lm.py's (--size, --out, the model and training flags;"
             " see its --help): they describe the checkpoint to load, and the training run"
             " when there is none. Those that train_lm saved in --out/train_lm_flags.json come"
             " first; flags given here override them.")
  p.add_argument("--prompt", default="def ", help="the text to continue (its UTF-8 bytes)")
  p.add_argument("--tokens", type=int, default=None,
                 help="new tokens (bytes) per generation (default: up to the model's context,"
                      " train_lm's --seq-len)")
  p.add_argument("--temperature", type=float, default=0.0,
                 help="0: greedy; above 0: sample from softmax(logits / temperature)")
  p.add_argument("--seed", type=int, default=0, help="the sampling key's seed")
  p.add_argument("--batches", default="1,8,32",
                 help="batch sizes (comma-separated) to time both models at")
  p.add_argument("--repeats", type=int, default=5, help="timed calls per batch size (median)")
  args, rest = p.parse_known_args(argv)
  # The flags train_lm saved beside its checkpoints describe their models;
  # flags given here come after them, so they win.
  out = lm.parse_args(rest).out
  rest, saved = lm.with_saved_flags(out, rest)
  args.flags_file = None if saved is None else os.path.join(out, lm.FLAGS_FILE)
  targs = lm.parse_args(rest)
  try:
    prompt = args.prompt.encode("utf-8")
  except UnicodeEncodeError:  # bytes of the command line that are not UTF-8
    p.error(f"--prompt {args.prompt!r} is not valid UTF-8 text.")
  if not prompt:
    p.error("--prompt must not be empty.")
  room = targs.seq_len - len(prompt)
  if room < 1:
    p.error(f"--prompt is {len(prompt)} bytes; the model's context (--seq-len) is"
            f" {targs.seq_len}: shorten the prompt.")
  if args.tokens is None:
    args.tokens = room
  if not 1 <= args.tokens <= room:
    p.error(f"--tokens {args.tokens}: the prompt ({len(prompt)} bytes) and the new tokens must"
            f" fit the model's context of {targs.seq_len} (--seq-len): pass 1 to {room}.")
  if not args.temperature >= 0 or math.isinf(args.temperature):  # NaN sampled NUL bytes
    p.error(f"--temperature must be a finite number >= 0, got {args.temperature}.")
  try:
    args.batches = [int(b) for b in args.batches.split(",")]
  except ValueError:
    p.error(f"--batches {args.batches!r}: batch sizes as integers separated by commas,"
            f" e.g. 1,8,32.")
  if min(args.batches) < 1 or args.repeats < 1:
    p.error("--batches and --repeats must be >= 1.")
  return args, targs, rest


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args, targs, train_argv = parse_args(argv)
  if args.flags_file is not None:
    print(f"train_lm's flags from {args.flags_file} (flags given here override them):"
          f" {' '.join(train_argv)}")
  print(f"preset {targs.size} ({targs.size_reason})")
  print(f"JAX {jax.__version__}, backend {jax.default_backend()!r}, devices {jax.devices()}")
  dense_run, sparse_run = load_runs(targs, train_argv)
  print(f"loaded {targs.out}: dense at step {dense_run.step}, 2:4 at step {sparse_run.step};"
        f" d_model {targs.d_model}, {targs.layers} layers, context {targs.seq_len}, {targs.dtype}")

  # Ship both in the compute dtype: each decode step reads every weight once,
  # so the bytes read are those the models hold.
  dtype = dense_run.model.dtype or jnp.float32
  dense_params = jax.tree.map(lambda a: a.astype(dtype), dense_run.params)
  sparse_params = jax.tree.map(lambda a: a.astype(dtype), sparse_run.params)
  if sparse_run.sparse:
    sparsity = serving_masks(jsparse24.optim.masks(sparse_run.opt_state))
    compressed = jsparse24.compress_params(sparse_params, sparsity)
  else:  # train_lm --mlp-weights dense: 2:4 activations alone, no 2:4 weight to compress
    compressed = sparse_params
  dense_model, sparse_model = decode_model(dense_run.model), decode_model(sparse_run.model)

  prompt = np.frombuffer(args.prompt.encode("utf-8"), np.uint8).astype(np.int32)
  # The check reads text (two windows of the small corpus's validation split)
  # in full matmul precision, so that it sees the cache's bookkeeping rather
  # than the matmul precision's rounding.
  check_tokens = jnp.asarray(lm.val_batches(lm.load_text(lm.corpus_files("small"))[1], 1, 2,
                                            targs.seq_len)[0][0])
  # float32: rounding only. bfloat16: a few ulps (2^-8) of the largest logit,
  # where the one-token products round differently from the whole-sequence ones.
  tol = 1e-4 if dtype == jnp.float32 else 3e-2
  with jax.default_matmul_precision("highest"):
    diffs = check_cache(dense_model, sparse_model, dense_params, compressed, check_tokens,
                        len(prompt), tol)
  for what, diff in diffs.items():
    print(f"logits, {what}: max |difference| / max |logit| {diff:.3g} (tolerance {tol:g})")

  key = jax.random.key(args.seed)
  models = {"dense": (dense_model, dense_params), "2:4": (sparse_model, compressed)}
  fns = {name: make_generate(model, args.tokens, args.temperature)
         for name, (model, _) in models.items()}
  texts = {}
  for name, (model, params) in models.items():
    out, _ = fns[name](params, jnp.asarray(prompt)[None], model.empty_cache(1), key)
    texts[name] = bytes(np.asarray(out[0]).astype(np.uint8).tolist()).decode("utf-8", "replace")
    mode = "greedy" if args.temperature == 0 else f"temperature {args.temperature}, seed {args.seed}"
    print(f"\n--- {name} model ({mode}) ---\n{args.prompt}{texts[name]}\n---")

  print(f"\ntokens/s: {args.tokens} new tokens per sequence after a {len(prompt)}-byte prompt"
        f" (prefill included), median of {args.repeats} calls")
  print(f"{'batch':>5} | {'dense tokens/s':>14} | {'2:4 tokens/s':>12} | 2:4 layers on")
  print("-" * 60)
  backends = decode_backends(compressed, args.batches)
  speed = {}
  for b in args.batches:
    speed[b] = {}
    prompts = jnp.asarray(np.broadcast_to(prompt, (b, len(prompt))))
    for name, (model, params) in models.items():
      seconds, _ = time_generate(fns[name], params, prompts, model.empty_cache(b), key, args.repeats)
      speed[b][name] = b * args.tokens / seconds
    print(f"{b:>5} | {speed[b]['dense']:>14,.0f} | {speed[b]['2:4']:>12,.0f} |"
          f" {sorted(set(backends[b].values())) or 'no compressed weight'}")
  if not any(backends.values()):
    print(f"2:4 / dense tokens/s: no speed-up to report. The 2:4 model has no compressed"
          f" weight (train_lm --mlp-weights dense): its only 2:4 operands are mlp/down's"
          f" activations, pruned on XLA's masked product at decode, so it reads the dense"
          f" model's bytes.")
  elif all(set(v.values()) == {"xla"} for v in backends.values()):
    print(f"2:4 / dense tokens/s: no speed-up to report. No 2:4 kernel ran: the automatic"
          f" choice took the masked dense reference for every 2:4 layer at every batch"
          f" ({backends[args.batches[0]]}), which multiplies by the decompressed weight, so"
          f" the tokens/s above differ by that and by timing noise only. On an NVIDIA GPU the"
          f" 2:4 products run where they measured faster.")
  else:
    for b in args.batches:
      print(f"batch {b}: 2:4 / dense tokens/s {speed[b]['2:4'] / speed[b]['dense']:.3f}x"
            f" (2:4 layers on {backends[b]})")

  total = {"dense": weight_bytes(dense_params), "2:4": weight_bytes(compressed)}
  kernels = lm.sparse_kernel_bytes(compressed)
  dname = jnp.dtype(dtype).name
  print(f"weights ({dname}): dense model {total['dense']:,} bytes, 2:4 model {total['2:4']:,}"
        f" bytes ({total['2:4'] / total['dense']:.1%}); "
        + (f"its 2:4 kernels {kernels[1]:,} bytes against {kernels[0]:,} dense"
           f" ({kernels[1] / kernels[0]:.1%})" if kernels[0] else "no 2:4 kernel"))
  return {"texts": texts, "tokens_per_s": speed, "backends": backends, "logit_diffs": diffs,
          "weight_bytes": total, "sparse_kernel_bytes": kernels,
          "steps": {"dense": dense_run.step, "2:4": sparse_run.step}}


if __name__ == "__main__":
  main()
