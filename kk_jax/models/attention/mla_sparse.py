"""GLM-5.3 DSA layer: NoPE multi-head latent attention over indexer-selected tokens (models.md §1.5).

``qr = RMSNorm(q_a x)``, ``q = q_b qr [H, nope]``; the cache holds one shared latent
``c = RMSNorm(kv_a x) [kv_lora]`` per token (keys = values = c, MQA over the latent). Attention
runs in the absorbed form: ``q_abs[h] = W_kb[h]ᵀ q[h]``, ``softmax(q_abs · c / √nope)`` over
the selected tokens, ``o[h] = W_vb[h] (Σ att · c)``, then o_proj. No positions (no RoPE).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from kk_jax.models.attention.paged import write_pages
from kk_jax.models.attention.pooled_indexer import PooledIndexer
from kk_jax.models.layers.linear import Linear
from kk_jax.models.layers.norm import RMSNorm

_MASKED = -1e30


class SparseMLA(nnx.Module):
    def __init__(self, cfg, dtype):
        d, h = cfg.hidden_size, cfg.num_attention_heads
        self.h, self.nope, self.vd, self.kl = h, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        eps = cfg.rms_norm_eps
        self.q_a_proj = Linear(d, cfg.q_lora_rank, dtype, axes=(None, "embed"))
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps, dtype)
        self.q_b_proj = Linear(cfg.q_lora_rank, h * self.nope, dtype, axes=("heads", None))
        self.kv_a_proj_with_mqa = Linear(d, self.kl, dtype, axes=(None, "embed"))
        self.kv_a_layernorm = RMSNorm(self.kl, eps, dtype)
        self.kv_b_proj = Linear(self.kl, h * (self.nope + self.vd), dtype, axes=("heads", None))
        self.o_proj = Linear(h * self.vd, d, dtype, axes=("embed", "heads"))
        self.indexer = PooledIndexer(cfg, dtype)

    def __call__(self, x, latent_pool, index, tail_pool, batch, backend: str = "xla"):
        """x [B, T, D]; index = (pooled keys, fp8 scales or None) -> (out [B, T, D], latent_pool,
        index, tail_pool). ``backend`` "pallas" (GPU) multiplies bf16 operands on the tensor cores."""
        b, t, _ = x.shape
        h, nope, vd, kl = self.h, self.nope, self.vd, self.kl
        qr = self.q_a_layernorm(self.q_a_proj(x))                                            # [B, T, ql]
        q = self.q_b_proj(qr).reshape(b, t, h, nope)
        c = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x))                                  # [B, T, kl]
        latent_pool = write_pages(latent_pool, c, batch.positions, batch.valid, batch.page_table)
        index, tail_pool = self.indexer.update_pools(x, index, tail_pool, batch.slots, batch.positions,
                                                     batch.valid, batch.page_table)
        mask = self.indexer.select(x, qr, index, batch.positions, batch.page_table)          # [B, T, S]
        lat = latent_pool[batch.page_table].reshape(b, -1, kl)                               # [B, S, kl]
        # Products take operands rounded to the model dtype with fp32 accumulation: on the GPU
        # backend bf16 operands run on the tensor cores (as FlashMLA); float32 models, and the
        # xla backend (XLA:CPU has no bf16 x bf16 -> f32 batched dot), multiply in exact fp32.
        # Softmax is fp32.
        exact = x.dtype == jnp.float32 or backend != "pallas"
        f32 = jnp.float32
        op, prec = (f32, jax.lax.Precision.HIGHEST) if exact else (x.dtype, None)
        mm = lambda spec, a, w: jnp.einsum(spec, a.astype(op), w, precision=prec, preferred_element_type=f32)
        wkv = self.kv_b_proj.dense_weight(x.dtype).astype(op).reshape(h, nope + vd, kl)   # dequantized if quantized
        lat = lat.astype(x.dtype).astype(op)
        q_abs = mm("bthn,hnc->bthc", q, wkv[:, :nope])
        s = mm("bthc,bsc->bhts", q_abs, lat) * nope ** -0.5
        s = jnp.where(mask[:, None], s, _MASKED)
        p = jax.nn.softmax(s, axis=-1)
        o_lat = mm("bhts,bsc->bthc", p, lat)
        o = mm("bthc,hvc->bthv", o_lat, wkv[:, nope:]).astype(x.dtype)
        return self.o_proj(o.reshape(b, t, h * vd)), latent_pool, index, tail_pool
