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
    show = args.process_id == 0
    it = _progress(combos, len(combos), f"N={n} procs={args.num_processes}") if show else combos
    for backend, t in it:
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
        results.append({"backend": backend, "ranks": n, "tokens": t, "procs": args.num_processes,
                        "max_tokens": max_tokens,
                        "layer_us_median": float(np.median(times)), "layer_us_min": float(np.min(times)),
                        "enqueue_us_per_layer": float(np.median(enqueue)),
                        "finite": ok, "launch_path": jax_latent_ep.ffi.launch_path() if backend == "nvlink" else ""})
        ep.close()
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
           "--repeats", str(args.repeats), "--inner", str(args.inner), "--backends", args.backends, "--max-tokens", str(args.max_tokens)]
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
    rows = []
    plans = [(1, 1)] + ([(2, 1), (2, 2)] if gpus >= 2 else [])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for ranks, procs in plans:
        if args.only_ranks and ranks not in args.only_ranks:
            continue
        if args.only_procs and procs not in args.only_procs:
            continue
        new_rows = []
        for r in _run_workers(ranks, procs, args, env):
            backend = r["backend"] + ("-1proc" if ranks > 1 and procs == 1 else "") + args.tag
            for metric in ("layer_us_median", "enqueue_us_per_layer"):
                new_rows.append((date, device, commit, backend, r["ranks"], r["tokens"], metric, f"{r[metric]:.2f}"))
        new = not os.path.exists(args.out)
        with open(args.out, "a") as f:  # written per mode, so a cut-off run keeps what it measured
            if new:
                f.write("date,device,commit,backend,ranks,tokens,metric,value\n")
            for row in new_rows:
                f.write(",".join(map(str, row)) + "\n")
        rows += new_rows
    _print_table(rows)


def _print_table(rows):
    by = {}
    for _, _, _, backend, ranks, tokens, metric, value in rows:
        if metric != "layer_us_median":
            continue
        by.setdefault((backend, ranks), {})[int(tokens)] = float(value)
    tokens = sorted({int(r[5]) for r in rows})
    width = _name_width(by)
    print("backend".ljust(width) + "N " + "".join(f"T={t}".rjust(9) for t in tokens))
    for (backend, ranks), vals in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(backend.ljust(width) + f"{ranks} " + "".join(f"{vals.get(t, float('nan')):9.1f}" for t in tokens))
    for line in _speedups(by, tokens, width):
        print(line)


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
    sub.choices["all"].add_argument("--out", default=os.path.join(HERE, "results", "bench.csv"))
    sub.choices["all"].add_argument("--timeout", type=int, default=900)
    sub.choices["all"].add_argument("--only-ranks", type=lambda s: [int(v) for v in s.split(",")], default=None)
    sub.choices["all"].add_argument("--only-procs", type=lambda s: [int(v) for v in s.split(",")], default=None)
    sub.choices["all"].add_argument("--no-cmdbuf", dest="cmdbuf", action="store_false",
                                    help="leave XLA's command-buffer settings at their defaults")
    sub.choices["all"].add_argument("--xla-flags", default="", help="more XLA_FLAGS for every worker")
    sub.choices["all"].add_argument("--tag", default="", help="appended to every backend name in the CSV")
    t = sub.add_parser("table", help="print the table (and the speed-ups) of a CSV written by `all`")
    t.add_argument("csv")
    t.add_argument("--exclude", default="", help="leave out backends whose name contains this")
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

        with open(args.csv) as f:
            rows = [tuple(r[k] for k in ("date", "device", "commit", "backend", "ranks", "tokens", "metric", "value"))
                    for r in csv.DictReader(f) if not (args.exclude and args.exclude in r["backend"])]
        _print_table(rows)
    else:
        run_all(args)


if __name__ == "__main__":
    main()
