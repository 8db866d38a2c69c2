"""The benchmarks refuse sizes they cannot time, by flag, before any work:
where they took a 0 as the default, raised a bare int() traceback, failed
row by row with exit code 0, or divided by zero after seconds of
measurement."""

import pytest

from benchmarks import _common, bench_decode, bench_matmul, bench_model, bench_moe



def _quick(main):
  """`(main, flags)` of a benchmark's --quick run with `flags` added."""
  return lambda *flags: (main, ["--quick", *flags])


decode, moe = _quick(bench_decode.main), _quick(bench_moe.main)


@pytest.mark.parametrize("main,flags,said", [
    (bench_model.main, ["--widths", "abc"], "--widths 'abc': integers >= 1 separated by commas"),
    (bench_model.main, ["--widths", "0"], "--widths '0': integers >= 1"),  # FAILED rows, exit 0
    (bench_model.main, ["--widths", "128", "--layers", "0"], "--layers '0': integers >= 1"),
    (bench_model.main, ["--widths", "128", "--layers", "1", "--batch", "0"],
     "--batch 0 must be >= 1"),  # took 8
    (bench_model.main, ["--widths", "128", "--layers", "1", "--seq", "0"],
     "--seq 0 must be >= 1"),  # took 2048
    (bench_model.main, ["--small", "--vocab", "0"], "--vocab 0 must be >= 1"),  # took 256
    (*decode("--widths", "0"), "--widths '0': integers >= 1"),  # 0 % 128 passed the check
    (*decode("--widths", "abc"), "--widths 'abc': integers >= 1 separated by commas"),
    (*decode("--batches", "1,x"), "--batches '1,x': integers >= 1"),
    (*decode("--kernel-ms", "-1"), "--kernel-ms '-1': integers >= 1"),
    (bench_matmul.main, ["--ms", "0"], "--ms '0': integers >= 1"),  # after the bandwidth runs
    (*moe("--hidden", "0"), "--hidden 0 must be >= 1"),  # took 4 x d_model
    (*moe("--group", "0"), "--group 0 must be >= 1"),  # ZeroDivisionError
    (*moe("--d-model", "-4"), "--d-model -4 must be >= 1"),
    (*moe("--capacity-factor", "inf"), "--capacity-factor inf must be a finite number > 0"),
], ids=lambda v: (v.__module__.split(".")[-1] if callable(v) else " ".join(v)
                  if isinstance(v, list) else "refused"))
def test_a_benchmark_refuses_sizes_it_cannot_time(main, flags, said, capsys, monkeypatch):
  def measured(*args, **kwargs):
    raise AssertionError("measured before the flags were checked")
  monkeypatch.setattr(_common, "copy_bandwidth", measured)
  monkeypatch.setattr(_common, "environment", measured)
  with pytest.raises(SystemExit):
    main([*flags, "--no-write"])
  assert said in capsys.readouterr().err
