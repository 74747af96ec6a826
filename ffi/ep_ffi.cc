// XLA FFI handlers that launch the ahead-of-time compiled dispatch / combine cubins (docs/kernel_abi.md).
//
// Built against jaxlib 0.11.2's FFI headers (API 0.4, loads on jaxlib 0.11 and 0.12) with no CUDA toolkit:
// the few driver API types and entry points used here are declared below and resolved from libcuda.so.1
// with dlopen at run time.
//
// Division of work:
//   * Python (jax_latent_ep/symmetric.py, nvlink.py) allocates the symmetric buffers, the device peer tables
//     and the host-mapped status pages, then calls `ep_register_rank` (plain C, through ctypes) once per
//     (instance, device). That call loads the cubins into the device's primary context (once per device and
//     cubin image, outside any CUDA graph capture), keeps a copy of each image for the life of the process
//     and records everything a launch needs in a registry.
//   * The handlers look their rank up in that registry by (instance attribute, device ordinal), check the
//     operand shapes and compute the kernel parameters (`prepare_dispatch` / `prepare_combine`, shared by
//     every handler). Two ways to the kernel:
//       - traced targets (`EpDispatch` / `EpCombine`, execute stage only): cuLaunchKernelEx on XLA's stream.
//         Inside an XLA command buffer XLA captures that launch into a child graph, and re-captures it
//         whenever a buffer address of the call changes.
//       - record targets (execute + RECORD stage, registered by `ep_register_record_targets` through the
//         plugin's XLA_FFI_Api, which jax's registration would drop): in a command buffer the record handler
//         adds a plain kernel node (XLA loads the kept cubin copy) and later only updates its parameters.
//         Outside command buffers their execute handler launches on the stream like the traced targets.
//     No host synchronization, no allocation on the device, no module loading in the handlers: they are safe
//     in XLA command buffers, where their host code runs at capture / record only (so the registered
//     pointers must outlive the executable).

#include <dlfcn.h>

#include <atomic>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

// The FFI RECORD stage (jaxlib >= 0.11.2). Without it the record targets are compiled out and
// ep_register_record_targets reports that.
#if defined(__has_include)
#if __has_include("xla/ffi/api/record_api.h")
#include "xla/ffi/api/record_api.h"
#define JAX_LATENT_EP_RECORD 1
#endif
#endif
#ifndef JAX_LATENT_EP_RECORD
#define JAX_LATENT_EP_RECORD 0
#endif

namespace ffi = xla::ffi;

// ---------------------------------------------------------------------------------------------------------
// The CUDA driver API subset (ABI-compatible declarations from cuda.h; CUDA 12.x and 13.x agree on these).
// ---------------------------------------------------------------------------------------------------------
extern "C" {
typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st* CUcontext;
typedef struct CUmod_st* CUmodule;
typedef struct CUfunc_st* CUfunction;
typedef struct CUstream_st* CUstream;
typedef CUstream cudaStream_t;  // the runtime's cudaStream_t is the same `struct CUstream_st*`

typedef union CUlaunchAttributeValue_union {
  char pad[64];
  int programmaticStreamSerializationAllowed;
} CUlaunchAttributeValue;

typedef struct CUlaunchAttribute_st {
  int id;  // CUlaunchAttributeID (an enum: 4 bytes)
  char pad[8 - sizeof(int)];
  CUlaunchAttributeValue value;
} CUlaunchAttribute;

typedef struct CUlaunchConfig_st {
  unsigned int gridDimX, gridDimY, gridDimZ;
  unsigned int blockDimX, blockDimY, blockDimZ;
  unsigned int sharedMemBytes;
  CUstream hStream;
  CUlaunchAttribute* attrs;
  unsigned int numAttrs;
} CUlaunchConfig;
}  // extern "C"

static_assert(sizeof(CUlaunchAttributeValue) == 64, "CUlaunchAttributeValue must be 64 bytes");
static_assert(sizeof(CUlaunchAttribute) == 72, "CUlaunchAttribute must be 72 bytes");

namespace {

constexpr CUresult kCudaSuccess = 0;
constexpr int kLaunchAttributeProgrammaticStreamSerialization = 6;  // CU_LAUNCH_ATTRIBUTE_...
constexpr int kFuncAttributeMaxDynamicSharedSizeBytes = 8;           // CU_FUNC_ATTRIBUTE_...
constexpr int kDeviceAttributeMultiprocessorCount = 16;              // CU_DEVICE_ATTRIBUTE_...
constexpr unsigned kDefaultMaxSmem = 48 * 1024;                      // above this: opt in per function

// Driver entry points, resolved once from libcuda.so.1.
struct Driver {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxPushCurrent)(CUcontext);
  CUresult (*cuCtxPopCurrent)(CUcontext*);
  CUresult (*cuCtxGetDevice)(CUdevice*);
  CUresult (*cuModuleLoadData)(CUmodule*, const void*);
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*cuFuncSetAttribute)(CUfunction, int, int);
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice);
  CUresult (*cuOccupancyMaxActiveBlocksPerMultiprocessor)(int*, CUfunction, int, size_t);
  CUresult (*cuLaunchKernelEx)(const CUlaunchConfig*, CUfunction, void**, void**);
  CUresult (*cuGetErrorName)(CUresult, const char**);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  std::string error;  // empty once every symbol resolved
};

const Driver& driver() {
  static const Driver* d = [] {
    auto* d = new Driver();
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = dlerror();
      d->error = std::string("cannot dlopen libcuda.so.1 (is an NVIDIA driver installed?): ") +
                 (why != nullptr ? why : "unknown error");
      return d;
    }
    auto get = [&](auto& fn, const char* name) {
      void* sym = dlsym(lib, name);
      if (sym == nullptr && d->error.empty()) d->error = std::string("libcuda.so.1 lacks ") + name;
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(sym);
    };
    get(d->cuInit, "cuInit");
    get(d->cuDeviceGet, "cuDeviceGet");
    get(d->cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    get(d->cuCtxPushCurrent, "cuCtxPushCurrent_v2");
    get(d->cuCtxPopCurrent, "cuCtxPopCurrent_v2");
    get(d->cuCtxGetDevice, "cuCtxGetDevice");
    get(d->cuModuleLoadData, "cuModuleLoadData");
    get(d->cuModuleGetFunction, "cuModuleGetFunction");
    get(d->cuFuncSetAttribute, "cuFuncSetAttribute");
    get(d->cuDeviceGetAttribute, "cuDeviceGetAttribute");
    get(d->cuOccupancyMaxActiveBlocksPerMultiprocessor, "cuOccupancyMaxActiveBlocksPerMultiprocessor");
    get(d->cuLaunchKernelEx, "cuLaunchKernelEx");
    get(d->cuGetErrorName, "cuGetErrorName");
    get(d->cuGetErrorString, "cuGetErrorString");
    return d;
  }();
  return *d;
}

std::string cu_error(CUresult rc) {
  const Driver& d = driver();
  const char* name = nullptr;
  const char* text = nullptr;
  if (d.cuGetErrorName != nullptr) d.cuGetErrorName(rc, &name);
  if (d.cuGetErrorString != nullptr) d.cuGetErrorString(rc, &text);
  return std::string(name != nullptr ? name : "CUDA_ERROR") + " (" + std::to_string(rc) +
         "): " + (text != nullptr ? text : "unknown");
}

// One kernel of a registered rank: the function handle in the device's primary context and its launch shape.
struct Kernel {
  CUfunction fn = nullptr;
  std::string name;                    // the cubin symbol (the manifest's `name`)
  const std::string* image = nullptr;  // the cubin, kept at this address for the process (g_images)
  unsigned block = 0;  // threads per CTA (the cubin's .reqntid)
  unsigned smem = 0;   // dynamic shared memory bytes
  // CTAs of one launch that can be resident at once (occupancy x SMs): every CTA of a launch waits on
  // flags that need every other CTA of the launch, so a larger grid would hang (docs/kernel_abi.md).
  int64_t max_grid = 0;
};

// Everything one (instance, device) needs to launch; filled by ep_register_rank, read by the handlers.
struct Rank {
  int64_t instance = 0;
  int ordinal = 0;
  int rank = 0;
  int ranks = 0;
  int max_tokens = 0;
  int stride = 0;  // ceil(max_tokens / 8) * 8
  int latent = 0;
  int topk = 0;
  uint64_t peers = 0;                        // device int64 [N + 1]
  uint64_t status = 0;                       // device address of the host-mapped int32 [4] record, or 0
  volatile const int32_t* status_host = nullptr;  // host address of the same record, or null
  int64_t timeout_ns = 0;
  Kernel dispatch, combine;
};

std::mutex g_mutex;
// (instance, ordinal) -> rank. Shared: a handler keeps the registration it found alive while it uses it, even if
// the backend unregisters it meanwhile (close() or the garbage collector's release, on another thread).
std::map<std::pair<int64_t, int>, std::shared_ptr<const Rank>> g_ranks;
// Loaded modules, once per (ordinal, image hash, image size): kept for the life of the process (a CUDA
// graph captured from a handler may still launch them).
std::map<std::tuple<int, size_t, size_t>, CUmodule> g_modules;
// Copies of the cubin images, one per distinct image, never freed: the record stage hands XLA the image's
// address, and XLA loads and caches the kernel by (name, address) for the life of its command buffers.
std::set<std::string> g_images;
thread_local std::string g_last_error;

int fail(std::string message) {
  g_last_error = std::move(message);
  return 1;
}

// Loads `image` (a cubin) into `ordinal`'s primary context once and resolves `name`. Caller holds g_mutex.
int load_kernel(int ordinal, const void* image, size_t size, const char* name, int block, int smem,
                Kernel* out) {
  const Driver& d = driver();
  if (!d.error.empty()) return fail(d.error);
  if (image == nullptr || size == 0) return fail(std::string("empty cubin for kernel ") + name);
  if (block <= 0 || block > 1024) return fail("block=" + std::to_string(block) + " out of range");
  if (smem < 0) return fail("smem=" + std::to_string(smem) + " must not be negative");
  CUresult rc = d.cuInit(0);
  if (rc != kCudaSuccess) return fail("cuInit: " + cu_error(rc));
  CUdevice dev;
  rc = d.cuDeviceGet(&dev, ordinal);
  if (rc != kCudaSuccess) return fail("cuDeviceGet(" + std::to_string(ordinal) + "): " + cu_error(rc));
  CUcontext ctx;
  rc = d.cuDevicePrimaryCtxRetain(&ctx, dev);  // kept retained: XLA uses this context for the process life
  if (rc != kCudaSuccess) return fail("cuDevicePrimaryCtxRetain: " + cu_error(rc));
  rc = d.cuCtxPushCurrent(ctx);
  if (rc != kCudaSuccess) return fail("cuCtxPushCurrent: " + cu_error(rc));
  std::string error;
  auto key = std::make_tuple(ordinal, std::hash<std::string_view>()(
                                          std::string_view(static_cast<const char*>(image), size)),
                             size);
  CUmodule module = nullptr;
  if (auto it = g_modules.find(key); it != g_modules.end()) {
    module = it->second;
  } else if ((rc = d.cuModuleLoadData(&module, image)) == kCudaSuccess) {
    g_modules[key] = module;
  } else {
    error = "cuModuleLoadData (kernel " + std::string(name) + ", device " + std::to_string(ordinal) +
            "): " + cu_error(rc);
  }
  CUfunction fn = nullptr;
  if (error.empty() && (rc = d.cuModuleGetFunction(&fn, module, name)) != kCudaSuccess) {
    error = "cuModuleGetFunction(" + std::string(name) + "): " + cu_error(rc) +
            " (does the manifest's kernel name match the cubin?)";
  }
  if (error.empty() && static_cast<unsigned>(smem) > kDefaultMaxSmem &&
      (rc = d.cuFuncSetAttribute(fn, kFuncAttributeMaxDynamicSharedSizeBytes, smem)) != kCudaSuccess) {
    error = "cuFuncSetAttribute(max dynamic smem " + std::to_string(smem) + "): " + cu_error(rc);
  }
  int per_sm = 0, sms = 0;
  if (error.empty() &&
      (rc = d.cuOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, block, smem)) != kCudaSuccess) {
    error = "cuOccupancyMaxActiveBlocksPerMultiprocessor(" + std::string(name) + "): " + cu_error(rc);
  }
  if (error.empty() &&
      (rc = d.cuDeviceGetAttribute(&sms, kDeviceAttributeMultiprocessorCount, dev)) != kCudaSuccess) {
    error = "cuDeviceGetAttribute(multiprocessor count): " + cu_error(rc);
  }
  if (error.empty() && per_sm < 1) {
    error = "kernel " + std::string(name) + " cannot run with block " + std::to_string(block) + " and smem " +
            std::to_string(smem) + " on device " + std::to_string(ordinal);
  }
  CUcontext popped;
  d.cuCtxPopCurrent(&popped);
  if (!error.empty()) return fail(error);
  out->max_grid = int64_t{per_sm} * sms;
  out->fn = fn;
  out->name = name;
  out->image = &*g_images.emplace(static_cast<const char*>(image), size).first;
  out->block = static_cast<unsigned>(block);
  out->smem = static_cast<unsigned>(smem);
  return 0;
}

// Finds the registration of `instance` on the device the handler runs on: XLA's device ordinal first, then
// the device of the current context (the two agree unless a process was given a subset of its visible GPUs).
std::shared_ptr<const Rank> find_rank(int64_t instance, int32_t ordinal) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (auto it = g_ranks.find({instance, ordinal}); it != g_ranks.end()) return it->second;
  const Driver& d = driver();
  CUdevice dev;
  if (d.error.empty() && d.cuCtxGetDevice(&dev) == kCudaSuccess) {
    if (auto it = g_ranks.find({instance, static_cast<int>(dev)}); it != g_ranks.end()) {
      return it->second;
    }
  }
  return nullptr;
}

ffi::Error missing_rank(const char* what, int64_t instance, int32_t ordinal) {
  return ffi::Error::InvalidArgument(
      std::string("jax_latent_ep ") + what + ": no NvlinkBackend instance " + std::to_string(instance) +
      " is registered on device ordinal " + std::to_string(ordinal) +
      " (was the backend closed, or built for a different mesh?)");
}

// A kernel that failed earlier (a timeout or a call out of sequence) left its record in the host-mapped status
// page: report it by name (the codes are layout.ERROR_*; nvlink.describe_error words them the same way).
ffi::Error check_status(const Rank& r, const char* what) {
  if (r.status_host == nullptr || r.status_host[0] == 0) return ffi::Error::Success();
  int32_t code = r.status_host[0], rank = r.status_host[1], peer = r.status_host[2];
  uint32_t layer = static_cast<uint32_t>(r.status_host[3]);
  std::string event;
  switch (code) {
    case 1:
      event = "dispatch on rank " + std::to_string(rank) + " timed out waiting for rank " + std::to_string(peer) +
              " at layer " + std::to_string(layer);
      break;
    case 2:
      event = "combine on rank " + std::to_string(rank) + " timed out waiting for rank " + std::to_string(peer) +
              " at layer " + std::to_string(layer);
      break;
    case 3:
      event = "dispatch called twice without a combine on rank " + std::to_string(rank) + " at layer " +
              std::to_string(layer);
      break;
    case 4:  // the combine records the last dispatched layer; it was called in the next one
      event = "combine called without its dispatch on rank " + std::to_string(rank) + " at layer " +
              std::to_string(layer + 1u);
      break;
    default:
      event = "kernel on rank " + std::to_string(rank) + " failed (peer " + std::to_string(peer) + ", layer " +
              std::to_string(layer) + ")";
  }
  return ffi::Error::Internal(std::string("jax_latent_ep ") + what + ": earlier, " + event + " (error code " +
                              std::to_string(code) + "); the CUDA context is unusable, restart the process");
}

std::string dims_str(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

const char* dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    default: return "another element type";
  }
}

// Checks one operand: element type and shape.
ffi::Error expect(const char* what, const char* name, const ffi::AnyBuffer& buf, ffi::DataType type,
                  std::initializer_list<int64_t> shape) {
  auto dims = buf.dimensions();
  bool ok = buf.element_type() == type && dims.size() == shape.size();
  size_t i = 0;
  for (int64_t s : shape) ok = ok && dims[i++] == s;
  if (ok) return ffi::Error::Success();
  std::string want = "[";
  i = 0;
  for (int64_t s : shape) want += (i++ ? ", " : "") + std::to_string(s);
  want += "]";
  return ffi::Error::InvalidArgument(std::string("jax_latent_ep ") + what + ": " + name + " is " +
                                     dtype_name(buf.element_type()) + dims_str(dims) + ", expected " +
                                     dtype_name(type) + want);
}

// The parameters of one kernel launch, in docs/kernel_abi.md order, held by value: the one list feeds both
// cuLaunchKernelEx (a pointer to each value) and the record stage (device addresses and by-value scalars).
class KernelParams {
 public:
  // A 64-bit device address (`.param .u64`): an XLA buffer, the peer table, the status record (or 0).
  void address(const void* p) { add(&p, sizeof(p), /*is_address=*/true); }
  void address(uint64_t p) { address(reinterpret_cast<const void*>(p)); }
  // A scalar passed by value (`i64`, `i32`, `f32`).
  template <typename T>
  void value(T v) {
    static_assert(std::is_arithmetic_v<T> && sizeof(T) <= 8, "kernel scalars are at most 8 bytes");
    add(&v, sizeof(T), /*is_address=*/false);
  }
  int size() const { return count_; }
  // One pointer per parameter, for cuLaunchKernelEx (valid while this object lives).
  void** pointers() {
    for (int i = 0; i < count_; ++i) pointers_[i] = slots_[i].bytes;
    return pointers_;
  }
#if JAX_LATENT_EP_RECORD
  // The same parameters for CreateLaunch / UpdateLaunch (XLA copies the values before these return).
  std::vector<ffi::KernelArg> record_args() const {
    std::vector<ffi::KernelArg> args;
    args.reserve(count_);
    for (int i = 0; i < count_; ++i) {
      const Slot& s = slots_[i];
      if (s.is_address) {
        void* p;
        std::memcpy(&p, s.bytes, sizeof(p));
        args.push_back(ffi::DevicePointer{p});
      } else {
        args.push_back(ffi::HostValue{s.bytes, s.size});
      }
    }
    return args;
  }
#endif

 private:
  static constexpr int kMax = 16;  // dispatch takes 15, combine 13
  struct Slot {
    alignas(8) unsigned char bytes[8];
    size_t size;
    bool is_address;
  };
  void add(const void* v, size_t size, bool is_address) {
    assert(count_ < kMax && "more kernel parameters than KernelParams holds");
    Slot& s = slots_[count_++];
    std::memset(s.bytes, 0, sizeof(s.bytes));
    std::memcpy(s.bytes, v, size);
    s.size = size;
    s.is_address = is_address;
  }
  Slot slots_[kMax];
  void* pointers_[kMax];
  int count_ = 0;
};

// One launch as a handler computed it: the kernel, its grid and its parameters.
struct Launch {
  std::shared_ptr<const Rank> rank;  // keeps `kernel` (one of its members) alive until the launch is issued
  const Kernel* kernel = nullptr;
  unsigned grid = 0;
  KernelParams params;
};

// Launches on XLA's stream (execute stage). `pdl`: allow programmatic dependent launch (the kernels wait
// with griddepcontrol.wait before reading anything a predecessor wrote).
ffi::Error launch(const char* what, Launch& l, cudaStream_t stream, bool pdl) {
  const Kernel& k = *l.kernel;
  CUlaunchAttribute attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.id = kLaunchAttributeProgrammaticStreamSerialization;
  attr.value.programmaticStreamSerializationAllowed = 1;
  CUlaunchConfig config;
  std::memset(&config, 0, sizeof(config));
  config.gridDimX = l.grid;
  config.gridDimY = config.gridDimZ = 1;
  config.blockDimX = k.block;
  config.blockDimY = config.blockDimZ = 1;
  config.sharedMemBytes = k.smem;
  config.hStream = stream;
  config.attrs = pdl ? &attr : nullptr;
  config.numAttrs = pdl ? 1 : 0;
  CUresult rc = driver().cuLaunchKernelEx(&config, k.fn, l.params.pointers(), nullptr);
  if (rc != kCudaSuccess) {
    return ffi::Error::Internal(std::string("jax_latent_ep ") + what + ": cuLaunchKernelEx(grid " +
                                std::to_string(l.grid) + ", block " + std::to_string(k.block) + ", smem " +
                                std::to_string(k.smem) + "): " + cu_error(rc));
  }
  return ffi::Error::Success();
}

#if JAX_LATENT_EP_RECORD
// The record stage's context, decoded from XLA's record extension (XLA's own xla/ffi/api/record_ffi.h, which
// jaxlib does not ship, defines the same two types).
struct RecordContext : ffi::internal::RecordContextBase<ffi::internal::ErrorPolicy> {
  using Base = ffi::internal::RecordContextBase<ffi::internal::ErrorPolicy>;
  using Base::Base;
};
struct RecordExtension : ffi::internal::RecordExtensionBase<RecordContext> {
  // Extension 0.1 (jaxlib 0.11.2) and 0.2 (jaxlib 0.12: adds a source format) share the layout used here;
  // the default check would accept only the version of the headers this file was built with.
  static bool Support(int32_t major, int32_t minor) { return major == 0 && (minor == 1 || minor == 2); }
};

std::atomic<int64_t> g_record_creates{0}, g_record_updates{0};

// Adds the launch to XLA's command buffer as one kernel node (Create), or updates that node's parameters
// (Update: XLA calls again when a buffer address of the call changed). Launch dimensions, kernel and shared
// memory come from attributes and the registry, so they do not change between Create and Update.
ffi::Error record(const char* what, RecordContext& ctx, const Launch& l, bool uses_pdl) {
  const Kernel& k = *l.kernel;
  std::vector<ffi::KernelArg> args = l.params.record_args();
  auto failed = [&](const ffi::Error& e, const char* step) {
    return ffi::Error(e.errc().value_or(ffi::ErrorCode::kInternal),
                      std::string("jax_latent_ep ") + what + ": " + step + " (kernel " + k.name + ", grid " +
                          std::to_string(l.grid) + ", block " + std::to_string(k.block) + ", smem " +
                          std::to_string(k.smem) + "): " + e.message());
  };
  if (ctx.action() == ffi::RecordAction::kCreate) {
    XLA_FFI_LaunchDims dims{/*grid=*/{static_cast<int32_t>(l.grid), 1, 1},
                            /*block=*/{static_cast<int32_t>(k.block), 1, 1}, /*cluster=*/{0, 0, 0}};
    auto cmd = ctx.CreateLaunch(k.name.c_str(), k.image->data(), k.image->size(), ffi::SourceFormat::kCubin,
                                dims, k.smem, uses_pdl, args);
    if (cmd.has_error()) return failed(cmd.error(), "recording the kernel node");
    g_record_creates.fetch_add(1, std::memory_order_relaxed);
    return ffi::Error::Success();
  }
  if (ctx.commands().size() != 1) {
    return ffi::Error::Internal(std::string("jax_latent_ep ") + what + ": record update with " +
                                std::to_string(ctx.commands().size()) + " recorded commands, expected 1");
  }
  if (ffi::Error e = ctx.UpdateLaunch(ctx.commands()[0], args); e.failure()) {
    return failed(e, "updating the kernel node");
  }
  g_record_updates.fetch_add(1, std::memory_order_relaxed);
  return ffi::Error::Success();
}
#endif  // JAX_LATENT_EP_RECORD

// ---------------------------------------------------------------------------------------------------------
// dispatch(x, ids, weights) -> (recv_x, recv_sf, recv_ids, recv_weights, recv_src)
// ---------------------------------------------------------------------------------------------------------

// Checks the operands against the registered rank and computes the launch (every dispatch handler).
ffi::Error prepare_dispatch(int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer ids, ffi::AnyBuffer weights,
                            ffi::Result<ffi::AnyBuffer> recv_x, ffi::Result<ffi::AnyBuffer> recv_sf,
                            ffi::Result<ffi::AnyBuffer> recv_ids, ffi::Result<ffi::AnyBuffer> recv_weights,
                            ffi::Result<ffi::AnyBuffer> recv_src, int64_t instance, int64_t grid, Launch& out) {
  constexpr const char* what = "dispatch";
  const std::shared_ptr<const Rank> r = find_rank(instance, ordinal);  // held by the Launch until issued
  if (r == nullptr) return missing_rank(what, instance, ordinal);
  if (ffi::Error e = check_status(*r, what); !e.success()) return e;
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("jax_latent_ep dispatch: x must be [T, L]");
  const int64_t T = xd[0], L = r->latent, K = r->topk, rows = int64_t{r->ranks} * r->stride;
  if (T < 1 || T > r->max_tokens) {
    return ffi::Error::InvalidArgument("jax_latent_ep dispatch: T=" + std::to_string(T) +
                                       " tokens, expected 1 <= T <= max_tokens=" +
                                       std::to_string(r->max_tokens));
  }
  if (grid < T || grid > r->dispatch.max_grid) {
    return ffi::Error::InvalidArgument(
        "jax_latent_ep dispatch: grid=" + std::to_string(grid) + " CTAs for T=" + std::to_string(T) +
        " tokens; it must satisfy T <= grid <= " + std::to_string(r->dispatch.max_grid) +
        " (the CTAs of one launch that fit on the device at once)");
  }
  for (ffi::Error e : {expect(what, "x", x, ffi::DataType::BF16, {T, L}),
                       expect(what, "ids", ids, ffi::DataType::S32, {T, K}),
                       expect(what, "weights", weights, ffi::DataType::F32, {T, K}),
                       expect(what, "recv_x", *recv_x, ffi::DataType::F8E4M3FN, {rows, L}),
                       expect(what, "recv_sf", *recv_sf, ffi::DataType::U8, {rows, L / 32}),
                       expect(what, "recv_ids", *recv_ids, ffi::DataType::S32, {rows, K}),
                       expect(what, "recv_weights", *recv_weights, ffi::DataType::F32, {rows, K}),
                       expect(what, "recv_src", *recv_src, ffi::DataType::S32, {rows})}) {
    if (!e.success()) return e;
  }
  out.rank = r;
  out.kernel = &r->dispatch;
  out.grid = static_cast<unsigned>(grid);
  // Parameters in docs/kernel_abi.md order (ffi.DISPATCH_PARAMS).
  KernelParams& p = out.params;
  p.address(x.untyped_data());
  p.address(ids.untyped_data());
  p.address(weights.untyped_data());
  p.address(r->peers);
  p.address(recv_x->untyped_data());
  p.address(recv_sf->untyped_data());
  p.address(recv_ids->untyped_data());
  p.address(recv_weights->untyped_data());
  p.address(recv_src->untyped_data());
  p.address(r->status);
  p.value(int64_t{r->timeout_ns});
  p.value(int32_t{r->rank});
  p.value(static_cast<int32_t>(T));
  p.value(static_cast<int32_t>(T));  // peer_tokens: under shard_map every rank's T is this call's T
  p.value(int32_t{r->max_tokens});
  return ffi::Error::Success();
}

// Execute stage of the record target (and, with uses_pdl, of the traced one).
ffi::Error DispatchExecute(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer ids,
                           ffi::AnyBuffer weights, ffi::Result<ffi::AnyBuffer> recv_x,
                           ffi::Result<ffi::AnyBuffer> recv_sf, ffi::Result<ffi::AnyBuffer> recv_ids,
                           ffi::Result<ffi::AnyBuffer> recv_weights, ffi::Result<ffi::AnyBuffer> recv_src,
                           int64_t instance, int64_t grid, int64_t /*call*/, bool uses_pdl) {
  Launch l;
  if (ffi::Error e = prepare_dispatch(ordinal, x, ids, weights, recv_x, recv_sf, recv_ids, recv_weights,
                                      recv_src, instance, grid, l);
      e.failure()) {
    return e;
  }
  return launch("dispatch", l, stream, uses_pdl);
}

// The traced target: always allows programmatic dependent launch.
ffi::Error DispatchTraced(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer ids,
                          ffi::AnyBuffer weights, ffi::Result<ffi::AnyBuffer> recv_x,
                          ffi::Result<ffi::AnyBuffer> recv_sf, ffi::Result<ffi::AnyBuffer> recv_ids,
                          ffi::Result<ffi::AnyBuffer> recv_weights, ffi::Result<ffi::AnyBuffer> recv_src,
                          int64_t instance, int64_t grid, int64_t /*call*/) {
  return DispatchExecute(stream, ordinal, x, ids, weights, recv_x, recv_sf, recv_ids, recv_weights, recv_src,
                         instance, grid, /*call=*/0, /*uses_pdl=*/true);
}

#if JAX_LATENT_EP_RECORD
ffi::Error DispatchRecord(RecordContext ctx, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer ids,
                          ffi::AnyBuffer weights, ffi::Result<ffi::AnyBuffer> recv_x,
                          ffi::Result<ffi::AnyBuffer> recv_sf, ffi::Result<ffi::AnyBuffer> recv_ids,
                          ffi::Result<ffi::AnyBuffer> recv_weights, ffi::Result<ffi::AnyBuffer> recv_src,
                          int64_t instance, int64_t grid, int64_t /*call*/, bool uses_pdl) {
  Launch l;
  if (ffi::Error e = prepare_dispatch(ordinal, x, ids, weights, recv_x, recv_sf, recv_ids, recv_weights,
                                      recv_src, instance, grid, l);
      e.failure()) {
    return e;
  }
  return record("dispatch", ctx, l, uses_pdl);
}
#endif

// The device, operands, results and attributes every dispatch handler binds (after its stage's context).
template <typename Binding>
auto bind_dispatch(Binding binding) {
  return std::move(binding)
      .template Ctx<ffi::DeviceOrdinal>()  // the device, key of the rank registry
      .template Arg<ffi::AnyBuffer>()      // x: bf16 [T, L] this rank's tokens
      .template Arg<ffi::AnyBuffer>()      // ids: int32 [T, K] global expert ids
      .template Arg<ffi::AnyBuffer>()      // weights: f32 [T, K] routing weights
      .template Ret<ffi::AnyBuffer>()      // recv_x: float8_e4m3fn [N*S, L]
      .template Ret<ffi::AnyBuffer>()      // recv_sf: uint8 [N*S, L/32] E8M0 scales
      .template Ret<ffi::AnyBuffer>()      // recv_ids: int32 [N*S, K]
      .template Ret<ffi::AnyBuffer>()      // recv_weights: f32 [N*S, K]
      .template Ret<ffi::AnyBuffer>()      // recv_src: int32 [N*S] (r << 16) | t, or -1
      .template Attr<int64_t>("instance")  // which NvlinkBackend (several may coexist)
      .template Attr<int64_t>("grid")      // CTAs, >= T
      .template Attr<int64_t>("call");     // unique per call in a program: XLA never merges two calls
}

// ---------------------------------------------------------------------------------------------------------
// combine(out, ids, norm_weight) -> result
// ---------------------------------------------------------------------------------------------------------

// Checks the operands against the registered rank and computes the launch (every combine handler).
ffi::Error prepare_combine(int32_t ordinal, ffi::AnyBuffer out, ffi::AnyBuffer ids, ffi::AnyBuffer norm_weight,
                           ffi::Result<ffi::AnyBuffer> result, int64_t instance, int64_t grid, float eps,
                           int64_t apply_norm, Launch& l) {
  constexpr const char* what = "combine";
  const std::shared_ptr<const Rank> r = find_rank(instance, ordinal);  // held by the Launch until issued
  if (r == nullptr) return missing_rank(what, instance, ordinal);
  if (ffi::Error e = check_status(*r, what); !e.success()) return e;
  auto id = ids.dimensions();
  if (id.size() != 2) return ffi::Error::InvalidArgument("jax_latent_ep combine: ids must be [T, K]");
  const int64_t T = id[0], L = r->latent, K = r->topk, rows = int64_t{r->ranks} * r->stride;
  if (T < 1 || T > r->max_tokens) {
    return ffi::Error::InvalidArgument("jax_latent_ep combine: T=" + std::to_string(T) +
                                       " tokens, expected 1 <= T <= max_tokens=" +
                                       std::to_string(r->max_tokens));
  }
  if (grid < 1 || grid > r->combine.max_grid) {
    return ffi::Error::InvalidArgument(
        "jax_latent_ep combine: grid=" + std::to_string(grid) + " CTAs; it must satisfy 1 <= grid <= " +
        std::to_string(r->combine.max_grid) + " (the CTAs of one launch that fit on the device at once)");
  }
  for (ffi::Error e : {expect(what, "out", out, ffi::DataType::BF16, {rows, L}),
                       expect(what, "ids", ids, ffi::DataType::S32, {T, K}),
                       expect(what, "norm_weight", norm_weight, ffi::DataType::BF16, {L}),
                       expect(what, "result", *result, ffi::DataType::BF16, {T, L})}) {
    if (!e.success()) return e;
  }
  l.rank = r;
  l.kernel = &r->combine;
  l.grid = static_cast<unsigned>(grid);
  // Parameters in docs/kernel_abi.md order (ffi.COMBINE_PARAMS).
  KernelParams& p = l.params;
  p.address(out.untyped_data());
  p.address(ids.untyped_data());
  p.address(norm_weight.untyped_data());
  p.address(result->untyped_data());
  p.address(r->peers);
  p.address(r->status);
  p.value(int64_t{r->timeout_ns});
  p.value(float{eps});
  p.value(int32_t{r->rank});
  p.value(static_cast<int32_t>(T));
  p.value(static_cast<int32_t>(T));  // peer_tokens: every rank's T (the dispatch's)
  p.value(int32_t{r->max_tokens});
  p.value(int32_t{apply_norm != 0 ? 1 : 0});
  return ffi::Error::Success();
}

// Execute stage of the record target (and, with uses_pdl, of the traced one).
ffi::Error CombineExecute(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer out, ffi::AnyBuffer ids,
                          ffi::AnyBuffer norm_weight, ffi::Result<ffi::AnyBuffer> result, int64_t instance,
                          int64_t grid, float eps, int64_t apply_norm, int64_t /*call*/, bool uses_pdl) {
  Launch l;
  if (ffi::Error e = prepare_combine(ordinal, out, ids, norm_weight, result, instance, grid, eps, apply_norm, l);
      e.failure()) {
    return e;
  }
  return launch("combine", l, stream, uses_pdl);
}

// The traced target: always allows programmatic dependent launch.
ffi::Error CombineTraced(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer out, ffi::AnyBuffer ids,
                         ffi::AnyBuffer norm_weight, ffi::Result<ffi::AnyBuffer> result, int64_t instance,
                         int64_t grid, float eps, int64_t apply_norm, int64_t /*call*/) {
  return CombineExecute(stream, ordinal, out, ids, norm_weight, result, instance, grid, eps, apply_norm,
                        /*call=*/0, /*uses_pdl=*/true);
}

#if JAX_LATENT_EP_RECORD
ffi::Error CombineRecord(RecordContext ctx, int32_t ordinal, ffi::AnyBuffer out, ffi::AnyBuffer ids,
                         ffi::AnyBuffer norm_weight, ffi::Result<ffi::AnyBuffer> result, int64_t instance,
                         int64_t grid, float eps, int64_t apply_norm, int64_t /*call*/, bool uses_pdl) {
  Launch l;
  if (ffi::Error e = prepare_combine(ordinal, out, ids, norm_weight, result, instance, grid, eps, apply_norm, l);
      e.failure()) {
    return e;
  }
  return record("combine", ctx, l, uses_pdl);
}
#endif

// The device, operands, results and attributes every combine handler binds (after its stage's context).
template <typename Binding>
auto bind_combine(Binding binding) {
  return std::move(binding)
      .template Ctx<ffi::DeviceOrdinal>()    // the device, key of the rank registry
      .template Arg<ffi::AnyBuffer>()        // out: bf16 [N*S, L] expert output per receive row
      .template Arg<ffi::AnyBuffer>()        // ids: int32 [T, K] this rank's own routing
      .template Arg<ffi::AnyBuffer>()        // norm_weight: bf16 [L] (read only if apply_norm)
      .template Ret<ffi::AnyBuffer>()        // result: bf16 [T, L] routed latent or its RMSNorm
      .template Attr<int64_t>("instance")    // which NvlinkBackend (several may coexist)
      .template Attr<int64_t>("grid")        // CTAs, >= 1
      .template Attr<float>("eps")           // RMSNorm epsilon
      .template Attr<int64_t>("apply_norm")  // 1: RMSNorm of the routed latent, 0: routed latent
      .template Attr<int64_t>("call");        // unique per call in a program: XLA never merges two calls
}

// ---------------------------------------------------------------------------------------------------------
// Handlers
// ---------------------------------------------------------------------------------------------------------

// Traced targets (jax_latent_ep_dispatch / _combine), registered by Python with jax.ffi.register_ffi_target.
XLA_FFI_DEFINE_HANDLER(kDispatchTraced, DispatchTraced,
                       bind_dispatch(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),  // XLA's stream
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kCombineTraced, CombineTraced,
                       bind_combine(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),  // XLA's stream
                       {ffi::Traits::kCmdBufferCompatible});

#if JAX_LATENT_EP_RECORD
// Record targets (registered by ep_register_record_targets): the execute stage (outside command buffers) and
// the record stage (inside them), both with the `uses_pdl` attribute that XLA also reads for the node.
XLA_FFI_DEFINE_HANDLER(kDispatchExecute, DispatchExecute,
                       bind_dispatch(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())  // XLA's stream
                           .Attr<bool>("uses_pdl"),  // programmatic dependent launch allowed
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kDispatchRecord, DispatchRecord,
                       bind_dispatch(ffi::Ffi::BindRecord().Ctx<ffi::Extension<RecordExtension>>())  // the record
                           .Attr<bool>("uses_pdl"));  // programmatic dependent launch allowed (the node's edges)
XLA_FFI_DEFINE_HANDLER(kCombineExecute, CombineExecute,
                       bind_combine(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())  // XLA's stream
                           .Attr<bool>("uses_pdl"),  // programmatic dependent launch allowed
                       {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER(kCombineRecord, CombineRecord,
                       bind_combine(ffi::Ffi::BindRecord().Ctx<ffi::Extension<RecordExtension>>())  // the record
                           .Attr<bool>("uses_pdl"));  // programmatic dependent launch allowed (the node's edges)
#endif

// The XLA FFI API of the process's CUDA plugin, seen in the first call frame of a traced handler: XLA queries
// a handler's metadata when jax.ffi.register_ffi_target registers it, so it is known once Python registered
// the traced targets with an initialized CUDA backend. Only ep_register_record_targets uses it.
std::atomic<const XLA_FFI_Api*> g_api{nullptr};

XLA_FFI_Error* remember_api(XLA_FFI_CallFrame* call_frame, XLA_FFI_Handler* handler) {
  if (g_api.load(std::memory_order_relaxed) == nullptr && call_frame->api != nullptr) {
    const XLA_FFI_Api* none = nullptr;
    g_api.compare_exchange_strong(none, call_frame->api);
  }
  return handler(call_frame);
}

}  // namespace

// The handler symbols are what Python wraps with jax.ffi.pycapsule: exported even under -fvisibility=hidden.
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* EpDispatch(XLA_FFI_CallFrame* call_frame) {
  return remember_api(call_frame, kDispatchTraced);
}
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* EpCombine(XLA_FFI_CallFrame* call_frame) {
  return remember_api(call_frame, kCombineTraced);
}

// ---------------------------------------------------------------------------------------------------------
// Plain C entry points for ctypes.
// ---------------------------------------------------------------------------------------------------------
extern "C" {

// The message of the last failed call on this thread ("" if none).
__attribute__((visibility("default"))) const char* ep_last_error() { return g_last_error.c_str(); }

// Registers rank `rank` of instance `instance` on CUDA device `ordinal` and loads both cubins there (once per
// device and image). Must be called outside CUDA graph capture, after JAX initialized the device. Returns 0,
// or 1 with ep_last_error() set. Registering an (instance, ordinal) pair again replaces it.
__attribute__((visibility("default"))) int ep_register_rank(
    int64_t instance, int ordinal, int rank, int ranks, int max_tokens, int latent, int topk,
    uint64_t peers, uint64_t status_device, const void* status_host, int64_t timeout_ns,
    const void* dispatch_cubin, size_t dispatch_size, const char* dispatch_name, int dispatch_block,
    int dispatch_smem, const void* combine_cubin, size_t combine_size, const char* combine_name,
    int combine_block, int combine_smem) {
  if (ranks < 1 || ranks > 32 || rank < 0 || rank >= ranks) {
    return fail("rank=" + std::to_string(rank) + " ranks=" + std::to_string(ranks) + " out of range");
  }
  if (max_tokens < 1 || max_tokens >= (1 << 16)) {
    return fail("max_tokens=" + std::to_string(max_tokens) + " out of range");
  }
  if (latent <= 0 || latent % 32 || topk < 1 || topk > 32) {
    return fail("bad shape latent=" + std::to_string(latent) + " topk=" + std::to_string(topk));
  }
  if (peers == 0) return fail("peers must be a device address");
  auto entry = std::make_shared<Rank>();
  entry->instance = instance;
  entry->ordinal = ordinal;
  entry->rank = rank;
  entry->ranks = ranks;
  entry->max_tokens = max_tokens;
  entry->stride = (max_tokens + 7) / 8 * 8;
  entry->latent = latent;
  entry->topk = topk;
  entry->peers = peers;
  entry->status = status_device;
  entry->status_host = static_cast<volatile const int32_t*>(status_host);
  entry->timeout_ns = timeout_ns;
  std::lock_guard<std::mutex> lock(g_mutex);
  if (load_kernel(ordinal, dispatch_cubin, dispatch_size, dispatch_name, dispatch_block, dispatch_smem,
                  &entry->dispatch) ||
      load_kernel(ordinal, combine_cubin, combine_size, combine_name, combine_block, combine_smem,
                  &entry->combine)) {
    return 1;
  }
  g_ranks[{instance, ordinal}] = std::move(entry);
  return 0;
}

// Forgets (instance, ordinal); returns 0 if it was registered, 1 otherwise. Modules stay loaded.
__attribute__((visibility("default"))) int ep_unregister_rank(int64_t instance, int ordinal) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_ranks.erase({instance, ordinal}) == 1 ? 0 : fail("not registered");
}

// The largest grid of one launch of `kernel` (0 dispatch, 1 combine) for (instance, ordinal), or -1 if that
// pair is not registered.
__attribute__((visibility("default"))) int64_t ep_max_grid(int64_t instance, int ordinal, int kernel) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_ranks.find({instance, ordinal});
  if (it == g_ranks.end()) return -1;
  return kernel == 0 ? it->second->dispatch.max_grid : it->second->combine.max_grid;
}

// Number of registered (instance, device) pairs (for tests).
__attribute__((visibility("default"))) int ep_registered_count() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return static_cast<int>(g_ranks.size());
}

// Registers the record targets `dispatch_name` / `combine_name` for CUDA, straight through the XLA FFI API of
// the CUDA plugin (jax.ffi.register_ffi_target would drop their record handler): each with its execute and
// record handler, command-buffer compatible. Call after Python registered the traced targets (EpDispatch /
// EpCombine) with an initialized CUDA backend. Returns 0 (also when they are already registered), 2 if no
// XLA FFI API has been seen yet (register the traced targets first, then call again), or 1 if the record
// stage is not available (not compiled in, or XLA refused); ep_last_error() says why for 1 and 2.
__attribute__((visibility("default"))) int ep_register_record_targets(const char* dispatch_name,
                                                                      const char* combine_name) {
#if !JAX_LATENT_EP_RECORD
  (void)dispatch_name;
  (void)combine_name;
  return fail("record stage not available: this library was built against XLA FFI headers without "
              "xla/ffi/api/record_api.h (jaxlib < 0.11.2)");
#else
  const XLA_FFI_Api* api = g_api.load();
  if (api == nullptr) {
    fail("record stage not available yet: no XLA FFI API seen (register the traced targets with "
         "jax.ffi.register_ffi_target for CUDA, once JAX initialized its CUDA backend, then call again)");
    return 2;
  }
  if (dispatch_name == nullptr || combine_name == nullptr || !*dispatch_name || !*combine_name) {
    return fail("record target names must not be empty");
  }
  static std::set<std::string>* registered = new std::set<std::string>();  // by this library, this process
  std::lock_guard<std::mutex> lock(g_mutex);
  const struct {
    const char* name;
    XLA_FFI_Handler* execute;
    XLA_FFI_Handler* record;
  } targets[] = {{dispatch_name, kDispatchExecute, kDispatchRecord},
                 {combine_name, kCombineExecute, kCombineRecord}};
  for (const auto& t : targets) {
    if (registered->count(t.name)) continue;
    XLA_FFI_Handler_Register_Args args;
    std::memset(&args, 0, sizeof(args));
    args.struct_size = XLA_FFI_Handler_Register_Args_STRUCT_SIZE;  // the size that carries bundle.record
    args.extension_start = nullptr;
    args.name = XLA_FFI_ByteSpan{t.name, std::strlen(t.name)};
    args.platform = XLA_FFI_ByteSpan{"CUDA", 4};
    args.bundle.execute = t.execute;
    args.bundle.record = t.record;
    args.traits = XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE;
    if (XLA_FFI_Error* error = api->XLA_FFI_Handler_Register(&args); error != nullptr) {
      std::string why = ffi::internal::GetErrorMessage(api, error);
      ffi::internal::DestroyError(api, error);
      return fail(std::string("record stage not available: XLA refused to register the record target ") +
                  t.name + ": " + why);
    }
    registered->insert(t.name);
  }
  return 0;
#endif
}

// How often the record handlers added (creates) or updated (updates) a kernel node, for tests and
// benchmarks; both 0 on the traced path. Returns 0, or 1 if the record stage is not compiled in.
__attribute__((visibility("default"))) int ep_record_counts(int64_t* creates, int64_t* updates) {
#if JAX_LATENT_EP_RECORD
  *creates = g_record_creates.load();
  *updates = g_record_updates.load();
  return 0;
#else
  *creates = *updates = 0;
  return fail("record stage not available");
#endif
}

}  // extern "C"
