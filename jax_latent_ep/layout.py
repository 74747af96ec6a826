"""The one byte layout of a rank's symmetric EP buffer (`EpLayout`), shared by host sizing and device offsets."""

from __future__ import annotations

import dataclasses

from jax_latent_ep.kernels.abi import NUM_MAX_RANKS, ROW_BLOCK
from jax_latent_ep.shapes import KIMI_K3, LatentMoEShape, check_max_tokens

#: Bytes of one cache line on the NVLink fabric; every region starts on one, and every flag and
#: source word owns one, so that no two ranks ever write the same line.
LINE = 128

# Words of the first control line (int32 each), written by this rank only. The two epoch words hand the
# layer epoch from kernel to kernel. Every thread of a kernel reads both after its griddepcontrol.wait (the
# previous kernel of the stream has completed) and checks the call's place in the sequence before any store;
# each kernel writes its word once, at its end, from the CTA that arrived last on its counter (which re-arms
# itself), so no thread ever reads a word after its own grid wrote it, and a call out of sequence writes nothing.
CTRL_EPOCH_D = 0  # epoch of the last completed layer (written by combine, read by the next dispatch)
CTRL_EPOCH_C = 1  # epoch of the current layer (written by dispatch, read by its combine)
# The arrival counters live on the second control line (words 32, 33), away from the words every thread reads.
CTRL_COUNT_D = 32  # CTAs of the running dispatch that have passed the sequence check (0 between kernels)
CTRL_COUNT_C = 33  # the same for the combine
CTRL_LAYER = CTRL_EPOCH_D  # = layers completed on this rank (the layer number in error reports)
CTRL_ERROR = 5  # 0, or an error code (kernels.abi.ERROR_*)
CTRL_ERROR_PEER = 6  # the rank whose data never came (or this rank, for a sequence error)
CTRL_ERROR_LAYER = 7  # the layer at which it happened
NUM_CTRL_WORDS = 8
# Kernel trace (debug builds only, `kernels.common.TRACE`): from ctrl offset TRACE on, TRACE_LAYERS pairs of lines
# (16 `%globaltimer` stamps, then 16 `%clock64` stamps, int64) in spare lines 16..31 of the control region.
# Stamps 0-7 are the dispatch's, 8-15 the combine's (`tools.kernel_harness.TRACE_STAMPS`).
TRACE = 2 * LINE + 16 * LINE
TRACE_LAYERS = 8

#: Bytes of one LL word: a 4-byte payload and the 4-byte epoch of the layer that wrote it, stored and loaded
#: as one 8-byte access (single-copy atomic), so a reader that sees the epoch sees the payload of that store.
LL_WORD = 8
#: Payload bytes of one LL word.
LL_PAYLOAD = 4


def stride(tokens: int) -> int:
    """Receive rows per source rank, `ceil(tokens / 8) * 8`.

    A multiple of 8, so that with the padded row pitches below no 128-byte line of the receive arrays
    holds rows of two source ranks (two remote writers of one line serialize on the fabric).
    """
    return (tokens + ROW_BLOCK - 1) & -ROW_BLOCK


def align(offset: int) -> int:
    """`offset` (>= 0) rounded up to a multiple of 128 bytes (works on Python ints and DSL integers; a mask, not
    a division, so that the kernels' address arithmetic stays short)."""
    return (offset + LINE - 1) & -LINE


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


#: Bytes of one wide LL word: 12 payload bytes and the 4-byte epoch of the layer that wrote them, stored and
#: loaded as one 16-byte `.b128` access (single-copy atomic, `kernels.memory.store_wide`). The receive rows'
#: data and the combine slots are streams of wide words: 3 of every 4 bytes on the wire are payload.
WIDE_WORD = 16
#: Payload bytes of one wide LL word (three 4-byte pieces; piece `i` of a stream is piece `i % 3` of word `i // 3`).
WIDE_PAYLOAD = 12


def wide_words(payload_bytes: int) -> int:
    """Wide LL words that carry `payload_bytes` (a multiple of 4): `ceil(payload_bytes / 12)`."""
    return (payload_bytes + WIDE_PAYLOAD - 1) // WIDE_PAYLOAD


def row_payload(shape: LatentMoEShape) -> int:
    """Payload bytes of a receive row's data stream: the `L` MXFP8 elements, then the `L / 32` E8M0 scales."""
    return shape.latent + shape.num_sf


def x_words(shape: LatentMoEShape) -> int:
    """Wide LL words of a receive row's data stream: `ceil((L + L / 32) / 12)` (Kimi K3: 308)."""
    return wide_words(row_payload(shape))


def x_pitch(shape: LatentMoEShape) -> int:
    """Bytes of a receive row's data (MXFP8 elements, then scales) in wide LL words: `x_words` words of 16 bytes
    (Kimi K3: 4928 bytes for 3696 payload bytes; 8 rows fill whole lines)."""
    return x_words(shape) * WIDE_WORD


def meta_pitch(shape: LatentMoEShape) -> int:
    """Bytes of a receive row's ids (or weights): one LL word per expert, `ceil(K / 2) * 2` words."""
    return _round_up(shape.topk, 2) * LL_WORD


#: Bytes of a receive row's header: one LL word (the source word, -1 for an empty row) and padding.
HDR_PITCH = 16


def comb_words(shape: LatentMoEShape) -> int:
    """Wide LL words of the BF16 partial in a combine slot: `ceil(2 L / 12)` (Kimi K3: 598)."""
    return wide_words(2 * shape.latent)


def comb_pitch(shape: LatentMoEShape) -> int:
    """Bytes of one combine slot: `comb_words` wide LL words, padded to whole 128-byte lines (one writer per
    line), and at least one word past the last (a reducing thread may load one word beyond its pieces):
    Kimi K3: 600 words, 9600 bytes for 7168 payload bytes."""
    return _round_up(comb_words(shape) + 1, LINE // WIDE_WORD) * WIDE_WORD


#: Bytes of the control region: two control lines, then 32 spare lines (debug builds keep their kernel trace in
#: lines 16..31, `TRACE`); their size keeps every later region's offset where the kernels expect it.
CTRL_BYTES = 2 * LINE + NUM_MAX_RANKS * LINE
#: The peer table follows the control region directly (`region_offsets`), so a kernel finds its control lines at
#: `peers - CTRL_BELOW_PEERS`, a constant, without the layout's arithmetic on `max_tokens`.
CTRL_BELOW_PEERS = align(CTRL_BYTES)

#: Halves of the peer-written receive rows (x, ids, weights, hdr): layer `e` stores into and polls half `e % 2`, so a
#: writer of layer `e + 1` overwrites the rows its reader read in layer `e - 1`, which the data chain already orders
#: (docs/protocol.md, "Double-buffered rows"): no ready line, no wait before the stores.
ROW_HALVES = 2


def region_offsets(stride_rows, tokens, ranks: int, shape: LatentMoEShape) -> dict[str, tuple]:
    """`{name: (offset, bytes)}` of every region, for `stride_rows = stride(tokens)`.

    The single definition of the buffer layout: `EpLayout` calls it with Python ints for host sizing,
    and the kernels call it with run-time DSL integers for `stride_rows` and `tokens` (only `+`, `*`
    and `&` are used), so host and device offsets cannot drift apart.
    """
    rows = stride_rows * ranks
    halves = rows * ROW_HALVES
    sizes = [
        ("x", halves * x_pitch(shape)),
        ("ids", halves * meta_pitch(shape)),
        ("weights", halves * meta_pitch(shape)),
        ("hdr", halves * HDR_PITCH),
        ("mirror", rows * 4),
        ("comb", tokens * (ranks * comb_pitch(shape))),
        ("ctrl", CTRL_BYTES),
        ("peers", (NUM_MAX_RANKS + 1) * 8),
    ]
    regions, offset = {}, 0
    for name, size in sizes:
        regions[name] = (offset, size)
        offset = align(offset + size)
    return regions


@dataclasses.dataclass(frozen=True)
class EpLayout:
    """Byte offsets of one rank's symmetric EP buffer for `ranks` ranks and at most `tokens` tokens per rank.

    Every region a peer writes holds LL words (`LL_WORD`: 4 payload bytes + the writer's layer epoch, one
    8-byte store) or wide LL words (`WIDE_WORD`: 12 payload bytes + the epoch, one 16-byte store), so a reader
    polls the data itself: no fences, counters or flags (docs/protocol.md).
    Regions, in order, each starting on a 128-byte line:
      x        [2, rows, x_pitch]     each receive row's data stream in wide LL words: the MXFP8
                                      (float8_e4m3fn) latent (`L` bytes), then its E8M0 scales (`L // 32`)
      ids      [2, rows, meta_pitch]  the token's `K` expert ids (int32), one LL word each
      weights  [2, rows, meta_pitch]  the token's `K` routing weights (float32), one LL word each
      hdr      [2, rows, 16]          LL word of the source word `(rank << 16) | token`, or -1: row empty
                                      (x, ids, weights, hdr: layer `e` uses half `e % 2`, `ROW_HALVES`)
      mirror   [rows] int32           this rank's own copy of each row's source word (written by the dispatch's
                                      copy-out, read by the combine; no peer writes it)
      comb     [tokens, ranks, comb_pitch]  BF16 partial (`2 L` bytes) of every own token from every destination
                                      rank, in wide LL words
      ctrl     2 * 128 + 32 * 128     control words (CTRL_*: epochs and error record, then the arrival counters
                                      on a line of their own), then 32 spare lines (`CTRL_BYTES`)
      peers    [N + 1] int64          local only: the base of every rank's buffer as this rank maps it, then
                                      its own (the kernels' `peers` argument points here, so the local base
                                      is `peers - offset`, with no load)
    with `rows = ranks * stride(tokens)`, row `s * stride(tokens) + t` holding token `t` of source `s`.
    Row pitches are multiples of 16 bytes so that the 8 rows of a source block fill whole lines (no line of
    a peer-written region has two writers). A zeroed buffer is the initial state (epoch 0: nothing written).

    Args:
      ranks: ranks `N` on the expert-parallel axis, `1 <= N <= 32`, dividing `shape.experts`.
      tokens: the largest token count `T` of one call per rank, `1 <= T < 2**16`.
      shape: the layer's `LatentMoEShape`.

    Raises:
      ValueError: if `ranks` or `tokens` breaks its rule.
    """

    ranks: int
    tokens: int
    shape: LatentMoEShape = KIMI_K3

    def __post_init__(self):
        self.shape.check_ranks(self.ranks)
        check_max_tokens(self.tokens)

    # Row pitches in bytes.
    @property
    def x_pitch(self) -> int:
        return x_pitch(self.shape)

    @property
    def meta_pitch(self) -> int:
        return meta_pitch(self.shape)

    @property
    def hdr_pitch(self) -> int:
        return HDR_PITCH

    @property
    def comb_pitch(self) -> int:
        return comb_pitch(self.shape)

    @property
    def stride(self) -> int:
        """Receive rows per source rank, `stride(tokens)`."""
        return stride(self.tokens)

    @property
    def rows(self) -> int:
        """Receive rows in all, `ranks * stride(tokens)`."""
        return self.ranks * self.stride

    def _regions(self) -> dict[str, tuple[int, int]]:
        return region_offsets(self.stride, self.tokens, self.ranks, self.shape)

    def regions(self) -> dict[str, tuple[int, int]]:
        """`{name: (offset, bytes)}` of every region, in buffer order."""
        return self._regions()

    @property
    def x(self) -> int:
        return self._regions()["x"][0]

    @property
    def ids(self) -> int:
        return self._regions()["ids"][0]

    @property
    def weights(self) -> int:
        return self._regions()["weights"][0]

    @property
    def hdr(self) -> int:
        return self._regions()["hdr"][0]

    @property
    def mirror(self) -> int:
        return self._regions()["mirror"][0]

    @property
    def comb(self) -> int:
        return self._regions()["comb"][0]

    @property
    def ctrl(self) -> int:
        return self._regions()["ctrl"][0]

    def ctrl_word(self, index: int) -> int:
        """Byte offset of control word `index` (one of the CTRL_* constants)."""
        return self.ctrl + 4 * index

    @property
    def peers(self) -> int:
        """Byte offset of the peer table (int64 `[N + 1]`, local only)."""
        return self._regions()["peers"][0]

    @property
    def bytes(self) -> int:
        """Total bytes of one rank's buffer (a multiple of 128)."""
        offset, size = self._regions()["peers"]
        return align(offset + size)

    def invalid_expert(self, rank: int) -> int:
        """The expert id of empty rows on `rank`: the next rank's first expert, never local when N > 1."""
        return ((rank + 1) % self.ranks) * self.shape.num_local_experts(self.ranks)

    def offsets(self) -> dict[str, int]:
        """Every offset the kernels take, by name (also recorded in the build manifest)."""
        return {
            "x": self.x,
            "ids": self.ids,
            "weights": self.weights,
            "hdr": self.hdr,
            "mirror": self.mirror,
            "comb": self.comb,
            "ctrl": self.ctrl,
            "peers": self.peers,
            "bytes": self.bytes,
        }
