// One kernel launch: its parameters (from the generated ep_abi.h structs), the launch on XLA's stream (execute
// stage) and the kernel node of an XLA command buffer (record stage).
#pragma once

#include <cassert>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "driver.h"
#include "ep_abi.h"
#include "registry.h"
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

namespace jax_latent_ep {

namespace ffi = xla::ffi;

// The parameters of one kernel launch, in ABI order, held by value: the one list feeds both cuLaunchKernelEx (a
// pointer to each value) and the record stage (device addresses and by-value scalars).
class KernelParams {
 public:
  static constexpr int kCapacity = 24;

  // Appends one parameter: a scalar (`i64`, `i32`, `f32`), or with `is_address` a 64-bit device address
  // (`.param .u64`: an XLA buffer, the peer table, the status record, or 0).
  template <typename T>
  void add(T v, bool is_address) {
    static_assert(std::is_arithmetic_v<T> && sizeof(T) <= 8, "kernel scalars are at most 8 bytes");
    assert(count_ < kCapacity && "more kernel parameters than KernelParams holds");  // make_params checks it
    Slot& s = slots_[count_++];
    std::memset(s.bytes, 0, sizeof(s.bytes));
    std::memcpy(s.bytes, &v, sizeof(T));
    s.size = sizeof(T);
    s.is_address = is_address && sizeof(T) == 8;
  }
  int size() const { return count_; }
  // One pointer per parameter, for cuLaunchKernelEx (valid while this object lives).
  void** pointers() {
    for (int i = 0; i < count_; ++i) pointers_[i] = slots_[i].bytes;
    return pointers_;
  }
#if JAX_LATENT_EP_RECORD
  // The same parameters for CreateLaunch / UpdateLaunch (XLA copies the values before these return).
  std::vector<ffi::KernelArg> record_args() const;
#endif

 private:
  struct Slot {
    alignas(8) unsigned char bytes[8];
    size_t size;
    bool is_address;
  };
  Slot slots_[kCapacity];
  void* pointers_[kCapacity];
  int count_ = 0;
};

// How many parameters `ep_abi::visit_params` passes for a `Params` (a constant expression).
template <typename Params>
constexpr int visited_count() {
  int n = 0;
  ep_abi::visit_params(Params{}, [&](auto, bool) { ++n; });
  return n;
}

// The launch parameters of one kernel, in ABI order, from its generated parameter struct.
template <typename Params>
KernelParams make_params(const Params& p) {
  static_assert(visited_count<Params>() <= KernelParams::kCapacity, "more kernel parameters than KernelParams holds");
  KernelParams k;
  ep_abi::visit_params(p, [&](auto value, bool is_address) { k.add(value, is_address); });
  return k;
}

// A device address as the parameter structs hold it (i64).
inline int64_t address(const void* p) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(p)); }
inline int64_t address(uint64_t p) { return static_cast<int64_t>(p); }

// One launch as a handler computed it: the kernel, its grid and its parameters.
struct Launch {
  std::shared_ptr<const Rank> rank;  // keeps `kernel` (one of its members) alive until the launch is issued
  const Kernel* kernel = nullptr;
  unsigned grid = 0;
  KernelParams params;
};

// Launches on XLA's stream (execute stage). `pdl`: allow programmatic dependent launch (the kernels wait
// with griddepcontrol.wait before reading anything a predecessor wrote).
ffi::Error launch(const char* what, Launch& l, cudaStream_t stream, bool pdl);

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

// Adds the launch to XLA's command buffer as one kernel node (Create), or updates that node's parameters
// (Update: XLA calls again when a buffer address of the call changed). Launch dimensions, kernel and shared
// memory come from attributes and the registry, so they do not change between Create and Update.
ffi::Error record(const char* what, RecordContext& ctx, const Launch& l, bool uses_pdl);
#endif

// How often the record stage added (creates) or updated (updates) a kernel node; both 0 on the traced path.
std::pair<int64_t, int64_t> record_counts();

}  // namespace jax_latent_ep
