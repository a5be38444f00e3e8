"""Validation of the OpenAI tool fields (``tools``, ``tool_choice``, tool-call history): every
rejection names the field and the reason, and the nearest valid input passes."""

import pytest

from kk_jax.chat.openai_tools import (ToolChoice, ToolRequestError, resolve_tool_choice, validate_history,
                                      validate_tools)


def fn_tool(name="get_weather", **fn):
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    return {"type": "function", "function": {"name": name, "description": "d", "parameters": params, **fn}}


def test_valid_tools_are_normalized_copies():
    tools = [fn_tool(), {"type": "function", "namespace": {"name": "inventory", "description": "Warehouse."},
                         "function": {"name": "lookup"}}]
    out = validate_tools(tools)
    assert [t["function"]["name"] for t in out] == ["get_weather", "inventory::lookup"]
    assert out[1]["function"]["description"] == "Warehouse.\n" and "namespace" in tools[1]
    assert validate_tools(None) == []


BAD_TOOLS = [
    ("not an object", ["x"], "must be an object"),
    ("wrong type", [{"type": "code_interpreter"}], "type must be 'function'"),
    ("no function", [{"type": "function"}], "function must be an object"),
    ("bad namespace", [{**fn_tool(), "namespace": "a::b"}], "without '::'"),
    ("conflicting namespaces", [{"type": "function", "namespace": "a", "function": {"name": "f", "namespace": "b"}}],
     "conflicting tool namespaces"),
    ("empty name", [fn_tool("")], "non-empty string"),
    ("name with spaces", [fn_tool("get weather")], "is invalid"),
    ("name with quote", [fn_tool('f"')], "is invalid"),
    ("name too long", [fn_tool("f" * 129)], "is invalid"),
    ("description not a string", [fn_tool(description=3)], "description must be a string"),
    ("parameters not an object", [fn_tool(parameters="{}")], "must be a JSON Schema object"),
    ("parameters type not object", [fn_tool(parameters={"type": "string"})], "type must be 'object'"),
    ("properties not a mapping", [fn_tool(parameters={"type": "object", "properties": ["city"]})],
     "properties must map"),
    ("required not a list", [fn_tool(parameters={"type": "object", "required": "city"})], "required must be a list"),
    ("duplicate names", [fn_tool(), fn_tool()], "must be unique"),
    ("duplicate after namespacing", [fn_tool("inv::f"), {"type": "function", "namespace": "inv",
                                                          "function": {"name": "f"}}], "must be unique"),
]


@pytest.mark.parametrize("case,tools,fragment", BAD_TOOLS, ids=[b[0] for b in BAD_TOOLS])
def test_bad_tools(case, tools, fragment):
    with pytest.raises(ToolRequestError) as info:
        validate_tools(tools)
    assert fragment in str(info.value) and info.value.param == "tools", str(info.value)


def test_tool_choice():
    tools = validate_tools([fn_tool(), {"type": "function", "namespace": "inventory", "function": {"name": "lookup"}}])
    assert resolve_tool_choice(None, tools) == ToolChoice("auto")
    assert resolve_tool_choice(None, []) == ToolChoice("none")
    assert resolve_tool_choice("auto", []) == ToolChoice("none")
    assert resolve_tool_choice("required", tools) == ToolChoice("required") and ToolChoice("required").forces_call
    assert resolve_tool_choice({"type": "function", "function": {"name": "lookup", "namespace": "inventory"}},
                               tools) == ToolChoice("function", "inventory::lookup")
    assert resolve_tool_choice({"type": "function", "function": {"name": "inventory::lookup"}},
                               tools).name == "inventory::lookup"
    for choice, fragment in [("sometimes", "not supported"), ({"type": "function"}, "must look like"),
                             ({"type": "function", "function": {"name": "nope"}}, "not in `tools`"),
                             ({"type": "function", "function": {"name": "x", "namespace": ""}}, "namespace")]:
        with pytest.raises(ToolRequestError, match=fragment) as info:
            resolve_tool_choice(choice, tools)
        assert info.value.param == "tool_choice"
    with pytest.raises(ToolRequestError, match="needs a non-empty `tools`"):
        resolve_tool_choice("required", [])
    with pytest.raises(ToolRequestError, match="not in `tools`"):
        resolve_tool_choice({"type": "function", "function": {"name": "get_weather"}}, [])


def test_history():
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "namespace": "inventory",
                                                  "function": {"name": "lookup", "arguments": ""}}]},
            {"role": "tool", "tool_call_id": "c", "content": "r"}]
    out = validate_history(msgs)
    assert out[1]["tool_calls"][0]["function"] == {"name": "inventory::lookup", "arguments": "{}"}
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == ""          # caller's message untouched
    cases = [
        ({"role": "tool", "content": "r"}, "needs the `tool_call_id`", "messages.0.tool_call_id"),
        ({"role": "user", "tool_calls": msgs[1]["tool_calls"]}, "only assistant messages", "messages.0.tool_calls"),
        ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}, "not valid JSON",
         "messages.0.tool_calls"),
        ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}, "JSON object",
         "messages.0.tool_calls"),
        ({"role": "assistant", "tool_calls": [{"namespace": "a", "function": {"name": "b::f", "arguments": "{}"}}]},
         "qualified with namespace 'b'", "messages.0.tool_calls"),
        ({"role": "assistant", "tool_calls": [{"function": {"name": "a b", "arguments": "{}"}}]}, "is invalid",
         "messages.0.tool_calls"),
    ]
    for msg, fragment, param in cases:
        with pytest.raises(ToolRequestError, match=fragment) as info:
            validate_history([msg])
        assert info.value.param == param
