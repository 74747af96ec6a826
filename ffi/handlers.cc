// The handlers: one template over the op (`Stages<Op>`), instantiated for dispatch and combine into the traced,
// execute and record handlers. Each op is a traits struct: its FFI binding, its operand checks and its kernel
// parameters, filled into the generated ep_abi.h struct with designated initializers (every field, in ABI order:
// the build's -Werror=missing-field-initializers turns a parameter added to kernels/abi.py only into an error).
#include "handlers.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>

#include "ep_abi.h"
#include "launch.h"
#include "registry.h"
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

// The first error of `checks`, or success.
ffi::Error first_error(std::initializer_list<ffi::Error> checks) {
  for (const ffi::Error& e : checks) {
    if (!e.success()) return e;
  }
  return ffi::Error::Success();
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
        .template Attr<int64_t>("grid")      // CTAs, >= T
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
    if (grid < T || grid > r.dispatch.max_grid) {
      return ffi::Error::InvalidArgument(
          "jax_latent_ep dispatch: grid=" + std::to_string(grid) + " CTAs for T=" + std::to_string(T) +
          " tokens; it must satisfy T <= grid <= " + std::to_string(r.dispatch.max_grid) +
          " (the CTAs of one launch that fit on the device at once)");
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

// The shape-free expert kernel named `what` loaded on `ordinal` (ffi.load_expert_kernels), held by the Launch.
ffi::Error find_expert_kernel(const char* what, int32_t ordinal, Launch& l) {
  l.kernel = find_kernel(what, ordinal);
  if (l.kernel != nullptr) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string("jax_latent_ep ") + what + ": its kernel is not loaded on device "
                                     "ordinal " + std::to_string(ordinal) +
                                     " (jax_latent_ep.runtime.ffi.load_expert_kernels)");
}

// ---------------------------------------------------------------------------------------------------------
// grouped_gemm(a, a_rows, a_scale, w, w_second, w_scale, w_second_scale, work) -> out: the expert stage's GEMM
// (kernels/grouped_gemm.py): its BF16 kernel, or with float8_e4m3fn weights its FP8 kernel (MXFP8 `a`); no rank.

struct GroupedGemm {
  static constexpr const char* kWhat = "grouped_gemm";
  static constexpr int64_t kBlockK = ep_abi::kGemmBlockK, kWorkWords = ep_abi::kGemmWorkWords;

  template <typename Binding>
  static auto bind(Binding binding) {
    return std::move(binding)
        .template Ctx<ffi::DeviceOrdinal>()      // the device, key of the kernel registry
        .template Arg<ffi::AnyBuffer>()          // a: bf16 [R, K] activations (FP8 weights: float8_e4m3fn)
        .template Arg<ffi::AnyBuffer>()          // a_rows: int32 [P] row of `a` per pair (read only if indexed)
        .template Arg<ffi::AnyBuffer>()          // a_scale: uint8 [R, K/32] E8M0 scales of `a` (FP8 weights only)
        .template Arg<ffi::AnyBuffer>()          // w: bf16 or float8_e4m3fn [G, K, N] (the gate with two_weights)
        .template Arg<ffi::AnyBuffer>()          // w_second: as w, the up (read only if two_weights)
        .template Arg<ffi::AnyBuffer>()          // w_scale: f32 [G, K/128, N/128] (read only with FP8 weights)
        .template Arg<ffi::AnyBuffer>()          // w_second_scale: as w_scale (FP8 weights and two_weights only)
        .template Arg<ffi::AnyBuffer>()          // work: int32 [W, 4] (group, first pair, pairs, items)
        .template Ret<ffi::AnyBuffer>()          // out: f32 [S, P, N or 2N] partials, or bf16 [P, N] with fuse_glu
        .template Attr<int64_t>("indexed")       // 1: pair p reads row a_rows[p] of a; 0: row p
        .template Attr<int64_t>("two_weights")   // 1: gate and up (w, w_second) in one launch
        .template Attr<int64_t>("fuse_glu")      // 1: out = bf16(silu(gate) * up) (two_weights, one split)
        .template Attr<int64_t>("k_per_split");  // contraction length of each of the S splits
  }

  static ffi::Error prepare(Launch& l, int32_t ordinal, ffi::AnyBuffer a, ffi::AnyBuffer a_rows,
                            ffi::AnyBuffer a_scale, ffi::AnyBuffer w, ffi::AnyBuffer w_second, ffi::AnyBuffer w_scale,
                            ffi::AnyBuffer w_second_scale,
                            ffi::AnyBuffer work, ffi::Result<ffi::AnyBuffer> out, int64_t indexed, int64_t two_weights,
                            int64_t fuse_glu, int64_t k_per_split) {
    const bool fp8 = w.element_type() == ffi::DataType::F8E4M3FN;
    const char* kernel = fp8 ? "grouped_gemm_fp8" : "grouped_gemm";
    l.kernel = find_kernel(kernel, ordinal);
    if (l.kernel == nullptr) {
      return ffi::Error::InvalidArgument(std::string("jax_latent_ep ") + kWhat + ": the " + kernel + " kernel is "
                                         "not loaded on device ordinal " + std::to_string(ordinal) +
                                         " (jax_latent_ep.runtime.ffi.load_expert_kernels)");
    }
    auto ad = a.dimensions(), rd = a_rows.dimensions(), wd = w.dimensions(), kd = work.dimensions();
    auto od = out->dimensions();
    if (ad.size() != 2 || rd.size() != 1 || wd.size() != 3 || kd.size() != 2 || od.size() != (fuse_glu ? 2u : 3u)) {
      return ffi::Error::InvalidArgument("jax_latent_ep grouped_gemm: expected a [R, K], a_rows [P], w [G, K, N], "
                                         "work [W, 4], out [S, P, N] (or [P, N] with fuse_glu)");
    }
    const int64_t R = ad[0], K = ad[1], P = rd[0], G = wd[0], N = wd[2], W = kd[0], S = fuse_glu ? 1 : od[0];
    const int64_t n_out = fuse_glu ? N : (two_weights ? 2 * N : N);
    // A tile: 64 columns of a BF16 weight, 128 of an FP8 one (a 128-byte row either way); FP8 scale blocks of 128.
    const int64_t tile = fp8 ? ep_abi::kGemmFp8BlockN : ep_abi::kGemmBlockN;
    const int64_t multiple = fp8 ? ep_abi::kGemmFp8ScaleBlock : kBlockK;
    if (K % multiple || N % tile || k_per_split <= 0 || k_per_split % multiple || S * k_per_split < K ||
        (S - 1) * k_per_split >= K || (fuse_glu && (!two_weights || k_per_split < K)) || (!indexed && R != P)) {
      return ffi::Error::InvalidArgument(
          "jax_latent_ep grouped_gemm: K=" + std::to_string(K) + ", N=" + std::to_string(N) + " must be multiples of " +
          std::to_string(multiple) + ", S=" + std::to_string(S) + " splits of k_per_split=" +
          std::to_string(k_per_split) + " (a multiple of it) must cover K with none empty, fuse_glu needs two weights "
          "and one split, and without a_rows a has one row per pair");
    }
    const ffi::DataType wt = fp8 ? ffi::DataType::F8E4M3FN : ffi::DataType::BF16;
    const int64_t KB = K / ep_abi::kGemmFp8ScaleBlock, NB = N / ep_abi::kGemmFp8ScaleBlock;
    ffi::Error out_ok = fuse_glu ? expect(kWhat, "out", *out, ffi::DataType::BF16, {P, N})
                                 : expect(kWhat, "out", *out, ffi::DataType::F32, {S, P, n_out});
    ffi::Error ok = ffi::Error::Success();
    ffi::Error scale_ok = fp8 ? expect(kWhat, "w_scale", w_scale, ffi::DataType::F32, {G, KB, NB}) : ok;
    ffi::Error second_ok = two_weights ? expect(kWhat, "w_second", w_second, wt, {G, K, N}) : ok;
    ffi::Error second_scale_ok =
        fp8 && two_weights ? expect(kWhat, "w_second_scale", w_second_scale, ffi::DataType::F32, {G, KB, NB}) : ok;
    ffi::Error a_ok = fp8 ? expect(kWhat, "a", a, ffi::DataType::F8E4M3FN, {R, K})
                          : expect(kWhat, "a", a, ffi::DataType::BF16, {R, K});
    ffi::Error a_scale_ok = fp8 ? expect(kWhat, "a_scale", a_scale, ffi::DataType::U8, {R, K / ep_abi::kMxBlock}) : ok;
    if (ffi::Error e = first_error({a_ok, a_scale_ok, expect(kWhat, "a_rows", a_rows, ffi::DataType::S32, {P}),
                                    expect(kWhat, "w", w, wt, {G, K, N}), second_ok, scale_ok, second_scale_ok,
                                    expect(kWhat, "work", work, ffi::DataType::S32, {W, kWorkWords}), out_ok});
        e.failure()) {
      return e;
    }
    const int64_t tiles = N / tile;
    // Every unit (split, item, tile) of the static shape; the CTAs that fit at once loop over the non-empty ones.
    const int64_t units = S * W * tiles;
    if (units < 1 || units > (int64_t{1} << 31) - 1) {
      return ffi::Error::InvalidArgument("jax_latent_ep grouped_gemm: " + std::to_string(units) + " units");
    }
    l.grid = static_cast<unsigned>(std::min(units, l.kernel->max_grid));
    l.params = make_params(ep_abi::GroupedGemmParams{
        .a = address(a.untyped_data()),
        .a_rows = indexed ? address(a_rows.untyped_data()) : int64_t{0},
        .a_scale = fp8 ? address(a_scale.untyped_data()) : int64_t{0},
        .w = address(w.untyped_data()),
        .w_second = two_weights ? address(w_second.untyped_data()) : int64_t{0},
        .w_scale = fp8 ? address(w_scale.untyped_data()) : int64_t{0},
        .w_second_scale = fp8 && two_weights ? address(w_second_scale.untyped_data()) : int64_t{0},
        .work = address(work.untyped_data()),
        .out = address(out->untyped_data()),
        .num_k = static_cast<int32_t>(K),
        .num_n = static_cast<int32_t>(N),
        .num_rows = static_cast<int32_t>(P),
        .num_work = static_cast<int32_t>(W),
        .k_per_split = static_cast<int32_t>(k_per_split),
        .fuse_glu = fuse_glu ? 1 : 0,
    });
    return ffi::Error::Success();
  }
};
static_assert(visited_count<ep_abi::GroupedGemmParams>() == ep_abi::kGroupedGemmParamsCount,
              "ep_abi.h: visit_params(GroupedGemmParams) must pass every parameter once");
// The FP8 kernel takes the same parameters (kernels/abi.py GROUPED_GEMM_FP8): one struct fills both.
static_assert(ep_abi::kGroupedGemmFp8ParamsCount == ep_abi::kGroupedGemmParamsCount &&
                  sizeof(ep_abi::GroupedGemmFp8Params) == sizeof(ep_abi::GroupedGemmParams),
              "ep_abi.h: the FP8 grouped GEMM's parameters are the grouped GEMM's");

// ---------------------------------------------------------------------------------------------------------
// expert_stage(x, sf, a_rows, w_gate, w_up, w_down, work, counts) -> (counts, parts, h, y): the expert stage's
// SwiGLU MLP on the MXFP8 receive rows in one launch (kernels/grouped_gemm.py ExpertStage, BF16, work items of at
// most kStageDirectPairs pairs: the kernel traps on more); `counts` is zero on entry (the output aliases it).

struct ExpertStage {
  static constexpr const char* kWhat = "expert_stage";
  static constexpr int64_t kTile = ep_abi::kGemmBlockN, kWorkWords = ep_abi::kGemmWorkWords;

  template <typename Binding>
  static auto bind(Binding binding) {
    return std::move(binding)
        .template Ctx<ffi::DeviceOrdinal>()  // the device, key of the kernel registry
        .template Arg<ffi::AnyBuffer>()      // x: float8_e4m3fn [R, L] receive rows
        .template Arg<ffi::AnyBuffer>()      // sf: uint8 [R, L / 32] their E8M0 scales
        .template Arg<ffi::AnyBuffer>()      // a_rows: int32 [P] receive row of each pair
        .template Arg<ffi::AnyBuffer>()      // w_gate: bf16 [J, L, I]
        .template Arg<ffi::AnyBuffer>()      // w_up: bf16 [J, L, I]
        .template Arg<ffi::AnyBuffer>()      // w_down: bf16 [J, I, L]
        .template Arg<ffi::AnyBuffer>()      // work: int32 [W, 4] (group, first pair, pairs, items)
        .template Arg<ffi::AnyBuffer>()      // counts_in: int32 [1 + W (1 + I / 64)] zeros (`counts` aliases it)
        .template Ret<ffi::AnyBuffer>()      // counts: the same buffer, the kernel's counts
        .template Ret<ffi::AnyBuffer>()      // parts: f32 [S1, P, 2I] gate / up partials (S1 > 1), else f32 [1]
        .template Ret<ffi::AnyBuffer>()      // h: bf16 [P, I]
        .template Ret<ffi::AnyBuffer>()      // y: f32 [S2, P, L] down's partials
        .template Attr<int64_t>("k_gate")    // contraction length of each gate / up split
        .template Attr<int64_t>("k_down");   // contraction length of each down split
  }

  static ffi::Error prepare(Launch& l, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer sf, ffi::AnyBuffer a_rows,
                            ffi::AnyBuffer w_gate, ffi::AnyBuffer w_up, ffi::AnyBuffer w_down, ffi::AnyBuffer work,
                            ffi::AnyBuffer counts_in, ffi::Result<ffi::AnyBuffer> counts,
                            ffi::Result<ffi::AnyBuffer> parts, ffi::Result<ffi::AnyBuffer> h,
                            ffi::Result<ffi::AnyBuffer> y, int64_t k_gate, int64_t k_down) {
    if (ffi::Error e = find_expert_kernel(kWhat, ordinal, l); e.failure()) return e;
    auto xd = x.dimensions(), rd = a_rows.dimensions(), wd = w_gate.dimensions(), kd = work.dimensions();
    auto yd = y->dimensions();
    if (xd.size() != 2 || rd.size() != 1 || wd.size() != 3 || kd.size() != 2 || yd.size() != 3) {
      return ffi::Error::InvalidArgument("jax_latent_ep expert_stage: expected x [R, L], a_rows [P], w_gate "
                                         "[J, L, I], work [W, 4], y [S2, P, L]");
    }
    const int64_t R = xd[0], L = xd[1], P = rd[0], J = wd[0], I = wd[2], W = kd[0], S2 = yd[0];
    const int64_t S1 = k_gate > 0 ? (L + k_gate - 1) / k_gate : 0;
    if (L % (2 * kTile) || I % kTile || k_gate <= 0 || k_gate % kTile || k_down <= 0 || k_down % kTile ||
        (S1 - 1) * k_gate >= L || S2 * k_down < I || (S2 - 1) * k_down >= I || W < 1) {
      return ffi::Error::InvalidArgument(
          "jax_latent_ep expert_stage: L=" + std::to_string(L) + " must be a multiple of " + std::to_string(2 * kTile) +
          ", I=" + std::to_string(I) + " of " + std::to_string(kTile) + ", and the splits of k_gate=" +
          std::to_string(k_gate) + " and of k_down=" + std::to_string(k_down) + " (S2=" + std::to_string(S2) +
          ", multiples of " + std::to_string(kTile) + ") must cover L and I with none empty");
    }
    if (k_gate > ep_abi::kStageDirectK) {
      return ffi::Error::InvalidArgument("jax_latent_ep expert_stage: k_gate=" + std::to_string(k_gate) +
                                         " must be at most " + std::to_string(ep_abi::kStageDirectK) +
                                         " (a gate / up unit's rows are dequantized into shared memory)");
    }
    const int64_t num_counts = 1 + W * (1 + I / kTile);
    ffi::Error parts_ok = S1 > 1 ? expect(kWhat, "parts", *parts, ffi::DataType::F32, {S1, P, 2 * I})
                                 : expect(kWhat, "parts", *parts, ffi::DataType::F32, {1});
    if (ffi::Error e = first_error({expect(kWhat, "x", x, ffi::DataType::F8E4M3FN, {R, L}),
                                    expect(kWhat, "sf", sf, ffi::DataType::U8, {R, L / ep_abi::kMxBlock}),
                                    expect(kWhat, "a_rows", a_rows, ffi::DataType::S32, {P}),
                                    expect(kWhat, "w_gate", w_gate, ffi::DataType::BF16, {J, L, I}),
                                    expect(kWhat, "w_up", w_up, ffi::DataType::BF16, {J, L, I}),
                                    expect(kWhat, "w_down", w_down, ffi::DataType::BF16, {J, I, L}),
                                    expect(kWhat, "work", work, ffi::DataType::S32, {W, kWorkWords}),
                                    expect(kWhat, "counts_in", counts_in, ffi::DataType::S32, {num_counts}),
                                    expect(kWhat, "counts", *counts, ffi::DataType::S32, {num_counts}),
                                    parts_ok,
                                    expect(kWhat, "h", *h, ffi::DataType::BF16, {P, I}),
                                    expect(kWhat, "y", *y, ffi::DataType::F32, {S2, P, L})});
        e.failure()) {
      return e;
    }
    if (counts->untyped_data() != counts_in.untyped_data()) {
      return ffi::Error::InvalidArgument("jax_latent_ep expert_stage: the counts output must alias counts_in");
    }
    // Every unit of the static shape; the CTAs that fit at once loop over the non-empty ones.
    const int64_t units = W * (S1 * (I / kTile) + S2 * (L / kTile));
    if (units < 1 || units > (int64_t{1} << 31) - 1 || P > (int64_t{1} << 28) || R > (int64_t{1} << 28)) {
      return ffi::Error::InvalidArgument("jax_latent_ep expert_stage: " + std::to_string(units) + " units");
    }
    l.grid = static_cast<unsigned>(std::min(units, l.kernel->max_grid));
    l.params = make_params(ep_abi::ExpertStageParams{
        .x = address(x.untyped_data()),
        .sf = address(sf.untyped_data()),
        .a_rows = address(a_rows.untyped_data()),
        .w_gate = address(w_gate.untyped_data()),
        .w_up = address(w_up.untyped_data()),
        .w_down = address(w_down.untyped_data()),
        .work = address(work.untyped_data()),
        .counts = address(counts->untyped_data()),
        .parts = S1 > 1 ? address(parts->untyped_data()) : int64_t{0},
        .h = address(h->untyped_data()),
        .y = address(y->untyped_data()),
        .num_l = static_cast<int32_t>(L),
        .num_i = static_cast<int32_t>(I),
        .num_rows = static_cast<int32_t>(P),
        .num_work = static_cast<int32_t>(W),
        .k_gate = static_cast<int32_t>(k_gate),
        .k_down = static_cast<int32_t>(k_down),
    });
    return ffi::Error::Success();
  }
};
static_assert(visited_count<ep_abi::ExpertStageParams>() == ep_abi::kExpertStageParamsCount,
              "ep_abi.h: visit_params(ExpertStageParams) must pass every parameter once");
static_assert(ep_abi::kExpertStageParamsCount <= KernelParams::kCapacity, "KernelParams holds too few parameters");

// ---------------------------------------------------------------------------------------------------------
// expert_plan(ids, weights, src, rank) -> (pair_row, pair_expert, pair_weight, group_sizes, count, row_pairs, work,
// scratch): the expert stage's plan (kernels/expert_plan.py), one CTA; no rank registration.

struct ExpertPlan {
  static constexpr const char* kWhat = "expert_plan";

  template <typename Binding>
  static auto bind(Binding binding) {
    return std::move(binding)
        .template Ctx<ffi::DeviceOrdinal>()         // the device, key of the kernel registry
        .template Arg<ffi::AnyBuffer>()             // ids: int32 [R, K]
        .template Arg<ffi::AnyBuffer>()             // weights: f32 [R, K]
        .template Arg<ffi::AnyBuffer>()             // src: int32 [R], -1 in empty rows
        .template Arg<ffi::AnyBuffer>()             // rank: int32 [1]
        .template Ret<ffi::AnyBuffer>()             // pair_row: int32 [C]
        .template Ret<ffi::AnyBuffer>()             // pair_expert: int32 [C]
        .template Ret<ffi::AnyBuffer>()             // pair_weight: f32 [C]
        .template Ret<ffi::AnyBuffer>()             // group_sizes: int32 [J]
        .template Ret<ffi::AnyBuffer>()             // count: int32 [1]
        .template Ret<ffi::AnyBuffer>()             // row_pairs: int32 [R, M], M = min(K, J)
        .template Ret<ffi::AnyBuffer>()             // work: int32 [W, 4]
        .template Ret<ffi::AnyBuffer>()             // scratch: int32 [3, R*K]
        .template Attr<int64_t>("rows_per_source")  // S: rows of one source block
        .template Attr<int64_t>("max_tokens");      // rows t >= max_tokens of a block are not planned
  }

  static ffi::Error prepare(Launch& l, int32_t ordinal, ffi::AnyBuffer ids, ffi::AnyBuffer weights, ffi::AnyBuffer src,
                            ffi::AnyBuffer rank, ffi::Result<ffi::AnyBuffer> pair_row,
                            ffi::Result<ffi::AnyBuffer> pair_expert, ffi::Result<ffi::AnyBuffer> pair_weight,
                            ffi::Result<ffi::AnyBuffer> group_sizes, ffi::Result<ffi::AnyBuffer> count,
                            ffi::Result<ffi::AnyBuffer> row_pairs, ffi::Result<ffi::AnyBuffer> work,
                            ffi::Result<ffi::AnyBuffer> scratch, int64_t rows_per_source, int64_t max_tokens) {
    if (ffi::Error e = find_expert_kernel(kWhat, ordinal, l); e.failure()) return e;
    auto id = ids.dimensions(), pd = pair_row->dimensions(), gd = group_sizes->dimensions();
    auto rd = row_pairs->dimensions(), wd = work->dimensions();
    if (id.size() != 2 || pd.size() != 1 || gd.size() != 1 || rd.size() != 2 || wd.size() != 2) {
      return ffi::Error::InvalidArgument("jax_latent_ep expert_plan: expected ids [R, K], pair_row [C], "
                                         "group_sizes [J], row_pairs [R, M], work [W, 4]");
    }
    const int64_t R = id[0], K = id[1], C = pd[0], J = gd[0], W = wd[0], M = K < J ? K : J;
    if (K < 1 || K > ep_abi::kMaxTopk || J < 1 || J > ep_abi::kPlanMaxExperts || C < 1 || W < 1 ||
        J * ((R + 31) / 32) > ep_abi::kPlanBitmapWords ||
        rows_per_source < 1 || R % rows_per_source || max_tokens < 1 || max_tokens > rows_per_source ||
        R > (int64_t{1} << 30) || C > (int64_t{1} << 28) || W > (int64_t{1} << 28)) {
      return ffi::Error::InvalidArgument(
          "jax_latent_ep expert_plan: K=" + std::to_string(K) + " must be in [1, " + std::to_string(ep_abi::kMaxTopk) +
          "], J=" + std::to_string(J) + " in [1, " + std::to_string(ep_abi::kPlanMaxExperts) + "] with J * ceil(R / 32) "
          "<= " + std::to_string(ep_abi::kPlanBitmapWords) + ", R=" +
          std::to_string(R) + " whole source blocks of S=" + std::to_string(rows_per_source) + " rows, max_tokens=" +
          std::to_string(max_tokens) + " in [1, S], C=" + std::to_string(C) + " and W=" + std::to_string(W) + " >= 1");
    }
    if (ffi::Error e = first_error({expect(kWhat, "ids", ids, ffi::DataType::S32, {R, K}),
                                    expect(kWhat, "weights", weights, ffi::DataType::F32, {R, K}),
                                    expect(kWhat, "src", src, ffi::DataType::S32, {R}),
                                    expect(kWhat, "rank", rank, ffi::DataType::S32, {1}),
                                    expect(kWhat, "pair_row", *pair_row, ffi::DataType::S32, {C}),
                                    expect(kWhat, "pair_expert", *pair_expert, ffi::DataType::S32, {C}),
                                    expect(kWhat, "pair_weight", *pair_weight, ffi::DataType::F32, {C}),
                                    expect(kWhat, "group_sizes", *group_sizes, ffi::DataType::S32, {J}),
                                    expect(kWhat, "count", *count, ffi::DataType::S32, {1}),
                                    expect(kWhat, "row_pairs", *row_pairs, ffi::DataType::S32, {R, M}),
                                    expect(kWhat, "work", *work, ffi::DataType::S32, {W, ep_abi::kGemmWorkWords}),
                                    expect(kWhat, "scratch", *scratch, ffi::DataType::S32, {3, R * K})});
        e.failure()) {
      return e;
    }
    l.grid = 1;
    l.params = make_params(ep_abi::ExpertPlanParams{
        .ids = address(ids.untyped_data()),
        .weights = address(weights.untyped_data()),
        .src = address(src.untyped_data()),
        .rank = address(rank.untyped_data()),
        .pair_row = address(pair_row->untyped_data()),
        .pair_expert = address(pair_expert->untyped_data()),
        .pair_weight = address(pair_weight->untyped_data()),
        .group_sizes = address(group_sizes->untyped_data()),
        .count = address(count->untyped_data()),
        .row_pairs = address(row_pairs->untyped_data()),
        .work = address(work->untyped_data()),
        .scratch = address(scratch->untyped_data()),
        .num_rows = static_cast<int32_t>(R),
        .topk = static_cast<int32_t>(K),
        .num_local_experts = static_cast<int32_t>(J),
        .rows_per_source = static_cast<int32_t>(rows_per_source),
        .max_tokens = static_cast<int32_t>(max_tokens),
        .capacity = static_cast<int32_t>(C),
        .num_work = static_cast<int32_t>(W),
    });
    return ffi::Error::Success();
  }
};
static_assert(visited_count<ep_abi::ExpertPlanParams>() == ep_abi::kExpertPlanParamsCount,
              "ep_abi.h: visit_params(ExpertPlanParams) must pass every parameter once");
static_assert(ep_abi::kExpertPlanParamsCount <= KernelParams::kCapacity, "KernelParams holds too few parameters");

// ---------------------------------------------------------------------------------------------------------
// row_sum(parts, row_pairs, pair_weight, count) -> out: each receive row's weighted sum over its pairs, rounded to
// bf16 (kernels/row_sum.py); a CTA a row and 512 columns.

struct RowSum {
  static constexpr const char* kWhat = "row_sum";

  template <typename Binding>
  static auto bind(Binding binding) {
    return std::move(binding)
        .template Ctx<ffi::DeviceOrdinal>()  // the device, key of the kernel registry
        .template Arg<ffi::AnyBuffer>()      // parts: f32 [S, P, L] down's partials of each pair
        .template Arg<ffi::AnyBuffer>()      // row_pairs: int32 [R, M] the pair of each row's m-th local expert
        .template Arg<ffi::AnyBuffer>()      // pair_weight: f32 [P] routing weight of each pair
        .template Arg<ffi::AnyBuffer>()      // count: int32 [1] pairs used
        .template Ret<ffi::AnyBuffer>();     // out: bf16 [R, L]
  }

  static ffi::Error prepare(Launch& l, int32_t ordinal, ffi::AnyBuffer parts, ffi::AnyBuffer row_pairs,
                            ffi::AnyBuffer pair_weight, ffi::AnyBuffer count, ffi::Result<ffi::AnyBuffer> out) {
    if (ffi::Error e = find_expert_kernel(kWhat, ordinal, l); e.failure()) return e;
    auto pd = parts.dimensions(), rd = row_pairs.dimensions();
    if (pd.size() != 3 || rd.size() != 2) {
      return ffi::Error::InvalidArgument("jax_latent_ep row_sum: expected parts [S, P, L], row_pairs [R, M]");
    }
    const int64_t S = pd[0], P = pd[1], L = pd[2], R = rd[0], M = rd[1];
    const int64_t chunks = (L + ep_abi::kRowSumColumns - 1) / ep_abi::kRowSumColumns;
    if (S < 1 || P < 1 || L < 4 || L % 4 || R < 1 || M < 1 || M > ep_abi::kMaxTopk ||
        R * chunks > (int64_t{1} << 31) - 1 || S * P * L > (int64_t{1} << 40)) {
      return ffi::Error::InvalidArgument(
          "jax_latent_ep row_sum: S=" + std::to_string(S) + " and P=" + std::to_string(P) + " must be >= 1, L=" +
          std::to_string(L) + " a multiple of 4, M=" + std::to_string(M) + " in [1, " +
          std::to_string(ep_abi::kMaxTopk) + "], R=" + std::to_string(R) + " >= 1");
    }
    if (ffi::Error e = first_error({expect(kWhat, "parts", parts, ffi::DataType::F32, {S, P, L}),
                                    expect(kWhat, "row_pairs", row_pairs, ffi::DataType::S32, {R, M}),
                                    expect(kWhat, "pair_weight", pair_weight, ffi::DataType::F32, {P}),
                                    expect(kWhat, "count", count, ffi::DataType::S32, {1}),
                                    expect(kWhat, "out", *out, ffi::DataType::BF16, {R, L})});
        e.failure()) {
      return e;
    }
    l.grid = static_cast<unsigned>(R * chunks);
    l.params = make_params(ep_abi::RowSumParams{
        .parts = address(parts.untyped_data()),
        .row_pairs = address(row_pairs.untyped_data()),
        .pair_weight = address(pair_weight.untyped_data()),
        .count = address(count.untyped_data()),
        .out = address(out->untyped_data()),
        .num_splits = static_cast<int32_t>(S),
        .num_pairs = static_cast<int32_t>(P),
        .num_rows = static_cast<int32_t>(R),
        .num_slots = static_cast<int32_t>(M),
        .num_l = static_cast<int32_t>(L),
    });
    return ffi::Error::Success();
  }
};
static_assert(visited_count<ep_abi::RowSumParams>() == ep_abi::kRowSumParamsCount,
              "ep_abi.h: visit_params(RowSumParams) must pass every parameter once");
static_assert(ep_abi::kRowSumParamsCount <= KernelParams::kCapacity, "KernelParams holds too few parameters");

// ---------------------------------------------------------------------------------------------------------
// The three stages of an op, over the arguments its `prepare` takes after the Launch (the ones `bind` binds).

template <typename Op, typename Prepare = decltype(&Op::prepare)>
struct Stages;

template <typename Op, typename... Bound>
struct Stages<Op, ffi::Error (*)(Launch&, Bound...)> {
  // Execute stage of the record target (and, with uses_pdl, of the traced one): launches on XLA's stream.
  static ffi::Error Execute(cudaStream_t stream, Bound... bound, bool uses_pdl) {
    Launch l;
    if (ffi::Error e = Op::prepare(l, bound...); e.failure()) return e;
    return launch(Op::kWhat, l, stream, uses_pdl);
  }

  // The traced target: always allows programmatic dependent launch.
  static ffi::Error Traced(cudaStream_t stream, Bound... bound) {
    return Execute(stream, bound..., /*uses_pdl=*/true);
  }

#if JAX_LATENT_EP_RECORD
  // Record stage of the record target: adds (or updates) the kernel node of XLA's command buffer.
  static ffi::Error Record(RecordContext ctx, Bound... bound, bool uses_pdl) {
    Launch l;
    if (ffi::Error e = Op::prepare(l, bound...); e.failure()) return e;
    return record(Op::kWhat, ctx, l, uses_pdl);
  }
#endif
};

// Traced target (jax_latent_ep_dispatch / _combine, registered by Python with jax.ffi.register_ffi_target).
template <typename Op>
XLA_FFI_Error* traced_handler(XLA_FFI_CallFrame* call_frame) {
  static auto* handler = Op::bind(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())  // XLA's stream
                             .To(Stages<Op>::Traced, {ffi::Traits::kCmdBufferCompatible})
                             .release();
  return handler->Call(call_frame);
}

#if JAX_LATENT_EP_RECORD
// Record target (registered by ep_register_record_targets), execute stage: outside command buffers.
template <typename Op>
XLA_FFI_Error* execute_handler(XLA_FFI_CallFrame* call_frame) {
  static auto* handler = Op::bind(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())  // XLA's stream
                             .template Attr<bool>("uses_pdl")  // programmatic dependent launch allowed
                             .To(Stages<Op>::Execute, {ffi::Traits::kCmdBufferCompatible})
                             .release();
  return handler->Call(call_frame);
}

// Record target, record stage: inside command buffers.
template <typename Op>
XLA_FFI_Error* record_handler(XLA_FFI_CallFrame* call_frame) {
  static auto* handler = Op::bind(ffi::Ffi::BindRecord().Ctx<ffi::Extension<RecordExtension>>())  // the record
                             .template Attr<bool>("uses_pdl")  // programmatic dependent launch allowed (node edges)
                             .To(Stages<Op>::Record)
                             .release();
  return handler->Call(call_frame);
}
#endif

template <typename Op>
Targets targets() {
#if JAX_LATENT_EP_RECORD
  return {traced_handler<Op>, execute_handler<Op>, record_handler<Op>};
#else
  return {traced_handler<Op>, nullptr, nullptr};
#endif
}

}  // namespace

Targets dispatch_targets() { return targets<Dispatch>(); }
Targets combine_targets() { return targets<Combine>(); }
Targets grouped_gemm_targets() { return targets<GroupedGemm>(); }
Targets expert_plan_targets() { return targets<ExpertPlan>(); }
Targets expert_stage_targets() { return targets<ExpertStage>(); }
Targets row_sum_targets() { return targets<RowSum>(); }

}  // namespace jax_latent_ep
