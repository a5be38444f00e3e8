"""Pure-jnp twin of the dense weight-streaming matmul: ``(bf16(x) @ w^T in fp32).astype(out)``."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.common import product_dtype


def validate(x, w) -> None:
    """ValueError naming the operand whose dtype or shape is wrong."""
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D [N, K], got shape {tuple(w.shape)}")
    if jnp.dtype(w.dtype) != jnp.dtype(jnp.bfloat16):
        raise ValueError(f"w must be bfloat16, got {w.dtype}")
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features but w has K={w.shape[1]}")


def matmul_reference(x, w, *, out_dtype=None):
    """x [..., K] -> [..., N]."""
    validate(x, w)
    out_dtype = out_dtype or x.dtype
    y = jnp.einsum("...k,nk->...n", x.astype(jnp.bfloat16), w, preferred_element_type=product_dtype(out_dtype))
    return y.astype(out_dtype)
