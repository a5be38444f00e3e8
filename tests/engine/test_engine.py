"""Engine behaviour: compile-once, donation, preemption, batch invariance, stops, aborts, errors."""

import dataclasses
import os
import random

import jax
import pytest

from kk_jax import LLM, SamplingParams
from kk_jax.engine.request import RequestError

LIMITS = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, decode_steps=6,
              progress=False)
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt, **LIMITS)


def random_requests(n, vocab, seed):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 60))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(1, 30), **GREEDY) for _ in range(n)]
    return prompts, params


def test_warmup_compiles_every_bucket_and_nothing_after(llm):
    report = llm.engine.warmup_report
    kinds = {(k, b, t) for k, b, t, _ in report}
    assert ("decode", 8, 6) in kinds and ("prefill", 1, 64) in kinds and ("prefill", 4, 16) in kinds
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: compiles.append(name) if name.endswith("backend_compile_duration") else None)
    rng = random.Random(7)
    prompts, _ = random_requests(12, llm.engine.model_config.vocab_size, seed=3)
    params = [SamplingParams(max_tokens=rng.randint(1, 40), temperature=rng.choice([0.0, 0.7, 1.0]),
                             top_k=rng.choice([-1, 5]), top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.1]),
                             logprobs=rng.choice([None, 2]), seed=rng.choice([None, 5]))
              for _ in prompts]
    n_before = len(compiles)
    llm.generate(prompts, params)
    assert compiles[n_before:] == []


def test_step_donates_the_cache_pools(llm):
    engine = llm.engine
    before = dict(engine.runner.pools)
    engine.add_request("donate", [1, 2, 3], SamplingParams(max_tokens=2, **GREEDY))
    while engine.has_unfinished():
        engine.step()
    assert all(a.is_deleted() for a in before.values())


def test_fifty_concurrent_requests_match_each_run_alone(llm):
    prompts, params = random_requests(50, llm.engine.model_config.vocab_size, seed=11)
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    assert together == alone
    assert [len(t) for t in together] == [p.max_tokens for p in params]
    assert llm.engine.pages.num_free == llm.engine.pages.capacity


def test_preempted_requests_give_the_same_greedy_tokens(tiny_ckpt, llm):
    prompts, _ = random_requests(6, llm.engine.model_config.vocab_size, seed=5)
    params = SamplingParams(max_tokens=40, **GREEDY)
    small = LLM(tiny_ckpt, num_pages=12, **LIMITS)          # 11 pages of 16 tokens for 6 x ~4 pages
    got = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in llm.generate(prompts, params)]
    assert small.engine.pages.num_free == small.engine.pages.capacity


def test_chunked_prefill_of_long_prompt_matches_short_budget(tiny_ckpt, llm):
    prompt = list(range(3, 100))                               # 97 tokens > the 64-token budget
    out = llm.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0]
    assert len(out.token_ids) == 8


def test_abort_frees_pages_immediately(llm):
    engine = llm.engine
    for i in range(5):
        engine.add_request(f"abort-{i}", list(range(1, 30)), SamplingParams(max_tokens=50, **GREEDY))
    engine.step()
    engine.step()
    assert engine.pages.num_free < engine.pages.capacity
    outs = [engine.abort(f"abort-{i}") for i in range(5)]
    assert all(o.finish_reason == "abort" and o.finished for o in outs)
    assert engine.pages.num_free == engine.pages.capacity and not engine.has_unfinished()


def test_interrupted_generate_leaves_nothing_behind(llm, monkeypatch):
    """An error or Ctrl-C inside ``generate`` aborts that call's requests; the next call works."""
    real, calls = llm.engine.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real()

    monkeypatch.setattr(llm.engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["Hello", "World"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    monkeypatch.undo()
    st = llm.engine.stats()
    assert st["running"] == 0 and st["waiting"] == 0 and st["pages_free"] == st["pages_total"]
    out = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out) == 1 and out[0].finished


def test_stop_strings_are_honoured_and_not_emitted(llm):
    prompt = "Hello, how are you today?"
    base = llm.generate(prompt, SamplingParams(max_tokens=30, **GREEDY))[0]
    text = base.text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), text
    out = llm.generate(prompt, SamplingParams(max_tokens=30, stop=[stop], **GREEDY))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert stop not in out.text


def test_stop_token_ids_and_eos(llm):
    base = llm.generate([5, 6, 7], SamplingParams(max_tokens=20, **GREEDY))[0]
    stop_tok = base.token_ids[6]
    out = llm.generate([5, 6, 7], SamplingParams(max_tokens=20, stop_token_ids=[stop_tok], **GREEDY))[0]
    first = base.token_ids.index(stop_tok)
    assert out.token_ids == base.token_ids[: first + 1] and out.finish_reason == "stop"
    assert base.finish_reason == "length"


def test_logprobs_are_reported(llm):
    out = llm.generate([1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and lp.logprob <= 0 and len(lp.top) == 3
        assert max(lp.top, key=lp.top.get) == tok                  # greedy = the top-1 alternative
        assert abs(lp.top[tok] - lp.logprob) < 1e-5


def test_seeded_sampling_is_independent_of_batch(llm):
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = llm.generate([[4, 5, 6]], p)[0].token_ids
    noise = [SamplingParams(max_tokens=15, temperature=1.0, ignore_eos=True)] * 3
    mixed = llm.generate([[9, 9], [4, 5, 6], [1], [2, 3]], [noise[0], p, noise[1], noise[2]])
    assert mixed[1].token_ids == alone
    other = llm.generate([[4, 5, 6]], SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=99,
                                                      ignore_eos=True))[0].token_ids
    assert other != alone


@pytest.mark.parametrize("prompt,params,match", [
    (list(range(1, 200)), SamplingParams(max_tokens=1), "maximum context length is 128"),
    (list(range(1, 100)), SamplingParams(max_tokens=50), "set max_tokens <= 29"),
    ([], SamplingParams(), "prompt is empty"),
    ([10 ** 6], SamplingParams(), "outside the vocabulary"),
])
def test_bad_requests_are_rejected_and_engine_keeps_running(llm, prompt, params, match):
    free = llm.engine.pages.num_free
    with pytest.raises(RequestError, match=match):
        llm.generate([prompt], params)
    assert llm.engine.pages.num_free == free and not llm.engine.has_unfinished()
    assert len(llm.generate([[1, 2]], SamplingParams(max_tokens=3, **GREEDY))[0].token_ids) == 3


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens must be at least 1"),
    (dict(temperature=-0.5), "temperature must be non-negative"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-2), "top_k must be -1"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(logprobs=21), "logprobs must be between 0 and 20"),
    (dict(stop=[""]), "stop strings must be non-empty"),
])
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(RequestError, match=match):
        SamplingParams(**kwargs)


def test_gpu_memory_utilization_is_a_share_of_the_whole_gpu(monkeypatch):
    """--gpu-memory-utilization 0.9 means 90 % of the GPU, as in vLLM: the allocator is told so
    (unless the user set its fraction) and the page budget is not shrunk by JAX's 75 % default twice."""
    from kk_jax.engine.runner import claim_device_memory, memory_budget

    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "")            # restored (or removed) afterwards
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    assert memory_budget(75, 0.9) == 75                        # default allocator: 75 % of a 100-byte GPU
    claim_device_memory(0.9)
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9"
    assert memory_budget(90, 0.9) == 90
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")      # the user's own fraction wins
    claim_device_memory(0.5)
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.95"
    assert abs(memory_budget(95, 0.5) - 50) < 1e-9


def test_kernel_backend_follows_what_the_kernels_take(tiny_ckpt, llm):
    """The tiny model's head_dim (16) is below what the Pallas attention kernels take: auto runs
    the jnp kernels (on a GPU too), an explicit pallas is refused before loading, naming the size."""
    from kk_jax.config import ConfigError

    assert llm.engine.runner.backend == "xla"
    with pytest.raises(ConfigError, match=r"kernel_backend 'pallas': .* head_dim 16 .* \(use auto or xla\)"):
        LLM(tiny_ckpt, kernel_backend="pallas", **LIMITS)


def mixed_requests(vocab: int, seed: int):
    """Greedy and seeded sampled requests with stop ids, stop strings, logprobs and lengths
    from 1 to 40 tokens."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(12)]
    params = [SamplingParams(max_tokens=rng.randint(1, 40), temperature=rng.choice([0.0, 0.8]), top_k=rng.choice([-1, 5]),
                             seed=i, logprobs=rng.choice([None, 2]), stop_token_ids=rng.choice([[], [7, 11]]),
                             stop=rng.choice([[], ["e", "a "]]), ignore_eos=True) for i in range(12)]
    return prompts, params


def test_pipelined_decode_gives_what_one_call_at_a_time_gives(llm):
    """With the next decode call dispatched before the current one's tokens are read, every
    request gets the tokens, text and finish reason it gets with one call at a time (logprobs
    to float32 rounding: the calls' batch buckets differ), the chained calls really ran, and
    every page comes back."""
    engine = llm.engine
    chained = []
    start = engine.runner.decode_start
    engine.runner.decode_start = lambda rows, after=None: (chained.append(after is not None), start(rows, after))[1]
    prompts, params = mixed_requests(engine.model_config.vocab_size, seed=11)
    runs = {}
    try:
        for pipeline in (False, True):
            engine.config = dataclasses.replace(engine.config, pipeline_decode=pipeline)
            chained.clear()
            runs[pipeline] = llm.generate(prompts, params)
            assert any(chained) == pipeline
    finally:
        del engine.runner.decode_start
        engine.config = dataclasses.replace(engine.config, pipeline_decode=True)
    for a, b in zip(runs[True], runs[False]):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert [lp.token_id for lp in a.logprobs or []] == [lp.token_id for lp in b.logprobs or []]
        assert [lp.logprob for lp in a.logprobs or []] == pytest.approx([lp.logprob for lp in b.logprobs or []],
                                                                        rel=1e-5, abs=1e-6)
    assert {o.finish_reason for o in runs[True]} >= {"stop", "length"}
    assert engine.pages.num_free == engine.pages.capacity


def test_abort_while_a_call_is_ahead(llm):
    """An aborted request's row in the call dispatched ahead is dropped; the others go on and
    match a run without the abort."""
    engine = llm.engine
    p = SamplingParams(max_tokens=30, **GREEDY)
    alone = llm.generate([[3, 4, 5]], p)[0].token_ids
    engine.add_request("ahead-0", [3, 4, 5], p)
    engine.add_request("ahead-1", [8, 9], p)
    while engine._ahead is None:
        engine.step()
    out = engine.abort("ahead-1")
    assert out.finish_reason == "abort"
    final = {}
    while engine.has_unfinished():
        for o in engine.step():
            final[o.request_id] = o
    assert set(final) == {"ahead-0"} and final["ahead-0"].token_ids == alone
    assert engine.pages.num_free == engine.pages.capacity


def test_a_row_the_device_stops_and_the_host_does_not_goes_on(llm):
    """If the host goes on with a row the device stopped (its stop id hidden from the host
    here), the call dispatched ahead ran that row masked; the engine reads it, stops chaining
    and decodes the row from the host's state, so the request still ends by length."""
    engine = llm.engine
    base = llm.generate([5, 6, 7], SamplingParams(max_tokens=20, **GREEDY))[0].token_ids
    stop = base[9]
    start = engine.runner.decode_start

    def hide_stop(rows, after=None):
        call = start(rows, after)
        result = call.result
        call.result = lambda: [dataclasses.replace(s, tokens=[t if t != stop else stop + 1 for t in s.tokens])
                               for s in result()]
        return call

    engine.runner.decode_start = hide_stop
    try:
        engine.add_request("hidden-stop", [5, 6, 7], SamplingParams(max_tokens=20, stop_token_ids=[stop], **GREEDY))
        outs = []
        for _ in range(40):
            outs += engine.step()
            if not engine.has_unfinished():
                break
    finally:
        del engine.runner.decode_start
    assert outs[-1].finished and outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 20
    assert engine.pages.num_free == engine.pages.capacity


def test_a_finished_batch_leaves_no_call_ahead_and_the_rest_chains_again(llm):
    """A call dispatched ahead whose rows all ended is read and dropped at the next step, so a
    new request is scheduled at once; and rows that end at a stop id or their length do not keep
    the remaining rows from chaining: a row whose length ends with a call is left out of the
    next, and a row the host ended is left out of the one after, as long as the rest keeps the
    batch bucket (else a fresh call of the smaller bucket)."""
    engine = llm.engine
    base = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=30, **GREEDY))[0].token_ids
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=30, stop_token_ids=[base[8]], **GREEDY))  # stops in call 2
    assert engine._ahead is not None and not engine.has_unfinished()
    engine.add_request("late", [1, 2, 3], SamplingParams(max_tokens=3, **GREEDY))
    assert engine.step() and engine.num_waiting == 0 and engine._ahead is None
    while engine.has_unfinished():
        engine.step()

    rng = random.Random(0)
    while True:                                      # A's 4th token is new: a stop id on it stops A there
        prompt = [rng.randrange(engine.model_config.vocab_size) for _ in range(8)]
        toks = llm.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0].token_ids
        if toks[3] not in toks[:3]:
            break
    calls = []
    start = engine.runner.decode_start
    engine.runner.decode_start = lambda rows, after=None: (calls.append(after is not None), start(rows, after))[1]
    try:
        engine.add_request("A", prompt, SamplingParams(max_tokens=30, stop_token_ids=[toks[3]], **GREEDY))
        engine.add_request("B", [4, 4], SamplingParams(max_tokens=7, **GREEDY))   # its last call is the first
        engine.add_request("C", [8, 8], SamplingParams(max_tokens=30, **GREEDY))
        engine.add_request("D", [9, 9], SamplingParams(max_tokens=30, **GREEDY))
        per_step = []
        while engine.has_unfinished():
            n = len(calls)
            engine.step()
            per_step.append(calls[n:])
    finally:
        del engine.runner.decode_start
    # prefill; A-D, then A, C and D chained (B ends; bucket 4); A stopped at its id, so C and D
    # (bucket 2) are read and run as a fresh call, then chained
    assert per_step[:4] == [[], [False, True], [], [False, True]]
    assert engine.pages.num_free == engine.pages.capacity


def test_a_waiting_request_is_admitted_before_chaining_past_an_end(llm):
    """With every sequence slot taken and a request waiting, a row whose length ends with the
    current call does not let the next call be dispatched ahead: the next step admits the waiting
    request into the freed slot."""
    engine = llm.engine
    engine.config = dataclasses.replace(engine.config, max_num_seqs=2)
    engine.scheduler.max_num_seqs = 2
    try:
        engine.add_request("short", [4, 4], SamplingParams(max_tokens=4, **GREEDY))     # ends in its first call
        engine.add_request("long", [8, 8], SamplingParams(max_tokens=30, **GREEDY))
        engine.add_request("waiting", [9, 9], SamplingParams(max_tokens=3, **GREEDY))
        engine.step()                                                  # prefill of short and long
        assert engine.num_waiting == 1
        engine.step()                                                  # their decode call; short ends
        assert engine._ahead is None and engine.num_waiting == 1
        engine.step()                                                  # the waiting request is prefilled
        assert engine.num_waiting == 0
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.config = dataclasses.replace(engine.config, max_num_seqs=8)
        engine.scheduler.max_num_seqs = 8
    assert engine.pages.num_free == engine.pages.capacity
