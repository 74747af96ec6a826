"""The call-sequence cases on the NVLink backend at N = 1 (one H200): each is refused at trace time with the same
message as the XLA backend on CPU, after a correct layer was traced and run with the same object (nothing launched:
a correct layer runs afterwards)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import cuda_devices as _gpus
from jax_latent_ep import ExpertParallel
from jax_latent_ep.shapes import KIMI_K3

T = 4


def _cases(ep):
    e = lambda r: r.x.astype(jnp.bfloat16)  # noqa: E731
    layer = lambda x, i, w: ep.combine(e(ep.dispatch(x, i, w)), i)  # noqa: E731
    return {
        "unused_dispatch": lambda x, i, w: (ep.dispatch(x, i, w),
                                            ep.combine(jnp.zeros((ep.rows, KIMI_K3.latent), jnp.bfloat16), i))[1],
        "other_ids": lambda x, i, w: ep.combine(e(ep.dispatch(x, i, w)), i[::-1]),
        "combine_alone": lambda x, i, w: ep.combine(jnp.zeros((ep.rows, KIMI_K3.latent), jnp.bfloat16), i),
        "divergent_cond": lambda x, i, w: lax.cond(lax.axis_index("ep") + jnp.sum(i) > 0,
                                                   lambda: layer(x, i, w), lambda: x),
        "while_loop": lambda x, i, w: lax.fori_loop(0, 1 + lax.axis_index("ep"), lambda _, h: layer(h, i, w), x),
    }, layer


def _message(ep, fn, args):
    f = jax.jit(jax.shard_map(fn, mesh=ep.mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))
    try:
        f(*args)
    except ValueError as err:
        return str(err).split("\n")[0]
    return None


def _inputs(mesh):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, KIMI_K3.latent)).astype(jnp.bfloat16)
    ids = rng.integers(0, KIMI_K3.experts, (T, KIMI_K3.topk)).astype(np.int32)
    w = rng.random((T, KIMI_K3.topk)).astype(np.float32)
    return [jax.device_put(a, NamedSharding(mesh, P("ep"))) for a in (x, ids, w)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["unused_dispatch", "other_ids", "combine_alone", "divergent_cond", "while_loop"])
def test_sequence_case_same_error_as_cpu(case):
    gpu_mesh = jax.make_mesh((1,), ("ep",), devices=_gpus()[:1])
    cpu_mesh = jax.make_mesh((1,), ("ep",), devices=jax.devices("cpu")[:1])
    with ExpertParallel(gpu_mesh, "ep", max_tokens=T, shape=KIMI_K3, backend="nvlink") as nv, \
            ExpertParallel(cpu_mesh, "ep", max_tokens=T, shape=KIMI_K3, backend="xla") as xla:
        for ep, mesh in ((nv, gpu_mesh), (xla, cpu_mesh)):  # other traces first: the checks do not depend on them
            assert _message(ep, _cases(ep)[1], _inputs(mesh)) is None
        got = _message(nv, _cases(nv)[0][case], _inputs(gpu_mesh))
        want = _message(xla, _cases(xla)[0][case], _inputs(cpu_mesh))
        assert want is not None and got == want, (got, want)
        layer = _cases(nv)[1]  # nothing was launched: a correct layer runs and no error was recorded
        out = jax.jit(jax.shard_map(layer, mesh=gpu_mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))(*_inputs(gpu_mesh))
        out.block_until_ready()
        assert nv.status() == {} or all(r[0] == 0 for r in nv.status().values()), nv.status()
