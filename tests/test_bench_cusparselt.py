"""benchmarks/bench_cusparselt.py's dense baselines (the sections themselves
need a GPU): every dense program the chosen sections compare against is timed
up front, before the run's first cuSPARSELt product, and a section cannot time
one later."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks import bench_cusparselt as bc

SHAPES = ((64, 32, 48), (32, 64, 16))
SWEEP_MS = (16, 32)


@pytest.fixture
def tiny(monkeypatch):
  monkeypatch.setattr(bc, "SHAPES", SHAPES)
  monkeypatch.setattr(bc, "SWEEP_MS", SWEEP_MS)
  monkeypatch.setattr(bc, "_mlp_time", lambda sparse: 0.25 if not sparse else None)
  timed = []

  def bench(fn, *args, **_):
    jax.block_until_ready(fn(*args))
    timed.append(tuple(a.shape for a in args))
    return 1e-3 * len(timed)

  monkeypatch.setattr(bc._common, "bench", bench)
  return timed


def test_every_section_finds_its_dense_baselines(tiny):
  dense = bc.DenseBaselines()
  dense.measure(["compress", "forward", "step", "mvue", "mlp", "sweep", "fp16"])
  for m, k, n in SHAPES:
    for dtype in (jnp.bfloat16, jnp.float16):
      assert dense.seconds("fwd", (m, k, n), dtype) > 0
      assert dense.seconds("step", (m, k, n), dtype) > 0
  for _, k, n in SHAPES:
    for m in SWEEP_MS:
      assert dense.seconds("step", (m, k, n)) > 0
  assert dense.seconds("mlp") == 0.25
  # Each program was timed once, on operands of its own shapes: x, w (and dy).
  assert ((64, 32), (32, 48)) in tiny and ((64, 32), (32, 48), (64, 48)) in tiny
  # Each program once: fwd and step at 2 shapes x 2 dtypes, and the sweep's
  # bfloat16 steps (one of which, 32 x 64 x 16, is also a section shape).
  sweep = {(m, k, n) for _, k, n in SHAPES for m in SWEEP_MS}
  assert len(tiny) == 2 * 2 * 2 + len(sweep - set(SHAPES)) == 11


def test_a_dense_baseline_not_timed_up_front_is_refused(tiny):
  dense = bc.DenseBaselines()
  dense.measure(["step"])
  m, k, n = SHAPES[0]
  assert dense.seconds("step", (m, k, n)) > 0
  with pytest.raises(RuntimeError, match="before the\\s+first cuSPARSELt product"):
    dense.seconds("fwd", (m, k, n))
  with pytest.raises(RuntimeError, match="DenseBaselines.measure"):
    dense.seconds("step", (m, k, n), jnp.float16)
  with pytest.raises(RuntimeError):
    dense.seconds("mlp")
