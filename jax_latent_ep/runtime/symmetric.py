"""`SymmetricBuffers`: one EP group's symmetric buffers, peer tables and status pages, owned by this process.

Every rank of an expert-parallel group owns one buffer of `EpLayout.bytes` (plain `cuMemAlloc` on its
device's primary context, the one XLA uses), zeroed and armed like the seed's `EpBuffers`: every receive
row empty (`src = -1`, ids all `layout.invalid_expert(rank)`, weights 0), counters and flags 0. Each rank
also gets a device peer table, int64 `[N + 1]`: `peers[d]` is rank `d`'s buffer as mapped in this process
on this rank's device, `peers[N]` this rank's own buffer through its local mapping (a rank never reaches its
own buffer through a peer mapping). A host-mapped pinned page holds one 4-word error record per local rank
(`code, rank, peer, layer`, see docs/kernel_abi.md) that the host reads with no synchronization.

Two ways to drive a group, and any mix of them:
  * one process driving several local GPUs: a peer's buffer is its plain device pointer (unified
    addressing); peer access between the devices is enabled here (XLA already did it: answered
    PEER_ACCESS_ALREADY_ENABLED, which counts as success);
  * one process per GPU (jax.distributed): each rank's `cuIpcGetMemHandle` (64 bytes) and its
    configuration travel through jax.distributed's key-value store; every rank checks that all ranks agree
    on N, max_tokens and the shape, then opens the others' handles with
    `cuIpcOpenMemHandle(CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)`.
A rank publishes its handle only after its buffer is armed (and the device synchronized), and a process
builds its peer tables only after reading every rank's record, so no kernel can write into a peer buffer
before that peer was armed: the record exchange is the seed's post-arming barrier.

Setup failures in a multi-process group: a process whose setup fails before it published its records
publishes an error record under the same keys instead (`publish_failure`), so the other processes, waiting
for its records, fail at once with a `PeerSetupError` naming that process and its error rather than after
`kv_timeout_s`.

Memory is freed by `close()` (idempotent) or at interpreter exit for every object still alive then. An
object dropped without `close()` is not freed before the process ends (the registry of live objects is weak:
its memory stays allocated, unreachable, until the driver reclaims it at exit); owners that may be dropped
(`jax_latent_ep.backends.nvlink.NvlinkBackend`) close theirs when they are collected. Close only once every
computation that uses the buffers has finished on every rank (a peer may still be writing into this rank's
buffer).
Set `XLA_PYTHON_CLIENT_PREALLOCATE=false` (or a memory fraction) before JAX starts: XLA preallocates 75% of
each GPU by default, and these buffers are allocated outside XLA.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import json
import threading
import weakref

import numpy as np

from jax_latent_ep.shapes import LatentMoEShape, check_max_tokens
from jax_latent_ep.layout import EpLayout

#: Bytes of one rank's error record slot in the status page (4 int32 words used, one line each).
STATUS_SLOT = 128
#: Bytes of a CUDA IPC memory handle.
IPC_HANDLE_BYTES = 64
#: Prefix of every key this module writes to jax.distributed's key-value store.
KV_PREFIX = "jax_latent_ep/symmetric"

_CUDA_SUCCESS = 0
_CUDA_ERROR_OUT_OF_MEMORY = 2
_CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704


class SymmetricMemoryError(RuntimeError):
    """Setting up or tearing down symmetric memory failed (the message says which call, rank and device)."""


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as e:  # pragma: no cover - depends on the install
        raise SymmetricMemoryError(
            "jax_latent_ep's NVLink backend needs cuda-bindings (pip install 'jax_latent_ep[cuda13]' or "
            f"'cuda-bindings'): {e}"
        ) from None
    return driver


def _cuda_ready(drv) -> bool:
    try:
        return int(drv.cuInit(0)[0]) == _CUDA_SUCCESS
    except Exception:
        return False


def _check(result, what: str):
    """Unpacks a cuda.bindings result tuple `(CUresult, *values)`, raising on failure."""
    err, *values = result if isinstance(result, tuple) else (result,)
    code = int(err)
    if code != _CUDA_SUCCESS:
        drv = _driver()
        _, name = drv.cuGetErrorName(err)
        _, text = drv.cuGetErrorString(err)
        name = name.decode() if isinstance(name, bytes) else str(name)
        text = text.decode() if isinstance(text, bytes) else str(text)
        if code == _CUDA_ERROR_OUT_OF_MEMORY:
            raise MemoryError(
                f"{what}: {name}: {text}. The symmetric buffers are allocated outside XLA's pool: set "
                "XLA_PYTHON_CLIENT_PREALLOCATE=false (or XLA_PYTHON_CLIENT_MEM_FRACTION) before JAX starts, "
                "or lower max_tokens."
            )
        raise SymmetricMemoryError(f"{what}: {name} ({code}): {text}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


# ---------------------------------------------------------------------------------------------------------
# The per-rank record exchanged between processes (pure Python: tested on CPU).


@dataclasses.dataclass(frozen=True)
class RankRecord:
    """What a rank publishes: its configuration, where it runs and its buffer's IPC handle."""

    rank: int
    ranks: int
    max_tokens: int
    latent: int
    experts: int
    topk: int
    process: int
    bytes: int
    handle: bytes = b""  # IPC_HANDLE_BYTES, or empty where IPC is unused

    def encode(self) -> bytes:
        fields = dataclasses.asdict(self)
        fields["handle"] = self.handle.hex()
        return json.dumps(fields, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> "RankRecord":
        fields = json.loads(bytes(data).decode())
        fields["handle"] = bytes.fromhex(fields["handle"])
        return cls(**fields)

    @property
    def config(self) -> dict:
        return {
            "N": self.ranks,
            "max_tokens": self.max_tokens,
            "shape": (self.latent, self.experts, self.topk),
            "buffer bytes": self.bytes,
        }


def check_records(records: list[RankRecord], ranks: int) -> None:
    """Raises ValueError unless `records` has one record per rank `0..ranks-1` and all agree on the config.

    The message names every disagreeing field with each rank's value.
    """
    by_rank = {r.rank: r for r in records}
    if sorted(by_rank) != list(range(ranks)) or len(records) != ranks:
        raise ValueError(f"expected one record per rank 0..{ranks - 1}, got ranks {sorted(r.rank for r in records)}")
    ref = by_rank[0].config
    problems = []
    for key in ref:
        values = {r.rank: r.config[key] for r in records}
        if len({json.dumps(v) for v in values.values()}) > 1:
            per_rank = ", ".join(f"rank {k}: {v}" for k, v in sorted(values.items()))
            problems.append(f"{key} differs ({per_rank})")
    if problems:
        raise ValueError(
            "jax_latent_ep: the ranks of one expert-parallel group were configured differently: "
            + "; ".join(problems)
            + ". Every process must build the backend with the same mesh axis, max_tokens and shape, and "
            "create its backends in the same order."
        )


class PeerSetupError(SymmetricMemoryError):
    """Another process of the group failed while setting up its symmetric buffer (its error record says how)."""


def encode_failure(rank: int, process: int, error: BaseException | str) -> bytes:
    """The error record ("tombstone") a process publishes under rank `rank`'s key when its setup failed."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return json.dumps({"failed": True, "rank": rank, "process": process, "error": text}, sort_keys=True).encode()


def decode_record(data: bytes, key: str = "?") -> RankRecord:
    """A published `RankRecord`; raises PeerSetupError (naming the process and its error) for an error record."""
    fields = json.loads(bytes(data).decode())
    if fields.get("failed"):
        raise PeerSetupError(
            f"jax_latent_ep: process {fields.get('process')} failed while setting up rank {fields.get('rank')} of "
            f"expert-parallel group {key!r}: {fields.get('error')}"
        )
    return RankRecord.decode(data)


def _kv_name(key: str, rank: int) -> str:
    return f"{KV_PREFIX}/{key}/rank{rank}"


def publish_failure(client, key: str, ranks, process: int, error: BaseException | str) -> list[int]:
    """Publishes an error record under the key of every rank in `ranks` that has no record yet, so that the
    processes waiting for those ranks fail at once (naming this process and `error`) instead of after
    `kv_timeout_s`. Best effort, never raises; a key already published is left as it is. Returns the ranks
    whose error record was written. `client`: jax.distributed's client (None: nothing to do)."""
    written = []
    if client is None:
        return written
    for r in ranks:
        try:
            client.key_value_set_bytes(_kv_name(key, r), encode_failure(r, process, error))
        except Exception:  # already published (the store refuses to overwrite), or the store is gone
            continue
        written.append(r)
    return written


def exchange_records(client, key: str, mine: dict[int, RankRecord], ranks: int, kv_timeout_s: float,
                     published: set | None = None) -> dict[int, RankRecord]:
    """Publishes this process's records `mine` (`{rank: record}`) and reads every rank's `0..ranks-1`.

    Args:
      client: jax.distributed's client (`key_value_set_bytes`, `blocking_key_value_get_bytes`).
      key: the group's key (identical in every process).
      mine: the records of the ranks this process drives.
      ranks: N.
      kv_timeout_s: how long to wait for each other rank's record.
      published: if given, every rank whose record was published is added to it (as soon as it is).

    Raises:
      PeerSetupError: another process published an error record instead (it failed during its setup).
      SymmetricMemoryError: a rank's record did not come within `kv_timeout_s`.
    """
    for r, rec in sorted(mine.items()):
        client.key_value_set_bytes(_kv_name(key, r), rec.encode())
        if published is not None:
            published.add(r)
    records = {}
    timeout_ms = int(kv_timeout_s * 1000)
    for r in range(ranks):
        if r in mine:
            records[r] = mine[r]
            continue
        try:
            data = client.blocking_key_value_get_bytes(_kv_name(key, r), timeout_ms)
        except Exception as e:
            raise SymmetricMemoryError(
                f"rank {r} of group {key!r} did not publish its buffer within {kv_timeout_s} s "
                f"(did every process build the same backend?): {e}"
            ) from None
        records[r] = decode_record(data, key)
    return records


# ---------------------------------------------------------------------------------------------------------


def _distributed_client():
    """jax.distributed's client, or None in a single-process program."""
    try:
        from jax._src import distributed
    except ImportError:  # pragma: no cover
        return None
    return getattr(distributed.global_state, "client", None)


_live: "weakref.WeakSet[SymmetricBuffers]" = weakref.WeakSet()
_live_lock = threading.Lock()


@atexit.register
def _close_all():  # pragma: no cover - runs at interpreter exit
    with _live_lock:
        live = list(_live)
    for buffers in live:
        try:
            buffers.close()
        except Exception:
            pass


@dataclasses.dataclass
class LocalRank:
    """One rank of the group driven by this process."""

    rank: int
    device: object  # the jax Device
    ordinal: int  # CUDA device ordinal in this process (device.local_hardware_id)
    context: object  # CUcontext (the device's primary context, retained)
    buffer: int  # device address of this rank's symmetric buffer
    peers: int  # device address of the int64 [N + 1] peer table
    peer_table: tuple  # its host copy
    status_device: int  # device address of this rank's error record (host-mapped)
    status_host: int  # host address of the same record


class SymmetricBuffers:
    """The symmetric buffers of one expert-parallel group, for the ranks this process drives.

    Args:
      devices: the group's jax devices in rank order (rank `d` = position `d` on the mesh axis).
      max_tokens: the largest `T` of one call; fixes the layout.
      shape: the layer's `LatentMoEShape`.
      key: a string unique to this group and backend instance, identical in every process (names the
        key-value store entries in multi-process runs).
      kv_timeout_s: how long to wait for the other processes' records.

    Attributes:
      layout: the `EpLayout`.
      ranks: `N`.
      local: `LocalRank` of every rank this process drives, in rank order.

    Raises:
      ValueError: bad arguments, or ranks configured differently (multi-process).
      MemoryError: the device has not enough free memory.
      SymmetricMemoryError: peer access impossible, or another CUDA failure.
    """

    def __init__(self, devices, max_tokens: int, shape: LatentMoEShape, *, key: str, kv_timeout_s: float = 300.0):
        devices = list(devices)
        if not devices:
            raise ValueError("SymmetricBuffers needs at least one device")
        self.ranks = shape.check_ranks(len(devices))
        self.max_tokens = check_max_tokens(max_tokens)
        self.shape = shape
        self.layout = EpLayout(self.ranks, max_tokens, shape)
        self.key = key
        self._close_lock = threading.Lock()  # close() may race: an owner's release thread and interpreter exit
        for d in devices:
            if getattr(d, "platform", None) != "gpu":
                raise ValueError(f"SymmetricBuffers needs CUDA GPUs, got {d} (platform {getattr(d, 'platform', None)})")
        import jax

        me = jax.process_index()
        self.devices = devices
        self.local: list[LocalRank] = []
        self._opened: list[tuple[object, int]] = []  # (context, IPC-mapped address) to close
        self._allocs: list[tuple[object, int]] = []  # (context, device address) to free
        self._host_page = 0
        self._closed = False
        local_ranks = [r for r, d in enumerate(devices) if d.process_index == me]
        if not local_ranks:
            raise ValueError(f"no device of this group belongs to process {me}")
        self.multiprocess = len(local_ranks) != self.ranks
        client = _distributed_client() if self.multiprocess else None
        if self.multiprocess and client is None:
            raise ValueError(
                "the group spans several processes, but jax.distributed is not initialized in this one"
            )
        self._published: set[int] = set()  # local ranks whose record is in the key-value store
        try:
            drv = _driver()
            previous = _check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent") if _cuda_ready(drv) else None
            try:
                self._setup(local_ranks, client, me, kv_timeout_s)
            finally:
                if previous is not None:
                    drv.cuCtxSetCurrent(previous)  # leave the thread's current context as it was
        except BaseException as e:
            # The other processes wait for this one's records: give them an error record instead, so they
            # fail at once naming this process and its error (not after kv_timeout_s).
            if self.multiprocess:
                publish_failure(client, key, [r for r in local_ranks if r not in self._published], me, e)
            self.close()
            raise
        with _live_lock:
            _live.add(self)

    # -- setup ----------------------------------------------------------------------------------------

    def _setup(self, local_ranks, client, me, kv_timeout_s):
        import jax

        drv = _driver()
        lay, n = self.layout, self.ranks
        # JAX must have created the primary contexts (and, with several local GPUs, enabled peer access).
        for r in local_ranks:
            jax.device_put(np.zeros((1,), np.int32), self.devices[r]).block_until_ready()
        _check(drv.cuInit(0), "cuInit")
        flags = drv.CU_MEMHOSTALLOC_DEVICEMAP | drv.CU_MEMHOSTALLOC_PORTABLE
        page_bytes = max(4096, STATUS_SLOT * len(local_ranks))
        first_ctx = None
        for r in local_ranks:
            device = self.devices[r]
            ordinal = int(device.local_hardware_id)
            cu_dev = _check(drv.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
            ctx = _check(drv.cuDevicePrimaryCtxRetain(cu_dev), f"cuDevicePrimaryCtxRetain({ordinal})")
            _check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            if first_ctx is None:
                first_ctx = ctx
                self._host_page = int(_check(drv.cuMemHostAlloc(page_bytes, flags), "cuMemHostAlloc(status page)"))
                ctypes.memset(self._host_page, 0, page_bytes)
            where = f"rank {r} (device {device}, {lay.bytes} bytes)"
            buf = int(_check(drv.cuMemAlloc(lay.bytes), f"cuMemAlloc for {where}"))
            self._allocs.append((ctx, buf))
            self._arm(drv, buf, r, where)
            slot = self._host_page + STATUS_SLOT * len(self.local)
            status_device = int(_check(drv.cuMemHostGetDevicePointer(slot, 0), "cuMemHostGetDevicePointer"))
            self.local.append(LocalRank(r, device, ordinal, ctx, buf, 0, (), status_device, slot))
        for lr in self.local:
            _check(drv.cuCtxSetCurrent(lr.context), "cuCtxSetCurrent")
            _check(drv.cuCtxSynchronize(), f"cuCtxSynchronize after arming rank {lr.rank}")

        # Where every rank's buffer is, as seen from each local device.
        by_rank = {lr.rank: lr for lr in self.local}
        records = {}
        if self.multiprocess:
            mine = {}
            for lr in self.local:
                _check(drv.cuCtxSetCurrent(lr.context), "cuCtxSetCurrent")
                handle = _check(drv.cuIpcGetMemHandle(lr.buffer), f"cuIpcGetMemHandle(rank {lr.rank})")
                mine[lr.rank] = self._record(lr.rank, me, ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES))
            records = exchange_records(client, self.key, mine, n, kv_timeout_s, self._published)
        else:
            for r in range(n):
                records[r] = self._record(r, me, b"")
        check_records(list(records.values()), n)

        for lr in self.local:
            _check(drv.cuCtxSetCurrent(lr.context), "cuCtxSetCurrent")
            table = []
            for r in range(n):
                if r == lr.rank:
                    table.append(lr.buffer)
                elif r in by_rank:
                    self._enable_peer_access(drv, lr, by_rank[r])
                    table.append(by_rank[r].buffer)
                else:
                    table.append(self._open_ipc(drv, lr, r, records[r]))
            table.append(lr.buffer)  # peers[N]: own buffer through the local mapping
            host = np.asarray(table, dtype=np.int64)
            # The table lives in the buffer's local-only `peers` region: the kernels derive the local base
            # from its address (`peers - layout.peers`) without a load.
            dev = int(lr.buffer) + self.layout.peers
            _check(drv.cuMemcpyHtoD(dev, host.ctypes.data, host.nbytes), "cuMemcpyHtoD(peer table)")
            _check(drv.cuCtxSynchronize(), "cuCtxSynchronize(peer table)")
            lr.peers, lr.peer_table = dev, tuple(int(v) for v in table)

    def _record(self, rank, process, handle) -> RankRecord:
        s = self.shape
        return RankRecord(rank, self.ranks, self.max_tokens, s.latent, s.experts, s.topk, process,
                          self.layout.bytes, handle)

    def _arm(self, drv, buf, rank, where):
        """Zero the buffer: the protocol's initial state (every epoch 0, nothing written yet)."""
        lay = self.layout
        _check(drv.cuMemsetD8(buf, 0, lay.bytes), f"cuMemsetD8 (zero) for {where}")

    def _enable_peer_access(self, drv, lr: LocalRank, peer: LocalRank):
        """Lets `lr`'s device access `peer`'s memory (current context: lr's)."""
        dev_a = _check(drv.cuDeviceGet(lr.ordinal), "cuDeviceGet")
        dev_b = _check(drv.cuDeviceGet(peer.ordinal), "cuDeviceGet")
        can = _check(drv.cuDeviceCanAccessPeer(dev_a, dev_b), "cuDeviceCanAccessPeer")
        if not can:
            raise SymmetricMemoryError(
                f"device {lr.device} (rank {lr.rank}) cannot access the memory of device {peer.device} "
                f"(rank {peer.rank}): no peer access between them (the NVLink backend needs NVLink or PCIe P2P)"
            )
        err = drv.cuCtxEnablePeerAccess(peer.context, 0)
        code = int(err[0] if isinstance(err, tuple) else err)
        if code not in (_CUDA_SUCCESS, _CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
            _check(err, f"cuCtxEnablePeerAccess(rank {lr.rank} -> rank {peer.rank})")

    def _open_ipc(self, drv, lr: LocalRank, r: int, record: RankRecord) -> int:
        if len(record.handle) != IPC_HANDLE_BYTES:
            raise SymmetricMemoryError(f"rank {r} published no IPC handle")
        handle = drv.CUipcMemHandle()
        ctypes.memmove(handle.getPtr(), record.handle, IPC_HANDLE_BYTES)
        flags = drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        try:
            ptr = int(_check(drv.cuIpcOpenMemHandle(handle, flags), f"cuIpcOpenMemHandle(rank {r})"))
        except SymmetricMemoryError as e:
            raise SymmetricMemoryError(
                f"rank {lr.rank} (device {lr.device}) cannot map rank {r}'s buffer (process {record.process}): "
                f"{e}. The NVLink backend needs peer access between the GPUs (all on one NVLink domain)."
            ) from None
        self._opened.append((lr.context, ptr))
        return ptr

    # -- use ------------------------------------------------------------------------------------------

    def status(self, rank: int) -> tuple[int, int, int, int]:
        """The error record `(code, rank, peer, layer)` of local rank `rank` (all 0 while no wait timed out)."""
        for lr in self.local:
            if lr.rank == rank:
                if self._closed:
                    raise ValueError("SymmetricBuffers is closed")
                return tuple(int(v) for v in (ctypes.c_int32 * 4).from_address(lr.status_host))
        raise KeyError(f"rank {rank} is not driven by this process")

    def kernel_errors(self) -> list[str]:
        """What each nonzero error record of this process's ranks says, with the process of the peer it names
        (e.g. "dispatch on rank 0 timed out waiting for rank 1 at layer 3 (error code 1); rank 1 is process 1")."""
        from jax_latent_ep.kernels.abi import describe_error

        out = []
        for lr in self.local:
            if self._closed:
                break
            record = tuple(int(v) for v in (ctypes.c_int32 * 4).from_address(lr.status_host))
            if record[0]:
                peer = record[2]
                owner = (f"; rank {peer} is process {self.devices[peer].process_index}"
                         if 0 <= peer < len(self.devices) else "")
                out.append(describe_error(record) + owner)
        return out

    def close(self):
        """Frees everything (idempotent, thread-safe). Only once no kernel uses the buffers on any rank."""
        with self._close_lock:
            self._close()

    def _close(self):
        if self._closed:
            return
        self._closed = True
        with _live_lock:
            _live.discard(self)
        try:
            drv = _driver()
        except SymmetricMemoryError:  # pragma: no cover
            return
        errors = []
        previous = drv.cuCtxGetCurrent()[1] if _cuda_ready(drv) else None
        contexts = {id(c): c for c, _ in self._allocs + self._opened}
        for ctx in contexts.values():
            drv.cuCtxSetCurrent(ctx)
            drv.cuCtxSynchronize()  # nothing of ours may still run
        for ctx, ptr in self._opened:
            drv.cuCtxSetCurrent(ctx)
            if int(drv.cuIpcCloseMemHandle(ptr)[0]) != _CUDA_SUCCESS:
                errors.append(f"cuIpcCloseMemHandle({ptr:#x})")
        for ctx, ptr in self._allocs:
            drv.cuCtxSetCurrent(ctx)
            if int(drv.cuMemFree(ptr)[0]) != _CUDA_SUCCESS:
                errors.append(f"cuMemFree({ptr:#x})")
        if self._host_page:
            drv.cuMemFreeHost(self._host_page)
        self._opened, self._allocs, self._host_page = [], [], 0
        for lr in self.local:
            drv.cuDevicePrimaryCtxRelease(_check(drv.cuDeviceGet(lr.ordinal), "cuDeviceGet"))
        if previous is not None:
            drv.cuCtxSetCurrent(previous)
        if errors:
            raise SymmetricMemoryError("SymmetricBuffers.close: " + ", ".join(errors) + " failed")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        return (
            f"SymmetricBuffers(key={self.key!r}, N={self.ranks}, max_tokens={self.max_tokens}, "
            f"local ranks={[lr.rank for lr in self.local]}, bytes={self.layout.bytes}, "
            f"multiprocess={self.multiprocess})"
        )


def kernel_errors() -> list[str]:
    """`SymmetricBuffers.kernel_errors` of every live group of this process (what its trapped kernels recorded)."""
    with _live_lock:
        live = list(_live)
    return [text for b in live for text in b.kernel_errors()]
