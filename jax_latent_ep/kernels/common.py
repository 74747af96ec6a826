"""Device-side pieces shared by the dispatch and combine kernels: buffer offsets on run-time integers, the
peer table, the layer epoch and its sequence guard, bounded polls and the error record.

The protocol (docs/protocol.md, checked by `tools.protocol_checker`): every word a peer writes is an
LL word (`primitives.store_ll`: 4 payload bytes + the writer's layer epoch in one 8-byte store) or a wide LL word
(`primitives.store_wide`: 12 payload bytes + the epoch in one 16-byte store), so a reader polls the data itself until it carries the current epoch; no fences or flags between ranks. Layer epochs come from two
control words of the rank's own buffer (`layout.CTRL_EPOCH_D`, `CTRL_EPOCH_C`), guarded by one local arrival
counter per kernel (`arrive_in_sequence`, `hand_over_epoch`). Receive rows come in two halves by layer parity
(`layout.ROW_HALVES`), so a writer overwrites only rows whose reads the data chain already ordered: no wait before
the stores, no flag. Every poll is bounded by `timeout_ns` (`poll_expired`); past it the polling thread writes the
error record and traps (`fail`).
No JAX here.
"""

from __future__ import annotations

import contextlib
import os

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32

from jax_latent_ep import layout as lay
from jax_latent_ep.kernels import abi
from jax_latent_ep.shapes import LatentMoEShape
from jax_latent_ep.kernels.primitives import (
    atomic_inc_relaxed_gpu,
    bits_from_f32,
    f32_from_bits,
    mul_ftz,
    fence_sc_sys,
    globaltimer,
    load_u64,
    shfl_bfly,
    shfl_idx_u64,
    store_relaxed_sys,
    store_u64,
    trap,
)

LINE = lay.LINE

#: Debug builds only (`JAX_LATENT_EP_KERNEL_TRACE=1` while compiling; never in the shipped cubins): the kernels
#: stamp `%globaltimer` and `%clock64` at their phase boundaries into the trace lines of the rank's control
#: region (`layout.TRACE`, `layout.TRACE_LAYERS`), read by the harness's `--trace`.
TRACE = os.environ.get("JAX_LATENT_EP_KERNEL_TRACE", "") in ("1", "2")
#: Debug builds only (`JAX_LATENT_EP_KERNEL_TRACE=2`): the trace's second line of each layer holds, instead of
#: `%clock64`, `%globaltimer` stamps of the combine's CTA 0 (lane 0 of a warp) through token 0's reduce: slot w
#: when warp w's polls returned, slot 8 + w when it passed the RMSNorm's stash barrier, slot 15 at warp 0's rstd,
#: slot 7 when warp 0's result stores were issued (`trace_warp`; harness `--trace` prints them).
TRACE_WARPS = os.environ.get("JAX_LATENT_EP_KERNEL_TRACE", "") == "2"
#: Experiment builds only (`JAX_LATENT_EP_KERNEL_NO_TIMEOUT=1` while compiling; never in the shipped cubins, whose
#: polls must end in an error when a peer stops): polls without the timeout, to time what its code costs.
POLL_TIMEOUT = os.environ.get("JAX_LATENT_EP_KERNEL_NO_TIMEOUT", "") != "1"
#: Source word of an empty receive row (its LL header's payload).
EMPTY = 0xFFFFFFFF


class DeviceLayout:
    """Byte offsets of a rank's buffer as DSL `Int64` values, from `layout.region_offsets` evaluated on the
    run-time `max_tokens` (the host sizes the buffer with the same function); pitches are compile-time."""

    def __init__(self, max_tokens, ranks: int, shape: LatentMoEShape):
        tokens = Int64(max_tokens)
        self.stride = lay.stride(tokens)
        regions = lay.region_offsets(self.stride, tokens, ranks, shape)
        self.rows = self.stride * ranks
        for name in ("x", "ids", "weights", "hdr", "mirror", "comb", "ctrl", "peers"):
            setattr(self, name, regions[name][0])
        self.x_pitch = lay.x_pitch(shape)
        self.x_words = lay.x_words(shape)  # wide LL words of a receive row's data stream
        self.meta_pitch = lay.meta_pitch(shape)
        self.hdr_pitch = lay.HDR_PITCH
        self.comb_pitch = lay.comb_pitch(shape)
        self.comb_words = lay.comb_words(shape)  # wide LL words of a partial


#: rn_f32(1 / 448), numerics.md's R.
RECIPROCAL_448_BITS = 0x3B124925
#: E8M0 scale of a 32-block that holds a NaN or Inf (the project's non-finite rule).
SF_NONFINITE = 255


def bf16_magnitude_max(words) -> Uint32:
    """The largest magnitude's bits (sign clear) of the BF16 pairs in `words` (each a `Uint32` of two BF16s):
    non-negative floats order like their bits (a NaN's or an Inf's bits are the largest, `mxfp8_exponent` flags
    them). Traced inline (a Python list of DSL values)."""
    top = Uint32(0)
    for word in words:
        top = cutlass.max(top, word & Uint32(0x7FFF))
        top = cutlass.max(top, (word >> Uint32(16)) & Uint32(0x7FFF))
    return top


@cute.jit
def mxfp8_exponent(top: Uint32) -> Uint32:
    """The E8M0 exponent `e` of a 32-block whose largest magnitude has the BF16 bits `top` (sign clear), as
    `numerics.mxfp8_scale_exponent`: `s = ftz(amax * R)`; `e = 0` if `s == 0`, else
    `min(254, biased_exp(s) + (mantissa(s) != 0))`; `SF_NONFINITE` where `top` is a NaN or Inf."""
    s_bits = Uint32(bits_from_f32(mul_ftz(f32_from_bits(top << Uint32(16)),
                                          f32_from_bits(Uint32(RECIPROCAL_448_BITS)))))
    e = Uint32(0)
    if s_bits & Uint32(0x7FFFFFFF) != Uint32(0):
        e = (s_bits >> Uint32(23)) & Uint32(0xFF)
        if s_bits & Uint32(0x7FFFFF) != Uint32(0):
            e = e + Uint32(1)
        if e > Uint32(254):
            e = Uint32(254)
    if top >= Uint32(0x7F80):
        e = Uint32(SF_NONFINITE)
    return e


@cute.jit
def mxfp8_inverse(e: Uint32) -> cutlass.Float32:
    """`2^(127 - e)` from the bits (a normal FP32 for BF16 blocks, `e <= 247`), 0 for `e` 0 or `SF_NONFINITE`:
    `e4m3(x * 0)` is NaN for a non-finite element, +-0 for the others."""
    inv_bits = Uint32(0)
    if e != Uint32(0):
        if e != Uint32(SF_NONFINITE):
            inv_bits = (Uint32(254) - e) << Uint32(23)
    return f32_from_bits(inv_bits)


@cute.jit
def mxfp8_block_scale(words, lanes: cutlass.Constexpr[int]):
    """`(e, 2^(127 - e))` of a 32-block that `lanes` adjacent lanes (1, 2 or 4, aligned) hold, this lane's part the
    BF16 pairs `words`: the block's largest magnitude over those lanes (butterflies), `mxfp8_exponent`,
    `mxfp8_inverse`. Every lane of the warp calls it."""
    top = bf16_magnitude_max(words)
    for offset_lanes in cutlass.range_constexpr(lanes.bit_length() - 1):
        other = shfl_bfly(top, 1 << offset_lanes)
        if other > top:
            top = other
    e = mxfp8_exponent(top)
    return e, mxfp8_inverse(e)


@cute.jit
def balanced_stride(num_units: Int32, grid) -> Int32:
    """The CTAs of a persistent grid that compute `num_units` units `u = cta, cta + stride, ..`: the fewest that
    take as many rounds as the whole `grid` would, so every computing CTA is busy to the last round (a last round
    of a few CTAs streams at their few loads' rate); the others exit. `num_units >= 1`."""
    rounds = (num_units + Int32(grid) - 1) // Int32(grid)
    return (num_units + rounds - 1) // rounds


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
def expert_rank_bit(expert: Uint32, local_experts: cutlass.Constexpr[int], ranks: cutlass.Constexpr[int]) -> Uint32:
    """`1 << d` for the rank `d = expert // local_experts` that holds expert id `expert` (the id's int32 bits),
    0 for an id outside `[0, E)`: unsigned, a negative id is at least 2**31, so its quotient is at least N too, and
    no shift is ever wider than the word. The XLA backend routes such ids to no rank; so do the kernels."""
    holder = expert // Uint32(local_experts)
    bit = Uint32(0)
    if holder < Uint32(ranks):
        bit = Uint32(1) << holder
    return bit


@cute.jit
def peer_row(r: Int32, rank: Int32, stride: Int32, peer_tokens: Int32, ranks: cutlass.Constexpr[int]) -> Int32:
    """Receive row of the `r`-th polled row of the other ranks (`r < (N - 1) * peer_tokens`, in rank order): row
    `r % peer_tokens` of rank `p = r // peer_tokens`, or of `p + 1` from this rank on. Rows `peer_tokens ..
    S - 1` of a rank carry nothing in this call (no rank has that many tokens), and a rank's own receive rows never
    pass through its buffer (the dispatch writes them straight into XLA's outputs, the combine reads them from
    `out`), so the copy-out and the sends walk only these rows. At N = 2 (`r < peer_tokens`, p = 0) without a
    division."""
    row = r
    if cutlass.const_expr(ranks == 2):
        if rank == 0:
            row = stride + r
    else:
        q = r // peer_tokens
        p = q
        if p >= rank:
            p = p + 1
        row = p * stride + r - q * peer_tokens
    return row


@cute.jit
def trace_stamp(ctrl: Int64, epoch: Uint32, index: cutlass.Constexpr[int], stamp: Int64, cycles: Int64, on: Int32):
    """Trace builds: if `on != 0`, stores `stamp` (`%globaltimer`) and `cycles` (`%clock64`) as stamp `index` of
    layer `epoch` (a ring of `layout.TRACE_LAYERS` layers: line pair `epoch % TRACE_LAYERS`)."""
    if on != 0:
        at = ctrl + lay.TRACE + Int64(epoch % Uint32(lay.TRACE_LAYERS)) * (2 * LINE) + index * 8
        store_u64(at, stamp)
        if cutlass.const_expr(not TRACE_WARPS):
            store_u64(at + LINE, cycles)


@cute.jit
def trace_warp(ctrl: Int64, epoch: Uint32, slot: Int32, on: Int32):
    """`TRACE_WARPS` builds: if `on != 0`, stores `%globaltimer` as slot `slot` of layer `epoch`'s second trace
    line (call it from one lane per warp)."""
    if on != 0:
        at = ctrl + lay.TRACE + Int64(epoch % Uint32(lay.TRACE_LAYERS)) * (2 * LINE) + LINE + Int64(slot) * 8
        store_u64(at, globaltimer())


@cute.jit
def poll_expired(start: Int64, polls: Uint32, timeout_ns: Int64) -> Uint32:
    """1 iff `timeout_ns != 0` and this is a 32nd poll and `%globaltimer` is past `start + timeout_ns` (the timer
    is read every 32 polls only: a shorter poll period)."""
    late = Uint32(0)
    if cutlass.const_expr(POLL_TIMEOUT):
        if timeout_ns != Int64(0) and (polls & Uint32(31)) == Uint32(0):
            if globaltimer() - start > timeout_ns:
                late = Uint32(1)
    return late


@cute.jit
def arrive_in_sequence(ctrl: Int64, counter: cutlass.Constexpr[int], grid: Int32, tid: Int32) -> Uint32:
    """The sequence guard's arrival: call it from every thread of every CTA, anywhere after the thread read
    both epoch words and passed its check (each thread checks before its first store). After a CTA barrier
    (every thread's reads of the epoch words have returned: its check used them) thread 0 arrives on the
    kernel's counter (`layout.CTRL_COUNT_*`, on a line of its own, re-armed by the grid's last arrival) and
    gets the old count, which nothing waits for until `hand_over_epoch`. Returns it (thread 0; 0 elsewhere)."""
    cute.arch.sync_threads()
    old = Uint32(0)
    if tid == 0:
        old = atomic_inc_relaxed_gpu(ctrl + 4 * counter, Uint32(grid - 1))
    return old


@cute.jit
def hand_over_epoch(ctrl: Int64, word: cutlass.Constexpr[int], epoch: Uint32, old: Uint32, grid: Int32,
                    tid: Int32):
    """The end of the sequence guard (call it last): thread 0 of the CTA whose arrival was the grid's last
    (old count = grid - 1) stores `epoch` into the kernel's epoch word (`layout.CTRL_EPOCH_*`). Guarantees: no
    thread of this grid reads an epoch word after the grid wrote it (every read returned before its CTA
    arrived; the store is issued only once the atomic returned the last count, so after every arrival), and a
    call out of sequence stores nothing (every thread fails its own check and traps before its first store;
    no failing CTA arrives, so the count never completes and the word is never written). The next kernel
    reads the word after its griddepcontrol.wait, when this grid has completed."""
    if tid == 0 and old == Uint32(grid - 1):
        store_relaxed_sys(ctrl + 4 * word, epoch)


@cute.jit
def fail(ctrl: Int64, status: Int64, code: cutlass.Constexpr[int], rank: Int32, peer: Int32, layer: Uint32):
    """Writes the error record `ctrl[CTRL_ERROR, CTRL_ERROR_PEER, CTRL_ERROR_LAYER] = code, peer, layer` and, if
    `status != 0`, the host record `{code, rank, peer, layer}` (code last, after a fence), then traps: the launch
    fails, and the host reads the record (several threads may write it; they write the same code)."""
    store_relaxed_sys(ctrl + 4 * lay.CTRL_ERROR_PEER, Uint32(peer))
    store_relaxed_sys(ctrl + 4 * lay.CTRL_ERROR_LAYER, layer)
    store_relaxed_sys(ctrl + 4 * lay.CTRL_ERROR, Uint32(code))
    if status != Int64(0):
        store_relaxed_sys(status + 4 * abi.STATUS_RANK, Uint32(rank))
        store_relaxed_sys(status + 4 * abi.STATUS_PEER, Uint32(peer))
        store_relaxed_sys(status + 4 * abi.STATUS_LAYER, layer)
        fence_sc_sys()
        store_relaxed_sys(status + 4 * abi.STATUS_CODE, Uint32(code))
    fence_sc_sys()
    trap()


#: DSL type of each ABI scalar type.
_DSL_TYPES = {"i64": Int64, "i32": Int32, "f32": cutlass.Float32}


def check_abi(op: abi.Kernel, kernel) -> None:
    """Raises ValueError unless `kernel.launch` and `kernel.kernel` take exactly `op`'s parameters (names and DSL
    types, in order): a parameter added on one side only fails the build."""
    import inspect

    # Annotations are strings here (`from __future__ import annotations`): compare by the type's name.
    names = {v.__name__: k for k, v in _DSL_TYPES.items()}
    for method in (type(kernel).launch, type(kernel).kernel):
        func = inspect.unwrap(getattr(method, "__wrapped__", method))
        params = [p for p in inspect.signature(func).parameters.values() if p.name != "self"]
        abi.check_signature(op.op, [p.name for p in params], [names.get(str(p.annotation), str(p.annotation))
                                                               for p in params])


@contextlib.contextmanager
def _private_dump_dir():
    """Points the DSL's dump directory (default: the working directory) at a private temporary one for the block;
    its files go with it."""
    import tempfile

    from cutlass.cutlass_dsl import CuTeDSL

    envar = CuTeDSL._get_dsl().envar
    saved = envar.dump_dir
    with tempfile.TemporaryDirectory(prefix="jax_latent_ep_cute_") as scratch:
        envar.dump_dir = scratch
        try:
            yield
        finally:
            envar.dump_dir = saved


def compile_cubin(op: abi.Kernel, kernel, arch: str):
    """`cute.compile(kernel.launch, ...)` for `arch`, after `check_abi`; returns `(symbol, cubin bytes)` of its one
    kernel (zero arguments of the ABI's types stand for the parameters).

    The DSL dumps the cubin into its dump directory and hands back its bytes (or its path); compiling happens in a
    private one (`_private_dump_dir`), so nothing is left behind."""
    check_abi(op, kernel)
    fake = [_DSL_TYPES[p.ctype](0) for p in op.params]
    with _private_dump_dir():
        compiled = cute.compile(kernel.launch, *fake, options=f"--gpu-arch {arch} --keep-cubin")
        return _read_cubin(compiled, arch)


def kernel_ptx(op: abi.Kernel, kernel, arch: str = "sm_90a") -> str:
    """The PTX of `kernel.launch` for `arch` (zero arguments of the ABI's types), for the build tests to read;
    compiled in a private dump directory like `compile_cubin`."""
    fake = [_DSL_TYPES[p.ctype](0) for p in op.params]
    with _private_dump_dir():
        compiled = cute.compile(kernel.launch, *fake, options=f"--gpu-arch {arch} --keep-ptx")
        ptx = compiled.artifacts.PTX
        if isinstance(ptx, str) and not ptx.lstrip().startswith("//"):  # a path into the dump directory
            with open(ptx) as f:
                ptx = f.read()
    return ptx.decode() if isinstance(ptx, bytes) else ptx


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
