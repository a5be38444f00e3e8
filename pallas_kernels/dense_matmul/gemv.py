"""bf16 weights on the one-row CUDA-core GEMV (`pallas_kernels/row_gemv.py`): 4 bf16 a thread
and tile row, each the upper half of its fp32 (exact), no block scales.

Numerics: products x * w are exact in fp32, summed in fp32 -- the jnp twin's bf16 dot up to the
summation order.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from pallas_kernels import row_gemv


def _decode(w0, w1):
    """The 4 bf16 of two words as fp32, in K order (the low half of w0 first)."""
    i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
    vals = []
    for word in (w0, w1):
        vals += [arith.bitcast(f32, arith.shli(word, mgpu_utils.c(16, i32))),
                 arith.bitcast(f32, arith.andi(word, mgpu_utils.c(-(1 << 16), i32)))]
    return vals


def _values(w):
    """uint8 [..., 2 B] little-endian bf16 bytes -> fp32 [..., B]."""
    pairs = w.reshape(*w.shape[:-1], w.shape[-1] // 2, 2)
    return lax.bitcast_convert_type(pairs, jnp.bfloat16).astype(jnp.float32)


FORMAT = row_gemv.Format(name="bf16_gemv", per_thread=4, block=4 * 128, factor=1.0, decode=_decode,
                         values=_values, scales=None)


def supported(m: int, n: int, k: int) -> bool:
    return row_gemv.supported(FORMAT, m, n, k)


def gemv(x, w, *, out_dtype, interpret=False, **fusions):
    """x [1, K] bf16, w [N, K] bf16 -> [1, N] out_dtype."""
    w_bytes = lax.bitcast_convert_type(w, jnp.uint8).reshape(w.shape[0], 2 * w.shape[1])
    return row_gemv.gemv(FORMAT, x, w_bytes, None, jnp.ones((1,), jnp.float32), out_dtype=out_dtype,
                         interpret=interpret, **fusions)
