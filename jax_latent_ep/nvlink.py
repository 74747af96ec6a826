"""The NVLink backend: dispatch / combine by the CuTe DSL kernels over symmetric memory, through XLA FFI.

    backend = NvlinkBackend(mesh, "ep", max_tokens=T, shape=KIMI_K3)
    def layer(x, ids, weights, norm_weight):         # inside jax.shard_map over "ep"
        recv = backend.dispatch(x, ids, weights)     # Received, [N*S, ...] rows
        out = experts(recv)                          # bf16 [N*S, L], derived from recv
        return backend.combine(out, ids, norm_weight)

Both calls run on per-rank arrays inside `jax.shard_map`, exactly like the XLA backend
(`jax_latent_ep.reference.XlaBackend`), and lower to one custom call each (one kernel launch on XLA's
stream, `kCmdBufferCompatible`, so XLA may capture them into CUDA graphs).

Ordering. The kernels synchronize through flags in the symmetric buffers and assume the contract's order on
every rank: dispatch, then its combine, then the next dispatch. XLA orders custom calls only by data
dependencies (`has_side_effect` keeps a call alive but does not order it), and here the model's data flow
provides them: dispatch returns the receive rows, combine takes `out` computed from them (so it follows its
dispatch), and the next layer's dispatch takes tokens computed from the combine's result (so it follows the
combine). Keep that flow: a combine whose `out` does not depend on its dispatch's `Received`, or a dispatch
whose `x` does not depend on the previous combine, may be reordered by XLA and then deadlock (until the
flag timeout) or corrupt the buffers. Layers in a Python loop or in `lax.scan` satisfy it naturally.

Setup. The constructor allocates one symmetric buffer per rank (`jax_latent_ep.symmetric.SymmetricBuffers`;
set `XLA_PYTHON_CLIENT_PREALLOCATE=false` before JAX starts), loads the kernels on every local device and
registers each rank with the FFI library under a fresh instance id, so several backends can coexist. In a
multi-process program (one process per GPU, `jax.distributed`), every process must build its backends with
the same arguments and in the same order. Timeouts: a flag wait that outlives `timeout_s` traps the kernel
after writing an error record; `status()` / `check()` read it (the computation itself fails with a CUDA
error, and later calls of this backend fail with a message naming the rank, the peer and the layer).
"""

from __future__ import annotations

import itertools
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jax_latent_ep import ffi
from jax_latent_ep.config import KIMI_K3, LatentMoEShape, check_max_tokens
from jax_latent_ep.layout import stride
from jax_latent_ep.symmetric import SymmetricBuffers
from jax_latent_ep.types import Received

#: Default dispatch grid: at least one CTA per token, at least min(N*S, 32) CTAs to copy receive rows out.
DISPATCH_MIN_CTAS = 32
#: Default combine grid: at least one CTA per own token, at least min(N*S, 64) CTAs to send receive rows.
COMBINE_MIN_CTAS = 64

_instances = itertools.count(1)
_instances_lock = threading.Lock()


def _arch(device) -> str:
    cc = str(getattr(device, "compute_capability", ""))
    arch = {"9.0": "sm_90a", "10.0": "sm_100a"}.get(cc)  # an "a" cubin loads on exactly one capability
    if arch is None:
        raise ValueError(f"the NVLink backend has kernels for sm_90a and sm_100a only; {device} has compute "
                         f"capability {cc or 'unknown'}")
    return arch


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


def default_grids(tokens: int, ranks: int, max_tokens: int) -> tuple[int, int]:
    """(dispatch CTAs, combine CTAs) for a call with `tokens` tokens per rank."""
    rows = ranks * stride(max_tokens)
    return max(tokens, min(rows, DISPATCH_MIN_CTAS)), max(tokens, min(rows, COMBINE_MIN_CTAS))


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
        `(dispatch, combine)`; a dispatch grid is raised to at least `T`. Every grid must fit on the device
        at once (`max_grids`, occupancy x SMs), which also bounds `T` per call (a dispatch needs `T` CTAs).

    Raises:
      ValueError, LookupError (no compiled kernel for this N / shape / arch), FileNotFoundError (no
      artifacts), MemoryError, jax_latent_ep.symmetric.SymmetricMemoryError.
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
        if not timeout_s >= 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be >= 0")
        self.timeout_ns = int(round(timeout_s * 1e9))
        self._grid = self._check_grid(grid)
        with _instances_lock:
            self.instance = next(_instances)
        #: (dispatch, combine) largest grid of one launch: every CTA of a launch must be resident at once
        #: (occupancy x SMs, docs/kernel_abi.md); a dispatch needs T CTAs, so this also bounds T.
        self.max_grids = (1 << 31, 1 << 31)
        self._buffers: list[SymmetricBuffers] = []
        self._registered: list[int] = []
        self._closed = False

        me = jax.process_index()
        # (index, devices) of every group with a device of this process; the index names it in the KV store.
        groups = [(i, g) for i, g in enumerate(_groups(mesh, axis_name)) if any(d.process_index == me for d in g)]
        archs = {_arch(d) for _, g in groups for d in g if d.process_index == me}
        if len(archs) != 1:
            raise ValueError(f"the local devices of the mesh mix GPU architectures: {sorted(archs)}")
        arch = archs.pop()
        dispatch = ffi.find_kernel("dispatch", self.ranks, shape, arch)
        combine = ffi.find_kernel("combine", self.ranks, shape, arch)
        ffi.register_targets()
        try:
            for index, g in groups:
                bufs = SymmetricBuffers(g, max_tokens, shape, key=f"{self.instance}/{index}")
                self._buffers.append(bufs)
                for lr in bufs.local:
                    ffi.register_rank(self.instance, lr.ordinal, lr.rank, self.ranks, max_tokens, shape, lr.peers,
                                      lr.status_device, lr.status_host, self.timeout_ns, dispatch, combine)
                    self._registered.append(lr.ordinal)
                    bounds = ffi.max_grids(self.instance, lr.ordinal)
                    self.max_grids = tuple(min(a, b) for a, b in zip(self.max_grids, bounds))
        except BaseException:
            self.close()
            raise

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
        """(dispatch CTAs, combine CTAs) used for a call with `tokens` tokens per rank.

        Raises:
          ValueError: if a grid exceeds the co-residency bound `max_grids` (a dispatch needs `T` CTAs, so a
            large `T` cannot be sent in one call).
        """
        if self._grid is None:
            grids = default_grids(tokens, self.ranks, self.max_tokens)
        else:
            grids = max(tokens, self._grid[0]), self._grid[1]
        for name, g, bound in zip(("dispatch", "combine"), grids, self.max_grids):
            if g > bound:
                raise ValueError(
                    f"NvlinkBackend: the {name} kernel would need {g} CTAs for T={tokens} tokens, but only {bound} "
                    f"fit on the device at once (every CTA of a launch waits for the others); send at most {bound} "
                    f"tokens per call{' or lower grid' if self._grid else ''}"
                )
        return grids

    def _check_open(self):
        if self._closed:
            raise ValueError("NvlinkBackend is closed")

    def dispatch(self, x, ids, weights) -> Received:
        """Per rank: x bf16 [T, L], ids int32 [T, K], weights f32 [T, K] -> Received with N*S rows."""
        self._check_open()
        tokens = int(x.shape[0])
        x, ids, weights = (_varying(a, self.axis_name) for a in (x, ids, weights))
        outs = ffi.dispatch_call(x, ids, weights, instance=self.instance, rows=self.rows,
                                 grid=self.grids(tokens)[0], num_sf=self.shape.num_sf)
        return Received(*(_varying(o, self.axis_name) for o in outs))

    def combine(self, out, ids, norm_weight=None, eps: float = 1e-5):
        """Per rank: out bf16 [N*S, L] (derived from this layer's Received), ids int32 [T, K] -> bf16 [T, L]."""
        self._check_open()
        tokens = int(ids.shape[0])
        apply_norm = norm_weight is not None
        if not apply_norm:
            norm_weight = jnp.zeros((self.shape.latent,), jnp.bfloat16)  # not read by the kernel
        out, ids, norm_weight = (_varying(a, self.axis_name) for a in (out, ids, norm_weight))
        y = ffi.combine_call(out, ids, norm_weight, instance=self.instance, grid=self.grids(tokens)[1],
                             eps=float(eps), apply_norm=apply_norm)
        return _varying(y, self.axis_name)

    def status(self) -> dict[int, tuple[int, int, int, int]]:
        """`{rank: (code, rank, peer, layer)}` of every local rank's error record (codes: 0 none, 1 dispatch
        timeout, 2 combine timeout). Host-mapped memory: no synchronization, readable after a failure."""
        return {lr.rank: b.status(lr.rank) for b in self._buffers for lr in b.local}

    def check(self) -> None:
        """Raises RuntimeError naming rank, peer and layer if a kernel of this backend timed out."""
        for rank, (code, r, peer, layer) in self.status().items():
            if code:
                phase = {1: "dispatch", 2: "combine"}.get(code, f"code {code}")
                raise RuntimeError(f"jax_latent_ep: {phase} on rank {r} timed out waiting for rank {peer} at "
                                   f"layer {layer} (local rank {rank})")

    def close(self):
        """Unregisters the ranks and frees the symmetric memory (idempotent). Call it only once every
        computation using this backend has finished on every rank; executables compiled with it cannot run
        afterwards."""
        if self._closed:
            return
        self._closed = True
        for ordinal in self._registered:
            ffi.unregister_rank(self.instance, ordinal)
        self._registered = []
        for bufs in self._buffers:
            bufs.close()
        self._buffers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        return (f"NvlinkBackend(axis_name={self.axis_name!r}, N={self.ranks}, max_tokens={self.max_tokens}, "
                f"shape={self.shape}, instance={self.instance})")
