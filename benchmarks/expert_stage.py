"""The expert stage on one GPU: every path of `jax_latent_ep.experts` against its floor (active experts' weight
bytes over the HBM bandwidth measured in the same run).

    python benchmarks/expert_stage.py [--out expert_stage.csv] [--paths ...] [--tokens 1 8 32 128]
    python benchmarks/expert_stage.py --smoke        # tiny shapes, CPU is fine (the CI test runs this)

Shapes: L = 3584, K = 16 of E = 896, `J` in {448, 112} local experts (a rank of N = E / J), `I` in {512, 2048};
T tokens per source rank, the rows rank 0 would receive from N sources at that T (`testing.experts.random_received`,
uniform top-16, `max_tokens = T`). A program is one jit of `layers` layers, each with its own weights and its
own routing (weights per layer >> L2, so no cache reuse); the median of `--repeats` runs over `layers`.

Paths (`backend` column `<path>/J<J>/I<I>`): `plan` (the XLA plan and the kernel's work list alone: the part of
every XLA path that is not a GEMM), `plan-kernel` (the same from the plan kernel, `kernels/expert_plan.py`), `kernel`
(the plan kernel and the project's grouped GEMM, `kernels/grouped_gemm.py`), `kernel-xla-plan` (the grouped GEMM
on the XLA plan),
`kernel-fp8` (the `kernel` path on FP8 weights with a scale per 128 x 128 block, `experts.BlockScaled`: its floor,
`floor-fp8/..`, counts 1 byte a weight and the scales), `wgmma-fp8` (the same weights `[out, in]`,
`experts.BlockScaledOutIn`, on the FP8 grouped matmul `experts.grouped.gmm_fp8`; `wgmma-fp8-xla-plan` on the XLA
plan), `wgmma-mxfp4` (MXFP4 weights on `gmm_mxfp4`; floor `floor-mxfp4/..`, half a byte a weight and a byte per 32), `ragged_dot-default`
(lax.ragged_dot as XLA lowers it by default),
`ragged_dot-cudnn` (a fresh process with `--xla_gpu_experimental_use_ragged_dot_fusion=true`),
`ragged_dot-pallas` (a fresh process with `jax_ragged_dot_use_gpu_pallas_triton_lowering`), `gather` (each pair
gathers its expert's weights; skipped where its `[C, L, I]` temporaries pass `--gather-gb`), `dense` (every
local expert on every row, FP32: the checker; skipped past `--dense-gb`). Rows: `us_per_layer`, `ratio` (to the
floor), `floor/..` `us` and `active_experts`, `hbm_GBps` (a device copy, bytes read + written); with `--device-time`
the GPU's kernel time and span per layer, with `--kernel-times` too each kernel's (`kernel_us:<name>`: where kernels
overlap, as with an early PDL trigger, only the span is the GPU's time). A path that fails
(an unknown flag, a lowering that refuses) is reported in the table and has no rows.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# path -> (environment for its process, jax config updates)
GROUPS = {
    "default": ({}, {}),
    "cudnn": ({"XLA_FLAGS": "--xla_gpu_experimental_use_ragged_dot_fusion=true"}, {}),
    "pallas": ({}, {"jax_ragged_dot_use_gpu_pallas_triton_lowering": True}),
}
PATHS = {"plan": ("default", "plan"), "plan-kernel": ("default", "plan-kernel"), "kernel": ("default", "kernel"),
         "kernel-fp8": ("default", "kernel-fp8"), "wgmma-fp8": ("default", "wgmma-fp8"),
         "wgmma-mxfp4": ("default", "wgmma-mxfp4"), "wgmma-fp8-xla-plan": ("default", "wgmma-fp8-xla-plan"),
         "kernel-xla-plan": ("default", "kernel-xla-plan"), "ragged_dot-default": ("default", "ragged_dot"),
         "gather": ("default", "gather"), "dense": ("default", "dense"), "ragged_dot-cudnn": ("cudnn", "ragged_dot"),
         "ragged_dot-pallas": ("pallas", "ragged_dot")}
#: time metric -> its ratio to the floor
RATIOS = {"us_per_layer": "ratio", "pipelined_us_per_layer": "pipelined_ratio", "device_us_per_layer": "device_ratio",
          "span_us_per_layer": "span_ratio"}
COLUMNS = ["date", "device", "commit", "backend", "ranks", "tokens", "metric", "value"]
#: Paths on FP8 weights (their floor is `floor-fp8/..`).
FP8_PATHS = ("kernel-fp8", "wgmma-fp8", "wgmma-fp8-xla-plan", "floor-fp8")
#: Paths on MXFP4 weights (their floor is `floor-mxfp4/..`: half a byte a weight and a byte per 32).
MXFP4_PATHS = ("wgmma-mxfp4", "floor-mxfp4")
FLOORS = ("floor", "floor-fp8", "floor-mxfp4")
#: path -> its weights' format (the rest: bf16): `BlockScaled`, `[out, in]` `BlockScaledOutIn`, or `MXFP4`.
PATH_FORMATS = {"kernel-fp8": "fp8", "wgmma-fp8": "fp8-out-in", "wgmma-fp8-xla-plan": "fp8-out-in",
                "wgmma-mxfp4": "mxfp4"}


def _weight_bytes(backend: str) -> float:
    """Bytes of one weight on a row's path: 2 (bf16), or 1 and its share of a 4-byte scale per 128 x 128 (FP8)."""
    path = backend.split("/")[0]
    return 1 + 4 / 128**2 if path in FP8_PATHS else 0.5 + 1 / 32 if path in MXFP4_PATHS else 2


def _commit():
    """`GIT_COMMIT` if set (a copied tree's git may lag), else the checkout's short HEAD."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _time(fn, args, repeats):
    import jax

    jax.block_until_ready(fn(*args))  # compile + warm up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return _median(samples)


#: Seconds of back-to-back calls a pipelined sample spans: at T = 1 (H100, 12 layers) 4 calls read 15-27 % above
#: 32 calls' steady state, 16 calls 2-3 %.
PIPELINED_SECONDS = 0.04


def _time_pipelined(fn, args, repeats, calls=None):
    """`(seconds per call, host seconds per call)` of `calls` calls issued back to back (JAX's asynchronous
    dispatch: the host prepares a call while the GPU runs the one before, as in a decode loop without a host sync
    per step), and of the host's share alone (the calls' return, before the wait: the GPU starves where it is the
    larger), the medians of `repeats` such runs; `fn` is warm. `calls` None: the steady state of a serving loop,
    `PIPELINED_SECONDS` of calls (8 to 64; the first call's host work, ~45 us a layer, is not overlapped)."""
    import jax

    if calls is None:
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        calls = int(min(64, max(8, PIPELINED_SECONDS / (time.perf_counter() - start))))
    samples, host = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = [fn(*args) for _ in range(calls)]
        host.append((time.perf_counter() - start) / calls)
        jax.block_until_ready(outs)
        samples.append((time.perf_counter() - start) / calls)
        del outs
    return _median(samples), _median(host)


def device_times(fn, args, per_kernel=None, per_op=None):
    """`(busy, span, launches)` of one call of `fn` on the GPU (off GPUs, XLA:CPU's thunks), microseconds, from a
    profiler trace: the sum of its kernel events, first kernel start to last kernel end (the busy time plus the
    gaps between kernels), and its kernel events. All leave out the program's host-side dispatch and
    synchronization. A dict `per_kernel` gets each kernel name's summed time, microseconds; `per_op` each HLO
    instruction's (`event_ops`; `op_sources` says which JAX operations and source lines an instruction is)."""
    import glob
    import shutil
    import tempfile

    import jax

    trace_dir = tempfile.mkdtemp(prefix="expert_stage_trace_")
    try:
        jax.profiler.start_trace(trace_dir)
        try:
            jax.block_until_ready(fn(*args))
        finally:
            jax.profiler.stop_trace()
        path = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
        all_planes = list(jax.profiler.ProfileData.from_file(path).planes)
        planes = sorted((p for p in all_planes if p.name.startswith("/device:GPU:")), key=lambda p: p.name)
        if planes:
            events = [e for line in planes[0].lines for e in line.events]
        else:  # XLA:CPU: its thunks, the host plane's events of an HLO instruction
            events = [e for p in all_planes if p.name.startswith("/host:CPU") for line in p.lines
                      for e in line.events if any(k == "hlo_op" for k, _ in e.stats)]
        busy = sum(e.duration_ns for e in events) / 1e3
        if per_kernel is not None:
            for e in events:
                per_kernel[e.name] = per_kernel.get(e.name, 0.0) + e.duration_ns / 1e3
        if per_op is not None:
            for op, us in event_ops(events).items():
                per_op[op] = per_op.get(op, 0.0) + us
        span = (max(e.start_ns + e.duration_ns for e in events) - min(e.start_ns for e in events)) / 1e3
        return busy, span, len(events)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)


def event_ops(events) -> dict[str, float]:
    """Microseconds of profiler `events` summed by the HLO instruction each ran (its `hlo_op` statistic; the
    event's own name where it has none)."""
    out: dict[str, float] = {}
    for e in events:
        op = next((str(v) for k, v in e.stats if k == "hlo_op"), e.name)
        out[op] = out.get(op, 0.0) + e.duration_ns / 1e3
    return out


def op_sources(hlo_text: str) -> dict[str, str]:
    """Each instruction's JAX operations in a compiled module's text (`compiled.as_text()`): its name -> its
    distinct operations in order, each with the file and line that traced it (`"dot_general@k3_layer.py:83
    slice@k3_layer.py:84"`), a fusion's from the computation it calls."""
    import re

    tables = {}
    for table, pattern in (("FileNames", r'^(\d+) "(.*)"$'),
                           ("FileLocations", r"^(\d+) \{file_name_id=(\d+) function_name_id=\d+ line=(\d+)"),
                           ("StackFrames", r"^(\d+) \{file_location_id=(\d+)")):
        block = re.search(rf"^{table}\n((?:\d+ .*\n)*)", hlo_text, re.M)
        tables[table] = [re.match(pattern, line).groups() for line in (block.group(1).splitlines() if block else [])
                         if re.match(pattern, line)]
    files = {i: os.path.basename(name) for i, name in tables["FileNames"]}
    locations = {i: f"{files.get(f, '?')}:{line}" for i, f, line in tables["FileLocations"]}
    frames = {i: locations.get(loc, "?") for i, loc in tables["StackFrames"]}

    def ops(lines):
        found = []
        for line in lines:
            meta = re.search(r"metadata=\{([^}]*)\}", line)
            op = re.search(r'op_name="([^"]*)"', meta.group(1)) if meta else None
            if op:
                frame = re.search(r"stack_frame_id=(\d+)", meta.group(1))
                src = re.search(r'source_file="([^"]*)" source_line=(\d+)', meta.group(1))
                where = (f"@{frames[frame.group(1)]}" if frame and frame.group(1) in frames else
                         f"@{os.path.basename(src.group(1))}:{src.group(2)}" if src else "")
                target = re.search(r'custom_call_target="([^"]*)"', line)  # an FFI call: which kernel
                name = (f"{target.group(1)}:" if target else "") + op.group(1).rsplit("/", 1)[-1] + where
                if name not in found:
                    found.append(name)
        return found

    bodies = {m.group(1): m.group(2).splitlines() for m in
              re.finditer(r"^(?:ENTRY )?%?([\w.\-]+) \([^\n]*\) -> [^\n]*\{\n(.*?)^\}", hlo_text, re.M | re.S)}
    fused = set(re.findall(r"\bfusion\(.*\bcalls=%?([\w.\-]+)", hlo_text))
    out = {}
    for body in (lines for name, lines in bodies.items() if name not in fused):  # what runs: no fused body's
        for line in body:
            m = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = ", line)
            if m:
                called = re.search(r"\bfusion\(.*\bcalls=%?([\w.\-]+)", line)
                out[m.group(1)] = " ".join(ops(bodies.get(called.group(1), []) if called else []) or ops([line]))
    return out


def device_us(fn, args):
    """Microseconds the GPU spends in kernels during one call of `fn` (`device_times`' busy time)."""
    return device_times(fn, args)[0]


def hbm_gbps(nbytes, repeats, passes=10):
    """The HBM bandwidth of this device, GB/s: the largest of a copy (in place, `a + 1` on uint32 in a loop of
    `passes` over a donated buffer, so no allocation is timed; bytes read + written), a read (`sum` of f32 rows;
    bytes read) and the same read `passes` times in a loop (`sum(rows + i)`, so no pass is hoisted; the one
    dispatch amortized), each the median of `repeats` runs."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def timed(fn, a, moved, chain):
        out = fn(a)  # compile, warm up
        samples = []
        for _ in range(repeats):
            a = out if chain else a
            jax.block_until_ready(a)
            start = time.perf_counter()
            out = jax.block_until_ready(fn(a))
            samples.append(time.perf_counter() - start)
        return moved / _median(samples) / 1e9

    words = nbytes // 4
    copy = jax.jit(lambda a: lax.fori_loop(0, passes, lambda i, a: a + 1, a), donate_argnums=0)
    copy_bw = timed(copy, jnp.zeros((words,), jnp.uint32), 2 * nbytes * passes, chain=True)
    rows = jnp.ones((passes, words // passes), jnp.float32)
    read_bw = timed(jax.jit(lambda r: jnp.sum(r, axis=1)), rows, (words // passes) * passes * 4, chain=False)
    loop = jax.jit(lambda r: lax.fori_loop(0, passes, lambda i, acc: acc + jnp.sum(r + i.astype(r.dtype), axis=1),
                                           jnp.zeros((r.shape[0],), r.dtype)))
    loop_bw = timed(loop, rows, (words // passes) * passes * 4 * passes, chain=False)
    return max(copy_bw, read_bw, loop_bw)


def child(args):
    """Measures the paths of one group in this process; prints one JSON row per line."""
    import jax

    for key, value in GROUPS[args.group][1].items():
        jax.config.update(key, value)
    import jax.numpy as jnp
    import numpy as np

    from jax_latent_ep.experts import grouped as grouped_mod, kernel as kernel_mod, stage as stage_mod
    from jax_latent_ep.testing.experts import random_received

    if args.min_units:  # the kernel path's contraction split target (`experts.kernel.KERNEL_MIN_UNITS`)
        kernel_mod.KERNEL_MIN_UNITS = args.min_units
    if args.narrow_units:  # the FP8 / MXFP4 kernels' split target (`experts.grouped.NARROW_MIN_UNITS`)
        grouped_mod.NARROW_MIN_UNITS = args.narrow_units
    if args.tile_headroom is not None:  # the FP8 / MXFP4 stage's tile size rule (`experts.grouped.tile_pairs`)
        grouped_mod.TILE_HEADROOM = args.tile_headroom
    if args.stage_units:  # the one launch's gate / up and down split targets
        kernel_mod.KERNEL_STAGE_GATE_UNITS, kernel_mod.KERNEL_STAGE_DOWN_UNITS = args.stage_units
    if args.xla_row_sum_slots is not None:  # where the one launch's row sum is XLA's (`stage.XLA_ROW_SUM_SLOTS`)
        stage_mod.XLA_ROW_SUM_SLOTS = args.xla_row_sum_slots
    dev = jax.devices()[0]
    print(f"DEVICE {dev.device_kind if dev.platform == 'gpu' else 'cpu'}", flush=True)  # first: a child cut short has it
    if args.weights_gb is None:  # a stage's temporaries are small beside its weights
        limit = (dev.memory_stats() or {}).get("bytes_limit") if dev.platform == "gpu" else None
        args.weights_gb = 0.85 * limit / 2**30 if limit else 40.0
    out = lambda **row: print("ROW " + json.dumps(row), flush=True)  # noqa: E731
    lat, e, k = args.latent, args.experts, args.topk
    if args.group == "default":
        out(backend="hbm_GBps", ranks=1, tokens=0, metric="GBps", value=hbm_gbps(args.hbm_bytes, args.repeats))
        out(backend="kernel_min_units", ranks=1, tokens=0, metric="units", value=kernel_mod.KERNEL_MIN_UNITS)
        out(backend="narrow_min_units", ranks=1, tokens=0, metric="units", value=grouped_mod.NARROW_MIN_UNITS)
        out(backend="tile_headroom", ranks=1, tokens=0, metric="ratio", value=grouped_mod.TILE_HEADROOM)
        out(backend="kernel_stage_gate_units", ranks=1, tokens=0, metric="units",
            value=kernel_mod.KERNEL_STAGE_GATE_UNITS)
        out(backend="kernel_stage_down_units", ranks=1, tokens=0, metric="units",
            value=kernel_mod.KERNEL_STAGE_DOWN_UNITS)
        out(backend="xla_row_sum_slots", ranks=1, tokens=0, metric="slots", value=stage_mod.XLA_ROW_SUM_SLOTS)
    paths = [p for p in args.paths if PATHS[p][0] == args.group]
    rng = np.random.default_rng(0)
    for j in args.local:
        n = e // j
        for inter in args.intermediate:
            by_fmt = format_layers(paths, j, lat, inter, args.layers, args.weights_gb)
            fit = {f: lay for f, (_, lay) in by_fmt.items()}
            layers = max(fit.values(), default=1)
            key = jax.random.key(j * 7 + inter)
            name = f"J{j}/I{inter}"
            routings = {}  # T -> the layers' receive rows (the same for both weight formats)
            for t in args.tokens:
                recvs = [random_received(rng, ranks=n, rank=0, tokens=t, max_tokens=t, latent=lat, experts=e, topk=k)
                         for _ in range(layers)]
                ids = [np.asarray(r.ids)[np.asarray(r.src) != -1] for r in recvs]
                active = float(np.mean([len(np.unique(i[(i >= 0) & (i < j)])) for i in ids]))
                routings[t] = [jax.tree.map(jnp.asarray, r) for r in recvs]
                if args.group == "default":
                    out(backend=f"floor/{name}", ranks=n, tokens=t, metric="active_experts", value=active)
                    if any(p in FP8_PATHS for p in paths):
                        out(backend=f"floor-fp8/{name}", ranks=n, tokens=t, metric="active_experts", value=active)
                    if any(p in MXFP4_PATHS for p in paths):
                        out(backend=f"floor-mxfp4/{name}", ranks=n, tokens=t, metric="active_experts", value=active)
            for fmt, (fmt_paths, _) in by_fmt.items():  # one weight format resident at a time
                ws = [_layer_weights(jax.random.fold_in(key, li), j, lat, inter, fmt) for li in range(fit[fmt])]
                for t in args.tokens:
                    _measure(args, out, dev, fmt_paths, routings[t][:fit[fmt]], ws, name, n, t, j, fit[fmt])
                del ws


def format_layers(paths, j, lat, inter, layers, weights_gb) -> dict:
    """weight format -> (its paths of `paths`, the layers of a program): `layers`, or fewer where that format's
    weights (`3 J L I` of them) would pass `weights_gb` GiB, at least one."""
    by_fmt = {}
    for p in paths:
        by_fmt.setdefault(PATH_FORMATS.get(p, "bf16"), []).append(p)
    per_layer = {f: 3 * j * lat * inter * _weight_bytes(ps[0]) for f, ps in by_fmt.items()}
    return {f: (ps, max(1, min(layers, int(weights_gb * 2**30 / per_layer[f])))) for f, ps in by_fmt.items()}


def _layer_weights(key, j, lat, inter, fmt):
    """One layer's (w_gate, w_up, w_down), made on the device ~ N(0, 1 / d^2): `fmt` "bf16", "fp8" (`fp8_normal`),
    "fp8-out-in" (the same, `[out, in]`) or "mxfp4" (random codes, one scale)."""
    import jax
    import jax.numpy as jnp

    kg, ku, kd = jax.random.split(key, 3)
    shapes = ((kg, (j, lat, inter), 60), (ku, (j, lat, inter), 60), (kd, (j, inter, lat), 45))
    if fmt == "bf16":
        return tuple(_by_expert(kk, sh, lambda k_, s_, d=d: (jax.random.normal(k_, s_, jnp.float32) / d).astype(
            jnp.bfloat16)) for kk, sh, d in shapes)
    from jax_latent_ep import experts

    if fmt == "mxfp4":  # random codes, the scale of each 32 inputs 2^-6 (weights ~ 1.7 / 64)
        # codes one expert at a time: `random.bits` draws 32-bit words, 4x the uint8 codes' bytes
        return tuple(experts.MXFP4(_by_expert(kk, (sh[0], sh[2], sh[1] // 2), lambda k_, s_: jax.random.bits(
            k_, s_, jnp.uint8)), jnp.full((sh[0], sh[2], sh[1] // 32), 121, jnp.uint8)) for kk, sh, _ in shapes)
    convert = experts.fp8_out_in if fmt == "fp8-out-in" else (lambda w: w)
    return tuple(convert(fp8_normal(kk, sh, 1 / d)) for kk, sh, d in shapes)


def fp8_normal(key, shape, std):
    """`experts.BlockScaled` weights `[J, K, N]` ~ N(0, std^2), made in FP8 on the device (no full-size FP32 or bf16
    copy): values ~ N(0, 64^2) in float8_e4m3fn (`_by_expert`), one scale `std / 64` in every 128 x 128 block."""
    import jax
    import jax.numpy as jnp

    from jax_latent_ep import experts

    j, k, n = shape
    values = _by_expert(key, shape, lambda k_, s_: (jax.random.normal(k_, s_, jnp.float32) * 64).astype(
        jnp.float8_e4m3fn))
    return experts.BlockScaled(values, jnp.full((j, k // 128, n // 128), std / 64, jnp.float32))


def _by_expert(key, shape, make):
    """`[J, ...]` of `make(key_e, shape[1:])` for each expert e, one at a time (no full-size FP32 temporary: a
    program's weights fill the device)."""
    import jax

    return jax.jit(lambda key: jax.lax.map(lambda k_: make(k_, shape[1:]), jax.random.split(key, shape[0])))(key)


def _measure(args, out, dev, paths, recvs, ws, name, n, t, j, layers):
    """Times `paths` on one point (`layers` layers of receive rows `recvs` and weights `ws`); prints their rows."""
    import jax

    from jax_latent_ep import experts
    from jax_latent_ep.experts.planning import capacity, work_items
    from jax_latent_ep.layout import stride

    lat, k = args.latent, args.topk
    inter = int(name.split("/I")[1])
    rows = n * stride(t)
    cap = capacity(n, t, k, j)
    for path in paths:
        impl = PATHS[path][1]
        if impl == "gather" and 3 * cap * lat * inter * 2 > args.gather_gb * 2**30:
            continue
        if impl == "dense" and (rows * j * max(lat, 2 * inter) * 4 > args.dense_gb * 2**30):
            continue

        def program(recvs, ws, impl=impl, t=t, n=n, j=j):
            if impl in ("kernel-fp8", "wgmma-fp8", "wgmma-mxfp4"):
                return [experts.expert_stage(r, 0, *w, impl=impl.split("-")[0], max_tokens=t, ranks=n)
                        for r, w in zip(recvs, ws)]
            if impl == "wgmma-fp8-xla-plan":
                return [experts.expert_stage(r, 0, *w, impl="wgmma", max_tokens=t, ranks=n, plan_impl="xla")
                        for r, w in zip(recvs, ws)]
            if impl == "plan":
                return [work_items(experts.plan(r, 0, j, max_tokens=t, ranks=n)) for r in recvs]
            if impl == "plan-kernel":
                return [experts.plan(r, 0, j, max_tokens=t, ranks=n, impl="kernel").work for r in recvs]
            if impl == "kernel-xla-plan":
                return [experts.expert_stage(r, 0, *w, impl="kernel", max_tokens=t, ranks=n, plan_impl="xla")
                        for r, w in zip(recvs, ws)]
            return [experts.expert_stage(r, 0, *w, impl=impl, max_tokens=t, ranks=n) for r, w in zip(recvs, ws)]

        fn = jax.jit(program)
        try:
            sec = _time(fn, (recvs, ws), args.repeats)
        except Exception as exc:  # a lowering that refuses, out of memory: say so, go on
            print(f"FAIL {path}/{name} T={t}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        if path.startswith("ragged_dot") and t == args.tokens[0]:
            hlo = fn.lower(recvs, ws).compile().as_text()
            out(backend=f"{path}/{name}", ranks=n, tokens=t, metric="cudnn_in_hlo",
                value=float("cudnn" in hlo.lower()))
        out(backend=f"{path}/{name}", ranks=n, tokens=t, metric="layers", value=layers)
        out(backend=f"{path}/{name}", ranks=n, tokens=t, metric="us_per_layer", value=1e6 * sec / layers)
        if args.pipelined:
            b2b, host = _time_pipelined(fn, (recvs, ws), args.repeats)
            out(backend=f"{path}/{name}", ranks=n, tokens=t, metric="pipelined_us_per_layer", value=1e6 * b2b / layers)
            out(backend=f"{path}/{name}", ranks=n, tokens=t, metric="host_us_per_layer", value=1e6 * host / layers)
        if args.device_time and dev.platform == "gpu":
            kernels = {} if args.kernel_times else None
            busy, span, launches = device_times(fn, (recvs, ws), kernels)
            out(backend=f"{path}/{name}", ranks=n, tokens=t, metric="launches_per_layer", value=launches / layers)
            for kname, us in sorted((kernels or {}).items()):  # each kernel's share of a layer, by its name
                out(backend=f"{path}/{name}", ranks=n, tokens=t, metric=f"kernel_us:{kname}", value=us / layers)
            out(backend=f"{path}/{name}", ranks=n, tokens=t, metric="device_us_per_layer",
                value=busy / layers)
            out(backend=f"{path}/{name}", ranks=n, tokens=t, metric="span_us_per_layer",
                value=span / layers)


def parent(args, argv):
    groups = sorted({PATHS[p][0] for p in args.paths}, key=list(GROUPS).index)
    rows, device, notes = [], "unknown", []
    for group in groups:
        env = dict(os.environ)
        extra = GROUPS[group][0]
        for k, v in extra.items():
            env[k] = (env.get(k, "") + " " + v).strip()
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE)] + [p for p in [env.get("PYTHONPATH")] if p])
        cmd = [sys.executable, os.path.abspath(__file__), "--child", group] + argv
        start = time.perf_counter()
        with tempfile.TemporaryFile("w+") as err:  # a file, not a pipe: a child's long stderr never blocks it
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
            late = []
            bound = threading.Timer(args.child_timeout, lambda: (late.append(True), proc.kill()))
            bound.start()
            try:
                for line in proc.stdout:
                    if line.startswith("ROW "):
                        rows.append(json.loads(line[4:]))
                        _write(args, rows, device)  # each row on disk as it comes: a run cut short keeps them
                    elif line.startswith("DEVICE "):
                        device = line[7:].strip()
                    elif line.startswith("FAIL "):
                        notes.append(line.strip())
            finally:
                bound.cancel()
                proc.kill()
                rc = proc.wait()
            err.seek(0)
            if rc:
                why = f"timed out after {args.child_timeout} s" if late else ""
                notes.append(f"FAIL group {group} (rc {rc}): {why or err.read().strip()[-500:]}")
        print(f"# group {group}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
        _write(args, rows, device)  # what the groups so far measured, should a later one not come back
    return report(args, rows, device, notes)


def _derived(args, rows):
    """The rows plus the floors (`floor/...` `us`) and each time's ratio to its floor. The floor's bandwidth
    (`floor_GBps`) is the larger of the probes' (`hbm_GBps`) and the fastest weight stream a measured path showed
    (`stream_GBps`: active experts' bytes over a time): a floor no measured time beats."""
    rows = [r for r in rows if r["backend"] not in ("stream_GBps", "floor_GBps")]
    hbm = next((r["value"] for r in rows if r["backend"] == "hbm_GBps"), None)
    lat = args.latent
    # ("J448/I512", T, bytes a weight): a path's point and its floor's
    point = lambda r: (r["backend"].split("/", 1)[1], r["tokens"], _weight_bytes(r["backend"]))  # noqa: E731
    floor_rows = [r for r in rows if r["backend"].split("/")[0] in FLOORS]
    weight_bytes = {point(r): r["value"] * 3 * lat * int(r["backend"].split("/I")[1]) * point(r)[2]
                    for r in floor_rows if r["metric"] == "active_experts"}
    stream = max((weight_bytes[point(r)] / (r["value"] * 1e-6) / 1e9 for r in rows
                  if r["metric"] in RATIOS and r["value"] > 0 and point(r) in weight_bytes), default=None)
    if hbm and stream:
        rows.append(dict(backend="stream_GBps", ranks=1, tokens=0, metric="GBps", value=stream))
        hbm = max(hbm, stream)
        rows.append(dict(backend="floor_GBps", ranks=1, tokens=0, metric="GBps", value=hbm))
    for r in list(rows):
        if r["metric"] == "active_experts" and hbm:
            rows.append(dict(r, metric="us", value=weight_bytes[point(r)] / (hbm * 1e9) * 1e6))
    floors = {point(r): r["value"] for r in rows if r["backend"].split("/")[0] in FLOORS
              and r["metric"] == "us"}
    for r in list(rows):
        if r["metric"] in RATIOS:
            f = floors.get(point(r))
            if f:
                rows.append(dict(r, metric=RATIOS[r["metric"]], value=r["value"] / f))
    return rows, hbm, floors


def write_rows(path, device, rows):
    """Writes `rows` of `(backend, ranks, tokens, metric, value)` to the CSV `path` (`COLUMNS`: today's date, `device`,
    `_commit()`)."""
    date, commit = datetime.date.today().isoformat(), _commit()
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(COLUMNS)
        for backend, ranks, tokens, metric, value in rows:
            w.writerow([date, device, commit, backend, ranks, tokens, metric, f"{value:.6g}"])


def _write(args, rows, device):
    """Writes `rows` with their floors and ratios to `args.out`; returns them."""
    rows = _derived(args, rows)[0]
    write_rows(args.out, device, [(r["backend"], r["ranks"], r["tokens"], r["metric"], r["value"]) for r in rows])
    return rows


def report(args, rows, device, notes):
    """Writes the CSV and prints the table."""
    _, hbm, floors = _derived(args, rows)
    rows = _write(args, rows, device)
    date, commit = datetime.date.today().isoformat(), _commit()

    probe = next((r["value"] for r in rows if r["backend"] == "hbm_GBps"), None)
    print(f"expert stage, {device}, commit {commit}, {date}; HBM {hbm and round(hbm)} GB/s (the largest of a copy, "
          f"read + write, a read and a looped read: {probe and round(probe)}; and the fastest weight stream measured)")
    print("us per layer (ratio to the floor); floor = active experts x 3 L I x 2 B / that bandwidth")
    for j in args.local:
        for inter in args.intermediate:
            name = f"J{j}/I{inter}"
            print(f"\n{name} (N = {args.experts // j}):")
            print(f"  {'path':30s}" + "".join(f"{'T=' + str(t):>18s}" for t in args.tokens))
            act = {r["tokens"]: r["value"] for r in rows if r["backend"] == f"floor/{name}" and r["metric"] == "active_experts"}
            print(f"  {'active experts':30s}" + "".join(f"{act.get(t, float('nan')):18.1f}" for t in args.tokens))
            for label, b in (("floor", 2), ("floor (FP8 weights)", _weight_bytes("floor-fp8")),
                             ("floor (MXFP4 weights)", _weight_bytes("floor-mxfp4"))):
                if any((name, t, b) in floors for t in args.tokens):
                    print(f"  {label:30s}" + "".join(f"{floors.get((name, t, b), float('nan')):18.1f}"
                                                     for t in args.tokens))
            for path in args.paths:
                for metric, label in (("us_per_layer", path), ("pipelined_us_per_layer", f"{path} (pipelined)"),
                                      ("device_us_per_layer", f"{path} (device)"), ("span_us_per_layer", f"{path} (span)")):
                    us = {r["tokens"]: r["value"] for r in rows if r["backend"] == f"{path}/{name}" and r["metric"] == metric}
                    if not us:
                        continue
                    cells = []
                    for t in args.tokens:
                        if t in us:
                            f = floors.get((name, t, _weight_bytes(path)))
                            cells.append(f"{us[t]:10.1f} ({us[t] / f:4.1f}x)" if f else f"{us[t]:18.1f}")
                        else:
                            cells.append(f"{'-':>18s}")
                    print(f"  {label:30s}" + "".join(f"{c:>18s}" for c in cells))
            cud = [r for r in rows if r["backend"].endswith(name) and r["metric"] == "cudnn_in_hlo"]
            for r in cud:
                print(f"  {r['backend'].split('/')[0]}: cuDNN custom call in the optimized HLO: {bool(r['value'])}")
    for n in notes:
        print(n)
    print(f"wrote {args.out} ({len(rows)} rows)")
    # a group that did not finish (killed, crashed) leaves the run incomplete, whatever rows it sent first
    return 0 if rows and not any(n.startswith("FAIL group") for n in notes) else 1


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU): L=128, E=32, K=4, J=16")
    p.add_argument("--out", default="expert_stage.csv")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32, 128])
    p.add_argument("--local", nargs="+", type=int, default=[448, 112], help="J, local experts")
    p.add_argument("--intermediate", nargs="+", type=int, default=[512, 2048], help="I")
    p.add_argument("--latent", type=int, default=3584)
    p.add_argument("--experts", type=int, default=896)
    p.add_argument("--topk", type=int, default=16)
    p.add_argument("--layers", type=int, default=4,
                   help="layers per program (fewer where a format's weights pass --weights-gb)")
    p.add_argument("--weights-gb", type=float, default=None,
                   help="GiB of weights a program may hold (default: 85 %% of the device's memory, 40 off GPUs)")
    p.add_argument("--gather-gb", type=float, default=8.0)
    p.add_argument("--dense-gb", type=float, default=8.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hbm-bytes", type=int, default=2 << 30)
    p.add_argument("--child-timeout", type=int, default=400)
    p.add_argument("--device-time", action="store_true",
                   help="also the GPU's time per layer from a profiler trace of one call: `device_us_per_layer` (kernels), "
                        "`span_us_per_layer` (first kernel start to last kernel end)")
    p.add_argument("--kernel-times", action="store_true",
                   help="with --device-time: each kernel's GPU time per layer, a `kernel_us:<kernel name>` row each")
    p.add_argument("--pipelined", action="store_true",
                   help="also the time per layer of calls issued back to back (`pipelined_us_per_layer`: the program's "
                        "host-side cost overlaps the GPU's work on the call before)")
    p.add_argument("--min-units", type=int, default=0,
                   help="the kernel path's contraction split aims at this many units a launch (default "
                        "`experts.kernel.KERNEL_MIN_UNITS`; recorded as the `kernel_min_units` row)")
    p.add_argument("--narrow-units", type=int, default=0,
                   help="the FP8 / MXFP4 kernels' contraction split aims at this many units (default "
                        "`experts.grouped.NARROW_MIN_UNITS`, 1: unsplit; recorded as the `narrow_min_units` row)")
    p.add_argument("--tile-headroom", type=float, default=None,
                   help="the FP8 / MXFP4 stage's tile holds at least this many times the pairs expected an active "
                        "expert (default `experts.grouped.TILE_HEADROOM`; 0.01: always 8 pairs, 1000: always 32; "
                        "recorded as the `tile_headroom` row)")
    p.add_argument("--stage-units", nargs=2, type=int, default=None, metavar=("GATE", "DOWN"),
                   help="the one launch's gate / up and down split targets (default "
                        "`experts.kernel.KERNEL_STAGE_GATE_UNITS`, `KERNEL_STAGE_DOWN_UNITS`; recorded as "
                        "`kernel_stage_*_units` rows)")
    p.add_argument("--xla-row-sum-slots", type=int, default=None,
                   help="the one launch's row sum is XLA's up to this many slots (R * M), the row-sum kernel's above "
                        "(default `experts.stage.XLA_ROW_SUM_SLOTS`; recorded as the `xla_row_sum_slots` row)")
    p.add_argument("--child", dest="group", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.stage_units and min(args.stage_units) < 1:
        p.error(f"--stage-units={args.stage_units}: give two positive numbers of units")
    if args.xla_row_sum_slots is not None and args.xla_row_sum_slots < 0:
        p.error(f"--xla-row-sum-slots={args.xla_row_sum_slots}: give a number of slots >= 0")
    if args.min_units < 0:
        p.error(f"--min-units={args.min_units}: give a positive number of units, or 0 for the default")
    if args.tile_headroom is not None and not args.tile_headroom > 0:
        p.error(f"--tile-headroom={args.tile_headroom}: give a positive ratio")
    if args.narrow_units < 0:
        p.error(f"--narrow-units={args.narrow_units}: give a positive number of units, or 0 for the default")
    if args.smoke:
        args.latent, args.experts, args.topk = 128, 32, 4
        args.local, args.intermediate, args.tokens = [16], [32], [1, 4]
        args.layers, args.repeats, args.hbm_bytes = 2, 1, 1 << 22
        if "--paths" not in argv:
            args.paths = ["ragged_dot-default", "gather", "dense"]  # the kernel path needs a GPU
    if args.group:
        child(args)
        return 0
    return parent(args, argv)


if __name__ == "__main__":
    sys.exit(main())
