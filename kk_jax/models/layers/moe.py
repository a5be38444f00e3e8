"""DeepSeek-V3-style MoE of GLM-5.3 (reference/models.md §1.7).

Router in fp32: ``s = sigmoid(W x)``; the top-k experts are chosen by ``s + bias`` but weighted
by the unbiased ``s``, renormalised and scaled by ``routed_scaling_factor``. Experts are
clamped SwiGLUs; a shared expert is added. Expert matmuls are grouped (tokens sorted by
expert): the ``pallas`` backend runs ``tokamax.ragged_dot`` (its Mosaic GPU kernel on the
H200); the ``xla`` backend (CPU, tests) runs ``jax.lax.ragged_dot`` in fp32, which XLA's CPU
dot supports — never on the GPU hot path. Under tensor parallelism each device
holds a slice of every expert's intermediate width; partial outputs are summed across ``tp``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from kk_jax.models.layers.mlp import SwiGLU
from kk_jax.parallel.mesh import TP


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
    metadata ``(name, E)`` tells the runner to stack and transpose them at load."""

    def __init__(self, hidden: int, width: int, experts: int, dtype):
        def stacked(name, d_in, d_out, axes):
            return nnx.Param(jnp.zeros((experts, d_in, d_out), dtype), axes=axes, hf_experts=(name, experts))

        self.gate_proj = stacked("gate_proj", hidden, width, (None, "embed", "mlp"))
        self.up_proj = stacked("up_proj", hidden, width, (None, "embed", "mlp"))
        self.down_proj = stacked("down_proj", width, hidden, (None, "mlp", "embed"))


class MoE(nnx.Module):
    def __init__(self, hidden: int, width: int, experts: int, shared: int, top_k: int, scaling: float,
                 renorm: bool, limit: float, dtype):
        self.gate = Router(hidden, experts, dtype)
        self.experts = Experts(hidden, width, experts, dtype)
        self.shared_experts = SwiGLU(hidden, width * shared, dtype, limit=limit)
        self.top_k, self.scaling, self.renorm, self.limit = top_k, scaling, renorm, limit

    def __call__(self, x: jax.Array, mesh, backend: str) -> jax.Array:
        """x [B, T, D] -> [B, T, D]."""
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        idx, w = route(flat, self.gate.weight[...], self.gate.e_score_correction_bias[...], self.top_k,
                       self.scaling, self.renorm)

        def shard(flat, idx, w, gate, up, down):
            return jax.lax.psum(grouped_experts(flat, idx, w, gate, up, down, self.limit, backend), TP)

        ex = self.experts
        col, row = P(None, None, TP), P(None, TP, None)
        routed = jax.shard_map(shard, mesh=mesh, in_specs=(P(), P(), P(), col, col, row), out_specs=P(),
                               check_vma=False)(flat, idx, w, ex.gate_proj[...], ex.up_proj[...], ex.down_proj[...])
        return (routed.reshape(b, t, d) + self.shared_experts(x).astype(jnp.float32)).astype(x.dtype)
