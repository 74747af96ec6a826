"""EpGroupedMatmulFp8Wide / EpGroupedMatmulFp8WideGlu: the FP8 grouped matmul of prefill sizes on Hopper's FP8
tensor cores: MXFP8 rows times FP8 block-scaled weights, `out[p] = x[p] @ w[group of p]^T` in FP32, in tiles of up
to 128 pairs; its SwiGLU form writes `h = bf16(silu(gate) * up)` in MXFP8 instead (`GroupedMatmulFp8WideGlu`).

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
in the 128-byte swizzle), the pairs' 4 scale bytes each and each 64 weight lines' block scale. A consumer waits for
each block's MMA before promoting it (the other warpgroup's MMA runs meanwhile) and stores its FP32 rows straight
from its registers, so the producer's copies of the next unit run on under the stores.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from jax_latent_ep.kernels import abi
from jax_latent_ep.kernels.common import balanced_stride, compile_cubin, mxfp8_block_scale
from jax_latent_ep.kernels.grouped_matmul import FORWARD_THREADS, LINE_BYTES, PRODUCER_THREADS, Ring, _chunks
from jax_latent_ep.kernels.primitives import (
    bf16x2,
    e4m3x4,
    hi_f32,
    lo_f32,
    mul_ftz,
    silu_mul,
    store_b16,
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
#: The producer's registers a thread (its row and weight addresses; the consumers keep the rest, 200).
PRODUCER_REGS = 104
#: A stage past its two operands' lines: the pairs' scale words, then the block scale of each half of the weight
#: lines (64 each: one weight block's columns).
X_SCALE_OFFSET = TILE_M * LINE_BYTES + TILE_N * LINE_BYTES
W_SCALE_OFFSET = X_SCALE_OFFSET + 4 * TILE_M
HALF_N = TILE_N // 2
EXTRA_STAGE_BYTES = 1024
TILE_WORDS = abi.MATMUL_TILE_WORDS


def launch_shape(kernel: str = "grouped_matmul_fp8_wide") -> tuple[int, int]:
    """(threads per CTA, dynamic shared bytes) of `kernel` (either of this module's)."""
    return FORWARD_THREADS, CLASSES[kernel]().smem_bytes


# ---------------------------------------------------------------------------------------------------------
# Launch / host signature (`abi.GROUPED_MATMUL_FP8_WIDE`): this host function exists only to compile the kernel; the
# C++ FFI launches the cubin with its own grid.


class GroupedMatmulFp8Wide(Ring):
    """The FP8 grouped matmul of prefill sizes (every size a run-time parameter); `compile_grouped_matmul_fp8_wide`
    builds it. `stages`, `lag`, `producer_regs`, `wait_suspend_ns`: the ring's (`STAGES`, `LAG`, `PRODUCER_REGS`, 0
    by default)."""

    #: Output columns of a unit (`unit`'s step).
    unit_n = TILE_N

    def __init__(self, stages: int = STAGES, lag: int = LAG, producer_regs: int = PRODUCER_REGS,
                 wait_suspend_ns: int = 0):
        super().__init__(stages, lag, 1, TILE_N, extra_stage_bytes=EXTRA_STAGE_BYTES, producer_regs=producer_regs,
                         wait_suspend_ns=wait_suspend_ns)
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
                self.consume(ring, full, empty, tid, Int32(cta), stride, num_units, tiles, used, unit_columns,
                             (out, out_n, num_rows), num_k, k_per_split)

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
        return entry, split, k0, (k_end - k0) // TILE_K, (unit % unit_columns) * self.unit_n

    @cute.jit
    def produce(self, ring: Uint32, full: Uint32, empty: Uint32, tid: Int32, cta: Int32, stride: Int32,
                num_units: Int32, x: Int64, x_scale: Int64, x_rows: Int64, w: Int64, w_scale: Int64, w_second: Int64,
                w_second_scale: Int64, tiles: Int64, used: Int32, unit_columns: Int32, num_k: Int32, num_n: Int32,
                k_per_split: Int32):
        """The producer warpgroup's stages of every unit of the CTA (stage `t` counted on across them): the tile's
        pair lines (a pair's row of `x` its own or the one `x_rows` names; zeros past the tile's pairs), the
        weight lines of each half (`half_source`) and its block scale, the pairs' scale words (zeros past the
        pairs)."""
        chunk, lines, x_dst = _chunks(tid, TILE_M, PRODUCER_THREADS)
        _, _, w_dst = _chunks(tid, TILE_N, PRODUCER_THREADS)
        per_half = len(w_dst) // 2  # this thread's weight lines `tid / 8 + 16 i`: the first half's below 64
        t = Int32(0)
        for unit in range(cta, num_units, stride):
            entry, _, k0, steps, out_n0 = self.unit(unit, tiles, used, unit_columns, num_k, k_per_split)
            group = Int32(load_b32(entry))
            first = Int32(load_b32(entry + 4))
            rows = Int32(load_b32(entry + 8))
            w_src, ws_src = [], []
            for h in cutlass.range_constexpr(2):
                weights, scales, n0 = self.half_source(h, out_n0, num_n, w, w_scale, w_second, w_second_scale)
                w_src.append(weights + (Int64(group) * Int64(num_n) + Int64(n0 + tid // 8)) * Int64(num_k)
                             + Int64(k0 + chunk * 16))
                ws_src.append(scales + ((Int64(group) * Int64(num_n // TILE_N) + Int64(n0 // TILE_N))
                                        * Int64(num_k // TILE_K) + Int64(k0 // TILE_K)) * 4)
            x_src = []
            for line in lines:
                row = first + line  # the pair's row of `x`: its own, or the one `x_rows` names (no gather)
                if x_rows != Int64(0):
                    if line < rows:
                        row = Int32(load_b32(x_rows + Int64(first + line) * 4))
                x_src.append(x + Int64(row) * Int64(num_k) + Int64(k0 + chunk * 16))
            w_line = Int64(16) * Int64(num_k)  # the next of this thread's weight lines
            s_row = first + tid
            if x_rows != Int64(0):
                if tid < rows:
                    s_row = Int32(load_b32(x_rows + Int64(first + tid) * 4))
            s_src = x_scale + Int64(s_row) * Int64(num_k // BLOCK_K) + Int64(k0 // BLOCK_K)
            for s in range(steps):
                self.wait_free(empty, t)
                slot = ring + Uint32(t % self.stages) * Uint32(self.stage_bytes)
                for i in cutlass.range_constexpr(len(x_dst)):
                    self.copy_chunk(slot + x_dst[i], x, x_src[i] + Int64(s * TILE_K), lines[i] < rows)
                for i in cutlass.range_constexpr(len(w_dst)):
                    self.copy_chunk(slot + Uint32(TILE_M * LINE_BYTES) + w_dst[i], w,
                                    w_src[i // per_half] + Int64(i % per_half) * w_line + Int64(s * TILE_K), True)
                self.copy_chunk(slot + Uint32(X_SCALE_OFFSET + 4 * tid), x_scale, s_src + Int64(s * 4), tid < rows, 4)
                for h in cutlass.range_constexpr(2):
                    if tid == h:
                        self.copy_chunk(slot + Uint32(W_SCALE_OFFSET + 4 * h), w_scale, ws_src[h] + Int64(s * 4),
                                        True, 4)
                self.mark_landed(full, t)
                t = t + 1
        self.mark_all_landed(full, t)

    @cute.jit
    def half_source(self, h: int, out_n0: Int32, num_n: Int32, w: Int64, w_scale: Int64, w_second: Int64,
                    w_second_scale: Int64):
        """`(weight, its scales, first column)` of the unit's weight lines `64 h ..`: output columns `out_n0 + 64 h
        ..`, `w`'s below `num_n`, else `w_second`'s (a unit's two halves: one weight block's columns)."""
        weights = w
        scales = w_scale
        n0 = out_n0 + HALF_N * h
        if n0 >= num_n:  # the second weight's columns
            weights = w_second
            scales = w_second_scale
            n0 = n0 - num_n
        return weights, scales, n0

    @cute.jit
    def consume(self, ring: Uint32, full: Uint32, empty: Uint32, tid: Int32, cta: Int32, stride: Int32,
                num_units: Int32, tiles: Int64, used: Int32, unit_columns: Int32, outs, num_k: Int32,
                k_per_split: Int32):
        """A consumer warpgroup's 64 rows of every unit of the CTA: each stage's four blocks multiplied and
        promoted (`multiply_promote`), the stage's slot given back, the unit's rows stored (`store_unit` of
        `outs`). A warpgroup past the tile's pairs multiplies nothing but keeps the barriers' count."""
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
                    mbarrier_wait(full + Uint32(8) * Uint32((t + s) % self.stages),
                                  Uint32(((t + s) // self.stages) % 2), self.wait_suspend_ns)
                    self.release(empty, t + s)
            t = t + steps
            self.store_unit(acc, outs, split, first, rows, row, lane, out_n0)

    @cute.jit
    def multiply_promote(self, acc, ring: Uint32, full: Uint32, t: Int32, warpgroup: Int32, row: Int32):
        """Once stage `t` landed: each of its 32-deep blocks in ascending order, this warpgroup's 64 rows by the
        unit's 128 weight lines into fresh FP32 (`m64n128k32`), then added to `acc` times `2^(s - 127) * w_scale`
        (the row's E8M0 scale of the block, the line's half's block scale: one FP32 product) in one FMA a value.
        Returns with the stage's MMAs complete."""
        mbarrier_wait(full + Uint32(8) * Uint32(t % self.stages), Uint32((t // self.stages) % 2), self.wait_suspend_ns)
        slot = ring + Uint32(t % self.stages) * Uint32(self.stage_bytes)
        ws = [load_shared_f32(slot + Uint32(W_SCALE_OFFSET + 4 * h)) for h in range(2)]
        words = [load_shared_b32(slot + Uint32(X_SCALE_OFFSET) + Uint32(4) * Uint32(row + 8 * i)) for i in range(2)]
        for kb in cutlass.range_constexpr(TILE_K // BLOCK_K):
            desc_a = smem_descriptor(slot + Uint32(warpgroup * 64 * LINE_BYTES + kb * BLOCK_K), 16, 1024)
            desc_b = smem_descriptor(slot + Uint32(TILE_M * LINE_BYTES + kb * BLOCK_K), 16, 1024)
            wgmma_fence()  # the previous block's FMAs read the registers this MMA writes
            part = wgmma_e4m3_m64k32(desc_a, desc_b, TILE_N)
            wgmma_commit()
            wgmma_wait(0)
            for i in cutlass.range_constexpr(2):
                power = f32_from_bits(((words[i] >> Uint32(8 * kb)) & Uint32(0xFF)) << Uint32(23))
                for h in cutlass.range_constexpr(2):
                    scale = mul_rn(power, ws[h])
                    for j in cutlass.range_constexpr(HALF_N // 8):
                        for e in cutlass.range_constexpr(2):
                            k = 4 * (j + h * HALF_N // 8) + 2 * i + e
                            acc[k] = fma_rn(part[k], scale, acc[k])

    @cute.jit
    def store_unit(self, acc, outs, split: Int32, first: Int32, rows: Int32, row: Int32, lane: Int32, out_n0: Int32):
        """This thread's FP32 values into split `split` of `out` (`outs = (out, out_n, num_rows)`, `out_n` a row):
        tile rows `row`, `row + 8` below `rows` (pairs `first + ..`), columns `out_n0 + 8 j + 2 (lane % 4)` and the
        next, 8 bytes a store (a quad's: a sector)."""
        out_base, out_n, num_rows = outs
        out = out_base + Int64(split) * Int64(num_rows) * Int64(out_n) * 4
        for i in cutlass.range_constexpr(2):
            if row + 8 * i < rows:
                at = out + (Int64(first + row + 8 * i) * Int64(out_n) + Int64(out_n0 + 2 * (lane % 4))) * 4
                for j in cutlass.range_constexpr(TILE_N // 8):
                    store_v2_f32(at + Int64(32 * j), acc[4 * j + 2 * i], acc[4 * j + 2 * i + 1])


GroupedMatmulFp8Wide.kernel.set_name_prefix(abi.GROUPED_MATMUL_FP8_WIDE.symbol, remove_cutlass_symbol=True,
                                            keep_mangled_name=False)


# ---------------------------------------------------------------------------------------------------------
# The SwiGLU form (`abi.GROUPED_MATMUL_FP8_WIDE_GLU`): a unit is gate's and up's same 64 columns, and what leaves
# the registers is `h` in MXFP8, the FP8 stage's next operand, with no FP32 products in memory.


class GroupedMatmulFp8WideGlu(GroupedMatmulFp8Wide):
    """The FP8 grouped matmul of prefill sizes with the SwiGLU in its epilogue (every size a run-time parameter);
    `compile_grouped_matmul_fp8_wide_glu` builds it. A unit's weight lines are gate's (`w`) columns `n0 .. n0 + 64`
    then up's (`w_second`) same ones; the contraction is not split. Its epilogue is `swiglu_mxfp8.py`'s on the
    unsplit gate and up (the same bits as that kernel on this kernel's FP32 products): `h = bf16(silu(gate) *
    up)`, each 32-block's E8M0 scale from its largest magnitude over the quad that holds its row, `h * 2^(127 -
    e)` to e4m3."""

    unit_n = HALF_N

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
        q: Int64,
        sf: Int64,
        num_k: Int32,
        num_n: Int32,
        num_tiles: Int32,
        num_rows: Int32,
    ):
        self.kernel(x, x_scale, x_rows, w, w_scale, w_second, w_second_scale, tiles, q, sf, num_k, num_n, num_tiles,
                    num_rows).launch(**self.launch_options([num_tiles, 1, 1]))

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
        q: Int64,
        sf: Int64,
        num_k: Int32,
        num_n: Int32,
        num_tiles: Int32,
        num_rows: Int32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        tid = Int32(tid)
        unit_columns = num_n // HALF_N
        griddepcontrol_wait()  # the tile list and the rows come from the previous kernels
        used = Int32(load_b32(tiles + 12))  # the non-empty tiles (word 3) come first
        num_units = used * unit_columns
        stride = balanced_stride(cutlass.max(num_units, Int32(1)), grid)  # no pairs: no unit, but no 0 / 0 either
        if Int32(cta) < stride:
            ring, full, empty, _ = self.shared()
            if tid < PRODUCER_THREADS:
                set_max_registers(self.producer_regs, False)
                self.produce(ring, full, empty, tid, Int32(cta), stride, num_units, x, x_scale, x_rows, w, w_scale,
                             w_second, w_second_scale, tiles, used, unit_columns, num_k, num_n, num_k)
            else:
                set_max_registers(self.consumer_regs, True)
                self.consume(ring, full, empty, tid, Int32(cta), stride, num_units, tiles, used, unit_columns,
                             (q, sf, num_n), num_k, num_k)

    @cute.jit
    def half_source(self, h: int, out_n0: Int32, num_n: Int32, w: Int64, w_scale: Int64, w_second: Int64,
                    w_second_scale: Int64):
        """`(weight, its scales, first column)` of the unit's weight lines `64 h ..`: gate's (`w`) columns `out_n0
        ..` for `h` 0, up's (`w_second`) for 1."""
        if cutlass.const_expr(h == 0):
            return w, w_scale, out_n0
        return w_second, w_second_scale, out_n0

    @cute.jit
    def store_unit(self, acc, outs, split: Int32, first: Int32, rows: Int32, row: Int32, lane: Int32, out_n0: Int32):
        """`h` of this thread's values (gate's at `acc[4 j + ..]`, up's at `acc[4 (j + 8) + ..]`) in MXFP8 into
        `outs = (q, sf, num_n)`: tile rows `row`, `row + 8` below `rows` (pairs `first + ..`), columns `out_n0 + 8 j
        + 2 (lane % 4)` and the next as two e4m3 bytes, and lane 4 r of the quad the row's two 32-block scales. The
        whole warp runs the shuffles; only live rows are stored."""
        q, sf, num_i = outs
        for i in cutlass.range_constexpr(2):
            words = [bf16x2(silu_mul(acc[4 * j + 2 * i], acc[4 * (j + 8) + 2 * i]),
                            silu_mul(acc[4 * j + 2 * i + 1], acc[4 * (j + 8) + 2 * i + 1]))
                     for j in range(HALF_N // 8)]  # unrolled: a Python comprehension
            pair = Int64(first + row + 8 * i)
            live = row + 8 * i < rows
            scales = Uint32(0)
            for b in cutlass.range_constexpr(2):
                e, inv = mxfp8_block_scale(words[4 * b:4 * b + 4], 4)
                scales = scales | (e << Uint32(8 * b))
                for j in cutlass.range_constexpr(4 * b, 4 * b + 4):
                    packed = e4m3x4(mul_ftz(lo_f32(words[j]), inv), mul_ftz(hi_f32(words[j]), inv), Float32(0.0),
                                    Float32(0.0))
                    if live:
                        store_b16(q + pair * Int64(num_i) + Int64(out_n0 + 8 * j + 2 * (lane % 4)), packed)
            if live:
                if lane % 4 == 0:
                    store_b16(sf + pair * Int64(num_i // 32) + Int64(out_n0 // 32), scales)


GroupedMatmulFp8WideGlu.kernel.set_name_prefix(abi.GROUPED_MATMUL_FP8_WIDE_GLU.symbol, remove_cutlass_symbol=True,
                                               keep_mangled_name=False)

#: kernel -> its class
CLASSES = {"grouped_matmul_fp8_wide": GroupedMatmulFp8Wide, "grouped_matmul_fp8_wide_glu": GroupedMatmulFp8WideGlu}


# ---------------------------------------------------------------------------------------------------------
# Compile


def compile_grouped_matmul_fp8_wide(arch: str = "sm_90a", **ring):
    """Compiles the kernel for `arch` (sm_90a only: `wgmma` e4m3; `ring`: `GroupedMatmulFp8Wide`'s settings);
    returns `(symbol, cubin bytes)`."""
    return compile_cubin(abi.GROUPED_MATMUL_FP8_WIDE, GroupedMatmulFp8Wide(**ring), arch)


def compile_grouped_matmul_fp8_wide_glu(arch: str = "sm_90a", **ring):
    """Compiles the SwiGLU form for `arch` (sm_90a only); returns `(symbol, cubin bytes)`."""
    return compile_cubin(abi.GROUPED_MATMUL_FP8_WIDE_GLU, GroupedMatmulFp8WideGlu(**ring), arch)
