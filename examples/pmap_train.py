"""Data-parallel 2:4 training with `jax.pmap` over all local devices.

A small MLP whose hidden layers are `jsparse24.SparseDense` learns a random
"teacher" network (regression). Every device draws its own batch, gradients
are averaged with `jax.lax.pmean`, and `jsparse24.optim.mask_update` (chained
before Adam) rebuilds the 2:4 masks from the parameters. Since every device
applies the same averaged update to the same parameters, every device rebuilds
the same masks: the end of the run checks that params and masks are identical
on all devices.

On a CPU, ask XLA for several (fake) host devices before JAX starts:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/pmap_train.py

On a machine with several GPUs, plain `python examples/pmap_train.py` uses
them all.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jsparse24

IN_FEATURES, OUT_FEATURES = 32, 8


class Teacher(nn.Module):
  """The function to learn: a fixed random dense network."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(OUT_FEATURES)(jnp.tanh(nn.Dense(64)(x)))


class SparseMLP(nn.Module):
  """The student: 2:4 sparse hidden layers, dense output layer."""

  hidden: int = 256

  @nn.compact
  def __call__(self, x):
    x = nn.gelu(jsparse24.SparseDense(self.hidden, name="hidden_0")(x))
    x = nn.gelu(jsparse24.SparseDense(self.hidden, name="hidden_1")(x))
    return nn.Dense(OUT_FEATURES, name="out")(x)


def replicate(tree, n: int):
  """Stacks `n` copies of every leaf along a new leading (device) axis."""
  return jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *jnp.shape(a))), tree)


def unreplicate(tree):
  return jax.tree.map(lambda a: a[0], tree)


def leaves_identical_across_devices(tree) -> bool:
  return all(bool(np.all(np.asarray(a) == np.asarray(a)[:1])) for a in jax.tree.leaves(tree))


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--steps", type=int, default=200, help="training steps")
  p.add_argument("--batch-per-device", type=int, default=64,
                 help="examples per device per step (the global batch is this x devices)")
  p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
  p.add_argument("--log-every", type=int, default=25, help="steps between loss printouts")
  p.add_argument("--seed", type=int, default=0, help="seed of the teacher, data and init")
  return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> float:
  args = parse_args(argv)
  devices = jax.local_devices()
  n = len(devices)
  print(f"JAX {jax.__version__}, backend {jax.default_backend()!r}, {n} local device(s)")
  if n == 1 and jax.default_backend() == "cpu":
    print("  (one device: set XLA_FLAGS=--xla_force_host_platform_device_count=8 to split"
          " the batch over 8 CPU devices)")

  teacher_key, student_key, data_key = jax.random.split(jax.random.key(args.seed), 3)
  teacher = Teacher()
  teacher_params = teacher.init(teacher_key, jnp.zeros((1, IN_FEATURES)))
  model = SparseMLP()
  variables = jax.jit(model.init)(student_key, jnp.zeros((1, IN_FEATURES)))
  tx = optax.chain(
      jsparse24.optim.mask_update(
          variables["sparsity"],
          jsparse24.optim.MaskSchedule(warmup_steps=args.steps // 10,
                                       rebuild_every=max(1, args.steps // 10),
                                       freeze_after=args.steps * 7 // 10)),
      optax.adam(optax.cosine_decay_schedule(args.lr, args.steps, alpha=0.05)))
  params = variables["params"]
  opt_state = jax.jit(tx.init)(params)

  @functools.partial(jax.pmap, axis_name="devices")
  def train_step(params, opt_state, step):
    # A different batch on every device and at every step.
    key = jax.random.fold_in(jax.random.fold_in(data_key, step),
                             jax.lax.axis_index("devices"))
    x = jax.random.normal(key, (args.batch_per_device, IN_FEATURES))
    y = teacher.apply(teacher_params, x)

    def loss_fn(p):
      pred = model.apply({"params": p, "sparsity": jsparse24.optim.masks(opt_state)}, x)
      return jnp.mean((pred - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    grads = jax.lax.pmean(grads, "devices")
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "devices")

  params, opt_state = replicate(params, n), replicate(opt_state, n)
  print(f"training {args.steps} steps, global batch {n} x {args.batch_per_device}")
  for step in range(args.steps):
    params, opt_state, loss = train_step(params, opt_state, jnp.full((n,), step))
    if (step + 1) % args.log_every == 0 or step == 0 or step + 1 == args.steps:
      print(f"step {step + 1:>5}  loss {float(loss[0]):.5f}")
  final_loss = float(loss[0])
  if not np.isfinite(final_loss):
    raise FloatingPointError(f"the loss diverged: {final_loss}")

  masks = jsparse24.optim.masks(opt_state)
  same_params = leaves_identical_across_devices(params)
  same_masks = leaves_identical_across_devices(masks)
  print(f"params identical on all {n} devices: {same_params}")
  print(f"2:4 masks identical on all {n} devices: {same_masks}")
  if not (same_params and same_masks):
    raise AssertionError("the devices drifted apart: params or masks differ")

  stats = jsparse24.optim.stats(unreplicate(opt_state))
  for path, s in stats.items():
    print(f"  {path}: sparsity {float(s['sparsity']):.2f}, flip rate at the last"
          f" rebuild {float(s['flip_rate']):.4f}")
  print(f"final loss {final_loss:.5f} (a zero predictor scores"
        f" {float(jnp.mean(teacher.apply(teacher_params, jax.random.normal(data_key, (4096, IN_FEATURES))) ** 2)):.5f})")
  return final_loss


if __name__ == "__main__":
  main()
