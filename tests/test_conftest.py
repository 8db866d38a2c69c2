"""tests/conftest.py's choice of tests on a GPU, seen from a pytest run in a
subprocess where JAX answers that its default backend is a GPU."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Imported by the subprocess's pytest (`-p`) before tests/conftest.py.
FAKE_GPU = "import jax\njax.default_backend = lambda: 'gpu'\n"
CPU_TEST = "tests/test_readme.py::test_readme_is_at_most_300_lines"


def _pytest(tmp_path, *args):
  (tmp_path / "fake_gpu.py").write_text(FAKE_GPU)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
  return subprocess.run([sys.executable, "-m", "pytest", "-p", "fake_gpu", "-p",
                         "no:cacheprovider", "-q", "-rs", *args, CPU_TEST], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300, check=False)


def test_a_gpu_skips_the_cpu_tests_saying_how_to_run_them_unless_a_marker_selects(tmp_path):
  """On one GPU, 10 of 399 CPU tests of six modules failed for their
  premises alone (8 fake CPU devices, the CPU's automatic choice)."""
  proc = _pytest(tmp_path)
  assert proc.returncode == 0 and "1 skipped" in proc.stdout, proc.stdout + proc.stderr
  assert "a CPU test: on a GPU machine run the CPU suite with JAX_PLATFORMS=cpu" in proc.stdout
  proc = _pytest(tmp_path, "-m", "not gpu")
  assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout + proc.stderr
