"""The OpenAI tools API end to end, with the real `openai` client against a live server.

The tiny model's output is SCRIPTED: a test-only wrapper around the server's
``ModelRunner.prefill`` / ``ModelRunner.decode`` lets the model run as usual and then replaces
the sampled tokens of requests whose ``seed`` has a registered script with the script's tokens
(the wanted text encoded by the tiny tokenizer, then EOS). Requests without a scripted seed are
untouched. So the server's own path — prompt building with tools, detokenization, tool-call
parsing, SSE deltas, finish reasons — sees exactly the model output a tool-calling model would
produce. The DS4.1 prompt and DSML parser are exercised by swapping the tokenizer's chat encoder
(there is no tiny DS4.1 checkpoint to load); GLM-5.3 runs on its own tiny checkpoint in
test_tools_glm.py.
"""

import json

import httpx
import pytest
from openai import OpenAI
from conftest import LiveServer, wait_pages_free
from tool_script import Script

from kk_jax.chat.encoders import DeepseekV41ChatEncoder

FLAGS = ["--max-model-len", "2048", "--max-num-seqs", "1", "--max-num-batched-tokens", "32", "--decode-steps", "8",
         "--served-model-name", "tiny", "--log-level", "warning"]

LOOKUP = {"type": "function", "namespace": {"name": "inventory", "description": "Warehouse tools."},
          "function": {"name": "lookup", "description": "Find a SKU.",
                       "parameters": {"type": "object", "properties": {"sku": {"type": "string"},
                                                                       "n": {"type": "integer"}}}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "Where is X1?"}]
HERMES = '<tool_call>\n{"name": "inventory::lookup", "arguments": {"sku": "X1", "n": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    srv = LiveServer(["--model", str(tiny_ckpt)] + FLAGS)
    srv.script = Script(srv.engine.engine)
    srv.tok = srv.engine.engine.tokenizer
    yield srv
    srv.script.remove()
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def encoder(server):
    """Swaps the served tokenizer's chat encoder for one test."""
    original = server.tok.chat_encoder

    def use(enc):
        server.tok.chat_encoder = enc
    yield use
    server.tok.chat_encoder = original


def n_prompt(server, messages, tools=None, suffix="", **kwargs):
    text = server.tok.apply_chat_template(messages, tools=tools, **kwargs)
    return len(server.tok.encode(text + suffix))


def chat(client, seed, **kwargs):
    return client.chat.completions.create(model="tiny", max_tokens=240, temperature=0, seed=seed, **kwargs)


def streamed(client, seed, **kwargs):
    chunks = list(chat(client, seed, stream=True, stream_options={"include_usage": True}, **kwargs))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return content, calls, finish, chunks[-1].usage


# ------------------------------------------------------------------ tool calls come back
def test_auto_tool_call(client, server):
    seed = server.script.set(101, HERMES)
    r = chat(client, seed, messages=ASK, tools=[LOOKUP, WEATHER])
    msg, choice = r.choices[0].message, r.choices[0]
    assert choice.finish_reason == "tool_calls" and msg.content is None
    (call,) = msg.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "inventory::lookup" and json.loads(call.function.arguments) == {"sku": "X1", "n": 2}
    assert r.usage.prompt_tokens == n_prompt(server, ASK, [LOOKUP, WEATHER])      # tools are in the prompt
    assert r.usage.prompt_tokens > n_prompt(server, ASK) + 100
    # control: the same output with tool_choice 'none' is plain content, and the tools are not rendered
    r2 = chat(client, seed, messages=ASK, tools=[LOOKUP, WEATHER], tool_choice="none")
    assert r2.choices[0].message.content == HERMES and not r2.choices[0].message.tool_calls
    assert r2.choices[0].finish_reason == "stop" and r2.usage.prompt_tokens == n_prompt(server, ASK)
    assert wait_pages_free(server.engine)


def test_streaming_tool_call_deltas(client, server):
    seed = server.script.set(102, "Checking the shelf.\n" + HERMES)
    content, calls, finish, usage = streamed(client, seed, messages=ASK, tools=[LOOKUP])
    assert content == "Checking the shelf." and finish == ["tool_calls"]
    (call,) = calls
    assert call.index == 0 and call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "inventory::lookup" and json.loads(call.function.arguments) == {"sku": "X1", "n": 2}
    whole = chat(client, seed, messages=ASK, tools=[LOOKUP])
    assert whole.choices[0].message.content == "Checking the shelf."
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_parallel_calls_and_parallel_tool_calls_false(client, server):
    two = HERMES + "\n" + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    seed = server.script.set(103, two)
    r = chat(client, seed, messages=ASK, tools=[LOOKUP, WEATHER])
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["inventory::lookup", "get_weather"]
    assert len({c.id for c in r.choices[0].message.tool_calls}) == 2
    _, calls, finish, _ = streamed(client, seed, messages=ASK, tools=[LOOKUP, WEATHER])
    assert [(c.index, c.function.name) for c in calls] == [(0, "inventory::lookup"), (1, "get_weather")]
    one = chat(client, seed, messages=ASK, tools=[LOOKUP, WEATHER], parallel_tool_calls=False)
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["inventory::lookup"]
    _, calls, finish, _ = streamed(client, seed, messages=ASK, tools=[LOOKUP, WEATHER], parallel_tool_calls=False)
    assert [c.function.name for c in calls] == ["inventory::lookup"] and finish == ["tool_calls"]


def test_each_choice_is_parsed_on_its_own(client, server):
    """n=2: choice 0 (seed) calls a tool, choice 1 (seed + 1) answers in text."""
    server.script.set(120, HERMES)
    server.script.set(121, "No tool needed.")
    r = chat(client, 120, messages=ASK, tools=[LOOKUP], n=2)
    assert [c.finish_reason for c in r.choices] == ["tool_calls", "stop"]
    assert r.choices[0].message.tool_calls[0].function.name == "inventory::lookup"
    assert r.choices[1].message.content == "No tool needed." and not r.choices[1].message.tool_calls
    chunks = list(chat(client, 120, messages=ASK, tools=[LOOKUP], n=2, stream=True))
    by = {0: [], 1: []}
    for c in chunks:
        by[c.choices[0].index].append(c.choices[0])
    assert [tc.function.name for ch in by[0] for tc in (ch.delta.tool_calls or [])] == ["inventory::lookup"]
    assert "".join(ch.delta.content or "" for ch in by[1]) == "No tool needed."
    assert [ch.finish_reason for ch in by[0] + by[1] if ch.finish_reason] == ["tool_calls", "stop"]


def test_history_with_tool_calls_and_results(client, server):
    history = ASK + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "lookup", "namespace": "inventory", "arguments": '{"sku": "X1"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "aisle 3"}]
    seed = server.script.set(104, "It is in aisle 3.")
    r = chat(client, seed, messages=history, tools=[LOOKUP])
    assert r.choices[0].message.content == "It is in aisle 3." and r.choices[0].finish_reason == "stop"
    assert not r.choices[0].message.tool_calls
    qualified = json.loads(json.dumps(history))
    qualified[1]["tool_calls"][0]["function"] = {"name": "inventory::lookup", "arguments": '{"sku": "X1"}'}
    assert r.usage.prompt_tokens == n_prompt(server, qualified, [LOOKUP])
    text = server.tok.apply_chat_template(qualified, tools=[LOOKUP])
    assert '{"name": "inventory::lookup", "arguments": {"sku": "X1"}}' in text and "aisle 3" in text


def test_named_and_required_tool_choice_prefill_the_call(client, server):
    enc = server.tok.chat_encoder
    prompt = server.tok.apply_chat_template(ASK, tools=[LOOKUP, WEATHER])
    seed = server.script.set(105, '{"sku": "X9"}}\n</tool_call>')          # the model continues the opened call
    named = {"type": "function", "function": {"name": "lookup", "namespace": "inventory"}}
    r = chat(client, seed, messages=ASK, tools=[LOOKUP, WEATHER], tool_choice=named)
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("inventory::lookup", {"sku": "X9"})
    suffix, _ = enc.forced_call_prefix(prompt, "inventory::lookup")
    assert r.usage.prompt_tokens == len(server.tok.encode(prompt + suffix))
    _, calls, finish, _ = streamed(client, seed, messages=ASK, tools=[LOOKUP, WEATHER], tool_choice=named)
    assert [c.function.name for c in calls] == ["inventory::lookup"] and finish == ["tool_calls"]

    seed = server.script.set(106, '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    r = chat(client, seed, messages=ASK, tools=[LOOKUP, WEATHER], tool_choice="required")
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]


def test_malformed_call_is_content(client, server):
    bad = '<tool_call>\n{"name": "inventory::lookup", "arguments": {"sku": }\n</tool_call>'
    seed = server.script.set(107, bad)
    r = chat(client, seed, messages=ASK, tools=[LOOKUP])
    assert r.choices[0].message.content == bad and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    content, calls, finish, _ = streamed(client, seed, messages=ASK, tools=[LOOKUP])
    assert (content, calls, finish) == (bad, [], ["stop"])


# ------------------------------------------------------------------ DS4.1 encoder
def test_ds41_latest_reminder_and_dsml_calls(client, server, encoder):
    encoder(DeepseekV41ChatEncoder())
    msgs = ASK + [{"role": "latest_reminder", "content": "Answer with a tool call."}]
    dsml = ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="inventory::lookup">\n'
            '<｜DSML｜ parameter name="sku" string="true">X1</｜DSML｜ parameter>\n'
            '<｜DSML｜ parameter name="n" string="false">2</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')
    seed = server.script.set(108, "Reasoning.</think>On it." + dsml)
    r = chat(client, seed, messages=msgs, tools=[LOOKUP], extra_body={"reasoning_effort": "low"})
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("inventory::lookup", {"sku": "X1", "n": 2})
    assert r.choices[0].message.content == "Reasoning.</think>On it." and r.choices[0].finish_reason == "tool_calls"
    text = server.tok.apply_chat_template(msgs, tools=[LOOKUP], reasoning_effort="low")
    assert text.endswith("<｜Assistant｜><think><｜latest_reminder｜>Answer with a tool call.")
    assert "Reasoning Effort: 50" in text and '"name": "inventory::lookup"' in text
    assert r.usage.prompt_tokens == len(server.tok.encode(text))
    _, calls, finish, _ = streamed(client, seed, messages=msgs, tools=[LOOKUP], extra_body={"reasoning_effort": "low"})
    assert [c.function.name for c in calls] == ["inventory::lookup"] and finish == ["tool_calls"]


# ------------------------------------------------------------------ rejected requests
def post(server, body):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        return c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 4, **body})


BAD = [
    ("latest_reminder on a non-DS4.1 model", {"messages": ASK + [{"role": "latest_reminder", "content": "R"}]},
     "role 'latest_reminder' is not supported by this model", "messages.1.role"),
    ("namespace with separator", {"messages": ASK, "tools": [{**LOOKUP, "namespace": "a::b"}]}, "without '::'",
     "tools"),
    ("conflicting namespaces", {"messages": ASK, "tools": [{"type": "function", "namespace": "a",
                                                            "function": {"name": "f", "namespace": "b"}}]},
     "conflicting tool namespaces", "tools"),
    ("schema not an object", {"messages": ASK, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "array"}}}]}, "type must be 'object'", "tools"),
    ("tool without function", {"messages": ASK, "tools": [{"type": "function"}]}, "function must be an object",
     "tools"),
    ("unknown named tool", {"messages": ASK, "tools": [WEATHER],
                            "tool_choice": {"type": "function", "function": {"name": "lookup"}}},
     "not in `tools`", "tool_choice"),
    ("required without tools", {"messages": ASK, "tool_choice": "required"}, "needs a non-empty `tools`",
     "tool_choice"),
    ("bad tool_choice", {"messages": ASK, "tools": [WEATHER], "tool_choice": "always"}, "not supported",
     "tool_choice"),
    ("tool message without id", {"messages": ASK + [{"role": "tool", "content": "x"}]}, "tool_call_id",
     "messages.1.tool_call_id"),
    ("history arguments not JSON", {"messages": ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, "not valid JSON",
     "messages.1.tool_calls"),
    ("history namespace mismatch", {"messages": ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "namespace": "a", "function": {"name": "b::f", "arguments": "{}"}}]}]},
     "qualified with namespace 'b'", "messages.1.tool_calls"),
]


@pytest.mark.parametrize("name,body,fragment,param", BAD, ids=[b[0] for b in BAD])
def test_rejected_with_reason(server, name, body, fragment, param):
    r = post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["param"] == param and err["type"] == "BadRequestError", err
    ok = post(server, {"messages": ASK})                       # nothing else changed: the server still serves
    assert ok.status_code == 200
    assert wait_pages_free(server.engine)


def test_latest_reminder_accepted_for_ds41(server, encoder):
    body = {"messages": ASK + [{"role": "latest_reminder", "content": "R"}]}
    assert post(server, body).status_code == 400                # control: refused by the Qwen3 template
    encoder(DeepseekV41ChatEncoder())
    r = post(server, body)
    assert r.status_code == 200, r.text
    bad = post(server, {**body, "reasoning_effort": "medium"})
    assert bad.status_code == 400 and "reasoning_effort" in bad.json()["error"]["message"]
