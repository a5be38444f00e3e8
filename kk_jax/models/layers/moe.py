"""DeepSeek-V3-style MoE of GLM-5.3 (reference/models.md §1.7).

Router in fp32: ``s = sigmoid(W x)``; the top-k experts are chosen by ``s + bias`` but weighted
by the unbiased ``s``, renormalised and scaled by ``routed_scaling_factor``. Experts are
clamped SwiGLUs; a shared expert is added. Expert matmuls are grouped (tokens sorted by
expert): the ``pallas`` backend runs ``tokamax.ragged_dot`` (its Mosaic GPU kernel on the
H200); the ``xla`` backend (CPU, tests) runs ``jax.lax.ragged_dot`` in fp32, which XLA's CPU
dot supports — never on the GPU hot path. Under tensor parallelism each device
holds a slice of every expert's intermediate width; partial outputs are summed across ``tp``.

Quantized routed experts (block FP8 as released, ModelOpt MXFP8 / NVFP4) stay quantized in
device memory, stacked per layer (:class:`Experts`); each call dequantizes in jnp to the
activation dtype and then runs the same grouped dot. When the call routes fewer token-slots
than there are experts (decode: N·k < E), only the experts it routes to are gathered and
dequantized (:func:`routed_subset`; XLA fuses the gather into the dequantization): at batch 1 that is k of E experts instead of all of them.
Otherwise the whole local shard is dequantized, one temporary copy per call (on the H200 that
path costs 1.8x the bf16 grouped dot at 16K rows; a fused grouped kernel that reads the codes
and scales directly is future work). The shared expert is a ``SwiGLU`` of ``Linear``
layers, quantized by ``prepare_linears`` like any dense projection.
"""

from __future__ import annotations

from typing import Iterable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from kk_jax.models.layers.mlp import SwiGLU
from kk_jax.parallel.mesh import TP, spec
from kk_jax.quant import mxfp8, nvfp4


def route(x: jax.Array, weight: jax.Array, bias: jax.Array, k: int, scaling: float, renorm: bool):
    """x [N, D] -> (expert ids [N, k] int32, weights [N, k] f32)."""
    s = jax.nn.sigmoid(jnp.einsum("nd,ed->ne", x.astype(jnp.float32), weight.astype(jnp.float32),
                                  precision=jax.lax.Precision.HIGHEST))
    _, idx = jax.lax.top_k(s + bias.astype(jnp.float32), k)
    w = jnp.take_along_axis(s, idx, axis=-1)
    if renorm:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return idx.astype(jnp.int32), w * scaling


def _ragged_dot(lhs, rhs, group_sizes, backend: str):
    if backend == "pallas":
        import tokamax

        return tokamax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    return jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), group_sizes,
                              precision=jax.lax.Precision.HIGHEST)


def routed_subset(idx: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """The experts that ``idx`` [N, k] routes to: ``(local idx [N, k], ids [N·k])``.

    ``ids`` are the sorted distinct expert ids, padded with E - 1 (which keeps them sorted and
    names a real expert that no token uses); ``local`` renumbers ``idx`` into positions of
    ``ids``. Stacked expert operands gathered at ``ids`` give grouped matmuls equal to those over
    all E experts (empty groups contribute nothing)."""
    ids = jnp.unique(idx.reshape(-1), size=idx.size, fill_value=num_experts - 1)
    return jnp.searchsorted(ids, idx).astype(jnp.int32), ids


def grouped_experts(x, idx, w, gate, up, down, limit: float, backend: str = "xla"):
    """x [N, D]; idx, w [N, k]; gate, up [E, D, I]; down [E, I, D] -> [N, D] f32
    (a partial sum when the I dimension is sharded)."""
    n, k = idx.shape
    e = gate.shape[0]
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    xs = x[token]                                                              # [N·k, D]
    g = _ragged_dot(xs, gate, sizes, backend)                                   # [N·k, I]
    u = _ragged_dot(xs, up, sizes, backend)
    h = jax.nn.silu(jnp.minimum(g, limit)) * jnp.clip(u, -limit, limit)
    y = _ragged_dot(h.astype(x.dtype), down, sizes, backend)                    # [N·k, D]
    y = y * w.reshape(-1)[order][:, None]
    return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token].add(y)


class Router(nnx.Module):
    def __init__(self, hidden: int, experts: int, dtype):
        self.weight = nnx.Param(jnp.zeros((experts, hidden), dtype), axes=(None, "embed"))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((experts,), jnp.float32), axes=(None,))


class Experts(nnx.Module):
    """Routed experts stacked ``[E, in, out]`` for grouped matmuls. The checkpoint stores them per
    expert (``experts.{e}.{gate,up,down}_proj.weight``, HF ``[out, in]``); the ``hf_experts``
    metadata ``(name, E)`` tells the runner to stack and transpose them at load.

    Quantized experts (:meth:`quantize_`, applied by :func:`prepare_experts` before loading)
    keep the checkpoint's codes and scales on the device, stacked per layer in the same
    transposed layout as the float weights, so that every tensor is ``[E, in-side, out-side]``:

        ============  ==========================================================================
        method        stacked tensors of one projection (per-expert HF tensor -> stacked param)
        ============  ==========================================================================
        fp8_block     ``{proj}``: e4m3 [E, K, N]; ``{proj}_weight_scale_inv``: f32 [E, ceil(K/bk), ceil(N/bn)]
        mxfp8         ``{proj}``: e4m3 [E, K, N]; ``{proj}_weight_scale``: uint8 E8M0 [E, K/32, N]
        nvfp4         ``{proj}``: uint8 [E, K/2, N] (two E2M1 along K); ``{proj}_weight_scale``:
                      e4m3 [E, K/16, N]; ``{proj}_weight_scale_2``: f32 [E];
                      ``{proj}_input_scale`` f32 [E] when the checkpoint has it (unused: W4A16)
        ============  ==========================================================================

    In a scanned layer group the params stay stacked over the group's layers inside the scan
    (``indexed_in_scan`` metadata, ``layers.scan``) and the MoE indexes them with the group's
    layer: decode gathers just the routed experts of that layer from the stack, where slicing
    the layer out first could copy all E experts.

    Each param's ``hf_experts`` metadata ``(proj, E, suffix)`` names the per-expert checkpoint
    tensor ``experts.{e}.{proj}.{suffix}`` and ``quant_dtype`` its exact dtype, so the loader
    checks every per-expert tensor's shape and dtype before any device work. Transposing the
    scales with the weights keeps the runner's single stack-and-transpose rule and gives the
    ``[E, K, N]`` right-hand side a grouped dot consumes.
    """

    PROJS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, hidden: int, width: int, experts: int, dtype):
        def stacked(name, d_in, d_out, axes):
            return nnx.Param(jnp.zeros((experts, d_in, d_out), dtype), axes=axes, hf_experts=(name, experts),
                             indexed_in_scan=True)

        self.num_experts = experts
        self.quant: tuple = (None, None, None)      # static: per projection None | fp8_block | mxfp8 | nvfp4
        self.block = (128, 128)
        self.gate_proj = stacked("gate_proj", hidden, width, (None, "embed", "mlp"))
        self.up_proj = stacked("up_proj", hidden, width, (None, "embed", "mlp"))
        self.down_proj = stacked("down_proj", width, hidden, (None, "mlp", "embed"))

    def quantize_(self, proj: str, method: str, *, block=(128, 128), optional: Iterable[str] = (), mesh=None,
                  name: str = "") -> None:
        """Re-declares projection ``proj`` for ``method`` (zeros of the stacked quantized layout)."""
        from kk_jax.models.layers.linear import QuantLayoutError, quant_tensor_specs

        var = getattr(self, proj)
        e, k, n = var.shape
        axes = tuple(var.get_metadata()["axes"])                       # (None, in-axis, out-axis)
        try:
            specs = quant_tensor_specs(method, n, k, block, optional)
            _check_expert_tp(method, k, n, axes, mesh, block)
        except QuantLayoutError as err:
            raise QuantLayoutError(f"{name or 'experts'}.{proj}: {err}") from None
        for suffix, (shape, dtype, sharded) in specs.items():
            stacked = (e, *reversed(shape))                               # [N, k'] -> [E, k', N]; [] -> [E]
            param = nnx.Param(jnp.zeros(stacked, dtype), axes=axes if sharded else (None,),
                              quant_dtype=jnp.dtype(dtype).name, hf_experts=(proj, e, suffix), indexed_in_scan=True)
            setattr(self, proj if suffix == "weight" else f"{proj}_{suffix}", param)
        quant = list(self.quant)
        quant[self.PROJS.index(proj)] = method
        self.quant, self.block = tuple(quant), tuple(block)

    def operands(self, proj: str) -> tuple:
        """The stacked arrays the grouped matmul needs for ``proj`` (weight first)."""
        method = self.quant[self.PROJS.index(proj)]
        extra = {None: (), "fp8_block": ("weight_scale_inv",), "mxfp8": ("weight_scale",),
                 "nvfp4": ("weight_scale", "weight_scale_2")}[method]
        return (getattr(self, proj)[...],) + tuple(getattr(self, f"{proj}_{s}")[...] for s in extra)


def _check_expert_tp(method, k, n, axes, mesh, block) -> None:
    """Each tensor-parallel shard must hold whole scale blocks of the stacked [E, K, N] layout."""
    from kk_jax.models.layers.linear import QuantLayoutError

    if mesh is None or TP not in mesh.shape or mesh.shape[TP] == 1:
        return
    tp = mesh.shape[TP]
    parts = tuple(spec(axes))
    units = {"fp8_block": (block[1], block[0]), "mxfp8": (32, 1), "nvfp4": (16, 1)}[method]
    for dim, size, unit in ((1, k, units[0]), (2, n, units[1])):
        if parts[dim] != TP:
            continue
        if size % tp or (size // tp) % unit:
            raise QuantLayoutError(f"tp={tp} splits the {'input' if dim == 1 else 'output'} dimension {size} into "
                                   f"shards of {size // tp}, not a multiple of the {method} scale block ({unit})")


def dequantize_stacked(method: str | None, ops: tuple, block=(128, 128), dtype=jnp.float32) -> jax.Array:
    """Stacked expert operands in the ``[E, K, N]`` layout (see :class:`Experts`) -> ``[E, K, N]``
    ``dtype``. The arithmetic is that of ``kk_jax.quant.*.dequantize`` (f32 products, one rounding
    each), so float32 results equal the per-expert 2-D dequantization bit for bit."""
    if method is None:
        return ops[0]
    w = ops[0]
    if method == "fp8_block":
        s = ops[1]
        k, n = w.shape[1], w.shape[2]
        full = jnp.repeat(jnp.repeat(s.astype(jnp.float32), block[1], axis=1), block[0], axis=2)[:, :k, :n]
        return (w.astype(jnp.float32) * full).astype(dtype)
    if method == "mxfp8":
        full = jnp.repeat(mxfp8.scale_values(ops[1]), mxfp8.BLOCK, axis=1)
        return (w.astype(jnp.float32) * full).astype(dtype)
    if method == "nvfp4":
        scale, scale_2 = ops[1], ops[2]
        e, half, n = w.shape
        lo, hi = w & 0x0F, w >> 4
        codes = jnp.stack([lo, hi], axis=2).reshape(e, half * 2, n)           # element 2i low, 2i+1 high
        s = scale.astype(jnp.float32) * scale_2.astype(jnp.float32)[:, None, None]
        return (nvfp4.e2m1_values(codes) * jnp.repeat(s, nvfp4.BLOCK, axis=1)).astype(dtype)
    raise ValueError(f"unknown expert quantization {method!r}")


def prepare_experts(model: nnx.Module, model_dir=None, *, mesh=None) -> nnx.Module:
    """Applies checkpoint ``model_dir``'s quantization to every :class:`Experts` of ``model``
    (call it on a freshly built or abstract model, before loading; a no-op for unquantized
    checkpoints). A projection is quantized when the config covers expert ``{e}.{proj}`` (block
    FP8: when ``experts.{e}.{proj}.weight_scale_inv`` is in the checkpoint); all experts of one
    layer must agree, otherwise a QuantLayoutError names them before anything is read."""
    from kk_jax.checkpoint.safetensors_io import index_checkpoint
    from kk_jax.models.layers.linear import QuantLayoutError
    from kk_jax.quant.config import OPTIONAL_TENSORS, detect

    qcfg = detect(model_dir) if model_dir is not None else None
    if qcfg is None:
        return model
    try:
        names = set(index_checkpoint(model_dir))
    except FileNotFoundError:
        names = None                 # the loader reports the missing files
    problems = []
    for path, module in nnx.iter_modules(model):
        if not isinstance(module, Experts):
            continue
        base = ".".join(map(str, path))
        for proj in Experts.PROJS:
            mods = [f"{base}.{e}.{proj}" for e in range(module.num_experts)]
            methods = [qcfg.method_for(m, names) for m in mods]
            if len(set(methods)) > 1:
                desc = ", ".join(f"{e}: {m or 'unquantized'}" for e, m in enumerate(methods))
                problems.append(f"{base}.*.{proj}: experts disagree on the format ({desc})")
                continue
            method = methods[0]
            if method is None:
                continue
            optional = tuple(t for t in OPTIONAL_TENSORS[method]
                             if names is not None and all(f"{m}.{t}" in names for m in mods))
            module.quantize_(proj, method, block=qcfg.block, optional=optional, mesh=mesh, name=base)
    if problems:
        raise QuantLayoutError(f"{len(problems)} routed-expert projection(s) cannot be stacked (nothing was "
                               "loaded):\n  " + "\n  ".join(problems))
    return model


class MoE(nnx.Module):
    def __init__(self, hidden: int, width: int, experts: int, shared: int, top_k: int, scaling: float,
                 renorm: bool, limit: float, dtype):
        self.gate = Router(hidden, experts, dtype)
        self.experts = Experts(hidden, width, experts, dtype)
        self.shared_experts = SwiGLU(hidden, width * shared, dtype, limit=limit)
        self.top_k, self.scaling, self.renorm, self.limit = top_k, scaling, renorm, limit

    def __call__(self, x: jax.Array, mesh, backend: str, stack_index: jax.Array | None = None) -> jax.Array:
        """x [B, T, D] -> [B, T, D]. ``stack_index``: this layer's position in a scanned group,
        whose expert params are then stacked ``[layers, E, ...]`` (see :class:`Experts`)."""
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        idx, w = route(flat, self.gate.weight[...], self.gate.e_score_correction_bias[...], self.top_k,
                       self.scaling, self.renorm)

        ex = self.experts
        methods, block = ex.quant, ex.block

        compact = any(methods) and idx.size < ex.num_experts       # decode: dequantize routed experts only

        stacked = stack_index is not None
        layer = jnp.asarray(stack_index if stacked else 0, jnp.int32)

        def shard(flat, idx, w, layer, gate, up, down):
            projs = (gate, up, down)
            if compact:
                idx, ids = routed_subset(idx, ex.num_experts)
                projs = tuple(tuple((o[layer, ids] if stacked else o[ids]) for o in ops) for ops in projs)
            elif stacked:
                projs = tuple(tuple(o[layer] for o in ops) for ops in projs)
            gate, up, down = (dequantize_stacked(m, ops, block, flat.dtype) for m, ops in zip(methods, projs))
            return jax.lax.psum(grouped_experts(flat, idx, w, gate, up, down, self.limit, backend), TP)

        lead = (None,) * (1 + stacked)                      # the expert axis, and the layer axis when stacked
        col, row = P(*lead, None, TP), P(*lead, TP, None)
        ops = tuple(ex.operands(p) for p in Experts.PROJS)
        specs = tuple(tuple(sp if o.ndim == len(lead) + 2 else P() for o in proj_ops)
                      for sp, proj_ops in zip((col, col, row), ops))
        routed = jax.shard_map(shard, mesh=mesh, in_specs=(P(), P(), P(), P()) + specs, out_specs=P(),
                               check_vma=False)(flat, idx, w, layer, *ops)
        return (routed.reshape(b, t, d) + self.shared_experts(x).astype(jnp.float32)).astype(x.dtype)
