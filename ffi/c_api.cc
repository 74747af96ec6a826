// The library's exported C ABI: the FFI handler symbols that Python wraps with jax.ffi.pycapsule, and the plain C
// entry points for ctypes (jax_latent_ep/runtime/ffi.py). Everything else is hidden (-fvisibility=hidden).
//
// Division of work:
//   * Python (jax_latent_ep/runtime/ffi.py and the NVLink backend) allocates the symmetric buffers, the device
//     peer tables and the host-mapped status pages, then calls `ep_register_rank` once per (instance, device).
//     That call loads the cubins into the device's primary context (once per device and cubin image, outside
//     any CUDA graph capture), keeps a copy of each image for the life of the process and records everything
//     a launch needs in the registry (registry.cc).
//   * The handlers (handlers.cc) look their rank up in that registry by (instance attribute, device ordinal),
//     check the operand shapes and compute the kernel parameters. Two ways to the kernel (launch.cc):
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
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "expert_handlers.h"
#include "handlers.h"
#include "launch.h"
#include "registry.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

#define EP_EXPORT __attribute__((visibility("default")))

namespace {

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

namespace ep = jax_latent_ep;

#if !JAX_LATENT_EP_RECORD
constexpr const char* kNoRecordStage =
    "record stage not available: this library was built against XLA FFI headers without xla/ffi/api/record_api.h "
    "(jaxlib < 0.11.2)";
#endif

// The traced targets' handlers.
extern "C" EP_EXPORT XLA_FFI_Error* EpDispatch(XLA_FFI_CallFrame* call_frame) {
  return remember_api(call_frame, ep::dispatch_targets().traced);
}
extern "C" EP_EXPORT XLA_FFI_Error* EpCombine(XLA_FFI_CallFrame* call_frame) {
  return remember_api(call_frame, ep::combine_targets().traced);
}

extern "C" EP_EXPORT XLA_FFI_Error* EpGroupedGemm(XLA_FFI_CallFrame* call_frame) {
  return remember_api(call_frame, ep::grouped_gemm_targets().traced);
}
extern "C" EP_EXPORT XLA_FFI_Error* EpExpertPlan(XLA_FFI_CallFrame* call_frame) {
  return remember_api(call_frame, ep::expert_plan_targets().traced);
}
extern "C" EP_EXPORT XLA_FFI_Error* EpExpertStage(XLA_FFI_CallFrame* call_frame) {
  return remember_api(call_frame, ep::expert_stage_targets().traced);
}
extern "C" EP_EXPORT XLA_FFI_Error* EpRowSum(XLA_FFI_CallFrame* call_frame) {
  return remember_api(call_frame, ep::row_sum_targets().traced);
}
extern "C" EP_EXPORT XLA_FFI_Error* EpGroupedMatmul(XLA_FFI_CallFrame* call_frame) {
  return remember_api(call_frame, ep::grouped_matmul_targets().traced);
}
extern "C" EP_EXPORT XLA_FFI_Error* EpGroupedMatmulWgrad(XLA_FFI_CallFrame* call_frame) {
  return remember_api(call_frame, ep::grouped_matmul_wgrad_targets().traced);
}
extern "C" EP_EXPORT XLA_FFI_Error* EpGroupedMatmulFp8(XLA_FFI_CallFrame* call_frame) {
  return remember_api(call_frame, ep::grouped_matmul_fp8_targets().traced);
}
extern "C" EP_EXPORT XLA_FFI_Error* EpGroupedMatmulMxfp4(XLA_FFI_CallFrame* call_frame) {
  return remember_api(call_frame, ep::grouped_matmul_mxfp4_targets().traced);
}
extern "C" EP_EXPORT XLA_FFI_Error* EpGroupedMatmulFp8N16(XLA_FFI_CallFrame* call_frame) {
  return remember_api(call_frame, ep::grouped_matmul_fp8_n16_targets().traced);
}
extern "C" EP_EXPORT XLA_FFI_Error* EpGroupedMatmulMxfp4N16(XLA_FFI_CallFrame* call_frame) {
  return remember_api(call_frame, ep::grouped_matmul_mxfp4_n16_targets().traced);
}
extern "C" EP_EXPORT XLA_FFI_Error* EpGroupedMatmulFp8N8(XLA_FFI_CallFrame* call_frame) {
  return remember_api(call_frame, ep::grouped_matmul_fp8_n8_targets().traced);
}
extern "C" EP_EXPORT XLA_FFI_Error* EpGroupedMatmulMxfp4N8(XLA_FFI_CallFrame* call_frame) {
  return remember_api(call_frame, ep::grouped_matmul_mxfp4_n8_targets().traced);
}
extern "C" EP_EXPORT XLA_FFI_Error* EpGroupedMatmulFp8Wide(XLA_FFI_CallFrame* call_frame) {
  return remember_api(call_frame, ep::grouped_matmul_fp8_wide_targets().traced);
}
extern "C" EP_EXPORT XLA_FFI_Error* EpGroupedMatmulFp8WideGlu(XLA_FFI_CallFrame* call_frame) {
  return remember_api(call_frame, ep::grouped_matmul_fp8_wide_glu_targets().traced);
}
extern "C" EP_EXPORT XLA_FFI_Error* EpSwigluMxfp8(XLA_FFI_CallFrame* call_frame) {
  return remember_api(call_frame, ep::swiglu_mxfp8_targets().traced);
}

#if JAX_LATENT_EP_RECORD
namespace {

struct RecordTarget {
  const char* name;
  ep::Targets handlers;
};

// Registers each target's execute and record handler for CUDA through the XLA FFI API seen by a traced handler
// (once per name and process); the return codes of ep_register_record_targets.
int register_record_targets(const std::vector<RecordTarget>& targets) {
  const XLA_FFI_Api* api = g_api.load();
  if (api == nullptr) {
    ep::fail("record stage not available yet: no XLA FFI API seen (register the traced targets with "
             "jax.ffi.register_ffi_target for CUDA, once JAX initialized its CUDA backend, then call again)");
    return 2;
  }
  for (const auto& t : targets) {
    if (t.name == nullptr || !*t.name) return ep::fail("record target names must not be empty");
  }
  static std::mutex mutex;
  static std::set<std::string>* registered = new std::set<std::string>();  // by this library, this process
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& t : targets) {
    if (registered->count(t.name)) continue;
    XLA_FFI_Handler_Register_Args args;
    std::memset(&args, 0, sizeof(args));
    args.struct_size = XLA_FFI_Handler_Register_Args_STRUCT_SIZE;  // the size that carries bundle.record
    args.extension_start = nullptr;
    args.name = XLA_FFI_ByteSpan{t.name, std::strlen(t.name)};
    args.platform = XLA_FFI_ByteSpan{"CUDA", 4};
    args.bundle.execute = t.handlers.execute;
    args.bundle.record = t.handlers.record;
    args.traits = XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE;
    if (XLA_FFI_Error* error = api->XLA_FFI_Handler_Register(&args); error != nullptr) {
      std::string why = xla::ffi::internal::GetErrorMessage(api, error);
      xla::ffi::internal::DestroyError(api, error);
      return ep::fail(std::string("record stage not available: XLA refused to register the record target ") +
                      t.name + ": " + why);
    }
    registered->insert(t.name);
  }
  return 0;
}

}  // namespace
#endif

extern "C" {

// The message of the last failed call on this thread ("" if none).
EP_EXPORT const char* ep_last_error() { return ep::last_error(); }

// Registers rank `rank` of instance `instance` on CUDA device `ordinal` and loads both cubins there (once per
// device and image). Must be called outside CUDA graph capture, after JAX initialized the device. Returns 0,
// or 1 with ep_last_error() set. Registering an (instance, ordinal) pair again replaces it.
EP_EXPORT int ep_register_rank(int64_t instance, int ordinal, int rank, int ranks, int max_tokens, int latent,
                               int topk, uint64_t peers, uint64_t status_device, const void* status_host,
                               int64_t timeout_ns, const void* dispatch_cubin, size_t dispatch_size,
                               const char* dispatch_name, int dispatch_block, int dispatch_smem,
                               const void* combine_cubin, size_t combine_size, const char* combine_name,
                               int combine_block, int combine_smem) {
  ep::Rank r;
  r.instance = instance;
  r.ordinal = ordinal;
  r.rank = rank;
  r.ranks = ranks;
  r.max_tokens = max_tokens;
  r.latent = latent;
  r.topk = topk;
  r.peers = peers;
  r.status = status_device;
  r.status_host = static_cast<volatile const int32_t*>(status_host);
  r.timeout_ns = timeout_ns;
  return ep::register_rank(std::move(r),
                           {dispatch_cubin, dispatch_size, dispatch_name, dispatch_block, dispatch_smem},
                           {combine_cubin, combine_size, combine_name, combine_block, combine_smem});
}

// Forgets (instance, ordinal); returns 0 if it was registered, 1 otherwise. Modules stay loaded.
EP_EXPORT int ep_unregister_rank(int64_t instance, int ordinal) { return ep::unregister_rank(instance, ordinal); }

// The largest grid of one launch of `kernel` (0 dispatch, 1 combine) for (instance, ordinal), or -1 if that
// pair is not registered.
EP_EXPORT int64_t ep_max_grid(int64_t instance, int ordinal, int kernel) {
  std::shared_ptr<const ep::Rank> r = ep::registered_rank(instance, ordinal);
  if (r == nullptr) return -1;
  return kernel == 0 ? r->dispatch.max_grid : r->combine.max_grid;
}

// Loads the kernel of op `op` that needs no rank (the grouped GEMM; `name` its cubin symbol) on CUDA device
// `ordinal`, once per (op, ordinal), outside CUDA graph capture. Returns 0, or 1 with ep_last_error() set.
EP_EXPORT int ep_register_kernel(const char* op, int ordinal, const void* cubin, size_t size, const char* name,
                                 int block, int smem) {
  return ep::register_kernel(op, ordinal, {cubin, size, name, block, smem});
}

// Number of registered (instance, device) pairs (for tests).
EP_EXPORT int ep_registered_count() { return ep::registered_count(); }


// Registers the record targets `dispatch_name` / `combine_name` for CUDA, straight through the XLA FFI API of
// the CUDA plugin (jax.ffi.register_ffi_target would drop their record handler): each with its execute and
// record handler, command-buffer compatible. Call after Python registered the traced targets (EpDispatch /
// EpCombine) with an initialized CUDA backend. Returns 0 (also when they are already registered), 2 if no
// XLA FFI API has been seen yet (register the traced targets first, then call again), or 1 if the record
// stage is not available (not compiled in, or XLA refused); ep_last_error() says why for 1 and 2.
EP_EXPORT int ep_register_record_targets(const char* dispatch_name, const char* combine_name) {
#if !JAX_LATENT_EP_RECORD
  (void)dispatch_name;
  (void)combine_name;
  return ep::fail(kNoRecordStage);
#else
  return register_record_targets({{dispatch_name, ep::dispatch_targets()}, {combine_name, ep::combine_targets()}});
#endif
}

// The same for the expert stage's record targets: `names[i]` for expert op `ops[i]` (`runtime/ffi.py`
// EXPERT_RECORD_TARGETS: the grouped GEMM, the plan, the fused stage, the row sum, the FP8 / MXFP4 grouped matmuls,
// the SwiGLU), `count` of them: a kernel node each in XLA's command buffers, updated in place, instead of a stream
// capture per record. An op it does not know is an error (rc 1), before any is registered.
EP_EXPORT int ep_register_expert_record_targets(const char* const* ops, const char* const* names, int count) {
#if !JAX_LATENT_EP_RECORD
  (void)ops;
  (void)names;
  (void)count;
  return ep::fail(kNoRecordStage);
#else
  static const std::pair<const char*, ep::Targets (*)()> kOps[] = {
      {"grouped_gemm", ep::grouped_gemm_targets},
      {"expert_plan", ep::expert_plan_targets},
      {"expert_stage", ep::expert_stage_targets},
      {"row_sum", ep::row_sum_targets},
      {"grouped_matmul_fp8", ep::grouped_matmul_fp8_targets},
      {"grouped_matmul_mxfp4", ep::grouped_matmul_mxfp4_targets},
      {"grouped_matmul_fp8_n16", ep::grouped_matmul_fp8_n16_targets},
      {"grouped_matmul_mxfp4_n16", ep::grouped_matmul_mxfp4_n16_targets},
      {"grouped_matmul_fp8_n8", ep::grouped_matmul_fp8_n8_targets},
      {"grouped_matmul_mxfp4_n8", ep::grouped_matmul_mxfp4_n8_targets},
      {"grouped_matmul_fp8_wide", ep::grouped_matmul_fp8_wide_targets},
      {"grouped_matmul_fp8_wide_glu", ep::grouped_matmul_fp8_wide_glu_targets},
      {"swiglu_mxfp8", ep::swiglu_mxfp8_targets},
  };
  if (count < 0 || (count > 0 && (ops == nullptr || names == nullptr))) return ep::fail("bad record target list");
  std::vector<RecordTarget> targets;
  for (int i = 0; i < count; ++i) {
    const char* op = ops[i] == nullptr ? "" : ops[i];
    auto* found = std::find_if(std::begin(kOps), std::end(kOps),
                               [op](const auto& entry) { return std::strcmp(entry.first, op) == 0; });
    if (found == std::end(kOps)) return ep::fail(std::string("no record target for expert op '") + op + "'");
    targets.push_back({names[i], found->second()});
  }
  return register_record_targets(targets);
#endif
}

// How often the record handlers added (creates) or updated (updates) a kernel node, for tests and
// benchmarks; both 0 on the traced path. Returns 0, or 1 if the record stage is not compiled in.
EP_EXPORT int ep_record_counts(int64_t* creates, int64_t* updates) {
#if JAX_LATENT_EP_RECORD
  std::tie(*creates, *updates) = ep::record_counts();
  return 0;
#else
  *creates = *updates = 0;
  return ep::fail("record stage not available");
#endif
}

}  // extern "C"
