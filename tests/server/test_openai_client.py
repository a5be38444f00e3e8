"""The real `openai` client against a live server: results, streaming format, usage, stops."""

import pytest
from openai import OpenAI
from conftest import wait_pages_free

from kk_jax import LLM, SamplingParams

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather like?"}]


@pytest.fixture(scope="module")
def client(live):
    return OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, decode_steps=4,
               progress=False)


def test_models(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny"]


def test_chat_greedy_matches_llm_and_streaming(client, llm, live):
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=20, temperature=0)
    want = llm.chat(MSGS, SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert r.choices[0].message.content == want.text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == want.finish_reason
    n_prompt = len(llm.tokenizer.encode(llm.tokenizer.apply_chat_template(MSGS)))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, len(want.token_ids))
    assert r.usage.total_tokens == n_prompt + len(want.token_ids)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")

    chunks = list(client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [want.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert chunks[-1].usage.prompt_tokens == n_prompt
    assert wait_pages_free(live.engine)


def test_completions_text_ids_list_echo_and_n(client, llm):
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0)
    want = llm.generate("Once upon a time", SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert r.choices[0].text == want.text and r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)

    ids = want.prompt_token_ids
    r2 = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0, echo=True)
    assert r2.choices[0].text == "Once upon a time" + want.text

    r3 = client.completions.create(model="tiny", prompt=["Once upon a time", "Hello"], max_tokens=5,
                                   temperature=0.8, n=2, seed=3)
    assert [c.index for c in r3.choices] == [0, 1, 2, 3]
    hello = len(llm.tokenizer.encode("Hello"))
    assert r3.usage.prompt_tokens == len(want.prompt_token_ids) + hello          # each prompt once, not once per n
    assert r3.choices[0].text.startswith(llm.generate("Once upon a time", SamplingParams(
        max_tokens=5, temperature=0.8, seed=3))[0].text)

    streamed = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12,
                                              temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == want.text
    assert streamed[-1].choices[0].finish_reason == want.finish_reason


def test_logprobs(client):
    r = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4 and all(len(t) <= 3 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text or len(r.choices[0].text) <= len("".join(lp.tokens))
    c = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob, abs=1e-5)
    assert c.usage.prompt_tokens == client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=4, temperature=0, n=3).usage.prompt_tokens


def test_streamed_logprobs_match_non_streamed(client):
    """Every generated token's logprob reaches the stream, also where its text is held back (a
    stop string's prefix, a partial character) or empty (the final EOS)."""
    base = client.completions.create(model="tiny", prompt="The weather", max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[len(base) // 2: len(base) // 2 + 2] + "\x00never"         # a prefix held back, never matched
    kw = dict(model="tiny", prompt="The weather", max_tokens=30, temperature=0, logprobs=1, stop=[stop])
    whole = client.completions.create(**kw).choices[0].logprobs.token_logprobs
    streamed = [x for c in client.completions.create(stream=True, **kw) if c.choices[0].logprobs
                for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(whole) and len(whole) == 30
    kw = dict(model="tiny", messages=MSGS, max_tokens=40, temperature=0, logprobs=True)
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [t for c in client.chat.completions.create(stream=True, **kw) if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in whole]


def test_stop_strings_are_not_emitted(client):
    base = client.completions.create(model="tiny", prompt="The weather", max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[len(base) // 2: len(base) // 2 + 2]
    assert stop.strip()
    r = client.completions.create(model="tiny", prompt="The weather", max_tokens=30, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == base[: base.index(stop)] and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="The weather", max_tokens=30, temperature=0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == base[: base.index(stop)]
