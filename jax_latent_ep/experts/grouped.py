"""The grouped matmul of training and prefill sizes, `gmm`, with a custom VJP whose gradients are grouped matmuls too.

    y = gmm(x, w, group_sizes, impl="mosaic")   # y[p] = x[p] @ w[g(p)], bf16, FP32 accumulation

Rows `x[p]` are sorted by group: group `g` owns rows `sum(group_sizes[:g]) ..` (`Plan`'s pair order). Its
implementations (`GMM_IMPLEMENTATIONS`) share one numerics: bf16 operands, FP32 accumulation, each output rounded
once to bf16 (the gradient of `w` too, per group); rows past `sum(group_sizes)` are 0 in every output, whatever
the operands hold there. "xla" is `lax.ragged_dot_general` (any device: the reference); "wgmma" is the project's
kernels for Hopper (`kernels/grouped_matmul.py`: tiles of at most 128 rows of one group, listed by `tiles`, so the
work follows the rows; the weights' gradient a kernel of its own); "mosaic" is JAX's Pallas Mosaic GPU kernels
(a static grid of every possible tile): the forward and the rows' gradient one ragged matmul kernel, the weights'
gradient its transposed form. `jax.grad` through `gmm` runs the same implementation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_latent_ep.autodiff import _axes, _vary
from jax_latent_ep.experts.formats import E2M1_VALUES, BlockScaledOutIn
from jax_latent_ep.experts.kernel import _expected_active, _kernel_row_sums, _split_sum, expected_active
from jax_latent_ep.experts.planning import chunks, work_list
from jax_latent_ep.experts.xla import _glu, _pair_row_sums, _row_sums
from jax_latent_ep.kernels import abi
from jax_latent_ep.numerics import mxfp8_quantize

GMM_IMPLEMENTATIONS = ("xla", "mosaic", "wgmma")
#: Implementations that run on Hopper GPUs only.
HOPPER_ONLY = ("mosaic", "wgmma")
#: The Mosaic kernels' tiles (rows, columns, contraction) and pipeline depth. `K` and `N` are each a contraction
#: or an output side in one of the three products: multiples of `MOSAIC_SIDE`.
MOSAIC_BLOCK_M, MOSAIC_BLOCK_N, MOSAIC_BLOCK_K, MOSAIC_STEPS = 128, 128, 64, 4
MOSAIC_SIDE = max(MOSAIC_BLOCK_M, MOSAIC_BLOCK_N, MOSAIC_BLOCK_K)
#: "wgmma"'s stage on separate gate and up weights: gate, up and the SwiGLU in one launch (`_wgmma_swiglu`); False:
#: two launches and XLA's SwiGLU (the same bits but the silu's last ulps).
WGMMA_SWIGLU = True


def check_gmm(x, w, group_sizes, impl: str, *, transpose_w: bool = False):
    """Raises ValueError naming the bad value unless `x` is bf16 `[M, K]`, `w` bf16 `[G, K, N]` (`[G, N, K]` with
    `transpose_w`), `group_sizes` int32 `[G]`, `impl` one of `GMM_IMPLEMENTATIONS`, and for the Hopper kernels
    (`HOPPER_ONLY`) the sides multiples of their tiles and a process of Hopper GPUs."""
    if impl not in GMM_IMPLEMENTATIONS:
        raise ValueError(f"gmm: impl={impl!r} must be one of {GMM_IMPLEMENTATIONS}")
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16 or x.ndim != 2 or w.ndim != 3:
        raise ValueError(f"gmm: x must be bfloat16[M, K] and w bfloat16[G, K, N], got "
                         f"{jnp.dtype(x.dtype).name}{list(x.shape)} and {jnp.dtype(w.dtype).name}{list(w.shape)}")
    k, n = (w.shape[2], w.shape[1]) if transpose_w else (w.shape[1], w.shape[2])
    if x.shape[1] != k:
        raise ValueError(f"gmm: x's K={x.shape[1]} must match w {list(w.shape)}'s K={k}")
    if group_sizes.dtype != jnp.int32 or tuple(group_sizes.shape) != (w.shape[0],):
        raise ValueError(f"gmm: group_sizes must be int32[{w.shape[0]}] (one per group of w), got "
                         f"{jnp.dtype(group_sizes.dtype).name}{list(group_sizes.shape)}")
    if impl not in HOPPER_ONLY:
        return
    if k % MOSAIC_SIDE or n % MOSAIC_SIDE:
        raise ValueError(f"gmm(impl={impl!r}): K={k} and N={n} must be multiples of {MOSAIC_SIDE} (the kernels' "
                         "tiles, forward and gradients; impl='xla' takes any)")
    _require_hopper(f"gmm(impl={impl!r})", "impl='xla' (experts impl 'gmm' or 'scan')")


def _require_hopper(call: str, instead: str):
    """Raises ValueError unless every device of this process is a Hopper GPU, naming `call` and what to use
    `instead`."""
    kinds = {getattr(d, "compute_capability", d.platform) for d in jax.local_devices()}
    if not kinds or any(not str(c).startswith("9.") for c in kinds):
        raise ValueError(f"{call} runs on Hopper GPUs (compute capability 9.x); this process has "
                         f"{sorted(map(str, kinds))}: use {instead}")


def gmm(x, w, group_sizes, *, impl: str = "xla", transpose_w: bool = False):
    """Grouped matmul: bf16 `[M, N]`, `y[p] = bf16(x[p] @ w[g(p)])` (FP32 accumulation), 0 in rows past
    `sum(group_sizes)`.

    Args:
      x: bf16 `[M, K]`, rows sorted by group (rows past `sum(group_sizes)` are ignored).
      w: bf16 `[G, K, N]` (`[G, N, K]` with `transpose_w`: multiplied by each group's transpose).
      group_sizes: int32 `[G]`, rows of each group, `sum <= M`.
      impl: one of `GMM_IMPLEMENTATIONS`; "wgmma" and "mosaic" (`HOPPER_ONLY`) run on Hopper GPUs and need
        `K`, `N` multiples of `MOSAIC_SIDE` (128).
    """
    check_gmm(x, w, group_sizes, impl, transpose_w=transpose_w)
    # Inside a shard_map the operands enter the custom VJP varying over the same axes (its cotangents must match
    # its inputs' types); the casts' own transposes sum a less-varying operand's gradient.
    axes = _axes(x, w, group_sizes)
    x, w, group_sizes = (_vary(a, axes) for a in (x, w, group_sizes))
    return _gmm(impl, transpose_w, x, w, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _gmm(impl, transpose_w, x, w, group_sizes):
    return _FORWARD[impl](x, w, group_sizes, transpose_w)


def _gmm_fwd(impl, transpose_w, x, w, group_sizes):
    return _gmm(impl, transpose_w, x, w, group_sizes), (x, w, group_sizes)


def _gmm_bwd(impl, transpose_w, res, dy):
    x, w, group_sizes = res
    dy = _zero_tail(dy.astype(jnp.bfloat16), group_sizes)
    dx = _FORWARD[impl](dy, w, group_sizes, not transpose_w)  # dx[p] = dy[p] @ w[g]^T
    dw = _WEIGHTS_GRAD[impl](dy, x, group_sizes) if transpose_w else _WEIGHTS_GRAD[impl](x, dy, group_sizes)
    return dx, dw.astype(w.dtype), None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def _zero_tail(y, group_sizes):
    """`y` with its rows past `sum(group_sizes)` set to 0."""
    live = jnp.arange(y.shape[0], dtype=jnp.int32)[:, None] < jnp.sum(group_sizes)
    return jnp.where(live, y, jnp.zeros((), y.dtype))


def _xla_forward(x, w, group_sizes, transpose_w, tail=True):
    dims = (([1], [2]), ([], [])) if transpose_w else (([1], [1]), ([], []))
    nums = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=dims, lhs_ragged_dimensions=[0],
                                         rhs_group_dimensions=[0])
    return lax.ragged_dot_general(x, w, group_sizes, nums, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def _xla_weights_grad(x, dy, group_sizes):
    """bf16 `[G, K, N]`: `x_g^T @ dy_g` per group (FP32 accumulation; 0 for an empty group)."""
    nums = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
                                         rhs_group_dimensions=[])
    return lax.ragged_dot_general(x, dy, group_sizes, nums, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def _padded_rows(a):
    """`a` `[M, ..]` with zero rows up to a multiple of `MOSAIC_BLOCK_M` (the kernels' TMA tiles of rows)."""
    pad = -a.shape[0] % MOSAIC_BLOCK_M
    return jnp.pad(a, ((0, pad), (0, 0))) if pad else a


def _mosaic_forward(x, w, group_sizes, transpose_w, tail=True):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # Hopper only: imported where it runs

    y = ragged_dot_mgpu.ragged_dot(_padded_rows(x), w, group_sizes=group_sizes, block_m=MOSAIC_BLOCK_M,
                                   block_n=MOSAIC_BLOCK_N, block_k=MOSAIC_BLOCK_K, max_concurrent_steps=MOSAIC_STEPS,
                                   grid_block_n=1, transpose_rhs=transpose_w)
    y = _vary(y, _axes(x, w))[: x.shape[0]]  # a kernel's result carries no shard_map type: its operands'
    return _zero_tail(y, group_sizes) if tail else y  # the kernel leaves rows past the groups unwritten


def _mosaic_weights_grad(x, dy, group_sizes):
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    dw = transposed_ragged_dot_mgpu.transposed_ragged_dot(
        _padded_rows(x), _padded_rows(dy), group_sizes=group_sizes, block_m=MOSAIC_BLOCK_M, block_n=MOSAIC_BLOCK_N,
        block_k=MOSAIC_BLOCK_K, max_concurrent_steps=MOSAIC_STEPS, grid_block_n=1)
    return _vary(dw, _axes(x, dy))


def tiles(group_sizes, num_rows: int):
    """int32 `[W, 4]`: the wgmma kernel's tile list, `planning.chunks` of at most `MATMUL_TILE_M` rows of one group
    (the grouped GEMM's work list in larger chunks)."""
    from jax_latent_ep.kernels.abi import MATMUL_TILE_M

    return chunks(group_sizes, num_rows, MATMUL_TILE_M)


def _wgmma_forward(x, w, group_sizes, transpose_w, tail=True, rows=None):
    """`gmm` on the grouped matmul kernel; with `rows` int32 `[P]` pair p reads row `rows[p]` of `x` (no gather)."""
    from jax_latent_ep.runtime import ffi

    ffi.load_expert_kernels({d for d in jax.local_devices() if d.platform == "gpu"})
    pairs = x.shape[0] if rows is None else rows.shape[0]
    y = ffi.grouped_matmul_call(x, w, tiles(group_sizes, pairs), w_k_major=transpose_w, x_rows=rows)
    y = _vary(y, _axes(x, w) if rows is None else _axes(x, w, rows))  # a custom call's result: its operands' type
    return _zero_tail(y, group_sizes) if tail else y  # the kernel writes the tiles' rows only


def _wgmma_swiglu(xb, w_gate, w_up, group_sizes, rows, residual):
    """`(h, gate_up)`: the SwiGLU's `h = bf16(silu(gate) * up)` `[P, I]` of the bf16 `gate = x @ w_gate`, `up = x @
    w_up` in one launch (pair p reads row `rows[p]` of `xb`), and with `residual` the bf16 gate and up (`[P, 2I]`,
    `ffi.split_gate_up`; else None); the rows past the groups unspecified."""
    from jax_latent_ep.runtime import ffi

    ffi.load_expert_kernels({d for d in jax.local_devices() if d.platform == "gpu"})
    out = ffi.grouped_matmul_call(xb, w_gate, tiles(group_sizes, rows.shape[0]), w_k_major=False, x_rows=rows,
                                  w_up=w_up, residual=residual)
    axes = _axes(xb, w_gate, w_up, rows)  # a custom call's results: its operands' type
    h, gate_up = out if residual else (out, None)
    return _vary(h, axes), None if gate_up is None else _vary(gate_up, axes)


def _wgmma_weights_grad(x, dy, group_sizes):
    from jax_latent_ep.runtime import ffi

    groups = jnp.stack([jnp.cumsum(group_sizes) - group_sizes, group_sizes], axis=1).astype(jnp.int32)
    return _vary(ffi.grouped_matmul_wgrad_call(x, dy, groups), _axes(x, dy))


#: name -> fn(x, w, group_sizes, transpose_w, tail=True): `gmm`'s product; `tail` False leaves the rows past the
#: groups unspecified (one pass less, for consumers that never read them).
_FORWARD = {"xla": _xla_forward, "mosaic": _mosaic_forward, "wgmma": _wgmma_forward}
_WEIGHTS_GRAD = {"xla": _xla_weights_grad, "mosaic": _mosaic_weights_grad, "wgmma": _wgmma_weights_grad}


# ---------------------------------------------------------------------------------------------------------
# FP8: MXFP8 rows times FP8 block-scaled weights stored `[out, in]`, each 32-deep block promoted with its scales.

#: `gmm_fp8`'s implementations: "xla" (any device, the reference), "wgmma" (`kernels/grouped_matmul_fp8.py`,
#: Hopper: the weights the 64-row side of `wgmma` e4m3, a tile of at most 32 pairs the narrow one).
GMM_FP8_IMPLEMENTATIONS = ("xla", "wgmma")


def check_gmm_fp8(x, x_scale, w, w_scale, group_sizes, impl: str):
    """Raises ValueError naming the bad value unless `x` is float8_e4m3fn `[M, K]`, `x_scale` uint8 `[M, K / 32]`,
    `w` float8_e4m3fn `[G, N, K]`, `w_scale` float32 `[G, N / 128, K / 128]`, `group_sizes` int32 `[G]`, `K` and
    `N` multiples of 128, `impl` one of `GMM_FP8_IMPLEMENTATIONS` ("wgmma": a process of Hopper GPUs)."""
    if impl not in GMM_FP8_IMPLEMENTATIONS:
        raise ValueError(f"gmm_fp8: impl={impl!r} must be one of {GMM_FP8_IMPLEMENTATIONS}")
    e4m3 = jnp.dtype(jnp.float8_e4m3fn)
    if x.dtype != e4m3 or w.dtype != e4m3 or x.ndim != 2 or w.ndim != 3:
        raise ValueError(f"gmm_fp8: x must be float8_e4m3fn[M, K] and w float8_e4m3fn[G, N, K], got "
                         f"{jnp.dtype(x.dtype).name}{list(x.shape)} and {jnp.dtype(w.dtype).name}{list(w.shape)}")
    (m, k), (g, n, wk) = x.shape, w.shape
    if wk != k or k % 128 or n % 128:
        raise ValueError(f"gmm_fp8: x [M, K={k}] and w [G, N={n}, K={wk}] need the same K, K and N multiples of 128")
    for name, a, dtype, shape in (("x_scale", x_scale, jnp.uint8, (m, k // 32)),
                                  ("w_scale", w_scale, jnp.float32, (g, n // 128, k // 128)),
                                  ("group_sizes", group_sizes, jnp.int32, (g,))):
        if a.dtype != jnp.dtype(dtype) or tuple(a.shape) != shape:
            raise ValueError(f"gmm_fp8: {name} must be {jnp.dtype(dtype).name}{list(shape)}, got "
                             f"{jnp.dtype(a.dtype).name}{list(a.shape)}")
    if impl == "wgmma":
        _require_hopper("gmm_fp8(impl='wgmma')", "impl='xla'")


def gmm_fp8(x, x_scale, w, w_scale, group_sizes, *, impl: str = "xla", expected_groups: int | None = None):
    """FP8 grouped matmul: FP32 `[M, N]`, `y[p] = sum over the 32-deep blocks b of (x[p, b] . w[g(p), :, b]) *
    2^(x_scale[p, b] - 127) * w_scale[g(p), :, b / 4]` (`x_scale` 0: the block adds 0), the blocks in ascending
    order, each added once; 0 in rows past `sum(group_sizes)` ("xla"; "wgmma" leaves them unspecified). The
    numerics of `docs/experts.md`'s FP8 weights: each block's products exact, summed in FP32 ("wgmma" may split
    the contraction, `narrow_splits`: each split's blocks in order, the splits' partials summed in split order).

    Args:
      x: float8_e4m3fn `[M, K]`, MXFP8 elements of rows sorted by group (`numerics.mxfp8_quantize`).
      x_scale: uint8 `[M, K / 32]`, their E8M0 scales.
      w: float8_e4m3fn `[G, N, K]`, each group's weight `[out, in]` as checkpoints store it (`BlockScaled`'s
        values transposed).
      w_scale: float32 `[G, N / 128, K / 128]`, a scale per 128 x 128 block.
      group_sizes: int32 `[G]`, rows of each group, `sum <= M`.
      impl: one of `GMM_FP8_IMPLEMENTATIONS`.
      expected_groups: the non-empty groups the caller expects ("wgmma" splits the contraction for them,
        `narrow_splits`); None: `min(G, M)`.
    """
    check_gmm_fp8(x, x_scale, w, w_scale, group_sizes, impl)
    if impl == "wgmma":
        return _wgmma_narrow("fp8", x, x_scale, w, w_scale, group_sizes, expected_groups)
    return _xla_gmm_fp8(x, x_scale, w, w_scale, group_sizes)


#: Units (split, tile, 128 columns) the FP8 / MXFP4 kernels aim for at least: two resident CTAs on each of an H200's
#: 132 SMs, one round.
NARROW_MIN_UNITS = 264
#: The FP8 / MXFP4 stage's tile holds at least this many times the pairs it expects an active expert (`tile_pairs`):
#: an expert past its tile streams its weights once more per tile, rare below half the tile's pairs.
TILE_HEADROOM = 2.0
#: Pairs an active expert expects from which FP8 weights take the prefill kernel's tiles
#: (`abi.MATMUL_FP8_WIDE_TILE_PAIRS`, `kernels/grouped_matmul_fp8_wide.py`): past two decode tiles an expert, its
#: weights would stream through each again.
FP8_WIDE_FROM = 64


def narrow_splits(groups: int, n: int, k: int) -> tuple[int, int]:
    """(splits, k_per_split) of the FP8 / MXFP4 kernel over `groups` non-empty groups of a `[N, K]` weight: the
    contraction split until about `NARROW_MIN_UNITS` units have work, each split at least 4 stages of 128."""
    steps = k // 128
    splits = max(1, min(-(-NARROW_MIN_UNITS // max(1, groups * (n // 128))), steps // 4))
    per = -(-steps // splits)
    return -(-steps // per), per * 128


def tile_pairs(expected_pairs: float, active: int, fp8: bool = False) -> int:
    """The FP8 / MXFP4 kernels' tile for `expected_pairs` over `active` experts: with `fp8` (FP8 weights) and at
    least `FP8_WIDE_FROM` pairs an expert, `abi.MATMUL_FP8_WIDE_TILE_PAIRS` (the prefill kernel); else the smallest
    of `abi.MATMUL_FP8_SMALL_TILE_PAIRS` of at least `TILE_HEADROOM` times the pairs an expert expects, else
    `abi.MATMUL_FP8_TILE_PAIRS` (a smaller tile: less MMA, promotion and copying a stage, the same bits)."""
    if fp8 and expected_pairs >= FP8_WIDE_FROM * max(1, active):
        return abi.MATMUL_FP8_WIDE_TILE_PAIRS
    fits = [p for p in abi.MATMUL_FP8_SMALL_TILE_PAIRS if p >= TILE_HEADROOM * expected_pairs / max(1, active)]
    return min(fits) if fits else abi.MATMUL_FP8_TILE_PAIRS


def narrow_tile(num_local_experts: int, capacity: int, expected_pairs: int | None, fp8: bool = False) -> int:
    """The tile (`tile_pairs`) of the FP8 (`fp8`) / MXFP4 stage (`swiglu_rows_fp8`) on a plan of `capacity` pairs
    over `num_local_experts` experts, `expected_pairs` as `swiglu`'s: what `expert_stage` asks the plan's list in."""
    return tile_pairs(expected_pairs or capacity, expected_active(num_local_experts, capacity, expected_pairs), fp8)


def _wgmma_narrow(kind, x, x_scale, w, w_scale, group_sizes, expected_groups=None):
    """The FP8 (`kind` "fp8") or MXFP4 ("mxfp4") grouped matmul kernel over tiles of at most
    `MATMUL_FP8_TILE_PAIRS` pairs of one group, or for FP8 at `FP8_WIDE_FROM` rows a group and more, of
    `MATMUL_FP8_WIDE_TILE_PAIRS` (the rows past the groups unspecified), its split partials summed in split
    order."""
    groups = min(group_sizes.shape[0], x.shape[0]) if expected_groups is None else expected_groups
    tile = tile_pairs(x.shape[0], groups, kind == "fp8")
    tile = tile if tile == abi.MATMUL_FP8_WIDE_TILE_PAIRS else None
    return _vary(_split_sum(_narrow_parts(kind, x, x_scale, w, w_scale, group_sizes, expected_groups, tile=tile)),
                 _axes(x, w))


def _narrow_parts(kind, x, x_scale, w, w_scale, group_sizes, expected_groups=None, rows=None, second=None,
                  tile=None, tiles=None):
    """`_wgmma_narrow`'s FP32 split partials `[S, M, N]` (typed as its operands); with `rows` int32 `[M]` pair p
    reads row `rows[p]` of `x` (no gather); with `second = (w2, w2_scale)` `[S, M, 2N]`, `w`'s columns then
    `w2`'s, one launch; `tile`: the kernel of tiles of that many pairs (`tile_pairs`; the same bits), None: 32;
    `tiles`: their list, `chunks(group_sizes, M, tile)`, where the caller has it (None: built here)."""
    from jax_latent_ep.runtime import ffi

    ffi.load_expert_kernels({d for d in jax.local_devices() if d.platform == "gpu"})
    pairs = x.shape[0] if rows is None else rows.shape[0]
    tile = tile or abi.MATMUL_FP8_TILE_PAIRS
    tiles = chunks(group_sizes, pairs, tile) if tiles is None else tiles
    groups = min(group_sizes.shape[0], pairs) if expected_groups is None else expected_groups
    splits, per = narrow_splits(groups, w.shape[1] * (1 if second is None else 2), x.shape[1])
    call = ffi.grouped_matmul_fp8_call if kind == "fp8" else ffi.grouped_matmul_mxfp4_call
    w2, w2_scale = (None, None) if second is None else second
    parts = call(x, x_scale, w, w_scale, tiles, splits=splits, k_per_split=per, x_rows=rows, w_second=w2,
                 w_second_scale=w2_scale, tile_pairs=tile)
    return _vary(parts, _axes(x, w) if rows is None else _axes(x, w, rows))


def _xla_gmm_fp8(x, x_scale, w, w_scale, group_sizes):
    """`gmm_fp8` in XLA: a loop over the 32-deep blocks, each a `ragged_dot` of exact FP32 operands (HIGHEST: no
    TF32 on GPUs) times its pairs' scales, added to the FP32 sum."""
    m, k = x.shape
    n = w.shape[1]
    group = jnp.minimum(jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(m), side="right",
                                         method="compare_all"), group_sizes.shape[0] - 1)
    xf, wf = x.astype(jnp.float32), w.astype(jnp.float32)
    nums = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
                                         rhs_group_dimensions=[0])
    x_pow = lax.bitcast_convert_type(x_scale.astype(jnp.uint32) << 23, jnp.float32)  # 2^(s - 127); 0 for s = 0

    def block(b, acc):
        part = lax.ragged_dot_general(lax.dynamic_slice_in_dim(xf, b * 32, 32, 1),
                                      lax.dynamic_slice_in_dim(wf, b * 32, 32, 2), group_sizes, nums,
                                      precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        ws = jnp.repeat(lax.dynamic_index_in_dim(w_scale, b // 4, 2, keepdims=False)[group], 128, axis=1)  # [M, N]
        return acc + part * (lax.dynamic_index_in_dim(x_pow, b, 1) * ws)

    zero = _vary(jnp.zeros((m, n), jnp.float32), _axes(x, x_scale, w, w_scale, group_sizes))  # the body's type
    acc = lax.fori_loop(0, k // 32, block, zero)
    return jnp.where(jnp.arange(m)[:, None] < jnp.sum(group_sizes), acc, 0.0)


def check_gmm_mxfp4(x, x_scale, w, w_scale, group_sizes, impl: str):
    """Raises ValueError naming the bad value unless `x`, `x_scale`, `group_sizes` and `impl` are as `check_gmm_fp8`
    asks and `w` is uint8 `[G, N, K / 2]` (e2m1 codes, `experts.MXFP4.values`), `w_scale` uint8 `[G, N, K / 32]`."""
    if tuple(w.shape[:1]) != tuple(group_sizes.shape) or w.dtype != jnp.uint8 or w.ndim != 3:
        raise ValueError(f"gmm_mxfp4: w must be uint8[G, N, K / 2] (G={group_sizes.shape[0]}), got "
                         f"{jnp.dtype(w.dtype).name}{list(w.shape)}")
    g, n, half = w.shape
    stand_in = jax.ShapeDtypeStruct((g, n, 2 * half), jnp.float8_e4m3fn)
    check_gmm_fp8(x, x_scale, stand_in, jax.ShapeDtypeStruct((g, n // 128, 2 * half // 128), jnp.float32),
                  group_sizes, impl)
    if w_scale.dtype != jnp.uint8 or tuple(w_scale.shape) != (g, n, 2 * half // 32):
        raise ValueError(f"gmm_mxfp4: w_scale must be uint8{[g, n, 2 * half // 32]}, got "
                         f"{jnp.dtype(w_scale.dtype).name}{list(w_scale.shape)}")


def gmm_mxfp4(x, x_scale, w, w_scale, group_sizes, *, impl: str = "xla", expected_groups: int | None = None):
    """`gmm_fp8` on MXFP4 weights (`experts.MXFP4`'s `values`, `scale`: `[out, in]` e2m1 codes two a byte, the even
    input in the low nibble, an E8M0 scale per 32 inputs): FP32 `[M, N]`, `y[p] = sum over the 32-deep blocks b of
    (x[p, b] . e2m1(w[g(p), :, b])) * 2^(x_scale[p, b] - 127) * 2^(w_scale[g(p), :, b] - 127)`, the blocks ascending,
    each added once (either scale code 0: the block adds 0). "wgmma" widens the codes to e4m3 (exact) and multiplies
    on the FP8 tensor cores (`kernels/grouped_matmul_fp8.py`), its contraction split as `gmm_fp8`'s."""
    check_gmm_mxfp4(x, x_scale, w, w_scale, group_sizes, impl)
    if impl == "wgmma":
        return _wgmma_narrow("mxfp4", x, x_scale, w, w_scale, group_sizes, expected_groups)
    table = jnp.asarray(E2M1_VALUES, jnp.float32)
    values = jnp.stack([table[w & 15], table[w >> 4]], axis=-1).reshape(*w.shape[:2], -1)  # [G, N, K]
    # The E8M0 scale folded in per 32-block: exact (a power of two times a value of 2 significant bits).
    w_pow = lax.bitcast_convert_type(w_scale.astype(jnp.uint32) << 23, jnp.float32)
    blocks = values.reshape(*w.shape[:2], -1, 32) * w_pow[..., None]
    ones = jnp.ones((w.shape[0], w.shape[1] // 128, 2 * w.shape[2] // 128), jnp.float32)
    return _xla_gmm_fp8(x, x_scale, blocks.reshape(values.shape), ones, group_sizes)


def swiglu_rows_fp8(pl, xb, mx, w_gate, w_up, w_down, impl: str, out_dtype, kernel_row_sums: bool = False,
                    expected_pairs: int | None = None):
    """The expert stage on `[out, in]` FP8 weights (`BlockScaledOutIn`) with `gmm_fp8`, or on MXFP4 weights with
    `gmm_mxfp4` ("xla" or "wgmma"): gate and up on the MXFP8 rows `mx = (x, sf)` the bf16 `xb` dequantizes
    (quantized from `xb` when None: the same rows), `h = bf16(silu(gate) * up)` rounded to MXFP8, down, and each
    row's FP32 sum of its pairs (`_row_sums`; on "wgmma" with `kernel_row_sums` the row-sum kernel, the same
    bits); the numerics of `docs/experts.md`'s FP8 weights. "wgmma" computes `h` and its MXFP8 in one kernel over
    the pairs used (`kernels/swiglu_mxfp8.py`: its silu within FP32 ulps of XLA's; on the prefill tiles of FP8
    weights with gate and up apart, in the gate and up kernel's epilogue, the same bits); its contraction splits are
    chosen for `min(J, C, expected_pairs)` active experts (`kernel._expected_active`), its tiles by the pairs
    they expect each (`tile_pairs`). No VJP."""
    x, sf = mxfp8_quantize(xb) if mx is None else mx
    gs = pl.group_sizes
    expected = _expected_active(pl, expected_pairs)
    tile = narrow_tile(pl.num_local_experts, pl.capacity, expected_pairs, isinstance(w_down, BlockScaledOutIn))
    kind = "fp8" if isinstance(w_down, BlockScaledOutIn) else "mxfp4"
    if impl == "wgmma":
        from jax_latent_ep.runtime import ffi

        tiles = work_list(pl, tile)  # the plan kernel's where `expert_stage` asked it for this tile
        if tile == abi.MATMUL_FP8_WIDE_TILE_PAIRS and w_up is not None:  # prefill: gate, up, h's MXFP8: one launch
            hq, hs = (_vary(a, _axes(x, w_gate.values, pl.row)) for a in ffi.grouped_matmul_fp8_glu_call(
                x, sf, w_gate.values, w_gate.scale, w_up.values, w_up.scale, tiles, x_rows=pl.row))
        else:  # gate and up in one launch on the receive rows (each pair reads its row: no gather), `[S, C, 2I]`
            second = None if w_up is None else (w_up.values, w_up.scale)
            gate_up = _narrow_parts(kind, x, sf, w_gate.values, w_gate.scale, gs, expected, rows=pl.row,
                                    second=second, tile=tile, tiles=tiles)
            count = jnp.reshape(pl.count, (1,)).astype(jnp.int32)
            hq, hs = (_vary(a, _axes(gate_up, count)) for a in ffi.swiglu_mxfp8_call(gate_up, None, count))
        down = _narrow_parts(kind, hq, hs, w_down.values, w_down.scale, gs, expected, tile=tile, tiles=tiles)
        return _kernel_row_sums(pl, down) if kernel_row_sums else _row_sums(pl, _split_sum(down), out_dtype)

    xq, xs = x[pl.row], sf[pl.row]

    def fp8(q, s, w):
        mm = gmm_fp8 if kind == "fp8" else gmm_mxfp4
        return mm(q, s, w.values, w.scale, gs, impl=impl, expected_groups=expected)

    gate = fp8(xq, xs, w_gate)
    h = _glu(gate, None if w_up is None else fp8(xq, xs, w_up), w_down.shape[1])
    return _row_sums(pl, fp8(*mxfp8_quantize(h), w_down), out_dtype)


def swiglu_pairs(pl, xb, w_gate, w_up, w_down, impl: str):
    """The expert stage's per-pair FP32 outputs `[C, L]` on `gmm`'s implementation `impl` (the "gmm", "mosaic" and
    "wgmma" entries of `experts.IMPLEMENTATIONS`): `swiglu_rows`' forward before its row sums, the unused pairs'
    rows unspecified."""
    y, _ = _stage_forward(impl, xb, w_gate, w_up, w_down, pl.weight, pl.row, pl.group_sizes, pl.count, pl.row_pairs,
                          False)
    return y.astype(jnp.float32)


def swiglu_rows(pl, xb, w_gate, w_up, w_down, impl: str, out_dtype):
    """`_row_sums(pl, swiglu_pairs(...), out_dtype)` with a VJP of its own: bf16 `gate`, `up` (one product when
    fused), `h = bf16(silu(gate) * up)`, each pair's down product rounded to bf16; and a backward of
    gathers where autodiff's would scatter (each pair belongs to one row, each row names its pairs in
    `pl.row_pairs`):

    - the pairs' cotangent `dy[p] = bf16(weight[p] * dout[row[p]])`, the routing weight's `<y[p], dout[row[p]]>`;
    - down's, SwiGLU's, gate's and up's gradients as in `gmm`'s VJP (`dh`, `d gate`, `d up` rounded to bf16 once);
    - the rows' `dxb[r] = bf16(sum_m (dx_gate + dx_up)[row_pairs[r, m]])`, FP32 in slot order, rounded once.

    Arguments as `swiglu_pairs`; `out_dtype` that of `experts.swiglu`."""
    for w, a_cols in ((w_gate, xb.shape[1]), (w_up, xb.shape[1]), (w_down, w_down.shape[1])):
        if w is not None:
            check_gmm(jax.ShapeDtypeStruct((pl.capacity, a_cols), xb.dtype), w, pl.group_sizes, impl)
    # Inside a shard_map every operand enters varying over the same axes (as `gmm`'s).
    ops = (xb, w_gate, w_up, w_down, pl.weight, pl.row, pl.group_sizes, pl.count, pl.row_pairs)
    axes = _axes(*(a for a in ops if a is not None))
    ops = tuple(None if a is None else _vary(a, axes) for a in ops)
    return _stage(impl, jnp.dtype(out_dtype), *ops)


def _stage_forward(impl, xb, w_gate, w_up, w_down, weight, row, group_sizes, count, row_pairs, residual=True):
    """(per-pair bf16 down outputs, residuals `(gate, up, h)`; `residual` False: None for gate and up where the
    forward need not keep them) of `swiglu_rows`."""
    # The products' rows past the pairs are left unspecified (no zeroing pass): the row sums never read them,
    # and what the weights' gradients multiply is 0 there (`h` here, the cotangents in `_stage_bwd`).
    if impl == "wgmma" and w_up is not None and WGMMA_SWIGLU:  # one launch; the kernels read tiles' rows only
        h, gate_up = _wgmma_swiglu(xb, w_gate, w_up, group_sizes, row, residual)
        from jax_latent_ep.runtime.ffi import split_gate_up

        g, u = (None, None) if gate_up is None else split_gate_up(gate_up)
        return _FORWARD[impl](h, w_down, group_sizes, False, False), (g, u, h)
    if impl == "wgmma":  # each pair reads its receive row (no gather)
        g, u = (None if w is None else _wgmma_forward(xb, w, group_sizes, False, False, rows=row)
                for w in (w_gate, w_up))
    else:
        xp = xb[row]
        g = _FORWARD[impl](xp, w_gate, group_sizes, False, False)
        u = None if w_up is None else _FORWARD[impl](xp, w_up, group_sizes, False, False)
    h = _glu(g.astype(jnp.float32), None if u is None else u.astype(jnp.float32), w_down.shape[1])
    h = jnp.where(_live(row, count), h, jnp.zeros((), h.dtype))
    return _FORWARD[impl](h, w_down, group_sizes, False, False), (g, u, h)


def _live(row, count):
    """bool `[C, 1]`: the used pairs."""
    return (jnp.arange(row.shape[0], dtype=jnp.int32) < count)[:, None]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _stage(impl, out_dtype, xb, w_gate, w_up, w_down, weight, row, group_sizes, count, row_pairs):
    y, _ = _stage_forward(impl, xb, w_gate, w_up, w_down, weight, row, group_sizes, count, row_pairs, False)
    return _pair_row_sums(y, weight, row_pairs, count, out_dtype)


def _stage_fwd(impl, out_dtype, xb, w_gate, w_up, w_down, weight, row, group_sizes, count, row_pairs):
    y, (g, u, h) = _stage_forward(impl, xb, w_gate, w_up, w_down, weight, row, group_sizes, count, row_pairs)
    res = (xb, w_gate, w_up, w_down, weight, row, group_sizes, count, row_pairs, y, g, u, h)
    return _pair_row_sums(y, weight, row_pairs, count, out_dtype), res


def _stage_bwd(impl, out_dtype, res, dout):
    xb, w_gate, w_up, w_down, weight, row, group_sizes, count, row_pairs, y, g, u, h = res
    live = _live(row, count)
    d_rows = dout[row].astype(jnp.float32)  # [C, L]: each pair's row's cotangent (a gather, no scatter)
    dy = jnp.where(live, weight[:, None] * d_rows, 0.0).astype(jnp.bfloat16)
    dweight = jnp.where(live[:, 0], jnp.sum(y.astype(jnp.float32) * d_rows, axis=1), 0.0)
    dh = _FORWARD[impl](dy, w_down, group_sizes, True, False)
    dw_down = _WEIGHTS_GRAD[impl](h, dy, group_sizes).astype(w_down.dtype)
    inter = w_down.shape[1]
    gate, up = (g, u) if u is not None else (g[:, :inter], g[:, inter:])
    _, glu_vjp = jax.vjp(lambda a, b: jax.nn.silu(a) * b, gate.astype(jnp.float32), up.astype(jnp.float32))
    d_gate, d_up = (jnp.where(live, d, 0.0).astype(jnp.bfloat16) for d in glu_vjp(dh.astype(jnp.float32)))
    xp = xb[row]
    if u is None:
        d_g = jnp.concatenate([d_gate, d_up], axis=1)
        dx = [_FORWARD[impl](d_g, w_gate, group_sizes, True, False)]
        dw_gate, dw_up = _WEIGHTS_GRAD[impl](xp, d_g, group_sizes).astype(w_gate.dtype), None
    else:
        dx = [_FORWARD[impl](d, w, group_sizes, True, False) for d, w in ((d_gate, w_gate), (d_up, w_up))]
        dw_gate = _WEIGHTS_GRAD[impl](xp, d_gate, group_sizes).astype(w_gate.dtype)
        dw_up = _WEIGHTS_GRAD[impl](xp, d_up, group_sizes).astype(w_up.dtype)
    dx_pairs = dx[0].astype(jnp.float32) if len(dx) == 1 else dx[0].astype(jnp.float32) + dx[1].astype(jnp.float32)
    dxb = _pair_row_sums(dx_pairs, None, row_pairs, count, xb.dtype)
    return dxb, dw_gate, dw_up, dw_down, dweight, None, None, None, None


_stage.defvjp(_stage_fwd, _stage_bwd)
