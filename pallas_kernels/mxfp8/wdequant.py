"""Shared Mosaic GPU (Hopper) engine for weight-streaming matmuls: weight-only quantized
(W8A16 / W4A16) and plain bf16.

    y[M, N] = x[M, K] (bf16) @ dequant(w)[N, K]^T      fp32 accumulation

Used by ``pallas_kernels.{mxfp8,fp8_block,nvfp4,dense_matmul}``. Hopper has no block-scaled
tensor-core instruction, so each CTA streams its quantized weight tile HBM -> SMEM with TMA (the
MXFP8 / NVFP4 per-block scales of the tile with it, as a [tk / block, 64] tile of the transposed
scale array), dequantizes it in registers (exact bit tricks, below) and feeds the bf16 values to
``wgmma`` straight from registers. The product is "swapped" (A =
weight rows, B = tokens): the accumulator is ``[64 weight rows, bm tokens]``, so a decode batch
of 1..64 tokens sits in wgmma's N dimension (multiple of 8) instead of being padded to M = 64.

One kernel serves both shapes of the problem, only the tiling differs (``plan``):

* decode (M <= 64): bm = 8/16/32/64 tokens, K split over ``splits`` CTAs so that
  ``N/64 * splits`` CTAs fill the GPU (up to a count per format and token tile, ``decode_cta_cap``); fp32
  partials are summed by the wrapper. The kernel
  is weight-streaming: 2-4 TMA stages of weight bytes in flight per CTA, tiles small enough
  for two CTAs per SM.
* prefill (M > 64): bm = 128 or 256 tokens, no split, a ``[64, bm]`` fp32 accumulator.
  On the GPU, MXFP8, NVFP4 and block FP8 run these shapes in a warp-specialized form instead
  (``prefill_ws``: 128 weight rows per CTA, 1.3-1.9x faster, K split on grids smaller than
  the GPU) where it fits; grouped calls, calls with plan overrides, block-FP8 grids too small
  for that form even split (``fills_gpu``) and the interpreter use this one.

Dequantization per format (``fmt``):

* ``mxfp8``: e4m3 -> bf16 is exact (through f16, which Hopper converts natively); the E8M0
  scale becomes a bf16 power of two by moving its 8 bits into the bf16 exponent field
  (``u << 7``) and the multiply is exact. The tile is processed in 32-column groups, each with
  one per-row scale vector (a row of the step's staged scale tile, read in the wgmma row layout).
  E8M0 0 (2^-127) maps to 0 (ModelOpt writes it for all-zero blocks, whose values are 0
  anyway) and 255 (NaN) to inf.
* ``fp8_block``: one fp32 scale per 128-column group of the tile (64 x min(128, tk), inside one
  128x128 block; scalars read from HBM, before the pipeline starts when a CTA has few K steps):
  ``bf16(f32(e4m3) * scale)``,
  rounded once, exactly as the jnp reference does.
* ``nvfp4``: bytes hold E2M1 codes, element 2i in the low nibble. Each thread reads whole
  32-bit words of codes (16-byte loads of the 128- or 64-byte-swizzled tile) and turns each
  word into four bf16x2 wgmma A registers, two codes per integer operation, each times its
  row's e4m3 block scale, exactly (``pallas_kernels/nvfp4/operands.py``). That fixes a K order
  per step of 128 or 256 codes (``MIN_STEP``), in which the wrapper stores x once per call
  (``operands.order_x``); 2^10 * ``weight_scale_2`` multiplies the fp32 accumulator in the
  epilogue. The earlier form (bytes widened to int16 in the wgmma layout, nibbles split into
  two tiles against x's even and odd columns, a per-column select of the block scale) was
  bound by those integer operations: one H200, same process, it took 14.4 / 41.9 / 40.9 us at
  M = 64 on 4096x4096 / 12288x4096 / 4096x12288 against 10.7 / 31.0 / 29.5, and 203.6 /
  762.4 us against 105.7 / 417.1 for GLM-shaped grouped experts at 8 / 64 tokens
  (RESULTS.md part 35).

* ``bf16``: plain weights, nothing to dequantize: the TMA'd weight tile is wgmma's A operand
  (``pallas_kernels.dense_matmul``, which unquantized linears use at decode by default on a GPU:
  ``dense_decode_backend``).

The MXFP8 / NVFP4 weight tile is stored in shared memory with the widest swizzle its rows allow
(128 bytes from a 128-byte K step) and read into registers 128 bytes of each row at a time; the
32-column groups are register slices of that. The swizzle is also the width of the TMA boxes that
bring the tile from HBM: with the 32-byte swizzle of the earlier design (one register load per
group) every TMA request covered 32 bytes of each of 64 rows, and the MXFP8 kernel streamed its
weights ~1.4x slower (one H200, M = 1, same process: 12288x4096 27.4 -> 19.7 µs, 4096x12288
25.0 -> 20.4 µs; M = 16 26.1 -> 22.0 µs; results identical; NVFP4, bound by its longer
dequantization, 26.0 -> 25.5 µs).

Constraints (the per-format wrappers pad what does not fit with ``pad_rows`` / ``pad_cols``):
N a multiple of 64, K a multiple of ``tk``, M at most ``TMA_ROWS`` or a multiple of it. Up to
8 rows (batch-1 decode) x is not padded: TMA fills the rows past its end with zeros, and they
only feed output rows that the wrapper crops (padding x cost one extra ~1.4 us kernel per call,
four per transformer layer: Qwen3-8B b=1 step 5.227 -> 5.156 ms without them). A larger row
count must be a multiple of TMA's 8-row shared-memory tiling (compiling fails otherwise), so
such x is padded to the token tile. Padding N or K copies the weight on every call, which only
odd shapes (N = 1 in tests, or a tensor-parallel MXFP8 shard whose K is an odd multiple of 32)
need: real layers have N % 64 == 0 and K a multiple of 64.

Staged scales and register operands against the earlier design, in which the per-row scale
vectors were loaded from HBM one step ahead and the dequantized tile was written to SMEM for an
SMEM-operand wgmma (one H200, 12288x4096, A/B in one process): MXFP8 0.95x at M = 1, 1.26x at
M = 16, 1.41x at M = 64; NVFP4 1.17x at M = 1, 1.09x at M = 16. Mosaic GPU's CPU interpreter
only models SMEM operands, so ``interpret=True`` (the CPU tests) runs the SMEM-operand form of
the same step: the same staged scales and the same dequantization, written to a double-buffered
SMEM tile; the register form is tested on the GPU (``pytest -m gpu``). Both SMEM wgmma operands
use the same swizzle (64 bytes for the 32-column groups), which ``wgmma`` requires.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels.nvfp4 import operands as fp4

BN = 64                      # weight rows per CTA (one warpgroup's wgmma M)
TMA_ROWS = 8                 # row tiling of the x tiles in SMEM (TMA box rows)
ROW = plgpu.Layout.WGMMA.reduce(1)
WGMMA = plgpu.Layout.WGMMA
UPCAST_2X = plgpu.Layout.WGMMA_UPCAST_2X
NUM_SMS = 132                # H200; sizes the decode split and the warp-specialized forms' grids
# The warp-specialized prefill form (``prefill_ws``) takes 128 weight rows per CTA where this
# engine's prefill tiles take 64 (same tokens; this engine's prefill tiles do not split K, that
# form splits it on small grids, ``prefill_ws.config``). Whether it also wins on grids
# smaller than the GPU was measured on the H200 at 128-2048 tokens (same process, bf16 out,
# RESULTS.md part 15): MXFP8's form is never slower (0.99-1.10x at 8-64 CTAs, 1.3-1.8x at 96 and
# more, 1.54x already at 32 CTAs for 4096x12288), so it takes every grid; block FP8's form loses
# below about half the SMs (0.82-0.97x at 8-64 CTAs, except 1.16x for 4096x12288 at 32) and wins
# above (1.32-1.50x at 128), so its small grids stay here. NVFP4's form takes every grid: at 130
# tokens (32-96 CTAs) it ran 46.4 / 54.3 / 136.9 us on 4096x4096 / 12288x4096 / 4096x12288
# against 49.6 / 98.5 / 142.8 for this engine with its earlier NVFP4 decoding (part 35; this
# engine with the word decoding was not timed on those grids). ``fills_gpu`` counts the CTAs of
# the K-split grid: block FP8 at 130 tokens through a 4096x4096 weight then takes the form with 4
# splits (128 CTAs), 16.5 us against 39.0 for this engine (part 36).
WS_MIN_CTAS = {"mxfp8": 1, "fp8_block": NUM_SMS // 2 + 1, "nvfp4": 1}


def fills_gpu(fmt: str, ctas: int) -> bool:
    """Whether a warp-specialized grid of ``ctas`` CTAs is large enough."""
    return ctas >= WS_MIN_CTAS[fmt]


# Decode: K is split until about this many CTAs exist. The register-dequantizing formats are
# bound by each CTA's chain of loads, conversions and wgmmas, so at up to 16 token rows many
# short CTAs (two K steps each) beat a few long ones: one H200, M = 1, cap 12 x NUM_SMS against
# 3 x NUM_SMS, MXFP8 12288x4096 24.2 against 29.1 us, 4096x12288 23.9 against 29.0; NVFP4 25.7
# against 28.4 and 25.8 against 27.2; grouped NVFP4 experts (GLM gate/up, 1 token) 44.1 against
# 53.9 (part 7); M = 16 MXFP8 20.6 against 25.9 us, block FP8 19.6 against 24.2 (part 11). At
# 64 rows the larger fp32 partials cost more than the short CTAs gain: MXFP8 37.6 against 31.5
# us, NVFP4 41.8 against 37.5, block FP8 35.3 against 30.0 (part 11). bf16 streams its TMA tiles
# straight into wgmma and keeps the small cap (12288x4096 30.6 against 28.7 us).
# (benchmarks/RESULTS.md, 2026-11-30 parts 7 and 11.)
REGISTER_DEQUANT = ("mxfp8", "nvfp4", "fp8_block")


def decode_cta_cap(fmt: str, bm: int) -> int:
    """CTAs up to which a decode call splits K (see above)."""
    return (12 if fmt in REGISTER_DEQUANT and bm <= 16 else 3) * NUM_SMS


def smem_tile(dtype, minor: int, swizzle: int | None = None) -> tuple:
    """Tiling + swizzle transforms for an SMEM tile whose minor dim holds ``minor`` elements."""
    isz = jnp.dtype(dtype).itemsize
    sw = swizzle or min(128, minor * isz)
    return (plgpu.TilingTransform((8, sw // isz)), plgpu.SwizzleTransform(sw))


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static tiling of one call."""

    bm: int          # tokens per CTA (wgmma N)
    tk: int          # K elements per pipeline step
    splits: int      # CTAs along K (fp32 partials summed by the wrapper when > 1)
    stages: int      # TMA pipeline depth


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# Shared memory per CTA: prefill tiles take one CTA per SM (227 KB on Hopper, minus barriers and
# slack); decode tiles are kept small enough for two CTAs per SM so that one CTA's dequantization
# overlaps the other's loads.
SMEM_BUDGET = {"prefill": 200 * 1024, "decode": 110 * 1024}


# K elements per scale of the formats whose per-block scales are staged through the pipeline
SCALE_BLOCK = {"mxfp8": 32, "nvfp4": 16}
# Smallest K step of those formats: MXFP8's staged scale tile must fill TMA's 128-byte
# alignment (``plan``); NVFP4's operand order repeats every step of 128 or 256 codes
# (``pallas_kernels/nvfp4/operands.py``). K is padded to (dense) or must be (grouped) a multiple.
MIN_STEP = {"mxfp8": 64, "nvfp4": min(fp4.ENGINE_STEPS)}


def smem_bytes(fmt: str, bm: int, tk: int, stages: int) -> int:
    """Shared memory of one CTA as compiled for the GPU: pipelined weight, activation and scale
    tiles, the double-buffered dequantized tile (block FP8 at prefill tiles only: the other
    dequantizing tiles feed wgmma from registers, bf16 from its TMA tile), output (counted at
    fp32, the widest output dtype, so one plan fits either)."""
    w_step = BN * {"nvfp4": tk // 2, "bf16": 2 * tk}.get(fmt, tk)
    x_step = bm * tk * (1 if fmt == "fp8_w8a8" else 2)
    s_step = BN * tk // SCALE_BLOCK[fmt] if fmt in SCALE_BLOCK else 0
    wdq = 2 * BN * tk * 2 if fmt == "fp8_block" and bm > 64 else 0
    return stages * (w_step + x_step + s_step) + wdq + bm * BN * 4


def plan(m: int, n: int, k: int, fmt: str, *, tk: int | None = None, splits: int | None = None,
         stages: int | None = None, bm: int | None = None, budget: int | None = None,
         row_tiles: int | None = None, max_ctas: int | None = None) -> Plan:
    """Tiles for an [m, k] x [n, k]^T product (n a multiple of 64, k of the chosen tk).

    ``fmt`` is mxfp8 / fp8_block / nvfp4 (dequantizing engine), bf16 (plain weights) or fp8_w8a8
    (tk = 128). The largest K step and pipeline depth that fit ``budget`` bytes of shared memory
    win. MXFP8 / NVFP4 steps are at least ``MIN_STEP`` wide: each stage's staged scale tile (tk /
    block rows of 64 bytes) must fill TMA's 128-byte SMEM alignment (a 64-byte tile, MXFP8 at tk =
    32, put every second stage at a misaligned address: CUDA_ERROR_MISALIGNED_ADDRESS on the
    H200), and NVFP4's operand order needs steps of 128 or 256 codes.
    ``row_tiles``: the number of row tiles when it is not ceil(m / bm) (grouped calls: m is
    one tile's rows), for sizing the K split; decode splits K until ``max_ctas`` CTAs (default
    per format and token tile: ``decode_cta_cap``)."""
    decode = m <= 64
    budget = budget or SMEM_BUDGET["decode" if decode else "prefill"]
    if bm is None:
        bm = max(8, _pow2_at_least(m)) if decode else (128 if m <= 128 else 256)
    if fmt == "fp8_w8a8":
        cands = (128,)
    elif decode:
        cands = (256, 128, 64, 32)
    else:
        cands = (64, 32)
    if fmt in SCALE_BLOCK:
        cands = tuple(c for c in cands if MIN_STEP[fmt] <= c <= 256) or (MIN_STEP[fmt],)
    if tk is not None:
        if fmt in SCALE_BLOCK and tk < MIN_STEP[fmt]:      # see the docstring and MIN_STEP
            raise ValueError(f"{fmt} needs a K step of at least {MIN_STEP[fmt]}, got tk={tk}")
        cands = (tk,)
    depths = (stages,) if stages is not None else ((4, 3, 2) if decode else (3, 2))
    # decode: deepest pipeline first (bytes in flight), then the widest step; prefill: widest step first
    options = ([(c, d) for d in depths for c in cands if k % c == 0] if decode else
               [(c, d) for c in cands if k % c == 0 for d in depths])
    if not options:
        raise ValueError(f"K={k} is not a multiple of any supported tile {cands} for {fmt}")
    fits = [o for o in options if smem_bytes(fmt, bm, o[0], o[1]) <= budget]
    tk, stages = (fits or [min(options, key=lambda o: smem_bytes(fmt, bm, *o))])[0]
    nk = k // tk
    if splits is None:
        splits = 1
        if decode:
            max_ctas = max_ctas or decode_cta_cap(fmt, bm)
            ctas = (n // BN) * (row_tiles or -(-m // bm))
            for s in range(1, nk + 1):
                if nk % s == 0 and nk // s >= 2 and ctas * s <= max_ctas:
                    splits = s
    if nk % splits:
        raise ValueError(f"splits={splits} must divide the {nk} K steps")
    return Plan(bm=bm, tk=tk, splits=splits, stages=max(2, min(stages, nk // splits + 1)))


def _e8m0_to_bf16(u):
    """E8M0 bytes -> bf16 2^(u-127) by placing u in the bf16 exponent field."""
    return lax.bitcast_convert_type(lax.shift_left(u.astype(jnp.int16), jnp.int16(7)), jnp.bfloat16)


def _e4m3_to_f32(v):
    return v.astype(jnp.float16).astype(jnp.float32)


def load_chunk(fmt: str, w_smem, cw: int, c: int):
    """Register load of stored columns [cw*c, cw*(c+1)) of a [64, tk] weight tile (cw = its
    swizzle in bytes), in the wgmma layout and converted: f16-exact bf16 (mxfp8) or f32
    (fp8_block)."""
    raw = plgpu.layout_cast(plgpu.load(w_smem.at[:, pl.ds(cw * c, cw)], layout=UPCAST_2X), WGMMA)
    return raw.astype(jnp.float16).astype(jnp.bfloat16) if fmt == "mxfp8" else _e4m3_to_f32(raw)


def scale_shapes(fmt: str, n: int, k: int, experts: int | None = None) -> list[tuple]:
    """Shapes of ``wdequant_matmul``'s scale operands for padded [N, K] weights (grouped form:
    ``experts`` matrices stacked); an unknown format gets none (the kernel rejects it)."""
    if fmt == "fp8_block":
        return [((experts or 1) * -(-n // 128), -(-k // 128))]
    if fmt in SCALE_BLOCK:
        blocks = (k // SCALE_BLOCK[fmt], n) if experts is None else (experts, k // SCALE_BLOCK[fmt], n)
        return [blocks] + ([(experts or 1,)] if fmt == "nvfp4" else [])
    return []


@functools.partial(jax.jit, static_argnames=("fmt", "p", "out_dtype", "expert_n", "interpret"))
def wdequant_matmul(x, w, scales, *, fmt: str, p: Plan, out_dtype, tile_expert=None, expert_n=None,
                    interpret=False):
    """Runs the kernel on operands padded along N and K.

    x       [M, K] bf16; nvfp4: in the engine's K order (``fp4.order_x``);
            M <= TMA_ROWS or a multiple of TMA_ROWS
    w       [N, K] e4m3 (mxfp8, fp8_block), [N, K/2] uint8 (nvfp4) or [N, K] bf16 (bf16)
    scales  mxfp8: (weight_scale uint8 [K/32, N],); fp8_block: (weight_scale_inv f32 [N/128, K/128],);
            nvfp4: (weight_scale e4m3 [K/16, N], weight_scale_2 f32 [1]); bf16: (). The per-block
            scales of mxfp8 / nvfp4 are transposed from the checkpoint's [N, K/b]: a step's scales
            for 64 rows are then one [tk/b, 64] TMA tile of 64-byte rows (in the checkpoint layout
            its rows would be 2-8 bytes, below TMA's 16-byte minimum)
    returns [Mo, N] out_dtype (splits == 1) or [splits, Mo, N] f32 partials: Mo = M when x is
    one partial token tile (TMA drops the tile's stores past M), else M rounded up to the token
    tile (the rows past M hold products of zeros)

    Grouped form (MoE experts), ``tile_expert`` int32 [Mp / bm]: row tile t of x is multiplied
    by expert ``tile_expert[t]`` (< 0: the tile is skipped and its output rows are left
    unwritten). The weight then holds E experts of ``expert_n`` rows each stacked along N
    (``w`` [E·N, ...]; fp8_block's scales likewise, [E·N/128, K/128] with N % 128 == 0), the
    per-block scales of mxfp8 / nvfp4 are ``[E, K/32 or K/16, N]``, nvfp4's ``weight_scale_2``
    is [E], and the result has N = ``expert_n`` columns.
    """
    grouped = tile_expert is not None
    n = expert_n if grouped else w.shape[0]
    bm, tk, splits, stages = p.bm, p.tk, p.splits, p.stages
    k = w.shape[1] * (2 if fmt == "nvfp4" else 1)
    nk = k // tk // splits
    rows = x.shape[0]
    mp = round_up(rows, bm)                      # rows past x's end load as zeros (TMA)
    if (n % BN or k % (tk * splits) or (rows > TMA_ROWS and rows % TMA_ROWS)
            or (grouped and tile_expert.shape != (rows // bm,))):
        raise ValueError(f"operands not padded for the plan: M={rows} N={n} K={k} plan={p}")
    part_dtype = jnp.float32 if splits > 1 else jnp.dtype(out_dtype)
    bf16 = jnp.bfloat16
    staged = fmt in SCALE_BLOCK                  # per-block scales come through the pipeline
    dequantizing = fmt != "bf16"
    # dequantized tiles feed wgmma from registers, except block FP8 at prefill tiles (faster through
    # SMEM there: RESULTS.md 2026-11-30 part 11; ``smem_bytes`` counts that buffer)
    register_a = dequantizing and not interpret and not (fmt == "fp8_block" and bm > 64)
    dequantized_smem = dequantizing and not register_a
    want = scale_shapes(fmt, n, k, w.shape[0] // n if grouped else None)
    if [tuple(a.shape) for a in scales] != want:
        raise ValueError(f"{fmt} scales {[tuple(a.shape) for a in scales]} do not match the padded operands "
                         f"(expected {want})")

    if fmt == "mxfp8":
        groups, gw = tk // 32, 32                    # 32-column groups, one scale each
        w_block, w_tr = (BN, tk), smem_tile(jnp.float8_e4m3fn, tk)
        op_tr = smem_tile(bf16, tk, swizzle=64)
    elif fmt == "fp8_block":
        groups, gw = tk // min(128, tk), min(128, tk)  # one 128x128 scale block per group
        w_block, w_tr = (BN, tk), smem_tile(jnp.float8_e4m3fn, tk)
        op_tr = smem_tile(bf16, tk)
    elif fmt == "nvfp4":
        groups, gw = tk // 32, 32                    # 32-column slice pairs of the operand order
        w_block, w_tr = (BN, tk // 2), smem_tile(jnp.uint8, tk // 2)
        op_tr = smem_tile(bf16, tk, swizzle=64)
    elif fmt == "bf16":
        w_block, w_tr = (BN, tk), smem_tile(bf16, tk)
        op_tr = smem_tile(bf16, tk)
    else:
        raise ValueError(f"unknown format {fmt!r}")
    wdq_shape = (2, 1, BN, tk)       # the double-buffered dequantized tile, where it is staged in SMEM

    def kernel(x_gmem, w_gmem, *refs):
        s_gmem = refs[:len(scales)]
        te_gmem = refs[len(scales)] if grouped else None
        o_gmem, *wdq, o_smem = refs[len(scales) + grouped:]
        nb = lax.axis_index("n")
        mb = lax.axis_index("m")
        ks = lax.axis_index("k")
        k0 = ks * nk                                 # first K step of this split
        e = te_gmem[mb] if grouped else 0            # expert of this row tile
        wb = e * (n // BN) + nb                      # weight row block

        def tile():
            def block_scales(kk):
                """fp8_block: the scalar scale of each group's 128x128 block at step kk."""
                return [s_gmem[0][(wb * BN) // 128, ((k0 + kk) * tk + gw * j) // 128] for j in range(groups)]

            # fp8_block, few steps per CTA (decode): every scale read once before the pipeline starts,
            # so that no step waits on a scalar load from HBM
            early = [block_scales(st) for st in range(nk)] if fmt == "fp8_block" and nk * groups <= 16 else None

            def step_scales(s_smem, kk):
                """mxfp8 / nvfp4: per-row scale vectors (ROW layout) of this step, from its TMA-staged
                [blocks, 64] tile; fp8_block: the scalar scale of each group's 128x128 block."""
                if fmt == "fp8_block" and early is None:
                    return tuple(block_scales(kk))
                if fmt == "fp8_block":
                    picked = early[0]
                    for st in range(1, nk):
                        picked = [jnp.where(kk == st, a, b) for a, b in zip(early[st], picked)]
                    return tuple(picked)
                if fmt == "nvfp4":           # read by the fragments themselves
                    return s_smem
                return tuple(_e8m0_to_bf16(plgpu.load(s_smem.at[i], layout=ROW)) for i in range(s_smem.shape[0]))

            cw = min(128, w_block[1])                # stored columns (bytes) per register load = the swizzle

            def dequant_groups(w_smem, sc):
                """Yields, per column group j of the step (32 columns; block FP8: up to 128), its
                dequantized bf16 operand."""
                if fmt == "nvfp4":
                    yield from nvfp4_groups(w_smem, sc)
                    return
                per = cw // gw
                for c in range(groups // per):
                    chunk = load_chunk(fmt, w_smem, cw, c)
                    for jj in range(per):
                        v = chunk if per == 1 else chunk[:, gw * jj:gw * (jj + 1)]
                        yield dequant_group(v, sc, c * per + jj)

            def dequant_group(v, sc, j):
                if fmt == "fp8_block":
                    return (v * sc[j]).astype(bf16)
                return v * lax.broadcast_in_dim(sc[j], v.shape, [0])

            def nvfp4_groups(w_smem, s_smem):
                """NVFP4: the step's slice pairs in the operand order of ``fp4.order_x``, decoded
                from whole words of codes (the interpreter: their jnp values)."""
                if interpret:
                    v = fp4.engine_values(w_smem[...], s_smem[...], tk)
                    for j in range(groups):
                        yield v[:, gw * j:gw * (j + 1)]
                    return
                yield from fp4.step_fragments(w_smem, s_smem, tk=tk, w_transforms=w_tr)

            def dequant(w_smem, buf, sc):
                for j, v in enumerate(dequant_groups(w_smem, sc)):
                    buf.at[0, :, pl.ds(gw * j, gw)][...] = v

            def compute(acc):
                def body(idx, w_smem, x_smem, *rest):
                    (kk,) = idx
                    s_smem = rest[0] if staged else None
                    sc = step_scales(s_smem, kk) if dequantizing else ()
                    if fmt == "bf16":        # the TMA tile is the wgmma operand
                        plgpu.wgmma(acc, w_smem, x_smem.T)
                        plgpu.wgmma_wait(0)
                        return
                    if register_a:
                        for j, v in enumerate(dequant_groups(w_smem, sc)):
                            plgpu.wgmma(acc, v, x_smem.at[:, pl.ds(gw * j, gw)].T)
                        plgpu.wgmma_wait(0)
                        return
                    buf = wdq[0].at[lax.rem(kk, 2)]
                    dequant(w_smem, buf, sc)
                    plgpu.commit_smem()
                    plgpu.wgmma(acc, buf.at[0], x_smem.T)
                    plgpu.wgmma_wait(1)

                in_specs = [plgpu.BlockSpec(w_block, lambda kk: (wb, k0 + kk), transforms=w_tr),
                            plgpu.BlockSpec((bm, tk), lambda kk: (mb, k0 + kk), transforms=op_tr, delay_release=1)]
                srcs = [w_gmem, x_gmem]
                if staged:
                    in_specs.append(plgpu.BlockSpec((tk // SCALE_BLOCK[fmt], BN), lambda kk: (k0 + kk, nb)))
                    srcs.append(s_gmem[0].at[e] if grouped else s_gmem[0])
                plgpu.emit_pipeline(body, grid=(nk,), in_specs=in_specs, max_concurrent_steps=stages)(*srcs)
                plgpu.wgmma_wait(0)
                return acc[...]

            # nvfp4's global scale, read before the pipeline so that its HBM latency hides there
            s2 = s_gmem[1][e] if fmt == "nvfp4" else None
            acc = pl.run_scoped(compute, plgpu.ACC((BN, bm), jnp.float32))
            if fmt == "nvfp4":
                acc = acc * (s2 * fp4.FACTOR)
            store_tile(acc.astype(part_dtype), o_smem, o_gmem, ks, splits, pl.ds(mb * bm, bm), pl.ds(nb * BN, BN))

        if grouped:
            pl.when(e >= 0)(tile)
        else:
            tile()

    out_rows = rows if rows < bm else mp           # batch-1 decode: no partials of padding rows (part 11)
    out_shape = (splits, out_rows, n) if splits > 1 else (out_rows, n)
    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(out_shape, part_dtype),
        scratch_types=(
            *([plgpu.SMEM(wdq_shape, bf16, transforms=op_tr)] if dequantized_smem else []),  # dequantized tiles
            plgpu.SMEM((bm, BN), part_dtype, transforms=smem_tile(part_dtype, BN)),     # output tile
        ),
        grid=(n // BN, mp // bm, splits),
        grid_names=("n", "m", "k"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **common.interpret_kwargs(interpret),
    )
    return call(x, w, *scales, *((tile_expert,) if grouped else ()))


def store_tile(acc_t, o_smem, o_gmem, ks, splits: int, rows, cols) -> None:
    """Epilogue shared by the weight-dequant kernels: the transposed accumulator tile
    ``acc_t [cols, rows]`` (already in the partial-sum dtype) to ``o_gmem[(ks,) rows, cols]``
    through SMEM; with split-K each split writes its own slab, summed later by ``finish``."""
    o_smem.T[...] = plgpu.layout_cast(acc_t, plgpu.Layout.WGMMA_TRANSPOSED)
    plgpu.commit_smem()
    dst = o_gmem.at[ks] if splits > 1 else o_gmem
    plgpu.copy_smem_to_gmem(o_smem, dst.at[rows, cols])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)     # the writes complete by the kernel's end


def matmul_padded(fmt: str, x2, w, scales, n: int, out_dtype, interpret=False, **plan_overrides):
    """The dense (non-grouped) call of the per-format wrappers: ``x2`` [m, Kp] bf16 with K already
    padded like ``w`` [Np, Kp'] and ``scales`` (N a multiple of 64, K of the format's smallest K
    step) -> [m, n] out_dtype.
    Plans the tiling, pads the rows of x to the token tile when there are more than
    ``TMA_ROWS``, stores x in the engine's K order for NVFP4 (``fp4.order_x``), runs
    :func:`wdequant_matmul` and sums split-K partials. Prefill-shaped MXFP8, NVFP4 and block-FP8
    calls on the GPU (more than 64 rows, no plan overrides) run the warp-specialized form,
    ``prefill_ws``, where their shapes fit it and its grid is large enough (``fills_gpu``)."""
    m, kp = x2.shape
    if m > 64 and not interpret and not plan_overrides:
        from . import prefill_ws           # (imports this module)

        c = prefill_ws.config(fmt, m, w.shape[0], kp, out_dtype)
        if c is not None and fills_gpu(fmt, prefill_ws.ctas(c, m, w.shape[0])):
            xw = pad_rows(x2, round_up(m, 8))             # TMA's tiled view takes whole 8-row tiles
            y = prefill_ws.prefill_matmul(fp4.order_x(xw, c.tk) if fmt == "nvfp4" else xw, w, scales, fmt=fmt, c=c,
                                          out_dtype=jnp.dtype(out_dtype))
            return finish(y, c.splits, m, n, out_dtype)
    p = plan(m, w.shape[0], kp, fmt, **plan_overrides)
    xp = x2 if m <= TMA_ROWS else pad_rows(x2, round_up(m, p.bm))     # see the module docstring
    xp = fp4.order_x(xp, p.tk) if fmt == "nvfp4" else xp
    y = wdequant_matmul(xp, w, scales, fmt=fmt, p=p, out_dtype=out_dtype, interpret=interpret)
    return finish(y, p.splits, m, n, out_dtype)


def finish(y, splits: int, m: int, n: int, out_dtype):
    """Sums the partials of a K split over ``splits`` CTAs and crops the padding: -> [m, n] out_dtype."""
    if splits > 1:
        y = jnp.sum(y, axis=0)
    return y[:m, :n].astype(out_dtype)


def pad_rows(a, rows: int):
    """Zero-pads axis 0 to ``rows``."""
    return a if a.shape[0] == rows else jnp.pad(a, ((0, rows - a.shape[0]),) + ((0, 0),) * (a.ndim - 1))


def pad_cols(a, cols: int):
    return a if a.shape[1] == cols else jnp.pad(a, ((0, 0), (0, cols - a.shape[1])))


def round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
