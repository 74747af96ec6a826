"""The expert stage at training and prefill sizes on one GPU: forward, and forward + backward (`jax.grad`), per layer,
against a plain dense SwiGLU MLP on as many rows measured in the same process (the rate of plain GEMMs of the same
shapes), with the compiled program's temporaries.

    python benchmarks/training.py [--out training.csv] [--models k3 k2] [--tokens 1024 4096 8192]
    python benchmarks/training.py --smoke        # tiny shapes, CPU is fine

A rank's share of the model (`MODELS`): K3 at N = 8 (J = 112 local experts, L = 3584, I = 2048, K = 16), K3 at
N = 2 (`k3n2`, J = 448), K2 at N = 8 (J = 48, L = 7168, I = 2048, K = 8). T tokens a rank: rank 0's receive rows
from N sources, each token's K ids uniform over the NJ experts, so about `T * K` pairs land here; the plan of
`capacity_factor` 1.25 (overflow dropped). A program is `--layers` residual layers `x += stage(x)`, each with its
own weights (one routing), and the loss `sum(y * dout)`; times are medians of `--repeats` runs, per layer. The
plain reference (`plain`): a dense SwiGLU MLP, batched over the J experts with `ceil(pairs / J)` rows each (the same
GEMM shapes, none ragged: cuBLAS's rate for them), in the same program shape, differentiated by XLA; `plain_bf16`
the same with a backward of plain batched bf16 GEMMs (FP32 accumulation, bf16 out: cuBLAS's rate for the
backward's shapes).

With `--profile K` (a GPU), each forward and forward + backward program's K kernels of the most GPU time are printed
(where the time goes; a diagnosis, no rows). With `--fp8`, the prefill forward on FP8 weights against XLA's FP8
GEMMs too (`measure_fp8`, rows `training/<model>/fp8/<case>`). With `--layer`, the whole `MoELayer` too (router,
K3's latent projections and norm or K2's shared expert, dispatch and combine on the xla backend, the stage) at N = 1
with the J experts, rows `training/<model>/layer/<impl>`.

Rows (`backend` `training/<model>/<impl>`): `fwd_ms`, `fwd_bwd_ms` (per layer), `fwd_tflops`, `fwd_bwd_tflops`
(the pairs' FLOPs: `2 * pairs * L * I * 3` forward, three times that with the backward), `bwd_tflops` (twice the
forward's FLOPs over `fwd_bwd_ms - fwd_ms`), `fwd_of_plain`, `fwd_bwd_of_plain` (the rate over `plain`'s, else `plain_bf16`'s),
`bwd_of_plain_fwd`, `bwd_of_plain_bf16_bwd` (the backward's rate over `plain`'s forward rate, over `plain_bf16`'s
backward rate), `fwd_temp_GB`, `fwd_bwd_temp_GB` (the compiled programs'
temporaries, all layers), `pairs`. An implementation that fails is printed and has no rows.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from expert_stage import _time, device_times, write_rows  # noqa: E402  (benchmarks/ is on the path as a script)

#: A rank's share of each model: `ranks` N, J = experts / N local experts. "k3n2": K3 at N = 2 (J 448; its weights,
#: 2 x 19.7 GB a program, fit an H200).
MODELS = {"k3": dict(j=112, lat=3584, inter=2048, k=16, ranks=8), "k2": dict(j=48, lat=7168, inter=2048, k=8, ranks=8),
          "k3n2": dict(j=448, lat=3584, inter=2048, k=16, ranks=2)}
#: `--layer`: the rest of each model's MoE block (K3: a latent projection from 7168 and the norm; K2: a shared
#: expert of 2048).
BLOCKS = {"k3": dict(hidden=7168, latent=3584, shared=0, norm=True), "k2": dict(hidden=7168, latent=None,
                                                                            shared=2048, norm=False)}
BLOCKS["k3n2"] = BLOCKS["k3"]
#: `--variants`: name -> (implementation, `experts.grouped` settings it runs with), for A/Bs in one process.
VARIANTS = {"wgmma-xla-swiglu": ("wgmma", {"WGMMA_SWIGLU": False})}


def fit_layers(model: str, layers: int, weights_gb: float) -> int:
    """The layers of a program at `model`: at most `layers`, and as many as keep its bf16 expert weights and their
    gradients within `weights_gb` GiB, at least one (K3 at N = 2: one layer on an 80 GB GPU)."""
    c = MODELS[model]
    per_layer = 2 * 3 * c["j"] * c["lat"] * c["inter"] * 2  # the weights and their gradient, bf16
    return max(1, min(layers, int(weights_gb * 2**30) // per_layer))


def _routing(rng, t, j, k, ranks):
    """Rank 0's `Received` (ids and weights only matter) for `ranks * t` rows of uniform top-`k` ids over
    `ranks * j` experts."""
    import jax.numpy as jnp
    import numpy as np

    from jax_latent_ep.received import Received

    rows, lat = ranks * t, 32
    ids = np.stack([rng.choice(ranks * j, size=k, replace=False) for _ in range(rows)]).astype(np.int32)
    weights = rng.random((rows, k)).astype(np.float32)
    src = ((np.arange(rows) // t) << 16 | (np.arange(rows) % t)).astype(np.int32)
    return Received(jnp.zeros((rows, lat), jnp.float8_e4m3fn), jnp.zeros((rows, 1), jnp.uint8), jnp.asarray(ids),
                    jnp.asarray(weights), jnp.asarray(src))


def residual_layers(stage):
    """`fwd(x, ws)`: `x += stage(x, w)` for each layer's weights `w` of `ws`, the sum in FP32, `x` bf16 between."""
    import jax.numpy as jnp

    def fwd(x, ws):
        for w in ws:
            x = (x.astype(jnp.float32) + stage(x, w).astype(jnp.float32)).astype(jnp.bfloat16)
        return x

    return fwd


def measure(model, t, impls, layers, repeats, tiles=(), plain=("plain", "plain_bf16"), seed=0, profile=0,
            variants=()):
    """Rows `(backend, tokens, metric, value)` of each implementation of `impls` (and the references `plain`) at
    `model`, T = `t`,
    and of "mosaic" with each `(block_m, block_n, steps)` of `tiles`, and of each of `variants` (`VARIANTS`). With
    `profile` (a GPU), each forward and forward + backward program's `profile` kernels of the most GPU time are
    printed (a diagnosis, no rows)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_latent_ep import experts

    defaults = {c: getattr(experts.grouped, c) for c in ("MOSAIC_BLOCK_M", "MOSAIC_BLOCK_N", "MOSAIC_STEPS",
                                                         *(c for _, consts in VARIANTS.values() for c in consts))}
    c = MODELS[model]
    j, lat, inter, k, ranks = c["j"], c["lat"], c["inter"], c["k"], c["ranks"]
    rng = np.random.default_rng(seed)
    recv = _routing(rng, t, j, k, ranks)
    pl = jax.jit(lambda r: experts.plan(r, 0, j, max_tokens=t, ranks=ranks, capacity_factor=1.25,
                                        overflow="drop"))(recv)
    pairs = int(pl.count)
    keys = jax.random.split(jax.random.key(seed), 4 * layers + 2)
    wshape = ((j, lat, inter), (j, lat, inter), (j, inter, lat))
    ws = [[jax.random.normal(keys[4 * i + m], s, jnp.bfloat16) * s[1] ** -0.5 for m, s in enumerate(wshape)]
          for i in range(layers)]
    x = jax.random.normal(keys[-2], (ranks * t, lat), jnp.bfloat16)
    dout = jax.random.normal(keys[-1], (ranks * t, lat), jnp.float32)  # the loss's weights
    flops = 2 * pairs * lat * inter * 3
    rows = [(f"training/{model}", t, "pairs", pairs)]

    def program(stage, dout):
        fwd = residual_layers(stage)

        def loss(x, ws):
            return jnp.sum(fwd(x, ws).astype(jnp.float32) * dout)

        return jax.jit(fwd), jax.jit(jax.grad(loss, argnums=(0, 1)))

    def plain_stage(xe, w):
        mm = lambda a, b: jnp.einsum("jml,jli->jmi", a, b, preferred_element_type=jnp.float32)  # noqa: E731
        h = (jax.nn.silu(mm(xe, w[0])) * mm(xe, w[1])).astype(jnp.bfloat16)
        return mm(h, w[2])

    @jax.custom_vjp
    def plain_bf16_stage(xe, w):
        return plain_bf16_fwd(xe, w)[0]

    def plain_bf16_fwd(xe, w):
        mm = lambda a, b: jnp.einsum("jml,jli->jmi", a, b, preferred_element_type=jnp.float32)  # noqa: E731
        g, u = mm(xe, w[0]).astype(jnp.bfloat16), mm(xe, w[1]).astype(jnp.bfloat16)
        h = (jax.nn.silu(g.astype(jnp.float32)) * u).astype(jnp.bfloat16)
        return mm(h, w[2]), (xe, w, g, u, h)

    def plain_bf16_bwd(res, dy):
        # The backward's six GEMMs as plain batched bf16 GEMMs (FP32 accumulation, bf16 out): cuBLAS's rate for them.
        xe, w, g, u, h = res
        dy = dy.astype(jnp.bfloat16)
        mm = lambda eq, a, b: jnp.einsum(eq, a, b, preferred_element_type=jnp.float32).astype(  # noqa: E731
            jnp.bfloat16)
        dh = mm("jmi,jli->jml", dy, w[2])
        _, vjp = jax.vjp(lambda a, b: jax.nn.silu(a) * b, g.astype(jnp.float32), u.astype(jnp.float32))
        dg, du = (d.astype(jnp.bfloat16) for d in vjp(dh.astype(jnp.float32)))
        dx = (mm("jmi,jli->jml", dg, w[0]).astype(jnp.float32) + mm("jmi,jli->jml", du, w[1])).astype(jnp.bfloat16)
        return dx, [mm("jml,jmi->jli", xe, dg), mm("jml,jmi->jli", xe, du), mm("jmi,jml->jil", h, dy)]

    plain_bf16_stage.defvjp(plain_bf16_fwd, plain_bf16_bwd)

    rates = {}
    per_expert = -(-pairs // j)
    cases = [(ref, None, {}) for ref in plain] + [(impl, impl, {}) for impl in impls] + [
        (f"mosaic-bm{bm}-bn{bn}-s{st}", "mosaic", dict(MOSAIC_BLOCK_M=bm, MOSAIC_BLOCK_N=bn, MOSAIC_STEPS=st))
        for bm, bn, st in tiles] + [(name, *VARIANTS[name]) for name in variants]
    for name, impl, consts in cases:
        case_flops = flops
        try:
            for const, v in consts.items():
                setattr(experts.grouped, const, v)
            if impl is None:  # every expert's rows in one batched dense MLP: `ceil(pairs / J)` rows an expert
                case_flops = 2 * j * per_expert * lat * inter * 3
                args = (jax.random.normal(keys[-2], (j, per_expert, lat), jnp.bfloat16), ws)
                fwd, grad = program(plain_stage if name == "plain" else plain_bf16_stage,
                                    jax.random.normal(keys[-1], (j, per_expert, lat), jnp.float32))
            else:
                args = (x, ws)
                fwd, grad = program(lambda x, w, impl=impl: experts.swiglu_rows(pl, x, *w, impl=impl), dout)
            start = time.perf_counter()
            temps = [f.lower(*args).compile().memory_analysis().temp_size_in_bytes / 1e9 for f in (fwd, grad)]
            t_fwd = _time(fwd, args, repeats) / layers
            t_all = _time(grad, args, repeats) / layers
        except Exception as e:  # noqa: BLE001  (a failing implementation is reported, the rest still run)
            print(f"{model} T={t} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        finally:
            for const, v in defaults.items():
                setattr(experts.grouped, const, v)
        r_fwd, r_all = case_flops / t_fwd / 1e12, 3 * case_flops / t_all / 1e12
        r_bwd = 2 * case_flops / (t_all - t_fwd) / 1e12
        rates.setdefault(name, (r_fwd, r_all, r_bwd))
        # The plain forward rate: either reference's (the same forward); the whole step's: "plain"'s, else
        # "plain_bf16"'s.
        nan = (float("nan"),) * 3
        p_fwd = max((rates[r][0] for r in ("plain", "plain_bf16") if r in rates), default=float("nan"))
        p_all = rates.get("plain", rates.get("plain_bf16", nan))[1]
        p_bwd = rates.get("plain_bf16", nan)[2]
        print(f"{model} T={t:5d} {name:10s}: fwd {t_fwd * 1e3:7.2f} ms {r_fwd:5.0f} TFLOPS ({r_fwd / p_fwd:4.2f} of "
              f"plain), fwd+bwd {t_all * 1e3:7.2f} ms {r_all:5.0f} TFLOPS ({r_all / p_all:4.2f}), bwd {r_bwd:5.0f} "
              f"TFLOPS ({r_bwd / p_fwd:4.2f} of plain fwd, {r_bwd / p_bwd:4.2f} of plain_bf16 bwd), temporaries "
              f"{temps[0]:.1f} / {temps[1]:.1f} GB ({time.perf_counter() - start:.0f} s)", flush=True)
        b = f"training/{model}/{name}"
        rows += [(b, t, "fwd_ms", t_fwd * 1e3), (b, t, "fwd_bwd_ms", t_all * 1e3), (b, t, "fwd_tflops", r_fwd),
                 (b, t, "fwd_bwd_tflops", r_all), (b, t, "bwd_tflops", r_bwd), (b, t, "fwd_temp_GB", temps[0]),
                 (b, t, "fwd_bwd_temp_GB", temps[1])]
        ratios = [("fwd_of_plain", r_fwd / p_fwd), ("fwd_bwd_of_plain", r_all / p_all),
                  ("bwd_of_plain_fwd", r_bwd / p_fwd), ("bwd_of_plain_bf16_bwd", r_bwd / p_bwd)]
        rows += [(b, t, m, v) for m, v in ratios if v == v]  # a reference not measured (yet): no row
        if profile:
            for what, fn in (("forward", fwd), ("forward + backward", grad)):
                print(f"  {what}:", flush=True)
                print_profile(fn, args, layers, profile)
    return rows


def print_profile(fn, args, layers, top):
    """Prints the GPU time per layer of one call of `fn` (busy and span) and its `top` kernels by summed time."""
    import jax

    if not any(d.platform == "gpu" for d in jax.devices()):
        print("  profile: needs a GPU", flush=True)
        return
    per_kernel = {}
    busy, span, _ = device_times(fn, args, per_kernel)
    print(f"  profile, per layer: GPU busy {busy / layers / 1e3:.2f} ms, span {span / layers / 1e3:.2f} ms",
          flush=True)
    for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {us / layers / 1e3:8.3f} ms  {us / busy:5.1%}  {name[:100]}", flush=True)


def measure_fp8(model, t, layers, repeats, impl="wgmma", seed=0, profile=0):
    """Rows of the prefill forward on FP8 weights (`--fp8`): the stage on `[out, in]` FP8 weights with a scale per
    128 x 128 block (`training/<model>/fp8/<impl>`: `experts.swiglu_rows` on `impl` as a caller runs it, "wgmma" the
    project's kernels, the MXFP8 rows quantized from the bf16 ones, the stage's row sums) against
    `training/<model>/fp8/plain`: the SwiGLU MLP batched over the J experts with `ceil(pairs / J)` rows each as
    plain e4m3 x e4m3 GEMMs (XLA's FP8 GEMM, BF16 out; `h` cast to e4m3), unscaled: an FP8 GEMM's rate for the same
    shapes. Rows `fwd_ms`, `fwd_tflops`, `fwd_of_plain`, `fwd_temp_GB`."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from expert_stage import _layer_weights  # noqa: E402  (benchmarks/ is on the path as a script)
    from jax_latent_ep import experts

    c = MODELS[model]
    j, lat, inter, k, ranks = c["j"], c["lat"], c["inter"], c["k"], c["ranks"]
    recv = _routing(np.random.default_rng(seed), t, j, k, ranks)
    pl = jax.jit(lambda r: experts.plan(r, 0, j, max_tokens=t, ranks=ranks, capacity_factor=1.25,
                                        overflow="drop"))(recv)
    pairs, per_expert = int(pl.count), -(-int(pl.count) // j)
    keys = jax.random.split(jax.random.key(seed), layers + 2)
    ws = [_layer_weights(keys[i], j, lat, inter, "fp8-out-in") for i in range(layers)]
    x = jax.random.normal(keys[-2], (ranks * t, lat), jnp.bfloat16)

    def kernel_stage(x, w):
        return experts.swiglu_rows(pl, x, *w, impl=impl)

    def plain_stage(xe, w):
        mm = lambda a, b: jax.lax.dot_general(a, b, (((2,), (2,)), ((0,), (0,))),  # noqa: E731
                                              preferred_element_type=jnp.bfloat16)
        xq = xe.astype(jnp.float8_e4m3fn)
        g, u = mm(xq, w[0].values), mm(xq, w[1].values)
        h = (jax.nn.silu(g.astype(jnp.float32)) * u).astype(jnp.float8_e4m3fn)
        return mm(h, w[2].values)

    rows, plain_rate = [], float("nan")
    for name, stage, args, case_pairs in (
            ("plain", plain_stage, (jax.random.normal(keys[-1], (j, per_expert, lat), jnp.bfloat16), ws),
             j * per_expert), (impl, kernel_stage, (x, ws), pairs)):
        fwd = jax.jit(residual_layers(stage))
        try:
            temp = fwd.lower(*args).compile().memory_analysis().temp_size_in_bytes / 1e9
            t_fwd = _time(fwd, args, repeats) / layers
        except Exception as e:  # noqa: BLE001  (a failing case is reported, the other still runs)
            print(f"{model} fp8 T={t} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        rate = 2 * case_pairs * lat * inter * 3 / t_fwd / 1e12
        plain_rate = rate if name == "plain" else plain_rate
        print(f"{model} fp8 T={t:5d} {name:10s}: fwd {t_fwd * 1e3:7.2f} ms {rate:5.0f} TFLOPS "
              f"({rate / plain_rate:4.2f} of plain), temporaries {temp:.1f} GB", flush=True)
        b = f"training/{model}/fp8/{name}"
        rows += [(b, t, "fwd_ms", t_fwd * 1e3), (b, t, "fwd_tflops", rate), (b, t, "fwd_temp_GB", temp)]
        rows += [(b, t, "fwd_of_plain", rate / plain_rate)] if plain_rate == plain_rate else []
        if profile:
            print_profile(fwd, args, layers, profile)
    return rows


def measure_layer(model, t, impls, layers, repeats, seed=0):
    """Rows of the whole `MoELayer` (router, projections, dispatch and combine on the xla backend, the stage) at
    N = 1 with a rank's share of the experts (J routed experts, top-K of them), `t` tokens: `layer/<impl>` rows
    `fwd_ms`, `fwd_bwd_ms`, `fwd_bwd_temp_GB`."""
    import jax
    import jax.numpy as jnp

    from jax_latent_ep import routers
    from jax_latent_ep.layer import MoELayer

    c, b = MODELS[model], BLOCKS[model]
    j, lat, inter, k, d = c["j"], c["lat"], c["inter"], c["k"], b["hidden"]
    mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])
    keys = iter(jax.random.split(jax.random.key(seed), 16 * layers + 2))
    normal = lambda *s: jax.random.normal(next(keys), s, jnp.bfloat16) * s[-2] ** -0.5  # noqa: E731
    params = []
    for _ in range(layers):
        p = {"router": normal(d, j), "w_gate": normal(j, lat, inter), "w_up": normal(j, lat, inter),
             "w_down": normal(j, inter, lat)}
        if b["latent"]:
            p.update(latent_down=normal(d, lat), latent_up=normal(lat, d), norm=jnp.ones((lat,), jnp.bfloat16))
        if b["shared"]:
            p.update(shared_gate=normal(d, b["shared"]), shared_up=normal(d, b["shared"]),
                     shared_down=normal(b["shared"], d))
        params.append(p)
    x = jax.random.normal(next(keys), (t, d), jnp.bfloat16)
    dout = jax.random.normal(next(keys), (t, d), jnp.float32)
    rows = []
    for impl in impls:
        try:
            layer = MoELayer(mesh, hidden=d, experts=j, topk=k, intermediate=inter, router=routers.SoftmaxTopK(k),
                             latent=b["latent"], shared_intermediate=b["shared"], norm=b["norm"], max_tokens=t,
                             buckets=(t,), impl=impl, backend="xla", capacity_factor=1.25, overflow="drop")

            def fwd(x, ps):
                for p in ps:
                    x = (x.astype(jnp.float32) + layer(x, p).astype(jnp.float32)).astype(jnp.bfloat16)
                return x

            grad = jax.jit(jax.grad(lambda x, ps: jnp.sum(fwd(x, ps).astype(jnp.float32) * dout), argnums=(0, 1)))
            fwd = jax.jit(fwd)
            temp = grad.lower(x, params).compile().memory_analysis().temp_size_in_bytes / 1e9
            t_fwd, t_all = _time(fwd, (x, params), repeats) / layers, _time(grad, (x, params), repeats) / layers
        except Exception as e:  # noqa: BLE001  (a failing implementation is reported, the rest still run)
            print(f"{model} layer T={t} {impl}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        print(f"{model} layer T={t:5d} {impl:10s}: fwd {t_fwd * 1e3:7.2f} ms, fwd+bwd {t_all * 1e3:7.2f} ms, "
              f"gradient temporaries {temp:.1f} GB", flush=True)
        name = f"training/{model}/layer/{impl}"
        rows += [(name, t, "fwd_ms", t_fwd * 1e3), (name, t, "fwd_bwd_ms", t_all * 1e3),
                 (name, t, "fwd_bwd_temp_GB", temp)]
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="training.csv")
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--tokens", nargs="+", type=int, default=[1024, 4096, 8192])
    p.add_argument("--impls", nargs="*", default=["wgmma", "mosaic", "ragged_dot", "scan"],
                   help="the stage's implementations (none, with `--plain none`: no bf16 rows, e.g. `--fp8` alone)")
    p.add_argument("--layers", type=int, default=4, help="layers a program (fewer where --weights-gb says)")
    p.add_argument("--weights-gb", type=float, default=40.0,
                   help="a program's expert weights and their gradients stay within this many GiB (`fit_layers`)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--mosaic-tiles", nargs="*", default=[], help="BM,BN,STEPS: 'mosaic' with these tiles too")
    p.add_argument("--variants", nargs="*", default=[], choices=list(VARIANTS), help="these variants too (`VARIANTS`)")
    p.add_argument("--jax-config", nargs="*", default=[], help="NAME=true|false: jax.config updates (e.g. "
                   "jax_ragged_dot_use_gpu_pallas_triton_lowering=true), recorded in the backend name")
    p.add_argument("--plain", choices=("both", "xla", "bf16", "none"), default="both",
                   help="the references: 'plain' (xla), 'plain_bf16' (bf16), both, or none")
    p.add_argument("--profile", type=int, default=0, metavar="K",
                   help="print each forward + backward program's K kernels of the most GPU time (a GPU only)")
    p.add_argument("--layer", action="store_true", help="the whole MoELayer too (N = 1, a rank's share of experts)")
    p.add_argument("--fp8", action="store_true", help="the prefill forward on FP8 weights too (`measure_fp8`)")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    if args.smoke:
        MODELS["tiny"] = dict(j=4, lat=128, inter=128, k=4, ranks=8)
        BLOCKS["tiny"] = dict(hidden=256, latent=128, shared=128, norm=True)
        args.models, args.tokens, args.impls, args.layers, args.repeats = ["tiny"], [16], ["gmm", "scan"], 2, 1
        args.layer, args.fp8, args.profile = True, True, args.profile or 2
    import jax

    for item in args.jax_config:
        name, value = item.split("=")
        jax.config.update(name, value.lower() == "true")
    device = jax.devices()[0].device_kind
    refs = {"both": ("plain", "plain_bf16"), "xla": ("plain",), "bf16": ("plain_bf16",), "none": ()}[args.plain]
    rows = []
    for model in args.models:
        layers = fit_layers(model, args.layers, args.weights_gb)
        for t in args.tokens:
            tiles = [tuple(int(v) for v in s.split(",")) for s in args.mosaic_tiles]
            tag = "".join(f"+{item}" for item in args.jax_config)
            if args.impls or refs:
                rows += [(b + tag if b.count("/") > 1 else b, tk, m, v) for b, tk, m, v in measure(
                    model, t, args.impls, layers, args.repeats, tiles, refs, profile=args.profile,
                    variants=args.variants)]
            rows.append((f"training/{model}", t, "layers", layers))
            if args.layer:
                rows += [(b + tag, tk, m, v) for b, tk, m, v in measure_layer(model, t, args.impls, layers,
                                                                              args.repeats)]
            if args.fp8:  # FP8 weights, no gradients: a quarter of the bf16 weights and gradients' bytes
                rows += measure_fp8(model, t, min(args.layers, 4 * layers), args.repeats,
                                    "gmm" if args.smoke else "wgmma", profile=args.profile)
            # written after each point: a run cut off keeps what it measured
            write_rows(args.out, device, [(b, 1 if "/layer/" in b else MODELS[b.split("/")[1]]["ranks"], tk, m, v)
                                          for b, tk, m, v in rows])


if __name__ == "__main__":
    main()
