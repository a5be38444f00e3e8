"""tp = 1, 2, 4 on four CPU devices give identical greedy tokens (float32)."""

import pytest

from kk_jax import LLM, SamplingParams


@pytest.fixture(scope="module")
def ckpt4(tmp_path_factory):
    from checkpoints.make_tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-tp4"), arch="qwen3", seed=3, dtype="float32",
                     num_heads=8, num_kv_heads=4, head_dim=8)


def test_greedy_tokens_identical_across_tp(ckpt4):
    prompts = [[1, 2, 3, 4, 5], list(range(10, 50)), [7]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    results = {}
    for tp in (1, 2, 4):
        llm = LLM(ckpt4, tp=tp, dtype="float32", max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32,
                  progress=False)
        results[tp] = [o.token_ids for o in llm.generate(prompts, params)]
    assert results[1] == results[2] == results[4]
    assert all(len(t) == 24 for t in results[1])
