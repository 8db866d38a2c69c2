"""README.md stays a short user guide whose code runs as pasted.

Every ```python block runs as pasted: in a namespace of its own, in a fresh
interpreter that runs the blocks in turn (CPU, the repository root as the
working directory, no test fixtures; one interpreter, not one per block, whose
start and JAX's took 2.5 s each): a block meant as an illustration only must
be written as ```text or as prose. The API table names every public
name of `jsparse24`, `jsparse24.optim` and `jsparse24.nnx`.
"""

import json
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


# Runs each block (argv: a JSON list of them) with globals of its own and
# prints a JSON list: None for a block that ran, else its traceback.
RUNNER = """
import json, sys, traceback
results = []
for block in json.loads(sys.argv[1]):
  try:
    exec(compile(block, "<README.md block>", "exec"), {"__name__": "__main__"})
    results.append(None)
  except BaseException:
    results.append(traceback.format_exc())
print("RESULTS " + json.dumps(results))
"""


def test_python_blocks_run_as_pasted():
  env = dict(os.environ)  # no fake devices; tests/conftest.py's quicker compilation kept
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if "device_count" not in f)
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(PYTHON)], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=TIMEOUT * len(PYTHON),
                        check=False)
  lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
  assert proc.returncode == 0 and lines, (
      f"the README blocks' interpreter failed:\n--- stdout\n{proc.stdout[-4000:]}\n"
      f"--- stderr\n{proc.stderr[-4000:]}")
  results = json.loads(lines[-1][len("RESULTS "):])
  assert len(results) == len(PYTHON)
  failed = [f"README.md's python block {i + 1} failed:\n{PYTHON[i]}\n{error}"
            for i, error in enumerate(results) if error is not None]
  assert not failed, "\n\n".join(failed)


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
