"""Repeating layer groups compiled once: stacked weights scanned with ``jax.lax.scan``.

A deep hybrid trunk repeats a short group of layers (GLM-5.3: 3 KDA + 1 DSA, ten times over).
Unrolled, every layer is traced and compiled on its own and start-up grows linearly with depth;
scanned, the group's body is compiled once. The plan ``(first, period, count)`` says that
layers ``first + j·period + k`` (``j < count``, ``k < period``) are layer ``k`` of group ``j``.
Before loading, :func:`stack_layers` declares on the template layers ``first + k`` each weight
stacked over the groups (``[count, ...]``) and drops the other layers; :func:`scan_groups` runs the
groups with the layers' own ``__call__``. Their cache entries are stacked the same way
(``cache.pools``, ``stack``): group ``j`` sees the pools through
:meth:`AttentionBatch.in_stack`, so the layer code is the same scanned or not.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

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


def stack_layers(layers: nnx.List, plan: Plan) -> bool:
    """In place, on an abstract model (``nnx.eval_shape``): template layer ``first + k``
    declares every weight stacked over the ``count`` groups (``[count, ...]``, ``axes``
    metadata ``(None, *axes)``, ``stacked_layers`` metadata: the layer indices it holds, in
    order); the other layers of the run become None. The loader fills each stacked weight from
    its layers' checkpoint tensors (:func:`member_paths`), one device slice at a time.

    Returns False and changes nothing when the layers of one group position differ in their
    parameters (names, shapes, dtypes: e.g. a checkpoint that quantizes some layers' experts
    and not others'), since one compiled body cannot serve both."""
    first, period, count = plan
    signature = lambda flat: [(path, tuple(v.shape), str(v.get_value().dtype)) for path, v in flat]
    columns = []                                  # (group position k, the variables of one weight)
    for k in range(period):
        flats = [nnx.to_flat_state(nnx.state(layers[first + j * period + k])) for j in range(count)]
        if any(signature(f) != signature(flats[0]) for f in flats[1:]):
            return False
        columns += [(k, [var for _, var in column]) for column in zip(*flats)]
    for k, variables in columns:
        v0 = variables[0].get_value()
        for v in variables[1:]:
            v.set_value(None)
        variables[0].set_value(jax.ShapeDtypeStruct((count, *v0.shape), v0.dtype))
        meta = variables[0].get_metadata()
        if "axes" in meta:
            variables[0].set_metadata(axes=(None, *meta["axes"]))
        variables[0].set_metadata(stacked_layers=tuple(first + j * period + k for j in range(count)))
    for k in range(period):
        for j in range(1, count):
            layers[first + j * period + k] = None
    return True


def member_paths(path: tuple, layers: Sequence[int]) -> list[tuple]:
    """The per-layer paths of a stacked parameter at ``path`` (under ``layers.{layers[0]}``)."""
    at = next(i for i in range(1, len(path)) if path[i - 1] == "layers" and path[i] == layers[0])
    return [path[:at] + (layer,) + path[at + 1:] for layer in layers]


def _indexed_in_scan(path, var) -> bool:
    """Params the layer indexes itself (``indexed_in_scan`` metadata): passed whole, not sliced."""
    return bool(var.get_metadata().get("indexed_in_scan"))


def scan_groups(templates: list, plan: Plan, carry, batch, num_pages: int, num_slots: int,
                call: Callable):
    """Runs the ``count`` groups: ``carry = call(layer, carry, batch_j)`` for the ``period``
    template layers of each group, ``batch_j`` addressing group ``j``'s block of the stacked
    pools (and carrying ``j`` as ``stack_index``). ``carry`` holds everything the layers update
    (residual streams and pools). Weights are sliced to group ``j``, except those marked
    ``indexed_in_scan``, which stay stacked for the layer to index."""
    first, period, count = plan
    graphdef, whole, params = nnx.split(nnx.List(templates), _indexed_in_scan, ...)

    def body(carry, xs):
        j, p = xs
        layers = nnx.merge(graphdef, whole, p)
        batch_j = batch.in_stack(j, num_pages, num_slots)
        for k, layer in enumerate(layers):
            with jax.named_scope(f"layer_{first + k}+{period}j"):          # trace name: layer first+k+period·j
                carry = call(layer, carry, batch_j)
        return carry, None

    carry, _ = jax.lax.scan(body, carry, (jnp.arange(count, dtype=jnp.int32), params))
    return carry
