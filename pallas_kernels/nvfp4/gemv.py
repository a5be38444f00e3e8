"""NVFP4 weight-only GEMV for a single activation row (decode at batch 1), on CUDA cores.

    y [1, N] = x [1, K] (bf16) @ (e2m1 * w_scale * w_scale_2)^T, fp32 accumulation

At one row the tensor-core engine (`mxfp8/wdequant.py`) spends its time in the latency of
dequantizing into `wgmma` operands, not in HBM (RESULTS.md: ~1 TB/s of NVFP4 bytes). Here the
weights stream through a ring of shared-memory slots in persistent CTAs (as the KDA decode
does) and every thread turns nibbles into fp32 products itself:

* a tile is R = 16 weight rows x 2048 K elements (16 KiB of codes, 128 16-element blocks):
  thread t owns block t of every row of the tile, so its 16 x values and 16 block scales are
  read once per tile and its row sums need no other thread until the item's last tile;
* E2M1 -> fp32 exactly, two codes per 32-bit operation: a code's three magnitude bits shifted
  to bits 9-11 of an f16 and its sign to bit 15 are the f16 value e2m1 * 2^-14 (code 1, 0.5,
  lands on the f16 subnormal 2^-15), and f16 -> fp32 conversion is exact; the 2^14 joins
  w_scale_2 in the one multiplication of each output, which the kernel writes in the output
  dtype (no XLA pass after it);
* block scales (e4m3) convert by `cvt.rn.f16x2.e4m3x2`, exact;
* at an item's last tile the 128 threads' row sums are added by a butterfly that halves the
  rows at each step (16 shuffles a thread) and one exchange through shared memory.

Numerics: products x * e2m1 are exact in fp32; the 16 products of a block are summed in fp32,
multiplied by the block scale and accumulated in fp32 -- a different summation order from the
jnp twin's bf16 dot, same precision class (fp32 accumulation). Interpret mode runs the same
tile math in jnp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, memref, vector
from jax._src.lib.mlir.dialects import math as mlir_math
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import hand_synced, interpret_kwargs, num_sms

from .reference import BLOCK

ROWS = 16                    # weight rows per item (and per tile)
TILE_K = 2048                # K elements per tile: 128 blocks of 16, one per thread
_QUARTER = 256               # bytes per TMA box along K (a box is at most 256 elements wide)
_STAGES = 4
_CTAS_PER_SM = 2
_X_ROW = 256                 # x is staged as [K / 256, 256] bf16 (same box limit)
MAX_K = 16384                # x must fit shared memory next to the ring (32 KiB of bf16)
SCALE_2_FACTOR = 2.0 ** 14   # the f16 decoding leaves every value 2^-14 small; the kernel
                             # multiplies it back in with w_scale_2
_ACC = plgpu.Layout.WG_STRIDED((128, ROWS), ROWS)   # thread t: its row sums for block t


def supported(m: int, n: int, k: int) -> bool:
    """Shapes this kernel serves: one activation row, N a multiple of 16, K of 2048."""
    return m == 1 and n % ROWS == 0 and k % TILE_K == 0 and k <= MAX_K


def _values(codes):
    """e2m1 * 2^-14 as fp32 for uint8 codes: the GPU's bit decoding, elementwise."""
    c = codes.astype(jnp.uint16)
    bits = ((c & 7) << 9) | ((c & 8) << 12)
    return lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _tile_update(acc, w_ref, s_ref, x_ref, *, interpret):
    """acc [128, ROWS] f32 += for block t and row r: scale[t, r] sum_j x[16 t + j] w[r, 16 t + j].
    w_ref [4, ROWS, 256] u8 (K quarters), s_ref [128, ROWS] u8 (e4m3), x_ref [8, 256] bf16."""
    if interpret:
        w = jnp.concatenate([w_ref[q] for q in range(4)], axis=1)              # [ROWS, 1024]
        codes = jnp.stack([w & 0x0F, w >> 4], axis=-1).reshape(ROWS, TILE_K)
        prod = _values(codes) * x_ref[...].reshape(TILE_K).astype(jnp.float32)
        sums = prod.reshape(ROWS, TILE_K // BLOCK, BLOCK).sum(-1)               # [ROWS, 128]
        scale = lax.bitcast_convert_type(s_ref[...], jnp.float8_e4m3fn).astype(jnp.float32)
        return acc + sums.T * scale

    @plgpu.inline_mgpu(arg_types=(_ACC, plgpu.RefType(), plgpu.RefType(), plgpu.RefType()),
                       return_type=plgpu.ShapeDtypeStruct((128, ROWS), jnp.float32, layout=_ACC))
    def update(_, acc_in, w_smem, s_smem, x_smem):
        f32, i32, i16, index = (ir.F32Type.get(), ir.IntegerType.get_signless(32),
                                ir.IntegerType.get_signless(16), ir.IndexType.get())
        cst = lambda v, ty=i32: mgpu_utils.c(v, ty)
        ix = lambda v: arith.index_cast(index, v)
        t = mgpu_utils.thread_idx()
        warp, lane = arith.shrui(t, cst(5)), arith.andi(t, cst(31))
        # x[16 t .. 16 t + 15]: row t // 16 of the [8, 256] chunk, columns 16 (t % 16) + ...
        x_at = [ix(arith.shrui(t, cst(4))), ix(arith.muli(arith.andi(t, cst(15)), cst(BLOCK)))]
        xv = vector.load(ir.VectorType.get((BLOCK,), ir.BF16Type.get()), x_smem, x_at)
        xv = arith.extf(ir.VectorType.get((BLOCK,), f32), xv)
        xs = [vector.extract(xv, [], [e]) for e in range(BLOCK)]
        # the block's ROWS scales: row t of s_smem, e4m3 pairs -> f16x2 -> fp32
        sv = vector.load(ir.VectorType.get((ROWS,), ir.IntegerType.get_signless(8)), s_smem,
                         [ix(t), cst(0, index)])
        pairs = mgpu_utils.bitcast(sv, ir.VectorType.get((ROWS // 2,), i16))
        half2 = ir.VectorType.get((2,), ir.F16Type.get())
        scales = []
        for p in range(ROWS // 2):
            h = llvm.inline_asm(i32, [vector.extract(pairs, [], [p])],
                                "cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h")
            hv = arith.extf(ir.VectorType.get((2,), f32), mgpu_utils.bitcast(h, half2))
            scales += [vector.extract(hv, [], [e]) for e in range(2)]

        def decode(word):
            """The 8 codes of a word (code e in bits 4e..4e+3) as fp32 e2m1 * 2^-14, in order."""
            mag, sgn = cst(0x0E000E00), cst(0x80008000 - (1 << 32))
            shifted = [(9, 12), (5, 8), (1, 4), (-3, 0)]       # codes (e, e + 4) for e = 0..3
            out = [None] * 8
            for e, (sm, ss) in enumerate(shifted):
                m = arith.shli(word, cst(sm)) if sm >= 0 else arith.shrui(word, cst(-sm))
                s = arith.shli(word, cst(ss)) if ss else word
                h = arith.ori(arith.andi(m, mag), arith.andi(s, sgn))
                v = arith.extf(ir.VectorType.get((2,), f32), mgpu_utils.bitcast(h, half2))
                out[e], out[e + 4] = vector.extract(v, [], [0]), vector.extract(v, [], [1])
            return out

        accs = [vector.extract(acc_in.registers.flat[0], [], [r]) for r in range(ROWS)]
        col = ix(arith.muli(lane, cst(8)))
        for r in range(ROWS):
            wv = vector.load(ir.VectorType.get((8,), ir.IntegerType.get_signless(8)), w_smem,
                             [ix(warp), cst(r, index), col])
            words = mgpu_utils.bitcast(wv, ir.VectorType.get((2,), i32))
            vals = decode(vector.extract(words, [], [0])) + decode(vector.extract(words, [], [1]))
            part = [arith.mulf(vals[0], xs[0]), arith.mulf(vals[1], xs[1])]   # two chains
            for j in range(2, BLOCK):
                part[j % 2] = mlir_math.fma(vals[j], xs[j], part[j % 2])
            accs[r] = mlir_math.fma(arith.addf(part[0], part[1]), scales[r], accs[r])
        regs = np.array([vector.from_elements(ir.VectorType.get((ROWS,), f32), accs)], dtype=object)
        return mgpu_fa.FragmentedArray(_registers=regs, _layout=_ACC.to_mgpu(), _is_signed=None)

    return update(acc, w_ref, s_ref, x_ref)


def _item_sums(acc, red_ref, s2_ref, y_ref, *, interpret):
    """y_ref [1, ROWS] (output dtype) <- the sum of acc [128, ROWS] over its 128 threads (rows
    of acc) times SCALE_2_FACTOR * w_scale_2 (s2_ref [1] f32 in HBM), rounded once."""
    if interpret:
        total = acc.sum(0, keepdims=True) * (SCALE_2_FACTOR * s2_ref[0])
        y_ref[...] = total.astype(y_ref.dtype)
        return

    @plgpu.inline_mgpu(arg_types=(_ACC, plgpu.RefType(), plgpu.RefType(), plgpu.RefType()))
    def reduce(_, acc_in, red_smem, s2_gmem, y_smem):
        i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
        cst = lambda v, ty=i32: mgpu_utils.c(v, ty)
        ix = lambda v: arith.index_cast(index, v)
        t = mgpu_utils.thread_idx()
        warp, lane = arith.shrui(t, cst(5)), arith.andi(t, cst(31))
        vals = [vector.extract(acc_in.registers.flat[0], [], [r]) for r in range(ROWS)]
        # butterfly over lanes 16, 8, 4, 2: a lane keeps the upper or lower half of its rows and
        # adds its partner's copy of them; afterwards lane l holds row (l >> 1) over 16 lanes
        for dist in (16, 8, 4, 2):
            half = len(vals) // 2
            upper = arith.cmpi(arith.CmpIPredicate.ne, arith.andi(lane, cst(dist)), cst(0))
            nxt = []
            for j in range(half):
                keep = arith.select(upper, vals[half + j], vals[j])
                send = arith.select(upper, vals[j], vals[half + j])
                nxt.append(arith.addf(keep, mgpu_utils.shfl_bfly(send, dist)))
            vals = nxt
        v = arith.addf(vals[0], mgpu_utils.shfl_bfly(vals[0], 1))
        row = ix(arith.shrui(lane, cst(1)))
        even = arith.cmpi(arith.CmpIPredicate.eq, arith.andi(lane, cst(1)), cst(0))
        with mgpu_utils.when(even):
            memref.store(v, red_smem, [ix(warp), row])
        mgpu_utils.warpgroup_barrier()
        with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.ult, t, cst(ROWS))):
            total = memref.load(red_smem, [cst(0, index), ix(t)])
            for w in range(1, 4):
                total = arith.addf(total, memref.load(red_smem, [cst(w, index), ix(t)]))
            s2 = memref.load(s2_gmem, [cst(0, index)])
            total = arith.mulf(total, arith.mulf(s2, mgpu_utils.c(SCALE_2_FACTOR, s2.type)))
            out_ty = ir.MemRefType(y_smem.type).element_type
            if out_ty != total.type:
                total = arith.truncf(out_ty, total)
            memref.store(total, y_smem, [cst(0, index), ix(t)])

    reduce(acc, red_ref, s2_ref, y_ref)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def gemv(x, w_q, w_scale, w_scale_2, *, out_dtype, interpret=False):
    """x [1, K] bf16, w_q [N, K/2] uint8, w_scale [K/16, N] e4m3, w_scale_2 [] / [1] f32 ->
    [1, N] out_dtype = x @ (e2m1 * w_scale * w_scale_2)^T, rounded once from fp32. Persistent CTAs take the 16-row items round-robin and stream each item's K tiles through
    a ring of `_STAGES` shared-memory slots; x sits in shared memory for the whole call."""
    n, k = w_q.shape[0], 2 * w_q.shape[1]
    if not supported(x.shape[0], n, k):
        raise ValueError(f"the NVFP4 GEMV serves M = 1, N % {ROWS} == 0, K % {TILE_K} == 0, K <= "
                         f"{MAX_K}; got M={x.shape[0]}, N={n}, K={k}")
    kcn, items = k // TILE_K, n // ROWS
    ctas = min(items, num_sms() * _CTAS_PER_SM)
    xs = x.astype(jnp.bfloat16).reshape(k // _X_ROW, _X_ROW)
    s8 = lax.bitcast_convert_type(w_scale, jnp.uint8)
    s2 = jnp.asarray(w_scale_2, jnp.float32).reshape(1)
    x_rows = TILE_K // _X_ROW

    def nvfp4_gemv(x_ref, w_ref, s_ref, s2_ref, y_ref, x_smem, w_smem, s_smem, y_smem, red_smem,
                   bar, xbar):
        c = lax.axis_index("c")
        tiles = lax.div(items - c + ctas - 1, ctas) * kcn     # items c, c + ctas, ... x K tiles

        def where(i):
            return c + lax.div(i, kcn) * ctas, lax.rem(i, kcn)

        def issue(i, slot):
            item, kc = where(i)
            rows, b = pl.ds(item * ROWS, ROWS), bar.at[slot]
            for q in range(4):
                cols = pl.ds(kc * (TILE_K // 2) + q * _QUARTER, _QUARTER)
                plgpu.copy_gmem_to_smem(w_ref.at[rows, cols], w_smem.at[slot, q], b)
            plgpu.copy_gmem_to_smem(s_ref.at[pl.ds(kc * (TILE_K // BLOCK), TILE_K // BLOCK), rows],
                                    s_smem.at[slot], b)

        plgpu.copy_gmem_to_smem(x_ref, x_smem, xbar.at[0])
        for p in range(_STAGES):
            @pl.when(p < tiles)
            def _():
                issue(p, p)
        plgpu.barrier_wait(xbar.at[0])

        def step(i, acc):
            slot = lax.rem(i, _STAGES)
            item, kc = where(i)
            plgpu.barrier_wait(bar.at[slot])
            acc = _tile_update(acc, w_smem.at[slot], s_smem.at[slot],
                               x_smem.at[pl.ds(kc * x_rows, x_rows)], interpret=interpret)
            plgpu.commit_smem()                           # every thread is done with the slot

            @pl.when(i + _STAGES < tiles)
            def _():
                issue(i + _STAGES, slot)

            last = kc == kcn - 1

            @pl.when(last)
            def _():
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)    # y_smem free again
                _item_sums(acc, red_smem, s2_ref, y_smem, interpret=interpret)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(y_smem, y_ref.at[:, pl.ds(item * ROWS, ROWS)])

            return jnp.where(jnp.broadcast_to(last, acc.shape), jnp.zeros_like(acc), acc)

        zero = plgpu.layout_cast(jnp.zeros((128, ROWS), jnp.float32), _ACC)
        lax.fori_loop(0, tiles, step, zero)
        plgpu.wait_smem_to_gmem(0)

    u8 = jnp.uint8
    call = plgpu.kernel(
        nvfp4_gemv, out_type=jax.ShapeDtypeStruct((1, n), out_dtype),
        scratch_types=[plgpu.SMEM(xs.shape, jnp.bfloat16),
                       plgpu.SMEM((_STAGES, 4, ROWS, _QUARTER), u8),
                       plgpu.SMEM((_STAGES, TILE_K // BLOCK, ROWS), u8),
                       plgpu.SMEM((1, ROWS), out_dtype),
                       plgpu.SMEM((4, ROWS), jnp.float32),
                       plgpu.Barrier(num_arrivals=5, num_barriers=_STAGES),
                       plgpu.Barrier(num_arrivals=1, num_barriers=1)],
        grid=(ctas,), grid_names=("c",),
        compiler_params=hand_synced(approx_math=False),
        **interpret_kwargs(interpret))
    return call(xs, w_q, s8, s2)
