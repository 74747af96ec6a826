"""The FP8 grouped matmul (`experts.grouped.gmm_fp8`) at decode sizes on one GPU, against the floor of its weight
bytes: a program of `--layers` layers (fewer where their weights pass `--weights-gb`), each its own FP8 weights, each layer gate-up (`[J, 2I, L]`), the SwiGLU with
its MXFP8 rounding in XLA, and down (`[J, L, I]`) on the pairs rank 0 holds under uniform routing.

    python benchmarks/fp8_matmul.py [--out fp8_matmul.csv] [--points 448,2048 112,512 ...] [--tokens 1 8 32 128]
    python benchmarks/fp8_matmul.py --smoke     # tiny shapes, impl "xla", CPU is fine

A point `J,I` at T tokens a rank: `T * K` pairs (K = 16) spread uniformly over the J local experts (as rank 0 of
N = 896 / J receives them), L = 3584. Floor: the active experts' weight bytes (1 a weight, plus the block scales)
at the run's best HBM stream (`expert_stage.hbm_gbps`) and at the H200's 4.8 TB/s. Rows (`backend`
`fp8_matmul/J<J>_I<I>/<impl>`): `wall_us` (one blocking call, per layer), `pipelined_us` (calls back to back),
`device_us` (the profiler's GPU busy time, per layer), `floor_us`, `floor_spec_us`, `active_experts`.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from expert_stage import _time, _time_pipelined, device_times, hbm_gbps, write_rows  # noqa: E402

LATENT, TOPK, SPEC_GBPS = 3584, 16, 4800.0


def measure(j, inter, t, impl, layers, repeats, best_gbps, seed=0):
    """Rows of one point."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_latent_ep.experts.grouped import gmm_fp8
    from jax_latent_ep.numerics import mxfp8_quantize

    rng = np.random.default_rng(seed)
    pairs = t * TOPK
    sizes = np.bincount(rng.integers(0, j, pairs), minlength=j).astype(np.int32)
    active = int(np.sum(sizes > 0))
    keys = iter(jax.random.split(jax.random.key(seed), 4 * layers + 1))

    def weights(n, k):
        values = jax.random.normal(next(keys), (j, n, k), jnp.float32).astype(jnp.float8_e4m3fn)
        return values, jnp.full((j, n // 128, k // 128), k ** -0.5 / 2, jnp.float32)

    ws = [(weights(2 * inter, LATENT), weights(LATENT, inter)) for _ in range(layers)]
    x, sf = mxfp8_quantize(jax.random.normal(next(keys), (pairs, LATENT), jnp.bfloat16))
    gs = jnp.asarray(sizes)

    def program(x, sf, ws):
        for (wgu, sgu), (wd, sd) in ws:
            gu = gmm_fp8(x, sf, wgu, sgu, gs, impl=impl)
            h = (jax.nn.silu(gu[:, :inter]) * gu[:, inter:]).astype(jnp.bfloat16)
            y = gmm_fp8(*mxfp8_quantize(h), wd, sd, gs, impl=impl)
            x, sf = mxfp8_quantize(y.astype(jnp.bfloat16))
        return x, sf

    fn = jax.jit(program)
    args = (x, sf, ws)
    wall = _time(fn, args, repeats) / layers
    pipelined = _time_pipelined(fn, args, repeats)[0] / layers
    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    busy = device_times(fn, args)[0] / layers / 1e6 if on_gpu else float("nan")
    nbytes = active * 3 * inter * LATENT * (1 + 4 / 128 / 128)
    floor, floor_spec = nbytes / (best_gbps * 1e9), nbytes / (SPEC_GBPS * 1e9)
    print(f"J={j:3d} I={inter:4d} T={t:3d} {impl}: wall {wall * 1e6:8.1f} us ({wall / floor:5.2f}x), pipelined "
          f"{pipelined * 1e6:8.1f} ({pipelined / floor:5.2f}x; {pipelined / floor_spec:5.2f}x at 4.8 TB/s), device "
          f"{busy * 1e6:8.1f} ({busy / floor:5.2f}x), floor {floor * 1e6:.1f} us, {active} experts", flush=True)
    b = f"fp8_matmul/J{j}_I{inter}/{impl}"
    rows = [(b, t, "wall_us", wall * 1e6), (b, t, "pipelined_us", pipelined * 1e6), (b, t, "floor_us", floor * 1e6),
            (b, t, "floor_spec_us", floor_spec * 1e6), (b, t, "active_experts", active)]
    return rows + [(b, t, "device_us", busy * 1e6)] * on_gpu


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="fp8_matmul.csv")
    p.add_argument("--points", nargs="+", default=["448,2048", "448,512", "112,2048", "112,512"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32, 128])
    p.add_argument("--impls", nargs="+", default=["wgmma"])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--weights-gb", type=float, default=48.0, help="the most weight bytes a program holds (an H100)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    global LATENT
    if args.smoke:
        LATENT = 256
        args.points, args.tokens, args.impls, args.layers, args.repeats = ["4,128"], [2], ["xla"], 2, 1
    import jax

    on_gpu = any(d.platform == "gpu" for d in jax.devices())
    best = hbm_gbps(1 << 30, 5) if on_gpu else SPEC_GBPS
    print(f"best stream {best:.0f} GB/s", flush=True)
    rows = [("fp8_matmul/hbm", 0, "best_GBps", best)]
    for point in args.points:
        j, inter = (int(v) for v in point.split(","))
        for t in args.tokens:
            for impl in args.impls:
                per_layer = 3 * j * inter * LATENT * (1 + 4 / 128**2)  # FP8 values and their block scales
                layers = max(1, min(args.layers, int(args.weights_gb * 2**30 // per_layer)))
                rows += measure(j, inter, t, impl, layers, args.repeats, best)
                write_rows(args.out, jax.devices()[0].device_kind, [(b, 1, tk, m, v) for b, tk, m, v in rows])


if __name__ == "__main__":
    main()
