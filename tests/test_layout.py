"""EpLayout against the seed's rules for every allowed N and several T, and the shape config's validation."""

import dataclasses

import numpy as np
import pytest

from jax_latent_ep.shapes import DEEPSEEK_V3, KIMI_K3, LatentMoEShape, check_max_tokens
from jax_latent_ep.layout import CTRL_BELOW_PEERS, LINE, NUM_CTRL_WORDS, EpLayout, region_offsets, stride

TOKENS = [1, 5, 7, 8, 9, 13, 64, 100, 128, 1000, 65535]
SHAPES = [KIMI_K3, DEEPSEEK_V3, LatentMoEShape(latent=96, experts=12, topk=6), LatentMoEShape(32, 7, 1)]


def allowed_ranks(shape):
    return [n for n in range(1, 33) if shape.experts % n == 0]


def test_stride_rule():
    for t in range(1, 300):
        s = stride(t)
        assert s % 8 == 0 and t <= s < t + 8
    assert stride(65535) == 65536


def test_offsets_for_kimi_by_hand():
    # Kimi K3 (3584 / 112 / K = 16), recomputed from the documented rules by hand: a receive row's data stream
    # (3584 + 112 payload bytes) in wide LL words (16 bytes per 12 payload bytes: 308 words), ids and weights in
    # LL words (8 bytes per 4), each of them in two halves; a combine slot's 7168 payload bytes in 598 wide words
    # padded to 600.
    def align(v):
        return (v + 127) // 128 * 128

    for n in allowed_ranks(KIMI_K3):
        for t in TOKENS:
            lay = EpLayout(n, t)
            rows = n * stride(t)
            halves = 2 * rows  # the peer-written rows twice: layer e in half e % 2
            x = 0
            ids = align(x + halves * 308 * 16)
            weights = align(ids + halves * 16 * 8)
            hdr = align(weights + halves * 16 * 8)
            mirror = align(hdr + halves * 16)
            comb = align(mirror + rows * 4)
            ctrl = align(comb + t * n * 600 * 16)
            peers = align(ctrl + 2 * 128 + 32 * 128)
            total = align(peers + 33 * 8)
            got = lay.offsets()
            assert (got["x"], got["ids"], got["weights"], got["hdr"]) == (x, ids, weights, hdr)
            assert (got["mirror"], got["comb"], got["ctrl"], got["peers"], got["bytes"]) == (
                mirror, comb, ctrl, peers, total)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"L{s.latent}_E{s.experts}_K{s.topk}")
def test_regions_aligned_disjoint_and_lines_single_source(shape):
    for n in allowed_ranks(shape):
        for t in TOKENS[:8] + [65535]:
            lay = EpLayout(n, t, shape)
            regions = list(lay.regions().items())
            end = 0
            for name, (offset, size) in regions:
                assert offset % LINE == 0, (name, offset)
                assert offset >= end, ("overlap", name)
                end = offset + size
            assert lay.bytes >= end and lay.bytes % LINE == 0
            s = lay.stride
            # No 128-byte line of a peer-written receive region holds rows of two source ranks: every
            # source block [s * S, (s + 1) * S) rows starts and ends on a line boundary.
            for name, pitch in (("x", lay.x_pitch), ("ids", lay.meta_pitch),
                                ("weights", lay.meta_pitch), ("hdr", lay.hdr_pitch)):
                offset = getattr(lay, name)
                assert (s * pitch) % LINE == 0, (name, n, t)
                assert pitch * 8 % LINE == 0  # 8-row blocks fill whole lines
                assert pitch % 16 == 0  # 16-byte LL stores stay aligned
                for source in (0, n - 1):
                    first = offset + source * s * pitch
                    last = offset + (source + 1) * s * pitch - 1
                    assert first % LINE == 0 and (last + 1) % LINE == 0
            # Wide LL words: 16 bytes per 12 payload bytes; LL words: 8 per 4.
            assert lay.x_pitch == -(-(shape.latent + shape.num_sf) // 12) * 16
            assert lay.comb_pitch >= (-(-2 * shape.latent // 12) + 1) * 16 and lay.meta_pitch >= 8 * shape.topk
            # Combine slots [t, d] are whole lines (one writer each).
            assert lay.comb % LINE == 0 and lay.comb_pitch % LINE == 0
            # The control words fit their line, the 32 spare lines follow the two control lines, the peer table is
            # last.
            assert lay.ctrl + NUM_CTRL_WORDS * 4 <= lay.ctrl + LINE
            assert lay.ctrl + 2 * LINE + 32 * LINE <= lay.peers and lay.peers + 33 * 8 <= lay.bytes
            # The kernels find the control lines at a constant offset below the peer table.
            assert lay.peers - lay.ctrl == CTRL_BELOW_PEERS


def test_region_offsets_is_the_one_definition():
    lay = EpLayout(8, 13, KIMI_K3)
    assert region_offsets(stride(13), 13, 8, KIMI_K3) == lay.regions()


def test_invalid_expert_is_never_local():
    for n in allowed_ranks(KIMI_K3):
        lay = EpLayout(n, 4)
        local = KIMI_K3.experts // n
        for r in range(n):
            e = lay.invalid_expert(r)
            assert 0 <= e < KIMI_K3.experts
            if n > 1:
                assert e // local != r


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(latent=100), "latent=100"),
        (dict(latent=0), "latent=0"),
        (dict(topk=33), "topk=33"),
        (dict(topk=0), "topk=0"),
        (dict(experts=8, topk=9), "topk=9"),
        (dict(experts=-1), "experts=-1"),
        (dict(latent=3584.0), "latent=3584.0"),
    ],
)
def test_shape_rules(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LatentMoEShape(**kwargs)


def test_rank_and_token_rules():
    with pytest.raises(ValueError, match="ranks=3 must divide experts=896"):
        EpLayout(3, 8)
    with pytest.raises(ValueError, match="ranks=64"):
        EpLayout(64, 8, LatentMoEShape(experts=128))
    with pytest.raises(ValueError, match="ranks=0"):
        EpLayout(0, 8)
    with pytest.raises(ValueError, match="max_tokens=65536"):
        EpLayout(2, 65536)
    with pytest.raises(ValueError, match="max_tokens=0"):
        check_max_tokens(0)
    assert EpLayout(32, 65535).rows == 32 * 65536
    assert KIMI_K3 == LatentMoEShape() and KIMI_K3.num_sf == 112
    with pytest.raises(dataclasses.FrozenInstanceError):
        KIMI_K3.latent = 8  # frozen


@pytest.mark.parametrize("shape", [KIMI_K3, DEEPSEEK_V3], ids=["kimi_k3", "deepseek_v3"])
def test_wide_word_streams_carry_every_piece_once(shape):
    """The kernels' wide-word maps: the dispatch stages a row's data stream (MXFP8 bytes, then scales) as 4-byte
    pieces and thread t stores words t, t + threads, ... (each warp instruction covers 512 contiguous bytes on a
    line); the combine's reducing thread t takes pieces 8 t .. 8 t + 7 of a slot from words k .. k + 3 (k = 8 t // 3)
    at offset 8 t % 3. Every payload piece lands in exactly one word, and every piece a reducer takes is the one
    that the sender put there, inside the slot's padded pitch."""
    from jax_latent_ep.layout import WIDE_WORD, comb_words, row_payload, wide_words

    lay = EpLayout(2, 8, shape)
    threads = shape.latent // 16
    # Dispatch rows: words w = tid + k * threads, whole lines per warp instruction.
    words = wide_words(row_payload(shape))
    assert words * WIDE_WORD == lay.x_pitch and 3 * words * 4 >= row_payload(shape)
    for k in range(-(-words // threads)):
        for warp in range(threads // 32):
            first = warp * 32 + k * threads
            if first + 32 <= words:
                assert (first * WIDE_WORD) % LINE == 0
    # Combine slots: the sender's word w holds pieces 3 w .. 3 w + 2 of the row (u32 of the BF16 partial).
    n_words = comb_words(shape)
    row_u32 = 2 * shape.latent // 4
    sent = {}
    for w in range(n_words):
        for c in range(3):
            if 3 * w + c < row_u32:
                sent[(w, c)] = 3 * w + c
    assert sorted(sent.values()) == list(range(row_u32))
    for tid in range(threads):
        k, r = 8 * tid // 3, 8 * tid % 3
        assert (k + 4) * WIDE_WORD <= lay.comb_pitch  # the four loads stay inside the slot
        taken = [sent[((k * 3 + r + j) // 3, (r + j) % 3)] for j in range(8)]
        assert taken == list(range(8 * tid, 8 * tid + 8))
        assert ((k * 3 + r + 7) // 3 == k + 3) == (r == 2)  # the fourth word is needed exactly when r == 2
