"""The SwiGLU-and-MXFP8 kernel's build (CPU, no GPU): its signature is the ABI's, and its PTX computes one unit of 8
columns a thread (8 silu, 4 e4m3 pair conversions, one 8-byte store of elements) with no local memory."""

import re

from jax_latent_ep.kernels import abi, swiglu_mxfp8
from jax_latent_ep.kernels.common import check_abi, kernel_ptx


def test_signature_is_the_abi():
    check_abi(abi.SWIGLU_MXFP8, swiglu_mxfp8.SwigluMxfp8())  # raises on any difference


def test_ptx_one_unit_a_thread_without_local_memory():
    ptx = kernel_ptx(abi.SWIGLU_MXFP8, swiglu_mxfp8.SwigluMxfp8())
    assert re.search(r"\.reqntid\s+%d,\s*1,\s*1" % swiglu_mxfp8.THREADS, ptx), "block differs from THREADS"
    unit = swiglu_mxfp8.UNIT
    assert ptx.count("ex2.approx.ftz.f32") == unit and ptx.count("div.rn.f32") == unit  # silu_mul, once a column
    assert ptx.count("cvt.rn.satfinite.e4m3x2.f32") == unit // 2 and ptx.count("cvt.rn.bf16x2.f32") == unit // 2
    assert ptx.count("st.global.v2.b32") == 1 and ptx.count("st.global.b32") == 1  # elements; 4 scales a word
    assert ptx.count("shfl.sync.bfly.b32") == 2  # the 32-block's amax over its four lanes
    assert ptx.count("add.rn.f32") % (2 * unit) == 0  # the splits' sums: whole units of gate and up
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
    assert "ld.local" not in ptx and "st.local" not in ptx
