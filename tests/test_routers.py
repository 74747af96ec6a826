"""`jax_latent_ep.routers` against float64 NumPy models of the same routing (stable argsort: ties by lower index)."""

import functools
import re

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from conftest import xla_devices
from jax_latent_ep.routers import SigmoidGroupTopK, SoftmaxTopK

# FP32 softmax / sigmoid, an FP32 sum of K weights and one division against float64: a few FP32 ulps (<= 3e-7 seen).
RTOL = 1e-6
# The smallest relative gap between two selection scores (or group scores) that a test's ids may depend on.
MARGIN = 1e-5

DTYPES = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32, "f64": np.float64}

# name: (router, E); the published configurations.
CONFIGS = {
    "deepseek-v3": (SigmoidGroupTopK(8, n_group=8, topk_group=4, routed_scaling_factor=2.5, normalize=True), 256),
    "kimi-k2": (SigmoidGroupTopK(8, n_group=1, topk_group=1, routed_scaling_factor=2.827, normalize=True), 384),
    "deepseek-v3-unnormalized": (SigmoidGroupTopK(8, 8, 4, 2.5, normalize=False), 256),
    "qwen3": (SoftmaxTopK(8, renormalize=True), 128),
    "mixtral": (SoftmaxTopK(2, renormalize=True), 8),
    "softmax-not-renormalized": (SoftmaxTopK(4, renormalize=False), 60),
}


def _top(choice, k):
    """ids of the k largest, largest first, ties by lower index (a stable sort of the negated values)."""
    return np.argsort(-choice, axis=-1, kind="stable")[:, :k]


def softmax_topk_numpy(router, logits64, bias64=None):
    """`SoftmaxTopK` in float64: `(ids int64 [T, K], weights float64 [T, K])`."""
    e = np.exp(logits64 - logits64.max(axis=-1, keepdims=True))
    probs = e / e.sum(axis=-1, keepdims=True)
    ids = _top(probs if bias64 is None else probs + bias64, router.topk)
    weights = np.take_along_axis(probs, ids, axis=-1)
    if router.renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return ids, weights


def _masked_choice(router, logits64, bias64):
    """(scores, choice with the dropped groups' experts at -inf, group scores or None), float64."""
    scores = 1.0 / (1.0 + np.exp(-logits64))
    choice = scores if bias64 is None else scores + bias64
    if router.topk_group == router.n_group:
        return scores, choice, None
    t, e = choice.shape
    grouped = choice.reshape(t, router.n_group, e // router.n_group)
    group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)
    keep = np.zeros((t, router.n_group), bool)
    np.put_along_axis(keep, _top(group_scores, router.topk_group), True, axis=-1)
    return scores, np.where(keep[:, :, None], grouped, -np.inf).reshape(t, e), group_scores


def sigmoid_group_topk_numpy(router, logits64, bias64=None):
    """`SigmoidGroupTopK` in float64: `(ids int64 [T, K], weights float64 [T, K])`."""
    scores, choice, _ = _masked_choice(router, logits64, bias64)
    ids = _top(choice, router.topk)
    weights = np.take_along_axis(scores, ids, axis=-1)
    if router.normalize:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return ids, weights * router.routed_scaling_factor


def numpy_model(router):
    """The router's float64 NumPy model, `model(logits64, bias64=None) -> (ids, weights)`."""
    model = softmax_topk_numpy if isinstance(router, SoftmaxTopK) else sigmoid_group_topk_numpy
    return functools.partial(model, router)


def decisive_gaps(router, logits64, bias64=None):
    """float64 [T]: each token's smallest relative gap among the comparisons that decide its ids and their order
    (the K + 1 largest selection scores in turn; with group masking also the last kept group against the first
    dropped): ids must agree between FP32 and float64 only where this is far above FP32 rounding."""
    if isinstance(router, SoftmaxTopK):
        e = np.exp(logits64 - logits64.max(axis=-1, keepdims=True))
        probs = e / e.sum(axis=-1, keepdims=True)
        choice, group_scores = (probs if bias64 is None else probs + bias64), None
    else:
        _, choice, group_scores = _masked_choice(router, logits64, bias64)
    lead = -np.sort(-choice, axis=-1)[:, : router.topk + 1]
    with np.errstate(invalid="ignore"):
        gaps = (lead[:, :-1] - lead[:, 1:]) / np.abs(lead[:, :-1])
    gaps = np.where(np.isfinite(lead[:, 1:]), gaps, np.inf).min(axis=-1)
    if group_scores is not None:
        g = -np.sort(-group_scores, axis=-1)
        k = router.topk_group
        gaps = np.minimum(gaps, (g[:, k - 1] - g[:, k]) / np.abs(g[:, k - 1]))
    return gaps


def distinct_logits(rng, tokens, experts, dtype):
    """[T, E] logits, each row a random permutation of distinct multiples of a power-of-two step (|k| <= 256:
    exact in bf16, f16, f32), spanning about [-4, 4], so no near-tie of the logits decides a selection."""
    step = 2.0 ** -int(np.ceil(np.log2(experts / 8)))
    k = np.stack([rng.permutation(experts) - experts // 2 for _ in range(tokens)])
    logits = (k * step).astype(dtype)
    assert np.array_equal(logits.astype(np.float64), k * step)
    return logits


def route(router, logits, bias=None):
    ids, weights = router(jnp.asarray(logits), None if bias is None else jnp.asarray(bias))
    assert ids.dtype == jnp.int32 and weights.dtype == jnp.float32
    assert ids.shape == weights.shape == (logits.shape[0], router.topk)
    return np.asarray(ids), np.asarray(weights)


def check_against_model(router, logits, bias=None):
    """Routes and compares with the float64 model fed the same values (upcast); returns the router's result."""
    ids, weights = route(router, logits, bias)
    ids64, weights64 = numpy_model(router)(logits.astype(np.float64), None if bias is None else bias.astype(np.float64))
    np.testing.assert_array_equal(ids, ids64)
    np.testing.assert_allclose(weights, weights64, rtol=RTOL, atol=0)
    return ids, weights


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("tokens", [1, 7, 64])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_matches_numpy_model(config, tokens, dtype, with_bias):
    router, experts = CONFIGS[config]
    rng = np.random.default_rng([tokens, experts, list(DTYPES).index(dtype), with_bias])
    logits = distinct_logits(rng, tokens, experts, DTYPES[dtype])
    bias = None
    if with_bias:
        # Exact in FP32; small shifts against the scores, as DeepSeek's e_score_correction_bias.
        bias = (rng.integers(-16, 16, experts) * 2.0**-8).astype(np.float32)
        if isinstance(router, SoftmaxTopK):
            bias = bias / experts
    bias64 = None if bias is None else bias.astype(np.float64)
    # Distinct logits still let two groups' top-2 sums (or a score plus its bias) come close: such tokens are
    # redrawn (seeded, so the data are fixed) until every decision has a margin of >= 100 FP32 ulps.
    for _ in range(100):
        bad = decisive_gaps(router, logits.astype(np.float64), bias64) < MARGIN
        if not bad.any():
            break
        logits[bad] = distinct_logits(rng, int(bad.sum()), experts, DTYPES[dtype])
    assert (decisive_gaps(router, logits.astype(np.float64), bias64) >= MARGIN).all()
    check_against_model(router, logits, bias)


def test_group_limit_limits():
    """The best single experts sit alone in groups whose top-2 sums lose: the router never takes them."""
    router, experts = CONFIGS["deepseek-v3"]
    size = experts // router.n_group
    rng = np.random.default_rng(1)
    tokens = 16
    logits = np.empty((tokens, experts), np.float32)
    strong_groups = []
    for t in range(tokens):
        row = -4.0 + rng.permutation(experts) * 2.0**-8  # background: sigmoid ~0.02
        groups = rng.permutation(router.n_group)
        solid, star = groups[:4], groups[4:]
        # 4 experts of logit 0.5..1.5 in each solid group: top-2 sum >= 2 * sigmoid(0.5) = 1.24.
        values = 0.5 + rng.permutation(16) * 2.0**-4
        for i, g in enumerate(solid):
            row[g * size + rng.choice(size, 4, replace=False)] = values[4 * i : 4 * i + 4]
        # One expert of logit 6..6.2 in each star group: top-2 sum < 1 + sigmoid(-3) = 1.05.
        for i, g in enumerate(star):
            row[g * size + rng.integers(size)] = 6.0 + i * 2.0**-4
        logits[t] = row
        strong_groups.append(set(solid.tolist()))
    ids, _ = check_against_model(router, logits)
    for t in range(tokens):
        assert set((ids[t] // size).tolist()) <= strong_groups[t]
    # Without the group limit the stars would win: the case tests something.
    ungrouped, _ = route(SigmoidGroupTopK(8, routed_scaling_factor=2.5), logits)
    assert all(not set((ungrouped[t, :4] // size).tolist()) & strong_groups[t] for t in range(tokens))


@pytest.mark.parametrize("config", ["kimi-k2", "deepseek-v3", "deepseek-v3-unnormalized"])
def test_bias_selects_but_does_not_weight(config):
    router, experts = CONFIGS[config]
    size = experts // router.n_group
    rng = np.random.default_rng(2)
    tokens = 8
    logits = distinct_logits(rng, tokens, experts, np.float32) * np.float32(0.5) + np.float32(1.0)  # [-1, 3]
    # 2 experts in each of 4 groups (so the group limit keeps them all), at the lowest logits of their rows.
    if router.n_group > 1:
        groups = rng.choice(router.n_group, 4, replace=False)
        biased = np.concatenate([g * size + rng.choice(size, 2, replace=False) for g in groups])
    else:
        biased = rng.choice(experts, 8, replace=False)
    low = -3.0 + np.arange(8) * 2.0**-4 + np.arange(tokens)[:, None] * 2.0**-8  # distinct, exact in FP32
    logits[:, biased] = low.astype(np.float32)
    bias = np.zeros(experts, np.float32)
    bias[biased] = 10.0
    ids, weights = check_against_model(router, logits, bias)
    for t in range(tokens):
        assert set(ids[t].tolist()) == set(biased.tolist())
        # Ordered by the selection score, here the logit (the bias is the same 10 on all of them).
        assert (np.diff(logits[t, ids[t]]) < 0).all()
    s = 1.0 / (1.0 + np.exp(-np.take_along_axis(logits, ids, axis=-1).astype(np.float64)))  # unbiased scores
    if router.normalize:
        s = s / (s.sum(axis=-1, keepdims=True) + 1e-20)
    np.testing.assert_allclose(weights, s * router.routed_scaling_factor, rtol=RTOL, atol=0)


def test_normalize_guard_keeps_underflowed_scores_finite():
    """Scores that underflow to 0 in FP32 (sigmoid(-200)) give weights 0 through DeepSeek's `sum + 1e-20`, not NaN."""
    router, experts = CONFIGS["deepseek-v3"]
    _, weights = route(router, np.full((2, experts), -200.0, np.float32))
    np.testing.assert_array_equal(weights, np.zeros((2, router.topk), np.float32))


def test_lax_top_k_breaks_ties_by_lower_index():
    rng = np.random.default_rng(3)
    x = rng.integers(0, 3, (32, 50)).astype(np.float32)  # many equal values
    values, ids = lax.top_k(jnp.asarray(x), 10)
    np.testing.assert_array_equal(np.asarray(ids), _top(x, 10))
    np.testing.assert_array_equal(np.asarray(lax.top_k(jnp.zeros((2, 9)), 4)[1]), [[0, 1, 2, 3]] * 2)


def test_ties_by_lower_expert_index():
    zeros = np.zeros((2, 16), np.float32)
    ids, weights = route(SoftmaxTopK(4), zeros)
    np.testing.assert_array_equal(ids, [[0, 1, 2, 3]] * 2)
    np.testing.assert_array_equal(weights, np.full((2, 4), 0.25, np.float32))
    rng = np.random.default_rng(4)
    logits = -1.0 - rng.permutation(16).astype(np.float32)[None] * 2.0**-4
    logits[0, [12, 9, 4]] = 1.0
    ids, _ = check_against_model(SoftmaxTopK(4), logits)
    np.testing.assert_array_equal(ids[0, :3], [4, 9, 12])

    grouped = SigmoidGroupTopK(8, n_group=8, topk_group=4, routed_scaling_factor=2.5)
    ids, _ = check_against_model(grouped, np.zeros((3, 64), np.float32))  # all groups tie: groups 0..3, experts 0..7
    np.testing.assert_array_equal(ids, [list(range(8))] * 3)
    # Groups 2 and 5 tie for the 4th kept group, with equal experts: group 2 (lower index) wins.
    logits = np.full((1, 64), -5.0, np.float32)
    for g in (0, 1, 3):
        logits[0, [8 * g + 1, 8 * g + 6]] = 6.0
    for g in (2, 5):
        logits[0, [8 * g + 3, 8 * g + 4]] = 1.0
    ids, _ = check_against_model(grouped, logits)
    np.testing.assert_array_equal(ids[0], [1, 6, 9, 14, 25, 30, 19, 20])
    # With K = 10 the kept group 2 and dropped group 5 show: the next are group 0's -5s, not group 5's 1s.
    ids, _ = check_against_model(SigmoidGroupTopK(10, n_group=8, topk_group=4), logits)
    np.testing.assert_array_equal(ids[0], [1, 6, 9, 14, 25, 30, 19, 20, 0, 2])
    ids, _ = check_against_model(SigmoidGroupTopK(10), logits)
    np.testing.assert_array_equal(ids[0], [1, 6, 9, 14, 25, 30, 19, 20, 43, 44])


@pytest.mark.parametrize("config", list(CONFIGS))
def test_jit_vmap_same_bits_as_eager(config):
    router, experts = CONFIGS[config]
    rng = np.random.default_rng(5)
    logits = jnp.asarray(distinct_logits(rng, 3 * 7, experts, ml_dtypes.bfloat16).reshape(3, 7, experts))
    bias = jnp.asarray((rng.integers(-16, 16, experts) * 2.0**-8).astype(np.float32))
    eager = [router(logits[b], bias) for b in range(3)]
    jitted = [jax.jit(router)(logits[b], bias) for b in range(3)]
    mapped = jax.vmap(router, in_axes=(0, None))(logits, bias)
    mapped_jit = jax.jit(jax.vmap(router, in_axes=(0, None)))(logits, bias)
    for b in range(3):
        for got in (jitted[b], (mapped[0][b], mapped[1][b]), (mapped_jit[0][b], mapped_jit[1][b])):
            np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(eager[b][0]))
            np.testing.assert_array_equal(np.asarray(got[1]).view(np.uint32), np.asarray(eager[b][1]).view(np.uint32))


@pytest.mark.parametrize("config", ["deepseek-v3", "qwen3"])
def test_shard_map_on_token_shards(config):
    router, experts = CONFIGS[config]
    mesh = Mesh(np.array(xla_devices(4)), ("ep",))
    rng = np.random.default_rng(6)
    logits = jnp.asarray(distinct_logits(rng, 4 * 5, experts, np.float32))
    bias = jnp.asarray((rng.integers(-16, 16, experts) * 2.0**-8).astype(np.float32))
    f = jax.jit(jax.shard_map(router, mesh=mesh, in_specs=(P("ep"), P()), out_specs=(P("ep"), P("ep"))))
    ids, weights = f(logits, bias)
    eager_ids, eager_weights = router(logits, bias)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(eager_ids))
    np.testing.assert_array_equal(np.asarray(weights).view(np.uint32), np.asarray(eager_weights).view(np.uint32))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: SoftmaxTopK(0), "topk=0"),
        (lambda: SoftmaxTopK(-3), "topk=-3"),
        (lambda: SoftmaxTopK(2.0), "topk=2.0"),
        (lambda: SoftmaxTopK(True), "topk=True"),
        (lambda: SoftmaxTopK(2, renormalize=1), "renormalize=1"),
        (lambda: SoftmaxTopK(2, renormalize="yes"), "renormalize='yes'"),
        (lambda: SigmoidGroupTopK(0), "topk=0"),
        (lambda: SigmoidGroupTopK(8, n_group=0), "n_group=0"),
        (lambda: SigmoidGroupTopK(8, n_group=4, topk_group=0), "topk_group=0"),
        (lambda: SigmoidGroupTopK(8, n_group=4, topk_group=5), "topk_group=5 must not exceed n_group=4"),
        (lambda: SigmoidGroupTopK(8, routed_scaling_factor=0), "routed_scaling_factor=0"),
        (lambda: SigmoidGroupTopK(8, routed_scaling_factor=-2.5), "routed_scaling_factor=-2.5"),
        (lambda: SigmoidGroupTopK(8, routed_scaling_factor=float("nan")), "routed_scaling_factor=nan"),
        (lambda: SigmoidGroupTopK(8, routed_scaling_factor=float("inf")), "routed_scaling_factor=inf"),
        (lambda: SigmoidGroupTopK(8, routed_scaling_factor="2.5"), "routed_scaling_factor='2.5'"),
        (lambda: SigmoidGroupTopK(8, routed_scaling_factor=True), "routed_scaling_factor=True"),
        (lambda: SigmoidGroupTopK(8, normalize=None), "normalize=None"),
    ],
)
def test_construction_errors(make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


@pytest.mark.parametrize(
    "router, logits, bias, message",
    [
        (SoftmaxTopK(2), np.zeros(8, np.float32), None, "shape (8,)"),
        (SigmoidGroupTopK(2), np.zeros((2, 3, 8), np.float32), None, "shape (2, 3, 8)"),
        (SoftmaxTopK(2), np.zeros((2, 8), np.int32), None, "int32"),
        (SoftmaxTopK(9), np.zeros((2, 8), np.float32), None, "topk=9 must not exceed the number of experts E=8"),
        (SigmoidGroupTopK(9), np.zeros((2, 8), np.float32), None, "topk=9 must not exceed the number of experts E=8"),
        (SoftmaxTopK(2), np.zeros((2, 8), np.float32), np.zeros(7, np.float32), "bias shape (7,) must be [E] = (8,)"),
        (SigmoidGroupTopK(2), np.zeros((2, 8), np.float32), np.zeros((1, 8), np.float32), "bias shape (1, 8)"),
        (SigmoidGroupTopK(2), np.zeros((2, 8), np.float32), np.zeros(8, np.int32), "bias dtype int32"),
        (
            SigmoidGroupTopK(2, n_group=3),
            np.zeros((2, 8), np.float32),
            None,
            "n_group=3 must divide the number of experts E=8",
        ),
        (SigmoidGroupTopK(2, n_group=8, topk_group=4), np.zeros((2, 8), np.float32), None, "E / n_group = 8 / 8 = 1"),
        (
            SigmoidGroupTopK(17, n_group=8, topk_group=2),
            np.zeros((2, 64), np.float32),
            None,
            "topk=17 exceeds the 16 experts of the kept groups (topk_group * E / n_group = 2 * 64 / 8)",
        ),
    ],
)
def test_call_errors(router, logits, bias, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        router(jnp.asarray(logits), None if bias is None else jnp.asarray(bias))
