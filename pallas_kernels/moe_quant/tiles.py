"""Routing -> row tiles of one expert each (the grouped kernel's input contract)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Tiles(NamedTuple):
    """Row tiles of ``bm`` rows for ``P`` token-slots over ``E`` experts.

    tile_expert  int32 [T]      expert of tile t, -1 for unused tiles; T = ceil(P/bm) + min(E, P)
                                bounds the tiles any routing needs (each expert wastes < 1 tile)
    slot_of_row  int32 [T·bm]   token-slot (flat index into idx [N, k]) held by a row, -1 padding
    row_of_pair  int32 [P]      row holding token-slot p
    """

    tile_expert: jax.Array
    slot_of_row: jax.Array
    row_of_pair: jax.Array


def num_tiles(pairs: int, experts: int, bm: int) -> int:
    return -(-pairs // bm) + min(experts, pairs)


# Below this many token-slots the ranks come from one [P, P] comparison (a single fused kernel)
# instead of a sort: decode-sized routing stays a handful of small kernels.
PAIRWISE_MAX = 2048


def route_tiles(idx: jax.Array, num_experts: int, bm: int) -> Tiles:
    """idx [N, k] int32 expert ids -> :class:`Tiles` (slots of one expert in routing order)."""
    flat = idx.reshape(-1).astype(jnp.int32)
    p = flat.shape[0]
    t = num_tiles(p, num_experts, bm)
    slots = jnp.arange(p, dtype=jnp.int32)
    if p <= PAIRWISE_MAX:
        same = flat[None, :] == flat[:, None]                                 # [P, P]
        rank = jnp.sum(same & (slots[None, :] < slots[:, None]), axis=1, dtype=jnp.int32)
        sizes = jnp.sum(flat[:, None] == jnp.arange(num_experts, dtype=jnp.int32)[None, :], axis=0, dtype=jnp.int32)
    else:
        sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
        order = jnp.argsort(flat, stable=True)                               # slots grouped by expert
        slot_start = jnp.cumsum(sizes) - sizes
        rank = jnp.zeros((p,), jnp.int32).at[order].set(slots - slot_start[flat[order]])
    ntiles = (sizes + bm - 1) // bm
    tile_end = jnp.cumsum(ntiles)                                             # [E]
    row_of_pair = ((tile_end - ntiles)[flat] * bm + rank).astype(jnp.int32)  # position within its expert
    slot_of_row = jnp.full((t * bm,), -1, jnp.int32).at[row_of_pair].set(slots)
    tid = jnp.arange(t, dtype=jnp.int32)
    expert = jnp.sum(tile_end[None, :] <= tid[:, None], axis=1, dtype=jnp.int32)
    tile_expert = jnp.where(tid < tile_end[-1], expert, -1)
    return Tiles(tile_expert, slot_of_row, row_of_pair)


def gather_rows(x: jax.Array, tiles: Tiles, k: int) -> jax.Array:
    """x [N, D] (the routed tokens, k slots each) -> [T·bm, D] rows of the tiles, zero padding."""
    slot = tiles.slot_of_row
    rows = x[jnp.maximum(slot, 0) // k]
    return jnp.where((slot >= 0)[:, None], rows, jnp.zeros((), x.dtype))
