"""The expert plan kernel's build (CPU, no GPU): its signature is the ABI's, its PTX asks for the one CTA of
`THREADS` the manifest records, uses the warp collectives the kernel module describes, and keeps to registers and
shared memory (no local memory). Its words against the XLA plan (GPU):
tests/test_experts.py::test_plan_kernel_is_the_xla_plan."""

import re

from jax_latent_ep.kernels import abi, expert_plan
from jax_latent_ep.kernels.common import check_abi, kernel_ptx


def _ptx():
    return kernel_ptx(abi.EXPERT_PLAN, expert_plan.ExpertPlan())


def test_signature_is_the_abi():
    check_abi(abi.EXPERT_PLAN, expert_plan.ExpertPlan())  # raises on any difference


def test_ptx_block_and_collectives():
    ptx = _ptx()
    assert re.search(r"\.reqntid\s+%d,\s*1,\s*1" % expert_plan.THREADS, ptx), "block differs from THREADS"
    assert expert_plan.THREADS == abi.PLAN_THREADS and expert_plan.SMEM_BYTES <= 227 * 1024
    # Phase 1 finds a row's pairs with match.any and ballots; phase 2 scans with shfl.up (5 steps for each of two
    # sums, in the warps and then over the warp totals); the bitmaps and counters are shared atomics.
    assert ptx.count("match.any.sync.b32") >= 1 and ptx.count("vote.sync.ballot.b32") >= 2
    assert ptx.count("shfl.sync.up.b32") == 2 * 2 * 5
    assert ptx.count("atom.shared.add.u32") >= 1 and ptx.count("atom.shared.or.b32") >= 1
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert ptx.count("bar.sync") + ptx.count("barrier.sync") >= 4
