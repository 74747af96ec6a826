"""Host or GPU: how long the host takes to enqueue one execution of the benchmark's jitted program, against
the wall time per program when executions run back to back.

For each backend and layer count: `--programs` executions enqueued back to back (JAX dispatches
asynchronously), the time at which each call returned, then one wait. If the enqueue time per program is
close to the wall time per program, the host is the bottleneck (the GPU idles between programs); if it is
far below, the GPU is.

    python benchmarks/host_probe.py --ranks 2 --tokens 1 --backends nvlink,xla --layers 32,64
"""

from __future__ import annotations

import argparse
import statistics
import time

from timeline import make_program


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--layers", default="32")
    parser.add_argument("--programs", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backends", default="nvlink,xla")
    args = parser.parse_args()
    print(f"{'backend':<8} {'N':>2} {'T':>4} {'layers':>6} {'enqueue us/program':>19} {'wall us/program':>16} "
          f"{'wall us/layer':>14}")
    for backend in args.backends.split(","):
        for layers in (int(v) for v in args.layers.split(",")):
            fn, x, rest, close = make_program(args.ranks, args.tokens, layers, backend)
            for _ in range(5):
                x = fn(x, *rest)
            x.block_until_ready()
            from jax_latent_ep import ffi

            counts = ffi.record_counts() if backend == "nvlink" else (0, 0)
            enqueue, wall = [], []
            for _ in range(args.repeats):
                start = time.perf_counter()
                for _ in range(args.programs):
                    x = fn(x, *rest)
                queued = time.perf_counter()
                x.block_until_ready()
                done = time.perf_counter()
                enqueue.append((queued - start) / args.programs * 1e6)
                wall.append((done - start) / args.programs * 1e6)
            after = ffi.record_counts() if backend == "nvlink" else (0, 0)
            close()
            e, w = statistics.median(enqueue), statistics.median(wall)
            runs = args.repeats * args.programs
            print(f"{backend:<8} {args.ranks:>2} {args.tokens:>4} {layers:>6} {e:19.1f} {w:16.1f} {w / layers:14.2f}"
                  f"   record creates/updates per program: {(after[0] - counts[0]) / runs:.1f} / "
                  f"{(after[1] - counts[1]) / runs:.1f}", flush=True)


if __name__ == "__main__":
    main()
