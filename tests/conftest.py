"""Test setup: 8 virtual CPU devices (set before JAX is imported) and the `gpu` skip helper."""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402


def cuda_devices():
    """The CUDA GPUs JAX sees (empty on CPU-only machines)."""
    try:
        return [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        return []


def xla_devices(count: int):
    """`count` devices for the XLA backend: JAX's default ones (GPUs on a GPU machine) when there are that many,
    else the 8 virtual CPU devices set up above (so a one-GPU machine still runs the multi-rank XLA tests);
    skips the test when neither has `count`."""
    for devices in (jax.devices(), jax.devices("cpu")):
        if len(devices) >= count:
            return devices[:count]
    pytest.skip(f"needs {count} devices, have {len(jax.devices())} (and {len(jax.devices('cpu'))} CPU devices)")


def have_gpus(count: int = 1) -> bool:
    return len(cuda_devices()) >= count


def skip_unless_gpus(count: int = 1):
    """`pytest.mark.skipif` for tests that need `count` NVIDIA GPUs."""
    return pytest.mark.skipif(not have_gpus(count), reason="needs NVIDIA GPUs")


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs NVIDIA GPUs")
    if not have_gpus():
        for item in items:
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(skip)
