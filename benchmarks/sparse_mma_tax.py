"""Does a sparse MMA slow the rest of its process? (A diagnostic, GPU only.)

    python3 benchmarks/sparse_mma_tax.py [MODE ...]   (default: all modes)

Each mode runs in a fresh process and times, before and after one event, a
cuBLAS GEMM 16384 x 4096 x 16384 and `xᵀx` (16384 x 4096), both bf16 through
PyTorch, with the idle GPU's power and clocks (NVML, 2 s at rest) beside them:
  control     nothing between the timings (the noise);
  cslt        one `torch._cslt_sparse_mm` (cuSPARSELt) 4096³, then 20 s idle;
              the runtime API calls and kernels of that matmul are printed
              (PyTorch's profiler);
  cslt_tiny   the same at 64³;
  mma         a kernel of ours issuing dense `mma.sync` (NVRTC via CuPy), then
              one issuing sparse `mma.sp` (the 2:4 tensor-core instruction);
  cslt_reset  cuSPARSELt, then the CUDA runtime's cache config and stack limit
              set back to their defaults.
It uses no jsparse24 code: the question is whether the slowdown that
`bench_model.py` sees after the first cuSPARSELt product is cuSPARSELt's or
the GPU's (it is the sparse MMA instruction's: docs/design_notes.md, "Dense
baselines are timed before the first sparse product"). Needs
torch (with cuSPARSELt), cupy and nvidia-ml-py, as on the device image.
"""

import ctypes
import glob
import json
import os
import subprocess
import sys
import time

MODES = ("control", "cslt", "cslt_tiny", "mma", "cslt_reset")

KERNELS = r'''
extern "C" __global__ void sparse_mma(float* out, int iters) {
  unsigned a0 = threadIdx.x * 2654435761u, a1 = a0 ^ 0x3c003c00u, a2 = a0 + 17u, a3 = a1 * 3u;
  unsigned b0 = blockIdx.x * 40503u, b1 = b0 ^ 0x3f803f80u, b2 = b0 + 5u, b3 = b1 * 7u;
  float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
  unsigned e = 0x44444444u;  // metadata: elements 0 and 1 of every group of 4
  for (int i = 0; i < iters; ++i) {
    asm volatile("mma.sp.sync.aligned.m16n8k32.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3},"
                 " {%4,%5,%6,%7}, {%8,%9,%10,%11}, {%0,%1,%2,%3}, %12, 0x0;\n"
      : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(b2), "r"(b3), "r"(e));
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = d0 + d1 + d2 + d3;
}
extern "C" __global__ void dense_mma(float* out, int iters) {
  unsigned a0 = threadIdx.x * 2654435761u, a1 = a0 ^ 0x3c003c00u, a2 = a0 + 17u, a3 = a1 * 3u;
  unsigned b0 = blockIdx.x * 40503u, b1 = b0 ^ 0x3f803f80u;
  float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
  for (int i = 0; i < iters; ++i) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3},"
                 " {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = d0 + d1 + d2 + d3;
}
'''


def log(*args):
  print(*args, flush=True)


def idle_state(seconds=2.0):
  """Mean power (W) and clocks (MHz) of the idle GPU over `seconds`."""
  import pynvml  # pylint: disable=import-outside-toplevel
  pynvml.nvmlInit()
  h = pynvml.nvmlDeviceGetHandleByIndex(0)
  power, sm, mem, temp = [], [], [], []
  end = time.time() + seconds
  while time.time() < end:
    power.append(pynvml.nvmlDeviceGetPowerUsage(h) / 1000)
    sm.append(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM))
    mem.append(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM))
    temp.append(pynvml.nvmlDeviceGetTemperature(h, 0))
    time.sleep(0.05)
  return {"W": round(sum(power) / len(power), 1), "sm_MHz": round(sum(sm) / len(sm)),
          "mem_MHz": round(sum(mem) / len(mem)), "C": max(temp)}


def cudart():
  import torch  # pylint: disable=import-outside-toplevel
  site = os.path.join(os.path.dirname(torch.__file__), "..", "nvidia")
  for path in glob.glob(os.path.join(site, "*", "lib", "libcudart.so*")):
    try:
      return ctypes.CDLL(path)
    except OSError:
      pass
  return ctypes.CDLL("libcudart.so")


def limits(rt):
  """The CUDA runtime's device limits and cache config (what a library could
  leave changed)."""
  out = {}
  for i, name in ((0, "stack"), (1, "printf"), (2, "heap"), (4, "pending"), (5, "l2fetch"),
                  (6, "l2persist")):
    v = ctypes.c_size_t(0)
    out[name] = v.value if rt.cudaDeviceGetLimit(ctypes.byref(v), i) == 0 else "error"
  c = ctypes.c_int(0)
  rt.cudaDeviceGetCacheConfig(ctypes.byref(c))
  out["cache_config"] = c.value
  rt.cudaGetLastError()  # an unsupported query must not surface in torch's next call
  return out


def per_call_ms(torch, fn, calls):
  """Median over 5 timed runs of `calls` consecutive calls, after ~0.7 s of warm-up."""
  t0 = time.time()
  while time.time() - t0 < 0.7:
    fn()
    torch.cuda.synchronize()
  times = []
  for _ in range(5):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
      fn()
    end.record()
    end.synchronize()
    times.append(start.elapsed_time(end) / calls)
  return round(sorted(times)[2], 4)


def measure(torch, rt, mode, tag, rows):
  torch.cuda.synchronize()
  time.sleep(1.0)
  idle = idle_state()
  a = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
  b = torch.randn(4096, 16384, device="cuda", dtype=torch.bfloat16)
  gemm = per_call_ms(torch, lambda: a @ b, 60)
  xtx = per_call_ms(torch, lambda: a.T @ a, 100)
  row = {"mode": mode, "tag": tag, "gemm_ms": gemm, "xtx_ms": xtx, "idle": idle,
         "limits": limits(rt)}
  log(json.dumps(row))
  rows.append(row)


def raw_kernel(name):
  import cupy as cp  # pylint: disable=import-outside-toplevel
  kernel = cp.RawKernel(KERNELS, name, options=("--gpu-architecture=sm_90",))
  out = cp.zeros(132 * 4 * 256, dtype=cp.float32)
  kernel((132 * 4,), (256,), (out, cp.int32(20000)))
  cp.cuda.Device().synchronize()
  log(f"{name} ran")


def cslt(torch, shape, trace=False):
  m, k, n = shape
  keep = torch.tensor([1, 1, 0, 0], device="cuda", dtype=torch.bool).repeat(m, k // 4)
  w = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * keep
  x = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
  packed = torch._cslt_compress(w)  # pylint: disable=protected-access
  torch.cuda.synchronize()
  if trace:
    from torch.profiler import ProfilerActivity, profile  # pylint: disable=import-outside-toplevel
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
      y = torch._cslt_sparse_mm(packed, x)  # pylint: disable=protected-access
      torch.cuda.synchronize()
    path = f"/tmp/sparse_mma_tax_trace_{os.getpid()}.json"
    prof.export_chrome_trace(path)
    for e in json.load(open(path))["traceEvents"]:
      if e.get("cat") in ("cuda_runtime", "cuda_driver", "kernel") and not any(
          s in e.get("name", "") for s in ("Event", "GetDevice", "LastError", "IsCapturing")):
        log("  trace:", e.get("cat"), e.get("name"))
  else:
    y = torch._cslt_sparse_mm(packed, x)  # pylint: disable=protected-access
  err = float((y.float() - w.float() @ x.float()).abs().max())
  log(f"cuSPARSELt {shape}: max abs error {err:.3g}")


def run_mode(mode):
  import torch  # pylint: disable=import-outside-toplevel
  torch.cuda.init()
  rt = cudart()
  rows = []
  measure(torch, rt, mode, "start", rows)
  if mode == "control":
    measure(torch, rt, mode, "again", rows)
    measure(torch, rt, mode, "again", rows)
  elif mode == "cslt":
    cslt(torch, (4096, 4096, 4096), trace=True)
    measure(torch, rt, mode, "after cuSPARSELt", rows)
    time.sleep(20)
    measure(torch, rt, mode, "after 20 s more idle", rows)
  elif mode == "cslt_tiny":
    cslt(torch, (64, 64, 64))
    measure(torch, rt, mode, "after cuSPARSELt 64^3", rows)
  elif mode == "mma":
    raw_kernel("dense_mma")
    measure(torch, rt, mode, "after mma.sync (dense)", rows)
    raw_kernel("sparse_mma")
    measure(torch, rt, mode, "after mma.sp (sparse)", rows)
  elif mode == "cslt_reset":
    cslt(torch, (4096, 4096, 4096))
    measure(torch, rt, mode, "after cuSPARSELt", rows)
    log("reset:", rt.cudaDeviceSetCacheConfig(0), rt.cudaDeviceSetLimit(0, 1024))
    measure(torch, rt, mode, "after the reset", rows)
  print("ROWS " + json.dumps(rows), flush=True)


def main(modes):
  table = []
  for mode in modes:
    log(f"===== {mode} {time.strftime('%H:%M:%S')}")
    proc = subprocess.run([sys.executable, __file__, "--one", mode], capture_output=True,
                          text=True, timeout=150, check=False)
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr[-3000:])
    for line in proc.stdout.splitlines():
      if line.startswith("ROWS "):
        table += json.loads(line[5:])
  log("\n| mode | after | GEMM ms | xᵀx ms | idle W | idle SM MHz |")
  log("|---|---|---|---|---|---|")
  for r in table:
    log(f"| {r['mode']} | {r['tag']} | {r['gemm_ms']} | {r['xtx_ms']} | {r['idle']['W']} |"
        f" {r['idle']['sm_MHz']} |")


if __name__ == "__main__":
  if len(sys.argv) == 3 and sys.argv[1] == "--one":
    run_mode(sys.argv[2])
  else:
    unknown = [m for m in sys.argv[1:] if m not in MODES]
    if unknown:
      raise SystemExit(f"sparse_mma_tax.py: unknown mode(s) {unknown}; choose from {MODES}")
    main(sys.argv[1:] or MODES)
