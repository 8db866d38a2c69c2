"""benchmarks/bench_act24.py on a CPU at tiny sizes: cuSPARSELt's products by
`tests/triton_removal.py`'s XLA stand-in, the Pallas passes interpreted.
Every section runs, and every dense step is timed before the run's first
cuSPARSELt product (`_common.CUSPARSELT_TAX`)."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks import bench_act24
from jsparse24.backends import cusparselt
from jsparse24.backends.pallas import interpret_mode
from tests import triton_removal


def _stand_ins(monkeypatch, events):

  def product(stand_in):
    def call(*args, **kw):
      events.append("cusparselt")
      return stand_in(*args, **kw)
    return call

  def bench(fn, *args, **_):
    events.append("bench")
    jax.block_until_ready(fn(*args))
    return 1e-3

  monkeypatch.setattr(cusparselt.CusparseltBackend, "unavailable_reason", lambda self: None)
  monkeypatch.setattr(cusparselt, "_check_size", lambda *a: None)
  monkeypatch.setattr(cusparselt, "_sparse_a_matmul",
                      product(triton_removal._stand_in_product))  # pylint: disable=protected-access
  monkeypatch.setattr(cusparselt, "_sparse_b_matmul",
                      product(triton_removal._stand_in_b_product))  # pylint: disable=protected-access
  cusparselt._input_sparse_local.cache_clear()  # pylint: disable=protected-access
  cusparselt._tiles_times_local.cache_clear()  # pylint: disable=protected-access
  cusparselt._pruned_weight_grad_local.cache_clear()  # pylint: disable=protected-access
  cusparselt._batched_matmul.cache_clear()  # pylint: disable=protected-access
  monkeypatch.setattr(bench_act24._common, "bench", bench)
  monkeypatch.setattr(bench_act24._common, "copy_bandwidth", lambda: 1e9)
  monkeypatch.setattr(bench_act24, "KERNEL_SHAPES", ((64, 128),))
  monkeypatch.setattr(bench_act24, "FFN", {"d_model": 64, "hidden": 128, "tokens": 64})


def test_sections_run_and_dense_steps_come_first(monkeypatch, capsys):
  events = []
  _stand_ins(monkeypatch, events)
  with interpret_mode():
    # Blocks that take every branch of `_ffn_step` (the up projection's weight
    # 2:4, its output gradient pruned, tiles, tokens) and no two the same.
    bench_act24.main(["--no-write", "--layer-ms", "64,128", "--layer-kn", "64",
                      "--ffn-blocks", "act,tiles+w,tokens"])
  out = capsys.readouterr().out
  for title in ("squared-ReLU FFN block step", "prune + compress of activations",
                "linear-layer step over M, K, N"):
    assert title in out, out
  # The layer grid's 2 dense and 2 XLA steps, then the block's first (dense)
  # step, before any product on the stand-in; then the 2:4 steps, and the
  # block's dense step timed again at the end of its section.
  first = events.index("cusparselt")
  assert events[:first] == ["bench"] * 5, events
  assert events.count("bench") == 4 + 5 + 2 + 2, events  # layer, block, kernel, layer
  cusparselt._input_sparse_local.cache_clear()  # pylint: disable=protected-access
  cusparselt._batched_matmul.cache_clear()  # pylint: disable=protected-access


def test_ffn_blocks_picks_the_blocks_between_the_dense_ones(monkeypatch, capsys):
  """`--ffn-blocks tiles`: the dense block, the tiles block, the dense block
  again, and no other (each block's step a stand-in: the selection is what
  is tested); an unknown block name is refused with the known ones."""
  stepped = []
  monkeypatch.setattr(bench_act24._common, "bench", lambda fn, *args, **_: 1e-3)  # pylint: disable=protected-access
  monkeypatch.setattr(bench_act24._common, "copy_bandwidth", lambda: 1e9)  # pylint: disable=protected-access
  monkeypatch.setattr(cusparselt.CusparseltBackend, "unavailable_reason", lambda self: None)
  monkeypatch.setattr(bench_act24, "FFN", {"d_model": 64, "hidden": 128, "tokens": 64})
  monkeypatch.setattr(bench_act24, "_ffn_step", lambda variant, mask1: stepped.append(variant)
                      or (lambda p, x, target: (p, jnp.float32(0), x)))
  bench_act24.main(["--no-write", "--sections", "ffn", "--ffn-blocks", "tiles"])
  table = capsys.readouterr().out.split("| block |")[1]
  assert [row.split("|")[1].strip() for row in table.splitlines()[2:] if row.startswith("|")] \
      == ["dense", "tiles", "dense again"], table
  assert stepped == ["dense", "tiles", "dense"], stepped
  with pytest.raises(SystemExit):
    bench_act24.main(["--no-write", "--sections", "ffn", "--ffn-blocks", "tiles,tile"])
  assert "unknown block(s) tile; of act, act+dx" in capsys.readouterr().err
