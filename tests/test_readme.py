"""README.md stays a short user guide whose code runs as pasted.

Every ```python block is run in a fresh interpreter (CPU, the repository root
as the working directory, no test fixtures): a block meant as an illustration
only must be written as ```text or as prose. The API table names every public
name of `jsparse24`, `jsparse24.optim` and `jsparse24.nnx`.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

import jsparse24

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
MAX_LINES = 300
# Seconds per block; each is a small CPU program (imports and compilation).
TIMEOUT = 120

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
BLOCKS = [(lang.strip(), body) for lang, body in FENCE.findall(README)]
PYTHON = [body for lang, body in BLOCKS if lang == "python"]


def test_readme_is_at_most_300_lines():
  assert len(README.splitlines()) <= MAX_LINES


def test_every_code_block_says_its_language():
  # A block tagged `py`, `python3` or `pycon` would escape the run below.
  langs = [lang for lang, _ in BLOCKS]
  assert set(langs) <= {"python", "bash", "text"}, langs
  assert PYTHON, "README.md has no ```python block"


@pytest.mark.parametrize("index", range(len(PYTHON)))
def test_python_block_runs_as_pasted(index):
  env = dict(os.environ)  # no fake devices; tests/conftest.py's quicker compilation kept
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if "device_count" not in f)
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, "-c", PYTHON[index]], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=TIMEOUT, check=False)
  assert proc.returncode == 0, (
      f"README.md's python block {index + 1} failed:\n{PYTHON[index]}\n"
      f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-4000:]}")


def _mentioned(name: str, prefix: str) -> bool:
  """Whether `prefix + name` is named inside a code span of README.md (a
  top-level name not as an attribute of something else)."""
  before = r"(?<!\w)" if prefix else r"(?<![\w.])"
  pattern = rf"`[^`\n]*{before}{re.escape(prefix + name)}\b[^`\n]*`"
  return re.search(pattern, README) is not None


@pytest.mark.parametrize("module,prefix", [(jsparse24, ""), (jsparse24.optim, "optim."),
                                           (jsparse24.nnx, "nnx.")])
def test_api_table_names_every_public_name(module, prefix):
  missing = [name for name in module.__all__ if not _mentioned(name, prefix)]
  assert not missing, f"README.md does not name {missing}"
