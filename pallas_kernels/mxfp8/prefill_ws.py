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
tile by TMA multicast (as the W8A8 form does) gained 0-3 % for block FP8 and nothing with the
launch order; for MXFP8 they gave wrong results (the deferred ``wgmma`` wait below with the
cluster-wide release of the slots), so neither takes them.

With a pipeline of three or more stages, an MXFP8 step (two or more ``wgmma`` groups) waits
for all but its last group, which keeps the tensor cores busy while the next tile is dequantized
(its pipeline slots are released one step late): +5-10 % at M = 2048 / 8192 on 4096-12288-row
weights and +1-7 % on the smaller grids this form takes (2560x1280 at M = 2048, 4096x4096 at
M = 1024), results bit-identical over six inputs each (H200, RESULTS.md parts 14 and 15).
Block FP8 keeps the full wait: its step is one group, and deferring that wait returned inf on
the H200; its 2-stage pipeline would also lose a stage.

GPU only: Mosaic GPU's interpreter models neither warp-specialized pipelines nor register
operands, so interpret mode keeps ``wdequant``'s one-warpgroup form (same numerics).
"""

from __future__ import annotations

import functools

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
# (tk, stages) in order of preference per format (the first that fits SMEM_PER_CTA with the output
# tile): one H200 at M = 2048 / 8192, bm = 256: MXFP8 best at tk 64 with 3-4 stages, block FP8
# (one scale per 128 columns) at tk 128 with 2 stages (RESULTS.md part 12).
STEPS = {"mxfp8": ((64, 4), (64, 3), (64, 2)), "fp8_block": ((128, 2), (64, 4), (64, 3), (64, 2)),
         "nvfp4": ((128, 2),)}


def smem_bytes(fmt: str, bm: int, tk: int, stages: int, out_bytes: int) -> int:
    """Shared memory of one CTA: the pipelined weight, activation (and MXFP8 / NVFP4 scale) tiles
    and the two warpgroups' output tiles."""
    scales = 2 * 64 * tk // wd.SCALE_BLOCK[fmt] if fmt in wd.SCALE_BLOCK else 0
    w_bytes = RB * tk // (2 if fmt == "nvfp4" else 1)
    return stages * (w_bytes + bm * tk * 2 + scales) + 2 * bm * 64 * out_bytes


def config(fmt: str, m: int, n: int, k: int, out_dtype) -> tuple[int, int, int] | None:
    """(bm, tk, stages) for an [m, k] x [n, k]^T product (n, k padded like ``wdequant``'s
    operands), or None when the shapes do not fit this form (N not a multiple of 128, K of no
    K step, an output tile too large)."""
    if fmt not in FORMATS or n % RB:
        return None
    bm = 128 if m <= 128 else 256
    out_bytes = jnp.dtype(out_dtype).itemsize
    for tk, stages in STEPS[fmt]:
        if k % tk == 0 and smem_bytes(fmt, bm, tk, stages, out_bytes) <= SMEM_PER_CTA:
            return bm, tk, stages
    return None


def launch_order(t, n_units: int, m_blocks: int, group: int):
    """(weight unit, token tile) of the t-th CTA (cluster) launched: ``group`` token tiles for
    each weight unit, then the next unit; after the last unit the next group of token tiles (the
    last group may be shorter). A bijection of [0, n_units * m_blocks) (works on ints and traced
    values alike)."""
    first = t // (group * n_units) * group
    size = jnp.minimum(m_blocks - first, group)
    r = t % (group * n_units)
    return r // size, first + r % size


def tile_of(n: int, m: int, bm: int, cluster: int):
    """(weight block, token tile) of this CTA: `launch_order` over groups of ``GROUP_TOKENS``
    tokens, so that the CTAs resident at once share their token and weight tiles (L2 reuse); a
    2-CTA cluster's unit is a pair of adjacent weight blocks, one a member."""
    unit, mb = launch_order(lax.axis_index("t"), n // RB // cluster, m // bm, max(1, GROUP_TOKENS // bm))
    return (unit if cluster == 1 else unit * cluster + lax.axis_index("cl")), mb


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


def ws_call(kernel, m: int, n: int, bm: int, out_dtype, cluster: int = 1):
    """The launch shared by the warp-specialized forms: one CTA per output tile of 128 weight
    rows x bm tokens, in clusters of ``cluster`` CTAs "cl" along N, in `tile_of`'s order (grid
    "t"), three warpgroups "wg" (two compute, one TMA), an [M, N] output and the compute
    warpgroups' [2, bm, 64] output tile as scratch."""
    out_dtype = jnp.dtype(out_dtype)
    clusters = dict(cluster=(cluster,), cluster_names=("cl",)) if cluster > 1 else {}
    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        scratch_types=(plgpu.SMEM((2, bm, 64), out_dtype, transforms=wd.smem_tile(out_dtype, 64)),),
        grid=(n // RB // cluster * (m // bm),), grid_names=("t",), num_threads=3, thread_name="wg", **clusters,
        compiler_params=plgpu.CompilerParams(approx_math=True))


@functools.partial(jax.jit, static_argnames=("fmt", "bm", "tk", "stages", "out_dtype"))
def prefill_matmul(x, w, scales, *, fmt: str, bm: int, tk: int, stages: int, out_dtype):
    """x [M, K] bf16 (M a multiple of bm), w [N, K] e4m3 or [N, K/2] NVFP4 codes (N a multiple
    of 128), scales: mxfp8 ([K/32, N] uint8 transposed E8M0,), fp8_block ([N/128, K/128] fp32,),
    nvfp4 ([K/16, N] e4m3 transposed, weight_scale_2 f32 [1]) -> [M, N] out_dtype. NVFP4 takes x
    in the engine's K order (``fp4.order_x``) and its codes as whole words (``fp4.engine_fragments``)."""
    m, k = x.shape
    n = w.shape[0]
    bf16 = jnp.bfloat16
    w_cols = tk // (2 if fmt == "nvfp4" else 1)     # weight tile bytes a row and step
    w_tr = wd.smem_tile(w.dtype, w_cols)
    cw = min(128, tk)                        # stored columns per register load = the swizzle
    delay = int(fmt == "mxfp8" and stages >= 3)        # wgmma groups left running at a step's end
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
        nb, mb = tile_of(n, m, bm, 1)

        def compute_context(eval_pipeline):
            @functools.partial(pl.run_scoped, acc=plgpu.ACC((64, bm), jnp.float32))
            def _(acc):
                factor = s2_gmem[0][0] * fp4.FACTOR if s2_gmem else None    # read before the pipeline
                eval_pipeline(acc)
                plgpu.wgmma_wait(0)
                out = acc[...] if factor is None else acc[...] * factor
                store_wg_tile(out, o_smem, o_gmem, bm, nb, mb)

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
                sc = [s_gmem[nb, (kk * tk + gw * j) // 128] for j in range(tk // gw)]
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

        in_specs = [plgpu.BlockSpec((RB, w_cols), lambda kk: (nb, kk), transforms=w_tr, delay_release=delay),
                    plgpu.BlockSpec((bm, tk), lambda kk: (mb, kk), transforms=x_tr, delay_release=delay)]
        srcs = [w_gmem, x_gmem]
        if fmt in wd.SCALE_BLOCK:
            in_specs.append(plgpu.BlockSpec((tk // wd.SCALE_BLOCK[fmt], 2, 64), lambda kk: (kk, nb, 0),
                                            delay_release=delay))
            srcs.append(s_gmem)
        plgpu.emit_pipeline_warp_specialized(
            body, grid=(k // tk,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=stages, compute_context=compute_context, in_specs=in_specs)(*srcs)

    return ws_call(kernel, m, n, bm, out_dtype)(x, w, scale, *s2)
