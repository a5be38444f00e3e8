"""Validated, sharded loading of HF safetensors checkpoints onto the device mesh.

Every expected tensor is checked (present, shape, floating dtype) and every unexpected one
is listed before any byte reaches a device; all problems are reported in one
``CheckpointError``. Each weight is then created with ``jax.make_array_from_callback`` and its
final ``NamedSharding``: each device receives only its own slice, read from the memory map,
so no device ever holds (and the host never materialises per device) a full copy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

from kk_jax.checkpoint.safetensors_io import LazyTensor, index_checkpoint
from kk_jax.parallel.mesh import sharding

FLOAT_CODES = {"F32", "F16", "BF16", "F64"}


class CheckpointError(ValueError):
    """The checkpoint does not match what the model expects; the message lists every problem."""


def validate(model_dir: Path, expected: dict[str, tuple[tuple[int, ...], Any]], ignore: Sequence[str] = ()) -> dict:
    """Returns the tensor index if it matches ``expected`` {name: (shape, axes)} exactly.

    Tensors whose names start with a prefix in ``ignore`` (parts of the checkpoint the model
    does not serve, e.g. a vision tower) may be present and are skipped."""
    try:
        found = index_checkpoint(model_dir)
    except FileNotFoundError as e:
        raise CheckpointError(str(e)) from None
    problems = []
    for name, (shape, _) in expected.items():
        info = found.get(name)
        if info is None:
            problems.append(f"missing tensor {name} (expected shape {list(shape)})")
            continue
        if tuple(info.shape) != tuple(shape):
            problems.append(f"tensor {name} has shape {list(info.shape)}, expected {list(shape)}")
        if info.dtype not in FLOAT_CODES:
            problems.append(f"tensor {name} has dtype {info.dtype}, expected a float type (F32/BF16/F16)")
    for name in sorted(set(found) - set(expected)):
        if name.startswith(tuple(ignore)):
            continue
        problems.append(f"unexpected tensor {name} (shape {list(found[name].shape)})")
    if problems:
        raise CheckpointError(f"checkpoint {model_dir} does not match the model ({len(problems)} problems):\n  "
                              + "\n  ".join(problems))
    return found


def load_params(model_dir: str | Path, expected: dict[str, tuple[tuple[int, ...], Sequence]],
                dtype, mesh: Mesh, progress: bool = True, ignore: Sequence[str] = ()) -> dict[str, jax.Array]:
    """Loads {name: (shape, logical axes)} from ``model_dir`` as sharded arrays of ``dtype``
    (tensors under the ``ignore`` prefixes are allowed and not loaded)."""
    model_dir = Path(model_dir)
    found = validate(model_dir, expected, ignore)
    out = {}
    for name, (shape, axes) in tqdm(expected.items(), desc="loading weights", unit="tensor",
                                    disable=not progress, leave=False):
        lazy = LazyTensor(found[name])
        np_dtype = np.dtype(dtype)
        out[name] = jax.make_array_from_callback(
            tuple(shape), sharding(mesh, axes), lambda idx, lazy=lazy: lazy[idx].astype(np_dtype))
    return out


def random_params(expected: dict[str, tuple[tuple[int, ...], Sequence]], dtype, mesh: Mesh,
                  seed: int = 0, std: float = 0.02) -> dict[str, jax.Array]:
    """Normal(0, std) matrices and unit norm weights, drawn directly on the devices with their
    final sharding; for benchmarks of full-size shapes without a checkpoint."""

    def draw(key, shape):
        if len(shape) == 1:
            return jnp.ones(shape, dtype)
        return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    key = jax.random.key(seed)
    return {name: jax.jit(draw, static_argnums=1, out_shardings=sharding(mesh, axes))(
                jax.random.fold_in(key, i), tuple(shape))
            for i, (name, (shape, axes)) in enumerate(expected.items())}
