"""Qwen3 in JAX against the independent NumPy oracle (float32)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles import qwen3_numpy as oracle

from kk_jax import LLM, SamplingParams
from kk_jax.models.attention.paged import AttentionBatch


def full_logits(llm: LLM, ids: list[int]) -> np.ndarray:
    """Logits at every position of ``ids`` from one prefill over fresh pages."""
    runner = llm.engine.runner
    ps = runner.cfg.page_size
    table = np.zeros((1, runner.max_pages_per_seq), np.int32)
    n_pages = math.ceil(len(ids) / ps)
    table[0, :n_pages] = np.arange(1, n_pages + 1)
    t = len(ids)
    batch = AttentionBatch(jnp.arange(t, dtype=jnp.int32)[None], jnp.ones((1, t), bool), jnp.asarray(table),
                           jnp.array([t], jnp.int32), jnp.zeros((1,), jnp.int32))

    def fwd(weights, pools, tokens, batch):
        model = runner._model(weights)
        h, _ = model(tokens, batch, pools, runner.ops)
        return model.logits(h)

    pools = jax.tree.map(jnp.copy, runner.pools)
    return np.asarray(jax.jit(fwd)(runner.weights, pools, jnp.asarray([ids], jnp.int32), batch))[0]


@pytest.fixture(scope="module", params=["tied", "untied"])
def case(request, tiny_ckpt, tiny_ckpt_untied):
    ckpt = tiny_ckpt if request.param == "tied" else tiny_ckpt_untied
    llm = LLM(ckpt, dtype="float32", max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32,
              decode_steps=8, progress=False)
    cfg, w = oracle.load(ckpt)
    return llm, cfg, w


def test_logits_match_numpy_oracle(case):
    llm, cfg, w = case
    ids = [int(x) for x in np.random.default_rng(0).integers(0, cfg["vocab_size"], 40)]
    got = full_logits(llm, ids)
    want = oracle.logits(cfg, w, ids)
    rel = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert rel < 1e-4, rel


def test_greedy_32_steps_match_numpy_oracle(case):
    llm, cfg, w = case
    prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    out = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == oracle.greedy(cfg, w, prompt, 32)
    assert len(set(out.token_ids)) > 3        # the random model does not collapse into one token
