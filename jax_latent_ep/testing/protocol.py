"""A model checker of the dispatch / combine synchronisation (pure Python, no JAX).

The two kernels of `jax_latent_ep.kernels` (`dispatch`, `combine`) are written here as an explicit state machine
over `N` ranks, each running `layers` consecutive layers (dispatch, combine, dispatch, ...) in stream order, the
ranks independent of each other. `explore` enumerates every reachable state (depth first, with a visited set);
`random_runs` follows random schedules. Both check, on every transition:

* ``flag_raised_while_set``: a flag is raised (set to 1) while it still holds the previous raise;
* ``flag_rearmed_unseen``: a flag is re-armed (set to 0) before every waiting CTA of its reader saw it;
* ``stale_flag``: a waiter observes a flag raised for another layer;
* ``overwrite_unread``: a store lands on a receive row that still holds data (not yet read and re-armed),
  a re-arm lands on a row holding another layer's data, or a partial lands on a combine slot not yet read;
* ``read_before_write``: a receive row or a combine slot is read before this layer's value landed in it;
* ``stale_read``: an empty receive row (no token reached it this layer) still holds data when read;
* ``deadlock``: no step is possible and some rank has not finished;
* ``not_rearmed``: at the end some flag or receive row is not back to its armed state.

Memory model (weak enough for a missing fence to matter):

* Data stores (receive rows, their re-arm, combine partials) of a CTA's *storing thread* do not land at once:
  they wait in a pending set and land either at that thread's own system fence (which lands all of its
  pending stores) or at any earlier moment. A fence by another thread (the lane-0 arrival thread) does not land
  them, and neither does the end of the kernel: a store not fenced may land after the arrival was counted,
  after the flag was raised, after the kernel finished.
* Flags and arrival counters are single words written by the arrival thread (lane 0 of warp 0) after its own
  fence; they are visible at once (each flag store is its own step, so the raises reach the ranks in any
  interleaving with everything else).
* Reads (flag polls, receive rows, combine slots) see the landed memory; the readers' acquire fences after
  `wait_flags` are implicit.

Each CTA has two threads: ``S``, a storing thread (it stands for every thread that writes rows / partials), and
``A``, lane 0 of warp 0 (arrivals, flags, polls, then the reads that follow the wait). Steps:

dispatch, CTA ``c`` of rank ``r``, layer ``l`` (grid ``Gd >= T``):
  S: issue the stores of token ``c`` (if ``c < T``) into row ``r*T + c`` of every destination rank;
     system fence (lands them); CTA barrier.
  A: after the barrier, fence + arrive on CTRL_DISPATCH_DONE; the ``Gd``-th arrival resets the counter and
     raises flag ``r`` on ranks 0..N-1 (one step each); every CTA waits for the N dispatch flags, arrives on
     CTRL_DISPATCH_SEEN, then reads (copies out) its receive rows ``c, c + Gd, ...``; the ``Gd``-th SEEN
     arrival then re-arms the N dispatch flags of this rank (one step; as the kernels' `finish_seen` does at
     their end; ``rearm_at_end=False``: before its reads, as in the seed).
combine, CTA ``c`` (grid ``Gc >= 1``):
  S: reads the source word of each of its receive rows ``c, c + Gc, ...`` and, if it holds a token, issues the
     partial to the source's combine slot ``[token, r]`` and the row's re-arm; system fence; barrier.
  A: fence + arrive on CTRL_COMBINE_DONE; the ``Gc``-th raises combine flag ``r`` on every rank (one step
     each); the CTAs ``c < min(Gc, T)`` wait for the N combine flags, arrive on CTRL_COMBINE_SEEN, read the
     combine slots of their tokens ``c, c + Gc, ...`` (the slot of every destination rank of the token); the
     last SEEN arrival then re-arms the combine flags (before its reads with ``rearm_at_end=False``).

Receive rows are modelled for tokens ``t < T`` only (rows ``t >= T`` of the real ``stride(T)`` block are never
written). The routing (which ranks a token reaches, per layer) is a parameter (`default_route`,
`random_route`).

Reductions (steps merged or left out; each keeps the violations reachable):

* Issuing stores into the pending set and starting the next kernel are invisible steps: they are taken
  eagerly and alone (a singleton ample set: the step is independent of every other step).
* A pending store to location ``L`` lands only where it can make a difference: just before an enabled
  read of ``L``, while another pending store to ``L`` exists, at its thread's fence, or once every rank
  finished. Any schedule can be reordered into one of these, because landing a store commutes with every step
  that does not touch ``L``.
* A wait is one step, enabled once all N flags are set (spinning on a 0 changes nothing). The lanes' polls
  really happen one by one, but a flag observed set stays set until it is re-armed, and re-arming it before
  every waiter passed its wait is itself reported (``flag_rearmed_unseen``), so up to the first violation the
  two are the same. The SEEN arrival that follows is merged into the wait step, and with per-thread fences the
  storing thread's fence, the CTA barrier and lane 0's DONE arrival are one step: arrivals touch only their
  rank's counter, so they commute with everything but that counter's other arrivals.
* The N local flag re-arms of the last waiter are one step (nobody polls them any more).
* ``atomic_reads=True`` (the default): a CTA's reads of its receive rows / combine slots are one step (a
  snapshot); stores landing among them are explored before or after the whole snapshot. ``atomic_reads=False``
  makes every row / token its own step (more states; the tests run both).

Flag stores and counters landing at once is an assumption: a flag's re-arm is a local store that is performed
before its kernel ends, and the next raise of that flag is causally after a later kernel of the same rank.

Broken variants (switches of `Config`), each caught by `explore` and by `random_runs`:

* ``fence_per_thread=False``: only the arrival thread fences, after the CTA barrier (in the kernels named by
  ``unfenced_kernels``); the storing thread's rows, re-arms and partials may land after the flag:
  ``read_before_write`` (then ``overwrite_unread``, ``stale_read``).
* ``rearm_by_writer=True``: the last waiter re-arms the flags it *wrote* (its own flag on every rank) instead
  of those it read: ``flag_rearmed_unseen`` (without that check: ``deadlock``).
* ``stream_order=False``: a rank may start its next dispatch as soon as its combine started (before it
  finished): ``overwrite_unread`` (then ``flag_raised_while_set``, ``stale_read``).
* ``seen_counter=False``: every dispatch / combine waiter re-arms the flags after its own wait (no SEEN
  counter): ``flag_rearmed_unseen`` as soon as a grid has two waiters.
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Callable

FLAG_RAISED_WHILE_SET = "flag_raised_while_set"
FLAG_REARMED_UNSEEN = "flag_rearmed_unseen"
STALE_FLAG = "stale_flag"
OVERWRITE_UNREAD = "overwrite_unread"
READ_BEFORE_WRITE = "read_before_write"
STALE_READ = "stale_read"
DEADLOCK = "deadlock"
NOT_REARMED = "not_rearmed"
KINDS = (
    FLAG_RAISED_WHILE_SET,
    FLAG_REARMED_UNSEEN,
    STALE_FLAG,
    OVERWRITE_UNREAD,
    READ_BEFORE_WRITE,
    STALE_READ,
    DEADLOCK,
    NOT_REARMED,
)

# Thread program counters.
S_FENCE = 100  # storing thread: about to fence (dispatch: pc 0 issues; combine: pc j < rows reads row j)
S_DONE = 999  # storing thread: at the CTA barrier (finished)
A_ARRIVE = 0  # arrival thread: waiting for the barrier, then arrives on the DONE counter
A_RAISE = 100  # + d: raise this rank's flag on rank d
A_WAIT = 200  # waiting for every flag, then arrives on the SEEN counter
A_REARM = 400  # (+ d with rearm_by_writer) re-arm
A_READ = 500  # + j: the j-th read after the wait (copy-out row / reduce token)
A_LAST = 700  # + j: the same, by the last waiter, which re-arms after its reads (`rearm_at_end`)
A_DONE = 999

# Pending store kinds.
P_ROW = 0  # a receive row's data (value: layer + 1)
P_REARM = 1  # a receive row's re-arm after combine (value: layer + 1 of the data it clears)
P_SLOT = 2  # a combine partial (value: layer + 1)

# Counters of a rank (offsets inside its block).
C_TDONE, C_DSEEN, C_CDONE, C_CSEEN = 1, 2, 3, 4


@dataclasses.dataclass(frozen=True)
class Config:
    """One model: `ranks` N, `tokens` T per rank, grids, `layers`, routing and variant switches.

    `route[l][s][t]` is the bitmask of the ranks that token `t` of rank `s` reaches in layer `l`; `None` picks
    `default_route`.
    """

    ranks: int
    tokens: int = 1
    dispatch_grid: int | None = None  # default: tokens
    combine_grid: int = 1
    layers: int = 3
    route: tuple | None = None
    fence_per_thread: bool = True
    unfenced_kernels: tuple = ("dispatch", "combine")  # where `fence_per_thread=False` drops the fence
    rearm_by_writer: bool = False
    stream_order: bool = True
    seen_counter: bool = True
    atomic_reads: bool = True  # a CTA's reads of its rows / slots after a wait are one step
    rearm_at_end: bool = True  # the last waiter re-arms after its own reads (the kernels); False: before them

    def __post_init__(self):
        if self.dispatch_grid is None:
            object.__setattr__(self, "dispatch_grid", self.tokens)
        if self.route is None:
            object.__setattr__(self, "route", default_route(self.ranks, self.tokens, self.layers))
        assert self.ranks >= 1 and self.tokens >= 1 and self.layers >= 1
        assert self.dispatch_grid >= self.tokens and self.combine_grid >= 1
        assert len(self.route) == self.layers


def default_route(ranks: int, tokens: int, layers: int) -> tuple:
    """A deterministic routing that changes from layer to layer, so that a row holds data in one layer and is
    empty in the next (and the other way round): token `t` of rank `s` reaches rank `d` in layer `l` unless
    `(l + s + t + d) % 3 == 0`, and always reaches at least one rank."""
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
    """Random destination sets (possibly empty) of every token of every rank in every layer."""
    return tuple(
        tuple(tuple(rng.randrange(1 << ranks) for _ in range(tokens)) for _ in range(ranks))
        for _ in range(layers)
    )


class Violation(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


@dataclasses.dataclass
class Result:
    """What an exploration found: states visited, transitions taken, terminal (finished) states, seconds, and
    for each violation kind found, the first message and the schedule (step labels) that reaches it."""

    states: int = 0
    transitions: int = 0
    finished: int = 0
    seconds: float = 0.0
    violations: dict = dataclasses.field(default_factory=dict)
    complete: bool = True

    @property
    def ok(self) -> bool:
        return not self.violations

    def kinds(self) -> set:
        return set(self.violations)


class Model:
    """The state machine of one `Config`.

    A state is `(words, pending)`: `words` a flat tuple of ints, `pending` a frozenset of the stores not yet
    landed, `(owner, kind, rank, index, value)` with `owner = (rank, kernel, cta)`.

    `words` holds, for each rank, a block `[kernel, tdone, dseen, cdone, cseen, started]` then, for the current
    kernel and for the next one (started early only with `stream_order=False`), `G` CTAs of
    `(s_pc, a_pc)`; then the dispatch flags `dflag[d * N + s]` (flag of source `s` on rank `d`; 0 or
    layer + 1), the combine flags `cflag[d * N + s]`, the receive rows `row[d * N * T + s * T + t]` (0 empty,
    else layer + 1 of the data), and the combine slots `slot[s * T * N + t * N + d]` (0, or
    `2 * (layer + 1) + read`).
    """

    def __init__(self, config: Config):
        self.cfg = cfg = config
        n, t = cfg.ranks, cfg.tokens
        self.n, self.t = n, t
        self.kernels = 2 * cfg.layers
        self.gmax = max(cfg.dispatch_grid, cfg.combine_grid)
        self.cta_words = 2 * self.gmax
        self.rank_words = 6 + 2 * self.cta_words
        self.df = n * self.rank_words
        self.cf = self.df + n * n
        self.rows = self.cf + n * n
        self.slots = self.rows + n * n * t
        self.size = self.slots + t * n * n
        # rows of each combine CTA / copy-out rows of each dispatch CTA / tokens of each combine CTA
        nrows = n * t
        self.drows = [list(range(c, nrows, cfg.dispatch_grid)) for c in range(cfg.dispatch_grid)]
        self.crows = [list(range(c, nrows, cfg.combine_grid)) for c in range(cfg.combine_grid)]
        self.ctoks = [list(range(c, t, cfg.combine_grid)) for c in range(cfg.combine_grid)]
        self.cwaiters = min(cfg.combine_grid, t)
        self.fenced = tuple(
            cfg.fence_per_thread or name not in cfg.unfenced_kernels for name in ("dispatch", "combine")
        )

    # ----------------------------------------------------------------------------------------------------
    def initial(self):
        return (tuple([0] * self.size), frozenset())

    def grid(self, kernel: int) -> int:
        return self.cfg.dispatch_grid if kernel % 2 == 0 else self.cfg.combine_grid

    def cta_base(self, r: int, which: int, c: int) -> int:
        return r * self.rank_words + 6 + which * self.cta_words + 2 * c

    def expected_row(self, layer: int, d: int, row: int) -> int:
        s, t = divmod(row, self.t)
        return layer + 1 if self.cfg.route[layer][s][t] >> d & 1 else 0

    def finished(self, w) -> bool:
        return all(w[r * self.rank_words] == self.kernels for r in range(self.n))

    # ----------------------------------------------------------------------------------------------------
    def _land(self, w: list, store):
        """Lands one pending store into `w` (checks for overwrites)."""
        _, kind, rank, index, value = store
        if kind == P_ROW:
            at = self.rows + rank * self.n * self.t + index
            if w[at] != 0:
                raise Violation(
                    OVERWRITE_UNREAD,
                    f"layer {value - 1} data lands on row {index} of rank {rank} still holding layer "
                    f"{w[at] - 1}",
                )
            w[at] = value
        elif kind == P_REARM:
            at = self.rows + rank * self.n * self.t + index
            if w[at] not in (0, value):
                raise Violation(
                    OVERWRITE_UNREAD,
                    f"the re-arm of layer {value - 1} lands on row {index} of rank {rank} holding "
                    f"unread layer {w[at] - 1} data",
                )
            w[at] = 0
        else:
            at = self.slots + index
            if w[at] != 0 and not w[at] & 1:
                raise Violation(
                    OVERWRITE_UNREAD,
                    f"layer {value - 1} partial lands on combine slot {index} of rank {rank} whose "
                    f"layer {w[at] // 2 - 1} partial was never read",
                )
            w[at] = 2 * value

    def _location(self, store):
        _, kind, rank, index, _ = store
        if kind == P_SLOT:
            return (1, index)
        return (0, rank * self.n * self.t + index)

    def _all_seen(self, w, reader: int, kernel_kind: int, layer: int, source: int) -> bool:
        """Whether every waiting CTA of rank `reader` in its (kind, layer) kernel saw flag `source` (passed its
        wait: a wait is one step, see the module docstring)."""
        kernel = 2 * layer + kernel_kind
        base = reader * self.rank_words
        k = w[base]
        if k > kernel:
            return True
        if kernel == k:
            which = 0
        elif kernel == k + 1 and w[base + 5]:
            which = 1
        else:
            return False
        waiters = self.cfg.dispatch_grid if kernel_kind == 0 else self.cwaiters
        for c in range(waiters):
            cb = self.cta_base(reader, which, c)
            if w[cb + 1] <= A_WAIT:
                return False
        return True

    def _normalize(self, w: list, r: int):
        """Ends the rank's kernel when all its CTAs finished, starts the next one (stream order)."""
        base = r * self.rank_words
        while w[base] < self.kernels:
            k = w[base]
            g = self.grid(k)
            if not all(w[self.cta_base(r, 0, c)] == S_DONE and w[self.cta_base(r, 0, c) + 1] == A_DONE
                       for c in range(g)):
                break
            # shift the next kernel (if started early) into the current slot
            lo, hi = base + 6, base + 6 + self.cta_words
            if w[base + 5]:
                w[lo:hi] = w[hi:hi + self.cta_words]
            else:
                w[lo:hi] = [0] * self.cta_words
            w[hi:hi + self.cta_words] = [0] * self.cta_words
            w[base + 5] = 0
            w[base] = k + 1

    # ----------------------------------------------------------------------------------------------------
    def successors(self, state):
        """[(step, next_state or Violation)]: every step enabled in `state` (after the reductions)."""
        return [(step, self._apply(state, step)) for step in self.enabled(state)]

    def enabled(self, state):
        """The steps enabled in `state` (after the reductions), not applied."""
        w, pending = state
        n = self.n
        cfg = self.cfg
        out = []
        reads = set()  # locations with an enabled read
        local = None  # an invisible step, taken alone

        for r in range(n):
            base = r * self.rank_words
            k = w[base]
            if k >= self.kernels:
                continue
            actives = [(0, k)]
            if w[base + 5]:
                actives.append((1, k + 1))
            elif not cfg.stream_order and k % 2 == 1 and k + 1 < self.kernels:
                local = ("start", r)
            for which, kernel in actives:
                layer, kind = divmod(kernel, 2)
                g = self.grid(kernel)
                for c in range(g):
                    cb = self.cta_base(r, which, c)
                    s_pc, a_pc = w[cb], w[cb + 1]
                    # storing thread
                    if kind == 0:
                        if s_pc == 0:
                            local = local or ("issue", r, which, kernel, c)
                        elif s_pc == S_FENCE:
                            out.append(("sfence", r, which, kernel, c))
                    else:
                        rows = self.crows[c]
                        if s_pc < len(rows):
                            for row in rows[s_pc:] if cfg.atomic_reads else rows[s_pc:s_pc + 1]:
                                reads.add((0, r * n * self.t + row))
                            out.append(("cread", r, which, kernel, c))
                        elif s_pc == S_FENCE or (not rows and s_pc == 0):
                            out.append(("sfence", r, which, kernel, c))
                    # arrival thread
                    if a_pc == A_ARRIVE:
                        if s_pc == S_DONE:
                            out.append(("arrive", r, which, kernel, c))
                    elif A_RAISE <= a_pc < A_RAISE + n:
                        out.append(("raise", r, which, kernel, c, a_pc - A_RAISE))
                    elif a_pc == A_WAIT:
                        flags = self.df if kind == 0 else self.cf
                        if all(w[flags + r * n + s] for s in range(n)):
                            out.append(("wait", r, which, kernel, c))
                    elif A_REARM <= a_pc < A_REARM + n:
                        out.append(("rearm", r, which, kernel, c, a_pc - A_REARM))
                    elif A_READ <= a_pc < A_DONE:
                        j = a_pc - (A_LAST if a_pc >= A_LAST else A_READ)
                        last = None if cfg.atomic_reads else j + 1
                        if kind == 0:
                            for row in self.drows[c][j:last]:
                                reads.add((0, r * n * self.t + row))
                            out.append(("copy", r, which, kernel, c))
                        else:
                            for tok in self.ctoks[c][j:last]:
                                for d in range(n):
                                    if cfg.route[layer][r][tok] >> d & 1:
                                        reads.add((1, r * self.t * n + tok * n + d))
                            out.append(("reduce", r, which, kernel, c))

        if local is not None:
            return [local]

        # landing pending stores where it matters
        if pending:
            locs = {}
            for p in pending:
                locs.setdefault(self._location(p), []).append(p)
            done = not out and self.finished(w)
            first = min(pending) if done else None
            for loc, stores in locs.items():
                for p in stores:
                    if len(stores) > 1 or loc in reads or p == first:
                        out.append(("land", p))
        return out

    def describe(self, step) -> str:
        """A step in words (for the schedules of counterexamples)."""
        op = step[0]
        if op == "land":
            (r, kernel, c), kind, rank, index, value = step[1]
            what = ("row", "re-arm of row", "partial into slot")[kind]
            return f"land r{r} cta{c} L{kernel // 2} {what} {index} on r{rank}"
        if op == "start":
            return f"r{step[1]} starts its next dispatch early"
        _, r, _, kernel, c = step[:5]
        words = {
            "issue": "S issues its row stores",
            "sfence": "S fences (its stores land), lane 0 arrives on DONE",
            "cread": "S reads a row's source word, issues partial + re-arm",
            "arrive": "lane 0 arrives on DONE",
            "raise": "lane 0 raises a flag",
            "wait": "lane 0 sees every flag, arrives on SEEN",
            "rearm": "lane 0 re-arms flags",
            "copy": "copies out a receive row",
            "reduce": "reads the partials of a token",
        }[op]
        if op == "raise":
            words = f"lane 0 raises its flag on r{step[5]}"
        elif op == "rearm" and self.cfg.rearm_by_writer:
            words = f"lane 0 re-arms its own flag on r{step[5]}"
        return f"r{r} L{kernel // 2} {'dispatch' if kernel % 2 == 0 else 'combine'} cta{c}: {words}"

    def _apply(self, state, step):
        try:
            return self._step(state, step)
        except Violation as v:
            return Violation(v.kind, f"{self.describe(step)}: {v.message}")

    def _step(self, state, step):
        w0, pending = state
        w = list(w0)
        n, cfg = self.n, self.cfg
        op = step[0]
        if op == "land":
            p = step[1]
            self._land(w, p)
            return (tuple(w), pending - {p})
        if op == "start":
            r = step[1]
            w[r * self.rank_words + 5] = 1
            return (tuple(w), pending)
        _, r, which, kernel, c = step[:5]
        layer, kind = divmod(kernel, 2)
        base = r * self.rank_words
        cb = self.cta_base(r, which, c)
        owner = (r, kernel, c)
        g = self.grid(kernel)
        T = self.t
        if op == "issue":
            new = set()
            if c < T:
                mask = cfg.route[layer][r][c]
                for d in range(n):
                    if mask >> d & 1:
                        new.add((owner, P_ROW, d, r * T + c, layer + 1))
            pending = pending | new
            w[cb] = S_FENCE if self.fenced[kind] else S_DONE
        elif op == "sfence":
            mine = sorted(p for p in pending if p[0] == owner)
            for p in mine:
                self._land(w, p)
            pending = pending - set(mine)
            w[cb] = S_DONE
            op = "arrive"  # the barrier and lane 0's arrival follow at once (they touch only a local counter)
        elif op == "cread":
            rows = self.crows[c]
            while True:
                row = rows[w[cb]]
                value = w[self.rows + r * n * T + row]
                self._check_row(layer, r, row, value)
                if value:
                    s, t = divmod(row, T)
                    pending = pending | {
                        (owner, P_SLOT, s, s * T * n + t * n + r, layer + 1),
                        (owner, P_REARM, r, row, value),
                    }
                w[cb] += 1
                if w[cb] == len(rows):
                    w[cb] = S_FENCE if self.fenced[kind] else S_DONE
                    break
                if not cfg.atomic_reads:
                    break
        if op == "arrive":
            counter = base + (C_TDONE if kind == 0 else C_CDONE)
            w[counter] += 1
            if w[counter] == g:
                w[counter] = 0
                w[cb + 1] = A_RAISE
            else:
                w[cb + 1] = self._after_raise(kind, c)
        elif op == "raise":
            d = w[cb + 1] - A_RAISE
            at = (self.df if kind == 0 else self.cf) + d * n + r
            if w[at]:
                raise Violation(
                    FLAG_RAISED_WHILE_SET,
                    f"layer {layer} raises the {'dispatch' if kind == 0 else 'combine'} flag of r{r} on "
                    f"r{d} still holding layer {w[at] - 1}",
                )
            w[at] = layer + 1
            w[cb + 1] = A_RAISE + d + 1 if d + 1 < n else self._after_raise(kind, c)
        elif op == "wait":
            flags = self.df if kind == 0 else self.cf
            for s in range(n):
                if w[flags + r * n + s] != layer + 1:
                    raise Violation(
                        STALE_FLAG,
                        f"a layer {layer} waiter sees the layer {w[flags + r * n + s] - 1} flag of r{s}",
                    )
            counter = base + (C_DSEEN if kind == 0 else C_CSEEN)
            total = g if kind == 0 else self.cwaiters
            w[counter] += 1
            if w[counter] == total or not cfg.seen_counter:
                w[counter] = 0
                if cfg.rearm_at_end:
                    w[cb + 1] = A_LAST if self._reads(kind, c) else A_REARM
                else:
                    w[cb + 1] = A_REARM
            else:
                w[cb + 1] = self._first_read(kind, c)
        elif op == "rearm":
            flags = self.df if kind == 0 else self.cf
            if cfg.rearm_by_writer:
                # the flag this rank wrote on rank d (one remote store per step)
                d = w[cb + 1] - A_REARM
                self._rearm(w, flags + d * n + r, d, kind, layer, r)
                w[cb + 1] = A_REARM + d + 1 if d + 1 < n else self._after_rearm(kind, c)
            else:
                for s in range(n):
                    self._rearm(w, flags + r * n + s, r, kind, layer, s)
                w[cb + 1] = self._after_rearm(kind, c)
        elif op == "copy":
            rows = self.drows[c]
            while True:
                first = A_LAST if w[cb + 1] >= A_LAST else A_READ
                j = w[cb + 1] - first
                row = rows[j]
                self._check_row(layer, r, row, w[self.rows + r * n * T + row])
                w[cb + 1] = first + j + 1 if j + 1 < len(rows) else A_REARM if first == A_LAST else A_DONE
                if j + 1 == len(rows) or not cfg.atomic_reads:
                    break
        elif op == "reduce":
            toks = self.ctoks[c]
            while True:
                first = A_LAST if w[cb + 1] >= A_LAST else A_READ
                j = w[cb + 1] - first
                tok = toks[j]
                for d in range(n):
                    if cfg.route[layer][r][tok] >> d & 1:
                        at = self.slots + r * T * n + tok * n + d
                        if w[at] // 2 != layer + 1:
                            raise Violation(
                                READ_BEFORE_WRITE,
                                f"the layer {layer} partial of r{d} for token {tok} of r{r} is read before it "
                                f"landed (the slot holds {f'layer {w[at] // 2 - 1}' if w[at] else 'nothing yet'})",
                            )
                        w[at] |= 1
                w[cb + 1] = first + j + 1 if j + 1 < len(toks) else A_REARM if first == A_LAST else A_DONE
                if j + 1 == len(toks) or not cfg.atomic_reads:
                    break
        elif op not in ("issue", "cread"):  # pragma: no cover
            raise AssertionError(op)
        if w[cb] == S_DONE and w[cb + 1] == A_DONE:
            self._normalize(w, r)
        return (tuple(w), pending)

    def _after_raise(self, kind, c):
        if kind == 0 or c < self.cwaiters:
            return A_WAIT
        return A_DONE

    def _reads(self, kind, c):
        return self.drows[c] if kind == 0 else self.ctoks[c]

    def _first_read(self, kind, c):
        return A_READ if self._reads(kind, c) else A_DONE

    def _after_rearm(self, kind, c):
        return A_DONE if self.cfg.rearm_at_end else self._first_read(kind, c)

    def _rearm(self, w, at, reader, kind, layer, source):
        if w[at] and not self._all_seen(w, reader, kind, w[at] - 1, source):
            raise Violation(
                FLAG_REARMED_UNSEEN,
                f"the {'dispatch' if kind == 0 else 'combine'} flag of r{source} on r{reader} "
                f"(layer {w[at] - 1}) is re-armed before every waiter of r{reader} saw it",
            )
        w[at] = 0

    def _check_row(self, layer, d, row, value):
        expected = self.expected_row(layer, d, row)
        if value != expected:
            if expected:
                raise Violation(
                    READ_BEFORE_WRITE,
                    f"row {row} of r{d} is read in layer {layer} before its data landed "
                    f"(holds {'empty' if not value else f'layer {value - 1}'})",
                )
            raise Violation(
                STALE_READ, f"empty row {row} of r{d} still holds layer {value - 1} data in layer {layer}"
            )

    def final_check(self, state):
        """Violation at a finished state with nothing pending (flags and rows back to 0), else None."""
        w, _ = state
        for at in range(self.df, self.slots):
            if w[at]:
                what = "flag" if at < self.rows else "receive row"
                return Violation(NOT_REARMED, f"a {what} (word {at}) is not re-armed at the end")
        return None


def explore(
    config: Config,
    *,
    stop_at: Callable[[Result], bool] | None = None,
    max_states: int | None = None,
    model_class: type = None,
) -> Result:
    """Every reachable state of `config` (depth first, visited set). Stops early when `stop_at(result)` is true
    or after `max_states` states (then `complete` is False). Records the first schedule of each violation.
    `model_class`: a subclass of `Model` to explore instead (the tests weaken checks with it)."""
    model = (model_class or Model)(config)
    result = Result()
    start = time.perf_counter()
    init = model.initial()
    seen = {init}
    path = []  # steps along the current DFS path
    stack = [(init, None)]
    while stack:
        state, it = stack[-1]
        if it is None:
            succ = model.successors(state)
            if not succ:
                if state[1]:  # pragma: no cover (pending stores always have a landing step then)
                    raise AssertionError("stuck with pending stores")
                if model.finished(state[0]):
                    result.finished += 1
                    v = model.final_check(state)
                else:
                    v = Violation(DEADLOCK, "no step is possible and some rank has not finished")
                if v is not None and v.kind not in result.violations:
                    result.violations[v.kind] = (v.message, [model.describe(x) for x in path])
            it = iter(succ)
            stack[-1] = (state, it)
            if stop_at is not None and result.violations and stop_at(result):
                result.complete = False
                break
        nxt = next(it, None)
        if nxt is None:
            stack.pop()
            if path:
                path.pop()
            continue
        label, child = nxt
        result.transitions += 1
        if isinstance(child, Violation):
            if child.kind not in result.violations:
                result.violations[child.kind] = (child.message, [model.describe(x) for x in path + [label]])
            continue
        if child in seen:
            continue
        seen.add(child)
        if max_states is not None and len(seen) > max_states:
            result.complete = False
            break
        stack.append((child, None))
        path.append(label)
    result.states = len(seen)
    result.seconds = time.perf_counter() - start
    return result


def random_runs(config: Config, runs: int, seed: int = 0) -> Result:
    """`runs` random schedules of `config` from the initial state to a finished, deadlocked or violating state;
    `states` counts the steps taken in all."""
    model = Model(config)
    rng = random.Random(seed)
    result = Result(complete=False)
    start = time.perf_counter()
    for _ in range(runs):
        state, path = model.initial(), []
        while True:
            steps = model.enabled(state)
            if not steps:
                v = model.final_check(state) if model.finished(state[0]) else Violation(
                    DEADLOCK, "no step is possible and some rank has not finished")
                if model.finished(state[0]):
                    result.finished += 1
                if v is not None and v.kind not in result.violations:
                    result.violations[v.kind] = (v.message, [model.describe(x) for x in path])
                break
            label = steps[rng.randrange(len(steps))]
            child = model._apply(state, label)
            result.transitions += 1
            path.append(label)
            if isinstance(child, Violation):
                if child.kind not in result.violations:
                    result.violations[child.kind] = (child.message, [model.describe(x) for x in path])
                break
            state = child
            result.states += 1
    result.seconds = time.perf_counter() - start
    return result
