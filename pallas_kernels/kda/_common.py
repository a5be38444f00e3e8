"""Argument checks and input preparation shared by the KDA reference and kernels.

Every public KDA function validates its arguments here *before* any device work, so a
bad call fails with a ``ValueError`` that says what to change (DESIGN rule 6). Values of
``cu_seqlens`` and ``slots`` can only be checked when they are concrete (NumPy arrays,
Python lists or committed, non-traced jax arrays); inside ``jax.jit`` they are traced and
the caller (the engine's host-side validation) is responsible for them.

Shape letters: B batch, T tokens, H q/k heads, HV value heads (HV % H == 0, "GVA"),
K key dim, V value dim, N sequences, S state-pool slots.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

L2NORM_EPS = 1e-6  # fla's l2norm: x * rsqrt(sum(x^2) + eps)


class KDACheckpoints(NamedTuple):
  """States published every ``checkpoint_every`` tokens of each sequence by ``chunk_kda``.

  states  [M, HV, K, V] fp32: rows offsets[n] .. offsets[n+1]-1 belong to sequence n; row
          offsets[n] + m holds the state after the first (m+1)*checkpoint_every tokens of n.
          M = T // every when cu_seqlens is given (an upper bound of sum_n len_n // every;
          unused trailing rows are zeros), B * (T // every) otherwise.
  offsets [N+1] int32, offsets[0] == 0, offsets[n+1] - offsets[n] == len_n // every.
  """
  states: jax.Array
  offsets: jax.Array


def concrete(x):
  """NumPy value of x when it is concrete, else None (x is traced under jit)."""
  if x is None:
    return None
  if isinstance(x, jax.core.Tracer):
    return None
  try:
    return np.asarray(x)
  except Exception:  # noqa: BLE001 - anything not convertible is treated as traced
    return None


def as_array(x):
  """x as a jax array (NumPy arrays and Python lists too, with JAX's canonical dtype: a
  float64 NumPy array is float32 unless x64 is enabled); None stays None, tracers pass."""
  return None if x is None else jnp.asarray(x)


def check_slots(slots, n: int, s: int) -> None:
  """slots: an integer [N] array; when concrete, every value in [0, S) and no real (non-zero)
  slot shared by two rows (slot 0 is the dummy that padding rows share)."""
  if slots is None:
    raise ValueError(f"slots must be an integer [N={n}] array, got None")
  if slots.shape != (n,) or not jnp.issubdtype(slots.dtype, jnp.integer):
    raise ValueError(f"slots must be an integer [N={n}] array, got {slots.shape} {slots.dtype}")
  sl = concrete(slots)
  if sl is not None:
    if np.any(sl < 0) or np.any(sl >= s):
      raise ValueError(f"slots must lie in [0, S={s}); got {sl.tolist()} "
                       "(padding rows use the dummy slot 0, never -1)")
    real = sl[sl != 0]
    if len(np.unique(real)) != len(real):
      raise ValueError(f"two rows share a real (non-zero) slot: {sl.tolist()}")


def check_pool(state_pool, tail: tuple[int, int, int] | None = None) -> int:
  """state_pool: fp32 [S, HV, K, V] (``tail`` = (HV, K, V) when known) with S >= 2; returns S."""
  if state_pool.ndim != 4 or (tail is not None and state_pool.shape[1:] != tail):
    want = "[S, HV, K, V]" if tail is None else f"[S, {tail[0]}, {tail[1]}, {tail[2]}]"
    raise ValueError(f"state_pool must be {want}, got {state_pool.shape}")
  if state_pool.dtype != jnp.float32:
    raise ValueError(f"state_pool must be float32 (recurrent state math is fp32), "
                     f"got {state_pool.dtype}")
  if state_pool.shape[0] < 2:
    raise ValueError(f"state_pool needs slot 0 (dummy) plus at least one real slot, "
                     f"got S={state_pool.shape[0]}")
  return state_pool.shape[0]


def check_commit_args(state_pool, slots, states, num_accepted) -> None:
  """Validates kda_commit's arguments: states [N, Ts, HV, K, V] matching the pool, slots as for
  decode, num_accepted an integer [N] array, each value in [0, Ts] when concrete."""
  s = check_pool(state_pool)
  if states.ndim != 5 or states.shape[2:] != state_pool.shape[1:]:
    raise ValueError(f"states must be [N, Ts, {', '.join(map(str, state_pool.shape[1:]))}], "
                     f"got {states.shape}")
  check_floats(states=states)
  n, ts = states.shape[:2]
  check_slots(slots, n, s)
  if num_accepted.shape != (n,) or not jnp.issubdtype(num_accepted.dtype, jnp.integer):
    raise ValueError(f"num_accepted must be an integer [N={n}] array, got {num_accepted.shape} "
                     f"{num_accepted.dtype}")
  acc = concrete(num_accepted)
  if acc is not None and (np.any(acc < 0) or np.any(acc > ts)):
    raise ValueError(f"num_accepted must lie in [0, Ts={ts}] (it counts the window's first "
                     f"token), got {acc.tolist()}")


def check_floats(**arrays) -> None:
  """Token inputs and states must be floating point (any width: g, beta and states narrower
  than fp32 are widened to fp32 losslessly, as fla does; an integer array is a caller's
  mistake, not a decay)."""
  for name, x in arrays.items():
    if x is not None and not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must be a floating-point array, got {x.dtype}")


def check_head_dims(h: int, hv: int, kd: int, vd: int) -> None:
  """Heads and head dims must be non-empty (an empty one has no recurrence to run)."""
  if min(h, hv, kd, vd) < 1:
    raise ValueError(f"q/k heads H, value heads HV, K and V must all be >= 1, got H={h}, "
                     f"HV={hv}, K={kd}, V={vd}")


def check_chunk_args(q, k, v, g, beta, initial_state, cu_seqlens, checkpoint_every,
                     chunk_size):
  """Validates chunk_kda's arguments; returns (B, T, H, HV, K, V, N)."""
  for name, x, rank in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 4), ("beta", beta, 3)):
    if x.ndim != rank:
      raise ValueError(f"{name} must have rank {rank}, got shape {x.shape}")
  check_floats(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
  b, t, h, kd = q.shape
  if k.shape != q.shape:
    raise ValueError(f"k must have q's shape {q.shape} [B, T, H, K], got {k.shape}")
  if v.shape[:2] != (b, t):
    raise ValueError(f"v must be [B={b}, T={t}, HV, V], got {v.shape}")
  hv, vd = v.shape[2], v.shape[3]
  check_head_dims(h, hv, kd, vd)
  if hv % h:
    raise ValueError(f"value heads HV={hv} must be a multiple of q/k heads H={h}")
  if g.shape != (b, t, hv, kd):
    raise ValueError(f"g must be [B, T, HV, K] = {(b, t, hv, kd)}, got {g.shape}")
  if beta.shape != (b, t, hv):
    raise ValueError(f"beta must be [B, T, HV] = {(b, t, hv)}, got {beta.shape}")
  if cu_seqlens is None:
    n = b
  else:
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
      raise ValueError(f"cu_seqlens must be [N+1] with N >= 1, got shape {cu_seqlens.shape}")
    if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
      raise ValueError(f"cu_seqlens must be an integer array, got {cu_seqlens.dtype}")
    if b != 1:
      raise ValueError(f"with cu_seqlens the sequences are packed: B must be 1, got B={b}")
    n = cu_seqlens.shape[0] - 1
    cu = concrete(cu_seqlens)
    if cu is not None:
      cu = cu.astype(np.int64)                  # unsigned differences would wrap, not go < 0
      if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}")
      if np.any(np.diff(cu) < 0):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu.tolist()}")
      if cu[-1] != t:
        raise ValueError(f"cu_seqlens must end at T={t}, got {cu[-1]}")
  if initial_state is not None and initial_state.shape != (n, hv, kd, vd):
    raise ValueError(f"initial_state must be [N, HV, K, V] = {(n, hv, kd, vd)}, "
                     f"got {initial_state.shape}")
  if checkpoint_every is not None and (
      not isinstance(checkpoint_every, (int, np.integer)) or isinstance(checkpoint_every, bool)
      or checkpoint_every <= 0):
    raise ValueError(f"checkpoint_every must be a positive int (a multiple of the chunk, "
                     f"{chunk_size}, is the fastest), got {checkpoint_every!r}")
  return b, t, h, hv, kd, vd, n


def check_step_args(q, k, v, g, beta, state_pool, slots, reset, *, tokens_axis):
  """Validates kda_decode (tokens_axis=False) / kda_verify (True) arguments.

  Returns (N, Tspec, H, HV, K, V, S); Tspec is 1 for decode.
  """
  lead = 2 if tokens_axis else 1
  form = "[N, T, " if tokens_axis else "[N, "
  for name, x, rank in (("q", q, lead + 2), ("k", k, lead + 2), ("v", v, lead + 2),
                        ("g", g, lead + 2), ("beta", beta, lead + 1)):
    if x.ndim != rank:
      raise ValueError(f"{name} must have rank {rank} ({form}...]), got shape {x.shape}")
  check_floats(q=q, k=k, v=v, g=g, beta=beta)
  n, h, kd = q.shape[0], q.shape[-2], q.shape[-1]
  ts = q.shape[1] if tokens_axis else 1
  if k.shape != q.shape:
    raise ValueError(f"k must have q's shape {q.shape}, got {k.shape}")
  if v.shape[:lead] != q.shape[:lead]:
    raise ValueError(f"v must be {form}HV, V], got {v.shape}")
  hv, vd = v.shape[-2], v.shape[-1]
  check_head_dims(h, hv, kd, vd)
  if hv % h:
    raise ValueError(f"value heads HV={hv} must be a multiple of q/k heads H={h}")
  if g.shape != q.shape[:lead] + (hv, kd):
    raise ValueError(f"g must be {form}HV, K] = {q.shape[:lead] + (hv, kd)}, got {g.shape}")
  if beta.shape != q.shape[:lead] + (hv,):
    raise ValueError(f"beta must be {form}HV] = {q.shape[:lead] + (hv,)}, got {beta.shape}")
  s = check_pool(state_pool, (hv, kd, vd))
  check_slots(slots, n, s)
  if reset is not None and (reset.shape != (n,) or reset.dtype != jnp.bool_):
    raise ValueError(f"reset must be a bool [N={n}] array, got {reset.shape} {reset.dtype}")
  return n, ts, h, hv, kd, vd, s


def l2norm(x):
  """fla's l2norm over the last axis, in fp32: x * rsqrt(sum(x^2) + 1e-6)."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def qk_scale(scale, kd: int) -> float:
  """The scale applied to q: `scale`, or 1/sqrt(K) when None (fla's default)."""
  return 1.0 / math.sqrt(kd) if scale is None else float(scale)


def prepare_qk(q, k, *, scale, use_qk_l2norm, hv):
  """fp32 q*scale and k (optionally l2-normalised), heads repeated up to HV (GVA).

  q, k [..., H, K] -> [..., HV, K] fp32; value head j reads q/k head j // (HV // H).
  """
  scale = qk_scale(scale, q.shape[-1])
  q = q.astype(jnp.float32)
  k = k.astype(jnp.float32)
  if use_qk_l2norm:
    q, k = l2norm(q), l2norm(k)
  q = q * scale
  rep = hv // q.shape[-2]
  if rep > 1:
    q = jnp.repeat(q, rep, axis=-2)
    k = jnp.repeat(k, rep, axis=-2)
  return q, k
