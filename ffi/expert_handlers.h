// The XLA FFI handlers of the expert stage's targets (expert_handlers.cc): what c_api.cc exports and registers.
// Their kernels need no rank registration (ep_register_kernel).
#pragma once

#include "handlers.h"

namespace jax_latent_ep {

Targets expert_plan_targets();
Targets grouped_gemm_targets();
Targets expert_stage_targets();
Targets row_sum_targets();
Targets grouped_matmul_targets();
Targets grouped_matmul_wgrad_targets();
Targets grouped_matmul_fp8_targets();
Targets grouped_matmul_mxfp4_targets();
Targets grouped_matmul_fp8_n16_targets();
Targets grouped_matmul_mxfp4_n16_targets();
Targets grouped_matmul_fp8_n8_targets();
Targets grouped_matmul_mxfp4_n8_targets();
Targets grouped_matmul_fp8_wide_targets();
Targets grouped_matmul_fp8_wide_glu_targets();
Targets swiglu_mxfp8_targets();

}  // namespace jax_latent_ep
