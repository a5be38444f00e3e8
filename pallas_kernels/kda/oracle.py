"""Slow, obviously-correct KDA oracle: a NumPy loop over tokens. Tests only.

For each sequence and value head, with state S [K, V] (fla's naive_recurrent_kda):

    q <- q / sqrt(|q|^2 + 1e-6), k likewise       (only if use_qk_l2norm)
    q <- q * scale                                 (default K^-1/2)
    S <- diag(exp(g_t)) S
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T q_t

Value head j reads q/k head j // (HV // H). Arithmetic is in `dtype` (float32 by default,
as the issue specifies; float64 for a tighter truth). Nothing here is shared with the
reference or the kernels.
"""

from __future__ import annotations

import numpy as np


def _prep(q, k, scale, use_qk_l2norm, dtype):
  q = np.asarray(q, np.float32).astype(dtype)
  k = np.asarray(k, np.float32).astype(dtype)
  if use_qk_l2norm:
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  return q * dtype(scale), k


def kda_oracle(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None,
               use_qk_l2norm=False, checkpoint_every=None, dtype=np.float32):
  """Per-token recurrence over packed or batched sequences.

  q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K]; beta [B,T,HV]; initial_state [N,HV,K,V];
  cu_seqlens [N+1] (then B == 1). Returns (o [B,T,HV,V], final [N,HV,K,V],
  ckpts: list over sequences of lists of states after every `checkpoint_every` tokens).
  """
  q, k = _prep(q, k, scale, use_qk_l2norm, dtype)
  v = np.asarray(v, np.float32).astype(dtype)
  g = np.asarray(g, np.float32).astype(dtype)
  beta = np.asarray(beta, np.float32).astype(dtype)
  b, t, h, kd = q.shape
  hv, vd = v.shape[2], v.shape[3]
  rep = hv // h
  if cu_seqlens is None:
    seqs = [(bi, 0, t) for bi in range(b)]
  else:
    cu = np.asarray(cu_seqlens)
    seqs = [(0, int(cu[i]), int(cu[i + 1])) for i in range(len(cu) - 1)]
  o = np.zeros((b, t, hv, vd), dtype)
  finals, ckpts = [], []
  for n, (bi, start, end) in enumerate(seqs):
    if initial_state is None:
      s = np.zeros((hv, kd, vd), dtype)
    else:
      s = np.asarray(initial_state[n], np.float32).astype(dtype).copy()
    mine = []
    for pos, ti in enumerate(range(start, end)):
      for j in range(hv):
        hq = j // rep
        st = s[j] * np.exp(g[bi, ti, j])[:, None]
        vn = beta[bi, ti, j] * (v[bi, ti, j] - k[bi, ti, hq] @ st)
        st = st + np.outer(k[bi, ti, hq], vn)
        o[bi, ti, j] = q[bi, ti, hq] @ st
        s[j] = st
      if checkpoint_every and (pos + 1) % checkpoint_every == 0:
        mine.append(s.copy())
    finals.append(s)
    ckpts.append(mine)
  return o, np.stack(finals), ckpts


def kda_steps_oracle(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm=False,
                     dtype=np.float32):
  """Tokens of one step group from given states: q, k [N,Ts,H,K] ... state [N,HV,K,V].

  Returns (o [N,Ts,HV,V], states [N,Ts,HV,K,V]) where states[:, i] follows token i.
  Used for decode (Ts = 1) and speculative verify.
  """
  n, _ts = q.shape[:2]
  outs, states = [], []
  for r in range(n):
    init = np.asarray(state[r:r + 1])
    o_r, _, ck = kda_oracle(q[r:r + 1], k[r:r + 1], v[r:r + 1], g[r:r + 1], beta[r:r + 1],
                            scale=scale, initial_state=init, use_qk_l2norm=use_qk_l2norm,
                            checkpoint_every=1, dtype=dtype)
    outs.append(o_r[0])
    states.append(np.stack(ck[0]))
  return np.stack(outs), np.stack(states)


def kda_gate_oracle(f, a_log, dt_bias, lower_bound=-5.0):
  """g from the raw gate f [..., HV, K] in float64 (see reference.kda_gate_reference)."""
  f = np.asarray(f, np.float64)
  hv, kd = f.shape[-2:]
  x = f + np.asarray(dt_bias, np.float64).reshape(hv, kd)
  a = np.exp(np.asarray(a_log, np.float64))[:, None]
  if lower_bound is None:
    return -a * np.log1p(np.exp(x))
  return lower_bound / (1.0 + np.exp(-a * x))
