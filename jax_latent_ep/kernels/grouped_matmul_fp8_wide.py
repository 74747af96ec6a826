"""EpGroupedMatmulFp8Wide: the FP8 grouped matmul of prefill sizes on Hopper's FP8 tensor cores: MXFP8 rows times
FP8 block-scaled weights, `out[p] = x[p] @ w[group of p]^T` in FP32, in tiles of up to 128 pairs.

Reading order: settings, the host-side launch signature, the device code, compile. No JAX here.

Parameters: `kernels.abi.GROUPED_MATMUL_FP8_WIDE`, those of `abi.GROUPED_MATMUL_FP8` (the decode kernel,
`grouped_matmul_fp8.py`): the same operands, units and numerics, the operands' roles swapped back for many pairs
an expert. A tile's pairs are `wgmma`'s 64-row side (two consumer warpgroups of 64), 128 weight columns `[out,
in]` (one scale block) its n (`m64n128k32`). A unit is (split, tile, 128 output columns), `u = (split * used +
tile) * columns + column` over the used tiles (`(group, first pair, pairs, used tiles)`, the used first) and the
output's columns (`w`'s, then with `w_second` the second weight's: gate and up in one launch); a pair's row of `x`
is its own or `x_rows[pair]` (the receive rows, no gather). The grid is persistent: CTA `c` computes units `c, c +
stride, ..` (`common.balanced_stride`), the ring running on from one unit to the next; pairs past a tile's are
zero-filled and never stored.

Numerics (`docs/experts.md`, FP8 weights), as the decode kernel's: each 32-deep block of the contraction is one MMA
into fresh FP32 (the exact products' sum in the tensor core), added to the accumulator times `2^(s - 127) * scale`
(the pair's E8M0 scale of that block, 0 for `s = 0`, and the weight block's FP32 scale, multiplied once) in one FMA,
a split's blocks in ascending k.

The CTA is `grouped_matmul.Ring`'s: a producer warpgroup's `cp.async` ring and two consumer warpgroups, `mbarrier`s
between them. A stage is 128 contraction elements: the tile's 128 pair lines and the weights' 128 lines (both K-major
in the 128-byte swizzle), the pairs' 4 scale bytes each and the weight block's FP32 scale. A consumer waits for
each block's MMA before promoting it (the other warpgroup's MMA runs meanwhile) and stores its FP32 rows straight
from its registers, so the producer's copies of the next unit run on under the stores.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from jax_latent_ep.kernels import abi
from jax_latent_ep.kernels.common import balanced_stride, compile_cubin
from jax_latent_ep.kernels.grouped_matmul import FORWARD_THREADS, LINE_BYTES, PRODUCER_THREADS, Ring, _chunks
from jax_latent_ep.kernels.primitives import (
    f32_from_bits,
    fma_rn,
    griddepcontrol_wait,
    load_b32,
    load_shared_b32,
    load_shared_f32,
    mbarrier_wait,
    mul_rn,
    set_max_registers,
    smem_descriptor,
    store_v2_f32,
    wgmma_commit,
    wgmma_e4m3_m64k32,
    wgmma_fence,
    wgmma_wait,
)

# ---------------------------------------------------------------------------------------------------------
# Settings

#: Pairs of one tile: two consumer warpgroups of 64 rows.
TILE_M = abi.MATMUL_FP8_WIDE_TILE_PAIRS
#: Output columns of one unit: `wgmma`'s n, one weight scale block.
TILE_N = 128
#: Contraction elements of one stage: a 128-byte line of e4m3, four 32-deep blocks.
TILE_K = 128
BLOCK_K = 32
#: The ring: `STAGES` of 33 KB, the producer marking a stage landed `LAG` stages after issuing it.
STAGES = 6
LAG = 3
#: A stage past its two operands' lines: the pairs' scale words, then the weight block's scale.
X_SCALE_OFFSET = TILE_M * LINE_BYTES + TILE_N * LINE_BYTES
W_SCALE_OFFSET = X_SCALE_OFFSET + 4 * TILE_M
EXTRA_STAGE_BYTES = 1024
TILE_WORDS = abi.MATMUL_TILE_WORDS


def launch_shape(kernel: str = "grouped_matmul_fp8_wide") -> tuple[int, int]:
    """(threads per CTA, dynamic shared bytes) of the kernel."""
    ring = GroupedMatmulFp8Wide()
    return FORWARD_THREADS, ring.smem_bytes


# ---------------------------------------------------------------------------------------------------------
# Launch / host signature (`abi.GROUPED_MATMUL_FP8_WIDE`): this host function exists only to compile the kernel; the
# C++ FFI launches the cubin with its own grid.


class GroupedMatmulFp8Wide(Ring):
    """The FP8 grouped matmul of prefill sizes (every size a run-time parameter); `compile_grouped_matmul_fp8_wide`
    builds it. `stages`, `lag`: the ring's (`STAGES`, `LAG` by default)."""

    def __init__(self, stages: int = STAGES, lag: int = LAG):
        super().__init__(stages, lag, 1, TILE_N, extra_stage_bytes=EXTRA_STAGE_BYTES)
        if W_SCALE_OFFSET + 4 > self.stage_bytes:
            raise ValueError("a stage's scales overrun it")

    @cute.jit
    def launch(
        self,
        x: Int64,
        x_scale: Int64,
        x_rows: Int64,
        w: Int64,
        w_scale: Int64,
        w_second: Int64,
        w_second_scale: Int64,
        tiles: Int64,
        out: Int64,
        num_k: Int32,
        num_n: Int32,
        num_tiles: Int32,
        num_rows: Int32,
        k_per_split: Int32,
    ):
        self.kernel(x, x_scale, x_rows, w, w_scale, w_second, w_second_scale, tiles, out, num_k, num_n, num_tiles,
                    num_rows, k_per_split).launch(**self.launch_options([num_tiles, 1, 1]))

    # -----------------------------------------------------------------------------------------------------
    # Device code

    @cute.kernel
    def kernel(
        self,
        x: Int64,
        x_scale: Int64,
        x_rows: Int64,
        w: Int64,
        w_scale: Int64,
        w_second: Int64,
        w_second_scale: Int64,
        tiles: Int64,
        out: Int64,
        num_k: Int32,
        num_n: Int32,
        num_tiles: Int32,
        num_rows: Int32,
        k_per_split: Int32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        tid = Int32(tid)
        out_n = num_n  # columns of a row of `out`: both weights' with `w_second`
        if w_second != Int64(0):
            out_n = 2 * num_n
        unit_columns = out_n // TILE_N
        splits = (num_k + k_per_split - 1) // k_per_split
        griddepcontrol_wait()  # the tile list and the rows come from the previous kernels
        used = Int32(load_b32(tiles + 12))  # the non-empty tiles (word 3) come first
        num_units = splits * used * unit_columns
        stride = balanced_stride(cutlass.max(num_units, Int32(1)), grid)  # no pairs: no unit, but no 0 / 0 either
        if Int32(cta) < stride:
            ring, full, empty, _ = self.shared()
            if tid < PRODUCER_THREADS:
                set_max_registers(self.producer_regs, False)
                self.produce(ring, full, empty, tid, Int32(cta), stride, num_units, x, x_scale, x_rows, w, w_scale,
                             w_second, w_second_scale, tiles, used, unit_columns, num_k, num_n, k_per_split)
            else:
                set_max_registers(self.consumer_regs, True)
                self.consume(ring, full, empty, tid, Int32(cta), stride, num_units, tiles, used, unit_columns, out,
                             out_n, num_k, num_rows, k_per_split)

    @cute.jit
    def unit(self, unit: Int32, tiles: Int64, used: Int32, unit_columns: Int32, num_k: Int32, k_per_split: Int32):
        """`(tile entry, split, first contraction element, stages, first output column)` of `unit`."""
        rest = unit // unit_columns
        split = rest // used
        k0 = split * k_per_split
        k_end = k0 + k_per_split
        if k_end > num_k:
            k_end = num_k
        entry = tiles + Int64(rest % used) * (4 * TILE_WORDS)
        return entry, split, k0, (k_end - k0) // TILE_K, (unit % unit_columns) * TILE_N

    @cute.jit
    def produce(self, ring: Uint32, full: Uint32, empty: Uint32, tid: Int32, cta: Int32, stride: Int32,
                num_units: Int32, x: Int64, x_scale: Int64, x_rows: Int64, w: Int64, w_scale: Int64, w_second: Int64,
                w_second_scale: Int64, tiles: Int64, used: Int32, unit_columns: Int32, num_k: Int32, num_n: Int32,
                k_per_split: Int32):
        """The producer warpgroup's stages of every unit of the CTA (stage `t` counted on across them): the tile's
        pair lines (a pair's row of `x` its own or the one `x_rows` names; zeros past the tile's pairs), the
        weights' lines, the pairs' scale words (zeros past the pairs) and the weight block's scale."""
        chunk, lines, x_dst = _chunks(tid, TILE_M, PRODUCER_THREADS)
        _, w_lines, w_dst = _chunks(tid, TILE_N, PRODUCER_THREADS)
        t = Int32(0)
        for unit in range(cta, num_units, stride):
            entry, _, k0, steps, out_n0 = self.unit(unit, tiles, used, unit_columns, num_k, k_per_split)
            group = Int32(load_b32(entry))
            first = Int32(load_b32(entry + 4))
            rows = Int32(load_b32(entry + 8))
            weights = w
            scales = w_scale
            n0 = out_n0
            if out_n0 >= num_n:  # the second weight's columns
                weights = w_second
                scales = w_second_scale
                n0 = out_n0 - num_n
            x_src = []
            for line in lines:
                row = first + line  # the pair's row of `x`: its own, or the one `x_rows` names (no gather)
                if x_rows != Int64(0):
                    if line < rows:
                        row = Int32(load_b32(x_rows + Int64(first + line) * 4))
                x_src.append(x + Int64(row) * Int64(num_k) + Int64(k0 + chunk * 16))
            w_src = weights + (Int64(group) * Int64(num_n) + Int64(n0 + w_lines[0])) * Int64(num_k) + Int64(
                k0 + chunk * 16)
            w_line = Int64(w_lines[1] - w_lines[0]) * Int64(num_k)  # the next of this thread's weight lines
            s_row = first + tid
            if x_rows != Int64(0):
                if tid < rows:
                    s_row = Int32(load_b32(x_rows + Int64(first + tid) * 4))
            s_src = x_scale + Int64(s_row) * Int64(num_k // BLOCK_K) + Int64(k0 // BLOCK_K)
            ws_src = scales + ((Int64(group) * Int64(num_n // TILE_N) + Int64(n0 // TILE_N)) * Int64(num_k // TILE_K)
                               + Int64(k0 // TILE_K)) * 4
            for s in range(steps):
                self.wait_free(empty, t)
                slot = ring + Uint32(t % self.stages) * Uint32(self.stage_bytes)
                for i in cutlass.range_constexpr(len(x_dst)):
                    self.copy_chunk(slot + x_dst[i], x, x_src[i] + Int64(s * TILE_K), lines[i] < rows)
                for i in cutlass.range_constexpr(len(w_dst)):
                    self.copy_chunk(slot + Uint32(TILE_M * LINE_BYTES) + w_dst[i], w,
                                    w_src + Int64(i) * w_line + Int64(s * TILE_K), True)
                self.copy_chunk(slot + Uint32(X_SCALE_OFFSET + 4 * tid), x_scale, s_src + Int64(s * 4), tid < rows, 4)
                if tid == 0:
                    self.copy_chunk(slot + Uint32(W_SCALE_OFFSET), scales, ws_src + Int64(s * 4), True, 4)
                self.mark_landed(full, t)
                t = t + 1
        self.mark_all_landed(full, t)

    @cute.jit
    def consume(self, ring: Uint32, full: Uint32, empty: Uint32, tid: Int32, cta: Int32, stride: Int32,
                num_units: Int32, tiles: Int64, used: Int32, unit_columns: Int32, out: Int64, out_n: Int32,
                num_k: Int32, num_rows: Int32, k_per_split: Int32):
        """A consumer warpgroup's 64 rows of every unit of the CTA: each stage's four blocks multiplied and
        promoted (`promote`), the stage's slot given back, the unit's FP32 rows stored. A warpgroup past the tile's
        pairs multiplies nothing but keeps the barriers' count."""
        c = self.consumer_thread()
        warpgroup = c // 128
        lane = c % 32
        row = warpgroup * 64 + ((c % 128) // 32) * 16 + lane // 4  # this thread's rows: row, row + 8
        acc = cute.make_rmem_tensor(cute.make_layout(TILE_N // 2), cutlass.Float32)
        t = Int32(0)
        for unit in range(cta, num_units, stride):
            entry, split, _, steps, out_n0 = self.unit(unit, tiles, used, unit_columns, num_k, k_per_split)
            first = Int32(load_b32(entry + 4))
            rows = Int32(load_b32(entry + 8))
            acc.fill(0.0)
            # Two loops, not a test a stage: ptxas serializes MMAs whose results a branch's join may redefine.
            if rows > warpgroup * 64:
                for s in range(steps):
                    self.multiply_promote(acc, ring, full, t + s, warpgroup, row)
                    self.release(empty, t + s)
            else:
                for s in range(steps):
                    mbarrier_wait(full + Uint32(8) * Uint32((t + s) % self.stages), Uint32(((t + s) // self.stages)
                                                                                         % 2))
                    self.release(empty, t + s)
            t = t + steps
            self.store_rows(acc, out + Int64(split) * Int64(num_rows) * Int64(out_n) * 4, first, rows, row, lane,
                            out_n, out_n0)

    @cute.jit
    def multiply_promote(self, acc, ring: Uint32, full: Uint32, t: Int32, warpgroup: Int32, row: Int32):
        """Once stage `t` landed: each of its 32-deep blocks in ascending order, this warpgroup's 64 rows by the
        unit's 128 columns into fresh FP32 (`m64n128k32`), then added to `acc` times `2^(s - 127) * w_scale` (the
        row's E8M0 scale of the block, the weight block's scale: one FP32 product) in one FMA a value. Returns with
        the stage's MMAs complete."""
        mbarrier_wait(full + Uint32(8) * Uint32(t % self.stages), Uint32((t // self.stages) % 2))
        slot = ring + Uint32(t % self.stages) * Uint32(self.stage_bytes)
        ws = load_shared_f32(slot + Uint32(W_SCALE_OFFSET))
        words = [load_shared_b32(slot + Uint32(X_SCALE_OFFSET) + Uint32(4) * Uint32(row + 8 * i)) for i in range(2)]
        for kb in cutlass.range_constexpr(TILE_K // BLOCK_K):
            desc_a = smem_descriptor(slot + Uint32(warpgroup * 64 * LINE_BYTES + kb * BLOCK_K), 16, 1024)
            desc_b = smem_descriptor(slot + Uint32(TILE_M * LINE_BYTES + kb * BLOCK_K), 16, 1024)
            wgmma_fence()  # the previous block's FMAs read the registers this MMA writes
            part = wgmma_e4m3_m64k32(desc_a, desc_b, TILE_N)
            wgmma_commit()
            wgmma_wait(0)
            for i in cutlass.range_constexpr(2):
                scale = mul_rn(f32_from_bits(((words[i] >> Uint32(8 * kb)) & Uint32(0xFF)) << Uint32(23)), ws)
                for j in cutlass.range_constexpr(TILE_N // 8):
                    for e in cutlass.range_constexpr(2):
                        k = 4 * j + 2 * i + e
                        acc[k] = fma_rn(part[k], scale, acc[k])

    @cute.jit
    def store_rows(self, acc, out: Int64, first: Int32, rows: Int32, row: Int32, lane: Int32, out_n: Int32,
                   out_n0: Int32):
        """This thread's FP32 values into `out` (`out_n` a row): tile rows `row`, `row + 8` below `rows` (pairs
        `first + ..`), columns `out_n0 + 8 j + 2 (lane % 4)` and the next, 8 bytes a store (a quad's: a sector)."""
        for i in cutlass.range_constexpr(2):
            if row + 8 * i < rows:
                at = out + (Int64(first + row + 8 * i) * Int64(out_n) + Int64(out_n0 + 2 * (lane % 4))) * 4
                for j in cutlass.range_constexpr(TILE_N // 8):
                    store_v2_f32(at + Int64(32 * j), acc[4 * j + 2 * i], acc[4 * j + 2 * i + 1])


GroupedMatmulFp8Wide.kernel.set_name_prefix(abi.GROUPED_MATMUL_FP8_WIDE.symbol, remove_cutlass_symbol=True,
                                            keep_mangled_name=False)


# ---------------------------------------------------------------------------------------------------------
# Compile


def compile_grouped_matmul_fp8_wide(arch: str = "sm_90a", **ring):
    """Compiles the kernel for `arch` (sm_90a only: `wgmma` e4m3; `ring`: `GroupedMatmulFp8Wide`'s settings);
    returns `(symbol, cubin bytes)`."""
    return compile_cubin(abi.GROUPED_MATMUL_FP8_WIDE, GroupedMatmulFp8Wide(**ring), arch)
