"""EpGroupedMatmulFp8: the grouped matmul of decode sizes on Hopper's FP8 tensor cores: MXFP8 rows times FP8
block-scaled weights, `out[p] = x[p] @ w[group of p]^T` in FP32, neither operand converted.

Reading order: settings, the host-side launch signature, the device code, compile. No JAX here.

Parameters: `kernels.abi.GROUPED_MATMUL_FP8` (and its variants, `VARIANTS`: MXFP4 weights, smaller tiles).

The operands are swapped for decode's few pairs an expert: the weights, `[out, in]` as checkpoints store them, are
`wgmma`'s 64-row side (a warpgroup's 64 output columns), a tile's at most `TILE_PAIRS` pairs its narrow side
(`m64n32k32`; `m64n16k32` / `m64n8k32` in the variants of `SMALL_TILE_PAIRS`, for a few pairs an expert). A unit
is (split, tile, 128 output columns), `u = (split * used + tile) * columns + column` over the used tiles
(`(group, first pair, pairs, used tiles)`, the caller's list, the used first, as `GroupedMatmul`'s) and the
output's columns (`w`'s, then with `w_second` the second weight's: gate and up in one launch, one `out` row
holding both); a pair's row of `x` is its own or `x_rows[pair]` (the receive rows, no gather). Its CTA streams
those columns' weights over the split's contraction `split * k_per_split ..` once for all the tile's pairs, into
`out[split]`. The grid is persistent (at most the resident CTAs): CTA `c` computes units `c, c + stride, ..`
(`common.balanced_stride`), so a list sized for the worst case costs no CTA per empty tile, and splits give
decode's few tiles enough units. Pairs past a tile's are zero-filled and never stored.

Numerics (`docs/experts.md`, FP8 weights): each 32-deep block of the contraction is one MMA (the exact products'
sum in the tensor core), added to the FP32 accumulator times `2^(s - 127) * scale` (the pair's E8M0 scale of that
block, 0 for `s = 0`, and the weight block's FP32 scale, multiplied once) in one FMA, a split's blocks in
ascending k (the caller sums the splits' partials in split order).

A stage is 128 contraction elements, one 128-byte line a row (`StageLayout`): the weights' 128 lines, a tile's
lines (both K-major in the 128-byte swizzle, as `grouped_matmul`'s), the pairs' 4 scale bytes each and the weight
block's scale, copied by `cp.async` through a ring of `StageLayout.stages`.
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from jax_latent_ep.kernels import abi
from jax_latent_ep.kernels.common import balanced_stride, compile_cubin
from jax_latent_ep.kernels.primitives import (
    cp_async_4,
    cp_async_16,
    cp_async_commit,
    cp_async_wait,
    e2m1x8_to_e4m3x8_scaled,
    f32_from_bits,
    fence_proxy_async_shared,
    fma_rn,
    griddepcontrol_wait,
    load_b32,
    load_shared_b32,
    load_shared_f32,
    load_shared_v4,
    mul_rn,
    smem_descriptor,
    smem_descriptor_advance,
    store_f32,
    store_shared_v4,
    wgmma_commit,
    wgmma_e4m3_m64k32,
    wgmma_fence,
    wgmma_wait,
)

# ---------------------------------------------------------------------------------------------------------
# Settings

#: Output columns of one CTA (two warpgroups of 64 weight rows; one weight scale block).
TILE_N = 128
#: Pairs of one tile: the MMA's n (`m64n32k32`); the variants' smaller tiles (16, 8), for a few pairs an expert.
TILE_PAIRS = abi.MATMUL_FP8_TILE_PAIRS
SMALL_TILE_PAIRS = abi.MATMUL_FP8_SMALL_TILE_PAIRS
#: Contraction elements of one stage: a 128-byte line of e4m3, four 32-deep blocks.
TILE_K = 128
BLOCK_K = 32
THREADS = 256
#: The ring's stages and CTAs an SM by default (`StageLayout`): two CTAs, one's promotion beside the other's MMAs,
#: `2 (STAGES - 1)` stages of weights (16 KB each in FP8) in flight an SM.
STAGES = 5
CTAS_PER_SM = 2
#: An SM's shared memory for CTAs (H100 / H200: 228 KB) and what the driver keeps of it for each CTA.
SM_SHARED_BYTES = 228 * 1024
CTA_RESERVED_BYTES = 1024
LINE_BYTES = 128
A_BYTES = TILE_N * LINE_BYTES
#: 16-byte chunks of the weights' stage each thread copies.
A_CHUNKS = A_BYTES // 16 // THREADS
#: 16-byte chunks of MXFP4 packed codes (32 inputs of one row) each thread copies and widens a stage.
MX_CHUNKS = TILE_N * TILE_K // 2 // 16 // THREADS
TILE_WORDS = abi.MATMUL_TILE_WORDS


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """Byte offsets in shared memory of a CTA whose tiles hold `pairs` pairs (8, 16, 24 or 32), through a ring of
    `stages` stages, `ctas_per_sm` CTAs an SM (the registers' cap; the launcher's grid is what resides).

    An FP8 stage: the weights' 128 lines, the pairs' lines (both K-major in the 128-byte swizzle), the pairs' 4
    scale bytes each, the weight block's FP32 scale. An MXFP4 stage (`mx_*`): the pairs' lines (swizzled), the
    weights' packed codes (64 bytes a row, linear), the pairs' scale words, the weight rows' scale words; the
    widened weights go to one of two tiles after the ring. A stage rounds up to the 1024-byte swizzle atoms."""

    pairs: int
    stages: int = STAGES
    ctas_per_sm: int = CTAS_PER_SM

    def __post_init__(self):
        if self.pairs % 8 or not 8 <= self.pairs <= 32:
            raise ValueError(f"StageLayout: pairs={self.pairs} must be 8, 16, 24 or 32")
        if not 3 <= self.stages <= 8:  # the MXFP4 loop holds two stages besides the one it fills
            raise ValueError(f"StageLayout: stages={self.stages} must be 3 to 8")
        if not 1 <= self.ctas_per_sm <= 4:
            raise ValueError(f"StageLayout: ctas_per_sm={self.ctas_per_sm} must be 1 to 4")

    @property
    def x_scale_offset(self) -> int:
        return A_BYTES + self.pairs * LINE_BYTES

    @property
    def w_scale_offset(self) -> int:
        return self.x_scale_offset + 4 * self.pairs

    @property
    def stage_bytes(self) -> int:
        return (self.w_scale_offset + 4 + 1023) // 1024 * 1024

    @property
    def smem_bytes(self) -> int:
        return self.stages * self.stage_bytes + 1024

    @property
    def acc(self) -> int:
        """FP32 accumulators of one thread (`m64n<pairs>`)."""
        return 64 * self.pairs // 128

    @property
    def mx_packed_offset(self) -> int:
        return self.pairs * LINE_BYTES

    @property
    def mx_x_scale_offset(self) -> int:
        return self.mx_packed_offset + TILE_N * TILE_K // 2

    @property
    def mx_w_scale_offset(self) -> int:
        return self.mx_x_scale_offset + 4 * self.pairs

    @property
    def mx_stage_bytes(self) -> int:
        return (self.mx_w_scale_offset + 4 * TILE_N + 1023) // 1024 * 1024

    @property
    def mx_tiles_offset(self) -> int:
        return self.stages * self.mx_stage_bytes

    @property
    def mx_smem_bytes(self) -> int:
        return self.mx_tiles_offset + 2 * A_BYTES + 1024


#: kernel -> (its tiles' pairs, MXFP4 weights)
VARIANTS = {f"{base}{'' if p == TILE_PAIRS else f'_n{p}'}": (p, base.endswith("mxfp4"))
            for base in ("grouped_matmul_fp8", "grouped_matmul_mxfp4") for p in (TILE_PAIRS, *SMALL_TILE_PAIRS)}


def smem_bytes() -> int:
    """Dynamic shared memory bytes the launcher must pass (the FP8 kernel's)."""
    return StageLayout(TILE_PAIRS).smem_bytes


def launch_shape(kernel: str = "grouped_matmul_fp8") -> tuple[int, int]:
    """(threads per CTA, dynamic shared bytes) of `kernel` (one of `VARIANTS`)."""
    _, mx = VARIANTS[kernel]
    layout = CLASSES[kernel].layout
    return THREADS, layout.mx_smem_bytes if mx else layout.smem_bytes


# ---------------------------------------------------------------------------------------------------------
# Launch / host signature (`abi.GROUPED_MATMUL_FP8`): this host function exists only to compile the kernel; the C++
# FFI launches the cubin with its own grid.


def _kernel_entry(op: abi.Kernel):
    """A kernel entry of `op`'s parameters that runs the class's `run_tiles`, named `op.symbol` (each variant its
    own, one cubin each)."""

    @cute.kernel
    def kernel(self, x: Int64, x_scale: Int64, x_rows: Int64, w: Int64, w_scale: Int64, w_second: Int64,
               w_second_scale: Int64, tiles: Int64, out: Int64, num_k: Int32, num_n: Int32, num_tiles: Int32,
               num_rows: Int32, k_per_split: Int32):
        self.run_tiles(x, x_scale, x_rows, w, w_scale, w_second, w_second_scale, tiles, out, num_k, num_n, num_rows,
                       k_per_split)

    kernel.set_name_prefix(op.symbol, remove_cutlass_symbol=True, keep_mangled_name=False)
    return kernel


class GroupedMatmulFp8:
    """The FP8 grouped matmul kernel (every size a run-time parameter); `compile_variant` builds it."""

    #: Pairs of a tile (the MMA's n) and the shared memory they set.
    pairs = TILE_PAIRS
    layout = StageLayout(TILE_PAIRS)

    @property
    def smem(self) -> int:
        """Dynamic shared bytes of a CTA."""
        return self.layout.smem_bytes

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
                    num_rows, k_per_split).launch(
            grid=[num_tiles, 1, 1], block=[THREADS, 1, 1], smem=self.smem, preferred_smem_carveout=-1,
            min_blocks_per_mp=self.layout.ctas_per_sm if self.layout.ctas_per_sm > 1 else 0)

    # -----------------------------------------------------------------------------------------------------
    # Device code

    kernel = _kernel_entry(abi.GROUPED_MATMUL_FP8)

    @cute.jit
    def run_tiles(self, x: Int64, x_scale: Int64, x_rows: Int64, w: Int64, w_scale: Int64, w_second: Int64,
                  w_second_scale: Int64, tiles: Int64, out: Int64, num_k: Int32, num_n: Int32, num_rows: Int32,
                  k_per_split: Int32):
        """The CTA's units (module docstring): `run` for each, the ring allocated once."""
        cta, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        ring = self.ring(self.smem)
        column_tiles = num_n // TILE_N
        out_n = num_n  # columns of a row of `out`: both weights' with `w_second`
        if w_second != Int64(0):
            out_n = 2 * num_n
        unit_columns = out_n // TILE_N
        splits = (num_k + k_per_split - 1) // k_per_split
        griddepcontrol_wait()  # the tile list and the rows come from the previous kernels
        num_tiles = Int32(load_b32(tiles + 12))  # the non-empty tiles (word 3) come first
        num_units = splits * num_tiles * unit_columns
        stride = balanced_stride(cutlass.max(num_units, Int32(1)), grid)  # no pairs: no unit, but no 0 / 0 either
        if Int32(cta) < stride:
            for unit in range(Int32(cta), num_units, stride):
                rest = unit // unit_columns
                entry = tiles + Int64(rest % num_tiles) * (4 * TILE_WORDS)
                rows = Int32(load_b32(entry + 8))
                split = rest // num_tiles
                k0 = split * k_per_split
                k_end = k0 + k_per_split
                if k_end > num_k:
                    k_end = num_k
                out_n0 = (unit % unit_columns) * TILE_N
                weights = w
                scales = w_scale
                n0 = out_n0
                if out_n0 >= num_n:  # the second weight's columns
                    weights = w_second
                    scales = w_second_scale
                    n0 = out_n0 - num_n
                if rows > 0:
                    self.run(ring, x, x_scale, x_rows, weights, scales,
                             out + Int64(split) * Int64(num_rows) * Int64(out_n) * 4, num_k, num_n, n0, out_n,
                             out_n0, Int32(load_b32(entry)), Int32(load_b32(entry + 4)), rows, k0,
                             (k_end - k0) // TILE_K)
                cute.arch.sync_threads()  # every warp is done with the ring before the next unit's prologue

    @cute.jit
    def store(self, acc, out: Int64, first: Int32, rows: Int32, out_n: Int32, n0: Int32):
        """Writes this thread's FP32 accumulators: pair `8 j + 2 (lane % 4) + e` of the tile (below `rows`), output
        column `n0 + 64 warpgroup + 16 (warp % 4) + lane / 4 + 8 i` of rows of `out_n`."""
        tid, _, _ = cute.arch.thread_idx()
        tid = Int32(tid)
        lane = tid % 32
        column = n0 + (tid // 128) * 64 + ((tid % 128) // 32) * 16 + lane // 4
        for j in cutlass.range_constexpr(self.pairs // 8):
            for e in cutlass.range_constexpr(2):
                p = 8 * j + 2 * (lane % 4) + e
                if p < rows:
                    at = out + (Int64(first + p) * Int64(out_n) + Int64(column)) * 4
                    for i in cutlass.range_constexpr(2):
                        store_f32(at + Int64(32 * i), acc[4 * j + 2 * i + e])

    @cute.jit
    def run(self, ring: Uint32, x: Int64, x_scale: Int64, x_rows: Int64, w: Int64, w_scale: Int64, out: Int64,
            num_k: Int32, num_n: Int32, n0: Int32, out_n: Int32, out_n0: Int32, group: Int32, first: Int32,
            rows: Int32, k0: Int32, steps: Int32):
        """One unit: `rows` pairs from `first` of `group`, the weight's output columns `n0 ..` into `out`'s columns
        `out_n0 ..` (`out_n` a row), contraction `k0 ..` for `steps` stages, through the ring at `ring`."""
        tid, _, _ = cute.arch.thread_idx()
        tid = Int32(tid)
        warpgroup = tid // 128
        lane = tid % 32

        # This thread's copies of a stage: weight lines `tid / 8 + 32 i`, chunk `tid % 8` (16-byte chunk c of line
        # l at c ^ (l % 8)), its pair's (`pair_copies`), and thread `pairs` the weight block's scale.
        chunk = tid % 8
        a_src, a_dst = [], []
        for i in cutlass.range_constexpr(A_CHUNKS):
            line = tid // 8 + (THREADS // 8) * i
            a_src.append(w + (Int64(group) * Int64(num_n) + Int64(n0 + line)) * Int64(num_k) + Int64(k0 + chunk * 16))
            a_dst.append(Uint32(line * LINE_BYTES + ((chunk ^ (line % 8)) * 16)))
        b_live, b_src, b_dst, s_live, s_src = self.pair_copies(x, x_scale, x_rows, first, rows, tid, num_k, k0, A_BYTES)
        ws_src = w_scale + ((Int64(group) * Int64(num_n // TILE_N) + Int64(n0 // TILE_N)) * Int64(num_k // TILE_K)
                            + Int64(k0 // TILE_K)) * 4

        # slot 0's descriptors; a slot's, one 32-bit add on (`smem_descriptor_advance`)
        ring_a = smem_descriptor(ring + Uint32(warpgroup * 64 * LINE_BYTES), 16, 1024)
        ring_b = smem_descriptor(ring + Uint32(A_BYTES), 16, 1024)
        acc = cute.make_rmem_tensor(cute.make_layout(self.layout.acc), cutlass.Float32)
        acc.fill(0.0)
        ahead = self.layout.stages - 1
        for s in cutlass.range_constexpr(ahead):
            if s < steps:
                self.load_stage(ring + Uint32(s * self.layout.stage_bytes), Int32(s), tid, a_src, a_dst, b_live,
                                b_src, b_dst, s_live, s_src, ws_src, x, x_scale)
            cp_async_commit()

        # Invariant at the barrier of step kt: stage kt is in shared memory, and every MMA of step kt - 1 completed
        # (each warpgroup waits for its own before its promotion), so its slot takes step kt + ahead. Not unrolled:
        # one copy of the body (LLVM unrolled the 8-pair tile's).
        for kt in cutlass.range(steps, unroll=1):
            cp_async_wait(ahead - 1)
            fence_proxy_async_shared()
            cute.arch.sync_threads()
            if kt + ahead < steps:
                self.load_stage(ring + Uint32(((kt + ahead) % self.layout.stages) * self.layout.stage_bytes),
                                kt + ahead, tid, a_src, a_dst, b_live, b_src, b_dst, s_live, s_src, ws_src, x, x_scale)
            cp_async_commit()
            slot_units = Uint32((kt % self.layout.stages) * (self.layout.stage_bytes // 16))
            slot = ring + slot_units * Uint32(16)
            wgmma_fence()
            parts = []
            for kb in cutlass.range_constexpr(TILE_K // BLOCK_K):
                desc_a = smem_descriptor_advance(ring_a, slot_units + Uint32(kb * BLOCK_K // 16))
                desc_b = smem_descriptor_advance(ring_b, slot_units + Uint32(kb * BLOCK_K // 16))
                parts.append(wgmma_e4m3_m64k32(desc_a, desc_b, self.pairs))
            wgmma_commit()
            wgmma_wait(0)
            self.promote(acc, parts, slot, lane)

        self.store(acc, out, first, rows, out_n, out_n0)

    @cute.jit
    def ring(self, smem_bytes: cutlass.Constexpr[int]):
        """The shared address of the CTA's `smem_bytes`, rounded up to the 1024-byte swizzle atom."""
        smem = cutlass.memory.SmemAllocator()
        raw = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(smem_bytes), 1024)
        return (Uint32(raw.iterator.toint()) + Uint32(1023)) & Uint32(0xFFFFFC00)

    @cute.jit
    def pair_copies(self, x: Int64, x_scale: Int64, x_rows: Int64, first: Int32, rows: Int32, tid: Int32, num_k: Int32,
                    k0: Int32, b_offset: int):
        """This thread's share of the pairs' part of every stage: chunk `tid % 8` of pair line `tid / 8` (swizzled,
        at `b_offset` in the stage; the first `8 pairs` threads) and, for the first `pairs` threads, pair `tid`'s
        scale word, each pair's row of `x` its own (`x_rows` 0) or `x_rows[pair]`; returns `(line live, its source,
        its place, scale live, its source)`, sources of the stage at contraction `k0`."""
        chunk = tid % 8
        pair = tid // 8
        line_row = first + pair
        scale_row = first + tid
        if x_rows != Int64(0):
            if pair < rows:
                line_row = Int32(load_b32(x_rows + Int64(first + pair) * 4))
            if tid < rows:
                scale_row = Int32(load_b32(x_rows + Int64(first + tid) * 4))
        b_src = x + Int64(line_row) * Int64(num_k) + Int64(k0 + chunk * 16)
        b_dst = Uint32(b_offset + pair * LINE_BYTES + ((chunk ^ (pair % 8)) * 16))
        s_src = x_scale + Int64(scale_row) * Int64(num_k // BLOCK_K) + Int64(k0 // BLOCK_K)
        return pair < rows, b_src, b_dst, tid < rows, s_src

    @cute.jit
    def load_pairs(self, slot: Uint32, stage: Int32, tid: Int32, b_live, b_src: Int64, b_dst: Uint32, s_live,
                   s_src: Int64, x_base: Int64, s_base: Int64, x_scale_offset: int):
        """Issues this thread's pair copies of stage `stage` (`pair_copies`): 16 zero bytes naming `x_base` past the
        tile's pairs, a zero scale word naming `s_base` past them; threads past the tile's lines copy none."""
        if cutlass.const_expr(8 * self.pairs == THREADS):
            self.load_line(slot, stage, b_live, b_src, b_dst, x_base)
        else:
            if tid < 8 * self.pairs:
                self.load_line(slot, stage, b_live, b_src, b_dst, x_base)
        if tid < self.pairs:
            src = s_base
            size = Uint32(0)
            if s_live:
                src = s_src + Int64(stage) * 4
                size = Uint32(4)
            cp_async_4(slot + Uint32(x_scale_offset) + Uint32(4) * Uint32(tid), src, size)

    @cute.jit
    def load_line(self, slot: Uint32, stage: Int32, b_live, b_src: Int64, b_dst: Uint32, x_base: Int64):
        """Issues this thread's 16 bytes of a pair line (zeros naming `x_base` past the tile's pairs)."""
        src = x_base
        size = Uint32(0)
        if b_live:
            src = b_src + Int64(stage) * TILE_K
            size = Uint32(16)
        cp_async_16(slot + b_dst, src, size)

    @cute.jit
    def promote(self, acc, parts, slot: Uint32, lane: Int32):
        """Adds each 32-deep block's product (`parts[kb]`, ascending) to `acc` times its pairs' scales: one FMA a
        value, the scale `2^(s - 127) * w_scale` one FP32 product (s = 0 gives 0)."""
        ws = load_shared_f32(slot + Uint32(self.layout.w_scale_offset))
        words = []
        for j in cutlass.range_constexpr(self.pairs // 8):
            for e in cutlass.range_constexpr(2):
                words.append(load_shared_b32(slot + Uint32(self.layout.x_scale_offset) + Uint32(4 * (8 * j + e))
                                             + Uint32(8) * Uint32(lane % 4)))
        for kb in cutlass.range_constexpr(TILE_K // BLOCK_K):
            part = parts[kb]
            for j in cutlass.range_constexpr(self.pairs // 8):
                for e in cutlass.range_constexpr(2):
                    s = (words[2 * j + e] >> Uint32(8 * kb)) & Uint32(0xFF)
                    scale = mul_rn(f32_from_bits(s << Uint32(23)), ws)
                    for i in cutlass.range_constexpr(2):
                        k = 4 * j + 2 * i + e
                        acc[k] = fma_rn(part[k], scale, acc[k])

    @cute.jit
    def load_stage(self, slot: Uint32, stage: Int32, tid: Int32, a_src, a_dst, b_live, b_src: Int64, b_dst: Uint32,
                   s_live, s_src: Int64, ws_src: Int64, x_base: Int64, s_base: Int64):
        """Issues this thread's copies of stage `stage` into `slot`: its weight chunks, its pair chunk (16 zero
        bytes, naming `x_base`, past the tile's pairs), its pair's scale word (zeros past them) and the weight
        block's scale."""
        for i in cutlass.range_constexpr(A_CHUNKS):
            cp_async_16(slot + a_dst[i], a_src[i] + Int64(stage) * TILE_K, Uint32(16))
        self.load_pairs(slot, stage, tid, b_live, b_src, b_dst, s_live, s_src, x_base, s_base,
                        self.layout.x_scale_offset)
        if tid == self.pairs:
            cp_async_4(slot + Uint32(self.layout.w_scale_offset), ws_src + Int64(stage) * 4, Uint32(4))




# ---------------------------------------------------------------------------------------------------------
# MXFP4 weights: e2m1 codes two a byte and an E8M0 scale per 32 inputs, `[out, in]` (`experts.MXFP4`), widened to
# e4m3 in shared memory (every e2m1 value is exact in e4m3) and multiplied on the same tensor cores, each 32-deep
# block promoted with `(2^(s_w - 127) * 2^6) * 2^(s_x - 127)` (2^6 undoing the widening's 2^-6; one FP32 product).

class GroupedMatmulMxfp4(GroupedMatmulFp8):
    """The grouped matmul on MXFP4 weights (every size a run-time parameter); `compile_variant` builds
    it. As `GroupedMatmulFp8`, but the weights arrive as packed codes through the ring and each stage is widened to
    e4m3 times 2^-6 (`e2m1x8_to_e4m3x8_scaled`, 9 instructions for 8 codes) into a tile of its own while the previous
    stage's MMAs run; the promotion carries the 2^6 back (a power of two: exact), the tensor core's block sum
    nearly scale-free (docs/experts.md)."""

    @property
    def smem(self) -> int:
        return self.layout.mx_smem_bytes

    kernel = _kernel_entry(abi.GROUPED_MATMUL_MXFP4)

    @cute.jit
    def run(self, ring: Uint32, x: Int64, x_scale: Int64, x_rows: Int64, w: Int64, w_scale: Int64, out: Int64,
            num_k: Int32, num_n: Int32, n0: Int32, out_n: Int32, out_n0: Int32, group: Int32, first: Int32,
            rows: Int32, k0: Int32, steps: Int32):
        """One unit: `rows` pairs from `first` of `group`, the weight's output columns `n0 ..` into `out`'s columns
        `out_n0 ..` (`out_n` a row), contraction `k0 ..` for `steps` stages, through the ring at `ring`."""
        tid, _, _ = cute.arch.thread_idx()
        tid = Int32(tid)
        warpgroup = tid // 128
        lane = tid % 32

        # This thread's copies of a stage: packed chunks `tid + 256 i` (row / 4, 32 inputs % 4), its pair's
        # (`pair_copies`), and the last 128 threads a weight row's scale word.
        a_src, a_dst = [], []
        for i in cutlass.range_constexpr(MX_CHUNKS):
            idx = tid + THREADS * i
            a_src.append(w + (Int64(group) * Int64(num_n) + Int64(n0 + idx // 4)) * Int64(num_k // 2)
                         + Int64(k0 // 2 + (idx % 4) * 16))
            a_dst.append(Uint32(self.layout.mx_packed_offset) + Uint32(idx * 16))
        b_live, b_src, b_dst, s_live, s_src = self.pair_copies(x, x_scale, x_rows, first, rows, tid, num_k, k0, 0)
        ws_src = w_scale + (Int64(group) * Int64(num_n) + Int64(n0 + tid - 128)) * Int64(num_k // BLOCK_K) + Int64(
            k0 // BLOCK_K)

        lay = self.layout
        # slot 0's and tile 0's descriptors; the others', one 32-bit add on (`smem_descriptor_advance`)
        ring_b = smem_descriptor(ring, 16, 1024)
        tile_a = smem_descriptor(ring + Uint32(lay.mx_tiles_offset + warpgroup * 64 * LINE_BYTES), 16, 1024)
        acc = cute.make_rmem_tensor(cute.make_layout(lay.acc), cutlass.Float32)
        acc.fill(0.0)
        ahead = lay.stages - 1
        for s in cutlass.range_constexpr(ahead):
            if s < steps:
                self.load_mx(ring + Uint32(s * lay.mx_stage_bytes), Int32(s), tid, a_src, a_dst, b_live, b_src, b_dst,
                             s_live, s_src, ws_src, x, x_scale)
            cp_async_commit()
        cp_async_wait(ahead - 1)
        cute.arch.sync_threads()
        self.widen(ring, ring + Uint32(lay.mx_tiles_offset), tid)

        # Invariant at the barrier of step kt: stages kt and kt + 1 are in the ring, stage kt widened into tile
        # kt % 2 (fenced for the async proxy), every MMA of step kt - 1 completed: tile (kt + 1) % 2 takes stage
        # kt + 1 while stage kt's MMAs run, and ring slot kt - 1 takes step kt + ahead.
        for kt in range(steps):
            cp_async_wait(ahead - 2)
            fence_proxy_async_shared()
            cute.arch.sync_threads()
            if kt + ahead < steps:
                self.load_mx(ring + Uint32(((kt + ahead) % lay.stages) * lay.mx_stage_bytes), kt + ahead, tid, a_src,
                             a_dst, b_live, b_src, b_dst, s_live, s_src, ws_src, x, x_scale)
            cp_async_commit()
            slot_units = Uint32((kt % lay.stages) * (lay.mx_stage_bytes // 16))
            slot = ring + slot_units * Uint32(16)
            tile_units = Uint32((kt % 2) * (A_BYTES // 16))
            wgmma_fence()
            parts = []
            for kb in cutlass.range_constexpr(TILE_K // BLOCK_K):
                desc_a = smem_descriptor_advance(tile_a, tile_units + Uint32(kb * BLOCK_K // 16))
                desc_b = smem_descriptor_advance(ring_b, slot_units + Uint32(kb * BLOCK_K // 16))
                parts.append(wgmma_e4m3_m64k32(desc_a, desc_b, self.pairs))
            wgmma_commit()
            if kt + 1 < steps:
                self.widen(ring + Uint32(((kt + 1) % lay.stages) * lay.mx_stage_bytes),
                           ring + Uint32(lay.mx_tiles_offset) + Uint32(((kt + 1) % 2) * A_BYTES), tid)
            wgmma_wait(0)
            self.promote_mx(acc, parts, slot, tid, lane)

        self.store(acc, out, first, rows, out_n, out_n0)

    @cute.jit
    def widen(self, slot: Uint32, tile: Uint32, tid: Int32):
        """This thread's packed chunks of the stage in `slot` (32 inputs of a row each) as e4m3 into `tile`: the
        row's line, 16-byte chunks `2 c` and `2 c + 1` at their swizzled places."""
        for i in cutlass.range_constexpr(MX_CHUNKS):
            idx = tid + THREADS * i
            row = idx // 4
            c = idx % 4
            words = load_shared_v4(slot + Uint32(self.layout.mx_packed_offset) + Uint32(idx * 16))
            wide = []
            for word in words:
                wide.extend(e2m1x8_to_e4m3x8_scaled(word))
            line = tile + Uint32(row * LINE_BYTES)
            store_shared_v4(line + Uint32(((2 * c) ^ (row % 8)) * 16), wide[:4])
            store_shared_v4(line + Uint32(((2 * c + 1) ^ (row % 8)) * 16), wide[4:])

    @cute.jit
    def promote_mx(self, acc, parts, slot: Uint32, tid: Int32, lane: Int32):
        """Adds each 32-deep block's product (`parts[kb]`, ascending) to `acc` times `(2^(s_w - 127) * 2^6) *
        2^(s_x - 127)` of its weight row and pair (the widening's 2^-6 undone; 0 where either code is 0): one FMA
        a value."""
        row = (tid // 128) * 64 + ((tid % 128) // 32) * 16 + lane // 4
        row_words = []
        for i in cutlass.range_constexpr(2):
            row_words.append(load_shared_b32(slot + Uint32(self.layout.mx_w_scale_offset) + Uint32(4)
                                             * Uint32(row + 8 * i)))
        words = []
        for j in cutlass.range_constexpr(self.pairs // 8):
            for e in cutlass.range_constexpr(2):
                words.append(load_shared_b32(slot + Uint32(self.layout.mx_x_scale_offset) + Uint32(4 * (8 * j + e))
                                             + Uint32(8) * Uint32(lane % 4)))
        for kb in cutlass.range_constexpr(TILE_K // BLOCK_K):
            part = parts[kb]
            w_pow = []  # 2^(s_w - 127) * 2^6: the 2^6 undoes the widening's 2^-6, exact below s_w = 249
            for i in cutlass.range_constexpr(2):
                w_pow.append(mul_rn(f32_from_bits(((row_words[i] >> Uint32(8 * kb)) & Uint32(0xFF)) << Uint32(23)),
                                    Float32(64.0)))
            for j in cutlass.range_constexpr(self.pairs // 8):
                for e in cutlass.range_constexpr(2):
                    x_pow = f32_from_bits(((words[2 * j + e] >> Uint32(8 * kb)) & Uint32(0xFF)) << Uint32(23))
                    for i in cutlass.range_constexpr(2):
                        k = 4 * j + 2 * i + e
                        acc[k] = fma_rn(part[k], mul_rn(w_pow[i], x_pow), acc[k])

    @cute.jit
    def load_mx(self, slot: Uint32, stage: Int32, tid: Int32, a_src, a_dst, b_live, b_src: Int64, b_dst: Uint32,
                s_live, s_src: Int64, ws_src: Int64, x_base: Int64, s_base: Int64):
        """Issues this thread's copies of stage `stage` into `slot`: its packed chunks, its pair chunk (16 zero
        bytes, naming `x_base`, past the tile's pairs), its pair's scale word (zeros past them), its weight row's
        scale word."""
        for i in cutlass.range_constexpr(MX_CHUNKS):
            cp_async_16(slot + a_dst[i], a_src[i] + Int64(stage) * (TILE_K // 2), Uint32(16))
        self.load_pairs(slot, stage, tid, b_live, b_src, b_dst, s_live, s_src, x_base, s_base,
                        self.layout.mx_x_scale_offset)
        if tid >= THREADS - TILE_N:
            cp_async_4(slot + Uint32(self.layout.mx_w_scale_offset) + Uint32(4) * Uint32(tid - (THREADS - TILE_N)),
                       ws_src + Int64(stage) * 4, Uint32(4))


# ---------------------------------------------------------------------------------------------------------
# The smaller tiles: decode's few pairs an expert (`VARIANTS`).


def _smaller_tiles(base: type, op: str, pairs: int) -> type:
    """`base` (the kernel of `op`) on tiles of `pairs` pairs (`m64n<pairs>k32`): less MMA, promotion and pair
    copies a stage; its own cubin, `<op>_n<pairs>`."""
    return type(f"{base.__name__}N{pairs}", (base,), {
        "__doc__": f"`{base.__name__}` on tiles of {pairs} pairs (`m64n{pairs}k32`).", "pairs": pairs,
        "layout": StageLayout(pairs), "kernel": _kernel_entry(abi.KERNELS[f"{op}_n{pairs}"])})


#: kernel -> its class
CLASSES = {"grouped_matmul_fp8": GroupedMatmulFp8, "grouped_matmul_mxfp4": GroupedMatmulMxfp4}
CLASSES.update({f"{op}_n{p}": _smaller_tiles(base, op, p) for op, base in tuple(CLASSES.items())
                for p in SMALL_TILE_PAIRS})


# ---------------------------------------------------------------------------------------------------------
# Compile


def compile_variant(kernel: str, arch: str = "sm_90a"):
    """Compiles `kernel` (one of `VARIANTS`) for `arch` (sm_90a only: `wgmma` e4m3); returns `(symbol, cubin
    bytes)`."""
    return compile_cubin(abi.KERNELS[kernel], CLASSES[kernel](), arch)

