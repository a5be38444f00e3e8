"""GLM-5.3 DSA layer: NoPE multi-head latent attention over indexer-selected tokens (models.md §1.5).

``qr = RMSNorm(q_a x)``, ``q = q_b qr [H, nope]``; the cache holds one shared latent
``c = RMSNorm(kv_a x) [kv_lora]`` per token (keys = values = c, MQA over the latent). Attention
runs in the absorbed form: ``q_abs[h] = W_kb[h]ᵀ q[h]``, ``softmax(q_abs · c / √nope)`` over
the selected tokens, ``o[h] = W_vb[h] (Σ att · c)``, then o_proj. No positions (no RoPE).

Only the selected tokens' latents are gathered (at most ``index_topk + kpool - 1`` per query),
never the whole context, and a prefill chunk is processed in query blocks whose intermediates
fit :data:`BLOCK_BYTES`: memory and latent reads per query do not grow with the context.
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
        keys, rotated = self.indexer.pooled_keys(index, batch.page_table)                    # [B, NP, d]
        # Products take operands rounded to the model dtype with fp32 accumulation: on the GPU
        # backend bf16 operands run on the tensor cores (as FlashMLA); float32 models, and the
        # xla backend (XLA:CPU has no bf16 x bf16 -> f32 batched dot), multiply in exact fp32.
        # Softmax is fp32.
        exact = x.dtype == jnp.float32 or backend != "pallas"
        f32 = jnp.float32
        op, prec = (f32, jax.lax.Precision.HIGHEST) if exact else (x.dtype, None)
        mm = lambda spec, a, w: jnp.einsum(spec, a.astype(op), w, precision=prec, preferred_element_type=f32)
        wkv = self.kv_b_proj.dense_weight(x.dtype).astype(op).reshape(h, nope + vd, kl)   # dequantized if quantized
        ps, span = latent_pool.shape[1], batch.page_table.shape[1]
        flat = latent_pool.reshape(-1, kl)

        def attend(q, qr, x, positions):
            """One block of queries [B, Tq, ...] -> o [B, Tq, H, vd] over its selected tokens."""
            tok, ok = self.indexer.selected_tokens(x, qr, keys, rotated, positions)           # [B, Tq, G]
            page = jnp.take_along_axis(batch.page_table, jnp.clip(tok // ps, 0, span - 1).reshape(b, -1),
                                       axis=1).reshape(tok.shape)
            lat = flat[page * ps + tok % ps].astype(x.dtype).astype(op)                       # [B, Tq, G, kl]
            q_abs = mm("bthn,hnc->bthc", q, wkv[:, :nope])
            s = mm("bthc,btgc->bthg", q_abs, lat) * nope ** -0.5
            p = jax.nn.softmax(jnp.where(ok[:, :, None], s, _MASKED), axis=-1)
            o_lat = mm("bthg,btgc->bthc", p, lat)
            return mm("bthc,hvc->bthv", o_lat, wkv[:, nope:]).astype(x.dtype)

        g = (min(self.indexer.select_pools, keys.shape[1]) + self.indexer.with_tail) * self.indexer.kpool
        # bytes per query: indexer dots and ReLU [ih, NP] + scores [NP] (f32), gathered latents
        # [G, kl], scores / probabilities / mask [H, G], q_abs and o_lat [H, kl] (f32)
        per_query = (8 * keys.shape[1] * (self.indexer.heads + 1) + g * kl * jnp.dtype(op).itemsize
                     + 12 * h * g + 8 * h * kl)
        o = by_query_blocks(attend, query_block(b, t, per_query), q, qr, x, batch.positions)
        return self.o_proj(o.reshape(b, t, h * vd)), latent_pool, index, tail_pool


# Bytes of selection and attention intermediates one query block may hold (per DSA layer call).
BLOCK_BYTES = 1 << 30


def query_block(b: int, t: int, per_query: int) -> int:
    """The largest divisor of ``t`` whose ``b`` rows of that many queries, ``per_query`` bytes
    each, fit :data:`BLOCK_BYTES`."""
    cap = max(1, BLOCK_BYTES // (b * per_query))
    return max(d for d in range(1, min(t, cap) + 1) if t % d == 0)


def by_query_blocks(fn, tq: int, *xs):
    """``fn`` over axis 1 (queries) of ``xs`` in blocks of ``tq``, one block after another, so
    that a prefill chunk's ``[T, selected tokens]`` intermediates never exist all at once."""
    t = xs[0].shape[1]
    if tq >= t:
        return fn(*xs)
    nb = t // tq
    split = lambda a: jnp.moveaxis(a.reshape(a.shape[0], nb, tq, *a.shape[2:]), 1, 0)
    out = jax.lax.map(lambda blk: fn(*blk), tuple(split(a) for a in xs))              # [nb, B, tq, ...]
    return jnp.moveaxis(out, 0, 1).reshape(out.shape[1], t, *out.shape[3:])
