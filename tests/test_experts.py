"""The expert stage (`jax_latent_ep.experts`): the plan's pairs, and every implementation of the grouped SwiGLU
against the NumPy model and the dense formulation, on fresh random routings with padded tokens (`-1` ids),
unused slots, duplicate ids, rows with no local expert and a different live count per source rank. One test
body, parametrized over the implementations."""

import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_latent_ep import experts
from jax_latent_ep.experts.kernel import KERNEL_BLOCK_M, KERNEL_MIN_UNITS, _kernel_splits, _stage_fits
from jax_latent_ep.experts.planning import plan_kernel_fits, work_items, work_list
from jax_latent_ep.experts.xla import activations
from jax_latent_ep.kernels import abi
from jax_latent_ep.received import Received
from jax_latent_ep.testing.experts import (dequantized, random_fp8_weights, random_int8_weights, random_mxfp4_weights,
                                          random_received, reference_swiglu)

# The GPU-only implementations run where a GPU is (the `gpu` marker skips them elsewhere, with the reason).
IMPLS = [pytest.param(i, marks=pytest.mark.gpu) if i in experts.GPU_ONLY else i for i in sorted(experts.IMPLEMENTATIONS)]


def _taking(cls):
    """`IMPLS` of the implementations that multiply weights of class `cls` (`experts.IMPL_FORMATS`)."""
    return [p for p in IMPLS if experts.takes(getattr(p, "values", [p])[0], cls)]


FP8_IMPLS = _taking(experts.BlockScaled)
#: The implementations a format refusal names for int8 weights (a regex of the list).
XLA_ONLY = r"\[.dense., .gather., .ragged_dot., .scan.\]"
# (N, rank, live tokens per source, max_tokens, L, E, K, I); L and I multiples of 64 (the kernel's tiles)
CASES = [
    (1, 0, [5], 5, 64, 16, 4, 64),  # N = 1: the empty rows carry expert 0 (weight 0), never planned
    (2, 1, [7, 0], 9, 128, 32, 6, 64),  # one source sends nothing; S = 16 > max_tokens
    (4, 2, [3, 8, 1, 5], 8, 64, 16, 8, 64),  # J = 4 < K: capacity N * T * J
    (8, 0, [2, 2, 0, 1, 3, 2, 1, 2], 3, 128, 64, 8, 64),
]


def _sized(impl, case):
    """`case` with L and I raised to the implementation's tile multiple ("mosaic": 128; the others take 64)."""
    n, rank, tokens, mt, lat, e, k, inter = case
    t = experts.grouped.MOSAIC_SIDE if impl in experts.grouped.HOPPER_ONLY else 1
    return n, rank, tokens, mt, -(-lat // t) * t, e, k, -(-inter // t) * t


def _case(seed_text, n, rank, tokens, mt, lat, e, k, inter, fused=False):
    rng = np.random.default_rng(zlib.crc32(seed_text.encode()))
    recv = random_received(rng, ranks=n, rank=rank, tokens=tokens, max_tokens=mt, latent=lat, experts=e, topk=k,
                           pad_tokens=0.15, pad_slots=0.2, duplicates=0.3, local_bias=0.4)
    j = e // n
    w = lambda *s: (rng.standard_normal(s) / np.sqrt(s[1])).astype(ml_dtypes.bfloat16)  # noqa: E731
    if fused:
        return recv, (w(j, lat, 2 * inter), None, w(j, inter, lat))
    return recv, (w(j, lat, inter), w(j, lat, inter), w(j, inter, lat))


def _run(recv, weights, rank, mt, n, impl):
    fn = jax.jit(lambda r, wg, wu, wd: experts.expert_stage(r, rank, wg, wu, wd, impl=impl, max_tokens=mt, ranks=n))
    return np.asarray(fn(jax.tree.map(jnp.asarray, recv), *weights), np.float32)


#: `_assert_close`'s share of the row's largest |value| where the gate / up sums come from the FP8 tensor cores
#: (`wgmma` on FP8 or MXFP4 weights): their block sums are within ~2^-14 of FP32's, and `h`'s MXFP8 rounding (an
#: e4m3 step, up to 1/8 of a value) follows them: a 2^-14 change of `h` moves these small cases' rows by up to 3 %
#: in a NumPy emulation. A wrong pair, scale or tile moves its row by the pair's whole share.
FP8_CORE_REL = 5e-2


def _assert_close(got, want, what, rel=1e-2):
    """Within 1 bf16 ulp of `want` plus `rel` (1%) of the row's largest |want|: the GEMMs' FP32 accumulation order
    is the implementation's, which may move the bf16 rounding of `h` (each flip changes `y` by ~2^-9 of one term)."""
    ulp = np.abs(want) * 2.0**-7
    tol = ulp + rel * np.max(np.abs(want), axis=1, keepdims=True)
    bad = np.argwhere(np.abs(got - want) > tol)
    assert bad.size == 0, f"{what}: {len(bad)} values off, first at {bad[0].tolist()}: {got[tuple(bad[0])]} vs {want[tuple(bad[0])]}"


def _plan_np(recv, rank, j, mt, n):
    """(row, local expert) -> FP32 weight (ascending k) of the live rows: the pairs the plan must hold."""
    ids, w, src = (np.asarray(a) for a in (recv.ids, recv.weights, recv.src))
    s_rows = ids.shape[0] // n
    pairs = {}
    for r in range(ids.shape[0]):
        if src[r] == -1 or r % s_rows >= mt:
            continue
        for k in range(ids.shape[1]):
            if ids[r, k] // j == rank:
                key = (r, int(ids[r, k]) - rank * j)
                pairs[key] = np.float32(pairs.get(key, np.float32(0)) + w[r, k])
    return pairs


@pytest.mark.parametrize("case", CASES, ids=[f"N{c[0]}" for c in CASES])
def test_plan(case):
    n, rank, tokens, mt, lat, e, k, inter = case
    recv, _ = _case(f"plan/{case}", *case)
    j = e // n
    pl = jax.jit(lambda r: experts.plan(r, rank, j, max_tokens=mt, ranks=n))(jax.tree.map(jnp.asarray, recv))
    pl = jax.tree.map(np.asarray, pl)
    want = _plan_np(recv, rank, j, mt, n)
    count = int(pl.count)
    assert pl.row.shape == (n * mt * min(k, j),) and count == len(want) > 0
    got = {(int(r), int(x)): wt for r, x, wt in zip(pl.row[:count], pl.expert[:count], pl.weight[:count])}
    assert len(got) == count, "a (row, expert) planned twice"
    assert got.keys() == want.keys()
    assert all(got[p] == want[p] for p in want), "pair weights are not the ascending-k FP32 sums"
    assert np.all(np.diff(pl.expert[:count]) >= 0), "pairs not grouped by expert"
    np.testing.assert_array_equal(pl.group_sizes, np.bincount(pl.expert[:count], minlength=j))
    assert np.all(pl.expert[count:] == j) and np.all(pl.weight[count:] == 0)
    # the way back: each row's pairs, in ascending first slot, then C
    ids = np.asarray(recv.ids)
    for r in range(ids.shape[0]):
        firsts = [int(x) - rank * j for kk, x in enumerate(ids[r]) if (r, int(x) - rank * j) in want and x not in ids[r, :kk]]
        refs = [p for p in pl.row_pairs[r] if p != pl.capacity]
        assert [int(pl.expert[p]) for p in refs] == firsts and all(pl.row[p] == r for p in refs)


# Plan-kernel cases besides CASES: (N, rank, live tokens, max_tokens, E, K, local_bias); Kimi K3 at N = 1, 2, 8
# with T = 128, and a hot expert (groups of several 64-pair work items; the in-group order over many rows).
PLAN_KERNEL_CASES = [(n, r, t, mt, e, k, 0.4) for n, r, t, mt, _, e, k, _ in CASES] + [
    (1, 0, [128], 128, 896, 16, None),
    (2, 1, [128, 77], 128, 896, 16, None),
    (8, 5, [128, 1, 0, 64, 128, 3, 128, 100], 128, 896, 16, None),
    (2, 0, [300, 257], 300, 8, 4, 0.9),
    (3, 2, [50, 61, 40], 61, 48, 6, 0.5),  # K = 6 (8 lanes a row); the last pass takes half the warps
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", PLAN_KERNEL_CASES, ids=lambda c: f"N{c[0]}-E{c[4]}-T{c[3]}")
def test_plan_kernel_is_the_xla_plan(case):
    """The plan kernel's words are the XLA plan's, bit for bit (pairs, weights, group sizes, count, the way back)
    and its work list is `work_items` of the XLA plan."""
    n, rank, tokens, mt, e, k, bias = case
    rng = np.random.default_rng(zlib.crc32(f"plan-kernel/{case}".encode()))
    recv = random_received(rng, ranks=n, rank=rank, tokens=tokens, max_tokens=mt, latent=64, experts=e, topk=k,
                           pad_tokens=0.15, pad_slots=0.2, duplicates=0.3, local_bias=bias)
    recv = jax.tree.map(jnp.asarray, recv)
    j = e // n
    build = lambda impl: jax.jit(lambda r, rk: experts.plan(r, rk, j, max_tokens=mt, ranks=n, impl=impl))(  # noqa: E731
        recv, jnp.int32(rank))
    got, want = build("kernel"), build("xla")
    assert int(want.count) > 0
    for name in ("row", "expert", "weight", "group_sizes", "count", "row_pairs"):
        a, b = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(a.view(np.int32), b.view(np.int32), err_msg=name)
    np.testing.assert_array_equal(np.asarray(got.work), np.asarray(jax.jit(work_items)(want)))
    for pairs in abi.PLAN_WORK_PAIRS:  # each item size the stage's kernels read: `work_items` at that size
        got = jax.jit(lambda r, rk, p=pairs: experts.plan(r, rk, j, max_tokens=mt, ranks=n, impl="kernel",
                                                          work_pairs=p))(recv, jnp.int32(rank))
        np.testing.assert_array_equal(np.asarray(got.work), np.asarray(work_items(want, pairs)), err_msg=str(pairs))


def test_plan_kernel_refusals():
    recv, _ = _case("plan-refusal", *CASES[0])
    recv = jax.tree.map(jnp.asarray, recv)
    with pytest.raises(ValueError, match="impl='fast' must be one of"):
        experts.plan(recv, 0, 16, impl="fast")
    with pytest.raises(ValueError, match=r"J <= 2048 local experts, K <= 32 ids and J \* ceil\(R / 32\) <= 24576, "
                       "got J=4096"):
        experts.plan(recv, 0, 4096, impl="kernel")
    assert plan_kernel_fits(1024, 16, 112) and plan_kernel_fits(128, 16, 896)
    assert not plan_kernel_fits(8192, 16, 896) and not plan_kernel_fits(8, 33, 8)
    if not any(d.platform == "gpu" for d in jax.devices()):
        with pytest.raises(ValueError, match=r"experts.plan\(impl='kernel'\) runs on NVIDIA GPUs"):
            experts.plan(recv, 0, 16, impl="kernel")


def test_work_list_takes_the_plans_list_of_its_length():
    """`work_list`: the plan's own list where it has the asked list's length, else `work_items`; lists of one
    length from two item sizes have the same non-empty items (the kernels read no more: word 3), on random
    group sizes. `plan` refuses an item size the kernel has not; `work_pairs` asks the FP8 / MXFP4 stage's tile."""
    rng = np.random.default_rng(7)
    for cap in (5, 12, 40, 200):
        for _ in range(3):  # eager calls: a case about 0.7 s on a CPU
            j = int(rng.integers(1, 9))
            gs = np.bincount(rng.integers(0, j, int(rng.integers(0, cap + 1))), minlength=j).astype(np.int32)
            pl = experts.Plan(*(jnp.zeros(s, jnp.int32) for s in ((cap,), (cap,), (cap,))), jnp.asarray(gs),
                              jnp.int32(gs.sum()), jnp.zeros((1, 1), jnp.int32))
            lists = {b: np.asarray(work_items(pl, b)) for b in abi.PLAN_WORK_PAIRS}
            for a in abi.PLAN_WORK_PAIRS:
                own = pl._replace(work=jnp.asarray(lists[a]))
                for b in abi.PLAN_WORK_PAIRS:
                    got = np.asarray(work_list(own, b))
                    if len(lists[a]) == len(lists[b]):
                        assert work_list(own, b) is own.work
                        items = lists[b][0, 3]
                        np.testing.assert_array_equal(got[:items], lists[b][:items])
                        assert items == 0 or np.all(got[:, 3] == items)
                    else:
                        np.testing.assert_array_equal(got, lists[b])
    recv, _ = _case("plan-work-pairs", *CASES[0])
    with pytest.raises(ValueError, match=r"work_pairs=12 must be one of \(8, 16, 32, 64\)"):
        experts.plan(jax.tree.map(jnp.asarray, recv), 0, 16, work_pairs=12)
    assert {abi.GEMM_BLOCK_M, abi.MATMUL_FP8_TILE_PAIRS, *abi.MATMUL_FP8_SMALL_TILE_PAIRS} <= set(abi.PLAN_WORK_PAIRS)
    k, n, j = 256, 256, 4
    fp8 = experts.BlockScaledOutIn(jnp.zeros((j, n, k), jnp.float8_e4m3fn), jnp.ones((j, n // 128, k // 128)))
    mx = experts.MXFP4(jnp.zeros((j, n, k // 2), jnp.uint8), jnp.full((j, n, k // 32), 127, jnp.uint8))
    for w in (fp8, mx):  # decode: a few pairs an expert, the 8-pair tiles; a hot stage, the 32-pair tiles
        assert experts.work_pairs("wgmma", w, 32, 8) == 8 and experts.work_pairs("wgmma", w, 2048, 200) == 32
        assert experts.work_pairs("gmm", w, 32, 8) == abi.GEMM_BLOCK_M
    # prefill on FP8 weights: the plan has no list of the prefill tiles (`work_list` builds it), MXFP4 no such tiles
    assert experts.work_pairs("wgmma", fp8, 4096, 4096) == abi.GEMM_BLOCK_M
    assert experts.work_pairs("wgmma", mx, 4096, 4096) == 32
    assert experts.work_pairs("kernel", jnp.zeros((j, k, n), jnp.bfloat16), 32, 8) == abi.GEMM_BLOCK_M


def test_default_plan_impl_is_the_kernel_only_without_a_vjp():
    """The plan kernel where the stage has no VJP through the plan's weights and it takes the rows; else XLA's."""
    recv, _ = _case("plan-default", *CASES[0])
    k, n, j = 4096, 256, 4
    bf16 = jnp.zeros((j, k, n), jnp.bfloat16)
    fp8 = experts.BlockScaledOutIn(jnp.zeros((j, n, k), jnp.float8_e4m3fn), jnp.ones((j, n // 128, k // 128)))
    mx = experts.MXFP4(jnp.zeros((j, n, k // 2), jnp.uint8), jnp.full((j, n, k // 32), 127, jnp.uint8))
    pick = experts.default_plan_impl
    assert pick(recv, "kernel", bf16) == "kernel"
    assert pick(recv, "wgmma", fp8) == "kernel" and pick(recv, "wgmma", mx) == "kernel"
    assert pick(recv, "wgmma", bf16) == "xla" and pick(recv, "mosaic", bf16) == "xla"  # the VJP needs XLA's weights
    assert pick(recv, "gmm", fp8) == "xla" and pick(recv, "ragged_dot", bf16) == "xla"  # any device
    assert pick(recv, "kernel", bf16, capacity_factor=2.0) == "xla"  # the kernel plans the worst case only
    many = jnp.zeros((4096, 8, 8), jnp.bfloat16)  # J past the plan kernel's
    assert pick(recv, "kernel", many) == "xla"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=[f"N{c[0]}" for c in CASES])
def test_swiglu_against_numpy(impl, case):
    case = _sized(impl, case)
    n, rank, tokens, mt, lat, e, k, inter = case
    recv, weights = _case(f"mlp/{impl}/{case}", *case)
    got = _run(recv, weights, rank, mt, n, impl)
    want = reference_swiglu(recv, rank, *weights, max_tokens=mt, ranks=n).astype(np.float32)
    src = np.asarray(recv.src)
    assert np.any(want != 0)
    assert np.all(got[src == -1] == 0), "an empty row is not exactly 0"
    assert np.all(got[~np.any(want != 0, axis=1)] == 0), "a row with no local expert is not exactly 0"
    _assert_close(got, want, impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_fused_gate_up(impl):
    case = _sized(impl, CASES[1])
    n, rank, tokens, mt = case[:4]
    recv, weights = _case(f"fused/{impl}", *case, fused=True)
    got = _run(recv, weights, rank, mt, n, impl)
    _assert_close(got, reference_swiglu(recv, rank, *weights, max_tokens=mt, ranks=n).astype(np.float32), impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_against_dense_formulation(impl):
    """Against the dense formulation written independently: every local expert on every row, weighted by the
    row's summed routing weight of that expert (`moe.local_coefficients`), summed over experts by XLA."""
    from jax_latent_ep import moe

    case = _sized(impl, CASES[2])
    n, rank, tokens, mt, lat, e, k, inter = case
    recv, (wg, wu, wd) = _case(f"dense/{impl}", *case)
    j = e // n
    got = _run(recv, (wg, wu, wd), rank, mt, n, impl)
    xf = jnp.asarray(activations(jax.tree.map(jnp.asarray, recv)), jnp.float32)
    live = (np.asarray(recv.src) != -1)[:, None]
    coef = moe.local_coefficients(jnp.asarray(recv.ids), jnp.where(live, jnp.asarray(recv.weights), 0.0), rank * j, j)
    f = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    hid = jax.nn.silu(jnp.einsum("rl,jli->rji", xf, f(wg))) * jnp.einsum("rl,jli->rji", xf, f(wu))
    y = jnp.einsum("rji,jil->rjl", hid.astype(jnp.bfloat16).astype(jnp.float32), f(wd))
    want = np.asarray(jnp.einsum("rj,rjl->rl", coef, y).astype(jnp.bfloat16), np.float32)
    _assert_close(got, want, f"{impl} vs dense")


# FP8 weights: L and I multiples of 128 (the scale block).
FP8_CASES = [
    (1, 0, [5], 5, 128, 16, 4, 256),
    (2, 1, [7, 0], 9, 256, 32, 6, 128),
    (4, 2, [3, 8, 1, 5], 8, 128, 16, 8, 128),
]


def _fp8_case(seed_text, n, rank, tokens, mt, lat, e, k, inter, fused=False):
    recv, _ = _case(seed_text, n, rank, tokens, mt, lat, e, k, 64)
    rng = np.random.default_rng(zlib.crc32(seed_text.encode()) + 1)
    j = e // n
    w = lambda *s: jax.tree.map(jnp.asarray, random_fp8_weights(rng, *s))  # noqa: E731
    if fused:
        return recv, (w(j, lat, 2 * inter), None, w(j, inter, lat))
    return recv, (w(j, lat, inter), w(j, lat, inter), w(j, inter, lat))


@pytest.mark.parametrize("impl", FP8_IMPLS)
@pytest.mark.parametrize("case", FP8_CASES, ids=[f"N{c[0]}" for c in FP8_CASES])
def test_fp8_weights_against_numpy(impl, case):
    """FP8 block-scaled weights (random codes, subnormals and zeros among them, scales not powers of two) against
    the NumPy model on the dequantized FP32 weights."""
    n, rank, tokens, mt = case[:4]
    recv, weights = _fp8_case(f"fp8/{impl}/{case}", *case)
    got = _run(recv, weights, rank, mt, n, impl)
    want = reference_swiglu(recv, rank, *weights, max_tokens=mt, ranks=n).astype(np.float32)
    assert np.any(want != 0)
    assert np.all(got[np.asarray(recv.src) == -1] == 0), "an empty row is not exactly 0"
    _assert_close(got, want, f"{impl}, FP8 weights")


@pytest.mark.parametrize("impl", FP8_IMPLS)
def test_fp8_fused_gate_up(impl):
    case = FP8_CASES[1]
    n, rank, tokens, mt = case[:4]
    recv, weights = _fp8_case(f"fp8-fused/{impl}", *case, fused=True)
    got = _run(recv, weights, rank, mt, n, impl)
    _assert_close(got, reference_swiglu(recv, rank, *weights, max_tokens=mt, ranks=n).astype(np.float32), impl)


#: Prefill sizes: 200 pairs an expert, past `FP8_WIDE_FROM` ("wgmma": the prefill kernel's 128-pair tiles).
FP8_WIDE_CASE = (1, 0, [200], 200, 256, 4, 4, 128)


@pytest.mark.parametrize("impl", ["gmm", pytest.param("wgmma", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("case", FP8_CASES + [FP8_WIDE_CASE], ids=[f"N{c[0]}" for c in FP8_CASES] + ["wide"])
def test_fp8_out_in_weights_against_numpy(impl, fused, case):
    """`[out, in]` FP8 weights (`BlockScaledOutIn`, the same random weights as `BlockScaled`) on the FP8 grouped
    matmul ("gmm": its XLA form; "wgmma": the kernels, decode's or prefill's tiles) against the NumPy model, as the
    other FP8 paths."""
    n, rank, tokens, mt = case[:4]
    recv, weights = _fp8_case(f"fp8-out-in/{impl}/{case}", *case, fused=fused)
    got = _run(recv, [None if w is None else experts.fp8_out_in(w) for w in weights], rank, mt, n, impl)
    want = reference_swiglu(recv, rank, *weights, max_tokens=mt, ranks=n).astype(np.float32)
    assert np.any(want != 0)
    assert np.all(got[np.asarray(recv.src) == -1] == 0), "an empty row is not exactly 0"
    _assert_close(got, want, f"{impl}, [out, in] FP8 weights", FP8_CORE_REL if impl == "wgmma" else 1e-2)


def test_fp8_out_in_refused_where_not_multiplied():
    recv, weights = _fp8_case("fp8-out-in-refused", *FP8_CASES[0])
    with pytest.raises(ValueError, match=r"BlockScaledOutIn FP8 weights are multiplied by \['gmm', 'wgmma'\] only"):
        _run(recv, [experts.fp8_out_in(w) for w in weights], 0, 5, 1, "ragged_dot")


def test_quantize_fp8():
    """`quantize_fp8`: each block's largest magnitude becomes 448 exactly, every value within half an e4m3 step."""
    rng = np.random.default_rng(11)
    w = (rng.standard_normal((2, 256, 384)) * np.exp(rng.standard_normal((2, 256, 1)))).astype(np.float32)
    w[1, :128, :128] = 0  # a zero block: scale 1
    q = experts.quantize_fp8(jnp.asarray(w))
    assert q.values.dtype == jnp.float8_e4m3fn and q.scale.shape == (2, 2, 3)
    blocks = np.abs(np.asarray(q.values, np.float32)).reshape(2, 2, 128, 3, 128).max(axis=(2, 4))
    assert np.all(blocks[np.asarray(q.scale) != 1] == 448) and float(q.scale[1, 0, 0]) == 1.0
    back = np.asarray(experts.dequantize_fp8(q))
    np.testing.assert_allclose(back, dequantized(jax.tree.map(np.asarray, q)), rtol=0, atol=0)
    step = np.abs(w) * 2.0**-4 + np.asarray(q.scale).repeat(128, 1).repeat(128, 2) * 2.0**-10  # e4m3: 3 bits
    assert np.all(np.abs(back - w) <= step)


@pytest.mark.parametrize("impl", _taking(experts.MXFP4))
@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
def test_mxfp4_weights_against_numpy(impl, fused):
    """MXFP4 weights (every e2m1 code, -0 and 0 among them, scales over 7 octaves) against the NumPy model on
    ml_dtypes' decoding of them (`h` rounded to MXFP8 before down, as with FP8 weights)."""
    case = FP8_CASES[1]
    n, rank, tokens, mt, lat, e, k, inter = case
    recv, _ = _case(f"mxfp4/{impl}/{fused}", n, rank, tokens, mt, lat, e, k, 64)
    rng = np.random.default_rng(zlib.crc32(f"mxfp4/{impl}".encode()))
    j = e // n
    w = lambda *s: jax.tree.map(jnp.asarray, random_mxfp4_weights(rng, *s))  # noqa: E731
    weights = (w(j, lat, 2 * inter), None, w(j, inter, lat)) if fused else (w(j, lat, inter), w(j, lat, inter),
                                                                          w(j, inter, lat))
    got = _run(recv, weights, rank, mt, n, impl)
    want = reference_swiglu(recv, rank, *weights, max_tokens=mt, ranks=n).astype(np.float32)
    assert np.any(want != 0)
    _assert_close(got, want, f"{impl}, MXFP4 weights", FP8_CORE_REL if impl == "wgmma" else 1e-2)


def test_quantize_mxfp4():
    """`quantize_mxfp4` against its definition in NumPy (ml_dtypes' e2m1 rounding): the same codes and scales, bit for
    bit, and `dequantize_mxfp4` the exact values (bf16 and FP32) of ml_dtypes' decoding."""
    rng = np.random.default_rng(12)
    w = (rng.standard_normal((2, 64, 96)) * np.exp(rng.standard_normal((2, 1, 96)) * 2)).astype(np.float32)
    w[1, :32, 5] = 0  # a zero block: scale 2^-127, codes 0
    q = jax.tree.map(np.asarray, experts.quantize_mxfp4(jnp.asarray(w)))
    assert q.values.shape == (2, 96, 32) and q.scale.shape == (2, 96, 2) and q.values.dtype == np.uint8
    blocks = np.swapaxes(w, 1, 2).reshape(2, 96, 2, 32)
    amax = np.abs(blocks).max(-1)
    e = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2, -127)
    np.testing.assert_array_equal(q.scale, (e + 127).astype(np.uint8))
    codes = np.clip(blocks / np.exp2(e)[..., None], -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    codes = codes.reshape(2, 96, 64)
    np.testing.assert_array_equal(q.values, codes[..., 0::2] | (codes[..., 1::2] << 4))
    for dtype in (jnp.bfloat16, jnp.float32):
        back = np.asarray(experts.dequantize_mxfp4(jax.tree.map(jnp.asarray, q), dtype), np.float32)
        np.testing.assert_array_equal(back, dequantized(q))
    assert np.all(np.abs(dequantized(q) - w) <= np.abs(w) * 0.25 + np.exp2(e).repeat(32, 2).swapaxes(1, 2) * 0.25)


def test_mxfp4_bad_arguments():
    recv, (wg, wu, wd) = _case("mxfp4-bad", *CASES[1])
    q = lambda a: experts.quantize_mxfp4(jnp.asarray(a, jnp.float32))  # noqa: E731
    pl = experts.plan(recv, 1, 16, max_tokens=9, ranks=2)
    with pytest.raises(ValueError, match=r"w_gate MXFP4 needs K=128 a multiple of 32 and scale uint8\[16, 64, 4\]"):
        experts.swiglu(recv, pl, experts.MXFP4(q(wg).values, q(wg).scale[..., :1]), q(wu), q(wd))
    with pytest.raises(ValueError, match=r"MXFP4 weights are multiplied by \[.dense., .gather., .gmm., .ragged_dot., "
                       r".scan., .wgmma.\]"):
        experts.swiglu(recv, pl, q(wg), q(wu), q(wd), impl="kernel")
    with pytest.raises(ValueError, match="K=48 must be a multiple of 32"):
        experts.quantize_mxfp4(jnp.zeros((1, 48, 64)))


def test_fp8_bad_arguments():
    case = FP8_CASES[1]
    recv, (wg, wu, wd) = _fp8_case("fp8-bad", *case)
    recv = jax.tree.map(jnp.asarray, recv)
    pl = experts.plan(recv, 1, 16, max_tokens=9, ranks=2)
    bf16 = jnp.zeros(wu.shape, jnp.bfloat16)
    with pytest.raises(ValueError, match="w_gate, w_down are BlockScaled and the others not"):
        experts.swiglu(recv, pl, wg, bf16, wd)
    with pytest.raises(ValueError, match=r"w_up scale must be float32\[16, 2, 1\]"):
        experts.swiglu(recv, pl, wg, experts.BlockScaled(wu.values, wu.scale[:, :1]), wd)
    with pytest.raises(ValueError, match=r"w_up BlockScaled values must be float8_e4m3fn\[16, 256, 128\]"):
        experts.swiglu(recv, pl, wg, experts.BlockScaled(wu.values.astype(jnp.bfloat16), wu.scale), wd)
    with pytest.raises(ValueError, match="multiples of 128"):
        experts.quantize_fp8(jnp.zeros((1, 64, 128)))


@pytest.mark.parametrize("impl", _taking(experts.Int8PerChannel))
@pytest.mark.parametrize("case", CASES[1:3], ids=[f"N{c[0]}" for c in CASES[1:3]])
def test_int8_weights_against_numpy(impl, case):
    """int8 weights with a scale per output channel (values over the whole int8 range, zeros among them) against
    the NumPy model on the dequantized FP32 weights (it scales each weight before the sum, the stage each sum:
    FP32 rounding apart)."""
    n, rank, tokens, mt, lat, e, k, inter = case
    recv, _ = _case(f"int8/{impl}/{case}", *case)
    rng = np.random.default_rng(zlib.crc32(f"int8-w/{case}".encode()))
    j = e // n
    weights = [jax.tree.map(jnp.asarray, random_int8_weights(rng, *s)) for s in ((j, lat, inter), (j, lat, inter),
                                                                                  (j, inter, lat))]
    got = _run(recv, weights, rank, mt, n, impl)
    want = reference_swiglu(recv, rank, *weights, max_tokens=mt, ranks=n).astype(np.float32)
    assert np.any(want != 0)
    assert np.all(got[np.asarray(recv.src) == -1] == 0), "an empty row is not exactly 0"
    _assert_close(got, want, f"{impl}, int8 weights")


def test_int8_bad_arguments():
    case = CASES[1]
    recv, (wg, wu, wd) = _case("int8-bad", *case)
    recv = jax.tree.map(jnp.asarray, recv)
    rng = np.random.default_rng(5)
    q = lambda w: jax.tree.map(jnp.asarray, random_int8_weights(rng, *w.shape))  # noqa: E731
    pl = experts.plan(recv, 1, 16, max_tokens=9, ranks=2)
    with pytest.raises(ValueError, match=r"w_gate scale must be float32\[16, 64\] \(one per output channel\)"):
        experts.swiglu(recv, pl, experts.Int8PerChannel(q(wg).values, q(wg).scale[:, :1]), q(wu), q(wd))
    with pytest.raises(ValueError, match=f"Int8PerChannel weights are multiplied by {XLA_ONLY} only"):
        experts.swiglu(recv, pl, q(wg), q(wu), q(wd), impl="kernel")
    with pytest.raises(ValueError, match="w_gate is a object, which is no weight format"):
        experts.swiglu(recv, pl, object(), wu, wd)


def test_bad_arguments():
    recv, (wg, wu, wd) = _case("bad", *CASES[1])
    recv = jax.tree.map(jnp.asarray, recv)
    pl = experts.plan(recv, 1, 16, max_tokens=9, ranks=2)
    with pytest.raises(ValueError, match="impl='cutlass' must be one of"):
        experts.swiglu(recv, pl, wg, wu, wd, impl="cutlass")
    with pytest.raises(ValueError, match=r"w_up must be bfloat16\[16, 128, 64\]"):
        experts.swiglu(recv, pl, wg, wu[:8], wd)
    with pytest.raises(ValueError, match=r"w_gate must be bfloat16"):
        experts.swiglu(recv, pl, np.asarray(wg, np.float32), wu, wd)
    with pytest.raises(ValueError, match="max_tokens=17 must be in"):
        experts.plan(recv, 1, 16, max_tokens=17, ranks=2)
    with pytest.raises(ValueError, match="num_local_experts=0"):
        experts.plan(recv, 1, 0)


def test_no_expert_id_is_never_local():
    """`-1` (and any id outside the rank's range) plans nothing, on every rank, whatever the row."""
    rows, k = 16, 4
    ids = np.full((rows, k), -1, np.int32)
    ids[3] = [-1, 5, -1, 70]  # 5 is local to rank 0 of J = 8; 70 // 8 = 8 is no rank of N = 8
    recv = Received(np.zeros((rows, 32), ml_dtypes.float8_e4m3fn), np.zeros((rows, 1), np.uint8), ids,
                    np.full((rows, k), 0.25, np.float32), np.arange(rows, dtype=np.int32))
    for rank in range(8):
        pl = experts.plan(jax.tree.map(jnp.asarray, recv), rank, 8)
        assert int(pl.count) == (1 if rank == 0 else 0)


def test_work_items_cover_every_pair_once():
    """The kernel's work list: chunks of <= 64 pairs of one expert, in expert order, covering every used pair once,
    then empty items, every row's word 3 the number of live ones; within its static bound."""
    rng = np.random.default_rng(3)
    for experts_, topk, t in ((4, 2, 200), (64, 8, 9), (16, 4, 1)):
        recv = random_received(rng, ranks=1, rank=0, tokens=t, max_tokens=t, latent=64, experts=experts_, topk=topk,
                               pad_tokens=0.1, duplicates=0.2)
        pl = experts.plan(jax.tree.map(jnp.asarray, recv), 0, experts_)
        work = np.asarray(work_items(pl))
        gs, count = np.asarray(pl.group_sizes), int(pl.count)
        assert work.shape == (min(experts_, pl.capacity) + pl.capacity // KERNEL_BLOCK_M, 4)
        live = work[:, 2] > 0
        assert np.all(live[: live.sum()]), "an empty item before a live one"
        offsets = np.concatenate([[0], np.cumsum(gs)])
        covered = np.zeros(count, int)
        assert np.all(work[:, 3] == live.sum()) and live.sum() > 0
        for g, first, rows, _ in work[live]:
            assert 1 <= rows <= KERNEL_BLOCK_M
            assert offsets[g] <= first and first + rows <= offsets[g + 1]
            covered[first : first + rows] += 1
        assert np.all(covered == 1)
        assert np.all(np.diff(work[live, 0]) >= 0)


def test_kernel_splits():
    """Few CTAs of work: the contraction splits (>= 4 steps each, covering it exactly); enough: one split."""
    for work, n_out, k in ((16, 1024, 3584), (4, 256, 2048), (896, 4096, 3584), (16, 3584, 512)):
        splits, per = _kernel_splits(work, n_out, k)
        assert per % 64 == 0 and (splits - 1) * per < k <= splits * per
        assert splits == 1 or (per // 64 >= 4 and work * n_out // 64 * (splits - 1) < KERNEL_MIN_UNITS)


def test_kernel_splits_follow_the_expected_experts():
    """The split count is chosen for `min(J, C, expected_pairs)` active experts: Kimi K3 at T = 1 (16 pairs expected
    of a capacity of 128 at N = 8) splits gate / up; with the capacity as the count it would not."""
    j, cap, inter, lat = 112, 128, 512, 3584
    assert _kernel_splits(min(j, cap), inter, lat)[0] == 1
    assert _kernel_splits(min(j, cap, 16 * 1), inter, lat)[0] > 1


def test_expected_pairs_leaves_xla_results_alone():
    """`expected_pairs` only steers the kernel's work split: the XLA implementations give the same bits."""
    recv, weights = _case("expected-pairs", *CASES[0])
    pl = experts.plan(jax.tree.map(jnp.asarray, recv), CASES[0][1], weights[2].shape[0], max_tokens=CASES[0][3],
                      ranks=CASES[0][0])
    run = lambda hint: np.asarray(experts.swiglu(jax.tree.map(jnp.asarray, recv), pl, *weights,  # noqa: E731
                                                 impl="ragged_dot", expected_pairs=hint), np.float32)
    np.testing.assert_array_equal(run(None), run(1))


@pytest.mark.skipif(any(d.platform == "gpu" for d in jax.devices()), reason="checks the CPU refusal")
def test_kernel_impl_needs_a_gpu():
    case = CASES[0]
    recv, weights = _case("cpu-refusal", *case)
    with pytest.raises(ValueError, match="runs on NVIDIA GPUs"):
        _run(recv, weights, case[1], case[3], case[0], "kernel")


def test_one_launch_where_gate_up_is_split():
    """`swiglu(impl="kernel")` takes the one-launch stage exactly where gate / up's contraction is split (few
    experts expected active) and its weights are bf16 gate and up of their own with L % 128 == 0."""
    spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)  # noqa: E731
    rng = np.random.default_rng(5)
    recv = jax.tree.map(jnp.asarray, random_received(rng, ranks=2, rank=0, tokens=8, max_tokens=8, latent=3584,
                                                     experts=896, topk=16))
    pl = experts.plan(recv, 0, 448, max_tokens=8, ranks=2)
    gate = spec(448, 3584, 512)
    assert _stage_fits(pl, gate, gate, 1 * 16)  # T = 1
    assert not _stage_fits(pl, gate, gate, 8 * 16)  # T = 8: 128 experts, no split
    assert not _stage_fits(pl, spec(448, 3584, 1024), None, 16)  # fused gate-up weights
    assert not _stage_fits(pl, experts.quantize_fp8(np.zeros((1, 128, 128), np.float32)), gate, 16)


@pytest.mark.parametrize("ranks,max_tokens,inter,fits", [
    (2, 1, 512, True), (8, 2, 512, True), (1, 16, 512, True),  # at most 16 pairs an expert, 8 splits of 448
    (1, 17, 512, False), (8, 3, 512, False),  # an expert may have more pairs than one row tile
    (2, 1, 2048, False),  # gate / up split in 2 x 1792 rows: past the `a` region
])
def test_one_launch_only_where_items_fit_a_row_tile(ranks, max_tokens, inter, fits):
    """The one launch also needs what its shared memory takes: no local expert with more pairs than
    `abi.STAGE_DIRECT_PAIRS` (the plan's rows, `N * max_tokens`) and a gate / up split of at most
    `abi.STAGE_DIRECT_K` rows; elsewhere the two launches run."""
    spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)  # noqa: E731
    rng = np.random.default_rng(ranks * 100 + max_tokens)
    recv = jax.tree.map(jnp.asarray, random_received(rng, ranks=ranks, rank=0, tokens=max_tokens, max_tokens=max_tokens,
                                                     latent=3584, experts=896, topk=16))
    pl = experts.plan(recv, 0, 896 // ranks, max_tokens=max_tokens, ranks=ranks)
    gate = spec(896 // ranks, 3584, inter)
    assert _stage_fits(pl, gate, gate, 16) == fits


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_scan_gradient_is_the_dense_one(fmt):
    """`jax.grad` through "scan" (rematerialized steps over the work list) against `jax.grad` through "dense" (every
    expert on every row), with respect to the rows and the weights: relative L2 within 1e-2 (their FP32 sums run in
    different orders, and a bf16 rounding of `h` may flip)."""
    case = CASES[2]
    n, rank, tokens, mt, lat, e, k, inter = case
    recv, weights = _case(f"scan-grad/{fmt}", *case)
    recv = jax.tree.map(jnp.asarray, recv)
    if fmt == "int8":
        rng = np.random.default_rng(9)
        weights = [jax.tree.map(jnp.asarray, random_int8_weights(rng, *w.shape)) for w in weights]
    else:
        weights = [jnp.asarray(w) for w in weights]
    pl = experts.plan(recv, rank, e // n, max_tokens=mt, ranks=n)
    xb = activations(recv)
    target = jnp.asarray(np.random.default_rng(3).standard_normal((xb.shape[0], lat)), jnp.float32)

    def grads(impl):
        def loss(xb, *w):
            y = experts.swiglu_rows(pl, xb, *w, impl=impl).astype(jnp.float32)
            return jnp.sum((y - target) ** 2)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), allow_int=True))(xb, *weights)

    floats = lambda g: [a for a in jax.tree.leaves(g) if jnp.issubdtype(a.dtype, jnp.floating)]  # noqa: E731
    for name, g, r in zip(("rows", "w_gate", "w_up", "w_down"), grads("scan"), grads("dense")):
        g, r = floats(g)[-1], floats(r)[-1]  # int8 weights: the gradient of their scales
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        assert np.any(r != 0), name
        assert np.linalg.norm(g - r) / np.linalg.norm(r) < 1e-2, name


def test_scan_memory_follows_the_pairs():
    """At Kimi K3's sizes (N = 8, 1,024 tokens a rank: J = 112, L = 3584, I = 2048, a capacity of 131,072 pairs)
    the "scan" forward and its gradient compile on the CPU within 16 GB of temporaries (no `[C, L, I]`)."""
    from jax_latent_ep.experts.planning import Plan, capacity

    n, t, lat, inter, k, j = 8, 1024, 3584, 2048, 16, 112
    cap, rows = capacity(n, t, k, j), n * t
    s = jax.ShapeDtypeStruct
    pl = Plan(s((cap,), jnp.int32), s((cap,), jnp.int32), s((cap,), jnp.float32), s((j,), jnp.int32),
              s((), jnp.int32), s((rows, k), jnp.int32))
    xb = s((rows, lat), jnp.bfloat16)
    w = (s((j, lat, inter), jnp.bfloat16), s((j, lat, inter), jnp.bfloat16), s((j, inter, lat), jnp.bfloat16))
    stage = lambda pl, xb, *w: experts.swiglu_rows(pl, xb, *w, impl="scan")  # noqa: E731
    fwd = jax.jit(stage).lower(pl, xb, *w).compile().memory_analysis().temp_size_in_bytes
    loss = lambda xb, wg, wu, wd, pl: jnp.sum(stage(pl, xb, wg, wu, wd).astype(jnp.float32))  # noqa: E731
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(xb, *w, pl).compile()
    bwd = grad.memory_analysis().temp_size_in_bytes
    assert fwd < 16e9 and bwd < 16e9, (fwd / 1e9, bwd / 1e9)


def _pairs_np(recv, rank, j, mt, n):
    """The plan's pairs `(row, local expert)` in its order (expert, then row): the first slot naming each."""
    pairs = _plan_np(recv, rank, j, mt, n)
    return sorted(pairs, key=lambda p: (p[1], p[0]))


@pytest.mark.parametrize("impl", ["ragged_dot", "scan", "dense"])
def test_capacity_factor_drops_and_counts(impl):
    """`capacity_factor`: a capacity that holds every pair gives the worst case's bits; a smaller one with
    `overflow="drop"` keeps the first pairs in expert order, counts the rest, and sums only the kept (the NumPy
    model on the same rows with the dropped pairs' ids removed)."""
    case = CASES[2]
    n, rank, tokens, mt, lat, e, k, inter = case
    recv, weights = _case(f"capacity/{impl}", *case)
    j = e // n
    pairs = _pairs_np(recv, rank, j, mt, n)
    recv_j = jax.tree.map(jnp.asarray, recv)

    def stage(factor):
        def f(r, *w):
            pl = experts.plan(r, rank, j, max_tokens=mt, ranks=n, capacity_factor=factor, overflow="drop")
            return experts.swiglu(r, pl, *w, impl=impl), pl.count, pl.dropped
        return jax.jit(f)(recv_j, *weights)

    worst = np.asarray(_run(recv, weights, rank, mt, n, impl))
    cap = experts.capacity(n, mt, k, j, 1.0)
    assert len(pairs) < cap < experts.capacity(n, mt, k, j)  # a factor of 1 holds these pairs: nothing dropped
    out, count, dropped = stage(1.0)
    assert int(count) == len(pairs) and int(dropped) == 0
    np.testing.assert_array_equal(np.asarray(out, np.float32), worst)

    factor = 0.5 * len(pairs) / (mt * k)  # half of them
    out, count, dropped = stage(factor)
    cap = experts.capacity(n, mt, k, j, factor)
    assert int(count) == cap and int(dropped) == len(pairs) - cap
    ids = np.array(recv.ids)
    for row, ex in pairs[cap:]:  # the dropped pairs: their slots name no local expert
        ids[row][ids[row] == rank * j + ex] = -1
    want = reference_swiglu(recv._replace(ids=ids), rank, *weights, max_tokens=mt, ranks=n).astype(np.float32)
    _assert_close(np.asarray(out, np.float32), want, f"{impl}, dropped pairs")


def test_capacity_overflow_error_names_rank_and_counts():
    from jax_latent_ep import host_checks

    case = CASES[2]
    n, rank, tokens, mt, lat, e, k, inter = case
    recv, weights = _case("capacity-error", *case)
    j, total = e // n, len(_plan_np(recv, rank, e // n, mt, n))
    plan_of = lambda factor: lambda r: experts.plan(r, rank, j, max_tokens=mt, ranks=n,  # noqa: E731
                                                     capacity_factor=factor).count
    cap = experts.capacity(n, mt, k, j, 0.25)
    step = host_checks.checked(jax.jit(plan_of(0.25)))
    with pytest.raises(experts.CapacityError, match=rf"{total} pairs reached rank {rank}, over its capacity of "
                                                     rf"{cap} \(capacity_factor=0.25\)"):
        step(jax.tree.map(jnp.asarray, recv))
    assert int(jax.jit(plan_of(None))(jax.tree.map(jnp.asarray, recv))) == total
    with pytest.raises(ValueError, match="capacity_factor=0 must be a positive number or None"):
        experts.plan(jax.tree.map(jnp.asarray, recv), rank, j, max_tokens=mt, ranks=n, capacity_factor=0)
    with pytest.raises(ValueError, match="overflow='clip' must be one of"):
        experts.plan(jax.tree.map(jnp.asarray, recv), rank, j, max_tokens=mt, ranks=n, overflow="clip")
