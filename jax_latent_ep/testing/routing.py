"""Routing generators for tests and benchmarks: `(ids int32 [..., T, K], weights float32 [..., T, K])`.

Every generator takes a `numpy.random.Generator` and returns fresh ids in `[0, E)` and positive weights
that sum to 1 per token (normalized top-k weights, as a router produces them).

  random_topk       K distinct experts per token, uniformly
  skewed            K distinct experts per token, drawn with a Zipf-like popularity (a few hot experts)
  hot_expert        every token includes expert `hot` (all tokens reach its rank), the rest random
  all_to_one_rank   every expert of every token lives on rank `rank` (needs K <= E // N)
  duplicates        ids with repeats inside a token (allowed: a rank is reached once per token)

Not in GENERATORS (its ids break the rule above on purpose):

  out_of_range      random_topk with ids outside [0, E) mixed in (and token 0 made of them only): without the
                    API's `check_ids` every backend must route such ids to no rank and carry them unchanged
"""

from __future__ import annotations

import numpy as np

from jax_latent_ep.shapes import LatentMoEShape


def _weights(rng: np.random.Generator, lead: tuple[int, ...], k: int) -> np.ndarray:
    logits = rng.standard_normal((*lead, k)).astype(np.float32)
    w = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return (w / w.sum(axis=-1, keepdims=True)).astype(np.float32)


def _distinct(rng, lead, k, experts, p=None) -> np.ndarray:
    flat = int(np.prod(lead)) if lead else 1
    out = np.empty((flat, k), np.int32)
    for i in range(flat):
        out[i] = rng.choice(experts, size=k, replace=False, p=p)
    return out.reshape(*lead, k)


def random_topk(rng: np.random.Generator, lead: tuple[int, ...], shape: LatentMoEShape):
    """K distinct uniformly random experts per token."""
    lead = tuple(lead)
    return _distinct(rng, lead, shape.topk, shape.experts), _weights(rng, lead, shape.topk)


def skewed(rng: np.random.Generator, lead: tuple[int, ...], shape: LatentMoEShape, alpha: float = 1.2):
    """K distinct experts per token with popularity proportional to `1 / rank^alpha` over a random permutation."""
    lead = tuple(lead)
    p = 1.0 / np.arange(1, shape.experts + 1) ** alpha
    p = p[rng.permutation(shape.experts)]
    return _distinct(rng, lead, shape.topk, shape.experts, p / p.sum()), _weights(rng, lead, shape.topk)


def hot_expert(rng: np.random.Generator, lead: tuple[int, ...], shape: LatentMoEShape, hot: int = 0):
    """Every token routes to expert `hot` (in a random slot) plus K - 1 other distinct random experts."""
    lead = tuple(lead)
    ids = _distinct(rng, lead, shape.topk, shape.experts)
    flat = ids.reshape(-1, shape.topk)
    for row in flat:
        if hot not in row:
            row[rng.integers(shape.topk)] = hot
    return flat.reshape(ids.shape), _weights(rng, lead, shape.topk)


def all_to_one_rank(rng: np.random.Generator, lead: tuple[int, ...], shape: LatentMoEShape, ranks: int, rank: int = 0):
    """Every token routes only to experts of `rank` (distinct while K <= E // N, else with repeats)."""
    lead = tuple(lead)
    local = shape.num_local_experts(ranks)
    flat = int(np.prod(lead)) if lead else 1
    ids = np.empty((flat, shape.topk), np.int32)
    for i in range(flat):
        ids[i] = rank * local + rng.choice(local, size=shape.topk, replace=shape.topk > local)
    return ids.reshape(*lead, shape.topk), _weights(rng, lead, shape.topk)


def duplicates(rng: np.random.Generator, lead: tuple[int, ...], shape: LatentMoEShape):
    """Ids drawn with replacement from a few experts, so most tokens repeat some id (allowed by the contract)."""
    lead = tuple(lead)
    pool = rng.choice(shape.experts, size=max(1, min(shape.experts, shape.topk // 2 + 1)), replace=False)
    ids = rng.choice(pool, size=(*lead, shape.topk)).astype(np.int32)
    return ids, _weights(rng, lead, shape.topk)


def spoil_ids(rng: np.random.Generator, ids: np.ndarray, experts: int, local: int, fraction: float) -> np.ndarray:
    """A copy of `ids` (int32 `[..., T, K]`) with about `fraction` of its ids, and every id of token 0 of each
    leading index (it reaches no rank), replaced by one of -1, -(local - 1), -local, -2**31, E, E + local, 2**20,
    2**31 - 1 (`E = experts`; the small negatives are the ids a signed division by `local` would give to rank 0)."""
    bad = np.array([-1, -(local - 1), -local, -(1 << 31), experts, experts + local, 1 << 20, (1 << 31) - 1],
                   np.int64)
    bad = bad[(bad < 0) | (bad >= experts)]  # -(local - 1) is 0, a valid id, when local == 1
    spoil = rng.random(ids.shape) < fraction
    spoil[..., 0, :] = True
    spoiled = ids.astype(np.int64)
    spoiled[spoil] = bad[rng.integers(0, len(bad), size=int(spoil.sum()))]
    return spoiled.astype(np.int32)


def out_of_range(rng: np.random.Generator, lead: tuple[int, ...], shape: LatentMoEShape, ranks: int):
    """`random_topk`, then `spoil_ids` with about one id in four (`local = E // ranks`)."""
    ids, weights = random_topk(rng, tuple(lead), shape)
    return spoil_ids(rng, ids, shape.experts, shape.num_local_experts(ranks), 0.25), weights


GENERATORS = ("random_topk", "skewed", "hot_expert", "all_to_one_rank", "duplicates")


def generate(name: str, rng: np.random.Generator, lead: tuple[int, ...], shape: LatentMoEShape, ranks: int):
    """Dispatches to the generator `name` (one of GENERATORS) with its defaults."""
    if name == "random_topk":
        return random_topk(rng, lead, shape)
    if name == "skewed":
        return skewed(rng, lead, shape)
    if name == "hot_expert":
        return hot_expert(rng, lead, shape, hot=int(rng.integers(shape.experts)))
    if name == "all_to_one_rank":
        return all_to_one_rank(rng, lead, shape, ranks, rank=int(rng.integers(ranks)))
    if name == "duplicates":
        return duplicates(rng, lead, shape)
    if name == "out_of_range":
        return out_of_range(rng, lead, shape, ranks)
    raise ValueError(f"unknown routing generator {name!r}; expected one of {GENERATORS} or 'out_of_range'")
