"""Weight-streaming GEMV for a single activation row (decode at batch 1) on CUDA cores, for
weight formats whose codes take 8 bytes per thread and tile row: NVFP4 (16 codes), MXFP8 and
block FP8 (8 codes), bf16 (4 weights, no scales).

    y [1, N] = x [1, K] (bf16) @ dequant(w)^T, fp32 accumulation, rounded once to out_dtype

At one row the tensor-core engine (`mxfp8/wdequant.py`) spends its time in the latency of
dequantizing into `wgmma` operands, not in HBM. Here the weights stream through a ring of
shared-memory slots in persistent CTAs (as the KDA decode does) and every thread turns codes
into fp32 products itself:

* a tile is ROWS = 16 weight rows x 1024 bytes of codes (four 256-byte TMA boxes), their block
  scales (`Scales.box`, into the slot's `Scales.slot` buffer) and the matching x chunk; thread t
  owns bytes 8t..8t+7 of every row of the tile (`per_thread` weights), so its x values and
  block scales are read once per tile and its row sums need no other thread until the item's
  last tile;
* the format decodes its 8 bytes into fp32 values (`Format.decode`) and reads its block scales
  (`Scales.read`), inline Mosaic GPU code; `Format.values` / `Scales.values` are the jnp forms
  interpret mode runs. A power-of-two or exactly representable scale multiplies the thread's
  row sum; block FP8's fp32 scales multiply every weight, rounded to bf16 as the format's jnp
  twin does (`Format.bf16_weights`);
* at an item's last tile the 128 threads' row sums are added by a butterfly that halves the
  rows at each step (16 shuffles a thread) and one exchange through shared memory, multiplied
  by `factor * w_scale_2` (one per member of a fused projection) and written in the output
  dtype;
* a decoder layer's neighbours can run inside (`fusable`): the RMSNorm of x before the
  product (every CTA normalises its staged copy), a bf16 residual added to the output, or the
  SwiGLU of a fused [gate; up] projection (a CTA takes a gate item, then its up item);
* routed experts (`experts=`, `moe_quant.routed_gemv`): P rows of x, each against its own
  expert's weight of a stacked [E, N, K'] set, one launch; items are (row, 16 weight rows) and
  every tile brings its row's x chunk with the codes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

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

from pallas_kernels.common import (CTA_SMEM_RESERVE, SMEM_PER_SM, bf16x2_word, cst, e4m3x2_to_f32,
                                    hand_synced, interpret_kwargs, ix, num_sms)

ROWS = 16                    # weight rows per item (and per tile)
ROW_BYTES = 1024             # bytes of codes per row and tile: 8 per thread
_BOX = 256                   # bytes per TMA box along K (a box is at most 256 elements wide)
_STAGES = 2                  # ring slots per CTA and CTAs per SM: a sweep on the H200 (2-5 slots,
_CTAS_PER_SM = 3             # 2-4 CTAs) found 2 x 3 fastest, 3-6 % ahead of 4 x 2 (RESULTS.md)
_X_ROW = 256                 # x is staged as [K / 256, 256] bf16 (same box limit)
MAX_K = 16384                # x must fit shared memory next to the ring (32 KiB of bf16)
_ACC = plgpu.Layout.WG_STRIDED((128, ROWS), ROWS)   # thread t: its ROWS row sums


class Scales(NamedTuple):
    """Where a tile's block scales come from and how a thread reads them."""
    dtype: object      # element type of the scale array
    slot: tuple        # shared-memory buffer per ring slot (the box lands in its leading rows)
    box: Callable      # (scale ref in HBM, item, K tile) -> the view copied into the slot
    read: Callable     # inline: (slot ref, thread's first K in the tile) -> ROWS fp32 scales
    values: Callable   # jnp: slot contents -> [tile K / block, ROWS] fp32


class Format(NamedTuple):
    """What a quantized format brings to the GEMV (codes are 8 bytes a thread and tile row)."""
    name: str          # the kernel's name in traces
    per_thread: int    # weights in a thread's 8 bytes
    block: int         # weights along K per block scale
    factor: float      # constant every output is multiplied by (with w_scale_2)
    decode: Callable   # inline: (i32 word, i32 word) -> per_thread fp32 values, in K order
    values: Callable   # jnp: uint8 [..., bytes] -> fp32 [..., per_thread / 8 * bytes]
    scales: Scales | None        # None: unscaled weights (bf16)
    bf16_weights: bool = False   # every weight is bf16(value * scale) (else the sums are scaled)
    k_step: int = 256            # K must be a multiple of this (x is staged in 256-wide rows) ...
    min_k: int = 0               # ... and at least this (else: one weight box, tile_k / 4)

    @property
    def tile_k(self) -> int:
        return 128 * self.per_thread


def row_scales(block: int, per_thread: int, convert: Callable, values: Callable) -> Scales:
    """Scales for a uint8 [K / block, N] array (NVFP4, MXFP8: one scale per row and K block, a
    K block's row scales contiguous): a tile's [tile K / block, ROWS] box; ``convert`` turns a
    vector<ROWS x i8> of one block's row scales into ROWS fp32 values (inline), ``values`` is
    its jnp form."""
    rows = 128 * per_thread // block

    def box(s_ref, item, kc):
        return s_ref.at[pl.ds(kc * rows, rows), pl.ds(item * ROWS, ROWS)]

    def read(s_smem, first):
        index = ir.IndexType.get()
        at = arith.index_cast(index, arith.divui(first, mgpu_utils.c(block, first.type)))
        sv = vector.load(ir.VectorType.get((ROWS,), ir.IntegerType.get_signless(8)), s_smem,
                         [at, mgpu_utils.c(0, index)])
        return convert(sv)

    return Scales(dtype=jnp.uint8, slot=(rows, ROWS), box=box, read=read, values=values)


def decode_e4m3_word(word):
    """The 4 e4m3 bytes of a word as fp32, in byte order: two per `cvt.rn.f16x2.e4m3x2` (exact),
    then exact f16 -> fp32."""
    i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)
    return [v for shift in (0, 16)
            for v in e4m3x2_to_f32(arith.trunci(i16, arith.shrui(word, mgpu_utils.c(shift, i32)) if shift else word))]


def decode_e4m3(w0, w1):
    """The 8 e4m3 bytes of two words as fp32, in K order (byte 0 of w0 first; MXFP8 and block
    FP8 codes)."""
    return decode_e4m3_word(w0) + decode_e4m3_word(w1)


def e4m3_values(w):
    """jnp form of `decode_e4m3`: uint8 e4m3 bytes -> fp32."""
    return lax.bitcast_convert_type(w, jnp.float8_e4m3fn).astype(jnp.float32)


MAX_NORM_K = 8192        # the norm weight is staged next to x
MAX_RESIDUAL_N = 8192    # the residual is staged whole


def fusable(n: int, k: int, out_dtype, *, norm: bool, residual: bool, glu: bool = False) -> bool:
    """Whether `gemv` can fuse an RMSNorm of x (K), a bf16 residual add (N, out_dtype) and / or
    the SwiGLU of its two halves (N a multiple of 32, bf16 out, no residual)."""
    bf16_out = jnp.dtype(out_dtype) == jnp.dtype(jnp.bfloat16)
    return ((not norm or k <= MAX_NORM_K)
            and (not residual or (n % _X_ROW == 0 and n <= MAX_RESIDUAL_N and bf16_out and not glu))
            and (not glu or (n % (2 * ROWS) == 0 and bf16_out)))


def _padded_k(fmt: Format, k: int) -> int:
    return -(-k // fmt.tile_k) * fmt.tile_k


def _smem(fmt: Format, kp: int, *, routed=False, extra_bytes=0, glu=False, scales_2=1) -> int:
    """Shared-memory bytes of a CTA: x staged whole (not routed), the ring, the fusions' vectors,
    the row sums' exchange, the gate's values and the global scales."""
    slot = ROWS * ROW_BYTES + (np.prod(fmt.scales.slot) * jnp.dtype(fmt.scales.dtype).itemsize
                               if fmt.scales is not None else 0)
    slot += 2 * fmt.tile_k if routed else 0        # the tile's x chunk
    return int(2 * kp * (not routed) + _STAGES * slot + extra_bytes + 4 * ROWS * 4 + ROWS * 4 * (1 + glu)
               + 4 * scales_2)


def _ctas(units: int, smem: int) -> int:
    """Persistent CTAs for ``units`` items: as many per SM as are resident at once (a persistent
    grid must not run in waves)."""
    return min(units, num_sms() * max(1, min(_CTAS_PER_SM, SMEM_PER_SM // (smem + CTA_SMEM_RESERVE))))


def busiest_tiles(fmt: Format, n: int, k: int) -> int:
    """K tiles (16 rows x 1 KiB of codes, a partial last tile counted whole) that the busiest SM
    streams for one unfused row of an N x K weight: ceil(CTAs / SMs) CTAs of ceil(items / CTAs)
    items, as `mma_gemv._plan` counts its own (`mma_gemv.takes_one_row` compares the two)."""
    kp, items = _padded_k(fmt, k), n // ROWS
    ctas = _ctas(items, _smem(fmt, kp))
    return -(-ctas // num_sms()) * -(-items // ctas) * (kp // fmt.tile_k)


def supported(fmt: Format, m: int, n: int, k: int) -> bool:
    """Shapes the GEMV serves: one activation row, N a multiple of 16, K a multiple of
    `k_step` (a partial last tile reads zeros past K) of at least one TMA box of codes."""
    return (m == 1 and n % ROWS == 0 and k % fmt.k_step == 0 and _padded_k(fmt, k) <= MAX_K
            and k >= max(fmt.min_k, fmt.tile_k // 4))


def _tile_update(fmt, acc, w_ref, s_ref, x_ref, *, interpret):
    """acc [128, ROWS] f32 += for thread t and row r: the sum over its weights j of x[j] times
    w[r, j] dequantized. w_ref [4, ROWS, 256] u8, s_ref the slot's scales (`Scales.slot`),
    x_ref [tile_k / 256, 256] bf16 (this tile's K range)."""
    pt = fmt.per_thread
    if interpret:
        w = jnp.concatenate([w_ref[q] for q in range(4)], axis=1)              # [ROWS, 1024]
        vals = fmt.values(w)
        if fmt.scales is not None:
            vals = vals * jnp.repeat(fmt.scales.values(s_ref[...]), fmt.block, axis=0).T
        if fmt.bf16_weights:
            vals = lax.reduce_precision(vals, exponent_bits=8, mantissa_bits=7)   # bf16, kept by XLA
        prod = vals * x_ref[...].reshape(fmt.tile_k).astype(jnp.float32)
        return acc + prod.reshape(ROWS, 128, pt).sum(-1).T
    refs = (w_ref, x_ref) + ((s_ref,) if fmt.scales is not None else ())

    @plgpu.inline_mgpu(arg_types=(_ACC,) + (plgpu.RefType(),) * len(refs),
                       return_type=plgpu.ShapeDtypeStruct((128, ROWS), jnp.float32, layout=_ACC))
    def update(_, acc_in, w_smem, x_smem, s_smem=None):
        f32, i32, index = ir.F32Type.get(), ir.IntegerType.get_signless(32), ir.IndexType.get()
        i8 = ir.IntegerType.get_signless(8)
        t = mgpu_utils.thread_idx()
        warp, lane = arith.shrui(t, cst(5)), arith.andi(t, cst(31))
        # x[pt t .. pt t + pt - 1]: row (pt t) // 256 of the chunk, column (pt t) % 256
        first = arith.muli(t, cst(pt))
        x_at = [ix(arith.shrui(first, cst(8))), ix(arith.andi(first, cst(_X_ROW - 1)))]
        xv = vector.load(ir.VectorType.get((pt,), ir.BF16Type.get()), x_smem, x_at)
        xv = arith.extf(ir.VectorType.get((pt,), f32), xv)
        xs = [vector.extract(xv, [], [e]) for e in range(pt)]
        scales = fmt.scales.read(s_smem, first) if fmt.scales is not None else None
        accs = [vector.extract(acc_in.registers.flat[0], [], [r]) for r in range(ROWS)]
        col = ix(arith.muli(lane, cst(8)))
        for r in range(ROWS):
            wv = vector.load(ir.VectorType.get((8,), i8), w_smem, [ix(warp), cst(r, index), col])
            words = mgpu_utils.bitcast(wv, ir.VectorType.get((2,), i32))
            vals = fmt.decode(vector.extract(words, [], [0]), vector.extract(words, [], [1]))
            if fmt.bf16_weights:
                vals = _bf16_rounded([arith.mulf(v, scales[r]) for v in vals])
            part = [arith.mulf(vals[0], xs[0]), arith.mulf(vals[1], xs[1])]   # two chains
            for j in range(2, pt):
                part[j % 2] = mlir_math.fma(vals[j], xs[j], part[j % 2])
            total = arith.addf(part[0], part[1])
            accs[r] = (mlir_math.fma(total, scales[r], accs[r]) if scales and not fmt.bf16_weights
                       else arith.addf(total, accs[r]))
        regs = np.array([vector.from_elements(ir.VectorType.get((ROWS,), f32), accs)], dtype=object)
        return mgpu_fa.FragmentedArray(_registers=regs, _layout=_ACC.to_mgpu(), _is_signed=None)

    return update(acc, *refs)


def _rms_normalize(x_ref, w_ref, red_ref, *, k, eps, interpret):
    """x_ref [K / 256, 256] bf16 <- bf16(x * rsqrt(sum(x^2) / K + eps) * w), the math in fp32
    (the models' RMSNorm, up to `rsqrt.approx.f32` and the summation order); w_ref like
    x_ref. Thread t rewrites columns 2t, 2t + 1 of every row; the warps' sums of squares meet
    in red_ref; the barrier at the end makes the normalised x whole for every thread."""
    rows = k // _X_ROW
    if interpret:
        xf = x_ref[pl.ds(0, rows)].astype(jnp.float32)
        r = lax.rsqrt(jnp.sum(xf * xf) * (1.0 / k) + eps)
        x_ref[pl.ds(0, rows)] = (xf * r * w_ref[...].astype(jnp.float32)).astype(jnp.bfloat16)
        return

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 3)
    def normalize(_, x_smem, w_smem, red_smem):
        f32, index = ir.F32Type.get(), ir.IndexType.get()
        t = mgpu_utils.thread_idx()
        warp, lane = arith.shrui(t, cst(5)), arith.andi(t, cst(31))
        bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
        f32x2 = ir.VectorType.get((2,), f32)
        col = ix(arith.muli(t, cst(2)))                      # thread t: columns 2t, 2t + 1
        xs = [arith.extf(f32x2, vector.load(bf16x2, x_smem, [cst(r, index), col])) for r in range(rows)]
        ss = None
        for v in xs:
            for e in range(2):
                xe = vector.extract(v, [], [e])
                ss = arith.mulf(xe, xe) if ss is None else mlir_math.fma(xe, xe, ss)
        for dist in (16, 8, 4, 2, 1):
            ss = arith.addf(ss, mgpu_utils.shfl_bfly(ss, dist))
        with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.eq, lane, cst(0))):
            memref.store(ss, red_smem, [ix(warp), cst(0, index)])
        mgpu_utils.warpgroup_barrier()
        total = memref.load(red_smem, [cst(0, index), cst(0, index)])
        for w in range(1, 4):
            total = arith.addf(total, memref.load(red_smem, [cst(w, index), cst(0, index)]))
        mean = arith.addf(arith.mulf(total, mgpu_utils.c(1.0 / k, f32)), mgpu_utils.c(eps, f32))
        r = llvm.inline_asm(f32, [mean], "rsqrt.approx.f32 $0, $1;", "=f,f")
        rv = vector.broadcast(f32x2, r)
        for row, v in enumerate(xs):
            wv = arith.extf(f32x2, vector.load(bf16x2, w_smem, [cst(row, index), col]))
            vector.store(arith.truncf(bf16x2, arith.mulf(arith.mulf(v, rv), wv)), x_smem,
                         [cst(row, index), col])
        mgpu_utils.warpgroup_barrier()

    normalize(x_ref, w_ref, red_ref)


def _warpgroup_sync():
    @plgpu.inline_mgpu()
    def sync(_):
        mgpu_utils.warpgroup_barrier()

    sync()


def _bf16_rounded(vals):
    """fp32 values rounded to the nearest-even bf16 (two per `cvt.rn.bf16x2.f32`), as fp32."""
    i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
    out = []
    for lo, hi in zip(vals[::2], vals[1::2]):
        pair = bf16x2_word(lo, hi)
        out += [arith.bitcast(f32, arith.shli(pair, mgpu_utils.c(16, i32))),
                arith.bitcast(f32, arith.andi(pair, mgpu_utils.c(-(1 << 16), i32)))]
    return out


def silu_times(g, u):
    """jnp form of the GLU epilogue: silu(g) * u of bf16 g, u in fp32, rounded once to bf16 (the
    model's ``jax.nn.silu(gate) * up`` without its intermediate roundings)."""
    gf = g.astype(jnp.float32)
    return (gf * jax.nn.sigmoid(gf) * u.astype(jnp.float32)).astype(jnp.bfloat16)


def _item_sums(fmt, acc, red_ref, s2_ref, y_ref, res_ref, *, interpret, s2_at=0, gate_ref=None):
    """y_ref [1, ROWS] (output dtype) <- the sum of acc [128, ROWS] over its 128 threads times
    fmt.factor * w_scale_2 (s2_ref[s2_at], f32 in shared memory), rounded once; plus, with res_ref
    (the item's [1, ROWS] bf16 residual), res + that, rounded again (a bf16 residual add); or, with
    gate_ref (the [1, ROWS] bf16 gate of these rows, this item being their up projection),
    silu(gate) * that (`silu_times`)."""
    if interpret:
        total = (acc.sum(0, keepdims=True) * (fmt.factor * s2_ref[s2_at])).astype(y_ref.dtype)
        if res_ref is not None:
            total = (res_ref[...].astype(jnp.float32) + total.astype(jnp.float32)).astype(y_ref.dtype)
        if gate_ref is not None:
            total = silu_times(gate_ref[...], total)
        y_ref[...] = total
        return

    refs = (red_ref, s2_ref, y_ref) + tuple(r for r in (res_ref, gate_ref) if r is not None)

    @plgpu.inline_mgpu(arg_types=(_ACC,) + (plgpu.RefType(),) * len(refs))
    def reduce(_, acc_in, red_smem, s2_smem, y_smem, extra_smem=None):
        res_smem, gate_smem = (extra_smem, None) if res_ref is not None else (None, extra_smem)
        index = ir.IndexType.get()
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
            s2 = memref.load(s2_smem, [cst(s2_at, index)])
            total = arith.mulf(total, arith.mulf(s2, mgpu_utils.c(fmt.factor, s2.type)))
            out_ty = ir.MemRefType(y_smem.type).element_type
            if out_ty != total.type:
                total = arith.truncf(out_ty, total)
            f32 = ir.F32Type.get()
            if res_smem is not None:
                res = arith.extf(f32, memref.load(res_smem, [cst(0, index), ix(t)]))
                total = arith.truncf(out_ty, arith.addf(res, arith.extf(f32, total)))
            if gate_smem is not None:
                g = arith.extf(f32, memref.load(gate_smem, [cst(0, index), ix(t)]))
                # silu(g) = g / (1 + 2^(-g log2 e)), times the up value, rounded once
                e = llvm.inline_asm(f32, [arith.mulf(g, mgpu_utils.c(-1.4426950408889634, f32))],
                                    "ex2.approx.ftz.f32 $0, $1;", "=f,f")
                act = arith.divf(g, arith.addf(mgpu_utils.c(1.0, f32), e))
                total = arith.truncf(out_ty, arith.mulf(act, arith.extf(f32, total)))
            memref.store(total, y_smem, [cst(0, index), ix(t)])

    reduce(acc, *refs)


@functools.partial(jax.jit, static_argnames=("fmt", "out_dtype", "eps", "glu", "segments", "interpret"))
def gemv(fmt, x, w_bytes, scales, w_scale_2, *, out_dtype, norm_weight=None, eps=None, residual=None,
         glu=False, segments=None, experts=None, interpret=False):
    """x [1, K] bf16; w_bytes uint8 codes [N, K * 1024 / tile_k] (NVFP4: [N, K/2], MXFP8: the
    e4m3 bytes [N, K]); scales in the format's layout (`Scales`); w_scale_2 [] / [1] f32 ->
    [1, N] out_dtype. Persistent CTAs take the 16-row items round-robin and stream each item's
    K tiles through a ring of `_STAGES` slots; x sits in shared memory for the whole call. A
    last tile past K gets zeros from TMA for its codes and scales, and zeros of x.

    Fusions of a decoder layer's neighbours (`fusable`): norm_weight [K] bf16 (with eps) applies
    the models' RMSNorm to x in every CTA first (K <= MAX_NORM_K); residual [1, N] bf16 (N a
    multiple of 256, at most MAX_RESIDUAL_N; bf16 out) is added to the output, rounded as XLA's
    bf16 add rounds; glu (bf16 out, N a multiple of 32): the weight is a fused [gate; up]
    projection, w_scale_2 [2] holds their two global scales, and the output [1, N / 2] is
    silu(gate) * up of the rounded halves (`silu_times`): a CTA takes a gate item and then the
    matching up item, keeping the gate's 16 values in shared memory.

    segments (rows of each member of a fused projection, multiples of 16 summing to N; glu: two
    halves): w_scale_2 holds one global scale per member, each applied to its member's rows.

    experts [P] int32 (routed experts, one GEMV per token-slot): x [P, K] holds P rows, w_bytes
    [E, N, K'] and scales [E, ...] stack E experts' operands in the layouts above, w_scale_2 [P]
    holds each row's global scale (or [1], one for all), and the output [P, N] has row p = x[p] @ expert experts[p]'s
    weight^T. Each tile brings its row's x chunk through the ring with the codes (x is not staged
    whole); no fusions."""
    routed = experts is not None
    n, k = w_bytes.shape[-2], x.shape[1]
    if (not supported(fmt, 1 if routed else x.shape[0], n, k) or w_bytes.shape[-1] * fmt.tile_k != k * ROW_BYTES
            or w_bytes.ndim != 2 + routed):
        raise ValueError(f"{fmt.name} serves M = 1, N % {ROWS} == 0, K % {fmt.k_step} == 0, "
                         f"{max(fmt.min_k, fmt.tile_k // 4)} <= K <= {MAX_K} with codes of K "
                         f"columns; got M={x.shape[0]}, N={n}, K={k}, codes {w_bytes.shape}"
                         + (" (experts given: codes [E, N, K'])" if routed else ""))
    if routed and (norm_weight is not None or residual is not None or glu or segments
                  or experts.shape != (x.shape[0],) or jnp.size(w_scale_2) not in (1, x.shape[0])):
        raise ValueError(f"{fmt.name}: with experts, x [P, K], experts [P], w_scale_2 [P] or [1] and no fusions; got "
                         f"x {x.shape}, experts {experts.shape}, w_scale_2 {jnp.shape(w_scale_2)}")
    kp = _padded_k(fmt, k)
    kcn, items = kp // fmt.tile_k, n // ROWS
    rows_x = x.shape[0] if routed else 1           # rows of x (and of the output)
    units = items // 2 if glu else items * rows_x   # what a CTA takes at a time: an item or a gate/up pair
    xs = x.astype(jnp.bfloat16).reshape((rows_x,) * routed + (k // _X_ROW, _X_ROW))
    x_rows = fmt.tile_k // _X_ROW
    scaled, normed, res = fmt.scales is not None, norm_weight is not None, residual is not None
    if not fusable(n, k, out_dtype, norm=normed, residual=res, glu=glu):
        raise ValueError(f"{fmt.name} fuses RMSNorm for K <= {MAX_NORM_K}, a residual for N % 256 == 0, "
                         f"N <= {MAX_RESIDUAL_N}, bf16 out, and SwiGLU for N % 32 == 0, bf16 out, no residual; "
                         f"got N={n}, K={k}, {jnp.dtype(out_dtype).name}, residual={res}, glu={glu}")
    segments = tuple(segments or ((n // 2, n // 2) if glu else (n,)))
    s2 = jnp.asarray(w_scale_2, jnp.float32).reshape(-1)
    if routed:                                     # one per row, a whole number of 16-byte TMA rows
        s2 = jnp.pad(jnp.broadcast_to(s2, (rows_x,)), (0, -rows_x % 4))
    elif (sum(segments) != n or any(r % ROWS for r in segments) or (glu and segments != (n // 2,) * 2)
            or s2.shape[0] not in (1, len(segments))):
        raise ValueError(f"{fmt.name}: segments {segments} must be multiples of {ROWS} rows summing to N={n} "
                         f"(two halves with glu), with one w_scale_2 each or one for all; got {s2.shape[0]}")
    shared = s2.shape[0] == 1                     # one global scale for every row
    starts = np.cumsum((0,) + segments)
    extras = (([norm_weight.astype(jnp.bfloat16).reshape(k // _X_ROW, _X_ROW)] if normed else [])
              + ([residual.astype(jnp.bfloat16).reshape(n // _X_ROW, _X_ROW)] if res else []))
    ctas = _ctas(units, _smem(fmt, kp, routed=routed, extra_bytes=sum(2 * a.size for a in extras), glu=glu,
                              scales_2=s2.shape[0]))

    def kernel(*refs):
        refs = list(refs)
        take = lambda cond: refs.pop(0) if cond else None
        x_ref, w_ref, s_ref, s2_ref, e_ref, nw_ref, r_ref, y_ref = (
            take(True), take(True), take(scaled), take(True), take(routed), take(normed), take(res), take(True))
        x_smem, w_smem, s_smem, nw_smem, r_smem, y_smem, g_smem, red_smem, s2_smem, bar, xbar = (
            take(True), take(True), take(scaled), take(normed), take(res), take(True), take(glu), take(True),
            take(True), take(True), take(True))
        c = lax.axis_index("c")
        per_unit = kcn * (1 + glu)
        tiles = lax.div(units - c + ctas - 1, ctas) * per_unit    # units c, c + ctas, ... x K tiles

        def where(i):
            """(unit, item, K tile, up half of a pair) of the CTA's i-th tile; routed, a unit is
            item unit % items of x's row unit // items."""
            unit, j = c + lax.div(i, per_unit) * ctas, lax.rem(i, per_unit)
            if routed:
                return unit, lax.rem(unit, items), j, False
            up = j >= kcn
            return unit, unit + jnp.where(up, units, 0), lax.rem(j, kcn), up

        def issue(i, slot):
            unit, item, kc, _ = where(i)
            rows, b = pl.ds(item * ROWS, ROWS), bar.at[slot]
            if routed:
                row = lax.div(unit, items)
                expert = e_ref[row]
                w_at, s_at = w_ref.at[expert], s_ref.at[expert] if scaled else None
                plgpu.copy_gmem_to_smem(x_ref.at[row, pl.ds(kc * x_rows, x_rows)], x_smem.at[slot], b)
            else:
                w_at, s_at = w_ref, s_ref
            for q in range(4):
                cols = pl.ds(kc * ROW_BYTES + q * _BOX, _BOX)
                plgpu.copy_gmem_to_smem(w_at.at[rows, cols], w_smem.at[slot, q], b)
            if scaled:
                box = fmt.scales.box(s_at, item, kc)
                plgpu.copy_gmem_to_smem(box, s_smem.at[slot, pl.ds(0, box.shape[0])], b)

        if routed:                                     # each row's global scale
            plgpu.copy_gmem_to_smem(s2_ref, s2_smem, xbar.at[0])
        elif kp > k:                                  # x's zeros past K, seen by every thread
            for r in range(k // _X_ROW, kp // _X_ROW):
                x_smem.at[r][...] = jnp.zeros((_X_ROW,), jnp.bfloat16)
            if not interpret:
                _warpgroup_sync()
        if not routed:
            plgpu.copy_gmem_to_smem(x_ref, x_smem.at[pl.ds(0, k // _X_ROW)], xbar.at[0])
        for src, dst in ((nw_ref, nw_smem), (r_ref, r_smem)):
            if src is not None:
                plgpu.copy_gmem_to_smem(src, dst, xbar.at[0])
        for p in range(_STAGES):
            @pl.when(p < tiles)
            def _():
                issue(p, p)
        # the global scales, read while the copies are in flight (every item's end multiplies by
        # one; a read from HBM there would add its latency to each item)
        if not routed:
            for i in range(s2.shape[0]):
                s2_smem[i] = s2_ref[i]
        plgpu.barrier_wait(xbar.at[0])
        if normed:
            _rms_normalize(x_smem, nw_smem, red_smem, k=k, eps=eps, interpret=interpret)

        def step(i, acc):
            slot = lax.rem(i, _STAGES)
            unit, item, kc, up = where(i)
            plgpu.barrier_wait(bar.at[slot])
            acc = _tile_update(fmt, acc, w_smem.at[slot], s_smem.at[slot] if scaled else None,
                               x_smem.at[slot] if routed else x_smem.at[pl.ds(kc * x_rows, x_rows)],
                               interpret=interpret)
            plgpu.commit_smem()                           # every thread is done with the slot

            @pl.when(i + _STAGES < tiles)
            def _():
                issue(i + _STAGES, slot)

            last = kc == kcn - 1

            first = item * ROWS

            def store(member):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)    # y_smem free again
                r_item = (r_smem.at[pl.ds(lax.div(first, _X_ROW), 1), pl.ds(lax.rem(first, _X_ROW), ROWS)]
                          if res else None)
                row = lax.div(unit, items)
                _item_sums(fmt, acc, red_smem, s2_smem.at[pl.ds(row, 1)] if routed else s2_smem, y_smem, r_item,
                           interpret=interpret, s2_at=member, gate_ref=g_smem)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(y_smem, y_ref.at[pl.ds(row, 1), pl.ds(item * ROWS, ROWS)] if routed
                                        else y_ref.at[:, pl.ds(unit * ROWS, ROWS)])

            if glu:
                @pl.when(last & ~up)
                def _():
                    _item_sums(fmt, acc, red_smem, s2_smem, g_smem, None, interpret=interpret)

                pl.when(last & up)(lambda: store(0 if shared else 1))
            elif shared or routed:
                pl.when(last)(lambda: store(0))
            else:
                for member in range(len(segments)):      # the item's member picks its global scale
                    in_member = (first >= int(starts[member])) & (first < int(starts[member + 1]))
                    pl.when(last & in_member)(functools.partial(store, member))

            return jnp.where(jnp.broadcast_to(last, acc.shape), jnp.zeros_like(acc), acc)

        zero = plgpu.layout_cast(jnp.zeros((128, ROWS), jnp.float32), _ACC)
        lax.fori_loop(0, tiles, step, zero)
        # the last output store must have read its shared memory before the CTA exits; its
        # global writes complete by the kernel's end (no wait for them at each CTA's tail)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel.__name__ = fmt.name
    u8 = jnp.uint8
    call = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((rows_x, n // 2 if glu else n), out_dtype),
        scratch_types=[plgpu.SMEM((_STAGES, x_rows, _X_ROW) if routed else (kp // _X_ROW, _X_ROW), jnp.bfloat16),
                       plgpu.SMEM((_STAGES, 4, ROWS, _BOX), u8),
                       *([plgpu.SMEM((_STAGES, *fmt.scales.slot), fmt.scales.dtype)] if scaled else []),
                       *[plgpu.SMEM(a.shape, jnp.bfloat16) for a in extras],
                       plgpu.SMEM((1, ROWS), out_dtype),
                       *([plgpu.SMEM((1, ROWS), out_dtype)] if glu else []),
                       plgpu.SMEM((4, ROWS), jnp.float32),
                       plgpu.SMEM((s2.shape[0],), jnp.float32),
                       plgpu.Barrier(num_arrivals=4 + scaled + routed, num_barriers=_STAGES),
                       plgpu.Barrier(num_arrivals=1 + len(extras), num_barriers=1)],
        grid=(ctas,), grid_names=("c",),
        compiler_params=hand_synced(approx_math=False),
        **interpret_kwargs(interpret))
    return call(xs, w_bytes, *([scales] if scaled else []), s2,
                *([jnp.asarray(experts, jnp.int32)] if routed else []), *extras)
