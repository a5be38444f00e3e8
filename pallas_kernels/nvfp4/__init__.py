"""NVFP4 (ModelOpt) weight-only matmul (W4A16).

    y = matmul(x, w_q, w_scale, w_scale_2, *, backend="pallas", out_dtype=None, interpret=False)

  x          [..., K]   bf16 or f32 (enters the tensor cores as bf16)
  w_q        [N, K/2]   uint8, two E2M1 codes per byte, element 2i in the low nibble
  w_scale    [K/16, N]  float8_e4m3fn per-16 block scale, the checkpoint's [N, K/16] transposed
                        (one K block's scales for consecutive rows are contiguous: a K
                        step's scales are one TMA tile). Where N == K/16 the checkpoint's
                        layout has the same shape and no check can tell them apart: pass
                        ``weight_scale.T`` (the loader stores it so)
  w_scale_2  []         float32 global scale
  returns    [..., N]   out_dtype (default x.dtype), fp32 accumulation

ModelOpt's ``input_scale`` (W4A4 activation scale) is not an input: activations stay bf16.
backend="xla" is the jnp twin (``reference.py``); backend="pallas" the Mosaic GPU kernels
(``kernel.py``: the CUDA-core GEMV of ``gemv.py`` for one activation row, the `mma.sync`
GEMV of ``mma_gemv.py`` for 1-16 rows where it serves the shape (one row first there where it
is faster, `pallas_kernels.mma_gemv.takes_one_row`), the dequantizing tensor-core engine
otherwise, on the GPU its warp-specialized form for more than 64 rows; interpret=True
runs them on CPU). Chosen once per server.
"""

from __future__ import annotations

from pallas_kernels.common import check_matmul_io, no_rows

from .kernel import matmul_kernel
from .reference import dequantize_bf16, matmul_reference, validate

BACKENDS = ("pallas", "xla")


def matmul(x, w_q, w_scale, w_scale_2, *, backend="pallas", out_dtype=None, interpret=False):
    """See the module docstring."""
    check_matmul_io(x, out_dtype)
    if backend == "xla":
        return matmul_reference(x, w_q, w_scale, w_scale_2, out_dtype=out_dtype)
    if backend == "pallas":
        if x.size == 0:
            validate(x, w_q, w_scale, w_scale_2)
            return no_rows(x, w_q.shape[0], out_dtype)
        return matmul_kernel(x, w_q, w_scale, w_scale_2, out_dtype=out_dtype, interpret=interpret)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


__all__ = ["matmul", "matmul_kernel", "matmul_reference", "dequantize_bf16", "BACKENDS"]
