// The handlers of the expert stage's targets, in pipeline order: the plan (pairs and work items), the grouped GEMM
// and the fused SwiGLU stage over its work items, and the row sum of each row's pairs. Ops are traits structs as in
// handlers.cc (stages.h); their kernels are found by op and device in the kernel registry, not by rank.
#include "expert_handlers.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>

#include "checks.h"
#include "ep_abi.h"
#include "launch.h"
#include "registry.h"
#include "stages.h"
#include "xla/ffi/api/ffi.h"

namespace jax_latent_ep {
namespace {

// The shape-free expert kernel named `what` loaded on `ordinal` (ffi.load_expert_kernels), held by the Launch.
ffi::Error find_expert_kernel(const char* what, int32_t ordinal, Launch& l) {
  l.kernel = find_kernel(what, ordinal);
  if (l.kernel != nullptr) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string("jax_latent_ep ") + what + ": its kernel is not loaded on device "
                                     "ordinal " + std::to_string(ordinal) +
                                     " (jax_latent_ep.runtime.ffi.load_expert_kernels)");
}

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
        .template Attr<int64_t>("max_tokens")       // rows t >= max_tokens of a block are not planned
        .template Attr<int64_t>("work_pairs");      // pairs of one work item at most, a power of two
  }

  static ffi::Error prepare(Launch& l, int32_t ordinal, ffi::AnyBuffer ids, ffi::AnyBuffer weights, ffi::AnyBuffer src,
                            ffi::AnyBuffer rank, ffi::Result<ffi::AnyBuffer> pair_row,
                            ffi::Result<ffi::AnyBuffer> pair_expert, ffi::Result<ffi::AnyBuffer> pair_weight,
                            ffi::Result<ffi::AnyBuffer> group_sizes, ffi::Result<ffi::AnyBuffer> count,
                            ffi::Result<ffi::AnyBuffer> row_pairs, ffi::Result<ffi::AnyBuffer> work,
                            ffi::Result<ffi::AnyBuffer> scratch, int64_t rows_per_source, int64_t max_tokens,
                            int64_t work_pairs) {
    if (ffi::Error e = find_expert_kernel(kWhat, ordinal, l); e.failure()) return e;
    if (work_pairs < ep_abi::kPlanMinWorkPairs || work_pairs > ep_abi::kPlanMaxWorkPairs ||
        (work_pairs & (work_pairs - 1))) {
      return ffi::Error::InvalidArgument("jax_latent_ep expert_plan: work_pairs=" + std::to_string(work_pairs) +
                                         " must be a power of two in [" + std::to_string(ep_abi::kPlanMinWorkPairs) +
                                         ", " + std::to_string(ep_abi::kPlanMaxWorkPairs) + "]");
    }
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
    // every pair's items fit the list: a group of s pairs takes ceil(s / work_pairs) <= 1 + (s - 1) / work_pairs
    if (const int64_t items = (J < C ? J : C) + C / work_pairs; W < items) {
      return ffi::Error::InvalidArgument("jax_latent_ep expert_plan: W=" + std::to_string(W) + " work items, fewer " +
                                         "than min(J, C) + C / work_pairs = " + std::to_string(items));
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
        .work_shift = static_cast<int32_t>(__builtin_ctzll(static_cast<uint64_t>(work_pairs))),
    });
    return ffi::Error::Success();
  }
};
static_assert(visited_count<ep_abi::ExpertPlanParams>() == ep_abi::kExpertPlanParamsCount,
              "ep_abi.h: visit_params(ExpertPlanParams) must pass every parameter once");
static_assert(ep_abi::kExpertPlanParamsCount <= KernelParams::kCapacity, "KernelParams holds too few parameters");

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
// grouped_matmul(x, x_rows, w, tiles, w_up) -> out, gate_up: the grouped matmul of training sizes
// (kernels/grouped_matmul.py, sm_90a), a CTA per (tile, kMatmulForwardTileN columns; with glu, per (tile,
// kMatmulForwardTileN / 2 columns of h): a SwiGLU's gate and up in one block); a CTA of an empty tile returns at once.

struct GroupedMatmul {
  static constexpr const char* kWhat = "grouped_matmul";

  template <typename Binding>
  static auto bind(Binding binding) {
    return std::move(binding)
        .template Ctx<ffi::DeviceOrdinal>()   // the device, key of the kernel registry
        .template Arg<ffi::AnyBuffer>()       // x: bf16 [R, K] the pairs' rows, sorted by group, or x_rows'
        .template Arg<ffi::AnyBuffer>()       // x_rows: int32 [P] the row of x of each pair (read when indexed)
        .template Arg<ffi::AnyBuffer>()       // w: bf16 [G, K, N], or [G, N, K] with w_k_major
        .template Arg<ffi::AnyBuffer>()       // tiles: int32 [T, 4] (group, first pair, pairs <= 128, used tiles)
        .template Arg<ffi::AnyBuffer>()       // w_up: bf16 [G, K, N], the SwiGLU's up (read when glu)
        .template Ret<ffi::AnyBuffer>()       // out: bf16 [P, N] (glu: h); rows outside every tile untouched
        .template Ret<ffi::AnyBuffer>()       // gate_up: bf16 [P, 2N] (glu with residual), else [1, 1] unwritten
        .template Attr<int64_t>("w_k_major")  // 1: w is [G, N, K] (out = x @ w[g].T)
        .template Attr<int64_t>("indexed")    // 1: pair p reads row x_rows[p] of x, 0: row p
        .template Attr<int64_t>("glu")        // 1: out = bf16(silu(gate) * up), gate x @ w[g], up x @ w_up[g]
        .template Attr<int64_t>("residual");  // 1 (with glu): gate and up into gate_up as well
  }

  static ffi::Error prepare(Launch& l, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer x_rows, ffi::AnyBuffer w,
                            ffi::AnyBuffer tiles, ffi::AnyBuffer w_up, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::AnyBuffer> gate_up, int64_t w_k_major, int64_t indexed, int64_t glu,
                            int64_t residual) {
    if (ffi::Error e = find_expert_kernel(kWhat, ordinal, l); e.failure()) return e;
    auto xd = x.dimensions(), wd = w.dimensions(), td = tiles.dimensions(), od = out->dimensions();
    if (xd.size() != 2 || wd.size() != 3 || td.size() != 2 || od.size() != 2) {
      return ffi::Error::InvalidArgument("jax_latent_ep grouped_matmul: expected x [R, K], w [G, K, N] (or [G, N, K]), "
                                         "tiles [T, 4], out [P, N]");
    }
    const int64_t R = xd[0], K = xd[1], G = wd[0], N = w_k_major ? wd[1] : wd[2], T = td[0], P = od[0];
    if ((glu != 0 && glu != 1) || (residual != 0 && residual != 1) || (residual && !glu) ||
        (glu && w_k_major)) {
      return ffi::Error::InvalidArgument("jax_latent_ep grouped_matmul: glu=" + std::to_string(glu) + ", residual=" +
                                         std::to_string(residual) + ": a SwiGLU block needs [G, K, N] weights, "
                                         "and residual only with glu");
    }
    const int64_t span = glu ? ep_abi::kMatmulForwardTileN / 2 : ep_abi::kMatmulForwardTileN;  // out columns a CTA
    const int64_t column_tiles = (N + span - 1) / span;
    if (R < 1 || P < 1 || G < 1 || T < 1 || K < ep_abi::kMatmulTileK || K % ep_abi::kMatmulTileK ||
        N < ep_abi::kMatmulTileN || N % ep_abi::kMatmulTileN || R * K > (int64_t{1} << 40) ||
        P * N > (int64_t{1} << 40) || T * column_tiles > (int64_t{1} << 31) - 1 || (indexed != 0 && indexed != 1) ||
        (!indexed && R != P)) {
      return ffi::Error::InvalidArgument(
          "jax_latent_ep grouped_matmul: K=" + std::to_string(K) + " must be a positive multiple of " +
          std::to_string(ep_abi::kMatmulTileK) + ", N=" + std::to_string(N) + " of " +
          std::to_string(ep_abi::kMatmulTileN) + ", R=" + std::to_string(R) + " (P=" + std::to_string(P) +
          " unless indexed), G=" + std::to_string(G) + " and T=" + std::to_string(T) + " >= 1");
    }
    const std::initializer_list<int64_t> w_dims = {G, w_k_major ? N : K, w_k_major ? K : N};
    if (ffi::Error e = first_error({expect(kWhat, "x", x, ffi::DataType::BF16, {R, K}),
                                    indexed ? expect(kWhat, "x_rows", x_rows, ffi::DataType::S32, {P})
                                            : ffi::Error::Success(),
                                    expect(kWhat, "w", w, ffi::DataType::BF16, w_dims),
                                    expect(kWhat, "tiles", tiles, ffi::DataType::S32, {T, ep_abi::kMatmulTileWords}),
                                    glu ? expect(kWhat, "w_up", w_up, ffi::DataType::BF16, w_dims)
                                        : ffi::Error::Success(),
                                    expect(kWhat, "out", *out, ffi::DataType::BF16, {P, N}),
                                    residual ? expect(kWhat, "gate_up", *gate_up, ffi::DataType::BF16, {P, 2 * N})
                                             : expect(kWhat, "gate_up", *gate_up, ffi::DataType::BF16, {1, 1})});
        e.failure()) {
      return e;
    }
    l.grid = static_cast<unsigned>(T * column_tiles);
    l.params = make_params(ep_abi::GroupedMatmulParams{
        .x = address(x.untyped_data()),
        .x_rows = indexed ? address(x_rows.untyped_data()) : 0,
        .w = address(w.untyped_data()),
        .tiles = address(tiles.untyped_data()),
        .out = address(out->untyped_data()),
        .w_up = glu ? address(w_up.untyped_data()) : 0,
        .gate_up = residual ? address(gate_up->untyped_data()) : 0,
        .num_k = static_cast<int32_t>(K),
        .num_n = static_cast<int32_t>(N),
        .num_tiles = static_cast<int32_t>(T),
        .w_k_major = w_k_major ? 1 : 0,
    });
    return ffi::Error::Success();
  }
};
static_assert(visited_count<ep_abi::GroupedMatmulParams>() == ep_abi::kGroupedMatmulParamsCount,
              "ep_abi.h: visit_params(GroupedMatmulParams) must pass every parameter once");

// ---------------------------------------------------------------------------------------------------------
// grouped_matmul_wgrad(x, dy, groups) -> dw: the weights' gradient of the grouped matmul (kernels/grouped_matmul.py,
// sm_90a), a CTA per (group, 128 rows of dw, tiles_per_cta of its kMatmulWgradTileN-column blocks), about
// kMatmulWgradCtas CTAs.

struct GroupedMatmulWgrad {
  static constexpr const char* kWhat = "grouped_matmul_wgrad";

  template <typename Binding>
  static auto bind(Binding binding) {
    return std::move(binding)
        .template Ctx<ffi::DeviceOrdinal>()  // the device, key of the kernel registry
        .template Arg<ffi::AnyBuffer>()      // x: bf16 [P, K] the pairs' rows, sorted by group
        .template Arg<ffi::AnyBuffer>()      // dy: bf16 [P, N] the output's cotangent
        .template Arg<ffi::AnyBuffer>()      // groups: int32 [G, 2] (first pair, pairs)
        .template Ret<ffi::AnyBuffer>();     // dw: bf16 [G, K, N]
  }

  static ffi::Error prepare(Launch& l, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::AnyBuffer groups,
                            ffi::Result<ffi::AnyBuffer> dw) {
    if (ffi::Error e = find_expert_kernel(kWhat, ordinal, l); e.failure()) return e;
    auto xd = x.dimensions(), yd = dy.dimensions(), gd = groups.dimensions();
    if (xd.size() != 2 || yd.size() != 2 || gd.size() != 2) {
      return ffi::Error::InvalidArgument("jax_latent_ep grouped_matmul_wgrad: expected x [P, K], dy [P, N], "
                                         "groups [G, 2]");
    }
    const int64_t P = xd[0], K = xd[1], N = yd[1], G = gd[0];
    const int64_t column_tiles = (N + ep_abi::kMatmulWgradTileN - 1) / ep_abi::kMatmulWgradTileN;  // last: half
    const int64_t blocks = G * (K / ep_abi::kMatmulTileM) * column_tiles;
    if (P < 1 || G < 1 || K < ep_abi::kMatmulTileM || K % ep_abi::kMatmulTileM || N < ep_abi::kMatmulTileN ||
        N % ep_abi::kMatmulTileN || P * (K > N ? K : N) > (int64_t{1} << 40) || blocks > (int64_t{1} << 31) - 1) {
      return ffi::Error::InvalidArgument(
          "jax_latent_ep grouped_matmul_wgrad: K=" + std::to_string(K) + " must be a positive multiple of " +
          std::to_string(ep_abi::kMatmulTileM) + ", N=" + std::to_string(N) + " of " +
          std::to_string(ep_abi::kMatmulTileN) + ", P=" + std::to_string(P) + " and G=" + std::to_string(G) + " >= 1");
    }
    if (ffi::Error e = first_error({expect(kWhat, "x", x, ffi::DataType::BF16, {P, K}),
                                    expect(kWhat, "dy", dy, ffi::DataType::BF16, {P, N}),
                                    expect(kWhat, "groups", groups, ffi::DataType::S32, {G, 2}),
                                    expect(kWhat, "dw", *dw, ffi::DataType::BF16, {G, K, N})});
        e.failure()) {
      return e;
    }
    // Column blocks a CTA computes in turn: as many as keep about kMatmulWgradCtas CTAs, spread evenly.
    int64_t per = blocks / ep_abi::kMatmulWgradCtas;
    per = per < 1 ? 1 : (per > column_tiles ? column_tiles : per);
    per = (column_tiles + (column_tiles + per - 1) / per - 1) / ((column_tiles + per - 1) / per);
    const int64_t column_ctas = (column_tiles + per - 1) / per;  // the kernel's own split of a row of blocks
    l.grid = static_cast<unsigned>(blocks / column_tiles * column_ctas);
    l.params = make_params(ep_abi::GroupedMatmulWgradParams{
        .x = address(x.untyped_data()),
        .dy = address(dy.untyped_data()),
        .groups = address(groups.untyped_data()),
        .dw = address(dw->untyped_data()),
        .num_k = static_cast<int32_t>(K),
        .num_n = static_cast<int32_t>(N),
        .num_groups = static_cast<int32_t>(G),
        .tiles_per_cta = static_cast<int32_t>(per),
    });
    return ffi::Error::Success();
  }
};
static_assert(visited_count<ep_abi::GroupedMatmulWgradParams>() == ep_abi::kGroupedMatmulWgradParamsCount,
              "ep_abi.h: visit_params(GroupedMatmulWgradParams) must pass every parameter once");

// ---------------------------------------------------------------------------------------------------------
// grouped_matmul_fp8 / grouped_matmul_mxfp4 (_n16, _n8: tiles of 16, 8 pairs)(x, x_scale, x_rows, w, w_scale,
// w_second, w_second_scale, tiles) -> out: the grouped matmul of decode sizes on FP8 or MXFP4 weights
// (kernels/grouped_matmul_fp8.py, sm_90a), one or two weights (gate and up), a persistent grid over (split, tile,
// 128 output columns); grouped_matmul_fp8_wide: the same call of prefill sizes, tiles of 128 pairs
// (kernels/grouped_matmul_fp8_wide.py).

// The op name of the variant (its kernel's key in the registry).
constexpr const char* narrow_op(bool mxfp4, int tile_pairs) {
  if (mxfp4) {
    return tile_pairs == 8 ? "grouped_matmul_mxfp4_n8" : tile_pairs == 16 ? "grouped_matmul_mxfp4_n16"
                                                                          : "grouped_matmul_mxfp4";
  }
  if (tile_pairs == ep_abi::kMatmulFp8WideTilePairs) return "grouped_matmul_fp8_wide";
  return tile_pairs == 8 ? "grouped_matmul_fp8_n8" : tile_pairs == 16 ? "grouped_matmul_fp8_n16" : "grouped_matmul_fp8";
}

template <bool kMxfp4, int kTilePairs>
struct GroupedMatmulNarrow {
  static_assert(kTilePairs == 8 || kTilePairs == 16 || kTilePairs == ep_abi::kMatmulFp8TilePairs ||
                (kTilePairs == ep_abi::kMatmulFp8WideTilePairs && !kMxfp4));
  static constexpr const char* kWhat = narrow_op(kMxfp4, kTilePairs);
  using Params = std::conditional_t<kMxfp4, ep_abi::GroupedMatmulMxfp4Params, ep_abi::GroupedMatmulFp8Params>;

  template <typename Binding>
  static auto bind(Binding binding) {
    return std::move(binding)
        .template Ctx<ffi::DeviceOrdinal>()  // the device, key of the kernel registry
        .template Arg<ffi::AnyBuffer>()      // x: float8_e4m3fn [R, K] MXFP8 elements (a row a pair, or x_rows')
        .template Arg<ffi::AnyBuffer>()      // x_scale: uint8 [R, K / 32] their E8M0 scales
        .template Arg<ffi::AnyBuffer>()      // x_rows: int32 [P] the row of x of each pair (read when indexed)
        .template Arg<ffi::AnyBuffer>()      // w: [out, in]: float8_e4m3fn [G, N, K] (FP8), uint8 [G, N, K / 2] (MXFP4)
        .template Arg<ffi::AnyBuffer>()      // w_scale: f32 [G, N / 128, K / 128] (FP8), uint8 [G, N, K / 32] (MXFP4)
        .template Arg<ffi::AnyBuffer>()      // w_second: as w (read with two_weights)
        .template Arg<ffi::AnyBuffer>()      // w_second_scale: as w_scale (read with two_weights)
        .template Arg<ffi::AnyBuffer>()      // tiles: int32 [T, 4] (group, first pair, pairs <= kTilePairs, used)
        .template Ret<ffi::AnyBuffer>()      // out: f32 [S, P, N or 2N] split partials; rows outside every tile untouched
        .template Attr<int64_t>("k_per_split")   // contraction length of each of the S splits
        .template Attr<int64_t>("indexed")       // 1: pair p reads row x_rows[p] of x, 0: row p
        .template Attr<int64_t>("two_weights");  // 1: w's columns, then w_second's, in each out row
  }

  // The weight `name` (w or w_second) and its scales, as the format asks; errors name the op `what`.
  static ffi::Error expect_weight(const char* what, const char* name, const char* scale_name, ffi::AnyBuffer w,
                                  ffi::AnyBuffer scale, int64_t G, int64_t N, int64_t K) {
    const ffi::Error w_ok = kMxfp4 ? expect(what, name, w, ffi::DataType::U8, {G, N, K / 2})
                                   : expect(what, name, w, ffi::DataType::F8E4M3FN, {G, N, K});
    const ffi::Error s_ok = kMxfp4 ? expect(what, scale_name, scale, ffi::DataType::U8, {G, N, K / 32})
                                   : expect(what, scale_name, scale, ffi::DataType::F32, {G, N / 128, K / 128});
    return first_error({w_ok, s_ok});
  }

  static ffi::Error prepare(Launch& l, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer x_scale,
                            ffi::AnyBuffer x_rows, ffi::AnyBuffer w, ffi::AnyBuffer w_scale, ffi::AnyBuffer w_second,
                            ffi::AnyBuffer w_second_scale, ffi::AnyBuffer tiles, ffi::Result<ffi::AnyBuffer> out,
                            int64_t k_per_split, int64_t indexed, int64_t two_weights) {
    if (ffi::Error e = find_expert_kernel(kWhat, ordinal, l); e.failure()) return e;
    auto xd = x.dimensions(), wd = w.dimensions(), td = tiles.dimensions(), od = out->dimensions();
    if (xd.size() != 2 || wd.size() != 3 || td.size() != 2 || od.size() != 3) {
      return ffi::Error::InvalidArgument(std::string("jax_latent_ep ") + kWhat + ": expected x [R, K], w [G, N, " +
                                         (kMxfp4 ? "K / 2" : "K") + "], tiles [T, 4], out [S, P, N or 2N]");
    }
    const int64_t R = xd[0], K = xd[1], G = wd[0], N = wd[1], T = td[0], S = od[0], P = od[1];
    const int64_t weights = two_weights ? 2 : 1, column_tiles = weights * N / 128;
    if (R < 1 || P < 1 || G < 1 || T < 1 || K < 128 || K % 128 || N < 128 || N % 128 || R * K > (int64_t{1} << 40) ||
        G * N * K > (int64_t{1} << 40) || S * P * weights * N > (int64_t{1} << 40) || k_per_split < 128 ||
        k_per_split % 128 || S * k_per_split < K || (S - 1) * k_per_split >= K || (indexed != 0 && indexed != 1) ||
        (two_weights != 0 && two_weights != 1) || (!indexed && R != P) ||
        S * T * column_tiles > (int64_t{1} << 31) - 1) {
      return ffi::Error::InvalidArgument(std::string("jax_latent_ep ") + kWhat + ": K=" + std::to_string(K) +
                                         " and N=" + std::to_string(N) + " must be positive multiples of 128, R=" +
                                         std::to_string(R) + " (P=" + std::to_string(P) + " unless indexed), G=" +
                                         std::to_string(G) + " and T=" + std::to_string(T) + " >= 1, and S=" +
                                         std::to_string(S) + " splits of k_per_split=" + std::to_string(k_per_split) +
                                         " (a multiple of 128) must cover K with none empty");
    }
    if (ffi::Error e = first_error({expect(kWhat, "x", x, ffi::DataType::F8E4M3FN, {R, K}),
                                    expect(kWhat, "x_scale", x_scale, ffi::DataType::U8, {R, K / 32}),
                                    indexed ? expect(kWhat, "x_rows", x_rows, ffi::DataType::S32, {P})
                                            : ffi::Error::Success(),
                                    expect_weight(kWhat, "w", "w_scale", w, w_scale, G, N, K),
                                    two_weights ? expect_weight(kWhat, "w_second", "w_second_scale", w_second,
                                                                w_second_scale, G, N, K)
                                                : ffi::Error::Success(),
                                    expect(kWhat, "tiles", tiles, ffi::DataType::S32, {T, ep_abi::kMatmulTileWords}),
                                    expect(kWhat, "out", *out, ffi::DataType::F32, {S, P, weights * N})});
        e.failure()) {
      return e;
    }
    // persistent: the kernel strides over the used tiles' units (a worst-case list costs no CTA per empty tile)
    l.grid = static_cast<unsigned>(std::min(S * T * column_tiles, l.kernel->max_grid));
    l.params = make_params(Params{
        .x = address(x.untyped_data()),
        .x_scale = address(x_scale.untyped_data()),
        .x_rows = indexed ? address(x_rows.untyped_data()) : 0,
        .w = address(w.untyped_data()),
        .w_scale = address(w_scale.untyped_data()),
        .w_second = two_weights ? address(w_second.untyped_data()) : 0,
        .w_second_scale = two_weights ? address(w_second_scale.untyped_data()) : 0,
        .tiles = address(tiles.untyped_data()),
        .out = address(out->untyped_data()),
        .num_k = static_cast<int32_t>(K),
        .num_n = static_cast<int32_t>(N),
        .num_tiles = static_cast<int32_t>(T),
        .num_rows = static_cast<int32_t>(P),
        .k_per_split = static_cast<int32_t>(k_per_split),
    });
    return ffi::Error::Success();
  }
};
using GroupedMatmulFp8 = GroupedMatmulNarrow<false, ep_abi::kMatmulFp8TilePairs>;
using GroupedMatmulMxfp4 = GroupedMatmulNarrow<true, ep_abi::kMatmulFp8TilePairs>;
using GroupedMatmulFp8N16 = GroupedMatmulNarrow<false, 16>;
using GroupedMatmulMxfp4N16 = GroupedMatmulNarrow<true, 16>;
using GroupedMatmulFp8N8 = GroupedMatmulNarrow<false, 8>;
using GroupedMatmulMxfp4N8 = GroupedMatmulNarrow<true, 8>;
using GroupedMatmulFp8Wide = GroupedMatmulNarrow<false, ep_abi::kMatmulFp8WideTilePairs>;
static_assert(visited_count<ep_abi::GroupedMatmulFp8Params>() == ep_abi::kGroupedMatmulFp8ParamsCount,
              "ep_abi.h: visit_params(GroupedMatmulFp8Params) must pass every parameter once");
static_assert(visited_count<ep_abi::GroupedMatmulMxfp4Params>() == ep_abi::kGroupedMatmulMxfp4ParamsCount,
              "ep_abi.h: visit_params(GroupedMatmulMxfp4Params) must pass every parameter once");

// ---------------------------------------------------------------------------------------------------------
// grouped_matmul_fp8_wide_glu(x, x_scale, x_rows, w, w_scale, w_second, w_second_scale, tiles) -> (q, sf): the FP8
// grouped matmul of prefill sizes with the SwiGLU in its epilogue (kernels/grouped_matmul_fp8_wide.py, sm_90a): gate
// (w) and up (w_second), h = bf16(silu(gate) * up) out in MXFP8; a persistent grid over (tile, 64 columns of h).

struct GroupedMatmulFp8WideGlu {
  static constexpr const char* kWhat = "grouped_matmul_fp8_wide_glu";

  template <typename Binding>
  static auto bind(Binding binding) {
    return std::move(binding)
        .template Ctx<ffi::DeviceOrdinal>()  // the device, key of the kernel registry
        .template Arg<ffi::AnyBuffer>()      // x: float8_e4m3fn [R, K] MXFP8 elements (a row a pair, or x_rows')
        .template Arg<ffi::AnyBuffer>()      // x_scale: uint8 [R, K / 32] their E8M0 scales
        .template Arg<ffi::AnyBuffer>()      // x_rows: int32 [P] the row of x of each pair (read when indexed)
        .template Arg<ffi::AnyBuffer>()      // w: gate's float8_e4m3fn [G, I, K], [out, in]
        .template Arg<ffi::AnyBuffer>()      // w_scale: f32 [G, I / 128, K / 128] its block scales
        .template Arg<ffi::AnyBuffer>()      // w_second: up's, as w
        .template Arg<ffi::AnyBuffer>()      // w_second_scale: up's, as w_scale
        .template Arg<ffi::AnyBuffer>()      // tiles: int32 [T, 4] (group, first pair, pairs <= 128, used)
        .template Ret<ffi::AnyBuffer>()      // q: float8_e4m3fn [P, I] h's MXFP8 elements (rows of no tile untouched)
        .template Ret<ffi::AnyBuffer>()      // sf: uint8 [P, I / 32] their E8M0 scales; as q
        .template Attr<int64_t>("indexed");  // 1: pair p reads row x_rows[p] of x, 0: row p
  }

  static ffi::Error prepare(Launch& l, int32_t ordinal, ffi::AnyBuffer x, ffi::AnyBuffer x_scale,
                            ffi::AnyBuffer x_rows, ffi::AnyBuffer w, ffi::AnyBuffer w_scale, ffi::AnyBuffer w_second,
                            ffi::AnyBuffer w_second_scale, ffi::AnyBuffer tiles, ffi::Result<ffi::AnyBuffer> q,
                            ffi::Result<ffi::AnyBuffer> sf, int64_t indexed) {
    if (ffi::Error e = find_expert_kernel(kWhat, ordinal, l); e.failure()) return e;
    auto xd = x.dimensions(), wd = w.dimensions(), td = tiles.dimensions(), qd = q->dimensions();
    if (xd.size() != 2 || wd.size() != 3 || td.size() != 2 || qd.size() != 2) {
      return ffi::Error::InvalidArgument(std::string("jax_latent_ep ") + kWhat +
                                         ": expected x [R, K], w [G, I, K], tiles [T, 4], q [P, I]");
    }
    const int64_t R = xd[0], K = xd[1], G = wd[0], N = wd[1], T = td[0], P = qd[0];
    if (R < 1 || P < 1 || G < 1 || T < 1 || K < 128 || K % 128 || N < 128 || N % 128 || R * K > (int64_t{1} << 40) ||
        G * N * K > (int64_t{1} << 40) || P * N > (int64_t{1} << 40) || (indexed != 0 && indexed != 1) ||
        (!indexed && R != P) || T * (N / 64) > (int64_t{1} << 31) - 1) {
      return ffi::Error::InvalidArgument(std::string("jax_latent_ep ") + kWhat + ": K=" + std::to_string(K) +
                                         " and I=" + std::to_string(N) + " must be positive multiples of 128, R=" +
                                         std::to_string(R) + " (P=" + std::to_string(P) + " unless indexed), G=" +
                                         std::to_string(G) + " and T=" + std::to_string(T) + " >= 1");
    }
    if (ffi::Error e = first_error({expect(kWhat, "x", x, ffi::DataType::F8E4M3FN, {R, K}),
                                    expect(kWhat, "x_scale", x_scale, ffi::DataType::U8, {R, K / 32}),
                                    indexed ? expect(kWhat, "x_rows", x_rows, ffi::DataType::S32, {P})
                                            : ffi::Error::Success(),
                                    GroupedMatmulFp8::expect_weight(kWhat, "w", "w_scale", w, w_scale, G, N, K),
                                    GroupedMatmulFp8::expect_weight(kWhat, "w_second", "w_second_scale", w_second,
                                                                    w_second_scale, G, N, K),
                                    expect(kWhat, "tiles", tiles, ffi::DataType::S32, {T, ep_abi::kMatmulTileWords}),
                                    expect(kWhat, "q", *q, ffi::DataType::F8E4M3FN, {P, N}),
                                    expect(kWhat, "sf", *sf, ffi::DataType::U8, {P, N / 32})});
        e.failure()) {
      return e;
    }
    // persistent: the kernel strides over the used tiles' units (a worst-case list costs no CTA per empty tile)
    l.grid = static_cast<unsigned>(std::min(T * (N / 64), l.kernel->max_grid));
    l.params = make_params(ep_abi::GroupedMatmulFp8WideGluParams{
        .x = address(x.untyped_data()),
        .x_scale = address(x_scale.untyped_data()),
        .x_rows = indexed ? address(x_rows.untyped_data()) : 0,
        .w = address(w.untyped_data()),
        .w_scale = address(w_scale.untyped_data()),
        .w_second = address(w_second.untyped_data()),
        .w_second_scale = address(w_second_scale.untyped_data()),
        .tiles = address(tiles.untyped_data()),
        .q = address(q->untyped_data()),
        .sf = address(sf->untyped_data()),
        .num_k = static_cast<int32_t>(K),
        .num_n = static_cast<int32_t>(N),
        .num_tiles = static_cast<int32_t>(T),
        .num_rows = static_cast<int32_t>(P),
    });
    return ffi::Error::Success();
  }
};
static_assert(visited_count<ep_abi::GroupedMatmulFp8WideGluParams>() == ep_abi::kGroupedMatmulFp8WideGluParamsCount,
              "ep_abi.h: visit_params(GroupedMatmulFp8WideGluParams) must pass every parameter once");

// ---------------------------------------------------------------------------------------------------------
// swiglu_mxfp8(gate, up, count) -> (q, sf): the FP8 / MXFP4 stage's SwiGLU of the used pairs' gate and up split
// partials, rounded to MXFP8 (kernels/swiglu_mxfp8.py, sm_90a); a persistent grid over 8-column units.

struct SwigluMxfp8 {
  static constexpr const char* kWhat = "swiglu_mxfp8";

  template <typename Binding>
  static auto bind(Binding binding) {
    return std::move(binding)
        .template Ctx<ffi::DeviceOrdinal>()  // the device, key of the kernel registry
        .template Arg<ffi::AnyBuffer>()      // gate: f32 [S, P, I] gate's split partials, or [S, P, 2I] gate and up
        .template Arg<ffi::AnyBuffer>()      // up: f32 [S, P, I] up's split partials (unread when fused)
        .template Arg<ffi::AnyBuffer>()      // count: int32 [1] pairs used
        .template Ret<ffi::AnyBuffer>()      // q: float8_e4m3fn [P, I] h's MXFP8 elements; rows >= count untouched
        .template Ret<ffi::AnyBuffer>()      // sf: uint8 [P, I / 32] h's E8M0 scales
        .template Attr<int64_t>("fused");    // 1: gate holds gate (columns 0 .. I) and up (I .. 2I) of each row
  }

  static ffi::Error prepare(Launch& l, int32_t ordinal, ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::AnyBuffer count,
                            ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> sf, int64_t fused) {
    if (ffi::Error e = find_expert_kernel(kWhat, ordinal, l); e.failure()) return e;
    auto gd = gate.dimensions(), qd = q->dimensions();
    if (gd.size() != 3 || qd.size() != 2) {
      return ffi::Error::InvalidArgument("jax_latent_ep swiglu_mxfp8: expected gate [S, P, I or 2I], q [P, I]");
    }
    const int64_t S = gd[0], P = gd[1], I = qd[1], stride = fused ? 2 * I : I;
    if (S < 1 || P < 1 || I < 128 || I % 128 || (fused != 0 && fused != 1) || S * P * stride > (int64_t{1} << 40) ||
        P * (I / 8) > (int64_t{1} << 31) - 1) {
      return ffi::Error::InvalidArgument("jax_latent_ep swiglu_mxfp8: S=" + std::to_string(S) + " and P=" +
                                         std::to_string(P) + " must be >= 1 (P I / 8 < 2^31), I=" + std::to_string(I) +
                                         " a positive multiple of 128, fused=" + std::to_string(fused) + " 0 or 1");
    }
    if (ffi::Error e = first_error({expect(kWhat, "gate", gate, ffi::DataType::F32, {S, P, stride}),
                                    fused ? ffi::Error::Success()
                                          : expect(kWhat, "up", up, ffi::DataType::F32, {S, P, I}),
                                    expect(kWhat, "count", count, ffi::DataType::S32, {1}),
                                    expect(kWhat, "q", *q, ffi::DataType::F8E4M3FN, {P, I}),
                                    expect(kWhat, "sf", *sf, ffi::DataType::U8, {P, I / 32})});
        e.failure()) {
      return e;
    }
    const int64_t units = P * (I / 8), per_cta = 256;  // kernels/swiglu_mxfp8.py: THREADS, UNIT
    l.grid = static_cast<unsigned>(std::min((units + per_cta - 1) / per_cta, l.kernel->max_grid));
    const int64_t gate_base = address(gate.untyped_data());
    l.params = make_params(ep_abi::SwigluMxfp8Params{
        .gate = gate_base,
        .up = fused ? gate_base + 4 * I : address(up.untyped_data()),
        .count = address(count.untyped_data()),
        .q = address(q->untyped_data()),
        .sf = address(sf->untyped_data()),
        .num_splits = static_cast<int32_t>(S),
        .num_pairs = static_cast<int32_t>(P),
        .num_i = static_cast<int32_t>(I),
        .row_stride = static_cast<int32_t>(stride),
    });
    return ffi::Error::Success();
  }
};
static_assert(visited_count<ep_abi::SwigluMxfp8Params>() == ep_abi::kSwigluMxfp8ParamsCount,
              "ep_abi.h: visit_params(SwigluMxfp8Params) must pass every parameter once");

}  // namespace

Targets expert_plan_targets() { return targets<ExpertPlan>(); }
Targets grouped_gemm_targets() { return targets<GroupedGemm>(); }
Targets expert_stage_targets() { return targets<ExpertStage>(); }
Targets row_sum_targets() { return targets<RowSum>(); }
Targets grouped_matmul_targets() { return targets<GroupedMatmul>(); }
Targets grouped_matmul_wgrad_targets() { return targets<GroupedMatmulWgrad>(); }
Targets grouped_matmul_fp8_targets() { return targets<GroupedMatmulFp8>(); }
Targets grouped_matmul_mxfp4_targets() { return targets<GroupedMatmulMxfp4>(); }
Targets grouped_matmul_fp8_n16_targets() { return targets<GroupedMatmulFp8N16>(); }
Targets grouped_matmul_mxfp4_n16_targets() { return targets<GroupedMatmulMxfp4N16>(); }
Targets grouped_matmul_fp8_n8_targets() { return targets<GroupedMatmulFp8N8>(); }
Targets grouped_matmul_mxfp4_n8_targets() { return targets<GroupedMatmulMxfp4N8>(); }
Targets grouped_matmul_fp8_wide_targets() { return targets<GroupedMatmulFp8Wide>(); }
Targets grouped_matmul_fp8_wide_glu_targets() { return targets<GroupedMatmulFp8WideGlu>(); }
Targets swiglu_mxfp8_targets() { return targets<SwigluMxfp8>(); }

}  // namespace jax_latent_ep
