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


def read_header(path: Path) -> dict[str, TensorInfo]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    base = 8 + n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        s, e = meta["data_offsets"]
        out[name] = TensorInfo(name, path, meta["dtype"], tuple(meta["shape"]), base + s, base + e)
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
