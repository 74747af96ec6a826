"""EpDispatch: MXFP8-quantize this rank's tokens and store them (the data stream as wide LL words, ids and weights
as LL words) into their receive rows on every destination peer (a header word on every peer, -1 where the token
does not go) and, for this rank's own row, straight into XLA's outputs; then copy the peers' rows into XLA's
output arrays, polling each word until it carries this layer's epoch.

Reading order: settings, the host-side launch signature, the device code, compile. No JAX here.

Parameters: `kernels.abi.DISPATCH` (the launch and kernel signatures below are checked against it when compiled).
`peer_tokens` (>= T, the same on every rank of the call; the JAX path passes T, which every rank shares) bounds the
rows that carry anything: rows j >= peer_tokens of every source are empty without a word sent or polled.
Grid: G >= 1 CTAs (a run-time choice, at most the co-residency bound; any G handles any T): CTA c takes source rows
j = c, c + G, ... < peer_tokens, one after another (token j if j < T, else an empty row, stored to the peers); rows
j >= peer_tokens of every rank are written empty here, one per warp of the grid; then the (N - 1) * peer_tokens
polled rows of the other ranks are copied out, the r-th by CTA (G - 1 - r) mod G, each CTA after all its stores.
Block: L // 16 threads.
"""

from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from jax_latent_ep import layout as lay
from jax_latent_ep.kernels import abi
from jax_latent_ep.shapes import LatentMoEShape
from jax_latent_ep.kernels.common import (
    EMPTY,
    TRACE,
    DeviceLayout,
    arrive_in_sequence,
    hand_over_epoch,
    compile_cubin,
    expert_rank_bit,
    fail,
    bf16_magnitude_max,
    load_peer_table,
    mxfp8_exponent,
    mxfp8_inverse,
    peer_of,
    peer_row,
    poll_expired,
    trace_stamp,
)
from jax_latent_ep.kernels.primitives import (
    clock64,
    e4m3x4,
    globaltimer,
    griddepcontrol_wait_after,
    load_b32,
    load_ll,
    load_relaxed_sys,
    load_v4,
    load_wide,
    lo_f32,
    hi_f32,
    mul_ftz,
    shfl_bfly,
    shfl_idx,
    store_b32,
    store_ll,
    store_v4,
    store_wide,
    warp_or,
)

# ---------------------------------------------------------------------------------------------------------
# Settings

def smem_bytes(shape: LatentMoEShape) -> int:
    """Dynamic shared memory bytes the launcher must pass: 16 for the destination mask, then the staging buffer of
    a row's data stream (`3 * x_words` 4-byte pieces), rounded up to 128 (Kimi K3: 3712)."""
    return lay.align(16 + 4 * 3 * lay.x_words(shape))


def block_threads(shape: LatentMoEShape) -> int:
    """Threads per CTA: one per 16 latent elements."""
    check_shape(shape)
    return shape.latent // 16


#: Registers per thread the occupancy bound is computed for (ptxas `.minnctapersm`, see `min_ctas_per_sm`; ptxas may
#: use up to 65536 // (4 * 224) = 72 for Kimi K3, and the kernels use 66-72). At 48 both kernels spill to local
#: memory; at 64 neither does, and the jitted layer is faster at every T (docs/performance.md, "64 registers
#: instead of 48"). The price: fewer co-resident CTAs (4 per SM for Kimi K3, 528 on an H200; enough for a
#: dispatch and a combine grid of 256 each, the co-residency bound of
#: docs/kernel_abi.md).
MAX_REGISTERS = 64


def min_ctas_per_sm(threads: int) -> int:
    """CTAs of `threads` threads that must fit on one SM by registers (64K per SM, `MAX_REGISTERS` each): 4 for
    Kimi K3's 224-thread CTAs, 2 for DeepSeek-V3's 448 (the co-residency bound of docs/kernel_abi.md)."""
    return max(1, 65536 // (threads * MAX_REGISTERS))


def launch_options(threads: int, smem: int, grid) -> dict:
    """The `.launch(...)` options both kernels compile with (`smem`: the kernel's shared bytes; the FFI handler
    sets the grid at run time)."""
    return dict(
        grid=grid,
        block=[threads, 1, 1],
        smem=smem,
        # Co-residency (docs/kernel_abi.md): bound the registers so that min_ctas_per_sm CTAs fit on an SM
        # (ptxas `.minnctapersm`); the carveout is a launch-time attribute only, given so that compiling needs
        # no device query.
        min_blocks_per_mp=min_ctas_per_sm(threads),
        preferred_smem_carveout=-1,
    )


def check_shape(shape: LatentMoEShape) -> None:
    """Raises ValueError unless the kernels support `shape` (`L % 512 == 0`, `L // 16 <= 1024`)."""
    if shape.latent % 512 or shape.latent // 16 > 1024:
        raise ValueError(f"latent={shape.latent} must be a multiple of 512 and at most 16384 for the kernels")


class Dispatch:
    """The dispatch kernel for one `(shape, ranks)` (compile-time constants); `compile_dispatch` builds it."""

    def __init__(self, shape: LatentMoEShape, ranks: int):
        check_shape(shape)
        shape.check_ranks(ranks)
        self.shape, self.ranks = shape, ranks
        self.threads = block_threads(shape)
        self.warps = self.threads // 32
        self.local_experts = shape.num_local_experts(ranks)

    # -----------------------------------------------------------------------------------------------------
    # Launch / host signature: the parameter list of the cubin (`abi.DISPATCH`). This host function exists only to
    # compile the kernel; at run time the C++ FFI (or the harness) launches the cubin with its own grid.

    @cute.jit
    def launch(
        self,
        x: Int64,
        ids: Int64,
        weights: Int64,
        peers: Int64,
        recv_x: Int64,
        recv_sf: Int64,
        recv_ids: Int64,
        recv_weights: Int64,
        recv_src: Int64,
        status: Int64,
        timeout_ns: Int64,
        rank: Int32,
        tokens: Int32,
        peer_tokens: Int32,
        max_tokens: Int32,
    ):
        self.kernel(
            x, ids, weights, peers, recv_x, recv_sf, recv_ids, recv_weights, recv_src,
            status, timeout_ns, rank, tokens, peer_tokens, max_tokens,
        ).launch(**launch_options(self.threads, smem_bytes(self.shape), [tokens, 1, 1]))

    # -----------------------------------------------------------------------------------------------------
    # Device code

    @cute.kernel
    def kernel(
        self,
        x: Int64,
        ids: Int64,
        weights: Int64,
        peers: Int64,
        recv_x: Int64,
        recv_sf: Int64,
        recv_ids: Int64,
        recv_weights: Int64,
        recv_src: Int64,
        status: Int64,
        timeout_ns: Int64,
        rank: Int32,
        tokens: Int32,
        peer_tokens: Int32,
        max_tokens: Int32,
    ):
        shape, ranks = self.shape, self.ranks
        latent, topk, num_sf = shape.latent, shape.topk, shape.num_sf
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        tid = Int32(tid)
        cta = Int32(cta)
        grid = Int32(grid)
        lane = tid % 32
        warp = tid // 32
        smem = cutlass.memory.SmemAllocator()
        # [0]: the destination mask of the token being stored (`store_token`, one token at a time).
        shared = smem.allocate_tensor(Int32, cute.make_layout(4), 16)
        # The token's data stream (its MXFP8 bytes, then its scales, then zero padding) as 4-byte pieces: each thread
        # stages what it quantized, and after the barrier takes the three pieces of each wide word it stores.
        x_words = lay.x_words(shape)
        stage = smem.allocate_tensor(Int32, cute.make_layout(3 * x_words), 16)
        buf = DeviceLayout(max_tokens, ranks, shape)
        stride = Int32(buf.stride)
        column = Int64(tid) * 16
        word_slots = (x_words + self.threads - 1) // self.threads  # wide words per thread (`my_words`)
        local = peers - buf.peers  # the peer table lives in this rank's buffer: no load for the local base
        ctrl = peers - lay.CTRL_BELOW_PEERS  # right before the peer table: a constant offset
        invalid = Uint32(((rank + 1) % ranks) * self.local_experts)  # the ids of an empty row
        if cutlass.const_expr(TRACE):
            traced = Int32(0)
            if tid == 0 and cta == 0:
                traced = Int32(1)
            t_entry, c_entry = globaltimer(), clock64()

        # The addresses of phase 1 and the buffer's base (the own rows' and the copy-out's addresses), computed before
        # the wait (they read no memory), so that their arithmetic runs while the previous grid still runs.
        meta = Int64(cta) * topk + tid
        if tid >= topk or cta >= tokens:
            meta = Int64(0)  # a valid address; the value is not used
        token_row = Int64(cta)
        if cta >= tokens:
            token_row = Int64(0)
        x_line = x + (token_row * latent + column) * 2
        griddepcontrol_wait_after(max_tokens, [x_line, meta, ctrl, local + buf.mirror])
        if cutlass.const_expr(TRACE):
            t_wait, c_wait = globaltimer(), clock64()
        # ---- Phase 1: one wave of loads (nothing waits for any of them before all are issued): token c's
        # inputs, lane d's peer base, the epoch words.
        expert_word = load_b32(ids + meta * 4)
        weight_word = load_b32(weights + meta * 4)
        first = load_v4(x_line)
        second = load_v4(x_line + 16)
        table = load_peer_table(peers, rank, lane, ranks)
        # This layer's epoch: one past the last combined layer. Sequence guard: every thread reads both epoch
        # words (neither is written before every CTA has arrived, `arrive_in_sequence`) and fails before its
        # first store if the last dispatch was not combined (EPOCH_C already carries this epoch).
        epoch = load_relaxed_sys(ctrl + 4 * lay.CTRL_EPOCH_D) + Uint32(1)
        current = load_relaxed_sys(ctrl + 4 * lay.CTRL_EPOCH_C)
        if current == epoch:
            fail(ctrl, status, abi.ERROR_DISPATCH_TWICE, rank, rank, epoch - Uint32(1))
        # This layer's half of the peer-written receive rows (`layout.ROW_HALVES`): row q of the layer is buffer row
        # q + half_rows in the x, ids, weights and hdr regions.
        half_rows = Int64(epoch & Uint32(1)) * buf.rows

        # ---- Phase 2: store, with no wait: own tokens j = c, c + G, ... < T (`store_token`), then the empty rows
        # T <= j < peer_tokens that the peers poll. Invariant: every store of this layer into rank d's half e % 2
        # follows rank d's last read of it, its copy-out of layer e - 2: this rank's dispatch e - 1 completed only
        # after rank d's layer e - 1 headers arrived, which rank d stores after its dispatch e - 2 completed
        # (docs/protocol.md, "Double-buffered rows").
        # Invariant: a CTA issues every store of its j's (any G) before its first poll, and no store waits: no deadlock.
        cta_state = SimpleNamespace(
            tid=tid, lane=lane, warp=warp, rank=rank, buf=buf, table=table, epoch=epoch, half_rows=half_rows,
            invalid=invalid, local=local, ctrl=ctrl, column=column, shared=shared, stage=stage, recv_x=recv_x,
            recv_sf=recv_sf, recv_ids=recv_ids, recv_weights=recv_weights, recv_src=recv_src,
        )
        stamps = None
        if cutlass.const_expr(TRACE):
            stamps = (t_entry, c_entry, t_wait, c_wait, traced)
        j = cta
        if cta < tokens:
            # Token c from the registers of phase 1's wave.
            self.store_token(cta, expert_word, weight_word, first + second, cta_state, stamps)
            j = cta + grid
        # Tokens c + G, c + 2G, ... < T (only where G < T): each loads its inputs, then waits at the barrier.
        while j < tokens:
            j_meta = Int64(j) * topk + tid
            if tid >= topk:
                j_meta = Int64(0)  # a valid address; the value is not used
            j_line = x + (Int64(j) * latent + column) * 2
            j_expert = load_b32(ids + j_meta * 4)
            j_weight = load_b32(weights + j_meta * 4)
            j_words = load_v4(j_line) + load_v4(j_line + 16)
            # Every thread read the previous token's mask and staged stream before this barrier: this token
            # overwrites them.
            cute.arch.sync_threads()
            self.store_token(j, j_expert, j_weight, j_words, cta_state, None)
            j += grid
        # Rows without a token that the peers poll (T <= j < peer_tokens; the j's of this CTA past its tokens; only
        # where a rank of the call has more tokens than this one): warp 0 stores an empty header on every peer; the
        # constants of an empty row go into this rank's own outputs. Invariant: this rank's own rows j < peer_tokens
        # are written exactly once, row j by CTA j mod G (token loop above, empty loop here).
        if warp == 0:
            while j < peer_tokens:
                own_row = Int64(rank) * buf.stride + j
                if lane < ranks and lane != rank:
                    store_ll(table + buf.hdr + (own_row + half_rows) * buf.hdr_pitch, Uint32(EMPTY), epoch)
                self.write_own_meta(own_row, tid, invalid, Uint32(0), Uint32(EMPTY), recv_ids, recv_weights,
                                    recv_src, local + buf.mirror)
                j += grid

        # Every thread of this CTA has passed the sequence check (above): arrive (nothing waits for the count
        # before the end). Invariant: each CTA arrives once, whatever its number of tokens, so the count reaches G.
        arrived = arrive_in_sequence(ctrl, lay.CTRL_COUNT_D, grid, tid)
        # The next kernel may be scheduled now; its griddepcontrol.wait still waits for this grid's end.
        cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(TRACE):
            trace_stamp(ctrl, epoch, 4, globaltimer(), clock64(), traced)

        # Rows j >= peer_tokens of every source: no rank stores or polls them in this layer, so they are written here
        # as empty rows (this rank's outputs and mirror; no peer word). One row j per warp of the grid, warps of all
        # CTAs first (j = peer_tokens + warp * G + c, then + G * warps): with a buffer of 128 and T = 1 each warp
        # takes one or two rows instead of warp 0 of each CTA taking eight.
        j = peer_tokens + warp * grid + cta
        while j < stride:
            source = Int32(0)
            while source < ranks:
                self.write_own_meta(Int64(source) * buf.stride + j, lane, invalid, Uint32(0), Uint32(EMPTY), recv_ids,
                                    recv_weights, recv_src, local + buf.mirror)
                source += 1
            j += grid * self.warps

        # ---- Phase 3: copy the receive rows q = c, c + G, ... out of the local buffer into XLA's outputs. Every
        # thread polls the row's header and its own words of the row together (one round trip once they have
        # landed) until the header carries this epoch: an empty row (-1) gets the constants (ids = the next
        # rank's first expert, weights 0); a full row is copied once every word this thread copies carries it.
        # Invariant: every word copied was stored in this layer by the row's source (each word is stored once
        # per layer, and only this layer's stores carry this epoch).
        # Invariant: this CTA issued all its stores above (any G), so its polls wait only for other co-resident
        # CTAs, which store before they poll: no cycle of waits (docs/kernel_abi.md, "Co-residency").
        x_pieces = latent // 4  # pieces [0, L / 4) of a data stream are MXFP8 bytes, then SF / 4 pieces of scales
        stream_pieces = (latent + num_sf) // 4
        my_words, has_word = self.my_words(tid)  # the words of each row this thread polls and copies out
        has_meta = Uint32(0)
        meta_col = Int64(0)
        if tid < topk:
            has_meta = Uint32(1)
            meta_col = Int64(tid)
        peer_rows = Int32(ranks - 1) * peer_tokens  # the polled rows of the other ranks: (N - 1) * peer_tokens
        # The last CTAs take the first rows (r = G - 1 - c, then + G): with G >= (N - 1) * peer_tokens + T no CTA
        # that stored a token also polls a row: 0.3 us faster than the first CTAs polling (docs/performance.md,
        # "Copy-out from the last CTAs").
        r = grid - 1 - cta
        while r < peer_rows:
            q = peer_row(r, rank, stride, peer_tokens, ranks)
            row = Int64(q)
            at = row + half_rows  # the row in this layer's half of the buffer
            hdr_at = local + buf.hdr + at * buf.hdr_pitch
            row_at = local + buf.x + at * buf.x_pitch
            ids_at = local + buf.ids + at * buf.meta_pitch + meta_col * 8
            w_at = local + buf.weights + at * buf.meta_pitch + meta_col * 8
            pending = Uint32(1)
            start = globaltimer()
            polls = Uint32(0)
            while pending != Uint32(0):
                source, h_epoch = load_ll(hdr_at)
                got = [load_wide(row_at + Int64(my_words[k]) * lay.WIDE_WORD) for k in range(word_slots)]
                id_v, id_e = load_ll(ids_at)
                w_v, w_e = load_ll(w_at)
                if h_epoch == epoch:
                    if source == Uint32(EMPTY):
                        pending = Uint32(0)
                        if has_meta != Uint32(0):
                            store_b32(recv_ids + (row * topk + meta_col) * 4, invalid)
                            store_b32(recv_weights + (row * topk + meta_col) * 4, Uint32(0))
                        if tid == 0:
                            store_b32(recv_src + row * 4, Uint32(EMPTY))
                            store_b32(local + buf.mirror + row * 4, Uint32(EMPTY))
                    else:
                        ok = Uint32(1)
                        for k in cutlass.range_constexpr(word_slots):
                            if has_word[k] != Uint32(0) and got[k][3] != epoch:
                                ok = Uint32(0)
                        if has_meta != Uint32(0) and (id_e != epoch or w_e != epoch):
                            ok = Uint32(0)
                        if ok != Uint32(0):
                            pending = Uint32(0)
                            for k in cutlass.range_constexpr(word_slots):
                                if has_word[k] != Uint32(0):
                                    for c in cutlass.range_constexpr(3):
                                        piece = my_words[k] * 3 + c
                                        if cutlass.const_expr(((k + 1) * self.threads) * 3 <= x_pieces):
                                            store_b32(recv_x + row * latent + Int64(piece) * 4, got[k][c])
                                        else:
                                            if piece < x_pieces:
                                                store_b32(recv_x + row * latent + Int64(piece) * 4, got[k][c])
                                            elif piece < stream_pieces:
                                                store_b32(recv_sf + row * num_sf + Int64(piece - x_pieces) * 4,
                                                          got[k][c])
                            if has_meta != Uint32(0):
                                store_b32(recv_ids + (row * topk + meta_col) * 4, id_v)
                                store_b32(recv_weights + (row * topk + meta_col) * 4, w_v)
                            if tid == 0:
                                store_b32(recv_src + row * 4, source)
                                store_b32(local + buf.mirror + row * 4, source)
                if pending != Uint32(0):
                    polls = polls + Uint32(1)
                    if poll_expired(start, polls, timeout_ns) != Uint32(0):
                        fail(ctrl, status, abi.ERROR_DISPATCH_TIMEOUT, rank, q // stride, epoch - Uint32(1))
            r += grid
            if cutlass.const_expr(TRACE):
                # 5: CTA G - 1's first row (the first peer's token 0) copied.
                if r == grid and tid == 0 and cta == grid - 1:  # CTA G - 1 starts at r = 0
                    trace_stamp(ctrl, epoch, 5, globaltimer(), clock64(), Int32(1))

        # ---- End: the layer is dispatched; the last CTA hands its epoch to the combine (EPOCH_C).
        hand_over_epoch(ctrl, lay.CTRL_EPOCH_C, epoch, arrived, grid, tid)
        if cutlass.const_expr(TRACE):
            trace_stamp(ctrl, epoch, 6, globaltimer(), clock64(), traced)


    @cute.jit
    def store_token(self, token: Int32, expert_word: Uint32, weight_word: Uint32, words, cta_state, stamps):
        """Phase 2 of own token `token`, by every thread of the CTA: its destination mask, its MXFP8 row, whose
        wide words, ids and weights go into its receive row on every destination peer, a header on every other
        peer, and this rank's own receive row written into XLA's outputs. `expert_word` / `weight_word`: this
        thread's id and weight of the token (used by threads tid < K); `words`: this thread's 8 words of x
        (elements [16 tid, 16 tid + 16)); `cta_state`: the kernel's values the tokens share; `stamps`: the trace
        stamps of the CTA's first token, or None. Writes the shared mask and staging buffer, then reads them after
        a barrier: a second call needs a barrier before it (the reads of this one first)."""
        shape, ranks = self.shape, self.ranks
        latent, topk, num_sf = shape.latent, shape.topk, shape.num_sf
        x_words = lay.x_words(shape)
        word_slots = (x_words + self.threads - 1) // self.threads  # wide words per thread (`my_words`)
        tid, lane, warp, rank, buf = cta_state.tid, cta_state.lane, cta_state.warp, cta_state.rank, cta_state.buf
        table, epoch, half_rows, invalid = cta_state.table, cta_state.epoch, cta_state.half_rows, cta_state.invalid
        local, ctrl, column = cta_state.local, cta_state.ctrl, cta_state.column
        shared, stage = cta_state.shared, cta_state.stage
        recv_x, recv_sf, recv_ids = cta_state.recv_x, cta_state.recv_sf, cta_state.recv_ids
        recv_weights, recv_src = cta_state.recv_weights, cta_state.recv_src

        # Destination mask of the token: bit d set iff one of its experts lives on rank d (`expert_rank_bit`: an
        # id outside [0, E) selects no rank, as in the XLA backend).
        if warp == 0:
            bit = Uint32(0)
            if lane < topk:
                bit = expert_rank_bit(expert_word, self.local_experts, ranks)
            mask = warp_or(bit)
            if lane == 0:
                shared[0] = Int32(mask)

        # MXFP8 of elements [16 tid, 16 tid + 16): two threads per 32-block.
        top = bf16_magnitude_max([words[w] for w in range(8)])
        other = shfl_bfly(top, 1)
        if other > top:
            top = other
        e = mxfp8_exponent(top)  # numerics.md's scale; a block holding a NaN or Inf: SF_NONFINITE
        inv = mxfp8_inverse(e)
        packed = []
        for j in cutlass.range_constexpr(4):
            a, b = words[2 * j], words[2 * j + 1]
            packed.append(
                e4m3x4(
                    mul_ftz(lo_f32(a), inv),
                    mul_ftz(hi_f32(a), inv),
                    mul_ftz(lo_f32(b), inv),
                    mul_ftz(hi_f32(b), inv),
                )
            )
        # Lanes 8i gather the scales of blocks 4i..4i+3 of their warp into one word (byte j = block j).
        sf_word = e
        for s in cutlass.range_constexpr(1, 4):
            sf_word = sf_word | (shfl_idx(e, Uint32(lane + 2 * s) % Uint32(32)) << Uint32(8 * s))
        # Stage the row's data stream: piece 4 tid + j = packed[j]; the scale word of blocks 4i..4i+3 is piece
        # L / 4 + i (i = tid / 8); the pieces past L / 4 + SF / 4 are zero.
        for j in cutlass.range_constexpr(4):
            stage[4 * tid + j] = Int32(packed[j])
        if tid % 8 == 0:
            stage[latent // 4 + tid // 8] = Int32(sf_word)
        pad = 3 * x_words - (latent + num_sf) // 4
        if cutlass.const_expr(pad > 0):
            if tid < pad:
                stage[(latent + num_sf) // 4 + tid] = Int32(0)

        source_word = (Uint32(rank) << Uint32(16)) | Uint32(token)
        slot = Int64(rank) * buf.stride + token + half_rows  # this layer's receive row of the token on every rank
        cute.arch.sync_threads()  # the mask and the staged stream, for every thread
        mask = Uint32(shared[0])
        # The three pieces of each of this thread's wide words.
        my_words, has_word = self.my_words(tid)
        pieces = [Uint32(stage[3 * my_words[k] + c]) for k in range(word_slots) for c in range(3)]
        if cutlass.const_expr(stamps is not None):
            t_entry, c_entry, t_wait, c_wait, traced = stamps
            trace_stamp(ctrl, epoch, 0, t_entry, c_entry, traced)
            trace_stamp(ctrl, epoch, 1, t_wait, c_wait, traced)
            trace_stamp(ctrl, epoch, 2, globaltimer(), clock64(), traced)

        for d in cutlass.range_constexpr(ranks):
            if (mask >> Uint32(d)) & Uint32(1) != Uint32(0) and Int32(d) != rank:
                base = peer_of(table, Int32(d))  # the mask is CTA-uniform: the warp is converged
                row_dst = base + buf.x + slot * buf.x_pitch
                for k in cutlass.range_constexpr(word_slots):
                    p = pieces[3 * k:3 * k + 3]
                    if has_word[k] != Uint32(0):
                        store_wide(row_dst + Int64(my_words[k]) * lay.WIDE_WORD, p[0], p[1], p[2], epoch)
                if tid < topk:
                    store_ll(base + buf.ids + slot * buf.meta_pitch + Int64(tid) * 8, expert_word, epoch)
                    store_ll(base + buf.weights + slot * buf.meta_pitch + Int64(tid) * 8, weight_word, epoch)
        # Headers: lane d tells peer d whether the row holds the token (its source word) or nothing (-1); issued
        # before the own row's stores, as the peers' copy-out waits for them.
        if warp == 0 and lane < ranks and lane != rank:
            header = Uint32(EMPTY)
            if (mask >> Uint32(lane)) & Uint32(1) != Uint32(0):
                header = source_word
            store_ll(table + buf.hdr + slot * buf.hdr_pitch, header, epoch)
        # This rank's own receive row of the token goes straight into XLA's outputs from the registers (no
        # buffer word, no poll): the MXFP8 bytes, the scales, ids, weights and source; the constants of an empty
        # row if the token has no expert here.
        own_row = Int64(rank) * buf.stride + token
        if (mask >> Uint32(rank)) & Uint32(1) != Uint32(0):
            store_v4(recv_x + own_row * latent + column, packed)
            if tid % 8 == 0:
                store_b32(recv_sf + own_row * num_sf + Int64(tid // 8) * 4, sf_word)
            self.write_own_meta(own_row, tid, expert_word, weight_word, source_word, recv_ids, recv_weights,
                                recv_src, local + buf.mirror)
        else:
            self.write_own_meta(own_row, tid, invalid, Uint32(0), Uint32(EMPTY), recv_ids, recv_weights,
                                recv_src, local + buf.mirror)
        if cutlass.const_expr(stamps is not None):
            trace_stamp(ctrl, epoch, 3, globaltimer(), clock64(), stamps[4])

    @cute.jit
    def write_own_meta(self, own_row: Int64, tid: Int32, expert_word: Uint32, weight_word: Uint32, source: Uint32,
                       recv_ids: Int64, recv_weights: Int64, recv_src: Int64, mirror: Int64):
        """Threads tid < K store expert / weight `tid` of this rank's receive row `own_row` (their values, or the
        constants of an empty row), thread 0 its source word into `recv_src` and the combine's `mirror` (`tid`: the
        thread index, or the lane when one warp writes the row)."""
        topk = self.shape.topk
        if tid < topk:
            store_b32(recv_ids + (own_row * topk + Int64(tid)) * 4, expert_word)
            store_b32(recv_weights + (own_row * topk + Int64(tid)) * 4, weight_word)
        if tid == 0:
            store_b32(recv_src + own_row * 4, source)
            store_b32(mirror + own_row * 4, source)

    @cute.jit
    def my_words(self, tid: Int32):
        """This thread's wide words of a row's data stream, stored in phase 2 and copied out in phase 3: `(words,
        has)`, lists over slots k < ceil(x_words / threads) of w = tid + k * threads, so that consecutive lanes take
        consecutive words (each warp instruction stores 512 contiguous bytes, whole lines). A slot past x_words has
        `has` 0 and names word tid instead: a valid word (always written in a full row) that this slot neither
        stores, checks nor copies."""
        x_words = lay.x_words(self.shape)
        words, has = [], []
        for k in cutlass.range_constexpr((x_words + self.threads - 1) // self.threads):
            w = tid + k * self.threads
            valid = Uint32(1)
            if cutlass.const_expr((k + 1) * self.threads > x_words):
                if w >= x_words:
                    w = tid
                    valid = Uint32(0)
            words.append(w)
            has.append(valid)
        return words, has


#: The cubin's one kernel symbol: `Dispatch.kernel` with a fixed name (the DSL appends `_0`).
Dispatch.kernel.set_name_prefix(abi.DISPATCH.symbol, remove_cutlass_symbol=True, keep_mangled_name=False)


# ---------------------------------------------------------------------------------------------------------
# Compile


def compile_dispatch(shape: LatentMoEShape, ranks: int, arch: str = "sm_90a"):
    """Compiles the dispatch kernel of `(shape, ranks)` for `arch`; returns `(symbol, cubin bytes)`."""
    return compile_cubin(abi.DISPATCH, Dispatch(shape, ranks), arch)
