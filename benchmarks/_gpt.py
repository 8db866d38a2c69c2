"""The GPT-style decoder that the whole-model benchmarks train, and its 2:4 setup.

`GPT`: token + learned position embeddings, pre-LayerNorm `Block`s stacked
with `nn.scan` (optionally `nn.remat` inside the scan, with a policy of
`REMAT_POLICIES`), a final LayerNorm and a dense output head. Each block has
exactly four `nn.Dense` layers, `qkv` (d -> 3d), `out` (d -> d), `up`
(d -> 4d) and `down` (4d -> d), all without bias, causal attention through
`jax.nn.dot_product_attention` with heads of `HEAD_DIM` and a GELU MLP;
bfloat16 compute, float32 params. The 2:4 model is the same one through
`jsparse24.sparsify(model, {SPARSE_LAYERS: sparse_options(cfg)})`, trained
with `mask_update` chained before AdamW (`LR`, `WEIGHT_DECAY`, `MASK_DECAY`).
Used by `bench_model.py` (timing and breakdown) and `profile_model.py`
(kernel profiles).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jsparse24

HEAD_DIM = 128
SPARSE_LAYERS = r".*/(qkv|out|up|down)"
MASK_KINDS = {"default": {}, "plain": {"transposable": False},
              "transposable": {"transposable": True}}
LR, WEIGHT_DECAY, MASK_DECAY = 1e-4, 0.1, 2e-4
MVUE = jsparse24.linen.MVUE_RNG  # the rng stream of weight_grad="mvue"
# Recompute everything in the backward pass (the default).
REMAT_POLICY = jax.checkpoint_policies.nothing_saveable

# --remat-policy compressed: also keep the 2:4 products' compressed weights
# (`jsparse24.CHECKPOINT_NAME`), which depend on the weights alone, so the
# recomputed forward pass does not prune and compress every weight again.
# The dense model has no such residual: for it this is `nothing_saveable`.
REMAT_POLICIES = {
    "nothing": REMAT_POLICY,
    "compressed": jax.checkpoint_policies.save_only_these_names(jsparse24.CHECKPOINT_NAME),
    # --remat-policy dots: the matmul outputs saved, the 2:4 products' too
    # (jsparse24.checkpoint_policies); on the dense model it is JAX's policy.
    "dots": jsparse24.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # --remat-policy dots-jax: JAX's own, which sees `dot_general` only: the
    # dense model keeps its matmul outputs, the 2:4 model recomputes its
    # products (custom calls). What a user who does not switch policies gets.
    "dots-jax": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # --remat-policy dots-compressed: "dots" and "compressed" together.
    "dots-compressed": jsparse24.checkpoint_policies.saving_products(
        jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
            jax.checkpoint_policies.save_only_these_names(jsparse24.CHECKPOINT_NAME))),
}

POLICY_NOTES = {
    "nothing": "`nothing_saveable`",
    "compressed": "`nothing_saveable` for the dense model, and for the 2:4 model its compressed"
                  " weights saved (`save_only_these_names(jsparse24.CHECKPOINT_NAME)`)",
    "dots": "`jsparse24.checkpoint_policies.dots_with_no_batch_dims_saveable` (the matmul"
            " outputs saved, the 2:4 products' too; on the dense model it is JAX's"
            " `dots_with_no_batch_dims_saveable`)",
    "dots-jax": "JAX's `dots_with_no_batch_dims_saveable` on both models (it saves"
                " `dot_general` outputs only: the 2:4 model recomputes its products, which are"
                " custom calls)",
    "dots-compressed": "`jsparse24.checkpoint_policies.saving_products(save_from_both_policies("
                       "dots_with_no_batch_dims_saveable, save_only_these_names("
                       "jsparse24.CHECKPOINT_NAME)))` (the matmul outputs, the 2:4 products'"
                       " and their compressed weights saved; on the dense model JAX's"
                       " `dots_with_no_batch_dims_saveable`)",
}


class Block(nn.Module):
  """Pre-LayerNorm decoder block; scanned, so it takes and returns a carry."""

  d_model: int
  attention: str | None  # `implementation=` of jax.nn.dot_product_attention
  dtype: Any = jnp.bfloat16

  @nn.compact
  def __call__(self, x, _):
    batch, seq, d = x.shape
    heads = d // HEAD_DIM
    h = nn.LayerNorm(dtype=self.dtype, name="ln_attn")(x)
    qkv = nn.Dense(3 * d, use_bias=False, dtype=self.dtype, name="qkv")(h)
    # Head-major columns (head, then q/k/v): a column-parallel split of
    # `qkv` hands each device whole heads, so attention needs no exchange.
    q, k, v = jnp.unstack(qkv.reshape(batch, seq, heads, 3, HEAD_DIM), axis=3)
    a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.attention)
    x = x + nn.Dense(d, use_bias=False, dtype=self.dtype, name="out")(a.reshape(batch, seq, d))
    h = nn.LayerNorm(dtype=self.dtype, name="ln_mlp")(x)
    h = nn.gelu(nn.Dense(4 * d, use_bias=False, dtype=self.dtype, name="up")(h))
    return x + nn.Dense(d, use_bias=False, dtype=self.dtype, name="down")(h), None


class GPT(nn.Module):
  vocab: int
  d_model: int
  layers: int
  max_len: int
  attention: str | None
  remat: bool = False
  dtype: Any = jnp.bfloat16
  remat_policy: str = "nothing"  # a key of REMAT_POLICIES

  @nn.compact
  def __call__(self, tokens):
    init = nn.initializers.normal(0.02)
    x = nn.Embed(self.vocab, self.d_model, embedding_init=init, dtype=self.dtype,
                 name="embed")(tokens)
    pos = self.param("pos_embed", init, (self.max_len, self.d_model))
    x = x + pos[: tokens.shape[-1]].astype(self.dtype)
    block = (nn.remat(Block, policy=REMAT_POLICIES[self.remat_policy], prevent_cse=False)
             if self.remat else Block)
    # "sparsity" stacks like "params": one mask per block once sparsified.
    # A 2:4 model with weight_grad="mvue" draws a key per block from "mvue".
    blocks = nn.scan(block, variable_axes={"params": 0, "sparsity": 0},
                     split_rngs={"params": True, MVUE: True}, length=self.layers)
    x, _ = blocks(self.d_model, self.attention, self.dtype, name="blocks")(x, None)
    x = nn.LayerNorm(dtype=self.dtype, name="ln_f")(x)
    return nn.Dense(self.vocab, use_bias=False, dtype=self.dtype, name="head")(x)


def layer_shapes(d: int) -> dict[str, tuple[int, int]]:
  """(K, N) of each block's linear layers."""
  return {"qkv": (d, 3 * d), "out": (d, d), "up": (d, 4 * d), "down": (4 * d, d)}


def sparse_options(cfg: dict) -> dict:
  """The sparsify rule's options: --mask, and weight_grad="mvue" with --weight-grad mvue."""
  extra = {"weight_grad": "mvue"} if cfg["weight_grad"] == "mvue" else {}
  return {**MASK_KINDS[cfg["mask"]], **extra}


def mvue_rngs(cfg: dict, step) -> dict | None:
  """A new "mvue" key per step (from the step number), as a training loop
  derives it; None without --weight-grad mvue."""
  if cfg["weight_grad"] != "mvue":
    return None
  return {MVUE: jax.random.fold_in(jax.random.key(1), step)}


def lm_loss(logits, tokens):
  """Next-token softmax cross-entropy; `logits` are those of `tokens[:, :-1]`."""
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), tokens[:, 1:]).mean()


def make_train_step(apply, tx, out_shardings=None, **update_args):
  """jit((params, opt_state, tokens) -> (params, opt_state, loss)), donating the
  state as a training loop does: the 8192-wide model fits only that way.
  `out_shardings`: the state's own and the loss's, so that the state keeps
  its layout from step to step (None: left to XLA). `update_args`: passed
  on to `tx.update` (mask_update's static `mask_rebuild`)."""

  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(
        lambda p: lm_loss(apply(p, opt_state, tokens[:, :-1]), tokens))(params)
    updates, opt_state = tx.update(grads, opt_state, params, **update_args)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1), out_shardings=out_shardings)


def make_update(tx, **update_args):
  """The optimizer alone: jit((params, opt_state, grads) -> (params, opt_state, None));
  `update_args` as `make_train_step`'s."""

  def update(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params, **update_args)
    return optax.apply_updates(params, updates), opt_state, None

  return jax.jit(update, donate_argnums=(0, 1))


@functools.cache
def _count_setter(count: int):
  # `count` is a constant of the program: no transfer from the host.
  # The old count kept (`keep_unused`) and donated: the new count takes its
  # buffer (`at_count`).
  return jax.jit(lambda c: jnp.full_like(c, count), donate_argnums=0, keep_unused=True)


def at_count(opt_state, count: int):
  """The optimizer state with mask_update's step count set to `count` (it is
  the first element of our chain). Set outside the jitted step, so the count
  stays a runtime input and the compiled step keeps its rebuild branch.

  Set on the device, from the previous step's count, by a program queued
  behind that step. A count made on the host (`jnp.asarray(count)`) is a
  host-to-device copy per step, which on a GPU waits for the steps queued
  before it: the timed 2:4 steps then ran one at a time, each waiting for
  the last, while the dense steps beside them (no count to pin) were
  queued, which at d_model 128-256 cost the 2:4 step more than its
  products.

  Consumes `opt_state`'s count: the new count takes its (donated) buffer,
  as the count that a step writes does in a training loop, so the timed
  step reads its inputs at the same addresses every step."""
  return (opt_state[0]._replace(count=_count_setter(count)(opt_state[0].count)),
          *opt_state[1:])
