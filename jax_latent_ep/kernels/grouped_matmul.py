"""EpGroupedMatmul / EpGroupedMatmulWgrad: the grouped matmuls of training and prefill sizes on Hopper's warpgroup MMA
(BF16 in, FP32 accumulation, BF16 out) for pairs sorted by group: `out[p] = x[p] @ w[group of p]` in tiles that
follow the groups, and the weights' gradient `dw[g] = x_g^T @ dy_g` over each group's pairs.

Reading order: settings, the host-side launch signatures, the device code, compile. No JAX here.

Parameters: `kernels.abi.GROUPED_MATMUL`, `kernels.abi.GROUPED_MATMUL_WGRAD`.

`GroupedMatmul`: a tile is at most `TILE_M` consecutive pairs of one group (the caller lists them: `(group, first
pair, pairs)`, the used tiles first, then tiles of 0 pairs); with `C = ceil(num_n / FORWARD_TILE_N)` CTAs a tile,
CTA `c` computes tile `c / C` times the `FORWARD_TILE_N` columns `c % C` of its group's weight (the last CTA's
columns past `num_n` zero-filled and never stored; a group's tiles run side by side, so its weight is read from HBM
about once), and a CTA of an empty tile returns at once: the work follows the pairs, not the worst case. A pair's
row of `x` is its own or the one `x_rows` names (the receive rows: no gather). Rows past the tile's pairs are
zero-filled and never stored. With `w_up` (a SwiGLU's gate `w` and up `w_up`, MN-major), a CTA's columns are
gate's `FORWARD_TILE_N / 2` columns `n0 ..` and up's same ones: it stores `h = bf16(silu(gate) * up)` of the
bf16-rounded pair (`primitives.silu_mul`) and, where asked, the bf16 gate and up (`gate_up`, the backward's residual,
blocks of gate's and up's columns alternating).

`GroupedMatmulWgrad`: with `C = ceil(num_n / WGRAD_TILE_N / tiles_per_cta)` CTAs a row of blocks, CTA `c`
computes, in turn, the `TILE_M x WGRAD_TILE_N` blocks of rows `(c / C) % (num_k / TILE_M)` and columns `(c % C)
tiles_per_cta ..` of group `c / (C num_k / TILE_M)`'s gradient, each contracting over the group's pairs `TILE_K` at a
time (rows past the group zero-filled; the ring runs on from one block to the next; columns past `num_n` zero-filled
and never stored); an empty group's blocks are 0. Each block leaves through a buffer of its own, in 16-byte stores
of whole rows.

Both run the contraction on a warp-specialized CTA (`Ring`): a producer warpgroup's ring of `cp.async` copies into
shared memory laid out as `wgmma` reads it with the 128-byte swizzle (16-byte chunk `c` of a 128-byte line `l` at
chunk `c ^ (l % 8)`, 1024-byte atoms): a K-major operand a line per row (64 contraction elements), an MN-major one a
line per contraction row and 64-column block, the blocks `MN_BLOCK_BYTES` apart. Each of two consumer warpgroups
multiplies its 64 rows by the block's columns with `wgmma.mma_async.m64n<columns>k16`, four a stage, while the next
stages' copies land; `mbarrier`s hand the ring's slots between them.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from jax_latent_ep.kernels import abi
from jax_latent_ep.kernels.common import compile_cubin
from jax_latent_ep.kernels.primitives import (
    cp_async_4,
    cp_async_16,
    cp_async_commit,
    cp_async_wait,
    fence_proxy_async_shared,
    bf16x2,
    griddepcontrol_wait,
    load_b32,
    load_shared_v4,
    mbarrier_arrive,
    mbarrier_init,
    mbarrier_wait,
    named_barrier_sync,
    round_bf16,
    set_max_registers,
    silu_mul,
    smem_descriptor,
    store_shared_b32,
    store_v4,
    wgmma_bf16_m64k16,
    wgmma_commit,
    wgmma_fence,
    wgmma_wait,
)

# ---------------------------------------------------------------------------------------------------------
# Settings

#: Rows of one CTA's block: two consumer warpgroups of 64 (the forward: pairs of a tile; the gradient: rows of
#: `dw[g]`).
TILE_M = abi.MATMUL_TILE_M
#: The narrower block (one `wgmma` n128; a CTA's columns are `TILE_N` or twice that).
TILE_N = abi.MATMUL_TILE_N
#: Contraction step of one stage: a 128-byte line of BF16.
TILE_K = abi.MATMUL_TILE_K
#: A warp-specialized CTA: a producer warpgroup of `cp.async` copies, `THREADS` consumers of MMAs. Registers a
#: thread: the producer's `PRODUCER_REGS`, the rest to the consumers' accumulators.
THREADS = 256
PRODUCER_THREADS = 128
FORWARD_THREADS = PRODUCER_THREADS + THREADS
PRODUCER_REGS = 88
#: The forward: `TILE_M x FORWARD_TILE_N` blocks, one CTA an SM, a ring of `FORWARD_STAGES` (48 KB each); the
#: producer marks a stage landed `FORWARD_LAG` stages after issuing it (its copies' completion is waited for per
#: thread).
FORWARD_TILE_N = abi.MATMUL_FORWARD_TILE_N
FORWARD_STAGES = 4
FORWARD_LAG = 2
FORWARD_CTAS_PER_SM = 1
#: The weights' gradient: the same CTA, its `TILE_M x WGRAD_TILE_N` blocks in turn through a ring of
#: `WGRAD_STAGES`, each block stored through a 64 KB buffer of its own while the next block's stages land.
WGRAD_TILE_N = abi.MATMUL_WGRAD_TILE_N
WGRAD_STAGES = 3
WGRAD_LAG = 1
#: The named barrier of the consumer warpgroups' epilogue (0 is `sync_threads`').
EPILOGUE_BARRIER = 1
LINE_BYTES = 128
#: An MN-major operand's 64-column block of one stage: `TILE_K` lines.
MN_BLOCK_BYTES = TILE_K * LINE_BYTES
A_STAGE_BYTES = TILE_M * LINE_BYTES


#: Words of a tile of the list.
TILE_WORDS = abi.MATMUL_TILE_WORDS


def launch_shape(kernel: str = "grouped_matmul") -> tuple[int, int]:
    """(threads per CTA, dynamic shared bytes) of `kernel` ("grouped_matmul" or "grouped_matmul_wgrad")."""
    return FORWARD_THREADS, (GroupedMatmul() if kernel == "grouped_matmul" else GroupedMatmulWgrad()).smem_bytes


# ---------------------------------------------------------------------------------------------------------
# The pipeline both kernels run: a warp-specialized CTA's stages of two operands into its consumers' accumulators.


class Ring:
    """Device helpers of a warp-specialized CTA: warpgroup 0 (the producer) copies stages into the ring, warpgroups 1
    and 2 (the consumers) multiply 64 rows each; stage `t` (counted on across a CTA's blocks) goes through slot `t %
    stages`, a `full` barrier a slot (the producer's `PRODUCER_THREADS` arrivals: its bytes landed) and an `empty`
    one (the consumers' `THREADS / 32` warps: its MMAs done). `stages`, `lag` (the stages the producer's copies run
    before it marks them landed), `ctas_per_sm`, `tile_n`; `epilogue_bytes`: a buffer of the consumers' own for the
    blocks' stores (0: the ring's, free after the last stage); `extra_stage_bytes`: a stage's bytes past its two
    operands (a multiple of 1024: the next stage's swizzle atoms); `producer_regs`: the producer's registers a
    thread (the rest the consumers'). `wait_suspend_ns`: how long a barrier wait's try may suspend (`mbarrier_wait`;
    0: the hardware's default)."""

    def __init__(self, stages: int, lag: int, ctas_per_sm: int, tile_n: int, epilogue_bytes: int = 0,
                 extra_stage_bytes: int = 0, producer_regs: int = PRODUCER_REGS, wait_suspend_ns: int = 0):
        if not 1 <= lag <= stages - 2:
            # Past stages - 2 the producer would wait for a slot freed only after a stage it has not yet marked.
            raise ValueError(f"stages={stages}, lag={lag}: need 1 <= lag <= stages - 2")
        if tile_n not in (TILE_N, 2 * TILE_N):
            raise ValueError(f"tile_n={tile_n}: a block is {TILE_N} or {2 * TILE_N} columns")
        self.stages, self.lag, self.ctas_per_sm, self.tile_n = stages, lag, ctas_per_sm, tile_n
        if wait_suspend_ns < 0:
            raise ValueError(f"wait_suspend_ns={wait_suspend_ns} must be >= 0")
        self.wait_suspend_ns = wait_suspend_ns
        if extra_stage_bytes % 1024:
            raise ValueError(f"extra_stage_bytes={extra_stage_bytes} must be a multiple of 1024")
        self.stage_bytes = A_STAGE_BYTES + tile_n * LINE_BYTES + extra_stage_bytes
        self.epilogue_bytes = epilogue_bytes
        # The ring (from the first 1024-byte boundary: the swizzle atoms), the buffer, a full and an empty barrier a
        # stage.
        self.smem_bytes = stages * self.stage_bytes + 1024 + epilogue_bytes + 16 * stages
        # Registers a thread: the CTA's pool at launch (`FORWARD_THREADS` of `base`), the producer's given to the
        # consumers' accumulators.
        base = 65536 // (FORWARD_THREADS * ctas_per_sm) // 8 * 8
        self.producer_regs = min(producer_regs, base)
        self.consumer_regs = min(256, (FORWARD_THREADS * base - PRODUCER_THREADS * self.producer_regs) // THREADS
                                 // 8 * 8)
        if self.consumer_regs < tile_n // 2 + 40:
            raise ValueError(f"ctas_per_sm={ctas_per_sm}, tile_n={tile_n}: {self.consumer_regs} registers a "
                             f"consumer thread hold too few beside {tile_n // 2} accumulators")

    def launch_options(self, grid) -> dict:
        return dict(grid=grid, block=[FORWARD_THREADS, 1, 1], smem=self.smem_bytes, preferred_smem_carveout=-1,
                    min_blocks_per_mp=self.ctas_per_sm if self.ctas_per_sm > 1 else 0)

    @cute.jit
    def shared(self):
        """`(ring, full, empty, epilogue)` shared addresses, the barriers initialized for every thread (a CTA
        barrier)."""
        tid, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        raw = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(self.smem_bytes), 1024)
        ring = (Uint32(raw.iterator.toint()) + Uint32(1023)) & Uint32(0xFFFFFC00)
        epilogue = ring + Uint32(self.stages * self.stage_bytes)
        full = epilogue + Uint32(self.epilogue_bytes)
        empty = full + Uint32(8 * self.stages)
        if Int32(tid) == 0:
            for s in cutlass.range_constexpr(self.stages):
                mbarrier_init(full + Uint32(8 * s), Uint32(PRODUCER_THREADS))
                mbarrier_init(empty + Uint32(8 * s), Uint32(THREADS // 32))
        cute.arch.sync_threads()
        return ring, full, empty, epilogue

    @cute.jit
    def copy_chunk(self, dst: Uint32, base: Int64, src: Int64, live, nbytes: cutlass.Constexpr[int] = 16):
        """The producer: one chunk of `nbytes` (16, or 4: a word) into shared `dst`, from `src` if `live`, else
        zeros (naming `base`, the operand's start, never read)."""
        address = base
        size = Uint32(0)
        if live:
            address = src
            size = Uint32(nbytes)
        if cutlass.const_expr(nbytes == 16):
            cp_async_16(dst, address, size)
        else:
            cp_async_4(dst, address, size)

    @cute.jit
    def wait_free(self, empty: Uint32, t: Int32):
        """The producer, before copying stage `t`: its slot's previous stage `t - stages` was multiplied."""
        if t >= self.stages:
            mbarrier_wait(empty + Uint32(8) * Uint32(t % self.stages), Uint32((t // self.stages + 1) % 2),
                          self.wait_suspend_ns)

    @cute.jit
    def mark_landed(self, full: Uint32, t: Int32):
        """The producer, after issuing stage `t`'s copies: commits them, then marks stage `t - lag` landed (its own
        copies of it completed and fenced for `wgmma`, then its arrival)."""
        cp_async_commit()
        if t >= self.lag:
            cp_async_wait(self.lag)
            fence_proxy_async_shared()
            mbarrier_arrive(full + Uint32(8) * Uint32((t - self.lag) % self.stages))

    @cute.jit
    def mark_all_landed(self, full: Uint32, total: Int32):
        """The producer, after its last stage (`total` in all): marks the last `lag` landed."""
        cp_async_wait(0)
        fence_proxy_async_shared()
        for j in cutlass.range_constexpr(self.lag):
            u = total - self.lag + j
            if u >= 0:
                mbarrier_arrive(full + Uint32(8) * Uint32(u % self.stages))

    @cute.jit
    def multiply(self, acc, ring: Uint32, full: Uint32, t: Int32, warpgroup: Int32, a_mn_major: cutlass.Constexpr,
                 b_mn_major: cutlass.Constexpr):
        """A consumer warpgroup: once stage `t` landed, issues its MMAs into `acc` and waits for the previous
        stage's (one stage's left in flight)."""
        mbarrier_wait(full + Uint32(8) * Uint32(t % self.stages), Uint32((t // self.stages) % 2), self.wait_suspend_ns)
        wgmma_fence()
        self.multiply_stage(acc, ring + Uint32(t % self.stages) * Uint32(self.stage_bytes), warpgroup, a_mn_major,
                            b_mn_major)
        wgmma_commit()
        wgmma_wait(1)

    @cute.jit
    def release(self, empty: Uint32, t: Int32):
        """A consumer warp: stage `t`'s MMAs (its own) completed; its slot may take the next stage."""
        tid, _, _ = cute.arch.thread_idx()
        if Int32(tid) % 32 == 0:
            mbarrier_arrive(empty + Uint32(8) * Uint32(t % self.stages))

    @cute.jit
    def multiply_stage(self, acc, slot: Uint32, warpgroup: Int32, a_mn_major: cutlass.Constexpr,
                       b_mn_major: cutlass.Constexpr):
        """Issues the stage's four `wgmma` k16 of this warpgroup's 64 rows of A by the `tile_n` columns of B into
        `acc`. A K-major operand advances 32 bytes a k16 within its lines (8-line groups 1024 bytes apart); an
        MN-major one two 8-line atoms (2 KB) in each 64-column block (blocks `MN_BLOCK_BYTES` apart; a warpgroup's
        64 rows of an MN-major A are one block)."""
        for k16 in cutlass.range_constexpr(TILE_K // 16):
            if cutlass.const_expr(a_mn_major):
                desc_a = smem_descriptor(slot + Uint32(warpgroup * MN_BLOCK_BYTES + k16 * 2048), MN_BLOCK_BYTES, 1024)
            else:
                desc_a = smem_descriptor(slot + Uint32(warpgroup * 64 * LINE_BYTES + k16 * 32), 16, 1024)
            b_tile = slot + Uint32(A_STAGE_BYTES)
            if cutlass.const_expr(b_mn_major):
                desc_b = smem_descriptor(b_tile + Uint32(k16 * 2048), MN_BLOCK_BYTES, 1024)
            else:
                desc_b = smem_descriptor(b_tile + Uint32(k16 * 32), 16, 1024)
            new = wgmma_bf16_m64k16([acc[i] for i in range(self.tile_n // 2)], desc_a, desc_b, a_mn_major,
                                    b_mn_major)
            for i, value in enumerate(new):  # a Python loop over the registers: unrolled as traced
                acc[i] = value

    @cute.jit
    def consumer_thread(self):
        """This thread's index among the consumers' `THREADS` (threads `PRODUCER_THREADS ..`)."""
        tid, _, _ = cute.arch.thread_idx()
        return Int32(tid) - PRODUCER_THREADS

    @cute.jit
    def consumers_sync(self):
        """The barrier of the consumer warpgroups alone (the producer may have finished)."""
        named_barrier_sync(EPILOGUE_BARRIER, THREADS)

    @cute.jit
    def store_staged(self, acc, slot: Uint32, out: Int64, row0: Int64, rows: Int32, num_n: Int32, n0: Int32):
        """The consumers' block into `out` rows `row0 + r` (`r < rows`), columns `n0 ..` below `num_n` as BF16,
        through `slot` (free shared memory of `TILE_M * tile_n * 2` bytes): each thread's accumulators as BF16
        pairs into the `TILE_M x tile_n` block (`2 tile_n`-byte lines, 16-byte chunk `c` of line `r` at `c ^ (r %
        8)` within its 128 bytes: conflict-free both ways), then each row out in 16-byte stores (`rows_out`: full
        sectors)."""
        tid = self.consumer_thread()
        lane = tid % 32
        block_row = (tid // 128) * 64 + ((tid % 128) // 32) * 16 + lane // 4
        self.consumers_sync()  # every warpgroup's MMAs have read the slot
        for i in cutlass.range_constexpr(2):
            r = block_row + 8 * i
            line = slot + Uint32(r * (self.tile_n * 2) + 4 * (lane % 4))
            for j in cutlass.range_constexpr(self.tile_n // 8):
                store_shared_b32(line + Uint32((j ^ (r % 8)) * 16), bf16x2(acc[4 * j + 2 * i], acc[4 * j + 2 * i + 1]))
        self.consumers_sync()
        self.rows_out(slot, self.tile_n * 2, out, row0, rows, num_n, n0)

    @cute.jit
    def rows_out(self, slot: Uint32, line_bytes: cutlass.Constexpr, out: Int64, row0: Int64, rows: Int32,
                 num_n: Int32, n0: Int32):
        """Copies the block staged in `slot` (`TILE_M` lines of `line_bytes`, 16-byte chunk `c` of line `r` at `c ^
        (r % 8)`) to `out` rows `row0 + r` (`r < rows`), columns `n0 ..` below `num_n`, in 16-byte stores of whole
        rows."""
        tid = self.consumer_thread()
        chunks = line_bytes // 16
        chunk = tid % chunks
        for k in cutlass.range_constexpr(TILE_M * line_bytes // 16 // THREADS):
            r = tid // chunks + (THREADS // chunks) * k
            words = load_shared_v4(slot + Uint32(r * line_bytes + (chunk ^ (r % 8)) * 16))
            if r < rows and n0 + chunk * 8 < num_n:
                store_v4(out + ((row0 + Int64(r)) * Int64(num_n) + Int64(n0 + chunk * 8)) * 2, words)

    @cute.jit
    def store_glu(self, acc, slot: Uint32, gate_up: Int64, h: Int64, row0: Int64, rows: Int32, num_h: Int32,
                  h0: Int32):
        """The epilogue of a SwiGLU block (the first `tile_n / 2` columns of `acc` gate's `h0 ..`, the rest up's):
        the block as BF16 into `gate_up` (`[P, 2 num_h]`, at columns `2 h0 ..`) unless 0, then `h =
        bf16(silu_mul(gate, up))` of the bf16-rounded pair through `slot` (`tile_n`-byte lines, 16-byte chunk `c` of
        line `r` at `c ^ (r % 8)`: conflict-free both ways) into `h` `[P, num_h]` rows `row0 + r` (`r < rows`),
        columns `h0 ..`, in 16-byte stores of whole rows."""
        if gate_up != Int64(0):
            self.store_staged(acc, slot, gate_up, row0, rows, num_h * 2, h0 * 2)
        tid = self.consumer_thread()
        lane = tid % 32
        block_row = (tid // 128) * 64 + ((tid % 128) // 32) * 16 + lane // 4
        self.consumers_sync()  # every MMA and every `gate_up` chunk has left the slot
        half = self.tile_n // 2  # gate's columns, then up's: the same thread holds column c of both
        for i in cutlass.range_constexpr(2):
            r = block_row + 8 * i
            line = slot + Uint32(r * (half * 2) + 4 * (lane % 4))
            for j in cutlass.range_constexpr(half // 8):
                g, u = 4 * j + 2 * i, 4 * (j + half // 8) + 2 * i
                word = bf16x2(*(silu_mul(round_bf16(acc[g + e]), round_bf16(acc[u + e])) for e in range(2)))
                store_shared_b32(line + Uint32((j ^ (r % 8)) * 16), word)
        self.consumers_sync()
        self.rows_out(slot, half * 2, h, row0, rows, num_h, h0)


def _chunks(tid, num_lines: int, threads: int = PRODUCER_THREADS):
    """This thread's chunks of an operand's stage of `num_lines` 128-byte lines copied by `threads` threads: line
    `tid / 8 + (threads / 8) i`, chunk `tid % 8`, and its swizzled shared offset."""
    chunk = tid % 8
    lines = [tid // 8 + (threads // 8) * i for i in range(num_lines * LINE_BYTES // 16 // threads)]
    return chunk, lines, [Uint32(line * LINE_BYTES + ((chunk ^ (line % 8)) * 16)) for line in lines]


# ---------------------------------------------------------------------------------------------------------
# Launch / host signatures (`abi.GROUPED_MATMUL`, `abi.GROUPED_MATMUL_WGRAD`): these host functions exist only to
# compile the kernels; the C++ FFI launches the cubins with their own grids.


class GroupedMatmul(Ring):
    """The grouped matmul kernel (every size a run-time parameter); `compile_grouped_matmul` builds it, one
    `TILE_M x tile_n` block a CTA (`Ring`; the block's stores through the ring); `stages`, `lag`,
    `ctas_per_sm`, `tile_n`: the forward's settings (`FORWARD_*`) by default."""

    def __init__(self, stages: int = FORWARD_STAGES, lag: int = FORWARD_LAG, ctas_per_sm: int = FORWARD_CTAS_PER_SM,
                 tile_n: int = FORWARD_TILE_N):
        super().__init__(stages, lag, ctas_per_sm, tile_n)

    @cute.jit
    def launch(
        self,
        x: Int64,
        x_rows: Int64,
        w: Int64,
        tiles: Int64,
        out: Int64,
        w_up: Int64,
        gate_up: Int64,
        num_k: Int32,
        num_n: Int32,
        num_tiles: Int32,
        w_k_major: Int32,
    ):
        self.kernel(x, x_rows, w, tiles, out, w_up, gate_up, num_k, num_n, num_tiles, w_k_major).launch(
            **self.launch_options([num_tiles, 1, 1]))

    # -----------------------------------------------------------------------------------------------------
    # Device code

    @cute.kernel
    def kernel(
        self,
        x: Int64,
        x_rows: Int64,
        w: Int64,
        tiles: Int64,
        out: Int64,
        w_up: Int64,
        gate_up: Int64,
        num_k: Int32,
        num_n: Int32,
        num_tiles: Int32,
        w_k_major: Int32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        tid = Int32(tid)
        cta = Int32(cta)
        span = Int32(self.tile_n)  # output columns of a CTA: a SwiGLU's block is half gate, half up
        if w_up != Int64(0):
            span = Int32(self.tile_n // 2)
        column_tiles = (num_n + span - 1) // span  # the last one half past num_n at most
        n0 = (cta % column_tiles) * span
        griddepcontrol_wait()  # the tile list and `x` come from the previous kernels
        entry = tiles + Int64(cta // column_tiles) * (4 * TILE_WORDS)
        group = Int32(load_b32(entry))
        first = Int32(load_b32(entry + 4))
        rows = Int32(load_b32(entry + 8))
        if rows > 0:
            ring, full, empty, _ = self.shared()
            steps = num_k // TILE_K
            if tid < PRODUCER_THREADS:
                set_max_registers(self.producer_regs, False)
                self.produce(ring, full, empty, steps, tid, x, x_rows, w, w_up, group, first, rows, num_k, num_n,
                             n0, w_k_major)
            else:
                set_max_registers(self.consumer_regs, True)
                acc = cute.make_rmem_tensor(cute.make_layout(self.tile_n // 2), cutlass.Float32)
                self.consume(acc, ring, full, empty, steps, tid, rows, w_k_major)
                if w_up != Int64(0):  # a SwiGLU block: `h` into `out`, its gate and up into `gate_up` if asked
                    self.store_glu(acc, ring, gate_up, out, Int64(first), rows, num_n, n0)
                else:
                    self.store_staged(acc, ring, out, Int64(first), rows, num_n, n0)

    @cute.jit
    def produce(self, ring: Uint32, full: Uint32, empty: Uint32, steps: Int32, tid: Int32, x: Int64, x_rows: Int64,
                w: Int64, w_up: Int64, group: Int32, first: Int32, rows: Int32, num_k: Int32, num_n: Int32,
                n0: Int32, w_k_major: Int32):
        """The producer warpgroup's `steps` stages of the tile's rows and the block's weight columns. A pair's row
        of `x` is its own or the one `x_rows` names; rows past the tile's pairs and columns past `num_n` are
        zero-filled, never read."""
        chunk, lines, x_dst = _chunks(tid, TILE_M, PRODUCER_THREADS)
        _, w_lines, w_dst = _chunks(tid, self.tile_n, PRODUCER_THREADS)
        x_src, w_src, w_column = [], [], []
        for line in lines:
            row = first + line  # the pair's row of `x`: its own, or the one `x_rows` names (no gather)
            if x_rows != Int64(0):
                if line < rows:
                    row = Int32(load_b32(x_rows + Int64(first + line) * 4))
            x_src.append(x + (Int64(row) * Int64(num_k) + Int64(chunk * 8)) * 2)
        half_blocks = self.tile_n // 128  # 64-column blocks of a SwiGLU block's gate (then as many of up's)
        for line in w_lines:
            block = line // 64  # MN-major weight: line = (64-column block, contraction row line % 64)
            src = w + ((Int64(group) * Int64(num_k) + Int64(line % 64)) * Int64(num_n)
                       + Int64(n0 + block * 64 + chunk * 8)) * 2
            column = Int32(block * 64)
            if w_up != Int64(0):
                base = w_up if block >= half_blocks else w
                src = base + ((Int64(group) * Int64(num_k) + Int64(line % 64)) * Int64(num_n)
                              + Int64(n0 + (block % half_blocks) * 64 + chunk * 8)) * 2
                column = Int32((block % half_blocks) * 64)
            if w_k_major != 0:
                # K-major weight: line = output column n0 + line, its contraction elements contiguous.
                src = w + ((Int64(group) * Int64(num_n) + Int64(n0 + line)) * Int64(num_k) + Int64(chunk * 8)) * 2
                column = Int32(line)
            w_src.append(src)
            w_column.append(column)  # a line's column below num_n - n0, or zeros
        w_step = Int64(TILE_K) * Int64(num_n) * 2
        if w_k_major != 0:
            w_step = Int64(TILE_K * 2)
        columns = num_n - n0
        for t in range(steps):
            self.wait_free(empty, t)
            slot = ring + Uint32(t % self.stages) * Uint32(self.stage_bytes)
            for i in cutlass.range_constexpr(len(x_dst)):
                self.copy_chunk(slot + x_dst[i], x, x_src[i] + Int64(t) * Int64(TILE_K * 2), lines[i] < rows)
            for i in cutlass.range_constexpr(len(w_dst)):
                self.copy_chunk(slot + Uint32(A_STAGE_BYTES) + w_dst[i], w, w_src[i] + Int64(t) * w_step,
                                w_column[i] < columns)
            self.mark_landed(full, t)
        self.mark_all_landed(full, steps)

    @cute.jit
    def consume(self, acc, ring: Uint32, full: Uint32, empty: Uint32, steps: Int32, tid: Int32, rows: Int32,
                w_k_major: Int32):
        """A consumer warpgroup: `acc` = its 64 rows of the tile times the block's columns, each stage's slot given
        back once the next stage's MMAs are issued and its own completed. A warpgroup past the tile's pairs
        multiplies nothing but keeps the barriers' count. Returns with every MMA complete and the ring free."""
        warpgroup = (tid - PRODUCER_THREADS) // 128
        acc.fill(0.0)
        # Two loops, not a test a stage: ptxas serializes MMAs whose accumulators a branch's join may redefine.
        if rows > warpgroup * 64:
            for t in range(steps):
                if w_k_major != 0:
                    self.multiply(acc, ring, full, t, warpgroup, False, False)
                else:
                    self.multiply(acc, ring, full, t, warpgroup, False, True)
                if t >= 1:
                    self.release(empty, t - 1)
            wgmma_wait(0)
        else:
            for t in range(steps):
                mbarrier_wait(full + Uint32(8) * Uint32(t % self.stages), Uint32((t // self.stages) % 2),
                              self.wait_suspend_ns)
                if t >= 1:
                    self.release(empty, t - 1)
        self.consumers_sync()  # every consumer's MMAs done: the ring is free for the epilogue


GroupedMatmul.kernel.set_name_prefix(abi.GROUPED_MATMUL.symbol, remove_cutlass_symbol=True, keep_mangled_name=False)


class GroupedMatmulWgrad(Ring):
    """The weights' gradient kernel (every size a run-time parameter); `compile_grouped_matmul_wgrad` builds it: a
    CTA's `TILE_M x tile_n` blocks in turn (`Ring`, the ring running on from one block to the next), each
    stored through a buffer of its own while the producer copies the next block's stages; `stages`, `lag`,
    `tile_n`: the weights' gradient's settings (`WGRAD_*`) by default."""

    def __init__(self, stages: int = WGRAD_STAGES, lag: int = WGRAD_LAG, tile_n: int = WGRAD_TILE_N):
        super().__init__(stages, lag, 1, tile_n, epilogue_bytes=TILE_M * tile_n * 2)

    @cute.jit
    def launch(
        self,
        x: Int64,
        dy: Int64,
        groups: Int64,
        dw: Int64,
        num_k: Int32,
        num_n: Int32,
        num_groups: Int32,
        tiles_per_cta: Int32,
    ):
        self.kernel(x, dy, groups, dw, num_k, num_n, num_groups, tiles_per_cta).launch(
            **self.launch_options([num_groups, 1, 1]))

    @cute.kernel
    def kernel(
        self,
        x: Int64,
        dy: Int64,
        groups: Int64,
        dw: Int64,
        num_k: Int32,
        num_n: Int32,
        num_groups: Int32,
        tiles_per_cta: Int32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        tid = Int32(tid)
        cta = Int32(cta)
        column_tiles = (num_n + self.tile_n - 1) // self.tile_n  # the last one half past num_n at most
        column_ctas = (column_tiles + tiles_per_cta - 1) // tiles_per_cta
        row_tiles = num_k // TILE_M
        n0 = (cta % column_ctas) * tiles_per_cta * self.tile_n
        blocks = column_tiles - (cta % column_ctas) * tiles_per_cta
        if blocks > tiles_per_cta:
            blocks = tiles_per_cta
        m0 = ((cta // column_ctas) % row_tiles) * TILE_M
        group = cta // (column_ctas * row_tiles)
        griddepcontrol_wait()  # the groups, `x` and `dy` come from the previous kernels
        first = Int32(load_b32(groups + Int64(group) * 8))
        rows = Int32(load_b32(groups + Int64(group) * 8 + 4))
        steps = (rows + TILE_K - 1) // TILE_K
        ring, full, empty, epilogue = self.shared()
        if tid < PRODUCER_THREADS:
            set_max_registers(self.producer_regs, False)
            self.produce(ring, full, empty, steps, blocks, tid, x, dy, first, rows, num_k, num_n, m0, n0)
        else:
            set_max_registers(self.consumer_regs, True)
            warpgroup = (tid - PRODUCER_THREADS) // 128
            acc = cute.make_rmem_tensor(cute.make_layout(self.tile_n // 2), cutlass.Float32)
            for b in range(blocks):
                acc.fill(0.0)
                for s in range(steps):
                    self.multiply(acc, ring, full, b * steps + s, warpgroup, True, True)
                    if s >= 1:
                        self.release(empty, b * steps + s - 1)
                wgmma_wait(0)
                if steps > 0:
                    self.release(empty, b * steps + steps - 1)
                self.store_staged(acc, epilogue, dw, Int64(group) * Int64(num_k) + Int64(m0), Int32(TILE_M), num_n,
                                  n0 + b * self.tile_n)

    @cute.jit
    def produce(self, ring: Uint32, full: Uint32, empty: Uint32, steps: Int32, blocks: Int32, tid: Int32, x: Int64,
                dy: Int64, first: Int32, rows: Int32, num_k: Int32, num_n: Int32, m0: Int32, n0: Int32):
        """The producer warpgroup's `steps` stages of each of the `blocks` blocks: `TILE_K` pairs of `x`'s columns
        `m0 ..` (A) and of `dy`'s block columns (B), both MN-major (line = (64-column block, pair)); pairs past the
        group and columns past `num_n` zero-filled, never read."""
        chunk, x_lines, x_dst = _chunks(tid, TILE_M, PRODUCER_THREADS)
        _, dy_lines, dy_dst = _chunks(tid, self.tile_n, PRODUCER_THREADS)
        # A thread's lines are (64-column block, pair) = (i / 4, 16 (i % 4) + tid / 8): one base an operand, each
        # line a multiple of 16 rows and of 64 columns further (no address a line held: the producer's registers).
        lead = tid // 8
        x_base = x + (Int64(first + lead) * Int64(num_k) + Int64(m0 + chunk * 8)) * 2
        dy_base = dy + (Int64(first + lead) * Int64(num_n) + Int64(n0 + chunk * 8)) * 2
        x_row, dy_row = Int64(16) * Int64(num_k) * 2, Int64(16) * Int64(num_n) * 2
        for b in range(blocks):
            columns = num_n - n0 - b * self.tile_n
            for s in range(steps):
                t = b * steps + s
                self.wait_free(empty, t)
                slot = ring + Uint32(t % self.stages) * Uint32(self.stage_bytes)
                pairs = rows - s * TILE_K - lead
                x_stage = x_base + Int64(s) * Int64(TILE_K) * Int64(num_k) * 2
                dy_stage = dy_base + (Int64(s) * Int64(TILE_K) * Int64(num_n) + Int64(b * self.tile_n)) * 2
                for i in cutlass.range_constexpr(len(x_dst)):
                    self.copy_chunk(slot + x_dst[i], x, x_stage + Int64(i % 4) * x_row + Int64((i // 4) * 128),
                                    (i % 4) * 16 < pairs)
                for i in cutlass.range_constexpr(len(dy_dst)):
                    self.copy_chunk(slot + Uint32(A_STAGE_BYTES) + dy_dst[i], dy,
                                    dy_stage + Int64(i % 4) * dy_row + Int64((i // 4) * 128),
                                    (i % 4) * 16 < pairs and (i // 4) * 64 < columns)
                self.mark_landed(full, t)
        self.mark_all_landed(full, blocks * steps)


GroupedMatmulWgrad.kernel.set_name_prefix(abi.GROUPED_MATMUL_WGRAD.symbol, remove_cutlass_symbol=True,
                                          keep_mangled_name=False)


# ---------------------------------------------------------------------------------------------------------
# Compile


def compile_grouped_matmul(arch: str = "sm_90a", **ring):
    """Compiles the grouped matmul for `arch` (sm_90a only: `wgmma`; `ring`: `Ring`'s settings); returns
    `(symbol, cubin bytes)`."""
    return compile_cubin(abi.GROUPED_MATMUL, GroupedMatmul(**ring), arch)


def compile_grouped_matmul_wgrad(arch: str = "sm_90a", **ring):
    """Compiles the weights' gradient kernel for `arch` (sm_90a only); returns `(symbol, cubin bytes)`."""
    return compile_cubin(abi.GROUPED_MATMUL_WGRAD, GroupedMatmulWgrad(**ring), arch)
