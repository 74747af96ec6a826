"""Model checking of the v3 dispatch / combine protocol (`tools.protocol_checker`).

The kernels' steps over N ranks and three consecutive layers are explored exhaustively for N = 2 and N = 3
(small T, S and grids: see `EXHAUSTIVE`; and N = 4, T = 1), for every routing at N = 2, T = 1, and along random
schedules with random routings for N up to 8. The correct protocol must show no violation and always reach the one final
state; each broken variant must be caught with its own kind of violation; the sequence guards must record
their error and write nothing. The model is pure Python (no JAX).

`Config()`'s defaults are the shipped kernels' protocol (double-buffered rows, no ready lines: `P.SHIPPED`); most
tests here state the earlier single-buffered protocol with ready lines explicitly (`P.READY_LINES`, through
`_config` and `_ready`), since the broken variants (a)-(f) are switches on it; `DOUBLE` names the shipped one.
"""

import dataclasses
import os
import pathlib
import random
import re

import pytest

from jax_latent_ep import layout
from tools import protocol_checker as P  # noqa: E402


# (ranks N, tokens T, stride S, dispatch grid Gd, combine grid Gc): every reachable state over three layers
# (counts and times in docs/protocol.md). Larger N = 3 and N = 4 configurations, and N >= 5, are left to random
# schedules.
EXHAUSTIVE = [
    (2, 1, 1, 1, 1),
    (2, 1, 1, 1, 2),
    (2, 1, 2, 1, 1),  # a padding row j >= T: nothing stored or polled there
    (2, 1, 2, 3, 2),  # a dispatch CTA with no row to store, combine CTAs with no token
    (2, 2, 2, 2, 1),
    (2, 2, 2, 2, 2),
    (2, 2, 3, 3, 3),
    (3, 1, 1, 1, 1),
    (3, 1, 1, 2, 1),
    (3, 1, 1, 2, 2),
    (3, 1, 2, 1, 1),
    (3, 2, 2, 2, 2),
    (4, 1, 1, 1, 1),
]
# The same with every polled word its own step (`atomic_reads=False`).
FINE = [(2, 1, 1, 1, 1), (2, 1, 2, 2, 2), (2, 2, 2, 2, 1), (2, 2, 2, 2, 2), (3, 1, 1, 1, 1), (3, 1, 1, 1, 2)]

# Random schedules per configuration (three random configurations per N); raise it for a longer search.
RANDOM_RUNS = int(os.environ.get("JAX_LATENT_EP_PROTOCOL_RUNS", "5"))


def _ready(**options):
    """A `Config` of the single-buffered protocol with ready lines (`P.READY_LINES`), `options` overriding."""
    return P.Config(**{**P.READY_LINES, **options})


def _config(ranks, tokens, stride, dgrid, cgrid, **variant):
    return _ready(ranks=ranks, tokens=tokens, stride=stride, dispatch_grid=dgrid, combine_grid=cgrid, **variant)


def _describe(result):
    lines = [f"{result.states} states, errors {sorted(result.errors)}"]
    for kind, (message, path) in result.violations.items():
        lines.append(f"{kind}: {message}")
        lines.extend(f"    {step}" for step in path[-16:])
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# The correct protocol.


@pytest.mark.parametrize("ranks,tokens,stride,dgrid,cgrid", EXHAUSTIVE)
def test_exhaustive_correct_protocol(ranks, tokens, stride, dgrid, cgrid):
    result = P.explore(_config(ranks, tokens, stride, dgrid, cgrid))
    assert result.complete
    assert result.ok, _describe(result)
    # every schedule ends in the one final state: every word read, epochs and ready lines at the last layer
    assert result.finished == 1 and not result.errors
    assert result.states > 50  # explored, not trivially finished (99 for the smallest model)


@pytest.mark.parametrize("ranks,tokens,stride,dgrid,cgrid", [(2, 1, 2, 3, 2), (2, 2, 2, 2, 1), (3, 1, 1, 1, 1)])
def test_own_rows_in_the_buffer_too(ranks, tokens, stride, dgrid, cgrid):
    """The earlier kernels (own rows stored, polled and sent through the rank's own buffer) are correct as well,
    and they explore more states than the bypass (the own words exist only there)."""
    bypass = P.explore(_config(ranks, tokens, stride, dgrid, cgrid))
    buffer = P.explore(_config(ranks, tokens, stride, dgrid, cgrid, own_rows="buffer"))
    assert buffer.complete and buffer.ok and buffer.finished == 1, _describe(buffer)
    assert bypass.complete and bypass.ok and bypass.states < buffer.states


@pytest.mark.parametrize("ranks,tokens,stride,dgrid,cgrid", FINE)
def test_exhaustive_correct_protocol_fine_reads(ranks, tokens, stride, dgrid, cgrid):
    result = P.explore(_config(ranks, tokens, stride, dgrid, cgrid, atomic_reads=False))
    assert result.complete and result.ok and result.finished == 1, _describe(result)


@pytest.mark.parametrize("dgrid,cgrid", [(1, 1), (1, 2), (2, 2)])
def test_exhaustive_every_route(dgrid, cgrid):
    """N = 2, T = 1: the model picks each token's destination set at each dispatch (all 3^6 routings of three
    layers), so rows and slots go full / empty / full in every order."""
    result = P.explore(_ready(ranks=2, dispatch_grid=dgrid, combine_grid=cgrid, route="any"))
    assert result.complete and result.ok, _describe(result)
    assert result.finished > 1 and not result.errors  # final states differ by the last layer's routes


@pytest.mark.parametrize("words", [1, 3])
def test_exhaustive_words_per_row(words):
    result = P.explore(_config(2, 2, 2, 2, 2, words=words))
    assert result.complete and result.ok and result.finished == 1, _describe(result)


# One buffer for programs of different T (`layer_tokens`: T of each of three layers, every rank the same): a row is
# skipped in one layer and stored and polled again in a later one.
VARYING_T = [
    (2, 2, 2, 2, 1, (2, 1, 2)),
    (2, 2, 2, 2, 2, (1, 2, 1)),
    (2, 2, 3, 2, 1, (1, 1, 2)),
    (3, 2, 2, 2, 1, (2, 1, 2)),
]


@pytest.mark.parametrize("ranks,tokens,stride,dgrid,cgrid,layer_tokens", VARYING_T)
def test_exhaustive_layers_of_different_t(ranks, tokens, stride, dgrid, cgrid, layer_tokens):
    result = P.explore(_config(ranks, tokens, stride, dgrid, cgrid, layer_tokens=layer_tokens))
    assert result.complete and result.ok and result.finished == 1, _describe(result)
    same = P.explore(_config(ranks, tokens, stride, dgrid, cgrid))
    assert result.states != same.states  # the skipped steps changed the state space: they are modelled


def test_exhaustive_layers_of_different_t_every_route():
    """N = 2, T = 1 then 2 then 2, every destination set of every token at every dispatch (291k states, ~20 s)."""
    result = P.explore(_config(2, 2, 2, 2, 1, layer_tokens=(1, 2, 2), route="any"))
    assert result.complete and result.ok and result.finished > 1 and not result.errors, _describe(result)


def test_layers_of_different_t_still_need_the_ready_wait():
    """Skipping rows does not hide the classic bug: without the ready wait a store overwrites an unread word."""
    result = P.explore(_config(2, 2, 2, 2, 1, layer_tokens=(1, 2, 2), route="any", wait_ready=False),
                       stop_at=lambda r: bool(r.violations))
    assert P.OVERWRITE_UNREAD in result.violations, _describe(result)


# Double-buffered rows (layer e in half e % 2) and no ready lines at all: the data chain alone orders a row's
# overwrite after its read (docs/protocol.md, "Double-buffered rows").
DOUBLE = dict(double_rows=True, wait_ready=False, ready_in="none")


def test_default_config_is_the_shipped_protocol():
    # The checker's default configuration must model the kernels that ship, so that a plain `Config(ranks=...)`
    # checks them: the counter guard (the arrival counters CTRL_COUNT_D / _C of the layout), receive rows in two
    # halves by layer parity (layout.ROW_HALVES) and no ready lines (neither kernel stores nor waits for one).
    kernels = pathlib.Path(layout.__file__).parent / "kernels"
    assert layout.ROW_HALVES == 2 and (layout.CTRL_COUNT_D, layout.CTRL_COUNT_C) == (32, 33)
    assert not any(re.search(r"\bready\b", (kernels / f).read_text(), re.I) for f in ("dispatch.py", "combine.py"))
    shipped = dict(guard="counter", own_rows="bypass", **DOUBLE)
    assert {k: P.SHIPPED[k] for k in shipped} == shipped
    default = P.Config(ranks=2)
    assert {k: getattr(default, k) for k in P.SHIPPED} == P.SHIPPED
    fields = {f.name for f in dataclasses.fields(P.Config)}
    assert set(P.SHIPPED) <= fields and set(P.READY_LINES) <= fields
    # the default explores exactly what DOUBLE spells out
    assert P.explore(P.Config(ranks=2)).states == P.explore(P.Config(ranks=2, **DOUBLE)).states


@pytest.mark.parametrize("ranks,tokens,stride,dgrid,cgrid", EXHAUSTIVE)
def test_exhaustive_double_rows_without_ready_lines(ranks, tokens, stride, dgrid, cgrid):
    result = P.explore(_config(ranks, tokens, stride, dgrid, cgrid, **DOUBLE))
    assert result.complete and result.ok and result.finished == 1, _describe(result)


@pytest.mark.parametrize("dgrid,cgrid", [(1, 1), (1, 2), (2, 2)])
def test_exhaustive_double_rows_every_route(dgrid, cgrid):
    result = P.explore(_ready(ranks=2, dispatch_grid=dgrid, combine_grid=cgrid, route="any", **DOUBLE))
    assert result.complete and result.ok and result.finished > 1 and not result.errors, _describe(result)


# A dispatch grid below T (`Gd < T`): CTA c stores the tokens c, c + Gd, ... in its store step, then copies out its
# rows (the kernels' loop over own tokens, every store of a CTA before its first poll).
SMALL_GRID = [
    (2, 2, 2, 1, 1),
    (2, 2, 2, 1, 2),
    (2, 3, 3, 1, 1),
    (2, 3, 3, 2, 2),
    (2, 3, 4, 2, 1),  # a padding row j >= T as well
    (3, 2, 2, 1, 1),
    (3, 2, 2, 1, 2),
]


@pytest.mark.parametrize("ranks,tokens,stride,dgrid,cgrid", SMALL_GRID)
def test_exhaustive_dispatch_grid_below_t(ranks, tokens, stride, dgrid, cgrid):
    for variant in (DOUBLE, {}):  # the kernels' protocol, and the single-buffered one with ready lines
        result = P.explore(_config(ranks, tokens, stride, dgrid, cgrid, **variant))
        assert result.complete and result.ok and result.finished == 1, _describe(result)
        assert result.states > 200


def test_exhaustive_dispatch_grid_below_t_every_route():
    """N = 2, T = 2, one dispatch CTA storing both tokens: every destination set of each token at each dispatch (two
    layers, 86k states)."""
    result = P.explore(_ready(ranks=2, tokens=2, dispatch_grid=1, route="any", layers=2, **DOUBLE))
    assert result.complete and result.ok and result.finished > 1 and not result.errors, _describe(result)


@pytest.mark.parametrize("ranks,tokens,stride,dgrid,cgrid,layer_tokens", [
    (2, 2, 2, 1, 1, (2, 1, 2)),
    (2, 3, 3, 2, 1, (3, 1, 2)),  # CTA 0 stores two tokens, one, then one
])
def test_exhaustive_dispatch_grid_below_t_of_different_t(ranks, tokens, stride, dgrid, cgrid, layer_tokens):
    result = P.explore(_config(ranks, tokens, stride, dgrid, cgrid, layer_tokens=layer_tokens, **DOUBLE))
    assert result.complete and result.ok and result.finished == 1, _describe(result)


@pytest.mark.parametrize("ranks", [2, 3, 4, 5, 6, 7, 8])
def test_random_schedules_dispatch_grid_below_t(ranks):
    rng = random.Random(100 + ranks)
    for case in range(3):
        tokens = rng.randint(2, 3 if ranks <= 5 else 2)
        config = _ready(
            ranks=ranks,
            tokens=tokens,
            stride=tokens + rng.randint(0, 1),
            dispatch_grid=rng.randint(1, tokens - 1),
            combine_grid=rng.randint(1, 3),
            route=P.random_route(rng, ranks, tokens, 3),
            **DOUBLE,
        )
        result = P.random_runs(config, runs=RANDOM_RUNS, seed=case)
        assert result.ok and result.finished == RANDOM_RUNS, _describe(result)


@pytest.mark.parametrize("variant", [dict(layer_tokens=(2, 1, 2)), dict(layers=5, tokens=1, stride=2),
                                     dict(atomic_reads=False)])
def test_exhaustive_double_rows_variants(variant):
    config = dict(ranks=2, tokens=2, stride=2, dispatch_grid=2, combine_grid=2, **DOUBLE)
    config.update(variant)
    result = P.explore(_ready(**config))
    assert result.complete and result.ok and result.finished == 1, _describe(result)


def test_single_rows_need_the_ready_lines():
    """The same model with one half and no ready lines overwrites an unread row (N = 3, default routing)."""
    config = dict(wait_ready=False, ready_in="none")
    result = P.explore(_config(3, 1, 1, 1, 1, **config), stop_at=lambda r: bool(r.violations))
    assert P.OVERWRITE_UNREAD in result.violations, _describe(result)
    assert P.explore(_config(3, 1, 1, 1, 1, double_rows=True, **config)).ok


@pytest.mark.parametrize("layer_tokens", [((2, 1), (2, 2), (2, 2)), ((2, 2), (2, 1), (2, 2)), ((2, 1), (1, 2), (2, 2))])
def test_ranks_that_disagree_on_t_time_out_and_accept_no_wrong_word(layer_tokens):
    """A misuse (the kernels require one peer_tokens on every rank of a call): a rank whose T differs from its peer's
    ends in a poll that never succeeds (the kernels' timeout: `deadlock` here), never in a wrong word accepted;
    every routing at N = 2 with the kernels' double rows."""
    result = P.explore(_config(2, 2, 2, 2, 1, layer_tokens=layer_tokens, route="any", **DOUBLE))
    assert result.complete and set(result.violations) == {P.DEADLOCK}, _describe(result)


def test_narrow_epochs_with_double_rows():
    """The narrow-epoch study on the kernels' protocol: with double rows and no ready lines, two epoch values need the
    reader's invalidation (six layers, every routing at N = 2, and N = 3), and fail without it."""
    for extra in (dict(route="any"), dict(ranks=3)):
        config = dict(dict(ranks=2, layers=6, epochs=2, **DOUBLE), **extra)
        clean = P.explore(_ready(invalidate=True, **config))
        assert clean.complete and clean.ok and not clean.errors, _describe(clean)
        broken = P.explore(_ready(**config), stop_at=lambda r: bool(r.violations))
        assert P.STALE_READ in broken.violations, _describe(broken)


def test_exhaustive_five_layers():
    result = P.explore(_config(2, 1, 2, 2, 1, layers=5))
    assert result.complete and result.ok and result.finished == 1, _describe(result)


@pytest.mark.parametrize("guard", ["cta0", "none"])
def test_exhaustive_other_guards_in_sequence(guard):
    """In sequence, the earlier CTA-0 guard and no guard at all change nothing."""
    for shape in [(2, 2, 2, 2, 2), (3, 1, 1, 2, 2)]:
        result = P.explore(_config(*shape, guard=guard))
        assert result.complete and result.ok and result.finished == 1, _describe(result)


@pytest.mark.parametrize("double", [False, True])
@pytest.mark.parametrize("ranks", [2, 3, 4, 5, 6, 7, 8])
def test_random_schedules_correct_protocol(ranks, double):
    rng = random.Random(ranks)
    runs = 0
    for case in range(3):
        tokens = rng.randint(1, 3 if ranks <= 5 else 2)
        stride = tokens + rng.randint(0, 1)
        config = _ready(
            ranks=ranks,
            tokens=tokens,
            stride=stride,
            dispatch_grid=tokens + rng.randint(0, 1),
            combine_grid=rng.randint(1, 3),
            route=P.random_route(rng, ranks, tokens, 3),
            **(DOUBLE if double else {}),
        )
        result = P.random_runs(config, runs=RANDOM_RUNS, seed=case)
        assert result.ok, _describe(result)
        assert result.finished == RANDOM_RUNS
        runs += result.finished
    assert runs == 3 * RANDOM_RUNS


# ----------------------------------------------------------------------------------------------------------
# Broken variants: each must be caught, with its own kind of violation. N = 2 with the routing "any" finds
# every one of them (a rank whose token stays home needs nothing from its peer and can run a layer ahead);
# N = 3 with the default routing finds them too.

BROKEN = {
    # (a) dispatch stores without waiting for the ready lines: a row is overwritten before its copy-out
    "no_ready_wait": (dict(wait_ready=False), P.OVERWRITE_UNREAD),
    # (b) ready[r] = e stored at the start of dispatch e (before its copy-out) instead of in combine e
    "ready_in_dispatch": (dict(ready_in="dispatch"), P.OVERWRITE_UNREAD),
    # (c) the combine takes the source word from the peer-written header: the peer's next dispatch may have
    # replaced it (ready[r] = e is stored at the start of combine e)
    "send_from_header": (dict(send_source="header"), P.WRONG_LAYER_READ),
    # (d) the epoch is not advanced between layers: the last layer's words pass the poll
    "fixed_epoch": (dict(advance_epoch=False), P.STALE_READ),
    # (e) an LL word stored as payload, then epoch (two 4-byte stores landing in either order)
    "split_ll_word": (dict(ll_atomic=False), P.TORN_READ),
    # (f) the next dispatch starts before this rank's combine finished (no stream order)
    "no_stream_order": (dict(stream_order=False), P.OVERWRITE_UNREAD),
}
CATCHING = [dict(ranks=2, tokens=1, route="any"), dict(ranks=3, tokens=1, dispatch_grid=2),
            dict(ranks=2, tokens=2, dispatch_grid=1, route="any")]


@pytest.mark.parametrize("name", sorted(BROKEN))
@pytest.mark.parametrize("shape", range(len(CATCHING)))
def test_exhaustive_catches_broken_variant(name, shape):
    variant, kind = BROKEN[name]
    result = P.explore(_ready(**CATCHING[shape], **variant), stop_at=lambda r: kind in r.violations)
    assert kind in result.violations, _describe(result)
    message, path = result.violations[kind]
    assert path and message.startswith(path[-1])


def test_broken_variants_all_kinds_small():
    """The full N = 2, T = 1 state space (every routing, two layers) of each broken variant: every kind of
    violation it leads to (docs/protocol.md)."""
    found = {}
    for name, (variant, _) in BROKEN.items():
        result = P.explore(_ready(ranks=2, route="any", layers=2, **variant))
        assert result.complete
        found[name] = result.kinds()
    assert found["no_ready_wait"] == {P.OVERWRITE_UNREAD}
    assert found["ready_in_dispatch"] == {P.OVERWRITE_UNREAD}
    assert found["send_from_header"] == {P.WRONG_LAYER_READ}
    assert found["fixed_epoch"] == {P.STALE_READ, P.OVERWRITE_UNREAD}
    assert found["split_ll_word"] == {P.TORN_READ}
    # the next dispatch's guard reads EPOCH_D before the combine wrote it; its copy-out overwrites mirror[]
    # before the combine read it; the peers' partials land on slots not yet reduced
    assert found["no_stream_order"] >= {P.OVERWRITE_UNREAD, P.SPURIOUS_GUARD}


@pytest.mark.parametrize("ranks", [4, 8])
@pytest.mark.parametrize("name", sorted(BROKEN))
def test_random_schedules_catch_broken_variant(name, ranks):
    variant, kind = BROKEN[name]
    if name == "no_stream_order":
        # every CTA of the early dispatch checks the sequence and mostly reports it first (spurious_guard,
        # which ends the run): without the guard the run goes on to the data race itself
        variant = dict(variant, guard="none")
    rng = random.Random(ranks)
    config = _ready(
        ranks=ranks, tokens=2, dispatch_grid=2, combine_grid=2, route=P.random_route(rng, ranks, 2, 3), **variant
    )
    found = set()
    for seed in range(60):
        found |= P.random_runs(config, runs=1, seed=seed).kinds()
        if kind in found:
            break
    assert kind in found, found


def test_counterexample_is_a_schedule():
    variant, kind = BROKEN["split_ll_word"]
    result = P.explore(_ready(ranks=2, **variant), stop_at=lambda r: kind in r.violations)
    message, path = result.violations[kind]
    assert all(isinstance(step, str) for step in path)
    assert any("issues its row stores" in step for step in path)
    assert "(epoch half)" in path[-1] and "torn" in message


def test_reductions_keep_every_violation():
    """The reductions (landings folded into the reads that see them, eager local steps) against the plain
    interleaving of every step and every landing (`reduce=False`), on state spaces small enough for the latter
    (N = 2, T = 1, one LL word per row, two layers routed so that every variant shows): the same kinds of
    violation, the same error records."""
    route = (((0b01,), (0b11,)), ((0b10,), (0b01,)))  # layer 0: r0's token stays home; layer 1: crossed
    cases = [
        (dict(), set()),
        (dict(wait_ready=False), {P.OVERWRITE_UNREAD}),
        (dict(send_source="header"), {P.WRONG_LAYER_READ}),
        (dict(ll_atomic=False, layers=1, route=(((0b01,), (0b10,)),)), {P.TORN_READ}),
        (dict(stream_order=False), {P.OVERWRITE_UNREAD, P.SPURIOUS_GUARD}),
        (dict(guard="all", dispatch_grid=2), {P.SPURIOUS_GUARD}),
        (dict(calls=("DCC", "DC"), layers=1, combine_grid=2, guard="cta0"), {P.GUARD_LEAK}),
    ]
    for variant, kinds in cases:
        base = dict(ranks=2, layers=2, words=1, route=route)
        base.update(variant)
        reduced = P.explore(_ready(**base))
        plain = P.explore(_ready(**base, reduce=False))
        assert plain.complete and reduced.states < plain.states
        assert reduced.kinds() == plain.kinds() == kinds, (variant, _describe(reduced), _describe(plain))
        assert reduced.errors == plain.errors


# ----------------------------------------------------------------------------------------------------------
# Sequence guards: a call out of sequence records {code, rank, peer, layer} and stops its rank (the kernels
# trap); it must write nothing (no store, no ready line, no epoch word). Its peers then wait for it until their
# own timeouts: not a deadlock of the protocol.

SEQUENCES = {
    "dispatch_twice": (("DD", "DC"), (0, P.ERROR_DISPATCH_TWICE, 0)),
    "dispatch_twice_layer_1": (("DCDD", "DCDC"), (0, P.ERROR_DISPATCH_TWICE, 1)),
    "combine_first": (("C", "DC"), (0, P.ERROR_COMBINE_WITHOUT_DISPATCH, 0)),
    "combine_twice": (("DCC", "DCDC"), (0, P.ERROR_COMBINE_WITHOUT_DISPATCH, 1)),
    "both_ranks": (("DCDD", "DCC"), None),
}


@pytest.mark.parametrize("name", sorted(SEQUENCES))
@pytest.mark.parametrize("guard,dgrid,cgrid", [("counter", 2, 2), ("counter", 1, 1), ("all", 1, 1), ("cta0", 1, 1)])
def test_guard_records_error_and_writes_nothing(name, guard, dgrid, cgrid):
    calls, record = SEQUENCES[name]
    config = _ready(ranks=2, calls=calls, layers=2, guard=guard, dispatch_grid=dgrid, combine_grid=cgrid)
    result = P.explore(config)
    assert result.complete and result.ok, _describe(result)
    assert result.finished == 0  # every run ends with the error recorded
    expected = {record} if record else {(0, P.ERROR_DISPATCH_TWICE, 1), (1, P.ERROR_COMBINE_WITHOUT_DISPATCH, 1)}
    if record is None:
        # one of the two ranks stops first: its peer then waits (before reaching its own bad call) or not
        assert result.errors and result.errors <= expected, result.errors
    else:
        assert result.errors == expected


def test_guard_all_races_its_own_write():
    """The guard as specified (every CTA reads EPOCH_D and EPOCH_C, CTA 0 writes one of them) fires in a
    correct sequence as soon as a grid has two CTAs: a CTA that reads after CTA 0's write sees the next state."""
    for shape, kind_word in [((2, 1, 1, 2, 1), "dispatch twice"), ((2, 1, 1, 1, 2), "combine without dispatch")]:
        result = P.explore(_config(*shape, guard="all"), stop_at=lambda r: P.SPURIOUS_GUARD in r.violations)
        message, path = result.violations[P.SPURIOUS_GUARD]
        assert kind_word in message, message
        assert "reads the epoch words" in path[-1]


@pytest.mark.parametrize("name", ["dispatch_twice", "combine_twice"])
def test_guard_cta0_leaks_stores(name):
    """The guard as the kernels write it (CTA 0 alone checks, the other CTAs take the layer from the word their
    kernel never writes): a call out of sequence with a grid of two stores before CTA 0 traps."""
    calls, _ = SEQUENCES[name]
    result = P.explore(_ready(ranks=2, calls=calls, layers=2, guard="cta0", dispatch_grid=2, combine_grid=2))
    assert P.GUARD_LEAK in result.violations, _describe(result)
    assert result.kinds() == {P.GUARD_LEAK}


def test_no_guard_is_caught():
    for name in ["dispatch_twice", "combine_first", "combine_twice"]:
        calls, _ = SEQUENCES[name]
        result = P.explore(_ready(ranks=2, calls=calls, layers=2, guard="none"))
        assert P.GUARD_LEAK in result.violations, (name, _describe(result))


# ----------------------------------------------------------------------------------------------------------
# Co-residency: a CTA's copy-out waits for rows that other CTAs (of this rank or of a peer) store, so the
# whole grid must be resident at once (`NvlinkBackend.max_grids`).


def test_grid_larger_than_residency_deadlocks():
    result = P.explore(_config(2, 2, 2, 3, 1, resident=1))
    assert P.DEADLOCK in result.violations, _describe(result)
    assert P.explore(_config(2, 2, 2, 3, 1, resident=2)).ok


def test_grid_below_t_needs_no_more_residency():
    """One dispatch CTA for both tokens (Gd = 1 < T = 2) runs with one resident CTA: it issues every store of its
    tokens before its first poll, so no poll waits for a CTA that is not running."""
    for variant in (DOUBLE, {}):
        result = P.explore(_config(2, 2, 2, 1, 1, resident=1, **variant))
        assert result.complete and result.ok and result.finished == 1, _describe(result)


# ----------------------------------------------------------------------------------------------------------
# Narrow epochs (a design study for fewer bytes per wide word, docs/protocol_checker.md): a data or comb word that
# carries only `epochs` epoch values repeats them, so a word not written for a while looks fresh to a later
# reader; the reader setting the epoch to 0 once it has read the word (`invalidate`) must close that, down to a
# single value (a full / empty flag).

NARROW = [(2, 1, 1, 1, 1), (2, 1, 2, 3, 2), (2, 2, 2, 2, 2), (3, 1, 1, 2, 1), (3, 2, 2, 2, 2)]


@pytest.mark.parametrize("ranks,tokens,stride,dgrid,cgrid", NARROW)
def test_narrow_epochs_without_invalidation_read_stale_words(ranks, tokens, stride, dgrid, cgrid):
    for epochs in (1, 2):
        config = _config(ranks, tokens, stride, dgrid, cgrid, layers=4, words=1, epochs=epochs)
        result = P.explore(config, stop_at=lambda r: P.STALE_READ in r.violations)
        assert P.STALE_READ in result.violations, (epochs, _describe(result))


@pytest.mark.parametrize("ranks,tokens,stride,dgrid,cgrid", NARROW)
@pytest.mark.parametrize("epochs", [1, 2, 3])
def test_narrow_epochs_with_invalidation(ranks, tokens, stride, dgrid, cgrid, epochs):
    """Every reachable state over four layers: no violation, and as many states and finished runs as with an
    epoch per layer (the invalidation changes what the words hold, not what can happen)."""
    wide = P.explore(_config(ranks, tokens, stride, dgrid, cgrid, layers=4, words=1))
    narrow = P.explore(_config(ranks, tokens, stride, dgrid, cgrid, layers=4, words=1, epochs=epochs,
                               invalidate=True))
    assert narrow.complete and narrow.ok, _describe(narrow)
    assert (narrow.states, narrow.finished) == (wide.states, wide.finished)


def test_narrow_epochs_with_invalidation_every_route_and_buffer_rows():
    """Every routing at N = 2 (bounded), the earlier own-rows-in-the-buffer design, and random schedules at N = 4:
    no violation; without invalidation the same searches find the stale read."""
    rng = random.Random(11)
    configs = [
        _ready(ranks=2, tokens=1, layers=4, words=1, route="any"),
        _ready(ranks=2, tokens=1, layers=4, words=2, own_rows="buffer"),
    ]
    for config in configs:
        fixed = P.explore(_ready(**{**config.__dict__, "epochs": 1, "invalidate": True}), max_states=60000)
        assert fixed.ok, _describe(fixed)
        broken = P.explore(_ready(**{**config.__dict__, "epochs": 1}), max_states=60000,
                           stop_at=lambda r: P.STALE_READ in r.violations)
        assert P.STALE_READ in broken.violations, _describe(broken)
    route = P.random_route(rng, 4, 2, 4)
    fixed = P.random_runs(_ready(ranks=4, tokens=2, layers=4, words=1, route=route, epochs=1, invalidate=True),
                          runs=20, seed=3)
    assert fixed.ok and fixed.finished == 20, _describe(fixed)


def test_invalidation_does_not_hide_a_broken_variant():
    """The next dispatch starting before the combine finished (variant f) is still caught."""
    config = _ready(ranks=2, tokens=1, layers=3, words=1, stream_order=False, epochs=1, invalidate=True)
    result = P.explore(config)
    assert P.OVERWRITE_UNREAD in result.violations, _describe(result)
