"""EpExpertPlan: the expert stage's plan and the grouped GEMM's work list in one CTA, the same words as the XLA plan
(`experts.plan`, `experts.work_items`) in one launch instead of a chain of small XLA kernels.

Reading order: settings, the host-side launch signature, the device code, compile. No JAX here.

Parameters: `kernels.abi.EXPERT_PLAN`. One CTA of `THREADS`; the per-expert counters live in shared memory
(`NUM_MAX_EXPERTS` of them). Phases, each ending at a CTA barrier:
  1. rows, one warp per receive row, lane k holding slot k: a slot is a pair when its id is local, its row live
     and no earlier slot of the row names the same id (`match.any`); its weight is the FP32 sum, from 0 in
     ascending slot order, of the row's weights of that id (as the XLA plan adds them, one `add.rn` a slot). The
     pair's expert counter is incremented; the row's unused `row_pairs` entries get `C`.
  2. scan: exclusive prefix sums of the pairs and of the 64-pair work items per expert (warp shuffles, then one
     warp over the warp totals); `group_sizes`, `count` and the work list are written from them.
  3. rows again: each pair takes a slot of its expert's range (a shared atomic: any order) and leaves its row,
     expert, first-slot rank and weight in `scratch`.
  4. pairs: each pair's place in its expert's range is the number of the range's pairs with a lower row (a
     row has one pair per expert, so the rows of a range are distinct): the XLA plan's order (expert, then row),
     whatever order phase 3 took. Unused pairs get row 0, expert J, weight 0.
Invariant at every barrier: shared counters hold only what the phases before wrote; outputs are written once.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from jax_latent_ep.kernels import abi
from jax_latent_ep.kernels.common import compile_cubin
from jax_latent_ep.kernels.primitives import (
    add_rn,
    atomic_add_shared,
    ballot,
    bits_from_f32,
    f32_from_bits,
    griddepcontrol_wait,
    load_b32,
    load_shared_b32,
    match_any,
    popc,
    shfl_idx,
    shfl_up,
    store_b32,
    store_shared_b32,
    store_v4,
)

# ---------------------------------------------------------------------------------------------------------
# Settings

THREADS = abi.PLAN_THREADS
WARPS = THREADS // 32
#: Local experts the shared counters hold (`num_local_experts` must not exceed it).
NUM_MAX_EXPERTS = abi.NUM_MAX_PLAN_EXPERTS
#: Experts each thread scans in phase 2.
EXPERTS_PER_THREAD = NUM_MAX_EXPERTS // THREADS
#: Pairs of one work item.
BLOCK_M = abi.GEMM_BLOCK_M
#: Shared words: counts, cursors, pair offsets, work-item offsets (one per expert each), 2 x 32 warp totals.
SMEM_WORDS = 4 * NUM_MAX_EXPERTS + 2 * 32
SMEM_BYTES = 4 * SMEM_WORDS

assert NUM_MAX_EXPERTS % THREADS == 0 and abi.NUM_MAX_TOPK == 32 and abi.GEMM_WORK_WORDS == 4


def smem_bytes() -> int:
    """Dynamic shared memory bytes the launcher passes."""
    return SMEM_BYTES


# ---------------------------------------------------------------------------------------------------------
# Launch / host signature (`abi.EXPERT_PLAN`): this host function exists only to compile the kernel; the C++ FFI
# launches the cubin with one CTA.


class ExpertPlan:
    """The plan kernel (every size a run-time parameter); `compile_expert_plan` builds it."""

    @cute.jit
    def launch(
        self,
        ids: Int64,
        weights: Int64,
        src: Int64,
        rank: Int64,
        pair_row: Int64,
        pair_expert: Int64,
        pair_weight: Int64,
        group_sizes: Int64,
        count: Int64,
        row_pairs: Int64,
        work: Int64,
        scratch: Int64,
        num_rows: Int32,
        topk: Int32,
        num_local_experts: Int32,
        rows_per_source: Int32,
        max_tokens: Int32,
        capacity: Int32,
        num_work: Int32,
    ):
        self.kernel(ids, weights, src, rank, pair_row, pair_expert, pair_weight, group_sizes, count, row_pairs, work,
                    scratch, num_rows, topk, num_local_experts, rows_per_source, max_tokens, capacity,
                    num_work).launch(grid=[1, 1, 1], block=[THREADS, 1, 1], smem=SMEM_BYTES,
                                     preferred_smem_carveout=-1)

    # -----------------------------------------------------------------------------------------------------
    # Device code

    @cute.kernel
    def kernel(
        self,
        ids: Int64,
        weights: Int64,
        src: Int64,
        rank: Int64,
        pair_row: Int64,
        pair_expert: Int64,
        pair_weight: Int64,
        group_sizes: Int64,
        count: Int64,
        row_pairs: Int64,
        work: Int64,
        scratch: Int64,
        num_rows: Int32,
        topk: Int32,
        num_local_experts: Int32,
        rows_per_source: Int32,
        max_tokens: Int32,
        capacity: Int32,
        num_work: Int32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        tid = Int32(tid)
        lane = tid % 32
        warp = tid // 32
        smem = cutlass.memory.SmemAllocator()
        words = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(SMEM_BYTES), 16)
        s_count = Uint32(words.iterator.toint())
        s_cursor = s_count + Uint32(4 * NUM_MAX_EXPERTS)
        s_offset = s_cursor + Uint32(4 * NUM_MAX_EXPERTS)
        s_chunk = s_offset + Uint32(4 * NUM_MAX_EXPERTS)
        s_warp = s_chunk + Uint32(4 * NUM_MAX_EXPERTS)  # [2, 32]: pairs, then work items, of each warp
        j = num_local_experts
        m_slots = topk
        if j < m_slots:
            m_slots = j
        zero = Uint32(0)

        for e in range(tid, NUM_MAX_EXPERTS, THREADS):
            store_shared_b32(s_count + Uint32(4 * e), zero)
            store_shared_b32(s_cursor + Uint32(4 * e), zero)
        griddepcontrol_wait()  # ids, weights, src and rank come from the previous kernels
        first_id = Int32(load_b32(rank)) * j
        cute.arch.sync_threads()

        # ---- Phase 1: count each expert's pairs; fill the rows' unused row_pairs entries.
        for r in range(warp, num_rows, WARPS):
            e, first, m, nfirst, coef = self.row_slot(ids, weights, src, r, lane, topk, first_id, j,
                                                      rows_per_source, max_tokens)
            if first:
                atomic_add_shared(s_count + Uint32(4 * e), Uint32(1))
            if lane >= nfirst and lane < m_slots:
                store_b32(row_pairs + (Int64(r) * Int64(m_slots) + Int64(lane)) * 4, Uint32(capacity))
        cute.arch.sync_threads()

        # ---- Phase 2: exclusive prefix sums of pairs and work items per expert.
        base = tid * EXPERTS_PER_THREAD
        mine_pairs = Int32(0)
        mine_items = Int32(0)
        for i in cutlass.range_constexpr(EXPERTS_PER_THREAD):
            c = Int32(load_shared_b32(s_count + Uint32(4 * (base + i))))
            mine_pairs = mine_pairs + c
            mine_items = mine_items + (c + (BLOCK_M - 1)) // BLOCK_M
        inc_pairs = mine_pairs
        inc_items = mine_items
        for sh in cutlass.range_constexpr(5):
            up_pairs = Int32(shfl_up(inc_pairs, 1 << sh))
            up_items = Int32(shfl_up(inc_items, 1 << sh))
            if lane >= (1 << sh):
                inc_pairs = inc_pairs + up_pairs
                inc_items = inc_items + up_items
        if lane == 31:
            store_shared_b32(s_warp + Uint32(4 * warp), Uint32(inc_pairs))
            store_shared_b32(s_warp + Uint32(4 * (32 + warp)), Uint32(inc_items))
        cute.arch.sync_threads()
        if warp == 0:
            v_pairs = Int32(load_shared_b32(s_warp + Uint32(4 * lane)))
            v_items = Int32(load_shared_b32(s_warp + Uint32(4 * (32 + lane))))
            w_pairs = v_pairs
            w_items = v_items
            for sh in cutlass.range_constexpr(5):
                up_pairs = Int32(shfl_up(w_pairs, 1 << sh))
                up_items = Int32(shfl_up(w_items, 1 << sh))
                if lane >= (1 << sh):
                    w_pairs = w_pairs + up_pairs
                    w_items = w_items + up_items
            # Exclusive in place (each lane reads and writes its own word); totals stay in lane 31.
            store_shared_b32(s_warp + Uint32(4 * lane), Uint32(w_pairs - v_pairs))
            store_shared_b32(s_warp + Uint32(4 * (32 + lane)), Uint32(w_items - v_items))
            if lane == 31:
                store_b32(count, Uint32(w_pairs))
        cute.arch.sync_threads()
        run_pairs = Int32(load_shared_b32(s_warp + Uint32(4 * warp))) + inc_pairs - mine_pairs
        run_items = Int32(load_shared_b32(s_warp + Uint32(4 * (32 + warp)))) + inc_items - mine_items
        for i in cutlass.range_constexpr(EXPERTS_PER_THREAD):
            c = Int32(load_shared_b32(s_count + Uint32(4 * (base + i))))
            store_shared_b32(s_offset + Uint32(4 * (base + i)), Uint32(run_pairs))
            store_shared_b32(s_chunk + Uint32(4 * (base + i)), Uint32(run_items))
            run_pairs = run_pairs + c
            run_items = run_items + (c + (BLOCK_M - 1)) // BLOCK_M
        cute.arch.sync_threads()
        total_pairs = Int32(load_shared_b32(s_offset + Uint32(4 * (NUM_MAX_EXPERTS - 1)))) + Int32(
            load_shared_b32(s_count + Uint32(4 * (NUM_MAX_EXPERTS - 1))))
        last_items = Int32(load_shared_b32(s_chunk + Uint32(4 * (j - 1))))
        last_offset = Int32(load_shared_b32(s_offset + Uint32(4 * (j - 1))))
        total_items = last_items + (Int32(load_shared_b32(s_count + Uint32(4 * (j - 1)))) + (BLOCK_M - 1)) // BLOCK_M

        # The work list: each expert's 64-pair chunks in expert order, then items of no pairs (the XLA form:
        # expert J - 1, first pair continuing its chunks).
        for g in range(tid, j, THREADS):
            c = Int32(load_shared_b32(s_count + Uint32(4 * g)))
            store_b32(group_sizes + Int64(g) * 4, Uint32(c))
            item = Int32(load_shared_b32(s_chunk + Uint32(4 * g)))
            first_pair = Int32(load_shared_b32(s_offset + Uint32(4 * g)))
            left = c
            while left > 0:
                rows = left
                if rows > BLOCK_M:
                    rows = BLOCK_M
                store_v4(work + Int64(item) * 16, (Uint32(g), Uint32(first_pair), Uint32(rows), zero))
                item = item + 1
                first_pair = first_pair + BLOCK_M
                left = left - BLOCK_M
        for item in range(total_items + tid, num_work, THREADS):
            first_pair = last_offset + (item - last_items) * BLOCK_M
            store_v4(work + Int64(item) * 16, (Uint32(j - 1), Uint32(first_pair), zero, zero))

        # ---- Phase 3: each pair takes a slot of its expert's range.
        cap = Int64(capacity)
        for r in range(warp, num_rows, WARPS):
            e, first, m, nfirst, coef = self.row_slot(ids, weights, src, r, lane, topk, first_id, j,
                                                      rows_per_source, max_tokens)
            if first:
                p = Int64(Int32(load_shared_b32(s_offset + Uint32(4 * e)))
                          + Int32(atomic_add_shared(s_cursor + Uint32(4 * e), Uint32(1))))
                store_b32(scratch + p * 4, Uint32(r))
                store_b32(scratch + (cap + p) * 4, Uint32(e))
                store_b32(scratch + (2 * cap + p) * 4, Uint32(m))
                store_b32(scratch + (3 * cap + p) * 4, bits_from_f32(coef))
        cute.arch.sync_threads()

        # ---- Phase 4: every pair at its place (expert, then row); unused pairs empty.
        for p in range(tid, capacity, THREADS):
            if p < total_pairs:
                q = Int64(p)
                r = Int32(load_b32(scratch + q * 4))
                e = Int32(load_b32(scratch + (cap + q) * 4))
                m = Int32(load_b32(scratch + (2 * cap + q) * 4))
                w_bits = load_b32(scratch + (3 * cap + q) * 4)
                start = Int32(load_shared_b32(s_offset + Uint32(4 * e)))
                size = Int32(load_shared_b32(s_count + Uint32(4 * e)))
                place = start
                for o in range(start, start + size):
                    if Int32(load_b32(scratch + Int64(o) * 4)) < r:
                        place = place + 1
                store_b32(pair_row + Int64(place) * 4, Uint32(r))
                store_b32(pair_expert + Int64(place) * 4, Uint32(e))
                store_b32(pair_weight + Int64(place) * 4, w_bits)
                store_b32(row_pairs + (Int64(r) * Int64(m_slots) + Int64(m)) * 4, Uint32(place))
            else:
                store_b32(pair_row + Int64(p) * 4, zero)
                store_b32(pair_expert + Int64(p) * 4, Uint32(j))
                store_b32(pair_weight + Int64(p) * 4, zero)

    @cute.jit
    def row_slot(self, ids: Int64, weights: Int64, src: Int64, r: Int32, lane: Int32, topk: Int32, first_id: Int32,
                 j: Int32, rows_per_source: Int32, max_tokens: Int32):
        """Warp-wide, lane k for slot k of row `r`: `(local expert, is the row's pair of it, its rank among the
        row's pairs in slot order, the row's pairs, its weight)`; lanes >= K hold no slot."""
        live = Int32(0)
        if Int32(load_b32(src + Int64(r) * 4)) != Int32(-1) and r % rows_per_source < max_tokens:
            live = Int32(1)
        slot_id = Int32(-1)
        w_bits = Uint32(0)
        if lane < topk:
            slot_id = Int32(load_b32(ids + (Int64(r) * Int64(topk) + Int64(lane)) * 4))
            w_bits = load_b32(weights + (Int64(r) * Int64(topk) + Int64(lane)) * 4)
        slots = (Uint32(1) << Uint32(topk)) - Uint32(1)
        if topk == 32:
            slots = Uint32(0xFFFFFFFF)
        below = (Uint32(1) << Uint32(lane)) - Uint32(1)
        same = match_any(slot_id) & slots
        is_pair = Int32(0)
        if lane < topk and live != 0 and slot_id >= first_id and slot_id < first_id + j:
            if same & below == Uint32(0):
                is_pair = Int32(1)
        pairs = ballot(is_pair)
        # The weight: FP32 from 0, one add per slot in ascending order (0 where the slot names another id).
        coef = Float32(0.0)
        for k in range(topk):
            other = Int32(shfl_idx(slot_id, k))
            w_k = f32_from_bits(shfl_idx(w_bits, k))
            add = Float32(0.0)
            if other == slot_id:
                add = w_k
            coef = add_rn(coef, add)
        return slot_id - first_id, is_pair != 0, Int32(popc(pairs & below)), Int32(popc(pairs)), coef


#: The cubin's one kernel symbol.
ExpertPlan.kernel.set_name_prefix(abi.EXPERT_PLAN.symbol, remove_cutlass_symbol=True, keep_mangled_name=False)


# ---------------------------------------------------------------------------------------------------------
# Compile


def compile_expert_plan(arch: str = "sm_90a"):
    """Compiles the plan kernel for `arch`; returns `(symbol, cubin bytes)`."""
    return compile_cubin(abi.EXPERT_PLAN, ExpertPlan(), arch)
