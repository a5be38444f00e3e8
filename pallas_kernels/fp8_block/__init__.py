"""Block-FP8 matmul (the DeepSeek-V3 / GLM-5.3 release format).

    y = matmul(x, w_q, w_scale_inv, *, block=(128, 128), act_quant=False,
               backend="pallas", out_dtype=None, interpret=False)

  x            [..., K]  bf16 or f32
  w_q          [N, K]    float8_e4m3fn
  w_scale_inv  [ceil(N/128), ceil(K/128)] float32: w = w_q * w_scale_inv[n // 128, k // 128]
  returns      [..., N]  out_dtype (default x.dtype), fp32 accumulation

act_quant=False: W8A16, weights dequantized once to bf16 (``bf16(f32(w_q) * scale)``).
act_quant=True: W8A8 with activations quantized per token and 128-wide K group, the
release's reference numerics and the fast prefill path (fp8 wgmma, DeepGEMM-style promotion);
it changes numerics against W8A16, so it is an explicit choice, never switched per call.
backend="xla" is the jnp twin (``reference.py``); backend="pallas" the Mosaic GPU kernels
(``kernel.py``: the CUDA-core GEMV of ``gemv.py`` for one W8A16 activation row, the tensor-core
GEMV of ``mma_gemv.py`` for 1-16 W8A16 rows (one row first on the
CUDA-core GEMV, except where the tensor-core one is faster,
`pallas_kernels.mma_gemv.takes_one_row`), and ``w8a8_ws.py`` for W8A8 calls
of more than 64 tokens on the GPU, their activations quantized by ``act_quant.py``;
interpret=True runs ``kernel.py``'s forms on CPU; 128x128 blocks only).
"""

from __future__ import annotations

from pallas_kernels.common import check_matmul_io, no_rows

from .kernel import check_block, matmul_kernel
from .reference import DEFAULT_BLOCK, dequantize_bf16, matmul_reference, quantize_activations, validate

BACKENDS = ("pallas", "xla")


def matmul(x, w_q, w_scale_inv, *, block=DEFAULT_BLOCK, act_quant=False, backend="pallas", out_dtype=None,
           interpret=False):
    """See the module docstring."""
    check_matmul_io(x, out_dtype)
    if backend == "xla":
        return matmul_reference(x, w_q, w_scale_inv, block=block, act_quant=act_quant, out_dtype=out_dtype)
    if backend == "pallas":
        if x.size == 0:
            validate(x, w_q, w_scale_inv, block)
            check_block(block)
            return no_rows(x, w_q.shape[0], out_dtype)
        return matmul_kernel(x, w_q, w_scale_inv, block=block, act_quant=act_quant, out_dtype=out_dtype,
                             interpret=interpret)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


__all__ = ["matmul", "matmul_kernel", "check_block", "matmul_reference", "dequantize_bf16", "quantize_activations",
           "BACKENDS"]
