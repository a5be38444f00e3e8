"""Weight-streaming matmul for unquantized (bf16) weights at decode sizes.

    y = matmul(x, w, *, backend="pallas", out_dtype=None, interpret=False)

  x        [..., K]  bf16 or f32 (enters the tensor cores as bf16)
  w        [N, K]    bf16, the checkpoint's [out_features, in_features]
  returns  [..., N]  out_dtype (default x.dtype), fp32 accumulation

A decode step reads every weight once for a handful of tokens, so its matmuls are bound by
HBM bandwidth. backend="pallas" runs one row on the CUDA-core GEMV (``gemv.py`` over
``pallas_kernels/row_gemv.py``) and up to 64 rows on the dequantizing engine's weight-streaming
tiling (``pallas_kernels/mxfp8/wdequant.py``, format ``bf16``: TMA-pipelined 64-row weight
tiles, swapped wgmma with the tokens in its N dimension, K split over CTAs).
Unquantized linears use it at batch-1 decode when the engine's ``dense_decode_backend`` resolves
to pallas, the default on a GPU (faster than XLA's GEMV at one row, not from 8 rows: ``kernel.py``). backend="xla" is
the jnp twin (XLA's dot).
interpret=True runs the kernel in Mosaic GPU interpret mode (CPU).
"""

from __future__ import annotations

from .kernel import MAX_ROWS, matmul_kernel
from .reference import matmul_reference

BACKENDS = ("pallas", "xla")


def matmul(x, w, *, backend="pallas", out_dtype=None, interpret=False):
    """See the module docstring."""
    if backend == "xla":
        return matmul_reference(x, w, out_dtype=out_dtype)
    if backend == "pallas":
        return matmul_kernel(x, w, out_dtype=out_dtype, interpret=interpret)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


__all__ = ["matmul", "matmul_kernel", "matmul_reference", "MAX_ROWS", "BACKENDS"]
