"""Inverses of the 16 x 16 diagonal blocks of I + N inside the KDA intra-chunk kernel.

N [C, C] (C = 64) is strictly lower triangular (Diag(beta) A_kk); Nd is its four 16 x 16
diagonal blocks and D = (I + Nd)^-1, block-diagonal and unit lower triangular. The kernel needs
D^T on the blocks only, as `dt[r, t] = D^T[r, base(r) + t] = D[base(r) + t, r]`, base(r) the
first row of r's block (reference/kernels.md §2.2: the chunked WY form, 16x16 diagonal
blocks in fp32).

On the GPU every thread solves for the columns of D that its WGMMA-layout rows of dt hold:
row r = 16 w + l // 4 (+ 8) of warp w, lane l is the solution x of (I + Nd_w) x = e_j,
j = r - 16 w, and the thread keeps the components t = 2 (l % 4) + {0, 1} (+ 8). The two
right-hand sides (j < 8 and j + 8) run by forward substitution in fp32 registers,
`x_i = delta_ij - sum_{k < i} N[i, k] x_k` with the sum taken in increasing k, so x_i waits
on x_{i-1} for one fused multiply-add only; the rows of N come from shared memory as 16-byte
vectors, the same address for every lane of a warp. That replaces a 16-step substitution of
whole register rows (a product, a quad reduction by two shuffles and selects per step) whose
steps each waited on the previous one's reduction.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, vector
from jax._src.lib.mlir.dialects import math as mlir_math
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

BLOCK = 16     # diagonal block size (rows a warp of the WGMMA layout holds)
_VEC = 4       # fp32 elements per shared-memory load


def diag_block_inverse_t(n_ref, *, interpret=False):
  """n_ref: SMEM [C, C] f32 without transforms holding N (strictly lower; its diagonal blocks
  are read). Returns dt [C, 16] f32 in the WGMMA layout, as above. Interpret mode, which cannot
  run inline Mosaic GPU code, solves the blocks with `solve_triangular` instead."""
  c = n_ref.shape[0]
  if c != 4 * BLOCK:
    raise ValueError(f"the block inverse serves 64-row chunks (one 16-row block a warp), got {c}")
  if interpret:
    n = n_ref[...].reshape(4, BLOCK, 4, BLOCK)
    nd = jnp.stack([n[b, :, b, :] for b in range(4)])               # [4, 16, 16]
    eye = jnp.eye(BLOCK, dtype=jnp.float32)
    d = jax.scipy.linalg.solve_triangular(eye + nd, jnp.broadcast_to(eye, nd.shape), lower=True,
                                          unit_diagonal=True)
    return jnp.swapaxes(d, 1, 2).reshape(c, BLOCK)
  out = plgpu.ShapeDtypeStruct((c, BLOCK), jnp.float32, layout=plgpu.Layout.WGMMA)

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),), return_type=out)
  def solve(_, n_smem):
    f32, i32, index = ir.F32Type.get(), ir.IntegerType.get_signless(32), ir.IndexType.get()
    cst = lambda v, ty=i32: mgpu_utils.c(v, ty)
    tid = mgpu_utils.thread_idx()
    base = arith.muli(arith.andi(arith.shrui(tid, cst(5)), cst(3)), cst(BLOCK))  # 16 w
    lane = arith.andi(tid, cst(31))
    j = arith.shrui(lane, cst(2))                                    # 0..7
    quad = arith.andi(lane, cst(3))
    zero, one = cst(0.0, f32), cst(1.0, f32)
    vec_ty = ir.VectorType.get((_VEC,), f32)
    base_ix = arith.index_cast(index, base)

    def row(i):
      """N[base + i, base + k] for k < i, as fp32 scalars."""
      r = arith.addi(base_ix, cst(i, index))
      vals = []
      for m in range(-(-i // _VEC)):
        v = vector.load(vec_ty, n_smem, [r, arith.addi(base_ix, cst(m * _VEC, index))])
        vals += [vector.extract(v, [], [e]) for e in range(_VEC)]
      return vals[:i]

    def delta(i, jj):
      return arith.select(arith.cmpi(arith.CmpIPredicate.eq, jj, cst(i)), one, zero)

    x1, x2 = [], []             # right-hand sides j (< 8) and j + 8 (x2_i = 0 for i < 8)
    for i in range(BLOCK):
      n_i = row(i)
      acc1 = delta(i, j) if i < 8 else zero
      for k in range(i):
        acc1 = mlir_math.fma(arith.negf(n_i[k]), x1[k], acc1)
      x1.append(acc1)
      if i < 8:
        x2.append(zero)
        continue
      acc2 = delta(i - 8, j)
      for k in range(8, i):
        acc2 = mlir_math.fma(arith.negf(n_i[k]), x2[k], acc2)
      x2.append(acc2)

    def pick(xs, col):
      """xs[col + 2 quad]: this thread's column of a register pair."""
      val = xs[col]
      for q in range(1, 4):
        val = arith.select(arith.cmpi(arith.CmpIPredicate.eq, quad, cst(q)), xs[col + 2 * q], val)
      return val

    layout = mgpu_fa.WGMMA_LAYOUT
    shape = (c, BLOCK)
    strides = layout.tiling.tile_strides(tuple(mgpu_utils.get_contiguous_strides(shape)))
    regs = np.empty(layout.registers_shape(shape), dtype=object)
    for idx in np.ndindex(regs.shape):
      row_off, col_off = divmod(sum(i * s for i, s in zip(idx, strides)), BLOCK)
      xs = x1 if row_off == 0 else x2                               # rows r and r + 8
      regs[idx] = vector.from_elements(ir.VectorType.get((layout.vector_length,), f32),
                                       [pick(xs, col_off + e) for e in range(layout.vector_length)])
    return mgpu_fa.FragmentedArray(_registers=regs, _layout=layout, _is_signed=None)

  return solve(n_ref)
