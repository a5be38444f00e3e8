"""The streaming floor of a weight-streaming GEMV: a TMA ring that only copies, by tile shape.

The decode GEMVs (`pallas_kernels/row_gemv.py`, `pallas_kernels/mma_gemv.py`) stream a weight
[N, K] through a ring of shared-memory slots in persistent CTAs. Here the same ring runs with no
math: CTA c takes items c, c + CTAs, ... (an item: `rows` weight rows and 1 / `split` of K) and
copies each item's [rows, cols]-byte tiles in K order (one TMA copy per 256 bytes of a row),
waiting for every tile before its slot is refilled. Its time is the memory system's part of a
GEMV with that tile shape, ring depth and CTA count. XLA's reduction of the same bytes (viewed
as bf16) runs beside it. Device µs per pass from profiler traces, over 4 weight copies so that
they stream from HBM (the H200's L2 holds 60 MB).

    python benchmarks/bench_stream.py [--rows 6144 12288 24576] [--k 4096]
        [--tiles 64x256x2x3x2 16x1024x2x3x1 ...]     # rows x cols(bytes) x slots x CTAs an SM x K parts
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pallas_kernels.common import num_sms  # noqa: E402

_BOX = 256   # bytes of a row per TMA copy (a box is at most 256 elements wide)


def stream(w, rows: int, cols: int, slots: int, ctas_per_sm: int, split: int = 1):
    """Copies w [N, K] uint8 through the ring; returns the first slot's last tile of every CTA
    ([CTAs, rows, 256] uint8), so that the copies have a consumer."""
    n, k = w.shape
    if n % rows or k % (cols * split) or cols % _BOX:
        raise ValueError(f"[{n}, {k}] does not split into {rows}x{cols} tiles over {split} K parts")
    items, kt = n // rows * split, k // cols // split
    ctas = min(items, num_sms() * ctas_per_sm)
    boxes = cols // _BOX

    def kernel(w_ref, o_ref, buf, bar):
        c = lax.axis_index("c")
        tiles = lax.div(items - c + ctas - 1, ctas) * kt

        def issue(i, slot):
            item = c + lax.div(i, kt) * ctas
            row0, kc = lax.div(item, split) * rows, lax.rem(item, split) * kt + lax.rem(i, kt)
            for b in range(boxes):
                plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(row0, rows), pl.ds(kc * cols + b * _BOX, _BOX)],
                                        buf.at[slot, b], bar.at[slot])

        for p in range(slots):
            pl.when(p < tiles)(lambda p=p: issue(p, p))

        def step(i, carry):
            slot = lax.rem(i, slots)
            plgpu.barrier_wait(bar.at[slot])
            pl.when(i + slots < tiles)(lambda: issue(i + slots, slot))
            return carry

        lax.fori_loop(0, tiles, step, 0)
        plgpu.copy_smem_to_gmem(buf.at[0, 0], o_ref.at[c])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((ctas, rows, _BOX), jnp.uint8),
                        scratch_types=[plgpu.SMEM((slots, boxes, rows, _BOX), jnp.uint8),
                                       plgpu.Barrier(num_arrivals=boxes, num_barriers=slots)],
                        grid=(ctas,), grid_names=("c",))(w)


def xla_read(w):
    """XLA's plain read of the same bytes: a sum of them viewed as bf16."""
    n, k = w.shape
    return jnp.sum(lax.bitcast_convert_type(w.reshape(n, k // 2, 2), jnp.bfloat16).astype(jnp.float32))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[4096, 12288, 24576])
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--tiles", nargs="+", default=["64x256x2x3x2", "32x512x2x3x2", "16x1024x2x3x2", "16x1024x2x3x1"])
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        sys.exit("bench_stream needs a GPU")
    from bench_quant_matmul import device_us

    x = jnp.zeros((1,), jnp.float32)
    for n in args.rows:
        key = jax.random.key(n)
        ws = [jax.random.bits(jax.random.fold_in(key, i), (n, args.k), jnp.uint8) for i in range(4)]
        mb = n * args.k / 1e6
        cases = [("xla read", lambda x, w: xla_read(w))]
        for t in args.tiles:
            rows, cols, slots, per_sm, split = map(int, t.split("x"))
            cases.append((f"ring {t}", lambda x, w, a=(rows, cols, slots, per_sm, split): stream(w, *a)))
        for name, fn in cases:
            us = device_us(fn, x, [(w,) for w in ws])
            print(f"{n}x{args.k} ({mb:5.1f} MB)  {name:20s} {us:7.2f} us  {mb / us:5.2f} TB/s", flush=True)
        del ws


if __name__ == "__main__":
    main()
