"""Named backends whose kernels are not in this build yet.

They are registered so that `implementation="pallas"` or `"cusparselt"` fails
with an honest, specific message instead of "unknown implementation", and so
that `implementation=None` skips them.
"""

from __future__ import annotations

from jsparse24.backends.base import Backend


class UnbuiltBackend(Backend):
  """A backend that is planned but not implemented in this version."""

  def __init__(self, name: str, what: str):
    self.name = name
    self._what = what

  def unavailable_reason(self) -> str | None:
    return f"the {self.name!r} backend ({self._what}) is not implemented in this version of jsparse24"

  def _never(self, *_):
    raise AssertionError(f"{self.name} backend called although unavailable")

  prepare = forward = backward_dx = mask_grad = forward_compressed = _never
