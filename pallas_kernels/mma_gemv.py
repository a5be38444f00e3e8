"""Weight-streaming GEMV for 1-16 activation rows (decode of small batches, speculative verify,
one row of a large weight outside the row GEMV's fusions) on the tensor cores'
`mma.sync.m16n8k16` (bf16 operands, fp32 sums), for weight formats whose dequantized weights are
bf16 values: NVFP4 (two codes a byte) and MXFP8 (one), exactly, and block FP8 (one), whose W8A16
weights are bf16(f32(w_q) * scale) by definition.

    y [M, N] = x [M, K] (bf16) @ dequant(w)^T * w_scale_2, fp32 sums, rounded once

The one-row GEMV (`row_gemv.py`) spends one FMA per weight; at M = 8 that would be eight, more
than an SM issues while HBM streams the codes. Here a thread decodes each code once into a bf16
`mma` operand and the tensor cores do the M products, so the cost per byte barely depends on M:

* an item is 32 or 64 weight rows (`ITEM_ROWS`, the plan's choice); its K tiles (16 KiB of
  codes: 32 rows x 512 bytes or 64 x 256, their block scales (`Format.scales`) and x's [M, tile
  K] slice) stream through a ring of TMA slots in persistent CTAs, which take the items
  round-robin; where N has fewer items than the grid has CTAs, a cluster of CTAs shares each
  item, one K range each (ranges of K tiles differing by one at most, `_plan`), and its first
  CTA adds the others' sums after a cluster barrier. A 32-row tile spans twice the K of a 64-row
  one, so the same bytes stream in half the rows, which the H200 copies faster
  (`benchmarks/bench_stream.py`: 16 KiB tiles of 32 rows streamed 12288x4096 and 4096x4096 bytes
  10-12 % faster than tiles of 64 rows, RESULTS.md part 48);
* lane (g, c) = (lane // 4, lane % 4) of warp w takes R = rows / 8 rows of a tile, in row slots
  j < R that hold row R g + j (or 8g + (j XOR 4) for odd g where R = 8, `_row_slot`), and of
  each row the 16 bytes from 64h + 16c for h = U w + u, u < U = 8 / R (a warp: its quarter of
  every row). Row group r's mma row g is slot 2r, its row g + 8 slot 2r + 1: a lane's rows are
  contiguous, so their per-row block scales are one R-byte load (halves swapped for odd g where
  R = 8; block FP8: one fp32 serves all R);
* the format turns a 32-bit word of codes and its row's block scale (`Format.scales`) into
  bf16x2 operands, operand i holding codes (i, i + `Format.pair`) of the word times the scale
  (`Format.operands`); two operands per row make an mma's A fragment for that row;
* each lane sums its codes in its own K order; x, the B operand, follows the same order (token
  g's pairs by `prmt` from 16-byte loads), so every mma is a sum of exact products of bf16
  values in fp32 (the jnp twins' numerics up to the summation order);
* 9-16 tokens take a second n8 column block: each A fragment feeds a second mma against tokens
  8-15, so the decoding, which bounds the tile, is shared by both blocks;
* at an item's end the 4 warps' partial [rows, M] sums meet in shared memory; with a K split the
  other cluster members store theirs into the first member's shared memory (distributed shared
  memory, no round trip through HBM); the first multiplies the total by `Format.factor *
  w_scale_2` and its threads store it straight to the output (the item's rows of a token
  coalesced).

The ring's code and x tiles sit in shared memory with the 128-byte swizzle (`_tiles`), and the
two lane groups of a quarter-warp load rows 4 apart modulo 8 (`_row_slot`): its 8 lanes then
load 8 different 16-byte bank groups of the codes (unswizzled, rows 8g and 8g + 8 met in the
same banks), and x's tokens g and g + 1 do the same (NVFP4's lanes c and c + 2 still share banks,
their x chunks lying 128 bytes apart). One H200, public NVFP4 `matmul`, device us, unswizzled ->
swizzled, results unchanged (RESULTS.md part 47): 12288x4096 at 4 / 8 / 12 / 16 tokens 12.6 /
12.7 / 17.7 / 17.6 -> 11.8 / 12.0 / 16.0 / 15.6, 4096x12288 13.9 / 14.1 / 17.3 / 17.4 -> 13.0 /
13.1 / 15.5 / 15.2, 4096x4096 at 8 / 16 tokens 6.3 / 7.5 -> 5.9 / 6.9; MXFP8 and block FP8 within
+-1.5 % (their x met 2-way, not 4-way), except MXFP8 at 12 tokens on 12288x4096, 3.5 % slower:
9-15 tokens are padded to 16 rows before the kernel, since TMA takes x in whole 8-row tiles or
one tile of fewer rows.

Shared-memory loads are 16 bytes with their alignment stated: without it the compiler split
some of them into 2-byte loads (with 16-way bank conflicts; that made two 8-token column blocks
2.5x slower than one). With two column blocks NVFP4 ran 1.1-1.6x faster than the wgmma engine
on the H200 (RESULTS.md, part 30) and MXFP8 0.98-1.31x where 3 CTAs fit an SM; where only 2 fit
(its 16-token slots, there with clusters of 4) MXFP8 ran 0.8-0.9x the engine, so MXFP8 and
block FP8 keep the engine where the plan splits K more than twice (`Format.wide_max_splits`;
parts 31 and 50). Since the engine decodes NVFP4 words the same way (part
35), the two were within 4 % of each other at 12 and 16 tokens before the swizzle (this GEMV
faster on 4096x4096, the engine on 12288x4096 and 4096x12288); at 2-8 tokens the engine took
3-19 % longer.
Interpret mode (CPU tests) runs the same ring and epilogue with jnp tile math
(`Format.values`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, gpu, llvm, memref, vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import row_gemv
from pallas_kernels.common import (CTA_SMEM_RESERVE, SMEM_PER_SM, cst, gpu_fence, hand_synced,
                                    interpret_kwargs, ix, max_active_clusters, num_sms)

TILE_SIZE = 16384            # bytes of codes per K tile: an item's rows x `tile_bytes`
ITEM_ROWS = (32, 64)         # weight rows per item, the plan's choice (`_plan`)
_STAGES = 2                  # ring slots per CTA where CTAs share an SM (3 ran 15-25 % slower on the H200)
_STAGES_ALONE = 4            # ring slots of a CTA alone on its SM (`_plan`)
_SPLIT_MIN_TILES = 6         # K tiles a CTA of a split streams, for the split to beat one CTA alone (`_plan`)
_CTAS_PER_SM = 3             # at most; fewer where shared memory runs out
MAX_M = 16                   # tokens: two n8 column blocks (`Format.wide_max_splits` may refuse 9-16)
_MIN_K = 1024                # codes along K a CTA of a split streams at least (`_plan`)
_UNEVEN_MIN_TILES = 5       # K tiles the even plans' CTAs stream at least, for a split of unequal ranges (`_plan`)
_OVERFLOW_TILES = 2         # K tiles that clusters past the GPU's places cost the busiest SM (`_load`)

_MMA = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")


def _blocks(m: int) -> int:
    """n8 column blocks (8 tokens each) for M tokens."""
    return -(-m // 8)


def tile_bytes(rows: int) -> int:
    """Bytes of codes per weight row and K tile for items of ``rows`` (64 or 32) weight rows."""
    return TILE_SIZE // rows


def _acc(rows: int, blocks: int):
    """Thread t's sums: 4 per m16 row group and column block."""
    return plgpu.Layout.WG_STRIDED((128, rows // 4 * blocks), rows // 4 * blocks)


class Scales(NamedTuple):
    """How a tile's block scales reach a lane, for items of ``rows`` weight rows (`ITEM_ROWS`)."""
    dtype: object       # element type of the scale array
    slot: Callable      # rows -> shape of the shared-memory buffer per ring slot (a 128-byte
                        # multiple; the box lands in its leading rows)
    box: Callable       # (scale ref in HBM, item, K tile, rows) -> the view one TMA copy brings
    view: Callable      # (slot ref, K tile, rows) -> what the tile's update reads of the slot
    read: Callable      # inline: (view, i32 K block in the tile, lane group g, rows) -> the
                        # scales of the lane's rows / 8 rows in its load order (`_row_slot`), as
                        # `Format.operands` takes them


def row_scales(block_bytes: int, convert: Callable) -> Scales:
    """uint8 scales [K / block, N], one a row and K block of ``block_bytes`` bytes of codes
    (NVFP4, MXFP8): a tile's [tile bytes / block_bytes, rows] box; ``convert`` turns a
    vector<R x i8> of a lane's R row scales into R values (inline)."""

    def read(view, kb, g, rows):
        per_lane = rows // 8
        sv = vector.load(ir.VectorType.get((per_lane,), ir.IntegerType.get_signless(8)), view,
                         [ix(kb), ix(arith.muli(g, cst(per_lane)))], alignment=per_lane)
        if per_lane == 8:                # odd lane groups load their rows' halves swapped (`_row_slot`)
            swap = arith.cmpi(arith.CmpIPredicate.ne, arith.andi(g, cst(1)), cst(0))
            sv = arith.select(swap, vector.shuffle(sv, sv, [4, 5, 6, 7, 0, 1, 2, 3]), sv)
        return convert(sv)

    def box(s_ref, item, kc, rows):
        blocks = tile_bytes(rows) // block_bytes
        return s_ref.at[pl.ds(kc * blocks, blocks), pl.ds(item * rows, rows)]

    return Scales(dtype=jnp.uint8, slot=lambda rows: (tile_bytes(rows) // block_bytes, rows), box=box,
                  view=lambda slot, kc, rows: slot, read=read)


def bf16x2_times(op, scale):
    """Inline: bf16x2 operand bits times a bf16x2 (s, s) scale, rounded once (exact where the
    products fit bf16)."""
    return llvm.inline_asm(ir.IntegerType.get_signless(32), [op, scale], "mul.rn.bf16x2 $0, $1, $2;", "=r,r,r")


class Format(NamedTuple):
    """What a weight format brings to the mma GEMV."""
    name: str           # the kernel's name in traces
    codes_per_byte: int
    block: int          # codes along K per block scale
    pair: int           # an operand holds codes (i, i + pair) of a word
    factor: float       # every output is multiplied by factor * w_scale_2
    operands: Callable  # inline: (i32 word, its row's scale from `scales.read`) -> [operand bits
                        # (i32 bf16x2, the codes' values times the scale)] for i = 0, 1, ...
    scales: Scales
    values: Callable    # jnp: (codes u8 [rows, tile bytes], the scales' view) -> [rows, tile K]
                        # f32 operand values times their scales, as the GPU multiplies them
    issue_bound: bool = False   # decoding, not memory, bounds a tile: of equally loaded plans
                                # the one with the fewest K splits (`_plan`)
    wide_max_splits: int = 8    # 9-16 tokens (a second column block) only where the plan's clusters
                                # have at most this many CTAs
    k_step: int = 1             # K must also be a multiple of this

    def tile_k(self, rows: int) -> int:
        """Codes along K per tile for items of ``rows`` weight rows."""
        return tile_bytes(rows) * self.codes_per_byte

    def k_multiple(self, rows: int) -> int:
        return math.lcm(self.tile_k(rows), self.k_step)


def supported(fmt: Format, m: int, n: int, k: int) -> bool:
    """1 <= M <= 16 activation rows (9-16 where `_plan` splits K at most `fmt.wide_max_splits` ways),
    N a multiple of 64, K a multiple of a 64-row item's tile K and of `fmt.k_step` (32-row items
    where N and K allow them too, `_plan`)."""
    return (1 <= m <= MAX_M and n % 64 == 0 and k % fmt.k_multiple(64) == 0
            and (m <= 8 or _plan(fmt, n, k, m).splits <= fmt.wide_max_splits))


def crowded(fmt: Format, n: int, k: int, m: int) -> bool:
    """Whether the plan of M rows on an N x K weight (`supported`) has clusters past the GPU's
    places for its even spread of CTAs, so that some SMs run one CTA more (`_load`)."""
    p = _plan(fmt, n, k, m)
    _, even, resident = _residency(n // p.rows, p.per_sm, p.splits)
    return resident > even


def takes_one_row(fmt: Format, row_fmt: row_gemv.Format, n: int, k: int) -> bool:
    """Whether one activation row runs faster here than on the CUDA-core row GEMV (`row_gemv.py`,
    format ``row_fmt``): where this GEMV's plan leaves the busiest SM fewer K tiles
    (`TILE_SIZE` bytes each) than the row GEMV's items do (`row_gemv.busiest_tiles`, whose
    partial last tile costs a whole one), or as many on a weight with a 64-row item for every SM.
    One H200, device us, row GEMV -> this one: NVFP4 at K = 7168 (row tiles 2048 codes, 3.5 an
    item) 4096 rows 9.28 -> 8.06, 7168 rows 15.02 -> 12.38, 4096x5120 7.39 -> 6.37, block FP8
    4096x1536 4.07 -> 3.72 (RESULTS.md part 51); as many tiles: NVFP4 / block FP8 on 24576x4096
    21.8 -> 18.7 / 28.2 -> 26.9, 12288x4096 12.2 -> 11.8 / 15.7 -> 15.4 (part 48), and from -4 to
    +7 % on 4096-6144 rows (parts 48-51). More tiles here lost by 1-32 % (1024- and 2048-row
    NVFP4 at K = 7168, 6.89 against 5.22 at 1024 rows). MXFP8 does not ask: its row GEMV won on
    every shape of as many tiles, by up to 8 %, and fewer tiles here gave +3 / -2 %."""
    if not supported(fmt, 1, n, k):
        return False
    p = _plan(fmt, n, k, 1)
    mine = _load(n // p.rows, k // fmt.tile_k(p.rows), p.per_sm, p.splits)[2]
    row = row_gemv.busiest_tiles(row_fmt, n, k)
    return mine < row or (mine == row and n // 64 >= num_sms())


def gemv_order(m: int, n: int, k: int, row_form, mma_form) -> tuple:
    """A format's two GEMV modules (each with its `FORMAT`) in the order a call of M rows on an
    N x K weight tries them: the row GEMV first, except for one row where `takes_one_row`."""
    return ((mma_form, row_form) if m == 1 and takes_one_row(mma_form.FORMAT, row_form.FORMAT, n, k)
            else (row_form, mma_form))


def _tiles(shape, dtype):
    """A ring of [rows, cols] tiles in SMEM as TMA writes them, (8, 128 bytes) tiles with the
    128-byte swizzle (16-byte unit u of a tile row r at u XOR r % 8), and the same bytes as raw
    [rows * cols * itemsize / 16, 16 bytes] units that the inline loads address. Unswizzled, the
    lanes of a quarter-warp met in the same banks: lane groups g and g + 1 load rows 8 apart of
    the codes (2 KiB) and tokens g and g + 1 of x (a whole number of 128-byte rows apart)."""
    stages, rows, cols = shape
    unit = 16 // jnp.dtype(dtype).itemsize
    per_row = 128 // jnp.dtype(dtype).itemsize
    return plgpu.RefUnion(
        plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, per_row)), plgpu.SwizzleTransform(128))),
        plgpu.SMEM((stages, rows * cols // unit, unit), dtype))


def _row_slot(rows, g, j):
    """Inline: the tile row of lane group g's row slot j (0 .. R - 1, R = rows / 8 rows a lane):
    R g + j, or for R = 8 and odd g 8g + (j XOR 4). Either way row % 8 = j XOR 4 (g % 2), so the
    two lane groups of a quarter-warp load rows of different swizzle phase (`_tiles`)."""
    per_lane = rows // 8
    slot = arith.xori(cst(j), arith.shli(arith.andi(g, cst(1)), cst(2))) if per_lane == 8 else cst(j)
    return arith.addi(arith.muli(g, cst(per_lane)), slot)


def _tile_update(fmt, acc, w_ref, s_ref, x_ref, *, m, rows, interpret):
    """acc += this tile's products. s_ref: the tile's scales (`Scales.view`). GPU: the ring
    slot's raw views of the swizzled tiles (`_tiles`), w_ref [1024, 16] u8 codes, x_ref
    [8 * blocks * tile K / 8, 8] bf16 (rows past M are not read into any stored output).
    Interpret mode: their tiled views, w_ref [rows, tile bytes], x_ref [8 * blocks, tile K], and
    acc [rows, M] f32, the same operand values summed by XLA."""
    if interpret:
        xs = x_ref[:m].astype(jnp.float32)
        return acc + jnp.dot(fmt.values(w_ref[...], s_ref[...]), xs.T, precision=lax.Precision.HIGHEST)

    nb, groups, units, tk = _blocks(m), rows // 16, tile_bytes(rows) // 256, fmt.tile_k(rows)
    layout = _acc(rows, nb)

    @plgpu.inline_mgpu(arg_types=(layout, plgpu.RefType(), plgpu.RefType(), plgpu.RefType()),
                       return_type=plgpu.ShapeDtypeStruct((128, 4 * groups * nb), jnp.float32, layout=layout))
    def update(_, acc_in, w_smem, s_smem, x_smem):
        f32, i32 = ir.F32Type.get(), ir.IntegerType.get_signless(32)
        i8 = ir.IntegerType.get_signless(8)
        words_of = lambda vec: [vector.extract(mgpu_utils.bitcast(vec, ir.VectorType.get((4,), i32)), [], [e])
                                for e in range(4)]
        asm = lambda args, text, cons: llvm.inline_asm(i32, args, text, cons)
        t = mgpu_utils.thread_idx()
        warp, lane = arith.shrui(t, cst(5)), arith.andi(t, cst(31))
        g, c = arith.shrui(lane, cst(2)), arith.andi(lane, cst(3))
        cpb = fmt.codes_per_byte
        zero = cst(0, ir.IndexType.get())
        word_codes = 4 * cpb
        half = fmt.pair // 2
        per_word = cpb                                       # mmas a word (2 cpb operands) feeds
        struct = llvm.StructType.get_literal([f32] * 4)
        regs = acc_in.registers.flat[0]
        accs = [vector.extract(regs, [], [j]) for j in range(4 * groups * nb)]   # (block, group, q)
        o = arith.shli(arith.andi(g, cst(1)), cst(2))
        # units before the lane's rows: row // 8 = g // (8 / R) (`_row_slot`) times a row of (8, 128 bytes) tiles
        lanes_per_tile_row = 8 // (rows // 8)                # lane groups whose rows share an 8-row band: 1 or 2
        row_tiles = arith.muli(arith.shrui(g, cst(lanes_per_tile_row.bit_length() - 1)), cst(tile_bytes(rows) // 2))
        for u in range(units):
            # the lane's u-th 16 bytes of each of its rows: bytes 64 h + 16c, h = units * warp + u
            h = arith.addi(arith.muli(warp, cst(units)), cst(u))
            first = arith.muli(arith.addi(arith.muli(h, cst(64)), arith.muli(c, cst(16))), cst(cpb))  # its 1st K

            # x: token g + 8b's 16 cpb values from first, in 16-byte loads; xw[b][j] = (x[2j], x[2j + 1]).
            # Chunk (8 values) first / 8 + v of token t sits at 16-byte unit (t // 8 * tile K / 64 + first // 64)
            # * 64 + t % 8 * 8 + ((first % 64 / 8 + v) XOR t % 8), and first % 64 / 8 has no bit of v.
            xbase = arith.addi(arith.addi(arith.shli(arith.shrui(first, cst(6)), cst(6)), arith.muli(g, cst(8))),
                               arith.xori(arith.shrui(arith.andi(first, cst(63)), cst(3)), g))
            xw = [[] for _ in range(nb)]
            for b in range(nb):
                for v in range(2 * cpb):
                    unit = arith.xori(arith.addi(xbase, cst(b * tk)), cst(v))
                    xw[b] += words_of(vector.load(ir.VectorType.get((8,), ir.BF16Type.get()), x_smem,
                                                  [ix(unit), zero], alignment=16))

            # block scales of the lane's rows for each K block these codes touch
            kb0 = arith.shrui(first, cst(fmt.block.bit_length() - 1))
            blocks = sorted({word_codes * s // fmt.block for s in range(4)})
            scale = {bl: fmt.scales.read(s_smem, arith.addi(kb0, cst(bl)), g, rows) for bl in blocks}

            # B operands of word s's mma e in column block b: the x values of the codes in A's
            # k-slots, (x[2e], x[2e + pair]) and (x[2e + 1], x[2e + 1 + pair]) of the word's x
            bops = {}
            for b in range(nb):
                for s in range(4):
                    xs = xw[b][2 * cpb * s:2 * cpb * (s + 1)]
                    for e in range(per_word):
                        bops[b, s, e] = [asm([xs[e], xs[e + half]], f"prmt.b32 $0, $1, $2, {sel};", "=r,r,r")
                                         for sel in ("0x5410", "0x7632")]

            # codes: row slot j's 16 bytes sit at 16-byte unit (row // 8 * tile bytes / 128 + h // 2) * 64 +
            # row % 8 * 8 + ((4 (h % 2) + c) XOR row % 8), row = `_row_slot(g, j)`, row % 8 = j XOR o: wbase XOR 9j
            wbase = arith.addi(arith.addi(row_tiles, arith.shli(arith.shrui(h, cst(1)), cst(6))),
                               arith.addi(arith.shli(o, cst(3)),
                                          arith.xori(arith.addi(arith.shli(arith.andi(h, cst(1)), cst(2)), c), o)))
            for r in range(groups):
                codes = [words_of(vector.load(ir.VectorType.get((16,), i8), w_smem,
                                              [ix(arith.xori(wbase, cst(9 * (2 * r + q)))), zero], alignment=16))
                         for q in range(2)]
                for s in range(4):
                    sc = scale[word_codes * s // fmt.block]
                    ops = [fmt.operands(codes[q][s], sc[2 * r + q]) for q in range(2)]
                    for e in range(per_word):
                        # A: rows g / g + 8 at k-slots (2c, 2c + 1) = operand 2e, (2c + 8, 2c + 9) = 2e + 1
                        a = [ops[q][2 * e + p] for p in range(2) for q in range(2)]
                        for b in range(nb):
                            at = slice(4 * (b * groups + r), 4 * (b * groups + r) + 4)
                            d = llvm.inline_asm(struct, a + bops[b, s, e] + accs[at], _MMA,
                                                "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
                            accs[at] = [llvm.extractvalue(f32, d, [q]) for q in range(4)]
        out = np.array([vector.from_elements(ir.VectorType.get((4 * groups * nb,), f32), accs)], dtype=object)
        return mgpu_fa.FragmentedArray(_registers=out, _layout=layout.to_mgpu(), _is_signed=None)

    return update(acc, w_ref, s_ref, x_ref)


def _owned(t, m, rows):
    """The (token, row) pairs of an item's output that thread t finishes: row t % rows, tokens
    t // rows + 128 / rows * j below M (as (predicate, token, row) triples)."""
    step = 128 // rows
    row, tok0 = arith.andi(t, cst(rows - 1)), arith.shrui(t, cst(rows.bit_length() - 1))
    for j in range(-(-m // step)):
        tok = arith.addi(tok0, cst(step * j))
        yield arith.cmpi(arith.CmpIPredicate.ult, tok, cst(m)), tok, row


def _warp_sums(acc, red_ref, *, m, interpret):
    """red_ref[0, tok, row] <- the item's sum D[row][tok] over the 4 warps, for the pairs each
    thread owns (`_owned`); red_ref [4, 8 * blocks, rows] f32. Thread t's sums (column block b,
    row group r, element q) are D[`_row_slot`(g, 2r + q // 2)][8b + 2c + q % 2]."""
    if interpret:
        red_ref[0, pl.ds(0, m)] = acc.T
        return

    nb, rows = _blocks(m), red_ref.shape[-1]
    groups = rows // 16

    @plgpu.inline_mgpu(arg_types=(_acc(rows, nb), plgpu.RefType()))
    def reduce(_, acc_in, red_smem):
        index = ir.IndexType.get()
        t = mgpu_utils.thread_idx()
        warp, lane = arith.shrui(t, cst(5)), arith.andi(t, cst(31))
        g, c = arith.shrui(lane, cst(2)), arith.andi(lane, cst(3))
        regs = acc_in.registers.flat[0]
        for b in range(nb):
            for r in range(groups):
                for q in range(4):
                    tok = arith.addi(arith.muli(c, cst(2)), cst(8 * b + q % 2))
                    row = _row_slot(rows, g, 2 * r + q // 2)
                    memref.store(vector.extract(regs, [], [4 * (b * groups + r) + q]), red_smem,
                                 [ix(warp), ix(tok), ix(row)])
        mgpu_utils.warpgroup_barrier()
        for pred, tok, row in _owned(t, m, rows):
            with mgpu_utils.when(pred):
                at = lambda w: [cst(w, index), ix(tok), ix(row)]
                total = memref.load(red_smem, at(0))
                for w in range(1, 4):
                    total = arith.addf(total, memref.load(red_smem, at(w)))
                memref.store(total, red_smem, at(0))

    reduce(acc, red_ref)


def _store_partial(red_ref, part_ref, *, m, interpret):
    """This CTA's sums over its K range, red_ref[0], to its cluster's first CTA. GPU: part_ref
    [8 * blocks, rows] f32 is this CTA's slot of the parts buffer, and the sums go to the same
    slot of the first CTA's (distributed shared memory). Interpret mode (no clusters): part_ref
    [M, rows] is a slice of a global output whose members' sums XLA adds."""
    if interpret:
        part_ref[...] = red_ref[0, pl.ds(0, m)]
        return
    rows = red_ref.shape[-1]

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
    def store(_, red_smem, part_smem):
        index = ir.IndexType.get()
        first = mgpu_utils.get_cluster_ref(part_smem, gpu.Dimension.x, cst(0, index))
        for pred, tok, row in _owned(mgpu_utils.thread_idx(), m, rows):
            with mgpu_utils.when(pred):
                memref.store(memref.load(red_smem, [cst(0, index), ix(tok), ix(row)]), first, [ix(tok), ix(row)])

    store(red_ref, part_ref)


def _finish(red_ref, parts_ref, s2_ref, y_ref, *, m, splits, factor, interpret):
    """y_ref [M, rows] (global memory, output dtype) <- (red_ref[0] + the other cluster members'
    sums parts_ref [splits - 1, 8 * blocks, rows] f32 in shared memory) * w_scale_2 * factor."""
    if interpret:
        y_ref[...] = (red_ref[0, pl.ds(0, m)] * (s2_ref[0] * factor)).astype(y_ref.dtype)
        return
    rows = red_ref.shape[-1]
    refs = (red_ref, s2_ref, y_ref) + ((parts_ref,) if splits > 1 else ())

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * len(refs))
    def finish(_, red_smem, s2_smem, y_gmem, parts_smem=None):
        index = ir.IndexType.get()
        s2 = arith.mulf(memref.load(s2_smem, [cst(0, index)]), mgpu_utils.c(factor, ir.F32Type.get()))
        out_ty = ir.MemRefType(y_gmem.type).element_type
        for pred, tok, row in _owned(mgpu_utils.thread_idx(), m, rows):
            with mgpu_utils.when(pred):
                total = memref.load(red_smem, [cst(0, index), ix(tok), ix(row)])
                for p in range(splits - 1):
                    total = arith.addf(total, memref.load(parts_smem, [cst(p, index), ix(tok), ix(row)]))
                total = arith.mulf(total, s2)
                if out_ty != total.type:
                    total = arith.truncf(out_ty, total)
                memref.store(total, y_gmem, [ix(tok), ix(row)])

    finish(*refs)


class Plan(NamedTuple):
    rows: int       # weight rows per item (`ITEM_ROWS`)
    per_sm: int     # CTAs an SM
    splits: int     # CTAs (a cluster) sharing an item, one K range each
    stages: int     # ring slots per CTA (`_STAGES`, or `_STAGES_ALONE` for a CTA alone on its SM)


def _k_range(kt: int, splits: int, member):
    """(first K tile, K tiles) of cluster member ``member`` (traced i32) of ``splits`` sharing
    ``kt`` tiles: the first kt % splits members take one tile more. An even split keeps a static
    count, so its per-tile index arithmetic divides by a constant."""
    base, extra = divmod(kt, splits)
    if not extra:
        return member * base, base
    return member * base + jnp.minimum(member, extra), base + (member < extra).astype(jnp.int32)


def _load(items: int, kt: int, per_sm: int, splits: int) -> tuple[int, int, int]:
    """CTAs on the busiest SM, items of the busiest CTA and K tiles of the busiest SM (bounds:
    ceil(CTAs / SMs) CTAs of ceil(items / clusters) items) for ``items`` of ``kt`` K tiles on
    clusters of ``splits`` CTAs, ``per_sm`` of them an SM.

    A cluster's CTAs share a GPC, so clusters past what that many CTAs an SM hold
    (`max_active_clusters`) put one CTA more on some SMs: the H200 holds 30 clusters of 4 at one
    CTA an SM. Such an overflow costs the busiest SM _OVERFLOW_TILES tiles, not a second CTA's
    whole range (H200, 32 clusters of 4, 32-row items, RESULTS.md part 53): NVFP4 at one row on
    1024x4096 and 1024x5120 (1-2 tiles a CTA) ran 3.95 / 5.13 us against 3.31 / 4.27 on the row
    GEMV, which streams 2 / 3 tiles, while at 1024x12288 and 1024x16384 (3-4 tiles a CTA) it ran
    6.58 / 7.97 against 7.12 / 9.03 for the row GEMV's 6 / 8, and MXFP8 1024x5120 and 1024x7168
    at 2-8 tokens ran 4.85-5.68 us against 5.02-6.12 for 2 splits of 5-7 tiles alone on their
    SMs."""
    clusters, even, resident = _residency(items, per_sm, splits)
    per_cta = -(-items // clusters)
    return resident, per_cta, even * per_cta * -(-kt // splits) + _OVERFLOW_TILES * (resident > even)


def _residency(items: int, per_sm: int, splits: int) -> tuple[int, int, int]:
    """Clusters of the grid, CTAs on the busiest SM of an even spread, and CTAs on the busiest SM
    where the GPU places the clusters (`_load`)."""
    clusters = min(items, num_sms() * per_sm // splits)
    even = resident = -(-clusters * splits // num_sms())
    while splits > 1 and resident < per_sm and clusters > max_active_clusters(splits, resident):
        resident += 1
    return clusters, even, resident


def _plan(fmt: Format, n: int, k: int, m: int) -> Plan:
    """The item rows, CTAs per SM, K splits and ring slots of a call. A K split is a cluster of 2,
    4 or 8 CTAs sharing an item, each over its own K tiles, at least _MIN_K codes of K. Of the
    plans whose CTAs fit an SM's shared memory and keep every cluster in the first wave as the GPU
    places clusters (so that with splits every cluster takes one item), the one that leaves the
    fewest K tiles (`TILE_SIZE` bytes of codes each) to the busiest SM: ceil(CTAs / SMs) CTAs of
    ceil(items / clusters) items of K tiles / splits each (NVFP4, 16 tokens: 384 32-row items on
    264 CTAs, 16 tiles, ran 16.6 us at 12288x4096 against 15.6 for 192 64-row items, also 16;
    24576x4096: 24 tiles against 32, 24.3 us against 29.1, part 49). Of equally loaded ones:

    * no split at all before a split whose CTAs stream fewer than _SPLIT_MIN_TILES tiles each
      (8-bit 4096x4096, 8 tiles: one CTA an SM ran 2-5 % faster at 2-8 tokens than 2 splits of
      4; NVFP4 4096x12288, 12 tiles: 2 splits of 6 ran 4-6 % faster than none, RESULTS.md part
      50); among splits only, a short one is no worse (MXFP8 1024x12288: 8 splits of 3 tiles
      7.1 us, 4 of 6 8.2);
    * the most CTAs on the busiest SM (MXFP8 4096x12288 at 16 tokens: 2 splits, two CTAs an SM,
      ran 16.2-16.4 us against 19.5-19.9 for one CTA an SM with 2 slots, part 50; MXFP8 at 16
      tokens, 64-row items: 2 splits one CTA an SM 9.3 us at 4096x4096 against 12.0 for 4 splits
      at two, part 31, where 4 splits are now short);
    * the fewest items a CTA (24576x4096 at 1-2 tokens: 32-row items two a CTA ran 3-10 % slower
      than 64-row items one a CTA in NVFP4 and block FP8, part 49);
    * 32-row items (up to 16 % faster than 64-row ones on 4096-12288 rows, part 49: the module
      docstring);
    * the fewest splits where decoding bounds the tile (NVFP4: more CTAs an SM add merge work, not
      throughput), else the most (MXFP8: more CTAs an SM keep more bytes in flight).

    Splits need not divide K's tiles (the first members take one tile more, `_k_range`) where the
    weight has fewer items than the GPU has SMs and the even plans leave each CTA at least
    _UNEVEN_MIN_TILES tiles: NVFP4 at 2-16 tokens 512x7168 6.6 -> 3.7-3.8 us (4 splits of 7
    tiles, was none), 1024x7168 6.7 -> 5.1, 2048x2560 5.1 -> 4.6; MXFP8 512x5120 4.8 -> 3.7,
    1024x7168 6.0 -> 5.6 (RESULTS.md part 52). Where the even plans already leave 3 tiles a CTA,
    a finer uneven split lost 4-23 % (NVFP4 512x12288 8 splits against 4, 1024x6144 4 against
    2, 1536x3072 2 against none), and on 192 items (6144x2560, 8-bit) 2 uneven splits lost 10 %.

    A CTA alone on its SM that streams more than _STAGES_ALONE tiles gets that many ring slots, not
    _STAGES (MXFP8, one CTA an SM: 4096x12288 at 16 tokens 19.9 us with 2 slots, 16.4 with 4,
    17.4 with 6; 4096x4096 at 8 tokens 7.8 with 2, 7.0 with 4, 7.8 with 8); NVFP4's 4 tiles an
    item on 4096x4096 ran 0.1-0.3 us slower with 4 (part 50). Sweeps of forced splits (64-row
    items, part 30) found the rule of that time fastest or within 1 % on 11 of 12 shapes at 8
    tokens; clusters of 3 and 6 placed badly (a second wave at 4096x12288, part 28; 3 splits at
    4096x12288 ran 19.7-21.4 us against 15.3-16.5 for 2, part 50). The placement
    (`max_active_clusters`) matters where clusters of 4 or 8 fill nearly every place: 96 clusters
    of 4 at 3 CTAs an SM, where the H200 holds 92, ran 9.8-12.5 us at 6144x4096 and 2-8 tokens,
    against 8.9-11.2 for 2 splits, in all three formats (part 32). One CTA an SM, which shared memory never refuses, is the last resort: by this count
    it can look lighter than two CTAs an SM whose items spread evenly."""
    xr = 8 * _blocks(m)                                     # x rows staged
    plans = {}
    for rows in ITEM_ROWS:
        if n % rows or k % fmt.k_multiple(rows):
            continue
        tk = fmt.tile_k(rows)
        slot = TILE_SIZE + math.prod(fmt.scales.slot(rows)) * jnp.dtype(fmt.scales.dtype).itemsize + xr * tk * 2
        items, kt = n // rows, k // tk
        smem = lambda s, stages: stages * slot + 4 * xr * rows * 4 + 4 + (s - 1) * xr * rows * 4   # ring, sums, parts
        even = min(kt // s for s in (1, 2, 4, 8) if kt % s == 0 and (s == 1 or kt // s * tk >= _MIN_K))
        uneven = items < num_sms() and even >= _UNEVEN_MIN_TILES
        for per_sm in range(_CTAS_PER_SM, 0, -1):
            for s in (1, 2, 4, 8):
                if ((kt % s == 0 or (uneven and kt >= s)) and (s == 1 or (kt // s * tk >= _MIN_K and items * s <= num_sms() * per_sm
                                                and items <= max_active_clusters(s, per_sm)))
                        and (per_sm == 1 or per_sm * (smem(s, _STAGES) + CTA_SMEM_RESERVE) <= SMEM_PER_SM)):
                    resident, per_cta, busiest = _load(items, kt, per_sm, s)
                    alone = (resident == 1 and busiest > _STAGES_ALONE
                             and smem(s, _STAGES_ALONE) + CTA_SMEM_RESERVE <= SMEM_PER_SM)
                    plans[Plan(rows, per_sm, s, _STAGES_ALONE if alone else _STAGES)] = (
                        per_sm == 1, busiest, s > 1 and kt // s < _SPLIT_MIN_TILES, -resident, per_cta, rows != 32,
                        s if fmt.issue_bound else -s)
    least = min(plans.values())[:2]
    tied = {p: key for p, key in plans.items() if key[:2] == least}
    if not any(p.splits == 1 for p in tied):     # among splits only, a short one is no worse
        tied = {p: key[:2] + (False,) + key[3:] for p, key in tied.items()}
    return min(tied, key=tied.get)


@functools.partial(jax.jit, static_argnames=("fmt", "out_dtype", "interpret"))
def gemv(fmt, x, w_bytes, scales, w_scale_2, *, out_dtype, interpret=False):
    """x [M, K] bf16 (1 <= M <= 16), w_bytes uint8 [N, K / codes_per_byte], scales the
    format's block scales in HBM (`Format.scales`: uint8 [K / block, N] for NVFP4 and MXFP8, fp32
    [ceil(N / 128), K / 128] for block FP8), w_scale_2 f32 (one value) -> [M, N] out_dtype
    (`supported` shapes).

    With K splits (`_plan`) a cluster's members write their sums into the first member's shared
    memory and the first adds them after a cluster barrier; the Mosaic GPU interpreter has no
    clusters, so in interpret mode every member writes its sums to a scratch output and XLA adds
    them."""
    m, k = x.shape
    n = w_bytes.shape[0]
    if not supported(fmt, m, n, k) or w_bytes.shape[1] * fmt.codes_per_byte != k:
        wide = f" (9-16 where K splits {fmt.wide_max_splits} ways at most)" if fmt.wide_max_splits < 8 else ""
        raise ValueError(f"{fmt.name} serves 1 <= M <= {MAX_M}{wide}, N % 64 == 0, K % {fmt.k_multiple(64)} == 0 with "
                         f"codes of K / {fmt.codes_per_byte} bytes; got M={m}, N={n}, K={k}, codes {w_bytes.shape}")
    rows, per_sm, splits, stages = _plan(fmt, n, k, m)
    nb = _blocks(m)
    xr = 8 * nb                                             # x rows staged
    tb, tk = tile_bytes(rows), fmt.tile_k(rows)
    items, kt = n // rows, k // tk
    clusters = min(items, num_sms() * per_sm // splits)
    s2 = jnp.asarray(w_scale_2, jnp.float32).reshape(1)
    emulated = interpret and splits > 1              # members' sums added by XLA
    def kernel(x_ref, w_ref, s_ref, s2_ref, y_ref, *refs):
        part_ref = refs[0] if emulated else None
        (x_smem, x_raw), (w_smem, w_raw), s_smem, red_smem, s2_smem, bar, *merge = refs[emulated:]
        cl, member = lax.axis_index("c"), lax.axis_index("s")
        k0, kts = _k_range(kt, splits, member)
        tiles = lax.div(items - cl + clusters - 1, clusters) * kts   # items cl, cl + clusters, ... x K tiles

        def where(i):
            return cl + lax.div(i, kts) * clusters, k0 + lax.rem(i, kts)

        def issue(i, slot):
            item, kc = where(i)
            b = bar.at[slot]
            plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(item * rows, rows), pl.ds(kc * tb, tb)],
                                    w_smem.at[slot], b)
            box = fmt.scales.box(s_ref, item, kc, rows)
            plgpu.copy_gmem_to_smem(box, s_smem.at[slot, pl.ds(0, box.shape[0])], b)
            # on the GPU whole 8-row tiles: TMA fills the rows past M with zeros
            tokens = pl.ds(0, m if interpret else xr)
            plgpu.copy_gmem_to_smem(x_ref.at[tokens, pl.ds(kc * tk, tk)], x_smem.at[slot, tokens], b)

        for p in range(stages):
            @pl.when(p < tiles)
            def _():
                issue(p, p)
        s2_smem[0] = s2_ref[0]

        def step(i, acc):
            slot = lax.rem(i, stages)
            item, kc = where(i)
            plgpu.barrier_wait(bar.at[slot])
            w_tile, x_tile = (w_smem, x_smem) if interpret else (w_raw, x_raw)
            acc = _tile_update(fmt, acc, w_tile.at[slot], fmt.scales.view(s_smem.at[slot], kc, rows), x_tile.at[slot],
                               m=m, rows=rows, interpret=interpret)
            plgpu.commit_smem()                               # every thread is done with the slot

            @pl.when(i + stages < tiles)
            def _():
                issue(i + stages, slot)

            last = lax.rem(i, kts) == kts - 1
            out_rows = pl.ds(item * rows, rows)

            @pl.when(last)
            def _():
                _warp_sums(acc, red_smem, m=m, interpret=interpret)
                if emulated:
                    _store_partial(red_smem, part_ref.at[member, :, out_rows], m=m, interpret=True)
                    return
                parts = None
                if splits > 1:       # one item a cluster (`_plan`): the parts buffer is written once
                    parts, cbar = merge
                    pl.when(member != 0)(lambda: _store_partial(red_smem, parts.at[member - 1], m=m,
                                                                interpret=interpret))
                    gpu_fence()
                    plgpu.barrier_arrive(cbar.at[0])
                    plgpu.barrier_wait(cbar.at[0])

                @pl.when(member == 0)
                def _():
                    if splits > 1:
                        gpu_fence()
                    _finish(red_smem, parts, s2_smem, y_ref.at[:, out_rows], m=m, splits=splits, factor=fmt.factor,
                            interpret=interpret)

            return jnp.where(jnp.broadcast_to(last, acc.shape), jnp.zeros_like(acc), acc)

        if interpret:
            zero = jnp.zeros((rows, m), jnp.float32)
        else:
            zero = plgpu.layout_cast(jnp.zeros((128, rows // 4 * nb), jnp.float32), _acc(rows, nb))
        lax.fori_loop(0, tiles, step, zero)

    kernel.__name__ = fmt.name
    if splits == 1 or interpret:
        layout = dict(grid=(clusters, splits), grid_names=("c", "s"))
    else:
        layout = dict(grid=(clusters,), grid_names=("c",), cluster=(splits,), cluster_names=("s",))
    merged = splits > 1 and not interpret
    call = plgpu.kernel(
        kernel, out_type=(jax.ShapeDtypeStruct((m, n), out_dtype),
                          *([jax.ShapeDtypeStruct((splits, m, n), jnp.float32)] if emulated else [])),
        scratch_types=[_tiles((stages, xr, tk), jnp.bfloat16), _tiles((stages, rows, tb), jnp.uint8),
                       plgpu.SMEM((stages, *fmt.scales.slot(rows)), fmt.scales.dtype),
                       plgpu.SMEM((4, xr, rows), jnp.float32),
                       plgpu.SMEM((1,), jnp.float32),
                       plgpu.Barrier(num_arrivals=3, num_barriers=stages),
                       *([plgpu.SMEM((splits - 1, xr, rows), jnp.float32),
                          plgpu.ClusterBarrier(collective_axes=("s",), num_arrivals=1, num_barriers=1)] if merged
                         else [])],
        **layout,
        compiler_params=hand_synced(approx_math=False),
        **interpret_kwargs(interpret))
    x = x.astype(jnp.bfloat16)
    if 8 < m < xr and not interpret:      # TMA takes x in whole 8-row tiles, or one of fewer rows
        x = jnp.pad(x, ((0, xr - m), (0, 0)))
    out = call(x, w_bytes, scales, s2)
    if emulated:
        return (out[1].sum(0) * (s2[0] * fmt.factor)).astype(out_dtype)
    return out[0]
