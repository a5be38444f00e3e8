"""Validated, sharded loading of HF safetensors checkpoints onto the device mesh.

Every expected tensor is checked (present, shape, dtype) and every unexpected one is listed
before any byte reaches a device; all problems are reported in one ``CheckpointError``. Each
weight is then created with ``jax.make_array_from_callback`` and its final ``NamedSharding``:
each device receives only its own slice, read from the memory map, so no device ever holds
(and the host never materialises per device) a full copy.

``expected`` maps a name to ``(shape, axes)`` (any floating dtype in the checkpoint, cast to
the load dtype) or to a :class:`TensorSpec`, which can also require an exact dtype (quantized
weights and their scales are placed on the device as they are, never converted) and can
assemble one parameter from several checkpoint tensors concatenated along axis 0
(``sources``; fused projections, concatenated per tensor-parallel shard).

A parameter can also be a :class:`Stack` of checkpoint tensors along a new leading axis
(routed experts stored per expert, layers of a scanned group), nested as deep as needed; each
device's slice is then read part by part on the host, so stacked parameters are never
assembled on a device from per-part copies.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

from kk_jax.checkpoint.safetensors_io import LazyTensor, SafetensorsError, index_checkpoint
from kk_jax.parallel.mesh import sharding

FLOAT_CODES = {"F32", "F16", "BF16", "F64"}
# numpy dtype name -> safetensors dtype code, for tensors that must have an exact dtype
DTYPE_CODES = {"float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "uint8": "U8", "int8": "I8",
               "float32": "F32", "bfloat16": "BF16", "float16": "F16", "int32": "I32"}


class CheckpointError(ValueError):
    """The checkpoint does not match what the model expects; the message lists every problem."""


class TensorSpec(NamedTuple):
    """One expected parameter.

    dtype    None: any floating dtype, cast to the load dtype; else the numpy dtype name the
             checkpoint tensor must have exactly (loaded as it is)
    sources  ((checkpoint name, rows), ...): the parameter is these tensors concatenated along
             axis 0; a scalar source with rows == 1 is one row (per-member scalars stacked)
    shards   concatenate per shard: [src0 part s, src1 part s, ...] for s in range(shards)
    transposed  the parameter is the (2-D) checkpoint tensor, or concatenation, transposed:
             ``shape`` and ``axes`` are the parameter's, the checkpoint holds ``shape`` reversed
    """

    shape: tuple
    axes: Sequence
    dtype: str | None = None
    sources: tuple = ()
    shards: int = 1
    transposed: bool = False

    def as_stored(self) -> "TensorSpec":
        """The spec in the checkpoint's orientation."""
        return self._replace(shape=tuple(reversed(self.shape)), transposed=False) if self.transposed else self


def as_spec(value) -> TensorSpec:
    """A TensorSpec from a TensorSpec or a legacy ``(shape, axes)`` pair."""
    if isinstance(value, TensorSpec):
        return value
    shape, axes, *rest = value
    return TensorSpec(tuple(shape), axes, *rest)


def tensor_spec(var) -> TensorSpec:
    """TensorSpec of one (abstract) NNX Variable, from its ``axes``, ``quant_dtype`` (exact
    checkpoint dtype), ``sources`` and ``shards`` metadata; a plain parameter gives the legacy
    ``(shape, axes)`` meaning."""
    meta = var.get_metadata() if hasattr(var, "get_metadata") else {}
    return TensorSpec(tuple(var.shape), meta.get("axes"), meta.get("quant_dtype"),
                      tuple(meta.get("sources") or ()), int(meta.get("shards", 1)), bool(meta.get("transposed")))


def expected_tensors(flat_state) -> dict[str, TensorSpec]:
    """{state path: TensorSpec} of an (abstract) NNX flat state; a path is the checkpoint name."""
    return {".".join(map(str, path)): tensor_spec(v) for path, v in flat_state}


def _check_tensor(name, info, shape, dtype, problems, what="") -> None:
    if dtype is None:
        if tuple(info.shape) != tuple(shape):
            problems.append(f"tensor {name} has shape {list(info.shape)}, expected {list(shape)}{what}")
        if info.dtype not in FLOAT_CODES:
            problems.append(f"tensor {name} has dtype {info.dtype}, expected a float type ({'/'.join(sorted(FLOAT_CODES))})")
        return
    scalar_as_1 = {tuple(shape), tuple(info.shape)} == {(), (1,)}
    if tuple(info.shape) != tuple(shape) and not scalar_as_1:
        problems.append(f"tensor {name} has shape {list(info.shape)}, expected {list(shape)}{what}")
    code = DTYPE_CODES.get(dtype, dtype)
    if info.dtype != code:
        problems.append(f"tensor {name} has dtype {info.dtype}, expected {code} (the checkpoint's quantization "
                        f"config declares it quantized){what}")


def validate(model_dir: Path, expected: dict, ignore: Sequence[str] = ()) -> dict:
    """Returns the tensor index if it matches ``expected`` ({name: (shape, axes) | TensorSpec})
    exactly.

    Tensors whose names start with a prefix in ``ignore`` (parts of the checkpoint the model
    does not serve, e.g. a vision tower) may be present and are skipped."""
    try:
        found = index_checkpoint(model_dir)
    except (FileNotFoundError, SafetensorsError) as e:
        raise CheckpointError(str(e)) from None
    problems, used = [], set()
    for name, value in expected.items():
        spec = as_spec(value).as_stored()
        if not spec.sources:
            used.add(name)
            info = found.get(name)
            if info is None:
                problems.append(f"missing tensor {name} (expected shape {list(spec.shape)})")
                continue
            _check_tensor(name, info, spec.shape, spec.dtype, problems)
            continue
        rows = sum(r for _, r in spec.sources)
        if spec.shape and rows != spec.shape[0]:
            problems.append(f"parameter {name}: its sources hold {rows} rows, expected {spec.shape[0]}")
        for src, r in spec.sources:
            used.add(src)
            info = found.get(src)
            want = (r, *spec.shape[1:])
            if info is None:
                problems.append(f"missing tensor {src} (expected shape {list(want)}, part of {name})")
                continue
            _check_tensor(src, info, want, spec.dtype, problems, f" (part of {name})")
    for name in sorted(set(found) - used):
        if name.startswith(tuple(ignore)):
            continue
        problems.append(f"unexpected tensor {name} (shape {list(found[name].shape)})")
    if problems:
        raise CheckpointError(f"checkpoint {model_dir} does not match the model ({len(problems)} problems):\n  "
                              + "\n  ".join(problems))
    return found


class _ScalarRow(NamedTuple):
    """A scalar checkpoint tensor read as a one-row array (a stacked per-member scalar)."""
    lazy: LazyTensor

    def __getitem__(self, idx):
        return np.asarray(self.lazy[...]).reshape(1)[idx]


def _fused_reader(spec: TensorSpec, found: dict, cast):
    """Callback reading any device slice of a parameter concatenated from ``spec.sources``."""
    def lazy(src, r):
        tensor = LazyTensor(found[src])
        return _ScalarRow(tensor) if r == 1 and tuple(found[src].shape) == () else tensor

    lazies = [(lazy(src, r), r) for src, r in spec.sources]
    segments = []                                              # (lazy, first row, rows) in fused order
    for s in range(spec.shards):
        for lz, r in lazies:
            part = r // spec.shards
            segments.append((lz, s * part, part))

    def read(idx):
        start, stop, _ = (idx[0] if idx else slice(None)).indices(spec.shape[0])
        pieces, pos = [], 0
        for lz, first, n in segments:
            lo, hi = max(start, pos), min(stop, pos + n)
            if lo < hi:
                pieces.append(lz[(slice(first + lo - pos, first + hi - pos),) + tuple(idx[1:])])
            pos += n
        return cast(np.concatenate(pieces, axis=0))
    return read


class Stack(NamedTuple):
    """A parameter stacked along a new axis 0 from ``parts`` (checkpoint tensor names, or Stacks
    for deeper stacking); ``transpose``: each part is stored transposed (HF ``[out, in]``
    expert weights and their scales, stacked as ``[in, out]``)."""

    parts: tuple
    transpose: bool = False


def _reader(name: str, spec: TensorSpec, found: dict, dtype):
    """Callback reading any device slice of expected tensor ``name`` (cast to ``dtype`` unless
    the spec requires an exact dtype)."""
    if spec.transposed:
        stored = _reader(name, spec.as_stored(), found, dtype)
        return lambda idx: stored(tuple(reversed(idx))).T
    np_dtype = np.dtype(dtype) if spec.dtype is None else None
    cast = (lambda a: a.astype(np_dtype)) if np_dtype is not None else (lambda a: a)
    if spec.sources:
        return _fused_reader(spec, found, cast)
    lazy = LazyTensor(found[name])
    if tuple(spec.shape) == () and tuple(found[name].shape) == (1,):          # a scalar stored as [1]
        return lambda idx: cast(lazy[...].reshape(()))[idx]
    return lambda idx: cast(lazy[idx])


def _stack_reader(stack: Stack, part_reader):
    parts = [_stack_reader(p, part_reader) if isinstance(p, Stack) else part_reader(p) for p in stack.parts]

    def read(idx):
        first, rest = (idx[0], tuple(idx[1:])) if idx else (slice(None), ())
        if stack.transpose:
            return np.stack([parts[i](rest[::-1]).T for i in range(len(parts))[first]])
        return np.stack([parts[i](rest) for i in range(len(parts))[first]])
    return read


def load_params(model_dir: str | Path, expected: dict, dtype, mesh: Mesh, progress: bool = True,
                ignore: Sequence[str] = (), stacks: dict[str, tuple[TensorSpec, Stack]] | None = None
                ) -> dict[str, jax.Array]:
    """Loads {name: (shape, logical axes) | TensorSpec} from ``model_dir`` as sharded arrays:
    floating tensors as ``dtype``, exact-dtype (quantized) tensors as they are (tensors under
    the ``ignore`` prefixes are allowed and not loaded). ``stacks`` {param name: (spec of the
    stacked param, Stack of expected names)} places those params instead of their parts."""
    model_dir = Path(model_dir)
    found = validate(model_dir, expected, ignore)
    stacks = stacks or {}
    stacked = {n for _, st in stacks.values() for n in _names(st)}
    part_reader = lambda n: _reader(n, as_spec(expected[n]), found, dtype)
    todo = [(name, as_spec(value), None) for name, value in expected.items() if name not in stacked]
    todo += [(name, spec, st) for name, (spec, st) in stacks.items()]
    out = {}
    for name, spec, st in tqdm(todo, desc="loading weights", unit="tensor", disable=not progress, leave=False):
        read = part_reader(name) if st is None else _stack_reader(st, part_reader)
        out[name] = jax.make_array_from_callback(tuple(spec.shape), sharding(mesh, spec.axes or ()), read)
    check_scales(out, model_dir)
    return out


SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale")


def check_scales(params: dict[str, jax.Array], model_dir) -> None:
    """CheckpointError naming every quantization scale parameter (``Linear`` ``.weight_scale``
    ..., stacked experts' ``{proj}_weight_scale`` ...) that holds a value no weight can be
    scaled by: an E8M0 byte 255 (the format's NaN) or a non-finite float (e4m3 NaN, fp32 inf or
    NaN), which would turn every output of its layer into NaN. One reduction a scale tensor,
    compiled together; scales are 1/16 of a layer's weight bytes or fewer."""
    names = [n for n in params if n.endswith(SCALE_SUFFIXES)]
    if not names:
        return

    def invalid(x):
        if x.dtype == jnp.uint8:
            return jnp.any(x == 255)
        return jnp.any(~jnp.isfinite(x.astype(jnp.float32)))

    flags = np.asarray(jax.jit(lambda xs: jnp.stack([invalid(x) for x in xs]))([params[n] for n in names]))
    bad = [n for n, f in zip(names, flags) if f]
    if bad:
        raise CheckpointError(f"checkpoint {model_dir} has quantization scales that are not numbers (E8M0 byte "
                              f"255, or inf / NaN) in {len(bad)} parameters: {', '.join(bad)}")


def _names(stack: Stack):
    for p in stack.parts:
        yield from _names(p) if isinstance(p, Stack) else (p,)


def abstract_params(expected: dict, dtype, mesh: Mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """Shape, dtype and sharding of every tensor ``random_params`` would draw, allocating
    nothing: the weights of a compile-only runner."""
    out = {}
    for name, value in expected.items():
        spec = as_spec(value)
        out[name] = jax.ShapeDtypeStruct(tuple(spec.shape), spec.dtype or dtype, sharding=sharding(mesh, spec.axes or ()))
    return out


def random_params(expected: dict, dtype, mesh: Mesh, seed: int = 0, std: float = 0.02,
                  stacked: frozenset[str] = frozenset()) -> dict[str, jax.Array]:
    """Normal(0, std) matrices and ones for vectors (norm weights), drawn directly on the devices
    with their final sharding; for benchmarks of full-size shapes without a checkpoint.
    ``stacked``: names of parameters stacked over layers along a new axis 0 (a stacked vector is
    ones too). Exact-dtype (quantized) tensors get random codes and scales of their own dtype."""

    def draw(key, shape, exact, is_scale, vector):
        if exact is not None:
            t = jnp.dtype(exact)
            if jnp.issubdtype(t, jnp.integer):       # E8M0 scales near 2^-6, else any byte
                lo, hi = (118, 124) if is_scale else (0, 256)
                return jax.random.randint(key, shape, lo, hi, jnp.int32).astype(t)
            if t == jnp.float32:                      # dequantization scales
                return jnp.full(shape, std / 64.0, t)
            return (jnp.abs(jax.random.normal(key, shape, jnp.float32)) if is_scale
                    else jax.random.normal(key, shape, jnp.float32)).astype(t)
        if vector:
            return jnp.ones(shape, dtype)
        return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    key = jax.random.key(seed)
    out = {}
    for i, (name, value) in enumerate(expected.items()):
        spec = as_spec(value)
        vector = len(spec.shape) - (name in stacked) == 1
        out[name] = jax.jit(draw, static_argnums=(1, 2, 3, 4), out_shardings=sharding(mesh, spec.axes or ()))(
            jax.random.fold_in(key, i), tuple(spec.shape), spec.dtype, "scale" in name.rsplit(".", 1)[-1], vector)
    return out
