"""Helpers shared by the Mosaic GPU kernels of this package."""

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu


def num_sms() -> int:
    """Multiprocessor count of the default GPU (132 on an H200; 132 without a GPU, e.g. for
    interpret mode and compile-only H200 targets)."""
    try:
        dev = jax.devices()[0]
        if dev.platform == "gpu" and getattr(dev, "core_count", None):
            return int(dev.core_count)
    except RuntimeError:
        pass
    return 132


def interpret_kwargs(interpret) -> dict:
    """``plgpu.kernel`` arguments for Mosaic GPU interpret mode (CPU tests): ``interpret`` may be
    True or an ``InterpretGPUParams``; empty when compiling for the GPU."""
    if not interpret:
        return {}
    return {"interpret": interpret if isinstance(interpret, plgpu.InterpretGPUParams) else plgpu.InterpretGPUParams()}
