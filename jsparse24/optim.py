"""The mask-update optax transform: rebuilds 2:4 masks on a schedule.

`mask_update` is an optax `GradientTransformationExtraArgs` that must come
*before* the optimizer: it may add the masked decay to the gradients, which
the optimizer then scales, and it keeps the masks in its state. `with_masks`
wraps an optimizer so (it is `optax.chain(mask_update(...), optimizer)`).
The forward pass gets the current masks with `masks(opt_state)`, a
`"sparsity"` collection for `model.apply`:

    tx = jsparse24.optim.with_masks(optax.adamw(1e-3), variables["sparsity"], schedule)
    opt_state = tx.init(params)
    loss = model.apply({"params": params, "sparsity": jsparse24.optim.masks(opt_state)}, x)

Chained by hand, last after the optimizer (`optax.chain(optax.adam(...),
mask_update(...))`), it would receive the optimizer's updates instead of the
gradients and add the decay to the step itself, with the gradient's sign and
no learning rate; `masks`, `stats` and `masks_like_kernels` refuse such a
state.

Timing. Step `s` is the `s`-th forward/backward pass (0-based); it uses the
masks held by the state after `s` updates. `init` builds the masks from the
initial params. The update of step `s - 1` prepares the masks of step `s`: it
rebuilds them, from the params step `s - 1` computed with, exactly when
`schedule.rebuild(s)` is True, and sets every layer active or dense by
`schedule.sparse(s)`.

A schedule with no dense phase (`warmup_steps=0`, `dense_after=None`, the
default) holds `"active": None` for every layer instead of run-time flags:
the layers then never switch between their sparse and dense products at run
time, and the compiled step has no conditional around each product. (On a
GPU every such conditional copies its predicate to the host and stalls the
launch queue: docs/design_notes.md, "No branch around the product for a
schedule's dense phase".)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jsparse24 import backends
from jsparse24._format import Mask24
from jsparse24._sharding import explicit_sharding, typed_like
from jsparse24.linen import (_map_layers, check_sparsity, dense_kernel, layers_by_path,
                             map_sparse_kernels, masks_like_kernels as _masks_like_kernels,
                             rebuild_masks)
from pallas_kernels import prune_rule

DENSITY = 0.5  # 2 of 4 kept


def _namespace(step):
  """NumPy for a step known on the host (a Python or NumPy int or array),
  else jax.numpy. A training loop asks for each step's phase on the host before
  dispatching the step (`bool(schedule.sparse(i))`); computed on the device,
  that `bool` would wait for every step already queued there, and the GPU
  would idle while the host dispatches the next one."""
  return np if isinstance(step, (int, np.integer, np.ndarray)) else jnp


@dataclasses.dataclass(frozen=True)
class MaskSchedule:
  """When masks are rebuilt and when layers are sparse. Steps are 0-based.

  Attributes:
    warmup_steps: steps `[0, warmup_steps)` run dense; the masks are built
      from the trained weights right before step `warmup_steps`.
    rebuild_every: rebuild every this many steps after the first sparse step
      (`warmup_steps + k * rebuild_every`, k >= 1); None = one-shot: the masks
      built at the first sparse step are kept.
    freeze_after: no periodic rebuild at steps `>= freeze_after` (masks
      frozen). The first build at the end of the warm-up (step
      `warmup_steps`) always happens: before it the layers are dense and the
      masks are those of the initial weights.
    dense_after: steps `>= dense_after` run dense again (final dense
      fine-tuning); None = sparse to the end.

  `sparse(step)` and `rebuild(step)` accept Python ints and traced arrays;
  for a Python or NumPy int they answer with a NumPy bool, computed on the
  host (`_namespace`).
  `always_sparse`: whether no step is dense (no warm-up, no `dense_after`).
  """

  warmup_steps: int = 0
  rebuild_every: int | None = None
  freeze_after: int | None = None
  dense_after: int | None = None

  def __post_init__(self):
    for name in ("warmup_steps", "rebuild_every", "freeze_after", "dense_after"):
      v = getattr(self, name)
      if (v is not None or name == "warmup_steps") and (
          isinstance(v, bool) or not isinstance(v, (int, np.integer))):
        raise TypeError(f"MaskSchedule: {name} must be an int"
                        f"{'' if name == 'warmup_steps' else ' or None'}, got"
                        f" {type(v).__name__} {v!r}.")
    if self.warmup_steps < 0:
      raise ValueError(f"MaskSchedule: warmup_steps must be >= 0, got {self.warmup_steps}.")
    if self.rebuild_every is not None and self.rebuild_every < 1:
      raise ValueError(f"MaskSchedule: rebuild_every must be >= 1 or None, got {self.rebuild_every}.")
    for name in ("freeze_after", "dense_after"):
      v = getattr(self, name)
      if v is not None and v < self.warmup_steps:
        raise ValueError(
            f"MaskSchedule: {name}={v} is before the end of the dense warm-up"
            f" (warmup_steps={self.warmup_steps}).")

  def sparse(self, step) -> jax.Array | np.ndarray:
    # int32 steps: results are strongly typed bools, so a state made by
    # `init` (Python step 0) and one made by `update` (traced step) have the
    # same types and a jitted train step compiles once.
    xp = _namespace(step)
    step = xp.asarray(step, xp.int32)
    on = step >= self.warmup_steps
    if self.dense_after is not None:
      on = on & (step < self.dense_after)
    return on

  def rebuild(self, step) -> jax.Array | np.ndarray:
    xp = _namespace(step)
    step = xp.asarray(step, xp.int32)
    first = (step == self.warmup_steps) & (self.warmup_steps > 0)
    periodic = xp.asarray(False)
    if self.rebuild_every is not None:
      since = step - self.warmup_steps
      periodic = (since > 0) & (since % self.rebuild_every == 0)
      if self.freeze_after is not None:
        periodic = periodic & (step < self.freeze_after)
    return (first | periodic) & self.sparse(step)

  @property
  def always_sparse(self) -> bool:
    return self.warmup_steps == 0 and self.dense_after is None


class MaskUpdateState(NamedTuple):
  """State of `mask_update`.

  Attributes:
    count: updates done so far (= the step the held masks are for).
    masks: the `"sparsity"` collection: per layer `{"mask": Mask24 (packed,
      1 bit per weight), "active": bool[]}`, `"active": None` when the
      schedule is `always_sparse` (module docstring).
    flip_rate: per layer, the fraction of weights whose kept/pruned state
      changed at the last rebuild (0 before any).
    layer_sparsity: per layer, the fraction of weights pruned in the forward
      pass at this step (0.5 when sparse, 0 in dense phases).
    last_rebuild: the step whose masks were last rebuilt (0 = at `init`).
  """

  count: jax.Array
  masks: Any
  flip_rate: Any
  layer_sparsity: Any
  last_rebuild: jax.Array


def _per_layer(fn, masks: Mapping) -> dict:
  return _map_layers(lambda layer, _, path: fn(layer), masks, masks)


def mask_update(
    sparsity: Mapping,
    schedule: MaskSchedule = MaskSchedule(),
    *,
    decay: float | Callable[[jax.Array], jax.Array] = 0.0,
) -> optax.GradientTransformationExtraArgs:
  """The optax transform that keeps and rebuilds the 2:4 masks.

  Args:
    sparsity: the model's `"sparsity"` collection from `init` (only its
      structure and per-layer `transposable` setting are used).
    schedule: a `MaskSchedule`.
    decay: masked decay of pruned weights (SR-STE): for each sparse layer,
      `g <- g + decay * (1 - mask) * w` while the layer is sparse. A float or
      a `step -> value` schedule.

  Returns:
    A `GradientTransformationExtraArgs`; its `update` needs `params`.

  Chain it before the optimizer, or let `with_masks` do it.

  Steps are the transform's own updates: inside `optax.MultiSteps(tx, k)`
  (gradient accumulation) it runs once per k micro-steps, so the schedule
  counts optimizer steps, not micro-steps.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jsparse24
    >>> layer = jsparse24.SparseDense(4)
    >>> variables = layer.init(jax.random.key(0), jnp.ones((1, 8)))
    >>> tx = optax.chain(
    ...     jsparse24.optim.mask_update(
    ...         variables["sparsity"], jsparse24.optim.MaskSchedule(rebuild_every=10)),
    ...     optax.sgd(0.1))
    >>> state = tx.init(variables["params"])
    >>> jsparse24.optim.masks(state)["mask"].unpack().shape
    (8, 4)
  """
  check_sparsity("mask_update", sparsity)
  if not isinstance(schedule, MaskSchedule):
    raise TypeError(
        f"mask_update: `schedule` must be a MaskSchedule, got {type(schedule).__name__}"
        f" {schedule!r} (e.g. MaskSchedule(rebuild_every={schedule!r})).")
  template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), sparsity)
  if isinstance(decay, bool) or not (callable(decay) or isinstance(decay, (int, float))
                                     or (hasattr(decay, "shape") and hasattr(decay, "dtype")
                                         and jnp.ndim(decay) == 0)):
    raise TypeError(
        f"mask_update: `decay` must be a number, a scalar array or a `step -> value`"
        f" schedule, got {type(decay).__name__} {decay!r}.")
  decay_fn = decay if callable(decay) else (lambda _: decay)
  # A traced decay (optax.inject_hyperparams under jit) cannot be compared
  # with 0 here; it is applied, adding nothing where it is 0.
  uses_decay = not isinstance(decay, (int, float)) or decay != 0.0

  def set_active(masks, active):
    if schedule.always_sparse:  # no run-time switch (module docstring)
      return _with_active(masks, lambda layer: None)
    # Broadcast, not replace: a stack of layers (nn.scan) has one flag per layer.
    active = jnp.asarray(active, jnp.bool_)
    return _with_active(masks, lambda layer: jnp.broadcast_to(active, _stack_shape(layer)))

  def per_layer_value(masks, value):
    return _per_layer(lambda layer: jnp.broadcast_to(
        jnp.asarray(value, jnp.float32), _stack_shape(layer)), masks)

  def sparsity_of(masks, active):
    return per_layer_value(masks, jnp.where(active, 1 - DENSITY, 0.0))

  def init_fn(params):
    masks = set_active(rebuild_masks(params, template), schedule.sparse(0))
    return MaskUpdateState(jnp.zeros((), jnp.int32), masks, per_layer_value(masks, 0.0),
                           sparsity_of(masks, schedule.sparse(0)), jnp.zeros((), jnp.int32))

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    if params is None:
      raise ValueError("mask_update: `update` needs `params` (tx.update(grads, state, params)).")
    _check_updates(updates, params, state.masks)
    step = state.count
    nxt = step + 1
    do_rebuild = schedule.rebuild(nxt)

    # The rebuild runs only on rebuild steps, with no conditional where a
    # kernel can skip its work on a run-time flag (a GPU,
    # `backends.rebuild_where`): on a GPU a conditional copies its
    # predicate to the host and waits for it, once per step, and the host
    # then launches the rest of the step behind the GPU
    # (benchmarks/results/nvidia-h100-80gb-hbm3.md, "mask rebuilds without a
    # conditional"). Other layers (a CPU, or weights the kernels do not
    # take) are rebuilt inside one `lax.cond`.
    old_masks = _by_path(lambda layer, _, path: layer["mask"], state.masks, state.masks)
    kernels = _by_path(lambda _, p, path: dense_kernel(p, path, "mask_update"), state.masks,
                       params)
    old_flips = _by_path(lambda _, f, path: f, state.masks, state.flip_rate)
    # The kernel counts the flips as it rebuilds (none otherwise): no pass
    # over the masks for the statistics on a step that rebuilds nothing.
    flagged = {path: backends.rebuild_where(kernels[path], old, do_rebuild)
               for path, old in old_masks.items()}
    flagged = {path: new for path, new in flagged.items() if new is not None}
    new_masks = {path: mask for path, (mask, _) in flagged.items()}
    flips = {path: jnp.where(do_rebuild, flip, old_flips[path])
             for path, (_, flip) in flagged.items()}
    slow = [path for path in old_masks if path not in new_masks]
    if slow:
      def rebuilt():
        new = {path: _mask_typed_like(Mask24.from_weights(kernels[path],
                                                     transposable=old_masks[path].transposable),
                                 old_masks[path])
               for path in slow}
        return new, {path: flip_fraction(old_masks[path], new[path]) for path in slow}

      slow_masks, slow_flips = jax.lax.cond(
          do_rebuild, rebuilt,
          lambda: ({path: old_masks[path] for path in slow},
                   {path: old_flips[path] for path in slow}))
      new_masks.update(slow_masks)
      flips.update(slow_flips)
    masks = _map_layers(lambda layer, _, path: {**layer, "mask": new_masks[path]},
                        state.masks, state.masks)
    flip = _map_layers(lambda _, __, path: flips[path], state.masks, state.masks)
    # The sparse kernels' updates depend on the rebuild's outputs, so that
    # the optimizer's in-place write of the new params (donated buffers)
    # provably follows the rebuild's read of the old ones. Without a data
    # dependency XLA cannot order the two and copies every sparse kernel
    # before the step to keep the old values for the conditional: two passes
    # over the float32 weights per step (docs/design_notes.md, "The
    # optimizer's updates depend on the rebuild"). `optimization_barrier`
    # does not order them for XLA's copy removal; a data dependency does.
    # Flip rates are fractions, so `after` is always True, but XLA cannot
    # fold it.
    after = sum(jnp.sum(f) for f in jax.tree.leaves(flip)) >= 0
    if uses_decay:
      updates = _add_masked_decay(updates, params, state.masks,
                                  jnp.asarray(decay_fn(step), jnp.float32), after)
    else:
      updates = _ordered_after(updates, state.masks, after)
    active = schedule.sparse(nxt)
    masks = set_active(masks, active)
    last = jnp.where(do_rebuild, nxt, state.last_rebuild).astype(jnp.int32)
    return updates, MaskUpdateState(optax.safe_increment(step), masks, flip,
                                    sparsity_of(masks, active), last)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _mask_typed_like(new: Mask24, old: Mask24) -> Mask24:
  """`new` with `old`'s sharding type where the mesh axes are Explicit (the
  rebuilt mask comes out sharded like its weight; the conditional around
  the rebuild needs both branches typed alike). Elsewhere `new` itself."""
  sharding = explicit_sharding(old.packed)
  if sharding is None:
    return new
  return dataclasses.replace(new, packed=jax.sharding.reshard(new.packed, sharding))


def flip_fraction(old: Mask24, new: Mask24) -> jax.Array:
  """The fraction of weights kept by one mask and pruned by the other, per
  mask of a stack (float32, the stack's axes), from the packed codes: no
  dense bool mask is made (one pass over 1/8 byte per weight each)."""
  def kept(packed):  # a byte's two codes -> the kept positions of its 8 weights
    return prune_rule.kept_bits(packed.astype(jnp.uint32))

  # Both are packed alike (the same dims), padding nibbles included.
  changed = jax.lax.population_count(kept(old.packed) ^ kept(new.packed))
  lead = len(old.shape) - 2
  k, n = old.dims
  return jnp.sum(changed.astype(jnp.float32), axis=tuple(range(lead, changed.ndim))) / (k * n)


def _by_path(fn, sparsity: Mapping, other: Any) -> dict:
  """`{layer path: fn(layer, other's entry, path)}` over the sparse layers."""
  out = {}
  _map_layers(lambda layer, o, path: out.__setitem__(path, fn(layer, o, path)), sparsity, other)
  return out


def _with_active(masks: Mapping, flags) -> dict:
  """`masks` with every layer's `"active"` replaced by `flags(layer)`."""
  return _per_layer(lambda layer: {**layer, "active": flags(layer)}, masks)


def _stack_shape(layer: Mapping) -> tuple[int, ...]:
  """The layer's stack axes (`[L]` under nn.scan; `()` for one layer)."""
  return tuple(layer["mask"].shape[:-2])


def _check_updates(updates, params, masks: Mapping) -> None:
  if jax.tree.structure(updates) != jax.tree.structure(params):
    have = {jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(updates)}
    want = {jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(params)}
    raise ValueError(
        f"mask_update: the gradients and the params differ in structure (missing from the"
        f" gradients: {sorted(want - have)[:5]}; not in the params: {sorted(have - want)[:5]});"
        f" pass the gradients of every parameter.")
  missing = map_sparse_kernels(lambda layer, u: u, layers_by_path(masks), updates)[1]
  if missing:
    raise ValueError(
        f"mask_update: the gradients have no 'kernel' for the sparse layer(s) {missing};"
        f" pass the gradients of the params the 'sparsity' collection was made for.")


def _ordered_after(updates, masks: Mapping, after: jax.Array):
  """`updates`, bit for bit (a select, not an addition: signed zeros and NaN
  kept), with every sparse kernel's entry computed from the always-True
  scalar `after`: a data dependency only (see `mask_update`). The untaken
  side is `-u`, not a zero: XLA merged a zero with nn.scan's zero-filled
  gradient buffers and read it from memory (docs/design_notes.md, "The
  optimizer's updates depend on the rebuild")."""
  return map_sparse_kernels(lambda layer, u: jnp.where(after, u, -u),
                            layers_by_path(masks), updates)[0]


def _add_masked_decay(updates, params, masks: Mapping, lam: jax.Array, after: jax.Array):
  """`updates` with `lam * (1 - mask) * kernel` added to every active sparse
  layer's kernel entry. `after` (always True) only orders the term after the
  rebuild (see `mask_update`); it enters through the per-layer scale, so the
  elementwise term stays the one XLA fuses. Mapped over the updates tree, so
  its container types (`FrozenDict`) are kept. The mask is expanded in the
  kernel's own layout (`Mask24.unpack`), so XLA fuses the whole term into the
  optimizer's elementwise pass over the kernel: no extra pass over the
  weights per step.
  """

  def add(layer, update, weight):
    # One flag per layer (an [L] stack under nn.scan) against [..., K, N].
    active = layer["active"]
    on = after if active is None else active & after
    scale = jnp.broadcast_to(jnp.where(on, lam, 0.0), _stack_shape(layer))
    scale = scale[..., None, None].astype(weight.dtype)
    # A select between two updates, not `where(mask, 0, weight)`: XLA merged
    # that zero with the zero-filled gradient buffers of nn.scan and read it
    # from memory, a weight-sized float32 buffer per layer
    # (docs/design_notes.md, "The optimizer's updates depend on the rebuild").
    kept = typed_like(Mask24.unpack, update, layer["mask"])  # typed like it (Explicit axes)
    return jnp.where(kept, update,
                     update + (scale * weight).astype(update.dtype))

  return map_sparse_kernels(add, layers_by_path(masks), updates, params)[0]


def with_masks(
    optimizer: optax.GradientTransformation,
    sparsity: Mapping,
    schedule: MaskSchedule = MaskSchedule(),
    *,
    decay: float | Callable[[jax.Array], jax.Array] = 0.0,
) -> optax.GradientTransformationExtraArgs:
  """`optimizer` with `mask_update` chained before it, where it belongs.

  The way to train with rebuilt masks: `mask_update` must see the gradients,
  not the optimizer's updates (module docstring), and this cannot put it
  anywhere else. The result is `optax.chain(mask_update(sparsity, schedule,
  decay=decay), optimizer)`; its `update` needs `params`, and `masks`,
  `stats` and `masks_like_kernels` read its state. Wrap it whole
  (`optax.MultiSteps(with_masks(...), k)`), not the optimizer inside it, for
  the schedule to count optimizer steps.

  Args:
    optimizer: any optax transform (`optax.adamw(1e-3)`, a chain with
      clipping, ...).
    sparsity: the model's `"sparsity"` collection from `init`.
    schedule: a `MaskSchedule`.
    decay: as in `mask_update`.

  Returns:
    A `GradientTransformationExtraArgs`.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jsparse24
    >>> layer = jsparse24.SparseDense(4)
    >>> variables = layer.init(jax.random.key(0), jnp.ones((1, 8)))
    >>> tx = jsparse24.optim.with_masks(
    ...     optax.adamw(1e-3), variables["sparsity"],
    ...     jsparse24.optim.MaskSchedule(rebuild_every=10), decay=2e-4)
    >>> state = tx.init(variables["params"])
    >>> jsparse24.optim.masks(state)["mask"].unpack().shape
    (8, 4)
  """
  if not isinstance(optimizer, optax.GradientTransformation):
    raise TypeError(
        f"with_masks: `optimizer` must be an optax transform (e.g. optax.adamw(1e-3)),"
        f" got {type(optimizer).__name__}; the 'sparsity' collection comes second.")
  check_sparsity("with_masks", sparsity)
  return optax.chain(mask_update(sparsity, schedule, decay=decay), optimizer)


def _find_state(opt_state, fn: str) -> MaskUpdateState:
  found = [(path, s) for path, s in jax.tree_util.tree_leaves_with_path(
      opt_state, is_leaf=lambda s: isinstance(s, MaskUpdateState))
           if isinstance(s, MaskUpdateState)]
  if len(found) != 1:
    raise ValueError(
        f"{fn}: expected exactly one jsparse24.optim.mask_update state in `opt_state`,"
        f" found {len(found)} (build the optimizer with jsparse24.optim.with_masks).")
  path, state = found[0]
  _check_placement(fn, opt_state, path)
  return state


def _check_placement(fn: str, opt_state, path) -> None:
  """Raises where the `mask_update` state at `path` shows the transform
  chained last, after other transforms: then it receives the optimizer's
  updates, not the gradients (module docstring), and trains on without a
  word. The state says so: `optax.chain` keeps its transforms' states in a
  plain tuple, in order, so the transform is last after others where it is
  the last entry of every tuple on its path and not the first of one. Other
  containers on the path (`optax.MultiSteps`, `inject_hyperparams`) are
  passed through; a container it cannot read makes it say nothing.
  (`optax.chain(clip, mask_update, optimizer)`, which feeds it clipped
  gradients, is accepted.)"""
  node, last, after_others = opt_state, True, False
  for key in path:
    if isinstance(key, jax.tree_util.SequenceKey) and isinstance(node, (tuple, list)):
      last &= key.idx == len(node) - 1
      after_others |= key.idx > 0
      node = node[key.idx]
    elif isinstance(key, jax.tree_util.GetAttrKey):
      node = getattr(node, key.name)
    elif isinstance(key, jax.tree_util.DictKey):
      node = node[key.key]
    else:
      return
  if last and after_others:
    raise ValueError(
        f"{fn}: the jsparse24.optim.mask_update transform is chained after the"
        f" optimizer (last in an optax.chain, after other transforms), so it receives"
        f" the optimizer's updates instead of the gradients and adds its decay to the"
        f" step itself. Chain it"
        f" first: jsparse24.optim.with_masks(optimizer, sparsity, schedule, decay=...),"
        f" or optax.chain(jsparse24.optim.mask_update(...), optimizer).")


def masks(opt_state, sparse: bool | None = None) -> dict:
  """The `"sparsity"` collection for the next forward pass, from an optimizer
  state that contains a `mask_update` state (anywhere in a chain).

  `sparse`: None (default) passes the state's `active` flags, which a
  schedule with dense phases keeps as run-time values: the compiled step
  then switches every product at run time (a conditional per product, which
  stalls a GPU; module docstring). A Python bool instead states this step's
  phase for every layer: True gives `"active": None` (always sparse: no
  switch at all), False constant False flags (dense; XLA folds the forward
  pass's switches, the backward pass keeps its own, which reads the flags as
  a residual). It must be the schedule's own phase, computed on the host,
  with the step jitted once per phase:

      @functools.partial(jax.jit, static_argnames="sparse")
      def step(params, opt_state, batch, sparse):
          variables = {"params": params, "sparsity": masks(opt_state, sparse)}
          ...
      step(params, opt_state, batch, sparse=bool(schedule.sparse(i)))
  """
  held = _find_state(opt_state, "masks").masks
  if sparse is None:
    return held
  if not isinstance(sparse, (bool, np.bool_)):
    raise TypeError(
        f"masks: `sparse` must be None or a Python bool (this step's phase, e.g."
        f" bool(schedule.sparse(step)) on the host), got {type(sparse).__name__}"
        f" {sparse!r}; a traced value would keep the run-time switch.")
  if sparse:
    return _with_active(held, lambda layer: None)
  return _with_active(held, lambda layer: np.zeros(_stack_shape(layer), bool))


def masks_like_kernels(opt_state, params: Mapping):
  """`opt_state` with its `mask_update` state's masks laid out like their
  kernels in `params` (`jsparse24.masks_like_kernels`), the rest as it is:

      opt_state = jsparse24.optim.masks_like_kernels(opt_state, params)
      keep = jax.tree.map(lambda a: a.sharding, (params, opt_state))
      step = jax.jit(train_step, out_shardings=keep + (loss_sharding,))
  """
  state = _find_state(opt_state, "masks_like_kernels")
  placed = state._replace(masks=_masks_like_kernels(state.masks, params))
  return jax.tree.map(lambda s: placed if s is state else s, opt_state,
                      is_leaf=lambda s: s is state)


def stats(opt_state) -> dict[str, dict[str, jax.Array]]:
  """`{"layer/path": {"flip_rate": ..., "sparsity": ...}}` for logging."""
  state = _find_state(opt_state, "stats")

  def by_path(tree):
    return {"/".join(str(k.key) for k in path): v
            for path, v in jax.tree_util.tree_leaves_with_path(tree)}

  sparsity = by_path(state.layer_sparsity)
  return {path: {"flip_rate": flip, "sparsity": sparsity[path]}
          for path, flip in by_path(state.flip_rate).items()}


__all__ = ["MaskSchedule", "MaskUpdateState", "mask_update", "masks", "masks_like_kernels",
           "stats", "with_masks"]
