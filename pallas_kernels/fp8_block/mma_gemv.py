"""Block FP8 (W8A16) on the mma GEMV for 1-16 activation rows (`pallas_kernels/mma_gemv.py`; 9-16
rows where the plan splits K at most twice): one e4m3 code a byte, one fp32 scale per 128x128
block.

* operands: a word's 4 codes become fp32 (`row_gemv.decode_e4m3_word`, exact), each is
  multiplied by its block's fp32 scale and rounded to bf16 (`cvt.rn.bf16x2.f32`), operand i =
  codes (i, i + 2): the format's W8A16 weights ``bf16(f32(w_q) * scale)`` (`reference.py`) bit
  for bit, so the kernel agrees with the jnp twin up to the summation order;
* scales: an item's 32 or 64 rows lie in one 128-row block and a lane's 16-code runs each in
  one 128-column block, so a lane reads one fp32 per run. A ring slot takes 4 of the item's
  block-row scales (16 bytes, TMA's least box: one 32-row tile's worth, two 64-row tiles') and a
  tile reads its 4 or 2 of them, so K must be a multiple of 512;
* the outputs are multiplied by 1.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, memref
from jax.experimental import pallas as pl

from pallas_kernels import mma_gemv, row_gemv
from pallas_kernels.common import bf16x2_word, cst, ix

BLOCK = 128
_BOX = 4                     # block scales a TMA copy brings: 16 bytes


def _operands(word, scale):
    """bf16x2 (bf16(w_i * s), bf16(w_{i+2} * s)) for i = 0, 1."""
    v = [arith.mulf(w, scale) for w in row_gemv.decode_e4m3_word(word)]
    return [bf16x2_word(v[i], v[i + 2]) for i in range(2)]


def _read(view, kb, g, rows):
    """The tile's scale of K block kb, the same for all the lane's rows / 8 rows."""
    return [memref.load(view, [cst(0, ir.IndexType.get()), ix(kb)])] * (rows // 8)


def _tile_blocks(rows):
    """128-column blocks a tile spans: 2 for 64-row items, 4 for 32-row ones."""
    return mma_gemv.tile_bytes(rows) // BLOCK


def _box(s_ref, item, kc, rows):
    """The item's block-row scales of the _BOX blocks that hold K tile kc."""
    per_box = _BOX // _tile_blocks(rows)                   # tiles a box serves
    return s_ref.at[pl.ds(item * rows // BLOCK, 1), pl.ds(kc // per_box * _BOX, _BOX)]


def _view(slot, kc, rows):
    """K tile kc's scales in the slot that holds its box."""
    tb = _tile_blocks(rows)
    return slot.at[pl.ds(0, 1), pl.ds(lax.rem(kc, _BOX // tb) * tb, tb)]


SCALES = mma_gemv.Scales(dtype=jnp.float32, slot=lambda rows: (8, _BOX),   # 128 bytes, TMA's slot alignment
                         box=_box, view=_view, read=_read)


def _values(codes, scales):
    """jnp: bf16(f32(e4m3) * scale) as f32 (reduce_precision: kept by XLA on the CPU)."""
    w = row_gemv.e4m3_values(codes) * jnp.repeat(scales[0], BLOCK)
    return lax.reduce_precision(w, exponent_bits=8, mantissa_bits=7)


FORMAT = mma_gemv.Format(name="fp8_block_mma_gemv", codes_per_byte=1, block=BLOCK, pair=2, factor=1.0,
                         operands=_operands, scales=SCALES, values=_values, wide_max_splits=2,
                         k_step=BLOCK * _BOX)


def supported(m: int, n: int, k: int) -> bool:
    """`mma_gemv.supported`; 2-16 rows stay on the wgmma engine where the plan crowds some SMs
    (`mma_gemv.crowded`). One H200, public matmul, device us, engine against this GEMV
    (RESULTS.md part 53): 1024x7168 at 4 / 8 rows 5.27 / 5.53 against 5.79 / 5.88 (32 clusters of
    4 where 30 fit one CTA an SM), 1024x9728 6.29 / 6.38 against 6.70 / 6.97; where no SM is
    crowded, the GEMV ran 1.05-1.54x the engine at 4-8 rows on weights of 576-3072 rows (576x4096
    4.12 / 4.22 against 3.32 / 3.25, 3072x1536 at 8 rows 5.20 against 3.37)."""
    return mma_gemv.supported(FORMAT, m, n, k) and (m == 1 or not mma_gemv.crowded(FORMAT, n, k, m))


def gemv(x, w_q, w_scale_inv, *, out_dtype, interpret=False):
    """x [M, K] bf16 (1 <= M <= 16, `supported`), w_q [N, K] e4m3, w_scale_inv [ceil(N/128), K/128]
    f32 -> [M, N] out_dtype."""
    return mma_gemv.gemv(FORMAT, x, lax.bitcast_convert_type(w_q, jnp.uint8), w_scale_inv,
                         jnp.ones((1,), jnp.float32), out_dtype=out_dtype, interpret=interpret)
