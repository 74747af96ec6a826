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
blocks of gate's and up's columns alternating). Its CTA is warp-specialized (`GroupedMatmul`): a producer warpgroup
copies the stages, two consumer warpgroups multiply, `mbarrier`s between them.

`GroupedMatmulWgrad`: with `C = ceil(num_n / TILE_N / tiles_per_cta)` CTAs a row of blocks, CTA `c` computes, in
turn, the `TILE_M x TILE_N` blocks of rows `(c / C) % (num_k / TILE_M)` and columns `(c % C) tiles_per_cta ..` of
group `c / (C num_k / TILE_M)`'s gradient, each contracting over the group's pairs `TILE_K` at a time (rows past the
group zero-filled; the ring runs on from one block to the next); an empty group's blocks are 0. Each block leaves
through the ring slot its last stage freed, in 16-byte stores of whole rows. All 256 threads copy and multiply,
a barrier a stage, two CTAs an SM of `STAGES` each.

Both run the contraction through a ring of `cp.async` copies into shared memory laid out as `wgmma` reads it with
the 128-byte swizzle (16-byte chunk `c` of a 128-byte line `l` at chunk `c ^ (l % 8)`, 1024-byte atoms): a K-major
operand a line per row (64 contraction elements), an MN-major one a line per contraction row and 64-column block,
the blocks `MN_BLOCK_BYTES` apart. Each of two warpgroups multiplies its 64 rows by the block's columns with
`wgmma.mma_async.m64n<columns>k16`, four a stage, while the next stages' copies land.
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
    store_b32_bf16x2,
    store_shared_b32,
    store_v4,
    wgmma_bf16_m64k16,
    wgmma_commit,
    wgmma_fence,
    wgmma_wait,
)

# ---------------------------------------------------------------------------------------------------------
# Settings

#: Rows of one CTA's block: two warpgroups of 64 (the forward: pairs of a tile; the gradient: rows of `dw[g]`).
TILE_M = abi.MATMUL_TILE_M
#: Columns of one block of the weights' gradient (one `wgmma` n128), and of the forward (n128, or n256 by `tile_n`).
TILE_N = abi.MATMUL_TILE_N
#: Contraction step of one stage: a 128-byte line of BF16.
TILE_K = abi.MATMUL_TILE_K
THREADS = 256
#: The weights' gradient's ring: its stages, and the stages of MMAs a warpgroup leaves in flight when it moves on
#: (0 or 1): copies for `STAGES - 1 - MMA_PENDING` stages ahead are in flight while one stage's MMAs run. Two CTAs
#: an SM of three stages each: one CTA's MMAs run while the other waits at its barrier or stores its block.
STAGES = 3
MMA_PENDING = 0
#: CTAs an SM holds (registers bounded for them: 65536 / (THREADS * CTAS_PER_SM) a thread).
CTAS_PER_SM = 2
#: The forward: a warp-specialized CTA (a producer warpgroup of copies, `THREADS` consumers of MMAs) of
#: `TILE_M x FORWARD_TILE_N` blocks, one an SM, its ring of `FORWARD_STAGES` (48 KB each); the producer marks a stage
#: landed `FORWARD_LAG` stages after issuing it (its copies' completion is waited for per thread). Registers a
#: thread: the producer's `PRODUCER_REGS`, the rest to the consumers' accumulators.
FORWARD_TILE_N = abi.MATMUL_FORWARD_TILE_N
FORWARD_STAGES = 4
FORWARD_LAG = 2
FORWARD_CTAS_PER_SM = 1
PRODUCER_THREADS = 128
FORWARD_THREADS = PRODUCER_THREADS + THREADS
PRODUCER_REGS = 88
#: The named barrier of the consumer warpgroups' epilogue (0 is `sync_threads`').
EPILOGUE_BARRIER = 1
LINE_BYTES = 128
#: An MN-major operand's 64-column block of one stage: `TILE_K` lines.
MN_BLOCK_BYTES = TILE_K * LINE_BYTES
A_STAGE_BYTES = TILE_M * LINE_BYTES


def ring_bytes(stages: int, tile_n: int = TILE_N) -> int:
    """Dynamic shared bytes of a ring of `stages` of `TILE_M` rows by `tile_n` columns: one extra KB, as the ring
    starts at the first 1024-byte boundary (the swizzle atoms)."""
    return stages * (A_STAGE_BYTES + tile_n * LINE_BYTES) + 1024


#: Words of a tile of the list.
TILE_WORDS = abi.MATMUL_TILE_WORDS


def launch_shape(kernel: str = "grouped_matmul") -> tuple[int, int]:
    """(threads per CTA, dynamic shared bytes) of `kernel` ("grouped_matmul" or "grouped_matmul_wgrad")."""
    ring = GroupedMatmul() if kernel == "grouped_matmul" else GroupedMatmulWgrad()
    return ring.threads, ring.smem_bytes


# ---------------------------------------------------------------------------------------------------------
# The pipeline both kernels run: a CTA's `steps` contraction stages of two operands into its 64 accumulators a thread.


class _Ring:
    """Device helpers of the ring; a kernel supplies each thread's chunk sources (module docstring). `stages`,
    `pending`, `ctas_per_sm`: the ring's settings; `tile_n`: a block's columns (128 or 256: 64 or 128 accumulators
    a thread)."""

    def __init__(self, stages: int = STAGES, pending: int = MMA_PENDING, ctas_per_sm: int = CTAS_PER_SM,
                 tile_n: int = TILE_N):
        if pending not in (0, 1) or stages < 2 + pending:
            raise ValueError(f"stages={stages}, pending={pending}: need pending in (0, 1) and stages >= 2 + pending")
        if tile_n not in (TILE_N, 2 * TILE_N):
            raise ValueError(f"tile_n={tile_n}: a block is {TILE_N} or {2 * TILE_N} columns")
        self.stages, self.pending, self.ctas_per_sm, self.tile_n = stages, pending, ctas_per_sm, tile_n
        self.stage_bytes = A_STAGE_BYTES + tile_n * LINE_BYTES
        self.smem_bytes = ring_bytes(stages, tile_n)

    #: Threads of a CTA.
    threads = THREADS

    def launch_options(self, grid) -> dict:
        """The `.launch(...)` options of either kernel (the FFI handler sets the grid)."""
        return dict(grid=grid, block=[self.threads, 1, 1], smem=self.smem_bytes, preferred_smem_carveout=-1,
                    min_blocks_per_mp=self.ctas_per_sm if self.ctas_per_sm > 1 else 0)

    @cute.jit
    def contract(self, acc, steps: Int32, blocks: Int32, warpgroup_live, a_base: Int64, a_src, a_line,
                 a_limit: Int32, a_step: Int64, b_base: Int64, b_src, b_line, b_limit: Int32, b_step: Int64,
                 b_block_step: Int64, limit_step: Int32, a_dst, b_dst, out: Int64, row0: Int64, rows: Int32,
                 num_n: Int32, n0: Int32):
        """Computes `blocks` output blocks in turn, each `steps` contraction stages of two MN-major operands into
        `acc` (zeroed first), and stores block `b` (rows `row0 ..` of `out`, columns `n0 + b tile_n ..` below
        `num_n`). Chunk `i` of operand A copies `a_src[i] + s a_step` into `a_dst[i]` at stage `s` of every block,
        16 bytes if `a_line[i] < a_limit - s limit_step`, else 16 zeros (named by `a_base`, the operand's start,
        never past it); B likewise, block `b` `b b_block_step` further. The ring runs on across blocks: the next
        block's first copies land while this one's last MMAs run and its results are stored. The warpgroup
        multiplies only if `warpgroup_live`. `steps` 0: every block stores zeros."""
        smem = cutlass.memory.SmemAllocator()
        raw = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(self.smem_bytes), 1024)
        ring = (Uint32(raw.iterator.toint()) + Uint32(1023)) & Uint32(0xFFFFFC00)
        tid, _, _ = cute.arch.thread_idx()
        warpgroup = Int32(tid) // 128
        acc.fill(0.0)
        if steps == 0:
            for b in range(blocks):
                self.store(acc, out, row0, rows, num_n, n0 + b * self.tile_n)
        total = steps * blocks

        ahead_stages = self.stages - 1 - self.pending
        # ---- Prologue: stages 0 .. ahead_stages - 1 in flight (a group committed for each, empty past the last).
        for s in cutlass.range_constexpr(ahead_stages):
            if s < total:
                self.load_stage(ring + Uint32(s * self.stage_bytes), s, steps, a_base, a_src, a_line, a_limit,
                                a_step, b_base, b_src, b_line, b_limit, b_step, b_block_step, limit_step, a_dst,
                                b_dst)
            cp_async_commit()

        # ---- Main loop. Invariant at the barrier of stage t: stage t is in shared memory for both warpgroups,
        # and every MMA of stage t - 1 - pending completed, so its slot takes stage t + ahead_stages (of this
        # block or the next).
        for t in range(total):
            cp_async_wait(ahead_stages - 1)
            fence_proxy_async_shared()
            cute.arch.sync_threads()
            ahead = t + ahead_stages
            if ahead < total:
                self.load_stage(ring + Uint32((ahead % self.stages) * self.stage_bytes), ahead, steps, a_base,
                                a_src, a_line, a_limit, a_step, b_base, b_src, b_line, b_limit, b_step,
                                b_block_step, limit_step, a_dst, b_dst)
            cp_async_commit()
            if warpgroup_live:
                wgmma_fence()
                self.multiply_stage(acc, ring + Uint32((t % self.stages) * self.stage_bytes), warpgroup, True, True)
                wgmma_commit()
                wgmma_wait(self.pending)
            if (t + 1) % steps == 0:  # the block's last stage: its results out, the next block from 0
                wgmma_wait(0)
                self.store_staged(acc, ring + Uint32((t % self.stages) * self.stage_bytes), out, row0, rows, num_n,
                                  n0 + (t // steps) * self.tile_n, False)
                acc.fill(0.0)

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
    def load_stage(self, slot: Uint32, stage: Int32, steps: Int32, a_base: Int64, a_src, a_line, a_limit: Int32,
                   a_step: Int64, b_base: Int64, b_src, b_line, b_limit: Int32, b_step: Int64, b_block_step: Int64,
                   limit_step: Int32, a_dst, b_dst):
        """Issues this thread's copies of stage `stage` (block `stage / steps`, its stage `stage % steps`) into
        `slot`: chunk `i` of each operand 16 bytes from its source at that stage if its line is below the operand's
        limit there, else 16 zero bytes (naming the operand's base, unread); `contract` says where."""
        k = stage % steps
        a_offset = Int64(k) * a_step
        b_offset = Int64(k) * b_step + Int64(stage // steps) * b_block_step
        a_limit = a_limit - k * limit_step
        b_limit = b_limit - k * limit_step
        for i in cutlass.range_constexpr(len(a_dst)):
            src = a_base
            size = Uint32(0)
            if a_line[i] < a_limit:
                src = a_src[i] + a_offset
                size = Uint32(16)
            cp_async_16(slot + a_dst[i], src, size)
        for i in cutlass.range_constexpr(len(b_dst)):
            src = b_base
            size = Uint32(0)
            if b_line[i] < b_limit:
                src = b_src[i] + b_offset
                size = Uint32(16)
            cp_async_16(slot + Uint32(A_STAGE_BYTES) + b_dst[i], src, size)

    @cute.jit
    def store(self, acc, out: Int64, row0: Int64, rows: Int32, num_n: Int32, n0: Int32):
        """Rounds this thread's accumulators to BF16 into `out` rows `row0 + r` (for block rows `r < rows`), columns
        `n0 ..` below `num_n` (a multiple of `TILE_N`)."""
        tid, _, _ = cute.arch.thread_idx()
        tid = Int32(tid)
        lane = tid % 32
        block_row = (tid // 128) * 64 + ((tid % 128) // 32) * 16 + lane // 4
        for i in cutlass.range_constexpr(2):
            r = block_row + 8 * i
            if r < rows:
                row_at = out + ((row0 + Int64(r)) * Int64(num_n) + Int64(n0 + 2 * (lane % 4))) * 2
                for h in cutlass.range_constexpr(self.tile_n // TILE_N):
                    if n0 + h * TILE_N < num_n:
                        for jj in cutlass.range_constexpr(TILE_N // 8):
                            j = h * (TILE_N // 8) + jj
                            store_b32_bf16x2(row_at + Int64(16 * j), acc[4 * j + 2 * i], acc[4 * j + 2 * i + 1])

    @cute.jit
    def epilogue_thread(self, specialized: cutlass.Constexpr):
        """This thread's index among the `THREADS` that hold the accumulators: all of a plain CTA, the consumer
        warpgroups (threads 128 ..) of a specialized one."""
        tid, _, _ = cute.arch.thread_idx()
        tid = Int32(tid)
        if cutlass.const_expr(specialized):
            tid = tid - PRODUCER_THREADS
        return tid

    @cute.jit
    def epilogue_sync(self, specialized: cutlass.Constexpr):
        """The barrier of the threads that hold the accumulators (`epilogue_thread`)."""
        if cutlass.const_expr(specialized):
            named_barrier_sync(EPILOGUE_BARRIER, THREADS)
        else:
            cute.arch.sync_threads()

    @cute.jit
    def store_staged(self, acc, slot: Uint32, out: Int64, row0: Int64, rows: Int32, num_n: Int32, n0: Int32,
                     specialized: cutlass.Constexpr):
        """`store` through `slot` (free shared memory of `TILE_M * tile_n * 2` bytes; for a plain CTA the ring slot
        of the stage just multiplied, free until the next stage's barrier refills it): each thread's accumulators as
        BF16 pairs into the `TILE_M x tile_n` block (`2 tile_n`-byte lines, 16-byte chunk `c` of line `r` at
        `c ^ (r % 8)` within its 128 bytes: conflict-free both ways), then each row out in 16-byte stores
        (`rows_out`: full sectors; a quarter of `store`'s store instructions)."""
        tid = self.epilogue_thread(specialized)
        lane = tid % 32
        block_row = (tid // 128) * 64 + ((tid % 128) // 32) * 16 + lane // 4
        self.epilogue_sync(specialized)  # every warpgroup's MMAs have read the slot
        for i in cutlass.range_constexpr(2):
            r = block_row + 8 * i
            line = slot + Uint32(r * (self.tile_n * 2) + 4 * (lane % 4))
            for j in cutlass.range_constexpr(self.tile_n // 8):
                store_shared_b32(line + Uint32((j ^ (r % 8)) * 16), bf16x2(acc[4 * j + 2 * i], acc[4 * j + 2 * i + 1]))
        self.epilogue_sync(specialized)
        self.rows_out(slot, self.tile_n * 2, out, row0, rows, num_n, n0, specialized)

    @cute.jit
    def rows_out(self, slot: Uint32, line_bytes: cutlass.Constexpr, out: Int64, row0: Int64, rows: Int32,
                 num_n: Int32, n0: Int32, specialized: cutlass.Constexpr):
        """Copies the block staged in `slot` (`TILE_M` lines of `line_bytes`, 16-byte chunk `c` of line `r` at `c ^
        (r % 8)`) to `out` rows `row0 + r` (`r < rows`), columns `n0 ..` below `num_n`, in 16-byte stores of whole
        rows."""
        tid = self.epilogue_thread(specialized)
        chunks = line_bytes // 16
        chunk = tid % chunks
        for k in cutlass.range_constexpr(TILE_M * line_bytes // 16 // THREADS):
            r = tid // chunks + (THREADS // chunks) * k
            words = load_shared_v4(slot + Uint32(r * line_bytes + (chunk ^ (r % 8)) * 16))
            if r < rows and n0 + chunk * 8 < num_n:
                store_v4(out + ((row0 + Int64(r)) * Int64(num_n) + Int64(n0 + chunk * 8)) * 2, words)

    @cute.jit
    def store_glu(self, acc, slot: Uint32, gate_up: Int64, h: Int64, row0: Int64, rows: Int32, num_h: Int32,
                  h0: Int32, specialized: cutlass.Constexpr):
        """The epilogue of a SwiGLU block (the first `tile_n / 2` columns of `acc` gate's `h0 ..`, the rest up's):
        the block as BF16 into `gate_up` (`[P, 2 num_h]`, at columns `2 h0 ..`) unless 0, then `h =
        bf16(silu_mul(gate, up))` of the bf16-rounded pair through `slot` (`tile_n`-byte lines, 16-byte chunk `c` of
        line `r` at `c ^ (r % 8)`: conflict-free both ways) into `h` `[P, num_h]` rows `row0 + r` (`r < rows`),
        columns `h0 ..`, in 16-byte stores of whole rows."""
        if gate_up != Int64(0):
            self.store_staged(acc, slot, gate_up, row0, rows, num_h * 2, h0 * 2, specialized)
        tid = self.epilogue_thread(specialized)
        lane = tid % 32
        block_row = (tid // 128) * 64 + ((tid % 128) // 32) * 16 + lane // 4
        self.epilogue_sync(specialized)  # every MMA and every `gate_up` chunk has left the slot
        half = self.tile_n // 2  # gate's columns, then up's: the same thread holds column c of both
        for i in cutlass.range_constexpr(2):
            r = block_row + 8 * i
            line = slot + Uint32(r * (half * 2) + 4 * (lane % 4))
            for j in cutlass.range_constexpr(half // 8):
                g, u = 4 * j + 2 * i, 4 * (j + half // 8) + 2 * i
                word = bf16x2(*(silu_mul(round_bf16(acc[g + e]), round_bf16(acc[u + e])) for e in range(2)))
                store_shared_b32(line + Uint32((j ^ (r % 8)) * 16), word)
        self.epilogue_sync(specialized)
        self.rows_out(slot, half * 2, h, row0, rows, num_h, h0, specialized)


def _chunks(tid, num_lines: int, threads: int = THREADS):
    """This thread's chunks of an operand's stage of `num_lines` 128-byte lines copied by `threads` threads: line
    `tid / 8 + (threads / 8) i`, chunk `tid % 8`, and its swizzled shared offset."""
    chunk = tid % 8
    lines = [tid // 8 + (threads // 8) * i for i in range(num_lines * LINE_BYTES // 16 // threads)]
    return chunk, lines, [Uint32(line * LINE_BYTES + ((chunk ^ (line % 8)) * 16)) for line in lines]


# ---------------------------------------------------------------------------------------------------------
# Launch / host signatures (`abi.GROUPED_MATMUL`, `abi.GROUPED_MATMUL_WGRAD`): these host functions exist only to
# compile the kernels; the C++ FFI launches the cubins with their own grids.


class GroupedMatmul(_Ring):
    """The grouped matmul kernel (every size a run-time parameter); `compile_grouped_matmul` builds it. A CTA is
    warp-specialized: warpgroup 0 copies stages into the ring, warpgroups 1 and 2 multiply 64 rows each; `stages`,
    `lag`, `ctas_per_sm`, `tile_n`: the forward's settings (`FORWARD_*`) by default."""

    threads = FORWARD_THREADS

    def __init__(self, stages: int = FORWARD_STAGES, lag: int = FORWARD_LAG, ctas_per_sm: int = FORWARD_CTAS_PER_SM,
                 tile_n: int = FORWARD_TILE_N):
        if not 1 <= lag <= stages - 2:
            # Past stages - 2 the producer would wait for a slot freed only after a stage it has not yet marked.
            raise ValueError(f"stages={stages}, lag={lag}: need 1 <= lag <= stages - 2")
        super().__init__(stages=stages, pending=0, ctas_per_sm=ctas_per_sm, tile_n=tile_n)
        self.lag = lag
        self.smem_bytes += 16 * stages  # a full and an empty barrier a stage, past the ring
        # Registers a thread: the CTA's pool at launch (`FORWARD_THREADS` of `base`), the producer's given to the
        # consumers' accumulators.
        base = 65536 // (FORWARD_THREADS * ctas_per_sm) // 8 * 8
        self.producer_regs = min(PRODUCER_REGS, base)
        self.consumer_regs = min(256, (FORWARD_THREADS * base - PRODUCER_THREADS * self.producer_regs) // THREADS
                                 // 8 * 8)
        if self.consumer_regs < tile_n // 2 + 40:
            raise ValueError(f"ctas_per_sm={ctas_per_sm}, tile_n={tile_n}: {self.consumer_regs} registers a "
                             f"consumer thread hold too few beside {tile_n // 2} accumulators")

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
            smem = cutlass.memory.SmemAllocator()
            raw = smem.allocate_tensor(cutlass.Uint8, cute.make_layout(self.smem_bytes), 1024)
            ring = (Uint32(raw.iterator.toint()) + Uint32(1023)) & Uint32(0xFFFFFC00)
            full = ring + Uint32(self.stages * self.stage_bytes)  # full[s]: stage s's bytes landed
            empty = full + Uint32(8 * self.stages)  # empty[s]: stage s's MMAs done, its slot free
            if tid == 0:
                for s in cutlass.range_constexpr(self.stages):
                    mbarrier_init(full + Uint32(8 * s), Uint32(PRODUCER_THREADS))
                    mbarrier_init(empty + Uint32(8 * s), Uint32(THREADS // 32))
            cute.arch.sync_threads()
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
                    self.store_glu(acc, ring, gate_up, out, Int64(first), rows, num_n, n0, True)
                else:
                    self.store_staged(acc, ring, out, Int64(first), rows, num_n, n0, True)

    @cute.jit
    def produce(self, ring: Uint32, full: Uint32, empty: Uint32, steps: Int32, tid: Int32, x: Int64, x_rows: Int64,
                w: Int64, w_up: Int64, group: Int32, first: Int32, rows: Int32, num_k: Int32, num_n: Int32,
                n0: Int32, w_k_major: Int32):
        """The producer warpgroup: stage `t` into slot `t % stages` once its `empty` barrier says the slot's
        previous stage was multiplied; stage `t - lag`'s `full` barrier once its copies landed (each thread's own
        copies completed and fenced for `wgmma`, then its arrival). A pair's row of `x` is its own or the one
        `x_rows` names; rows past the tile's pairs and columns past `num_n` are zero-filled, never read."""
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
            s = t % self.stages
            if t >= self.stages:
                mbarrier_wait(empty + Uint32(8) * Uint32(s), Uint32((t // self.stages + 1) % 2))
            slot = ring + Uint32(s) * Uint32(self.stage_bytes)
            for i in cutlass.range_constexpr(len(x_dst)):
                src = x
                size = Uint32(0)
                if lines[i] < rows:
                    src = x_src[i] + Int64(t) * Int64(TILE_K * 2)
                    size = Uint32(16)
                cp_async_16(slot + x_dst[i], src, size)
            for i in cutlass.range_constexpr(len(w_dst)):
                src = w
                size = Uint32(0)
                if w_column[i] < columns:
                    src = w_src[i] + Int64(t) * w_step
                    size = Uint32(16)
                cp_async_16(slot + Uint32(A_STAGE_BYTES) + w_dst[i], src, size)
            cp_async_commit()
            if t >= self.lag:
                cp_async_wait(self.lag)
                fence_proxy_async_shared()
                mbarrier_arrive(full + Uint32(8) * Uint32((t - self.lag) % self.stages))
        cp_async_wait(0)
        fence_proxy_async_shared()
        for j in cutlass.range_constexpr(self.lag):
            u = steps - self.lag + j
            if u >= 0:
                mbarrier_arrive(full + Uint32(8) * Uint32(u % self.stages))

    @cute.jit
    def consume(self, acc, ring: Uint32, full: Uint32, empty: Uint32, steps: Int32, tid: Int32, rows: Int32,
                w_k_major: Int32):
        """A consumer warpgroup: `acc` = its 64 rows of the tile times the block's columns, stage by stage as the
        `full` barriers say they landed, one stage's MMAs left in flight; a stage's slot is given back (each warp's
        arrival on its `empty` barrier) once the next stage's MMAs are issued and its own completed. A warpgroup
        past the tile's pairs multiplies nothing but keeps the barriers' count. Returns with every MMA complete."""
        warpgroup = (tid - PRODUCER_THREADS) // 128
        live = rows > warpgroup * 64
        acc.fill(0.0)
        # Two loops, not a test a stage: ptxas serializes MMAs whose accumulators a branch's join may redefine.
        if live:
            for t in range(steps):
                s = t % self.stages
                mbarrier_wait(full + Uint32(8) * Uint32(s), Uint32((t // self.stages) % 2))
                slot = ring + Uint32(s) * Uint32(self.stage_bytes)
                wgmma_fence()
                if w_k_major != 0:
                    self.multiply_stage(acc, slot, warpgroup, False, False)
                else:
                    self.multiply_stage(acc, slot, warpgroup, False, True)
                wgmma_commit()
                wgmma_wait(1)
                if t >= 1 and tid % 32 == 0:
                    mbarrier_arrive(empty + Uint32(8) * Uint32((t - 1) % self.stages))
            wgmma_wait(0)
        else:
            for t in range(steps):
                mbarrier_wait(full + Uint32(8) * Uint32(t % self.stages), Uint32((t // self.stages) % 2))
                if t >= 1 and tid % 32 == 0:
                    mbarrier_arrive(empty + Uint32(8) * Uint32((t - 1) % self.stages))
        self.epilogue_sync(True)  # every consumer's MMAs done: the ring is free for the epilogue


GroupedMatmul.kernel.set_name_prefix(abi.GROUPED_MATMUL.symbol, remove_cutlass_symbol=True, keep_mangled_name=False)


class GroupedMatmulWgrad(_Ring):
    """The weights' gradient kernel (every size a run-time parameter); `compile_grouped_matmul_wgrad` builds it.
    `ring`: `_Ring`'s settings (`TILE_N`-column blocks only)."""

    def __init__(self, **ring):
        if ring.get("tile_n", TILE_N) != TILE_N:
            raise ValueError(f"tile_n={ring['tile_n']}: the weights' gradient's blocks are {TILE_N} columns")
        super().__init__(**ring)

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
        column_tiles = num_n // TILE_N
        column_ctas = (column_tiles + tiles_per_cta - 1) // tiles_per_cta
        row_tiles = num_k // TILE_M
        n0 = (cta % column_ctas) * tiles_per_cta * TILE_N
        blocks = column_tiles - (cta % column_ctas) * tiles_per_cta
        if blocks > tiles_per_cta:
            blocks = tiles_per_cta
        m0 = ((cta // column_ctas) % row_tiles) * TILE_M
        group = cta // (column_ctas * row_tiles)
        griddepcontrol_wait()  # the groups, `x` and `dy` come from the previous kernels
        first = Int32(load_b32(groups + Int64(group) * 8))
        rows = Int32(load_b32(groups + Int64(group) * 8 + 4))
        chunk, lines, dst = _chunks(tid, TILE_M)
        # Both operands MN-major: line = (64-column block line / 64, pair line % 64 of the stage).
        x_src, dy_src, pair = [], [], []
        for line in lines:
            p = Int64(first + line % 64)
            x_src.append(x + (p * Int64(num_k) + Int64(m0 + (line // 64) * 64 + chunk * 8)) * 2)
            dy_src.append(dy + (p * Int64(num_n) + Int64(n0 + (line // 64) * 64 + chunk * 8)) * 2)
            pair.append(Int32(line % 64))
        acc = cute.make_rmem_tensor(cute.make_layout(TILE_N // 2), cutlass.Float32)
        self.contract(acc, (rows + TILE_K - 1) // TILE_K, blocks, rows > 0, x, x_src, pair, rows,
                      Int64(TILE_K) * Int64(num_k) * 2, dy, dy_src, pair, rows, Int64(TILE_K) * Int64(num_n) * 2,
                      Int64(TILE_N * 2), Int32(TILE_K), dst, dst, dw, Int64(group) * Int64(num_k) + Int64(m0),
                      Int32(TILE_M), num_n, n0)


GroupedMatmulWgrad.kernel.set_name_prefix(abi.GROUPED_MATMUL_WGRAD.symbol, remove_cutlass_symbol=True,
                                          keep_mangled_name=False)


# ---------------------------------------------------------------------------------------------------------
# Compile


def compile_grouped_matmul(arch: str = "sm_90a", **ring):
    """Compiles the grouped matmul for `arch` (sm_90a only: `wgmma`; `ring`: `_Ring`'s settings); returns
    `(symbol, cubin bytes)`."""
    return compile_cubin(abi.GROUPED_MATMUL, GroupedMatmul(**ring), arch)


def compile_grouped_matmul_wgrad(arch: str = "sm_90a", **ring):
    """Compiles the weights' gradient kernel for `arch` (sm_90a only); returns `(symbol, cubin bytes)`."""
    return compile_cubin(abi.GROUPED_MATMUL_WGRAD, GroupedMatmulWgrad(**ring), arch)
