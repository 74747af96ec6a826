"""The example latent MoE: expert-parallel over N devices against the same model on one device."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import xla_devices
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_latent_ep import ExpertParallel, LatentMoEShape, moe


def run_both(n, t, cfg, scan=True, seed=0):
    """(got, got per layer, want per layer, h, platform): the sharded model's output bf16 [N*T, H] as float32,
    both programs' `(hs [Ly, N*T, H], ids [Ly, N*T, K])` (`per_layer=True`), as numpy, and the devices' platform
    (`conftest.xla_devices`: GPUs where there are N, else CPU devices)."""
    devices = xla_devices(n)
    mesh = jax.make_mesh((n,), ("ep",), devices=devices)
    params = moe.init_params(jax.random.key(seed), cfg)
    h = jax.random.normal(jax.random.key(seed + 1), (n * t, cfg.hidden), jnp.float32).astype(jnp.bfloat16)
    as_np = lambda a: np.asarray(a, np.float32) if a.dtype == jnp.bfloat16 else np.asarray(a)  # noqa: E731
    with ExpertParallel(mesh, "ep", max_tokens=t, shape=cfg.shape, backend="xla") as ep:
        sharded, h_in = moe.shard_params(params, mesh, "ep"), jax.device_put(h, NamedSharding(mesh, P("ep")))
        got = as_np(moe.make_forward(ep, cfg, scan=scan)(sharded, h_in))
        got_layers = jax.tree.map(as_np, moe.make_forward(ep, cfg, scan=scan, per_layer=True)(sharded, h_in))
    one = devices[0]
    reference = moe.make_reference_forward(cfg, n, per_layer=True)
    want_layers = jax.tree.map(as_np, reference(jax.device_put(params, one), jax.device_put(h, one)))
    return got, got_layers, want_layers, np.asarray(h, np.float32), devices[0].platform


@pytest.mark.parametrize("n,t,scan", [(1, 3, True), (2, 5, True), (4, 4, False), (8, 2, True)])
def test_sharded_matches_one_device(n, t, scan):
    cfg = moe.MoEConfig(shape=LatentMoEShape(latent=256, experts=32, topk=4), hidden=128, layers=3)
    got, (got_hs, got_ids), (want_hs, want_ids), h, platform = run_both(n, t, cfg, scan=scan, seed=n)
    assert np.all(np.isfinite(got))
    assert not np.array_equal(got, h), "the layers changed nothing"
    if platform == "cpu":
        # Same shapes per rank, same order of every sum: bit-identical (moe.reference_layer), every layer.
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_array_equal(got_hs, want_hs)
        np.testing.assert_array_equal(got, got_hs[-1])  # per_layer changes nothing
        return
    # GPUs: the two programs' GEMMs may sum in other orders, so a near-tie in a token's top-k may flip (the
    # token then differs arbitrarily from that layer on). Tokens are independent: every token must match, layer
    # by layer, as long as both programs routed it to the same experts in this and every earlier layer.
    same = np.all(np.sort(got_ids, axis=-1) == np.sort(want_ids, axis=-1), axis=-1)  # [Ly, N*T]
    alike = np.cumprod(same, axis=0).astype(bool)
    err = np.max(np.abs(got_hs - want_hs) / (1 + np.abs(want_hs)), axis=-1)  # [Ly, N*T]
    bad = np.argwhere(alike & (err > 2e-2))
    assert bad.size == 0, f"(layer, token) routed alike but differing by > 2e-2: {bad.tolist()}"
    assert alike[-1].mean() >= 0.9, f"only {100 * alike[-1].mean():.0f}% of tokens routed alike in every layer"


def test_demo_runs():
    from jax_latent_ep.example import demo

    assert demo.main(["--layers", "2", "--steps", "2", "--tokens", "3"]) == 0


@pytest.mark.gpu
@pytest.mark.slow
def test_demo_on_gpus_runs_the_nvlink_backend():
    """The quick start's main job on GPUs: Kimi K3's shape, the NVLink backend chosen by `auto`, the result
    matching the single-device model (a fresh process: the suite's virtual CPU devices are not its business).
    Needs two GPUs: on one, `auto` picks the XLA backend (faster at N = 1)."""
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 2:
        pytest.skip(f"needs 2 GPUs (auto picks XLA at N = 1), have {len(gpus)}")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    run = subprocess.run([sys.executable, "-m", "jax_latent_ep.example.demo", "--layers", "2", "--steps", "2", "--tokens", "4"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "backend: nvlink" in run.stdout and "L=3584 E=896 K=16" in run.stdout, run.stdout[-3000:]
    assert "OK: matches the single-device model" in run.stdout, run.stdout[-3000:]


@pytest.mark.parametrize("n,t,live", [(2, 5, [5, 2]), (4, 4, [0, 4, 1, 3])])
def test_padded_tokens_per_rank(n, t, live):
    """A different live count on every rank: padded tokens (ids all -1) pass through each layer unchanged, and
    the sharded model equals the one-device model (bit for bit on CPU) with the same live counts."""
    cfg = moe.MoEConfig(shape=LatentMoEShape(latent=256, experts=32, topk=4), hidden=128, layers=2)
    devices = xla_devices(n)
    mesh = jax.make_mesh((n,), ("ep",), devices=devices)
    params = moe.init_params(jax.random.key(7 + n), cfg)
    h = jax.random.normal(jax.random.key(8 + n), (n * t, cfg.hidden), jnp.float32).astype(jnp.bfloat16)
    lv = np.asarray(live, np.int32)
    with ExpertParallel(mesh, "ep", max_tokens=t, shape=cfg.shape, backend="xla") as ep:
        fwd = moe.make_forward(ep, cfg, per_layer=True)
        hs, ids = fwd(moe.shard_params(params, mesh, "ep"), jax.device_put(h, NamedSharding(mesh, P("ep"))),
                      jax.device_put(lv, NamedSharding(mesh, P("ep"))))
    hs, ids = np.asarray(hs, np.float32), np.asarray(ids)
    padded = (np.arange(n * t) % t) >= np.repeat(lv, t)
    assert np.all(ids[:, padded] == -1) and np.all(ids[:, ~padded] >= 0)
    np.testing.assert_array_equal(hs[:, padded], np.broadcast_to(np.asarray(h, np.float32)[padded], hs[:, padded].shape))
    assert not np.array_equal(hs[-1, ~padded], np.asarray(h, np.float32)[~padded]), "the layers changed nothing"
    one = devices[0]
    want_hs, want_ids = moe.make_reference_forward(cfg, n, per_layer=True)(
        jax.device_put(params, one), jax.device_put(h, one), jax.device_put(lv, one))
    np.testing.assert_array_equal(ids, np.asarray(want_ids))
    if devices[0].platform == "cpu":
        np.testing.assert_array_equal(hs, np.asarray(want_hs, np.float32))
