"""`MoEBlock`: `layer.MoELayer` as a Flax NNX module holding its weights as sharded `nnx.Param`s (needs flax)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_latent_ep.layer import MoELayer


def _leaves(spec, value):
    """`value`'s arrays paired with their PartitionSpecs (a weight format is a NamedTuple of arrays)."""
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return {f: (getattr(spec, f), getattr(value, f)) for f in value._fields}
    return {"": (spec, value)}


class MoEBlock(nnx.Module):
    """One MoE layer whose weights are `nnx.Param`s, each placed by its sharding (`MoELayer.param_specs`).

    Args:
      layer: the `MoELayer` (sizes, router, axes, buckets).
      params: its weights as `MoELayer.__call__` takes them (global arrays; expert weights in any format of
        `layer.expert_weights`), or None: `init` makes random bf16 ones.
      rngs: for `params=None`.

    `block(x, ids=None, weights=None, **kw)` is `layer(x, params, ids, weights, **kw)`: the same arguments, inside or
    outside the model's `shard_map`, differentiable with respect to the float weights (`nnx.grad`).
    """

    def __init__(self, layer: MoELayer, params: dict | None = None, *, rngs: nnx.Rngs | None = None):
        self.layer = layer
        if params is None:
            if rngs is None:
                raise ValueError("MoEBlock: give params, or rngs to draw random ones")
            params = init(layer, rngs)
        specs = layer.param_specs(params)
        self.formats = {name: type(v) for name, v in params.items() if isinstance(v, tuple)}
        self.weights = nnx.Dict({
            name: nnx.Dict({leaf or "value": nnx.Param(value, out_sharding=tuple(spec), mesh=layer.mesh)
                            for leaf, (spec, value) in _leaves(specs[name], params[name]).items()})
            for name in params})

    def params(self) -> dict:
        """The weights as `MoELayer.__call__` takes them."""
        out = {}
        for name, leaves in self.weights.items():
            arrays = {k: v[...] for k, v in leaves.items()}
            out[name] = self.formats[name](**arrays) if name in self.formats else arrays["value"]
        return out

    def __call__(self, x, ids=None, weights=None, **kw):
        return self.layer(x, self.params(), ids, weights, **kw)


def init(layer: MoELayer, rngs: nnx.Rngs) -> dict:
    """Random bf16 weights for `layer` (normal, scaled by 1 / sqrt(fan-in); the norm near 1)."""
    d, e, lat, i, s = layer.hidden, layer.shape.experts, layer.latent, layer.intermediate, layer.shared_intermediate

    def normal(shape, fan_in):
        return (jax.random.normal(rngs.params(), shape, jnp.float32) / jnp.sqrt(fan_in)).astype(jnp.bfloat16)

    params = {"w_gate": normal((e, lat, i), lat), "w_up": normal((e, lat, i), lat), "w_down": normal((e, i, lat), i)}
    if layer.router is not None:
        params["router"] = normal((d, e), d)
    if layer.has_latent:
        params["latent_down"], params["latent_up"] = normal((d, lat), d), normal((lat, d), lat)
    if layer.norm:
        params["norm"] = (1 + 0.1 * jax.random.normal(rngs.params(), (lat,))).astype(jnp.bfloat16)
    if s:
        params["shared_gate"], params["shared_up"] = normal((d, s), d), normal((d, s), d)
        params["shared_down"] = normal((s, d), s)
    return params

