"""Memory-ordering, raw-pointer and bit helpers of the EP kernels, each written once.

Every helper is one inline-PTX statement (or a short fixed sequence) marked as having side effects, so LLVM
never reorders two of them, never merges two loads of one address and never drops a store: the program
order of the DSL code is the order in which the instructions are issued. What the *hardware* may reorder is
what each docstring states; the memory model terms are PTX's (relaxed / acquire / release, scope `.gpu` or
`.sys`). Addresses are raw 64-bit generic addresses of global memory (device memory of this or a peer GPU,
or host-mapped memory), passed as `Int64`.

No JAX here: this module is imported by the ahead-of-time build only.
"""

from __future__ import annotations

from cutlass import Float32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _asm(result, operands, code, constraints, loc, ip):
    return llvm.inline_asm(
        result,
        operands,
        code,
        constraints,
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


def _i64(value, loc, ip):
    return Int64(value).ir_value(loc=loc, ip=ip)


def _u32(value, loc, ip):
    return Uint32(value).ir_value(loc=loc, ip=ip)


def _f32(value, loc, ip):
    return Float32(value).ir_value(loc=loc, ip=ip)


# ---------------------------------------------------------------------------------------------------------
# Plain (weak) loads and stores: data, never synchronization.


@dsl_user_op
def load_u64(addr, *, loc=None, ip=None) -> Int64:
    """Always issues one weak 8-byte `ld.global.b64`; `addr` must be 8-byte aligned (peer tables)."""
    return Int64(_asm(T.i64(), [_i64(addr, loc, ip)], "ld.global.b64 $0, [$1];", "=l,l", loc, ip))


@dsl_user_op
def store_u64(addr, value, *, loc=None, ip=None) -> None:
    """Always issues one weak 8-byte `st.global.b64` (the kernel trace's stamps); `addr` 8-byte aligned."""
    _asm(None, [_i64(addr, loc, ip), _i64(value, loc, ip)], "st.global.b64 [$0], $1;", "l,l", loc, ip)


@dsl_user_op
def clock64(*, loc=None, ip=None) -> Int64:
    """Always reads `%clock64` (this SM's cycle counter, a fresh read each call)."""
    return Int64(_asm(T.i64(), [], "mov.u64 $0, %clock64;", "=l", loc, ip))


@dsl_user_op
def load_b32(addr, *, loc=None, ip=None) -> Uint32:
    """Always issues one weak 4-byte `ld.global.b32`; ordered after earlier fences of this thread."""
    return Uint32(_asm(T.i32(), [_i64(addr, loc, ip)], "ld.global.b32 $0, [$1];", "=r,l", loc, ip))


@dsl_user_op
def load_v4(addr, *, loc=None, ip=None):
    """Always issues one weak 16-byte `ld.global.v4.b32` (addr 16-byte aligned); returns 4 `Uint32` words."""
    struct = _asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [_i64(addr, loc, ip)],
        "ld.global.v4.b32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,l",
        loc,
        ip,
    )
    return tuple(Uint32(llvm.extractvalue(T.i32(), struct, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def store_b32(addr, value, *, loc=None, ip=None) -> None:
    """Always issues one weak 4-byte `st.global.b32` (local or peer memory)."""
    _asm(None, [_i64(addr, loc, ip), _u32(value, loc, ip)], "st.global.b32 [$0], $1;", "l,r", loc, ip)


@dsl_user_op
def store_b16(addr, value, *, loc=None, ip=None) -> None:
    """Always issues one weak 2-byte `st.global.b16` of `value`'s low half (addr 2-byte aligned)."""
    _asm(None, [_i64(addr, loc, ip), _u32(value, loc, ip)], "st.global.b16 [$0], $1;", "l,r", loc, ip)


@dsl_user_op
def store_v2_b32(addr, lo, hi, *, loc=None, ip=None) -> None:
    """Always issues one weak 8-byte `st.global.v2.b32` of `(lo, hi)` (addr 8-byte aligned)."""
    _asm(None, [_i64(addr, loc, ip), _u32(lo, loc, ip), _u32(hi, loc, ip)], "st.global.v2.b32 [$0], {$1, $2};",
         "l,r,r", loc, ip)


@dsl_user_op
def store_v4(addr, words, *, loc=None, ip=None) -> None:
    """Always issues one weak 16-byte `st.global.v4.b32` of 4 words (addr 16-byte aligned): one fabric packet."""
    operands = [_i64(addr, loc, ip)] + [_u32(w, loc, ip) for w in words]
    _asm(None, operands, "st.global.v4.b32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", loc, ip)


# ---------------------------------------------------------------------------------------------------------
# LL words: a 4-byte payload and the 4-byte epoch of the layer that wrote it, in ONE 8-byte access. PTX makes an
# aligned 8-byte relaxed access single-copy atomic (and each element of a vector access is a scalar access of
# its own), so a reader that sees its epoch in a word sees the payload stored with it: no fence orders data
# before a flag, the data is the flag.


@dsl_user_op
def store_ll(addr, payload, epoch, *, loc=None, ip=None) -> None:
    """Always issues one `st.relaxed.sys.global.b64` of {payload (bits 0-31), epoch (bits 32-63)} (addr 8-byte
    aligned; local, peer or host-mapped memory): one single-copy atomic LL word."""
    code = "{ .reg .b64 w; mov.b64 w, {$1, $2}; st.relaxed.sys.global.b64 [$0], w; }"
    _asm(None, [_i64(addr, loc, ip), _u32(payload, loc, ip), _u32(epoch, loc, ip)], code, "l,r,r", loc, ip)


@dsl_user_op
def load_ll(addr, *, loc=None, ip=None):
    """Always issues one `ld.relaxed.sys.global.b64` (a fresh read, never cached in L1, never hoisted out of a
    poll loop); returns `(payload, epoch)` of one LL word, both from the same store."""
    struct = _asm(
        llvm.StructType.get_literal([T.i32()] * 2),
        [_i64(addr, loc, ip)],
        "{ .reg .b64 w; ld.relaxed.sys.global.b64 w, [$2]; mov.b64 {$0, $1}, w; }",
        "=r,=r,l",
        loc,
        ip,
    )
    return tuple(Uint32(llvm.extractvalue(T.i32(), struct, [i], loc=loc, ip=ip)) for i in range(2))


@dsl_user_op
def store_wide(addr, p0, p1, p2, epoch, *, loc=None, ip=None) -> None:
    """Always issues one `st.relaxed.sys.global.b128` of {p0, p1, p2, epoch} (bytes 0-3, 4-7, 8-11, 12-15; addr
    16-byte aligned; local or peer memory): one single-copy atomic wide LL word, one 16-byte fabric packet."""
    code = (
        "{ .reg .b64 lo, hi; .reg .b128 w; mov.b64 lo, {$1, $2}; mov.b64 hi, {$3, $4}; mov.b128 w, {lo, hi}; "
        "st.relaxed.sys.global.b128 [$0], w; }"
    )
    operands = [_i64(addr, loc, ip)] + [_u32(v, loc, ip) for v in (p0, p1, p2, epoch)]
    _asm(None, operands, code, "l,r,r,r,r", loc, ip)


@dsl_user_op
def load_wide(addr, *, loc=None, ip=None):
    """Always issues one `ld.relaxed.sys.global.b128` (a fresh read, never cached in L1, never hoisted out of a
    poll loop; addr 16-byte aligned); returns `(p0, p1, p2, epoch)` of one wide LL word, all from the same store."""
    struct = _asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [_i64(addr, loc, ip)],
        "{ .reg .b64 lo, hi; .reg .b128 w; ld.relaxed.sys.global.b128 w, [$4]; mov.b128 {lo, hi}, w; "
        "mov.b64 {$0, $1}, lo; mov.b64 {$2, $3}, hi; }",
        "=r,=r,=r,=r,l",
        loc,
        ip,
    )
    return tuple(Uint32(llvm.extractvalue(T.i32(), struct, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def griddepcontrol_wait_after(nonzero, values, *, loc=None, ip=None) -> None:
    """Always issues one `griddepcontrol.wait`, under a predicate that is true whenever `nonzero != 0`: the OR of
    `nonzero` and every 64-bit value in `values`. So the wait is issued only after all of `values` are computed.
    Without it ptxas hoists the wait (SASS `ACQBULK`) to the kernel's first instructions and leaves the address
    arithmetic behind it, where it runs after the previous grid has completed, on the critical path; with it that
    arithmetic runs while the previous grid is still running (programmatic dependent launch). Callers pass a
    value that is never 0 (`max_tokens >= 1`), so the wait is never skipped."""
    mix = Int64(nonzero)
    for value in values:
        mix = mix | Int64(value)
    _asm(None, [_i64(mix, loc, ip)], "{ .reg .pred p; setp.ne.u64 p, $0, 0; @p griddepcontrol.wait; }", "l", loc, ip)


# ---------------------------------------------------------------------------------------------------------
# Control words, the error record and the trap.


@dsl_user_op
def load_relaxed_sys(addr, *, loc=None, ip=None) -> Uint32:
    """Always issues one `ld.relaxed.sys.global.b32`: a fresh read of a control word (never cached, never hoisted
    out of a poll loop); it orders nothing else."""
    return Uint32(_asm(T.i32(), [_i64(addr, loc, ip)], "ld.relaxed.sys.global.b32 $0, [$1];", "=r,l", loc, ip))


@dsl_user_op
def store_relaxed_sys(addr, value, *, loc=None, ip=None) -> None:
    """Always issues one `st.relaxed.sys.global.b32`: a control-word store visible to every GPU and the host; it
    orders nothing by itself."""
    _asm(None, [_i64(addr, loc, ip), _u32(value, loc, ip)], "st.relaxed.sys.global.b32 [$0], $1;", "l,r", loc, ip)


@dsl_user_op
def atomic_inc_relaxed_gpu(addr, limit, *, loc=None, ip=None) -> Uint32:
    """Always issues one `atom.relaxed.gpu.global.inc.u32` (new = old >= limit ? 0 : old + 1) and returns the
    old value: an arrival counter that re-arms itself. No fence: nothing of this thread waits for it until the
    result is used (unlike `atom.add`, which ptxas may aggregate over the warp with a shuffle of the result
    right after the atomic, `inc` is issued as is), so its round trip overlaps the work issued after it."""
    return Uint32(
        _asm(
            T.i32(),
            [_i64(addr, loc, ip), _u32(limit, loc, ip)],
            "atom.relaxed.gpu.global.inc.u32 $0, [$1], $2;",
            "=r,l,r",
            loc,
            ip,
        )
    )


@dsl_user_op
def fence_sc_sys(*, loc=None, ip=None) -> None:
    """Always issues one `fence.sc.sys` (sequentially consistent, system scope): the strongest fence."""
    _asm(None, [], "fence.sc.sys;", "~{memory}", loc, ip)


@dsl_user_op
def trap(*, loc=None, ip=None) -> None:
    """Always issues `trap`: the launch fails with an illegal-instruction error (the context is lost)."""
    _asm(None, [], "trap;", "~{memory}", loc, ip)


@dsl_user_op
def globaltimer(*, loc=None, ip=None) -> Int64:
    """Always reads `%globaltimer` (nanoseconds, a fresh read each call)."""
    return Int64(_asm(T.i64(), [], "mov.u64 $0, %globaltimer;", "=l", loc, ip))


# ---------------------------------------------------------------------------------------------------------
# Warp collectives.


@dsl_user_op
def warp_or(value, *, loc=None, ip=None) -> Uint32:
    """Always issues one `redux.sync.or.b32` over the full warp (every lane must call it)."""
    return Uint32(_asm(T.i32(), [_u32(value, loc, ip)], "redux.sync.or.b32 $0, $1, 0xffffffff;", "=r,r", loc, ip))



@dsl_user_op
def shfl_bfly(value, offset: int, *, loc=None, ip=None) -> Uint32:
    """Always issues one `shfl.sync.bfly.b32` over the full warp: the value of lane `lane ^ offset`."""
    return Uint32(
        _asm(
            T.i32(),
            [_u32(value, loc, ip)],
            f"shfl.sync.bfly.b32 $0, $1, {offset}, 0x1f, 0xffffffff;",
            "=r,r",
            loc,
            ip,
        )
    )


@dsl_user_op
def shfl_idx(value, lane, *, loc=None, ip=None) -> Uint32:
    """Always issues one `shfl.sync.idx.b32` over the full warp: the value of lane `lane`."""
    return Uint32(
        _asm(
            T.i32(),
            [_u32(value, loc, ip), _u32(lane, loc, ip)],
            "shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;",
            "=r,r,r",
            loc,
            ip,
        )
    )


@dsl_user_op
def shfl_idx_u64(value, lane, *, loc=None, ip=None) -> Int64:
    """Two `shfl.sync.idx.b32` over the full warp: the 64-bit value of lane `lane`."""
    code = (
        "{ .reg .b32 lo, hi; mov.b64 {lo, hi}, $1; shfl.sync.idx.b32 lo, lo, $2, 0x1f, 0xffffffff; "
        "shfl.sync.idx.b32 hi, hi, $2, 0x1f, 0xffffffff; mov.b64 $0, {lo, hi}; }"
    )
    return Int64(_asm(T.i64(), [_i64(value, loc, ip), _u32(lane, loc, ip)], code, "=l,l,r", loc, ip))




@dsl_user_op
def shfl_up(value, offset: int, *, loc=None, ip=None) -> Uint32:
    """Always issues one `shfl.sync.up.b32` over the full warp: the value of lane `lane - offset` (lanes below
    `offset` get their own)."""
    return Uint32(_asm(T.i32(), [_u32(value, loc, ip)], f"shfl.sync.up.b32 $0, $1, {offset}, 0x0, 0xffffffff;",
                       "=r,r", loc, ip))


@dsl_user_op
def ballot(predicate, *, loc=None, ip=None) -> Uint32:
    """Always issues one `vote.sync.ballot.b32` over the full warp: bit l set where lane l's `predicate` != 0."""
    code = "{ .reg .pred p; setp.ne.u32 p, $1, 0; vote.sync.ballot.b32 $0, p, 0xffffffff; }"
    return Uint32(_asm(T.i32(), [_u32(predicate, loc, ip)], code, "=r,r", loc, ip))


@dsl_user_op
def match_any(value, *, loc=None, ip=None) -> Uint32:
    """Always issues one `match.any.sync.b32` over the full warp: the lanes whose `value` equals this lane's."""
    return Uint32(_asm(T.i32(), [_u32(value, loc, ip)], "match.any.sync.b32 $0, $1, 0xffffffff;", "=r,r", loc, ip))


@dsl_user_op
def popc(value, *, loc=None, ip=None) -> Uint32:
    """`popc.b32`: the set bits of `value`."""
    return Uint32(_asm(T.i32(), [_u32(value, loc, ip)], "popc.b32 $0, $1;", "=r,r", loc, ip))


@dsl_user_op
def shfl_bfly_f32(value, offset: int, *, loc=None, ip=None) -> Float32:
    """Always issues one `shfl.sync.bfly.b32` of an FP32 value (bits unchanged)."""
    return Float32(
        _asm(
            T.f32(),
            [_f32(value, loc, ip)],
            f"shfl.sync.bfly.b32 $0, $1, {offset}, 0x1f, 0xffffffff;",
            "=f,f",
            loc,
            ip,
        )
    )


# ---------------------------------------------------------------------------------------------------------
# Bits and arithmetic with pinned rounding (no fast-math, no contraction).


@dsl_user_op
def f32_from_bits(bits, *, loc=None, ip=None) -> Float32:
    """The FP32 value with the given bit pattern (`mov.b32`)."""
    return Float32(_asm(T.f32(), [_u32(bits, loc, ip)], "mov.b32 $0, $1;", "=f,r", loc, ip))


@dsl_user_op
def bits_from_f32(value, *, loc=None, ip=None) -> Uint32:
    """The bit pattern of an FP32 value (`mov.b32`)."""
    return Uint32(_asm(T.i32(), [_f32(value, loc, ip)], "mov.b32 $0, $1;", "=r,f", loc, ip))


@dsl_user_op
def mul_ftz(a, b, *, loc=None, ip=None) -> Float32:
    """`mul.rn.ftz.f32`: one round-to-nearest-even product; FP32-subnormal inputs and result flushed to signed 0."""
    return Float32(_asm(T.f32(), [_f32(a, loc, ip), _f32(b, loc, ip)], "mul.rn.ftz.f32 $0, $1, $2;", "=f,f,f", loc, ip))


@dsl_user_op
def mul_rn(a, b, *, loc=None, ip=None) -> Float32:
    """`mul.rn.f32`: one IEEE product (subnormals kept), never contracted into an FMA."""
    return Float32(_asm(T.f32(), [_f32(a, loc, ip), _f32(b, loc, ip)], "mul.rn.f32 $0, $1, $2;", "=f,f,f", loc, ip))


@dsl_user_op
def add_rn(a, b, *, loc=None, ip=None) -> Float32:
    """`add.rn.f32`: one IEEE sum (subnormals kept), never contracted into an FMA."""
    return Float32(_asm(T.f32(), [_f32(a, loc, ip), _f32(b, loc, ip)], "add.rn.f32 $0, $1, $2;", "=f,f,f", loc, ip))


@dsl_user_op
def e4m3x4(a, b, c, d, *, loc=None, ip=None) -> Uint32:
    """Four FP32 values to four float8_e4m3fn bytes `[a, b, c, d]` (byte 0 = a) with
    `cvt.rn.satfinite.e4m3x2.f32`: round to nearest even, finite overflow saturates to +-448, NaN stays NaN."""
    code = (
        "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }"
    )
    operands = [_f32(v, loc, ip) for v in (a, b, c, d)]
    return Uint32(_asm(T.i32(), operands, code, "=r,f,f,f,f", loc, ip))


@dsl_user_op
def bf16x2(lo, hi, *, loc=None, ip=None) -> Uint32:
    """Two FP32 values rounded once (nearest even) to BF16 and packed: `lo` in bits 0-15, `hi` in 16-31."""
    return Uint32(
        _asm(T.i32(), [_f32(hi, loc, ip), _f32(lo, loc, ip)], "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", loc, ip)
    )


@dsl_user_op
def prmt(a, b, selector: int, *, loc=None, ip=None) -> Uint32:
    """`prmt.b32`: byte `i` of the result is byte `(selector >> 4 i) & 7` of `b:a` (bytes 0-3 of `a`, 4-7 of `b`)."""
    return Uint32(_asm(T.i32(), [_u32(a, loc, ip), _u32(b, loc, ip)], f"prmt.b32 $0, $1, $2, {int(selector):#x};",
                       "=r,r,r", loc, ip))


@dsl_user_op
def rms_rstd(total, eps, latent: int, *, loc=None, ip=None) -> Float32:
    """vLLM's `rsqrtf(total / latent + eps)`: IEEE `div.rn`, `add.rn`, then the hardware `rsqrt.approx.f32`."""
    code = "{ .reg .f32 m; div.rn.f32 m, $1, 0f%08X; add.rn.f32 m, m, $2; rsqrt.approx.f32 $0, m; }" % _f32_hex(latent)
    return Float32(_asm(T.f32(), [_f32(total, loc, ip), _f32(eps, loc, ip)], code, "=f,f,f", loc, ip))


def _f32_hex(value: float) -> int:
    import struct

    return struct.unpack("<I", struct.pack("<f", float(value)))[0]


def lo_f32(word):
    """The BF16 in bits 0-15 of `word`, widened (exactly) to FP32."""
    return f32_from_bits(Uint32(word) << Uint32(16))


def hi_f32(word):
    """The BF16 in bits 16-31 of `word`, widened (exactly) to FP32."""
    return f32_from_bits(Uint32(word) & Uint32(0xFFFF0000))


# ---------------------------------------------------------------------------------------------------------
# Shared memory, asynchronous copies and warp-level tensor-core MMA (the grouped GEMM). Shared addresses are the
# 32-bit `.shared` window offsets that `SmemAllocator` pointers give with `toint()`.


@dsl_user_op
def cp_async_16(smem, gmem, src_bytes, *, loc=None, ip=None) -> None:
    """Always issues one `cp.async.cg.shared.global` of 16 bytes from `gmem` (16-byte aligned) to `smem`: the
    first `src_bytes` (0 or 16) are read, the rest zero-filled. Completes only at `cp_async_wait`; bypasses L1."""
    _asm(None, [_u32(smem, loc, ip), _i64(gmem, loc, ip), _u32(src_bytes, loc, ip)],
         "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r", loc, ip)


@dsl_user_op
def cp_async_4(smem, gmem, src_bytes, *, loc=None, ip=None) -> None:
    """Always issues one `cp.async.ca.shared.global` of 4 bytes from `gmem` (4-byte aligned) to `smem`, the first
    `src_bytes` (0 or 4) read and the rest zero-filled; completes only at `cp_async_wait`, like `cp_async_16`."""
    _asm(None, [_u32(smem, loc, ip), _i64(gmem, loc, ip), _u32(src_bytes, loc, ip)],
         "cp.async.ca.shared.global [$0], [$1], 4, $2;", "r,l,r", loc, ip)


@dsl_user_op
def cp_async_commit(*, loc=None, ip=None) -> None:
    """Always issues `cp.async.commit_group`: this thread's copies since the last commit form one group."""
    _asm(None, [], "cp.async.commit_group;", "~{memory}", loc, ip)


@dsl_user_op
def cp_async_wait(pending: int, *, loc=None, ip=None) -> None:
    """Always issues `cp.async.wait_group pending`: returns once at most `pending` of this thread's committed
    groups are still in flight (their bytes are then in shared memory, visible to this thread; other threads
    see them after a barrier)."""
    _asm(None, [], f"cp.async.wait_group {int(pending)};", "~{memory}", loc, ip)


def _ldmatrix(smem, trans: bool, loc, ip):
    struct = _asm(
        llvm.StructType.get_literal([T.i32()] * 4),
        [_u32(smem, loc, ip)],
        f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16 {{$0, $1, $2, $3}}, [$4];",
        "=r,=r,=r,=r,r",
        loc,
        ip,
    )
    return tuple(Uint32(llvm.extractvalue(T.i32(), struct, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def ldmatrix_x4(smem, *, loc=None, ip=None):
    """Warp-wide `ldmatrix.x4` (all lanes, converged): lanes 8q..8q+7 give the 16-byte rows of 8x8 b16 matrix q;
    returns this lane's word of each matrix (row lane/4, columns 2(lane%4), +1)."""
    return _ldmatrix(smem, False, loc, ip)


@dsl_user_op
def ldmatrix_x4_trans(smem, *, loc=None, ip=None):
    """`ldmatrix_x4` transposed: this lane's word of matrix q holds rows 2(lane%4), +1 of column lane/4."""
    return _ldmatrix(smem, True, loc, ip)


def _mma_16x8(op: str, acc, a, b, loc, ip):
    """One warp-wide `mma.sync.aligned.<op>` of 4 A words, 2 B words and 4 FP32 accumulators; the 4 results."""
    operands = [_u32(w, loc, ip) for w in a] + [_u32(w, loc, ip) for w in b] + [_f32(c, loc, ip) for c in acc]
    struct = _asm(llvm.StructType.get_literal([T.f32()] * 4), operands,
                  f"mma.sync.aligned.{op} {{$0, $1, $2, $3}}, {{$4, $5, $6, $7}}, {{$8, $9}}, {{$10, $11, $12, $13}};",
                  "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", loc, ip)
    return tuple(Float32(llvm.extractvalue(T.f32(), struct, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def mma_bf16_16816(acc, a, b, *, loc=None, ip=None):
    """Warp-wide `mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32`: `acc` (4 FP32) += A (4 words: ldmatrix_x4 of a
    row-major 16x16 tile) x B (2 words: the k 0-7 and 8-15 halves of a 16x8 tile); FP32 accumulation in the
    tensor core's order. Returns the 4 new accumulators (rows lane/4 and +8, columns 2(lane%4), +1)."""
    return _mma_16x8("m16n8k16.row.col.f32.bf16.bf16.f32", acc, a, b, loc, ip)


@dsl_user_op
def mma_e4m3_16832(acc, a, b, *, loc=None, ip=None):
    """Warp-wide `mma.sync.m16n8k32.row.col.f32.e4m3.e4m3.f32`: `acc` (4 FP32) += A (4 words: `ldmatrix_x4` of a
    row-major 16x32 float8_e4m3fn tile, 16-byte rows 0-7 | 8-15 of bytes 0-15, then of 16-31) x B (2 words: contraction
    rows 4 (lane % 4) .. + 3 and 16 + those of column lane / 4); the tensor core's sum of the exact products (on sm_90a
    two f16 HMMAs of the widened operands). Returns the 4 new accumulators (rows lane/4 and +8, columns 2(lane%4),
    +1)."""
    return _mma_16x8("m16n8k32.row.col.f32.e4m3.e4m3.f32", acc, a, b, loc, ip)


@dsl_user_op
def store_v2_f32(addr, x, y, *, loc=None, ip=None) -> None:
    """Always issues one weak 8-byte `st.global.v2.f32` of `(x, y)` (addr 8-byte aligned)."""
    _asm(None, [_i64(addr, loc, ip), _f32(x, loc, ip), _f32(y, loc, ip)], "st.global.v2.f32 [$0], {$1, $2};",
         "l,f,f", loc, ip)


@dsl_user_op
def griddepcontrol_wait(*, loc=None, ip=None) -> None:
    """Always issues `griddepcontrol.wait`: returns once the grids this one depends on (programmatic dependent
    launch) have completed and their memory is visible; a no-op without such a launch."""
    _asm(None, [], "griddepcontrol.wait;", "~{memory}", loc, ip)


@dsl_user_op
def store_shared_v2_f32(smem, x, y, *, loc=None, ip=None) -> None:
    """Always issues one `st.shared.v2.f32` of `(x, y)` at shared address `smem` (8-byte aligned)."""
    _asm(None, [_u32(smem, loc, ip), _f32(x, loc, ip), _f32(y, loc, ip)], "st.shared.v2.f32 [$0], {$1, $2};",
         "r,f,f", loc, ip)


@dsl_user_op
def load_shared_v2_f32(smem, *, loc=None, ip=None):
    """Always issues one `ld.shared.v2.f32` at shared address `smem` (8-byte aligned); returns two `Float32`."""
    struct = _asm(llvm.StructType.get_literal([T.f32()] * 2), [_u32(smem, loc, ip)],
                  "ld.shared.v2.f32 {$0, $1}, [$2];", "=f,=f,r", loc, ip)
    return tuple(Float32(llvm.extractvalue(T.f32(), struct, [i], loc=loc, ip=ip)) for i in range(2))


@dsl_user_op
def silu_mul(gate, up, *, loc=None, ip=None) -> Float32:
    """`gate / (1 + exp(-gate)) * up` in FP32 (`ex2.approx` and IEEE `div.rn`: within a few FP32 ulps of
    XLA's `silu(gate) * up`, far below the BF16 rounding that follows)."""
    code = ("{ .reg .f32 e, d; mul.f32 e, $1, 0fBFB8AA3B; ex2.approx.ftz.f32 e, e; add.f32 d, e, 0f3F800000; "
            "div.rn.f32 e, $1, d; mul.f32 $0, e, $2; }")
    return Float32(_asm(T.f32(), [_f32(gate, loc, ip), _f32(up, loc, ip)], code, "=f,f,f", loc, ip))


@dsl_user_op
def round_bf16(value, *, loc=None, ip=None) -> Float32:
    """`value` rounded once (nearest even) to BF16, as FP32: what a bf16 output holds."""
    code = "{ .reg .b16 b; cvt.rn.bf16.f32 b, $1; cvt.f32.bf16 $0, b; }"
    return Float32(_asm(T.f32(), [_f32(value, loc, ip)], code, "=f,f", loc, ip))


@dsl_user_op
def store_b32_bf16x2(addr, lo, hi, *, loc=None, ip=None) -> None:
    """Rounds `lo`, `hi` once (nearest even) to BF16 and issues one weak 4-byte `st.global.b32` of the pair."""
    code = "{ .reg .b32 w; cvt.rn.bf16x2.f32 w, $2, $1; st.global.b32 [$0], w; }"
    _asm(None, [_i64(addr, loc, ip), _f32(lo, loc, ip), _f32(hi, loc, ip)], code, "l,f,f", loc, ip)


@dsl_user_op
def load_shared_b32(smem, *, loc=None, ip=None) -> Uint32:
    """Always issues one `ld.shared.b32` at shared address `smem`."""
    return Uint32(_asm(T.i32(), [_u32(smem, loc, ip)], "ld.shared.b32 $0, [$1];", "=r,r", loc, ip))


@dsl_user_op
def store_shared_b32(smem, value, *, loc=None, ip=None) -> None:
    """Always issues one `st.shared.b32` of `value` at shared address `smem`."""
    _asm(None, [_u32(smem, loc, ip), _u32(value, loc, ip)], "st.shared.b32 [$0], $1;", "r,r", loc, ip)


@dsl_user_op
def store_shared_v4(smem, words, *, loc=None, ip=None) -> None:
    """Always issues one `st.shared.v4.b32` of 4 words at shared address `smem` (16-byte aligned)."""
    operands = [_u32(smem, loc, ip)] + [_u32(w, loc, ip) for w in words]
    _asm(None, operands, "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r", loc, ip)


@dsl_user_op
def atomic_add_shared(smem, value, *, loc=None, ip=None) -> Uint32:
    """`atom.shared.add.u32`: adds `value` to the word at shared address `smem`; returns the word before (the
    order among concurrent adds is unspecified)."""
    return Uint32(_asm(T.i32(), [_u32(smem, loc, ip), _u32(value, loc, ip)], "atom.shared.add.u32 $0, [$1], $2;",
                       "=r,r,r", loc, ip))


@dsl_user_op
def atomic_or_shared(smem, value, *, loc=None, ip=None) -> None:
    """`atom.shared.or.b32`: ORs `value` into the word at shared address `smem` (result unused)."""
    _asm(None, [_u32(smem, loc, ip), _u32(value, loc, ip)], "{ .reg .b32 t; atom.shared.or.b32 t, [$0], $1; }",
         "r,r", loc, ip)


# ---------------------------------------------------------------------------------------------------------
# Arrival counters in global memory (the one-launch expert stage, `kernels/grouped_gemm.py`): a CTA's threads store, the
# CTA synchronizes, one thread fences and adds; a reader that sees the count (an acquire load, or the atomic's old
# value followed by a fence) and then synchronizes its CTA reads what the counted CTAs stored, through L2.


@dsl_user_op
def fence_acq_rel_gpu(*, loc=None, ip=None) -> None:
    """Always issues one `fence.acq_rel.gpu`: this thread's earlier memory operations (and, through a CTA barrier
    before it, its CTA's) are ordered before its later ones for every thread of the GPU."""
    _asm(None, [], "fence.acq_rel.gpu;", "~{memory}", loc, ip)


@dsl_user_op
def atomic_add_relaxed_gpu(addr, value, *, loc=None, ip=None) -> Uint32:
    """Always issues one `atom.relaxed.gpu.global.add.u32`; returns the word before (it orders nothing else)."""
    return Uint32(_asm(T.i32(), [_i64(addr, loc, ip), _u32(value, loc, ip)],
                       "atom.relaxed.gpu.global.add.u32 $0, [$1], $2;", "=r,l,r", loc, ip))


@dsl_user_op
def red_add_relaxed_gpu(addr, value, *, loc=None, ip=None) -> None:
    """Always issues one `red.relaxed.gpu.global.add.u32` (no result: the thread does not wait for it)."""
    _asm(None, [_i64(addr, loc, ip), _u32(value, loc, ip)], "red.relaxed.gpu.global.add.u32 [$0], $1;", "l,r",
         loc, ip)


@dsl_user_op
def load_acquire_gpu(addr, *, loc=None, ip=None) -> Uint32:
    """Always issues one `ld.acquire.gpu.global.b32`: a fresh read of a counter; this thread's later memory
    operations are ordered after it."""
    return Uint32(_asm(T.i32(), [_i64(addr, loc, ip)], "ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", loc, ip))


@dsl_user_op
def load_cg_v2_f32(addr, *, loc=None, ip=None):
    """Always issues one `ld.global.cg.v2.f32` (cached in L2 only: another CTA's fenced stores, never a stale L1
    line); returns two `Float32` (addr 8-byte aligned)."""
    struct = _asm(llvm.StructType.get_literal([T.f32()] * 2), [_i64(addr, loc, ip)],
                  "ld.global.cg.v2.f32 {$0, $1}, [$2];", "=f,=f,l", loc, ip)
    return tuple(Float32(llvm.extractvalue(T.f32(), struct, [i], loc=loc, ip=ip)) for i in range(2))


@dsl_user_op
def e4m3x8_to_bf16x8(lo, hi, scale, *, loc=None, ip=None):
    """Eight e4m3 bytes (`lo`, then `hi`; element 0 the lowest byte of `lo`) times the FP32 `scale`, each rounded
    once to BF16 (nearest even), as four `bf16x2` words, element 0 in the low half of word 0:
    `numerics.mxfp8_dequantize` then `astype(bfloat16)` bit for bit (e4m3 -> f16 -> f32 is exact, the product one
    FP32 rounding)."""
    code = ("{ .reg .b16 q0, q1, q2, q3; .reg .b32 h0, h1, h2, h3; .reg .f16 e<8>; .reg .f32 f<8>; "
            "mov.b32 {q0, q1}, $4; mov.b32 {q2, q3}, $5; "
            "cvt.rn.f16x2.e4m3x2 h0, q0; cvt.rn.f16x2.e4m3x2 h1, q1; cvt.rn.f16x2.e4m3x2 h2, q2; "
            "cvt.rn.f16x2.e4m3x2 h3, q3; mov.b32 {e0, e1}, h0; mov.b32 {e2, e3}, h1; mov.b32 {e4, e5}, h2; "
            "mov.b32 {e6, e7}, h3; cvt.f32.f16 f0, e0; cvt.f32.f16 f1, e1; cvt.f32.f16 f2, e2; cvt.f32.f16 f3, e3; "
            "cvt.f32.f16 f4, e4; cvt.f32.f16 f5, e5; cvt.f32.f16 f6, e6; cvt.f32.f16 f7, e7; "
            "mul.rn.f32 f0, f0, $6; mul.rn.f32 f1, f1, $6; mul.rn.f32 f2, f2, $6; mul.rn.f32 f3, f3, $6; "
            "mul.rn.f32 f4, f4, $6; mul.rn.f32 f5, f5, $6; mul.rn.f32 f6, f6, $6; mul.rn.f32 f7, f7, $6; "
            "cvt.rn.bf16x2.f32 $0, f1, f0; cvt.rn.bf16x2.f32 $1, f3, f2; cvt.rn.bf16x2.f32 $2, f5, f4; "
            "cvt.rn.bf16x2.f32 $3, f7, f6; }")
    struct = _asm(llvm.StructType.get_literal([T.i32()] * 4),
                  [_u32(lo, loc, ip), _u32(hi, loc, ip), _f32(scale, loc, ip)], code, "=r,=r,=r,=r,r,r,f", loc, ip)
    return tuple(Uint32(llvm.extractvalue(T.i32(), struct, [i], loc=loc, ip=ip)) for i in range(4))


# ---------------------------------------------------------------------------------------------------------
# Warpgroup MMA (sm_90a): shared-memory operands named by 64-bit matrix descriptors, FP32 accumulators in registers.
# The accumulators of an issued `wgmma_*` are the hardware's until `wgmma_wait` says it completed (ptxas
# serializes, never corrupts, a read it cannot prove safe).


@dsl_user_op
def fence_proxy_async_shared(*, loc=None, ip=None) -> None:
    """Always issues `fence.proxy.async.shared::cta`: this thread's completed generic-proxy writes to shared memory
    (`cp.async` bytes after `cp_async_wait`, `st.shared`) become visible to the async proxy (`wgmma`'s operand
    reads) of the threads that pass a later barrier with it."""
    _asm(None, [], "fence.proxy.async.shared::cta;", "~{memory}", loc, ip)


@dsl_user_op
def mbarrier_init(bar, count, *, loc=None, ip=None) -> None:
    """Always issues `mbarrier.init.shared::cta.b64`: the barrier at shared address `bar` (8-byte aligned) expects
    `count` arrivals a phase, in phase 0. Other threads may use it after a CTA barrier that follows."""
    _asm(None, [_u32(bar, loc, ip), _u32(count, loc, ip)], "mbarrier.init.shared::cta.b64 [$0], $1;", "r,r", loc,
         ip)


@dsl_user_op
def mbarrier_arrive(bar, *, loc=None, ip=None) -> None:
    """Always issues `mbarrier.arrive.release.cta.shared::cta.b64`: one arrival on `bar`; this thread's prior
    memory accesses happen before those of a thread whose `mbarrier_wait` sees the phase complete."""
    _asm(None, [_u32(bar, loc, ip)], "mbarrier.arrive.release.cta.shared::cta.b64 _, [$0];", "r,~{memory}", loc, ip)


@dsl_user_op
def mbarrier_wait(bar, parity, suspend_ns: int = 0, *, loc=None, ip=None) -> None:
    """Returns once the phase of `bar` of parity `parity` (0 or 1: phase `k` has parity `k % 2`) has completed
    (`mbarrier.try_wait.parity.acquire.cta` in a loop): the accesses the arrivals released are visible. `suspend_ns`
    > 0: each try may suspend the thread up to that long for the phase (fewer tries issued while it waits)."""
    hint = f", {int(suspend_ns)}" if suspend_ns else ""
    code = ("{ .reg .pred done; waiting: mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [$0], $1"
            f"{hint}; @!done bra waiting; }}")
    _asm(None, [_u32(bar, loc, ip), _u32(parity, loc, ip)], code, "r,r,~{memory}", loc, ip)


@dsl_user_op
def named_barrier_sync(barrier: int, threads: int, *, loc=None, ip=None) -> None:
    """Always issues `bar.sync barrier, threads` (a multiple of 32): the CTA barrier of the `threads` threads that
    name `barrier` (1-15; 0 is `sync_threads`'); memory ordered as by `sync_threads` among them."""
    _asm(None, [], f"bar.sync {int(barrier)}, {int(threads)};", "~{memory}", loc, ip)


@dsl_user_op
def set_max_registers(count: int, increase: bool, *, loc=None, ip=None) -> None:
    """Always issues `setmaxnreg.{inc,dec}.sync.aligned.u32 count` (warpgroup-wide, `count` a multiple of 8 in
    24-256): this warpgroup's registers a thread become `count`, released to or taken from the CTA's pool (an
    increase waits until the pool holds them)."""
    _asm(None, [], f"setmaxnreg.{'inc' if increase else 'dec'}.sync.aligned.u32 {int(count)};", "~{memory}", loc, ip)


@dsl_user_op
def wgmma_fence(*, loc=None, ip=None) -> None:
    """Always issues `wgmma.fence.sync.aligned` (warpgroup-wide): orders this warpgroup's prior register and shared
    memory accesses before the `wgmma_*` that follow."""
    _asm(None, [], "wgmma.fence.sync.aligned;", "~{memory}", loc, ip)


@dsl_user_op
def wgmma_commit(*, loc=None, ip=None) -> None:
    """Always issues `wgmma.commit_group.sync.aligned`: the `wgmma_*` issued since the last commit form one group."""
    _asm(None, [], "wgmma.commit_group.sync.aligned;", "~{memory}", loc, ip)


@dsl_user_op
def wgmma_wait(pending: int, *, loc=None, ip=None) -> None:
    """Always issues `wgmma.wait_group.sync.aligned pending`: returns once at most `pending` of this warpgroup's
    committed groups are in flight (the others' accumulators written, their shared operands read)."""
    _asm(None, [], f"wgmma.wait_group.sync.aligned {int(pending)};", "~{memory}", loc, ip)


def descriptor_fields(leading_bytes: int, stride_bytes: int) -> int:
    """The constant bits of a `wgmma` shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format"): the
    leading and stride byte offsets in 16-byte units at bits 16-29 and 32-45, swizzle mode 1 (128 B) at bits
    62-63; the start address (bits 0-13) is `smem_descriptor`'s."""
    for name, value in (("leading_bytes", leading_bytes), ("stride_bytes", stride_bytes)):
        if value % 16 or not 0 <= value >> 4 < 1 << 14:
            raise ValueError(f"{name}={value} must be a multiple of 16 below 256 KB")
    return (leading_bytes >> 4) << 16 | (stride_bytes >> 4) << 32 | 1 << 62


def smem_descriptor(addr, leading_bytes: int, stride_bytes: int):
    """The 64-bit `wgmma` matrix descriptor of the 128-byte-swizzled operand tile at shared address `addr` (its
    swizzle atoms 1024-byte aligned), `descriptor_fields` with the start address in 16-byte units. K-major tiles:
    `stride_bytes` between 8-row groups, `leading_bytes` unused; MN-major: `leading_bytes` between 64-element
    column blocks, `stride_bytes` between 8-row groups of the contraction."""
    return ((Int64(addr) & 0x3FFFF) >> 4) | Int64(descriptor_fields(leading_bytes, stride_bytes))


@dsl_user_op
def smem_descriptor_advance(desc, units, *, loc=None, ip=None):
    """`desc` (an `smem_descriptor`) of the tile `units` 16-byte units further on (the tile below 256 KB): one 32-bit
    add to the start address (bits 0-13; no carry out of them below 256 KB), the other fields kept."""
    code = "{ .reg .b32 lo, hi; mov.b64 {lo, hi}, $1; add.u32 lo, lo, $2; mov.b64 $0, {lo, hi}; }"
    return Int64(_asm(T.i64(), [_i64(desc, loc, ip), _u32(units, loc, ip)], code, "=l,l,r", loc, ip))


@dsl_user_op
def wgmma_bf16_m64k16(acc, desc_a, desc_b, a_mn_major: bool, b_mn_major: bool, *, loc=None, ip=None):
    """Warpgroup-wide `wgmma.mma_async.sync.aligned.m64n<n>k16.f32.bf16.bf16`, `n = 2 len(acc)` (128 or 256): `acc`
    (n / 2 FP32 of this thread) += A (64 x 16, `desc_a`) x B (16 x n, `desc_b`), each K-major or, with `a_mn_major` /
    `b_mn_major`, MN-major. Thread t of the warpgroup holds rows 16 (t / 32) + (t % 32) / 4 (+ 8) and columns
    8 j + 2 (t % 4) (+ 1) at `acc[4 j + 2 i + e]` (row + 8 i, column + e). Returns the new accumulators
    (asynchronous: `wgmma_wait`)."""
    n = len(acc)
    if n not in (64, 128):
        raise ValueError(f"wgmma_bf16_m64k16: {n} accumulators a thread, want 64 (n128) or 128 (n256)")
    outs = ", ".join(f"${i}" for i in range(n))
    code = ("{ .reg .pred p; setp.ne.b32 p, $%d, 0; wgmma.mma_async.sync.aligned.m64n%dk16.f32.bf16.bf16 "
            "{%s}, $%d, $%d, p, 1, 1, %d, %d; }" % (2 * n + 2, 2 * n, outs, 2 * n, 2 * n + 1, int(a_mn_major),
                                                   int(b_mn_major)))
    constraints = ",".join(["=f"] * n + [str(i) for i in range(n)] + ["l", "l", "r"])
    operands = [_f32(a, loc, ip) for a in acc] + [_i64(desc_a, loc, ip), _i64(desc_b, loc, ip), _u32(1, loc, ip)]
    struct = _asm(llvm.StructType.get_literal([T.f32()] * n), operands, code, constraints, loc, ip)
    return [Float32(llvm.extractvalue(T.f32(), struct, [i], loc=loc, ip=ip)) for i in range(n)]


@dsl_user_op
def wgmma_e4m3_m64k32(desc_a, desc_b, n: int, *, loc=None, ip=None):
    """Warpgroup-wide `wgmma.mma_async.sync.aligned.m64n<n>k32.f32.e4m3.e4m3` (`n` 8, 16, 24, 32, 64 or 128) with
    `scale-d` 0: A (64 x 32 e4m3, `desc_a`) x B (32 x n, `desc_b`), both K-major (FP8 operands have no other form), into
    `n / 2` fresh FP32 of this thread: the exact products' sum in the tensor core, one 32-deep block. Thread t
    holds rows 16 (t / 32) + (t % 32) / 4 (+ 8) and columns 8 j + 2 (t % 4) (+ 1) at `[4 j + 2 i + e]` (row + 8 i,
    column + e), as `wgmma_bf16_m64k16`. Asynchronous: read the results after `wgmma_wait`."""
    if n not in (8, 16, 24, 32, 64, 128):
        raise ValueError(f"wgmma_e4m3_m64k32: n={n} must be 8, 16, 24, 32, 64 or 128")
    regs = n // 2
    outs = ", ".join(f"${i}" for i in range(regs))
    code = ("{ .reg .pred p; setp.ne.b32 p, $%d, 0; wgmma.mma_async.sync.aligned.m64n%dk32.f32.e4m3.e4m3 "
            "{%s}, $%d, $%d, p, 1, 1; }" % (regs + 2, n, outs, regs, regs + 1))
    constraints = ",".join(["=f"] * regs + ["l", "l", "r"])
    operands = [_i64(desc_a, loc, ip), _i64(desc_b, loc, ip), _u32(0, loc, ip)]
    struct = _asm(llvm.StructType.get_literal([T.f32()] * regs), operands, code, constraints, loc, ip)
    return [Float32(llvm.extractvalue(T.f32(), struct, [i], loc=loc, ip=ip)) for i in range(regs)]


@dsl_user_op
def fma_rn(a, b, c, *, loc=None, ip=None) -> Float32:
    """`fma.rn.f32`: `a * b + c` rounded once (subnormals kept)."""
    return Float32(_asm(T.f32(), [_f32(a, loc, ip), _f32(b, loc, ip), _f32(c, loc, ip)], "fma.rn.f32 $0, $1, $2, $3;",
                        "=f,f,f,f", loc, ip))


@dsl_user_op
def store_f32(addr, value, *, loc=None, ip=None) -> None:
    """Always issues one weak 4-byte `st.global.f32`."""
    _asm(None, [_i64(addr, loc, ip), _f32(value, loc, ip)], "st.global.f32 [$0], $1;", "l,f", loc, ip)


@dsl_user_op
def load_shared_f32(smem, *, loc=None, ip=None) -> Float32:
    """Always issues one `ld.shared.f32` at shared address `smem`."""
    return Float32(_asm(T.f32(), [_u32(smem, loc, ip)], "ld.shared.f32 $0, [$1];", "=f,r", loc, ip))


@dsl_user_op
def load_shared_v4(smem, *, loc=None, ip=None):
    """Always issues one `ld.shared.v4.b32` at shared address `smem` (16-byte aligned); returns 4 words."""
    struct = _asm(llvm.StructType.get_literal([T.i32()] * 4), [_u32(smem, loc, ip)],
                  "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r", loc, ip)
    return tuple(Uint32(llvm.extractvalue(T.i32(), struct, [i], loc=loc, ip=ip)) for i in range(4))


#: `e2m1x8_to_e4m3x8_scaled`'s PTX ($0, $1: the e4m3 words; $2: the codes), nine integer instructions for eight codes:
#: the even codes' magnitude bits shifted to bits 2-4 and their signs to bit 7 of each byte (`e`), the odd codes'
#: likewise (`o`), then `prmt` interleaves the two. Interpreted on the host by `tests/test_grouped.py`.
E2M1X8_TO_E4M3X8_PTX = (
    "{ .reg .b32 t, u, e, o; "
    "shl.b32 t, $2, 2; shl.b32 u, $2, 4; and.b32 u, u, 0x80808080; lop3.b32 e, t, 0x1C1C1C1C, u, 0xEA; "
    "shr.b32 t, $2, 2; and.b32 u, $2, 0x80808080; lop3.b32 o, t, 0x1C1C1C1C, u, 0xEA; "
    "prmt.b32 $0, e, o, 0x5140; prmt.b32 $1, e, o, 0x7362; }")


@dsl_user_op
def e2m1x8_to_e4m3x8_scaled(codes, *, loc=None, ip=None):
    """The eight e2m1 codes of `codes` (code `i` in bits `4 i .. 4 i + 3`, bit 3 its sign) as eight e4m3 bytes, code
    `i` in byte `i % 4` of word `i // 4`, each `2^-6` times the code's value: exact, -0 kept. Guarantee: byte =
    (magnitude bits << 2) | (sign << 7), which is e2m1's exponent and mantissa in e4m3's low exponent and high
    mantissa bits (0.5 the subnormal 2^-7, 6 = 1.5 * 2^-4); `E2M1X8_TO_E4M3X8_PTX`."""
    struct = _asm(llvm.StructType.get_literal([T.i32()] * 2), [_u32(codes, loc, ip)], E2M1X8_TO_E4M3X8_PTX,
                  "=r,=r,r", loc, ip)
    return tuple(Uint32(llvm.extractvalue(T.i32(), struct, [i], loc=loc, ip=ip)) for i in range(2))


def e2m1x8_to_e4m3x8_scaled_model(codes: int) -> tuple[int, int]:
    """`e2m1x8_to_e4m3x8_scaled`'s two words for a Python int (the host model the tests check the bytes against)."""
    out = 0
    for i in range(8):
        nib = (codes >> (4 * i)) & 0xF
        out |= (((nib & 7) << 2) | ((nib & 8) << 4)) << (8 * i)
    return out & 0xFFFFFFFF, out >> 32

