"""A latent MoE decode model in Flax NNX on `ExpertParallel`, checked against the same model on one device.

    python examples/flax_moe.py [--backend auto|xla|nvlink] [--layers 2] [--tokens 4]     (pip install flax)

`LatentMoEBlock` is an `nnx.Module` holding one layer's parameters as `nnx.Param`s, each with its
`out_sharding` (the SwiGLU expert weights `w_gate`, `w_up` `[E, L, I]`, `w_down` `[E, I, L]` over the `ep` axis,
the rest replicated).
Built under `jax.set_mesh(mesh)`, every Param is placed as its `out_sharding` says. `LatentMoE` stacks blocks;
its `__call__` splits the module into a graph and a state, gives `jax.shard_map` the state's specs from the
params' metadata (`nnx.get_partition_spec`), and runs every block inside one `jax.shard_map` over the mesh,
where each block's `local` method is the per-rank layer: router -> down projection -> `ep.dispatch` -> this rank's
experts on the dequantized MXFP8 rows (`jax_latent_ep.experts`: the plan of (row, local expert) pairs and the
grouped SwiGLU) -> `ep.combine` (RMSNorm) -> up projection + residual. The check is `moe.reference_layer`, the
same layer on one device without collectives: on CPU the two are bit for bit equal.

Not part of the wheel (a top-level example); CI runs it on 8 CPU devices (tests/examples/test_flax_moe.py).
"""

from __future__ import annotations

import argparse
import os
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jax_latent_ep import ExpertParallel, experts, moe  # noqa: E402
from jax_latent_ep.experts.stage import swiglu_rows  # noqa: E402

NAMES = ("router", "down", "w_gate", "w_up", "w_down", "up", "norm")


class LatentMoEBlock(nnx.Module):
    """One latent MoE decode layer (`moe.MoEConfig` sizes: hidden H, latent L, experts E, top-K, intermediate I).

    Params (bf16): router `[H, E]`, down `[H, L]`, w_gate and w_up `[E, L, I]`, w_down `[E, I, L]` sharded over
    `axis_name` on their expert dimension (rank `d` holds experts `d * E/N ... (d + 1) * E/N - 1`), up `[L, H]`, norm `[L]`.
    """

    def __init__(self, cfg: moe.MoEConfig, axis_name: str = "ep", *, rngs: nnx.Rngs):
        s, h, i = cfg.shape, cfg.hidden, cfg.intermediate
        self.cfg, self.axis_name = cfg, axis_name

        def param(shape, fan_in, sharding=None):
            value = (jax.random.normal(rngs.params(), shape, jnp.float32) / jnp.sqrt(fan_in)).astype(jnp.bfloat16)
            return nnx.Param(value, out_sharding=sharding or (None,) * len(shape))

        self.router = param((h, s.experts), h)
        self.down = param((h, s.latent), h)
        self.w_gate = param((s.experts, s.latent, i), s.latent, (axis_name, None, None))
        self.w_up = param((s.experts, s.latent, i), s.latent, (axis_name, None, None))
        self.w_down = param((s.experts, i, s.latent), i, (axis_name, None, None))
        self.up = param((s.latent, h), s.latent)
        norm = (1 + 0.1 * jax.random.normal(rngs.params(), (s.latent,))).astype(jnp.bfloat16)
        self.norm = nnx.Param(norm, out_sharding=(None,))

    def local(self, ep: ExpertParallel, h):
        """The layer on one rank, inside `jax.shard_map` over `ep.axis_name`: h bf16 `[T, H]` -> bf16 `[T, H]`
        (this rank's tokens; the expert weights hold this rank's `E/N` experts only)."""
        shape = ep.shape
        local = shape.num_local_experts(ep.ranks)
        rank = lax.axis_index(ep.axis_name).astype(jnp.int32)
        ids, weights = moe.route(h, self.router[...], shape.topk)                   # [T, K] int32 / f32
        x = jnp.dot(h, self.down[...], preferred_element_type=jnp.float32).astype(jnp.bfloat16)  # [T, L]
        recv, xf = ep.dispatch(x, ids, weights, dequantize=True)                      # N*S rows, f32 latent
        pl = experts.plan(recv, rank, local, max_tokens=ep.max_tokens, ranks=ep.ranks)  # the local pairs
        out = swiglu_rows(pl, xf.astype(jnp.bfloat16), self.w_gate[...], self.w_up[...],
                                  self.w_down[...])                                   # bf16 [N*S, L]
        y = ep.combine(out, ids, self.norm[...], self.cfg.eps)                        # bf16 [T, L], RMS-normed
        return h + jnp.dot(y, self.up[...], preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    def as_dict(self) -> dict:
        """The parameters as `moe.reference_layer` takes them (all experts, as global arrays)."""
        return {name: getattr(self, name)[...] for name in NAMES}


class LatentMoE(nnx.Module):
    """`cfg.layers` blocks, one expert-parallel program: `model(ep, h)` with h bf16 `[N*T, H]` sharded over
    `ep.axis_name` (rank `r` owns rows `r*T ... r*T + T - 1`) returns bf16 `[N*T, H]` laid out the same way."""

    def __init__(self, cfg: moe.MoEConfig, axis_name: str = "ep", *, rngs: nnx.Rngs):
        self.blocks = nnx.List([LatentMoEBlock(cfg, axis_name, rngs=rngs) for _ in range(cfg.layers)])
        self.axis_name = axis_name

    def __call__(self, ep: ExpertParallel, h):
        graphdef, state = nnx.split(self)
        specs = nnx.get_partition_spec(state)  # from each Param's out_sharding

        def body(state, h):  # per rank: the state holds this rank's experts
            model = nnx.merge(graphdef, state)
            for block in model.blocks:
                h = block.local(ep, h)
            return h

        return jax.shard_map(body, mesh=ep.mesh, in_specs=(specs, P(self.axis_name)), out_specs=P(self.axis_name))(
            state, h)


def run(backend: str = "auto", layers: int = 2, tokens: int = 4, devices=None) -> dict:
    """Builds the model over the largest expert-dividing number of `devices` (default: the GPUs, else the CPU
    devices), runs one decode step expert-parallel and on one device, and returns what it found:
    {"ranks", "backend", "equal" (fraction of output values bit-identical), "max_rel" (max |diff| / (1 + |ref|))}."""
    cfg = moe.MoEConfig(shape=moe.SMALL, layers=layers)
    if devices is None:
        devices = [d for d in jax.devices() if d.platform == "gpu"] or jax.devices("cpu")
    n = max(c for c in range(1, min(len(devices), 32) + 1) if cfg.shape.experts % c == 0)
    mesh = jax.make_mesh((n,), ("ep",), devices=devices[:n])
    with jax.set_mesh(mesh):  # each Param is placed by its out_sharding as it is created (eager sharding)
        model = LatentMoE(cfg, "ep", rngs=nnx.Rngs(params=0))
    w_gate = model.blocks[0].w_gate[...]
    assert w_gate.sharding.spec == P("ep", None, None), w_gate.sharding  # the experts are sharded over ep:
    assert {s.data.shape[0] for s in w_gate.addressable_shards} == {cfg.shape.experts // n}  # E/N per device
    h = jax.random.normal(jax.random.key(1), (n * tokens, cfg.hidden), jnp.float32).astype(jnp.bfloat16)
    with ExpertParallel(mesh, "ep", max_tokens=tokens, shape=cfg.shape, backend=backend) as ep:
        forward = nnx.jit(lambda model, h: model(ep, h))
        got = np.asarray(forward(model, jax.device_put(h, NamedSharding(mesh, P("ep")))), np.float32)
        chosen = ep.backend
    one = devices[0]
    want = jax.device_put(h, one)
    layer = jax.jit(lambda p, h: moe.reference_layer(p, h, cfg.shape, n, cfg.eps))
    for block in model.blocks:
        want = layer(jax.device_put(jax.tree.map(np.asarray, block.as_dict()), one), want)  # unsharded copies
    want = np.asarray(want, np.float32)
    return {"ranks": n, "backend": chosen, "equal": float(np.mean(got == want)),
            "max_rel": float(np.max(np.abs(got - want) / (1 + np.abs(want))))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="auto", choices=["auto", "xla", "nvlink"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4)
    args = parser.parse_args(argv)
    found = run(args.backend, args.layers, args.tokens)
    import flax

    print(f"flax {flax.__version__} NNX latent MoE, {args.layers} layers, {found['ranks']} ranks, backend "
          f"{found['backend']}: {100 * found['equal']:.1f}% of output values equal to one device "
          f"(max |diff| / (1 + |ref|) = {found['max_rel']:.2e})")
    # On CPU bit-identical; on GPUs a near-tie in a token's top-k may flip between the two programs.
    return 0 if found["max_rel"] <= 2e-2 or found["equal"] >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
