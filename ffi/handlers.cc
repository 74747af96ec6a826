// The handlers of the dispatch and combine targets (the expert stage's are in expert_handlers.cc). Each op is a
// traits struct (stages.h): its FFI binding, its operand checks against the registered rank and its kernel
// parameters, filled into the generated ep_abi.h struct with designated initializers (every field, in ABI order:
// the build's -Werror=missing-field-initializers turns a parameter added to kernels/abi.py only into an error).
#include "handlers.h"

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>

#include "checks.h"
#include "ep_abi.h"
#include "launch.h"
#include "registry.h"
#include "stages.h"
#include "status.h"
#include "xla/ffi/api/ffi.h"

namespace jax_latent_ep {
namespace {

ffi::Error missing_rank(const char* what, int64_t instance, int32_t ordinal) {
  return ffi::Error::InvalidArgument(
      std::string("jax_latent_ep ") + what + ": no NvlinkBackend instance " + std::to_string(instance) +
      " is registered on device ordinal " + std::to_string(ordinal) +
      " (was the backend closed, or built for a different mesh?)");
}

// A kernel that failed earlier (a timeout or a call out of sequence) left its record in the host-mapped status
// page: report it in kernels/abi.py's words (describe_error).
ffi::Error check_status(const Rank& r, const char* what) {
  if (r.status_host == nullptr || r.status_host[ep_abi::kStatusCode] == ep_abi::kErrorNone) {
    return ffi::Error::Success();
  }
  return ffi::Error::Internal(std::string("jax_latent_ep ") + what + ": earlier, " + describe_error(r.status_host) +
                              "; the CUDA context is unusable, restart the process");
}

// The registration a handler of `instance` runs for, unless it is missing or a kernel failed earlier: held by
// the Launch until the kernel is issued.
ffi::Error find_launch_rank(const char* what, int64_t instance, int32_t ordinal, Launch& l) {
  l.rank = find_rank(instance, ordinal);
  if (l.rank == nullptr) return missing_rank(what, instance, ordinal);
  return check_status(*l.rank, what);
}

// ---------------------------------------------------------------------------------------------------------
// dispatch(x, ids, weights) -> (recv_x, recv_sf, recv_ids, recv_weights, recv_src)

struct Dispatch {
  static constexpr const char* kWhat = "dispatch";

  // The device, operands, results and attributes every dispatch handler binds (after its stage's context).
  template <typename Binding>
  static auto bind(Binding binding) {
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
        .template Attr<int64_t>("grid")      // CTAs, >= 1 (CTA c takes tokens c, c + grid, ...)
        .template Attr<int64_t>("call");     // unique per call in a program: XLA never merges two calls
  }

  // Checks the operands against the registered rank and computes the launch (every dispatch handler).
  static ffi::Error prepare(Launch& l, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer ids,
                            ffi::AnyBuffer weights, ffi::Result<ffi::AnyBuffer> recv_x,
                            ffi::Result<ffi::AnyBuffer> recv_sf, ffi::Result<ffi::AnyBuffer> recv_ids,
                            ffi::Result<ffi::AnyBuffer> recv_weights, ffi::Result<ffi::AnyBuffer> recv_src,
                            int64_t instance, int64_t grid, int64_t /*call*/) {
    if (ffi::Error e = find_launch_rank(kWhat, instance, ordinal, l); e.failure()) return e;
    const Rank& r = *l.rank;
    auto xd = x.dimensions();
    if (xd.size() != 2) return ffi::Error::InvalidArgument("jax_latent_ep dispatch: x must be [T, L]");
    const int64_t T = xd[0], L = r.latent, K = r.topk, rows = int64_t{r.ranks} * r.stride;
    if (T < 1 || T > r.max_tokens) {
      return ffi::Error::InvalidArgument("jax_latent_ep dispatch: T=" + std::to_string(T) +
                                         " tokens, expected 1 <= T <= max_tokens=" + std::to_string(r.max_tokens));
    }
    if (grid < 1 || grid > r.dispatch.max_grid) {
      return ffi::Error::InvalidArgument(
          "jax_latent_ep dispatch: grid=" + std::to_string(grid) + " CTAs; it must satisfy 1 <= grid <= " +
          std::to_string(r.dispatch.max_grid) + " (the CTAs of one launch that fit on the device at once)");
    }
    if (ffi::Error e = first_error({expect(kWhat, "x", x, ffi::DataType::BF16, {T, L}),
                                    expect(kWhat, "ids", ids, ffi::DataType::S32, {T, K}),
                                    expect(kWhat, "weights", weights, ffi::DataType::F32, {T, K}),
                                    expect(kWhat, "recv_x", *recv_x, ffi::DataType::F8E4M3FN, {rows, L}),
                                    expect(kWhat, "recv_sf", *recv_sf, ffi::DataType::U8, {rows, L / ep_abi::kMxBlock}),
                                    expect(kWhat, "recv_ids", *recv_ids, ffi::DataType::S32, {rows, K}),
                                    expect(kWhat, "recv_weights", *recv_weights, ffi::DataType::F32, {rows, K}),
                                    expect(kWhat, "recv_src", *recv_src, ffi::DataType::S32, {rows})});
        e.failure()) {
      return e;
    }
    l.kernel = &r.dispatch;
    l.grid = static_cast<unsigned>(grid);
    l.params = make_params(ep_abi::DispatchParams{
        .x = address(x.untyped_data()),
        .ids = address(ids.untyped_data()),
        .weights = address(weights.untyped_data()),
        .peers = address(r.peers),
        .recv_x = address(recv_x->untyped_data()),
        .recv_sf = address(recv_sf->untyped_data()),
        .recv_ids = address(recv_ids->untyped_data()),
        .recv_weights = address(recv_weights->untyped_data()),
        .recv_src = address(recv_src->untyped_data()),
        .status = address(r.status),
        .timeout_ns = r.timeout_ns,
        .rank = r.rank,
        .tokens = static_cast<int32_t>(T),
        .peer_tokens = static_cast<int32_t>(T),  // under shard_map every rank's T is this call's T
        .max_tokens = r.max_tokens,
    });
    return ffi::Error::Success();
  }
};
static_assert(visited_count<ep_abi::DispatchParams>() == ep_abi::kDispatchParamsCount,
              "ep_abi.h: visit_params(DispatchParams) must pass every parameter once");
static_assert(ep_abi::kDispatchParamsCount <= KernelParams::kCapacity, "KernelParams holds too few parameters");

// ---------------------------------------------------------------------------------------------------------
// combine(out, ids, norm_weight) -> result

struct Combine {
  static constexpr const char* kWhat = "combine";

  // The device, operands, results and attributes every combine handler binds (after its stage's context).
  template <typename Binding>
  static auto bind(Binding binding) {
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
        .template Attr<int64_t>("call");       // unique per call in a program: XLA never merges two calls
  }

  // Checks the operands against the registered rank and computes the launch (every combine handler).
  static ffi::Error prepare(Launch& l, int32_t ordinal, ffi::AnyBuffer out, ffi::AnyBuffer ids,
                            ffi::AnyBuffer norm_weight, ffi::Result<ffi::AnyBuffer> result, int64_t instance,
                            int64_t grid, float eps, int64_t apply_norm, int64_t /*call*/) {
    if (ffi::Error e = find_launch_rank(kWhat, instance, ordinal, l); e.failure()) return e;
    const Rank& r = *l.rank;
    auto id = ids.dimensions();
    if (id.size() != 2) return ffi::Error::InvalidArgument("jax_latent_ep combine: ids must be [T, K]");
    const int64_t T = id[0], L = r.latent, K = r.topk, rows = int64_t{r.ranks} * r.stride;
    if (T < 1 || T > r.max_tokens) {
      return ffi::Error::InvalidArgument("jax_latent_ep combine: T=" + std::to_string(T) +
                                         " tokens, expected 1 <= T <= max_tokens=" + std::to_string(r.max_tokens));
    }
    if (grid < 1 || grid > r.combine.max_grid) {
      return ffi::Error::InvalidArgument(
          "jax_latent_ep combine: grid=" + std::to_string(grid) + " CTAs; it must satisfy 1 <= grid <= " +
          std::to_string(r.combine.max_grid) + " (the CTAs of one launch that fit on the device at once)");
    }
    if (ffi::Error e = first_error({expect(kWhat, "out", out, ffi::DataType::BF16, {rows, L}),
                                    expect(kWhat, "ids", ids, ffi::DataType::S32, {T, K}),
                                    expect(kWhat, "norm_weight", norm_weight, ffi::DataType::BF16, {L}),
                                    expect(kWhat, "result", *result, ffi::DataType::BF16, {T, L})});
        e.failure()) {
      return e;
    }
    l.kernel = &r.combine;
    l.grid = static_cast<unsigned>(grid);
    l.params = make_params(ep_abi::CombineParams{
        .out = address(out.untyped_data()),
        .ids = address(ids.untyped_data()),
        .norm_weight = address(norm_weight.untyped_data()),
        .result = address(result->untyped_data()),
        .peers = address(r.peers),
        .status = address(r.status),
        .timeout_ns = r.timeout_ns,
        .eps = eps,
        .rank = r.rank,
        .tokens = static_cast<int32_t>(T),
        .peer_tokens = static_cast<int32_t>(T),  // every rank's T (the dispatch's)
        .max_tokens = r.max_tokens,
        .apply_norm = apply_norm != 0 ? 1 : 0,
    });
    return ffi::Error::Success();
  }
};
static_assert(visited_count<ep_abi::CombineParams>() == ep_abi::kCombineParamsCount,
              "ep_abi.h: visit_params(CombineParams) must pass every parameter once");
static_assert(ep_abi::kCombineParamsCount <= KernelParams::kCapacity, "KernelParams holds too few parameters");

}  // namespace

Targets dispatch_targets() { return targets<Dispatch>(); }
Targets combine_targets() { return targets<Combine>(); }

}  // namespace jax_latent_ep
