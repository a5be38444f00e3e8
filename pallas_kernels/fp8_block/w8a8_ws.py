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

RB = 128                     # weight rows per CTA (one block row): two math warpgroups x 64
BM = 128                     # tokens per CTA; 64 and 192 measured slower (RESULTS.md part 13)
STAGES = 4                   # 3-5 within ~5 % of each other
COL = plgpu.Layout.WGMMA.reduce(0)


def fits(n: int) -> bool:
    """Whether a weight of ``n`` rows (padded) takes this form: whole 128-row blocks per CTA."""
    return n % RB == 0


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def prefill_matmul(xq, sxt, w, sw, *, out_dtype):
    """xq [M, K] e4m3 (M a multiple of 128), sxt [K/128, M] fp32 (per token and K group),
    w [N, K] e4m3 (N a multiple of 128, K of 128), sw [N/128, K/128] fp32 -> [M, N] out_dtype."""
    m, k = xq.shape
    n = w.shape[0]
    if m % BM or not fits(n) or k % 128:
        raise ValueError(f"operands not padded for the warp-specialized W8A8 form: M={m} N={n} K={k}")
    f8, f32 = jnp.float8_e4m3fn, jnp.float32
    out_dtype = jnp.dtype(out_dtype)

    def kernel(x_gmem, sx_gmem, w_gmem, sw_gmem, o_gmem, o_smem):
        nb, mb = lax.axis_index("n"), lax.axis_index("m")

        def compute_context(eval_pipeline):
            wg = lax.axis_index("wg")
            acc = eval_pipeline(plgpu.layout_cast(jnp.zeros((64, BM), f32), wd.WGMMA))
            dst = o_smem.at[wg]
            dst.T[...] = plgpu.layout_cast(acc.astype(out_dtype), plgpu.Layout.WGMMA_TRANSPOSED)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dst, o_gmem.at[pl.ds(mb * BM, BM), pl.ds(nb * RB + wg * 64, 64)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

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
                      plgpu.BlockSpec((BM, 128), lambda kk: (mb, kk), transforms=wd.smem_tile(f8, 128)),
                      plgpu.BlockSpec((1, BM), lambda kk: (kk, mb))])(w_gmem, x_gmem, sx_gmem)

    call = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        scratch_types=(plgpu.SMEM((2, BM, 64), out_dtype, transforms=wd.smem_tile(out_dtype, 64)),),
        grid=(n // RB, m // BM), grid_names=("n", "m"), num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True))
    return call(xq, sxt, w, sw)
