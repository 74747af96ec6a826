"""The expert stage on a GPU (`@pytest.mark.gpu`): every implementation, and ragged_dot with the Pallas-Triton
lowering, against the NumPy model at Kimi K3's L = 3584, K = 16 of 896 with padding and duplicates."""

import subprocess
import sys
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_latent_ep import experts
from jax_latent_ep.experts.kernel import KERNEL_BLOCK_M, _kernel_row_sums, _kernel_splits, _split_sum, _stage_fits
from jax_latent_ep.experts.stage import XLA_ROW_SUM_SLOTS, swiglu_rows
from jax_latent_ep.experts.xla import _glu, _row_sums, activations
from jax_latent_ep.numerics import mxfp8_quantize
from jax_latent_ep.testing.experts import random_fp8_weights, random_received, reference_swiglu

pytestmark = pytest.mark.gpu


def _close(got, want):
    # as tests/test_experts.py: 1 bf16 ulp + 1% of the row's largest value (GEMM accumulation order)
    tol = np.abs(want) * 2.0**-7 + 1e-2 * np.max(np.abs(want), axis=1, keepdims=True)
    assert np.all(np.abs(got - want) <= tol), float(np.max(np.abs(got - want) - tol))


def _check_k3(rng, n, t, inter, w, impl):
    """The stage on a rank's rows at K3's sizes (padded tokens and slots, duplicates, a different live count per
    source) with weights `w(*shape)` against the NumPy model."""
    recv = random_received(rng, ranks=n, rank=1, tokens=[t - (s % t) for s in range(n)], max_tokens=t,
                           latent=3584, experts=896, topk=16, pad_tokens=0.1, pad_slots=0.1, duplicates=0.3)
    j = 896 // n
    ws = (w(j, 3584, inter), w(j, 3584, inter), w(j, inter, 3584))
    fn = jax.jit(lambda r, a, b, c: experts.expert_stage(r, 1, a, b, c, impl=impl, max_tokens=t, ranks=n))
    got = np.asarray(fn(jax.tree.map(jnp.asarray, recv), *ws), np.float32)
    want = reference_swiglu(recv, 1, *ws, max_tokens=t, ranks=n).astype(np.float32)
    assert np.any(want != 0)
    assert np.all(got[np.asarray(recv.src) == -1] == 0)
    _close(got, want)


@pytest.mark.parametrize("impl", sorted(experts.IMPLEMENTATIONS))
@pytest.mark.parametrize("n,t", [(2, 3), (8, 5)])
def test_k3_sizes(impl, n, t):
    rng = np.random.default_rng(n * 10 + t)
    w = lambda *s: (rng.standard_normal(s, np.float32) / np.sqrt(s[1])).astype(ml_dtypes.bfloat16)  # noqa: E731
    _check_k3(rng, n, t, 128, w, impl)


@pytest.mark.parametrize("n,t,subnormal", [(2, 3, False), (8, 5, False), (8, 4, True)])
def test_fp8_weights_k3_sizes(n, t, subnormal, impl="kernel"):
    """FP8 block-scaled weights at K3's L (random codes, zeros and subnormals among them; with `subnormal` every
    weight is zero or subnormal, which a flushing widening would zero) against the NumPy model."""
    rng = np.random.default_rng(100 + n * 10 + t)
    w = lambda *s: jax.tree.map(jnp.asarray, random_fp8_weights(rng, *s, subnormal_only=subnormal))  # noqa: E731
    _check_k3(rng, n, t, 256, w, impl)


def test_pallas_triton_lowering():
    """The same check in a fresh process with `jax_ragged_dot_use_gpu_pallas_triton_lowering`."""
    code = (
        "import jax; jax.config.update('jax_ragged_dot_use_gpu_pallas_triton_lowering', True)\n"
        "import sys; sys.argv = ['x']; import pytest\n"
        f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', {os.path.abspath(__file__)!r} + '::test_k3_sizes', "
        "'-k', 'ragged_dot']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if "No module named 'jax._src.lax.pallas_lowerings'" in proc.stdout + proc.stderr:
        pytest.skip("this jax has no Pallas-Triton lowering of ragged_dot (jax._src.lax.pallas_lowerings)")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("fused", [False, True])
def test_kernel_hot_experts_and_split_contraction(fused, fp8):
    """The grouped GEMM kernel where groups pass 64 pairs (several work items per expert), the contraction is split
    (L = 2048 over few CTAs), and gate / up come fused: against ragged_dot on the same plan (bf16 and FP8 weights)."""
    rng = np.random.default_rng(7 + fused + 2 * fp8)
    lat, e, k, t, inter = 2048, 4, 2, 200, 128
    recv = random_received(rng, ranks=1, rank=0, tokens=t, max_tokens=t, latent=lat, experts=e, topk=k,
                           pad_tokens=0.05, duplicates=0.2)
    w = lambda *s: (rng.standard_normal(s, np.float32) / np.sqrt(s[1])).astype(ml_dtypes.bfloat16)  # noqa: E731
    if fp8:
        w = lambda *s: jax.tree.map(jnp.asarray, random_fp8_weights(rng, *s))  # noqa: E731
    if fused:
        ws = (w(e, lat, 2 * inter), None, w(e, inter, lat))
    else:
        ws = (w(e, lat, inter), w(e, lat, inter), w(e, inter, lat))
    recv = jax.tree.map(jnp.asarray, recv)
    pl = experts.plan(recv, 0, e)
    assert int(np.max(np.asarray(pl.group_sizes))) > KERNEL_BLOCK_M
    assert _kernel_splits(min(e, pl.capacity), inter, lat, 128 if fp8 else 64)[0] > 1
    run = lambda impl: np.asarray(jax.jit(lambda r, p, a, c: experts.swiglu(r, p, a, ws[1], c, impl=impl))(  # noqa: E731
        recv, pl, ws[0], ws[2]), np.float32)
    got, want = run("kernel"), run("ragged_dot")
    assert np.any(want != 0)
    _close(got, want)


@pytest.mark.parametrize("inter,t", [(256, 1), (256, 2), (128, 3), (512, 1)])
def test_fused_stage_against_two_launches(inter, t):
    """The one launch (`experts.swiglu(impl="kernel")`: bf16 gate and up, gate / up split) against the two
    grouped-GEMM launches on the same plan (`swiglu_rows(impl="kernel")`, where XLA dequantizes, sums the splits and
    applies the SwiGLU), within the GEMM tolerance (the kernel's SiLU instead of XLA's moves the bf16 rounding of
    `h`); both against ragged_dot."""
    rng = np.random.default_rng(1000 + inter + t)
    lat, e, k = 1024, 64, 8
    recv = random_received(rng, ranks=2, rank=0, tokens=[t, t - 1 if t > 1 else t], max_tokens=t, latent=lat,
                           experts=e, topk=k, pad_tokens=0.1, pad_slots=0.1, duplicates=0.2)
    w = lambda *s: jnp.asarray((rng.standard_normal(s, np.float32) / np.sqrt(s[1])).astype(ml_dtypes.bfloat16))  # noqa: E731
    ws = (w(e // 2, lat, inter), w(e // 2, lat, inter), w(e // 2, inter, lat))
    recv = jax.tree.map(jnp.asarray, recv)
    pl = experts.plan(recv, 0, e // 2, max_tokens=t, ranks=2, impl="kernel")
    assert _stage_fits(pl, *ws[:2], t * k)
    fused = np.asarray(jax.jit(lambda r, p, a, b, c: experts.swiglu(r, p, a, b, c, impl="kernel", expected_pairs=t * k))(
        recv, pl, *ws), np.float32)
    rows = lambda impl: np.asarray(jax.jit(lambda p, x, a, b, c: swiglu_rows(  # noqa: E731
        p, x, a, b, c, impl=impl, expected_pairs=t * k))(pl, activations(recv), *ws), np.float32)
    launches = rows("kernel")
    assert np.any(launches != 0)
    assert np.all(fused[np.asarray(recv.src) == -1] == 0)
    _close(fused, launches)
    _close(fused, rows("ragged_dot"))
    no_pair = np.all(np.asarray(pl.row_pairs) >= pl.capacity, axis=1)
    assert np.any(no_pair) and np.all(fused[no_pair] == 0)


def test_fused_stage_hot_rows_and_split_down(monkeypatch):
    """The one launch where work items hold many pairs (hot experts: one of 16 pairs, the most the launch takes,
    others of 9-12), down's contraction is split (I = 512) and gate / up's too (a small `expected_pairs`): against
    the two launches, the NumPy model and ragged_dot; with the row-sum kernel after it bit for bit as with XLA's row
    sum."""
    rng = np.random.default_rng(2024)
    lat, e, k, t, inter = 1024, 8, 4, 16, 512
    recv = random_received(rng, ranks=1, rank=0, tokens=t, max_tokens=t, latent=lat, experts=e, topk=k,
                           pad_tokens=0.0, pad_slots=0.1, duplicates=0.2)
    ids = np.array(recv.ids)
    ids[:, 0] = 0  # expert 0 in every row: a work item of 16 pairs
    recv = recv._replace(ids=ids)
    w = lambda *s: jnp.asarray((rng.standard_normal(s, np.float32) / np.sqrt(s[1])).astype(ml_dtypes.bfloat16))  # noqa: E731
    ws = (w(e, lat, inter), w(e, lat, inter), w(e, inter, lat))
    recv = jax.tree.map(jnp.asarray, recv)
    pl = experts.plan(recv, 0, e, impl="kernel")
    hint = 4
    assert int(np.max(np.asarray(pl.group_sizes))) == 16 and _stage_fits(pl, *ws[:2], hint)
    assert _kernel_splits(hint, lat, inter)[0] > 1
    fused = np.asarray(jax.jit(lambda r, p, a, b, c: experts.swiglu(r, p, a, b, c, impl="kernel", expected_pairs=hint))(
        recv, pl, *ws), np.float32)
    rows = lambda impl: np.asarray(jax.jit(lambda p, x, a, b, c: swiglu_rows(  # noqa: E731
        p, x, a, b, c, impl=impl, expected_pairs=hint))(pl, activations(recv), *ws), np.float32)
    want = reference_swiglu(jax.tree.map(np.asarray, recv), 0, *(np.asarray(a) for a in ws), max_tokens=t,
                            ranks=1).astype(np.float32)
    assert np.any(want != 0) and np.all(fused[np.asarray(recv.src) == -1] == 0)
    _close(fused, rows("kernel"))
    _close(fused, want)
    _close(fused, rows("ragged_dot"))
    assert pl.row_pairs.size <= XLA_ROW_SUM_SLOTS  # so `fused` took XLA's row sum
    monkeypatch.setattr("jax_latent_ep.experts.stage.XLA_ROW_SUM_SLOTS", 0)
    summed = np.asarray(jax.jit(lambda r, p, a, b, c: experts.swiglu(r, p, a, b, c, impl="kernel",
                                                                     expected_pairs=hint))(recv, pl, *ws), np.float32)
    np.testing.assert_array_equal(summed, fused)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("n,t,lat,plan_impl", [(2, 3, 3584, "kernel"), (8, 5, 1056, "xla"), (1, 40, 3584, "kernel")])
def test_row_sum_kernel_bit_exact(n, t, lat, plan_impl, splits):
    """The row-sum kernel (`experts.kernel._kernel_row_sums`) against XLA's `_row_sums` of `_split_sum` bit for bit on
    random partials (signed zeros among them; NaN in every pair no row names, which neither may add) over a plan
    with padded tokens and slots, duplicate ids, rows with no local expert and (N = 1) rows with up to 16 local
    experts; L = 1056 leaves a CTA's columns partly past the row."""
    rng = np.random.default_rng(3000 + 100 * n + t + splits)
    e, k = 64, 16
    recv = jax.tree.map(jnp.asarray, random_received(
        rng, ranks=n, rank=0, tokens=[t - (s % t) for s in range(n)], max_tokens=t, latent=lat, experts=e, topk=k,
        pad_tokens=0.1, pad_slots=0.1, duplicates=0.3))
    pl = experts.plan(recv, 0, e // n, max_tokens=t, ranks=n, impl=plan_impl)
    parts = rng.standard_normal((splits, pl.capacity, lat)).astype(np.float32)
    parts[rng.random(parts.shape) < 0.05] = -0.0
    named = np.unique(np.asarray(pl.row_pairs)[np.asarray(pl.row_pairs) < int(pl.count)])
    unnamed = np.setdiff1d(np.arange(pl.capacity), named)
    parts[:, unnamed] = np.nan
    parts = jnp.asarray(parts)
    got = np.asarray(jax.jit(_kernel_row_sums)(pl, parts))
    want = np.asarray(jax.jit(lambda p, y: _row_sums(p, _split_sum(y)))(pl, parts))
    rows = np.asarray(pl.row_pairs) < int(pl.count)
    assert np.any(rows.sum(axis=1) == 0) and np.any(rows.sum(axis=1) > 1) and unnamed.size > 0
    assert not np.any(np.isnan(want.astype(np.float32)))
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    assert np.all(got[rows.sum(axis=1) == 0].astype(np.float32) == 0)


def test_fused_stage_refuses_a_gate_split_past_its_shared_memory():
    """The FFI handler refuses a gate / up split longer than `abi.STAGE_DIRECT_K` rows (a unit's dequantized slice
    would not fit its `a` region), naming the value, before the kernel runs."""
    from jax_latent_ep.kernels import abi
    from jax_latent_ep.runtime import ffi

    rng = np.random.default_rng(7)
    lat, inter, j = 1024, 128, 4
    recv = jax.tree.map(jnp.asarray, random_received(rng, ranks=1, rank=0, tokens=2, max_tokens=2, latent=lat,
                                                     experts=j, topk=2))
    pl = experts.plan(recv, 0, j, impl="kernel")
    w = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32).astype(ml_dtypes.bfloat16))  # noqa: E731
    k_gate = 2 * abi.STAGE_DIRECT_K
    call = jax.jit(lambda r, p, a, b, c: ffi.expert_stage_call(r.x, r.sf, p.row, a, b, c, p.work, k_gate=k_gate,
                                                               k_down=inter))
    with pytest.raises(Exception, match=f"k_gate={k_gate} must be at most {abi.STAGE_DIRECT_K}"):
        jax.block_until_ready(call(recv, pl, w(j, lat, inter), w(j, lat, inter), w(j, inter, lat)))


@pytest.mark.parametrize("splits,fused", [(1, False), (3, False), (2, True)])
def test_swiglu_mxfp8_kernel_against_xla(splits, fused):
    """The FP8 / MXFP4 stage's SwiGLU-and-MXFP8 kernel against XLA's split sum, `_glu` and `mxfp8_quantize` on the
    used pairs (gate over 12 octaves, a zero block, a NaN): the kernel's silu is within FP32 ulps of XLA's, so
    `bf16(h)` may round the other way: at most 1 in 1,000 scales and elements differ, by one e4m3 step, and the
    rest are equal."""
    from jax_latent_ep.runtime import ffi

    ffi.load_expert_kernels({d for d in jax.local_devices() if d.platform == "gpu"})
    rng = np.random.default_rng(10 * splits + fused)
    pairs, inter, count = 300, 384, 237
    cols = 2 * inter if fused else inter
    octave = 2.0 ** rng.integers(-6, 6, (1, pairs, cols // 32, 1))
    gate = (rng.standard_normal((splits, pairs, cols // 32, 32)) * octave).reshape(splits, pairs, cols)
    gate = gate.astype(np.float32)
    up = None if fused else rng.standard_normal((splits, pairs, inter)).astype(np.float32)
    gate[:, 5, :32] = 0  # silu(0) = 0: a zero block, scale code 0
    gate[0, 7, 40] = np.nan  # a NaN: its block's scale code 255
    q, sf = jax.jit(ffi.swiglu_mxfp8_call)(gate, up, jnp.array([count], jnp.int32))
    g = _split_sum(jnp.asarray(gate))
    h = _glu(g, None if fused else _split_sum(jnp.asarray(up)), inter)
    want_q, want_sf = (np.asarray(a)[:count] for a in mxfp8_quantize(h))
    got_q, got_sf = np.asarray(q)[:count], np.asarray(sf)[:count]
    assert got_sf[5, 0] == 0 and got_sf[7, 1] == 255 and np.isnan(got_q[7, 40].astype(np.float32))
    same_scale = (got_sf == want_sf).repeat(32, axis=1)
    assert np.mean(got_sf != want_sf) <= 1e-3
    a, b = got_q.astype(np.float32), want_q.astype(np.float32)
    equal = (a == b) | (np.isnan(a) & np.isnan(b))
    assert np.mean(~equal) <= 1e-3, np.mean(~equal)
    step = np.maximum(np.abs(b), 2.0**-6) * 2.0**-3  # one e4m3 step (3 mantissa bits; subnormals 2^-9)
    close = equal | (np.abs(a - b) <= step)
    assert np.all(close | ~same_scale)
