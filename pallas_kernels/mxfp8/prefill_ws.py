"""Warp-specialized prefill form of the dequantizing engine (``wdequant``) for MXFP8, NVFP4 and
block FP8 weights (W8A16 / W4A16): one CTA computes a 128-weight-row x ``bm``-token output tile
with three warpgroups, one issuing TMA loads of the weight, activation and scale tiles through a
``stages``-deep ring, two dequantizing their 64 weight rows each (the math of ``wdequant``'s
register-operand path: e4m3 -> f16 -> bf16 times the E8M0 or the block's fp32 scale; NVFP4's
words of codes, ``pallas_kernels/nvfp4/operands.py``) and feeding them to ``wgmma`` from
registers against the shared activation tile. While one compute warpgroup
converts, the other's ``wgmma`` occupies the tensor cores, which the one-warpgroup engine (64
weight rows per CTA, conversion and ``wgmma`` in turn) cannot overlap.

One H200, same process (RESULTS.md, 2026-11-30 part 12; results equal to XLA's
dequantize-then-dot bit for bit): at M = 2048 MXFP8 4096x4096 107.6 us against 171.2 us for the
one-warpgroup engine (1.14x XLA's bf16 dot), 12288x4096 332 against 515 us; block FP8 107.7 /
326.0 against 155.3 / 466.5 us.

The launch order (`tile_of`) walks 2048 tokens' tiles for each weight block before the next
block, so that the CTAs resident at once share a few token and weight tiles instead of every
weight block of one token tile. At M = 8192 that made the form 5-7 % faster (MXFP8 4096x4096 /
12288x4096 / 4096x12288: 408.9 / 1228.3 / 1182.6 -> 387.2 / 1150.6 / 1116.1 us; block FP8 3-7 %;
results bit-identical) and left M = 2048 unchanged; groups of 1024 or 4096 tokens were slower
(H200, RESULTS.md part 33). NVFP4 (its first form here, part 35) ran 2048 tokens 1.9x faster
than the one-warpgroup engine: 105.0 / 299.6 / 299.1 us against 194.8 / 572.6 / 594.5 on
4096x4096 / 12288x4096 / 4096x12288 (0.85-0.99x XLA's bf16 dot). Then MXFP8 runs 0.97-1.02x
XLA's bf16 product at M = 8192 when that product is an fp32 result cast to bf16, 0.88-1.00x against its bf16 result (part 34). XLA's
dequantize-then-dot with that bf16 result is 4-12 % faster at M = 8192, so the linear layers
give it chunks from 8192 rows (``linear.kernel_max_rows``). 2-CTA clusters sharing the token
tile by TMA multicast (as the W8A8 form does) gain 3-8 % for NVFP4 and 10-15 % for MXFP8 grids
of one token tile, nothing for block FP8 (``shares_token_tiles``); with the deferred ``wgmma``
wait below they gave wrong MXFP8 results (the cluster-wide release of the slots), so MXFP8's
clusters wait for every group.

With a pipeline of three or more stages, an MXFP8 step (two or more ``wgmma`` groups) waits
for all but its last group, which keeps the tensor cores busy while the next tile is dequantized
(its pipeline slots are released one step late): +5-10 % at M = 2048 / 8192 on 4096-12288-row
weights and +1-7 % on the smaller grids this form takes (2560x1280 at M = 2048, 4096x4096 at
M = 1024), results bit-identical over six inputs each (H200, RESULTS.md parts 14 and 15).
Block FP8 keeps the full wait: its step is one group, and deferring that wait returned inf on
the H200; its 2-stage pipeline would also lose a stage.

Small grids (``config``): token tiles are as tight as 16-token multiples allow (130 tokens: one
tile of 144, not 256), and a grid that does not fill the GPU takes the tiling with the most CTAs
up to one per SM: 128-token tiles, K split over CTAs that each write an fp32 partial
([splits, M, N], summed by the caller). One H200, same process, device us per call including
the partial sums, 96 / 130 / 256 / 512 tokens against the tiling before (256-token tiles, no
split; block FP8 there ran the one-warpgroup engine; RESULTS.md part 36):

  NVFP4 4096x4096    30.1 / 47.0 / 45.4 / 49.2     -> 12.5 / 15.9 / 23.3 / 35.6
  NVFP4 4096x12288   92.6 / 137.1 / 135.7 / 138.4  -> 29.9 / 36.2 / 57.8 / 98.2
  MXFP8 4096x12288   91.9 / 122.0 / 118.2 / 119.4  -> 36.9 / 40.3 / 57.2 / 92.7
  block FP8 4096x12288  108.8 / 120.6 / 118.6 / 119.4 -> 31.7 / 37.1 / 56.4 / 95.8

12288-row weights (96 CTAs at 256-token tiles, no room for a split) gain 13-27 % at 96-130
tokens from the tighter tiles and are unchanged from 256 tokens.

GPU only: Mosaic GPU's interpreter models neither warp-specialized pipelines nor register
operands, so interpret mode keeps ``wdequant``'s one-warpgroup form (same numerics).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import SMEM_PER_CTA
from pallas_kernels.nvfp4 import operands as fp4

from . import wdequant as wd

RB = 128                     # weight rows per CTA: two compute warpgroups x 64
GROUP_TOKENS = 2048          # tokens of the launch order's groups (`tile_of`)
FORMATS = ("mxfp8", "fp8_block", "nvfp4")
MIN_SPLIT_STEPS = 4          # K steps of a split CTA at the least
# (tk, stages) in order of preference per format (among tilings of as many CTAs, the first that
# fits SMEM_PER_CTA with the output tile, ``config``): one H200 at M = 2048 / 8192, bm = 256:
# MXFP8 best at tk 64 with 3-4 stages, block FP8 (one scale per 128 columns) at tk 128 with 2
# stages (RESULTS.md part 12).
STEPS = {"mxfp8": ((64, 4), (64, 3), (64, 2)), "fp8_block": ((128, 2), (64, 4), (64, 3), (64, 2)),
         "nvfp4": ((128, 2),)}


def smem_bytes(fmt: str, bm: int, tk: int, stages: int, out_bytes: int) -> int:
    """Shared memory of one CTA: the pipelined weight, activation (and MXFP8 / NVFP4 scale) tiles
    and the two warpgroups' output tiles."""
    scales = 2 * 64 * tk // wd.SCALE_BLOCK[fmt] if fmt in wd.SCALE_BLOCK else 0
    w_bytes = RB * tk // (2 if fmt == "nvfp4" else 1)
    return stages * (w_bytes + bm * tk * 2 + scales) + 2 * bm * 64 * out_bytes


class Config(NamedTuple):
    """Tiling of one call: ``bm`` tokens per CTA, K steps of ``tk`` through a ``stages``-deep
    ring, K split over ``splits`` CTAs (fp32 partials summed by the caller when > 1), CTAs in
    clusters of ``cluster`` along N that share each token tile by TMA multicast."""

    bm: int
    tk: int
    stages: int
    splits: int
    cluster: int = 1


def token_tile(m: int, most: int) -> int:
    """The tightest token tile that covers m tokens in ceil(m / most) tiles: a multiple of 16
    tokens. (wgmma and TMA take multiples of 8, but on the H200 a 136-token MXFP8 tile with a
    4-stage ring and an fp32 output tile gave wrong sums, relative error 1-3e-2; every other
    tile tried matched XLA's product: MXFP8 16-256 tokens in steps of 32 and 256, block FP8 and
    NVFP4 48-240 in steps of 48 and 144, each with every (tk, stages) of ``STEPS``, bf16 and fp32
    outputs, split and not; RESULTS.md part 36.)"""
    tiles = -(-m // most)
    return wd.round_up(-(-m // tiles), 16)


def config(fmt: str, m: int, n: int, k: int, out_dtype) -> Config | None:
    """Tiling for an [m, k] x [n, k]^T product (n, k padded like ``wdequant``'s operands), or
    None when the shapes do not fit this form (N not a multiple of 128, K of no K step, an
    output tile too large).

    Token tiles of up to 256 tokens while that grid fills the GPU (one CTA per SM); a smaller
    grid takes the tiling with the most CTAs up to ``NUM_SMS``: tiles of up to 256 or 128
    tokens, K split over up to ``NUM_SMS`` CTAs with at least ``MIN_SPLIT_STEPS`` K steps each,
    ties to the (tk, stages) preferred in ``STEPS``, then to the larger token tile; in 2-CTA
    clusters where ``shares_token_tiles``."""
    if fmt not in FORMATS or n % RB:
        return None
    options = []                             # (CTAs, -preference, bm, Config)
    for bm in dict.fromkeys(token_tile(m, most) for most in (256, 128)):
        for pref, (tk, stages) in enumerate(STEPS[fmt]):
            nk = k // tk
            if k % tk:
                continue
            for s in [1] + [s for s in range(2, nk + 1) if nk % s == 0 and nk // s >= MIN_SPLIT_STEPS]:
                c = Config(bm, tk, stages, s)
                out_bytes = 4 if s > 1 else jnp.dtype(out_dtype).itemsize
                fits = smem_bytes(fmt, bm, tk, stages, out_bytes) <= SMEM_PER_CTA
                if fits and (s == 1 or ctas(c, m, n) <= wd.NUM_SMS):
                    options.append((ctas(c, m, n), -pref, bm, c))
    if not options:
        return None
    largest = options[0]                     # the largest token tile that fits, no split, the preferred K step
    one_wave = [o for o in options if o[0] <= wd.NUM_SMS]
    c = (largest if largest[0] >= wd.NUM_SMS or not one_wave else max(one_wave))[3]
    return c._replace(cluster=2) if shares_token_tiles(fmt, m, n, c.bm) else c


def shares_token_tiles(fmt: str, m: int, n: int, bm: int) -> bool:
    """Whether pairs of CTAs along N take each token tile by TMA multicast (a 2-CTA cluster;
    N must hold an even number of 128-row blocks): NVFP4 on every grid, MXFP8 when all tokens
    are one tile (its clusters drop the deferred ``wgmma`` wait, which is worth more than the
    multicast on larger grids). Block FP8 gains nothing from them. One H200, same process, device
    us (RESULTS.md part 37), results bit-identical:

      NVFP4 130x4096x12288 / 512x4096x12288 / 512x12288x4096 / 2048x12288x4096 / 2048x4096x4096:
        36.6 / 100.5 / 102.1 / 300.8 / 107.1 -> 34.9 / 97.3 / 94.7 / 281.5 / 99.3
      MXFP8 130x12288x4096 / 256x12288x4096 / 130x4096x12288 (one token tile):
        43.9 / 56.7 / 40.4 -> 39.8 / 48.3 / 36.5; without the deferred wait alone 42.0 / 51.7 / 38.2
      MXFP8 512x4096x4096 / 512x4096x12288 / 2048x4096x12288 (several tiles):
        32.8 / 92.9 / 272.7 -> 35.3 / 100.8 / 283.1 (so these keep one CTA a cluster)"""
    if (n // RB) % 2:
        return False
    return fmt == "nvfp4" or (fmt == "mxfp8" and m <= bm)


def ctas(c: Config, m: int, n: int) -> int:
    """CTAs of the grid of an [m, k] x [n, k]^T call tiled by ``c``."""
    return n // RB * -(-m // c.bm) * c.splits


def launch_order(t, n_units: int, m_blocks: int, group: int):
    """(weight unit, token tile) of the t-th CTA (cluster) launched: ``group`` token tiles for
    each weight unit, then the next unit; after the last unit the next group of token tiles (the
    last group may be shorter). A bijection of [0, n_units * m_blocks) (works on ints and traced
    values alike)."""
    first = t // (group * n_units) * group
    size = jnp.minimum(m_blocks - first, group)
    r = t % (group * n_units)
    return r // size, first + r % size


def tile_of(n: int, m: int, bm: int, cluster: int, splits: int = 1):
    """(weight block, token tile, K split) of this CTA: `launch_order` over groups of
    ``GROUP_TOKENS`` tokens, so that the CTAs resident at once share their token and weight
    tiles (L2 reuse), one K split after the other; a 2-CTA cluster's unit is a pair of adjacent
    weight blocks, one a member."""
    units = n // RB // cluster
    per_split = units * (m // bm)
    t = lax.axis_index("t")
    unit, mb = launch_order(t % per_split, units, m // bm, max(1, GROUP_TOKENS // bm))
    return (unit if cluster == 1 else unit * cluster + lax.axis_index("cl")), mb, t // per_split


def store_wg_tile(acc, o_smem, o_gmem, bm: int, nb, mb) -> None:
    """Epilogue of a compute warpgroup of a warp-specialized form: its [64 weight rows, bm tokens]
    fp32 accumulator (value) to ``o_gmem[tokens, rows]`` of weight block ``nb`` and token tile
    ``mb`` in the output dtype, through its half of the [2, bm, 64] SMEM tile."""
    wg = lax.axis_index("wg")
    dst = o_smem.at[wg]
    dst.T[...] = plgpu.layout_cast(acc.astype(o_smem.dtype), plgpu.Layout.WGMMA_TRANSPOSED)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dst, o_gmem.at[pl.ds(mb * bm, bm), pl.ds(nb * RB + wg * 64, 64)])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def ws_call(kernel, m: int, n: int, bm: int, out_dtype, cluster: int = 1, splits: int = 1,
            wg_tile: tuple[int, int] | None = None, compute_wgs: int = 2,
            out_mn: tuple[int, int] | None = None):
    """The launch shared by the warp-specialized forms: one CTA per output tile of 128 weight
    rows x bm tokens and K split, in clusters of ``cluster`` CTAs "cl" along N, in `tile_of`'s
    order (grid "t"), ``compute_wgs`` compute warpgroups "wg" and one TMA warpgroup, an [M, N]
    output ([splits, M, N] fp32 partials when K is split) and the compute warpgroups' output
    tiles as [compute_wgs, *wg_tile] scratch (default [2, bm, 64]: each warpgroup's 64 weight
    rows of the bm tokens). ``out_mn``: a smaller [M', N'] output (M' a multiple of 8, N' of the
    output tile's columns), whose tiles' stores past its edge TMA drops, which spares the caller
    a copy that slices off the padding."""
    out_dtype = jnp.dtype(jnp.float32 if splits > 1 else out_dtype)
    out_mn = out_mn or (m, n)
    out_shape = (splits, *out_mn) if splits > 1 else out_mn
    rows, cols = wg_tile or (bm, 64)
    clusters = dict(cluster=(cluster,), cluster_names=("cl",)) if cluster > 1 else {}
    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        scratch_types=(plgpu.SMEM((compute_wgs, rows, cols), out_dtype, transforms=wd.smem_tile(out_dtype, cols)),),
        grid=(splits * (n // RB // cluster) * (m // bm),), grid_names=("t",), num_threads=compute_wgs + 1,
        thread_name="wg",
        **clusters,
        compiler_params=plgpu.CompilerParams(approx_math=True))


@functools.partial(jax.jit, static_argnames=("fmt", "c", "out_dtype"))
def prefill_matmul(x, w, scales, *, fmt: str, c: Config, out_dtype):
    """x [M, K] bf16 (M a multiple of 8; the last token tile's rows past M read as zeros and its
    stores past them are dropped), w [N, K] e4m3 or [N, K/2] NVFP4 codes (N a multiple
    of 128), scales: mxfp8 ([K/32, N] uint8 transposed E8M0,), fp8_block ([N/128, K/128] fp32,),
    nvfp4 ([K/16, N] e4m3 transposed, weight_scale_2 f32 [1]) -> [M, N] out_dtype, or [splits,
    M, N] fp32 partials when c.splits > 1. NVFP4 takes x in the engine's K order
    (``fp4.order_x``) and its codes as whole words (``fp4.engine_fragments``)."""
    m, k = x.shape
    n = w.shape[0]
    bm, tk, stages, splits, cluster = c
    nk = k // tk // splits                   # K steps of one split
    mt = wd.round_up(m, bm)                  # tokens of the grid's tiles
    if m % 8 or n % (RB * cluster) or k % (tk * splits):
        raise ValueError(f"operands not padded for the warp-specialized form: M={m} N={n} K={k} {c}")
    bf16 = jnp.bfloat16
    w_cols = tk // (2 if fmt == "nvfp4" else 1)     # weight tile bytes a row and step
    w_tr = wd.smem_tile(w.dtype, w_cols)
    cw = min(128, tk)                        # stored columns per register load = the swizzle
    delay = int(fmt == "mxfp8" and stages >= 3 and cluster == 1)   # wgmma groups left running at a step's end
    scale, *s2 = scales
    if fmt in wd.SCALE_BLOCK:
        scale = scale.reshape(k // wd.SCALE_BLOCK[fmt], n // 64, 64)   # a CTA's two 64-row scale vectors per block
        x_tr = wd.smem_tile(bf16, tk, swizzle=64)      # wgmma reads it in 32-column groups
        gw = 32
    else:
        x_tr = wd.smem_tile(bf16, tk)
        gw = cw                              # one 128x128 block's scale per chunk

    def kernel(x_gmem, w_gmem, s_gmem, *refs):
        *s2_gmem, o_gmem, o_smem = refs
        nb, mb, ks = tile_of(n, mt, bm, cluster, splits)
        k0 = ks * nk                         # first K step of this split

        def compute_context(eval_pipeline):
            @functools.partial(pl.run_scoped, acc=plgpu.ACC((64, bm), jnp.float32))
            def _(acc):
                factor = s2_gmem[0][0] * fp4.FACTOR if s2_gmem else None    # read before the pipeline
                eval_pipeline(acc)
                plgpu.wgmma_wait(0)
                out = acc[...] if factor is None else acc[...] * factor
                store_wg_tile(out, o_smem, o_gmem.at[ks] if splits > 1 else o_gmem, bm, nb, mb)

        def body(idx, w_smem, x_smem, *rest):
            (kk,) = idx
            acc = rest[-1]
            wg = lax.axis_index("wg")
            rows = w_smem.at[pl.ds(wg * 64, 64)]
            if fmt == "nvfp4":
                frags = fp4.step_fragments(rows, rest[0].at[:, wg], tk=tk, w_transforms=w_tr)
                for q, v in enumerate(frags):
                    plgpu.wgmma(acc, v, x_smem.at[:, pl.ds(32 * q, 32)].T)
                plgpu.wgmma_wait(0)
                return acc
            if fmt == "mxfp8":
                sc = [wd._e8m0_to_bf16(plgpu.load(rest[0].at[i, wg], layout=wd.ROW)) for i in range(tk // 32)]
            else:                            # this CTA's 128 rows are one block row
                sc = [s_gmem[nb, ((k0 + kk) * tk + gw * j) // 128] for j in range(tk // gw)]
            for c in range(tk // cw):
                chunk = wd.load_chunk(fmt, rows, cw, c)
                if fmt == "fp8_block":
                    plgpu.wgmma(acc, (chunk * sc[c]).astype(bf16), x_smem.at[:, pl.ds(cw * c, cw)].T)
                    continue
                for jj in range(cw // 32):
                    j = c * (cw // 32) + jj
                    v = chunk[:, 32 * jj:32 * (jj + 1)] * lax.broadcast_in_dim(sc[j], (64, 32), [0])
                    plgpu.wgmma(acc, v, x_smem.at[:, pl.ds(32 * j, 32)].T)
            plgpu.wgmma_wait(delay)
            return acc

        in_specs = [plgpu.BlockSpec((RB, w_cols), lambda kk: (nb, k0 + kk), transforms=w_tr, delay_release=delay),
                    plgpu.BlockSpec((bm, tk), lambda kk: (mb, k0 + kk), transforms=x_tr, delay_release=delay,
                                    collective_axes=("cl",) if cluster > 1 else ())]
        srcs = [w_gmem, x_gmem]
        if fmt in wd.SCALE_BLOCK:
            in_specs.append(plgpu.BlockSpec((tk // wd.SCALE_BLOCK[fmt], 2, 64), lambda kk: (k0 + kk, nb, 0),
                                            delay_release=delay))
            srcs.append(s_gmem)
        plgpu.emit_pipeline_warp_specialized(
            body, grid=(nk,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=stages, compute_context=compute_context, in_specs=in_specs)(*srcs)

    return ws_call(kernel, mt, n, bm, out_dtype, cluster, splits, out_mn=(m, n))(x, w, scale, *s2)
