"""SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``; gate/up column-parallel, down row-parallel.

With ``limit`` (GLM-5.3's ``swiglu_limit``) the gate is clamped from above and up on both
sides before SiLU·mul.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from kk_jax.models.layers.linear import Linear, project


class SwiGLU(nnx.Module):
    FUSIBLE = {"gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, hidden: int, intermediate: int, dtype, limit: float | None = None):
        self.limit = limit
        self.gate_proj = Linear(hidden, intermediate, dtype, axes=("mlp", "embed"))
        self.up_proj = Linear(hidden, intermediate, dtype, axes=("mlp", "embed"))
        self.down_proj = Linear(intermediate, hidden, dtype, axes=("embed", "mlp"))

    def __call__(self, x: jax.Array, *, norm=None, residual: jax.Array | None = None) -> jax.Array:
        """``residual + down(silu(gate(norm(x))) * up(norm(x)))``, norm and residual optional (the
        linears fuse them into their kernels where they can)."""
        fused = getattr(self, "gate_up_proj", None)
        if fused is not None and self.limit is None:
            return self.down_proj(fused.swiglu(x, norm=norm), residual=residual)
        gate, up = project(self, "gate_up_proj", x, norm=norm)
        if self.limit is not None:
            gate = jnp.minimum(gate, self.limit)
            up = jnp.clip(up, -self.limit, self.limit)
        return self.down_proj(jax.nn.silu(gate) * up, residual=residual)
