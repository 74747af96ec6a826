"""The warp-specialized ring's barrier protocol (`kernels/grouped_matmul.py` `Ring`), modelled in Python and run
on random schedules (CPU): a producer's threads copy stage `t` into slot `t % stages` once the slot's `empty`
barrier says stage `t - stages` was multiplied, and mark stage `t - lag` on its `full` barrier once their own
copies of it landed; each consumer warp waits `full`, issues its MMAs, and gives a slot back once the MMAs that read
it completed (a warpgroup past the tile's pairs gives each slot back at once), over a CTA's blocks in turn. Checked:
no deadlock, no slot refilled before every MMA that reads it completed, no MMA before its stage landed, and every
parity wait that passes names the phase it waited for (never one two phases on)."""

import random

import pytest

from jax_latent_ep.kernels import grouped_matmul

PRODUCERS = 4  # producer threads modelled (each its own copies and arrival, as the kernel's 128)
WARPS = grouped_matmul.THREADS // 32  # consumer warps: the `empty` barriers' arrivals


class _Barrier:
    """An mbarrier: `expected` arrivals complete a phase; a parity wait passes once the phase of that parity
    completed, i.e. while the current phase's parity differs."""

    def __init__(self, expected):
        self.expected, self.count, self.phase = expected, 0, 0

    def arrive(self):
        self.count += 1
        assert self.count <= self.expected
        if self.count == self.expected:
            self.count, self.phase = 0, self.phase + 1

    def passed(self, parity, phase):
        """The kernel's `mbarrier_wait(bar, parity)` for `phase` (parity `phase % 2`): passes, and then `phase`
        must be complete and the barrier not two phases on (where parity would lie)."""
        if self.phase % 2 == parity:
            return False
        assert phase + 1 <= self.phase <= phase + 2, f"a wait for phase {phase} passed at phase {self.phase}"
        return True


def _run(stages, lag, blocks, seed):
    """One random schedule of a CTA's `blocks` (steps, warpgroup 0 live, warpgroup 1 live) in turn."""
    rng = random.Random(seed)
    full = [_Barrier(PRODUCERS) for _ in range(stages)]
    empty = [_Barrier(WARPS) for _ in range(stages)]
    slot, landed, done, readers = [None] * stages, {}, {}, {}
    total = sum(b[0] for b in blocks)

    def producer(p):
        for t in range(total):
            if t >= stages:  # `wait_free`
                while not empty[t % stages].passed((t // stages + 1) % 2, t // stages - 1):
                    yield
                assert all(done[(w, t - stages)] for w in readers.get(t - stages, ())), f"slot of {t} refilled early"
            slot[t % stages] = t
            landed[(p, t)] = False
            yield
            if t >= lag:  # `mark_landed`: this thread's copies of t - lag completed, then its arrival
                while not landed[(p, t - lag)]:
                    yield
                full[(t - lag) % stages].arrive()
        for u in range(max(0, total - lag), total):  # `mark_all_landed`
            while not landed[(p, u)]:
                yield
            full[u % stages].arrive()

    def consumer(w):
        t0 = 0
        for steps, *live in blocks:
            issued = []
            for s in range(steps):
                t = t0 + s
                while not full[t % stages].passed((t // stages) % 2, t // stages):
                    yield
                if live[w * 32 // 128]:  # `multiply`: the MMAs, then `wgmma_wait(1)`; `release` of t - 1
                    assert slot[t % stages] == t and all(landed[(p, t)] for p in range(PRODUCERS)), f"{t} read early"
                    readers.setdefault(t, set()).add(w)
                    done[(w, t)] = False
                    issued.append(t)
                    yield
                    while not all(done[(w, u)] for u in issued[:-1]):
                        yield
                    if s >= 1:
                        empty[(t - 1) % stages].arrive()
                else:
                    empty[t % stages].arrive()
            if issued:  # `wgmma_wait(0)`, then the block's last stage given back
                while not all(done[(w, u)] for u in issued):
                    yield
                empty[(t0 + steps - 1) % stages].arrive()
            t0 += steps
            yield  # the block's stores

    actors = [producer(p) for p in range(PRODUCERS)] + [consumer(w) for w in range(WARPS)]
    alive, idle, last = list(range(len(actors))), 0, None
    while alive:
        state = (tuple((b.phase, b.count) for b in full + empty), tuple(landed.values()), tuple(done.values()),
                 len(alive))
        idle = idle + 1 if state == last else 0
        last = state
        assert idle < 20000, f"deadlock: full {[b.phase for b in full]}, empty {[b.phase for b in empty]}"
        for events in (landed, done):  # copies land and MMAs complete in any order, at any time
            for key in [k for k, v in events.items() if not v and rng.random() < 0.3]:
                events[key] = True
        i = rng.choice(alive)
        try:
            next(actors[i])
        except StopIteration:
            alive.remove(i)


@pytest.mark.parametrize("stages, lag", [(grouped_matmul.FORWARD_STAGES, grouped_matmul.FORWARD_LAG),
                                         (grouped_matmul.WGRAD_STAGES, grouped_matmul.WGRAD_LAG), (6, 3), (6, 4)])
def test_ring_protocol_on_random_schedules(stages, lag):
    """60 random schedules of 1-4 blocks of 0-17 stages each (warpgroup 1 past the pairs in some)."""
    rng = random.Random(stages * 10 + lag)
    for trial in range(60):
        blocks = [(rng.choice([0, 1, 2, 3, 5, 9, 17]), True, rng.random() < 0.7) for _ in range(rng.randint(1, 4))]
        _run(stages, lag, blocks, seed=trial)


def test_ring_protocol_model_finds_a_deadlock():
    """The model can fail: with `lag = stages - 1` the producer waits for a slot the consumers free only after a
    stage it has not yet marked (what `Ring` refuses to build)."""
    with pytest.raises(AssertionError, match="deadlock"):
        _run(3, 2, [(9, True, True)], seed=0)
    with pytest.raises(ValueError, match="lag=2"):
        grouped_matmul.GroupedMatmulWgrad(stages=3, lag=2)
