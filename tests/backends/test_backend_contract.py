"""Every backend against the NumPy contract model: received rows and the routed latent bit for bit, the
RMS-normed latent within 1 bf16 ulp. One test body, parametrized over backends (nvlink: GPUs only), rank
counts, token counts and routings; fresh random data in every case."""

import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import cuda_devices, xla_devices
from jax_latent_ep import KIMI_K3, ExpertParallel, LatentMoEShape
from jax_latent_ep.testing import check, routing

SMALL = LatentMoEShape(latent=512, experts=64, topk=4)
BACKENDS = ["xla", pytest.param("nvlink", marks=pytest.mark.gpu)]


def _devices(backend, n, shape=None):
    if backend != "nvlink":
        return xla_devices(n)
    devices = cuda_devices()
    if len(devices) < n:
        pytest.skip(f"needs {n} devices for backend {backend}, have {len(devices)}")
    if backend == "nvlink" and shape is not None:
        from jax_latent_ep.runtime import ffi
        from jax_latent_ep.runtime.ffi import gpu_arch

        try:
            ffi.find_kernel("dispatch", n, shape, gpu_arch(devices[0]))
        except LookupError:
            pytest.skip(f"no kernel compiled for {shape} at N={n} (the default build has Kimi K3 and DeepSeek-V3)")
    return devices[:n]


def run_and_check(backend, shape, n, t, max_tokens, routing_name="random_topk", seed_text=""):
    seed = zlib.crc32(f"{backend}/{shape}/{n}/{t}/{max_tokens}/{routing_name}/{seed_text}".encode())
    mesh = jax.make_mesh((n,), ("ep",), devices=_devices(backend, n, shape))
    case = check.make_case(seed, shape, n, t, max_tokens, routing_name)
    assert np.any(case.x.astype(np.float32) != 0)
    with ExpertParallel(mesh, "ep", max_tokens=max_tokens, shape=shape, backend=backend) as ep:
        assert ep.backend == backend
        got = check.run_case(ep, case)
    want = check.model_two_layers(case)
    stats = [check.compare_rank(got[r], want, r) for r in range(n)]
    assert sum(s["valid_rows"] for s in stats) > 0
    return stats


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,t", list(itertools.product([1, 2, 4, 8], [1, 5, 13])))
def test_kimi_k3_bit_exact(backend, n, t):
    """The must-show: Kimi K3's shape (L=3584, E=896, K=16), max_tokens=13 (S=16), every N and T."""
    run_and_check(backend, KIMI_K3, n, t, 13)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,t", [(1, 13), (2, 1), (2, 13), (4, 5), (8, 1), (8, 13)])
def test_small_shape_routings(backend, n, t):
    """A small shape, each case with another routing generator (random, skewed, hot expert, one rank, duplicates)."""
    name = routing.GENERATORS[(n + t) % len(routing.GENERATORS)]
    run_and_check(backend, SMALL, n, t, 13, name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", routing.GENERATORS)
def test_routings_at_full_stride(backend, name):
    """T == max_tokens == stride (no padding rows), N = 4, every routing generator."""
    run_and_check(backend, SMALL, 4, 8, 8, name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,t", [(1, 5), (2, 2), (2, 13), (4, 5)])
def test_out_of_range_ids_reach_no_rank(backend, n, t):
    """Ids outside [0, E) without `check_ids` (the API's documented behaviour): they select no rank in dispatch
    and combine and travel unchanged in the received ids; a token made of them only is routed to 0. Kimi K3
    (the shipped kernels), small negative ids among them."""
    stats = run_and_check(backend, KIMI_K3, n, t, 13, "out_of_range")
    assert sum(s["valid_rows"] for s in stats) <= 2 * n * n * (t - 1)  # two layers; no rank's token 0 reached one


@pytest.mark.parametrize("backend", BACKENDS)
def test_other_shapes(backend):
    """K = 1 and K = 32 with N = 2 (E not a power of two)."""
    run_and_check(backend, LatentMoEShape(latent=64, experts=6, topk=1), 2, 3, 3)
    run_and_check(backend, LatentMoEShape(latent=96, experts=40, topk=32), 2, 9, 11, "duplicates")


def test_model_quantizer_matches_numerics():
    """The model's own NumPy MXFP8 against `numerics.mxfp8_quantize`, including ftz blocks and non-finite
    blocks (scale 255; NaN-ness of elements compared, not NaN bits)."""
    from jax_latent_ep import mxfp8_dequantize, mxfp8_quantize
    from jax_latent_ep.testing import model

    rng = np.random.default_rng(7)
    x = check.random_latent(rng, (64,), 512).astype(np.float32)
    x[1, 5] = np.inf
    x[2, 40] = -np.inf
    x[3, 100] = np.nan
    x[4, 0:32] = np.float32(2.0**-130) * rng.standard_normal(32)  # bf16 subnormals only
    x[5, 0:32] = np.float32(448 * 2.0**-126)  # the closed form's boundary
    x = x.astype(check.BF16)
    q, sf = (np.asarray(a) for a in mxfp8_quantize(x))
    mq, msf = model.mxfp8_quantize(x)
    np.testing.assert_array_equal(sf, msf)
    qf, mqf = q.astype(np.float32), mq.astype(np.float32)
    np.testing.assert_array_equal(np.isnan(qf), np.isnan(mqf))
    finite = ~np.isnan(qf)
    np.testing.assert_array_equal(q.view(np.uint8)[finite], mq.view(np.uint8)[finite])
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(np.asarray(mxfp8_dequantize(q, sf)), model.mxfp8_dequantize(mq, msf))


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_tokens(backend):
    """Tokens holding Inf / NaN: their blocks get scale 255 and NaN elements where the input was not finite,
    identically in the backend and the model; other blocks and tokens are untouched."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jax_latent_ep.testing import model

    n, t, mt = 2, 4, 6
    rng = np.random.default_rng(11)
    x = check.random_latent(rng, (n, t), SMALL.latent, special=False).astype(np.float32)
    x[0, 1, 7], x[1, 3, 100], x[1, 3, 101], x[0, 2, 300] = np.inf, -np.inf, np.nan, np.nan
    x = x.astype(check.BF16)
    ids, w = routing.random_topk(rng, (n, t), SMALL)
    mesh = jax.make_mesh((n,), ("ep",), devices=_devices(backend, n, SMALL))
    with ExpertParallel(mesh, "ep", max_tokens=mt, shape=SMALL, backend=backend) as ep:
        def f(x, i, w):
            recv = ep.dispatch(x, i, w)
            return tuple(recv), ep.combine(jnp.where(recv.src[:, None] == -1, 0, 1).astype(jnp.bfloat16)
                                           * jnp.ones((1, SMALL.latent), jnp.bfloat16), i)

        put = lambda a: jax.device_put(a.reshape(n * t, -1), NamedSharding(mesh, P("ep")))  # noqa: E731
        recv, _ = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))(
            put(x), put(ids.astype(np.int32)), put(w))
        recv = [np.asarray(a) for a in recv]
    want = model.dispatch(x, ids, w, shape=SMALL, max_tokens=mt)
    assert np.any(want.sf == 255)
    for r in range(n):
        rows = slice(r * ep.rows, (r + 1) * ep.rows)
        check.compare_received(tuple(a[rows] for a in recv), want, r, "non-finite tokens")


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_chained_layers_program_matches_the_model(scan):
    """`check.chained_layers` (the multi-layer program of the GPU subprocess tests) with one routed layer, on the
    XLA backend over 2 CPU devices: its routed output bit for bit and its normed output within 1 bf16 ulp of the
    model's two layers, on fresh random data."""
    from jax_latent_ep.backends.xla import XlaBackend
    from jax_latent_ep.testing.model import bf16_ulp_diff

    n, t, max_tokens = 2, 5, 8
    mesh = jax.make_mesh((n,), ("ep",), devices=_devices("xla", n))
    case = check.make_case(zlib.crc32(f"chained/{scan}".encode()), SMALL, n, t, max_tokens)
    ep = XlaBackend(mesh, "ep", max_tokens, SMALL)
    routed, normed = (np.asarray(a) for a in check.chained_layers(ep, mesh, 1, scan)(*check.sharded_inputs(
        case, mesh, "ep")))
    _, want_routed, _, want_normed = check.model_two_layers(case)
    assert np.any(want_routed.astype(np.float32) != 0)
    assert np.array_equal(routed.view(np.uint16), want_routed.reshape(n * t, -1).view(np.uint16))
    assert bf16_ulp_diff(normed, want_normed.reshape(n * t, -1)).max() <= 1
