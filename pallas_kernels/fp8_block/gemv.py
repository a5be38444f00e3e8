"""Block FP8 (W8A16) on the one-row CUDA-core GEMV (`pallas_kernels/row_gemv.py`): 8 e4m3 codes
a thread and tile row (`row_gemv.decode_e4m3`, exact), each multiplied by its 128x128 block's
fp32 scale and rounded to bf16 -- the format's W8A16 numerics, ``bf16(f32(w_q) * scale)``
(`reference.py`) -- then multiplied by x (exact in fp32) and summed in fp32: the jnp twin's bf16
dot up to the summation order.

A tile's 16 rows lie in one 128-row block and its 1024 columns span 8 column blocks, so its
scales are 8 consecutive fp32 of one row of ``w_scale_inv`` (a 32-byte TMA box), each shared by
16 threads; the box lands in a 128-byte slot, TMA's alignment for every ring slot. The box
must fit a row of ``w_scale_inv`` (K >= 1024) whose stride TMA can take (K % 512 == 0).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, memref
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from pallas_kernels import row_gemv

BLOCK = 128
_TILE_BLOCKS = 8           # column blocks per tile: 1024 codes / 128


def _box(s_ref, item, kc):
    return s_ref.at[pl.ds(item * row_gemv.ROWS // BLOCK, 1), pl.ds(kc * _TILE_BLOCKS, _TILE_BLOCKS)]


def _read(s_smem, first):
    """The thread's block scale, the same for all its rows."""
    index = ir.IndexType.get()
    col = arith.index_cast(index, arith.divui(first, mgpu_utils.c(BLOCK, first.type)))
    return [memref.load(s_smem, [mgpu_utils.c(0, index), col])] * row_gemv.ROWS


def _scale_values(slot):
    return jnp.broadcast_to(slot[0][:, None], (_TILE_BLOCKS, row_gemv.ROWS))


FORMAT = row_gemv.Format(
    name="fp8_block_gemv", per_thread=8, block=BLOCK, factor=1.0, decode=row_gemv.decode_e4m3,
    values=row_gemv.e4m3_values, bf16_weights=True, k_step=512, min_k=BLOCK * _TILE_BLOCKS,
    scales=row_gemv.Scales(dtype=jnp.float32, slot=(4, _TILE_BLOCKS), box=_box, read=_read,
                           values=_scale_values))


def supported(m: int, n: int, k: int) -> bool:
    return row_gemv.supported(FORMAT, m, n, k)


def gemv(x, w_q, w_scale_inv, *, out_dtype, interpret=False, **fusions):
    """x [1, K] bf16, w_q [N, K] e4m3, w_scale_inv [ceil(N/128), K/128] f32 -> [1, N]
    out_dtype. ``fusions``: `row_gemv.gemv`'s keywords (``experts=``: its routed-expert form)."""
    return row_gemv.gemv(FORMAT, x, lax.bitcast_convert_type(w_q, jnp.uint8), w_scale_inv,
                         jnp.ones((1,), jnp.float32), out_dtype=out_dtype, interpret=interpret, **fusions)
