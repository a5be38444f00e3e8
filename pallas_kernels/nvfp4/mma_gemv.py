"""NVFP4 on the mma GEMV for 2-16 activation rows (`pallas_kernels/mma_gemv.py`): two codes a
byte, e4m3 scales per 16.

* operands: a word's 8 codes (code i in bits 4i..4i+3) make four bf16x2 operands, operand i =
  codes (i, i + 4). The two codes (at bits p and p + 16 of the word, or of the word >> 8) times
  2^(6-p) + 2^(12-p) put each code's magnitude bits at 6-8 and its sign at 15 of its half, i.e.
  e2m1 * 2^-126 as bf16 (code 1, 0.5, is the subnormal 2^-127); a mask drops the copies' other
  bits. The multiply runs on the FMA pipe, off the integer one that the decoding fills (1-2 %
  faster than shifts on the H200);
* scales: e4m3 -> f16 by `cvt.rn.f16x2.e4m3x2` (exact) -> fp32, times 2^116, -> bf16 (s, s); an
  operand times its scale is e2m1 * scale * 2^-10, at most 6 significant bits: exact in bf16;
* the outputs are multiplied by 2^10 * w_scale_2.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from pallas_kernels import mma_gemv

from . import gemv as one_row
from .reference import BLOCK


def _operands(word, scale):
    i32 = ir.IntegerType.get_signless(32)
    cst = lambda v: mgpu_utils.c(v, i32)
    keep, high, out = cst(0x81C081C0 - (1 << 32)), arith.shrui(word, cst(8)), []
    for i in range(4):
        p = 4 * (i % 2)
        codes = arith.andi(word if i < 2 else high, cst(0x000F000F << p))
        out.append(arith.andi(arith.muli(codes, cst((1 << (6 - p)) + (1 << (12 - p)))), keep))
    return [mma_gemv.bf16x2_times(op, scale) for op in out]


def _scale_pairs(sv):
    """8 e4m3 scales -> bf16x2 (scale * 2^116, the same)."""
    i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
    big = mgpu_utils.c(2.0 ** 116, f32)
    return [llvm.inline_asm(i32, [v, v], "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f")
            for v in (arith.mulf(s, big) for s in one_row.e4m3_scales(sv))]


def _values(codes, scales):
    """jnp: e2m1 * scale * 2^-10 (from the one-row GEMV's e2m1 * 2^-14: the GPU's subnormal
    bf16 codes would be flushed by XLA on the CPU)."""
    s = lax.bitcast_convert_type(scales, jnp.float8_e4m3fn).astype(jnp.float32)
    return one_row.FORMAT.values(codes) * jnp.repeat(s.T * 2.0 ** 4, BLOCK, axis=1)


FORMAT = mma_gemv.Format(name="nvfp4_mma_gemv", codes_per_byte=2, block=BLOCK, pair=4, factor=2.0 ** 10,
                         operands=_operands, scales=mma_gemv.row_scales(2 * mma_gemv.TILE_BYTES // BLOCK, _scale_pairs),
                         values=_values, issue_bound=True)


def supported(m: int, n: int, k: int) -> bool:
    return mma_gemv.supported(FORMAT, m, n, k)


def gemv(x, w_q, w_scale, w_scale_2, *, out_dtype, interpret=False):
    """x [M, K] bf16 (2 <= M <= 16), w_q [N, K/2] uint8, w_scale [K/16, N] e4m3, w_scale_2 f32 ->
    [M, N] out_dtype = x @ (e2m1 * w_scale * w_scale_2)^T."""
    return mma_gemv.gemv(FORMAT, x, w_q, lax.bitcast_convert_type(w_scale, jnp.uint8), w_scale_2,
                         out_dtype=out_dtype, interpret=interpret)
