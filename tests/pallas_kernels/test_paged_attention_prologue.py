"""pallas_kernels.paged_attention.prologue: the decode prologue (q/k RMSNorm, RoPE, q scaling
and padding, K/V page writes) in Mosaic GPU interpret mode against its jnp twin, and feeding
the attention kernel's prepared-query entry."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import paged_decode_attention_reference
from pallas_kernels.paged_attention import prologue as pr
from pallas_kernels.paged_attention.kernel import attend_prepared


def make(b=3, hq=8, hkv=2, d=128, pages=6, page_size=16, seed=0):
    rng = np.random.default_rng(seed)
    qkv = jnp.asarray(rng.standard_normal((b, (hq + 2 * hkv) * d)) * 2, jnp.bfloat16)
    qw, kw = (jnp.asarray(1 + rng.standard_normal(d) / 10, jnp.bfloat16) for _ in range(2))
    pos = jnp.asarray(rng.integers(0, 40, b), jnp.int32)
    ang = pos[:, None].astype(jnp.float32) * 1e6 ** (-jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    kp, vp = (jnp.asarray(rng.standard_normal((pages, page_size, hkv, d)), jnp.bfloat16) for _ in range(2))
    page = jnp.asarray(rng.permutation(np.arange(1, pages))[:b], jnp.int32).at[-1].set(0)   # last row: padding
    slot = pos % page_size
    return (qkv, qw, kw, jnp.cos(ang), jnp.sin(ang), page, slot, kp, vp), dict(
        num_q_heads=hq, num_kv_heads=hkv, eps=1e-6, scale=d ** -0.5, group_p=16)


def test_prologue_matches_its_twin():
    args, kw = make()
    got = pr.decode_prologue(*args, interpret=True, **kw)
    want = pr.decode_prologue_reference(*args, **kw)
    for a, b in zip(got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert a.shape == b.shape
        assert np.max(np.abs(a - b)) <= 2.0 ** -8 * np.max(np.abs(b))     # one bf16 rounding at most
    qs = np.asarray(got[0], np.float32)
    assert not qs[:, :, 4:].any()                                          # padded group rows are zero


def test_prologue_then_prepared_attention_is_decode_attention():
    args, kw = make(b=2, seed=1)
    qs, kp, vp = pr.decode_prologue(*args, interpret=True, **kw)
    page_table = jnp.stack([jnp.asarray([args[5][i], 0], jnp.int32) for i in range(2)])
    kv_lens = args[6] + 1                                                  # the token just written is the last
    o = attend_prepared(qs, kp, vp, page_table, kv_lens, group=4, interpret=True)
    q = pr.decode_prologue_reference(*args, **{**kw, "scale": 1.0})[0][:, :, :4].reshape(2, 8, 128)
    want = paged_decode_attention_reference(q, kp, vp, page_table, kv_lens)
    assert float(jnp.max(jnp.abs(o - want))) < 2e-2 * float(jnp.max(jnp.abs(want)))


def test_unsupported_shapes_are_rejected():
    args, kw = make(d=64)
    with pytest.raises(ValueError, match="decode prologue takes D = 128"):
        pr.decode_prologue(*args, interpret=True, **kw)


@pytest.mark.gpu
def test_compiled_prologue_matches_its_twin():
    args, kw = make(b=4, hq=32, hkv=8, pages=40, page_size=64, seed=2)
    got = jax.jit(lambda *a: pr.decode_prologue(*a, **kw))(*args)
    want = pr.decode_prologue_reference(*args, **kw)
    for a, b in zip(got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.max(np.abs(a - b)) <= 2.0 ** -8 * np.max(np.abs(b))
