"""The FP8 prefill kernels' build (CPU, no GPU): signatures are the ABI's; their PTX asks for the warp-specialized
block, gives the producer and the consumers the module's registers, issues one `m64n128k32` e4m3 MMA a 32-deep block
(four a stage) after the async-proxy fence, stores what the module says, and uses no local memory; its barrier
waits take the suspend hint asked for."""

import re

import pytest

from jax_latent_ep.kernels import abi, grouped_matmul, grouped_matmul_fp8_wide as wide
from jax_latent_ep.kernels.common import check_abi, kernel_ptx

KERNELS = [(abi.GROUPED_MATMUL_FP8_WIDE, wide.GroupedMatmulFp8Wide),
           (abi.GROUPED_MATMUL_FP8_WIDE_GLU, wide.GroupedMatmulFp8WideGlu)]
IDS = ["fp32-out", "glu"]
MMA = r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f32\.e4m3\.e4m3 \{[^}]*\}, %rd\d+, %rd\d+, p, 1, 1;"


@pytest.mark.parametrize("op, cls", KERNELS, ids=IDS)
def test_signature_is_the_abi(op, cls):
    check_abi(op, cls())  # raises on any difference


@pytest.mark.parametrize("op, cls", KERNELS, ids=IDS)
def test_ptx_block_registers_mma_stores_and_no_local_memory(op, cls):
    ring = cls()
    ptx = kernel_ptx(op, ring)
    assert re.search(r"\.reqntid\s+%d,\s*1,\s*1" % grouped_matmul.FORWARD_THREADS, ptx), "block differs"
    assert f"setmaxnreg.dec.sync.aligned.u32 {ring.producer_regs};" in ptx
    assert f"setmaxnreg.inc.sync.aligned.u32 {ring.consumer_regs};" in ptx
    assert re.findall(MMA, ptx) == [str(wide.TILE_N)] * (wide.TILE_K // wide.BLOCK_K)
    assert ptx.index("fence.proxy.async.shared::cta") < ptx.index("wgmma.mma_async")
    # FP32 rows out of the registers, 8 bytes a store; the SwiGLU form's h two e4m3 a store, its scales two a store
    stores = "st.global.b16" if op is abi.GROUPED_MATMUL_FP8_WIDE_GLU else "st.global.v2.f32"
    assert stores in ptx and ("st.global.v2.f32" in ptx) == (op is abi.GROUPED_MATMUL_FP8_WIDE)
    assert "ld.local" not in ptx and "st.local" not in ptx


def test_stage_and_registers_fit():
    """A stage's scales lie within it, the ring within an SM's shared memory, the consumers' registers hold the
    accumulators and a block's products (64 each) with room; the launch shape the build records is the class's."""
    for name, cls in wide.CLASSES.items():
        ring = cls()
        assert wide.W_SCALE_OFFSET + 8 <= ring.stage_bytes and ring.stage_bytes % 1024 == 0
        assert ring.smem_bytes <= 227 * 1024
        assert ring.consumer_regs >= wide.TILE_N + 40
        assert wide.launch_shape(name) == (grouped_matmul.FORWARD_THREADS, ring.smem_bytes)


@pytest.mark.parametrize("suspend_ns", [0, 10_000_000])
def test_barrier_waits_carry_the_suspend_hint_asked_for(suspend_ns):
    """Every ring barrier wait's try takes `wait_suspend_ns` as its suspend hint, or none at 0 (the default: the
    hardware's own); a negative one is refused."""
    ptx = kernel_ptx(abi.GROUPED_MATMUL_FP8_WIDE, wide.GroupedMatmulFp8Wide(wait_suspend_ns=suspend_ns))
    try_wait = r"mbarrier\.try_wait\.parity\.acquire\.cta\.shared::cta\.b64 done, \[%r\d+\], %r\d+([^;]*);"
    tries = re.findall(try_wait, ptx)
    assert len(tries) >= 3  # the producer's empty slots, the consumers' full ones (two loops)
    assert set(tries) == ({f", {suspend_ns}"} if suspend_ns else {""})
    with pytest.raises(ValueError, match="wait_suspend_ns=-1"):
        wide.GroupedMatmulFp8Wide(wait_suspend_ns=-1)
