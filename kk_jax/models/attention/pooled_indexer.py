"""GLM-5.3's C4 pooled lightning indexer (models.md §1.4, glm5-checkpoint.md edge cases).

Keys are LayerNorm'd per token, then every ``kpool`` (4) consecutive tokens are pooled by a
per-channel softmax over the pool's slots (gate scores + ``ape``). A query at position ``pos``
scores the complete pools ending at or before ``pos``:
``Σ_h w_h · ReLU(q_h · K_p / √d)`` with ``w = weights_proj(x) / √heads``, keeps the top
``index_topk / kpool`` pools and always the incomplete tail ``kpool·⌊(pos+1)/kpool⌋ … pos``.
With no more complete pools than that, selection is exactly dense causal attention.

Cache: pooled keys live in pages (``kpool`` tokens per entry) next to the latent pages; the
raw keys and gate scores of a sequence's incomplete pool live in its slot
(``tail [2 (key | gate), kpool, d]`` fp32) and carry across chunks and decode steps.

With an fp8 cache the pooled keys are stored in the serving layout of the reference: rotated
by the orthonormal ``d``-point Walsh–Hadamard transform, then e4m3 with one power-of-two scale
per pool (``2^ceil(log2(absmax / 448))``, absmax floored at 1e-4) — ``d + 4`` bytes per pool,
33 bytes per token at d = 128. Queries are rotated by the same matrix, so q·k is unchanged
up to the key quantization.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kk_jax.models.layers.linear import Linear

_NEG = -jnp.inf
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0


def hadamard(d: int) -> np.ndarray:
    """Orthonormal Sylvester Walsh–Hadamard matrix [d, d] (d a power of two); symmetric."""
    if d & (d - 1):
        raise ValueError(f"the fp8 index cache needs a power-of-two index_head_dim, got {d}")
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(d)


def quantize_keys(pooled: jax.Array):
    """Rotated pooled keys -> (e4m3 values [..., d], power-of-two scales [...] f32)."""
    rot = pooled @ jnp.asarray(hadamard(pooled.shape[-1]), jnp.float32)
    amax = jnp.maximum(jnp.max(jnp.abs(rot), axis=-1), 1e-4)
    scale = jnp.exp2(jnp.ceil(jnp.log2(amax / FP8_MAX)))
    return (rot / scale[..., None]).astype(FP8), scale


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, dtype, eps: float = 1e-6):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype), axes=(None,))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype), axes=(None,))

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        mu = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
        y = (xf - mu) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class PooledIndexer(nnx.Module):
    def __init__(self, cfg, dtype):
        d, ih, idim = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
        self.heads, self.dim, self.kpool = ih, idim, cfg.index_kpool
        self.select_pools = cfg.index_topk // cfg.index_kpool
        self.with_tail = cfg.index_kpool_always_select_tail
        self.wq_b = Linear(cfg.q_lora_rank, ih * idim, dtype, axes=(None, None))
        self.wk = Linear(d, idim, dtype, axes=(None, "embed"))
        self.k_norm = LayerNorm(idim, dtype)
        self.weights_proj = Linear(d, ih, dtype, axes=(None, "embed"))
        self.index_kpool_compress_ape = nnx.Param(jnp.zeros((self.kpool, idim), dtype), axes=(None, None))
        self.index_kpool_compress_gate = nnx.Param(jnp.zeros((idim, d), dtype), axes=(None, "embed"))

    def update_pools(self, x, index, tail_pool, slots, positions, valid, page_table):
        """Pools every key group this chunk completes into ``index = (keys [P, page/kpool, d],
        scales [P, page/kpool] or None)`` and carries the new incomplete group in
        ``tail_pool [S, 2, kpool, d]``.

        x [B, T, D] (normed hidden); positions [B, T] (a row's tokens are consecutive from
        positions[:, 0]); valid [B, T] a prefix of each row."""
        b, t, _ = x.shape
        kp, d = self.kpool, self.dim
        ik = self.k_norm(self.wk(x)).astype(jnp.float32)                                    # [B, T, d]
        ig = jnp.einsum("btD,dD->btd", x, self.index_kpool_compress_gate[...],
                        preferred_element_type=jnp.float32)                                  # [B, T, d]
        n = jnp.sum(valid, axis=1).astype(jnp.int32)
        start = positions[:, 0]
        r = start % kp                                     # tokens of the open group already seen
        tail = tail_pool[slots]                                                              # [B, 2, kp, d]
        ext_len = -(-(t + kp - 1) // kp) * kp
        j = jnp.arange(ext_len)
        src = jnp.clip(j[None] - r[:, None], 0, t - 1)                                      # [B, L]
        from_tail = j[None] < r[:, None]
        take = lambda a: jnp.take_along_axis(a, src[..., None], axis=1)
        tail_idx = jnp.clip(j, 0, kp - 1)[None, :, None]
        ext_k = jnp.where(from_tail[..., None], jnp.take_along_axis(tail[:, 0], jnp.broadcast_to(
            tail_idx, (b, ext_len, 1)), axis=1), take(ik))
        ext_g = jnp.where(from_tail[..., None], jnp.take_along_axis(tail[:, 1], jnp.broadcast_to(
            tail_idx, (b, ext_len, 1)), axis=1), take(ig))
        groups = ext_len // kp
        gk = ext_k.reshape(b, groups, kp, d)
        gg = ext_g.reshape(b, groups, kp, d)
        prob = jax.nn.softmax(gg + self.index_kpool_compress_ape[...].astype(jnp.float32), axis=2)
        pooled = jnp.sum(prob * gk, axis=2)                                                  # [B, G, d]
        q = jnp.arange(groups)
        complete = (q[None] + 1) * kp <= (r + n)[:, None]                                    # [B, G]
        pool_id = (start - r)[:, None] // kp + q[None]                                       # absolute pool index
        keys, scales = index
        per_page = keys.shape[1]
        page = jnp.take_along_axis(page_table, jnp.clip(pool_id // per_page, 0, page_table.shape[1] - 1), axis=1)
        page = jnp.where(complete, page, 0)
        slot = pool_id % per_page
        if scales is None:
            keys = keys.at[page, slot].set(pooled.astype(keys.dtype))
        else:
            values, scale = quantize_keys(pooled)
            keys = keys.at[page, slot].set(values)
            scales = scales.at[page, slot].set(scale)
        # the new open group: ext[last*kp : last*kp + m] with m = (r + n) % kp
        last = (r + n) // kp
        s = jnp.arange(kp)
        gather = jnp.clip(last[:, None] * kp + s[None], 0, ext_len - 1)[..., None]
        keep = (s[None] < ((r + n) % kp)[:, None])[..., None]
        new_tail = jnp.stack([jnp.where(keep, jnp.take_along_axis(ext_k, gather, axis=1), 0.0),
                              jnp.where(keep, jnp.take_along_axis(ext_g, gather, axis=1), 0.0)], axis=1)
        tail_pool = tail_pool.at[slots].set(new_tail.astype(tail_pool.dtype))
        return (keys, scales), tail_pool

    def pooled_keys(self, index, page_table):
        """Every pool of each row's pages -> (keys [B, NP, d] f32, rotated). NP = the page table's
        token span / kpool. fp8 keys come back scaled but still Hadamard-rotated (``rotated``):
        queries must then be rotated too."""
        keys, scales = index
        b = page_table.shape[0]
        out = keys[page_table].reshape(b, -1, self.dim).astype(jnp.float32)                  # [B, NP, d]
        if scales is None:
            return out, False
        return out * scales[page_table].reshape(b, -1, 1), True

    def selected_tokens(self, x, qr, keys, rotated: bool, positions):
        """The tokens each query attends: (tokens [B, T, G] int32 positions, ok [B, T, G] bool).

        x [B, T, D], qr [B, T, q_lora], positions [B, T]; keys from :meth:`pooled_keys`. G =
        (min(topk pools, NP) + tail) * kpool: the top-scored visible complete pools, then the
        incomplete tail ``kpool·⌊(pos+1)/kpool⌋ … pos``; ``ok`` is False for padding (fewer
        visible pools than the top-k, tail slots after ``pos``). Each token appears at most
        once: selected pools are complete, the tail pool is not."""
        b, t, _ = x.shape
        kp, ih, d = self.kpool, self.heads, self.dim
        iq = self.wq_b(qr).reshape(b, t, ih, d).astype(jnp.float32)
        if rotated:
            iq = iq @ jnp.asarray(hadamard(d), jnp.float32)
        w = self.weights_proj(x).astype(jnp.float32) * ih ** -0.5                           # [B, T, ih]
        n_pools = keys.shape[1]
        dots = jnp.einsum("bthd,bpd->bthp", iq, keys, precision=jax.lax.Precision.HIGHEST) * d ** -0.5
        scores = jnp.einsum("bth,bthp->btp", w, jax.nn.relu(dots), precision=jax.lax.Precision.HIGHEST)
        p = jnp.arange(n_pools)
        visible = (p[None, None] + 1) * kp - 1 <= positions[..., None]                       # [B, T, NP]
        vals, idx = jax.lax.top_k(jnp.where(visible, scores, _NEG), min(self.select_pools, n_pools))
        slot = jnp.arange(kp)
        tokens = idx[..., None] * kp + slot                                                  # [B, T, k, kp]
        ok = jnp.broadcast_to((vals > _NEG)[..., None], tokens.shape)
        if self.with_tail:
            pos = positions[..., None, None]
            tail = (pos + 1) // kp * kp + slot                                               # [B, T, 1, kp]
            tokens = jnp.concatenate([tokens, tail], axis=2)
            ok = jnp.concatenate([ok, tail <= pos], axis=2)
        return tokens.reshape(b, t, -1).astype(jnp.int32), ok.reshape(b, t, -1)
