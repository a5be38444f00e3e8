"""NVFP4 on the mma GEMV for 1-16 activation rows (`pallas_kernels/mma_gemv.py`): two codes a
byte, e4m3 scales per 16, decoded into bf16x2 operands by ``operands.py`` (a word's operand i =
codes (i, i + 4); operand values e2m1 * scale * 2^-10, the outputs multiplied by 2^10 *
w_scale_2)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels import mma_gemv

from . import operands
from .reference import BLOCK

FORMAT = mma_gemv.Format(name="nvfp4_mma_gemv", codes_per_byte=2, block=BLOCK, pair=4, factor=operands.FACTOR,
                         operands=operands.word_operands,
                         scales=mma_gemv.row_scales(BLOCK // 2, operands.scale_pairs),
                         values=operands.values, issue_bound=True)


def supported(m: int, n: int, k: int) -> bool:
    return mma_gemv.supported(FORMAT, m, n, k)


def gemv(x, w_q, w_scale, w_scale_2, *, out_dtype, interpret=False):
    """x [M, K] bf16 (1 <= M <= 16), w_q [N, K/2] uint8, w_scale [K/16, N] e4m3, w_scale_2 f32 ->
    [M, N] out_dtype = x @ (e2m1 * w_scale * w_scale_2)^T."""
    return mma_gemv.gemv(FORMAT, x, w_q, lax.bitcast_convert_type(w_scale, jnp.uint8), w_scale_2,
                         out_dtype=out_dtype, interpret=interpret)
