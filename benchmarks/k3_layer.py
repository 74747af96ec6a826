"""A Kimi K3 decode layer end to end on one GPU, with its breakdown (communication, experts, the rest).

    python benchmarks/k3_layer.py [--out k3_layer.csv] [--tokens 1 8 32 128] [--impl ragged_dot] [--pallas]
    python benchmarks/k3_layer.py --smoke          # tiny shapes, CPU is fine (the CI test runs this)

The layer (per rank, `jax_latent_ep.example.moe`'s, at K3's sizes): router 7168 -> 896 logits, top-16, softmax;
down projection 7168 -> 3584 (bf16); `ep.dispatch`; the expert stage (`experts.plan` + `experts.swiglu`, bf16
SwiGLU, intermediate `--intermediate`; with `--fp8` its weights in FP8 blocks, `experts.BlockScaled`); `ep.combine`
with RMSNorm; up projection 3584 -> 7168 and the residual.

Two cases, one GPU each:
- `N1`: N = 1, all 896 experts local, the nvlink backend (named: "auto" would pick xla at N = 1) where it is
  available, else xla;
- `J448`: a rank of N = 2 modelled on one GPU: the xla backend on a one-device mesh (its dispatch / combine are
  N = 1's: nothing crosses a link, so "communication" is a lower bound of N = 2's), and an expert stage built for
  the 448 local experts of rank 0 (ids >= 448 are not local: their pairs go to the other rank, not computed
  here), so the expert work and weight bytes are a real N = 2 rank's for the rows of its own tokens only.

Timed (each a jitted program of `layers` layers with their own weights, the median of `--repeats` runs, per
layer): `layer` (everything), `experts` (the expert stage alone on the layer's received rows), `comm` (dispatch
+ combine with the dequantized rows as the expert output); `rest` = layer - experts - comm (router, projections,
the plan's share is in `experts`). CSV rows `date,device,commit,backend,ranks,tokens,metric,value` with backend
`k3_layer/<case>/<backend>/I<I>` and metrics `layer_us`, `experts_us`, `comm_us`, `rest_us` (and with
`--device-time` the same as the GPU's kernel time, `*_device_us`: the wall times of a one-layer program carry its
host-side dispatch and synchronization).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))


from expert_stage import _time, device_us, fp8_normal  # noqa: E402  (benchmarks/ is on the path when run as a script)


def run_case(case, j, backend, shape, args, t, params):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jax_latent_ep import ExpertParallel, experts, moe
    from jax_latent_ep.numerics import mxfp8_dequantize

    dev = jax.devices()[0]
    mesh = jax.make_mesh((1,), ("ep",), devices=[dev])
    rng = jax.random.key(t)
    h = jax.random.normal(rng, (t, args.hidden), jnp.float32).astype(jnp.bfloat16)
    layers = len(params)
    rep = P()
    with ExpertParallel(mesh, "ep", max_tokens=t, shape=shape, backend=backend) as ep:
        def route(p, h):
            ids, w = moe.route(h, p["router"], shape.topk)
            x = jnp.dot(h, p["down"], preferred_element_type=jnp.float32).astype(jnp.bfloat16)
            return x, ids, w

        def stage(recv, p):
            return experts.expert_stage(recv, 0, p["w_gate"], p["w_up"], p["w_down"], impl=args.impl, max_tokens=t, ranks=1)

        def full(ps, h):
            for p in ps:
                x, ids, w = route(p, h)
                recv = ep.dispatch(x, ids, w)
                y = ep.combine(stage(recv, p), ids, p["norm"], 1e-5)
                h = h + jnp.dot(y, p["up"], preferred_element_type=jnp.float32).astype(jnp.bfloat16)
            return h

        def comm(ps, xs, idss, ws):
            acc = []
            for p, x, ids, w in zip(ps, xs, idss, ws):
                recv = ep.dispatch(x, ids, w)
                out = mxfp8_dequantize(recv.x, recv.sf).astype(jnp.bfloat16)
                acc.append(ep.combine(out, ids, p["norm"], 1e-5))
            return acc

        def get_recv(ps, xs, idss, ws):
            out, results = [], []
            for x, ids, w in zip(xs, idss, ws):
                r = ep.dispatch(x, ids, w)
                out.append(r)
                # Calls come in pairs, and a combine whose result is unused would be dropped: return it too.
                results.append(ep.combine(mxfp8_dequantize(r.x, r.sf).astype(jnp.bfloat16), ids, None))
            return out, results

        sm = lambda f, n_in: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(rep,) * n_in, out_specs=rep, check_vma=False))  # noqa: E731  one device
        full_fn = sm(full, 2)
        routed = [jax.jit(route)(p, h) for p in params]
        xs, idss, ws = ([r[i] for r in routed] for i in range(3))
        comm_fn = sm(comm, 4)
        recvs = sm(get_recv, 4)(params, xs, idss, ws)[0]
        experts_fn = sm(lambda recvs, ps: [stage(r, p) for r, p in zip(recvs, ps)], 2)
        layer_us = 1e6 * _time(full_fn, (params, h), args.repeats) / layers
        experts_us = 1e6 * _time(experts_fn, (recvs, params), args.repeats) / layers
        comm_us = 1e6 * _time(comm_fn, (params, xs, idss, ws), args.repeats) / layers
        res = {"layer_us": layer_us, "experts_us": experts_us, "comm_us": comm_us,
               "rest_us": layer_us - experts_us - comm_us}
        if args.device_time and dev.platform == "gpu":  # the GPU's kernel time: no host dispatch or sync in it
            res["layer_device_us"] = device_us(full_fn, (params, h)) / layers
            res["experts_device_us"] = device_us(experts_fn, (recvs, params)) / layers
            res["comm_device_us"] = device_us(comm_fn, (params, xs, idss, ws)) / layers
            res["rest_device_us"] = res["layer_device_us"] - res["experts_device_us"] - res["comm_device_us"]
        return ep.backend, res


def make_params(shape, j, args, layers):
    import jax
    import jax.numpy as jnp

    hid, lat, inter = args.hidden, shape.latent, args.intermediate
    out = []
    for li in range(layers):
        k = jax.random.split(jax.random.key(100 + li), 7)
        n = lambda key, s, fan: (jax.random.normal(key, s, jnp.float32) / fan**0.5).astype(jnp.bfloat16)  # noqa: E731
        # The experts' weights: bf16, or with --fp8 made in FP8 (a quantized full-size bf16 weight passes the memory
        # at N = 1).
        e = (lambda key, s, fan: fp8_normal(key, s, fan**-0.5)) if args.fp8 else n  # noqa: E731
        out.append({"router": n(k[0], (hid, shape.experts), hid), "down": n(k[1], (hid, lat), hid),
                    "w_gate": e(k[2], (j, lat, inter), lat), "w_up": e(k[3], (j, lat, inter), lat),
                    "w_down": e(k[4], (j, inter, lat), inter), "up": n(k[5], (lat, hid), lat),
                    "norm": (1 + 0.1 * jax.random.normal(k[6], (lat,))).astype(jnp.bfloat16)})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default="k3_layer.csv")
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32, 128])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--impl", default="ragged_dot")
    p.add_argument("--device-time", action="store_true",
                   help="also the GPU's kernel time per layer of each program (a profiler trace): `*_device_us`")
    p.add_argument("--fp8", action="store_true", help="the experts' weights in FP8 blocks (backend name `..-fp8`)")
    p.add_argument("--pallas", action="store_true", help="jax_ragged_dot_use_gpu_pallas_triton_lowering")
    p.add_argument("--cases", nargs="+", default=["N1", "J448"], choices=["N1", "J448"])
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--weights-gb", type=float, default=60.0)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)

    import jax

    if args.pallas:
        jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", True)
    from jax_latent_ep import KIMI_K3, LatentMoEShape

    shape = KIMI_K3
    if args.smoke:
        shape = LatentMoEShape(latent=128, experts=32, topk=4)
        # (FP8 blocks are 128 x 128: the smallest intermediate they allow)
        args.hidden, args.intermediate, args.tokens, args.layers, args.repeats = 64, 128 if args.fp8 else 32, [2], 2, 1
    dev = jax.devices()[0]
    gpu = dev.platform == "gpu"
    device = dev.device_kind if gpu else "cpu"
    try:
        import subprocess

        commit = os.environ.get("GIT_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True, timeout=10
        ).stdout.strip() or "unknown"
    except Exception:
        commit = "unknown"
    rows = []
    for case in args.cases:
        j = shape.experts if case == "N1" else shape.experts // 2
        per_layer = 3 * j * shape.latent * args.intermediate * (1 if args.fp8 else 2)
        layers = max(1, min(args.layers, int(args.weights_gb * 2**30) // per_layer))
        params = make_params(shape, j, args, layers)
        backend = "nvlink" if (case == "N1" and gpu) else "xla"
        for t in args.tokens:
            try:
                used, res = run_case(case, j, backend, shape, args, t, params)
            except ValueError as exc:  # nvlink not available here: xla
                if backend != "nvlink":
                    raise
                print(f"# {case}: nvlink unavailable ({exc}); xla", file=sys.stderr)
                backend = "xla"
                used, res = run_case(case, j, backend, shape, args, t, params)
            name = f"k3_layer/{case}/{used}/I{args.intermediate}" + ("-fp8" if args.fp8 else "")
            for m, v in res.items():
                rows.append((name, 1 if case == "N1" else 2, t, m, v))
            for kind in ("", "_device"):
                if f"layer{kind}_us" in res:
                    print(f"{case:5s} {used:6s} T={t:4d} {'device' if kind else 'wall':6s}: layer "
                          f"{res[f'layer{kind}_us']:9.1f} us = comm "
                          f"{res[f'comm{kind}_us']:8.1f} + experts {res[f'experts{kind}_us']:9.1f} + rest "
                          f"{res[f'rest{kind}_us']:8.1f}  ({layers} layer(s) per program)", flush=True)
        del params
    date = datetime.date.today().isoformat()
    with open(args.out, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["date", "device", "commit", "backend", "ranks", "tokens", "metric", "value"])
        for name, n, t, m, v in rows:
            w.writerow([date, device, commit, name, n, t, m, f"{v:.6g}"])
    print(f"wrote {args.out} ({len(rows)} rows; {device}, commit {commit}, {date}, impl {args.impl})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
