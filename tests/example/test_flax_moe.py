"""examples/flax_moe.py: the Flax NNX latent MoE (experts sharded over `ep`, `ExpertParallel` inside
`jax.shard_map`) on 8 CPU devices against the same layers on one device, bit for bit (CPU XLA programs of equal
per-rank shapes compute identically)."""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import pytest

pytest.importorskip("flax", reason="flax is not installed (pip install .[flax])")

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "flax_moe.py"


def _example():
    spec = importlib.util.spec_from_file_location("flax_moe_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_flax_moe_matches_one_device_bit_for_bit():
    found = _example().run(backend="auto", layers=2, tokens=3, devices=jax.devices("cpu"))
    assert found["ranks"] == 8 and found["backend"] == "xla", found
    assert found["equal"] == 1.0 and found["max_rel"] == 0.0, found
