"""EpRowSum: each receive row's weighted sum of its local experts' FP32 outputs, rounded once to bf16 (`out` as
combine takes it), reading only the pairs the row names.

Reading order: settings, the host-side launch signature, the device code, compile. No JAX here.

Parameters: `kernels.abi.ROW_SUM`. CTA `c` takes row `c / chunks` and its columns `(c % chunks) * COLUMNS ..`, four
a thread. Phases:
  1. lane `m` of every warp loads slot `m`'s pair and its weight (one round trip, no barrier): a slot is used when
     its pair is below `count` (one ballot); `n` is one past the last used slot.
  2. over slots `0 .. n - 1` in batches of `BATCH` (each slot's pair and weight shuffled from its lane; a batch's
     outputs loaded before any is added): each pair's output, the FP32 sum of its `num_splits` partials in split
     order (from split 0), then the row's sum from 0 in slot order: `acc + y * weight` for a used slot (`mul.rn`,
     `add.rn`: never an FMA), `acc + 0` for an unused one, and one `acc + 0` for the slots past `n` (all unused:
     adding +0 twice is adding it once). Threads past `num_l` take part in the shuffles, read column 0's values and
     store nothing.
That is `experts._row_sums(plan, experts._split_sum(parts))` bit for bit (docs/experts.md): the same adds in the
same order, a -0 made +0 by an unused slot's zero as there. An unused slot's output is never added (a batch loads
pair 0's in its place: the loads stay unconditional); a row with no used slot is exactly 0.
Registers: a slot's pair lives in its lane (no per-thread slot array), so `CTAS_PER_SM` CTAs fit an SM without
spills (`tests/kernels/test_row_sum.py` reads the cubin's registers): at prefill sizes a CTA's two dependent round
trips are hidden by the other CTAs, not by a batch.
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
    load_v4,
    mul_rn,
    popc,
    shfl_idx,
    store_b32_bf16x2,
)

# ---------------------------------------------------------------------------------------------------------
# Settings

THREADS = 128
#: Columns of one CTA: four a thread (one 16-byte load of each partial).
COLUMNS = abi.ROW_SUM_COLUMNS
#: Slots whose loads one thread issues at once (a row's used slots at decode: K * J / E, 2-8 at Kimi K3).
BATCH = 8
#: CTAs an SM holds at once (ptxas `.minnctapersm`: at most 65536 / (THREADS * CTAS_PER_SM) = 64 registers).
CTAS_PER_SM = 8
#: No shared memory.
SMEM_BYTES = 0

# A slot per lane: one warp's ballot covers every slot.
assert COLUMNS == 4 * THREADS and abi.NUM_MAX_TOPK == 32 and abi.NUM_MAX_TOPK % BATCH == 0


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
            grid=[num_rows, 1, 1], block=[THREADS, 1, 1], smem=SMEM_BYTES, min_blocks_per_mp=CTAS_PER_SM,
            preferred_smem_carveout=-1,
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
        lane = tid % 32
        chunks = (num_l + COLUMNS - 1) // COLUMNS
        row = cta // chunks
        col = (cta % chunks) * COLUMNS + tid * 4
        in_row = col < num_l
        col_read = col
        if col >= num_l:  # past the row: read column 0's (in bounds), store nothing
            col_read = Int32(0)
        griddepcontrol_wait()  # the partials (and the plan before them) come from the previous kernels

        # ---- Phase 1: slot `lane`'s pair (clamped into the partials as XLA's gather is: a corrupt plan reads
        # inside them; an unused slot's is pair 0) and its weight; the used-slot mask and n, the same in every warp.
        slot_row = row_pairs + Int64(row) * Int64(num_slots) * 4
        named = Int32(0x7FFFFFFF)
        if lane < num_slots:
            named = Int32(load_b32(slot_row + Int64(lane) * 4))
        total = Int32(load_b32(count))
        used = Uint32(0)
        pair = Int32(0)
        if named < total:
            used = Uint32(1)
            pair = named
            if pair > num_pairs - 1:
                pair = num_pairs - 1
            if pair < 0:
                pair = Int32(0)
        weight = load_b32(pair_weight + Int64(pair) * 4)
        mask = ballot(used)
        smear = mask | (mask >> Uint32(1))
        smear = smear | (smear >> Uint32(2))
        smear = smear | (smear >> Uint32(4))
        smear = smear | (smear >> Uint32(8))
        smear = smear | (smear >> Uint32(16))
        n = Int32(popc(smear))

        # ---- Phase 2: the row's sum over slots 0 .. n - 1, BATCH slots' output loads at once.
        acc = cute.make_rmem_tensor(cute.make_layout(4), cutlass.Float32)
        acc.fill(0.0)
        y = cute.make_rmem_tensor(cute.make_layout(4 * BATCH), cutlass.Float32)
        w = cute.make_rmem_tensor(cute.make_layout(BATCH), cutlass.Float32)
        pairs = cute.make_rmem_tensor(cute.make_layout(BATCH), cutlass.Int32)
        split_bytes = Int64(num_pairs) * Int64(num_l) * 4
        for b in cutlass.range_constexpr(abi.NUM_MAX_TOPK // BATCH):
            if b * BATCH < n:  # the same in every thread: the shuffles see the full warp
                for j in cutlass.range_constexpr(BATCH):
                    pairs[j] = Int32(shfl_idx(Uint32(pair), Int32(b * BATCH + j)))
                    w[j] = f32_from_bits(shfl_idx(weight, Int32(b * BATCH + j)))
                for j in cutlass.range_constexpr(BATCH):
                    v = load_v4(parts + (Int64(pairs[j]) * Int64(num_l) + Int64(col_read)) * 4)
                    for k in cutlass.range_constexpr(4):
                        y[4 * j + k] = f32_from_bits(v[k])
                # Split partials pair by pair (down is split only where few experts are active): a rolled loop.
                for j in cutlass.range_constexpr(BATCH):
                    src = parts + (Int64(pairs[j]) * Int64(num_l) + Int64(col_read)) * 4
                    y0, y1, y2, y3 = y[4 * j], y[4 * j + 1], y[4 * j + 2], y[4 * j + 3]
                    for s in cutlass.range(1, num_splits, unroll=1):
                        v = load_v4(src + Int64(s) * split_bytes)
                        y0 = add_rn(y0, f32_from_bits(v[0]))
                        y1 = add_rn(y1, f32_from_bits(v[1]))
                        y2 = add_rn(y2, f32_from_bits(v[2]))
                        y3 = add_rn(y3, f32_from_bits(v[3]))
                    y[4 * j], y[4 * j + 1], y[4 * j + 2], y[4 * j + 3] = y0, y1, y2, y3
                for j in cutlass.range_constexpr(BATCH):
                    if b * BATCH + j < n:
                        if (mask >> Uint32(b * BATCH + j)) & Uint32(1) != Uint32(0):
                            for k in cutlass.range_constexpr(4):
                                acc[k] = add_rn(acc[k], mul_rn(y[4 * j + k], w[j]))
                        else:
                            for k in cutlass.range_constexpr(4):
                                acc[k] = add_rn(acc[k], cutlass.Float32(0.0))
        if n < num_slots:
            for k in cutlass.range_constexpr(4):
                acc[k] = add_rn(acc[k], cutlass.Float32(0.0))
        if in_row:
            dst = out + (Int64(row) * Int64(num_l) + Int64(col)) * 2
            store_b32_bf16x2(dst, acc[0], acc[1])
            store_b32_bf16x2(dst + Int64(4), acc[2], acc[3])


# ---------------------------------------------------------------------------------------------------------
# Compile


def compile_row_sum(arch: str = "sm_90a"):
    """Compiles the row-sum kernel for `arch`; returns `(symbol, cubin bytes)`."""
    RowSum.kernel.set_name_prefix(abi.ROW_SUM.symbol, remove_cutlass_symbol=True, keep_mangled_name=False)
    return compile_cubin(abi.ROW_SUM, RowSum(), arch)
