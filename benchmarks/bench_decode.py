"""Decode: a GPT-style decoder generating with a KV cache, dense and 2:4, and
its products at the decode shapes.

    PYTHONPATH=. python benchmarks/bench_decode.py [--widths 2048,4096] [--layers 8]
        [--blocks loop|scan] [--layout portable|cusparselt] [--profile] [--no-write]
    PYTHONPATH=. python benchmarks/bench_decode.py --quick --no-write   # CPU, tiny

The model is `benchmarks/_gpt.py`'s `GPT` (random weights; bf16 compute;
blocks of four bias-free linear layers `qkv`, `out`, `up`, `down`, heads of
128, a dense output head), written for a cache as `DecodeGPT`: the same params
tree (`qkv`'s output split as `[q | k | v]`, GPT-2's order: `qkv_as_blocks`),
a Python loop of blocks with params of their own (`--blocks scan`: the
blocks in `nn.scan` over stacked params, where each step copies every
block's weights out of the stacks, as a generator should not), the
cache head-major, `[layers, batch, heads, context, 128]`, carried through the
blocks and written in place (`dynamic_update_slice`; the jitted step donates
it), each block's keys and values read in the cache's own layout (`pinned`)
by an attention written as two einsums (`cached_attention`). The 2:4
model is the same module through
`jsparse24.sparsify(model, {r".*/(qkv|out|up|down)": {"transposable": False}})`
applied to `jsparse24.compress_params` output (bf16 `Sparse24`s: the forward
operand only, as a model is shipped), each product on the implementation the
automatic choice picks; the dense model holds the masked weights
(`decompress` of the same `Sparse24`s), so both compute the same function.

Per width:

* one decode step at context `--context` (the new token at the last position,
  attending to all of the cache): ms and tokens/s, dense and 2:4, at each
  `--batches`; the logits of the two models compared at every batch
  (relative error by norm within `LOGITS_TOL`, else the script exits with an
  error after printing);
* prefill: `--prefill` tokens of one sequence written into the cache (causal
  attention over them: cuDNN's fused attention on a GPU, `--attention`) and
  the last one's logits, tokens/s of both;
* the products at the model's shapes (`layer_shapes`; M = each batch and the
  prefill length): dense XLA `x @ w` against `jsparse24.sparse_dot(x, sp)`
  on the compressed operand, with the automatic choice and with each other
  implementation that runs here forced, each timed over a rotation of weights
  (`rotation`), each weight with its own x; ms, GB/s (x, the weight and y
  moved once), % of the measured copy bandwidth, speed-up over dense XLA;
  with `--profile`, also each product's GPU time and the speed-up by it;
* with `--profile` (a GPU): where one decode step's GPU time goes at each
  batch, both models (`jax.profiler` over `PROFILED_STEPS` steps, kernels
  summed per step by kind: the decode kernel, cuSPARSELt, XLA's products,
  the rest).

Every dense timing of every width runs before the first 2:4 one (the
method's rule 1 in benchmarks/README.md). Tables are printed and written to
benchmarks/results/<gpu>.md unless `--no-write`.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental import layout

import jsparse24
from benchmarks import _common
from benchmarks._gpt import GPT, HEAD_DIM, SPARSE_LAYERS, layer_shapes

# The 2:4 model's logits against the dense model's on the masked weights:
# relative error by norm. Both run bf16 products accumulated in float32 that
# differ in summation order only; each layer's bf16 rounding (2^-9) then
# propagates through the blocks.
LOGITS_TOL = 3e-2
IMPLEMENTATIONS = ("xla", "pallas", "cusparselt")
# Steps traced per profile (after two untraced ones): the kernels are summed
# over them and divided, so one step's stray kernel weighs a third.
PROFILED_STEPS = 3
# The profile table's columns: `_common.kernel_category`'s kinds of the
# products (cuSPARSELt's "sparse gemm", XLA's "dense gemm"), all else summed.
KERNEL_KINDS = ("decode kernel", "sparse gemm", "dense gemm", "the rest")
# Seconds of consecutive decode steps per timed run (the median of 5 runs is
# reported). A run pays the first call's dispatch (0.4-0.8 ms for these steps)
# and the final sync once: runs of 0.02 s held 3 steps at batch 64, where
# this put 0.2-0.5 ms on each step and two timings of one 2:4 model differed
# by 0.4 ms (H200, 2026-12-03, benchmarks/results/nvidia-h200.md, "Decode:
# the steps timed over longer runs, ..."). A generation is a long run of
# steps: time one.
STEP_MIN_TIME = 0.3
QUICK = dict(widths="128", layers=2, context=32, batches="1,4", prefill=32, vocab=512)


# --- the model with a KV cache ------------------------------------------------------


def pinned(a: jax.Array) -> jax.Array:
  """`a` laid out row-major, as the cache it is read from.

  Without it, where the attention's output feeds a Pallas kernel (the 2:4
  `out` projection on the decode kernel), XLA lays the matrix-vector
  attention's reduction out with the context minor and pushes that layout
  into the scan's carry: the whole cache is transposed before and after
  the loop over the blocks, in every decode step (`out` on the kernel up
  to M = 16, batch 16, d_model 4096 x 8 blocks: 8.93 ms per step against
  3.46 ms pinned; H200,
  2026-11-28, benchmarks/results/nvidia-h200.md, "Decode: the KV cache
  re-laid out around the blocks' loop"). A kernel's operands are fixed
  row-major; XLA's own product takes any layout, so the dense model is
  unaffected (4.26 ms either way). Those figures are of the attention
  then written, `jax.nn.dot_product_attention` over a context-major
  cache; the head-major cache and `cached_attention` keep the pin and
  were not timed without it."""
  return layout.with_layout_constraint(a, layout.Layout(major_to_minor=tuple(range(a.ndim))))


def cached_attention(q: jax.Array, keys: jax.Array, values: jax.Array, pos) -> jax.Array:
  """One query per sequence, `q [batch, heads, HEAD_DIM]`, against a
  head-major cache (`keys`, `values`: `[batch, heads, context, HEAD_DIM]`)
  up to position `pos`: `jax.nn.dot_product_attention`'s XLA computation
  (float32 logits and softmax) written as two einsums.

  That function takes the cache context-major (`[batch, context, heads,
  HEAD_DIM]`), where its decode attention took 36.9 and 94.2 us per block at
  batch 1 and 8 against 24.3 and 80.9 us here (H200, 2026-12-03,
  benchmarks/results/nvidia-h200.md, "Decode: products on the CUDA cores at
  1-4 rows, ..."); in the model the head-major cache made both models' steps
  7-11% faster and left their ratio as it was ("Decode: the steps timed
  over longer runs, ...").

  The barrier between the softmax and the values' reduction keeps XLA from
  fusing the softmax into that reduction at batch 1, where its fusion
  computed 8 of a head's 128 outputs per program: 25.7 us per block against
  21.7 us kept apart (at batch 4-64 the barrier took 0.6-0.9% off); the
  decode step at batch 1 took 1.446 / 1.044 ms (dense / 2:4) with it and
  1.479 / 1.084 ms without (H100, 2026-12-06,
  benchmarks/results/nvidia-h100-80gb-hbm3.md, "Decode: the softmax kept
  out of the values' reduction")."""
  logits = jnp.einsum("bhd,bhkd->bhk", q, keys, preferred_element_type=jnp.float32)
  logits = jnp.where(jnp.arange(keys.shape[2]) <= pos, logits * HEAD_DIM ** -0.5, -jnp.inf)
  probs = jax.lax.optimization_barrier(jax.nn.softmax(logits, axis=-1).astype(values.dtype))
  return jnp.einsum("bhk,bhkd->bhd", probs, values,
                    preferred_element_type=jnp.float32).astype(q.dtype)


class DecodeBlock(nn.Module):
  """`_gpt.Block` over a cache; scanned, so it takes and returns a carry
  `(x, k_cache, v_cache)` (caches of every block, `[layers, batch, heads,
  context, HEAD_DIM]`) and gets its block index as the scanned input.

  `prefill`: the tokens are the first ones (`pos` = 0): causal attention over
  them alone (`jax.nn.dot_product_attention` with `implementation=attention`:
  None or "xla" is XLA's, which writes the float32 logits of every pair of
  tokens to memory; "cudnn" is a fused flash attention, as a serving prefill
  runs).
  Otherwise one token at `pos`: attention over the cache up to it
  (`cached_attention`)."""

  d_model: int
  prefill: bool
  dtype: Any = jnp.bfloat16
  attention: str | None = None

  @nn.compact
  def __call__(self, carry, layer, pos):
    x, k_cache, v_cache = carry
    batch, seq, d = x.shape
    heads = d // HEAD_DIM
    h = nn.LayerNorm(dtype=self.dtype, name="ln_attn")(x)
    qkv = nn.Dense(3 * d, use_bias=False, dtype=self.dtype, name="qkv")(h)
    # [q | k | v], each of all heads (GPT-2's order; `_gpt.Block` orders the
    # columns per head: `qkv_as_blocks`). Split in the per-head order, the
    # 2:4 model's step took 1.68 ms at batch 8 and 8.18 ms at batch 64
    # against 1.54 and 6.96 ms, the dense one's the same (H200, 2026-12-03,
    # benchmarks/results/nvidia-h200.md, "Decode: the order of qkv's
    # columns, ..."): XLA fuses the strided slice of q out of the decode
    # kernel's output into the attention's reduction, which then reads the
    # cache 1.6x more slowly ("Decode: the steps timed over longer runs, the
    # per-head split's attention, ...").
    q, k, v = jnp.unstack(qkv.reshape(batch, seq, 3, heads, HEAD_DIM), axis=2)
    at = (layer, 0, 0, pos, 0)
    k_cache = jax.lax.dynamic_update_slice(
        k_cache, jnp.swapaxes(k, 1, 2)[None].astype(k_cache.dtype), at)
    v_cache = jax.lax.dynamic_update_slice(
        v_cache, jnp.swapaxes(v, 1, 2)[None].astype(v_cache.dtype), at)
    if self.prefill:
      a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.attention)
    else:
      if seq != 1:
        raise ValueError(f"DecodeBlock: a decode step takes one token per sequence, got {seq}.")
      keys, values = (pinned(jax.lax.dynamic_index_in_dim(c, layer, keepdims=False))
                      for c in (k_cache, v_cache))
      a = cached_attention(q[:, 0], keys, values, pos)
    x = x + nn.Dense(d, use_bias=False, dtype=self.dtype, name="out")(a.reshape(batch, seq, d))
    h = nn.LayerNorm(dtype=self.dtype, name="ln_mlp")(x)
    h = nn.gelu(nn.Dense(4 * d, use_bias=False, dtype=self.dtype, name="up")(h))
    x = x + nn.Dense(d, use_bias=False, dtype=self.dtype, name="down")(h)
    return (x, k_cache, v_cache), None


class DecodeGPT(nn.Module):
  """`_gpt.GPT` with a KV cache: `__call__(tokens [B, S], cache, pos) ->
  (logits [B, S, vocab], cache)`; a `prefill` returns the last token's
  logits only (`[B, 1, vocab]`), the ones the next token is drawn from, as a
  generator's prefill does (at 2048 tokens and a vocabulary of 32768 the
  head over every token is a 0.55-TFLOP product).

  `attention`: the prefill's `implementation=` of
  `jax.nn.dot_product_attention` (`DecodeBlock`).

  `scan` (the default): the blocks in `nn.scan`, params stacked as in
  `_gpt.GPT` (the same tree). Otherwise a Python loop over blocks
  `block_0`, `block_1`, ... with params of their own (`unstack_blocks`):
  the scan's loop slices each block's weights out of the stacks in every
  step, and where a product cannot read the slice in place (a Pallas kernel
  cannot; XLA's dense product on a static slice can) the slice is a copy."""

  vocab: int
  d_model: int
  layers: int
  max_len: int
  prefill: bool
  dtype: Any = jnp.bfloat16
  scan: bool = True
  attention: str | None = None

  @nn.compact
  def __call__(self, tokens, cache, pos):
    init = nn.initializers.normal(0.02)
    x = nn.Embed(self.vocab, self.d_model, embedding_init=init, dtype=self.dtype,
                 name="embed")(tokens)
    pos_embed = self.param("pos_embed", init, (self.max_len, self.d_model))
    x = x + jax.lax.dynamic_slice_in_dim(pos_embed, pos, tokens.shape[-1]).astype(self.dtype)
    carry = (x, cache["k"], cache["v"])
    if self.scan:
      blocks = nn.scan(DecodeBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                       in_axes=(0, nn.broadcast), length=self.layers)
      carry, _ = blocks(self.d_model, self.prefill, self.dtype, self.attention, name="blocks")(
          carry, jnp.arange(self.layers), pos)
    else:
      for i in range(self.layers):
        carry, _ = DecodeBlock(self.d_model, self.prefill, self.dtype, self.attention,
                               name=f"block_{i}")(carry, i, pos)
    x, k_cache, v_cache = carry
    if self.prefill:
      x = x[:, -1:]
    x = nn.LayerNorm(dtype=self.dtype, name="ln_f")(x)
    logits = nn.Dense(self.vocab, use_bias=False, dtype=self.dtype, name="head")(x)
    return logits, {"k": k_cache, "v": v_cache}


def qkv_as_blocks(params: dict) -> dict:
  """`GPT`'s params with each block's `qkv` kernel columns reordered from
  `_gpt.Block`'s per-head `[heads, 3, HEAD_DIM]` to the `[3, heads,
  HEAD_DIM]` that `DecodeBlock` splits: `DecodeGPT` on the result computes
  what `GPT` computes on `params`. The benchmark's weights are random, so it
  leaves them as they are."""
  def reorder(kernel):
    *lead, d, n = kernel.shape
    grouped = kernel.reshape(*lead, d, n // (3 * HEAD_DIM), 3, HEAD_DIM)
    return jnp.swapaxes(grouped, -3, -2).reshape(*lead, d, n)
  qkv = params["blocks"]["qkv"]
  return {**params, "blocks": {**params["blocks"], "qkv": {**qkv, "kernel": reorder(qkv["kernel"])}}}


def unstack_blocks(params: dict, layers: int) -> dict:
  """`DecodeGPT(scan=False)`'s params from the scanned model's: `blocks`'
  stacked arrays (and `Sparse24`s) split into `block_0`, `block_1`, ..."""
  out = {k: v for k, v in params.items() if k != "blocks"}
  for i in range(layers):
    out[f"block_{i}"] = jax.tree.map(lambda a, i=i: a[i], params["blocks"])
  return out


def random_cache(cfg: dict, d: int, batch: int, seed: int = 0) -> dict[str, jax.Array]:
  """A full cache of random keys and values (the same for a given seed, so the
  dense and the 2:4 model see the same one)."""
  shape = (cfg["layers"], batch, d // HEAD_DIM, cfg["context"], HEAD_DIM)
  return _random_cache(jax.random.key(seed), shape)


@functools.partial(jax.jit, static_argnums=1)
def _random_cache(key, shape):
  kk, kv = jax.random.split(key)
  return {"k": jax.random.normal(kk, shape, jnp.bfloat16),
          "v": jax.random.normal(kv, shape, jnp.bfloat16)}


def make_models(cfg: dict, d: int) -> dict[str, Any]:
  """The width's params (masked dense and compressed, bf16) and its jitted
  steps `(params, tokens, cache, pos) -> (logits, cache)`, cache donated."""
  vocab, layers, context = cfg["vocab"], cfg["layers"], cfg["context"]
  rules = {SPARSE_LAYERS: {"transposable": False}}
  train_model = jsparse24.sparsify(GPT(vocab, d, layers, context, None), rules)
  variables = jax.jit(train_model.init)(jax.random.key(d), jnp.zeros((1, 8), jnp.int32))
  bf16 = jax.jit(lambda p: jax.tree.map(lambda a: a.astype(jnp.bfloat16), p))(
      variables["params"])
  compressed = jsparse24.compress_params(bf16, variables["sparsity"],
                                         cusparselt=cfg.get("layout") == "cusparselt")
  del variables, bf16
  scan = cfg.get("blocks", "loop") == "scan"
  if not scan:
    compressed = unstack_blocks(compressed, layers)
  out = {"compressed": compressed, "masked": masked_params(compressed), "steps": {}}
  for prefill in (False, True):
    model = DecodeGPT(vocab, d, layers, context, prefill, scan=scan,
                      attention=cfg.get("attention"))
    for name, m in (("dense", model), ("2:4", jsparse24.sparsify(model, rules))):
      out["steps"][name, prefill] = jax.jit(
          lambda params, tokens, cache, pos, m=m: m.apply({"params": params}, tokens, cache, pos),
          donate_argnums=2)
  return out


@jax.jit
def masked_params(compressed):
  """Dense params with `kernel * mask` in place of each `Sparse24`."""
  return jax.tree.map(
      lambda a: jsparse24.decompress(a) if isinstance(a, jsparse24.Sparse24) else a,
      compressed, is_leaf=lambda a: isinstance(a, jsparse24.Sparse24))


def logits_match(got, ref, tol: float = LOGITS_TOL) -> tuple[bool, float]:
  """(whether `got` equals `ref` within `tol`, their relative error by norm)."""
  err = _common.rel_err(got, ref)
  return err <= tol, err


# --- timing ---------------------------------------------------------------------------


def threaded_step(step, params, tokens, cache, pos):
  """A callable for `_common.bench`: each call runs `step` on the cache the
  previous (donating) call returned."""
  state = {"cache": cache}

  def run():
    logits, state["cache"] = step(params, tokens, state["cache"], pos)
    return logits

  return run


def profile_steps(run) -> dict[str, Any] | None:
  """GPU kernels per step of `run` (a `threaded_step`), by kind: `{"kernels":
  count, "ms": total, kind: ms}`; None where no GPU kernel was traced (CPU)."""
  events = _common.traced_kernels(run, calls=PROFILED_STEPS, warmups=2)
  if not events:
    return None
  ms = collections.Counter()
  for e in events:
    kind = _common.kernel_category(e["name"])
    ms[kind if kind in KERNEL_KINDS else "the rest"] += e.get("dur", 0) / 1e3 / PROFILED_STEPS
  return {"kernels": len(events) / PROFILED_STEPS, "ms": sum(ms.values()),
          **{kind: ms[kind] for kind in KERNEL_KINDS}}


def time_model(cfg: dict, d: int, models: dict, name: str, timer) -> dict[str, Any]:
  """Decode steps at every batch and the prefill of one model: ms, tokens/s
  and the logits (the last position's, float32) the comparison needs."""
  params = models["compressed" if name == "2:4" else "masked"]
  out = {"decode": {}, "prefill": None}
  for b in cfg["batches"]:
    tokens = jax.random.randint(jax.random.key(b), (b, 1), 0, cfg["vocab"], jnp.int32)
    pos = jnp.asarray(cfg["context"] - 1, jnp.int32)
    step = models["steps"][name, False]
    logits = step(params, tokens, random_cache(cfg, d, b), pos)[0]  # its cache freed now
    run = threaded_step(step, params, tokens, random_cache(cfg, d, b), pos)
    seconds = timer(run)
    out["decode"][b] = {"ms": seconds * 1e3, "tokens_per_s": b / seconds,
                        "logits": logits[:, -1].astype(jnp.float32)}
    if cfg.get("profile"):
      out["decode"][b]["profile"] = profile_steps(run)
    del run
  p = cfg["prefill"]
  tokens = jax.random.randint(jax.random.key(p), (1, p), 0, cfg["vocab"], jnp.int32)
  step = models["steps"][name, True]
  zero = jnp.asarray(0, jnp.int32)
  logits = step(params, tokens, random_cache(cfg, d, 1), zero)[0]
  seconds = timer(threaded_step(step, params, tokens, random_cache(cfg, d, 1), zero))
  out["prefill"] = {"ms": seconds * 1e3, "tokens_per_s": p / seconds,
                    "logits": logits[0].astype(jnp.float32)}
  return out


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def kernel_operands(k: int, n: int, m: int, i: int = 0, cusparselt: bool = False):
  """(the `i`-th x [m, k], the `i`-th compressed random weight [k, n]
  (`cusparselt`: in cuSPARSELt's layout), its dense `w * mask`), bf16. Each
  weight of a rotation has its own x (`_common.rows_per_weight` says why)."""
  x = jax.random.normal(jax.random.key(m * 31 + k + 7919 * i), (m, k), jnp.bfloat16)
  w = jax.random.normal(jax.random.key(k * 7 + n + 7919 * i), (k, n), jnp.bfloat16)
  sp = jsparse24.compress(w, cusparselt=cusparselt)
  return x, sp, jsparse24.decompress(sp)


def rotation(k: int, n: int, quick: bool) -> int:
  """How many weights of `[k, n]` each timed call of the product table
  cycles through (`_common.rotation` of the compressed weight; 2 with
  --quick: a check of the script, not a timing). One weight in one call per
  timing measured the call and L2 more than the product (H100, 2026-11-28,
  M = 1, `up` and `down`: the kernel 0.56x and 0.57x of dense XLA with one
  weight, 1.37x and 1.51x rotated, as tune_decode; nvidia-h100-80gb-hbm3.md,
  "Decode with a KV cache: narrow tiles where K is long, ...")."""
  return 2 if quick else _common.rotation(_common.compressed_bytes(k, n))


def time_kernels(cfg: dict, d: int, timer, sparse: bool, bandwidth: float) -> list[dict]:
  """Rows of the product table for this width: dense XLA (`sparse=False`),
  or `sparse_dot` on the compressed operand, automatic and forced; each
  timing the mean over a rotation of weights (`rotation`)."""
  rows = []
  dense_mm = _common.rotated(lambda x, w: x @ w)
  for m in cfg["kernel_ms"]:
    for layer, (k, n) in layer_shapes(d).items():
      r = rotation(k, n, cfg["quick"])
      cusparselt = cfg.get("layout") == "cusparselt"
      operands = [kernel_operands(k, n, m, i, cusparselt) for i in range(r)]
      xs, sps, ws = ([o[j] for o in operands] for j in range(3))
      del operands
      io = 2 * (m * k + m * n)
      if not sparse:
        runs = [("dense XLA", dense_mm, ws, io + 2 * k * n)]
      else:
        auto = jsparse24.selected_implementation(
            (m, k), (k, n), jnp.bfloat16, compressed="cusparselt" if cusparselt else True)
        # Bytes read: cuSPARSELt's metadata rows (in its layout) by cuSPARSELt only.
        read = lambda impl: (io + sps[0].nbytes if impl == "cusparselt"  # noqa: E731
                             else io + k * n + sps[0].meta.size)
        runs = [(f"auto ({auto})", None, sps, read(auto))]
        # Forced: every other implementation that runs here (the automatic
        # choice's own is its row).
        runs += [(impl, impl, sps, read(impl)) for impl in IMPLEMENTATIONS
                 if impl != auto and jsparse24.available_implementations()[impl] is None]
      for label, impl, ops, nbytes in runs:
        row = {"m": m, "layer": layer, "k": k, "n": n, "implementation": label, "rotation": r}
        fn = impl if callable(impl) else _common.rotated(functools.partial(
            lambda x, s, impl: jsparse24.sparse_dot(x, s, implementation=impl), impl=impl))
        try:
          seconds = timer(fn, xs, ops) / r
        except Exception as e:  # pylint: disable=broad-except
          # A forced implementation that cannot run a shape is a row of the
          # table saying why; the automatic choice must always run.
          if label.startswith("auto") or label == "dense XLA":
            raise
          row.update(ms=float("nan"), note=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
          rows.append(row)
          continue
        row.update(ms=seconds * 1e3, gb_s=nbytes / seconds / 1e9,
                   pct_copy=100 * nbytes / seconds / bandwidth)
        if cfg.get("profile"):
          gpu = _common.kernel_seconds(fn, xs, ops)
          row["gpu_ms"] = float("nan") if gpu is None else gpu / r * 1e3
        rows.append(row)
      del xs, sps, ws
  return rows


# --- main ------------------------------------------------------------------------------


def steps_line(cfg: dict, result: dict, name: str) -> str:
  """The steps of `name` ("dense" or "2:4") just timed, in one line: ms per
  decode step per batch and the prefill's, with the speed-up over dense for
  2:4. Printed as each model finishes, so a run stopped before its tables
  (a time limit) still shows them."""
  def part(label, ms, dense_ms):
    return f"{label} {ms:.4g} ms" + (f" ({dense_ms / ms:.3f}x)" if name != "dense" else "")
  timed = result[name]
  parts = [part(f"batch {b}", timed["decode"][b]["ms"], result["dense"]["decode"][b]["ms"])
           for b in cfg["batches"]]
  parts.append(part(f"prefill {cfg['prefill']}", timed["prefill"]["ms"],
                    result["dense"]["prefill"]["ms"]))
  return ", ".join(parts)


def profile_section(rows: list[list]) -> str:
  """The `--profile` table, or why it is empty."""
  if not rows:
    return "\n\n`--profile`: no GPU kernel was traced (the profile needs a GPU)."
  return (f"\n\n**Where a decode step's GPU time goes** (`--profile`: `jax.profiler` over"
          f" {PROFILED_STEPS} steps, GPU kernels summed per step by kind; ms per step is the"
          f" timing above, with steps queued back to back):\n\n"
          + _common.table(["d_model", "batch", "model", "ms per step", "kernels per step",
                           "kernel ms", *(f"{kind} ms" for kind in KERNEL_KINDS)], rows))


def parse_args(argv: Sequence[str] | None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--widths", default=None, help="d_model values (comma-separated;"
                 " default 2048,4096, --quick: 128,256); multiples of 128")
  p.add_argument("--layers", type=_common.count, default=None,
                 help="blocks (default 8; --quick: 2)")
  p.add_argument("--context", type=_common.count, default=None,
                 help="KV-cache length; the decode step's token sits at its last position"
                      " (default 2048; --quick: 64)")
  p.add_argument("--batches", default=None, help="decode batch sizes (default 1,4,16,64;"
                 " --quick: 1,4)")
  p.add_argument("--prefill", type=_common.count, default=None,
                 help="prefill tokens, one sequence (default 2048; --quick: 64); <= --context")
  p.add_argument("--vocab", type=_common.count, default=None,
                 help="vocabulary (default 32768; --quick: 512)")
  p.add_argument("--kernel-ms", default=None,
                 help="M (rows of x) of the product table (default: --batches and --prefill)")
  p.add_argument("--blocks", choices=("loop", "scan"), default="loop",
                 help="a Python loop of blocks with params of their own (default), or the blocks"
                      " in nn.scan with stacked params (each step then copies every block's"
                      " weights out of the stacks, dense and 2:4 alike)")
  p.add_argument("--quick", action="store_true",
                 help="tiny sizes and short timings (CPU checks of the script)")
  p.add_argument("--profile", action="store_true",
                 help="also profile decode steps (jax.profiler; a GPU): where each batch's"
                      " step time goes")
  p.add_argument("--layout", choices=("portable", "cusparselt"), default="portable",
                 help="the 2:4 weights as `compress_params` gives them (portable, default) or"
                      " in cuSPARSELt's layout (cusparselt=True), which cuSPARSELt multiplies"
                      " in place")
  p.add_argument("--attention", choices=_common.ATTENTION_CHOICES, default="auto",
                 help="the prefill's causal attention (jax.nn.dot_product_attention's"
                      " implementation; auto: cudnn on a GPU, else xla); a decode step's"
                      " attention is always `cached_attention`")
  p.add_argument("--no-write", action="store_true", help="print only; leave results/ alone")
  p.add_argument("--json", default=None, help="also write the raw numbers to this file")
  args = p.parse_args(argv)
  full = dict(widths="2048,4096", layers=8, context=2048, batches="1,4,16,64", prefill=2048,
              vocab=32768)
  for key, value in (QUICK if args.quick else full).items():
    if getattr(args, key) is None:
      setattr(args, key, value)
  cfg = {"widths": _common.counts(p, "--widths", args.widths),
         "batches": _common.counts(p, "--batches", args.batches),
         "layers": args.layers, "context": args.context, "prefill": args.prefill,
         "vocab": args.vocab, "quick": args.quick, "blocks": args.blocks,
         "profile": args.profile, "layout": args.layout,
         "attention": _common.attention_implementation(args.attention)}
  cfg["kernel_ms"] = (_common.counts(p, "--kernel-ms", args.kernel_ms) if args.kernel_ms
                      else [*cfg["batches"], cfg["prefill"]])
  if any(w % HEAD_DIM for w in cfg["widths"]):
    p.error(f"--widths must be multiples of {HEAD_DIM} (the head size).")
  if args.prefill > args.context:
    p.error(f"--prefill {args.prefill} must fit the cache: at most --context {args.context}.")
  return args, cfg


def compressed_backends(d: int, m: int, weights: str = "portable") -> list[str]:
  """The implementations the automatic choice takes for the 2:4 model's
  products at `m` rows: its weights are compressed (`compress_params`, in
  the `--layout` `weights`)."""
  compressed = "cusparselt" if weights == "cusparselt" else True
  return sorted({jsparse24.selected_implementation((m, k), (k, n), jnp.bfloat16,
                                                   compressed=compressed)
                 for k, n in layer_shapes(d).values()})


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args, cfg = parse_args(argv)
  env = _common.environment()
  print(env, flush=True)
  if cfg["quick"]:
    timer = step_timer = functools.partial(_common.bench, min_time=0.005, repeats=3)
    bandwidth = _common.copy_bandwidth() if jax.default_backend() == "gpu" else float("nan")
  else:
    timer = functools.partial(_common.bench, min_time=0.02, repeats=5)
    step_timer = functools.partial(_common.bench, min_time=STEP_MIN_TIME, repeats=5)
    bandwidth = _common.copy_bandwidth()
  print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s; config {cfg}", flush=True)

  start = time.perf_counter()
  elapsed = lambda: f"({time.perf_counter() - start:.0f} s)"
  models = {d: make_models(cfg, d) for d in cfg["widths"]}
  results = {d: {"d_model": d} for d in cfg["widths"]}
  # Dense first, every width (benchmarks/README.md, rule 1), then 2:4.
  for name in ("dense", "2:4"):
    for d in cfg["widths"]:
      print(f"[d_model {d}] {name}: decode steps and prefill {elapsed()}", flush=True)
      results[d][name] = time_model(cfg, d, models[d], name, step_timer)
      print(f"[d_model {d}] {name}: {steps_line(cfg, results[d], name)}", flush=True)
      print(f"[d_model {d}] {name}: products {elapsed()}", flush=True)
      results[d][f"kernels_{name}"] = time_kernels(cfg, d, timer, name == "2:4", bandwidth)

  print(f"timings done {elapsed()}", flush=True)
  failures = []
  model_rows, prefill_rows, kernel_rows, profile_rows = [], [], [], []
  for d in cfg["widths"]:
    r, dense, sparse = results[d], results[d]["dense"], results[d]["2:4"]
    r["decode"], r["prefill"] = {}, {}
    for b in cfg["batches"]:
      ok, err = logits_match(sparse["decode"][b]["logits"], dense["decode"][b]["logits"])
      if not ok:
        failures.append(f"d_model {d}, batch {b}: logits relative error {err:.3g}")
      backends = compressed_backends(d, b, cfg["layout"])
      t_d, t_s = dense["decode"][b]["ms"], sparse["decode"][b]["ms"]
      r["decode"][b] = {"dense_ms": t_d, "sparse_ms": t_s, "speedup": t_d / t_s,
                        "dense_tokens_per_s": b / t_d * 1e3, "sparse_tokens_per_s": b / t_s * 1e3,
                        "logits_rel_err": err, "backends": backends}
      model_rows.append([d, cfg["layers"], b, t_d, b / t_d * 1e3, t_s, b / t_s * 1e3, t_d / t_s,
                         ", ".join(backends), err, "ok" if ok else "MISMATCH"])
    ok, err = logits_match(sparse["prefill"]["logits"], dense["prefill"]["logits"])
    if not ok:
      failures.append(f"d_model {d}, prefill: logits relative error {err:.3g}")
    t_d, t_s = dense["prefill"]["ms"], sparse["prefill"]["ms"]
    p = cfg["prefill"]
    backends = compressed_backends(d, p, cfg["layout"])
    r["prefill"] = {"dense_ms": t_d, "sparse_ms": t_s, "speedup": t_d / t_s,
                    "logits_rel_err": err, "backends": backends}
    prefill_rows.append([d, cfg["layers"], p, t_d, p / t_d * 1e3, t_s, p / t_s * 1e3, t_d / t_s,
                         ", ".join(backends), err, "ok" if ok else "MISMATCH"])
    dense_ms = {(row["m"], row["layer"]): row for row in r["kernels_dense"]}
    for row in r["kernels_dense"] + r["kernels_2:4"]:
      base = dense_ms[row["m"], row["layer"]]
      row["speedup"] = base["ms"] / row["ms"] if row["ms"] == row["ms"] else float("nan")
      if cfg["profile"]:
        row["gpu_speedup"] = base.get("gpu_ms", float("nan")) / row.get("gpu_ms", float("nan"))
    order = list(layer_shapes(d))
    for row in sorted(r["kernels_dense"] + r["kernels_2:4"],
                      key=lambda row: (row["m"], order.index(row["layer"]))):
      kernel_rows.append([d, row["m"], row["layer"], f"{row['k']}x{row['n']}",
                          row["implementation"], row["ms"], row.get("gb_s", float("nan")),
                          row.get("pct_copy", float("nan")), row["speedup"],
                          *((row.get("gpu_ms", float("nan")), row["gpu_speedup"])
                            if cfg["profile"] else ()), row.get("note", "")])
    for b in cfg["batches"] if cfg["profile"] else ():
      for name in ("dense", "2:4"):
        part = r[name]["decode"][b]
        if prof := part["profile"]:
          profile_rows.append([d, b, name, part["ms"], prof["kernels"], prof["ms"],
                               *(prof[kind] for kind in KERNEL_KINDS)])
    for name in ("dense", "2:4"):
      for part in r[name]["decode"].values():
        part.pop("logits")
      r[name]["prefill"].pop("logits")

  in_layout = ", in cuSPARSELt's layout" if cfg["layout"] == "cusparselt" else ""
  body = (f"{env}; measured copy bandwidth {bandwidth / 1e12:.3f} TB/s. Random weights, bf16;"
          f" {cfg['layers']} blocks ({'nn.scan, params stacked' if cfg['blocks'] == 'scan' else 'a Python loop, params per block'}),"
          f" vocabulary {cfg['vocab']}, every block's qkv, out, up and"
          f" down 2:4 (compress_params, forward operand only{in_layout}),"
          f" dense head. Dense: the same"
          f" model on the masked weights. Every dense timing ran before the first 2:4 one."
          f" Logits: relative error by norm of the 2:4 model's against the dense model's"
          f" (tolerance {LOGITS_TOL}).\n\n"
          f"**Decode step** (one new token per sequence at position {cfg['context'] - 1}, the"
          f" cache holding {cfg['context']} positions; ms per step, the median of"
          f" {3 if cfg['quick'] else 5} runs of consecutive steps, each at least"
          f" {0.005 if cfg['quick'] else STEP_MIN_TIME} s):\n\n"
          + _common.table(["d_model", "blocks", "batch", "dense ms", "dense tokens/s", "2:4 ms",
                           "2:4 tokens/s", "speedup", "2:4 layers on", "logits rel err",
                           "check"], model_rows)
          + f"\n\n**Prefill** ({cfg['prefill']} tokens, one sequence; causal attention"
            f" `implementation={cfg['attention']!r}`; the last token's logits):\n\n"
          + _common.table(["d_model", "blocks", "tokens", "dense ms", "dense tokens/s", "2:4 ms",
                           "2:4 tokens/s", "speedup", "2:4 layers on", "logits rel err",
                           "check"], prefill_rows)
          + "\n\n**Products at the model's shapes** (each timed call cycling through"
            f" {'2 weights' if cfg['quick'] else '2-16 weights (about 200 MB compressed, at most 16)'},"
            " ms per product; GB/s: x, the weight (dense, or values + metadata) and y moved"
            " once; speed-up over dense XLA; `auto`: the automatic choice, which it names;"
            + (" GPU ms: the product's kernels' GPU time (`--profile`; a call of nothing but"
               " Pallas Mosaic GPU products idles between them, a decode step does not),"
               " GPU speed-up by it;" if cfg["profile"] else "")
            + (" `cusparselt` multiplies the weights in its layout in place):\n\n"
               if cfg["layout"] == "cusparselt" else
               " `cusparselt` on a `Sparse24` re-lays it out for cuSPARSELt in every call):\n\n")
          + _common.table(["d_model", "M", "layer", "KxN", "implementation", "ms", "GB/s",
                           "% of copy bw", "speedup",
                           *(("GPU ms", "GPU speedup") if cfg["profile"] else ()), "note"],
                          kernel_rows)
          + (profile_section(profile_rows) if cfg["profile"] else "")
          + "".join(f"\n\nNot run here: `{name}`, {reason}." for name, reason
                    in jsparse24.available_implementations().items() if reason))
  print("\n" + body)
  used = {b for r in results.values() for part in (*r["decode"].values(), r["prefill"])
          for b in part["backends"]}
  if used == {"xla"}:
    body += ("\n\nNo 2:4 kernel ran: the automatic choice took the masked dense reference"
             " (`xla`) for every 2:4 product, so the speed-ups above say nothing about 2:4"
             " kernels.")
    print(body.rsplit("\n\n", 1)[1])
  out = {"config": cfg, "bandwidth": bandwidth, "widths": list(results.values()),
         "failures": failures}
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(out, indent=1, default=str))
  if failures:
    raise SystemExit("bench_decode: the 2:4 model's logits differ from the dense model's on the"
                     f" masked weights beyond {LOGITS_TOL}: " + "; ".join(failures))
  if not args.no_write:
    title = (f"Decode: GPT-style decoder with a KV cache, d_model {','.join(map(str, cfg['widths']))},"
             f" context {cfg['context']}")
    print(f"\nwritten to {_common.write_section(title, body)}")
  return out


if __name__ == "__main__":
  main()
