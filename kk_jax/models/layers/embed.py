"""Token embedding ``weight [vocab, hidden]`` (vocab-parallel); doubles as a tied lm_head."""

import jax
import jax.numpy as jnp
from flax import nnx


class Embedding(nnx.Module):
    def __init__(self, vocab: int, dim: int, dtype):
        self.weight = nnx.Param(jnp.zeros((vocab, dim), dtype), axes=("vocab", "embed"))

    def __call__(self, ids: jax.Array) -> jax.Array:
        """ids [...] int32 -> [..., hidden]."""
        return jnp.take(self.weight[...], ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied output projection: x [..., hidden] -> logits [..., vocab] in fp32."""
        return jnp.einsum("...d,vd->...v", x, self.weight[...], preferred_element_type=jnp.float32)
