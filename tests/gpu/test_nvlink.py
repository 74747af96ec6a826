"""The NVLink backend on GPUs (`@pytest.mark.gpu`, skipped with the reason where there is no NVIDIA GPU): every result of a two-layer case against the XLA backend and the NumPy model, with 1 and 2 GPUs in one process, also with T above the grid (up to 8192 tokens); many layers in one jit with XLA command buffers; the record and traced paths bit for bit alike; one process per GPU; bad input refused before any kernel runs; the kernels' sequence errors reported by `check()`."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from jax_latent_ep.shapes import KIMI_K3

REPO = pathlib.Path(__file__).resolve().parents[2]


from conftest import cuda_devices as _gpus


def _mesh(n):
    return jax.make_mesh((n,), ("ep",), devices=_gpus()[:n])


def _as_stacked(per_rank):
    """run_case's per-rank results -> the model's layout (arrays stacked over ranks)."""
    from jax_latent_ep.testing.model import ModelReceived

    n = len(per_rank)
    recv1 = ModelReceived(*(np.stack([per_rank[r][0][i] for r in range(n)]) for i in range(5)))
    routed = np.stack([per_rank[r][1] for r in range(n)])
    recv2 = ModelReceived(*(np.stack([per_rank[r][2][i] for r in range(n)]) for i in range(5)))
    normed = np.stack([per_rank[r][3] for r in range(n)])
    return recv1, routed, recv2, normed

def _assert_two_layers_match(got, got_again, xla_backend, case, n):
    """Two runs of `case` against the NumPy model (rows and routed bit-exact, normed within 1 ulp) and against
    `xla_backend` on the same GPUs (rows and routed bit-exact; normed within 2 ulp: both may be 1 ulp off the exact
    model, in opposite directions)."""
    from jax_latent_ep.testing import check
    from jax_latent_ep.testing.model import bf16_ulp_diff

    xla = _as_stacked(check.run_case(xla_backend, case))
    model = check.model_two_layers(case)
    for r in range(n):
        check.compare_rank(got[r], model, r)
        check.compare_rank(got_again[r], model, r)
        g_recv1, g_routed, g_recv2, g_normed = got[r]
        check.compare_received(g_recv1, xla[0], r, "layer 1 dispatch vs xla")
        np.testing.assert_array_equal(g_routed.view(np.uint16), xla[1][r].view(np.uint16), err_msg="routed vs xla")
        check.compare_received(g_recv2, xla[2], r, "layer 2 dispatch vs xla")
        assert bf16_ulp_diff(g_normed, xla[3][r]).max() <= 2, "normed vs xla"



@pytest.mark.gpu
@pytest.mark.parametrize("n, tokens, max_tokens, routing", [
    (1, 5, 8, "random_topk"),
    (1, 64, 64, "random_topk"),
    (2, 5, 8, "random_topk"),
    (2, 37, 64, "random_topk"),
    (2, 16, 16, "all_to_one_rank"),
    (2, 1, 1, "random_topk"),
])
def test_two_layers_match_xla_and_model(n, tokens, max_tokens, routing):
    """Two layers of dispatch / combine on the nvlink kernels against the NumPy model and the XLA backend."""
    if len(_gpus()) < n:
        pytest.skip(f"needs {n} GPUs, found {len(_gpus())}")
    from jax_latent_ep.backends.nvlink import NvlinkBackend
    from jax_latent_ep.backends.xla import XlaBackend
    from jax_latent_ep.testing import check

    mesh = _mesh(n)
    case = check.make_case(100 * n + tokens, KIMI_K3, n, tokens, max_tokens, routing)
    with NvlinkBackend(mesh, "ep", max_tokens, KIMI_K3) as nv:
        got = check.run_case(nv, case)
        got_again = check.run_case(nv, case)  # the buffers were re-armed: same results
        assert nv.status() == {(0, r): (0, 0, 0, 0) for r in range(n)}
    _assert_two_layers_match(got, got_again, XlaBackend(mesh, "ep", max_tokens, KIMI_K3), case, n)


@pytest.mark.gpu
@pytest.mark.parametrize("n, tokens, max_tokens, grid", [
    pytest.param(1, 2048, 2048, None, id="n1-T2048-default_grid"),
    pytest.param(1, 8192, 8192, None, id="n1-T8192-default_grid"),
    pytest.param(1, 300, 300, (64, 64), id="n1-T300-grid64"),
    pytest.param(1, 8192, 8192, (1, 1), id="n1-T8192-grid1"),
    pytest.param(2, 2048, 2048, None, id="n2-T2048-default_grid"),
    pytest.param(2, 1000, 1024, (64, 64), id="n2-T1000-grid64"),
])
def test_tokens_beyond_the_grid_match_xla_and_model(n, tokens, max_tokens, grid):
    """T above the dispatch grid (CTA c quantizes and stores the tokens c, c + G, ...): the default grids where T
    exceeds the co-residency bound, and forced small grids. Every received row and the routed latent bit for bit
    against the XLA backend and the NumPy model, as in test_two_layers_match_xla_and_model."""
    if len(_gpus()) < n:
        pytest.skip(f"needs {n} GPUs, found {len(_gpus())}")
    from jax_latent_ep.backends.nvlink import NvlinkBackend
    from jax_latent_ep.backends.xla import XlaBackend
    from jax_latent_ep.testing import check

    mesh = _mesh(n)
    case = check.make_case(1000 * n + tokens, KIMI_K3, n, tokens, max_tokens)
    with NvlinkBackend(mesh, "ep", max_tokens, KIMI_K3, grid=grid) as nv:
        grids = nv.grids(tokens)
        # The case runs the kernels' loop over tokens: both grids below T and within the co-residency bound.
        assert all(g < tokens for g in grids), grids
        assert all(g <= bound for g, bound in zip(grids, nv.max_grids)), (grids, nv.max_grids)
        if grid is None:
            assert grids == nv.max_grids  # T above the bound: the default grids stop at it
        got = check.run_case(nv, case)
        got_again = check.run_case(nv, case)
        assert nv.status() == {(0, r): (0, 0, 0, 0) for r in range(n)}
    _assert_two_layers_match(got, got_again, XlaBackend(mesh, "ep", max_tokens, KIMI_K3), case, n)


@pytest.mark.gpu
def test_two_backends_coexist():
    n = min(2, len(_gpus()))
    from jax_latent_ep.backends.nvlink import NvlinkBackend
    from jax_latent_ep.testing import check

    mesh = _mesh(n)
    a = NvlinkBackend(mesh, "ep", 8, KIMI_K3)
    b = NvlinkBackend(mesh, "ep", 16, KIMI_K3, grid=(20, 3))
    try:
        ca = check.make_case(1, KIMI_K3, n, 7, 8)
        cb = check.make_case(2, KIMI_K3, n, 11, 16)
        ga, gb = check.run_case(a, ca), check.run_case(b, cb)
        wa, wb = check.model_two_layers(ca), check.model_two_layers(cb)
        for r in range(n):
            check.compare_rank(ga[r], wa, r)
            check.compare_rank(gb[r], wb, r)
    finally:
        a.close()
        b.close()
    a.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        a.dispatch(None, None, None)


_LAYERS_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import jax, numpy as np
    from jax_latent_ep.shapes import KIMI_K3
    from jax_latent_ep.backends.nvlink import NvlinkBackend
    from jax_latent_ep.backends.xla import XlaBackend
    from jax_latent_ep.testing import check
    from jax_latent_ep.testing.model import bf16_ulp_diff

    n, tokens, max_tokens, layers = (int(v) for v in sys.argv[1:5])
    mesh = jax.make_mesh((n,), ("ep",), devices=jax.devices()[:n])
    case = check.make_case(7, KIMI_K3, n, tokens, max_tokens)
    make = lambda ep, scan: check.chained_layers(ep, mesh, layers, scan)  # routed: bit-exact layer after layer
    args = check.sharded_inputs(case, mesh, "ep")
    xla = XlaBackend(mesh, "ep", max_tokens, KIMI_K3)
    with NvlinkBackend(mesh, "ep", max_tokens, KIMI_K3) as nv:
        for scan in (False, True):
            want = [np.asarray(a) for a in make(xla, scan)(*args)]
            fn = make(nv, scan)
            for rep in range(3):  # replays of one executable (command buffers: graph launches)
                got = [np.asarray(a) for a in fn(*args)]
                assert np.array_equal(got[0].view(np.uint16), want[0].view(np.uint16)), (scan, rep, "routed")
                assert bf16_ulp_diff(got[1], want[1]).max() <= 2, (scan, rep, "normed")
            jax.block_until_ready(fn(*args))
            t0 = time.perf_counter()
            reps = 20
            for _ in range(reps):
                out = fn(*args)
            jax.block_until_ready(out)
            dt = (time.perf_counter() - t0) / reps / (layers + 1)
            print(f"RESULT n={n} T={tokens} layers={layers + 1} scan={scan} us_per_layer={dt * 1e6:.1f}", flush=True)
        assert all(v == (0, 0, 0, 0) for v in nv.status().values())
    print("OK", flush=True)
    """
)


COMMAND_BUFFER_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"


def _run(script: str, args, env_extra, timeout=300):
    env = dict(os.environ)
    env.update(env_extra)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=str(REPO))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("flags", [COMMAND_BUFFER_FLAGS, ""], ids=["command_buffers", "default"])
def test_many_layers_one_jit(flags):
    n = min(2, len(_gpus()))
    proc = _run(_LAYERS_SCRIPT, [n, 5, 8, 12], {"XLA_FLAGS": flags})
    print(proc.stdout)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]


_PATH_SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, numpy as np
    from jax_latent_ep.runtime import ffi
    from jax_latent_ep.shapes import KIMI_K3
    from jax_latent_ep.backends.nvlink import NvlinkBackend
    from jax_latent_ep.backends.xla import XlaBackend
    from jax_latent_ep.testing import check
    from jax_latent_ep.testing.model import bf16_ulp_diff

    n, tokens, max_tokens, layers = (int(v) for v in sys.argv[1:5])
    out_path = sys.argv[5]
    mesh = jax.make_mesh((n,), ("ep",), devices=jax.devices()[:n])
    case = check.make_case(9, KIMI_K3, n, tokens, max_tokens)
    make = lambda ep, scan: check.chained_layers(ep, mesh, layers, scan)
    # New device buffers, same values: the executable's buffer addresses change between runs.
    fresh = lambda: check.sharded_inputs(case, mesh, "ep")

    inputs = [fresh(), fresh()]
    xla = XlaBackend(mesh, "ep", max_tokens, KIMI_K3)
    saved = {}
    with NvlinkBackend(mesh, "ep", max_tokens, KIMI_K3) as nv:
        print("PATH", ffi.launch_path(), "|", ffi.record_error(), flush=True)
        for scan in (False, True):
            want = [np.asarray(a) for a in make(xla, scan)(*inputs[0])]
            fn = make(nv, scan)
            first = None
            for rep in range(4):  # alternating inputs: command-buffer updates (record: UpdateLaunch)
                got = [np.asarray(a) for a in fn(*inputs[rep % 2])]
                assert np.array_equal(got[0].view(np.uint16), want[0].view(np.uint16)), (scan, rep, "routed")
                assert bf16_ulp_diff(got[1], want[1]).max() <= 2, (scan, rep, "normed")
                if first is None:
                    first = got
                for a, b in zip(got, first):
                    assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), (scan, rep, "replay differs")
            saved[f"routed_scan{int(scan)}"], saved[f"normed_scan{int(scan)}"] = (a.view(np.uint16) for a in first)
        assert all(v == (0, 0, 0, 0) for v in nv.status().values()), nv.status()
    np.savez(out_path, **saved)
    print("COUNTS", *ffi.record_counts(), flush=True)
    print("OK", flush=True)
    """
)


@pytest.mark.gpu
@pytest.mark.slow
def test_record_and_traced_paths_agree(tmp_path):
    """One jitted multi-layer program (unrolled and in lax.scan, command buffers on, inputs alternating
    between two sets of buffers) on the record path (with and without PDL) and on the traced path: each
    against the XLA backend (routed bit for bit, normed within 2 ulp), and all three bit for bit alike.
    The record handlers must have added and updated kernel nodes; the traced path must not touch them."""
    n = min(2, len(_gpus()))
    cases = {
        "record": ({"JAX_LATENT_EP_FFI_RECORD": "1", "JAX_LATENT_EP_PDL": "1"}, "record"),
        "record_no_pdl": ({"JAX_LATENT_EP_FFI_RECORD": "1", "JAX_LATENT_EP_PDL": "0"}, "record"),
        "traced": ({"JAX_LATENT_EP_FFI_RECORD": "0", "JAX_LATENT_EP_PDL": "1"}, "traced"),
    }
    results = {}
    for label, (env, path) in cases.items():
        out = tmp_path / f"{label}.npz"
        proc = _run(_PATH_SCRIPT, [n, 5, 8, 6, out], {"XLA_FLAGS": COMMAND_BUFFER_FLAGS, **env})
        print(label, proc.stdout)
        assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]
        assert f"PATH {path} " in proc.stdout, proc.stdout
        creates, updates = (int(v) for v in proc.stdout.split("COUNTS")[1].split()[:2])
        if path == "record":
            assert creates > 0 and updates > 0, (label, creates, updates)
        else:
            assert (creates, updates) == (0, 0), (label, creates, updates)
        with np.load(out) as z:
            results[label] = {k: z[k] for k in z.files}
    for label in ("record_no_pdl", "traced"):
        for key, want in results["record"].items():
            got = results[label][key]
            np.testing.assert_array_equal(got, want, err_msg=f"{label} {key} (bf16 bits)")


_MULTIPROCESS_SCRIPT = textwrap.dedent(
    """
    import os, sys
    rank, port, tokens, max_tokens = (int(v) for v in sys.argv[1:5])
    import jax
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jax_latent_ep.shapes import KIMI_K3
    from jax_latent_ep.backends.nvlink import NvlinkBackend
    from jax_latent_ep.testing import check

    mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices())
    case = check.make_case(11, KIMI_K3, 2, tokens, max_tokens)
    want = check.model_two_layers(case)
    with NvlinkBackend(mesh, "ep", max_tokens, KIMI_K3) as nv:
        assert nv._buffers[0].multiprocess and list(nv.status()) == [(0, rank)]
        fn = jax.jit(jax.shard_map(check.two_layers(nv), mesh=mesh,
                     in_specs=(P("ep"),) * 4 + (P(),), out_specs=P("ep")))
        n, rows = 2, case.rows
        flat = lambda a: a.reshape(n * a.shape[1], *a.shape[2:])
        junk = np.moveaxis(case.junk, 0, 1).reshape(n * 2, rows, -1)
        def put(a, spec):
            sharding = NamedSharding(mesh, spec)
            return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])
        args = [put(flat(case.x), P("ep")), put(flat(case.ids), P("ep")), put(flat(case.weights), P("ep")),
                put(junk, P("ep")), put(case.norm_weight, P())]
        for rep in range(3):
            res = fn(*args)
            recv1, routed, recv2, normed = jax.tree.map(
                lambda a: np.asarray(a.addressable_shards[0].data), res)
            stats = check.compare_rank((tuple(recv1), routed, tuple(recv2), normed), want, rank)
        jax.block_until_ready(res)
        print("OK", rank, stats, flush=True)
    jax.distributed.shutdown()
    """
)


@pytest.mark.gpu
@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_one_gpu_each():
    if len(_gpus()) < 2:
        pytest.skip("needs 2 GPUs")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env.pop("XLA_FLAGS", None)
    procs = []
    for rank in range(2):
        e = dict(env, CUDA_VISIBLE_DEVICES=str(rank))
        procs.append(subprocess.Popen([sys.executable, "-c", _MULTIPROCESS_SCRIPT, str(rank), str(port), "13", "16"],
                                      env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO)))
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        outs.append((p.returncode, out, err))
    for rank, (rc, out, err) in enumerate(outs):
        print(out)
        assert rc == 0 and f"OK {rank}" in out, f"rank {rank} rc={rc}\n{out[-2000:]}\n{err[-6000:]}"


_TIMEOUT_SCRIPT = textwrap.dedent(
    """
    import os
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    from jax_latent_ep.shapes import KIMI_K3
    from jax_latent_ep.backends.nvlink import NvlinkBackend

    nv = NvlinkBackend(jax.make_mesh((2,), ("ep",), devices=jax.devices()[:2]), "ep", 8, KIMI_K3, timeout_s=0.5)
    # Rank 0 dispatches alone (a one-device program): it must time out waiting for rank 1's flag.
    alone = jax.make_mesh((1,), ("ep",), devices=jax.devices()[:1])
    fn = jax.jit(jax.shard_map(lambda x, i, w: nv.dispatch(x, i, w).src, mesh=alone, in_specs=(P("ep"),) * 3,
                               out_specs=P("ep")))
    put = lambda a: jax.device_put(a, jax.NamedSharding(alone, P("ep")))
    x = put(jnp.zeros((4, 3584), jnp.bfloat16))
    ids = put(jnp.zeros((4, 16), jnp.int32))  # every token to expert 0 (rank 0) only
    w = put(jnp.ones((4, 16), jnp.float32))
    try:
        jax.block_until_ready(fn(x, ids, w))
        print("NO ERROR", flush=True)
    except Exception as e:
        print("RAISED", type(e).__name__, str(e)[:300].replace(chr(10), " "), flush=True)
    print("STATUS", nv.status()[(0, 0)], flush=True)
    try:
        nv.check()
    except RuntimeError as e:
        print("CHECK", e, flush=True)
    os._exit(0)  # the trap killed the CUDA context: no orderly teardown
    """
)


@pytest.mark.gpu
@pytest.mark.slow
def test_flag_timeout_is_reported():
    if len(_gpus()) < 2:
        pytest.skip("needs 2 GPUs")
    proc = _run(_TIMEOUT_SCRIPT, [], {"XLA_FLAGS": ""}, timeout=120)
    print(proc.stdout)
    assert "RAISED" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "STATUS (1, 0, 1, " in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CHECK jax_latent_ep: dispatch on rank 0 timed out waiting for rank 1" in proc.stdout, proc.stdout


_BAD_INPUT_SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jax_latent_ep import ExpertParallel
    from jax_latent_ep.shapes import KIMI_K3
    from jax_latent_ep.testing import check

    n, t, mt = int(sys.argv[1]), 5, 8
    mesh = jax.make_mesh((n,), ("ep",), devices=jax.devices()[:n])
    ep = ExpertParallel(mesh, "ep", max_tokens=mt, shape=KIMI_K3, backend="nvlink", check_ids=True)
    spec = P("ep")
    case = check.make_case(5, KIMI_K3, n, t, mt)
    flat = lambda a: a.reshape(n * a.shape[1], *a.shape[2:])
    x, ids, w = flat(case.x), flat(case.ids), flat(case.weights)

    def layer(x, i, w):
        recv = ep.dispatch(x, i, w)
        return ep.combine(recv.x.astype(jnp.bfloat16), i)

    def bad_out(x, i, w):
        recv = ep.dispatch(x, i, w)
        return ep.combine(recv.x.astype(jnp.bfloat16)[:-1], i)

    bad_ids = ids.copy()
    bad_ids[1, 3] = KIMI_K3.experts
    attempts = [
        ("dtype", layer, (x.astype(np.float32), ids, w), "x must be bfloat16[5, 3584], got float32[5, 3584]"),
        ("shape", layer, (x[:, :1792], ids, w), "x must be bfloat16[5, 3584], got bfloat16[5, 1792]"),
        ("ids shape", layer, (x, ids[:, :8], w), "ids must be int32[5, 16], got int32[5, 8]"),
        ("too many tokens", layer, (np.concatenate([x, x]), np.concatenate([ids, ids]), np.concatenate([w, w])),
         "T=10 tokens"),
        ("out shape", bad_out, (x, ids, w), "out must be bfloat16"),
        ("ids out of range", layer, (x, bad_ids, w), "ExpertParallel.dispatch: ids[1, 3] = 896 on rank 0"),
    ]
    for label, fn, arrays, expect in attempts:
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
        try:
            jax.block_until_ready(f(*[jax.device_put(a, NamedSharding(mesh, spec)) for a in arrays]))
        except Exception as e:
            text = str(e).replace(chr(10), " ")
            assert expect in text, (label, text[:2000])
            print("REFUSED", label, ":", type(e).__name__, text[:200], flush=True)
        else:
            raise AssertionError(f"{label}: accepted")
        try:
            jax.effects_barrier()  # a failed host callback is also recorded in JAX's runtime tokens
        except Exception:
            pass
        assert ep.status() and all(v == (0, 0, 0, 0) for v in ep.status().values()), (label, ep.status())
    # No kernel ran: a dispatch without its combine would make this next dispatch fail (error code 3).
    got = check.run_case(ep, case)
    want = check.model_two_layers(case)
    for r in range(n):
        check.compare_rank(got[r], want, r)
    ep.check()
    print("OK", flush=True)
    """
)


@pytest.mark.gpu
@pytest.mark.slow
def test_bad_input_refused_before_any_kernel():
    """Wrong dtype / shape, T > max_tokens, a bad `out`, ids out of range (check_ids) on the nvlink backend:
    each refused with its message, no error record, and a correct two-layer run afterwards (so no kernel ran)."""
    n = min(2, len(_gpus()))
    proc = _run(_BAD_INPUT_SCRIPT, [n], {"XLA_FLAGS": ""}, timeout=300)
    print(proc.stdout)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.count("REFUSED") == 6, proc.stdout


_SEQUENCE_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jax_latent_ep.shapes import KIMI_K3
    from jax_latent_ep.backends.nvlink import NvlinkBackend

    mode, n = sys.argv[1], int(sys.argv[2])
    mesh = jax.make_mesh((n,), ("ep",), devices=jax.devices()[:n])
    nv = NvlinkBackend(mesh, "ep", 8, KIMI_K3, timeout_s=2.0)

    def twice(x, i, w):
        first = nv.dispatch(x, i, w)
        x2 = x + (first.weights[0, 0] * 0).astype(x.dtype)  # the second dispatch follows the first
        return nv.dispatch(x2, i, w).src

    def without(x, i, w):
        out = jnp.zeros((nv.rows, 3584), jnp.bfloat16) + x[0, 0] * 0
        return nv.combine(out, i)

    spec = P("ep")
    fn = jax.jit(jax.shard_map({"twice": twice, "without": without}[mode], mesh=mesh, in_specs=(spec,) * 3,
                               out_specs=spec))
    put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))
    x = put(jnp.zeros((n * 4, 3584), jnp.bfloat16))
    ids = put(jnp.tile(jnp.arange(16, dtype=jnp.int32), (n * 4, 1)))
    w = put(jnp.ones((n * 4, 16), jnp.float32))
    try:
        jax.block_until_ready(fn(x, ids, w))
        print("NO ERROR", flush=True)
    except Exception as e:
        print("RAISED", type(e).__name__, str(e)[:300].replace(chr(10), " "), flush=True)
    print("STATUS", nv.status()[(0, 0)], flush=True)
    try:
        nv.check()
        print("CHECK PASSED", flush=True)
    except RuntimeError as e:
        print("CHECK", e, flush=True)
    os._exit(0)  # the trap killed the CUDA context: no orderly teardown
    """
)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("mode, code, words", [
    ("twice", 3, "dispatch called twice without a combine on rank 0 at layer"),
    ("without", 4, "combine called without its dispatch on rank 0 at layer"),
])
def test_sequence_error_is_reported(mode, code, words):
    """A jitted program calling dispatch twice in a row (or combine first) fails; check() names the code."""
    n = min(2, len(_gpus()))
    proc = _run(_SEQUENCE_SCRIPT, [mode, n], {"XLA_FLAGS": ""}, timeout=120)
    print(proc.stdout)
    out = proc.stdout
    assert "RAISED" in out, out[-3000:] + proc.stderr[-6000:]
    assert f"STATUS ({code}, 0, 0, " in out, out[-3000:] + proc.stderr[-3000:]
    assert f"CHECK jax_latent_ep: {words}" in out and f"error code {code})" in out, out
