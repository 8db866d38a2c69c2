"""Which cuSPARSELt versions jsparse24 works with, and how fast each is.

    PYTHONPATH=. python benchmarks/cusparselt_versions.py --homes DEFAULT,/path/to/cusparselt-0.10.0

(`--state FILE` keeps each version's result in FILE and tabulates every
version in it: one invocation per version fits a time-limited machine.)

For each cuSPARSELt install (a directory with `include/` and `lib/`, as
`JSPARSE24_CUSPARSELT_HOME` takes it; `DEFAULT`: the one jsparse24 finds by
itself), in a fresh process each:
  1. the GPU tests of the cuSPARSELt backend (`TESTS`, `--workers` pytest
     processes sharing the GPU): the compressed layout written by jsparse24
     against `cusparseLtSpMMACompress2`'s bytes (bf16 and fp16), the metadata
     kernel, the products and gradients against the XLA reference (transposable
     masks, MVUE weight gradient), the algorithm search and its cache (fp16's
     configuration ids);
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
TESTS = ["-m", "gpu", "tests/test_gpu.py", "-k", "buffers_equal_compress2 or metadata_kernel_on_gpu or algorithm_choice_survives or (cusparselt_matches_reference and mask24_t) or cusparselt_mvue_weight_grad"]


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


def measure(home: str, workers: int, log) -> dict:
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  if home != "DEFAULT":
    env["JSPARSE24_CUSPARSELT_HOME"] = home
  # Several test processes share the GPU: none may take most of its memory.
  tests_env = dict(env, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  parallel = ["-n", str(workers)] if workers > 1 else []
  tests = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *parallel, *TESTS],
               tests_env, log)
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
  p.add_argument("--workers", type=int, default=4, help="pytest processes for the GPU tests")
  p.add_argument("--state", default=None,
                 help="JSON file of earlier versions' results: read, extended, tabulated")
  p.add_argument("--no-write", action="store_true", help="print only; leave results/ alone")
  args = p.parse_args(argv)
  state = pathlib.Path(args.state) if args.state else None
  results = json.loads(state.read_text()) if state and state.exists() else []
  with open(args.log, "a") as log:
    for home in args.homes.split(","):
      results.append(measure(home, args.workers, log))
      print(json.dumps(results[-1], indent=1), flush=True)
      if state:
        state.write_text(json.dumps(results, indent=1))
  shapes = sorted({(r["m"], r["k"], r["n"]) for res in results for r in res["records"]})
  headers = ["cuSPARSELt", "GPU tests (`TESTS`)"]
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
