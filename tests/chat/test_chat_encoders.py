"""Chat encoders behind one interface: selection by the checkpoint config, the Qwen3 (tiny
checkpoint) and GLM-5.3 jinja templates with tools, the DS4.1 Python encoder, role checks
(``latest_reminder`` only for DS4.1) and the prefilled opening of a forced tool call."""

import json
import shutil
from pathlib import Path

import pytest

from checkpoints.make_tiny import CHAT_TEMPLATE
from kk_jax.chat import deepseek_v41 as ds
from kk_jax.chat.encoders import DeepseekV41ChatEncoder, RoleError, TemplateChatEncoder, chat_encoder_for
from kk_jax.chat.template import ChatTemplateError
from kk_jax.chat.tool_parsers import parse_tool_calls
from kk_jax.tokenizer import Tokenizer

GLM_TEMPLATE = (Path(__file__).resolve().parents[2] / "checkpoints/templates/glm5_chat_template.jinja").read_text()
LOOKUP = {"type": "function", "namespace": "inventory",
          "function": {"name": "lookup", "description": "Find a SKU.",
                       "parameters": {"type": "object", "properties": {"sku": {"type": "string"}}}}}


def call(cid, name, args):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


# ------------------------------------------------------------------ selection
def test_selection_by_config():
    assert isinstance(chat_encoder_for({"model_type": "deepseek_v41"}, None), DeepseekV41ChatEncoder)
    assert isinstance(chat_encoder_for({"architectures": ["DeepseekV41ForCausalLM"]}, CHAT_TEMPLATE),
                      DeepseekV41ChatEncoder)
    glm = chat_encoder_for({"model_type": "glm5_next", "architectures": ["Glm5NextForConditionalGeneration"]},
                           GLM_TEMPLATE)
    assert isinstance(glm, TemplateChatEncoder) and (glm.name, glm.tool_format) == ("glm5", "glm")
    assert chat_encoder_for({"model_type": "glm5_next"}, None) is None            # no template, no encoder
    qwen = chat_encoder_for({"model_type": "qwen3"}, CHAT_TEMPLATE)
    assert (qwen.name, qwen.tool_format) == ("qwen3", "hermes")
    plain = chat_encoder_for({"model_type": "llama"}, "{{ messages[0].content }}")
    assert plain.tool_format is None
    named = chat_encoder_for({}, [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}])
    assert named.template == "D"


def test_tokenizer_uses_the_encoder_of_its_checkpoint(tiny_ckpt, tmp_path):
    tok = Tokenizer(tiny_ckpt)
    assert isinstance(tok.chat_encoder, TemplateChatEncoder) and tok.chat_encoder.tool_format == "hermes"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[LOOKUP])
    assert '"name": "inventory::lookup"' in text and "<tools>" in text
    # the same tokenizer files under a DS4.1 config select the Python encoder
    ds_dir = tmp_path / "ds41"
    shutil.copytree(tiny_ckpt, ds_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((ds_dir / "config.json").read_text())
    (ds_dir / "config.json").write_text(json.dumps({**cfg, "model_type": "deepseek_v41"}))
    tok41 = Tokenizer(ds_dir)
    assert isinstance(tok41.chat_encoder, DeepseekV41ChatEncoder)
    assert tok41.apply_chat_template([{"role": "user", "content": "hi"}]).startswith(ds.BOS + ds.SYSTEM)


# ------------------------------------------------------------------ roles
@pytest.mark.parametrize("template", [CHAT_TEMPLATE, GLM_TEMPLATE])
def test_latest_reminder_only_for_ds41(template):
    msgs = [{"role": "user", "content": "Q"}, {"role": "latest_reminder", "content": "R"}]
    with pytest.raises(RoleError, match="'latest_reminder' is not supported") as info:
        TemplateChatEncoder(template).encode(msgs)
    assert info.value.index == 1
    assert DeepseekV41ChatEncoder().encode(msgs).endswith("<｜latest_reminder｜>R")
    TemplateChatEncoder(template).encode(msgs[:1])                               # control


def test_developer_role_is_a_system_message_for_templates():
    out = TemplateChatEncoder(CHAT_TEMPLATE).encode([{"role": "developer", "content": "D"},
                                                     {"role": "user", "content": "Q"}])
    assert out.startswith("<|im_start|>system\nD<|im_end|>\n")


# ------------------------------------------------------------------ Qwen3 template with tools
def test_qwen3_tools_history_and_results():
    enc = TemplateChatEncoder(CHAT_TEMPLATE, name="qwen3")
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Find X"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "lookup", "namespace": "inventory", "arguments": '{"sku": "X"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "aisle 3"},
            {"role": "tool", "tool_call_id": "c2", "content": "none"}]
    out = enc.encode(msgs, tools=[LOOKUP])
    assert out.startswith("<|im_start|>system\nS\n\n# Tools\n")
    assert '"name": "inventory::lookup", "description": "Find a SKU."' in out
    assert '<tool_call>\n{"name": "inventory::lookup", "arguments": {"sku": "X"}}\n</tool_call><|im_end|>' in out
    assert ("<|im_start|>user\n<tool_response>\naisle 3\n</tool_response>\n<tool_response>\nnone\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in out
    assert enc.encode(msgs[:2]) .count("# Tools") == 0                           # control: no tools, no block


# ------------------------------------------------------------------ GLM-5.3 template
def test_glm_template_layout():
    enc = TemplateChatEncoder(GLM_TEMPLATE, name="glm5", tool_format="glm")
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
            {"role": "assistant", "reasoning_content": "old", "content": "A1"}, {"role": "user", "content": "Q2"},
            {"role": "assistant", "reasoning_content": "new", "content": " A2 ",
             "tool_calls": [call("a", "f", '{"s": "x", "n": 1, "o": {"k": [true]}}')]},
            {"role": "tool", "tool_call_id": "a", "content": "R"}]
    out = enc.encode(msgs, tools=[LOOKUP])
    assert out.startswith("[gMASK]<sop><|system|>\n# Tools\n\nYou may call one or more functions")
    assert '\n<tools>\n{"type": "function", "function": {"name": "inventory::lookup"' in out
    assert "...</tool_call><|system|>S<|user|>Q1<|assistant|></think>A1<|user|>Q2<|assistant|><think>new</think>A2" \
           "<tool_call>f<arg_key>s</arg_key><arg_value>x</arg_value><arg_key>n</arg_key><arg_value>1</arg_value>" \
           '<arg_key>o</arg_key><arg_value>{"k": [true]}</arg_value></tool_call>' \
           "<|observation|><tool_response>R</tool_response><|assistant|><think>" in out
    assert "old" not in out
    assert "<think>old</think>A1" in enc.encode(msgs, clear_thinking=False)
    assert enc.encode(msgs[:2], enable_thinking=False) == "[gMASK]<sop><|system|>S<|user|>Q1<|assistant|></think>"


def test_glm_tool_results_in_call_order_when_ids_match():
    enc = TemplateChatEncoder(GLM_TEMPLATE, name="glm5", tool_format="glm")
    head = [{"role": "user", "content": "Q"},
            {"role": "assistant", "tool_calls": [call("a", "f", {}), call("b", "g", {})]}]
    swapped = [{"role": "tool", "tool_call_id": "b", "content": "B"},
               {"role": "tool", "tool_call_id": "a", "content": "A"}]
    out = enc.encode(head + swapped)
    assert out.endswith("<|observation|><tool_response>A</tool_response><tool_response>B</tool_response>"
                        "<|assistant|><think>")
    # control: an id that matches no call keeps the source order
    odd = [swapped[0], {"role": "tool", "tool_call_id": "zz", "content": "A"}]
    assert enc.encode(head + odd).endswith("<|observation|><tool_response>B</tool_response><tool_response>A"
                                           "</tool_response><|assistant|><think>")


def test_glm_rejects_non_object_arguments():
    enc = TemplateChatEncoder(GLM_TEMPLATE, name="glm5", tool_format="glm")
    with pytest.raises(ChatTemplateError, match="JSON object"):
        enc.encode([{"role": "user", "content": "Q"}, {"role": "assistant", "tool_calls": [call("a", "f", "[1]")]}])


# ------------------------------------------------------------------ DS4.1 encoder
def test_ds41_encoder_switches():
    enc = DeepseekV41ChatEncoder()
    msgs = [{"role": "user", "content": "Q"}]
    assert enc.encode(msgs) == ds.BOS + ds.SYSTEM + "Reasoning Effort: 75 (range 1-100, the higher the value, the " \
                               "more thorough the reasoning)\n\n<｜User｜>Q<｜Assistant｜><think>"
    assert enc.encode(msgs, enable_thinking=False) == ds.BOS + "<｜User｜>Q<｜Assistant｜></think>"
    assert enc.encode(msgs, reasoning_effort="low").count("Reasoning Effort: 50") == 1
    assert enc.encode(msgs, add_generation_prompt=False).endswith("<｜User｜>Q")
    with pytest.raises(ValueError, match="unknown DeepSeek V4.1 chat options"):
        enc.encode(msgs, temperature=1)
    with pytest.raises(ValueError, match="reasoning_effort"):
        enc.encode(msgs, reasoning_effort="medium")


# ------------------------------------------------------------------ forced tool calls
CONTINUATIONS = {"hermes": '{"sku": "X"}}\n</tool_call>', "glm": "<arg_key>sku</arg_key><arg_value>X</arg_value>"
                 "</tool_call>", "dsml": '<｜DSML｜ parameter name="sku" string="true">X</｜DSML｜ parameter>\n'
                 '</｜DSML｜ invoke>\n</｜DSML｜ calls>'}


@pytest.mark.parametrize("enc", [TemplateChatEncoder(CHAT_TEMPLATE, name="qwen3"),
                                 TemplateChatEncoder(GLM_TEMPLATE, name="glm5", tool_format="glm"),
                                 DeepseekV41ChatEncoder()], ids=["qwen3", "glm5", "ds41"])
def test_forced_call_prefix_opens_the_named_call(enc):
    prompt = enc.encode([{"role": "user", "content": "Find X"}], tools=[LOOKUP])
    suffix, seed = enc.forced_call_prefix(prompt, "inventory::lookup")
    assert suffix.endswith(seed) and seed
    parsed = parse_tool_calls(enc.tool_format, seed + CONTINUATIONS[enc.tool_format])
    assert [(c.name, c.args()) for c in parsed.calls] == [("inventory::lookup", {"sku": "X"})]
    assert (prompt + suffix).count("</think>") == prompt.count("</think>") + 1      # thinking closed first
    any_suffix, any_seed = enc.forced_call_prefix(prompt, None)                       # 'required': any function
    assert any_suffix.endswith(any_seed) and "lookup" not in any_seed
