"""DeepSeek V4.1 prompt encoding: byte-exact golden prompts and the rules behind them.

``fixtures/deepseek_v41_golden.json`` holds conversations (``kind`` ``encode`` = the
``encode_messages`` layer, ``api`` = the request layer with ``tools`` and thinking switches) with
their expected prompt strings, produced by the checkpoint's reference encoder (plus its namespace
normalizer, spec values for the reasoning-effort mapping) and checked against the worked examples
of reference/models.md §6.10. The rule tests below pin single behaviours, each next to a control
input that renders differently, so an encoder that ignores the rule fails.
"""

import copy
import json
from pathlib import Path

import pytest

from kk_jax.chat import deepseek_v41 as ds

FIXTURES = json.loads((Path(__file__).parent / "fixtures" / "deepseek_v41_golden.json").read_text())
EFFORT_75 = "Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


def render(case):
    kwargs = dict(case["kwargs"])
    if case["kind"] == "encode":
        return ds.encode_messages(case["messages"], **kwargs)
    tools = kwargs.pop("tools", None)
    return ds.apply_chat_template(case["messages"], tools, **kwargs)


def test_fixture_set_is_broad():
    assert len(FIXTURES) >= 25
    assert len({c["name"] for c in FIXTURES}) == len(FIXTURES)
    assert len({c["expected"] for c in FIXTURES}) == len(FIXTURES)     # no two cases collapse to one prompt
    text = "".join(c["expected"] for c in FIXTURES)
    for piece in (ds.BOS, ds.EOS, ds.SYSTEM, ds.USER, ds.ASSISTANT, ds.LATEST_REMINDER, ds.CALLS_OPEN,
                  'string="true"', 'string="false"', "<tool_result>", "## Tools", "Reasoning Effort: 50",
                  "Reasoning Effort: 100", "<｜query｜>", "<｜action｜>", "## Response Format", ds.IMAGE,
                  "[Unsupported ", "inventory::lookup"):
        assert piece in text, piece


@pytest.mark.parametrize("case", FIXTURES, ids=[c["name"] for c in FIXTURES])
def test_golden(case):
    before = copy.deepcopy(case)
    assert render(case) == case["expected"]
    assert case == before                                            # inputs are never mutated


def test_spec_worked_example_1_literal():
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "reasoning_content": "a", "content": "Hello"},
            {"role": "user", "content": "Bye"}]
    want = (ds.BOS + ds.SYSTEM + EFFORT_75 + "<｜User｜>Hi<｜Assistant｜></think>Hello<｜end▁of▁sentence｜>"
            "<｜User｜>Bye<｜Assistant｜><think>")
    assert ds.encode_messages(msgs, "thinking") == want


def test_special_strings_use_fullwidth_bar_and_lower_block():
    assert ds.BOS == "<\uff5cbegin\u2581of\u2581sentence\uff5c>" and "|" not in ds.BOS + ds.DSML + ds.USER


def test_reasoning_effort_mapping_and_errors():
    one = [{"role": "user", "content": "Q"}]
    for effort, n in (("low", 50), ("high", 75), ("xhigh", 75), ("max", 100), (1, 1), (100, 100), (None, 75)):
        assert f"Reasoning Effort: {n} (" in ds.encode_messages(one, "thinking", reasoning_effort=effort)
    for bad in ("medium", 0, 101, 2.5, True, "none"):
        with pytest.raises(ValueError, match="reasoning_effort"):
            ds.encode_messages(one, "thinking", reasoning_effort=bad)
    assert "Reasoning Effort" not in ds.encode_messages(one, "chat", reasoning_effort="max")


def test_effort_line_only_at_index_0_with_context():
    ctx = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}]
    out = ds.encode_messages([{"role": "user", "content": "C"}], "thinking", context=ctx)
    assert out == "<｜User｜>C<｜Assistant｜><think>"                   # no BOS, no effort line
    assert ds.encode_messages(ctx + [{"role": "user", "content": "C"}], "thinking").startswith(ds.BOS + ds.SYSTEM)


def test_drop_thinking_rules():
    msgs = [{"role": "user", "content": "Q1"}, {"role": "assistant", "reasoning_content": "R1", "content": "A1"},
            {"role": "user", "content": "Q2"}, {"role": "assistant", "reasoning_content": "R2", "content": "A2"}]
    dropped = ds.encode_messages(msgs, "thinking")
    assert "R1" not in dropped and "R2</think>A2" in dropped             # after the last user turn: kept
    assert "R1</think>A1" in ds.encode_messages(msgs, "thinking", drop_thinking=False)
    with_tools = [{"role": "system", "content": "", "tools": [{"type": "function", "function": {"name": "f"}}]}]
    assert "R1</think>A1" in ds.encode_messages(with_tools + msgs, "thinking")   # tools present: never dropped
    assert "R1" not in ds.encode_messages(msgs, "chat") and "R2" not in ds.encode_messages(msgs, "chat")


def test_mid_conversation_system_is_a_user_turn():
    msgs = [{"role": "user", "content": "Q1"}, {"role": "assistant", "reasoning_content": "R1", "content": "A1"},
            {"role": "system", "content": "S"}]
    out = ds.encode_messages(msgs, "thinking")
    assert out.endswith("<｜System｜>S<｜Assistant｜><think>") and "R1" not in out
    # control: a system message at index 0 gets no generation header of its own
    assert ds.encode_messages([{"role": "system", "content": "S"}], "chat") == ds.BOS + "<｜System｜>S"


def test_tool_results_merge_and_order():
    calls = [{"id": i, "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in ("a", "b", "c")]
    msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "c", "content": "C"},
            {"role": "tool", "tool_call_id": "a", "content": "A"},
            {"role": "user", "content": "and?"}, {"role": "tool", "tool_call_id": "b", "content": "B"}]
    out = ds.encode_messages(msgs, "chat")
    # one user turn; results in call order in their slots, the text block keeps its slot
    assert out.endswith("<｜User｜><tool_result>A</tool_result>\n\n<tool_result>B</tool_result>\n\nand?\n\n"
                        "<tool_result>C</tool_result><｜Assistant｜></think>")
    assert out.count(ds.USER) == 2


def test_tool_role_must_be_merged_and_unknown_roles_fail():
    with pytest.raises(ValueError, match="tool role"):
        ds._render(0, [{"role": "tool", "content": "x"}], False, False, None, -1)
    with pytest.raises(ValueError, match="unknown role"):
        ds.encode_messages([{"role": "wizard", "content": "x"}], "chat")
    with pytest.raises(ValueError, match="thinking_mode"):
        ds.encode_messages([{"role": "user", "content": "x"}], "fast")
    with pytest.raises(ValueError, match="invalid task"):
        ds.encode_messages([{"role": "user", "content": "x", "task": "summarize"}], "chat")


def test_dsml_string_flag_and_json_values():
    block = ds.render_dsml_calls([("f", {"s": "a\"b", "n": 1, "b": False, "z": None, "l": [1], "o": {"k": "ü"}})])
    assert '<｜DSML｜ parameter name="s" string="true">a"b</｜DSML｜ parameter>' in block
    for key, text in (("n", "1"), ("b", "false"), ("z", "null"), ("l", "[1]"), ("o", '{"k": "ü"}')):
        assert f'<｜DSML｜ parameter name="{key}" string="false">{text}</｜DSML｜ parameter>' in block


def test_tool_call_history_as_tuples_equals_lists():
    call = {"id": "c", "type": "function", "function": {"name": "lookup", "namespace": "inv", "arguments": {"a": 1}}}
    as_list = [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [call]}]
    as_tuple = [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": (call,)}]
    out = ds.encode_messages(as_list, "chat")
    assert out == ds.encode_messages(as_tuple, "chat") and 'invoke name="inv::lookup"' in out


def test_api_layer_roles_and_parts():
    with pytest.raises(ValueError, match="Invalid role"):
        ds.apply_chat_template([{"role": "function", "content": "x"}])
    with pytest.raises(ValueError, match="text and image"):
        ds.apply_chat_template([{"role": "user", "content": [{"type": "input_audio"}]}])
    out = ds.apply_chat_template([{"role": "developer", "content": "D"}, {"role": "user", "content": "Q"}],
                                 thinking=False)
    assert out == ds.BOS + "<｜System｜>D<｜User｜>Q<｜Assistant｜></think>"
    assert ds.apply_chat_template([{"role": "user", "content": "Q"}]).endswith("<think>")      # thinking default on
    assert ds.apply_chat_template([{"role": "user", "content": "Q"}], thinking=None).endswith("</think>")  # given
    assert ds.apply_chat_template([{"role": "user", "content": "Q"}], reasoning_effort="none").endswith("</think>")


def test_api_layer_tools_placement():
    t = [{"type": "function", "function": {"name": "f", "description": "d"}}]
    with_sys = ds.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}], t,
                                      thinking=False)
    assert with_sys.startswith(ds.BOS + "<｜System｜>S\n\n## Tools\n") and with_sys.count(ds.SYSTEM) == 1
    without = ds.apply_chat_template([{"role": "user", "content": "Q"}], t, thinking=False)
    assert without.startswith(ds.BOS + "<｜System｜>\n\n## Tools\n")
    assert '{"name": "f", "description": "d"}\n\nYou MUST strictly follow' in without
