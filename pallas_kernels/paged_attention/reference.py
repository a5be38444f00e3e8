"""Pure-jnp paged decode attention: the numerical reference for the Pallas kernel.

Same signature as the public ``paged_decode_attention`` minus ``backend`` and
``interpret``. It gathers every page of the page table, masks positions
``>= kv_len`` and does the softmax in fp32. It is simple, not fast: it reads
``max_pages * page_size`` positions of every sequence whatever its length.

Shapes (B sequences, Hq query heads, Hkv kv heads, D head dim, P pages):
  q          [B, Hq, D]                 bf16 / f32, one query token per sequence
  k_pages    [P, page_size, Hkv, D]     bf16 / f32 / float8_e4m3fn; real = stored * k_scale
  v_pages    [P, page_size, Hkv, D]     same dtype as k_pages; real = stored * v_scale
  page_table [B, max_pages] int32       page ids in sequence order (0 = dummy page)
  kv_lens    [B] int32                  valid tokens per sequence (0 for padded rows)
  returns    [B, Hq, D] in q.dtype      rows with kv_len == 0 are zeros

Masked positions get exactly zero weight, and their V values are replaced by
zero before the P @ V product, so stale or uninitialised pool slots (even NaN)
past ``kv_len`` never leak into the output.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax


def validate_inputs(q, k_pages, v_pages, page_table, kv_lens) -> None:
  """Checks ranks, shapes and dtypes; raises ValueError saying what to change."""
  if q.ndim != 3:
    raise ValueError(f"q must be [B, Hq, D], got shape {q.shape}")
  if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
    raise ValueError(
        "k_pages and v_pages must both be [P, page_size, Hkv, D] with the same"
        f" shape, got {k_pages.shape} and {v_pages.shape}")
  if k_pages.dtype != v_pages.dtype:
    raise ValueError(
        f"k_pages and v_pages dtypes differ: {k_pages.dtype} vs {v_pages.dtype}")
  batch, num_q_heads, head_dim = q.shape
  _, _, num_kv_heads, head_dim_kv = k_pages.shape
  if head_dim != head_dim_kv:
    raise ValueError(f"head_dim of q ({head_dim}) and of the pages ({head_dim_kv}) differ")
  if num_q_heads % num_kv_heads:
    raise ValueError(
        f"Hq={num_q_heads} must be a multiple of Hkv={num_kv_heads} (GQA)")
  if page_table.ndim != 2 or page_table.shape[0] != batch:
    raise ValueError(
        f"page_table must be [B={batch}, max_pages], got {page_table.shape}")
  if kv_lens.shape != (batch,):
    raise ValueError(f"kv_lens must be [B={batch}], got {kv_lens.shape}")
  if page_table.dtype != jnp.int32 or kv_lens.dtype != jnp.int32:
    raise ValueError(
        f"page_table and kv_lens must be int32, got {page_table.dtype} and {kv_lens.dtype}")


def paged_decode_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    kv_lens: jax.Array,
    *,
    scale: float | None = None,
    k_scale: float | jax.Array = 1.0,
    v_scale: float | jax.Array = 1.0,
) -> jax.Array:
  """Decode attention over a paged KV cache, in fp32, by gathering all pages."""
  validate_inputs(q, k_pages, v_pages, page_table, kv_lens)
  batch, num_q_heads, head_dim = q.shape
  _, page_size, num_kv_heads, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  max_pages = page_table.shape[1]
  max_len = max_pages * page_size
  if scale is None:
    scale = 1.0 / math.sqrt(head_dim)
  hi = lax.Precision.HIGHEST

  # [B, max_pages, page_size, Hkv, D] -> [B, T, Hkv, D], T = max_pages * page_size.
  k = k_pages[page_table].reshape(batch, max_len, num_kv_heads, head_dim)
  v = v_pages[page_table].reshape(batch, max_len, num_kv_heads, head_dim)
  k = k.astype(jnp.float32) * jnp.asarray(k_scale, jnp.float32)
  v = v.astype(jnp.float32) * jnp.asarray(v_scale, jnp.float32)

  valid = jnp.arange(max_len)[None, :] < kv_lens[:, None]          # [B, T]
  v = jnp.where(valid[:, :, None, None], v, 0.0)

  qg = q.astype(jnp.float32).reshape(batch, num_kv_heads, group, head_dim)
  s = jnp.einsum("bhgd,bthd->bhgt", qg, k, precision=hi) * scale  # [B, Hkv, G, T]
  mask = valid[:, None, None, :]
  s = jnp.where(mask, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)                          # empty rows
  p = jnp.where(mask, jnp.exp(s - m), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  o = jnp.einsum("bhgt,bthd->bhgd", p, v, precision=hi)
  o = o / jnp.where(l == 0.0, 1.0, l)
  return o.reshape(batch, num_q_heads, head_dim).astype(q.dtype)
