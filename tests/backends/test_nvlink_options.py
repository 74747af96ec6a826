"""NvlinkBackend's constructor options, checked before any GPU work (runs on CPU-only machines)."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from jax_latent_ep import KIMI_K3
from jax_latent_ep.backends.nvlink import NvlinkBackend


def _cpu_mesh():
    """A mesh of 2 CPU devices (skips without them): the backend gets past its option checks and refuses the devices."""
    try:
        cpus = jax.devices("cpu")
    except RuntimeError:
        cpus = []
    if len(cpus) < 2:
        pytest.skip(f"needs 2 CPU devices, have {len(cpus)}")
    return jax.make_mesh((2,), ("ep",), devices=cpus[:2])


@pytest.mark.parametrize("timeout_s", [float("inf"), float("-inf"), float("nan"), -1, -1e-9, 1e12, "x", "5", None,
                                       True, False, np.bool_(True)])
def test_timeout_s_must_be_a_finite_number_of_seconds(timeout_s):
    """Refused right after the axis checks, before any device is touched: a mesh needs only its shape here."""
    mesh = SimpleNamespace(shape={"ep": 2})
    with pytest.raises(ValueError, match=r"timeout_s=.* must be a finite number of seconds >= 0"):
        NvlinkBackend(mesh, "ep", 8, KIMI_K3, timeout_s=timeout_s)


@pytest.mark.parametrize("timeout_s", [0, 0.5, 5, np.float32(2.0), np.int64(3)])
def test_valid_timeout_s_passes_to_the_device_checks(timeout_s):
    """A valid timeout_s gets past the check: on CPU devices the backend then refuses the devices themselves."""
    mesh = _cpu_mesh()
    with pytest.raises(ValueError, match="compute capability") as info:
        NvlinkBackend(mesh, "ep", 8, KIMI_K3, timeout_s=timeout_s)
    assert "timeout_s" not in str(info.value)


def test_timeout_too_large_for_a_float_is_a_value_error():
    """An int beyond float range (math.isfinite raises OverflowError on it) is refused like any other bad value."""
    from types import SimpleNamespace

    from jax_latent_ep.backends.nvlink import NvlinkBackend

    mesh = SimpleNamespace(shape={"ep": 2}, axis_names=("ep",), devices=None)
    with pytest.raises(ValueError, match=r"timeout_s=.* must be a finite number of seconds >= 0"):
        NvlinkBackend(mesh, "ep", 8, KIMI_K3, timeout_s=10**400)


@pytest.mark.parametrize("max_tokens, grid", [(8192, None), (8192, 64), (300, (64, 64)), (65535, (1, 1))])
def test_t_is_bounded_by_max_tokens_alone(max_tokens, grid):
    """Any max_tokens < 65536 and a grid below it pass the option checks (the kernels loop over their tokens, the
    grid bounds nothing but co-residency): on CPU devices the backend then refuses the devices themselves."""
    mesh = _cpu_mesh()
    with pytest.raises(ValueError, match="compute capability") as info:
        NvlinkBackend(mesh, "ep", max_tokens, KIMI_K3, grid=grid)
    assert "grid" not in str(info.value) and "max_tokens" not in str(info.value)


def test_max_tokens_of_65536_is_refused():
    mesh = SimpleNamespace(shape={"ep": 2})
    with pytest.raises(ValueError, match=r"max_tokens=65536 must satisfy 1 <= max_tokens < 65536"):
        NvlinkBackend(mesh, "ep", 65536, KIMI_K3)
