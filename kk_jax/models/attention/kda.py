"""GLM-5.3 KDA (Kimi Delta Attention) layer over per-sequence state slots (models.md §1.3).

Per token: separate q/k/v projections, each through a causal depthwise conv (kernel 4) and
SiLU; q, k l2-normalised inside the kernel; ``beta = sigmoid(b_proj x)``; the safe gate
``g = lower_bound · sigmoid(exp(A_log) · (f_b(f_a x) + dt_bias))``; the delta rule via
``pallas_kernels.kda``; per-head RMSNorm of the output gated by ``sigmoid(g_b(g_a x))``; o_proj.

Cache (slots of the pool, DESIGN rule 5): ``state [H, K, V]`` fp32 and ``conv [3 (q|k|v),
kernel-1, H·K]`` (the last kernel-1 projected inputs). Padded tokens of a chunk get
``beta = 0, g = 0``, which leaves the state untouched; padded rows use slot 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kk_jax.models.layers.linear import Linear, project
from kk_jax.models.layers.norm import rms_norm
from kk_jax.parallel.mesh import shard_heads
from pallas_kernels.kda import chunk_kda, kda_decode, kda_gate


class KDAAttention(nnx.Module):
    FUSIBLE = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, cfg, dtype):
        d, h, dk = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim
        qkv = h * dk
        self.h, self.dk, self.kernel = h, dk, cfg.linear_conv_kernel_dim
        self.lower_bound, self.eps = cfg.linear_lower_bound, cfg.rms_norm_eps
        self.q_proj = Linear(d, qkv, dtype, axes=("heads", "embed"))
        self.k_proj = Linear(d, qkv, dtype, axes=("heads", "embed"))
        self.v_proj = Linear(d, qkv, dtype, axes=("heads", "embed"))
        conv = lambda: nnx.Param(jnp.zeros((qkv, 1, self.kernel), dtype), axes=("heads", None, None))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = Conv(conv()), Conv(conv()), Conv(conv())
        self.A_log = nnx.Param(jnp.zeros((h,), jnp.float32), axes=("heads",))
        self.dt_bias = nnx.Param(jnp.zeros((qkv,), jnp.float32), axes=("heads",))
        self.b_proj = Linear(d, h, dtype, axes=("heads", "embed"))
        self.f_a_proj = Linear(d, dk, dtype, axes=(None, "embed"))
        self.f_b_proj = Linear(dk, qkv, dtype, axes=("heads", None))
        self.g_a_proj = Linear(d, dk, dtype, axes=(None, "embed"))
        self.g_b_proj = Linear(dk, qkv, dtype, axes=("heads", None))
        self.o_norm = OutNorm(dk, dtype)
        self.o_proj = Linear(qkv, d, dtype, axes=("embed", "heads"))

    def _conv(self, x, conv_state, valid_len):
        """x [B, T, 3, C] projected q|k|v; conv_state [B, 3, kernel-1, C].

        Returns SiLU(causal conv) [B, T, 3, C] and the new state: the last kernel-1 inputs up to
        each row's ``valid_len``."""
        km1 = self.kernel - 1
        seq = jnp.concatenate([conv_state.transpose(0, 2, 1, 3).astype(x.dtype), x], axis=1)   # [B, km1+T, 3, C]
        w = jnp.stack([self.q_conv1d.weight[...][:, 0], self.k_conv1d.weight[...][:, 0],
                       self.v_conv1d.weight[...][:, 0]])                                       # [3, C, kernel]
        t = x.shape[1]
        out = sum(seq[:, j:j + t].astype(jnp.float32) * w[None, None, :, :, j].astype(jnp.float32)
                  for j in range(self.kernel))
        new_state = jax.vmap(lambda s, n: jax.lax.dynamic_slice_in_dim(s, n, km1, axis=0))(seq, valid_len)
        return jax.nn.silu(out).astype(x.dtype), new_state.transpose(0, 2, 1, 3)

    def __call__(self, x, state_pool, conv_pool, slots, valid, backend: str, mesh):
        """x [B, T, D]; valid [B, T] (a prefix of each row); slots [B].

        Returns (out [B, T, D], state_pool, conv_pool)."""
        b, t, _ = x.shape
        h, dk = self.h, self.dk
        mixed = jnp.stack(project(self, "qkv_proj", x), axis=2)                             # [B, T, 3, H·K]
        valid_len = jnp.sum(valid, axis=1).astype(jnp.int32)
        mixed, conv = self._conv(mixed, conv_pool[slots], valid_len)
        conv_pool = conv_pool.at[slots].set(conv.astype(conv_pool.dtype))
        q, k, v = (mixed[:, :, i].reshape(b, t, h, dk) for i in range(3))
        f = self.f_b_proj(self.f_a_proj(x)).reshape(b, t, h, dk)
        g = kda_gate(f, self.A_log[...], self.dt_bias[...], self.lower_bound, backend=backend)   # [B, T, H, K] f32
        beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))                              # [B, T, H]
        g = jnp.where(valid[:, :, None, None], g, 0.0)
        beta = jnp.where(valid[:, :, None], beta, 0.0)
        o, state_pool = recurrence(q, k, v, g, beta, state_pool, slots, backend, mesh)
        gate = self.g_b_proj(self.g_a_proj(x)).reshape(b, t, h, dk)
        o = self.o_norm(o, gate, self.eps)
        return self.o_proj(o.reshape(b, t, h * dk)), state_pool, conv_pool


def recurrence(q, k, v, g, beta, state_pool, slots, backend: str, mesh):
    """The delta rule on this step's tokens, per head shard (``jax.shard_map`` over tp).

    q, k, v, g [B, T, H, K]; beta [B, T, H]; state_pool [S, H, K, V]. T == 1 runs the decode
    kernel on the pool in place; T > 1 the chunked kernel from each row's slot state.
    Returns (o [B, T, H, V], state_pool)."""

    def per_shard(q, k, v, g, beta, state_pool, slots):
        if q.shape[1] == 1:
            o, state_pool = kda_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state_pool, slots,
                                       use_qk_l2norm=True, backend=backend)
            return o[:, None], state_pool
        o, final = chunk_kda(q, k, v, g, beta, initial_state=state_pool[slots], output_final_state=True,
                             use_qk_l2norm=True, backend=backend)
        return o, state_pool.at[slots].set(final)

    heads = (None, None, "heads", None)
    return shard_heads(per_shard, mesh, in_axes=(heads, heads, heads, heads, (None, None, "heads"),
                                                 (None, "heads", None, None), None),
                       out_axes=(heads, (None, "heads", None, None)))(q, k, v, g, beta, state_pool, slots)


class Conv(nnx.Module):
    """Depthwise causal conv weight ``[channels, 1, kernel]`` (HF ``*_conv1d.weight``)."""

    def __init__(self, weight: nnx.Param):
        self.weight = weight


class OutNorm(nnx.Module):
    """Per-head RMSNorm gated by ``sigmoid(gate)``, all in fp32 (``o_norm.weight [K]``)."""

    def __init__(self, dim: int, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype), axes=(None,))

    def __call__(self, o, gate, eps):
        y = rms_norm(o.astype(jnp.float32), self.weight[...].astype(jnp.float32), eps)
        return (y * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(o.dtype)
