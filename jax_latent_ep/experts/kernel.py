"""The "kernel" implementation: the project's grouped GEMM in two launches or one (`_kernel_stage`), and its row sum."""

from __future__ import annotations

import jax.numpy as jnp

from jax_latent_ep.autodiff import _axes, _vary
from jax_latent_ep.experts.formats import FP8_BLOCK, BlockScaled
from jax_latent_ep.experts.planning import Plan, _gpus, work_list
from jax_latent_ep.experts.xla import _glu
from jax_latent_ep.kernels import abi
from jax_latent_ep.numerics import mxfp8_quantize
from jax_latent_ep.received import Received

#: Rows of one work item of the grouped GEMM kernel and its other tile sizes (`kernels/abi.py`).
KERNEL_BLOCK_M, KERNEL_BLOCK_K, KERNEL_BLOCK_N = abi.GEMM_BLOCK_M, abi.GEMM_BLOCK_K, abi.GEMM_BLOCK_N
#: Units the kernel path aims for at least per launch (four per SM of an H200), reached by splitting the contraction.
KERNEL_MIN_UNITS = 528
#: The one launch's gate / up target (`_kernel_stage`): finer units there end the gate / up phase evenly (T = 1,
#: I = 512: 8 splits instead of 5, the launch 2.5 / 1 us faster at J = 112 / 448; I = 2048 keeps its 2,
#: docs/performance.md).
KERNEL_STAGE_GATE_UNITS = 1024
#: The one launch's down target: the two launches' (T = 1: unsplit at I = 512; two splits there were 1.5-2.4 us
#: slower, docs/performance.md).
KERNEL_STAGE_DOWN_UNITS = KERNEL_MIN_UNITS


def _kernel_tile(w) -> int:
    """Columns of one kernel unit: 64 of a bf16 weight, 128 of an FP8 one (a 128-byte row either way)."""
    return abi.GEMM_FP8_BLOCK_N if isinstance(w, BlockScaled) else KERNEL_BLOCK_N


def _kernel_splits(num_work: int, n: int, k: int, tile: int = KERNEL_BLOCK_N,
                   min_units: int | None = None) -> tuple[int, int]:
    """(splits, k_per_split) of one kernel launch over `n` columns (of each weight) in `tile`-column units: split the
    contraction until about `min_units` (default `KERNEL_MIN_UNITS`) units (counting one item per local expert that
    can be active) have work, keeping >= 4 pipeline steps per split (FP8, 128-column tiles: splits on the 128-row
    scale blocks)."""
    step = KERNEL_BLOCK_K if tile == KERNEL_BLOCK_N else FP8_BLOCK
    steps = k // step
    ctas = num_work * (n // tile)
    target = KERNEL_MIN_UNITS if min_units is None else min_units
    splits = max(1, min(-(-target // max(ctas, 1)), steps * step // (4 * KERNEL_BLOCK_K)))
    per = -(-steps // splits)
    return -(-steps // per), per * step


def _kernel_gemm(a, a_rows, indexed: bool, w, w_second, work, num_active: int, fuse_glu: bool = False):
    """The kernel's grouped GEMM over the plan's pairs: bf16 `[C, I]` SwiGLU with `fuse_glu`, else FP32 `[C, N]` (or
    `[C, 2N]`, gate and up interleaved by the unit's columns, `_kernel_tile`, with `w_second`), its split partials
    summed in split order. `a` is bf16, or with FP8 weights MXFP8 `(q, sf)`. Pairs outside every work item hold
    garbage (nothing reads them)."""
    from jax_latent_ep.runtime import ffi

    fp8 = isinstance(w, BlockScaled)
    k, n = w.shape[1], w.shape[2]
    tile = _kernel_tile(w)
    step = FP8_BLOCK if fp8 else KERNEL_BLOCK_K
    if k % step or n % tile:
        raise ValueError(f"experts.swiglu(impl='kernel'): the kernel needs L and I multiples of {max(step, tile)} "
                         f"with {'FP8' if fp8 else 'bf16'} weights, got a [{k}, {n}] weight")
    scales = {}
    if fp8:
        a, a_scale = a
        scales = {"a_scale": a_scale, "w_scale": w.scale,
                  "w_second_scale": w_second.scale if w_second is not None else None}
        w, w_second = w.values, (w_second.values if w_second is not None else None)
    if fuse_glu:
        return ffi.grouped_gemm_call(a, a_rows, w, w_second, work, indexed=indexed, fuse_glu=True, splits=1,
                                     k_per_split=k, **scales)
    splits, per = _kernel_splits(num_active, n, k, tile)
    return _split_sum(ffi.grouped_gemm_call(a, a_rows, w, w_second, work, indexed=indexed, fuse_glu=False,
                                            splits=splits, k_per_split=per, **scales))


def _split_sum(parts):
    """FP32 sum over the leading (split) axis of a kernel's partials, in split order (a fixed order)."""
    total = parts[0]
    for s in range(1, parts.shape[0]):
        total = total + parts[s]
    return total


def _expected_active(pl: Plan, expected_pairs) -> int:
    """The local experts a kernel call's contraction splits are chosen for: `expected_active` of the plan's."""
    return expected_active(pl.num_local_experts, pl.capacity, expected_pairs)


def expected_active(num_local_experts: int, capacity: int, expected_pairs: int | None) -> int:
    """`min(J, C, expected_pairs)` (`expected_pairs` None: the capacity `C`)."""
    return min(num_local_experts, capacity, expected_pairs or capacity)


def _kernel_setup(pl: Plan, expected_pairs):
    """(work list, experts expected active) of a kernel call; loads the expert kernels."""
    from jax_latent_ep.runtime import ffi

    ffi.load_expert_kernels(_gpus("experts.swiglu(impl='kernel')"))
    work = work_list(pl, KERNEL_BLOCK_M)
    return work, _expected_active(pl, expected_pairs)


def _stage_fits(pl: Plan, w_gate, w_up, expected_pairs) -> bool:
    """Whether `swiglu(impl="kernel")` runs as one launch (`_kernel_stage`): bf16 gate and up weights of their own,
    `L` a multiple of 128 and `I` of 64, gate / up's contraction split (few experts expected active, decode at a
    handful of tokens: there the kernel boundaries and XLA's kernels around the GEMMs are a large part of the time;
    with more experts active the two launches are 1-7 % faster, docs/performance.md), and what the launch's shared
    memory takes (`abi.STAGE_DIRECT_PAIRS`, `abi.STAGE_DIRECT_K`): no expert can have more pairs than the planned
    rows, `capacity / min(K, J)` (`N * max_tokens`), and those fit one 16-row tile; a gate / up split of at most
    512 rows of `L`."""
    if isinstance(w_gate, BlockScaled) or w_up is None:
        return False
    lat, inter = w_gate.shape[1], w_gate.shape[2]
    active = _expected_active(pl, expected_pairs)
    return (lat % (2 * KERNEL_BLOCK_N) == 0 and inter % KERNEL_BLOCK_N == 0
            and _kernel_splits(active, inter, lat)[0] > 1
            and pl.capacity // pl.row_pairs.shape[1] <= abi.STAGE_DIRECT_PAIRS
            and _stage_k_gate(active, lat, inter) <= abi.STAGE_DIRECT_K)


def _stage_k_gate(active: int, lat: int, inter: int) -> int:
    """The one launch's gate / up split length (`KERNEL_STAGE_GATE_UNITS`)."""
    return _kernel_splits(active, inter, lat, min_units=KERNEL_STAGE_GATE_UNITS)[1]


def _kernel_stage(recv: Received, pl: Plan, w_gate, w_up, w_down, expected_pairs=None):
    """Down's FP32 per-pair partials `[S2, C, L]` of `swiglu(impl="kernel")` in one launch
    (`grouped_gemm.ExpertStage`): gate / up units that dequantize their own rows' slice, and down units that wait
    only for their item's `h`, down's weights streaming while gate / up finishes; gate / up's contraction split for
    `KERNEL_STAGE_GATE_UNITS` units, down's for `KERNEL_STAGE_DOWN_UNITS`. Numerics as the two launches'
    (docs/experts.md), but for `h` where gate / up is split (the kernel's SiLU after the in-order split sum, not
    XLA's: a few FP32 ulps before the bf16 rounding)."""
    from jax_latent_ep.runtime import ffi

    work, active = _kernel_setup(pl, expected_pairs)
    lat, inter = w_gate.shape[1], w_gate.shape[2]
    return ffi.expert_stage_call(recv.x, recv.sf, pl.row, w_gate, w_up, w_down, work,
                                 k_gate=_stage_k_gate(active, lat, inter),
                                 k_down=_kernel_splits(active, lat, inter, min_units=KERNEL_STAGE_DOWN_UNITS)[1])


def _kernel(pl: Plan, xb, w_gate, w_up, w_down, expected_pairs=None, mx=None):
    """The project's grouped GEMM kernel (`kernels/grouped_gemm.py`, NVIDIA GPUs) in two launches (`swiglu` takes
    `_kernel_stage` instead where `_stage_fits`). Gate and up run in one launch that reads each pair's row of `xb`
    itself and, unless the contraction is split, ends in the SwiGLU (bf16 `h`); then down. Each active expert's
    weights are read once per launch (once per 64 pairs of a hotter expert). The contraction splits are chosen for
    `min(J, C, expected_pairs)` active experts. With FP8 weights the activations are MXFP8: the received rows
    `mx = (x, sf)` themselves (else `xb` quantized), and `h` quantized for down."""
    work, active = _kernel_setup(pl, expected_pairs)
    inter = w_down.shape[1]
    tile = _kernel_tile(w_gate)
    fp8 = isinstance(w_gate, BlockScaled)
    a = (mx if mx is not None else mxfp8_quantize(xb)) if fp8 else xb
    if w_up is None:  # fused [J, L, 2I]: one weight of 2I columns, the SwiGLU in XLA
        h = _glu(_kernel_gemm(a, pl.row, True, w_gate, None, work, active), None, inter)
    elif _kernel_splits(active, inter, w_gate.shape[1], tile)[0] == 1:
        h = _kernel_gemm(a, pl.row, True, w_gate, w_up, work, active, fuse_glu=True)
    else:
        gu = _kernel_gemm(a, pl.row, True, w_gate, w_up, work, active).reshape(-1, inter // tile, 2, tile)
        h = _glu(gu[:, :, 0].reshape(-1, inter), gu[:, :, 1].reshape(-1, inter), inter)
    return _kernel_gemm(mxfp8_quantize(h) if fp8 else h, pl.row, False, w_down, None, work, active)


def _kernel_row_sums(pl: Plan, parts):
    """`_row_sums(pl, _split_sum(parts))` bit for bit in one kernel (`kernels/row_sum.py`, NVIDIA GPUs), reading
    only the pairs each row names; `parts` FP32 `[S, C, L]`. The one launch's row sum past `XLA_ROW_SUM_SLOTS` slots
    (most of them unused at N = 8); with hundreds of rows XLA's gather-sum is faster again (docs/performance.md)."""
    from jax_latent_ep.runtime import ffi

    out = ffi.row_sum_call(parts, pl.row_pairs, pl.weight, jnp.reshape(pl.count, (1,)).astype(jnp.int32))
    return _vary(out, _axes(parts, pl.row_pairs))  # a custom call's result: its operands' type
