"""Rotary position embedding, rotate-half (non-interleaved) convention as in HF Qwen3."""

import jax
import jax.numpy as jnp


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """x [B, T, H, D], positions [B, T] int32 -> rotated x (same dtype), math in fp32.

    Pair (i, i + D/2) rotates by ``positions * theta ** (-2i / D)``.
    """
    d = x.shape[-1]
    inv_freq = theta ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)          # [D/2]
    ang = positions.astype(jnp.float32)[..., None] * inv_freq                   # [B, T, D/2]
    cos = jnp.cos(ang)[:, :, None, :]
    sin = jnp.sin(ang)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
