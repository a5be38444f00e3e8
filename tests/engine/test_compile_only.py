"""ModelRunner programs: a compile-only runner lowers and compiles its steps without weights or pools
on a device; the decode program for greedy batches decodes what the general one does."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kk_jax.config import EngineConfig, Qwen3Config
from kk_jax.engine.request import SamplingParams
from kk_jax.engine.runner import DecodeRow, ModelRunner, StepError
from kk_jax.models.qwen3 import Qwen3ForCausalLM
from kk_jax.parallel.mesh import make_mesh

CFG = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                  rope_theta=1e4, max_position_embeddings=512, tie_word_embeddings=False)
ECFG = EngineConfig(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=16, page_size=16, num_pages=20,
                    decode_steps=2)


def runner(**kw):
    return ModelRunner(Qwen3ForCausalLM, CFG, None, jnp.float32, ECFG, make_mesh(1), progress=False, **kw)


def program(r) -> str:
    """The compiled decode step's HLO without source locations (they name the caller's lines)."""
    text = r._compile("decode", 1, ECFG.decode_steps).as_text()
    return re.sub(r", metadata=\{[^}]*\}", "", text.split("\n\nFileNames")[0])


def test_compile_only_runner_allocates_nothing_and_compiles_the_same_step():
    abstract, real = runner(compile_only=True), runner(random_weights_seed=0)
    assert not any(isinstance(w, jax.Array) for w in abstract.weights)
    assert not any(isinstance(p, jax.Array) for p in abstract.pools.values())
    assert abstract.weight_bytes == real.weight_bytes
    assert [(w.shape, w.dtype, w.sharding) for w in abstract.weights] == \
           [(w.shape, w.dtype, w.sharding) for w in real.weights]
    assert {n: (p.shape, p.dtype) for n, p in abstract.pools.items()} == \
           {n: (p.shape, p.dtype) for n, p in real.pools.items()}
    assert program(abstract) == program(real)
    row = DecodeRow(token=1, position=3, pages=[1], slot=0, budget=2, stop_ids=[],
                    params=SamplingParams(max_tokens=2, temperature=0.0), seed=0, token_index=0)
    with pytest.raises(RuntimeError, match="compile-only"):
        abstract.decode([row])
    assert len(real.decode([row])[0].tokens) == 2


@pytest.mark.parametrize("params, kind", [
    ([SamplingParams(max_tokens=8, temperature=0.0)] * 2, "decode_greedy"),
    ([SamplingParams(max_tokens=8, temperature=0.9, seed=3), SamplingParams(max_tokens=8, temperature=0.0)],
     "decode_draw"),
    ([SamplingParams(max_tokens=8, temperature=0.9, top_p=0.8, seed=3), SamplingParams(max_tokens=8, temperature=1.0)],
     "decode_draw_filtered"),
    ([SamplingParams(max_tokens=8, temperature=0.9, logprobs=2)] * 2, "decode"),
])
def test_branch_free_programs_decode_what_the_general_one_does(params, kind):
    """Off by default on the CPU; forced on, a batch runs the program of its `draw_mode` (the
    general one when a row asks for top logprobs) and gets the general program's tokens and
    logprobs (6 steps; rows with budgets 6 and 3)."""
    ecfg = dataclasses.replace(ECFG, decode_steps=6)
    outs = {}
    for mode in ("off", "on"):
        r = ModelRunner(Qwen3ForCausalLM, CFG, None, jnp.float32, dataclasses.replace(ecfg, sampler_programs=mode),
                        make_mesh(1), progress=False, random_weights_seed=0)
        assert r.decode_programs == (("decode",) if mode == "off" else
                                     ("decode", "decode_greedy", "decode_draw", "decode_draw_filtered"))
        rows = [DecodeRow(token=5 + i, position=0, pages=[1 + i], slot=0, budget=budget, stop_ids=[], params=p,
                          seed=11 + i, token_index=0) for i, (budget, p) in enumerate(zip((6, 3), params))]
        outs[mode] = r.decode(rows)
        assert list(r._compiled) == [(kind if mode == "on" else "decode", 2, 6)]
    assert [len(o.tokens) for o in outs["on"]] == [6, 3]
    assert [o.tokens for o in outs["on"]] == [o.tokens for o in outs["off"]]
    for a, b in zip(outs["on"], outs["off"]):
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-6)
        assert a.top_ids == b.top_ids


def test_tail_program_decodes_what_the_full_one_does():
    """Off by default on the CPU; forced on, a call whose rows all have at most 4 tokens left runs
    the 4-step program and gets the tokens and logprobs the 6-step one gives; a call with more
    left runs the 6-step one."""
    ecfg = dataclasses.replace(ECFG, decode_steps=6)
    sampled = SamplingParams(max_tokens=8, temperature=0.8, top_k=5)
    outs = {}
    for mode in ("off", "on"):
        r = ModelRunner(Qwen3ForCausalLM, CFG, None, jnp.float32, dataclasses.replace(ecfg, decode_tail_program=mode),
                        make_mesh(1), progress=False, random_weights_seed=0)
        assert r.decode_step_counts == ((6,) if mode == "off" else (4, 6))
        rows = [DecodeRow(token=5 + i, position=0, pages=[1 + i], slot=0, budget=budget, stop_ids=[],
                          params=sampled, seed=3, token_index=0) for i, budget in enumerate((4, 2))]
        outs[mode] = r.decode(rows)
        assert list(r._compiled) == [("decode", 2, 4 if mode == "on" else 6)]
    assert [len(o.tokens) for o in outs["on"]] == [4, 2]
    assert [o.tokens for o in outs["on"]] == [o.tokens for o in outs["off"]]
    for a, b in zip(outs["on"], outs["off"]):
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-6)
    row = DecodeRow(token=5, position=4, pages=[1], slot=0, budget=5, stop_ids=[], params=sampled, seed=3,
                    token_index=4)
    assert len(r.decode([row])[0].tokens) == 5
    assert ("decode", 1, 6) in r._compiled


def test_a_chained_call_continues_any_rows_of_the_call_before():
    """A call whose rows continue rows 2 and 0 of a 3-row call (in that order; row 1 ended) runs in
    that call's batch bucket and decodes what a call given those rows' last tokens by the host
    does (greedy, 3 steps each)."""
    r = ModelRunner(Qwen3ForCausalLM, CFG, None, jnp.float32, dataclasses.replace(ECFG, max_num_seqs=4, decode_steps=3),
                    make_mesh(1), progress=False, random_weights_seed=0)
    greedy = SamplingParams(max_tokens=100, temperature=0.0)

    def row(i, token, position, follows=None):
        return DecodeRow(token=token, position=position, pages=[1 + 2 * i, 2 + 2 * i], slot=0, budget=3, stop_ids=[],
                         params=greedy, seed=0, token_index=position, follows=follows)

    first = r.decode_start([row(i, 5 + i, 0) for i in range(3)])
    ahead = r.decode_start([row(2, None, 3, follows=2), row(0, None, 3, follows=0)], after=first)
    assert ahead.batch == first.batch == 4
    head, chained = first.result(), ahead.result()
    again = r.decode([row(2, head[2].tokens[-1], 3), row(0, head[0].tokens[-1], 3)])
    assert [s.tokens for s in chained] == [s.tokens for s in again]
    for bad in (3, -1):
        with pytest.raises(StepError, match="row index"):
            r.decode_start([row(0, None, 3, follows=bad)], after=first)
