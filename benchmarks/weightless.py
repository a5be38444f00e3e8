"""Weightless checkpoint directories for random-weight benchmarks: only the quantization config,
so that ``ModelRunner(..., random_weights_seed=...)`` holds the declared layers quantized (random
codes and scales of the real dtypes and shapes) exactly as a quantized checkpoint would."""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path

# the block each format's scales cover (rows, columns), as the checkpoint formats declare them
BLOCKS = {"fp8_block": (128, 128), "mxfp8": (1, 32), "nvfp4": (1, 16)}


def quantized_dir(directory: Path, fmt: str, exclude: tuple[str, ...] = ()) -> Path:
    """Writes ``config.json`` (and ModelOpt's ``hf_quant_config.json`` where the format has one)
    declaring every linear layer quantized in ``fmt`` except the ``exclude`` patterns."""
    from kk_jax.quant.config import QuantConfig

    qc, hf_quant = QuantConfig(fmt, BLOCKS[fmt], tuple(exclude)).to_hf()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"quantization_config": qc}))
    if hf_quant is not None:
        (directory / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return directory


@contextlib.contextmanager
def model_dir(fmt: str):
    """A temporary :func:`quantized_dir` quantizing every linear but the lm_head in ``fmt``, or
    None for "bf16" (a random-weight model without a checkpoint). The directory only needs to
    live while the ``ModelRunner`` is built (it reads the quantization config then)."""
    if fmt == "bf16":
        yield None
        return
    with tempfile.TemporaryDirectory() as tmp:
        yield quantized_dir(Path(tmp), fmt, exclude=("lm_head",))
