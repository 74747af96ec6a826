"""EpDispatch: MXFP8-quantize this rank's tokens and store them into their receive rows on every destination
rank, then (every CTA) wait for all N ranks and copy this rank's receive rows into XLA's output arrays.

Reading order: settings, the host-side launch signature, the device code, compile. No JAX here.

Parameters (docs/kernel_abi.md; all scalars): x, ids, weights, peers, recv_x, recv_sf, recv_ids,
recv_weights, recv_src, status (i64 addresses), timeout_ns (i64), rank, tokens, max_tokens (i32).
Grid: G >= T CTAs (a run-time choice); CTA t < T sends token t; every CTA arrives, waits for the N dispatch
flags and copies receive rows r = cta, cta + G, ... out of the local buffer. Block: L // 16 threads.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

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
from jax_latent_ep.kernels.memory import (
    ballot,
    bits_from_f32,
    e4m3x4,
    f32_from_bits,
    fence_acq_rel_sys,
    hi_f32,
    load_b32,
    load_u64,
    load_v4,
    lo_f32,
    lowest_bit,
    mul_ftz,
    shfl_bfly,
    shfl_idx,
    store_b32,
    store_v4,
    warp_or,
)

# ---------------------------------------------------------------------------------------------------------
# Settings

#: Dynamic shared memory bytes the launcher must pass (the kernel uses less: a mask word).
SMEM_BYTES = 128

#: Parameter list of the cubin, in order: (name, type). The C++ launcher passes exactly these.
PARAMS = (
    ("x", "i64"),
    ("ids", "i64"),
    ("weights", "i64"),
    ("peers", "i64"),
    ("recv_x", "i64"),
    ("recv_sf", "i64"),
    ("recv_ids", "i64"),
    ("recv_weights", "i64"),
    ("recv_src", "i64"),
    ("status", "i64"),
    ("timeout_ns", "i64"),
    ("rank", "i32"),
    ("tokens", "i32"),
    ("max_tokens", "i32"),
)

#: Valid receive rows copied out together (all their loads in flight before their stores).
COPY_ROWS = 2

#: rn_f32(1 / 448), numerics.md's R.
RECIPROCAL_448_BITS = 0x3B124925
#: E8M0 scale of a 32-block that holds a NaN or Inf (the project's non-finite rule).
SF_NONFINITE = 255


def block_threads(shape: LatentMoEShape) -> int:
    """Threads per CTA: one per 16 latent elements."""
    check_shape(shape)
    return shape.latent // 16


#: Registers per thread the kernels are held to (ptxas `.minnctapersm`, see `min_ctas_per_sm`).
MAX_REGISTERS = 48


def min_ctas_per_sm(threads: int) -> int:
    """CTAs of `threads` threads that must fit on one SM by registers (64K per SM, `MAX_REGISTERS` each): 6 for
    Kimi K3's 224-thread CTAs, 3 for DeepSeek-V3's 448 (the co-residency bound of docs/kernel_abi.md)."""
    return max(1, 65536 // (threads * MAX_REGISTERS))


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
        self.local_experts = shape.num_local_experts(ranks)

    # -----------------------------------------------------------------------------------------------------
    # Launch / host signature: the parameter list of the cubin (PARAMS). This host function exists only to
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
        max_tokens: Int32,
    ):
        self.kernel(
            x, ids, weights, peers, recv_x, recv_sf, recv_ids, recv_weights, recv_src,
            status, timeout_ns, rank, tokens, max_tokens,
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
        # [0]: the token's destination mask; [1]: the valid-row mask of the current copy-out chunk.
        shared = smem.allocate_tensor(Int32, cute.make_layout(4), 16)
        buf = DeviceLayout(max_tokens, ranks, shape)
        column = Int64(tid) * 16

        cute.arch.griddepcontrol_wait()
        # Lane d of every warp holds rank d's buffer base (this rank's own through its local mapping); the
        # token's inputs are loaded in the same wave, before anything waits for either.
        table = load_peer_table(peers, rank, lane, ranks)

        if cta < tokens:
            token = cta
            # Every load of the token first, all in flight together: its K ids and weights (threads tid < K,
            # which are warp 0's lanes: K <= 32) and the 32 bytes of x of this thread.
            meta = Int64(token) * topk + tid
            if tid >= topk:
                meta = Int64(token) * topk  # a valid address; the value is not used
            expert_word = load_b32(ids + meta * 4)
            weight_word = load_b32(weights + meta * 4)
            x_line = x + (Int64(token) * latent + column) * 2
            first = load_v4(x_line)
            second = load_v4(x_line + 16)
            # Destination mask of the token: bit d set iff one of its experts lives on rank d.
            if warp == 0:
                bit = Uint32(0)
                if lane < topk:
                    bit = Uint32(1) << Uint32(Int32(expert_word) // self.local_experts)
                mask = warp_or(bit)
                if lane == 0:
                    shared[0] = Int32(mask)

            # MXFP8 of elements [16 tid, 16 tid + 16): two threads per 32-block.
            words = first + second
            top = Uint32(0)
            for w in cutlass.range_constexpr(8):
                lo = words[w] & Uint32(0x7FFF)
                hi = (words[w] >> Uint32(16)) & Uint32(0x7FFF)
                if lo > top:
                    top = lo
                if hi > top:
                    top = hi
            other = shfl_bfly(top, 1)
            if other > top:
                top = other
            # MXFP8 scale (numerics.md) on the bits: s = ftz(amax * R); e = 0 if s == 0 else
            # min(254, biased_exp(s) + (mantissa(s) != 0)); inv = 2^(127 - e) built from bits (0 if e == 0).
            # For BF16 input e <= 247, so inv is a normal FP32. A block holding a NaN or Inf (amax bits >= 0x7F80)
            # gets e = 255 and inv = 0: q = e4m3(x * 0) is NaN for its non-finite elements, +-0 for the others.
            s_bits = Uint32(
                bits_from_f32(mul_ftz(f32_from_bits(top << Uint32(16)), f32_from_bits(Uint32(RECIPROCAL_448_BITS))))
            )
            e = Uint32(0)
            if s_bits & Uint32(0x7FFFFFFF) != Uint32(0):
                e = (s_bits >> Uint32(23)) & Uint32(0xFF)
                if s_bits & Uint32(0x7FFFFF) != Uint32(0):
                    e = e + Uint32(1)
                if e > Uint32(254):
                    e = Uint32(254)
            inv_bits = Uint32(0)
            if e != Uint32(0):
                inv_bits = (Uint32(254) - e) << Uint32(23)
            if top >= Uint32(0x7F80):  # NaN or Inf in the block
                e = Uint32(SF_NONFINITE)
                inv_bits = Uint32(0)
            inv = f32_from_bits(inv_bits)
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

            source_word = (Uint32(rank) << Uint32(16)) | Uint32(token)
            slot = Int64(rank) * buf.stride + token  # static receive row of this token on every rank
            cute.arch.sync_threads()  # the mask (the x loads above were issued before this barrier)
            mask = Uint32(shared[0])

            for d in cutlass.range_constexpr(ranks):
                if (mask >> Uint32(d)) & Uint32(1) != Uint32(0):
                    base = peer_of(table, Int32(d))  # the mask is CTA-uniform: the warp is converged
                    store_v4(base + buf.x + slot * buf.x_pitch + column, packed)
                    if tid % 8 == 0:
                        store_b32(base + buf.sf + slot * buf.sf_pitch + tid // 2, sf_word)
                    if tid < topk:
                        store_b32(base + buf.ids + slot * buf.meta_pitch + tid * 4, expert_word)
                        store_b32(base + buf.weights + slot * buf.meta_pitch + tid * 4, weight_word)
                    if tid == 0:
                        store_b32(base + buf.src + slot * lay.LINE, source_word)
            # Every thread of this CTA stored (every token reaches >= 1 rank): each fences at system scope before
            # the CTA's arrival is counted. CTAs cta >= T stored nothing and skip the fence.
            fence_acq_rel_sys()
        cute.arch.sync_threads()
        local = peer_of(table, rank)  # this rank's own buffer through its local mapping
        dflag = Int64(buf.dflag)
        ctrl = local + buf.ctrl
        seen = Uint32(0)
        if warp == 0:
            if last_arrival(ctrl + 4 * lay.CTRL_DISPATCH_DONE, grid, lane) != Uint32(0):
                raise_flags(table, dflag, rank, lane, ranks)
            wait_flags(local, dflag, lane, ranks, timeout_ns, status, ctrl, rank, lay.ERROR_DISPATCH_TIMEOUT, 0)
            # (wait_flags ended with warp 0's acquire fence; the barrier below extends it to the CTA.)
            # The SEEN arrival is issued now, its result used at the end (`finish_seen`).
            seen = arrive_seen(ctrl + 4 * lay.CTRL_DISPATCH_SEEN, grid, lane)
        cute.arch.sync_threads()
        # The next kernel may be scheduled now; its griddepcontrol.wait still waits for this grid's end.
        cute.arch.griddepcontrol_launch_dependents()

        # Copy the receive rows r = cta + k * G (k < count) out of the local buffer into XLA's outputs, in chunks
        # of 32 rows: warp 0's lane j loads the source word of the chunk's row j (all in flight), copies it to
        # recv_src and ballots its validity; after one barrier every thread copies the valid rows, U at a time
        # with all their loads issued before any store, and writes the known constants of the empty rows
        # (ids = the next rank's first expert, weights 0: what init and the combine's re-arm leave there).
        invalid = Uint32(((rank + 1) % ranks) * self.local_experts)
        rows32 = Int32(buf.rows)  # N * S < 2^21
        count = Int32(0)
        if cta < rows32:
            count = (rows32 - cta + grid - 1) // grid
        sf_threads = num_sf // 16
        x_src = local + buf.x + column
        sf_col = column
        if tid >= sf_threads:
            sf_col = Int64(0)  # a valid address; the value is not stored
        meta_col = Int64(tid) * 4
        if tid >= topk:
            meta_col = Int64(0)
        kb = Int32(0)
        while kb < count:
            if warp == 0:
                valid = Uint32(0)
                if kb + lane < count:
                    crow = Int64(cta) + Int64(kb + lane) * Int64(grid)
                    csource = load_b32(local + buf.src + crow * lay.LINE)
                    store_b32(recv_src + crow * 4, csource)
                    if csource != Uint32(0xFFFFFFFF):
                        valid = Uint32(1)
                valid_mask = ballot(valid)
                if lane == 0:
                    shared[1] = Int32(valid_mask)
            cute.arch.sync_threads()
            vmask = Uint32(shared[1])
            in_chunk = count - kb
            if in_chunk > 32:
                in_chunk = Int32(32)
            # Empty rows: constants, one (row, k) pair per thread.
            p = tid
            while p < in_chunk * topk:
                pj = p // topk
                if (vmask >> Uint32(pj)) & Uint32(1) == Uint32(0):
                    prow = Int64(cta) + Int64(kb + pj) * Int64(grid)
                    at = prow * topk + (p - pj * topk)
                    store_b32(recv_ids + at * 4, invalid)
                    store_b32(recv_weights + at * 4, Uint32(0))
                p += self.threads
            # Valid rows, U at a time (a short group repeats its first row: loaded again, stored once).
            m = vmask
            while m != Uint32(0):
                rows = []
                lives = []
                j0 = lowest_bit(m)
                m = m & (m - Uint32(1))
                for u in cutlass.range_constexpr(COPY_ROWS):
                    ju = j0
                    live = Uint32(1)
                    if u > 0:
                        live = Uint32(0)
                        if m != Uint32(0):
                            ju = lowest_bit(m)
                            m = m & (m - Uint32(1))
                            live = Uint32(1)
                    rows.append(Int64(cta) + Int64(kb + Int32(ju)) * Int64(grid))
                    lives.append(live)
                loaded = []
                for u in cutlass.range_constexpr(COPY_ROWS):
                    vrow = rows[u]
                    xs = load_v4(x_src + vrow * buf.x_pitch)
                    sfs = load_v4(local + buf.sf + vrow * buf.sf_pitch + sf_col)
                    e_w = load_b32(local + buf.ids + vrow * buf.meta_pitch + meta_col)
                    w_w = load_b32(local + buf.weights + vrow * buf.meta_pitch + meta_col)
                    loaded.append((xs, sfs, e_w, w_w))
                for u in cutlass.range_constexpr(COPY_ROWS):
                    vrow = rows[u]
                    xs, sfs, e_w, w_w = loaded[u]
                    if lives[u] != Uint32(0):
                        store_v4(recv_x + vrow * latent + column, xs)
                        if tid < sf_threads:
                            store_v4(recv_sf + vrow * num_sf + column, sfs)
                        if tid < topk:
                            store_b32(recv_ids + (vrow * topk + tid) * 4, e_w)
                            store_b32(recv_weights + (vrow * topk + tid) * 4, w_w)
            cute.arch.sync_threads()  # every thread read shared[1] before warp 0 writes the next chunk's
            kb += 32

        # The last SEEN arrival re-arms the dispatch flags and counts the layer.
        if warp == 0:
            finish_seen(seen, grid, local, dflag, lane, ranks, ctrl, True)


#: The cubin's one kernel symbol: `Dispatch.kernel` with a fixed name (the DSL appends `_0`).
Dispatch.kernel.set_name_prefix("ep_dispatch", remove_cutlass_symbol=True, keep_mangled_name=False)


# ---------------------------------------------------------------------------------------------------------
# Compile


def compile_dispatch(shape: LatentMoEShape, ranks: int, arch: str = "sm_90a"):
    """Compiles the dispatch kernel of `(shape, ranks)` for `arch`; returns `(symbol, cubin bytes)`."""
    kernel = Dispatch(shape, ranks)
    fake = [Int64(0)] * 11 + [Int32(0)] * 3
    return compile_cubin(kernel.launch, fake, arch)
