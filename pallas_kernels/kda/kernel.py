"""Mosaic GPU KDA kernels for Hopper (H200): decode, speculative verify, chunked prefill.

Public entry points (wrapped by `pallas_kernels.kda`): `kda_decode_pallas`,
`kda_verify_pallas`, `chunk_kda_pallas`. All are Mosaic GPU (`plgpu.kernel`, TMA, `wgmma`);
no Triton lowering is used. `interpret=True` runs them in Mosaic GPU interpret mode on CPU.
All order their shared-memory traffic themselves (`hand_synced`: Pallas's automatic barriers
around every SMEM store made the prefill 6 % slower at T = 32K, H = 32, outputs bit-identical).

Decode and verify update fp32 state tiles S [K, Vt] of `state_pool[slots[n], h]` with one
warpgroup, S in registers (row broadcasts of g/k/q, column broadcasts of v', reductions over
K). Decode (`_decode_stream`) is persistent: each resident CTA streams its round-robin share
of the (row, head, V tile) tiles through a ring of SMEM slots (TMA loads ahead, TMA stores
back into the same slot: the pool is a `jax.new_ref` aliased to the output, so the update is
in place when the caller donates the pool). State traffic is exactly one read and one write
of the state per call -- the roofline for this op. Verify (`_verify_call`): one CTA per
(V tile, head, row) runs the Ts tokens and TMA-stores S after every token into `states` (V
tiles of 32 columns for small batches, 64 otherwise: `_step_v_tile`). Both hold S with each
thread owning columns of the tile (`_column_layout`), so the reductions over K stay mostly
in-thread.

Chunked prefill (`chunk_kda_pallas`), fla's stage split with stages 3 and 4 fused:
  0.   Input prep: for varlen the gather into sequence-aligned 64-token chunks; at K = 64 the
       chunk-local fp32 cumsum Gamma of g (`chunk_cumsum.py`, Mosaic GPU; at K = 128 the
       intra-chunk kernel takes it in shared memory, the same walk on its swizzled tile). bf16
       q / k go to the intra-chunk kernel as they are (it l2-normalises and scales them and
       maps value heads to q/k heads); other dtypes are normalised, scaled and GVA-expanded
       by XLA in fp32 first (one fused elementwise pass, bf16 out).
  1-2. `_intra_call` (Mosaic GPU, one CTA per (head, chunk), all chunks in parallel):
       A_qk / A_kk with the 32-token sub-chunk reference trick (exp(Gamma_i - r) *
       exp(r - Gamma_j), r = Gamma at the middle token of row i's sub-chunk; 2 passes of 2
       wgmmas), T = (I + A_kk)^-1 Diag(beta) blocked: the 16x16 diagonal blocks by fp32
       forward substitution, each thread solving for the columns it holds (`diag_inverse.py`),
       the rest by four 3-pass bf16 products (hi*hi + hi*lo + lo*hi); w = T (exp(Gamma) k) and
       u = T v in 3 passes.
       Independent wgmmas are issued together before one wait (`_mm`); exponentials use the
       approximate ex2 path (outputs within ~1e-5 relative of exact expf on the H200, far below
       the bf16 operand rounding), which cut the stage by a quarter. The CTA fits twice per SM
       (shared buffers reused in place, masks from index vectors so ptxas keeps the wgmmas
       asynchronous): the stage is a chain of small dependent steps, and a second CTA fills the
       waits. `_intra` is the same stage in jnp (`intra="xla"`), kept as a fallback; it was 3.6x
       slower than fla end to end.
  3-4. `_scan_call` (Mosaic GPU): grid (V tiles, HV, N sequences); each CTA walks its
       sequence's chunks in order with the fp32 state S [K, Vt] held in registers and, per
       chunk, runs 4 wgmmas:
         W S, Qg S (both [C,K] @ [K,Vt], S copied to SMEM as bf16),
         O = Qg S + A_qk v_new ([C,C] @ [C,Vt]),   v_new = u - W S,
         S = exp(Gamma_last) * S + Kg^T v_new      ([K,C] @ [C,Vt], transposed SMEM operand).
       The next chunk's operands are TMA-prefetched into a second buffer while the current
       one computes. Final states and chunk-end states (a per-chunk row table says which,
       and where) are TMA-stored from the registers. A checkpoint interval that is not a
       multiple of C takes the chunk ends its checkpoints start from and finishes each with
       one fp32 chunk step of the remaining < C tokens in XLA
       (`reference.checkpoints_from_boundaries`).
Matmul operands of the scan are bf16 with fp32 accumulation (as fla); the state, u, decays
and all elementwise math stay fp32.

Numerical precondition of the prefill kernel: the sub-chunk trick multiplies by
exp(Gamma_i - r) and exp(r - Gamma_j), each <= exp(-16 * min g) inside a 32-token sub-chunk
referenced at its middle, which stays finite for fla's safe gate (g >= -5, GLM-5.3: <= exp(80))
and is clamped at exp(85) otherwise; gates more negative than about -5.3 per token can lose
accuracy there (use backend="xla" for such gates).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import (
  SMEM_PER_CTA,
  bf16_split,
  hand_synced,
  interpret_kwargs,
  num_sms,
  to_bf16,
)

from ._common import L2NORM_EPS, KDACheckpoints, prepare_qk, qk_scale
from .chunk_cumsum import COLS as CUMSUM_COLS
from .chunk_cumsum import chunk_cumsum, cumsum_swizzled_rows
from .chunk_cumsum import kernel_supported as cumsum_kernel_supported
from .diag_inverse import BLOCK as _INV_BLOCK
from .diag_inverse import diag_block_inverse_t
from .reference import CHUNK, _chunk_table, checkpoints_from_boundaries

SUPPORTED_DIMS = (64, 128)
_L = plgpu.Layout
_SUB = 32          # sub-chunk length of the intra-chunk reference trick
_REF = 16          # its reference row (the middle: both exponent ranges are 16 tokens)
_EXP_CLAMP = 85.0  # exp(85) ~ 8e36 < float32/bf16 max


def check_kernel_dims(kd, vd):
  """The kernels need K == V in {64, 128} (wgmma M/N tiling of the state)."""
  if kd not in SUPPORTED_DIMS or vd != kd:
    raise ValueError(f"the Pallas KDA kernels need K == V in {SUPPORTED_DIMS}, got K={kd}, "
                     f"V={vd}; use backend='xla' for other head sizes")


def _swizzled(dtype, cols, max_bytes=128):
  """SMEM transforms (tiling + swizzle) for a tile whose rows hold `cols` elements of `dtype`:
  the layout wgmma operands need, and the one that lets WGMMA-layout register loads/stores of
  f32 tiles run without shared-memory bank conflicts (an unswizzled 256-512 B row stride puts
  the 8 rows a warp touches on the same banks). Both operands of a wgmma need the same swizzle:
  `max_bytes` caps it to the narrowest operand's row."""
  bits = jnp.dtype(dtype).itemsize * 8
  sw = plgpu.find_swizzle(min(cols * bits, max_bytes * 8), "lhs")
  return (plgpu.TilingTransform((8, sw * 8 // bits)), plgpu.SwizzleTransform(sw))


_NARROW_SCAN_CTAS = 132    # prefill scan: the most CTAs of one wave (one per SM on the H200)


def _scan_v_tile(n, hv, vd):
  """V tile of the prefill scan's grid (V tiles x heads x sequences, each CTA walking its
  sequence's chunks in order, one CTA per SM): 32 columns when that grid still fits in one
  wave, 64 otherwise. H200, T = 32K, V = 128: HV = 32 (64 -> 128 CTAs) 0.817 -> 0.747 ms; HV =
  64 (128 -> 256 CTAs: two waves) 1.06 -> 1.98 ms, so 64 wide there."""
  return 32 if n * hv * (vd // 32) <= _NARROW_SCAN_CTAS else min(64, vd)


_NARROW_STEP_ROWS = 1024   # verify: rows x heads up to which V tiles are 32 wide


def _step_v_tile(n, hv, vd):
  """V tile of the verify grid (measured when decode used the same grid). A small batch has too
  few (row, head) state tiles to spread over the SMs, so its tiles are 32 columns wide (twice
  the CTAs; N = 1, HV = 32 on the H200: 17 instead of 35 µs per step); from
  `_NARROW_STEP_ROWS` rows x heads on, 64 (N = 256: 338 instead of 373 µs)."""
  return min(32 if n * hv <= _NARROW_STEP_ROWS else 64, vd)


# ------------------------------------------------------------------ decode / verify


def _column_layout(kd, vt):
  """Register layout of an fp32 [K, Vt] state tile (Vt a multiple of 32) in which each thread
  holds K / 4 consecutive rows of Vt / 32 adjacent columns: warp w owns rows [w K/4, (w+1) K/4),
  lane l columns [l Vt/32, (l+1) Vt/32). Reductions over K are in-thread adds plus one
  cross-warp step (the WGMMA layout spreads K over 8 lanes and 4 warps: shuffles on every
  column), and a warp's row access is one contiguous Vt x 4-byte run of shared memory, free of
  bank conflicts without a swizzle."""
  return _L.TILED(plgpu.Tiling(((kd, vt), (kd // 4, vt), (vt // 32,))), warp_dims=(-5,),
                  lane_dims=(-2,), vector_dim=-1)


def _verify_call(q, k, v, eg, beta, pool, slots, reset, *, interpret):
  """Ts tokens per row from pool slots, one CTA per (V tile, head, row).

  q, k [N,Ts,HV,K] f32 (q pre-scaled / normalised); eg = exp(g) [N,Ts,HV,K] f32; v
  [N,Ts,HV,V] f32; beta [N,Ts,HV] f32; pool [S,HV,K,V] f32; slots, reset [N] int32.
  Returns (o [N,Ts,HV,V] f32, states [N,Ts,HV,K,V] f32); the pool is left untouched.
  """
  n, ts, hv, kd = q.shape
  vd = v.shape[-1]
  vt = _step_v_tile(n, hv, vd)
  f32 = jnp.float32
  lay = _column_layout(kd, vt)

  def kda_step(q_ref, k_ref, v_ref, eg_ref, b_ref, slot_ref, reset_ref, pool_ref, o_ref, st_ref,
               *, s_smem, q_smem, k_smem, eg_smem, v_smem, bar):
    j = lax.axis_index("vt")
    h = lax.axis_index("h")
    r = lax.axis_index("n")
    slot = slot_ref[r]
    cols = pl.ds(j * vt, vt)
    plgpu.copy_gmem_to_smem(pool_ref.at[slot, h, :, cols], s_smem, bar.at[0])
    plgpu.copy_gmem_to_smem(q_ref.at[r, :, h, :], q_smem, bar.at[0])
    plgpu.copy_gmem_to_smem(k_ref.at[r, :, h, :], k_smem, bar.at[0])
    plgpu.copy_gmem_to_smem(eg_ref.at[r, :, h, :], eg_smem, bar.at[0])
    plgpu.copy_gmem_to_smem(v_ref.at[r, :, h, cols], v_smem, bar.at[0])
    plgpu.barrier_wait(bar.at[0])
    s = plgpu.load(s_smem, layout=lay)                               # [K, Vt] f32
    fresh = jnp.broadcast_to(reset_ref[r] != 0, (kd, vt))
    s = jnp.where(fresh, jnp.zeros_like(s), s)
    for t in range(ts):
      ev = plgpu.load(eg_smem.at[t], layout=lay.reduce(1))            # [K] exp(g)
      kv = plgpu.load(k_smem.at[t], layout=lay.reduce(1))
      qv = plgpu.load(q_smem.at[t], layout=lay.reduce(1))
      vv = plgpu.load(v_smem.at[t], layout=lay.reduce(0))            # [Vt]
      kb = lax.broadcast_in_dim(kv, (kd, vt), [0])
      s = s * lax.broadcast_in_dim(ev, (kd, vt), [0])
      ks = jnp.sum(s * kb, axis=0)                                  # k^T S  [Vt]
      vn = jnp.broadcast_to(b_ref[r, t, h], (vt,)) * (vv - ks)
      s = s + kb * lax.broadcast_in_dim(vn, (kd, vt), [1])
      o = jnp.sum(s * lax.broadcast_in_dim(qv, (kd, vt), [0]), axis=0)
      v_smem[t] = o                                                 # reuse v's row for o
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)               # s_smem free again
      s_smem[...] = s
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(s_smem, st_ref.at[r, t, h, :, cols])
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(v_smem, o_ref.at[r, :, h, cols])
    plgpu.wait_smem_to_gmem(0)

  out_type = (jax.ShapeDtypeStruct((n, ts, hv, vd), f32),
              jax.ShapeDtypeStruct((n, ts, hv, kd, vd), f32))
  scratch = {
      "s_smem": plgpu.SMEM((kd, vt), f32),
      "q_smem": plgpu.SMEM((ts, kd), f32),
      "k_smem": plgpu.SMEM((ts, kd), f32),
      "eg_smem": plgpu.SMEM((ts, kd), f32),
      "v_smem": plgpu.SMEM((ts, vt), f32),
      "bar": plgpu.Barrier(num_arrivals=5, num_barriers=1),
  }
  call = plgpu.kernel(
      kda_step, out_type=out_type, scratch_types=scratch,
      grid=(vd // vt, hv, n), grid_names=("vt", "h", "n"),
      compiler_params=hand_synced(approx_math=False),
      **interpret_kwargs(interpret))
  return call(q, k, v, eg, beta, slots, reset, pool)


# Decode's persistent form, (V tile, ring slots per CTA): fp32 [K, 32] state tiles, or whole
# [K, V] states from _WHOLE_STATE_ROWS rows x heads on; as many CTAs per SM as fill
# _STREAM_RING_BYTES (K = V = 128: 3 x 4 x 16 KiB, or 1 x 3 x 64 KiB). H200, HV = 32, K = V =
# 128, kernel time in one process (RESULTS.md part 21), µs for [K, 32] / [K, 64] (two CTAs per
# SM) / whole states: N = 64 74.1 / 72.9 / 72.4, N = 128 148.4 / 143.3 / 139.7, N = 256 298.8 /
# 283.3 / 274.1 (3.92 TB/s of state read + written; a device-to-device copy of the same bytes:
# 4.2 TB/s); another run: N = 16 14.1 / 14.4 / 14.9, N = 32 37.5 / 37.3 / 38.0.
_STREAM_NARROW, _STREAM_WHOLE = (32, 4), (None, 3)
_WHOLE_STATE_ROWS = 2048
_STREAM_RING_BYTES = 192 * 1024


def _stream_config(n, hv, kd, vd):
  """(V tile, ring slots, CTAs per SM) of the persistent decode for n rows of hv heads."""
  vt, stages = _STREAM_WHOLE if n * hv >= _WHOLE_STATE_ROWS else _STREAM_NARROW
  vt = min(vt or vd, vd)
  return vt, stages, max(1, _STREAM_RING_BYTES // (stages * kd * vt * 4))


def _decode_stream(q, k, v, eg, beta, pool, slots, reset, *, interpret):
  """One decode token per row, persistent form: the (row, head, V tile) state tiles are dealt
  round-robin to at most `num_sms()` x (CTAs per SM) resident CTAs, and each CTA streams its
  share through a ring of SMEM slots (`_stream_config`; TMA loads of the next tiles and the
  TMA stores of the previous ones run under the current tile's update). A grid of one CTA per
  tile loads, updates and stores each tile in turn and stays below HBM speed even with no math.

  q, k [N,1,HV,K] f32 (q pre-scaled / normalised); eg = exp(g) [N,1,HV,K] f32; v [N,1,HV,V] f32;
  beta [N,1,HV] f32;
  pool [S,HV,K,V] f32 (updated in place); slots, reset [N] int32.
  Returns (o [N,1,HV,V] f32, new pool).
  """
  n, _, hv, kd = q.shape
  vd = v.shape[-1]
  vt, stages, per_sm = _stream_config(n, hv, kd, vd)
  nj = vd // vt
  items = n * hv * nj
  ctas = min(items, num_sms() * per_sm)
  f32 = jnp.float32
  lay = _column_layout(kd, vt)

  def kda_stream(q_ref, k_ref, v_ref, eg_ref, b_ref, slot_ref, reset_ref, pool_ref, o_ref, *,
                 s_smem, q_smem, k_smem, eg_smem, v_smem, bar):
    c = lax.axis_index("c")
    mine = lax.div(items - c + ctas - 1, ctas)       # items c, c + ctas, c + 2 ctas, ...

    def where(i):
      it = c + i * ctas
      rest = lax.div(it, nj)
      return lax.div(rest, hv), lax.rem(rest, hv), pl.ds(lax.rem(it, nj) * vt, vt)

    def issue(i, sx):
      r, h, cols = where(i)
      b = bar.at[sx]
      plgpu.copy_gmem_to_smem(pool_ref.at[slot_ref[r], h, :, cols], s_smem.at[sx], b)
      plgpu.copy_gmem_to_smem(q_ref.at[r, :, h, :], q_smem.at[sx], b)
      plgpu.copy_gmem_to_smem(k_ref.at[r, :, h, :], k_smem.at[sx], b)
      plgpu.copy_gmem_to_smem(eg_ref.at[r, :, h, :], eg_smem.at[sx], b)
      plgpu.copy_gmem_to_smem(v_ref.at[r, :, h, cols], v_smem.at[sx], b)

    for p in range(stages):
      @pl.when(p < mine)
      def _():
        issue(p, p)

    def step(i, carry):
      # Refill the slot of item i - 1 (its stores were issued last step) before waiting on
      # item i. (Issuing the refill after item i's stores, waiting for all but those, hung
      # on the H200; refilling the slot of item i - 2 instead, with item i - 1's stores left
      # in flight, measured no faster.)
      @pl.when((i >= 1) & (i - 1 + stages < mine))
      def _():
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        issue(i - 1 + stages, lax.rem(i - 1, stages))
      sx = lax.rem(i, stages)
      r, h, cols = where(i)
      plgpu.barrier_wait(bar.at[sx])
      s = plgpu.load(s_smem.at[sx], layout=lay)                      # [K, Vt] f32
      s = jnp.where(jnp.broadcast_to(reset_ref[r] != 0, (kd, vt)), jnp.zeros_like(s), s)
      ev = plgpu.load(eg_smem.at[sx, 0], layout=lay.reduce(1))         # [K] exp(g)
      kv = plgpu.load(k_smem.at[sx, 0], layout=lay.reduce(1))
      qv = plgpu.load(q_smem.at[sx, 0], layout=lay.reduce(1))
      vv = plgpu.load(v_smem.at[sx, 0], layout=lay.reduce(0))         # [Vt]
      kb = lax.broadcast_in_dim(kv, (kd, vt), [0])
      s = s * lax.broadcast_in_dim(ev, (kd, vt), [0])
      ks = jnp.sum(s * kb, axis=0)                                   # k^T S  [Vt]
      vn = jnp.broadcast_to(b_ref[r, 0, h], (vt,)) * (vv - ks)
      s = s + kb * lax.broadcast_in_dim(vn, (kd, vt), [1])
      v_smem[sx, 0] = jnp.sum(s * lax.broadcast_in_dim(qv, (kd, vt), [0]), axis=0)   # o
      s_smem[sx] = s
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(s_smem.at[sx], pool_ref.at[slot_ref[r], h, :, cols])
      plgpu.copy_smem_to_gmem(v_smem.at[sx], o_ref.at[r, :, h, cols])
      return carry

    lax.fori_loop(0, mine, step, 0)
    plgpu.wait_smem_to_gmem(0)

  scratch = {
      "s_smem": plgpu.SMEM((stages, kd, vt), f32),
      "q_smem": plgpu.SMEM((stages, 1, kd), f32),
      "k_smem": plgpu.SMEM((stages, 1, kd), f32),
      "eg_smem": plgpu.SMEM((stages, 1, kd), f32),
      "v_smem": plgpu.SMEM((stages, 1, vt), f32),
      "bar": plgpu.Barrier(num_arrivals=5, num_barriers=stages),
  }
  call = plgpu.kernel(
      kda_stream, out_type=jax.ShapeDtypeStruct((n, 1, hv, vd), f32), scratch_types=scratch,
      grid=(ctas,), grid_names=("c",),
      compiler_params=hand_synced(approx_math=False),
      **interpret_kwargs(interpret))
  pool_ref = jax.new_ref(pool)
  o = call(q, k, v, eg, beta, slots, reset, pool_ref)
  return o, pool_ref[...]


def _prep_step(q, k, v, g, beta, slots, reset, *, scale, use_qk_l2norm):
  """The step kernels' fp32 operands: q, k normalised / scaled, v, exp(g) (taken here once per
  (row, head, key) rather than by each of the threads that hold a key's row), beta; slots and
  the reset flags as int32."""
  hv = v.shape[-2]
  qf, kf = prepare_qk(q, k, scale=scale, use_qk_l2norm=use_qk_l2norm, hv=hv)
  n = slots.shape[0]
  rs = (jnp.zeros((n,), jnp.int32) if reset is None else reset.astype(jnp.int32))
  f32 = jnp.float32
  return (qf, kf, v.astype(f32), jnp.exp(g.astype(f32)), beta.astype(f32),
          slots.astype(jnp.int32), rs)


def kda_decode_pallas(q, k, v, g, beta, state_pool, slots, *, scale=None,
                      use_qk_l2norm=False, reset=None, interpret=False):
  """Decode step (one token per row); arguments as `kda_decode` (validated there)."""
  check_kernel_dims(q.shape[-1], v.shape[-1])
  qf, kf, vf, egf, bf, sl, rs = _prep_step(q, k, v, g, beta, slots, reset, scale=scale,
                                          use_qk_l2norm=use_qk_l2norm)
  o, pool = _decode_stream(qf[:, None], kf[:, None], vf[:, None], egf[:, None], bf[:, None],
                           state_pool, sl, rs, interpret=interpret)
  return o[:, 0].astype(v.dtype), pool


def kda_verify_pallas(q, k, v, g, beta, state_pool, slots, *, scale=None,
                      use_qk_l2norm=False, reset=None, interpret=False):
  """Speculative verify; arguments as `kda_verify` (validated there)."""
  check_kernel_dims(q.shape[-1], v.shape[-1])
  qf, kf, vf, egf, bf, sl, rs = _prep_step(q, k, v, g, beta, slots, reset, scale=scale,
                                          use_qk_l2norm=use_qk_l2norm)
  o, states = _verify_call(qf, kf, vf, egf, bf, state_pool, sl, rs, interpret=interpret)
  return o.astype(v.dtype), states


# ------------------------------------------------------------------- chunked prefill


def _mm(*groups, sync=False):
  """Tensor-core products into fresh fp32 accumulators, inside a kernel body.

  Each group is (shape, (a, b), (a, b), ...): its products are summed in one accumulator of
  `shape`. Every wgmma of every group is issued before a single wait, so independent products
  overlap instead of paying one issue-to-completion latency each. Returns one value per group.
  `sync`: end with a warpgroup barrier, for callers that next store into an operand
  (`hand_synced` kernels).
  (Accumulating into an existing register value with pl.run_state(ACC.init(x)) would save an
  add, but Mosaic GPU interpret mode cannot run it, and the tests must run the GPU code.)"""
  def run(*accs):
    for acc, (_, *pairs) in zip(accs, groups):
      for a_op, b_op in pairs:
        plgpu.wgmma(acc, a_op, b_op)
    plgpu.wgmma_wait(0)
    if sync:
      plgpu.commit_smem()
    return tuple(acc[...] for acc in accs)
  return pl.run_scoped(run, *(plgpu.ACC(shape, jnp.float32) for shape, *_ in groups))


def _intra(q, k, v, g, beta):
  """Stages 1-2 (XLA, parallel over chunks): per-chunk operands of the scan kernel.

  q, k, g [NC,C,HV,K] fp32 (q pre-scaled); v [NC,C,HV,V] fp32; beta [NC,C,HV] fp32; padded
  tokens are zeros. Returns head-major operands:
    w, qg, kg [NC,HV,C,K] bf16   T(exp(G) k), q exp(G), k exp(G_last - G)
    u         [NC,HV,C,V] f32    T v
    a         [NC,HV,C,C] bf16   A_qk, lower triangle incl. the diagonal
    gl        [NC,HV,K]   f32    exp(G_last), the state's decay over the chunk
  with G the chunk-local cumsum of g and T = (I + A_kk)^-1 Diag(beta).
  """
  nc, c, hv, kd = q.shape
  ns = c // _SUB
  tr = lambda x: jnp.swapaxes(x, 1, 2)
  q, k, v, g = tr(q), tr(k), tr(v), tr(g)
  beta = jnp.swapaxes(beta, 1, 2)                                 # [NC,HV,C]
  gam = jnp.cumsum(g, axis=2)
  ref = gam[:, :, _REF::_SUB]                                     # [NC,HV,ns,K]
  rowexp = jnp.exp(jnp.minimum(gam - jnp.repeat(ref, _SUB, axis=2), _EXP_CLAMP))
  keyexp = jnp.exp(jnp.minimum(ref[:, :, :, None] - gam[:, :, None], _EXP_CLAMP))
  kh = k[:, :, None] * keyexp                                     # [NC,HV,ns,C,K]

  def blocks(x):                                                  # [NC,HV,C,K] rows x keys
    xs = (x * rowexp).reshape(nc, hv, ns, _SUB, kd)
    return jnp.einsum("nhaik,nhajk->nhaij", xs, kh,
                      preferred_element_type=jnp.float32).reshape(nc, hv, c, c)

  ii = jnp.arange(c)
  a_qk = jnp.where(ii[:, None] >= ii[None, :], blocks(q), 0.0)
  a_kk = jnp.where(ii[:, None] > ii[None, :], blocks(k), 0.0) * beta[..., None]
  eg = jnp.exp(gam)
  rhs = beta[..., None] * jnp.concatenate([v, eg * k], axis=-1)
  x = jax.scipy.linalg.solve_triangular(jnp.eye(c, dtype=jnp.float32) + a_kk, rhs,
                                        lower=True, unit_diagonal=True)
  u, w = x[..., :v.shape[-1]], x[..., v.shape[-1]:]
  glast = gam[:, :, -1]                                           # [NC,HV,K]
  kg = k * jnp.exp(glast[:, :, None] - gam)
  bf = jnp.bfloat16
  return (w.astype(bf), (q * eg).astype(bf), kg.astype(bf), u, a_qk.astype(bf),
          jnp.exp(glast))


@functools.partial(jax.jit, static_argnames=("interpret", "scale", "l2norm"))
def _intra_call(qn, kn, v, decay, beta_t, *, interpret, scale=1.0, l2norm=False):
  """Stages 1-2 on the tensor cores (Mosaic GPU), one CTA per (head, chunk).

  qn, kn [NC,C,H,K] bf16, H dividing HV (value head j reads q/k head j // (HV // H)); the
  CTA l2-normalises them over K when `l2norm` and scales q by `scale` (in fp32, rounded once
  to bf16, as `prepare_qk`); v [NC,C,HV,V] bf16 or f32; decay [NC,C,HV,K] f32, g itself where
  the CTA takes its chunk-local cumsum G (K = 128, `_cumsum_in_kernel`), else G; beta_t
  [NC,HV,C] f32. Returns the same operands as `_intra`. Per CTA:
    A_qk, A_kk: 2 sub-chunk reference passes, each 2 wgmmas [C,K] @ [K,C] with operands
      q exp(min(G - r_row, 85)), k exp(min(G - r_row, 85)) and k exp(min(r_a - G, 85)) (bf16),
      keeping the rows of sub-chunk a (32-row sub-chunks referenced at their middle row: half
      the passes of 16-row ones referenced at their first: the kernel 1.12x faster at T = 32K,
      H = 32);
    T = (I + N)^-1, N = Diag(beta) A_kk strictly lower: D, the inverse of N's 16x16 diagonal
      blocks, by forward substitution in fp32 registers, each thread for the two columns of D
      its rows of D^T hold (`diag_block_inverse_t`; 1.07x faster than a 16-step substitution
      of whole register rows at T = 32K, H = 32), then T = (I - M)(I + M^2) D with
      M = D (N below the blocks), three 3-pass products after M's (1.13x faster than the
      64-step substitution of all of T at T = 32K, H = 32; 8x8 blocks with one product more
      were 1 % slower);
    machine code size is a limit of this kernel: with the sub-chunk passes unrolled it was
      125 KiB (sm_90a), and unrolling a 64-step substitution loop 4, 8 or 64 times (128.5 /
      135 / 185 KiB) made the prefill 7 % / 50 % / 100 % slower, a cliff at ~128 KiB
      consistent with the SM's instruction cache; adding the q/k l2-normalisation to that form
      (135 KiB) made it 40 % slower. So the sub-chunk passes and reference rows run as loops:
      95 KiB with the l2-normalisation, 8 % faster than the unrolled form without it (RESULTS.md
      part 15); 106 KiB (6776 instructions) with the straight-line block inverse and cumsum
      walk of part 20. Code added here should keep the kernel well below 128 KiB;
    w = T (beta exp(G) k), u = T (beta v) in 3 bf16 passes (hi*hi + hi*lo + lo*hi, ~16-bit
      mantissa).
  The chain of small dependent steps leaves one warpgroup mostly waiting, so the CTA is
  sized for two per SM (about 101 KB of shared memory at K = 128, bf16 v): five buffers are
  reused in place as the stage goes,
    x1  q -> q exp(G - r_row) -> v -> (beta v)_hi          (f32 v: its own buffer)
    x2  k -> D, then T (hi | lo)
    x3  kg staging -> keys of pass a -> N (f32, its diagonal blocks' rows read by every
        thread of a warp in the substitution) -> I + P (hi | lo) -> w staging
    x4  qg staging (its TMA store issued first, so that it has read the buffer by the time
        k exp(G - r_row) goes there) -> k exp(G - r_row) -> A_qk staging -> N below the
        blocks, then P (hi | lo) -> (beta v)_lo
    x5  g -> gamma (f32; at K = 128 the cumsum runs in place) -> beta exp(G) k (hi | lo)
        -> u staging (f32)
  and v is only read once the inverse starts.
  """
  nct, c, hq, kd = qn.shape
  hv, vd = v.shape[2], v.shape[-1]
  group = hv // hq
  f32, bf = jnp.float32, jnp.bfloat16
  ns = c // _SUB
  blk = _INV_BLOCK
  nblk = c // blk
  ref_rows = tuple(range(_REF, c, _SUB)) + (c - 1,)
  v_own = v.dtype != bf                  # an f32 v does not fit x1
  raw_g = _cumsum_in_kernel(kd)
  # fp32 -> bf16 in packed conversions (LLVM converts element by element where the value is
  # used again as fp32)
  split_bf = functools.partial(bf16_split, interpret=interpret)
  to_bf16_ = functools.partial(to_bf16, interpret=interpret)

  def kda_intra(q_ref, k_ref, v_ref, g_ref, b_ref, w_ref, qg_ref, kg_ref, u_ref, a_ref, gl_ref, *,
                x1, x2, x3, x4, x5, v_f32, gr_s, b_s, gl_s, bar, vbar):
    h = lax.axis_index("h")
    ch = lax.axis_index("c")
    k_s, (m1, m2) = x2
    t2, n_s, (q1, q2) = x3
    t3, m5, (p1, p2) = x4
    g_s, (rh_s, rl_s), g_raw = x5
    v_s = v_f32 if v_own else x1
    # Gamma rows used as per-column vectors (sub-chunk references, last row) live in their own
    # buffer gr_s: g_s is swizzled, and Pallas reads only an unswizzled tile by rows.
    with jax.named_scope("load"):
      plgpu.copy_gmem_to_smem(q_ref.at[ch, :, h // group, :], x1, bar.at[0])
      plgpu.copy_gmem_to_smem(k_ref.at[ch, :, h // group, :], k_s, bar.at[0])
      plgpu.copy_gmem_to_smem(g_ref.at[ch, :, h, :], g_s, bar.at[0])
      plgpu.copy_gmem_to_smem(b_ref.at[ch, h], b_s, bar.at[0])
      if not raw_g:
        for i, row in enumerate(ref_rows):
          plgpu.copy_gmem_to_smem(g_ref.at[ch, pl.ds(row, 1), h, :], gr_s.at[pl.ds(i, 1)],
                                  bar.at[0])
      plgpu.barrier_wait(bar.at[0])
    if raw_g:
      with jax.named_scope("cumsum"):
        # Gamma in place in the swizzled g_s, each thread walking its column (`g_raw` is the
        # same buffer without transforms); each thread reads the reference rows it wrote
        refs = cumsum_swizzled_rows(g_raw, g_s, ref_rows, interpret=interpret)
        for i, vec in enumerate(refs):
          gr_s[i] = vec
        plgpu.commit_smem()

    def split3(x_hi, x_lo, y_hi, y_lo, n_out):
      """The 3-pass product hi*hi + hi*lo + lo*hi as one `_mm` group."""
      return ((c, n_out), (x_hi, y_hi), (x_hi, y_lo), (x_lo, y_hi))

    def ref_vec(row):
      i = ref_rows.index(row)
      return plgpu.load(gr_s.at[i], layout=_L.WGMMA.reduce(0))    # [K], one per column

    def tile(ref):
      return plgpu.load(ref, layout=_L.WGMMA).astype(f32)

    # row / column indices as vectors broadcast where used: a thread's share of a tile spans
    # 2 rows and 16 columns, so masks cost a few registers instead of a full tile of indices
    # (register pressure here decides whether ptxas keeps the wgmmas asynchronous)
    row_v = plgpu.broadcasted_iota(jnp.int32, (c,), 0, layout=_L.WGMMA.reduce(1))
    col_v = plgpu.broadcasted_iota(jnp.int32, (c,), 0, layout=_L.WGMMA.reduce(0))
    rows_c = lambda: lax.broadcast_in_dim(row_v, (c, c), [0])
    cols_c = lambda: lax.broadcast_in_dim(col_v, (c, c), [1])
    def prepared(ref, mult, keep):
      """q or k as the rest of the kernel reads it: l2-normalised when `l2norm`, times `mult`,
      rounded once to bf16 (as `prepare_qk`); written back to `ref` when `keep`."""
      x = tile(ref)
      if not l2norm and mult == 1.0:
        return x
      if l2norm:
        x = x * lax.broadcast_in_dim(lax.rsqrt(jnp.sum(x * x, axis=1) + L2NORM_EPS), (c, kd), [0])
      x = to_bf16_(x * mult if mult != 1.0 else x)
      if keep:
        ref[...] = x
      return x.astype(f32)

    # the masks below are per row: compared on the row vector (2 values a thread), then
    # broadcast, instead of compared per element
    in_rows = lambda lo, hi, n: lax.broadcast_in_dim((row_v >= lo) & (row_v < hi), (c, n), [0])
    with jax.named_scope("qk_out"):
      # q and k loaded once for the outputs that need only G, q, k (qg = q exp(G), kg = k
      # exp(G_last - G), exp(G_last)) and for the A matrices' operands, q and k rescaled by
      # exp(G - r_row), r_row = G at the middle token of the row's sub-chunk
      gam = plgpu.load(g_s, layout=_L.WGMMA)
      rref = lax.broadcast_in_dim(ref_vec(_REF), (c, kd), [1])
      for a in range(1, ns):
        r_a = lax.broadcast_in_dim(ref_vec(_REF + a * _SUB), (c, kd), [1])
        rref = jnp.where(in_rows(a * _SUB, c, kd), r_a, rref)
      rowexp = jnp.exp(jnp.minimum(gam - rref, _EXP_CLAMP))
      q = prepared(x1, scale, keep=False)
      t3[...] = (q * jnp.exp(gam)).astype(bf)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(t3, qg_ref.at[ch, h])
      x1[...] = (q * rowexp).astype(bf)
      k = prepared(k_s, 1.0, keep=True)
      glast = ref_vec(c - 1)
      t2[...] = (k * jnp.exp(lax.broadcast_in_dim(glast, (c, kd), [1]) - gam)).astype(bf)
      gl_s[...] = jnp.exp(glast)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(t2, kg_ref.at[ch, h])
      plgpu.copy_smem_to_gmem(gl_s, gl_ref.at[ch, h])
      k_row = (k * rowexp).astype(bf)
      plgpu.wait_smem_to_gmem(2, wait_read_only=True)                # qg (t3) read
      t3[...] = k_row

    with jax.named_scope("a_matrices"):
      def sub_chunk_pass(a, acc):
        # a rolled loop: the kernel's code is large enough that its size costs time (see the
        # docstring)
        a_qk, a_kk = acc
        ref_a = plgpu.load(gr_s.at[a], layout=_L.WGMMA.reduce(0))          # r_a
        expo = jnp.minimum(lax.broadcast_in_dim(ref_a, (c, kd), [1])
                           - plgpu.load(g_s, layout=_L.WGMMA), _EXP_CLAMP)
        # keys after sub-chunk a meet its rows only above the diagonal, where their products
        # (which can overflow: both factors up to exp(85)) are masked out
        keys = (tile(k_s) * jnp.exp(expo)).astype(bf)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)                # kg (t2) read (pass 0)
        t2[...] = keys
        plgpu.commit_smem()
        keys = t2.transpose((1, 0))
        mine = in_rows(a * _SUB, (a + 1) * _SUB, c)
        p_qk, p_kk = _mm(((c, c), (x1, keys)), ((c, c), (t3, keys)),
                         sync=True)                             # t2, x1 rewritten next
        return jnp.where(mine, p_qk, a_qk), jnp.where(mine, p_kk, a_kk)

      zero = plgpu.layout_cast(jnp.zeros((c, c), f32), _L.WGMMA)
      a_qk, a_kk = lax.fori_loop(0, ns, sub_chunk_pass, (zero, zero))
    with jax.named_scope("a_out"):
      plgpu.copy_gmem_to_smem(v_ref.at[ch, :, h, :], v_s, vbar.at[0])   # x1 is free again
      m5[...] = to_bf16_(jnp.where(cols_c() <= rows_c(), a_qk, 0.0))
      beta_r = lax.broadcast_in_dim(plgpu.load(b_s, layout=_L.WGMMA.reduce(1)), (c, c), [0])
      nmat = jnp.where(cols_c() < rows_c(), a_kk, 0.0) * beta_r           # strictly lower
      # the right-hand side of w replaces gamma; k is no longer needed
      beta_k = lax.broadcast_in_dim(plgpu.load(b_s, layout=_L.WGMMA.reduce(1)), (c, kd), [0])
      r_hi, r_lo = split_bf(beta_k * jnp.exp(plgpu.load(g_s, layout=_L.WGMMA)) * tile(k_s))
      plgpu.commit_smem()                          # all of g_s read before r overwrites it
      rh_s[...] = r_hi
      rl_s[...] = r_lo
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(m5, a_ref.at[ch, h])
    with jax.named_scope("inverse"):
      # T = (I + N)^-1 in two parts. Split N = Nd + No, Nd inside the diagonal blocks of
      # B = _INV_BLOCK rows, No below them; then I + N = (I + Nd)(I + D No) with
      # D = (I + Nd)^-1, and M = D No is strictly block-lower (M^(c/B) = 0), so
      #   T = (I + M)^-1 D = (I - M)(I + M^2)(I + M^4)... D.
      # D comes from a forward substitution in fp32 registers on the diagonal blocks only:
      # dt[r, t] = D^T[r, base(r) + t], base(r) the first row of r's block
      # (`diag_block_inverse_t`). The products are 3-pass bf16 wgmmas (64x64x64).
      n_s[...] = nmat
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)                # A_qk (m5) read
      base_r = functools.reduce(lambda acc, b: jnp.where(row_v >= b * blk, b * blk, acc),
                                range(1, nblk), jnp.zeros_like(row_v))   # first row of r's block
      base_rc = lambda: lax.broadcast_in_dim(base_r, (c, c), [0])
      no_hi, no_lo = split_bf(jnp.where(cols_c() < base_rc(), nmat, 0.0))
      p1[...] = no_hi
      p2[...] = no_lo
      plgpu.commit_smem()
      with jax.named_scope("diagonal"):
        dt = diag_block_inverse_t(n_s, interpret=interpret)
        in_block = (cols_c() >= base_rc()) & (cols_c() < base_rc() + blk)
        dt = jnp.where(in_block, jnp.concatenate([dt] * nblk, axis=1), 0.0)   # D^T [c, c]
      d_hi, d_lo = split_bf(dt)
      m1.T[...] = plgpu.layout_cast(d_hi, _L.WGMMA_TRANSPOSED)       # X = D
      m2.T[...] = plgpu.layout_cast(d_lo, _L.WGMMA_TRANSPOSED)
      plgpu.commit_smem()
      (m,) = _mm(split3(m1, m2, p1, p2, c), sync=True)               # M = D No
      p = -m
      eye = jnp.where(cols_c() == rows_c(), 1.0, 0.0)
      levels = nblk.bit_length() - 1
      for lvl in range(levels):
        # X <- (I + P) X and, unless last, P <- P^2 = (I + P) P - P, with P = -M^(2^lvl)
        last = lvl == levels - 1
        if not last:
          p1[...], p2[...] = split_bf(p)
        q1[...], q2[...] = split_bf(eye + p)
        plgpu.commit_smem()
        groups = (split3(q1, q2, m1, m2, c),) + (() if last else (split3(q1, q2, p1, p2, c),))
        x, *pp = _mm(*groups, sync=True)
        m1[...], m2[...] = split_bf(x)                               # T when last
        if not last:
          p = pp[0] - p
      plgpu.commit_smem()
    with jax.named_scope("w_u_out"):
      (w,) = _mm(split3(m1, m2, rh_s, rl_s, kd))                       # w = T beta exp(G) k
      t2[...] = w.astype(bf)
      plgpu.barrier_wait(vbar.at[0])                                 # v has arrived
      beta_v = lax.broadcast_in_dim(plgpu.load(b_s, layout=_L.WGMMA.reduce(1)), (c, vd), [0])
      v_hi, v_lo = split_bf(beta_v * tile(v_s))
      x1[...] = v_hi
      t3[...] = v_lo
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(t2, w_ref.at[ch, h])
      (u,) = _mm(split3(m1, m2, x1, t3, vd))                           # u = T beta v
      g_s[...] = u
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(g_s, u_ref.at[ch, h])
      plgpu.wait_smem_to_gmem(0)

  sw_k, sw_c = _swizzled(bf, kd), _swizzled(bf, c)
  bf_k = lambda: plgpu.SMEM((c, kd), bf, transforms=sw_k)
  bf_c = lambda: plgpu.SMEM((c, c), bf, transforms=sw_c)
  scratch = {
      "x1": bf_k(),
      "x2": plgpu.RefUnion(bf_k(), (bf_c(), bf_c())),
      "x3": plgpu.RefUnion(bf_k(), plgpu.SMEM((c, c), f32), (bf_c(), bf_c())),
      "x4": plgpu.RefUnion(bf_k(), bf_c(), (bf_c(), bf_c())),
      "x5": plgpu.RefUnion(plgpu.SMEM((c, kd), f32, transforms=_swizzled(f32, kd)),
                           (bf_k(), bf_k()), plgpu.SMEM((c, kd), f32)),
      "v_f32": (plgpu.SMEM((c, vd), f32, transforms=_swizzled(f32, vd)) if v_own else None),
      "gr_s": plgpu.SMEM((8, kd), f32),
      "b_s": plgpu.SMEM((c,), f32),
      "gl_s": plgpu.SMEM((kd,), f32),
      "bar": plgpu.Barrier(num_arrivals=4 + (0 if raw_g else len(ref_rows)), num_barriers=1),
      "vbar": plgpu.Barrier(num_arrivals=1, num_barriers=1),
  }
  out_type = (jax.ShapeDtypeStruct((nct, hv, c, kd), bf),     # w
              jax.ShapeDtypeStruct((nct, hv, c, kd), bf),     # qg
              jax.ShapeDtypeStruct((nct, hv, c, kd), bf),     # kg
              jax.ShapeDtypeStruct((nct, hv, c, vd), f32),    # u
              jax.ShapeDtypeStruct((nct, hv, c, c), bf),      # a_qk
              jax.ShapeDtypeStruct((nct, hv, kd), f32))       # exp(G_last)
  call = plgpu.kernel(
      kda_intra, out_type=out_type, scratch_types=scratch,
      grid=(hv, nct), grid_names=("h", "c"),
      compiler_params=hand_synced(approx_math=True),
      **interpret_kwargs(interpret))
  return call(qn, kn, v, decay, beta_t)


def _intra_inputs(q, k, v, g, beta, *, interpret):
  """Chunk-layout inputs (as `_intra`, but q / k may have fewer heads than v; v bf16 or f32) ->
  the operands of `_intra_call`: bf16 q / k, v as given, then `_chunk_decays`."""
  return (q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v) + _chunk_decays(g, beta, interpret=interpret)


def _cumsum_in_kernel(kd):
  """Whether the intra-chunk kernel takes the chunk-local cumsum of g itself: at K = 128, one
  column per thread of its warpgroup (saves `chunk_cumsum`'s pass over g)."""
  return kd == CUMSUM_COLS


def _chunk_decays(g, beta, *, interpret):
  """g [NC,C,HV,K], beta [NC,C,HV] f32 -> the intra-chunk kernel's decay input and beta
  head-major [NC,HV,C]: all the prefill computes before that kernel. The decay input is g
  itself where the kernel takes the cumsum (`_cumsum_in_kernel`), else the chunk-local cumsum
  (`chunk_cumsum` where HV*K fills its 128-column groups, XLA's otherwise)."""
  if _cumsum_in_kernel(g.shape[-1]):
    gam = g
  elif cumsum_kernel_supported(g):
    gam = chunk_cumsum(g, interpret=interpret)
  else:
    gam = jnp.cumsum(g, axis=1)
  return gam, jnp.swapaxes(beta, 1, 2)


_SCAN_STAGES = 3           # prefill scan: chunks whose operands are loaded or in flight at once
# prefill scan: V tiles of a head that share their operand loads (one CTA each, multicast).
# H200, T = 32K, K = 128, same process: H = 32 2.10 -> 2.06 ms, H = 64 3.85 -> 3.63 ms; all
# four V tiles of a head (H = 32) 2.52 ms, clusters of four such CTAs are not all resident at
# once; at K = 64 pairs were 1 % slower, so not there
_SCAN_CLUSTER = 2
_SMEM_BYTES = SMEM_PER_CTA - 1024   # the scan's buffers: all a CTA may use, less its barriers


@functools.partial(jax.jit, static_argnames=("out_dtype", "num_ckpt", "vt", "interpret"))
def _scan_call(w, qg, kg, u, a, gl, cs, ncs, init, ck_row, *, out_dtype, num_ckpt, vt,
               interpret):
  """Stages 3-4 (Mosaic GPU): sequential chunk scan + output, one CTA per (V tile, head,
  sequence).

  w, qg, kg [NC,HV,C,K] bf16; u [NC,HV,C,V] f32; a [NC,HV,C,C] bf16; gl [NC,HV,K] f32;
  cs, ncs [N] int32 (first chunk, chunk count of each sequence); init [N,HV,K,V] f32 or
  None; ck_row [NC] int32 or None: the row of the checkpoint output that takes the state
  after chunk c, -1 for none; vt the V tile (`_scan_v_tile`). Returns o [NC,C,HV,V]
  (out_dtype; rows of unused chunk slots are unwritten), final [N,HV,K,V] f32 and, when
  ck_row is given, checkpoints [max(num_ckpt, 1),HV,K,V] f32 (rows no chunk names are
  unwritten). The operands of up to `_SCAN_STAGES` chunks are loaded or in flight at once
  (three fit in shared memory at 32-wide V tiles: 1.2 % faster at K = 64, T = 32K, H = 32,
  within the noise at K = 128; two at 64-wide tiles). The step waits on its loads (L2
  bandwidth: 128 CTAs take in ~6 TB/s), hence `_SCAN_CLUSTER`.
  """
  nct, hv, c, kd = w.shape
  vd = u.shape[-1]
  n = cs.shape[0]
  f32, bf = jnp.float32, jnp.bfloat16
  has_init = init is not None
  has_ck = ck_row is not None

  def kda_scan(*refs, w_smem, qg_smem, kg_smem, a_smem, u_smem, gl_smem, s_smem, vn_smem,
               o_smem, sf_smem, bar, ibar, free):
    refs = list(refs)
    w_ref, qg_ref, kg_ref, u_ref, a_ref, gl_ref, cs_ref, nc_ref = refs[:8]
    refs = refs[8:]
    init_ref = refs.pop(0) if has_init else None
    row_ref = refs.pop(0) if has_ck else None
    o_ref, fin_ref = refs[0], refs[1]
    ck_ref = refs[2] if has_ck else None
    j = lax.axis_index("vt") * pair + (lax.axis_index("pair") if pair > 1 else 0)
    h = lax.axis_index("h")
    sq = lax.axis_index("n")
    cols = pl.ds(j * vt, vt)
    c0 = cs_ref[sq]
    nch = nc_ref[sq]

    def issue(i, slot):
      ch = c0 + i
      b = bar.at[slot]
      for src, dst in ((w_ref, w_smem), (qg_ref, qg_smem), (kg_ref, kg_smem), (a_ref, a_smem)):
        plgpu.copy_gmem_to_smem(src.at[ch, h], dst.at[slot], b, collective_axes=shared)
      plgpu.copy_gmem_to_smem(u_ref.at[ch, h, :, cols], u_smem.at[slot], b)
      plgpu.copy_gmem_to_smem(gl_ref.at[ch, h], gl_smem.at[slot], b)

    for i in range(stages - 1):                  # the ring's first chunks

      @pl.when(i < nch)
      def _():
        issue(i, i)

    if has_init:
      plgpu.copy_gmem_to_smem(init_ref.at[sq, h, :, cols], sf_smem, ibar.at[0])
      plgpu.barrier_wait(ibar.at[0])
      s0 = plgpu.load(sf_smem, layout=_L.WGMMA)
    else:
      s0 = plgpu.layout_cast(jnp.zeros((kd, vt), f32), _L.WGMMA)

    def step(i, s):
      slot = lax.rem(i, stages)

      @pl.when(i + stages - 1 < nch)      # into the slot of chunk i - 1, whose reads are done
      def _():
        if shared:                        # in every CTA of the cluster

          @pl.when(i >= 1)
          def _():
            plgpu.barrier_wait(free.at[lax.rem(i - 1, stages)])

        issue(i + stages - 1, lax.rem(i + stages - 1, stages))

      plgpu.barrier_wait(bar.at[slot])
      s_smem[...] = s.astype(bf)
      plgpu.commit_smem()

      def products(acc_ws, acc_o, acc_kv):
        # The state's chain is S -> W S -> v_new -> Kg^T v_new -> S; the output's products
        # (Qg S, A v_new, summed in one accumulator) are issued behind the chain's and waited
        # for last
        plgpu.wgmma(acc_ws, w_smem.at[slot], s_smem)                   # W S      [C,Vt]
        plgpu.wgmma(acc_o, qg_smem.at[slot], s_smem)                   # Qg S     [C,Vt]
        vn = (plgpu.load(u_smem.at[slot], layout=_L.WGMMA)
              - plgpu.wgmma_accumulator_load(acc_ws, wait_n=1))        # v_new    [C,Vt]
        vn_smem[...] = vn.astype(bf)
        plgpu.commit_smem()
        plgpu.wgmma(acc_kv, kg_smem.at[slot].transpose((1, 0)), vn_smem)   # Kg^T v_new
        plgpu.wgmma(acc_o, a_smem.at[slot], vn_smem)                   # + A v_new
        kv = plgpu.wgmma_accumulator_load(acc_kv, wait_n=1)
        glv = plgpu.load(gl_smem.at[slot], layout=_L.WGMMA.reduce(1))
        return s * lax.broadcast_in_dim(glv, (kd, vt), [0]) + kv, acc_o[...]

      s, o = pl.run_scoped(products, plgpu.ACC((c, vt), f32), plgpu.ACC((c, vt), f32),
                           plgpu.ACC((kd, vt), f32))
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      o_smem[...] = o.astype(out_dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem, o_ref.at[c0 + i, :, h, cols])
      if shared:

        @pl.when(i + stages < nch)        # this CTA has read the slot that chunk i + stages takes
        def _():
          plgpu.barrier_arrive(free.at[slot])

      if has_ck:
        row = row_ref[c0 + i]

        @pl.when(row >= 0)
        def _():
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          sf_smem[...] = s
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(sf_smem, ck_ref.at[row, h, :, cols])
      return s

    s = lax.fori_loop(0, nch, step, s0)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    sf_smem[...] = s
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(sf_smem, fin_ref.at[sq, h, :, cols])
    plgpu.wait_smem_to_gmem(0)

  # chunks in flight: as many as fit in shared memory, at least two
  per_chunk = 3 * c * kd * 2 + c * c * 2 + c * vt * 4 + kd * 4      # w, qg, kg, a, u, gl
  fixed = kd * vt * 2 + c * vt * 2 + c * vt * jnp.dtype(out_dtype).itemsize + kd * vt * 4
  stages = max(2, min(_SCAN_STAGES, (_SMEM_BYTES - fixed) // per_chunk))
  # at K = 128, pairs of a head's V tiles form clusters: each CTA loads half of the operands
  # both read (w, qg, kg, A) and multicasts it; `free` tells both CTAs when both have read a slot
  pair = _SCAN_CLUSTER if kd >= 128 and (vd // vt) % _SCAN_CLUSTER == 0 else 1
  shared = ("pair",) if pair > 1 else None
  sw = vt * 2                             # bf16 bytes of the narrowest operand row (<= 128)
  sw_k, sw_c, sw_v = _swizzled(bf, kd, sw), _swizzled(bf, c, sw), _swizzled(bf, vt)
  scratch = {
      "w_smem": plgpu.SMEM((stages, c, kd), bf, transforms=sw_k),
      "qg_smem": plgpu.SMEM((stages, c, kd), bf, transforms=sw_k),
      "kg_smem": plgpu.SMEM((stages, c, kd), bf, transforms=sw_k),
      "a_smem": plgpu.SMEM((stages, c, c), bf, transforms=sw_c),
      "u_smem": plgpu.SMEM((stages, c, vt), f32, transforms=_swizzled(f32, vt)),
      "gl_smem": plgpu.SMEM((stages, kd), f32),
      "s_smem": plgpu.SMEM((kd, vt), bf, transforms=sw_v),
      "vn_smem": plgpu.SMEM((c, vt), bf, transforms=sw_v),
      "o_smem": plgpu.SMEM((c, vt), out_dtype, transforms=_swizzled(out_dtype, vt)),
      "sf_smem": plgpu.SMEM((kd, vt), f32, transforms=_swizzled(f32, vt)),
      "bar": plgpu.Barrier(num_arrivals=6, num_barriers=stages),
      "ibar": plgpu.Barrier(num_arrivals=1, num_barriers=1),
      "free": plgpu.ClusterBarrier(collective_axes=shared, num_barriers=stages) if shared else None,
  }
  out_type = [jax.ShapeDtypeStruct((nct, c, hv, vd), out_dtype),
              jax.ShapeDtypeStruct((n, hv, kd, vd), f32)]
  if has_ck:
    out_type.append(jax.ShapeDtypeStruct((max(num_ckpt, 1), hv, kd, vd), f32))
  args = [w, qg, kg, u, a, gl, cs, ncs]
  if has_init:
    args.append(init)
  if has_ck:
    args.append(ck_row)
  call = plgpu.kernel(
      kda_scan, out_type=tuple(out_type), scratch_types=scratch,
      grid=(vd // vt // pair, hv, n), grid_names=("vt", "h", "n"),
      cluster=(pair,) if shared else (), cluster_names=shared or (),
      compiler_params=hand_synced(approx_math=False),
      **interpret_kwargs(interpret))
  return call(*args)


def chunk_kda_pallas(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None,
                     output_final_state=False, use_qk_l2norm=False, checkpoint_every=None,
                     interpret=False, intra="pallas"):
  """Chunked prefill; arguments and returns as `chunk_kda` (validated there).

  intra="pallas" runs stages 1-2 on the tensor cores (`_intra_call`); intra="xla" runs the
  jnp version (`_intra`), kept for comparison and as a fallback.
  """
  if intra not in ("pallas", "xla"):
    raise ValueError(f"intra must be 'pallas' or 'xla', got {intra!r}")
  check_kernel_dims(q.shape[-1], v.shape[-1])
  b, t, _, kd = q.shape
  hv, vd = v.shape[2], v.shape[3]
  c = CHUNK
  # bf16 q / k (the models' case) are normalised, scaled and GVA-mapped inside the intra-chunk
  # kernel; other dtypes are normalised in fp32 first, so that they are rounded to bf16 once
  in_kernel = intra == "pallas" and q.dtype == k.dtype == jnp.bfloat16
  if in_kernel:
    qf, kf = q, k
    qk_prep = dict(scale=qk_scale(scale, kd), l2norm=use_qk_l2norm)
  else:
    qf, kf = prepare_qk(q, k, scale=scale, use_qk_l2norm=use_qk_l2norm, hv=hv)
    qk_prep = {}
  vf = v if (v.dtype == jnp.bfloat16 and intra == "pallas") else v.astype(jnp.float32)
  gf, bf = g.astype(jnp.float32), beta.astype(jnp.float32)
  every = checkpoint_every
  if cu_seqlens is None:
    n = b
    ncl = -(-t // c)
    pad = ncl * c - t

    def to_chunks(x):
      x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) if pad else x
      return x.reshape((b * ncl, c) + x.shape[2:])

    cs = jnp.arange(n, dtype=jnp.int32) * ncl
    ncs = jnp.full((n,), ncl, jnp.int32)
    lens = jnp.full((n,), t, jnp.int32)
    cu = jnp.arange(n + 1, dtype=jnp.int32) * t             # the lanes as packed sequences
    slot = jnp.arange(n * ncl, dtype=jnp.int32)
    seq, pos = slot // ncl, slot % ncl
    out_idx = None
  else:
    n = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.astype(jnp.int32)
    nct = t // c + n
    seq, pos, start, valid = _chunk_table(cu, nct, c)
    tok = start[:, None] + jnp.arange(c)[None, :]
    ok = jnp.arange(c)[None, :] < valid[:, None]
    tok_c = jnp.clip(tok, 0, max(t - 1, 0))

    def to_chunks(x):
      y = x[0][tok_c]
      return jnp.where(ok.reshape(ok.shape + (1,) * (y.ndim - 2)), y, 0.0)

    lens = cu[1:] - cu[:-1]
    ncs = ((lens + c - 1) // c).astype(jnp.int32)
    cs = (jnp.cumsum(ncs) - ncs).astype(jnp.int32)
    out_idx = jnp.where(ok, tok, t).reshape(-1)
  chunks = tuple(map(to_chunks, (qf, kf, vf, gf, bf)))
  if intra == "pallas":
    w, qg, kg, u, a, gl = _intra_call(*_intra_inputs(*chunks, interpret=interpret),
                                      interpret=interpret, **qk_prep)
  else:
    w, qg, kg, u, a, gl = _intra(*chunks)
  init = None if initial_state is None else initial_state.astype(jnp.float32)
  num_ckpt, rows, ck_row = 0, 0, None     # rows: of the kernel's checkpoint output
  if every:
    per = lens // every
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(per)]).astype(jnp.int32)
    num_ckpt = t // every if cu_seqlens is not None else b * (t // every)
    seq_c = jnp.minimum(seq, n - 1)
    done = (pos + 1) * c                           # tokens of its sequence after chunk slot
    real = (seq < n) & (done <= lens[seq_c])
    if every % c == 0:                             # the chunk ends are the checkpoints
      ck_row = jnp.where(real & (done % every == 0), offsets[seq_c] + done // every - 1, -1)
      rows = num_ckpt
    else:                                          # chunk ends that a checkpoint starts from
      first = -(-done // every) * every
      need = real & (first < done + c) & (first <= lens[seq_c])
      ck_row = jnp.where(need, jnp.cumsum(need) - 1, -1)
      rows = min(seq.shape[0], num_ckpt)
    ck_row = ck_row.astype(jnp.int32)
  outs = _scan_call(w, qg, kg, u, a, gl, cs, ncs, init, ck_row, out_dtype=v.dtype,
                    num_ckpt=rows, vt=_scan_v_tile(n, hv, vd), interpret=interpret)
  oc, final = outs[0], outs[1]
  if out_idx is None:
    o = oc.reshape(b, -1, hv, vd)[:, :t]
  else:
    o = jnp.zeros((t, hv, vd), v.dtype).at[out_idx].set(
        oc.reshape(-1, hv, vd), mode="drop")[None]
  final = final if output_final_state else None
  if every and every % c == 0:
    used = jnp.arange(num_ckpt)[:, None, None, None] < offsets[-1]
    states = jnp.where(used, outs[2][:num_ckpt], 0.0)                # unused rows: zeros
    return o, final, KDACheckpoints(states, offsets)
  if every:
    kp = prepare_qk(k, k, scale=scale, use_qk_l2norm=use_qk_l2norm, hv=hv)[1]
    flat = lambda x: x.reshape((-1,) + x.shape[2:]).astype(jnp.float32)
    states = checkpoints_from_boundaries(
        outs[2], ck_row, cs, jnp.zeros((n, hv, kd, vd), jnp.float32) if init is None else init,
        flat(kp), flat(v), flat(g), flat(beta), cu, offsets, every, num_ckpt)
    return o, final, KDACheckpoints(states, offsets)
  return o, final
