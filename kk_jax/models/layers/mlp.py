"""SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``; gate/up column-parallel, down row-parallel."""

import jax
from flax import nnx

from kk_jax.models.layers.linear import Linear


class SwiGLU(nnx.Module):
    def __init__(self, hidden: int, intermediate: int, dtype):
        self.gate_proj = Linear(hidden, intermediate, dtype, axes=("mlp", "embed"))
        self.up_proj = Linear(hidden, intermediate, dtype, axes=("mlp", "embed"))
        self.down_proj = Linear(intermediate, hidden, dtype, axes=("embed", "mlp"))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
