"""The dependency ranges in pyproject.toml are the ones the tests run: what is
installed lies inside them, and the cuSPARSELt range is the backend's list of
verified versions."""

import importlib.metadata
import pathlib
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from jsparse24.backends import cusparselt

PYPROJECT = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())


def _requirements(group: str | None) -> dict[str, Requirement]:
  project = PYPROJECT["project"]
  lines = project["dependencies"] if group is None else project["optional-dependencies"][group]
  return {Requirement(line).name: Requirement(line) for line in lines}


@pytest.mark.parametrize("group", [None, "test"])
def test_installed_versions_lie_in_the_declared_ranges(group):
  for name, req in _requirements(group).items():
    if req.marker is not None and not req.marker.evaluate():
      continue
    installed = importlib.metadata.version(name)
    assert req.specifier.contains(installed, prereleases=True), (
        f"{name} {installed} is installed, outside pyproject.toml's {req}")


def test_jax_range_is_the_tested_one():
  # CI runs the suite on the oldest (Python 3.11) and the newest (Python 3.12)
  # jax of this range (.ci/run).
  spec = _requirements(None)["jax"].specifier
  assert spec.contains("0.10.2") and spec.contains("0.12.0.1") and not spec.contains("0.10.1")
  assert not spec.contains("0.13.0")


@pytest.mark.parametrize("group", ["test", "cuda"])
def test_cusparselt_range_is_the_verified_versions(group):
  spec = _requirements(group)["nvidia-cusparselt-cu13"].specifier
  verified = [Version(v) for v in cusparselt.VERIFIED_VERSIONS]
  for v in verified:
    assert spec.contains(f"{v}.0") and spec.contains(f"{v}.9"), (v, spec)
  newest = max(verified)
  assert not spec.contains(f"{newest.major}.{newest.minor + 1}.0")
  oldest = min(verified)
  assert not spec.contains(f"{oldest.major}.{oldest.minor - 1}.9")
  # A minor version between them that was not verified is excluded too.
  for minor in range(oldest.minor + 1, newest.minor):
    if Version(f"{oldest.major}.{minor}") not in verified:
      assert not spec.contains(f"{oldest.major}.{minor}.0"), (minor, spec)
