"""Grouped quantized-expert matmul on Hopper: the shared dequantizing engine
(``pallas_kernels/mxfp8/wdequant.py``) with one expert per row tile. The experts are viewed
stacked along N (``[E·N, ...]``, a free reshape), so a tile's weight rows are those of its
expert; the engine's decode tiling (bm = 8..64 tokens in wgmma's N, weight streaming, split K
when the tiles alone do not fill the GPU) or its prefill tiling (bm >= 128) applies per tile."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.mxfp8 import wdequant as wd
from pallas_kernels.nvfp4 import operands as fp4

from .reference import check_tiles, expert_of_tile, validate


def grouped_matmul_kernel(x_rows, tile_expert, fmt, w, *scales, expert_offset=0, out_dtype=None, interpret=False,
                          **plan_overrides):
    """See ``pallas_kernels.moe_quant``; plan_overrides: tk, splits, stages."""
    validate(x_rows, tile_expert, fmt, w, *scales)
    check_tiles(x_rows, tile_expert, fmt, w)
    out_dtype = out_dtype or x_rows.dtype
    n = w.shape[1]
    t = tile_expert.shape[0]
    bm = x_rows.shape[0] // t
    k = w.shape[2] * (2 if fmt == "nvfp4" else 1)
    p = wd.plan(bm, n, k, fmt, bm=bm, row_tiles=t, **plan_overrides)
    x2 = x_rows.astype(jnp.bfloat16)
    x2 = fp4.order_x(x2, p.tk) if fmt == "nvfp4" else x2
    # experts stacked along N: the weight and block FP8's scales; mxfp8 / nvfp4 scales stay [E, K/b, N]
    flat = lambda a: a.reshape(-1, *a.shape[2:])
    scales = (flat(scales[0]),) if fmt == "fp8_block" else scales
    te = expert_of_tile(tile_expert, expert_offset, w.shape[0])
    y = wd.wdequant_matmul(x2, flat(w), scales, fmt=fmt, p=p, out_dtype=out_dtype,
                           tile_expert=te, expert_n=n, interpret=interpret)
    return wd.finish(y, p.splits, x_rows.shape[0], n, out_dtype)
