"""Device-side pieces shared by the dispatch and combine kernels: buffer offsets on run-time integers, the
arrival counters and the single-reader flag protocol (raise, wait with a timeout, re-arm).

The protocol (the seed's, with every dispatch CTA waiting):
  * every thread that stored (locally or remotely) fences at system scope, then the CTA barrier, then warp 0's
    lane 0 counts the CTA's arrival on a local counter (`last_arrival`); a CTA that stored nothing (it may
    have read: its reads were consumed before the barrier) skips the fence;
  * the last arrival raises this rank's flag on every rank (`raise_flags`: lane d stores to rank d, in
    parallel, through the base it loaded at the kernel's start, `load_peer_table`; this rank's own flag
    through its local mapping `peers[N]`);
  * waiters poll their N flags with one lane each, all in flight (`wait_flags`), then fence;
  * a second counter of waiters (`arrive_seen`: a release `atom.inc` whose result is only used at the end of
    the kernel, `finish_seen`) lets the last waiter re-arm the flags (`rearm_flags`): a flag has one reader
    (its rank) and the next layer's writer cannot raise it before the re-arm (see the seed); the re-arm still
    happens inside the kernel, before the next kernel of the stream can start.
No JAX here.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from jax_latent_ep import layout as lay
from jax_latent_ep.config import LatentMoEShape
from jax_latent_ep.kernels.memory import (
    atomic_add_acq_rel_gpu,
    atomic_inc_release_gpu,
    fence_acq_rel_gpu,
    red_add_relaxed_gpu,
    shfl_idx_u64,
    fence_acq_rel_sys,
    fence_sc_sys,
    globaltimer,
    load_b32,
    load_relaxed_sys,
    load_u64,
    shfl_idx,
    store_b32,
    store_relaxed_sys,
    trap,
    warp_or,
)

LINE = lay.LINE


class DeviceLayout:
    """Byte offsets of a rank's buffer as DSL `Int64` values, from `layout.region_offsets` evaluated on the
    run-time `max_tokens` (the host sizes the buffer with the same function)."""

    def __init__(self, max_tokens, ranks: int, shape: LatentMoEShape):
        tokens = Int64(max_tokens)
        self.stride = (tokens + (lay.ROW_BLOCK - 1)) // lay.ROW_BLOCK * lay.ROW_BLOCK  # = layout.stride
        regions = lay.region_offsets(self.stride, tokens, ranks, shape)
        self.rows = self.stride * ranks
        self.x = regions["x"][0]
        self.sf = regions["sf"][0]
        self.ids = regions["ids"][0]
        self.weights = regions["weights"][0]
        self.src = regions["src"][0]
        self.comb = regions["comb"][0]
        self.ctrl = regions["ctrl"][0]
        self.dflag = self.ctrl + LINE
        self.cflag = self.ctrl + LINE + lay.NUM_MAX_RANKS * LINE
        # Row pitches (compile-time).
        self.x_pitch = shape.latent
        self.sf_pitch = (shape.num_sf + 15) // 16 * 16
        self.meta_pitch = (shape.topk + 3) // 4 * 4 * 4

    def word(self, index: int):
        """Byte offset of control word `index` (CTRL_*)."""
        return self.ctrl + 4 * index


@cute.jit
def peer_base(peers: Int64, target: Int32) -> Int64:
    """`peers[target]` (8-byte load from the device peer table)."""
    return load_u64(peers + Int64(target) * 8)


@cute.jit
def last_arrival(counter: Int64, total: Int32, lane: Int32) -> Uint32:
    """Warp-wide (all 32 lanes call it): nonzero on every lane iff this CTA is the `total`-th arrival on
    `counter`. Lane 0 adds 1 (acq_rel, gpu scope: every arriving CTA is on this GPU); the last arrival resets
    the counter to 0 for the next launch and every lane of its warp fences at system scope, so what the warp
    does next (raise flags) is ordered after every counted CTA's stores.

    The caller guarantees that every thread of the CTA whose stores the arrival publishes has fenced at
    system scope and passed a CTA barrier before this call (so lane 0 needs no fence of its own)."""
    last = Uint32(0)
    if lane == 0:
        old = atomic_add_acq_rel_gpu(counter, Uint32(1))
        if old == Uint32(total - 1):
            store_b32(counter, Uint32(0))
            last = Uint32(1)
    last = shfl_idx(last, Uint32(0))
    if last != Uint32(0):
        fence_acq_rel_sys()
    return last


@cute.jit
def load_peer_table(peers: Int64, rank: Int32, lane: Int32, ranks: cutlass.Constexpr[int]) -> Int64:
    """Warp-wide: lane d < N gets the base of rank d's buffer as this rank reaches it: `peers[d]`, or for
    d == rank the local mapping `peers[N]` (one load per lane, all in flight together); other lanes get 0.
    `peer_of(table, d)` then hands any lane the base of rank d with a shuffle instead of a dependent load."""
    base = Int64(0)
    if lane < ranks:
        target = lane
        if lane == rank:
            target = Int32(ranks)
        base = load_u64(peers + Int64(target) * 8)
    return base


@cute.jit
def peer_of(table: Int64, target: Int32) -> Int64:
    """The base of rank `target`'s buffer (its local mapping for this rank) from `load_peer_table`'s per-lane
    table: a warp shuffle (every lane of the warp must call it, converged)."""
    return shfl_idx_u64(table, Uint32(target))


@cute.jit
def raise_flags(table: Int64, flag_offset: Int64, rank: Int32, lane: Int32, ranks: cutlass.Constexpr[int]):
    """Lane d < N sets this rank's flag (line `rank`) on rank d with a relaxed system-scope store, all lanes in
    parallel; the caller fenced (`last_arrival`). `table` is the lane's `load_peer_table` entry (rank d's base,
    this rank's own through its local mapping), loaded at the kernel's start: no load on this path."""
    if lane < ranks:
        store_relaxed_sys(table + flag_offset + Int64(rank) * LINE, Uint32(1))


@cute.jit
def arrive_seen(counter: Int64, total: Int32, lane: Int32) -> Uint32:
    """Warp-wide: lane 0 counts this CTA's arrival on a SEEN counter with a release `atom.inc` (it orders the
    CTA's flag polls before it; the `total`-th arrival wraps the counter back to 0) and returns the old value
    (0 on other lanes) WITHOUT waiting for it: the caller hands it to `finish_seen` at the end of the kernel, so
    the atomic's round trip overlaps the copy-out / reduce."""
    old = Uint32(0)
    if lane == 0:
        old = atomic_inc_release_gpu(counter, Uint32(total - 1))
    return old


@cute.jit
def finish_seen(
    old: Uint32,
    total: Int32,
    local: Int64,
    flag_offset: Int64,
    lane: Int32,
    ranks: cutlass.Constexpr[int],
    ctrl: Int64,
    bump_layer: cutlass.Constexpr[bool],
):
    """Warp-wide, with `arrive_seen`'s value: the `total`-th arrival (its atomic already reset the counter)
    acquires (GPU scope: every waiter of this rank is on this GPU) so that its stores follow every waiter's
    polls, re-arms this rank's N flags (single reader) and, if `bump_layer`, adds 1 to ctrl[CTRL_LAYER] (a `red`:
    nothing waits for it)."""
    last = Uint32(0)
    if lane == 0:
        if old == Uint32(total - 1):
            last = Uint32(1)
    last = shfl_idx(last, Uint32(0))
    if last != Uint32(0):
        fence_acq_rel_gpu()
        if lane == 0:
            if bump_layer:
                red_add_relaxed_gpu(ctrl + 4 * lay.CTRL_LAYER, Uint32(1))
        rearm_flags(local, flag_offset, lane, ranks)


@cute.jit
def rearm_flags(local: Int64, flag_offset: Int64, lane: Int32, ranks: cutlass.Constexpr[int]):
    """Lane s < N re-arms flag s of this rank's own buffer to 0 (single reader: only this rank does)."""
    if lane < ranks:
        store_b32(local + flag_offset + Int64(lane) * LINE, Uint32(0))


@cute.jit
def wait_flags(
    local: Int64,
    flag_offset: Int64,
    lane: Int32,
    ranks: cutlass.Constexpr[int],
    timeout_ns: Int64,
    status: Int64,
    ctrl: Int64,
    rank: Int32,
    code: cutlass.Constexpr[int],
    layer_bias: cutlass.Constexpr[int],
):
    """Warp-wide: lane s < N polls flag s of this rank's buffer (relaxed, system scope; all lanes in flight
    together) until every flag is set, then every lane fences (acquire). If `timeout_ns != 0` and the wait
    outlives it (`%globaltimer`, read every 32 polls), lane 0 writes `ctrl[CTRL_ERROR, CTRL_ERROR_PEER, CTRL_ERROR_LAYER]` and, if
    `status != 0`, the host record `{code, rank, peer, layer}` (peer = the lowest rank whose flag is missing,
    layer = `ctrl[CTRL_LAYER] + layer_bias`), fences, and the warp traps."""
    pending = Uint32(0)
    if lane < ranks:
        pending = Uint32(1)
    start = globaltimer()
    polls = Uint32(0)
    while warp_or(pending) != Uint32(0):
        if pending != Uint32(0):
            if load_relaxed_sys(local + flag_offset + Int64(lane) * LINE) != Uint32(0):
                pending = Uint32(0)
        polls = polls + Uint32(1)
        # The timer (and the two reductions of the check) only every 32 polls: a shorter poll period.
        if timeout_ns != Int64(0) and (polls & Uint32(31)) == Uint32(0):
            late = Uint32(0)
            if globaltimer() - start > timeout_ns:
                late = Uint32(1)
            late = warp_or(late)
            missing = warp_or(pending << Uint32(lane))
            if late != Uint32(0) and missing != Uint32(0):
                if lane == 0:
                    peer = Int32(0)
                    while (missing >> Uint32(peer)) & Uint32(1) == Uint32(0):
                        peer += 1
                    layer = load_b32(ctrl + 4 * lay.CTRL_LAYER) + Uint32(layer_bias)
                    store_b32(ctrl + 4 * lay.CTRL_ERROR, Uint32(code))
                    store_b32(ctrl + 4 * lay.CTRL_ERROR_PEER, Uint32(peer))
                    store_b32(ctrl + 4 * lay.CTRL_ERROR_LAYER, layer)
                    if status != Int64(0):
                        store_relaxed_sys(status + 4, Uint32(rank))
                        store_relaxed_sys(status + 8, Uint32(peer))
                        store_relaxed_sys(status + 12, layer)
                        fence_sc_sys()
                        store_relaxed_sys(status, Uint32(code))
                    fence_sc_sys()
                trap()
    fence_acq_rel_sys()


def compile_cubin(launch, fake_args, arch: str):
    """`cute.compile(launch, *fake_args)` for `arch`; returns `(symbol, cubin bytes)` of its one kernel.

    The DSL dumps the cubin into its dump directory (default: the working directory, so compiling happens
    inside a private temporary one) and hands back its bytes (or its path); nothing is left behind."""
    import os
    import tempfile

    # The dump directory defaults to the working directory: point it at a private one while compiling.
    from cutlass.cutlass_dsl import CuTeDSL

    envar = CuTeDSL._get_dsl().envar
    saved = envar.dump_dir
    with tempfile.TemporaryDirectory(prefix="jax_latent_ep_cute_") as scratch:
        envar.dump_dir = scratch
        try:
            compiled = cute.compile(launch, *fake_args, options=f"--gpu-arch {arch} --keep-cubin")
            return _read_cubin(compiled, arch)
        finally:
            envar.dump_dir = saved


def _read_cubin(compiled, arch):
    import os

    names = list(compiled.kernel_info)
    if len(names) != 1:
        raise RuntimeError(f"expected one kernel symbol, got {names}")
    cubin = compiled.artifacts.CUBIN
    path = None
    if isinstance(cubin, str):
        path = cubin
        with open(cubin, "rb") as f:
            cubin = f.read()
    if path and os.path.exists(path):
        os.remove(path)
    if not isinstance(cubin, (bytes, bytearray)) or cubin[:4] != b"\x7fELF":
        raise RuntimeError("the DSL did not produce an ELF cubin")
    return names[0], bytes(cubin)
