"""A shape outside the default build, on the GPU from the per-user kernel cache (`@pytest.mark.gpu`).

The cache is filled on a machine with nvidia-cutlass-dsl (the GPU machine may have none) and carried over:

    JAX_LATENT_EP_CACHE=/path/cache python -m jax_latent_ep.runtime.build --cache --shape 4096,128,8 --ranks 1 --arch sm_90a
    JAX_LATENT_EP_CACHE=/path/cache python -m pytest -q tests/gpu/test_on_demand_shape.py

`JAX_LATENT_EP_ON_DEMAND_SHAPE=L,E,K` picks another shape. Skipped without `$JAX_LATENT_EP_CACHE`.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

from jax_latent_ep.shapes import LatentMoEShape

from conftest import cuda_devices


def _shape() -> LatentMoEShape:
    text = os.environ.get("JAX_LATENT_EP_ON_DEMAND_SHAPE", "4096,128,8")
    return LatentMoEShape(*(int(v) for v in text.split(",")))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, max_tokens", [(5, 8), (64, 64)])
def test_cached_shape_runs_on_nvlink_at_n1_bit_exact_to_xla(tokens, max_tokens):
    cache = os.environ.get("JAX_LATENT_EP_CACHE")
    if not cache:
        pytest.skip("set JAX_LATENT_EP_CACHE to a cache filled with `python -m jax_latent_ep.runtime.build --cache`")
    import jax

    from jax_latent_ep import ExpertParallel
    from jax_latent_ep.runtime.ffi import gpu_arch
    from jax_latent_ep.runtime import artifacts, build, ffi
    from jax_latent_ep.testing import check
    from jax_latent_ep.testing.model import bf16_ulp_diff

    shape = _shape()
    devices = cuda_devices()[:1]
    arch = gpu_arch(devices[0])
    # The shape is not in the installed manifest: the kernels come from the cache (compile=False: loaded only).
    _, manifest = artifacts.manifest()
    assert not any(e["shape"].get("latent") == shape.latent and e["shape"].get("experts") == shape.experts
                   and e["shape"].get("topk") == shape.topk for e in manifest["entries"]), "shape is in the default build"
    for kernel in build.KERNELS:
        image = ffi.find_kernel(kernel, 1, shape, arch, compile=False)
        assert pathlib.Path(image.path).is_relative_to(pathlib.Path(cache).resolve()) or \
            pathlib.Path(image.path).is_relative_to(pathlib.Path(cache)), image.path
        print(f"{kernel}: {image}")

    mesh = jax.make_mesh((1,), ("ep",), devices=devices)
    case = check.make_case(4096 + tokens, shape, 1, tokens, max_tokens)
    with ExpertParallel(mesh, "ep", max_tokens=max_tokens, shape=shape, backend="nvlink") as nv:
        assert nv.backend == "nvlink"
        got = check.run_case(nv, case)
    with ExpertParallel(mesh, "ep", max_tokens=max_tokens, shape=shape, backend="xla") as xl:
        want = check.run_case(xl, case)
    model = check.model_two_layers(case)
    g_recv1, g_routed, g_recv2, g_normed = got[0]
    w_recv1, w_routed, w_recv2, w_normed = want[0]
    # Received rows (both layers) and the routed latent bit for bit; the RMS-normed output within the contract's
    # 2 BF16 ulp of XLA's (each may be 1 ulp off the exact model, in opposite directions).
    for g, w, label in ((g_recv1, w_recv1, "layer 1 rows"), (g_recv2, w_recv2, "layer 2 rows")):
        for i, (a, b) in enumerate(zip(g, w)):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8),
                                          err_msg=f"{label}, field {i}")
    np.testing.assert_array_equal(g_routed.view(np.uint16), w_routed.view(np.uint16), err_msg="routed vs xla")
    ulp = bf16_ulp_diff(g_normed, w_normed)
    print(f"{shape} T={tokens}: rows and routed bit-exact; normed equal {np.mean(ulp == 0):.4f}, max {ulp.max()} ulp")
    assert ulp.max() <= 2
    check.compare_rank(got[0], model, 0)
