"""Independent NumPy decoders for the quantized formats (test oracle).

Decodes raw bytes with explicit bit arithmetic in float64: no ml_dtypes conversions, no code
shared with ``kk_jax.quant`` or ``pallas_kernels``.

    e4m3: s eeee mmm, bias 7; e == 0 is subnormal (m/8 * 2^-6); 0x7F / 0xFF are NaN
    e8m0: 2^(u - 127); 255 is NaN
    e2m1: s ee m; e == 0 is subnormal (m * 0.5), else 2^(e-1) * (1 + m/2)
"""

from __future__ import annotations

import numpy as np


def as_bytes(a) -> np.ndarray:
    """Raw bytes of a float8 / uint8 array."""
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.astype(np.uint8)


def decode_e4m3(b) -> np.ndarray:
    b = as_bytes(b).astype(np.int64)
    s = np.where(b & 0x80, -1.0, 1.0)
    e = (b >> 3) & 0xF
    m = b & 0x7
    v = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7))
    v = np.where((b & 0x7F) == 0x7F, np.nan, v)
    return s * v


def decode_e8m0(u) -> np.ndarray:
    u = as_bytes(u).astype(np.float64)
    return np.where(u == 255, np.nan, 2.0 ** (u - 127))


def decode_e2m1(c) -> np.ndarray:
    c = np.asarray(c).astype(np.int64)
    s = np.where(c & 8, -1.0, 1.0)
    e, m = (c >> 1) & 3, c & 1
    return s * np.where(e == 0, m * 0.5, 2.0 ** (e - 1) * (1 + m / 2.0))


def dequant_fp8_block(w, scale_inv, block=(128, 128)) -> np.ndarray:
    v = decode_e4m3(w)
    s = np.asarray(scale_inv, np.float64)
    out = np.empty_like(v)
    for i in range(v.shape[0]):
        for j0 in range(0, v.shape[1], block[1]):
            out[i, j0:j0 + block[1]] = v[i, j0:j0 + block[1]] * s[i // block[0], j0 // block[1]]
    return out


def dequant_mxfp8(w, scale) -> np.ndarray:
    v = decode_e4m3(w)
    s = decode_e8m0(scale)
    return v * np.repeat(s, 32, axis=-1)


def dequant_nvfp4(packed, scale, scale_2) -> np.ndarray:
    b = as_bytes(packed).astype(np.int64)
    codes = np.empty(b.shape[:-1] + (2 * b.shape[-1],), np.int64)
    codes[..., 0::2] = b & 0xF            # element 2i: low nibble
    codes[..., 1::2] = b >> 4             # element 2i+1: high nibble
    s = decode_e4m3(scale) * float(np.asarray(scale_2, np.float64).reshape(()))
    return decode_e2m1(codes) * np.repeat(s, 16, axis=-1)


def bf16_round(x) -> np.ndarray:
    """Round-to-nearest-even to bfloat16, returned as float64 (bit arithmetic on float32)."""
    f = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    f = (f + 0x7FFF + ((f >> 16) & 1)) & 0xFFFF0000
    return f.astype(np.uint32).view(np.float32).astype(np.float64)


def matmul(x, w) -> np.ndarray:
    """bf16-rounded activations times a float64 weight [N, K]: the W*A16 oracle."""
    return bf16_round(x) @ np.asarray(w, np.float64).T


def rel_err(a, b) -> float:
    """Relative L2 error of a (any array, upcast) against the reference b."""
    a = np.asarray(np.asarray(a, dtype=np.float32), np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
