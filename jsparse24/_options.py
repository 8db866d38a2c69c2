"""The sparsity options of a layer and of the product, declared once.

`SparsityOptions` is the one declaration. The public surfaces spell its
fields out with the same names and defaults (`SparseDense`'s fields,
`nnx.SparseLinear`'s keyword arguments, a `sparsify` rule's options;
`sparse_dot`'s keywords, where `kernel_sharding` is `weight_sharding`
and the mask source is the `mask` argument); tests/test_options.py checks
that they match. Below them, one `SparsityOptions` travels down whole: from
the layers through `_layer.sparse_dense_forward` to `_ops`, which turns it,
with the call's precision and tensor-parallel split, into the backends'
`DotConfig`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from jsparse24 import _checks

GRADIENT_MODES = ("ste", "masked")
WEIGHT_GRADS = ("dense", "mvue", "2:4")
# Those of a layer whose activation is pruned (its kernel dense): "mvue" is
# an option of a 2:4 kernel only (`SparsityOptions._check_dense_kernel` says so).
ACTIVATION_WEIGHT_GRADS = ("dense", "2:4")
MASK_SOURCES = ("collection", "dynamic", "none")
INPUT_SPARSITY = ("off", "masked", "ste")
GRAD_OUTPUTS = ("dense", "2:4")


@dataclasses.dataclass(frozen=True)
class SparsityOptions:
  """The sparsity settings of one layer (also the patcher's per-rule options).

  Attributes:
    gradient: `"ste"` (straight-through dense `dw`) or `"masked"`.
    transposable: build masks that are 2:4 along both axes of the kernel, so
      that the backward product `dx` runs on the sparse tensor cores too.
      None (the default): transposable wherever the layer's output size is a
      multiple of 4, else plain (`resolve_transposable`): `dx` then runs
      on the sparse tensor cores too, for a slightly higher loss
      (docs/design_notes.md, "Transposable masks by default"). With a
      dense kernel (`input_sparsity`, `grad_output`), True prunes those
      activations by the same rule on 4x4 tiles of `[tokens, features]`,
      2:4 along the tokens too, so that the weight gradient runs on the
      sparse tensor cores as well, exactly; a token's mask then depends on
      the 3 others of its tile, later ones included, so a causal model
      must not use it (`weight_grad="2:4"` is the causal route). None and
      False: 2:4 along the features only.
    implementation: the `sparse_dot` backend (None = automatic).
    mask_source: `"collection"`: the mask is the layer's entry in the
      `"sparsity"` collection (made at `init` from the initial kernel, rebuilt
      by `jsparse24.optim`); `"dynamic"`: prune the kernel by magnitude at
      every call (no collection needed); `"none"`: the kernel stays dense
      (no mask anywhere), for a layer whose input or output gradient is
      pruned instead (`input_sparsity`, `grad_output`), and only then.
    weight_grad: `"dense"`, or `"mvue"`: the kernel's gradient from the
      output gradient pruned 2:4 along the tokens by the minimum-variance
      unbiased rule (`jsparse24.sparse_dot`). Its randomness comes from the
      `"mvue"` rng stream: `apply(..., rngs={"mvue": key})` (Linen; under
      `nn.scan`, add `"mvue"` to `split_rngs` for one key per layer), or the
      module's `rngs` (NNX). `"2:4"`, for a layer that prunes an activation
      (`input_sparsity`, `grad_output`): the kernel's gradient from that
      activation pruned again 2:4 along the tokens by magnitude (the pruned
      input, else the pruned output gradient), so that `dw` runs on the
      sparse tensor cores too: an approximation of `dw`, which drops the
      values that a group of 4 tokens holds beyond its 2 largest (few where
      the activation is mostly zeros, as a squared ReLU's is). The forward
      pass is unchanged (each token pruned alone, so a causal model stays
      causal).
    kernel_sharding: tensor parallelism: a `jax.sharding.NamedSharding` of
      the `[in, out]` kernel (`P(None, "model")` column-parallel,
      `P("model", None)` row-parallel); each device prunes, compresses and
      multiplies its own block (`sparse_dot`'s `weight_sharding`). None:
      a kernel sharded at rest is gathered for the product.
    input_sparsity: 2:4 activations (`sparse_dot(..., input_sparsity=)`): `"off"`
      (the default), or the layer's input `x[..., K]` pruned 2:4 along K by
      magnitude at every call, `y = prune(x) @ kernel`, with the input's
      gradient `"masked"` (`dx = (dy @ kernel^T) * mask`, the derivative of
      the pruned product) or `"ste"` (`dx = dy @ kernel^T`,
      straight-through). The sparse tensor cores take one sparse operand,
      so the kernel is then dense: it needs `mask_source="none"` (and the
      weight-only options at their defaults); put 2:4 weights on another
      layer (in a squared-ReLU feed-forward: the up projection 2:4 weights,
      the down projection 2:4 activations).
    grad_output: `"dense"` (the default), or `"2:4"`: the gradient arriving
      at the layer's output, `dy[..., N]`, is pruned 2:4 along N by
      magnitude and the input's gradient `dx = prune(dy) @ kernel^T` runs
      with it as the sparse operand (on `"cusparselt"`, the sparse tensor
      cores; on `"xla"`, a masked dense product); `dw = x^T @ dy` takes the
      whole `dy`. Exact where `dy` is 2:4 already: the up projection of a
      feed-forward whose down projection has `input_sparsity="masked"`
      (the gradient into the elementwise activation is zero where its
      output was pruned, and so is the gradient out of it). Elsewhere an
      approximation of `dx`. The kernel is dense
      (`mask_source="none"`), as with `input_sparsity`; the two combine.
      With `transposable=True`, `dy` is pruned by the tile rule and
      `dw = x^T @ prune(dy)` too (exact where `dy` is tile-2:4 already:
      behind a down projection with `input_sparsity="masked"` and
      `transposable=True`).
  """

  gradient: Literal["ste", "masked"] = "ste"
  transposable: bool | None = None
  implementation: str | None = None
  mask_source: Literal["collection", "dynamic", "none"] = "collection"
  weight_grad: Literal["dense", "mvue", "2:4"] = "dense"
  kernel_sharding: Any = None
  input_sparsity: Literal["off", "masked", "ste"] = "off"
  grad_output: Literal["dense", "2:4"] = "dense"

  def __post_init__(self):
    for name, allowed in (("gradient", GRADIENT_MODES), ("weight_grad", WEIGHT_GRADS),
                          ("mask_source", MASK_SOURCES), ("input_sparsity", INPUT_SPARSITY),
                          ("grad_output", GRAD_OUTPUTS)):
      value = getattr(self, name)
      if value not in allowed:
        raise ValueError(f"unknown {name}={value!r}; expected one of {allowed}.")
    # Checked here too, where the error names the caller (`checked`). Imported
    # here, not at the top: the backends import this module (`_input_sparse`).
    from jsparse24.backends import check_name
    check_name(self.implementation)
    _checks.check_flag("SparsityOptions", "transposable", self.transposable,
                       none="transposable wherever the output width is a multiple of 4")
    self._check_dense_kernel()

  @property
  def activation_sparse(self) -> bool:
    """Whether an activation, not the kernel, is the sparse operand: the
    input (`input_sparsity`) or the output's gradient (`grad_output`)."""
    return self.input_sparsity != "off" or self.grad_output != "dense"

  def pruned_options(self) -> str:
    """The options that prune an activation, as a user wrote them."""
    return " and ".join(f"{name}={getattr(self, name)!r}" for name, off in
                        (("input_sparsity", "off"), ("grad_output", "dense"))
                        if getattr(self, name) != off)

  def _check_dense_kernel(self) -> None:
    """One sparse operand per product: pruned activations take a dense
    kernel, said explicitly (`mask_source="none"`), and a dense kernel only
    goes with them."""
    pruned = self.activation_sparse
    if pruned and self.mask_source != "none":
      raise ValueError(
          f"{self.pruned_options()} prunes an activation 2:4, and the sparse tensor cores"
          f" take one sparse operand, so the kernel stays dense: set mask_source='none'"
          f" (got {self.mask_source!r}); 2:4 weights go on another layer, e.g. the up"
          f" projection of the feed-forward.")
    if not pruned and self.mask_source == "none":
      raise ValueError(
          "mask_source='none' (a dense kernel) is for layers with input_sparsity='masked'"
          " or 'ste', or grad_output='2:4'; with none of them the layer is a plain dense"
          " layer: use nn.Dense / nnx.Linear, or leave it out of the sparsify rules.")
    if not pruned:
      if self.weight_grad == "2:4":
        raise ValueError(
            "weight_grad='2:4' prunes an activation along the tokens, for layers with"
            " input_sparsity or grad_output='2:4'; for a 2:4 kernel use weight_grad='mvue'"
            " (the output gradient pruned along the tokens, unbiased) or 'dense'.")
      return
    if self.gradient != "ste":
      raise ValueError(
          f"gradient={self.gradient!r} is an option of a 2:4 kernel; with"
          f" {self.pruned_options()} the kernel is dense and its gradient exact: leave"
          f" gradient at 'ste'.")
    if self.weight_grad == "mvue":
      raise ValueError(
          f"weight_grad='mvue' is an option of a 2:4 kernel; with {self.pruned_options()}"
          f" the kernel is dense and its gradient exact: leave weight_grad at 'dense' (or"
          f" '2:4': dw from the pruned activation pruned along the tokens).")
    if self.weight_grad == "2:4" and self.transposable:
      raise ValueError(
          "weight_grad='2:4' with transposable=True: the tile masks are 2:4 along the"
          " tokens already, and dw runs on the sparse tensor cores exactly; leave"
          " weight_grad at 'dense' (or transposable at None for the causal forward).")

  @classmethod
  def checked(cls, fn: str, **options: Any) -> SparsityOptions:
    """`SparsityOptions(**options)`, an error naming the caller `fn`."""
    try:
      return cls(**options)
    except (ValueError, TypeError) as e:
      message = str(e).removeprefix("SparsityOptions: ")
      raise type(e)(f"{fn}: {message}") from None

  @classmethod
  def of(cls, obj: Any) -> SparsityOptions:
    """The options held by `obj`'s attributes of the same names (a
    `SparseDense`)."""
    return cls.checked(type(obj).__name__,
                       **{f.name: getattr(obj, f.name) for f in dataclasses.fields(cls)})


def resolve_transposable(transposable: bool | None, features: int,
                         mask_source: str = "collection") -> bool:
  """The mask kind of a layer with `features` outputs: `transposable`, or
  with None, transposable where `features` is a multiple of 4. For a dense
  kernel (`mask_source="none"`) the kind of its pruned activations' masks:
  tiles where `transposable` is True, else False."""
  if mask_source == "none":
    return bool(transposable)
  return features % 4 == 0 if transposable is None else bool(transposable)


def check_widths(layer: str, opts: SparsityOptions, *, inputs: str, in_width: int,
                 outputs: str, out_width: int, leave_dense: str) -> None:
  """Raises where a layer's widths cannot take its options, naming the layer
  and the fix: before the mask is built, whose own error would name
  `prune_24` and not the layer. `layer`: how the error names it; `inputs`,
  `outputs`: how it names the two widths (`"the input width 6"`,
  `"in_features=6"`); `in_width`, `out_width`: the widths; `leave_dense`:
  the way to a dense layer, said last (`"or make this layer an nn.Dense"`).
  `opts.transposable` as requested (True raises on an output width that is
  not a multiple of 4; None picks a plain mask there)."""
  # The input axis is pruned where the input is or where the kernel is 2:4.
  if in_width % 4 and (opts.input_sparsity != "off" or opts.mask_source != "none"):
    what = ("the input is pruned 2:4 along" if opts.input_sparsity != "off"
            else "2:4 sparsity keeps 2 of every 4 consecutive inputs (the")
    raise ValueError(
        f"{layer}: {inputs} is not a multiple of 4; {what} kernel's contraction axis)."
        f" Pad the inputs' last axis to {in_width + -in_width % 4}, {leave_dense}.")
  if opts.grad_output != "dense" and out_width % 4:
    raise ValueError(
        f"{layer}: {outputs} is not a multiple of 4; with grad_output="
        f"{opts.grad_output!r} the output gradient is pruned 2:4 along it. Pad the output"
        f" to {out_width + -out_width % 4} features, or leave grad_output at 'dense'.")
  if opts.transposable and opts.mask_source != "none" and out_width % 4:
    raise ValueError(
        f"{layer}: {outputs} is not a multiple of 4, which a transposable mask (2:4"
        f" along both kernel axes) needs. Set transposable=None (transposable wherever"
        f" the output width allows) or False, {leave_dense}.")
