"""The docstring examples run and print what they show (CI runs them here,
with the README's test command)."""

import doctest
import importlib
import pkgutil

import pytest

import jsparse24
import pallas_kernels


def _modules():
  names = []
  for package in (jsparse24, pallas_kernels):
    names.append(package.__name__)
    names += [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
  return names


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name):
  module = importlib.import_module(name)
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
