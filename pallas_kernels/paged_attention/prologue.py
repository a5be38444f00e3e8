"""Decode-attention prologue for GQA layers with per-head q/k RMSNorm and RoPE (Qwen3): one
Mosaic GPU kernel in place of XLA's q/k norms, rotations, q scaling and padding and the two
K/V page writes of a decode step.

    qs, k_pages, v_pages = decode_prologue(qkv, q_norm_w, k_norm_w, cos, sin, page, slot,
                                           k_pages, v_pages, *, num_q_heads, num_kv_heads,
                                           eps, scale, group_p)

  qkv       [B, (Hq + 2 Hkv) D] bf16   the fused q/k/v projection of one token per sequence
  q_norm_w, k_norm_w [D] bf16          the RMSNorm weights
  cos, sin  [B, D/2] f32               RoPE of each sequence's position (pair i, i + D/2)
  page, slot [B] int32                 where the token's K/V go (page 0: padded rows)
  k_pages, v_pages [P, page_size, Hkv, D] bf16, updated in place
  returns qs [B, Hkv, group_p, D] bf16: q * scale grouped by kv head, rows past the group
          zero (the paged decode kernel's query operand), and the pages

One CTA per (sequence, kv head), thread d owns element d of every head (D = 128): a head's
sum of squares is a warp reduction plus one exchange through shared memory, RoPE's partner
element d ^ D/2 comes through shared memory. Numerics follow the model's XLA ops: RMSNorm in
fp32 rounded to bf16, RoPE in fp32 rounded to bf16, q * scale in fp32 rounded to bf16; the
square sums run in another order and rsqrt is `rsqrt.approx.f32`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, memref
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import cst, hand_synced, interpret_kwargs, ix

HEAD_DIM = 128          # one element per thread of the warpgroup


def supported(head_dim: int, pool_dtype, group_p: int, group: int) -> bool:
    return head_dim == HEAD_DIM and jnp.dtype(pool_dtype) == jnp.dtype(jnp.bfloat16) and group <= group_p


def decode_prologue_reference(qkv, q_norm_w, k_norm_w, cos, sin, page, slot, k_pages, v_pages, *,
                              num_q_heads, num_kv_heads, eps, scale, group_p):
    """The same contract in jnp (the model's ops, for tests)."""
    b, d = qkv.shape[0], k_pages.shape[-1]
    heads = qkv.reshape(b, num_q_heads + 2 * num_kv_heads, d)

    def norm_rope(x, w):
        xf = x.astype(jnp.float32)
        y = (xf * lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps) * w.astype(jnp.float32))
        yf = y.astype(jnp.bfloat16).astype(jnp.float32)
        c, s = cos[:, None, :], sin[:, None, :]
        x1, x2 = yf[..., : d // 2], yf[..., d // 2:]
        return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1).astype(jnp.bfloat16)

    q = norm_rope(heads[:, :num_q_heads], q_norm_w)
    k = norm_rope(heads[:, num_q_heads:num_q_heads + num_kv_heads], k_norm_w)
    v = heads[:, num_q_heads + num_kv_heads:]
    g = num_q_heads // num_kv_heads
    qs = (q.astype(jnp.float32) * scale).astype(jnp.bfloat16).reshape(b, num_kv_heads, g, d)
    qs = jnp.pad(qs, ((0, 0), (0, 0), (0, group_p - g), (0, 0)))
    return qs, k_pages.at[page, slot].set(k), v_pages.at[page, slot].set(v)


def _normalize_rotate(in_ref, w_ref, cs_ref, tmp_ref, red_ref, oq_ref, ok_ref, *, group, eps, scale,
                      interpret):
    """in_ref [G + 2, D] bf16 (q heads, k, v) -> oq_ref [Gp, D] (q normalised, rotated and scaled,
    zero rows past G), ok_ref [D] (k normalised and rotated); w_ref [2, D] bf16 (q, k norm
    weights), cs_ref [2, D/2] f32 (cos, sin); tmp_ref [G + 1, D] f32, red_ref [G + 1, 4] f32
    scratch."""
    rows, d = group + 1, HEAD_DIM
    if interpret:
        xf = in_ref[pl.ds(0, rows)].astype(jnp.float32)
        w = jnp.concatenate([jnp.broadcast_to(w_ref[0], (group, d)), w_ref[1][None]]).astype(jnp.float32)
        y = xf * lax.rsqrt(jnp.sum(xf * xf, -1, keepdims=True) * (1.0 / d) + eps) * w
        yf = y.astype(jnp.bfloat16).astype(jnp.float32)
        c, s = cs_ref[0][None], cs_ref[1][None]
        x1, x2 = yf[:, : d // 2], yf[:, d // 2:]
        o = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1).astype(jnp.bfloat16)
        oq_ref[...] = jnp.zeros(oq_ref.shape, jnp.bfloat16)
        oq_ref[pl.ds(0, group)] = (o[:group].astype(jnp.float32) * scale).astype(jnp.bfloat16)
        ok_ref[...] = o[group]
        return

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 7)
    def compute(_, in_smem, w_smem, cs_smem, tmp_smem, red_smem, oq_smem, ok_smem):
        f32, index = ir.F32Type.get(), ir.IndexType.get()
        bf16 = ir.BF16Type.get()
        fc = lambda v: mgpu_utils.c(v, f32)
        t = mgpu_utils.thread_idx()
        warp, lane = arith.shrui(t, cst(5)), arith.andi(t, cst(31))
        col = ix(t)
        xs = [arith.extf(f32, memref.load(in_smem, [cst(r, index), col])) for r in range(rows)]
        for r, x in enumerate(xs):
            ss = arith.mulf(x, x)
            for dist in (16, 8, 4, 2, 1):
                ss = arith.addf(ss, mgpu_utils.shfl_bfly(ss, dist))
            with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.eq, lane, cst(0))):
                memref.store(ss, red_smem, [cst(r, index), ix(warp)])
        mgpu_utils.warpgroup_barrier()
        wq = arith.extf(f32, memref.load(w_smem, [cst(0, index), col]))
        wk = arith.extf(f32, memref.load(w_smem, [cst(1, index), col]))
        ys = []
        for r, x in enumerate(xs):
            total = memref.load(red_smem, [cst(r, index), cst(0, index)])
            for w in range(1, 4):
                total = arith.addf(total, memref.load(red_smem, [cst(r, index), cst(w, index)]))
            rr = llvm.inline_asm(f32, [arith.addf(arith.mulf(total, fc(1.0 / d)), fc(eps))],
                                 "rsqrt.approx.f32 $0, $1;", "=f,f")
            y = arith.mulf(arith.mulf(x, rr), wq if r < group else wk)
            y = arith.extf(f32, arith.truncf(bf16, y))
            memref.store(y, tmp_smem, [cst(r, index), col])
            ys.append(y)
        mgpu_utils.warpgroup_barrier()
        low = arith.cmpi(arith.CmpIPredicate.ult, t, cst(d // 2))
        half = ix(arith.andi(t, cst(d // 2 - 1)))
        c = memref.load(cs_smem, [cst(0, index), half])
        s = memref.load(cs_smem, [cst(1, index), half])
        partner_col = ix(arith.xori(t, cst(d // 2)))
        for r, y in enumerate(ys):
            p = memref.load(tmp_smem, [cst(r, index), partner_col])
            # first half: y c - p s; second half: y c + p s (p is the other half's element)
            o = arith.select(low, arith.subf(arith.mulf(y, c), arith.mulf(p, s)),
                             arith.addf(arith.mulf(y, c), arith.mulf(p, s)))
            ob = arith.truncf(bf16, o)
            if r < group:
                memref.store(arith.truncf(bf16, arith.mulf(arith.extf(f32, ob), fc(scale))), oq_smem,
                             [cst(r, index), col])
            else:
                memref.store(ob, ok_smem, [col])
        zero = arith.truncf(bf16, fc(0.0))
        for r in range(group, ir.MemRefType(oq_smem.type).shape[0]):
            memref.store(zero, oq_smem, [cst(r, index), col])

    compute(in_ref, w_ref, cs_ref, tmp_ref, red_ref, oq_ref, ok_ref)


@functools.partial(jax.jit, static_argnames=("num_q_heads", "num_kv_heads", "eps", "scale", "group_p",
                                             "interpret"))
def decode_prologue(qkv, q_norm_w, k_norm_w, cos, sin, page, slot, k_pages, v_pages, *, num_q_heads,
                    num_kv_heads, eps, scale, group_p, interpret=False):
    """See the module docstring."""
    b, d = qkv.shape[0], k_pages.shape[-1]
    group = num_q_heads // num_kv_heads
    if not supported(d, k_pages.dtype, group_p, group) or qkv.shape[1] != (num_q_heads + 2 * num_kv_heads) * d:
        raise ValueError(f"the decode prologue takes D = {HEAD_DIM}, bf16 pages and qkv of (Hq + 2 Hkv) D "
                         f"columns; got D={d}, pages {k_pages.dtype}, qkv {qkv.shape}")
    heads = qkv.astype(jnp.bfloat16).reshape(b, num_q_heads + 2 * num_kv_heads, d)
    weights = [w.astype(jnp.bfloat16).reshape(1, d) for w in (q_norm_w, k_norm_w)]
    rope = [a.astype(jnp.float32) for a in (cos, sin)]

    def kernel(h_ref, qw_ref, kw_ref, cos_ref, sin_ref, page_ref, slot_ref, kp_ref, vp_ref, qs_ref,
               in_smem, w_smem, cs_smem, tmp_smem, red_smem, oq_smem, ok_smem, bar):
        bi, h = lax.axis_index("b"), lax.axis_index("h")
        plgpu.copy_gmem_to_smem(h_ref.at[bi, pl.ds(h * group, group)], in_smem.at[pl.ds(0, group)], bar.at[0])
        plgpu.copy_gmem_to_smem(h_ref.at[bi, pl.ds(num_q_heads + h, 1)], in_smem.at[pl.ds(group, 1)], bar.at[0])
        plgpu.copy_gmem_to_smem(h_ref.at[bi, pl.ds(num_q_heads + num_kv_heads + h, 1)],
                                in_smem.at[pl.ds(group + 1, 1)], bar.at[0])
        for i, src in enumerate((qw_ref, kw_ref)):
            plgpu.copy_gmem_to_smem(src, w_smem.at[pl.ds(i, 1)], bar.at[0])
        for i, src in enumerate((cos_ref, sin_ref)):
            plgpu.copy_gmem_to_smem(src.at[pl.ds(bi, 1)], cs_smem.at[pl.ds(i, 1)], bar.at[0])
        pg, sl = page_ref[bi], slot_ref[bi]            # their latency hides behind the copies
        plgpu.barrier_wait(bar.at[0])
        _normalize_rotate(in_smem, w_smem, cs_smem, tmp_smem, red_smem, oq_smem, ok_smem, group=group,
                          eps=eps, scale=scale, interpret=interpret)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(oq_smem, qs_ref.at[bi, h])
        plgpu.copy_smem_to_gmem(ok_smem, kp_ref.at[pg, sl, h])
        plgpu.copy_smem_to_gmem(in_smem.at[group + 1], vp_ref.at[pg, sl, h])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)     # the writes complete by the kernel's end

    call = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((b, num_kv_heads, group_p, d), jnp.bfloat16),
        scratch_types=[plgpu.SMEM((group + 2, d), jnp.bfloat16),
                       plgpu.SMEM((2, d), jnp.bfloat16),
                       plgpu.SMEM((2, d // 2), jnp.float32),
                       plgpu.SMEM((group + 1, d), jnp.float32),
                       plgpu.SMEM((group + 1, 4), jnp.float32),
                       plgpu.SMEM((group_p, d), jnp.bfloat16),
                       plgpu.SMEM((d,), jnp.bfloat16),
                       plgpu.Barrier(num_arrivals=7, num_barriers=1)],
        grid=(b, num_kv_heads), grid_names=("b", "h"),
        compiler_params=hand_synced(approx_math=False),
        **interpret_kwargs(interpret))
    k_ref, v_ref = jax.new_ref(k_pages), jax.new_ref(v_pages)
    qs = call(heads, *weights, *rope, page.astype(jnp.int32), slot.astype(jnp.int32), k_ref, v_ref)
    return qs, k_ref[...], v_ref[...]
