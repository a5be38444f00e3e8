"""Tests for pallas_kernels.paged_attention.

reference <-> NumPy oracle in fp32; Pallas kernel (Mosaic GPU interpret mode on
CPU, small shapes) <-> reference; bf16 / fp8 / f32 pools; kv_len 0 rows; garbage
(NaN) in pool slots past kv_len; argument errors. A `gpu`-marked test runs the
compiled kernel when a GPU is present.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import (
    paged_decode_attention, paged_decode_attention_kernel)
from paged_attention_oracle import paged_attention_oracle


def make_inputs(*, batch, num_q_heads, num_kv_heads, head_dim, page_size,
                max_pages, kv_lens, pool_dtype=jnp.bfloat16, q_dtype=jnp.bfloat16,
                extra_pages=3, seed=0, poison=False):
  """Random q / pools and a shuffled, non-contiguous page table.

  Every sequence gets distinct pages drawn from a permutation of 1..P-1 (page 0
  is the dummy page); unused table entries stay 0. With poison=True, page 0 and
  every slot past kv_len hold NaN (bf16/f32 pools) or the e4m3 NaN code.
  """
  rng = np.random.default_rng(seed)
  kv_lens = np.asarray(kv_lens, np.int32)
  need = [-(-int(n) // page_size) for n in kv_lens]
  num_pages = 1 + sum(need) + extra_pages
  q = rng.standard_normal((batch, num_q_heads, head_dim)).astype(np.float32)
  k = rng.standard_normal((num_pages, page_size, num_kv_heads, head_dim)).astype(np.float32)
  v = rng.standard_normal((num_pages, page_size, num_kv_heads, head_dim)).astype(np.float32)
  perm = rng.permutation(np.arange(1, num_pages))
  table = np.zeros((batch, max_pages), np.int32)
  used = np.zeros((num_pages, page_size), bool)
  pos = 0
  for b in range(batch):
    table[b, :need[b]] = perm[pos:pos + need[b]]
    pos += need[b]
    for t in range(int(kv_lens[b])):
      used[table[b, t // page_size], t % page_size] = True
  if poison:
    k[~used] = np.nan
    v[~used] = np.nan
  return (jnp.asarray(q, q_dtype), jnp.asarray(k, pool_dtype), jnp.asarray(v, pool_dtype),
          jnp.asarray(table), jnp.asarray(kv_lens))


def rel_err(a, b):
  a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ---------------------------------------------------------------- reference vs oracle

REF_CASES = [
    # (Hq, Hkv, D, page_size, max_pages, kv_lens, pool dtype)
    (4, 4, 16, 16, 5, [0, 1, 16, 37, 80], jnp.float32),       # G=1, exact pages, partial
    (8, 4, 32, 8, 7, [56, 3, 0], jnp.float32),                  # G=2
    (8, 2, 16, 4, 9, [33, 36, 1, 12], jnp.float32),              # G=4
    (4, 1, 8, 16, 4, [64, 17], jnp.bfloat16),                   # MQA, bf16 pool
    (4, 2, 16, 8, 6, [41, 8, 0], jnp.float8_e4m3fn),            # fp8 pool + scales
]


@pytest.mark.parametrize("hq,hkv,d,ps,maxp,lens,dtype", REF_CASES)
def test_reference_matches_oracle(hq, hkv, d, ps, maxp, lens, dtype):
  args = make_inputs(batch=len(lens), num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                     page_size=ps, max_pages=maxp, kv_lens=lens, pool_dtype=dtype,
                     q_dtype=jnp.float32, seed=len(lens) + d)
  kw = dict(k_scale=0.5, v_scale=1.5) if dtype == jnp.float8_e4m3fn else {}
  out = paged_decode_attention(*args, backend="xla", **kw)
  assert out.dtype == jnp.float32 and out.shape == (len(lens), hq, d)
  want = paged_attention_oracle(*args, **kw)
  np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-6)


def test_reference_custom_scale_and_poisoned_slots():
  args = make_inputs(batch=3, num_q_heads=6, num_kv_heads=2, head_dim=16, page_size=8,
                     max_pages=5, kv_lens=[19, 0, 40], q_dtype=jnp.float32,
                     pool_dtype=jnp.float32, poison=True)
  out = paged_decode_attention(*args, scale=0.3, backend="xla")
  assert np.isfinite(np.asarray(out)).all()
  clean = [jnp.nan_to_num(a) if a.dtype == jnp.float32 else a for a in args]
  want = paged_attention_oracle(*clean, scale=0.3)
  np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-6)
  assert np.all(np.asarray(out)[1] == 0.0)


# ---------------------------------------------------------------- kernel (interpret) vs reference

KERNEL_CASES = [
    # id, shapes, pool dtype, q dtype, kernel kwargs, scales
    ("bf16-ps16-g4-split2-poison",
     dict(num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16, max_pages=9,
          kv_lens=[0, 1, 64, 130]), jnp.bfloat16, jnp.bfloat16, dict(num_splits=2), {}),
    ("bf16-ps64-g1-split3",
     dict(num_q_heads=2, num_kv_heads=2, head_dim=128, page_size=64, max_pages=5,
          kv_lens=[300, 64]), jnp.bfloat16, jnp.bfloat16, dict(num_splits=3), {}),
    ("fp8-ps32-g8-scales",
     dict(num_q_heads=16, num_kv_heads=2, head_dim=64, page_size=32, max_pages=6,
          kv_lens=[150, 33]), jnp.float8_e4m3fn, jnp.bfloat16, {},
     dict(k_scale=0.5, v_scale=2.0)),
    ("bf16-ps64-block128-large-plan",
     dict(num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=64, max_pages=5,
          kv_lens=[200, 0, 256, 1]), jnp.bfloat16, jnp.bfloat16,
     dict(block_tokens=128, num_stages=2, num_splits=1), {}),
    ("bf16-ps256-subpage-block128",
     dict(num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=256, max_pages=2,
          kv_lens=[300, 100]), jnp.bfloat16, jnp.bfloat16, dict(block_tokens=128), {}),
    ("f32-ps128-g4-fq32",
     dict(num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=128, max_pages=3,
          kv_lens=[257, 0]), jnp.float32, jnp.float32, {}, {}),
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_kernel_interpret_matches_reference(case):
  name, shapes, pool_dtype, q_dtype, kernel_kw, scales = case
  lens = shapes["kv_lens"]
  args = make_inputs(batch=len(lens), pool_dtype=pool_dtype, q_dtype=q_dtype,
                     poison="poison" in name, seed=7, **shapes)
  kernel_args = args
  if "poison" in name:
    # table entries past each sequence's pages name pages outside the pool: the kernel may read
    # them (clamped) for a split's first block but must never let them reach the output
    q, k, v, table, kv = args
    used = (jnp.arange(table.shape[1])[None, :] * shapes["page_size"]) < kv[:, None]
    junk = jnp.where(jnp.arange(table.shape[1]) % 2 == 0, -7, k.shape[0] + 1000)
    kernel_args = (q, k, v, jnp.where(used, table, junk[None, :]).astype(jnp.int32), kv)
  out = paged_decode_attention_kernel(*kernel_args, interpret=True, **kernel_kw, **scales)
  ref = paged_decode_attention(*args, backend="xla", **scales)
  assert out.shape == ref.shape and out.dtype == q_dtype
  out_np = np.asarray(jnp.asarray(out, jnp.float32))
  assert np.isfinite(out_np).all()
  assert rel_err(out, ref) < 1e-2, rel_err(out, ref)
  np.testing.assert_allclose(out_np, np.asarray(jnp.asarray(ref, jnp.float32)),
                             atol=3e-2, rtol=3e-2)
  for b, n in enumerate(lens):
    if n == 0:
      assert np.all(out_np[b] == 0.0)


def test_public_pallas_backend_interpret():
  args = make_inputs(batch=2, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=64,
                     max_pages=2, kv_lens=[70, 5])
  out = paged_decode_attention(*args, backend="pallas", interpret=True)
  ref = paged_decode_attention(*args, backend="xla")
  assert rel_err(out, ref) < 1e-2


# ---------------------------------------------------------------- argument errors

def test_errors():
  args = make_inputs(batch=1, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=12,
                     max_pages=2, kv_lens=[5])
  with pytest.raises(ValueError, match="page_size"):
    paged_decode_attention(*args, backend="pallas", interpret=True)
  with pytest.raises(ValueError, match="backend"):
    paged_decode_attention(*args, backend="cuda")
  q, k, v, pt, lens = make_inputs(batch=1, num_q_heads=3, num_kv_heads=2, head_dim=64,
                                  page_size=16, max_pages=2, kv_lens=[5])
  with pytest.raises(ValueError, match="multiple"):
    paged_decode_attention(q, k, v, pt, lens, backend="xla")
  q, k, v, pt, lens = make_inputs(batch=1, num_q_heads=2, num_kv_heads=2, head_dim=32,
                                  page_size=16, max_pages=2, kv_lens=[5])
  with pytest.raises(ValueError, match="head_dim"):
    paged_decode_attention(q, k, v, pt, lens, backend="pallas", interpret=True)


# ---------------------------------------------------------------- compiled kernel on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("pool_dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32])
@pytest.mark.parametrize("page_size,lens", [(64, [0, 1, 64, 1000, 4096, 77]),
                                            (16, [5, 300, 0, 16]),
                                            (64, [1000]), (64, [3, 2000])])   # 8 splits: a full cluster
def test_kernel_compiled_matches_reference(pool_dtype, page_size, lens):
  maxp = max(-(-n // page_size) for n in lens) + 2
  args = make_inputs(batch=len(lens), num_q_heads=32, num_kv_heads=8, head_dim=128,
                     page_size=page_size, max_pages=maxp, kv_lens=lens,
                     pool_dtype=pool_dtype, poison=True, seed=3)
  scales = dict(k_scale=0.7, v_scale=1.3) if pool_dtype == jnp.float8_e4m3fn else {}
  out = jax.jit(lambda *a: paged_decode_attention(*a, **scales))(*args)
  ref = paged_decode_attention(*args, backend="xla", **scales)
  out_np = np.asarray(jnp.asarray(out, jnp.float32))
  assert np.isfinite(out_np).all()
  assert rel_err(out, ref) < 1e-2, rel_err(out, ref)
  for b, n in enumerate(lens):
    if n == 0:
      assert np.all(out_np[b] == 0.0)


@pytest.mark.gpu
def test_kernel_compiled_large_batch_plan():
  """batch * Hkv >= #SMs: 128-token blocks, one CTA per SM, no split."""
  rng = np.random.default_rng(5)
  lens = [int(x) for x in rng.integers(0, 700, 40)]
  lens[:3] = [0, 1, 128]
  args = make_inputs(batch=40, num_q_heads=32, num_kv_heads=8, head_dim=128,
                     page_size=64, max_pages=12, kv_lens=lens, poison=True, seed=4)
  out = jax.jit(paged_decode_attention)(*args)
  ref = paged_decode_attention(*args, backend="xla")
  out_np = np.asarray(jnp.asarray(out, jnp.float32))
  assert np.isfinite(out_np).all() and np.all(out_np[0] == 0.0)
  assert rel_err(out, ref) < 1e-2, rel_err(out, ref)
