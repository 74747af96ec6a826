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
    compile_cubin,
    last_arrival,
    peer_base,
    raise_flags,
    rearm_flags,
    wait_flags,
)
from jax_latent_ep.kernels.dispatch import block_threads, check_shape
from jax_latent_ep.kernels.memory import (
    add_rn,
    bf16x2,
    fence_acq_rel_sys,
    hi_f32,
    load_b32,
    load_u64,
    load_v4,
    lo_f32,
    mul_rn,
    rms_rstd,
    shfl_bfly_f32,
    store_b32,
    store_v4,
    warp_or,
)

# ---------------------------------------------------------------------------------------------------------
# Settings

#: Dynamic shared memory bytes the launcher must pass (the kernel uses less: a mask word and 32 FP32 warp sums).
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
        ).launch(grid=[tokens, 1, 1], block=[self.threads, 1, 1], smem=SMEM_BYTES)

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
        shared_mask = smem.allocate_tensor(Int32, cute.make_layout(4), 16)
        shared_sum = smem.allocate_tensor(Float32, cute.make_layout(32), 16)
        buf = DeviceLayout(max_tokens, ranks, shape)
        src_off = Int64(buf.src)
        ids_off = Int64(buf.ids)
        weights_off = Int64(buf.weights)
        comb_off = Int64(buf.comb)
        cflag = Int64(buf.cflag)
        rows = Int64(buf.rows)
        meta_pitch = buf.meta_pitch
        invalid = Uint32(((rank + 1) % ranks) * self.local_experts)  # re-armed rows: next rank's first expert
        column = Int64(tid) * 16

        cute.arch.griddepcontrol_wait()
        local = load_u64(peers + 8 * ranks)  # this rank's own buffer through its local mapping
        ctrl = local + buf.ctrl

        # Send every valid receive row's output to its source's slot [token, rank], then re-arm the row.
        r = cta
        while Int64(r) < rows:
            row = Int64(r)
            source = load_b32(local + src_off + row * lay.LINE)
            cute.arch.sync_threads()  # every thread read the source word before thread 0 re-arms it
            if source != Uint32(EMPTY):
                origin = Int32(source >> Uint32(16))
                token = Int64(source & Uint32(0xFFFF))
                target = origin
                if origin == rank:
                    target = Int32(ranks)
                dest = peer_base(peers, target) + comb_off + ((token * ranks + rank) * latent + column) * 2
                line = out + (row * latent + column) * 2
                first = load_v4(line)
                second = load_v4(line + 16)
                store_v4(dest, first)
                store_v4(dest + 16, second)
                if tid < topk:
                    store_b32(local + ids_off + row * meta_pitch + tid * 4, invalid)
                    store_b32(local + weights_off + row * meta_pitch + tid * 4, Uint32(0))
                if tid == 0:
                    store_b32(local + src_off + row * lay.LINE, Uint32(EMPTY))
            r += grid

        # Every thread that stored fences at system scope before the CTA's arrival is counted.
        fence_acq_rel_sys()
        cute.arch.sync_threads()
        waiters = grid
        if tokens < grid:
            waiters = tokens
        if warp == 0:
            if last_arrival(ctrl + 4 * lay.CTRL_COMBINE_DONE, grid, lane) != Uint32(0):
                raise_flags(peers, cflag, rank, lane, ranks)
            if cta < waiters:
                wait_flags(local, cflag, lane, ranks, timeout_ns, status, ctrl, rank, lay.ERROR_COMBINE_TIMEOUT, -1)
                # (wait_flags ended with warp 0's acquire fence; the barrier below extends it to the CTA.)
                if last_arrival(ctrl + 4 * lay.CTRL_COMBINE_SEEN, waiters, lane) != Uint32(0):
                    rearm_flags(local, cflag, lane, ranks)
        cute.arch.sync_threads()
        # The next kernel may be scheduled now; its griddepcontrol.wait still waits for this grid's end.
        cute.arch.griddepcontrol_launch_dependents()

        t = cta
        while t < tokens:
            if warp == 0:
                bit = Uint32(0)
                if lane < topk:
                    expert = Int32(load_b32(ids + (Int64(t) * topk + lane) * 4))
                    bit = Uint32(1) << Uint32(expert // self.local_experts)
                mask = warp_or(bit)
                if lane == 0:
                    shared_mask[0] = Int32(mask)
            cute.arch.sync_threads()
            mask = Uint32(shared_mask[0])
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
                    shared_sum[warp] = total
                cute.arch.sync_threads()
                total = Float32(0.0)
                for w in cutlass.range_constexpr(self.warps):
                    total = add_rn(total, shared_sum[w])
                rstd = rms_rstd(total, eps, latent)
                gamma = load_v4(norm_weight + column * 2) + load_v4(norm_weight + column * 2 + 16)
                normed = []
                for j in cutlass.range_constexpr(8):
                    a = mul_rn(mul_rn(lo_f32(routed[j]), rstd), lo_f32(gamma[j]))
                    b = mul_rn(mul_rn(hi_f32(routed[j]), rstd), hi_f32(gamma[j]))
                    normed.append(bf16x2(a, b))
                store_v4(dest, normed[0:4])
                store_v4(dest + 16, normed[4:8])
            cute.arch.sync_threads()  # shared_mask / shared_sum are reused by the next token
            t += grid


#: The cubin's one kernel symbol: `Combine.kernel` with a fixed name (the DSL appends `_0`).
Combine.kernel.set_name_prefix("ep_combine", remove_cutlass_symbol=True, keep_mangled_name=False)


# ---------------------------------------------------------------------------------------------------------
# Compile


def compile_combine(shape: LatentMoEShape, ranks: int, arch: str = "sm_90a"):
    """Compiles the combine kernel of `(shape, ranks)` for `arch`; returns `(symbol, cubin bytes)`."""
    kernel = Combine(shape, ranks)
    fake = [Int64(0)] * 7 + [Float32(0.0)] + [Int32(0)] * 4
    return compile_cubin(kernel.launch, fake, arch)
