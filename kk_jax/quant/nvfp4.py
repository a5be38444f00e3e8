"""ModelOpt NVFP4 (E2M1 values, e4m3 per-16 scales, one fp32 global scale).

Layout (HF ``[out, in]`` = ``[N, K]``, K a multiple of 16):

    weight          uint8          [N, K / 2]    two E2M1 codes per byte along K:
                                                 element 2i in the low nibble, 2i+1 in the high
    weight_scale    float8_e4m3fn  [N, K / 16]   per-16-block scale
    weight_scale_2  float32        []            per-tensor global scale
    input_scale     float32        []            activation global scale (W4A4 only; a W4A16
                                                 kernel does not use it)

    w[n, k] = e2m1(code[n, k]) * (float(weight_scale[n, k // 16]) * weight_scale_2)

E2M1 codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8..15 their negatives (bit 3 is
the sign). The low-nibble-first order is ModelOpt's ``NVFP4QTensor`` packing
(``(q[..., 1::2] << 4) | q[..., 0::2]``) and its ``_unpack_tensor``.

Scale selection (``quantize``) is ModelOpt's dynamic-weight rule:
``weight_scale_2 = amax(|w|) / (6 * 448)``; per block
``weight_scale = e4m3(max(amax_block / (6 * weight_scale_2), 2^-9))`` (an all-zero block
takes 1.0; 2^-9 is e4m3's smallest subnormal, so a tiny block never gets scale 0); values
are ``w / (float(weight_scale) * weight_scale_2)`` rounded to E2M1 with ModelOpt's
thresholds ``[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5]`` (a value is counted above every
threshold it strictly exceeds) plus its tie adjustment that rounds a value equal to the
thresholds at indices 1, 3 and 5 (0.75, 1.75, 3.5) *up*: round-to-nearest-even on the codes
(2.5 -> 2, 3.5 -> 4, 5 -> 4; ModelOpt's source comment names 2.5, but its index 5 is 3.5).
A tensor of zeros gets ``weight_scale_2 = 1`` (ModelOpt would divide by 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 16
E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_ROUND_UP_TIES = (0.75, 1.75, 3.5)      # _BOUNDS[1], [3], [5]


def e2m1_codes(x):
    """f32 values (already divided by their scale) -> E2M1 codes 0..15 (uint8), ModelOpt rounding."""
    x = jnp.asarray(x, jnp.float32)
    a = jnp.abs(x)
    ordinal = jnp.searchsorted(jnp.asarray(_BOUNDS, jnp.float32), a, side="left").astype(jnp.uint8)
    tie_up = jnp.any(a[..., None] == jnp.asarray(_ROUND_UP_TIES, jnp.float32), axis=-1).astype(jnp.uint8)
    sign = (x < 0).astype(jnp.uint8)
    return (sign << 3) + ordinal + tie_up


def pack(codes):
    """codes [..., K] uint8 (0..15) -> bytes [..., K/2]: element 2i low nibble, 2i+1 high."""
    codes = jnp.asarray(codes, jnp.uint8)
    return (codes[..., 1::2] << 4) | codes[..., 0::2]


def unpack(packed):
    """bytes [..., K/2] -> codes [..., K] (uint8)."""
    packed = jnp.asarray(packed, jnp.uint8)
    lo, hi = packed & 0x0F, packed >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


@jax.jit
def global_scale(w):
    """``weight_scale_2 = amax / (6 * 448)`` (1.0 for an all-zero tensor), at least fp32's
    smallest normal: a tensor whose amax is below ~3e-35 would otherwise get a subnormal scale
    that XLA flushes to 0 on some devices, and every value would dequantize to 0 * inf = NaN."""
    amax = jnp.max(jnp.abs(jnp.asarray(w, jnp.float32)))
    s2 = jnp.maximum(amax / jnp.float32(E2M1_MAX * E4M3_MAX), jnp.finfo(jnp.float32).tiny)
    return jnp.where(amax > 0, s2, 1.0).astype(jnp.float32)


def quantize(w, weight_scale_2=None):
    """w [..., K] float (K % 16 == 0) -> (weight uint8 [..., K/2], weight_scale e4m3 [..., K/16],
    weight_scale_2 f32 [])."""
    k = jnp.shape(w)[-1]
    if k % BLOCK:
        raise ValueError(f"NVFP4 needs the input dimension to be a multiple of {BLOCK}, got {k}")
    w = jnp.asarray(w, jnp.float32)
    s2 = global_scale(w) if weight_scale_2 is None else jnp.asarray(weight_scale_2, jnp.float32).reshape(())
    return _quantize(w, s2)


@jax.jit
def _quantize(w, s2):
    k = w.shape[-1]
    blocks = w.reshape(*w.shape[:-1], k // BLOCK, BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    s = amax / (jnp.float32(E2M1_MAX) * s2)
    s = jnp.where(s == 0, 1.0, s)
    s = jnp.maximum(s, 2.0 ** -9).astype(jnp.float8_e4m3fn)
    scaled = blocks / (s.astype(jnp.float32) * s2)[..., None]
    codes = e2m1_codes(scaled.reshape(w.shape))
    return pack(codes), s, s2


def e2m1_values(codes):
    """codes (0..15) -> f32 E2M1 values (:data:`E2M1_VALUES`), exactly, by arithmetic rather than a
    table gather, so that XLA fuses it into the dequantization: the 3 magnitude bits placed at
    f16 bits 9..11 give ``value * 2^-14`` (E2M1's 0.5 lands on an f16 subnormal), the sign bit
    goes to bit 15."""
    c = jnp.asarray(codes).astype(jnp.uint16)
    bits = ((c & 7) << 9) | ((c & 8) << 12)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32) * 16384.0


def dequantize(weight, weight_scale, weight_scale_2, dtype=jnp.float32):
    """``e2m1 * (float(weight_scale) * weight_scale_2)`` per 16-block, cast to ``dtype``."""
    check(weight, weight_scale, weight_scale_2)
    v = e2m1_values(unpack(weight))                                        # [..., K]
    k = v.shape[-1]
    s = weight_scale.astype(jnp.float32) * jnp.asarray(weight_scale_2, jnp.float32).reshape(())
    w = v.reshape(*v.shape[:-1], k // BLOCK, BLOCK) * s[..., None]
    return w.reshape(v.shape).astype(dtype)


def check(weight, weight_scale, weight_scale_2=None, name: str = "weight") -> None:
    """Raises ValueError unless the weight is uint8 and its scales e4m3, shaped [..., K/2] /
    [..., K/16], and ``weight_scale_2`` (taken as fp32) is one value."""
    if jnp.dtype(weight.dtype) != jnp.dtype(jnp.uint8):
        raise ValueError(f"{name}: NVFP4 weight must be uint8 (two E2M1 per byte), got {weight.dtype}")
    if jnp.dtype(weight_scale.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise ValueError(f"{name}_scale: NVFP4 scales must be float8_e4m3fn, got {weight_scale.dtype}")
    k = weight.shape[-1] * 2
    if k % BLOCK:
        raise ValueError(f"{name}: NVFP4 input dimension {k} is not a multiple of {BLOCK}")
    want = (*weight.shape[:-1], k // BLOCK)
    if tuple(weight_scale.shape) != want:
        raise ValueError(f"{name}_scale has shape {list(weight_scale.shape)}; a packed weight of shape "
                         f"{list(weight.shape)} (K = {k}) needs {list(want)}")
    if weight_scale_2 is not None and int(np.prod(jnp.shape(weight_scale_2))) != 1:
        raise ValueError(f"{name}_scale_2 must be a single fp32 value, got shape {list(jnp.shape(weight_scale_2))}")
