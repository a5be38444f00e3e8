"""Paged decode attention: one query token per sequence over a paged KV cache.

    o = paged_decode_attention(q, k_pages, v_pages, page_table, kv_lens, *,
                               scale=None, k_scale=1.0, v_scale=1.0,
                               backend="pallas", interpret=False)

  q          [B, Hq, D]               bf16 or f32
  k_pages    [P, page_size, Hkv, D]   bf16, f32 or float8_e4m3fn (real = stored * k_scale)
  v_pages    same as k_pages          (real = stored * v_scale)
  page_table [B, max_pages] int32     page ids in order; unused entries 0 (dummy page)
  kv_lens    [B] int32                valid tokens per sequence; 0 for padded rows
  returns    [B, Hq, D] in q.dtype    rows with kv_len == 0 are zeros

GQA: Hq % Hkv == 0 and query head h reads kv head h // (Hq // Hkv).
scale defaults to 1 / sqrt(D).

backend="xla" is the pure-jnp reference (`reference.py`, fp32, any shape).
backend="pallas" is the Mosaic GPU kernel (`kernel.py`, Hopper): page_size in
{8, 16, 32, 64, 128, 256}, D in {64, 128, 256}, Hq // Hkv <= 64; it raises
ValueError otherwise. interpret=True runs the kernel in Mosaic GPU interpret mode
(CPU). The backend is chosen once per server, never per call.
"""

from __future__ import annotations

from .kernel import paged_decode_attention_kernel
from .reference import paged_decode_attention_reference

BACKENDS = ("pallas", "xla")


def paged_decode_attention(q, k_pages, v_pages, page_table, kv_lens, *,
                           scale=None, k_scale=1.0, v_scale=1.0,
                           backend="pallas", interpret=False):
  """Decode attention over a paged KV cache; see the module docstring."""
  if backend == "xla":
    return paged_decode_attention_reference(
        q, k_pages, v_pages, page_table, kv_lens,
        scale=scale, k_scale=k_scale, v_scale=v_scale)
  if backend == "pallas":
    return paged_decode_attention_kernel(
        q, k_pages, v_pages, page_table, kv_lens,
        scale=scale, k_scale=k_scale, v_scale=v_scale, interpret=interpret)
  raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def pallas_supports(head_dim: int, q_per_kv: int) -> bool:
  """Whether the Pallas kernel takes heads of this size and grouping (page size and dtypes are
  the server's choice and checked per call)."""
  from .kernel import MAX_GROUP, SUPPORTED_HEAD_DIMS
  return head_dim in SUPPORTED_HEAD_DIMS and q_per_kv <= MAX_GROUP


__all__ = ["paged_decode_attention", "paged_decode_attention_kernel",
           "paged_decode_attention_reference", "pallas_supports", "BACKENDS"]
