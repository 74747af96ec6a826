"""Model checking of the dispatch / combine synchronisation (`jax_latent_ep.testing.protocol`).

The kernels' steps over N ranks and three consecutive layers are explored exhaustively for N = 2 and N = 3
(small T and grids: see `EXHAUSTIVE`), and along random schedules with random routings for N up to 8. The
correct protocol must show no violation and always finish; each broken variant must be caught with its own
violation kind. The model is pure Python, loaded from its file (the `jax_latent_ep` package is not imported).
"""

import importlib.util
import os
import pathlib
import random
import sys

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[1] / "jax_latent_ep" / "testing" / "protocol.py"


def _load():
    name = "jax_latent_ep.testing.protocol"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location("_ep_protocol", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["_ep_protocol"] = module
    spec.loader.exec_module(module)
    return module


P = _load()

# (ranks, tokens, dispatch grid, combine grid): every reachable state over three layers (counts and times in
# docs/protocol.md). N = 3 stops at T = 2 and grids of 2 (~0.1 M states); larger N = 3 configurations and
# N >= 4 are left to the random schedules.
EXHAUSTIVE = [
    (2, 1, 1, 1),
    (2, 1, 1, 2),
    (2, 1, 2, 3),  # a dispatch CTA with no token, combine CTAs with no row / no token
    (2, 2, 2, 1),
    (2, 2, 2, 2),
    (3, 1, 1, 1),
    (3, 1, 1, 2),
    (3, 2, 2, 1),
    (3, 2, 2, 2),
]
# The same with every read of a row or slot its own step (`atomic_reads=False`): the finer interleavings.
FINE = [(2, 1, 1, 1), (2, 1, 1, 2), (2, 2, 2, 1), (2, 2, 2, 2), (3, 1, 1, 1)]


# Random schedules per configuration (three random configurations per N); raise it for a longer search.
RANDOM_RUNS = int(os.environ.get("JAX_LATENT_EP_PROTOCOL_RUNS", "5"))


def _config(ranks, tokens, dgrid, cgrid, **variant):
    return P.Config(ranks=ranks, tokens=tokens, dispatch_grid=dgrid, combine_grid=cgrid, **variant)


def _describe(result):
    lines = [f"{result.states} states"]
    for kind, (message, path) in result.violations.items():
        lines.append(f"{kind}: {message}")
        lines.extend(f"    {step}" for step in path[-12:])
    return "\n".join(lines)


@pytest.mark.parametrize("ranks,tokens,dgrid,cgrid", EXHAUSTIVE)
def test_exhaustive_correct_protocol(ranks, tokens, dgrid, cgrid):
    result = P.explore(_config(ranks, tokens, dgrid, cgrid))
    assert result.complete
    assert result.ok, _describe(result)
    # every schedule ends in the one final state: every flag and row re-armed, nothing pending
    assert result.finished == 1
    assert result.states > 100


@pytest.mark.parametrize("ranks,tokens,dgrid,cgrid", FINE)
def test_exhaustive_correct_protocol_fine_reads(ranks, tokens, dgrid, cgrid):
    result = P.explore(_config(ranks, tokens, dgrid, cgrid, atomic_reads=False))
    assert result.complete and result.ok and result.finished == 1, _describe(result)


@pytest.mark.parametrize("ranks,tokens,dgrid,cgrid", FINE + [(3, 1, 1, 2), (3, 2, 2, 1)])
def test_exhaustive_correct_protocol_rearm_before_reads(ranks, tokens, dgrid, cgrid):
    """The seed's order: the last waiter re-arms the flags before its own reads (the kernels: after them)."""
    result = P.explore(_config(ranks, tokens, dgrid, cgrid, rearm_at_end=False))
    assert result.complete and result.ok and result.finished == 1, _describe(result)


@pytest.mark.parametrize("ranks", [2, 3])
def test_exhaustive_every_route_two_layers(ranks):
    """Routes of one token per rank that change from layer to layer (layers 0 and 2 alike, layer 1 another):
    the token reaches every rank, no rank, only its own rank, only the next rank."""
    full, none = (1 << ranks) - 1, 0
    patterns = [
        lambda s: full,
        lambda s: none,
        lambda s: 1 << s,
        lambda s: 1 << (s + 1) % ranks,
    ]
    for first in patterns:
        for second in patterns:
            route = tuple(tuple((p(s),) for s in range(ranks)) for p in (first, second, first))
            result = P.explore(P.Config(ranks=ranks, route=route))
            assert result.complete and result.ok and result.finished == 1, _describe(result)


@pytest.mark.parametrize("ranks", [2, 3, 4, 5, 6, 7, 8])
def test_random_schedules_correct_protocol(ranks):
    rng = random.Random(ranks)
    runs = 0
    for case in range(3):
        tokens = rng.randint(1, 3)
        config = P.Config(
            ranks=ranks,
            tokens=tokens,
            dispatch_grid=tokens + rng.randint(0, 1),
            combine_grid=rng.randint(1, 3),
            route=P.random_route(rng, ranks, tokens, 3),
        )
        result = P.random_runs(config, runs=RANDOM_RUNS, seed=case)
        assert result.ok, _describe(result)
        assert result.finished == RANDOM_RUNS
        runs += result.finished
    assert runs == 3 * RANDOM_RUNS


# ----------------------------------------------------------------------------------------------------------
# Broken variants: each must be caught, with its own kind of violation.

BROKEN = {
    # one fence by lane 0 after the CTA barrier, instead of one per storing thread: rows land after the flag
    "fence_after_barrier": (dict(fence_per_thread=False), P.READ_BEFORE_WRITE),
    # the same in combine only: a partial is read before it landed
    "fence_after_barrier_combine": (
        dict(fence_per_thread=False, unfenced_kernels=("combine",)),
        P.READ_BEFORE_WRITE,
    ),
    # each flag re-armed by the rank that raised it (after its own wait), not by its reader
    "rearm_by_writer": (dict(rearm_by_writer=True), P.FLAG_REARMED_UNSEEN),
    # the next layer's dispatch starts as soon as the combine started, not after it finished
    "dispatch_before_combine_finished": (dict(stream_order=False), P.OVERWRITE_UNREAD),
    # every dispatch waiter re-arms after its own wait (no CTRL_DISPATCH_SEEN): needs two dispatch CTAs
    "no_seen_counter": (dict(seen_counter=False), P.FLAG_REARMED_UNSEEN),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
@pytest.mark.parametrize("ranks,tokens,dgrid,cgrid", [(2, 1, 2, 1), (3, 1, 2, 1), (2, 2, 2, 2)])
def test_exhaustive_catches_broken_variant(name, ranks, tokens, dgrid, cgrid):
    variant, kind = BROKEN[name]
    result = P.explore(_config(ranks, tokens, dgrid, cgrid, **variant), stop_at=lambda r: kind in r.violations)
    assert kind in result.violations, _describe(result)
    message, path = result.violations[kind]
    assert path and message.startswith(path[-1]) or kind == P.DEADLOCK
    if name == "fence_after_barrier_combine":
        assert "partial" in message
    elif name == "fence_after_barrier":
        assert "row" in message


def test_broken_variants_all_kinds_small():
    """The full state space of N = 2 for each broken variant: every kind of violation each one leads to."""
    found = {}
    for name, (variant, _) in BROKEN.items():
        result = P.explore(_config(2, 1, 2, 1, **variant))
        assert result.complete
        found[name] = result.kinds()
    assert found["fence_after_barrier"] >= {P.READ_BEFORE_WRITE, P.OVERWRITE_UNREAD, P.STALE_READ}
    # combine's re-arm of a row landing late: the next layer's row lands on it first, or a reader sees it
    assert found["fence_after_barrier_combine"] >= {P.READ_BEFORE_WRITE, P.OVERWRITE_UNREAD}
    assert found["rearm_by_writer"] == {P.FLAG_REARMED_UNSEEN}
    assert found["dispatch_before_combine_finished"] >= {P.OVERWRITE_UNREAD, P.FLAG_RAISED_WHILE_SET}
    assert found["no_seen_counter"] == {P.FLAG_REARMED_UNSEEN}


@pytest.mark.parametrize("ranks", [4, 6, 8])
@pytest.mark.parametrize("name", sorted(BROKEN))
def test_random_schedules_catch_broken_variant(name, ranks):
    variant, kind = BROKEN[name]
    rng = random.Random(ranks)
    config = P.Config(
        ranks=ranks, tokens=2, dispatch_grid=2, combine_grid=2, route=P.random_route(rng, ranks, 2, 3), **variant
    )
    found = set()
    for seed in range(40):
        found |= P.random_runs(config, runs=1, seed=seed).kinds()
        if kind in found:
            break
    assert kind in found, found


def test_rearm_by_writer_deadlocks_without_its_check():
    """With the re-arm check off (a reader that never saw the flag), the writer's re-arm shows as a deadlock."""

    class Unchecked(P.Model):
        def _all_seen(self, *args):
            return True

    result = P.explore(_config(2, 1, 1, 1, rearm_by_writer=True), model_class=Unchecked)
    assert P.DEADLOCK in result.violations, _describe(result)


def test_missing_fence_needs_the_weak_model():
    """The fence bug is invisible when stores land at once: the same schedule space with every store landing
    as it is issued finds nothing (so the pending stores are what catches it)."""

    class Eager(P.Model):
        def _step(self, state, step):
            w, pending = super()._step(state, step)
            w = list(w)
            for p in sorted(pending):
                self._land(w, p)
            return (tuple(w), frozenset())

    result = P.explore(_config(2, 1, 1, 1, fence_per_thread=False), model_class=Eager)
    assert result.complete and result.ok, _describe(result)


def test_counterexample_is_a_schedule():
    variant, kind = BROKEN["fence_after_barrier"]
    result = P.explore(_config(2, 1, 1, 1, **variant), stop_at=lambda r: kind in r.violations)
    message, path = result.violations[kind]
    assert all(isinstance(step, str) for step in path)
    assert any("issues its row stores" in step for step in path)
    assert "before its data landed" in message
