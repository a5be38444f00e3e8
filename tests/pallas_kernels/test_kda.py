"""KDA reference (backend="xla") against the per-token NumPy oracle, plus API contracts.

Covers: o and final state for K = V = 64 and 128; varlen lengths {1, 15, 16, 63, 64, 65, 200}
(and a zero-length sequence); initial state given and absent; bf16 and fp32 inputs; GVA;
checkpoints; prefill of T then decode of k tokens == prefill of T + k; verify + commit of an
accepted prefix == decoding that prefix; slot isolation (dummy slot 0, reset of a reused
slot); the GLM gate (lower_bound -5); argument errors. Kernel tests live in
test_kda_kernel.py and reuse `make_inputs` / `rel_err` from here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import chunk_kda, kda_commit, kda_decode, kda_gate, kda_verify
from pallas_kernels.kda.oracle import kda_gate_oracle, kda_oracle, kda_steps_oracle

LENS = (1, 15, 16, 63, 64, 65, 200)


def make_inputs(*, b=1, t=32, h=2, hv=None, kd=64, vd=64, seed=0, dtype=jnp.float32,
                lead=None):
  """Random KDA inputs with a realistic GLM safe gate (g in (-5, 0)) and beta in (0, 1).

  lead overrides the leading dims (default (b, t)); returns jnp arrays q, k, v, g, beta with
  q, k, v in `dtype`, g and beta fp32.
  """
  hv = hv or h
  lead = (b, t) if lead is None else tuple(lead)
  rng = np.random.default_rng(seed)
  q = rng.standard_normal(lead + (h, kd)).astype(np.float32)
  k = rng.standard_normal(lead + (h, kd)).astype(np.float32)
  v = rng.standard_normal(lead + (hv, vd)).astype(np.float32)
  g = -5.0 / (1.0 + np.exp(-rng.standard_normal(lead + (hv, kd)) - 1.0))
  beta = 1.0 / (1.0 + np.exp(-rng.standard_normal(lead + (hv,))))
  return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
          jnp.asarray(g, jnp.float32), jnp.asarray(beta, jnp.float32))


def rand_state(n, hv, kd, vd, seed=1):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((n, hv, kd, vd)) * 0.5,
                     jnp.float32)


def rel_err(a, b):
  a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
  assert np.all(np.isfinite(a)), "non-finite values"
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def cu_of(lens):
  return jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))


# ------------------------------------------------------------------- reference vs oracle


@pytest.mark.parametrize("kd", [64, 128])
@pytest.mark.parametrize("with_init", [True, False])
def test_varlen_reference_matches_oracle(kd, with_init):
  lens = LENS
  t = sum(lens)
  q, k, v, g, beta = make_inputs(t=t, h=2, kd=kd, vd=kd, seed=kd + with_init)
  init = rand_state(len(lens), 2, kd, kd) if with_init else None
  cu = cu_of(lens)
  o, fin = chunk_kda(q, k, v, g, beta, initial_state=init, cu_seqlens=cu,
                     output_final_state=True, use_qk_l2norm=True, backend="xla")
  oo, ff, _ = kda_oracle(q, k, v, g, beta, initial_state=init, cu_seqlens=cu,
                         use_qk_l2norm=True, dtype=np.float64)
  assert o.shape == v.shape and o.dtype == v.dtype
  assert fin.shape == (len(lens), 2, kd, kd) and fin.dtype == jnp.float32
  assert rel_err(o, oo) < 1e-5
  assert rel_err(fin, ff) < 1e-5
  # each sequence separately, too (varlen must not leak state across sequences)
  for i in (0, 3, 6):
    s, e = int(cu[i]), int(cu[i + 1])
    o1, f1, _ = kda_oracle(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e],
                           initial_state=None if init is None else init[i:i + 1],
                           use_qk_l2norm=True, dtype=np.float64)
    assert rel_err(o[:, s:e], o1) < 1e-5
    assert rel_err(fin[i:i + 1], f1) < 1e-5


def test_batched_bf16_gva_reference_matches_oracle():
  """B = 2 fixed-length lanes, bf16 q/k/v, 2 value heads per q/k head, no l2norm, T not a
  multiple of the chunk."""
  q, k, v, g, beta = make_inputs(b=2, t=100, h=1, hv=2, kd=64, vd=64, dtype=jnp.bfloat16)
  init = rand_state(2, 2, 64, 64)
  o, fin = chunk_kda(q, k, v, g, beta, initial_state=init, output_final_state=True,
                     scale=0.1, backend="xla")
  oo, ff, _ = kda_oracle(q, k, v, g, beta, initial_state=init, scale=0.1, dtype=np.float64)
  assert o.dtype == jnp.bfloat16
  assert rel_err(o, oo) < 1e-2          # bf16 output rounding
  assert rel_err(fin, ff) < 1e-5        # state stays fp32 from the same bf16 inputs


def test_default_gate_without_safe_bound_is_finite():
  """Very negative log decays (fla's default gate, no lower bound) must not overflow."""
  q, k, v, _, beta = make_inputs(t=80, kd=64, vd=64)
  g = jnp.full(q.shape[:3] + (64,), -30.0, jnp.float32).at[:, ::7].set(-0.01)
  o, fin = chunk_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True,
                     backend="xla")
  oo, ff, _ = kda_oracle(q, k, v, g, beta, use_qk_l2norm=True, dtype=np.float64)
  assert rel_err(o, oo) < 1e-5 and rel_err(fin, ff) < 1e-5


def test_zero_length_sequence_keeps_initial_state():
  lens = (5, 0, 70)
  q, k, v, g, beta = make_inputs(t=75, kd=64, vd=64)
  init = rand_state(3, 2, 64, 64)
  o, fin = chunk_kda(q, k, v, g, beta, initial_state=init, cu_seqlens=cu_of(lens),
                     output_final_state=True, backend="xla")
  oo, ff, _ = kda_oracle(q, k, v, g, beta, initial_state=init, cu_seqlens=cu_of(lens),
                         dtype=np.float64)
  np.testing.assert_array_equal(np.asarray(fin[1]), np.asarray(init[1]))
  assert rel_err(o, oo) < 1e-5 and rel_err(fin, ff) < 1e-5


def test_checkpoints_match_oracle():
  lens = (200, 63, 130)
  q, k, v, g, beta = make_inputs(t=sum(lens), kd=64, vd=64, seed=3)
  init = rand_state(3, 2, 64, 64)
  _o, _fin, ck = chunk_kda(q, k, v, g, beta, initial_state=init, cu_seqlens=cu_of(lens),
                         output_final_state=True, checkpoint_every=64, backend="xla")
  _, _, cc = kda_oracle(q, k, v, g, beta, initial_state=init, cu_seqlens=cu_of(lens),
                        checkpoint_every=64, dtype=np.float64)
  np.testing.assert_array_equal(np.asarray(ck.offsets), [0, 3, 3, 5])
  assert ck.states.shape == (sum(lens) // 64, 2, 64, 64)
  want = np.stack([s for per in cc for s in per])
  assert rel_err(ck.states[:5], want) < 1e-5
  # batched lanes: B * (T // every) rows, offsets n * (T // every)
  q, k, v, g, beta = make_inputs(b=2, t=128, kd=64, vd=64, seed=4)
  _, _, ck = chunk_kda(q, k, v, g, beta, checkpoint_every=64, backend="xla")
  _, _, cc = kda_oracle(q, k, v, g, beta, checkpoint_every=64, dtype=np.float64)
  np.testing.assert_array_equal(np.asarray(ck.offsets), [0, 2, 4])
  assert rel_err(ck.states, np.stack([s for per in cc for s in per])) < 1e-5


@pytest.mark.parametrize("every", [1, 16, 48, 65, 100, 130, 500])
def test_checkpoints_at_any_interval_match_oracle(every):
  """Intervals that are not a multiple of the 64-token chunk put checkpoints inside chunks
  (several a chunk below 64, none at all when longer than every sequence)."""
  lens = (200, 63, 130, 1, 0, 65)
  q, k, v, g, beta = make_inputs(t=sum(lens), kd=64, vd=64, seed=5)
  init = rand_state(len(lens), 2, 64, 64)
  _, _, ck = chunk_kda(q, k, v, g, beta, initial_state=init, cu_seqlens=cu_of(lens),
                       checkpoint_every=every, backend="xla")
  _, _, cc = kda_oracle(q, k, v, g, beta, initial_state=init, cu_seqlens=cu_of(lens),
                        checkpoint_every=every, dtype=np.float64)
  per = [len(c) for c in cc]
  assert per == [n // every for n in lens]
  np.testing.assert_array_equal(np.asarray(ck.offsets), np.cumsum([0] + per))
  assert ck.states.shape == (sum(lens) // every, 2, 64, 64)
  if sum(per):
    assert rel_err(ck.states[:sum(per)], np.stack([s for c in cc for s in c])) < 1e-5
  np.testing.assert_array_equal(np.asarray(ck.states[sum(per):]), 0.0)


def test_jit_with_traced_cu_seqlens():
  lens = (40, 90)
  q, k, v, g, beta = make_inputs(t=130, kd=64, vd=64)
  f = jax.jit(lambda *a: chunk_kda(*a[:5], cu_seqlens=a[5], output_final_state=True,
                                   backend="xla"))
  o, fin = f(q, k, v, g, beta, cu_of(lens))
  oo, ff, _ = kda_oracle(q, k, v, g, beta, cu_seqlens=cu_of(lens), dtype=np.float64)
  assert rel_err(o, oo) < 1e-5 and rel_err(fin, ff) < 1e-5


# ------------------------------------------------------------- decode / verify / commit


def _pool(s, hv, kd, vd, seed=7):
  return rand_state(s, hv, kd, vd, seed)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_prefill_then_decode_equals_longer_prefill(dtype):
  """Prefill T tokens, write the final state into a slot, decode k more tokens one at a time
  from the pool: outputs and the slot's state equal a prefill of T + k."""
  tp, kk = 70, 3
  q, k, v, g, beta = make_inputs(t=tp + kk, kd=64, vd=64, dtype=dtype, seed=11)
  o_full, f_full = chunk_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True,
                             backend="xla")
  _, f_pre = chunk_kda(q[:, :tp], k[:, :tp], v[:, :tp], g[:, :tp], beta[:, :tp],
                       output_final_state=True, use_qk_l2norm=True, backend="xla")
  pool = _pool(4, 2, 64, 64).at[2].set(f_pre[0])
  slots = jnp.array([2], jnp.int32)
  outs = []
  for i in range(tp, tp + kk):
    o, pool = kda_decode(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], pool, slots,
                         use_qk_l2norm=True, backend="xla")
    outs.append(o)
  tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
  assert rel_err(jnp.stack(outs, 1), o_full[:, tp:]) < tol
  assert rel_err(pool[2], f_full[0]) < 1e-5


def test_decode_matches_oracle_and_slot_isolation():
  """Rows 0 and 3 are padding on the dummy slot 0; row 2 resets a reused slot. Slots not
  named by a real row are bit-identical afterwards; the reset row equals a zero start."""
  n = 4
  q, k, v, g, beta = make_inputs(lead=(n,), h=2, kd=64, vd=64, seed=5)
  pool = _pool(6, 2, 64, 64)
  slots = jnp.array([0, 4, 1, 0], jnp.int32)
  reset = jnp.array([False, False, True, False])
  o, new = kda_decode(q, k, v, g, beta, pool, slots, reset=reset, use_qk_l2norm=True,
                      backend="xla")
  init = np.asarray(pool)[np.asarray(slots)].copy()
  init[2] = 0.0
  oo, ss = kda_steps_oracle(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                            init, use_qk_l2norm=True, dtype=np.float64)
  assert rel_err(o[1:3], oo[1:3, 0]) < 1e-5
  assert rel_err(new[4], ss[1, 0]) < 1e-5
  assert rel_err(new[1], ss[2, 0]) < 1e-5
  for s in (2, 3, 5):
    np.testing.assert_array_equal(np.asarray(new[s]), np.asarray(pool[s]))


def test_verify_commit_equals_decoding_prefix():
  n, ts = 3, 4
  q, k, v, g, beta = make_inputs(lead=(n, ts), h=1, hv=2, kd=64, vd=64, seed=9)
  pool = _pool(5, 2, 64, 64)
  slots = jnp.array([3, 0, 1], jnp.int32)      # row 1 is padding
  o, states = kda_verify(q, k, v, g, beta, pool, slots, use_qk_l2norm=True, backend="xla")
  assert states.shape == (n, ts, 2, 64, 64)
  init = np.asarray(pool)[np.asarray(slots)]
  oo, ss = kda_steps_oracle(q, k, v, g, beta, init, use_qk_l2norm=True, dtype=np.float64)
  assert rel_err(o, oo) < 1e-5 and rel_err(states, ss) < 1e-5
  accepted = jnp.array([2, 4, 0], jnp.int32)
  committed = kda_commit(pool, slots, states, accepted)
  # decode the accepted prefix token by token
  dec = pool
  for i in range(2):
    row = jnp.array([3], jnp.int32)
    _, dec = kda_decode(q[:1, i], k[:1, i], v[:1, i], g[:1, i], beta[:1, i], dec, row,
                        use_qk_l2norm=True, backend="xla")
  assert rel_err(committed[3], dec[3]) < 1e-6
  np.testing.assert_array_equal(np.asarray(committed[1]), np.asarray(pool[1]))  # 0 accepted
  for s in (2, 4):
    np.testing.assert_array_equal(np.asarray(committed[s]), np.asarray(pool[s]))


# ------------------------------------------------------------------------------ gate


def test_glm_gate_lower_bound():
  rng = np.random.default_rng(0)
  f = jnp.asarray(rng.standard_normal((3, 5, 4, 16)) * 4, jnp.bfloat16)
  a_log = jnp.asarray(rng.standard_normal(4), jnp.float32)
  dt = jnp.asarray(rng.standard_normal(64), jnp.float32)
  gg = kda_gate(f, a_log, dt, lower_bound=-5.0, backend="xla")
  assert gg.dtype == jnp.float32 and gg.shape == f.shape
  assert float(gg.min()) >= -5.0 and float(gg.max()) <= 0.0
  np.testing.assert_allclose(np.asarray(gg), kda_gate_oracle(f, a_log, dt, -5.0),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(kda_gate(f, a_log, dt, backend="pallas")),
                             kda_gate_oracle(f, a_log, dt, -5.0), rtol=1e-5, atol=1e-6)
  gd = kda_gate(f, a_log, dt.reshape(4, 16), lower_bound=None, backend="xla")
  np.testing.assert_allclose(np.asarray(gd), kda_gate_oracle(f, a_log, dt, None),
                             rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------- bad input


def test_bad_input_raises_before_running():
  q, k, v, g, beta = make_inputs(t=10, kd=64, vd=64)
  with pytest.raises(ValueError, match="rank 4"):
    chunk_kda(q[0], k, v, g, beta, backend="xla")
  with pytest.raises(ValueError, match="g must be"):
    chunk_kda(q, k, v, g[..., :32], beta, backend="xla")
  with pytest.raises(ValueError, match="must end at T"):
    chunk_kda(q, k, v, g, beta, cu_seqlens=cu_of((3, 4)), backend="xla")
  with pytest.raises(ValueError, match="non-decreasing"):
    chunk_kda(q, k, v, g, beta, cu_seqlens=jnp.array([0, 6, 4, 10], jnp.int32),
              backend="xla")
  with pytest.raises(ValueError, match="initial_state"):
    chunk_kda(q, k, v, g, beta, initial_state=rand_state(2, 2, 64, 64), backend="xla")
  for bad in (0, -64, 64.0, True):
    with pytest.raises(ValueError, match="checkpoint_every must be a positive int"):
      chunk_kda(q, k, v, g, beta, checkpoint_every=bad, backend="xla")
  with pytest.raises(ValueError, match="backend"):
    chunk_kda(q, k, v, g, beta, backend="cuda")
  with pytest.raises(ValueError, match="K == V in"):
    chunk_kda(*make_inputs(t=10, kd=32, vd=32), backend="pallas")
  dq, dk, dv, dg, db = make_inputs(lead=(2,), kd=64, vd=64)
  pool = _pool(3, 2, 64, 64)
  with pytest.raises(ValueError, match="slots must lie"):
    kda_decode(dq, dk, dv, dg, db, pool, jnp.array([1, 3], jnp.int32), backend="xla")
  with pytest.raises(ValueError, match="slots must lie"):
    kda_decode(dq, dk, dv, dg, db, pool, jnp.array([1, -1], jnp.int32), backend="xla")
  with pytest.raises(ValueError, match="share"):
    kda_decode(dq, dk, dv, dg, db, pool, jnp.array([1, 1], jnp.int32), backend="xla")
  with pytest.raises(ValueError, match="float32"):
    kda_decode(dq, dk, dv, dg, db, pool.astype(jnp.bfloat16), jnp.array([1, 2], jnp.int32),
               backend="xla")
  with pytest.raises(ValueError, match="slots must be an integer"):
    kda_decode(dq, dk, dv, dg, db, pool, None, backend="xla")
  with pytest.raises(ValueError, match="non-decreasing"):    # unsigned: no wrap-around
    chunk_kda(q, k, v, g, beta, cu_seqlens=np.array([0, 7, 3, 10], np.uint32), backend="xla")
  with pytest.raises(ValueError, match="must all be >= 1"):
    chunk_kda(q[:, :, :0], k[:, :, :0], v, g, beta, backend="xla")
  with pytest.raises(ValueError, match="must all be >= 1"):
    kda_decode(dq[..., :0], dk[..., :0], dv, dg[..., :0], db, pool, [1, 2], backend="xla")
  with pytest.raises(ValueError, match="K == V in"):            # also with no token to run
    chunk_kda(*make_inputs(t=0, kd=32, vd=32), backend="pallas")
  with pytest.raises(ValueError, match="lower_bound"):
    kda_gate(dg, jnp.zeros(2), jnp.zeros(128), lower_bound=1.0)
  with pytest.raises(ValueError, match="dt_bias"):
    kda_gate(dg, jnp.zeros(2), jnp.zeros((64, 2)))


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_empty_batches_and_host_inputs(backend):
  """No tokens or no rows give empty outputs and untouched states on both backends (packed
  prefill of empty sequences, decode / verify of no rows, verify of no tokens); NumPy arrays
  and lists are taken like jax arrays; a checkpoint interval past int32 gives no checkpoints."""
  run = dict(backend=backend, interpret=backend == "pallas")
  init = rand_state(2, 2, 64, 64)
  o, fin, ck = chunk_kda(*make_inputs(t=0, kd=64, vd=64), cu_seqlens=[0, 0, 0],
                         initial_state=init, output_final_state=True, checkpoint_every=3, **run)
  assert o.shape == (1, 0, 2, 64) and ck.states.shape == (0, 2, 64, 64)
  np.testing.assert_array_equal(np.asarray(fin), np.asarray(init))
  np.testing.assert_array_equal(np.asarray(ck.offsets), [0, 0, 0])
  assert chunk_kda(*make_inputs(b=0, t=10, kd=64, vd=64), **run)[0].shape == (0, 10, 2, 64)
  pool = _pool(3, 2, 64, 64)
  o, new = kda_decode(*make_inputs(lead=(0,), kd=64, vd=64), pool, np.zeros(0, np.int32), **run)
  assert o.shape == (0, 2, 64)
  np.testing.assert_array_equal(np.asarray(new), np.asarray(pool))
  o, st = kda_verify(*make_inputs(lead=(2, 0), kd=64, vd=64), pool, [1, 2], **run)
  assert o.shape == (2, 0, 2, 64) and st.shape == (2, 0, 2, 64, 64)
  np.testing.assert_array_equal(np.asarray(kda_commit(pool, [1, 2], st, [0, 0])),
                                np.asarray(pool))
  assert kda_verify(*make_inputs(lead=(0, 3), kd=64, vd=64), pool, np.zeros(0, np.int32),
                    **run)[1].shape == (0, 3, 2, 64, 64)
  dq, dk, dv, dg, db = make_inputs(lead=(2,), kd=64, vd=64)
  o_np, pool_np = kda_decode(*(np.asarray(x) for x in (dq, dk, dv, dg, db)), np.asarray(pool),
                             [1, 2], **run)
  o_j, pool_j = kda_decode(dq, dk, dv, dg, db, pool, jnp.array([1, 2], jnp.int32), **run)
  np.testing.assert_array_equal(np.asarray(o_np), np.asarray(o_j))
  np.testing.assert_array_equal(np.asarray(pool_np), np.asarray(pool_j))
  if backend == "xla":
    q, k, v, g, beta = make_inputs(t=10, kd=64, vd=64)
    _, _, ck = chunk_kda(q, k, v, g, beta, checkpoint_every=2 ** 40, **run)
    assert ck.states.shape[0] == 0
    np.testing.assert_array_equal(np.asarray(ck.offsets), [0, 0])


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_bad_step_and_commit_input_raises_before_running(backend):
  """Both backends validate before any work: cu_seqlens must start at 0, decode / verify slots
  and reset masks, and kda_commit's pool, states, slots and accepted counts."""
  run = dict(backend=backend, interpret=backend == "pallas")
  q, k, v, g, beta = make_inputs(t=10, kd=64, vd=64)
  with pytest.raises(ValueError, match="start at 0"):
    chunk_kda(q, k, v, g, beta, cu_seqlens=jnp.array([2, 10], jnp.int32), **run)
  dq, dk, dv, dg, db = make_inputs(lead=(2,), kd=64, vd=64)
  pool = _pool(3, 2, 64, 64)
  with pytest.raises(ValueError, match="reset must be a bool"):
    kda_decode(dq, dk, dv, dg, db, pool, [1, 2], reset=jnp.array([0.5, 0.0]), **run)
  vq, vk, vv, vg, vb = make_inputs(lead=(2, 3), kd=64, vd=64)
  with pytest.raises(ValueError, match="slots must lie"):
    kda_verify(vq, vk, vv, vg, vb, pool, [1, 3], **run)
  with pytest.raises(ValueError, match="v must be"):
    kda_verify(vq, vk, vv[:, :2], vg, vb, pool, [1, 2], **run)
  _, states = kda_verify(vq, vk, vv, vg, vb, pool, [1, 2], backend="xla")
  for slots, acc, match in (([1, 7], [1, 1], "slots must lie"), ([1, 1], [1, 2], "share"),
                            ([1, 2], [4, 1], "num_accepted must lie"),
                            ([1, 2], [-1, 1], "num_accepted must lie"),
                            ([1, 2], jnp.array([1.0, 1.0]), "num_accepted must be an integer")):
    with pytest.raises(ValueError, match=match):
      kda_commit(pool, slots, states, acc)
  with pytest.raises(ValueError, match="states must be"):
    kda_commit(pool, [1, 2], states.reshape(-1), [1, 1])
  with pytest.raises(ValueError, match="float32"):
    kda_commit(pool.astype(jnp.bfloat16), [1, 2], states, [1, 1])


def test_narrow_float_gates_and_states_are_widened_and_integers_refused():
  """g, beta and initial_state in bf16 give what their values widened to fp32 give (fla's
  behaviour: nothing is lost by the widening); integer token inputs or states (also those
  handed to kda_commit) are refused."""
  q, k, v, g, beta = make_inputs(t=20, kd=64, vd=64)
  gb, bb, sb = g.astype(jnp.bfloat16), beta.astype(jnp.bfloat16), rand_state(1, 2, 64, 64).astype(jnp.bfloat16)
  o_n, f_n = chunk_kda(q, k, v, gb, bb, initial_state=sb, output_final_state=True, backend="xla")
  o_w, f_w = chunk_kda(q, k, v, gb.astype(jnp.float32), bb.astype(jnp.float32),
                       initial_state=sb.astype(jnp.float32), output_final_state=True, backend="xla")
  np.testing.assert_array_equal(np.asarray(o_n), np.asarray(o_w))
  np.testing.assert_array_equal(np.asarray(f_n), np.asarray(f_w))
  for backend in ("xla", "pallas"):
    with pytest.raises(ValueError, match="g must be a floating-point"):
      chunk_kda(q, k, v, g.astype(jnp.int32), beta, backend=backend, interpret=True)
    with pytest.raises(ValueError, match="initial_state must be a floating-point"):
      chunk_kda(q, k, v, g, beta, initial_state=jnp.zeros((1, 2, 64, 64), jnp.int32),
                backend=backend, interpret=True)
    dq, dk, dv, dg, db = make_inputs(lead=(2,), kd=64, vd=64)
    with pytest.raises(ValueError, match="q must be a floating-point"):
      kda_decode(dq.astype(jnp.int8), dk, dv, dg, db, _pool(3, 2, 64, 64), [1, 2], backend=backend,
                 interpret=True)
  with pytest.raises(ValueError, match="states must be a floating-point"):
    kda_commit(_pool(3, 2, 64, 64), [1, 2], jnp.zeros((2, 3, 2, 64, 64), jnp.int32), [1, 1])


def test_index_lists_and_empty_prompts_are_taken():
  """Python lists for cu_seqlens / slots / reset / num_accepted act as the arrays they spell, and
  T = 0 returns an empty output and the initial state on both backends (no kernel runs)."""
  q, k, v, g, beta = make_inputs(t=10, kd=64, vd=64)
  o_list, _ = chunk_kda(q, k, v, g, beta, cu_seqlens=[0, 4, 10], backend="xla")
  o_arr, _ = chunk_kda(q, k, v, g, beta, cu_seqlens=cu_of((4, 6)), backend="xla")
  np.testing.assert_array_equal(np.asarray(o_list), np.asarray(o_arr))
  dq, dk, dv, dg, db = make_inputs(lead=(2,), kd=64, vd=64)
  pool = _pool(3, 2, 64, 64)
  o1, p1 = kda_decode(dq, dk, dv, dg, db, pool, [2, 1], reset=[True, False], backend="xla")
  o2, p2 = kda_decode(dq, dk, dv, dg, db, pool, jnp.array([2, 1], jnp.int32),
                      reset=jnp.array([True, False]), backend="xla")
  np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))
  np.testing.assert_array_equal(np.asarray(p1), np.asarray(p2))
  vq, vk, vv, vg, vb = make_inputs(lead=(2, 3), kd=64, vd=64)
  _, states = kda_verify(vq, vk, vv, vg, vb, pool, [1, 2], backend="xla")
  committed = kda_commit(pool, [1, 2], states, [3, 0])
  np.testing.assert_array_equal(np.asarray(committed[1]), np.asarray(states[0, 2]))
  np.testing.assert_array_equal(np.asarray(committed[2]), np.asarray(pool[2]))
  init = rand_state(1, 2, 64, 64)
  for backend in ("xla", "pallas"):
    o, final = chunk_kda(*make_inputs(t=0, kd=64, vd=64), initial_state=init,
                         output_final_state=True, backend=backend, interpret=True)
    assert o.shape == (1, 0, 2, 64)
    np.testing.assert_array_equal(np.asarray(final), np.asarray(init))
