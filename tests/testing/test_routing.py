"""The routing generators of `jax_latent_ep.testing.routing` produce what they promise."""

import numpy as np
import pytest

from jax_latent_ep import KIMI_K3, LatentMoEShape
from jax_latent_ep.testing import routing

SHAPE = LatentMoEShape(latent=64, experts=64, topk=8)


@pytest.mark.parametrize("name", routing.GENERATORS)
@pytest.mark.parametrize("shape", [SHAPE, KIMI_K3], ids=["small", "kimi"])
def test_generators(name, shape):
    rng = np.random.default_rng(0)
    ids, w = routing.generate(name, rng, (4, 7), shape, 8)
    assert ids.shape == w.shape == (4, 7, shape.topk) and ids.dtype == np.int32 and w.dtype == np.float32
    assert ids.min() >= 0 and ids.max() < shape.experts
    assert np.all(w > 0)
    np.testing.assert_allclose(w.sum(-1), 1, rtol=1e-5)
    distinct = np.array([len(set(row)) for row in ids.reshape(-1, shape.topk)])
    if name == "duplicates":
        assert np.any(distinct < shape.topk)
    elif not (name == "all_to_one_rank" and shape.topk > shape.experts // 8):
        assert np.all(distinct == shape.topk)


def test_all_to_one_rank_and_hot():
    rng = np.random.default_rng(1)
    ids, _ = routing.all_to_one_rank(rng, (5,), SHAPE, ranks=4, rank=2)
    assert np.all(ids // 16 == 2)
    ids, _ = routing.hot_expert(rng, (50,), SHAPE, hot=13)
    assert np.all(np.any(ids == 13, axis=-1))
    ids, _ = routing.skewed(rng, (200,), SHAPE)
    counts = np.bincount(ids.reshape(-1), minlength=64)
    assert counts.max() > 4 * counts.mean()


def test_out_of_range_generator():
    """`out_of_range` (not in GENERATORS): token 0 of each rank only bad ids, about a quarter of the rest bad,
    small negatives among them, the others random_topk's; `spoil_ids` at the harness's one in eight likewise."""
    shape, n = KIMI_K3, 2
    ids, w = routing.generate("out_of_range", np.random.default_rng(3), (n, 64), shape, n)
    bad = (ids < 0) | (ids >= shape.experts)
    assert ids.shape == (n, 64, shape.topk) and w.shape == ids.shape and ids.dtype == np.int32
    assert bad[:, 0].all() and 0.15 < bad[:, 1:].mean() < 0.35
    assert np.isin(ids, [-1, -(shape.experts // n - 1)]).any()
    topk = routing.random_topk(np.random.default_rng(3), (n, 64), shape)[0]  # what out_of_range drew first
    np.testing.assert_array_equal(ids[~bad], topk[~bad])
    good = routing.random_topk(np.random.default_rng(4), (64,), shape)[0]
    spoiled = routing.spoil_ids(np.random.default_rng(5), good, shape.experts, shape.experts // n, 0.125)
    changed = spoiled != good
    assert changed[0].all() and 0.05 < changed[1:].mean() < 0.2
    assert np.all((spoiled[changed] < 0) | (spoiled[changed] >= shape.experts))
