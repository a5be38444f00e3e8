"""Decode-sized expert projections on the one-row CUDA-core GEMV (``pallas_kernels/row_gemv.py``):
one GEMV per token-slot, against its routed expert's quantized weight, all token-slots in one
launch.

    y [P, N] = routed_gemv(x [P, K], experts [P], fmt, w, *scales)    # y[p] = x[p] @ W[experts[p]]^T

The grouped engine (``kernel.py``) multiplies row tiles of at least 8 rows on tensor cores; at
decode a tile holds one or two token-slots, and the engine's dequantization latency bounds it.
Here every 16-row item of every slot's expert streams through the GEMV's ring with that slot's x
chunk, so a slot costs its expert's bytes and nothing else. Operands as ``moe_quant`` documents
(experts stacked, MXFP8 / NVFP4 scales ``[E, K/b, N]``); the numerics are the dense GEMV's
(fp32 sums, one rounding to ``out_dtype``; NVFP4's ``weight_scale_2`` of each slot's expert
multiplies its sums before that rounding).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.common import check_matmul_io, no_rows
from pallas_kernels.fp8_block import gemv as fp8_block_gemv
from pallas_kernels.mxfp8 import gemv as mxfp8_gemv
from pallas_kernels.nvfp4 import gemv as nvfp4_gemv

from .reference import validate

_GEMVS = {"nvfp4": nvfp4_gemv, "mxfp8": mxfp8_gemv, "fp8_block": fp8_block_gemv}


def supported(fmt: str, n: int, k: int) -> bool:
    """Whether one expert's [N, K] weight fits the row GEMV (N % 16, K's step and range)."""
    return _GEMVS[fmt].supported(1, n, k)


def routed_gemv(x, experts, fmt, w, *scales, expert_offset=0, out_dtype=None, interpret=False):
    """x [P, K] (one row per token-slot), experts [P] int32 (each in [0, E)) -> [P, N] out_dtype
    (default x's). ``expert_offset`` as in ``grouped_matmul``: added to every expert index."""
    check_matmul_io(x, out_dtype)
    validate(x, experts, fmt, w, *scales)
    n, k = w.shape[1], x.shape[1]
    if x.shape[0] == 0:                                # no token-slots: no kernel to launch
        return no_rows(x, n, out_dtype)
    if not supported(fmt, n, k):
        raise ValueError(f"routed_gemv: {fmt} experts of [{n}, {k}] do not fit the row GEMV")
    e = (experts + jnp.asarray(expert_offset, jnp.int32)).astype(jnp.int32)
    per_slot = (scales[0], scales[1][e]) if fmt == "nvfp4" else scales      # NVFP4: each slot's weight_scale_2
    return _GEMVS[fmt].gemv(x, w, *per_slot, out_dtype=out_dtype or x.dtype, experts=e, interpret=interpret)
