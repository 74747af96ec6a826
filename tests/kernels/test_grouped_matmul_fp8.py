"""The FP8 / MXFP4 grouped matmul kernels' build (CPU, no GPU), each tile size: the signature is the ABI's, the PTX
issues the e4m3 `wgmma` of its tile (four 32-deep blocks a stage, fresh accumulators, after the async-proxy fence),
promotes each with one FMA a value, and uses no local memory."""

import dataclasses
import re

import pytest

from jax_latent_ep.kernels import abi
from jax_latent_ep.kernels import grouped_matmul_fp8 as gm
from jax_latent_ep.kernels.common import check_abi, kernel_ptx

FP8 = {op: cls for op, cls in gm.CLASSES.items() if not gm.VARIANTS[op][1]}
MXFP4 = {op: cls for op, cls in gm.CLASSES.items() if gm.VARIANTS[op][1]}
BLOCKS = gm.TILE_K // gm.BLOCK_K


def _wgmma(pairs: int) -> str:
    return (r"wgmma\.mma_async\.sync\.aligned\.m64n%dk32\.f32\.e4m3\.e4m3 \{[^}]*\}, %%rd\d+, %%rd\d+, p, 1, 1;"
            % pairs)


def test_variants_cover_the_kernels():
    assert set(gm.VARIANTS) == set(gm.CLASSES) and set(gm.VARIANTS) <= set(abi.KERNELS)
    tiles = {abi.MATMUL_FP8_TILE_PAIRS, *abi.MATMUL_FP8_SMALL_TILE_PAIRS}
    assert {cls.pairs for cls in FP8.values()} == {cls.pairs for cls in MXFP4.values()} == tiles
    assert all(cls.pairs == gm.VARIANTS[op][0] and cls.layout.pairs == cls.pairs for op, cls in gm.CLASSES.items())
    assert all(gm.launch_shape(op) == (gm.THREADS, cls().smem) for op, cls in {**FP8, **MXFP4}.items())


@pytest.mark.parametrize("op", list(FP8) + list(MXFP4))
def test_signature_is_the_abi(op):
    check_abi(abi.KERNELS[op], {**FP8, **MXFP4}[op]())  # raises on any difference


@pytest.mark.parametrize("op", list(FP8))
def test_ptx_wgmma_promotion_and_no_local_memory(op):
    kernel = FP8[op]()
    ptx = kernel_ptx(abi.KERNELS[op], kernel)
    assert re.search(r"\.reqntid\s+%d,\s*1,\s*1" % gm.THREADS, ptx), "block differs from THREADS"
    assert len(re.findall(_wgmma(kernel.pairs), ptx)) == BLOCKS
    assert "setp.ne.b32 p, 0, 0" in ptx or ptx.count("wgmma.mma_async") == BLOCKS
    assert ptx.index("fence.proxy.async.shared::cta") < ptx.index("wgmma.mma_async")
    # One FMA per accumulator and block: `acc` values x four blocks.
    assert ptx.count("fma.rn.f32") == kernel.layout.acc * BLOCKS
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert kernel.layout.stage_bytes % 1024 == 0 and kernel.smem <= 227 * 1024


@pytest.mark.parametrize("op", list(MXFP4))
def test_mxfp4_ptx_widens_then_multiplies_without_local_memory(op):
    kernel = MXFP4[op]()
    ptx = kernel_ptx(abi.KERNELS[op], kernel)
    assert len(re.findall(_wgmma(kernel.pairs), ptx)) == BLOCKS
    # A widened chunk: eight e2m1x4 conversions (one prmt each) and two 16-byte shared stores, per thread chunk,
    # in the prologue and the loop.
    assert ptx.count("prmt.b32") == 2 * 8 * gm.MX_CHUNKS and ptx.count("st.shared.v4.b32") == 2 * 2 * gm.MX_CHUNKS
    assert ptx.count("fma.rn.f32") == kernel.layout.acc * BLOCKS
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert kernel.layout.mx_stage_bytes % 1024 == 0 and kernel.smem <= 227 * 1024


def test_stage_layout_refuses_other_tiles():
    with pytest.raises(ValueError, match="pairs=12"):
        gm.StageLayout(12)
    with pytest.raises(ValueError, match="stages=2"):
        gm.StageLayout(8, stages=2)
    with pytest.raises(ValueError, match="ctas_per_sm=5"):
        gm.StageLayout(8, ctas_per_sm=5)


@pytest.mark.parametrize("op", list(gm.CLASSES))
def test_ctas_an_sm_fit_its_shared_memory_and_cap_registers(op):
    """A variant's `ctas_per_sm` CTAs, each its shared memory and the driver's reserve, fit an SM; the PTX asks for
    that many (`.minnctapersm`: the registers' cap) and rings its `stages` slots."""
    kernel = gm.CLASSES[op]()
    lay = kernel.layout
    assert (kernel.smem + gm.CTA_RESERVED_BYTES) * lay.ctas_per_sm <= gm.SM_SHARED_BYTES
    ptx = kernel_ptx(abi.KERNELS[op], kernel)
    assert re.search(r"\.minnctapersm\s+%d" % lay.ctas_per_sm, ptx) or lay.ctas_per_sm == 1
    # a ring one stage shorter is a different kernel: the PTX follows the setting
    fewer = dataclasses.replace(lay, stages=lay.stages - 1)
    other = type(f"{type(kernel).__name__}S", (type(kernel),), {"layout": fewer})()
    assert kernel_ptx(abi.KERNELS[op], other) != ptx and other.smem < kernel.smem
