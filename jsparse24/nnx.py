"""Flax NNX: `SparseLinear`, its `SparsityMask` variables, and mask helpers.

`SparseLinear` is a drop-in `flax.nnx.Linear`: same constructor, same `Param`s
(`kernel [in, out]`, `bias`), so `nnx.state(layer, nnx.Param)` is exactly
`nnx.Linear`'s and dense weights load unchanged. Its 2:4 mask is extra state
in `SparsityMask` variables, which are not `Param`s: an
`nnx.Optimizer(..., wrt=nnx.Param)` and `nnx.grad` leave them alone.

Per layer (with `mask_source="collection"`, the default):

* `layer.mask`: `SparsityMask(Mask24)`, the packed mask (1 bit per weight),
  built from the initial kernel; `rebuild_masks(model)` rebuilds it from the
  current kernel;
* `layer.active`: `SparsityMask(bool[])`; False runs the plain dense product
  (dense phases of a schedule: warm-up, final dense fine-tuning).

With `mask_source="dynamic"` both are None and the kernel is pruned by
magnitude at every call; with `"none"` (2:4 activations) both are None and
the kernel stays dense. This mirrors `jsparse24.linen`, where the same state
lives in the `"sparsity"` collection.

To serve a trained model, `compress_params(model)` replaces, in place, the
kernel of every active layer by its `Sparse24` (values + metadata, 56% of the
bfloat16 bytes without the transposed copy), as `jsparse24.compress_params`
does for Linen params: the kernel stays an `nnx.Param` (holding a pytree),
the layer's `mask` and `active` become None (the mask is in the metadata),
and `SparseLinear` multiplies by it through `jsparse24.sparse_dot`, whose
automatic choice takes the Pallas decode kernel at few rows where that
measured faster. `nnx.split`/`merge`/`jit` and Orbax carry such a model like
any other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from flax.nnx.nn.linear import default_bias_init, default_kernel_init

from jsparse24._format import Mask24, Sparse24
from jsparse24._layer import compresses, sparse_dense_forward
from jsparse24._ops import compress, cusparselt_layout_unfit
from jsparse24._options import SparsityOptions, check_widths, resolve_transposable
from jsparse24.linen import MVUE_RNG, mask_like_kernel


class SparsityMask(nnx.Variable):
  """State of a 2:4 sparse layer (its `Mask24` mask and `active` flag).

  Not a `Param`: optimizers built with `wrt=nnx.Param` and `nnx.grad` do not
  touch it. Select it with `nnx.state(model, SparsityMask)`
  (`masks_state(model)`).
  """


class SparseLinear(nnx.Module):
  """A drop-in `flax.nnx.Linear` whose kernel is 2:4 sparse along its input axis.

  Takes every argument of `nnx.Linear` with the same names and defaults, and
  has the same parameters (`kernel [in, out]`, `bias`); the output equals
  `nnx.Linear` applied to `kernel * mask`. The keyword-only sparsity options
  mean what they mean in `jsparse24.linen.SparsityOptions`: `gradient`
  (`"ste"` or `"masked"`), `transposable`, `implementation`,
  `mask_source` (`"collection"`: a `SparsityMask` made from the initial
  kernel; `"dynamic"`: prune the kernel by magnitude at every call;
  `"none"`: a dense kernel, with `input_sparsity` or `grad_output`), `weight_grad`
  (`"mvue"`: the layer keeps a fork of `rngs["mvue"]`, or of the default
  stream, and draws one key per call from it) and `input_sparsity`
  (`"masked"` / `"ste"`: the input pruned 2:4 at every call, the kernel
  dense; `jsparse24.sparse_dot`) and `grad_output` (`"2:4"`: the input's
  gradient from the output gradient pruned 2:4, the kernel dense).
  `transposable=None` (the default) is transposable where `out_features` is
  a multiple of 4, as in `jsparse24.SparseDense`. The layer keeps them as
  attributes of the same names (`transposable` resolved).

  `in_features` must be a multiple of 4 (and `out_features` too when
  `transposable`). A custom `dot_general` is refused: the product is
  `jsparse24.sparse_dot`. `preferred_element_type` sets the output dtype; the
  sparse product accumulates in float32 but rounds to the promoted input dtype
  before that cast.

  After `compress_params(model)` the kernel holds a `Sparse24` and the layer
  multiplies by it (`jsparse24.sparse_dot` with the layer's
  `implementation`, None: the automatic choice for a compressed weight).

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jsparse24 import nnx as jnnx
    >>> layer = jnnx.SparseLinear(16, 8, rngs=nnx.Rngs(0))
    >>> layer(jnp.ones((2, 16))).shape
    (2, 8)
    >>> sorted(k for k, _ in nnx.state(layer, nnx.Param).items())
    ['bias', 'kernel']
  """

  def __init__(
      self,
      in_features: int,
      out_features: int,
      *,
      use_bias: bool = True,
      dtype: Any = None,
      param_dtype: Any = jnp.float32,
      precision: Any = None,
      kernel_init: Any = default_kernel_init,
      bias_init: Any = default_bias_init,
      dot_general: Any = jax.lax.dot_general,
      promote_dtype: Any = nnx_dtypes.promote_dtype,
      preferred_element_type: Any = None,
      rngs: nnx.Rngs,
      kernel_metadata: Mapping[str, Any] = MappingProxyType({}),
      bias_metadata: Mapping[str, Any] = MappingProxyType({}),
      gradient: Literal["ste", "masked"] = "ste",
      transposable: bool | None = None,
      implementation: str | None = None,
      mask_source: Literal["collection", "dynamic", "none"] = "collection",
      weight_grad: Literal["dense", "mvue", "2:4"] = "dense",
      kernel_sharding: Any = None,
      input_sparsity: Literal["off", "masked", "ste"] = "off",
      grad_output: Literal["dense", "2:4"] = "dense",
  ):
    opts = SparsityOptions.checked(
        "SparseLinear", gradient=gradient, transposable=transposable,
        implementation=implementation, mask_source=mask_source, weight_grad=weight_grad,
        kernel_sharding=kernel_sharding, input_sparsity=input_sparsity,
        grad_output=grad_output)
    check_widths("SparseLinear", opts, inputs=f"in_features={in_features}",
                 in_width=in_features, outputs=f"out_features={out_features}",
                 out_width=out_features, leave_dense="or make this layer an nnx.Linear")
    opts = dataclasses.replace(opts, transposable=resolve_transposable(
        transposable, out_features, opts.mask_source))
    if dot_general is not jax.lax.dot_general:
      raise ValueError(
          "SparseLinear: a custom `dot_general` cannot be combined with 2:4"
          " sparsity (the product is jsparse24.sparse_dot).")

    # The same rng draws in the same order as nnx.Linear: same seed, same params.
    kernel_key = rngs.params()
    self.kernel = nnx.Param(
        kernel_init(kernel_key, (in_features, out_features), param_dtype),
        **kernel_metadata)
    self.bias: nnx.Param | None
    if use_bias:
      bias_key = rngs.params()
      self.bias = nnx.Param(bias_init(bias_key, (out_features,), param_dtype),
                            **bias_metadata)
    else:
      self.bias = nnx.data(None)

    self.mask: SparsityMask | None
    self.active: SparsityMask | None
    if opts.mask_source == "collection":
      self.mask = SparsityMask(Mask24.from_weights(self.kernel[...],
                                                   transposable=opts.transposable))
      self.active = SparsityMask(jnp.array(True))
    else:
      self.mask = nnx.data(None)
      self.active = nnx.data(None)
    # After the parameter draws, so that the params are nnx.Linear's.
    self.mvue_rngs: nnx.RngStream | None
    if opts.weight_grad == "mvue":
      if MVUE_RNG not in rngs and "default" not in rngs:
        raise ValueError(
            f"SparseLinear: weight_grad='mvue' needs an {MVUE_RNG!r} (or 'default') rng"
            f" stream in `rngs`, e.g. nnx.Rngs(params=0, {MVUE_RNG}=1).")
      self.mvue_rngs = rngs[MVUE_RNG].fork()
    else:
      self.mvue_rngs = nnx.data(None)

    self.in_features = in_features
    self.out_features = out_features
    self.use_bias = use_bias
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.precision = precision
    self.dot_general = dot_general
    self.promote_dtype = promote_dtype
    self.preferred_element_type = preferred_element_type
    for field in dataclasses.fields(opts):
      setattr(self, field.name, getattr(opts, field.name))

  def __call__(self, inputs: jax.Array, out_sharding: Any = None) -> jax.Array:
    """`inputs @ (kernel * mask) + bias` over the last axis of `inputs`; with
    a compressed kernel (`compress_params`), `inputs @ kernel + bias`."""
    if out_sharding is not None:
      raise NotImplementedError(
          "SparseLinear: `out_sharding` is not supported (jsparse24.sparse_dot"
          " takes no output sharding); constrain the output yourself.")
    kernel = self.kernel.get_value()
    bias = self.bias[...] if self.bias is not None else None
    if isinstance(kernel, Sparse24):
      if self.mask is not None or self.active is not None:
        # compress_params leaves neither: here the state of a compressed model
        # went into one that was not compressed, whose mask (another model's,
        # or stale) would be ignored, and so would `active`.
        raise ValueError(
            "SparseLinear: the kernel is a Sparse24 (compressed), but the layer still"
            " holds a mask and an active flag, which a compressed layer does not read:"
            " the state of a compressed model was put into a model that was not"
            " compressed (nnx.update(model, state)). Compress the target first,"
            " jsparse24.nnx.compress_params(model), then update it with the state.")
      return self._compressed(inputs, kernel, bias)
    if self.mask is None and self.mask_source == "collection":
      # Without this check the product would prune the kernel by magnitude at
      # every call (mask=None), not use the mask the layer was trained with.
      raise ValueError(
          "SparseLinear: this layer takes its 2:4 mask from `layer.mask`"
          " (mask_source='collection'), but its mask is None and its kernel is"
          " dense. A layer compressed by jsparse24.nnx.compress_params has no"
          " mask (it is in the Sparse24's metadata): give it back its Sparse24"
          " kernel, or a mask, layer.mask = SparsityMask(jsparse24.Mask24."
          "from_weights(layer.kernel[...], transposable=layer.transposable)) and"
          " layer.active = SparsityMask(jnp.array(True)).")
    # nnx.Linear's promotion decides the compute dtype; the kernel itself
    # goes in uncast (sparse_dense_forward casts it inside the product).
    inputs, _, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
    return sparse_dense_forward(
        inputs, kernel, bias,
        self.mask.get_value() if self.mask is not None else None,
        self.active.get_value() if self.active is not None else None,
        SparsityOptions.of(self), precision=self.precision,
        preferred_element_type=self.preferred_element_type,
        key=self.mvue_rngs() if self.mvue_rngs is not None else None, fn="SparseLinear")

  def _compressed(self, inputs: jax.Array, sp: Sparse24, bias: jax.Array | None) -> jax.Array:
    """The product with a kernel compressed by `compress_params`."""
    # The compute dtype is the one the dense kernel gives (nnx.Linear's
    # promotion); the kept values are cast to it here, as Linen's SparseDense
    # does, since sparse_dot computes in the dtype of `x` and `w` together.
    inputs, values, bias = self.promote_dtype((inputs, sp.values, bias), dtype=self.dtype)
    sp = sp.astype(values.dtype)
    # A Sparse24's gradient is that of its kept values: the MVUE estimate of
    # a dense `dw` has nothing to apply to, and no key is drawn.
    opts = dataclasses.replace(SparsityOptions.of(self), weight_grad="dense")
    return sparse_dense_forward(inputs, sp, bias, None, None, opts, precision=self.precision,
                                preferred_element_type=self.preferred_element_type,
                                fn="SparseLinear")


def rebuild_masks(model: nnx.Module) -> None:
  """Rebuilds, in place, the mask of every `SparseLinear` in `model` from its
  current kernel by magnitude (each keeps its `transposable` setting).

  Use it after loading dense weights (`nnx.update(model, params)`) or on a
  schedule during training; it also works inside `nnx.jit`. Layers with
  `mask_source` `"dynamic"` or `"none"` have no stored mask and are skipped;
  a model with no stored mask at all raises a `ValueError`.
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(
        f"nnx.rebuild_masks: `model` must be an nnx.Module, got {type(model).__name__}.")
  stored = []
  # Every layer is checked before any mask changes: an error leaves the model whole.
  for path, layer in nnx.iter_modules(model):
    if isinstance(layer, SparseLinear) and isinstance(layer.kernel.get_value(), Sparse24):
      raise TypeError(
          f"nnx.rebuild_masks: the kernel of layer {_name(path)!r} is a Sparse24"
          f" (compressed by nnx.compress_params); masks are rebuilt from dense"
          f" kernels: rebuild them before compressing.")
    if isinstance(layer, SparseLinear) and layer.mask is not None:
      stored.append(layer)
  if not stored:
    raise _nothing_stored("nnx.rebuild_masks", "rebuild")
  for layer in stored:
    layer.mask.set_value(Mask24.from_weights(
        layer.kernel[...], transposable=layer.mask.get_value().transposable))


def masks_like_kernels(model: nnx.Module) -> None:
  """Lays out, in place, the stored mask of every `SparseLinear` in `model`
  like its kernel (`jsparse24.masks_like_kernels`: a kernel sharded
  `P(k, n)` gives its packed mask `[N, K/8]` `P(n, k)`), so that the mask
  kernels' per-device blocks stay where they are made. Call it outside
  `jit`, after the kernels are laid out; a kernel that is not sharded over
  a mesh leaves its mask as it is. A model with no stored mask raises a
  `ValueError`."""
  if not isinstance(model, nnx.Module):
    raise TypeError(
        f"nnx.masks_like_kernels: `model` must be an nnx.Module, got {type(model).__name__}.")
  stored = 0
  for path, layer in nnx.iter_modules(model):
    if isinstance(layer, SparseLinear) and layer.mask is not None:
      stored += 1
      layer.mask.set_value(mask_like_kernel(layer.mask.get_value(), layer.kernel.get_value(),
                                            _name(path), "nnx.masks_like_kernels"))
  if not stored:
    raise _nothing_stored("nnx.masks_like_kernels", "lay out")


def _nothing_stored(fn: str, verb: str) -> ValueError:
  """The error of `fn` (which would `verb` each stored mask) on a model with
  none: as the Linen helpers refuse an empty 'sparsity' collection, a model
  of nnx.Linear layers is not passed over in silence."""
  return ValueError(
      f"{fn}: `model` has no SparseLinear with a stored mask (mask_source="
      f"'collection'), so there is nothing to {verb}; layers with"
      f" mask_source='dynamic' prune their kernel at every call, those with 'none'"
      f" keep it dense.")


def compress_params(model: nnx.Module, *, transposed: bool | None = None,
                    cusparselt: bool = False) -> None:
  """Replaces, in place, the kernel of every active `SparseLinear` in `model`
  by its `Sparse24` (values + metadata), compressed with the layer's own mask;
  the NNX form of `jsparse24.compress_params`. The model then computes with
  the compressed weights: its outputs are those of `kernel * mask`.

  Each compressed layer keeps `nnx.Param` as the kernel's type (holding the
  `Sparse24` pytree; the kernel's metadata is not carried over, since the
  compressed arrays are laid out `[N, K/2]`), and its `mask` and `active`
  become None: the mask is the `Sparse24`'s metadata
  (`layer.kernel.get_value().mask()`), and serving does not read a second
  copy. Left dense: layers in a dense phase (`active` False), and layers with
  `mask_source` `"dynamic"` or `"none"` (no stored mask). A stack of layers (`nnx.vmap`)
  becomes one stacked `Sparse24`, so all its layers must be active or none.

  Call it outside `nnx.jit`: it decides per layer, from the concrete
  `active` flags, whether to compress (a traced flag raises a `TypeError`),
  and it changes the model's structure. A restored checkpoint of a
  compressed model needs a compressed model as its target: build and
  compress one, then restore `nnx.state(model)` into it.

  A compressed model is for inference. `nnx.grad` over its `Param`s raises
  JAX's `TypeError` on the integer metadata; `nnx.grad(..., allow_int=True)`
  differentiates in the kept values (as `jax.grad` does through
  `jsparse24.compress_params` output), and gradients in the inputs or in
  other Variables (`nnx.DiffState`) need nothing special. Masks are no longer
  rebuilt (`rebuild_masks` raises): fine-tune before compressing.

  Args:
    model: an `nnx.Module` holding `SparseLinear` layers.
    transposed: None (default): store the transposed copy where the mask is
      transposable, as `jsparse24.compress_params` does; False: the forward
      operand alone, which is all that inference reads (a transposable mask's
      copy doubles the kept values' bytes); True: always, and raise for a
      plain mask.
    cusparselt: store each kernel in cuSPARSELt's layout (`jsparse24.compress`'s
      `cusparselt`): cuSPARSELt then multiplies it in place, for a prefill's
      and a large batch's rows; bfloat16 or float16 kernels with K and N
      multiples of 64, raising otherwise (naming the layer).

  Example:
    >>> import jax.numpy as jnp, jsparse24
    >>> from flax import nnx
    >>> from jsparse24 import nnx as jnnx
    >>> layer = jnnx.SparseLinear(16, 8, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    >>> y = layer(jnp.ones((1, 16), jnp.bfloat16))
    >>> jnnx.compress_params(layer, transposed=False)
    >>> isinstance(layer.kernel.get_value(), jsparse24.Sparse24), layer.mask
    (True, None)
    >>> bool((layer(jnp.ones((1, 16), jnp.bfloat16)) == y).all())
    True
  """
  fn = "nnx.compress_params"
  if not isinstance(model, nnx.Module):
    raise TypeError(f"{fn}: `model` must be an nnx.Module, got {type(model).__name__}.")
  if transposed not in (None, False, True):
    raise TypeError(f"{fn}: `transposed` must be None, False or True, got {transposed!r}.")
  stored, chosen = 0, []
  # Every layer is checked before any is changed: an error leaves the model whole.
  for path, layer in nnx.iter_modules(model):
    if not isinstance(layer, SparseLinear):
      continue
    if isinstance(layer.kernel.get_value(), Sparse24):
      raise TypeError(
          f"{fn}: the kernel of layer {_name(path)!r} is already a Sparse24 (was the"
          f" model compressed twice?); pass a model with dense kernels.")
    if layer.mask is None:
      continue
    stored += 1
    # Outside nnx.jit also because compressing changes the model's structure.
    compressed = compresses(fn, _name(path), layer.active.get_value(), "nnx.jit")
    mask = layer.mask.get_value()
    if transposed and not mask.transposable:
      raise ValueError(
          f"{fn}: transposed=True, but the mask of layer {_name(path)!r} is not"
          f" transposable (2:4 along K only), so its transpose is not 2:4; pass"
          f" transposed=None (a transposed copy where the mask allows) or False.")
    reason = cusparselt and cusparselt_layout_unfit(layer.kernel.get_value().shape,
                                                    layer.kernel.get_value().dtype)
    if reason and compressed:
      raise ValueError(f"{fn}: layer {_name(path)!r}: cusparselt=True {reason}")
    if compressed:
      chosen.append((layer, mask))
  if not stored:
    raise _nothing_stored(fn, "compress")
  for layer, mask in chosen:
    keep_transpose = mask.transposable if transposed is None else transposed
    layer.kernel = nnx.Param(compress(layer.kernel.get_value(), mask,
                                      transposed=keep_transpose, cusparselt=cusparselt))
    layer.mask = nnx.data(None)
    layer.active = nnx.data(None)


def _name(path) -> str:
  """A layer's path in errors: `blocks/0/up`."""
  return "/".join(str(p) for p in path) or "(the model itself)"


def masks_state(model: nnx.Module) -> nnx.State:
  """The `SparsityMask` variables of `model` (masks and `active` flags), for
  checkpointing or `nnx.update`."""
  return nnx.state(model, SparsityMask)


class _Expert(nnx.Module):
  """One expert of `SparseMoE`, `down(activation(up(x)))`; stacked over the
  experts with `nnx.vmap`. `up` and `down` are `SparseLinear`, or
  `nnx.Linear` when not `sparse` (`kw` then holds no sparsity options)."""

  def __init__(self, features: int, hidden: int, activation, *, sparse: bool,
               rngs: nnx.Rngs, **kw):
    linear = SparseLinear if sparse else nnx.Linear
    self.up = linear(features, hidden, rngs=rngs, **kw)
    self.down = linear(hidden, features, rngs=rngs, **kw)
    self.activation = activation

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(self.activation(self.up(x)))


class SparseMoE(nnx.Module):
  """The NNX form of `jsparse24.SparseMoE`: a mixture-of-experts feed-forward
  layer whose `[E, K, N]` expert kernels are 2:4 per expert.

  `self.router` is an `nnx.Linear` (float32); `self.experts` one `_Expert`
  (`up`, `down`: `SparseLinear`) stacked over the experts with `nnx.vmap`,
  so that `experts.up.kernel` is `[E, in_features, hidden]` and
  `experts.up.mask` a stacked `Mask24` with one mask per expert.
  `rebuild_masks` rebuilds each expert's masks from its own kernels and
  `compress_params` gives one stacked `Sparse24` per kernel, as for any
  `nnx.vmap` stack. The forward pass is `jsparse24.moe.moe_forward`, the
  Linen layer's: the same routing, capacity and dispatch.
  `sparse=False` makes the experts `nnx.Linear` (no masks): the dense
  baseline, with the same `Param`s and the same initial values for the same
  `rngs` (`SparseLinear` draws `nnx.Linear`'s keys in its order); the
  sparsity options are then unused.

  Each call stores two `nnx.Intermediate` scalars on the layer (declared at
  construction, so that the module's structure stays fixed under
  `nnx.jit`, `nnx.scan` and `nnx.vmap`): `load_balancing_loss`, which the
  training loss should add (Switch uses 0.01 times it) or the router may send
  every token to a few experts, and `dropped`, the share of the top-k
  choices dropped for capacity. Read them after the call inside the loss
  function, `moe.load_balancing_loss[...]` or, for every layer of a model,
  `nnx.state(model, nnx.Intermediate)`: the value is the traced one of the
  call, so its gradient reaches the router. (`Module.sow` outside
  `nnx.capture` is deprecated from flax 0.12.8, and flax 0.12.1, which
  jsparse24 supports, has no `nnx.capture`.)

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from jsparse24 import nnx as jnnx
    >>> moe = jnnx.SparseMoE(16, num_experts=4, hidden=32, rngs=nnx.Rngs(0))
    >>> moe.experts.up.kernel.shape
    (4, 16, 32)
    >>> moe(jnp.ones((2, 6, 16))).shape
    (2, 6, 16)
  """

  def __init__(
      self,
      in_features: int,
      *,
      num_experts: int,
      hidden: int,
      top_k: int = 2,
      capacity_factor: float = 1.25,
      activation: Any = jax.nn.gelu,
      use_bias: bool = False,
      dtype: Any = None,
      param_dtype: Any = jnp.float32,
      precision: Any = None,
      kernel_init: Any = default_kernel_init,
      bias_init: Any = default_bias_init,
      router_init: Any = default_kernel_init,
      rngs: nnx.Rngs,
      gradient: Literal["ste", "masked"] = "ste",
      transposable: bool | None = None,
      implementation: str | None = None,
      mask_source: Literal["collection", "dynamic"] = "collection",
      weight_grad: Literal["dense", "mvue"] = "dense",
      sparse: bool = True,
  ):
    # Imported here: jsparse24.moe imports jsparse24.linen, which this module imports too.
    from jsparse24.moe import check_experts, check_routing  # pylint: disable=g-import-not-at-top
    check_routing("nnx.SparseMoE", num_experts, top_k, capacity_factor)
    check_experts("nnx.SparseMoE", hidden, activation, sparse)
    self.router = nnx.Linear(in_features, num_experts, use_bias=False, dtype=jnp.float32,
                             param_dtype=param_dtype, precision=precision,
                             kernel_init=router_init, rngs=rngs)
    kw = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, precision=precision,
              kernel_init=kernel_init, bias_init=bias_init)
    if sparse:
      kw.update(gradient=gradient, transposable=transposable, implementation=implementation,
                mask_source=mask_source, weight_grad=weight_grad)

    @nnx.split_rngs(splits=num_experts)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return _Expert(in_features, hidden, activation, sparse=sparse, rngs=rngs, **kw)

    self.experts = make(rngs)
    self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
    self.dtype, self.param_dtype = dtype, param_dtype
    self.load_balancing_loss = nnx.Intermediate(jnp.zeros((), jnp.float32))
    self.dropped = nnx.Intermediate(jnp.zeros((), jnp.float32))

  def __call__(self, inputs: jax.Array) -> jax.Array:
    from jsparse24.moe import check_groups, moe_forward  # pylint: disable=g-import-not-at-top
    check_groups("nnx.SparseMoE", inputs, self.router.in_features)

    @nnx.vmap(in_axes=(0, 0), out_axes=0)
    def run(expert, x):
      return expert(x)

    dtype = self.dtype or jnp.result_type(inputs.dtype, self.param_dtype)
    y, aux, dropped = moe_forward(inputs, self.router, lambda x: run(self.experts, x),
                                  self.num_experts, self.top_k, self.capacity_factor, dtype)
    self._record("load_balancing_loss", aux)
    self._record("dropped", dropped)
    return y

  def _record(self, name: str, value: jax.Array) -> None:
    """Stores `value` in the `nnx.Intermediate` `name`, recreating it if it
    was taken off the layer (`nnx.pop(model, nnx.Intermediate)`)."""
    variable = getattr(self, name, None)
    if isinstance(variable, nnx.Variable):
      variable.set_value(value)
    else:
      setattr(self, name, nnx.Intermediate(value))


__all__ = ["SparseLinear", "SparseMoE", "SparsityMask", "compress_params", "masks_like_kernels", "masks_state",
           "rebuild_masks"]
