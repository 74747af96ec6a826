"""What MXFP8 dispatch costs in accuracy: the layer's error against a float64 bf16 layer, beside bf16's own.

    python benchmarks/mxfp8_error.py [--out mxfp8_error.csv] [--hidden 7168] [--tokens 64]

Runs on the CPU (the XLA backend: the kernels' bits). For each configuration (DeepSeek-V3 / Kimi K2 style, L =
hidden, with and without the shared expert; K3 style, a 3584 latent with the norm), the relative L2 error over
the tokens, against the float64 NumPy model of the same layer whose dispatched rows stay bf16 (`mx=False`), of:
`layer` (MXFP8 rows: what users run) and `model_mxfp8` (the float64 model with MXFP8 rows: the rounding alone).
Rows `date,device,commit,backend,ranks,tokens,metric,value` with backend `mxfp8_error/<config>`.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from expert_stage import write_rows  # noqa: E402  (benchmarks/ is on the path when run as a script)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="mxfp8_error.csv")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.experts, args.intermediate, args.tokens = 256, 16, 128, 4

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_latent_ep import routers
    from jax_latent_ep.layer import MoELayer
    from jax_latent_ep.testing import layer_model

    mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices("cpu")[:1])
    d, e, i = args.hidden, args.experts, args.intermediate
    configs = {
        "k2_style": dict(latent=None, shared=i, norm=False, router=routers.SigmoidGroupTopK(8, n_group=4, topk_group=2,
                                                                                         routed_scaling_factor=2.5)),
        "k2_style_routed_only": dict(latent=None, shared=0, norm=False, router=routers.SigmoidGroupTopK(8)),
        "k3_style": dict(latent=d // 2, shared=0, norm=True, router=routers.SoftmaxTopK(8)),
    }
    rows = []
    for name, c in configs.items():
        rng = np.random.default_rng(7)
        params = layer_model.random_params(rng, hidden=d, experts=e, intermediate=i, latent=c["latent"],
                                           shared_intermediate=c["shared"], bias=isinstance(c["router"],
                                                                                           routers.SigmoidGroupTopK))
        layer = MoELayer(mesh, hidden=d, experts=e, topk=8, intermediate=i, router=c["router"], latent=c["latent"],
                         shared_intermediate=c["shared"], norm=c["norm"], max_tokens=args.tokens, backend="xla")
        x = rng.standard_normal((args.tokens, d)).astype(np.float32)
        got = np.asarray(jax.jit(layer)(jnp.asarray(x, jnp.bfloat16), params), np.float64)
        ids, w = layer_model.route(c["router"], x, params)
        kw = dict(ranks=1, norm=c["norm"], eps=layer.eps, latent=c["latent"] is not None, shared=bool(c["shared"]))
        bf16_layer = layer_model.layer(x, params, ids, w, mx=False, **kw)
        mx_model = layer_model.layer(x, params, ids, w, mx=True, **kw)
        rel = lambda a: float(np.linalg.norm(a - bf16_layer) / np.linalg.norm(bf16_layer))  # noqa: E731
        res = {"rel_l2_layer_vs_bf16": rel(got), "rel_l2_model_mxfp8_vs_bf16": rel(mx_model)}
        print(f"{name:22s} layer vs a bf16 layer: {100 * res['rel_l2_layer_vs_bf16']:.2f} % relative L2 "
              f"(the MXFP8 rounding alone, float64 model: {100 * res['rel_l2_model_mxfp8_vs_bf16']:.2f} %)",
              flush=True)
        rows += [(f"mxfp8_error/{name}", m, v) for m, v in res.items()]
    write_rows(args.out, "cpu", [(name, 1, args.tokens, m, v) for name, m, v in rows])


if __name__ == "__main__":
    main()
