"""Warp-specialized prefill form of the block-FP8 W8A8 matmul (DeepGEMM's Hopper scheme with two
math warpgroups): one CTA computes a 128-token x 128-weight-row output tile with three
warpgroups. One issues TMA loads of the [128, 128] e4m3 weight tile, the [128, 128] e4m3
activation tile and the tokens' [128] fp32 activation scales through a 4-deep ring; each of the
other two runs an fp8 ``wgmma`` of its 64 tokens (the M operand) against the 128 weight rows
(N) into a fresh fp32 accumulator per 128-wide K group and promotes it, ``acc += chunk *
sx[token] * sw[block]``, while the other warpgroup's ``wgmma`` occupies the tensor cores. Same
numerics as the one-warpgroup kernel in ``kernel.py`` (same products, same promotion order): the
two agree bit for bit.

Tokens are the M operand because the promotion's scales then follow the accumulator's rows: a
thread multiplies by 2 token scales a step instead of 32 (with weight rows as M, each thread
held 32 token columns). One H200, kernel alone, same process (RESULTS.md part 39): 72.7 -> 65.0
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

from pallas_kernels.mxfp8 import wdequant as wd
from pallas_kernels.mxfp8.prefill_ws import RB, tile_of, ws_call

# per CTA: RB = 128 weight rows (one block row) x BM tokens (two math warpgroups x 64)
BM = 128                     # tokens per CTA; 256 measured at half the speed (RESULTS.md part 39)
STAGES = 4                   # 5 measured 2-4 % slower; 6 does not fit in shared memory


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
    h = BM // 2                                      # tokens of a compute warpgroup

    def kernel(x_gmem, sx_gmem, w_gmem, sw_gmem, o_gmem, o_smem):
        nb, mb, _ = tile_of(n, m, BM, cluster)

        def compute_context(eval_pipeline):
            acc = eval_pipeline(plgpu.layout_cast(jnp.zeros((h, RB), f32), wd.WGMMA))
            wg = lax.axis_index("wg")
            dst = o_smem.at[wg]
            dst[...] = acc.astype(o_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dst, o_gmem.at[pl.ds(mb * BM + wg * h, h), pl.ds(nb * RB, RB)])
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
            body, grid=(k // 128,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=STAGES, compute_context=compute_context,
            in_specs=[plgpu.BlockSpec((RB, 128), lambda kk: (nb, kk), transforms=wd.smem_tile(f8, 128)),
                      plgpu.BlockSpec((BM, 128), lambda kk: (mb, kk), transforms=wd.smem_tile(f8, 128),
                                      collective_axes=("cl",) if cluster > 1 else ()),
                      plgpu.BlockSpec((1, BM), lambda kk: (kk, mb))])(w_gmem, x_gmem, sx_gmem)

    return ws_call(kernel, m, n, BM, out_dtype, cluster, wg_tile=(h, RB))(xq, sxt, w, sw)
