"""The one byte layout of a rank's symmetric EP buffer (`EpLayout`), shared by host sizing and device offsets."""

from __future__ import annotations

import dataclasses

from jax_latent_ep.config import KIMI_K3, LatentMoEShape, NUM_MAX_RANKS, check_max_tokens

#: Bytes of one cache line on the NVLink fabric; every region starts on one, and every flag and
#: source word owns one, so that no two ranks ever write the same line.
LINE = 128
#: Rows per source block of the receive arrays: `stride(tokens)` is a multiple of this.
ROW_BLOCK = 8

# Words of the first control line (int32 each). Counters are touched by this rank only.
CTRL_LAYER = 0  # dispatches completed on this rank (the layer number in error reports)
CTRL_DISPATCH_DONE = 1  # dispatch CTAs that finished storing (arrival counter)
CTRL_COMBINE_DONE = 2  # combine CTAs that finished sending (arrival counter)
CTRL_COMBINE_SEEN = 3  # combine waiters that saw every combine flag (arrival counter)
CTRL_DISPATCH_SEEN = 4  # dispatch waiters that saw every dispatch flag (arrival counter)
CTRL_ERROR = 5  # 0, or an error code (1: dispatch flag timeout, 2: combine flag timeout)
CTRL_ERROR_PEER = 6  # the rank whose flag never came
CTRL_ERROR_LAYER = 7  # the layer at which it happened
NUM_CTRL_WORDS = 8

ERROR_NONE = 0
ERROR_DISPATCH_TIMEOUT = 1
ERROR_COMBINE_TIMEOUT = 2


def stride(tokens: int) -> int:
    """Receive rows per source rank, `ceil(tokens / 8) * 8`.

    A multiple of 8, so that with the padded row pitches below no 128-byte line of the receive arrays
    holds rows of two source ranks (two remote writers of one line serialize on the fabric).
    """
    return (tokens + ROW_BLOCK - 1) // ROW_BLOCK * ROW_BLOCK


def align(offset: int) -> int:
    """`offset` rounded up to a multiple of 128 bytes (works on Python ints and DSL integers)."""
    return (offset + LINE - 1) // LINE * LINE


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def region_offsets(stride_rows, tokens, ranks: int, shape: LatentMoEShape) -> dict[str, tuple]:
    """`{name: (offset, bytes)}` of every region, for `stride_rows = stride(tokens)`.

    The single definition of the buffer layout: `EpLayout` calls it with Python ints for host sizing,
    and the kernels call it with run-time DSL integers for `stride_rows` and `tokens` (only `+`, `*`
    and `//` are used), so host and device offsets cannot drift apart.
    """
    rows = stride_rows * ranks
    sf_pitch = _round_up(shape.num_sf, 16)
    meta_pitch = _round_up(shape.topk, 4) * 4
    sizes = [
        ("x", rows * shape.latent),
        ("sf", rows * sf_pitch),
        ("ids", rows * meta_pitch),
        ("weights", rows * meta_pitch),
        ("src", rows * LINE),
        ("comb", tokens * (ranks * shape.latent * 2)),
        ("ctrl", LINE + 2 * NUM_MAX_RANKS * LINE),
    ]
    regions, offset = {}, 0
    for name, size in sizes:
        regions[name] = (offset, size)
        offset = align(offset + size)
    return regions


@dataclasses.dataclass(frozen=True)
class EpLayout:
    """Byte offsets of one rank's symmetric EP buffer for `ranks` ranks and at most `tokens` tokens per rank.

    Regions, in order, each starting on a 128-byte line:
      x        [rows, x_pitch]        MXFP8 (float8_e4m3fn) latent of each receive row
      sf       [rows, sf_pitch]       E8M0 block scales (uint8), `L // 32` used per row
      ids      [rows, meta_pitch]     the token's `K` expert ids (int32)
      weights  [rows, meta_pitch]     the token's `K` routing weights (float32)
      src      [rows, 128]            source word `(rank << 16) | token` or -1, one line per row
      comb     [tokens, ranks, L]     BF16 partial of every own token from every destination rank
      ctrl     128 + 2 * 32 * 128     counters (see CTRL_*), then 32 dispatch and 32 combine flags,
                                      one line each
    with `rows = ranks * stride(tokens)`, row `s * stride(tokens) + t` holding token `t` of source `s`.
    Row pitches are padded to multiples of 16 bytes so that 8 rows fill whole lines.

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
        return self.shape.latent

    @property
    def sf_pitch(self) -> int:
        return _round_up(self.shape.num_sf, 16)

    @property
    def meta_pitch(self) -> int:
        return _round_up(self.shape.topk, 4) * 4

    @property
    def src_pitch(self) -> int:
        return LINE

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
    def sf(self) -> int:
        return self._regions()["sf"][0]

    @property
    def ids(self) -> int:
        return self._regions()["ids"][0]

    @property
    def weights(self) -> int:
        return self._regions()["weights"][0]

    @property
    def src(self) -> int:
        return self._regions()["src"][0]

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
    def dflag(self) -> int:
        """Byte offset of the dispatch flags: flag of source rank `s` at `dflag + 128 * s`."""
        return self.ctrl + LINE

    @property
    def cflag(self) -> int:
        """Byte offset of the combine flags: flag of rank `d` at `cflag + 128 * d`."""
        return self.ctrl + LINE + NUM_MAX_RANKS * LINE

    @property
    def bytes(self) -> int:
        """Total bytes of one rank's buffer (a multiple of 128)."""
        offset, size = self._regions()["ctrl"]
        return align(offset + size)

    def invalid_expert(self, rank: int) -> int:
        """The expert id written into empty rows of `rank`: the next rank's first expert, never local when N > 1."""
        return ((rank + 1) % self.ranks) * self.shape.num_local_experts(self.ranks)

    def offsets(self) -> dict[str, int]:
        """Every offset the kernels take, by name (also recorded in the build manifest)."""
        return {
            "x": self.x,
            "sf": self.sf,
            "ids": self.ids,
            "weights": self.weights,
            "src": self.src,
            "comb": self.comb,
            "ctrl": self.ctrl,
            "dflag": self.dflag,
            "cflag": self.cflag,
            "bytes": self.bytes,
        }
