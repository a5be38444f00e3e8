"""Detection of quantized checkpoints: block FP8 (quant_method fp8 + weight_block_size) and
ModelOpt (hf_quant_config.json and/or config.json quantization_config), exclusion patterns,
and clear errors for what is not supported."""

import json

import pytest

from kk_jax.config import ConfigError
from kk_jax.quant.config import QuantConfig, detect, parse

BLOCK_FP8 = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}}


def test_block_fp8_from_config_json():
    q = parse(BLOCK_FP8, None)
    assert (q.method, q.block, q.by_tensors, q.activation_scheme) == ("fp8_block", (128, 128), True, "dynamic")
    names = {"model.layers.0.mlp.up_proj.weight_scale_inv"}
    # the release keeps some linears in BF16 without listing them: membership follows the tensors
    assert q.method_for("model.layers.0.mlp.up_proj", names) == "fp8_block"
    assert q.method_for("model.layers.0.self_attn.kv_b_proj", names) is None
    assert q.method_for("lm_head", {"lm_head.weight_scale_inv"}) is None


def test_modelopt_spellings_agree():
    hq = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "MXFP8", "kv_cache_quant_algo": None,
                                                               "group_size": 32, "exclude_modules": ["lm_head"]}}
    flat = {"quantization_config": {"quant_method": "modelopt", "quant_algo": "MXFP8", "ignore": ["model.layers.1*"]}}
    nested = {"quantization_config": {"quant_method": "modelopt", "quantization": {"quant_algo": "nvfp4",
                                                                                   "exclude_modules": []}}}
    assert parse({}, hq).method == "mxfp8"
    assert parse(flat, None).method == "mxfp8"
    assert parse(nested, None).method == "nvfp4"
    both = parse(flat, hq)
    assert both.method == "mxfp8" and set(both.exclude) == {"lm_head", "model.layers.1*"}
    assert parse({"quantization_config": {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4"}}, None).method \
        == "nvfp4"
    # config.json may say ModelOpt and leave quant_algo to hf_quant_config.json; its exclusions count
    only_method = {"quantization_config": {"quant_method": "modelopt", "ignore": ["model.layers.1*"]}}
    split = parse(only_method, hq)
    assert split.method == "mxfp8" and set(split.exclude) == {"lm_head", "model.layers.1*"}


def test_exclusion_patterns():
    q = QuantConfig("mxfp8", (1, 32), ("model.layers.0.self_attn", "*.mlp.down_proj", "model.layers.2.mlp.up_proj"))
    assert q.is_excluded("model.layers.0.self_attn.q_proj")           # parent module
    assert q.is_excluded("model.layers.5.mlp.down_proj")              # wildcard
    assert q.is_excluded("model.layers.2.mlp.up_proj")                # exact
    assert not q.is_excluded("model.layers.2.mlp.gate_proj")
    assert not q.is_excluded("model.layers.0.self_attn_extra.q_proj")  # a prefix that is not a parent
    assert q.is_excluded("lm_head")                                   # output heads never quantized
    assert q.method_for("model.layers.1.mlp.up_proj") == "mxfp8"
    wild = QuantConfig("mxfp8", (1, 32), ("model.layers.*.self_attn",))       # a wildcard parent
    assert wild.is_excluded("model.layers.3.self_attn.k_proj") and wild.is_excluded("model.layers.3.self_attn")
    assert not wild.is_excluded("model.layers.3.mlp.up_proj")


def test_every_exclusion_list_counts():
    """Both spellings in one document, and exclusions in an hf_quant_config.json that leaves the
    method to config.json: none is dropped."""
    both = {"quantization": {"quant_algo": "NVFP4", "exclude_modules": ["lm_head"], "ignore": ["*.v_proj"]}}
    assert set(parse({}, both).exclude) == {"lm_head", "*.v_proj"}
    flat = {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["a"]}}
    q = parse(flat, {"quantization": {"exclude_modules": ["b"]}})
    assert q.method == "nvfp4" and set(q.exclude) == {"a", "b"}


@pytest.mark.parametrize("config,hq,msg", [
    ({"quantization_config": {"quant_method": "modelopt", "quant_algo": "INT4_AWQ"}}, None,
     "unsupported quant_algo 'INT4_AWQ'"),
    ({}, {"quantization": {"quant_algo": "FP8"}}, "unsupported quant_algo 'FP8' in hf_quant_config.json"),
    ({"quantization_config": {"quant_method": "fp8"}}, None, "without weight_block_size"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}, None, "two positive ints"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}}, None,
     "fmt 'e5m2' is not supported"),
    ({"quantization_config": {"quant_method": "awq"}}, None, "quant_method 'awq', which is not supported"),
    ({"quantization_config": {"quant_method": "modelopt", "quant_algo": "MXFP8"}},
     {"quantization": {"quant_algo": "NVFP4"}}, "says mxfp8 but hf_quant_config.json says nvfp4"),
    ({}, {"quantization": {"quant_algo": "MXFP8", "group_size": 16}}, "MXFP8 uses group_size 32, got 16"),
    ({}, {"quantization": {"quant_algo": "NVFP4", "exclude_modules": "lm_head"}}, "must be a list"),
    ({}, {"quantization": {"quant_algo": "NVFP4", "group_size": "sixteen"}}, "NVFP4 uses group_size 16, got sixteen"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                              "modules_to_not_convert": "model.layers.0"}}, None,
     "modules_to_not_convert must be a list of module-name patterns"),
    ({"quantization_config": {"quant_method": "modelopt"}}, None, "gives no quant_algo"),
    ({"quantization_config": {"quant_method": "modelopt"}}, {"quantization": {}}, "has no quantization.quant_algo"),
    ({}, ["NVFP4"], "hf_quant_config.json must be a JSON object, got list"),
    ([], None, "config.json must be a JSON object, got list"),
])
def test_bad_quantization_configs(config, hq, msg):
    with pytest.raises(ConfigError, match=msg):
        parse(config, hq)


def test_detect_reads_the_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    assert detect(tmp_path) is None
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    q = detect(tmp_path)
    assert q.method == "nvfp4" and q.block == (1, 16) and "hf_quant_config.json" in q.source
    (tmp_path / "hf_quant_config.json").write_text('{"quantization": ')
    with pytest.raises(ConfigError, match="hf_quant_config.json: not valid JSON"):
        detect(tmp_path)


def test_to_hf_round_trips():
    for q in (QuantConfig("fp8_block", (128, 128), ("a",), by_tensors=True, activation_scheme="dynamic"),
              QuantConfig("mxfp8", (1, 32), ("lm_head",)), QuantConfig("nvfp4", (1, 16))):
        qc, hq = q.to_hf()
        back = parse({"quantization_config": qc}, hq)
        assert (back.method, back.block, back.exclude) == (q.method, q.block, q.exclude)
