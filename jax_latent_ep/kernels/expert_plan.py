"""EpExpertPlan: the expert stage's plan and the grouped GEMM's work list in one CTA, the same words as the XLA plan
(`experts.plan`, `experts.work_items`) in one launch instead of a chain of small XLA kernels.

Reading order: settings, the host-side launch signature, the device code, compile. No JAX here.

Parameters: `kernels.abi.EXPERT_PLAN`. One CTA of `THREADS`; per-expert counters and per-expert row bitmaps
(`J * ceil(R / 32)` words) live in shared memory. Phases, each ending at a CTA barrier:
  1. rows: a warp takes `32 / P` rows at a time (`P`, the power of two >= K, lanes per row; lane k of a row holds
     slot k). A slot is a pair when its id is local, its row live and no earlier slot of the row names the same
     id (`match.any`); its weight is the FP32 sum, from 0 in ascending slot order, of the row's weights of that
     id (the XLA plan's adds: with no duplicate in the warp that is `0 + w`, else one `add.rn` a slot). A pair
     adds one to its expert's count and sets its row's bit in the expert's bitmap; each slot leaves (expert or
     -1, rank among its row's pairs, weight) in its thread's registers when the rows take one pass of the CTA
     (`R * P <= THREADS`: decode), else appends its pair's (row, expert and rank, weight) to its warp's region of
     `scratch` (the slots of its rows, in row order; the warp counts its pairs in a register, no shared atomic);
     the row's unused `row_pairs` entries get `C`.
  2. scan: exclusive prefix sums of the pairs and of the work items (`2^work_shift` pairs at most) per expert
     (warp shuffles, then one warp over the warp totals); `group_sizes`, `count` and the work list are written
     from them.
  3. slots: a pair's place is its expert's offset plus the rows before its own in the expert's bitmap (a row
     has one pair per expert): the XLA plan's order, expert then row, whatever order the pairs come in (registers,
     or each warp its own `scratch` region). Unused pairs get row 0, expert J, weight 0.
Invariant at every barrier: shared memory holds only what the phases before wrote; every output word is written
once.
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
    atomic_or_shared,
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
#: Words of the per-expert row bitmaps.
BITMAP_WORDS = abi.NUM_PLAN_BITMAP_WORDS
#: Experts each thread scans in phase 2.
EXPERTS_PER_THREAD = NUM_MAX_EXPERTS // THREADS
#: Shared words: counts, pair offsets, work-item offsets (one per expert each), 2 x 32 warp totals, the bitmaps.
SMEM_WORDS = 3 * NUM_MAX_EXPERTS + 2 * 32 + BITMAP_WORDS
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
        work_shift: Int32,
    ):
        self.kernel(ids, weights, src, rank, pair_row, pair_expert, pair_weight, group_sizes, count, row_pairs, work,
                    scratch, num_rows, topk, num_local_experts, rows_per_source, max_tokens, capacity,
                    num_work, work_shift).launch(grid=[1, 1, 1], block=[THREADS, 1, 1], smem=SMEM_BYTES,
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
        work_shift: Int32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        tid = Int32(tid)
        lane = tid % 32
        warp = tid // 32
        smem = cutlass.memory.SmemAllocator()
        words = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(SMEM_BYTES), 16)
        s_count = Uint32(words.iterator.toint())
        s_offset = s_count + Uint32(4 * NUM_MAX_EXPERTS)
        s_chunk = s_offset + Uint32(4 * NUM_MAX_EXPERTS)
        s_warp = s_chunk + Uint32(4 * NUM_MAX_EXPERTS)  # [2, 32]: pairs, then work items, of each warp
        s_bits = s_warp + Uint32(4 * 64)  # [J, ceil(R / 32)]: bit r % 32 of word r / 32: row r has a pair
        j = num_local_experts
        m_slots = topk
        if j < m_slots:
            m_slots = j
        row_words = (num_rows + 31) // 32
        entries = num_rows * topk
        zero = Uint32(0)

        for e in range(tid, NUM_MAX_EXPERTS, THREADS):
            store_shared_b32(s_count + Uint32(4 * e), zero)
        for i in range(tid, j * row_words, THREADS):
            store_shared_b32(s_bits + Uint32(4 * i), zero)
        griddepcontrol_wait()  # ids, weights, src and rank come from the previous kernels
        # Lanes per row: the power of two >= K; a warp takes 32 / lanes rows at a time.
        lanes = Int32(1)
        while lanes < topk:
            lanes = lanes * 2
        seg = lane // lanes
        slot = lane - seg * lanes
        row_slots = (Uint32(1) << Uint32(topk)) - Uint32(1)
        if topk == 32:
            row_slots = Uint32(0xFFFFFFFF)
        row_slots = row_slots << Uint32(seg * lanes)
        below = (Uint32(1) << Uint32(lane)) - Uint32(1)
        rows_per_warp = 32 // lanes
        pass_rows = WARPS * rows_per_warp  # rows of one pass of the CTA
        # One pass over the rows (R <= 1024 / lanes): each thread keeps its slot's (expert or -1, rank, weight) in
        # registers for phase 3 instead of a round trip through `scratch`.
        one_pass = Int32(0)
        if num_rows <= pass_rows:
            one_pass = Int32(1)
        kept_expert = Int32(-1)
        kept_rank = Int32(0)
        kept_weight = Uint32(0)
        kept_row = Int32(0)
        # This warp's `scratch` region: the slots of the rows before its own (warp w takes rows w * rows_per_warp ..
        # of each pass; the last pass's `rest` rows go to the first warps).
        rest = num_rows % pass_rows
        rows_before = warp * rows_per_warp
        if rest < rows_before:
            rows_before = rest
        listed_at = Int64((num_rows // pass_rows) * (warp * rows_per_warp) + rows_before) * Int64(topk)
        listed = Int32(0)  # pairs of this warp in its region (warp-uniform)
        cute.arch.sync_threads()

        # ---- Phase 1: each slot of each row; count each expert's pairs and set their rows' bits.
        for base in range(warp * rows_per_warp, num_rows, pass_rows):
            r = base + seg
            holds = Int32(0)
            if r < num_rows and slot < topk:
                holds = Int32(1)
            # Every load first (they are in flight together), then their uses.
            src_word = Int32(-1)
            slot_id = Int32(-1)
            w_bits = Uint32(0)
            if holds != 0:
                at = (Int64(r) * Int64(topk) + Int64(slot)) * 4
                src_word = Int32(load_b32(src + Int64(r) * 4))
                slot_id = Int32(load_b32(ids + at))
                w_bits = load_b32(weights + at)
            # The rank's word with the row's loads (in flight together; before them it was a round trip alone).
            first_id = Int32(load_b32(rank)) * j
            same = match_any(slot_id) & row_slots
            is_pair = Int32(0)
            repeats = Int32(0)
            if holds != 0 and src_word != Int32(-1) and r % rows_per_source < max_tokens:
                if slot_id >= first_id and slot_id < first_id + j:
                    if (same & below) == zero:
                        is_pair = Int32(1)
                    # Only a live local id's weight is used: an empty row's repeated id (the contract's filler) or
                    # another rank's repeats take no per-slot adds.
                    if popc(same) > Uint32(1):
                        repeats = Int32(1)
            pairs = ballot(is_pair) & row_slots
            # The weight, as the XLA plan adds it: 0 + w for an id named once (adding +0.0 after it changes
            # nothing: the sum is never -0.0), else one add per slot in ascending order.
            coef = add_rn(Float32(0.0), f32_from_bits(w_bits))
            if ballot(repeats) != zero:  # warp-uniform
                coef = Float32(0.0)
                for k in range(topk):
                    other = Int32(shfl_idx(slot_id, seg * lanes + k))
                    w_k = f32_from_bits(shfl_idx(w_bits, seg * lanes + k))
                    add = Float32(0.0)
                    if other == slot_id:
                        add = w_k
                    coef = add_rn(coef, add)
            e = slot_id - first_id
            m = Int32(popc(pairs & below))
            if holds != 0:
                expert_or_none = Int32(-1)
                if is_pair != 0:
                    expert_or_none = e
                    atomic_add_shared(s_count + Uint32(4 * e), Uint32(1))
                    atomic_or_shared(s_bits + Uint32(4 * (e * row_words + r // 32)), Uint32(1) << Uint32(r % 32))
                if one_pass != 0:
                    kept_expert = expert_or_none
                    kept_rank = m
                    kept_weight = bits_from_f32(coef)
                    kept_row = r
                if slot >= Int32(popc(pairs)) and slot < m_slots:
                    store_b32(row_pairs + (Int64(r) * Int64(m_slots) + Int64(slot)) * 4, Uint32(capacity))
            if one_pass == 0:  # CTA-uniform: the warp's pairs go to its region, in lane order
                warp_pairs = ballot(is_pair)
                at = listed_at + Int64(listed + Int32(popc(warp_pairs & below)))
                if is_pair != 0:
                    store_b32(scratch + at * 4, Uint32(r))
                    store_b32(scratch + (Int64(entries) + at) * 4, Uint32(e | (m << 16)))
                    store_b32(scratch + (2 * Int64(entries) + at) * 4, bits_from_f32(coef))
                listed = listed + Int32(popc(warp_pairs))
        cute.arch.sync_threads()

        # ---- Phase 2: exclusive prefix sums of pairs and work items per expert.
        block_m = Int32(1) << work_shift
        first_e = tid * EXPERTS_PER_THREAD
        mine_pairs = Int32(0)
        mine_items = Int32(0)
        for i in cutlass.range_constexpr(EXPERTS_PER_THREAD):
            c = Int32(load_shared_b32(s_count + Uint32(4 * (first_e + i))))
            mine_pairs = mine_pairs + c
            mine_items = mine_items + ((c + (block_m - 1)) >> work_shift)
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
            # Exclusive in place (each lane reads and writes its own word).
            store_shared_b32(s_warp + Uint32(4 * lane), Uint32(w_pairs - v_pairs))
            store_shared_b32(s_warp + Uint32(4 * (32 + lane)), Uint32(w_items - v_items))
            if lane == 31:
                store_b32(count, Uint32(w_pairs))
        cute.arch.sync_threads()
        run_pairs = Int32(load_shared_b32(s_warp + Uint32(4 * warp))) + inc_pairs - mine_pairs
        run_items = Int32(load_shared_b32(s_warp + Uint32(4 * (32 + warp)))) + inc_items - mine_items
        for i in cutlass.range_constexpr(EXPERTS_PER_THREAD):
            c = Int32(load_shared_b32(s_count + Uint32(4 * (first_e + i))))
            store_shared_b32(s_offset + Uint32(4 * (first_e + i)), Uint32(run_pairs))
            store_shared_b32(s_chunk + Uint32(4 * (first_e + i)), Uint32(run_items))
            run_pairs = run_pairs + c
            run_items = run_items + ((c + (block_m - 1)) >> work_shift)
        cute.arch.sync_threads()
        total_pairs = Int32(load_shared_b32(s_offset + Uint32(4 * (NUM_MAX_EXPERTS - 1)))) + Int32(
            load_shared_b32(s_count + Uint32(4 * (NUM_MAX_EXPERTS - 1))))
        last_items = Int32(load_shared_b32(s_chunk + Uint32(4 * (j - 1))))
        last_offset = Int32(load_shared_b32(s_offset + Uint32(4 * (j - 1))))
        total_items = last_items + ((Int32(load_shared_b32(s_count + Uint32(4 * (j - 1)))) + (block_m - 1))
                                    >> work_shift)

        # The work list: each expert's `block_m`-pair chunks in expert order, then items of no pairs (the XLA form:
        # expert J - 1, first pair continuing its chunks).
        for g in range(tid, j, THREADS):
            c = Int32(load_shared_b32(s_count + Uint32(4 * g)))
            store_b32(group_sizes + Int64(g) * 4, Uint32(c))
            item = Int32(load_shared_b32(s_chunk + Uint32(4 * g)))
            first_pair = Int32(load_shared_b32(s_offset + Uint32(4 * g)))
            left = c
            while left > 0:
                rows = left
                if rows > block_m:
                    rows = block_m
                store_v4(work + Int64(item) * 16, (Uint32(g), Uint32(first_pair), Uint32(rows), Uint32(total_items)))
                item = item + 1
                first_pair = first_pair + block_m
                left = left - block_m
        for item in range(total_items + tid, num_work, THREADS):
            first_pair = last_offset + (item - last_items) * block_m
            store_v4(work + Int64(item) * 16, (Uint32(j - 1), Uint32(first_pair), zero, Uint32(total_items)))

        # ---- Phase 3: every pair at its place (expert, then row); unused pairs empty.
        if one_pass != 0:
            if kept_expert >= 0:
                self.place_pair(kept_expert, kept_row, kept_rank, kept_weight, s_bits, s_offset, row_words, m_slots,
                                pair_row, pair_expert, pair_weight, row_pairs)
        else:
            for i in range(lane, listed, 32):  # each warp its own region's pairs
                x = listed_at + Int64(i)
                r = Int32(load_b32(scratch + x * 4))
                em = Int32(load_b32(scratch + (Int64(entries) + x) * 4))
                w_bits = load_b32(scratch + (2 * Int64(entries) + x) * 4)
                self.place_pair(em & 0xFFFF, r, em >> 16, w_bits, s_bits, s_offset, row_words, m_slots, pair_row,
                                pair_expert, pair_weight, row_pairs)
        for p in range(total_pairs + tid, capacity, THREADS):
            store_b32(pair_row + Int64(p) * 4, zero)
            store_b32(pair_expert + Int64(p) * 4, Uint32(j))
            store_b32(pair_weight + Int64(p) * 4, zero)


    @cute.jit
    def place_pair(self, e: Int32, r: Int32, m: Int32, w_bits: Uint32, s_bits: Uint32, s_offset: Uint32,
                   row_words: Int32, m_slots: Int32, pair_row: Int64, pair_expert: Int64, pair_weight: Int64,
                   row_pairs: Int64):
        """Stores the pair of row `r`, local expert `e` (the row's `m`-th pair, weight bits `w_bits`) at its place:
        its expert's offset plus the rows before `r` in the expert's bitmap."""
        bits = s_bits + Uint32(4 * e * row_words)
        place = Int32(load_shared_b32(s_offset + Uint32(4 * e)))
        for wd in range(r // 32):
            place = place + Int32(popc(load_shared_b32(bits + Uint32(4 * wd))))
        own = load_shared_b32(bits + Uint32(4 * (r // 32)))
        place = place + Int32(popc(own & ((Uint32(1) << Uint32(r % 32)) - Uint32(1))))
        store_b32(pair_row + Int64(place) * 4, Uint32(r))
        store_b32(pair_expert + Int64(place) * 4, Uint32(e))
        store_b32(pair_weight + Int64(place) * 4, w_bits)
        store_b32(row_pairs + (Int64(r) * Int64(m_slots) + Int64(m)) * 4, Uint32(place))


#: The cubin's one kernel symbol.
ExpertPlan.kernel.set_name_prefix(abi.EXPERT_PLAN.symbol, remove_cutlass_symbol=True, keep_mangled_name=False)


# ---------------------------------------------------------------------------------------------------------
# Compile


def compile_expert_plan(arch: str = "sm_90a"):
    """Compiles the plan kernel for `arch`; returns `(symbol, cubin bytes)`."""
    return compile_cubin(abi.EXPERT_PLAN, ExpertPlan(), arch)
