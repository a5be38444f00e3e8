"""NVFP4 on the one-row CUDA-core GEMV (`pallas_kernels/row_gemv.py`): 16 codes a thread and
tile row.

* E2M1 -> fp32 exactly, two codes per 32-bit operation: a code's three magnitude bits shifted
  to bits 9-11 of an f16 and its sign to bit 15 are the f16 value e2m1 * 2^-14 (code 1, 0.5,
  lands on the f16 subnormal 2^-15), and f16 -> fp32 conversion is exact; the 2^14 joins
  w_scale_2 in the one multiplication of each output (`FORMAT.factor`);
* block scales (e4m3, per 16) convert by `cvt.rn.f16x2.e4m3x2`, exact.

Numerics: products x * e2m1 are exact in fp32; the 16 products of a block are summed in fp32,
multiplied by the block scale and accumulated in fp32 -- a different summation order from the
jnp twin's bf16 dot, same precision class (fp32 accumulation).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, vector
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from pallas_kernels import row_gemv
from pallas_kernels.common import e4m3x2_to_f32

from .reference import BLOCK, unpack_codes


def _decode(w0, w1):
    """The 16 codes of two words (code e of a word in bits 4e..4e+3) as fp32 e2m1 * 2^-14."""
    i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
    cst = lambda v: mgpu_utils.c(v, i32)
    half2 = ir.VectorType.get((2,), ir.F16Type.get())
    mag, sgn = cst(0x0E000E00), cst(0x80008000 - (1 << 32))
    vals = []
    for word in (w0, w1):
        out = [None] * 8
        for e, (sm, ss) in enumerate([(9, 12), (5, 8), (1, 4), (-3, 0)]):   # codes e, e + 4
            m = arith.shli(word, cst(sm)) if sm >= 0 else arith.shrui(word, cst(-sm))
            s = arith.shli(word, cst(ss)) if ss else word
            h = arith.ori(arith.andi(m, mag), arith.andi(s, sgn))
            v = arith.extf(ir.VectorType.get((2,), f32), mgpu_utils.bitcast(h, half2))
            out[e], out[e + 4] = vector.extract(v, [], [0]), vector.extract(v, [], [1])
        vals += out
    return vals


def e4m3_scales(sv):
    """ROWS e4m3 scales -> fp32, two per `cvt.rn.f16x2.e4m3x2`."""
    rows = ir.VectorType(sv.type).shape[0]
    pairs = mgpu_utils.bitcast(sv, ir.VectorType.get((rows // 2,), ir.IntegerType.get_signless(16)))
    return [v for p in range(rows // 2) for v in e4m3x2_to_f32(vector.extract(pairs, [], [p]))]


def _values(w):
    """uint8 [..., B] packed codes -> fp32 [..., 2 B] e2m1 * 2^-14: the GPU's bit decoding."""
    c = unpack_codes(w).astype(jnp.uint16)
    bits = ((c & 7) << 9) | ((c & 8) << 12)
    return lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _scale_values(s):
    return lax.bitcast_convert_type(s, jnp.float8_e4m3fn).astype(jnp.float32)


FORMAT = row_gemv.Format(name="nvfp4_gemv", per_thread=16, block=BLOCK, factor=2.0 ** 14,
                         decode=_decode, values=_values,
                         scales=row_gemv.row_scales(BLOCK, 16, e4m3_scales, _scale_values))


def supported(m: int, n: int, k: int) -> bool:
    return row_gemv.supported(FORMAT, m, n, k)


def gemv(x, w_q, w_scale, w_scale_2, *, out_dtype, interpret=False, **fusions):
    """x [1, K] bf16, w_q [N, K/2] uint8, w_scale [K/16, N] e4m3, w_scale_2 f32 -> [1, N]
    out_dtype = x @ (e2m1 * w_scale * w_scale_2)^T. ``fusions``: `row_gemv.gemv`'s keywords (with
    ``experts=``, its routed-expert form: stacked operands, w_scale_2 [P] one per row)."""
    return row_gemv.gemv(FORMAT, x, w_q, lax.bitcast_convert_type(w_scale, jnp.uint8), w_scale_2,
                         out_dtype=out_dtype, interpret=interpret, **fusions)
