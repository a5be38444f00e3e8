"""NVFP4 weight-streaming matmul for 2-16 activation rows (decode of small batches,
speculative verify) on the tensor cores' `mma.sync.m16n8k16` (bf16 operands, fp32 sums).

    y [M, N] = x [M, K] (bf16) @ (e2m1 * w_scale)^T * w_scale_2, fp32 sums, rounded once

The one-row GEMV (`gemv.py`) spends one FMA per weight; at M = 8 that would be eight, more than
an SM issues while HBM streams the codes. Here a thread decodes each code once into a bf16 `mma`
operand and the tensor cores do the M products, so the cost per byte barely depends on M:

* an item is ROWS = 64 weight rows; its K tiles (64 rows x 256 bytes = 512 codes of K, their
  e4m3 scales [32, 64] and x's [M, 512] slice) stream through a ring of TMA slots in
  persistent CTAs, which take the items round-robin;
* warp w takes bytes 64w..64w+63 of every row of a tile; lane (g, c) = (lane // 4, lane % 4)
  the 16 bytes 64w + 16c.. (32 codes) of the 8 tile rows 8g..8g+7. Row group r's mma row g is
  tile row 8g + 2r, its row g + 8 is 8g + 2r + 1: a lane's 8 rows are contiguous, so their
  block scales are one 8-byte load;
* a 32-bit word of codes (code i in bits 4i..4i+3) becomes four bf16x2 operands, pair i = (code
  i, code i + 4), each code as e2m1 * 2^-126 (its magnitude bits moved to bits 6-8, its sign to
  bit 15; code 1, 0.5, is the bf16 subnormal 2^-127), times its block scale * 2^116
  (`mul.rn.bf16x2`, exact: e2m1 * scale has at most 6 significant bits); the 2^10 left over
  joins w_scale_2 in the one multiplication of each output;
* each lane sums its codes in its own K order; x, the B operand, follows the same order (token
  g's two words from a 16-byte load by `prmt`), so every mma is a sum of exact products of bf16
  values in fp32 (the jnp twin's numerics up to the summation order);
* at an item's end the 4 warps' partial [64, M] sums meet in shared memory; the output leaves
  by TMA in the output dtype.

Interpret mode (CPU tests) runs the same ring and epilogue with jnp tile math.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, memref, vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import gpu_fence, hand_synced, interpret_kwargs, num_sms

from . import gemv as one_row
from .reference import BLOCK

ROWS = 64                    # weight rows per item
GROUPS = ROWS // 16          # m16 row groups per item
TILE_BYTES = 256             # bytes of codes per row and K tile (one TMA box)
TILE_K = 2 * TILE_BYTES      # K per tile
_X_BOX = 256                 # x is staged in [M, 256] boxes (the TMA box limit)
_STAGES = 2                  # ring slots per CTA
_CTAS_PER_SM = 3             # at most; fewer where shared memory runs out
_SM_SMEM = 228 * 1024
_CTA_SMEM_RESERVE = 2 * 1024
_FACTOR = 2.0 ** 10          # what the operands' 2^-126 * 2^116 leaves on every sum
MAX_M = 8                    # tokens: one n8 column block (two, for 9-16 rows, ran 2.5x slower)
MAX_SPLITS = 8               # K splits: CTAs of a cluster (the portable cluster size)

_MMA = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")


def supported(m: int, n: int, k: int) -> bool:
    """2 <= M <= 8 activation rows, N a multiple of 64, K a multiple of 512."""
    return 2 <= m <= MAX_M and n % ROWS == 0 and k % TILE_K == 0


_ACC = plgpu.Layout.WG_STRIDED((128, 4 * GROUPS), 4 * GROUPS)   # thread t: 4 sums per row group


def _tile_update(acc, w_ref, s_ref, x_ref, *, m, interpret):
    """acc += this tile's products. w_ref [64, 256] u8 codes, s_ref [32, 64] u8 e4m3 scales (K
    block, row), x_ref [2, 8, 256] bf16 (x's 512 K of the tile in two boxes; rows past M are
    not read into any stored output). Interpret mode: acc [64, M] f32, the same operand values
    (e2m1 * scale * 2^-10) summed by XLA."""
    if interpret:
        w = w_ref[...]
        scales = lax.bitcast_convert_type(s_ref[...], jnp.float8_e4m3fn).astype(jnp.float32)
        # e2m1 * 2^-14 (the one-row GEMV's decoding; the GPU's subnormal bf16 codes would be
        # flushed by XLA on the CPU) times scale * 2^4: e2m1 * scale * 2^-10
        wd = one_row.FORMAT.values(w) * jnp.repeat(scales.T * 2.0 ** 4, BLOCK, axis=1)
        xs = jnp.concatenate([x_ref[0, :m], x_ref[1, :m]], axis=1).astype(jnp.float32)
        return acc + jnp.dot(wd, xs.T, precision=lax.Precision.HIGHEST)
    @plgpu.inline_mgpu(arg_types=(_ACC, plgpu.RefType(), plgpu.RefType(), plgpu.RefType()),
                       return_type=plgpu.ShapeDtypeStruct((128, 4 * GROUPS), jnp.float32, layout=_ACC))
    def update(_, acc_in, w_smem, s_smem, x_smem):
        f32, i32, index = ir.F32Type.get(), ir.IntegerType.get_signless(32), ir.IndexType.get()
        i8, i16 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(16)
        cst = lambda v, ty=i32: mgpu_utils.c(v, ty)
        ix = lambda v: arith.index_cast(index, v)
        words_of = lambda vec, n: [vector.extract(mgpu_utils.bitcast(vec, ir.VectorType.get((n,), i32)), [], [e])
                                   for e in range(n)]
        asm = lambda args, text, cons: llvm.inline_asm(i32, args, text, cons)
        t = mgpu_utils.thread_idx()
        warp, lane = arith.shrui(t, cst(5)), arith.andi(t, cst(31))
        g, c = arith.shrui(lane, cst(2)), arith.andi(lane, cst(3))

        # x: token g, the lane's 32 K at column 128 (w % 2) + 32 c of box w // 2, as four 16-byte
        # sub-chunks s (x[8s .. 8s + 7] of the lane's 32); B operands per (s, e)
        box = ix(arith.shrui(warp, cst(1)))
        xcol = arith.addi(arith.muli(arith.andi(warp, cst(1)), cst(128)), arith.muli(c, cst(32)))
        bops = {}
        for s in range(4):
            xv = vector.load(ir.VectorType.get((8,), ir.BF16Type.get()), x_smem, [box, ix(g), ix(arith.addi(xcol, cst(8 * s)))])
            xw = words_of(xv, 4)                          # (x[2j], x[2j + 1]) of the sub-chunk
            for e in range(2):                            # (x[2e], x[2e + 4]), (x[2e + 1], x[2e + 5])
                bops[s, e] = [asm([xw[e], xw[e + 2]], "prmt.b32 $0, $1, $2, 0x5410;", "=r,r,r"),
                              asm([xw[e], xw[e + 2]], "prmt.b32 $0, $1, $2, 0x7632;", "=r,r,r")]

        # block scales of the lane's 8 rows for its two K blocks (8 w + 2 c + b), as bf16x2
        # (scale * 2^116, twice)
        half2 = ir.VectorType.get((2,), ir.F16Type.get())
        kb0 = arith.addi(arith.muli(warp, cst(8)), arith.muli(c, cst(2)))
        row0 = ix(arith.muli(g, cst(8)))
        scale = {}
        for b in range(2):
            sv = vector.load(ir.VectorType.get((8,), i8), s_smem, [ix(arith.addi(kb0, cst(b))), row0])
            pairs = mgpu_utils.bitcast(sv, ir.VectorType.get((4,), i16))
            for p in range(4):
                h = llvm.inline_asm(i32, [vector.extract(pairs, [], [p])], "cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h")
                hv = arith.extf(ir.VectorType.get((2,), f32), mgpu_utils.bitcast(h, half2))
                for e in range(2):
                    v = arith.mulf(vector.extract(hv, [], [e]), mgpu_utils.c(2.0 ** 116, f32))
                    scale[b, 2 * p + e] = llvm.inline_asm(i32, [v, v], "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f")

        keep = cst(0x81C081C0 - (1 << 32))
        high = {}

        def operand(word, i, sc):
            """bf16x2 (code i, code i + 4) of the word, each e2m1 * scale * 2^-10: the two codes
            (at bits p and p + 16 of the word or of the word >> 8) times 2^(6-p) + 2^(12-p) puts
            each code's magnitude at bits 6-8 and its sign at 15 (of its half); the mask drops the
            copies' other bits. The multiply runs on the FMA pipe, off the integer one."""
            src = word if i < 2 else high.setdefault(id(word), arith.shrui(word, cst(8)))
            p = 4 * (i % 2)
            codes = arith.andi(src, cst(0x000F000F << p))
            bits = arith.andi(arith.muli(codes, cst((1 << (6 - p)) + (1 << (12 - p)))), keep)
            return asm([bits, sc], "mul.rn.bf16x2 $0, $1, $2;", "=r,r,r")

        regs = acc_in.registers.flat[0]
        accs = [vector.extract(regs, [], [j]) for j in range(4 * GROUPS)]
        wcol = ix(arith.addi(arith.muli(warp, cst(64)), arith.muli(c, cst(16))))
        struct = llvm.StructType.get_literal([f32] * 4)
        for r in range(GROUPS):
            rows = [ix(arith.addi(arith.muli(g, cst(8)), cst(2 * r + h))) for h in range(2)]
            codes = [words_of(vector.load(ir.VectorType.get((16,), i8), w_smem, [row, wcol]), 4) for row in rows]
            for s in range(4):
                for e in range(2):
                    # a0 / a1: rows g / g + 8 at k-slots 2c, 2c + 1; a2 / a3 at 2c + 8, 2c + 9
                    a = [operand(codes[h][s], 2 * e + p, scale[s // 2, 2 * r + h]) for p in range(2) for h in range(2)]
                    d = llvm.inline_asm(struct, a + bops[s, e] + accs[4 * r:4 * r + 4], _MMA,
                                        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
                    accs[4 * r:4 * r + 4] = [llvm.extractvalue(f32, d, [q]) for q in range(4)]
        out = np.array([vector.from_elements(ir.VectorType.get((4 * GROUPS,), f32), accs)], dtype=object)
        return mgpu_fa.FragmentedArray(_registers=out, _layout=_ACC.to_mgpu(), _is_signed=None)

    return update(acc, w_ref, s_ref, x_ref)


def _owned(t, m, cst):
    """The (token, row) pairs of an item's output that thread t finishes: row t % 64, tokens
    t // 64 + 2j below M (as (predicate, token, row) triples)."""
    row, tok0 = arith.andi(t, cst(ROWS - 1)), arith.shrui(t, cst(6))
    for j in range(-(-m // 2)):
        tok = arith.addi(tok0, cst(2 * j))
        yield arith.cmpi(arith.CmpIPredicate.ult, tok, cst(m)), tok, row


def _warp_sums(acc, red_ref, *, m, interpret):
    """red_ref[0, tok, row] <- the item's sum D[row][tok] over the 4 warps, for the pairs each
    thread owns (`_owned`); red_ref [4, 8, 64] f32. Thread t's sums (row group r, element q) are
    D[8g + 2r + q // 2][2c + q % 2]."""
    if interpret:
        red_ref[0, pl.ds(0, m)] = acc.T
        return

    @plgpu.inline_mgpu(arg_types=(_ACC, plgpu.RefType()))
    def reduce(_, acc_in, red_smem):
        i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
        cst = lambda v, ty=i32: mgpu_utils.c(v, ty)
        ix = lambda v: arith.index_cast(index, v)
        t = mgpu_utils.thread_idx()
        warp, lane = arith.shrui(t, cst(5)), arith.andi(t, cst(31))
        g, c = arith.shrui(lane, cst(2)), arith.andi(lane, cst(3))
        regs = acc_in.registers.flat[0]
        for r in range(GROUPS):
            for q in range(4):
                tok = arith.addi(arith.muli(c, cst(2)), cst(q % 2))
                row = arith.addi(arith.muli(g, cst(8)), cst(2 * r + q // 2))
                memref.store(vector.extract(regs, [], [4 * r + q]), red_smem, [ix(warp), ix(tok), ix(row)])
        mgpu_utils.warpgroup_barrier()
        for pred, tok, row in _owned(t, m, cst):
            with mgpu_utils.when(pred):
                at = lambda w: [cst(w, index), ix(tok), ix(row)]
                total = memref.load(red_smem, at(0))
                for w in range(1, 4):
                    total = arith.addf(total, memref.load(red_smem, at(w)))
                memref.store(total, red_smem, at(0))

    reduce(acc, red_ref)


def _store_partial(red_ref, part_ref, *, m, interpret):
    """part_ref [M, 64] f32 (global memory) <- red_ref[0] (this CTA's sums over its K range)."""
    if interpret:
        part_ref[...] = red_ref[0, pl.ds(0, m)]
        return

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
    def store(_, red_smem, part_gmem):
        i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
        cst = lambda v, ty=i32: mgpu_utils.c(v, ty)
        ix = lambda v: arith.index_cast(index, v)
        for pred, tok, row in _owned(mgpu_utils.thread_idx(), m, cst):
            with mgpu_utils.when(pred):
                memref.store(memref.load(red_smem, [cst(0, index), ix(tok), ix(row)]), part_gmem,
                             [ix(tok), ix(row)])

    store(red_ref, part_ref)


def _finish(red_ref, parts_ref, s2_ref, y_ref, *, m, splits, interpret):
    """y_ref [8, 64] (output dtype; rows past M untouched) <- (red_ref[0] + the other cluster
    members' sums parts_ref[1:] [splits, M, 64] f32 in global memory) * w_scale_2 * 2^10."""
    if interpret:
        y_ref[pl.ds(0, m)] = (red_ref[0, pl.ds(0, m)] * (s2_ref[0] * _FACTOR)).astype(y_ref.dtype)
        return
    refs = (red_ref, s2_ref, y_ref) + ((parts_ref,) if splits > 1 else ())

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * len(refs))
    def finish(_, red_smem, s2_smem, y_smem, parts_gmem=None):
        i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
        cst = lambda v, ty=i32: mgpu_utils.c(v, ty)
        ix = lambda v: arith.index_cast(index, v)
        s2 = arith.mulf(memref.load(s2_smem, [cst(0, index)]), mgpu_utils.c(_FACTOR, ir.F32Type.get()))
        out_ty = ir.MemRefType(y_smem.type).element_type
        for pred, tok, row in _owned(mgpu_utils.thread_idx(), m, cst):
            with mgpu_utils.when(pred):
                total = memref.load(red_smem, [cst(0, index), ix(tok), ix(row)])
                for p in range(1, splits):
                    total = arith.addf(total, memref.load(parts_gmem, [cst(p, index), ix(tok), ix(row)]))
                total = arith.mulf(total, s2)
                if out_ty != total.type:
                    total = arith.truncf(out_ty, total)
                memref.store(total, y_smem, [ix(tok), ix(row)])

    finish(*refs)


def _plan(n: int, k: int, out_dtype) -> tuple[int, int]:
    """(CTAs per SM, K splits). A K split is a cluster of CTAs sharing an
    item, each over its own K tiles: the most that divides the tiles and keeps every CTA of a
    full grid busy (small N has fewer 64-row items than SMs)."""
    slot = ROWS * TILE_BYTES + (TILE_K // BLOCK) * ROWS + 2 * 8 * _X_BOX * 2
    smem = _STAGES * slot + 4 * 8 * ROWS * 4 + 8 * ROWS * jnp.dtype(out_dtype).itemsize + 4
    per_sm = max(1, min(_CTAS_PER_SM, _SM_SMEM // (smem + _CTA_SMEM_RESERVE)))
    items, kt = n // ROWS, k // TILE_K
    fit = max(1, min(MAX_SPLITS, kt, num_sms() * per_sm // items))
    return per_sm, max(s for s in range(1, fit + 1) if kt % s == 0)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def gemv(x, w_q, w_scale, w_scale_2, *, out_dtype, interpret=False):
    """x [M, K] bf16 (2 <= M <= 8), w_q [N, K/2] uint8, w_scale [K/16, N] e4m3 (or its bytes),
    w_scale_2 f32 (one value) -> [M, N] out_dtype (`supported` shapes).

    With K splits (`_plan`) a cluster's members write their sums to a scratch output and the
    first adds them after a cluster barrier; the Mosaic GPU interpreter has no clusters, so in
    interpret mode every member writes its sums and XLA adds them."""
    m, k = x.shape
    n = w_q.shape[0]
    if not supported(m, n, k) or w_q.shape[1] * 2 != k:
        raise ValueError(f"nvfp4 mma_gemv serves 2 <= M <= {MAX_M}, N % {ROWS} == 0, K % {TILE_K} == 0 with codes "
                         f"of K / 2 bytes; got M={m}, N={n}, K={k}, codes {w_q.shape}")
    per_sm, splits = _plan(n, k, out_dtype)
    items, kts = n // ROWS, k // TILE_K // splits
    clusters = min(items, num_sms() * per_sm // splits)
    s_bytes = lax.bitcast_convert_type(w_scale, jnp.uint8) if w_scale.dtype != jnp.uint8 else w_scale
    s2 = jnp.asarray(w_scale_2, jnp.float32).reshape(1)
    emulated = interpret and splits > 1              # members' sums added by XLA

    def kernel(x_ref, w_ref, s_ref, s2_ref, y_ref, *refs):
        part_ref = refs[0] if splits > 1 else None
        x_smem, w_smem, s_smem, red_smem, y_smem, s2_smem, bar, *cbar = refs[splits > 1:]
        cl, member = lax.axis_index("c"), lax.axis_index("s")
        tiles = lax.div(items - cl + clusters - 1, clusters) * kts   # items cl, cl + clusters, ... x K tiles

        def where(i):
            return cl + lax.div(i, kts) * clusters, member * kts + lax.rem(i, kts)

        def issue(i, slot):
            item, kc = where(i)
            b = bar.at[slot]
            plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(item * ROWS, ROWS), pl.ds(kc * TILE_BYTES, TILE_BYTES)],
                                    w_smem.at[slot], b)
            plgpu.copy_gmem_to_smem(s_ref.at[pl.ds(kc * (TILE_K // BLOCK), TILE_K // BLOCK), pl.ds(item * ROWS, ROWS)],
                                    s_smem.at[slot], b)
            for h in range(2):
                plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds(kc * TILE_K + h * _X_BOX, _X_BOX)],
                                        x_smem.at[slot, h, pl.ds(0, m)], b)

        for p in range(_STAGES):
            @pl.when(p < tiles)
            def _():
                issue(p, p)
        s2_smem[0] = s2_ref[0]

        def step(i, acc):
            slot = lax.rem(i, _STAGES)
            item, _ = where(i)
            plgpu.barrier_wait(bar.at[slot])
            acc = _tile_update(acc, w_smem.at[slot], s_smem.at[slot], x_smem.at[slot], m=m, interpret=interpret)
            plgpu.commit_smem()                               # every thread is done with the slot

            @pl.when(i + _STAGES < tiles)
            def _():
                issue(i + _STAGES, slot)

            last = lax.rem(i, kts) == kts - 1
            rows = pl.ds(item * ROWS, ROWS)

            @pl.when(last)
            def _():
                _warp_sums(acc, red_smem, m=m, interpret=interpret)
                if emulated:
                    _store_partial(red_smem, part_ref.at[member, :, rows], m=m, interpret=True)
                    return
                if splits > 1:
                    pl.when(member != 0)(lambda: _store_partial(red_smem, part_ref.at[member, :, rows], m=m,
                                                                interpret=interpret))
                    gpu_fence()
                    plgpu.barrier_arrive(cbar[0].at[0])
                    plgpu.barrier_wait(cbar[0].at[0])

                @pl.when(member == 0)
                def _():
                    if splits > 1:
                        gpu_fence()
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)     # y_smem free again
                    _finish(red_smem, part_ref.at[:, :, rows] if splits > 1 else None, s2_smem, y_smem, m=m,
                            splits=splits, interpret=interpret)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(y_smem.at[pl.ds(0, m)], y_ref.at[:, rows])

            return jnp.where(jnp.broadcast_to(last, acc.shape), jnp.zeros_like(acc), acc)

        if interpret:
            zero = jnp.zeros((ROWS, m), jnp.float32)
        else:
            zero = plgpu.layout_cast(jnp.zeros((128, 4 * GROUPS), jnp.float32), _ACC)
        lax.fori_loop(0, tiles, step, zero)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel.__name__ = "nvfp4_mma_gemv"
    if splits == 1 or interpret:
        layout = dict(grid=(clusters, splits), grid_names=("c", "s"))
    else:
        layout = dict(grid=(clusters,), grid_names=("c",), cluster=(splits,), cluster_names=("s",))
    merged = splits > 1 and not interpret
    call = plgpu.kernel(
        kernel, out_type=(jax.ShapeDtypeStruct((m, n), out_dtype),
                          *([jax.ShapeDtypeStruct((splits, m, n), jnp.float32)] if splits > 1 else [])),
        scratch_types=[plgpu.SMEM((_STAGES, 2, 8, _X_BOX), jnp.bfloat16),
                       plgpu.SMEM((_STAGES, ROWS, TILE_BYTES), jnp.uint8),
                       plgpu.SMEM((_STAGES, TILE_K // BLOCK, ROWS), jnp.uint8),
                       plgpu.SMEM((4, 8, ROWS), jnp.float32),
                       plgpu.SMEM((8, ROWS), out_dtype),
                       plgpu.SMEM((1,), jnp.float32),
                       plgpu.Barrier(num_arrivals=4, num_barriers=_STAGES),
                       *([plgpu.ClusterBarrier(collective_axes=("s",), num_arrivals=1, num_barriers=1)] if merged
                         else [])],
        **layout,
        compiler_params=hand_synced(approx_math=False),
        **interpret_kwargs(interpret))
    out = call(x.astype(jnp.bfloat16), w_q, s_bytes, s2)
    if emulated:
        return (out[1].sum(0) * (s2[0] * _FACTOR)).astype(out_dtype)
    return out[0]
