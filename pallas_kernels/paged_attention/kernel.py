"""Mosaic GPU (Hopper) paged decode attention kernel.

One CTA (one warpgroup, 128 threads) per (kv head, context split, sequence). It
streams the sequence's K/V pages HBM -> SMEM with TMA through the page table,
`num_stages` blocks of `block_tokens` tokens in flight, and runs an fp32 online
softmax. The GQA group of query heads sharing a kv head is processed together,
so each K/V byte is read from HBM once.

The tensor-core products are "swapped" so that the small query group sits in the
N dimension of wgmma instead of being padded to M = 64:

  S^T [T, Gp] = K_blk [T, D] @ Q^T [D, Gp]        (A = K tile in SMEM, B = Q^T)
  O^T [D, Gp] += V_blk^T [D, T] @ P^T [T, Gp]     (A = V^T view of the V tile, B = P^T)

with T = block_tokens (64 or 128), Gp = query group padded to 16, 32 or 64. The
softmax reduces over axis 0 (tokens). A block is one or more whole pages
(page_size <= T, one TMA copy per page) or a slice of a page (page_size > T).
Split s of S takes the blocks s, s + S, s + 2S, ..., so its first block is known
before the sequence length is read. Each split writes its normalised O^T and
base-2 log-sum-exp; with 2..MAX_CLUSTER splits they run as one thread-block
cluster whose first CTA combines them (log-sum-exp weights) into [B, Hq, D],
otherwise (and in interpret mode) the wrapper does. `plan` picks block size,
pipeline depth and splits (small batch: context splits so that ~2 CTAs per SM
are busy; large batch: one CTA per SM with 128-token blocks).

Numerics: q is multiplied by scale * k_scale in fp32 and rounded to bf16; K/V
tiles are bf16 (bf16 pools are used as stored; f32 and float8_e4m3fn pools are
converted to bf16 in SMEM, fp8 exactly via f16); products accumulate in fp32;
the softmax is fp32. Expect bf16-level agreement (~3e-3 relative) with the fp32
reference.

Supported (ValueError otherwise): page_size in {8, 16, 32, 64, 128, 256};
head_dim in {64, 128, 256}; Hq // Hkv <= 64; pool dtype bf16, f32 or
float8_e4m3fn; q bf16 or f32. Positions >= kv_len get zero weight, and the V
rows of the last partial block are zeroed in SMEM before P @ V, so garbage (even
NaN) in unused pool slots never reaches the output; rows with kv_len == 0 are 0.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, memref
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import gpu_fence, interpret_kwargs, num_sms

from .reference import validate_inputs

LOG2E = 1.4426950408889634

SUPPORTED_PAGE_SIZES = (8, 16, 32, 64, 128, 256)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_POOL_DTYPES = (jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn)
MAX_GROUP = 64
# A sequence's context splits run as one thread-block cluster (at most 8 CTAs, the portable
# cluster size) and merge inside the kernel.
MAX_CLUSTER = 8
# Shared memory per CTA: the "small batch" plan keeps two CTAs per SM (228 KiB
# per SM, 1 KiB reserved per CTA); the "large batch" plan one CTA per SM
# (227 KiB max per CTA, less Mosaic's own scratch and barriers).
_SMEM_TWO_PER_SM = 113 * 1024
_SMEM_ONE_PER_SM = 220 * 1024
# K+V bytes buffered per CTA in the one-CTA-per-SM plan (measured setting).
_ONE_PER_SM_IN_FLIGHT = 128 * 1024
# SMEM reserved for cross-warp reductions (softmax max/sum over tokens).
_REDUCTION_SCRATCH = 4096


def _padded_group(group: int) -> int:
  for gp in (16, 32, 64):
    if group <= gp:
      return gp
  raise ValueError(f"query heads per kv head must be <= {MAX_GROUP}, got {group}")


def _swizzled(dtype, minor_dim: int) -> tuple:
  """Tiling + swizzle transforms for an SMEM tile whose minor dim is `minor_dim`.

  128-byte swizzle when a row holds at least 128 bytes (every wgmma operand
  here: bf16 rows of >= 64 elements), else the row size (fp8 staging, D = 64).
  """
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = min(128, minor_dim * itemsize)
  return (plgpu.TilingTransform((8, swizzle // itemsize)),
          plgpu.SwizzleTransform(swizzle))


def _to_bf16(x):
  """Converts a pool tile to bf16 in registers. float8_e4m3fn goes through f16
  (Hopper has no direct e4m3 -> bf16 conversion); both steps are exact."""
  if x.dtype == jnp.dtype(jnp.float8_e4m3fn):
    x = x.astype(jnp.float16)
  return x.astype(jnp.bfloat16)


def check_kernel_support(q, k_pages):
  """Raises ValueError if the Pallas kernel does not support these shapes/dtypes."""
  _, hq, d = q.shape
  _, page_size, hkv, _ = k_pages.shape
  if page_size not in SUPPORTED_PAGE_SIZES:
    raise ValueError(
        f"the Pallas paged attention kernel supports page_size in {SUPPORTED_PAGE_SIZES},"
        f" got {page_size}; use backend='xla' for other sizes")
  if d not in SUPPORTED_HEAD_DIMS:
    raise ValueError(
        f"the Pallas paged attention kernel supports head_dim in {SUPPORTED_HEAD_DIMS},"
        f" got {d}; use backend='xla'")
  if hq // hkv > MAX_GROUP:
    raise ValueError(
        f"the Pallas paged attention kernel supports Hq // Hkv <= {MAX_GROUP},"
        f" got {hq // hkv}; use backend='xla'")
  if not any(k_pages.dtype == jnp.dtype(t) for t in SUPPORTED_POOL_DTYPES):
    raise ValueError(
        f"pool dtype must be bf16, f32 or float8_e4m3fn, got {k_pages.dtype}")
  if q.dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
    raise ValueError(f"q must be bf16 or f32, got {q.dtype}")


def _smem_bytes(block_tokens, stages, head_dim, pool_dtype, group_p) -> int:
  """SMEM a CTA needs: `stages` K+V blocks in the pool dtype, q, P^T, reduction
  scratch, and the bf16 conversion buffers for non-bf16 pools."""
  stage = 2 * block_tokens * head_dim * jnp.dtype(pool_dtype).itemsize
  fixed = group_p * head_dim * 2 + group_p * block_tokens * 2 + _REDUCTION_SCRATCH
  if jnp.dtype(pool_dtype) != jnp.dtype(jnp.bfloat16):
    fixed += 2 * block_tokens * head_dim * 2      # bf16 conversion buffers
  return stages * stage + fixed


def plan(batch, num_kv_heads, max_pages, page_size, head_dim, pool_dtype,
         group_p, *, num_splits=None, num_stages=None, block_tokens=None):
  """Static launch plan: (block_tokens, num_stages, num_splits).

  Large batch (batch * Hkv >= #SMs), bf16 pool: no context split, one CTA per
  SM with 128-token blocks and 128 KiB of K+V buffered (2 stages at D=128):
  in a first H200 run at batch 64 x 4K this beat 64-token blocks with 3 stages
  and 2 CTAs per SM (3.77 vs 3.45 TB/s, differential timing). Otherwise: 64-token blocks, as many
  stages (2..4) as keep two CTAs per SM; at small batch each sequence is split
  into floor(2 * #SMs / (batch * Hkv)) pieces (combined by log-sum-exp).
  Explicit arguments override the plan.
  """
  sms = num_sms()
  large = batch * num_kv_heads >= sms
  # One CTA per SM with big blocks only pays for bf16 pools; converting pools
  # (fp8, f32) need the compute of two warpgroups per SM.
  one_per_sm = large and jnp.dtype(pool_dtype) == jnp.dtype(jnp.bfloat16)
  budget = _SMEM_ONE_PER_SM if one_per_sm else _SMEM_TWO_PER_SM
  if block_tokens is None:
    block_tokens = 64
    if (one_per_sm and _smem_bytes(128, 2, head_dim, pool_dtype, group_p) <= budget
        and (128 % page_size == 0 or page_size % 128 == 0)):
      block_tokens = 128
  tb = block_tokens
  if tb % 64 or tb > 256 or (tb % page_size and page_size % tb):
    raise ValueError(
        f"block_tokens={tb} must be a multiple of 64 (at most 256) that divides"
        f" or is a multiple of page_size={page_size}")
  if num_stages is None:
    stage = 2 * tb * head_dim * jnp.dtype(pool_dtype).itemsize
    num_stages = 2
    while (num_stages < 4
           and _smem_bytes(tb, num_stages + 1, head_dim, pool_dtype, group_p) <= budget
           and (not one_per_sm or (num_stages + 1) * stage <= _ONE_PER_SM_IN_FLIGHT)):
      num_stages += 1
  if num_splits is None:
    if large:
      num_splits = 1
    else:
      max_blocks = max(1, -(-(max_pages * page_size) // tb))
      num_splits = max(1, min((2 * sms) // (batch * num_kv_heads), max_blocks, MAX_CLUSTER))
  if _smem_bytes(tb, num_stages, head_dim, pool_dtype, group_p) > _SMEM_ONE_PER_SM:
    raise ValueError(
        f"block_tokens={tb} x num_stages={num_stages} needs more shared memory than"
        " a CTA has; lower one of them")
  return int(tb), int(num_stages), int(num_splits)


def paged_decode_attention_kernel(
    q, k_pages, v_pages, page_table, kv_lens, *, scale=None, k_scale=1.0,
    v_scale=1.0, interpret=False, num_splits=None, num_stages=None,
    block_tokens=None):
  """Pallas Mosaic GPU paged decode attention (see module docstring).

  interpret: False (compile for the GPU), True (Mosaic GPU interpret mode with
  default InterpretGPUParams) or an InterpretGPUParams.
  Extra tuning knobs (static, default from `plan`): num_splits (context splits
  per sequence), num_stages (TMA pipeline depth), block_tokens (tokens per step:
  a multiple of 64 that divides or is a multiple of page_size).
  """
  validate_inputs(q, k_pages, v_pages, page_table, kv_lens)
  check_kernel_support(q, k_pages)
  batch, num_q_heads, head_dim = q.shape
  num_kv_heads = k_pages.shape[2]
  group = num_q_heads // num_kv_heads
  group_p = _padded_group(group)
  if scale is None:
    scale = 1.0 / math.sqrt(head_dim)

  # q * scale * k_scale in fp32, grouped by kv head and padded to group_p rows.
  qs = q.astype(jnp.float32) * (jnp.asarray(scale, jnp.float32)
                                * jnp.asarray(k_scale, jnp.float32))
  qs = qs.reshape(batch, num_kv_heads, group, head_dim)
  qs = jnp.pad(qs, ((0, 0), (0, 0), (0, group_p - group), (0, 0)))
  qs = qs.astype(jnp.bfloat16)
  return attend_prepared(qs, k_pages, v_pages, page_table, kv_lens, group=group, v_scale=v_scale,
                         interpret=interpret, num_splits=num_splits, num_stages=num_stages,
                         block_tokens=block_tokens, out_dtype=q.dtype)


def attend_prepared(qs, k_pages, v_pages, page_table, kv_lens, *, group, v_scale=1.0,
                    interpret=False, num_splits=None, num_stages=None, block_tokens=None,
                    out_dtype=jnp.float32):
  """The kernel on a prepared query operand: qs [B, Hkv, group_p, D] bf16, q * scale * k_scale
  grouped by kv head, rows past `group` zero (as `paged_decode_attention_kernel` builds it, or
  `prologue.decode_prologue`) -> o [B, Hq, D] out_dtype (times v_scale, rounded once)."""
  batch, num_kv_heads, group_p, head_dim = qs.shape
  _, page_size, _, _ = k_pages.shape
  block_tokens, num_stages, num_splits = plan(
      batch, num_kv_heads, page_table.shape[1], page_size, head_dim, k_pages.dtype, group_p,
      num_splits=num_splits, num_stages=num_stages, block_tokens=block_tokens)
  merge = 1 < num_splits <= MAX_CLUSTER and not interpret
  unit_scale = isinstance(v_scale, float) and v_scale == 1.0
  o_part, lse, merged = _paged_call(
      qs, k_pages, v_pages, page_table, kv_lens, group=group,
      num_splits=num_splits, num_stages=num_stages, block_tokens=block_tokens, merge=merge,
      # the in-kernel merge writes the final dtype only when no v_scale follows (one rounding)
      out_dtype=jnp.dtype(out_dtype if unit_scale else jnp.float32), interpret=interpret)
  if merge:
    o = merged                                             # [B, Hq, D], splits merged in-kernel
  else:
    # o_part [B, Hkv, S, D, Gp] (normalised per split), lse [B, Hkv, S, Gp] (base 2).
    o_part = o_part[..., :group]
    lse = lse[..., :group]
    if num_splits == 1:
      o = o_part[:, :, 0]                                   # [B, Hkv, D, G]
    else:
      lse_max = jnp.max(lse, axis=2, keepdims=True)
      lse_max = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
      w = jnp.exp2(lse - lse_max)                           # [B, Hkv, S, G]
      denom = jnp.sum(w, axis=2)                            # [B, Hkv, G]
      o = jnp.einsum("bhsg,bhsdg->bhdg", w, o_part,
                     precision=lax.Precision.HIGHEST)
      o = o / jnp.where(denom == 0.0, 1.0, denom)[:, :, None, :]
    o = jnp.swapaxes(o, -1, -2).reshape(batch, num_kv_heads * group, head_dim)
  if not unit_scale:
    o = o * jnp.asarray(v_scale, jnp.float32)
  return o.astype(out_dtype)


def _merge_splits(o_ref, lse_ref, out_ref):
  """out_ref [G, D] (HBM) <- the log-sum-exp merge of a sequence's splits for one kv head:
  o_ref [S, D, Gp] f32 normalised per split, lse_ref [S, Gp] f32 (base 2; -inf for an empty
  split). Thread d owns column d of every query head; a head whose splits are all empty gets 0."""
  nsplit, head_dim, _ = o_ref.shape
  group = out_ref.shape[0]

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * 3)
  def merge(_, o_gmem, lse_gmem, out_gmem):
    f32, i32, index = ir.F32Type.get(), ir.IntegerType.get_signless(32), ir.IndexType.get()
    ci = lambda v: mgpu_utils.c(v, index)
    d = arith.index_cast(index, mgpu_utils.thread_idx())
    with mgpu_utils.when(arith.cmpi(arith.CmpIPredicate.ult, mgpu_utils.thread_idx(),
                                    mgpu_utils.c(head_dim, i32))):
      # every load before any store: the stores may alias the partials as far as LLVM knows, so
      # interleaving them would serialise one L2 round trip per query head
      lses = [[memref.load(lse_gmem, [ci(s), ci(g)]) for s in range(nsplit)] for g in range(group)]
      parts = [[memref.load(o_gmem, [ci(s), d, ci(g)]) for s in range(nsplit)] for g in range(group)]
      out_ty = ir.MemRefType(out_gmem.type).element_type
      for g in range(group):
        m = lses[g][0]
        for v in lses[g][1:]:
          m = arith.maximumf(m, v)
        finite = arith.cmpf(arith.CmpFPredicate.OLT, m, mgpu_utils.c(float("inf"), f32))
        finite = arith.andi(finite, arith.cmpf(arith.CmpFPredicate.OGT, m, mgpu_utils.c(float("-inf"), f32)))
        m = arith.select(finite, m, mgpu_utils.c(0.0, f32))
        num, den = mgpu_utils.c(0.0, f32), mgpu_utils.c(0.0, f32)
        for v, part in zip(lses[g], parts[g]):
          w = llvm.inline_asm(f32, [arith.subf(v, m)], "ex2.approx.ftz.f32 $0, $1;", "=f,f")
          num = arith.addf(num, arith.mulf(w, part))
          den = arith.addf(den, w)
        zero = arith.cmpf(arith.CmpFPredicate.OEQ, den, mgpu_utils.c(0.0, f32))
        o = arith.divf(num, arith.select(zero, mgpu_utils.c(1.0, f32), den))
        memref.store(o if out_ty == f32 else arith.truncf(out_ty, o), out_gmem, [ci(g), d])

  merge(o_ref, lse_ref, out_ref)


@functools.partial(jax.jit, static_argnames=("group", "num_splits", "num_stages", "block_tokens", "merge",
                                             "out_dtype", "interpret"))
def _paged_call(qs, k_pages, v_pages, page_table, kv_lens, *, group, num_splits,
                num_stages, block_tokens, merge, out_dtype, interpret):
  batch, num_kv_heads, group_p, head_dim = qs.shape
  num_pages, page_size, _, _ = k_pages.shape
  max_pages = page_table.shape[1]
  pool_dtype = k_pages.dtype
  convert = pool_dtype != jnp.dtype(jnp.bfloat16)
  tb = block_tokens
  chunk = min(tb, page_size)        # rows of one TMA copy (one page or a slice)
  cpb = tb // chunk                 # copies per block (pages per block if >= 1 page)
  ns = num_stages
  nsplit = num_splits

  def paged_decode_attention(q_ref, k_ref, v_ref, pt_ref, len_ref, o_ref, lse_ref, out_ref,
                             q_smem, k_smem, v_smem, kc_smem, vc_smem, p_smem,
                             q_bar, k_bar, v_bar, merge_bar):
    h = lax.axis_index("head")
    s = lax.axis_index("split")
    b = lax.axis_index("batch")
    # Split s takes blocks s, s + nsplit, s + 2 nsplit, ...: its first block is known before
    # kv_len is, so that block's page ids are read and its copies issued without waiting for
    # the kv_len load (past the end, the page the table names there, clamped into the pool;
    # those rows are masked).
    blk = lambda i: s + i * nsplit
    plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar.at[0])

    def page_ids(j, n_pages=None):
      """(page id, row offset) of each copy of block j. Given n_pages, chunks past the
      sequence end read the dummy page 0; without it, the table's entry clamped into the pool
      (their rows are masked either way)."""
      ids = []
      for c in range(cpb):
        tok = j * tb + c * chunk
        idx = lax.div(tok, page_size)
        pid = pt_ref[b, jnp.minimum(idx, max_pages - 1)]
        ids.append(jnp.clip(pid, 0, num_pages - 1) if n_pages is None else jnp.where(idx < n_pages, pid, 0))
        if chunk < page_size:
          ids.append(lax.rem(tok, page_size))
      return tuple(ids)

    def issue(slot, ids):
      for c in range(cpb):
        if chunk < page_size:
          pid, off = ids[2 * c], ids[2 * c + 1]
          src_rows = pl.ds(pl.multiple_of(off, chunk), chunk)
        else:
          pid, src_rows = ids[c], slice(None)
        dst_rows = pl.ds(c * chunk, chunk)
        plgpu.copy_gmem_to_smem(k_ref.at[pid, src_rows, h, :], k_smem.at[slot, dst_rows],
                                k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[pid, src_rows, h, :], v_smem.at[slot, dst_rows],
                                v_bar.at[slot])

    issue(0, page_ids(blk(0)))
    kv_len = len_ref[b]
    n_pages = lax.div(kv_len + (page_size - 1), page_size)
    n_blk = lax.div(kv_len + (tb - 1), tb)
    n = jnp.maximum(lax.div(n_blk - s + (nsplit - 1), nsplit), 0)   # blocks of this CTA

    for i in range(1, ns):
      @pl.when(i < n)
      def _prologue():
        issue(i, page_ids(blk(i), n_pages))

    @pl.when(n == 0)
    def _drain():                       # the first block's copies land before the CTA ends
      plgpu.barrier_wait(k_bar.at[0])
      plgpu.barrier_wait(v_bar.at[0])

    plgpu.barrier_wait(q_bar.at[0])

    m0 = plgpu.layout_cast(jnp.full((group_p,), -jnp.inf, jnp.float32),
                           plgpu.Layout.WGMMA.reduce(0))
    l0 = plgpu.layout_cast(jnp.full((group_p,), 0.0, jnp.float32),
                           plgpu.Layout.WGMMA.reduce(0))
    acc0 = plgpu.layout_cast(jnp.full((head_dim, group_p), 0.0, jnp.float32),
                             plgpu.Layout.WGMMA)

    def step(i, carry):
      acc, m_i, l_i, ids = carry
      slot = lax.rem(i, ns)
      blk_start = blk(i) * tb
      n_valid = kv_len - blk_start                        # >= 1
      plgpu.barrier_wait(k_bar.at[slot])
      if convert:
        kc_smem[...] = _to_bf16(k_smem[slot])
        plgpu.commit_smem()
        k_tile = kc_smem
      else:
        k_tile = k_smem.at[slot]

      def qk(acc_ref):
        plgpu.wgmma(acc_ref, k_tile, q_smem.transpose((1, 0)))
        return acc_ref[...]
      st = pl.run_scoped(qk, plgpu.ACC((tb, group_p), jnp.float32))  # [T, Gp]

      tok = plgpu.broadcasted_iota(jnp.int32, (tb, group_p), 0,
                                   layout=plgpu.Layout.WGMMA)
      s2 = jnp.where(tok < n_valid, st * LOG2E, -jnp.inf)
      m_new = jnp.maximum(m_i, s2.max(axis=0))
      alpha = jnp.exp2(m_i - m_new)
      p = jnp.exp2(s2 - lax.broadcast_in_dim(m_new, s2.shape, [1]))
      l_new = l_i * alpha + p.sum(axis=0)
      p_smem.transpose((1, 0))[...] = p.astype(jnp.bfloat16)

      plgpu.barrier_wait(v_bar.at[slot])
      if convert:
        v_tile = vc_smem
        vc_smem[...] = _to_bf16(v_smem[slot])
      else:
        v_tile = v_smem.at[slot]

      @pl.when(n_valid < tb)
      def _zero_tail():
        rows = plgpu.broadcasted_iota(jnp.int32, (tb, head_dim), 0,
                                      layout=plgpu.Layout.WGMMA)
        v_tile[...] = jnp.where(rows < n_valid, v_tile[...],
                                jnp.zeros((tb, head_dim), jnp.bfloat16))
      plgpu.commit_smem()

      def pv(acc_ref):
        plgpu.wgmma(acc_ref, v_tile.transpose((1, 0)), p_smem.transpose((1, 0)))
        return acc_ref[...]
      o_blk = pl.run_scoped(pv, plgpu.ACC((head_dim, group_p), jnp.float32))
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1]) + o_blk

      @pl.when(i + ns < n)
      def _refill():
        issue(slot, ids)
      ids = page_ids(blk(i + ns + 1), n_pages)
      return acc, m_new, l_new, ids

    acc, m_i, l_i, _ = lax.fori_loop(0, n, step, (acc0, m0, l0, page_ids(blk(ns), n_pages)))

    l_safe = jnp.where(l_i == 0.0, 1.0, l_i)
    o_ref[b, h, s] = acc / lax.broadcast_in_dim(l_safe, acc.shape, [1])
    lse_ref[b, h, s] = m_i + jnp.log(l_i) * LOG2E
    if merge:
      gpu_fence()
      plgpu.barrier_arrive(merge_bar.at[0])
      plgpu.barrier_wait(merge_bar.at[0])

      @pl.when(s == 0)
      def _():
        gpu_fence()
        _merge_splits(o_ref.at[b, h], lse_ref.at[b, h], out_ref.at[b, pl.ds(h * group, group)])

  bf16 = jnp.bfloat16
  conv_shape = (tb, head_dim) if convert else (8, 64)
  scratch = dict(
      q_smem=plgpu.SMEM((group_p, head_dim), bf16, transforms=_swizzled(bf16, head_dim)),
      k_smem=plgpu.SMEM((ns, tb, head_dim), pool_dtype,
                        transforms=_swizzled(pool_dtype, head_dim)),
      v_smem=plgpu.SMEM((ns, tb, head_dim), pool_dtype,
                        transforms=_swizzled(pool_dtype, head_dim)),
      kc_smem=plgpu.SMEM(conv_shape, bf16, transforms=_swizzled(bf16, conv_shape[1])),
      vc_smem=plgpu.SMEM(conv_shape, bf16, transforms=_swizzled(bf16, conv_shape[1])),
      p_smem=plgpu.SMEM((group_p, tb), bf16, transforms=_swizzled(bf16, tb)),
      q_bar=plgpu.Barrier(num_barriers=1),
      k_bar=plgpu.Barrier(num_arrivals=cpb, num_barriers=ns),
      v_bar=plgpu.Barrier(num_arrivals=cpb, num_barriers=ns),
      merge_bar=(plgpu.ClusterBarrier(collective_axes=("split",), num_arrivals=1, num_barriers=1) if merge
                 else plgpu.Barrier(num_barriers=1)),
  )
  out_type = (
      jax.ShapeDtypeStruct((batch, num_kv_heads, nsplit, head_dim, group_p), jnp.float32),
      jax.ShapeDtypeStruct((batch, num_kv_heads, nsplit, group_p), jnp.float32),
      jax.ShapeDtypeStruct((batch, num_kv_heads * group, head_dim) if merge else (1, 1, 1), out_dtype),
  )
  layout = (dict(grid=(num_kv_heads, batch), grid_names=("head", "batch"), cluster=(nsplit,),
                 cluster_names=("split",)) if merge
            else dict(grid=(num_kv_heads, nsplit, batch), grid_names=("head", "split", "batch")))
  call = plgpu.kernel(
      paged_decode_attention,
      out_type=out_type,
      scratch_types=scratch,
      **layout,
      compiler_params=plgpu.CompilerParams(
          approx_math=True, reduction_scratch_bytes=_REDUCTION_SCRATCH),
      **interpret_kwargs(interpret),
  )
  return call(qs, k_pages, v_pages, page_table, kv_lens)
