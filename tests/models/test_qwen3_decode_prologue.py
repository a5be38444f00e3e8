"""Qwen3 decode through the fused prologue (q/k norm, RoPE and page writes in one kernel, then
the attention kernel on the prepared queries), Mosaic GPU interpret mode, against the jnp path
of the same layer."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kk_jax.config import Qwen3Config
from kk_jax.models.attention.paged import AttentionBatch, PagedAttention
from kk_jax.models.layers.linear import fuse_projections
from kk_jax.models.qwen3 import Qwen3Attention
from kk_jax.parallel.mesh import make_mesh


def test_fused_prologue_decode_matches_the_jnp_path():
    cfg = Qwen3Config(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128, attention_bias=False,
                      rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=256, tie_word_embeddings=True)
    attn_mod = Qwen3Attention(cfg, jnp.bfloat16)
    fuse_projections(attn_mod)
    rng = np.random.default_rng(0)
    for _, p in nnx.iter_graph(attn_mod):
        if isinstance(p, nnx.Param):
            p.value = jnp.asarray(rng.standard_normal(p.value.shape) / 8 + (p.value.ndim == 1), jnp.bfloat16)
    pages, ps = 5, 16
    kp, vp = (jnp.asarray(rng.standard_normal((pages, ps, 2, 128)), jnp.bfloat16) for _ in range(2))
    batch = AttentionBatch(positions=jnp.asarray([[19], [3], [0]], jnp.int32),
                           valid=jnp.asarray([[True], [True], [False]]),
                           page_table=jnp.asarray([[2, 4], [1, 0], [0, 0]], jnp.int32),
                           kv_lens=jnp.asarray([20, 4, 0], jnp.int32), slots=jnp.zeros(3, jnp.int32))
    x = jnp.asarray(rng.standard_normal((3, 1, 256)), jnp.bfloat16)
    mesh = make_mesh(1)
    outs = {}
    for backend in ("xla", "pallas"):
        op = PagedAttention(mesh=mesh, backend=backend, scale=128 ** -0.5, interpret=True)
        assert op.takes_qkv(128, 4, 2, jnp.bfloat16, 1) == (backend == "pallas")
        outs[backend] = attn_mod(x, (kp, vp), batch, op)
    (o_x, (k_x, v_x)), (o_p, (k_p, v_p)) = outs["xla"], outs["pallas"]
    np.testing.assert_allclose(np.asarray(o_p[:2], np.float32), np.asarray(o_x[:2], np.float32), atol=3e-2, rtol=3e-2)
    np.testing.assert_array_equal(np.asarray(v_p[1:], np.float32), np.asarray(v_x[1:], np.float32))
    np.testing.assert_allclose(np.asarray(k_p[1:], np.float32), np.asarray(k_x[1:], np.float32), atol=2e-2, rtol=1e-2)


def test_fused_prologue_decode_runs_per_shard(monkeypatch):
    """tp = 2: each shard's prologue sees its own q, k, v heads of the fused projection and its
    kv heads' pages. The kernels are replaced by their jnp twins here (the Mosaic GPU
    interpreter is not safe on two CPU devices at once)."""
    import kk_jax.models.attention.paged as paged_mod
    from pallas_kernels.paged_attention import paged_decode_attention_reference, prologue

    seen = []

    def prologue_twin(qkv, *args, interpret, **kw):
        seen.append((qkv.shape, args[-2].shape))
        return prologue.decode_prologue_reference(qkv, *args, **kw)

    def attend_twin(qs, kp, vp, page_table, kv_lens, *, group, interpret, out_dtype):
        b, hkv, _, d = qs.shape
        q = qs[:, :, :group].reshape(b, hkv * group, d).astype(jnp.float32)
        return paged_decode_attention_reference(q, kp, vp, page_table, kv_lens, scale=1.0).astype(out_dtype)

    monkeypatch.setattr(paged_mod.prologue, "decode_prologue", prologue_twin)
    monkeypatch.setattr(paged_mod, "attend_prepared", attend_twin)
    cfg = Qwen3Config(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128, attention_bias=False,
                      rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=256, tie_word_embeddings=True)
    mesh = make_mesh(2)
    attn_mod = Qwen3Attention(cfg, jnp.bfloat16)
    fuse_projections(attn_mod, mesh=mesh)
    attn_mod.qkv_proj.quantize_(None, mesh=mesh)                  # the per-shard q|k|v layout
    rng = np.random.default_rng(1)
    for _, p in nnx.iter_graph(attn_mod):
        if isinstance(p, nnx.Param):
            p.value = jnp.asarray(rng.standard_normal(p.value.shape) / 8 + (p.value.ndim == 1), jnp.bfloat16)
    kp, vp = (jnp.asarray(rng.standard_normal((4, 16, 2, 128)), jnp.bfloat16) for _ in range(2))
    batch = AttentionBatch(positions=jnp.asarray([[7], [2]], jnp.int32), valid=jnp.asarray([[True], [True]]),
                           page_table=jnp.asarray([[3], [1]], jnp.int32), kv_lens=jnp.asarray([8, 3], jnp.int32),
                           slots=jnp.zeros(2, jnp.int32))
    x = jnp.asarray(rng.standard_normal((2, 1, 256)), jnp.bfloat16)
    o_p, (k_p, v_p) = attn_mod(x, (kp, vp), batch, PagedAttention(mesh=mesh, backend="pallas", scale=128 ** -0.5))
    assert seen and seen[0] == ((2, 4 * 128), (4, 16, 1, 128))      # (2 + 1 + 1) heads, one kv head per shard
    o_x, (k_x, v_x) = attn_mod(x, (kp, vp), batch, PagedAttention(mesh=mesh, backend="xla", scale=128 ** -0.5))
    np.testing.assert_allclose(np.asarray(o_p, np.float32), np.asarray(o_x, np.float32), atol=3e-2, rtol=3e-2)
    np.testing.assert_array_equal(np.asarray(v_p, np.float32), np.asarray(v_x, np.float32))
    np.testing.assert_allclose(np.asarray(k_p, np.float32), np.asarray(k_x, np.float32), atol=2e-2, rtol=1e-2)
