"""The FP8 grouped matmul kernel's build (CPU, no GPU): its signature is the ABI's, its PTX issues the e4m3 `wgmma`
the module says (four 32-deep blocks a stage, fresh accumulators, after the async-proxy fence), promotes each with
one FMA a value, and uses no local memory."""

import re

from jax_latent_ep.kernels import abi, grouped_matmul_fp8
from jax_latent_ep.kernels.common import check_abi, kernel_ptx

WGMMA = (r"wgmma\.mma_async\.sync\.aligned\.m64n32k32\.f32\.e4m3\.e4m3 \{[^}]*\}, %rd\d+, %rd\d+, p, 1, 1;")


def test_signature_is_the_abi():
    check_abi(abi.GROUPED_MATMUL_FP8, grouped_matmul_fp8.GroupedMatmulFp8())  # raises on any difference


def test_ptx_wgmma_promotion_and_no_local_memory():
    ptx = kernel_ptx(abi.GROUPED_MATMUL_FP8, grouped_matmul_fp8.GroupedMatmulFp8())
    assert re.search(r"\.reqntid\s+%d,\s*1,\s*1" % grouped_matmul_fp8.THREADS, ptx), "block differs from THREADS"
    blocks = grouped_matmul_fp8.TILE_K // grouped_matmul_fp8.BLOCK_K
    assert len(re.findall(WGMMA, ptx)) == blocks
    assert "setp.ne.b32 p, 0, 0" in ptx or ptx.count("wgmma.mma_async") == blocks
    assert ptx.index("fence.proxy.async.shared::cta") < ptx.index("wgmma.mma_async")
    # One FMA per accumulator and block: ACC values x four blocks.
    assert ptx.count("fma.rn.f32") == grouped_matmul_fp8.ACC * blocks
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert grouped_matmul_fp8.STAGE_BYTES % 1024 == 0 and grouped_matmul_fp8.SMEM_BYTES <= 227 * 1024


def test_mxfp4_signature_is_the_abi():
    check_abi(abi.GROUPED_MATMUL_MXFP4, grouped_matmul_fp8.GroupedMatmulMxfp4())


def test_mxfp4_ptx_widens_then_multiplies_without_local_memory():
    ptx = kernel_ptx(abi.GROUPED_MATMUL_MXFP4, grouped_matmul_fp8.GroupedMatmulMxfp4())
    blocks = grouped_matmul_fp8.TILE_K // grouped_matmul_fp8.BLOCK_K
    assert len(re.findall(WGMMA, ptx)) == blocks
    # A widened chunk: eight e2m1x4 conversions (one prmt each) and two 16-byte shared stores, per thread chunk,
    # in the prologue and the loop.
    chunks = grouped_matmul_fp8.MX_CHUNKS
    assert ptx.count("prmt.b32") == 2 * 8 * chunks and ptx.count("st.shared.v4.b32") == 2 * 2 * chunks
    assert ptx.count("fma.rn.f32") == grouped_matmul_fp8.ACC * blocks
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert grouped_matmul_fp8.MX_STAGE_BYTES % 1024 == 0 and grouped_matmul_fp8.MX_SMEM_BYTES <= 227 * 1024
