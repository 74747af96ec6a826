"""`--mode virtual` and `--mode devices`: consecutive dispatch + combine layers on N ranks (one GPU, one stream
per rank; or one GPU per rank), every layer's receive rows and combine outputs checked against
`tools.kernel_harness.expected`. The two modes differ only in where `System` puts the ranks."""

from __future__ import annotations

import time

import numpy as np

from jax_latent_ep.layout import CTRL_ERROR
from jax_latent_ep.testing import routing
from tools.kernel_harness.expected import (
    BF16, Rows, expected_receive, expected_result, host_expert, mxfp8_bytes, receive_mismatches, result_mismatches,
)
from tools.kernel_harness.inputs import make_routing, make_tokens
from tools.kernel_harness.runtime import System, check


def run_layers(system: System, layers, seed=0, nonfinite_every=0, log_every=100, check_every=1, bad_ids=False):
    """Runs `layers` consecutive dispatch + combine layers; returns (layers, mismatches, details). With `bad_ids`
    every layer's routing also holds ids outside [0, E) (`routing.spoil_ids`, one in eight), which must select no
    rank."""
    rng = np.random.default_rng(seed)
    shape, lay, n = system.shape, system.layout, system.n
    latent, topk, nsf, S = shape.latent, shape.topk, shape.num_sf, lay.stride
    local = shape.experts // n
    norm = (1.0 + 0.25 * rng.standard_normal(latent)).astype(BF16)
    for r in system.ranks:
        check(system.cu.cuCtxSetCurrent(r.ctx))
        r.norm.upload(norm)
    mismatches = 0
    ulp1 = 0
    details = []
    started = time.perf_counter()
    for layer in range(layers):
        special = "nonfinite" if nonfinite_every and layer % nonfinite_every == nonfinite_every - 1 else (layer % 3 == 0)
        apply_norm = layer % 2
        state = []
        for r in system.ranks:
            tokens = int(rng.integers(1, system.max_tokens + 1))
            x = make_tokens(rng, tokens, shape, special)
            ids, weights = make_routing(rng, tokens, shape)
            if bad_ids:
                ids = routing.spoil_ids(rng, ids, shape.experts, shape.experts // n, 0.125)
            check(system.cu.cuCtxSetCurrent(r.ctx))
            r.x.upload(x)
            r.ids.upload(ids)
            r.weights.upload(weights)
            state.append((tokens, x, ids, weights))
        peer_tokens = max(s[0] for s in state)  # each rank draws its own T: the kernels poll up to the largest
        for r in system.ranks:
            system.launch_dispatch(r, state[r.rank][0], peer_tokens=peer_tokens)
        system.sync()
        # Expected receive rows.
        quant = [mxfp8_bytes(s[1]) for s in state]
        dests = [(s[2] // local) for s in state]  # [T, K] destination rank of each expert
        received = []
        for d, r in enumerate(system.ranks):
            check(system.cu.cuCtxSetCurrent(r.ctx))
            got = Rows(
                r.recv_x.download(np.uint8, (lay.rows, latent)),
                r.recv_sf.download(np.uint8, (lay.rows, nsf)),
                r.recv_ids.download(np.int32, (lay.rows, topk)),
                r.recv_weights.download(np.uint32, (lay.rows, topk)),
                r.recv_src.download(np.int32, (lay.rows,)),
            )
            exp, valid = expected_receive(lay, d, state, quant)
            bad = int(receive_mismatches(got, exp, valid))
            if bad:
                details.append(f"layer {layer} rank {d}: {bad} receive mismatches")
            mismatches += bad
            received.append((got, valid))
        # Expert stage on the host (`host_expert`); garbage in the empty rows.
        outs = []
        for d, r in enumerate(system.ranks):
            got, valid = received[d]
            out = host_expert(got, valid, d, local, BF16(np.nan) if layer % 2 else BF16(1e30))
            outs.append(out)
            check(system.cu.cuCtxSetCurrent(r.ctx))
            r.out.upload(out)
        for r in system.ranks:
            system.launch_combine(r, state[r.rank][0], apply_norm, peer_tokens=peer_tokens)
        system.sync()
        for s, r in enumerate(system.ranks):
            tokens, x, ids, weights = state[s]
            check(system.cu.cuCtxSetCurrent(r.ctx))
            got = r.result.download(np.uint16, (tokens, latent))
            exp = expected_result(outs, dests[s], s, S, tokens, norm, apply_norm)
            bad, one = (int(v) for v in result_mismatches(got, exp, apply_norm))
            ulp1 += one
            if bad:
                details.append(f"layer {layer} rank {s}: {bad} combine mismatches (norm={apply_norm})")
            mismatches += bad
        if log_every and (layer + 1) % log_every == 0:
            rate = (layer + 1) / (time.perf_counter() - started)
            print(f"  layer {layer + 1}/{layers}: mismatches {mismatches}, 1-ulp normed {ulp1} ({rate:.0f} layers/s)", flush=True)
        if len(details) > 20:
            break
    for r in system.ranks:
        words = r.ctrl_words()
        if words[CTRL_ERROR]:
            details.append(f"rank {r.rank} ctrl error words {words.tolist()}")
            mismatches += 1
    return layer + 1, mismatches, {"details": details, "ulp1": ulp1, "ctrl": [r.ctrl_words().tolist() for r in system.ranks]}
