"""EpCombine: send every row received from another rank, its BF16 expert output, back as wide LL words to its
source's combine slot; then reduce own tokens, polling each peer's partial until it carries this layer's epoch
(this rank's own partial is its own row of `out`): FP32 sum of the partials in ascending rank order over the
token's destination set, rounded once to BF16 (the routed latent), optionally vLLM's RMSNorm of it.

Reading order: settings, the host-side launch signature, the device code, compile. No JAX here.

Parameters: `kernels.abi.COMBINE` (the launch and kernel signatures below are checked against it when compiled).
Grid: G >= 1 CTAs; the other ranks' rows r = c, c + G, ... < (N - 1) * peer_tokens are sent (rows t < peer_tokens
of each; the dispatch of this layer left the others empty); own tokens t = c, c + G, ... < T are reduced.
Block: L // 16 threads.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from jax_latent_ep import layout as lay
from jax_latent_ep.kernels import abi
from jax_latent_ep.shapes import LatentMoEShape
from jax_latent_ep.kernels.common import (
    EMPTY,
    TRACE,
    TRACE_WARPS,
    DeviceLayout,
    arrive_in_sequence,
    hand_over_epoch,
    compile_cubin,
    expert_rank_bit,
    fail,
    load_peer_table,
    peer_of,
    peer_row,
    poll_expired,
    trace_stamp,
    trace_warp,
)
from jax_latent_ep.kernels.dispatch import block_threads, check_shape, launch_options
from jax_latent_ep.kernels.primitives import (
    add_rn,
    bf16x2,
    bits_from_f32,
    clock64,
    f32_from_bits,
    globaltimer,
    griddepcontrol_wait_after,
    hi_f32,
    load_b32,
    load_relaxed_sys,
    load_v4,
    load_wide,
    lo_f32,
    mul_rn,
    rms_rstd,
    shfl_bfly_f32,
    store_wide,
    store_v4,
    warp_or,
)

# ---------------------------------------------------------------------------------------------------------
# Settings

#: Dynamic shared memory bytes the launcher must pass (the kernel uses less: 4 mask words and 32 words for the
#: FP32 warp sums of the RMSNorm).
SMEM_BYTES = 256


#: From this many own tokens on, the combine lets the next kernel be scheduled (PDL trigger) after its reduce
#: instead of before it. The late trigger is 0.4 us faster at T = 128 and even at T = 32-64; at T = 5-16 it is
#: 0.1-0.2 us slower, so small T keeps the early trigger (docs/performance.md, "Combine's PDL trigger after its
#: reduce").
LATE_TRIGGER_TOKENS = 64


def smem_bytes(shape: LatentMoEShape) -> int:
    """Dynamic shared memory bytes the launcher must pass (`SMEM_BYTES` for every shape)."""
    return SMEM_BYTES

class Combine:
    """The combine kernel for one `(shape, ranks)` (compile-time constants); `compile_combine` builds it."""

    def __init__(self, shape: LatentMoEShape, ranks: int):
        check_shape(shape)
        shape.check_ranks(ranks)
        self.shape, self.ranks = shape, ranks
        self.threads = block_threads(shape)
        self.warps = self.threads // 32
        # The warp that reads the first own token's routing while warp 0 arrives and waits (warp 0 if alone).
        self.mask_warp = 1 if self.warps > 1 else 0
        self.local_experts = shape.num_local_experts(ranks)

    # -----------------------------------------------------------------------------------------------------
    # Launch / host signature: the parameter list of the cubin (`abi.COMBINE`). This host function exists only to
    # compile the kernel; at run time the C++ FFI (or the harness) launches the cubin with its own grid.

    @cute.jit
    def launch(
        self,
        out: Int64,
        ids: Int64,
        norm_weight: Int64,
        result: Int64,
        peers: Int64,
        status: Int64,
        timeout_ns: Int64,
        eps: Float32,
        rank: Int32,
        tokens: Int32,
        peer_tokens: Int32,
        max_tokens: Int32,
        apply_norm: Int32,
    ):
        self.kernel(
            out, ids, norm_weight, result, peers, status, timeout_ns, eps, rank, tokens, peer_tokens, max_tokens,
            apply_norm,
        ).launch(**launch_options(self.threads, SMEM_BYTES, [tokens, 1, 1]))

    # -----------------------------------------------------------------------------------------------------
    # Device code

    @cute.kernel
    def kernel(
        self,
        out: Int64,
        ids: Int64,
        norm_weight: Int64,
        result: Int64,
        peers: Int64,
        status: Int64,
        timeout_ns: Int64,
        eps: Float32,
        rank: Int32,
        tokens: Int32,
        peer_tokens: Int32,
        max_tokens: Int32,
        apply_norm: Int32,
    ):
        shape, ranks = self.shape, self.ranks
        latent, topk = shape.latent, shape.topk
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        tid = Int32(tid)
        cta = Int32(cta)
        grid = Int32(grid)
        lane = tid % 32
        warp = tid // 32
        smem = cutlass.memory.SmemAllocator()
        # [0]: the destination mask of the token being reduced.
        shared_mask = smem.allocate_tensor(Int32, cute.make_layout(4), 16)
        # The FP32 bits of the warp sums of the RMSNorm.
        stash = smem.allocate_tensor(Int32, cute.make_layout(32), 16)
        buf = DeviceLayout(max_tokens, ranks, shape)
        column = Int64(tid) * 16
        local = peers - buf.peers  # the peer table lives in this rank's buffer: no load for the local base
        ctrl = peers - lay.CTRL_BELOW_PEERS  # right before the peer table: a constant offset
        stride = Int32(buf.stride)
        # Rows sent: rows t < peer_tokens of the other ranks, (N - 1) * peer_tokens (this rank's own rows are reduced
        # straight from `out`; the rows past peer_tokens are empty in every call of this layer).
        peer_rows = Int32(ranks - 1) * peer_tokens
        if cutlass.const_expr(TRACE):
            traced = Int32(0)
            if tid == 0 and cta == 0:
                traced = Int32(1)
            t_entry, c_entry = globaltimer(), clock64()

        # ---- Phase 1: one wave of loads: the first send row's source word (this rank's own mirror, written by
        # the dispatch's copy-out) and its output, lane d's peer base, this layer's epoch (EPOCH_C, written by
        # the dispatch) and EPOCH_D (neither is written before every CTA has arrived, `arrive_in_sequence`).
        # CTA c sends the rows r = c, c + G, ...: the first CTAs to be scheduled send (inside a jitted program the
        # last CTAs of a grid may wait for SMs that the expert stage still holds; the reduce waits for the sends
        # anyway; docs/performance.md, "Combine sends from the first CTAs"). Their addresses are computed
        # before the wait (they read no memory), so that their arithmetic runs while the previous grid still
        # runs.
        first = cta
        first_row = Int64(peer_row(first, rank, stride, peer_tokens, ranks))
        if first >= peer_rows:
            first_row = Int64(0)  # a valid address; nothing is sent
        source_at = local + buf.mirror + first_row * 4
        out_row = out + first_row * (2 * latent)
        griddepcontrol_wait_after(max_tokens, [source_at, out_row, ctrl])
        if cutlass.const_expr(TRACE):
            t_wait, c_wait = globaltimer(), clock64()
        source = load_b32(source_at)
        pieces = self.row_pieces(out_row, tid)
        table = load_peer_table(peers, rank, lane, ranks)
        epoch = load_relaxed_sys(ctrl + 4 * lay.CTRL_EPOCH_C)
        completed = load_relaxed_sys(ctrl + 4 * lay.CTRL_EPOCH_D)
        # Sequence guard: every thread fails before its first store unless a dispatch came before (EPOCH_C is
        # one past EPOCH_D).
        if completed + Uint32(1) != epoch:
            fail(ctrl, status, abi.ERROR_COMBINE_WITHOUT_DISPATCH, rank, rank, epoch - Uint32(1))
        if warp == self.mask_warp:
            # The destination mask of the first own token (routing input: no wait needed), read with the rest.
            if cta < tokens:
                self.token_mask(ids, cta, lane, shared_mask)

        # ---- Phase 2: send every valid receive row of another rank (the r-th for r = c, c + G, ...) to its source's
        # slot [token, rank] as wide LL words. The source word is CTA-uniform (every thread loads it), so the warps
        # stay converged.
        if first < peer_rows:
            self.send_row(table, buf, source, pieces, epoch, rank, tid)
        r = first + grid
        while r < peer_rows:
            row = Int64(peer_row(r, rank, stride, peer_tokens, ranks))
            source_q = load_b32(local + buf.mirror + row * 4)
            self.send_row(table, buf, source_q, self.row_pieces(out + row * (2 * latent), tid), epoch, rank, tid)
            r += grid
        if cutlass.const_expr(TRACE_WARPS):
            lane_of_cta0 = Int32(0)
            if cta == 0 and lane == 0:
                lane_of_cta0 = Int32(1)
        if cutlass.const_expr(TRACE):
            trace_stamp(ctrl, epoch, 8, t_entry, c_entry, traced)
            trace_stamp(ctrl, epoch, 9, t_wait, c_wait, traced)
            trace_stamp(ctrl, epoch, 10, globaltimer(), clock64(), traced)
        # Every thread of this CTA has passed the sequence check (above): arrive (nothing waits for the count
        # before the end).
        arrived = arrive_in_sequence(ctrl, lay.CTRL_COUNT_C, grid, tid)
        # The next kernel may be scheduled now (T < LATE_TRIGGER_TOKENS; else after the reduce); its
        # griddepcontrol.wait still waits for this grid's end. The branch is grid-uniform.
        if tokens < Int32(LATE_TRIGGER_TOKENS):
            cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(TRACE):
            trace_stamp(ctrl, epoch, 11, globaltimer(), clock64(), traced)

        # ---- Phase 3: reduce own tokens t = c, c + G, ... < T. Thread tid adds BF16 elements [16 tid, 16 tid + 16),
        # the slot's 4-byte pieces 8 tid .. 8 tid + 7: piece i is piece i % 3 of wide word i // 3, so the thread
        # reads words k .. k + 2 (k + 3 too when 8 tid % 3 == 2) with k = 8 tid // 3 and takes its pieces from
        # offset r = 8 tid % 3. For each rank d of the token's destination set, in ascending order, it polls those
        # words of slot [t, d] until each carries this epoch, then adds. Invariant: a partial is added only once it
        # was stored in this layer (each slot is stored once per layer, by rank d alone). This rank's own partial
        # (d = rank) is its own receive row of the token in `out`, loaded without a poll (an input of this kernel).
        first_word = Int64((8 * tid) // 3)
        offset = (8 * tid) % 3
        needs_fourth = Uint32(0)
        if offset == 2:
            needs_fourth = Uint32(1)
        gamma_base = out
        if apply_norm != 0:
            gamma_base = norm_weight
        t = cta
        while t < tokens:
            if t != cta:
                if warp == 0:
                    self.token_mask(ids, t, lane, shared_mask)
            cute.arch.sync_threads()
            mask = Uint32(shared_mask[0])
            gamma = load_v4(gamma_base + column * 2) + load_v4(gamma_base + column * 2 + 16)
            own = out + ((Int64(rank) * buf.stride + t) * latent + column) * 2
            if (mask >> Uint32(rank)) & Uint32(1) == Uint32(0):
                own = gamma_base  # a valid address; not added
            own_words = load_v4(own) + load_v4(own + 16)
            values = cute.make_rmem_tensor(16, Float32)
            for j in cutlass.range_constexpr(16):
                values[j] = Float32(0.0)
            for d in cutlass.range_constexpr(ranks):
                if (mask >> Uint32(d)) & Uint32(1) != Uint32(0) and Int32(d) == rank:
                    for j in cutlass.range_constexpr(8):
                        values[2 * j] = add_rn(values[2 * j], lo_f32(own_words[j]))
                        values[2 * j + 1] = add_rn(values[2 * j + 1], hi_f32(own_words[j]))
                if (mask >> Uint32(d)) & Uint32(1) != Uint32(0) and Int32(d) != rank:
                    part = local + buf.comb + (Int64(t) * ranks + d) * buf.comb_pitch + first_word * lay.WIDE_WORD
                    pending = Uint32(1)
                    # A timed-out poll leaves the loop and fails after it: the trap's branch inside the loop costs
                    # 0.15-0.4 us at N = 2 (docs/performance.md, "Timed-out poll leaves the loop").
                    expired = Uint32(0)
                    start = globaltimer()
                    polls = Uint32(0)
                    while pending != Uint32(0):
                        a0, a1, a2, ea = load_wide(part)
                        b0, b1, b2, eb = load_wide(part + lay.WIDE_WORD)
                        c0, c1, c2, ec = load_wide(part + 2 * lay.WIDE_WORD)
                        d0, d1, d2, ed = load_wide(part + 3 * lay.WIDE_WORD)  # inside the slot's padding
                        if ea == epoch and eb == epoch and ec == epoch and (needs_fourth == Uint32(0) or ed == epoch):
                            pending = Uint32(0)
                            loaded = [a0, a1, a2, b0, b1, b2, c0, c1, c2, d0, d1, d2]
                            words = []
                            for j in cutlass.range_constexpr(8):
                                piece = loaded[j]
                                if offset == 1:
                                    piece = loaded[j + 1]
                                if offset == 2:
                                    piece = loaded[j + 2]
                                words.append(piece)
                            for j in cutlass.range_constexpr(8):
                                values[2 * j] = add_rn(values[2 * j], lo_f32(words[j]))
                                values[2 * j + 1] = add_rn(values[2 * j + 1], hi_f32(words[j]))
                        else:
                            polls = polls + Uint32(1)
                            if poll_expired(start, polls, timeout_ns) != Uint32(0):
                                pending = Uint32(0)
                                expired = Uint32(1)
                    if expired != Uint32(0):
                        fail(ctrl, status, abi.ERROR_COMBINE_TIMEOUT, rank, Int32(d), epoch - Uint32(1))
            if cutlass.const_expr(TRACE_WARPS):
                if t == cta:
                    trace_warp(ctrl, epoch, warp, lane_of_cta0)  # this warp's polls of token 0 returned
            if cutlass.const_expr(TRACE):
                if t == cta:
                    trace_stamp(ctrl, epoch, 12, globaltimer(), clock64(), traced)
            routed = []
            for j in cutlass.range_constexpr(8):
                routed.append(bf16x2(values[2 * j], values[2 * j + 1]))
            dest = result + (Int64(t) * latent + column) * 2
            if apply_norm == 0:
                store_v4(dest, routed[0:4])
                store_v4(dest + 16, routed[4:8])
            else:
                # ss: per thread (elements in order), warp butterfly, then the warps in order.
                total = Float32(0.0)
                for j in cutlass.range_constexpr(8):
                    a = lo_f32(routed[j])
                    b = hi_f32(routed[j])
                    total = add_rn(total, mul_rn(a, a))
                    total = add_rn(total, mul_rn(b, b))
                for k in cutlass.range_constexpr(5):
                    total = add_rn(total, shfl_bfly_f32(total, 1 << k))
                if lane == 0:
                    stash[warp] = Int32(bits_from_f32(total))
                cute.arch.sync_threads()
                if cutlass.const_expr(TRACE_WARPS):
                    if t == cta:
                        trace_warp(ctrl, epoch, 8 + warp, lane_of_cta0)  # this warp past the stash barrier
                total = Float32(0.0)
                for w in cutlass.range_constexpr(self.warps):
                    total = add_rn(total, f32_from_bits(Uint32(stash[w])))
                rstd = rms_rstd(total, eps, latent)
                if cutlass.const_expr(TRACE_WARPS):
                    if t == cta and warp == 0:
                        trace_warp(ctrl, epoch, 15, lane_of_cta0)  # warp 0's rstd
                normed = []
                for j in cutlass.range_constexpr(8):
                    a = mul_rn(mul_rn(lo_f32(routed[j]), rstd), lo_f32(gamma[j]))
                    b = mul_rn(mul_rn(hi_f32(routed[j]), rstd), hi_f32(gamma[j]))
                    normed.append(bf16x2(a, b))
                store_v4(dest, normed[0:4])
                store_v4(dest + 16, normed[4:8])
                if cutlass.const_expr(TRACE_WARPS):
                    if t == cta and warp == 0:
                        trace_warp(ctrl, epoch, 7, lane_of_cta0)  # warp 0's result stores issued
            cute.arch.sync_threads()  # shared_mask / stash are reused by the next token
            if cutlass.const_expr(TRACE):
                if t == cta:
                    trace_stamp(ctrl, epoch, 13, globaltimer(), clock64(), traced)
            t += grid

        if tokens >= Int32(LATE_TRIGGER_TOKENS):
            cute.arch.griddepcontrol_launch_dependents()
        # ---- End: the layer is combined; the last CTA hands its epoch to the next dispatch (EPOCH_D).
        hand_over_epoch(ctrl, lay.CTRL_EPOCH_D, epoch, arrived, grid, tid)
        if cutlass.const_expr(TRACE):
            trace_stamp(ctrl, epoch, 14, globaltimer(), clock64(), traced)

    @cute.jit
    def row_pieces(self, row: Int64, tid: Int32):
        """The 4-byte pieces of the wide words this thread sends from the BF16 output row at `row` (`2 L` bytes):
        word w = tid + k * threads (k < ceil(comb_words / threads)) carries pieces 3 w .. 3 w + 2; a piece past the
        row is 0 (never loaded). Returns them in that order."""
        row_u32 = 2 * self.shape.latent // 4
        words = lay.comb_words(self.shape)
        pieces = []
        for k in cutlass.range_constexpr((words + self.threads - 1) // self.threads):
            for c in cutlass.range_constexpr(3):
                index = (tid + k * self.threads) * 3 + c
                if cutlass.const_expr(((k + 1) * self.threads) * 3 <= row_u32):
                    pieces.append(load_b32(row + Int64(index) * 4))
                else:
                    value = Uint32(0)
                    if index < row_u32:
                        value = load_b32(row + Int64(index) * 4)
                    pieces.append(value)
        return pieces

    @cute.jit
    def send_row(self, table: Int64, buf, source: Uint32, pieces, epoch: Uint32, rank: Int32, tid: Int32):
        """Stores this thread's wide words of a receive row's output (`pieces`, from `row_pieces`) into slot
        [token, rank] of the source rank named by `source` (nothing if the row is empty); consecutive lanes store
        consecutive words, so each warp instruction writes 512 contiguous bytes. Warp-wide (`peer_of` shuffles):
        `source` must be uniform over the warp."""
        if source != Uint32(EMPTY):
            origin = Int32(source >> Uint32(16))
            token = Int64(source & Uint32(0xFFFF))
            dest = peer_of(table, origin) + buf.comb + (token * self.ranks + rank) * buf.comb_pitch
            for k in cutlass.range_constexpr(len(pieces) // 3):
                w = tid + k * self.threads
                p = pieces[3 * k:3 * k + 3]
                if cutlass.const_expr((k + 1) * self.threads <= buf.comb_words):
                    store_wide(dest + Int64(w) * lay.WIDE_WORD, p[0], p[1], p[2], epoch)
                else:
                    if w < buf.comb_words:
                        store_wide(dest + Int64(w) * lay.WIDE_WORD, p[0], p[1], p[2], epoch)

    @cute.jit
    def token_mask(self, ids: Int64, t: Int32, lane: Int32, shared_mask):
        """Warp-wide: shared_mask[0] = the destination-rank mask of own token `t` (bit d iff one of its K experts
        lives on rank d; an id outside [0, E) sets no bit, as in the dispatch)."""
        bit = Uint32(0)
        if lane < self.shape.topk:
            expert = load_b32(ids + (Int64(t) * self.shape.topk + lane) * 4)
            bit = expert_rank_bit(expert, self.local_experts, self.ranks)
        mask = warp_or(bit)
        if lane == 0:
            shared_mask[0] = Int32(mask)


#: The cubin's one kernel symbol: `Combine.kernel` with a fixed name (the DSL appends `_0`).
Combine.kernel.set_name_prefix(abi.COMBINE.symbol, remove_cutlass_symbol=True, keep_mangled_name=False)


# ---------------------------------------------------------------------------------------------------------
# Compile


def compile_combine(shape: LatentMoEShape, ranks: int, arch: str = "sm_90a"):
    """Compiles the combine kernel of `(shape, ranks)` for `arch`; returns `(symbol, cubin bytes)`."""
    return compile_cubin(abi.COMBINE, Combine(shape, ranks), arch)
