"""The device cache: one flat pytree ``{name: array}`` allocated once at start-up.

Two kinds of entries share one pool type, so hybrid models (GLM-5.3: paged KV for attention
layers, recurrent-state and conv-state slots for KDA layers) keep all their cache in one
donated pytree:

* ``PagedSpec`` — per-token data in pages: array ``[num_pages, page_size / tokens_per_entry,
  *entry_shape]``, addressed through a sequence's page table (one entry per token, or per
  group of ``tokens_per_entry`` tokens, e.g. pooled indexer keys). Page 0 is a dummy that
  padded rows write to.
* ``SlotSpec`` — per-sequence data: array ``[num_slots, *entry_shape]`` (e.g. a KDA state
  ``[H, K, V]`` fp32, a conv state ``[taps, channels]``), addressed by a sequence's slot.
  Slot 0 is a dummy; a slot is zeroed before a new sequence uses it.

``axes`` gives the logical axes of ``entry_shape`` for sharding (e.g. ``("kv_heads", None)``).

``stack = L`` makes one entry hold the pools of ``L`` layers that run as one scanned layer
group (the model compiles the group's body once): the leading dimension is ``L·num_pages``
(or ``L·num_slots``) and layer ``j`` uses pages ``j·num_pages + p`` and slots
``j·num_slots + s``, so its page 0 and slot 0 are again dummies and the layer's code indexes
the stacked pool with shifted page tables and slots, unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any, Union

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from kk_jax.parallel.mesh import sharding


@dataclasses.dataclass(frozen=True)
class PagedSpec:
    entry_shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str | None, ...]
    tokens_per_entry: int = 1
    stack: int = 1


@dataclasses.dataclass(frozen=True)
class SlotSpec:
    entry_shape: tuple[int, ...]
    dtype: Any
    axes: tuple[str | None, ...]
    stack: int = 1


CacheLayout = dict[str, Union[PagedSpec, SlotSpec]]


def _entry_bytes(spec) -> int:
    """Bytes of one entry summed over the ``stack`` layers that share the spec."""
    return spec.stack * math.prod(spec.entry_shape) * jnp.dtype(spec.dtype).itemsize


def bytes_per_page(layout: CacheLayout, page_size: int) -> int:
    """Bytes one page occupies summed over every paged entry (all shards)."""
    return sum(page_size // s.tokens_per_entry * _entry_bytes(s) for s in layout.values()
               if isinstance(s, PagedSpec))


def bytes_per_slot(layout: CacheLayout) -> int:
    return sum(_entry_bytes(s) for s in layout.values() if isinstance(s, SlotSpec))


def pool_shape(spec, num_pages: int, page_size: int, num_slots: int) -> tuple[int, ...]:
    if isinstance(spec, PagedSpec):
        if page_size % spec.tokens_per_entry:
            raise ValueError(f"page_size {page_size} is not a multiple of {spec.tokens_per_entry} tokens per entry")
        return (spec.stack * num_pages, page_size // spec.tokens_per_entry, *spec.entry_shape)
    return (spec.stack * num_slots, *spec.entry_shape)


def pool_sharding(spec, mesh: Mesh):
    lead = (None, None) if isinstance(spec, PagedSpec) else (None,)
    return sharding(mesh, lead + tuple(spec.axes))


def allocate_pools(layout: CacheLayout, *, num_pages: int, page_size: int, num_slots: int,
                   mesh: Mesh) -> dict[str, jax.Array]:
    """Zero-filled pools, each created directly with its sharding (no host copy)."""
    pools = {}
    for name, spec in layout.items():
        shape = pool_shape(spec, num_pages, page_size, num_slots)
        pools[name] = jax.jit(partial(jnp.zeros, shape, spec.dtype),
                              out_shardings=pool_sharding(spec, mesh))()
    return pools


def abstract_pools(layout: CacheLayout, *, num_pages: int, page_size: int, num_slots: int,
                   mesh: Mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """What ``allocate_pools`` would create, allocating nothing (a compile-only runner)."""
    return {name: jax.ShapeDtypeStruct(pool_shape(spec, num_pages, page_size, num_slots), spec.dtype,
                                       sharding=pool_sharding(spec, mesh))
            for name, spec in layout.items()}


def _zero_slots(pools, slots, stacks):
    stacks = dict(stacks)

    def zero(a, stack):
        n = a.shape[0] // stack
        return a.at[(jnp.arange(stack)[:, None] * n + slots[None, :]).reshape(-1)].set(0)

    return {n: (zero(a, stacks[n]) if n in stacks else a) for n, a in pools.items()}


_zero_slots_jit = jax.jit(_zero_slots, donate_argnums=(0,), static_argnums=(2,))


def zero_slots(pools: dict, layout: CacheLayout, slots: jax.Array) -> dict:
    """Zeroes the given slots (in every stacked layer) of every SlotSpec entry in place (pools
    are donated)."""
    stacks = tuple(sorted((n, s.stack) for n, s in layout.items() if isinstance(s, SlotSpec)))
    if not stacks:
        return pools
    return _zero_slots_jit(pools, slots, stacks)
