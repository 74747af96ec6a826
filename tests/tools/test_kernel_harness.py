"""CPU checks of the kernel harness' host side (`tools.kernel_harness`), above all `--mode stress`.

No GPU: a fake `cuda.bindings.driver` keeps "device" memory in host arrays (device pointers are host
addresses) and a lockstep emulator plays the kernels' contract (its own NumPy code from `testing/model.py`) when
a stream is synchronized. That checks the harness' plumbing (input sets, pointer overrides, output slots,
batches, expectations, comparisons, CLI, CSV) and that injected faults are caught; not the kernels."""

from __future__ import annotations

import ctypes
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from jax_latent_ep.kernels import abi
from jax_latent_ep.layout import CTRL_EPOCH_C, CTRL_EPOCH_D, EpLayout
from jax_latent_ep.testing import model
from tools import kernel_harness as harness
from tools.kernel_harness import cli, runtime

ROOT = pathlib.Path(__file__).resolve().parents[2]
BF16 = harness.BF16
SYSTEM = harness.System  # the class (test_stress_cli replaces cli.System by a factory)
DISPATCH_PARAMS = ("x", "ids", "weights", "peers", "recv_x", "recv_sf", "recv_ids", "recv_weights", "recv_src",
                   "status", "timeout_ns", "rank", "tokens", "peer_tokens", "max_tokens")
COMBINE_PARAMS = ("out", "ids", "norm_weight", "result", "peers", "status", "timeout_ns", "eps", "rank", "tokens",
                  "peer_tokens", "max_tokens", "apply_norm")


def _view(ptr, dtype, shape):
    """A writable NumPy view of fake device memory at `ptr`."""
    count = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * count).from_address(int(ptr)))
    return raw.view(dtype).reshape(shape)


class Emulator:
    """Plays every rank's queued kernels in lockstep (op i of every stream together) by the contract."""

    def __init__(self, layout: EpLayout):
        self.layout = layout
        self.queues = {}
        self.layers = 0  # dispatches played
        self.mirror = {}
        self.on_dispatch = None  # callback(layer, rank, args): may corrupt the receive outputs
        self.on_combine = None  # callback(layer, rank, args): may corrupt the result
        self.fail_at_layer = None  # a sync that would play this layer reports a CUDA error instead
        self.grids = []  # (kind, grid, tokens) of every launch

    def drain(self):
        while any(self.queues.values()):
            ops = [q.pop(0) for q in self.queues.values()]
            kinds = {kind for kind, _ in ops}
            assert len(kinds) == 1 and len(ops) == self.layout.ranks, [k for k, _ in ops]
            args = {a["rank"]: a for _, a in ops}
            # The kernels' precondition: every rank of a call passes the same peer_tokens, the largest T.
            assert {a["peer_tokens"] for a in args.values()} == {max(a["tokens"] for a in args.values())}
            if kinds == {"dispatch"}:
                self.dispatch(args)
            else:
                self.combine(args)

    def _ctrl(self, a):
        base = a["peers"] - self.layout.peers
        return _view(base + self.layout.ctrl, np.uint32, (8,))

    def dispatch(self, args):
        lay = self.layout
        shape, n, S = lay.shape, lay.ranks, lay.stride
        local = shape.num_local_experts(n)
        sources = []
        for s in range(n):
            a = args[s]
            assert a["max_tokens"] == lay.tokens and 1 <= a["tokens"] <= lay.tokens
            t = a["tokens"]
            x = _view(a["x"], BF16, (t, shape.latent))
            ids = _view(a["ids"], np.int32, (t, shape.topk)).copy()
            weights = _view(a["weights"], np.uint32, (t, shape.topk)).copy()
            q, sf = model.mxfp8_quantize(x)
            q_bytes = q.view(np.uint8).copy()
            q_bytes[np.isnan(q.astype(np.float32))] = 0x7F  # the canonical NaN of cvt.satfinite
            sources.append((t, q_bytes, sf, ids, weights, model.destinations(ids, shape, n)))
            ctrl = self._ctrl(a)
            assert ctrl[CTRL_EPOCH_C] == ctrl[CTRL_EPOCH_D], "dispatch twice"
            ctrl[CTRL_EPOCH_C] = ctrl[CTRL_EPOCH_D] + 1
        for d in range(n):
            a = args[d]
            rx = _view(a["recv_x"], np.uint8, (lay.rows, shape.latent))
            rsf = _view(a["recv_sf"], np.uint8, (lay.rows, shape.num_sf))
            rids = _view(a["recv_ids"], np.int32, (lay.rows, shape.topk))
            rw = _view(a["recv_weights"], np.uint32, (lay.rows, shape.topk))
            rsrc = _view(a["recv_src"], np.int32, (lay.rows,))
            for s, (t_count, q, sf, ids, weights, member) in enumerate(sources):
                for t in range(S):
                    row = s * S + t
                    if t < t_count and member[t, d]:
                        rx[row], rsf[row], rids[row], rw[row] = q[t], sf[t], ids[t], weights[t]
                        rsrc[row] = (s << 16) | t
                    else:  # x / sf are left as they were (unspecified)
                        rids[row], rw[row], rsrc[row] = ((d + 1) % n) * local, 0, -1
            self.mirror[d] = rsrc.copy()
            if self.on_dispatch:
                self.on_dispatch(self.layers, d, a)
        self.layers += 1

    def combine(self, args):
        lay = self.layout
        shape, n, S = lay.shape, lay.ranks, lay.stride
        outs = [_view(args[d]["out"], BF16, (lay.rows, shape.latent)).copy() for d in range(n)]
        for s in range(n):
            a = args[s]
            t_count = a["tokens"]
            ids = _view(a["ids"], np.int32, (t_count, shape.topk))
            member = model.destinations(ids, shape, n)
            routed = np.zeros((t_count, shape.latent), np.float32)
            for t in range(t_count):
                for d in range(n):
                    if member[t, d]:
                        assert self.mirror[d][s * S + t] == (s << 16) | t, "combine routing != dispatch routing"
                        with np.errstate(invalid="ignore", over="ignore"):
                            routed[t] = routed[t] + outs[d][s * S + t].astype(np.float32)
            routed = routed.astype(BF16)
            if a["apply_norm"]:
                norm = _view(a["norm_weight"], BF16, (shape.latent,))
                with np.errstate(invalid="ignore", over="ignore"):
                    routed = model.rms_norm(routed, norm, a["eps"])
            _view(a["result"], BF16, (t_count, shape.latent))[:] = routed
            ctrl = self._ctrl(a)
            assert ctrl[CTRL_EPOCH_C] == ctrl[CTRL_EPOCH_D] + 1, "combine without dispatch"
            ctrl[CTRL_EPOCH_D] = ctrl[CTRL_EPOCH_C]
            if self.on_combine:
                self.on_combine(self.layers - 1, s, a)


class FakeKernel:
    def __init__(self, kind, emulator, names):
        self.kind, self.emulator, self.names = kind, emulator, names

    def launch(self, stream, grid, pdl=True, **args):
        assert set(args) == set(self.names), sorted(set(args) ^ set(self.names))
        assert 1 <= grid  # below T too: a CTA takes the tokens c, c + G, ...
        self.emulator.grids.append((self.kind, grid, args["tokens"]))
        for name in self.names:
            if name not in ("eps",):
                assert isinstance(args[name], int), (name, type(args[name]))
        self.emulator.queues[stream].append((self.kind, dict(args)))


class FakeDriver:
    """The few `cuda.bindings.driver` calls the harness makes, on host memory."""

    class CUresult:
        CUDA_SUCCESS = 0
        CUDA_ERROR_LAUNCH_FAILED = 719

    class CUstream_flags:
        CU_STREAM_NON_BLOCKING = 1

    CU_MEMHOSTALLOC_PORTABLE = 1
    CU_MEMHOSTALLOC_DEVICEMAP = 2

    def __init__(self):
        self.memory = []
        self.emulator = None

    def cuGetErrorName(self, err):
        return 0, b"CUDA_ERROR_FAKE"

    def cuCtxSetCurrent(self, ctx):
        return (0,)

    def cuCtxSynchronize(self):
        return (0,)

    def cuStreamCreate(self, flags):
        stream = len(self.emulator.queues) + 1
        self.emulator.queues[stream] = []
        return 0, stream

    def cuStreamSynchronize(self, stream):
        em = self.emulator
        if em.fail_at_layer is not None and em.layers + len(em.queues[stream]) // 2 > em.fail_at_layer:
            return (self.CUresult.CUDA_ERROR_LAUNCH_FAILED,)
        em.drain()
        return (0,)

    def cuMemAlloc(self, nbytes):
        block = np.full(int(nbytes) + 256, 0xA5, np.uint8)  # garbage, as fresh device memory may hold
        self.memory.append(block)
        return 0, (block.ctypes.data + 255) // 256 * 256

    def cuMemHostAlloc(self, nbytes, flags):
        return self.cuMemAlloc(nbytes)

    def cuMemHostGetDevicePointer(self, host, flags):
        return 0, int(host)

    def cuMemsetD8(self, ptr, value, nbytes):
        ctypes.memset(int(ptr), value, int(nbytes))
        return (0,)

    def cuMemcpyHtoD(self, dst, src, nbytes):
        ctypes.memmove(int(dst), int(src), int(nbytes))
        return (0,)

    def cuMemcpyDtoH(self, dst, src, nbytes):
        ctypes.memmove(int(dst), int(src), int(nbytes))
        return (0,)


def fake_system(monkeypatch, ranks=2, max_tokens=16, shape_name="kimi_k3"):
    """A `harness.System` on the fake driver (virtual ranks, every kernel played by an `Emulator`)."""
    driver = FakeDriver()
    monkeypatch.setattr(runtime, "_cu", lambda: driver)
    shape = harness.SHAPES[shape_name]
    layout = EpLayout(ranks, max_tokens, shape)
    driver.emulator = Emulator(layout)
    system = object.__new__(SYSTEM)
    system.cu, system.shape_name, system.shape, system.n, system.mode = driver, shape_name, shape, ranks, "virtual"
    system.ctxs, system.cap, system.max_tokens, system.layout = {0: "ctx"}, 1024, max_tokens, layout
    system.grid_cap = system.cap
    kernels = (FakeKernel("dispatch", driver.emulator, DISPATCH_PARAMS),
               FakeKernel("combine", driver.emulator, COMBINE_PARAMS))
    system.ranks = [harness.Rank(r, "ctx", layout, kernels) for r in range(ranks)]
    for r in system.ranks:
        r.peers.upload(np.array([p.buffer.ptr for p in system.ranks] + [r.buffer.ptr], np.int64))
    system.status, system.timeout_ns = 0, 10_000_000_000
    return system


# ---------------------------------------------------------------------------------------------------------


def test_help_and_import_need_no_gpu():
    result = subprocess.run([sys.executable, "-m", "tools.kernel_harness", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "stress" in result.stdout and "--stress-virtual" in result.stdout


def test_kernel_params_match_the_kernels():
    pytest.importorskip("cutlass")
    from jax_latent_ep.kernels import combine, common, dispatch
    from jax_latent_ep.shapes import KIMI_K3

    # The kernels' launch signatures are the ABI's (the check their compile runs), and these lists are the ABI's.
    common.check_abi(abi.DISPATCH, dispatch.Dispatch(KIMI_K3, 2))
    common.check_abi(abi.COMBINE, combine.Combine(KIMI_K3, 2))
    assert abi.DISPATCH.names() == DISPATCH_PARAMS
    assert abi.COMBINE.names() == COMBINE_PARAMS


def test_harness_params_are_the_abi():
    # The harness launches with the ABI's parameter lists (kernels/abi.py, in order), not a copy of its own; the
    # fake kernels below use the same lists, so a parameter added to the ABI reaches every launch.
    assert harness.DISPATCH_PARAMS == abi.DISPATCH.names() == DISPATCH_PARAMS
    assert harness.COMBINE_PARAMS == abi.COMBINE.names() == COMBINE_PARAMS
    assert harness.buffer_params(abi.DISPATCH) == ("x", "ids", "weights", "recv_x", "recv_sf", "recv_ids",
                                                   "recv_weights", "recv_src")
    assert harness.buffer_params(abi.COMBINE) == ("out", "ids", "norm_weight", "result")


def test_kernel_refuses_a_manifest_of_another_abi(tmp_path):
    entry = {"kernel": "dispatch", "file": "x.cubin", "name": "ep_dispatch",
             "params": [list(p) for p in abi.DISPATCH.signature()][:-1]}
    with pytest.raises(ValueError, match="differ from kernels/abi.py"):
        harness.Kernel(harness.Manifest.__new__(harness.Manifest), entry)


def test_grid_rule_is_the_ffi_rule_with_the_harness_cap():
    # The harness caps its grids at its residency bound instead of the FFI's 256 CTAs and co-residency bound (the
    # only difference, with peer_tokens for the ranks' own T): with both at 256 and peer_tokens = T both give the
    # same grids, below T from T = 257 on.
    nvlink = pytest.importorskip("jax_latent_ep.backends.nvlink")
    assert nvlink.DISPATCH_MIN_CTAS == nvlink.COMBINE_MIN_CTAS == 256
    for ranks in (1, 2, 4, 8):
        for tokens in (1, 2, 7, 8, 33, 128, 255, 256, 300, 1000, 8192):
            want = nvlink.default_grids(tokens, ranks, (256, 256))
            assert (harness.launch_grid(tokens, tokens, ranks, 256),) * 2 == want, (ranks, tokens)
            if tokens <= 256:
                assert want == nvlink.default_grids(tokens, ranks)  # the bound changes nothing up to 256
    assert harness.launch_grid(1000, 1000, 2, 33) == 33


def test_import_needs_no_jax():
    code = "import sys, tools.kernel_harness; assert 'jax' not in sys.modules, sorted(sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr


def test_schedule():
    rng = np.random.default_rng(3)
    s = harness.stress_schedule(rng, 20_000, 2, 64, 16, delay_prob=0.5, max_delay_us=200)
    assert s.tokens.min() == 1 and s.tokens.max() == 16 and len(np.unique(s.tokens)) == 16
    assert set(np.unique(s.combo)) == set(range(64)) and set(np.unique(s.apply_norm)) == {0, 1}
    delayed = s.delayed >= 0
    assert 0.45 < delayed.mean() < 0.55
    assert (s.order[delayed, -1] == s.delayed[delayed]).all()  # the delayed rank launches last
    assert (np.sort(s.order, axis=1) == np.arange(2)).all()
    assert s.delay_ns[delayed].max() <= 200_000 and (s.delay_ns[~delayed] == 0).all()
    assert set(np.unique(s.delay_combine[delayed])) == {0, 1}
    assert ((s.order[:, 0] == 1) & ~delayed).any()  # undelayed layers launch in both orders
    none = harness.stress_schedule(rng, 100, 2, 4, 8, delay_prob=0.5, max_delay_us=0)
    assert (none.delayed == -1).all()


def test_pool_expectations_match_run_layers_model():
    """A pool's cut-down blocks equal expected_receive / expected_result of the layer's actual inputs."""
    shape, lay = harness.SHAPES["kimi_k3"], EpLayout(2, 16, harness.SHAPES["kimi_k3"])
    rng = np.random.default_rng(0)
    norm = (1.0 + 0.25 * rng.standard_normal(shape.latent)).astype(BF16)
    pool = harness.StressPool(rng, shape, lay, 4, norm)
    assert pool.combos.shape == (16, 2)
    assert pool.hit.any(axis=-1).all() and not pool.hit[:, :, 1].all()  # odd sets route some tokens to one rank
    local = shape.num_local_experts(2)
    for combo, tokens, apply_norm in ((5, (3, 16), 1), (14, (16, 1), 0), (0, (7, 7), 1)):
        sets = pool.combos[combo]
        state = [(t, pool.x[s, p, :t], pool.ids[s, p, :t], pool.weights[s, p, :t])
                 for s, (p, t) in enumerate(zip(sets, tokens))]
        quant = [harness.mxfp8_bytes(x) for _, x, _, _ in state]
        outs = pool.combo_outs(0), pool.combo_outs(1)
        for d in range(2):
            exp, valid = harness.expected_receive(lay, d, state, quant)
            got, got_valid = pool.receive(d, np.array([combo]), np.array([tokens]))
            assert (got_valid[0] == valid).all()
            for a, b in zip(got, exp):
                if a.ndim == 3:  # x, sf: only valid rows are specified
                    assert (a[0][valid] == b[valid]).all()
                else:
                    assert (a[0] == b).all()
            assert int(harness.receive_mismatches(got, Rows1(exp), valid[None])[0]) == 0
            # the device's expert outputs of the combo = the host expert stage of these rows (valid rows)
            ref = harness.host_expert(exp, valid, d, local, BF16(0))
            assert (outs[d][combo][valid].view(np.uint16) == ref[valid].view(np.uint16)).all()
        for s in range(2):
            exp = harness.expected_result([o[combo] for o in outs], state[s][2] // local, s, lay.stride, tokens[s],
                                          norm, apply_norm)
            got, rows = pool.combined(s, np.array([combo]), np.array([apply_norm]), np.array([tokens[s]]))
            assert rows[0].sum() == tokens[s]
            assert (got[0][: tokens[s]] == exp).all()


def Rows1(rows):
    """Rows with a leading batch axis of 1."""
    return harness.Rows(*(a[None] for a in rows))


def test_compare_rules():
    rng = np.random.default_rng(1)
    got = rng.integers(0, 1 << 16, size=(3, 2, 4, 64), dtype=np.uint16)
    got[(got & 0x7FFF) > 0x7F80] = 0x3F80  # no NaN in the random part
    exp = got.copy()
    exp[0, 0, 1, 5] += 1  # 1 ulp: ok where normed
    exp[1, 1, 2, 7] ^= 0x0100  # far off
    exp[2, 0, 3, 0] += 1  # a row outside T
    got[2, 1, 0, 9], exp[2, 1, 0, 9] = 0x7FC0, 0xFFC1  # NaN == NaN
    normed = np.array([1, 0, 1])[:, None]
    rows = np.ones((3, 2, 4), bool)
    rows[2, 0, 3] = False
    bad, ulp1 = harness.result_mismatches(got, exp, normed, rows)
    assert bad.tolist() == [[0, 0], [0, 1], [0, 0]] and ulp1.tolist() == [[1, 0], [0, 0], [0, 0]]
    bad, _ = harness.result_mismatches(got, exp, 0, None)
    assert bad.tolist() == [[1, 0], [0, 1], [1, 0]]
    # unbatched, as run_layers calls it
    assert [int(v) for v in harness.result_mismatches(got[0, 0], exp[0, 0], 1)] == [0, 1]


@pytest.mark.parametrize("ranks,max_tokens,pool,cap", [(2, 16, 8, 1024), (4, 8, 4, 1024), (2, 16, 8, 3)])
def test_stress_emulated_clean(monkeypatch, capsys, ranks, max_tokens, pool, cap):
    system = fake_system(monkeypatch, ranks=ranks, max_tokens=max_tokens)
    system.grid_cap = cap
    layers, mismatches, info = harness.stress(system, 150, seed=5, pool_size=pool, batch=32, max_delay_us=5,
                                              log_every=64)
    assert (layers, mismatches) == (150, 0), info["details"]
    assert info["error"] is None and 40 < info["delayed"] < 110
    assert [w[CTRL_EPOCH_D] for w in info["ctrl"]] == [150] * ranks
    assert info["combos"] == (64 if ranks == 2 else 4)
    assert "layer 128/150" in capsys.readouterr().out
    grids = system.cu.emulator.grids
    assert {kind for kind, _, _ in grids} == {"dispatch", "combine"} and max(g for _, g, _ in grids) <= cap
    # A cap below max_tokens launches grids below T (the kernels loop over their tokens); a wide one never does.
    assert any(g < t for _, g, t in grids) == (cap < max_tokens)


def test_run_layers_emulated(monkeypatch):
    system = fake_system(monkeypatch, ranks=2, max_tokens=16)
    layers, mismatches, info = harness.run_layers(system, 12, seed=2, nonfinite_every=4, log_every=0)
    assert (layers, mismatches) == (12, 0), info["details"]


def _corrupt_x(layer_at, rank_at, applied, empty=False):
    """A dispatch hook flipping one x byte of a valid (or, with `empty`, an empty) receive row."""
    def hook(layer, d, args):
        if (layer, d) != (layer_at, rank_at):
            return
        shape, rows = harness.SHAPES["kimi_k3"], 2 * 16
        src = _view(args["recv_src"], np.int32, (rows,))
        row = int(np.nonzero((src == -1) if empty else (src != -1))[0][0])
        _view(args["recv_x"] + row * shape.latent, np.uint8, (shape.latent,))[100] ^= 0x01
        applied.append(row)
    return hook


@pytest.mark.parametrize("where", ["receive", "empty", "result"])
def test_stress_emulated_catches_faults(monkeypatch, where):
    system = fake_system(monkeypatch, ranks=2, max_tokens=16)
    em = system.cu.emulator
    if where == "result":
        def hook(layer, s, args):
            if (layer, s) == (70, 0):
                _view(args["result"], np.uint16, (1,))[0] ^= 0x0004  # 4 ulps off, routed or normed
        em.on_combine = hook
    applied = []
    if where != "result":
        em.on_dispatch = _corrupt_x(70, 1, applied, empty=where == "empty")
    layers, mismatches, info = harness.stress(system, 100, seed=11, pool_size=4, batch=32, max_delay_us=0,
                                              log_every=0)
    assert where == "result" or len(applied) == 1
    if where == "empty":
        assert mismatches == 0, info["details"]
    else:
        assert mismatches == 1 and len(info["details"]) == 1, info["details"]
        rank = 1 if where == "receive" else 0
        kind = "1 receive, 0 combine" if where == "receive" else "0 receive, 1 combine"
        assert info["details"][0].startswith(f"layer 70 rank {rank}: {kind} mismatches"), info["details"]


def test_stress_emulated_cuda_error(monkeypatch):
    system = fake_system(monkeypatch, ranks=2, max_tokens=16)
    system.cu.emulator.fail_at_layer = 40
    layers, mismatches, info = harness.stress(system, 100, seed=1, pool_size=4, batch=32, log_every=0)
    assert layers == 32 and info["error"].startswith("in the batch of layers 32..63")
    assert info["status"] == [0, 0, 0, 0]


def test_stress_cli(monkeypatch, tmp_path, capsys):
    made = {}

    def system(shape_name, ranks, max_tokens, mode, artifacts):
        made["mode"] = mode
        return fake_system(monkeypatch, ranks=ranks, max_tokens=max_tokens, shape_name=shape_name)

    monkeypatch.setattr(cli, "System", system)
    monkeypatch.setattr(cli, "device_name", lambda: "NVIDIA H200")
    csv = tmp_path / "stress.csv"
    argv = ["--mode", "stress", "--ranks", "2", "--layers", "100", "--max-tokens", "16", "--csv", str(csv),
            "--commit", "abc123", "--stress-batch", "16", "--stress-pool", "4", "--stress-delay-us", "3"]
    assert harness.main(argv) == 0
    out = capsys.readouterr().out
    assert made["mode"] == "devices"
    last = [line for line in out.splitlines() if line.startswith("stress: 100 layers")]
    assert last and last[0].startswith("stress: 100 layers, 0 mismatches, ") and "delayed launches" in last[0], out
    lines = csv.read_text().splitlines()
    assert lines[0] == "date,device,commit,backend,ranks,tokens,metric,value"
    rows = [line.split(",") for line in lines[1:]]
    assert [r[6] for r in rows] == ["layers", "mismatches", "delayed_layers", "seconds"]
    assert all(r[1:6] == ["2x NVIDIA H200", "abc123", "stress", "2", "16"] for r in rows)
    assert rows[0][7] == "100" and rows[1][7] == "0"
    # a fault: nonzero exit; virtual placement
    monkeypatch.setattr(harness.StressPool, "combined", _off_by_4(harness.StressPool.combined))
    assert harness.main(argv + ["--stress-virtual"]) == 1
    assert made["mode"] == "virtual"


def _off_by_4(combined):
    def wrapper(self, s, combo, apply_norm, tokens):
        exp, rows = combined(self, s, combo, apply_norm, tokens)
        exp = exp.copy()
        exp[0, 0, 0] ^= 0x0004
        return exp, rows
    return wrapper
