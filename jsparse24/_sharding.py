"""Sharding rules for the products that XLA cannot partition by itself.

The `"pallas"` and `"cusparselt"` products are custom calls (a Pallas kernel,
an FFI call): XLA knows nothing of how they may be split, so under `jax.jit`
with sharded inputs it gathers their operands onto every device and computes
the whole product everywhere. Here they get a rule, through
`jax.experimental.custom_partitioning` (both of XLA's partitioners):

* `rows_parallel`: `y[M, N] = f(x[M, K], *weight_side)` where every row of y
  depends on the same row of x only (a `shard_map` instead where the mesh
  axes are Explicit: there the sharding is part of the types and Pallas
  calls only accept per-device arrays). x and y keep x's sharding of M (any mesh
  axes); x's other axes and every weight-side operand are made whole on each
  device (a sharded weight is gathered first, as XLA does for a dense
  layer's weight under FSDP). That covers data parallelism and FSDP: no
  activation is ever gathered.

* `stack_rows_parallel`: a stack of such products, `y[B, M, N] = f(x[B, M,
  K], *weights[B, ...])` (the experts of a mixture of experts as one call):
  split over B and M, each weight's items split like x's B.

* `rows_contracted`: `dw[K, N] = f(x[M, K], dy[M, N], first_row, ...)`, a
  sum over the rows M (the weight gradient on the sparse tensor cores):
  each device contracts its own rows (`first_row` tells it where they
  start), then one all-reduce of the partial sums (in their dtype) over M's
  mesh axes, as XLA does for a dense `x^T dy`; x split on K or dy on N (tensor
  parallelism) give each device its block of dw. No activation or
  activation gradient is gathered. Under `vmap` of x and dy (stacked
  experts), a `fn` that takes a stack (`stacks=True`) runs once for the
  stack (`stack_rows_contracted`: split over B and M).

* `columns_parallel`: the compress kernels (`w[K, N]` -> compressed values
  and metadata, column by column) keep w's sharding of N: under FSDP with the
  weights left sharded in the step, each device compresses its own columns
  and XLA gathers the compressed arrays for the products, not the weights.

* `Split` and `split_map`: tensor parallelism, where the caller names the
  weight's sharding (`sparse_dot(..., weight_sharding=)`, the layers'
  `kernel_sharding`). Each device prunes and compresses its own block of
  the weight and multiplies by it, in a `shard_map` over the whole mesh:
  a weight sharded on N (column-parallel) gives y sharded on N; one sharded
  on K (row-parallel) takes x sharded on K and sums the partial products
  over K's mesh axes (one all-reduce of y), and `dx` the other way round.
  The compressed arrays of a block are only ever read inside these maps
  (cuSPARSELt's buffers of a block are not a block of the whole weight's
  buffers), so the split is static: under `Auto` mesh axes the weight's
  sharding is unknown when JAX traces, hence the argument. Without it, a
  weight sharded through the product is gathered whole (correct, not
  faster). The reference backend's plain ops need none of this: XLA
  partitions them as it does `nn.Dense` (tests/test_sharding.py, the
  Megatron MLP).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from jsparse24 import _jax_internals

_FACTORS = "abcdefghijlopqrstuvwxyz"  # weight-side factor names (not m, k, n)


def _factor_names():
  """Fresh factor names for a Shardy sharding rule (`a0`, `b0`, ...; never m,
  k or n, which the rules name themselves)."""
  return iter(f"{c}{i}" for i in range(8) for c in _FACTORS)


def _spec_entries(sharding: Any, ndim: int) -> tuple[Any, ...]:
  """The `ndim` entries of `sharding`'s PartitionSpec (None past its end, and
  all None for a sharding without a spec)."""
  spec = tuple(getattr(sharding, "spec", None) or ())
  return spec + (None,) * (ndim - len(spec))


def _rows_spec(sharding: Any, ndim: int) -> P:
  """The spec that keeps `sharding`'s partition of axis 0 and no other."""
  return P(_spec_entries(sharding, 1)[0], *([None] * (ndim - 1)))


def _rule(ranks: tuple[int, ...], outputs: int = 1) -> str:
  """Shardy's rule: x and each result share their first factor, nothing else
  is shared."""
  names = _factor_names()
  operands = ", ".join(" ".join(next(names) for _ in range(r)) if r else "" for r in ranks)
  results = ", ".join(["m n"] + [f"m n{i}" for i in range(1, outputs)])
  return f"m k, {operands} -> {results}" if ranks else f"m k -> {results}"


def _all_batched(axis_size: int, in_batched, args) -> tuple[Any, ...]:
  """A custom_vmap rule's `args` with the unbatched ones broadcast along a
  new leading axis of `axis_size`."""
  return tuple(a if bat else jnp.broadcast_to(a, (axis_size, *a.shape))
               for a, bat in zip(args, in_batched))


def one_call_per_element(call: Callable, axis_size: int, in_batched, args) -> tuple[Any, Any]:
  """A custom_vmap rule's result: `call` once per batch element (`lax.map`),
  unbatched arguments broadcast; every output batched."""
  args = _all_batched(axis_size, in_batched, args)
  out = jax.lax.map(lambda a: call(*a), args)
  return out, jax.tree.map(lambda _: True, out)


@functools.cache
def _wrap(fn: Callable, ranks: tuple[int, ...], outputs: int = 1) -> Callable:

  @custom_partitioning
  def partitioned(x, *operands):
    return fn(x, *operands)

  # custom_partitioning has no batching rule: under vmap, a batch of x
  # against shared operands folds into the rows (one product); batched
  # operands run one product per batch element.
  @jax.custom_batching.custom_vmap
  def call(x, *operands):
    return partitioned(x, *operands)

  @call.def_vmap
  def _batched(axis_size, in_batched, x, *operands):
    _, *ops_batched = in_batched
    if not any(ops_batched):
      b, m = x.shape[0], x.shape[1]
      y = call(x.reshape(b * m, *x.shape[2:]), *operands)
      return jax.tree.map(lambda a: a.reshape(b, m, *a.shape[1:]), y), True
    return one_call_per_element(call, axis_size, in_batched, (x, *operands))

  def out_shardings(mesh, x, result_shape):
    # Each result split like x's rows (`outputs` > 1: a tuple of results).
    shardings = tuple(NamedSharding(mesh, _rows_spec(x.sharding, len(r.shape)))
                      for r in (result_shape if outputs > 1 else (result_shape,)))
    return shardings if outputs > 1 else shardings[0]

  def infer(mesh, arg_shapes, result_shape):
    return out_shardings(mesh, arg_shapes[0], result_shape)

  def partition(mesh, arg_shapes, result_shape):
    x = arg_shapes[0]
    spec = _rows_spec(x.sharding, len(x.shape))
    args = (NamedSharding(mesh, spec),) + tuple(NamedSharding(mesh, P()) for _ in arg_shapes[1:])
    return mesh, fn, out_shardings(mesh, x, result_shape), args

  partitioned.def_partition(infer_sharding_from_operands=infer, partition=partition,
                            sharding_rule=_rule(ranks, outputs))
  return call


def _explicit_mesh(*arrays: jax.Array) -> Any:
  """The mesh of the first of `arrays` whose sharding type has Explicit
  axes, else None."""
  for a in arrays:
    mesh = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
    if is_explicit(mesh):
      return mesh
  return None


def _weight_side_explicit_mesh(*arrays: jax.Array) -> Any:
  """`_explicit_mesh(*arrays)`, or, where none of them is typed with a mesh
  but the context mesh (`jax.set_mesh`) has Explicit axes, that mesh: a
  weight closed over as a constant (frozen) is untyped there. Such arrays
  take the Explicit path too (`whole_on_each_device`): lowered inside
  `custom_partitioning` under an Explicit context mesh, jax 0.12 annotates
  the kernel's own ops with sharding custom calls that the CPU backend
  cannot run (tests/test_sharding.py, the frozen weights of
  `test_explicit_axes_gradient_through_a_computed_activation`)."""
  mesh = _explicit_mesh(*arrays)
  if mesh is not None:
    return mesh
  context = jax.sharding.get_abstract_mesh()
  return context if is_explicit(context) else None


# Set while the library traces products that must not be partitioned
# (`unpartitioned`): a `jax.make_user_context`, so that its value is part of
# jit's cache key.
_UNPARTITIONED = jax.make_user_context(False)


@contextlib.contextmanager
def unpartitioned():
  """Inside, the partitioned wrappers of this module (`rows_parallel`,
  `rows_contracted`, their `stack_` forms, `columns_parallel`,
  `whole_on_each_device`) call their function directly,
  with no sharding rule: for code traced inside another primitive's
  lowering rule (the forward-mode tangent of `backends._autodiff`), where
  JAX lowers out of line, without the device assignment that
  `custom_partitioning` needs, and inside `split_map`'s `shard_map`, whose
  arrays are per-device blocks already. XLA partitions the plain kernels
  there as it does any custom call: it gathers their operands.

  Scope: the `with` block, in the calling thread; internal (the library
  enters it, users never need to). The value is part of `jax.jit`'s cache
  key, so a jitted function (a kernel wrapper) traced outside is traced
  again inside; caches of traced wrappers that jit does not key
  (`functools.cache`d `custom_vmap`s) take `partitioning_off()` as an
  argument."""
  with _UNPARTITIONED(True):
    yield


def partitioning_off() -> bool:
  """Whether `unpartitioned` is in effect. A traced wrapper around
  `rows_parallel` that JAX caches by function (a `functools.cache`d
  `custom_vmap`) must be built per value of this, or a trace from outside
  the context is reused inside it."""
  return bool(_UNPARTITIONED.value)


def rows_parallel(fn: Callable, x: jax.Array, *operands: jax.Array, outputs: int = 1) -> Any:
  """`fn(x, *operands)` (x `[M, K]`, result `[M, N]`; with `outputs` > 1 a
  tuple of that many `[M, .]` results) partitioned over M.

  `fn` must be hashable and stable (a module-level function, or a
  `functools.cache`d closure): one partitioned op is built per `fn` and
  operand ranks. With Explicit mesh axes the sharding is part of x's type,
  so the split is a `shard_map` over x's own partition of M (the kernels
  inside see per-device arrays, as Pallas requires there).
  """
  if partitioning_off():
    return fn(x, *operands)
  mesh = _explicit_mesh(x)
  if mesh is None:
    return _wrap(fn, tuple(a.ndim for a in operands), outputs)(x, *operands)
  rows = _rows_spec(jax.typeof(x).sharding, 2)  # x and the results are all [rows, cols]
  operands = tuple(jax.sharding.reshard(a, NamedSharding(mesh, P())) for a in operands)
  return jax.shard_map(fn, mesh=mesh, in_specs=(rows,) + (P(),) * len(operands),
                       out_specs=(rows,) * outputs if outputs > 1 else rows, check_vma=False)(
                           jax.sharding.reshard(x, NamedSharding(mesh, rows)), *operands)


def _stack_specs(sharding: Any, ranks: tuple[int, ...]) -> tuple[P, tuple[P, ...]]:
  """(x's and the result's spec, the operands' specs) of `stack_rows_parallel`:
  x's partition of its stack axis B and of its rows M kept, its last axis
  whole; each operand split like B on its axis 0, whole on the others."""
  b, m = _spec_entries(sharding, 2)[:2]
  return P(b, m, None), tuple(P(b, *([None] * (r - 1))) for r in ranks)


def _stack_operands_rule(ranks: tuple[int, ...]) -> str:
  """Shardy's factors of a stack's operands (`, b a0 b0, b c0 ...`): each
  shares the stack's factor b on its axis 0, nothing else."""
  names = _factor_names()
  return "".join(", b " + " ".join(next(names) for _ in range(r - 1)) for r in ranks)


@functools.cache
def _wrap_stack(fn: Callable, ranks: tuple[int, ...]) -> Callable:

  @custom_partitioning
  def partitioned(x, *operands):
    return fn(x, *operands)

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    return NamedSharding(mesh, _stack_specs(arg_shapes[0].sharding, ranks)[0])

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    xs, ops = _stack_specs(arg_shapes[0].sharding, ranks)
    args = (NamedSharding(mesh, xs),) + tuple(NamedSharding(mesh, o) for o in ops)
    return mesh, fn, NamedSharding(mesh, xs), args

  partitioned.def_partition(infer_sharding_from_operands=infer, partition=partition,
                            sharding_rule=f"b m k{_stack_operands_rule(ranks)} -> b m n")
  return partitioned


def stack_rows_parallel(fn: Callable, x: jax.Array, *operands: jax.Array) -> jax.Array:
  """`fn(x, *operands)` for a stack of products: x `[B, M, K]`, each operand
  `[B, ...]` (product b's weight-side arrays), result `[B, M, N]`,
  partitioned over B and M: each device runs `fn` on its own items of the
  stack (operand items split like x's, so that sharded experts are never
  gathered) and its own rows of each. `fn` must be hashable and stable, as
  for `rows_parallel`; with Explicit mesh axes the split is a `shard_map`."""
  if partitioning_off():
    return fn(x, *operands)
  ranks = tuple(a.ndim for a in operands)
  mesh = _explicit_mesh(x)
  if mesh is None:
    return _wrap_stack(fn, ranks)(x, *operands)
  xs, ops = _stack_specs(jax.typeof(x).sharding, ranks)
  operands = tuple(jax.sharding.reshard(a, NamedSharding(mesh, o))
                   for a, o in zip(operands, ops))
  return jax.shard_map(fn, mesh=mesh, in_specs=(xs,) + ops, out_specs=xs, check_vma=False)(
      jax.sharding.reshard(x, NamedSharding(mesh, xs)), *operands)


def explicit_sharding(a: jax.Array) -> Any:
  """`a`'s sharding type where its mesh has Explicit axes, else None."""
  return jax.typeof(a).sharding if _explicit_mesh(a) is not None else None


def product_sharding(x: Any, split: "Split | None") -> Any:
  """The sharding type of `x @ W` (x `[M, K]`, an array or its aval) as the
  products make it with Explicit mesh axes: the rows of x's partition of M
  (`rows_parallel`), or the split's M and N (tensor parallelism); None
  (unsharded, the default) elsewhere. For an abstract evaluation, whose
  result must carry the type the evaluated product has."""
  sharding = getattr(x, "sharding", None)
  mesh, spec = ((split.mesh, split.spec("mn")) if split is not None
                else (getattr(sharding, "mesh", None), _rows_spec(sharding, 2)))
  if not is_explicit(mesh):
    return None
  # An aval's sharding names the abstract mesh (a split holds the concrete one).
  return NamedSharding(getattr(mesh, "abstract_mesh", mesh), spec)


def weight_grad_sharding(w: jax.Array, *operands: jax.Array) -> Any:
  """`out_sharding` for a product of `operands` (x, dy) that makes w's
  gradient: w's sharding where its mesh has Explicit axes (there JAX needs
  it to resolve a product contracted over a sharded axis); replicated where
  only the operands are typed with such a mesh (a `w` that is not a sharded
  parameter, e.g. a constant); else None."""
  sharding = explicit_sharding(w)
  if sharding is not None:
    return sharding
  mesh = _explicit_mesh(*operands)
  return None if mesh is None else NamedSharding(mesh, P())


def whole_on_each_device(fn: Callable, *args: jax.Array) -> Any:
  """`fn(*args)` with every argument and result whole on every device: for
  the kernels that prepare a weight (prune, compress), which need all of it.
  With Auto axes XLA gathers a sharded weight for such a call by itself;
  with Explicit axes the call runs in a `shard_map` over replicated specs
  (Pallas calls only accept per-device arrays there)."""
  mesh = _weight_side_explicit_mesh(*args)
  if mesh is None or partitioning_off():
    return fn(*args)
  # Inside a shard_map (its axes Manual) and a vmap over Explicit axes (a
  # stack of experts), the arrays are already each device's: no axis is
  # left to go manual over (jax 0.12.1 refuses such a shard_map).
  if not (set(mesh.axis_names) - set(getattr(mesh, "manual_axes", ()))
          - _jax_internals.vmapped_explicit_axes()):
    return fn(*args)
  args = tuple(jax.sharding.reshard(a, NamedSharding(mesh, P())) for a in args)
  return jax.shard_map(fn, mesh=mesh, in_specs=(P(),) * len(args), out_specs=P(),
                       check_vma=False)(*args)


def _mesh_axes(entry: Any) -> tuple[str, ...]:
  """The mesh axis names of one PartitionSpec entry."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _first_index(axes: tuple[str, ...], per_device: int) -> jax.Array:
  """Inside a partitioned op: the global index of this device's first row
  (or column), for an axis split over mesh `axes` (major to minor),
  `per_device` of them on each device."""
  index = jnp.zeros((), jnp.int32)
  for name in axes:
    index = index * jax.lax.axis_size(name) + jax.lax.axis_index(name)
  return index * per_device


def _contract_local(fn: Callable, axes: tuple[str, ...], col_axes: tuple[str, ...],
                    n_total: int) -> Callable:
  # x [..., M, K], dy [..., M, N]: a stack (`stack_rows_contracted`) leads.
  def local(x, dy, *operands):
    zero = jnp.zeros((), jnp.int32)
    first = _first_index(axes, x.shape[-2]) if axes else zero
    first_col = _first_index(col_axes, dy.shape[-1]) if col_axes else zero
    part = fn(x, dy, first, first_col, n_total, *operands)
    return jax.lax.psum(part, axes) if axes else part
  return local


def _contracted_specs(mesh, x_sharding, dy_sharding, k: int, n: int, align: int):
  """(x's spec, dy's spec, dw's spec) of `rows_contracted`: x and dy keep x's
  rows' partition; x's K and dy's N keep theirs (dw's blocks) where each
  device's share is a multiple of `align` and no mesh axis is used twice."""
  rows = _rows_spec(x_sharding, 2)
  used = set(_mesh_axes(rows[0]))

  def keep(sharding, dim):
    entry = _spec_entries(sharding, 2)[1]
    axes = _mesh_axes(entry)
    if not axes or used & set(axes) or dim % (_axis_size(mesh, entry) * align):
      return None
    used.update(axes)
    return entry
  kx = keep(x_sharding, k)
  ny = keep(dy_sharding, n)
  return P(rows[0], kx), P(rows[0], ny), P(kx, ny)


@functools.cache
def _wrap_contracted(fn: Callable, ranks: tuple[int, ...], align: int, stacks: bool) -> Callable:

  @custom_partitioning
  def partitioned(x, dy, *operands):
    zero = jnp.zeros((), jnp.int32)
    return fn(x, dy, zero, zero, dy.shape[1], *operands)

  # custom_partitioning has no batching rule: a `fn` that takes a stack runs
  # once for the batch (no copy of each element out of its stack); any
  # other, once per batch element.
  @jax.custom_batching.custom_vmap
  def call(x, dy, *operands):
    return partitioned(x, dy, *operands)

  @call.def_vmap
  def _batched(axis_size, in_batched, *args):
    if not stacks:
      return one_call_per_element(call, axis_size, in_batched, args)
    return _one_stacked_call(fn, axis_size, in_batched, args)

  def specs(mesh, arg_shapes):
    x, dy = arg_shapes[:2]
    return _contracted_specs(mesh, x.sharding, dy.sharding, x.shape[1], dy.shape[1], align)

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    return NamedSharding(mesh, specs(mesh, arg_shapes)[2])

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    xs, dys, out = specs(mesh, arg_shapes)
    args = ((NamedSharding(mesh, xs), NamedSharding(mesh, dys))
            + tuple(NamedSharding(mesh, P()) for _ in arg_shapes[2:]))
    local = _contract_local(fn, _mesh_axes(xs[0]), _mesh_axes(dys[1]), arg_shapes[1].shape[1])
    return mesh, local, NamedSharding(mesh, out), args

  names = _factor_names()
  extra = "".join(", " + " ".join(next(names) for _ in range(r)) for r in ranks)
  partitioned.def_partition(infer_sharding_from_operands=infer, partition=partition,
                            sharding_rule=f"m k, m n{extra} -> k n")
  return call


def rows_contracted(fn: Callable, x: jax.Array, dy: jax.Array, *operands: jax.Array,
                    align: int = 1, stacks: bool = False) -> jax.Array:
  """`fn(x, dy, first_row, first_col, n_total, *operands)` (x `[M, K]`, dy
  `[M, N]`, result `[K, N]`, a sum over the rows, all-reduced in its dtype) partitioned over
  M: each device runs `fn` on its own rows (`first_row`: an int32 scalar,
  the global index of its first row; `operands` whole on every device),
  then the partial results are summed over M's mesh axes (one all-reduce).
  Where x is split on K or dy on N (tensor parallelism; each device's share
  a multiple of `align`), each device computes its block of the result
  (`first_col`: the global index of its first column of dy, `n_total`
  (a Python int): dy's whole N). `fn` must be hashable and stable, as for
  `rows_parallel`. `stacks`: `fn` also takes a stack (x `[B, M, K]`, dy
  `[B, M, N]`, each operand `[B, ...]` -> `[B, K, N]`), and under `vmap`
  runs once for it (`stack_rows_contracted`)."""
  if partitioning_off():
    zero = jnp.zeros((), jnp.int32)
    return fn(x, dy, zero, zero, dy.shape[1], *operands)
  mesh = _explicit_mesh(x)
  if mesh is None:
    return _wrap_contracted(fn, tuple(a.ndim for a in operands), align, stacks)(x, dy, *operands)
  if stacks:
    return _explicit_stacks(fn, align)(x, dy, *operands)
  return _explicit_contracted(fn, align, mesh, x, dy, *operands)


@functools.cache
def _explicit_stacks(fn: Callable, align: int) -> Callable:
  """`rows_contracted` on Explicit axes for a `fn` that takes a stack: under
  `vmap`, one `stack_rows_contracted` for the batch, as `_wrap_contracted`
  does on Auto axes. (A `vmap` of the one-item `shard_map` would leave the
  stack's mesh axes out of the manual ones, and `fn` would see them.)"""

  @jax.custom_batching.custom_vmap
  def call(x, dy, *operands):
    return _explicit_contracted(fn, align, _explicit_mesh(x), x, dy, *operands)

  @call.def_vmap
  def _batched(axis_size, in_batched, *args):
    return _one_stacked_call(fn, axis_size, in_batched, args)

  return call


def _one_stacked_call(fn: Callable, axis_size: int, in_batched, args) -> tuple[jax.Array, bool]:
  """A custom_vmap rule's result for a contraction whose `fn` takes a stack:
  one `stack_rows_contracted` for the batch, unbatched arguments broadcast."""
  args = _all_batched(axis_size, in_batched, args)
  return stack_rows_contracted(fn, *args), True


def _explicit_contracted(fn: Callable, align: int, mesh: Any, x: jax.Array, dy: jax.Array,
                         *operands: jax.Array) -> jax.Array:
  """`rows_contracted` of one contraction on an Explicit mesh: a `shard_map`
  over x's rows (and the dw blocks that x's K and dy's N give)."""
  xs, dys, out = _contracted_specs(mesh, jax.typeof(x).sharding, jax.typeof(dy).sharding,
                                   x.shape[1], dy.shape[1], align)
  operands = tuple(jax.sharding.reshard(a, NamedSharding(mesh, P())) for a in operands)
  local = _contract_local(fn, _mesh_axes(xs[0]), _mesh_axes(dys[1]), dy.shape[1])
  return jax.shard_map(local, mesh=mesh, in_specs=(xs, dys) + (P(),) * len(operands),
                       out_specs=out, check_vma=False)(
                           jax.sharding.reshard(x, NamedSharding(mesh, xs)),
                           jax.sharding.reshard(dy, NamedSharding(mesh, dys)), *operands)


def _stack_contracted_specs(sharding: Any, ranks: tuple[int, ...]) -> tuple[P, P, tuple[P, ...]]:
  """(x's and dy's spec, the result's, the operands') of
  `stack_rows_contracted`: `_stack_specs`' for x (and dy) and the operands,
  the result split like B."""
  xs, ops = _stack_specs(sharding, ranks)
  return xs, P(xs[0], None, None), ops


@functools.cache
def _wrap_stack_contracted(fn: Callable, ranks: tuple[int, ...]) -> Callable:

  @custom_partitioning
  def partitioned(x, dy, *operands):
    zero = jnp.zeros((), jnp.int32)
    return fn(x, dy, zero, zero, dy.shape[-1], *operands)

  @jax.custom_batching.custom_vmap
  def call(x, dy, *operands):
    return partitioned(x, dy, *operands)

  @call.def_vmap
  def _batched(axis_size, in_batched, *args):
    return one_call_per_element(call, axis_size, in_batched, args)

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    return NamedSharding(mesh, _stack_contracted_specs(arg_shapes[0].sharding, ranks)[1])

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    xs, out, ops = _stack_contracted_specs(arg_shapes[0].sharding, ranks)
    args = ((NamedSharding(mesh, xs),) * 2 + tuple(NamedSharding(mesh, o) for o in ops))
    local = _contract_local(fn, _mesh_axes(xs[1]), (), arg_shapes[1].shape[-1])
    return mesh, local, NamedSharding(mesh, out), args

  partitioned.def_partition(infer_sharding_from_operands=infer, partition=partition,
                            sharding_rule=f"b m k, b m n{_stack_operands_rule(ranks)} -> b k n")
  return call


def stack_rows_contracted(fn: Callable, x: jax.Array, dy: jax.Array,
                          *operands: jax.Array) -> jax.Array:
  """`fn(x, dy, first_row, first_col, n_total, *operands)` for a stack of
  contractions: x `[B, M, K]`, dy `[B, M, N]`, each operand `[B, ...]`,
  result `[B, K, N]` (item b the sum over the rows of x[b] and dy[b]),
  partitioned over B and M: each device runs `fn` on its own items of the
  stack (operands split like x's B) and its own rows of each, then the
  partial sums are all-reduced over M's mesh axes. K and N are kept whole
  (`first_col` is 0, `n_total` dy's N). `fn` must be hashable and stable,
  as for `rows_parallel`."""
  if partitioning_off():
    zero = jnp.zeros((), jnp.int32)
    return fn(x, dy, zero, zero, dy.shape[-1], *operands)
  ranks = tuple(a.ndim for a in operands)
  mesh = _explicit_mesh(x)
  if mesh is None:
    return _wrap_stack_contracted(fn, ranks)(x, dy, *operands)
  xs, out, ops = _stack_contracted_specs(jax.typeof(x).sharding, ranks)
  operands = tuple(jax.sharding.reshard(a, NamedSharding(mesh, o))
                   for a, o in zip(operands, ops))
  local = _contract_local(fn, _mesh_axes(xs[1]), (), dy.shape[-1])
  return jax.shard_map(local, mesh=mesh, in_specs=(xs, xs) + ops, out_specs=out,
                       check_vma=False)(
                           jax.sharding.reshard(x, NamedSharding(mesh, xs)),
                           jax.sharding.reshard(dy, NamedSharding(mesh, xs)), *operands)


def _axis_size(mesh, entry) -> int:
  """The number of devices over the mesh axes of a spec `entry` (a name, a
  tuple of names, or None: 1)."""
  size = 1
  for name in _mesh_axes(entry):
    size *= mesh.shape[name]
  return size


def _vmapped(fn: Callable, times: int) -> Callable:
  """`fn` vmapped over `times` leading axes of every argument and result."""
  for _ in range(times):
    fn = jax.vmap(fn)
  return fn


@functools.cache
def _wrap_columns(fn: Callable, n_dims: tuple[int, ...], align: int,
                  extra_ranks: tuple[int, ...], lead: int = 0,
                  k_dims: tuple | None = None, extra_k_dims: tuple | None = None) -> Callable:
  """`fn(w[K, N], *extras)` (extras: arrays of these ranks whose axis 0 runs
  over N, e.g. a packed mask `[N, K/8]` or per-column flags `[N]`) ->
  outputs whose axis `n_dims[i]` runs over N (or a fixed fraction of it),
  partitioned over w's sharding of N where each device's share is a
  multiple of `align`. With `lead` > 0 every operand and output has that
  many leading (stack) axes more, which `fn` is vmapped over inside the one
  partitioned call (a Pallas call's vmap is one call with a larger grid:
  no per-layer slices of the stack); they are kept whole on each device.

  `k_dims` (None: K is never split): for a `fn` whose results are row-local
  too (the mask kernels), w's sharding of K is kept where each device's
  share is a multiple of 8 (whole packed-mask bytes): per output, the axis
  that runs over K, None (none), or "sum" (a total over K: summed over K's
  mesh axes on each device); `extra_k_dims` the same for the extras."""
  inner = _vmapped(fn, lead)
  stack = [None] * lead

  @custom_partitioning
  def partitioned(w, *extras):
    return inner(w, *extras)

  def entries(mesh, w_sharding, shape):
    spec = _spec_entries(w_sharding, lead + 2)

    def fit(entry, dim, a):
      size = _axis_size(mesh, entry) if entry is not None else 1
      return entry if entry is not None and dim % (size * a) == 0 else None
    n = fit(spec[lead + 1], shape[lead + 1], align)
    k = fit(spec[lead], shape[lead], 8) if k_dims is not None else None
    return k, n

  def place(mesh, ndim, n_dim, k_dim, k, n):
    parts = [None] * ndim
    if n_dim is not None:
      parts[lead + n_dim] = n
    if isinstance(k_dim, int):
      parts[lead + k_dim] = k
    return NamedSharding(mesh, P(*parts))

  def out_shardings(mesh, k, n, shapes):
    kd = k_dims or (None,) * len(n_dims)
    return tuple(place(mesh, len(s.shape), d, e, k, n) for s, d, e in zip(shapes, n_dims, kd))

  def local(k):
    if k is None or "sum" not in (k_dims or ()):
      return inner
    axes = _mesh_axes(k)

    def run(*args):
      outs = inner(*args)
      return type(outs)(jax.lax.psum(o, axes) if d == "sum" else o
                        for o, d in zip(outs, k_dims))
    return run

  def infer(mesh, arg_shapes, result_shape):
    k, n = entries(mesh, arg_shapes[0].sharding, arg_shapes[0].shape)
    return out_shardings(mesh, k, n, result_shape)

  def partition(mesh, arg_shapes, result_shape):
    k, n = entries(mesh, arg_shapes[0].sharding, arg_shapes[0].shape)
    ekd = extra_k_dims or (None,) * len(extra_ranks)
    args = (NamedSharding(mesh, P(*stack, k, n)),) + tuple(
        place(mesh, lead + r, 0, e, k, n) for r, e in zip(extra_ranks, ekd))
    return mesh, local(k), out_shardings(mesh, k, n, result_shape), args

  names = _factor_names()
  stack_names = "".join(next(names) + " " for _ in range(lead))
  outs = ", ".join(stack_names + " ".join(next(names) for _ in range(2)) for _ in n_dims)
  extras = "".join(", " + stack_names + " ".join(["n"] + [next(names) for _ in range(r - 1)])
                   for r in extra_ranks)
  partitioned.def_partition(infer_sharding_from_operands=infer, partition=partition,
                            sharding_rule=f"{stack_names}k n{extras} -> {outs}")

  # custom_partitioning has no batching rule: stacked weights (vmap, e.g. a
  # mixture of experts' kernels) are one more leading stack axis, `fn`
  # vmapped over it inside one partitioned call (one Pallas call with a
  # larger grid), rather than a loop that copies each weight out of its
  # stack and each result into one.
  @jax.custom_batching.custom_vmap
  def call(w, *extras):
    return partitioned(w, *extras)

  @call.def_vmap
  def _batched(axis_size, in_batched, *args):
    args = _all_batched(axis_size, in_batched, args)
    stacked = _wrap_columns(fn, n_dims, align, extra_ranks, lead + 1, k_dims, extra_k_dims)
    out = stacked(*args)
    return out, jax.tree.map(lambda _: True, out)

  return call


def columns_parallel(fn: Callable, n_dims: tuple[int, ...], align: int, w: jax.Array,
                     *extras: jax.Array, lead: int = 0, k_dims: tuple | None = None,
                     extra_k_dims: tuple | None = None) -> Any:
  """`fn(w[K, N], *extras)` (the compress kernels: each column of `w` is
  pruned and compressed on its own) with w's sharding of N kept: each device
  compresses its own columns, and the (half-size) compressed outputs are
  what XLA gathers for a product that needs them whole, not `w`. `n_dims`:
  the axis of each 2-D output that runs over N; `extras`: arrays whose axis
  0 runs over N (a packed mask `[N, K/8]`, per-column flags `[N]`), sharded
  like w's N. A sharding of N that does not leave each device a multiple of
  `align` columns is gathered first, as is K's. `lead`: leading stack axes
  of w, the extras and the outputs (`fn` is vmapped over them in one call).
  `k_dims`, `extra_k_dims`: for the mask kernels, whose results are
  row-local too: w's sharding of K kept as well (`_wrap_columns`), so that
  a row-parallel weight (tensor parallelism) is not gathered either.
  (Auto mesh axes; with Explicit ones see `whole_on_each_device`.)"""
  if partitioning_off():
    return _vmapped(fn, lead)(w, *extras)
  if _weight_side_explicit_mesh(w, *extras) is not None:
    return whole_on_each_device(_vmapped(fn, lead), w, *extras)
  return _wrap_columns(fn, tuple(n_dims), align, tuple(e.ndim - lead for e in extras),
                       lead, k_dims, extra_k_dims)(w, *extras)


# --- tensor parallelism: a static split of the weight --------------------------


@dataclasses.dataclass(frozen=True)
class Split:
  """How one product is split over a mesh (static): the mesh axes of x's
  rows `m`, of the weight's K (`k`) and N (`n`); each a tuple of mesh axis
  names, major to minor, () for none."""

  mesh: Any
  m: tuple[str, ...]
  k: tuple[str, ...]
  n: tuple[str, ...]

  def entry(self, role: str) -> Any:
    """The PartitionSpec entry of one axis role: 'm', 'k', 'n', or '.' (whole)."""
    axes = getattr(self, role) if role in "mkn" else ()
    return (axes[0] if len(axes) == 1 else axes) if axes else None

  def spec(self, roles: str) -> P:
    """The PartitionSpec of an array whose axes play `roles` (e.g. "nk")."""
    return P(*(self.entry(r) for r in roles))

  def size(self, role: str) -> int:
    return _axis_size(self.mesh, getattr(self, role))


def weight_split(fn: str, sharding: Any, rows: int, k: int, n: int,
                 align: tuple[int, int], backend: str, warn: bool = True,
                 arg: str = "weight_sharding") -> Split:
  """The `Split` of a product of `rows` rows by a `[K, N]` weight laid out
  as `sharding` (a `NamedSharding` of the weight), checked: each device's
  block must keep `align = (along K, along N)` (whole 4-groups and packed
  mask bytes; cuSPARSELt's 64 x 64 minimum). x's rows are split over the
  mesh axes the weight does not use, where they divide evenly (else each
  device takes all rows, with a warning). `fn`, `arg`: the caller and its
  argument's name, for errors."""
  if not isinstance(sharding, NamedSharding):
    raise TypeError(f"{fn}: `{arg}` must be a jax.sharding.NamedSharding of the"
                    f" [K, N] weight (mesh and PartitionSpec), got {type(sharding).__name__}.")
  spec = _spec_entries(sharding, 2)
  if len(spec) != 2:
    raise ValueError(f"{fn}: `{arg}` has the PartitionSpec {sharding.spec} of"
                     f" {len(spec)} axes; the weight is [K, N] (2 axes).")
  mesh = sharding.mesh
  k_axes, n_axes = _mesh_axes(spec[0]), _mesh_axes(spec[1])
  for name, axes, dim, a in (("K", k_axes, k, align[0]), ("N", n_axes, n, align[1])):
    parts = _axis_size(mesh, axes)
    if dim % parts or (dim // parts) % a:
      raise ValueError(
          f"{fn}: `{arg}` {sharding.spec} splits {name} = {dim} over mesh axes"
          f" {axes} ({parts} devices): the {backend!r} backend needs each device's share"
          f" of {name} to be a multiple of {a}, got {dim / parts:g}. Shard fewer ways,"
          f" or pass {arg}=None (the weight is then gathered for the product).")
  used = set(k_axes) | set(n_axes)
  m_axes = tuple(a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1)
  if m_axes and rows % _axis_size(mesh, m_axes):
    if warn:
      warnings.warn(
          f"{fn}: {rows} rows of x do not divide over mesh axes {m_axes}"
          f" ({_axis_size(mesh, m_axes)} devices); every device of them"
          f" multiplies all rows.", stacklevel=4)
    m_axes = ()
  return Split(mesh, m_axes, k_axes, n_axes)


def split_map(split: Split, fn: Callable, in_roles: Any, out_roles: Any, *args: Any) -> Any:
  """`fn` on each device's blocks of `args`, under `shard_map` over the whole
  mesh. `in_roles` / `out_roles`: pytrees like the arguments / results with
  a roles string per array (one letter per axis, `Split.spec`). Inside, the
  products call their kernels directly (`unpartitioned`): the arrays are
  per-device blocks already."""
  spec = lambda roles: jax.tree.map(split.spec, roles)  # noqa: E731
  mapped = jax.shard_map(fn, mesh=split.mesh, in_specs=spec(tuple(in_roles)),
                         out_specs=spec(out_roles), check_vma=False)
  if is_explicit(split.mesh):
    # Explicit axes: the sharding is part of the types, which must match.
    args = jax.tree.map(lambda a, r: jax.sharding.reshard(a, NamedSharding(split.mesh,
                                                                         split.spec(r))),
                        tuple(args), tuple(in_roles))
  with unpartitioned():
    # Under jit (inlined there) the arguments are resharded to the specs as
    # needed; called eagerly, shard_map itself would refuse unsharded arrays.
    return jax.jit(mapped)(*args)


def is_explicit(mesh: Any) -> bool:
  """Whether `mesh` (None allowed) has Explicit axes (sharding in types)."""
  explicit = getattr(jax.sharding.AxisType, "Explicit", None)
  return (mesh is not None and not getattr(mesh, "empty", True) and explicit is not None
          and explicit in tuple(getattr(mesh, "axis_types", ())))


def typed_like(fn: Callable, like: jax.Array, *args: Any) -> jax.Array:
  """`fn(*args)`, an array shaped like `like`: with Explicit mesh axes it
  runs with the axes made Auto (XLA partitions its reshapes as it would
  there) and comes out typed with `like`'s sharding (e.g. a mask unpacked
  next to its sharded weight); elsewhere `fn(*args)`."""
  sharding = explicit_sharding(like)
  if sharding is None:
    return fn(*args)
  return jax.sharding.auto_axes(fn, out_sharding=sharding)(*args)


def psum_over(y: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """`y` summed over mesh `axes` (inside `split_map`); itself where none."""
  return jax.lax.psum(y, axes) if axes else y
