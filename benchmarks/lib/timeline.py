"""Where a jitted layer's time goes on the GPU: the profiler's kernel timeline of a few back-to-back programs.

Builds the benchmark's program (bench.py: dispatch + trivial expert + combine + RMSNorm per layer, unrolled),
traces `--programs` executions with `jax.profiler` (CUPTI), and prints per kernel name its count and median
duration, the GPU span per layer (first kernel start to last kernel end over the traced programs, divided by
the layers), the busy time per layer (sum of kernel durations) and the idle gaps between kernels of one
program and between programs, plus the host events that took longest (command-buffer updates show there).

    python benchmarks/lib/timeline.py --ranks 1 --tokens 1 --backend nvlink [--layers 32 --programs 5]
"""

from __future__ import annotations

import argparse
import collections
import glob
import statistics
import tempfile


def make_program(n: int, t: int, layers: int, backend: str):
    """The benchmark's jitted program on the first `n` devices (T = `t`, `layers` layers unrolled):
    returns `(fn, x, rest, close)`; call `x = fn(x, *rest)` (x is donated)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jax_latent_ep
    from jax_latent_ep.shapes import KIMI_K3

    shape = KIMI_K3
    mesh = jax.make_mesh((n,), ("ep",), devices=jax.devices()[:n], axis_types=(jax.sharding.AxisType.Explicit,))
    ep = jax_latent_ep.ExpertParallel(mesh, axis_name="ep", max_tokens=t, shape=shape, backend=backend)
    rng = np.random.default_rng(0)
    pool = 8
    ids = np.stack([np.stack([rng.choice(shape.experts, shape.topk, replace=False) for _ in range(n * t)])
                    for _ in range(pool)]).astype(np.int32)
    weights = rng.random((pool, n * t, shape.topk), dtype=np.float32)
    shard, repl = NamedSharding(mesh, P("ep")), NamedSharding(mesh, P())
    x = jax.device_put(rng.standard_normal((n * t, shape.latent)).astype(jnp.bfloat16), shard)
    ids_d = tuple(jax.device_put(a, shard) for a in ids)
    w_d = tuple(jax.device_put(a, shard) for a in weights)
    nw = jax.device_put((1 + 0.1 * rng.standard_normal(shape.latent)).astype(jnp.bfloat16), repl)

    def program(x, ids, weights, norm_w):
        for layer in range(layers):
            i, w = ids[layer % pool], weights[layer % pool]
            recv = ep.dispatch(x, i, w)
            x = ep.combine(recv.x.astype(jnp.bfloat16), i, norm_w, eps=1e-5)
        return x

    fn = jax.jit(jax.shard_map(program, mesh=mesh, in_specs=(P("ep"), (P("ep"),) * pool, (P("ep"),) * pool, P()),
                               out_specs=P("ep"), check_vma=False), donate_argnums=(0,))
    return fn, x, (ids_d, w_d, nw), ep.close


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--programs", type=int, default=5)
    parser.add_argument("--backend", default="nvlink")
    parser.add_argument("--show", type=int, default=12, help="kernels of the first traced layer to list")
    parser.add_argument("--host-events", type=int, default=14, help="host event names to list (by total time)")
    args = parser.parse_args()

    import jax

    n, t = args.ranks, args.tokens
    fn, x, rest, close = make_program(n, t, args.layers, args.backend)
    for _ in range(5):
        x = fn(x, *rest)
    x.block_until_ready()
    trace_dir = tempfile.mkdtemp(prefix="timeline_")
    with jax.profiler.trace(trace_dir):
        for _ in range(args.programs):
            x = fn(x, *rest)
        x.block_until_ready()
    close()

    path = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
    data = jax.profiler.ProfileData.from_file(path)
    layers = args.programs * args.layers
    print(f"N={n} T={t} backend={args.backend} layers/program={args.layers} programs={args.programs}")
    for plane in data.planes:
        if "GPU:0" not in plane.name and "/host:CPU" not in plane.name:
            continue
        events = [(e.name, e.start_ns, e.duration_ns) for line in plane.lines for e in line.events]
        if not events:
            continue
        if "GPU" in plane.name:
            kernels = sorted((s, d, name) for name, s, d in events if d > 0)
            by_name = collections.defaultdict(list)
            for s, d, name in kernels:
                by_name[name].append(d)
            print(f"{plane.name}: {len(kernels)} events on lines {[line.name for line in plane.lines]}")
            for name, ds in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]:
                print(f"  {len(ds):6d} x {statistics.median(ds) / 1e3:8.2f} us median  {name[:90]}")
            span = kernels[-1][0] + kernels[-1][1] - kernels[0][0]
            busy = sum(d for _, d, _ in kernels)
            gaps = [b[0] - (a[0] + a[1]) for a, b in zip(kernels, kernels[1:])]
            print(f"  per layer: GPU span {span / layers / 1e3:.2f} us, kernels busy {busy / layers / 1e3:.2f} us, "
                  f"gap median {statistics.median(gaps) / 1e3:.2f} us, gaps > 20 us: "
                  f"{[round(g / 1e3, 1) for g in gaps if g > 20e3][:12]}")
            start = kernels[0][0]
            for s, d, name in kernels[: args.show]:
                print(f"    +{(s - start) / 1e3:9.2f} us  {d / 1e3:7.2f} us  {name[:70]}")
        else:
            total = collections.defaultdict(lambda: [0, 0])
            for name, _, d in events:
                total[name][0] += 1
                total[name][1] += d
            print(f"{plane.name}: host events with the most time")
            for name, (count, d) in sorted(total.items(), key=lambda kv: -kv[1][1])[:args.host_events]:
                print(f"  {count:6d} x {d / count / 1e3:9.2f} us = {d / 1e6:8.2f} ms  {name[:90]}")


if __name__ == "__main__":
    main()
