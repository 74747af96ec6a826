#include "registry.h"

#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

#include "driver.h"
#include "ep_abi.h"

namespace jax_latent_ep {
namespace {

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
// (op, ordinal) -> a kernel registered without a rank; never erased, so the pointers stay valid.
std::map<std::pair<std::string, int>, std::unique_ptr<Kernel>> g_kernels;
thread_local std::string g_last_error;

// Loads `k.data` (a cubin) into `ordinal`'s primary context once and resolves `k.name`. Caller holds g_mutex.
int load_kernel(int ordinal, const KernelImage& k, Kernel* out) {
  const char* name = k.name;
  const int block = k.block, smem = k.smem;
  const Driver& d = driver();
  if (!d.error.empty()) return fail(d.error);
  if (k.data == nullptr || k.size == 0) return fail(std::string("empty cubin for kernel ") + name);
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
  auto key = std::make_tuple(
      ordinal, std::hash<std::string_view>()(std::string_view(static_cast<const char*>(k.data), k.size)), k.size);
  CUmodule module = nullptr;
  if (auto it = g_modules.find(key); it != g_modules.end()) {
    module = it->second;
  } else if ((rc = d.cuModuleLoadData(&module, k.data)) == kCudaSuccess) {
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
  out->image = &*g_images.emplace(static_cast<const char*>(k.data), k.size).first;
  out->block = static_cast<unsigned>(block);
  out->smem = static_cast<unsigned>(smem);
  return 0;
}

}  // namespace

int fail(std::string message) {
  g_last_error = std::move(message);
  return 1;
}

const char* last_error() { return g_last_error.c_str(); }

int register_rank(Rank r, const KernelImage& dispatch, const KernelImage& combine) {
  if (r.ranks < 1 || r.ranks > ep_abi::kMaxRanks || r.rank < 0 || r.rank >= r.ranks) {
    return fail("rank=" + std::to_string(r.rank) + " ranks=" + std::to_string(r.ranks) + " out of range");
  }
  if (r.max_tokens < 1 || r.max_tokens >= ep_abi::kMaxTokensExclusive) {
    return fail("max_tokens=" + std::to_string(r.max_tokens) + " out of range");
  }
  if (r.latent <= 0 || r.latent % ep_abi::kMxBlock || r.topk < 1 || r.topk > ep_abi::kMaxTopk) {
    return fail("bad shape latent=" + std::to_string(r.latent) + " topk=" + std::to_string(r.topk));
  }
  if (r.peers == 0) return fail("peers must be a device address");
  r.stride = ep_abi::stride(r.max_tokens);
  auto entry = std::make_shared<Rank>(std::move(r));
  std::lock_guard<std::mutex> lock(g_mutex);
  if (load_kernel(entry->ordinal, dispatch, &entry->dispatch) ||
      load_kernel(entry->ordinal, combine, &entry->combine)) {
    return 1;
  }
  g_ranks[{entry->instance, entry->ordinal}] = std::move(entry);
  return 0;
}

int unregister_rank(int64_t instance, int ordinal) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_ranks.erase({instance, ordinal}) == 1 ? 0 : fail("not registered");
}

std::shared_ptr<const Rank> registered_rank(int64_t instance, int ordinal) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_ranks.find({instance, ordinal});
  return it == g_ranks.end() ? nullptr : it->second;
}

int registered_count() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return static_cast<int>(g_ranks.size());
}

int register_kernel(const std::string& op, int ordinal, const KernelImage& image) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto key = std::make_pair(op, ordinal);
  if (g_kernels.count(key)) return 0;
  auto k = std::make_unique<Kernel>();
  if (load_kernel(ordinal, image, k.get())) return 1;
  g_kernels[key] = std::move(k);
  return 0;
}

const Kernel* find_kernel(const std::string& op, int32_t ordinal) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (auto it = g_kernels.find({op, ordinal}); it != g_kernels.end()) return it->second.get();
  const Driver& d = driver();
  CUdevice dev;
  if (d.error.empty() && d.cuCtxGetDevice(&dev) == kCudaSuccess) {
    if (auto it = g_kernels.find({op, static_cast<int>(dev)}); it != g_kernels.end()) return it->second.get();
  }
  return nullptr;
}

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

}  // namespace jax_latent_ep
