// The words for a kernel's status record (ep_abi.h's kErrorMessages), the same as
// jax_latent_ep.kernels.abi.describe_error's. Header only, no XLA: tests/runtime/test_ffi_abi.py compiles it alone.
#pragma once

#include <cstdint>
#include <string>

#include "ep_abi.h"

namespace jax_latent_ep {

// What a nonzero status record {code, rank, peer, layer} says, e.g. "dispatch on rank 0 timed out waiting for
// rank 1 at layer 3 (error code 1)": the code's message (kUnknownError's for a code the ABI lacks) with its
// fields filled in, the layer moved by the code's layer_offset (mod 2**32).
inline std::string describe_error(int32_t code, int32_t rank, int32_t peer, int32_t layer) {
  const ep_abi::ErrorMessage* m = &ep_abi::kUnknownError;
  for (const ep_abi::ErrorMessage& e : ep_abi::kErrorMessages) {
    if (e.code == code) m = &e;
  }
  // The values of the fields the message names, in the order its conversions take them (rank, peer, layer).
  const std::string values[] = {std::to_string(rank), std::to_string(peer),
                                std::to_string(static_cast<uint32_t>(layer) + m->layer_offset)};
  const bool present[] = {m->has_rank, m->has_peer, m->has_layer};
  int next = 0;
  std::string text;
  for (const char* c = m->format; *c != '\0'; ++c) {
    if (c[0] == '%' && (c[1] == 'd' || c[1] == 'u')) {
      while (next < 3 && !present[next]) ++next;
      text += next < 3 ? values[next++] : std::string("?");
      ++c;
    } else if (c[0] == '%' && c[1] == '%') {
      text += '%';
      ++c;
    } else {
      text += *c;
    }
  }
  return text + " (error code " + std::to_string(code) + ")";
}

// The same for a record read from the host-mapped status page (ep_abi::kStatusWords int32 words).
inline std::string describe_error(const volatile int32_t* record) {
  return describe_error(record[ep_abi::kStatusCode], record[ep_abi::kStatusRank], record[ep_abi::kStatusPeer],
                        record[ep_abi::kStatusLayer]);
}

}  // namespace jax_latent_ep
