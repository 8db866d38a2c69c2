"""The interface every `implementation=` backend of `sparse_dot` provides.

A backend turns `(w, mask)` into an *operand* once per forward pass (prune
and/or compress), multiplies by it, and reuses the same operand in the backward
pass for `dx = dy @ (w*m)^T`: nothing is pruned or compressed twice per step.
`dw = x^T @ dy` is a dense product that `sparse_dot` computes itself.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import jax

from jsparse24._format import Mask24, Sparse24


class BackendUnavailableError(ValueError):
  """An explicitly requested backend cannot run here (the message says why)."""


@dataclasses.dataclass(frozen=True)
class Problem:
  """The static facts a backend needs to decide whether it can run a call."""

  m: int  # rows of x after flattening leading axes
  k: int
  n: int
  dtype: Any
  transposable: bool
  platform: str  # jax.default_backend() at trace time


class Backend(abc.ABC):
  """One implementation of the sparse product."""

  name: str
  # Why `jsparse24.compress(..., implementation=name)` cannot use this backend
  # (None: it can).
  no_sparse24_reason: str | None = None

  def unavailable_reason(self) -> str | None:
    """None when this backend can run on this machine, else why not."""
    return None

  def check_supported(self, problem: Problem) -> None:
    """Raises NotImplementedError (with the reason) for inputs it cannot run."""

  def prefers(self, problem: Problem) -> bool:
    """Whether `implementation=None` should take this backend for `problem`:
    only where it measured faster than dense XLA."""
    del problem
    return True

  def compress(self, w: jax.Array, mask: jax.Array | Mask24 | None,
               transposed: bool) -> Sparse24:
    """`jsparse24.compress` (arguments already checked)."""
    raise NotImplementedError(f"the {self.name!r} backend has no compress")

  @abc.abstractmethod
  def prepare(self, w: jax.Array, mask: jax.Array | Mask24 | None,
              transposable: bool) -> Any:
    """Masks/compresses `w`: returns the operand (a pytree of arrays).

    `mask=None` means prune `w` by magnitude now (`transposable` says how).
    """

  @abc.abstractmethod
  def forward(self, x: jax.Array, operand: Any, precision: Any) -> jax.Array:
    """`x[M, K] @ (w*m)[K, N]`, accumulated in float32, in x's dtype."""

  @abc.abstractmethod
  def backward_dx(self, dy: jax.Array, operand: Any, precision: Any) -> jax.Array:
    """`dy[M, N] @ (w*m)^T`, accumulated in float32, in dy's dtype."""

  @abc.abstractmethod
  def mask_grad(self, dw: jax.Array, operand: Any) -> jax.Array:
    """`dw * mask` for the "masked" gradient mode."""

  @abc.abstractmethod
  def forward_compressed(self, x: jax.Array, sp: Sparse24, precision: Any) -> jax.Array:
    """`x @ decompress(sp)` for inference on a compressed weight."""
