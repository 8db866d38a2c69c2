"""docs/code_map.md, the maintainers' map of the code, names every module of
`jsparse24/` and `pallas_kernels/`, and every path it names exists: a module
added, renamed or removed without its line fails here."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAP = ROOT / "docs" / "code_map.md"


def _modules() -> list[str]:
  return sorted(str(p.relative_to(ROOT)) for folder in ("jsparse24", "pallas_kernels")
                for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".cc"))


def _named() -> set[str]:
  return set(re.findall(r"`((?:jsparse24|pallas_kernels|tests|benchmarks|examples|docs)/[\w/.]+)`",
                        MAP.read_text(encoding="utf-8")))


def test_every_module_is_on_the_map():
  modules = _modules()
  assert len(modules) > 40 and "jsparse24/backends/cusparselt_ffi.cc" in modules
  missing = [m for m in modules if m not in _named()]
  assert not missing, f"docs/code_map.md does not name {missing}: add a line for each"


def test_every_path_on_the_map_exists():
  gone = sorted(p for p in _named() if not (ROOT / p).exists())
  assert not gone, f"docs/code_map.md names {gone}, which do not exist"
