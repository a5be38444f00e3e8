"""Tool namespaces (reference/models.md §6.9): folding into ``ns::name``, descriptions, idempotence,
no mutation, and every rejection. Each rejection test also runs the nearest valid input, so a
normalizer that rejects everything (or nothing) fails."""

import copy

import pytest

from kk_jax.chat.tool_names import (ToolNamespaceError, normalize_messages_tool_calls, normalize_tool_calls,
                                    normalize_tool_choice, normalize_tool_namespace, split_qualified_name)


def tool(name="lookup", ns=None, fn_ns=None, description="Find a SKU.", **extra):
    fn = {"name": name, "description": description, "parameters": {"type": "object", "properties": {}}}
    if description is None:
        del fn["description"]
    if fn_ns is not None:
        fn["namespace"] = fn_ns
    t = {"type": "function", "function": fn, **extra}
    if ns is not None:
        t["namespace"] = ns
    return t


def test_tool_level_string_namespace_qualifies_name_and_drops_keys():
    out = normalize_tool_namespace(tool(ns="inventory"))
    assert out["function"]["name"] == "inventory::lookup"
    assert "namespace" not in out and "namespace" not in out["function"]
    assert out["function"]["description"] == "Find a SKU."          # string namespace: no description
    assert list(out["function"]) == ["name", "description", "parameters"]   # key order kept


def test_function_level_namespace_with_description_prepends_it():
    out = normalize_tool_namespace(tool(fn_ns={"name": "inventory", "description": "Warehouse tools."}))
    assert out["function"]["name"] == "inventory::lookup"
    assert out["function"]["description"] == "Warehouse tools.\nFind a SKU."


def test_namespace_description_without_function_description():
    out = normalize_tool_namespace(tool(ns={"name": "inv", "description": "D"}, description=None))
    assert out["function"]["description"] == "D\n"
    assert list(out["function"]) == ["name", "parameters", "description"]     # appended at the end


def test_empty_namespace_description_leaves_description_alone():
    out = normalize_tool_namespace(tool(ns={"name": "inv", "description": ""}))
    assert out["function"]["description"] == "Find a SKU."


def test_no_namespace_is_unchanged_even_with_separator_in_name():
    t = tool(name="a::b")
    assert normalize_tool_namespace(t) is t
    plain = tool()
    assert normalize_tool_namespace(plain) is plain


def test_non_dicts_pass_through():
    for value in (None, "x", 3, ["a"], {"function": "not a dict"}, {"type": "function"}):
        assert normalize_tool_namespace(value) is value


def test_idempotent_and_inputs_not_mutated():
    t = tool(ns={"name": "inventory", "description": "Warehouse."})
    before = copy.deepcopy(t)
    once = normalize_tool_namespace(t)
    assert t == before                                   # caller's object untouched
    twice = normalize_tool_namespace(once)
    assert twice == once and twice is once               # no namespace keys left: a no-op


def test_consistent_duplicate_declarations_and_prequalified_name():
    out = normalize_tool_namespace(tool(name="inventory::lookup", ns="inventory", fn_ns={"name": "inventory"}))
    assert out["function"]["name"] == "inventory::lookup"


def test_first_declaration_supplies_description():
    out = normalize_tool_namespace(tool(ns="inv", fn_ns={"name": "inv", "description": "ignored"}))
    assert out["function"]["description"] == "Find a SKU."
    out = normalize_tool_namespace(tool(ns={"name": "inv", "description": "first"}, fn_ns={"name": "inv",
                                                                                         "description": "2nd"}))
    assert out["function"]["description"] == "first\nFind a SKU."


# (case, rejected input, message fragment, nearest accepted input)
BAD = [
    ("empty namespace", dict(ns=""), "non-empty string", dict(ns="inv")),
    ("non-string namespace", dict(ns=7), "non-empty string", dict(ns="7")),
    ("namespace with separator", dict(ns="a::b"), "without '::'", dict(ns="a_b")),
    ("dict namespace without name", dict(ns={"description": "d"}), "non-empty string",
     dict(ns={"name": "inv", "description": "d"})),
    ("non-string namespace description", dict(ns={"name": "inv", "description": 3}), "must be a string",
     dict(ns={"name": "inv", "description": "3"})),
    ("conflicting namespaces", dict(ns="inv", fn_ns="web"), "conflicting tool namespaces",
     dict(ns="inv", fn_ns="inv")),
    ("empty function name", dict(name="", ns="inv"), "non-empty string name", dict(name="x", ns="inv")),
    ("non-string function name", dict(name=None, ns="inv"), "non-empty string name", dict(name="None", ns="inv")),
    ("qualified with another namespace", dict(name="web::lookup", ns="inv"), "qualified with namespace 'web'",
     dict(name="inv::lookup", ns="inv")),
    ("empty remainder", dict(name="inv::", ns="inv"), "non-empty after the namespace",
     dict(name="inv::x", ns="inv")),
    ("remainder with separator", dict(name="inv::a::b", ns="inv"), "no further '::'",
     dict(name="inv::a_b", ns="inv")),
    ("non-string function description", dict(ns={"name": "inv", "description": "D"}, description=5),
     "must be a string", dict(ns={"name": "inv", "description": "D"}, description="5")),
]


@pytest.mark.parametrize("case,bad,fragment,good", BAD, ids=[b[0] for b in BAD])
def test_rejections(case, bad, fragment, good):
    with pytest.raises(ToolNamespaceError) as info:
        normalize_tool_namespace(tool(**bad))
    assert isinstance(info.value, ValueError) and fragment in str(info.value), str(info.value)
    out = normalize_tool_namespace(tool(**good))           # control: the nearest valid input passes
    assert "::" in out["function"]["name"] and "namespace" not in out


def test_tool_call_history_lists_and_tuples():
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "namespace": "inventory",
                                                          "arguments": "{}"}}
    as_list = normalize_tool_calls([call])
    as_tuple = normalize_tool_calls((call,))
    assert isinstance(as_list, list) and isinstance(as_tuple, tuple)
    assert as_list[0]["function"]["name"] == as_tuple[0]["function"]["name"] == "inventory::lookup"
    assert "namespace" in call["function"]                      # input not mutated
    msgs = normalize_messages_tool_calls([{"role": "user", "content": "x"},
                                          {"role": "assistant", "tool_calls": (call,)}])
    assert msgs[1]["tool_calls"][0]["function"]["name"] == "inventory::lookup"


def test_named_tool_choice():
    choice = {"type": "function", "namespace": "inventory", "function": {"name": "lookup"}}
    assert normalize_tool_choice(choice)["function"]["name"] == "inventory::lookup"
    with pytest.raises(ToolNamespaceError):
        normalize_tool_choice({"type": "function", "function": {"name": "web::lookup", "namespace": "inventory"}})


def test_split_qualified_name():
    assert split_qualified_name("inventory::lookup") == ("inventory", "lookup")
    assert split_qualified_name("lookup") == (None, "lookup")
