"""Tool-call parsers (DSML, GLM, Hermes): whole parsing, streaming in any chunking equals whole
parsing, malformed or truncated calls come back as plain content (never an exception), and round
trips through the real encoders: encode(tool calls) -> parse -> the same calls."""

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from checkpoints.make_tiny import CHAT_TEMPLATE
from kk_jax.chat import deepseek_v41 as ds
from kk_jax.chat.encoders import TemplateChatEncoder
from kk_jax.chat.template import render_chat
from kk_jax.chat.tool_parsers import Call, Content, ToolCall, make_tool_parser, parse_tool_calls

GLM_TEMPLATE = (Path(__file__).resolve().parents[2] / "checkpoints/templates/glm5_chat_template.jinja").read_text()

DSML_CALL = ('<｜DSML｜ calls>\n<｜DSML｜ invoke name="inventory::lookup">\n'
             '<｜DSML｜ parameter name="sku" string="true">X</｜DSML｜ parameter>\n'
             '<｜DSML｜ parameter name="n" string="false">2</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
GLM_CALL = '<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>' \
           '<arg_value>2</arg_value></tool_call>'

VALID = {
    "dsml": [("Sure.\n\n" + DSML_CALL, "Sure.", [("inventory::lookup", {"sku": "X", "n": 2})]),
             (DSML_CALL, "", [("inventory::lookup", {"sku": "X", "n": 2})]),
             ('<｜DSML｜ calls>\n<｜DSML｜ invoke name="a">\n\n</｜DSML｜ invoke>\n<｜DSML｜ invoke name="b">\n'
              '<｜DSML｜ parameter name="v" string="false">{"k": [1, null]}</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n'
              '</｜DSML｜ calls>', "", [("a", {}), ("b", {"v": {"k": [1, None]}})]),
             ('<｜DSML｜ calls><｜DSML｜ invoke name="t"><｜DSML｜ parameter name="s" string="false">bare'
              '</｜DSML｜ parameter></｜DSML｜ invoke></｜DSML｜ calls> after', " after", [("t", {"s": "bare"})])],
    "hermes": [("Let me check.\n" + HERMES_CALL, "Let me check.", [("get_weather", {"city": "Paris", "days": 2})]),
               (HERMES_CALL + "\n" + HERMES_CALL.replace("Paris", "Oslo"), "",
                [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Oslo", "days": 2})]),
               ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("f", {"a": 1})]),
               ('<tool_call>{"name": "f"}</tool_call>', "", [("f", {})])],
    "glm": [("Checking." + GLM_CALL, "Checking.", [("get_weather", {"city": "Paris", "days": 2})]),
            ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>", "",
             [("get_weather", {"city": "Oslo"})]),
            ("<tool_call>ping</tool_call><tool_call>f<arg_key>o</arg_key><arg_value>{\"a\": true}</arg_value>"
             "</tool_call>", "", [("ping", {}), ("f", {"o": {"a": True}})])],
}

MALFORMED = {
    "dsml": ["<｜DSML｜ calls>\n</｜DSML｜ calls>",                                  # no invoke
             '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n</｜DSML｜ calls>',       # invoke never closed
             '<｜DSML｜ calls>\n<｜DSML｜ invoke nam="f">\n</｜DSML｜ invoke>\n</｜DSML｜ calls>',
             '<｜DSML｜ calls><｜DSML｜ invoke name="f"><｜DSML｜ parameter name="a" string="maybe">1'
             '</｜DSML｜ parameter></｜DSML｜ invoke></｜DSML｜ calls>',
             '<｜DSML｜ calls><｜DSML｜ invoke name="f"><｜DSML｜ parameter name="a" string="true">1</｜DSML｜ parameter>'
             '<｜DSML｜ parameter name="a" string="true">2</｜DSML｜ parameter></｜DSML｜ invoke></｜DSML｜ calls>',
             "text " + DSML_CALL[:-5],                                               # truncated
             "text <｜DSML｜ cal"],
    "hermes": ['<tool_call>{"name": "f", "arguments": </tool_call>', "<tool_call>[1, 2]</tool_call>",
               '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
               "ok " + HERMES_CALL[:-3], "<tool_call>", "tail <tool_"],
    "glm": ["<tool_call><arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",       # no name
            "<tool_call>f<arg_key>a</arg_key></tool_call>",                             # key without value
            "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value>junk</tool_call>",
            "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>a</arg_key><arg_value>2</arg_value>"
            "</tool_call>",
            "<tool_call>f\nbad name<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
            "so " + GLM_CALL[:-4]],
}


def calls_of(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def stream(fmt, pieces, tools=None):
    p = make_tool_parser(fmt, tools)
    events = []
    for piece in pieces:
        events += p.feed(piece)
    events += p.finish()
    return merged(events)


def merged(events):
    out = []
    for e in events:
        if isinstance(e, Content) and out and isinstance(out[-1], Content):
            out[-1] = Content(out[-1].text + e.text)
        elif not (isinstance(e, Content) and not e.text):
            out.append(e)
    return out


def chunkings(text, seed=0):
    rng = random.Random(seed)
    yield [text]
    yield list(text)
    for _ in range(4):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6)))) if len(text) > 1 else []
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("fmt", ["dsml", "hermes", "glm"])
def test_valid_calls_whole_and_streamed(fmt):
    for text, content, calls in VALID[fmt]:
        parsed = parse_tool_calls(fmt, text)
        assert (parsed.content, calls_of(parsed)) == (content, calls), text
        whole = stream(fmt, [text])
        assert [e.index for e in whole if isinstance(e, Call)] == list(range(len(calls)))
        for pieces in chunkings(text):
            assert stream(fmt, pieces) == whole, pieces


@pytest.mark.parametrize("fmt", ["dsml", "hermes", "glm"])
def test_malformed_and_truncated_are_content(fmt):
    for text in MALFORMED[fmt]:
        parsed = parse_tool_calls(fmt, text)
        assert parsed.calls == [] and parsed.content == text, text
        for pieces in chunkings(text, seed=1):
            assert stream(fmt, pieces) == [Content(text)]


def test_valid_call_after_a_malformed_block_is_found():
    text = 'a <tool_call>{oops</tool_call> b ' + HERMES_CALL + ' c'
    parsed = parse_tool_calls("hermes", text)
    assert calls_of(parsed) == [("get_weather", {"city": "Paris", "days": 2})]
    assert parsed.content == "a <tool_call>{oops</tool_call> b c"
    # an unterminated block swallowed by a later one still yields the later call
    nested = '<tool_call>{"name": ' + HERMES_CALL
    assert calls_of(parse_tool_calls("hermes", nested)) == [("get_weather", {"city": "Paris", "days": 2})]


def test_streaming_holds_back_only_possible_markers():
    p = make_tool_parser("hermes")
    assert p.feed("Hello <tool") == [Content("Hello")]                  # " <tool" may open a call
    assert p.feed("box>") == [Content(" <toolbox>")]                     # it did not
    assert p.feed("\n\n") == [] and p.finish() == [Content("\n\n")]      # trailing whitespace is content at the end
    q = make_tool_parser("dsml")
    assert q.feed("x\n\n") == [Content("x")]
    assert q.feed(DSML_CALL) == [Call(0, ToolCall("inventory::lookup", '{"sku": "X", "n": 2}'))]
    assert q.feed("\n") == [] and q.finish() == []                       # whitespace after a call is dropped


def test_glm_string_parameters_follow_the_schema():
    text = "<tool_call>f<arg_key>code</arg_key><arg_value>5</arg_value><arg_key>n</arg_key><arg_value>7</arg_value>" \
           "<arg_key>q</arg_key><arg_value>\"x\"</arg_value><arg_key>z</arg_key><arg_value>007</arg_value></tool_call>"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "code": {"type": "string"}, "n": {"type": "integer"}, "q": {"type": "string"}}}}}]
    assert calls_of(parse_tool_calls("glm", text, tools)) == [("f", {"code": "5", "n": 7, "q": '"x"', "z": "007"})]
    # control: without the schema a number-looking string is decoded (the format alone cannot tell);
    # a bare JSON string and non-JSON text stay raw either way
    assert calls_of(parse_tool_calls("glm", text)) == [("f", {"code": 5, "n": 7, "q": '"x"', "z": "007"})]


def test_unknown_format():
    with pytest.raises(ValueError, match="unknown tool-call format"):
        make_tool_parser("xml")


PIECES = {
    "dsml": ["<｜DSML｜ calls>", "</｜DSML｜ calls>", '<｜DSML｜ invoke name="f">', "</｜DSML｜ invoke>",
             '<｜DSML｜ parameter name="a" string="true">', '<｜DSML｜ parameter name="b" string="false">',
             "</｜DSML｜ parameter>", "<｜DSML", "\n", "\n\n", " ", "x", "1", '"', "<", ">"],
    "hermes": ["<tool_call>", "</tool_call>", '{"name": "f", "arguments": {"a": 1}}', "{", "}", '"name"', ":",
               "<tool", "\n", " ", "x", "[", "]"],
    "glm": ["<tool_call>", "</tool_call>", "f", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "a",
            "1", "{}", "\n", " ", "<tool_", "<"],
}


@pytest.mark.parametrize("fmt", ["dsml", "hermes", "glm"])
@settings(max_examples=150, deadline=None, database=None)
@given(data=st.data())
def test_fuzz_never_raises_and_chunking_is_irrelevant(fmt, data):
    text = "".join(data.draw(st.lists(st.sampled_from(PIECES[fmt]), max_size=24)))
    whole = stream(fmt, [text])
    assert stream(fmt, list(text)) == whole
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=5)))
    cuts = [c for c in cuts if 0 < c < len(text)]
    assert stream(fmt, [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]) == whole
    parsed = parse_tool_calls(fmt, text)
    assert "".join(e.text for e in whole if isinstance(e, Content)) == parsed.content
    for c in parsed.calls:
        assert isinstance(json.loads(c.arguments), dict)


# ------------------------------------------------------------------ round trips through the encoders
CALLS = [("inventory::lookup", {"sku": "X-1", "n": 2, "exact": True}),
         ("get_weather", {"city": "São Paulo", "days": [1, 2], "opts": {"unit": "C"}, "note": "a \"b\"\nc"})]
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {
    k: {"type": "string" if isinstance(v, str) else "object"} for k, v in a.items()}}}} for n, a in CALLS]


def history(content, args_as_string):
    calls = [{"id": f"c{i}", "type": "function",
              "function": {"name": n, "arguments": json.dumps(a) if args_as_string else a}}
             for i, (n, a) in enumerate(CALLS)]
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content, "tool_calls": calls}]


@pytest.mark.parametrize("content", ["", "Let me look that up."])
@pytest.mark.parametrize("as_string", [False, True])
def test_round_trip_dsml(content, as_string):
    prompt = ds.encode_messages(history(content, as_string), "chat")
    turn = prompt.split(ds.ASSISTANT + ds.THINK_END, 1)[1]
    assert turn.endswith(ds.EOS)
    for pieces in ([turn[:-len(ds.EOS)]], list(turn[:-len(ds.EOS)])):
        out = stream("dsml", pieces)
        assert [(e.call.name, json.loads(e.call.arguments)) for e in out if isinstance(e, Call)] == CALLS
        assert "".join(e.text for e in out if isinstance(e, Content)) == content


@pytest.mark.parametrize("content", ["", "Let me look that up."])
@pytest.mark.parametrize("as_string", [False, True])
def test_round_trip_hermes_qwen3_template(content, as_string):
    enc = TemplateChatEncoder(CHAT_TEMPLATE, name="qwen3")
    assert enc.tool_format == "hermes"
    prompt = enc.encode(history(content, as_string), add_generation_prompt=False)
    turn = prompt.split("<|im_start|>assistant\n", 1)[1]
    assert turn.endswith("<|im_end|>\n")
    parsed = parse_tool_calls("hermes", turn[:-len("<|im_end|>\n")])
    assert calls_of(parsed) == CALLS and parsed.content == content


@pytest.mark.parametrize("content", ["", "Let me look that up."])
@pytest.mark.parametrize("as_string", [False, True])
def test_round_trip_glm_template(content, as_string):
    enc = TemplateChatEncoder(GLM_TEMPLATE, name="glm5", tool_format="glm")
    prompt = enc.encode(history(content, as_string), add_generation_prompt=False)
    turn = prompt.split("<|assistant|></think>", 1)[1]
    for pieces in ([turn], list(turn)):
        out = stream("glm", pieces, TOOLS)
        assert [(e.call.name, json.loads(e.call.arguments)) for e in out if isinstance(e, Call)] == CALLS
        assert "".join(e.text for e in out if isinstance(e, Content)) == content


def test_round_trip_renders_calls_in_the_prompt():
    """Control for the round trips: the calls really are in the rendered text (not parsed from nothing)."""
    assert render_chat(CHAT_TEMPLATE, history("", False), add_generation_prompt=False).count("<tool_call>") == 2
