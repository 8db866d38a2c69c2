"""2:4 activations: the product `y = prune(x) @ w` whose input is pruned 2:4
along K at every call (`SparsityOptions.input_sparsity`), its gradients, and
their plain-`jnp` reference.

Where it comes from. Haziza et al., "Accelerating Transformer Inference and
Training with 2:4 Activation Sparsity" (Meta, 2025; arXiv 2503.16672,
https://arxiv.org/html/2503.16672v1; OpenReview O5feVk7p6Y). What these
sources establish (as read on 2026-11-27):

- The abstract: 2:4 sparsity applied to activations, exploiting the
  intrinsic sparsity of Squared-ReLU activations "with no accuracy loss";
  up to 1.3x faster feed-forward networks (FFNs) in the forward and the
  backward pass. The pruned activation is the input of the FFN's second
  (down) projection, the output of the squared ReLU.
- One of its authors (pytorch/ao issue #1920, 2025-03-18): squared-ReLU
  FFNs reach > 85% activation sparsity with minimal to no accuracy loss
  against SwiGLU; the forward pass is sparsified "naively, dropping values
  to fit the 2:4 constraint if they do not fit", and "for the backwards
  pass, we need some special sauce to maintain accuracy".
- A third-party summary of the paper (sciencestack.ai) names that sauce: an
  FP8 three-kernel FFN path, a 95/5 feature split and a token permutation
  "to enable effective backward sparsity". The paper's method section is
  not among these sources, and those two are not implemented: they
  serve to run the weight gradient, whose contraction runs over the tokens,
  on the sparse tensor cores (a 2:4 pattern along the tokens).
- xformers (facebookresearch/xformers, `xformers/ops/sp24.py`), the
  authors' library: `sparsify24(x, gradient=...)` gives the pruned input's
  gradient either the forward's own 2:4 pattern (`"24sparse"`, the default,
  and `"24dense"`: the same values, dense) or passes it through unpruned
  (`sparsify24_ste`, "the gradient is *not* sparsified"). Its pruning
  (`sparse24_sparsify_both_ways`) keeps a pattern that is 2:4 along both
  axes of every 4x4 tile, and it returns the activation compressed both
  ways (`packed`, `packed_t`), so that the product contracted over the
  tokens (the weight gradient) can take it as the sparse operand too;
  torchao's `SemiSparseActivationLinear` (pytorch/ao,
  `torchao/sparsity/training/`) does the same with a straight-through
  input gradient.

`transposable=True` is that route to a sparse weight gradient: the mask is
jsparse24's transposable rule (`prune_24(transposable=True)`: the exact best
of the 90 patterns with 2 kept per row and per column of each 4x4 tile of
`x[M, K]`, by kept magnitude) instead of the rows' rule, which keeps the
2 largest of each 4 along K. It keeps a subset of what a pattern along K
alone could keep, so it drops more of a dense activation, and little of a
squared ReLU's (mostly zeros already). The weight gradient stays the exact
gradient of the product that ran, `(x * m)^T @ dy`, and `(x * m)^T` is 2:4
along the tokens, its contraction: on `"cusparselt"` it is the sparse
operand. No re-pruning along the tokens is made, so no approximation of
`dw` either. The price: a token's mask depends on the 3 other tokens of
its tile, later ones included, so its output does too, which a causal
language model must not allow (a token would see the tokens after it, and
decoding one token at a time would prune it otherwise than training did).
Tiles suit models without a causal order (encoders, vision transformers).

`weight_grad="2:4"` is the paper's route as summarized above, without its
refinements: the forward keeps the rows' mask (each token pruned alone,
causal), and the weight gradient's pruned operand (`x * m`, or the pruned
`dy` under `grad_output="2:4"`) is pruned again 2:4 along the tokens by
magnitude (`token_mask`) for `dw` alone, on `"cusparselt"` as the sparse
operand: an approximation of `dw` that drops, per feature and group of 4
tokens, what lies beyond the 2 largest, nothing where the activation has at
most 2 nonzeros there (a squared ReLU's mostly has). The groups are of
tokens 16 rows apart (`TOKEN_STRIDE`), not neighbours, which is what the
paper's token permutation is for: on train_lm's CPU preset the validation
loss rose 1.3% with groups of neighbours and not measurably with these. The
95/5 split (the densest features' `dw` exact) is not implemented.

The gradients here, for `y = (x * m) @ w` with `m = prune_24(x, axis=-1)`
(the magnitude rule of `jsparse24.prune_24`: the 2 largest `|x|` of every 4
consecutive along K, ties to the lower index), or the tile mask above:

- `dw = (x * m)^T @ dy`: exact (the gradient of the product that ran). On
  `"cusparselt"` with the tile mask, the product with `(x * m)^T` as the
  sparse operand.
- `dx`, `"masked"`: `(dy @ w^T) * m`, the derivative of the pruned product
  (the mask held fixed, as a ReLU's is), and xformers' default. Behind a
  squared ReLU its zeros carry on: the gradient into the up projection is
  2:4 along the same axis, which lets the up projection's `dx` run on the
  sparse tensor cores too (`grad_output`, below).
- `dx`, `"ste"`: `dy @ w^T` (straight-through: pruned inputs receive the
  gradient they would have had unpruned).
- `dx` under `grad_output="2:4"` (`SparsityOptions.grad_output`; any of the
  input options, `"off"` included): `prune_24(dy, axis=-1) * dy @ w^T`, the
  output gradient pruned 2:4 along N by magnitude, on `"cusparselt"` with
  the pruned `dy` as the sparse operand. It equals `dy @ w^T` wherever `dy`
  is 2:4 already, which is the case on the layer before one with
  `input_sparsity="masked"` and an elementwise activation between them (a
  feed-forward's up projection: the masked `dx` of the down projection is
  zero where its input was pruned, and the activation's derivative keeps
  those zeros); on any other `dy` it is an approximation of `dx`. `y` and
  `dw` are the product's without it (`dw` from the whole `dy`).
- Under `grad_output="2:4"` with `transposable=True`, `dy` is pruned by the
  tile rule and `dw = (x * m)^T @ prune(dy)` takes it too, on
  `"cusparselt"` with the pruned `dy` as the sparse operand (where the input
  is pruned as well, the input is that operand). Behind a down projection
  with `input_sparsity="masked", transposable=True`, the gradient into
  the up projection is tile-2:4 already, and its `dx` and `dw` are exact
  (tests/test_input_sparse.py,
  `test_transposable_makes_the_whole_feed_forward_backward_exact`); on any
  other `dy` `dw` is an approximation too.

The operation is a `jax.custom_vjp` so that the backends' kernels slot into
its forward (prune + compress `x` once) and backward products; its
residuals are `x` and `w`, and the mask is recomputed from `x` in the
backward pass (the rows' rule: one elementwise pass that XLA fuses into the
products' operands; the tile rule: one Pallas pass on a GPU) rather than
stored. With the tile rule on `"cusparselt"` and at least `KEEP_MIN_ROWS`
rows per device, the forward's one pass over `x` serves the backward too:
the residual is its copy compressed along M (for `dw`) and the mask's codes
(for `dx`), an array of x's shape and a small one, in x's place; likewise
the output gradient's one pass serves `dx` and `dw` (`times_keeping`).
With fewer rows the backward prunes and compresses `x` (`dy`) again for
`dw`. Tiles are 4 consecutive rows of `x[M, K]`
(all leading axes flattened); under data parallelism on `"cusparselt"`,
each device tiles its own rows from its first, which are the whole array's
tiles where each device holds a multiple of 4 rows. Reverse mode only: `jax.jvp` of it raises
JAX's error for a `custom_vjp`. Under `jax.vmap` over `x` with a shared `w`
the backward is batched by JAX: `dw` is formed per example and summed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jsparse24._format import Mask24
from jsparse24._options import ACTIVATION_WEIGHT_GRADS, GRAD_OUTPUTS, INPUT_SPARSITY
from jsparse24._prune import prune_24
from jsparse24.backends._products import accumulation_dtype, as_weight_grad, dense_weight_grad


def input_mask(x: jax.Array, transposable: bool = False) -> jax.Array:
  """The bool 2:4 mask of `x` by magnitude: along K of `x[..., K]`
  (`prune_24(x, axis=-1)`), or with `transposable`, the transposable rule on
  the 4x4 tiles of `x[M, K]` (2:4 along K and along M; M padded with rows
  of zeros to a multiple of 4, which take no kept value from a real row),
  by `Mask24.from_weights`: on an NVIDIA GPU one Pallas pass, where XLA's
  search of the 90 patterns is some 60 times slower."""
  if not transposable:
    return prune_24(x, axis=-1)
  if x.ndim != 2:
    raise ValueError(f"input_mask: transposable=True tiles a 2-D [M, K] array; got shape"
                     f" {x.shape}.")
  pad = -x.shape[0] % 4
  xp = jnp.pad(x, ((0, pad), (0, 0))) if pad else x
  return Mask24.from_weights(xp, transposable=True).unpack()[:x.shape[0]]


def _contract_last(a: jax.Array, b: jax.Array, b_axis: int, precision: Any) -> jax.Array:
  """a's last axis contracted with b's axis `b_axis` (0: `a @ b`, 1: `a @
  b^T`), in their common dtype, as `backends._products.matmul`."""
  return jax.lax.dot_general(a, b, (((a.ndim - 1,), (b_axis,)), ((), ())),
                             precision=precision)


# weight_grad="2:4" groups the tokens in fours TOKEN_STRIDE rows apart, within
# blocks of TOKEN_BLOCK rows (rows 64b + j + 16i, i = 0..3), not consecutively:
# neighbouring tokens of a text light up the same features, and groups of
# consecutive ones held more than 2 nonzeros so often that the validation loss
# rose 1.3% (docs/design_notes.md, "What 2:4 activations cost in validation
# loss"). Blocks of 64 rows keep each device's groups its own where it holds a
# multiple of 64 rows, and are the rows that cuSPARSELt's products pad to.
TOKEN_STRIDE = 16
TOKEN_BLOCK = 4 * TOKEN_STRIDE


def token_groups(a: jax.Array) -> jax.Array:
  """`a[M, C]` (M a multiple of `TOKEN_BLOCK`) with its rows reordered so
  that each group of `weight_grad="2:4"` is 4 consecutive rows: row 4g + i
  is row 64b + j + 16i of `a`, for group g = 16b + j."""
  m, c = a.shape
  return a.reshape(m // TOKEN_BLOCK, 4, TOKEN_STRIDE, c).transpose(0, 2, 1, 3).reshape(m, c)


def token_mask(a: jax.Array) -> jax.Array:
  """The bool mask of `weight_grad="2:4"` for `a[M, C]`: in each group of 4
  tokens (`TOKEN_STRIDE` rows apart, within blocks of `TOKEN_BLOCK` rows; M
  padded with rows of zeros to a multiple of it), per column, the 2 largest
  by magnitude (ties to the lower row)."""
  m, c = a.shape
  pad = -m % TOKEN_BLOCK
  ap = jnp.pad(a, ((0, pad), (0, 0))) if pad else a
  blocks = ap.reshape(ap.shape[0] // TOKEN_BLOCK, 4, TOKEN_STRIDE, c)
  return prune_24(blocks, axis=1).reshape(ap.shape)[:m]


@dataclasses.dataclass(frozen=True)
class ActivationConfig:
  """The static settings of one product with a pruned activation: the
  fields of `SparsityOptions` of the same names (`transposable` resolved to
  a bool), and the product's `precision`. What `Backend.dot_input_sparse`
  and `input_sparse_product` take, as `backends.base.DotConfig` is for a
  2:4 weight."""

  input_sparsity: str  # "masked", "ste", or "off" (the input unpruned)
  grad_output: str  # "dense", or "2:4" (dx from the output gradient pruned along N)
  transposable: bool  # the masks by the 4x4 tile rule
  weight_grad: str  # "dense", or "2:4" (dw's pruned operand pruned again along M)
  precision: Any = None


def input_sparse_reference(x: jax.Array, w: jax.Array, dy: jax.Array | None = None, *,
                           input_sparsity: str = "masked", grad_output: str = "dense",
                           transposable: bool = False, weight_grad: str = "dense",
                           precision: Any = None):
  """The contract, in plain `jnp`: `y = (x * m) @ w` and, given `dy`, the
  `(dx, dw)` of the module docstring, all accumulated in float32 (float64
  for float64) and returned in x's dtype (`dw` in w's). `x` is `[M, K]`,
  `w` `[K, N]`. `input_sparsity`: `"masked"`, `"ste"` or `"off"` (the
  input is not pruned: `m` all ones); `grad_output`: `"dense"` or `"2:4"` (`dx`
  from `dy` pruned 2:4 along N); `transposable`: both masks by the
  transposable rule on 4x4 tiles (`input_mask`), and `dw` from the pruned
  `dy` where `grad_output="2:4"`; `weight_grad="2:4"`: `dw` from the pruned
  activation (the input, else `dy`) pruned again along M (`token_mask`).
  Returns `y`, or `(y, dx, dw)` with `dy`."""
  if (input_sparsity not in INPUT_SPARSITY or grad_output not in GRAD_OUTPUTS
      or weight_grad not in ACTIVATION_WEIGHT_GRADS):
    raise ValueError(f"input_sparse_reference: input_sparsity={input_sparsity!r},"
                     f" grad_output={grad_output!r}, weight_grad={weight_grad!r}; expected"
                     f" one of {INPUT_SPARSITY}, one of {GRAD_OUTPUTS} and one of"
                     f" {ACTIVATION_WEIGHT_GRADS}.")
  acc = accumulation_dtype(x.dtype)
  m = input_mask(x, transposable) if input_sparsity != "off" else jnp.ones(x.shape, bool)
  xm = jnp.where(m, x, 0).astype(acc)
  y = jnp.matmul(xm, w.astype(x.dtype).astype(acc), precision=precision).astype(x.dtype)
  if dy is None:
    return y
  dym = jnp.where(input_mask(dy, transposable), dy, 0) if grad_output == "2:4" else dy
  dx = jnp.matmul(dym.astype(acc), w.astype(x.dtype).astype(acc).T, precision=precision)
  if input_sparsity == "masked":
    dx = jnp.where(m, dx, 0)
  lhs, rhs = xm, (dym if transposable else dy).astype(acc)
  if weight_grad == "2:4" and input_sparsity != "off":
    lhs = jnp.where(token_mask(xm), xm, 0)
  elif weight_grad == "2:4":
    rhs = jnp.where(token_mask(dym), dym, 0).astype(acc)
  dw = jnp.matmul(lhs.T, rhs, precision=precision)
  return y, dx.astype(x.dtype), dw.astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def input_sparse_product(x: jax.Array, w: jax.Array, cfg: ActivationConfig, products: Any):
  """`prune(x) @ w` for `x[M, K]` (the compute dtype) and `w[K, N]` (any
  float dtype, cast to x's inside, so that `dw` comes back in w's dtype as
  the dense layer's does), with the gradients of the module docstring for
  the settings `cfg`, at least one of whose `input_sparsity`, `grad_output`
  prunes.

  `products`: None for the XLA backend's products (masked dense arrays and
  XLA's dense products), or a backend's `SparseProducts` (module-level
  functions, so that it hashes) that prune their sparse operand themselves
  and multiply on the sparse tensor cores."""
  return _fwd(x, w, cfg, products)[0]


class SparseProducts(NamedTuple):
  """A backend's products with a pruned activation as the sparse operand.

  `times(a, b, transposable) -> prune(a) @ b` (a `[M, C]` pruned 2:4 along
  C, by the tile rule where `transposable`; b `[C, N]` in a's dtype): the
  forward product, and `dx` under `grad_output="2:4"`.
  `weight_grad(x, dy, pruned, rule) -> [K, N]` in x's dtype:
  `prune(x)^T @ dy` (`pruned="x"`) or `x^T @ prune(dy)` (`pruned="dy"`),
  the pruned operand 2:4 along M, the contraction: by the tile rule
  (`rule="tiles"`, the operand as the forward saw it), along M alone
  (`rule="tokens"`, the operand already pruned along its features), or
  `times_keeping`'s `kept` in the pruned operand's place (`rule="kept"`).
  `times_keeping(a, b) -> (prune_tiles(a) @ b, kept, codes)`, for a with
  at least `KEEP_MIN_ROWS` rows per device: `times(a, b, True)` that also
  returns what the weight gradient needs of the pruned `a` (`kept`, an
  a-shaped array) and the tile mask's `codes`, so that the one pass that
  prunes `a` serves both products; `tile_mask(codes)`: that mask, bool
  `[M, C]`."""

  times: Callable[[jax.Array, jax.Array, bool], jax.Array]
  weight_grad: Callable[[jax.Array, jax.Array, str, str], jax.Array]
  times_keeping: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]]
  tile_mask: Callable[[jax.Array], jax.Array]


# A backend's `times_keeping` needs this many rows of its operand on each
# device (cuSPARSELt: the copy along M of rows padded to 64 fits in 9/16 of
# them); the whole operand's rows are checked against it times the devices.
KEEP_MIN_ROWS = 128


def _keeps(a: jax.Array, transposable: bool, products: Any) -> bool:
  """Whether the tile-pruned `a` takes `times_keeping`: the tile rule, a
  backend's products, and rows enough on every device (decided at trace time
  from all devices, since under Auto mesh axes the split is not known yet)."""
  return (transposable and products is not None
          and a.shape[0] >= KEEP_MIN_ROWS * jax.device_count())


def _pruned(x: jax.Array, transposable: bool) -> tuple[jax.Array, jax.Array]:
  m = input_mask(x, transposable)
  return m, jnp.where(m, x, jnp.zeros((), x.dtype))


def _sparse_times(a: jax.Array, b: jax.Array, transposable, precision, products) -> jax.Array:
  """`prune(a) @ b` (a's last axis pruned 2:4): the backend's sparse
  product, or XLA's of the masked `a`."""
  if products is not None:
    return products.times(a, b, transposable)
  # nn.Dense's dtype convention: the product in a's dtype, accumulated in
  # float32 by XLA for 16-bit inputs.
  return _contract_last(_pruned(a, transposable)[1], b, 0, precision)


def _fwd(x, w, cfg: ActivationConfig, products):
  if cfg.input_sparsity == "off":
    return _contract_last(x, w.astype(x.dtype), 0, cfg.precision), (x, w, None)
  if _keeps(x, cfg.transposable, products):
    # The backward reads the pruned x and its mask from `kept` and `codes`,
    # not x: no second pass over x, and x need not be kept alive for it.
    y, kept, codes = products.times_keeping(x, w.astype(x.dtype))
    return y, (None, w, (kept, codes))
  y = _sparse_times(x, w.astype(x.dtype), cfg.transposable, cfg.precision, products)
  return y, (x, w, None)


def _bwd(cfg: ActivationConfig, products, res, dy):
  x, w, kept = res
  dy_kept = None
  if cfg.grad_output == "2:4":
    # w^T laid out by XLA (one copy of the kernel, a pass at memory speed):
    # the backends' sparse product takes its dense operand as `[K, N]`.
    wt = w.astype(dy.dtype).T
    if cfg.input_sparsity == "off" and _keeps(dy, cfg.transposable, products):
      dx, dy_kept, _ = products.times_keeping(dy, wt)  # dy's one tile pass for dx and dw
    else:
      dx = _sparse_times(dy, wt, cfg.transposable, cfg.precision, products)
  else:
    # In dy's dtype (backends/_products.py's `matmul` says why): zeroing
    # commutes with the rounding, so the masked dx has the reference's bits.
    dx = _contract_last(dy, w.astype(dy.dtype), 1, cfg.precision)
  if kept is not None:
    m, xm = products.tile_mask(kept[1]), None
  elif cfg.input_sparsity != "off":
    m, xm = _pruned(x, cfg.transposable)
  else:
    m, xm = None, x
  if cfg.input_sparsity == "masked":
    dx = jnp.where(m, dx, jnp.zeros((), dx.dtype))
  if cfg.weight_grad == "2:4":
    dw = _token_weight_grad(x, xm, dy, w, cfg, products)
  else:
    dw = _weight_grad(x, xm, dy, w, cfg, products, kept, dy_kept)
  return dx.astype((x if kept is None else kept[0]).dtype), dw


def _weight_grad(x, xm, dy, w, cfg: ActivationConfig, products, kept=None, dy_kept=None):
  """`dw = xm^T @ dy`, with `dy` pruned too under the tile rule and
  `grad_output="2:4"`; on the backend's sparse product where the tile rule
  makes an operand 2:4 along M, from the pruned operand's `kept` copy where
  `times_keeping` made one (the input's `(kept, codes)`, in x's place; or
  `dy_kept`). Where both are pruned, the input is the sparse operand and
  `dy`'s mask is applied to the dense one. Each operand is pruned once, from
  its own values, as the reference prunes it."""
  if not cfg.transposable:
    return dense_weight_grad(xm, dy, w, cfg.precision)
  if dy_kept is not None:
    return as_weight_grad(products.weight_grad(x, dy_kept, "dy", "kept"), w, x, dy)
  if products is not None and cfg.input_sparsity == "off":
    return as_weight_grad(products.weight_grad(x, dy, "dy", "tiles"), w, x, dy)
  if cfg.grad_output == "2:4":
    dy = _pruned(dy, True)[1]
  if kept is not None:
    return as_weight_grad(products.weight_grad(kept[0], dy, "x", "kept"), w, kept[0], dy)
  if products is None:
    return dense_weight_grad(xm, dy, w, cfg.precision)
  return as_weight_grad(products.weight_grad(x, dy, "x", "tiles"), w, x, dy)


def _token_weight_grad(x, xm, dy, w, cfg: ActivationConfig, products):
  """`weight_grad="2:4"`: `dw` with the pruned input `xm` (where the input
  is pruned; else the output gradient pruned along N, `grad_output="2:4"`)
  pruned again 2:4 along M, the sparse operand on the backend's product."""
  if cfg.input_sparsity != "off":
    if products is not None:
      return as_weight_grad(products.weight_grad(xm, dy, "x", "tokens"), w, x, dy)
    return dense_weight_grad(jnp.where(token_mask(xm), xm, jnp.zeros((), xm.dtype)), dy, w,
                             cfg.precision)
  dym = _pruned(dy, False)[1]
  if products is not None:
    return as_weight_grad(products.weight_grad(x, dym, "dy", "tokens"), w, x, dy)
  return dense_weight_grad(x, jnp.where(token_mask(dym), dym, jnp.zeros((), dym.dtype)), w,
                           cfg.precision)


input_sparse_product.defvjp(_fwd, _bwd)
