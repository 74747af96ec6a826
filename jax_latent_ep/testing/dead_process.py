"""The dead-process check shared by the CPU (gloo) and the NVLink tests: two processes run ExpertParallel layers;
process 1 raises before the first layer, raises after a warm-up layer, or is SIGKILLed after it; process 0 must end
by itself, within the liveness bound, with an error naming process 1 (`runtime.liveness`: set up by the launcher,
or, on the plain path, armed by the workers' `ExpertParallel` after a plain `jax.distributed.initialize`)."""

from __future__ import annotations

import os
import re
import signal
import time

#: The CPU tests' shape (L, E, K).
SMALL = dict(latent=64, experts=8, topk=2)
#: The liveness bound of the launcher-armed tests (`liveness_s`).
BOUND_S = 10
#: The plain path's bounds (the issue's promise): a raise ends the job within 10 s, a silent death within 60 s.
PLAIN_RAISE_S, PLAIN_SILENT_S = 10, 60
#: The three ways process 1 dies.
CASES = ("before_first_layer", "after_warmup", "sigkill")


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

    shape = LatentMoEShape(**shape)
    mesh = jax.make_mesh((num_processes,), ("ep",), devices=jax.devices())
    ep = ExpertParallel(mesh, "ep", max_tokens=4, shape=shape, backend=backend)
    if process_id == 1 and when == "before_first_layer":
        die()

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


def check_dead_process(when: str, backend: str = "xla", shape: dict = SMALL, gpus=None, plain: bool = False) -> float:
    """Runs `worker_dies` in two processes (`gpus`: see `launcher.run`; None: CPU; `plain`: a user's plain
    `jax.distributed.initialize`, see `launcher.run`) and checks how process 0 ended; returns (and prints) the
    seconds from process 1's death to process 0's end."""
    from jax_latent_ep.testing.launcher import run

    bound = (PLAIN_SILENT_S if when == "sigkill" else PLAIN_RAISE_S) if plain else BOUND_S + 5
    start = time.monotonic()
    (code0, log0, end0), (code1, log1, _) = run(
        f"{__name__}:worker_dies", 2, timeout=bound + 40, liveness_s=BOUND_S, gpus=gpus, plain=plain,
        args=dict(when=when, backend=backend, shape=shape))
    found = re.search(r"DEATH ([0-9.]+)", log1)
    assert found, f"process 1 did not reach its death:\n{log1}\n---- process 0:\n{log0}"
    assert code0 not in (None, 0), f"process 0 did not end by itself (status {code0}):\n{log0}"
    took = end0 - float(found.group(1))
    path = "plain path" if plain else "launcher-armed"
    print(f"{backend} {when} ({path}): process 0 ended {took:.1f} s after process 1 died (status {code0})")
    assert took < bound, f"{took:.1f} s:\n{log0}"
    if backend == "nvlink" and when != "before_first_layer":
        assert "warm-up layer done" in log0, log0
    if when == "sigkill":
        assert code1 == -signal.SIGKILL
        # The watcher's heartbeat check, the coordination service's (launcher-armed: the same bound), or the NVLink
        # survivor's kernel, whose bounded wait names the rank it waited for: whichever comes first.
        kernel = r"|on rank 0 timed out waiting for rank 1" if backend == "nvlink" else ""
        assert re.search(r"ending process 0: process 1 stopped its heartbeat|tasks are unhealthy \(stopped sending "
                         r"heartbeats\):\s*1\b|Task 1 heartbeat timeout" + kernel, log0), log0
    else:
        assert code1 == 1, log1
        assert f"process 1 failed: RuntimeError: deliberate failure of process 1 ({when})" in log0, log0
        if backend == "xla":  # either the watcher ends process 0, or its collective fails first naming process 1
            assert re.search(r"ending process 0: process 1 failed|then process 0 failed", log0), log0
    assert time.monotonic() - start < bound + 40
    return took
