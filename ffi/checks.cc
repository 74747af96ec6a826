#include "checks.h"

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_latent_ep {
namespace {

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

}  // namespace

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

ffi::Error first_error(std::initializer_list<ffi::Error> checks) {
  for (const ffi::Error& e : checks) {
    if (!e.success()) return e;
  }
  return ffi::Error::Success();
}

}  // namespace jax_latent_ep
