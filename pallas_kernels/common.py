"""Helpers shared by the Mosaic GPU kernels of this package."""

import ctypes
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, vector
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

SMEM_PER_CTA = 227 * 1024   # the most shared memory a CTA may use on the H100 / H200 (bytes)
SMEM_PER_SM = 228 * 1024    # shared memory of an SM, shared by its resident CTAs (bytes)
CTA_SMEM_RESERVE = 2 * 1024  # what each resident CTA takes of it besides its own (1 KiB), plus
                             # Mosaic's barriers and alignment


def check_matmul_io(x, out_dtype) -> None:
    """ValueError unless the activations ``x`` are floating point (they enter the tensor cores
    as bf16) and ``out_dtype``, when given, is a floating type: an integer x or result has no
    meaning for a quantized-weight matmul."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be a floating-point array (bf16 or f32), got {x.dtype}")
    if out_dtype is not None and not jnp.issubdtype(jnp.dtype(out_dtype), jnp.floating):
        raise ValueError(f"out_dtype must be a floating type, got {jnp.dtype(out_dtype)}")


def no_rows(x, n: int, out_dtype):
    """The product of an ``x`` without rows (a zero-size leading dimension) with an [N, K]
    weight: zeros [..., N] in ``out_dtype`` (default x's), without launching a kernel on an
    empty grid."""
    return jnp.zeros(x.shape[:-1] + (n,), out_dtype or x.dtype)


def product_dtype(out_dtype):
    """The result type to ask of XLA's dot when the product is wanted in ``out_dtype``: bf16 and
    fp32 as they are (XLA sums in fp32 either way and rounds once, bit for bit the fp32 result
    cast), other types fp32 (then cast). An fp32 result cast afterwards costs XLA a second kernel:
    a bf16 [M, K] x [K, N] product with N, K = 4096-12288 took up to 21 % longer on one H200 at
    M = 2048-8192 and 7-27 % longer at M = 1 (RESULTS.md 2026-12-02 part 34)."""
    out_dtype = jnp.dtype(out_dtype)
    return out_dtype if out_dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)) else jnp.dtype(jnp.float32)


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


_PROBE_PTX = b".version 7.8\n.target sm_90\n.address_size 64\n.visible .entry probe() { ret; }\n"


class _LaunchAttr(ctypes.Structure):      # CUlaunchAttribute: id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):    # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttr)), ("n_attrs", ctypes.c_uint)]


@functools.cache
def max_active_clusters(size: int, ctas_per_sm: int, threads: int = 128) -> int:
    """Clusters of ``size`` CTAs of ``threads`` threads that the default GPU runs at once when
    shared memory lets ``ctas_per_sm`` CTAs share an SM: the CUDA driver's occupancy answer for a
    kernel sized so. A cluster's CTAs share one GPU processing cluster (GPC), so this can be
    below ``num_sms() * ctas_per_sm // size``: the H200 holds 92 clusters of 4 CTAs at 3 CTAs an
    SM, not 99, and 30 of 33 at one (RESULTS.md, part 32); clusters of 2 fill every place. A
    grid of more clusters runs part of them after the others, or with an extra CTA on some SMs.
    Without a GPU or its driver, that upper bound."""
    bound = num_sms() * ctas_per_sm // size
    try:
        return min(bound, _driver_max_clusters(size, ctas_per_sm, threads))
    except (RuntimeError, OSError):
        return bound


def _driver_max_clusters(size: int, ctas_per_sm: int, threads: int) -> int:
    """``cuOccupancyMaxActiveClusters`` for an empty kernel (`_PROBE_PTX`) whose dynamic shared
    memory lets ``ctas_per_sm`` CTAs share an SM, on the default GPU's primary context."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        raise RuntimeError("no GPU")
    cu = ctypes.CDLL("libcuda.so.1")

    def call(name, *args):
        if getattr(cu, name)(*args):
            raise OSError(f"{name} failed")

    handle, ctx, mod, fn = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    per_sm, reserved, n = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    call("cuInit", 0)
    call("cuDeviceGet", ctypes.byref(handle), dev.local_hardware_id)
    call("cuDeviceGetAttribute", ctypes.byref(per_sm), 81, handle)       # shared memory an SM
    call("cuDeviceGetAttribute", ctypes.byref(reserved), 111, handle)    # reserved a CTA
    smem = per_sm.value // ctas_per_sm - reserved.value
    attr = _LaunchAttr(id=4)                                             # cluster dimension
    attr.value[:3] = (size, 1, 1)
    config = _LaunchConfig((ctypes.c_uint * 3)(size, 1, 1), (ctypes.c_uint * 3)(threads, 1, 1), smem,
                           None, ctypes.pointer(attr), 1)
    call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), handle)
    try:
        call("cuCtxPushCurrent_v2", ctx)
        try:
            call("cuModuleLoadData", ctypes.byref(mod), ctypes.c_char_p(_PROBE_PTX))
            try:
                call("cuModuleGetFunction", ctypes.byref(fn), mod, b"probe")
                call("cuFuncSetAttribute", fn, 8, smem)                  # most dynamic shared memory
                call("cuOccupancyMaxActiveClusters", ctypes.byref(n), fn, ctypes.byref(config))
                return n.value
            finally:
                cu.cuModuleUnload(mod)
        finally:
            cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        cu.cuDevicePrimaryCtxRelease_v2(handle)


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


def cst(v, ty=None):
    """Inside inline Mosaic GPU code: the constant v of type ty (i32 unless given)."""
    return mgpu_utils.c(v, ty if ty is not None else ir.IntegerType.get_signless(32))


def ix(v):
    """Inside inline Mosaic GPU code: an integer value as an index."""
    return arith.index_cast(ir.IndexType.get(), v)


def gpu_fence():
    """fence.acq_rel.gpu by every thread, then a warpgroup barrier: what all threads of a CTA
    wrote to global memory is visible GPU-wide before any of them arrives on a cluster barrier,
    and a CTA reading other CTAs' writes after its wait on that barrier sees them."""
    @plgpu.inline_mgpu()
    def fence(_):
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "fence.acq_rel.gpu;", "", has_side_effects=True)
        mgpu_utils.warpgroup_barrier()

    fence()


# PTX taking a pair of fp32 registers (the last two operands; element 0 goes to the low half of
# each bf16x2 word) to one (_CVT_PAIR) or two (_SPLIT_PAIR: hi, lo) bf16x2 words
_CVT_PAIR = "cvt.rn.bf16x2.f32 $0, $2, $1;"
_SPLIT_PAIR = """{
\t.reg .b32 t0, t1;
\tcvt.rn.bf16x2.f32 $0, $3, $2;
\tshl.b32 t0, $0, 16;
\tand.b32 t1, $0, 0xffff0000;
\tsub.f32 t0, $2, t0;
\tsub.f32 t1, $3, t1;
\tcvt.rn.bf16x2.f32 $1, t1, t0;
}"""


def bf16x2_word(lo, hi):
    """Inline: fp32 ``lo``, ``hi`` -> one bf16x2 word (i32, ``lo`` in the low half), each rounded
    to the nearest even bf16."""
    return llvm.inline_asm(ir.IntegerType.get_signless(32), [lo, hi], _CVT_PAIR, "=r,f,f")


def e4m3x2_to_f32(pair):
    """Inline: i16 holding two e4m3 bytes -> [fp32 of the low byte, fp32 of the high byte], exact
    (`cvt.rn.f16x2.e4m3x2`, then f16 -> fp32)."""
    f32x2 = ir.VectorType.get((2,), ir.F32Type.get())
    h = llvm.inline_asm(ir.IntegerType.get_signless(32), [pair], "cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h")
    v = arith.extf(f32x2, mgpu_utils.bitcast(h, ir.VectorType.get((2,), ir.F16Type.get())))
    return [vector.extract(v, [], [0]), vector.extract(v, [], [1])]


def _pairwise_bf16(x, layout, asm, n_out):
    """``n_out`` bf16 arrays of ``x``'s shape from fp32 ``x`` (in ``layout``), each pair of
    elements turned into ``n_out`` bf16x2 words by the PTX ``asm``."""
    out = plgpu.ShapeDtypeStruct(x.shape, jnp.bfloat16, layout=layout)

    @plgpu.inline_mgpu(arg_types=(layout,), return_type=(out,) * n_out)
    def convert(_, a):
        i32 = ir.IntegerType.get_signless(32)
        ret = i32 if n_out == 1 else llvm.StructType.get_literal([i32] * n_out)
        pair = ir.VectorType.get((2,), ir.BF16Type.get())
        regs = [np.empty_like(a.registers) for _ in range(n_out)]
        for idx, reg in np.ndenumerate(a.registers):
            n = ir.VectorType(reg.type).shape[0]
            if n % 2:
                raise NotImplementedError(f"packed bf16 conversion: odd register width {n}")
            words = [[] for _ in range(n_out)]
            for i in range(0, n, 2):
                res = llvm.inline_asm(ret, [vector.extract(reg, [], [i + j]) for j in (0, 1)], asm,
                                      ",".join(["=r"] * n_out + ["f", "f"]))
                for o in range(n_out):
                    word = res if n_out == 1 else llvm.extractvalue(i32, res, [o])
                    words[o].append(mgpu_utils.bitcast(word, pair))
            for o in range(n_out):
                regs[o][idx] = mgpu_utils.vector_concat(words[o])
        return tuple(mgpu.FragmentedArray(_registers=r, _layout=a.layout, _is_signed=None)
                     for r in regs)

    return convert(x)


def to_bf16(x, *, interpret=False, layout=plgpu.Layout.WGMMA):
    """fp32 ``x`` (a kernel value in ``layout``) rounded to bf16, bit-identical to
    ``x.astype(bf16)``: one packed ``cvt.rn.bf16x2.f32`` per pair of elements, where LLVM emits
    two scalar conversions and a repack whenever the rounded value is used as fp32 again.
    Interpret mode (which cannot run inline Mosaic GPU code) runs ``astype``."""
    if interpret:
        return x.astype(jnp.bfloat16)
    return _pairwise_bf16(x, layout, _CVT_PAIR, 1)[0]


def bf16_split(x, *, interpret=False, layout=plgpu.Layout.WGMMA):
    """fp32 ``x`` (a kernel value in ``layout``) as bf16 ``hi, lo``, hi = RN(x), lo = RN(x - hi),
    so x = hi + lo + O(2^-16 |x|): the operands of a 3-pass bf16 product. On the GPU a pair of
    elements costs six instructions (two of them packed conversions); bit-identical to the jnp
    form, which interpret mode runs. (With it and `to_bf16`, the KDA intra-chunk kernel went
    from 7.1k to 6.6k PTX instructions and the 32K prefill from 2.29 to 2.15 ms on the H200.)"""
    if interpret:
        hi = x.astype(jnp.bfloat16)
        return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)
    return _pairwise_bf16(x, layout, _SPLIT_PAIR, 2)
