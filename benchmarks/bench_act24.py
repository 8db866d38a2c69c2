"""2:4 activations on the sparse tensor cores (`input_sparsity`, the
"cusparselt" backend): the prune + compress pass, the linear layer's
training step over a grid of shapes, and a squared-ReLU feed-forward block.

Sections (`--sections`, comma-separated):

* `kernel`: `x[M, K]` pruned 2:4 along K and compressed for cuSPARSELt (the
  Pallas pass and the metadata pass), against its floor: reading x and
  writing 9/16 of its bytes at the measured copy bandwidth; and pruned on
  4x4 tiles (`transposable=True`) with both copies written (9/8 of its
  bytes).
* `layer`: `y = prune(x) @ w` with its gradients (y, dx, dw, as a layer in
  a model needs them) on cuSPARSELt, against the same step on XLA (masked
  dense products) and the dense layer's, at M in `--layer-ms` and K, N in
  `--layer-kn`; `--json` writes the timings, the sweep that
  `CusparseltBackend.prefers` reads its rule for this product from.
* `ffn`: a feed-forward block `relu(x @ w1)^2 @ w2` (d_model 4096, hidden
  16384, 16,384 tokens) trained by SGD, its input's gradient computed as in a
  model: dense; the down projection's input 2:4 (`input_sparsity="masked"`);
  that with the up projection's dx from its 2:4 output gradient
  (`grad_output="2:4"`); the down projection's input 2:4 with the up
  projection's weight 2:4 (a stored transposable mask); the first two with
  the activations pruned on 4x4 tiles (`transposable=True`: the down
  projection's dw and the up projection's dw on the sparse tensor cores too);
  and `act+dx` with both weight gradients from the pruned activations pruned
  again along the tokens (`weight_grad="2:4"`, the causal route to the same
  sparse products).

Every dense step is timed before the process's first cuSPARSELt product, and
again after the 2:4 ones (`_common.CUSPARSELT_TAX`); the ratios use the first.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp

import jsparse24
from benchmarks import _common
from jsparse24.backends import cusparselt as cslt

KERNEL_SHAPES = ((16384, 16384), (16384, 4096), (4096, 16384))
FFN = {"d_model": 4096, "hidden": 16384, "tokens": 16384}


def _rand(seed, shape, scale=1.0):
  return (jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale).astype(jnp.bfloat16)


def section_kernel(bw):
  rows = []
  for m, k in KERNEL_SHAPES:
    x = _rand(m, (m, k))
    t = _common.bench(jax.jit(cslt.input_compress_for_product), x, min_time=0.3)
    moved = m * k * 2 + m * k * 9 // 8  # read x; write the values and the metadata
    rows.append([f"{m} x {k}", "rows", t * 1e3, moved / t / 1e9, 100 * moved / t / bw,
                 moved / bw * 1e3])
    t = _common.bench(jax.jit(cslt.tiles_compress_for_products), x, min_time=0.3)
    moved = m * k * 2 + 2 * (m * k * 9 // 8)  # read x; write both copies
    rows.append([f"{m} x {k}", "tiles", t * 1e3, moved / t / 1e9, 100 * moved / t / bw,
                 moved / bw * 1e3])
  return ("prune + compress of activations for cuSPARSELt (bf16)",
          "`rows`: `cusparselt.input_compress_for_product` (2:4 along K); `tiles`:"
          " `cusparselt.tiles_compress_for_products` (the transposable rule on 4x4"
          " tiles, both copies); each the Pallas prune + compress pass and the metadata"
          " passes; floor = bytes read and written at the measured copy bandwidth.\n\n"
          + _common.table(["x [M, K]", "mask", "ms", "GB/s", "% of copy", "floor ms"],
                          rows))


def _layer_step(impl):
  kw = {} if impl is None else {"input_sparsity": "masked", "implementation": impl}

  @jax.jit
  def step(x, w, dy):
    y, back = jax.vjp(lambda x, w: jsparse24.sparse_dot(x, w, **kw), x, w)
    return y, *back(dy)

  return step


def _layer_args(m, k, n):
  return _rand(1, (m, k)), _rand(2, (k, n), k ** -0.5), _rand(3, (m, n))


def time_layer(impl, points):
  """{(M, K, N): seconds per step}; the arrays made per point (the largest
  three take 1.5 GB)."""
  return {p: _common.bench(_layer_step(impl), *_layer_args(*p), min_time=0.1, repeats=3)
          for p in points}


def section_layer(dense, masked, points, records):
  sparse = time_layer("cusparselt", points)
  rows = [[*p, dense[p] * 1e3, masked[p] * 1e3, sparse[p] * 1e3, dense[p] / sparse[p],
           masked[p] / sparse[p]] for p in points]
  records.append({"layer": [[*p, dense[p], masked[p], sparse[p]] for p in points]})
  return ("2:4 activations: linear-layer step over M, K, N (bf16)",
          "y = prune(x) @ w and its dx, dw (`jax.vjp` of `sparse_dot(...,"
          " input_sparsity='masked')`) on cuSPARSELt, where only the forward product is"
          " sparse, and on XLA (masked dense products), against the dense `x @ w`'s.\n\n"
          + _common.table(["M", "K", "N", "dense ms", "xla 2:4 x ms", "cuSPARSELt 2:4 x ms",
                           "dense / cuSPARSELt", "xla / cuSPARSELt"], rows))


def _ffn_step(variant, mask1):
  """One SGD step of the block; variant "dense", "act", "act+dx", "act+w",
  "tiles" (act+dx on 4x4 tiles), "tiles+w" (act+w, the activation on tiles)
  or "tokens" (act+dx, the weight gradients pruned along the tokens)."""
  tiles = variant.startswith("tiles")
  dw = {"weight_grad": "2:4"} if variant == "tokens" else {}

  def block(p, x):
    if variant in ("act+w", "tiles+w"):
      h = jsparse24.sparse_dot(x, p["w1"], mask1, implementation="cusparselt")
    elif variant in ("act+dx", "tiles", "tokens"):
      h = jsparse24.sparse_dot(x, p["w1"], grad_output="2:4", transposable=tiles,
                               implementation="cusparselt", **dw)
    else:
      h = x @ p["w1"]
    h = jnp.square(jax.nn.relu(h))
    if variant == "dense":
      return h @ p["w2"]
    return jsparse24.sparse_dot(h, p["w2"], input_sparsity="masked", transposable=tiles,
                                implementation="cusparselt", **dw)

  # The input's gradient too, as a block inside a model computes it for the
  # layers before it (without it XLA drops the up projection's dx product).
  @functools.partial(jax.jit, donate_argnums=0)
  def step(p, x, target):
    def loss(p, x):
      return jnp.mean(jnp.square((block(p, x) - target).astype(jnp.float32)))
    value, (g, dx) = jax.value_and_grad(loss, argnums=(0, 1))(p, x)
    return jax.tree.map(lambda a, b: a - 1e-3 * b.astype(a.dtype), p, g), value, dx

  return step


FFN_BLOCKS = ("act", "act+dx", "act+w", "tiles", "tiles+w", "tokens")


def section_ffn(blocks=FFN_BLOCKS):
  d, hidden, tokens = FFN["d_model"], FFN["hidden"], FFN["tokens"]
  x, target = _rand(1, (tokens, d)), _rand(2, (tokens, d))
  params = {"w1": _rand(3, (d, hidden), d ** -0.5), "w2": _rand(4, (hidden, d), hidden ** -0.5)}
  mask1 = jsparse24.Mask24.from_weights(params["w1"], transposable=True)
  params = {"w1": jnp.where(mask1.unpack(), params["w1"], 0), "w2": params["w2"]}
  times, losses = {}, {}

  def run(name):
    step = _ffn_step(name.split(" ")[0], mask1)
    state = {"p": jax.tree.map(jnp.copy, params)}
    losses.setdefault(name.split(" ")[0], float(step(jax.tree.map(jnp.copy, params), x,
                                                     target)[1]))

    def once(x, target):
      state["p"], value, dx = step(state["p"], x, target)
      return value, dx

    times[name] = _common.bench(once, x, target, min_time=1.0)

  for name in ("dense", *blocks, "dense again"):
    run(name)
  base = times["dense"]
  rows = [[name, t * 1e3, tokens / t, base / t] for name, t in times.items()]
  return (f"2:4 activations: squared-ReLU FFN block step (d_model {d}, hidden {hidden},"
          f" {tokens} tokens, bf16)",
          "relu(x @ w1)^2 @ w2, SGD, with the input's gradient (6 products); `act`: the"
          " down projection's input pruned 2:4 (`input_sparsity='masked'`, cuSPARSELt"
          " with x as the sparse operand); `act+dx`: and the up projection's dx from its"
          " output gradient, 2:4 behind the masked activations, as the sparse operand"
          " (`grad_output='2:4'`);"
          " `act+w`: and the up projection 2:4 on a stored transposable mask (y and dx"
          " sparse); `tiles`, `tiles+w`: `act+dx`, `act+w` with the activation (and the"
          " up projection's output gradient) pruned on 4x4 tiles (`transposable=True`),"
          " the weight gradients of the pruned operands sparse too; `tokens`: `act+dx`"
          " with both weight gradients from the pruned activations pruned along the"
          " tokens (`weight_grad='2:4'`, an approximation). First-step losses: "
          + ", ".join(f"{k} {v:.5f}" for k, v in losses.items()) + ".\n\n"
          + _common.table(["block", "ms / step", "tokens / s", "dense / this"], rows))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--sections", default="kernel,layer,ffn")
  p.add_argument("--no-write", action="store_true", help="print only; leave results/ alone")
  p.add_argument("--layer-ms", default="4096,16384", help="the layer section's M values")
  p.add_argument("--layer-kn", default="2048,4096,8192,16384",
                 help="the layer section's K and N values (every pair)")
  p.add_argument("--json", default=None, help="also write the layer timings to this JSON file")
  p.add_argument("--ffn-blocks", default=",".join(FFN_BLOCKS),
                 help="the ffn section's 2:4 blocks (timed between the dense block and"
                      f" the dense block again); of {', '.join(FFN_BLOCKS)}")
  args = p.parse_args(argv)
  blocks = tuple(args.ffn_blocks.split(","))
  if unknown := [b for b in blocks if b not in FFN_BLOCKS]:
    p.error(f"--ffn-blocks: unknown block(s) {', '.join(unknown)}; of {', '.join(FFN_BLOCKS)}")
  reason = jsparse24.available_implementations()["cusparselt"]
  if reason is not None:
    raise SystemExit(f"bench_act24: the cusparselt backend cannot run here: {reason}")
  bw = _common.copy_bandwidth()
  head = (f"{_common.environment()}; measured copy bandwidth {bw / 1e12:.3f} TB/s. Dense"
          f" steps timed before the first cuSPARSELt product: {_common.CUSPARSELT_TAX}.\n\n")
  print(head, flush=True)
  records = []
  sections = args.sections.split(",")
  # Every dense step before the first cuSPARSELt product: the layer grid's
  # here, the block's inside its section, which runs first.
  ms, kn = ([int(v) for v in a.split(",")] for a in (args.layer_ms, args.layer_kn))
  points = [(m, k, n) for m in ms for k in kn for n in kn]
  if "layer" in sections:
    dense_layer, masked_layer = time_layer(None, points), time_layer("xla", points)
  run = {"kernel": lambda: section_kernel(bw), "ffn": lambda: section_ffn(blocks),
         "layer": lambda: section_layer(dense_layer, masked_layer, points, records)}
  for name in [s for s in ("ffn", "kernel", "layer") if s in sections]:
    t0 = time.time()
    title, body = run[name]()
    print(f"\n## {title}\n\n{body}\n({time.time() - t0:.0f} s)\n", flush=True)
    if not args.no_write:
      _common.write_section(title, head + body)
  if args.json:
    _common.write_json(args.json, records)


if __name__ == "__main__":
  main()
