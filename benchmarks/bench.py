"""Per-layer latency of dispatch + trivial expert + combine (+RMSNorm): NVLink backend vs XLA collectives.

One command, on the GPUs present:

    python benchmarks/bench.py all --out benchmarks/results/bench_<date>.csv

runs, in one go: N = 1 (one GPU), N = 2 with one process driving both GPUs, N = 2 with one process per GPU
(two processes under `jax.distributed`), each for T in {1, 2, 5, 8, 16, 32, 64, 128} and each backend
(`nvlink`, `xla` = the library's all_to_all backend, `xla-allgather` = all_gather + psum_scatter), inside a
jitted program of `--layers` unrolled layers; the median over `--repeats` timed samples, each `--inner`
programs enqueued back to back, divided by the layer count. A sample pays the pipeline's fill once (the host's
enqueue of its first program, 0.15-0.6 ms, and the skew between the devices' starts) before the GPU runs at
its steady rate, as a decode loop pays it once: with `--inner 20` (the default) the fill is 1/20 of a sample,
with 5 (the setting before 2026-11-30's fourth session) it added ~2 us per layer at T = 1
(`benchmarks/host_probe.py`). Each layer takes its routing from a rotating pool, so caches see fresh ids.
Rows go to the CSV (`date,device,commit,backend,ranks,tokens,metric,value`, metric `layer_us_median`, with
`mode` folded into the backend name for the one-process-two-GPU figures: `nvlink-1proc`, `xla-1proc`, ...),
and `enqueue_us_per_layer`: the host's time to enqueue the sample's programs, per layer (when it is as large as
`layer_us_median`, the host is the bottleneck).

The same run also measures, on the same machine and into the same CSV (`--stages`, all by default):
- `floor` (two or more GPUs, `nvcc` on the PATH): `benchmarks/floor.cu` compiled for the GPU's architecture: the flag
  round trip and the SM-store peer bandwidth, and from them `floor_us` of one dispatch + combine at each T
  (`floor_rows.py`: two flag round trips plus the bytes one rank sends at N = 2 at that bandwidth);
- `kernels`: `kernel_us_median`, dispatch + combine alone from CUDA-graph replays (the kernel harness, JAX-free,
  `jax_latent_ep.testing.harness --mode latency`), at each N and T, with the layer benchmark's buffer sizes: per
  layer over the steady layers of each replay (`kernel_replay_us_median`: over the whole replay, start-up included);
- `layers`: the jitted layers above, and, after every timing, for the smallest and largest T (`--count-tokens`) `launches_per_layer`:
  every kernel and copy that one program put on the GPU (the profiler's device trace), divided by the layers, and
  `our_launches_per_layer`, the NVLink backend's own kernels among them.

`python benchmarks/bench.py worker ...` is one process's share (the `all` command spawns them);
`python benchmarks/bench.py table CSV [--exclude NAME]` prints a CSV's table again, with the best XLA variant per T
and each NVLink backend's speed-up over it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import time

TOKENS = (1, 2, 5, 8, 16, 32, 64, 128)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)  # floor_rows
ROOT = os.path.dirname(HERE)


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
# One process's work.
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
    from jax_latent_ep.types import Received

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
    from jax_latent_ep import KIMI_K3
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
                "finite": ok, "launch_path": jax_latent_ep.ffi.launch_path() if backend == "nvlink" else ""}

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
# The whole run.
# ----------------------------------------------------------------------------------------------------------


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
        # Every worker's output is kept beside the CSV (a failure's cause is often in the other process).
        log = f"{os.path.splitext(args.out)[0]}.N{ranks}p{procs}_{i}.log"
        with open(log, "w") as f:
            f.write(out.stdout + "\n--- stderr ---\n" + out.stderr)
        sys.stderr.write(out.stderr[-4000:] if out.returncode else "")
        for line in out.stdout.splitlines():
            if line.startswith("RESULT "):
                results += json.loads(line[len("RESULT "):])
        if out.returncode:
            print(f"worker {i} of N={ranks} procs={procs} failed with {out.returncode}", file=sys.stderr)
    return results


def _append_rows(path, rows):
    """Appends CSV rows to `path` (the header first when the file is new), as the harness writes its rows: each stage
    writes its rows when it ends, so a run cut off later keeps what it measured."""
    from jax_latent_ep.testing.harness import _csv_rows

    _csv_rows(path, rows)


def _cuda_arch():
    """`sm_90a` / `sm_100a`: the first GPU's architecture for nvcc, as the NVLink backend picks its cubins."""
    import jax

    from jax_latent_ep.nvlink import _arch

    return _arch(jax.devices("gpu")[0])


def stage_floor(args, gpus, device, commit, date):
    """The floor rows (`floor.cu` compiled and run on GPUs 0 and 1; `floor_rows.py`): `[]` and a reason printed
    when it cannot run here."""
    import shutil
    import tempfile

    from floor_rows import floor_rows

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
    import csv

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
    shutil.copy(raw, f"{os.path.splitext(args.out)[0]}.floor_raw.csv")  # every skeleton figure, kept beside the CSV
    rows = [tuple(r) for r in floor_rows(raw_rows, date, device, commit)]
    rows = [r for r in rows if r[6] != "floor_us" or int(r[5]) in args.tokens]
    _append_rows(args.out, rows)
    return rows


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
    import csv
    import tempfile

    ranks = [r for r in (1, 2) if r <= gpus and (not args.only_ranks or r in args.only_ranks)]
    tmp = os.path.join(tempfile.mkdtemp(prefix="bench_kernels_"), "kernels.csv")
    for m, tokens in sorted(_kernel_buffers(args).items()):
        cmd = [sys.executable, "-m", "jax_latent_ep.testing.harness", "--mode", "latency", "--ranks",
               *map(str, ranks), "--max-tokens", str(m), "--latency-tokens", *map(str, tokens), "--csv", tmp,
               "--commit", commit]
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
    _append_rows(args.out, rows)
    return rows


def run_all(args):
    import jax

    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if args.cmdbuf:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"
                            " --xla_gpu_graph_min_graph_size=1").strip()
    if args.xla_flags:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + args.xla_flags).strip()
    print(f"XLA_FLAGS={env.get('XLA_FLAGS', '')!r}", flush=True)
    gpus = len([d for d in jax.devices() if d.platform == "gpu"])
    device = jax.devices()[0].device_kind if gpus else "cpu"
    commit = os.environ.get("GIT_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip() or "unknown"
    date = datetime.date.today().isoformat()
    if not gpus and "nvlink" in args.backends.split(","):
        args.backends = ",".join(b for b in args.backends.split(",") if b != "nvlink")
        print(f"nvlink: skipped (no GPU); backends {args.backends}", flush=True)
    rows = []
    plans = [(1, 1)] + ([(2, 1), (2, 2)] if gpus >= 2 else [])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    stages = args.stages.split(",")
    unknown = set(stages) - {"floor", "kernels", "layers"}
    if unknown:
        raise SystemExit(f"unknown stages {sorted(unknown)}: floor, kernels, layers")
    if "floor" in stages:
        rows += stage_floor(args, gpus, device, commit, date)
    if "kernels" in stages:
        if gpus:
            rows += stage_kernels(args, gpus, device, commit, date, env)
        else:
            print("kernels: skipped (no GPU)", flush=True)
    for ranks, procs in plans:
        if "layers" not in stages:
            break
        if args.only_ranks and ranks not in args.only_ranks:
            continue
        if args.only_procs and procs not in args.only_procs:
            continue
        new_rows = []
        for r in _run_workers(ranks, procs, args, env):
            backend = r["backend"] + ("-1proc" if ranks > 1 and procs == 1 else "") + args.tag
            for metric in ("layer_us_median", "enqueue_us_per_layer", "launches_per_layer", "our_launches_per_layer"):
                if metric in r and not (metric == "our_launches_per_layer" and not r["backend"].startswith("nvlink")):
                    new_rows.append((date, device, commit, backend, r["ranks"], r["tokens"], metric,
                                     f"{r[metric]:.2f}"))
            if "by_name" in r:
                print(f"launches per layer, {backend} N={r['ranks']} T={r['tokens']}: "
                      + ", ".join(f"{c:g} x {name[:60]}" for name, c in r["by_name"].items()), flush=True)
        _append_rows(args.out, new_rows)  # written per mode, so a cut-off run keeps what it measured
        rows += new_rows
    _print_table(rows)


def _print_table(rows, markdown=False):
    """Prints per rank count: the floor, the kernels alone and every backend's `layer_us_median` per T, the best XLA
    variant, each NVLink backend's speed-up over it, the kernels' ratio to the floor, and the launches per layer
    (where counted); with `markdown`, as markdown tables (one per rank count and kind), the README's form."""
    if markdown:
        import contextlib
        import io

        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            _print_table(rows)
        print(_markdown(text.getvalue().splitlines()))
        return
    by, launches = {}, {}
    for _, _, _, backend, ranks, tokens, metric, value in rows:
        key = {"layer_us_median": backend, "kernel_us_median": "kernels only", "floor_us": "floor"}.get(metric)
        if key is not None:
            by.setdefault((key, int(ranks)), {})[int(tokens)] = float(value)
        elif metric in ("launches_per_layer", "our_launches_per_layer"):
            name = backend + (" (ours)" if metric.startswith("our") else "")
            launches.setdefault((name, int(ranks)), {})[int(tokens)] = float(value)
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
    """The fixed-width lines of `_print_table` as markdown tables: a header line ("backend ... N T=1 ...") starts a
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
        title = f"{kind} (N = {ranks})"
        out.append(f"| {title} | " + " | ".join(header) + " |")
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
    """Lines of the best XLA variant per T (any `xla*` backend of the run, either process mode) and of each NVLink
    backend's speed-up over it, per rank count. `by`: {(backend, ranks): {T: us}}."""
    width = width or _name_width(by)
    lines = []
    for ranks in sorted({r for _, r in by}):
        xla = [v for (b, r), v in by.items() if r == ranks and b.startswith("xla")]
        if not xla:
            continue
        best = {t: min(v[t] for v in xla if t in v) for t in tokens if any(t in v for v in xla)}
        lines.append("best xla".ljust(width) + f"{ranks} "
                     + "".join(f"{best.get(t, float('nan')):9.1f}" for t in tokens))
        for (b, r), v in sorted(by.items()):
            if r == ranks and b.startswith("nvlink"):
                lines.append(f"speed-up of {b}".ljust(width) + f"{ranks} " + "".join(
                    f"{best[t] / v[t]:8.1f}x" if t in v and t in best else f"{'nan':>9}" for t in tokens))
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("all", "worker"):
        p = sub.add_parser(name)
        p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=list(TOKENS))
        p.add_argument("--layers", type=int, default=48)
        p.add_argument("--repeats", type=int, default=20, help="timed samples (the median is reported)")
        p.add_argument("--inner", type=int, default=20, help="programs enqueued back to back per sample")
        p.add_argument("--backends", default="nvlink,xla,xla-allgather")
        p.add_argument("--max-tokens", type=int, default=0,
                       help="receive-buffer size: 0 = the largest T of the run, -1 = each T its own, N = N")
        p.add_argument("--count-tokens", type=lambda s: [] if s == "none" else [int(v) for v in s.split(",")],
                       default=None, help="T at which launches per layer are counted (default: the smallest and "
                                          "largest T; 'none': never)")
    sub.choices["all"].add_argument("--out", default=os.path.join(HERE, "results", "bench.csv"))
    sub.choices["all"].add_argument("--timeout", type=int, default=900)
    sub.choices["all"].add_argument("--only-ranks", type=lambda s: [int(v) for v in s.split(",")], default=None)
    sub.choices["all"].add_argument("--only-procs", type=lambda s: [int(v) for v in s.split(",")], default=None)
    sub.choices["all"].add_argument("--no-cmdbuf", dest="cmdbuf", action="store_false",
                                    help="leave XLA's command-buffer settings at their defaults")
    sub.choices["all"].add_argument("--xla-flags", default="", help="more XLA_FLAGS for every worker")
    sub.choices["all"].add_argument("--tag", default="", help="appended to every backend name in the CSV")
    sub.choices["all"].add_argument("--stages", default="floor,kernels,layers",
                                    help="comma-separated: floor (floor.cu), kernels (kernel harness), layers (jit)")
    t = sub.add_parser("table", help="print the table (and the speed-ups) of CSVs written by `all`")
    t.add_argument("csv", nargs="+", help="one or more CSVs, read as one (the best XLA variant is over all of them)")
    t.add_argument("--exclude", default="", help="leave out backends whose name contains this")
    t.add_argument("--markdown", action="store_true", help="markdown tables (the README's form)")
    w = sub.choices["worker"]
    w.add_argument("--ranks", type=int, required=True)
    w.add_argument("--num-processes", type=int, default=1)
    w.add_argument("--process-id", type=int, default=0)
    w.add_argument("--coordinator", default=None)
    args = parser.parse_args()
    if args.cmd == "worker":
        worker(args)
    elif args.cmd == "table":
        import csv

        rows = []
        for path in args.csv:
            with open(path) as f:
                rows += [tuple(r[k] for k in ("date", "device", "commit", "backend", "ranks", "tokens", "metric", "value"))
                         for r in csv.DictReader(f) if not (args.exclude and args.exclude in r["backend"])]
        _print_table(rows, markdown=args.markdown)
    else:
        run_all(args)


if __name__ == "__main__":
    main()
