"""Every use of a JAX internal that has no public equivalent, in one place.

jsparse24 defines two custom primitives (`backends._autodiff` for forward mode,
`backends.pallas` for the compression with a stored mask) through JAX's
primitive-extension modules (`jax.extend.core.Primitive`, `jax.interpreters`).
Two hooks they need are not public and have changed between releases; each
is wrapped here with the JAX versions it was checked on, and
`tests/test_jax_internals.py` fails with this module's name if a new JAX
release moves or changes one:

* `register_dce_rule`: JAX's dead-code rule table
  (`jax.interpreters.partial_eval.dce_rules`). Checked on jax 0.10.2, 0.11.2,
  0.12.0.1 and 0.12.1. Up to 0.11 a rule is called as `rule(used_outputs, eqn)`;
  from 0.12 as `rule(used_outputs, live_inputs, eqn)` (`live_inputs` says which
  mutable-array inputs are read later, which a primitive without mutable
  arrays can ignore).
* `requires_devices_during_lowering`: the set of primitives that need the
  devices while lowering (`jax._src.dispatch.prim_requires_devices_during_lowering`),
  for a primitive whose lowering holds a `custom_partitioning` call. Checked
  on the same versions.
* `vmapped_explicit_axes`: the Explicit mesh axes that an enclosing `vmap`
  maps over (`jax._src.core.get_axis_env().explicit_mesh_axis_names`), which
  a `shard_map` inside it cannot go manual over from jax 0.12.1. Checked on
  jax 0.10.2 and 0.12.1 (both name the axis of a `vmap` with an Explicit
  `spmd_axis_name`); an environment without the set reads as empty.

Why the dead-code rule is worth an internal hook: the fused compression
kernel writes the forward and the transposed copy of a weight in one pass;
where only the forward copy is used (the forward pass under
`jax.checkpoint`), the rule swaps in the kernel that writes only that copy.
XLA cannot narrow a custom call's outputs itself, and `jax.checkpoint` keeps
whatever the primitive returns. Measured: 0.9 ms less per step of the
d_model 4096 x 8 GPT under remat on an H200 (benchmarks/results/nvidia-h200.md,
"the forward pass compresses without the transposed copy").
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.interpreters import partial_eval as _pe

# A dead-code rule as jsparse24 writes it: `rule(used_outputs, eqn)` returns
# `(used_inputs, new_eqn or None)`.
DceRule = Callable[[list, "jax.extend.core.JaxprEqn"], tuple]


class JaxInternalsError(RuntimeError):
  """A JAX internal jsparse24 relies on is missing or changed (see the message)."""


def _changed(what: str, detail: str) -> JaxInternalsError:
  return JaxInternalsError(
      f"jsparse24._jax_internals: {what} changed in jax {jax.__version__} ({detail});"
      f" jsparse24 checked it on jax 0.10.2 to 0.12.1. Please report this with the"
      f" JAX version; pinning jax<=0.12.1 works meanwhile.")


def register_dce_rule(primitive: "jax.extend.core.Primitive", rule: DceRule) -> None:
  """Registers `rule(used_outputs, eqn) -> (used_inputs, new_eqn | None)` as
  `primitive`'s dead-code rule, whatever JAX's calling convention (module
  docstring)."""
  table = getattr(_pe, "dce_rules", None)
  if not isinstance(table, dict):
    raise _changed("jax.interpreters.partial_eval.dce_rules", "no such dict")

  def adapted(used_outputs, *rest):
    # rest is (eqn,) up to jax 0.11 and (live_inputs, eqn) from 0.12.
    if len(rest) not in (1, 2) or not isinstance(rest[-1], jax.extend.core.JaxprEqn):
      raise _changed("the dead-code rule's arguments",
                     f"called with {1 + len(rest)} arguments, the last a {type(rest[-1]).__name__}")
    return rule(used_outputs, rest[-1])

  table[primitive] = adapted


def requires_devices_during_lowering(primitive: "jax.extend.core.Primitive") -> None:
  """Marks `primitive` as needing the devices while it lowers (its lowering
  holds a `custom_partitioning` call; without the mark, lowering fails with
  an AssertionError inside custom_partitioning)."""
  from jax._src import dispatch  # pylint: disable=g-import-not-at-top,protected-access
  registry = getattr(dispatch, "prim_requires_devices_during_lowering", None)
  if not isinstance(registry, set):
    raise _changed("jax._src.dispatch.prim_requires_devices_during_lowering", "no such set")
  registry.add(primitive)


def vmapped_explicit_axes() -> frozenset:
  """The Explicit mesh axes an enclosing `vmap` maps over here (none outside
  such a `vmap`): a `shard_map` inside it goes manual over the other axes."""
  from jax._src import core  # pylint: disable=g-import-not-at-top,protected-access
  env = core.get_axis_env()
  return frozenset(getattr(env, "explicit_mesh_axis_names", ()))
