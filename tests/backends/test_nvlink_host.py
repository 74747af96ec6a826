"""The NVLink backend's host side on stand-ins for the GPU state: grid rules, a CPU mesh refused, the grid bound at trace time, `status()` keyed by (group, rank), `check()`'s message for every error code, `close()` and the release of a dropped backend."""

from __future__ import annotations

import pathlib
import threading

import jax
import pytest

from jax_latent_ep.shapes import KIMI_K3

REPO = pathlib.Path(__file__).resolve().parents[2]




def test_default_grids():
    from jax_latent_ep.backends.nvlink import COMBINE_MIN_CTAS, DISPATCH_MIN_CTAS, NvlinkBackend, default_grids

    # min(N * stride(T), DISPATCH_MIN_CTAS), min(N * stride(T), COMBINE_MIN_CTAS): the call's rows, not the buffer's
    assert default_grids(1, 2) == (16, 16)
    assert default_grids(5, 8) == (64, 64)
    assert default_grids(64, 8) == (min(512, DISPATCH_MIN_CTAS), min(512, COMBINE_MIN_CTAS))
    assert default_grids(1000, 2) == (1000, 1000)  # one CTA per token where the device holds them all
    # Lowered to the co-residency bounds: the kernels loop over their tokens, so T may exceed the grid.
    assert default_grids(1000, 2, (528, 600)) == (528, 600)
    assert default_grids(8192, 1, (528, 528)) == (528, 528)
    assert default_grids(5, 8, (528, 528)) == (64, 64)  # below the bound: unchanged
    assert default_grids(64, 8, (100, 300)) == (100, min(512, COMBINE_MIN_CTAS))
    assert NvlinkBackend._check_grid(None) is None
    assert NvlinkBackend._check_grid(7) == (7, 7)
    assert NvlinkBackend._check_grid((3, 9)) == (3, 9)
    for bad in (0, (1,), (1, 0), True, 2.5):
        with pytest.raises(ValueError):
            NvlinkBackend._check_grid(bad)


def test_backend_refuses_cpu_mesh():
    from jax_latent_ep.backends.nvlink import NvlinkBackend

    devices = jax.devices()
    if devices[0].platform == "gpu":
        pytest.skip("this machine has GPUs")
    mesh = jax.make_mesh((2,), ("ep",), devices=devices[:2])
    with pytest.raises(ValueError, match="compute capability|CUDA"):
        NvlinkBackend(mesh, "ep", 8, KIMI_K3)


def test_grid_bound_is_checked_at_trace_time():
    from jax_latent_ep.backends.nvlink import NvlinkBackend

    nv = NvlinkBackend.__new__(NvlinkBackend)  # no GPU: only the grid rule's state
    nv.ranks, nv.max_tokens, nv._grid, nv.max_grids = 2, 8192, None, (396, 396)
    assert nv.grids(396) == (396, 396)
    # T above the co-residency bound: the default grids stop at the bound (each CTA loops over its tokens).
    assert nv.grids(397) == (396, 396)
    assert nv.grids(8192) == (396, 396)
    # A grid given to the constructor is used as it is, below T too.
    nv._grid = (64, 64)
    assert nv.grids(300) == (64, 64)
    assert nv.grids(8192) == (64, 64)
    nv._grid = (1, 3)
    assert nv.grids(5) == (1, 3)
    # ... but never above the bound, which the message names.
    nv._grid = (10, 500)
    with pytest.raises(ValueError, match=r"grid=500 CTAs for the combine kernel, but only 396 fit"):
        nv.grids(5)
    nv._grid = (397, 10)
    with pytest.raises(ValueError, match=r"grid=397 CTAs for the dispatch kernel, but only 396 fit"):
        nv.grids(1)


class FakeBuffers:
    """Stands in for SymmetricBuffers: local ranks with fixed error records; close() is logged."""

    def __init__(self, records, log=None):
        self.records, self.log = dict(records), log if log is not None else []
        self.local = [SimpleRank(r) for r in sorted(records)]
        self.closed = threading.Event()

    def status(self, rank):
        return self.records[rank]

    def close(self):
        self.log.append(("free", sorted(self.records)))
        self.closed.set()


class SimpleRank:  # a LocalRank stand-in
    def __init__(self, rank):
        self.rank = rank


def _stand_in(buffers, groups, registered=(), log=None, monkeypatch=None):
    from jax_latent_ep.runtime import ffi
    from jax_latent_ep.backends.nvlink import NvlinkBackend

    nv = NvlinkBackend.__new__(NvlinkBackend)  # no GPU: only the state status / check / close use
    nv.instance, nv.axis_name, nv._closed = 424242, "ep", False
    nv._buffers, nv._group_index, nv._registered = list(buffers), list(groups), list(registered)
    if monkeypatch is not None:
        monkeypatch.setattr(ffi, "unregister_rank",
                            lambda instance, ordinal: log.append(("unregister", instance, ordinal)))
    nv._track()
    return nv


def test_status_keys_by_group_and_rank():
    """Two EP groups in one process (a 2 x 2 ("dp", "ep") mesh): equal ranks no longer overwrite each other."""
    nv = _stand_in([FakeBuffers({0: (0, 0, 0, 0), 1: (0, 0, 0, 0)}),
                    FakeBuffers({0: (0, 0, 0, 0), 1: (2, 1, 0, 7)})], [0, 1])
    assert nv.status() == {(0, 0): (0, 0, 0, 0), (0, 1): (0, 0, 0, 0), (1, 0): (0, 0, 0, 0), (1, 1): (2, 1, 0, 7)}
    with pytest.raises(RuntimeError) as info:
        nv.check()
    assert str(info.value) == ("jax_latent_ep: combine on rank 1 timed out waiting for rank 0 at layer 7 "
                               "(group 1, error code 2)")


@pytest.mark.parametrize("record, message", [
    ((1, 0, 1, 3), "dispatch on rank 0 timed out waiting for rank 1 at layer 3 (group 0, error code 1)"),
    ((2, 1, 0, 4), "combine on rank 1 timed out waiting for rank 0 at layer 4 (group 0, error code 2)"),
    ((3, 1, 1, 5), "dispatch called twice without a combine on rank 1 at layer 5 (group 0, error code 3)"),
    # code 4: the kernel records the last dispatched layer; a combine before any dispatch records all ones.
    ((4, 0, 0, 0xFFFFFFFF), "combine called without its dispatch on rank 0 at layer 0 (group 0, error code 4)"),
    ((4, 0, 0, 2), "combine called without its dispatch on rank 0 at layer 3 (group 0, error code 4)"),
    ((9, 0, 1, 2), "unknown error on rank 0 (peer 1) at layer 2 (group 0, error code 9)"),
])
def test_check_names_every_error_code(record, message):
    rank = record[1]
    nv = _stand_in([FakeBuffers({rank: record, 1 - rank: (0, 0, 0, 0)})], [0])
    with pytest.raises(RuntimeError) as info:
        nv.check()
    assert str(info.value) == "jax_latent_ep: " + message


def test_check_passes_and_reports_every_failed_rank():
    nv = _stand_in([FakeBuffers({0: (0, 0, 0, 0), 1: (0, 0, 0, 0)})], [0])
    nv.check()
    nv = _stand_in([FakeBuffers({0: (3, 0, 0, 2), 1: (1, 1, 0, 2)})], [0])
    with pytest.raises(RuntimeError, match=r"dispatch called twice .* on rank 0 .*; dispatch on rank 1 timed out"):
        nv.check()


def test_close_unregisters_before_freeing_and_refuses_later_calls(monkeypatch):
    log = []
    nv = _stand_in([FakeBuffers({0: (0,) * 4}, log), FakeBuffers({1: (0,) * 4}, log)], [0, 0], registered=[0, 1],
                   log=log, monkeypatch=monkeypatch)
    nv.close()
    assert log == [("unregister", 424242, 0), ("unregister", 424242, 1), ("free", [0]), ("free", [1])]
    assert nv.status() == {}
    nv.close()  # idempotent
    assert len(log) == 4
    for call in (lambda: nv.dispatch(None, None, None), lambda: nv.combine(None, None)):
        with pytest.raises(ValueError, match="NvlinkBackend is closed"):
            call()
    del nv
    import gc

    gc.collect()
    assert len(log) == 4  # no second release by the finalizer


def test_dropped_backend_is_released(monkeypatch):
    """Garbage collection releases a backend not closed: unregistered at once, buffers closed off-thread."""
    import gc

    log = []
    bufs = FakeBuffers({0: (0,) * 4}, log)
    nv = _stand_in([bufs], [0], registered=[3], log=log, monkeypatch=monkeypatch)
    del nv
    gc.collect()
    assert bufs.closed.wait(10), log
    assert log == [("unregister", 424242, 3), ("free", [0])]
