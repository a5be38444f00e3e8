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
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, memref, vector
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
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


SWIZZLED_TILE = (8, 32)     # the f32 tiling of a swizzled tile: 8 rows of one 128-byte swizzle atom


def cumsum_swizzled_rows(raw, tiled, rows, *, interpret=False):
  """Inside a Mosaic GPU kernel (one warpgroup): the cumsum over rows, in place, of a [C, 128]
  f32 tile that sits in SMEM in the layout `tiled` declares, (8, 32) tiles with the 128-byte
  swizzle (the layout the kernel's WGMMA-layout loads read without bank conflicts). `raw` is
  the same buffer without transforms. Returns the cumsum's `rows` as [128] vectors, one column
  per thread (`ROW`).

  On the GPU each thread walks its own column, left to right in fp32 (as `cumsum_rows`), at the
  swizzled addresses, so no thread touches another's elements and the walk needs no barrier;
  the TMA load can write the swizzled tile directly. (Walking an unswizzled tile and moving it
  into the swizzled one took a WGMMA-layout load with 8-way bank conflicts and three barriers.)
  Interpret mode, which cannot run inline Mosaic GPU code, sums the rows of `tiled` in the
  same order (so both are bit-equal to a sequential fp32 sum)."""
  c = raw.shape[0]
  if raw.shape != (c, COLS) or c % SWIZZLED_TILE[0]:
    raise ValueError(f"the swizzled walk serves [8k, {COLS}] tiles, got {raw.shape}")
  if interpret:
    x = tiled[...]
    sums = [x[0]]
    for r in range(1, c):
      sums.append(sums[-1] + x[r])
    tiled[...] = jnp.stack(sums)
    return tuple(sums[r] for r in rows)
  out = plgpu.ShapeDtypeStruct((COLS,), jnp.float32, layout=ROW)

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),), return_type=(out,) * len(rows))
  def walk(_, ref):
    i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
    cst = lambda v, ty=i32: mgpu_utils.c(v, ty)
    tr, tc = SWIZZLED_TILE
    t = arith.andi(mgpu_utils.thread_idx(), cst(COLS - 1))        # this thread's column
    # element (r, t) of the tiled tile sits at raw position (row, col) with
    #   row = 8 (r // 8) + 2 (t // 32) + (r % 8) // 4,   col = 32 (r % 4) + swz(t, r % 8),
    #   swz(t, j) = 4 ((t % 32) // 4 XOR j) + t % 4      (16-byte units XORed with the row)
    row_t = arith.index_cast(index, arith.muli(arith.shrui(t, cst(5)), cst(COLS // tc // 2)))
    unit, lane4 = arith.shrui(arith.andi(t, cst(tc - 1)), cst(2)), arith.andi(t, cst(3))
    swz = [arith.index_cast(index, arith.addi(arith.shli(arith.xori(unit, cst(j)), cst(2)), lane4))
           for j in range(tr)]

    def at(r):
      j = r % tr
      return [arith.addi(row_t, cst(tr * (r // tr) + j * tc // COLS, index)),
              arith.addi(swz[j], cst(tc * (j % (COLS // tc)), index))]

    acc, picked = None, {}
    for b in range(0, c, tr):                     # a block's loads first, then its adds
      vals = [memref.load(ref, at(r)) for r in range(b, b + tr)]
      for r, x in zip(range(b, b + tr), vals):
        acc = x if acc is None else arith.addf(acc, x)
        memref.store(acc, ref, at(r))
        if r in rows:
          picked[r] = acc
    vec = ir.VectorType.get((1,), ir.F32Type.get())
    return tuple(mgpu_fa.FragmentedArray(
        _registers=np.array([vector.from_elements(vec, [picked[r]])], dtype=object),
        _layout=mgpu_fa.WGStridedFragLayout((COLS,), 1), _is_signed=None) for r in rows)

  return walk(raw)


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
