"""The benchmarks refuse sizes they cannot time, by flag, before any work:
where they took a 0 as the default, raised a bare int() traceback, failed
row by row with exit code 0, or divided by zero after seconds of
measurement."""

import pytest

from benchmarks import (_common, bench_auto, bench_decode, bench_matmul, bench_model, bench_moe,
                        bench_prune, bench_sharded)



def _quick(main):
  """`(main, flags)` of a benchmark's --quick run with `flags` added."""
  return lambda *flags: (main, ["--quick", *flags])


decode, moe = _quick(bench_decode.main), _quick(bench_moe.main)


@pytest.mark.parametrize("main,flags,said", [
    (bench_model.main, ["--widths", "abc"], "--widths 'abc': integers >= 1 separated by commas"),
    (bench_model.main, ["--widths", "0"], "--widths '0': integers >= 1"),  # FAILED rows, exit 0
    (bench_model.main, ["--widths", "128", "--layers", "0"], "--layers '0': integers >= 1"),
    (bench_model.main, ["--widths", "128", "--layers", "1", "--batch", "0"],
     "argument --batch: '0' is not an integer >= 1"),  # took 8
    (bench_model.main, ["--widths", "128", "--layers", "1", "--seq", "0"],
     "argument --seq: '0' is not an integer >= 1"),  # took 2048
    (bench_model.main, ["--small", "--vocab", "0"],
     "argument --vocab: '0' is not an integer >= 1"),  # took 256
    (bench_model.main, ["--widths", "128", "--model-devices", "x"],
     "argument --model-devices: 'x' is not an integer >= 1"),
    (*decode("--widths", "0"), "--widths '0': integers >= 1"),  # 0 % 128 passed the check
    (*decode("--widths", "abc"), "--widths 'abc': integers >= 1 separated by commas"),
    (*decode("--batches", "1,x"), "--batches '1,x': integers >= 1"),
    (*decode("--kernel-ms", "-1"), "--kernel-ms '-1': integers >= 1"),
    (bench_matmul.main, ["--ms", "0"], "--ms '0': integers >= 1"),  # after the bandwidth runs
    (*decode("--context", "0"), "argument --context: '0' is not an integer >= 1"),
    (*moe("--hidden", "0"), "argument --hidden: '0' is not an integer >= 1"),  # took 4 x d_model
    (*moe("--group", "0"), "argument --group: '0' is not an integer >= 1"),  # ZeroDivisionError
    (*moe("--d-model", "-4"), "argument --d-model: '-4' is not an integer >= 1"),
    (*moe("--capacity-factor", "inf"), "--capacity-factor inf must be a finite number > 0"),
    # statistics.median of no timings
    (bench_auto.main, ["--repeats", "0"], "argument --repeats: '0' is not an integer >= 1"),
    (bench_prune.main, ["--size", "0"], "argument --size: '0' is not an integer >= 1"),
    (bench_sharded.main, ["--tokens", "0"], "argument --tokens: '0' is not an integer >= 1"),
    (bench_model.main, ["--widths", "128", "--rebuild-every", "1"],
     "argument --rebuild-every: '1' is not an integer >= 2 (with 1 every step rebuilds)"),
    (*moe("--rebuild-every", "x"), "argument --rebuild-every: 'x' is not an integer >= 2"),
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
