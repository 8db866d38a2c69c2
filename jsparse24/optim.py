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

Chained by hand after the optimizer (`optax.chain(optax.adam(...),
mask_update(...))`, in an `optax.named_chain` too, or with transforms after
it), it would receive the optimizer's updates instead of the gradients and
add the decay to the step itself, with the gradient's sign and no learning
rate; `masks`, `stats` and `masks_like_kernels` refuse such a state.

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

Gradual sparsity. A schedule with a `SparsityRamp` makes the layers 2:4 a
few at a time: the share of 2:4 layers grows along a cosine curve, and where
it grows the dense layers whose masks remove the least of their weights
(`pruned_norm`, rescored whenever their masks are rebuilt) go 2:4 first, and
stay 2:4. The state holds which layers are 2:4 as run-time flags; a training
loop that tells the step what the host knows keeps run-time switches out of
it:
- the layers: while the ramp mixes dense and 2:4 layers
  (`MaskSchedule.phase(step)` is None), `masks(opt_state,
  sparse=sparse_layers(opt_state))` gives each layer a phase fixed at trace
  time (None: 2:4, `STATIC_DENSE`: dense), and the step is jitted once per
  set. Layers only enter 2:4, so a run passes through at most `layers + 1`
  sets, and the host reads the set (one transfer of the flags, which waits
  for the queued steps) only where `MaskSchedule.changes(step, layers)`.
  With the state's flags instead (`sparse=None`) every product carries a
  run-time switch (a conditional in the forward and one in the backward
  pass); on a GPU each copies its predicate to the host and stalls the
  launch queue, and the step becomes launch-bound (docs/design_notes.md,
  "Gradual sparsity without run-time switches"). A stack of layers
  (`nn.scan`) that the set holds partly keeps the switch of its own
  products (`masks`);
- the rebuild: a `lax.cond` scores the layers whose masks were rebuilt (one
  pass over their weights on the steps that rebuild, none otherwise), every
  step, whatever the phase, and on a CPU (or for weights the mask kernel
  does not take) another rebuilds the masks. `update(...,
  mask_rebuild=schedule.update_rebuilds(step, layers))`, a Python bool,
  traces only the branch that runs: no conditional, at the price of one
  program with and one without a rebuild per phase (at most `2 * (layers +
  1)` with a ramp);
- the masked decay: `update(..., sparse=...)`, the same set as the
  forward's `masks(opt_state, sparse=...)`, adds it to the 2:4 layers only;
  with the state's flags every layer's update carries the term (scaled by
  zero while the layer is dense: an elementwise pass over its gradient and
  weight per step);
- always: a per-layer select of every mask between its old and rebuilt
  bits (one elementwise pass over the packed masks, 1 bit per weight),
  because a layer entering 2:4 gets a fresh mask while the 2:4 layers keep
  the schedule's rebuild cadence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jsparse24 import _checks, backends
from jsparse24._format import Mask24
from jsparse24._phase import STATIC_DENSE, is_static_dense
from jsparse24._sharding import explicit_sharding, typed_like
from jsparse24.linen import (check_params, check_sparsity, dense_kernel, entries_by_path,
                             layers_by_path, map_layers, map_sparse_kernels,
                             masks_like_kernels as _masks_like_kernels, rebuild_masks_as)
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
class SparsityRamp:
  """Gradual sparsity: the share of the model's 2:4 layers along a cosine
  curve, from `initial` at step `start` to `target` at step `end`.

  A 2:4 layer is dense or 2:4, so the ramp counts layers: at step `s`,
  `count(s, layers) = floor(share(s) * layers + 0.5)` of the model's
  `layers` 2:4 layers are sparse (a stack of layers under `nn.scan` counts
  each of its layers), the others dense. Which ones `mask_update` decides
  (module docstring): the least sensitive first, and a layer once sparse
  stays sparse. Give it to a `MaskSchedule` (`ramp=`), whose warm-up, rebuild
  cadence, freeze and dense tail still hold: no layer is sparse outside
  `schedule.sparse(step)`.

  The cosine (as in `optax.cosine_decay_schedule`, rising) starts and ends
  flat: the first layers go sparse slowly while the model adapts, most of
  them in the middle of the window, the last ones slowly again.

  Attributes:
    start: the ramp's first step; steps `<= start` have the `initial` share.
    end: steps `>= end` have the `target` share (`end > start`).
    initial: the share of 2:4 layers up to `start`, in [0, 1].
    target: the share from `end` on, in [`initial`, 1]; 1 = every layer.

  Example:
    >>> import jsparse24
    >>> ramp = jsparse24.optim.SparsityRamp(start=0, end=8)
    >>> [int(ramp.count(step, 6)) for step in range(10)]  # of 6 layers
    [0, 0, 1, 2, 3, 4, 5, 6, 6, 6]
    >>> schedule = jsparse24.optim.MaskSchedule(rebuild_every=4, ramp=ramp)
    >>> [schedule.phase(step) for step in (0, 4, 8)]  # for masks(opt_state, sparse=...)
    [False, None, True]
  """

  start: int
  end: int
  initial: float = 0.0
  target: float = 1.0

  def __post_init__(self):
    for name in ("start", "end"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"SparsityRamp: {name} must be an int, got {type(v).__name__} {v!r}.")
    for name in ("initial", "target"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(
            f"SparsityRamp: {name} must be a share of layers in [0, 1], got"
            f" {type(v).__name__} {v!r}.")
    if not 0 <= self.start < self.end:
      raise ValueError(
          f"SparsityRamp: need 0 <= start < end, got start={self.start}, end={self.end}"
          f" (a switch at one step is MaskSchedule(warmup_steps=...) without a ramp).")
    if not 0.0 <= self.initial <= self.target <= 1.0 or self.target == 0.0:
      raise ValueError(
          f"SparsityRamp: need 0 <= initial <= target <= 1 and target > 0 (shares of the 2:4"
          f" layers, growing; with target 0 no layer is ever 2:4), got initial={self.initial},"
          f" target={self.target}.")

  def share(self, step) -> jax.Array | np.ndarray:
    """The share of 2:4 layers at `step` (float32; exactly `initial` up to
    `start` and `target` from `end` on). Host steps are answered on the host
    (`_namespace`)."""
    xp = _namespace(step)
    step = xp.asarray(step, xp.int32)
    t = xp.clip((step - self.start) / (self.end - self.start), 0.0, 1.0)
    rise = (1.0 - xp.cos(np.pi * t)) / 2.0
    share = self.initial + (self.target - self.initial) * rise
    share = xp.where(step <= self.start, self.initial, xp.where(step >= self.end, self.target,
                                                                 share))
    return share.astype(xp.float32)

  def count(self, step, layers: int) -> jax.Array | np.ndarray:
    """How many of `layers` 2:4 layers are sparse at `step` (int32,
    non-decreasing in `step`). A traced step is compared with the first step
    of each count (`_first_steps`), which the host found with the host's
    arithmetic, so that the device's count and the host's
    (`MaskSchedule.phase`) never differ by a rounding."""
    _check_layers("SparsityRamp.count", layers)
    if _namespace(step) is np:
      return self._host_count(np.asarray(step), layers)
    base, firsts = self._first_steps(layers)
    step = jnp.asarray(step, jnp.int32)
    return base + jnp.sum(step[..., None] >= jnp.asarray(firsts), axis=-1, dtype=jnp.int32)

  def _host_count(self, steps: np.ndarray, layers: int) -> np.ndarray:
    share = self.share(steps).astype(np.float64)
    return np.floor(share * layers + 0.5).astype(np.int32)

  def _first_steps(self, layers: int) -> tuple[int, np.ndarray]:
    """The count up to `start`, and for each count above it up to the
    target's, the first step that has it: `layers` + 1 numbers at most,
    however long the ramp (a table of every step's count would put `end -
    start + 1` entries in the program: gigabytes for a ramp of 10**8 steps).
    The host count is non-decreasing in the step, so a bisection per count
    finds its first step: all counts at once, about log2(end - start) host
    passes."""
    base = int(self._host_count(np.asarray(self.start), layers))
    want = np.arange(base + 1, int(self._host_count(np.asarray(self.end), layers)) + 1)
    lo = np.full(want.shape, self.start, np.int64)  # count(lo) < want
    hi = np.full(want.shape, self.end, np.int64)  # count(hi) >= want
    while np.any(hi - lo > 1):
      mid = (lo + hi) // 2
      reached = self._host_count(mid, layers) >= want
      hi, lo = np.where(reached, mid, hi), np.where(reached, lo, mid)
    return base, hi.astype(np.int32)


def _check_layers(fn: str, layers: Any) -> None:
  """A count of layers (a float was truncated, a negative count gave
  negative counts)."""
  _checks.check_count(fn, "`layers`", layers, 0,
                      " (the model's 2:4 layers, each layer of a stack counted)")


def _check_host_step(fn: str, step: Any) -> None:
  """Raises unless `step` is a Python or NumPy int (not a bool, not traced)."""
  if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
    raise TypeError(f"{fn}: `step` must be a host int (the step about to be dispatched),"
                    f" got {type(step).__name__} {step!r}.")


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
    ramp: a `SparsityRamp`: the layers go 2:4 one by one over its window,
      inside the steps that `sparse(step)` allows; None = every layer at
      once.

  `sparse(step)` and `rebuild(step)` accept Python ints and traced arrays;
  for a Python or NumPy int they answer with a NumPy bool, computed on the
  host (`_namespace`). With a ramp, `sparse(step)` says whether layers may
  be 2:4 at `step`; `phase(step)` says whether all of them are.
  `always_sparse`: whether no step is dense (no warm-up, no `dense_after`,
  no ramp).
  """

  warmup_steps: int = 0
  rebuild_every: int | None = None
  freeze_after: int | None = None
  dense_after: int | None = None
  ramp: SparsityRamp | None = None

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
    # Schedules under which the run is not what their fields say: no 2:4
    # step at all, or a ramp that the warm-up or the dense tail hides.
    if self.dense_after is not None and self.dense_after == self.warmup_steps:
      raise ValueError(
          f"MaskSchedule: dense_after={self.dense_after} is where the dense warm-up ends"
          f" (warmup_steps={self.warmup_steps}), so no step would be 2:4; make it later.")
    if self.ramp is not None and not isinstance(self.ramp, SparsityRamp):
      raise TypeError(
          f"MaskSchedule: ramp must be a SparsityRamp or None, got {type(self.ramp).__name__}"
          f" {self.ramp!r} (e.g. SparsityRamp(start=100, end=600)).")
    if self.ramp is not None and self.ramp.end <= self.warmup_steps:
      raise ValueError(
          f"MaskSchedule: the ramp ends at step {self.ramp.end}, within the dense warm-up"
          f" (warmup_steps={self.warmup_steps}): its layers would all go 2:4 at once at step"
          f" {self.warmup_steps}; start the ramp at the warm-up's end or later, or shorten the"
          f" warm-up.")
    if (self.ramp is not None and self.dense_after is not None
        and self.ramp.start >= self.dense_after):
      raise ValueError(
          f"MaskSchedule: the ramp starts at step {self.ramp.start}, in the dense tail"
          f" (dense_after={self.dense_after}), so its layers would never be 2:4; start it"
          f" earlier.")

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

  def phase(self, step: int) -> bool | None:
    """This host step's phase for `masks(opt_state, sparse=...)`: True where
    every layer is 2:4, False where none is, None where a ramp mixes them
    (the layers then read their run-time flags). Without a ramp,
    `bool(sparse(step))`."""
    _check_host_step("MaskSchedule.phase", step)
    if not self.sparse(step):
      return False
    if self.ramp is None:
      return True
    share = float(self.ramp.share(step))
    # count(step, n) is 0 for every n only at share 0, and n only at share 1.
    return False if share == 0.0 else True if share == 1.0 else None

  def sparse_count(self, step, layers: int) -> jax.Array | np.ndarray:
    """How many of the model's `layers` 2:4 layers (each layer of a stack
    counted) are 2:4 at `step` (int32): `ramp.count(step, layers)` (all
    `layers` without a ramp) where `sparse(step)`, else 0. It is the number
    of True flags that `mask_update` holds for step `step`, since a layer
    enters 2:4 only where this count grows and leaves only where
    `sparse(step)` ends. Host steps are answered on the host (`_namespace`)."""
    _check_layers("MaskSchedule.sparse_count", layers)
    xp = _namespace(step)
    full = layers if self.ramp is None else self.ramp.count(step, layers)
    return xp.where(self.sparse(step), full, 0).astype(xp.int32)

  def update_rebuilds(self, step: int, layers: int) -> bool:
    """Whether `mask_update`'s update of host step `step` (the one that
    prepares the masks of step `step + 1`) rebuilds any mask: where
    `rebuild(step + 1)`, or where a ramp's `sparse_count` grows (the dense
    layers' masks are rebuilt for the layers entering 2:4). For its static
    `mask_rebuild` argument (`mask_update`), which leaves the rebuild's
    conditionals out of the compiled step."""
    _check_host_step("MaskSchedule.update_rebuilds", step)
    grows = (self.ramp is not None
             and self.sparse_count(step + 1, layers) > self.sparse_count(step, layers))
    return bool(self.rebuild(step + 1)) or bool(grows)

  def changes(self, step: int, layers: int) -> bool:
    """Whether the set of 2:4 layers at host step `step` may differ from
    that of step `step - 1` (True at step 0): where `sparse_count` differs.
    A training loop that jits its step for the set of 2:4 layers
    (`masks(opt_state, sparse=frozenset)`) reads the set
    (`sparse_layers(opt_state)`, a transfer that waits for the steps queued
    before it) only on these steps: at most `layers + 1` of them while the
    schedule is sparse, and one where `dense_after` ends it."""
    _check_host_step("MaskSchedule.changes", step)
    if step == 0:
      return True
    return bool(self.sparse_count(step, layers) != self.sparse_count(step - 1, layers))

  @property
  def always_sparse(self) -> bool:
    return self.warmup_steps == 0 and self.dense_after is None and self.ramp is None


class MaskUpdateState(NamedTuple):
  """State of `mask_update`.

  Attributes:
    count: updates done so far (= the step the held masks are for).
    masks: the `"sparsity"` collection: per layer `{"mask": Mask24 (packed,
      1 bit per weight), "active": bool[]}`, `"active": None` when the
      schedule is `always_sparse` (module docstring).
    flip_rate: per layer, the fraction of weights whose kept/pruned state
      changed at the last rebuild (0 before any).
    last_rebuild: the step whose masks were last rebuilt (0 = at `init`;
      with a ramp, also the steps that rebuild the dense layers' masks for
      the layers entering 2:4).
    score: with a `SparsityRamp`, per layer, the share of its weights'
      norm that its mask removes, `||w * (1 - mask)|| / ||w||` (float32, the
      stack's axes), from the weights its mask was last rebuilt from: the
      dense layers with the lowest scores go 2:4 first. None without a ramp.
  """

  count: jax.Array
  masks: Any
  flip_rate: Any
  last_rebuild: jax.Array
  score: Any = None


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
      `g <- g + decay * (1 - mask) * w` while the layer is sparse. A float
      (>= 0, finite; a concrete scalar array too) or a `step -> value`
      schedule (its values unchecked: they are traced).

  Returns:
    A `GradientTransformationExtraArgs`; its `update` needs `params`.

  Chain it before the optimizer, or let `with_masks` do it.

  Steps are the transform's own updates: inside `optax.MultiSteps(tx, k)`
  (gradient accumulation) it runs once per k micro-steps, so the schedule
  counts optimizer steps, not micro-steps.

  `update` takes two extra keyword arguments (passed on by `optax.chain`):
  `mask_rebuild`, None (default) or a Python bool, whether this update
  rebuilds any mask, as the host knows it
  (`schedule.update_rebuilds(step, layers)`, `layers =
  len(layer_names(opt_state))`). Given, the step has no conditional around
  the rebuild or the ramp's scores (module docstring); it must be the
  schedule's own answer, with the step jitted once per value (a static
  argument): a wrong one skips or forces a rebuild, unchecked. The host's
  `step` must be the state's count: under a wrapper that skips updates
  (`optax.apply_if_finite` after a non-finite gradient) the count falls
  behind the host's steps, and the host's answer belongs to another update
  (a layer entering 2:4 then keeps its mask from `init`); there pass None,
  or count the host's steps as the state does. Given as False, nothing in
  the update reads the weights, and the optimizer's updates carry no
  ordering after it.
  `sparse`, None (default) or the step's 2:4 layers as `masks(opt_state,
  sparse)` takes them (the same static value): the masked decay is then
  added to those layers only, with no term, select or pass over the
  weights for the layers that are dense this step.

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
  # jnp's shape and dtype: an `active` flag written as a Python bool, as
  # the layers take it, has neither attribute.
  template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
                          sparsity)
  if isinstance(decay, bool) or not (callable(decay) or isinstance(decay, (int, float))
                                     or (hasattr(decay, "shape") and hasattr(decay, "dtype")
                                         and jnp.ndim(decay) == 0)):
    raise TypeError(
        f"mask_update: `decay` must be a number, a scalar array or a `step -> value`"
        f" schedule, got {type(decay).__name__} {decay!r}.")
  # A number or a concrete scalar array (numpy's, jax's) is checked now; a
  # traced one (optax.inject_hyperparams) and a schedule's values cannot be.
  if not callable(decay) and _checks.is_concrete(decay) and not 0 <= float(decay) < np.inf:
    raise ValueError(
        f"mask_update: `decay` must be >= 0 and finite, got {decay!r}: SR-STE's decay pulls"
        f" the pruned weights toward 0, a negative one would push them away, an infinite one"
        f" makes their updates infinite.")
  decay_fn = decay if callable(decay) else (lambda _: decay)
  # A traced decay (optax.inject_hyperparams under jit) cannot be compared
  # with 0 here; it is applied, adding nothing where it is 0.
  uses_decay = not isinstance(decay, (int, float)) or decay != 0.0

  ramp = schedule.ramp
  # The ramp counts each layer of a stack (nn.scan) as one layer.
  n_layers = sum(int(np.prod(_stack_shape(layer)))
                 for layer in layers_by_path(sparsity).values())

  # Each layer gets an array of its own (a copy, where the broadcast is
  # none): one array in several leaves of a state that a step donates is
  # refused ("Attempt to donate the same buffer twice").
  def set_active(masks, active):
    if schedule.always_sparse:  # no run-time switch (module docstring)
      return _with_active(masks, lambda layer: None)
    # Broadcast, not replace: a stack of layers (nn.scan) has one flag per layer.
    active = jnp.asarray(active, jnp.bool_)
    return _with_active(masks, lambda layer: jnp.array(
        jnp.broadcast_to(active, _stack_shape(layer)), copy=True))

  def per_layer_value(masks, value):
    return map_layers(lambda layer, _: jnp.array(jnp.broadcast_to(
        jnp.asarray(value, jnp.float32), _stack_shape(layer)), copy=True), masks)

  def init_fn(params):
    masks = rebuild_masks_as("mask_update", params, template)
    def zero():  # count and last_rebuild: two arrays (see set_active)
      return jnp.zeros((), jnp.int32)
    if ramp is None:
      masks = set_active(masks, schedule.sparse(0))
      return MaskUpdateState(zero(), masks, per_layer_value(masks, 0.0), zero())
    held = {path: layer["mask"] for path, layer in layers_by_path(masks).items()}
    kernels = _kernels(masks, params)
    score = {path: pruned_norm(kernels[path], held[path]) for path in held}
    dense = {path: jnp.zeros(_stack_shape({"mask": m}), jnp.bool_) for path, m in held.items()}
    active = _grow(dense, score, ramp.count(0, n_layers), schedule.sparse(0))
    masks = map_layers(lambda layer, path: {**layer, "active": active[path]}, masks)
    return MaskUpdateState(zero(), masks, per_layer_value(masks, 0.0), zero(),
                           map_layers(lambda _, path: score[path], masks))

  def update_fn(updates, state, params=None, *, mask_rebuild: bool | None = None,
                sparse: bool | frozenset[str] | None = None, **extra_args):
    del extra_args
    if not isinstance(state, MaskUpdateState):
      raise TypeError(
          f"mask_update: `state` is a {type(state).__name__}, not this transform's"
          f" MaskUpdateState; pass the state that its init (or the chain's) returned:"
          f" tx.update(grads, opt_state, params).")
    if params is None:
      raise ValueError("mask_update: `update` needs `params` (tx.update(grads, state, params)).")
    if mask_rebuild is not None and not isinstance(mask_rebuild, (bool, np.bool_)):
      raise TypeError(
          f"mask_update: `mask_rebuild` must be None or a Python bool (the host's"
          f" schedule.update_rebuilds(step, layers)), got {type(mask_rebuild).__name__}"
          f" {mask_rebuild!r}; a traced value would keep the conditional.")
    check_params("mask_update", params, state.masks)
    _check_updates(updates, params, state.masks)
    stated = _with_static_phase(state.masks, sparse, "mask_update")
    step = state.count
    nxt = step + 1
    do_rebuild = schedule.rebuild(nxt)

    # The rebuild runs only on rebuild steps, with no conditional where a
    # kernel can skip its work on a run-time flag (a GPU,
    # `backends.rebuild_where`): on a GPU a conditional copies its
    # predicate to the host and waits for it, once per step, and the host
    # then launches the rest of the step behind the GPU
    # (benchmarks/results/nvidia-h100-80gb-hbm3.md, "Whole model, mask
    # rebuilds without a conditional (2026-11-24)"). Other layers (a CPU, or
    # weights the kernels do not take) are rebuilt inside one `lax.cond`
    # (`_rebuilt_masks`).
    held = layers_by_path(state.masks)
    old_masks = {path: layer["mask"] for path, layer in held.items()}
    kernels = _kernels(state.masks, params)
    old_flips = entries_by_path(state.masks, state.flip_rate, "mask_update")
    if ramp is not None:
      # Layers enter 2:4 where the ramp's count grows: the dense layers'
      # masks (and scores) are rebuilt then, so that the entering layers
      # are chosen by, and start from, masks of the current weights; the
      # 2:4 layers' masks keep the schedule's cadence.
      was_active = {path: layer["active"] for path, layer in held.items()}
      held_sparse = sum(jnp.sum(a, dtype=jnp.int32) for a in was_active.values())
      count = ramp.count(nxt, n_layers)
      grow = schedule.sparse(nxt) & (count > held_sparse)
      per_layer = {path: do_rebuild | (grow & ~a) for path, a in was_active.items()}
      do_rebuild = do_rebuild | grow
    if mask_rebuild is not None:
      do_rebuild = jnp.asarray(bool(mask_rebuild))

    new_masks, flips = _rebuilt_masks(kernels, old_masks, old_flips, do_rebuild, mask_rebuild)
    if ramp is not None:
      new_masks = {path: _select_layers(per_layer[path], new, old_masks[path])
                   for path, new in new_masks.items()}
      flips = {path: jnp.where(per_layer[path], flip, old_flips[path])
               for path, flip in flips.items()}
      old_score = entries_by_path(state.masks, state.score, "mask_update")
      # Scores only where masks were rebuilt: one pass over those weights,
      # inside a conditional unless the host said (module docstring).
      score = _when_rebuilding(
          do_rebuild, mask_rebuild,
          lambda: {path: jnp.where(per_layer[path], pruned_norm(kernels[path], new_masks[path]),
                                   old_score[path]) for path in old_score},
          lambda: dict(old_score))
    masks = map_layers(lambda layer, path: {**layer, "mask": new_masks[path]}, state.masks)
    flip = map_layers(lambda _, path: flips[path], state.masks)
    # The sparse kernels' updates depend on the rebuild's outputs, so that
    # the optimizer's in-place write of the new params (donated buffers)
    # provably follows the rebuild's read of the old ones. Without a data
    # dependency XLA cannot order the two and copies every sparse kernel
    # before the step to keep the old values for the conditional: two passes
    # over the float32 weights per step (docs/design_notes.md, "The
    # optimizer's updates depend on the rebuild"). `optimization_barrier`
    # does not order them for XLA's copy removal; a data dependency does.
    # Flip rates are fractions, so `after` is always True, but XLA cannot
    # fold it. Scores read the weights too; they are never negative (NaN
    # for NaN weights, which `< 0` leaves True as well).
    # An update that the host says rebuilds nothing reads no weights: no
    # order to keep (None).
    after = None
    if mask_rebuild is not False:
      after = sum(jnp.sum(f) for f in jax.tree.leaves(flip)) >= 0
      if ramp is not None:
        after = after & ~(sum(jnp.sum(s) for s in score.values()) < 0)
    if uses_decay:
      updates = _add_masked_decay(updates, params, stated,
                                  jnp.asarray(decay_fn(step), jnp.float32), after)
    elif after is not None:
      updates = _ordered_after(updates, state.masks, after)
    last = jnp.where(do_rebuild, nxt, state.last_rebuild).astype(jnp.int32)
    if ramp is None:
      active = schedule.sparse(nxt)
      masks = set_active(masks, active)
      masks = _apart(masks, flips)
      return updates, MaskUpdateState(optax.safe_increment(step), masks, flip, last)
    active = _grow(was_active, score, count, schedule.sparse(nxt))
    masks = map_layers(lambda layer, path: {**layer, "active": active[path]}, masks)
    return updates, MaskUpdateState(optax.safe_increment(step), masks, flip, last,
                                    map_layers(lambda _, path: score[path], masks))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _when_rebuilding(do_rebuild: jax.Array, mask_rebuild: bool | None, rebuild: Callable,
                     keep: Callable):
  """`rebuild()` on the updates that rebuild masks, else `keep()`: by a
  conditional on the run-time flag `do_rebuild`, or, where the host said
  which (`mask_update`'s `mask_rebuild`), by tracing only the one that runs."""
  if mask_rebuild is None:
    return jax.lax.cond(do_rebuild, rebuild, keep)
  return rebuild() if mask_rebuild else keep()


def _rebuilt_masks(kernels: dict, old_masks: dict, old_flips: dict, do_rebuild: jax.Array,
                   mask_rebuild: bool | None) -> tuple[dict, dict]:
  """`mask_update`'s rebuild, by layer path: (the masks, the flip rates)
  after the update, rebuilt from `kernels` where `do_rebuild`, else the old
  ones. The fused kernel (`backends.rebuild_where`) skips its work on the
  run-time flag and counts the flips as it rebuilds (no pass over the masks
  for the statistics on a step that rebuilds nothing); the layers it does
  not take (a CPU, or weights it cannot) are rebuilt inside one conditional
  (`_when_rebuilding`). An update that the host knows rebuilds nothing
  (`mask_rebuild=False`) calls no kernel."""
  flagged = {} if mask_rebuild is False else {
      path: backends.rebuild_where(kernels[path], old, do_rebuild)
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

    slow_masks, slow_flips = _when_rebuilding(
        do_rebuild, mask_rebuild, rebuilt,
        lambda: ({path: old_masks[path] for path in slow},
                 {path: old_flips[path] for path in slow}))
    new_masks.update(slow_masks)
    flips.update(slow_flips)
  return new_masks, flips


def pruned_norm(kernel: jax.Array, mask: Mask24) -> jax.Array:
  """`||w * (1 - mask)|| / ||w||` per layer of a stack (float32, the stack's
  axes; 0 for an all-zero weight): the share of a layer's weight norm that
  its 2:4 mask removes, the score by which a `SparsityRamp` orders the
  layers. Chosen because it measures what going 2:4 changes in the layer
  itself, relative to its size, from what every layer has at a rebuild (its
  weights and its new mask): a layer whose weights are already nearly 2:4
  loses little and goes first. Gradient scores would need the loss's
  gradient of the layer's output, which one mini-batch gives noisily, and
  the flip rate says how unsettled a mask is, not what it costs (it is 0
  before the second rebuild)."""
  w = jnp.asarray(kernel).astype(jnp.float32)
  kept = typed_like(Mask24.unpack, w, mask)  # typed like it (Explicit axes)
  sq = w * w
  removed = jnp.sum(jnp.where(kept, 0.0, sq), axis=(-2, -1))
  total = jnp.sum(sq, axis=(-2, -1))
  return jnp.sqrt(jnp.where(total > 0, removed / jnp.where(total > 0, total, 1.0), 0.0))


def _grow(active: Mapping, score: Mapping, count, allowed) -> dict:
  """Per layer path, the flags with enough dense layers made 2:4 for
  `count` 2:4 layers in all, the lowest scores first (ties to the first
  layer in the tree's order, then along the stack), all False where
  `allowed` is False. Flags already True stay True."""
  paths = list(active)
  shapes = [tuple(jnp.shape(active[p])) for p in paths]
  flat_active = jnp.concatenate([jnp.ravel(active[p]) for p in paths])
  flat_score = jnp.concatenate([jnp.ravel(score[p]) for p in paths]).astype(jnp.float32)
  needed = jnp.asarray(count, jnp.int32) - jnp.sum(flat_active, dtype=jnp.int32)
  # Scores lie in [0, 1]: 2 puts the sparse layers after every dense one,
  # 1.5 a NaN score (NaN weights) after every finite one.
  key = jnp.where(flat_active, 2.0, jnp.nan_to_num(flat_score, nan=1.5))
  order = jnp.argsort(key, stable=True)
  rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
  flat = (flat_active | (rank < needed)) & jnp.asarray(allowed, jnp.bool_)
  ends = np.cumsum([int(np.prod(s)) for s in shapes])
  return {p: part.reshape(s) for p, part, s in zip(paths, jnp.split(flat, ends[:-1]), shapes)}


def _select_layers(take_new: jax.Array, new: Mask24, old: Mask24) -> Mask24:
  """Per layer of a stack, `new`'s packed bits where `take_new`, else `old`'s."""
  flag = jnp.reshape(take_new, jnp.shape(take_new) + (1,) * (new.packed.ndim - jnp.ndim(take_new)))
  return dataclasses.replace(new, packed=jnp.where(flag, new.packed, old.packed))


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


def _kernels(masks: Mapping, params: Mapping) -> dict:
  """`{layer path: its dense kernel in params}` over the sparse layers, each
  of its mask's shape (else params of another model: the rebuild would fail
  inside XLA on shapes that do not broadcast)."""
  held = layers_by_path(masks)
  out = {}
  for path, layer_params in entries_by_path(masks, params, "mask_update").items():
    kernel = dense_kernel(layer_params, path, "mask_update")
    want = tuple(held[path]["mask"].shape)
    if tuple(kernel.shape) != want:
      raise ValueError(
          f"mask_update: the kernel of layer {'/'.join(path)!r} has shape"
          f" {tuple(kernel.shape)}, and its mask in the state is for {want}: pass the params of"
          f" the model whose 'sparsity' collection made this state.")
    out[path] = kernel
  return out


def _apart(masks: Mapping, flips: Mapping) -> dict:
  """`masks` with each layer's `"active"` flag made a value of its own, tied
  to the layer's flip rate by a test that never holds (flip rates are
  fractions: not negative, not NaN).

  Without a ramp every layer's flag is one value. On a GPU, XLA writes a
  value that a jitted step returns at three or more places into only some
  of the donated buffers they alias (jax-ml/jax#39625, open): with the
  optimizer state donated, half of a GPT's layers kept the `active` False
  of the dense warm-up for the rest of training, and `compress_params` left
  them dense. Values XLA cannot prove equal are each written."""
  never = {path: flip < 0 for path, flip in flips.items()}
  return map_layers(
      lambda layer, path: layer if layer["active"] is None
      else {**layer, "active": layer["active"] | never[path]}, masks)


def _with_active(masks: Mapping, flags) -> dict:
  """`masks` with every layer's `"active"` replaced by `flags(layer)`."""
  return map_layers(lambda layer, _: {**layer, "active": flags(layer)}, masks)


def _stack_shape(layer: Mapping) -> tuple[int, ...]:
  """The layer's stack axes (`[L]` under nn.scan; `()` for one layer)."""
  return tuple(layer["mask"].shape[:-2])


def _check_updates(updates, params, masks: Mapping) -> None:
  if jax.tree.structure(updates) != jax.tree.structure(params):
    if (isinstance(updates, Mapping) and "params" in updates
        and isinstance(params, Mapping) and "params" not in params):
      raise ValueError(
          f"mask_update: the gradients are of the whole variables (they hold"
          f" {sorted(updates)}); pass the gradients of variables['params'] alone.")
    have = {jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(updates)}
    want = {jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(params)}
    if have == want:
      raise ValueError(
          f"mask_update: the gradients and the params hold the same leaves in containers of"
          f" other types (gradients: {type(updates).__name__}, params:"
          f" {type(params).__name__}, at some level); give both as dicts"
          f" (flax.core.unfreeze) or both as FrozenDicts.")
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
  return map_sparse_kernels(lambda layer, u: _ordered(u, after), layers_by_path(masks),
                            updates)[0]


def _ordered(update: jax.Array, after: jax.Array | None) -> jax.Array:
  """`update` bit for bit, computed from `after` (`_ordered_after`); None:
  `update` itself."""
  return update if after is None else jnp.where(after, update, -update)


def _add_masked_decay(updates, params, masks: Mapping, lam: jax.Array, after: jax.Array):
  """`updates` with `lam * (1 - mask) * kernel` added to every active sparse
  layer's kernel entry (`STATIC_DENSE` layers: none). `after` (always True;
  None where nothing needs ordering) only orders the term after the
  rebuild (see `mask_update`); it enters through the per-layer scale, so the
  elementwise term stays the one XLA fuses. Mapped over the updates tree, so
  its container types (`FrozenDict`) are kept. The mask is expanded in the
  kernel's own layout (`Mask24.unpack`), so XLA fuses the whole term into the
  optimizer's elementwise pass over the kernel: no extra pass over the
  weights per step.
  """

  def add(layer, update, weight):
    active = layer["active"]
    if is_static_dense(active):  # dense this step, as the host stated (`sparse`)
      return _ordered(update, after)
    # One flag per layer (an [L] stack under nn.scan) against [..., K, N].
    on = True if after is None else after
    on = on if active is None else active & on
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
  if isinstance(optimizer, optax.MultiSteps):
    raise TypeError(
        "with_masks: `optimizer` is an optax.MultiSteps, which is no transform itself;"
        " accumulate around the masks instead: optax.MultiSteps(jsparse24.optim.with_masks("
        "optimizer, sparsity, schedule), every_k_schedule).")
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


# The states of optax's optimizers (their moments): a chain whose entries
# before `mask_update` hold one of these feeds it the optimizer's updates.
# Read by name, as optax versions differ in which they define.
_OPTIMIZER_STATES = tuple(getattr(optax, name) for name in (
    "ScaleByAdaDeltaState", "ScaleByAdamState", "ScaleByAdanState", "ScaleByAmsgradState",
    "ScaleByBeliefState", "ScaleByLionState", "ScaleByNovogradState", "ScaleByRStdDevState",
    "ScaleByRmsState", "ScaleByRpropState", "ScaleByRssState", "ScaleBySM3State",
    "TraceState", "FactoredState") if hasattr(optax, name))


def _holds_optimizer_state(tree) -> bool:
  return any(isinstance(node, _OPTIMIZER_STATES) for node in jax.tree_util.tree_leaves(
      tree, is_leaf=lambda n: isinstance(n, _OPTIMIZER_STATES)))


def _check_placement(fn: str, opt_state, path) -> None:
  """Raises where the `mask_update` state at `path` shows the transform
  chained after the optimizer: then it receives the optimizer's updates,
  not the gradients (module docstring), and its decay, added to the step
  itself with the gradient's sign, grows the pruned weights, without a
  word. The state says so: `optax.chain` keeps its transforms' states in a
  tuple, `optax.named_chain` in a dict, both in order. The transform comes
  after the optimizer where, in a chain on its path, an entry before it
  holds an optimizer's state (`_OPTIMIZER_STATES`: Adam's moments, SGD's
  momentum), or where it is the last entry of every chain on its path and
  not the first of one (a plain `optax.sgd` keeps no moments). Other
  containers on the path (`optax.MultiSteps`, `inject_hyperparams`, the
  groups of `optax.multi_transform`: a dict that is an attribute, not a
  chain) are passed through; a container it cannot read makes it say
  nothing. (`optax.chain(clip, mask_update, optimizer)`, which feeds it
  clipped gradients, is accepted.)"""
  node, last, after_others, after_optimizer = opt_state, True, False, False
  via_attribute = False
  for key in path:
    if isinstance(key, jax.tree_util.SequenceKey) and isinstance(node, (tuple, list)):
      entries, index, child = list(node), key.idx, node[key.idx]
    elif (isinstance(key, jax.tree_util.DictKey) and isinstance(node, dict)
          and not via_attribute):  # optax.named_chain's state
      entries, index, child = list(node.values()), list(node).index(key.key), node[key.key]
    elif isinstance(key, jax.tree_util.GetAttrKey):
      node, via_attribute = getattr(node, key.name), True
      continue
    elif isinstance(key, jax.tree_util.DictKey):
      node, via_attribute = node[key.key], False
      continue
    else:
      return
    last &= index == len(entries) - 1
    after_others |= index > 0
    after_optimizer |= any(_holds_optimizer_state(e) for e in entries[:index])
    node, via_attribute = child, False
  if after_optimizer or (last and after_others):
    raise ValueError(
        f"{fn}: the jsparse24.optim.mask_update transform is chained after the"
        f" optimizer (in an optax.chain or named_chain, after the optimizer's"
        f" transform), so it receives the optimizer's updates instead of the gradients"
        f" and adds its decay to the step itself. Chain it first:"
        f" jsparse24.optim.with_masks(optimizer, sparsity, schedule, decay=...),"
        f" or optax.chain(jsparse24.optim.mask_update(...), optimizer).")


def masks(opt_state, sparse: bool | frozenset[str] | None = None) -> dict:
  """The `"sparsity"` collection for the next forward pass, from an optimizer
  state that contains a `mask_update` state (anywhere in a chain).

  `sparse`: None (default) passes the state's `active` flags, which a
  schedule with dense phases keeps as run-time values: the compiled step
  then switches every product at run time (a conditional per product, which
  stalls a GPU; module docstring). A Python bool instead states this step's
  phase for every layer: True gives `"active": None` (2:4), False
  `jsparse24.linen.STATIC_DENSE` (dense, nothing pruned or compressed): no
  switch at all. A `frozenset` of layer names (`layer_names`) states which
  layers are 2:4 this step, the others dense, as the state's flags hold them
  while a `SparsityRamp` mixes the two: `sparse_layers(opt_state)` reads it.
  Either must be the state's own phase, known on the host, with the step
  jitted once per value (a static argument); a value that is not the
  state's runs layers dense or 2:4 against the schedule, unchecked.
  `schedule.phase(i)` gives the bool, and None while a ramp mixes the
  layers; the set changes only on the steps where `schedule.changes(i,
  len(layer_names(opt_state)))`, at most once per layer, so a run compiles
  at most `layers + 1` programs for the ramp:

      @functools.partial(jax.jit, static_argnames="sparse")
      def step(params, opt_state, batch, sparse):
          variables = {"params": params, "sparsity": masks(opt_state, sparse)}
          ...
      n, held = len(layer_names(opt_state)), None
      for i in range(first, steps):
          phase = schedule.phase(i)
          if phase is None:  # a ramp mixes the layers: the set, read where it changes
              if held is None or schedule.changes(i, n):
                  held = sparse_layers(opt_state)
              phase = held
          params, opt_state = step(params, opt_state, batch, sparse=phase)

  Stacked layers (`nn.scan`, an MoE's experts under `nn.vmap`): the set
  names each layer of a stack (`"path[i]"`, `layer_names`). A stack that the
  set holds whole or not at all gets no switch; one partly 2:4 keeps a
  run-time flag per layer of the stack (a constant, sliced by the scan or
  vmap into the switch of each of its products), since the stack traces
  one body for all its layers. With a ramp over stacks, only the steps where a stack
  is partly 2:4 pay that cost, and only for that stack.
  """
  return _with_static_phase(_find_state(opt_state, "masks").masks, sparse, "masks")


def _with_static_phase(held: Mapping, sparse: bool | frozenset[str] | None, fn: str) -> Mapping:
  """The `"sparsity"` collection `held` with its `active` flags replaced by
  the host's statement `sparse` (see `masks`); `held` itself for None."""
  if sparse is None:
    return held
  if isinstance(sparse, frozenset):
    names = _layer_names(held)
    unknown = sorted(sparse - {n for entries in names.values() for n in entries})
    if unknown or not all(isinstance(n, str) for n in sparse):
      raise ValueError(
          f"{fn}: `sparse` names layers the model does not have: {unknown[:5]}; the"
          f" names are those of jsparse24.optim.layer_names(opt_state) (e.g."
          f" {[n for e in names.values() for n in e][:3]}), as"
          f" jsparse24.optim.sparse_layers(opt_state) gives them.")

    def static(layer, path):
      flags = np.array([n in sparse for n in names[path]], bool)
      if flags.all():
        return None
      if not flags.any():
        return STATIC_DENSE
      return flags.reshape(_stack_shape(layer))

    return map_layers(lambda layer, path: {**layer, "active": static(layer, path)}, held)
  if not isinstance(sparse, (bool, np.bool_)):
    raise TypeError(
        f"{fn}: `sparse` must be None, a Python bool (this step's phase, e.g."
        f" schedule.phase(step) on the host) or a frozenset of 2:4 layer names"
        f" (sparse_layers(opt_state) on the host), got {type(sparse).__name__}"
        f" {sparse!r}; a traced value would keep the run-time switch.")
  if sparse:
    return _with_active(held, lambda layer: None)
  return _with_active(held, lambda layer: STATIC_DENSE)


def _layer_names(sparsity: Mapping) -> dict[tuple[str, ...], tuple[str, ...]]:
  """Per layer path, the names of its layers: the `/`-joined path, or
  `path[i]` for each layer of a stack (its stack axes flattened in C
  order, as `SparsityRamp` counts them)."""
  out = {}
  for path, layer in layers_by_path(sparsity).items():
    name, shape = "/".join(path), _stack_shape(layer)
    out[path] = (name,) if not shape else tuple(
        f"{name}[{i}]" for i in range(int(np.prod(shape))))
  return out


def layer_names(opt_state) -> tuple[str, ...]:
  """The names of the model's 2:4 layers, in the tree's order, each layer of
  a stack named `"path[i]"` (flat index over the stack axes): the names that
  `sparse_layers` returns and `masks(opt_state, sparse=frozenset(...))`
  takes. Its length is the `layers` of `SparsityRamp.count` and
  `MaskSchedule.sparse_count`."""
  return tuple(n for names in _layer_names(_find_state(opt_state, "layer_names").masks).values()
               for n in names)


def sparse_layers(opt_state) -> frozenset[str]:
  """The names (`layer_names`) of the layers that are 2:4 in the next step,
  read from the state's flags: one transfer of a few bools to the host,
  which waits for the steps already queued. For a static argument of the
  jitted step (`masks(opt_state, sparse=...)`); read it where
  `schedule.changes(step, layers)` says the set may have changed, not
  every step. Call it outside `jax.jit`."""
  state = _find_state(opt_state, "sparse_layers")
  names = _layer_names(state.masks)
  flags = {path: layer["active"] for path, layer in layers_by_path(state.masks).items()}
  if not all(a is None or _checks.is_concrete(a) for a in flags.values()):
    raise TypeError(
        "sparse_layers: the state's 'active' flags are traced; call it outside jax.jit,"
        " on the state a jitted step returned.")
  # One transfer for every layer's flags (None: always 2:4).
  host = jax.device_get({path: a for path, a in flags.items() if a is not None})
  out = set()
  for path, entries in names.items():
    on = np.ravel(host[path]) if path in host else np.ones(len(entries), bool)
    out.update(n for n, flag in zip(entries, on) if flag)
  return frozenset(out)


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
  """`{"layer/path": {"flip_rate": ..., "sparsity": ...}}` for logging, one
  value per layer (an array over the stack for stacked layers). `sparsity`
  is the layer's state: 0.5 where it is 2:4, 0 where it is dense. With a
  `SparsityRamp`, also `"score"`: the share of its weights' norm that its
  mask removes (`MaskUpdateState.score`), by which the dense layers are
  ordered."""
  state = _find_state(opt_state, "stats")

  def by_path(tree):
    return {"/".join(_checks.path_keys(path)): v
            for path, v in jax.tree_util.tree_leaves_with_path(tree)}

  # Derived from the flags, not kept in the state: a leaf of the state that
  # the update writes without reading is an input that a jitted step drops
  # (`jax.jit`'s `keep_unused=False`), so its output cannot take the donated
  # buffer: a new allocation every step, at a new address.
  sparsity = by_path(map_layers(lambda layer, _: jnp.broadcast_to(
      jnp.where(True if layer["active"] is None else layer["active"], 1 - DENSITY, 0.0),
      _stack_shape(layer)).astype(jnp.float32), state.masks))
  score = {} if state.score is None else by_path(state.score)
  return {path: {"flip_rate": flip, "sparsity": sparsity[path],
                 **({"score": score[path]} if path in score else {})}
          for path, flip in by_path(state.flip_rate).items()}


__all__ = ["MaskSchedule", "MaskUpdateState", "SparsityRamp", "layer_names", "mask_update",
           "masks", "masks_like_kernels", "sparse_layers", "stats", "with_masks"]
