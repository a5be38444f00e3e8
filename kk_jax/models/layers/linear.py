"""Linear layers over weights stored in the Hugging Face layout ``[out_features, in_features]``,
in floating point or kept quantized (block FP8, ModelOpt MXFP8 / NVFP4).

Keeping the checkpoint layout lets the loader place tensors without transposing on the
host; XLA contracts the transposed operand for free. Models build every projection as a
plain ``Linear``; :func:`quantize_linears` then turns the ones a checkpoint quantizes into
quantized layers *before anything is loaded* (the model code never changes with the format):

    ============  =====================================================================
    method        tensors next to ``weight`` (names, dtypes and shapes of the checkpoint)
    ============  =====================================================================
    (none)        weight [N, K] model dtype
    fp8_block     weight e4m3 [N, K], weight_scale_inv f32 [ceil(N/128), ceil(K/128)]
    mxfp8         weight e4m3 [N, K], weight_scale uint8 [N, K/32]
    nvfp4         weight uint8 [N, K/2], weight_scale e4m3 [N, K/16], weight_scale_2 f32 [],
                  input_scale f32 [] when the checkpoint has it (unused: activations stay bf16)
    ============  =====================================================================

On the device every tensor keeps its checkpoint layout except the MXFP8 / NVFP4 block scales,
held transposed (``[K/32 or K/16, N]``, :data:`TRANSPOSED_SCALES`; the loader transposes them
while placing them): the dequantizing kernels copy each K step's scales for 64 consecutive rows
into shared memory with the weight tile, one TMA tile whose rows are then 64 contiguous bytes
(in the checkpoint layout they would be 2-8 bytes, below TMA's 16-byte minimum).

The call is the same for every method: ``y = linear(x)``, x ``[..., K]`` -> ``[..., N]`` in
x's dtype with fp32 accumulation. Quantized weights stay quantized in device memory and are
dequantized inside ``pallas_kernels.{fp8_block,mxfp8,nvfp4}.matmul`` (``backend="pallas"``,
inside ``jax.shard_map`` over ``tp``) or by their jnp twins (``backend="xla"``, partitioned by
XLA). Block FP8 runs W8A16 unless ``act_quant`` asks for the release's W8A8 numerics.
Unquantized weights run XLA's dot, or at batch-1 decode the weight-streaming
``pallas_kernels.dense_matmul`` when the engine's ``dense_decode_backend`` resolves to pallas (the default on a GPU;
:func:`dense_kernel_takes`).

:class:`FusedLinear` computes several projections of the same input as one matmul along N
(an MLP's gate and up, an attention's q, k and v: :func:`fuse_projections`). Its weight is the
members' checkpoint tensors concatenated along N at load time (per tensor-parallel shard, so
each device holds whole rows of its own heads of every member); mixing formats, in
particular MXFP8 and non-MXFP8 members, is rejected by :func:`quantize_linears` before any
weight is read.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from kk_jax.parallel.mesh import TP, spec
from kk_jax.quant.config import OPTIONAL_TENSORS, QuantConfig
from pallas_kernels.common import product_dtype

E4M3 = jnp.float8_e4m3fn
# Quantization tensors held transposed on the device (see the module docstring)
TRANSPOSED_SCALES = ("weight_scale",)
# The tensors a linear's kernel call takes, in order (the kernels' and jnp twins' arguments;
# None: an unquantized weight, for the dense kernel)
OPERANDS = {None: ("weight",), "fp8_block": ("weight", "weight_scale_inv"), "mxfp8": ("weight", "weight_scale"),
            "nvfp4": ("weight", "weight_scale", "weight_scale_2")}


class QuantLayoutError(ValueError):
    """A layer cannot hold the requested quantized format (shapes, tensor parallelism, fusion)."""


def quant_tensor_specs(method: str, n: int, k: int, block=(128, 128), optional: Iterable[str] = ()) -> dict:
    """{tensor suffix: (shape, dtype, sharded-like-weight)} of one quantized linear [n, k]."""
    if method == "fp8_block":
        return {"weight": ((n, k), E4M3, True),
                "weight_scale_inv": ((math.ceil(n / block[0]), math.ceil(k / block[1])), jnp.float32, True)}
    if method == "mxfp8":
        if k % 32:
            raise QuantLayoutError(f"MXFP8 needs in_features to be a multiple of 32, got {k}")
        return {"weight": ((n, k), E4M3, True), "weight_scale": ((n, k // 32), jnp.uint8, True)}
    if method == "nvfp4":
        if k % 16:
            raise QuantLayoutError(f"NVFP4 needs in_features to be a multiple of 16, got {k}")
        specs = {"weight": ((n, k // 2), jnp.uint8, True), "weight_scale": ((n, k // 16), E4M3, True),
                 "weight_scale_2": ((), jnp.float32, False)}
        if "input_scale" in optional:
            specs["input_scale"] = ((), jnp.float32, False)
        return specs
    raise QuantLayoutError(f"unknown quantization method {method!r}")


def _param(shape, dtype, axes, suffix: str = "", **meta):
    """A parameter whose checkpoint tensor must have exactly ``dtype`` (``quant_dtype`` metadata);
    ``shape`` and ``axes`` are the checkpoint's, reversed on the device for TRANSPOSED_SCALES."""
    if suffix in TRANSPOSED_SCALES:
        shape, axes, meta = tuple(reversed(shape)), tuple(reversed(axes)), {**meta, "transposed": True}
    return nnx.Param(jnp.zeros(shape, dtype), axes=axes, quant_dtype=jnp.dtype(dtype).name, **meta)


class Linear(nnx.Module):
    """``y[..., o] = sum_i x[..., i] * weight[o, i] (+ bias[o])``.

    ``axes`` names the logical axes of ``weight`` (e.g. ``("heads", "embed")`` for a
    column-parallel projection, ``("embed", "heads")`` for a row-parallel one).
    """

    def __init__(self, in_features: int, out_features: int, dtype, axes: tuple, bias: bool = False):
        self.in_features, self.out_features, self.axes = in_features, out_features, tuple(axes)
        self.quant: str | None = None      # static: None | "fp8_block" | "mxfp8" | "nvfp4"
        self.block = (128, 128)
        self.backend = "xla"
        self.mesh = None
        self.act_quant = False
        self.interpret = False
        self.wide_scales = False           # static: MXFP8 scales the 2-16-row GEMV cannot take (`mark_wide_scales`)
        self.weight = nnx.Param(jnp.zeros((out_features, in_features), dtype), axes=axes)
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype), axes=axes[:1]) if bias else None

    # ------------------------------------------------------------------ quantization
    def quantize_(self, method: str, *, block=(128, 128), optional: Iterable[str] = (), backend: str = "xla",
                  mesh=None, act_quant: bool = False, interpret: bool = False, name: str = "") -> None:
        """Re-declares the parameters for ``method`` (zeros of the checkpoint's dtypes/shapes)."""
        n, k = self.out_features, self.in_features
        try:
            specs = quant_tensor_specs(method, n, k, block, optional)
            check_tp_layout(method, n, k, (_tp_shards(self.axes, mesh, 0), _tp_shards(self.axes, mesh, 1)), block)
            check_kernel_block(method, block, backend)
        except QuantLayoutError as e:
            raise QuantLayoutError(f"{name or 'linear'}: {e}") from None
        for suffix, (shape, dtype, sharded) in specs.items():
            setattr(self, suffix, _param(shape, dtype, self.axes if sharded else (), suffix))
        self.quant, self.block, self.backend, self.mesh = method, tuple(block), backend, mesh
        self.act_quant, self.interpret = act_quant, interpret

    def _quant_operands(self) -> tuple:
        return tuple(getattr(self, s)[...] for s in OPERANDS[self.quant])

    def __call__(self, x: jax.Array, *, norm=None, residual: jax.Array | None = None) -> jax.Array:
        """x [..., K] -> [..., N] in x's dtype. ``norm`` (an RMSNorm module) normalises x first;
        ``residual`` [..., N] is added to the result (in x's dtype). Both run inside the one-row
        GEMV where it can take them (:func:`gemv_fuses`), else as separate ops."""
        fuse = gemv_fuses(self, x, norm, residual)
        if norm is not None and not fuse:
            x = norm(x)
        # the layer's dtype straight from the product (fp32 sums rounded once, no fp32 output pass:
        # `product_dtype`) unless a bias or a psum of row-parallel partials follows
        exact_out = self.bias is not None or _tp_shards(self.axes, self.mesh, 1) > 1
        if self.quant is None and not dense_kernel_takes(self, x):
            y = jnp.einsum("...i,oi->...o", x, self.weight[...],
                           preferred_element_type=jnp.float32 if exact_out else product_dtype(x.dtype))
        else:
            y = linear_matmul(x, self._quant_operands(), method=self.quant, axes=self.axes, block=self.block,
                              backend=self.backend, mesh=self.mesh, act_quant=self.act_quant,
                              interpret=self.interpret, out_dtype=jnp.float32 if exact_out else x.dtype,
                              norm=norm if fuse else None, residual=residual if fuse else None,
                              wide_scales=self.wide_scales)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        y = y.astype(x.dtype)
        return residual + y if residual is not None and not fuse else y

    def dense_weight(self, dtype=None) -> jax.Array:
        """The ``[out, in]`` weight in floating point (dequantized if quantized), for code that needs
        the matrix itself (e.g. MLA weight absorption)."""
        if self.quant is None:
            w = self.weight[...]
            return w if dtype is None else w.astype(dtype)
        return dequantize(self.quant, self._quant_operands(), self.block, dtype or jnp.bfloat16)


class FusedLinear(nnx.Module):
    """Several projections of one input as a single matmul along N.

    ``members`` are the checkpoint module names (e.g. ``model.layers.0.self_attn.k_proj``) and
    their ``out_features``. The fused parameters carry ``sources`` metadata that tells the loader
    which checkpoint tensors to concatenate; on a tensor-parallel mesh the concatenation is
    done per shard (``[m0_shard0, m1_shard0, m0_shard1, ...]``) so that :meth:`split` of the
    output is local to each device.
    """

    def __init__(self, in_features: int, members: Sequence[tuple[str, int]], dtype, axes: tuple):
        if not members:
            raise QuantLayoutError("FusedLinear needs at least one member")
        self.in_features, self.axes = in_features, tuple(axes)
        self.members = tuple((str(name), int(n)) for name, n in members)
        self.out_features = sum(n for _, n in self.members)
        self.quant: str | None = None
        self.block = (128, 128)
        self.backend, self.mesh, self.act_quant, self.interpret = "xla", None, False, False
        self.wide_scales = False
        self.shards = 1
        self.weight = nnx.Param(jnp.zeros((self.out_features, in_features), dtype), axes=axes,
                                sources=self._sources("weight", 1))

    def _sources(self, suffix: str, rows_per_row: float) -> tuple:
        """((checkpoint tensor, rows), ...) in member order."""
        return tuple((f"{name}.{suffix}", int(n * rows_per_row)) for name, n in self.members)

    def quantize_(self, method: str | None, *, block=(128, 128), optional: Iterable[str] = (), backend="xla",
                  mesh=None, act_quant=False, interpret=False, name: str = "") -> None:
        """Declares the fused parameters for ``method`` (None: floating point) and the tp layout."""
        n, k = self.out_features, self.in_features
        shards = _tp_shards(self.axes, mesh, 0)
        for member, nm in self.members:
            if nm % shards:
                raise QuantLayoutError(f"{name}: member {member} has {nm} rows, not divisible by tp={shards}")
            if method == "fp8_block" and (nm // shards) % block[0]:
                raise QuantLayoutError(f"{name}: block-FP8 member {member} has {nm} rows; fusing needs each "
                                       f"member's rows per shard ({nm // shards}) to be a multiple of {block[0]}")
        self.shards = shards
        dtype = self.weight.dtype
        if method is None:
            self.weight = nnx.Param(jnp.zeros((n, k), dtype), axes=self.axes,
                                    sources=self._sources("weight", 1), shards=shards)
            return
        try:
            specs = quant_tensor_specs(method, n, k, block, optional)
            check_tp_layout(method, n, k, (_tp_shards(self.axes, mesh, 0), _tp_shards(self.axes, mesh, 1)), block)
            check_kernel_block(method, block, backend)
        except QuantLayoutError as e:
            members = ", ".join(m for m, _ in self.members)
            raise QuantLayoutError(f"{name or 'fused linear'} ({members}): {e}") from None
        for suffix, (shape, dt, sharded) in specs.items():
            if sharded:
                per_row = shape[0] / n
                setattr(self, suffix, _param(shape, dt, self.axes, suffix, sources=self._sources(suffix, per_row),
                                             shards=shards))
            else:   # per-tensor scalars, one per member (NVFP4's global scales differ between members)
                setattr(self, suffix, _param((len(self.members),), dt, (None,), shards=1,
                                             sources=tuple((f"{m}.{suffix}", 1) for m, _ in self.members)))
        self.quant, self.block, self.backend, self.mesh = method, tuple(block), backend, mesh
        self.act_quant, self.interpret = act_quant, interpret

    def __call__(self, x: jax.Array, *, norm=None) -> jax.Array:
        """x [..., K] -> [..., sum(N_i)] in the fused (per-shard interleaved) order; see split.
        ``norm`` as for :class:`Linear`. NVFP4: the one-row GEMV applies each member's
        ``weight_scale_2`` to its rows; other kernels run with a global scale of 1 and an fp32
        output, which the members' scales then multiply (one rounding to x's dtype, as unfused)."""
        if self.quant != "nvfp4":
            return Linear.__call__(self, x, norm=norm)
        w, s, s2 = self._quant_operands()
        if gemv_fuses(self, x, norm, None):     # the GEMV scales each member's rows itself
            return linear_matmul(x, (w, s, s2), method="nvfp4", axes=self.axes, backend=self.backend,
                                 mesh=self.mesh, interpret=self.interpret, out_dtype=x.dtype, norm=norm,
                                 segments=tuple(n // self.shards for _, n in self.members))
        if norm is not None:
            x = norm(x)
        y = linear_matmul(x, (w, s, jnp.ones((), jnp.float32)), method="nvfp4", axes=self.axes, backend=self.backend,
                          mesh=self.mesh, interpret=self.interpret, out_dtype=jnp.float32)
        per_shard = [jnp.broadcast_to(s2[i], (n // self.shards,)) for i, (_, n) in enumerate(self.members)]
        return (y * jnp.tile(jnp.concatenate(per_shard), self.shards)).astype(x.dtype)

    def swiglu(self, x: jax.Array, *, norm=None) -> jax.Array:
        """``silu(gate) * up`` of a [gate; up] fusion ([..., N / 2], x's dtype): inside the one-row
        GEMV where it can (:func:`gemv_fuses` with ``glu``; NVFP4 members keep their own global
        scales), else from the split output. ``norm`` as for :class:`Linear`."""
        if not gemv_fuses(self, x, norm, None, glu=True):
            gate, up = self.split(self(x, norm=norm))
            return jax.nn.silu(gate) * up
        return linear_matmul(x, self._quant_operands(), method=self.quant, axes=self.axes, block=self.block,
                             backend=self.backend, mesh=self.mesh, interpret=self.interpret, out_dtype=x.dtype,
                             norm=norm, glu=True)

    _quant_operands = Linear._quant_operands
    bias = None

    def split(self, y: jax.Array) -> list[jax.Array]:
        """Fused output [..., sum(N_i)] -> one [..., N_i] per member."""
        lead = y.shape[:-1]
        per_shard = [n // self.shards for _, n in self.members]
        y = y.reshape(*lead, self.shards, sum(per_shard))
        out, start = [], 0
        for n in per_shard:
            out.append(y[..., start:start + n].reshape(*lead, n * self.shards))
            start += n
        return out


# ---------------------------------------------------------------------- model-wide pass
def mark_wide_scales(model: nnx.Module) -> list[str]:
    """Sets ``wide_scales`` on every MXFP8 Linear / FusedLinear of a loaded ``model`` whose scales
    hold an E8M0 byte above ``pallas_kernels.mxfp8.mma_gemv.MAX_SCALE`` (its 2-16-row calls then
    run the engine, which takes every scale) and returns their names. Static (part of the
    graph), so call it on the concrete model before compiling."""
    from pallas_kernels.mxfp8 import mma_gemv

    wide = []
    for path, module in nnx.iter_modules(model):
        if isinstance(module, (Linear, FusedLinear)) and module.quant == "mxfp8":
            module.wide_scales = mma_gemv.wide_scales(module.weight_scale[...])
            if module.wide_scales:
                wide.append(".".join(map(str, path)))
    return wide


def quantize_linears(model: nnx.Module, qcfg: QuantConfig | None, *, tensor_names: Iterable[str] | None = None,
                     backend: str = "xla", mesh=None, act_quant: bool = False, interpret: bool = False,
                     dense_backend: str = "xla") -> list[str]:
    """Turns every Linear / FusedLinear of ``model`` that ``qcfg`` quantizes into a quantized one;
    the others run decode-sized inputs on ``dense_backend`` (see :func:`dense_kernel_takes`).

    Call it on a freshly built (or abstract) model, before loading. ``tensor_names`` (the
    checkpoint's tensor names) decides block-FP8 membership and NVFP4's optional
    ``input_scale``. Raises one QuantLayoutError naming every layer that cannot be quantized as
    declared (a FusedLinear whose members do not share one format, shapes the format cannot
    block). Returns the names of the quantized layers.
    """
    names = set(tensor_names) if tensor_names is not None else None
    done, problems = [], []
    for path, module in nnx.iter_modules(model):
        name = ".".join(map(str, path))
        if isinstance(module, FusedLinear):
            methods = {m: (qcfg.method_for(m, names) if qcfg else None) for m, _ in module.members}
            kinds = set(methods.values())
            if len(kinds) > 1:
                desc = ", ".join(f"{m} ({v or 'unquantized'})" for m, v in methods.items())
                mx = "MXFP8 and non-MXFP8 members" if "mxfp8" in kinds else "members of different formats"
                problems.append(f"{name or 'fused'}: cannot fuse {mx} along N: {desc}")
                continue
            method = kinds.pop()
            members = [m for m, _ in module.members]
        elif isinstance(module, Linear):
            method = qcfg.method_for(name, names) if qcfg is not None else None
            members = [name]
        else:
            continue
        if method:
            try:
                module.quantize_(method, block=qcfg.block, optional=_optional(method, members, names),
                                 backend=backend, mesh=mesh, act_quant=act_quant, interpret=interpret, name=name)
            except QuantLayoutError as e:        # reported with every other layer's problem
                problems.append(str(e))
                continue
            done.append(name)
        else:                       # unquantized: decode-sized inputs on the dense backend
            module.backend, module.mesh, module.interpret = dense_backend, mesh, interpret
    if problems:
        raise QuantLayoutError(f"{len(problems)} layer(s) cannot take the checkpoint's quantization "
                               "(nothing was loaded):\n  " + "\n  ".join(problems))
    return done


def project(module: nnx.Module, group: str, x: jax.Array, norm=None) -> list[jax.Array]:
    """The outputs ``[..., N_i]`` of the projections ``module.FUSIBLE[group]`` names, all of ``x``
    (normalised by ``norm`` first, if given): one matmul when :func:`fuse_projections` fused them
    into ``module.<group>``, else one each."""
    fused = getattr(module, group, None)
    if fused is not None:
        return fused.split(fused(x, norm=norm))
    if norm is not None and not all(gemv_fuses(getattr(module, m), x, norm, None) for m in module.FUSIBLE[group]):
        x, norm = norm(x), None
    return [getattr(module, m)(x, norm=norm) for m in module.FUSIBLE[group]]


def fuse_projections(model: nnx.Module, qcfg: QuantConfig | None = None, tensor_names: Iterable[str] | None = None,
                     mesh=None) -> list[str]:
    """Replaces each group of sibling projections that a module lists in ``FUSIBLE`` (``{group:
    (member, ...)}``, e.g. an MLP's gate and up) by one :class:`FusedLinear` named ``group``.

    Decode streams every weight once per step; one larger matmul instead of two or three small
    ones saves their launches and tails. A group is fused only when its members can share one
    matmul and one load: plain Linears without bias, the same tensor-parallel split, one
    quantization format (NVFP4 members keep their own global scales, applied to their columns
    of the output), and for block FP8 whole 128-row blocks per member and shard. Call it on a freshly
    built (or abstract) model before :func:`quantize_linears`; models call :func:`project`,
    which works either way. Returns the fused modules' names."""
    names = set(tensor_names) if tensor_names is not None else None
    fused = []
    for path, module in list(nnx.iter_modules(model)):
        for group, members in getattr(module, "FUSIBLE", {}).items():
            prefix = ".".join(map(str, path))
            full = [f"{prefix}.{m}" if prefix else m for m in members]
            linears = [getattr(module, m, None) for m in members]
            if not all(type(lin) is Linear and lin.bias is None for lin in linears):
                continue
            if len({tuple(spec(lin.axes)) for lin in linears}) > 1:
                continue
            methods = {qcfg.method_for(n, names) if qcfg else None for n in full}
            method = methods.pop() if len(methods) == 1 else "mixed"
            if method == "mixed":
                continue
            shards = _tp_shards(linears[0].axes, mesh, 0)
            if method == "fp8_block" and any(lin.out_features % shards or (lin.out_features // shards) % qcfg.block[0]
                                             for lin in linears):
                continue
            setattr(module, group, FusedLinear(linears[0].in_features,
                                               [(n, lin.out_features) for n, lin in zip(full, linears)],
                                               linears[0].weight.dtype, linears[0].axes))
            for m in members:
                setattr(module, m, None)
            fused.append(f"{prefix}.{group}")
    return fused


def prepare_linears(model: nnx.Module, model_dir=None, *, backend: str = "xla", mesh=None,
                    act_quant: bool = False, interpret: bool = False, dense_backend: str = "xla") -> nnx.Module:
    """Fuses sibling projections (:func:`fuse_projections`), applies the quantization of
    checkpoint ``model_dir`` (none if None or unquantized) to ``model``'s linears with
    :func:`quantize_linears` and returns ``model``. FusedLinears get their tensor-parallel
    layout even when nothing is quantized; unquantized linears run decode-sized inputs on
    ``dense_backend``."""
    from kk_jax.quant.config import detect_with_names

    qcfg, names = detect_with_names(model_dir)
    fuse_projections(model, qcfg, names, mesh)
    quantize_linears(model, qcfg, tensor_names=names, backend=backend, mesh=mesh, act_quant=act_quant,
                     interpret=interpret, dense_backend=dense_backend)
    return model


def _optional(method, modules, names) -> tuple:
    if not method or names is None:
        return ()
    return tuple(t for t in OPTIONAL_TENSORS[method] if all(f"{m}.{t}" in names for m in modules))


def _tp_shards(axes, mesh, dim: int) -> int:
    if mesh is None or TP not in mesh.shape:
        return 1
    return mesh.shape[TP] if tuple(spec(axes))[dim] == TP else 1


def check_kernel_block(method, block, backend) -> None:
    """The Pallas block-FP8 kernels take 128x128 scale blocks only: other blocks are refused when
    the layer is declared (before any weight is read), not at its first call."""
    if method == "fp8_block" and backend == "pallas":
        from pallas_kernels.fp8_block import check_block
        try:
            check_block(block)
        except ValueError as e:
            raise QuantLayoutError(str(e)) from None


def check_tp_layout(method, n, k, shards: tuple[int, int], block) -> None:
    """Each tensor-parallel shard of an [N, K] weight split ``shards`` = (N ways, K ways) must
    hold whole scale blocks."""
    units = {"fp8_block": tuple(block), "mxfp8": (1, 32), "nvfp4": (1, 16)}[method]
    for what, size, parts, unit in (("output", n, shards[0], units[0]), ("input", k, shards[1], units[1])):
        if parts > 1 and (size % parts or (size // parts) % unit):
            raise QuantLayoutError(f"tp={parts} splits the {what} dimension {size} into shards of {size // parts}, "
                                   f"not a multiple of the {method} scale block ({unit})")


# ---------------------------------------------------------------------- the matmul
# Row counts from which the weight-only (W8A16 / W4A16) layers dequantize the weight and run
# XLA's bf16 dot instead of the Pallas dequantizing kernels; decode always runs the kernels.
# Layers writing an fp32 output (a row-parallel shard's partial sum, a layer with a bias): NVFP4
# from 4096 rows, MXFP8 and block FP8 from 3072. One H200, public matmul against the jnp twin
# with an fp32 result, NVFP4 / MXFP8 / block FP8 on 4096 x 4096 and on a tp = 4 down-projection
# shard 4096 x 3072: the kernels 1.4-1.9x faster at M = 1024 and 1.07-1.38x at M = 2048, 0.69-0.89x
# at M = 8192 (RESULTS.md part 37); at M = 3072 NVFP4 1.04x, MXFP8 and block FP8 0.79-0.81x;
# at M = 4096 NVFP4 0.95-0.98x (part 39).
# NVFP4 writing the layer's bf16 output runs the kernels at every row count: XLA's NVFP4
# dequantization alone takes 60-200 us, and the kernel beat dequantize-then-dot from 96 to 8192
# rows on the three shapes below, e.g. M = 8192 411 / 1185 / 1190 against 420 / 1302 / 1214 us
# (H200, RESULTS.md part 35).
# MXFP8 and block FP8 writing the layer's bf16 output run the warp-specialized prefill form
# (``pallas_kernels.mxfp8.prefill_ws``) below 8192 rows. One H200, same process, kernel against
# dequantize-then-dot with XLA's bf16-result dot (benchmarks/RESULTS.md, part 34), MXFP8 on
# 4096 x 4096 / 12288 x 4096 / 4096 x 12288: M = 4096 190.5 / 564.2 / 548.3 against 215.1 /
# 543.2 / 559.0 us, M = 8192 381.6 / 1134.2 / 1100.7 against 363.1 / 1016.7 / 1061.2 us (block
# FP8 M = 8192 393.7 / 1178.5 / 1127.5 against 368.3 / 1056.0 / 1077.6).
# (method, bf16 output) -> rows from which the layer's matmul runs on XLA (None: an unquantized
# weight on the dense kernel)
KERNEL_MAX_ROWS = {(None, True): 4096, (None, False): 4096,
                   ("nvfp4", True): math.inf, ("nvfp4", False): 4096,
                   ("mxfp8", True): 8192, ("mxfp8", False): 3072,
                   ("fp8_block", True): 8192, ("fp8_block", False): 3072}


def kernel_max_rows(method: str | None, out_dtype) -> float:
    """Rows from which a quantized layer's matmul runs on XLA (see above; inf: never)."""
    return KERNEL_MAX_ROWS[method, jnp.dtype(out_dtype) == jnp.bfloat16]


# Rows up to which unquantized linears on the pallas dense backend use the weight-streaming
# kernels: at one row (the one-row GEMV) one H200 timed them 1.09-1.30x faster than XLA's GEMV
# on Qwen3-8B's four decode matmuls; from 8 rows the engine runs 0.91-1.03x XLA's GEMM.
DENSE_KERNEL_MAX_ROWS = 1


def dense_kernel_takes(linear, x: jax.Array) -> bool:
    """Whether an unquantized linear runs ``x`` through the weight-streaming Pallas kernel
    (``pallas_kernels.dense_matmul``): its backend is pallas, weight and input are bf16, ``x`` has
    at most DENSE_KERNEL_MAX_ROWS rows (batch-1 decode) and each tensor-parallel shard holds
    whole 64-row, 64-column tiles (otherwise the kernel would pad, i.e. copy, the weight every
    call)."""
    if (linear.backend != "pallas" or math.prod(x.shape[:-1]) > DENSE_KERNEL_MAX_ROWS
            or x.dtype != jnp.bfloat16 or linear.weight[...].dtype != jnp.bfloat16):
        return False
    s0, s1 = _tp_shards(linear.axes, linear.mesh, 0), _tp_shards(linear.axes, linear.mesh, 1)
    n, k = linear.out_features, linear.in_features
    return n % s0 == 0 and k % s1 == 0 and (n // s0) % 64 == 0 and (k // s1) % 64 == 0


def _gemv_module(method):
    """The package whose one-row GEMV serves ``method`` (None: unquantized bf16)."""
    if method is None:
        from pallas_kernels.dense_matmul import gemv
    elif method == "fp8_block":
        from pallas_kernels.fp8_block import gemv
    elif method == "mxfp8":
        from pallas_kernels.mxfp8 import gemv
    else:
        from pallas_kernels.nvfp4 import gemv
    return gemv


def gemv_fuses(linear, x: jax.Array, norm, residual, glu: bool = False) -> bool:
    """Whether ``linear`` on ``x`` runs the one-row GEMV with ``norm`` (an RMSNorm of x), and / or
    ``residual`` (added to the output) or ``glu`` (silu of the first half times the second)
    inside it: a decode row (one bf16 row) on the pallas backend, W8A16 with 128x128 blocks if
    block FP8, no bias, K not split over tensor-parallel shards, shapes the GEMV serves
    (`row_gemv.supported`, `row_gemv.fusable`); for a residual a plain Linear (a fused layer's
    output is split, NVFP4's scaled after the kernel), for glu a fusion of two equal members; a
    fused NVFP4 layer's members (per shard) in whole 16-row items, as its per-member global
    scales need."""
    from pallas_kernels import row_gemv

    if norm is None and residual is None and not glu:
        return False
    if glu and not (isinstance(linear, FusedLinear) and len(linear.members) == 2
                    and linear.members[0][1] == linear.members[1][1]):
        return False
    if (linear.backend != "pallas" or math.prod(x.shape[:-1]) != 1 or x.dtype != jnp.bfloat16
            or linear.bias is not None or linear.act_quant or _tp_shards(linear.axes, linear.mesh, 1) > 1):
        return False
    if linear.quant is None and not dense_kernel_takes(linear, x):
        return False
    if linear.quant == "fp8_block" and tuple(linear.block) != (128, 128):
        return False
    if residual is not None and (residual.dtype != jnp.bfloat16 or isinstance(linear, FusedLinear)):
        return False
    if norm is not None and norm.weight[...].shape != (x.shape[-1],):
        return False
    if (isinstance(linear, FusedLinear) and linear.quant == "nvfp4"     # each member's scale: whole items
            and any(m // linear.shards % row_gemv.ROWS for _, m in linear.members)):
        return False
    n, k = linear.out_features // _tp_shards(linear.axes, linear.mesh, 0), linear.in_features
    return (_gemv_module(linear.quant).supported(1, n, k)
            and row_gemv.fusable(n, k, x.dtype, norm=norm is not None, residual=residual is not None, glu=glu))


def _kernel_call(method, x2, ops, *, block, backend, act_quant, interpret, out_dtype, wide_scales=False):
    limit = kernel_max_rows(method, out_dtype)
    if backend == "pallas" and not act_quant and x2.shape[0] >= limit:
        backend = "xla"
    if method is None:
        from pallas_kernels import dense_matmul
        return dense_matmul.matmul(x2, *ops, backend=backend, out_dtype=out_dtype, interpret=interpret)
    if method == "fp8_block":
        from pallas_kernels import fp8_block
        return fp8_block.matmul(x2, *ops, block=block, act_quant=act_quant, backend=backend, out_dtype=out_dtype,
                                interpret=interpret)
    if method == "mxfp8":
        from pallas_kernels import mxfp8
        return mxfp8.matmul(x2, *ops, backend=backend, out_dtype=out_dtype, interpret=interpret,
                            wide_scales=wide_scales)
    from pallas_kernels import nvfp4
    return nvfp4.matmul(x2, *ops, backend=backend, out_dtype=out_dtype, interpret=interpret)


def linear_matmul(x, ops: tuple, *, method: str | None, axes, block=(128, 128), backend="xla", mesh=None,
                  act_quant=False, interpret=False, out_dtype=jnp.float32, norm=None, residual=None, glu=False,
                  segments=None, wide_scales=False):
    """x [..., K] @ dequant(ops)^T -> [..., N] out_dtype for a linear's :data:`OPERANDS` (``method``
    None: the unquantized weight, for the dense kernel); fp32 accumulation, one rounding to
    ``out_dtype``. With backend="pallas" on a tp mesh the kernel runs per shard inside
    ``jax.shard_map``: column-parallel weights give N-sharded outputs, row-parallel ones partial
    sums reduced with ``psum`` (pass an fp32 ``out_dtype`` for those). ``norm`` / ``residual`` /
    ``glu`` / ``segments`` (per-member global scales): the one-row GEMV's options, for calls
    :func:`gemv_fuses` accepted. ``wide_scales``: MXFP8 scales above the 2-16-row GEMV's range
    (:func:`mark_wide_scales`)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    extras = ([norm.weight[...]] if norm is not None else []) + ([residual.reshape(1, -1)] if residual is not None else [])

    def call(xx, *oo):
        if norm is None and residual is None and not glu and segments is None:
            return _kernel_call(method, xx, oo, block=block, backend=backend, act_quant=act_quant,
                                interpret=interpret, out_dtype=out_dtype, wide_scales=wide_scales)
        oo, ex = oo[:len(ops)], list(oo[len(ops):])
        fusions = dict(norm_weight=ex.pop(0), eps=float(norm.eps)) if norm is not None else {}
        if residual is not None:
            fusions["residual"] = ex.pop(0)
        if glu:
            fusions["glu"] = True
        if segments is not None:
            fusions["segments"] = segments
        return _gemv_module(method).gemv(xx.astype(jnp.bfloat16), *oo, out_dtype=jnp.dtype(out_dtype),
                                         interpret=interpret, **fusions)

    if backend != "pallas" or mesh is None or mesh.size == 1:
        y = call(x2, *ops, *extras)
        return y.reshape(*lead, y.shape[-1])
    w_spec = spec(axes)
    t_spec = P(*reversed(tuple(w_spec)))
    op_specs = tuple(P() if o.ndim != 2 else t_spec if s in TRANSPOSED_SCALES else w_spec
                     for s, o in zip(OPERANDS[method], ops))
    col, row = tuple(w_spec)[0] == TP, tuple(w_spec)[1] == TP
    out_spec = P(None, TP) if col else P()
    ex_specs = ((P(),) if norm is not None else ()) + ((out_spec,) if residual is not None else ())
    if row:
        if extras:
            raise ValueError("a row-parallel linear cannot fuse a norm or a residual into its kernel")
        body = lambda xx, *oo: jax.lax.psum(call(xx, *oo), TP)
        fn = jax.shard_map(body, mesh=mesh, in_specs=(P(None, TP),) + op_specs, out_specs=P(), check_vma=False)
    else:
        fn = jax.shard_map(call, mesh=mesh, in_specs=(P(),) + op_specs + ex_specs, out_specs=out_spec,
                           check_vma=False)
    y = fn(x2, *ops, *extras)
    return y.reshape(*lead, y.shape[-1])


def dequantize(method: str, ops: tuple, block=(128, 128), dtype=jnp.bfloat16) -> jax.Array:
    """[N, K] floating-point weight of a quantized linear (jnp, exact up to ``dtype`` rounding)."""
    from kk_jax.quant import fp8_block, mxfp8, nvfp4

    if method == "fp8_block":
        return fp8_block.dequantize(*ops, block=block, dtype=dtype)
    w, scale, *rest = ops                                   # scale: transposed on the device
    if method == "mxfp8":
        return mxfp8.dequantize(w, scale.T, dtype=dtype)
    return nvfp4.dequantize(w, scale.T, *rest, dtype=dtype)
