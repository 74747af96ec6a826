// Operand checks shared by the handlers (handlers.cc, expert_handlers.cc): element type and shape of one operand,
// and the first failure of several such checks, as the ffi::Error a handler returns.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "xla/ffi/api/ffi.h"

namespace jax_latent_ep {

namespace ffi = xla::ffi;

// Checks one operand of op `what`: element type and shape. The error names both, e.g.
// "jax_latent_ep combine: ids is float32[4, 2], expected int32[4, 2]".
ffi::Error expect(const char* what, const char* name, const ffi::AnyBuffer& buf, ffi::DataType type,
                  std::initializer_list<int64_t> shape);

// The first error of `checks`, or success.
ffi::Error first_error(std::initializer_list<ffi::Error> checks);

}  // namespace jax_latent_ep
