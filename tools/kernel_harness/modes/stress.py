"""`--mode stress`: many consecutive layers with random input sets, T, apply_norm, launch order and host-side
hold-backs, launched in batches into their own output slots and checked batch by batch against expectations
computed once per input set."""

from __future__ import annotations

import itertools
import time
from typing import NamedTuple

import numpy as np

from jax_latent_ep.layout import CTRL_ERROR, CTRL_LAYER, EpLayout
from tools.kernel_harness.expected import (
    BF16, Rows, expected_receive, expected_result, host_expert, mxfp8_bytes, receive_mismatches, result_mismatches,
)
from tools.kernel_harness.inputs import make_routing, make_tokens
from tools.kernel_harness.runtime import DeviceArray, System, check, host_status

#: Largest number of input-set combinations a stress layer may draw from (one expert-output array each): beyond
#: it, every rank of a layer reads the same set index.
STRESS_MAX_COMBOS = 64


def make_pool_routing(rng, tokens, shape, ranks, one_rank_fraction):
    """`make_routing`, then about `one_rank_fraction` of the tokens re-routed to K distinct experts of one random
    rank (such a token leaves its receive row empty on every other rank)."""
    ids, weights = make_routing(rng, tokens, shape)
    local = shape.num_local_experts(ranks)
    if ranks > 1 and local >= shape.topk:
        for t in np.nonzero(rng.random(tokens) < one_rank_fraction)[0]:
            ids[t] = int(rng.integers(ranks)) * local + rng.choice(local, size=shape.topk, replace=False)
    return ids, weights


class StressPool:
    """Host side of the stress run: `pool` input sets per rank (`max_tokens` tokens each, from run_layers'
    generators: every 4th set with a NaN and an Inf block, every 4th with subnormal and zero blocks, every 2nd
    with half its tokens routed to one rank only), the set combinations a layer draws from (`combos` [C, N]:
    rank s reads set `combos[c, s]`) and every expected output, computed once with run_layers' model code.

    A layer's expectations split into per-source blocks: rank d's receive rows from source s (rows s * S ..
    s * S + S - 1) depend only on s's (set, T), and rank s's combine output only on its own (set, apply_norm)
    (token t's routed latent does not depend on T). So they are computed once per set for T = max_tokens and
    cut to each layer's T (rows t >= T empty, result rows t >= T not compared): T is free in 1..max_tokens and
    nothing is cached per layer. Rank d's expert output (the combine's `out` input) mixes the sources' sets:
    one array per combo, garbage (NaN or 1e30, alternating by row) in its empty rows."""

    def __init__(self, rng, shape, lay: EpLayout, pool, norm, max_combos=STRESS_MAX_COMBOS):
        n, tmax, S = lay.ranks, lay.tokens, lay.stride
        latent, topk = shape.latent, shape.topk
        local = shape.num_local_experts(n)
        self.shape, self.layout, self.pool, self.norm = shape, lay, pool, norm
        self.x = np.empty((n, pool, tmax, latent), BF16)
        self.ids = np.empty((n, pool, tmax, topk), np.int32)
        self.weights = np.empty((n, pool, tmax, topk), np.float32)
        for s in range(n):
            for p in range(pool):
                special = "nonfinite" if p % 4 == 3 else p % 4 == 0
                self.x[s, p] = make_tokens(rng, tmax, shape, special)
                self.ids[s, p], self.weights[s, p] = make_pool_routing(rng, tmax, shape, n, 0.5 if p % 2 else 0.0)
        if pool**n <= max_combos:
            combos = list(itertools.product(range(pool), repeat=n))
        else:
            combos = [(p,) * n for p in range(pool)]
        self.combos = np.array(combos, np.int64).reshape(-1, n)
        # [destination d, source s, set p, S]: the receive rows from s on d for T = max_tokens.
        self.rx = np.zeros((n, n, pool, S, latent), np.uint8)
        self.rsf = np.zeros((n, n, pool, S, shape.num_sf), np.uint8)
        self.rids = np.zeros((n, n, pool, S, topk), np.int32)
        self.rw = np.zeros((n, n, pool, S, topk), np.uint32)
        self.rsrc = np.zeros((n, n, pool, S), np.int32)
        self.hit = np.zeros((n, n, pool, S), bool)
        self.outs = np.empty((pool, n, lay.rows, latent), BF16)  # [set p of every source, d]: expert outputs
        self.result = np.empty((n, pool, 2, tmax, latent), np.uint16)  # [s, p, apply_norm]: combine outputs
        garbage = np.array([np.nan, 1e30], np.float32).astype(BF16)
        for p in range(pool):
            state = [(tmax, self.x[s, p], self.ids[s, p], self.weights[s, p]) for s in range(n)]
            quant = [mxfp8_bytes(self.x[s, p]) for s in range(n)]
            for d in range(n):
                exp, valid = expected_receive(lay, d, state, quant)
                self.rx[d, :, p] = exp.x.reshape(n, S, latent)
                self.rsf[d, :, p] = exp.sf.reshape(n, S, shape.num_sf)
                self.rids[d, :, p] = exp.ids.reshape(n, S, topk)
                self.rw[d, :, p] = exp.weights.reshape(n, S, topk)
                self.rsrc[d, :, p] = exp.src.reshape(n, S)
                self.hit[d, :, p] = valid.reshape(n, S)
                self.outs[p, d] = host_expert(exp, valid, d, local, garbage[(np.arange(lay.rows) + p + d) % 2])
            for s in range(n):
                for apply_norm in (0, 1):
                    self.result[s, p, apply_norm] = expected_result(
                        self.outs[p], self.ids[s, p] // local, s, S, tmax, norm, apply_norm)

    def combo_outs(self, d):
        """bf16 [C, R, L]: rank d's expert outputs for every combo (rows of source s from set `combos[c, s]`)."""
        n, S = self.layout.ranks, self.layout.stride
        blocks = self.outs.reshape(self.pool, n, n, S, -1)[self.combos, d, np.arange(n)[None, :]]  # [C, N, S, L]
        return np.ascontiguousarray(blocks.reshape(len(self.combos), self.layout.rows, -1))

    def receive(self, d, combo, tokens):
        """Rank d's expected receive rows after layers of combos `combo` [B] and token counts `tokens` [B, N]:
        `(Rows [B, R, ...], valid [B, R])`."""
        lay = self.layout
        n, S = lay.ranks, lay.stride
        sets = self.combos[combo]  # [B, N]
        src = np.arange(n)[None, :]
        valid = self.hit[d][src, sets] & (np.arange(S) < np.asarray(tokens)[:, :, None])  # [B, N, S]
        rows = Rows(
            self.rx[d][src, sets],
            self.rsf[d][src, sets],
            np.where(valid[..., None], self.rids[d][src, sets], np.int32(lay.invalid_expert(d))),
            np.where(valid[..., None], self.rw[d][src, sets], np.uint32(0)),
            np.where(valid, self.rsrc[d][src, sets], np.int32(-1)),
        )
        batch = len(combo)
        return Rows(*(a.reshape(batch, lay.rows, *a.shape[3:]) for a in rows)), valid.reshape(batch, lay.rows)

    def combined(self, s, combo, apply_norm, tokens):
        """Rank s's expected combine outputs (BF16 bits [B, max_tokens, L]) after layers of combos `combo` [B],
        `apply_norm` [B] and its token counts `tokens` [B], and the rows to compare (bool [B, max_tokens])."""
        exp = self.result[s, self.combos[combo, s], np.asarray(apply_norm)]
        return exp, np.arange(self.layout.tokens) < np.asarray(tokens)[:, None]


class Schedule(NamedTuple):
    """The random choices of the stress layers, one row per layer."""

    combo: np.ndarray  # [layers]: a row of StressPool.combos (rank s reads set combos[c, s])
    tokens: np.ndarray  # [layers, N]: T of every rank, 1..max_tokens
    apply_norm: np.ndarray  # [layers]: 0 routed, 1 normed (every rank)
    delayed: np.ndarray  # [layers]: the rank whose launches are held back, -1 for none
    delay_ns: np.ndarray  # [layers]: how long (0 where none)
    delay_combine: np.ndarray  # [layers]: 1: the delay comes between its dispatch and its combine; 0: before both
    order: np.ndarray  # [layers, N]: launch order of the ranks, the delayed one last


def stress_schedule(rng, layers, ranks, combos, max_tokens, delay_prob=0.5, max_delay_us=200.0):
    """Draws a `Schedule`: uniform combos and apply_norm; T uniform in 1..max_tokens, a quarter of the draws
    forced to 1 or max_tokens; with probability `delay_prob` a layer holds one random rank back by 0 ..
    `max_delay_us` microseconds, that rank launching after the others."""
    combo = rng.integers(combos, size=layers)
    tokens = rng.integers(1, max_tokens + 1, size=(layers, ranks))
    edge = rng.random((layers, ranks)) < 0.25
    tokens = np.where(edge, np.where(rng.random((layers, ranks)) < 0.5, 1, max_tokens), tokens)
    apply_norm = rng.integers(2, size=layers)
    delay = (rng.random(layers) < delay_prob) & (max_delay_us > 0)
    delayed = np.where(delay, rng.integers(ranks, size=layers), -1)
    delay_ns = np.where(delay, rng.integers(0, int(max_delay_us * 1000) + 1, size=layers), 0)
    delay_combine = np.where(delay, rng.integers(2, size=layers), 0)
    order = rng.permuted(np.tile(np.arange(ranks), (layers, 1)), axis=1)
    last = np.argsort(order == delayed[:, None], axis=1, kind="stable")  # the delayed rank moves to the end
    order = np.take_along_axis(order, last, axis=1)
    return Schedule(combo, tokens, apply_norm, delayed, delay_ns, delay_combine, order)


class StressBuffers:
    """Device side of the stress run, per rank: its input sets and the expert outputs of every combo (uploaded
    once), and `batch` slots of every output (each layer of a batch writes its own slot)."""

    INPUTS = ("x", "ids", "weights", "out")
    OUTPUTS = ("recv_x", "recv_sf", "recv_ids", "recv_weights", "recv_src", "result")

    def __init__(self, system: System, pool: StressPool, batch):
        cu, lay, shape = system.cu, system.layout, system.shape
        tmax, rows, latent, topk = lay.tokens, lay.rows, shape.latent, shape.topk
        self.batch = batch
        # Bytes of one input set / combo / output slot.
        self.sizes = {
            "x": tmax * latent * 2, "ids": tmax * topk * 4, "weights": tmax * topk * 4, "out": rows * latent * 2,
            "recv_x": rows * latent, "recv_sf": rows * shape.num_sf, "recv_ids": rows * topk * 4,
            "recv_weights": rows * topk * 4, "recv_src": rows * 4, "result": tmax * latent * 2,
        }
        self.arrays = []
        for d, r in enumerate(system.ranks):
            check(cu.cuCtxSetCurrent(r.ctx))
            arrays = {}
            for name, host in zip(self.INPUTS, (pool.x[d], pool.ids[d], pool.weights[d], pool.combo_outs(d))):
                assert host.nbytes == len(host) * self.sizes[name], (name, host.shape)
                arrays[name] = DeviceArray(host.nbytes)
                arrays[name].upload(host)
            for name in self.OUTPUTS:
                arrays[name] = DeviceArray(batch * self.sizes[name])
            r.norm.upload(pool.norm)
            self.arrays.append(arrays)
        for r in system.ranks:  # a pageable upload may return before its DMA lands: settle before any launch
            check(cu.cuCtxSetCurrent(r.ctx))
            check(cu.cuCtxSynchronize())

    def ptr(self, rank, name, index):
        """Device address of input set / combo / output slot `index` of array `name` of `rank`."""
        return self.arrays[rank][name].ptr + index * self.sizes[name]

    def download(self, system: System, rank, count):
        """`(Rows [count, R, ...], result bits [count, max_tokens, L])` of the first `count` slots of `rank`."""
        lay, shape = system.layout, system.shape
        check(system.cu.cuCtxSetCurrent(system.ranks[rank].ctx))
        a = self.arrays[rank]
        got = Rows(
            a["recv_x"].download(np.uint8, (count, lay.rows, shape.latent)),
            a["recv_sf"].download(np.uint8, (count, lay.rows, shape.num_sf)),
            a["recv_ids"].download(np.int32, (count, lay.rows, shape.topk)),
            a["recv_weights"].download(np.uint32, (count, lay.rows, shape.topk)),
            a["recv_src"].download(np.int32, (count, lay.rows)),
        )
        return got, a["result"].download(np.uint16, (count, lay.tokens, shape.latent))


def _spin(ns):
    """Busy-waits `ns` nanoseconds on the host (sleeps are far too coarse for microseconds)."""
    end = time.perf_counter_ns() + ns
    while time.perf_counter_ns() < end:
        pass


def _launch_stress_layer(system: System, bufs: StressBuffers, sets, combo, slot, tokens, apply_norm, delayed,
                         delay_ns, delay_combine, order):
    """Launches one stress layer (dispatch + combine of every rank, in `order`) into output slot `slot`,
    busy-waiting `delay_ns` before rank `delayed`'s dispatch (or, if `delay_combine`, its combine)."""
    peer_tokens = int(max(tokens))
    for s in order:
        r = system.ranks[s]
        if s == delayed and not delay_combine:
            _spin(delay_ns)
        system.launch_dispatch(
            r, tokens[s], peer_tokens=peer_tokens, x=bufs.ptr(s, "x", sets[s]), ids=bufs.ptr(s, "ids", sets[s]),
            weights=bufs.ptr(s, "weights", sets[s]), recv_x=bufs.ptr(s, "recv_x", slot),
            recv_sf=bufs.ptr(s, "recv_sf", slot), recv_ids=bufs.ptr(s, "recv_ids", slot),
            recv_weights=bufs.ptr(s, "recv_weights", slot), recv_src=bufs.ptr(s, "recv_src", slot),
        )
        if s == delayed and delay_combine:
            _spin(delay_ns)
        system.launch_combine(
            r, tokens[s], apply_norm, peer_tokens=peer_tokens, out=bufs.ptr(s, "out", combo),
            ids=bufs.ptr(s, "ids", sets[s]), result=bufs.ptr(s, "result", slot),
        )


def _check_stress_batch(system: System, bufs: StressBuffers, pool: StressPool, sched: Schedule, start, count):
    """Compares the `count` layers of a batch from layer `start` with the pool's expectations: `(receive
    mismatches [count, N], combine mismatches [count, N], normed elements at 1 ulp)`."""
    n = system.n
    part = slice(start, start + count)
    combo, tokens, apply_norm = sched.combo[part], sched.tokens[part], sched.apply_norm[part]
    bad_receive = np.zeros((count, n), np.int64)
    bad_combine = np.zeros((count, n), np.int64)
    ulp1 = 0
    for d in range(n):
        got, result = bufs.download(system, d, count)
        exp, valid = pool.receive(d, combo, tokens)
        bad_receive[:, d] = receive_mismatches(got, exp, valid)
        exp_result, rows = pool.combined(d, combo, apply_norm, tokens[:, d])
        bad, one = result_mismatches(result, exp_result, apply_norm, rows)
        bad_combine[:, d] = bad
        ulp1 += int(one.sum())
    return bad_receive, bad_combine, ulp1


def _describe_stress_layer(pool: StressPool, sched: Schedule, layer):
    """The choices of one layer, for a mismatch report."""
    text = (f"T {sched.tokens[layer].tolist()}, sets {pool.combos[sched.combo[layer]].tolist()}, "
            f"norm {int(sched.apply_norm[layer])}, order {sched.order[layer].tolist()}")
    if sched.delayed[layer] >= 0:
        where = "combine" if sched.delay_combine[layer] else "dispatch"
        text += f", rank {int(sched.delayed[layer])} delayed {sched.delay_ns[layer] / 1000:.0f} us before its {where}"
    return text


def stress(system: System, layers, seed=0, pool_size=8, batch=64, delay_prob=0.5, max_delay_us=200.0,
           log_every=10_000, max_details=20):
    """Runs `layers` consecutive dispatch + combine layers with random choices (`stress_schedule`) on input sets
    uploaded once (`StressPool`, `StressBuffers`): `batch` layers are launched back to back, each into its own
    output slots, then the ranks are synchronized once and the batch is compared (run_layers' rules: receive rows
    and routed bit-exact, normed within 1 ulp). A layer may hold one rank's launches back by a host busy-wait.
    Stops early after `max_details` mismatching (layer, rank) reports or on a CUDA error (a kernel trap: the
    host status record says which rank, peer and layer). Returns `(layers, mismatches, info)`."""
    started = time.perf_counter()
    cu, n = system.cu, system.n
    rng = np.random.default_rng(seed)
    norm = (1.0 + 0.25 * rng.standard_normal(system.shape.latent)).astype(BF16)
    pool = StressPool(rng, system.shape, system.layout, pool_size, norm)
    sched = stress_schedule(rng, layers, n, len(pool.combos), system.max_tokens, delay_prob, max_delay_us)
    bufs = StressBuffers(system, pool, batch)
    record = None
    if system.status == 0:
        try:
            system.status, record = host_status(cu)
        except RuntimeError as error:
            print(f"  note: no host status record ({error}): a trap will not say which rank / peer / layer")
    epochs = [int(r.ctrl_words()[CTRL_LAYER]) for r in system.ranks]  # layers completed before this run
    info = {"details": [], "ulp1": 0, "delayed": 0, "error": None, "status": None, "ctrl": [],
            "combos": len(pool.combos), "setup_s": time.perf_counter() - started}
    print(f"  stress setup: {pool_size} input sets per rank, {len(pool.combos)} combos, batches of {batch}, "
          f"{info['setup_s']:.1f} s", flush=True)
    mismatches, done, logged = 0, 0, 0
    started = time.perf_counter()
    try:
        for start in range(0, layers, batch):
            count = min(batch, layers - start)
            part = slice(start, start + count)
            sets = pool.combos[sched.combo[part]].tolist()
            rows = zip(sets, sched.combo[part].tolist(), sched.tokens[part].tolist(), sched.apply_norm[part].tolist(),
                       sched.delayed[part].tolist(), sched.delay_ns[part].tolist(), sched.delay_combine[part].tolist(),
                       sched.order[part].tolist())
            for slot, row in enumerate(rows):
                _launch_stress_layer(system, bufs, row[0], row[1], slot, *row[2:])
            system.sync()
            bad_receive, bad_combine, ulp1 = _check_stress_batch(system, bufs, pool, sched, start, count)
            done = start + count
            info["ulp1"] += ulp1
            mismatches += int(bad_receive.sum() + bad_combine.sum())
            for i, d in zip(*np.nonzero(bad_receive + bad_combine)):
                info["details"].append(
                    f"layer {start + i} rank {d}: {bad_receive[i, d]} receive, {bad_combine[i, d]} combine mismatches "
                    f"({_describe_stress_layer(pool, sched, start + i)})")
            if log_every and done // log_every > logged:
                logged = done // log_every
                rate = done / (time.perf_counter() - started)
                print(f"  layer {done}/{layers}: mismatches {mismatches}, 1-ulp normed {info['ulp1']}, delayed "
                      f"{int((sched.delayed[:done] >= 0).sum())} ({rate:.0f} layers/s)", flush=True)
            if len(info["details"]) > max_details:
                break
    except RuntimeError as error:  # a CUDA error: the kernels trapped (timeout, sequence error) or a launch failed
        info["error"] = f"in the batch of layers {start}..{start + count - 1}: {error}"
        if record is not None:
            info["status"] = list(record)
    info["seconds"] = time.perf_counter() - started
    info["delayed"] = int((sched.delayed[:done] >= 0).sum())
    if info["error"] is None:
        for r in system.ranks:
            words = r.ctrl_words()
            info["ctrl"].append(words.tolist())
            if words[CTRL_ERROR]:
                info["details"].append(f"rank {r.rank} ctrl error words {words.tolist()}")
                mismatches += 1
            if words[CTRL_LAYER] != epochs[r.rank] + done:
                info["details"].append(f"rank {r.rank} completed {words[CTRL_LAYER] - epochs[r.rank]} layers, "
                                       f"expected {done}")
                mismatches += 1
    return done, mismatches, info
