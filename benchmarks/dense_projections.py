"""A decode step's dense projections alone: Kimi K3's router and down projection (one weight, 7168 -> 896 + 3584)
and its up projection (3584 -> 7168), bf16, each layer its own weights, against the bytes of those weights.

    python benchmarks/dense_projections.py [--out dense_projections.csv] [--tokens 1 8 32 128]
        [--impls kernel xla] [--min-units 0 264 528 1056] [--device-time]
    python benchmarks/dense_projections.py --smoke     # tiny shapes, CPU is fine (the CI test runs this)

Each point is a jitted program of `--layers` layers, `h += up(bf16(y[:, E:]))` with `y = h @ router_down` in FP32 (the
logits `y[:, :E]` summed into a second output so that nothing is dropped), through `dense.matmul(impl=...)`; for
`kernel` each `--min-units` value sets `dense.KERNEL_MIN_UNITS` (0: its default), so the contraction splits
and the split partials' sum are what the layer runs. Timed as `k3_layer.py` times the layer: waited for
(`us_per_layer`), issued back to back (`pipelined_us_per_layer`), with `--device-time` the GPU's kernel time
(`device_us_per_layer`); the floor is the weights' bytes over the best stream measured in the same run
(`floor_us`, `hbm_GBps`) and over the H200's 4.8 TB/s (`floor_spec_us`); `ratio` = back to back / floor. CSV rows
`date,device,commit,backend,ranks,tokens,metric,value`, backend `dense/<impl>[/units<U>]`, with the splits of each
weight (`splits_router_down`, `splits_up`).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from expert_stage import _commit, _time, _time_pipelined, device_us, hbm_gbps  # noqa: E402  (benchmarks/ on the path)
from k3_layer import SPEC_BYTES_PER_S, _write_csv  # noqa: E402


def program(t: int, experts: int, impl: str):
    """The jitted layers: `(router_downs, ups, h) -> (h, summed logits)`."""
    import jax
    import jax.numpy as jnp

    from jax_latent_ep import dense

    def layers(router_downs, ups, h):
        logits = jnp.zeros((t, experts), jnp.float32)
        for router_down, up in zip(router_downs, ups):
            y = dense.matmul(h, router_down, impl=impl, out_dtype=jnp.float32)
            logits = logits + y[:, :experts]
            h = h + dense.matmul(y[:, experts:].astype(jnp.bfloat16), up, impl=impl)
        return h, logits

    return jax.jit(layers)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default="dense_projections.csv")
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32, 128])
    p.add_argument("--impls", nargs="+", default=["kernel", "xla"], choices=["kernel", "xla"])
    p.add_argument("--min-units", nargs="+", type=int, default=[0],
                   help="kernel: `dense.KERNEL_MIN_UNITS` values to time (0: its default)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--latent", type=int, default=3584)
    p.add_argument("--experts", type=int, default=896)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device-time", action="store_true", help="also the GPU's kernel time per layer")
    p.add_argument("--hbm-bytes", type=int, default=2 << 30)
    args = p.parse_args(argv)
    if any(u < 0 for u in args.min_units):
        p.error(f"--min-units {args.min_units}: give positive numbers of units, or 0 for the default rule")

    import jax
    import jax.numpy as jnp

    from jax_latent_ep import dense
    from jax_latent_ep.experts.kernel import KERNEL_MIN_UNITS, _kernel_splits
    from jax_latent_ep.kernels import abi

    default_units = dense.KERNEL_MIN_UNITS
    gpu = jax.devices()[0].platform == "gpu"
    if args.smoke:
        args.hidden, args.latent, args.experts, args.tokens, args.layers, args.repeats = 128, 64, 64, [2], 2, 1
        args.hbm_bytes = 1 << 22
    impls = [i for i in args.impls if gpu or i == "xla"]  # the kernel needs a GPU
    device = jax.devices()[0].device_kind if gpu else "cpu"
    hid, lat, e = args.hidden, args.latent, args.experts
    key = jax.random.key(0)
    normal = lambda k, shape, fan: (jax.random.normal(k, shape, jnp.float32) / fan**0.5).astype(jnp.bfloat16)  # noqa: E731
    router_downs = [normal(jax.random.fold_in(key, i), (hid, e + lat), hid) for i in range(args.layers)]
    ups = [normal(jax.random.fold_in(key, 1000 + i), (lat, hid), lat) for i in range(args.layers)]
    nbytes = 2.0 * (hid * (e + lat) + lat * hid)
    bw = hbm_gbps(args.hbm_bytes, args.repeats) * 1e9
    rows = [("dense/hbm", 1, 0, "hbm_GBps", bw / 1e9)]
    print(f"best stream {bw / 1e9:.0f} GB/s; weights {nbytes / 1e6:.1f} MB a layer, floor {1e6 * nbytes / bw:.1f} us",
          flush=True)
    for t in args.tokens:
        h = jax.random.normal(jax.random.key(t), (t, hid), jnp.float32).astype(jnp.bfloat16)
        for impl in impls:
            for units in (args.min_units if impl == "kernel" else [0]):
                dense.KERNEL_MIN_UNITS = units or default_units
                fn = program(t, e, impl)
                fargs = (router_downs, ups, h)
                res = {"us_per_layer": 1e6 * _time(fn, fargs, args.repeats) / args.layers,
                       "pipelined_us_per_layer": 1e6 * _time_pipelined(fn, fargs, args.repeats)[0] / args.layers}
                if args.device_time and gpu:
                    res["device_us_per_layer"] = device_us(fn, fargs) / args.layers
                res["floor_us"], res["floor_spec_us"] = 1e6 * nbytes / bw, 1e6 * nbytes / SPEC_BYTES_PER_S
                res["ratio"] = res["pipelined_us_per_layer"] / res["floor_us"]
                target = units or default_units or KERNEL_MIN_UNITS
                if impl == "kernel":
                    items = -(-t // abi.GEMM_BLOCK_M)  # `dense`'s work items: one per 64 rows
                    res["splits_router_down"] = _kernel_splits(items, e + lat, hid, min_units=target)[0]
                    res["splits_up"] = _kernel_splits(items, hid, lat, min_units=target)[0]
                name = f"dense/{impl}" + (f"/units{target}" if impl == "kernel" else "")
                rows += [(name, 1, t, m, v) for m, v in res.items()]
                _write_csv(args.out, rows, device, _commit())  # each point on disk as it comes
                gpu_part = f", GPU {res['device_us_per_layer']:.1f}" if "device_us_per_layer" in res else ""
                print(f"T={t:4d} {name:22s} {res['us_per_layer']:8.1f} us waited, {res['pipelined_us_per_layer']:8.1f}"
                      f" back to back{gpu_part} ({res['ratio']:.2f}x floor)", flush=True)
                jax.clear_caches()
    dense.KERNEL_MIN_UNITS = default_units
    print(f"wrote {args.out} ({len(rows)} rows; {device}, commit {_commit()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
