"""Chunk-local cumulative sum of the KDA log-decay g on the GPU (Mosaic GPU).

  gam[c, i, h, k] = sum_{j <= i} g[c, j, h, k]        g, gam [NC, C, HV, K] f32

The prefill's intra-chunk kernel needs Gamma, the cumsum of g inside each 64-token chunk. XLA's
cumsum of the [NC, 64, HV, K] array ran at 1.3 TB/s (0.82 ms of the 6.6 ms prefill at T = 32K,
HV = 32, K = 128 on the H200; benchmarks/RESULTS.md part 6), a quarter of what reading g once and
writing Gamma once costs. The sum runs along the chunk's rows and every (head, k) column is
independent, so the array is viewed as [NC, C, HV*K/128, 128]: one CTA per (chunk, 128-column
group) TMA-loads its [C, 128] tile, walks the rows with one column per thread (fp32, the same
left-to-right order as a sequential sum), and TMA-stores the tile it overwrote in place: 0.302 ms
at that size (3.56 TB/s), against XLA's 0.844 ms in the same process (RESULTS.md part 10).
At K = 128 the intra-chunk kernel runs the same walk (`cumsum_rows`) on its own tile of g and
this kernel is not used; it serves the other head sizes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.common import hand_synced, interpret_kwargs

COLS = 128                                    # columns per CTA: one per thread of a warpgroup
ROW = plgpu.Layout.WG_STRIDED((COLS,), vec_size=1)   # one row of a tile, a column per thread
_BLOCK = 8                                   # rows per step of the walk (divides the chunk)


def cumsum_rows(tile):
  """Inside a Mosaic GPU kernel (one warpgroup): tile [C, 128] f32 SMEM without transforms <-
  its cumsum over rows, one column per thread, left to right in fp32. Rows go in blocks of
  `_BLOCK`, all loads of a block before its adds, so the loads' latency is paid once a block."""
  def block(b, acc):
    rows = [plgpu.load(tile.at[b * _BLOCK + u], (), layout=ROW) for u in range(_BLOCK)]
    for u, x in enumerate(rows):
      acc = acc + x
      tile[b * _BLOCK + u] = acc
    return acc

  lax.fori_loop(0, tile.shape[0] // _BLOCK, block,
                plgpu.layout_cast(jnp.zeros((COLS,), jnp.float32), ROW))


def kernel_supported(g) -> bool:
  """The kernel needs the (head, k) columns of a token to fill whole 128-column groups."""
  return (g.shape[2] * g.shape[3]) % COLS == 0


@functools.partial(jax.jit, static_argnames=("interpret",))
def chunk_cumsum(g, *, interpret=False):
  """g [NC, C, HV, K] f32 with HV*K % 128 == 0 -> cumsum over axis 1, same shape and dtype."""
  nc, c, hv, kd = g.shape
  if not kernel_supported(g) or g.dtype != jnp.float32 or c % _BLOCK:
    raise ValueError(f"chunk_cumsum needs f32 g with HV*K a multiple of {COLS} and a chunk a "
                     f"multiple of {_BLOCK}, got {g.shape} {g.dtype}")
  groups = hv * kd // COLS

  def body(g_ref, o_ref, tile, bar):
    ch, j = lax.axis_index("c"), lax.axis_index("j")
    plgpu.copy_gmem_to_smem(g_ref.at[ch, :, j, :], tile, bar.at[0])
    plgpu.barrier_wait(bar.at[0])
    cumsum_rows(tile)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(tile, o_ref.at[ch, :, j, :])
    plgpu.wait_smem_to_gmem(0)

  call = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((nc, c, groups, COLS), jnp.float32),
      scratch_types={"tile": plgpu.SMEM((c, COLS), jnp.float32),
                     "bar": plgpu.Barrier(num_arrivals=1, num_barriers=1)},
      grid=(nc, groups), grid_names=("c", "j"),
      compiler_params=hand_synced(),
      **interpret_kwargs(interpret))
  return call(g.reshape(nc, c, groups, COLS)).reshape(g.shape)
