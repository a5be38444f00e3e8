"""What the three quantized matmuls (block FP8, MXFP8, NVFP4) share at their public entry:
activations and results must be floating point, and an x without rows gives an empty result
on both backends without a kernel launch."""

import jax.numpy as jnp
import numpy as np
import pytest

from kk_jax.quant import fp8_block as q_fp8_block
from kk_jax.quant import mxfp8 as q_mxfp8
from kk_jax.quant import nvfp4 as q_nvfp4
from pallas_kernels import fp8_block, mxfp8, nvfp4


def _operands(fmt, n=64, k=256):
    """(matmul, weight operands in the kernels' layout) of a random [n, k] weight."""
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    if fmt == "fp8_block":
        return fp8_block.matmul, q_fp8_block.quantize(w)
    if fmt == "mxfp8":
        q, s = q_mxfp8.quantize(w)
        return mxfp8.matmul, (q, s.T)
    q, s, s2 = q_nvfp4.quantize(w)
    return nvfp4.matmul, (q, s.T, s2)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp8", "nvfp4"])
def test_dtypes_and_empty_rows(fmt, backend):
    matmul, ops = _operands(fmt)
    run = dict(backend=backend, interpret=True)
    with pytest.raises(ValueError, match="x must be a floating-point array"):
        matmul(jnp.ones((2, 256), jnp.int32), *ops, **run)
    with pytest.raises(ValueError, match="out_dtype must be a floating type"):
        matmul(jnp.ones((2, 256), jnp.bfloat16), *ops, out_dtype=jnp.int8, **run)
    y = matmul(jnp.zeros((3, 0, 256), jnp.bfloat16), *ops, out_dtype=jnp.float32, **run)
    assert y.shape == (3, 0, 64) and y.dtype == jnp.float32
    with pytest.raises(ValueError, match="features but"):        # still validated without rows
        matmul(jnp.zeros((0, 128), jnp.bfloat16), *ops, **run)
