"""Helpers shared by the Mosaic GPU kernels of this package."""

from jax.experimental.pallas import mosaic_gpu as plgpu


def interpret_kwargs(interpret) -> dict:
    """``plgpu.kernel`` arguments for Mosaic GPU interpret mode (CPU tests): ``interpret`` may be
    True or an ``InterpretGPUParams``; empty when compiling for the GPU."""
    if not interpret:
        return {}
    return {"interpret": interpret if isinstance(interpret, plgpu.InterpretGPUParams) else plgpu.InterpretGPUParams()}
