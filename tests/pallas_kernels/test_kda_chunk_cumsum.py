"""The chunk-local cumsum kernel of the KDA prefill (Mosaic GPU interpret mode on CPU; `gpu`:
compiled). It sums each chunk's rows left to right in fp32, so it must equal NumPy's sequential
float32 accumulation bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kda import make_inputs, rel_err

from pallas_kernels.kda import chunk_kda
from pallas_kernels.kda.chunk_cumsum import chunk_cumsum, kernel_supported
from pallas_kernels.kda.oracle import kda_oracle


def _gates(shape, seed):
  return np.random.default_rng(seed).uniform(-5.0, 0.0, shape).astype(np.float32)


@pytest.mark.parametrize("shape", [(3, 64, 2, 64), (2, 64, 3, 128)])
def test_chunk_cumsum_equals_sequential_fp32_sum(shape):
  g = _gates(shape, seed=shape[2])
  y = chunk_cumsum(jnp.asarray(g), interpret=jax.default_backend() != "gpu")
  np.testing.assert_array_equal(np.asarray(y), np.cumsum(g, axis=1, dtype=np.float32))


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
