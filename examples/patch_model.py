"""Make an existing Linen model's MLP layers 2:4 sparse without editing its code.

`TinyTransformer` below stands for a model you already have: plain `nn.Dense`
layers, trained and checkpointed dense. `jsparse24.sparsify` intercepts its
`nn.Dense` calls and runs those whose module path fully matches a regex as
2:4 sparse layers (here `.*/mlp/.*`: `block_0/mlp/up`, `block_0/mlp/down`, ...);
every other layer is untouched. The `params` tree does not change, so the dense
checkpoint loads as is; the masks live in a new `"sparsity"` collection.

The script:
  1. trains the dense model a little and saves a dense Orbax checkpoint;
  2. sparsifies the MLP layers, restores the dense checkpoint into the sparse
     model unchanged and builds the 2:4 masks from the loaded weights
     (`jsparse24.rebuild_masks`);
  3. fine-tunes it sparse with `jsparse24.optim.mask_update`;
  4. compresses the sparse kernels (`jsparse24.compress_params`), prints the
     bytes saved, and checks that the compressed model computes the same.

    python examples/patch_model.py
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import jsparse24

VOCAB, SEQ_LEN, D_MODEL = 32, 16, 64
RULES = {r".*/mlp/.*": {"gradient": "ste"}}


# --- "your" model: plain flax.linen, no jsparse24 in it ------------------------


class MlpBlock(nn.Module):
  hidden: int

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(self.hidden, name="up")(x))
    return nn.Dense(x.shape[-1], name="down")(h)


class Block(nn.Module):
  heads: int = 4

  @nn.compact
  def __call__(self, x, mask):
    h = nn.LayerNorm(name="ln_attn")(x)
    x = x + nn.MultiHeadDotProductAttention(self.heads, deterministic=True, name="attn")(h, mask=mask)
    h = nn.LayerNorm(name="ln_mlp")(x)
    return x + MlpBlock(4 * x.shape[-1], name="mlp")(h)


class TinyTransformer(nn.Module):
  """A 2-block causal transformer with dense `nn.Dense` layers everywhere."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, D_MODEL, name="embed")(tokens)
    x = nn.Dense(D_MODEL, name="proj_in")(x)  # a Dense outside the MLPs: stays dense
    x = x + self.param("pos_embed", nn.initializers.normal(0.02), (SEQ_LEN, D_MODEL))
    mask = nn.make_causal_mask(tokens)
    for i in range(2):
      x = Block(name=f"block_{i}")(x, mask)
    return nn.Dense(VOCAB, name="head")(nn.LayerNorm(name="ln_final")(x))


# --- a toy task: continue a sequence that counts modulo VOCAB -------------------


def batch(step: int, size: int = 32):
  rng = np.random.default_rng(step)
  start = rng.integers(0, VOCAB, size=(size, 1))
  stride = rng.integers(1, 4, size=(size, 1))
  seq = (start + stride * np.arange(SEQ_LEN + 1)) % VOCAB
  return jnp.asarray(seq[:, :-1], jnp.int32), jnp.asarray(seq[:, 1:], jnp.int32)


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def train(apply_fn, params, tx, steps: int, first_step: int, variables_fn, label: str):
  """`steps` Adam steps; `variables_fn(params, opt_state)` makes the apply
  variables (the sparse run adds the masks)."""
  opt_state = jax.jit(tx.init)(params)

  @jax.jit
  def step_fn(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(
        lambda p: cross_entropy(apply_fn(variables_fn(p, opt_state), x), y))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  for i in range(steps):
    params, opt_state, loss = step_fn(params, opt_state, *batch(first_step + i))
    if i == 0 or (i + 1) % 20 == 0 or i + 1 == steps:
      print(f"  {label:>5} step {i + 1:>4}: loss {float(loss):.4f}")
  return params, opt_state, float(loss)


def layer_paths(tree: dict, is_layer) -> list[str]:
  """'/'-joined paths of the sub-dicts of `tree` for which `is_layer` holds."""
  out = []

  def walk(node, path):
    if is_layer(node):
      out.append("/".join(path))
    elif isinstance(node, dict):
      for key, value in node.items():
        walk(value, path + (key,))

  walk(tree, ())
  return sorted(out)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--dense-steps", type=int, default=100,
                 help="steps of dense training before the model is made 2:4")
  p.add_argument("--sparse-steps", type=int, default=60,
                 help="steps of 2:4 fine-tuning after `sparsify`")
  p.add_argument("--seed", type=int, default=0, help="seed of the data and init")
  args = p.parse_args(argv)
  if min(args.dense_steps, args.sparse_steps) < 1:  # each phase reports its last loss
    p.error(f"--dense-steps {args.dense_steps} and --sparse-steps {args.sparse_steps} must be"
            f" >= 1.")
  print(f"JAX {jax.__version__}, backend {jax.default_backend()!r}")

  model = TinyTransformer()
  x0, _ = batch(0)

  # 1. The dense model, trained a little and checkpointed.
  params = jax.jit(model.init)(jax.random.key(args.seed), x0)["params"]
  print("dense training:")
  params, _, dense_loss = train(model.apply, params, optax.adam(3e-3), args.dense_steps, 0,
                                lambda p, _: {"params": p}, "dense")
  tmp = tempfile.TemporaryDirectory(prefix="patch_model_")
  ckpt_dir = os.path.join(tmp.name, "dense")
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(ckpt_dir, params)

  # 2. Patch the MLP layers; the dense checkpoint loads unchanged.
  sparse_model = jsparse24.sparsify(model, RULES)
  variables = jax.jit(sparse_model.init)(jax.random.key(args.seed + 1), x0)
  same_tree = (jax.tree.structure(variables["params"]) == jax.tree.structure(params)
               and all(a.shape == b.shape and a.dtype == b.dtype for a, b in
                       zip(jax.tree.leaves(variables["params"]), jax.tree.leaves(params))))
  print(f"sparse model's params tree identical to the dense one: {same_tree}")
  with ocp.StandardCheckpointer() as checkpointer:
    loaded = checkpointer.restore(
        ckpt_dir, jax.tree.map(ocp.utils.to_shape_dtype_struct, variables["params"]))
  tmp.cleanup()
  unchanged = all(bool(jnp.array_equal(a, b)) for a, b in
                  zip(jax.tree.leaves(loaded), jax.tree.leaves(params)))
  print(f"dense checkpoint restored into the sparse model unchanged: {unchanged}")
  # The masks from `init` came from random weights: rebuild them from the loaded ones.
  sparsity = jax.jit(jsparse24.rebuild_masks)(loaded, variables["sparsity"])
  sparse_layers = layer_paths(sparsity, lambda node: isinstance(node, dict) and "mask" in node)
  dense_layers = [path for path in layer_paths(loaded, lambda n: isinstance(n, dict) and "kernel" in n)
                  if path not in sparse_layers]
  print(f"rules {list(RULES)} made sparse: {sparse_layers}")
  print(f"left dense: {dense_layers}")

  x_test, y_test = batch(10_000, size=256)  # a batch no training step sees

  @jax.jit
  def held_out_loss(variables):
    return cross_entropy(sparse_model.apply(variables, x_test), y_test)

  loss_dense_ckpt = float(jax.jit(
      lambda v: cross_entropy(model.apply(v, x_test), y_test))({"params": loaded}))
  loss_pruned = float(held_out_loss({"params": loaded, "sparsity": sparsity}))
  print(f"held-out loss: dense checkpoint {loss_dense_ckpt:.4f}, after one-shot 2:4"
        f" pruning of the MLPs {loss_pruned:.4f}")

  # 3. Sparse fine-tuning: masks rebuilt every 20 steps, frozen for the last quarter.
  tx = optax.chain(
      jsparse24.optim.mask_update(
          sparsity, jsparse24.optim.MaskSchedule(
              rebuild_every=20, freeze_after=max(0, args.sparse_steps * 3 // 4))),
      optax.adam(1e-3))
  print("2:4 fine-tuning:")
  params, opt_state, sparse_loss = train(
      sparse_model.apply, loaded, tx, args.sparse_steps, args.dense_steps,
      lambda p, s: {"params": p, "sparsity": jsparse24.optim.masks(s)}, "2:4")
  masks = jsparse24.optim.masks(opt_state)
  loss_finetuned = float(held_out_loss({"params": params, "sparsity": masks}))
  print(f"held-out loss after 2:4 fine-tuning: {loss_finetuned:.4f}")

  # 4. Compressed weights: the MLP kernels become Sparse24 (values + metadata).
  compressed = jsparse24.compress_params(params, masks)  # not jittable: it reads "active"
  kernels = [k for k in jax.tree.leaves(compressed, is_leaf=lambda a: isinstance(a, jsparse24.Sparse24))
             if isinstance(k, jsparse24.Sparse24)]
  dense_bytes = sum(int(np.prod(k.shape)) * k.dtype.itemsize for k in kernels)
  compressed_bytes = sum(k.nbytes for k in kernels)
  total_dense = sum(a.nbytes for a in jax.tree.leaves(params))
  total_compressed = sum(a.nbytes for a in jax.tree.leaves(  # Sparse24.nbytes for kernels
      compressed, is_leaf=lambda a: isinstance(a, jsparse24.Sparse24)))
  print(f"MLP kernels: dense {dense_bytes:,} bytes -> 2:4 compressed {compressed_bytes:,}"
        f" bytes ({compressed_bytes / dense_bytes:.1%}); whole model {total_dense:,} ->"
        f" {total_compressed:,} bytes (float32)")
  logits = jax.jit(sparse_model.apply)
  with jax.default_matmul_precision("highest"):  # no TF32 on GPUs: compare exactly
    err = float(jnp.max(jnp.abs(logits({"params": compressed}, x_test)
                                - logits({"params": params, "sparsity": masks}, x_test))))
  print(f"compressed model vs masked model: max |logit difference| {err:.2e}")

  return {
      "params_tree_identical": same_tree,
      "checkpoint_loaded_unchanged": unchanged,
      "sparse_layers": sparse_layers,
      "dense_layers": dense_layers,
      "dense_train_loss": dense_loss,
      "sparse_train_loss": sparse_loss,
      "held_out_loss_dense": loss_dense_ckpt,
      "held_out_loss_pruned": loss_pruned,
      "held_out_loss_finetuned": loss_finetuned,
      "mlp_kernel_bytes_dense": dense_bytes,
      "mlp_kernel_bytes_compressed": compressed_bytes,
      "compressed_max_abs_error": err,
      "masks": masks,
  }


if __name__ == "__main__":
  main()
