"""Tests of checkpoints/make_tiny.py (tiny Qwen3 in the HF layout) and of the NumPy oracle.

Fast and CPU-only: each checkpoint takes well under a second to write. What is checked:
byte-determinism per seed, the file set and config keys, tensor names / shapes / dtypes of
the Qwen3 contract (tied and untied), sharded output and its index, the tokenizer (round
trip, special tokens as single ids), the chat template, the CLI, and that the oracle's greedy
decoding of the random model does not collapse into one repeated token.
"""

import json
import struct
import subprocess
import sys
from pathlib import Path

import jinja2
import jinja2.sandbox
import numpy as np
import pytest
from tokenizers import Tokenizer

from checkpoints.make_tiny import ADDED_TOKENS, make_tiny
from oracles.qwen3_numpy import greedy, load, logits, read_safetensors, rope_theta

REPO = Path(__file__).resolve().parents[2]
FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
CONFIG_KEYS = {
    "architectures", "attention_bias", "attention_dropout", "bos_token_id", "dtype", "eos_token_id",
    "head_dim", "hidden_act", "hidden_size", "initializer_range", "intermediate_size", "layer_types",
    "max_position_embeddings", "max_window_layers", "model_type", "num_attention_heads",
    "num_hidden_layers", "num_key_value_heads", "pad_token_id", "rms_norm_eps", "rope_parameters",
    "sliding_window", "tie_word_embeddings", "transformers_version", "use_cache",
    "use_sliding_window", "vocab_size",
}  # fmt: skip


def _header(path: Path) -> dict:
    """The JSON header of a safetensors file: name -> {dtype, shape, data_offsets}."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n])


def _expected_shapes(cfg: dict) -> dict[str, list[int]]:
    """Every tensor of Qwen3ForCausalLM with its HF shape ([out, in] for projections)."""
    d, v, f = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    hq, hkv, dh = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    shapes = {"model.embed_tokens.weight": [v, d], "model.norm.weight": [d]}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": [d],
            p + "self_attn.q_proj.weight": [hq * dh, d],
            p + "self_attn.k_proj.weight": [hkv * dh, d],
            p + "self_attn.v_proj.weight": [hkv * dh, d],
            p + "self_attn.o_proj.weight": [d, hq * dh],
            p + "self_attn.q_norm.weight": [dh],
            p + "self_attn.k_norm.weight": [dh],
            p + "post_attention_layernorm.weight": [d],
            p + "mlp.gate_proj.weight": [f, d],
            p + "mlp.up_proj.weight": [f, d],
            p + "mlp.down_proj.weight": [d, f],
        })  # fmt: skip
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = [v, d]
    return shapes


def _render(template: str, messages, **kwargs) -> str:
    """Render a chat template the way transformers does (sandbox, trim/lstrip blocks, plain tojson)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False)
    return env.from_string(template).render(messages=messages, **kwargs)


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tied"), seed=0)


@pytest.fixture(scope="module")
def untied_f32(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("untied"), seed=0, dtype="float32", tie_word_embeddings=False)


def test_same_seed_gives_identical_bytes(tmp_path, tied):
    again = make_tiny(tmp_path / "again", seed=0)
    assert {p.name for p in again.iterdir()} == FILES
    for name in FILES:
        assert (again / name).read_bytes() == (tied / name).read_bytes(), name


def test_different_seed_changes_weights_only(tmp_path, tied):
    other = make_tiny(tmp_path / "seed1", seed=1)
    for name in FILES - {"model.safetensors"}:
        assert (other / name).read_bytes() == (tied / name).read_bytes(), name
    a, b = read_safetensors(tied / "model.safetensors"), read_safetensors(other / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert not np.array_equal(a[name], b[name]), name


def test_config_and_generation_config(tied):
    cfg = json.loads((tied / "config.json").read_text())
    assert set(cfg) == CONFIG_KEYS
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"} and "rope_theta" not in cfg
    assert rope_theta(cfg) == 10000.0 and rope_theta({"rope_theta": 5e5}) == 5e5
    assert cfg["dtype"] == "bfloat16" and "torch_dtype" not in cfg
    sizes = {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")}
    assert sizes == {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    assert (cfg["head_dim"], cfg["intermediate_size"], cfg["max_position_embeddings"]) == (16, 128, 4096)
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["tie_word_embeddings"] is True
    assert cfg["layer_types"] == ["full_attention"] * 2 and cfg["use_sliding_window"] is False
    assert cfg["attention_bias"] is False

    tok = Tokenizer.from_file(str(tied / "tokenizer.json"))
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    assert cfg["vocab_size"] >= n_tok and cfg["vocab_size"] % 64 == 0 and cfg["vocab_size"] - n_tok < 64
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    assert cfg["bos_token_id"] == eot and cfg["eos_token_id"] == im_end
    gen = json.loads((tied / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [im_end, eot]
    assert gen["bos_token_id"] == eot and gen["pad_token_id"] == eot


@pytest.mark.parametrize("variant", ["tied", "untied_f32"])
def test_tensor_contract(variant, request):
    ckpt = request.getfixturevalue(variant)
    cfg = json.loads((ckpt / "config.json").read_text())
    header = _header(ckpt / "model.safetensors")
    assert header.pop("__metadata__") == {"format": "pt"}
    expected = _expected_shapes(cfg)
    assert set(header) == set(expected)
    assert ("lm_head.weight" in header) == (variant == "untied_f32")
    want_dtype = {"bfloat16": "BF16", "float32": "F32"}[cfg["dtype"]]
    for name, info in header.items():
        assert info["shape"] == expected[name], name
        assert info["dtype"] == want_dtype, name


def test_weight_statistics(untied_f32):
    """Norm weights sit near 1 but are not exactly 1; matrices are centred random draws."""
    _, w = load(untied_f32)
    for name, arr in w.items():
        if arr.ndim == 1:
            assert 0.5 < arr.mean() < 1.5 and arr.std() > 0.01, name
        else:
            assert abs(arr.mean()) < 0.05 and arr.std() > 0.01, name


def test_sharded_matches_single_file(tmp_path, untied_f32):
    out = make_tiny(tmp_path / "sharded", seed=0, dtype="float32", tie_word_embeddings=False, shards=3)
    names = {p.name for p in out.iterdir()}
    shard_files = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert names == (FILES - {"model.safetensors"}) | set(shard_files) | {"model.safetensors.index.json"}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    total = 0
    for f in shard_files:
        header = _header(out / f)
        header.pop("__metadata__")
        assert header, f"{f} is empty"
        for name, info in header.items():
            assert weight_map[name] == f
            total += info["data_offsets"][1] - info["data_offsets"][0]
    assert index["metadata"]["total_size"] == total
    cfg_a, a = load(out)
    cfg_b, b = load(untied_f32)
    assert cfg_a == cfg_b and a.keys() == b.keys() == set(weight_map)
    assert index["metadata"]["total_parameters"] == sum(x.size for x in b.values())
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    # Rewriting the directory unsharded removes the shard files and the index.
    make_tiny(out, seed=0, dtype="float32", tie_word_embeddings=False)
    assert {p.name for p in out.iterdir()} == FILES


def test_tokenizer_round_trip_and_special_tokens(tied):
    tok = Tokenizer.from_file(str(tied / "tokenizer.json"))
    for text in [
        "The train leaves at 9:30 from platform 4.",
        "  Leading spaces, tabs\tand\nnew lines\n\n",
        "Unicode: café, naïve, 日本語, emoji 🙂 — all bytes survive.",
        "x = [1, 2, 3]; print(x)  # code-ish {braces}",
    ]:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    assert len(tok.encode("The weather is sunny and warm.").ids) < 12  # BPE merges, not bytes
    base = tok.get_vocab_size(with_added_tokens=False)
    for k, (content, _) in enumerate(ADDED_TOKENS):
        ids = tok.encode(content).ids
        assert ids == [base + k], content
    prompt = "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>\n\n"
    ids = tok.encode(prompt).ids
    for content in ("<|im_start|>", "<|im_end|>", "<think>", "</think>"):
        assert tok.token_to_id(content) in ids
    assert tok.decode(ids, skip_special_tokens=False) == prompt
    # ChatML control tokens are special (dropped); think tags are plain added tokens (kept).
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi\n<think>\n\n</think>\n\n"


def test_tokenizer_config(tied):
    tc = json.loads((tied / "tokenizer_config.json").read_text())
    tok = Tokenizer.from_file(str(tied / "tokenizer.json"))
    assert tc["tokenizer_class"] == "Qwen2Tokenizer"
    assert tc["eos_token"] == "<|im_end|>" and tc["pad_token"] == "<|endoftext|>" and tc["bos_token"] is None
    for content, special in ADDED_TOKENS:
        entry = tc["added_tokens_decoder"][str(tok.token_to_id(content))]
        assert entry["content"] == content and entry["special"] is special


def test_chat_template(tied):
    template = json.loads((tied / "tokenizer_config.json").read_text())["chat_template"]
    msgs = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    expected = (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
    )
    assert _render(template, msgs) == expected
    assert _render(template, msgs, add_generation_prompt=True) == expected + "<|im_start|>assistant\n"
    assert _render(template, msgs, add_generation_prompt=True, enable_thinking=False) == (
        expected + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    # Reasoning is kept for the assistant turn after the last user query, dropped before it.
    think = {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"}
    assert _render(template, msgs + [think]).endswith("<|im_start|>assistant\n<think>\nadd them\n</think>\n\n4<|im_end|>\n")
    assert "add them" not in _render(template, msgs + [think, {"role": "user", "content": "ok"}])
    # Tools: listed in the system turn; calls and results in Qwen3's tags.
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]}  # fmt: skip
    out = _render(
        template,
        [{"role": "user", "content": "Time?"}, call, {"role": "tool", "content": "12:00"}],
        tools=tools,
        add_generation_prompt=True,
    )
    assert out.startswith("<|im_start|>system\n# Tools\n") and json.dumps(tools[0]) in out
    assert out.endswith(
        "<|im_start|>user\nTime?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("variant", ["tied", "untied_f32"])
def test_oracle_greedy_is_not_degenerate(variant, request):
    ckpt = request.getfixturevalue(variant)
    cfg, w = load(ckpt)
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    prompt = tok.encode("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n").ids
    out = greedy(cfg, w, prompt, 16)
    assert len(out) == 16 and all(0 <= t < cfg["vocab_size"] for t in out)
    assert len(set(out)) >= 4, out
    lg = logits(cfg, w, prompt + out)
    assert lg.shape == (len(prompt) + 16, cfg["vocab_size"]) and lg.dtype == np.float32
    assert 0.5 < lg.std() < 10.0  # logits have spread, so argmax margins are clear
    # Greedy tokens are the argmax of the full forward; causality: a prefix's logits don't change.
    assert [int(i) for i in np.argmax(lg[len(prompt) - 1 : -1], axis=-1)] == out
    np.testing.assert_allclose(logits(cfg, w, prompt)[:, :], lg[: len(prompt)], rtol=1e-5, atol=1e-5)


def test_options_and_errors(tmp_path):
    out = make_tiny(
        tmp_path / "custom", seed=3, dtype="float32", num_hidden_layers=3, num_heads=8,
        num_kv_heads=2, head_dim=8, hidden_size=32, intermediate_size=96, vocab_size=1536, rope_theta=1e6,
    )  # fmt: skip
    cfg, w = load(out)
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["head_dim"], cfg["vocab_size"]) == (3, 8, 8, 1536)
    assert cfg["rope_parameters"]["rope_theta"] == 1e6
    assert {k: list(v.shape) for k, v in w.items()} == _expected_shapes(cfg)
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        make_tiny(tmp_path / "bad", vocab_size=100)
    with pytest.raises(TypeError, match="unknown option"):
        make_tiny(tmp_path / "bad", hidden=32)
    with pytest.raises(ValueError, match="unknown arch"):
        make_tiny(tmp_path / "bad", arch="llama")


def test_cli(tmp_path):
    out = tmp_path / "cli"
    cmd = [sys.executable, str(REPO / "checkpoints" / "make_tiny.py"), "--arch", "qwen3", "--out", str(out),
           "--seed", "0", "--dtype", "float32", "--no-tie-word-embeddings", "--shards", "2", "--num-layers", "3"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert "wrote qwen3" in res.stdout
    cfg, w = load(out)
    assert cfg["num_hidden_layers"] == 3 and cfg["tie_word_embeddings"] is False and "lm_head.weight" in w
    assert (out / "model-00002-of-00002.safetensors").exists()
    ref = make_tiny(tmp_path / "api", seed=0, dtype="float32", tie_word_embeddings=False, shards=2, num_layers=3)
    for p in out.iterdir():
        assert p.read_bytes() == (ref / p.name).read_bytes(), p.name
