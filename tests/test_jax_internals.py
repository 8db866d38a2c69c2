"""The JAX internals jsparse24 relies on (`jsparse24._jax_internals`) still
behave as it expects: a new JAX release that moves or changes one fails here,
by name, before it breaks a training step somewhere else."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.interpreters import mlir
from jax.interpreters import partial_eval as pe

from jsparse24 import _jax_internals


def _two_output_primitive(name):
  """A primitive `p(x) -> (2x, 3x)` whose dead-code rule, registered through
  `register_dce_rule`, records its calls and drops the second output's work
  when only the first is used (it rebinds with `first_only=True`)."""
  p = jax.extend.core.Primitive(name)
  p.multiple_results = True

  def impl(x, *, first_only):
    return [2 * x] if first_only else [2 * x, 3 * x]

  p.def_impl(impl)
  p.def_abstract_eval(lambda x, *, first_only: [x] if first_only else [x, x])
  mlir.register_lowering(p, mlir.lower_fun(impl, multiple_results=True))
  calls = []

  def rule(used_outs, eqn):
    calls.append(list(used_outs))
    if not any(used_outs):
      return [False], None
    if not used_outs[1] and not eqn.params["first_only"]:
      return [True], jax.extend.core.new_jaxpr_eqn(
          eqn.invars, eqn.outvars[:1], p, dict(eqn.params, first_only=True), eqn.effects,
          eqn.source_info, eqn.ctx)
    return [True], eqn

  _jax_internals.register_dce_rule(p, rule)
  return p, calls


def test_dce_rule_is_called_and_can_replace_the_equation():
  p, calls = _two_output_primitive("jsparse24_test_two_outputs")
  x = jnp.arange(4.0)
  first = lambda x: p.bind(x, first_only=False)[0]  # noqa: E731
  jaxpr = jax.make_jaxpr(first)(x).jaxpr
  narrowed, used_inputs = pe.dce_jaxpr(jaxpr, [True])
  assert calls == [[True, False]], "the dead-code rule was not called as registered"
  assert used_inputs == [True]
  [eqn] = narrowed.eqns
  assert eqn.params["first_only"] and len(eqn.outvars) == 1
  # Nothing used: the rule removes the equation.
  unused = jax.make_jaxpr(lambda x: (p.bind(x, first_only=False), x)[1])(x).jaxpr
  assert pe.dce_jaxpr(unused, [True])[0].eqns == []
  # jit runs the same program end to end (XLA lowers the narrowed equation).
  np.testing.assert_array_equal(jax.jit(first)(x), 2 * x)


def test_dce_rule_with_an_unknown_calling_convention_names_this_module():
  p, _ = _two_output_primitive("jsparse24_test_convention")
  adapted = pe.dce_rules[p]
  with pytest.raises(_jax_internals.JaxInternalsError,
                     match=r"jsparse24\._jax_internals: the dead-code rule's arguments changed"):
    adapted([True, True], "not an equation")


def test_devices_during_lowering_registry_exists():
  p = jax.extend.core.Primitive("jsparse24_test_devices")
  _jax_internals.requires_devices_during_lowering(p)
  from jax._src import dispatch  # pylint: disable=g-import-not-at-top,protected-access
  assert p in dispatch.prim_requires_devices_during_lowering


def test_the_compression_primitive_uses_both_hooks():
  from jsparse24.backends import pallas  # pylint: disable=g-import-not-at-top
  from jax._src import dispatch  # pylint: disable=g-import-not-at-top,protected-access
  prim = pallas._compress_with_mask_p  # pylint: disable=protected-access
  assert prim in pe.dce_rules
  assert prim in dispatch.prim_requires_devices_during_lowering


def test_vmapped_explicit_axes_names_the_axis_a_vmap_maps_over():
  """Empty outside a vmap; inside `vmap(..., spmd_axis_name="x")` over an
  Explicit axis, {"x"} (what `_sharding.whole_on_each_device` leaves out of
  its shard_map's manual axes)."""
  assert _jax_internals.vmapped_explicit_axes() == frozenset()
  mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices()[:2])
  seen = []

  def f(a):
    seen.append(_jax_internals.vmapped_explicit_axes())
    return a * 2

  with jax.set_mesh(mesh):
    a = jax.device_put(jnp.ones((2, 4)), jax.sharding.NamedSharding(mesh, jax.P("x")))
    jax.vmap(f, spmd_axis_name="x")(a)
  assert seen == [frozenset({"x"})]
