"""The chunk-local cumsum of the KDA prefill (Mosaic GPU interpret mode on CPU; `gpu`: compiled):
the stand-alone kernel and the walk the intra-chunk kernel runs on its swizzled tile. On the GPU
both sum each column left to right in fp32, so they must equal NumPy's sequential float32
accumulation bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kda import make_inputs, rel_err

from pallas_kernels.kda import chunk_kda
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import hand_synced, interpret_kwargs
from pallas_kernels.kda.chunk_cumsum import (
  COLS,
  SWIZZLED_TILE,
  chunk_cumsum,
  cumsum_swizzled_rows,
  kernel_supported,
)
from pallas_kernels.kda.oracle import kda_oracle


def _gates(shape, seed):
  return np.random.default_rng(seed).uniform(-5.0, 0.0, shape).astype(np.float32)


@pytest.mark.parametrize("shape", [(3, 64, 2, 64), (2, 64, 3, 128)])
def test_chunk_cumsum_equals_sequential_fp32_sum(shape):
  g = _gates(shape, seed=shape[2])
  y = chunk_cumsum(jnp.asarray(g), interpret=jax.default_backend() != "gpu")
  np.testing.assert_array_equal(np.asarray(y), np.cumsum(g, axis=1, dtype=np.float32))


def _swizzled_walk(g, rows, interpret):
  """g [C, 128] f32 -> (its cumsum over rows, those rows), from `cumsum_swizzled_rows` in a
  kernel whose tile is TMA-loaded in the (8, 32)-tiled, 128-byte-swizzled layout."""
  c = g.shape[0]
  f32 = jnp.float32
  swizzled = (plgpu.TilingTransform(SWIZZLED_TILE), plgpu.SwizzleTransform(128))

  def body(g_ref, o_ref, r_ref, tile, rows_s, bar):
    g_s, g_raw = tile
    plgpu.copy_gmem_to_smem(g_ref, g_s, bar.at[0])
    plgpu.barrier_wait(bar.at[0])
    for i, vec in enumerate(cumsum_swizzled_rows(g_raw, g_s, rows, interpret=interpret)):
      rows_s[i] = vec
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(g_s, o_ref)
    plgpu.copy_smem_to_gmem(rows_s, r_ref)
    plgpu.wait_smem_to_gmem(0)

  call = plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((c, COLS), f32), jax.ShapeDtypeStruct((len(rows), COLS), f32)),
      scratch_types={"tile": plgpu.RefUnion(plgpu.SMEM((c, COLS), f32, transforms=swizzled),
                                            plgpu.SMEM((c, COLS), f32)),
                     "rows_s": plgpu.SMEM((len(rows), COLS), f32),
                     "bar": plgpu.Barrier(num_arrivals=1, num_barriers=1)},
      compiler_params=hand_synced(), **interpret_kwargs(interpret))
  return (np.asarray(x) for x in call(jnp.asarray(g)))


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.gpu)])
def test_swizzled_walk_equals_sequential_fp32_sum(interpret):
  g = _gates((64, COLS), seed=7)
  rows = (16, 48, 63)
  y, picked = _swizzled_walk(g, rows, interpret)
  np.testing.assert_array_equal(y, np.cumsum(g, axis=0, dtype=np.float32))
  np.testing.assert_array_equal(picked, y[list(rows)])


def test_chunk_cumsum_rejects_partial_column_groups():
  g = jnp.zeros((1, 64, 1, 64), jnp.float32)
  assert not kernel_supported(g)
  with pytest.raises(ValueError, match="multiple of 128"):
    chunk_cumsum(g, interpret=True)


def test_prefill_with_xla_cumsum_fallback_matches_oracle():
  """HV * K = 64 does not fill a 128-column group: the prefill takes XLA's cumsum instead."""
  q, k, v, g, beta = make_inputs(t=130, h=1, kd=64, vd=64, seed=5)
  o, fin = chunk_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True,
                     backend="pallas", interpret=jax.default_backend() != "gpu")
  oo, ff, _ = kda_oracle(q, k, v, g, beta, use_qk_l2norm=True, dtype=np.float64)
  assert rel_err(o, oo) < 2e-2 and rel_err(fin, ff) < 2e-2


@pytest.mark.gpu
def test_gpu_compiled_chunk_cumsum_equals_sequential_fp32_sum():
  g = _gates((512, 64, 32, 128), seed=0)
  y = jax.jit(chunk_cumsum)(jnp.asarray(g))
  np.testing.assert_array_equal(np.asarray(y), np.cumsum(g, axis=1, dtype=np.float32))
