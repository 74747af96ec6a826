"""The expert stage's memory at training and prefill sizes: compiled temporaries of the "scan" stage's forward and
gradient (XLA:CPU's memory analysis; nothing runs), beside the weights, at Kimi K3 and K2 sizes.

    python benchmarks/stage_memory.py [--out stage_memory.csv] [--tokens 128 1024 4096 8192] [--factor 1.25]
    python benchmarks/stage_memory.py --smoke

Per rank of N = 8: K3 (J = 112 local experts, L = 3584, I = 2048, K = 16), K2 (J = 48, L = 7168, I = 2048, K = 8);
T tokens a rank, the plan's capacity `capacity(N, T, K, J, factor)` (and the worst case, `--factor 0`). Rows
`date,device,commit,backend,ranks,tokens,metric,value`, backend `stage_memory/<model>/f<factor>`, metrics
`weights_GB`, `fwd_temp_GB`, `grad_temp_GB`, `capacity_pairs`.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from expert_stage import write_rows  # noqa: E402  (benchmarks/ is on the path when run as a script)

MODELS = {"k3": dict(j=112, lat=3584, inter=2048, k=16), "k2": dict(j=48, lat=7168, inter=2048, k=8)}


def temporaries(n, t, j, lat, inter, k, factor):
    """(capacity, forward bytes, gradient bytes) of the compiled scan stage."""
    import jax
    import jax.numpy as jnp

    from jax_latent_ep.experts import capacity, swiglu_rows
    from jax_latent_ep.experts.planning import Plan

    cap, rows, m = capacity(n, t, k, j, factor or None), n * t, min(k, j)
    s = jax.ShapeDtypeStruct
    pl = Plan(s((cap,), jnp.int32), s((cap,), jnp.int32), s((cap,), jnp.float32), s((j,), jnp.int32),
              s((), jnp.int32), s((rows, m), jnp.int32))
    xb = s((rows, lat), jnp.bfloat16)
    w = (s((j, lat, inter), jnp.bfloat16), s((j, lat, inter), jnp.bfloat16), s((j, inter, lat), jnp.bfloat16))
    stage = lambda pl, xb, *w: swiglu_rows(pl, xb, *w, impl="scan")  # noqa: E731
    fwd = jax.jit(stage).lower(pl, xb, *w).compile().memory_analysis().temp_size_in_bytes
    loss = lambda xb, wg, wu, wd, pl: jnp.sum(stage(pl, xb, wg, wu, wd).astype(jnp.float32))  # noqa: E731
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(xb, *w, pl).compile()
    return cap, fwd, grad.memory_analysis().temp_size_in_bytes


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="stage_memory.csv")
    p.add_argument("--tokens", nargs="+", type=int, default=[128, 1024, 4096, 8192])
    p.add_argument("--factor", nargs="+", type=float, default=[1.25, 0])
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    models = MODELS
    if args.smoke:
        models = {"tiny": dict(j=4, lat=128, inter=64, k=4)}
        args.tokens, args.factor = [8], [1.25]
    n, rows = 8, []
    for name, c in models.items():
        weights = 3 * c["j"] * c["lat"] * c["inter"] * 2
        for factor in args.factor:
            for t in args.tokens:
                cap, fwd, grad = temporaries(n, t, c["j"], c["lat"], c["inter"], c["k"], factor)
                print(f"{name} f={factor or 'worst'} T={t:5d}: capacity {cap:7d} pairs, weights {weights / 1e9:5.1f} "
                      f"GB, forward {fwd / 1e9:6.1f} GB, gradient {grad / 1e9:6.1f} GB", flush=True)
                rows += [(f"stage_memory/{name}/f{factor or 'worst'}", t, m, v) for m, v in (
                    ("capacity_pairs", cap), ("weights_GB", weights / 1e9), ("fwd_temp_GB", fwd / 1e9),
                    ("grad_temp_GB", grad / 1e9))]
    write_rows(args.out, "cpu", [(backend, n, t, metric, v) for backend, t, metric, v in rows])


if __name__ == "__main__":
    main()
