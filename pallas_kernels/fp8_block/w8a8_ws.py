"""Warp-specialized prefill form of the block-FP8 W8A8 matmul (DeepGEMM's Hopper scheme): one
CTA computes a (64 * wgs)-token x 128-weight-row output tile with wgs = 2 or 3 math warpgroups
and one TMA warpgroup. The TMA warpgroup loads the [128, 128] e4m3 weight tile, the [64 * wgs,
128] e4m3 activation tile and the tokens' fp32 activation scales through a ring; each
math warpgroup runs an fp8 ``wgmma`` of its 64 tokens (the M operand) against the 128 weight
rows (N) into a fresh fp32 accumulator per 128-wide K group and promotes it, ``acc += chunk *
sx[token] * sw[block]``, while the other warpgroups' ``wgmma``s occupy the tensor cores. Same
numerics as the one-warpgroup kernel in ``kernel.py`` (same products, same promotion order): the
two agree bit for bit.

Three math warpgroups keep the tensor cores busier through the promotions (each waits for its
own ``wgmma`` before promoting) and read each weight tile for 192 tokens. Their tiles pad M more
and make fewer, longer CTAs, so ``warpgroups`` counts the waves of both grids. One H200, kernel
alone, 2 against 3 warpgroups, results bit-identical (RESULTS.md part 40), µs:

  4096x4096 weight:  1000 / 1536 / 2048 / 4096 tokens  33.8 / 50.4 / 64.7 / 125.9
                                                    -> 40.3 / 42.4 / 61.2 / 120.5
  12288x4096 weight: 1000 / 1536 / 2048 / 4096 tokens  97.3 / 142.1 / 185.8 / 367.6
                                                    -> 99.3 / 121.4 / 166.1 / 329.8

(100 and 256 tokens: 2 faster by 10-17 %). With an fp32 output three warpgroups' tiles leave
room for a 3-deep ring only (``stages``): 2048 / 3072 tokens 68.7 / 102.2 -> 68.5 / 91.6.

The output is the caller's [M, N] (rounded to whole 8 x 64 tiles) and the padded tiles' stores
past it are dropped: slicing a 2112-token output to 2048 had cost a copy of it (public matmul at
2048x4096x4096: 72.1 us with the slice, 63.4 without).

Tokens are the M operand because the promotion's scales then follow the accumulator's rows: a
thread multiplies by 2 token scales a step instead of 32 (with weight rows as M, each thread
held 32 token columns). One H200, kernel alone, two math warpgroups (part 39): 72.7 -> 65.0
us at 2048x4096x4096 (1057 TFLOP/s), 209.1 -> 187.2 at 2048x12288x4096, 278.1 -> 250.2 at
8192x4096x4096, 818.7 -> 739.6 at 8192x12288x4096 (1115 TFLOP/s), results bit-identical.
256-token tiles (128 a warpgroup) ran at half the speed, 5 stages 2-4 % slower, and two K
groups a step with their ``wgmma``s in flight together -2 to +2 %.

The first form (weight rows as M; RESULTS.md, 2026-11-30 part 13; activation quantization
included, one H200): 785-856 TFLOP/s at M = 2048 / 8192 on 4096x4096, 12288x4096 and
4096x12288, against 261-304 for the one-warpgroup kernel and 980-1344 for XLA's unscaled e4m3
dot. Bringing the activation scales
through the TMA ring instead of a global load per K group gave ~20 %.

CTAs run in pairs along N (a 2-CTA cluster where N has an even number of 128-row blocks) that
share the token tile by TMA multicast, in the warp-specialized forms' launch order
(``prefill_ws.tile_of``): at M = 8192 on the three weights above 879-924 -> 930-983 TFLOP/s,
M = 2048 within +-1 % (887-984 TFLOP/s), results bit-identical (H200, RESULTS.md part 33).

GPU only (Mosaic GPU's interpreter does not model warp-specialized pipelines): interpret mode and
decode-shaped calls keep ``kernel.py``'s form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import SMEM_PER_CTA
from pallas_kernels.mxfp8 import wdequant as wd
from pallas_kernels.mxfp8.prefill_ws import RB, tile_of, ws_call

# per CTA: RB = 128 weight rows (one block row) x 64 tokens per math warpgroup (2 or 3 of them)
MAX_STAGES = 4               # 5 measured 2-4 % slower with two warpgroups
THREE_WG_SPEEDUP = 1.14      # the least gain of 3 warpgroups over 2 per token (part 39)


def warpgroups(m: int, n: int) -> int:
    """Math warpgroups of the CTAs for M tokens and N weight rows: the count whose grid takes
    the fewer CTA-times, counted in whole waves of ``NUM_SMS`` CTAs, a 192-token tile taking
    1.5 / ``THREE_WG_SPEEDUP`` as long as a 128-token one."""
    def cost(wgs):
        bm = 64 * wgs
        waves = wd.ceil_div(wd.ceil_div(m, bm) * wd.ceil_div(n, RB), wd.NUM_SMS)
        return waves * (bm / THREE_WG_SPEEDUP if wgs == 3 else bm)
    return 3 if cost(3) < cost(2) else 2


def stages(wgs: int, out_dtype) -> int:
    """Depth of the TMA ring: ``MAX_STAGES``, or as many as fit in shared memory beside the output
    tiles (3 for three warpgroups with an fp32 output)."""
    bm = 64 * wgs
    step = RB * 128 + bm * 128 + bm * 4                        # e4m3 weight and token tiles, fp32 scales
    out = wgs * 64 * RB * jnp.dtype(out_dtype).itemsize
    return min(MAX_STAGES, (SMEM_PER_CTA - out - 1024) // step)   # 1 KiB for the ring's barriers


@functools.partial(jax.jit, static_argnames=("out_dtype", "wgs", "out_mn"))
def prefill_matmul(xq, sxt, w, sw, *, out_dtype, wgs: int, out_mn: tuple[int, int] | None = None):
    """xq [M, K] e4m3 (M a multiple of 64 * wgs), sxt [K/128, M] fp32 (per token and K group),
    w [N, K] e4m3 (N a multiple of 128, K of 128), sw [N/128, K/128] fp32 -> [M, N] out_dtype,
    or the leading [M', N'] = ``out_mn`` of it (the padding's stores dropped); ``wgs`` math
    warpgroups of 64 tokens each per CTA."""
    m, k = xq.shape
    n = w.shape[0]
    bm, h = 64 * wgs, 64                             # tokens of a CTA, of a math warpgroup
    if m % bm or n % RB or k % 128:
        raise ValueError(f"operands not padded for the warp-specialized W8A8 form: M={m} N={n} K={k}")
    f8, f32 = jnp.float8_e4m3fn, jnp.float32
    cluster = 2 if n % (2 * RB) == 0 else 1          # pairs of weight blocks share the token tile

    def kernel(x_gmem, sx_gmem, w_gmem, sw_gmem, o_gmem, o_smem):
        nb, mb, _ = tile_of(n, m, bm, cluster)

        def compute_context(eval_pipeline):
            acc = eval_pipeline(plgpu.layout_cast(jnp.zeros((h, RB), f32), wd.WGMMA))
            wg = lax.axis_index("wg")
            dst = o_smem.at[wg]
            dst[...] = acc.astype(o_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dst, o_gmem.at[pl.ds(mb * bm + wg * h, h), pl.ds(nb * RB, RB)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        def body(idx, w_smem, x_smem, sx_smem, acc):
            (kk,) = idx
            wg = lax.axis_index("wg")
            s = plgpu.load(sx_smem.at[0, pl.ds(wg * h, h)], (), layout=wd.ROW, optimized=False) * sw_gmem[nb, kk]

            def mma(chunk):
                plgpu.wgmma(chunk, x_smem.at[pl.ds(wg * h, h)], w_smem.T)
                plgpu.wgmma_wait(0)
                return chunk[...]

            chunk = pl.run_scoped(mma, plgpu.ACC((h, RB), f32))
            return acc + chunk * lax.broadcast_in_dim(s, (h, RB), [0])

        plgpu.emit_pipeline_warp_specialized(
            body, grid=(k // 128,), memory_registers=40, wg_axis="wg", num_compute_wgs=wgs,
            max_concurrent_steps=stages(wgs, out_dtype), compute_context=compute_context,
            in_specs=[plgpu.BlockSpec((RB, 128), lambda kk: (nb, kk), transforms=wd.smem_tile(f8, 128)),
                      plgpu.BlockSpec((bm, 128), lambda kk: (mb, kk), transforms=wd.smem_tile(f8, 128),
                                      collective_axes=("cl",) if cluster > 1 else ()),
                      plgpu.BlockSpec((1, bm), lambda kk: (kk, mb))])(w_gmem, x_gmem, sx_gmem)

    return ws_call(kernel, m, n, bm, out_dtype, cluster, wg_tile=(h, RB), compute_wgs=wgs,
                   out_mn=out_mn)(xq, sxt, w, sw)
