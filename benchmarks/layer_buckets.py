"""Token buckets: a serving `MoELayer` at small T against a layer built for that T alone, and one without buckets.

    python benchmarks/layer_buckets.py [--out layer_buckets.csv] [--tokens 1 8] [--max-tokens 128] [--layers 12]
    python benchmarks/layer_buckets.py --smoke          # tiny shapes, CPU is fine (the CI test runs this)

Three layers of the same sizes (by default DeepSeek-V3's shipped kernel shape: hidden 7168 = `L`, 256 experts,
top-8, a small I; sigmoid + bias group-limited top-k, a shared expert) on one device: `served`, buckets up to
`--max-tokens` (powers of two); `alone`, built for the call's T; `unbucketed`, built for `--max-tokens` with that
one bucket (every call pays for the largest). Each is a jitted
program of `--layers` layers with their own weights, timed as wall time per layer (median of `--repeats`), every
call waited for (`us_per_layer`) and calls issued back to back (`us_per_layer_b2b`); `ratio` is served / alone
(the target: within 1.1 at T = 1). On GPUs the nvlink backend at N = 1 and `--impl kernel`; elsewhere xla and
ragged_dot. CSV rows `date,device,commit,backend,ranks,tokens,metric,value`, backend `layer_buckets/<layer>/<impl>`.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from expert_stage import _time, _time_pipelined, write_rows  # noqa: E402  (benchmarks/ is on the path as a script)


def make_params(args, layers):
    """Random bf16 weights of `layers` layers, made on the device (no host copy of the experts)."""
    import jax
    import jax.numpy as jnp

    d, e, i, s = args.hidden, args.experts, args.intermediate, args.intermediate

    def normal(key, shape, fan_in):
        return (jax.random.normal(key, shape, jnp.float32) / fan_in**0.5).astype(jnp.bfloat16)

    out = []
    for li in range(layers):
        k = jax.random.split(jax.random.key(200 + li), 8)
        out.append({"router": normal(k[0], (d, e), d), "router_bias": 0.05 * jax.random.normal(k[1], (e,)),
                    "w_gate": normal(k[2], (e, d, i), d), "w_up": normal(k[3], (e, d, i), d),
                    "w_down": normal(k[4], (e, i, d), i), "shared_gate": normal(k[5], (d, s), d),
                    "shared_up": normal(k[6], (d, s), d), "shared_down": normal(k[7], (s, d), s)})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default="layer_buckets.csv")
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--impl", default=None, help="the expert stage's implementation (default: kernel on GPUs)")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.experts, args.topk, args.intermediate = 64, 16, 4, 64
        args.tokens, args.max_tokens, args.layers, args.repeats = [1, 2], 8, 2, 2

    import jax
    import jax.numpy as jnp

    from jax_latent_ep.layer import MoELayer
    from jax_latent_ep.routers import SigmoidGroupTopK

    dev = jax.devices()[0]
    gpu = dev.platform == "gpu"
    impl = args.impl or ("kernel" if gpu else "ragged_dot")
    backend = "nvlink" if gpu else "xla"
    mesh = jax.make_mesh((1,), ("ep",), devices=[dev])
    router = SigmoidGroupTopK(args.topk, n_group=4, topk_group=2, routed_scaling_factor=2.5)

    def layer(max_tokens, buckets=None):
        return MoELayer(mesh, hidden=args.hidden, experts=args.experts, topk=args.topk,
                        intermediate=args.intermediate, router=router, shared_intermediate=args.intermediate,
                        max_tokens=max_tokens, buckets=buckets, impl=impl, backend=backend)

    def program(lay):
        def run(ps, x):
            for prm in ps:
                x = (x.astype(jnp.float32) + lay(x, prm).astype(jnp.float32)).astype(jnp.bfloat16)
            return x
        return jax.jit(run)

    params = make_params(args, args.layers)
    served, unbucketed = layer(args.max_tokens), layer(args.max_tokens, [args.max_tokens])
    rows = []
    for t in args.tokens:
        x = jax.random.normal(jax.random.key(t), (t, args.hidden), jnp.float32).astype(jnp.bfloat16)
        res = {}
        for name, lay in (("served", served), ("alone", layer(t)), ("unbucketed", unbucketed)):
            fn = program(lay)
            waited = 1e6 * _time(fn, (params, x), args.repeats) / args.layers
            b2b = 1e6 * _time_pipelined(fn, (params, x), args.repeats)[0] / args.layers
            res[name] = (waited, b2b)
            rows += [(f"layer_buckets/{name}/{impl}", t, "us_per_layer", waited),
                     (f"layer_buckets/{name}/{impl}", t, "us_per_layer_b2b", b2b)]
        for i, what in enumerate(("us_per_layer", "us_per_layer_b2b")):
            rows.append((f"layer_buckets/served_over_alone/{impl}", t, f"ratio{what[12:]}",
                         res["served"][i] / res["alone"][i]))
        print(f"T={t:4d} {impl}: served {res['served'][0]:8.1f} us ({res['served'][1]:8.1f} back to back), alone "
              f"{res['alone'][0]:8.1f} ({res['alone'][1]:8.1f}), unbucketed {res['unbucketed'][0]:8.1f} "
              f"({res['unbucketed'][1]:8.1f}); served / alone {res['served'][0] / res['alone'][0]:.3f} "
              f"({res['served'][1] / res['alone'][1]:.3f})", flush=True)
    write_rows(args.out, dev.device_kind if gpu else "cpu", [(name, 1, t, m, v) for name, t, m, v in rows])


if __name__ == "__main__":
    main()
