"""A dead process ends its job on the NVLink backend too: the cases of tests/testing/test_dead_process.py, two
processes that share GPU 0 (one rank each, their symmetric buffers exchanged by CUDA IPC within the device, their
kernels time-sliced), the nvlink kernels' waits bounded by `timeout_s` = 5 s. Process 0 must end by itself, within
the bound, with an error that names process 1: the watcher's (process 1 raised), the heartbeat's, or a kernel
timeout naming rank 1 (SIGKILL: whichever comes first)."""

import re
import signal
import time

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess]

#: The liveness bound (as tests/testing/test_dead_process.py).
BOUND_S = 10
#: The shape of the prebuilt GPU test cubins (.kernel_cache): L, E, K.
SHAPE = dict(latent=512, experts=64, topk=4)


@pytest.mark.parametrize("when", ["before_first_collective", "after_warmup", "sigkill"])
def test_dead_process_ends_the_nvlink_job(when):
    from jax_latent_ep.testing.launcher import run

    start = time.monotonic()
    target = __file__.replace("gpu/test_dead_process_nvlink.py", "testing/test_dead_process.py") + ":worker_dies"
    (code0, log0, end0), (code1, log1, _) = run(target, 2, timeout=BOUND_S + 40, liveness_s=BOUND_S, gpus=[0],
                                                args=dict(when=when, backend="nvlink", shape=SHAPE))
    found = re.search(r"DEATH ([0-9.]+)", log1)
    assert found, f"process 1 did not reach its death:\n{log1}\n---- process 0:\n{log0}"
    assert code0 not in (None, 0), f"process 0 did not end by itself (status {code0}):\n{log0}"
    took = end0 - float(found.group(1))
    print(f"nvlink {when}: process 0 ended {took:.1f} s after process 1 died (status {code0})")
    assert took < BOUND_S + 5, f"{took:.1f} s:\n{log0}"
    if when != "before_first_collective":
        assert "warm-up layer done" in log0, log0
    if when == "sigkill":
        assert code1 == -signal.SIGKILL
        assert re.search(r"tasks are unhealthy \(stopped sending heartbeats\):\s*1\b|Task 1 heartbeat timeout|"
                         r"on rank 0 timed out waiting for rank 1", log0), log0
    else:
        assert code1 == 1, log1
        assert f"process 1 failed: RuntimeError: deliberate failure of process 1 ({when})" in log0, log0
    assert time.monotonic() - start < BOUND_S + 40
