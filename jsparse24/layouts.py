"""Where a 2:4 model's training state lives on a mesh, layout by layout.

One `jax.jit` train step serves every layout; the layout is only in the
shardings of the state it is given and keeps (`Layout.state_shardings`, for
`jax.jit(init, out_shardings=...)` and the step's `out_shardings`), the
constraints inside the step (`Layout.constrain`) and the 2:4 layers'
`kernel_sharding` (`Layout.kernel_sharding`). The masks follow their kernels
(`jsparse24.optim.masks_like_kernels`). `LAYOUTS`:

* `"data"`: each batch split over the mesh's `data` axis; params and
  optimizer state replicated. The 2:4 layers' `kernel_sharding` says so
  (the kernel whole, x's rows split): the automatic choice of each
  product's backend then sees the rows one device multiplies.
* `"fsdp"`: every array of the state sharded over `data` at rest (its last
  axis, where it divides), gathered whole inside the step for the products,
  gradients reduce-scattered. The 2:4 kernels stay sharded in the step: each
  device prunes and compresses its own columns and the compressed arrays are
  gathered (half the bytes of the weights, a 1/n share of the work).
* `"tp"`: Megatron tensor parallelism of the layers that `tensor_parallel`
  names on a `data x model` mesh: a `"column"` layer's kernel `[K, N]`
  sharded on N over `model` (its outputs), a `"row"` layer's on K (its
  inputs; its partial products are summed over `model`), their optimizer
  state alike, everything else replicated; each batch split over `data`.
  The 2:4 layers take the same sharding as `kernel_sharding`: each device
  prunes, compresses and multiplies its own block. (XLA partitions a dense
  `nn.Dense` the same way from its kernel's sharding alone.)
* `"2d"`: both: the named layers tensor parallel over `model` as in `"tp"`,
  and FSDP over `data`: every array sharded over `data` at rest (the
  tensor-parallel kernels on their other axis: column `P("data", "model")`,
  row `P("model", "data")`), gathered over `data` only inside the step.

Stacked layers (`nn.scan`'s `[L, K, N]` kernels) are laid out on their
trailing two axes. `tensor_parallel` rules are regexes of layer paths, as
`jsparse24.sparsify`'s: a rule matches a kernel of params or of the optimizer
state (an AdamW moment) when it fully matches the end of the kernel's layer
path (`"blocks/up"` matches `"blocks/up/kernel"` and
`"1/0/mu/blocks/up/kernel"`).

Example (tensor parallelism over 1 device, to run anywhere):

  >>> import jax, jax.numpy as jnp
  >>> from jsparse24 import layouts
  >>> mesh = layouts.make_mesh("tp", jax.devices()[:1])
  >>> layout = layouts.Layout("tp", mesh, {r".*/up": "column", r".*/down": "row"})
  >>> params = {"mlp": {"up": {"kernel": jnp.zeros((8, 32))},
  ...                   "down": {"kernel": jnp.zeros((32, 8))}}}
  >>> [s.spec for s in jax.tree.leaves(layout.state_shardings(params))]
  [P('model', None), P(None, 'model')]
  >>> layout.kernel_sharding("column").spec
  P(None, 'model')
  >>> layouts.Layout("data", layouts.make_mesh("data", jax.devices()[:1])).kernel_sharding("row").spec
  P(None, None)
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jsparse24._checks import is_kernel, layer_name, path_keys

LAYOUTS = ("data", "fsdp", "tp", "2d")
ROLES = ("column", "row")
# Megatron tensor parallelism of a `[K, N]` kernel: column-parallel splits its
# outputs N, row-parallel its inputs K.
TP_SPECS = {"column": P(None, "model"), "row": P("model", None)}
# "2d" at rest: FSDP over `data` on the axis that tensor parallelism leaves.
TP_FSDP_SPECS = {"column": P("data", "model"), "row": P("model", "data")}


def make_mesh(layout: str, devices: Sequence[Any] | None = None,
              model_devices: int | None = None) -> Mesh:
  """The mesh of `layout` over `devices` (default: `jax.devices()`, every
  process's). `"data"`, `"fsdp"`: 1-D, axis `data`. `"tp"`, `"2d"`: `data x
  model` with `model_devices` on `model` (default: all of them for `"tp"`,
  2 for `"2d"`); `model` runs over consecutive devices, which
  `jax.devices()` lists process by process, so it stays within a host where
  it fits."""
  _check_layout("make_mesh", layout)
  devices = np.array(jax.devices() if devices is None else list(devices))
  # A mesh of none failed at the first sharding (a modulo by zero), one that
  # lists a device twice inside device_put (a bare AssertionError).
  if not devices.size:
    raise ValueError("make_mesh: `devices` is empty; pass jax.devices() or a part of it.")
  if len(set(devices.flat)) != devices.size:
    raise ValueError(f"make_mesh: `devices` lists a device more than once"
                     f" ({devices.size} entries, {len(set(devices.flat))} devices); pass each"
                     f" device once.")
  if layout not in ("tp", "2d"):
    if model_devices not in (None, 1):
      raise ValueError(f"make_mesh: model_devices={model_devices} applies to the layouts 'tp'"
                       f" and '2d' only (got layout={layout!r}); leave it None.")
    return Mesh(devices, ("data",))
  model = model_devices if model_devices is not None else (devices.size if layout == "tp" else 2)
  if isinstance(model, bool) or not isinstance(model, (int, np.integer)) or model < 1 or (
      devices.size % model):
    raise ValueError(f"make_mesh: model_devices={model} must divide the {devices.size} devices"
                     f" (layout {layout!r}); pass a divisor of {devices.size}.")
  return Mesh(devices.reshape(-1, model), ("data", "model"))


def _check_layout(fn: str, layout: str) -> None:
  if layout not in LAYOUTS:
    raise ValueError(f"{fn}: unknown layout {layout!r}; expected one of {LAYOUTS}.")


def _kernel_paths(tree) -> list:
  """The key paths of `tree`'s leaves named "kernel"."""
  return [path for path, _ in jax.tree_util.tree_leaves_with_path(tree) if is_kernel(path)]


def _trailing(spec: P, ndim: int) -> P:
  """`spec` of a `[K, N]` kernel on the trailing axes of an `ndim` array
  (a stack of kernels keeps its stack axes whole)."""
  return P(*([None] * (ndim - len(spec))), *spec)


@dataclasses.dataclass(frozen=True)
class Layout:
  """A layout (`LAYOUTS`) on a mesh (`make_mesh`).

  Attributes:
    name: one of `LAYOUTS`.
    mesh: axis `data`, and `model` for `"tp"` and `"2d"`.
    tensor_parallel: `{layer path regex: "column" | "row"}` (or pairs): the
      layers whose kernels `"tp"` and `"2d"` split over `model` (Megatron's
      MLP: `up` column, `down` row). Ignored by `"data"` and `"fsdp"`.
  """

  name: str
  mesh: Mesh
  tensor_parallel: Any = ()

  def __post_init__(self):
    _check_layout("Layout", self.name)
    given = self.tensor_parallel if self.tensor_parallel is not None else ()
    rules = tuple(given.items() if isinstance(given, Mapping) else given)
    for entry in rules:
      if (not isinstance(entry, (tuple, list)) or len(entry) != 2
          or not isinstance(entry[0], str)):
        raise TypeError(f"Layout: tensor_parallel must be a {{layer path regex: role}} mapping or"
                        f" (regex, role) pairs, got the entry {entry!r} of {given!r}.")
      rule, role = entry
      if role not in ROLES:
        raise ValueError(f"Layout: tensor_parallel rule {rule!r} has role {role!r}; expected"
                         f" one of {ROLES}.")
      try:
        re.compile(rule)
      except re.error as e:
        raise ValueError(f"Layout: tensor_parallel rule {rule!r} is not a valid regex: {e}.") from e
    object.__setattr__(self, "tensor_parallel", tuple((rule, role) for rule, role in rules))
    want = ("data", "model") if self.name in ("tp", "2d") else ("data",)
    if tuple(self.mesh.axis_names) != want:
      raise ValueError(f"Layout: layout {self.name!r} needs a mesh with axes {want}, got"
                       f" {tuple(self.mesh.axis_names)}; make it with make_mesh({self.name!r}).")
    if self.name in ("tp", "2d") and not rules:
      raise ValueError(f"Layout: layout {self.name!r} splits the layers that tensor_parallel"
                       f" names, and it names none; pass e.g. {{r'.*/up': 'column',"
                       f" r'.*/down': 'row'}}.")

  @property
  def batch_sharding(self) -> NamedSharding:
    """A batch's: its rows split over `data`."""
    return NamedSharding(self.mesh, P("data"))

  def role(self, path) -> str | None:
    """`"column"` or `"row"` where `path` (a key path into params or
    optimizer state) ends at the kernel of a tensor-parallel layer; else
    None (also for `"data"` and `"fsdp"`)."""
    rule = self._rule(path)
    return None if rule is None else self.tensor_parallel[rule][1]

  def _rule(self, path) -> int | None:
    """The index of the first tensor-parallel rule that matches the layer
    whose kernel `path` ends at (a rule matches the layer's path or any
    tail of it); None elsewhere, and under `"data"` and `"fsdp"`."""
    layer = path_keys(path)[:-1]
    if self.name not in ("tp", "2d") or not layer or not is_kernel(path):
      return None
    for i, (rule, _) in enumerate(self.tensor_parallel):
      if any(re.fullmatch(rule, "/".join(layer[j:])) for j in range(len(layer))):
        return i
    return None

  def _fsdp_spec(self, a) -> P:
    """FSDP at rest: the last axis over `data` where it divides (a Python
    scalar, such as a `TrainState`'s step, stays whole)."""
    shape = a.shape if hasattr(a, "shape") else np.shape(a)
    if len(shape) >= 1 and shape[-1] % self.mesh.shape["data"] == 0:
      return P(*([None] * (len(shape) - 1)), "data")
    return P()

  def state_spec(self, path, a) -> P:
    """Where the array `a` at `path` of the train state (params, optimizer
    state) lives between steps."""
    role = self.role(path)
    if self.name == "fsdp":
      return self._fsdp_spec(a)
    if self.name == "tp":
      return _trailing(TP_SPECS[role], a.ndim) if role else P()
    if self.name == "2d":
      return _trailing(TP_FSDP_SPECS[role], a.ndim) if role else self._fsdp_spec(a)
    return P()

  def state_sharding(self, path, a) -> NamedSharding:
    """`state_spec` on this layout's mesh."""
    return NamedSharding(self.mesh, self.state_spec(path, a))

  def state_shardings(self, tree):
    """The `NamedSharding` of every array of `tree` (arrays or
    `jax.eval_shape`'s shapes): the `out_shardings` to make the state in
    (`jax.jit(tx.init, out_shardings=...)`) and to keep it in (the train
    step's). Lay the masks out after with `masks_like_kernels`.

    Under `"tp"` and `"2d"`, where `tree` holds kernels, each
    `tensor_parallel` rule must match one of them: a rule that matches none
    (a typo, `.../kernel` in the rule) would leave its layers replicated."""
    shardings = jax.tree_util.tree_map_with_path(self.state_sharding, tree)
    if self.name in ("tp", "2d"):
      kernels = _kernel_paths(tree)
      used = {self._rule(path) for path in kernels}
      unused = [rule for i, (rule, _) in enumerate(self.tensor_parallel) if i not in used]
      if kernels and unused:
        layers = sorted({layer_name(path) for path in kernels})
        raise ValueError(
            f"Layout.state_shardings: tensor_parallel rule(s) {unused} match no kernel of the"
            f" tree; a rule fully matches a layer's path or a tail of it, without '/kernel'"
            f" (e.g. r'mlp/up'). The tree's layers: {layers[:12]}"
            f"{' ...' if len(layers) > 12 else ''}.")
      for path, a in jax.tree_util.tree_leaves_with_path(tree):
        rule = self._rule(path)
        if rule is not None:
          self._check_split(path, a, *self.tensor_parallel[rule])
    return shardings

  def _check_split(self, path, a, rule: str, role: str) -> None:
    """Raises where the mesh axes of a tensor-parallel kernel's `state_spec`
    (its `rule` and `role`) do not divide its axes: JAX's IndivisibleError
    at `device_put` or `jit` named neither the layer nor the rule."""
    shape = a.shape if hasattr(a, "shape") else np.shape(a)
    for size, axis in zip(shape, self.state_spec(path, a)):
      if axis is None:
        continue
      count = math.prod(self.mesh.shape[n] for n in (axis if isinstance(axis, tuple) else (axis,)))
      if size % count:
        raise ValueError(
            f"Layout.state_shardings: the kernel of layer {layer_name(path)!r}"
            f" {tuple(shape)} is split over {count} devices of mesh axis {axis!r} along an axis"
            f" of {size} ({self.name!r}, tensor_parallel rule {rule!r}: {role!r}), which"
            f" {count} does not divide; give the layer a width that {count} divides, or leave"
            f" it out of tensor_parallel.")

  def step_spec(self, path, a, sparse_kernel: bool = False) -> P | None:
    """The sharding a param is constrained to inside the step, for the
    products; None: as it is at rest. `sparse_kernel`: the kernel of a 2:4
    layer, left sharded under FSDP (each device compresses its own columns,
    the compressed arrays are gathered: half the bytes, 1/n of the work)."""
    if self.name == "fsdp":
      return None if sparse_kernel else P()
    if self.name == "2d":
      role = self.role(path)
      if role:
        return _trailing(TP_SPECS[role], a.ndim)  # gathered over `data` only
      return None if sparse_kernel else P()
    return None

  def constrain(self, params, sparse_layers: Collection[str] = ()):
    """`params` constrained to their `step_spec` (inside the jitted step,
    before the model reads them). `sparse_layers`: the 2:4 layers' paths in
    `params` (`"blocks/up"`; `jsparse24.optim.stats(opt_state)` keys them
    so)."""

    if isinstance(sparse_layers, str):  # its characters were taken as the layers' names
      raise TypeError(f"Layout.constrain: sparse_layers must be a collection of layer paths,"
                      f" got the string {sparse_layers!r}; pass [{sparse_layers!r}].")
    # A layer of a stack (nn.scan) is named with its index by
    # `optim.sparse_layers` ("blocks/up[0]"): its stacked kernel is the one
    # array of all of them.
    named = {re.sub(r"\[\d+\]$", "", name) for name in sparse_layers}
    layers = {layer_name(path) for path in _kernel_paths(params)}
    if named - layers:
      raise ValueError(
          f"Layout.constrain: sparse_layers names {sorted(named - layers)}, which `params` has no"
          f" kernel for; name the 2:4 layers by their paths in params (\"blocks/up\", as"
          f" jsparse24.optim.stats(opt_state) keys them), and pass variables['params'].")

    def constrain(path, a):
      sparse = is_kernel(path) and layer_name(path) in named
      spec = self.step_spec(path, a, sparse)
      return a if spec is None else jax.lax.with_sharding_constraint(
          a, NamedSharding(self.mesh, spec))

    return jax.tree_util.tree_map_with_path(constrain, params)

  def kernel_sharding(self, role: str) -> NamedSharding | None:
    """The `kernel_sharding` of a 2:4 layer of `role` (`"column"`,
    `"row"`): its `[K, N]` kernel's split over `model` under `"tp"` and
    `"2d"`; under `"data"` the kernel whole on every device, so that x's
    rows split over `data` and each device's product, and the automatic
    choice of its backend, sees that device's rows (a layer that gains at
    16k rows on one GPU may lose at 4k rows on each of four); None under
    `"fsdp"`, whose 2:4 kernels stay sharded into the step (each device
    compresses its own columns)."""
    if role not in ROLES:
      raise ValueError(f"Layout.kernel_sharding: role={role!r}; expected one of {ROLES}.")
    if self.name == "data":
      return NamedSharding(self.mesh, P(None, None))
    if self.name == "fsdp":
      return None
    return NamedSharding(self.mesh, TP_SPECS[role])


__all__ = ["LAYOUTS", "Layout", "ROLES", "TP_FSDP_SPECS", "TP_SPECS", "make_mesh"]
