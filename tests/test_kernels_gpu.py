"""The CuTe DSL kernels on real GPUs through the JAX-free harness (`tools.kernel_harness`): a few
hundred consecutive layers per setting, every receive row and combine output checked against numpy.

Needs an NVIDIA GPU, cuda-bindings and the AOT artifacts (`python -m jax_latent_ep.runtime.build`); each missing piece
skips the tests with the reason."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


def _gpu_count() -> int:
    try:
        from cuda.bindings import driver

        if driver.cuInit(0)[0] != driver.CUresult.CUDA_SUCCESS:
            return 0
        err, count = driver.cuDeviceGetCount()
    except Exception:  # no cuda-bindings, or no driver library (CPU-only machine)
        return 0
    return count if err == driver.CUresult.CUDA_SUCCESS else 0


def _artifacts_problem():
    try:
        from jax_latent_ep.runtime import artifacts, build
        out = artifacts.find(artifacts.MANIFEST).parent  # where the library and the harness read them
    except (ImportError, FileNotFoundError) as error:  # pragma: no cover
        return str(error)
    problems = build.check_installed(out, archs=("sm_90a",), complete=False)
    if problems:
        return problems[0]
    from tools.kernel_harness import Manifest

    try:
        manifest = Manifest()
        for n in (1, 2):
            manifest.entry("dispatch", "kimi_k3", n, "sm_90a")
            manifest.entry("combine", "kimi_k3", n, "sm_90a")
    except (FileNotFoundError, KeyError) as error:
        return str(error)
    return None


GPUS = _gpu_count()
PROBLEM = None if not GPUS else _artifacts_problem()
needs_gpu = pytest.mark.skipif(GPUS == 0, reason="needs an NVIDIA GPU and cuda-bindings")
needs_artifacts = pytest.mark.skipif(PROBLEM is not None, reason=f"kernel artifacts unusable: {PROBLEM}")


@needs_gpu
@needs_artifacts
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_virtual_ranks_one_gpu(ranks):
    from tools import kernel_harness as harness

    system = harness.System("kimi_k3", ranks, 32, "virtual")
    system.timeout_ns = 10_000_000_000
    layers, mismatches, info = harness.run_layers(system, 200, seed=ranks, nonfinite_every=25, log_every=0)
    assert (layers, mismatches) == (200, 0), info["details"]


@needs_gpu
@needs_artifacts
@pytest.mark.parametrize("ranks, grid_cap", [(1, 5), (2, 16), (4, 7)])
def test_virtual_ranks_grid_below_t(ranks, grid_cap):
    """Grids below T (`grid_cap` CTAs, T up to 64): CTA c stores the tokens c, c + G, ..., then its empty rows up to
    the largest T of the call (each rank draws its own T), and the combine reduces t = c, c + G, ...."""
    from tools import kernel_harness as harness

    system = harness.System("kimi_k3", ranks, 64, "virtual")
    system.grid_cap = grid_cap
    system.timeout_ns = 10_000_000_000
    layers, mismatches, info = harness.run_layers(system, 200, seed=10 + ranks, nonfinite_every=25, log_every=0)
    assert (layers, mismatches) == (200, 0), info["details"]


@needs_gpu
@needs_artifacts
@pytest.mark.skipif(GPUS < 2, reason="needs 2 NVIDIA GPUs")
def test_two_gpus():
    from tools import kernel_harness as harness

    system = harness.System("kimi_k3", 2, 64, "devices")
    system.timeout_ns = 10_000_000_000
    layers, mismatches, info = harness.run_layers(system, 300, seed=7, nonfinite_every=25, log_every=0)
    assert (layers, mismatches) == (300, 0), info["details"]


@needs_gpu
@needs_artifacts
@pytest.mark.parametrize("case, record", [("dispatch", "[1, 0, 1, 0]"), ("combine", "[2, 0, 1, 0]")])
def test_flag_timeout_reports_and_traps(case, record):
    # Rank 1 of two stops before its dispatch (or after it): rank 0's dispatch (combine) must trap with its record.
    # A separate process: the trap kills its CUDA context.
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    result = subprocess.run(
        [sys.executable, "-m", "tools.kernel_harness", "--mode", "timeout", "--timeout-case", case],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"status record {record}" in result.stdout


@needs_gpu
@needs_artifacts
@pytest.mark.parametrize("case, code", [("dispatch_twice", 3), ("combine_twice", 4)])
def test_call_out_of_sequence_writes_nothing(case, code):
    # Rank 0 of two virtual ranks repeats a call out of sequence: it must trap with its record, and rank 1's
    # buffer (in mapped host memory, read after the trap) must be byte for byte what it was. A separate
    # process: the trap kills its CUDA context (docs/protocol_checker.md: why a guard in CTA 0 alone would write).
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    result = subprocess.run(
        [sys.executable, "-m", "tools.kernel_harness", "--mode", "sequence", "--sequence-case", case],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"status record [{code}, 0, 0, " in result.stdout, result.stdout
    assert "0 of " in result.stdout and f"SEQUENCE TEST {case} PASS" in result.stdout, result.stdout
