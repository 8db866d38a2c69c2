"""Which cuSPARSELt versions jsparse24 works with, and how fast each is.

    PYTHONPATH=. python benchmarks/cusparselt_versions.py --homes DEFAULT,/path/to/cusparselt-0.10.0

For each cuSPARSELt install (a directory with `include/` and `lib/`, as
`JSPARSE24_CUSPARSELT_HOME` takes it; `DEFAULT`: the one jsparse24 finds by
itself), in a fresh process each:
  1. the GPU tests of the cuSPARSELt backend (`pytest -m gpu tests/test_gpu.py
     -k "cusparselt or mvue"`): the compressed layout written by jsparse24
     against `cusparseLtSpMMACompress2`'s bytes, the products and gradients
     against the XLA reference (bf16 and fp16), the algorithm cache;
  2. `bench_cusparselt.py --sections forward,step` (dense XLA timed first in
     each process): the forward product and the linear-layer training step
     at its three shapes.
The table (one row per version) goes to benchmarks/results/<gpu>.md,
"cuSPARSELt versions". `jsparse24.backends.cusparselt.VERIFIED_VERSIONS`
lists the versions whose row passed every test.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

from benchmarks import _common

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = ["-m", "gpu", "tests/test_gpu.py", "-k", "cusparselt or mvue"]


def _run(cmd: list[str], env: dict[str, str], log) -> subprocess.CompletedProcess:
  print("$", " ".join(cmd), flush=True)
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
  log.write(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}\n")
  log.flush()
  return proc


def _summary(pytest_output: str) -> str:
  """pytest's last line, e.g. '98 passed, 2 skipped in 120.3s'."""
  lines = [l for l in pytest_output.strip().splitlines() if re.search(r"\d+ (passed|failed)", l)]
  return lines[-1].strip("= ") if lines else "no result (see the log)"


def measure(home: str, log) -> dict:
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  if home != "DEFAULT":
    env["JSPARSE24_CUSPARSELT_HOME"] = home
  tests = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], env, log)
  with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(tmp) / "bench.json"
    bench = _run([sys.executable, "benchmarks/bench_cusparselt.py", "--sections", "forward,step",
                  "--no-write", "--json", str(out)], env, log)
    data = json.loads(out.read_text()) if out.exists() else {}
  version = data.get("cusparselt") or "?"
  if bench.returncode:
    print(bench.stdout[-2000:], bench.stderr[-4000:], flush=True)
  return {"home": home, "version": version, "tests": _summary(tests.stdout),
          "tests_ok": tests.returncode == 0, "records": data.get("records", [])}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--homes", default="DEFAULT",
                 help="comma-separated cuSPARSELt install directories; DEFAULT = the one found")
  p.add_argument("--log", default="cusparselt_versions.log", help="full output of every run")
  p.add_argument("--no-write", action="store_true", help="print only; leave results/ alone")
  args = p.parse_args(argv)
  results = []
  with open(args.log, "w") as log:
    for home in args.homes.split(","):
      results.append(measure(home, log))
      print(json.dumps(results[-1], indent=1), flush=True)
  shapes = sorted({(r["m"], r["k"], r["n"]) for res in results for r in res["records"]})
  headers = ["cuSPARSELt", "GPU tests (cusparselt or mvue)"]
  headers += [f"forward {m}x{k}x{n}" for m, k, n in shapes]
  headers += [f"step {m}x{k}x{n}" for m, k, n in shapes]
  rows = []
  for res in results:
    speed = {(r["section"], r["m"], r["k"], r["n"]): r["dense_ms"] / r["ours_ms"]
             for r in res["records"]}
    rows.append([res["version"], res["tests"]]
                + [speed.get(("forward", *s), float("nan")) for s in shapes]
                + [speed.get(("step", *s), float("nan")) for s in shapes])
  body = (f"{_common.environment()}. Each version in its own processes"
          f" (`JSPARSE24_CUSPARSELT_HOME`); speedups over dense XLA timed in the same process"
          f" before its first cuSPARSELt product: the forward product with the weight"
          f" compressed, and the linear-layer training step (y, dx, dw; transposable"
          f" stored mask; masking and compression included), bf16, M x K x N.\n\n"
          + _common.table(headers, rows))
  print("\n" + body, flush=True)
  if not args.no_write:
    _common.write_section("cuSPARSELt versions", body)


if __name__ == "__main__":
  main()
