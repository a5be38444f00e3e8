"""Block FP8: the DeepSeek-V3 / GLM-5.3 release format (``quant_method: "fp8"`` with
``weight_block_size: [128, 128]``).

Layout (one linear, HF ``[out, in]`` = ``[N, K]``):

    weight            float8_e4m3fn  [N, K]
    weight_scale_inv  float32        [ceil(N / bn), ceil(K / bk)]     (bn, bk) = (128, 128)

    w[n, k] = float(weight[n, k]) * weight_scale_inv[n // bn, k // bk]

The name says "inverse" because the value stored is the *dequantization* multiplier (the
inverse of the quantization scale ``448 / amax``). Edge blocks (N or K not a multiple of the
block) are partial blocks with their own scale; no padding is stored.

Scale selection (``quantize``): per block, ``scale_inv = amax(|w_block|) / 448`` (448 is the
largest finite e4m3 value), an all-zero block gets ``1.0``; values are ``w / scale_inv``
rounded to nearest-even e4m3 and clipped to ±448. This is the rule of DeepSeek's reference
``act_quant``/``weight_dequant`` pair and of vLLM's / DeepGEMM's ``per_block_cast_to_fp8``
(which clamp amax at 1e-4 instead of special-casing zero; the two agree on every block with
amax >= 1e-4, and on zero blocks the stored bytes are all zero either way). With
``scale_fmt="ue8m0"`` (DeepSeek V3.1 configs) the scale is rounded *up* to a power of two,
``2^ceil(log2(amax / 448))``, so scaling is exact in every float format.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

E4M3_MAX = 448.0
DEFAULT_BLOCK = (128, 128)


def scale_shape(shape: tuple[int, int], block=DEFAULT_BLOCK) -> tuple[int, int]:
    """Shape of ``weight_scale_inv`` for a weight of ``shape`` [N, K]."""
    n, k = shape
    return (math.ceil(n / block[0]), math.ceil(k / block[1]))


def _pad_to_blocks(w, block):
    n, k = w.shape
    nb, kb = scale_shape((n, k), block)
    w = jnp.pad(w, ((0, nb * block[0] - n), (0, kb * block[1] - k)))
    return w.reshape(nb, block[0], kb, block[1])


def quantize(w, block=DEFAULT_BLOCK, scale_fmt: str | None = None):
    """w [N, K] float -> (weight e4m3 [N, K], weight_scale_inv f32 [ceil(N/bn), ceil(K/bk)])."""
    if jnp.ndim(w) != 2:
        raise ValueError(f"block FP8 quantizes 2-D [out, in] weights, got shape {jnp.shape(w)}")
    if scale_fmt not in (None, "float", "ue8m0"):
        raise ValueError(f"scale_fmt must be None, 'float' or 'ue8m0', got {scale_fmt!r}")
    return _quantize(jnp.asarray(w, jnp.float32), tuple(block), scale_fmt)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize(w, block, scale_fmt):
    n, k = w.shape
    blocks = _pad_to_blocks(w, block)                                     # [Nb, bn, Kb, bk]
    amax = jnp.max(jnp.abs(blocks), axis=(1, 3))                          # [Nb, Kb]
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    if scale_fmt == "ue8m0":
        scale = jnp.where(amax > 0, jnp.exp2(jnp.ceil(jnp.log2(scale))), 1.0)
    q = jnp.clip(blocks / scale[:, None, :, None], -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    q = q.reshape(blocks.shape[0] * block[0], blocks.shape[2] * block[1])[:n, :k]
    return q, scale.astype(jnp.float32)


def expand_scale(scale_inv, shape: tuple[int, int], block=DEFAULT_BLOCK):
    """Per-element multiplier [N, K] from the per-block scales."""
    n, k = shape
    s = jnp.repeat(jnp.repeat(jnp.asarray(scale_inv, jnp.float32), block[0], axis=0), block[1], axis=1)
    return s[:n, :k]


def dequantize(weight, weight_scale_inv, block=DEFAULT_BLOCK, dtype=jnp.float32):
    """``float(weight) * weight_scale_inv[block]`` in f32, cast to ``dtype``."""
    check(weight, weight_scale_inv, block)
    w = weight.astype(jnp.float32) * expand_scale(weight_scale_inv, weight.shape, block)
    return w.astype(dtype)


def check(weight, weight_scale_inv, block=DEFAULT_BLOCK, name: str = "weight") -> None:
    """Raises ValueError unless the pair has the block-FP8 dtypes and matching shapes."""
    if jnp.dtype(weight.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise ValueError(f"{name}: block FP8 weight must be float8_e4m3fn, got {weight.dtype}")
    if weight.ndim != 2:
        raise ValueError(f"{name}: block FP8 weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    want = scale_shape(tuple(weight.shape), block)
    if tuple(weight_scale_inv.shape) != want:
        raise ValueError(f"{name}_scale_inv has shape {list(weight_scale_inv.shape)}; a weight of shape "
                         f"{list(weight.shape)} with {block[0]}x{block[1]} blocks needs {list(want)}")
    if jnp.dtype(weight_scale_inv.dtype) != jnp.dtype(jnp.float32):
        raise ValueError(f"{name}_scale_inv must be float32, got {weight_scale_inv.dtype}")
