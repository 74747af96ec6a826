"""The expert stage between `dispatch` and `combine`: a plan of the (row, local expert) pairs and a grouped SwiGLU.

    recv = ep.dispatch(x, ids, weights)
    out  = experts.expert_stage(recv, rank, w_gate, w_up, w_down, max_tokens=T, ranks=N)  # bf16 [N*S, L]
    y    = ep.combine(out, ids, norm)

`expert_stage` (inference) is the plan and the grouped SwiGLU in one call; the same in two steps, the plan kept:

    pl   = experts.plan(recv, rank, num_local_experts=J, max_tokens=T)      # static shapes, no host sync
    out  = experts.swiglu(recv, pl, w_gate, w_up, w_down, impl="ragged_dot")  # bf16 [N*S, L]

The plan (`Plan`) lists the pairs that exist, sorted by local expert (what a grouped GEMM reads), within a static
capacity `N * max_tokens * min(K, J)`; an id is local when `id // J == rank`, so `NO_EXPERT` (-1) never is. It is
built by XLA ops anywhere or by one kernel on NVIDIA GPUs (`PLAN_IMPLEMENTATIONS`: the same words, bit for bit).
The SwiGLU's implementations (`IMPLEMENTATIONS`: "ragged_dot", "gather", "dense", and on NVIDIA GPUs only, `GPU_ONLY`,
"kernel", the project's grouped GEMM) share its numerics: bf16 activations, FP32 accumulation, `h` rounded once to
bf16, each row's pairs summed in a fixed order, so that they differ only by their GEMMs' accumulation order.
Weights are bf16, FP8 with a scale per 128 x 128 block (`BlockScaled`, `quantize_fp8`, `dequantize_fp8`) as
DeepSeek / Kimi checkpoints store them, MXFP4 (`MXFP4`, `quantize_mxfp4`, `dequantize_mxfp4`: Kimi K3's and
gpt-oss's experts, XLA only) or int8 with a scale per output channel (`Int8PerChannel`, XLA only).
docs/experts.md has the numerics and the implementations.

Modules: `planning` (the plan, `capacity`, `plan_kernel_fits`, `work_items`), `formats` (the weight formats and
their checks), `xla` (the XLA implementations, `activations`, the row sum), `kernel` (the grouped GEMM kernel's
implementation: the contraction splits and their `KERNEL_*` targets, the one launch, the row-sum kernel), `grouped`
(`gmm`, the training path's grouped matmul with its custom VJP: XLA, the project's `wgmma` kernels, JAX's Mosaic
GPU kernels), `stage`
(the registry, the entry points, `XLA_ROW_SUM_SLOTS`, and `swiglu_rows`: the SwiGLU on bf16 activations `[R, L]`
of one's own).
"""

from jax_latent_ep.experts.formats import (FP8_BLOCK, FP8_MAX, MX_BLOCK, MXFP4, BlockScaled, BlockScaledOutIn,
                                          Int8PerChannel, dequantize_fp8, dequantize_mxfp4, fp8_in_out, fp8_out_in,
                                          quantize_fp8, quantize_mxfp4)
from jax_latent_ep.experts.planning import (NO_EXPERT, OVERFLOW_POLICIES, PLAN_IMPLEMENTATIONS, CapacityError, Plan,
                                           capacity, plan)
from jax_latent_ep.experts.grouped import GMM_IMPLEMENTATIONS, gmm
from jax_latent_ep.experts.stage import (GPU_ONLY, IMPL_FORMATS, IMPLEMENTATIONS, READS_RECEIVED, default_plan_impl,
                                     expert_stage, swiglu, takes, work_pairs)
from jax_latent_ep.experts.stage import swiglu_rows  # noqa: F401  (the level under `swiglu`; not in `__all__`)

__all__ = [
    "FP8_BLOCK",
    "FP8_MAX",
    "GMM_IMPLEMENTATIONS",
    "GPU_ONLY",
    "IMPL_FORMATS",
    "IMPLEMENTATIONS",
    "MXFP4",
    "MX_BLOCK",
    "NO_EXPERT",
    "OVERFLOW_POLICIES",
    "PLAN_IMPLEMENTATIONS",
    "READS_RECEIVED",
    "BlockScaled",
    "BlockScaledOutIn",
    "CapacityError",
    "Int8PerChannel",
    "Plan",
    "capacity",
    "default_plan_impl",
    "dequantize_fp8",
    "dequantize_mxfp4",
    "expert_stage",
    "fp8_in_out",
    "fp8_out_in",
    "gmm",
    "plan",
    "quantize_fp8",
    "quantize_mxfp4",
    "swiglu",
    "takes",
    "work_pairs",
]
