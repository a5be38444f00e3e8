"""Shared pytest setup.

This file sits at the root of ``tests/``, so pytest (prepend import mode) puts ``tests/`` on
``sys.path``: test helpers import as ``from oracles.qwen3_numpy import ...``. The repository
root is appended too, so the checkpoint tools import as ``from checkpoints.make_tiny import
make_tiny`` however pytest is started. Test folders carry no ``__init__.py`` (a
``tests/checkpoints/__init__.py`` would shadow the top-level ``checkpoints`` package), so test
file names must be unique across the suite.
"""

import os
import sys
from pathlib import Path

# Four host devices so tensor-parallel tests (tp = 2, 4) run on CPU; set before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.append(_ROOT)


import jax  # noqa: E402
import pytest  # noqa: E402

# Single-device CPU computations run inline in the calling thread. The Mosaic GPU interpreter
# (interpret-mode kernel tests) evaluates jnp expressions inside its io_callbacks; with
# asynchronous dispatch such a nested computation can queue behind the computation that is
# waiting for the callback, and the test process hangs (seen once in a full suite run: a
# callback of the grouped MoE kernel blocked in `wait_smem_to_gmem`).
jax.config.update("jax_cpu_enable_async_dispatch", False)     # before the CPU client exists


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """A float32 tiny Qwen3 checkpoint (tied embeddings) shared by the whole session."""
    from checkpoints.make_tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-f32"), arch="qwen3", seed=0, dtype="float32")


@pytest.fixture(scope="session")
def tiny_ckpt_untied(tmp_path_factory):
    from checkpoints.make_tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-untied"), arch="qwen3", seed=1, dtype="float32",
                     tie_word_embeddings=False, shards=2)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need an NVIDIA GPU: skipped anywhere else (CI has none)."""
    import jax

    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
