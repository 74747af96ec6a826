"""The NVLink backend: dispatch / combine by the CuTe DSL kernels over symmetric memory, through XLA FFI.

    backend = NvlinkBackend(mesh, "ep", max_tokens=T, shape=KIMI_K3)
    def layer(x, ids, weights, norm_weight):         # inside jax.shard_map over "ep"
        recv = backend.dispatch(x, ids, weights)     # Received, [N*S, ...] rows
        out = experts(recv)                          # bf16 [N*S, L], derived from recv
        return backend.combine(out, ids, norm_weight)

Both calls run on per-rank arrays inside `jax.shard_map`, exactly like the XLA backend
(`jax_latent_ep.backends.xla.XlaBackend`), and lower to one custom call each (one kernel launch on XLA's
stream, `kCmdBufferCompatible`, so XLA may capture them into CUDA graphs).

Ordering: every rank calls dispatch, its combine, then the next dispatch, ordered by their data alone
(docs/usage.md, "Call ordering and pairing"); the kernels' sequence guard fails a call out of order.

Setup. The constructor allocates one symmetric buffer per rank (`jax_latent_ep.runtime.symmetric.SymmetricBuffers`;
set `XLA_PYTHON_CLIENT_PREALLOCATE=false` before JAX starts), loads the kernels on every local device and
registers each rank with the FFI library under a fresh instance id, so several backends can coexist. In a
multi-process program (one process per GPU, `jax.distributed`), every process must build its backends with
the same arguments and in the same order. Timeouts: a flag wait that outlives `timeout_s` traps the kernel
after writing an error record; so does a kernel called out of sequence (a dispatch twice without a
combine, error code 3; a combine without its dispatch, code 4; the other ranks then time out waiting for
that one). `status()` / `check()` read the records and name the error, rank, peer, layer and group (the
computation itself fails with a CUDA error; later calls of this backend fail in the FFI handler with a
message naming the rank, the peer, the layer and the error code, whose phase the library spells out for the
timeouts, codes 1 and 2, only: `check()` says what codes 3 and 4 mean).

Lifetime: `close()` frees the buffers; no executable of the backend may run afterwards (docs/usage.md,
"Lifetime").
"""

from __future__ import annotations

import itertools
import math
import numbers
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from jax_latent_ep.kernels import abi
from jax_latent_ep.runtime import ffi
from jax_latent_ep.runtime.ffi import gpu_arch
from jax_latent_ep.shapes import KIMI_K3, LatentMoEShape, check_max_tokens
from jax_latent_ep.layout import stride
from jax_latent_ep.runtime.symmetric import SymmetricBuffers, _distributed_client, publish_failure
from jax_latent_ep.received import Received

#: Default dispatch grid: one CTA per token and at least min(N * stride(T), 256) CTAs (a CTA polls its rows one after
#: another), lowered to the co-residency bound (`NvlinkBackend.max_grids`; below T, CTA c quantizes and stores the
#: tokens c, c + G, ... one after another). The copy-out walks the other ranks' (N - 1) * T rows that carry anything
#: in a call of T tokens (the kernels' `peer_tokens`) from the last CTA down, so with N * stride(T) >= (N - 1) * T + T
#: CTAs no CTA that stores a token also polls a row. The grid follows T, not the buffer's max_tokens: the rows past T
#: are written empty without a poll. 256 rather than 128: faster at N = 2, T = 1-128 (docs/performance.md, "Grid cap
#: 256").
DISPATCH_MIN_CTAS = 256
#: Default combine grid: one CTA per own token and at least min(N * stride(T), 256) CTAs (the first (N - 1) * T send
#: the other ranks' rows, one each), lowered to the co-residency bound (CTA c reduces the tokens c, c + G, ...).
COMBINE_MIN_CTAS = 256

_instances = itertools.count(1)
_instances_lock = threading.Lock()


def _groups(mesh, axis_name: str) -> list[list]:
    """The expert-parallel groups of `mesh`: devices sharing every other mesh coordinate, in rank order."""
    devices = np.asarray(mesh.devices)
    axis = list(mesh.axis_names).index(axis_name)
    moved = np.moveaxis(devices, axis, -1)
    return [list(row) for row in moved.reshape(-1, devices.shape[axis])]


def _varying(a, axis_name: str):
    """`a` marked as varying over `axis_name` (each rank's result differs): a no-op at run time."""
    vma = getattr(jax.typeof(a), "vma", None)
    if vma is not None and axis_name in vma:
        return a
    try:
        return jax.lax.pcast(a, axis_name, to="varying")
    except ValueError:  # already varying, or check_vma=False
        return a


def describe_error(group: int, record) -> str:
    """The message for one nonzero error record `(code, rank, peer, layer)` of expert-parallel group `group`
    (`kernels.abi.describe_error`, with the group named)."""
    text = abi.describe_error(record)
    return text[: text.rindex(" (error code")] + f" (group {group}, error code {int(record[0])})"


def _release(instance: int, registered: list, buffers: list, background: bool) -> None:
    """Unregisters `instance` on every ordinal of `registered`, then closes every SymmetricBuffers of `buffers`
    (emptying both lists). Unregistering comes first: from then on a handler that runs for this instance fails
    with an FFI error instead of launching on memory about to be freed. `background`: close the buffers on a
    daemon thread (the garbage-collection path: `close()` synchronizes the devices, which must not happen on
    a thread that a running computation waits for, e.g. a host callback's)."""
    for ordinal in registered:
        ffi.unregister_rank(instance, ordinal)
    registered.clear()
    owned = list(buffers)
    buffers.clear()

    def close_all():
        errors = []
        for bufs in owned:
            try:
                bufs.close()
            except Exception as e:  # close the others all the same
                errors.append(e)
        if errors:
            raise errors[0]

    if background and owned:
        threading.Thread(target=close_all, name=f"jax_latent_ep release {instance}", daemon=True).start()
    else:
        close_all()


def default_grids(tokens: int, ranks: int, bounds: tuple[int, int] | None = None) -> tuple[int, int]:
    """(dispatch CTAs, combine CTAs) for a call with `tokens` tokens per rank (whatever the buffer's max_tokens):
    `max(T, min(N * stride(T), 256))` each, lowered to `bounds` (the co-residency bounds, `NvlinkBackend.max_grids`;
    None: no bound). Both kernels loop over their tokens (CTA c takes t = c, c + G, ...): any grid handles any T."""
    rows = ranks * stride(tokens)
    grids = max(tokens, min(rows, DISPATCH_MIN_CTAS)), max(tokens, min(rows, COMBINE_MIN_CTAS))
    if bounds is None:
        return grids
    return min(grids[0], bounds[0]), min(grids[1], bounds[1])


class NvlinkBackend:
    """Dispatch / combine over NVLink symmetric memory for the mesh axis `axis_name`.

    Args:
      mesh: the `jax.sharding.Mesh`; every device a CUDA GPU (sm_90 or sm_100) with peer access to the
        others of its group.
      axis_name: the expert-parallel axis, of size `N` (`shape.check_ranks(N)`).
      max_tokens: the largest `T` of a call per rank; fixes the buffer layout.
      shape: the layer's `LatentMoEShape`.
      timeout_s: bound of every flag wait inside the kernels; 0 waits forever.
      grid: CTAs per launch: None (the default rule, `default_grids`), an int for both kernels, or a pair
        `(dispatch, combine)`, used as given for every `T` (a grid below `T` loops over the tokens). Every grid
        must fit on the device at once (`max_grids`, occupancy x SMs); `T` itself is bounded by `max_tokens`
        alone.

    Raises:
      ValueError, LookupError (no compiled kernel for this N / shape / arch), FileNotFoundError (no
      artifacts), MemoryError, jax_latent_ep.runtime.symmetric.SymmetricMemoryError (PeerSetupError: another
      process of a group failed during its setup).

    Lifetime (docs/usage.md, "Lifetime"): `close()` releases the buffers; a backend dropped without it is released
    by `weakref.finalize` (ranks unregistered at once, buffers closed on a background thread once the devices are
    idle).
    """

    name = "nvlink"

    def __init__(self, mesh, axis_name: str, max_tokens: int, shape: LatentMoEShape = KIMI_K3, *,
                 timeout_s: float = 5.0, grid=None):
        self.mesh, self.axis_name, self.shape = mesh, axis_name, shape
        self.max_tokens = check_max_tokens(max_tokens)
        axes = dict(mesh.shape)
        if axis_name not in axes:
            raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh (axes: {list(axes)})")
        self.ranks = shape.check_ranks(int(axes[axis_name]))
        self.stride = stride(max_tokens)
        self.rows = self.ranks * self.stride
        # A real number of seconds (not bool), finite, >= 0, and within the kernels' int64 nanoseconds.
        try:
            valid = (not isinstance(timeout_s, (bool, np.bool_)) and isinstance(timeout_s, numbers.Real)
                     and math.isfinite(timeout_s) and 0 <= timeout_s * 1e9 < 2.0**63)
        except OverflowError:  # an int too large for a float
            valid = False
        if not valid:
            raise ValueError(f"timeout_s={timeout_s!r} must be a finite number of seconds >= 0 (0 waits forever)")
        self.timeout_ns = max(1, int(round(timeout_s * 1e9))) if timeout_s > 0 else 0  # > 0 never becomes 0 (forever)
        self._grid = self._check_grid(grid)
        with _instances_lock:
            self.instance = next(_instances)
        #: (dispatch, combine) largest grid of one launch: every CTA of a launch must be resident at once
        #: (occupancy x SMs, docs/kernel_abi.md). It bounds the grids, not T: a CTA loops over its tokens.
        self.max_grids = (1 << 31, 1 << 31)
        self._buffers: list[SymmetricBuffers] = []
        self._group_index: list[int] = []  # the mesh-wide index of each of `_buffers`' groups
        self._registered: list[int] = []
        self._closed = False
        self._track()

        me = jax.process_index()
        # (index, devices) of every group with a device of this process; the index names it in the KV store.
        groups = [(i, g) for i, g in enumerate(_groups(mesh, axis_name)) if any(d.process_index == me for d in g)]
        try:
            archs = {gpu_arch(d) for _, g in groups for d in g if d.process_index == me}
            if len(archs) != 1:
                raise ValueError(f"the local devices of the mesh mix GPU architectures: {sorted(archs)}")
            arch = archs.pop()
            dispatch = ffi.find_kernel("dispatch", self.ranks, shape, arch)
            combine = ffi.find_kernel("combine", self.ranks, shape, arch)
            ffi.register_targets()
            for index, g in groups:
                bufs = SymmetricBuffers(g, max_tokens, shape, key=self._key(index))
                self._buffers.append(bufs)
                self._group_index.append(index)
                for lr in bufs.local:
                    ffi.register_rank(self.instance, lr.ordinal, lr.rank, self.ranks, max_tokens, shape, lr.peers,
                                      lr.status_device, lr.status_host, self.timeout_ns, dispatch, combine)
                    self._registered.append(lr.ordinal)
                    bounds = ffi.max_grids(self.instance, lr.ordinal)
                    self.max_grids = tuple(min(a, b) for a, b in zip(self.max_grids, bounds))
        except BaseException as e:
            self._publish_failure(groups, me, e)
            self.close()
            raise

    def _key(self, index: int) -> str:
        """The key-value store name of group `index` of this backend (identical in every process)."""
        return f"{self.instance}/{index}"

    def _track(self):
        """Releases the ranks and buffers when this backend is garbage-collected without `close()`."""
        self._finalizer = weakref.finalize(self, _release, self.instance, self._registered, self._buffers, True)
        self._finalizer.atexit = False  # at exit, symmetric.py closes every live SymmetricBuffers itself

    def _publish_failure(self, groups, me, error):
        """Error records for this process's unpublished ranks of every group spanning several processes: the
        other processes, waiting for them, then fail at once with `error` instead of after a timeout."""
        client = None
        for index, g in groups:
            if all(d.process_index == me for d in g):
                continue  # nobody waits for this group's records
            client = client or _distributed_client()
            ranks = [r for r, d in enumerate(g) if d.process_index == me]
            publish_failure(client, self._key(index), ranks, me, error)

    @staticmethod
    def _check_grid(grid):
        if grid is None:
            return None
        try:
            pair = (grid, grid) if isinstance(grid, int) and not isinstance(grid, bool) else tuple(grid)
        except TypeError:
            pair = ()
        if len(pair) != 2 or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 1 for g in pair):
            raise ValueError(f"grid={grid!r} must be None, a positive int or a pair of positive ints")
        return pair

    def grids(self, tokens: int) -> tuple[int, int]:
        """(dispatch CTAs, combine CTAs) used for a call with `tokens` tokens per rank: the default rule
        (`default_grids`, lowered to the co-residency bound `max_grids`), or the `grid` given to the constructor
        as it is (any grid of at least one CTA handles any `T`).

        Raises:
          ValueError: if a grid given to the constructor exceeds the co-residency bound `max_grids` (the default
            rule never does).
        """
        if self._grid is None:
            return default_grids(tokens, self.ranks, self.max_grids)
        for name, g, bound in zip(("dispatch", "combine"), self._grid, self.max_grids):
            if g > bound:
                raise ValueError(
                    f"NvlinkBackend: grid={g} CTAs for the {name} kernel, but only {bound} fit on the device at once "
                    f"(every CTA of a launch waits for the others): pass grid=None (the default rule) or at most "
                    f"{bound}"
                )
        return self._grid

    def _check_open(self):
        if self._closed:
            raise ValueError("NvlinkBackend is closed")

    def dispatch(self, x, ids, weights) -> Received:
        """Per rank, inside `jax.shard_map` over `axis_name`: the contract's dispatch (one kernel launch).

        Args:
          x: bfloat16 `[T, L]`, `1 <= T <= max_tokens`.
          ids: int32 `[T, K]` global expert ids; one outside `[0, E)` selects no rank (as in the XLA backend).
          weights: float32 `[T, K]` routing weights.

        Returns:
          `Received(x, sf, ids, weights, src)` with `N * S` rows (see `jax_latent_ep.received.Received`).

        `jax_latent_ep.ExpertParallel.dispatch` is the checked public entry; this method checks no argument
        (only that the backend is open and the grid fits).
        """
        self._check_open()
        tokens = int(x.shape[0])
        x, ids, weights = (_varying(a, self.axis_name) for a in (x, ids, weights))
        outs = ffi.dispatch_call(x, ids, weights, instance=self.instance, rows=self.rows,
                                 grid=self.grids(tokens)[0], num_sf=self.shape.num_sf)
        return Received(*(_varying(o, self.axis_name) for o in outs))

    def combine(self, out, ids, norm_weight=None, eps: float = 1e-5):
        """Per rank, inside `jax.shard_map` over `axis_name`: the contract's combine (one kernel launch).

        Args:
          out: bfloat16 `[N*S, L]`, the expert output of every receive row; it must be derived from this
            layer's `Received` (see "Ordering" in the module docstring).
          ids: int32 `[T, K]`, the same ids (and `T`) as this layer's dispatch.
          norm_weight: bfloat16 `[L]`, the RMSNorm weight, or None for the routed latent without RMSNorm.
          eps: RMSNorm epsilon, `rstd = rsqrt(mean(routed^2) + eps)` (used only with `norm_weight`).

        Returns:
          bfloat16 `[T, L]`: each own token's routed latent (FP32 sum over its ranks in ascending order, one
          bf16 rounding), RMS-normed with `norm_weight` unless that is None (the routed latent is exact; the
          kernel's `rsqrt.approx` and summation order may move a small fraction of normed elements by 1 ulp).

        `jax_latent_ep.ExpertParallel.combine` is the checked public entry; this method checks no argument
        (only that the backend is open and the grid fits).
        """
        self._check_open()
        tokens = int(ids.shape[0])
        apply_norm = norm_weight is not None
        if not apply_norm:
            norm_weight = jnp.zeros((self.shape.latent,), jnp.bfloat16)  # not read by the kernel
        out, ids, norm_weight = (_varying(a, self.axis_name) for a in (out, ids, norm_weight))
        y = ffi.combine_call(out, ids, norm_weight, instance=self.instance, grid=self.grids(tokens)[1],
                             eps=float(eps), apply_norm=apply_norm)
        return _varying(y, self.axis_name)

    def status(self) -> dict[tuple[int, int], tuple[int, int, int, int]]:
        """`{(group, rank): (code, rank, peer, layer)}`: the error record of every rank this process drives.

        `group` is the index of the rank's expert-parallel group among all groups of the mesh (the devices
        sharing every other mesh coordinate, numbered row-major over the other axes; 0 when `axis_name` is the
        only axis), `rank` its position on `axis_name`. Codes (`jax_latent_ep.kernels.abi.ERRORS`): 0 none,
        1 dispatch timeout, 2 combine timeout (`peer`: the rank whose data never came), 3 dispatch called
        twice without a combine, 4 combine called without its dispatch (`peer`: the rank itself); `layer`: the
        layers that rank had completed. Host-mapped memory: no synchronization, readable after a failure.
        Empty after `close()`.
        """
        return {(g, lr.rank): b.status(lr.rank) for g, b in zip(self._group_index, self._buffers) for lr in b.local}

    def check(self) -> None:
        """Raises RuntimeError if a kernel of this backend recorded an error, naming for every such rank the
        error (a timeout with the peer waited for, or a call-sequence error), the rank, the layer and the group."""
        problems = [describe_error(g, rec) for (g, _), rec in sorted(self.status().items()) if rec[0]]
        if problems:
            raise RuntimeError("jax_latent_ep: " + "; ".join(problems))

    def close(self):
        """Unregisters the ranks, then frees the symmetric memory (idempotent).

        The rules are docs/usage.md's ("Lifetime"). Unregistering first means that a later execution which runs
        the FFI handler fails with "no NvlinkBackend instance <i> is registered on device ordinal <d>" before
        launching anything (instance ids are never reused); a CUDA graph replayed without the handler cannot be
        stopped.
        """
        if self._closed:
            return
        self._closed = True
        if self._finalizer.detach() is not None:  # not yet released (by the garbage collector's path)
            _release(self.instance, self._registered, self._buffers, False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        return (f"NvlinkBackend(axis_name={self.axis_name!r}, N={self.ranks}, max_tokens={self.max_tokens}, "
                f"shape={self.shape}, instance={self.instance})")
