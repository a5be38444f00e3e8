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
    if any(s.shape[0] != e for s in scales):
        raise ValueError(f"scales {[tuple(s.shape) for s in scales]} do not stack the {e} experts of w")
    if x_rows.ndim != 2 or x_rows.shape[0] % tile_expert.shape[0]:
        raise ValueError(f"x_rows {tuple(x_rows.shape)} is not [T·bm, K] for {tile_expert.shape[0]} tiles")
    if jnp.dtype(tile_expert.dtype) != jnp.dtype(jnp.int32):
        raise ValueError(f"tile_expert must be int32, got {tile_expert.dtype}")
    if fmt == "nvfp4":
        nvfp4.validate(x_rows, w[0], scales[0][0], scales[1][0])
    elif fmt == "mxfp8":
        mxfp8.validate(x_rows, w[0], scales[0][0])
    else:
        fp8_block.validate(x_rows, w[0], scales[0][0])


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
    out_dtype = out_dtype or x_rows.dtype
    t = tile_expert.shape[0]
    e = jnp.where(tile_expert >= 0, tile_expert + expert_offset, 0)
    wt = dequantize_experts(fmt, w[e], *(s[e] for s in scales))                  # [T, N, K]
    xt = x_rows.reshape(t, -1, x_rows.shape[-1]).astype(jnp.bfloat16)
    y = jnp.einsum("tbk,tnk->tbn", xt, wt, preferred_element_type=jnp.float32)
    if fmt == "nvfp4":
        y = y * scales[1][e].astype(jnp.float32)[:, None, None]
    y = jnp.where((tile_expert >= 0)[:, None, None], y, 0.0)
    return y.reshape(x_rows.shape[0], -1).astype(out_dtype)
