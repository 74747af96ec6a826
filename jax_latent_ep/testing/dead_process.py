"""The dead-process check shared by the CPU (gloo) and the NVLink tests: two processes run ExpertParallel layers;
process 1 raises before the first collective, raises after a warm-up layer, or is SIGKILLed after it; process 0
must end by itself, within the liveness bound, with an error naming process 1 (`runtime.liveness`, set up by the
launcher)."""

from __future__ import annotations

import os
import re
import signal
import time

#: The CPU tests' shape (L, E, K).
SMALL = dict(latent=64, experts=8, topk=2)
#: The liveness bound of the tests (`liveness_s`; 60 s by default).
BOUND_S = 10
#: The three ways process 1 dies.
CASES = ("before_first_collective", "after_warmup", "sigkill")


def worker_dies(process_id, num_processes, when, backend="xla", shape=SMALL):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jax_latent_ep import ExpertParallel, LatentMoEShape

    def die():
        print(f"DEATH {time.time():.3f}", flush=True)
        if when == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"deliberate failure of process 1 ({when})")

    if process_id == 1 and when == "before_first_collective":
        die()
    shape = LatentMoEShape(**shape)
    mesh = jax.make_mesh((num_processes,), ("ep",), devices=jax.devices())
    ep = ExpertParallel(mesh, "ep", max_tokens=4, shape=shape, backend=backend)

    def layer(x, ids, w):
        recv = ep.dispatch(x, ids, w)
        return ep.combine(recv.x.astype(jnp.bfloat16)[:, :0].sum() + jnp.zeros((ep.rows, shape.latent), jnp.bfloat16)
                          + recv.weights[:, :1].astype(jnp.bfloat16), ids)

    f = jax.jit(jax.shard_map(layer, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))
    put = lambda a: jax.make_array_from_process_local_data(NamedSharding(mesh, P("ep")), a, (2 * a.shape[0], *a.shape[1:]))
    ids = np.arange(shape.topk, dtype=np.int32) * (shape.experts // shape.topk) + 1  # distinct, on both ranks
    args = (put(np.ones((4, shape.latent), jnp.bfloat16)), put(np.tile(ids[None], (4, 1))),
            put(np.ones((4, shape.topk), np.float32)))
    f(*args).block_until_ready()
    print("warm-up layer done", flush=True)
    if process_id == 1:
        die()
    for _ in range(1000):
        f(*args).block_until_ready()
        time.sleep(0.01)
    raise AssertionError("process 0 was not ended")


def check_dead_process(when: str, backend: str = "xla", shape: dict = SMALL, gpus=None) -> float:
    """Runs `worker_dies` in two processes (`gpus`: see `launcher.run`; None: CPU) and checks how process 0 ended;
    returns (and prints) the seconds from process 1's death to process 0's end."""
    from jax_latent_ep.testing.launcher import run

    start = time.monotonic()
    (code0, log0, end0), (code1, log1, _) = run(
        f"{__name__}:worker_dies", 2, timeout=BOUND_S + 40, liveness_s=BOUND_S, gpus=gpus,
        args=dict(when=when, backend=backend, shape=shape))
    found = re.search(r"DEATH ([0-9.]+)", log1)
    assert found, f"process 1 did not reach its death:\n{log1}\n---- process 0:\n{log0}"
    assert code0 not in (None, 0), f"process 0 did not end by itself (status {code0}):\n{log0}"
    took = end0 - float(found.group(1))
    print(f"{backend} {when}: process 0 ended {took:.1f} s after process 1 died (status {code0})")
    assert took < BOUND_S + 5, f"{took:.1f} s:\n{log0}"
    if backend == "nvlink" and when != "before_first_collective":
        assert "warm-up layer done" in log0, log0
    if when == "sigkill":
        assert code1 == -signal.SIGKILL
        # The NVLink survivor may end first by its kernel's bounded wait, which names the rank it waited for.
        kernel = r"|on rank 0 timed out waiting for rank 1" if backend == "nvlink" else ""
        assert re.search(r"tasks are unhealthy \(stopped sending heartbeats\):\s*1\b|Task 1 heartbeat timeout" + kernel,
                         log0), log0
    else:
        assert code1 == 1, log1
        assert f"process 1 failed: RuntimeError: deliberate failure of process 1 ({when})" in log0, log0
        if backend == "xla":  # either the watcher ends process 0, or its collective fails first naming process 1
            assert re.search(r"ending process 0: process 1 failed|then process 0 failed", log0), log0
    assert time.monotonic() - start < BOUND_S + 40
    return took
