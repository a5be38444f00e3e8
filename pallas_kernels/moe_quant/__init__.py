"""Grouped (MoE) matmul over quantized experts, dequantized inside the kernel (W8A16 / W4A16).

    tiles = route_tiles(idx, num_experts, bm)          # [N, k] routing -> row tiles
    x_rows = gather_rows(x, tiles)                      # [T·bm, K] bf16, zero padding rows
    y_rows = grouped_matmul(x_rows, tiles.tile_expert, fmt, w, *scales, backend="pallas")
    y = y_rows[tiles.row_of_pair]                       # [N·k, N_out], pair order of idx

The token-slots routed to one expert are packed into row tiles of ``bm`` rows, one expert per
tile (:func:`route_tiles`); tile t is multiplied by expert ``tile_expert[t]``'s weight and
unused tiles (``-1``) are skipped. Every expert a call routes to is read once per tile, from
its quantized bytes: decode at batch 1 reads k experts, never the whole layer.

Operands, E experts stacked, weights in the checkpoint's ``[out, in]`` orientation and the
per-block scales of MXFP8 / NVFP4 transposed (``[in / block, out]``: one K block's scales for
64 consecutive rows are contiguous, so a K step's scales are one TMA tile); N a multiple of 64
(block FP8: 128), K a multiple of 64 (MXFP8), 128 (NVFP4) or 32 (block FP8): the kernel does not
pad K, and both backends apply these rules (``reference.check_tiles``):

  nvfp4      w uint8 [E, N, K/2]; scales (weight_scale e4m3 [E, K/16, N], weight_scale_2 f32 [E])
  mxfp8      w e4m3  [E, N, K];   scales (weight_scale uint8 E8M0 [E, K/32, N],)
  fp8_block  w e4m3  [E, N, K];   scales (weight_scale_inv f32 [E, N/128, K/128],)  (128x128 blocks)

returns [T·bm, N] ``out_dtype`` (fp32 accumulation); rows of skipped tiles are unspecified
(they are never gathered), rows of padding slots are zero. ``expert_offset`` (traced int32)
adds to every tile's expert: the weights may hold several layers' experts ``[L·E, ...]``
(a scanned layer group) and a call uses layer l's with offset l·E, without slicing them. A
tile whose expert, offset, falls outside the stacked experts is skipped like a -1 tile.
No tiles (T = 0) give an empty result.

backend="pallas": the Mosaic GPU engine of ``pallas_kernels/mxfp8/wdequant.py`` with an expert
per row tile (interpret=True runs it on CPU); backend="xla": the jnp twin (dequantize each
tile's expert, then a batched dot).

Decode-sized calls can skip the tiles: ``routed_gemv(x_slots, experts, fmt, w, *scales)`` runs one
weight-streaming GEMV per token-slot (``routed_gemv.py``).
"""

from __future__ import annotations

from pallas_kernels.common import check_matmul_io, no_rows

from .kernel import grouped_matmul_kernel
from .reference import FORMATS, grouped_matmul_reference, validate
from .routed_gemv import routed_gemv
from .routed_gemv import supported as routed_gemv_supported
from .tiles import Tiles, gather_rows, route_tiles

BACKENDS = ("pallas", "xla")


def grouped_matmul(x_rows, tile_expert, fmt, w, *scales, expert_offset=0, backend="pallas", out_dtype=None,
                   interpret=False):
    """See the module docstring."""
    check_matmul_io(x_rows, out_dtype)
    if tile_expert.shape[:1] == (0,):                  # no tiles: no kernel to launch
        validate(x_rows, tile_expert, fmt, w, *scales)
        return no_rows(x_rows, w.shape[1], out_dtype)
    if backend == "xla":
        return grouped_matmul_reference(x_rows, tile_expert, fmt, w, *scales, expert_offset=expert_offset,
                                        out_dtype=out_dtype)
    if backend == "pallas":
        return grouped_matmul_kernel(x_rows, tile_expert, fmt, w, *scales, expert_offset=expert_offset,
                                     out_dtype=out_dtype, interpret=interpret)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


__all__ = ["grouped_matmul", "grouped_matmul_kernel", "grouped_matmul_reference", "routed_gemv",
           "routed_gemv_supported", "route_tiles", "gather_rows", "Tiles", "validate", "FORMATS", "BACKENDS"]
