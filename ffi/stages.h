// The stages of one op's targets, instantiated by handlers.cc and expert_handlers.cc. An op is a traits struct:
// `kWhat` (its name in errors), `bind` (the device, operands, results and attributes its handlers bind after their
// stage's context, one comment per argument) and `prepare` (checks them and computes the Launch, without host
// synchronization: the handlers run at capture / record time inside XLA command buffers).
#pragma once

#include "handlers.h"
#include "launch.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace jax_latent_ep {

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

}  // namespace jax_latent_ep
