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


def hand_synced(**params) -> plgpu.CompilerParams:
    """``CompilerParams(**params)`` for a kernel that orders its shared-memory accesses itself.

    By default Pallas puts a warpgroup barrier before and after every SMEM store and before
    every TMA load; a loop of small stores pays two per store (the KDA cumsum walk: 128 per
    64-row tile). A kernel built with these parameters keeps this contract instead:
      - a thread rewrites only SMEM elements it read itself, in the same layout;
      - every hand-off between threads, to the tensor cores or to TMA passes through
        ``commit_smem`` (fence + warpgroup barrier), a TMA wait (it ends in a barrier), an
        mbarrier wait, or a cross-warp reduction (it has barriers of its own);
      - after a ``wgmma`` that reads SMEM, a barrier comes before any store into its operands
        (another warp's share of the product may still be reading them).
    Mosaic GPU's interpreter with race detection finds a TMA copy that overtakes the loads or
    stores it must follow (the KDA kernels are tested so); a missing barrier between the warps
    of one warpgroup, or before a store into a wgmma operand, only the GPU tests can show."""
    return plgpu.CompilerParams(unsafe_no_auto_barriers=True, **params)
