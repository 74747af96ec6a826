"""The call-sequence contract at trace time, every backend alike (`jax_latent_ep.sequence`): a combine whose
`out` does not derive from its dispatch (the kernels' error 4), other ids than the dispatch's, calls under
rank-divergent `lax.cond` / `switch` / `while_loop`; and what stays allowed (uniform cond, scan, fori_loop with
static bounds). Also `check_ids` as a flag that changes nothing else (vmap, grad, scan, remat; -1 is "no
expert"; one BadIdError message, not logged per rank) and the edge values of issue 27."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_latent_ep import ExpertParallel, LatentMoEShape
from jax_latent_ep.api import BadIdError
from tests.test_api import MT, N, SHAPE, T, _expert, good_inputs, mesh_of, run


def _ep(**kw):
    return ExpertParallel(mesh_of(), "ep", max_tokens=MT, shape=SHAPE, **kw)


def _layer(ep):
    def f(x, i, w):
        return ep.combine(_expert(ep.dispatch(x, i, w)), i)
    return f


# -- the call sequence ---------------------------------------------------------------------------------


def test_combine_whose_out_does_not_derive_from_its_dispatch_is_refused():
    ep = _ep()
    x, ids, w = good_inputs()

    def unused_dispatch(x, i, w):
        ep.dispatch(x, i, w)  # XLA would drop it: the combine would run without its dispatch
        return ep.combine(jnp.zeros((ep.rows, SHAPE.latent), jnp.bfloat16), i)

    with pytest.raises(ValueError, match=r"ExpertParallel.combine: combine called without its dispatch: out does "
                                         r"not derive from the Received of this layer's dispatch"):
        run(ep, unused_dispatch, x, ids, w)

    def uses_weights_only(x, i, w):  # deriving from any Received field is a dependency XLA keeps
        recv = ep.dispatch(x, i, w)
        return ep.combine(jnp.broadcast_to(recv.weights[:, :1], (ep.rows, SHAPE.latent)).astype(jnp.bfloat16), i)

    run(ep, uses_weights_only, x, ids, w)


WITHOUT = r"ExpertParallel.combine: combine called without its dispatch: no dispatch was traced before it"


@pytest.mark.parametrize("backend", ["xla", "auto"])
def test_combine_without_its_dispatch_is_refused_whatever_was_traced_before(backend):
    """A combine with no dispatch in its own trace (the kernels' error 4) is refused on every backend: alone, and
    after the same ExpertParallel traced a dispatch alone, whole layers, and the refused call itself."""
    ep = _ep(backend=backend)
    x, ids, w = good_inputs()
    rng = np.random.default_rng(7)
    out = jnp.asarray(rng.standard_normal((N * ep.rows, SHAPE.latent)), jnp.bfloat16)
    combine_alone = lambda o, i: ep.combine(o, i)
    with pytest.raises(ValueError, match=WITHOUT):
        run(ep, combine_alone, out, ids)
    run(ep, lambda x, i, w: ep.dispatch(x, i, w), x, ids, w)
    layer = run(ep, _layer(ep), x, ids, w)
    with pytest.raises(ValueError, match=WITHOUT):
        run(ep, combine_alone, out, ids)
    x2, ids2, _ = good_inputs(t=T - 1, seed=5)
    with pytest.raises(ValueError, match=WITHOUT):  # a new shape, traced afresh
        run(ep, combine_alone, np.asarray(out), ids2)
    np.testing.assert_array_equal(run(ep, _layer(ep), x, ids, w).view(np.uint16), layer.view(np.uint16))


def test_combine_nested_in_its_layers_function_is_accepted():
    """A combine in a trace nested in the layer's function (`jax.checkpoint`, an inner `jit`) takes the dispatch
    of the enclosing trace, and gives the same bits as the flat layer; a second combine there is refused."""
    ep = _ep()
    x, ids, w = good_inputs(seed=8)
    flat = run(ep, _layer(ep), x, ids, w)

    def nested(wrap):
        def f(x, i, w):
            recv = ep.dispatch(x, i, w)
            return wrap(lambda r, i: ep.combine(_expert(r), i))(recv, i)
        return f

    for wrap in (jax.checkpoint, jax.jit):
        got = run(ep, nested(wrap), x, ids, w)
        np.testing.assert_array_equal(got.view(np.uint16), flat.view(np.uint16))

    def twice(x, i, w):
        recv = ep.dispatch(x, i, w)
        first = jax.checkpoint(lambda r, i: ep.combine(_expert(r), i))(recv, i)
        return first + ep.combine(_expert(recv), i)

    with pytest.raises(ValueError, match="called again in this traced function without a dispatch"):
        run(ep, twice, x, ids, w)


def test_combine_with_other_ids_is_refused():
    ep = _ep()
    x, ids, w = good_inputs()
    with pytest.raises(ValueError, match="ids are not the ids given to this layer's dispatch"):
        run(ep, lambda x, i, i2, w: ep.combine(_expert(ep.dispatch(x, i, w)), i2), x, ids, ids.copy(), w)
    with pytest.raises(ValueError, match="ids are not the ids given to this layer's dispatch"):
        run(ep, lambda x, i, w: ep.combine(_expert(ep.dispatch(x, i, w)), i[::-1]), x, ids, w)


def test_rank_divergent_cond_is_refused_at_trace_time():
    ep = _ep()
    x, ids, w = good_inputs()

    def skips_when_empty(x, i, w):  # the issue's `lax.cond(n_live > 0, layer, identity)`
        live = jnp.sum(i >= 0) - lax.axis_index("ep") * 1000  # varies per rank
        return lax.cond(live > 0, lambda: _layer(ep)(x, i, w), lambda: x)

    with pytest.raises(ValueError, match=r"ExpertParallel.dispatch: traced inside a lax.cond branch whose predicate "
                                         r"varies over 'ep'.*Every rank must make every dispatch and combine"):
        run(ep, skips_when_empty, x, ids, w)

    def switch(x, i, w):
        return lax.switch(lax.axis_index("ep") % 2, [lambda: _layer(ep)(x, i, w), lambda: x])

    with pytest.raises(ValueError, match=r"traced inside a lax.switch branch whose predicate varies over 'ep'"):
        run(ep, switch, x, ids, w)


def test_while_loop_is_refused_at_trace_time():
    ep = _ep()
    x, ids, w = good_inputs()

    def loop(x, i, w):
        n = 1 + lax.axis_index("ep")  # a trip count per rank
        return lax.fori_loop(0, n, lambda _, h: _layer(ep)(h, i, w), x)

    with pytest.raises(ValueError, match=r"traced inside a lax.while_loop \(or a fori_loop with traced bounds\)"):
        run(ep, loop, x, ids, w)


def test_uniform_control_flow_is_allowed():
    ep = _ep()
    x, ids, w = good_inputs()
    want = run(ep, _layer(ep), x, ids, w)

    def uniform_cond(x, i, w):
        flag = lax.psum(jnp.sum(i), "ep") > -1  # the same on every rank: replicated over 'ep'
        return lax.cond(flag, lambda: _layer(ep)(x, i, w), lambda: x)

    np.testing.assert_array_equal(run(ep, uniform_cond, x, ids, w), want)

    def static_loop(x, i, w):
        return lax.fori_loop(0, 1, lambda _, h: _layer(ep)(h, i, w), x)  # static bounds: a scan

    np.testing.assert_array_equal(run(ep, static_loop, x, ids, w), want)


# -- check_ids: a debugging flag that changes nothing else ------------------------------------------------


def _sharded(ep, *arrays):
    return [jax.device_put(a, NamedSharding(ep.mesh, P("ep"))) for a in arrays]


def test_check_ids_under_vmap():
    x, ids, w = good_inputs()
    xs = np.stack([x, x[::-1]])
    outs = {}
    for flag in (False, True):
        ep = _ep(check_ids=flag)
        f = jax.jit(jax.vmap(jax.shard_map(_layer(ep), mesh=ep.mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")),
                             in_axes=(0, None, None)))
        xs_ = jax.device_put(xs, NamedSharding(ep.mesh, P(None, "ep")))
        outs[flag] = np.asarray(f(xs_, *_sharded(ep, ids, w)))
    np.testing.assert_array_equal(outs[True], outs[False])  # bit-exact: the flag changes nothing


def test_check_ids_under_grad_scan_and_remat():
    x, ids, w = good_inputs()
    nw = np.ones((SHAPE.latent,), np.float32)
    results = {}
    for flag in (False, True):
        ep = _ep(check_ids=flag)

        def loss(nw, x, i, w):
            def layer(h, _):
                def body(h):  # the gradient of h flows through the dequantized latent (docs/numerics.md)
                    recv, xf = ep.dispatch(h, i, w, dequantize=True)
                    out = (xf * jnp.sum(recv.weights, axis=1, keepdims=True)).astype(jnp.bfloat16)
                    return ep.combine(out, i, nw.astype(jnp.bfloat16))

                out = jax.checkpoint(body)(h)
                return out, None
            h, _ = lax.scan(layer, x, None, length=2)
            return lax.psum(jnp.sum(h.astype(jnp.float32)), "ep")

        g = jax.jit(jax.shard_map(jax.grad(loss), mesh=ep.mesh, in_specs=(P(), P("ep"), P("ep"), P("ep")),
                                  out_specs=P(), check_vma=False))
        results[flag] = np.asarray(g(nw, *_sharded(ep, x, ids, w)))
    assert np.all(np.isfinite(results[False])) and np.any(results[False] != 0)
    np.testing.assert_array_equal(results[True], results[False])


def test_minus_one_is_no_expert_for_check_ids():
    x, ids, w = good_inputs()
    ids[0, 1] = -1
    ids[3, :] = -1  # a padded token: reaches no rank, its routed latent is 0
    ep, ep_checked = _ep(), _ep(check_ids=True)
    a = run(ep, _layer(ep), x, ids, w)
    b = run(ep_checked, _layer(ep_checked), x, ids, w)
    np.testing.assert_array_equal(a, b)
    assert np.all(b[3].astype(np.float32) == 0)
    ids[1, 0] = -2  # other negative ids still fail
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"ids\[1, 0\] = -2 on rank 0 is outside \[0, 8\) and not -1"):
        run(ep_checked, _layer(ep_checked), x, ids, w)
    try:  # JAX records a failed host callback in its runtime tokens too (issue 27, left open): consume it here
        jax.effects_barrier()
    except Exception:
        pass


def test_checked_raises_one_bad_id_error(capfd):
    """`ep.checked(step)`: the failed check is the BadIdError itself, raised once; nothing is left for
    jax.effects_barrier(), nothing logged; a good call after it runs."""
    x, ids, w = good_inputs()
    ep = _ep(check_ids=True)
    step = ep.checked(lambda x, i, w: run(ep, _layer(ep), x, i, w))
    good = step(x, ids, w)
    bad = ids.copy()
    bad[5, 1] = 1000
    with pytest.raises(BadIdError, match=r"ExpertParallel.dispatch: ids\[2, 1\] = 1000 on rank 1 ") as info:
        step(x, bad, w)
    assert type(info.value) is BadIdError and info.value.__cause__ is None
    jax.effects_barrier()  # raises nothing: the copy was consumed
    np.testing.assert_array_equal(step(x, ids, w), good)
    err = capfd.readouterr().err
    assert "BadIdError" not in err and "pure_callback failed" not in err, err


def test_bad_id_is_not_logged_per_rank(capfd):
    x, ids, w = good_inputs()
    ids[4, 1] = 99
    ep = _ep(check_ids=True)
    with pytest.raises(jax.errors.JaxRuntimeError, match="BadIdError") as info:
        run(ep, _layer(ep), x, ids, w)
    assert "ids[1, 1] = 99 on rank 1" in str(info.value)
    try:
        jax.effects_barrier()
    except Exception:
        pass
    assert issubclass(BadIdError, ValueError)
    err = capfd.readouterr().err
    assert "pure_callback failed" not in err and "BadIdError" not in err, err


_CATCH_AND_EXIT = """
import jax
from tests.test_api import good_inputs, run
from tests.test_sequence import _ep, _layer
x, ids, w = good_inputs()
ids[4, 1] = 99
ep = _ep(check_ids=True)
try:
    run(ep, _layer(ep), x, ids, w)
except jax.errors.JaxRuntimeError as e:
    print("caught:", "ExpertParallel.dispatch: ids[1, 1] = 99 on rank 1" in str(e))
"""


def test_failed_id_check_raises_once():
    """By default (no `ep.checked`) a failed id check raises at the step's result, where the user catches it, and
    not again when the interpreter exits (JAX's exit hook would re-raise its copy of the failed callback)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": root,
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    proc = subprocess.run([sys.executable, "-c", _CATCH_AND_EXIT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "caught: True", (proc.stdout, proc.stderr)
    assert "BadIdError" not in proc.stderr and "atexit" not in proc.stderr, proc.stderr


# -- edges ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("eps", [float("inf"), float("nan"), -1e-3, np.float32(np.inf), jnp.float32(-1.0), "1e-5",
                                 np.ones(2, np.float32), True])
def test_eps_must_be_finite_and_non_negative(eps):
    ep = _ep()
    x, ids, w = good_inputs()
    nw = np.ones((SHAPE.latent,), jnp.bfloat16)
    with pytest.raises(ValueError, match="must be a finite non-negative float"):
        run(ep, lambda x, i, w, n: ep.combine(_expert(ep.dispatch(x, i, w)), i, n, eps), x, ids, w, nw,
            specs=(P("ep"),) * 3 + (P(),))


def test_scalars_of_numpy_and_jax_are_accepted():
    x, ids, w = good_inputs()
    nw = np.ones((SHAPE.latent,), jnp.bfloat16)
    shape = LatentMoEShape(latent=np.int64(SHAPE.latent), experts=np.int32(SHAPE.experts), topk=jnp.int32(SHAPE.topk))
    assert shape == SHAPE and type(shape.latent) is int
    ep = ExpertParallel(mesh_of(), "ep", max_tokens=np.int64(MT), shape=shape)
    assert type(ep.max_tokens) is int and ep.max_tokens == MT
    outs = [run(ep, lambda x, i, w, n, e=e: ep.combine(_expert(ep.dispatch(x, i, w)), i, n, e), x, ids, w, nw,
                specs=(P("ep"),) * 3 + (P(),)) for e in (1e-3, np.float32(1e-3), jnp.float32(1e-3))]
    np.testing.assert_array_equal(outs[1], outs[2])
    np.testing.assert_array_equal(outs[0], outs[1]) if float(np.float32(1e-3)) == 1e-3 else None


def test_tuple_axis_name_is_refused_with_the_reason():
    mesh = jax.make_mesh((1, 2), ("dp", "ep"), devices=jax.devices("cpu")[:2])
    with pytest.raises(ValueError, match=r"axis_name=\('dp', 'ep'\) must be one mesh axis name \(a str\): expert "
                                         r"parallelism over several mesh axes is not supported"):
        ExpertParallel(mesh, ("dp", "ep"), max_tokens=MT, shape=SHAPE)


def test_with_on_a_closed_instance_is_refused():
    ep = _ep()
    ep.close()
    with pytest.raises(ValueError, match="ExpertParallel is closed: `with` needs an open instance"):
        with ep:
            pass


def _ancestors(jaxpr, variables):
    """Every variable of `jaxpr` that `variables` are computed from (themselves included)."""
    made = {id(v): e for e in jaxpr.eqns for v in e.outvars}
    seen, stack = set(), list(variables)
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if id(v) in made:
            stack.extend(u for u in made[id(v)].invars if hasattr(u, "aval") and not hasattr(u, "val"))
    return seen


def test_next_dispatch_waits_for_the_previous_combine():
    """A dispatch of tokens that are not computed from the previous combine's result still follows that combine
    (XLA orders calls by data only; the kernels refuse a dispatch run before the previous combine)."""
    x, ids, w = good_inputs()
    ep = _ep()

    def body(x, i, w):
        y = ep.combine(_expert(ep.dispatch(x, i, w)), i)
        return ep.combine(_expert(ep.dispatch(x, i, w)), i), y  # the second dispatch's x ignores y

    spec = P("ep")
    closed = jax.make_jaxpr(jax.shard_map(body, mesh=ep.mesh, in_specs=(spec,) * 3, out_specs=(spec, spec)))(
        *_sharded(ep, x, ids, w))
    inner = next(e.params["jaxpr"] for e in closed.jaxpr.eqns if e.primitive.name == "shard_map")
    calls = [e for e in inner.eqns if e.primitive.name.startswith("custom_vjp")]
    assert len(calls) == 4, [e.primitive.name for e in inner.eqns]  # dispatch, combine, dispatch, combine
    first_combine, second_dispatch = calls[1], calls[2]
    assert {id(v) for v in first_combine.outvars} & _ancestors(inner, second_dispatch.invars)
    # ... and the results are the same as without the tie (it is an optimization barrier, no arithmetic)
    f = jax.jit(jax.shard_map(body, mesh=ep.mesh, in_specs=(spec,) * 3, out_specs=(spec, spec)))
    a, b = f(*_sharded(ep, x, ids, w))
    np.testing.assert_array_equal(np.asarray(b), np.asarray(run(ep, _layer(ep), x, ids, w)))
