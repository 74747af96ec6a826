#include "driver.h"

#include <dlfcn.h>

#include <string>
#include <type_traits>

namespace jax_latent_ep {

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

}  // namespace jax_latent_ep
