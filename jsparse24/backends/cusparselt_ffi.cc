// jsparse24's cuSPARSELt shim: XLA FFI handlers for 2:4 compression and the
// sparse matmul, plus two C helpers that Python calls through ctypes.
//
// Built on first use by jsparse24/backends/_cusparselt_build.py (g++, the
// cuSPARSELt and CUDA headers, XLA's FFI headers from jax.ffi.include_dir()).
//
// The shim does not link libcusparseLt. jsp_cusparselt_open, which Python
// calls first, dlopens the file that jsparse24 found (JSPARSE24_CUSPARSELT_HOME,
// the pip wheels, ...) by its path and takes every cuSPARSELt function from
// that handle into one table (CusparseLt); everything else calls through the
// table. Linked by soname instead, the shim would get whichever
// libcusparseLt.so.0 the process loaded first: torch loads its own at import,
// and the user's choice was then silently ignored. A path that is not an
// already-loaded object's path loads a second copy, private to the shim. The
// library must be the version of the header the shim was compiled with
// (major.minor; checked on opening), or types and structure sizes could
// disagree without any error. libcudart stays linked: XLA's CUDA runtime is
// the one to share.
//
// Everything that costs host time is cached per device for the life of the
// process: the cuSPARSELt handle, the structured-matrix descriptors used by
// compression, and the matmul plans (descriptors, algorithm selection, plan).
// How a plan picks its algorithm (attributes `search` and `alg`):
//   search=0: cuSPARSELt's default, or configuration id `alg` if alg >= 0;
//   search=1: cusparseLtMatmulSearch, once, on the plan's first execution
//             (with the real buffers);
//   search=2: jsparse24's own search, likewise once: times configuration ids
//             0 .. min(alg, the library's maximum id + 1) - 1 (CUDA events, on
//             the real buffers; each id has its own cached plan; an id whose
//             plan cannot be made is skipped) and runs the fastest's plan
//             from then on. For when cusparseLtMatmulSearch cannot be used (it
//             tries every id, and with cuSPARSELt 0.8.0 on an H200 the
//             float16 ids from 34 on hit an illegal instruction).
//   search=3: both: cusparseLtMatmulSearch, then its pick timed beside the
//             ids of search=2 in the same way; the fastest is kept. (Its pick
//             alone was once 2.2x slower than search=2's: bfloat16, H100;
//             benchmarks/results/nvidia-h100-80gb-hbm3.md, "cuSPARSELt
//             algorithm search modes".)
// A search's result (configuration id and split-K settings) is written to the
// algorithm cache file, if one is set (jsp_cusparselt_set_algorithm_cache),
// keyed by the GPU, the cuSPARSELt version and the plan's key; a later process
// reads it instead of searching again, so that a resumed run computes with the
// same algorithm (bit for bit) and skips the search's cost.
// Cached objects are never destroyed: they live as long as the CUDA context,
// and destroying them from a static destructor after CUDA has shut down
// would crash at exit. Objects made by a call that fails midway are destroyed
// before it returns.
//
// Every CUDA / cuSPARSELt status is checked; a failure becomes an FFI error
// that names the failing call.

#include <cuda_runtime_api.h>
#include <cusparseLt.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Every cuSPARSELt function the shim calls.
#define JSP_CUSPARSELT_FUNCTIONS(X)                                         \
  X(cusparseLtDenseDescriptorInit)                                          \
  X(cusparseLtGetErrorName)                                                 \
  X(cusparseLtGetErrorString)                                               \
  X(cusparseLtGetProperty)                                                  \
  X(cusparseLtInit)                                                         \
  X(cusparseLtMatDescriptorDestroy)                                         \
  X(cusparseLtMatmul)                                                       \
  X(cusparseLtMatmulAlgGetAttribute)                                        \
  X(cusparseLtMatmulAlgSelectionDestroy)                                    \
  X(cusparseLtMatmulAlgSelectionInit)                                       \
  X(cusparseLtMatmulAlgSetAttribute)                                        \
  X(cusparseLtMatmulDescriptorInit)                                         \
  X(cusparseLtMatmulGetWorkspace)                                           \
  X(cusparseLtMatmulPlanDestroy)                                            \
  X(cusparseLtMatmulPlanInit)                                               \
  X(cusparseLtMatmulSearch)                                                 \
  X(cusparseLtSpMMACompress2)                                               \
  X(cusparseLtSpMMACompressedSize2)                                         \
  X(cusparseLtStructuredDescriptorInit)

// The opened library's functions, typed by the header's declarations, so that
// every call is checked against them. Members keep the functions' names, which
// the JSP_CSLT macros print when a call fails.
struct CusparseLt {
#define JSP_MEMBER(name) decltype(&::name) name = nullptr;
  JSP_CUSPARSELT_FUNCTIONS(JSP_MEMBER)
#undef JSP_MEMBER
};

// The library is opened once per process and never closed (cached objects
// live as long as the CUDA context; see above). g_lt is written once, under
// g_lt_mu, before g_lt_opened is set; readers check g_lt_opened (acquire)
// at every entry point, so a pointer of g_lt is never used before it is set,
// and open checked that none is null.
std::mutex g_lt_mu;
CusparseLt g_lt;
std::string g_lt_path;  // as given to jsp_cusparselt_open
std::string g_lt_real_path;  // realpath() of it
std::atomic<bool> g_lt_opened{false};

bool Opened() { return g_lt_opened.load(std::memory_order_acquire); }

const CusparseLt& Lt() { return g_lt; }

std::string NotOpenedMessage() {
  return "jsparse24's cuSPARSELt shim: no cuSPARSELt library is open"
         " (jsp_cusparselt_open must succeed first; _cusparselt_build.load() calls it)";
}

std::string CsltMessage(const char* call, cusparseStatus_t status) {
  const char* name = Lt().cusparseLtGetErrorName(status);
  const char* text = Lt().cusparseLtGetErrorString(status);
  return std::string(call) + " failed: " + (name ? name : "?") + " (" +
         (text ? text : "") + ")";
}

std::string CudaMessage(const char* call, cudaError_t status) {
  return std::string(call) + " failed: " + cudaGetErrorName(status) + " (" +
         cudaGetErrorString(status) + ")";
}

// Calls FN(ARGS...) and returns an ffi::Error naming FN on failure. A string
// message instead of an ffi::Error is produced by the *_MSG variants (used by
// the helpers that return std::string errors).
#define JSP_CSLT(fn, args)                                          \
  do {                                                              \
    cusparseStatus_t jsp_status_ = Lt().fn args;                   \
    if (jsp_status_ != CUSPARSE_STATUS_SUCCESS)                     \
      return ffi::Error::Internal(CsltMessage(#fn, jsp_status_));   \
  } while (0)

#define JSP_CSLT_MSG(fn, args)                                      \
  do {                                                              \
    cusparseStatus_t jsp_status_ = Lt().fn args;                   \
    if (jsp_status_ != CUSPARSE_STATUS_SUCCESS)                     \
      return CsltMessage(#fn, jsp_status_);                         \
  } while (0)

#define JSP_CUDA(fn, args)                                          \
  do {                                                              \
    cudaError_t jsp_status_ = fn args;                              \
    if (jsp_status_ != cudaSuccess)                                 \
      return ffi::Error::Internal(CudaMessage(#fn, jsp_status_));   \
  } while (0)

#define JSP_CUDA_MSG(fn, args)                                      \
  do {                                                              \
    cudaError_t jsp_status_ = fn args;                              \
    if (jsp_status_ != cudaSuccess) return CudaMessage(#fn, jsp_status_); \
  } while (0)

// Makes `device` current for the scope (XLA normally has it current already).
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) : device_(device) {}
  std::string Enter() {
    JSP_CUDA_MSG(cudaGetDevice, (&old_));
    if (old_ != device_) {
      JSP_CUDA_MSG(cudaSetDevice, (device_));
      changed_ = true;
    }
    return "";
  }
  ~ScopedDevice() {
    if (changed_) cudaSetDevice(old_);
  }

 private:
  int device_;
  int old_ = -1;
  bool changed_ = false;
};

std::mutex g_mu;  // guards the three caches below (not the objects in them)

std::map<int, std::unique_ptr<cusparseLtHandle_t>>& Handles() {
  static auto* handles = new std::map<int, std::unique_ptr<cusparseLtHandle_t>>;
  return *handles;
}

// The cuSPARSELt handle of `device` (created with that device current).
std::string GetHandle(int device, const cusparseLtHandle_t** out) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto& handles = Handles();
  auto it = handles.find(device);
  if (it == handles.end()) {
    ScopedDevice scoped(device);
    std::string err = scoped.Enter();
    if (!err.empty()) return err;
    auto handle = std::make_unique<cusparseLtHandle_t>();
    JSP_CSLT_MSG(cusparseLtInit, (handle.get()));
    it = handles.emplace(device, std::move(handle)).first;
  }
  *out = it->second.get();
  return "";
}

cudaDataType_t ValueType(int dtype_code) {
  return dtype_code == 0 ? CUDA_R_16BF : CUDA_R_16F;
}

cusparseOrder_t Order(int64_t order) {
  return order == 0 ? CUSPARSE_ORDER_ROW : CUSPARSE_ORDER_COL;
}

cusparseOperation_t Op(int64_t op) {
  return op == 0 ? CUSPARSE_OPERATION_NON_TRANSPOSE
                 : CUSPARSE_OPERATION_TRANSPOSE;
}

int64_t LeadingDim(int64_t rows, int64_t cols, int64_t order) {
  return order == 0 ? cols : rows;
}

// ---------------------------------------------------------------------------
// Structured descriptors (compression) and sizes.

using SparseKey = std::tuple<int, int, int64_t, int64_t, int64_t>;

struct SparseDesc {
  cusparseLtMatDescriptor_t desc;
  size_t compressed_size = 0;
  size_t buffer_size = 0;
};

std::map<SparseKey, std::unique_ptr<SparseDesc>>& SparseDescs() {
  static auto* descs = new std::map<SparseKey, std::unique_ptr<SparseDesc>>;
  return *descs;
}

std::string GetSparseDesc(int device, int dtype_code, int64_t rows,
                          int64_t cols, int64_t order, const SparseDesc** out) {
  const cusparseLtHandle_t* handle;
  std::string err = GetHandle(device, &handle);
  if (!err.empty()) return err;
  std::lock_guard<std::mutex> lock(g_mu);
  SparseKey key{device, dtype_code, rows, cols, order};
  auto& descs = SparseDescs();
  auto it = descs.find(key);
  if (it == descs.end()) {
    auto d = std::make_unique<SparseDesc>();
    JSP_CSLT_MSG(cusparseLtStructuredDescriptorInit,
                 (handle, &d->desc, rows, cols, LeadingDim(rows, cols, order),
                  16, ValueType(dtype_code), Order(order),
                  CUSPARSELT_SPARSITY_50_PERCENT));
    JSP_CSLT_MSG(cusparseLtSpMMACompressedSize2,
                 (handle, &d->desc, &d->compressed_size, &d->buffer_size));
    it = descs.emplace(key, std::move(d)).first;
  }
  *out = it->second.get();
  return "";
}

// ---------------------------------------------------------------------------
// Matmul plans.

// device, dtype, m, n, k, op_a, op_b, sparse_a, order_a, order_b, order_d,
// search, alg
using PlanKey = std::tuple<int, int, int64_t, int64_t, int64_t, int64_t, int64_t,
                           int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;

struct Plan {
  cusparseLtMatDescriptor_t a, b, d;
  cusparseLtMatmulDescriptor_t matmul;
  cusparseLtMatmulAlgSelection_t alg;
  cusparseLtMatmulPlan_t plan;
  size_t compressed_size = 0;  // of the structured operand
  std::mutex search_mu;
  bool searched = false;
  const Plan* chosen = nullptr;  // search=2, 3: the fastest id's plan
  // Which cuSPARSELt objects exist (destroyed by PlanGuard if making the
  // plan fails midway).
  int made_matrices = 0;
  bool made_alg = false, made_plan = false;
};

// Destroys a plan's cuSPARSELt objects unless released: a plan whose making
// failed midway leaks nothing.
class PlanGuard {
 public:
  explicit PlanGuard(Plan* p) : p_(p) {}
  void Release() { p_ = nullptr; }
  ~PlanGuard() {
    if (p_ == nullptr) return;
    if (p_->made_plan) Lt().cusparseLtMatmulPlanDestroy(&p_->plan);
    if (p_->made_alg) Lt().cusparseLtMatmulAlgSelectionDestroy(&p_->alg);
    cusparseLtMatDescriptor_t* matrices[3] = {&p_->a, &p_->b, &p_->d};
    for (int i = 0; i < p_->made_matrices; ++i)
      Lt().cusparseLtMatDescriptorDestroy(matrices[i]);
  }

 private:
  Plan* p_;
};

// A pair of CUDA events, destroyed on every return path.
class EventPair {
 public:
  std::string Create() {
    JSP_CUDA_MSG(cudaEventCreate, (&start));
    made_start_ = true;
    JSP_CUDA_MSG(cudaEventCreate, (&stop));
    made_stop_ = true;
    return "";
  }
  ~EventPair() {
    if (made_start_) cudaEventDestroy(start);
    if (made_stop_) cudaEventDestroy(stop);
  }
  cudaEvent_t start = nullptr, stop = nullptr;

 private:
  bool made_start_ = false, made_stop_ = false;
};

// ---------------------------------------------------------------------------
// The algorithm cache file: one line per searched plan,
//   <key> <config id> <split-K> <split-K mode> <split-K buffers>
// with no spaces in <key>. Lines are appended (O_APPEND writes of one short
// line: concurrent processes do not interleave them); the last line of a key
// wins when read.

struct Choice {
  int config_id, split_k, split_k_mode, split_k_buffers;
};

std::mutex g_cache_mu;  // guards the three below
std::string g_cache_path;
bool g_cache_read = false;
std::map<std::string, Choice> g_cache;
int64_t g_searches = 0;  // searches run by this process (read by the tests)

// The version of the library whose table `lt` is (no device needed).
cusparseStatus_t LibraryVersion(const CusparseLt& lt, int* major, int* minor, int* patch) {
  cusparseStatus_t s = lt.cusparseLtGetProperty(MAJOR_VERSION, major);
  if (s == CUSPARSE_STATUS_SUCCESS) s = lt.cusparseLtGetProperty(MINOR_VERSION, minor);
  if (s == CUSPARSE_STATUS_SUCCESS) s = lt.cusparseLtGetProperty(PATCH_LEVEL, patch);
  return s;
}

std::string VersionText(int major, int minor, int patch) {
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

// Opens the cuSPARSELt library at `path` and fills g_lt from it; "" or why not.
std::string OpenLibrary(const char* path) {
  // A name without a slash would be looked up by soname, and could give the
  // copy that another library loaded.
  if (path == nullptr || std::string(path).find('/') == std::string::npos)
    return std::string("jsp_cusparselt_open needs the path of a cuSPARSELt library, got ") +
           (path == nullptr ? "none" : "\"" + std::string(path) + "\"");
  std::string file = path;
  char* real = realpath(path, nullptr);
  std::string real_path = real != nullptr ? real : file;
  std::free(real);
  std::lock_guard<std::mutex> lock(g_lt_mu);
  if (g_lt_opened.load(std::memory_order_relaxed)) {
    // Objects made by one library must never reach another's functions, so
    // a process keeps the library it opened first (Python's load() is
    // cached per process too; this refuses any other caller).
    if (real_path == g_lt_real_path) return "";
    return "this process already uses the cuSPARSELt library " + g_lt_path +
           " and cannot also open " + file + " (one cuSPARSELt library per process)";
  }
  // RTLD_LOCAL keeps the copy's symbols out of the global scope, where they
  // would interpose on another copy's users. RTLD_DEEPBIND makes the copy's
  // own references bind within it first: libcusparseLt.so.0 (0.8.0) calls
  // its exported cusparseLtMatmul through its PLT (from
  // cusparseLtMatmulSearch), and without it that call would go to a copy
  // that torch had put into the global scope.
  void* handle = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
  if (handle == nullptr) {
    const char* why = dlerror();
    return "cannot open the cuSPARSELt library " + file + ": " + (why ? why : "dlopen failed");
  }
  // A library that fails a check below stays loaded, unused: unloading one
  // that may have started CUDA is not safe.
  CusparseLt lt;
  std::string missing;
#define JSP_LOOK_UP(name)                                                 \
  lt.name = reinterpret_cast<decltype(lt.name)>(dlsym(handle, #name));    \
  if (lt.name == nullptr) missing += std::string(missing.empty() ? "" : ", ") + #name;
  JSP_CUSPARSELT_FUNCTIONS(JSP_LOOK_UP)
#undef JSP_LOOK_UP
  if (!missing.empty())
    return "the cuSPARSELt library " + file + " lacks " + missing +
           ", which jsparse24's shim calls (is it cuSPARSELt " +
           VersionText(CUSPARSELT_VER_MAJOR, CUSPARSELT_VER_MINOR, CUSPARSELT_VER_PATCH) + "?)";
  int major = -1, minor = -1, patch = -1;
  cusparseStatus_t s = LibraryVersion(lt, &major, &minor, &patch);
  if (s != CUSPARSE_STATUS_SUCCESS)
    return "the cuSPARSELt library " + file + ": cusparseLtGetProperty failed (status " +
           std::to_string(static_cast<int>(s)) + ")";
  if (major != CUSPARSELT_VER_MAJOR || minor != CUSPARSELT_VER_MINOR)
    return "the cuSPARSELt library " + file + " is version " + VersionText(major, minor, patch) +
           ", but jsparse24's shim was compiled with the header of cuSPARSELt " +
           VersionText(CUSPARSELT_VER_MAJOR, CUSPARSELT_VER_MINOR, CUSPARSELT_VER_PATCH) +
           " (a header and a library of different major.minor versions may disagree on"
           " types and structure sizes); use the include/ and lib/ of one cuSPARSELt install"
           " (JSPARSE24_CUSPARSELT_HOME)";
  g_lt = lt;
  g_lt_path = file;
  g_lt_real_path = real_path;
  g_lt_opened.store(true, std::memory_order_release);
  return "";
}

std::map<std::string, Choice>& CachedChoices() {  // g_cache_mu held
  if (!g_cache_read && !g_cache_path.empty()) {
    // C stdio, not iostreams: the shim is loaded into processes that carry
    // other libstdc++ builds (jaxlib, torch), and its stream code crashed there.
    if (FILE* in = std::fopen(g_cache_path.c_str(), "r")) {
      char key[1024];
      Choice c;
      while (std::fscanf(in, "%1023s %d %d %d %d", key, &c.config_id, &c.split_k,
                         &c.split_k_mode, &c.split_k_buffers) == 5)
        g_cache[key] = c;
      std::fclose(in);
    }
    g_cache_read = true;
  }
  return g_cache;
}

// "<gpu name>/sm<major><minor>/cusparselt<version>/<the plan key>", spaces
// replaced, or "" when the GPU cannot be named.
std::string CacheKey(const PlanKey& key) {
  auto [device, dtype_code, m, n, k, op_a, op_b, sparse_a, order_a, order_b, order_d,
        search, alg] = key;
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) return "";
  int major = 0, minor = 0, patch = 0;
  if (LibraryVersion(Lt(), &major, &minor, &patch) != CUSPARSE_STATUS_SUCCESS) return "";
  char text[1024];
  std::snprintf(text, sizeof(text),
                "%s/sm%d%d/cusparselt%d.%d.%d/%d,%lld,%lld,%lld,%lld,%lld,%lld,%lld,%lld,%lld,"
                "%lld,%lld",
                prop.name, prop.major, prop.minor, major, minor, patch, dtype_code,
                static_cast<long long>(m), static_cast<long long>(n),
                static_cast<long long>(k), static_cast<long long>(op_a),
                static_cast<long long>(op_b), static_cast<long long>(sparse_a),
                static_cast<long long>(order_a), static_cast<long long>(order_b),
                static_cast<long long>(order_d), static_cast<long long>(search),
                static_cast<long long>(alg));
  std::string s = text;
  for (char& ch : s)
    if (ch == ' ' || ch == '\t' || ch == '\n') ch = '_';
  return s;
}

std::optional<Choice> LookUpChoice(const std::string& key) {
  if (key.empty()) return std::nullopt;
  std::lock_guard<std::mutex> lock(g_cache_mu);
  auto& cache = CachedChoices();
  auto it = cache.find(key);
  if (it == cache.end()) return std::nullopt;
  return it->second;
}

void RecordChoice(const std::string& key, const Choice& c) {
  std::lock_guard<std::mutex> lock(g_cache_mu);
  ++g_searches;
  if (key.empty() || g_cache_path.empty()) return;
  CachedChoices()[key] = c;
  if (FILE* out = std::fopen(g_cache_path.c_str(), "a")) {
    std::fprintf(out, "%s %d %d %d %d\n", key.c_str(), c.config_id, c.split_k,
                 c.split_k_mode, c.split_k_buffers);
    std::fclose(out);
  }
}

std::string ReadChoice(const cusparseLtHandle_t* handle, const Plan& p, Choice* c) {
  JSP_CSLT_MSG(cusparseLtMatmulAlgGetAttribute,
               (handle, &p.alg, CUSPARSELT_MATMUL_ALG_CONFIG_ID, &c->config_id,
                sizeof(c->config_id)));
  JSP_CSLT_MSG(cusparseLtMatmulAlgGetAttribute,
               (handle, &p.alg, CUSPARSELT_MATMUL_SPLIT_K, &c->split_k, sizeof(c->split_k)));
  JSP_CSLT_MSG(cusparseLtMatmulAlgGetAttribute,
               (handle, &p.alg, CUSPARSELT_MATMUL_SPLIT_K_MODE, &c->split_k_mode,
                sizeof(c->split_k_mode)));
  JSP_CSLT_MSG(cusparseLtMatmulAlgGetAttribute,
               (handle, &p.alg, CUSPARSELT_MATMUL_SPLIT_K_BUFFERS, &c->split_k_buffers,
                sizeof(c->split_k_buffers)));
  return "";
}

std::string ApplyChoice(const cusparseLtHandle_t* handle, Plan* p, const Choice& c) {
  JSP_CSLT_MSG(cusparseLtMatmulAlgSetAttribute,
               (handle, &p->alg, CUSPARSELT_MATMUL_ALG_CONFIG_ID, &c.config_id,
                sizeof(c.config_id)));
  JSP_CSLT_MSG(cusparseLtMatmulAlgSetAttribute,
               (handle, &p->alg, CUSPARSELT_MATMUL_SPLIT_K, &c.split_k, sizeof(c.split_k)));
  JSP_CSLT_MSG(cusparseLtMatmulAlgSetAttribute,
               (handle, &p->alg, CUSPARSELT_MATMUL_SPLIT_K_MODE, &c.split_k_mode,
                sizeof(c.split_k_mode)));
  JSP_CSLT_MSG(cusparseLtMatmulAlgSetAttribute,
               (handle, &p->alg, CUSPARSELT_MATMUL_SPLIT_K_BUFFERS, &c.split_k_buffers,
                sizeof(c.split_k_buffers)));
  return "";
}

std::map<PlanKey, std::unique_ptr<Plan>>& Plans() {
  static auto* plans = new std::map<PlanKey, std::unique_ptr<Plan>>;
  return *plans;
}

std::string InitMatrix(const cusparseLtHandle_t* handle,
                       cusparseLtMatDescriptor_t* desc, bool structured,
                       int64_t rows, int64_t cols, int64_t order,
                       cudaDataType_t type) {
  int64_t ld = LeadingDim(rows, cols, order);
  if (structured) {
    JSP_CSLT_MSG(cusparseLtStructuredDescriptorInit,
                 (handle, desc, rows, cols, ld, 16, type, Order(order),
                  CUSPARSELT_SPARSITY_50_PERCENT));
  } else {
    JSP_CSLT_MSG(cusparseLtDenseDescriptorInit,
                 (handle, desc, rows, cols, ld, 16, type, Order(order)));
  }
  return "";
}

std::string GetPlan(const PlanKey& key, const cusparseLtHandle_t* handle,
                    Plan** out) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto& plans = Plans();
  auto it = plans.find(key);
  if (it == plans.end()) {
    auto [device, dtype_code, m, n, k, op_a, op_b, sparse_a, order_a, order_b,
          order_d, search, alg] = key;
    (void)device;
    cudaDataType_t type = ValueType(dtype_code);
    auto p = std::make_unique<Plan>();
    PlanGuard guard(p.get());
    // D = op(A) op(B): op(A) is m x k, op(B) is k x n, D is m x n.
    int64_t a_rows = op_a == 0 ? m : k, a_cols = op_a == 0 ? k : m;
    int64_t b_rows = op_b == 0 ? k : n, b_cols = op_b == 0 ? n : k;
    std::string err;
    err = InitMatrix(handle, &p->a, sparse_a != 0, a_rows, a_cols, order_a, type);
    if (!err.empty()) return err;
    p->made_matrices = 1;
    err = InitMatrix(handle, &p->b, sparse_a == 0, b_rows, b_cols, order_b, type);
    if (!err.empty()) return err;
    p->made_matrices = 2;
    err = InitMatrix(handle, &p->d, false, m, n, order_d, type);
    if (!err.empty()) return err;
    p->made_matrices = 3;
    JSP_CSLT_MSG(cusparseLtMatmulDescriptorInit,
                 (handle, &p->matmul, Op(op_a), Op(op_b), &p->a, &p->b, &p->d,
                  &p->d, CUSPARSE_COMPUTE_32F));
    JSP_CSLT_MSG(cusparseLtMatmulAlgSelectionInit,
                 (handle, &p->alg, &p->matmul, CUSPARSELT_MATMUL_ALG_DEFAULT));
    p->made_alg = true;
    if (search == 0 && alg >= 0) {
      int id = static_cast<int>(alg);
      JSP_CSLT_MSG(cusparseLtMatmulAlgSetAttribute,
                   (handle, &p->alg, CUSPARSELT_MATMUL_ALG_CONFIG_ID, &id, sizeof(id)));
    }
    if (search != 0) {
      // A search made by an earlier process (algorithm cache file): use its
      // result instead of searching again.
      std::optional<Choice> cached = LookUpChoice(CacheKey(key));
      if (cached.has_value()) {
        err = ApplyChoice(handle, p.get(), *cached);
        if (!err.empty()) return err;
        p->searched = true;
      }
    }
    JSP_CSLT_MSG(cusparseLtMatmulPlanInit, (handle, &p->plan, &p->matmul, &p->alg));
    p->made_plan = true;
    size_t buffer_size = 0;
    JSP_CSLT_MSG(cusparseLtSpMMACompressedSize2,
                 (handle, sparse_a ? &p->a : &p->b, &p->compressed_size, &buffer_size));
    guard.Release();
    it = plans.emplace(key, std::move(p)).first;
  }
  *out = it->second.get();
  return "";
}

// The largest configuration id of a plan's matmul (cuSPARSELt's
// CUSPARSELT_MATMUL_ALG_CONFIG_MAX_ID).
std::string MaxConfigId(const cusparseLtHandle_t* handle, const Plan& p, int* max_id) {
  JSP_CSLT_MSG(cusparseLtMatmulAlgGetAttribute,
               (handle, &p.alg, CUSPARSELT_MATMUL_ALG_CONFIG_MAX_ID, max_id, sizeof(*max_id)));
  return "";
}

int DtypeCode(ffi::DataType t) {
  if (t == ffi::DataType::BF16) return 0;
  if (t == ffi::DataType::F16) return 1;
  return -1;
}

// ---------------------------------------------------------------------------
// FFI handlers.

ffi::Error CompressImpl(cudaStream_t stream, int32_t device,
                        ffi::ScratchAllocator scratch, ffi::AnyBuffer dense,
                        ffi::Result<ffi::AnyBuffer> out, int64_t rows,
                        int64_t cols, int64_t order, int64_t op,
                        int64_t sparse_a) {
  if (!Opened()) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, NotOpenedMessage());
  int dtype_code = DtypeCode(dense.element_type());
  if (dtype_code < 0)
    return ffi::Error::InvalidArgument(
        "jsparse24 cuSPARSELt compress: dtype must be bfloat16 or float16");
  if (static_cast<int64_t>(dense.element_count()) != rows * cols)
    return ffi::Error::InvalidArgument(
        "jsparse24 cuSPARSELt compress: the dense operand has " +
        std::to_string(dense.element_count()) + " elements, expected " +
        std::to_string(rows) + " x " + std::to_string(cols));
  const cusparseLtHandle_t* handle;
  std::string err = GetHandle(device, &handle);
  if (!err.empty()) return ffi::Error::Internal(err);
  const SparseDesc* sd;
  err = GetSparseDesc(device, dtype_code, rows, cols, order, &sd);
  if (!err.empty()) return ffi::Error::Internal(err);
  if (out->size_bytes() != sd->compressed_size)
    return ffi::Error::InvalidArgument(
        "jsparse24 cuSPARSELt compress: output has " +
        std::to_string(out->size_bytes()) + " bytes, cusparseLtSpMMACompressedSize2 says " +
        std::to_string(sd->compressed_size));
  // XLA's FFI allocator accepts alignments up to 16 bytes; its device
  // allocations are 256-byte aligned anyway, as cuSPARSELt wants.
  void* buffer = nullptr;
  if (sd->buffer_size > 0) {
    std::optional<void*> got = scratch.Allocate(sd->buffer_size, 16);
    if (!got.has_value())
      return ffi::Error::Internal(
          "jsparse24 cuSPARSELt compress: could not allocate the " +
          std::to_string(sd->buffer_size) + "-byte compression buffer");
    buffer = *got;
  }
  JSP_CSLT(cusparseLtSpMMACompress2,
           (handle, &sd->desc, static_cast<int>(sparse_a), Op(op),
            dense.untyped_data(), out->untyped_data(), buffer, stream));
  return ffi::Error::Success();
}

ffi::Error MatmulImpl(cudaStream_t stream, int32_t device,
                      ffi::ScratchAllocator scratch, ffi::AnyBuffer a,
                      ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> d,
                      int64_t m, int64_t n, int64_t k, int64_t op_a,
                      int64_t op_b, int64_t sparse_a, int64_t order_a,
                      int64_t order_b, int64_t order_d, int64_t search,
                      int64_t alg, int64_t batch) {
  if (!Opened()) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, NotOpenedMessage());
  if (batch < 1)
    return ffi::Error::InvalidArgument("jsparse24 cuSPARSELt matmul: batch must be >= 1");
  int dtype_code = DtypeCode(d->element_type());
  if (dtype_code < 0)
    return ffi::Error::InvalidArgument(
        "jsparse24 cuSPARSELt matmul: dtype must be bfloat16 or float16");
  const ffi::AnyBuffer& dense = sparse_a ? b : a;
  if (dense.element_type() != d->element_type())
    return ffi::Error::InvalidArgument(
        "jsparse24 cuSPARSELt matmul: the dense operand and the result differ in dtype");
  // `batch` products of the same shape, stacked: operand and result i start
  // i item sizes into their buffers (one plan for all of them).
  int64_t dense_count = sparse_a ? k * n : m * k;
  if (static_cast<int64_t>(dense.element_count()) != dense_count * batch ||
      static_cast<int64_t>(d->element_count()) != m * n * batch)
    return ffi::Error::InvalidArgument(
        "jsparse24 cuSPARSELt matmul: operand sizes do not match m, n, k");
  const cusparseLtHandle_t* handle;
  std::string err = GetHandle(device, &handle);
  if (!err.empty()) return ffi::Error::Internal(err);
  PlanKey key{device, dtype_code, m, n, k, op_a, op_b, sparse_a,
              order_a, order_b, order_d, search, alg};
  Plan* p;
  err = GetPlan(key, handle, &p);
  if (!err.empty()) return ffi::Error::Internal(err);
  const ffi::AnyBuffer& structured = sparse_a ? a : b;
  if (structured.size_bytes() != p->compressed_size * static_cast<size_t>(batch))
    return ffi::Error::InvalidArgument(
        "jsparse24 cuSPARSELt matmul: the compressed operand has " +
        std::to_string(structured.size_bytes()) + " bytes for " +
        std::to_string(batch) + " product(s), cusparseLtSpMMACompressedSize2 says " +
        std::to_string(p->compressed_size) + " each");

  float alpha = 1.0f, beta = 0.0f;
  cudaStream_t streams[1] = {stream};
  auto workspace = [&](const Plan* plan, void** ws) -> ffi::Error {
    size_t size = 0;
    JSP_CSLT(cusparseLtMatmulGetWorkspace, (handle, &plan->plan, &size));
    *ws = nullptr;
    if (size > 0) {
      std::optional<void*> got = scratch.Allocate(size, 16);
      if (!got.has_value())
        return ffi::Error::Internal(
            "jsparse24 cuSPARSELt matmul: could not allocate the " +
            std::to_string(size) + "-byte workspace");
      *ws = *got;
    }
    return ffi::Error::Success();
  };
  if (search != 0) {
    std::lock_guard<std::mutex> lock(p->search_mu);
    if (!p->searched) {
      // The candidates that get timed: cusparseLtMatmulSearch's pick (its
      // configuration id and split-K settings, set on `p` itself; search=3)
      // and configuration ids [0, min(alg, max id + 1)), each with its own
      // cached plan (search=0, alg=id; an id whose plan cannot be made is
      // skipped; search=2 and 3). search=1 keeps cusparseLtMatmulSearch's
      // pick untimed.
      std::vector<Plan*> candidates;
      if (search == 1 || search == 3) {
        void* ws;
        ffi::Error e = workspace(p, &ws);
        if (e.failure()) return e;
        JSP_CSLT(cusparseLtMatmulSearch,
                 (handle, &p->plan, &alpha, a.untyped_data(), b.untyped_data(),
                  &beta, d->untyped_data(), d->untyped_data(), ws, streams, 1));
        if (search == 3) candidates.push_back(p);
      }
      if (search == 2 || search == 3) {
        int max_id = 0;
        err = MaxConfigId(handle, *p, &max_id);
        if (!err.empty()) return ffi::Error::Internal(err);
        int64_t ids = std::min<int64_t>(alg, static_cast<int64_t>(max_id) + 1);
        for (int64_t id = 0; id < ids; ++id) {
          PlanKey ck{device, dtype_code, m, n, k, op_a, op_b, sparse_a,
                     order_a, order_b, order_d, 0, id};
          Plan* c;
          if (GetPlan(ck, handle, &c).empty()) candidates.push_back(c);
        }
        if (candidates.empty())
          return ffi::Error::Internal(
              "jsparse24 cuSPARSELt matmul: the configuration search found no"
              " configuration that runs");
      }
      Plan* best = p;
      if (!candidates.empty()) {
        // On the real buffers, CUDA events: each candidate's mean over
        // kTimed runs after kWarm untimed ones, in two passes (in order, then
        // in reverse, so that no candidate always runs first or after the
        // same one); its time is the lower of the two. One pass of 5 runs
        // picked ids up to 10% slower than the fastest id timed alone; even
        // so, picks differ by up to ~12% from search to search
        // (docs/design_notes.md, "cuSPARSELt: how an algorithm is picked").
        constexpr int kWarm = 2, kTimed = 10;
        EventPair events;
        err = events.Create();
        if (!err.empty()) return ffi::Error::Internal(err);
        std::vector<float> best_ms(candidates.size(), 0.0f);
        // Each candidate's workspace, allocated once for both passes (the
        // scratch allocations live until this call returns).
        std::vector<void*> spaces(candidates.size(), nullptr);
        for (size_t i = 0; i < candidates.size(); ++i) {
          ffi::Error e = workspace(candidates[i], &spaces[i]);
          if (e.failure()) return e;
        }
        for (int pass = 0; pass < 2; ++pass) {
          for (size_t j = 0; j < candidates.size(); ++j) {
            size_t i = pass == 0 ? j : candidates.size() - 1 - j;
            const Plan* c = candidates[i];
            for (int r = 0; r < kWarm + kTimed; ++r) {
              if (r == kWarm) JSP_CUDA(cudaEventRecord, (events.start, stream));
              JSP_CSLT(cusparseLtMatmul,
                       (handle, &c->plan, &alpha, a.untyped_data(), b.untyped_data(),
                        &beta, d->untyped_data(), d->untyped_data(), spaces[i],
                        streams, 1));
            }
            JSP_CUDA(cudaEventRecord, (events.stop, stream));
            JSP_CUDA(cudaEventSynchronize, (events.stop));
            float ms = 0.0f;
            JSP_CUDA(cudaEventElapsedTime, (&ms, events.start, events.stop));
            if (pass == 0 || ms < best_ms[i]) best_ms[i] = ms;
          }
        }
        size_t fastest = static_cast<size_t>(
            std::min_element(best_ms.begin(), best_ms.end()) - best_ms.begin());
        best = candidates[fastest];
      }
      Choice choice;
      err = ReadChoice(handle, *best, &choice);
      if (!err.empty()) return ffi::Error::Internal(err);
      if (best != p) p->chosen = best;
      RecordChoice(CacheKey(key), choice);
      p->searched = true;
    }
  }
  const Plan* run = p->chosen != nullptr ? p->chosen : p;
  void* ws;
  ffi::Error e = workspace(run, &ws);
  if (e.failure()) return e;
  // A stack of products (the experts of a mixture of experts) runs as one
  // call on offsets into the stacked buffers: one launch from XLA and no
  // copy of each item out of its stack and of each result into one, which
  // a loop over the items in XLA makes (dynamic slices and updates). The
  // items run in turn on the stream, sharing the workspace.
  char* pa = static_cast<char*>(a.untyped_data());
  char* pb = static_cast<char*>(b.untyped_data());
  char* pd = static_cast<char*>(d->untyped_data());
  size_t a_item = a.size_bytes() / batch, b_item = b.size_bytes() / batch,
         d_item = d->size_bytes() / batch;
  for (int64_t i = 0; i < batch; ++i) {
    JSP_CSLT(cusparseLtMatmul,
             (handle, &run->plan, &alpha, pa + i * a_item, pb + i * b_item, &beta,
              pd + i * d_item, pd + i * d_item, ws, streams, 1));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspCusparseltCompress, CompressImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("cols")
                                  .Attr<int64_t>("order")
                                  .Attr<int64_t>("op")
                                  .Attr<int64_t>("sparse_a"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspCusparseltMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("m")
                                  .Attr<int64_t>("n")
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("op_a")
                                  .Attr<int64_t>("op_b")
                                  .Attr<int64_t>("sparse_a")
                                  .Attr<int64_t>("order_a")
                                  .Attr<int64_t>("order_b")
                                  .Attr<int64_t>("order_d")
                                  .Attr<int64_t>("search")
                                  .Attr<int64_t>("alg")
                                  .Attr<int64_t>("batch"));

namespace {

int Report(const std::string& err, char* msg, size_t msg_len) {
  if (err.empty()) return 0;
  if (msg != nullptr && msg_len > 0) std::snprintf(msg, msg_len, "%s", err.c_str());
  return 1;
}

}  // namespace

extern "C" {

// Opens the cuSPARSELt library at `path` (a path, not a bare name: the file
// that _cusparselt_build.find_toolchain found) for every other entry point. Returns
// 0, or 1 with `msg` set: the file cannot be opened, lacks a function the shim
// calls, or is not the header's major.minor version; or another library is
// open already. Opening the same file again returns 0.
int jsp_cusparselt_open(const char* path, char* msg, size_t msg_len) {
  return Report(OpenLibrary(path), msg, msg_len);
}

// The bytes of a compressed [rows, cols] matrix (`order` 0 = row-major,
// 1 = column-major; dtype_code 0 = bfloat16, 1 = float16) and of the
// temporary buffer its compression needs. Returns 0, or 1 with `msg` set.
int jsp_cusparselt_compressed_size(int device, int dtype_code, int64_t rows,
                                   int64_t cols, int64_t order, size_t* size,
                                   size_t* buffer_size, char* msg,
                                   size_t msg_len) {
  if (!Opened()) return Report(NotOpenedMessage(), msg, msg_len);
  const SparseDesc* sd;
  std::string err = GetSparseDesc(device, dtype_code, rows, cols, order, &sd);
  if (err.empty()) {
    *size = sd->compressed_size;
    *buffer_size = sd->buffer_size;
  }
  return Report(err, msg, msg_len);
}

// The opened cuSPARSELt library's version as major * 1000000 + minor * 100 +
// patch (the encoding of CUSPARSELT_VERSION since 0.10; no device needed).
int jsp_cusparselt_version(int* version, char* msg, size_t msg_len) {
  if (!Opened()) return Report(NotOpenedMessage(), msg, msg_len);
  int major = 0, minor = 0, patch = 0;
  cusparseStatus_t s = LibraryVersion(Lt(), &major, &minor, &patch);
  if (s != CUSPARSE_STATUS_SUCCESS)
    return Report(CsltMessage("cusparseLtGetProperty", s), msg, msg_len);
  *version = major * 1000000 + minor * 100 + patch;
  return 0;
}

// Sets the algorithm cache file (module comment); "" turns it off. Returns 0.
int jsp_cusparselt_set_algorithm_cache(const char* path) {
  std::lock_guard<std::mutex> lock(g_cache_mu);
  g_cache_path = path == nullptr ? "" : path;
  g_cache_read = false;
  g_cache.clear();
  return 0;
}

// Algorithm searches this process has run (a plan whose choice came from the
// cache file ran none).
int64_t jsp_cusparselt_searches() {
  std::lock_guard<std::mutex> lock(g_cache_mu);
  return g_searches;
}

}  // extern "C"
