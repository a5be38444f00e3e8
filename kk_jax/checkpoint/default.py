"""The embedded default model: a tiny Qwen3 checkpoint written on first use into a cache
directory (``$XDG_CACHE_HOME/kk_jax`` or ``~/.cache/kk_jax``), so ``python serve.py`` and
``LLM()`` work on a fresh machine with no download."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

DEFAULT_NAME = "tiny-qwen3"


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kk_jax"


def default_model_dir() -> Path:
    """Path of the default checkpoint, creating it (atomically) if it does not exist yet."""
    from checkpoints.make_tiny import make_tiny

    target = cache_root() / DEFAULT_NAME
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
        make_tiny(tmp, arch="qwen3", seed=0)
        try:
            tmp.rename(target)
        except OSError:          # another process won the race
            pass
    return target
