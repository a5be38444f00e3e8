"""MXFP8 on the one-row CUDA-core GEMV (`pallas_kernels/row_gemv.py`): 8 e4m3 codes a thread
and tile row (`row_gemv.decode_e4m3`, exact); E8M0 block scales (per 32) become fp32 powers of
two by a shift (0 -> 2^-127, the fp32 subnormal).

Numerics: products x * e4m3 are exact in fp32; a thread's 8 products are summed in fp32,
multiplied by the block scale (exact) and accumulated in fp32 -- the jnp twin's bf16 dot up to
the summation order.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, vector
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from pallas_kernels import row_gemv

from .reference import BLOCK, e8m0_to_f32


def _convert(sv):
    """ROWS E8M0 bytes -> fp32 2^(s - 127): s in the exponent field; s = 0 is 2^-127."""
    i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
    cst = lambda v: mgpu_utils.c(v, i32)
    out = []
    for r in range(ir.VectorType(sv.type).shape[0]):
        s = arith.extui(i32, vector.extract(sv, [], [r]))
        bits = arith.select(arith.cmpi(arith.CmpIPredicate.eq, s, cst(0)), cst(1 << 22),
                            arith.shli(s, cst(23)))
        out.append(arith.bitcast(f32, bits))
    return out


FORMAT = row_gemv.Format(name="mxfp8_gemv", per_thread=8, block=BLOCK, factor=1.0,
                         decode=row_gemv.decode_e4m3, values=row_gemv.e4m3_values,
                         scales=row_gemv.row_scales(BLOCK, 8, _convert, e8m0_to_f32))


def supported(m: int, n: int, k: int) -> bool:
    return row_gemv.supported(FORMAT, m, n, k)


def gemv(x, w_q, w_scale, *, out_dtype, interpret=False, **fusions):
    """x [1, K] bf16, w_q [N, K] e4m3, w_scale [K/32, N] uint8 E8M0 -> [1, N] out_dtype.
    ``fusions``: `row_gemv.gemv`'s keywords (``experts=``: its routed-expert form)."""
    return row_gemv.gemv(FORMAT, x, lax.bitcast_convert_type(w_q, jnp.uint8), w_scale,
                         jnp.ones((1,), jnp.float32), out_dtype=out_dtype, interpret=interpret, **fusions)
