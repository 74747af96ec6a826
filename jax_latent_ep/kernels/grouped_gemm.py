"""EpGroupedGemm: the expert stage's grouped GEMM at decode sizes, `out = a @ w[group]` per work item, streaming each
group's weights from HBM once.

Reading order: settings, the host-side launch signature, the device code, compile. No JAX here.

Parameters: `kernels.abi.GROUPED_GEMM`. A unit `(split, work item, column tile)` is the work item's rows (at most
`BLOCK_M` pairs of one group, listed by the caller; each read through `a_rows` when it is given) times a
`k_per_split x BLOCK_N` slice of the group's weights: 64 columns of `w`, and with `w_second` (gate and up in one
launch) the same 64 columns of `w_second`, in alternate stages of the ring (each weight row a whole 128-byte line:
HBM streams those at full rate, half lines of two weights not). It stores FP32 partials, or with `fuse_glu` (one
split) `bf16(silu(gate) * up)` straight from the accumulators (each warp holds both of its 16 columns).
The grid is 1-D and at most the CTAs that fit on the device at once; of it the fewest CTAs `G` that need as many rounds
(`ceil(units / grid)`) as all of them compute, CTA `c < G` the units `u = c, c + G, ..`,
`u = (split * num_items + item) * column_tiles + tile` (consecutive units read neighbouring columns of the same weight
rows), over the `num_items` non-empty work items only (word 3 of the work list; they come first): no CTA is spent on
the capacity's empty items.

Decode sizes make it a weight stream: a group has a few rows, so each weight byte is read once from HBM and used by
every row of its work item; the rows and the weights go through a `STAGES`-deep `cp.async` ring in shared memory
(swizzled 128-byte rows: the `ldmatrix` reads of 8 rows hit 8 different bank groups), and each warp multiplies its
16 columns by up to four 16-row tiles with `mma.sync.m16n8k16` (BF16 in, FP32 accumulators), skipping row tiles
past the work item's rows.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from jax_latent_ep.kernels import abi
from jax_latent_ep.kernels.common import compile_cubin
from jax_latent_ep.kernels.primitives import (
    cp_async_16,
    cp_async_commit,
    cp_async_wait,
    griddepcontrol_wait,
    ldmatrix_x4,
    ldmatrix_x4_trans,
    load_b32,
    load_shared_v2_f32,
    mma_bf16_16816,
    silu_mul,
    store_b32_bf16x2,
    store_shared_v2_f32,
    store_v2_f32,
)

# ---------------------------------------------------------------------------------------------------------
# Settings

#: Rows (pairs) of one work item: four 16-row MMA tiles.
BLOCK_M = abi.GEMM_BLOCK_M
#: Columns of one CTA: 16 per warp.
BLOCK_N = abi.GEMM_BLOCK_N
#: Contraction step of one pipeline stage; `num_k` and `k_per_split` are multiples of it.
BLOCK_K = abi.GEMM_BLOCK_K
#: Stages of the shared-memory ring (STAGES - 1 loads in flight while one stage is multiplied).
STAGES = 4
THREADS = 128
WARPS = THREADS // 32
#: Bytes of one shared row: 64 BF16 (a row of the `a` tile holds BLOCK_K, of the weight tile BLOCK_N).
ROW_BYTES = 128
A_STAGE_BYTES = BLOCK_M * ROW_BYTES
W_STAGE_BYTES = BLOCK_K * ROW_BYTES
SMEM_BYTES = STAGES * (A_STAGE_BYTES + W_STAGE_BYTES)
#: Words of a work item: (group, first row, rows, non-empty items of the list).
WORK_WORDS = abi.GEMM_WORK_WORDS

assert BLOCK_K * 2 == ROW_BYTES and BLOCK_N * 2 == ROW_BYTES and BLOCK_N == 16 * WARPS and BLOCK_M == 4 * 16


def smem_bytes() -> int:
    """Dynamic shared memory bytes the launcher passes."""
    return SMEM_BYTES


# ---------------------------------------------------------------------------------------------------------
# Launch / host signature (`abi.GROUPED_GEMM`): this host function exists only to compile the kernel; the C++ FFI
# launches the cubin with its own grid.


class GroupedGemm:
    """The grouped GEMM kernel (every size a run-time parameter); `compile_grouped_gemm` builds it."""

    @cute.jit
    def launch(
        self,
        a: Int64,
        a_rows: Int64,
        w: Int64,
        w_second: Int64,
        work: Int64,
        out: Int64,
        num_k: Int32,
        num_n: Int32,
        num_rows: Int32,
        num_work: Int32,
        k_per_split: Int32,
        fuse_glu: Int32,
    ):
        self.kernel(a, a_rows, w, w_second, work, out, num_k, num_n, num_rows, num_work, k_per_split, fuse_glu).launch(
            # The FFI handler sets the grid.
            grid=[num_work, 1, 1], block=[THREADS, 1, 1], smem=SMEM_BYTES, preferred_smem_carveout=-1,
        )

    # -----------------------------------------------------------------------------------------------------
    # Device code

    @cute.kernel
    def kernel(
        self,
        a: Int64,
        a_rows: Int64,
        w: Int64,
        w_second: Int64,
        work: Int64,
        out: Int64,
        num_k: Int32,
        num_n: Int32,
        num_rows: Int32,
        num_work: Int32,
        k_per_split: Int32,
        fuse_glu: Int32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        tid = Int32(tid)
        cta = Int32(cta)
        smem = cutlass.memory.SmemAllocator()
        ring = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(SMEM_BYTES), 128)
        smem_a = Uint32(ring.iterator.toint())
        smem_w = smem_a + Uint32(STAGES * A_STAGE_BYTES)

        # ---- The units this CTA computes: (split, item, column tile) for u = cta, cta + grid, ... over the
        # non-empty items only (work word 3; they come first), so a grid of resident CTAs does every unit and no
        # CTA starts for an empty item. A tile is 64 columns (of each weight).
        column_tiles = num_n // BLOCK_N
        grid, _, _ = cute.arch.grid_dim()
        griddepcontrol_wait()  # the work list and `a` come from the previous kernels
        num_items = Int32(load_b32(work + 12))
        if num_items > num_work:  # a work list of another shape: never past its items
            num_items = num_work
        num_splits = (num_k + k_per_split - 1) // k_per_split
        num_units = num_splits * num_items * column_tiles
        # The fewest CTAs that take as many rounds as the whole grid would: every CTA busy to the last round (a
        # last round of a few CTAs streams at their few loads' rate); the others exit at once.
        rounds = (num_units + Int32(grid) - 1) // Int32(grid)
        stride = (num_units + rounds - 1) // rounds
        if cta < stride:
            for unit_idx in range(cta, num_units, stride):
                self.unit(a, a_rows, w, w_second, work, out, num_k, num_n, num_rows, k_per_split, fuse_glu,
                          unit_idx, num_items, smem_a, smem_w, tid)
                cute.arch.sync_threads()  # every warp is done with the ring before the next unit's prologue

    @cute.jit
    def unit(self, a: Int64, a_rows: Int64, w: Int64, w_second: Int64, work: Int64, out: Int64, num_k: Int32,
             num_n: Int32, num_rows: Int32, k_per_split: Int32, fuse_glu: Int32, unit_idx: Int32, num_items: Int32,
             smem_a: Uint32, smem_w: Uint32, tid: Int32):
        """One unit, `unit_idx = (split * num_items + item) * column_tiles + tile` (module docstring)."""
        lane = tid % 32
        warp = tid // 32
        two = w_second != Int64(0)
        column_tiles = num_n // BLOCK_N
        tile = unit_idx % column_tiles
        rest = unit_idx // column_tiles
        item = rest % num_items
        split = rest // num_items
        group = Int32(load_b32(work + Int64(item) * (4 * WORK_WORDS)))
        first = Int32(load_b32(work + Int64(item) * (4 * WORK_WORDS) + 4))
        rows = Int32(load_b32(work + Int64(item) * (4 * WORK_WORDS) + 8))
        if rows > 0:
            k_begin = split * k_per_split
            k_end = k_begin + k_per_split
            if k_end > num_k:
                k_end = num_k
            steps = (k_end - k_begin) // BLOCK_K
            rows_padded = (rows + 15) // 16 * 16
            # This thread's 16-byte chunk of every shared row it fills: chunk tid % 8 of rows tid / 8 + 16 i;
            # columns `tile * 64 ..` of the group's weight (and of the second weight: the same offset).
            chunk = tid % 8
            w_offset = Int64(group) * Int64(num_k) * Int64(num_n) * 2 + Int64(tile * BLOCK_N + chunk * 8) * 2
            w_col = w + w_offset
            u_col = w_second + w_offset
            # The `a` rows of this thread's chunks (the pair's row through `a_rows`), their copy size (0: a zero
            # row past the item's pairs) and whether they are copied at all (not past the 16-row tile).
            a_src, a_size, a_live = [], [], []
            for i in cutlass.range_constexpr(BLOCK_M // (THREADS // 8)):
                r = tid // 8 + i * (THREADS // 8)
                row = first
                size = Uint32(0)
                if r < rows:
                    row = first + r
                    size = Uint32(16)
                    if a_rows != Int64(0):
                        row = Int32(load_b32(a_rows + Int64(first + r) * 4))
                a_src.append(a + Int64(row) * Int64(num_k) * 2 + Int64(chunk * 16))
                a_size.append(size)
                a_live.append(r < rows_padded)
            acc = cute.make_rmem_tensor(cute.make_layout(BLOCK_M // 16 * 2 * 4), cutlass.Float32)
            acc.fill(0.0)
            acc_up = cute.make_rmem_tensor(cute.make_layout(BLOCK_M // 16 * 2 * 4), cutlass.Float32)
            acc_up.fill(0.0)

            if two:
                # ---- Two weights: stage 2 kt holds the first weight's rows of contraction step kt, stage
                # 2 kt + 1 the second's (`acc`, `acc_up`). Prologue: stages 0, 1, 2 in flight.
                for s in cutlass.range_constexpr(STAGES - 1):
                    if s // 2 < steps:
                        self.load_stage(w_col if s % 2 == 0 else u_col, a_src, a_size, a_live, smem_a, smem_w,
                                        k_begin + (s // 2) * BLOCK_K, Int32(s), num_n, tid, chunk)
                    cp_async_commit()
                # Main loop, two stages a pass: wait for the stage, refill the slot the stage before freed
                # (STAGES - 1 ahead: the other weight of the next step, then this weight two steps on),
                # multiply.
                for kt in range(steps):
                    cp_async_wait(STAGES - 2)
                    cute.arch.sync_threads()
                    if kt + 1 < steps:
                        self.load_stage(u_col, a_src, a_size, a_live, smem_a, smem_w, k_begin + (kt + 1) * BLOCK_K,
                                        (2 * kt + 3) % STAGES, num_n, tid, chunk)
                    cp_async_commit()
                    self.multiply(acc, smem_a, smem_w, (2 * kt) % STAGES, rows, warp, lane)
                    cp_async_wait(STAGES - 2)
                    cute.arch.sync_threads()
                    if kt + 2 < steps:
                        self.load_stage(w_col, a_src, a_size, a_live, smem_a, smem_w, k_begin + (kt + 2) * BLOCK_K,
                                        (2 * kt + 4) % STAGES, num_n, tid, chunk)
                    cp_async_commit()
                    self.multiply(acc_up, smem_a, smem_w, (2 * kt + 1) % STAGES, rows, warp, lane)
            else:
                # ---- One weight. Prologue: stages 0 .. STAGES - 2 in flight.
                for s in cutlass.range_constexpr(STAGES - 1):
                    if s < steps:
                        self.load_stage(w_col, a_src, a_size, a_live, smem_a, smem_w, k_begin + s * BLOCK_K,
                                        Int32(s), num_n, tid, chunk)
                    cp_async_commit()
                # Main loop: wait for stage kt, refill the slot the previous step freed, multiply stage kt.
                for kt in range(steps):
                    cp_async_wait(STAGES - 2)
                    cute.arch.sync_threads()
                    nxt = kt + (STAGES - 1)
                    if nxt < steps:
                        self.load_stage(w_col, a_src, a_size, a_live, smem_a, smem_w, k_begin + nxt * BLOCK_K,
                                        nxt % STAGES, num_n, tid, chunk)
                    cp_async_commit()
                    self.multiply(acc, smem_a, smem_w, kt % STAGES, rows, warp, lane)

            if fuse_glu != 0:
                # ---- Epilogue, SwiGLU: each warp holds the gate and the up of its 16 columns; it stores
                # bf16(silu(gate) * up) of the work item's rows.
                base = out + Int64(first) * Int64(num_n) * 2
                for mt in cutlass.range_constexpr(BLOCK_M // 16):
                    if mt * 16 < rows:
                        for nt in cutlass.range_constexpr(2):
                            col = Int64(tile * BLOCK_N + warp * 16 + nt * 8 + 2 * (lane % 4))
                            r = mt * 16 + lane // 4
                            i = (mt * 2 + nt) * 4
                            if r < rows:
                                store_b32_bf16x2(base + (Int64(r) * Int64(num_n) + col) * 2,
                                                 silu_mul(acc[i], acc_up[i]), silu_mul(acc[i + 1], acc_up[i + 1]))
                            if r + 8 < rows:
                                store_b32_bf16x2(base + (Int64(r + 8) * Int64(num_n) + col) * 2,
                                                 silu_mul(acc[i + 2], acc_up[i + 2]),
                                                 silu_mul(acc[i + 3], acc_up[i + 3]))
            else:
                # ---- Epilogue, partials: FP32 of the work item's rows, columns `tile * 64 ..` of `out` (with two
                # weights, columns `tile * 128 ..` the first's and `tile * 128 + 64 ..` the second's).
                out_n = num_n
                tile_base = tile * BLOCK_N
                if two:
                    out_n = 2 * num_n
                    tile_base = tile * 2 * BLOCK_N
                base = out + (Int64(split) * Int64(num_rows) + Int64(first)) * Int64(out_n) * 4
                for mt in cutlass.range_constexpr(BLOCK_M // 16):
                    if mt * 16 < rows:
                        for nt in cutlass.range_constexpr(2):
                            col = Int64(tile_base + warp * 16 + nt * 8 + 2 * (lane % 4))
                            r = mt * 16 + lane // 4
                            i = (mt * 2 + nt) * 4
                            self.store_partials(base, out_n, col, r, rows, acc, i)
                            if two:
                                self.store_partials(base, out_n, col + Int64(BLOCK_N), r, rows, acc_up, i)

    @cute.jit
    def store_partials(self, base: Int64, out_n: Int32, col: Int64, r: Int32, rows: Int32, acc, i):
        """Stores the FP32 pair `acc[i], acc[i + 1]` at row `r`, `acc[i + 2], acc[i + 3]` at row `r + 8` (rows
        past the work item's pairs skipped)."""
        if r < rows:
            store_v2_f32(base + (Int64(r) * Int64(out_n) + col) * 4, acc[i], acc[i + 1])
        if r + 8 < rows:
            store_v2_f32(base + (Int64(r + 8) * Int64(out_n) + col) * 4, acc[i + 2], acc[i + 3])

    @cute.jit
    def load_stage(self, w_col: Int64, a_src, a_size, a_live, smem_a: Uint32, smem_w: Uint32, k0: Int32,
                   slot: Int32, num_n: Int32, tid: Int32, chunk: Int32):
        """Issues this thread's `cp.async` copies of the stage at contraction offset `k0` into ring slot `slot`:
        its chunk of weight rows `k0 + tid / 8 + 16 i` and of the work item's `a` rows (`a_src`; zero-filled past
        the item's pairs, not copied past their 16-row tile)."""
        a_slot = smem_a + Uint32(slot) * Uint32(A_STAGE_BYTES)
        w_slot = smem_w + Uint32(slot) * Uint32(W_STAGE_BYTES)
        for i in cutlass.range_constexpr(BLOCK_K // (THREADS // 8)):
            r = tid // 8 + i * (THREADS // 8)
            src = w_col + Int64(k0 + r) * Int64(num_n) * 2
            cp_async_16(w_slot + Uint32(r * ROW_BYTES + ((chunk ^ (r % 8)) * 16)), src, Uint32(16))
        for i in cutlass.range_constexpr(BLOCK_M // (THREADS // 8)):
            r = tid // 8 + i * (THREADS // 8)
            if a_live[i]:
                cp_async_16(a_slot + Uint32(r * ROW_BYTES + ((chunk ^ (r % 8)) * 16)), a_src[i] + Int64(k0) * 2,
                            a_size[i])

    @cute.jit
    def multiply(self, acc, smem_a: Uint32, smem_w: Uint32, slot: Int32, rows: Int32, warp: Int32, lane: Int32):
        """`acc += a_tile @ w_tile` for this warp's 16 columns over one stage (BLOCK_K / 16 MMA steps), row tiles
        past `rows` skipped (warp-uniform)."""
        a_slot = smem_a + Uint32(slot) * Uint32(A_STAGE_BYTES)
        w_slot = smem_w + Uint32(slot) * Uint32(W_STAGE_BYTES)
        q = lane // 8
        i8 = lane % 8
        for kk in cutlass.range_constexpr(BLOCK_K // 16):
            # B: matrices (k 0-7 | 8-15) x (columns 0-7 | 8-15) of this warp's 16 columns, transposed.
            k_row = kk * 16 + (q % 2) * 8 + i8
            w_chunk = warp * 2 + q // 2
            b = ldmatrix_x4_trans(w_slot + Uint32(k_row * ROW_BYTES + ((w_chunk ^ (k_row % 8)) * 16)))
            for mt in cutlass.range_constexpr(BLOCK_M // 16):
                if mt * 16 < rows:
                    a_row = mt * 16 + (q % 2) * 8 + i8
                    a_chunk = kk * 2 + q // 2
                    frag = ldmatrix_x4(a_slot + Uint32(a_row * ROW_BYTES + ((a_chunk ^ (a_row % 8)) * 16)))
                    for nt in cutlass.range_constexpr(2):
                        i = (mt * 2 + nt) * 4
                        c = mma_bf16_16816((acc[i], acc[i + 1], acc[i + 2], acc[i + 3]), frag,
                                           (b[2 * nt], b[2 * nt + 1]))
                        for j in cutlass.range_constexpr(4):
                            acc[i + j] = c[j]


#: The cubin's one kernel symbol.
GroupedGemm.kernel.set_name_prefix(abi.GROUPED_GEMM.symbol, remove_cutlass_symbol=True, keep_mangled_name=False)


# ---------------------------------------------------------------------------------------------------------
# Compile


def compile_grouped_gemm(arch: str = "sm_90a"):
    """Compiles the grouped GEMM for `arch`; returns `(symbol, cubin bytes)`."""
    return compile_cubin(abi.GROUPED_GEMM, GroupedGemm(), arch)
