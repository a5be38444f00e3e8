"""Device mesh and sharding rules.

One mesh axis, ``tp``, for tensor parallelism. Parameters and cache pools name their
dimensions with logical axes (``vocab``, ``heads``, ``kv_heads``, ``mlp``); ``RULES`` maps
each to a mesh axis. Pallas kernels are not auto-partitioned, so every kernel call goes
through :func:`shard_heads`, a ``jax.shard_map`` over the head dimension.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

TP = "tp"

# logical axis name -> mesh axis (None = replicated)
RULES: dict[str, str | None] = {
    "vocab": TP,
    "heads": TP,
    "kv_heads": TP,
    "mlp": TP,
    "embed": None,
}


class ParallelError(ValueError):
    """The requested parallel layout does not fit the model or the machine."""


def make_mesh(tp: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh over the first ``tp`` devices."""
    devices = list(devices if devices is not None else jax.devices())
    if tp < 1:
        raise ParallelError(f"tp must be >= 1, got {tp}")
    if tp > len(devices):
        raise ParallelError(f"tp={tp} needs {tp} devices but only {len(devices)} are visible")
    return Mesh(np.array(devices[:tp]), (TP,))


def spec(axes: Sequence[str | None]) -> P:
    """PartitionSpec for a tuple of logical axis names."""
    return P(*(RULES.get(a) if a is not None else None for a in axes))


def sharding(mesh: Mesh, axes: Sequence[str | None]) -> NamedSharding:
    return NamedSharding(mesh, spec(axes))


def check_divisible(mesh: Mesh, **sizes: int) -> None:
    """Raises a ParallelError naming every logical size that tp does not divide."""
    tp = mesh.shape[TP]
    bad = [f"{name}={n}" for name, n in sizes.items() if n % tp]
    if bad:
        raise ParallelError(f"tp={tp} must divide {', '.join(bad)}; choose a tp that divides them")


def shard_heads(fn: Callable, mesh: Mesh, in_axes: Sequence, out_axes: Sequence) -> Callable:
    """Wraps ``fn`` in ``jax.shard_map`` with per-array logical axes.

    ``in_axes`` / ``out_axes`` hold one entry per argument / per returned array: a tuple of
    logical names, or None for a replicated array. Each shard sees only its heads; no
    collectives happen inside.
    """
    to_spec = lambda a: P() if a is None else spec(a)
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(to_spec(a) for a in in_axes),
                         out_specs=tuple(to_spec(a) for a in out_axes), check_vma=False)
