"""Kimi Delta Attention (KDA): chunked prefill, decode, speculative verify, gate.

fla's conventions, JAX arrays. Shape letters: B batch, T tokens, H q/k heads, HV value heads
(HV % H == 0; value head j reads q/k head j // (HV // H)), K key dim, V value dim,
N sequences, S state-pool slots, Ts speculative tokens per sequence.

    o, final = chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None,
                         cu_seqlens=None, output_final_state=False, use_qk_l2norm=False,
                         checkpoint_every=None, backend="pallas")
      q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K] fp32 log decay (<= 0); beta [B,T,HV]
      initial_state [N,HV,K,V] fp32 or None (zeros); cu_seqlens [N+1] int32 (B == 1, packed)
      (g, beta and initial_state may come in a narrower float, e.g. bf16: they are widened to
      fp32 without loss, as fla does; integer inputs are refused)
      -> o [B,T,HV,V] (v.dtype), final [N,HV,K,V] fp32 (None unless output_final_state)
      checkpoint_every=E (any positive int): returns (o, final, KDACheckpoints) with the state
      after every E tokens of each sequence (see _common.KDACheckpoints for the layout). With
      E a multiple of the 64-token chunk the Pallas kernel stores them as it goes; otherwise
      it stores the chunk ends they start from and each checkpoint adds one fp32 chunk step
      of fewer than 64 tokens in XLA, run one checkpoint after another (slower: prefer
      multiples of 64, as prefix caches of hybrid models usually align their blocks).

    o, state_pool = kda_decode(q, k, v, g, beta, state_pool, slots, *, scale=None,
                               use_qk_l2norm=False, reset=None, backend="pallas")
      one token per row: q, k [N,H,K]; v [N,HV,V]; g [N,HV,K]; beta [N,HV]
      state_pool [S,HV,K,V] fp32 (donate it: updated in place under jit); slots [N] int32,
      slot 0 is the dummy that padding rows read and write; reset [N] bool: start that row
      from a zero state (a reused slot's first token) instead of reading the slot.

    o, states = kda_verify(q, k, v, g, beta, state_pool, slots, *, ..., backend="pallas")
      Ts = 1 + K tokens per row (the last committed token t0, then K drafts; q, k [N,Ts,H,K]
      ...) from the slots' states; the pool is NOT modified. states [N,Ts,HV,K,V] fp32:
      states[:, i] is the state after token i.
    state_pool = kda_commit(state_pool, slots, states, num_accepted)
      writes states[n, num_accepted[n] - 1] to slot slots[n]: num_accepted counts t0, so it is
      n_acc + 1 for n_acc accepted drafts (at least 1 for a real row); 0 keeps the slot as it
      was (padding). verify + commit(a) == decoding those a tokens one by one.

    g = kda_gate(f, A_log, dt_bias, lower_bound=-5.0, backend="pallas")
      GLM-5.3 / fla safe gate: g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias)), fp32.

Recurrence (per sequence and value head, fp32 state S [K,V]):
    S <- Diag(exp(g_t)) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
with q, k optionally l2-normalised (eps 1e-6) and q scaled by `scale` (default K^-1/2).

Backends: "xla" is the pure-jnp chunked reference (`reference.py`, fp32, any K/V, any
g <= 0); "pallas" runs the Mosaic GPU kernels (`kernel.py`, Hopper; K = V in {64, 128}) and
raises ValueError for shapes they do not support. Pallas decode / verify are fp32 like the
reference (agreement ~1e-7); Pallas prefill uses bf16 tensor-core operands with fp32
accumulation and fp32 state, like fla (agreement ~5e-3 relative), and assumes the safe gate
(per-token g >= -5, GLM-5.3's gate; see kernel.py for the exact bound). The backend is chosen once per server, never per
call, so numerics are stable for the server's lifetime. `interpret=True` runs the Pallas
kernels in Mosaic GPU interpret mode (CPU tests). Arguments are validated before any device
work; values of cu_seqlens / slots are checked only when concrete (not traced).
"""

from __future__ import annotations

import jax.numpy as jnp

from ._common import KDACheckpoints, as_array, check_chunk_args, check_commit_args, check_step_args
from .reference import (
  CHUNK,
  chunk_kda_reference,
  kda_decode_reference,
  kda_gate_reference,
  kda_verify_reference,
)

BACKENDS = ("pallas", "xla")


def _check_backend(backend):
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None,
              output_final_state=False, use_qk_l2norm=False, checkpoint_every=None,
              backend="pallas", interpret=False):
  """Chunked KDA prefill over batched or packed (cu_seqlens) sequences; see module doc."""
  _check_backend(backend)
  q, k, v, g, beta, initial_state, cu_seqlens = map(
      as_array, (q, k, v, g, beta, initial_state, cu_seqlens))
  b, t = check_chunk_args(q, k, v, g, beta, initial_state, cu_seqlens, checkpoint_every,
                          CHUNK)[:2]
  _check_pallas_dims(backend, q, v)
  if checkpoint_every is not None:        # longer than every sequence: no checkpoints, same rows
    checkpoint_every = min(int(checkpoint_every), t + 1)
  if backend == "xla" or t == 0 or b == 0:   # no tokens: no kernel to run, the same result
    return chunk_kda_reference(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                               cu_seqlens=cu_seqlens, output_final_state=output_final_state,
                               use_qk_l2norm=use_qk_l2norm, checkpoint_every=checkpoint_every)
  from .kernel import chunk_kda_pallas
  return chunk_kda_pallas(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                          cu_seqlens=cu_seqlens, output_final_state=output_final_state,
                          use_qk_l2norm=use_qk_l2norm, checkpoint_every=checkpoint_every,
                          interpret=interpret)


def kda_decode(q, k, v, g, beta, state_pool, slots, *, scale=None, use_qk_l2norm=False,
               reset=None, backend="pallas", interpret=False):
  """One decode token per row, state read from and written to `state_pool[slots]`."""
  _check_backend(backend)
  q, k, v, g, beta, state_pool, slots, reset = map(
      as_array, (q, k, v, g, beta, state_pool, slots, reset))
  n = check_step_args(q, k, v, g, beta, state_pool, slots, reset, tokens_axis=False)[0]
  _check_pallas_dims(backend, q, v)
  if backend == "xla" or n == 0:
    return kda_decode_reference(q, k, v, g, beta, state_pool, slots, scale=scale,
                                use_qk_l2norm=use_qk_l2norm, reset=reset)
  from .kernel import kda_decode_pallas
  return kda_decode_pallas(q, k, v, g, beta, state_pool, slots, scale=scale,
                           use_qk_l2norm=use_qk_l2norm, reset=reset, interpret=interpret)


def kda_verify(q, k, v, g, beta, state_pool, slots, *, scale=None, use_qk_l2norm=False,
               reset=None, backend="pallas", interpret=False):
  """Ts speculative tokens per row from the slots' states; returns (o, per-token states)."""
  _check_backend(backend)
  q, k, v, g, beta, state_pool, slots, reset = map(
      as_array, (q, k, v, g, beta, state_pool, slots, reset))
  n, ts = check_step_args(q, k, v, g, beta, state_pool, slots, reset, tokens_axis=True)[:2]
  _check_pallas_dims(backend, q, v)
  if backend == "xla" or n == 0 or ts == 0:
    return kda_verify_reference(q, k, v, g, beta, state_pool, slots, scale=scale,
                                use_qk_l2norm=use_qk_l2norm, reset=reset)
  from .kernel import kda_verify_pallas
  return kda_verify_pallas(q, k, v, g, beta, state_pool, slots, scale=scale,
                           use_qk_l2norm=use_qk_l2norm, reset=reset, interpret=interpret)


def kda_commit(state_pool, slots, states, num_accepted):
  """Commits the state after each row's accepted prefix to its slot.

  state_pool [S,HV,K,V]; slots [N]; states [N,Ts,HV,K,V] from kda_verify; num_accepted [N]
  int in [0, Ts], counting the window's first token t0 (n_acc accepted drafts: n_acc + 1).
  Row n gets states[n, num_accepted[n] - 1]; 0 keeps the slot (padding rows).
  Padding rows use slot 0 (dummy). Pure scatter, identical for both backends. Slots and
  num_accepted are range-checked like decode's slots (when concrete).
  """
  state_pool, slots, states, num_accepted = map(as_array, (state_pool, slots, states,
                                                         num_accepted))
  check_commit_args(state_pool, slots, states, num_accepted)
  n, ts = states.shape[:2]
  if ts == 0:                             # no tokens verified: every num_accepted is 0
    return state_pool
  idx = jnp.clip(num_accepted - 1, 0, ts - 1)
  new = states[jnp.arange(n), idx]
  new = jnp.where((num_accepted > 0)[:, None, None, None], new, state_pool[slots])
  return state_pool.at[slots].set(new)


def _check_pallas_dims(backend, q, v):
  """The Pallas kernels' head-size rule, checked on every call (also those with no token to
  run), so that a backend's accepted shapes do not depend on the batch."""
  if backend == "pallas":
    from .kernel import check_kernel_dims
    check_kernel_dims(q.shape[-1], v.shape[-1])


def kda_gate(f, A_log, dt_bias, lower_bound=-5.0, *, backend="pallas"):
  """KDA decay gate (fp32 log space). f [..., HV, K]; A_log [HV]; dt_bias [HV*K] or [HV, K].

  lower_bound (GLM-5.3: -5.0): g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias));
  lower_bound=None: fla's default g = -exp(A_log) * softplus(f + dt_bias).
  Both backends run the same elementwise jnp: XLA fuses it into the f projection's
  epilogue, so a standalone Pallas kernel would only add an HBM round trip.
  """
  _check_backend(backend)
  if f.ndim < 2:
    raise ValueError(f"f must be [..., HV, K], got shape {f.shape}")
  hv, kd = f.shape[-2:]
  if A_log.shape != (hv,):
    raise ValueError(f"A_log must be [HV={hv}], got {A_log.shape}")
  if dt_bias.shape not in ((hv * kd,), (hv, kd)):
    raise ValueError(f"dt_bias must be [HV*K={hv * kd}] or [HV={hv}, K={kd}], got {dt_bias.shape}")
  if lower_bound is not None and not lower_bound < 0:
    raise ValueError(f"lower_bound must be negative (or None), got {lower_bound}")
  return kda_gate_reference(f, A_log, dt_bias, lower_bound)


def pallas_supports(key_dim: int, value_dim: int) -> bool:
  """Whether the Pallas kernels take this head size (K == V in {64, 128})."""
  from .kernel import SUPPORTED_DIMS
  return key_dim == value_dim and key_dim in SUPPORTED_DIMS


__all__ = [
  "BACKENDS",
  "CHUNK",
  "KDACheckpoints",
  "chunk_kda",
  "kda_commit",
  "kda_decode",
  "kda_gate",
  "kda_verify",
  "pallas_supports",
]
