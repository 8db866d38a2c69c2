"""Every Python file of the project compiles on the Python running the
tests: benchmarks and GPU-only tools are not imported by the CPU tests, so a
syntax error there would otherwise reach a GPU machine first."""

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = sorted(p for folder in ("jsparse24", "pallas_kernels", "benchmarks", "examples", "tests")
                 for p in (ROOT / folder).rglob("*.py"))


def test_the_project_has_sources():
  assert len(SOURCES) > 50 and ROOT / "benchmarks" / "sweep_decode.py" in SOURCES


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_source_compiles(path):
  compile(path.read_text(encoding="utf-8"), str(path), "exec")
