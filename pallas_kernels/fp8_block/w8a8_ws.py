"""Warp-specialized prefill form of the block-FP8 W8A8 matmul (DeepGEMM's Hopper scheme with two
math warpgroups): one CTA computes a 128-weight-row x ``bm``-token output tile with three
warpgroups. One issues TMA loads of the [128, 128] e4m3 weight tile, the [bm, 128] e4m3
activation tile and the tokens' [bm] fp32 activation scales through a ``stages``-deep ring; each
of the other two runs an fp8 ``wgmma`` of its 64 weight rows into a fresh fp32 accumulator per
128-wide K group and promotes it, ``acc += chunk * sx[token] * sw[block]``, while the other
warpgroup's ``wgmma`` occupies the tensor cores. Same numerics as the one-warpgroup kernel in
``kernel.py`` (same products, same promotion order): the two agree bit for bit.

One H200 (RESULTS.md, 2026-11-30 part 13; activation quantization included): 785-856 TFLOP/s
at M = 2048 / 8192 on 4096x4096, 12288x4096 and 4096x12288, against 261-304 for the
one-warpgroup kernel and 980-1344 for XLA's unscaled e4m3 dot. Bringing the activation scales
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

from pallas_kernels.mxfp8 import wdequant as wd
from pallas_kernels.mxfp8.prefill_ws import RB, store_wg_tile, tile_of, ws_call

# per CTA: RB = 128 weight rows (one block row, two math warpgroups x 64) x BM tokens
BM = 128                     # tokens per CTA; 64 and 192 measured slower (RESULTS.md part 13)
STAGES = 4                   # 3-5 within ~5 % of each other
COL = plgpu.Layout.WGMMA.reduce(0)


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def prefill_matmul(xq, sxt, w, sw, *, out_dtype):
    """xq [M, K] e4m3 (M a multiple of 128), sxt [K/128, M] fp32 (per token and K group),
    w [N, K] e4m3 (N a multiple of 128, K of 128), sw [N/128, K/128] fp32 -> [M, N] out_dtype."""
    m, k = xq.shape
    n = w.shape[0]
    if m % BM or n % RB or k % 128:
        raise ValueError(f"operands not padded for the warp-specialized W8A8 form: M={m} N={n} K={k}")
    f8, f32 = jnp.float8_e4m3fn, jnp.float32
    cluster = 2 if n % (2 * RB) == 0 else 1          # pairs of weight blocks share the token tile

    def kernel(x_gmem, sx_gmem, w_gmem, sw_gmem, o_gmem, o_smem):
        nb, mb, _ = tile_of(n, m, BM, cluster)

        def compute_context(eval_pipeline):
            acc = eval_pipeline(plgpu.layout_cast(jnp.zeros((64, BM), f32), wd.WGMMA))
            store_wg_tile(acc, o_smem, o_gmem, BM, nb, mb)

        def body(idx, w_smem, x_smem, sx_smem, acc):
            (kk,) = idx
            wg = lax.axis_index("wg")
            s = plgpu.load(sx_smem.at[0], layout=COL, optimized=False) * sw_gmem[nb, kk]

            def mma(chunk):
                plgpu.wgmma(chunk, w_smem.at[pl.ds(wg * 64, 64)], x_smem.T)
                plgpu.wgmma_wait(0)
                return chunk[...]

            chunk = pl.run_scoped(mma, plgpu.ACC((64, BM), f32))
            return acc + chunk * lax.broadcast_in_dim(s, (64, BM), [1])

        plgpu.emit_pipeline_warp_specialized(
            body, grid=(k // 128,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=STAGES, compute_context=compute_context,
            in_specs=[plgpu.BlockSpec((RB, 128), lambda kk: (nb, kk), transforms=wd.smem_tile(f8, 128)),
                      plgpu.BlockSpec((BM, 128), lambda kk: (mb, kk), transforms=wd.smem_tile(f8, 128),
                                      collective_axes=("cl",) if cluster > 1 else ()),
                      plgpu.BlockSpec((1, BM), lambda kk: (kk, mb))])(w_gmem, x_gmem, sx_gmem)

    return ws_call(kernel, m, n, BM, out_dtype, cluster)(xq, sxt, w, sw)
