"""Slow, obviously-correct NumPy oracle for paged decode attention (tests only).

Loops over sequences, query heads and tokens in float64: for each token t < kv_len
it looks up page page_table[b, t // page_size], slot t % page_size, and does a
plain (two-pass) softmax. Used to check the jnp reference in fp32.
"""

import math

import numpy as np


def paged_attention_oracle(q, k_pages, v_pages, page_table, kv_lens, *,
                           scale=None, k_scale=1.0, v_scale=1.0):
  q = np.asarray(q, np.float64)
  k_pages = np.asarray(k_pages.astype(np.float32), np.float64) * float(k_scale)
  v_pages = np.asarray(v_pages.astype(np.float32), np.float64) * float(v_scale)
  page_table = np.asarray(page_table)
  kv_lens = np.asarray(kv_lens)
  batch, num_q_heads, head_dim = q.shape
  page_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
  group = num_q_heads // num_kv_heads
  if scale is None:
    scale = 1.0 / math.sqrt(head_dim)
  out = np.zeros((batch, num_q_heads, head_dim), np.float64)
  for b in range(batch):
    n = int(kv_lens[b])
    for hq in range(num_q_heads):
      hk = hq // group
      scores, values = [], []
      for t in range(n):
        page = page_table[b, t // page_size]
        slot = t % page_size
        scores.append(scale * float(np.dot(q[b, hq], k_pages[page, slot, hk])))
        values.append(v_pages[page, slot, hk])
      if not scores:
        continue                      # kv_len == 0: zeros
      m = max(scores)
      w = [math.exp(s - m) for s in scores]
      total = sum(w)
      for wi, vi in zip(w, values):
        out[b, hq] += (wi / total) * vi
  return out
