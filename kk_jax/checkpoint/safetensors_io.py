"""Lazy reading of safetensors files: header parsing plus ``numpy.memmap`` views.

Nothing is read from disk until a slice of a tensor is asked for, so a loader can copy
exactly one device shard at a time. Handles a single ``model.safetensors`` or a sharded set
described by ``model.safetensors.index.json``.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str              # safetensors dtype code, e.g. "BF16"
    shape: tuple[int, ...]
    start: int              # absolute byte offset in the file
    end: int


class SafetensorsError(ValueError):
    """A safetensors file that cannot be read as one (truncated, corrupt or of an unknown
    dtype); the message names the file and, where it can, the tensor."""


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, each checked to lie inside the file with exactly
    the bytes its dtype and shape need (a truncated or corrupt file fails here, by name,
    instead of at the first read of its data)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if n is None or n > size - 8:
            raise SafetensorsError(f"{path}: not a safetensors file (its {size} bytes hold no "
                                   "complete header)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: corrupt safetensors header (not a JSON object)")
    base = 8 + n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            s, e = (int(x) for x in meta["data_offsets"])
            dtype, shape = meta["dtype"], tuple(int(d) for d in meta["shape"])
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: corrupt header entry for tensor {name}: {meta!r}") from None
        if dtype not in DTYPES:
            raise SafetensorsError(f"{path}: tensor {name} has dtype {dtype}, which kk_jax does not "
                                   f"read (known: {', '.join(DTYPES)})")
        need = int(np.prod(shape, dtype=np.int64)) * np.dtype(DTYPES[dtype]).itemsize
        if not 0 <= s <= e <= size - base or e - s != need:
            raise SafetensorsError(f"{path}: tensor {name} ({dtype} {list(shape)}, {need} bytes) has "
                                   f"data offsets [{s}, {e}) outside the file's {size - base} data "
                                   "bytes or of the wrong length (truncated or corrupt file)")
        out[name] = TensorInfo(name, path, dtype, shape, base + s, base + e)
    return out


def index_checkpoint(model_dir: Path) -> dict[str, TensorInfo]:
    """All tensors of a checkpoint directory by name (single file or sharded index)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    tensors: dict[str, TensorInfo] = {}
    for fname in files:
        path = model_dir / fname
        if not path.is_file():
            raise FileNotFoundError(f"{path} is listed in the index but missing")
        tensors.update(read_header(path))
    return tensors


class LazyTensor:
    """A memory-mapped view of one tensor; slicing reads only the requested bytes."""

    def __init__(self, info: TensorInfo):
        self.info = info
        dtype = np.dtype(DTYPES[info.dtype])
        count = (info.end - info.start) // dtype.itemsize
        self._mm = np.memmap(info.file, dtype=dtype, mode="r", offset=info.start, shape=(count,))

    def __getitem__(self, idx) -> np.ndarray:
        return np.asarray(self._mm.reshape(self.info.shape)[idx])
