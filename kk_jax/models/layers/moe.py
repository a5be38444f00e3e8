"""DeepSeek-V3-style MoE of GLM-5.3 (reference/models.md §1.7).

Router in fp32: ``s = sigmoid(W x)``; the top-k experts are chosen by ``s + bias`` but weighted
by the unbiased ``s``, renormalised and scaled by ``routed_scaling_factor``. Experts are
clamped SwiGLUs; a shared expert is added. Expert matmuls are grouped (tokens sorted by
expert): the ``pallas`` backend runs ``tokamax.ragged_dot`` (its Mosaic GPU kernel on the
H200); the ``xla`` backend (CPU, tests) runs ``jax.lax.ragged_dot`` in fp32, which XLA's CPU
dot supports — never on the GPU hot path. Under tensor parallelism each device
holds a slice of every expert's intermediate width; partial outputs are summed across ``tp``.

Quantized routed experts (block FP8 as released, ModelOpt MXFP8 / NVFP4) stay quantized in
device memory, stacked per layer, codes in the checkpoint's ``[out, in]`` orientation and block
scales transposed (:class:`Experts`). On the GPU (``pallas``) they run through ``pallas_kernels.moe_quant``:
the token-slots of each expert are packed into row tiles and every tile is multiplied by its
expert's codes and scales, dequantized inside the kernel, so a decode step reads only the
experts it routes to, once each; a few token-slots instead run one weight-streaming GEMV each
against their expert (:func:`quantized_experts`). Elsewhere (``xla``; or a layout the
kernel does not take) the routed experts (decode: N·k < E, :func:`routed_subset`) or the whole
local shard are dequantized in jnp to the activation dtype and run through the grouped dot
above. The shared expert is a ``SwiGLU`` of ``Linear`` layers, quantized by
``prepare_linears`` like any dense projection.
"""

from __future__ import annotations

from typing import Iterable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from kk_jax.models.layers.linear import OPERANDS, TRANSPOSED_SCALES, dequantize
from kk_jax.models.layers.mlp import SwiGLU
from kk_jax.parallel.mesh import TP, spec


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


def tile_rows(pairs: int, experts: int) -> int:
    """Rows per tile of the grouped quantized kernel: about the mean number of token-slots per
    routed expert (a power of two in 8..128), so that decode pads little and prefill re-reads
    each expert's weights few times."""
    mean = -(-pairs // min(experts, pairs))
    return min(128, max(8, 1 << (mean - 1).bit_length()))


# Token-slots (tokens x top-k) up to which quantized experts run as one GEMV per slot
# (``pallas_kernels.moe_quant.routed_gemv``) instead of row tiles on the grouped engine. H200,
# GLM-5.3-Flash expert shapes (RESULTS.md, part 46): one projection takes 0.52-0.66x the tiles'
# time at 8 slots, 0.73-0.85x at 32, 0.83-0.99x at 64 and 0.97-1.48x at 128-256; an 8-layer
# NVFP4 model's decode step is 5.8 % faster at batch 1, level at batch 4 and 2.9 % slower at 8.
ROUTED_GEMV_MAX_SLOTS = 32


def _in_width(method: str, ops: tuple) -> int:
    """K of a quantized expert projection from its codes ``[E', N, K']`` (NVFP4: two per byte)."""
    return ops[0].shape[-1] * (2 if method == "nvfp4" else 1)


def quantized_experts(x, idx, w, methods, projs, limit: float, num_experts: int, expert_offset=0,
                      interpret=False):
    """:func:`grouped_experts` over quantized experts, dequantized inside the
    ``pallas_kernels.moe_quant`` kernels (``interpret``: their CPU interpreter, for tests).
    ``projs``: per projection (gate, up, down) the operands in the :class:`Experts` layout
    (codes ``[E', N, K']``, E' = layers x E when a scanned group's stack is passed whole;
    ``expert_offset`` then selects the layer's E experts). Up to ``ROUTED_GEMV_MAX_SLOTS``
    token-slots, and expert shapes the row GEMV takes, each slot is one GEMV against its expert;
    otherwise the slots are packed into row tiles of one expert each."""
    from pallas_kernels.moe_quant import gather_rows, grouped_matmul, route_tiles, routed_gemv, routed_gemv_supported

    n, k = idx.shape
    if idx.size <= ROUTED_GEMV_MAX_SLOTS and all(routed_gemv_supported(m, ops[0].shape[-2], _in_width(m, ops))
                                                 for m, ops in zip(methods, projs)):
        slots = idx.reshape(-1)
        rows = jnp.repeat(x, k, axis=0)                                          # [N·k, D], slot order
        mm = lambda a, m, ops: routed_gemv(a, slots, m, *ops, expert_offset=expert_offset,
                                           out_dtype=jnp.float32, interpret=interpret)
        pick = lambda y: y
    else:
        tiles = route_tiles(idx, num_experts, tile_rows(idx.size, num_experts))
        rows = gather_rows(x, tiles, k)                                         # [T·bm, D]
        mm = lambda a, m, ops: grouped_matmul(a, tiles.tile_expert, m, *ops, expert_offset=expert_offset,
                                              out_dtype=jnp.float32, interpret=interpret)
        pick = lambda y: y[tiles.row_of_pair]
    g, u = mm(rows, methods[0], projs[0]), mm(rows, methods[1], projs[1])
    h = jax.nn.silu(jnp.minimum(g, limit)) * jnp.clip(u, -limit, limit)
    y = pick(mm(h.astype(x.dtype), methods[2], projs[2]))                      # [N·k, D], slot order
    return jnp.sum(y.reshape(n, k, -1) * w[..., None], axis=1)


class Router(nnx.Module):
    def __init__(self, hidden: int, experts: int, dtype):
        self.weight = nnx.Param(jnp.zeros((experts, hidden), dtype), axes=(None, "embed"))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((experts,), jnp.float32), axes=(None,))


class Experts(nnx.Module):
    """Routed experts stacked ``[E, in, out]`` for grouped matmuls. The checkpoint stores them per
    expert (``experts.{e}.{gate,up,down}_proj.weight``, HF ``[out, in]``); the ``hf_experts``
    metadata ``(name, E)`` tells the runner to stack and transpose them at load.

    Quantized experts (:meth:`quantize_`, applied by :func:`prepare_experts` before loading)
    keep the checkpoint's codes and scales on the device, stacked per layer in the layout the
    grouped dequantizing kernel streams (``pallas_kernels.moe_quant``): codes in the checkpoint's
    own ``[out, in]`` orientation (``hf_orientation`` metadata: the loader stacks them without
    transposing), MXFP8 / NVFP4 block scales transposed like float experts (``[in / block, out]``,
    contiguous per K block):

        ============  ==========================================================================
        method        stacked tensors of one projection (per-expert HF tensor -> stacked param)
        ============  ==========================================================================
        fp8_block     ``{proj}``: e4m3 [E, N, K]; ``{proj}_weight_scale_inv``: f32 [E, ceil(N/bn), ceil(K/bk)]
        mxfp8         ``{proj}``: e4m3 [E, N, K]; ``{proj}_weight_scale``: uint8 E8M0 [E, K/32, N]
        nvfp4         ``{proj}``: uint8 [E, N, K/2] (two E2M1 along K); ``{proj}_weight_scale``:
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
        from kk_jax.models.layers.linear import QuantLayoutError, check_tp_layout, quant_tensor_specs

        var = getattr(self, proj)
        e, k, n = var.shape
        lead, k_axis, n_axis = var.get_metadata()["axes"]               # float layout (None, in, out)
        axes = (lead, n_axis, k_axis)                                    # checkpoint orientation [E, N, K']
        try:
            specs = quant_tensor_specs(method, n, k, block, optional)
            tp = mesh.shape[TP] if mesh is not None and TP in mesh.shape else 1
            parts = tuple(spec(axes))
            check_tp_layout(method, n, k, (tp if parts[1] == TP else 1, tp if parts[2] == TP else 1), block)
        except QuantLayoutError as err:
            raise QuantLayoutError(f"{name or 'experts'}.{proj}: {err}") from None
        for suffix, (shape, dtype, sharded) in specs.items():
            transposed = suffix in TRANSPOSED_SCALES                         # [N, K/b] -> [K/b, N]
            param = nnx.Param(jnp.zeros((e, *(reversed(shape) if transposed else shape)), dtype),
                              axes=(lead, k_axis, n_axis) if transposed else axes if sharded else (None,),
                              quant_dtype=jnp.dtype(dtype).name, hf_experts=(proj, e, suffix),
                              hf_orientation=not transposed, indexed_in_scan=True)
            setattr(self, proj if suffix == "weight" else f"{proj}_{suffix}", param)
        quant = list(self.quant)
        quant[self.PROJS.index(proj)] = method
        self.quant, self.block = tuple(quant), tuple(block)

    def operands(self, proj: str) -> tuple:
        """The stacked arrays the grouped matmul needs for ``proj`` (weight first)."""
        return tuple(getattr(self, proj if s == "weight" else f"{proj}_{s}")[...] for s in self.suffixes(proj))

    def suffixes(self, proj: str) -> tuple:
        """Checkpoint suffixes of :meth:`operands` (``weight`` first)."""
        return OPERANDS[self.quant[self.PROJS.index(proj)]]


def dequantize_stacked(method: str | None, ops: tuple, block=(128, 128), dtype=jnp.float32) -> jax.Array:
    """Stacked expert operands in the :class:`Experts` layout (quantized: codes ``[E, N, K']``, block
    scales ``[E, K/b, N]``; float: ``[E, K, N]`` as is) -> ``[E, K, N]`` ``dtype``, the right-hand
    side of the grouped dot. Each expert goes through the linear layers' :func:`dequantize` (f32
    products, one rounding), so float32 results equal the per-expert 2-D dequantization bit for bit."""
    if method is None:
        return ops[0]
    return jnp.swapaxes(jax.vmap(lambda *o: dequantize(method, o, block, dtype))(*ops), 1, 2)


def kernel_takes(methods, block, projs) -> bool:
    """Whether ``pallas_kernels.moe_quant`` runs these expert projections (local shapes
    ``projs``): all three quantized, 128x128 blocks for block FP8, whole 64-row (block FP8:
    128-row) weight tiles per expert and K a multiple of the kernel's smallest K step (MXFP8: 64,
    NVFP4: 128, block FP8: 32; the grouped kernel does not pad K)."""
    from pallas_kernels.mxfp8.wdequant import MIN_STEP

    if not all(methods) or (("fp8_block" in methods) and tuple(block) != (128, 128)):
        return False
    rows = lambda m: 128 if m == "fp8_block" else 64
    return all(ops[0].shape[-2] % rows(m) == 0 and _in_width(m, ops) % MIN_STEP.get(m, 32) == 0
               for m, ops in zip(methods, projs))


def prepare_experts(model: nnx.Module, model_dir=None, *, mesh=None) -> nnx.Module:
    """Applies checkpoint ``model_dir``'s quantization to every :class:`Experts` of ``model``
    (call it on a freshly built or abstract model, before loading; a no-op for unquantized
    checkpoints). A projection is quantized when the config covers expert ``{e}.{proj}`` (block
    FP8: when ``experts.{e}.{proj}.weight_scale_inv`` is in the checkpoint); all experts of one
    layer must agree, otherwise a QuantLayoutError names them before anything is read."""
    from kk_jax.models.layers.linear import QuantLayoutError
    from kk_jax.quant.config import OPTIONAL_TENSORS, detect_with_names

    qcfg, names = detect_with_names(model_dir)
    if qcfg is None:
        return model
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
        stacked = stack_index is not None
        layer = jnp.asarray(stack_index if stacked else 0, jnp.int32)

        def shard(flat, idx, w, layer, gate, up, down):
            projs = (gate, up, down)
            if backend == "pallas" and kernel_takes(methods, block, projs):
                if stacked:         # [L, E, ...] -> [L·E, ...]: the kernel offsets to this layer's experts
                    projs = tuple(tuple(o.reshape(-1, *o.shape[2:]) for o in ops) for ops in projs)
                y = quantized_experts(flat, idx, w, methods, projs, self.limit, ex.num_experts,
                                      layer * ex.num_experts)
                return jax.lax.psum(y, TP)
            if any(methods) and idx.size < ex.num_experts:     # decode: dequantize the routed experts only
                idx, ids = routed_subset(idx, ex.num_experts)
                projs = tuple(tuple((o[layer, ids] if stacked else o[ids]) for o in ops) for ops in projs)
            elif stacked:
                projs = tuple(tuple(o[layer] for o in ops) for ops in projs)
            gate, up, down = (dequantize_stacked(m, ops, block, flat.dtype) for m, ops in zip(methods, projs))
            return jax.lax.psum(grouped_experts(flat, idx, w, gate, up, down, self.limit, backend), TP)

        lead = (None,) * (1 + stacked)                      # the expert axis, and the layer axis when stacked
        mid, last = P(*lead, TP, None), P(*lead, None, TP)
        # the intermediate width is sharded: N of gate/up, K of down. It is the minor axis of gate/up
        # in the [.., in, out] layouts (float experts, transposed scales) and the middle one in the
        # [.., out, in] layouts (quantized codes, block FP8 tile scales); down the other way round.
        def operand_spec(i, suffix, method, o):
            if o.ndim != len(lead) + 2:
                return P()
            in_out = method is None or suffix in TRANSPOSED_SCALES
            return ((last, mid) if in_out else (mid, last))[i == 2]

        ops = tuple(ex.operands(p) for p in Experts.PROJS)
        specs = tuple(tuple(operand_spec(i, sfx, m, o) for sfx, o in zip(ex.suffixes(p), proj_ops))
                      for i, (p, m, proj_ops) in enumerate(zip(Experts.PROJS, methods, ops)))
        routed = jax.shard_map(shard, mesh=mesh, in_specs=(P(), P(), P(), P()) + tuple(specs), out_specs=P(),
                               check_vma=False)(flat, idx, w, layer, *ops)
        return (routed.reshape(b, t, d) + self.shared_experts(x).astype(jnp.float32)).astype(x.dtype)
