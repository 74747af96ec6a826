"""JAX-free harness of the EP kernels on `cuda.bindings.driver`: loads the AOT cubins (manifest), allocates and
arms one symmetric buffer per rank, runs N ranks concurrently and checks every layer against numpy.

Modes (`python -m tools.kernel_harness --help`):
  virtual   N ranks on ONE GPU: all buffers on one device, one stream per rank.
  devices   N ranks on N GPUs of one process (peer access), one stream per GPU.
  latency   kernel-only time of one dispatch + combine per layer at T in {1, 5, 32, 128}, N = 2 on 2 GPUs:
            CUDA graphs of `--graph-layers` layers per GPU (programmatic stream serialization), CUDA events
            around each replay, median over the replays of (elapsed / layers). `--latency-virtual`: the ranks on
            one GPU, one stream each (a one-GPU view of the ranks' interplay, without NVLink).
  timeout   N = 2, rank 1 stops (`--timeout-case`): before its dispatch (rank 0's dispatch must trap), or after
            its dispatch (rank 0's combine must trap); the trap fills the host status record {code, rank, peer,
            layer} (run last: the trap kills the context).
  sequence  N = 2 virtual ranks, rank 1's buffer in mapped host memory; rank 0 repeats a dispatch / combine out
            of sequence (`--sequence-case`): it must trap with its error record and leave rank 1's buffer
            unchanged, byte for byte (run last: the trap kills the context).
  stress    `--layers` (e.g. 100000) consecutive layers, one rank per GPU (`--stress-virtual`: on one GPU): input
            sets uploaded once, random sets / T / apply_norm per layer and rank, one rank held back by a host
            busy-wait in half the layers, batches of `--stress-batch` layers launched back to back into their
            own output slots, then one sync and a vectorized check of the batch (same rules as below).

Each checked layer uses fresh random BF16 tokens, fresh routing and a random T <= max_tokens per rank; the
expert stage runs on the host (numpy) from the received rows; receive rows (x, sf of valid rows; ids,
weights, src of all rows) and the routed latent must be bit-exact, the normed output within 1 BF16 ulp.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import pathlib
import sys
import time
from typing import NamedTuple

import ml_dtypes
import numpy as np

from jax_latent_ep.shapes import DEEPSEEK_V3, KIMI_K3
from jax_latent_ep.layout import CTRL_ERROR, CTRL_LAYER, TRACE, TRACE_LAYERS, EpLayout, stride
from jax_latent_ep.testing import model, routing

DEFAULT_ARTIFACTS = pathlib.Path(__file__).resolve().parents[2] / "jax_latent_ep" / "_artifacts"
SHAPES = {"kimi_k3": KIMI_K3, "deepseek_v3": DEEPSEEK_V3}
BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn


def _cu():
    from cuda.bindings import driver

    return driver


def check(result):
    """Unwraps a cuda.bindings (err, *values) result; raises RuntimeError naming the error."""
    cu = _cu()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        name = cu.cuGetErrorName(err)[1]
        raise RuntimeError(f"CUDA error {int(err)} ({name.decode() if isinstance(name, bytes) else name})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


# ---------------------------------------------------------------------------------------------------------
# numpy reference (numerics.md + the project's non-finite rule)


def mxfp8_reference(x):
    """x bf16 [T, L] -> (q uint8 [T, L], sf uint8 [T, L // 32]): the contract model's MXFP8 (`testing/model.py`,
    numerics.md + the non-finite rule), with NaN elements as the canonical 0x7F that `cvt.satfinite` writes."""
    q, sf = model.mxfp8_quantize(x)
    q_bytes = q.view(np.uint8).copy()
    q_bytes[np.isnan(q.astype(np.float32))] = 0x7F
    return q_bytes, sf


def dequant(q, sf):
    """MXFP8 rows -> f32: f32(q) * 2^(e - 127); sf 255 -> NaN."""
    rows, latent = q.shape
    values = q.view(E4M3).astype(np.float32).reshape(rows, latent // 32, 32)
    scale = np.where(sf == 255, np.nan, np.ldexp(np.float32(1), sf.astype(np.int32) - 127)).astype(np.float32)
    with np.errstate(invalid="ignore"):
        return (values * scale[..., None]).reshape(rows, latent)


def bf16_bits(values_f32):
    return values_f32.astype(np.float32).astype(BF16).view(np.uint16)


def ulp_distance_bf16(a_bits, b_bits):
    """|a - b| in BF16 ulps on the monotone integer line (NaN == NaN counts 0)."""
    def key(bits):
        bits = bits.astype(np.int32)
        return np.where(bits & 0x8000, 0x8000 - (bits & 0x7FFF), 0x8000 + (bits & 0x7FFF))

    nan_a = (a_bits & 0x7FFF) > 0x7F80
    nan_b = (b_bits & 0x7FFF) > 0x7F80
    dist = np.abs(key(a_bits) - key(b_bits))
    return np.where(nan_a & nan_b, 0, np.where(nan_a | nan_b, 1 << 20, dist))


# ---------------------------------------------------------------------------------------------------------
# Kernels from the manifest


class Manifest:
    def __init__(self, artifacts=DEFAULT_ARTIFACTS):
        self.dir = pathlib.Path(artifacts)
        path = self.dir / "manifest.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: run python -m jax_latent_ep.runtime.build")
        self.entries = json.loads(path.read_text())["entries"]

    def entry(self, kernel, shape_name, ranks, arch):
        for e in self.entries:
            if (e["kernel"], e["shape"]["name"], e["ranks"], e["arch"]) == (kernel, shape_name, ranks, arch):
                return e
        raise KeyError(f"no {kernel} cubin for {shape_name} n{ranks} {arch} in {self.dir}")


_CTYPES = {"i64": ctypes.c_int64, "i32": ctypes.c_int32, "f32": ctypes.c_float}


class Kernel:
    """One cubin loaded into the current context."""

    def __init__(self, manifest: Manifest, entry: dict):
        cu = _cu()
        self.entry = entry
        data = (manifest.dir / entry["file"]).read_bytes()
        self.module = check(cu.cuModuleLoadData(data))
        self.function = check(cu.cuModuleGetFunction(self.module, entry["name"].encode()))
        self.types = tuple(_CTYPES[t] for _, t in entry["params"])
        self.names = tuple(n for n, _ in entry["params"])

    def occupancy(self) -> int:
        cu = _cu()
        return check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.function, self.entry["block"], self.entry["smem"]))

    def launch(self, stream, grid, pdl=True, **args):
        cu = _cu()
        if set(args) != set(self.names):
            raise ValueError(f"arguments {sorted(args)} != {sorted(self.names)}")
        config = cu.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = int(grid), 1, 1
        config.blockDimX, config.blockDimY, config.blockDimZ = self.entry["block"], 1, 1
        config.sharedMemBytes = self.entry["smem"]
        config.hStream = stream
        if pdl:
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            config.attrs = [attr]
            config.numAttrs = 1
        else:
            config.numAttrs = 0
        values = tuple(args[n] for n in self.names)
        check(cu.cuLaunchKernelEx(config, self.function, (values, self.types), 0))


#: A one-thread kernel that spins until `ns` nanoseconds of `%globaltimer` have passed (PTX, JIT-compiled by the
#: driver): `latency(delay_ns=...)` puts it before one rank's dispatch, to make that rank the late one.
_SPIN_PTX = b"""
.version 7.8
.target sm_90
.address_size 64
.visible .entry spin_ns(.param .u64 ns)
{
  .reg .u64 %t0, %t1, %d, %n;
  .reg .pred %p;
  ld.param.u64 %n, [ns];
  mov.u64 %t0, %globaltimer;
SPIN:
  mov.u64 %t1, %globaltimer;
  sub.u64 %d, %t1, %t0;
  setp.lt.u64 %p, %d, %n;
  @%p bra SPIN;
  ret;
}
\0"""


class SpinKernel:
    """`_SPIN_PTX` loaded into the current context."""

    def __init__(self):
        cu = _cu()
        self.module = check(cu.cuModuleLoadData(_SPIN_PTX))
        self.function = check(cu.cuModuleGetFunction(self.module, b"spin_ns"))

    def launch(self, stream, ns):
        cu = _cu()
        check(cu.cuLaunchKernel(self.function, 1, 1, 1, 1, 1, 1, 0, stream, ((int(ns),), (ctypes.c_uint64,)), 0))


# ---------------------------------------------------------------------------------------------------------
# Ranks and buffers


class DeviceArray:
    def __init__(self, nbytes):
        cu = _cu()
        self.nbytes = max(int(nbytes), 16)
        self.ptr = int(check(cu.cuMemAlloc(self.nbytes)))

    def upload(self, array):
        cu = _cu()
        array = np.ascontiguousarray(array)
        assert array.nbytes <= self.nbytes, (array.nbytes, self.nbytes)
        check(cu.cuMemcpyHtoD(self.ptr, array.ctypes.data, array.nbytes))

    def download(self, dtype, shape):
        cu = _cu()
        out = np.empty(shape, dtype)
        check(cu.cuMemcpyDtoH(out.ctypes.data, self.ptr, out.nbytes))
        return out


class HostMappedArray(DeviceArray):
    """Pinned host memory mapped into every context (`cuMemHostAlloc` DEVICEMAP | PORTABLE): kernels reach it at
    `ptr` (unified addressing); the CPU reads and writes it directly, also after a GPU context was lost."""

    def __init__(self, nbytes):
        cu = _cu()
        self.nbytes = max(int(nbytes), 16)
        self.host = int(check(cu.cuMemHostAlloc(self.nbytes, cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE)))
        self.ptr = int(check(cu.cuMemHostGetDevicePointer(self.host, 0)))
        ctypes.memset(self.host, 0, self.nbytes)

    def upload(self, array, offset=0):
        array = np.ascontiguousarray(array)
        assert offset + array.nbytes <= self.nbytes, (offset, array.nbytes, self.nbytes)
        ctypes.memmove(self.host + offset, array.ctypes.data, array.nbytes)

    def download(self, dtype, shape, offset=0):
        out = np.empty(shape, dtype)
        ctypes.memmove(out.ctypes.data, self.host + offset, out.nbytes)
        return out


class HostMappedView(DeviceArray):
    """A window of a `HostMappedArray` (no memory of its own)."""

    def __init__(self, array: HostMappedArray, offset, nbytes):
        self.array, self.offset = array, int(offset)
        self.ptr, self.nbytes = array.ptr + self.offset, int(nbytes)

    def upload(self, values):
        self.array.upload(values, self.offset)


class DeviceView(DeviceArray):
    """A window `[ptr, ptr + nbytes)` of another allocation (no memory of its own)."""

    def __init__(self, ptr, nbytes):
        self.ptr, self.nbytes = int(ptr), int(nbytes)


class Rank:
    """One rank: its context, stream, symmetric buffer, peer table, inputs and outputs."""

    def __init__(self, rank, ctx, layout: EpLayout, kernels, host_buffer=False):
        cu = _cu()
        self.rank, self.ctx, self.layout = rank, ctx, layout
        check(cu.cuCtxSetCurrent(ctx))
        self.stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
        self.dispatch, self.combine = kernels
        shape, n, tmax = layout.shape, layout.ranks, layout.tokens
        rows, latent, topk = layout.rows, shape.latent, shape.topk
        if host_buffer:  # the symmetric buffer in mapped host memory: readable after the context is lost
            self.buffer = HostMappedArray(layout.bytes)
            self.peers = HostMappedView(self.buffer, layout.peers, 8 * (n + 1))
        else:
            self.buffer = DeviceArray(layout.bytes)
            self.peers = DeviceView(self.buffer.ptr + layout.peers, 8 * (n + 1))  # the layout's local peer table
        self.x = DeviceArray(tmax * latent * 2)
        self.ids = DeviceArray(tmax * topk * 4)
        self.weights = DeviceArray(tmax * topk * 4)
        self.recv_x = DeviceArray(rows * latent)
        self.recv_sf = DeviceArray(rows * shape.num_sf)
        self.recv_ids = DeviceArray(rows * topk * 4)
        self.recv_weights = DeviceArray(rows * topk * 4)
        self.recv_src = DeviceArray(rows * 4)
        self.out = DeviceArray(rows * latent * 2)
        self.result = DeviceArray(tmax * latent * 2)
        self.norm = DeviceArray(latent * 2)
        self.arm()

    def arm(self):
        """Zero the buffer but its peer table (the protocol's initial state, as `SymmetricBuffers` leaves it)."""
        cu = _cu()
        lay = self.layout
        check(cu.cuCtxSetCurrent(self.ctx))
        if isinstance(self.buffer, HostMappedArray):
            check(cu.cuCtxSynchronize())  # no kernel still writes it
            ctypes.memset(self.buffer.host, 0, lay.peers)
        else:
            check(cu.cuMemsetD8(self.buffer.ptr, 0, lay.peers))
            check(cu.cuCtxSynchronize())

    def trace(self):
        """The kernel trace of a trace build (`kernels.common.TRACE`): `(timer_ns, cycles)`, each int64
        `[TRACE_LAYERS, 16]`, one row per layer of the ring (stamp meanings: `TRACE_STAMPS`)."""
        cu = _cu()
        check(cu.cuCtxSetCurrent(self.ctx))
        raw = np.empty((TRACE_LAYERS, 2, 16), np.int64)
        check(cu.cuMemcpyDtoH(raw.ctypes.data, self.buffer.ptr + self.layout.ctrl + TRACE, raw.nbytes))
        return raw[:, 0], raw[:, 1]

    def ctrl_words(self):
        cu = _cu()
        check(cu.cuCtxSetCurrent(self.ctx))
        out = np.empty(8, np.int32)
        check(cu.cuMemcpyDtoH(out.ctypes.data, self.buffer.ptr + self.layout.ctrl, 32))
        return out


def _grid(tokens, peer_tokens, ranks, cap):
    """The FFI's default grid (`nvlink.default_grids`) for a call whose ranks send at most `peer_tokens` tokens."""
    return max(tokens, min(ranks * stride(peer_tokens), cap))


class System:
    """N ranks on one GPU (virtual) or on N GPUs, with their kernels loaded."""

    def __init__(self, shape_name, ranks, max_tokens, mode, artifacts=DEFAULT_ARTIFACTS, arch="sm_90a", host_ranks=()):
        cu = _cu()
        check(cu.cuInit(0))
        self.cu = cu
        self.shape_name, self.shape = shape_name, SHAPES[shape_name]
        self.n, self.mode = ranks, mode
        manifest = Manifest(artifacts)
        entries = [manifest.entry(k, shape_name, ranks, arch) for k in ("dispatch", "combine")]
        devices = check(cu.cuDeviceGetCount())
        if mode == "devices" and devices < ranks:
            raise RuntimeError(f"{ranks} ranks on devices need {ranks} GPUs, found {devices}")
        ordinals = list(range(ranks)) if mode == "devices" else [0] * ranks
        self.ctxs = {}
        for o in sorted(set(ordinals)):
            dev = check(cu.cuDeviceGet(o))
            self.ctxs[o] = check(cu.cuDevicePrimaryCtxRetain(dev))
        if mode == "devices":
            for a in self.ctxs:
                check(cu.cuCtxSetCurrent(self.ctxs[a]))
                for b in self.ctxs:
                    if a != b:
                        err = cu.cuCtxEnablePeerAccess(self.ctxs[b], 0)[0]
                        if err not in (cu.CUresult.CUDA_SUCCESS, cu.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
                            check((err,))
        kernels = {}
        for o, ctx in self.ctxs.items():
            check(cu.cuCtxSetCurrent(ctx))
            kernels[o] = (Kernel(manifest, entries[0]), Kernel(manifest, entries[1]))
        check(cu.cuCtxSetCurrent(self.ctxs[ordinals[0]]))
        sms = check(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, check(cu.cuDeviceGet(0))))
        resident = min(k.occupancy() for k in kernels[ordinals[0]]) * sms
        per_device_ranks = ranks if mode == "virtual" else 1
        # Every CTA of every rank on a GPU may spin at once: keep them all resident.
        self.cap = max(1, resident // (2 * per_device_ranks))
        if max_tokens > self.cap:
            print(f"note: max_tokens {max_tokens} -> {self.cap} (residency: {resident} CTAs per GPU)")
            max_tokens = self.cap
        self.max_tokens = max_tokens
        #: Most CTAs of one launch beyond T (the grids are max(T, min(N * S, grid_cap))).
        self.grid_cap = self.cap
        self.layout = EpLayout(ranks, max_tokens, self.shape)
        self.ranks = [Rank(r, self.ctxs[ordinals[r]], self.layout, kernels[ordinals[r]], r in host_ranks)
                      for r in range(ranks)]
        for r in self.ranks:
            table = np.array([p.buffer.ptr for p in self.ranks] + [r.buffer.ptr], np.int64)
            check(cu.cuCtxSetCurrent(r.ctx))
            r.peers.upload(table)
        self.status = 0
        self.timeout_ns = 0

    def sync(self):
        for r in self.ranks:
            check(self.cu.cuCtxSetCurrent(r.ctx))
            check(self.cu.cuStreamSynchronize(r.stream))

    def launch_dispatch(self, r: Rank, tokens, timeout_ns=None, peer_tokens=None, **pointers):
        """Launches rank `r`'s dispatch of `tokens` tokens on its stream. `peer_tokens`: the largest T of any rank
        in this call (every rank must pass the same; None: `tokens`, every rank sends as many). `pointers` (raw
        device addresses, by parameter name: x, ids, weights, recv_x, recv_sf, recv_ids, recv_weights, recv_src)
        replace the rank's own arrays."""
        check(self.cu.cuCtxSetCurrent(r.ctx))
        peer_tokens = tokens if peer_tokens is None else peer_tokens
        grid = _grid(tokens, peer_tokens, self.n, self.grid_cap)
        args = dict(
            x=r.x.ptr, ids=r.ids.ptr, weights=r.weights.ptr, recv_x=r.recv_x.ptr, recv_sf=r.recv_sf.ptr,
            recv_ids=r.recv_ids.ptr, recv_weights=r.recv_weights.ptr, recv_src=r.recv_src.ptr,
        )
        _override(args, pointers)
        r.dispatch.launch(
            r.stream, grid, peers=r.peers.ptr, status=self.status,
            timeout_ns=self.timeout_ns if timeout_ns is None else timeout_ns,
            rank=r.rank, tokens=tokens, peer_tokens=peer_tokens, max_tokens=self.max_tokens, **args,
        )

    def launch_combine(self, r: Rank, tokens, apply_norm, eps=1e-6, peer_tokens=None, **pointers):
        """Launches rank `r`'s combine of `tokens` tokens on its stream; `peer_tokens` as its dispatch's. `pointers`
        (raw device addresses, by parameter name: out, ids, norm_weight, result) replace the rank's own arrays."""
        check(self.cu.cuCtxSetCurrent(r.ctx))
        peer_tokens = tokens if peer_tokens is None else peer_tokens
        grid = _grid(tokens, peer_tokens, self.n, self.grid_cap)
        args = dict(out=r.out.ptr, ids=r.ids.ptr, norm_weight=r.norm.ptr, result=r.result.ptr)
        _override(args, pointers)
        r.combine.launch(
            r.stream, grid, peers=r.peers.ptr, status=self.status, timeout_ns=self.timeout_ns, eps=eps,
            rank=r.rank, tokens=tokens, peer_tokens=peer_tokens, max_tokens=self.max_tokens, apply_norm=apply_norm,
            **args,
        )


def _override(args, pointers):
    """`args.update(pointers)` for known pointer names only (a typo must not pass silently)."""
    unknown = set(pointers) - set(args)
    if unknown:
        raise ValueError(f"unknown pointer arguments {sorted(unknown)}; expected some of {sorted(args)}")
    args.update({k: int(v) for k, v in pointers.items()})


# ---------------------------------------------------------------------------------------------------------
# Expected outputs and their comparison (shared by run_layers and stress)


class Rows(NamedTuple):
    """Receive rows of one rank, or stacked over leading axes `...`: x uint8 [..., R, L] (MXFP8 bytes), sf uint8
    [..., R, SF], ids int32 [..., R, K], weights uint32 [..., R, K] (FP32 bits), src int32 [..., R]."""

    x: np.ndarray
    sf: np.ndarray
    ids: np.ndarray
    weights: np.ndarray
    src: np.ndarray


def expected_receive(lay: EpLayout, d, state, quant):
    """The receive rows rank `d` must hold after a layer with `state[s] = (tokens, x, ids, weights)` of every
    source rank `s` and `quant[s] = mxfp8_reference(x)`: `(Rows, valid [R] bool)`. Empty rows hold the
    contract's constants (ids `invalid_expert(d)`, weights 0, src -1) and zero x / sf (unspecified: compare
    them only where `valid`)."""
    shape = lay.shape
    local, S = shape.num_local_experts(lay.ranks), lay.stride
    exp_ids = np.full((lay.rows, shape.topk), lay.invalid_expert(d), np.int32)
    exp_w = np.zeros((lay.rows, shape.topk), np.uint32)
    exp_src = np.full((lay.rows,), -1, np.int32)
    valid = np.zeros(lay.rows, bool)
    exp_x = np.zeros((lay.rows, shape.latent), np.uint8)
    exp_sf = np.zeros((lay.rows, shape.num_sf), np.uint8)
    for s, (tokens, x, ids, weights) in enumerate(state):
        hit = (ids // local == d).any(axis=1)
        t = np.nonzero(hit)[0]
        rows = s * S + t
        valid[rows] = True
        exp_ids[rows] = ids[t]
        exp_w[rows] = weights[t].view(np.uint32)
        exp_src[rows] = (s << 16) | t
        exp_x[rows] = quant[s][0][t]
        exp_sf[rows] = quant[s][1][t]
    return Rows(exp_x, exp_sf, exp_ids, exp_w, exp_src), valid


def _row_differs(a, b):
    """bool [..., R]: the rows of two same-shape arrays [..., R, W] that differ anywhere (8 bytes at a time)."""
    if a.shape == b.shape and a.dtype == b.dtype and (a.shape[-1] * a.itemsize) % 8 == 0:
        a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
        return (a.view(np.uint64) != b.view(np.uint64)).any(axis=-1)
    return (a != b).any(axis=-1)


def receive_mismatches(got: Rows, exp: Rows, valid):
    """Mismatching elements of received rows, an int array over the leading axes of `valid` [..., R]: ids,
    weights (bits) and src of every row and sf of valid rows bit-exact; x of valid rows bit-exact but for NaN
    (a NaN byte, 0x7F or 0xFF, equals any other). x / sf of empty rows are unspecified: not compared."""
    lead = valid.shape[:-1]
    bad = ((got.ids != exp.ids).sum(axis=(-2, -1)) + (got.weights != exp.weights).sum(axis=(-2, -1))
           + (got.src != exp.src).sum(axis=-1) + ((got.sf != exp.sf) & valid[..., None]).sum(axis=(-2, -1)))
    bad = np.array(bad, np.int64).reshape(-1)
    rows, width = valid.shape[-1], got.x.shape[-1]
    gx, ex = got.x.reshape(-1, rows, width), exp.x.reshape(-1, rows, width)
    which = np.nonzero(_row_differs(gx, ex) & valid.reshape(-1, rows))
    if which[0].size:
        g, e = gx[which], ex[which]
        nan_both = ((g & 0x7F) == 0x7F) & ((e & 0x7F) == 0x7F)
        np.add.at(bad, which[0], ((g != e) & ~nan_both).sum(axis=1))
    return bad.reshape(lead)


def host_expert(rows: Rows, valid, d, local, garbage):
    """The expert stage of rank `d` on the host: `out = bf16(dequant(row) * sum of the row's local weights)`
    in valid rows, `garbage` (one BF16 value, or one per row) in the others; bf16 [R, L]."""
    weights = rows.weights.view(np.float32)
    wsum = np.where(rows.ids // local == d, weights, np.float32(0)).sum(axis=1, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        out = (dequant(rows.x, rows.sf) * wsum[:, None]).astype(BF16)
    garbage = np.asarray(garbage, BF16)
    fill = np.broadcast_to(garbage.reshape(-1, 1) if garbage.ndim else garbage, out.shape)
    out[~valid] = fill[~valid]
    return out


def expected_result(outs, dests, s, stride_rows, tokens, norm, apply_norm):
    """Rank `s`'s combine output as BF16 bits (uint16 [tokens, L]) from every rank's expert output `outs[d]`
    (bf16 [R, L]) and the destination rank of each of its tokens' experts, `dests` [tokens, K]: the FP32 sum
    over the token's destination ranks in ascending order, rounded once (the routed latent), or, if
    `apply_norm`, RMSNorm of it (eps 1e-6, weight `norm`) in FP32, rounded once."""
    latent = outs[0].shape[-1]
    acc = np.zeros((tokens, latent), np.float32)
    own = slice(s * stride_rows, s * stride_rows + tokens)  # the rows of rank s's tokens
    for d in range(len(outs)):
        sel = (dests == d).any(axis=1)
        with np.errstate(invalid="ignore", over="ignore"):
            acc = np.where(sel[:, None], acc + outs[d][own].astype(np.float32), acc)
    routed = acc.astype(BF16)
    if not apply_norm:
        return routed.view(np.uint16)
    v = routed.astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        ss = (v.astype(np.float64) ** 2).sum(axis=1).astype(np.float32)
        rstd = (1.0 / np.sqrt(np.float64(ss / np.float32(latent) + np.float32(1e-6)))).astype(np.float32)
        y = ((v * rstd[:, None]).astype(np.float32) * norm.astype(np.float32)).astype(np.float32)
    return bf16_bits(y)


def result_mismatches(got, exp, apply_norm, rows=None):
    """`(bad, ulp1)` over the leading axes of the BF16 bits `got`, `exp` [..., T, L]: elements off by more than
    1 ulp where `apply_norm` (normed) or by any ulp where not (routed), and the normed elements at exactly 1
    ulp; NaN equals NaN. `rows` (bool [..., T]) limits the comparison to those tokens."""
    lead, (tokens, latent) = got.shape[:-2], got.shape[-2:]
    count = int(np.prod(lead, dtype=np.int64))
    g, e = got.reshape(count, tokens, latent), exp.reshape(count, tokens, latent)
    normed = np.broadcast_to(np.asarray(apply_norm) != 0, lead).reshape(count)
    differs = _row_differs(g, e)
    if rows is not None:
        differs &= np.broadcast_to(rows, (*lead, tokens)).reshape(count, tokens)
    bad, ulp1 = np.zeros(count, np.int64), np.zeros(count, np.int64)
    which = np.nonzero(differs)
    if which[0].size:
        g, e = g[which], e[which]  # [rows, L], then the differing elements only
        row, column = np.nonzero(g != e)
        dist = ulp_distance_bf16(g[row, column], e[row, column])
        owner = which[0][row]
        limit = normed[owner]
        np.add.at(bad, owner, dist > limit.astype(np.int32))
        np.add.at(ulp1, owner, (dist == 1) & limit)
    return bad.reshape(lead), ulp1.reshape(lead)


# ---------------------------------------------------------------------------------------------------------
# Correctness run


def make_tokens(rng, tokens, shape, special):
    """Random BF16 tokens with per-token scales over a wide range; `special` adds a tiny block with FP32
    subnormals and, if 'nonfinite', a NaN and an Inf block."""
    latent = shape.latent
    scale = np.exp2(rng.integers(-20, 21, size=(tokens, 1))).astype(np.float32)
    x = (rng.standard_normal((tokens, latent), dtype=np.float32) * scale)
    blocks = x.reshape(tokens, latent // 32, 32)
    blocks *= np.exp2(rng.integers(-6, 7, size=(tokens, latent // 32, 1))).astype(np.float32)
    x = x.astype(BF16)
    if special:
        t = rng.integers(tokens)
        b = rng.integers(latent // 32)
        tiny = (rng.standard_normal(32).astype(np.float32) * np.float32(2.0**-128)).astype(BF16)
        tiny[0] = BF16(2.0**-116)  # e = 3: the FP32-subnormal elements must flush to 0 (ftz)
        x[t, 32 * b : 32 * b + 32] = tiny
        x[(t + 1) % tokens, 0:32] = BF16(0.0)  # an all-zero block
        if special == "nonfinite":
            x[t, (32 * b + 64) % latent] = BF16(np.nan)
            x[(t + 1) % tokens, 40] = BF16(np.inf)
    return x


def make_routing(rng, tokens, shape):
    keys = rng.random((tokens, shape.experts))
    ids = np.argpartition(keys, shape.topk, axis=1)[:, : shape.topk].astype(np.int32)
    weights = rng.random((tokens, shape.topk), dtype=np.float32)
    return ids, weights


def run_layers(system: System, layers, seed=0, nonfinite_every=0, log_every=100, check_every=1, bad_ids=False):
    """Runs `layers` consecutive dispatch + combine layers; returns (layers, mismatches, details). With `bad_ids`
    every layer's routing also holds ids outside [0, E) (`routing.spoil_ids`, one in eight), which must select no
    rank."""
    rng = np.random.default_rng(seed)
    shape, lay, n = system.shape, system.layout, system.n
    latent, topk, nsf, S = shape.latent, shape.topk, shape.num_sf, lay.stride
    local = shape.experts // n
    norm = (1.0 + 0.25 * rng.standard_normal(latent)).astype(BF16)
    for r in system.ranks:
        check(system.cu.cuCtxSetCurrent(r.ctx))
        r.norm.upload(norm)
    mismatches = 0
    ulp1 = 0
    details = []
    started = time.perf_counter()
    for layer in range(layers):
        special = "nonfinite" if nonfinite_every and layer % nonfinite_every == nonfinite_every - 1 else (layer % 3 == 0)
        apply_norm = layer % 2
        state = []
        for r in system.ranks:
            tokens = int(rng.integers(1, system.max_tokens + 1))
            x = make_tokens(rng, tokens, shape, special)
            ids, weights = make_routing(rng, tokens, shape)
            if bad_ids:
                ids = routing.spoil_ids(rng, ids, shape.experts, shape.experts // n, 0.125)
            check(system.cu.cuCtxSetCurrent(r.ctx))
            r.x.upload(x)
            r.ids.upload(ids)
            r.weights.upload(weights)
            state.append((tokens, x, ids, weights))
        peer_tokens = max(s[0] for s in state)  # each rank draws its own T: the kernels poll up to the largest
        for r in system.ranks:
            system.launch_dispatch(r, state[r.rank][0], peer_tokens=peer_tokens)
        system.sync()
        # Expected receive rows.
        quant = [mxfp8_reference(s[1]) for s in state]
        dests = [(s[2] // local) for s in state]  # [T, K] destination rank of each expert
        received = []
        for d, r in enumerate(system.ranks):
            check(system.cu.cuCtxSetCurrent(r.ctx))
            got = Rows(
                r.recv_x.download(np.uint8, (lay.rows, latent)),
                r.recv_sf.download(np.uint8, (lay.rows, nsf)),
                r.recv_ids.download(np.int32, (lay.rows, topk)),
                r.recv_weights.download(np.uint32, (lay.rows, topk)),
                r.recv_src.download(np.int32, (lay.rows,)),
            )
            exp, valid = expected_receive(lay, d, state, quant)
            bad = int(receive_mismatches(got, exp, valid))
            if bad:
                details.append(f"layer {layer} rank {d}: {bad} receive mismatches")
            mismatches += bad
            received.append((got, valid))
        # Expert stage on the host: out = bf16(dequant(row) * sum of the row's local weights); garbage elsewhere.
        outs = []
        for d, r in enumerate(system.ranks):
            got, valid = received[d]
            out = host_expert(got, valid, d, local, BF16(np.nan) if layer % 2 else BF16(1e30))
            outs.append(out)
            check(system.cu.cuCtxSetCurrent(r.ctx))
            r.out.upload(out)
        for r in system.ranks:
            system.launch_combine(r, state[r.rank][0], apply_norm, peer_tokens=peer_tokens)
        system.sync()
        for s, r in enumerate(system.ranks):
            tokens, x, ids, weights = state[s]
            check(system.cu.cuCtxSetCurrent(r.ctx))
            got = r.result.download(np.uint16, (tokens, latent))
            exp = expected_result(outs, dests[s], s, S, tokens, norm, apply_norm)
            bad, one = (int(v) for v in result_mismatches(got, exp, apply_norm))
            ulp1 += one
            if bad:
                details.append(f"layer {layer} rank {s}: {bad} combine mismatches (norm={apply_norm})")
            mismatches += bad
        if log_every and (layer + 1) % log_every == 0:
            rate = (layer + 1) / (time.perf_counter() - started)
            print(f"  layer {layer + 1}/{layers}: mismatches {mismatches}, 1-ulp normed {ulp1} ({rate:.0f} layers/s)", flush=True)
        if len(details) > 20:
            break
    for r in system.ranks:
        words = r.ctrl_words()
        if words[CTRL_ERROR]:
            details.append(f"rank {r.rank} ctrl error words {words.tolist()}")
            mismatches += 1
    return layer + 1, mismatches, {"details": details, "ulp1": ulp1, "ctrl": [r.ctrl_words().tolist() for r in system.ranks]}


# ---------------------------------------------------------------------------------------------------------
# Latency


def _graph_time(system: System, body, graph_layers, replays, warmup_layers=10):
    """Kernel time per layer from CUDA-graph replays: each GPU's graph runs `warmup_layers + graph_layers` layers,
    with events recorded inside the graph (event record nodes) after the warm-up layers and at the end, and events
    around each replay. Returns `(steady median, steady min, whole median)` in us per layer over `replays` replays,
    each the max over the ranks' GPUs: "steady" over the last `graph_layers` layers only (the per-layer cost of a long
    run of layers), "whole" over the whole replay (it also pays the replay's start: the host launches the GPUs'
    graphs one after the other, and the GPU launched first waits for the others in its first layer, a skew of
    ~10-30 us that adds skew / layers to every layer). `body(rank)` launches one layer's kernels of a rank."""
    cu = system.cu
    external = cu.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL
    total = warmup_layers + graph_layers
    graphs, events = [], []
    for r in system.ranks:
        check(cu.cuCtxSetCurrent(r.ctx))
        inner = (check(cu.cuEventCreate(0)), check(cu.cuEventCreate(0)))
        check(cu.cuStreamBeginCapture(r.stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        for i in range(total):
            if i == warmup_layers:
                check(cu.cuEventRecordWithFlags(inner[0], r.stream, external))
            body(r)
        check(cu.cuEventRecordWithFlags(inner[1], r.stream, external))
        graph = check(cu.cuStreamEndCapture(r.stream))
        graphs.append(check(cu.cuGraphInstantiate(graph, 0)))
        events.append((check(cu.cuEventCreate(0)), check(cu.cuEventCreate(0))) + inner)
    steady, whole = [], []
    for it in range(replays + 2):
        for r, g, (start, stop, _, _) in zip(system.ranks, graphs, events):
            check(cu.cuCtxSetCurrent(r.ctx))
            check(cu.cuEventRecord(start, r.stream))
            check(cu.cuGraphLaunch(g, r.stream))
            check(cu.cuEventRecord(stop, r.stream))
        system.sync()
        if it >= 2:  # warm-up replays
            per_steady, per_whole = [], []
            for r, (start, stop, first, last) in zip(system.ranks, events):
                check(cu.cuCtxSetCurrent(r.ctx))
                per_steady.append(check(cu.cuEventElapsedTime(first, last)) * 1000.0 / graph_layers)
                per_whole.append(check(cu.cuEventElapsedTime(start, stop)) * 1000.0 / total)
            steady.append(max(per_steady))
            whole.append(max(per_whole))
    return float(np.median(steady)), float(min(steady)), float(np.median(whole))


#: Stamps of a trace build, by index (CTA 0, thread 0 unless said).
TRACE_STAMPS = {
    0: "dispatch entry", 1: "dispatch griddepcontrol.wait returned", 2: "dispatch inputs and mask done",
    3: "dispatch token 0 stored (issued)", 4: "dispatch launch_dependents",
    5: "dispatch first peer row copied out (CTA G - 1)", 6: "dispatch end",
    8: "combine entry", 9: "combine griddepcontrol.wait returned", 10: "combine sends issued",
    11: "combine launch_dependents", 12: "combine token 0 partials arrived", 13: "combine token 0 stored",
    14: "combine end",
}


def trace_report(system: System):
    """Per rank: median over the ring's layers of every stamp relative to the layer's dispatch entry (ns, from
    `%globaltimer`), and of CTA 0's cycles inside each kernel; then the gaps between kernels."""
    lines = []
    for r in system.ranks:
        timer, cycles = r.trace()
        order = np.argsort(timer[:, 0])
        timer, cycles = timer[order], cycles[order]
        rel = timer - timer[:, :1]
        lines.append(f"  rank {r.rank} (timer ns from dispatch entry; cycles from the kernel's entry):")
        for i, name in TRACE_STAMPS.items():
            base = 0 if i < 8 else 8
            # stamp 5 is another CTA's (another SM's clock)
            cyc = cycles[:, i] - cycles[:, base] if i != 5 else np.zeros(len(cycles), np.int64)
            lines.append(f"    {i:2d} {name:<58s} {np.median(rel[:, i]):8.0f} ns  {np.median(cyc):8.0f} cyc")
        gaps = {
            "combine wait returned - dispatch end": timer[:, 9] - timer[:, 6],
            "next dispatch entry - combine end": timer[1:, 0] - timer[:-1, 14],
            "next dispatch wait returned - combine end": timer[1:, 1] - timer[:-1, 14],
            "layer (dispatch entry to next)": timer[1:, 0] - timer[:-1, 0],
        }
        for name, v in gaps.items():
            lines.append(f"    {name:<61s} {np.median(v):8.0f} ns")
        if os.environ.get("JAX_LATENT_EP_KERNEL_TRACE", "") == "2":  # a warp trace build (kernels.common.TRACE_WARPS)
            polls = cycles[:, 0:7] - timer[:, 12:13]
            barrier = cycles[:, 8:15] - timer[:, 12:13]
            lines.append("    warp trace (ns from stamp 12; combine CTA 0, warps 0-6): polls of token 0 returned: "
                         + " ".join(f"{np.median(polls[:, w]):6.0f}" for w in range(7)))
            lines.append("    warp trace: past the stash barrier:                                         "
                         + " ".join(f"{np.median(barrier[:, w]):6.0f}" for w in range(7)))
            lines.append(f"    warp trace: warp 0's rstd {np.median(cycles[:, 15] - timer[:, 12]):6.0f}, its result stores "
                         f"issued {np.median(cycles[:, 7] - timer[:, 12]):6.0f}, stamp 13 "
                         f"{np.median(timer[:, 13] - timer[:, 12]):6.0f}")
        steps = np.unique(np.diff(np.sort(timer[:, :15].ravel())))
        lines.append(f"    smallest non-zero timer step: {steps[steps > 0].min() if (steps > 0).any() else 0} ns")
    print("\n".join(lines), flush=True)


def latency(system: System, token_counts=(1, 5, 32, 128), graph_layers=50, replays=30, apply_norm=1, trace=False,
            delay_ns=0, delay_rank=1):
    """Median kernel-only microseconds per T of one dispatch + combine layer (`layer`): CUDA graphs of
    `graph_layers` layers per GPU (`_graph_time`). (A dispatch alone repeated is refused by the kernels' sequence
    guard, so only whole layers are timed.) `delay_ns > 0` (an experiment): a one-thread kernel spinning that long
    runs before rank `delay_rank`'s every dispatch, so that this rank is the late one of every layer."""
    cu = system.cu
    rng = np.random.default_rng(1)
    shape = system.shape
    results = {}
    spin = {}
    if delay_ns:
        for r in system.ranks:
            if r.rank == delay_rank:
                check(cu.cuCtxSetCurrent(r.ctx))
                spin[r.rank] = SpinKernel()
    for tokens in token_counts:
        tokens = min(tokens, system.max_tokens)
        for r in system.ranks:
            check(cu.cuCtxSetCurrent(r.ctx))
            r.x.upload(make_tokens(rng, system.max_tokens, shape, False))
            ids, weights = make_routing(rng, system.max_tokens, shape)
            r.ids.upload(ids)
            r.weights.upload(weights)
            r.out.upload(np.zeros((system.layout.rows, shape.latent), BF16))
            r.norm.upload(np.ones(shape.latent, BF16))
        for _ in range(5):  # warm up, un-captured
            for r in system.ranks:
                system.launch_dispatch(r, tokens)
            for r in system.ranks:
                system.launch_combine(r, tokens, apply_norm)
        system.sync()

        def layer(r):
            if r.rank in spin:
                spin[r.rank].launch(r.stream, delay_ns)
            system.launch_dispatch(r, tokens)
            system.launch_combine(r, tokens, apply_norm)

        row = {"layer": _graph_time(system, layer, graph_layers, replays)}
        text = ""
        results[tokens] = row
        print(f"  T={tokens}: {row['layer'][0]:.2f} us per dispatch + combine (median of {replays}, min "
              f"{row['layer'][1]:.2f}; whole replays {row['layer'][2]:.2f}){text}", flush=True)
        if trace:
            trace_report(system)
    return results


# ---------------------------------------------------------------------------------------------------------
# Timeout


def timeout_test(artifacts=DEFAULT_ARTIFACTS, shape_name="kimi_k3", case="dispatch"):
    """A poll that never succeeds must trap and report, with a 2 ms timeout, N = 2 virtual ranks, 4 tokens each.
    `case` "dispatch": rank 1 never launches, so rank 0's dispatch waits for rank 1's rows: record {1, 0, 1, 0}.
    "combine": both ranks dispatch, then rank 0 alone combines and waits for rank 1's partials of its tokens:
    record {2, 0, 1, 0}. Returns (ok, record, the stream's error)."""
    system = System(shape_name, 2, 8, "virtual", artifacts)
    cu = system.cu
    system.status, status_host = _host_status(cu)
    system.timeout_ns = 2_000_000_000  # the dispatches of the combine case complete
    rng = np.random.default_rng(0)
    for r in reversed(system.ranks[:1] if case == "dispatch" else system.ranks):  # rank 0 last: `ids` are its
        r.x.upload(make_tokens(rng, 4, system.shape, False))
        ids, weights = make_routing(rng, 4, system.shape)
        r.ids.upload(ids)
        r.weights.upload(weights)
    r = system.ranks[0]
    if case == "combine":
        if not (ids // system.shape.num_local_experts(2) == 1).any():
            raise RuntimeError("the routing sends no token of rank 0 to rank 1")  # not with these seeds and shapes
        for q in system.ranks:
            system.launch_dispatch(q, 4)
        system.sync()
        system.timeout_ns = 2_000_000
        started = time.perf_counter()
        system.launch_combine(r, 4, apply_norm=1)
    else:
        started = time.perf_counter()
        system.launch_dispatch(r, 4, timeout_ns=2_000_000)
    err = cu.cuStreamSynchronize(r.stream)[0]
    elapsed = time.perf_counter() - started
    record = [status_host[i] for i in range(4)]
    print(f"  timeout ({case}): stream sync -> {err!r} after {elapsed * 1e3:.1f} ms, status record {record}",
          flush=True)
    code = 1 if case == "dispatch" else 2
    ok = err != cu.CUresult.CUDA_SUCCESS and record == [code, 0, 1, 0]
    return ok, record, str(err)


def sequence_test(case, artifacts=DEFAULT_ARTIFACTS, shape_name="kimi_k3", tokens=8):
    """A call out of sequence corrupts nothing else: N = 2 virtual ranks on one GPU, rank 1's symmetric buffer in
    mapped host memory (the CPU reads it after rank 0's trap has lost the context). Both ranks run layer 0
    (`case` "dispatch_twice": the dispatch; "combine_twice": dispatch and combine) on fresh random inputs; rank
    1's buffer (receive rows, combine slots and control lines: all a peer may write) is read. Rank 0 then
    repeats its last call with new random inputs, out of sequence: it must trap with error 3 (4) and leave rank
    1's buffer byte for byte as it was. Returns (ok, status record, bytes of rank 1's buffer changed)."""
    system = System(shape_name, 2, tokens, "virtual", artifacts, host_ranks=(1,))
    cu = system.cu
    system.status, status_host = _host_status(cu)
    system.timeout_ns = 2_000_000_000
    rng = np.random.default_rng(7)
    lay = system.layout
    for r in system.ranks:
        r.x.upload(make_tokens(rng, tokens, system.shape, False))
        ids, weights = make_routing(rng, tokens, system.shape)
        r.ids.upload(ids)
        r.weights.upload(weights)
        r.out.upload(rng.standard_normal((lay.rows, system.shape.latent), dtype=np.float32).astype(BF16))
    for r in system.ranks:
        system.launch_dispatch(r, tokens)
    system.sync()
    if case == "combine_twice":
        for r in system.ranks:
            system.launch_combine(r, tokens, apply_norm=1)
        system.sync()
    offender, victim = system.ranks
    before = victim.buffer.download(np.uint8, lay.peers)
    offender.x.upload(make_tokens(rng, tokens, system.shape, False))
    offender.out.upload(rng.standard_normal((lay.rows, system.shape.latent), dtype=np.float32).astype(BF16))
    if case == "dispatch_twice":
        system.launch_dispatch(offender, tokens)
    else:
        system.launch_combine(offender, tokens, apply_norm=1)
    err = cu.cuStreamSynchronize(offender.stream)[0]
    time.sleep(0.05)  # anything still in flight has landed
    after = victim.buffer.download(np.uint8, lay.peers)
    changed = int(np.count_nonzero(before != after))
    record = [status_host[i] for i in range(4)]
    code = 3 if case == "dispatch_twice" else 4
    print(f"  sequence {case}: offender sync -> {err!r}, status record {record}, "
          f"{changed} of {lay.peers} bytes of rank 1's buffer changed", flush=True)
    ok = err != cu.CUresult.CUDA_SUCCESS and record[:3] == [code, 0, 0] and changed == 0
    return ok, record, changed


# ---------------------------------------------------------------------------------------------------------
# Stress

#: Largest number of input-set combinations a stress layer may draw from (one expert-output array each): beyond
#: it, every rank of a layer reads the same set index.
STRESS_MAX_COMBOS = 64


def make_pool_routing(rng, tokens, shape, ranks, one_rank_fraction):
    """`make_routing`, then about `one_rank_fraction` of the tokens re-routed to K distinct experts of one random
    rank (such a token leaves its receive row empty on every other rank)."""
    ids, weights = make_routing(rng, tokens, shape)
    local = shape.num_local_experts(ranks)
    if ranks > 1 and local >= shape.topk:
        for t in np.nonzero(rng.random(tokens) < one_rank_fraction)[0]:
            ids[t] = int(rng.integers(ranks)) * local + rng.choice(local, size=shape.topk, replace=False)
    return ids, weights


class StressPool:
    """Host side of the stress run: `pool` input sets per rank (`max_tokens` tokens each, from run_layers'
    generators: every 4th set with a NaN and an Inf block, every 4th with subnormal and zero blocks, every 2nd
    with half its tokens routed to one rank only), the set combinations a layer draws from (`combos` [C, N]:
    rank s reads set `combos[c, s]`) and every expected output, computed once with run_layers' model code.

    A layer's expectations split into per-source blocks: rank d's receive rows from source s (rows s * S ..
    s * S + S - 1) depend only on s's (set, T), and rank s's combine output only on its own (set, apply_norm)
    (token t's routed latent does not depend on T). So they are computed once per set for T = max_tokens and
    cut to each layer's T (rows t >= T empty, result rows t >= T not compared): T is free in 1..max_tokens and
    nothing is cached per layer. Rank d's expert output (the combine's `out` input) mixes the sources' sets:
    one array per combo, garbage (NaN or 1e30, alternating by row) in its empty rows."""

    def __init__(self, rng, shape, lay: EpLayout, pool, norm, max_combos=STRESS_MAX_COMBOS):
        n, tmax, S = lay.ranks, lay.tokens, lay.stride
        latent, topk = shape.latent, shape.topk
        local = shape.num_local_experts(n)
        self.shape, self.layout, self.pool, self.norm = shape, lay, pool, norm
        self.x = np.empty((n, pool, tmax, latent), BF16)
        self.ids = np.empty((n, pool, tmax, topk), np.int32)
        self.weights = np.empty((n, pool, tmax, topk), np.float32)
        for s in range(n):
            for p in range(pool):
                special = "nonfinite" if p % 4 == 3 else p % 4 == 0
                self.x[s, p] = make_tokens(rng, tmax, shape, special)
                self.ids[s, p], self.weights[s, p] = make_pool_routing(rng, tmax, shape, n, 0.5 if p % 2 else 0.0)
        if pool**n <= max_combos:
            combos = list(itertools.product(range(pool), repeat=n))
        else:
            combos = [(p,) * n for p in range(pool)]
        self.combos = np.array(combos, np.int64).reshape(-1, n)
        # [destination d, source s, set p, S]: the receive rows from s on d for T = max_tokens.
        self.rx = np.zeros((n, n, pool, S, latent), np.uint8)
        self.rsf = np.zeros((n, n, pool, S, shape.num_sf), np.uint8)
        self.rids = np.zeros((n, n, pool, S, topk), np.int32)
        self.rw = np.zeros((n, n, pool, S, topk), np.uint32)
        self.rsrc = np.zeros((n, n, pool, S), np.int32)
        self.hit = np.zeros((n, n, pool, S), bool)
        self.outs = np.empty((pool, n, lay.rows, latent), BF16)  # [set p of every source, d]: expert outputs
        self.result = np.empty((n, pool, 2, tmax, latent), np.uint16)  # [s, p, apply_norm]: combine outputs
        garbage = np.array([np.nan, 1e30], np.float32).astype(BF16)
        for p in range(pool):
            state = [(tmax, self.x[s, p], self.ids[s, p], self.weights[s, p]) for s in range(n)]
            quant = [mxfp8_reference(self.x[s, p]) for s in range(n)]
            for d in range(n):
                exp, valid = expected_receive(lay, d, state, quant)
                self.rx[d, :, p] = exp.x.reshape(n, S, latent)
                self.rsf[d, :, p] = exp.sf.reshape(n, S, shape.num_sf)
                self.rids[d, :, p] = exp.ids.reshape(n, S, topk)
                self.rw[d, :, p] = exp.weights.reshape(n, S, topk)
                self.rsrc[d, :, p] = exp.src.reshape(n, S)
                self.hit[d, :, p] = valid.reshape(n, S)
                self.outs[p, d] = host_expert(exp, valid, d, local, garbage[(np.arange(lay.rows) + p + d) % 2])
            for s in range(n):
                for apply_norm in (0, 1):
                    self.result[s, p, apply_norm] = expected_result(
                        self.outs[p], self.ids[s, p] // local, s, S, tmax, norm, apply_norm)

    def combo_outs(self, d):
        """bf16 [C, R, L]: rank d's expert outputs for every combo (rows of source s from set `combos[c, s]`)."""
        n, S = self.layout.ranks, self.layout.stride
        blocks = self.outs.reshape(self.pool, n, n, S, -1)[self.combos, d, np.arange(n)[None, :]]  # [C, N, S, L]
        return np.ascontiguousarray(blocks.reshape(len(self.combos), self.layout.rows, -1))

    def receive(self, d, combo, tokens):
        """Rank d's expected receive rows after layers of combos `combo` [B] and token counts `tokens` [B, N]:
        `(Rows [B, R, ...], valid [B, R])`."""
        lay = self.layout
        n, S = lay.ranks, lay.stride
        sets = self.combos[combo]  # [B, N]
        src = np.arange(n)[None, :]
        valid = self.hit[d][src, sets] & (np.arange(S) < np.asarray(tokens)[:, :, None])  # [B, N, S]
        rows = Rows(
            self.rx[d][src, sets],
            self.rsf[d][src, sets],
            np.where(valid[..., None], self.rids[d][src, sets], np.int32(lay.invalid_expert(d))),
            np.where(valid[..., None], self.rw[d][src, sets], np.uint32(0)),
            np.where(valid, self.rsrc[d][src, sets], np.int32(-1)),
        )
        batch = len(combo)
        return Rows(*(a.reshape(batch, lay.rows, *a.shape[3:]) for a in rows)), valid.reshape(batch, lay.rows)

    def combined(self, s, combo, apply_norm, tokens):
        """Rank s's expected combine outputs (BF16 bits [B, max_tokens, L]) after layers of combos `combo` [B],
        `apply_norm` [B] and its token counts `tokens` [B], and the rows to compare (bool [B, max_tokens])."""
        exp = self.result[s, self.combos[combo, s], np.asarray(apply_norm)]
        return exp, np.arange(self.layout.tokens) < np.asarray(tokens)[:, None]


class Schedule(NamedTuple):
    """The random choices of the stress layers, one row per layer."""

    combo: np.ndarray  # [layers]: a row of StressPool.combos (rank s reads set combos[c, s])
    tokens: np.ndarray  # [layers, N]: T of every rank, 1..max_tokens
    apply_norm: np.ndarray  # [layers]: 0 routed, 1 normed (every rank)
    delayed: np.ndarray  # [layers]: the rank whose launches are held back, -1 for none
    delay_ns: np.ndarray  # [layers]: how long (0 where none)
    delay_combine: np.ndarray  # [layers]: 1: the delay comes between its dispatch and its combine; 0: before both
    order: np.ndarray  # [layers, N]: launch order of the ranks, the delayed one last


def stress_schedule(rng, layers, ranks, combos, max_tokens, delay_prob=0.5, max_delay_us=200.0):
    """Draws a `Schedule`: uniform combos and apply_norm; T uniform in 1..max_tokens, a quarter of the draws
    forced to 1 or max_tokens; with probability `delay_prob` a layer holds one random rank back by 0 ..
    `max_delay_us` microseconds, that rank launching after the others."""
    combo = rng.integers(combos, size=layers)
    tokens = rng.integers(1, max_tokens + 1, size=(layers, ranks))
    edge = rng.random((layers, ranks)) < 0.25
    tokens = np.where(edge, np.where(rng.random((layers, ranks)) < 0.5, 1, max_tokens), tokens)
    apply_norm = rng.integers(2, size=layers)
    delay = (rng.random(layers) < delay_prob) & (max_delay_us > 0)
    delayed = np.where(delay, rng.integers(ranks, size=layers), -1)
    delay_ns = np.where(delay, rng.integers(0, int(max_delay_us * 1000) + 1, size=layers), 0)
    delay_combine = np.where(delay, rng.integers(2, size=layers), 0)
    order = rng.permuted(np.tile(np.arange(ranks), (layers, 1)), axis=1)
    last = np.argsort(order == delayed[:, None], axis=1, kind="stable")  # the delayed rank moves to the end
    order = np.take_along_axis(order, last, axis=1)
    return Schedule(combo, tokens, apply_norm, delayed, delay_ns, delay_combine, order)


class StressBuffers:
    """Device side of the stress run, per rank: its input sets and the expert outputs of every combo (uploaded
    once), and `batch` slots of every output (each layer of a batch writes its own slot)."""

    INPUTS = ("x", "ids", "weights", "out")
    OUTPUTS = ("recv_x", "recv_sf", "recv_ids", "recv_weights", "recv_src", "result")

    def __init__(self, system: System, pool: StressPool, batch):
        cu, lay, shape = system.cu, system.layout, system.shape
        tmax, rows, latent, topk = lay.tokens, lay.rows, shape.latent, shape.topk
        self.batch = batch
        # Bytes of one input set / combo / output slot.
        self.sizes = {
            "x": tmax * latent * 2, "ids": tmax * topk * 4, "weights": tmax * topk * 4, "out": rows * latent * 2,
            "recv_x": rows * latent, "recv_sf": rows * shape.num_sf, "recv_ids": rows * topk * 4,
            "recv_weights": rows * topk * 4, "recv_src": rows * 4, "result": tmax * latent * 2,
        }
        self.arrays = []
        for d, r in enumerate(system.ranks):
            check(cu.cuCtxSetCurrent(r.ctx))
            arrays = {}
            for name, host in zip(self.INPUTS, (pool.x[d], pool.ids[d], pool.weights[d], pool.combo_outs(d))):
                assert host.nbytes == len(host) * self.sizes[name], (name, host.shape)
                arrays[name] = DeviceArray(host.nbytes)
                arrays[name].upload(host)
            for name in self.OUTPUTS:
                arrays[name] = DeviceArray(batch * self.sizes[name])
            r.norm.upload(pool.norm)
            self.arrays.append(arrays)
        for r in system.ranks:  # a pageable upload may return before its DMA lands: settle before any launch
            check(cu.cuCtxSetCurrent(r.ctx))
            check(cu.cuCtxSynchronize())

    def ptr(self, rank, name, index):
        """Device address of input set / combo / output slot `index` of array `name` of `rank`."""
        return self.arrays[rank][name].ptr + index * self.sizes[name]

    def download(self, system: System, rank, count):
        """`(Rows [count, R, ...], result bits [count, max_tokens, L])` of the first `count` slots of `rank`."""
        lay, shape = system.layout, system.shape
        check(system.cu.cuCtxSetCurrent(system.ranks[rank].ctx))
        a = self.arrays[rank]
        got = Rows(
            a["recv_x"].download(np.uint8, (count, lay.rows, shape.latent)),
            a["recv_sf"].download(np.uint8, (count, lay.rows, shape.num_sf)),
            a["recv_ids"].download(np.int32, (count, lay.rows, shape.topk)),
            a["recv_weights"].download(np.uint32, (count, lay.rows, shape.topk)),
            a["recv_src"].download(np.int32, (count, lay.rows)),
        )
        return got, a["result"].download(np.uint16, (count, lay.tokens, shape.latent))


def _spin(ns):
    """Busy-waits `ns` nanoseconds on the host (sleeps are far too coarse for microseconds)."""
    end = time.perf_counter_ns() + ns
    while time.perf_counter_ns() < end:
        pass


def _launch_stress_layer(system: System, bufs: StressBuffers, sets, combo, slot, tokens, apply_norm, delayed,
                         delay_ns, delay_combine, order):
    """Launches one stress layer (dispatch + combine of every rank, in `order`) into output slot `slot`,
    busy-waiting `delay_ns` before rank `delayed`'s dispatch (or, if `delay_combine`, its combine)."""
    peer_tokens = int(max(tokens))
    for s in order:
        r = system.ranks[s]
        if s == delayed and not delay_combine:
            _spin(delay_ns)
        system.launch_dispatch(
            r, tokens[s], peer_tokens=peer_tokens, x=bufs.ptr(s, "x", sets[s]), ids=bufs.ptr(s, "ids", sets[s]),
            weights=bufs.ptr(s, "weights", sets[s]), recv_x=bufs.ptr(s, "recv_x", slot),
            recv_sf=bufs.ptr(s, "recv_sf", slot), recv_ids=bufs.ptr(s, "recv_ids", slot),
            recv_weights=bufs.ptr(s, "recv_weights", slot), recv_src=bufs.ptr(s, "recv_src", slot),
        )
        if s == delayed and delay_combine:
            _spin(delay_ns)
        system.launch_combine(
            r, tokens[s], apply_norm, peer_tokens=peer_tokens, out=bufs.ptr(s, "out", combo),
            ids=bufs.ptr(s, "ids", sets[s]), result=bufs.ptr(s, "result", slot),
        )


def _check_stress_batch(system: System, bufs: StressBuffers, pool: StressPool, sched: Schedule, start, count):
    """Compares the `count` layers of a batch from layer `start` with the pool's expectations: `(receive
    mismatches [count, N], combine mismatches [count, N], normed elements at 1 ulp)`."""
    n = system.n
    part = slice(start, start + count)
    combo, tokens, apply_norm = sched.combo[part], sched.tokens[part], sched.apply_norm[part]
    bad_receive = np.zeros((count, n), np.int64)
    bad_combine = np.zeros((count, n), np.int64)
    ulp1 = 0
    for d in range(n):
        got, result = bufs.download(system, d, count)
        exp, valid = pool.receive(d, combo, tokens)
        bad_receive[:, d] = receive_mismatches(got, exp, valid)
        exp_result, rows = pool.combined(d, combo, apply_norm, tokens[:, d])
        bad, one = result_mismatches(result, exp_result, apply_norm, rows)
        bad_combine[:, d] = bad
        ulp1 += int(one.sum())
    return bad_receive, bad_combine, ulp1


def _describe_stress_layer(pool: StressPool, sched: Schedule, layer):
    """The choices of one layer, for a mismatch report."""
    text = (f"T {sched.tokens[layer].tolist()}, sets {pool.combos[sched.combo[layer]].tolist()}, "
            f"norm {int(sched.apply_norm[layer])}, order {sched.order[layer].tolist()}")
    if sched.delayed[layer] >= 0:
        where = "combine" if sched.delay_combine[layer] else "dispatch"
        text += f", rank {int(sched.delayed[layer])} delayed {sched.delay_ns[layer] / 1000:.0f} us before its {where}"
    return text


def _host_status(cu):
    """A zeroed, mapped, portable host record of 4 int32 for the kernels' `status` argument (`fail` writes
    {code, rank, peer, layer} there before it traps): `(device address, ctypes view)`."""
    host = check(cu.cuMemHostAlloc(16, cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE))
    record = (ctypes.c_int32 * 4).from_address(int(host))
    for i in range(4):
        record[i] = 0
    return int(check(cu.cuMemHostGetDevicePointer(host, 0))), record


def stress(system: System, layers, seed=0, pool_size=8, batch=64, delay_prob=0.5, max_delay_us=200.0,
           log_every=10_000, max_details=20):
    """Runs `layers` consecutive dispatch + combine layers with random choices (`stress_schedule`) on input sets
    uploaded once (`StressPool`, `StressBuffers`): `batch` layers are launched back to back, each into its own
    output slots, then the ranks are synchronized once and the batch is compared (run_layers' rules: receive rows
    and routed bit-exact, normed within 1 ulp). A layer may hold one rank's launches back by a host busy-wait.
    Stops early after `max_details` mismatching (layer, rank) reports or on a CUDA error (a kernel trap: the
    host status record says which rank, peer and layer). Returns `(layers, mismatches, info)`."""
    started = time.perf_counter()
    cu, n = system.cu, system.n
    rng = np.random.default_rng(seed)
    norm = (1.0 + 0.25 * rng.standard_normal(system.shape.latent)).astype(BF16)
    pool = StressPool(rng, system.shape, system.layout, pool_size, norm)
    sched = stress_schedule(rng, layers, n, len(pool.combos), system.max_tokens, delay_prob, max_delay_us)
    bufs = StressBuffers(system, pool, batch)
    record = None
    if system.status == 0:
        try:
            system.status, record = _host_status(cu)
        except RuntimeError as error:
            print(f"  note: no host status record ({error}): a trap will not say which rank / peer / layer")
    epochs = [int(r.ctrl_words()[CTRL_LAYER]) for r in system.ranks]  # layers completed before this run
    info = {"details": [], "ulp1": 0, "delayed": 0, "error": None, "status": None, "ctrl": [],
            "combos": len(pool.combos), "setup_s": time.perf_counter() - started}
    print(f"  stress setup: {pool_size} input sets per rank, {len(pool.combos)} combos, batches of {batch}, "
          f"{info['setup_s']:.1f} s", flush=True)
    mismatches, done, logged = 0, 0, 0
    started = time.perf_counter()
    try:
        for start in range(0, layers, batch):
            count = min(batch, layers - start)
            part = slice(start, start + count)
            sets = pool.combos[sched.combo[part]].tolist()
            rows = zip(sets, sched.combo[part].tolist(), sched.tokens[part].tolist(), sched.apply_norm[part].tolist(),
                       sched.delayed[part].tolist(), sched.delay_ns[part].tolist(), sched.delay_combine[part].tolist(),
                       sched.order[part].tolist())
            for slot, row in enumerate(rows):
                _launch_stress_layer(system, bufs, row[0], row[1], slot, *row[2:])
            system.sync()
            bad_receive, bad_combine, ulp1 = _check_stress_batch(system, bufs, pool, sched, start, count)
            done = start + count
            info["ulp1"] += ulp1
            mismatches += int(bad_receive.sum() + bad_combine.sum())
            for i, d in zip(*np.nonzero(bad_receive + bad_combine)):
                info["details"].append(
                    f"layer {start + i} rank {d}: {bad_receive[i, d]} receive, {bad_combine[i, d]} combine mismatches "
                    f"({_describe_stress_layer(pool, sched, start + i)})")
            if log_every and done // log_every > logged:
                logged = done // log_every
                rate = done / (time.perf_counter() - started)
                print(f"  layer {done}/{layers}: mismatches {mismatches}, 1-ulp normed {info['ulp1']}, delayed "
                      f"{int((sched.delayed[:done] >= 0).sum())} ({rate:.0f} layers/s)", flush=True)
            if len(info["details"]) > max_details:
                break
    except RuntimeError as error:  # a CUDA error: the kernels trapped (timeout, sequence error) or a launch failed
        info["error"] = f"in the batch of layers {start}..{start + count - 1}: {error}"
        if record is not None:
            info["status"] = [int(record[i]) for i in range(4)]
    info["seconds"] = time.perf_counter() - started
    info["delayed"] = int((sched.delayed[:done] >= 0).sum())
    if info["error"] is None:
        for r in system.ranks:
            words = r.ctrl_words()
            info["ctrl"].append(words.tolist())
            if words[CTRL_ERROR]:
                info["details"].append(f"rank {r.rank} ctrl error words {words.tolist()}")
                mismatches += 1
            if words[CTRL_LAYER] != epochs[r.rank] + done:
                info["details"].append(f"rank {r.rank} completed {words[CTRL_LAYER] - epochs[r.rank]} layers, "
                                       f"expected {done}")
                mismatches += 1
    return done, mismatches, info


# ---------------------------------------------------------------------------------------------------------
# CLI


def _csv_rows(path, rows):
    if not path:
        return
    path = pathlib.Path(path)
    new = not path.exists()
    with path.open("a") as f:
        if new:
            f.write("date,device,commit,backend,ranks,tokens,metric,value\n")
        for row in rows:
            f.write(",".join(str(v) for v in row) + "\n")


def _device_name():
    cu = _cu()
    check(cu.cuInit(0))
    name = check(cu.cuDeviceGetName(64, check(cu.cuDeviceGet(0))))
    return name.split(b"\0")[0].decode().replace(",", " ")


def _stress_cli(args, n, device, date):
    """`--mode stress` for N = n: runs, prints, appends the CSV rows; returns `(failed, error)`."""
    mode = "virtual" if args.stress_virtual else "devices"
    system = System(args.shape, n, args.max_tokens, mode, args.artifacts)
    system.timeout_ns = args.timeout_ns
    where = "1 GPU (virtual ranks)" if mode == "virtual" else f"{n} GPUs"
    print(f"stress: {args.shape} N={n} on {where}, max_tokens {system.max_tokens}, {args.layers} layers", flush=True)
    layers, mismatches, info = stress(
        system, args.layers, seed=args.seed + n, pool_size=args.stress_pool, batch=args.stress_batch,
        delay_prob=args.stress_delay_prob, max_delay_us=args.stress_delay_us, log_every=args.stress_log_every,
    )
    for line in info["details"][:20]:
        print("   ", line)
    if info["error"]:
        print(f"  ERROR {info['error']}; host status record {{code, rank, peer, layer}} = {info['status']}", flush=True)
    print(f"  {info['ulp1']} normed elements at 1 ulp; ctrl {info['ctrl']}")
    print(f"stress: {layers} layers, {mismatches} mismatches, {info['delayed']} delayed launches, "
          f"{info['seconds']:.1f} s", flush=True)
    backend_device = f"1x {device} ({n} virtual ranks)" if mode == "virtual" else f"{n}x {device}"
    _csv_rows(args.csv, [
        (date, backend_device, args.commit, "stress", n, system.max_tokens, metric, value)
        for metric, value in (("layers", layers), ("mismatches", mismatches), ("delayed_layers", info["delayed"]),
                              ("seconds", f"{info['seconds']:.1f}"))
    ])
    failed = mismatches != 0 or layers != args.layers or info["error"] is not None
    return failed, info["error"] is not None


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tools.kernel_harness", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("virtual", "devices", "latency", "timeout", "sequence", "stress"), default="virtual")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="kimi_k3")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2])
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--timeout-ns", type=int, default=10_000_000_000, help="flag-wait bound (0: forever)")
    parser.add_argument("--nonfinite-every", type=int, default=50, help="every k-th layer has NaN/Inf blocks")
    parser.add_argument("--bad-ids", action="store_true",
                        help="virtual/devices: every layer's routing also holds ids outside [0, E) (they reach no rank)")
    parser.add_argument("--artifacts", default=str(DEFAULT_ARTIFACTS))
    parser.add_argument("--csv", default=None, help="append figures to this CSV")
    parser.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--latency-tokens", type=int, nargs="+", default=None,
                        help="latency mode: the T values (default 1 5 32 128, each at most --max-tokens)")
    parser.add_argument("--grid-cap", type=int, default=0, help="latency mode: grids max(T, min(N * S, this))")
    parser.add_argument("--tag", default="", help="suffix of the CSV rows' backend name (latency mode)")
    parser.add_argument("--trace", action="store_true", help="latency mode with a trace build: print its stamps")
    parser.add_argument("--latency-delay-ns", type=int, default=0,
                        help="latency mode, an experiment: rank 1 spins this long before each dispatch (the late rank)")
    parser.add_argument("--latency-virtual", action="store_true",
                        help="latency mode: all ranks on one GPU, one stream each (the peers' stores stay on the "
                             "device: no NVLink in the times)")
    parser.add_argument("--sequence-case", choices=("dispatch_twice", "combine_twice"), default="dispatch_twice")
    parser.add_argument("--timeout-case", choices=("dispatch", "combine"), default="dispatch",
                        help="--mode timeout: the kernel whose poll must time out")
    group = parser.add_argument_group("stress mode")
    group.add_argument("--stress-virtual", action="store_true", help="all ranks on one GPU (default: one per GPU)")
    group.add_argument("--stress-pool", type=int, default=8, help="input sets per rank, uploaded once")
    group.add_argument("--stress-batch", type=int, default=64, help="layers launched between two syncs")
    group.add_argument("--stress-delay-prob", type=float, default=0.5, help="fraction of layers with a rank held back")
    group.add_argument("--stress-delay-us", type=float, default=200.0, help="longest hold-back (host busy-wait)")
    group.add_argument("--stress-log-every", type=int, default=10_000, help="progress line every k layers")
    args = parser.parse_args(argv)
    date = time.strftime("%Y-%m-%d", time.gmtime())
    failed = False
    if args.mode == "timeout":
        ok, record, err = timeout_test(args.artifacts, args.shape, args.timeout_case)
        print("TIMEOUT TEST", args.timeout_case, "PASS" if ok else "FAIL")
        return 0 if ok else 1
    if args.mode == "sequence":
        ok, record, changed = sequence_test(args.sequence_case, args.artifacts, args.shape)
        print("SEQUENCE TEST", args.sequence_case, "PASS" if ok else "FAIL")
        _csv_rows(args.csv, [(date, f"1x {_device_name()} (2 virtual ranks)", args.commit, "stress", 2, 8,
                              f"{args.sequence_case}_peer_bytes_changed", changed)])
        return 0 if ok else 1
    device = _device_name()
    for n in args.ranks:
        if args.mode == "stress":
            bad, error = _stress_cli(args, n, device, date)
            failed |= bad
            if error:
                break  # a trapped context is unusable
            continue
        if args.mode == "latency":
            system = System(args.shape, n, args.max_tokens, "virtual" if args.latency_virtual else "devices",
                            args.artifacts)
            system.timeout_ns = args.timeout_ns
            if args.grid_cap:
                system.grid_cap = min(args.grid_cap, system.cap)
            where = "1 GPU (virtual ranks)" if args.latency_virtual else f"{n} GPUs"
            print(f"latency {args.shape} N={n} on {where}, grids max(T, min(N * S, {system.grid_cap}))", flush=True)
            counts = tuple(args.latency_tokens) if args.latency_tokens else (1, 5, 32, 128)
            res = latency(system, token_counts=counts, trace=args.trace, delay_ns=args.latency_delay_ns)
            backend_device = f"1x {device} ({n} virtual ranks)" if args.latency_virtual else f"{n}x {device}"
            rows = []
            for t, row in res.items():
                rows.append((date, backend_device, args.commit, "kernel-harness" + args.tag, n, t, "kernel_us_median", f"{row['layer'][0]:.2f}"))
                rows.append((date, backend_device, args.commit, "kernel-harness" + args.tag, n, t,
                             "kernel_replay_us_median", f"{row['layer'][2]:.2f}"))
                for part in ("dispatch", "combine"):
                    if part in row:
                        rows.append((date, backend_device, args.commit, "kernel-harness" + args.tag, n, t, f"{part}_us_median", f"{row[part][0]:.2f}"))
            _csv_rows(args.csv, rows)
            continue
        system = System(args.shape, n, args.max_tokens, args.mode, args.artifacts)
        system.timeout_ns = args.timeout_ns
        where = "1 GPU (virtual ranks)" if args.mode == "virtual" else f"{n} GPUs"
        print(f"{args.mode}: {args.shape} N={n} on {where}, max_tokens {system.max_tokens}, {args.layers} layers", flush=True)
        started = time.perf_counter()
        layers, mismatches, info = run_layers(system, args.layers, seed=args.seed + n, nonfinite_every=args.nonfinite_every,
                                              bad_ids=args.bad_ids)
        print(f"  -> {layers} layers, {mismatches} mismatches, {info['ulp1']} normed elements at 1 ulp, "
              f"{time.perf_counter() - started:.1f} s; ctrl {info['ctrl'][0]}", flush=True)
        for line in info["details"][:20]:
            print("   ", line)
        failed |= mismatches != 0 or layers != args.layers
        backend_device = f"1x {device} ({n} virtual ranks)" if args.mode == "virtual" else f"{n}x {device}"
        _csv_rows(args.csv, [
            (date, backend_device, args.commit, "kernel-harness", n, system.max_tokens, "layers", layers),
            (date, backend_device, args.commit, "kernel-harness", n, system.max_tokens, "mismatches", mismatches),
        ])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
