"""GLM-5.3 on the engine: transformers parity (recorded fixture), chunking invariance, slot
isolation, tensor parallelism (float32, CPU)."""

import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kk_jax import LLM, SamplingParams
from kk_jax.config import ConfigError, EngineConfig
from kk_jax.engine.core import LLMEngine
from kk_jax.models.attention.paged import AttentionBatch

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "glm5_hf_greedy.json").read_text())
LIMITS = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, decode_steps=4,
              progress=False)
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from checkpoints.make_tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("glm5"), **FIXTURE["checkpoint"])


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, **LIMITS)


def test_greedy_tokens_equal_transformers(llm):
    """Tokens recorded from transformers' Glm5NextForConditionalGeneration on this exact checkpoint
    (benchmarks/parity_hf_glm5.py); prompts longer than index_topk so selection is sparse."""
    outs = llm.generate(FIXTURE["prompts"], SamplingParams(max_tokens=FIXTURE["steps"], **GREEDY))
    assert [o.token_ids for o in outs] == FIXTURE["tokens"]


def chunked_logits(llm, ids, chunk):
    """Logits at every position, feeding ``ids`` through the model ``chunk`` tokens at a time
    (chunk 1 = the decode path) on fresh pages and a fresh slot."""
    r = llm.engine.runner
    ps = r.cfg.page_size
    table = np.zeros((1, r.max_pages_per_seq), np.int32)
    table[0, : math.ceil(len(ids) / ps)] = np.arange(1, math.ceil(len(ids) / ps) + 1)

    @jax.jit
    def step(weights, pools, tokens, positions, kv_len):
        model = r._model(weights)
        batch = AttentionBatch(positions, jnp.ones(tokens.shape, bool), jnp.asarray(table), kv_len,
                               jnp.ones((1,), jnp.int32))
        h, pools = model(tokens, batch, pools, r.ops)
        return pools, model.logits(h)

    pools = jax.tree.map(jnp.zeros_like, r.pools)
    out = []
    for s in range(0, len(ids), chunk):
        part = ids[s:s + chunk]
        pools, lg = step(r.weights, pools, jnp.asarray([part], jnp.int32),
                         jnp.arange(s, s + len(part), dtype=jnp.int32)[None], jnp.array([s + len(part)], jnp.int32))
        out.append(np.asarray(lg[0]))
    return np.concatenate(out)


def test_prefill_then_decode_equals_longer_prefill(llm):
    ids = [int(x) for x in np.random.default_rng(0).integers(0, 1000, 42)]      # 6 chunks of 7
    full = chunked_logits(llm, ids, 64)
    for chunk in (1, 7):
        got = chunked_logits(llm, ids, chunk)
        rel = np.max(np.abs(got - full)) / np.max(np.abs(full))
        assert rel < 1e-4, (chunk, rel)
        assert (got.argmax(-1) == full.argmax(-1)).all()


def test_query_blocks_change_nothing(llm, monkeypatch):
    """A prefill chunk's DSA attention runs in query blocks sized to a byte budget; one query per
    block gives the logits of one block for all."""
    from kk_jax.models.attention import mla_sparse

    ids = [int(x) for x in np.random.default_rng(1).integers(0, 1000, 42)]
    whole = chunked_logits(llm, ids, 64)
    monkeypatch.setattr(mla_sparse, "BLOCK_BYTES", 200)
    assert mla_sparse.query_block(2, 42, 10) == 7                 # largest divisor of 42 <= 200 // 20
    assert mla_sparse.query_block(1, 42, 10**6) == 1
    blocked = chunked_logits(llm, ids, 64)
    np.testing.assert_allclose(blocked, whole, rtol=1e-5, atol=1e-5 * np.max(np.abs(whole)))


def test_twenty_interleaved_requests_are_isolated(llm):
    rng = random.Random(3)
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(1, 40))] for _ in range(20)]
    params = [SamplingParams(max_tokens=rng.randint(1, 20), **GREEDY) for _ in prompts]
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    assert together == alone
    engine = llm.engine
    assert engine.pages.num_free == engine.pages.capacity and engine.slots.num_free == engine.config.max_num_seqs


def test_greedy_tokens_identical_across_tp(ckpt, llm):
    prompts = FIXTURE["prompts"][:2]
    params = SamplingParams(max_tokens=12, **GREEDY)
    want = [o.token_ids for o in llm.generate(prompts, params)]
    for tp in (2, 4):
        other = LLM(ckpt, tp=tp, **{**LIMITS, "max_num_seqs": 2, "max_num_batched_tokens": 16})
        assert [o.token_ids for o in other.generate(prompts, params)] == want, tp


def test_inconsistent_step_is_rejected_and_pools_stay_bit_identical(llm):
    from kk_jax.engine.runner import DecodeRow, PrefillRow, StepError

    r = llm.engine.runner
    before = {n: np.asarray(a).copy() for n, a in r.pools.items()}
    greedy = SamplingParams(max_tokens=4, **GREEDY)
    bad_steps = [
        [PrefillRow(list(range(1, 40)), 0, [1], 1, greedy, 0, 0)],             # pages missing for 39 tokens
        [PrefillRow([1, 2], 0, [1], 0, greedy, 0, 0)],                          # no state slot for a KDA model
        [PrefillRow([1, 2], 0, [1], 1, greedy, 0, 0), PrefillRow([3], 0, [1], 2, greedy, 0, 0)],   # shared page
        [DecodeRow(5, 15, [2], 1, 4, [], greedy, 0, 0)],                        # decode runs past its page
        [DecodeRow(5, 3, [0], 1, 1, [], greedy, 0, 0)],                         # the dummy page as a real page
    ]
    for rows in bad_steps:
        with pytest.raises(StepError, match="rejected before touching the cache"):
            (r.prefill if isinstance(rows[0], PrefillRow) else r.decode)(rows)
    for n, a in r.pools.items():
        np.testing.assert_array_equal(np.asarray(a), before[n])


def test_fp8_cache_stays_close_to_the_exact_cache(ckpt, llm):
    """--kv-cache-dtype fp8: e4m3 latent + Hadamard-rotated e4m3 index keys with pow2 scales."""
    ids = [int(x) for x in np.random.default_rng(0).integers(0, 1000, 42)]
    exact = chunked_logits(llm, ids, 64)
    fp8 = LLM(ckpt, kv_cache_dtype="fp8", **{**LIMITS, "max_num_seqs": 2, "max_num_batched_tokens": 16})
    assert fp8.engine.runner.pools["layers.3.latent"].dtype == jnp.float8_e4m3fn
    got = chunked_logits(fp8, ids, 64)
    # mean error, not max: a small score change can flip which pool the indexer selects at one
    # position, a discrete jump that even a bf16 cache shows (measured: mean |d| 0.6% of the
    # logit std for bf16, 1.3% for fp8 on this model)
    err = np.mean(np.abs(got - exact)) / np.std(exact)
    assert 0 < err < 0.03, err
    assert np.mean(got.argmax(-1) == exact.argmax(-1)) >= 0.9


def test_bfloat16_model_runs_on_the_xla_backend_close_to_float32(tmp_path):
    """A bf16 GLM on the CPU (xla backend): every product, the DSA attention's included, must
    lower there (XLA:CPU has no bf16 x bf16 -> f32 batched dot), and the logits stay close to
    the float32 model's. Dense MLPs and a dense DSA budget keep the comparison continuous: with
    this random tiny router, bf16 rounding flips near-tied expert choices (measured 14-17 % mean
    |d| / std with MoE layers, against 3.2 % without; Qwen3 of the same depth: 1.5 %)."""
    from checkpoints.make_tiny import make_tiny

    ckpt = make_tiny(tmp_path / "dense", arch="glm5_next", seed=2, dtype="float32", num_layers=4,
                     first_dense_layers=4, index_topk=1024)
    config = EngineConfig(max_model_len=128, max_num_seqs=1, max_num_batched_tokens=16)
    # engines without the bucket warm-up: chunked_logits compiles the one program it runs
    model = lambda dtype: SimpleNamespace(engine=LLMEngine(ckpt, dtype=dtype, config=config, progress=False,
                                                           warmup=False))
    ids = [int(x) for x in np.random.default_rng(1).integers(0, 500, 24)]
    exact = chunked_logits(model("float32"), ids, 64)
    got = chunked_logits(model("bfloat16"), ids, 64)
    err = np.mean(np.abs(got - exact)) / np.std(exact)
    assert 0 < err < 0.06, err
    assert np.mean(got.argmax(-1) == exact.argmax(-1)) >= 0.9


def test_kda_backend_is_fixed_per_engine_and_checked(ckpt, llm):
    """--kda-backend: auto follows the kernel backend (xla on this CPU); pallas is refused without
    a GPU before anything is loaded; unknown names are a config error."""
    assert (llm.engine.runner.backend, llm.engine.runner.ops.kda_backend) == ("xla", "xla")
    with pytest.raises(ConfigError, match="kda_backend 'pallas' .* needs an NVIDIA GPU"):
        LLM(ckpt, kda_backend="pallas", **LIMITS)
    with pytest.raises(ConfigError, match="kda_backend must be auto, pallas or xla, got 'triton'"):
        LLM(ckpt, kda_backend="triton", **LIMITS)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the refusal on a machine without a GPU")
def test_dense_decode_backend_is_checked(ckpt, llm):
    """--dense-decode-backend: auto resolves to xla without a GPU; pallas is refused there
    before loading."""
    assert llm.engine.runner.dense_backend == "xla"
    with pytest.raises(ConfigError, match="dense_decode_backend 'pallas' .* needs an NVIDIA GPU"):
        LLM(ckpt, dense_decode_backend="pallas", **LIMITS)
    with pytest.raises(ConfigError, match="dense_decode_backend must be auto, pallas or xla, got 'triton'"):
        LLM(ckpt, dense_decode_backend="triton", **LIMITS)


def test_scanned_layer_groups_equal_unrolled_layers(tmp_path):
    """Nine layers (a dense KDA layer, then two groups of KDA, KDA, DSA, KDA with MoE): the
    repeating groups run as one scan over stacked weights and stacked pools (fp8 cache, so the
    index-key scales are stacked too); logits (prefill and decode paths) and greedy tokens
    equal those of every layer unrolled."""
    from checkpoints.make_tiny import make_tiny
    from kk_jax.cache.pools import PagedSpec

    ckpt = make_tiny(tmp_path, arch="glm5_next", dtype="float32", seed=5, num_layers=9, first_dense_layers=1)
    limits = {**LIMITS, "max_num_seqs": 1, "max_num_batched_tokens": 16, "kv_cache_dtype": "fp8"}
    scanned, unrolled = LLM(ckpt, **limits), LLM(ckpt, scan_layers=False, **limits)
    layout = scanned.engine.runner.layout
    assert layout["layers.3.latent"] == PagedSpec((32,), jnp.float8_e4m3fn, (None,), stack=2)   # layers 3 and 7
    assert layout["layers.3.index_k_scale"].stack == 2
    assert [layout[f"layers.{i}.state"].stack for i in (0, 1, 2, 4)] == [1, 2, 2, 2]
    assert not any(n.startswith(tuple(f"layers.{i}." for i in range(5, 9))) for n in layout)
    ids = [int(x) for x in np.random.default_rng(2).integers(0, 1000, 32)]   # whole 16-token chunks: one shape
    for chunk in (1, 16):
        want, got = chunked_logits(unrolled, ids, chunk), chunked_logits(scanned, ids, chunk)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.max(np.abs(want)))
    params = SamplingParams(max_tokens=10, **GREEDY)
    assert scanned.generate(FIXTURE["prompts"][1], params)[0].token_ids == \
        unrolled.generate(FIXTURE["prompts"][1], params)[0].token_ids


def test_random_weights_take_the_models_stacked_shapes(tmp_path):
    """Benchmarks draw random weights directly in the model's own shapes (stacked experts, then
    stacked layer groups), without per-expert tensors; the runner then decodes with them."""
    from checkpoints.make_tiny import make_tiny
    from kk_jax.config import Glm5NextConfig
    from kk_jax.engine.runner import DecodeRow, ModelRunner
    from kk_jax.models.glm5_next import Glm5NextForConditionalGeneration
    from kk_jax.parallel.mesh import make_mesh

    ckpt = make_tiny(tmp_path, arch="glm5_next", dtype="float32", seed=5, num_layers=9, first_dense_layers=1)
    cfg = Glm5NextConfig.from_hf(json.loads((ckpt / "config.json").read_text()))
    ecfg = EngineConfig(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, page_size=16, num_pages=9,
                        decode_steps=2)
    r = ModelRunner(Glm5NextForConditionalGeneration, cfg, None, jnp.float32, ecfg, make_mesh(1), progress=False,
                    random_weights_seed=0)
    model = r._model(r.weights)
    experts = model.model.language_model.layers[1].mlp.experts.gate_proj
    assert experts.shape == (2, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
    assert model.model.language_model.layers[5] is None
    norm = model.model.language_model.layers[1].input_layernorm.weight[...]       # stacked [2, hidden]
    assert norm.shape == (2, cfg.hidden_size) and bool(jnp.all(norm == 1))
    row = DecodeRow(token=3, position=0, pages=[1], slot=1, budget=2, stop_ids=[], params=SamplingParams(max_tokens=2),
                    seed=0, token_index=0)
    assert len(r.decode([row])[0].tokens) == 2
