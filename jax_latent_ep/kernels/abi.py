"""The one declaration of the kernel ABI: each kernel's parameters, the error codes, the status record, the limits.

Everything else derives from this module: the kernels' launch signatures are checked against it when they are
compiled (`check_signature`), the build manifest records `Kernel.signature()`, the Python FFI wrapper checks the
manifest against it, the backends and the model checker take their error codes and messages from it, and the C
header `ep_abi.h` that the FFI library includes is generated from it (`header()`; `python -m
jax_latent_ep.kernels.abi --header PATH`), so a parameter added on one side only fails the C++ build (designated
initializers in declaration order, every field required) or the manifest check. `docs/kernel_abi.md` carries the
generated tables (`markdown()`; a test compares them).

Pure Python: no JAX, no cutlass.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

# ---------------------------------------------------------------------------------------------------------
# Limits

#: Largest number of ranks: rank masks are 32-bit and the peer table has one entry per rank.
NUM_MAX_RANKS = 32
#: Largest top-k: one warp lane per expert id of a token.
NUM_MAX_TOPK = 32
#: Bits of the token field of the source word `(rank << TOKEN_BITS) | token`.
TOKEN_BITS = 16
#: Tokens per rank must be below this (`2 ** TOKEN_BITS`).
NUM_MAX_TOKENS_EXCLUSIVE = 1 << TOKEN_BITS
#: Receive rows per source block: `stride(max_tokens) = ceil(max_tokens / ROW_BLOCK) * ROW_BLOCK`.
ROW_BLOCK = 8
#: Elements per MXFP8 scale block.
MX_BLOCK = 32
#: The source word of an empty receive row (int32 -1).
EMPTY_SOURCE = -1
#: The grouped GEMM's tiles: pairs of one work item, columns of one CTA (gate and up: 32 each), contraction step
#: (`num_k`, `num_n` and `k_per_split` are multiples of the last two), and int32 words of one work item.
GEMM_BLOCK_M = 64
GEMM_BLOCK_N = 64
GEMM_BLOCK_K = 64
GEMM_WORK_WORDS = 4
#: The FP8-weight grouped GEMM: columns of one CTA, and the block of one FP32 weight scale (rows and columns).
GEMM_FP8_BLOCK_N = 128
GEMM_FP8_SCALE_BLOCK = 128
#: The one-launch expert stage (`EXPERT_STAGE`): every work item has at most `STAGE_DIRECT_PAIRS` pairs (one MMA
#: row tile) and `k_gate <= STAGE_DIRECT_K`, so a gate / up unit's slice of its rows fits its `a` region and the
#: unit dequantizes it there itself.
STAGE_DIRECT_PAIRS = 16
STAGE_DIRECT_K = 512
#: Most local experts the expert plan kernel takes (its per-expert counters live in shared memory).
NUM_MAX_PLAN_EXPERTS = 2048
#: Words of the plan kernel's per-expert row bitmaps (`J * ceil(R / 32)` must not exceed it).
NUM_PLAN_BITMAP_WORDS = 24576
#: Threads of the expert plan kernel's one CTA.
PLAN_THREADS = 1024
#: Pairs of one item of the plan kernel's work list it takes (powers of two): the grouped GEMM's `GEMM_BLOCK_M` and
#: the FP8 grouped matmul's tiles, so either reads the plan's list with no list of its own to build.
PLAN_WORK_PAIRS = (8, 16, 32, 64)
#: Columns of one CTA of the row-sum kernel (`num_l` is a multiple of 4; a row takes `ceil(num_l / 512)` CTAs).
ROW_SUM_COLUMNS = 512
#: The grouped matmul (`kernels/grouped_matmul.py`): pairs of one tile, columns of one CTA, contraction of a stage,
#: words of a tile of the list.
MATMUL_TILE_M = 128
MATMUL_TILE_N = 128
#: Columns of one CTA of the grouped matmul's forward (twice `MATMUL_TILE_N`: `num_n` a multiple of `MATMUL_TILE_N`,
#: the last CTA of a row may have half; a SwiGLU block half gate's columns, half up's).
MATMUL_FORWARD_TILE_N = 256
#: Columns of one block of the grouped matmul's weights' gradient (`num_n` a multiple of `MATMUL_TILE_N`, the last
#: block of a row may have half).
MATMUL_WGRAD_TILE_N = 256
MATMUL_TILE_K = 64
MATMUL_TILE_WORDS = 4
#: CTAs the weights' gradient aims at (its launcher gives each CTA that many fewer 128 x 128 blocks of dw, at least
#: one, the ring running on across them): enough for every SM to take several in turn.
MATMUL_WGRAD_CTAS = 1024
#: Pairs of one tile of the FP8 grouped matmul (its `wgmma` n), and of its variants' smaller tiles.
MATMUL_FP8_TILE_PAIRS = 32
MATMUL_FP8_SMALL_TILE_PAIRS = (16, 8)
#: Pairs of one tile of the FP8 grouped matmul of prefill sizes (`grouped_matmul_fp8_wide`: `wgmma`'s m, two
#: warpgroups of 64).
MATMUL_FP8_WIDE_TILE_PAIRS = 128

# ---------------------------------------------------------------------------------------------------------
# Kernel parameters

#: C types of the kernels' scalar parameters: (manifest name, C type, bytes).
CTYPES = {"i64": "int64_t", "i32": "int32_t", "f32": "float"}


@dataclasses.dataclass(frozen=True)
class Param:
    """One kernel parameter.

    Attributes:
      name: the parameter's name (the same in the kernel, the manifest and the C header).
      ctype: "i64", "i32" or "f32" (every parameter is a scalar; device buffers are passed as i64 addresses).
      address: True if the value is a device address (an XLA buffer, the peer table, the status record).
      meaning: what it holds, with its dtype and shape for buffers.
    """

    name: str
    ctype: str
    address: bool
    meaning: str

    def __post_init__(self):
        if self.ctype not in CTYPES:
            raise ValueError(f"{self.name}: ctype={self.ctype!r} must be one of {sorted(CTYPES)}")
        if self.address and self.ctype != "i64":
            raise ValueError(f"{self.name}: an address is an i64")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of the ABI: its op name, its cubin symbol and its parameters in order."""

    op: str
    symbol: str
    params: tuple[Param, ...]
    #: The op whose parameters (and C struct) these are, when they are another kernel's.
    params_of: str | None = None
    #: The archs it is built for, when not every one (`wgmma` is sm_90a's); None: all.
    archs: tuple[str, ...] | None = None

    def signature(self) -> tuple[tuple[str, str], ...]:
        """`((name, ctype), ...)` in order: what the manifest records and the FFI wrapper checks."""
        return tuple((p.name, p.ctype) for p in self.params)

    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)


def _address(name, meaning):
    return Param(name, "i64", True, meaning)


_PEERS = _address("peers", "int64 [N + 1]: every rank's buffer base as this rank maps it, then its own")
_STATUS = _address("status", "int32 [4] host-mapped error record (`STATUS_FIELDS`), or 0")
_TIMEOUT = Param("timeout_ns", "i64", False, "bound of every wait in nanoseconds; 0 waits forever")
_RANK = Param("rank", "i32", False, "this rank, 0 <= rank < N")
_TOKENS = Param("tokens", "i32", False, "T, this call's tokens per rank, 1 <= T <= max_tokens")
_PEER_TOKENS = Param("peer_tokens", "i32", False, "rows of every source that carry anything (>= T, the same on "
                     "every rank of the call; the FFI passes T)")
_MAX_TOKENS = Param("max_tokens", "i32", False, "the buffer's max_tokens (fixes the layout's offsets)")

DISPATCH = Kernel("dispatch", "ep_dispatch", (
    _address("x", "bf16 [T, L]: this rank's tokens"),
    _address("ids", "int32 [T, K]: their expert ids"),
    _address("weights", "f32 [T, K]: their routing weights"),
    _PEERS,
    _address("recv_x", "float8_e4m3fn [N*S, L]: received MXFP8 elements (output)"),
    _address("recv_sf", "uint8 [N*S, L/32]: their E8M0 scales (output)"),
    _address("recv_ids", "int32 [N*S, K] (output)"),
    _address("recv_weights", "f32 [N*S, K] (output)"),
    _address("recv_src", "int32 [N*S]: (rank << 16) | token, or -1 (output)"),
    _STATUS,
    _TIMEOUT,
    _RANK,
    _TOKENS,
    _PEER_TOKENS,
    _MAX_TOKENS,
))

COMBINE = Kernel("combine", "ep_combine", (
    _address("out", "bf16 [N*S, L]: the expert output of every receive row"),
    _address("ids", "int32 [T, K]: this rank's ids (the dispatch's)"),
    _address("norm_weight", "bf16 [L]: RMSNorm weight (read only if apply_norm)"),
    _address("result", "bf16 [T, L]: routed latent, or its RMSNorm (output)"),
    _PEERS,
    _STATUS,
    _TIMEOUT,
    Param("eps", "f32", False, "RMSNorm epsilon"),
    _RANK,
    _TOKENS,
    _PEER_TOKENS,
    _MAX_TOKENS,
    Param("apply_norm", "i32", False, "1: RMSNorm the routed latent, 0: return it"),
))

#: The expert stage's grouped GEMM (`kernels/grouped_gemm.py`): for the rows of each work item (pairs of one group),
#: `a[rows] @ w[group]` (FP32 accumulation) as per-split FP32 partials, or with `fuse_glu` the SwiGLU of gate (`w`)
#: and up (`w_second`) rounded to BF16. No peers, no status record.
GROUPED_GEMM = Kernel("grouped_gemm", "ep_grouped_gemm", (
    _address("a", "bf16 (FP8 kernel: float8_e4m3fn, MXFP8 with `a_scale`) [R, num_k]: the activations (rows of "
             "`a_rows`, or the pairs themselves)"),
    _address("a_rows", "int32 [P]: the row of `a` of each pair, or 0: pair p reads row p"),
    _address("a_scale", "FP8 kernel: uint8 [R, num_k / 32], the E8M0 scale of each 32 elements of `a` (unread by the "
             "BF16 kernel)"),
    _address("w", "bf16 (FP8 kernel: float8_e4m3fn) [G, num_k, num_n]: each group's weights (the gate with "
             "`w_second`)"),
    _address("w_second", "as `w`: the up weights, or 0"),
    _address("w_scale", "FP8 kernel: f32 [G, num_k / 128, num_n / 128], `w`'s scale per 128 x 128 block (unread by "
             "the BF16 kernel)"),
    _address("w_second_scale", "FP8 kernel: `w_second`'s block scales, as `w_scale`"),
    _address("work", "int32 [num_work, 4]: (group, first pair, pairs <= 64, non-empty items) per work item, the non-empty first; pairs 0: none"),
    _address("out", "without fuse_glu f32 [num_splits, P, num_n] (one weight) or [num_splits, P, 2 num_n] (gate and "
             "up interleaved by 64 columns, FP8 kernel 128); with fuse_glu bf16 [P, num_n]; pairs outside every work item untouched "
             "(output)"),
    Param("num_k", "i32", False, "contraction length, a multiple of 64"),
    Param("num_n", "i32", False, "columns of one weight, a multiple of 64 (FP8 kernel: 128)"),
    Param("num_rows", "i32", False, "P, pairs (rows of each split of `out`)"),
    Param("num_work", "i32", False, "work items"),
    Param("k_per_split", "i32", False, "contraction length of each split, a multiple of 64 (FP8 kernel: 128)"),
    Param("fuse_glu", "i32", False, "1: `out` = bf16(silu(gate) * up) (needs w_second and one split), 0: partials"),
))

#: The grouped GEMM of MXFP8 activations and FP8 weights with FP32 block scales (`kernels/grouped_gemm.py`, its own
#: cubin): the same parameters, `num_k`, `num_n` and `k_per_split` multiples of 128.
GROUPED_GEMM_FP8 = Kernel("grouped_gemm_fp8", "ep_grouped_gemm_fp8", GROUPED_GEMM.params, params_of="grouped_gemm")

#: The expert stage's SwiGLU MLP on the MXFP8 receive rows in one launch (`kernels/grouped_gemm.py` ExpertStage,
#: BF16 weights, work items of at most STAGE_DIRECT_PAIRS pairs): gate / up units that dequantize their own rows'
#: slice, and down units that wait only for the counts they read (no kernel boundary). R receive rows, P pairs;
#: J, L, I: local experts, latent, intermediate; S1 / S2 the gate / up and down splits.
EXPERT_STAGE = Kernel("expert_stage", "ep_expert_stage", (
    _address("x", "float8_e4m3fn [R, num_l]: the receive rows' MXFP8 elements"),
    _address("sf", "uint8 [R, num_l / 32]: their E8M0 scales"),
    _address("a_rows", "int32 [P]: the receive row of each pair (the plan's pair_row)"),
    _address("w_gate", "bf16 [J, num_l, num_i]"),
    _address("w_up", "bf16 [J, num_l, num_i]"),
    _address("w_down", "bf16 [J, num_i, num_l]"),
    _address("work", "int32 [num_work, 4]: the work list, as the grouped GEMM's"),
    _address("counts", "int32 [1 + num_work (1 + num_i / 64)]: zero on entry; per item the tiles of `h` stored, per "
             "(item, tile) the gate / up splits stored, the units taken (output)"),
    _address("parts", "f32 [S1, P, 2 num_i]: gate / up partials interleaved by 64 columns (S1 > 1; output, scratch)"),
    _address("h", "bf16 [P, num_i]: silu(gate) * up of each pair (output, scratch)"),
    _address("y", "f32 [S2, P, num_l]: down's partials; pairs outside every work item untouched (output)"),
    Param("num_l", "i32", False, "L, a multiple of 128"),
    Param("num_i", "i32", False, "I, a multiple of 64"),
    Param("num_rows", "i32", False, "P, pairs; each work item at most STAGE_DIRECT_PAIRS of them"),
    Param("num_work", "i32", False, "work items"),
    Param("k_gate", "i32", False, "contraction length of each gate / up split, a multiple of 64, <= STAGE_DIRECT_K"),
    Param("k_down", "i32", False, "contraction length of each down split, a multiple of 64"),
))

#: The expert stage's plan (`kernels/expert_plan.py`, one CTA): the (row, local expert) pairs of one rank's receive
#: rows grouped by local expert, the way back and the grouped GEMM's work list, exactly as `experts.plan` and
#: `experts.work_items` compute them in XLA. C = capacity, M = min(K, J).
EXPERT_PLAN = Kernel("expert_plan", "ep_expert_plan", (
    _address("ids", "int32 [R, K]: the receive rows' expert ids"),
    _address("weights", "f32 [R, K]: their routing weights"),
    _address("src", "int32 [R]: the receive rows' source words, -1 in empty rows"),
    _address("rank", "int32 [1]: this rank (an id is local when id // J == rank)"),
    _address("pair_row", "int32 [C]: the receive row of each pair, 0 in unused pairs (output)"),
    _address("pair_expert", "int32 [C]: the local expert of each pair, J in unused pairs (output)"),
    _address("pair_weight", "f32 [C]: the pair's routing weight, 0 in unused pairs (output)"),
    _address("group_sizes", "int32 [J]: pairs per local expert (output)"),
    _address("count", "int32 [1]: pairs used (output)"),
    _address("row_pairs", "int32 [R, M]: the pair of each row's m-th local expert, or C (output)"),
    _address("work", "int32 [num_work, 4]: the work list, items of at most 2^work_shift pairs (output)"),
    _address("scratch", "int32 [3, R*K]: the pairs, each warp in its rows' slots: row, local expert | rank in its "
             "row << 16, weight (output, unused)"),
    Param("num_rows", "i32", False, "R, receive rows"),
    Param("topk", "i32", False, "K, ids per row, <= 32"),
    Param("num_local_experts", "i32", False, "J, <= NUM_MAX_PLAN_EXPERTS, J * ceil(R / 32) <= NUM_PLAN_BITMAP_WORDS"),
    Param("rows_per_source", "i32", False, "S, rows of one source block"),
    Param("max_tokens", "i32", False, "rows t >= max_tokens of a source block are never planned"),
    Param("capacity", "i32", False, "C, pairs"),
    Param("num_work", "i32", False, "work items"),
    Param("work_shift", "i32", False, "log2 of the pairs of one work item, one of PLAN_WORK_PAIRS"),
))

#: The expert stage's last step (`kernels/row_sum.py`): each receive row's sum over its pairs of the pair's
#: routing weight times its output (the FP32 sum of down's split partials), rounded to bf16, exactly as
#: `experts._row_sums` computes it in XLA. R receive rows, P pairs, M = min(K, J) slots a row.
ROW_SUM = Kernel("row_sum", "ep_row_sum", (
    _address("parts", "f32 [num_splits, P, num_l]: down's partials of each pair (unused pairs never read)"),
    _address("row_pairs", "int32 [R, M]: the pair of each row's m-th local expert, or >= count (the plan's)"),
    _address("pair_weight", "f32 [P]: each pair's routing weight (the plan's)"),
    _address("count", "int32 [1]: pairs used (the plan's): a slot is used when its pair is below it"),
    _address("out", "bf16 [R, num_l]: each row's weighted sum, 0 in rows with no used slot (output)"),
    Param("num_splits", "i32", False, "down's contraction splits, >= 1"),
    Param("num_pairs", "i32", False, "P, pairs (rows of each split of `parts`)"),
    Param("num_rows", "i32", False, "R, receive rows"),
    Param("num_slots", "i32", False, "M, slots a row, <= 32"),
    Param("num_l", "i32", False, "L, a multiple of 4"),
))

#: The FP8 / MXFP4 expert stage's SwiGLU (`kernels/swiglu_mxfp8.py`): for each used pair, gate and up (the FP32 sums
#: of their split partials in split order), `h = bf16(silu(gate) * up)` and `h` rounded to MXFP8 (down's rows).
SWIGLU_MXFP8 = Kernel("swiglu_mxfp8", "ep_swiglu_mxfp8", (
    _address("gate", "f32 [S, P, row_stride]: gate's split partials in columns 0 .. num_i of each row"),
    _address("up", "f32: up's partials, rows as `gate`'s (a second array, or `gate` + num_i for fused gate-up)"),
    _address("count", "int32 [1]: pairs used (the plan's): rows at or past it are never read or written"),
    _address("q", "float8_e4m3fn [P, num_i]: h's MXFP8 elements (output)"),
    _address("sf", "uint8 [P, num_i / 32]: h's E8M0 scales (output)"),
    Param("num_splits", "i32", False, "S, contraction splits of gate and up, >= 1"),
    Param("num_pairs", "i32", False, "P, pairs (rows of each split)"),
    Param("num_i", "i32", False, "I, a multiple of 128"),
    Param("row_stride", "i32", False, "FP32 elements of a row of `gate` and `up`: num_i, or 2 num_i (fused)"),
), archs=("sm_90a",))

#: The grouped matmul of training and prefill sizes (`kernels/grouped_matmul.py`, sm_90a `wgmma`): for each tile of
#: the list, `x[first:first + pairs] @ w[group]` (FP32 accumulation) rounded to BF16.
GROUPED_MATMUL = Kernel("grouped_matmul", "ep_grouped_matmul", (
    _address("x", "bf16 [R, num_k]: the pairs' rows, sorted by group (R = P), or rows `x_rows` names"),
    _address("x_rows", "int32 [P]: the row of `x` of each pair, or 0: pair p reads row p"),
    _address("w", "bf16 [G, num_k, num_n] (`w_k_major` 0) or [G, num_n, num_k] (1): each group's weight"),
    _address("tiles", "int32 [num_tiles, 4]: (group, first pair, pairs <= 128, used tiles) per tile, the used "
             "first; pairs 0: none"),
    _address("out", "bf16 [P, num_n]: rows of the tiles' pairs written, the others untouched (output); with "
             "`w_up`, `h = bf16(silu(gate) * up)` of the bf16 `gate = x @ w[g]`, `up = x @ w_up[g]`"),
    _address("w_up", "bf16 [G, num_k, num_n]: the SwiGLU's up weight (`w` its gate, `w_k_major` 0), or 0: none"),
    _address("gate_up", "bf16 [P, 2 num_n]: with `w_up`, the bf16 `gate` and `up`, blocks of h = "
             "MATMUL_FORWARD_TILE_N / 2 columns alternating (gate's block b at columns 2 h b, up's at 2 h b + h), "
             "the tiles' rows written (output), or 0: none"),
    Param("num_k", "i32", False, "contraction length, a multiple of 64"),
    Param("num_n", "i32", False, "columns, a multiple of 128"),
    Param("num_tiles", "i32", False, "tiles of the list"),
    Param("w_k_major", "i32", False, "1: `w` is [G, num_n, num_k] (out = x @ w[g].T), 0: [G, num_k, num_n]"),
), archs=("sm_90a",))

#: The weights' gradient of the grouped matmul (`kernels/grouped_matmul.py`, sm_90a `wgmma`): for each group,
#: `x_g^T @ dy_g` over its pairs (FP32 accumulation) rounded to BF16; 0 for an empty group.
GROUPED_MATMUL_WGRAD = Kernel("grouped_matmul_wgrad", "ep_grouped_matmul_wgrad", (
    _address("x", "bf16 [P, num_k]: the pairs' rows, sorted by group"),
    _address("dy", "bf16 [P, num_n]: the output's cotangent, the same rows"),
    _address("groups", "int32 [num_groups, 2]: (first pair, pairs) of each group"),
    _address("dw", "bf16 [num_groups, num_k, num_n]: each group's gradient (output)"),
    Param("num_k", "i32", False, "rows of each group's gradient, a multiple of 128"),
    Param("num_n", "i32", False, "columns, a multiple of 128"),
    Param("num_groups", "i32", False, "groups"),
    Param("tiles_per_cta", "i32", False, "MATMUL_WGRAD_TILE_N-column blocks of dw each CTA computes in turn, >= 1"),
), archs=("sm_90a",))

def _narrow_matmul(op: str, w: str, w_scale: str) -> Kernel:
    """The grouped matmul of decode sizes on FP8 tensor cores (`kernels/grouped_matmul_fp8.py`, sm_90a `wgmma`
    e4m3) whose weights are described by `w` and `w_scale`: the weights the 64-row side, a tile's pairs the narrow
    one; each 32-deep block's product promoted into FP32 with its two scales."""
    return Kernel(op, "ep_" + op, (
        _address("x", "float8_e4m3fn [R, num_k]: MXFP8 elements, a row a pair (sorted by group) or rows `x_rows` "
                 "names"),
        _address("x_scale", "uint8 [R, num_k / 32]: their E8M0 scales (2^(s - 127); 0: the block is 0)"),
        _address("x_rows", "int32 [P]: the row of `x` of each pair, or 0: pair p reads row p"),
        _address("w", w),
        _address("w_scale", w_scale),
        _address("w_second", "as `w`: a second weight (up beside gate), or 0"),
        _address("w_second_scale", "as `w_scale`: its scales (unread without `w_second`)"),
        _address("tiles", "int32 [num_tiles, 4]: (group, first pair, pairs <= MATMUL_FP8_TILE_PAIRS, used tiles) "
                 "per tile, the used first; pairs 0: none"),
        _address("out", "f32 [S, P, num_n] (`w_second` 0) or [S, P, 2 num_n] (`w`'s columns, then `w_second`'s): "
                 "split s's partial (contraction `s k_per_split ..`) in `out[s]`; rows of the tiles' pairs written, "
                 "the others untouched (output)"),
        Param("num_k", "i32", False, "contraction length, a multiple of 128"),
        Param("num_n", "i32", False, "columns, a multiple of 128"),
        Param("num_tiles", "i32", False, "tiles of the list"),
        Param("num_rows", "i32", False, "P, pairs (rows of each split of `out`)"),
        Param("k_per_split", "i32", False, "contraction length of each of the S splits, a multiple of 128"),
    ), archs=("sm_90a",))


#: FP8 block-scaled weights (`experts.BlockScaledOutIn`).
GROUPED_MATMUL_FP8 = _narrow_matmul(
    "grouped_matmul_fp8", "float8_e4m3fn [G, num_n, num_k]: each group's weight, `[out, in]` (K-major)",
    "f32 [G, num_n / 128, num_k / 128]: a scale per 128 x 128 block of `w`")
#: MXFP4 weights (`experts.MXFP4`), widened to e4m3 in shared memory; the promotion takes the weight row's E8M0 scale.
GROUPED_MATMUL_MXFP4 = _narrow_matmul(
    "grouped_matmul_mxfp4", "uint8 [G, num_n, num_k / 2]: each group's e2m1 codes, `[out, in]`, the even input low",
    "uint8 [G, num_n, num_k / 32]: an E8M0 scale per 32 inputs of an output")
#: Their variants of smaller tiles (`<op>_n<pairs>`, `m64n<pairs>k32`, `MATMUL_FP8_SMALL_TILE_PAIRS`), for a few
#: pairs an expert: the same parameters, tiles of at most that many pairs.
NARROW_VARIANTS = tuple(Kernel(f"{k.op}_n{p}", f"{k.symbol}_n{p}", k.params, params_of=k.op, archs=("sm_90a",))
                        for k in (GROUPED_MATMUL_FP8, GROUPED_MATMUL_MXFP4) for p in MATMUL_FP8_SMALL_TILE_PAIRS)
#: The FP8 kernel of prefill sizes (`kernels/grouped_matmul_fp8_wide.py`): its parameters, tiles of at most
#: `MATMUL_FP8_WIDE_TILE_PAIRS` pairs, a tile's pairs `wgmma`'s 64-row side.
GROUPED_MATMUL_FP8_WIDE = Kernel("grouped_matmul_fp8_wide", "ep_grouped_matmul_fp8_wide", GROUPED_MATMUL_FP8.params,
                                 params_of=GROUPED_MATMUL_FP8.op, archs=("sm_90a",))
#: Its SwiGLU form: gate and up of the same columns in one unit, `h = bf16(silu(gate) * up)` out in MXFP8 (the FP8
#: stage's `swiglu_mxfp8` in the epilogue), the contraction unsplit.
GROUPED_MATMUL_FP8_WIDE_GLU = Kernel("grouped_matmul_fp8_wide_glu", "ep_grouped_matmul_fp8_wide_glu", (
    *GROUPED_MATMUL_FP8.params[:5],
    _address("w_second", "as `w`: up's weight (`w` gate's)"),
    _address("w_second_scale", "as `w_scale`: up's scales"),
    _address("tiles", "int32 [num_tiles, 4]: (group, first pair, pairs <= MATMUL_FP8_WIDE_TILE_PAIRS, used tiles) "
             "per tile, the used first; pairs 0: none"),
    _address("q", "float8_e4m3fn [P, num_n]: h's MXFP8 elements; rows of the tiles' pairs written (output)"),
    _address("sf", "uint8 [P, num_n / 32]: their E8M0 scales; rows of the tiles' pairs written (output)"),
    Param("num_k", "i32", False, "contraction length, a multiple of 128"),
    Param("num_n", "i32", False, "columns of gate, of up and of h, a multiple of 128"),
    Param("num_tiles", "i32", False, "tiles of the list"),
    Param("num_rows", "i32", False, "P, pairs (rows of q)"),
), archs=("sm_90a",))

KERNELS = {k.op: k for k in (DISPATCH, COMBINE, GROUPED_GEMM, GROUPED_GEMM_FP8, EXPERT_STAGE, EXPERT_PLAN, ROW_SUM,
                             GROUPED_MATMUL, GROUPED_MATMUL_WGRAD, GROUPED_MATMUL_FP8, GROUPED_MATMUL_MXFP4,
                             *NARROW_VARIANTS, GROUPED_MATMUL_FP8_WIDE,
                             GROUPED_MATMUL_FP8_WIDE_GLU, SWIGLU_MXFP8)}


def c_name(op: str) -> str:
    """The C name stem of an op: "grouped_gemm" -> "GroupedGemm"."""
    return "".join(w.capitalize() for w in op.split("_"))


def check_signature(op: str, names: list[str], ctypes: list[str]) -> None:
    """Raises ValueError unless a kernel's launch parameters (`names`, and their ctypes) are `KERNELS[op]`'s."""
    want = KERNELS[op].signature()
    have = tuple(zip(names, ctypes))
    if have != want:
        raise ValueError(f"the {op} kernel's parameters {list(have)} differ from kernels/abi.py's {list(want)}")


# ---------------------------------------------------------------------------------------------------------
# Error codes and the status record


@dataclasses.dataclass(frozen=True)
class ErrorCode:
    """One kernel error code.

    Attributes:
      code: the value in the record's `code` field (nonzero).
      name: the constant's name (`ERROR_<name>` in Python, `EP_ERROR_<name>` in C).
      message: what happened, with `{rank}`, `{peer}` and `{layer}` filled in from the record.
      layer_offset: added to the record's layer (mod 2**32) before it is printed: a combine without its dispatch
        records the last dispatched layer; it was called in the next one.
    """

    code: int
    name: str
    message: str
    layer_offset: int = 0


ERRORS = (
    ErrorCode(1, "DISPATCH_TIMEOUT", "dispatch on rank {rank} timed out waiting for rank {peer} at layer {layer}"),
    ErrorCode(2, "COMBINE_TIMEOUT", "combine on rank {rank} timed out waiting for rank {peer} at layer {layer}"),
    ErrorCode(3, "DISPATCH_TWICE", "dispatch called twice without a combine on rank {rank} at layer {layer}"),
    ErrorCode(4, "COMBINE_WITHOUT_DISPATCH", "combine called without its dispatch on rank {rank} at layer {layer}",
              layer_offset=1),
)
#: The message of a code not in ERRORS.
UNKNOWN_ERROR = "unknown error on rank {rank} (peer {peer}) at layer {layer}"

ERROR_NONE = 0
ERROR_DISPATCH_TIMEOUT = 1
ERROR_COMBINE_TIMEOUT = 2
ERROR_DISPATCH_TWICE = 3
ERROR_COMBINE_WITHOUT_DISPATCH = 4
ERROR_BY_CODE = {e.code: e for e in ERRORS}
assert all(globals()[f"ERROR_{e.name}"] == e.code for e in ERRORS)

#: The host-mapped status record a failing kernel writes (int32 each, `code` last, after a fence).
STATUS_FIELDS = ("code", "rank", "peer", "layer")
STATUS_CODE, STATUS_RANK, STATUS_PEER, STATUS_LAYER = range(len(STATUS_FIELDS))
STATUS_WORDS = len(STATUS_FIELDS)


def describe_error(record) -> str:
    """What a nonzero status record `(code, rank, peer, layer)` says, e.g. "dispatch on rank 0 timed out waiting
    for rank 1 at layer 3 (error code 1)"."""
    code, rank, peer, layer = (int(v) for v in record)
    error = ERROR_BY_CODE.get(code)
    text = error.message if error else UNKNOWN_ERROR
    layer = (layer + (error.layer_offset if error else 0)) % (1 << 32)
    return f"{text.format(rank=rank, peer=peer, layer=layer)} (error code {code})"


# ---------------------------------------------------------------------------------------------------------
# The C header and the documentation tables


def _c_message(text: str) -> str:
    """A message template as a C string literal with `%d` / `%u` for rank, peer and layer, in that order."""
    for field in ("{rank}", "{peer}", "{layer}"):
        if text.count(field) > 1:
            raise ValueError(f"{field} appears twice in {text!r}")
    order = sorted((text.index(f), f) for f in ("{rank}", "{peer}", "{layer}") if f in text)
    if [f for _, f in order] != [f for f in ("{rank}", "{peer}", "{layer}") if f in text]:
        raise ValueError(f"{text!r}: fields must appear in the order rank, peer, layer")
    return '"' + text.replace("{rank}", "%d").replace("{peer}", "%d").replace("{layer}", "%u") + '"'


def header() -> str:
    """The C header `ep_abi.h`: limits, error codes and messages, the status record, and each kernel's parameters as
    a struct (fields in ABI order) with a visitor that passes them in order to the launcher."""
    lines = [
        "// Generated by `python -m jax_latent_ep.kernels.abi --header` from jax_latent_ep/kernels/abi.py: do not edit.",
        "#pragma once",
        "#include <cstddef>",
        "#include <cstdint>",
        "",
        "namespace ep_abi {",
        "",
        f"constexpr int kMaxRanks = {NUM_MAX_RANKS};",
        f"constexpr int kMaxTopk = {NUM_MAX_TOPK};",
        f"constexpr int kTokenBits = {TOKEN_BITS};",
        f"constexpr int kMaxTokensExclusive = {NUM_MAX_TOKENS_EXCLUSIVE};",
        f"constexpr int kRowBlock = {ROW_BLOCK};",
        f"constexpr int kMxBlock = {MX_BLOCK};",
        f"constexpr int kGemmBlockM = {GEMM_BLOCK_M};",
        f"constexpr int kGemmBlockN = {GEMM_BLOCK_N};",
        f"constexpr int kGemmBlockK = {GEMM_BLOCK_K};",
        f"constexpr int kGemmWorkWords = {GEMM_WORK_WORDS};",
        f"constexpr int kGemmFp8BlockN = {GEMM_FP8_BLOCK_N};",
        f"constexpr int kGemmFp8ScaleBlock = {GEMM_FP8_SCALE_BLOCK};",
        f"constexpr int kStageDirectPairs = {STAGE_DIRECT_PAIRS};",
        f"constexpr int kStageDirectK = {STAGE_DIRECT_K};",
        f"constexpr int kPlanMaxExperts = {NUM_MAX_PLAN_EXPERTS};",
        f"constexpr int kPlanThreads = {PLAN_THREADS};",
        f"constexpr int kPlanBitmapWords = {NUM_PLAN_BITMAP_WORDS};",
        f"constexpr int kPlanMinWorkPairs = {min(PLAN_WORK_PAIRS)};",
        f"constexpr int kPlanMaxWorkPairs = {max(PLAN_WORK_PAIRS)};",
        f"constexpr int kRowSumColumns = {ROW_SUM_COLUMNS};",
        f"constexpr int kMatmulTileM = {MATMUL_TILE_M};",
        f"constexpr int kMatmulTileN = {MATMUL_TILE_N};",
        f"constexpr int kMatmulForwardTileN = {MATMUL_FORWARD_TILE_N};",
        f"constexpr int kMatmulWgradTileN = {MATMUL_WGRAD_TILE_N};",
        f"constexpr int kMatmulTileK = {MATMUL_TILE_K};",
        f"constexpr int kMatmulTileWords = {MATMUL_TILE_WORDS};",
        f"constexpr int kMatmulWgradCtas = {MATMUL_WGRAD_CTAS};",
        f"constexpr int kMatmulFp8TilePairs = {MATMUL_FP8_TILE_PAIRS};",
        f"constexpr int kMatmulFp8WideTilePairs = {MATMUL_FP8_WIDE_TILE_PAIRS};",
        "// Receive rows per source rank: ceil(max_tokens / kRowBlock) * kRowBlock.",
        "constexpr int stride(int max_tokens) { return (max_tokens + kRowBlock - 1) / kRowBlock * kRowBlock; }",
        "",
        "// The host-mapped status record a failing kernel writes (int32 each).",
    ]
    lines += [f"constexpr int kStatus{f.capitalize()} = {i};" for i, f in enumerate(STATUS_FIELDS)]
    lines += [f"constexpr int kStatusWords = {STATUS_WORDS};", "", "constexpr int32_t kErrorNone = 0;"]
    lines += [f"constexpr int32_t kError{''.join(w.capitalize() for w in e.name.split('_'))} = {e.code};"
              for e in ERRORS]
    lines += [
        "",
        "struct ErrorMessage {",
        "  int32_t code;",
        "  uint32_t layer_offset;",
        "  const char* format;  // printf format: rank (%d), peer (%d), layer (%u), those present, in that order",
        "  bool has_rank, has_peer, has_layer;",
        "};",
        "constexpr ErrorMessage kErrorMessages[] = {",
    ]
    for e in ERRORS:
        flags = ", ".join("true" if "{" + f + "}" in e.message else "false" for f in ("rank", "peer", "layer"))
        lines.append(f"    {{{e.code}, {e.layer_offset}u, {_c_message(e.message)}, {flags}}},")
    lines += ["};", f"constexpr ErrorMessage kUnknownError = {{0, 0u, {_c_message(UNKNOWN_ERROR)}, true, true, true}};", ""]
    for kernel in KERNELS.values():
        struct = c_name(kernel.op) + "Params"
        lines.append(f"// Parameters of `{kernel.symbol}`, in order.")
        lines.append(f"struct {struct} {{")
        for p in kernel.params:
            lines.append(f"  {CTYPES[p.ctype]} {p.name};  // {'address: ' if p.address else ''}{p.meaning}")
        lines.append("};")
        lines.append(f"constexpr int k{struct}Count = {len(kernel.params)};")
        lines.append(f"constexpr const char* k{c_name(kernel.op)}Symbol = \"{kernel.symbol}\";")
        lines.append("// Calls visit(value, is_address) for every parameter of `p`, in order.")
        lines.append("template <class Visit>")
        lines.append(f"constexpr void visit_params(const {struct}& p, Visit&& visit) {{")
        for p in kernel.params:
            lines.append(f"  visit(p.{p.name}, {'true' if p.address else 'false'});")
        lines.append("}")
        size = sum(8 if p.ctype == "i64" else 4 for p in kernel.params)
        lines.append(f"static_assert(sizeof({struct}) >= {size}, \"{struct}: fields missing\");")
        lines.append("")
    lines.append("}  // namespace ep_abi")
    return "\n".join(lines) + "\n"


def markdown() -> str:
    """The tables of `docs/kernel_abi.md` between its generated markers: each kernel's parameters, the error codes,
    the status record, the limits."""
    out = []
    for kernel in KERNELS.values():
        if kernel.params_of:
            out += [f"`{kernel.symbol}` ({kernel.op}, its own cubin): the parameters of {kernel.params_of}.", ""]
            continue
        out += [f"`{kernel.symbol}` ({kernel.op}):", "", "| # | parameter | type | meaning |", "| --- | --- | --- | --- |"]
        out += [f"| {i} | `{p.name}` | {p.ctype} | {p.meaning.replace('|', chr(92) + '|')} |"
                for i, p in enumerate(kernel.params)]
        out.append("")
    out += ["Error codes (the status record's `code`):", "", "| code | name | message |", "| --- | --- | --- |"]
    out += [f"| {e.code} | `ERROR_{e.name}` | {e.message} |" for e in ERRORS]
    out += ["", f"Status record: int32 `{{{', '.join(STATUS_FIELDS)}}}`, `code` written last.", "",
            f"Limits: N <= {NUM_MAX_RANKS}, K <= {NUM_MAX_TOPK}, T < 2^{TOKEN_BITS}, receive rows per source a "
            f"multiple of {ROW_BLOCK}, L a multiple of {MX_BLOCK}; grouped GEMM tiles {GEMM_BLOCK_M} pairs x "
            f"{GEMM_BLOCK_N} columns x {GEMM_BLOCK_K}, {GEMM_WORK_WORDS} words a work item."]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_latent_ep.kernels.abi", description=__doc__.split("\n")[0])
    parser.add_argument("--header", metavar="PATH", help="write the C header ep_abi.h to PATH")
    parser.add_argument("--markdown", action="store_true", help="print the tables of docs/kernel_abi.md")
    args = parser.parse_args(argv)
    if args.header:
        path = pathlib.Path(args.header)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = header()
        if not path.exists() or path.read_text() != text:  # keep the timestamp: no needless C++ rebuild
            path.write_text(text)
    if args.markdown:
        sys.stdout.write(markdown())
    if not args.header and not args.markdown:
        parser.error("nothing to do: give --header PATH and/or --markdown")
    return 0


if __name__ == "__main__":
    sys.exit(main())
