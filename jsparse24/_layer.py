"""What the Linen and NNX sparse dense layers share: the forward pass, and
`compress_params`' choice per layer."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jsparse24._format import Mask24, Sparse24
from jsparse24._ops import sparse_or_dense_dot
from jsparse24._options import SparsityOptions
from jsparse24._phase import is_static_dense


def sparse_dense_forward(inputs: jax.Array, kernel: jax.Array | Sparse24, bias: jax.Array | None,
                         mask: Mask24 | None, active: jax.Array | None, opts: SparsityOptions,
                         *, precision: Any, preferred_element_type: Any = None,
                         key: jax.Array | None = None, fn: str = "SparseDense") -> jax.Array:
  """`inputs @ (kernel * mask) + bias`; the plain dense product while `active`
  is False (dense phases of a schedule). `mask=None, active=None` prunes
  `kernel` by magnitude now. `inputs` and `bias` are already promoted to the
  compute dtype; `kernel` is in its parameter dtype (float32 in mixed
  precision) and is cast to the compute dtype inside the product, which then
  returns its gradient in the parameter dtype directly. `kernel` may also be
  a `Sparse24` in the compute dtype (a compressed layer: `mask` and `active`
  None, `opts.weight_grad` "dense"). `opts`: the layer's
  options, `transposable` resolved (`resolve_transposable`); `key`: as in
  `sparse_dot`; `fn`: the layer, for errors."""
  out_dtype = inputs.dtype if preferred_element_type is None else preferred_element_type
  y = sparse_or_dense_dot(inputs, kernel, mask, active, opts, precision=precision,
                          dtype=inputs.dtype, key=key, fn=fn)
  y = y.astype(out_dtype)
  if bias is not None:
    y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
  return y


def compresses(fn: str, layer: str, active: Any, outside: str) -> bool:
  """Whether `compress_params` (`fn`) compresses the layer named `layer`,
  from its `active` flag (None: always sparse; a stack's flags): yes where
  every flag is True, no in a dense phase (all False). A stack partly sparse
  and partly dense raises `ValueError` (one stacked kernel cannot be partly
  compressed); traced flags raise `TypeError`, naming the transform to call
  it `outside`: the choice is made on the host."""
  try:
    flags = np.asarray(True if active is None else False if is_static_dense(active)
                       else active)
  except jax.errors.TracerArrayConversionError as e:
    raise TypeError(
        f"{fn}: the 'active' flags of layer {layer!r} are traced; call {fn} outside"
        f" {outside} (it decides per layer whether to compress).") from e
  if flags.any() and not flags.all():
    raise ValueError(
        f"{fn}: layer {layer!r} is a stack whose layers are partly sparse and partly dense"
        f" (active={flags.tolist()}); one stacked kernel cannot be partly compressed.")
  return bool(flags.all())
