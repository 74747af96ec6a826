"""The expert stage between `dispatch` and `combine`: a plan of the (row, local expert) pairs and a grouped SwiGLU.

    recv = ep.dispatch(x, ids, weights)
    pl   = experts.plan(recv, rank, num_local_experts=J, max_tokens=T)      # static shapes, no host sync
    out  = experts.swiglu(recv, pl, w_gate, w_up, w_down, impl="ragged_dot")  # bf16 [N*S, L]
    y    = ep.combine(out, ids, norm)

The plan lists the pairs (row, local expert) that exist, sorted by local expert (the layout a grouped GEMM
reads), with their group sizes and the way back from pairs to rows. Its capacity is static:
`C = N * max_tokens * min(K, J)` (rows `t >= max_tokens` of a source block are always empty; `max_tokens`
defaults to `S`, giving the `N * S * min(K, J)` bound), and a row is never planned twice for one expert:
duplicate ids of a token that name the same local expert make one pair whose weight is their FP32 sum in
ascending slot order. An id is local when `id // J == rank`; so `-1` (the documented "no expert" id of a
padded token or an unused slot) and every other id outside this rank's range are not. Rows with `src == -1`
get no pair whatever their ids (with N = 1 the empty rows carry expert 0 with weight 0). The plan is built by XLA
ops anywhere, or on NVIDIA GPUs by one kernel (`PLAN_IMPLEMENTATIONS`; the same words, bit for bit).

Numerics (docs/experts.md): activations are the dequantized MXFP8 rows rounded to bf16 (exact: an MXFP8 value
has 4 significant bits); `gate = x @ w_gate[e]`, `up = x @ w_up[e]` bf16 x bf16 with FP32 accumulation;
`h = bf16(silu(gate) * up)` (silu and product in FP32, one rounding); `y = h @ w_down[e]` FP32 accumulation;
`out[row] = bf16(sum_m coef_m * y_m)`, the FP32 sum starting from 0 over the row's local experts in ascending
order of their first slot `k`, rounded once. The sum is a fixed-order loop over `min(K, J)` gathered pair
outputs, so given the pair outputs it is deterministic and identical on every implementation; the GEMMs'
accumulation order is the implementation's (XLA's or the kernel's), hence a stated tolerance between them.

Weights are bf16, or FP8 with block scales (`BlockScaled`: float8_e4m3fn values and an FP32 scale per 128 x 128 block,
as DeepSeek / Kimi checkpoints store them). With FP8 weights `h` is rounded to MXFP8 (the dispatch's format:
`numerics.mxfp8_quantize`) before down, in every implementation; the kernel multiplies MXFP8 activations by the FP8
weights with the e4m3 MMA (exact products, FP32 sums), the XLA implementations dequantize both to FP32 (one rounding
of `w * scale`) at HIGHEST precision (docs/experts.md).

Implementations (`IMPLEMENTATIONS`, a small registry; each maps the plan and the bf16 activations to the
per-pair FP32 outputs `y [C, L]`): "ragged_dot" (`jax.lax.ragged_dot` over the sorted pairs; how XLA lowers it
is the backend's: see benchmarks/expert_stage.py), "gather" (each pair gathers its expert's weights: only
for small `C`), "dense" (every local expert on every row, then the pairs picked: the checker), "kernel" (the
project's grouped GEMM, `kernels/grouped_gemm.py`, NVIDIA GPUs only: `GPU_ONLY`; docs/experts.md).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_latent_ep.kernels import abi
from jax_latent_ep.numerics import mxfp8_dequantize, mxfp8_quantize
from jax_latent_ep.received import Received

#: The "no expert" id: a padded token's ids, or a slot a token does not use. It selects no rank.
NO_EXPERT = -1


class Plan(NamedTuple):
    """The (row, local expert) pairs of one rank's receive rows, grouped by local expert (static shapes).

    `C` = capacity, `R = N * S` rows, `J` local experts, `M = min(K, J)`.

    Attributes:
      row: int32 `[C]`, the receive row of each pair; pairs sorted by local expert, then row (0 in unused pairs).
      expert: int32 `[C]`, the local expert `j` in `[0, J)` of each pair (`J` in unused pairs).
      weight: float32 `[C]`, the pair's routing weight: the FP32 sum, ascending `k`, of the row's weights of
        the slots naming that expert (0 in unused pairs).
      group_sizes: int32 `[J]`, pairs per local expert (what `ragged_dot` takes).
      count: int32 `[]`, pairs used (`sum(group_sizes)`); pairs `count ... C - 1` are unused.
      row_pairs: int32 `[R, M]`, the way back: the pair of the row's `m`-th local expert in ascending order of
        its first slot, or `C` where the row has fewer (points at a zero row).
      work: int32 `[W, 4]`, the grouped GEMM kernel's work list (`work_items`) when the plan kernel built the
        plan, else None (the kernel implementation then derives it).
    """

    row: jax.Array
    expert: jax.Array
    weight: jax.Array
    group_sizes: jax.Array
    count: jax.Array
    row_pairs: jax.Array
    work: jax.Array | None = None

    @property
    def capacity(self) -> int:
        return int(self.row.shape[0])

    @property
    def num_local_experts(self) -> int:
        return int(self.group_sizes.shape[0])


#: Rows and columns of one FP8 weight block (one FP32 scale each).
FP8_BLOCK = abi.GEMM_FP8_SCALE_BLOCK
#: The largest float8_e4m3fn value (what `quantize_fp8` scales each block's largest magnitude to).
FP8_MAX = 448.0


class BlockScaled(NamedTuple):
    """FP8 expert weights with an FP32 scale per `FP8_BLOCK x FP8_BLOCK` block: the weight is
    `values[j, k, n] * scale[j, k // 128, n // 128]`. A checkpoint's `[out, in]` weight with its `weight_scale_inv`
    `[out / 128, in / 128]` is this transposed (`values = w.transpose(0, 2, 1)`, `scale = s.transpose(0, 2, 1)`).

    Attributes:
      values: float8_e4m3fn `[J, K, N]` (finite: NaN is not a weight).
      scale: float32 `[J, K / 128, N / 128]`.
    """

    values: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)


def quantize_fp8(w) -> BlockScaled:
    """`w` `[J, K, N]` (K, N multiples of 128) as `BlockScaled`: each block's scale is its largest magnitude / 448
    (1 where the block is zero), its values `w / scale` rounded to float8_e4m3fn (nearest even)."""
    j, k, n = w.shape
    if k % FP8_BLOCK or n % FP8_BLOCK:
        raise ValueError(f"quantize_fp8: K={k} and N={n} must be multiples of {FP8_BLOCK}")
    blocks = w.astype(jnp.float32).reshape(j, k // FP8_BLOCK, FP8_BLOCK, n // FP8_BLOCK, FP8_BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=(2, 4))
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
    values = (blocks / scale[:, :, None, :, None]).astype(jnp.float8_e4m3fn).reshape(j, k, n)
    return BlockScaled(values, scale)


def dequantize_fp8(w: BlockScaled):
    """FP32 `[J, K, N]`: `values * scale` of each block (one FP32 rounding a weight)."""
    j, k, n = w.values.shape
    blocks = w.values.astype(jnp.float32).reshape(j, k // FP8_BLOCK, FP8_BLOCK, n // FP8_BLOCK, FP8_BLOCK)
    return (blocks * w.scale[:, :, None, :, None]).reshape(j, k, n)


def _xla_operands(a, w):
    """`(a, w)` as an XLA dot takes them: bf16 as they are, FP8 weights dequantized to FP32 (and `a` widened)."""
    if isinstance(w, BlockScaled):
        return a.astype(jnp.float32), dequantize_fp8(w)
    return a, w


def capacity(ranks: int, max_tokens: int, topk: int, num_local_experts: int) -> int:
    """`N * max_tokens * min(K, J)`: the most pairs one rank's receive rows can hold."""
    return ranks * max_tokens * min(topk, num_local_experts)


#: How a plan is built: "xla" (XLA ops, every platform) or "kernel" (the plan kernel, `kernels/expert_plan.py`, one
#: launch on NVIDIA GPUs: the same words, and the work list with them).
PLAN_IMPLEMENTATIONS = ("xla", "kernel")


def plan(recv: Received, rank, num_local_experts: int, *, max_tokens: int | None = None, ranks: int | None = None,
         impl: str = "xla") -> Plan:
    """The plan of this rank's received rows (traced inside the `shard_map`, or anywhere on a `Received`).

    Args:
      recv: the rank's `Received` (`[N*S, ...]` rows); only `ids`, `weights` and `src` are read.
      rank: int32 scalar (traced or static), this rank's index on the expert-parallel axis.
      num_local_experts: `J = E / N`; an id is local when `id // J == rank`.
      max_tokens: the `ExpertParallel`'s `max_tokens` (rows `t >= max_tokens` of every source block are
        empty by the contract and are not planned); default `S`, i.e. every row.
      ranks: `N`, the number of source blocks of `recv`; default `N*S / S` with `S = stride(max_tokens)` when
        `max_tokens` is given, else 1 (one block of all rows).
      impl: one of `PLAN_IMPLEMENTATIONS`; "kernel" runs on NVIDIA GPUs, where `plan_kernel_fits`.

    Returns:
      A `Plan` of capacity `N * max_tokens * min(K, J)` (with its work list when `impl="kernel"`).
    """
    from jax_latent_ep.layout import stride

    rows, k = recv.ids.shape
    j = int(num_local_experts)
    if j < 1:
        raise ValueError(f"num_local_experts={num_local_experts} must be >= 1")
    if ranks is None:
        ranks = rows // stride(max_tokens) if max_tokens is not None else 1
    if rows % ranks:
        raise ValueError(f"{rows} receive rows do not split into ranks={ranks} source blocks")
    s_rows = rows // ranks
    mt = s_rows if max_tokens is None else int(max_tokens)
    if not 1 <= mt <= s_rows:
        raise ValueError(f"max_tokens={max_tokens} must be in [1, S={s_rows}]")
    m = min(k, j)
    cap = capacity(ranks, mt, k, j)
    if impl not in PLAN_IMPLEMENTATIONS:
        raise ValueError(f"experts.plan: impl={impl!r} must be one of {PLAN_IMPLEMENTATIONS}")
    if impl == "kernel":
        return _plan_kernel(recv, rank, j, s_rows, mt, cap)
    ids, w = recv.ids, recv.weights.astype(jnp.float32)
    rank = jnp.asarray(rank, jnp.int32)

    live = (recv.src != -1) & ((jnp.arange(rows, dtype=jnp.int32) % s_rows) < mt)  # [R]
    local = (jnp.floor_divide(ids, j) == rank) & live[:, None]  # [R, K]
    # One pair per distinct local expert of a row: the first slot naming it; its weight sums the slots
    # naming it in ascending k (FP32, from 0).
    same = ids[:, :, None] == ids[:, None, :]  # [R, K(k), K(k')]
    earlier = jnp.tril(jnp.ones((k, k), bool), -1)  # k' < k
    first = local & ~jnp.any(same & earlier[None], axis=2)
    coef = jnp.zeros((rows, k), jnp.float32)
    for kk in range(k):  # ascending k'
        coef = coef + jnp.where(same[:, :, kk], w[:, kk : kk + 1], 0.0)
    coef = jnp.where(first, coef, 0.0)

    flat_first = first.reshape(-1)
    key = jnp.where(first, jnp.clip(ids - rank * j, 0, j - 1), j).reshape(-1)  # [R*K], J = no pair
    order = jnp.argsort(key, stable=True)[:cap].astype(jnp.int32)  # by expert, then row, then slot
    used = flat_first[order]
    pair_row = jnp.where(used, order // k, 0)
    pair_expert = jnp.where(used, key[order], j)
    pair_weight = jnp.where(used, coef.reshape(-1)[order], 0.0)
    group_sizes = jnp.zeros((j + 1,), jnp.int32).at[key].add(1)[:j]
    count = jnp.sum(flat_first, dtype=jnp.int32)

    # The way back: the pair index of every (row, slot), then each row's pairs in ascending first slot.
    pos = jnp.full((rows * k,), cap, jnp.int32).at[order].set(jnp.arange(cap, dtype=jnp.int32), unique_indices=True)
    pos = jnp.where(flat_first, pos, cap).reshape(rows, k)
    slots = jnp.argsort(~first, axis=1, stable=True)[:, :m]  # the row's first slots, ascending k
    row_pairs = jnp.take_along_axis(pos, slots, axis=1)
    row_pairs = jnp.where(jnp.take_along_axis(first, slots, axis=1), row_pairs, cap)
    return Plan(pair_row, pair_expert, pair_weight, group_sizes, count, row_pairs.astype(jnp.int32))


def _gpus(what: str):
    """This process's NVIDIA GPUs, or a ValueError naming `what` and its XLA alternative."""
    gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
    if not gpus:
        raise ValueError(f"{what} runs on NVIDIA GPUs (sm_90a / sm_100a); this process has none: use the XLA "
                         "implementation (plan impl='xla', swiglu impl='ragged_dot')")
    return gpus


def plan_kernel_fits(rows: int, topk: int, num_local_experts: int) -> bool:
    """Whether the plan kernel takes `rows` receive rows of `topk` ids over `num_local_experts` local experts:
    `J <= NUM_MAX_PLAN_EXPERTS`, `K <= NUM_MAX_TOPK` and `J * ceil(R / 32) <= NUM_PLAN_BITMAP_WORDS` (its
    per-expert row bitmaps in shared memory; `kernels/abi.py`)."""
    j = num_local_experts
    return j <= abi.NUM_MAX_PLAN_EXPERTS and topk <= abi.NUM_MAX_TOPK and j * -(-rows // 32) <= abi.NUM_PLAN_BITMAP_WORDS


def _plan_kernel(recv: Received, rank, j: int, s_rows: int, mt: int, cap: int) -> Plan:
    """`plan` by the plan kernel (one launch; the XLA plan's words, and the work list)."""
    from jax_latent_ep.runtime import ffi

    rows, k = recv.ids.shape
    if not plan_kernel_fits(rows, k, j):
        raise ValueError(f"experts.plan(impl='kernel') takes J <= {abi.NUM_MAX_PLAN_EXPERTS} local experts, K <= "
                         f"{abi.NUM_MAX_TOPK} ids and J * ceil(R / 32) <= {abi.NUM_PLAN_BITMAP_WORDS}, got J={j}, "
                         f"K={k}, R={rows}: use impl='xla'")
    ffi.load_expert_kernels(_gpus("experts.plan(impl='kernel')"))
    num_work = min(j, cap) + cap // KERNEL_BLOCK_M
    rank = jnp.asarray(rank, jnp.int32).reshape(1)
    row, expert, weight, sizes, count, row_pairs, work = ffi.expert_plan_call(
        recv.ids.astype(jnp.int32), recv.weights.astype(jnp.float32), recv.src.astype(jnp.int32), rank,
        capacity=cap, num_local_experts=j, num_work=num_work, rows_per_source=s_rows, max_tokens=mt)
    return Plan(row, expert, weight, sizes, count[0], row_pairs, work)


def activations(recv: Received):
    """bf16 `[N*S, L]`: the dequantized MXFP8 rows (exact in bf16; unspecified in empty rows)."""
    return mxfp8_dequantize(recv.x, recv.sf).astype(jnp.bfloat16)


def _split(w_gate, w_up):
    """(gate, up) weights, or the fused `[J, L, 2I]` and None."""
    return (w_gate, w_up) if w_up is not None else (w_gate, None)


def _glu(gu, up, inter):
    """bf16 `h = silu(gate) * up` from FP32 `gate`, `up` (or the fused `[.., 2I]` `gu` with `up=None`)."""
    if up is None:
        gu, up = gu[..., :inter], gu[..., inter:]
    return (jax.nn.silu(gu) * up).astype(jnp.bfloat16)


def _down_input(h, w_down):
    """What down multiplies: bf16 `h`, or with FP8 weights `h` rounded to MXFP8 (its values, exact in bf16)."""
    if isinstance(w_down, BlockScaled):
        return mxfp8_dequantize(*mxfp8_quantize(h)).astype(jnp.bfloat16)
    return h


def _ragged_dot(pl: Plan, xb, w_gate, w_up, w_down, expected_pairs=None, mx=None):
    """`lax.ragged_dot` over the pairs sorted by expert (unused pairs past `sum(group_sizes)` give 0)."""
    xp = xb[pl.row]  # [C, L] bf16
    gs = pl.group_sizes
    def rd(a, w):
        # FP8 weights are FP32 operands here: HIGHEST keeps XLA on GPUs from rounding them to TF32.
        hi = lax.Precision.HIGHEST if isinstance(w, BlockScaled) else None
        return lax.ragged_dot(*_xla_operands(a, w), gs, preferred_element_type=jnp.float32, precision=hi)

    gate = rd(xp, w_gate)
    up = rd(xp, w_up) if w_up is not None else None
    h = _down_input(_glu(gate, up, w_down.shape[1]), w_down)
    return rd(h, w_down)


def _gather(pl: Plan, xb, w_gate, w_up, w_down, expected_pairs=None, mx=None):
    """Each pair gathers its expert's weights (`[C, L, I]` temporaries: decode-sized `C` only)."""
    e = jnp.minimum(pl.expert, pl.num_local_experts - 1)
    xp = xb[pl.row]
    def mv(a, w):
        a, w = _xla_operands(a, w)
        return jnp.einsum("cl,cli->ci", a, w[e], preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)

    gate = mv(xp, w_gate)
    up = mv(xp, w_up) if w_up is not None else None
    return mv(_down_input(_glu(gate, up, w_down.shape[1]), w_down), w_down)


def _dense(pl: Plan, xb, w_gate, w_up, w_down, expected_pairs=None, mx=None):
    """Every local expert on every row (`[R, J, L]` FP32), then each pair's (row, expert) picked.

    In FP32 operands (exact bf16 values: the same products), as XLA's CPU dot does not take bf16 x bf16 -> f32
    in a batched dot; it is the checker, not a fast path."""
    f32 = lambda a: dequantize_fp8(a) if isinstance(a, BlockScaled) else a.astype(jnp.float32)  # noqa: E731
    hi = lax.Precision.HIGHEST  # no TF32 on GPUs
    mm = lambda a, w: jnp.einsum("rl,jli->rji", f32(a), f32(w), precision=hi)  # noqa: E731
    gate = mm(xb, w_gate)
    up = mm(xb, w_up) if w_up is not None else None
    h = _down_input(_glu(gate, up, w_down.shape[1]), w_down)
    y = jnp.einsum("rji,jil->rjl", f32(h), f32(w_down), precision=hi)
    return y[pl.row, jnp.minimum(pl.expert, pl.num_local_experts - 1)]


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


def work_items(pl: Plan, block_m: int = KERNEL_BLOCK_M):
    """int32 `[W, 4]` work list of the grouped GEMM kernel: `(local expert, first pair, pairs <= block_m, items)` for
    each `block_m`-chunk of each non-empty group in expert order, then `(., ., 0, items)` (nothing to do); `items`,
    the same in every row, is the number of non-empty ones (the kernel's grid covers only those).
    `W = min(J, C) + C // block_m`, a static bound: a group of `s > 0` pairs takes `ceil(s / block_m) <= 1 +
    (s - 1) // block_m` items."""
    gs = pl.group_sizes
    j, cap = pl.num_local_experts, pl.capacity
    num_work = min(j, cap) + cap // block_m
    chunks = (gs + block_m - 1) // block_m
    incl = jnp.cumsum(chunks)
    offsets = jnp.cumsum(gs) - gs
    w = jnp.arange(num_work, dtype=jnp.int32)
    # compare_all: one fused comparison (the default method is a loop, a device-host round trip per step on GPUs)
    g = jnp.minimum(jnp.searchsorted(incl, w, side="right", method="compare_all"), j - 1).astype(jnp.int32)
    m = w - (incl[g] - chunks[g])
    rows = jnp.where(w < incl[-1], jnp.clip(gs[g] - m * block_m, 0, block_m), 0)
    items = jnp.broadcast_to(incl[-1], g.shape)
    return jnp.stack([g, offsets[g] + m * block_m, rows, items], axis=1).astype(jnp.int32)


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
    """The local experts a kernel call's contraction splits are chosen for: `min(J, C, expected_pairs)`."""
    return min(pl.num_local_experts, pl.capacity, expected_pairs or pl.capacity)


def _kernel_setup(pl: Plan, expected_pairs):
    """(work list, experts expected active) of a kernel call; loads the expert kernels."""
    from jax_latent_ep.runtime import ffi

    ffi.load_expert_kernels(_gpus("experts.swiglu(impl='kernel')"))
    work = pl.work if pl.work is not None else work_items(pl)
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


#: name -> fn(plan, xb bf16 [R, L], w_gate, w_up or None, w_down, expected_pairs, mx) -> FP32 per-pair outputs [C, L]
#: (`expected_pairs`: a hint for how the kernel splits its work; `mx`: the MXFP8 rows `xb` came from, or None, which
#: the kernel takes with FP8 weights; the XLA implementations ignore both).
IMPLEMENTATIONS: dict[str, Callable] = {"ragged_dot": _ragged_dot, "gather": _gather, "dense": _dense,
                                        "kernel": _kernel}
#: The implementations that run on NVIDIA GPUs only.
GPU_ONLY = frozenset({"kernel"})


def _check_weights(xb, w_gate, w_up, w_down, pl: Plan):
    j, lat = pl.num_local_experts, xb.shape[1]
    given = [("w_gate", w_gate), ("w_down", w_down)] + ([("w_up", w_up)] if w_up is not None else [])
    fp8 = [name for name, w in given if isinstance(w, BlockScaled)]
    if fp8 and len(fp8) != len(given):
        raise ValueError(f"experts.swiglu: {', '.join(fp8)} are BlockScaled and the others not: give every weight "
                         "in one format (bf16, or BlockScaled FP8)")
    dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    inter = w_down.shape[1] if len(w_down.shape) == 3 else None
    want_gate = (j, lat, inter if w_up is not None else 2 * (inter or 0))
    checks = [("w_down", w_down, (j, inter, lat)), ("w_gate", w_gate, want_gate)]
    if w_up is not None:
        checks.append(("w_up", w_up, (j, lat, inter)))
    for name, a, shape in checks:
        values = a.values if fp8 else a
        if values.ndim != 3 or tuple(values.shape) != shape or values.dtype != dtype:
            what = "BlockScaled values " if fp8 else ""
            raise ValueError(
                f"experts.swiglu: {name} {what}must be {jnp.dtype(dtype).name}{list(shape)} (J={j} local experts, "
                f"L={lat}), got {jnp.dtype(values.dtype).name}{list(values.shape)}"
            )
        if fp8:
            if shape[1] % FP8_BLOCK or shape[2] % FP8_BLOCK:
                raise ValueError(f"experts.swiglu: FP8 weights need L and I multiples of {FP8_BLOCK} (the block), "
                                 f"got {name} {list(shape)}")
            want = (j, shape[1] // FP8_BLOCK, shape[2] // FP8_BLOCK)
            if tuple(a.scale.shape) != want or a.scale.dtype != jnp.float32:
                raise ValueError(f"experts.swiglu: {name} scale must be float32{list(want)} (one per {FP8_BLOCK} x "
                                 f"{FP8_BLOCK} block), got {jnp.dtype(a.scale.dtype).name}{list(a.scale.shape)}")


def swiglu_rows(pl: Plan, xb, w_gate, w_up, w_down, *, impl: str = "ragged_dot", expected_pairs: int | None = None,
                mx=None):
    """The grouped SwiGLU on bf16 activations `xb` `[R, L]` (see `swiglu`); `mx`, the MXFP8 rows `(x, sf)` that `xb`
    dequantizes, if there are such (the kernel's FP8 path reads them; without, it quantizes `xb` to MXFP8)."""
    _check_inputs(pl, xb, w_gate, w_up, w_down, impl)
    return _row_sums(pl, IMPLEMENTATIONS[impl](pl, xb, w_gate, w_up, w_down, expected_pairs, mx))


def _check_inputs(pl: Plan, xb, w_gate, w_up, w_down, impl: str):
    """Raises ValueError for an unknown `impl`, activations (or their shape) other than bf16 `[R, L]` of the
    plan's rows, or weights `_check_weights` refuses."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl={impl!r} must be one of {sorted(IMPLEMENTATIONS)}")
    if xb.dtype != jnp.bfloat16 or len(xb.shape) != 2 or xb.shape[0] != pl.row_pairs.shape[0]:
        raise ValueError(f"experts.swiglu: activations must be bfloat16[{pl.row_pairs.shape[0]}, L], got "
                         f"{jnp.dtype(xb.dtype).name}{list(xb.shape)}")
    _check_weights(xb, w_gate, w_up, w_down, pl)


def _row_sums(pl: Plan, y):
    """bf16 `[R, L]`: each row's weighted sum of its pairs' FP32 outputs `y` `[C, L]` (unused pairs: garbage)."""
    # One fused gather-sum: only the pairs a row names are read (never an unused pair's row).
    valid = pl.row_pairs < pl.count  # [R, M]; C (no pair) and unused pairs fail
    safe = jnp.minimum(pl.row_pairs, pl.capacity - 1)
    coef = pl.weight[safe]
    acc = jnp.zeros((pl.row_pairs.shape[0], y.shape[1]), jnp.float32)
    for m in range(pl.row_pairs.shape[1]):  # ascending first slot: a fixed order
        acc = acc + jnp.where(valid[:, m : m + 1], y[safe[:, m]] * coef[:, m : m + 1], 0.0)
    return acc.astype(jnp.bfloat16)


#: Slots (`R * M`) up to which XLA's gather-sum over every slot of every row beats the row-sum kernel (256: 2.8
#: against 3.3 us; 1024: 4.3 against 3.1, docs/performance.md).
XLA_ROW_SUM_SLOTS = 512


def _kernel_row_sums(pl: Plan, parts):
    """`_row_sums(pl, _split_sum(parts))` bit for bit in one kernel (`kernels/row_sum.py`, NVIDIA GPUs), reading
    only the pairs each row names; `parts` FP32 `[S, C, L]`. The one launch's row sum past `XLA_ROW_SUM_SLOTS` slots
    (most of them unused at N = 8); with hundreds of rows XLA's gather-sum is faster again (docs/performance.md)."""
    from jax_latent_ep.runtime import ffi

    return ffi.row_sum_call(parts, pl.row_pairs, pl.weight, jnp.reshape(pl.count, (1,)).astype(jnp.int32))


def swiglu(recv: Received, pl: Plan, w_gate, w_up, w_down, *, impl: str = "ragged_dot",
           expected_pairs: int | None = None):
    """The rank's routed experts on its received rows: bf16 `[N*S, L]`, exactly what `combine` takes.

    Args:
      recv: the rank's `Received` (its MXFP8 `x`, `sf` are dequantized here).
      pl: `plan(recv, ...)` of the same rows.
      w_gate: bf16 `[J, L, I]` gate projection of each local expert, or bf16 `[J, L, 2I]` gate and up fused
        (gate first) when `w_up` is None; or any of these shapes as `BlockScaled` FP8 (L, I multiples of 128).
      w_up: bf16 `[J, L, I]` up projection, or None (fused into `w_gate`); `BlockScaled` with FP8 weights.
      w_down: bf16 `[J, I, L]` down projection; `BlockScaled` with FP8 weights (all three in one format).
      impl: a name of `IMPLEMENTATIONS` ("ragged_dot", "gather", "dense", or on NVIDIA GPUs "kernel", which needs
        `L` and `I` multiples of 64, 128 with FP8 weights, and has no VJP; where few experts are expected active it
        is one launch after the plan, docs/experts.md).
      expected_pairs: how many pairs the plan is expected to hold (`max_tokens * K` under uniform routing), or
        None (the capacity): how the kernel splits its contraction (performance, and the FP32 order of a split
        contraction, `docs/experts.md`); the other implementations ignore it.

    Returns:
      bf16 `[N*S, L]`: `out[row] = bf16(sum_m weight_m * down(bf16(silu(gate) * up)))` over the row's local
      experts in ascending first-slot order (FP32, from 0); exactly 0 in rows with no local expert or
      `src == -1`.
    """
    if impl == "kernel":
        _check_inputs(pl, jax.ShapeDtypeStruct(recv.x.shape, jnp.bfloat16), w_gate, w_up, w_down, impl)
        if _stage_fits(pl, w_gate, w_up, expected_pairs):
            parts = _kernel_stage(recv, pl, w_gate, w_up, w_down, expected_pairs)
            if pl.row_pairs.size > XLA_ROW_SUM_SLOTS:
                return _kernel_row_sums(pl, parts)
            return _row_sums(pl, _split_sum(parts))
    return swiglu_rows(pl, activations(recv), w_gate, w_up, w_down, impl=impl, expected_pairs=expected_pairs,
                       mx=(recv.x, recv.sf))


def expert_stage(recv: Received, rank, w_gate, w_up, w_down, *, impl: str = "ragged_dot", max_tokens=None, ranks=None,
                 plan_impl: str | None = None):
    """`swiglu(recv, plan(recv, rank, J, max_tokens=..., ranks=..., impl=plan_impl), ...)` with `J =
    w_down.shape[0]`; `plan_impl` defaults to "kernel" with `impl="kernel"` where `plan_kernel_fits`, else "xla"
    (the same plan); `expected_pairs = max_tokens * K` (each of the N sources sends `max_tokens * K` slots, 1 / N of
    them here under uniform routing)."""
    if plan_impl is None:
        fits = plan_kernel_fits(recv.ids.shape[0], recv.ids.shape[1], w_down.shape[0])
        plan_impl = "kernel" if impl == "kernel" and fits else "xla"
    pl = plan(recv, rank, w_down.shape[0], max_tokens=max_tokens, ranks=ranks, impl=plan_impl)
    rows, k = recv.ids.shape
    mt = max_tokens if max_tokens is not None else rows // (ranks or 1)
    return swiglu(recv, pl, w_gate, w_up, w_down, impl=impl, expected_pairs=mt * k)
