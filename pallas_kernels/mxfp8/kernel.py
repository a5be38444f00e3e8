"""MXFP8 weight-only matmul on Hopper: one activation row on a shape the CUDA-core GEMV serves
goes there (``gemv.py``), 1-16 rows on a shape the `mma.sync` GEMV serves to it
(``mma_gemv.py``); everything else runs the shared dequantizing engine (``wdequant.py``) with
32-column groups, one E8M0 scale per row and group. See ``wdequant`` for the design."""

from __future__ import annotations

import jax.numpy as jnp

from . import gemv, mma_gemv
from . import wdequant as wd
from .reference import validate


def matmul_kernel(x, w_q, w_scale, *, out_dtype=None, interpret=False, wide_scales=None, **plan_overrides):
    """x [..., K] @ dequant(w_q)^T -> [..., N]; plan_overrides: tk, splits, stages, bm.
    ``wide_scales``: whether some E8M0 byte exceeds ``mma_gemv.MAX_SCALE`` (1-16 rows then run
    the engine); None reads it from a concrete w_scale (``mma_gemv.wide_scales``)."""
    validate(x, w_q, w_scale)
    out_dtype = out_dtype or x.dtype
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).astype(jnp.bfloat16)
    n = w_q.shape[0]
    if not plan_overrides and gemv.supported(x2.shape[0], n, k):
        y = gemv.gemv(x2, w_q, w_scale, out_dtype=jnp.dtype(out_dtype), interpret=interpret)
        return y.reshape(*lead, n)
    if (not plan_overrides and mma_gemv.supported(x2.shape[0], n, k)
            and not (mma_gemv.wide_scales(w_scale) if wide_scales is None else wide_scales)):
        return mma_gemv.gemv(x2, w_q, w_scale, out_dtype=jnp.dtype(out_dtype), interpret=interpret).reshape(*lead, n)
    np_, kp = wd.round_up(n, wd.BN), wd.round_up(k, 64)
    # The weight is padded per call only when N or K is not a multiple of 64 (odd test shapes, or
    # a tensor-parallel shard with K an odd multiple of 32); padded K columns meet zero
    # activations, so their scales (E8M0 0) do not matter.
    w, s = wd.pad_cols(wd.pad_rows(w_q, np_), kp), wd.pad_rows(wd.pad_cols(w_scale, np_), kp // 32)
    y = wd.matmul_padded("mxfp8", wd.pad_cols(x2, kp), w, (s,), n, out_dtype, interpret, **plan_overrides)
    return y.reshape(*lead, n)
