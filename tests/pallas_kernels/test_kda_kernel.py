"""KDA Pallas kernels (Mosaic GPU interpret mode on CPU) against the reference and oracle.

Prefill (varlen {1,15,16,63,64,65,200}, batched with GVA, initial state given / absent,
checkpoints), decode (dummy slot 0, reset of a reused slot, untouched slots bit-identical,
in-place update under jit with a donated pool), verify + commit, prefill-then-decode
consistency, bf16 and fp32 inputs, K = V = 64 and 128. The kernels use bf16 tensor-core
operands for the prefill (fla does the same), so prefill tolerances are bf16-sized (2e-2
relative); decode / verify are pure fp32 and are held to 1e-5. `gpu`-marked tests compile
the kernels on an NVIDIA GPU and compare them with the reference at larger sizes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from test_kda import LENS, cu_of, make_inputs, rand_state, rel_err

from pallas_kernels.kda import chunk_kda, kda_commit, kda_decode, kda_verify, kernel
from pallas_kernels.kda.oracle import kda_oracle, kda_steps_oracle

PREFILL_TOL = 2e-2



def _interpret():
  return jax.default_backend() != "gpu"


# ------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("kd,with_init,dtype", [
    (64, True, jnp.bfloat16),
    (128, False, jnp.float32),
])
def test_chunk_kernel_varlen_matches_reference_and_oracle(kd, with_init, dtype):
  q, k, v, g, beta = make_inputs(t=sum(LENS), h=2, kd=kd, vd=kd, seed=kd, dtype=dtype)
  init = rand_state(len(LENS), 2, kd, kd) if with_init else None
  kw = {"initial_state": init, "cu_seqlens": cu_of(LENS), "output_final_state": True,
            "use_qk_l2norm": True, "checkpoint_every": 64}
  o, fin, ck = chunk_kda(q, k, v, g, beta, backend="pallas", interpret=_interpret(), **kw)
  o_x, fin_x, ck_x = chunk_kda(q, k, v, g, beta, backend="xla", **kw)
  oo, ff, cc = kda_oracle(q, k, v, g, beta, initial_state=init, cu_seqlens=cu_of(LENS),
                          use_qk_l2norm=True, checkpoint_every=64, dtype=np.float64)
  assert o.dtype == v.dtype and o.shape == v.shape
  assert rel_err(o, o_x) < PREFILL_TOL and rel_err(o, oo) < PREFILL_TOL
  assert rel_err(fin, fin_x) < PREFILL_TOL and rel_err(fin, ff) < PREFILL_TOL
  np.testing.assert_array_equal(np.asarray(ck.offsets), np.asarray(ck_x.offsets))
  want = np.stack([s for per in cc for s in per])
  assert rel_err(ck.states[:len(want)], want) < PREFILL_TOL
  np.testing.assert_array_equal(np.asarray(ck.states[len(want):]), 0.0)
  # every sequence's tokens, not just the total, must match
  cu = np.asarray(cu_of(LENS))
  for i in range(len(LENS)):
    s, e = cu[i], cu[i + 1]
    assert rel_err(o[:, s:e], oo[:, s:e]) < PREFILL_TOL, f"sequence {i} (len {e - s})"


@pytest.mark.parametrize("every", [16, 100])
def test_chunk_kernel_checkpoints_inside_chunks(every):
  """Checkpoint intervals that are not a multiple of 64: the kernel publishes the chunk ends
  the checkpoints start from (the initial state for the first chunk) and the last partial
  chunk is run in fp32; packed with an empty sequence, and batched lanes with GVA."""
  lens = (200, 63, 130, 0, 65)
  q, k, v, g, beta = make_inputs(t=sum(lens), kd=64, vd=64, seed=7, dtype=jnp.bfloat16)
  init = rand_state(len(lens), 2, 64, 64)
  kw = {"initial_state": init, "cu_seqlens": cu_of(lens), "use_qk_l2norm": True,
        "checkpoint_every": every}
  _, _, ck = chunk_kda(q, k, v, g, beta, backend="pallas", interpret=_interpret(), **kw)
  _, _, ck_x = chunk_kda(q, k, v, g, beta, backend="xla", **kw)
  _, _, cc = kda_oracle(q, k, v, g, beta, initial_state=init, cu_seqlens=cu_of(lens),
                        use_qk_l2norm=True, checkpoint_every=every, dtype=np.float64)
  want = np.stack([s for per in cc for s in per])
  np.testing.assert_array_equal(np.asarray(ck.offsets), np.asarray(ck_x.offsets))
  assert ck.states.shape == ck_x.states.shape
  assert rel_err(ck.states[:len(want)], want) < PREFILL_TOL
  np.testing.assert_array_equal(np.asarray(ck.states[len(want):]), 0.0)
  q, k, v, g, beta = make_inputs(b=2, t=130, h=1, hv=2, kd=64, vd=64, seed=8)
  _, _, ck = chunk_kda(q, k, v, g, beta, checkpoint_every=every, backend="pallas",
                       interpret=_interpret())
  _, _, cc = kda_oracle(q, k, v, g, beta, checkpoint_every=every, dtype=np.float64)
  np.testing.assert_array_equal(np.asarray(ck.offsets), [0, 130 // every, 2 * (130 // every)])
  assert rel_err(ck.states, np.stack([s for per in cc for s in per])) < PREFILL_TOL


def test_chunk_kernel_takes_float64_host_inputs():
  """NumPy float64 inputs are taken as JAX's canonical float32 (x64 off), as the reference
  takes them: the output is float32, not a float64 the kernels cannot store."""
  q, k, v, g, beta = (np.asarray(x, np.float64) for x in make_inputs(t=20, kd=64, vd=64))
  o, fin = chunk_kda(q, k, v, g, beta, output_final_state=True, backend="pallas",
                     interpret=_interpret())
  o_x, fin_x = chunk_kda(q, k, v, g, beta, output_final_state=True, backend="xla")
  assert o.dtype == o_x.dtype == jnp.float32
  assert rel_err(o, o_x) < PREFILL_TOL and rel_err(fin, fin_x) < PREFILL_TOL


def test_chunk_kernel_batched_gva_fp32():
  """B = 2 lanes, T = 130 (not a chunk multiple), 1 q/k head feeding 2 value heads."""
  q, k, v, g, beta = make_inputs(b=2, t=130, h=1, hv=2, kd=64, vd=64, seed=3)
  init = rand_state(2, 2, 64, 64)
  o, fin = chunk_kda(q, k, v, g, beta, initial_state=init, output_final_state=True,
                     backend="pallas", interpret=_interpret())
  oo, ff, _ = kda_oracle(q, k, v, g, beta, initial_state=init, dtype=np.float64)
  assert rel_err(o, oo) < PREFILL_TOL and rel_err(fin, ff) < PREFILL_TOL
  o2, none = chunk_kda(q, k, v, g, beta, initial_state=init, backend="pallas",
                       interpret=_interpret())
  assert none is None
  np.testing.assert_array_equal(np.asarray(o2), np.asarray(o))


def test_chunk_kernel_qk_prep_in_kernel_matches_xla_prep():
  """bf16 q / k are l2-normalised, scaled and mapped to their value heads (GVA) inside the
  intra-chunk kernel; the same values as fp32 are normalised by XLA first. Both paths agree to
  bf16 rounding and match the oracle."""
  q, k, v, g, beta = make_inputs(b=2, t=130, h=2, hv=4, kd=64, vd=64, seed=5, dtype=jnp.bfloat16)
  kw = dict(scale=0.3, use_qk_l2norm=True, output_final_state=True, backend="pallas",
            interpret=_interpret())
  o, fin = chunk_kda(q, k, v, g, beta, **kw)
  o32, fin32 = chunk_kda(q.astype(jnp.float32), k.astype(jnp.float32), v, g, beta, **kw)
  oo, ff, _ = kda_oracle(q, k, v, g, beta, scale=0.3, use_qk_l2norm=True, dtype=np.float64)
  assert rel_err(o, o32) < 5e-3 and rel_err(fin, fin32) < 5e-3
  assert rel_err(o, oo) < PREFILL_TOL and rel_err(fin, ff) < PREFILL_TOL


def test_chunk_kernel_scan_tile_widths_agree(monkeypatch):
  """The scan's 32-column V tiles (few CTAs) and 64-column ones give the same outputs."""
  q, k, v, g, beta = make_inputs(t=200, h=2, kd=128, vd=128, seed=9)
  init = rand_state(1, 2, 128, 128)
  run = lambda: chunk_kda(q, k, v, g, beta, initial_state=init, output_final_state=True,
                          use_qk_l2norm=True, backend="pallas", interpret=_interpret())
  assert kernel._scan_v_tile(1, 2, 128) == 32
  # one CTA per SM: 32-wide tiles only while their grid fits in one wave of the H200's 132 SMs
  assert kernel._scan_v_tile(1, 32, 128) == 32 and kernel._scan_v_tile(1, 64, 128) == 64
  narrow = run()
  monkeypatch.setattr(kernel, "_NARROW_SCAN_CTAS", 0)
  assert kernel._scan_v_tile(1, 2, 128) == 64
  wide = run()
  for a, b in zip(narrow, wide):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-6)
  oo, ff, _ = kda_oracle(q, k, v, g, beta, initial_state=init, use_qk_l2norm=True, dtype=np.float64)
  assert rel_err(wide[0], oo) < PREFILL_TOL and rel_err(wide[1], ff) < PREFILL_TOL


# -------------------------------------------------------------------------- decode


def _resident_ctas(monkeypatch, ctas):
  """The persistent decode as `ctas` CTAs in all (one SM, `ctas` per SM, either tile width)."""
  monkeypatch.setattr(kernel, "num_sms", lambda: 1)
  config = kernel._stream_config
  monkeypatch.setattr(kernel, "_stream_config", lambda *a: config(*a)[:2] + (ctas,))


@pytest.mark.parametrize("kd,dtype,wide,ctas", [(64, jnp.bfloat16, False, None),
                                                 (128, jnp.float32, False, None),
                                                 (128, jnp.bfloat16, True, None),
                                                 (64, jnp.float32, False, 3),
                                                 (128, jnp.float32, True, 2)])
def test_decode_kernel_matches_oracle_and_isolates_slots(kd, dtype, wide, ctas, monkeypatch):
  """Rows 0 and 3 pad onto dummy slot 0, row 2 resets reused slot 1. Slots no real row names
  (2, 3, 5) must be bit-identical afterwards; real rows match the fp32 oracle. wide: whole-state
  tiles instead of the default 32-column ones. ctas: the state tiles dealt to that many
  persistent CTAs instead of one CTA per tile (16 narrow tiles to 3: uneven shares; 8 whole
  states to 2; more tiles per CTA than ring slots either way)."""
  if wide:
    monkeypatch.setattr(kernel, "_WHOLE_STATE_ROWS", 0)
  if ctas:
    _resident_ctas(monkeypatch, ctas)
  n = 4
  q, k, v, g, beta = make_inputs(lead=(n,), h=1, hv=2, kd=kd, vd=kd, seed=kd, dtype=dtype)
  pool = rand_state(6, 2, kd, kd)
  pool = pool.at[1].set(jnp.nan)          # garbage in the reused slot must not leak
  slots = jnp.array([0, 4, 1, 0], jnp.int32)
  reset = jnp.array([False, False, True, False])
  o, new = kda_decode(q, k, v, g, beta, pool, slots, reset=reset, use_qk_l2norm=True,
                      backend="pallas", interpret=_interpret())
  init = np.nan_to_num(np.asarray(pool)[np.asarray(slots)])
  init[2] = 0.0
  oo, ss = kda_steps_oracle(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                            init, use_qk_l2norm=True, dtype=np.float64)
  tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5      # bf16 output rounding
  assert o.dtype == dtype
  assert rel_err(o[1:3], oo[1:3, 0]) < tol
  assert rel_err(new[4], ss[1, 0]) < 1e-5
  assert rel_err(new[1], ss[2, 0]) < 1e-5
  for s in (2, 3, 5):
    np.testing.assert_array_equal(np.asarray(new[s]), np.asarray(pool[s]))


def test_decode_kernel_in_place_under_jit():
  """The pool is donated and updated in place; results equal the xla backend's."""
  q, k, v, g, beta = make_inputs(lead=(2,), kd=64, vd=64, seed=2)
  pool = rand_state(3, 2, 64, 64)
  slots = jnp.array([2, 1], jnp.int32)
  want_o, want_pool = kda_decode(q, k, v, g, beta, pool, slots, backend="xla")
  step = jax.jit(lambda p, *a: kda_decode(*a, p, slots, backend="pallas",
                                          interpret=_interpret()), donate_argnums=0)
  o, new = step(jnp.array(pool), q, k, v, g, beta)
  assert rel_err(o, want_o) < 1e-5 and rel_err(new, want_pool) < 1e-5


def test_verify_kernel_commit_equals_decode_kernel_prefix():
  n, ts, kd = 2, 3, 64
  q, k, v, g, beta = make_inputs(lead=(n, ts), kd=kd, vd=kd, seed=8)
  pool = rand_state(4, 2, kd, kd)
  slots = jnp.array([3, 1], jnp.int32)
  o, states = kda_verify(q, k, v, g, beta, pool, slots, use_qk_l2norm=True,
                         backend="pallas", interpret=_interpret())
  oo, ss = kda_steps_oracle(q, k, v, g, beta, np.asarray(pool)[np.asarray(slots)],
                            use_qk_l2norm=True, dtype=np.float64)
  assert rel_err(o, oo) < 1e-5 and rel_err(states, ss) < 1e-5
  committed = kda_commit(pool, slots, states, jnp.array([2, 0], jnp.int32))
  dec = pool
  for i in range(2):
    _, dec = kda_decode(q[:1, i], k[:1, i], v[:1, i], g[:1, i], beta[:1, i], dec,
                        slots[:1], use_qk_l2norm=True, backend="pallas",
                        interpret=_interpret())
  assert rel_err(committed[3], dec[3]) < 1e-6
  for s in (0, 1, 2):
    np.testing.assert_array_equal(np.asarray(committed[s]), np.asarray(pool[s]))


def test_kernel_prefill_then_decode_equals_longer_prefill():
  tp, kk = 64, 2
  q, k, v, g, beta = make_inputs(t=tp + kk, kd=64, vd=64, seed=12, dtype=jnp.bfloat16)
  _, f_pre = chunk_kda(q[:, :tp], k[:, :tp], v[:, :tp], g[:, :tp], beta[:, :tp],
                       output_final_state=True, use_qk_l2norm=True, backend="pallas",
                       interpret=_interpret())
  pool = jnp.zeros((3, 2, 64, 64), jnp.float32).at[1].set(f_pre[0])
  outs = []
  for i in range(tp, tp + kk):
    o, pool = kda_decode(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], pool,
                         jnp.array([1], jnp.int32), use_qk_l2norm=True, backend="pallas",
                         interpret=_interpret())
    outs.append(o)
  oo, ff, _ = kda_oracle(q, k, v, g, beta, use_qk_l2norm=True, dtype=np.float64)
  assert rel_err(jnp.stack(outs, 1), oo[:, tp:]) < PREFILL_TOL
  assert rel_err(pool[1], ff[0]) < PREFILL_TOL


@pytest.mark.parametrize("kd", [64, 128])
def test_kernels_order_tma_traffic_without_races(kd, monkeypatch):
  """The kernels run without Pallas's automatic barriers (`hand_synced`), so their own order of
  TMA copies against shared-memory loads and stores is what keeps them correct. Mosaic GPU's
  interpreter with race detection checks that order (between TMA and warpgroups, and between
  warpgroups; not between the warps of one warpgroup, nor the tensor cores' reads): prefill
  with varlen, initial states and checkpoints, the chunk cumsum (K = 64), decode (more state
  tiles than CTAs, so the TMA ring is refilled) and verify."""
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks   # no public access
  states = []

  class Recorded(gpu_callbacks.GPURaceDetectionState):    # one per interpreted kernel
    def __init__(self, *a, **kw):
      super().__init__(*a, **kw)
      states.append(self)

  monkeypatch.setattr(gpu_callbacks, "GPURaceDetectionState", Recorded)
  _resident_ctas(monkeypatch, 1)                          # decode: ring refills in each CTA
  races = plgpu.InterpretGPUParams(detect_races=True)
  lens = [130, 15]
  q, k, v, g, beta = make_inputs(t=sum(lens), h=1, kd=kd, vd=kd, seed=3, dtype=jnp.bfloat16)
  chunk_kda(q, k, v, g, beta, initial_state=rand_state(2, 1, kd, kd), cu_seqlens=cu_of(lens),
            output_final_state=True, use_qk_l2norm=True, checkpoint_every=64,
            backend="pallas", interpret=races)
  pool, slots = rand_state(7, 1, kd, kd), jnp.array([1, 2, 3, 4, 5, 0], jnp.int32)
  kda_decode(q[0, :6], k[0, :6], v[0, :6], g[0, :6], beta[0, :6], pool, slots,
             use_qk_l2norm=True, backend="pallas", interpret=races)
  two_rows_of_3 = lambda x: x[0, :6].reshape(2, 3, *x.shape[2:])
  kda_verify(*map(two_rows_of_3, (q, k, v, g, beta)), pool, slots[:2], use_qk_l2norm=True,
             backend="pallas", interpret=races)
  assert len(states) >= 4 and not any(st.races_found for st in states)


@pytest.mark.parametrize("kd,vdtype", [(64, jnp.float32), (128, jnp.bfloat16)])
def test_prefill_kernels_lower_for_hopper(kd, vdtype):
  """The prefill kernels (intra-chunk, scan, chunk cumsum) pass Mosaic GPU's lowering for
  Hopper, which interpret mode never runs."""
  S = jax.ShapeDtypeStruct
  x = S((1, 200, 2, kd), jnp.bfloat16)
  args = (x, x, S((1, 200, 2, kd), vdtype), S((1, 200, 2, kd), jnp.float32),
          S((1, 200, 2), jnp.float32))
  for every in (None, 64, 100):           # checkpoints: chunk ends, and chunk ends + fp32 tails
    f = lambda *a, e=every: chunk_kda(*a, backend="pallas", output_final_state=True,
                                      use_qk_l2norm=True, checkpoint_every=e)
    jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


# ------------------------------------------------------------------ compiled (GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("kd", [64, 128])
def test_gpu_compiled_prefill_matches_reference(kd):
  lens = (1, 15, 16, 63, 64, 65, 200, 2048, 777)
  q, k, v, g, beta = make_inputs(t=sum(lens), h=4, kd=kd, vd=kd, seed=kd,
                                 dtype=jnp.bfloat16)
  init = rand_state(len(lens), 4, kd, kd)
  kw = {"initial_state": init, "cu_seqlens": cu_of(lens), "output_final_state": True,
            "use_qk_l2norm": True}
  o, fin = jax.jit(lambda *a: chunk_kda(*a, backend="pallas", **kw))(q, k, v, g, beta)
  o_x, fin_x = jax.jit(lambda *a: chunk_kda(*a, backend="xla", **kw))(q, k, v, g, beta)
  assert rel_err(o, o_x) < PREFILL_TOL and rel_err(fin, fin_x) < PREFILL_TOL
  for every in (256, 100):                # chunk ends; chunk ends + fp32 tails
    run = lambda b, e=every: jax.jit(lambda *a: chunk_kda(*a, backend=b, checkpoint_every=e,
                                                          **kw))(q, k, v, g, beta)[2]
    ck, ck_x = run("pallas"), run("xla")
    np.testing.assert_array_equal(np.asarray(ck.offsets), np.asarray(ck_x.offsets))
    assert rel_err(ck.states, ck_x.states) < PREFILL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("kd", [64, 128])
def test_gpu_compiled_decode_verify_match_reference(wide, kd, monkeypatch):
  if wide:
    monkeypatch.setattr(kernel, "_NARROW_STEP_ROWS", 0)
    monkeypatch.setattr(kernel, "_WHOLE_STATE_ROWS", 0)
  n, hv = 64, 8
  q, k, v, g, beta = make_inputs(lead=(n,), h=hv, kd=kd, vd=kd, seed=1)
  pool = rand_state(n + 1, hv, kd, kd)
  slots = jnp.arange(1, n + 1, dtype=jnp.int32)
  o, new = jax.jit(lambda *a: kda_decode(*a, backend="pallas"))(q, k, v, g, beta, pool, slots)
  o_x, new_x = kda_decode(q, k, v, g, beta, pool, slots, backend="xla")
  assert rel_err(o, o_x) < 1e-4 and rel_err(new, new_x) < 1e-4
  q, k, v, g, beta = make_inputs(lead=(n, 4), h=hv, kd=kd, vd=kd, seed=2)
  o, st = jax.jit(lambda *a: kda_verify(*a, backend="pallas"))(q, k, v, g, beta, pool, slots)
  o_x, st_x = kda_verify(q, k, v, g, beta, pool, slots, backend="xla")
  assert rel_err(o, o_x) < 1e-4 and rel_err(st, st_x) < 1e-4


def test_xla_intra_fallback_matches_tensor_core_intra():
  """`intra="xla"` (jnp stages 1-2 + the Pallas scan) agrees with the default Mosaic GPU
  intra-chunk kernel; both agree with the oracle."""
  from pallas_kernels.kda.kernel import chunk_kda_pallas
  q, k, v, g, beta = make_inputs(t=100, kd=64, vd=64, seed=21)
  outs = [chunk_kda_pallas(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True,
                           interpret=_interpret(), intra=mode) for mode in ("xla", "pallas")]
  oo, ff, _ = kda_oracle(q, k, v, g, beta, use_qk_l2norm=True, dtype=np.float64)
  for o, fin in outs:
    assert rel_err(o, oo) < PREFILL_TOL and rel_err(fin, ff) < PREFILL_TOL
  with pytest.raises(ValueError, match="intra"):
    chunk_kda_pallas(q, k, v, g, beta, intra="triton")
