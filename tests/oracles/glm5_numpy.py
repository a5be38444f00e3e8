"""NumPy implementations of GLM-5.3's DSA attention (pooled indexer + NoPE MLA, expanded
form), MoE and MTP block, straight from the equations of reference/models.md §1.4–1.7 and
glm5-checkpoint.md, over HF-named float64 weights. One sequence, positions 0..T-1. Tests only;
imports neither jax nor kk_jax."""

from __future__ import annotations

import numpy as np


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def silu(z):
    return z / (1 + np.exp(-z))


def indexer_mask(c, w, p, x, qr):
    """[T, T] tokens each query attends: top index_topk/kpool complete pools + the open tail."""
    t, kp, ih, d = x.shape[0], c["index_kpool"], c["index_n_heads"], c["index_head_dim"]
    k = x @ w[p + "wk.weight"].T
    k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + 1e-6)
    k = k * w[p + "k_norm.weight"] + w[p + "k_norm.bias"]
    g = x @ w[p + "index_kpool_compress_gate"].T
    ape = w[p + "index_kpool_compress_ape"]
    pooled = []
    for q in range(t // kp):
        logits = g[kp * q:kp * q + kp] + ape
        e = np.exp(logits - logits.max(0))
        pooled.append(((e / e.sum(0)) * k[kp * q:kp * q + kp]).sum(0))
    iq = (qr @ w[p + "wq_b.weight"].T).reshape(t, ih, d)
    hw = (x @ w[p + "weights_proj.weight"].T) / np.sqrt(ih)
    mask = np.zeros((t, t), bool)
    for pos in range(t):
        visible = [q for q in range(len(pooled)) if kp * q + kp - 1 <= pos]
        score = {q: float(np.sum(hw[pos] * np.maximum(iq[pos] @ pooled[q] / np.sqrt(d), 0))) for q in visible}
        for q in sorted(visible, key=lambda q: -score[q])[: c["index_topk"] // kp]:
            mask[pos, kp * q:kp * q + kp] = True
        mask[pos, (pos + 1) - (pos + 1) % kp:pos + 1] = True
    return mask


def dsa(c, w, p, x):
    """NoPE MLA over the indexer's selection, expanded form: k, v = kv_b(c) per head."""
    t, h, nope, vd, eps = x.shape[0], c["num_attention_heads"], c["qk_nope_head_dim"], c["v_head_dim"], c["rms_norm_eps"]
    qr = rms(x @ w[p + "q_a_proj.weight"].T, w[p + "q_a_layernorm.weight"], eps)
    q = (qr @ w[p + "q_b_proj.weight"].T).reshape(t, h, nope)
    lat = rms(x @ w[p + "kv_a_proj_with_mqa.weight"].T, w[p + "kv_a_layernorm.weight"], eps)
    kv = (lat @ w[p + "kv_b_proj.weight"].T).reshape(t, h, nope + vd)
    k, v = kv[..., :nope], kv[..., nope:]
    mask = indexer_mask(c, w, p + "indexer.", x, qr)
    s = np.einsum("thn,shn->hts", q, k) / np.sqrt(nope)
    s = np.where(mask[None], s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a = a / a.sum(-1, keepdims=True)
    o = np.einsum("hts,shv->thv", a, v).reshape(t, h * vd)
    return o @ w[p + "o_proj.weight"].T


def swiglu(w, p, x, limit):
    g = np.minimum(x @ w[p + "gate_proj.weight"].T, limit)
    u = np.clip(x @ w[p + "up_proj.weight"].T, -limit, limit)
    return (silu(g) * u) @ w[p + "down_proj.weight"].T


def moe(c, w, p, x):
    s = 1 / (1 + np.exp(-(x @ w[p + "gate.weight"].T)))
    out = swiglu(w, p + "shared_experts.", x, c["swiglu_limit"])
    for t in range(x.shape[0]):
        top = np.argsort(-(s[t] + w[p + "gate.e_score_correction_bias"]))[: c["num_experts_per_tok"]]
        wt = s[t, top] / (s[t, top].sum() + 1e-20) * c["routed_scaling_factor"]
        for e, we in zip(top, wt):
            out[t] += we * swiglu(w, p + f"experts.{e}.", x[t:t + 1], c["swiglu_limit"])[0]
    return out


def mtp(c, w, emb, h):
    """MTP block output for rows (embedding of token t+1, trunk hidden h_t), each [T, D]."""
    p, eps = f"model.language_model.layers.{c['num_hidden_layers']}.", c["rms_norm_eps"]
    x = np.concatenate([rms(emb, w[p + "enorm.weight"], eps), rms(h, w[p + "hnorm.weight"], eps)], -1)
    x = x @ w[p + "eh_proj.weight"].T
    r = x + dsa(c, w, p + "self_attn.", rms(x, w[p + "input_layernorm.weight"], eps))
    y = r + moe(c, w, p + "mlp.", rms(r, w[p + "post_attention_layernorm.weight"], eps))
    return rms(y, w[p + "shared_head.norm.weight"], eps)
