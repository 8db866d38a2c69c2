"""The sparsity options are declared once (`jsparse24._options.SparsityOptions`):
every public surface that spells them out has the same names, defaults and
types, so that they cannot drift apart."""

import dataclasses
import inspect
import typing

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jsparse24
from jsparse24 import nnx as jnnx
from jsparse24.linen import SparsityOptions

OPTIONS = {f.name: f for f in dataclasses.fields(SparsityOptions)}
# sparse_dot's keywords: the mask source is its `mask` argument, and the
# kernel's sharding is the weight's.
DOT_NAMES = {"gradient": "gradient", "transposable": "transposable",
             "implementation": "implementation", "weight_grad": "weight_grad",
             "kernel_sharding": "weight_sharding", "input_sparsity": "input_sparsity",
             "grad_output": "grad_output"}


def _type(annotation, namespace):
  return eval(annotation, namespace) if isinstance(annotation, str) else annotation  # pylint: disable=eval-used


def test_sparse_dense_fields_are_the_options():
  fields = {f.name: f for f in dataclasses.fields(jsparse24.SparseDense)}
  names = [f.name for f in dataclasses.fields(jsparse24.SparseDense) if f.name in OPTIONS]
  assert names == list(OPTIONS)
  hints = typing.get_type_hints(jsparse24.SparseDense)
  option_hints = typing.get_type_hints(SparsityOptions)
  for name, option in OPTIONS.items():
    assert fields[name].default == option.default, name
    assert hints[name] == option_hints[name], name


def test_sparse_linear_keywords_are_the_options():
  params = inspect.signature(jnnx.SparseLinear.__init__).parameters
  option_hints = typing.get_type_hints(SparsityOptions)
  names = [n for n in params if n in OPTIONS]
  assert names == list(OPTIONS)
  namespace = vars(jnnx)
  for name, option in OPTIONS.items():
    assert params[name].kind == inspect.Parameter.KEYWORD_ONLY, name
    assert params[name].default == option.default, name
    assert _type(params[name].annotation, namespace) == option_hints[name], name


def test_sparse_dot_keywords_are_the_options():
  params = inspect.signature(jsparse24.sparse_dot).parameters
  for option, keyword in DOT_NAMES.items():
    assert params[keyword].kind == inspect.Parameter.KEYWORD_ONLY, keyword
    assert params[keyword].default == OPTIONS[option].default, keyword
  assert set(OPTIONS) - set(DOT_NAMES) == {"mask_source"}


def test_layers_hold_the_options_they_were_given():
  """`SparsityOptions.of` reads a layer's options back: what the layers pass
  down to the product (the NNX layer with `transposable` resolved)."""
  opts = SparsityOptions(gradient="masked", transposable=False, implementation="xla",
                         mask_source="dynamic", weight_grad="mvue")
  kw = {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)}
  assert SparsityOptions.of(jsparse24.SparseDense(8, **kw)) == opts
  assert SparsityOptions.of(jnnx.SparseLinear(8, 8, rngs=nnx.Rngs(0), **kw)) == opts
  resolved = jnnx.SparseLinear(8, 8, rngs=nnx.Rngs(0))
  assert SparsityOptions.of(resolved) == SparsityOptions(transposable=True)


@pytest.mark.parametrize("make", [
    lambda: SparsityOptions.checked("SparseLinear", gradient="dense"),
    lambda: jnnx.SparseLinear(8, 8, gradient="dense", rngs=nnx.Rngs(0)),
])
def test_unknown_options_name_the_caller(make):
  with pytest.raises(ValueError, match=r"SparseLinear: unknown gradient='dense'; expected one"):
    make()


@pytest.mark.parametrize("make,caller", [
    (lambda: jnnx.SparseLinear(8, 8, implementation="cuda", rngs=nnx.Rngs(0)), "SparseLinear"),
    (lambda: jsparse24.SparseDense(8, implementation="cuda").init(
        jax.random.key(0), jnp.ones((2, 8))), "SparseDense"),
    (lambda: jsparse24.sparsify(jsparse24.SparseDense(8), {"": {"implementation": "cuda"}}),
     "sparsify: rule ''"),
    (lambda: jsparse24.sparse_dot(jnp.ones((2, 8)), jnp.ones((8, 4)), implementation="cuda"),
     "sparse_dot"),
    (lambda: jsparse24.compress(jnp.ones((8, 4)), implementation="cuda"), "compress"),
])
def test_an_unknown_implementation_names_the_caller(make, caller):
  """An implementation no backend has is refused where the options are
  given (a layer when built, a patcher's rule), naming the caller, as the
  other options are."""
  with pytest.raises(ValueError, match=rf"^{caller}: unknown implementation='cuda'; expected"
                                       r" None or one of \['cusparselt', 'pallas', 'xla'\]"):
    make()


def test_sparse_dot_passes_its_options_down():
  """The keywords reach the product as one `SparsityOptions`: the masked
  gradient mode is the layer's (and the product's) dw * mask."""
  x = jnp.ones((2, 8))
  w = jnp.arange(32.0).reshape(8, 4)
  dw = jax.grad(lambda w: jsparse24.sparse_dot(x, w, gradient="masked").sum())(w)
  assert bool(jnp.all((dw != 0) == jsparse24.prune_24(w)))
