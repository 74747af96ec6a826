"""`--mode latency`: kernel-only time of one dispatch + combine per layer (CUDA graphs of many layers per GPU,
CUDA events around each replay), and the stamps of a trace build."""

from __future__ import annotations

import os

import numpy as np

from tools.kernel_harness.expected import BF16
from tools.kernel_harness.inputs import make_routing, make_tokens
from tools.kernel_harness.runtime import SpinKernel, System, check


def _graph_time(system: System, body, graph_layers, replays, warmup_layers=10):
    """Kernel time per layer from CUDA-graph replays: each GPU's graph runs `warmup_layers + graph_layers` layers,
    with events recorded inside the graph (event record nodes) after the warm-up layers and at the end, and events
    around each replay. Returns `(steady median, steady min, whole median)` in us per layer over `replays` replays,
    each the max over the ranks' GPUs: "steady" over the last `graph_layers` layers only (the per-layer cost of a long
    run of layers), "whole" over the whole replay (it also pays the replay's start: the host launches the GPUs'
    graphs one after the other, and the GPU launched first waits for the others in its first layer, a skew of
    ~10-30 us that adds skew / layers to every layer). `body(rank)` launches one layer's kernels of a rank."""
    cu = system.cu
    external = cu.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL
    total = warmup_layers + graph_layers
    graphs, events = [], []
    for r in system.ranks:
        check(cu.cuCtxSetCurrent(r.ctx))
        inner = (check(cu.cuEventCreate(0)), check(cu.cuEventCreate(0)))
        check(cu.cuStreamBeginCapture(r.stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        for i in range(total):
            if i == warmup_layers:
                check(cu.cuEventRecordWithFlags(inner[0], r.stream, external))
            body(r)
        check(cu.cuEventRecordWithFlags(inner[1], r.stream, external))
        graph = check(cu.cuStreamEndCapture(r.stream))
        graphs.append(check(cu.cuGraphInstantiate(graph, 0)))
        events.append((check(cu.cuEventCreate(0)), check(cu.cuEventCreate(0))) + inner)
    steady, whole = [], []
    for it in range(replays + 2):
        for r, g, (start, stop, _, _) in zip(system.ranks, graphs, events):
            check(cu.cuCtxSetCurrent(r.ctx))
            check(cu.cuEventRecord(start, r.stream))
            check(cu.cuGraphLaunch(g, r.stream))
            check(cu.cuEventRecord(stop, r.stream))
        system.sync()
        if it >= 2:  # warm-up replays
            per_steady, per_whole = [], []
            for r, (start, stop, first, last) in zip(system.ranks, events):
                check(cu.cuCtxSetCurrent(r.ctx))
                per_steady.append(check(cu.cuEventElapsedTime(first, last)) * 1000.0 / graph_layers)
                per_whole.append(check(cu.cuEventElapsedTime(start, stop)) * 1000.0 / total)
            steady.append(max(per_steady))
            whole.append(max(per_whole))
    return float(np.median(steady)), float(min(steady)), float(np.median(whole))


#: Stamps of a trace build, by index (CTA 0, thread 0 unless said).
TRACE_STAMPS = {
    0: "dispatch entry", 1: "dispatch griddepcontrol.wait returned", 2: "dispatch inputs and mask done",
    3: "dispatch token 0 stored (issued)", 4: "dispatch launch_dependents",
    5: "dispatch first peer row copied out (CTA G - 1)", 6: "dispatch end",
    8: "combine entry", 9: "combine griddepcontrol.wait returned", 10: "combine sends issued",
    11: "combine launch_dependents", 12: "combine token 0 partials arrived", 13: "combine token 0 stored",
    14: "combine end",
}


def trace_report(system: System):
    """Per rank: median over the ring's layers of every stamp relative to the layer's dispatch entry (ns, from
    `%globaltimer`), and of CTA 0's cycles inside each kernel; then the gaps between kernels."""
    lines = []
    for r in system.ranks:
        timer, cycles = r.trace()
        order = np.argsort(timer[:, 0])
        timer, cycles = timer[order], cycles[order]
        rel = timer - timer[:, :1]
        lines.append(f"  rank {r.rank} (timer ns from dispatch entry; cycles from the kernel's entry):")
        for i, name in TRACE_STAMPS.items():
            base = 0 if i < 8 else 8
            # stamp 5 is another CTA's (another SM's clock)
            cyc = cycles[:, i] - cycles[:, base] if i != 5 else np.zeros(len(cycles), np.int64)
            lines.append(f"    {i:2d} {name:<58s} {np.median(rel[:, i]):8.0f} ns  {np.median(cyc):8.0f} cyc")
        gaps = {
            "combine wait returned - dispatch end": timer[:, 9] - timer[:, 6],
            "next dispatch entry - combine end": timer[1:, 0] - timer[:-1, 14],
            "next dispatch wait returned - combine end": timer[1:, 1] - timer[:-1, 14],
            "layer (dispatch entry to next)": timer[1:, 0] - timer[:-1, 0],
        }
        for name, v in gaps.items():
            lines.append(f"    {name:<61s} {np.median(v):8.0f} ns")
        if os.environ.get("JAX_LATENT_EP_KERNEL_TRACE", "") == "2":  # a warp trace build (kernels.common.TRACE_WARPS)
            polls = cycles[:, 0:7] - timer[:, 12:13]
            barrier = cycles[:, 8:15] - timer[:, 12:13]
            lines.append("    warp trace (ns from stamp 12; combine CTA 0, warps 0-6): polls of token 0 returned: "
                         + " ".join(f"{np.median(polls[:, w]):6.0f}" for w in range(7)))
            lines.append("    warp trace: past the stash barrier:                                         "
                         + " ".join(f"{np.median(barrier[:, w]):6.0f}" for w in range(7)))
            lines.append(f"    warp trace: warp 0's rstd {np.median(cycles[:, 15] - timer[:, 12]):6.0f}, its result stores "
                         f"issued {np.median(cycles[:, 7] - timer[:, 12]):6.0f}, stamp 13 "
                         f"{np.median(timer[:, 13] - timer[:, 12]):6.0f}")
        steps = np.unique(np.diff(np.sort(timer[:, :15].ravel())))
        lines.append(f"    smallest non-zero timer step: {steps[steps > 0].min() if (steps > 0).any() else 0} ns")
    print("\n".join(lines), flush=True)


def latency(system: System, token_counts=(1, 5, 32, 128), graph_layers=50, replays=30, apply_norm=1, trace=False,
            delay_ns=0, delay_rank=1):
    """Median kernel-only microseconds per T of one dispatch + combine layer (`layer`): CUDA graphs of
    `graph_layers` layers per GPU (`_graph_time`). (A dispatch alone repeated is refused by the kernels' sequence
    guard, so only whole layers are timed.) `delay_ns > 0` (an experiment): a one-thread kernel spinning that long
    runs before rank `delay_rank`'s every dispatch, so that this rank is the late one of every layer."""
    cu = system.cu
    rng = np.random.default_rng(1)
    shape = system.shape
    results = {}
    spin = {}
    if delay_ns:
        for r in system.ranks:
            if r.rank == delay_rank:
                check(cu.cuCtxSetCurrent(r.ctx))
                spin[r.rank] = SpinKernel()
    for tokens in token_counts:
        tokens = min(tokens, system.max_tokens)
        for r in system.ranks:
            check(cu.cuCtxSetCurrent(r.ctx))
            r.x.upload(make_tokens(rng, system.max_tokens, shape, False))
            ids, weights = make_routing(rng, system.max_tokens, shape)
            r.ids.upload(ids)
            r.weights.upload(weights)
            r.out.upload(np.zeros((system.layout.rows, shape.latent), BF16))
            r.norm.upload(np.ones(shape.latent, BF16))
        for _ in range(5):  # warm up, un-captured
            for r in system.ranks:
                system.launch_dispatch(r, tokens)
            for r in system.ranks:
                system.launch_combine(r, tokens, apply_norm)
        system.sync()

        def layer(r):
            if r.rank in spin:
                spin[r.rank].launch(r.stream, delay_ns)
            system.launch_dispatch(r, tokens)
            system.launch_combine(r, tokens, apply_norm)

        row = {"layer": _graph_time(system, layer, graph_layers, replays)}
        text = ""
        results[tokens] = row
        print(f"  T={tokens}: {row['layer'][0]:.2f} us per dispatch + combine (median of {replays}, min "
              f"{row['layer'][1]:.2f}; whole replays {row['layer'][2]:.2f}){text}", flush=True)
        if trace:
            trace_report(system)
    return results
