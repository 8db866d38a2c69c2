"""benchmarks/bench_sharded.py on 8 fake CPU devices: its tensor-parallel step
keeps the masks on each device's block, and its table runs end to end."""

import re

import jax
import numpy as np
import pytest

import jsparse24
from benchmarks import bench_sharded
from jsparse24 import _pallas_runtime
from jsparse24.backends.pallas import interpret_mode


def _gathered_bytes_arrays(hlo: str) -> list[str]:
  """The uint8 results of the compiled step's all-gathers (packed masks)."""
  return re.findall(r"= \(?(u8\[[\d,]*\])[^=]*? all-gather(?:-start)?\(", hlo)


@pytest.mark.parametrize("keep", [True, False])
def test_tensor_parallel_step_keeps_the_masks_on_each_devices_block(monkeypatch, keep):
  """The masks rebuilt by the mask kernel every step on a run-time flag (as
  on a GPU) come out of each device's block of the weight. With the state's
  layout kept by the step (`jsparse24.optim.masks_like_kernels` and
  `out_shardings`) they are never gathered; left to XLA (`keep=False`, the
  benchmark before), the step gathered both packed masks every step."""
  if not keep:
    jit = jax.jit
    monkeypatch.setattr(jsparse24.optim, "masks_like_kernels", lambda o, *a: o)
    monkeypatch.setattr(jax, "jit", lambda f, out_shardings=None, **kw: jit(f, **kw))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
  with interpret_mode():
    step, params, opt_state, x = bench_sharded.make(True, 128, 64, mesh, "tp", "pallas")
    # The mask kernels "run natively" only from here on, where `lower` traces
    # the step: the checked program does not depend on the initial masks'
    # bits, so `make`'s init builds them with XLA's search instead of
    # compiling two more interpreted kernel programs (one per kernel shape).
    monkeypatch.setattr(_pallas_runtime, "runs_natively", lambda: True)
    hlo = step.lower(params, opt_state, x).compile().as_text()
  gathered = _gathered_bytes_arrays(hlo)
  assert (gathered == []) == keep, gathered


def test_bench_sharded_table_runs_on_cpu(capsys, monkeypatch):
  """The table's rows (a 2:4 MVUE row with --weight-grad dense,mvue). Each
  step runs once, untimed: the timing loop's back-to-back steps, their
  collectives in flight on 8 fake CPU devices, aborted a CI worker."""
  monkeypatch.setattr(bench_sharded._common, "bench",  # pylint: disable=protected-access
                      lambda fn, *args, **kw: (jax.block_until_ready(fn(*args)), 1e-3)[1])
  bench_sharded.main(["--d", "128", "--tokens", "64", "--implementation", "xla",
                      "--layouts", "data,tp", "--weight-grad", "dense,mvue", "--no-write"])
  lines = capsys.readouterr().out.splitlines()
  rows = [line for line in lines if line.startswith(("| data |", "| tp |"))]
  assert [r.split(" | ")[1] for r in rows] == ["dense", "2:4", "2:4 MVUE"] * 2, rows
  # The dense model at every layout before any 2:4 step (a process that has
  # run a cuSPARSELt product runs its GEMMs slower from then on).
  timed = [tuple(v.strip() for v in line.split(": 1 GPU ")[0].split(None, 1))
           for line in lines if ": 1 GPU " in line]
  assert timed == [("data", "dense"), ("tp", "dense"), ("data", "2:4"), ("tp", "2:4"),
                   ("data", "2:4 MVUE"), ("tp", "2:4 MVUE")], timed
