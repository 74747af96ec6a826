"""Gradients on one GPU: the nvlink backend's at N = 1 against the XLA backend's (`@pytest.mark.gpu`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_latent_ep import ExpertParallel, LatentMoEShape, moe
from conftest import cuda_devices


@pytest.mark.gpu
def test_nvlink_grads_equal_xla_grads_at_n1():
    """Both backends' forwards give bit-identical routed latents (the loss is equal to the bit) and the backward is
    the same XLA code (`jax_latent_ep.autodiff`; under differentiation the RMSNorm runs in XLA on both), compiled
    into two programs whose GEMMs XLA autotunes separately: so each gradient is equal within 2e-2 of its largest
    value (an FP32 accumulation order that moves a bf16 rounding by an ulp, carried through the layers)."""
    mesh = jax.make_mesh((1,), ("ep",), devices=cuda_devices()[:1])
    cfg = moe.MoEConfig(shape=LatentMoEShape(latent=512, experts=64, topk=4), hidden=256, layers=2)
    t = 8
    params = moe.init_params(jax.random.key(0), cfg)
    h = jax.random.normal(jax.random.key(1), (t, cfg.hidden)).astype(jnp.bfloat16)
    target = jax.random.normal(jax.random.key(2), (t, cfg.hidden), jnp.float32)
    grads = {}
    for name in ("xla", "nvlink"):
        with ExpertParallel(mesh, "ep", max_tokens=t, shape=cfg.shape, backend=name) as ep:
            forward = moe.make_forward(ep, cfg)
            loss = lambda p, h: jnp.sum(forward(p, h).astype(jnp.float32) * target)  # noqa: E731
            value, g = jax.jit(jax.value_and_grad(loss))(moe.shard_params(params, mesh, "ep"),
                                                        jax.device_put(h, NamedSharding(mesh, P("ep"))))
            grads[name] = (float(value), jax.tree.map(lambda a: np.asarray(a, np.float32), g))
    figures = {k: (float(np.abs(grads["nvlink"][1][k] - v).max()), float(np.abs(v).max()))
               for k, v in grads["xla"][1].items()}
    summary = ", ".join(f"{k} {d:.3g} / {m:.3g} ({d / m:.2e})" for k, (d, m) in figures.items())
    print(f"nvlink vs xla at N=1: loss {grads['nvlink'][0]} vs {grads['xla'][0]}; max abs grad difference / max "
          f"|grad| (relative): {summary}")
    assert grads["nvlink"][0] == grads["xla"][0]
    for k, (d, m) in figures.items():
        assert m > 0, k
        assert d <= 2e-2 * m, (k, d, m)
