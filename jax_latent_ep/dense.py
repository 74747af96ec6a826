"""Dense projections at decode sizes, `matmul`: XLA's dot, or the weights streamed by the grouped GEMM kernel.

    y = dense.matmul(h, w, impl="auto")        # bf16 [T, N] = bf16(h @ w), FP32 accumulation

A decode step's router and latent projections read megabytes of weights for a handful of tokens: the same
weight-streaming problem as the expert stage's, which the project's grouped GEMM kernel (`kernels/grouped_gemm.py`)
solves with its contraction split. Here the weight is that kernel's one group, the tokens its rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_latent_ep.kernels import abi

IMPLEMENTATIONS = ("auto", "xla", "kernel")
#: Rows up to which "auto" takes the kernel on a GPU: there the expert stage's kernel streams its weights at
#: 1.0-1.3x their floor (docs/experts.md); past them its FP32 split partials grow and the weights are re-read per
#: 64-row tile (the crossover against XLA's GEMM: `benchmarks/dense_projections.py --impls kernel xla`).
KERNEL_MAX_ROWS = 32
#: Units the kernel's contraction split aims for (`experts.kernel._kernel_splits`; None: the expert stage's 528).
#: K3's projections (70 and 112 column tiles) then take 3 and 2 splits, 210 and 224 units: one round of the
#: resident grid (three CTAs an SM), 8 % faster at T = 1 and 12 % at T = 32 than 528's 560 units in two rounds
#: (H100, `benchmarks/dense_projections.py --min-units`; docs/performance.md).
KERNEL_MIN_UNITS: int | None = 200


def check_matmul(x, w, impl: str):
    """Raises ValueError naming the bad value unless `x` is bf16 `[T, K]`, `w` bf16 `[K, N]` and `impl` one of
    `IMPLEMENTATIONS`; "kernel" needs `K` and `N` multiples of 64 and a GPU (checked where it runs)."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"dense.matmul: impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"dense.matmul: needs x [T, K] and w [K, N], got x {tuple(x.shape)} and w {tuple(w.shape)}")
    for name, a in (("x", x), ("w", w)):
        if a.dtype != jnp.bfloat16:
            raise ValueError(f"dense.matmul: {name} must be bfloat16, got {a.dtype}")
    if impl == "kernel":
        k, n = w.shape
        if k % abi.GEMM_BLOCK_K or n % abi.GEMM_BLOCK_N:
            raise ValueError(f"dense.matmul(impl='kernel'): K and N must be multiples of {abi.GEMM_BLOCK_K}, "
                             f"got w [{k}, {n}]")


def kernel_fits(x, w) -> bool:
    """Whether "auto" takes the kernel for `x @ w`: a GPU, at most `KERNEL_MAX_ROWS` rows, `K` and `N` multiples of
    64."""
    on_gpu = any(d.platform == "gpu" for d in jax.local_devices())
    k, n = w.shape
    return (on_gpu and x.shape[0] <= KERNEL_MAX_ROWS and k % abi.GEMM_BLOCK_K == 0 and n % abi.GEMM_BLOCK_N == 0)


def matmul(x, w, *, impl: str = "auto", out_dtype=jnp.bfloat16):
    """`x @ w` with FP32 accumulation, rounded once to `out_dtype`.

    Args:
      x: bf16 `[T, K]`, the tokens.
      w: bf16 `[K, N]`, the weight.
      impl: "xla" (`jnp.dot`, any device), "kernel" (the grouped GEMM kernel, NVIDIA GPUs, sm_90a / sm_100a: `K` and `N`
        multiples of 64; the contraction split into FP32 partials summed in split order, `experts.kernel`'s
        split rule), or "auto": the kernel where `kernel_fits`, else XLA.
      out_dtype: the result's dtype; `jnp.float32` keeps the FP32 sum unrounded (a router's logits).

    Returns:
      `out_dtype` `[T, N]`. The two implementations differ only by their accumulation order.
    """
    check_matmul(x, w, impl)
    if impl == "auto":
        impl = "kernel" if kernel_fits(x, w) else "xla"
    if impl == "xla":
        return _xla_matmul(x, w).astype(out_dtype)
    return _kernel_matmul(x, w).astype(out_dtype)


def _xla_matmul(x, w):
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


@jax.custom_vjp
def _kernel_matmul(x, w):
    """FP32 `[T, N]`: the grouped GEMM kernel over one group of `T` rows, its split partials summed in order;
    its gradient XLA's (a training step at these sizes is not weight-bound)."""
    from jax_latent_ep.autodiff import _axes, _vary
    from jax_latent_ep.experts.kernel import _kernel_splits, _split_sum
    from jax_latent_ep.experts.planning import _gpus
    from jax_latent_ep.runtime import ffi

    ffi.load_expert_kernels(_gpus("dense.matmul(impl='kernel')"))
    t = x.shape[0]
    k, n = w.shape
    block = abi.GEMM_BLOCK_M
    num_work = -(-t // block)
    # one work item per 64 rows of the one group: (group, first row, rows, items), a constant of the shape
    work = np.array([(0, i * block, min(block, t - i * block), num_work) for i in range(num_work)], np.int32)
    splits, per = _kernel_splits(num_work, n, k, min_units=KERNEL_MIN_UNITS)
    rows = jnp.zeros((t,), jnp.int32)  # unread: the rows are the pairs themselves
    parts = ffi.grouped_gemm_call(x, rows, w[None], None, jnp.asarray(work), indexed=False, fuse_glu=False,
                                  splits=splits, k_per_split=per)
    return _vary(_split_sum(parts), _axes(x, w))  # a custom call's result: its operands' type (shard_map)


def _kernel_fwd(x, w):
    return _kernel_matmul(x, w), (x, w)


def _kernel_bwd(res, dy):
    x, w = res
    _, vjp = jax.vjp(_xla_matmul, x, w)
    return vjp(dy)


_kernel_matmul.defvjp(_kernel_fwd, _kernel_bwd)
