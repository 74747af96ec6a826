"""Several JAX processes (CPU, gloo collectives) run dispatch / expert / combine layers through the XLA
backend; every rank checks its own results against the NumPy model. Also: a failing or hanging worker ends
the run with a clear AssertionError inside the timeout, showing every rank's log; and a process whose
symmetric-buffer setup fails publishes an error record in jax.distributed's key-value store, so a peer
waiting for its buffer record fails at once naming it (the NVLink setup's record exchange, on CPU).

The worker functions below run in the launched processes (`launcher.launch("<this file>:worker_...")`).
"""

import time

import pytest

SMALL = dict(latent=256, experts=32, topk=4)


def worker_layers(process_id, num_processes, ranks, tokens, max_tokens, calls, seed):
    """`calls` x two layers (dispatch, expert, combine; the second normed) on a mesh of all devices."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jax_latent_ep import ExpertParallel, LatentMoEShape
    from jax_latent_ep.testing import check

    shape = LatentMoEShape(**SMALL)
    assert jax.device_count() == ranks, (jax.device_count(), ranks)
    mesh = jax.make_mesh((ranks,), ("ep",), devices=jax.devices())
    mine = [list(mesh.devices.flat).index(d) for d in jax.local_devices()]
    ep = ExpertParallel(mesh, "ep", max_tokens=max_tokens, shape=shape, backend="xla")
    spec = P("ep")
    fn = jax.jit(jax.shard_map(check.two_layers(ep), mesh=mesh, in_specs=(spec,) * 4 + (P(),), out_specs=spec))
    rows = ranks * (-(-max_tokens // 8) * 8)

    def global_array(per_rank, s):
        """Global array from the stacked per-rank data [N, m, ...]: this process supplies its ranks' rows."""
        sharding = NamedSharding(mesh, s)
        if s == P():
            return jax.make_array_from_process_local_data(sharding, per_rank)
        local = np.concatenate([per_rank[r] for r in mine])
        shape_ = (per_rank.shape[0] * per_rank.shape[1], *per_rank.shape[2:])
        return jax.make_array_from_process_local_data(sharding, local, shape_)

    for call in range(calls):
        case = check.make_case(seed + call, shape, ranks, tokens, max_tokens, ["random_topk", "skewed", "duplicates"][call % 3])
        junk = np.moveaxis(case.junk, 0, 1)  # [N, 2, rows, L]
        args = [global_array(case.x, spec), global_array(case.ids, spec), global_array(case.weights, spec),
                global_array(junk, spec), global_array(case.norm_weight, P())]
        recv1, routed, recv2, normed = fn(*args)
        want = check.model_two_layers(case)

        def mine_of(a, m):
            shards = {s.device: np.asarray(s.data) for s in a.addressable_shards}
            return {r: shards[mesh.devices.flat[r]] for r in mine}

        got = [mine_of(a, rows) for a in recv1], mine_of(routed, tokens), [mine_of(a, rows) for a in recv2], mine_of(normed, tokens)
        for r in mine:
            stats = check.compare_rank(
                (tuple(a[r] for a in got[0]), got[1][r], tuple(a[r] for a in got[2]), got[3][r]), want, r)
            print(f"call {call} rank {r}: bit-exact vs model {stats}", flush=True)


def worker_fail(process_id, num_processes):
    """Rank 1 fails; rank 0 would wait in a collective for it forever."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    if process_id == 1:
        raise RuntimeError("deliberate failure on rank 1")
    mesh = jax.make_mesh((num_processes,), ("ep",), devices=jax.devices())
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("ep")), jnp.ones((1,)), (num_processes,))
    jax.jit(lambda a: a.sum())(x).block_until_ready()
    time.sleep(3600)


def worker_setup_failure(process_id, num_processes):
    """Process 1 fails before publishing its buffer record; process 0 waits for it (300 s allowed)."""
    from jax._src import distributed

    from jax_latent_ep.runtime.symmetric import PeerSetupError, RankRecord, exchange_records, publish_failure

    client = distributed.global_state.client
    key = "test/setup_failure"
    if process_id == 1:
        time.sleep(1)  # process 0 is waiting by now
        written = publish_failure(client, key, [1], process_id, LookupError("no compiled kernel (deliberate)"))
        print(f"published error records for ranks {written}", flush=True)
        again = publish_failure(client, key, [1], process_id, "a second failure")
        assert again == [], f"the store let a record be overwritten: {again}"  # records are never replaced
        return
    mine = {0: RankRecord(0, 2, 8, 256, 32, 4, process_id, 1 << 20, bytes(64))}
    start = time.monotonic()
    try:
        exchange_records(client, key, mine, 2, kv_timeout_s=300)
    except PeerSetupError as e:
        print(f"peer failure after {time.monotonic() - start:.1f} s: {e}", flush=True)
    else:
        raise AssertionError("process 1's error record was not recognized")


def worker_hang(process_id, num_processes):
    """Every rank hangs."""
    print(f"rank {process_id} about to hang", flush=True)
    time.sleep(3600)


@pytest.mark.multiprocess
@pytest.mark.parametrize("processes,devices_per_process", [(2, 1), (4, 1), (2, 2)])
def test_layers_across_processes(processes, devices_per_process):
    from jax_latent_ep.testing.launcher import launch

    ranks = processes * devices_per_process
    logs = launch(f"{__file__}:worker_layers", processes, timeout=240, devices_per_process=devices_per_process,
                  args=dict(ranks=ranks, tokens=5, max_tokens=13, calls=3, seed=1000 * processes + devices_per_process))
    for pid, log in enumerate(logs):
        assert log.count("bit-exact vs model") == 3 * devices_per_process, log
        assert f"process {pid} done" in log, log


def test_failure_headline_names_the_failing_rank():
    """A rank its watcher ended on another's failure is not reported as failed, even when both exits are seen
    in one poll; without such a line every failed rank is named."""
    from jax_latent_ep.testing.launcher import _failure_headline

    texts = ["jax_latent_ep: ending process 0: process 1 failed: RuntimeError: x\n", "RuntimeError: x\n"]
    assert "rank(s) [1] failed; rank(s) [0] ended on that failure" in _failure_headline("t", [0, 1], texts)
    assert "rank(s) [0, 1] failed (" in _failure_headline("t", [0, 1], ["a\n", "b\n"])
    assert "rank(s) [1] failed (" in _failure_headline("t", [1], texts)


@pytest.mark.multiprocess
def test_failing_worker_fails_fast():
    from jax_latent_ep.testing.launcher import launch

    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        launch(f"{__file__}:worker_fail", 2, timeout=90)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "rank(s) [1] failed" in message and "deliberate failure on rank 1" in message, message
    assert "----- rank 0:" in message and "----- rank 1:" in message
    assert elapsed < 30, f"took {elapsed:.0f} s"


@pytest.mark.multiprocess
def test_setup_failure_reaches_the_peer_at_once():
    from jax_latent_ep.testing.launcher import launch

    start = time.monotonic()
    logs = launch(f"{__file__}:worker_setup_failure", 2, timeout=90)
    elapsed = time.monotonic() - start
    assert "published error records for ranks [1]" in logs[1], logs[1]
    assert ("process 1 failed while setting up rank 1 of expert-parallel group 'test/setup_failure': "
            "LookupError: no compiled kernel (deliberate)") in logs[0], logs[0]
    assert elapsed < 60, f"took {elapsed:.0f} s"


@pytest.mark.multiprocess
def test_hanging_worker_times_out():
    from jax_latent_ep.testing.launcher import launch

    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        launch(f"{__file__}:worker_hang", 2, timeout=15)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "timed out after 15 s" in message and "rank 1 about to hang" in message, message
    assert elapsed < 15 + 20, f"took {elapsed:.0f} s"
