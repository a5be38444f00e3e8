"""Dense bf16 weight-streaming matmul on Hopper: one row on the CUDA-core GEMV (``gemv.py``),
more on the shared engine (``wdequant.py``, format ``bf16``) with its decode tiling. One H200,
one process, device µs at one row (RESULTS.md 2026-12-01 part 22), XLA / engine / GEMV:
6144x4096 17.6 / 15.1 / 13.5, 4096x4096 12.4 / 10.9 / 9.6, 24576x4096 50.8 / 46.4 / 46.7,
4096x12288 29.1 / 26.0 / 24.7 (XLA's product as an fp32 result cast to bf16, the form the linear
layers used then; with a bf16 result XLA took 11.0 µs at 4096x4096 and 27.1 at 4096x12288 in
part 34). At 8 and 64 rows the engine runs 0.91-1.03x XLA's GEMM."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.mxfp8 import wdequant as wd

from . import gemv
from .reference import validate

MAX_ROWS = 64       # the decode tiling's largest token tile; more rows belong to XLA's GEMM


def matmul_kernel(x, w, *, out_dtype=None, interpret=False, **plan_overrides):
    """x [..., K] @ w^T -> [..., N] for at most MAX_ROWS rows; plan_overrides: tk, splits, stages, bm."""
    validate(x, w)
    out_dtype = out_dtype or x.dtype
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).astype(jnp.bfloat16)
    m, n = x2.shape[0], w.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"the weight-streaming kernel takes at most {MAX_ROWS} rows, got {m}")
    if not plan_overrides and gemv.supported(m, n, k):
        return gemv.gemv(x2, w, out_dtype=jnp.dtype(out_dtype), interpret=interpret).reshape(*lead, n)
    np_, kp = wd.round_up(n, wd.BN), wd.round_up(k, 64)
    # N % 64 / K % 64 padding copies the weight (no real layer needs it).
    wp = wd.pad_cols(wd.pad_rows(w, np_), kp)
    y = wd.matmul_padded("bf16", wd.pad_cols(x2, kp), wp, (), n, out_dtype, interpret, **plan_overrides)
    return y.reshape(*lead, n)
