"""Tool calling on a tiny GLM-5.3 checkpoint: the chat template shipped in the checkpoint
(``tokenizer_config.json``) renders the tools, and GLM ``<tool_call>`` output comes back as
OpenAI tool calls through the real `openai` client.

The model output is SCRIPTED (``tool_script.Script``: the engine's sampled tokens are replaced
for requests with a registered seed); the script ends with ``<|observation|>``, one of GLM's
end-of-turn ids, as a tool-calling GLM turn does.
"""

import json

import pytest
from openai import OpenAI
from conftest import LiveServer
from tool_script import Script

from kk_jax.chat.encoders import TemplateChatEncoder

FLAGS = ["--max-model-len", "1024", "--max-num-seqs", "1", "--max-num-batched-tokens", "32", "--decode-steps", "8",
         "--served-model-name", "tiny-glm", "--log-level", "warning"]
LOOKUP = {"type": "function", "namespace": "inventory",
          "function": {"name": "lookup", "description": "Find a SKU.",
                       "parameters": {"type": "object", "properties": {"sku": {"type": "string"},
                                                                       "n": {"type": "integer"}}}}}
ASK = [{"role": "user", "content": "Where is 42?"}]
CALL = "<tool_call>inventory::lookup<arg_key>sku</arg_key><arg_value>42</arg_value><arg_key>n</arg_key>" \
       "<arg_value>2</arg_value></tool_call>"


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    from checkpoints.make_tiny import make_tiny

    ckpt = make_tiny(tmp_path_factory.mktemp("tiny-glm"), arch="glm5_next", seed=0, dtype="float32", num_layers=4,
                     first_dense_layers=1, mtp=False)     # the smallest layout with every layer kind
    srv = LiveServer(["--model", str(ckpt)] + FLAGS)
    srv.script = Script(srv.engine.engine)
    srv.tok = srv.engine.engine.tokenizer
    srv.observation = srv.tok.encode("<|observation|>")[0]
    yield srv
    srv.script.remove()
    srv.stop()


def test_glm_checkpoint_template_and_tool_calls(glm):
    enc = glm.tok.chat_encoder
    assert isinstance(enc, TemplateChatEncoder) and (enc.name, enc.tool_format) == ("glm5", "glm")
    assert glm.observation in glm.engine.engine.eos_token_ids
    client = OpenAI(base_url=glm.url + "/v1", api_key="unused", max_retries=0)
    seed = glm.script.set(201, "Looking." + CALL, end=glm.observation)
    r = client.chat.completions.create(model="tiny-glm", messages=ASK, tools=[LOOKUP], max_tokens=100,
                                       temperature=0, seed=seed)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "inventory::lookup"
    assert json.loads(call.function.arguments) == {"sku": "42", "n": 2}        # "sku" is declared a string
    assert r.choices[0].message.content == "Looking." and r.choices[0].finish_reason == "tool_calls"
    prompt = glm.tok.apply_chat_template(ASK, tools=[LOOKUP])
    assert prompt.startswith("[gMASK]<sop><|system|>\n# Tools") and '"name": "inventory::lookup"' in prompt
    assert r.usage.prompt_tokens == len(glm.tok.encode(prompt))

    chunks = list(client.chat.completions.create(model="tiny-glm", messages=ASK, tools=[LOOKUP], max_tokens=100,
                                                 temperature=0, seed=seed, stream=True))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [(0, "inventory::lookup", {"sku": "42", "n": 2})]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Looking."
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]

    # history: the call and its result render in GLM's format and the answer is plain content
    history = ASK + [{"role": "assistant", "content": "Looking.", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "aisle 3"}]
    seed = glm.script.set(202, "Aisle 3.")
    r = client.chat.completions.create(model="tiny-glm", messages=history, tools=[LOOKUP], max_tokens=40,
                                       temperature=0, seed=seed)
    assert r.choices[0].message.content == "Aisle 3." and r.choices[0].finish_reason == "stop"
    text = glm.tok.apply_chat_template(history, tools=[LOOKUP])
    assert text.endswith("<|observation|><tool_response>aisle 3</tool_response><|assistant|><think>")
    assert r.usage.prompt_tokens == len(glm.tok.encode(text))
