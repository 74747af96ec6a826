"""A Kimi K3 decode layer end to end on one GPU, in each expert weight format, against the bytes of all its weights.

    python benchmarks/k3_layer.py [--out k3_layer.csv] [--tokens 1 8 32 128] [--formats bf16 fp8 mxfp4]
    python benchmarks/k3_layer.py --smoke          # tiny shapes, CPU is fine (the CI test runs this)

The layer (per rank, `jax_latent_ep.example.moe`'s, at K3's sizes): router 7168 -> 896 logits, top-16, softmax;
down projection 7168 -> 3584 (bf16; the router and both projections `dense.matmul(impl=--dense)`, with
`--fuse-router` the router and down as one weight; the top-16 `moe.top_k_softmax(method=--topk)`); `ep.dispatch`;
the expert stage (`experts.expert_stage`, SwiGLU, intermediate `--intermediate`) on the format's weights: `bf16`
(`--impl`, default `kernel` on a GPU), `fp8` (`[out, in]` blocks, `experts.BlockScaledOutIn`) and `mxfp4`
(`experts.MXFP4`), both on `wgmma` (`gmm` off GPUs); `ep.combine` with RMSNorm; up projection 3584 -> 7168 and the
residual.

Cases, one GPU each, dispatch / combine on a one-device mesh (`--comm`: the nvlink backend's kernels, named since
"auto" would pick xla at N = 1, where they are available, else xla; or xla): they are N = 1's, nothing crosses a link,
so "communication" is a lower bound of N's:
- `J448` / `J112`: rank 0 of N = 2 / N = 8 modelled on one GPU: an expert stage built for rank 0's J local experts
  (ids >= J are not local: their pairs go to other ranks, not computed here), so the expert work and weight bytes
  are a real rank's for the rows of its own tokens only;
- `N1`: N = 1, all 896 experts local.

Timed (each a jitted program of `--layers` layers with their own weights, fewer where they pass `--weights-gb`; the
median of `--repeats` runs, per layer): `layer` (everything) waited for (`layer_us`) and issued back to back
(`layer_pipelined_us`, as a serving loop dispatches them), `experts` (the expert stage alone on the layer's
received rows), `comm` (dispatch + combine with the dequantized rows as the expert output); `rest` = layer -
experts - comm (router, top-16, projections; the plan's share is in `experts`). With `--device-time` the same as
the GPU's kernel time, `*_device_us`; with `--ops K` where the layer's kernel time goes: each HLO
instruction's events (its kernels outside command buffers; off GPUs XLA:CPU's thunks) summed over the layers'
copies by the JAX operations and source lines it runs, the K costliest (`op_us:<operations>`, with events a
layer). The floor: the bytes of every weight the layer reads (router, projections, the active local experts of
each layer's routing in the format's bytes with their scales) over the best stream measured in the same run
(`floor_us`, `hbm_GBps`) and over the H200's 4.8 TB/s (`floor_spec_us`); `ratio` / `ratio_spec` are the
back-to-back layer over each. CSV rows `date,device,commit,backend,ranks,tokens,metric,value`
with backend `k3_layer/<case>/<backend>/I<I>/<format>/dense-<impl>[-fused][/topk-<method>]`.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from expert_stage import (  # noqa: E402  (benchmarks/ is on the path when run as a script)
    _commit, _layer_weights, _time, _time_pipelined, device_times, device_us, hbm_gbps, op_sources)

#: The expert weight formats: (`_layer_weights`' format, the implementation on a GPU, off GPUs).
FORMATS = {"bf16": ("bf16", None, None), "fp8": ("fp8-out-in", "wgmma", "gmm"), "mxfp4": ("mxfp4", "wgmma", "gmm")}
#: Local experts J of each case (rank 0 of N = 896 / J); N1: every expert.
CASES = {"N1": None, "J448": 448, "J112": 112}
#: The H200's HBM bandwidth, bytes a second (`floor_spec_us`).
SPEC_BYTES_PER_S = 4.8e12


def expert_bytes(fmt: str, lat: int, inter: int) -> float:
    """Bytes one expert's three weights take in `fmt`, scales included."""
    n = 3 * lat * inter
    return {"bf16": 2.0 * n, "fp8": n + 4.0 * n / 128**2, "mxfp4": n / 2 + n / 32}[fmt]


def run_case(j, backend, shape, args, t, params, impl):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from jax_latent_ep import ExpertParallel, dense, experts, moe
    from jax_latent_ep.numerics import mxfp8_dequantize

    dev = jax.devices()[0]
    mesh = jax.make_mesh((1,), ("ep",), devices=[dev])
    rng = jax.random.key(t)
    h = jax.random.normal(rng, (t, args.hidden), jnp.float32).astype(jnp.bfloat16)
    layers = len(params)
    rep = P()
    with ExpertParallel(mesh, "ep", max_tokens=t, shape=shape, backend=backend) as ep:
        def route(p, h):
            if args.fuse_router:  # router and down projection: one weight [H, E + L], one launch
                both = dense.matmul(h, p["router_down"], impl=args.dense, out_dtype=jnp.float32)
                logits, x = both[:, :shape.experts], both[:, shape.experts:].astype(jnp.bfloat16)
            else:
                logits = dense.matmul(h, p["router"], impl=args.dense, out_dtype=jnp.float32)
                x = dense.matmul(h, p["down"], impl=args.dense)
            ids, w = moe.top_k_softmax(logits, shape.topk, args.topk)
            return x, ids, w

        def stage(recv, p):
            return experts.expert_stage(recv, 0, p["w_gate"], p["w_up"], p["w_down"], impl=impl, max_tokens=t,
                                        ranks=1)

        def full(ps, h):
            for p in ps:
                x, ids, w = route(p, h)
                recv = ep.dispatch(x, ids, w)
                y = ep.combine(stage(recv, p), ids, p["norm"], 1e-5)
                h = h + dense.matmul(y, p["up"], impl=args.dense)
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
        # the floor's experts: the distinct local ids of each layer's routing of `h`, averaged over the layers
        active = float(np.mean([len(set(np.asarray(ids).ravel().tolist()) & set(range(j))) for ids in idss]))
        comm_fn = sm(comm, 4)
        recvs = sm(get_recv, 4)(params, xs, idss, ws)[0]
        experts_fn = sm(lambda recvs, ps: [stage(r, p) for r, p in zip(recvs, ps)], 2)
        layer_us = 1e6 * _time(full_fn, (params, h), args.repeats) / layers
        experts_us = 1e6 * _time(experts_fn, (recvs, params), args.repeats) / layers
        comm_us = 1e6 * _time(comm_fn, (params, xs, idss, ws), args.repeats) / layers
        b2b, host = _time_pipelined(full_fn, (params, h), args.repeats)
        res = {"layer_us": layer_us, "layer_pipelined_us": 1e6 * b2b / layers, "layer_host_us": 1e6 * host / layers,
               "experts_us": experts_us, "comm_us": comm_us, "rest_us": layer_us - experts_us - comm_us,
               "active_experts": active, "layers": float(layers)}
        if args.device_time and dev.platform == "gpu":  # the GPU's kernel time: no host dispatch or sync in it
            res["layer_device_us"] = device_us(full_fn, (params, h)) / layers
            res["experts_device_us"] = device_us(experts_fn, (recvs, params)) / layers
            res["comm_device_us"] = device_us(comm_fn, (params, xs, idss, ws)) / layers
            res["rest_device_us"] = res["layer_device_us"] - res["experts_device_us"] - res["comm_device_us"]
        if args.ops:  # where the layer's time goes, each HLO instruction's: its own kernels, not one command buffer
            ops_fn = full_fn.lower(params, h).compile(compiler_options={"xla_gpu_enable_command_buffer": ""})
            ops: dict[str, float] = {}
            device_times(ops_fn, (params, h), per_op=ops)
            sources = op_sources(ops_fn.as_text())
            by_source: dict[str, list] = {}  # each layer's copy of an instruction has its own name: sum by source
            for op, us in ops.items():
                entry = by_source.setdefault(sources.get(op) or re.sub(r"\.\d+$", "", op), [0.0, 0])
                entry[0] += us
                entry[1] += 1
            for src, (us, count) in sorted(by_source.items(), key=lambda kv: -kv[1][0])[:args.ops]:
                res[f"op_us:{src}"] = us / layers
                print(f"    {us / layers:8.2f} us  x{count / layers:g}  {src[:180]}", flush=True)
        return ep.backend, res


def make_params(shape, j, args, layers, fmt):
    import jax
    import jax.numpy as jnp

    hid, lat, inter = args.hidden, shape.latent, args.intermediate
    out = []
    for li in range(layers):
        k = jax.random.split(jax.random.key(100 + li), 6)
        n = lambda key, s, fan: (jax.random.normal(key, s, jnp.float32) / fan**0.5).astype(jnp.bfloat16)  # noqa: E731
        w_gate, w_up, w_down = _layer_weights(k[2], j, lat, inter, FORMATS[fmt][0])  # made on the device
        router, down = n(k[0], (hid, shape.experts), hid), n(k[1], (hid, lat), hid)
        fused = {"router_down": jnp.concatenate([router, down], axis=1)} if args.fuse_router else {
            "router": router, "down": down}
        out.append({**fused,
                    "w_gate": w_gate, "w_up": w_up, "w_down": w_down, "up": n(k[3], (lat, hid), lat),
                    "norm": (1 + 0.1 * jax.random.normal(k[4], (lat,))).astype(jnp.bfloat16)})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default="k3_layer.csv")
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32, 128])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--impl", default=None, help="bf16 experts' implementation (default: kernel on a GPU, else "
                                                "ragged_dot)")
    p.add_argument("--dense", default="auto", choices=["auto", "xla", "kernel"],
                   help="the router's and projections' `dense.matmul` implementation")
    p.add_argument("--topk", default="top_k", choices=["top_k", "rank", "auto"], help="`moe.top_k_softmax`'s method")
    p.add_argument("--fuse-router", action="store_true",
                   help="router and down projection as one [H, E + L] weight, one matmul")
    p.add_argument("--device-time", action="store_true",
                   help="also the GPU's kernel time per layer of each program (a profiler trace): `*_device_us`")
    p.add_argument("--ops", type=int, default=0, metavar="K",
                   help="the layer's K costliest sources of kernel time (GPU kernels outside command buffers; "
                        "XLA:CPU's thunks): `op_us:<JAX operations and their lines>`, microseconds a layer")
    p.add_argument("--pallas", action="store_true", help="jax_ragged_dot_use_gpu_pallas_triton_lowering")
    p.add_argument("--cases", nargs="+", default=None, choices=list(CASES), help="default J448 J112 (smoke: J112)")
    p.add_argument("--comm", default="nvlink", choices=["nvlink", "xla"],
                   help="dispatch / combine backend on a GPU (nvlink falls back to xla where unavailable)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--weights-gb", type=float, default=None,
                   help="expert weights' GiB a program may hold (default: 70 %% of the device's memory, 100 off GPUs)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--hbm-bytes", type=int, default=2 << 30)
    args = p.parse_args(argv)

    import jax

    if args.pallas:
        jax.config.update("jax_ragged_dot_use_gpu_pallas_triton_lowering", True)
    from jax_latent_ep import KIMI_K3, LatentMoEShape

    shape = KIMI_K3
    dev = jax.devices()[0]
    gpu = dev.platform == "gpu"
    local = CASES
    if args.smoke:
        # FP8 blocks are 128 x 128 and the wgmma kernels' sizes multiples of 128: the smallest that all formats take
        shape = LatentMoEShape(latent=128, experts=32, topk=4)
        args.hidden, args.intermediate, args.tokens, args.layers, args.repeats = 64, 128, [2], 2, 1
        args.ops = args.ops or 3
        args.hbm_bytes = 1 << 22
        local = {"N1": None, "J448": 16, "J112": 8}  # N = 2 and N = 4 of the 32 experts
    args.cases = args.cases or (["J112"] if args.smoke else ["J448", "J112"])  # smoke: one case, every format
    device = dev.device_kind if gpu else "cpu"
    commit = _commit()
    if args.weights_gb is None:  # room for the programs' temporaries: 100 GB of weights did not fit an H100
        limit = (dev.memory_stats() or {}).get("bytes_limit") if gpu else None
        args.weights_gb = 0.7 * limit / 2**30 if limit else 100.0
    bw = hbm_gbps(args.hbm_bytes, args.repeats) * 1e9  # bytes a second, the run's best stream
    dense_bytes = 2.0 * (args.hidden * shape.experts + 2 * args.hidden * shape.latent)
    rows = [("k3_layer/hbm", 1, 0, "hbm_GBps", bw / 1e9)]
    print(f"best stream {bw / 1e9:.0f} GB/s; router and projections {dense_bytes / 1e6:.1f} MB a layer", flush=True)
    for case in args.cases:
        j = local[case] or shape.experts
        ranks = shape.experts // j
        for fmt in args.formats:
            if fmt == "bf16":
                impl = args.impl or ("kernel" if gpu else "ragged_dot")
            else:
                impl = FORMATS[fmt][1 if gpu else 2]
            per_layer = j * expert_bytes(fmt, shape.latent, args.intermediate)
            layers = max(1, min(args.layers, int(args.weights_gb * 2**30 // per_layer)))
            params = make_params(shape, j, args, layers, fmt)
            backend = "nvlink" if (args.comm == "nvlink" and gpu) else "xla"
            for t in args.tokens:
                try:
                    used, res = run_case(j, backend, shape, args, t, params, impl)
                except ValueError as exc:  # nvlink not available here: xla
                    if backend != "nvlink":
                        raise
                    print(f"# {case}: nvlink unavailable ({exc}); xla", file=sys.stderr)
                    backend = "xla"
                    used, res = run_case(j, backend, shape, args, t, params, impl)
                except Exception as exc:  # out of memory, a lowering that refuses: say so, keep the other rows
                    print(f"FAIL {case} {fmt} T={t}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    continue
                nbytes = dense_bytes + res["active_experts"] * expert_bytes(fmt, shape.latent, args.intermediate)
                res["floor_us"], res["floor_spec_us"] = 1e6 * nbytes / bw, 1e6 * nbytes / SPEC_BYTES_PER_S
                res["ratio"] = res["layer_pipelined_us"] / res["floor_us"]
                res["ratio_spec"] = res["layer_pipelined_us"] / res["floor_spec_us"]
                name = f"k3_layer/{case}/{used}/I{args.intermediate}/{fmt}/dense-{args.dense}" + (
                    "-fused" if args.fuse_router else "") + (f"/topk-{args.topk}" if args.topk != "top_k" else "")
                rows += [(name, ranks, t, m, v) for m, v in res.items()]
                _write_csv(args.out, rows, device, commit)  # each point on disk as it comes: a run cut short keeps it
                kind = "_device" if "layer_device_us" in res else ""
                split = " + ".join(f"{part} {res[f'{part}{kind}_us']:.1f}" for part in ("comm", "experts", "rest"))
                print(f"{case:5s} {fmt:5s} {impl:10s} T={t:4d}: layer {res['layer_us']:8.1f} us waited, "
                      f"{res['layer_pipelined_us']:8.1f} back to back ({res['ratio']:.2f}x floor {res['floor_us']:.1f},"
                      f" {res['ratio_spec']:.2f}x at 4.8 TB/s) = {split}  ({layers} layer(s))", flush=True)
            del params
            jax.clear_caches()  # the format's weights and programs go before the next format's are made
            gc.collect()
    date = _write_csv(args.out, rows, device, commit)
    print(f"wrote {args.out} ({len(rows)} rows; {device}, commit {commit}, {date})")
    return 0


def _write_csv(path, rows, device, commit) -> str:
    """Writes `rows` `(backend, ranks, tokens, metric, value)` to the CSV at `path`; returns the date written."""
    date = datetime.date.today().isoformat()
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["date", "device", "commit", "backend", "ranks", "tokens", "metric", "value"])
        for name, n, t, m, v in rows:
            w.writerow([date, device, commit, name, n, t, m, f"{v:.6g}"])
    return date


if __name__ == "__main__":
    sys.exit(main())
