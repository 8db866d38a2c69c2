"""Backend registry for `implementation=` and the `None` (automatic) choice.

`implementation=None` tries the backends in `AUTO_ORDER` and takes the first
that is available, supports the call and measured faster than dense for it
(`Backend.prefers`); the reference `"xla"` backend is last
and supports everything, so the automatic choice always works. A backend named
explicitly either runs or raises `BackendUnavailableError` / `ValueError`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jsparse24 import _pallas_runtime
from jsparse24._format import Mask24
from jsparse24.backends import pallas as _pallas
from jsparse24.backends.base import (Backend, BackendUnavailableError, DotConfig, Problem,
                                     UnmeasuredChoiceWarning, XlaFallbackWarning)
from jsparse24.backends.cusparselt import CusparseltBackend
from jsparse24.backends.pallas import PallasBackend
from jsparse24.backends.xla import XlaBackend

BACKENDS: dict[str, Backend] = {
    "xla": XlaBackend(),
    "pallas": PallasBackend(),
    "cusparselt": CusparseltBackend(),
}

AUTO_ORDER = ("cusparselt", "pallas", "xla")


def _prefix(fn: str | None) -> str:
  """How an error raised for the public function `fn` begins."""
  return "" if fn is None else f"{fn}: "


def check_name(implementation, fn: str | None = None) -> None:
  """Raises `ValueError` (naming `fn`) unless `implementation` is None or a
  backend's name."""
  if implementation is not None and (not isinstance(implementation, str)
                                     or implementation not in BACKENDS):
    raise ValueError(
        f"{_prefix(fn)}unknown implementation={implementation!r}; expected None or one of"
        f" {sorted(BACKENDS)}.")


def select(implementation: str | None, problem: Problem, fn: str | None = None) -> Backend:
  """The backend that runs `problem` (see the module docstring); its errors
  begin with `fn`, the public function called, where given."""
  if implementation is None:
    for name in AUTO_ORDER:
      backend = BACKENDS[name]
      # The cheap static checks first: availability may build something (the
      # cuSPARSELt shim), which only calls the backend would take should pay.
      try:
        backend.check_supported(problem)
      except NotImplementedError:
        continue
      if backend.prefers(problem) and backend.unavailable_reason() is None:
        return backend
    raise AssertionError("the xla backend supports every problem")
  check_name(implementation, fn)
  backend = BACKENDS[implementation]
  reason = backend.unavailable_reason()
  if reason is not None:
    raise BackendUnavailableError(
        f"{_prefix(fn)}implementation={implementation!r} cannot run here: {reason}. Use"
        f" implementation=None to pick the best available backend, or 'xla'.")
  try:
    backend.check_supported(problem)
  except NotImplementedError as e:
    raise BackendUnavailableError(
        f"{_prefix(fn)}implementation={implementation!r} cannot run this call: {e}") from e
  return backend


def select_compress(implementation: str | None, w, fn: str = "compress") -> Backend:
  """The backend for `jsparse24.compress` (`fn`: the public function called):
  with None, the Pallas kernel where it runs natively (2-D weights of a
  dtype it supports), else the reference."""
  problem = Problem(m=0, k=w.shape[-2], n=w.shape[-1], dtype=w.dtype,
                    transposable=False, platform="")
  if implementation is None:
    pallas = BACKENDS["pallas"]
    if _pallas_runtime.runs_natively() and w.ndim == 2:
      try:
        pallas.check_supported(problem)
        return pallas
      except NotImplementedError:
        pass
    return BACKENDS["xla"]
  backend = select(implementation, problem, fn)
  if backend.no_sparse24_reason is not None:
    raise BackendUnavailableError(
        f"{fn}: implementation={implementation!r} cannot build a Sparse24:"
        f" {backend.no_sparse24_reason}")
  if implementation == "pallas" and w.ndim != 2:
    raise BackendUnavailableError(
        f"{fn}: implementation='pallas' compresses 2-D weights [K, N]; got shape {w.shape}.")
  return backend


__all__ = ["BACKENDS", "Backend", "BackendUnavailableError", "DotConfig", "Problem",
           "UnmeasuredChoiceWarning", "XlaFallbackWarning", "check_name", "rebuild_where",
           "select", "select_compress"]


def rebuild_where(w, old: Mask24, rebuild) -> tuple[Mask24, jax.Array] | None:
  """`(Mask24.from_weights(w, transposable=old.transposable), flips)` if the
  bool scalar `rebuild` (traced) is set, else `(old, 0)`, without a
  conditional: one fused Pallas kernel call whose programs only copy their
  block of `old` when the flag is off (`pallas.rebuild_mask`), and which
  counts the flipped weights (`flips`: their fraction, per mask of a stack)
  only where it rebuilds. Where the kernel runs natively (an NVIDIA GPU);
  None elsewhere (the caller keeps a `lax.cond`, which on a CPU costs
  nothing)."""
  w = jnp.asarray(w)
  if (tuple(w.shape[-2:]) != tuple(old.dims) or tuple(w.shape[:-2]) != tuple(old.shape[:-2])
      or not _mask_kernel_applies(w, old.transposable)):
    return None
  return _pallas.rebuild_mask(w, old, rebuild)


def _mask_kernel_applies(w, transposable: bool) -> bool:
  """Whether the fused mask kernels run natively on `w` (K a multiple of 4;
  N too for a transposable mask)."""
  return _pallas_runtime.runs_natively() and _pallas_runtime.mask_kernel_takes(w, transposable)
