"""The grouped GEMM kernel's build (CPU, no GPU): its signature is the ABI's, its PTX asks for the block the
manifest records, and its tensor-core loop is what the kernel module says (no local memory)."""

import re

from jax_latent_ep.kernels import abi, grouped_gemm
from jax_latent_ep.kernels.common import check_abi, kernel_ptx


def _ptx():
    return kernel_ptx(abi.GROUPED_GEMM, grouped_gemm.GroupedGemm())


def test_signature_is_the_abi():
    check_abi(abi.GROUPED_GEMM, grouped_gemm.GroupedGemm())  # raises on any difference


def test_ptx_block_and_loop():
    ptx = _ptx()
    assert re.search(r"\.reqntid\s+%d,\s*1,\s*1" % grouped_gemm.THREADS, ptx), "block differs from THREADS"
    # 4 row tiles x 2 column tiles x BLOCK_K / 16 k-steps per stage, unrolled, at each of the three stages of the
    # main loops (two weights: the first's and the second's; one weight); no spills to local memory
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 3 * 4 * 2 * grouped_gemm.BLOCK_K // 16
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert ptx.count("cp.async.cg.shared.global") >= 2


def test_fp8_variant():
    """The FP8 variant: the same signature, 256 threads, two CTAs an SM asked for, per stage two e4m3 MMAs of 32
    contraction rows per row tile and column tile, four byte permutes per 32 rows, the scales copied with the stage;
    no local memory."""
    kernel = grouped_gemm.GroupedGemm(fp8=True)
    check_abi(abi.GROUPED_GEMM_FP8, kernel)
    ptx = kernel_ptx(abi.GROUPED_GEMM_FP8, kernel)
    assert re.search(r"\.reqntid\s+%d,\s*1,\s*1" % grouped_gemm.FP8_THREADS, ptx)
    assert re.search(r"\.minnctapersm\s+2", ptx)
    assert ptx.count("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32") == 3 * 4 * 2 * grouped_gemm.BLOCK_K // 32
    assert ptx.count("prmt.b32") == 3 * 4 * grouped_gemm.BLOCK_K // 32
    assert "mma.sync.aligned.m16n8k16" not in ptx
    assert "cp.async.ca.shared.global" in ptx  # the scales of each stage
    assert "ld.local" not in ptx and "st.local" not in ptx
