"""The DeepSeek-V3 / Kimi K2 style example (`example/k2.py`): its published configurations, and a scaled copy of the
family (same routing, shared expert, `L` = hidden) through two blocks against the float64 NumPy model, with tokens
`[B, S, D]` replicated over the EP axis of a (dp, ep) mesh (`layer_model.assert_close`, per block)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_latent_ep.example import k2
from jax_latent_ep.testing import layer_model


def test_published_configurations():
    for cfg, experts, groups in ((k2.KIMI_K2, 384, (1, 1)), (k2.DEEPSEEK_V3, 256, (8, 4))):
        assert (cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok) == (7168, experts, 8)
        assert (cfg.n_group, cfg.topk_group) == groups and cfg.n_shared_experts == 1
    mesh = jax.make_mesh((8,), ("ep",), devices=jax.devices("cpu")[:8])
    layer = k2.make_layer(mesh, k2.KIMI_K2, max_tokens=4)
    assert (layer.local_experts, layer.latent, layer.shared_intermediate) == (48, 7168, 2048)
    params = jax.eval_shape(lambda: k2.random_params(np.random.default_rng(0), dataclasses.replace(
        k2.KIMI_K2, n_routed_experts=8)))  # shapes only: the full layer is 17 G weights
    assert params["w_gate"].shape == (8, 7168, 2048) and params["shared_down"].shape == (2048, 7168)


def test_scaled_family_against_the_float64_model():
    cfg = dataclasses.replace(k2.DEEPSEEK_V3, hidden_size=128, n_routed_experts=32, moe_intermediate_size=128)
    mesh = jax.make_mesh((2, 4), ("dp", "ep"), devices=jax.devices("cpu")[:8])
    layer = k2.make_layer(mesh, cfg, token_axes=("dp",), max_tokens=8)
    rng = np.random.default_rng(21)
    params = [k2.random_params(rng, cfg) for _ in range(2)]
    x = jnp.asarray(rng.standard_normal((2, 5, cfg.hidden_size)), jnp.bfloat16)  # [B, S, D], B over dp
    got = np.asarray(jax.jit(lambda x, ps: k2.forward(layer, ps, x))(x, params), np.float64)
    h = np.asarray(x, np.float64).reshape(-1, cfg.hidden_size)
    for p in params:
        ids, w = layer_model.route(cfg.router(), h, p)
        moe = layer_model.layer(h, p, ids, w, ranks=4, shared=True)
        h = layer_model.bf16(h + moe)
    layer_model.assert_close(got.reshape(-1, cfg.hidden_size), h)
