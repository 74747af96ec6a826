// The rank registry: what ep_register_rank recorded for each (backend instance, CUDA device), with the kernels it
// loaded there, and the thread's last error for the C entry points.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "driver.h"

namespace jax_latent_ep {

// One kernel of a registered rank: the function handle in the device's primary context and its launch shape.
struct Kernel {
  CUfunction fn = nullptr;
  std::string name;                    // the cubin symbol (the manifest's `name`)
  const std::string* image = nullptr;  // the cubin, kept at this address for the process
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
  int stride = 0;  // ep_abi::stride(max_tokens)
  int latent = 0;
  int topk = 0;
  uint64_t peers = 0;                             // device int64 [N + 1]
  uint64_t status = 0;                            // device address of the host-mapped status record, or 0
  volatile const int32_t* status_host = nullptr;  // host address of the same record (ep_abi::kStatusWords), or null
  int64_t timeout_ns = 0;
  Kernel dispatch, combine;
};

// A cubin as ep_register_rank receives it: the image, its kernel's symbol and launch shape.
struct KernelImage {
  const void* data;
  size_t size;
  const char* name;
  int block;  // threads per CTA
  int smem;   // dynamic shared memory bytes
};

// Sets this thread's last error to `message`; returns 1 (the C entry points' failure).
int fail(std::string message);
// The message of the last failed call on this thread ("" if none).
const char* last_error();

// Checks `rank` against the ABI's limits, loads both kernels on its device (once per device and image) and
// registers it, replacing an earlier registration of its (instance, ordinal). Returns 0, or 1 with last_error().
int register_rank(Rank rank, const KernelImage& dispatch, const KernelImage& combine);
// Forgets (instance, ordinal); returns 0 if it was registered, 1 with last_error() otherwise.
int unregister_rank(int64_t instance, int ordinal);
// The registration of (instance, ordinal), or null.
std::shared_ptr<const Rank> registered_rank(int64_t instance, int ordinal);
// Number of registered (instance, device) pairs.
int registered_count();

// Finds the registration of `instance` on the device the handler runs on: XLA's device ordinal first, then
// the device of the current context (the two agree unless a process was given a subset of its visible GPUs).
// The returned pointer keeps the registration alive even if it is unregistered meanwhile.
std::shared_ptr<const Rank> find_rank(int64_t instance, int32_t ordinal);

// Loads the kernel of op `op` (kernels/abi.py's name) that needs no rank (the grouped GEMM) on device `ordinal`,
// once per (op, ordinal): kept for the life of the process. Returns 0, or 1 with last_error().
int register_kernel(const std::string& op, int ordinal, const KernelImage& image);
// The kernel of `op` registered on the handler's device (XLA's ordinal, else the current context's), or null.
const Kernel* find_kernel(const std::string& op, int32_t ordinal);

}  // namespace jax_latent_ep
