"""Automatic backend choice: the linear-layer training step over (M, K, N).

    PYTHONPATH=. python benchmarks/bench_auto.py [--kn 1024,2048,4096,8192,16384]
        [--k SIZES] [--n SIZES] [--ms 1024,2048,4096,8192,16384] [--budget SECONDS]
        [--json PATH] [--resume PATH] [--min-time 0.01] [--repeats 5] [--no-write]

`sparse_dot(..., implementation=None)` picks a backend per call with a static
rule (`jsparse24.selected_implementation`). This sweep measures what that rule
is fitted to: one linear-layer training step, jit((x, w, dy) -> (y, dx, dw))
through `jax.vjp`, bf16 x [M, K] and a float32 kernel w [K, N] cast to bf16
in the step (as `nn.Dense(dtype=bfloat16)` does), masking and compression
included, for
  dense                     x @ w (XLA);
  xla                       sparse_dot(implementation="xla"), a plain Mask24 (the
                            fallback: masked dense products);
  cusparselt plain          implementation="cusparselt", a plain Mask24 (dx dense);
  cusparselt transposable   the same with a transposable Mask24 (dx sparse too).
"auto" is not timed again: it is the backend the current rule names for each
mask kind, with that backend's time ("xla" uses the plain-mask time for both
kinds: its products do not depend on the kind).

Two passes over the points a run reaches: first dense and xla at every point,
then the two cuSPARSELt variants at the same points. Once a cuSPARSELt product
has run in a process, its compute-bound kernels (cuBLAS's GEMMs among them)
run 2-7% slower until it ends (docs/design_notes.md, "Dense baselines are
timed before the first sparse product"), which a dense layer in a user's
dense run never pays; so no dense or xla step is
timed after one. Each pass builds each (K, N)'s weight and masks (the same
bits both times) and runs every M; within a pass the variants are timed in
rounds, each round visiting every variant once, and the median per variant is
kept; the spread of the dense step's rounds shows the timing noise. At the
first M of each (K, N) the cuSPARSELt outputs are checked against the xla
ones with the same mask (relative error by norm).

Output: the table (section "Automatic backend choice: training-step sweep" of
benchmarks/results/<gpu>.md unless --no-write), all raw numbers (--json, written
after every point), and per mask kind a K x N table of the smallest M from
which cuSPARSELt is >= 5% faster than dense at that M and every larger M (WIN).

The full grid is 125 points x 4 programs, mostly compile time and cuSPARSELt's
algorithm search (first call of each shape). `--budget` stops before a point
that it estimates would end past that many seconds (counted from the end of
the imports; the dense pass may use 60% of them), writes what it has and
lists the points left (a point whose cuSPARSELt pass did not run counts as
left); `--resume` a JSON
of an earlier run on the same GPU model measures only the points it lacks and
reports them all, so a sweep splits over two device calls:
    python benchmarks/bench_auto.py --budget 530 --no-write --json $OUT/auto.json
    (copy auto.json into the working tree, e.g. benchmarks/results/auto_part1.json)
    python benchmarks/bench_auto.py --budget 530 --resume benchmarks/results/auto_part1.json \
        --json $OUT/auto.json
CPU smoke test (cuSPARSELt columns n/a): --kn 64 --ms 64 --no-write
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import pathlib
import statistics
import time
import traceback

import jax
import jax.numpy as jnp

import jsparse24
from benchmarks import _common

T0 = time.perf_counter()
SIZES = (1024, 2048, 4096, 8192, 16384)
KINDS = ("plain", "transposable")
# variant -> (implementation, mask kind)
VARIANTS = {"dense": ("dense", None), "xla": ("xla", "plain"),
            "cusparselt plain": ("cusparselt", "plain"),
            "cusparselt transposable": ("cusparselt", "transposable")}
# "Faster than dense": dense / cusparselt >= WIN. A 5% margin, not 1%: the
# dense step's rounds spread by ~11% (median over the H200 sweep of
# 2026-11-25), and a cuSPARSELt product anywhere in a model slows the rest of
# its process by 2-7% (docs/design_notes.md, "Dense baselines are timed
# before the first sparse product"), which a layer that gains only a few
# percent does not pay back.
WIN = 1.05
XLA_SLOW = 0.99  # the fallback "more than 1% slower than dense": dense / xla < this
TOL = 1e-2  # relative error (by norm) of cusparselt against xla, bf16
TITLE = "Automatic backend choice: training-step sweep"


def _sizes(text) -> list[int]:
  return [int(v) for v in text.split(",") if v.strip()]


def _elapsed() -> float:
  return time.perf_counter() - T0


@functools.cache
def _normal(shape: tuple[int, int], salt: int) -> jax.Array:
  """A bf16 standard-normal array, cached: x [M, K] is shared by every N, dy
  [M, N] by every K (each new shape is one more compiled program)."""
  seed = (shape[0] * 40503 + shape[1] * 7 + salt) % (2 ** 31)
  return jax.random.normal(jax.random.key(seed), shape, jnp.bfloat16)


def _step(implementation):
  """jit((x, w, mask, dy) -> (y, dx, dw)) for one linear layer as a model has
  it (`nn.Dense(dtype=bfloat16)`): a float32 kernel cast to bf16 in the
  step, its gradient float32; the mask is an argument (not a constant of the
  program), ignored by "dense"."""
  @jax.jit
  def step(x, w, mask, dy):
    if implementation == "dense":
      f = lambda x, w: x @ w.astype(jnp.bfloat16)  # noqa: E731
    else:
      f = lambda x, w: jsparse24.sparse_dot(  # noqa: E731
          x, w.astype(jnp.bfloat16), mask, implementation=implementation)
    y, vjp = jax.vjp(f, x, w)
    return (y,) + vjp(dy)
  return step


def _max_err(got, ref) -> float:
  return max(_common.rel_err(g, r) for g, r in zip(got, ref))


def _first(fn, args, keep=False):
  """(outputs if keep, seconds of the first call: trace, compile, run)."""
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  return (out if keep else None), time.perf_counter() - t0


def _round_robin(calls: dict, opts) -> dict[str, list[float]]:
  """Seconds per call of each `name: (fn, args)`, timed in `opts.repeats`
  rounds that visit every variant once (`_common.bench` with one repeat), so
  that drift between them hits every variant alike. (The variants of one
  pass only: see CLEAN.)"""
  times = {name: [] for name in calls}
  for _ in range(opts.repeats):
    for name, (fn, args) in calls.items():
      times[name].append(_common.bench(fn, *args, min_time=opts.min_time, repeats=1))
  return times


# --- one point ---------------------------------------------------------------------

# Timed first, all of them, before the process runs any cuSPARSELt product:
# once one has run, the process's compute-bound kernels (cuBLAS's GEMMs, so
# the dense and xla steps) run 2-7% slower until it ends, which a dense layer
# in a user's dense run never pays (`_common.CUSPARSELT_TAX`).
CLEAN = ("dense", "xla")
CSLT = ("cusparselt plain", "cusparselt transposable")
# With --budget, the share of it the clean pass may use; the cuSPARSELt pass
# (its first calls search for an algorithm) gets the rest: on an H200 the
# clean pass over 55 points took 207 s (the process's start included) and
# the cuSPARSELt pass over the same points 111 s (at 0.4 a run stopped with
# 40% of its budget unused).
CLEAN_SHARE = 0.6


def _new_rec(m, k, n):
  return {"m": m, "k": k, "n": n, "ms": {}, "first_s": {}, "bench_s": {}, "na": {}, "errors": {},
          "seconds": 0.0}


def _measure(rec, w, masks, steps, opts, names, check):
  """Times the variants `names` of one (M, K, N) point into `rec` (medians
  over `_round_robin`'s rounds) and, with `check`, the error of the
  cuSPARSELt variants against xla with the same mask."""
  t_start = time.perf_counter()
  m, k, n = rec["m"], rec["k"], rec["n"]
  x, dy = _normal((m, k), 1), _normal((m, n), 2)
  outs, calls = {}, {}
  first = {}
  for name in names:
    impl, kind = VARIANTS[name]
    if impl == "cusparselt" and opts.cslt_reason is not None:
      rec["na"][name] = opts.cslt_reason
      continue
    args = (x, w, masks[kind] if kind else None, dy)
    try:
      out, first[name] = _first(steps[impl], args, keep=check)
    except jsparse24.BackendUnavailableError as e:
      rec["na"][name] = str(e)
      continue
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc()
      rec["errors"][name] = f"{type(e).__name__}: {e}"[:500]
      continue
    calls[name] = (steps[impl], args)
    if out is not None:
      outs[name] = out
  rec["first_s"].update(first)
  t0 = time.perf_counter()
  times = _round_robin(calls, opts)
  rec["bench_s"]["+".join(names)] = time.perf_counter() - t0
  for name, ts in times.items():
    rec["ms"][name] = statistics.median(ts) * 1e3
  if "dense" in times:
    ts = times["dense"]
    rec["dense_spread"] = (max(ts) - min(ts)) / statistics.median(ts)
  if check and outs:
    err = rec.setdefault("err", {})
    for kind in KINDS:
      if f"cusparselt {kind}" in outs:
        try:
          ref = jax.block_until_ready(steps["xla"](x, w, masks[kind], dy))
          err[kind] = _max_err(outs[f"cusparselt {kind}"], ref)
          del ref
        except Exception as e:  # pylint: disable=broad-except
          rec["errors"]["check"] = f"{type(e).__name__}: {e}"[:500]
  del outs
  rec["auto"] = _auto(m, k, n)
  took = time.perf_counter() - t_start
  rec["seconds"] += took
  return took


def _auto(m, k, n):
  """Per mask kind, the backend `implementation=None` runs at (M, K, N) here."""
  return {kind: jsparse24.selected_implementation(
      (m, k), (k, n), jnp.bfloat16, transposable=kind == "transposable") for kind in KINDS}


def _complete(rec) -> bool:
  return not rec.get("errors") and all(v in rec["ms"] or v in rec["na"] for v in VARIANTS)


# --- derived numbers ---------------------------------------------------------------

def _ratio(rec, variant):
  """dense / variant (> 1: faster than dense), or None."""
  if rec is None or "dense" not in rec["ms"] or variant not in rec["ms"]:
    return None
  return rec["ms"]["dense"] / rec["ms"][variant]


def _auto_variant(rec, kind):
  name = rec["auto"][kind]
  return {"xla": "xla", "cusparselt": f"cusparselt {kind}"}.get(name)


def _best(rec, kind):
  """The fastest sparse backend for this mask kind: (name, dense / it)."""
  cands = [("xla", "xla"), ("cusparselt", f"cusparselt {kind}")]
  cands = [(name, _ratio(rec, v)) for name, v in cands if _ratio(rec, v) is not None]
  return max(cands, key=lambda c: c[1]) if cands else None


def _min_m(by, k, n, ms, kind):
  """The smallest M of `ms` from which cusparselt (this kind) measured >= WIN
  faster than dense at that M and every larger one: (M or None, complete).
  complete is False where a point on the way down was not measured."""
  best = None
  for m in sorted(ms, reverse=True):
    r = _ratio(by.get((m, k, n)), f"cusparselt {kind}")
    if r is None:
      return best, False
    if r < WIN:
      return best, True
    best = m
  return best, True


def _rule_min_m(by, k, n, ms, kind):
  """The smallest measured M at which the current rule picks cusparselt."""
  picked = [m for m in ms if (m, k, n) in by and by[(m, k, n)]["auto"][kind] == "cusparselt"]
  return min(picked) if picked else None


def _cell(value, complete=True, na=False):
  if na:
    return "n/a"
  text = "never" if value is None else str(value)
  return text if complete else ("?" if value is None else f"{text}*")


def _kn_table(by, ks, ns, ms, kind, rule=False):
  rows = []
  for k in ks:
    row = [k]
    for n in ns:
      recs = [by.get((m, k, n)) for m in ms]
      na = all(r is None or f"cusparselt {kind}" not in r["ms"] for r in recs) and any(
          r is not None and f"cusparselt {kind}" in r["na"] for r in recs)
      if rule:
        row.append(_cell(_rule_min_m(by, k, n, ms, kind)))
      else:
        row.append(_cell(*_min_m(by, k, n, ms, kind), na=na))
    rows.append(row)
  return _common.table(["K \\ N"] + [str(n) for n in ns], rows)


def _fmt_time(rec, variant):
  if variant in rec["ms"]:
    r = _ratio(rec, variant)
    return f"{rec['ms'][variant]:.4g} ({r:.3f}x)" if r is not None else f"{rec['ms'][variant]:.4g}"
  if variant in rec["na"]:
    return "n/a"
  return "error" if variant in rec.get("errors", {}) else "-"


def _fmt_choice(name, ratio):
  return f"{name} {ratio:.3f}x" if ratio is not None else f"{name} (not timed)"


def _row(rec):
  best = {kind: _best(rec, kind) for kind in KINDS}
  auto = {}
  for kind in KINDS:
    v = _auto_variant(rec, kind)
    auto[kind] = _fmt_choice(rec["auto"][kind], _ratio(rec, v) if v else None)
  spread = f"{rec['dense_spread'] * 100:.1f}%" if "dense_spread" in rec else ""
  err = rec.get("err") or {}
  err_text = " / ".join(
      f"{err[kind]:.1e}" + (" FAIL" if err[kind] > TOL else "") if kind in err else "-"
      for kind in KINDS) if "err" in rec else ""
  return [rec["m"], rec["k"], rec["n"],
          f"{rec['ms']['dense']:.4g}" if "dense" in rec["ms"] else "error",
          _fmt_time(rec, "xla"), _fmt_time(rec, "cusparselt plain"),
          _fmt_time(rec, "cusparselt transposable"),
          _fmt_choice(*best["plain"]) if best["plain"] else "-",
          _fmt_choice(*best["transposable"]) if best["transposable"] else "-",
          auto["plain"], auto["transposable"], spread, err_text]


def _progress(rec, done, total, timed):
  ms, first = rec["ms"], rec["first_s"]
  parts = []
  for v, short in (("dense", "dense"), ("xla", "xla"), ("cusparselt plain", "cslt plain"),
                   ("cusparselt transposable", "cslt transp")):
    r = _ratio(rec, v) if v != "dense" else None
    parts.append(f"{short} " + (f"{ms[v]:.4g} ms" + (f" ({r:.3f}x)" if r is not None else "")
                                if v in ms else "n/a" if v in rec["na"]
                                else "ERROR" if v in rec.get("errors", {}) else "-"))
  text = " | ".join(parts)
  text += f" | auto {rec['auto']['plain']}/{rec['auto']['transposable']}"
  text += (" | first call " + "/".join(f"{first[v]:.2f}" if v in first else "-" for v in VARIANTS)
           + " s")
  if "dense_spread" in rec:
    text += f" | dense spread over rounds {rec['dense_spread'] * 100:.1f}%"
  if "err" in rec:
    text += " | err " + " / ".join(
        f"{rec['err'][kind]:.1e}" + (" FAIL" if rec["err"][kind] > TOL else "")
        if kind in rec["err"] else "-" for kind in KINDS)
  if rec.get("errors"):
    text += " | ERRORS: " + "; ".join(f"{v}: {e[:120]}" for v, e in rec["errors"].items())
  print(f"[{timed}: {done:3d}/{total} {_elapsed():5.0f} s {rec['seconds']:5.1f} s] M={rec['m']}"
        f" K={rec['k']} N={rec['n']}: {text}", flush=True)


# --- report ------------------------------------------------------------------------

def _report(state, ks, ns, ms):
  for r in state["points"]:  # the rule as it is now (a resumed point kept its run's)
    r["auto"] = _auto(r["m"], r["k"], r["n"])
  by = {(r["m"], r["k"], r["n"]): r for r in state["points"]}
  recs = [by[(m, k, n)] for k in ks for n in ns for m in ms if (m, k, n) in by]
  headers = ["M", "K", "N", "dense ms", "xla ms (dense/xla)", "cusparselt plain ms (dense/it)",
             "cusparselt transposable ms (dense/it)", "best plain", "best transposable",
             "auto plain (now)", "auto transposable (now)", "dense: spread over rounds",
             "rel err vs xla plain / transposable"]
  body = [_common.table(headers, [_row(r) for r in recs])]
  notes = []
  xla = [r for r in (_ratio(rec, "xla") for rec in recs) if r is not None]
  if xla:
    slow = sum(r < XLA_SLOW for r in xla)
    notes.append(f"xla against dense: median {statistics.median(xla):.3f}x, min {min(xla):.3f}x;"
                 f" {slow} of {len(xla)} points more than {1 - XLA_SLOW:.0%} slower than dense.")
  spreads = [r["dense_spread"] for r in recs if "dense_spread" in r]
  if spreads:
    notes.append(f"Dense step at {len(spreads)} points, (max - min) /"
                 f" median of its rounds: median {statistics.median(spreads) * 100:.2f}%,"
                 f" max {max(spreads) * 100:.2f}%.")
  fails = [(r["m"], r["k"], r["n"], kind) for r in recs for kind, e in (r.get("err") or {}).items()
           if e > TOL]
  checked = sum(1 for r in recs if r.get("err"))
  if checked:
    notes.append(f"cuSPARSELt outputs checked against xla at {checked} points: "
                 + (f"{len(fails)} FAILED (> {TOL:g}): {fails}." if fails
                    else f"all within {TOL:g}."))
  else:
    notes.append("cuSPARSELt outputs not checked (it did not run).")
  errors = [(r["m"], r["k"], r["n"], v) for r in recs for v in r.get("errors", {})]
  if errors:
    notes.append(f"Errors (see the JSON): {errors}.")
  body.append("\n".join(notes))
  for kind in KINDS:
    body.append(f"**{kind.capitalize()} Mask24: cusparselt >= {WIN - 1:.0%} faster than dense"
                f" from M =** (that M and every larger M of the grid; rows K, columns N;"
                f" `never`: not at the largest M; `*`: a smaller M was not measured; `?`: the"
                f" largest M was not measured)\n\n" + _kn_table(by, ks, ns, ms, kind))
  for kind in KINDS:
    body.append(f"Current rule, {kind} Mask24: smallest M at which it picks cusparselt\n\n"
                + _kn_table(by, ks, ns, ms, kind, rule=True))
  missing = [(m, k, n) for k in ks for n in ns for m in ms if (m, k, n) not in by]
  if missing:
    body.append(f"Not measured ({len(missing)} points, M x K x N): "
                + ", ".join(f"{m}x{k}x{n}" for m, k, n in missing))
  summary = {kind: {f"{k}x{n}": dict(zip(("min_m", "complete"), _min_m(by, k, n, ms, kind)))
                    for k in ks for n in ns} for kind in KINDS}
  return "\n\n".join(body), summary, missing


def _write_json(path, state):
  if not path:
    return
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(json.dumps(state, indent=1))
  os.replace(tmp, path)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--kn", default=",".join(map(str, SIZES)), help="K and N sizes")
  p.add_argument("--k", default=None, help="K sizes (default: --kn)")
  p.add_argument("--n", default=None, help="N sizes (default: --kn)")
  p.add_argument("--ms", default=",".join(map(str, SIZES)), help="M sizes")
  p.add_argument("--budget", type=float, default=None,
                 help="seconds from the start; no point is started that would end past it")
  p.add_argument("--json", default=None, help="write all raw numbers here (after every point)")
  p.add_argument("--resume", default=None, help="a previous --json: measure only what it lacks")
  p.add_argument("--min-time", type=float, default=0.01, help="_common.bench min_time")
  p.add_argument("--repeats", type=_common.count, default=7, help="timing rounds over the variants")
  p.add_argument("--no-write", action="store_true", help="print only; leave results/ alone")
  opts = p.parse_args(argv)
  ks, ns = _sizes(opts.k or opts.kn), _sizes(opts.n or opts.kn)
  ms = sorted(_sizes(opts.ms))
  env = _common.environment()
  print(env, flush=True)
  avail = jsparse24.available_implementations()
  print("backends: " + ", ".join(f"{k}: {'ok' if v is None else v}" for k, v in avail.items()),
        flush=True)
  opts.cslt_reason = avail["cusparselt"]

  state = {"title": TITLE, "device": _common.gpu_name(), "runs": [],
           "settings": {"min_time": opts.min_time, "repeats": opts.repeats, "win": WIN, "tol": TOL,
                        "dtype": "bfloat16"},
           "points": [], "masks_s": {}}
  if opts.resume:
    prev = json.loads(pathlib.Path(opts.resume).read_text())
    if prev.get("device") != state["device"]:
      raise SystemExit(f"--resume {opts.resume}: measured on {prev.get('device')!r}, this is"
                       f" {state['device']!r}; not mixing them.")
    state["runs"] = prev.get("runs", [])
    state["points"] = [r for r in prev["points"] if _complete(r)]
    state["masks_s"] = prev.get("masks_s", {})
    print(f"resumed {len(state['points'])} complete points from {opts.resume}", flush=True)
  done_keys = {(r["m"], r["k"], r["n"]) for r in state["points"]}
  todo = [(m, k, n) for k in ks for n in ns for m in ms if (m, k, n) not in done_keys]
  if todo:  # a run that only reports (everything resumed) measured nothing
    state["runs"].append(env)
  total = len(todo)
  print(f"grid K {ks}, N {ns}, M {ms}: {total} points to measure, 4 programs each"
        + (f"; budget {opts.budget:.0f} s" if opts.budget else ""), flush=True)

  skipped, failed, stop, count = [], [], None, 0
  mask_s = 0.0  # the longest weight + masks build so far
  point_s: dict[str, dict[int, float]] = {"clean": {}, "cslt": {}}  # longest point per M

  def estimate(which, m):
    """Seconds a point of this pass at M may take: 1.5x the longest so far at
    this M or larger."""
    done = point_s[which]
    longer = [s for mm, s in done.items() if mm >= m] or list(done.values()) or [0.0]
    return 1.5 * max(longer)

  def inputs(k, n):
    """The float32 weight of (K, N) and its two masks (the same bits in both
    passes), or None where building them failed."""
    nonlocal mask_s
    t0 = time.perf_counter()
    try:
      w = jax.random.normal(jax.random.key(k * 31 + n), (k, n), jnp.float32)
      masks = {"plain": jsparse24.Mask24.from_weights(w),
               "transposable": jsparse24.Mask24.from_weights(w, transposable=True)}
      jax.block_until_ready((w, masks))
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc()
      print(f"K={k} N={n}: weight or masks FAILED ({type(e).__name__}); its points skipped",
            flush=True)
      return None
    state["masks_s"][f"{k}x{n}"] = time.perf_counter() - t0
    mask_s = max(mask_s, time.perf_counter() - t0)
    return w, masks

  steps = {impl: _step(impl) for impl in ("dense", "xla", "cusparselt")}
  # Pass 1: dense and xla at every point this run reaches, before any
  # cuSPARSELt product (CLEAN).
  clean_budget = opts.budget * CLEAN_SHARE if opts.budget else None
  pending = []
  for k in ks:
    for n in ns:
      pair_ms = [m for m in ms if (m, k, n) not in done_keys]
      if not pair_ms:
        continue
      ahead = 1.5 * mask_s + estimate("clean", pair_ms[0])
      if stop is None and clean_budget and _elapsed() + ahead > clean_budget:
        stop = (f"{_elapsed():.0f} s elapsed, the next masks and dense point estimated at"
                f" {ahead:.0f} s past the clean pass's share of the budget")
      if stop is not None:
        skipped += [(m, k, n) for m in pair_ms]
        continue
      built = inputs(k, n)
      if built is None:
        failed += [(m, k, n) for m in pair_ms]
        continue
      for m in pair_ms:
        if stop is None and clean_budget and _elapsed() + estimate("clean", m) > clean_budget:
          stop = f"{_elapsed():.0f} s elapsed, the next dense point estimated at" \
                 f" {estimate('clean', m):.0f} s"
        if stop is not None:
          skipped.append((m, k, n))
          continue
        rec = _new_rec(m, k, n)
        took = _measure(rec, *built, steps, opts, CLEAN, check=False)
        point_s["clean"][m] = max(point_s["clean"].get(m, 0.0), took)
        pending.append(rec)
        state["points"].append(rec)
        _progress(rec, len(pending), total, "dense, xla")
      del built
  state["wall_s"] = _elapsed()
  _write_json(opts.json, state)
  # Pass 2: cuSPARSELt at the same points (the rest of the budget).
  untimed = []
  for (k, n), group in itertools.groupby(pending, key=lambda r: (r["k"], r["n"])):
    group = list(group)
    ahead = 1.5 * mask_s + estimate("cslt", group[0]["m"])
    if opts.budget and _elapsed() + ahead > opts.budget:
      untimed += group
      continue
    # Without cuSPARSELt, `_measure` marks its variants n/a before reading w.
    built = inputs(k, n) if opts.cslt_reason is None else (None, None)
    if built is None:
      untimed += group
      continue
    for i, rec in enumerate(group):
      if opts.budget and _elapsed() + estimate("cslt", rec["m"]) > opts.budget:
        untimed.append(rec)
        continue
      took = _measure(rec, *built, steps, opts, CSLT, check=i == 0)
      point_s["cslt"][rec["m"]] = max(point_s["cslt"].get(rec["m"], 0.0), took)
      count += 1
      _progress(rec, count, len(pending), "cusparselt")
      state["wall_s"] = _elapsed()
      _write_json(opts.json, state)
    del built
  if untimed:
    stop = stop or f"{_elapsed():.0f} s elapsed, the budget's cuSPARSELt pass ran out"
    skipped += [(r["m"], r["k"], r["n"]) for r in untimed]

  body, summary, missing = _report(state, ks, ns, ms)
  state["summary"], state["wall_s"] = summary, _elapsed()
  state["skipped"], state["failed"] = [list(s) for s in skipped], [list(s) for s in failed]
  _write_json(opts.json, state)
  first = {v: sum(r["first_s"].get(v, 0.0) for r in pending) for v in VARIANTS}
  bench_s = sum(sum(r["bench_s"].values()) for r in pending)
  head = (f"{'; '.join(state['runs'])}. One linear-layer training step (y, dx, dw through"
          f" `jax.vjp`), bf16 activations, a float32 kernel cast to bf16 in the step (as"
          f" `nn.Dense(dtype=bfloat16)`), masking and compression included; {opts.repeats}"
          f" rounds of `_common.bench(min_time={opts.min_time}, repeats=1)` over the variants,"
          f" median per variant; dense and xla at every point first, then cuSPARSELt"
          f" ({_common.CUSPARSELT_TAX}). Ratios are dense / variant (> 1: faster"
          f" than dense). `auto`: the backend `jsparse24.selected_implementation` names now, with"
          f" its measured ratio (xla: the plain-mask time). Rel err: cusparselt's (y, dx, dw)"
          f" against xla's with the same mask, max over the three, at the first M of each"
          f" (K, N).\n\n")
  print(f"\n## {TITLE}\n\n{head}{body}\n", flush=True)
  print(f"wall {_elapsed():.0f} s for {count} points: masks {sum(state['masks_s'].values()):.0f} s"
        f" (all runs), first calls (trace + compile + cuSPARSELt search) "
        + ", ".join(f"{v} {s:.0f} s" for v, s in first.items())
        + f", timing {bench_s:.0f} s", flush=True)
  if skipped:
    print(f"STOPPED ({stop}); {len(skipped)} points skipped: "
          + ", ".join(f"{m}x{k}x{n}" for m, k, n in skipped)
          + (f"\nresume with --resume {opts.json}" if opts.json else ""), flush=True)
  if failed:
    print(f"{len(failed)} points not measured (their weight or masks failed): "
          + ", ".join(f"{m}x{k}x{n}" for m, k, n in failed), flush=True)
  if missing and not skipped and not failed:
    print(f"{len(missing)} points of the grid not measured (see the table)", flush=True)
  if not opts.no_write:
    path = _common.write_section(TITLE, head + body)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
  main()
