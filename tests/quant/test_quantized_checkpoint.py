"""Quantized checkpoints end to end: ``checkpoints/quantize.py`` writes the release layouts,
the loader places the quantized tensors on the device as they are, and a tiny Qwen3 in each
format generates through ``kk_jax.LLM`` exactly the greedy tokens of the NumPy oracle run on
the same weights dequantized on the host. Bad checkpoints fail with errors naming tensors."""

import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant_oracle as qo  # noqa: E402
from oracles import qwen3_numpy as oracle  # noqa: E402

from checkpoints.make_tiny import make_tiny  # noqa: E402
from checkpoints.quantize import _main as quantize_main, quantize_checkpoint  # noqa: E402
from kk_jax import LLM  # noqa: E402
from kk_jax.checkpoint.loader import CheckpointError  # noqa: E402
from kk_jax.checkpoint.safetensors_io import LazyTensor, index_checkpoint  # noqa: E402
from kk_jax.config import ConfigError  # noqa: E402
from kk_jax.engine.request import SamplingParams  # noqa: E402
from kk_jax.models.layers.linear import QuantLayoutError  # noqa: E402

SMALL = dict(dtype="float32", max_model_len=32, max_num_seqs=1, max_num_batched_tokens=8, decode_steps=4,
             progress=False)
PROMPT = [1, 2, 3, 4, 5]
Q_PROJ = "model.layers.0.self_attn.q_proj"
QKV_PROJ = "model.layers.0.self_attn.qkv_proj"          # q, k, v fused
EXCLUDE = ["model.layers.1.mlp*", "model.layers.0.self_attn.o_proj"]


@pytest.fixture(scope="module")
def quantized(tiny_ckpt, tmp_path_factory):
    """{algo: checkpoint dir}; the NVFP4 one keeps EXCLUDE in floating point."""
    root = tmp_path_factory.mktemp("quantized")
    return {algo: quantize_checkpoint(tiny_ckpt, root / algo, algo, EXCLUDE if algo == "nvfp4" else ())
            for algo in ("fp8_block", "mxfp8", "nvfp4")}


def host_dequantized(ckpt: Path) -> dict[str, np.ndarray]:
    """float64 weights of a quantized checkpoint, decoded from its bytes by the test oracle."""
    t = {n: LazyTensor(i)[...] for n, i in index_checkpoint(ckpt).items()}
    out = {}
    for name, a in t.items():
        module, _, sfx = name.rpartition(".")
        if sfx != "weight":
            continue                                            # scales are consumed below
        if f"{module}.weight_scale_inv" in t:
            out[name] = qo.dequant_fp8_block(a, t[f"{module}.weight_scale_inv"])
        elif f"{module}.weight_scale_2" in t:
            out[name] = qo.dequant_nvfp4(a, t[f"{module}.weight_scale"], t[f"{module}.weight_scale_2"])
        elif f"{module}.weight_scale" in t:
            out[name] = qo.dequant_mxfp8(a, t[f"{module}.weight_scale"])
        else:
            out[name] = np.asarray(a, np.float64)
    return out


@pytest.mark.parametrize("algo,weight_dtype,weight_shape,scales", [
    ("fp8_block", "F8_E4M3", [64, 64], {"weight_scale_inv": ("F32", [1, 1])}),
    ("mxfp8", "F8_E4M3", [64, 64], {"weight_scale": ("U8", [64, 2])}),
    ("nvfp4", "U8", [64, 32], {"weight_scale": ("F8_E4M3", [64, 4]), "weight_scale_2": ("F32", [])}),
])
def test_quantize_writes_the_release_layout(quantized, algo, weight_dtype, weight_shape, scales):
    ckpt = quantized[algo]
    idx = index_checkpoint(ckpt)
    w = idx[f"{Q_PROJ}.weight"]
    assert (w.dtype, list(w.shape)) == (weight_dtype, weight_shape)
    for sfx, (dt, shape) in scales.items():
        assert (idx[f"{Q_PROJ}.{sfx}"].dtype, list(idx[f"{Q_PROJ}.{sfx}"].shape)) == (dt, shape)
    assert idx["model.embed_tokens.weight"].dtype == "F32" and idx["model.norm.weight"].dtype == "F32"
    assert not any(n.endswith("input_scale") for n in idx)
    cfg = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    hq = ckpt / "hf_quant_config.json"
    if algo == "fp8_block":
        assert cfg == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [128, 128]}
        assert not hq.exists()
    else:
        algo_name = algo.upper()
        assert cfg["quant_method"] == "modelopt" and cfg["quant_algo"] == algo_name
        assert json.loads(hq.read_text())["quantization"]["quant_algo"] == algo_name
    assert (ckpt / "tokenizer.json").is_file() and (ckpt / "generation_config.json").is_file()


def test_exclude_keeps_modules_in_floating_point(quantized):
    idx = index_checkpoint(quantized["nvfp4"])
    for name in ("model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj", "model.layers.0.self_attn.o_proj"):
        assert idx[f"{name}.weight"].dtype == "F32" and f"{name}.weight_scale" not in idx
    assert idx["model.layers.1.self_attn.o_proj.weight"].dtype == "U8"
    hq = json.loads((quantized["nvfp4"] / "hf_quant_config.json").read_text())
    assert hq["quantization"]["exclude_modules"] == EXCLUDE


@pytest.mark.parametrize("algo", ["fp8_block", "mxfp8", "nvfp4"])
def test_llm_generates_the_dequantized_models_tokens(quantized, algo):
    ckpt = quantized[algo]
    llm = LLM(ckpt, **SMALL)
    weights = dict(zip([".".join(map(str, p)) for p, _ in nnx.to_flat_state(
        jax.tree.unflatten(llm.engine.runner.treedef, llm.engine.runner.weights))], llm.engine.runner.weights))
    # q, k, v run as one fused matmul for MXFP8 and NVFP4 (each member keeping its global scale);
    # not for block FP8 here (64-row projections are not whole 128-row blocks)
    q = weights[f"{QKV_PROJ}.weight" if algo != "fp8_block" else f"{Q_PROJ}.weight"]
    if algo == "nvfp4":
        assert weights[f"{QKV_PROJ}.weight_scale_2"].shape == (3,)
    assert q.dtype == {"fp8_block": jax.numpy.float8_e4m3fn, "mxfp8": jax.numpy.float8_e4m3fn,
                       "nvfp4": jax.numpy.uint8}[algo]                      # kept quantized on the device
    got = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0].token_ids
    cfg = json.loads((ckpt / "config.json").read_text())
    want = oracle.greedy(cfg, host_dequantized(ckpt), PROMPT, 8)
    assert got == want


def test_tensor_parallel_quantized_model(quantized):
    """MXFP8 at tp=2: scales are sharded like their weights (column- and row-parallel) and the
    tokens match tp=1. Block FP8's 128-row blocks cannot be split across tp=2 here: clear error."""
    llm = LLM(quantized["mxfp8"], tp=2, **SMALL)
    runner = llm.engine.runner
    weights = dict(zip([".".join(map(str, p)) for p, _ in nnx.to_flat_state(
        jax.tree.unflatten(runner.treedef, runner.weights))], runner.weights))
    s = weights[f"{QKV_PROJ}.weight_scale"]              # q|k|v [2, 64 + 32 + 32] (transposed), split on N
    assert s.shape == (2, 128) and s.addressable_shards[0].data.shape == (2, 64)
    so = weights["model.layers.0.self_attn.o_proj.weight_scale"]             # row-parallel: K/32 split
    assert so.addressable_shards[0].data.shape == (1, 64)
    got = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0].token_ids
    cfg = json.loads((quantized["mxfp8"] / "config.json").read_text())
    assert got == oracle.greedy(cfg, host_dequantized(quantized["mxfp8"]), PROMPT, 8)
    with pytest.raises(QuantLayoutError, match=r"model\.layers\.0\.\w+\.\w+_proj: tp=2 splits the (output|input) "
                                               r"dimension \d+ into shards of \d+, not a multiple of the fp8_block scale block"):
        LLM(quantized["fp8_block"], tp=2, **SMALL)


def test_declared_mxfp8_with_float_tensors_names_them(tiny_ckpt, tmp_path):
    ckpt = shutil.copytree(tiny_ckpt, tmp_path / "ckpt")
    (ckpt / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "MXFP8"}}))
    with pytest.raises(CheckpointError) as e:
        LLM(ckpt, **SMALL)
    msg = str(e.value)
    assert f"tensor {Q_PROJ}.weight has dtype F32, expected F8_E4M3" in msg
    assert f"missing tensor {Q_PROJ}.weight_scale (expected shape [64, 2], part of {QKV_PROJ}.weight_scale)" in msg


def test_bad_scale_shape_names_the_tensor(quantized, tmp_path):
    from safetensors.numpy import save

    ckpt = shutil.copytree(quantized["mxfp8"], tmp_path / "ckpt")
    idx = index_checkpoint(ckpt)
    tensors = {n: LazyTensor(i)[...] for n, i in idx.items()}
    tensors[f"{Q_PROJ}.weight_scale"] = tensors[f"{Q_PROJ}.weight_scale"][:, :1].copy()
    (ckpt / "model.safetensors").write_bytes(save(tensors))
    with pytest.raises(CheckpointError, match=rf"tensor {Q_PROJ}.weight_scale has shape \[64, 1\], expected \[64, 2\]"):
        LLM(ckpt, **SMALL)


def test_mxfp8_block_past_2_16_flags_its_layer(quantized, tmp_path, caplog):
    """A 32-block of one projection scaled past 2^16 (E8M0 byte 140, beyond the 2-16-row mma
    GEMV's bf16 factor): the engine loads it, flags that layer so its few-row calls take the
    dequantizing engine (a warning names it), and generates the oracle's tokens."""
    from safetensors.numpy import save

    ckpt = shutil.copytree(quantized["mxfp8"], tmp_path / "ckpt")
    tensors = {n: LazyTensor(i)[...] for n, i in index_checkpoint(ckpt).items()}
    tensors[f"{Q_PROJ}.weight_scale"] = scale = tensors[f"{Q_PROJ}.weight_scale"].copy()
    scale[5, 1] = 140
    (ckpt / "model.safetensors").write_bytes(save(tensors))
    with caplog.at_level("WARNING", logger="kk_jax.engine.runner"):
        llm = LLM(ckpt, **SMALL)
    assert f"MXFP8 scales above 2^7 (blocks with weights beyond 2^16) in {QKV_PROJ}:" in caplog.text
    got = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0].token_ids
    cfg = json.loads((ckpt / "config.json").read_text())
    assert got == oracle.greedy(cfg, host_dequantized(ckpt), PROMPT, 8)


def test_nvfp4_input_scales_are_accepted(quantized, tmp_path):
    """ModelOpt's NVFP4 exports hold an ``input_scale`` next to every quantized linear's weight
    (unused: activations stay bf16); such a checkpoint loads and generates the tokens of the same
    checkpoint without them."""
    from safetensors.numpy import save

    ckpt = shutil.copytree(quantized["nvfp4"], tmp_path / "ckpt")
    tensors = {n: LazyTensor(i)[...] for n, i in index_checkpoint(ckpt).items()}
    scaled = [n.removesuffix(".weight_scale_2") for n in tensors if n.endswith(".weight_scale_2")]
    assert scaled
    tensors.update({f"{m}.input_scale": np.asarray(0.5 + i, np.float32) for i, m in enumerate(scaled)})
    (ckpt / "model.safetensors").write_bytes(save(tensors))
    params = SamplingParams(max_tokens=6, temperature=0)
    got = LLM(ckpt, **SMALL).generate([PROMPT], params)[0].token_ids
    assert got == LLM(quantized["nvfp4"], **SMALL).generate([PROMPT], params)[0].token_ids


@pytest.mark.parametrize("algo,name,bad", [
    ("mxfp8", f"{Q_PROJ}.weight_scale", 255),                  # E8M0's NaN byte
    ("fp8_block", f"{Q_PROJ}.weight_scale_inv", np.nan),
    ("nvfp4", "model.layers.1.self_attn.q_proj.weight_scale_2", np.inf),
])
def test_scales_that_are_not_numbers_are_refused_at_load(quantized, tmp_path, algo, name, bad):
    from safetensors.numpy import save

    ckpt = shutil.copytree(quantized[algo], tmp_path / "ckpt")
    tensors = {n: LazyTensor(i)[...] for n, i in index_checkpoint(ckpt).items()}
    tensors[name] = scale = tensors[name].copy()
    scale.reshape(-1)[0] = bad
    (ckpt / "model.safetensors").write_bytes(save(tensors))
    with pytest.raises(CheckpointError, match=r"quantization scales that are not numbers .* in 1 parameters: "
                                              r"model\.layers\.\d\.self_attn\.\w+_proj\.weight_scale"):
        LLM(ckpt, **SMALL)


def test_truncated_or_corrupt_safetensors_name_the_file(tiny_ckpt, tmp_path, capsys):
    ckpt = shutil.copytree(tiny_ckpt, tmp_path / "ckpt")
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor \S+ .*truncated or corrupt file"):
        LLM(ckpt, **SMALL)
    assert quantize_main(["--in", str(ckpt), "--out", str(tmp_path / "q"), "--algo", "mxfp8", "--quiet"]) == 2
    assert "truncated or corrupt file" in capsys.readouterr().err
    (ckpt / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="model.safetensors: not a safetensors file"):
        LLM(ckpt, **SMALL)


def test_unknown_quant_algo_is_a_config_error(tiny_ckpt, tmp_path):
    ckpt = shutil.copytree(tiny_ckpt, tmp_path / "ckpt")
    (ckpt / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "INT4_AWQ"}}))
    with pytest.raises(ConfigError, match="unsupported quant_algo 'INT4_AWQ'"):
        LLM(ckpt, **SMALL)


def test_cli(tiny_ckpt, tmp_path, capsys):
    assert quantize_main(["--in", str(tiny_ckpt), "--out", str(tmp_path / "q"), "--algo", "mxfp8",
                          "--exclude", "model.layers.0*", "--quiet"]) == 0
    assert index_checkpoint(tmp_path / "q")["model.layers.0.mlp.up_proj.weight"].dtype == "F32"
    assert quantize_main(["--in", str(tmp_path / "q"), "--out", str(tmp_path / "q2"), "--algo", "nvfp4"]) == 2
    assert "already quantized" in capsys.readouterr().err
    odd = make_tiny(tmp_path / "odd", arch="qwen3", seed=0, dtype="float32", hidden_size=48)
    assert quantize_main(["--in", str(odd), "--out", str(tmp_path / "q3"), "--algo", "mxfp8"]) == 2
    err = capsys.readouterr().err
    assert "model.layers.0.self_attn.q_proj.weight has in_features 48, not a multiple of 32 (mxfp8)" in err
    assert "add --exclude model.layers.0.self_attn.q_proj" in err


def test_cli_excludes_and_bad_input(tiny_ckpt, tmp_path, capsys):
    """--exclude may be repeated; a pattern that names no module, excluding everything, an
    input that is no checkpoint or an output that is a file: exit status 2 and one line saying
    what is wrong, nothing written."""
    out = tmp_path / "q"
    assert quantize_main(["--in", str(tiny_ckpt), "--out", str(out), "--algo", "mxfp8", "--quiet",
                          "--exclude", "model.layers.0.*", "--exclude", "model.layers.1.mlp.*"]) == 0
    idx = index_checkpoint(out)
    assert idx["model.layers.0.self_attn.q_proj.weight"].dtype == "F32"
    assert idx["model.layers.1.mlp.up_proj.weight"].dtype == "F32"
    assert idx["model.layers.1.self_attn.q_proj.weight"].dtype == "F8_E4M3"
    bad = {"typo": ["--exclude", "model.layer.0"], "everything": ["--exclude", "*"],
           "no checkpoint": ["--in", str(tmp_path / "missing")], "file out": ["--out", str(tmp_path / "afile")]}
    (tmp_path / "afile").write_text("")
    for case, args in bad.items():
        argv = {"--in": str(tiny_ckpt), "--out": str(tmp_path / "bad"), "--algo": "nvfp4"}
        argv.update(dict(zip(args[::2], args[1::2])))
        assert quantize_main([a for kv in argv.items() for a in kv] + ["--quiet"]) == 2, case
        assert not (tmp_path / "bad").exists(), case
    err = capsys.readouterr().err
    assert "--exclude 'model.layer.0' matches no linear module" in err
    assert "every linear module is excluded: nothing to quantize" in err
    assert "is not a Hugging Face checkpoint directory (no config.json)" in err
    assert "exists and is not a directory" in err


def test_cli_refuses_non_finite_weights_and_unknown_names_keeping_the_output(tiny_ckpt, tmp_path, capsys):
    """A weight holding inf / NaN, or tensor names that are not the architecture's: exit status
    2 and the reason; an output directory that held a checkpoint keeps it, byte for byte."""
    from safetensors.numpy import save

    out = tmp_path / "q"
    assert quantize_main(["--in", str(tiny_ckpt), "--out", str(out), "--algo", "nvfp4", "--quiet"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    bad = shutil.copytree(tiny_ckpt, tmp_path / "bad")
    tensors = {n: LazyTensor(i)[...] for n, i in index_checkpoint(bad).items()}
    tensors["model.layers.1.mlp.down_proj.weight"] = w = tensors["model.layers.1.mlp.down_proj.weight"].copy()
    w[3, 5] = np.inf
    (bad / "model.safetensors").write_bytes(save(tensors))
    assert quantize_main(["--in", str(bad), "--out", str(out), "--algo", "mxfp8", "--quiet"]) == 2
    assert ("model.layers.1.mlp.down_proj.weight holds inf or NaN values" in capsys.readouterr().err)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    renamed = {n.replace("model.", "model.language_model.", 1): t for n, t in tensors.items()}
    (bad / "model.safetensors").write_bytes(save(renamed))
    assert quantize_main(["--in", str(bad), "--out", str(tmp_path / "q2"), "--algo", "mxfp8", "--quiet",
                          "--exclude", "model.language_model.layers.0.mlp*"]) == 2
    assert "none of the model's linear weights is in the checkpoint" in capsys.readouterr().err


def test_fp8_activations_switch_block_fp8_linears_to_w8a8(quantized, tiny_ckpt):
    """W8A8 is opt-in: it changes the numerics (activations rounded to e4m3 per 1x128 group) but
    stays close to the default W8A16; any checkpoint that is not block FP8 refuses the flag."""
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=0)
    w8a16 = LLM(quantized["fp8_block"], **SMALL).generate([PROMPT], params)[0].logprobs
    w8a8 = LLM(quantized["fp8_block"], fp8_activations=True, **SMALL).generate([PROMPT], params)[0].logprobs
    first16, first8 = w8a16[0].logprob, w8a8[0].logprob
    assert first16 != first8 and abs(first16 - first8) < 0.05
    with pytest.raises(ConfigError, match="needs a block-FP8 checkpoint .* got a mxfp8 checkpoint"):
        LLM(quantized["mxfp8"], fp8_activations=True, **SMALL)
    with pytest.raises(ConfigError, match="got an unquantized checkpoint"):
        LLM(tiny_ckpt, fp8_activations=True, **SMALL)
