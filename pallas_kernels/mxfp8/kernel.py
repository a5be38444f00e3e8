"""MXFP8 weight-only matmul on Hopper: the shared dequantizing engine (``wdequant.py``) with
32-column groups, one E8M0 scale per row and group. See ``wdequant`` for the design."""

from __future__ import annotations

import jax.numpy as jnp

from . import wdequant as wd
from .reference import validate


def matmul_kernel(x, w_q, w_scale, *, out_dtype=None, interpret=False, **plan_overrides):
    """x [..., K] @ dequant(w_q)^T -> [..., N]; plan_overrides: tk, splits, stages, bm."""
    validate(x, w_q, w_scale)
    out_dtype = out_dtype or x.dtype
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).astype(jnp.bfloat16)
    m, n = x2.shape[0], w_q.shape[0]
    np_, kp = wd.round_up(n, wd.BN), wd.round_up(k, 64)
    p = wd.plan(m, np_, kp, "mxfp8", **plan_overrides)
    xp = wd.pad_cols(wd.pad_rows(x2, wd.round_up(m, p.bm)), kp)
    # The weight is padded per call only when N or K is not a multiple of 64 (never for real
    # layers); padded K columns meet zero activations, so their scales (E8M0 0) do not matter.
    w, s = wd.pad_cols(wd.pad_rows(w_q, np_), kp), wd.pad_rows(wd.pad_cols(w_scale, np_), kp // 32)
    y = wd.wdequant_matmul((xp,), w, (s,), fmt="mxfp8", p=p, out_dtype=out_dtype, interpret=interpret)
    return wd.finish(y, p, m, n, out_dtype).reshape(*lead, n)
