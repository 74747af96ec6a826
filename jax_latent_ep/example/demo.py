"""Demo: a few decode steps of a small latent MoE over every available device, checked against one device.

    python -m jax_latent_ep.example.demo [--backend auto|xla|nvlink] [--layers 4] [--steps 3] [--tokens 4]
                                 [--max-tokens T] [--ranks N] [--seed 0]
                                 [--shape auto|small|kimi|kimi_k3|deepseek_v3|L,E,K]

Without a GPU it runs on 8 virtual CPU devices (the flag is set before JAX is imported) with a small shape;
on GPUs with Kimi K3's latent shape, for which the NVLink kernels are built (`--shape auto`). It prints the
backend that ran, the time per layer, and how far the expert-parallel result is from the same model
computed on one device without collectives (exit status 1 if it is not close).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()


def _found(jax, gpus) -> str:
    """The demo's first line: the accelerators JAX found (and, without any, why that may be)."""
    if gpus:
        return (f"found: {len(gpus)} GPU(s) ({gpus[0].device_kind}), jax {jax.__version__} on "
                f"{jax.default_backend()}: running on the GPUs")
    import shutil

    hint = ("an NVIDIA driver is present but JAX has no CUDA plugin: `JAX_LATENT_EP_CUDA=auto ./dev setup` (or pip install "
            "'jax_latent_ep[cuda13]' / '[cuda12]', matching the driver)" if shutil.which("nvidia-smi") else "no GPU")
    return f"found: {hint}; jax {jax.__version__}: running on {len(jax.devices('cpu'))} CPU devices"


def _positive(text: str) -> int:
    """argparse type: an int >= 1 (a usage error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _shape(text: str):
    """argparse type: auto, small, kimi, a named shape (jax_latent_ep.shapes.SHAPES) or `L,E,K`."""
    from jax_latent_ep.shapes import SHAPES, LatentMoEShape

    if text in ("auto", "small", "kimi") or text in SHAPES:
        return text
    parts = text.split(",")
    try:
        if len(parts) != 3:
            raise ValueError("give L,E,K (three integers)")
        return LatentMoEShape(*(int(p) for p in parts))
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"{text!r}: {e}; use auto, small, kimi, {', '.join(SHAPES)} or L,E,K") from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="auto", choices=["auto", "xla", "nvlink"])
    parser.add_argument("--layers", type=_positive, default=4)
    parser.add_argument("--steps", type=_positive, default=3, help="decode steps (each feeds its output to the next)")
    parser.add_argument("--tokens", type=_positive, default=4, help="tokens per rank per step (T)")
    parser.add_argument("--max-tokens", type=_positive, default=None, help="max_tokens (default: --tokens; >= T)")
    parser.add_argument("--ranks", type=_positive, default=None,
                        help="expert-parallel ranks N (default: the most devices that divide the experts)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the parameters and the inputs")
    parser.add_argument("--shape", type=_shape, default="auto",
                        help="auto: kimi on GPUs (the NVLink kernels are built for it), small elsewhere; small, "
                             "kimi (= kimi_k3), deepseek_v3, or L,E,K")
    parser.add_argument("--hidden", type=_positive, default=256)
    parser.add_argument("--intermediate", type=_positive, default=32)
    args = parser.parse_args(argv)
    max_tokens = args.max_tokens or args.tokens
    if args.tokens > max_tokens:
        parser.error(f"--tokens {args.tokens} must not exceed --max-tokens {max_tokens}")
    if max_tokens >= 1 << 16:
        parser.error(f"--max-tokens {max_tokens} must be below 65536")

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jax_latent_ep import KIMI_K3, ExpertParallel, moe
    from jax_latent_ep.shapes import SHAPES

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    print(_found(jax, gpus), flush=True)
    if not isinstance(args.shape, str):
        shape = args.shape
    elif args.shape in SHAPES:
        shape = SHAPES[args.shape]
    else:
        kimi = args.shape == "kimi" or (args.shape == "auto" and bool(gpus))
        shape = KIMI_K3 if kimi else moe.SMALL
    devices = gpus or jax.devices("cpu")
    if args.ranks is not None:
        if args.ranks > len(devices):
            parser.error(f"--ranks {args.ranks}: only {len(devices)} {devices[0].platform} device(s)")
        if args.ranks > 32 or shape.experts % args.ranks:
            parser.error(f"--ranks {args.ranks} must be at most 32 and divide the {shape.experts} experts")
        n = args.ranks
    else:
        n = max(c for c in range(1, min(len(devices), 32) + 1) if shape.experts % c == 0)
    cfg = moe.MoEConfig(shape=shape, hidden=args.hidden, intermediate=args.intermediate, layers=args.layers)
    mesh = jax.make_mesh((n,), ("ep",), devices=devices[:n])
    t = args.tokens

    with ExpertParallel(mesh, "ep", max_tokens=max_tokens, shape=shape, backend=args.backend) as ep:
        print(f"jax {jax.__version__}, {n} x {devices[0].platform} devices ({devices[0].device_kind}); "
              f"backend: {ep.backend}" + (f" (auto: {ep.fallback_reason})" if ep.fallback_reason else ""))
        print(f"model: {cfg.layers} layers, L={shape.latent} E={shape.experts} K={shape.topk}, hidden {cfg.hidden}, "
              f"expert intermediate {cfg.intermediate}; {t} tokens per rank ({n * t} per step), max_tokens {max_tokens}, seed {args.seed}")
        params = moe.init_params(jax.random.key(args.seed), cfg)
        h = jax.random.normal(jax.random.key(args.seed + 1), (n * t, cfg.hidden), jnp.float32).astype(jnp.bfloat16)
        # Decode ranks hold different numbers of live tokens: rank r pads its last r % T tokens (ids -1).
        live = np.asarray([t - r % t for r in range(n)], np.int32)
        print(f"live tokens per rank: {live.tolist()} (the others are padding: routed to no expert)")
        forward = moe.make_forward(ep, cfg)
        sharded = moe.shard_params(params, mesh, "ep")
        reference = moe.make_reference_forward(cfg, n)
        one = devices[0]
        ref_params = jax.device_put(params, one)

        start = time.perf_counter()
        live_in = jax.device_put(live, NamedSharding(mesh, P("ep")))
        compiled = forward.lower(sharded, jax.device_put(h, NamedSharding(mesh, P("ep"))), live_in).compile()
        print(f"compiled in {time.perf_counter() - start:.1f} s")
        worst, times = 1.0, []
        for step in range(args.steps):
            h_in = jax.device_put(h, NamedSharding(mesh, P("ep")))
            start = time.perf_counter()
            out = compiled(sharded, h_in, live_in)
            out.block_until_ready()
            times.append(time.perf_counter() - start)
            got = np.asarray(out, np.float32)
            want = np.asarray(reference(ref_params, jax.device_put(h, one), jax.device_put(live, one)), np.float32)
            token_err = np.max(np.abs(got - want) / (1 + np.abs(want)), axis=1)
            exact = float(np.mean(got == want))
            close = float(np.mean(token_err <= 2e-2))
            worst = min(worst, close)
            print(f"step {step}: {times[-1] * 1e3 / cfg.layers:8.3f} ms per layer; vs one device: "
                  f"{100 * exact:.1f}% of values equal, {100 * close:.0f}% of tokens within 2e-2 "
                  f"(max |diff| / (1 + |ref|) = {float(token_err.max()):.2e})")
            h = out
        steady = times[1:] or times
        print(f"backend {ep.backend}: {1e3 * min(steady) / cfg.layers:.3f} ms per layer "
              f"(best of {len(steady)} step(s) after the first; {n} ranks, T={t})")
    # Tokens are independent; on GPUs a near-tie in a token's top-k may flip between the two programs (their
    # GEMMs may sum in different orders), which changes that token only. On CPU everything is bit-identical.
    if worst < 0.9:
        print(f"FAILED: only {100 * worst:.0f}% of tokens match the single-device model", file=sys.stderr)
        return 1
    print("OK: matches the single-device model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
