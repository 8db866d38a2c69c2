"""Flax Linen: `SparseDense`, the `sparsify` patcher, and mask-tree helpers.

Masks live in their own `"sparsity"` collection, beside `"params"`, one entry
per sparse layer: `{"mask": Mask24, "active": bool[]}`. `"active"` is False in
dense phases of a schedule (warm-up, final dense fine-tuning), and None where
the layer has none (`mask_update` with an always-sparse schedule: no run-time
switch between the sparse and dense products). `STATIC_DENSE` (a pytree with
no leaves, which `jit`, `nn.scan` and `nn.vmap` pass through as static data)
makes a layer dense with no run-time switch either: `jsparse24.optim.masks`
gives it for a phase the host knows (`sparse=False`, or a layer left out of
a static set of 2:4 layers). The `params`
tree is exactly `nn.Dense`'s, so dense checkpoints load unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import initializers
from flax.linen.dtypes import promote_dtype as _promote_dtype

from jsparse24._checks import is_kernel, layer_name, path_keys
from jsparse24._format import Mask24, Sparse24, check_mask24, check_sparse24
from jsparse24._layer import compresses, sparse_dense_forward
from jsparse24._ops import compress, cusparselt_layout_unfit
from jsparse24._options import SparsityOptions, check_widths, resolve_transposable
from jsparse24._phase import STATIC_DENSE

COLLECTION = "sparsity"
# The rng stream of `weight_grad="mvue"` (`model.apply(..., rngs={"mvue": key})`).
MVUE_RNG = "mvue"


def _dense_layer(module: nn.Module, inputs: jax.Array, opts: SparsityOptions,
                 outer: Sequence[_Outer] = ()) -> jax.Array:
  """The forward of `nn.Dense` with a 2:4 sparse kernel, for any module that
  has `nn.Dense`'s fields (`SparseDense`, or an `nn.Dense` being patched).
  `outer`: the enclosing module calls, outermost first, where `sparsify`
  intercepts them (`_Outer`)."""
  if module.dot_general is not None or module.dot_general_cls is not None:
    raise ValueError(
        f"{_layer_name(module)}: a custom `dot_general` cannot be combined with 2:4"
        f" sparsity (the product is jsparse24.sparse_dot).")
  stored = module.get_variable("params", "kernel") if module.has_variable("params", "kernel") else None
  if isinstance(stored, Sparse24):
    return _compressed_layer(module, inputs, stored, opts)

  _check_widths(module, jnp.shape(inputs)[-1], opts)
  kernel = module.param("kernel", module.kernel_init,
                        (jnp.shape(inputs)[-1], module.features), module.param_dtype)
  bias = (module.param("bias", module.bias_init, (module.features,), module.param_dtype)
          if module.use_bias else None)
  opts = dataclasses.replace(opts, transposable=resolve_transposable(
      opts.transposable, module.features, opts.mask_source))
  mask, active = _layer_mask(module, kernel, opts, outer)
  # nn.Dense's promotion decides the compute dtype; the kernel itself goes
  # in uncast (sparse_dense_forward casts it inside the product).
  inputs, _, bias = module.promote_dtype(inputs, kernel, bias, dtype=module.dtype)

  # Without the stream (inference) the product runs; taking its gradient
  # then raises, naming the stream (backends._products.weight_grad).
  key = (module.make_rng(MVUE_RNG)
         if opts.weight_grad == "mvue" and module.has_rng(MVUE_RNG) else None)
  return sparse_dense_forward(inputs, kernel, bias, mask, active, opts,
                              precision=module.precision, key=key,
                              fn=_layer_name(module))


def _layer_name(module: nn.Module) -> str:
  """How errors name a layer: `SparseDense 'mlp/up'`, or `nn.Dense 'mlp/up'
  (patched by jsparse24.sparsify)`."""
  path = f" {'/'.join(module.path)!r}" if module.path else ""
  if _patched(module):
    return f"nn.Dense{path} (patched by jsparse24.sparsify)"
  return f"SparseDense{path}"


def _patched(module: nn.Module) -> bool:
  """Whether `module` is an `nn.Dense` that `sparsify` computes as sparse."""
  return type(module) is nn.Dense  # pylint: disable=unidiomatic-typecheck


def _check_widths(module: nn.Module, width: int, opts: SparsityOptions) -> None:
  """`check_widths` for an `nn.Dense`-like module with `width` inputs."""
  leave_dense = (f"or leave this layer dense: give jsparse24.sparsify rules that do not"
                 f" match {'/'.join(module.path)!r}" if _patched(module)
                 else "or make this layer an nn.Dense")
  check_widths(_layer_name(module), opts, inputs=f"the input width {width}", in_width=width,
               outputs=f"the output width (features={module.features})",
               out_width=module.features, leave_dense=leave_dense)


def _found_in_collection(module: nn.Module) -> str:
  """What `apply` was given for this layer in the `"sparsity"` collection,
  said for an error: nothing, something else at its path, or the whole
  variables. Inside a lifted transform (`nn.scan`, `nn.vmap`) the variables
  in reach start at the transformed module (`lifted`)."""
  root = module.scope.root
  lifted = tuple(root.path)
  path = tuple(module.scope.path)[len(lifted):]
  node = root.variables().get(COLLECTION)
  if node is None:
    if lifted:
      return (f"the {COLLECTION!r} collection passed to `apply` has nothing under"
              f" {'/'.join(lifted)!r}")
    return f"no {COLLECTION!r} collection was passed to `apply`"
  if not lifted and isinstance(node, Mapping) and {"params", COLLECTION} <= set(node):
    return (f"the {COLLECTION!r} collection passed to `apply` is the whole variables (it"
            f" holds 'params' and {COLLECTION!r}): pass variables[{COLLECTION!r}] there")
  for depth, key in enumerate(path):
    if not isinstance(node, Mapping) or key not in node:
      where = repr("/".join(lifted + path[:depth])) if lifted + path[:depth] else "its top level"
      have = sorted(node) if isinstance(node, Mapping) else _kind(node)
      return (f"the {COLLECTION!r} collection passed to `apply` has no entry for it"
              f" (at {where}: {have})")
    node = node[key]
  return (f"the {COLLECTION!r} collection passed to `apply` holds {_kind(node)} at its"
          f" path, where a dict {{'mask': jsparse24.Mask24, 'active': ...}} belongs")


def _kind(x: Any) -> str:
  """`a numpy.ndarray bool[16, 8]`, `a dict with keys [...]`, or the type's name."""
  if x is None:
    return "None"
  if isinstance(x, Mapping):
    return f"a {type(x).__name__} with keys {sorted(x)}"
  if isinstance(x, (np.ndarray, jax.Array)):
    kind = "numpy.ndarray" if isinstance(x, np.ndarray) else "jax.Array"
    return f"a {kind} {x.dtype}{list(x.shape)}"
  return f"a {type(x).__name__}"


# Orbax restores a pytree without a template as nested dicts: a Mask24
# comes back as {"packed": array}, without its shape and transposable flag.
_RESTORE_WITH_A_TEMPLATE = (
    "a dict {'packed': ...} is a Mask24 restored from a checkpoint without a template,"
    " which loses its shape and transposable flag: restore against the variables'"
    " abstract tree, e.g. checkpointer.restore(path, jax.tree.map("
    "ocp.utils.to_shape_dtype_struct, jax.eval_shape(model.init, key, x)))")


def _mask_fix(mask: Any) -> str:
  """How to turn `mask`, found where a Mask24 belongs, into one: restore it
  against a template where it holds a Mask24 restored without one (a
  mapping whose only key is "packed"), else pack a bool mask."""
  packed = lambda node: isinstance(node, Mapping) and set(node) == {"packed"}  # noqa: E731
  if any(packed(node) for node in jax.tree.leaves(mask, is_leaf=packed)):
    return _RESTORE_WITH_A_TEMPLATE
  return "a bool 2:4 mask [in, out] converts with jsparse24.Mask24.pack(mask, transposable=...)"


def _layer_mask(module: nn.Module, kernel: jax.Array, opts: SparsityOptions,
                outer: Sequence[_Outer] = ()):
  """(mask, active) for this layer: (None, None) when pruning dynamically
  or with a dense kernel (`mask_source="none"`)."""
  if opts.mask_source in ("dynamic", "none"):
    return None, None
  if module.is_initializing() and not module.scope.is_mutable_collection(COLLECTION):
    return _init_outside(module, kernel, opts, outer)
  # The layer's own entry, read as a Mapping before `has_variable` would
  # test `"mask" in` whatever it is (an array raises there).
  own = None if module.is_initializing() else module.scope.variables().get(COLLECTION)
  if not module.is_initializing() and not (isinstance(own, Mapping) and "mask" in own):
    lifted = _read_outside(module, kernel, outer)
    if lifted is not None:
      return _checked_mask(module, kernel, opts, *lifted)
    raise ValueError(
        f"{_layer_name(module)} takes its 2:4 mask from the"
        f" {COLLECTION!r} collection, but {_found_in_collection(module)}. Pass"
        f" the variables from `init` (e.g. `model.apply(variables, x)`; for a model"
        f" patched by jsparse24.sparsify, from the patched model's `init`: the dense"
        f" model's own `init` makes no masks), or"
        f" `{{'params': params, {COLLECTION!r}: jsparse24.optim.masks(opt_state)}}`"
        f" when training with jsparse24.optim, or set mask_source='dynamic'. (Params"
        f" from compress_params keep a dense kernel for a layer that was in a dense"
        f" phase, active=False; such a layer still needs its collection.)")
  mask = module.variable(
      COLLECTION, "mask",
      lambda: Mask24.from_weights(kernel, transposable=opts.transposable)).value
  active = module.variable(COLLECTION, "active", lambda: jnp.array(True)).value
  return _checked_mask(module, kernel, opts, mask, active)


def _checked_mask(module: nn.Module, kernel: jax.Array, opts: SparsityOptions, mask: Any,
                  active: Any):
  """`(mask, active)`, once `mask` is known to be a `Mask24` that fits the
  layer's kernel and options."""
  if not isinstance(mask, Mask24):
    how = _mask_fix(mask)
    raise TypeError(
        f"{_layer_name(module)}: the 'mask' in the {COLLECTION!r} collection"
        f" passed to `apply` is {_kind(mask)}; expected a jsparse24.Mask24, as `init`"
        f" and jsparse24.optim.masks(opt_state) give it ({how}).")
  check_mask24(_layer_name(module), f"{COLLECTION}/mask", mask)
  if mask.transposable != opts.transposable or tuple(mask.shape) != tuple(kernel.shape):
    raise ValueError(
        f"{_layer_name(module)}: the mask in the {COLLECTION!r}"
        f" collection (shape {mask.shape}, transposable={mask.transposable})"
        f" does not fit this layer (kernel {kernel.shape},"
        f" transposable={opts.transposable}): take the collection from this model's"
        f" init, or rebuild it for these params (jsparse24.rebuild_masks), or set the"
        f" layer's transposable to the mask's.")
  return mask, active


# --- layers under a lifted transform that does not carry the masks ------------
#
# Flax MoE code stacks its experts with `nn.vmap(..., variable_axes={"params":
# 0})` (flaxformer's MoE layer does): inside, only "params" is mapped, and the
# "sparsity" collection is neither readable nor writable. `sparsify` does not
# edit that `nn.vmap`; instead the masks of such a layer live, stacked like its
# kernel, in the nearest enclosing module that sees the collection (the paths
# are the same as if the vmap carried them, `experts/wi/mask [E, ...]`), and
# each expert's slice is handed into the vmap by `_per_element`.


@dataclasses.dataclass
class _Outer:
  """A module call that `sparsify` intercepted, enclosing the layers it runs;
  `pending` holds the layers below it, by path relative to it, whose masks
  it must create once the call returns (init under a lifted transform)."""

  module: nn.Module
  pending: dict[tuple[str, ...], bool] = dataclasses.field(default_factory=dict)

  def relative(self, module: nn.Module) -> tuple[str, ...] | None:
    """`module`'s path below this one, or None if it is not below it."""
    own, path = tuple(self.module.path), tuple(module.path)
    return path[len(own):] if path[:len(own)] == own and len(path) > len(own) else None

  def create_pending(self) -> None:
    """Creates the stacked `{"mask", "active"}` entry of every pending layer
    from its stacked kernel, as this module's variables: the entry that an
    `nn.vmap` carrying the collection would have made (`nn.vmap` splits the
    params rng, so each expert's mask is its own kernel's)."""
    for rel, transposable in self.pending.items():
      kernel = self.module.scope.variables()["params"]
      for key in rel:
        kernel = kernel[key]
      kernel = kernel["kernel"]
      scope = self.module.scope
      for key in rel:
        scope = scope.push(key, reuse=True)
      if not scope.has_variable(COLLECTION, "mask"):
        scope.put_variable(COLLECTION, "mask",
                           Mask24.from_weights(kernel, transposable=transposable))
        scope.put_variable(COLLECTION, "active", jnp.ones(kernel.shape[:-2], bool))
    self.pending.clear()


def _init_outside(module: nn.Module, kernel: jax.Array, opts: SparsityOptions,
                  outer: Sequence[_Outer]):
  """At init, for a layer whose own scope cannot hold the collection (under
  an `nn.vmap` without it in `variable_axes`): the nearest enclosing call
  that can creates the stacked masks when it returns (`_Outer.create_pending`);
  this call computes with the mask of the initial kernel, the very mask
  created there."""
  for call in reversed(outer):
    rel = call.relative(module)
    if rel is not None and call.module.scope.is_mutable_collection(COLLECTION):
      call.pending[rel] = opts.transposable
      return Mask24.from_weights(kernel, transposable=opts.transposable), None
  raise ValueError(
      f"{_layer_name(module)}: its masks cannot be created: the {COLLECTION!r}"
      f" collection is not mutable in `init` here, nor in any enclosing module. Call"
      f" `init` without restricting `mutable`, or list {COLLECTION!r} in the"
      f" variable_axes of the lifted transform (nn.vmap, nn.scan) around it.")


def _read_outside(module: nn.Module, kernel: jax.Array, outer: Sequence[_Outer]):
  """`(mask, active)` of a layer under an `nn.vmap` that does not carry the
  collection, this element's slice of the stacked entry of the nearest
  enclosing call that holds one at the layer's path; None if none does."""
  for call in reversed(outer):
    rel = call.relative(module)
    node = call.module.scope.variables().get(COLLECTION) if rel is not None else None
    for key in rel or ():
      node = node.get(key) if isinstance(node, Mapping) else None
    if not (isinstance(node, Mapping) and isinstance(node.get("mask"), Mask24)):
      continue
    mask, active = node["mask"], node.get("active")
    stack = tuple(mask.shape[:-2])
    if len(stack) != 1 or tuple(mask.shape[-2:]) != tuple(jnp.shape(kernel)):
      raise ValueError(
          f"{_layer_name(module)}: the {COLLECTION!r} collection holds its mask at"
          f" {'/'.join(module.path)!r} with shape {tuple(mask.shape)}, outside the lifted"
          f" transform it runs under, which does not carry the collection; sparsify"
          f" slices such a mask for one nn.vmap over a kernel {tuple(jnp.shape(kernel))}"
          f" (a mask [E, *kernel]). Add {COLLECTION!r}: 0 to the variable_axes of the"
          f" nn.vmap and nn.scan around the layer.")
    return _per_element(module, kernel, (mask, active), stack[0])
  return None


def _per_element(module: nn.Module, kernel: jax.Array, stacked: Any, size: int):
  """Each element's slice of `stacked` (leading axis `size`) inside the
  `jax.vmap` that maps `kernel`: a `custom_vmap` whose rule declares the
  whole stack batched along axis 0, so no gather runs. Raises unless that
  rule ran, i.e. unless `kernel` is mapped by a vmap of `size` elements
  (the function itself, traced first, returns element 0's slice)."""
  ran = []

  @jax.custom_batching.custom_vmap
  def own(anchor, stacked):
    del anchor
    return jax.tree.map(lambda a: a[0], stacked)

  @own.def_vmap
  def _rule(axis_size, in_batched, anchor, stacked):
    del anchor
    if axis_size != size or any(jax.tree.leaves(in_batched[1])):
      raise ValueError(
          f"{_layer_name(module)}: its mask in the {COLLECTION!r} collection is a stack"
          f" of {size}, but the vmap around the layer maps {axis_size} elements"
          f"{' and the masks too' if any(jax.tree.leaves(in_batched[1])) else ''}; the"
          f" stack belongs to an nn.vmap of {size} over the layer's kernel.")
    ran.append(axis_size)
    return stacked, jax.tree.map(lambda _: True, stacked)

  out = own(jax.lax.stop_gradient(kernel), stacked)
  if not ran:
    raise ValueError(
        f"{_layer_name(module)}: its mask in the {COLLECTION!r} collection is a stack of"
        f" {size} kept outside the lifted transform the layer runs under, but its kernel"
        f" is not mapped by a vmap there; list {COLLECTION!r} in that transform's"
        f" variable_axes.")
  return out


def _compressed_layer(module, inputs, sp: Sparse24, opts: SparsityOptions):
  """Inference on compressed weights made by `compress_params`: the shared
  forward, with the kept values promoted as nn.Dense promotes its kernel
  (they compute in that dtype) and no MVUE key (a Sparse24's gradient is
  that of its kept values), as `nnx.SparseLinear`'s compressed product."""
  name = _layer_name(module)
  check_sparse24(name, "kernel", sp)  # before its shape is read
  if sp.shape[-1] != module.features:
    raise ValueError(
        f"{name}: its compressed kernel (a Sparse24) has {sp.shape[-1]} outputs (dense"
        f" shape {sp.shape}), but the layer has features={module.features}: the params"
        f" were compressed from another model.")
  bias = None
  if module.use_bias:
    if not module.has_variable("params", "bias"):
      raise ValueError(
          f"{name}: use_bias=True, but the params hold a compressed kernel and no 'bias'"
          f" (compress_params keeps the bias beside the Sparse24: pass the whole params).")
    bias = module.get_variable("params", "bias")
    if jnp.shape(bias) != (module.features,):
      raise ValueError(
          f"{name}: its 'bias' has shape {jnp.shape(bias)}, want ({module.features},)"
          f" (features) beside its compressed kernel.")
  inputs, values, bias = module.promote_dtype(inputs, sp.values, bias, dtype=module.dtype)
  return sparse_dense_forward(inputs, sp.astype(values.dtype), bias, None, None,
                              dataclasses.replace(opts, weight_grad="dense"),
                              precision=module.precision, fn=name)


class SparseDense(nn.Module):
  """A drop-in `flax.linen.Dense` whose kernel is 2:4 sparse along its input axis.

  Same fields, defaults and parameter names (`kernel [in, out]`, `bias`) as
  `nn.Dense`; the output equals `nn.Dense` applied to `kernel * mask`. The
  extra fields are those of `SparsityOptions`. The mask lives in the
  `"sparsity"` collection (see this module's docstring).

  Example:
    >>> import jax, jax.numpy as jnp, jsparse24
    >>> layer = jsparse24.SparseDense(features=8)
    >>> variables = layer.init(jax.random.key(0), jnp.ones((2, 16)))
    >>> sorted(variables)
    ['params', 'sparsity']
    >>> layer.apply(variables, jnp.ones((2, 16))).shape
    (2, 8)
  """

  features: int
  use_bias: bool = True
  dtype: Any = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  kernel_init: Any = nn.linear.default_kernel_init
  bias_init: Any = initializers.zeros_init()
  promote_dtype: Any = _promote_dtype
  dot_general: Any = None
  dot_general_cls: Any = None
  # sparsity: `SparsityOptions`'s fields, names and defaults (tests/test_options.py)
  gradient: Literal["ste", "masked"] = "ste"
  transposable: bool | None = None
  implementation: str | None = None
  mask_source: Literal["collection", "dynamic", "none"] = "collection"
  weight_grad: Literal["dense", "mvue", "2:4"] = "dense"
  kernel_sharding: Any = None
  input_sparsity: Literal["off", "masked", "ste"] = "off"
  grad_output: Literal["dense", "2:4"] = "dense"

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    return _dense_layer(self, inputs, SparsityOptions.of(self))


# --- the patcher -------------------------------------------------------------

Rules = Mapping[str, Mapping[str, Any] | SparsityOptions] | Sequence[
    tuple[str, Mapping[str, Any] | SparsityOptions]]


def _normalize_rules(rules: Rules) -> tuple[tuple[re.Pattern, SparsityOptions], ...]:
  if isinstance(rules, (str, bytes)) or not isinstance(rules, (Mapping, list, tuple)):
    # A set of regexes reads as a dict of them with default options.
    patterns = sorted(map(repr, rules)) if isinstance(rules, (set, frozenset)) else [repr(rules)]
    raise TypeError(
        f"sparsify: `rules` must be {{regex: options}} or [(regex, options), ...], got"
        f" {type(rules).__name__} {rules!r} (for every matching layer with default options:"
        f" {{{', '.join(f'{p}: {{}}' for p in patterns)}}}).")
  items = rules.items() if isinstance(rules, Mapping) else rules
  out = []
  for item in items:
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
      raise TypeError(f"sparsify: each rule must be a (regex, options) pair, got {item!r}.")
    pattern, opts = item
    if not isinstance(pattern, str):
      raise TypeError(f"sparsify: rule {pattern!r}: the pattern must be a regex string.")
    if not isinstance(opts, (SparsityOptions, Mapping)):
      raise TypeError(
          f"sparsify: rule {pattern!r}: options must be a dict of SparseDense options or a"
          f" SparsityOptions (use {{}} for the defaults), got {type(opts).__name__} {opts!r}.")
    try:
      compiled = re.compile(pattern)
    except re.error as e:
      raise ValueError(f"sparsify: rule {pattern!r} is not a valid regex: {e}.") from e
    if not isinstance(opts, SparsityOptions):
      names = [f.name for f in dataclasses.fields(SparsityOptions)]
      unknown = set(opts) - set(names)
      if unknown:
        raise ValueError(
            f"sparsify: rule {pattern!r} has unknown option(s) {sorted(unknown)};"
            f" expected some of {names}.")
      opts = SparsityOptions.checked(f"sparsify: rule {pattern!r}", **opts)
    out.append((compiled, opts))
  if not out:
    raise ValueError("sparsify: `rules` is empty.")
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class Sparsified:
  """An existing Linen model whose matching `nn.Dense` layers run 2:4 sparse.

  Made by `sparsify`. `init`, `apply` and `init_with_output` behave like the
  model's, with matching `Dense` layers computed as `SparseDense` (same
  params; masks in the `"sparsity"` collection). `intercept()` is the context
  manager doing it, for use around other entry points.
  """

  model: nn.Module
  rules: tuple[tuple[re.Pattern, SparsityOptions], ...]

  def _options_for(self, path: str) -> SparsityOptions | None:
    for pattern, opts in self.rules:
      if pattern.fullmatch(path):
        return opts
    return None

  @contextlib.contextmanager
  def intercept(self, seen: list[str] | None = None, modules: dict[str, str] | None = None):
    """Within it, `nn.Dense` layers whose path (`"Block_0/mlp/up"`) fully
    matches a rule's regex (first matching rule wins) run sparse. `seen`
    collects the paths of the `nn.Dense` layers called, `modules` the type
    of every other module called, by path.

    An `nn.Dense` under an `nn.vmap` that maps only `"params"` (experts
    stacked as flaxformer stacks them) keeps its masks stacked like its
    kernel in the nearest enclosing module that sees the `"sparsity"`
    collection, at the layer's own path, and runs with its element's slice."""

    outer: list[_Outer] = []

    def interceptor(next_fun, args, kwargs, context):
      module = context.module
      if type(module) is not nn.Dense or context.method_name != "__call__":  # pylint: disable=unidiomatic-typecheck
        if modules is not None and module.path:
          modules.setdefault("/".join(module.path), type(module).__name__)
        outer.append(_Outer(module))
        try:
          out = next_fun(*args, **kwargs)
        finally:
          call = outer.pop()
        call.create_pending()
        return out
      path = "/".join(module.path)
      if seen is not None:
        seen.append(path)
      opts = self._options_for(path)
      if opts is None:
        if (module.has_variable("params", "kernel")
            and isinstance(module.get_variable("params", "kernel"), Sparse24)):
          # Flax's own error would quote the compressed values' shape.
          raise ValueError(
              f"sparsify: nn.Dense {path!r} holds a compressed kernel (a Sparse24, from"
              f" compress_params) but no rule matches it: give `sparsify` the rules the"
              f" model was compressed with.")
        return next_fun(*args, **kwargs)
      return _dense_layer(module, *args, opts, tuple(outer), **kwargs)

    with nn.intercept_methods(interceptor):
      yield

  def _check_rules_match(self, fn: str, seen: list[str], variables: Any = None) -> None:
    """Raises for a rule that fully matches no layer: neither an `nn.Dense`
    that the call ran (`seen`) nor, in `apply`, a layer of the variables
    passed (a `"sparsity"` entry or a `"kernel"` in the params), which a
    call of one method (`apply(..., method=...)`) may not run. Such a rule
    would leave its layers dense without a word (a typo, or a model whose
    layers were renamed). Then for a rule that never applies
    (`_check_no_shadowed_rules`)."""
    known = set(seen)
    if (isinstance(variables, Mapping)
        and not all(any(p.fullmatch(s) for s in known) for p, _ in self.rules)):
      known |= (_layers_holding(variables.get("params"), "kernel")
                | _layers_holding(variables.get(COLLECTION), "mask"))
    unmatched = [p.pattern for p, _ in self.rules if not any(p.fullmatch(s) for s in known)]
    if unmatched:
      # A top-level nn.Dense (the model is one layer) has the empty path,
      # which a bare [''] would not explain.
      layers = ", ".join(repr(s) if s else "'' (the model itself)" for s in sorted(known))
      raise ValueError(
          f"sparsify: rule(s) {unmatched} matched no nn.Dense layer in `{fn}`; the"
          f" model's layers are [{layers}]. Each rule's regex must fully"
          f" match a layer's path (\"block_0/mlp/up\"; \"\" for a model that is one"
          f" nn.Dense).")
    self._check_no_shadowed_rules(fn, known)

  def _check_no_shadowed_rules(self, fn: str, layers: set[str]) -> None:
    """Raises for a rule whose layers (of `layers`) an earlier rule all
    matches first: the first match wins, so its options never apply (as
    `{".*": {}, "up": {"transposable": False}}` leaves "up" transposable)."""
    for i, (pattern, _) in enumerate(self.rules):
      matched = sorted(s for s in layers if pattern.fullmatch(s))
      if matched and all(any(p.fullmatch(s) for p, _ in self.rules[:i]) for s in matched):
        first = {s: next(p.pattern for p, _ in self.rules[:i] if p.fullmatch(s))
                 for s in matched}
        raise ValueError(
            f"sparsify: rule {pattern.pattern!r} never applies in `{fn}`: every layer it"
            f" matches is matched by an earlier rule first ({first}), and the first"
            f" matching rule wins. Put it before them, or drop it.")

  def _check_no_raw_kernels(self, fn: str, seen: list[str], modules: dict[str, str],
                            variables: Any) -> None:
    """Raises for a rule that matches no `nn.Dense` but matches a parameter
    that another module reads itself, or that module's path: a subclass of
    `nn.Dense`, `nn.DenseGeneral`, `nn.Conv`, or an `[E, K, N]` expert kernel
    that a module multiplies in an einsum (`self.param`, as maxtext writes
    MoE layers). `sparsify` intercepts the calls of `nn.Dense` itself, so
    such a product stays dense unless the model is edited; in `apply` the
    rule would otherwise pass as matching the layer's `"kernel"`."""
    params = variables.get("params") if isinstance(variables, Mapping) else None
    unmatched = [p for p, _ in self.rules if not any(p.fullmatch(path) for path in seen)]
    if not isinstance(params, Mapping) or not unmatched:
      return
    # Kernels first: a DenseGeneral's bias is 2-D too.
    leaves = sorted(jax.tree_util.tree_leaves_with_path(params),
                    key=lambda item: not is_kernel(item[0]))
    for pattern in unmatched:
      for key_path, leaf in leaves:
        keys = path_keys(key_path)
        owner = "/".join(keys[:-1])
        kind = modules.get(owner)
        if kind is None or jnp.ndim(leaf) < 2:
          continue
        if pattern.fullmatch("/".join(keys)) or pattern.fullmatch(owner):
          raise ValueError(
              f"sparsify: rule {pattern.pattern!r} matches no nn.Dense layer in `{fn}`,"
              f" but the parameter {'/'.join(keys)!r}"
              f" ({jnp.result_type(leaf)}{list(jnp.shape(leaf))}) of module {owner!r}"
              f" ({kind}), which multiplies it itself: sparsify makes nn.Dense layers"
              f" (nn.Dense itself, not a subclass, nn.DenseGeneral or nn.Conv) 2:4 by"
              f" intercepting their calls and cannot reach that product without editing"
              f" the model. For a layer, use jsparse24.SparseDense (nn.Dense's fields) in"
              f" its place. For experts read with self.param in an einsum, write them as"
              f" nn.Dense layers stacked with nn.vmap (variable_axes={{'params': 0}},"
              f" split_rngs={{'params': True}}) and give a rule for their path, or use"
              f" jsparse24.SparseMoE in the model.")

  def init(self, *args, **kwargs):
    seen: list[str] = []
    modules: dict[str, str] = {}
    with self.intercept(seen, modules):
      out = self.model.init(*args, **kwargs)
    self._check_no_raw_kernels("init", seen, modules, out)
    self._check_rules_match("init", seen)
    return out

  def init_with_output(self, *args, **kwargs):
    seen: list[str] = []
    modules: dict[str, str] = {}
    with self.intercept(seen, modules):
      out = self.model.init_with_output(*args, **kwargs)
    self._check_no_raw_kernels("init_with_output", seen, modules, out[1])
    self._check_rules_match("init_with_output", seen)
    return out

  def apply(self, variables, *args, **kwargs):
    seen: list[str] = []
    modules: dict[str, str] = {}
    with self.intercept(seen, modules):
      out = self.model.apply(variables, *args, **kwargs)
    self._check_no_raw_kernels("apply", seen, modules, variables)
    self._check_rules_match("apply", seen, variables)
    self._check_no_ignored_masks(seen, variables)
    return out

  def _check_no_ignored_masks(self, seen: list[str], variables: Any) -> None:
    """Raises where `apply` ran an `nn.Dense` dense (no rule matches it) whose
    masks the `"sparsity"` collection holds: rules that left out a layer the
    model was initialised with, whose trained mask would be ignored."""
    if not isinstance(variables, Mapping):
      return
    ignored = sorted(_layers_holding(variables.get(COLLECTION), "mask")
                     & {p for p in seen if self._options_for(p) is None})
    if ignored:
      raise ValueError(
          f"sparsify: `apply` ran the nn.Dense layer(s) {ignored} dense, as no rule"
          f" matches them, but the {COLLECTION!r} collection holds their masks (the"
          f" model was initialised with rules that matched them): give `sparsify` those"
          f" rules again, or drop those layers' masks to run them dense.")


def _layers_holding(tree: Any, name: str) -> set[str]:
  """The paths (`"block_0/mlp/up"`) of the layers of a collection `tree` that
  hold a variable `name` (`"kernel"` in the params, `"mask"` in the
  `"sparsity"` collection); none where `tree` is not a mapping."""
  if not isinstance(tree, Mapping):
    return set()
  return {layer_name(path)
          for path, _ in jax.tree_util.tree_leaves_with_path(
              tree, is_leaf=lambda x: isinstance(x, (Mask24, Sparse24)))
          if path_keys(path[-1:]) == (name,)}


def sparsify(model: nn.Module, rules: Rules) -> Sparsified:
  """Makes the `nn.Dense` layers of `model` that match `rules` 2:4 sparse.

  The model's code is not edited: calls are intercepted
  (`flax.linen.intercept_methods`) and matching layers compute as
  `SparseDense` with the same `params`.

  Args:
    model: any Linen module.
    rules: `{regex: options}` or `[(regex, options), ...]`; a regex must fully
      match the layer's module path (`"Block_0/mlp/up"`); options are a dict
      of `SparsityOptions` fields or a `SparsityOptions`. The first matching
      rule wins. `init` and `apply` raise if a rule matches no `Dense` layer
      of the model, or only layers that an earlier rule matches (it would
      never apply), and `apply` if the `"sparsity"` collection holds masks
      of layers that no rule matches (they would run dense).

  Mixture-of-experts layers whose experts are `nn.Dense` layers stacked with
  `nn.vmap(..., variable_axes={"params": 0})` (flaxformer's form) need no
  change: a rule for the experts' path (`r".*/experts/(wi|wo)"`) makes each
  expert's kernels 2:4 with masks of its own, stacked `[E, ...]` at the
  layers' paths in the `"sparsity"` collection, so that
  `jsparse24.optim.mask_update`, `rebuild_masks` and `compress_params` work
  per expert, and the products run as `jsparse24.sparse_dot` under that
  vmap. (`weight_grad="mvue"` needs the vmap to split the `"mvue"` rng too.)
  Expert kernels that the model reads with `self.param` and multiplies
  itself (maxtext's einsums) cannot be intercepted: `init` raises, naming
  the parameter and the fix (`nn.Dense` experts, or `jsparse24.SparseMoE`).

  Example:
    >>> import flax.linen as nn, jax, jax.numpy as jnp, jsparse24
    >>> class MLP(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     return nn.Dense(8, name="down")(nn.relu(nn.Dense(16, name="up")(x)))
    >>> sparse = jsparse24.sparsify(MLP(), {r"up": {"gradient": "masked"}})
    >>> variables = sparse.init(jax.random.key(0), jnp.ones((1, 8)))
    >>> list(variables["sparsity"])
    ['up']
  """
  return Sparsified(model, _normalize_rules(rules))


# --- mask trees ---------------------------------------------------------------


def _map_layers(fn, sparsity: Mapping, other: Any, caller: str, path=()):
  """Maps `fn(layer_sparsity, other_at_same_path, path)` over the sparse
  layers of a `"sparsity"` tree; `other` is a tree with the same layer paths
  (params, or a per-layer tree of statistics). `caller` names the public
  function in the error where `other` lacks a layer."""
  if isinstance(sparsity.get("mask"), Mask24):
    return fn(sparsity, other, path)
  out = {}
  for key, value in sparsity.items():
    if not isinstance(other, Mapping) or key not in other:
      raise ValueError(
          f"{caller}: the {COLLECTION!r} collection has a layer at"
          f" {'/'.join(path + (key,))!r} that `params` does not have: pass the params of"
          f" the model whose init made this collection.")
    out[key] = _map_layers(fn, value, other[key], caller, path + (key,))
  return out


def map_layers(fn, sparsity: Mapping) -> dict:
  """A `"sparsity"` tree with `fn(layer, path)` in place of each sparse
  layer's `{"mask": Mask24, "active": ...}`."""
  return _map_layers(lambda layer, _, path: fn(layer, path), sparsity, sparsity, "map_layers")


def entries_by_path(sparsity: Mapping, tree: Any, caller: str) -> dict[tuple[str, ...], Any]:
  """`{layer path: tree's entry at that path}` for every sparse layer of a
  `"sparsity"` tree; `tree` has the same layer paths (params, or a per-layer
  tree of statistics), raising where it lacks one (naming `caller`)."""
  out = {}
  _map_layers(lambda _, entry, path: out.__setitem__(path, entry), sparsity, tree, caller)
  return out


def layers_by_path(sparsity: Mapping) -> dict[tuple[str, ...], Mapping]:
  """`{layer path: {"mask": Mask24, "active": ...}}` for every sparse layer of a
  `"sparsity"` tree."""
  return entries_by_path(sparsity, sparsity, "layers_by_path")


def mask_like_kernel(mask: Mask24, kernel: Any, layer: str, fn: str) -> Mask24:
  """`mask` laid out like `kernel` (`masks_like_kernels`); `layer` and `fn`
  name the layer and the caller in the error."""
  sharding = getattr(kernel, "sharding", None)
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return mask
  spec = tuple(sharding.spec) + (None,) * (kernel.ndim - len(sharding.spec))
  lead, (k, n) = spec[:-2], spec[-2:]
  packed = mask.packed
  flat = packed.ndim == len(lead) + 1
  want = jax.sharding.PartitionSpec(*lead, *((None,) if flat else (n, k)))
  mesh = sharding.mesh
  for axis, (entry, size) in enumerate(zip(want, packed.shape)):
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    parts = int(np.prod([mesh.shape[a] for a in names])) if names else 1
    if size % parts:
      raise ValueError(
          f"{fn}: the mask of layer {layer!r} (packed {packed.shape}) cannot be split"
          f" like its kernel ({sharding.spec}): its axis {axis} of {size} does not"
          f" divide over the {parts} devices of {names}; the kernel's K must split"
          f" into multiples of 8 per device.")
  placed = jax.device_put(packed, jax.sharding.NamedSharding(mesh, want))
  return dataclasses.replace(mask, packed=placed)


def masks_like_kernels(sparsity: Mapping, params: Mapping) -> dict:
  """The `"sparsity"` collection with every mask laid out like its layer's
  kernel in `params` (laid-out arrays, e.g. after `jax.device_put`).

  A packed mask is `uint8[..., N, K/8]` for a kernel `[..., K, N]`, so a
  kernel sharded `P(..., k, n)` gives its mask `P(..., n, k)`: each device
  holds the mask of its block of the weight, where the backends' mask
  kernels make it (tensor parallelism, FSDP with the kernels left sharded);
  a replicated mask would be gathered back every step. (Masks whose K/4 is
  odd are packed flat; they keep only the stack axes' sharding.) A kernel
  that is not sharded over a mesh (`NamedSharding`) leaves its mask as it
  is. Raises where a device's block of the mask would not be whole bytes,
  naming the layer. Give the train step `out_shardings` equal to the
  state's shardings, so the rebuilt masks stay where they are."""
  fn = "masks_like_kernels"
  check_sparsity(fn, sparsity)
  check_params(fn, params, sparsity)

  def place(layer, layer_params, path):
    kernel = dense_kernel(layer_params, path, fn)
    return {**layer, "mask": mask_like_kernel(layer["mask"], kernel, "/".join(path), fn)}

  return _map_layers(place, sparsity, params, fn)


def rebuild_masks(params: Mapping, sparsity: Mapping) -> dict:
  """A new `"sparsity"` collection with every mask rebuilt from `params` by
  magnitude (each keeps its `transposable` setting and its `active` flag).

  Use it after loading dense weights into a sparse model:
  `variables = {"params": p, "sparsity": rebuild_masks(p, variables["sparsity"])}`.
  """
  return rebuild_masks_as("rebuild_masks", params, sparsity)


def rebuild_masks_as(fn: str, params: Mapping, sparsity: Mapping) -> dict:
  """`rebuild_masks`, its errors naming `fn` (the public function called)."""
  check_sparsity(fn, sparsity)
  check_params(fn, params, sparsity)

  def rebuild(layer, layer_params, path):
    kernel = dense_kernel(layer_params, path, fn)
    return {**layer, "mask": Mask24.from_weights(kernel, transposable=layer["mask"].transposable)}

  return _map_layers(rebuild, sparsity, params, fn)


def check_sparsity(fn: str, sparsity: Any) -> None:
  """Raises, naming `fn`, unless `sparsity` is a `"sparsity"` collection
  holding at least one layer's `Mask24`: an empty one (`{}`), the optimizer
  state, the whole variables or the params would otherwise be walked as a
  model without sparse layers, and the call would silently do nothing."""
  fix = (f"pass the model's {COLLECTION!r} collection: variables[{COLLECTION!r}] from"
         f" `init`, or jsparse24.optim.masks(opt_state) when training with jsparse24.optim")
  # By name: jsparse24.optim, which defines the state, imports this module.
  if any(type(leaf).__name__ == "MaskUpdateState" for leaf in jax.tree.leaves(
      sparsity, is_leaf=lambda x: type(x).__name__ == "MaskUpdateState")):
    raise TypeError(
        f"{fn}: `sparsity` is an optimizer state; pass jsparse24.optim.masks(opt_state),"
        f" the {COLLECTION!r} collection it holds.")
  if not isinstance(sparsity, Mapping):
    raise TypeError(f"{fn}: `sparsity` must be a dict, got {_kind(sparsity)}; {fix}.")
  if {"params", COLLECTION} <= set(sparsity):
    raise ValueError(
        f"{fn}: `sparsity` is the whole variables (it holds 'params' and"
        f" {COLLECTION!r}); pass variables[{COLLECTION!r}].")
  _check_layer_masks(fn, sparsity)
  if not any(isinstance(leaf, Mask24) for leaf in jax.tree.leaves(
      sparsity, is_leaf=lambda a: isinstance(a, Mask24))):
    held = "is empty" if not sparsity else f"holds no Mask24 (keys {sorted(sparsity)[:5]})"
    raise ValueError(
        f"{fn}: `sparsity` {held}, so there is no sparse layer to work on; {fix}"
        f" (the params come first, then the collection).")


def _check_layer_masks(fn: str, sparsity: Mapping, path: tuple[str, ...] = ()) -> None:
  """Raises, naming `fn` and the layer, where a layer's entry (`{"mask":
  ..., "active": ...}`) holds something else than a `Mask24` as its mask (a
  dense bool mask, or a mask restored without a template), which the walks
  over the collection would take for a submodule named "mask"."""
  mask = sparsity.get("mask")
  if ({"mask", "active"} <= set(sparsity) and not isinstance(mask, Mask24)
      and not any(isinstance(leaf, Mask24) for leaf in jax.tree.leaves(
          mask, is_leaf=lambda a: isinstance(a, Mask24)))):
    how = _mask_fix(mask)
    raise TypeError(f"{fn}: the mask of layer {'/'.join(path)!r} in `sparsity` is"
                    f" {_kind(mask)}; expected a jsparse24.Mask24 ({how}).")
  for key, value in sparsity.items():
    if isinstance(value, Mapping):
      _check_layer_masks(fn, value, path + (str(key),))


def check_params(fn: str, params: Any, sparsity: Mapping) -> None:
  """Raises, naming `fn`, where `params` is a model's whole variables
  (`{"params": ..., "sparsity": ...}`, or `{"params": ...}`) in place of its
  'params' collection: it holds a 'params' entry and lacks a layer at the top
  of `sparsity` (so a model with a submodule named 'params' still passes).
  Without it the call fails later on the first layer it misses, with no word
  of the variables."""
  if (isinstance(params, Mapping) and "params" in params
      and any(key not in params for key in sparsity)):
    raise ValueError(
        f"{fn}: `params` is the whole variables (it holds {sorted(params)}), not the"
        f" 'params' collection; pass variables['params'].")


def dense_kernel(layer_params: Any, path: tuple[str, ...], fn: str) -> jax.Array:
  """The dense `"kernel"` of a sparse layer's params (masks are built from
  it); `fn` names the caller in the errors."""
  kernel = layer_params.get("kernel") if isinstance(layer_params, Mapping) else None
  if kernel is None:
    raise ValueError(
        f"{fn}: `params` has no kernel for the sparse layer {'/'.join(path)!r}"
        f" (pass the model's params first, then its 'sparsity' collection).")
  if isinstance(kernel, Sparse24):
    raise TypeError(
        f"{fn}: the kernel of layer {'/'.join(path)!r} is a Sparse24 (already"
        f" compressed); masks are rebuilt from dense params.")
  return kernel


def map_sparse_kernels(fn, layers: Mapping[tuple, Any], tree: Any, *rest: Any):
  """`tree` with `fn(layers[path], kernel, *rest_kernels)` in place of the
  `"kernel"` leaf of every layer path in `layers` (other leaves unchanged),
  mapped with `tree_map_with_path` so that container types (`FrozenDict`)
  survive; `rest` are trees of the same structure. Returns (the new tree,
  the sorted layer paths of `layers` that `tree` has no kernel for)."""
  seen = set()

  def visit(path, leaf, *others):
    keys = path_keys(path)
    layer = layers.get(keys[:-1]) if is_kernel(path) else None
    if layer is None or leaf is None:
      return leaf
    seen.add(keys[:-1])
    return fn(layer, leaf, *others)

  out = jax.tree_util.tree_map_with_path(
      visit, tree, *rest, is_leaf=lambda x: x is None or isinstance(x, Sparse24))
  return out, sorted("/".join(map(str, p)) for p in set(layers) - seen)


def compress_params(params: Mapping, sparsity: Mapping, *, cusparselt: bool = False) -> Any:
  """`params` with every active sparse layer's kernel replaced by its
  `Sparse24` (values + metadata; with the transposed copy when the mask is
  transposable). A model applied to the result computes with the compressed
  weights; no `"sparsity"` collection is needed then. A stack of layers
  (`nn.scan`) becomes one stacked `Sparse24`. The container types of `params`
  are kept (`FrozenDict` too).

  `cusparselt=True` stores each kernel in cuSPARSELt's layout (`compress`'s
  `cusparselt`): cuSPARSELt then multiplies it in place, for a prefill's and
  a large batch's rows (N*K/8 bytes more per kernel); bfloat16 or float16
  kernels with K and N multiples of 64, raising otherwise (naming the layer).

  Call it outside `jax.jit`: it decides per layer, from the concrete
  `active` flags, whether to compress (layers in a dense phase keep their
  dense kernels); traced flags raise a `TypeError`.
  """
  fn = "compress_params"
  check_sparsity(fn, sparsity)
  check_params(fn, params, sparsity)
  chosen = {}
  for path, layer in layers_by_path(sparsity).items():
    if compresses(fn, "/".join(path), layer.get("active"), "jax.jit"):
      chosen[path] = (path, layer["mask"])
  def compress_kernel(layer, kernel):
    path, mask = layer
    if isinstance(kernel, Sparse24):  # map_sparse_kernels hands it over whole
      raise TypeError(f"{fn}: the kernel of layer {'/'.join(path)!r} is already a Sparse24"
                      f" (were the params compressed twice?); pass the dense params.")
    if tuple(mask.shape) != tuple(kernel.shape):
      raise ValueError(
          f"{fn}: the mask of layer {'/'.join(path)!r} is for a kernel of shape"
          f" {tuple(mask.shape)}, and its kernel in `params` has shape {tuple(kernel.shape)}:"
          f" pass the params and the {COLLECTION!r} collection of one model.")
    reason = cusparselt and cusparselt_layout_unfit(kernel.shape, kernel.dtype)
    if reason:
      raise ValueError(f"{fn}: layer {'/'.join(path)!r}: cusparselt=True {reason}")
    return compress(kernel, mask, transposed=mask.transposable, cusparselt=cusparselt)

  out, missing = map_sparse_kernels(compress_kernel, chosen, params)
  if missing:
    raise ValueError(f"{fn}: no kernel in params for sparse layer(s) {missing}: pass the"
                     f" params of the model whose init made this collection.")
  return out
