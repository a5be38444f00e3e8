"""MXFP8 (ModelOpt) weight-only matmul.

    y = matmul(x, w_q, w_scale, *, backend="pallas", out_dtype=None, interpret=False, wide_scales=None)

  x        [..., K]  bf16 or f32 (enters the tensor cores as bf16)
  w_q      [N, K]    float8_e4m3fn
  w_scale  [K/32, N] uint8 E8M0, the checkpoint's [N, K/32] transposed (one K block's scales
           for consecutive rows are contiguous: a K step's scales are one TMA tile; where
           N == K/32 the checkpoint's layout has the same shape and no check can tell them
           apart: pass ``weight_scale.T``, as the loader stores it):
           w[n, k] = w_q[n, k] * 2^(w_scale[k // 32, n] - 127); byte 255 (E8M0's NaN) is no
           scale: these kernels read it as 2^128 (the model loader refuses it)
  returns  [..., N]  out_dtype (default x.dtype), fp32 accumulation
  wide_scales  whether some E8M0 byte exceeds 134 (a 32-block whose largest weight passes 2^16):
           the mma GEMV cannot take those, so such calls run the engine; None reads it from
           a concrete w_scale (a traced one is taken as narrow; the linear layers pass it)

backend="xla": the jnp twin (``reference.py``): dequantize to bf16 (exact), XLA dot.
backend="pallas": Mosaic GPU kernels (``kernel.py``): weight tiles stay MXFP8 in HBM and are
dequantized in registers. One activation row runs the CUDA-core GEMV (``gemv.py``, over
``pallas_kernels/row_gemv.py``); 1-16 rows the `mma.sync` GEMV (``mma_gemv.py``) where it
serves the shape; other decode-shaped calls (M <= 64) the tensor-core engine (``wdequant.py``)
with K split across CTAs to stream the weights at full bandwidth; larger M its prefill tiling,
on the GPU its warp-specialized form (``prefill_ws.py``). interpret=True runs them in Mosaic GPU interpret mode (CPU). The backend is
chosen once per server.
"""

from __future__ import annotations

from pallas_kernels.common import check_matmul_io, no_rows

from .kernel import matmul_kernel
from .reference import dequantize_bf16, matmul_reference, validate

BACKENDS = ("pallas", "xla")


def matmul(x, w_q, w_scale, *, backend="pallas", out_dtype=None, interpret=False, wide_scales=None):
    """See the module docstring."""
    check_matmul_io(x, out_dtype)
    if backend == "xla":
        return matmul_reference(x, w_q, w_scale, out_dtype=out_dtype)
    if backend == "pallas":
        if x.size == 0:
            validate(x, w_q, w_scale)
            return no_rows(x, w_q.shape[0], out_dtype)
        return matmul_kernel(x, w_q, w_scale, out_dtype=out_dtype, interpret=interpret, wide_scales=wide_scales)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


__all__ = ["matmul", "matmul_kernel", "matmul_reference", "dequantize_bf16", "BACKENDS"]
