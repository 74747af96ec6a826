"""The expert stage's entry points (`swiglu`, `expert_stage`; `swiglu_rows` under them) and the implementations."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jax_latent_ep.experts.formats import (_BF16, _FORMATS, _FP8_OUT_IN, _MXFP4, KERNEL_FORMATS, MXFP4, XLA_FORMATS,
                                          BlockScaledOutIn, _check_weights, _format)
from jax_latent_ep.experts import grouped
from jax_latent_ep.experts.grouped import swiglu_pairs
from jax_latent_ep.experts.kernel import _kernel, _kernel_row_sums, _kernel_stage, _split_sum, _stage_fits
from jax_latent_ep.experts.planning import Plan, capacity, plan, plan_blocks, plan_kernel_fits
from jax_latent_ep.experts.xla import _dense, _gather, _ragged_dot, _row_sums, _scan, activations
from jax_latent_ep.kernels import abi
from jax_latent_ep.received import Received

#: The implementations on `grouped.gmm`, and the `gmm` implementation each runs.
GMM_STAGE = {"gmm": "xla", "mosaic": "mosaic", "wgmma": "wgmma"}
#: name -> fn(plan, xb bf16 [R, L], w_gate, w_up or None, w_down, expected_pairs, mx) -> FP32 per-pair outputs [C, L]
#: (`expected_pairs`: a hint for how the kernel splits its work; `mx`: the MXFP8 rows `xb` came from, or None, which
#: the kernel takes with FP8 weights; the XLA implementations ignore both).
IMPLEMENTATIONS: dict[str, Callable] = {
    "ragged_dot": _ragged_dot, "scan": _scan, "gather": _gather, "dense": _dense, "kernel": _kernel,
    **{name: lambda pl, xb, wg, wu, wd, expected_pairs=None, mx=None, impl=impl: swiglu_pairs(pl, xb, wg, wu, wd, impl)
       for name, impl in GMM_STAGE.items()},
}
#: The implementations that run on NVIDIA GPUs only ("mosaic", "wgmma": Hopper).
GPU_ONLY = frozenset({"kernel", "mosaic", "wgmma"})
#: The implementations that read the received MXFP8 rows themselves and have no VJP (the rest differentiate).
READS_RECEIVED = frozenset({"kernel"})
#: The weight formats each implementation multiplies (the XLA ones: all but `[out, in]` FP8). "gmm", "mosaic" and
#: "wgmma" are the training path, on bf16 weights; "gmm" and "wgmma" multiply `[out, in]` FP8 and MXFP4 too, on
#: the FP8 tensor cores' numerics (`gmm_fp8`, `gmm_mxfp4`).
IMPL_FORMATS = {impl: XLA_FORMATS for impl in IMPLEMENTATIONS} | {
    "kernel": KERNEL_FORMATS, "gmm": (_BF16, _FP8_OUT_IN, _MXFP4), "mosaic": (_BF16,),
    "wgmma": (_BF16, _FP8_OUT_IN, _MXFP4)}


def takes(impl: str, w) -> bool:
    """Whether implementation `impl` multiplies weights of `w`'s format (an instance, or a format class such as
    `BlockScaled`; a plain array is bf16)."""
    fmt = next((f for f in _FORMATS if f.cls is w), None) if isinstance(w, type) else _format(w)
    return fmt in IMPL_FORMATS[impl]


def swiglu_rows(pl: Plan, xb, w_gate, w_up, w_down, *, impl: str = "ragged_dot", expected_pairs: int | None = None,
                mx=None, out_dtype=jnp.bfloat16):
    """The grouped SwiGLU on bf16 activations `xb` `[R, L]` (see `swiglu`); `mx`, the MXFP8 rows `(x, sf)` that `xb`
    dequantizes, if there are such (the kernel's FP8 path reads them; without, it quantizes `xb` to MXFP8)."""
    _check_inputs(pl, xb, w_gate, w_up, w_down, impl)
    if isinstance(w_down, (BlockScaledOutIn, MXFP4)) and impl in GMM_STAGE:  # the FP8 tensor cores, no VJP
        kernel_sums = pl.row_pairs.size > XLA_ROW_SUM_SLOTS and jnp.dtype(out_dtype) == jnp.bfloat16
        return grouped.swiglu_rows_fp8(pl, xb, mx, w_gate, w_up, w_down, GMM_STAGE[impl], out_dtype, kernel_sums,
                                        expected_pairs)
    if impl in GMM_STAGE:  # the same forward, with a backward of gathers (`grouped.swiglu_rows`)
        return grouped.swiglu_rows(pl, xb, w_gate, w_up, w_down, GMM_STAGE[impl], out_dtype)
    return _row_sums(pl, IMPLEMENTATIONS[impl](pl, xb, w_gate, w_up, w_down, expected_pairs, mx), out_dtype)


def _check_inputs(pl: Plan, xb, w_gate, w_up, w_down, impl: str):
    """Raises ValueError for an unknown `impl`, activations (or their shape) other than bf16 `[R, L]` of the
    plan's rows, or weights `_check_weights` refuses."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl={impl!r} must be one of {sorted(IMPLEMENTATIONS)}")
    if xb.dtype != jnp.bfloat16 or len(xb.shape) != 2 or xb.shape[0] != pl.row_pairs.shape[0]:
        raise ValueError(f"experts.swiglu: activations must be bfloat16[{pl.row_pairs.shape[0]}, L], got "
                         f"{jnp.dtype(xb.dtype).name}{list(xb.shape)}")
    _check_weights(xb, w_gate, w_up, w_down, pl)
    fmt = _format(w_down)
    if impl == "kernel" and pl.dropped is not None:
        raise ValueError(f"experts.swiglu(impl={impl!r}) takes plans of the worst case's capacity (capacity_factor="
                         "None); a plan of a capacity_factor runs on the other implementations")
    if fmt not in IMPL_FORMATS[impl]:
        others = sorted(i for i, f in IMPL_FORMATS.items() if fmt in f)
        raise ValueError(f"experts.swiglu(impl={impl!r}): {fmt.label} weights are multiplied by {others} only; "
                         f"{impl!r} takes {', '.join(f.label for f in IMPL_FORMATS[impl])}")


#: Slots (`R * M`) up to which XLA's gather-sum over every slot of every row beats the row-sum kernel (256: 2.8
#: against 3.3 us; 1024: 4.3 against 3.1, docs/performance.md).
XLA_ROW_SUM_SLOTS = 512


def swiglu(recv: Received, pl: Plan, w_gate, w_up, w_down, *, impl: str = "ragged_dot",
           expected_pairs: int | None = None, out_dtype=jnp.bfloat16):
    """The rank's routed experts on its received rows: bf16 `[N*S, L]`, exactly what `combine` takes.

    Args:
      recv: the rank's `Received` (its MXFP8 `x`, `sf` are dequantized here).
      pl: `plan(recv, ...)` of the same rows.
      w_gate: bf16 `[J, L, I]` gate projection of each local expert, or bf16 `[J, L, 2I]` gate and up fused
        (gate first) when `w_up` is None; or any of these shapes as `BlockScaled` FP8 (L, I multiples of 128) or
        `Int8PerChannel` (XLA implementations).
      w_up: bf16 `[J, L, I]` up projection, or None (fused into `w_gate`); in the format of `w_gate`.
      w_down: bf16 `[J, I, L]` down projection; in the format of `w_gate` (all three in one format).
      impl: a name of `IMPLEMENTATIONS` ("ragged_dot", "gather", "dense", or on NVIDIA GPUs "kernel", which needs
        `L` and `I` multiples of 64, 128 with FP8 weights, and has no VJP; where few experts are expected active it
        is one launch after the plan, docs/experts.md).
      expected_pairs: how many pairs the plan is expected to hold (`max_tokens * K` under uniform routing), or
        None (the capacity): how the kernel splits its contraction (performance, and the FP32 order of a split
        contraction, `docs/experts.md`); the other implementations ignore it.
      out_dtype: the dtype of the one rounding of each row's FP32 sum: bf16 (what `combine` takes), or float32 for
        partial sums still to be added (tensor parallelism over `I`: `psum` in FP32, then one bf16 rounding).

    Returns:
      `out_dtype` `[N*S, L]`: `out[row] = bf16(sum_m weight_m * down(bf16(silu(gate) * up)))` over the row's local
      experts in ascending first-slot order (FP32, from 0); exactly 0 in rows with no local expert or
      `src == -1`.
    """
    if impl == "kernel":
        _check_inputs(pl, jax.ShapeDtypeStruct(recv.x.shape, jnp.bfloat16), w_gate, w_up, w_down, impl)
        if _stage_fits(pl, w_gate, w_up, expected_pairs):
            parts = _kernel_stage(recv, pl, w_gate, w_up, w_down, expected_pairs)
            if pl.row_pairs.size > XLA_ROW_SUM_SLOTS and jnp.dtype(out_dtype) == jnp.bfloat16:
                return _kernel_row_sums(pl, parts)
            return _row_sums(pl, _split_sum(parts), out_dtype)
    return swiglu_rows(pl, activations(recv), w_gate, w_up, w_down, impl=impl, expected_pairs=expected_pairs,
                       mx=(recv.x, recv.sf), out_dtype=out_dtype)


def expert_stage(recv: Received, rank, w_gate, w_up, w_down, *, impl: str = "ragged_dot", max_tokens=None, ranks=None,
                 plan_impl: str | None = None):
    """`swiglu(recv, plan(recv, rank, J, max_tokens=..., ranks=..., impl=plan_impl), ...)` with `J =
    w_down.shape[0]`; `plan_impl` defaults to `default_plan_impl`'s (the same plan either way); `expected_pairs =
    max_tokens * K` (each of the N sources sends `max_tokens * K` slots, 1 / N of them here under uniform
    routing). The plan kernel writes its work list in the items the stage's kernels take (`work_pairs`), so
    they build none."""
    if plan_impl is None:
        plan_impl = default_plan_impl(recv, impl, w_down)
    rows, k = recv.ids.shape
    j = w_down.shape[0]
    n, _, mt = plan_blocks(rows, j, max_tokens, ranks)
    pl = plan(recv, rank, j, max_tokens=max_tokens, ranks=ranks, impl=plan_impl,
              work_pairs=work_pairs(impl, w_down, capacity(n, mt, k, j), mt * k))
    return swiglu(recv, pl, w_gate, w_up, w_down, impl=impl, expected_pairs=mt * k)


def work_pairs(impl: str, w_down, capacity: int, expected_pairs: int | None = None) -> int:
    """The pairs of one item of the work list the stage's kernels read (`plan`'s `work_pairs`): the FP8 / MXFP4
    tiles on "wgmma" (`grouped.narrow_tile`) where the plan kernel writes lists of them (`abi.PLAN_WORK_PAIRS`;
    the prefill tiles' list `work_list` builds in XLA), else the grouped GEMM's; `w_down` the stage's down weights
    (`[J, ...]`), `capacity` the plan's pairs, `expected_pairs` as `swiglu`'s."""
    if isinstance(w_down, (BlockScaledOutIn, MXFP4)) and GMM_STAGE.get(impl) == "wgmma":
        tile = grouped.narrow_tile(w_down.shape[0], capacity, expected_pairs, isinstance(w_down, BlockScaledOutIn))
        if tile in abi.PLAN_WORK_PAIRS:
            return tile
    return abi.GEMM_BLOCK_M


def default_plan_impl(recv: Received, impl: str, w_down, capacity_factor=None) -> str:
    """"kernel" (one launch) where the plan kernel takes the rows (`plan_kernel_fits`, the worst case's capacity)
    and the stage has no VJP to carry through the plan's routing weights: `impl="kernel"`, or FP8 `[out, in]` /
    MXFP4 weights on the GPU implementations; else "xla" (the same plan, bit for bit; XLA's sort and scatters are
    15-20 kernels at decode sizes)."""
    no_vjp = impl in READS_RECEIVED or (impl in GPU_ONLY and isinstance(w_down, (BlockScaledOutIn, MXFP4)))
    fits = plan_kernel_fits(recv.ids.shape[0], recv.ids.shape[1], w_down.shape[0])
    return "kernel" if no_vjp and fits and capacity_factor is None else "xla"
