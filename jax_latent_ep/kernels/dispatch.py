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
    compile_cubin,
    last_arrival,
    peer_base,
    raise_flags,
    rearm_flags,
    wait_flags,
)
from jax_latent_ep.kernels.memory import (
    bits_from_f32,
    e4m3x4,
    f32_from_bits,
    fence_acq_rel_sys,
    hi_f32,
    load_b32,
    load_u64,
    load_v4,
    lo_f32,
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

#: rn_f32(1 / 448), numerics.md's R.
RECIPROCAL_448_BITS = 0x3B124925
#: E8M0 scale of a 32-block that holds a NaN or Inf (the project's non-finite rule).
SF_NONFINITE = 255


def block_threads(shape: LatentMoEShape) -> int:
    """Threads per CTA: one per 16 latent elements."""
    check_shape(shape)
    return shape.latent // 16


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
        ).launch(grid=[tokens, 1, 1], block=[self.threads, 1, 1], smem=SMEM_BYTES)

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
        shared = smem.allocate_tensor(Int32, cute.make_layout(4), 16)
        buf = DeviceLayout(max_tokens, ranks, shape)

        cute.arch.griddepcontrol_wait()
        local = load_u64(peers + 8 * ranks)  # this rank's own buffer through its local mapping

        if cta < tokens:
            token = cta
            # Destination mask of the token: bit d set iff one of its experts lives on rank d.
            if warp == 0:
                bit = Uint32(0)
                if lane < topk:
                    expert = Int32(load_b32(ids + (Int64(token) * topk + lane) * 4))
                    bit = Uint32(1) << Uint32(expert // self.local_experts)
                mask = warp_or(bit)
                if lane == 0:
                    shared[0] = Int32(mask)
            cute.arch.sync_threads()
            mask = Uint32(shared[0])

            # MXFP8 of elements [16 tid, 16 tid + 16): two threads per 32-block.
            column = Int64(tid) * 16
            row = x + (Int64(token) * latent + column) * 2
            first = load_v4(row)
            second = load_v4(row + 16)
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

            expert_word = Uint32(0)
            weight_word = Uint32(0)
            if tid < topk:
                expert_word = load_b32(ids + (Int64(token) * topk + tid) * 4)
                weight_word = load_b32(weights + (Int64(token) * topk + tid) * 4)
            source_word = (Uint32(rank) << Uint32(16)) | Uint32(token)
            slot = Int64(rank) * buf.stride + token  # static receive row of this token on every rank

            for d in cutlass.range_constexpr(ranks):
                if (mask >> Uint32(d)) & Uint32(1) != Uint32(0):
                    target = Int32(d)
                    if rank == d:
                        target = Int32(ranks)
                    base = peer_base(peers, target)
                    store_v4(base + buf.x + slot * buf.x_pitch + column, packed)
                    if tid % 8 == 0:
                        store_b32(base + buf.sf + slot * buf.sf_pitch + tid // 2, sf_word)
                    if tid < topk:
                        store_b32(base + buf.ids + slot * buf.meta_pitch + tid * 4, expert_word)
                        store_b32(base + buf.weights + slot * buf.meta_pitch + tid * 4, weight_word)
                    if tid == 0:
                        store_b32(base + buf.src + slot * lay.LINE, source_word)

        # Every thread that stored fences at system scope before the CTA's arrival is counted.
        fence_acq_rel_sys()
        cute.arch.sync_threads()
        dflag = Int64(buf.dflag)
        ctrl = local + buf.ctrl
        if warp == 0:
            if last_arrival(ctrl + 4 * lay.CTRL_DISPATCH_DONE, grid, lane) != Uint32(0):
                raise_flags(peers, dflag, rank, lane, ranks)
            wait_flags(local, dflag, lane, ranks, timeout_ns, status, ctrl, rank, lay.ERROR_DISPATCH_TIMEOUT, 0)
            # (wait_flags ended with warp 0's acquire fence; the barrier below extends it to the CTA.)
            if last_arrival(ctrl + 4 * lay.CTRL_DISPATCH_SEEN, grid, lane) != Uint32(0):
                rearm_flags(local, dflag, lane, ranks)
                if lane == 0:
                    store_b32(ctrl + 4 * lay.CTRL_LAYER, load_b32(ctrl + 4 * lay.CTRL_LAYER) + Uint32(1))
        cute.arch.sync_threads()
        # The next kernel may be scheduled now; its griddepcontrol.wait still waits for this grid's end.
        cute.arch.griddepcontrol_launch_dependents()

        # Copy the receive rows out of the local buffer into XLA's outputs.
        r = cta
        while r < buf.rows:
            row = Int64(r)
            source = load_b32(local + buf.src + row * lay.LINE)
            if tid == 0:
                store_b32(recv_src + row * 4, source)
            if tid < topk:
                store_b32(recv_ids + (row * topk + tid) * 4, load_b32(local + buf.ids + row * buf.meta_pitch + tid * 4))
                store_b32(
                    recv_weights + (row * topk + tid) * 4,
                    load_b32(local + buf.weights + row * buf.meta_pitch + tid * 4),
                )
            if source != Uint32(0xFFFFFFFF):
                column = Int64(tid) * 16
                store_v4(recv_x + row * latent + column, load_v4(local + buf.x + row * buf.x_pitch + column))
                if tid < num_sf // 16:
                    store_v4(recv_sf + row * num_sf + column, load_v4(local + buf.sf + row * buf.sf_pitch + column))
            r += grid


#: The cubin's one kernel symbol: `Dispatch.kernel` with a fixed name (the DSL appends `_0`).
Dispatch.kernel.set_name_prefix("ep_dispatch", remove_cutlass_symbol=True, keep_mangled_name=False)


# ---------------------------------------------------------------------------------------------------------
# Compile


def compile_dispatch(shape: LatentMoEShape, ranks: int, arch: str = "sm_90a"):
    """Compiles the dispatch kernel of `(shape, ranks)` for `arch`; returns `(symbol, cubin bytes)`."""
    kernel = Dispatch(shape, ranks)
    fake = [Int64(0)] * 11 + [Int32(0)] * 3
    return compile_cubin(kernel.launch, fake, arch)
