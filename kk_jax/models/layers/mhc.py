"""Manifold-constrained hyper-connections (mHC), GLM-5.3 form (reference/models.md §1.2).

The residual is ``hc`` parallel streams ``X [B, T, hc, D]``. Each site (attention, FFN)
computes, in fp32, from the RMS-normalised flattened streams: ``pre`` (stream collapse
weights), ``post`` (placement of the block output, in [0, 2]) and ``comb`` (an hc×hc mixer
projected onto the doubly-stochastic manifold by Sinkhorn iterations). Then
``X'[j] = post[j]·y + Σ_i comb[i, j]·X[i]`` with ``y = F(norm(Σ_i pre[i]·X[i]))``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def mhc_pre(x: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, *, hc: int, iters: int,
            eps: float, rms_eps: float):
    """x [B, T, hc, D]; fn [(2+hc)·hc, hc·D]; base [(2+hc)·hc]; scale [3].

    Returns post [B, T, hc] f32, comb [B, T, hc(src), hc(dst)] f32, collapsed u [B, T, D] (x.dtype).
    """
    b, t, _, d = x.shape
    flat = x.reshape(b, t, hc * d).astype(jnp.float32)
    flat = flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + rms_eps)
    m = jnp.einsum("btk,mk->btm", flat, fn.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    base = base.astype(jnp.float32)
    scale = scale.astype(jnp.float32)
    pre = jax.nn.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2.0 * jax.nn.sigmoid(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = m[..., 2 * hc:].reshape(b, t, hc, hc) * scale[2] + base[2 * hc:].reshape(hc, hc)
    comb = jax.nn.softmax(comb, axis=-1) + eps
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)

    def sinkhorn(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    # unrolled: one fused kernel instead of a device loop of ~4 tiny kernels per iteration
    # (the rolled loop cost ~150 launches per decode step per 4 layers on the H200)
    comb = jax.lax.fori_loop(0, iters - 1, sinkhorn, comb, unroll=True)
    u = jnp.sum(pre[..., None] * x.astype(jnp.float32), axis=2).astype(x.dtype)
    return post, comb, u


def mhc_post(x: jax.Array, y: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """X'[j] = post[j]·y + Σ_i comb[i, j]·X[i]; x [B, T, hc, D], y [B, T, D] -> [B, T, hc, D]."""
    dt = x.dtype
    placed = post.astype(dt)[..., None] * y[:, :, None, :]
    mixed = jnp.einsum("btij,btid->btjd", comb.astype(dt), x, preferred_element_type=jnp.float32)
    return (placed.astype(jnp.float32) + mixed).astype(dt)
