"""MXFP8 on the mma GEMV for 1-16 activation rows (`pallas_kernels/mma_gemv.py`; 9-16 only where
the plan splits K at most twice): one e4m3 code a byte, E8M0 scales per 32.

* operands: a word's 4 codes make two bf16x2 operands, operand i = codes (i, i + 2). A code's 7
  magnitude bits moved to bits 4-10 of its half and its sign to bit 15 are e4m3 * 2^-120 as bf16
  (the e4m3 subnormals land on bf16 subnormals, exactly);
* scales: E8M0 s -> bf16 2^(s - 7) (exponent field s + 120; one multiply-add makes (s, s)); an
  operand times its scale is e4m3 * 2^(s - 127), the dequantized weight, exact. Scales above 2^7
  (s > ``MAX_SCALE``, blocks whose largest weight exceeds 2^16) overflow the bf16 factor: such
  weights take the engine (``wide_scales``; ModelOpt's rule writes them only for weights beyond
  57344 in magnitude);
* the outputs are multiplied by w_scale_2 = 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, vector
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from pallas_kernels import mma_gemv

from .reference import BLOCK, e8m0_to_f32

MAX_SCALE = 134              # largest E8M0 byte whose factor 2^(s - 7) is a finite bf16


def _operands(word, scale):
    i32 = ir.IntegerType.get_signless(32)
    cst = lambda v: mgpu_utils.c(v, i32)
    mag, sign = cst(0x07F007F0), cst(0x80008000 - (1 << 32))
    lo = arith.ori(arith.andi(arith.shli(word, cst(4)), mag), arith.andi(arith.shli(word, cst(8)), sign))
    hi = arith.ori(arith.andi(arith.shrui(word, cst(4)), mag), arith.andi(word, sign))
    return [mma_gemv.bf16x2_times(op, scale) for op in (lo, hi)]


def _scale_pairs(sv):
    """R E8M0 scales -> bf16x2 (2^(s - 7), the same)."""
    i32 = ir.IntegerType.get_signless(32)
    cst = lambda v: mgpu_utils.c(v, i32)
    return [arith.addi(arith.muli(arith.extui(i32, vector.extract(sv, [], [r])), cst(0x00800080)), cst(0x3C003C00))
            for r in range(ir.VectorType(sv.type).shape[0])]


def _values(codes, scales):
    """jnp: e4m3 * 2^(s - 127), the dequantized weights."""
    w = lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.float32)
    s = e8m0_to_f32(scales)
    return w * jnp.repeat(s.T, BLOCK, axis=1)


FORMAT = mma_gemv.Format(name="mxfp8_mma_gemv", codes_per_byte=1, block=BLOCK, pair=2, factor=1.0,
                         operands=_operands, scales=mma_gemv.row_scales(BLOCK, _scale_pairs),
                         values=_values, wide_max_splits=2)


def supported(m: int, n: int, k: int) -> bool:
    return mma_gemv.supported(FORMAT, m, n, k)


def gemv(x, w_q, w_scale, *, out_dtype, interpret=False):
    """x [M, K] bf16 (1 <= M <= 16, `supported`), w_q [N, K] e4m3, w_scale [K/32, N] uint8 E8M0 -> [M, N]
    out_dtype."""
    return mma_gemv.gemv(FORMAT, x, lax.bitcast_convert_type(w_q, jnp.uint8), w_scale, jnp.ones((1,), jnp.float32),
                         out_dtype=out_dtype, interpret=interpret)


def wide_scales(w_scale) -> bool:
    """Whether a concrete scale array holds an E8M0 byte above ``MAX_SCALE`` (False for a traced
    one, whose values are unknown: a jitted caller that cannot rule them out says so itself)."""
    return not isinstance(w_scale, jax.core.Tracer) and int(jnp.max(w_scale)) > MAX_SCALE
