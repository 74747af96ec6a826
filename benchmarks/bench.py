"""The benchmark runner: per-layer latency of dispatch + trivial expert + combine (+RMSNorm), the NVLink backend
against XLA's collectives, with the floor and the kernels alone measured in the same run.

    python benchmarks/bench.py run --suite readme --out bench.csv   # the README's table (floor, kernels, layers, ...)
    python benchmarks/bench.py table [CSV ...] [--markdown]          # the table of a CSV (default: results/latest.csv)
    python benchmarks/bench.py plot [--csv CSV] [--out-dir DIR]       # latency_n1.png, latency_n2.png of a CSV
    python benchmarks/bench.py floor [--out CSV | --raw FLOOR_RAW]    # floor.cu alone: round trip, bandwidth, floor
    python benchmarks/bench.py publish bench.csv                      # results/latest.csv, history.csv and the plots
    python benchmarks/bench.py suites                                 # the named suites and what each runs

`run` without `--suite` is one pass with the options given. A pass measures, on the GPUs present (`--stages`):
- `floor` (two GPUs, `nvcc` on the PATH): `floor.cu` compiled for the GPU's architecture; the flag round trip, the
  SM-store peer bandwidth, and `floor_us` at each T: two flag round trips plus the bytes one rank sends at N = 2
  at that bandwidth (`floor_rows`); the skeleton layers of `floor.cu` as rows of backend `floor.cu`;
- `kernels`: dispatch + combine alone in the JAX-free kernel harness (`python -m tools.kernel_harness --mode
  latency`), CUDA-graph replays timed over their steady layers (`kernel_us_median`; `kernel_replay_us_median` over
  whole replays), each T with the buffer the jitted layer of that T gets;
- `layers`: every backend's jitted layer (`nvlink`; `xla`, the library's all_to_all backend; `xla-allgather`,
  all_gather + psum_scatter) at N = 1 (one GPU), N = 2 with one process per GPU (two processes under
  `jax.distributed`) and N = 2 with one process driving both GPUs (backend name `...-1proc`), for each T, inside one
  jitted program of `--layers` unrolled layers: the median over `--repeats` samples of `--inner` programs enqueued
  back to back, per layer (`layer_us_median`), the host's enqueue time per layer (`enqueue_us_per_layer`), and,
  after every timing, at the smallest and largest T, the launches per layer from the profiler's device trace
  (`launches_per_layer`, `our_launches_per_layer`).
Rows `date,device,commit,backend,ranks,tokens,metric,value` go into `--out` as each stage ends (a run cut off keeps
what it measured); the workers' logs into `--logs` (default: `<out>.logs/`). Without a GPU the XLA backends run on
the CPU and the other stages say why they are skipped.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import time

TOKENS = (1, 2, 5, 8, 16, 32, 64, 128)
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
LATEST = os.path.join(RESULTS, "latest.csv")
HISTORY = os.path.join(RESULTS, "history.csv")
sys.path.insert(0, ROOT)

#: The columns of every CSV the runner writes, and history.csv's (the same plus `source`, the file a row came from).
COLUMNS = ("date", "device", "commit", "backend", "ranks", "tokens", "metric", "value")
HISTORY_COLUMNS = COLUMNS + ("source",)

#: XLA flags of every timed pass: command buffers for fusions and custom calls (the runner's default), temporaries at
#: fixed addresses (no command-buffer update between executions).
SKIP_TEMP = "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
#: XLA's collectives captured into its command buffers as well: the best XLA tuning found (`-collectives-cmdbuf`).
CMDBUF_ALL = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES"


def _progress(iterable, total, desc):
    try:
        from tqdm import tqdm

        return tqdm(iterable, total=total, desc=desc, file=sys.stderr, mininterval=1.0)
    except ImportError:
        def gen():
            for i, item in enumerate(iterable):
                print(f"[{desc}] {i + 1}/{total}", file=sys.stderr, flush=True)
                yield item

        return gen()


# ----------------------------------------------------------------------------------------------------------
# One process's work (`bench.py worker`, spawned by `run`).
# ----------------------------------------------------------------------------------------------------------


def allgather_backend(mesh, axis_name, max_tokens, shape):
    """Dispatch by all_gather of every rank's quantized rows, combine by psum_scatter of masked partials.

    Same Received format as the contract (rows of tokens that do not route here are re-marked empty); the
    combine sums in XLA's reduction order, which equals ascending rank order for N <= 2.
    """
    import jax
    import jax.numpy as jnp

    from jax_latent_ep import numerics
    from jax_latent_ep.layout import stride
    from jax_latent_ep.received import Received

    n = mesh.shape[axis_name]
    s = stride(max_tokens)
    local = shape.experts // n

    class AllGather:
        def dispatch(self, x, ids, weights):
            t = x.shape[0]
            rank = jax.lax.axis_index(axis_name)
            q, sf = numerics.mxfp8_quantize(x)
            pad = ((0, s - t), (0, 0))
            q, sf = jnp.pad(q, pad), jnp.pad(sf, pad)
            ids_p = jnp.pad(ids, pad, constant_values=-1)
            w_p = jnp.pad(weights, pad)
            src = jnp.where(jnp.arange(s) < t, (rank << 16) | jnp.arange(s), -1).astype(jnp.int32)
            g = lambda a: jax.lax.all_gather(a, axis_name, tiled=True)  # noqa: E731
            q, sf, ids_g, w_g, src = g(q), g(sf), g(ids_p), g(w_p), g(src)
            here = jnp.any((ids_g // local) == rank, axis=-1) & (src >= 0)
            invalid = ((rank + 1) % n) * local
            ids_g = jnp.where(here[:, None], ids_g, invalid).astype(jnp.int32)
            w_g = jnp.where(here[:, None], w_g, 0.0)
            src = jnp.where(here, src, -1)
            return Received(q, sf, ids_g, w_g, src)

        def combine(self, out, ids, norm_weight, eps=1e-5):
            t = ids.shape[0]
            rank = jax.lax.axis_index(axis_name)
            # A partial counts only where the source token routes here (the others are not read).
            all_ids = jax.lax.all_gather(jnp.pad(ids, ((0, s - t), (0, 0)), constant_values=-1), axis_name,
                                         tiled=True)
            here = jnp.any((all_ids // local) == rank, axis=-1)
            part = jnp.where(here[:, None], out.astype(jnp.float32), 0.0)
            routed = jax.lax.psum_scatter(part, axis_name, scatter_dimension=0, tiled=True)[:t]
            routed = routed.astype(jnp.bfloat16)
            if norm_weight is None:
                return routed
            return numerics.rms_norm(routed, norm_weight, eps)

        def close(self):
            pass

    return AllGather()


#: Kernel names of the NVLink backend (the cubins' symbols; `ep_dispatch_0`, `ep_combine_0` in a device trace).
OUR_KERNELS = ("ep_dispatch", "ep_combine")


def launch_counts(events, layers):
    """Per-layer launch counts from one program's device trace: `events` are `(line name, event name)` pairs of one
    GPU's plane. Counts the events on its stream lines (kernels, memcpy and memset; the profiler's derived lines such
    as "XLA Ops" repeat them and are skipped). Returns `{"launches_per_layer": float, "our_launches_per_layer":
    float, "by_name": {name: count per layer}}`."""
    names = [name for line, name in events if line.startswith("Stream")]
    by_name = {}
    for name in names:
        by_name[name] = by_name.get(name, 0) + 1
    ours = sum(c for name, c in by_name.items() if name.startswith(OUR_KERNELS))
    return {"launches_per_layer": len(names) / layers, "our_launches_per_layer": ours / layers,
            "by_name": {name: c / layers for name, c in sorted(by_name.items(), key=lambda kv: -kv[1])}}


def trace_launches(fn, args, layers, plane_index=0):
    """Runs `x = fn(*args)` once under `jax.profiler` and returns `(x, launch_counts(...))` of the first GPU plane
    (`plane_index`-th in name order). The counts are None, with the reason on stderr, on a machine without GPU planes
    or when the profiler fails; `x` is returned either way (`args[0]` is donated to `fn`)."""
    import glob
    import shutil
    import tempfile

    import jax

    trace_dir = tempfile.mkdtemp(prefix="bench_trace_")
    try:
        jax.profiler.start_trace(trace_dir)
    except Exception as e:  # nothing ran yet: the caller's arguments are intact
        print(f"launch count: the profiler did not start: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return fn(*args), None
    try:
        x = fn(*args)
        x.block_until_ready()
    finally:
        try:
            jax.profiler.stop_trace()
        except Exception as e:
            print(f"launch count: stop_trace failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    try:
        paths = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        planes = sorted((p for p in jax.profiler.ProfileData.from_file(paths[0]).planes
                         if p.name.startswith("/device:GPU:")), key=lambda p: p.name) if paths else []
        if len(planes) <= plane_index:
            print("launch count: no GPU plane in the trace", file=sys.stderr, flush=True)
            return x, None
        plane = planes[plane_index]
        return x, launch_counts([(line.name, e.name) for line in plane.lines for e in line.events], layers)
    except Exception as e:
        print(f"launch count: reading the trace failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return x, None
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)


def _launch_path():
    """`record` or `traced`: the FFI targets the NVLink backend's calls use (imported only where it runs)."""
    from jax_latent_ep.runtime import ffi

    return ffi.launch_path()


def worker(args):
    if args.num_processes > 1:
        import jax

        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            local_device_ids=[args.process_id],
        )
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_latent_ep
    from jax_latent_ep.shapes import KIMI_K3

    shape = KIMI_K3
    devices = jax.devices()[: args.ranks]
    n = len(devices)
    assert n == args.ranks, (n, args.ranks)
    mesh = jax.make_mesh((n,), ("ep",), devices=devices, axis_types=(jax.sharding.AxisType.Explicit,))
    results = []
    # --max-tokens 0: one buffer sized for the largest T of the run (one backend serves every T); > 0: that.
    # --max-tokens -1: per T (each T its own backend with max_tokens = T, as a server with one program per
    # batch-size bucket would build it): receive rows, copy-out and the expert stage then scale with T.
    fixed_max_tokens = args.max_tokens if args.max_tokens > 0 else max(args.tokens)
    backends = args.backends.split(",")
    rng = np.random.default_rng(1234)  # the same global inputs on every process
    pool = 8  # routings rotated over the layers
    combos = [(b, t) for b in backends for t in args.tokens]
    count_tokens = set(args.count_tokens if args.count_tokens is not None else
                       (min(args.tokens), max(args.tokens)))
    show = args.process_id == 0

    def run_combo(backend, t, count=False):
        """Builds the program of `(backend, t)` and times it (`count`: traces one program under the profiler
        instead and returns its launch counts)."""
        max_tokens = t if args.max_tokens < 0 else fixed_max_tokens
        if backend == "xla-allgather":
            ep = allgather_backend(mesh, "ep", max_tokens, shape)
        else:
            ep = jax_latent_ep.ExpertParallel(mesh, axis_name="ep", max_tokens=max_tokens, shape=shape,
                                              backend=backend)
        # Global inputs: [n * t, ...] sharded over ep; routing pool [pool, n * t, K].
        ids = np.stack([
            np.stack([rng.choice(shape.experts, shape.topk, replace=False) for _ in range(n * t)])
            for _ in range(pool)
        ]).astype(np.int32)
        weights = rng.random((pool, n * t, shape.topk), dtype=np.float32)
        x = (rng.standard_normal((n * t, shape.latent))).astype(jnp.bfloat16)
        norm_w = (1 + 0.1 * rng.standard_normal(shape.latent)).astype(jnp.bfloat16)
        shard = NamedSharding(mesh, P("ep"))
        repl = NamedSharding(mesh, P())
        x_d = jax.device_put(x, shard)
        # The pool as separate arguments (not slices of one array): a slice per layer would add two copy
        # kernels per layer to every backend's time.
        ids_d = tuple(jax.device_put(a, shard) for a in ids)
        w_d = tuple(jax.device_put(a, shard) for a in weights)
        nw_d = jax.device_put(norm_w, repl)

        def program(x, ids, weights, norm_w):
            for layer in range(args.layers):
                i, w = ids[layer % pool], weights[layer % pool]
                recv = ep.dispatch(x, i, w)
                out = recv.x.astype(jnp.bfloat16)  # trivial expert: one fusion
                x = ep.combine(out, i, norm_w, eps=1e-5)
            return x

        # The tokens are carried from program to program and donated, as a decode loop carries its state: the
        # output reuses the input's buffer, so no buffer address changes between executions (XLA re-records
        # the command buffer's commands that touch an allocation whose address changed).
        fn = jax.jit(
            jax.shard_map(program, mesh=mesh, in_specs=(P("ep"), (P("ep"),) * pool, (P("ep"),) * pool, P()),
                          out_specs=P("ep"), check_vma=False),
            donate_argnums=(0,),
        )
        y = x_d = fn(x_d, ids_d, w_d, nw_d)
        y.block_until_ready()
        ok = bool(np.isfinite(np.asarray(jax.device_get(y.addressable_shards[0].data), np.float32)).all())
        for _ in range(3):
            x_d = fn(x_d, ids_d, w_d, nw_d)
        x_d.block_until_ready()
        if count:
            # One program under the profiler (every process runs it: collectives).
            x_d, counts = trace_launches(fn, (x_d, ids_d, w_d, nw_d), args.layers)
            x_d.block_until_ready()
            ep.close()
            return counts
        # Each timed sample is `--inner` programs enqueued back to back (JAX dispatches asynchronously), then
        # one wait: the host's launch cost and, with one process per GPU, the skew between the processes'
        # launches are paid once per sample instead of once per program; the median is over the samples.
        times, enqueue = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _ in range(args.inner):
                x_d = fn(x_d, ids_d, w_d, nw_d)
            queued = time.perf_counter()
            x_d.block_until_ready()
            times.append((time.perf_counter() - start) / (args.inner * args.layers) * 1e6)
            enqueue.append((queued - start) / (args.inner * args.layers) * 1e6)
        ep.close()
        return {"backend": backend, "ranks": n, "tokens": t, "procs": args.num_processes,
                "max_tokens": max_tokens,
                "layer_us_median": float(np.median(times)), "layer_us_min": float(np.min(times)),
                "enqueue_us_per_layer": float(np.median(enqueue)),
                "finite": ok, "launch_path": _launch_path() if backend == "nvlink" else ""}

    # Every timing first, then the launch counts: the profiler runs after the last timed program, so that
    # nothing it leaves behind (CUPTI stays loaded) can touch a timing.
    counted = [(b, t) for b, t in combos if t in count_tokens] if jax.devices()[0].platform == "gpu" else []
    steps = [(b, t, False) for b, t in combos] + [(b, t, True) for b, t in counted]
    it = _progress(steps, len(steps), f"N={n} procs={args.num_processes}") if show else steps
    for backend, t, count in it:
        if not count:
            results.append(run_combo(backend, t))
            continue
        counts = run_combo(backend, t, count=True)
        if counts:
            next(r for r in results if r["backend"] == backend and r["tokens"] == t).update(counts)
    if show:
        print("RESULT " + json.dumps(results), flush=True)


# ----------------------------------------------------------------------------------------------------------
# CSV rows.
# ----------------------------------------------------------------------------------------------------------


def append_rows(path, rows):
    """Appends rows (sequences in `COLUMNS` order) to the CSV at `path`, the header first when the file is new or
    empty: each stage writes its rows when it ends, so a run cut off later keeps what it measured."""
    rows = [tuple(str(v) for v in r) for r in rows]
    if not rows:
        return
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        if new:
            w.writerow(COLUMNS)
        w.writerows(rows)


def read_rows(paths, exclude=""):
    """The rows of one or more CSVs as tuples in `COLUMNS` order (read as one; `exclude`: leave out backends whose
    name contains it). A file without every column of `COLUMNS` is an error."""
    rows = []
    for path in [paths] if isinstance(paths, str) else paths:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            missing = set(COLUMNS) - set(reader.fieldnames or ())
            if missing:
                raise SystemExit(f"{path}: no column {', '.join(sorted(missing))} (a CSV of bench.py rows has "
                                 f"{','.join(COLUMNS)})")
            rows += [tuple(r[k] for k in COLUMNS) for r in reader if not (exclude and exclude in r["backend"])]
    return rows


# ----------------------------------------------------------------------------------------------------------
# The floor.
# ----------------------------------------------------------------------------------------------------------

#: Bytes one rank sends per token at N = 2 (Kimi K3): a dispatch row (3584 MXFP8 bytes, 112 scales, 16 ids and
#: 16 weights, 4 bytes of source) and a combine partial (3584 BF16).
DISPATCH_ROW_BYTES = 3584 + 112 + 16 * 4 * 2 + 4
COMBINE_PARTIAL_BYTES = 3584 * 2


def floor_rows(raw_rows, date, device, commit, tokens=TOKENS):
    """Rows (lists in `COLUMNS` order) from `floor.cu`'s `metric,bytes,value` rows: the flag round trip, the peer
    bandwidth of the largest transfer, and `floor_us` per T = two flag round trips plus the bytes one rank sends
    (dispatch row + combine partial per token) at that bandwidth."""
    round_trip = next(float(r["value"]) for r in raw_rows if r["metric"] == "flag_round_trip_us")
    peer = [r for r in raw_rows if r["metric"] == "peer_store_GBps"]
    bandwidth = float(max(peer, key=lambda r: int(r["bytes"]))["value"])  # GB/s = bytes per ns
    head = [date, device, commit, "floor", "2"]
    rows = [head + ["0", "flag_round_trip_us", f"{round_trip:.3f}"],
            head + ["0", "peer_store_GBps", f"{bandwidth:.3f}"]]
    for t in tokens:
        us = 2 * round_trip + t * (DISPATCH_ROW_BYTES + COMBINE_PARTIAL_BYTES) / (bandwidth * 1e3)
        rows.append(head + [str(t), "floor_us", f"{us:.3f}"])
    return rows


def floor_raw_rows(raw_rows, date, device, commit):
    """`floor.cu`'s own figures (every bandwidth by transfer size, the skeleton layers) as rows of backend
    `floor.cu`: metric `<name>` where `bytes` is 0, else `<name>_<bytes>B`; ranks 2, tokens 0."""
    return [[date, device, commit, "floor.cu", "2", "0",
             r["metric"] if int(r["bytes"]) == 0 else f"{r['metric']}_{r['bytes']}B", r["value"]] for r in raw_rows]


def _cuda_arch():
    """`sm_90a` / `sm_100a`: the first GPU's architecture for nvcc, as the NVLink backend picks its cubins."""
    import jax

    from jax_latent_ep.runtime.ffi import gpu_arch

    return gpu_arch(jax.devices("gpu")[0])


def stage_floor(args, gpus, device, commit, date):
    """The floor rows (`floor.cu` compiled and run on GPUs 0 and 1): `[]` and the reason printed when it cannot run
    here."""
    import tempfile

    if gpus < 2:
        print(f"floor: skipped (it needs two GPUs with peer access; {gpus} here)", flush=True)
        return []
    nvcc = shutil.which("nvcc")
    if not nvcc:
        print("floor: skipped (nvcc is not on the PATH)", flush=True)
        return []
    work = tempfile.mkdtemp(prefix="bench_floor_")
    binary, raw = os.path.join(work, "floor"), os.path.join(work, "floor_raw.csv")
    built = subprocess.run([nvcc, "-O3", f"-arch={_cuda_arch()}", "-o", binary, os.path.join(HERE, "floor.cu")],
                           capture_output=True, text=True, timeout=args.timeout)
    if built.returncode:
        print(f"floor: nvcc failed with {built.returncode}: {built.stderr[-2000:]}", flush=True)
        return []
    out = subprocess.run([binary, raw], capture_output=True, text=True, timeout=args.timeout)
    for line in out.stdout.splitlines():  # the round trip, the bandwidths, the skeletons (floor.cu's own lines)
        print("floor: " + line, flush=True)
    raw_rows = []
    if os.path.exists(raw):
        with open(raw) as f:
            raw_rows = list(csv.DictReader(f))
    have = {r["metric"] for r in raw_rows}
    if out.returncode:
        # floor.cu writes the round trip and the bandwidth first; its later parts (the skeletons) are not the floor.
        print(f"floor: floor.cu failed with {out.returncode}: {out.stderr[-2000:]}", flush=True)
    if not {"flag_round_trip_us", "peer_store_GBps"} <= have:
        print("floor: no round trip or bandwidth measured; no floor rows", flush=True)
        return []
    rows = [tuple(r) for r in floor_rows(raw_rows, date, device, commit, args.tokens)]
    rows += [tuple(r) for r in floor_raw_rows(raw_rows, date, device, commit)]
    append_rows(args.out, rows)
    return rows


# ----------------------------------------------------------------------------------------------------------
# The kernels alone and the jitted layers.
# ----------------------------------------------------------------------------------------------------------


def _kernel_buffers(args):
    """{max_tokens: [T, ...]}: the kernel harness's buffer for each T, as the layer benchmark sizes it."""
    groups = {}
    for t in args.tokens:
        m = t if args.max_tokens < 0 else (args.max_tokens or max(args.tokens))
        groups.setdefault(m, []).append(t)
    return groups


def stage_kernels(args, gpus, device, commit, date, env):
    """`kernel_us_median` rows (and the dispatch and combine alone): the kernel harness's latency mode at N = 1 and,
    with two GPUs, N = 2 (one GPU per rank), each T with the layer benchmark's buffer."""
    import tempfile

    ranks = [r for r in (1, 2) if r <= gpus and (not args.only_ranks or r in args.only_ranks)]
    tmp = os.path.join(tempfile.mkdtemp(prefix="bench_kernels_"), "kernels.csv")
    for m, tokens in sorted(_kernel_buffers(args).items()):
        cmd = [sys.executable, "-m", "tools.kernel_harness", "--mode", "latency", "--ranks", *map(str, ranks),
               "--max-tokens", str(m), "--latency-tokens", *map(str, tokens), "--csv", tmp, "--commit", commit]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
        for line in out.stdout.splitlines():
            if line.strip().startswith(("latency", "T=")):
                print(f"kernels (buffer {m}): {line.strip()}", flush=True)
        if out.returncode:
            print(f"kernels (buffer {m}): harness failed with {out.returncode}: {out.stderr[-2000:]}", flush=True)
    rows = []
    if os.path.exists(tmp):
        with open(tmp) as f:
            for r in csv.DictReader(f):
                if r["metric"] in ("kernel_us_median", "kernel_replay_us_median", "dispatch_us_median",
                                   "combine_us_median"):
                    # The harness's device column names the GPUs used ("2x NVIDIA H200").
                    rows.append((date, r["device"], commit, "kernels" + args.tag, r["ranks"], r["tokens"],
                                 r["metric"], r["value"]))
    append_rows(args.out, rows)
    return rows


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_workers(ranks, procs, args, env):
    cmd = [sys.executable, os.path.abspath(__file__), "worker", "--ranks", str(ranks),
           "--tokens", ",".join(map(str, args.tokens)), "--layers", str(args.layers),
           "--repeats", str(args.repeats), "--inner", str(args.inner), "--backends", args.backends,
           "--max-tokens", str(args.max_tokens)]
    if args.count_tokens is not None:
        cmd += ["--count-tokens", ",".join(map(str, args.count_tokens)) or "none"]
    if procs == 1:
        out = subprocess.run(cmd + ["--num-processes", "1"], env=env, capture_output=True, text=True,
                             timeout=args.timeout)
        outs = [out]
    else:
        port = _free_port()
        popen = [
            subprocess.Popen(cmd + ["--num-processes", str(procs), "--process-id", str(i),
                                    "--coordinator", f"127.0.0.1:{port}"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(procs)
        ]
        outs = []
        for p in popen:
            stdout, stderr = p.communicate(timeout=args.timeout)
            outs.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    results = []
    for i, out in enumerate(outs):
        # Every worker's output is kept (a failure's cause is often in the other process).
        log = os.path.join(args.logs, f"layers{args.tag}.N{ranks}p{procs}_{i}.log")
        with open(log, "w") as f:
            f.write(out.stdout + "\n--- stderr ---\n" + out.stderr)
        sys.stderr.write(out.stderr[-4000:] if out.returncode else "")
        for line in out.stdout.splitlines():
            if line.startswith("RESULT "):
                results += json.loads(line[len("RESULT "):])
        if out.returncode:
            print(f"worker {i} of N={ranks} procs={procs} failed with {out.returncode} (log: {log})", file=sys.stderr)
    return results


def _machine(args):
    """(gpus, device, commit, date) of this machine and tree."""
    import jax

    gpus = len([d for d in jax.devices() if d.platform == "gpu"])
    device = jax.devices()[0].device_kind if gpus else "cpu"
    commit = os.environ.get("GIT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or "unknown"
    return gpus, device, commit, datetime.date.today().isoformat()


def _env(args):
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if args.cmdbuf:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                            " --xla_gpu_graph_min_graph_size=1").strip()
    if args.xla_flags:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + args.xla_flags).strip()
    return env


STAGES = ("floor", "kernels", "layers")


def run_pass(args, machine):
    """One pass: the stages of `args.stages` with `args`'s settings; its rows are appended to `args.out` as each stage
    ends and returned."""
    gpus, device, commit, date = machine
    env = _env(args)
    print(f"--- pass{args.tag or ''}: stages {args.stages}, backends {args.backends}, "
          f"XLA_FLAGS={env.get('XLA_FLAGS', '')!r}", flush=True)
    stages = args.stages.split(",")
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise SystemExit(f"unknown stages {sorted(unknown)}: {', '.join(STAGES)}")
    backends = args.backends
    if not gpus and "nvlink" in backends.split(","):
        backends = ",".join(b for b in backends.split(",") if b != "nvlink")
        print(f"nvlink: skipped (no GPU); backends {backends}", flush=True)
    rows = []
    if "floor" in stages:
        rows += stage_floor(args, gpus, device, commit, date)
    if "kernels" in stages:
        if gpus:
            rows += stage_kernels(args, gpus, device, commit, date, env)
        else:
            print("kernels: skipped (no GPU)", flush=True)
    if "layers" not in stages or not backends:
        return rows
    plans = [(1, 1)] + ([(2, 1), (2, 2)] if gpus >= 2 else [])
    for ranks, procs in plans:
        if args.only_ranks and ranks not in args.only_ranks:
            continue
        if args.only_procs and procs not in args.only_procs:
            continue
        new_rows = []
        for r in _run_workers(ranks, procs, argparse.Namespace(**{**vars(args), "backends": backends}), env):
            backend = r["backend"] + ("-1proc" if ranks > 1 and procs == 1 else "") + args.tag
            for metric in ("layer_us_median", "enqueue_us_per_layer", "launches_per_layer", "our_launches_per_layer"):
                if metric in r and not (metric == "our_launches_per_layer" and not r["backend"].startswith("nvlink")):
                    new_rows.append((date, device, commit, backend, r["ranks"], r["tokens"], metric,
                                     f"{r[metric]:.2f}"))
            if "by_name" in r:
                print(f"launches per layer, {backend} N={r['ranks']} T={r['tokens']}: "
                      + ", ".join(f"{c:g} x {name[:60]}" for name, c in r["by_name"].items()), flush=True)
        append_rows(args.out, new_rows)  # written per mode, so a cut-off run keeps what it measured
        rows += new_rows
    return rows


# ----------------------------------------------------------------------------------------------------------
# Named suites.
# ----------------------------------------------------------------------------------------------------------

#: The README's settings: 32 layers, 10 samples, each T its own buffer (`max_tokens = T`), temporaries at fixed
#: addresses.
README_PASS = {"layers": 32, "repeats": 10, "max_tokens": -1, "xla_flags": SKIP_TEMP}
#: The XLA variants at N = 2 with NCCL's collectives in XLA's command buffers (rows `...-collectives-cmdbuf`).
XLA_CMDBUF_PASS = {**README_PASS, "stages": "layers", "backends": "xla,xla-allgather", "only_ranks": [2],
                   "count_tokens": [], "xla_flags": f"{SKIP_TEMP} {CMDBUF_ALL}", "tag": "-collectives-cmdbuf"}
#: The jitted NVLink layer at N = 2, one process per GPU, with one buffer of 128 tokens for every T (a decode
#: server's case: one ExpertParallel for every batch size; rows `nvlink-buf128`).
BUF128_PASS = {**README_PASS, "stages": "layers", "backends": "nvlink", "only_ranks": [2], "only_procs": [2],
               "count_tokens": [], "max_tokens": 128, "tag": "-buf128"}

#: GPU tests that the suite runs (`pytest -m gpu`).
#: Where `pytest -m gpu` looks: every test marked gpu, wherever it lives.
GPU_TESTS = ("tests",)


def _harness(*argv):
    return [sys.executable, "-m", "tools.kernel_harness", *argv]


def check_commands(out, commit, gpus):
    """The `gpu-suite` steps: `[(name, argv, env overrides, timeout_s)]`. The kernel harness's correctness runs (virtual
    ranks N = 1, 2, 4, 8 and DeepSeek-V3 at N = 4 on GPU 0; N = 2 on two GPUs), both sequence guards, both timeout
    cases, out-of-range ids, a stress run with a randomly delayed rank, 1000 NVLink layers checked against XLA inside
    one jitted program, and the GPU tests. Rows of the harness runs go into `out`."""
    c = ["--csv", out, "--commit", commit]
    gpu0 = {"CUDA_VISIBLE_DEVICES": "0"}
    steps = [
        ("harness virtual N=1", _harness("--mode", "virtual", "--ranks", "1", "--max-tokens", "128", "--layers", "200",
                                         *c), gpu0, 120),
        ("harness virtual N=2", _harness("--mode", "virtual", "--ranks", "2", "--max-tokens", "128", "--layers", "300",
                                         *c), gpu0, 120),
        ("harness virtual N=4", _harness("--mode", "virtual", "--ranks", "4", "--max-tokens", "32", "--layers", "200",
                                         *c), gpu0, 120),
        ("harness virtual N=8", _harness("--mode", "virtual", "--ranks", "8", "--max-tokens", "16", "--layers", "200",
                                         *c), gpu0, 120),
        ("harness virtual deepseek_v3 N=4", _harness("--shape", "deepseek_v3", "--mode", "virtual", "--ranks", "4",
                                                     "--max-tokens", "16", "--layers", "100", *c), gpu0, 120),
        ("harness bad ids N=2", _harness("--mode", "virtual", "--ranks", "2", "--max-tokens", "16", "--layers", "100",
                                         "--bad-ids", *c), gpu0, 120),
    ]
    steps += [(f"sequence {case}", _harness("--mode", "sequence", "--sequence-case", case, *c), gpu0, 60)
              for case in ("dispatch_twice", "combine_twice")]
    if gpus >= 2:
        steps += [
            ("harness devices N=2", _harness("--mode", "devices", "--ranks", "2", "--max-tokens", "128", "--layers",
                                             "300", *c), {}, 120),
            ("timeout dispatch", _harness("--mode", "timeout", "--timeout-case", "dispatch"), {}, 60),
            ("timeout combine", _harness("--mode", "timeout", "--timeout-case", "combine"), {}, 60),
            ("stress N=2, 20000 layers", _harness("--mode", "stress", "--ranks", "2", "--layers", "20000",
                                                  "--max-tokens", "128", "--stress-log-every", "10000", *c), {}, 200),
            ("nvlink 1000 layers, 2 processes", [sys.executable, os.path.join(HERE, "lib", "nvlink_layers.py"),
                                                 "--procs", "2", "--layers", "1000", "--csv", out], {}, 300),
        ]
    steps.append(("gpu tests", [sys.executable, "-m", "pytest", "-q", "-m", "gpu", *GPU_TESTS], {}, 600))
    return steps


def expert_commands(out, commit, gpus):
    """The `experts` steps (one GPU): the expert stage's tests on the GPU (the plan kernel, the grouped GEMMs in bf16,
    FP8 and MXFP4, the stage at Kimi K3's sizes, the dense projections), then `expert_stage.py` over every format's
    path, `k3_layer.py` in every format, `dense_projections.py` and `training.py`, each CSV beside `out`
    (`<out>.expert_stage.csv`, ...). Each benchmark sizes its programs to the device's memory."""
    base = os.path.splitext(out)[0]
    bench_script = lambda name, *argv: [sys.executable, os.path.join(HERE, f"{name}.py"), *argv,  # noqa: E731
                                        "--out", f"{base}.{name}.csv"]
    return [
        ("expert stage tests", [sys.executable, "-m", "pytest", "-q", "tests/test_experts.py", "tests/test_grouped.py",
                                "tests/test_dense.py", "tests/gpu/test_experts_gpu.py"], {}, 900),
        ("expert stage, every format", bench_script("expert_stage", "--paths", "kernel", "wgmma-fp8", "wgmma-mxfp4",
                                                    "--layers", "12", "--pipelined", "--device-time"), {}, 2400),
        ("K3 layer, every format", bench_script("k3_layer", "--fuse-router", "--topk", "auto", "--device-time"), {},
         1200),
        ("dense projections", bench_script("dense_projections", "--min-units", "0", "132", "264", "528",
                                           "--device-time"), {}, 600),
        ("training step", bench_script("training", "--models", "k3", "k3n2", "k2", "--impls", "wgmma", "--plain",
                                       "both", "--weights-gb", "60"), {}, 2400),
    ]


def profile_commands(gpus):
    """The `profile` steps: the profiler's kernel timeline of the jitted NVLink layer at T = 1 (`lib/timeline.py`),
    N = 1 and, with two GPUs, N = 2 (one process)."""
    env = {"XLA_FLAGS": f"{SKIP_TEMP} --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"}
    return [(f"timeline N={n} T=1", [sys.executable, os.path.join(HERE, "lib", "timeline.py"), "--ranks", str(n),
                                     "--tokens", "1", "--show", "8"], env, 120) for n in (1, 2) if n <= max(gpus, 1)]


#: name -> (what it runs, [pass overrides], step builder or None).
SUITES = {
    "readme": ("the README's table: the floor, the kernels alone, every backend's jitted layer at N = 1 and N = 2 and "
               "the launches per layer, then the xla-variants rows",
               [README_PASS, XLA_CMDBUF_PASS, BUF128_PASS], None),
    "quick": ("a smoke run in about a minute: the kernels alone and every backend's jitted layer at T = 1, 8, 128, "
              "8 layers, 3 samples of 5 programs, no launch counts",
              [{"stages": "kernels,layers", "tokens": [1, 8, 128], "layers": 8, "repeats": 3, "inner": 5,
                "max_tokens": -1, "count_tokens": [], "xla_flags": SKIP_TEMP}], None),
    "xla-variants": ("the README's -collectives-cmdbuf rows (XLA with NCCL in its command buffers, N = 2) and the "
                     "nvlink-buf128 row (one buffer of 128 tokens for every T)",
                     [XLA_CMDBUF_PASS, BUF128_PASS], None),
    "gpu-suite": ("correctness on the GPUs: the kernel harness (virtual ranks, two GPUs, sequence guards, timeouts, "
                  "bad ids, stress), 1000 jitted NVLink layers against XLA, and pytest -m gpu",
                  [], check_commands),
    "profile": ("where a jitted layer's time goes: the profiler's kernel timeline at T = 1, N = 1 and 2",
                [], lambda out, commit, gpus: profile_commands(gpus)),
    "experts": ("the expert stage on one GPU: its GPU tests, every format against the HBM floor (expert_stage.py), "
                "the Kimi K3 layer in every format (k3_layer.py), its projections (dense_projections.py), the "
                "training step (training.py)", [], expert_commands),
}


def suite_passes(name, args):
    """The passes of suite `name` as argument namespaces: `args` (the command line's) with the suite's overrides.
    A suite's own settings win over the command line's, except `--tokens` when given there."""
    if name not in SUITES:
        raise SystemExit(f"unknown suite {name!r}: {', '.join(SUITES)}")
    passes = []
    for overrides in SUITES[name][1]:
        ns = argparse.Namespace(**{**vars(args), **overrides})
        if getattr(args, "tokens_given", False):
            ns.tokens = args.tokens
        passes.append(ns)
    return passes


def _text(b):
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def run_steps(steps, logs, env):
    """Runs each `(name, argv, env overrides, timeout)` step from the repository root, its output into `logs`; prints
    one verdict line per step and returns the names of the steps that failed."""
    failed = []
    for i, (name, argv, extra, timeout) in enumerate(steps):
        start = time.perf_counter()
        try:
            out = subprocess.run(argv, env={**env, **extra}, cwd=ROOT, capture_output=True, text=True,
                                 timeout=timeout)
            rc, text = out.returncode, out.stdout + "\n--- stderr ---\n" + out.stderr
        except subprocess.TimeoutExpired as e:
            rc, text = "timeout", f"{_text(e.stdout)}\n--- stderr ---\n{_text(e.stderr)}"
        log = os.path.join(logs, f"{i:02d}_{''.join(c if c.isalnum() else '_' for c in name)}.log")
        with open(log, "w") as f:
            f.write(" ".join(argv) + "\n" + text)
        stdout, _, stderr = text.partition("\n--- stderr ---")
        tail = [line for line in (stdout if rc == 0 else stderr or stdout).splitlines() if line.strip()][-1:]
        print(f"{'ok  ' if rc == 0 else 'FAIL'} {name} ({time.perf_counter() - start:.0f} s, rc {rc})"
              + (f": {tail[0][:150]}" if tail else ""), flush=True)
        if rc != 0:
            failed.append(name)
    return failed


def cmd_run(args):
    """`run`: one pass with the command line's settings, or the passes and steps of `--suite`."""
    machine = _machine(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if not args.append and os.path.exists(args.out):
        os.remove(args.out)  # a run writes a CSV of its own rows
    args.logs = args.logs or os.path.splitext(args.out)[0] + ".logs"
    os.makedirs(args.logs, exist_ok=True)
    passes = suite_passes(args.suite, args) if args.suite else [args]
    rows = []
    for p in passes:
        rows += run_pass(p, machine)
    failed = []
    if args.suite and SUITES[args.suite][2]:
        env = _env(argparse.Namespace(cmdbuf=False, xla_flags=""))
        failed = run_steps(SUITES[args.suite][2](args.out, machine[2], machine[0]), args.logs, env)
    if rows:
        print_table(rows)
    print(f"rows in {args.out}, logs in {args.logs}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


# ----------------------------------------------------------------------------------------------------------
# The table.
# ----------------------------------------------------------------------------------------------------------


def series(rows):
    """({(name, ranks): {T: us}}, {(name, ranks): {T: launches}}) of the table: `layer_us_median` by backend,
    `kernel_us_median` as "kernels only", `floor_us` as "floor"; the launch counts by backend ("<backend> (ours)" for
    the NVLink backend's own kernels)."""
    by, launches = {}, {}
    for _, _, _, backend, ranks, tokens, metric, value in rows:
        key = {"layer_us_median": backend, "kernel_us_median": "kernels only", "floor_us": "floor"}.get(metric)
        if key is not None:
            by.setdefault((key, int(ranks)), {})[int(tokens)] = float(value)
        elif metric in ("launches_per_layer", "our_launches_per_layer"):
            name = backend + (" (ours)" if metric.startswith("our") else "")
            launches.setdefault((name, int(ranks)), {})[int(tokens)] = float(value)
    return by, launches


def best_xla(by, ranks):
    """{T: us} of the fastest XLA variant per T (any `xla*` backend at `ranks`, either process mode, any flags)."""
    xla = [v for (b, r), v in by.items() if r == ranks and b.startswith("xla")]
    return {t: min(v[t] for v in xla if t in v) for t in sorted({t for v in xla for t in v})}


def print_table(rows, markdown=False):
    """Prints per rank count: the floor, the kernels alone and every backend's `layer_us_median` per T, the best XLA
    variant, each NVLink backend's speed-up over it, the kernels' ratio to the floor, and the launches per layer
    (where counted); with `markdown`, as markdown tables (one per rank count and kind), the README's form."""
    if markdown:
        import contextlib
        import io

        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            print_table(rows)
        print(_markdown(text.getvalue().splitlines()))
        return
    by, launches = series(rows)
    tokens = sorted({int(r[5]) for r in rows if r[6] in ("layer_us_median", "kernel_us_median", "floor_us")})
    width = _name_width(by)
    order = {"floor": 0, "kernels only": 1}
    print("backend".ljust(width) + "N " + "".join(f"T={t}".rjust(9) for t in tokens))
    for (backend, ranks), vals in sorted(by.items(), key=lambda kv: (kv[0][1], order.get(kv[0][0], 2), kv[0][0])):
        print(backend.ljust(width) + f"{ranks} " + "".join(f"{vals.get(t, float('nan')):9.1f}" for t in tokens))
    for line in _speedups(by, tokens, width):
        print(line)
    for line in _floor_ratios(by, tokens, width):
        print(line)
    if launches:
        counted = sorted({t for v in launches.values() for t in v})
        print("launches per layer".ljust(width) + "N " + "".join(f"T={t}".rjust(9) for t in counted))
        for (name, ranks), vals in sorted(launches.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            print(name.ljust(width) + f"{ranks} " + "".join(f"{vals.get(t, float('nan')):9.2f}" for t in counted))


def _markdown(lines):
    """The fixed-width lines of `print_table` as markdown tables: a header line ("backend ... N T=1 ...") starts a
    table kind; its rows are split by rank count; "nan" cells are left empty."""
    tables, header, kind = {}, None, None
    for line in lines:
        fields = line.split()
        if "N" in fields and fields[-1].startswith("T="):  # a header: "<kind> N T=1 T=2 ..."
            kind, header = line[:line.index(" N ")].strip(), fields[fields.index("N") + 1:]
            continue
        if header is None or len(fields) < len(header) + 2:
            continue
        name, ranks, cells = " ".join(fields[:-len(header) - 1]), fields[-len(header) - 1], fields[-len(header):]
        tables.setdefault((kind, ranks, tuple(header)), []).append((name, cells))
    out = []
    for (kind, ranks, header), body in tables.items():
        out.append(f"| {kind} (N = {ranks}) | " + " | ".join(header) + " |")
        out.append("|---|" + "---|" * len(header))
        for name, cells in body:
            out.append(f"| {name} | " + " | ".join("" if c == "nan" else c for c in cells) + " |")
        out.append("")
    return "\n".join(out)


def _floor_ratios(by, tokens, width):
    """Lines of the kernels' time over the floor per T (`by` as in `_speedups`, with "kernels only" and "floor")."""
    lines = []
    floor = {r: v for (b, r), v in by.items() if b == "floor"}
    for (b, ranks), kernels in sorted(by.items()):
        if b != "kernels only" or ranks not in floor:
            continue
        f = floor[ranks]
        lines.append("kernels / floor".ljust(width) + f"{ranks} " + "".join(
            f"{kernels[t] / f[t]:8.2f}x" if t in kernels and t in f else f"{'nan':>9}" for t in tokens))
    return lines


def _name_width(by):
    """The name column's width for the backends of `by` and their speed-up lines."""
    return max([22] + [len(b) + 2 for b, _ in by] + [len(b) + 14 for b, _ in by if b.startswith("nvlink")])


def _speedups(by, tokens, width=None):
    """Lines of the best XLA variant per T (`best_xla`) and of each NVLink backend's speed-up over it, per rank
    count. `by`: {(backend, ranks): {T: us}}."""
    width = width or _name_width(by)
    lines = []
    for ranks in sorted({r for _, r in by}):
        best = best_xla(by, ranks)
        if not best:
            continue
        lines.append("best xla".ljust(width) + f"{ranks} "
                     + "".join(f"{best.get(t, float('nan')):9.1f}" for t in tokens))
        for (b, r), v in sorted(by.items()):
            if r == ranks and b.startswith("nvlink"):
                lines.append(f"speed-up of {b}".ljust(width) + f"{ranks} " + "".join(
                    f"{best[t] / v[t]:8.1f}x" if t in v and t in best else f"{'nan':>9}" for t in tokens))
    return lines


# ----------------------------------------------------------------------------------------------------------
# The plot.
# ----------------------------------------------------------------------------------------------------------

#: The plot's series, in the legend's order.
PLOT_SERIES = ("floor", "kernels only", "nvlink", "best XLA")


def current_series(rows, ranks):
    """{series: {T: us}} of the plot at `ranks`: the floor, the kernels alone, the `nvlink` backend (one process per
    GPU) and the best XLA variant per T; a series without rows is left out."""
    by, _ = series(rows)
    out = {"floor": by.get(("floor", ranks), {}), "kernels only": by.get(("kernels only", ranks), {}),
           "nvlink": by.get(("nvlink", ranks), {}), "best XLA": best_xla(by, ranks)}
    return {name: pts for name, pts in out.items() if pts}


def plot(rows, ranks, path, title=None):
    """Draws `current_series(rows, ranks)` into the PNG at `path` (us per layer against T, both axes log), with the
    NVLink backend's speed-up over the best XLA variant written above each XLA point. Returns the series drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = current_series(rows, ranks)
    if not data:
        raise SystemExit(f"no floor, kernel or layer rows for N = {ranks}")
    style = {"floor": dict(color="black", linestyle="--", marker=None),
             "kernels only": dict(color="tab:gray", linestyle=":", marker="s"),
             "nvlink": dict(color="tab:blue", linestyle="-", marker="o", linewidth=2),
             "best XLA": dict(color="tab:red", linestyle="-", marker="v")}
    label = {"floor": "floor (2 flag round trips + bytes at peer bandwidth)",
             "kernels only": "kernels alone (dispatch + combine, CUDA graph)",
             "nvlink": "nvlink: jitted layer",
             "best XLA": "best XLA variant per T: jitted layer (label: nvlink's speed-up over it)"}
    fig, ax = plt.subplots(figsize=(8, 5))
    for name in PLOT_SERIES:
        if name in data:
            ts = sorted(data[name])
            ax.plot(ts, [data[name][t] for t in ts], label=label[name], **style[name])
    if "nvlink" in data and "best XLA" in data:
        for t, us in data["best XLA"].items():
            if t in data["nvlink"]:
                above = us > data["nvlink"][t]
                ax.annotate(f"{us / data['nvlink'][t]:.1f}x", (t, us), textcoords="offset points",
                            xytext=(0, 7 if above else -14), ha="center", fontsize=8, color="tab:red",
                            bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none", alpha=0.8))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ts = sorted({t for pts in data.values() for t in pts})
    ax.set_xticks(ts, [str(t) for t in ts])
    lo, hi = min(min(p.values()) for p in data.values()), max(max(p.values()) for p in data.values())
    steps = (1, 2, 3, 4, 5, 6, 8, 10, 20) if hi / lo < 5 else (1, 2, 3, 5, 10, 20, 30, 50, 100)
    ticks = [v for v in steps if lo / 1.3 <= v <= hi * 1.3]
    ax.set_yticks(ticks, [str(v) for v in ticks])
    ax.minorticks_off()
    ax.set_xlabel("tokens per rank T")
    ax.set_ylabel("us per layer (median)")
    ax.set_title(title or f"dispatch + expert + combine (+RMSNorm), Kimi K3, N = {ranks}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return data


def cmd_plot(args):
    rows = read_rows(args.csv)
    os.makedirs(args.out_dir, exist_ok=True)
    for ranks in args.ranks:
        device = next((r[1] for r in rows if int(r[4]) == ranks and r[6] == "layer_us_median"), "")
        path = os.path.join(args.out_dir, f"latency_n{ranks}.png")
        plot(rows, ranks, path, title=f"dispatch + expert + combine (+RMSNorm), Kimi K3, N = {ranks}"
             + (f", {device}" if device else ""))
        print("wrote", path)
    return 0


# ----------------------------------------------------------------------------------------------------------
# Publishing a run.
# ----------------------------------------------------------------------------------------------------------


def append_history(rows, source, path=None):
    """Appends `rows` to history.csv (or `path`) with `source` (the run's name) in the last column."""
    path = path or HISTORY
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        if new:
            w.writerow(HISTORY_COLUMNS)
        w.writerows(tuple(r) + (source,) for r in rows)


def cmd_publish(args):
    """`publish CSV`: the run becomes results/latest.csv, its rows go into history.csv, and the plots are drawn
    again from it."""
    rows = read_rows(args.csv)
    if not rows:
        raise SystemExit(f"{args.csv}: no rows")
    source = args.source or f"bench_{rows[0][0]}_{rows[0][2][:7]}"
    with open(HISTORY) as f:
        if any(r.get("source") == source for r in csv.DictReader(f)):
            raise SystemExit(f"history.csv already has rows of {source!r} (--source names another)")
    append_history(rows, source)
    with open(LATEST, "w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows([COLUMNS] + rows)
    print(f"{len(rows)} rows into {LATEST} and {HISTORY} (source {source})")
    return cmd_plot(argparse.Namespace(csv=[LATEST], out_dir=RESULTS, ranks=[1, 2]))


# ----------------------------------------------------------------------------------------------------------
# The command line.
# ----------------------------------------------------------------------------------------------------------


def _ints(s):
    return [int(v) for v in s.split(",")]


def _add_pass_options(p):
    p.add_argument("--tokens", type=_ints, default=list(TOKENS))
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--repeats", type=int, default=20, help="timed samples (the median is reported)")
    p.add_argument("--inner", type=int, default=20, help="programs enqueued back to back per sample")
    p.add_argument("--backends", default="nvlink,xla,xla-allgather")
    p.add_argument("--max-tokens", type=int, default=0,
                   help="receive-buffer size: 0 = the largest T of the run, -1 = each T its own, N = N")
    p.add_argument("--count-tokens", type=lambda s: [] if s == "none" else _ints(s), default=None,
                   help="T at which launches per layer are counted (default: the smallest and largest T; 'none': "
                        "never)")


def parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="measure: one pass with these options, or a named suite (--suite)")
    _add_pass_options(r)
    r.add_argument("--suite", default=None, choices=sorted(SUITES), help="a named suite (`bench.py suites`)")
    r.add_argument("--out", default="bench.csv", help="the CSV of this run's rows (replaced unless --append)")
    r.add_argument("--append", action="store_true", help="add to --out instead of replacing it")
    r.add_argument("--logs", default=None, help="the workers' and steps' logs (default: <out>.logs/)")
    r.add_argument("--timeout", type=int, default=900)
    r.add_argument("--only-ranks", type=_ints, default=None)
    r.add_argument("--only-procs", type=_ints, default=None)
    r.add_argument("--no-cmdbuf", dest="cmdbuf", action="store_false",
                   help="leave XLA's command-buffer settings at their defaults")
    r.add_argument("--xla-flags", default="", help="more XLA_FLAGS for every worker")
    r.add_argument("--tag", default="", help="appended to every backend name in the CSV")
    r.add_argument("--stages", default=",".join(STAGES),
                   help="comma-separated: floor (floor.cu), kernels (kernel harness), layers (jit)")
    t = sub.add_parser("table", help="print the table (and the speed-ups) of CSVs written by `run`")
    t.add_argument("csv", nargs="*", default=[LATEST], help="CSVs read as one (default: results/latest.csv)")
    t.add_argument("--exclude", default="", help="leave out backends whose name contains this")
    t.add_argument("--markdown", action="store_true", help="markdown tables (the README's form)")
    pl = sub.add_parser("plot", help="draw the floor, the kernels, nvlink and the best XLA variant against T")
    pl.add_argument("--csv", nargs="+", default=[LATEST], help="CSVs read as one (default: results/latest.csv)")
    pl.add_argument("--out-dir", default=RESULTS, help="where latency_n<N>.png go (default: benchmarks/results)")
    pl.add_argument("--ranks", type=_ints, default=[1, 2], help="rank counts to draw (default: 1,2)")
    f = sub.add_parser("floor", help="floor.cu alone (two GPUs and nvcc), or the rows of a floor.cu output (--raw)")
    f.add_argument("--out", default="floor.csv")
    f.add_argument("--raw", default=None, help="floor.cu's metric,bytes,value output: print its rows, run nothing")
    f.add_argument("--tokens", type=_ints, default=list(TOKENS))
    f.add_argument("--commit", default=None)
    f.add_argument("--device", default="2x NVIDIA H200 (NV18)")
    f.add_argument("--date", default=datetime.date.today().isoformat())
    f.add_argument("--timeout", type=int, default=900)
    pb = sub.add_parser("publish", help="a run's CSV becomes results/latest.csv, its rows go into history.csv, and "
                                        "the plots are redrawn")
    pb.add_argument("csv")
    pb.add_argument("--source", default=None, help="the run's name in history.csv (default: bench_<date>_<commit>)")
    sub.add_parser("suites", help="list the named suites")
    w = sub.add_parser("worker", help="one process's share of a pass (spawned by run)")
    _add_pass_options(w)
    w.add_argument("--ranks", type=int, required=True)
    w.add_argument("--num-processes", type=int, default=1)
    w.add_argument("--process-id", type=int, default=0)
    w.add_argument("--coordinator", default=None)
    return ap


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.cmd == "worker":
        worker(args)
        return 0
    if args.cmd == "run":
        args.tokens_given = any(a == "--tokens" or a.startswith("--tokens=") for a in argv)
        return cmd_run(args)
    if args.cmd == "table":
        print_table(read_rows(args.csv, args.exclude), markdown=args.markdown)
        return 0
    if args.cmd == "plot":
        return cmd_plot(args)
    if args.cmd == "publish":
        return cmd_publish(args)
    if args.cmd == "suites":
        for name, (what, passes, steps) in SUITES.items():
            print(f"{name:<13} {what}")
        return 0
    if args.cmd == "floor":
        if args.raw:
            with open(args.raw) as fh:
                raw_rows = list(csv.DictReader(fh))
            commit = args.commit or "unknown"
            rows = floor_rows(raw_rows, args.date, args.device, commit, args.tokens)
            rows += floor_raw_rows(raw_rows, args.date, args.device, commit)
            csv.writer(sys.stdout, lineterminator="\n").writerows([COLUMNS] + rows)
            return 0
        gpus, device, commit, date = _machine(args)
        if os.path.exists(args.out):
            os.remove(args.out)
        rows = stage_floor(args, gpus, device, args.commit or commit, date)
        if rows:
            print_table(rows)
            print(f"rows in {args.out}")
        return 0 if rows else 1
    raise AssertionError(args.cmd)


if __name__ == "__main__":
    sys.exit(main())
