"""The embedded default model: a tiny GLM-5.3 checkpoint (``make_tiny --arch glm5_next``: KDA +
pooled sparse attention + MoE + mHC, its chat template and tool-call format) written on first
use into a cache directory (``$XDG_CACHE_HOME/kk_jax`` or ``~/.cache/kk_jax``), so
``python serve.py`` and ``LLM()`` work on a fresh machine with no download.

Batch limits: a real checkpoint gets the engine's serving defaults (EngineConfig: 64 sequences,
512 tokens per step); the embedded demo model gets small ones (:data:`DEMO_LIMITS`) unless given, because
the engine compiles one program per batch bucket at start-up and a CPU machine would spend
minutes on the full bucket set of this hybrid model."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

DEFAULT_NAME = "tiny-glm5"
SERVED_NAME = f"kk_jax/{DEFAULT_NAME}"
DEMO_LIMITS = {"max_num_seqs": 8, "max_num_batched_tokens": 128}


def batch_limits(model, max_num_seqs: int | None, max_num_batched_tokens: int | None) -> dict[str, int]:
    """The batch limits to use: the given ones, else the demo limits when ``model`` is None (the
    embedded model) or EngineConfig's serving defaults."""
    from kk_jax.config import EngineConfig

    base = DEMO_LIMITS if model is None else {k: getattr(EngineConfig, k) for k in DEMO_LIMITS}
    return {"max_num_seqs": max_num_seqs or base["max_num_seqs"],
            "max_num_batched_tokens": max_num_batched_tokens or base["max_num_batched_tokens"]}


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kk_jax"


def default_model_dir() -> Path:
    """Path of the default checkpoint, creating it (atomically) if it does not exist yet."""
    from checkpoints.make_tiny import make_tiny

    target = cache_root() / DEFAULT_NAME
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
        make_tiny(tmp, arch="glm5_next", seed=0)
        try:
            tmp.rename(target)
        except OSError:          # another process won the race
            pass
    return target
