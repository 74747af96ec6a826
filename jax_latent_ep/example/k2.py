"""An example DeepSeek-V3 / Kimi K2 style MoE model on `MoELayer`, from the published configurations.

    cfg = KIMI_K2                                    # hidden 7168, 384 experts, top-8, a shared expert
    layer = make_layer(mesh, cfg)                    # the MoE block of one decoder layer
    y = forward(layer, [params] * n_layers, x)       # x [B, S, 7168] bf16, replicated over the EP axis

Each decoder layer's MoE block is `h + moe(h)`: sigmoid scores with the selection bias `e_score_correction_bias`,
group-limited top-8 (`n_group`, `topk_group`), the chosen unbiased scores normalized and scaled by
`routed_scaling_factor`; routed SwiGLU experts of `moe_intermediate_size`, one shared expert of the same size; no
latent projection and no norm inside the block (`L = hidden`). Attention is not part of this example.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jax_latent_ep.layer import MoELayer
from jax_latent_ep.routers import SigmoidGroupTopK
from jax_latent_ep.testing import layer_model


@dataclasses.dataclass(frozen=True)
class MoEFamilyConfig:
    """The MoE block of a DeepSeek-V3 / Kimi K2 checkpoint's `config.json` (the names it uses)."""

    hidden_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool = True

    def router(self) -> SigmoidGroupTopK:
        return SigmoidGroupTopK(self.num_experts_per_tok, n_group=self.n_group, topk_group=self.topk_group,
                                routed_scaling_factor=self.routed_scaling_factor, normalize=self.norm_topk_prob)


KIMI_K2 = MoEFamilyConfig(hidden_size=7168, n_routed_experts=384, num_experts_per_tok=8, moe_intermediate_size=2048,
                          n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.827)
DEEPSEEK_V3 = MoEFamilyConfig(hidden_size=7168, n_routed_experts=256, num_experts_per_tok=8,
                              moe_intermediate_size=2048, n_shared_experts=1, n_group=8, topk_group=4,
                              routed_scaling_factor=2.5)


def make_layer(mesh, cfg: MoEFamilyConfig, **options) -> MoELayer:
    """The MoE block of `cfg` over `mesh` (`options`: `MoELayer`'s, e.g. `ep_axis`, `tp_axis`, `max_tokens`)."""
    return MoELayer(mesh, hidden=cfg.hidden_size, experts=cfg.n_routed_experts, topk=cfg.num_experts_per_tok,
                    intermediate=cfg.moe_intermediate_size, router=cfg.router(),
                    shared_intermediate=cfg.n_shared_experts * cfg.moe_intermediate_size, **options)


def random_params(rng: np.random.Generator, cfg: MoEFamilyConfig) -> dict:
    """Random bf16 weights of one block in the layer's layout (`testing.layer_model.random_params`): router `[D, E]`
    and its bias `[E]` (f32), `w_gate`, `w_up` `[E, D, I]`, `w_down` `[E, I, D]`, the shared expert's `[D, Is]`,
    `[D, Is]`, `[Is, D]`."""
    return layer_model.random_params(rng, hidden=cfg.hidden_size, experts=cfg.n_routed_experts,
                                     intermediate=cfg.moe_intermediate_size,
                                     shared_intermediate=cfg.n_shared_experts * cfg.moe_intermediate_size, bias=True)


def forward(layer: MoELayer, params: list[dict], x):
    """`x` through one MoE block per entry of `params`, each `h + moe(h)` (bf16)."""
    for p in params:
        x = (x.astype(jnp.float32) + layer(x, p).astype(jnp.float32)).astype(jnp.bfloat16)
    return x


__all__ = ["DEEPSEEK_V3", "KIMI_K2", "MoEFamilyConfig", "forward", "make_layer", "random_params"]
