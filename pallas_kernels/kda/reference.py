"""Pure-jnp KDA (Kimi Delta Attention): the ``backend="xla"`` implementation.

Recurrence per (sequence, value head), state S in R^{K x V}, fp32 (fla's convention):

    S_t- = Diag(exp(g_t)) S_{t-1}                 g_t in R^K, log-space decay (<= 0)
    v'_t = beta_t (v_t - S_t-^T k_t)
    S_t  = S_t- + k_t v'_t^T
    o_t  = S_t^T q_t                               q pre-multiplied by scale (K^-1/2)

Prefill (`chunk_kda_reference`) uses the chunked WY form with chunks of C = 64 tokens;
Gamma = in-chunk cumsum of g, D_ij = exp(Gamma_i - Gamma_j) for j <= i (per channel):

    A_kk[i,j] = beta_i sum_d k_i k_j D_ij  (j < i)     T = (I + A_kk)^-1 Diag(beta)
    w = T (exp(Gamma) * k)    u = T v                   v_new = u - w S0
    A_qk[i,j] = sum_d q_i k_j D_ij (j <= i)
    o = (q * exp(Gamma)) S0 + A_qk v_new
    S1 = Diag(exp(Gamma_last)) S0 + (exp(Gamma_last - Gamma) * k)^T v_new

The per-channel factor D_ij is formed explicitly as a [C, C, K] tensor with the exponent
masked to <= 0, so no exp ever overflows for any g <= 0 (no safe-gate assumption). This is
deliberately a different formulation from the Pallas kernel (16-token sub-chunks with
reference offsets) and from the oracle (per-token loop), so the three check each other.

Varlen: sequences are laid out in C-aligned chunks (a static upper bound of
T // C + N chunks), padded with identity tokens (k = v = q = 0, g = 0, beta = 0) that leave
the state unchanged; one `lax.scan` walks the chunks and restarts the state at each
sequence's first chunk. All matmuls run at HIGHEST precision in fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ._common import KDACheckpoints, prepare_qk

CHUNK = 64
_HI = lax.Precision.HIGHEST


def _chunk_table(cu, num_chunks, chunk):
  """Static-size chunk layout for packed sequences.

  cu [N+1] int32 cumulative lengths. Returns, per chunk slot c < num_chunks:
    seq [NC] sequence id (N for unused slots), pos [NC] chunk index within its sequence,
    start [NC] first token, valid [NC] number of real tokens (0 for unused slots).
  """
  n = cu.shape[0] - 1
  lens = cu[1:] - cu[:-1]
  nchunks = (lens + chunk - 1) // chunk                           # [N]
  ends = jnp.cumsum(nchunks)                                      # [N]
  starts = ends - nchunks
  c = jnp.arange(num_chunks, dtype=jnp.int32)
  seq = jnp.searchsorted(ends, c, side="right").astype(jnp.int32)  # [NC], N when unused
  seq_c = jnp.minimum(seq, n - 1)
  pos = c - starts[seq_c]
  start = cu[seq_c] + pos * chunk
  valid = jnp.where(seq < n, jnp.clip(lens[seq_c] - pos * chunk, 0, chunk), 0)
  return seq, pos, start, valid


def _chunk_step(s0, q, k, v, g, beta, at=None):
  """One chunk for all heads. s0 [H,K,V]; q,k,g [C,H,K]; v [C,H,V]; beta [C,H].

  Returns (o [C,H,V], s1 [H,K,V]) and, when `at` [P] int32 (each in 1..C) is given, also the
  states after the chunk's first at[p] tokens [P,H,K,V].
  """
  c = q.shape[0]
  gam = jnp.cumsum(g, axis=0)                                     # [C,H,K]
  diff = gam[:, None] - gam[None, :]                               # [i,j,H,K]
  ii = jnp.arange(c)
  lower_eq = (ii[:, None] >= ii[None, :])[:, :, None, None]
  strict = (ii[:, None] > ii[None, :])[:, :, None]
  dec = jnp.exp(jnp.where(lower_eq, diff, -jnp.inf))              # 0 above the diagonal
  a_kk = jnp.einsum("ihd,jhd,ijhd->hij", k, k, dec, precision=_HI)
  a_kk = jnp.where(strict.transpose(2, 0, 1), a_kk, 0.0) * beta.T[:, :, None]
  a_qk = jnp.einsum("ihd,jhd,ijhd->hij", q, k, dec, precision=_HI)
  eye = jnp.eye(c, dtype=jnp.float32)
  # T = (I + A_kk)^-1 Diag(beta): unit-lower-triangular solve, batched over heads.
  t_mat = jax.scipy.linalg.solve_triangular(
      eye + a_kk, jnp.broadcast_to(eye, a_kk.shape) * beta.T[:, None, :],
      lower=True, unit_diagonal=True)                             # [H,C,C]
  eg = jnp.exp(gam)                                               # [C,H,K]
  w = jnp.einsum("hij,jhd->hid", t_mat, eg * k, precision=_HI)    # [H,C,K]
  u = jnp.einsum("hij,jhv->hiv", t_mat, v, precision=_HI)         # [H,C,V]
  v_new = u - jnp.einsum("hik,hkv->hiv", w, s0, precision=_HI)
  o = (jnp.einsum("ihk,hkv->ihv", q * eg, s0, precision=_HI)
       + jnp.einsum("hij,hjv->ihv", a_qk, v_new, precision=_HI))
  s1 = _state_after(s0, k, gam, v_new, c)
  if at is None:
    return o, s1
  return o, s1, jax.vmap(lambda r: _state_after(s0, k, gam, v_new, r))(at)


def _state_after(s0, k, gam, v_new, r):
  """The state after the chunk's first r tokens (1 <= r <= C): the end-of-chunk update
  restricted to tokens j < r, decayed to token r - 1 (v_new of a token depends only on the
  tokens before it). s0 [H,K,V]; k, gam [C,H,K]; v_new [H,C,V]; r a scalar. Returns [H,K,V].
  """
  last = gam[r - 1]                                               # [H,K]
  before = (jnp.arange(k.shape[0]) < r)[:, None, None]
  kdec = jnp.where(before, jnp.exp(jnp.where(before, last[None] - gam, 0.0)) * k, 0.0)
  return (jnp.exp(last)[:, :, None] * s0
          + jnp.einsum("jhk,hjv->hkv", kdec, v_new, precision=_HI))


def _lane(q, k, v, g, beta, cu, init, num_chunks, every, num_ckpt):
  """One packed lane: q,k,g [T,H,K], v [T,H,V], beta [T,H], cu [N+1], init [N,H,K,V].

  Returns o [T,H,V] fp32, final [N,H,K,V], ckpt [num_ckpt,H,K,V] (or None), ckpt offsets.
  """
  t = q.shape[0]
  n = cu.shape[0] - 1
  seq, pos, start, valid = _chunk_table(cu, num_chunks, CHUNK)
  tok = start[:, None] + jnp.arange(CHUNK)[None, :]               # [NC,C]
  ok = jnp.arange(CHUNK)[None, :] < valid[:, None]
  tok_c = jnp.clip(tok, 0, max(t - 1, 0))

  def gather(x):
    y = x[tok_c]                                                  # [NC,C,...]
    return jnp.where(ok.reshape(ok.shape + (1,) * (y.ndim - 2)), y, 0.0)

  qc, kc, vc, gc, bc = map(gather, (q, k, v, g, beta))
  lens = cu[1:] - cu[:-1]
  nchunks = (lens + CHUNK - 1) // CHUNK
  last_chunk = jnp.cumsum(nchunks) - 1                            # [N]
  seq_c = jnp.minimum(seq, n - 1)
  is_last = (seq < n) & (jnp.arange(num_chunks) == last_chunk[seq_c])
  fin_idx = jnp.where(is_last, seq, n)                            # n -> dropped
  if every is not None:
    per = lens // every
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(per).astype(jnp.int32)])
    # a chunk holds at most ceil(C / every) checkpoints: numbers m (1-based) of its sequence,
    # each at r = m * every - (tokens before the chunk) of the chunk's tokens
    m = (pos * CHUNK // every + 1)[:, None] + jnp.arange(-(-CHUNK // every))[None, :]
    ck_r = m * every - (pos * CHUNK)[:, None]                     # [NC,P] >= 1
    is_ck = (seq < n)[:, None] & (ck_r <= valid[:, None])
    ck_idx = jnp.where(is_ck, offsets[seq_c][:, None] + m - 1, num_ckpt)
    ck_r = jnp.minimum(ck_r, CHUNK)
  else:
    offsets = None
    ck_idx = ck_r = jnp.zeros((num_chunks, 1), jnp.int32)
  final0 = init
  ckpt0 = jnp.zeros((num_ckpt,) + init.shape[1:], jnp.float32) if every is not None else None

  def body(carry, xs):
    s, final, ckpt = carry
    qi, ki, vi, gi, bi, pi, si, fi, ci, ri = xs
    s = jnp.where(pi == 0, init[jnp.minimum(si, n - 1)], s)       # a sequence's first chunk
    if ckpt is None:
      o, s = _chunk_step(s, qi, ki, vi, gi, bi)
    else:
      o, s, s_at = _chunk_step(s, qi, ki, vi, gi, bi, at=ri)
      ckpt = ckpt.at[ci].set(s_at, mode="drop")
    final = final.at[fi].set(s, mode="drop")
    return (s, final, ckpt), o

  s_init = jnp.zeros(init.shape[1:], jnp.float32)
  (_, final, ckpt), oc = lax.scan(
      body, (s_init, final0, ckpt0), (qc, kc, vc, gc, bc, pos, seq, fin_idx, ck_idx, ck_r))
  out_idx = jnp.where(ok, tok, t)                                 # t -> dropped
  o = jnp.zeros((t,) + v.shape[1:], jnp.float32).at[out_idx.reshape(-1)].set(
      oc.reshape((-1,) + v.shape[1:]), mode="drop")
  return o, final, ckpt, offsets


def checkpoints_from_boundaries(boundary, boundary_row, first_chunk, init, k, v, g, beta, cu,
                                offsets, every, num_ckpt):
  """Checkpoints after every `every` tokens (any every) from states at chunk boundaries.

  Checkpoint m of sequence n (the state after p = (m+1) * every tokens) is the state at the
  boundary a = (p // C) * C advanced by the r = p - a < C tokens after it: one fp32 chunk step
  with the tokens from r on masked to identity (k = v = g = beta = 0 leave a state unchanged).
  The state at a is init[n] for a = 0, else boundary[boundary_row[first_chunk[n] + a/C - 1]].
  Used by the Pallas prefill, whose kernel publishes states at chunk ends only.

  boundary [A,HV,K,V] f32; boundary_row [NC] int32 (the boundary row of the state after chunk
  slot c); first_chunk [N] int32 (each sequence's first chunk slot); init [N,HV,K,V] f32;
  k [T,HV,K] f32 prepared (l2-normalised as asked, mapped to value heads); v [T,HV,V];
  g [T,HV,K]; beta [T,HV] (f32); cu [N+1] int32 token offsets; offsets [N+1] int32 as in
  `KDACheckpoints`. Returns [num_ckpt,HV,K,V] f32, rows past offsets[N] zeros. The chunk
  steps run one after another (`lax.map`), so the transient memory is one chunk step's.
  """
  n, t = cu.shape[0] - 1, k.shape[0]
  rows = jnp.arange(num_ckpt, dtype=jnp.int32)
  seq = jnp.minimum(jnp.searchsorted(offsets[1:], rows, side="right"), n - 1).astype(jnp.int32)
  p = (rows - offsets[seq] + 1) * every
  a = p // CHUNK * CHUNK
  brow = boundary_row[jnp.maximum(first_chunk[seq] + a // CHUNK - 1, 0)]
  j = jnp.arange(CHUNK)

  def one(xs):
    sq, a_, p_, br, row = xs
    s0 = jnp.where(a_ == 0, init[sq], boundary[jnp.maximum(br, 0)])
    ok = j < p_ - a_
    tok = jnp.clip(cu[sq] + a_ + j, 0, max(t - 1, 0))
    kc, vc, gc, bc = (jnp.where(ok.reshape((CHUNK,) + (1,) * (x.ndim - 1)), x[tok], 0.0)
                      for x in (k, v, g, beta))
    s1 = _chunk_step(s0, jnp.zeros_like(kc), kc, vc, gc, bc)[1]
    return jnp.where(row < offsets[-1], s1, 0.0)

  return lax.map(one, (seq, a, p, brow, rows))


def chunk_kda_reference(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None,
                        output_final_state=False, use_qk_l2norm=False, checkpoint_every=None):
  """Chunked KDA prefill in pure jnp (fp32 math). Arguments as `chunk_kda` (validated there).

  q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K] fp32 log decay; beta [B,T,HV];
  initial_state [N,HV,K,V] fp32 or None (zeros); cu_seqlens [N+1] int32 or None.
  Returns (o [B,T,HV,V] in v.dtype, final_state [N,HV,K,V] fp32 or None) and, when
  checkpoint_every is set, a third element `KDACheckpoints`.
  """
  b, t, _, _ = q.shape
  hv, vd = v.shape[2], v.shape[3]
  kd = q.shape[3]
  if t == 0:                              # nothing to scan: final states are the initial ones
    n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final = (jnp.zeros((n, hv, kd, vd), jnp.float32) if initial_state is None
             else initial_state.astype(jnp.float32))
    out = (jnp.zeros(v.shape, v.dtype), final if output_final_state else None)
    if checkpoint_every:
      out += (KDACheckpoints(jnp.zeros((0, hv, kd, vd), jnp.float32),
                             jnp.zeros((n + 1,), jnp.int32)),)
    return out
  qf, kf = prepare_qk(q, k, scale=scale, use_qk_l2norm=use_qk_l2norm, hv=hv)
  vf, gf, bf = v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32)
  every = checkpoint_every
  if cu_seqlens is None:
    n = b
    init = (jnp.zeros((n, hv, kd, vd), jnp.float32) if initial_state is None
            else initial_state.astype(jnp.float32))
    cu = jnp.array([0, t], jnp.int32)
    nck = t // every if every else 0
    lane = lambda q_, k_, v_, g_, b_, i_: _lane(
        q_, k_, v_, g_, b_, cu, i_[None], -(-t // CHUNK), every, nck)
    o, final, ckpt, _ = jax.vmap(lane)(qf, kf, vf, gf, bf, init)
    final = final[:, 0]
    if every:
      ckpt = KDACheckpoints(ckpt.reshape((b * nck, hv, kd, vd)),
                            jnp.arange(b + 1, dtype=jnp.int32) * nck)
  else:
    n = cu_seqlens.shape[0] - 1
    init = (jnp.zeros((n, hv, kd, vd), jnp.float32) if initial_state is None
            else initial_state.astype(jnp.float32))
    cu = cu_seqlens.astype(jnp.int32)
    nck = t // every if every else 0
    o, final, ckpt, offs = _lane(qf[0], kf[0], vf[0], gf[0], bf[0], cu, init,
                                 t // CHUNK + n, every, nck)
    o = o[None]
    if every:
      ckpt = KDACheckpoints(ckpt, offs)
  o = o.astype(v.dtype)
  final = final if output_final_state else None
  if every:
    return o, final, ckpt
  return o, final


def _token_step(s, q, k, v, g, beta):
  """One token for a batch of states. s [...,K,V]; q,k,g [...,K]; v [...,V]; beta [...].

  Returns (o [...,V], s_new). Exactly the recurrence in the module docstring.
  """
  s = jnp.exp(g)[..., :, None] * s
  kv = jnp.einsum("...k,...kv->...v", k, s, precision=_HI)
  vn = beta[..., None] * (v - kv)
  s = s + k[..., :, None] * vn[..., None, :]
  o = jnp.einsum("...k,...kv->...v", q, s, precision=_HI)
  return o, s


def kda_decode_reference(q, k, v, g, beta, state_pool, slots, *, scale=None,
                         use_qk_l2norm=False, reset=None):
  """One token per row from pool slots; returns (o [N,HV,V] in v.dtype, new pool).

  Rows with reset[n] start from a zero state (a reused slot's first token). Writes every
  row's new state to state_pool[slots[n]]; padding rows share the dummy slot 0.
  """
  hv = v.shape[1]
  qf, kf = prepare_qk(q, k, scale=scale, use_qk_l2norm=use_qk_l2norm, hv=hv)
  s = state_pool[slots]
  if reset is not None:
    s = jnp.where(reset[:, None, None, None], 0.0, s)
  o, s = _token_step(s, qf, kf, v.astype(jnp.float32), g.astype(jnp.float32),
                     beta.astype(jnp.float32))
  return o.astype(v.dtype), state_pool.at[slots].set(s)


def kda_verify_reference(q, k, v, g, beta, state_pool, slots, *, scale=None,
                         use_qk_l2norm=False, reset=None):
  """Tspec draft tokens per row from pool slots, pool untouched.

  q, k [N,Ts,H,K]; v [N,Ts,HV,V]; g [N,Ts,HV,K]; beta [N,Ts,HV].
  Returns (o [N,Ts,HV,V] in v.dtype, states [N,Ts,HV,K,V] fp32) where states[:, i] is the
  state after token i; `kda_commit` writes the one after the accepted prefix.
  """
  hv = v.shape[2]
  qf, kf = prepare_qk(q, k, scale=scale, use_qk_l2norm=use_qk_l2norm, hv=hv)
  s = state_pool[slots]
  if reset is not None:
    s = jnp.where(reset[:, None, None, None], 0.0, s)

  def body(s, xs):
    o, s = _token_step(s, *xs)
    return s, (o, s)

  xs = tuple(jnp.swapaxes(x, 0, 1) for x in
             (qf, kf, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32)))
  _, (o, states) = lax.scan(body, s, xs)
  return jnp.swapaxes(o, 0, 1).astype(v.dtype), jnp.swapaxes(states, 0, 1)


def kda_gate_reference(f, a_log, dt_bias, lower_bound=-5.0):
  """KDA gate in fp32. f [..., HV, K]; a_log [HV]; dt_bias [HV*K] or [HV, K].

  lower_bound set (GLM-5.3 / fla safe gate): g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)),
  so every per-step decay lies in [exp(lower_bound), 1). lower_bound None (fla default):
  g = -exp(A_log) * softplus(f + dt_bias).
  """
  hv, kd = f.shape[-2], f.shape[-1]
  x = f.astype(jnp.float32) + dt_bias.astype(jnp.float32).reshape(hv, kd)
  a = jnp.exp(a_log.astype(jnp.float32))[:, None]
  if lower_bound is None:
    return -a * jax.nn.softplus(x)
  return lower_bound * jax.nn.sigmoid(a * x)
