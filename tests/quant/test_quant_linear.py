"""Quantization-aware Linear / FusedLinear: one call for every format, the Pallas kernels
inside ``jax.shard_map`` on a tp mesh (column- and row-parallel), fused projections loaded
from several checkpoint tensors per tp shard, and the fused-format check that runs before
any weight is read."""

import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant_oracle as qo  # noqa: E402

from checkpoints.quantize import quantize_checkpoint  # noqa: E402
from kk_jax.checkpoint.loader import expected_tensors, load_params  # noqa: E402
from kk_jax.models.layers.linear import (FusedLinear, Linear, QuantLayoutError, mark_wide_scales,  # noqa: E402
                                         prepare_linears, quantize_linears)
from kk_jax.parallel.mesh import make_mesh, spec  # noqa: E402
from kk_jax.quant import QuantConfig, fp8_block, mxfp8, nvfp4  # noqa: E402

QUANTIZE = {"fp8_block": fp8_block.quantize, "mxfp8": mxfp8.quantize, "nvfp4": nvfp4.quantize}
SUFFIXES = {"fp8_block": ("weight", "weight_scale_inv"), "mxfp8": ("weight", "weight_scale"),
            "nvfp4": ("weight", "weight_scale", "weight_scale_2")}


def rel_err(a, b) -> float:
    a, b = np.asarray(jnp.asarray(a, jnp.float32), np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def quantized_linear(method, n, k, axes, seed=0, **kw):
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) / np.sqrt(k)
    lin = Linear(k, n, jnp.float32, axes=axes)
    lin.quantize_(method, **kw)
    for sfx, arr in zip(SUFFIXES[method], QUANTIZE[method](w)):
        getattr(lin, sfx).value = arr.T if sfx == "weight_scale" else arr      # block scales held transposed
    return lin


@pytest.mark.parametrize("method", ["fp8_block", "mxfp8", "nvfp4"])
def test_one_call_for_every_format(method):
    lin = quantized_linear(method, 64, 128, ("heads", "embed"))
    x = jax.random.normal(jax.random.key(0), (2, 3, 128), jnp.float32)
    y = lin(x)
    assert y.shape == (2, 3, 64) and y.dtype == jnp.float32
    # the kernels' weights: bf16(f32(e4m3) * scale) for block FP8, exact for the others
    w = lin.dense_weight(jnp.bfloat16 if method == "fp8_block" else jnp.float32)
    want = qo.matmul(np.asarray(x).reshape(6, 128), np.asarray(w.astype(jnp.float32)))
    assert rel_err(y.reshape(6, 64), want) < 1e-5
    lin.backend, lin.interpret = "pallas", True                 # the kernel, same numerics
    assert rel_err(lin(x), y) < 1e-5


def test_mxfp8_layer_with_scales_past_the_mma_gemv_takes_the_engine(monkeypatch):
    """``mark_wide_scales`` flags the MXFP8 layer whose scales hold a byte above 134 (a 32-block
    past 2^16, which the 2-16-row mma GEMV's bf16 factor cannot hold); that layer's few-row calls
    then run the engine, exact, while the other layer keeps the GEMV."""
    from pallas_kernels.mxfp8 import mma_gemv

    class Pair(nnx.Module):
        def __init__(self):
            kw = dict(backend="pallas", interpret=True)
            self.narrow = quantized_linear("mxfp8", 64, 256, ("heads", "embed"), **kw)
            self.wide = quantized_linear("mxfp8", 64, 256, ("heads", "embed"), seed=1, **kw)
            self.wide.weight_scale.value = self.wide.weight_scale[...].at[2, 5].set(mma_gemv.MAX_SCALE + 1)

    pair = Pair()
    assert mark_wide_scales(pair) == ["wide"] and pair.wide.wide_scales and not pair.narrow.wide_scales
    calls, real = [], mma_gemv.gemv
    monkeypatch.setattr(mma_gemv, "gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x = jax.random.normal(jax.random.key(2), (4, 256), jnp.float32)
    y = pair.wide(x)
    want = qo.matmul(np.asarray(x), np.asarray(pair.wide.dense_weight(jnp.float32)))
    assert not calls and rel_err(y, want) < 1e-5
    pair.narrow(x)
    assert len(calls) == 1


@pytest.mark.parametrize("axes,x_local,w_local", [
    (("heads", "embed"), (4, 128), (32, 128)),     # column-parallel: N split, output N-sharded
    (("embed", "heads"), (4, 64), (64, 64)),       # row-parallel: K split, fp32 partials psum-ed
], ids=["column", "row"])
def test_pallas_path_runs_per_shard_inside_shard_map(monkeypatch, axes, x_local, w_local):
    """The Pallas backend on a tp=2 mesh: each shard's kernel sees its own slice of x, the weight
    and the scales. The per-shard kernel is replaced by its jnp twin here (the Mosaic GPU
    interpreter is not safe to run on two CPU devices at once); the kernels themselves are
    tested in tests/pallas_kernels."""
    import kk_jax.models.layers.linear as linear_mod

    seen = []
    real = linear_mod._kernel_call

    def twin(method, x2, ops, **kw):
        seen.append((x2.shape, ops[0].shape, ops[1].shape))
        return real(method, x2, ops, **{**kw, "backend": "xla", "interpret": False})

    monkeypatch.setattr(linear_mod, "_kernel_call", twin)
    mesh = make_mesh(2)
    lin = quantized_linear("mxfp8", 64, 128, axes, seed=1, backend="pallas", mesh=mesh)
    for sfx in SUFFIXES["mxfp8"]:
        v = getattr(lin, sfx)
        v.value = jax.device_put(v.value, NamedSharding(mesh, spec(v.get_metadata()["axes"])))
    x = jax.random.normal(jax.random.key(1), (4, 128), jnp.float32)
    y = jax.jit(lambda x: lin(x))(x)
    assert seen and seen[0] == (x_local, w_local, (w_local[1] // 32, w_local[0]))
    want = qo.matmul(np.asarray(x), np.asarray(lin.dense_weight(jnp.float32)))
    assert rel_err(y, want) < 1e-5


MEMBERS = [(f"model.layers.{i}.self_attn.{p}", 32) for i in (0, 1) for p in ("k_proj", "v_proj")]


class KVFeatures(nnx.Module):
    """All layers' K and V projections of the same features as one matmul (the drafter shape)."""

    def __init__(self, dtype):
        self.kv = FusedLinear(64, MEMBERS, dtype, axes=("kv_heads", "embed"))


@pytest.fixture(scope="module")
def fused_ckpts(tiny_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    return {m: quantize_checkpoint(tiny_ckpt, root / m, m) for m in ("mxfp8", "nvfp4")}


@pytest.mark.parametrize("method", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("tp", [1, 2])
def test_fused_members_load_per_shard_and_split(fused_ckpts, method, tp):
    """Each member's output equals its own checkpoint tensors' product; NVFP4 members keep their
    (different) global scales, stacked into one per-member vector."""
    ckpt, mesh = fused_ckpts[method], make_mesh(tp)
    model = nnx.eval_shape(lambda: prepare_linears(KVFeatures(jnp.float32), ckpt, mesh=mesh))
    graphdef, state = nnx.split(model)
    expected = expected_tensors(nnx.to_flat_state(state))
    assert expected["kv.weight"].sources == tuple((f"{m}.weight", 32) for m, _ in MEMBERS)
    params = load_params(ckpt, expected, jnp.float32, mesh, progress=False, ignore=("model.",))
    from kk_jax.checkpoint.safetensors_io import LazyTensor, index_checkpoint
    idx = index_checkpoint(ckpt)
    read = lambda name, suffix: LazyTensor(idx[f"{name}.{suffix}"])[...]
    if method == "mxfp8":
        assert params["kv.weight"].dtype == jnp.float8_e4m3fn and params["kv.weight_scale"].shape == (2, 128)
    else:
        s2 = [float(np.asarray(read(name, "weight_scale_2")).reshape(())) for name, _ in MEMBERS]
        assert len(set(s2)) > 1 and params["kv.weight_scale_2"].tolist() == s2
    nnx.replace_by_pure_dict(state, {"kv": {k.split(".")[1]: v for k, v in params.items()}})
    model = nnx.merge(graphdef, state)
    x = jax.random.normal(jax.random.key(2), (3, 64), jnp.float32)
    outs = model.kv.split(jax.jit(lambda x: model.kv(x))(x))
    for (name, _), y in zip(MEMBERS, outs):
        w = (qo.dequant_mxfp8(read(name, "weight"), read(name, "weight_scale")) if method == "mxfp8" else
             qo.dequant_nvfp4(read(name, "weight"), read(name, "weight_scale"), read(name, "weight_scale_2")))
        assert rel_err(y, qo.matmul(np.asarray(x), w)) < 1e-5


def test_fused_mix_of_mxfp8_and_unquantized_is_rejected_before_loading(tmp_path):
    """Only the config files exist: the error comes from the format check, not from the loader."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"quantization": {"quant_algo": "MXFP8", "exclude_modules": ["model.layers.1.self_attn.v_proj"]}}))
    with pytest.raises(QuantLayoutError) as e:
        nnx.eval_shape(lambda: prepare_linears(KVFeatures(jnp.bfloat16), tmp_path))
    msg = str(e.value)
    assert "kv: cannot fuse MXFP8 and non-MXFP8 members along N" in msg
    assert "model.layers.1.self_attn.v_proj (unquantized)" in msg and "model.layers.0.self_attn.k_proj (mxfp8)" in msg
    assert "nothing was loaded" in msg


def test_every_layer_problem_is_reported_together():
    """A layer whose shape the format cannot block does not hide a fused layer's format mix."""

    class Both(nnx.Module):
        def __init__(self, dtype):
            self.kv = KVFeatures(dtype).kv
            self.odd = Linear(48, 64, dtype, axes=("embed", "mlp"))

    q = QuantConfig("mxfp8", (1, 32), ("model.layers.1.self_attn.v_proj",))
    with pytest.raises(QuantLayoutError) as e:
        nnx.eval_shape(lambda: quantize_linears(Both(jnp.bfloat16), q))
    msg = str(e.value)
    assert msg.startswith("2 layer(s) cannot take the checkpoint's quantization")
    assert "kv: cannot fuse MXFP8 and non-MXFP8 members along N" in msg
    assert "odd: MXFP8 needs in_features to be a multiple of 32, got 48" in msg


def test_fused_block_fp8_membership_follows_tensors():
    q = QuantConfig("fp8_block", (128, 128), by_tensors=True)
    names = {f"{m}.weight_scale_inv" for m, _ in MEMBERS[:3]}
    with pytest.raises(QuantLayoutError, match="cannot fuse members of different formats"):
        nnx.eval_shape(lambda: quantize_linears(KVFeatures(jnp.bfloat16), q, tensor_names=names))


@pytest.mark.parametrize("method,k,msg", [("mxfp8", 48, "MXFP8 needs in_features to be a multiple of 32, got 48"),
                                          ("nvfp4", 40, "NVFP4 needs in_features to be a multiple of 16, got 40")])
def test_k_not_divisible_by_the_block_names_the_layer(method, k, msg):
    with pytest.raises(QuantLayoutError, match=f"model.layers.0.mlp.down_proj: {msg}"):
        Linear(k, 64, jnp.bfloat16, axes=("embed", "mlp")).quantize_(method, name="model.layers.0.mlp.down_proj")
    fused = FusedLinear(k, [("model.layers.0.mlp.gate_proj", 64), ("model.layers.0.mlp.up_proj", 64)], jnp.bfloat16,
                        axes=("mlp", "embed"))
    with pytest.raises(QuantLayoutError, match=rf"model.layers.0.mlp.gate_up_proj \(model.layers.0.mlp.gate_proj, "
                                               rf"model.layers.0.mlp.up_proj\): {msg}"):
        fused.quantize_(method, name="model.layers.0.mlp.gate_up_proj")


def test_pallas_block_fp8_other_blocks_are_refused_when_declared():
    """A block-FP8 checkpoint with 64x64 blocks cannot run on the Pallas kernels: the layer says so
    by name when it is declared, before a weight is read; the XLA backend takes it."""
    with pytest.raises(QuantLayoutError, match=r"model.layers.0.mlp.up_proj: .*128x128 weight blocks.*\(64, 64\)"):
        Linear(128, 64, jnp.bfloat16, axes=("mlp", "embed")).quantize_(
            "fp8_block", block=(64, 64), backend="pallas", name="model.layers.0.mlp.up_proj")
    fused = FusedLinear(128, [("model.layers.0.mlp.gate_proj", 64), ("model.layers.0.mlp.up_proj", 64)],
                        jnp.bfloat16, axes=("mlp", "embed"))
    with pytest.raises(QuantLayoutError, match="gate_up_proj.*128x128 weight blocks"):
        fused.quantize_("fp8_block", block=(64, 64), backend="pallas", name="model.layers.0.mlp.gate_up_proj")
    Linear(128, 64, jnp.bfloat16, axes=("mlp", "embed")).quantize_("fp8_block", block=(64, 64), backend="xla")


class Layer(nnx.Module):
    """An MLP and an attention's projections under ``layers.0``, as the models declare them."""

    def __init__(self, dtype, intermediate=256, bias=False):
        from kk_jax.config import Qwen3Config
        from kk_jax.models.layers.mlp import SwiGLU
        from kk_jax.models.qwen3 import Qwen3Attention

        cfg = Qwen3Config(vocab_size=64, hidden_size=128, intermediate_size=intermediate, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=128, attention_bias=bias,
                          rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=256, tie_word_embeddings=True)
        self.layers = nnx.List([nnx.Dict(mlp=SwiGLU(128, intermediate, dtype),
                                         self_attn=Qwen3Attention(cfg, dtype))])


@pytest.mark.parametrize("method,intermediate,tp,fused", [
    (None, 256, 1, True), ("mxfp8", 256, 2, True), ("fp8_block", 256, 2, True),
    ("fp8_block", 64, 1, False),       # 64-row members: not whole 128-row blocks
    ("nvfp4", 256, 2, True),           # members keep their own global scales
])
def test_sibling_projections_fuse_when_one_matmul_can_hold_them(method, intermediate, tp, fused):
    from kk_jax.models.layers.linear import fuse_projections

    mesh = make_mesh(tp)
    qcfg = QuantConfig(method, {"fp8_block": (128, 128), "mxfp8": (1, 32), "nvfp4": (1, 16)}[method]) if method else None
    model = nnx.eval_shape(lambda: Layer(jnp.bfloat16, intermediate))
    done = fuse_projections(model, qcfg, mesh=mesh)
    quantize_linears(model, qcfg, mesh=mesh)
    mlp, attn = model.layers[0]["mlp"], model.layers[0]["self_attn"]
    if not fused:
        assert "layers.0.mlp.gate_up_proj" not in done and mlp.gate_proj is not None
        return
    assert done == ["layers.0.mlp.gate_up_proj", "layers.0.self_attn.qkv_proj"]
    assert mlp.gate_proj is None and mlp.up_proj is None and attn.q_proj is None
    assert mlp.gate_up_proj.members == (("layers.0.mlp.gate_proj", intermediate), ("layers.0.mlp.up_proj", intermediate))
    assert mlp.gate_up_proj.quant == method and mlp.gate_up_proj.shards == tp
    assert [n for n, _ in attn.qkv_proj.members] == [f"layers.0.self_attn.{p}_proj" for p in "qkv"]


def test_projections_with_bias_stay_separate():
    from kk_jax.models.layers.linear import fuse_projections

    model = nnx.eval_shape(lambda: Layer(jnp.bfloat16, bias=True))
    assert fuse_projections(model) == ["layers.0.mlp.gate_up_proj"]
    assert model.layers[0]["self_attn"].q_proj is not None


def test_fused_projection_computes_what_the_separate_ones_do():
    from kk_jax.models.layers.linear import fuse_projections, project
    from kk_jax.models.layers.mlp import SwiGLU

    separate = SwiGLU(128, 256, jnp.float32)
    rng = np.random.default_rng(7)
    for lin in (separate.gate_proj, separate.up_proj, separate.down_proj):
        lin.weight[...] = jnp.asarray(rng.standard_normal(lin.weight.shape) / 11, jnp.float32)
    fused = SwiGLU(128, 256, jnp.float32)
    fuse_projections(fused)
    fused.gate_up_proj.weight[...] = jnp.concatenate([separate.gate_proj.weight[...], separate.up_proj.weight[...]])
    fused.down_proj.weight[...] = separate.down_proj.weight[...]
    x = jnp.asarray(rng.standard_normal((3, 128)), jnp.float32)
    np.testing.assert_allclose(fused(x), separate(x), rtol=1e-6, atol=1e-6)
    gate, up = project(fused, "gate_up_proj", x)
    np.testing.assert_allclose(gate, separate.gate_proj(x), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(up, separate.up_proj(x), rtol=1e-6, atol=1e-6)


def dense_linear(n, k, axes, seed=0, dtype=jnp.bfloat16):
    lin = Linear(k, n, dtype, axes=axes)
    lin.weight.value = jnp.asarray(np.random.default_rng(seed).standard_normal((n, k)) / np.sqrt(k), dtype)
    return lin


def test_unquantized_layer_asks_xla_for_its_output_dtype():
    """Without a bias (or a row-parallel psum) a bf16 layer's product is a bf16 result, which XLA
    sums in fp32 and rounds once: bit for bit the fp32 result cast, without the cast's kernel
    (``pallas_kernels.common.product_dtype``); a bias keeps the fp32 result until it is added."""
    from pallas_kernels.common import product_dtype

    def dot_types(lin, x):
        eqns = jax.make_jaxpr(lambda x: lin(x))(x).jaxpr.eqns
        return [jnp.dtype(e.params["preferred_element_type"]).name for e in eqns if e.primitive.name == "dot_general"]

    lin = dense_linear(96, 160, ("heads", "embed"))
    x = jax.random.normal(jax.random.key(4), (7, 160), jnp.float32).astype(jnp.bfloat16)
    assert dot_types(lin, x) == ["bfloat16"] and dot_types(lin, x.astype(jnp.float32)) == ["float32"]
    want = jnp.einsum("mk,nk->mn", x, lin.weight[...], preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    assert np.array_equal(np.asarray(lin(x)), np.asarray(want))
    biased = Linear(160, 96, jnp.bfloat16, axes=("heads", "embed"), bias=True)
    assert dot_types(biased, x) == ["float32"]
    assert [product_dtype(t).name for t in (jnp.bfloat16, jnp.float32, jnp.float16)] == ["bfloat16", "float32", "float32"]


def test_dense_linear_decode_rows_run_the_weight_streaming_kernel(monkeypatch):
    """An unquantized linear on the pallas dense backend: a one-row bf16 input (batch-1 decode)
    goes through pallas_kernels.dense_matmul (Mosaic GPU interpreter here); more rows, float32
    inputs and shapes the kernel would have to pad stay on XLA's dot; all give the einsum's
    result."""
    import kk_jax.models.layers.linear as linear_mod

    calls = []
    real = linear_mod._kernel_call
    monkeypatch.setattr(linear_mod, "_kernel_call", lambda method, x2, ops, **kw: (
        calls.append((method, x2.shape)), real(method, x2, ops, **kw))[1])
    lin = dense_linear(128, 192, ("heads", "embed"))
    x = jax.random.normal(jax.random.key(3), (1, 1, 192), jnp.float32).astype(jnp.bfloat16)
    want = lin(x)                                              # xla backend: XLA's dot
    assert not calls
    lin.backend, lin.interpret = "pallas", True
    y = lin(x)
    assert calls == [(None, (1, 192))] and y.shape == (1, 1, 128) and y.dtype == jnp.bfloat16
    assert rel_err(y, want.astype(jnp.float32)) < 1e-2
    lin(jnp.zeros((2, 192), jnp.bfloat16))                    # more than one row: XLA
    lin(x.astype(jnp.float32))                                 # float32 activations: XLA
    odd = dense_linear(96, 192, ("heads", "embed"))            # 96 rows: not whole 64-row tiles
    odd.backend, odd.interpret = "pallas", True
    odd(x)
    assert len(calls) == 1


@pytest.mark.parametrize("axes", [("heads", "embed"), ("embed", "heads")], ids=["column", "row"])
def test_dense_kernel_path_per_shard_at_tp2(monkeypatch, axes):
    """At tp=2 the dense kernel runs per shard inside jax.shard_map (the per-shard kernel replaced
    by its jnp twin, as in the quantized test above); a shard holding a partial tile (N or K / 2
    not a multiple of 64) stays on XLA."""
    import kk_jax.models.layers.linear as linear_mod

    seen = []
    real = linear_mod._kernel_call

    def twin(method, x2, ops, **kw):
        seen.append((method, x2.shape, ops[0].shape))
        return real(method, x2, ops, **{**kw, "backend": "xla", "interpret": False})

    monkeypatch.setattr(linear_mod, "_kernel_call", twin)
    mesh = make_mesh(2)
    lin = dense_linear(256, 256, axes, seed=4)
    quantize_linears(lin, None, dense_backend="pallas", mesh=mesh)
    assert (lin.backend, lin.mesh) == ("pallas", mesh)
    lin.weight.value = jax.device_put(lin.weight.value, NamedSharding(mesh, spec(axes)))
    x = jax.random.normal(jax.random.key(5), (1, 256), jnp.float32).astype(jnp.bfloat16)
    y = jax.jit(lambda x: lin(x))(x)
    local = (128, 256) if axes[0] == "heads" else (256, 128)
    assert seen == [(None, (1, local[1]), local)]
    want = np.asarray(x, np.float64) @ np.asarray(lin.weight.value, np.float64).T
    assert rel_err(y, want) < 1e-2
    f32 = dense_linear(256, 256, axes, dtype=jnp.float32)     # float32 weights: XLA
    quantize_linears(f32, None, dense_backend="pallas", mesh=mesh)
    f32(jnp.ones((1, 256)))
    small = dense_linear(64, 64, axes)                         # 32 per shard: XLA
    quantize_linears(small, None, dense_backend="pallas", mesh=mesh)
    small(jnp.ones((1, 64), jnp.bfloat16))
    assert len(seen) == 1


def test_prepare_linears_gives_unquantized_linears_the_dense_backend():
    """The engine's dense_decode_backend reaches plain and fused unquantized linears (with the
    mesh); quantized ones keep the kernel backend."""
    from kk_jax.models.qwen3 import Qwen3ForCausalLM
    from kk_jax.config import Qwen3Config

    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6,
                      rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=True)
    mesh = make_mesh(1)
    model = nnx.eval_shape(lambda: prepare_linears(Qwen3ForCausalLM(cfg, jnp.bfloat16), None, backend="pallas",
                                                   mesh=mesh, dense_backend="xla"))
    kinds = {type(m).__name__: (m.backend, m.mesh) for _, m in nnx.iter_modules(model)
             if isinstance(m, (Linear, FusedLinear))}
    assert kinds == {"Linear": ("xla", mesh), "FusedLinear": ("xla", mesh)}
    model = nnx.eval_shape(lambda: prepare_linears(Qwen3ForCausalLM(cfg, jnp.bfloat16), None, mesh=mesh,
                                                   dense_backend="pallas"))
    assert {m.backend for _, m in nnx.iter_modules(model) if isinstance(m, (Linear, FusedLinear))} == {"pallas"}


@pytest.mark.parametrize("method", ["fp8_block", "mxfp8"])
def test_bf16_layer_takes_its_output_from_the_kernel(monkeypatch, method):
    """A bf16 layer without a bias asks the kernel for its bf16 output (one rounding of the fp32
    accumulator, as the cast of an fp32 result); with a bias it keeps the fp32 output. Such bf16
    MXFP8 / block-FP8 calls stay on the kernel (its warp-specialized prefill form on a GPU) below
    8192 rows (bf16 NVFP4 at every row count); fp32 outputs go to XLA's dot from 3072 (NVFP4
    from 4096)."""
    import kk_jax.models.layers.linear as linear_mod

    seen = []
    real = linear_mod._kernel_call
    monkeypatch.setattr(linear_mod, "_kernel_call", lambda method, x2, ops, **kw: (
        seen.append(jnp.dtype(kw["out_dtype"]).name), real(method, x2, ops, **kw))[1])
    lin = quantized_linear(method, 64, 128, ("heads", "embed"), backend="pallas", interpret=True)
    x = jax.random.normal(jax.random.key(2), (5, 128), jnp.float32).astype(jnp.bfloat16)
    y = lin(x)
    w = lin.dense_weight(jnp.bfloat16 if method == "fp8_block" else jnp.float32)
    want = qo.matmul(np.asarray(x.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))
    assert seen == ["bfloat16"] and y.dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(y), np.asarray(jnp.asarray(want, jnp.float32).astype(jnp.bfloat16)))
    biased = Linear(128, 64, jnp.float32, axes=("heads", "embed"), bias=True)
    biased.quantize_(method, backend="pallas", interpret=True)
    biased(x)
    assert seen[-1] == "float32"
    rows = linear_mod.kernel_max_rows
    assert rows(method, jnp.bfloat16) == 8192 and rows(method, jnp.float32) == 3072
    assert rows("nvfp4", jnp.bfloat16) == math.inf and rows("nvfp4", jnp.float32) == 4096


@pytest.mark.parametrize("method", [None, "fp8_block", "mxfp8", "nvfp4"])
def test_one_row_fuses_norm_and_residual_into_the_gemv(method, monkeypatch):
    """A decode row on the pallas backend: the layer's RMSNorm and the residual add run inside
    the one-row GEMV (Mosaic GPU interpreter here) and give what the separate ops give; more
    rows keep the separate ops."""
    from kk_jax.models.layers.norm import RMSNorm
    from pallas_kernels import row_gemv

    n, k = 512, 1024
    lin = (dense_linear(n, k, ("heads", "embed"), seed=4) if method is None
           else quantized_linear(method, n, k, ("heads", "embed"), seed=4))
    rng = np.random.default_rng(5)
    norm = RMSNorm(k, 1e-6, jnp.bfloat16)
    norm.weight.value = jnp.asarray(1 + rng.standard_normal(k) / 10, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((1, 1, k)) * 3, jnp.bfloat16)
    r = jnp.asarray(rng.standard_normal((1, 1, n)), jnp.bfloat16)
    want = r + lin(norm(x))                                     # xla backend: separate ops
    calls, real = [], row_gemv.gemv
    monkeypatch.setattr(row_gemv, "gemv", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    lin.backend, lin.interpret = "pallas", True
    got = lin(x, norm=norm, residual=r)
    assert len(calls) == 1 and calls[0]["norm_weight"] is not None and calls[0]["residual"] is not None
    assert got.dtype == jnp.bfloat16 and got.shape == (1, 1, n) and rel_err(got, want) < 4e-3
    x2 = jnp.concatenate([x, x], axis=1)
    assert rel_err(lin(x2, norm=norm, residual=jnp.concatenate([r, r], axis=1))[:, :1], want) < 4e-3
    assert len(calls) == 1


def gate_up_linear(method, n, k, seed=0):
    """A [gate; up] FusedLinear of two n-row members, each quantized on its own (NVFP4: its own
    global scale), as the loader would fill it."""
    rng = np.random.default_rng(seed)
    ws = [rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k) * (1 + i) for i in range(2)]
    lin = FusedLinear(k, [("gate_proj", n), ("up_proj", n)], jnp.bfloat16, axes=("mlp", "embed"))
    if method is None:
        lin.weight.value = jnp.asarray(np.concatenate(ws), jnp.bfloat16)
        return lin
    lin.quantize_(method)
    for i, sfx in enumerate(SUFFIXES[method]):
        parts = [np.asarray(QUANTIZE[method](w)[i]) for w in ws]
        value = np.stack(parts) if parts[0].ndim == 0 else np.concatenate(parts)
        getattr(lin, sfx).value = jnp.asarray(value.T if sfx == "weight_scale" else value)
    return lin


@pytest.mark.parametrize("method", [None, "fp8_block", "mxfp8", "nvfp4"])
def test_one_row_fuses_swiglu_into_the_gate_up_gemv(method, monkeypatch):
    """A fused [gate; up] projection at one decode row runs one GEMV that normalises x and
    returns silu(gate) * up; it matches SiLU·mul (in fp32) of the split output of the separate
    ops, and more rows take those ops."""
    from kk_jax.models.layers.norm import RMSNorm
    from pallas_kernels import row_gemv

    n, k = 256, 1024
    lin = gate_up_linear(method, n, k, seed=6)
    rng = np.random.default_rng(8)
    norm = RMSNorm(k, 1e-6, jnp.bfloat16)
    norm.weight.value = jnp.asarray(1 + rng.standard_normal(k) / 10, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((1, 1, k)) * 3, jnp.bfloat16)
    gate, up = lin.split(lin(norm(x)))                                  # xla backend: separate ops
    separate = jax.nn.silu(gate) * up
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    want = gate * jax.nn.sigmoid(gate) * up
    calls, real = [], row_gemv.gemv
    monkeypatch.setattr(row_gemv, "gemv", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    lin.backend, lin.interpret = "pallas", True
    got = lin.swiglu(x, norm=norm)
    assert len(calls) == 1 and calls[0]["glu"] and calls[0]["norm_weight"] is not None
    assert got.dtype == jnp.bfloat16 and got.shape == (1, 1, n) and rel_err(got, want) < 4e-3
    x2 = jnp.concatenate([x, x], axis=1)
    assert rel_err(lin.swiglu(x2, norm=norm)[:, :1], separate) < 4e-3
    assert len(calls) == 1


def test_swiglu_gemv_runs_per_shard_on_the_interleaved_gate_up(monkeypatch):
    """tp = 2, MXFP8 [gate; up] held per shard as [gate_0; up_0; gate_1; up_1]: each shard's GEMV
    takes its own gate and up rows and returns its half of silu(gate) * up, which concatenates
    to the whole. The per-shard GEMV is a jnp twin here (the Mosaic GPU interpreter is not safe
    on two CPU devices at once)."""
    import types

    import kk_jax.models.layers.linear as linear_mod
    from kk_jax.models.layers.norm import RMSNorm, rms_norm
    from pallas_kernels import mxfp8 as mxfp8_kernels
    from pallas_kernels.row_gemv import silu_times

    seen = []

    def twin(x, w, s, *, out_dtype, interpret, norm_weight, eps, glu):
        seen.append((w.shape, glu))
        y = mxfp8_kernels.matmul(rms_norm(x, norm_weight, eps), w, s, backend="xla", out_dtype=out_dtype)
        return silu_times(y[:, :y.shape[1] // 2], y[:, y.shape[1] // 2:])

    monkeypatch.setattr(linear_mod, "_gemv_module", lambda method: types.SimpleNamespace(
        supported=lambda m, n, k: True, gemv=twin))
    mesh, n, k = make_mesh(2), 256, 1024
    rng = np.random.default_rng(10)
    ws = [rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k) for _ in range(2)]
    lin = FusedLinear(k, [("gate_proj", n), ("up_proj", n)], jnp.bfloat16, axes=("mlp", "embed"))
    lin.quantize_("mxfp8", backend="pallas", mesh=mesh)
    for i, sfx in enumerate(SUFFIXES["mxfp8"]):
        halves = [np.split(np.asarray(mxfp8.quantize(w)[i]), 2) for w in ws]     # [member][shard]
        value = np.concatenate([halves[m][sh] for sh in range(2) for m in range(2)])
        param = getattr(lin, sfx)
        param.value = jax.device_put(jnp.asarray(value.T if sfx == "weight_scale" else value),
                                     NamedSharding(mesh, spec(param.get_metadata()["axes"])))
    norm = RMSNorm(k, 1e-6, jnp.bfloat16)
    norm.weight.value = jnp.asarray(1 + rng.standard_normal(k) / 10, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((1, k)), jnp.bfloat16)
    got = jax.jit(lambda x: lin.swiglu(x, norm=norm))(x)
    assert seen and seen[0] == ((n, k), True)                          # a shard: n / 2 gate + n / 2 up rows
    lin.backend = "xla"
    gate, up = lin.split(lin(norm(x)))
    assert got.shape == (1, n) and rel_err(got, silu_times(gate, up)) < 4e-3


def _fused_nvfp4(k, members, rng):
    """An NVFP4 FusedLinear of random members, member i's weights scaled by 4^i (so their global
    scales differ), loaded as a checkpoint would be."""
    ws = [rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k) * 4 ** i for i, (_, n) in enumerate(members)]
    lin = FusedLinear(k, members, jnp.bfloat16, axes=("heads", "embed"))
    lin.quantize_("nvfp4")
    for i, sfx in enumerate(SUFFIXES["nvfp4"]):
        parts = [np.asarray(nvfp4.quantize(w)[i]) for w in ws]
        value = np.stack(parts) if parts[0].ndim == 0 else np.concatenate(parts)
        getattr(lin, sfx).value = jnp.asarray(value.T if sfx == "weight_scale" else value)
    return lin


def test_fused_nvfp4_members_keep_their_global_scales_in_the_gemv(monkeypatch):
    """q / k / v-like NVFP4 members with different global scales, fused: at one decode row the
    GEMV applies each member's scale to its rows (and the norm) and rounds once, as the
    separate ops do; a two-row input takes them."""
    from kk_jax.models.layers.norm import RMSNorm
    from pallas_kernels import row_gemv

    k, members = 1024, [("q_proj", 256), ("k_proj", 64), ("v_proj", 64)]
    rng = np.random.default_rng(9)
    lin = _fused_nvfp4(k, members, rng)
    norm = RMSNorm(k, 1e-6, jnp.bfloat16)
    norm.weight.value = jnp.asarray(1 + rng.standard_normal(k) / 10, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((1, 1, k)) * 3, jnp.bfloat16)
    want = lin(norm(x))                                                  # xla backend
    calls, real = [], row_gemv.gemv
    monkeypatch.setattr(row_gemv, "gemv", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    lin.backend, lin.interpret = "pallas", True
    got = lin(x, norm=norm)
    assert len(calls) == 1 and calls[0]["segments"] == (256, 64, 64)
    for g, w_ in zip(lin.split(got), lin.split(want)):                   # each member at its own scale
        assert rel_err(g, w_) < 4e-3
    assert rel_err(lin(jnp.concatenate([x, x], axis=1), norm=norm)[:, :1], want) < 4e-3 and len(calls) == 1


def test_fused_nvfp4_members_off_the_16_row_items_take_the_norm_outside():
    """Members of 24 and 8 rows (NVFP4's one-row GEMV scales whole 16-row items): the norm is
    not fused, the layer still computes what the unfused ops do."""
    from kk_jax.models.layers.linear import gemv_fuses
    from kk_jax.models.layers.norm import RMSNorm

    k, members = 512, [("k_proj", 24), ("v_proj", 8)]
    rng = np.random.default_rng(3)
    lin = _fused_nvfp4(k, members, rng)
    norm = RMSNorm(k, 1e-6, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((1, k)), jnp.bfloat16)
    want = lin(norm(x))                                                  # xla backend
    lin.backend, lin.interpret = "pallas", True
    assert not gemv_fuses(lin, x, norm, None)
    assert rel_err(lin(x, norm=norm), want) < 4e-3


def test_fused_norm_and_residual_run_per_shard_inside_shard_map(monkeypatch):
    """tp = 2, column-parallel MXFP8: each shard's GEMV sees the whole x and norm weight and its
    own half of the residual. The per-shard GEMV is replaced by a jnp twin here (the Mosaic GPU
    interpreter is not safe on two CPU devices at once)."""
    import types

    import kk_jax.models.layers.linear as linear_mod
    from kk_jax.models.layers.norm import RMSNorm, rms_norm
    from pallas_kernels import mxfp8 as mxfp8_kernels

    seen = []

    def twin(x, w, s, *, out_dtype, interpret, norm_weight=None, eps=None, residual=None):
        seen.append((x.shape, w.shape, norm_weight.shape, residual.shape))
        y = mxfp8_kernels.matmul(rms_norm(x, norm_weight, eps), w, s, backend="xla", out_dtype=out_dtype)
        return residual + y

    monkeypatch.setattr(linear_mod, "_gemv_module", lambda method: types.SimpleNamespace(
        supported=lambda m, n, k: True, gemv=twin))
    mesh = make_mesh(2)
    lin = quantized_linear("mxfp8", 512, 1024, ("heads", "embed"), seed=2, backend="pallas", mesh=mesh)
    for sfx in SUFFIXES["mxfp8"]:
        v = getattr(lin, sfx)
        v.value = jax.device_put(v.value, NamedSharding(mesh, spec(v.get_metadata()["axes"])))
    rng = np.random.default_rng(3)
    norm = RMSNorm(1024, 1e-6, jnp.bfloat16)
    norm.weight.value = jnp.asarray(1 + rng.standard_normal(1024) / 10, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((1, 1024)), jnp.bfloat16)
    r = jnp.asarray(rng.standard_normal((1, 512)), jnp.bfloat16)
    got = jax.jit(lambda x, r: lin(x, norm=norm, residual=r))(x, r)
    assert seen and seen[0] == ((1, 1024), (256, 1024), (1024,), (1, 256))
    lin.backend = "xla"
    assert rel_err(got, r + lin(norm(x))) < 4e-3
