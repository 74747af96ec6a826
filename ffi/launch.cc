#include "launch.h"

#include <atomic>
#include <cstring>
#include <string>
#include <vector>

namespace jax_latent_ep {

#if JAX_LATENT_EP_RECORD
std::vector<ffi::KernelArg> KernelParams::record_args() const {
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
namespace {
std::atomic<int64_t> g_record_creates{0}, g_record_updates{0};
}  // namespace

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

std::pair<int64_t, int64_t> record_counts() { return {g_record_creates.load(), g_record_updates.load()}; }
#else
std::pair<int64_t, int64_t> record_counts() { return {0, 0}; }
#endif  // JAX_LATENT_EP_RECORD

}  // namespace jax_latent_ep
