"""Pure-jnp twins of the block-FP8 matmuls (same signatures and numerics as the kernels).

W8A16 (``act_quant=False``, default): ``w = bf16(f32(w_q) * w_scale_inv[block])`` (one
rounding per weight), ``y = bf16(x) @ w^T`` with fp32 accumulation.

W8A8 (``act_quant=True``), the DeepSeek-V3 / GLM-5.3 reference numerics
(``activation_scheme: dynamic``; DeepGEMM / vLLM ``w8a8_block_fp8``): x is quantized per
token and 128-wide K group, ``sx = amax / 448``, ``xq = e4m3(x / sx)``; then
``y = sum_b (xq_b @ w_q_b^T) * sx[:, b] * w_scale_inv[:, b]`` over 128-column K groups b,
every group product exact in fp32 before scaling. Requires 128x128 weight blocks.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.common import product_dtype

E4M3_MAX = 448.0
DEFAULT_BLOCK = (128, 128)


def validate(x, w_q, w_scale_inv, block=DEFAULT_BLOCK) -> None:
    """ValueError naming the operand whose dtype or shape is wrong."""
    if w_q.ndim != 2:
        raise ValueError(f"w_q must be 2-D [N, K], got shape {tuple(w_q.shape)}")
    n, k = w_q.shape
    if jnp.dtype(w_q.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise ValueError(f"w_q must be float8_e4m3fn, got {w_q.dtype}")
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"block must be two positive ints (rows, columns), got {block!r}")
    want = (math.ceil(n / block[0]), math.ceil(k / block[1]))
    if tuple(w_scale_inv.shape) != want:
        raise ValueError(f"w_scale_inv has shape {list(w_scale_inv.shape)}, expected {list(want)} for w_q "
                         f"{[n, k]} with {block[0]}x{block[1]} blocks")
    if jnp.dtype(w_scale_inv.dtype) != jnp.dtype(jnp.float32):
        raise ValueError(f"w_scale_inv must be float32, got {w_scale_inv.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features but w_q has K={k}")


def expand_scale(w_scale_inv, shape, block=DEFAULT_BLOCK):
    n, k = shape
    s = jnp.repeat(jnp.repeat(w_scale_inv, block[0], axis=0), block[1], axis=1)
    return s[:n, :k]


def dequantize_bf16(w_q, w_scale_inv, block=DEFAULT_BLOCK):
    """[N, K] bf16: ``bf16(f32(w_q) * scale)``."""
    return (w_q.astype(jnp.float32) * expand_scale(w_scale_inv, w_q.shape, block)).astype(jnp.bfloat16)


def quantize_activations(x2, group: int = 128):
    """x [M, K] -> (xq e4m3 [M, K], sx f32 [M, ceil(K/group)]): amax/448 per token and group
    (1.0 for an all-zero group), ``xq = e4m3(x / sx)``."""
    m, k = x2.shape
    kb = math.ceil(k / group)
    xb = jnp.pad(x2.astype(jnp.float32), ((0, 0), (0, kb * group - k))).reshape(m, kb, group)
    amax = jnp.max(jnp.abs(xb), axis=-1)
    sx = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    xq = jnp.clip(xb / sx[..., None], -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return xq.reshape(m, kb * group)[:, :k], sx


def matmul_reference(x, w_q, w_scale_inv, *, block=DEFAULT_BLOCK, act_quant=False, out_dtype=None):
    """x [..., K] -> [..., N]."""
    validate(x, w_q, w_scale_inv, block)
    out_dtype = out_dtype or x.dtype
    if not act_quant:
        y = jnp.einsum("...k,nk->...n", x.astype(jnp.bfloat16), dequantize_bf16(w_q, w_scale_inv, block),
                       preferred_element_type=product_dtype(out_dtype))
        return y.astype(out_dtype)
    if tuple(block) != (128, 128):
        raise ValueError(f"W8A8 block FP8 needs 128x128 weight blocks, got {block}")
    lead, k = x.shape[:-1], x.shape[-1]
    n = w_q.shape[0]
    kb = math.ceil(k / 128)
    xq, sx = quantize_activations(x.reshape(-1, k))
    pad = kb * 128 - k
    xq = jnp.pad(xq, ((0, 0), (0, pad))).reshape(-1, kb, 128)
    wq = jnp.pad(w_q, ((0, 0), (0, pad))).reshape(n, kb, 128)
    sw = jnp.repeat(w_scale_inv, 128, axis=0)[:n]                               # [N, Kb]

    def group(b, acc):
        xb = jax.lax.dynamic_index_in_dim(xq, b, axis=1, keepdims=False).astype(jnp.float32)
        wb = jax.lax.dynamic_index_in_dim(wq, b, axis=0 + 1, keepdims=False).astype(jnp.float32)
        part = jnp.einsum("mk,nk->mn", xb, wb, preferred_element_type=jnp.float32,
                          precision=jax.lax.Precision.HIGHEST)
        return acc + part * sx[:, b][:, None] * sw[:, b][None, :]

    y = jax.lax.fori_loop(0, kb, group, jnp.zeros((xq.shape[0], n), jnp.float32))
    return y.reshape(*lead, n).astype(out_dtype)
