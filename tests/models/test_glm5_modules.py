"""GLM-5.3 building blocks against NumPy implementations of their equations (models.md §1)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kk_jax.models.layers.mhc import mhc_post, mhc_pre
from kk_jax.models.layers.moe import (dequantize_stacked, grouped_experts, quantized_experts, route, routed_subset,
                                      tile_rows)
from kk_jax.quant import mxfp8, nvfp4


def np_mhc(x, fn, base, scale, hc, iters, eps, rms_eps):
    b, t, _, d = x.shape
    flat = x.reshape(b, t, hc * d).astype(np.float64)
    flat = flat / np.sqrt(np.mean(flat ** 2, -1, keepdims=True) + rms_eps)
    m = flat @ fn.T.astype(np.float64)
    sig = lambda z: 1 / (1 + np.exp(-z))
    pre = sig(m[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * sig(m[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    c = m[..., 2 * hc:].reshape(b, t, hc, hc) * scale[2] + base[2 * hc:].reshape(hc, hc)
    c = np.exp(c - c.max(-1, keepdims=True))
    c = c / c.sum(-1, keepdims=True) + eps
    c = c / (c.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdims=True) + eps)
        c = c / (c.sum(-2, keepdims=True) + eps)
    u = np.einsum("bti,btid->btd", pre, x)
    return post, c, u


def test_mhc_matches_numpy_and_comb_is_doubly_stochastic():
    rng = np.random.default_rng(0)
    hc, d = 4, 8
    x = rng.standard_normal((2, 3, hc, d)).astype(np.float32)
    fn = (rng.standard_normal(((2 + hc) * hc, hc * d)) / np.sqrt(hc * d)).astype(np.float32)
    base = rng.standard_normal(((2 + hc) * hc,)).astype(np.float32)
    scale = np.array([0.7, 1.3, 0.9], np.float32)
    post, comb, u = mhc_pre(jnp.asarray(x), jnp.asarray(fn), jnp.asarray(base), jnp.asarray(scale), hc=hc,
                            iters=20, eps=1e-6, rms_eps=1e-5)
    wp, wc, wu = np_mhc(x, fn, base, scale, hc, 20, 1e-6, 1e-5)
    np.testing.assert_allclose(np.asarray(post), wp, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(comb), wc, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(u), wu, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(comb).sum(-1), 1, atol=1e-3)
    np.testing.assert_allclose(np.asarray(comb).sum(-2), 1, atol=1e-3)
    y = rng.standard_normal((2, 3, d)).astype(np.float32)
    out = mhc_post(jnp.asarray(x), jnp.asarray(y), post, comb)
    want = wp[..., None] * y[:, :, None] + np.einsum("btij,btid->btjd", wc, x)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)


def test_routing_selects_with_bias_and_weights_without():
    rng = np.random.default_rng(1)
    n, d, e, k = 16, 8, 8, 2
    x = rng.standard_normal((n, d)).astype(np.float32)
    w = rng.standard_normal((e, d)).astype(np.float32)
    bias = rng.standard_normal(e).astype(np.float32)
    idx, wt = route(jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias), k, 2.5, True)
    s = 1 / (1 + np.exp(-(x.astype(np.float64) @ w.T)))
    for row in range(n):
        choice = np.argsort(-(s[row] + bias))[:k]
        assert set(np.asarray(idx[row])) == set(choice)          # selection uses the bias
        sel = s[row, np.asarray(idx[row])]
        np.testing.assert_allclose(np.asarray(wt[row]), 2.5 * sel / sel.sum(), rtol=1e-5)   # weights do not


def test_grouped_experts_match_dense_numpy():
    rng = np.random.default_rng(2)
    n, d, i, e, k, limit = 10, 8, 6, 4, 2, 1.5
    x = rng.standard_normal((n, d)).astype(np.float32)
    gate, up = (rng.standard_normal((e, d, i)).astype(np.float32) for _ in range(2))
    down = rng.standard_normal((e, i, d)).astype(np.float32)
    idx = np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)
    wt = rng.random((n, k)).astype(np.float32)
    got = grouped_experts(jnp.asarray(x), jnp.asarray(idx), jnp.asarray(wt), jnp.asarray(gate), jnp.asarray(up),
                          jnp.asarray(down), limit)
    silu = lambda z: z / (1 + np.exp(-z))
    want = np.zeros((n, d))
    for r in range(n):
        for j in range(k):
            ex = idx[r, j]
            h = silu(np.minimum(x[r] @ gate[ex], limit)) * np.clip(x[r] @ up[ex], -limit, limit)
            want[r] += wt[r, j] * (h @ down[ex])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_routed_subset_gives_the_same_experts_output():
    """Decode with quantized experts gathers only the routed experts: same output as all E,
    including when one expert appears in several rows and when E - 1 (the padding id) is used."""
    rng = np.random.default_rng(3)
    n, d, i, e, k, limit = 3, 8, 6, 16, 2, 1.5
    x = rng.standard_normal((n, d)).astype(np.float32)
    gate, up = (rng.standard_normal((e, d, i)).astype(np.float32) for _ in range(2))
    down = rng.standard_normal((e, i, d)).astype(np.float32)
    wt = rng.random((n, k)).astype(np.float32)
    for idx in ([[5, 2], [2, 9], [15, 5]], [[1, 0], [0, 1], [1, 0]]):
        idx = jnp.asarray(idx, jnp.int32)
        local, ids = routed_subset(idx, e)
        assert local.shape == idx.shape and ids.shape == (n * k,)
        np.testing.assert_array_equal(np.asarray(ids)[np.asarray(local)], np.asarray(idx))
        full = grouped_experts(jnp.asarray(x), idx, jnp.asarray(wt), jnp.asarray(gate), jnp.asarray(up),
                               jnp.asarray(down), limit)
        sub = grouped_experts(jnp.asarray(x), local, jnp.asarray(wt), jnp.asarray(gate)[ids], jnp.asarray(up)[ids],
                              jnp.asarray(down)[ids], limit)
        np.testing.assert_allclose(np.asarray(sub), np.asarray(full), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fmt,quantize", [("nvfp4", nvfp4.quantize), ("mxfp8", mxfp8.quantize)])
@pytest.mark.parametrize("width", [128, 512])
def test_quantized_experts_kernel_path_matches_the_dequantized_grouped_dot(fmt, quantize, width, monkeypatch):
    """The GPU path for quantized experts (here in Mosaic GPU's interpreter) equals dequantizing
    the same experts and running the grouped dot, for a decode batch and with two layers' experts
    stacked (the scanned form, offset to the second layer). Width 128 is below the row GEMV's
    smallest K, so the slots go to the grouped tile engine; at 512 each runs a routed GEMV."""
    from pallas_kernels import moe_quant
    calls = []
    real = moe_quant.routed_gemv
    monkeypatch.setattr(moe_quant, "routed_gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    rng = np.random.default_rng(4)
    (n, k), d, i, e, limit, layers = (5, 3) if width == 128 else (2, 2), width, width, 6, 4.0, 2
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
    idx = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(n)]), jnp.int32)
    wt = jnp.asarray(rng.random((n, k)), jnp.float32)

    def stacked(n_out, n_in):          # [layers·E, ...] operands of per-expert HF [N, K] weights (Experts layout)
        ops = [quantize(rng.standard_normal((n_out, n_in)) * 0.3) for _ in range(layers * e)]
        ops = [jnp.stack([jnp.asarray(o[j]) for o in ops]) for j in range(len(ops[0]))]
        return (ops[0], jnp.swapaxes(ops[1], 1, 2), *ops[2:])                 # block scales [E, K/b, N]

    projs = (stacked(i, d), stacked(i, d), stacked(d, i))
    got = quantized_experts(x, idx, wt, (fmt,) * 3, projs, limit, e, expert_offset=jnp.int32(e), interpret=True)
    layer1 = [tuple(o[e:] for o in ops) for ops in projs]
    dense = [dequantize_stacked(fmt, ops, dtype=jnp.bfloat16).astype(jnp.float32) for ops in layer1]
    want = grouped_experts(x.astype(jnp.float32), idx, wt, *dense, limit)
    # the kernel path feeds the down projection bf16 activations (measured 3.8e-3; another layer's experts: 1.5)
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-2
    assert len(calls) == (3 if width == 512 else 0)
    assert tile_rows(n * k, e) == 8 and tile_rows(8192 * 8, 288) == 128 and tile_rows(64 * 8, 288) == 8


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_block"])
def test_moe_layer_takes_the_kernel_path_like_the_dequantized_path(monkeypatch, fmt):
    """MoE.__call__ with backend="pallas" (the grouped kernel, replaced here by its jnp twin: the
    Mosaic GPU interpreter is not safe on several CPU devices at once) against backend="xla"
    (dequantize + grouped dot), for a scanned group of two layers' stacked experts at both stack
    positions, under tensor parallelism: exercises the per-operand shard specs (codes [.., N, K'],
    transposed block scales, block FP8 tile scales), the [L·E] flattening and the layer offset."""
    import pallas_kernels.moe_quant as mq
    from kk_jax.models.layers.moe import MoE
    from kk_jax.parallel.mesh import make_mesh
    from kk_jax.quant import fp8_block

    twin = mq.grouped_matmul
    used = []
    monkeypatch.setattr(mq, "grouped_matmul", lambda *a, **k: used.append(1) or twin(*a, **{**k, "backend": "xla"}))
    hidden, width, e, layers = 128, 256, 6, 2
    moe = MoE(hidden, width, e, 1, 3, 2.5, True, 7.0, jnp.float32)
    rng = np.random.default_rng(5)
    quantize = {"nvfp4": nvfp4.quantize, "fp8_block": fp8_block.quantize}[fmt]
    for proj, (n, k) in zip(("gate_proj", "up_proj", "down_proj"), ((width, hidden),) * 2 + ((hidden, width),)):
        moe.experts.quantize_(proj, fmt)
        per = [quantize(rng.standard_normal((n, k)) * 0.1) for _ in range(layers * e)]
        for j, sfx in enumerate(moe.experts.suffixes(proj)):
            a = jnp.stack([jnp.asarray(q[j]) for q in per])
            if sfx == "weight_scale":
                a = jnp.swapaxes(a, 1, 2)                                 # held transposed
            var = getattr(moe.experts, proj if sfx == "weight" else f"{proj}_{sfx}")
            var.value = a.reshape(layers, e, *a.shape[1:])                # [L, E, ...] as in a scanned group
    moe.gate.weight.value = jnp.asarray(rng.standard_normal((e, hidden)), jnp.float32)
    mesh = make_mesh(2)
    x = jnp.asarray(rng.standard_normal((1, 5, hidden)), jnp.bfloat16)
    run = {b: jax.jit(lambda x, layer, b=b: moe(x, mesh, b, stack_index=layer)) for b in ("pallas", "xla")}
    out = {(b, layer): run[b](x, jnp.int32(layer)).astype(jnp.float32) for b in run for layer in range(layers)}
    rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
    for layer in range(layers):
        assert rel(out["pallas", layer], out["xla", layer]) < 2e-2, layer
    assert used                                       # the kernel path ran (kernel_takes held for every shard)
    assert rel(out["pallas", 1], out["xla", 0]) > 0.1                    # the layers' experts differ


def test_kernel_path_needs_whole_kernel_tiles():
    """Shapes the grouped kernel cannot tile fall back to the dequantizing path instead of failing."""
    from kk_jax.models.layers.moe import kernel_takes

    def nv(n, k):                      # nvfp4 operands of 2 experts: codes, transposed scales, global scales
        return (jnp.zeros((2, n, k // 2), jnp.uint8), jnp.zeros((2, k // 16, n), jnp.float8_e4m3fn), jnp.ones((2,)))

    assert kernel_takes(("nvfp4",) * 3, (128, 128), (nv(128, 128), nv(128, 128), nv(128, 128)))
    assert not kernel_takes(("nvfp4",) * 3, (128, 128), (nv(64, 128), nv(64, 128), nv(128, 64)))  # K % 128
    assert not kernel_takes(("nvfp4",) * 3, (128, 128), (nv(32, 128), nv(32, 128), nv(128, 32)))  # N % 64
    assert not kernel_takes(("nvfp4", "nvfp4", None), (128, 128), (nv(128, 128), nv(128, 128), nv(128, 128)))

    def mx(n, k):                      # mxfp8 operands of 2 experts: codes, transposed E8M0 scales
        return (jnp.zeros((2, n, k), jnp.float8_e4m3fn), jnp.zeros((2, k // 32, n), jnp.uint8))

    assert kernel_takes(("mxfp8",) * 3, (128, 128), (mx(64, 128), mx(64, 128), mx(128, 64)))
    assert not kernel_takes(("mxfp8",) * 3, (128, 128), (mx(64, 96), mx(64, 96), mx(128, 64)))    # K % 64


@pytest.fixture(scope="module")
def indexer():

    from kk_jax.config import Glm5NextConfig
    from kk_jax.models.attention.pooled_indexer import PooledIndexer

    cfg = Glm5NextConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, layer_types=("deepseek_sparse_attention",),
                         mlp_layer_types=("dense",), intermediate_size=16, moe_intermediate_size=8, n_routed_experts=2,
                         num_experts_per_tok=1, n_shared_experts=1, routed_scaling_factor=1.0, norm_topk_prob=True,
                         swiglu_limit=10.0, num_attention_heads=2, q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=8,
                         v_head_dim=8, index_n_heads=3, index_head_dim=8, index_topk=8, index_kpool=4,
                         index_kpool_always_select_tail=True, linear_num_heads=2, linear_head_dim=8,
                         linear_conv_kernel_dim=4, linear_lower_bound=-5.0, hc_mult=4, hc_eps=1e-6,
                         hc_sinkhorn_iters=20, rms_norm_eps=1e-5, max_position_embeddings=1024)
    ix = PooledIndexer(cfg, jnp.float32)
    rng = np.random.default_rng(3)
    for name in ("wq_b", "wk", "weights_proj"):
        lin = getattr(ix, name)
        lin.weight[...] = jnp.asarray(rng.standard_normal(lin.weight.shape), jnp.float32)
    ix.index_kpool_compress_ape[...] = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
    ix.index_kpool_compress_gate[...] = jnp.asarray(rng.standard_normal((8, 16)), jnp.float32)
    return ix


def _run_indexer(ix, x, qr, t, page_size=16, pages=4):
    index_pool = jnp.zeros((pages + 1, page_size // 4, 8), jnp.float32)
    tail_pool = jnp.zeros((2, 2, 4, 8), jnp.float32)
    table = jnp.arange(1, pages + 1, dtype=jnp.int32)[None]
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    index, _ = ix.update_pools(x, (index_pool, None), tail_pool, jnp.array([1]), pos, jnp.ones((1, t), bool), table)
    keys, rotated = ix.pooled_keys(index, table)
    tokens, ok = (np.asarray(a)[0] for a in ix.selected_tokens(x, qr, keys, rotated, pos))
    span = pages * page_size
    assert tokens[ok].max() < span
    for row in range(t):                                          # a token is selected at most once
        assert len(set(tokens[row][ok[row]])) == ok[row].sum()
    mask = np.zeros((t, span), bool)
    mask[np.nonzero(ok)[0], tokens[ok]] = True
    return mask, index, table


def test_indexer_selection_matches_numpy(indexer):
    rng = np.random.default_rng(4)
    t = 30
    x = jnp.asarray(rng.standard_normal((1, t, 16)), jnp.float32)
    qr = jnp.asarray(rng.standard_normal((1, t, 12)), jnp.float32)
    from oracles.glm5_numpy import indexer_mask

    got, _, _ = _run_indexer(indexer, x, qr, t)
    w = {"wk.weight": indexer.wk.weight[...], "wq_b.weight": indexer.wq_b.weight[...],
         "weights_proj.weight": indexer.weights_proj.weight[...], "k_norm.weight": indexer.k_norm.weight[...],
         "k_norm.bias": indexer.k_norm.bias[...], "index_kpool_compress_ape": indexer.index_kpool_compress_ape[...],
         "index_kpool_compress_gate": indexer.index_kpool_compress_gate[...]}
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    c = {"index_kpool": 4, "index_n_heads": 3, "index_head_dim": 8, "index_topk": 8}
    want = indexer_mask(c, w, "", np.asarray(x[0], np.float64), np.asarray(qr[0], np.float64))
    np.testing.assert_array_equal(got[:, :t], want)
    assert not got[:, t:].any()
    assert (got.sum(-1) < np.arange(1, t + 1)).any()            # selection is really sparse somewhere


def test_indexer_is_dense_when_topk_covers_the_context(indexer):
    rng = np.random.default_rng(5)
    t = 30
    x = jnp.asarray(rng.standard_normal((1, t, 16)), jnp.float32)
    qr = jnp.asarray(rng.standard_normal((1, t, 12)), jnp.float32)
    indexer.select_pools = 64                                    # index_topk >= context
    try:
        got, _, _ = _run_indexer(indexer, x, qr, t)
    finally:
        indexer.select_pools = 2
    np.testing.assert_array_equal(got[:, :t], np.tril(np.ones((t, t), bool)))
    assert not got[:, t:].any()


def test_fp8_index_keys_hadamard_and_power_of_two_scales():
    from kk_jax.models.attention.pooled_indexer import hadamard, quantize_keys

    h = hadamard(128)
    np.testing.assert_allclose(h @ h.T, np.eye(128), atol=1e-12)
    rng = np.random.default_rng(6)
    pooled = rng.standard_normal((5, 128)).astype(np.float32) * np.array([1e-6, 0.1, 1, 10, 1000])[:, None]
    values, scale = quantize_keys(jnp.asarray(pooled))
    assert values.dtype == jnp.float8_e4m3fn and scale.shape == (5,)
    log2 = np.log2(np.asarray(scale))
    np.testing.assert_array_equal(log2, np.round(log2))                    # powers of two
    back = (np.asarray(values, np.float32) * np.asarray(scale)[:, None]) @ h.T      # un-rotate
    for row in range(1, 5):                                                  # e4m3: 3 mantissa bits
        assert np.max(np.abs(back[row] - pooled[row])) <= 0.07 * np.max(np.abs(pooled[row])) + 1e-6


def flash_config(**changes):
    """GLM-5.3-Flash's shapes at 4 layers (3 KDA + 1 DSA)."""
    import dataclasses

    from kk_jax.config import Glm5NextConfig

    flash = Glm5NextConfig(vocab_size=154880, hidden_size=4096, num_hidden_layers=4,
                           layer_types=("linear_attention",) * 3 + ("deepseek_sparse_attention",),
                           mlp_layer_types=("dense",) * 4, intermediate_size=12288, moe_intermediate_size=2048,
                           n_routed_experts=288, num_experts_per_tok=8, n_shared_experts=1, routed_scaling_factor=2.5,
                           norm_topk_prob=True, swiglu_limit=10.0, num_attention_heads=64, q_lora_rank=1536,
                           kv_lora_rank=512, qk_nope_head_dim=256, v_head_dim=256, index_n_heads=32,
                           index_head_dim=128, index_topk=2048, index_kpool=4, index_kpool_always_select_tail=True,
                           linear_num_heads=64, linear_head_dim=128, linear_conv_kernel_dim=4, linear_lower_bound=-5.0,
                           hc_mult=4, hc_eps=1e-6, hc_sinkhorn_iters=20, rms_norm_eps=1e-5,
                           max_position_embeddings=1 << 20)
    return dataclasses.replace(flash, **changes)


def test_fp8_index_cache_is_33_bytes_per_token_at_flash_shapes():
    from kk_jax.cache.pools import PagedSpec, bytes_per_page
    from kk_jax.models.glm5_next import Glm5NextForConditionalGeneration

    flash = flash_config()
    layout = Glm5NextForConditionalGeneration.cache_layout(flash, jnp.float8_e4m3fn)
    index = {n: s for n, s in layout.items() if "index_k" in n}
    assert set(index) == {"layers.3.index_k", "layers.3.index_k_scale"}
    assert all(isinstance(s, PagedSpec) for s in index.values())
    assert bytes_per_page(index, 256) == 33 * 256
    assert bytes_per_page({"l": layout["layers.3.latent"]}, 256) == 512 * 256      # fp8 latent: 1 byte/value


def test_mtp_block_matches_numpy(tmp_path):
    """Draft logits of the MTP block (layer N) from the trunk's hidden states vs its NumPy twin."""
    import math

    from oracles import glm5_numpy, qwen3_numpy

    from checkpoints.make_tiny import make_tiny
    from kk_jax import LLM
    from kk_jax.models.attention.paged import AttentionBatch

    ckpt = make_tiny(tmp_path, arch="glm5_next", seed=7, num_layers=4, first_dense_layers=1, dtype="float32")
    llm = LLM(ckpt, dtype="float32", max_model_len=64, max_num_seqs=1, max_num_batched_tokens=16,
              load_mtp=True, progress=False)
    r = llm.engine.runner
    ids = [int(x) for x in np.random.default_rng(8).integers(0, 1000, 21)]
    t = len(ids) - 1
    table = np.zeros((1, r.max_pages_per_seq), np.int32)
    table[0, : math.ceil(t / 16)] = np.arange(1, math.ceil(t / 16) + 1)
    batch = AttentionBatch(jnp.arange(t, dtype=jnp.int32)[None], jnp.ones((1, t), bool), jnp.asarray(table),
                           jnp.array([t], jnp.int32), jnp.ones((1,), jnp.int32))

    @jax.jit
    def draft(weights, pools):
        model = r._model(weights)
        h, pools = model(jnp.asarray([ids[:-1]]), batch, pools, r.ops)
        out, _ = model.mtp_hidden(jnp.asarray([ids[1:]]), h, batch, pools, r.ops)
        return h, out, model.logits(out)

    h, out, logits = draft(r.weights, jax.tree.map(jnp.zeros_like, r.pools))
    cfg, w = qwen3_numpy.load(ckpt)
    c = cfg["text_config"]
    w = {k: v.astype(np.float64) for k, v in w.items()}
    want = glm5_numpy.mtp(c, w, w["model.language_model.embed_tokens.weight"][ids[1:]], np.asarray(h[0], np.float64))
    np.testing.assert_allclose(np.asarray(out[0]), want, rtol=1e-4, atol=1e-4)
    want_logits = want @ w["lm_head.weight"].T
    rel = np.max(np.abs(np.asarray(logits[0]) - want_logits)) / np.max(np.abs(want_logits))
    assert rel < 1e-4, rel


def test_kda_backend_auto_falls_back_for_head_sizes_the_kernels_do_not_take():
    """On a GPU (backend pallas) a tiny model's 16-wide KDA heads run the jnp recurrence under
    auto, and an explicit pallas is refused; 128-wide heads (GLM-5.3-Flash) keep the kernels."""
    from kk_jax.config import ConfigError
    from kk_jax.models.glm5_next import Glm5NextForConditionalGeneration as M

    tiny, flash = flash_config(linear_head_dim=16), flash_config()
    assert M.make_ops(tiny, None, "pallas", "auto").kda_backend == "xla"
    assert M.make_ops(tiny, None, "xla", "auto").kda_backend == "xla"
    with pytest.raises(ConfigError, match="need a head dim of 64 or 128, this model's linear_head_dim is 16"):
        M.make_ops(tiny, None, "pallas", "pallas")
    assert M.make_ops(flash, None, "pallas", "auto").kda_backend == "pallas"
    assert M.make_ops(flash, None, "pallas", "xla").kda_backend == "xla"
