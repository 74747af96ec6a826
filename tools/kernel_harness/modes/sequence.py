"""`--mode sequence`: a call out of sequence must trap with its error record and leave the peer's buffer
unchanged, byte for byte (run last: the trap kills the context)."""

from __future__ import annotations

import time

import numpy as np

from jax_latent_ep.kernels import abi
from tools.kernel_harness.expected import BF16
from tools.kernel_harness.inputs import make_routing, make_tokens
from tools.kernel_harness.runtime import DEFAULT_ARTIFACTS, System, host_status


def sequence_test(case, artifacts=DEFAULT_ARTIFACTS, shape_name="kimi_k3", tokens=8):
    """A call out of sequence corrupts nothing else: N = 2 virtual ranks on one GPU, rank 1's symmetric buffer in
    mapped host memory (the CPU reads it after rank 0's trap has lost the context). Both ranks run layer 0
    (`case` "dispatch_twice": the dispatch; "combine_twice": dispatch and combine) on fresh random inputs; rank
    1's buffer (receive rows, combine slots and control lines: all a peer may write) is read. Rank 0 then
    repeats its last call with new random inputs, out of sequence: it must trap with ERROR_DISPATCH_TWICE (ERROR_COMBINE_WITHOUT_DISPATCH)
    and leave rank 1's buffer byte for byte as it was. Returns (ok, status record, bytes of rank 1's buffer changed)."""
    system = System(shape_name, 2, tokens, "virtual", artifacts, host_ranks=(1,))
    cu = system.cu
    system.status, status_host = host_status(cu)
    system.timeout_ns = 2_000_000_000
    rng = np.random.default_rng(7)
    lay = system.layout
    for r in system.ranks:
        r.x.upload(make_tokens(rng, tokens, system.shape, False))
        ids, weights = make_routing(rng, tokens, system.shape)
        r.ids.upload(ids)
        r.weights.upload(weights)
        r.out.upload(rng.standard_normal((lay.rows, system.shape.latent), dtype=np.float32).astype(BF16))
    for r in system.ranks:
        system.launch_dispatch(r, tokens)
    system.sync()
    if case == "combine_twice":
        for r in system.ranks:
            system.launch_combine(r, tokens, apply_norm=1)
        system.sync()
    offender, victim = system.ranks
    before = victim.buffer.download(np.uint8, lay.peers)
    offender.x.upload(make_tokens(rng, tokens, system.shape, False))
    offender.out.upload(rng.standard_normal((lay.rows, system.shape.latent), dtype=np.float32).astype(BF16))
    if case == "dispatch_twice":
        system.launch_dispatch(offender, tokens)
    else:
        system.launch_combine(offender, tokens, apply_norm=1)
    err = cu.cuStreamSynchronize(offender.stream)[0]
    time.sleep(0.05)  # anything still in flight has landed
    after = victim.buffer.download(np.uint8, lay.peers)
    changed = int(np.count_nonzero(before != after))
    record = list(status_host)
    code = abi.ERROR_DISPATCH_TWICE if case == "dispatch_twice" else abi.ERROR_COMBINE_WITHOUT_DISPATCH
    print(f"  sequence {case}: offender sync -> {err!r}, status record {record}, "
          f"{changed} of {lay.peers} bytes of rank 1's buffer changed", flush=True)
    ok = err != cu.CUresult.CUDA_SUCCESS and record[:3] == [code, 0, 0] and changed == 0
    return ok, record, changed
