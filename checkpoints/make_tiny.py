"""Write small, deterministic checkpoints in the exact Hugging Face layout, for tests and demos.

No weights can be downloaded where kk_jax is developed and tested, so every supported
architecture gets a generator here that writes a random-but-reproducible checkpoint directory
laid out exactly as ``transformers`` 5.x ``save_pretrained`` writes the real model class:

    config.json                       model_type, architectures, sizes, rope_parameters, dtype
    model.safetensors                 or model-0000i-of-0000N.safetensors + model.safetensors.index.json
    tokenizer.json                    byte-level BPE trained on ``tiny_corpus.txt`` (shipped beside this file)
    tokenizer_config.json             Qwen2Tokenizer settings, added tokens, ChatML chat_template
    generation_config.json            bos / eos / pad ids and sampling defaults as the real model ships them

Same arguments and seed => byte-identical files (tests check it). Usable two ways:

    python checkpoints/make_tiny.py --arch qwen3 --out DIR [--seed N] [--dtype bfloat16|float32]
        [--shards N] [--tie-word-embeddings | --no-tie-word-embeddings] [--hidden-size ...]

    from checkpoints.make_tiny import make_tiny
    path = make_tiny(DIR, arch="qwen3", seed=0, dtype="float32", num_layers=3)

This file depends only on numpy, ml_dtypes, safetensors and tokenizers (not on kk_jax), so the
same checkpoints can be written from an interpreter that has transformers instead of jax.
"""

from __future__ import annotations

import argparse
import json
import math
import zlib
from pathlib import Path

import numpy as np

__all__ = ["make_tiny", "ARCHS", "QWEN3_DEFAULTS", "build_tokenizer", "CHAT_TEMPLATE"]

CORPUS_PATH = Path(__file__).with_name("tiny_corpus.txt")

# Transformers release whose on-disk layout these files mirror (written as
# ``transformers_version`` the way save_pretrained stamps its own version).
TRANSFORMERS_LAYOUT_VERSION = "5.17.0"

# Size of the trained BPE vocabulary (256 byte symbols + merges), before the added tokens.
BPE_VOCAB_SIZE = 1000

# Added tokens after the BPE vocabulary, in Qwen3's relative order: (content, special).
# The three ChatML control tokens are special (skipped by decode(skip_special_tokens=True));
# the tool and think tags are plain added tokens, as in Qwen3's tokenizer.
ADDED_TOKENS = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

# Pre-tokenizer split of Qwen2/Qwen3 (transformers' Qwen2Tokenizer rebuilds the tokenizer from
# vocab + merges with exactly this pipeline, so tokenizer.json must use the same one).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML template in the shape of Qwen3's: optional system turn (tools listed inside it), user /
# assistant turns as ``<|im_start|>role\n...<|im_end|>\n``, assistant tool calls as
# ``<tool_call>\n{json}\n</tool_call>``, consecutive tool results grouped into one user turn of
# ``<tool_response>`` blocks, ``<think>`` reasoning kept only after the last user query, and
# ``add_generation_prompt`` / ``enable_thinking=False`` (appends an empty think block).
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query and reasoning %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') }}"
    "{%- else %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- endif %}"
    "{%- if message.tool_calls %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

# Defaults of the tiny Qwen3 (public keyword names accepted by make_tiny / the CLI).
QWEN3_DEFAULTS = {
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": None,  # None: the tokenizer's size rounded up to a multiple of 64
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "dtype": "bfloat16",
    "shards": 1,
}

# Hugging Face config spellings accepted as aliases of the short keyword names.
_ALIASES = {
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
}

# Weight init (normal draws). Chosen so the random model is not degenerate. With std 0.02
# everywhere the residual stream stays dominated by the current token's embedding, and the tied
# unembedding then scores that same token highest: greedy decoding repeats one token forever.
# Here projections are 1/sqrt(fan_in)-scaled (unit-variance activations), and the two matrices
# that write into the residual stream (o_proj, down_proj) get an extra gain, so the layer
# updates outweigh the embedding (as they do in trained models) and the self-preference of tied
# weights drops well below the logit spread. Embeddings of std 0.25 give logits a standard
# deviation near 2 after the final RMSNorm (sqrt(hidden) * 0.25 at hidden 64), so argmax margins
# are clear (median ~0.4) and bf16 / fp32 implementations agree on greedy tokens.
EMBED_STD = 0.25
RESIDUAL_GAIN = 4.0
NORM_NOISE_STD = 0.1  # norm weights are 1 + N(0, this): q/k norms are not trivially identity


def _proj_std(fan_in: int) -> float:
    return 1.0 / math.sqrt(fan_in)


# ----------------------------------------------------------------------------- tokenizer


def build_tokenizer(corpus: str | None = None, bpe_vocab_size: int = BPE_VOCAB_SIZE, added_tokens=ADDED_TOKENS):
    """Train the byte-level BPE tokenizer on ``corpus`` (default: tiny_corpus.txt).

    Pipeline exactly as Qwen2/Qwen3: NFC normalizer, regex Split (isolated) + ByteLevel
    (no prefix space, no regex) pre-tokenizer, BPE with no unk / no byte fallback, ByteLevel
    decoder and post-processor. The 256 byte symbols seed the alphabet so any text encodes.
    ``added_tokens`` (default ``ADDED_TOKENS``) follow the BPE vocabulary, in order. Training is deterministic: the
    trainer breaks count ties by pair ids, which come from the sorted alphabet.
    Returns a ``tokenizers.Tokenizer``.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, processors, trainers

    if corpus is None:
        corpus = CORPUS_PATH.read_text(encoding="utf-8")
    tok = Tokenizer(
        models.BPE(
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab_size,
        min_frequency=1,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    lines = [line for line in corpus.splitlines(keepends=True) if line.strip()]
    tok.train_from_iterator(lines, trainer=trainer)
    for content, special in added_tokens:
        t = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        if special:
            tok.add_special_tokens([t])
        else:
            tok.add_tokens([t])
    return tok


def _added_tokens_decoder(tok, added_tokens) -> dict:
    added = {}
    for content, special in added_tokens:
        added[str(tok.token_to_id(content))] = {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
    return added


def _tokenizer_config(tok) -> dict:
    """tokenizer_config.json as Qwen3 ships it (Qwen2Tokenizer, ChatML template, eos <|im_end|>)."""
    added = _added_tokens_decoder(tok, ADDED_TOKENS)
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        # As in Qwen3: the ChatML markers only; the tool / think tags stay plain added tokens.
        "additional_special_tokens": [c for c, special in ADDED_TOKENS if special and c != "<|endoftext|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


# ----------------------------------------------------------------------------- weights


def _normal(seed: int, name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    """N(0, std^2) float32 draws from a stream keyed by (seed, tensor name).

    Keying by name keeps each tensor independent of the others' shapes: e.g. the tied and
    untied variants of one seed share every weight but lm_head.
    """
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return (rng.standard_normal(shape, dtype=np.float64) * std).astype(np.float32)


def _qwen3_weights(cfg: dict, seed: int) -> dict[str, np.ndarray]:
    """Float32 weights of Qwen3ForCausalLM in HF names and layouts ([out, in] for projections)."""
    d, v, f = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    hq, hkv, dh = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    w: dict[str, np.ndarray] = {}

    def norm(name: str, n: int) -> None:
        w[name] = 1.0 + _normal(seed, name, (n,), NORM_NOISE_STD)

    def proj(name: str, out: int, inp: int, gain: float = 1.0) -> None:
        w[name] = _normal(seed, name, (out, inp), gain * _proj_std(inp))

    w["model.embed_tokens.weight"] = _normal(seed, "model.embed_tokens.weight", (v, d), EMBED_STD)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        norm(p + "input_layernorm.weight", d)
        proj(p + "self_attn.q_proj.weight", hq * dh, d)
        proj(p + "self_attn.k_proj.weight", hkv * dh, d)
        proj(p + "self_attn.v_proj.weight", hkv * dh, d)
        proj(p + "self_attn.o_proj.weight", d, hq * dh, RESIDUAL_GAIN)
        norm(p + "self_attn.q_norm.weight", dh)
        norm(p + "self_attn.k_norm.weight", dh)
        norm(p + "post_attention_layernorm.weight", d)
        proj(p + "mlp.gate_proj.weight", f, d)
        proj(p + "mlp.up_proj.weight", f, d)
        proj(p + "mlp.down_proj.weight", d, f, RESIDUAL_GAIN)
    norm("model.norm.weight", d)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = _normal(seed, "lm_head.weight", (v, d), EMBED_STD)
    return w


def _qwen3_config(o: dict, tokenizer_size: int, ids: dict[str, int]) -> dict:
    """config.json content with every key transformers 5 writes for Qwen3ForCausalLM."""
    if o["vocab_size"] is None:
        vocab = -(-tokenizer_size // 64) * 64
    else:
        vocab = int(o["vocab_size"])
        if vocab < tokenizer_size:
            raise ValueError(f"vocab_size={vocab} is smaller than the tokenizer ({tokenizer_size} tokens)")
    if o["num_heads"] % o["num_kv_heads"]:
        raise ValueError(f"num_heads={o['num_heads']} must be a multiple of num_kv_heads={o['num_kv_heads']}")
    if o["head_dim"] % 2:
        raise ValueError(f"head_dim={o['head_dim']} must be even (RoPE rotates pairs)")
    n_layers = int(o["num_layers"])
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids["<|endoftext|>"],
        "dtype": o["dtype"],
        "eos_token_id": ids["<|im_end|>"],
        "head_dim": int(o["head_dim"]),
        "hidden_act": "silu",
        "hidden_size": int(o["hidden_size"]),
        "initializer_range": 0.02,
        "intermediate_size": int(o["intermediate_size"]),
        "layer_types": ["full_attention"] * n_layers,
        "max_position_embeddings": int(o["max_position_embeddings"]),
        "max_window_layers": n_layers,
        "model_type": "qwen3",
        "num_attention_heads": int(o["num_heads"]),
        "num_hidden_layers": n_layers,
        "num_key_value_heads": int(o["num_kv_heads"]),
        "pad_token_id": None,
        "rms_norm_eps": float(o["rms_norm_eps"]),
        "rope_parameters": {"rope_theta": float(o["rope_theta"]), "rope_type": "default"},
        "sliding_window": None,
        "tie_word_embeddings": bool(o["tie_word_embeddings"]),
        "transformers_version": TRANSFORMERS_LAYOUT_VERSION,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab,
    }


def _generation_config(ids: dict[str, int]) -> dict:
    """generation_config.json as Qwen3 ships it: stop on <|im_end|> or <|endoftext|>."""
    return {
        "bos_token_id": ids["<|endoftext|>"],
        "do_sample": True,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "transformers_version": TRANSFORMERS_LAYOUT_VERSION,
    }


# ----------------------------------------------------------------------------- writing


def _json_text(obj: dict) -> str:
    """JSON as save_pretrained formats it: 2-space indent, sorted keys, trailing newline."""
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def _cast(arr: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return np.ascontiguousarray(arr, dtype=np.float32)
    if dtype == "bfloat16":
        import ml_dtypes

        return np.ascontiguousarray(arr.astype(ml_dtypes.bfloat16))  # round to nearest even
    raise ValueError(f"dtype must be 'bfloat16' or 'float32', got {dtype!r}")


def _write_weights(out: Path, weights: dict[str, np.ndarray], shards: int) -> list[str]:
    """Write safetensors file(s); with shards > 1 also the index. Returns the file names.

    Tensors keep model order (embedding, layers, final norm, lm_head) and are cut into
    ``shards`` contiguous groups of roughly equal byte size, each group non-empty.
    """
    from safetensors.numpy import save

    names = list(weights)
    if not 1 <= shards <= len(names):
        raise ValueError(f"shards must be between 1 and {len(names)} (the number of tensors), got {shards}")
    meta = {"format": "pt"}
    if shards == 1:
        (out / "model.safetensors").write_bytes(save(weights, metadata=meta))
        return ["model.safetensors"]
    sizes = [weights[n].nbytes for n in names]
    total = sum(sizes)
    groups: list[list[str]] = [[] for _ in range(shards)]
    acc, g = 0, 0
    for k, name in enumerate(names):
        remaining_tensors = len(names) - k
        remaining_groups = shards - g - 1
        # Move to the next group when this one has its share, or when each later group needs
        # one of the remaining tensors.
        if groups[g] and g < shards - 1 and (acc >= total * (g + 1) / shards or remaining_tensors <= remaining_groups):
            g += 1
        groups[g].append(name)
        acc += sizes[k]
    files, weight_map = [], {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        (out / fname).write_bytes(save({n: weights[n] for n in group}, metadata=meta))
        files.append(fname)
        weight_map.update({n: fname for n in group})
    index = {
        "metadata": {"total_parameters": int(sum(w.size for w in weights.values())), "total_size": int(total)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (out / "model.safetensors.index.json").write_text(_json_text(index))
    files.append("model.safetensors.index.json")
    return files


def _clear_old_weights(out: Path) -> None:
    """Remove weight files a previous run may have left (a stale single file next to shards, or
    the reverse, would make the directory ambiguous). Nothing else in ``out`` is touched."""
    for p in list(out.glob("model*.safetensors")) + [out / "model.safetensors.index.json"]:
        if p.is_file():
            p.unlink()


def _make_qwen3(out: Path, seed: int, o: dict) -> None:
    tok = build_tokenizer()
    ids = {c: tok.token_to_id(c) for c, _ in ADDED_TOKENS}
    cfg = _qwen3_config(o, tok.get_vocab_size(with_added_tokens=True), ids)
    shards = int(o["shards"])
    weights = {k: _cast(v, o["dtype"]) for k, v in _qwen3_weights(cfg, seed).items()}
    out.mkdir(parents=True, exist_ok=True)
    _clear_old_weights(out)
    _write_weights(out, weights, shards)
    (out / "config.json").write_text(_json_text(cfg))
    (out / "generation_config.json").write_text(_json_text(_generation_config(ids)))
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True))
    (out / "tokenizer_config.json").write_text(_json_text(_tokenizer_config(tok)))


# ----------------------------------------------------------------------------- glm5_next

# GLM-5.3's control tokens (special: skipped by decode) and its tag tokens (plain added tokens).
GLM5_ADDED_TOKENS = (
    ("<|endoftext|>", True),
    ("[MASK]", True),
    ("[gMASK]", True),
    ("[sMASK]", True),
    ("<sop>", True),
    ("<eop>", True),
    ("<|system|>", True),
    ("<|user|>", True),
    ("<|assistant|>", True),
    ("<|observation|>", True),
    ("<think>", False),
    ("</think>", False),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<arg_key>", False),
    ("</arg_key>", False),
    ("<arg_value>", False),
    ("</arg_value>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
)
GLM5_TEMPLATE_PATH = Path(__file__).with_name("templates") / "glm5_chat_template.jinja"

# Defaults of the tiny GLM-5.3: the real 3:1 KDA:DSA pattern over 8 layers (DSA at 3 and 7),
# two dense layers then MoE with a shared expert, mHC with 4 streams, and an index_topk of 8
# tokens (2 pools of 4) so sparse selection really happens beyond 8 context tokens.
GLM5_DEFAULTS = {
    "hidden_size": 64,
    "num_layers": 8,
    "first_dense_layers": 2,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "num_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "index_n_heads": 8,
    "index_head_dim": 16,
    "index_topk": 8,
    "index_kpool": 4,
    "linear_num_heads": 4,
    "linear_head_dim": 16,
    "hc_mult": 4,
    "rms_norm_eps": 1e-5,
    "vocab_size": None,
    "mtp": True,          # also write the MTP (NextN) block as layer num_layers, as the release does
    "dtype": "bfloat16",
    "shards": 1,
}


def _glm5_layer_types(n: int) -> list[str]:
    return ["deepseek_sparse_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]


def _glm5_text_config(o: dict, vocab: int, ids: dict[str, int]) -> dict:
    """text_config with every key transformers 5 writes for glm5_next_text."""
    n = int(o["num_layers"])
    dense = int(o["first_dense_layers"])
    return {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": None,
        "eos_token_id": [ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"]],
        "hc_eps": 1e-06, "hc_mult": int(o["hc_mult"]), "hc_sinkhorn_iters": 20, "head_dim": 0, "hidden_act": "silu",
        "hidden_size": int(o["hidden_size"]), "index_head_dim": int(o["index_head_dim"]),
        "index_kpool": int(o["index_kpool"]), "index_kpool_always_select_tail": True,
        "index_n_heads": int(o["index_n_heads"]), "index_topk": int(o["index_topk"]),
        "indexer_types": ["full"] * n, "initializer_range": 0.02, "intermediate_size": int(o["intermediate_size"]),
        "kv_lora_rank": int(o["kv_lora_rank"]), "layer_types": _glm5_layer_types(n), "linear_conv_kernel_dim": 4,
        "linear_head_dim": int(o["linear_head_dim"]), "linear_lower_bound": -5.0,
        "linear_num_heads": int(o["linear_num_heads"]), "max_position_embeddings": 1048576,
        "mlp_layer_types": ["dense"] * min(dense, n) + ["sparse"] * max(0, n - dense),
        "model_type": "glm5_next_text", "moe_intermediate_size": int(o["moe_intermediate_size"]),
        "n_group": 1, "n_routed_experts": int(o["n_routed_experts"]), "n_shared_experts": int(o["n_shared_experts"]),
        "norm_topk_prob": True, "num_attention_heads": int(o["num_heads"]),
        "num_experts_per_tok": int(o["num_experts_per_tok"]), "num_hidden_layers": n,
        "num_key_value_heads": int(o["num_heads"]), "output_router_logits": False,
        "pad_token_id": ids["<|endoftext|>"], "q_lora_rank": int(o["q_lora_rank"]),
        "qk_head_dim": int(o["qk_nope_head_dim"]), "qk_nope_head_dim": int(o["qk_nope_head_dim"]),
        "qk_rope_head_dim": 0, "rms_norm_eps": float(o["rms_norm_eps"]), "routed_scaling_factor": 2.5,
        "router_aux_loss_coef": 0.001, "swiglu_limit": 10.0, "tie_word_embeddings": False, "topk_group": 1,
        "use_cache": True, "v_head_dim": int(o["v_head_dim"]), "vocab_size": vocab,
    }


def _glm5_config(o: dict, tokenizer_size: int, ids: dict[str, int]) -> dict:
    vocab = -(-tokenizer_size // 64) * 64 if o["vocab_size"] is None else int(o["vocab_size"])
    if vocab < tokenizer_size:
        raise ValueError(f"vocab_size={vocab} is smaller than the tokenizer ({tokenizer_size} tokens)")
    if int(o["index_topk"]) % int(o["index_kpool"]):
        raise ValueError("index_topk must be a multiple of index_kpool")
    return {
        "architectures": ["Glm5NextForConditionalGeneration"], "dtype": o["dtype"],
        "image_end_token_id": 154831, "image_start_token_id": 154830, "image_token_id": 154854,
        "model_type": "glm5_next", "text_config": _glm5_text_config(o, vocab, ids), "tie_word_embeddings": False,
        "transformers_version": TRANSFORMERS_LAYOUT_VERSION, "video_end_token_id": 154833,
        "video_start_token_id": 154832, "video_token_id": 154855,
        # a one-block vision tower config (its weights are not written: only the text tower is served)
        "vision_config": {"depth": 1, "hidden_act": "silu", "hidden_size": 32, "in_channels": 3,
                          "initializer_range": 0.02, "intermediate_size": 64, "model_type": "glm5_next_vision",
                          "num_heads": 2, "out_hidden_size": int(o["hidden_size"]), "patch_size": 14,
                          "projection_intermediate_size": 128, "rms_norm_eps": 1e-05,
                          "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"},
                          "spatial_merge_size": 2, "swiglu_limit": 10.0, "temporal_patch_size": 2},
    }


def _glm5_weights(cfg: dict, seed: int, mtp: bool) -> dict[str, np.ndarray]:
    """Float32 text-tower weights of Glm5NextForConditionalGeneration in HF names and layouts."""
    t = cfg["text_config"]
    d, v, hc = t["hidden_size"], t["vocab_size"], t["hc_mult"]
    hk, dk = t["linear_num_heads"], t["linear_head_dim"]
    qkv = hk * dk
    h, nope, vd = t["num_attention_heads"], t["qk_nope_head_dim"], t["v_head_dim"]
    ql, kl = t["q_lora_rank"], t["kv_lora_rank"]
    ih, idim, kp = t["index_n_heads"], t["index_head_dim"], t["index_kpool"]
    e, fi, fe = t["n_routed_experts"], t["intermediate_size"], t["moe_intermediate_size"]
    w: dict[str, np.ndarray] = {}

    def normal(name, shape, std):
        w[name] = _normal(seed, name, shape, std)

    def norm(name, n):
        w[name] = 1.0 + _normal(seed, name, (n,), NORM_NOISE_STD)

    def proj(name, out, inp, gain=1.0):
        normal(name, (out, inp), gain * _proj_std(inp))

    def swiglu(p, width):
        proj(p + "gate_proj.weight", width, d)
        proj(p + "up_proj.weight", width, d)
        proj(p + "down_proj.weight", d, width, RESIDUAL_GAIN)

    def dsa(p):
        proj(p + "self_attn.q_a_proj.weight", ql, d)
        norm(p + "self_attn.q_a_layernorm.weight", ql)
        proj(p + "self_attn.q_b_proj.weight", h * nope, ql)
        proj(p + "self_attn.kv_a_proj_with_mqa.weight", kl, d)
        norm(p + "self_attn.kv_a_layernorm.weight", kl)
        proj(p + "self_attn.kv_b_proj.weight", h * (nope + vd), kl)
        proj(p + "self_attn.o_proj.weight", d, h * vd, RESIDUAL_GAIN)
        q = p + "self_attn.indexer."
        proj(q + "wq_b.weight", ih * idim, ql)
        proj(q + "wk.weight", idim, d)
        norm(q + "k_norm.weight", idim)
        normal(q + "k_norm.bias", (idim,), NORM_NOISE_STD)
        proj(q + "weights_proj.weight", ih, d)
        normal(q + "index_kpool_compress_ape", (kp, idim), 0.5)
        proj(q + "index_kpool_compress_gate", idim, d)

    def moe(p):
        normal(p + "mlp.gate.weight", (e, d), _proj_std(d))
        normal(p + "mlp.gate.e_score_correction_bias", (e,), 0.1)
        for x in range(e):
            swiglu(p + f"mlp.experts.{x}.", fe)
        swiglu(p + "mlp.shared_experts.", fe * t["n_shared_experts"])

    normal("model.language_model.embed_tokens.weight", (v, d), EMBED_STD)
    for i in range(t["num_hidden_layers"]):
        p = f"model.language_model.layers.{i}."
        for site in ("attn", "ffn"):
            normal(p + f"hc_{site}_base", ((2 + hc) * hc,), 0.5)
            normal(p + f"hc_{site}_fn", ((2 + hc) * hc, hc * d), 1.0 / math.sqrt(hc * d))
            w[p + f"hc_{site}_scale"] = 0.5 + np.abs(_normal(seed, p + f"hc_{site}_scale", (3,), 0.5))
        norm(p + "input_layernorm.weight", d)
        norm(p + "post_attention_layernorm.weight", d)
        if t["layer_types"][i] == "linear_attention":
            a = p + "self_attn."
            for x in "qkv":
                proj(a + f"{x}_proj.weight", qkv, d)
                normal(a + f"{x}_conv1d.weight", (qkv, 1, 4), 0.5)
            w[a + "A_log"] = np.log(np.linspace(1.0, 16.0, hk, dtype=np.float64)).astype(np.float32)
            normal(a + "dt_bias", (qkv,), 0.5)
            proj(a + "b_proj.weight", hk, d)
            proj(a + "f_a_proj.weight", dk, d)
            proj(a + "f_b_proj.weight", qkv, dk)
            proj(a + "g_a_proj.weight", dk, d)
            proj(a + "g_b_proj.weight", qkv, dk)
            norm(a + "o_norm.weight", dk)
            proj(a + "o_proj.weight", d, qkv, RESIDUAL_GAIN)
        else:
            dsa(p)
        if t["mlp_layer_types"][i] == "dense":
            swiglu(p + "mlp.", fi)
        else:
            moe(p)
    norm("model.language_model.norm.weight", d)
    normal("lm_head.weight", (v, d), EMBED_STD)
    if mtp:   # NextN block: layer num_hidden_layers, DSA + MoE, no hc_* tensors, shares embed/lm_head
        p = f"model.language_model.layers.{t['num_hidden_layers']}."
        proj(p + "eh_proj.weight", d, 2 * d)
        for name in ("enorm", "hnorm", "shared_head.norm", "input_layernorm", "post_attention_layernorm"):
            norm(p + name + ".weight", d)
        dsa(p)
        moe(p)
    return w


def _make_glm5(out: Path, seed: int, o: dict) -> None:
    tok = build_tokenizer(added_tokens=GLM5_ADDED_TOKENS)
    ids = {c: tok.token_to_id(c) for c, _ in GLM5_ADDED_TOKENS}
    cfg = _glm5_config(o, tok.get_vocab_size(with_added_tokens=True), ids)
    weights = {k: _cast(v, o["dtype"]) for k, v in _glm5_weights(cfg, seed, bool(o["mtp"])).items()}
    out.mkdir(parents=True, exist_ok=True)
    _clear_old_weights(out)
    _write_weights(out, weights, int(o["shards"]))
    (out / "config.json").write_text(_json_text(cfg))
    eos = cfg["text_config"]["eos_token_id"]
    (out / "generation_config.json").write_text(_json_text({
        "_from_model_config": True, "eos_token_id": eos, "pad_token_id": ids["<|endoftext|>"],
        "transformers_version": TRANSFORMERS_LAYOUT_VERSION}))
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True))
    tcfg = {
        "added_tokens_decoder": _added_tokens_decoder(tok, GLM5_ADDED_TOKENS),
        "additional_special_tokens": [c for c, special in GLM5_ADDED_TOKENS if special and c != "<|endoftext|>"],
        "clean_up_tokenization_spaces": False, "do_lower_case": False, "eos_token": "<|endoftext|>",
        "model_max_length": 1048576, "pad_token": "<|endoftext|>", "padding_side": "left",
        "remove_space": False, "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if GLM5_TEMPLATE_PATH.is_file():
        tcfg["chat_template"] = GLM5_TEMPLATE_PATH.read_text(encoding="utf-8")
    (out / "tokenizer_config.json").write_text(_json_text(tcfg))


ARCHS = {"qwen3": (_make_qwen3, QWEN3_DEFAULTS), "glm5_next": (_make_glm5, GLM5_DEFAULTS)}


def make_tiny(out_dir, arch: str = "qwen3", seed: int = 0, **overrides) -> Path:
    """Write a tiny ``arch`` checkpoint into ``out_dir`` (created if missing); return its Path.

    ``overrides`` replace entries of the architecture's defaults (for qwen3: ``QWEN3_DEFAULTS``:
    hidden_size, num_layers, num_heads, num_kv_heads, head_dim, intermediate_size, vocab_size,
    rope_theta, rms_norm_eps, max_position_embeddings, tie_word_embeddings, dtype, shards; the
    HF names num_hidden_layers / num_attention_heads / num_key_value_heads are accepted too).
    Same arguments and seed => byte-identical files.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(ARCHS)}")
    builder, defaults = ARCHS[arch]
    opts = dict(defaults)
    for key, value in overrides.items():
        key = _ALIASES.get(key, key)
        if key not in defaults:
            raise TypeError(f"make_tiny({arch!r}) got unknown option {key!r}; options: {sorted(defaults)}")
        if value is not None or key == "vocab_size":
            opts[key] = value
    out = Path(out_dir)
    builder(out, int(seed), opts)
    return out


def _main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="qwen3", choices=sorted(ARCHS))
    ap.add_argument("--out", required=True, help="output directory (created if missing)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None)
    ap.add_argument("--shards", type=int, default=None, help="number of safetensors files (default 1)")
    ap.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction, default=None)
    for flag in ("hidden-size", "num-layers", "num-heads", "num-kv-heads", "head-dim", "intermediate-size", "vocab-size"):
        ap.add_argument(f"--{flag}", type=int, default=None)
    ap.add_argument("--rope-theta", type=float, default=None)
    ap.add_argument("--rms-norm-eps", type=float, default=None)
    ap.add_argument("--max-position-embeddings", type=int, default=None)
    args = vars(ap.parse_args(argv))
    arch, out, seed = args.pop("arch"), args.pop("out"), args.pop("seed")
    overrides = {k: v for k, v in args.items() if v is not None}
    path = make_tiny(out, arch=arch, seed=seed, **overrides)
    cfg = json.loads((path / "config.json").read_text())
    files = sorted(p.name for p in path.iterdir() if p.is_file())
    print(
        f"wrote {arch} to {path}: hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
        f"{cfg['num_attention_heads']}/{cfg['num_key_value_heads']} heads x {cfg['head_dim']}, "
        f"vocab {cfg['vocab_size']}, {cfg['dtype']}, tied={cfg['tie_word_embeddings']}; files: {', '.join(files)}"
    )


if __name__ == "__main__":
    _main()
