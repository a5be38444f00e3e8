"""ModelOpt MXFP8 (OCP microscaling FP8; the DFlash2 drafter's format).

Layout (HF ``[out, in]`` = ``[N, K]``, K a multiple of 32):

    weight        float8_e4m3fn  [N, K]
    weight_scale  uint8 (E8M0)   [N, K / 32]     un-swizzled, one scale per 32 values along K

    w[n, k] = float(weight[n, k]) * 2^(weight_scale[n, k // 32] - 127)

E8M0 is a biased exponent with no mantissa; 255 is NaN. The multiply is exact (a power of
two) in f32, and in bf16 unless the result leaves bf16's range.

Scale selection (``quantize``) is ModelOpt's ``MXFP8QTensor`` rule: per 32-block,
``e = ceil(log2(amax / 448))`` computed in float32 and clamped to [-127, 127] (an all-zero
block takes -127), ``weight_scale = e + 127``, values ``clip(w * 2^-e, ±448)`` rounded to
nearest-even e4m3. Rounding the exponent *up* guarantees ``amax * 2^-e <= 448`` so no value
saturates. (The OCP spec's own rule, ``floor(log2(amax)) - 8``, can leave values above 448
that must clip; ModelOpt and TransformerEngine use the ceil rule, and so do we, so a
checkpoint we write is byte-identical to ModelOpt's for the same weights.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 32
E4M3_MAX = 448.0
E8M0_BIAS = 127


def e8m0_exponent(amax):
    """ModelOpt's exponent: clamp(ceil(log2(amax / 448)), -127, 127); -127 where amax == 0."""
    descale = jnp.asarray(amax, jnp.float32) / jnp.float32(E4M3_MAX)
    log2 = jnp.where(descale > 0, jnp.log2(jnp.where(descale > 0, descale, 1.0)), -127.0)
    return jnp.clip(jnp.ceil(log2), -127, 127)


def quantize(w):
    """w [..., K] float (K % 32 == 0) -> (weight e4m3 [..., K], weight_scale uint8 [..., K/32])."""
    k = jnp.shape(w)[-1]
    if k % BLOCK:
        raise ValueError(f"MXFP8 needs the input dimension to be a multiple of {BLOCK}, got {k}")
    return _quantize(jnp.asarray(w, jnp.float32))


@jax.jit
def _quantize(w):
    k = w.shape[-1]
    blocks = w.reshape(*w.shape[:-1], k // BLOCK, BLOCK)
    e = e8m0_exponent(jnp.max(jnp.abs(blocks), axis=-1))                  # [..., K/32]
    q = jnp.clip(blocks * jnp.exp2(-e)[..., None], -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return q.reshape(w.shape), (e + E8M0_BIAS).astype(jnp.uint8)


def scale_values(weight_scale):
    """E8M0 bytes -> f32 multipliers 2^(u - 127) (NaN for 255), exact."""
    u = jnp.asarray(weight_scale).astype(jnp.int32)
    return jnp.where(u == 255, jnp.nan, jnp.ldexp(jnp.float32(1.0), u - E8M0_BIAS))


def dequantize(weight, weight_scale, dtype=jnp.float32):
    """``float(weight) * 2^(weight_scale - 127)`` per 32-block, cast to ``dtype``."""
    check(weight, weight_scale)
    k = weight.shape[-1]
    s = scale_values(weight_scale)[..., None]                             # [..., K/32, 1]
    w = weight.astype(jnp.float32).reshape(*weight.shape[:-1], k // BLOCK, BLOCK) * s
    return w.reshape(weight.shape).astype(dtype)


def check(weight, weight_scale, name: str = "weight") -> None:
    """Raises ValueError unless dtypes are e4m3 / uint8 and the scale is [..., K/32]."""
    if jnp.dtype(weight.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise ValueError(f"{name}: MXFP8 weight must be float8_e4m3fn, got {weight.dtype}")
    if jnp.dtype(weight_scale.dtype) != jnp.dtype(jnp.uint8):
        raise ValueError(f"{name}_scale: MXFP8 scales must be uint8 (E8M0), got {weight_scale.dtype}")
    k = weight.shape[-1]
    if k % BLOCK:
        raise ValueError(f"{name}: MXFP8 input dimension {k} is not a multiple of {BLOCK}")
    want = (*weight.shape[:-1], k // BLOCK)
    if tuple(weight_scale.shape) != want:
        raise ValueError(f"{name}_scale has shape {list(weight_scale.shape)}; a weight of shape "
                         f"{list(weight.shape)} needs {list(want)}")
