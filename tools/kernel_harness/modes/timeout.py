"""`--mode timeout`: a poll that never succeeds must trap and fill the host status record (run last: the trap
kills the context)."""

from __future__ import annotations

import time

import numpy as np

from jax_latent_ep.kernels import abi
from tools.kernel_harness.inputs import make_routing, make_tokens
from tools.kernel_harness.runtime import DEFAULT_ARTIFACTS, System, host_status


def timeout_test(artifacts=DEFAULT_ARTIFACTS, shape_name="kimi_k3", case="dispatch"):
    """A poll that never succeeds must trap and report, with a 2 ms timeout, N = 2 virtual ranks, 4 tokens each.
    `case` "dispatch": rank 1 never launches, so rank 0's dispatch waits for rank 1's rows: record
    {ERROR_DISPATCH_TIMEOUT, rank 0, peer 1, layer 0}.
    "combine": both ranks dispatch, then rank 0 alone combines and waits for rank 1's partials of its tokens:
    record {ERROR_COMBINE_TIMEOUT, 0, 1, 0} (`kernels/abi.py`). Returns (ok, record, the stream's error)."""
    system = System(shape_name, 2, 8, "virtual", artifacts)
    cu = system.cu
    system.status, status_host = host_status(cu)
    system.timeout_ns = 2_000_000_000  # the dispatches of the combine case complete
    rng = np.random.default_rng(0)
    for r in reversed(system.ranks[:1] if case == "dispatch" else system.ranks):  # rank 0 last: `ids` are its
        r.x.upload(make_tokens(rng, 4, system.shape, False))
        ids, weights = make_routing(rng, 4, system.shape)
        r.ids.upload(ids)
        r.weights.upload(weights)
    r = system.ranks[0]
    if case == "combine":
        if not (ids // system.shape.num_local_experts(2) == 1).any():
            raise RuntimeError("the routing sends no token of rank 0 to rank 1")  # not with these seeds and shapes
        for q in system.ranks:
            system.launch_dispatch(q, 4)
        system.sync()
        system.timeout_ns = 2_000_000
        started = time.perf_counter()
        system.launch_combine(r, 4, apply_norm=1)
    else:
        started = time.perf_counter()
        system.launch_dispatch(r, 4, timeout_ns=2_000_000)
    err = cu.cuStreamSynchronize(r.stream)[0]
    elapsed = time.perf_counter() - started
    record = list(status_host)
    print(f"  timeout ({case}): stream sync -> {err!r} after {elapsed * 1e3:.1f} ms, status record {record}",
          flush=True)
    code = abi.ERROR_DISPATCH_TIMEOUT if case == "dispatch" else abi.ERROR_COMBINE_TIMEOUT
    ok = err != cu.CUresult.CUDA_SUCCESS and record == [code, 0, 1, 0]
    return ok, record, str(err)
