"""Pure-jnp twin of the MXFP8 matmul (same signature and numerics as the kernel).

    y = (bf16(x) @ bf16(w_q * 2^(w_scale - 127))^T in fp32).astype(out_dtype)

Every dequantized weight is exact in bf16 (an e4m3 value times a power of two), so the
kernel and this twin differ only in the order of the fp32 accumulation.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.common import product_dtype

BLOCK = 32


def validate(x, w_q, w_scale) -> None:
    """ValueError naming the operand whose dtype or shape is wrong."""
    if w_q.ndim != 2:
        raise ValueError(f"w_q must be 2-D [N, K], got shape {tuple(w_q.shape)}")
    n, k = w_q.shape
    if jnp.dtype(w_q.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise ValueError(f"w_q must be float8_e4m3fn, got {w_q.dtype}")
    if jnp.dtype(w_scale.dtype) != jnp.dtype(jnp.uint8):
        raise ValueError(f"w_scale must be uint8 (E8M0), got {w_scale.dtype}")
    if k % BLOCK:
        raise ValueError(f"MXFP8 K={k} is not a multiple of {BLOCK}")
    if tuple(w_scale.shape) != (k // BLOCK, n):
        raise ValueError(f"w_scale has shape {list(w_scale.shape)}, expected {[k // BLOCK, n]} (transposed) for "
                         f"w_q {[n, k]}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features but w_q has K={k}")


def e8m0_to_f32(s):
    """E8M0 bytes -> fp32 2^(s - 127)."""
    return jnp.ldexp(jnp.float32(1.0), s.astype(jnp.int32) - 127)


def dequantize_bf16(w_q, w_scale):
    """[N, K] bf16 weights, exact (``w_scale`` [K/32, N])."""
    n, k = w_q.shape
    s = e8m0_to_f32(w_scale.T)                                                 # [N, K/32]
    w = w_q.astype(jnp.float32).reshape(n, k // BLOCK, BLOCK) * s[..., None]
    return w.reshape(n, k).astype(jnp.bfloat16)


def matmul_reference(x, w_q, w_scale, *, out_dtype=None):
    """x [..., K] -> [..., N]."""
    validate(x, w_q, w_scale)
    out_dtype = out_dtype or x.dtype
    y = jnp.einsum("...k,nk->...n", x.astype(jnp.bfloat16), dequantize_bf16(w_q, w_scale),
                   preferred_element_type=product_dtype(out_dtype))
    return y.astype(out_dtype)
