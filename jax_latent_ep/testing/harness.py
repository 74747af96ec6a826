"""JAX-free harness of the EP kernels on `cuda.bindings.driver`: loads the AOT cubins (manifest), allocates and
arms one symmetric buffer per rank, runs N ranks concurrently and checks every layer against numpy.

Modes (`python -m jax_latent_ep.testing.harness --help`):
  virtual   N ranks on ONE GPU: all buffers on one device, one stream per rank.
  devices   N ranks on N GPUs of one process (peer access), one stream per GPU.
  latency   kernel-only time of one dispatch + combine per layer at T in {1, 5, 32, 128}, N = 2 on 2 GPUs:
            CUDA graphs of `--graph-layers` layers per GPU (programmatic stream serialization), CUDA events
            around each replay, median over the replays of (elapsed / layers).
  timeout   rank 0 alone of N = 2 (rank 1 never launches): the dispatch must trap and fill the host status
            record {code, rank, peer, layer} (run last: the trap kills the context).

Each checked layer uses fresh random BF16 tokens, fresh routing and a random T <= max_tokens per rank; the
expert stage runs on the host (numpy) from the received rows; receive rows (x, sf of valid rows; ids,
weights, src of all rows) and the routed latent must be bit-exact, the normed output within 1 BF16 ulp.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import pathlib
import sys
import time

import ml_dtypes
import numpy as np

from jax_latent_ep.config import DEEPSEEK_V3, KIMI_K3
from jax_latent_ep.layout import CTRL_ERROR, EpLayout
from jax_latent_ep.testing import model

DEFAULT_ARTIFACTS = pathlib.Path(__file__).resolve().parent.parent / "_artifacts"
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
            raise FileNotFoundError(f"{path} is missing: run python -m jax_latent_ep.build")
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


class DeviceView(DeviceArray):
    """A window `[ptr, ptr + nbytes)` of another allocation (no memory of its own)."""

    def __init__(self, ptr, nbytes):
        self.ptr, self.nbytes = int(ptr), int(nbytes)


class Rank:
    """One rank: its context, stream, symmetric buffer, peer table, inputs and outputs."""

    def __init__(self, rank, ctx, layout: EpLayout, kernels):
        cu = _cu()
        self.rank, self.ctx, self.layout = rank, ctx, layout
        check(cu.cuCtxSetCurrent(ctx))
        self.stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
        self.dispatch, self.combine = kernels
        shape, n, tmax = layout.shape, layout.ranks, layout.tokens
        rows, latent, topk = layout.rows, shape.latent, shape.topk
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
        check(cu.cuMemsetD8(self.buffer.ptr, 0, lay.peers))
        check(cu.cuCtxSynchronize())

    def ctrl_words(self):
        cu = _cu()
        check(cu.cuCtxSetCurrent(self.ctx))
        out = np.empty(8, np.int32)
        check(cu.cuMemcpyDtoH(out.ctypes.data, self.buffer.ptr + self.layout.ctrl, 32))
        return out


def _grid(tokens, rows, cap):
    return max(tokens, min(rows, cap))


class System:
    """N ranks on one GPU (virtual) or on N GPUs, with their kernels loaded."""

    def __init__(self, shape_name, ranks, max_tokens, mode, artifacts=DEFAULT_ARTIFACTS, arch="sm_90a"):
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
        self.layout = EpLayout(ranks, max_tokens, self.shape)
        self.ranks = [Rank(r, self.ctxs[ordinals[r]], self.layout, kernels[ordinals[r]]) for r in range(ranks)]
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

    def launch_dispatch(self, r: Rank, tokens, timeout_ns=None):
        check(self.cu.cuCtxSetCurrent(r.ctx))
        grid = _grid(tokens, self.layout.rows, self.cap)
        r.dispatch.launch(
            r.stream, grid, x=r.x.ptr, ids=r.ids.ptr, weights=r.weights.ptr, peers=r.peers.ptr,
            recv_x=r.recv_x.ptr, recv_sf=r.recv_sf.ptr, recv_ids=r.recv_ids.ptr, recv_weights=r.recv_weights.ptr,
            recv_src=r.recv_src.ptr, status=self.status, timeout_ns=self.timeout_ns if timeout_ns is None else timeout_ns,
            rank=r.rank, tokens=tokens, max_tokens=self.max_tokens,
        )

    def launch_combine(self, r: Rank, tokens, apply_norm, eps=1e-6):
        check(self.cu.cuCtxSetCurrent(r.ctx))
        grid = _grid(tokens, self.layout.rows, self.cap)
        r.combine.launch(
            r.stream, grid, out=r.out.ptr, ids=r.ids.ptr, norm_weight=r.norm.ptr, result=r.result.ptr,
            peers=r.peers.ptr, status=self.status, timeout_ns=self.timeout_ns, eps=eps, rank=r.rank,
            tokens=tokens, max_tokens=self.max_tokens, apply_norm=apply_norm,
        )


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


def run_layers(system: System, layers, seed=0, nonfinite_every=0, log_every=100, check_every=1):
    """Runs `layers` consecutive dispatch + combine layers; returns (layers, mismatches, details)."""
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
            check(system.cu.cuCtxSetCurrent(r.ctx))
            r.x.upload(x)
            r.ids.upload(ids)
            r.weights.upload(weights)
            state.append((tokens, x, ids, weights))
        for r in system.ranks:
            system.launch_dispatch(r, state[r.rank][0])
        system.sync()
        # Expected receive rows.
        quant = [mxfp8_reference(s[1]) for s in state]
        dests = [(s[2] // local) for s in state]  # [T, K] destination rank of each expert
        received = []
        for d, r in enumerate(system.ranks):
            check(system.cu.cuCtxSetCurrent(r.ctx))
            got_x = r.recv_x.download(np.uint8, (lay.rows, latent))
            got_sf = r.recv_sf.download(np.uint8, (lay.rows, nsf))
            got_ids = r.recv_ids.download(np.int32, (lay.rows, topk))
            got_w = r.recv_weights.download(np.uint32, (lay.rows, topk))
            got_src = r.recv_src.download(np.int32, (lay.rows,))
            exp_ids = np.full((lay.rows, topk), lay.invalid_expert(d), np.int32)
            exp_w = np.zeros((lay.rows, topk), np.uint32)
            exp_src = np.full((lay.rows,), -1, np.int32)
            valid = np.zeros(lay.rows, bool)
            exp_x = np.zeros((lay.rows, latent), np.uint8)
            exp_sf = np.zeros((lay.rows, nsf), np.uint8)
            for s, (tokens, x, ids, weights) in enumerate(state):
                hit = (dests[s] == d).any(axis=1)
                t = np.nonzero(hit)[0]
                rows = s * S + t
                valid[rows] = True
                exp_ids[rows] = ids[t]
                exp_w[rows] = weights[t].view(np.uint32)
                exp_src[rows] = (s << 16) | t
                exp_x[rows] = quant[s][0][t]
                exp_sf[rows] = quant[s][1][t]
            bad = 0
            bad += int((got_ids != exp_ids).sum())
            bad += int((got_w != exp_w).sum())
            bad += int((got_src != exp_src).sum())
            gx, ex = got_x[valid], exp_x[valid]
            nan_both = ((gx & 0x7F) == 0x7F) & ((ex & 0x7F) == 0x7F)
            bad += int(((gx != ex) & ~nan_both).sum())
            bad += int((got_sf[valid] != exp_sf[valid]).sum())
            if bad:
                details.append(f"layer {layer} rank {d}: {bad} receive mismatches")
            mismatches += bad
            received.append((got_x, got_sf, got_ids, got_w.view(np.float32), got_src, valid))
        # Expert stage on the host: out = bf16(dequant(row) * sum of the row's local weights); garbage elsewhere.
        outs = []
        for d, r in enumerate(system.ranks):
            got_x, got_sf, got_ids, got_w, got_src, valid = received[d]
            wsum = np.where(got_ids // local == d, got_w, np.float32(0)).sum(axis=1, dtype=np.float32)
            with np.errstate(invalid="ignore", over="ignore"):
                out = (dequant(got_x, got_sf) * wsum[:, None]).astype(BF16)
            out[~valid] = BF16(np.nan) if layer % 2 else BF16(1e30)
            outs.append(out)
            check(system.cu.cuCtxSetCurrent(r.ctx))
            r.out.upload(out)
        for r in system.ranks:
            system.launch_combine(r, state[r.rank][0], apply_norm)
        system.sync()
        for s, r in enumerate(system.ranks):
            tokens, x, ids, weights = state[s]
            check(system.cu.cuCtxSetCurrent(r.ctx))
            got = r.result.download(np.uint16, (tokens, latent))
            acc = np.zeros((tokens, latent), np.float32)
            for d in range(n):
                sel = (dests[s] == d).any(axis=1)
                with np.errstate(invalid="ignore", over="ignore"):
                    acc = np.where(sel[:, None], acc + outs[d][s * S : s * S + tokens].astype(np.float32), acc)
            routed = acc.astype(BF16)
            if apply_norm:
                v = routed.astype(np.float32)
                with np.errstate(invalid="ignore", over="ignore"):
                    ss = (v.astype(np.float64) ** 2).sum(axis=1).astype(np.float32)
                    rstd = (1.0 / np.sqrt(np.float64(ss / np.float32(latent) + np.float32(1e-6)))).astype(np.float32)
                    y = ((v * rstd[:, None]).astype(np.float32) * norm.astype(np.float32)).astype(np.float32)
                dist = ulp_distance_bf16(got, bf16_bits(y))
                bad = int((dist > 1).sum())
                ulp1 += int((dist == 1).sum())
            else:
                dist = ulp_distance_bf16(got, routed.view(np.uint16))
                bad = int((dist != 0).sum())
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


def _graph_time(system: System, body, graph_layers, replays):
    """Median over `replays` graph replays of (elapsed / graph_layers) in us, the max over the ranks' GPUs;
    `body(rank)` launches one layer's kernels of a rank."""
    cu = system.cu
    graphs, events = [], []
    for r in system.ranks:
        check(cu.cuCtxSetCurrent(r.ctx))
        check(cu.cuStreamBeginCapture(r.stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        for _ in range(graph_layers):
            body(r)
        graph = check(cu.cuStreamEndCapture(r.stream))
        graphs.append(check(cu.cuGraphInstantiate(graph, 0)))
        events.append((check(cu.cuEventCreate(0)), check(cu.cuEventCreate(0))))
    samples = []
    for it in range(replays + 2):
        for r, g, (start, stop) in zip(system.ranks, graphs, events):
            check(cu.cuCtxSetCurrent(r.ctx))
            check(cu.cuEventRecord(start, r.stream))
            check(cu.cuGraphLaunch(g, r.stream))
            check(cu.cuEventRecord(stop, r.stream))
        system.sync()
        if it >= 2:  # warm-up replays
            per = []
            for r, (start, stop) in zip(system.ranks, events):
                check(cu.cuCtxSetCurrent(r.ctx))
                per.append(check(cu.cuEventElapsedTime(start, stop)) * 1000.0 / graph_layers)
            samples.append(max(per))
    return float(np.median(samples)), float(min(samples))


def latency(system: System, token_counts=(1, 5, 32, 128), graph_layers=50, replays=30, apply_norm=1):
    """Median kernel-only microseconds per T of one dispatch + combine layer (`layer`): CUDA graphs of
    `graph_layers` layers per GPU, events around each replay. (A dispatch alone repeated is refused by the
    kernels' sequence guard, so only whole layers are timed.)"""
    cu = system.cu
    rng = np.random.default_rng(1)
    shape = system.shape
    results = {}
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
            system.launch_dispatch(r, tokens)
            system.launch_combine(r, tokens, apply_norm)

        row = {"layer": _graph_time(system, layer, graph_layers, replays)}
        text = ""
        results[tokens] = row
        print(f"  T={tokens}: {row['layer'][0]:.2f} us per dispatch + combine (median of {replays}, min "
              f"{row['layer'][1]:.2f}){text}", flush=True)
    return results


# ---------------------------------------------------------------------------------------------------------
# Timeout


def timeout_test(artifacts=DEFAULT_ARTIFACTS, shape_name="kimi_k3"):
    """Rank 0 of N = 2 dispatches alone with a 2 ms timeout: it must trap and report {1, 0, 1, 0}."""
    system = System(shape_name, 2, 8, "virtual", artifacts)
    cu = system.cu
    host = check(cu.cuMemHostAlloc(16, cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE))
    status_host = (ctypes.c_int32 * 4).from_address(int(host))
    for i in range(4):
        status_host[i] = 0
    system.status = int(check(cu.cuMemHostGetDevicePointer(host, 0)))
    r = system.ranks[0]
    rng = np.random.default_rng(0)
    r.x.upload(make_tokens(rng, 4, system.shape, False))
    ids, weights = make_routing(rng, 4, system.shape)
    r.ids.upload(ids)
    r.weights.upload(weights)
    started = time.perf_counter()
    system.launch_dispatch(r, 4, timeout_ns=2_000_000)
    err = cu.cuStreamSynchronize(r.stream)[0]
    elapsed = time.perf_counter() - started
    record = [status_host[i] for i in range(4)]
    print(f"  timeout: stream sync -> {err!r} after {elapsed * 1e3:.1f} ms, status record {record}", flush=True)
    ok = err != cu.CUresult.CUDA_SUCCESS and record == [1, 0, 1, 0]
    return ok, record, str(err)


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


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m jax_latent_ep.testing.harness", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("virtual", "devices", "latency", "timeout"), default="virtual")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="kimi_k3")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2])
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--timeout-ns", type=int, default=10_000_000_000, help="flag-wait bound (0: forever)")
    parser.add_argument("--nonfinite-every", type=int, default=50, help="every k-th layer has NaN/Inf blocks")
    parser.add_argument("--artifacts", default=str(DEFAULT_ARTIFACTS))
    parser.add_argument("--csv", default=None, help="append figures to this CSV")
    parser.add_argument("--commit", default=os.environ.get("COMMIT", "unknown"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    date = time.strftime("%Y-%m-%d", time.gmtime())
    failed = False
    if args.mode == "timeout":
        ok, record, err = timeout_test(args.artifacts, args.shape)
        print("TIMEOUT TEST", "PASS" if ok else "FAIL")
        return 0 if ok else 1
    device = _device_name()
    for n in args.ranks:
        if args.mode == "latency":
            system = System(args.shape, n, args.max_tokens, "devices", args.artifacts)
            system.timeout_ns = args.timeout_ns
            print(f"latency {args.shape} N={n} on {n} GPUs", flush=True)
            res = latency(system)
            backend_device = f"{n}x {device}"
            rows = []
            for t, row in res.items():
                rows.append((date, backend_device, args.commit, "kernel-harness", n, t, "kernel_us_median", f"{row['layer'][0]:.2f}"))
                for part in ("dispatch", "combine"):
                    if part in row:
                        rows.append((date, backend_device, args.commit, "kernel-harness", n, t, f"{part}_us_median", f"{row[part][0]:.2f}"))
            _csv_rows(args.csv, rows)
            continue
        system = System(args.shape, n, args.max_tokens, args.mode, args.artifacts)
        system.timeout_ns = args.timeout_ns
        where = "1 GPU (virtual ranks)" if args.mode == "virtual" else f"{n} GPUs"
        print(f"{args.mode}: {args.shape} N={n} on {where}, max_tokens {system.max_tokens}, {args.layers} layers", flush=True)
        started = time.perf_counter()
        layers, mismatches, info = run_layers(system, args.layers, seed=args.seed + n, nonfinite_every=args.nonfinite_every)
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
