"""RMSNorm (Zhang & Sennrich 2019) as used by Qwen3: ``x / rms(x) * weight``, math in fp32."""

import jax
import jax.numpy as jnp
from flax import nnx


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Normalises over the last axis; returns x's dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
    """``weight [dim]``, replicated."""

    def __init__(self, dim: int, eps: float, dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype), axes=(None,))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)
