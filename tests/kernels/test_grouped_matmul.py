"""The grouped matmul kernels' build (CPU, no GPU): signatures are the ABI's, their PTX asks for the block and the
CTAs an SM the manifest and the module record, issues the `wgmma` forms the module says (operand majors, four k16
a stage) after the async-proxy fence, and uses no local memory; the descriptor's constant fields are PTX's."""

import re

import pytest

from jax_latent_ep.kernels import abi, grouped_matmul
from jax_latent_ep.kernels.common import check_abi, kernel_ptx
from jax_latent_ep.kernels.primitives import descriptor_fields

KERNELS = [(abi.GROUPED_MATMUL, grouped_matmul.GroupedMatmul), (abi.GROUPED_MATMUL_WGRAD,
                                                                 grouped_matmul.GroupedMatmulWgrad)]
# The forward's other block (`tile_n=128`, a deeper ring: constructor settings): built and checked like the defaults.
NARROW = (abi.GROUPED_MATMUL, lambda: grouped_matmul.GroupedMatmul(tile_n=128, stages=6, lag=3))
WGMMA = (r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16 \{[^}]*\}, %rd\d+, %rd\d+, p, 1, 1, "
         r"(\d), (\d);")


@pytest.mark.parametrize("op, cls", KERNELS, ids=lambda v: getattr(v, "op", ""))
def test_signature_is_the_abi(op, cls):
    check_abi(op, cls())  # raises on any difference


@pytest.mark.parametrize("op, cls", KERNELS + [NARROW], ids=["forward", "wgrad", "forward-128"])
def test_ptx_block_wgmma_forms_and_no_local_memory(op, cls):
    ring = cls()
    ptx = kernel_ptx(op, ring)
    assert re.search(r"\.reqntid\s+%d,\s*1,\s*1" % grouped_matmul.FORWARD_THREADS, ptx), "block differs"
    minnctapersm = re.search(r"\.minnctapersm\s+(\d+)", ptx)
    assert (int(minnctapersm.group(1)) if minnctapersm else 1) == ring.ctas_per_sm
    forms = sorted(re.findall(WGMMA, ptx))
    k16 = grouped_matmul.TILE_K // 16
    # The forward: K-major rows by a K-major (w_k_major) or an MN-major weight; the weights' gradient: both operands
    # MN-major (x^T and dy); each of its block's columns.
    n = str(ring.tile_n)
    want = [(n, "0", "0")] * k16 + [(n, "0", "1")] * k16 if op is abi.GROUPED_MATMUL else [(n, "1", "1")] * k16
    assert forms == sorted(want)
    assert ptx.count("fence.proxy.async.shared::cta") >= 1 and ptx.count("wgmma.commit_group.sync.aligned") >= 1
    assert ptx.index("fence.proxy.async.shared::cta") < ptx.index("wgmma.mma_async")
    assert "ld.local" not in ptx and "st.local" not in ptx


def test_ring_settings_are_checked():
    """A ring's settings outside what its kernel computes are refused when it is built, naming the value."""
    with pytest.raises(ValueError, match="tile_n=192"):
        grouped_matmul.GroupedMatmul(tile_n=192)
    with pytest.raises(ValueError, match="stages=3, lag=2"):
        grouped_matmul.GroupedMatmul(stages=3, lag=2)
    with pytest.raises(ValueError, match="ctas_per_sm=2, tile_n=256"):
        grouped_matmul.GroupedMatmul(ctas_per_sm=2, stages=3, lag=1)
    assert grouped_matmul.GroupedMatmul().smem_bytes <= 227 * 1024 // grouped_matmul.FORWARD_CTAS_PER_SM
    assert grouped_matmul.GroupedMatmulWgrad().smem_bytes <= 227 * 1024


def test_descriptor_fields_follow_ptx():
    """Leading byte offset >> 4 at bits 16-29, stride >> 4 at 32-45, 128-byte swizzle (1) at 62-63."""
    bits = descriptor_fields(8192, 1024)
    assert (bits >> 16) & 0x3FFF == 8192 // 16 and (bits >> 32) & 0x3FFF == 1024 // 16 and bits >> 62 == 1
    assert bits & 0xFFFF == 0 and (bits >> 46) & 0xFFFF == 0  # start address and base offset are the caller's
    with pytest.raises(ValueError, match="leading_bytes=8 must be a multiple of 16"):
        descriptor_fields(8, 1024)
    with pytest.raises(ValueError, match=r"stride_bytes=262144 must be a multiple of 16 below 256 KB"):
        descriptor_fields(16, 1 << 18)


def test_descriptor_advance_is_the_moved_address():
    """`smem_descriptor_advance`'s one 32-bit add to the low word (its PTX, modelled here) gives the descriptor of the
    moved address for every 16-byte step of the FP8 / MXFP4 kernels' shared memory (below 256 KB): no carry leaves
    the start address field."""
    import numpy as np

    from jax_latent_ep.kernels import grouped_matmul_fp8 as gm

    fields = descriptor_fields(16, 1024)
    desc = lambda addr: ((addr & 0x3FFFF) >> 4) | fields  # noqa: E731  (`smem_descriptor`)
    advance = lambda d, u: (((d & 0xFFFFFFFF) + u) & 0xFFFFFFFF) | (d & ~0xFFFFFFFF)  # noqa: E731  (its PTX)
    top = 227 * 1024  # an SM's shared memory: every kernel's (`smem`) lies below
    assert all(gm.CLASSES[k]().smem <= top for k in gm.CLASSES)
    rng = np.random.default_rng(3)
    for base in [0, 1024, top - 16] + (rng.integers(0, top // 16, 64) * 16).tolist():
        for units in [0, 1, 2, 6] + rng.integers(0, (top - base) // 16 + 1, 8).tolist():
            assert advance(desc(base), units) == desc(base + 16 * units), (base, units)
