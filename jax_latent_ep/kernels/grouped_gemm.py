"""EpGroupedGemm / EpExpertStage: the expert stage's grouped GEMM at decode sizes, `out = a @ w[group]` per work item,
streaming each group's weights from HBM once, and the stage's gate / up and down in one launch.

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

`ExpertStage` (`kernels.abi.EXPERT_STAGE`) runs the same gate / up and down units in one launch on items of at most
`abi.STAGE_DIRECT_PAIRS` pairs, each gate / up unit dequantizing its own slice of the MXFP8 rows and each down unit
waiting only for the counts of what it reads (its docstring); `GroupedGemm.unit` serves both.

Decode sizes make it a weight stream: a group has a few rows, so each weight byte is read once from HBM and used by
every row of its work item; the rows and the weights go through a `STAGES`-deep (FP8: `FP8_STAGES`) `cp.async` ring in shared memory
(swizzled 128-byte rows: the `ldmatrix` reads of 8 rows hit 8 different bank groups), and each warp multiplies its
16 columns by up to four 16-row tiles with `mma.sync.m16n8k16` (BF16 in, FP32 accumulators), skipping row tiles
past the work item's rows.

The FP8 variant (`GROUPED_GEMM_FP8`, the same parameters) multiplies MXFP8 activations (`a` float8_e4m3fn with an E8M0
scale per 32 elements, `a_scale`) by float8_e4m3fn weights with an FP32 scale per 128 x 128 block (`w_scale`,
`w_second_scale` `[G, num_k / 128, num_n / 128]`, DeepSeek's block layout) on the e4m3 MMA (`mma.sync.m16n8k32`;
on sm_90a ptxas makes it two f16 HMMAs of operands widened by `F2FP`: exact, at the BF16 rate, and issue-bound;
Hopper's FP8 rate is `wgmma`'s): a unit is 128 columns (each weight row a whole 128-byte line), eight warps of 16
columns; the `a` tile has 64-byte rows. Each warp's transposed `ldmatrix` of the weight rows, fed rows `4i, 4i + 1` and
`4i + 2, 4i + 3` as two matrices, gives each lane two pairs of neighbouring columns, and one byte permute (`prmt`) a
register makes the four consecutive contraction rows of one column the MMA takes: the even columns of the warp are
one MMA column tile, the odd ones another. Each MMA covers one 32-element scale block of `a`; its FP32 result is
added times `2^(a_scale - 127) * w_scale` (one FMA each) to the accumulators.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from jax_latent_ep.kernels import abi
from jax_latent_ep.kernels.common import balanced_stride, compile_cubin
from jax_latent_ep.kernels.primitives import (
    cp_async_4,
    cp_async_16,
    cp_async_commit,
    mma_e4m3_16832,
    prmt,
    cp_async_wait,
    griddepcontrol_wait,
    ldmatrix_x4,
    ldmatrix_x4_trans,
    f32_from_bits,
    load_b32,
    load_shared_b32,
    mma_bf16_16816,
    silu_mul,
    store_b32_bf16x2,
    store_v2_f32,
    # the one-launch stage
    atomic_add_relaxed_gpu,
    e4m3x8_to_bf16x8,
    fence_acq_rel_gpu,
    globaltimer,
    load_acquire_gpu,
    load_cg_v2_f32,
    load_v4,
    red_add_relaxed_gpu,
    store_shared_b32,
    store_shared_v4,
    store_v4,
    trap,
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
#: The one launch's ring (`ExpertStage`): its items have at most `abi.STAGE_DIRECT_PAIRS` pairs, one 16-row tile,
#: so an `a` slot is 2 KB and the same 64 KB hold six stages (five in flight, against the grouped GEMM's three).
STAGE_STAGES = 6
STAGE_A_STAGE_BYTES = abi.STAGE_DIRECT_PAIRS * ROW_BYTES
#: Words of a work item: (group, first row, rows, non-empty items of the list).
WORK_WORDS = abi.GEMM_WORK_WORDS
#: The FP8 variant: 128 columns of one CTA (a 128-byte FP8 row), 16 per warp; a ring slot holds the stage's weight
#: rows, its `a` tile (64 e4m3 a row), the tile's E8M0 scales (the 4 of its rows' 128-element block: 4 bytes a row)
#: and the weight block's FP32 scale (16 bytes). Six stages: two CTAs an SM keep as many weight bytes in flight as
#: the BF16 kernel's three.
FP8_BLOCK_N = abi.GEMM_FP8_BLOCK_N
FP8_THREADS = 32 * FP8_BLOCK_N // 16
FP8_STAGES = 6
FP8_A_ROW_BYTES = BLOCK_K
FP8_A_STAGE_BYTES = BLOCK_M * FP8_A_ROW_BYTES
FP8_SF_STAGE_BYTES = BLOCK_M * 4
FP8_SMEM_BYTES = FP8_STAGES * (FP8_A_STAGE_BYTES + W_STAGE_BYTES + FP8_SF_STAGE_BYTES + 16)

#: A gate / up unit's `a` slice in the one launch: one 16-row tile a contraction step, `DIRECT_STEP_BYTES` apart
#: from the start of the `a` region (`STAGE_DIRECT_K / BLOCK_K` steps), and each thread's 16-element chunks of it
#: (their loads issued at once).
DIRECT_STEP_BYTES = STAGE_A_STAGE_BYTES
DIRECT_STEPS = abi.STAGE_DIRECT_K // BLOCK_K
DIRECT_CHUNKS = DIRECT_STEPS * abi.STAGE_DIRECT_PAIRS * (BLOCK_K // 16) // THREADS
#: The one launch's shared memory: the `a` region (a gate / up unit's slice, or a down unit's ring slots), the
#: weight ring, the finisher's flag and the next unit (a 16-byte slot).
STAGE_A_REGION_BYTES = max(DIRECT_STEPS * DIRECT_STEP_BYTES, STAGE_STAGES * STAGE_A_STAGE_BYTES)
STAGE_SMEM_BYTES = STAGE_A_REGION_BYTES + STAGE_STAGES * W_STAGE_BYTES + 16
#: The fused stage's bound on one wait for another CTA's count (they come within microseconds): then a trap.
WAIT_NS = 2_000_000_000
#: Splits of the gate / up contraction the fused stage's finisher loads at once (more take several rounds).
SUM_SPLITS = 8

assert BLOCK_K * 2 == ROW_BYTES and BLOCK_N * 2 == ROW_BYTES and BLOCK_N == 16 * WARPS and BLOCK_M == 4 * 16
assert abi.STAGE_DIRECT_PAIRS == 16 and 3 * (STAGE_SMEM_BYTES + 1024) <= 228 * 1024  # three CTAs an SM
assert THREADS == 2 * abi.STAGE_DIRECT_PAIRS * (BLOCK_K // 16) and DIRECT_CHUNKS * 2 == DIRECT_STEPS
assert FP8_BLOCK_N == ROW_BYTES and abi.GEMM_FP8_SCALE_BLOCK == 2 * BLOCK_K == FP8_BLOCK_N and FP8_THREADS == 256


def smem_bytes() -> int:
    """Dynamic shared memory bytes the launcher passes (the BF16 kernel)."""
    return SMEM_BYTES


def launch_shape(kernel: str) -> tuple[int, int]:
    """(threads, dynamic shared memory bytes) of "grouped_gemm", "grouped_gemm_fp8" or "expert_stage"."""
    if kernel == "grouped_gemm_fp8":
        return FP8_THREADS, FP8_SMEM_BYTES
    return (THREADS, STAGE_SMEM_BYTES) if kernel == "expert_stage" else (THREADS, SMEM_BYTES)


# ---------------------------------------------------------------------------------------------------------
# Launch / host signature (`abi.GROUPED_GEMM`): this host function exists only to compile the kernel; the C++ FFI
# launches the cubin with its own grid.


class GroupedGemm:
    """The grouped GEMM kernel (every size a run-time parameter); `compile_grouped_gemm` builds it, with `fp8=True`
    the FP8-weight variant (module docstring)."""

    def __init__(self, fp8: bool = False):
        self.fp8 = fp8
        self.threads = FP8_THREADS if fp8 else THREADS
        self.tile_n = FP8_BLOCK_N if fp8 else BLOCK_N  # columns of one unit (of each weight)
        self.elem = 1 if fp8 else 2  # weight bytes
        self.stages = FP8_STAGES if fp8 else STAGES
        self.a_stage_bytes = FP8_A_STAGE_BYTES if fp8 else A_STAGE_BYTES
        self.smem_bytes = FP8_SMEM_BYTES if fp8 else SMEM_BYTES

    @cute.jit
    def launch(
        self,
        a: Int64,
        a_rows: Int64,
        a_scale: Int64,
        w: Int64,
        w_second: Int64,
        w_scale: Int64,
        w_second_scale: Int64,
        work: Int64,
        out: Int64,
        num_k: Int32,
        num_n: Int32,
        num_rows: Int32,
        num_work: Int32,
        k_per_split: Int32,
        fuse_glu: Int32,
    ):
        self.kernel(a, a_rows, a_scale, w, w_second, w_scale, w_second_scale, work, out, num_k, num_n, num_rows,
                    num_work, k_per_split, fuse_glu).launch(
            # The FFI handler sets the grid.
            grid=[num_work, 1, 1], block=[self.threads, 1, 1], smem=self.smem_bytes, preferred_smem_carveout=-1,
            # FP8: two CTAs an SM (128 registers a thread) keep as many loads in flight as the BF16 kernel's four.
            min_blocks_per_mp=2 if self.fp8 else 0,
        )

    # -----------------------------------------------------------------------------------------------------
    # Device code

    @cute.kernel
    def kernel(
        self,
        a: Int64,
        a_rows: Int64,
        a_scale: Int64,
        w: Int64,
        w_second: Int64,
        w_scale: Int64,
        w_second_scale: Int64,
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
        ring = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(self.smem_bytes), 128)
        smem_a = Uint32(ring.iterator.toint())
        smem_w = smem_a + Uint32(self.stages * self.a_stage_bytes)  # then, FP8: the slots' a scales and weight scales

        # ---- The units this CTA computes: (split, item, column tile) for u = cta, cta + grid, ... over the
        # non-empty items only (work word 3; they come first), so a grid of resident CTAs does every unit and no
        # CTA starts for an empty item. A tile is 64 columns (FP8: 128) of each weight.
        column_tiles = num_n // self.tile_n
        grid, _, _ = cute.arch.grid_dim()
        griddepcontrol_wait()  # the work list and `a` come from the previous kernels
        num_items = self.non_empty_items(work, num_work)
        num_splits = (num_k + k_per_split - 1) // k_per_split
        num_units = num_splits * num_items * column_tiles
        stride = balanced_stride(num_units, grid)
        if cta < stride:
            for unit_idx in range(cta, num_units, stride):
                tile = unit_idx % column_tiles
                rest = unit_idx // column_tiles
                self.unit(a, a_rows, a_scale, w, w_second, w_scale, w_second_scale, work, out, num_k, num_n, num_rows,
                          k_per_split, fuse_glu, rest // num_items, rest % num_items, tile, smem_a, smem_w, tid,
                          False, Int64(0), Int32(0), False)
                cute.arch.sync_threads()  # every warp is done with the ring before the next unit's prologue

    @cute.jit
    def non_empty_items(self, work: Int64, num_work: Int32):
        """The work list's non-empty items (word 3; they come first), never past its `num_work` items (a list of
        another shape)."""
        num_items = Int32(load_b32(work + 12))
        if num_items > num_work:
            num_items = num_work
        return num_items

    @cute.jit
    def unit(self, a: Int64, a_rows: Int64, a_scale: Int64, w: Int64, w_second: Int64, w_scale: Int64,
             w_second_scale: Int64, work: Int64, out: Int64, num_k: Int32, num_n: Int32, num_rows: Int32,
             k_per_split: Int32, fuse_glu: Int32, split: Int32, item: Int32, tile: Int32, smem_a: Uint32,
             smem_w: Uint32, tid: Int32, waits: cutlass.Constexpr, ready_addr: Int64, ready: Int32,
             direct: cutlass.Constexpr):
        """One unit `(split, item, tile)` (module docstring). With `waits` (the fused stage, BF16) the prologue's
        weight stages are issued first, then the CTA waits until the word at `ready_addr` reaches `ready` (the rows
        of `a` it reads are stored by other CTAs of the launch), then the prologue's `a` stages; with `direct` too
        (the one launch's gate / up) `a` is the MXFP8 rows (`a_scale` their scales) and the unit dequantizes its
        slice of them into the `a` region itself (`dequantize_slice`) instead: no wait, no `a` stages."""
        lane = tid % 32
        warp = tid // 32
        two = w_second != Int64(0)
        group = Int32(load_b32(work + Int64(item) * (4 * WORK_WORDS)))
        first = Int32(load_b32(work + Int64(item) * (4 * WORK_WORDS) + 4))
        rows = Int32(load_b32(work + Int64(item) * (4 * WORK_WORDS) + 8))
        if cutlass.const_expr(waits):
            if rows > abi.STAGE_DIRECT_PAIRS:
                trap()  # the one launch's `a` slots hold one row tile: a host bug, never a wrong result
        if rows > 0:
            k_begin = split * k_per_split
            k_end = k_begin + k_per_split
            if k_end > num_k:
                k_end = num_k
            steps = (k_end - k_begin) // BLOCK_K
            rows_padded = (rows + 15) // 16 * 16
            # This thread's 16-byte chunk of every shared row it fills: chunk tid % 8 of rows tid / 8 + (threads
            # / 8) i; the 128 bytes of columns `tile * tile_n ..` of the group's weight (and of the second weight:
            # the same offset).
            chunk = tid % 8
            w_offset = Int64(group) * Int64(num_k) * Int64(num_n) * self.elem + Int64(tile * ROW_BYTES + chunk * 16)
            w_col = w + w_offset
            u_col = w_second + w_offset
            # FP8: the scales of this unit's column block, one per 128 contraction rows (`scale_k` words apart).
            scale_k = (num_n + FP8_BLOCK_N - 1) // FP8_BLOCK_N
            s_offset = (Int64(group) * Int64((num_k + FP8_BLOCK_N - 1) // FP8_BLOCK_N) * Int64(scale_k)
                        + Int64(tile)) * 4
            w_sc = w_scale + s_offset
            u_sc = w_second_scale + s_offset
            # The `a` rows of this thread's chunks (the pair's row through `a_rows`), their copy size (0: a zero
            # row past the item's pairs) and whether they are copied at all (not past the 16-row tile). BF16: chunk
            # tid % 8 of rows tid / 8 + 16 i; FP8: chunk tid % 4 of row tid / 4, and thread r < 64 copies row r's
            # scales.
            a_src, a_size, a_live = [], [], []
            if cutlass.const_expr(self.fp8):
                row, size = self.pair_row(a_rows, first, tid // 4, rows)
                a_src.append(a + Int64(row) * Int64(num_k) + Int64((tid % 4) * 16))
                a_size.append(size)
                a_live.append(tid // 4 < rows_padded)
                row, size = self.pair_row(a_rows, first, tid, rows)
                a_src.append(a_scale + Int64(row) * Int64(num_k // 32))
                a_size.append(size // Uint32(4))
                a_live.append(tid < rows_padded)
            else:
                copied_rows = rows_padded
                if cutlass.const_expr(direct):
                    copied_rows = Int32(0)  # `a` is in shared memory before the main loop
                for i in cutlass.range_constexpr(BLOCK_M // (self.threads // 8)):
                    r = tid // 8 + i * (self.threads // 8)
                    row, size = self.pair_row(a_rows, first, r, rows)
                    a_src.append(a + Int64(row) * Int64(num_k) * 2 + Int64(chunk * 16))
                    a_size.append(size)
                    a_live.append(r < copied_rows)
            acc = cute.make_rmem_tensor(cute.make_layout(BLOCK_M // 16 * 2 * 4), cutlass.Float32)
            acc.fill(0.0)
            acc_up = cute.make_rmem_tensor(cute.make_layout(BLOCK_M // 16 * 2 * 4), cutlass.Float32)
            acc_up.fill(0.0)

            stages = self.stages
            if two:
                # ---- Two weights: stage c holds weight c % 2 (`w`, `acc`; `w_second`, `acc_up`) of contraction
                # step c // 2.
                self.prologue(2, w_col, u_col, w_sc, u_sc, a_src, a_size, a_live, smem_a, smem_w, k_begin, steps,
                              num_n, tid, chunk, waits, ready_addr, ready, direct, a, a_scale, a_rows, first, rows,
                              num_k)
                # Main loop, stages 2 kt + h: wait for the stage, refill the slot the stage before freed with stage
                # 2 kt + h + stages - 1 (its weight and step fixed by h), multiply.
                for kt in range(steps):
                    for h in cutlass.range_constexpr(2):
                        cp_async_wait(stages - 2)
                        cute.arch.sync_threads()
                        ahead = h + stages - 1  # stages ahead of 2 kt: weight ahead % 2, step kt + ahead // 2
                        if kt + ahead // 2 < steps:
                            self.load_stage(w_col if ahead % 2 == 0 else u_col, w_sc if ahead % 2 == 0 else u_sc,
                                            a_src, a_size, a_live, smem_a, smem_w, k_begin + (kt + ahead // 2) * BLOCK_K,
                                            (2 * kt + ahead) % stages, num_n, tid, chunk)
                        cp_async_commit()
                        self.multiply(acc if h == 0 else acc_up, self.a_slot(smem_a, (2 * kt + h) % stages, kt, direct),
                                      smem_w, (2 * kt + h) % stages, kt % 2, rows, warp, lane)
            else:
                # ---- One weight.
                self.prologue(1, w_col, u_col, w_sc, u_sc, a_src, a_size, a_live, smem_a, smem_w, k_begin, steps,
                              num_n, tid, chunk, waits, ready_addr, ready, direct, a, a_scale, a_rows, first, rows,
                              num_k)
                # Main loop: wait for stage kt, refill the slot the previous step freed, multiply stage kt.
                for kt in range(steps):
                    cp_async_wait(stages - 2)
                    cute.arch.sync_threads()
                    nxt = kt + (stages - 1)
                    if nxt < steps:
                        self.load_stage(w_col, w_sc, a_src, a_size, a_live, smem_a, smem_w, k_begin + nxt * BLOCK_K,
                                        nxt % stages, num_n, tid, chunk)
                    cp_async_commit()
                    self.multiply(acc, self.a_slot(smem_a, kt % stages, kt, direct), smem_w, kt % stages,
                                  kt % 2, rows, warp, lane)

            if fuse_glu != 0:
                # ---- Epilogue, SwiGLU: each warp holds the gate and the up of its 16 columns; it stores
                # bf16(silu(gate) * up) of the work item's rows.
                base = out + Int64(first) * Int64(num_n) * 2
                for mt in cutlass.range_constexpr(BLOCK_M // 16):
                    if mt * 16 < rows:
                        for h in cutlass.range_constexpr(2):  # rows lane / 4 and + 8
                            pr = mt * 16 + lane // 4 + 8 * h
                            if pr < rows:
                                for nt in cutlass.range_constexpr(2):
                                    col, i, j = self.fragment_columns(tile, warp, lane, mt, nt, h)
                                    store_b32_bf16x2(base + (Int64(pr) * Int64(num_n) + col) * 2,
                                                     silu_mul(acc[i], acc_up[i]), silu_mul(acc[j], acc_up[j]))
            else:
                # ---- Epilogue, partials: FP32 of the work item's rows, columns `tile * tile_n ..` of `out` (with
                # two weights, columns `tile * 2 tile_n ..` the first's and the next tile_n the second's).
                out_n = num_n
                if two:
                    out_n = 2 * num_n
                base = out + (Int64(split) * Int64(num_rows) + Int64(first)) * Int64(out_n) * 4
                for mt in cutlass.range_constexpr(BLOCK_M // 16):
                    if mt * 16 < rows:
                        for h in cutlass.range_constexpr(2):
                            pr = mt * 16 + lane // 4 + 8 * h
                            if pr < rows:
                                for nt in cutlass.range_constexpr(2):
                                    col, i, j = self.fragment_columns(tile, warp, lane, mt, nt, h)
                                    if two:
                                        col = col + Int64(tile * self.tile_n)  # the tile's pair of column blocks
                                    addr = base + (Int64(pr) * Int64(out_n) + col) * 4
                                    store_v2_f32(addr, acc[i], acc[j])
                                    if two:
                                        store_v2_f32(addr + Int64(self.tile_n) * 4, acc_up[i], acc_up[j])

    @cute.jit
    def prologue(self, per_step: cutlass.Constexpr, w_col: Int64, u_col: Int64, w_sc: Int64, u_sc: Int64, a_src,
                 a_size, a_live, smem_a: Uint32, smem_w: Uint32, k_begin: Int32, steps: Int32, num_n: Int32,
                 tid: Int32, chunk: Int32, waits: cutlass.Constexpr, ready_addr: Int64, ready: Int32,
                 direct: cutlass.Constexpr,
                 a: Int64, a_scale: Int64, a_rows: Int64, first: Int32, rows: Int32, num_k: Int32):
        """Ring stages 0 .. stages - 2 in flight, stage c holding weight c % `per_step` (`w_col`, else `u_col`) of
        contraction step c // `per_step`. With `waits`: the weight rows (no dependency) as groups 0 .. stages - 2,
        the wait, then the `a` rows as groups stages - 1 + c (the main loop's wait for a stage still covers both of
        its halves); with `direct` the slice's dequantization instead of the wait and the `a` groups (the main
        loop's first wait then covers the first weight stage only)."""
        for part in cutlass.range_constexpr(1, 3 if waits else 2):
            if cutlass.const_expr(waits and part == 2):
                if cutlass.const_expr(direct):
                    self.dequantize_slice(a, a_scale, a_rows, first, rows, num_k, k_begin, steps, smem_a, tid)
                else:
                    self.wait_count(ready_addr, ready, tid)
                    for c in cutlass.range_constexpr(self.stages - 1):
                        if c // per_step < steps:
                            self.load_stage(w_col if c % per_step == 0 else u_col,
                                            w_sc if c % per_step == 0 else u_sc, a_src, a_size, a_live, smem_a,
                                            smem_w, k_begin + (c // per_step) * BLOCK_K, Int32(c), num_n, tid, chunk,
                                            parts=2)
                        cp_async_commit()
            else:
                for c in cutlass.range_constexpr(self.stages - 1):
                    if c // per_step < steps:
                        self.load_stage(w_col if c % per_step == 0 else u_col, w_sc if c % per_step == 0 else u_sc,
                                        a_src, a_size, a_live, smem_a, smem_w, k_begin + (c // per_step) * BLOCK_K,
                                        Int32(c), num_n, tid, chunk, parts=part if waits else 3)
                    cp_async_commit()

    @cute.jit
    def a_slot(self, smem_a: Uint32, slot: Int32, step: Int32, direct: cutlass.Constexpr):
        """Shared address of the `a` tile a stage multiplies: ring slot `slot`'s, or with `direct` contraction step
        `step`'s of the unit's dequantized slice."""
        if cutlass.const_expr(direct):
            return smem_a + Uint32(step) * Uint32(DIRECT_STEP_BYTES)
        return smem_a + Uint32(slot) * Uint32(self.a_stage_bytes)

    @cute.jit
    def dequantize_slice(self, x: Int64, sf: Int64, a_rows: Int64, first: Int32, rows: Int32, num_k: Int32,
                         k_begin: Int32, steps: Int32, smem_a: Uint32, tid: Int32):
        """A one-launch gate / up unit's `a`: contraction steps `0 .. steps - 1` of the work item's rows (through
        `a_rows`), MXFP8 elements `k_begin ..`, each `e4m3 * 2^(e - 127)` (0 for `e = 0`) rounded once to BF16:
        `activations` bit for bit. Step `s` is a 16-row tile at `s * DIRECT_STEP_BYTES` (the ring's swizzle; rows
        past the item's pairs zero). Thread `t`: row `(t % 64) / 4`, 16-element chunk `t % 4` of steps
        `t / 64 + 2 i`, every load issued before any is converted (the first ring stages' weights are already in
        flight). An item of more pairs or more steps than the launch takes is a host bug: a trap, never a wrong
        `h`."""
        if steps > DIRECT_STEPS:
            trap()
        r = (tid % 64) // 4
        c16 = tid % 4
        r_load = r
        keep = Uint32(0xFFFFFFFF)
        if r >= rows:
            r_load = Int32(0)  # a repeated load of the item's first pair, stored as zeros: the loads stay unconditional
            keep = Uint32(0)
        row = Int32(load_b32(a_rows + Int64(first + r_load) * 4))
        src = x + Int64(row) * Int64(num_k)
        sf_row = sf + Int64(row) * Int64(num_k // 32)
        qs, words = [], []
        for i in cutlass.range_constexpr(DIRECT_CHUNKS):
            s = tid // 64 + 2 * i
            if s > steps - 1:
                s = steps - 1
            col = k_begin + s * BLOCK_K + c16 * 16
            qs.append(load_v4(src + Int64(col)))
            words.append(load_b32(sf_row + Int64(col // 128 * 4)))
        for i in cutlass.range_constexpr(DIRECT_CHUNKS):
            s = tid // 64 + 2 * i
            if s < steps:
                col = k_begin + s * BLOCK_K + c16 * 16
                e = (words[i] >> Uint32(8 * ((col // 32) % 4))) & Uint32(0xFF)
                scale = f32_from_bits(e << Uint32(23))
                lo = [v & keep for v in e4m3x8_to_bf16x8(qs[i][0], qs[i][1], scale)]
                hi = [v & keep for v in e4m3x8_to_bf16x8(qs[i][2], qs[i][3], scale)]
                tile = smem_a + Uint32(s * DIRECT_STEP_BYTES + r * ROW_BYTES)
                store_shared_v4(tile + Uint32(((2 * c16) ^ (r % 8)) * 16), lo)
                store_shared_v4(tile + Uint32(((2 * c16 + 1) ^ (r % 8)) * 16), hi)

    @cute.jit
    def wait_count(self, addr: Int64, target: Int32, tid: Int32):
        """Thread 0 polls the counter at `addr` (acquire) until it reaches `target`, then the CTA synchronizes: what
        the counted CTAs stored before their arrivals is visible to every thread after it. A count that never comes
        (a bug, never an input) traps after `WAIT_NS`."""
        if tid == 0:
            start = globaltimer()
            while Int32(load_acquire_gpu(addr)) < target:
                if globaltimer() - start > Int64(WAIT_NS):
                    trap()
        cute.arch.sync_threads()

    @cute.jit
    def fragment_columns(self, tile: Int32, warp: Int32, lane: Int32, mt: int, nt: int, h: int):
        """`(column of out, i, j)`: accumulators `acc[i]`, `acc[j]` are columns `column`, `column + 1` (of one weight)
        of row `lane / 4 + 8 h` of row tile `mt`. BF16: column tile `nt` of the warp holds columns
        `8 nt + 2 (lane % 4)`, +1. FP8: the warp's tiles are its even (`nt` 0) and odd columns, so the lane holds
        columns `4 (lane % 4)` .. +3, as (even, odd) of the tiles' first pair (`nt` 0), then of their second."""
        base = (mt * 2) * 4 + 2 * h
        if cutlass.const_expr(self.fp8):
            col = Int64(tile * self.tile_n + warp * 16 + 4 * (lane % 4) + 2 * nt)
            return col, base + nt, base + 4 + nt
        col = Int64(tile * self.tile_n + warp * 16 + nt * 8 + 2 * (lane % 4))
        return col, base + nt * 4, base + nt * 4 + 1

    @cute.jit
    def pair_row(self, a_rows: Int64, first: Int32, r: Int32, rows: Int32):
        """`(row of a, copy bytes)` of the work item's pair `r`: its row through `a_rows` (pair `first + r` itself
        without), 16 bytes; past the item's pairs row `first` and 0 bytes (a zero-filled copy)."""
        row = first
        size = Uint32(0)
        if r < rows:
            row = first + r
            size = Uint32(16)
            if a_rows != Int64(0):
                row = Int32(load_b32(a_rows + Int64(first + r) * 4))
        return row, size

    @cute.jit
    def w_swizzle(self, r):
        """The 16-byte chunk XOR of weight row `r` in shared memory: `r % 8` (BF16: rows 8 apart read together), or
        FP8 `(r & 1) | ((r >> 1) & 6)`, distinct over the rows `4i, 4i + 1` (and over `4i + 2, 4i + 3`) one
        transposed `ldmatrix` matrix takes."""
        if cutlass.const_expr(self.fp8):
            return (r & 1) | ((r >> 1) & 6)
        return r % 8

    @cute.jit
    def load_stage(self, w_col: Int64, w_sc: Int64, a_src, a_size, a_live, smem_a: Uint32, smem_w: Uint32, k0: Int32,
                   slot: Int32, num_n: Int32, tid: Int32, chunk: Int32, parts: cutlass.Constexpr = 3):
        """Issues this thread's `cp.async` copies of the stage at contraction offset `k0` into ring slot `slot`:
        its chunk of weight rows `k0 + tid / 8 + (threads / 8) i` and of the work item's `a` rows (`a_src`;
        zero-filled past the item's pairs, not copied past their 16-row tile); FP8 also row `tid`'s 4 E8M0 scales of
        the 128-element block (threads < 64) and (thread 0) the weight block's scale (`w_sc`: this unit's, block
        row 0). `parts` (BF16): 1 the weight rows only, 2 the `a` rows only, 3 both."""
        a_slot = smem_a + Uint32(slot) * Uint32(self.a_stage_bytes)
        w_slot = smem_w + Uint32(slot) * Uint32(W_STAGE_BYTES)
        if cutlass.const_expr(parts & 1):
            for i in cutlass.range_constexpr(BLOCK_K // (self.threads // 8)):
                r = tid // 8 + i * (self.threads // 8)
                src = w_col + Int64(k0 + r) * Int64(num_n) * self.elem
                cp_async_16(w_slot + Uint32(r * ROW_BYTES + ((chunk ^ self.w_swizzle(r)) * 16)), src, Uint32(16))
        if cutlass.const_expr(self.fp8):
            r = tid // 4
            if a_live[0]:
                cp_async_16(a_slot + Uint32(r * FP8_A_ROW_BYTES + (((tid % 4) ^ ((r >> 1) & 3)) * 16)),
                            a_src[0] + Int64(k0), a_size[0])
            sf_slot, ws_slot = self.scale_slots(smem_w, slot)
            if tid < BLOCK_M:
                if a_live[1]:
                    cp_async_4(sf_slot + Uint32(tid * 4), a_src[1] + Int64(k0 // abi.GEMM_FP8_SCALE_BLOCK) * 4,
                               a_size[1])
            if tid == 0:
                scale_k = (num_n + FP8_BLOCK_N - 1) // FP8_BLOCK_N
                cp_async_4(ws_slot, w_sc + Int64(k0 // abi.GEMM_FP8_SCALE_BLOCK) * Int64(scale_k) * 4, Uint32(4))
        elif cutlass.const_expr(parts & 2):
            for i in cutlass.range_constexpr(BLOCK_M // (self.threads // 8)):
                r = tid // 8 + i * (self.threads // 8)
                if a_live[i]:
                    cp_async_16(a_slot + Uint32(r * ROW_BYTES + ((chunk ^ (r % 8)) * 16)), a_src[i] + Int64(k0) * 2,
                                a_size[i])

    @cute.jit
    def scale_slots(self, smem_w: Uint32, slot: Int32):
        """FP8: shared addresses of ring slot `slot`'s `a` scales (4 bytes a row) and weight block scale."""
        sf = smem_w + Uint32(self.stages * W_STAGE_BYTES)
        ws = sf + Uint32(self.stages * FP8_SF_STAGE_BYTES)
        return sf + Uint32(slot) * Uint32(FP8_SF_STAGE_BYTES), ws + Uint32(slot) * Uint32(16)

    @cute.jit
    def multiply(self, acc, a_slot: Uint32, smem_w: Uint32, slot: Int32, half: Int32, rows: Int32, warp: Int32,
                 lane: Int32):
        """`acc += a_tile @ w_tile` for this warp's 16 columns over one stage (the `a` tile at `a_slot`, the weights
        in ring slot `slot`), row tiles past `rows` skipped (warp-uniform). BF16: BLOCK_K / 16 MMA steps. FP8: two
        e4m3 MMAs of 32 contraction rows per row tile and column tile, each result times its scales; `half` (0, 1)
        is the stage's half of its 128-row scale block."""
        w_slot = smem_w + Uint32(slot) * Uint32(W_STAGE_BYTES)
        q = lane // 8
        i8 = lane % 8
        if cutlass.const_expr(self.fp8):
            sf_slot, ws_slot = self.scale_slots(smem_w, slot)
            w_scale = f32_from_bits(load_shared_b32(ws_slot))
            zero = cutlass.Float32(0.0)
            for kb in cutlass.range_constexpr(BLOCK_K // 32):
                # B: matrices q = 0, 1 take rows 4i, 4i + 1 and 4i + 2, 4i + 3 (i = 0..3) of contraction rows 0-15
                # of the block, q = 2, 3 the same of 16-31: the lane's words hold columns 2 (lane / 4), +1 of rows
                # 4 (lane % 4) + 0, 1 | 2, 3; a permute each makes rows 4 (lane % 4) .. + 3 of one column.
                k_row = kb * 32 + 16 * (q // 2) + 4 * (i8 // 2) + 2 * (q % 2) + i8 % 2
                b = ldmatrix_x4_trans(w_slot + Uint32(k_row * ROW_BYTES + ((warp ^ self.w_swizzle(k_row)) * 16)))
                tiles = ((prmt(b[0], b[1], 0x6420), prmt(b[2], b[3], 0x6420)),  # even columns
                         (prmt(b[0], b[1], 0x7531), prmt(b[2], b[3], 0x7531)))  # odd columns
                shift = Uint32(8 * (2 * half + kb))  # this 32-block's byte of the rows' scale words
                for mt in cutlass.range_constexpr(BLOCK_M // 16):
                    if mt * 16 < rows:
                        a_row = mt * 16 + (q % 2) * 8 + i8
                        a_chunk = kb * 2 + q // 2
                        frag = ldmatrix_x4(a_slot + Uint32(a_row * FP8_A_ROW_BYTES + ((a_chunk ^ ((a_row >> 1) & 3)) * 16)))
                        g = mt * 16 + lane // 4
                        f_lo = self.row_factor(sf_slot, g, shift) * w_scale
                        f_hi = self.row_factor(sf_slot, g + 8, shift) * w_scale
                        for nt in cutlass.range_constexpr(2):
                            i = (mt * 2 + nt) * 4
                            d = mma_e4m3_16832((zero, zero, zero, zero), frag, tiles[nt])
                            acc[i] = acc[i] + d[0] * f_lo
                            acc[i + 1] = acc[i + 1] + d[1] * f_lo
                            acc[i + 2] = acc[i + 2] + d[2] * f_hi
                            acc[i + 3] = acc[i + 3] + d[3] * f_hi
        else:
            for kk in cutlass.range_constexpr(BLOCK_K // 16):
                # B: matrices (k 0-7 | 8-15) x (columns 0-7 | 8-15) of this warp's 16 columns, transposed.
                k_row = kk * 16 + (q % 2) * 8 + i8
                w_chunk = warp * 2 + q // 2
                b = ldmatrix_x4_trans(w_slot + Uint32(k_row * ROW_BYTES + ((w_chunk ^ (k_row % 8)) * 16)))
                for mt in cutlass.range_constexpr(BLOCK_M // 16):
                    if mt * 16 < rows:
                        frag = self.a_fragment(a_slot, mt, kk, q, i8)
                        for nt in cutlass.range_constexpr(2):
                            i = (mt * 2 + nt) * 4
                            c = mma_bf16_16816((acc[i], acc[i + 1], acc[i + 2], acc[i + 3]), frag,
                                               (b[2 * nt], b[2 * nt + 1]))
                            for j in cutlass.range_constexpr(4):
                                acc[i + j] = c[j]

    @cute.jit
    def row_factor(self, sf_slot: Uint32, row: Int32, shift: Uint32):
        """`2^(e - 127)` of the E8M0 scale `e` at byte `shift / 8` of row `row`'s scale word (0 for `e = 0`, as
        `numerics.mxfp8_dequantize`)."""
        e = (load_shared_b32(sf_slot + Uint32(row * 4)) >> shift) & Uint32(0xFF)
        return f32_from_bits(e << Uint32(23))

    @cute.jit
    def a_fragment(self, a_slot: Uint32, mt: int, kk: int, q: Int32, i8: Int32):
        """`ldmatrix_x4` of the `a` tile's rows `16 mt ..`, contraction columns `16 kk ..` (the MMA's A operand)."""
        a_row = mt * 16 + (q % 2) * 8 + i8
        a_chunk = kk * 2 + q // 2
        return ldmatrix_x4(a_slot + Uint32(a_row * ROW_BYTES + ((a_chunk ^ (a_row % 8)) * 16)))


class ExpertStage(GroupedGemm):
    """The expert stage's SwiGLU MLP on the MXFP8 receive rows in one launch (`abi.EXPERT_STAGE`, BF16 weights, work
    items of at most `abi.STAGE_DIRECT_PAIRS` pairs: decode), with no kernel boundary between gate / up and down:
    a unit waits only for the counts of what it reads.

    Units, in the order the CTAs take them (CTA `c` first unit `c`, then the next ticket of the last counts word,
    so a CTA that ends early takes the next unit):
      1. gate / up `(item, split, tile)`, item-major (an item's `h` is complete early): the first weight stages,
         then the unit's slice of its rows dequantized into the `a` region (`dequantize_slice`): no unit waits for
         another before its first MMA. One split stores its tile of `h` (the SwiGLU epilogue); several store FP32
         partials and count themselves in the (item, tile) word, and the CTA that brings it to the splits sums them
         in split order (from split 0), applies the SwiGLU and stores the tile. Each tile of `h` stored counts in its
         item's word;
      2. down `(item, split, tile)`: the first weight stages, a wait for its item's word to reach the tiles, then
         its rows of `h`; FP32 partials `y`.
    A down unit waits only for gate / up units, all taken before it by CTAs whose units never wait: with every CTA
    resident (the grid is at most the CTAs that fit at once) each wait ends. The ring has `STAGE_STAGES` slots of
    16-row `a` tiles.
    """

    def __init__(self):
        super().__init__(fp8=False)
        self.stages = STAGE_STAGES
        self.a_stage_bytes = STAGE_A_STAGE_BYTES
        self.smem_bytes = STAGE_SMEM_BYTES

    @cute.jit
    def launch(
        self,
        x: Int64,
        sf: Int64,
        a_rows: Int64,
        w_gate: Int64,
        w_up: Int64,
        w_down: Int64,
        work: Int64,
        counts: Int64,
        parts: Int64,
        h: Int64,
        y: Int64,
        num_l: Int32,
        num_i: Int32,
        num_rows: Int32,
        num_work: Int32,
        k_gate: Int32,
        k_down: Int32,
    ):
        self.kernel(x, sf, a_rows, w_gate, w_up, w_down, work, counts, parts, h, y, num_l, num_i, num_rows, num_work,
                    k_gate, k_down).launch(
            # The FFI handler sets the grid; three CTAs an SM whatever a unit holds.
            grid=[num_work, 1, 1], block=[THREADS, 1, 1], smem=STAGE_SMEM_BYTES, preferred_smem_carveout=-1,
            min_blocks_per_mp=3,
        )

    @cute.kernel
    def kernel(
        self,
        x: Int64,
        sf: Int64,
        a_rows: Int64,
        w_gate: Int64,
        w_up: Int64,
        w_down: Int64,
        work: Int64,
        counts: Int64,
        parts: Int64,
        h: Int64,
        y: Int64,
        num_l: Int32,
        num_i: Int32,
        num_rows: Int32,
        num_work: Int32,
        k_gate: Int32,
        k_down: Int32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        tid = Int32(tid)
        cta = Int32(cta)
        smem = cutlass.memory.SmemAllocator()
        ring = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(STAGE_SMEM_BYTES), 128)
        smem_a = Uint32(ring.iterator.toint())
        smem_w = smem_a + Uint32(STAGE_A_REGION_BYTES)
        smem_word = smem_w + Uint32(STAGE_STAGES * W_STAGE_BYTES)  # the finisher's flag, then the next unit
        grid, _, _ = cute.arch.grid_dim()
        griddepcontrol_wait()  # the plan, the rows and the zeroed counts come from the previous kernels
        num_items = self.non_empty_items(work, num_work)
        tiles_gate = num_i // BLOCK_N
        splits_gate = (num_l + k_gate - 1) // k_gate
        tiles_down = num_l // BLOCK_N
        splits_down = (num_i + k_down - 1) // k_down
        end_gate = num_items * splits_gate * tiles_gate
        num_units = end_gate + num_items * splits_down * tiles_down
        fuse = Int32(0)
        gate_out = parts
        if splits_gate == 1:
            fuse = Int32(1)
            gate_out = h
        # The CTA's first unit is its own index, each next one a ticket taken as the unit starts (the CTAs that end
        # first take the next units: no CTA left with a round more than the others).
        ticket = counts + Int64(num_work) * Int64(1 + tiles_gate) * 4
        smem_next = smem_word + Uint32(4)
        unit_idx = cta
        while unit_idx < num_units:
            next_unit = Uint32(0)
            if tid == 0:
                next_unit = atomic_add_relaxed_gpu(ticket, Uint32(1))  # waited for only at its store below
            if unit_idx < end_gate:
                tile = unit_idx % tiles_gate
                rest = unit_idx // tiles_gate
                item = rest // splits_gate
                self.unit(x, a_rows, sf, w_gate, w_up, Int64(0), Int64(0), work, gate_out, num_l, num_i, num_rows,
                          k_gate, fuse, rest % splits_gate, item, tile, smem_a, smem_w, tid, True, Int64(0),
                          Int32(0), True)
                self.arrive(counts, parts, h, work, num_i, num_rows, num_work, splits_gate, item, tile,
                            smem_word, tid)
            else:
                v = unit_idx - end_gate
                rest = v // tiles_down
                item = rest // splits_down
                self.unit(h, Int64(0), Int64(0), w_down, Int64(0), Int64(0), Int64(0), work, y, num_i, num_l,
                          num_rows, k_down, Int32(0), rest % splits_down, item, v % tiles_down, smem_a, smem_w,
                          tid, True, counts + Int64(item) * 4, tiles_gate, False)
            if tid == 0:
                store_shared_b32(smem_next, next_unit + Uint32(grid))
            cute.arch.sync_threads()  # every warp is done with the ring before the next unit's prologue
            unit_idx = Int32(load_shared_b32(smem_next))
            cute.arch.sync_threads()  # every thread has read the next unit before thread 0 writes the one after

    @cute.jit
    def count_unit(self, word: Int64, tid: Int32):
        """After a unit stored: the CTA's stores are ordered before one count in `word`."""
        cute.arch.sync_threads()
        if tid == 0:
            fence_acq_rel_gpu()
            red_add_relaxed_gpu(word, Uint32(1))

    @cute.jit
    def arrive(self, counts: Int64, parts: Int64, h: Int64, work: Int64, num_i: Int32, num_rows: Int32,
               num_work: Int32, splits: Int32, item: Int32, tile: Int32, smem_flag: Uint32, tid: Int32):
        """After gate / up unit (item, ., tile) stored: one split counts its tile of `h` in the item's word; several
        count the split in the (item, tile) word, and the last one's CTA stores the tile (`finish`), then counts it."""
        item_word = counts + Int64(item) * 4
        if splits == 1:
            self.count_unit(item_word, tid)
        else:
            cute.arch.sync_threads()  # the CTA's stores are issued before thread 0's fence
            if tid == 0:
                fence_acq_rel_gpu()
                old = atomic_add_relaxed_gpu(counts + (Int64(num_work) + Int64(item) * Int64(num_i // BLOCK_N)
                                                       + Int64(tile)) * 4, Uint32(1))
                last = Uint32(0)
                if Int32(old) == splits - 1:
                    fence_acq_rel_gpu()  # the other splits' partials are read after it
                    last = Uint32(1)
                store_shared_b32(smem_flag, last)
            cute.arch.sync_threads()
            if load_shared_b32(smem_flag) != Uint32(0):
                self.finish(parts, h, work, num_i, num_rows, splits, item, tile, tid)
                self.count_unit(item_word, tid)

    @cute.jit
    def finish(self, parts: Int64, h: Int64, work: Int64, num_i: Int32, num_rows: Int32, splits: Int32,
               item: Int32, tile: Int32, tid: Int32):
        """Tile `tile` of the item's `h`: `bf16(silu(g) * u)`, `g` and `u` the FP32 sums of the splits' partials in
        split order (from split 0), `SUM_SPLITS` splits' loads issued at once."""
        first = Int32(load_b32(work + Int64(item) * (4 * WORK_WORDS) + 4))
        rows = Int32(load_b32(work + Int64(item) * (4 * WORK_WORDS) + 8))
        out_n = 2 * num_i
        split_bytes = Int64(num_rows) * Int64(out_n) * 4
        for idx in range(tid, rows * (BLOCK_N // 2), THREADS):
            r = idx // (BLOCK_N // 2)
            col = (idx % (BLOCK_N // 2)) * 2
            src = parts + ((Int64(first + r) * Int64(out_n)) + Int64(tile * 2 * BLOCK_N + col)) * 4
            g0 = cutlass.Float32(0.0)
            g1 = cutlass.Float32(0.0)
            u0 = cutlass.Float32(0.0)
            u1 = cutlass.Float32(0.0)
            for s0 in range(0, splits, SUM_SPLITS):
                gs, us = [], []
                for j in cutlass.range_constexpr(SUM_SPLITS):
                    sj = s0 + j
                    if sj > splits - 1:
                        sj = splits - 1  # a repeated load, not added: the loads stay unconditional
                    addr = src + Int64(sj) * split_bytes
                    gs.append(load_cg_v2_f32(addr))
                    us.append(load_cg_v2_f32(addr + Int64(BLOCK_N * 4)))
                for j in cutlass.range_constexpr(SUM_SPLITS):
                    if s0 + j == 0:
                        g0, g1 = gs[j]
                        u0, u1 = us[j]
                    elif s0 + j < splits:
                        g0 = g0 + gs[j][0]
                        g1 = g1 + gs[j][1]
                        u0 = u0 + us[j][0]
                        u1 = u1 + us[j][1]
            store_b32_bf16x2(h + (Int64(first + r) * Int64(num_i) + Int64(tile * BLOCK_N + col)) * 2,
                             silu_mul(g0, u0), silu_mul(g1, u1))


def _name(op: abi.Kernel) -> None:
    """Names the kernel symbol of the next compile after `op` (the BF16 and the FP8 cubin each carry their own)."""
    GroupedGemm.kernel.set_name_prefix(op.symbol, remove_cutlass_symbol=True, keep_mangled_name=False)


_name(abi.GROUPED_GEMM)


# ---------------------------------------------------------------------------------------------------------
# Compile


def compile_grouped_gemm(arch: str = "sm_90a"):
    """Compiles the grouped GEMM for `arch`; returns `(symbol, cubin bytes)`."""
    _name(abi.GROUPED_GEMM)
    return compile_cubin(abi.GROUPED_GEMM, GroupedGemm(), arch)


def compile_grouped_gemm_fp8(arch: str = "sm_90a"):
    """Compiles the FP8-weight grouped GEMM for `arch`; returns `(symbol, cubin bytes)`."""
    _name(abi.GROUPED_GEMM_FP8)
    try:
        return compile_cubin(abi.GROUPED_GEMM_FP8, GroupedGemm(fp8=True), arch)
    finally:
        _name(abi.GROUPED_GEMM)


def compile_expert_stage(arch: str = "sm_90a"):
    """Compiles the fused expert stage for `arch`; returns `(symbol, cubin bytes)`."""
    ExpertStage.kernel.set_name_prefix(abi.EXPERT_STAGE.symbol, remove_cutlass_symbol=True, keep_mangled_name=False)
    return compile_cubin(abi.EXPERT_STAGE, ExpertStage(), arch)
