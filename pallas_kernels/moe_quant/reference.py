"""Pure-jnp twin of the grouped quantized-expert matmul: each format's per-matrix
dequantization (the same exact bf16 weights the kernel builds) applied per expert, then a
batched dot per tile in fp32. nvfp4's ``weight_scale_2`` multiplies the fp32 product, as in
the kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_block import reference as fp8_block
from pallas_kernels.mxfp8 import reference as mxfp8
from pallas_kernels.nvfp4 import reference as nvfp4

FORMATS = ("nvfp4", "mxfp8", "fp8_block")
_NUM_SCALES = {"nvfp4": 2, "mxfp8": 1, "fp8_block": 1}


def validate(x_rows, tile_expert, fmt, w, *scales) -> None:
    """ValueError naming the operand whose dtype or shape is wrong (checks expert 0's matrices
    with the per-format validators, then the stacking)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown expert format {fmt!r}; expected one of {FORMATS}")
    if len(scales) != _NUM_SCALES[fmt]:
        raise ValueError(f"{fmt} takes {_NUM_SCALES[fmt]} scale operand(s), got {len(scales)}")
    if w.ndim != 3:
        raise ValueError(f"w must be 3-D [E, N, K'] stacked experts, got shape {tuple(w.shape)}")
    e = w.shape[0]
    if any(s.ndim == 0 or s.shape[0] != e for s in scales):
        raise ValueError(f"scales {[tuple(s.shape) for s in scales]} do not stack the {e} experts of w")
    if fmt == "nvfp4" and scales[1].shape != (e,):
        raise ValueError(f"weight_scale_2 must be [E={e}] (one global scale an expert), got "
                         f"{list(scales[1].shape)}")
    if tile_expert.ndim != 1 or jnp.dtype(tile_expert.dtype) != jnp.dtype(jnp.int32):
        raise ValueError(f"tile_expert must be an int32 [T] array, got {tile_expert.dtype} "
                         f"{list(tile_expert.shape)}")
    t = tile_expert.shape[0]
    if x_rows.ndim != 2 or (x_rows.shape[0] % t if t else x_rows.shape[0]):
        raise ValueError(f"x_rows {tuple(x_rows.shape)} is not [T·bm, K] for {t} tiles")
    if fmt == "nvfp4":
        nvfp4.validate(x_rows, w[0], scales[0][0], scales[1][0])
    elif fmt == "mxfp8":
        mxfp8.validate(x_rows, w[0], scales[0][0])
    else:
        fp8_block.validate(x_rows, w[0], scales[0][0])


def check_tiles(x_rows, tile_expert, fmt, w) -> None:
    """The grouped matmul's own shape rules, the same for both backends (the kernel's tiling):
    tiles of 8-256 rows (a power of two), N a multiple of 64 (block FP8: 128) and K of the
    engine's smallest K step (MXFP8 64, NVFP4 128, block FP8 32; K is not padded)."""
    from pallas_kernels.mxfp8.wdequant import BN, MIN_STEP

    t = tile_expert.shape[0]
    bm = x_rows.shape[0] // t if t else 8
    n, k = w.shape[1], x_rows.shape[1]
    rows, step = (128 if fmt == "fp8_block" else BN), MIN_STEP.get(fmt, 32)
    if bm not in (8, 16, 32, 64, 128, 256):
        raise ValueError(f"x_rows holds row tiles of {bm} rows; expected 8, 16, 32, 64, 128 or 256")
    if n % rows:
        raise ValueError(f"grouped {fmt} experts need N % {rows} == 0, got w with N={n}")
    if k % step:
        raise ValueError(f"grouped {fmt} experts need K % {step} == 0 (K is not padded), got K={k}")


def expert_of_tile(tile_expert, expert_offset, num_experts):
    """Each tile's expert after ``expert_offset``, -1 (skipped) for an unused tile and for one
    whose expert falls outside the stacked ``num_experts``: both backends skip such tiles."""
    e = tile_expert + jnp.asarray(expert_offset, jnp.int32)
    return jnp.where((tile_expert >= 0) & (e >= 0) & (e < num_experts), e, -1).astype(jnp.int32)


def dequantize_experts(fmt, w, *scales):
    """[E, N, K] bf16 (nvfp4 without ``weight_scale_2``)."""
    if fmt == "nvfp4":
        return jax.vmap(nvfp4.dequantize_bf16)(w, scales[0])
    if fmt == "mxfp8":
        return jax.vmap(mxfp8.dequantize_bf16)(w, scales[0])
    return jax.vmap(fp8_block.dequantize_bf16)(w, scales[0])


def grouped_matmul_reference(x_rows, tile_expert, fmt, w, *scales, expert_offset=0, out_dtype=None):
    """x_rows [T·bm, K], tile_expert [T] -> [T·bm, N]; skipped tiles give zeros."""
    validate(x_rows, tile_expert, fmt, w, *scales)
    check_tiles(x_rows, tile_expert, fmt, w)
    out_dtype = out_dtype or x_rows.dtype
    t = tile_expert.shape[0]
    te = expert_of_tile(tile_expert, expert_offset, w.shape[0])
    e = jnp.maximum(te, 0)
    wt = dequantize_experts(fmt, w[e], *(s[e] for s in scales))                  # [T, N, K]
    xt = x_rows.reshape(t, -1, x_rows.shape[-1]).astype(jnp.bfloat16)
    y = jnp.einsum("tbk,tnk->tbn", xt, wt, preferred_element_type=jnp.float32)
    if fmt == "nvfp4":
        y = y * scales[1][e].astype(jnp.float32)[:, None, None]
    y = jnp.where((te >= 0)[:, None, None], y, 0.0)
    return y.reshape(x_rows.shape[0], -1).astype(out_dtype)
