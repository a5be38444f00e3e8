"""A step's per-row inputs packed into one ``[B, W]`` int32 array.

The runner hands a compiled step one array instead of one per input: each host array passed
to a GPU program is its own host->device transfer, ~40 us of host time apiece on the H200
(14 inputs cost a decode call ~0.6 ms, RESULTS.md part 25), while the GPU waits. Fields are
int32, uint32, float32 or bool, each of a fixed per-row shape; uint32 and float32 travel as
their bits, bool as 0/1.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

_KINDS = (np.int32, np.uint32, np.float32, np.bool_)


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Named per-row fields, in column order: ``(name, shape, dtype)``; ``shape`` excludes the
    row axis."""

    fields: tuple[tuple[str, tuple[int, ...], type], ...]

    def __post_init__(self):
        bad = [name for name, _, dtype in self.fields if dtype not in _KINDS]
        if bad:
            raise TypeError(f"fields {bad}: a packed field is int32, uint32, float32 or bool")

    @property
    def width(self) -> int:
        return sum(math.prod(shape) for _, shape, _ in self.fields)

    def pack(self, rows: int, values: dict[str, np.ndarray]) -> np.ndarray:
        """``values[name]``: ``[rows, *shape]`` of the field's dtype; every field given."""
        out = np.empty((rows, self.width), np.int32)
        col = 0
        for name, shape, dtype in self.fields:
            a = np.asarray(values[name])
            if a.shape != (rows, *shape) or a.dtype != dtype:
                raise ValueError(f"{name}: expected {(rows, *shape)} {np.dtype(dtype)}, got {a.shape} {a.dtype}")
            n = math.prod(shape)
            out[:, col:col + n] = a.reshape(rows, n).astype(np.int32) if dtype is np.bool_ else \
                a.reshape(rows, n).view(np.int32)
            col += n
        return out

    def unpack(self, packed: jax.Array) -> dict[str, jax.Array]:
        """Inside a trace: ``packed`` [B, width] int32 -> each field as ``[B, *shape]``."""
        rows, col, out = packed.shape[0], 0, {}
        for name, shape, dtype in self.fields:
            n = math.prod(shape)
            a = packed[:, col:col + n].reshape(rows, *shape)
            out[name] = (a != 0 if dtype is np.bool_ else
                         a if dtype is np.int32 else jax.lax.bitcast_convert_type(a, jnp.dtype(dtype)))
            col += n
        return out
