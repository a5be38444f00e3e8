"""Linear layer over a weight stored in the Hugging Face layout ``[out_features, in_features]``.

Keeping the checkpoint layout lets the loader place tensors without transposing on the
host; XLA contracts the transposed operand for free.
"""

import jax
import jax.numpy as jnp
from flax import nnx


class Linear(nnx.Module):
    """``y[..., o] = sum_i x[..., i] * weight[o, i] (+ bias[o])``.

    ``axes`` names the logical axes of ``weight`` (e.g. ``("heads", "embed")`` for a
    column-parallel projection, ``("embed", "heads")`` for a row-parallel one).
    """

    def __init__(self, in_features: int, out_features: int, dtype, axes: tuple, bias: bool = False):
        self.weight = nnx.Param(jnp.zeros((out_features, in_features), dtype), axes=axes)
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype), axes=axes[:1]) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jnp.einsum("...i,oi->...o", x, self.weight[...], preferred_element_type=jnp.float32)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)
