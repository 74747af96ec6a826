"""EpSwigluMxfp8: the FP8 / MXFP4 expert stage's middle step, for the pairs that exist: each pair's gate and up (the
FP32 sums of their split partials), `h = bf16(silu(gate) * up)`, and `h` rounded to MXFP8 for down.

Reading order: settings, the host-side launch signature, the device code, compile. No JAX here.

Parameters: `kernels.abi.SWIGLU_MXFP8`. A unit is 8 consecutive columns of one pair, a thread's; four lanes hold a
32-block. The grid is persistent: warp `w` of the grid takes units `32 w + lane, 32 (w + warps) + lane, ..` below
`count * num_i / 8` (`count` read on the device: the plan's pairs used, so a capacity sized for the worst case costs
nothing past them). Per unit:
  1. gate and up, each the FP32 sum of its `num_splits` partials in split order from split 0 (`add.rn`);
  2. `h = bf16(silu_mul(gate, up))` (`primitives.silu_mul`: within a few FP32 ulps of XLA's silu, rounded once);
  3. the block's largest BF16 magnitude over its four lanes (two butterflies), its E8M0 exponent and `h * 2^(127 - e)`
     to e4m3 (`common.mxfp8_exponent`: `numerics.mxfp8_quantize` bit for bit on the same `h`); lane 0 of each 16
     stores the 4 scale bytes of its 128 columns in one word.
Rows at or past `count` are never written.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from jax_latent_ep.kernels import abi
from jax_latent_ep.kernels.common import compile_cubin, mxfp8_block_scale
from jax_latent_ep.kernels.primitives import (
    add_rn,
    bf16x2,
    e4m3x4,
    f32_from_bits,
    griddepcontrol_wait,
    hi_f32,
    load_b32,
    load_v4,
    lo_f32,
    mul_ftz,
    shfl_idx,
    silu_mul,
    store_b32,
    store_v2_b32,
)

# ---------------------------------------------------------------------------------------------------------
# Settings

THREADS = 256
WARPS = THREADS // 32
#: Columns of a thread's unit: two 16-byte loads of each FP32 partial, one 8-byte store of e4m3.
UNIT = 8
#: No shared memory.
SMEM_BYTES = 0


def smem_bytes() -> int:
    """Dynamic shared memory bytes the launcher passes."""
    return SMEM_BYTES


# ---------------------------------------------------------------------------------------------------------
# Launch / host signature (`abi.SWIGLU_MXFP8`): this host function exists only to compile the kernel; the C++ FFI
# launches the cubin with its own grid.


class SwigluMxfp8:
    """The SwiGLU-and-MXFP8 kernel (every size a run-time parameter); `compile_swiglu_mxfp8` builds it."""

    @cute.jit
    def launch(self, gate: Int64, up: Int64, count: Int64, q: Int64, sf: Int64, num_splits: Int32, num_pairs: Int32,
               num_i: Int32, row_stride: Int32):
        self.kernel(gate, up, count, q, sf, num_splits, num_pairs, num_i, row_stride).launch(
            # The FFI handler sets the grid: at most the resident CTAs, no more than the worst case's units need.
            grid=[1, 1, 1], block=[THREADS, 1, 1], smem=SMEM_BYTES, preferred_smem_carveout=-1,
        )

    # -----------------------------------------------------------------------------------------------------
    # Device code

    @cute.kernel
    def kernel(self, gate: Int64, up: Int64, count: Int64, q: Int64, sf: Int64, num_splits: Int32,
               num_pairs: Int32, num_i: Int32, row_stride: Int32):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        tid = Int32(tid)
        lane = tid % 32
        warp = Int32(cta) * WARPS + tid // 32
        warps = Int32(grid) * WARPS
        units_per_row = num_i // UNIT
        griddepcontrol_wait()  # the partials (and the plan's count) come from the previous kernels
        total = Int32(load_b32(count)) * units_per_row
        split_bytes = Int64(num_pairs) * Int64(row_stride) * 4

        # Warp-uniform loop (the shuffles need the whole warp): lanes past `total` recompute the last unit, unstored.
        for first in range(warp * 32, total, warps * 32):
            unit = first + lane
            live = unit < total
            if unit > total - 1:
                unit = total - 1
            row = unit // units_per_row
            col = (unit % units_per_row) * UNIT

            # ---- 1. gate and up: the splits' partials summed in split order.
            g = cute.make_rmem_tensor(cute.make_layout(UNIT), cutlass.Float32)
            u = cute.make_rmem_tensor(cute.make_layout(UNIT), cutlass.Float32)
            src = (Int64(row) * Int64(row_stride) + Int64(col)) * 4
            self.load_unit(gate, up, src, g, u, False)
            for s in range(1, num_splits):
                self.load_unit(gate, up, src + Int64(s) * split_bytes, g, u, True)

            # ---- 2. h = bf16(silu(gate) * up), two a word.
            h = [bf16x2(silu_mul(g[2 * j], u[2 * j]), silu_mul(g[2 * j + 1], u[2 * j + 1]))
                 for j in range(UNIT // 2)]  # unrolled: a Python comprehension

            # ---- 3. MXFP8 of the 32-block over four lanes.
            e, inv = mxfp8_block_scale(h, 4)
            packed = [e4m3x4(mul_ftz(lo_f32(h[2 * j]), inv), mul_ftz(hi_f32(h[2 * j]), inv),
                             mul_ftz(lo_f32(h[2 * j + 1]), inv), mul_ftz(hi_f32(h[2 * j + 1]), inv))
                      for j in range(2)]
            # Lane 16 i + 4 b holds block b of its 128 columns: lane 16 i gathers the four into one word.
            sf_word = e
            for b in cutlass.range_constexpr(1, 4):
                sf_word = sf_word | (shfl_idx(e, Uint32(lane + 4 * b) % Uint32(32)) << Uint32(8 * b))
            if live:
                store_v2_b32(q + Int64(row) * Int64(num_i) + Int64(col), packed[0], packed[1])
                if lane % 16 == 0:
                    store_b32(sf + Int64(row) * Int64(num_i // 32) + Int64(col // 32), sf_word)


    @cute.jit
    def load_unit(self, gate: Int64, up: Int64, src: Int64, g, u, add: cutlass.Constexpr[bool]):
        """Loads one split's 8 gate and 8 up partials at byte offset `src` (all four 16-byte loads issued first)
        into `g`, `u`, or adds them (`add.rn`)."""
        words = [load_v4(base + src + Int64(16 * half)) for base in (gate, up) for half in range(2)]
        for k in cutlass.range_constexpr(UNIT):
            gk = f32_from_bits(words[k // 4][k % 4])
            uk = f32_from_bits(words[2 + k // 4][k % 4])
            if cutlass.const_expr(add):
                g[k] = add_rn(g[k], gk)
                u[k] = add_rn(u[k], uk)
            else:
                g[k] = gk
                u[k] = uk


# ---------------------------------------------------------------------------------------------------------
# Compile


def compile_swiglu_mxfp8(arch: str = "sm_90a"):
    """Compiles the SwiGLU-and-MXFP8 kernel for `arch`; returns `(symbol, cubin bytes)`."""
    SwigluMxfp8.kernel.set_name_prefix(abi.SWIGLU_MXFP8.symbol, remove_cutlass_symbol=True, keep_mangled_name=False)
    return compile_cubin(abi.SWIGLU_MXFP8, SwigluMxfp8(), arch)
