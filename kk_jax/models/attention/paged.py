"""Attention over a paged KV cache: write this step's K/V into pages, then attend.

Prefill (T > 1 tokens per sequence) gathers each sequence's pages into a contiguous
``[S, Hkv, D]`` view and runs causal attention with an explicit position mask (queries at
absolute positions, so a later chunk of a chunked prefill sees the earlier chunks). On the
GPU that is tokamax's Mosaic GPU flash attention; elsewhere a jnp twin. Decode (T == 1) runs
``pallas_kernels.paged_attention`` directly on the pages.

Everything per head runs inside ``jax.shard_map`` over ``tp``: each shard owns its query
heads and the matching kv heads of the pool (DESIGN rule 8).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from kk_jax.parallel.mesh import TP, shard_heads
from pallas_kernels.paged_attention import paged_decode_attention, prologue
from pallas_kernels.paged_attention.kernel import _padded_group, attend_prepared

_MASKED = -1e30  # finite: fully masked (padding) rows stay NaN-free


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionBatch:
    """Per-step attention metadata (device arrays).

    positions  [B, T] int32  absolute position of each token
    valid      [B, T] bool   real tokens; padded tokens write K/V to the dummy page 0
    page_table [B, max_pages] int32  pages of each sequence; unused entries are 0
    kv_lens    [B] int32     tokens in the cache after this step (0 for padded rows)
    slots      [B] int32     per-sequence state slot (0, the dummy, for padded rows and for
                             models without slot state)
    stack_index [] int32 | None  the layer's group in a scanned run (None outside one), for
                             weights kept stacked inside the scan (routed experts)
    """

    positions: jax.Array
    valid: jax.Array
    page_table: jax.Array
    kv_lens: jax.Array
    slots: jax.Array
    stack_index: jax.Array | None = None

    def in_stack(self, layer, num_pages: int, num_slots: int) -> "AttentionBatch":
        """The batch as layer ``layer`` (traced) of a stacked pool addresses it: pages and slots
        shifted into that layer's block (cache.pools, ``stack``)."""
        return dataclasses.replace(self, page_table=self.page_table + layer * num_pages,
                                   slots=self.slots + layer * num_slots, stack_index=layer)


def write_pages(pages, x, positions, valid, page_table):
    """Scatters per-token x [B, T, ...] into pages [P, page_size, ...] at their positions;
    invalid (padded) tokens go to the dummy page 0."""
    page_size = pages.shape[1]
    page = jnp.take_along_axis(page_table, positions // page_size, axis=1)   # [B, T]
    page = jnp.where(valid, page, 0)
    if pages.dtype == jnp.float8_e4m3fn:           # saturate: e4m3fn has no infinity
        x = jnp.clip(x.astype(jnp.float32), -448.0, 448.0)
    return pages.at[page, positions % page_size].set(x.astype(pages.dtype))


def write_kv(k_pages, v_pages, k, v, positions, valid, page_table):
    """Scatters k/v [B, T, Hkv, D] into pages [P, page_size, Hkv, D] at their positions."""
    return (write_pages(k_pages, k, positions, valid, page_table),
            write_pages(v_pages, v, positions, valid, page_table))


def prefill_attention_reference(q, k, v, positions, kv_lens, scale):
    """jnp causal GQA attention. q [B, T, Hq, D]; k, v [B, S, Hkv, D] -> [B, T, Hq, D]."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    key_pos = jnp.arange(k.shape[1])
    mask = (key_pos[None, None, :] <= positions[:, :, None]) & (key_pos[None, None, :] < kv_lens[:, None, None])
    s = jnp.where(mask[:, None, None], s, _MASKED)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, t, hq, d).astype(q.dtype)


def prefill_attention_tokamax(q, k, v, positions, kv_lens, scale):
    """Same contract as the reference, on tokamax's Mosaic GPU flash attention (sm90)."""
    import tokamax

    key_pos = jnp.arange(k.shape[1])
    mask = (key_pos[None, None, :] <= positions[:, :, None]) & (key_pos[None, None, :] < kv_lens[:, None, None])
    return tokamax.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale, implementation="mosaic")


@dataclasses.dataclass(frozen=True)
class PagedAttention:
    """The attention op a model layer calls; fixed per server (mesh, backend, pool scales)."""

    mesh: Mesh
    backend: str            # "pallas" | "xla"
    scale: float
    interpret: bool = False  # pallas kernels in Mosaic GPU interpret mode (tests on CPU)

    def __call__(self, q, k, v, k_pages, v_pages, batch: AttentionBatch):
        """q [B, T, Hq, D]; k, v [B, T, Hkv, D] -> (o [B, T, Hq, D], k_pages, v_pages)."""
        decode = q.shape[1] == 1
        backend, scale = self.backend, self.scale

        def per_shard(q, k, v, k_pages, v_pages, positions, valid, page_table, kv_lens):
            k_pages, v_pages = write_kv(k_pages, v_pages, k, v, positions, valid, page_table)
            if decode:
                o = paged_decode_attention(q[:, 0], k_pages, v_pages, page_table, kv_lens,
                                           scale=scale, backend=backend, interpret=self.interpret)[:, None]
            else:
                b, maxp = page_table.shape
                ps = k_pages.shape[1]
                kc = k_pages[page_table].reshape(b, maxp * ps, *k_pages.shape[2:]).astype(q.dtype)
                vc = v_pages[page_table].reshape(b, maxp * ps, *v_pages.shape[2:]).astype(q.dtype)
                # Mosaic GPU attention has bf16/f16 modes only: fp32 serving (a debugging setup)
                # keeps the jnp prefill so that its numerics stay fp32
                fast = backend == "pallas" and q.dtype != jnp.float32
                attend = prefill_attention_tokamax if fast else prefill_attention_reference
                o = attend(q, kc, vc, positions, kv_lens, scale)
            return o, k_pages, v_pages

        heads = (None, None, "heads", None)
        kv_heads = (None, None, "kv_heads", None)
        fn = shard_heads(per_shard, self.mesh,
                         in_axes=(heads, kv_heads, kv_heads, kv_heads, kv_heads, None, None, None, None),
                         out_axes=(heads, kv_heads, kv_heads))
        return fn(q, k, v, k_pages, v_pages, batch.positions, batch.valid, batch.page_table, batch.kv_lens)

    def takes_qkv(self, head_dim: int, num_q_heads: int, num_kv_heads: int, pool_dtype, tokens: int) -> bool:
        """Whether :meth:`decode_qkv` serves a layer: one decode token per sequence, the pallas
        backend, and what the prologue kernel takes (D = 128, bf16 pages)."""
        tp = self.mesh.shape.get(TP, 1)
        group = num_q_heads // num_kv_heads
        return (tokens == 1 and self.backend == "pallas" and num_kv_heads % tp == 0
                and prologue.supported(head_dim, pool_dtype, _padded_group(group), group))

    def decode_qkv(self, qkv, q_norm, k_norm, theta: float, k_pages, v_pages, batch: AttentionBatch, *,
                   num_q_heads: int, num_kv_heads: int):
        """A decode step from the fused q/k/v projection: qkv [B, 1, (Hq + 2 Hkv) D] (per shard: that
        shard's q, k, v heads), per-head RMSNorms q_norm / k_norm, RoPE base theta -> (o [B, 1, Hq,
        D], k_pages, v_pages). The norms, rotations and page writes run in one kernel
        (`pallas_kernels.paged_attention.prologue`), then the attention kernel."""
        d, ps = k_pages.shape[-1], k_pages.shape[1]
        pos = batch.positions[:, 0]
        ang = pos.astype(jnp.float32)[:, None] * theta ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
        page = jnp.take_along_axis(batch.page_table, (pos // ps)[:, None], axis=1)[:, 0]
        page = jnp.where(batch.valid[:, 0], page, 0)
        tp = self.mesh.shape.get(TP, 1)
        hq, hkv = num_q_heads // tp, num_kv_heads // tp
        group = hq // hkv
        scale, interpret, eps = self.scale, self.interpret, float(q_norm.eps)

        def per_shard(qkv, qw, kw, cos, sin, page, slot, k_pages, v_pages, page_table, kv_lens):
            qs, k_pages, v_pages = prologue.decode_prologue(
                qkv[:, 0], qw, kw, cos, sin, page, slot, k_pages, v_pages, num_q_heads=hq, num_kv_heads=hkv,
                eps=eps, scale=scale, group_p=_padded_group(group), interpret=interpret)
            o = attend_prepared(qs, k_pages, v_pages, page_table, kv_lens, group=group, interpret=interpret,
                                out_dtype=qkv.dtype)
            return o.reshape(o.shape[0], 1, hq, d), k_pages, v_pages

        heads, kv_heads = (None, None, "heads", None), (None, None, "kv_heads", None)
        fn = shard_heads(per_shard, self.mesh,
                         in_axes=((None, None, "heads"), None, None, None, None, None, None, kv_heads, kv_heads,
                                  None, None),
                         out_axes=(heads, kv_heads, kv_heads))
        return fn(qkv, q_norm.weight[...], k_norm.weight[...], jnp.cos(ang), jnp.sin(ang), page, pos % ps,
                  k_pages, v_pages, batch.page_table, batch.kv_lens)
