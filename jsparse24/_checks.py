"""Argument checks shared by the public functions.

Every check raises at trace time with a message that names the function, the
argument and what was expected, so that bad input never reaches XLA.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)


def is_concrete(x: Any) -> bool:
  """True when `x` holds values now (not a tracer inside jit/grad/vmap)."""
  return not isinstance(x, jax.core.Tracer)


def path_keys(path) -> tuple[str, ...]:
  """The keys of a `jax.tree_util` key path as strings (`("blocks", "up",
  "kernel")`): how errors name a layer and how rules and layouts match it."""
  return tuple(jax.tree_util.keystr((k,), simple=True) for k in path)


def is_kernel(path) -> bool:
  """True where key path `path` ends at a leaf named `"kernel"`: a layer's
  weight (`nn.Dense`'s, a stack's `[L, K, N]`, experts' `[E, K, N]`), the
  leaves that masks, layouts and rules are about."""
  return path_keys(path)[-1:] == ("kernel",)


def layer_name(path) -> str:
  """The path of the layer that holds the variable at key path `path`
  (`"blocks/up"` for `.../blocks/up/kernel`): how errors name and
  layouts match a layer, as `optim.stats` keys it."""
  return "/".join(path_keys(path)[:-1])


def check_dense_array(fn: str, name: str, x: Any) -> None:
  """Raises for a jsparse24 container (or any non-array) where a dense array
  is expected, naming what was passed instead."""
  kind = type(x).__name__  # by name: _format (Sparse24, Mask24) imports this module
  if kind == "Sparse24":
    raise TypeError(f"{fn}: `{name}` is a Sparse24 (already compressed); pass the dense"
                    f" array (jsparse24.decompress gives it back).")
  if kind == "Mask24":
    raise TypeError(f"{fn}: `{name}` is a Mask24 (a mask, not values); pass the dense"
                    f" array (Mask24.unpack() gives the bool mask).")
  if isinstance(x, (list, tuple)):  # jnp.result_type cannot type a nested list
    raise TypeError(f"{fn}: `{name}` must be an array, got a {kind}: pass"
                    f" jnp.asarray({name}).")
  if not (hasattr(x, "shape") and hasattr(x, "dtype")) and not isinstance(x, (int, float)):
    raise TypeError(f"{fn}: `{name}` must be an array, got {kind}.")


def check_float(fn: str, name: str, x: Any) -> None:
  check_dense_array(fn, name, x)
  check_float_dtype(fn, name, jnp.result_type(x))


def check_key(fn: str, name: str, key: Any, needed_for: str) -> None:
  """`key` must be one PRNG key: a typed key array of shape () or a raw
  uint32[2] key."""
  if key is None:
    raise ValueError(f"{fn}: {needed_for} needs `{name}`, a PRNG key (jax.random.key(...)).")
  dtype = getattr(key, "dtype", None)
  shape = tuple(getattr(key, "shape", ()))
  typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
  if not ((typed and shape == ()) or (not typed and dtype == jnp.uint32 and shape == (2,))):
    raise TypeError(
        f"{fn}: `{name}` must be one PRNG key (jax.random.key(...)), got"
        f" {type(key).__name__} of dtype {dtype} and shape {shape}.")


def check_float_dtype(fn: str, name: str, dtype: Any) -> None:
  dtype = jnp.dtype(dtype)
  if dtype not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
    raise TypeError(
        f"{fn}: `{name}` must have a floating dtype (bfloat16, float16,"
        f" float32 or float64), got {dtype}."
    )


def check_nonempty(fn: str, name: str, shape: tuple[int, ...], axes: tuple[int, ...],
                   what: str) -> None:
  """Raises for a zero-size axis among `axes` (2:4 groups need 4 elements)."""
  for axis in axes:
    if shape[axis] == 0:
      raise ValueError(
          f"{fn}: `{name}.shape[{axis}]` = 0 ({what}); a 2:4 sparse weight needs"
          f" at least one group of 4 along each axis (shape {tuple(shape)}).")


def check_count(fn: str, name: str, v: Any, minimum: int = 1, what: str = "") -> None:
  """Raises unless `v` is a Python or NumPy int (not a bool) >= `minimum`:
  a float or 0 where a count goes fails later inside JAX or Python, or
  truncates."""
  if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
    raise ValueError(f"{fn}: {name} must be an int >= {minimum}{what}, got"
                     f" {type(v).__name__} {v!r}.")


def check_shape(fn: str, name: str, shape: Any) -> tuple[int, ...]:
  """`shape` as a tuple of ints >= 0; raises naming `fn` and `name` for an
  array passed in its place, an int, or entries that are not ints."""
  if hasattr(shape, "shape") and hasattr(shape, "dtype"):
    raise TypeError(f"{fn}: `{name}` must be a shape (a tuple of ints), got an array; pass"
                    f" its .shape.")
  if not isinstance(shape, (tuple, list)) or any(
      isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0 for d in shape):
    raise TypeError(f"{fn}: `{name}` must be a shape (a tuple of ints >= 0), got"
                    f" {type(shape).__name__} {shape!r}.")
  return tuple(int(d) for d in shape)


def check_flag(fn: str, name: str, v: Any, none: str = "") -> None:
  """Raises unless `v` is a bool (or None, where `none` says what None
  means): any string is true, so `transposable="False"` was taken as True."""
  if not (isinstance(v, (bool, np.bool_)) or (none and v is None)):
    options = f"True, False or None ({none})" if none else "True or False"
    raise TypeError(f"{fn}: {name} must be {options}, got {type(v).__name__} {v!r}.")


def normalize_axis(fn: str, name: str, axis: int, ndim: int) -> int:
  if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
    raise TypeError(f"{fn}: `axis` must be an int, got {type(axis).__name__} {axis!r}.")
  if not -ndim <= axis < ndim:
    raise ValueError(
        f"{fn}: `axis={axis}` is out of range for `{name}` of rank {ndim}."
    )
  return axis % ndim


def check_kn(fn: str, name: str, shape: tuple[int, ...]) -> None:
  """Raises unless `shape` is `[..., K, N]`: a weight or mask, or a stack of them."""
  if len(shape) < 2:
    raise ValueError(f"{fn}: `{name}` must be [..., K, N] (rank >= 2), got shape {tuple(shape)}.")


def check_multiple_of_4(fn: str, name: str, shape: tuple[int, ...], axis: int,
                        what: str = "the contraction axis") -> None:
  if shape[axis] % 4:
    raise ValueError(
        f"{fn}: `{name}.shape[{axis}]` = {shape[axis]} ({what}) is not a"
        f" multiple of 4; 2:4 sparsity keeps 2 of every 4 consecutive"
        f" elements along it (shape {shape})."
    )


def check_mask_dtype(fn: str, mask: Any) -> None:
  dtype = jnp.result_type(mask)
  if dtype != jnp.bool_:
    raise TypeError(
        f"{fn}: `mask` must be a bool array (True = kept) or a"
        f" jsparse24.Mask24, got dtype {dtype}."
    )


def check_same_shape(fn: str, name: str, got: tuple[int, ...],
                     want: tuple[int, ...], want_name: str) -> None:
  if tuple(got) != tuple(want):
    raise ValueError(
        f"{fn}: `{name}` has shape {tuple(got)}, expected {tuple(want)}"
        f" (the shape of `{want_name}`)."
    )


def check_24_groups(fn: str, mask: Any, axis: int) -> None:
  """Raises if a concrete bool mask does not keep exactly 2 of every 4."""
  if not is_concrete(mask):
    return
  m = np.asarray(mask)
  counts = np.moveaxis(m, axis, -1)
  counts = counts.reshape(counts.shape[:-1] + (-1, 4)).sum(-1)
  bad = np.argwhere(counts != 2)
  if bad.size:
    raise ValueError(
        f"{fn}: `mask` is not 2:4 along axis {axis}: {bad.shape[0]} group(s)"
        f" of 4 keep other than 2 elements (first at group index"
        f" {tuple(int(i) for i in bad[0])}, keeping"
        f" {int(counts[tuple(bad[0])])}). Build masks with"
        f" jsparse24.prune_24."
    )


def check_dense_mask(fn: str, mask: Any, w_shape: tuple[int, ...], both_axes: bool) -> jax.Array:
  """A bool mask shaped like `w`, 2:4 along axis -2 (and -1 if `both_axes`)
  when concrete; returns it as an array."""
  mask = jnp.asarray(mask)
  check_mask_dtype(fn, mask)
  check_same_shape(fn, "mask", mask.shape, w_shape, "w")
  check_24_groups(fn, mask, mask.ndim - 2)
  if both_axes:
    check_24_groups(fn, mask, mask.ndim - 1)
  return mask
