"""The 2:4 formats: `Sparse24` (compressed weights) and `Mask24` (packed masks).

Both describe a weight `w` of shape `[..., K, N]` (Flax kernel layout, used as
`x @ w`) that is 2:4 sparse along K, the contraction axis.

Metadata ("meta"). For every group of 4 along K, a 4-bit code holds the two
kept indices `i0 < i1` as `i0 | i1 << 2` (NVIDIA's sparse tensor-core
convention: two 2-bit indices, the first in the low bits). Two groups share a
byte, the lower group in the low nibble. The array is `uint8[..., N, ceil(K/8)]`
(K contiguous); when K/4 is odd the last high nibble is padding, set to the
valid code `0x4` (indices 0 and 1) so that decoders need no special case.
(The codes' one definition, shared with the Pallas kernels:
`pallas_kernels.prune_rule`.)
4 bits per 4 elements is 1 bit per weight element.

`Sparse24.values` holds the kept values in K order, `[..., N, K/2]`: with the
metadata about 56% of the dense bytes for bf16. The optional `values_t`,
`meta_t` hold the same for `w`'s transpose (`[..., K, N/2]`, sparse along N),
which exists when the mask is transposable; the backward product
`dy @ (w*m)^T` reads it.

In cuSPARSELt's layout (`Sparse24.cusparselt`, `compress(...,
cusparselt=True)`) `values` is `[..., N + N/8, K/2]`: the same kept values,
then the metadata in cuSPARSELt's own layout, which makes `values` exactly
the compressed buffer cuSPARSELt multiplies (its structured operand read as
the row-major `[N, K]` it is). Its products then read the weight in place;
the portable layout is re-laid out for cuSPARSELt in every call.

`Mask24` is a mask kept as training state: its metadata only (1 bit per
element), plus the dense shape and whether it is transposable.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from jsparse24 import _checks, _pallas_runtime
from jsparse24._prune import prune_24
from pallas_kernels import prune_rule as rule


def _group_indices(mask_t: jax.Array) -> tuple[jax.Array, jax.Array]:
  """mask_t: [..., G, 4] bool with 2 kept -> (i0, i1) int32 [..., G], i0 < i1.

  A group that does not keep 2 (possible only for a traced mask, which cannot
  be checked) still gets two distinct indices, so that every format reads it
  alike: its first and last kept element; with one kept, that one and the
  lowest other; with none kept, elements 0 and 3.
  """
  i0 = jnp.argmax(mask_t, axis=-1).astype(jnp.int32)
  i1 = (3 - jnp.argmax(mask_t[..., ::-1], axis=-1)).astype(jnp.int32)
  one = i0 == i1
  other = jnp.where(i0 == 0, 1, 0).astype(jnp.int32)
  return jnp.where(one, jnp.minimum(i0, other), i0), jnp.where(one, jnp.maximum(i0, other), i1)


def _pack_codes(codes: jax.Array) -> jax.Array:
  """codes: [..., G] in [0, 16) -> uint8 [..., ceil(G/2)]."""
  groups = codes.shape[-1]
  if groups % 2:
    pad = jnp.full(codes.shape[:-1] + (1,), rule.PAD_CODE, codes.dtype)
    codes = jnp.concatenate([codes, pad], axis=-1)
  pairs = codes.reshape(codes.shape[:-1] + (-1, 2)).astype(jnp.uint8)
  return rule.byte_of(pairs[..., 0], pairs[..., 1])


def _unpack_codes(meta: jax.Array, groups: int) -> tuple[jax.Array, jax.Array]:
  """uint8 [..., ceil(G/2)] -> (i0, i1) int32 [..., G]."""
  codes = jnp.stack(rule.byte_codes(meta), axis=-1)
  codes = codes.reshape(meta.shape[:-1] + (-1,))[..., :groups].astype(jnp.int32)
  return rule.code_indices(codes)


def _compress_last(w_t: jax.Array, mask_t: jax.Array):
  """Compress along the last axis. w_t, mask_t: [..., N, K] -> values, meta."""
  k = w_t.shape[-1]
  g = w_t.reshape(w_t.shape[:-1] + (k // 4, 4))
  m = mask_t.reshape(g.shape)
  i0, i1 = _group_indices(m)
  idx = jnp.stack([i0, i1], axis=-1)
  values = jnp.take_along_axis(g, idx, axis=-1).reshape(w_t.shape[:-1] + (k // 2,))
  return values, _pack_codes(rule.group_code(i0, i1))


def _decompress_last(values: jax.Array, meta: jax.Array, k: int) -> jax.Array:
  """Inverse of `_compress_last`: -> dense [..., N, K]."""
  i0, i1 = _unpack_codes(meta, k // 4)
  v = values.reshape(values.shape[:-1] + (k // 4, 2))
  lane = jnp.arange(4, dtype=jnp.int32)
  zero = jnp.zeros((), values.dtype)
  dense = jnp.where(lane == i0[..., None], v[..., 0:1],
                    jnp.where(lane == i1[..., None], v[..., 1:2], zero))
  return dense.reshape(values.shape[:-1] + (k,))


_ROW_SHIFT = np.array([0, 0, 0, 0, 4, 4, 4, 4], np.uint8)[:, None]
_ROW_LANE = np.array([0, 1, 2, 3, 0, 1, 2, 3], np.uint8)[:, None]


def _mask_kn(meta: jax.Array, k: int) -> jax.Array:
  """meta `[..., N, ceil(K/8)]` -> dense bool `[..., K, N]`.

  Written as a small transpose of the metadata (1/8 byte per weight) followed
  by broadcasts and elementwise ops in the weight's own `[K, N]` order, so
  that XLA fuses the expansion into whatever consumes the mask (`w * mask`,
  the masked decay): no `[K, N]` bool array is written to memory and no
  weight-sized transpose runs. Unpacking `[N, K]` and transposing it instead
  costs a separate pass, which measured slower than a dense product.

  The row-dependent shift and lane are 8-entry constants broadcast against
  the bytes, not a `[K, N]` iota: inside `nn.scan`'s loop XLA hoisted the
  iota's shift and lane out of the loop as two `uint8[K, N]` arrays, written
  every step and read by every layer's masking (2 bytes per weight more).
  """
  meta_t = jnp.swapaxes(meta, -1, -2)  # [..., ceil(K/8), N]
  *lead, rows, n = meta_t.shape
  byte = meta_t[..., :, None, :]  # [..., ceil(K/8), 1, N]: row k's byte is k // 8
  code = (byte >> _ROW_SHIFT) & 0xF  # [..., ceil(K/8), 8, N]: the nibble of group k // 4
  i0, i1 = rule.code_indices(code)
  kept = (i0 == _ROW_LANE) | (i1 == _ROW_LANE)
  return kept.reshape(*lead, rows * 8, n)[..., :k, :]


def _refused_eq(cls_name: str, how: str):
  """An `__eq__` that names the class and how to compare: the dataclass's
  compared the arrays, whose truth value is ambiguous (a ValueError naming
  neither), or raised a broadcasting error for another size. Setting it
  leaves the class unhashable, as its arrays are."""

  def __eq__(self, other):
    if not isinstance(other, type(self)):
      return NotImplemented  # `mask in (None, ...)` stays an identity test
    raise TypeError(f"{cls_name}: `==` would compare arrays elementwise; {how}.")

  return __eq__


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class Sparse24:
  """A 2:4-compressed weight `w[..., K, N]` (sparse along K). A pytree.

  Attributes:
    values: `[..., N, K/2]` kept values, K order, dtype of `w`; with
      `cusparselt`, `[..., N + N/8, K/2]`: those rows, then cuSPARSELt's
      metadata (module docstring).
    meta: `uint8[..., N, ceil(K/8)]` 4-bit codes (module docstring).
    values_t, meta_t: the same for `w`'s transpose (sparse along N), or None.
    cusparselt: static; whether `values` is in cuSPARSELt's layout.

  The dense shape `(..., K, N)` (`shape`) is read off `values` and `meta`,
  so stacks of layers (`nn.scan`, `vmap`) slice and stack a `Sparse24` like
  any array.
  """

  values: jax.Array
  meta: jax.Array
  values_t: jax.Array | None = None
  meta_t: jax.Array | None = None
  cusparselt: bool = dataclasses.field(default=False, metadata=dict(static=True))

  __eq__ = _refused_eq("Sparse24", "compare the dense weights, jnp.array_equal(decompress(a),"
                       " decompress(b)), or each array (a.values, a.meta, ...)")

  @property
  def shape(self) -> tuple[int, ...]:
    """The dense shape `(..., K, N)`."""
    *lead, _, half_k = self.values.shape
    return (*lead, 2 * half_k, self.meta.shape[-2])

  @property
  def kept_values(self) -> jax.Array:
    """The kept values `[..., N, K/2]` in either layout (a slice of `values`
    in cuSPARSELt's: a copy where it is not fused into its reader)."""
    if not self.cusparselt:
      return self.values
    return self.values[..., :self.meta.shape[-2], :]

  @property
  def dtype(self):
    return self.values.dtype

  @property
  def has_transpose(self) -> bool:
    return self.values_t is not None

  @property
  def nbytes(self) -> int:
    """Bytes of the forward operand (values + meta; in cuSPARSELt's layout
    its metadata rows too), without the transpose."""
    return int(self.values.size * self.values.dtype.itemsize + self.meta.size)

  def astype(self, dtype) -> "Sparse24":
    """This weight with its values in `dtype` (itself when they are). In
    cuSPARSELt's layout a cast keeps the kept values only (the portable
    layout): the metadata rows are bits, not numbers, and cuSPARSELt's
    products take bfloat16 and float16 only, one buffer per dtype."""
    # An integer cast would truncate the values, and every product refuses
    # the result (`check_sparse24`) far from the cast.
    _checks.check_float_dtype("Sparse24.astype", "dtype", dtype)
    if jnp.dtype(dtype) == self.dtype:
      return self
    return Sparse24(self.kept_values.astype(dtype), self.meta,
                    None if self.values_t is None else self.values_t.astype(dtype), self.meta_t)

  def mask(self) -> Bool[Array, "... K N"]:
    """The dense bool mask this weight was compressed with."""
    return _mask_kn(self.meta, self.shape[-2])

  def transpose(self) -> "Sparse24":
    """The compressed `w^T` (`[..., N, K]`, sparse along N). Needs `values_t`."""
    if not self.has_transpose:
      raise ValueError(
          "Sparse24.transpose: this weight was compressed without its"
          " transpose; compress with transposed=True (needs a transposable"
          " mask).")
    return Sparse24(self.values_t, self.meta_t, self.kept_values, self.meta)


@functools.partial(jax.jit, static_argnums=2)
def compress_reference(w: jax.Array, mask: "jax.Array | Mask24 | None",
                       transposed: bool) -> Sparse24:
  """The plain-jnp `compress` (arguments already checked)."""
  if mask is None:
    mask = prune_24(w, axis=-2, transposable=transposed)
  elif isinstance(mask, Mask24):
    mask = mask.unpack()
  values, meta = _compress_last(jnp.swapaxes(w, -1, -2), jnp.swapaxes(mask, -1, -2))
  values_t = meta_t = None
  if transposed:
    values_t, meta_t = _compress_last(w, mask)
  return Sparse24(values, meta, values_t, meta_t)


def check_mask24(fn: str, name: str, mask: "Mask24") -> None:
  """Raises where `mask.packed` is not the packing of a mask of `mask.dims`
  (`Mask24`'s docstring), naming `fn` and `name`: a mask sliced by a pytree
  map along an axis it does not stack (`a[0]` of one layer's mask, where a
  model mixes stacked and single layers), or restored against another
  template, kept its dims, so its `shape` passed the shape checks and the
  product failed inside JAX. Shapes and dtypes only: free under `jit`."""
  k, n = mask.dims
  want = (-(-n * k // 8),) if (k // 4) % 2 else (n, k // 8)
  packed = mask.packed
  if packed.dtype != jnp.uint8 or tuple(packed.shape[-len(want):]) != want or (
      packed.ndim < len(want)):
    raise ValueError(
        f"{fn}: `{name}` is a Mask24 of dims (K, N) = {mask.dims} whose packed codes are"
        f" {packed.dtype}{tuple(packed.shape)}, not uint8[..., {', '.join(map(str, want))}] as"
        f" those dims pack: was it sliced along an axis it does not stack (a pytree map over"
        f" masks of single layers and stacks alike), or restored against another template?"
        f" Take masks from the model's init, Mask24.pack or Mask24.from_weights.")


def check_sparse24(fn: str, name: str, sp: Sparse24) -> None:
  """Raises where `sp`'s arrays do not fit together as `compress` makes them
  (module docstring), naming `fn`, `name` and what was expected: a
  `Sparse24` built by hand, or restored from a checkpoint against another
  template, would otherwise fail inside JAX's ops with a broadcasting error,
  or run with metadata of a dtype the kernels were not written for. Shapes
  and dtypes only: free under `jit`. Not in
  `__post_init__`: pytree maps rebuild a `Sparse24` around other leaves
  (shardings, shape structs, cotangents)."""
  values, meta = sp.values, sp.meta
  _checks.check_float_dtype(fn, f"{name}.values", values.dtype)
  if meta.dtype != jnp.uint8:
    raise TypeError(f"{fn}: `{name}.meta` must be uint8 (two 4-bit codes a byte, as"
                    f" jsparse24.compress makes it), got {meta.dtype}.")
  if values.ndim < 2 or meta.shape[:-2] != values.shape[:-2] or meta.ndim != values.ndim:
    raise ValueError(f"{fn}: `{name}` must hold values [..., N, K/2] and meta [..., N, ceil(K/8)]"
                     f" with the same leading axes, got values {values.shape} and meta"
                     f" {meta.shape}.")
  *lead, n, _ = meta.shape
  k = 2 * values.shape[-1]
  rows = n + n // 8 if sp.cusparselt else n
  layout = " (cuSPARSELt's layout: N + N/8 rows)" if sp.cusparselt else ""
  if k % 4 or values.shape[-2] != rows or meta.shape[-1] != -(-k // 8):
    raise ValueError(f"{fn}: `{name}`'s values {values.shape} and meta {meta.shape} do not fit"
                     f" together: values [..., N, K/2]{layout} and meta [..., N, ceil(K/8)], K a"
                     f" multiple of 4; here N = {n} (meta's rows) and K = {k} (twice values'"
                     f" columns) want values {(*lead, rows, k // 2)} and meta"
                     f" {(*lead, n, -(-k // 8))}.")
  if (sp.values_t is None) != (sp.meta_t is None):
    raise ValueError(f"{fn}: `{name}` has one of values_t and meta_t without the other; the"
                     f" transpose needs both (or neither).")
  if sp.values_t is not None:
    want = {"values_t": ((*lead, k, n // 2), values.dtype),
            "meta_t": ((*lead, k, -(-n // 8)), jnp.dtype(jnp.uint8))}
    for part, (shape, dtype) in want.items():
      got = getattr(sp, part)
      if got.shape != shape or got.dtype != dtype:
        raise ValueError(f"{fn}: `{name}.{part}` must be {jnp.dtype(dtype).name}{list(shape)}"
                         f" (the transpose of a [K, N] = [{k}, {n}] weight), got"
                         f" {got.dtype}{list(got.shape)}.")


def decompress(sp: Sparse24) -> Float[Array, "... K N"]:
  """The dense `w * mask` that `sp` was compressed from (exact)."""
  if not isinstance(sp, Sparse24):
    raise TypeError(f"decompress: expected a jsparse24.Sparse24, got {type(sp).__name__}.")
  check_sparse24("decompress", "sp", sp)
  return jnp.swapaxes(_decompress_last(sp.kept_values, sp.meta, sp.shape[-2]), -1, -2)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class Mask24:
  """A 2:4 mask along K of a `[..., K, N]` weight, packed to 1 bit/element.

  A pytree whose one leaf is `packed`, the 4-bit codes of the metadata
  format. When K/4 is even it is exactly `Sparse24.meta`
  (`uint8[..., N, K/8]`); when K/4 is odd the codes of each slice are packed
  flat (`uint8[..., ceil(N*K/8)]`, row-major over `[N, K/4]`) so that no
  column carries a padding nibble.

  The static fields are `dims = (K, N)`, the trailing dense axes, and
  `transposable`; the leading axes of `shape` are those of `packed`. So a
  stack of masks (`nn.scan`, `nnx.vmap`, `jax.vmap` over layers) slices and
  stacks like an array: each slice is the mask of one layer.
  """

  packed: jax.Array
  dims: tuple[int, int] = dataclasses.field(default=(0, 0), metadata=dict(static=True))
  transposable: bool = dataclasses.field(default=False, metadata=dict(static=True))

  __eq__ = _refused_eq("Mask24", "compare the codes, jnp.array_equal(a.packed, b.packed) with"
                       " a.dims and a.transposable, or the dense masks a.unpack()")

  def __post_init__(self):
    # A full dense shape is accepted and reduced to its trailing (K, N).
    object.__setattr__(self, "dims", tuple(int(d) for d in tuple(self.dims)[-2:]))
    if len(self.dims) != 2 or min(self.dims) < 1:
      # `Mask24(mask)` took a dense bool mask as the packed codes, with no
      # shape: a mask of shape (0, 0) that failed far from here.
      raise ValueError(
          f"Mask24: dims={self.dims} must be the weight's (K, N), both >= 1; a mask is made"
          f" with Mask24.pack(mask) from a bool 2:4 mask, or Mask24.from_weights(w), not"
          f" with the constructor.")

  @property
  def shape(self) -> tuple[int, ...]:
    """The dense shape `(..., K, N)` of the weight this mask belongs to."""
    k, n = self.dims
    flat = (k // 4) % 2
    lead = tuple(self.packed.shape[:-1] if flat else self.packed.shape[:-2])
    return (*lead, k, n)

  @classmethod
  def pack(cls, mask: Bool[Array, "... K N"], *, transposable: bool = False) -> "Mask24":
    """Packs a dense bool 2:4 mask (along axis -2)."""
    fn = "Mask24.pack"
    _checks.check_flag(fn, "transposable", transposable)
    mask = jnp.asarray(mask)
    _checks.check_mask_dtype(fn, mask)
    _checks.check_kn(fn, "mask", mask.shape)
    _checks.check_multiple_of_4(fn, "mask", mask.shape, mask.ndim - 2)
    _checks.check_24_groups(fn, mask, mask.ndim - 2)
    if transposable:
      _checks.check_multiple_of_4(fn, "mask", mask.shape, mask.ndim - 1,
                                  "N, for a transposable mask")
      _checks.check_24_groups(fn, mask, mask.ndim - 1)
    i0, i1 = _group_indices(
        jnp.swapaxes(mask, -1, -2).reshape(
            mask.shape[:-2] + (mask.shape[-1], mask.shape[-2] // 4, 4)))
    return cls._from_codes(rule.group_code(i0, i1), tuple(mask.shape), transposable)

  @classmethod
  def _from_codes(cls, codes: jax.Array, shape, transposable: bool) -> "Mask24":
    """codes: int `[..., N, K/4]`."""
    if codes.shape[-1] % 2:
      codes = codes.reshape(codes.shape[:-2] + (-1,))
    return cls(_pack_codes(codes), tuple(shape), transposable)

  @classmethod
  def from_meta(cls, meta: jax.Array, shape: tuple[int, ...], transposable: bool = False) -> "Mask24":
    """The mask of `Sparse24` metadata `meta` (`uint8[..., N, ceil(K/8)]`)."""
    i0, i1 = _unpack_codes(meta, shape[-2] // 4)
    return cls._from_codes(rule.group_code(i0, i1), tuple(shape), transposable)

  @classmethod
  def from_weights(cls, w: Float[Array, "... K N"], *, transposable: bool = False) -> "Mask24":
    """`Mask24.pack(prune_24(w, transposable=...))`: the same bits, on the
    fastest path here: on an NVIDIA GPU a transposable mask comes from one
    fused Pallas kernel (0.42 ms against 27 ms for XLA's search of a 16384²
    float32 weight on an H200: benchmarks/results/nvidia-h200.md,
    "prune+compress 16384x16384 bf16"); elsewhere, and for plain masks, from
    one compiled XLA program."""
    fn = "Mask24.from_weights"
    _checks.check_flag(fn, "transposable", transposable)
    _checks.check_float(fn, "w", w)
    w = jnp.asarray(w)
    _checks.check_kn(fn, "w", w.shape)
    _checks.check_multiple_of_4(fn, "w", w.shape, w.ndim - 2)
    if transposable:
      _checks.check_multiple_of_4(fn, "w", w.shape, w.ndim - 1, "N, for a transposable mask")
    if (transposable and _pallas_runtime.runs_natively()
        and _pallas_runtime.mask_kernel_takes(w, True)):
      return cls.from_meta(_pallas_runtime.transposable_mask_meta(w), w.shape,
                           transposable=True)
    return _mask_from_weights(w, transposable)

  def meta(self) -> jax.Array:
    """The mask as `Sparse24` metadata, `uint8[..., N, ceil(K/8)]`."""
    k, n = self.dims
    if (k // 4) % 2 == 0:
      return self.packed
    i0, i1 = _unpack_codes(self.packed, n * (k // 4))
    codes = rule.group_code(i0, i1).reshape(self.packed.shape[:-1] + (n, k // 4))
    return _pack_codes(codes)

  def unpack(self) -> Bool[Array, "... K N"]:
    """The dense bool mask."""
    return _mask_kn(self.meta(), self.dims[0])

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.packed.shape))


@functools.partial(jax.jit, static_argnums=1)
def _mask_from_weights(w: jax.Array, transposable: bool) -> Mask24:
  return Mask24.pack(prune_24(w, axis=-2, transposable=transposable),
                     transposable=transposable)
