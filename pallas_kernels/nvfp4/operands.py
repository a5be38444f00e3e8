"""NVFP4 codes as bf16 tensor-core operands, two codes per integer operation: shared by the mma
GEMV (``mma_gemv.py``, `mma.sync` A fragments) and the dequantizing wgmma engine
(``pallas_kernels/mxfp8/wdequant.py``, wgmma register A fragments).

* ``word_operands``: a 32-bit word's 8 codes (code i in bits 4i..4i+3) make four bf16x2
  operands, operand i = codes (i, i + 4). The two codes (at bits p and p + 16 of the word, or of
  the word >> 8) times 2^(6-p) + 2^(12-p) put each code's magnitude bits at 6-8 and its sign at
  15 of its half, i.e. e2m1 * 2^-126 as bf16 (code 1, 0.5, is the subnormal 2^-127); a mask
  drops the copies' other bits. The multiply runs on the FMA pipe, off the integer one that the
  decoding fills (1-2 % faster than shifts on the H200);
* ``scale_pairs``: e4m3 -> f16 by `cvt.rn.f16x2.e4m3x2` (exact) -> fp32, times 2^116, -> bf16
  (s, s); an operand times its scale is e2m1 * scale * 2^-10, at most 6 significant bits: exact
  in bf16. The outputs are multiplied by ``FACTOR`` = 2^10 (with ``weight_scale_2``).

The engine's fragments (``engine_fragments``) take whole words too, so its logical K order is a
permutation of the weight's within each K step: a thread's word fills the A
registers of its row in two k16 slices, and x is stored in the same order (``order_x``, one
pass over the activations per call, as the even / odd split it replaces was).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, memref, vector
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mma_gemv
from pallas_kernels.common import bf16x2_word, cst, ix

from . import gemv as one_row
from .reference import BLOCK

FACTOR = 2.0 ** 10                # outputs times FACTOR * weight_scale_2
ENGINE_STEPS = (256, 128)         # K steps (codes) the engine's fragments serve: 1 or 2 words a row and thread


def word_operands(word, scale):
    """Inline: i32 word of 8 codes, bf16x2 (s, s) -> 4 bf16x2 operands (codes (i, i + 4)) * s."""
    keep, high, out = cst(0x81C081C0 - (1 << 32)), arith.shrui(word, cst(8)), []
    for i in range(4):
        p = 4 * (i % 2)
        codes = arith.andi(word if i < 2 else high, cst(0x000F000F << p))
        out.append(arith.andi(arith.muli(codes, cst((1 << (6 - p)) + (1 << (12 - p)))), keep))
    return [mma_gemv.bf16x2_times(op, scale) for op in out]


def scale_pairs(sv):
    """Inline: vector<R x i8> of e4m3 scales -> R bf16x2 (scale * 2^116, the same)."""
    big = mgpu_utils.c(2.0 ** 116, ir.F32Type.get())
    return [bf16x2_word(v, v) for v in (arith.mulf(s, big) for s in one_row.e4m3_scales(sv))]


def values(codes, scales):
    """jnp: codes u8 [R, B] (two a byte), scales u8 [2 B / 16, R] (e4m3 bits) -> [R, 2 B] f32
    e2m1 * scale * 2^-10 in the weight's K order (from the one-row GEMV's e2m1 * 2^-14: the
    GPU's subnormal bf16 codes would be flushed by XLA on the CPU)."""
    s = lax.bitcast_convert_type(scales, jnp.float8_e4m3fn).astype(jnp.float32)
    return one_row.FORMAT.values(codes) * jnp.repeat(s.T * 2.0 ** 4, BLOCK, axis=1)


def order_x(x, tk: int):
    """x [M, K] (K % tk == 0) -> its columns in the engine's K order, the same in every step of
    tk codes: column l = 32 q + 8 t + 2 c + p of a step (slice pair q = 4 i + j, register column
    t, lane c % 4, half p of a wgmma A fragment) is code 32 (c I + i) + 8 j + t + 4 p, I = tk /
    128. Lane c's i-th 16-byte load of a row holds codes 32 (c I + i) .., word j of it the 8
    from 8 j, and register t of pair q half p of the word's operand t (``word_operands``)."""
    if tk not in ENGINE_STEPS:
        raise ValueError(f"the NVFP4 engine's K step is one of {ENGINE_STEPS}, got {tk}")
    m, k = x.shape
    y = x.reshape(m, k // tk, 4, tk // 128, 4, 2, 4)              # (c, i, j, p, t)
    return y.transpose(0, 1, 3, 4, 6, 2, 5).reshape(m, k)         # (i, j, t, c, p)


def engine_values(codes, scales, tk: int):
    """jnp twin of ``engine_fragments`` for the interpreter: a step's codes u8 [64, tk / 2] and
    scales [tk / 16, 64] (e4m3 bits) -> [64, tk] bf16 operand values in the engine's K order."""
    return order_x(values(codes, scales), tk).astype(jnp.bfloat16)


def step_fragments(w_ref, s_ref, *, tk: int, w_transforms):
    """All tk / 32 slice pairs of a step, in the engine's K order (``engine_fragments``)."""
    for load in range(tk // 128):
        yield from engine_fragments(w_ref, s_ref, load, tk=tk, w_transforms=w_transforms)


def engine_fragments(w_ref, s_ref, load: int, *, tk: int, w_transforms):
    """The step's wgmma A operands from its TMA-staged codes and scales: four [64, 32] bf16 arrays
    in the WGMMA layout, slice pairs 4 * load + j (j = 0..3) of the engine's K order.

    w_ref [64, tk / 2] u8 codes in shared memory, tiled (8, S) and S-swizzled (S = tk / 2 bytes,
    ``w_transforms``); s_ref [tk / 16, 64] e4m3 scales (or their bytes) (K block, row). Thread (warp w, lane
    4 g + c) holds rows 16 w + g and 16 w + g + 8: one 16-byte load of each (the lane's unit c I +
    load of the row: across a quarter warp's rows g and g + 1 the swizzle sends those 8 units to
    8 distinct bank groups) and the two e4m3 scales of their blocks."""
    n = tk // 128
    width = tk // 2
    xor_shift = (128 // width).bit_length() - 1        # 128 B swizzle: unit ^ (row % 8); 64 B: ^ (row % 8) // 2
    frag = plgpu.ShapeDtypeStruct((64, 32), jnp.bfloat16, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(w_transforms), plgpu.RefType()), return_type=(frag,) * 4)
    def fragments(_, w_smem, s_smem):
        i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
        bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
        t = mgpu_utils.thread_idx()
        warp, lane = arith.andi(arith.shrui(t, cst(5)), cst(3)), arith.andi(t, cst(31))   # in the warpgroup
        g, c = arith.shrui(lane, cst(2)), arith.andi(lane, cst(3))
        unit = arith.addi(arith.muli(c, cst(n)), cst(load))
        col = ix(arith.shli(arith.xori(unit, arith.shrui(g, cst(xor_shift))), cst(4)))
        blk = arith.shli(unit, cst(1))
        words, scales = [], []
        for h in range(2):
            row = arith.addi(arith.muli(warp, cst(16)), arith.addi(g, cst(8 * h)))
            codes = vector.load(ir.VectorType.get((16,), i8), w_smem,
                                [ix(arith.shrui(row, cst(3))), ix(cst(0)), ix(g), col], alignment=16)
            vec = mgpu_utils.bitcast(codes, ir.VectorType.get((4,), i32))
            words.append([vector.extract(vec, [], [e]) for e in range(4)])
            pair = [memref.load(s_smem, [ix(arith.addi(blk, cst(b))), ix(row)]) for b in range(2)]
            sv = vector.from_elements(ir.VectorType.get((2,), pair[0].type), pair)     # e4m3 or u8
            scales.append(scale_pairs(mgpu_utils.bitcast(sv, ir.VectorType.get((2,), i8))))
        out = []
        for j in range(4):
            ops = [word_operands(words[h][j], scales[h][j // 2]) for h in range(2)]
            regs = np.empty(mgpu_fa.WGMMA_LAYOUT.registers_shape((64, 32)), dtype=object)
            for r in range(4):               # register column r: cols 8r + 2c, + 1 = codes (r, r + 4)
                for h in range(2):
                    regs[0, r, 0, 0, h, 0, 0, 0, 0] = mgpu_utils.bitcast(ops[h][r], bf16x2)
            out.append(mgpu_fa.FragmentedArray(_registers=regs, _layout=mgpu_fa.WGMMA_LAYOUT, _is_signed=None))
        return tuple(out)

    return fragments(w_ref, s_ref)
