"""The expert stage's plan: the (row, local expert) pairs of a rank's receive rows, by XLA ops or the plan kernel."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_latent_ep import host_checks
from jax_latent_ep.kernels import abi
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
      dropped: int32 `[]`, the pairs past a `capacity_factor`'s capacity left out (`overflow="drop"`; 0 when none
        were), or None for a worst-case plan (none can be).
    """

    row: jax.Array
    expert: jax.Array
    weight: jax.Array
    group_sizes: jax.Array
    count: jax.Array
    row_pairs: jax.Array
    work: jax.Array | None = None
    dropped: jax.Array | None = None

    @property
    def capacity(self) -> int:
        return int(self.row.shape[0])

    @property
    def num_local_experts(self) -> int:
        return int(self.group_sizes.shape[0])


def capacity(ranks: int, max_tokens: int, topk: int, num_local_experts: int, factor: float | None = None) -> int:
    """Pairs a rank's plan holds: the worst case `N * max_tokens * min(K, J)` (every pair one rank's receive rows
    can hold), or with `factor` that many times the uniform expectation, `ceil(factor * max_tokens * K)` pairs (each
    of the N sources sends `max_tokens * K` slots, 1 / N of them here), at most the worst case."""
    worst = ranks * max_tokens * min(topk, num_local_experts)
    if factor is None:
        return worst
    return max(1, min(worst, math.ceil(factor * max_tokens * topk)))


#: What a plan does with the pairs past its capacity (`plan(overflow=...)`): "error" raises a `CapacityError` naming
#: the rank and the counts where the step's result is read (a device-host round trip per plan); "drop" keeps the
#: capacity's first pairs in expert order, leaves the rest out of the sums and counts them (`Plan.dropped`).
OVERFLOW_POLICIES = ("error", "drop")


class CapacityError(host_checks.HostCheckError):
    """More pairs reached a rank than its plan's capacity (`plan(capacity_factor=..., overflow="error")`)."""


def _check_capacity_host(count, rank, cap: int, factor):
    """Raises `CapacityError` if this rank's `count` of pairs (an array under `jax.vmap`) exceeds `cap`."""
    count, rank = np.asarray(count), np.asarray(rank)
    over = np.flatnonzero(count.reshape(-1) > cap)
    if over.size:
        i = int(over[0])
        host_checks.fail(CapacityError(
            f"experts.plan: {int(count.reshape(-1)[i])} pairs reached rank {int(np.broadcast_to(rank, count.shape)
            .reshape(-1)[i])}, over its capacity of {cap} (capacity_factor={factor}); raise capacity_factor, give "
            "None for the worst case, or pass overflow='drop' to leave the excess out and count it"))
    return np.zeros(count.shape, np.int32)


#: How a plan is built: "xla" (XLA ops, every platform) or "kernel" (the plan kernel, `kernels/expert_plan.py`, one
#: launch on NVIDIA GPUs: the same words, and the work list with them).
PLAN_IMPLEMENTATIONS = ("xla", "kernel")


def plan_blocks(rows: int, num_local_experts: int, max_tokens: int | None = None, ranks: int | None = None):
    """`(N, S, max_tokens)`: the source blocks, their rows and the planned rows of each of `plan`'s `rows` receive
    rows, from its arguments of the same names (checked)."""
    from jax_latent_ep.layout import stride

    if int(num_local_experts) < 1:
        raise ValueError(f"num_local_experts={num_local_experts} must be >= 1")
    if ranks is None:
        ranks = rows // stride(max_tokens) if max_tokens is not None else 1
    if rows % ranks:
        raise ValueError(f"{rows} receive rows do not split into ranks={ranks} source blocks")
    s_rows = rows // ranks
    mt = s_rows if max_tokens is None else int(max_tokens)
    if not 1 <= mt <= s_rows:
        raise ValueError(f"max_tokens={max_tokens} must be in [1, S={s_rows}]")
    return ranks, s_rows, mt


def plan(recv: Received, rank, num_local_experts: int, *, max_tokens: int | None = None, ranks: int | None = None,
         impl: str = "xla", capacity_factor: float | None = None, overflow: str = "error",
         work_pairs: int = abi.GEMM_BLOCK_M) -> Plan:
    """The plan of this rank's received rows (traced inside the `shard_map`, or anywhere on a `Received`).

    Args:
      recv: the rank's `Received` (`[N*S, ...]` rows); only `ids`, `weights` and `src` are read.
      rank: int32 scalar (traced or static), this rank's index on the expert-parallel axis.
      num_local_experts: `J = E / N`; an id is local when `id // J == rank`.
      max_tokens: the `ExpertParallel`'s `max_tokens` (rows `t >= max_tokens` of every source block are
        empty by the contract and are not planned); default `S`, i.e. every row.
      ranks: `N`, the number of source blocks of `recv`; default `N*S / S` with `S = stride(max_tokens)` when
        `max_tokens` is given, else 1 (one block of all rows).
      impl: one of `PLAN_IMPLEMENTATIONS`; "kernel" runs on NVIDIA GPUs, where `plan_kernel_fits`, at the worst
        case's capacity only.
      capacity_factor: None (the worst case: nothing can overflow), or the capacity as a multiple of the uniform
        expectation of `max_tokens * K` pairs a rank (`capacity`): every buffer of the stage follows it.
      overflow: one of `OVERFLOW_POLICIES`, what the pairs past a `capacity_factor`'s capacity meet.
      work_pairs: the pairs of one item of the kernel's work list, one of `abi.PLAN_WORK_PAIRS`: that of the
        kernel that reads it (`work_list`); `impl="kernel"` only.

    Returns:
      A `Plan` of capacity `capacity(N, max_tokens, K, J, capacity_factor)` (with its work list when
      `impl="kernel"`; with `capacity_factor`, `dropped`).
    """
    rows, k = recv.ids.shape
    j = int(num_local_experts)
    ranks, s_rows, mt = plan_blocks(rows, num_local_experts, max_tokens, ranks)
    m = min(k, j)
    if capacity_factor is not None and not (isinstance(capacity_factor, (int, float)) and capacity_factor > 0):
        raise ValueError(f"experts.plan: capacity_factor={capacity_factor!r} must be a positive number or None")
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"experts.plan: overflow={overflow!r} must be one of {OVERFLOW_POLICIES}")
    cap = capacity(ranks, mt, k, j, capacity_factor)
    worst = cap == capacity(ranks, mt, k, j)
    if impl not in PLAN_IMPLEMENTATIONS:
        raise ValueError(f"experts.plan: impl={impl!r} must be one of {PLAN_IMPLEMENTATIONS}")
    if work_pairs not in abi.PLAN_WORK_PAIRS:
        raise ValueError(f"experts.plan: work_pairs={work_pairs!r} must be one of {abi.PLAN_WORK_PAIRS}")
    if impl == "kernel":
        if not worst:
            raise ValueError(f"experts.plan(impl='kernel') plans the worst case's {capacity(ranks, mt, k, j)} pairs; "
                             f"capacity_factor={capacity_factor} ({cap} pairs) needs impl='xla'")
        return _plan_kernel(recv, rank, j, s_rows, mt, cap, work_pairs)
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
    group_sizes = jnp.zeros((j + 1,), jnp.int32).at[pair_expert].add(1)[:j]  # the kept pairs'
    total = jnp.sum(flat_first, dtype=jnp.int32)
    count = jnp.minimum(total, cap)
    dropped = None
    if not worst:
        dropped = total - count
        if overflow == "error":  # a data dependency on the count keeps the check
            count = count + jax.pure_callback(
                functools.partial(_check_capacity_host, cap=cap, factor=capacity_factor),
                jax.ShapeDtypeStruct((), jnp.int32), total, rank, vmap_method="broadcast_all")

    # The way back: the pair index of every (row, slot), then each row's pairs in ascending first slot.
    pos = jnp.full((rows * k,), cap, jnp.int32).at[order].set(jnp.arange(cap, dtype=jnp.int32), unique_indices=True)
    pos = jnp.where(flat_first, pos, cap).reshape(rows, k)
    slots = jnp.argsort(~first, axis=1, stable=True)[:, :m]  # the row's first slots, ascending k
    row_pairs = jnp.take_along_axis(pos, slots, axis=1)
    row_pairs = jnp.where(jnp.take_along_axis(first, slots, axis=1), row_pairs, cap)
    return Plan(pair_row, pair_expert, pair_weight, group_sizes, count, row_pairs.astype(jnp.int32),
                dropped=dropped)


def work_items(pl: Plan, block_m: int = abi.GEMM_BLOCK_M):
    """int32 `[W, 4]` work list of the grouped GEMM kernel (and of the "scan" implementation): `chunks` of the plan's
    group sizes, `block_m` pairs at most, `W = min(J, C) + C // block_m`."""
    return chunks(pl.group_sizes, pl.capacity, block_m)


def work_list(pl: Plan, block_m: int):
    """`work_items(pl, block_m)` for a kernel: the plan kernel's list where it is one of that length (no launch),
    else built in XLA. Two blocks of one length `W` make the same non-empty items (`W` equal for blocks `a < b`
    means `C < a`: every group one item under either), and the kernels read no item past those (word 3)."""
    if pl.work is not None and pl.work.shape[0] == min(pl.num_local_experts, pl.capacity) + pl.capacity // block_m:
        return pl.work
    return work_items(pl, block_m)


def chunks(group_sizes, num_rows: int, block_m: int):
    """int32 `[W, 4]`: `(group, first row, rows <= block_m, items)` for each `block_m`-chunk of each non-empty group
    of `group_sizes` (int32 `[G]`, rows sorted by group, `sum <= num_rows`) in group order, then `(., ., 0, items)`
    (nothing to do); `items`, the same in every row, is the number of non-empty ones. `W = min(G, num_rows) +
    num_rows // block_m`, a static bound: a group of `s > 0` rows takes `ceil(s / block_m) <= 1 + (s - 1) //
    block_m` chunks. The work lists of the grouped GEMM (`work_items`) and of the wgmma grouped matmul."""
    gs = group_sizes
    j = gs.shape[0]
    num_work = min(j, num_rows) + num_rows // block_m
    per = (gs + block_m - 1) // block_m
    incl = jnp.cumsum(per)
    offsets = jnp.cumsum(gs) - gs
    w = jnp.arange(num_work, dtype=jnp.int32)
    # compare_all: one fused comparison (the default method is a loop, a device-host round trip per step on GPUs)
    g = jnp.minimum(jnp.searchsorted(incl, w, side="right", method="compare_all"), j - 1).astype(jnp.int32)
    m = w - (incl[g] - per[g])
    rows = jnp.where(w < incl[-1], jnp.clip(gs[g] - m * block_m, 0, block_m), 0)
    items = jnp.broadcast_to(incl[-1], g.shape)
    return jnp.stack([g, offsets[g] + m * block_m, rows, items], axis=1).astype(jnp.int32)


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


def _plan_kernel(recv: Received, rank, j: int, s_rows: int, mt: int, cap: int, work_pairs: int) -> Plan:
    """`plan` by the plan kernel (one launch; the XLA plan's words, and the work list of `work_pairs`-pair items)."""
    from jax_latent_ep.runtime import ffi

    rows, k = recv.ids.shape
    if not plan_kernel_fits(rows, k, j):
        raise ValueError(f"experts.plan(impl='kernel') takes J <= {abi.NUM_MAX_PLAN_EXPERTS} local experts, K <= "
                         f"{abi.NUM_MAX_TOPK} ids and J * ceil(R / 32) <= {abi.NUM_PLAN_BITMAP_WORDS}, got J={j}, "
                         f"K={k}, R={rows}: use impl='xla'")
    ffi.load_expert_kernels(_gpus("experts.plan(impl='kernel')"))
    num_work = min(j, cap) + cap // work_pairs  # `chunks`' bound
    rank = jnp.asarray(rank, jnp.int32).reshape(1)
    row, expert, weight, sizes, count, row_pairs, work = ffi.expert_plan_call(
        recv.ids.astype(jnp.int32), recv.weights.astype(jnp.float32), recv.src.astype(jnp.int32), rank,
        capacity=cap, num_local_experts=j, num_work=num_work, rows_per_source=s_rows, max_tokens=mt,
        work_pairs=work_pairs)
    from jax_latent_ep.autodiff import _axes, _vary

    # a custom call's results take its operands' varying axes (as the XLA plan's would, in a checked shard_map)
    axes = _axes(recv.ids, recv.weights, recv.src, rank)
    return Plan(*(_vary(a, axes) for a in (row, expert, weight, sizes, count[0], row_pairs, work)))
