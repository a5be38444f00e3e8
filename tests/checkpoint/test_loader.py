"""Checkpoint validation and sharded placement; configuration errors name what to change."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kk_jax import LLM
from kk_jax.checkpoint.loader import CheckpointError
from kk_jax.config import ConfigError, Qwen3Config
from kk_jax.parallel.mesh import ParallelError
from kk_jax.tokenizer import TokenizerError

SMALL = dict(dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, progress=False)


@pytest.fixture
def ckpt_copy(tiny_ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, dst)
    return dst


def test_every_tensor_problem_is_reported_at_once(ckpt_copy):
    path = ckpt_copy / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.0.mlp.up_proj.weight"]
    del tensors["model.norm.weight"]
    tensors["model.layers.1.self_attn.q_proj.weight"] = tensors["model.layers.1.self_attn.q_proj.weight"][:, :8]
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"].astype(np.int32)
    tensors["model.extra.weight"] = np.zeros((2,), np.float32)
    save_file(tensors, path)
    with pytest.raises(CheckpointError) as e:
        LLM(ckpt_copy, **SMALL)
    msg = str(e.value)
    assert "5 problems" in msg
    for needle in ["missing tensor model.layers.0.mlp.up_proj.weight", "missing tensor model.norm.weight",
                   "model.layers.1.self_attn.q_proj.weight has shape [64, 8], expected [64, 64]",
                   "model.layers.0.self_attn.k_proj.weight has dtype I32",
                   "unexpected tensor model.extra.weight"]:
        assert needle in msg, msg


def test_unknown_architecture(ckpt_copy):
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    cfg["architectures"] = ["MysteryForCausalLM"]
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unknown architecture.*MysteryForCausalLM.*supported: "
                                          "Glm5NextForConditionalGeneration, Qwen3ForCausalLM"):
        LLM(ckpt_copy, **SMALL)


def test_missing_tokenizer(ckpt_copy):
    (ckpt_copy / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="tokenizer.json not found"):
        LLM(ckpt_copy, **SMALL)


def test_tp_must_divide_heads(tiny_ckpt):
    with pytest.raises(ParallelError, match="tp=4 must divide num_key_value_heads=2"):
        LLM(tiny_ckpt, tp=4, **SMALL)


def test_tp_beyond_devices(tiny_ckpt):
    with pytest.raises(ParallelError, match="tp=8 needs 8 devices"):
        LLM(tiny_ckpt, tp=8, **SMALL)


def test_rope_spellings():
    base = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8)
    assert Qwen3Config.from_hf({**base, "rope_theta": 5e5}).rope_theta == 5e5
    assert Qwen3Config.from_hf({**base, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}).rope_theta == 1e6
    with pytest.raises(ConfigError, match="rope_type 'yarn' is not supported"):
        Qwen3Config.from_hf({**base, "rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn"}})


def test_sharded_checkpoint_places_each_weight_with_its_tp_sharding(tiny_ckpt_untied):
    llm = LLM(tiny_ckpt_untied, tp=2, **SMALL)
    runner = llm.engine.runner
    state = dict(zip([".".join(map(str, p)) for p, _ in __import__("flax").nnx.to_flat_state(
        __import__("jax").tree.unflatten(runner.treedef, runner.weights))], runner.weights))
    q = state["model.layers.0.self_attn.qkv_proj.weight"]        # [(q + k + v heads)*dim, hidden], split on heads
    assert q.addressable_shards[0].data.shape == (q.shape[0] // 2, q.shape[1])
    o = state["model.layers.0.self_attn.o_proj.weight"]          # [hidden, heads*dim], split on heads
    assert o.addressable_shards[0].data.shape == (o.shape[0], o.shape[1] // 2)
    lm = state["lm_head.weight"]
    assert lm.addressable_shards[0].data.shape == (lm.shape[0] // 2, lm.shape[1])
    kv = runner.pools["layers.0.k"]
    assert kv.addressable_shards[0].data.shape[2] == kv.shape[2] // 2


def test_stacked_params_are_read_part_by_part_into_each_device_slice(tmp_path):
    """A Stack of Stacks of transposed per-expert tensors (layers x experts, HF [out, in]) is
    placed as [layers, experts, in, out], split over tp along ``out``: each device's slice
    equals NumPy stacking of the same tensors."""
    import jax.numpy as jnp

    from kk_jax.checkpoint.loader import Stack, TensorSpec, load_params
    from kk_jax.parallel.mesh import make_mesh

    rng = np.random.default_rng(0)
    w = {f"l{j}.e{e}": rng.standard_normal((8, 6)).astype(np.float32) for j in range(3) for e in range(2)}
    save_file({**w, "other": np.ones((4,), np.float32)}, tmp_path / "model.safetensors")
    expected = {n: ((8, 6), (None, None)) for n in w} | {"other": ((4,), (None,))}
    stack = Stack(tuple(Stack(tuple(f"l{j}.e{e}" for e in range(2)), transpose=True) for j in range(3)))
    mesh = make_mesh(2)
    out = load_params(tmp_path, expected, jnp.float32, mesh, progress=False,
                      stacks={"stacked": (TensorSpec((3, 2, 6, 8), (None, None, None, "mlp")), stack)})
    assert set(out) == {"stacked", "other"}
    want = np.stack([np.stack([w[f"l{j}.e{e}"].T for e in range(2)]) for j in range(3)])
    np.testing.assert_array_equal(np.asarray(out["stacked"]), want)
    assert out["stacked"].sharding.shard_shape(want.shape) == (3, 2, 6, 4)
