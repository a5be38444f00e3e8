"""Repeating layer groups compiled once: stacked weights scanned with ``jax.lax.scan``.

A deep hybrid trunk repeats a short group of layers (GLM-5.3: 3 KDA + 1 DSA, ten times over).
Unrolled, every layer is traced and compiled on its own and start-up grows linearly with depth;
scanned, the group's body is compiled once. The plan ``(first, period, count)`` says that
layers ``first + j·period + k`` (``j < count``, ``k < period``) are layer ``k`` of group ``j``.
After loading, :func:`stack_layers` gives the template layers ``first + k`` each weight stacked
over the groups (``[count, ...]``) and drops the other copies; :func:`scan_groups` runs the
groups with the layers' own ``__call__``. Their cache entries are stacked the same way
(``cache.pools``, ``stack``): group ``j`` sees the pools through
:meth:`AttentionBatch.in_stack`, so the layer code is the same scanned or not.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

Plan = tuple[int, int, int]          # (first, period, count)


def repeating_groups(signatures: Sequence) -> Plan | None:
    """The plan that leaves the fewest layers to compile: over every period and start, the
    longest run of consecutive identical groups of ``signatures`` (one hashable per layer);
    None when no group repeats."""
    n, best, best_cost = len(signatures), None, len(signatures)
    for period in range(1, n // 2 + 1):
        for first in range(n - 2 * period + 1):
            group = tuple(signatures[first:first + period])
            count = 1
            while tuple(signatures[first + count * period:first + (count + 1) * period]) == group:
                count += 1
            cost = n - (count - 1) * period          # layer bodies compiled
            if count >= 2 and cost < best_cost:
                best, best_cost = (first, period, count), cost
    return best


def _stack(values: list):
    """[count, ...] of the per-layer values: a placed array sharded as they are along the other
    axes, or (abstract model) a ShapeDtypeStruct."""
    v0 = values[0]
    if isinstance(v0, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(values), *v0.shape), v0.dtype)
    sh = v0.sharding
    out = NamedSharding(sh.mesh, P(None, *sh.spec)) if isinstance(sh, NamedSharding) else None
    return jax.jit(lambda xs: jnp.stack(xs), out_shardings=out)(values)


def stack_layers(layers: nnx.List, plan: Plan) -> None:
    """In place: template layer ``first + k`` gets every weight stacked over the ``count``
    groups (``[count, ...]``, sharded as before along the other axes, ``axes`` metadata
    ``(None, *axes)``); the other layers of the run become None. On an abstract model
    (``nnx.eval_shape``) this declares the stacked parameters, which random weights are then
    drawn into directly. On loaded weights, tensors are stacked one at a time and each source is
    released right after, so the extra memory is one stacked tensor (but the freed per-layer
    buffers leave the allocator fragmented)."""
    first, period, count = plan
    for k in range(period):
        members = [layers[first + j * period + k] for j in range(count)]
        flats = [nnx.to_flat_state(nnx.state(m)) for m in members]
        for column in zip(*flats):
            paths = {path for path, _ in column}
            assert len(paths) == 1, f"layers of one group position differ: {paths}"
            variables = [var for _, var in column]
            stacked = _stack([v.get_value() for v in variables])
            for v in variables[1:]:
                v.set_value(None)
            variables[0].set_value(stacked)
            if "axes" in variables[0].get_metadata():
                variables[0].set_metadata(axes=(None, *variables[0].get_metadata()["axes"]))
        for j in range(1, count):
            layers[first + j * period + k] = None


def scan_groups(templates: list, plan: Plan, carry, batch, num_pages: int, num_slots: int,
                call: Callable):
    """Runs the ``count`` groups: ``carry = call(layer, carry, batch_j)`` for the ``period``
    template layers of each group, ``batch_j`` addressing group ``j``'s block of the stacked
    pools. ``carry`` holds everything the layers update (residual streams and pools)."""
    _, _, count = plan
    graphdef, params = nnx.split(nnx.List(templates))

    def body(carry, xs):
        j, p = xs
        layers = nnx.merge(graphdef, p)
        batch_j = batch.in_stack(j, num_pages, num_slots)
        for layer in layers:
            carry = call(layer, carry, batch_j)
        return carry, None

    carry, _ = jax.lax.scan(body, carry, (jnp.arange(count, dtype=jnp.int32), params))
    return carry
