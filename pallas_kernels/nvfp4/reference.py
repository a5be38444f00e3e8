"""Pure-jnp twin of the NVFP4 (ModelOpt) weight-only matmul.

    w' = e2m1(w_q) * float(w_scale)      exact in bf16 (2 + 4 significant bits)
    y  = (bf16(x) @ w'^T in fp32) * w_scale_2

Same numerics as the kernel, which also applies ``w_scale_2`` to the fp32 accumulator.
(ModelOpt's own dequantization multiplies ``w_scale * w_scale_2`` first; the two orders
differ by one fp32 rounding.)
"""

from __future__ import annotations

import jax.numpy as jnp

BLOCK = 16
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def validate(x, w_q, w_scale, w_scale_2) -> None:
    """ValueError naming the operand whose dtype or shape is wrong."""
    if w_q.ndim != 2:
        raise ValueError(f"w_q must be 2-D [N, K/2] packed bytes, got shape {tuple(w_q.shape)}")
    n, k = w_q.shape[0], w_q.shape[1] * 2
    if jnp.dtype(w_q.dtype) != jnp.dtype(jnp.uint8):
        raise ValueError(f"w_q must be uint8 (two E2M1 codes per byte), got {w_q.dtype}")
    if jnp.dtype(w_scale.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise ValueError(f"w_scale must be float8_e4m3fn, got {w_scale.dtype}")
    if k % BLOCK:
        raise ValueError(f"NVFP4 K={k} is not a multiple of {BLOCK}")
    if tuple(w_scale.shape) != (k // BLOCK, n):
        raise ValueError(f"w_scale has shape {list(w_scale.shape)}, expected {[k // BLOCK, n]} (transposed) for "
                         f"N={n}, K={k}")
    if jnp.size(w_scale_2) != 1:
        raise ValueError(f"w_scale_2 must hold one value, got shape {list(jnp.shape(w_scale_2))}")
    if hasattr(w_scale_2, "dtype") and jnp.dtype(w_scale_2.dtype) != jnp.dtype(jnp.float32):
        raise ValueError(f"w_scale_2 must be float32 (the checkpoint's global scale), got {w_scale_2.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features but the packed weight has K={k}")


def unpack_codes(w_q):
    """uint8 [..., B] -> the [..., 2 B] E2M1 codes (element 2i in the low nibble of byte i)."""
    return jnp.stack([w_q & 0x0F, w_q >> 4], axis=-1).reshape(*w_q.shape[:-1], 2 * w_q.shape[-1])


def dequantize_bf16(w_q, w_scale):
    """[N, K] bf16 of e2m1 * w_scale (exact; w_scale [K/16, N]; w_scale_2 not applied)."""
    n, half = w_q.shape
    codes = unpack_codes(w_q)
    v = jnp.asarray(E2M1, jnp.float32)[codes.astype(jnp.int32)]
    w = v.reshape(n, -1, BLOCK) * w_scale.T.astype(jnp.float32)[..., None]
    return w.reshape(n, 2 * half).astype(jnp.bfloat16)


def matmul_reference(x, w_q, w_scale, w_scale_2, *, out_dtype=None):
    """x [..., K] -> [..., N]."""
    validate(x, w_q, w_scale, w_scale_2)
    out_dtype = out_dtype or x.dtype
    y = jnp.einsum("...k,nk->...n", x.astype(jnp.bfloat16), dequantize_bf16(w_q, w_scale),
                   preferred_element_type=jnp.float32)
    return (y * jnp.asarray(w_scale_2, jnp.float32).reshape(())).astype(out_dtype)
