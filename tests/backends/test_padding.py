"""`-1`, the "no expert" id, on every backend: a padded token (all ids -1) is sent to no rank and its combine
output is exactly 0, RMS-normed or not; an unused slot (-1 among valid ids) routes nowhere and changes nothing
else; with the expert stage in between, a live token equals the same token with its -1 slots dropped."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import cuda_devices, xla_devices
from jax_latent_ep import KIMI_K3, ExpertParallel, experts
from jax_latent_ep.testing import routing

BACKENDS = ["xla", pytest.param("nvlink", marks=pytest.mark.gpu)]
# "gather": on CPU XLA expands ragged_dot to every group (J times the work); the stage's numerics are the same
IMPL = "gather"


def _devices(backend, n):
    if backend == "xla":
        return xla_devices(n)
    devices = cuda_devices()
    if len(devices) < n:
        pytest.skip(f"needs {n} GPUs")
    return devices[:n]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,t", [(1, 5), (2, 7), (4, 3)])
def test_no_expert_id(backend, n, t):
    shape, mt = KIMI_K3, 8
    rng = np.random.default_rng(zlib.crc32(f"pad/{backend}/{n}/{t}".encode()))
    mesh = jax.make_mesh((n,), ("ep",), devices=_devices(backend, n))
    ids = np.stack([np.stack([rng.choice(shape.experts, shape.topk, replace=False) for _ in range(t)]) for _ in range(n)])
    ids = ids.astype(np.int32)  # [N, T, K]
    live = np.asarray([t - (r % t) for r in range(n)])  # a different live count per rank
    padded = np.arange(t)[None, :] >= live[:, None]  # [N, T]
    ids[padded] = -1
    unused = (rng.random(ids.shape) < 0.25) & ~padded[..., None]
    ids[unused] = -1  # unused slots of live tokens
    w = rng.random(ids.shape).astype(np.float32)
    x = rng.standard_normal((n, t, shape.latent)).astype(jnp.bfloat16)
    norm = (1 + 0.1 * rng.standard_normal(shape.latent)).astype(jnp.bfloat16)
    inter = 16  # small: the expert stage here is about routing, not GEMM speed
    wg = (rng.standard_normal((shape.experts, shape.latent, inter), np.float32) / 60).astype(jnp.bfloat16)
    wu = (rng.standard_normal((shape.experts, shape.latent, inter), np.float32) / 60).astype(jnp.bfloat16)
    wd = (rng.standard_normal((shape.experts, inter, shape.latent), np.float32) / 4).astype(jnp.bfloat16)

    with ExpertParallel(mesh, "ep", max_tokens=mt, shape=shape, backend=backend) as ep:
        def body(x, ids, w, wg, wu, wd):
            x, ids, w = x[0], ids[0], w[0]
            rank = jax.lax.axis_index("ep")
            recv = ep.dispatch(x, ids, w)
            out = experts.expert_stage(recv, rank, wg, wu, wd, impl=IMPL, max_tokens=mt, ranks=n)
            # a second layer pair for the normed combine (calls come in pairs)
            routed = ep.combine(out, ids)
            recv2 = ep.dispatch(x, ids, w)
            out2 = experts.expert_stage(recv2, rank, wg, wu, wd, impl=IMPL, max_tokens=mt, ranks=n)
            normed = ep.combine(out2, ids, norm)
            return recv.src[None], routed[None], normed[None]

        ex = P("ep")
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(ex, ex, ex, ex, ex, ex), out_specs=(ex, ex, ex)))
        put = lambda a: jax.device_put(jnp.asarray(a), NamedSharding(mesh, ex))  # noqa: E731
        src, routed, normed = (np.asarray(a) for a in fn(put(x), put(ids), put(w), put(wg), put(wu), put(wd)))

        # the same tokens with each -1 slot replaced by a valid id of weight 0 on the token's first rank: the
        # same destinations, so every live token's result must be bit-identical
        first = np.where(padded[..., None], 0, np.take_along_axis(ids, np.argmax(ids >= 0, axis=-1)[..., None], -1))
        ids_b = np.where(ids >= 0, ids, first).astype(np.int32)
        w_b = np.where(ids >= 0, w, 0.0).astype(np.float32)
        _, routed_b, normed_b = (np.asarray(a) for a in fn(put(x), put(ids_b), put(w_b), put(wg), put(wu), put(wd)))

    senders = [(s >> 16, s & 0xFFFF) for s in src.reshape(-1) if s != -1]
    assert senders and not any(padded[r, tt] for r, tt in senders), "a padded token was received somewhere"
    for a in (routed, normed):
        assert a.dtype == jnp.bfloat16
        assert np.all(np.asarray(a, np.float32)[padded] == 0) and not np.any(np.signbit(np.asarray(a, np.float32)[padded]))
        assert np.any(np.asarray(a, np.float32)[~padded] != 0)
    live_rows = ~padded
    np.testing.assert_array_equal(np.asarray(routed, np.float32)[live_rows], np.asarray(routed_b, np.float32)[live_rows])
    np.testing.assert_array_equal(np.asarray(normed, np.float32)[live_rows], np.asarray(normed_b, np.float32)[live_rows])
