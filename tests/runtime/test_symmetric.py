"""The rank records the symmetric buffers exchange between processes (config mismatches, missing ranks, the error record of a process whose setup failed and its publication, for every group of a backend)."""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import pytest

from jax_latent_ep.shapes import KIMI_K3
from jax_latent_ep.runtime import symmetric
from jax_latent_ep.runtime.symmetric import RankRecord, check_records

REPO = pathlib.Path(__file__).resolve().parents[2]




def _record(rank, **kw):
    base = dict(rank=rank, ranks=2, max_tokens=64, latent=3584, experts=896, topk=16, process=rank, bytes=1 << 20,
                handle=bytes(range(64)))
    base.update(kw)
    return RankRecord(**base)


def test_rank_record_roundtrip():
    rec = _record(1)
    assert RankRecord.decode(rec.encode()) == rec


def test_records_agree():
    check_records([_record(0), _record(1)], 2)


@pytest.mark.parametrize(
    "field, value, words",
    [("max_tokens", 32, ["max_tokens differs", "rank 0: 64", "rank 1: 32"]),
     ("ranks", 4, ["N differs"]),
     ("topk", 8, ["shape differs"])],
)
def test_records_disagree(field, value, words):
    with pytest.raises(ValueError) as info:
        check_records([_record(0), _record(1, **{field: value})], 2)
    for w in words:
        assert w in str(info.value)


def test_records_missing_rank():
    with pytest.raises(ValueError, match="one record per rank"):
        check_records([_record(0), _record(0)], 2)


class FakeKV:
    """jax.distributed's key-value client, in memory: a key is set once (the real store refuses overwrites)."""

    def __init__(self):
        self.store = {}

    def key_value_set_bytes(self, key, value, allow_overwrite=False):
        if key in self.store and not allow_overwrite:
            raise RuntimeError(f"ALREADY_EXISTS: {key}")
        self.store[key] = bytes(value)

    def blocking_key_value_get_bytes(self, key, timeout_in_ms):
        if key not in self.store:
            raise RuntimeError(f"DEADLINE_EXCEEDED: {key} after {timeout_in_ms} ms")
        return self.store[key]


class FakeDevice:
    platform = "gpu"
    compute_capability = "9.0"

    def __init__(self, process_index, id_):
        self.process_index, self.id = process_index, id_

    def __repr__(self):
        return f"FakeDevice({self.id}, process {self.process_index})"


def test_exchange_reads_every_rank():
    kv = FakeKV()
    kv.key_value_set_bytes(f"{symmetric.KV_PREFIX}/k/rank1", _record(1).encode())  # the other process's
    published = set()
    records = symmetric.exchange_records(kv, "k", {0: _record(0)}, 2, 1.0, published)
    assert records == {0: _record(0), 1: _record(1)} and published == {0}
    assert symmetric.decode_record(kv.store[f"{symmetric.KV_PREFIX}/k/rank0"]) == _record(0)


def test_exchange_fails_at_once_on_an_error_record():
    kv = FakeKV()
    written = symmetric.publish_failure(kv, "k", [1], 3, LookupError("no compiled dispatch kernel"))
    assert written == [1]
    with pytest.raises(symmetric.PeerSetupError) as info:
        symmetric.exchange_records(kv, "k", {0: _record(0)}, 2, 300.0)
    message = str(info.value)
    assert "process 3 failed while setting up rank 1 of expert-parallel group 'k'" in message, message
    assert "LookupError: no compiled dispatch kernel" in message, message


def test_error_record_never_replaces_a_record():
    kv = FakeKV()
    kv.key_value_set_bytes(f"{symmetric.KV_PREFIX}/k/rank0", _record(0).encode())
    assert symmetric.publish_failure(kv, "k", [0, 1], 0, "late failure") == [1]
    assert symmetric.decode_record(kv.store[f"{symmetric.KV_PREFIX}/k/rank0"]) == _record(0)
    assert symmetric.publish_failure(None, "k", [0], 0, "no client") == []


def test_exchange_times_out_naming_the_rank():
    with pytest.raises(symmetric.SymmetricMemoryError, match="rank 1 of group 'k' did not publish its buffer"):
        symmetric.exchange_records(FakeKV(), "k", {0: _record(0)}, 2, 0.01)


def test_symmetric_buffers_publish_an_error_record_on_failure(monkeypatch):
    """A process whose setup fails before publishing leaves an error record under its ranks' keys."""
    kv = FakeKV()
    monkeypatch.setattr(symmetric, "_distributed_client", lambda: kv)

    def no_driver():
        raise symmetric.SymmetricMemoryError("cuda-bindings missing (test)")

    monkeypatch.setattr(symmetric, "_driver", no_driver)
    me = jax.process_index()
    devices = [FakeDevice(me, 0), FakeDevice(me + 1, 1)]  # rank 0 here, rank 1 in another process
    with pytest.raises(symmetric.SymmetricMemoryError, match="cuda-bindings missing"):
        symmetric.SymmetricBuffers(devices, 8, KIMI_K3, key="9/0")
    assert list(kv.store) == [f"{symmetric.KV_PREFIX}/9/0/rank0"]
    with pytest.raises(symmetric.PeerSetupError, match=f"process {me} failed .*cuda-bindings missing"):
        symmetric.decode_record(kv.store[f"{symmetric.KV_PREFIX}/9/0/rank0"], "9/0")


def test_backend_publishes_error_records_for_every_group(monkeypatch):
    """NvlinkBackend failing before its buffers exist (no kernel here) still answers the peers of each group."""
    from types import SimpleNamespace

    from jax_latent_ep.backends import nvlink
    from jax_latent_ep.runtime import ffi

    kv = FakeKV()
    monkeypatch.setattr(nvlink, "_distributed_client", lambda: kv)

    def no_kernel(*args):
        raise LookupError("no compiled dispatch kernel for this test")

    monkeypatch.setattr(ffi, "find_kernel", no_kernel)
    me = jax.process_index()
    devices = np.empty((2, 2), object)  # ("dp", "ep"): this process drives rank 0 of both groups
    for g in range(2):
        for r in range(2):
            devices[g, r] = FakeDevice(me + r, 2 * g + r)
    mesh = SimpleNamespace(shape={"dp": 2, "ep": 2}, axis_names=("dp", "ep"), devices=devices)
    with pytest.raises(LookupError, match="no compiled dispatch kernel"):
        nvlink.NvlinkBackend(mesh, "ep", 8, KIMI_K3)
    keys = sorted(kv.store)
    assert len(keys) == 2 and keys[0].endswith("/0/rank0") and keys[1].endswith("/1/rank0"), keys
    for key in keys:
        with pytest.raises(symmetric.PeerSetupError, match=f"process {me} failed .*LookupError: no compiled"):
            symmetric.decode_record(kv.store[key])
