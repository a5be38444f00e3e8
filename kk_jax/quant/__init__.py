"""Quantized weight formats kept quantized on the device.

``fp8_block`` (the DeepSeek/GLM release format), ``mxfp8`` and ``nvfp4`` (NVIDIA ModelOpt):
exact layouts, quantize/dequantize in jnp, and ``config`` (which format a checkpoint uses and
which linears it covers). The matmul kernels are in ``pallas_kernels.{fp8_block,mxfp8,nvfp4}``;
``kk_jax.models.layers.linear.Linear`` puts the two together.
"""

from kk_jax.quant import fp8_block, mxfp8, nvfp4  # noqa: F401
from kk_jax.quant.config import METHODS, QuantConfig, detect  # noqa: F401
