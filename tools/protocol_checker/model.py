"""The state machine of the v3 dispatch / combine protocol (LL words with layer epochs): `Config`, `Model`."""

# The model (docs/protocol.md has the protocol, the safety argument and what the checker found).
#
# N ranks, each running its call sequence (`Config.calls`; default: dispatch, combine for every layer) in stream
# order: a kernel starts once the previous kernel of its rank finished. Each kernel is a grid of CTAs that
# interleave arbitrarily; a CTA is a program of steps (`Model.programs`):
#
#   dispatch CTA c   guard      read EPOCH_D / EPOCH_C (`Config.guard` says which CTA reads / writes what)
#                    store      (c < T) (`wait_ready`: wait until ready[d] >= e - 1 for every d), issue the LL stores of
#                               rows j = c, c + Gd, ... < T: data words + header {src, e} to every d in D(j),
#                               header {-1, e} to the others
#                    copy q     (the polled rows q = s S + j, j < T, the c-th, (c + Gd)-th, ...) poll hdr[q] (and,
#                               if it is not empty, the row's data words) until they carry e; write mirror[q]
#   combine CTA c    guard      read EPOCH_D / EPOCH_C; (`ready_in="combine"`) CTA 0 stores ready[r] = e to every rank; the epoch word
#                               is written by the last CTA to arrive (guard "counter", the kernels) or CTA 0
#                    send q     (the polled rows, c-th, (c + Gc)-th, ...) read mirror[q]; if valid, issue the
#                               partial's LL words to rank q // S, slot [q % S][r]
#
# Rows j >= T of every source (S > T) carry nothing: no rank stores or polls them (the kernels' `peer_tokens`, the
# T that every rank of the call shares; the kernel writes their outputs as empty rows locally).
#                    reduce t   (t = c, c + Gc, ... < T) poll slot [t][d] of every d in D(t) until it carries e
#
# The defaults are the shipped kernels (`SHIPPED`): receive rows in two halves by layer parity and no ready lines at
# all, `double_rows=True, wait_ready=False, ready_in="none"` (the store waits for nothing, the combine stores no ready
# line; docs/protocol.md, "Double-buffered rows"). `READY_LINES` selects the earlier single-buffered kernels, one half
# of rows ordered by ready lines, against which the broken variants (a)-(f) are stated.
#
# `own_rows="bypass"` (the kernels): rank r's own rows (q // S == r) and slots ([t][r]) have no words: the store
# skips d == r, and the copy, send and slot steps of own rows are no-ops (the kernel writes the outputs from its
# registers and reads its own partial from `out`); the kernels also walk only the other ranks' rows, which the
# no-op steps stand for. `own_rows="buffer"`: the earlier kernels.
#
# Memory. Every store into a peer-written word (LL words, ready lines) is issued into a pending set and lands
# later, at any moment, in any order with the other pending stores, except that the stores of one rank into
# one word land in the order they were issued (coherence; every word has one writer). An LL store lands whole
# unless `ll_atomic=False` (payload and epoch: two stores). Control words and mirror[] are local and visible at
# once. Reads see the landed memory; a poll is one step, enabled once the polled words carry the reader's
# epoch (a poll that fails changes nothing). A call out of sequence records its error and stops its rank.
#
# Reductions (`reduce=False` turns them off; the tests compare both on small state spaces):
# * Landing a store commutes with every step that does not touch its word, so a landing is deferred to the
#   read that sees it: a poll step carries the set of pending stores that land just before it (per polled
#   word, a prefix in issue order of the stores pending there, such that the poll succeeds). Two landings are
#   steps of their own, taken at once: one that is a violation (it overwrites a value nobody read), and one
#   that turns off a poll that could succeed now. Once nothing else can move, the rest land one at a time.
# * Steps that touch only their CTA, the pending set and words no concurrent step writes are taken alone as
#   soon as they are enabled: a dispatch CTA's ready wait + stores (ready lines only grow), a combine CTA's
#   send (mirror[] is written by the previous kernel), a guard whose words no sibling writes, and
#   (`stream_order=False`) the early start of the next dispatch. A call out of sequence interleaves every step;
#   guards interleave with `guard="all"` and a grid > 1, with `resident` grids and with `stream_order=False`,
#   and sends with `stream_order=False`.
# * `atomic_reads=True` (default): a copy-out of a row (header + data words) and a reduce of a token (every
#   slot of every destination) are one snapshot poll, as the kernels poll them (all loads, then the check);
#   `atomic_reads=False` polls every word on its own.

from __future__ import annotations

import dataclasses
import itertools
import random

# Violation kinds (property numbers as in docs/protocol.md).
STALE_READ = "stale_read"  # (1, 3) a reader accepted a word written in an earlier layer (or never written)
WRONG_LAYER_READ = "wrong_layer_read"  # (1) a reader accepted a word written in a later layer than its own
TORN_READ = "torn_read"  # (1) a reader accepted an LL word whose payload and epoch came from different stores
OVERWRITE_UNREAD = "overwrite_unread"  # (2) a store landed on a word (or mirror[]) its reader had not read yet
DEADLOCK = "deadlock"  # (4) nothing can move, some rank has not finished (and none failed)
BAD_FINAL_STATE = "bad_final_state"  # (4) a finished run with a word never read, or epochs not at the last layer
SPURIOUS_GUARD = "spurious_guard"  # (5) a call made in the right sequence recorded a sequence error
GUARD_MISSED = "guard_missed"  # (5) a call made in the wrong sequence finished without its error (or a wrong one)
GUARD_LEAK = "guard_leak"  # (5) a call made in the wrong sequence wrote something (a store or a control word)
KINDS = (
    STALE_READ,
    WRONG_LAYER_READ,
    TORN_READ,
    OVERWRITE_UNREAD,
    DEADLOCK,
    BAD_FINAL_STATE,
    SPURIOUS_GUARD,
    GUARD_MISSED,
    GUARD_LEAK,
)

# Error codes of the record {code, rank, peer, layer}: the kernels' own (kernels/abi.py).
from jax_latent_ep.kernels.abi import (  # noqa: E402, F401 (the checker names all four codes)
    ERROR_COMBINE_TIMEOUT,
    ERROR_COMBINE_WITHOUT_DISPATCH,
    ERROR_DISPATCH_TIMEOUT,
    ERROR_DISPATCH_TWICE,
)

#: `Config.guard` values. "counter" (the kernels since `arrive_in_sequence`): every CTA reads both epoch words
#: and checks, then arrives on a local counter whose last arrival writes; "all": every CTA reads both and
#: checks, CTA 0 writes (as first specified for v3: races its own write); "cta0": CTA 0 alone reads both, checks
#: and writes, the others read only the word their kernel never writes (the kernels before the counter: an
#: out-of-sequence call's other CTAs still store); "none": no check (CTA 0 writes).
GUARDS = ("all", "cta0", "counter", "none")

#: The protocol of the shipped kernels (`jax_latent_ep/kernels/dispatch.py`, `combine.py`), the defaults of `Config`:
#: the counter guard, own rows bypassing the buffer, receive rows in two halves by layer parity, no ready lines.
SHIPPED = dict(guard="counter", own_rows="bypass", double_rows=True, wait_ready=False, ready_in="none",
               send_source="mirror", advance_epoch=True, ll_atomic=True, stream_order=True, epochs=None,
               invalidate=False)
#: The earlier single-buffered kernels: one half of receive rows, the combine stores `ready[r] = e` to every rank
#: and the next dispatch's stores wait for `ready[d] >= e - 1` (`Config(**READY_LINES, ...)`); the broken variants
#: (a)-(f) of docs/protocol.md are switches on it.
READY_LINES = dict(double_rows=False, wait_ready=True, ready_in="combine")

# Words of a rank's block in the state.
_K, _NEXT, _ED, _EC, _ERR, _CNT_D, _CNT_C = range(7)
_HEAD = 7


@dataclasses.dataclass(frozen=True)
class Config:
    """One model: `ranks` N, `tokens` T per rank, `stride` S >= T receive rows per source, `words` W LL words
    per row and per partial, grids, the calls of every rank, the routing, and the variant switches.

    `route[l][s][t]`: the bitmask D(t) of the ranks token `t` of rank `s` reaches in layer `l` (nonempty);
    `None` picks `default_route`; `"any"` lets the model choose every D(t) at each dispatch (all 2^N - 1 sets).
    `calls`: one string of "D" / "C" per rank (default `"DC" * layers`); a call out of sequence records its
    error and stops the rank (the kernels trap), so nothing after it runs.
    """

    ranks: int
    tokens: int = 1
    stride: int | None = None  # default: tokens
    words: int = 2
    dispatch_grid: int | None = None  # default: tokens; below T, CTA c stores the tokens c, c + Gd, ... in one step
    combine_grid: int = 1
    layers: int = 3
    route: tuple | str | None = None
    calls: tuple | None = None
    guard: str = "counter"
    # "bypass" (the kernels): a rank's own receive rows and combine slots skip its buffer (the
    # dispatch writes them into the outputs, the combine adds its own partial from `out`), so only words between
    # two ranks exist; "buffer": the earlier kernels, own rows stored, polled and sent like the others.
    own_rows: str = "bypass"
    # ready lines (`READY_LINES`; the shipped kernels have none) and broken variants (docs/protocol.md)
    wait_ready: bool = False  # True: dispatch stores after ready[d] >= e - 1 for every d; False with one half of
    # rows is (a), the store without waiting for the ready lines
    ready_in: str = "none"  # "combine": ready[r] = e stored by combine e; "dispatch": (b) at the start of dispatch e
    send_source: str = "mirror"  # "header": (c) the combine reads the row's source word from hdr[q]
    advance_epoch: bool = True  # False: (d) every layer writes and expects epoch 1
    ll_atomic: bool = True  # False: (e) an LL word is two 4-byte stores (payload, epoch) landing in any order
    stream_order: bool = True  # False: (f) the next dispatch may start once the combine started
    # narrow epochs (a design study: docs/protocol_checker.md): `epochs` = k gives a receive row's data words and a
    # combine slot's words k epoch values, 1 + layer % k (0: never written), instead of one per layer (headers and
    # ready lines keep theirs); `invalidate`: the reader of such a word sets its epoch to 0 once it has read it.
    epochs: int | None = None
    invalidate: bool = False
    # T of each layer (`layer_tokens[l] <= tokens`, the same on every rank: the kernels' peer_tokens), for programs
    # that share one buffer with different T; None: `tokens` in every layer. The CTA programs cover `tokens`
    # rows; in layer l the steps on rows, tokens or stores past its T touch nothing (the kernels neither store nor
    # poll those rows; their outputs are written empty locally). An entry may also be a tuple of one T per rank:
    # ranks that disagree (a misuse: the kernels require one peer_tokens per call), which must end in a poll that
    # never succeeds (the kernels' timeout), never in a wrong word accepted.
    layer_tokens: tuple | None = None
    # Two halves of receive rows (headers and data words), layer e in half e % 2, so that a writer of layer e + 1
    # overwrites what its reader read in layer e - 1 (the shipped kernels: docs/protocol.md, "Double-buffered rows"),
    # with wait_ready=False and ready_in="none" (no ready lines at all). False: one half (`READY_LINES`).
    double_rows: bool = True
    # exploration
    atomic_reads: bool = True  # False: every polled word is its own step
    resident: int | None = None  # at most this many CTAs of a kernel run at once (None: the whole grid)
    reduce: bool = True  # False: no reductions (every landing its own step, no eager step): for cross-checks

    def __post_init__(self):
        t = self.tokens
        if self.stride is None:
            object.__setattr__(self, "stride", t)
        if self.dispatch_grid is None:
            object.__setattr__(self, "dispatch_grid", t)
        if self.calls is None:
            object.__setattr__(self, "calls", ("DC" * self.layers,) * self.ranks)
        if self.route is None:
            object.__setattr__(self, "route", default_route(self.ranks, t, self.layers))
        assert self.ranks >= 1 and t >= 1 and self.layers >= 1 and self.words >= 1
        assert self.stride >= t and self.dispatch_grid >= 1 and self.combine_grid >= 1
        assert self.guard in GUARDS and self.ready_in in ("combine", "dispatch", "none")
        assert self.send_source in ("mirror", "header")
        assert self.own_rows in ("bypass", "buffer")
        assert len(self.calls) == self.ranks and all(set(c) <= {"D", "C"} for c in self.calls)
        if self.route != "any":
            assert len(self.route) >= self.layers
            assert all(m for layer in self.route for src in layer for m in src), "D(t) must not be empty"
        assert self.resident is None or self.resident >= 1
        assert self.epochs is None or self.epochs >= 1
        if self.layer_tokens is not None:
            assert len(self.layer_tokens) >= self.layers
            for x in self.layer_tokens:
                assert all(1 <= v <= t for v in (x if isinstance(x, tuple) else (x,)))
                assert not isinstance(x, tuple) or len(x) == self.ranks
            assert self.epochs is None, "narrow epochs assume every layer writes every word it polls"


def default_route(ranks: int, tokens: int, layers: int) -> tuple:
    """A deterministic routing that changes from layer to layer (a row is full in one layer and empty in the
    next): token `t` of rank `s` reaches rank `d` in layer `l` unless `(l + s + t + d) % 3 == 0`; never empty."""
    route = []
    for l in range(layers):
        per_source = []
        for s in range(ranks):
            masks = []
            for t in range(tokens):
                mask = sum(1 << d for d in range(ranks) if (l + s + t + d) % 3 != 0)
                masks.append(mask or 1 << s)
            per_source.append(tuple(masks))
        route.append(tuple(per_source))
    return tuple(route)


def random_route(rng: random.Random, ranks: int, tokens: int, layers: int) -> tuple:
    """Random nonempty destination sets of every token of every rank in every layer."""
    return tuple(
        tuple(tuple(rng.randrange(1, 1 << ranks) for _ in range(tokens)) for _ in range(ranks))
        for _ in range(layers)
    )


def sequence(calls: str) -> list:
    """What the guards should decide for one rank's `calls`: per call `(kind, layer, error)` with `error` None
    (in sequence) or `(code, layer)`; the list stops at the first call out of sequence (the kernels trap)."""
    out, ed, ec = [], 0, 0
    for call in calls:
        if call == "D":
            if ec == ed:
                out.append(("D", ed, None))
                ec = ed + 1
                continue
            out.append(("D", ed, (ERROR_DISPATCH_TWICE, ed)))
        else:
            if ec == ed + 1:
                out.append(("C", ed, None))
                ed = ec
                continue
            out.append(("C", ed, (ERROR_COMBINE_WITHOUT_DISPATCH, ed)))
        break
    return out


class Violation(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


@dataclasses.dataclass
class Result:
    """What an exploration found: states visited, transitions taken, terminal states where every rank finished,
    the error records `(rank, code, layer)` of the terminal states where a rank stopped on a sequence error,
    seconds, and for each violation kind found, the first message and the schedule (step labels) reaching it."""

    states: int = 0
    transitions: int = 0
    finished: int = 0
    errors: set = dataclasses.field(default_factory=set)
    seconds: float = 0.0
    violations: dict = dataclasses.field(default_factory=dict)
    complete: bool = True

    @property
    def ok(self) -> bool:
        return not self.violations

    def kinds(self) -> set:
        return set(self.violations)


# LL word encoding in the state: (payload store's layer + 1) << 8 | (epoch store's layer + 1) << 2 | payload
# valid bit (headers: a source word, not -1) << 1 | read bit. Layer 0 + 1 = 1; 0: never written (epoch 0).
def _pl(word: int) -> int:
    return word >> 8


def _el(word: int) -> int:
    return (word >> 2) & 63


class Model:
    """The state machine of one `Config`.

    A state is `(words, pending)`. `words` is a flat tuple: per rank a block `[k, next_started, EPOCH_D,
    EPOCH_C, error, counter_d, counter_c]`, then `2 * Gmax` CTA words `pc | (layer + 1) << 8` (current kernel,
    next kernel), then (`route="any"`) `2 * T` chosen destination masks (by layer parity); then per rank its
    memory: hdr[N S], data[N S][W], comb[T][N][W] (LL words), ready[N] (epoch values), mirror[N S]
    (`(layer + 1) << 2 | valid << 1 | read`). `pending`: a frozenset of `(word, half, layer, valid)` (half 0:
    a whole LL word or a ready line, 1: payload only, 2: epoch only).
    """

    def __init__(self, config: Config):
        self.cfg = cfg = config
        n, t, s, W = cfg.ranks, cfg.tokens, cfg.stride, cfg.words
        self.n, self.t, self.s, self.W = n, t, s, W
        self.ns = n * s
        self.nrows = self.ns * (2 if cfg.double_rows else 1)  # receive rows in the buffer (both halves)
        self.polled = [q for q in range(self.ns) if q % s < t]  # the rows that carry something: j < T of each rank
        self.any_route = cfg.route == "any"
        self.bypass = cfg.own_rows == "bypass"
        self.masks = tuple(range(1, 1 << n))
        self.plans = [sequence(c) for c in cfg.calls]
        self.gmax = max(cfg.dispatch_grid, cfg.combine_grid)
        self.rb = _HEAD + 2 * self.gmax + (2 * t if self.any_route else 0)
        self.mem = n * self.rb
        self.o_data = self.nrows
        self.o_comb = self.nrows + self.nrows * W
        self.o_ready = self.o_comb + t * n * W
        self.o_mirror = self.o_ready + n
        self.mb = self.o_mirror + self.ns
        self.size = self.mem + n * self.mb
        # what each word is: 0 LL header, 1 LL data, 2 LL comb, 3 ready, 4 mirror
        self.kind_at = [None] * self.size
        for d in range(n):
            b = self.mem + d * self.mb
            for i in range(self.mb):
                self.kind_at[b + i] = (
                    0 if i < self.o_data else 1 if i < self.o_comb else 2 if i < self.o_ready else
                    3 if i < self.o_mirror else 4
                )
        self._closed_cache = {}
        self._ep = [0] + [self.epoch(layer) for layer in range(63)]  # epoch of a word by its (layer + 1) tag
        # the same for the words of narrow epochs (`Config.epochs`: data and comb words), and the table of each word
        narrow = [0] + [self.narrow(self.epoch(layer)) for layer in range(63)]
        self._ep_at = [narrow if cfg.epochs is not None and k in (1, 2) else self._ep for k in self.kind_at]
        self.data_locs = [[tuple(self.data(r, q, i) for i in range(W)) for q in range(self.nrows)] for r in range(n)]
        # the words a reduce of token `tok` polls, by destination mask
        self.comb_locs = [
            [
                [self._slot_words(r, tok, m) for m in range(1 << n)]
                for tok in range(t)
            ]
            for r in range(n)
        ]
        self.programs = {kind: [self._program(kind, c) for c in range(self.grid_of(kind))] for kind in "DC"}
        self.guard_eager = cfg.stream_order and cfg.resident is None and cfg.reduce
        self.eager = cfg.reduce
        self.layers = max(sum(1 for p in plan if p[0] == "D" and p[2] is None) for plan in self.plans)
        if not self.any_route:
            assert len(cfg.route) >= self.layers

    def _slot_words(self, r, tok, mask):
        return tuple(
            self.comb(r, tok, d, i)
            for d in range(self.n)
            if mask >> d & 1 and not (self.bypass and d == r)
            for i in range(self.W)
        )

    def _own(self, r, op) -> bool:
        """`own_rows="bypass"`: the step `op` of rank `r` touches its own row or slot, which has no buffer word
        (the step does nothing)."""
        if not self.bypass:
            return False
        if op[0] in ("copy", "hdr", "data", "send"):
            return op[1] // self.s == r
        return op[0] == "slot" and op[2] == r

    def _idle(self, r, layer, c, op) -> bool:
        """The step `op` of CTA `c` of rank `r` in `layer` touches nothing: its rank's own row or slot (`_own`),
        or a store, row or token past the layer's T (`Config.layer_tokens`)."""
        if self._own(r, op):
            return True
        if self.cfg.layer_tokens is None or layer < 0:
            return False
        t = self.layer_t(r, layer)
        name = op[0]
        if name == "store":
            return c >= t  # CTA c stores the rows c, c + Gd, ... < T: none from c = T on
        if name in ("copy", "hdr", "data", "send"):
            return op[1] % self.s >= t
        if name in ("reduce", "slot"):
            return op[1] >= t
        return False

    def layer_t(self, r, layer) -> int:
        """T of rank `r` in `layer` (`Config.layer_tokens`, this rank's own view where ranks disagree)."""
        t = self.t if self.cfg.layer_tokens is None else self.cfg.layer_tokens[layer]
        return t[r] if isinstance(t, tuple) else t

    def stored_tokens(self, r, layer, c) -> range:
        """The tokens dispatch CTA `c` of rank `r` stores in `layer`, one after another in its store step:
        `c, c + Gd, ... < T` (one token where Gd >= T)."""
        return range(c, self.layer_t(r, layer), self.cfg.dispatch_grid)

    def hq(self, q, layer):
        """The buffer row that receive row `q` of `layer` occupies (`Config.double_rows`: half `layer % 2`)."""
        return q + (layer % 2) * self.ns if self.cfg.double_rows and layer >= 0 else q

    # ------------------------------------------------------------------------------------------------------
    # addresses
    def hdr(self, d, q):
        return self.mem + d * self.mb + q

    def data(self, d, q, w):
        return self.mem + d * self.mb + self.o_data + q * self.W + w

    def comb(self, d, t, src, w):
        return self.mem + d * self.mb + self.o_comb + (t * self.n + src) * self.W + w

    def ready(self, d, src):
        return self.mem + d * self.mb + self.o_ready + src

    def mirror(self, d, q):
        return self.mem + d * self.mb + self.o_mirror + q

    def where(self, at: int) -> str:
        """A word of the state in words."""
        if at < self.mem:
            return f"word {at}"
        d, i = divmod(at - self.mem, self.mb)
        if i < self.o_data:
            return f"hdr[{self._row(i)}] on r{d}"
        if i < self.o_comb:
            q, w = divmod(i - self.o_data, self.W)
            return f"data word {w} of row {self._row(q)} on r{d}"
        if i < self.o_ready:
            tok, rest = divmod(i - self.o_comb, self.n * self.W)
            src, w = divmod(rest, self.W)
            return f"word {w} of comb slot [{tok}][{src}] on r{d}"
        if i < self.o_mirror:
            return f"ready[{i - self.o_ready}] on r{d}"
        return f"mirror[{self._row(i - self.o_mirror)}] on r{d}"

    def _row(self, q):
        half, q = divmod(q, self.ns)
        return f"{q} (r{q // self.s} j{q % self.s}{' half 1' if half else ''})"

    def grid_of(self, kind: str) -> int:
        return self.cfg.dispatch_grid if kind == "D" else self.cfg.combine_grid

    def epoch(self, layer: int) -> int:
        """The epoch layer `layer` writes and expects (`advance_epoch=False`: always 1)."""
        return layer + 1 if self.cfg.advance_epoch else 1

    def narrow(self, epoch: int) -> int:
        """`epoch` as a word of narrow epochs carries it (`Config.epochs` values, 0 kept for never written)."""
        return epoch if self.cfg.epochs is None or not epoch else 1 + (epoch - 1) % self.cfg.epochs

    def target(self, at: int, layer: int) -> int:
        """The epoch a reader in `layer` waits for in word `at` (what the word carries once `layer` wrote it)."""
        return self._ep_at[at][layer + 1]

    def _program(self, kind: str, c: int) -> tuple:
        cfg, W = self.cfg, self.W
        ops = [("guard",)]
        if kind == "D":
            if c < self.t:
                ops.append(("store",))
            for q in self.polled[c::cfg.dispatch_grid]:
                if cfg.atomic_reads:
                    ops.append(("copy", q))
                else:
                    ops.append(("hdr", q))
                    ops.extend(("data", q, w) for w in range(W))
        else:
            ops.extend(("send", q) for q in self.polled[c::cfg.combine_grid])
            for tok in range(c, self.t, cfg.combine_grid):
                if cfg.atomic_reads:
                    ops.append(("reduce", tok))
                else:
                    ops.extend(("slot", tok, d, w) for d in range(self.n) for w in range(W))
        return tuple(ops)

    def route(self, w, r: int, layer: int, tok: int) -> int:
        """D(tok) of rank `r` in `layer` (0 for layer -1: a combine sibling out of sequence at the start)."""
        if layer < 0:
            return 0
        if self.any_route:
            return w[r * self.rb + _HEAD + 2 * self.gmax + (layer % 2) * self.t + tok]
        return self.cfg.route[layer][r][tok]

    # ------------------------------------------------------------------------------------------------------
    def initial(self):
        return (tuple([0] * self.size), frozenset())

    def finished(self, w) -> bool:
        """Every rank finished its calls or stopped on an error."""
        return all(w[r * self.rb + _K] >= len(self.plans[r]) or w[r * self.rb + _ERR] for r in range(self.n))

    def cta(self, r: int, which: int, c: int) -> int:
        return r * self.rb + _HEAD + which * self.gmax + c

    # ------------------------------------------------------------------------------------------------------
    def successors(self, state):
        """[(step, next_state or Violation)]: the steps enabled in `state` (after the reductions), applied."""
        return [(step, self._apply(state, step)) for step in self.enabled(state)]

    def enabled(self, state):
        """The steps enabled in `state` (after the reductions), not applied. A step that reads peer-written
        words carries the pending stores that land just before it (`_landings`)."""
        w, pending = state
        cfg, n = self.cfg, self.n
        by_at = {}
        for p in pending:
            by_at.setdefault(p[0], []).append(p)
        out = []
        polled = {}  # word -> the epochs its pollers wait for
        for r in range(n):
            base = r * self.rb
            k = w[base + _K]
            plan = self.plans[r]
            if k >= len(plan) or w[base + _ERR]:
                continue
            if not cfg.stream_order and plan[k][0] == "C" and not w[base + _NEXT] and k + 1 < len(plan):
                return [("start", r)]
            for which in (0, 1) if w[base + _NEXT] else (0,):
                call = k + which
                kind, _, error = plan[call]
                good = error is None
                progs = self.programs[kind]
                running = None
                if cfg.resident is not None:
                    running = 0
                    for c in range(len(progs)):
                        pc = w[self.cta(r, which, c)] & 0xFF
                        if 0 < pc < len(progs[c]):
                            running += 1
                for c, prog in enumerate(progs):
                    word = w[self.cta(r, which, c)]
                    pc = word & 0xFF
                    if pc >= len(prog):
                        continue
                    op = prog[pc]
                    name = op[0]
                    step = (name, r, call, c) + op[1:]
                    if name == "guard":
                        if running is not None and running >= cfg.resident:
                            continue
                        if good and self.guard_eager and (cfg.guard != "all" or len(progs) == 1):
                            return [step]
                        out.append(step)
                        continue
                    layer = (word >> 8) - 1
                    e = self.epoch(layer)
                    if self._idle(r, layer, c, op):  # touches nothing: enabled at once
                        if good and self.eager:
                            return [step + ((),)]
                        out.append(step + ((),))
                        continue
                    if name == "store":
                        landed = ()
                        if cfg.wait_ready:
                            landed = self._ready_landings(w, by_at if self.eager else {}, r, e - 1)
                            if landed is None:
                                continue
                        if self.any_route and c < self.t:
                            # D(j) of each of the CTA's tokens: one mask per token
                            count = len(self.stored_tokens(r, layer, c))
                            steps = [step + (landed, m) for m in itertools.product(self.masks, repeat=count)]
                        else:
                            steps = [step + (landed,)]
                        if good and self.eager:
                            return steps
                        out.extend(steps)
                    elif name == "send":
                        if cfg.send_source == "header" and self.eager:
                            out.extend(step + (S,) for S in self._closed(by_at.get(self.hdr(r, self.hq(op[1], layer)),
                                                                                           ())))
                        elif good and cfg.stream_order and self.eager and cfg.send_source == "mirror":
                            return [step + ((),)]
                        else:
                            out.append(step + ((),))
                    elif self.eager:
                        out.extend(step + (S,) for S in self._landings(w, by_at, r, layer, op))
                        for at in self._polled(w, r, layer, op):
                            if at in by_at:
                                polled.setdefault(at, set()).add(self.target(at, layer))
                    elif self._landings(w, {}, r, layer, op):  # the poll succeeds on the landed memory
                        out.append(step + ((),))
        if not self.eager:
            # no reductions: every store that may land (coherence order) is a step of its own
            out.extend(("land", (p,)) for p in pending if self._may_land(p, pending))
            return out
        # A landing that is itself a violation (a store overwriting a value its reader has not read), or that
        # turns off a poll that could succeed now, is taken at once; every other landing waits for the read
        # that sees it.
        for at, stores in by_at.items():
            if self.kind_at[at] == 3:
                continue  # a ready line: only ever waited on for a lower bound
            wanted = polled.get(at, ())
            now = self._epoch_of(w[at], at)
            quiet = len(stores) == 1 and (w[at] & 1 or not w[at] >> 8) and now not in wanted
            if quiet:
                continue  # one store onto a value already read (or never written) that nobody polls for
            for S in self._closed(stores):
                if not S:
                    continue
                if self._overwrites(w[at], S) or (now in wanted and self._epoch_of(self._after(w[at], S), at) != now):
                    out.append(("land", S))
        if not out and pending:
            # nothing else can move: the stores nobody reads any more land (one at a time, least first)
            out.append(("land", (min(p for p in pending if self._may_land(p, pending)),)))
        return out

    @staticmethod
    def _overwrites(word, stores) -> bool:
        """Whether landing `stores` (pending at one word, in landing order) overwrites a value never read."""
        for store in stores:
            pl = _pl(word)
            if pl and pl == _el(word) and pl != store[2] + 1 and not word & 1:
                return True
            word = Model._after(word, (store,))
        return False

    def _ready_landings(self, w, by_at, r, need):
        """The fewest pending ready stores that bring every ready line of rank `r` to `need`, or None."""
        landed = []
        for d in range(self.n):
            at = self.ready(r, d)
            if w[at] >= need:
                continue
            for p in sorted(by_at.get(at, ()), key=lambda p: p[2]):
                landed.append(p)
                if self.epoch(p[2]) >= need:
                    break
            else:
                return None
        return tuple(sorted(landed))

    def _closed(self, stores) -> list:
        """Every set of `stores` (pending at one word) that can have landed: closed under issue order; each
        set is sorted in landing order."""
        if not stores:
            return [()]
        if len(stores) == 1:
            return [(), tuple(stores)]
        key = frozenset(stores)
        out = self._closed_cache.get(key)
        if out is None:
            ordered = sorted(stores, key=lambda p: (p[2], p[1]))
            out = []
            for size in range(len(ordered) + 1):
                for sub in itertools.combinations(ordered, size):
                    if all(o in sub for p in sub for o in ordered if self._before(o, p)):
                        out.append(sub)
            self._closed_cache[key] = out
        return out

    @staticmethod
    def _before(o, p) -> bool:
        """Store `o` lands before store `p` (same word, earlier layer, overlapping halves)."""
        return o[0] == p[0] and o[2] < p[2] and (o[1] == 0 or p[1] == 0 or o[1] == p[1])

    @staticmethod
    def _after(word, stores):
        """The word once `stores` (pending at it, in landing order) have landed (no checks)."""
        for _, half, layer, valid in stores:
            pl, el, v = _pl(word), _el(word), word >> 1 & 1
            if half != 2:
                pl, v = layer + 1, valid
            if half != 1:
                el = layer + 1
            word = pl << 8 | el << 2 | v << 1
        return word

    def _landings(self, w, by_at, r, layer, op) -> list:
        """The poll `op` of rank `r` can succeed after each returned set of pending stores lands (a union of one
        set per polled word: a prefix in issue order of the stores pending there)."""
        if op[0] != "copy":
            return self._product(w, by_at, self._locs(w, r, layer, op), layer)
        q = self.hq(op[1], layer)
        h_at = self.hdr(r, q)
        out = []
        for hs in self._product(w, by_at, (h_at,), layer):
            if not (self._after(w[h_at], hs) if hs else w[h_at]) >> 1 & 1:
                out.append(hs)  # an empty row: its data words are not read
                continue
            for ds in self._product(w, by_at, self.data_locs[r][q], layer):
                out.append(tuple(sorted(hs + ds)) if hs and ds else hs or ds)
        return out

    def _product(self, w, by_at, locs, layer) -> list:
        """The sets of pending stores whose landing leaves every word of `locs` carrying the epoch a reader in
        `layer` waits for."""
        per_word = []
        for at in locs:
            ep = self._ep_at[at]
            e = ep[layer + 1]
            stores = by_at.get(at)
            if stores is None:
                if ep[w[at] >> 2 & 63] != e:
                    return []
                continue
            options = [S for S in self._closed(stores) if ep[(self._after(w[at], S) if S else w[at]) >> 2 & 63] == e]
            if not options:
                return []
            per_word.append(options)
        if not per_word:
            return [()]
        if len(per_word) == 1:
            return per_word[0]
        return [tuple(sorted(sum(combo, ()))) for combo in itertools.product(*per_word)]

    def _polled(self, w, r, layer, op):
        """The words the poll `op` reads."""
        if op[0] == "copy":
            q = self.hq(op[1], layer)
            return (self.hdr(r, q),) + self.data_locs[r][q]
        return self._locs(w, r, layer, op)

    def _locs(self, w, r, layer, op):
        name = op[0]
        if name == "hdr":
            return [self.hdr(r, self.hq(op[1], layer))]
        if name == "data":
            return [self.data(r, self.hq(op[1], layer), op[2])]
        if name == "reduce":
            tok = op[1]
            return self.comb_locs[r][tok][self.route(w, r, layer, tok)]
        if name == "slot":
            return [self.comb(r, op[1], op[2], op[3])]
        raise AssertionError(op)  # pragma: no cover

    def _epoch_of(self, word: int, at: int) -> int:
        """The epoch value word `at` holding `word` carries."""
        return self._ep_at[at][word >> 2 & 63]

    @staticmethod
    def _may_land(p, pending) -> bool:
        """Coherence: the stores of one writer to one word land in issue order (layer order)."""
        return not any(Model._before(o, p) for o in pending)

    # ------------------------------------------------------------------------------------------------------
    def describe(self, step) -> str:
        """A step in words (for the schedules of counterexamples)."""
        op = step[0]
        if op == "land":
            return " then ".join(self._describe_store(p) for p in step[1]) + " lands"
        if op == "start":
            return f"r{step[1]} starts its next dispatch before its combine finished"
        _, r, call, c = step[:4]
        kind, layer, error = self.plans[r][call]
        name = "dispatch" if kind == "D" else "combine"
        tag = f"r{r} L{layer} {name}{' (out of sequence)' if error else ''} cta{c}"
        if op == "guard":
            words = "reads the epoch words"
        elif op == "store":
            words = "sees every ready line, issues its row stores" if self.cfg.wait_ready else "issues its row stores"
            if len(step) > 5:
                tokens = self.stored_tokens(r, layer, c)
                words += " (" + ", ".join(f"token {j} to ranks {[d for d in range(self.n) if m >> d & 1]}"
                                         for j, m in zip(tokens, step[5])) + ")"
        elif op == "copy":
            words = f"copies out row {self._row(step[4])}"
        elif op == "hdr":
            words = f"polls hdr[{self._row(step[4])}]"
        elif op == "data":
            words = f"polls data word {step[5]} of row {self._row(step[4])}"
        elif op == "send":
            words = f"sends row {self._row(step[4])} ({'mirror' if self.cfg.send_source == 'mirror' else 'hdr'})"
        elif op == "reduce":
            words = f"reduces token {step[4]}"
        else:
            words = f"polls word {step[6]} of comb slot [{step[4]}][{step[5]}]"
        nargs = {"store": 0, "copy": 1, "hdr": 1, "data": 2, "send": 1, "reduce": 1, "slot": 3}.get(op)
        if nargs is not None and len(step) > 4 + nargs and step[4 + nargs]:
            words += " after " + ", ".join(self._describe_store(p) for p in step[4 + nargs]) + " landed"
        return f"{tag}: {words}"

    def _describe_store(self, p) -> str:
        at, half, layer, valid = p
        what = ("", " (payload half)", " (epoch half)")[half]
        value = (" {src}" if valid else " {-1}") if self.kind_at[at] == 0 else ""
        return f"the L{layer} store{value}{what} into {self.where(at)}"

    def _apply(self, state, step):
        try:
            return self._step(state, step)
        except Violation as v:
            return Violation(v.kind, f"{self.describe(step)}: {v.message}")

    # ------------------------------------------------------------------------------------------------------
    def _step(self, state, step):
        w0, pending = state
        w = list(w0)
        cfg, n = self.cfg, self.n
        op = step[0]
        if op == "land":
            for p in sorted(step[1], key=lambda p: (p[2], p[1])):
                self._land(w, p)
            return (tuple(w), pending - set(step[1]))
        if op == "start":
            r = step[1]
            w[r * self.rb + _NEXT] = 1
            return (tuple(w), pending)
        _, r, k, c = step[:4]
        base = r * self.rb
        which = k - w[base + _K]
        kind, plan_layer, error = self.plans[r][k]
        at = self.cta(r, which, c)
        word = w[at]
        pc = word & 0xFF
        layer = (word >> 8) - 1
        nargs = len(self.programs[kind][c][pc]) - 1
        extra = step[4 + nargs:]
        for p in sorted(extra[0], key=lambda p: (p[2], p[1])) if extra else ():  # landing just before this step
            self._land(w, p)
            pending = pending - {p}
        masks = extra[1] if len(extra) > 1 else None  # route="any": D(j) of each token j of this store step
        new = []
        if op == "guard":
            layer = self._guard(w, r, c, kind, plan_layer, error, new)
            if layer is None:  # the rank stopped on a sequence error (trap)
                return (tuple(w), pending | frozenset(new))
        elif self._idle(r, layer, c, (op,) + step[4:]):
            if op == "hdr":
                pc += self.W  # and its data polls
        elif op == "store":
            for i, j in enumerate(self.stored_tokens(r, layer, c)):
                q = r * self.s + j
                if masks is not None:
                    dests = masks[i]
                    w[base + _HEAD + 2 * self.gmax + (layer % 2) * self.t + j] = dests
                else:
                    dests = self.route(w, r, layer, j)
                for d in range(n):
                    if self.bypass and d == r:
                        continue  # the own row goes straight into the outputs
                    hq = self.hq(q, layer)
                    if dests >> d & 1:
                        for i in range(self.W):
                            new.extend(self._ll_stores(self.data(d, hq, i), layer, 0))
                        new.extend(self._ll_stores(self.hdr(d, hq), layer, 1))
                    else:
                        new.extend(self._ll_stores(self.hdr(d, hq), layer, 0))
        elif op in ("copy", "hdr", "data"):
            q = step[4]
            hq = self.hq(q, layer)
            if op == "data":
                self._accept(w, self.data(r, hq, step[5]), layer, "reader of", pending)
                if step[5] == self.W - 1:
                    self._write_mirror(w, r, q, layer, 1, error)
            else:
                h = w[self.hdr(r, hq)]
                self._accept(w, self.hdr(r, hq), layer, "copy-out of")
                valid = h >> 1 & 1
                if op == "copy":
                    if valid:
                        for i in range(self.W):
                            self._accept(w, self.data(r, hq, i), layer, "copy-out of", pending)
                    self._write_mirror(w, r, q, layer, valid, error)
                elif not valid:
                    self._write_mirror(w, r, q, layer, 0, error)
                    pc += self.W  # skip the data polls of an empty row
        elif op == "send":
            q = step[4]
            if cfg.send_source == "mirror":
                m_at = self.mirror(r, q)
                m = w[m_at]
                m_layer = (m >> 2) - 1
                if m_layer != layer:
                    kind_ = STALE_READ if m_layer < layer else WRONG_LAYER_READ
                    raise Violation(
                        kind_,
                        f"mirror[{self._row(q)}] on r{r} holds layer {m_layer} (the combine is in layer {layer})",
                    )
                w[m_at] = m | 1
                valid = m >> 1 & 1
            else:
                h_at = self.hdr(r, self.hq(q, layer))
                h = w[h_at]
                self._check(h, layer, "combine's read of", h_at)
                valid = h >> 1 & 1
            if valid:
                src, j = divmod(q, self.s)
                for i in range(self.W):
                    new.extend(self._ll_stores(self.comb(src, j, r, i), layer, 0))
        elif op == "reduce":
            tok = step[4]
            for at_ in self._locs(w, r, layer, ("reduce", tok)):
                self._accept(w, at_, layer, "reduce of", pending)
        elif op == "slot":
            self._accept(w, self.comb(r, step[4], step[5], step[6]), layer, "reduce of", pending)
        else:  # pragma: no cover
            raise AssertionError(op)
        if new and error is not None:
            raise Violation(GUARD_LEAK, f"the call out of sequence stores into {self.where(new[0][0])}")
        pc += 1
        # skip the slot polls of ranks outside the token's destination set
        prog = self.programs[kind][c]
        while pc < len(prog) and prog[pc][0] == "slot":
            if self.route(w, r, layer, prog[pc][1]) >> prog[pc][2] & 1 and not self._idle(r, layer, c, prog[pc]):
                break
            pc += 1
        w[at] = pc | (layer + 1) << 8
        if pc >= len(prog):
            self._normalize(w, r)
        return (tuple(w), pending | frozenset(new))

    def _ll_stores(self, at, layer, valid):
        if self.cfg.ll_atomic:
            return [(at, 0, layer, valid)]
        return [(at, 1, layer, valid), (at, 2, layer, valid)]

    def _guard(self, w, r, c, kind, plan_layer, error, new):
        """The sequence guard of one CTA (`Config.guard`). Returns the layer the CTA runs, or None when it
        recorded an error (the rank stops)."""
        cfg = self.cfg
        base = r * self.rb
        mode = cfg.guard
        ed, ec = w[base + _ED], w[base + _EC]
        grid = self.grid_of(kind)
        if kind == "D":
            layer = ed
            ok = ec == ed
            code = ERROR_DISPATCH_TWICE
            checks = mode in ("all", "counter") or (mode == "cta0" and c == 0)
        else:
            # "cta0": the CTAs but 0 take the layer from EPOCH_C alone (EPOCH_D is written by CTA 0)
            layer = ec - 1 if mode in ("cta0", "none") and c else ed
            ok = ec == ed + 1
            code = ERROR_COMBINE_WITHOUT_DISPATCH
            checks = mode in ("all", "counter") or (mode == "cta0" and c == 0)
        if checks and not ok:
            record = (code, ed)
            w[base + _ERR] = code << 8 | ed
            if error is None:
                raise Violation(
                    SPURIOUS_GUARD,
                    f"r{r} records error {code} ({'dispatch twice' if code == 3 else 'combine without dispatch'}) "
                    f"in a call made in sequence: EPOCH_D = {ed}, EPOCH_C = {ec}",
                )
            if record != error:
                raise Violation(GUARD_MISSED, f"r{r} records {record}, expected {error}")
            return None
        writes = []
        if kind == "D":
            if (mode == "counter" and self._arrive(w, base + _CNT_D, grid)) or (mode != "counter" and c == 0):
                w[base + _EC] = layer + 1
                writes.append("EPOCH_C")
            if cfg.ready_in == "dispatch" and c == 0:
                new.extend((self.ready(d, r), 0, layer, 0) for d in range(self.n))
        else:
            if c == 0 and cfg.ready_in == "combine":
                new.extend((self.ready(d, r), 0, layer, 0) for d in range(self.n))
            if (mode == "counter" and self._arrive(w, base + _CNT_C, grid)) or (mode != "counter" and c == 0):
                w[base + _ED] = layer + 1
                writes.append("EPOCH_D")
        if error is not None and writes:
            raise Violation(GUARD_LEAK, f"the call out of sequence writes {writes[0]} on r{r}")
        return layer

    @staticmethod
    def _arrive(w, at, grid) -> bool:
        w[at] += 1
        if w[at] == grid:
            w[at] = 0
            return True
        return False

    def _check(self, word, layer, who, at):
        """A reader (`who`, reading word `at`) accepts `word` in `layer`: it must be whole and of that layer."""
        pl, el = _pl(word), _el(word)
        if pl == el == layer + 1:
            return
        what = f"the {who} {self.where(at)}"
        if pl != el:
            raise Violation(
                TORN_READ,
                f"{what} accepts a torn LL word: payload of layer {pl - 1}, epoch of layer {el - 1}",
            )
        if pl - 1 < layer:
            raise Violation(
                STALE_READ,
                f"{what} accepts {'a never written word' if not pl else f'a layer {pl - 1} word'} in layer {layer}",
            )
        if pl - 1 > layer:
            raise Violation(WRONG_LAYER_READ, f"{what} accepts a layer {pl - 1} word in layer {layer}")

    def _accept(self, w, at, layer, who, pending=()):
        self._check(w[at], layer, who, at)
        w[at] |= 1
        if self.cfg.invalidate and self.kind_at[at] in (1, 2):
            # the reader's own store of epoch 0 (local: visible at once); a peer's store to the word issued
            # before it would race with it
            if any(p[0] == at for p in pending):
                raise Violation(
                    OVERWRITE_UNREAD,
                    f"a store into {self.where(at)} was issued before its reader in layer {layer} invalidated it",
                )
            w[at] = _pl(w[at]) << 8 | (w[at] & 3)

    def _write_mirror(self, w, r, q, layer, valid, error):
        if self.cfg.send_source != "mirror":  # variant (c): no mirror
            return
        if error is not None:
            raise Violation(GUARD_LEAK, f"the call out of sequence copies row {self._row(q)} out again (mirror[])")
        at = self.mirror(r, q)
        old = w[at]
        if old and not old & 1:
            raise Violation(
                OVERWRITE_UNREAD,
                f"layer {layer} copy-out writes mirror[{self._row(q)}] on r{r} before the layer {(old >> 2) - 1} "
                f"combine read it",
            )
        w[at] = (layer + 1) << 2 | valid << 1

    def _land(self, w, p):
        at, half, layer, valid = p
        kind = self.kind_at[at]
        if kind == 3:
            w[at] = self.epoch(layer)
            return
        old = w[at]
        pl, el = _pl(old), _el(old)
        if pl and pl == el and pl != layer + 1 and not old & 1:
            raise Violation(
                OVERWRITE_UNREAD,
                f"a layer {layer} store lands on {self.where(at)} whose layer {pl - 1} value was never read",
            )
        if half != 2:
            pl = layer + 1
            v = valid
        else:
            v = old >> 1 & 1
        if half != 1:
            el = layer + 1
        w[at] = pl << 8 | el << 2 | v << 1

    def _normalize(self, w, r):
        """Ends the rank's current kernel once all its CTAs finished; the next one (if started early) moves in."""
        base = r * self.rb
        plan = self.plans[r]
        while w[base + _K] < len(plan):
            k = w[base + _K]
            kind, layer, error = plan[k]
            progs = self.programs[kind]
            if not all((w[self.cta(r, 0, c)] & 0xFF) >= len(progs[c]) for c in range(len(progs))):
                return
            if error is not None and not w[base + _ERR]:
                raise Violation(GUARD_MISSED, f"r{r}'s call out of sequence (layer {layer}) finished without error")
            lo = base + _HEAD
            g = self.gmax
            if self.any_route and kind == "C":  # the layer's chosen routes are not needed any more
                at = lo + 2 * g + (layer % 2) * self.t
                w[at:at + self.t] = [0] * self.t
            if w[base + _NEXT]:
                w[lo:lo + g] = w[lo + g:lo + 2 * g]
            else:
                w[lo:lo + g] = [0] * g
            w[lo + g:lo + 2 * g] = [0] * g
            w[base + _NEXT] = 0
            w[base + _K] = k + 1

    # ------------------------------------------------------------------------------------------------------
    def terminal_check(self, state):
        """At a state where nothing can move: None if every rank finished and the buffers are in their final
        state, or some rank stopped on a sequence error (its peers would time out); else the Violation."""
        w, _ = state
        n = self.n
        if any(w[r * self.rb + _ERR] for r in range(n)):
            return None
        if not self.finished(w):
            stuck = [r for r in range(n) if w[r * self.rb + _K] < len(self.plans[r])]
            return Violation(DEADLOCK, f"nothing can move and r{stuck} have not finished")
        last = self.layers
        for r in range(n):
            base = r * self.rb
            if (w[base + _ED], w[base + _EC]) != (last, last):
                return Violation(BAD_FINAL_STATE, f"r{r} ends with EPOCH_D, EPOCH_C = {w[base + _ED]}, {w[base + _EC]}")
        for at in range(self.mem, self.size):
            kind, word = self.kind_at[at], w[at]
            if kind == 3:
                if self.cfg.ready_in != "none" and word != self.epoch(last - 1):
                    return Violation(BAD_FINAL_STATE, f"{self.where(at)} ends at {word}")
            elif word and not word & 1:
                return Violation(BAD_FINAL_STATE, f"{self.where(at)} was written and never read")
        return None
