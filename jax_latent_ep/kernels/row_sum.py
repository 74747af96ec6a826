"""EpRowSum: each receive row's weighted sum of its local experts' FP32 outputs, rounded once to bf16 (`out` as
combine takes it), reading only the pairs the row names.

Reading order: settings, the host-side launch signature, the device code, compile. No JAX here.

Parameters: `kernels.abi.ROW_SUM`. CTA `c` takes row `c / chunks` and its columns `(c % chunks) * COLUMNS ..`, four
a thread. Phases:
  1. warp 0: lane `m < M` loads the row's m-th pair, whether it is used (`pair < count`) and its weight into shared
     memory; `n`, one past the last used slot, by a warp max. Barrier.
  2. every thread, over slots `0 .. n - 1` in batches of `BATCH` (a batch's loads issued before any is added): each
     pair's output, the FP32 sum of its `num_splits` partials in split order (from split 0), then the row's sum
     from 0 in slot order: `acc + y * weight` for a used slot (`mul.rn`, `add.rn`: never an FMA), `acc + 0` for an
     unused one, and one `acc + 0` for the slots past `n` (all unused: adding +0 twice is adding it once).
That is `experts._row_sums(plan, experts._split_sum(parts))` bit for bit (docs/experts.md): the same adds in the
same order, a -0 made +0 by an unused slot's zero as there. An unused slot reads nothing; a row with no used slot
is exactly 0.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from jax_latent_ep.kernels import abi
from jax_latent_ep.kernels.common import compile_cubin
from jax_latent_ep.kernels.primitives import (
    add_rn,
    ballot,
    f32_from_bits,
    griddepcontrol_wait,
    load_b32,
    load_shared_b32,
    load_v4,
    mul_rn,
    shfl_bfly,
    store_b32_bf16x2,
    store_shared_b32,
)

# ---------------------------------------------------------------------------------------------------------
# Settings

THREADS = 128
#: Columns of one CTA: four a thread (one 16-byte load of each partial).
COLUMNS = abi.ROW_SUM_COLUMNS
#: Slots whose loads one thread issues at once (a row's used slots at decode: K * J / E, 2-8 at Kimi K3).
BATCH = 8
#: Shared words: the row's pairs, their weights, then `n` and the used-slot mask.
SMEM_BYTES = 4 * (2 * abi.NUM_MAX_TOPK + 2)

assert COLUMNS == 4 * THREADS and abi.NUM_MAX_TOPK == 32


def smem_bytes() -> int:
    """Dynamic shared memory bytes the launcher passes."""
    return SMEM_BYTES


# ---------------------------------------------------------------------------------------------------------
# Launch / host signature (`abi.ROW_SUM`): this host function exists only to compile the kernel; the C++ FFI
# launches the cubin with its own grid.


class RowSum:
    """The row-sum kernel (every size a run-time parameter); `compile_row_sum` builds it."""

    @cute.jit
    def launch(
        self,
        parts: Int64,
        row_pairs: Int64,
        pair_weight: Int64,
        count: Int64,
        out: Int64,
        num_splits: Int32,
        num_pairs: Int32,
        num_rows: Int32,
        num_slots: Int32,
        num_l: Int32,
    ):
        self.kernel(parts, row_pairs, pair_weight, count, out, num_splits, num_pairs, num_rows, num_slots,
                    num_l).launch(
            # The FFI handler sets the grid: num_rows * ceil(num_l / COLUMNS).
            grid=[num_rows, 1, 1], block=[THREADS, 1, 1], smem=SMEM_BYTES, preferred_smem_carveout=-1,
        )

    # -----------------------------------------------------------------------------------------------------
    # Device code

    @cute.kernel
    def kernel(
        self,
        parts: Int64,
        row_pairs: Int64,
        pair_weight: Int64,
        count: Int64,
        out: Int64,
        num_splits: Int32,
        num_pairs: Int32,
        num_rows: Int32,
        num_slots: Int32,
        num_l: Int32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        tid = Int32(tid)
        cta = Int32(cta)
        smem = cutlass.memory.SmemAllocator()
        words = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(SMEM_BYTES), 16)
        s_pair = Uint32(words.iterator.toint())
        s_weight = s_pair + Uint32(4 * abi.NUM_MAX_TOPK)
        s_n = s_weight + Uint32(4 * abi.NUM_MAX_TOPK)
        s_used = s_n + Uint32(4)
        chunks = (num_l + COLUMNS - 1) // COLUMNS
        row = cta // chunks
        col = (cta % chunks) * COLUMNS + tid * 4
        griddepcontrol_wait()  # the partials (and the plan before them) come from the previous kernels

        # ---- Phase 1: the row's slots (warp 0, lane m: slot m).
        if tid < 32:
            pair = Int32(0)
            w_bits = Uint32(0)
            used = Int32(0)
            if tid < num_slots:
                named = Int32(load_b32(row_pairs + (Int64(row) * Int64(num_slots) + Int64(tid)) * 4))
                total = Int32(load_b32(count))
                if named < total:
                    used = Int32(1)
                    # Clamped into the partials as XLA's gather is: a corrupt plan reads inside them.
                    pair = named
                    if pair > num_pairs - 1:
                        pair = num_pairs - 1
                    if pair < 0:
                        pair = Int32(0)
                    w_bits = load_b32(pair_weight + Int64(pair) * 4)
            mask = ballot(used != 0)
            last = Uint32(0)
            if used != 0:
                last = Uint32(tid + 1)
            for offset in cutlass.range_constexpr(5):
                other = shfl_bfly(last, 1 << offset)
                if other > last:
                    last = other
            store_shared_b32(s_pair + Uint32(4 * tid), Uint32(pair))
            store_shared_b32(s_weight + Uint32(4 * tid), w_bits)
            if tid == 0:
                store_shared_b32(s_n, last)
                store_shared_b32(s_used, mask)
        cute.arch.sync_threads()

        # ---- Phase 2: the row's sum over slots 0 .. n - 1, BATCH pairs' loads at once.
        n = Int32(load_shared_b32(s_n))
        mask = load_shared_b32(s_used)
        if col < num_l:
            acc = cute.make_rmem_tensor(cute.make_layout(4), cutlass.Float32)
            acc.fill(0.0)
            y = cute.make_rmem_tensor(cute.make_layout(4 * BATCH), cutlass.Float32)
            split_bytes = Int64(num_pairs) * Int64(num_l) * 4
            for m0 in range(0, n, BATCH):
                for j in cutlass.range_constexpr(BATCH):
                    m = m0 + j
                    if m > n - 1:
                        m = n - 1  # a repeated load, not added: the loads stay unconditional
                    pair = Int32(load_shared_b32(s_pair + Uint32(4 * m)))
                    v = load_v4(parts + (Int64(pair) * Int64(num_l) + Int64(col)) * 4)
                    for k in cutlass.range_constexpr(4):
                        y[4 * j + k] = f32_from_bits(v[k])
                for s in range(1, num_splits):
                    for j in cutlass.range_constexpr(BATCH):
                        m = m0 + j
                        if m > n - 1:
                            m = n - 1
                        pair = Int32(load_shared_b32(s_pair + Uint32(4 * m)))
                        v = load_v4(parts + Int64(s) * split_bytes + (Int64(pair) * Int64(num_l) + Int64(col)) * 4)
                        for k in cutlass.range_constexpr(4):
                            y[4 * j + k] = add_rn(y[4 * j + k], f32_from_bits(v[k]))
                for j in cutlass.range_constexpr(BATCH):
                    m = m0 + j
                    if m < n:
                        if (mask >> Uint32(m)) & Uint32(1) != Uint32(0):
                            w = f32_from_bits(load_shared_b32(s_weight + Uint32(4 * m)))
                            for k in cutlass.range_constexpr(4):
                                acc[k] = add_rn(acc[k], mul_rn(y[4 * j + k], w))
                        else:
                            for k in cutlass.range_constexpr(4):
                                acc[k] = add_rn(acc[k], cutlass.Float32(0.0))
            if n < num_slots:
                for k in cutlass.range_constexpr(4):
                    acc[k] = add_rn(acc[k], cutlass.Float32(0.0))
            dst = out + (Int64(row) * Int64(num_l) + Int64(col)) * 2
            store_b32_bf16x2(dst, acc[0], acc[1])
            store_b32_bf16x2(dst + Int64(4), acc[2], acc[3])


# ---------------------------------------------------------------------------------------------------------
# Compile


def compile_row_sum(arch: str = "sm_90a"):
    """Compiles the row-sum kernel for `arch`; returns `(symbol, cubin bytes)`."""
    RowSum.kernel.set_name_prefix(abi.ROW_SUM.symbol, remove_cutlass_symbol=True, keep_mangled_name=False)
    return compile_cubin(abi.ROW_SUM, RowSum(), arch)
