// The XLA FFI handlers of the dispatch and combine targets (handlers.cc): what c_api.cc exports and registers.
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jax_latent_ep {

// The handlers of one op's targets (the expert stage's too: expert_handlers.h).
struct Targets {
  XLA_FFI_Handler* traced;   // EpDispatch / EpCombine: execute stage, always programmatic dependent launch
  XLA_FFI_Handler* execute;  // record target, execute stage (`uses_pdl` attribute); null without the record stage
  XLA_FFI_Handler* record;   // record target, record stage (`uses_pdl` attribute); null without the record stage
};

Targets dispatch_targets();
Targets combine_targets();

}  // namespace jax_latent_ep
