"""`ExpertParallel`: backend choice, trace-time checks with clear messages (including the mesh the shard_map
runs over), `check_ids` (and which call it names), out-of-range and duplicate ids, the context manager and
close, and the package's exports."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_latent_ep
from jax_latent_ep import ExpertParallel, LatentMoEShape, Received
from jax_latent_ep.testing import check, model

SHAPE = LatentMoEShape(latent=64, experts=8, topk=2)
N, T, MT = 2, 3, 5


def mesh_of(n=N):
    return jax.make_mesh((n,), ("ep",), devices=jax.devices("cpu")[:n])  # the xla backend, even on a GPU machine


def good_inputs(n=N, t=T, seed=0):
    rng = np.random.default_rng(seed)
    x = check.random_latent(rng, (n * t,), SHAPE.latent, special=False)
    ids = np.stack([rng.choice(SHAPE.experts, SHAPE.topk, replace=False) for _ in range(n * t)]).astype(np.int32)
    w = rng.random((n * t, SHAPE.topk)).astype(np.float32)
    return x, ids, w


def run(ep, fn, *arrays, specs=None):
    """`jax.jit(jax.shard_map(fn))` over ep's mesh with every array sharded on its first axis."""
    mesh = ep.mesh
    specs = specs or tuple(P("ep") for _ in arrays)
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, specs)]
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P("ep")))
    return jax.tree.map(np.asarray, f(*placed))


# -- construction ----------------------------------------------------------------------------------------


def test_auto_is_xla_on_cpu():
    ep = ExpertParallel(mesh_of(), "ep", max_tokens=MT, shape=SHAPE)
    assert ep.backend == "xla" and ep.ranks == N and ep.rows == N * 8
    assert "backend='xla'" in repr(ep)
    assert "not every mesh device is a CUDA GPU" in ep.fallback_reason


def test_nvlink_unavailable_on_cpu():
    with pytest.raises(ValueError, match="backend='nvlink' is not available: not every mesh device is a CUDA GPU"):
        ExpertParallel(mesh_of(), "ep", max_tokens=MT, shape=SHAPE, backend="nvlink")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(backend="nccl"), r"backend='nccl' must be one of \('auto', 'xla', 'nvlink'\)"),
        (dict(max_tokens=None), "needs max_tokens"),
        (dict(max_tokens=0), "max_tokens=0 must satisfy 1 <= max_tokens < 65536"),
        (dict(max_tokens=65536), "max_tokens=65536"),
        (dict(axis_name="tp"), r"axis_name='tp' is not an axis of the mesh \(axes: \['ep'\]\)"),
        (dict(shape=(64, 8, 2)), "must be a LatentMoEShape"),
        (dict(backend="xla", grid=4), r"the xla backend takes no options, got \['grid'\]"),
    ],
)
def test_bad_construction(kwargs, message):
    args = dict(axis_name="ep", max_tokens=MT, shape=SHAPE) | kwargs
    with pytest.raises(ValueError, match=message):
        ExpertParallel(mesh_of(), **args)


def test_ranks_must_divide_experts():
    with pytest.raises(ValueError, match="ranks=3 must divide experts=8"):
        ExpertParallel(mesh_of(3), "ep", max_tokens=MT, shape=SHAPE)


def test_context_manager_closes():
    with ExpertParallel(mesh_of(), "ep", max_tokens=MT, shape=SHAPE) as ep:
        pass
    ep.close()  # idempotent
    x, ids, w = good_inputs()
    with pytest.raises(ValueError, match="ExpertParallel is closed"):
        run(ep, lambda x, i, w: ep.dispatch(x, i, w).src, x, ids, w)
    out = np.zeros((N * ep.rows, SHAPE.latent), jnp.bfloat16)
    with pytest.raises(ValueError, match="ExpertParallel is closed"):
        run(ep, lambda o, i: ep.combine(o, i), out, ids)


def test_exports():
    for name in ["ExpertParallel", "Received", "KIMI_K3", "DEEPSEEK_V3", "LatentMoEShape", "EpLayout",
                 "mxfp8_quantize", "mxfp8_dequantize", "rms_norm"]:
        assert hasattr(jax_latent_ep, name), name
    assert Received._fields == ("x", "sf", "ids", "weights", "src")


# -- trace-time checks -----------------------------------------------------------------------------------


def test_outside_shard_map():
    ep = ExpertParallel(mesh_of(), "ep", max_tokens=MT, shape=SHAPE)
    x, ids, w = good_inputs(t=T)
    with pytest.raises(ValueError, match="must be called inside jax.shard_map over the mesh axis 'ep'"):
        ep.dispatch(jnp.asarray(x[:T]), jnp.asarray(ids[:T]), jnp.asarray(w[:T]))
    with pytest.raises(ValueError, match="combine must be called inside jax.shard_map"):
        ep.combine(jnp.zeros((ep.rows, SHAPE.latent), jnp.bfloat16), jnp.asarray(ids[:T]))


def test_wrong_axis_size():
    ep = ExpertParallel(mesh_of(2), "ep", max_tokens=MT, shape=SHAPE)
    x, ids, w = good_inputs(n=4)
    other = ExpertParallel(mesh_of(4), "ep", max_tokens=MT, shape=SHAPE)
    with pytest.raises(ValueError, match="axis 'ep' has size 4 here, but the ExpertParallel was built for N=2"):
        run(other, lambda x, i, w: ep.dispatch(x, i, w).src, x, ids, w)


def mesh_2x2():
    return jax.make_mesh((2, 2), ("dp", "ep"), devices=jax.devices("cpu")[:4])


def test_other_mesh_is_refused():
    """An axis of the right size in another mesh: the shard_map must run over the constructor's mesh."""
    ep = ExpertParallel(mesh_2x2(), "ep", max_tokens=MT, shape=SHAPE)
    x, ids, w = good_inputs()
    one_d = ExpertParallel(mesh_of(2), "ep", max_tokens=MT, shape=SHAPE)  # only for `run`'s mesh
    with pytest.raises(ValueError, match=r"dispatch: traced inside a shard_map over the mesh \('ep': 2\), but the "
                                         r"ExpertParallel was built for the mesh \('dp': 2, 'ep': 2\)"):
        run(one_d, lambda x, i, w: ep.dispatch(x, i, w).src, x, ids, w)
    out = np.zeros((N * ep.rows, SHAPE.latent), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"combine: traced inside a shard_map over the mesh \('ep': 2\)"):
        run(one_d, lambda o, i: ep.combine(o, i), out, ids)


def test_two_groups_on_a_2x2_mesh():
    """The constructor's mesh passes the check, with "dp" mapped too: each dp group is its own EP group."""
    mesh = mesh_2x2()
    ep = ExpertParallel(mesh, "ep", max_tokens=MT, shape=SHAPE)
    x, ids, w = good_inputs(n=4)
    spec = P(("dp", "ep"))
    placed = [jax.device_put(a, NamedSharding(mesh, spec)) for a in (x, ids, w)]
    f = jax.jit(jax.shard_map(_dispatch_combine(ep), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    recv, routed = jax.tree.map(np.asarray, f(*placed))
    per = lambda a: a.reshape(N, T, *a.shape[1:])  # noqa: E731
    for g in range(2):
        tokens = slice(g * N * T, (g + 1) * N * T)
        want = model.dispatch(per(x[tokens]), per(ids[tokens]), per(w[tokens]), shape=SHAPE, max_tokens=MT)
        for r in range(N):
            rows = slice((g * N + r) * ep.rows, (g * N + r + 1) * ep.rows)
            check.compare_received(tuple(a[rows] for a in recv), want, r, f"group {g}")


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda x, i, w: (x.astype(np.float32), i, w), r"x must be bfloat16\[3, 64\], got float32\[3, 64\]"),
        (lambda x, i, w: (x[:, :32], i, w), r"x must be bfloat16\[3, 64\], got bfloat16\[3, 32\]"),
        (lambda x, i, w: (x.reshape(-1), i, w), r"x must be 2-D \[T, \.\.\.\], got bfloat16\[192\]"),
        (lambda x, i, w: (x, i.astype(np.int16), w), r"ids must be int32\[3, 2\], got int16\[3, 2\]"),
        (lambda x, i, w: (x, i[:, :1], w), r"ids must be int32\[3, 2\], got int32\[3, 1\]"),
        (lambda x, i, w: (x, i, w.astype(jnp.bfloat16)), r"weights must be float32\[3, 2\], got bfloat16\[3, 2\]"),
    ],
)
def test_bad_dispatch_inputs(change, message):
    ep = ExpertParallel(mesh_of(), "ep", max_tokens=MT, shape=SHAPE)
    x, ids, w = good_inputs()
    with pytest.raises(ValueError, match=message):
        run(ep, lambda x, i, w: ep.dispatch(x, i, w).src, *change(x, ids, w))


def test_too_many_tokens():
    ep = ExpertParallel(mesh_of(), "ep", max_tokens=2, shape=SHAPE)
    x, ids, w = good_inputs(t=3)
    with pytest.raises(ValueError, match=r"T=3 tokens \(x bfloat16\[3, 64\]\) must satisfy 1 <= T <= max_tokens=2"):
        run(ep, lambda x, i, w: ep.dispatch(x, i, w).src, x, ids, w)


def test_zero_tokens():
    ep = ExpertParallel(mesh_of(), "ep", max_tokens=MT, shape=SHAPE)
    x, ids, w = good_inputs()
    with pytest.raises(ValueError, match=r"T=0 tokens"):
        run(ep, lambda x, i, w: ep.dispatch(x[:0], i[:0], w[:0]).src, x, ids, w)


@pytest.mark.parametrize(
    "out_fn,norm,eps,message",
    [
        (lambda r: r[:-1], None, 1e-5, r"out must be bfloat16\[16, 64\], got bfloat16\[15, 64\]"),
        (lambda r: r.astype(jnp.float32), None, 1e-5, r"out must be bfloat16\[16, 64\], got float32\[16, 64\]"),
        (lambda r: r, jnp.ones(64, jnp.float32), 1e-5, r"norm_weight must be bfloat16\[64\], got float32\[64\]"),
        (lambda r: r, jnp.ones(32, jnp.bfloat16), 1e-5, r"norm_weight must be bfloat16\[64\], got bfloat16\[32\]"),
        (lambda r: r, None, -1.0, r"eps=-1.0 must be a finite non-negative float"),
    ],
)
def test_bad_combine_inputs(out_fn, norm, eps, message):
    ep = ExpertParallel(mesh_of(), "ep", max_tokens=MT, shape=SHAPE)
    x, ids, w = good_inputs()

    def f(x, i, w):
        recv = ep.dispatch(x, i, w)
        return ep.combine(out_fn(recv.x.astype(jnp.bfloat16)), i, norm, eps)

    with pytest.raises(ValueError, match=message):
        run(ep, f, x, ids, w)


# -- ids -------------------------------------------------------------------------------------------------


def _dispatch_combine(ep):
    def f(x, i, w):
        recv = ep.dispatch(x, i, w)
        return tuple(recv), ep.combine(recv.x.astype(jnp.bfloat16), i)

    return f


def test_check_ids_rejects_out_of_range():
    ep = ExpertParallel(mesh_of(), "ep", max_tokens=MT, shape=SHAPE, check_ids=True)
    x, ids, w = good_inputs()
    run(ep, _dispatch_combine(ep), x, ids, w)  # in range: fine
    ids[4, 1] = SHAPE.experts
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"ids\[1, 1\] = 8 on rank 1 is outside \[0, 8\) and not -1 \(no expert\) \(1 bad id\(s\) on all ranks\)"):
        run(ep, _dispatch_combine(ep), x, ids, w)
    try:  # the failed callback is also recorded in JAX's runtime tokens: consume it here, not at exit
        jax.effects_barrier()
    except Exception:
        pass


def _consume_callback_error():
    try:  # the failed callback is also recorded in JAX's runtime tokens: consume it here, not at exit
        jax.effects_barrier()
    except Exception:
        pass


def _expert(recv):
    """A trivial expert stage over the received rows: their dequantized latent, which depends on the dispatch."""
    return recv.x.astype(jnp.bfloat16)


@pytest.mark.parametrize(
    "body,message",
    [
        (lambda ep, x, i, w: (ep.dispatch(x, i, w).src, ep.dispatch(x, i, w).src),
         r"ExpertParallel.dispatch: called again in this traced function before the combine of the previous"),
        (lambda ep, x, i, w: (lambda out: (ep.combine(out, i), ep.combine(out, i)))(_expert(ep.dispatch(x, i, w))),
         r"ExpertParallel.combine: called again in this traced function without a dispatch since the last combine"),
        # three layers in one function, every call alternating: accepted
        (lambda ep, x, i, w: ep.combine(_expert(ep.dispatch(ep.combine(_expert(ep.dispatch(x, i, w)), i), i, w)), i)
         + ep.combine(_expert(ep.dispatch(x, i, w)), i) * 0 + ep.combine(_expert(ep.dispatch(x, i, w)), i),
         None),
    ],
    ids=["dispatch-twice", "combine-twice", "three-pairs"],
)
def test_calls_alternate_in_a_traced_function(body, message):
    """Dispatch and combine traced into one function must alternate (the NVLink kernels would fail the second
    call of a kind at run time and lose the CUDA context): refused at trace time, on every backend, naming it."""
    ep = ExpertParallel(mesh_of(), "ep", max_tokens=MT, shape=SHAPE, backend="xla")
    x, ids, w = good_inputs()
    if message is None:  # alternating calls are accepted
        got = run(ep, lambda x, i, w: body(ep, x, i, w), x, ids, w)
        assert np.asarray(got).shape == (N * T, SHAPE.latent)
        return
    with pytest.raises(ValueError, match=message):
        run(ep, lambda x, i, w: body(ep, x, i, w), x, ids, w)


@pytest.mark.parametrize("repeat", range(3))
def test_check_ids_names_the_call_that_got_the_bad_id(repeat):
    """Dispatch and combine take the same ids: the bad id is reported by dispatch, the first call given it."""
    ep = ExpertParallel(mesh_of(), "ep", max_tokens=MT, shape=SHAPE, check_ids=True)
    x, ids, w = good_inputs(seed=repeat)
    ids[2, 0] = -3
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        run(ep, _dispatch_combine(ep), x, ids, w)
    _consume_callback_error()
    message = str(info.value)
    assert "ExpertParallel.dispatch: ids[2, 0] = -3 on rank 0" in message, message
    assert "ExpertParallel.combine" not in message, message


def test_combine_check_waits_for_the_dispatch_check():
    """The mechanism behind the message: combine's host check takes an input computed from dispatch's check
    (through `out`), so XLA cannot run it first."""
    ep = ExpertParallel(mesh_of(), "ep", max_tokens=MT, shape=SHAPE, check_ids=True)
    x, ids, w = good_inputs()
    mesh = ep.mesh
    f = jax.shard_map(_dispatch_combine(ep), mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep"))
    placed = [jax.device_put(a, NamedSharding(mesh, P("ep"))) for a in (x, ids, w)]
    outer = jax.make_jaxpr(f)(*placed).jaxpr
    body = next(e.params["jaxpr"] for e in outer.eqns if e.primitive.name == "shard_map")
    body = getattr(body, "jaxpr", body)
    callbacks, tainted = [], set()  # tainted: variables computed from the first callback's result
    for eqn in body.eqns:
        uses = any(not hasattr(v, "val") and v in tainted for v in eqn.invars)
        if eqn.primitive.name == "pure_callback":
            callbacks.append(uses)
            if len(callbacks) == 1:
                tainted.update(eqn.outvars)
                continue
        if uses:
            tainted.update(eqn.outvars)
    assert callbacks == [False, True], callbacks


def test_check_ids_names_combine_for_its_own_bad_id():
    ep = ExpertParallel(mesh_of(), "ep", max_tokens=MT, shape=SHAPE, check_ids=True)
    x, ids, w = good_inputs()
    bad = ids.copy()
    bad[5, 1] = SHAPE.experts + 2

    # Other ids than the dispatch's in one trace are refused at trace time
    # (test_sequence.py::test_combine_with_other_ids_is_refused); a combine in a nested trace is compared with
    # nothing there, and the run-time check names combine.
    def f(x, i, b, w):
        recv = ep.dispatch(x, i, w)
        return jax.checkpoint(lambda r, b: ep.combine(_expert(r), b))(recv, b)

    with pytest.raises(jax.errors.JaxRuntimeError, match=r"ExpertParallel.combine: ids\[2, 1\] = 10 on rank 1"):
        run(ep, f, x, ids, bad, w)
    _consume_callback_error()


def test_out_of_range_ids_are_ignored_without_check():
    """Documented behaviour of the XLA backend: an id outside [0, E) selects no rank and travels unchanged."""
    ep = ExpertParallel(mesh_of(), "ep", max_tokens=MT, shape=SHAPE)
    x, ids, w = good_inputs()
    ids[0, 0] = -1
    ids[1, :] = [SHAPE.experts, 1 << 20]  # reaches nobody: routed latent 0
    ids[4, 1] = -7
    recv, routed = run(ep, _dispatch_combine(ep), x, ids, w)
    per = lambda a: a.reshape(N, T, *a.shape[1:])  # noqa: E731
    want = model.dispatch(per(x), per(ids), per(w), shape=SHAPE, max_tokens=MT)
    for r in range(N):
        rows = slice(r * ep.rows, (r + 1) * ep.rows)
        check.compare_received(tuple(a[rows] for a in recv), want, r, "out-of-range ids")
    assert not np.any(recv[4] == 1), "token 1 of rank 0 reached a rank"
    assert np.all(routed[1].astype(np.float32) == 0)


def test_duplicate_ids_reach_a_rank_once():
    """Repeated ids within a token: the token reaches each rank once (one row, all K ids and weights), and its
    routed latent sums each rank's partial once (the model's result, bit for bit)."""
    ep = ExpertParallel(mesh_of(), "ep", max_tokens=MT, shape=SHAPE)
    x, ids, w = good_inputs()
    ids[:] = [[5, 5]] * (N * T)  # every token: expert 5 twice (rank 1)
    ids[2] = [0, 1]  # rank 0 only, two of its experts
    ids[4] = [1, 6]  # both ranks
    recv, routed = run(ep, _dispatch_combine(ep), x, ids, w)
    src = recv[4].reshape(N, ep.rows)
    valid1 = sorted(int(s) for s in src[1] if s != -1)
    assert valid1 == sorted(((r << 16) | t) for r in range(N) for t in range(T) if not (r == 0 and t == 2))
    assert sorted(int(s) for s in src[0] if s != -1) == [2, (1 << 16) | 1]
    per = lambda a: a.reshape(N, T, *a.shape[1:])  # noqa: E731
    want = model.dispatch(per(x), per(ids), per(w), shape=SHAPE, max_tokens=MT)
    for r in range(N):
        rows = slice(r * ep.rows, (r + 1) * ep.rows)
        check.compare_received(tuple(a[rows] for a in recv), want, r, "duplicate ids")
    # combine over the expert stage `_dispatch_combine` uses (the dequantized received rows), in the model
    outs = np.asarray(want.x).astype(model.BF16)
    want_routed = model.combine(outs, per(ids), None, shape=SHAPE, max_tokens=MT)
    np.testing.assert_array_equal(routed.reshape(N, T, -1).view(np.uint16), np.asarray(want_routed).view(np.uint16))


def test_combine_takes_the_tokens_of_its_dispatch():
    """A combine whose ids have another T than its dispatch's is refused at trace time, on every backend."""
    ep = ExpertParallel(mesh_of(), "ep", max_tokens=MT, shape=SHAPE, backend="xla")
    x, ids, w = good_inputs()
    fewer = ids.reshape(N, T, -1)[:, : T - 1].reshape(N * (T - 1), -1)

    def body(x, i, w, i2):
        return ep.combine(_expert(ep.dispatch(x, i, w)), i2)

    with pytest.raises(ValueError, match=rf"ExpertParallel.combine: ids has T={T - 1} tokens, but this layer's "
                                         rf"dispatch sent T={T}"):
        run(ep, body, x, ids, w, fewer)


def test_numpy_eps_is_accepted_and_equal_to_python_float():
    ep = ExpertParallel(mesh_of(), "ep", max_tokens=MT, shape=SHAPE)
    x, ids, w = good_inputs()
    g = jnp.asarray(np.random.default_rng(3).uniform(0.5, 2, SHAPE.latent), jnp.bfloat16)

    def f(eps):
        def body(x, i, w):
            recv = ep.dispatch(x, i, w)
            return ep.combine(recv.x.astype(jnp.bfloat16), i, g, eps)

        return np.asarray(run(ep, body, x, ids, w))

    a, b = f(np.float32(1e-3)), f(1e-3)
    assert np.isfinite(a.astype(np.float32)).all() and np.any(a.astype(np.float32) != 0)
    np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


def test_status_and_check_forward_to_the_backend():
    """`ExpertParallel.status()` / `check()`: nothing recorded for xla; for a backend with error records they
    return its records and raise its error (a stand-in with a recorded timeout)."""
    ep = ExpertParallel(mesh_of(), "ep", max_tokens=MT, shape=SHAPE, backend="xla")
    assert ep.status() == {}
    ep.check()

    class Recording:
        def status(self):
            return {(0, 1): (1, 1, 0, 7)}

        def check(self):
            raise RuntimeError("jax_latent_ep: dispatch on rank 1 timed out waiting for rank 0")

    ep._impl = Recording()
    assert ep.status() == {(0, 1): (1, 1, 0, 7)}
    with pytest.raises(RuntimeError, match="timed out waiting for rank 0"):
        ep.check()
