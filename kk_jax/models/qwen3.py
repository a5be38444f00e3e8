"""Qwen3 decoder (``Qwen3ForCausalLM``) as Flax NNX modules over a paged KV cache.

Math (reference/models.md, reference/qwen3-checkpoint.md): per layer
``h = x + o_proj(attn(rope(q_norm(q)), rope(k_norm(k)), v))`` with GQA, per-head RMSNorm on
q and k before RoPE (rotate-half, ``rope_theta``), then ``h + mlp(post_attention_layernorm(h))``
with SwiGLU; a final RMSNorm and an lm_head (tied to the embedding when
``tie_word_embeddings``). Attribute names mirror the HF tensor names, so the NNX state path
``model.layers.3.self_attn.o_proj.weight`` *is* the checkpoint name; q/k/v and gate/up run fused
(``qkv_proj`` / ``gate_up_proj``, see ``layers.linear.fuse_projections``) and their parameters
name the checkpoint tensors they concatenate.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from kk_jax.cache.pools import CacheLayout, PagedSpec
from kk_jax.config import Qwen3Config
from kk_jax.models.attention.paged import AttentionBatch, PagedAttention
from kk_jax.models.layers.embed import Embedding
from kk_jax.models.layers.linear import Linear, project
from kk_jax.models.layers.mlp import SwiGLU
from kk_jax.models.layers.norm import RMSNorm
from kk_jax.models.layers.rope import apply_rope


class Qwen3Attention(nnx.Module):
    FUSIBLE = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, cfg: Qwen3Config, dtype):
        d, hq, hkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.cfg = cfg
        self.q_proj = Linear(d, hq * hd, dtype, axes=("heads", "embed"), bias=cfg.attention_bias)
        self.k_proj = Linear(d, hkv * hd, dtype, axes=("kv_heads", "embed"), bias=cfg.attention_bias)
        self.v_proj = Linear(d, hkv * hd, dtype, axes=("kv_heads", "embed"), bias=cfg.attention_bias)
        self.o_proj = Linear(hq * hd, d, dtype, axes=("embed", "heads"))
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype)

    def __call__(self, x, kv, batch: AttentionBatch, attn: PagedAttention, *, norm=None, residual=None):
        """x [B, T, hidden]; kv = (k_pages, v_pages) -> (residual + out [B, T, hidden], kv), x
        normalised by ``norm`` first (norm and residual optional; the linears fuse them into
        their kernels where they can)."""
        cfg = self.cfg
        b, t, _ = x.shape
        fused = getattr(self, "qkv_proj", None)
        if fused is not None and attn.takes_qkv(cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                                                 kv[0].dtype, t):
            o, k_pages, v_pages = attn.decode_qkv(fused(x, norm=norm), self.q_norm, self.k_norm, cfg.rope_theta,
                                                  kv[0], kv[1], batch, num_q_heads=cfg.num_attention_heads,
                                                  num_kv_heads=cfg.num_key_value_heads)
            return self.o_proj(o.reshape(b, t, -1), residual=residual), (k_pages, v_pages)
        q, k, v = project(self, "qkv_proj", x, norm=norm)
        q = q.reshape(b, t, cfg.num_attention_heads, cfg.head_dim)                    # [B, T, Hq, D]
        k = k.reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)                    # [B, T, Hkv, D]
        v = v.reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)                    # [B, T, Hkv, D]
        q = apply_rope(self.q_norm(q), batch.positions, cfg.rope_theta)
        k = apply_rope(self.k_norm(k), batch.positions, cfg.rope_theta)
        o, k_pages, v_pages = attn(q, k, v, kv[0], kv[1], batch)                      # [B, T, Hq, D]
        return self.o_proj(o.reshape(b, t, -1), residual=residual), (k_pages, v_pages)


class Qwen3DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen3Config, dtype):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Qwen3Attention(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype)

    def __call__(self, x, kv, batch, attn):
        h, kv = self.self_attn(x, kv, batch, attn, norm=self.input_layernorm, residual=x)
        return self.mlp(h, norm=self.post_attention_layernorm, residual=h), kv


class Qwen3Model(nnx.Module):
    def __init__(self, cfg: Qwen3Config, dtype):
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nnx.List([Qwen3DecoderLayer(cfg, dtype) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class Qwen3ForCausalLM(nnx.Module):
    """Causal LM over the paged cache pools ``layers.{i}.k`` / ``layers.{i}.v``."""

    config_class = Qwen3Config

    def __init__(self, cfg: Qwen3Config, dtype):
        self.cfg = cfg
        self.model = Qwen3Model(cfg, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, dtype, axes=("vocab", "embed"))

    @staticmethod
    def cache_layout(cfg: Qwen3Config, kv_dtype) -> CacheLayout:
        entry = PagedSpec((cfg.num_key_value_heads, cfg.head_dim), kv_dtype, ("kv_heads", None))
        return {f"layers.{i}.{kv}": entry for i in range(cfg.num_hidden_layers) for kv in ("k", "v")}

    @staticmethod
    def divisible_sizes(cfg: Qwen3Config) -> dict[str, int]:
        """Sizes that the tp degree must divide."""
        return {"num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
                "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size}

    @staticmethod
    def ignored_tensors(cfg: Qwen3Config) -> tuple[str, ...]:
        return ()

    @staticmethod
    def pallas_unsupported(cfg: Qwen3Config) -> str | None:
        """Why the GPU kernels cannot run this model (tiny test models), or None."""
        from pallas_kernels.paged_attention import pallas_supports
        from pallas_kernels.paged_attention.kernel import MAX_GROUP, SUPPORTED_HEAD_DIMS

        group = cfg.num_attention_heads // cfg.num_key_value_heads
        if not pallas_supports(cfg.head_dim, group):
            return (f"the Pallas paged decode attention kernel takes head_dim in {SUPPORTED_HEAD_DIMS} and at most "
                    f"{MAX_GROUP} query heads per kv head; this model has head_dim {cfg.head_dim} and {group}")
        return None

    @staticmethod
    def make_ops(cfg: Qwen3Config, mesh, backend: str, kda_backend: str | None = None) -> PagedAttention:
        """The paged-attention op (Qwen3 has no KDA layers: ``kda_backend`` is unused)."""
        return PagedAttention(mesh=mesh, backend=backend, scale=1.0 / math.sqrt(cfg.head_dim))

    def __call__(self, tokens, batch: AttentionBatch, pools: dict, attn: PagedAttention):
        """tokens [B, T] int32 -> (hidden [B, T, hidden] after the final norm, pools)."""
        x = self.model.embed_tokens(tokens)                                          # [B, T, hidden]
        pools = dict(pools)
        for i, layer in enumerate(self.model.layers):
            with jax.named_scope(f"layer_{i}"):
                kv = (pools[f"layers.{i}.k"], pools[f"layers.{i}.v"])
                x, (pools[f"layers.{i}.k"], pools[f"layers.{i}.v"]) = layer(x, kv, batch, attn)
        return self.model.norm(x), pools

    def logits(self, h: jax.Array) -> jax.Array:
        """h [..., hidden] -> logits [..., vocab] fp32."""
        with jax.named_scope("lm_head"):
            if self.lm_head is None:
                return self.model.embed_tokens.attend(h)
            return jnp.einsum("...d,vd->...v", h, self.lm_head.weight[...], preferred_element_type=jnp.float32)
