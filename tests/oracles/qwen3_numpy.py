"""Independent NumPy oracle for the Qwen3 causal LM forward pass.

Written straight from the equations of Hugging Face ``Qwen3ForCausalLM`` so that the JAX model
can be tested against something that shares no code with it. It imports neither jax nor
anything from kk_jax, reads safetensors files with its own ~20-line parser (so it does not
depend on a framework's bfloat16 support either), and computes everything in float64.

Per layer, for hidden states ``x`` of shape [T, D]:

    h = RMSNorm(x) * input_layernorm
    q = h @ Wq.T -> [T, Hq, Dh];  k = h @ Wk.T -> [T, Hkv, Dh];  v = h @ Wv.T -> [T, Hkv, Dh]
    q = RMSNorm_Dh(q) * q_norm;   k = RMSNorm_Dh(k) * k_norm        (per head, before RoPE)
    q, k = RoPE(q), RoPE(k)       rotate-half convention, positions 0..T-1, base rope_theta
    a = softmax(q k^T / sqrt(Dh) + causal mask) v                    (GQA: Hq/Hkv q heads per kv head)
    x = x + a.reshape(T, Hq*Dh) @ Wo.T
    h = RMSNorm(x) * post_attention_layernorm
    x = x + (silu(h @ Wg.T) * (h @ Wu.T)) @ Wd.T

then ``logits = (RMSNorm(x) * norm) @ W_out.T`` with ``W_out = lm_head`` or, when
``tie_word_embeddings`` is true, the embedding matrix. HF weight layout is [out, in].

API: ``load(ckpt_dir) -> (config, weights)``, ``logits(config, weights, ids) -> [T, V]``,
``greedy(config, weights, prompt_ids, steps) -> list[int]``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

__all__ = ["load", "read_safetensors", "rope_theta", "logits", "greedy"]

# safetensors dtype tag -> numpy dtype of the raw little-endian bytes.
_RAW_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # widened to float32 by a 16-bit shift below
}


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Read every tensor of one ``.safetensors`` file as float32 numpy arrays.

    File format: 8-byte little-endian header length N, N bytes of JSON header mapping
    tensor name -> {dtype, shape, data_offsets=[begin, end]} (offsets relative to the end of
    the header), then the raw data. bfloat16 is the upper half of a float32, so it widens
    exactly by shifting its bits left by 16.
    """
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _RAW_DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        raw = np.frombuffer(data[base + begin : base + end], dtype=_RAW_DTYPES[info["dtype"]])
        if info["dtype"] == "BF16":
            arr = (raw.astype(np.uint32) << 16).view(np.float32)
        else:
            arr = raw.astype(np.float32)
        out[name] = arr.reshape(info["shape"])
    return out


def load(ckpt_dir: str | Path) -> tuple[dict, dict[str, np.ndarray]]:
    """Read ``config.json`` and all weights (single file or sharded with an index) as float32."""
    ckpt_dir = Path(ckpt_dir)
    cfg = json.loads((ckpt_dir / "config.json").read_text())
    index = ckpt_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        weight_map, files = None, ["model.safetensors"]
    weights: dict[str, np.ndarray] = {}
    for f in files:
        part = read_safetensors(ckpt_dir / f)
        if weight_map is not None:
            for name in part:
                if weight_map.get(name) != f:
                    raise ValueError(f"{name} found in {f} but the index maps it to {weight_map.get(name)}")
        weights.update(part)
    if weight_map is not None and set(weight_map) != set(weights):
        raise ValueError(f"index and shards disagree: {sorted(set(weight_map) ^ set(weights))}")
    return cfg, weights


def rope_theta(cfg: dict) -> float:
    """RoPE base from either spelling: transformers 5 ``rope_parameters`` or a top-level ``rope_theta``."""
    params = cfg.get("rope_parameters")
    if params is not None:
        if params.get("rope_type", "default") != "default":
            raise ValueError(f"oracle supports only rope_type 'default', got {params.get('rope_type')!r}")
        return float(params["rope_theta"])
    scaling = cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise ValueError(f"oracle supports only default RoPE, got rope_scaling={scaling!r}")
    return float(cfg["rope_theta"])


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * weight."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rope(x: np.ndarray, theta: float) -> np.ndarray:
    """Rotate-half RoPE on x [T, H, Dh] at positions 0..T-1.

    inv_freq[i] = theta^(-2i/Dh) for i < Dh/2; angle[t, j] = t * inv_freq[j mod Dh/2];
    out = x * cos(angle) + rotate_half(x) * sin(angle), rotate_half([a, b]) = [-b, a].
    """
    t, _, dh = x.shape
    inv_freq = 1.0 / theta ** (np.arange(0, dh, 2, dtype=np.float64) / dh)  # [Dh/2]
    ang = np.arange(t, dtype=np.float64)[:, None] * inv_freq[None, :]  # [T, Dh/2]
    ang = np.concatenate([ang, ang], axis=-1)[:, None, :]  # [T, 1, Dh]
    half = dh // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(ang) + rot * np.sin(ang)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def logits(cfg: dict, w: dict[str, np.ndarray], token_ids) -> np.ndarray:
    """Full causal forward over ``token_ids`` (positions 0..T-1); returns float32 logits [T, vocab]."""
    return _forward(cfg, w, token_ids).astype(np.float32)


def _forward(cfg: dict, w: dict[str, np.ndarray], token_ids) -> np.ndarray:
    """The forward pass in float64; returns logits [T, vocab] float64."""
    ids = np.asarray(token_ids, dtype=np.int64)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError("token_ids must be a non-empty 1-D sequence")
    f = lambda name: w[name].astype(np.float64)  # noqa: E731
    d = cfg["hidden_size"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dh = cfg.get("head_dim") or d // hq
    eps = float(cfg["rms_norm_eps"])
    theta = rope_theta(cfg)
    if cfg.get("attention_bias"):
        raise ValueError("oracle does not implement attention_bias")
    if cfg.get("use_sliding_window"):
        raise ValueError("oracle does not implement sliding-window attention")
    t = ids.shape[0]
    group = hq // hkv

    x = f("model.embed_tokens.weight")[ids]  # [T, D]
    causal = np.tril(np.ones((t, t), dtype=bool))  # [Tq, Tk], True = may attend
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms_norm(x, f(p + "input_layernorm.weight"), eps)
        q = (h @ f(p + "self_attn.q_proj.weight").T).reshape(t, hq, dh)
        k = (h @ f(p + "self_attn.k_proj.weight").T).reshape(t, hkv, dh)
        v = (h @ f(p + "self_attn.v_proj.weight").T).reshape(t, hkv, dh)
        q = _rope(_rms_norm(q, f(p + "self_attn.q_norm.weight"), eps), theta)
        k = _rope(_rms_norm(k, f(p + "self_attn.k_norm.weight"), eps), theta)
        k = np.repeat(k, group, axis=1)  # [T, Hq, Dh]: q head j reads kv head j // group
        v = np.repeat(v, group, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(dh)  # [Hq, Tq, Tk]
        s = np.where(causal[None], s, -np.inf)
        s = s - s.max(axis=-1, keepdims=True)
        pr = np.exp(s)
        pr = pr / pr.sum(axis=-1, keepdims=True)
        a = np.einsum("hqk,khd->qhd", pr, v).reshape(t, hq * dh)  # [T, Hq*Dh]
        x = x + a @ f(p + "self_attn.o_proj.weight").T
        h = _rms_norm(x, f(p + "post_attention_layernorm.weight"), eps)
        gate = h @ f(p + "mlp.gate_proj.weight").T
        up = h @ f(p + "mlp.up_proj.weight").T
        x = x + (_silu(gate) * up) @ f(p + "mlp.down_proj.weight").T
    x = _rms_norm(x, f("model.norm.weight"), eps)
    if cfg.get("tie_word_embeddings", False):
        w_out = f("model.embed_tokens.weight")
    else:
        w_out = f("lm_head.weight")
    return x @ w_out.T  # [T, V]


def greedy(cfg: dict, w: dict[str, np.ndarray], prompt_ids, steps: int) -> list[int]:
    """Greedy continuation of ``prompt_ids`` for ``steps`` tokens (no stop on EOS).

    Recomputes the whole forward each step (no cache): slow but obviously correct. The argmax
    is taken on the float64 logits; exact ties go to the lowest token id (numpy's argmax).
    """
    ids = [int(i) for i in prompt_ids]
    out: list[int] = []
    for _ in range(steps):
        nxt = int(np.argmax(_forward(cfg, w, ids)[-1]))
        out.append(nxt)
        ids.append(nxt)
    return out
