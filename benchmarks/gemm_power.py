"""What bounds a 2:4 product on the GPU: time, power, SM clock and energy per
GEMM, dense cuBLAS against cuSPARSELt. (A diagnostic, GPU only.)

    python3 benchmarks/gemm_power.py [--shapes 16384x4096x16384,...] [--seconds 5]
        [--json PATH]

Each shape `M x K x N` is the forward product of a linear layer, `y[M, N] =
x[M, K] @ w[K, N]`, computed as cuSPARSELt computes jsparse24's (the
weight as the left operand, `w^T[N, K] @ x^T[K, M]`), bf16: dense with
`torch.mm`, 2:4 with `torch._cslt_sparse_mm` on the weight compressed along
K, at the algorithm `torch._cslt_sparse_mm_search` picks. Two ways:
  sustained  back-to-back products for `--seconds`: the steady state of a
             training step, with power (NVML) and the SM clock sampled every
             50 ms and the power-cap throttle reason recorded;
  paced      one product at a time with 30 ms of rest between them (median
             of 25): the GPU below its power cap, so the kernel runs at a
             higher clock -- its speed when power does not bound it.
PyTorch sets up cuSPARSELt's descriptors on the host at every call, so a
back-to-back loop of small products (0.5 ms or less) measures that, not the
kernel: read the paced time there. Every dense product is timed before the
process's first cuSPARSELt product (after one, the process's compute-bound
kernels run slower: `benchmarks/sparse_mma_tax.py`). Uses no jsparse24 code;
needs torch (with cuSPARSELt) and nvidia-ml-py, as on the device image.
"""

import argparse
import json
import statistics
import threading
import time

DEFAULT_SHAPES = "16384x4096x16384,16384x16384x4096,16384x4096x12288,16384x4096x4096,8192x8192x8192"
POWER_CAP_REASON = 0x4  # nvmlClocksThrottleReasonSwPowerCap


class Sampler:
  """NVML power (W), SM clock (MHz) and throttle reasons every 50 ms."""

  def __init__(self):
    import pynvml  # pylint: disable=import-outside-toplevel
    pynvml.nvmlInit()
    self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
    self.samples, self._stop = [], False
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _run(self):
    nv, h = self.nvml, self.handle
    while not self._stop:
      self.samples.append((time.time(), nv.nvmlDeviceGetPowerUsage(h) / 1000,
                           nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                           nv.nvmlDeviceGetCurrentClocksThrottleReasons(h)))
      time.sleep(0.05)

  def stop(self):
    self._stop = True

  def between(self, t0, t1):
    s = [q for q in self.samples if t0 <= q[0] <= t1]
    return {"W": statistics.mean(q[1] for q in s), "MHz": statistics.mean(q[2] for q in s),
            "power_capped": statistics.mean(bool(q[3] & POWER_CAP_REASON) for q in s)}

  def limits(self):
    nv, h = self.nvml, self.handle
    return {"power_limit_W": nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000,
            "max_sm_MHz": nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM),
            "name": nv.nvmlDeviceGetName(h)}


def sustained(torch, sampler, fn, seconds):
  """ms per product over `seconds` of back-to-back products (the first
  second left out of the power and clock means)."""
  for _ in range(10):
    fn()
  torch.cuda.synchronize()
  start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
  t0, n = time.time(), 0
  start.record()
  while time.time() - t0 < seconds:
    for _ in range(10):
      fn()
    n += 10
    torch.cuda.synchronize()
  end.record()
  end.synchronize()
  ms = start.elapsed_time(end) / n
  return {"ms": ms, **sampler.between(t0 + 1.0, time.time())}


def paced(torch, fn, reps=25, rest_s=0.03):
  """Median ms of single products, each after `rest_s` of rest. A spinning
  kernel (~2 ms) runs before each timed product, so that the host's work of
  the call (PyTorch sets up cuSPARSELt's descriptors on every call) is done
  before the product starts and stays out of its time."""
  times = []
  for _ in range(reps):
    time.sleep(rest_s)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(4_000_000)  # pylint: disable=protected-access
    start.record()
    fn()
    end.record()
    end.synchronize()
    times.append(start.elapsed_time(end))
  return statistics.median(times)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shapes", default=DEFAULT_SHAPES)
  p.add_argument("--seconds", type=float, default=5.0)
  p.add_argument("--json", default=None)
  args = p.parse_args()
  import torch  # pylint: disable=import-outside-toplevel
  sampler = Sampler()
  print(json.dumps(sampler.limits()), f"torch {torch.__version__}", flush=True)
  shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
  operands, rows = [], []
  for m, k, n in shapes:  # dense first: no cuSPARSELt product has run yet
    torch.manual_seed(0)
    w_t = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x_t = torch.randn(k, m, device="cuda", dtype=torch.bfloat16)
    dense = lambda w_t=w_t, x_t=x_t: torch.mm(w_t, x_t)  # noqa: E731
    row = {"shape": [m, k, n], "dense": sustained(torch, sampler, dense, args.seconds)}
    row["dense"]["paced_ms"] = paced(torch, dense)
    print(f"{m}x{k}x{n} dense: {json.dumps(row['dense'])}", flush=True)
    operands.append((w_t, x_t))
    rows.append(row)
  for row, (m, k, n) in zip(rows, shapes):
    w_t, x_t = operands.pop(0)
    keep = torch.tensor([1, 1, 0, 0], device="cuda", dtype=torch.bool).repeat(n, k // 4)
    masked = w_t * keep
    packed = torch._cslt_compress(masked)  # pylint: disable=protected-access
    # (torch 2.11 warns that this is deprecated, for torch._C._cusparselt.mm_search)
    alg = torch._cslt_sparse_mm_search(packed, x_t)  # pylint: disable=protected-access
    alg = alg[0] if isinstance(alg, (tuple, list)) else int(alg)
    sparse = lambda packed=packed, x_t=x_t, alg=alg: torch._cslt_sparse_mm(  # noqa: E731  pylint: disable=protected-access
        packed, x_t, alg_id=alg)
    err = float((sparse().float() - masked.float() @ x_t.float()).abs().max())
    row["sparse"] = {"alg_id": alg, "max_abs_err": err,
                     **sustained(torch, sampler, sparse, args.seconds)}
    row["sparse"]["paced_ms"] = paced(torch, sparse)
    print(f"{m}x{k}x{n} 2:4: {json.dumps(row['sparse'])}", flush=True)
    del packed, masked, w_t, x_t
  sampler.stop()
  print("\n| M x K x N | dense ms | W | MHz | J/GEMM | 2:4 ms | W | MHz | J/GEMM"
        " | speedup (sustained) | energy ratio | dense paced ms | 2:4 paced ms"
        " | speedup (paced) | power-capped (dense / 2:4) |")
  print("|" + "---|" * 15)
  for r in rows:
    d, s = r["dense"], r["sparse"]
    dj, sj = d["W"] * d["ms"] / 1e3, s["W"] * s["ms"] / 1e3
    print(f"| {'x'.join(map(str, r['shape']))} | {d['ms']:.3f} | {d['W']:.0f} | {d['MHz']:.0f}"
          f" | {dj:.2f} | {s['ms']:.3f} | {s['W']:.0f} | {s['MHz']:.0f} | {sj:.2f}"
          f" | {d['ms'] / s['ms']:.3f}x | {dj / sj:.3f}x | {d['paced_ms']:.3f}"
          f" | {s['paced_ms']:.3f} | {d['paced_ms'] / s['paced_ms']:.3f}x"
          f" | {d['power_capped']:.0%} / {s['power_capped']:.0%} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"limits": sampler.limits(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
