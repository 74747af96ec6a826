"""The row-sum kernel's build (CPU, no GPU): its signature is the ABI's, its PTX asks for the block and the CTAs an
SM the module records, takes the slots by lane (one ballot, a pair and a weight shuffled a slot) and uses no local
memory, and its cubin's registers let `CTAS_PER_SM` CTAs share an SM without spills. Its bits against XLA's row
sums (GPU): tests/gpu/test_experts_gpu.py -k row_sum."""

import re

from jax_latent_ep.kernels import abi, row_sum
from jax_latent_ep.kernels.common import check_abi, kernel_ptx
from jax_latent_ep.runtime.cubin import cubin_resources


def test_signature_is_the_abi():
    check_abi(abi.ROW_SUM, row_sum.RowSum())  # raises on any difference


def test_ptx_block_collectives_and_no_local_memory():
    ptx = kernel_ptx(abi.ROW_SUM, row_sum.RowSum())
    assert re.search(r"\.reqntid\s+%d,\s*1,\s*1" % row_sum.THREADS, ptx), "block differs from THREADS"
    assert re.search(r"\.minnctapersm\s+%d\b" % row_sum.CTAS_PER_SM, ptx)
    assert ptx.count("vote.sync.ballot.b32") == 1
    assert ptx.count("shfl.sync.idx.b32") == 2 * abi.NUM_MAX_TOPK  # each slot's pair and weight, once
    assert "ld.local" not in ptx and "st.local" not in ptx


def _resources(monkeypatch, ctas_per_sm):
    monkeypatch.setattr(row_sum, "CTAS_PER_SM", ctas_per_sm)
    _, cubin = row_sum.compile_row_sum()
    return cubin_resources(cubin)


def test_ctas_per_sm_fit_the_register_file_without_spills(monkeypatch):
    registers, frame = _resources(monkeypatch, row_sum.CTAS_PER_SM)
    assert registers * row_sum.THREADS * row_sum.CTAS_PER_SM <= 65536, registers
    assert frame == 0, f"{frame} bytes a thread spilled"


def test_the_register_reader_sees_spills(monkeypatch):
    # 12 CTAs an SM leave 40 registers, fewer than a batch's outputs: ptxas spills, and the reader must say so.
    registers, frame = _resources(monkeypatch, 12)
    assert registers <= 65536 // (row_sum.THREADS * 12) and frame > 0
