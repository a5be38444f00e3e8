"""NVFP4 weight-only matmul on Hopper (RESULTS.md part 35 for the H200 numbers below).

* One activation row (decode at batch 1) on a shape the CUDA-core GEMV serves: ``gemv.py``
  (the engine took 1.13-1.38x its time), except where the `mma.sync` GEMV leaves the busiest
  SM fewer K tiles, or as many on weights of 64 rows an SM and more
  (`pallas_kernels.mma_gemv.takes_one_row`): it is faster there.
* 1-16 rows otherwise: the `mma.sync` GEMV, ``mma_gemv.py`` (the engine took 3-19 % longer at
  2-8 rows, and was within 4 % at 12-16).
* Everything else: the shared dequantizing engine (``pallas_kernels/mxfp8/wdequant.py``, prefill
  in its warp-specialized form). Whole words of codes become wgmma register operands
  (``operands.py``) in a K order that x is stored in once per call (a pass over the
  activations, not the weights). K is padded to that order's 128-code step.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import mma_gemv as mma_kernel
from pallas_kernels.mxfp8 import wdequant as wd

from . import gemv, mma_gemv
from .reference import validate


def matmul_kernel(x, w_q, w_scale, w_scale_2, *, out_dtype=None, interpret=False, **plan_overrides):
    """x [..., K] @ (e2m1 * w_scale * w_scale_2)^T -> [..., N]; plan_overrides: tk, splits, stages, bm."""
    validate(x, w_q, w_scale, w_scale_2)
    out_dtype = out_dtype or x.dtype
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).astype(jnp.bfloat16)
    n = w_q.shape[0]
    s2 = jnp.asarray(w_scale_2, jnp.float32).reshape(1)
    if not plan_overrides:
        m = x2.shape[0]
        for form in mma_kernel.gemv_order(m, n, k, gemv, mma_gemv):
            if form.supported(m, n, k):
                y = form.gemv(x2, w_q, w_scale, s2, out_dtype=jnp.dtype(out_dtype), interpret=interpret)
                return y.reshape(*lead, n)
    np_, kp = wd.round_up(n, wd.BN), wd.round_up(k, wd.MIN_STEP["nvfp4"])
    # N / K padding copies the weight: only for shapes no real layer has (N % 64, K % 128).
    w = wd.pad_cols(wd.pad_rows(w_q, np_), kp // 2)
    s = wd.pad_cols(wd.pad_rows(w_scale, kp // 16), np_)
    y = wd.matmul_padded("nvfp4", wd.pad_cols(x2, kp), w, (s, s2), n, out_dtype, interpret, **plan_overrides)
    return y.reshape(*lead, n)
