"""Block-FP8 matmuls on Hopper.

* W8A16 (default): one activation row on a shape the CUDA-core GEMV serves goes there
  (``gemv.py``), 1-16 rows on a shape the `mma.sync` GEMV serves to it (``mma_gemv.py``; one
  row first there where it is faster, `pallas_kernels.mma_gemv.takes_one_row`);
  everything else runs the shared dequantizing engine
  (``pallas_kernels/mxfp8/wdequant.py``; on the GPU, calls of more than 64 rows its
  warp-specialized form ``prefill_ws.py``) with one fp32 scale per min(128, ``tk``)
  columns of a weight tile (each such group lies inside one 128x128 block).
* W8A8 (``act_quant=True``): DeepGEMM's Hopper scheme. Activations are quantized per token
  and 128-wide K group (jnp, before the call); per 128-K step the CTA runs an fp8 ``wgmma``
  (both operands e4m3, K-major in SMEM) into a fresh fp32 accumulator and promotes it,
  ``acc += chunk * sx[token] * sw[block]``, on the CUDA cores. Promoting every 128 K is also
  what keeps Hopper's reduced-precision fp8 accumulation from drifting. Swapped like the
  W8A16 engine (accumulator ``[64 weight rows, bm tokens]``); decode-shaped calls split K.
  Prefill-shaped calls on the GPU use the warp-specialized form of the same scheme
  (``w8a8_ws.py``, tokens as the ``wgmma`` M operand) on activations quantized by a one-pass
  kernel (``act_quant.py``, bit-identical to the jnp quantization).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels import mma_gemv as mma_kernel
from pallas_kernels.mxfp8 import wdequant as wd

from . import gemv, mma_gemv, w8a8_ws
from .act_quant import quantize as quantize_activations_padded
from .reference import DEFAULT_BLOCK, quantize_activations, validate

COL = plgpu.Layout.WGMMA.reduce(0)


def check_block(block):
    """The Pallas kernels' one scale block, 128x128 (ValueError otherwise)."""
    if tuple(block) != (128, 128):
        raise ValueError(f"the Pallas block-FP8 kernels support 128x128 weight blocks, got {tuple(block)}; "
                         "use backend='xla'")


def matmul_kernel(x, w_q, w_scale_inv, *, block=DEFAULT_BLOCK, act_quant=False, out_dtype=None,
                  interpret=False, **plan_overrides):
    """x [..., K] @ dequant(w_q)^T -> [..., N]; plan_overrides: tk, splits, stages, bm (any override
    keeps the call on this module's kernels, also where the warp-specialized forms would run)."""
    validate(x, w_q, w_scale_inv, block)
    check_block(block)
    out_dtype = out_dtype or x.dtype
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    n = w_q.shape[0]
    np_ = wd.round_up(n, wd.BN)
    if act_quant:
        y = _w8a8(x2, w_q, w_scale_inv, np_, out_dtype, interpret, **plan_overrides)
        return y.reshape(*lead, n)
    if not plan_overrides:
        m = x2.shape[0]
        for form in mma_kernel.gemv_order(m, n, k, gemv, mma_gemv):
            if form.supported(m, n, k):
                y = form.gemv(x2.astype(jnp.bfloat16), w_q, w_scale_inv, out_dtype=jnp.dtype(out_dtype),
                              interpret=interpret)
                return y.reshape(*lead, n)
    kp = wd.round_up(k, 32)
    # N % 64 / K % 32 padding copies the weight (no real layer needs it).
    w = wd.pad_cols(wd.pad_rows(w_q, np_), kp)
    y = wd.matmul_padded("fp8_block", wd.pad_cols(x2.astype(jnp.bfloat16), kp), w, (w_scale_inv,), n, out_dtype,
                         interpret, **plan_overrides)
    return y.reshape(*lead, n)


def _w8a8(x2, w_q, w_scale_inv, np_, out_dtype, interpret, **plan_overrides):
    """Prefill-shaped calls (more than 64 tokens) on the GPU without plan overrides quantize
    their activations in one pass (``act_quant``) and take the warp-specialized form
    (``w8a8_ws``, 128- or 192-token tiles as ``w8a8_ws.warpgroups`` picks); the rest quantize
    in jnp and run this module's kernel (same numerics)."""
    m, k = x2.shape
    n = w_q.shape[0]
    kp = wd.round_up(k, 128)
    if plan_overrides.get("tk", 128) != 128:
        raise ValueError(f"the W8A8 kernel steps through K in 128-wide groups, got tk={plan_overrides['tk']}")
    if m > 64 and not interpret and not plan_overrides:
        wgs = w8a8_ws.warpgroups(m, n)
        m_ws, n_ws = wd.round_up(m, 64 * wgs), wd.round_up(n, w8a8_ws.RB)
        xq, sxt = quantize_activations_padded(x2, mp=m_ws)                # [m_ws, Kp] e4m3, [Kb, m_ws]
        # stores past the output's edge are dropped, but its tiled TMA view takes whole 8-row and
        # 64-column tiles: only M not a multiple of 8 (or N of 64) leaves padding to slice off
        y = w8a8_ws.prefill_matmul(xq, sxt, wd.pad_cols(wd.pad_rows(w_q, n_ws), kp), w_scale_inv,
                                   out_dtype=out_dtype, wgs=wgs, out_mn=(wd.round_up(m, 8), wd.round_up(n, 64)))
        return y[:m, :n]
    xq, sx = quantize_activations(x2)                                    # [M, K] e4m3, [M, Kb]
    p = wd.plan(m, np_, kp, "fp8_w8a8", **{k_: v for k_, v in plan_overrides.items() if k_ != "tk"})
    mp = wd.round_up(m, p.bm)
    xq = wd.pad_cols(wd.pad_rows(xq, mp), kp)
    sxt = wd.pad_cols(sx.T, mp)                                          # [Kb, Mp] token-minor
    w = wd.pad_cols(wd.pad_rows(w_q, np_), kp)
    y = w8a8_matmul(xq, sxt, w, w_scale_inv, p=p, out_dtype=out_dtype, interpret=interpret)
    return wd.finish(y, p.splits, m, n, out_dtype)


@functools.partial(jax.jit, static_argnames=("p", "out_dtype", "interpret"))
def w8a8_matmul(xq, sxt, w, sw, *, p: wd.Plan, out_dtype, interpret=False):
    """xq [Mp, K] e4m3, sxt [K/128, Mp] f32, w [Np, K] e4m3, sw [ceil(N/128), K/128] f32."""
    mp, k = xq.shape
    n = w.shape[0]
    bm, tk, splits, stages = p.bm, p.tk, p.splits, p.stages
    bn = wd.BN
    if tk != 128 or n % bn or mp % bm or k % (tk * splits):
        raise ValueError(f"operands not padded for the plan: M={mp} N={n} K={k} plan={p}")
    nk = k // tk // splits
    part_dtype = jnp.float32 if splits > 1 else jnp.dtype(out_dtype)
    f8 = jnp.float8_e4m3fn

    def kernel(x_gmem, sx_gmem, w_gmem, sw_gmem, o_gmem, o_smem):
        nb, mb, ks = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("k")
        k0 = ks * nk

        def body(idx, w_smem, x_smem, acc):
            (kk,) = idx

            def mma(chunk):
                plgpu.wgmma(chunk, w_smem, x_smem.T)
                plgpu.wgmma_wait(0)
                return chunk[...]

            chunk = pl.run_scoped(mma, plgpu.ACC((bn, bm), jnp.float32))          # [64, bm]
            sx = plgpu.load(sx_gmem.at[k0 + kk, pl.ds(mb * bm, bm)], layout=COL, optimized=False)
            s = sx * sw_gmem[(nb * bn) // 128, k0 + kk]
            return acc + chunk * lax.broadcast_in_dim(s, (bn, bm), [1])

        acc0 = plgpu.layout_cast(jnp.zeros((bn, bm), jnp.float32), wd.WGMMA)
        acc = plgpu.emit_pipeline(
            body, grid=(nk,), max_concurrent_steps=stages, init_carry=acc0,
            in_specs=[plgpu.BlockSpec((bn, tk), lambda kk: (nb, k0 + kk), transforms=wd.smem_tile(f8, tk)),
                      plgpu.BlockSpec((bm, tk), lambda kk: (mb, k0 + kk), transforms=wd.smem_tile(f8, tk))],
        )(w_gmem, x_gmem)
        wd.store_tile(acc.astype(part_dtype), o_smem, o_gmem, ks, splits, pl.ds(mb * bm, bm), pl.ds(nb * bn, bn))

    out_shape = (splits, mp, n) if splits > 1 else (mp, n)
    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(out_shape, part_dtype),
        scratch_types=(plgpu.SMEM((bm, bn), part_dtype, transforms=wd.smem_tile(part_dtype, bn)),),
        grid=(n // bn, mp // bm, splits),
        grid_names=("n", "m", "k"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **common.interpret_kwargs(interpret),
    )
    return call(xq, sxt, w, sw)
