"""EpCombine: send every received row's BF16 expert output back to its source's combine slot, re-arm the row,
then (CTAs with own tokens) wait for all N ranks and reduce: FP32 sum of the partials in ascending rank order
over the token's destination set, rounded once to BF16 (the routed latent), optionally vLLM's RMSNorm of it.

Reading order: settings, the host-side launch signature, the device code, compile. No JAX here.

Parameters (docs/kernel_abi.md; all scalars): out, ids, norm_weight, result, peers, status (i64 addresses),
timeout_ns (i64), eps (f32), rank, tokens, max_tokens, apply_norm (i32).
Grid: G >= 1 CTAs; rows r = cta, cta + G, ... are sent; CTAs cta < min(G, T) wait and reduce own tokens
t = cta, cta + G, ... Block: L // 16 threads.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32

from jax_latent_ep import layout as lay
from jax_latent_ep.config import LatentMoEShape
from jax_latent_ep.kernels.common import (
    DeviceLayout,
    arrive_seen,
    compile_cubin,
    finish_seen,
    last_arrival,
    load_peer_table,
    peer_of,
    raise_flags,
    wait_flags,
)
from jax_latent_ep.kernels.dispatch import block_threads, check_shape, min_ctas_per_sm
from jax_latent_ep.kernels.memory import (
    add_rn,
    ballot,
    bf16x2,
    bits_from_f32,
    f32_from_bits,
    fence_acq_rel_sys,
    hi_f32,
    load_b32,
    load_v4,
    lo_f32,
    lowest_bit,
    mul_rn,
    rms_rstd,
    shfl_bfly_f32,
    store_b32,
    store_v4,
    warp_or,
)

# ---------------------------------------------------------------------------------------------------------
# Settings

#: Dynamic shared memory bytes the launcher must pass (the kernel uses less: 4 mask words and 32 words that hold
#: the source words of a send chunk, then the FP32 warp sums).
SMEM_BYTES = 256

#: Parameter list of the cubin, in order: (name, type). The C++ launcher passes exactly these.
PARAMS = (
    ("out", "i64"),
    ("ids", "i64"),
    ("norm_weight", "i64"),
    ("result", "i64"),
    ("peers", "i64"),
    ("status", "i64"),
    ("timeout_ns", "i64"),
    ("eps", "f32"),
    ("rank", "i32"),
    ("tokens", "i32"),
    ("max_tokens", "i32"),
    ("apply_norm", "i32"),
)

#: Valid receive rows sent together (all their loads in flight before their stores).
SEND_ROWS = 2

#: Source word of an empty receive row.
EMPTY = 0xFFFFFFFF


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
    # Launch / host signature: the parameter list of the cubin (PARAMS). This host function exists only to
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
        max_tokens: Int32,
        apply_norm: Int32,
    ):
        self.kernel(
            out, ids, norm_weight, result, peers, status, timeout_ns, eps, rank, tokens, max_tokens, apply_norm
        ).launch(
            grid=[tokens, 1, 1],
            block=[self.threads, 1, 1],
            smem=SMEM_BYTES,
            # Co-residency (docs/kernel_abi.md): bound the registers so that min_ctas_per_sm CTAs fit on an SM
            # (ptxas `.minnctapersm`); the carveout is a launch-time attribute only, given so that compiling
            # needs no device query.
            min_blocks_per_mp=min_ctas_per_sm(self.threads),
            preferred_smem_carveout=-1,
        )

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
        # [0]: the destination mask of the token being reduced; [1]: the valid-row mask of the current send chunk.
        shared_mask = smem.allocate_tensor(Int32, cute.make_layout(4), 16)
        # Send phase: the source words of the chunk's 32 rows. Reduce phase: the 32 warp sums (FP32 bits).
        # (The send phase ends with a CTA barrier before the reduce phase writes it.)
        stash = smem.allocate_tensor(Int32, cute.make_layout(32), 16)
        buf = DeviceLayout(max_tokens, ranks, shape)
        src_off = Int64(buf.src)
        ids_off = Int64(buf.ids)
        weights_off = Int64(buf.weights)
        comb_off = Int64(buf.comb)
        cflag = Int64(buf.cflag)
        meta_pitch = buf.meta_pitch
        invalid = Uint32(((rank + 1) % ranks) * self.local_experts)  # re-armed rows: next rank's first expert
        column = Int64(tid) * 16

        cute.arch.griddepcontrol_wait()
        # Lane d of every warp holds rank d's buffer base (this rank's own through its local mapping).
        table = load_peer_table(peers, rank, lane, ranks)
        local = peer_of(table, rank)
        ctrl = local + buf.ctrl

        # Send every valid receive row r = cta + k * G (k < count) to its source's slot [token, rank], then re-arm
        # the row. In chunks of 32 rows: warp 0's lane j loads the source word of the chunk's row j (all in
        # flight) into shared memory and ballots its validity; after one barrier every thread sends the valid
        # rows, U at a time with all their loads issued before any store. The row's re-arm (its source word by
        # thread 0) comes after that barrier, so after every read of the word.
        rows32 = Int32(buf.rows)  # N * S < 2^21
        count = Int32(0)
        if cta < rows32:
            count = (rows32 - cta + grid - 1) // grid
        stored = Uint32(0)
        kb = Int32(0)
        while kb < count:
            if warp == 0:
                csource = Uint32(EMPTY)
                if kb + lane < count:
                    crow = Int64(cta) + Int64(kb + lane) * Int64(grid)
                    csource = load_b32(local + src_off + crow * lay.LINE)
                stash[lane] = Int32(csource)
                valid_mask = ballot(csource ^ Uint32(EMPTY))
                if lane == 0:
                    shared_mask[1] = Int32(valid_mask)
            cute.arch.sync_threads()
            m = Uint32(shared_mask[1])
            if m != Uint32(0):
                stored = Uint32(1)
            while m != Uint32(0):
                js = []
                lives = []
                j0 = lowest_bit(m)
                m = m & (m - Uint32(1))
                for u in cutlass.range_constexpr(SEND_ROWS):
                    ju = j0
                    live = Uint32(1)
                    if u > 0:
                        live = Uint32(0)
                        if m != Uint32(0):
                            ju = lowest_bit(m)
                            m = m & (m - Uint32(1))
                            live = Uint32(1)
                    js.append(ju)
                    lives.append(live)
                # Every load of the group first (a short group repeats its first row: loaded again, sent once).
                loaded = []
                for u in cutlass.range_constexpr(SEND_ROWS):
                    srow = Int64(cta) + Int64(kb + Int32(js[u])) * Int64(grid)
                    line = out + (srow * latent + column) * 2
                    first = load_v4(line)
                    second = load_v4(line + 16)
                    source = Uint32(stash[Int32(js[u])])
                    loaded.append((srow, first, second, source))
                for u in cutlass.range_constexpr(SEND_ROWS):
                    srow, first, second, source = loaded[u]
                    origin = Int32(source >> Uint32(16))
                    token = Int64(source & Uint32(0xFFFF))
                    # The base of the origin (its local mapping if it is this rank); the group is CTA-uniform.
                    dest = peer_of(table, origin) + comb_off + ((token * ranks + rank) * latent + column) * 2
                    if lives[u] != Uint32(0):
                        store_v4(dest, first)
                        store_v4(dest + 16, second)
                        if tid < topk:
                            store_b32(local + ids_off + srow * meta_pitch + tid * 4, invalid)
                            store_b32(local + weights_off + srow * meta_pitch + tid * 4, Uint32(0))
                        if tid == 0:
                            store_b32(local + src_off + srow * lay.LINE, Uint32(EMPTY))
            cute.arch.sync_threads()  # every thread read the stash before warp 0 writes the next chunk's
            kb += 32

        # Every thread of a CTA that sent a row stored (remotely and re-arms): each fences at system scope before
        # the CTA's arrival is counted. CTAs without a valid row stored nothing (their source-word reads were
        # consumed before the barrier above) and skip the fence.
        if stored != Uint32(0):
            fence_acq_rel_sys()
        cute.arch.sync_threads()
        waiters = grid
        if tokens < grid:
            waiters = tokens
        seen = Uint32(0)
        if warp == 0:
            if last_arrival(ctrl + 4 * lay.CTRL_COMBINE_DONE, grid, lane) != Uint32(0):
                raise_flags(table, cflag, rank, lane, ranks)
        # The RMSNorm weight of this thread's 16 elements is loaded with each token's partials (one round trip for
        # both); from `out` when there is no norm (a valid address, the value unused).
        gamma_base = out
        if apply_norm != 0:
            gamma_base = norm_weight
        if warp == self.mask_warp:
            # The destination mask of the first own token (routing input: no flag needed), read while waiting.
            if cta < tokens:
                self.token_mask(ids, cta, lane, shared_mask)
        if warp == 0:
            if cta < waiters:
                wait_flags(local, cflag, lane, ranks, timeout_ns, status, ctrl, rank, lay.ERROR_COMBINE_TIMEOUT, -1)
                # (wait_flags ended with warp 0's acquire fence; the barrier below extends it to the CTA.)
                seen = arrive_seen(ctrl + 4 * lay.CTRL_COMBINE_SEEN, waiters, lane)
        cute.arch.sync_threads()
        # The next kernel may be scheduled now; its griddepcontrol.wait still waits for this grid's end.
        cute.arch.griddepcontrol_launch_dependents()

        t = cta
        while t < tokens:
            if t != cta:
                if warp == 0:
                    self.token_mask(ids, t, lane, shared_mask)
                cute.arch.sync_threads()
            mask = Uint32(shared_mask[0])
            gamma = load_v4(gamma_base + column * 2) + load_v4(gamma_base + column * 2 + 16)
            values = cute.make_rmem_tensor(16, Float32)
            for j in cutlass.range_constexpr(16):
                values[j] = Float32(0.0)
            for d in cutlass.range_constexpr(ranks):
                if (mask >> Uint32(d)) & Uint32(1) != Uint32(0):
                    part = local + comb_off + ((Int64(t) * ranks + d) * latent + column) * 2
                    first = load_v4(part)
                    second = load_v4(part + 16)
                    words = first + second
                    for j in cutlass.range_constexpr(8):
                        values[2 * j] = add_rn(values[2 * j], lo_f32(words[j]))
                        values[2 * j + 1] = add_rn(values[2 * j + 1], hi_f32(words[j]))
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
                total = Float32(0.0)
                for w in cutlass.range_constexpr(self.warps):
                    total = add_rn(total, f32_from_bits(Uint32(stash[w])))
                rstd = rms_rstd(total, eps, latent)
                normed = []
                for j in cutlass.range_constexpr(8):
                    a = mul_rn(mul_rn(lo_f32(routed[j]), rstd), lo_f32(gamma[j]))
                    b = mul_rn(mul_rn(hi_f32(routed[j]), rstd), hi_f32(gamma[j]))
                    normed.append(bf16x2(a, b))
                store_v4(dest, normed[0:4])
                store_v4(dest + 16, normed[4:8])
            cute.arch.sync_threads()  # shared_mask / stash are reused by the next token
            t += grid

        # The last SEEN arrival re-arms the combine flags.
        if warp == 0:
            if cta < waiters:
                finish_seen(seen, waiters, local, cflag, lane, ranks, ctrl, False)

    @cute.jit
    def token_mask(self, ids: Int64, t: Int32, lane: Int32, shared_mask):
        """Warp-wide: shared_mask[0] = the destination-rank mask of own token `t` (bit d iff one of its K experts
        lives on rank d)."""
        bit = Uint32(0)
        if lane < self.shape.topk:
            expert = Int32(load_b32(ids + (Int64(t) * self.shape.topk + lane) * 4))
            bit = Uint32(1) << Uint32(expert // self.local_experts)
        mask = warp_or(bit)
        if lane == 0:
            shared_mask[0] = Int32(mask)


#: The cubin's one kernel symbol: `Combine.kernel` with a fixed name (the DSL appends `_0`).
Combine.kernel.set_name_prefix("ep_combine", remove_cutlass_symbol=True, keep_mangled_name=False)


# ---------------------------------------------------------------------------------------------------------
# Compile


def compile_combine(shape: LatentMoEShape, ranks: int, arch: str = "sm_90a"):
    """Compiles the combine kernel of `(shape, ranks)` for `arch`; returns `(symbol, cubin bytes)`."""
    kernel = Combine(shape, ranks)
    fake = [Int64(0)] * 7 + [Float32(0.0)] + [Int32(0)] * 4
    return compile_cubin(kernel.launch, fake, arch)
