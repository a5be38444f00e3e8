"""Tool-call parsers for model output, streaming and whole, in three formats.

* ``dsml`` (DeepSeek V4.1)::

      <｜DSML｜ calls>
      <｜DSML｜ invoke name="inventory::lookup">
      <｜DSML｜ parameter name="sku" string="true">X</｜DSML｜ parameter>
      <｜DSML｜ parameter name="n" string="false">2</｜DSML｜ parameter>
      </｜DSML｜ invoke>
      </｜DSML｜ calls>

* ``glm`` (GLM-4.5 … GLM-5.3): ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…</tool_call>``
  (string values raw, other values JSON; newlines between the parts are allowed).
* ``hermes`` (Qwen3 and other Hermes-style templates):
  ``<tool_call>\\n{"name": "NAME", "arguments": {…}}\\n</tool_call>``.

Every format is a sequence of *blocks* that open and close with fixed markers. One algorithm
serves all three, so that feeding text in any chunking (down to one character at a time) gives
the same content and the same calls as parsing it whole:

* text outside blocks is content, except that a tail which may still become a block marker (a
  prefix of the opening marker, and whitespace before it) is held back until it is decided;
* a block is only judged once its closing marker has arrived; a well-formed block becomes tool
  calls, and the whitespace around it (the separator the chat templates put between content and
  calls) is dropped;
* a malformed block, or one still open when the output ends, is returned as plain content, as
  written; parsing never raises.

Tool calls are emitted whole (name and JSON arguments) as soon as their block closes.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable

from kk_jax.chat.deepseek_v41 import CALLS_CLOSE, CALLS_OPEN, INVOKE_CLOSE, INVOKE_OPEN, PARAM_CLOSE, PARAM_OPEN

FORMATS = ("dsml", "glm", "hermes")


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str                 # a JSON object, as OpenAI returns it

    def args(self) -> dict:
        return json.loads(self.arguments)


@dataclasses.dataclass(frozen=True)
class Content:
    text: str


@dataclasses.dataclass(frozen=True)
class Call:
    index: int                     # position among the calls of this output
    call: ToolCall


Event = Content | Call


@dataclasses.dataclass(frozen=True)
class ParsedOutput:
    content: str
    calls: list[ToolCall]


def _dumps(args: dict) -> str:
    return json.dumps(args, ensure_ascii=False)


def _tool_properties(tools: Iterable[dict] | None) -> dict[str, dict]:
    """{function name: JSON-schema properties} of OpenAI tool definitions (lenient)."""
    out: dict[str, dict] = {}
    for t in tools or ():
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def _is_string_type(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    t = schema.get("type")
    return t == "string" or (isinstance(t, list) and t and all(x in ("string", "null") for x in t) and "string" in t)


def _json_or_raw(raw: str) -> Any:
    """JSON value of ``raw`` when it is JSON other than a bare string; else ``raw`` itself."""
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    return raw if isinstance(value, str) else value


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i].isspace():
        i += 1
    return i


class ToolCallParser:
    """One output's parser. ``feed(text)`` returns the events that are decided so far;
    ``finish()`` returns the rest. Subclasses define the markers and ``parse_block``."""

    format = ""
    start = ""
    end = ""

    def __init__(self, tools: Iterable[dict] | None = None):
        self.properties = _tool_properties(tools)
        self._buf = ""
        self._in_block = False
        self._scan = 0              # where to look for the closing marker next
        self._ws = ""               # whitespace just before the open block (dropped if the block is valid)
        self._after_block = False   # whitespace right after a valid block is dropped at the end
        self._n_calls = 0
        self._done = False

    # ---------------------------------------------------------------- format
    def parse_block(self, body: str) -> list[ToolCall] | None:
        """Calls of one block (the text between the markers), or None when malformed."""
        raise NotImplementedError

    # ---------------------------------------------------------------- streaming
    def feed(self, text: str) -> list[Event]:
        if self._done:
            raise RuntimeError("feed() after finish()")
        self._buf += text
        out: list[Event] = []
        while True:
            if self._in_block:
                e = self._buf.find(self.end, self._scan)
                if e < 0:
                    self._scan = max(len(self.start), len(self._buf) - len(self.end) + 1)
                    break
                self._close_block(e, out)
                continue
            i = self._buf.find(self.start)
            if i >= 0:
                pre = self._buf[:i]
                kept = pre.rstrip()
                self._emit(kept, out)
                self._ws = pre[len(kept):]
                self._buf = self._buf[i:]
                self._in_block = True
                self._scan = len(self.start)
                continue
            hold = self._held_tail()
            self._emit(self._buf[:len(self._buf) - hold], out)
            self._buf = self._buf[len(self._buf) - hold:]
            break
        return _merge(out)

    def finish(self) -> list[Event]:
        if self._done:
            return []
        out: list[Event] = []
        if self._in_block:
            self._emit(self._ws + self._buf, out, force=True)
        elif not (self._after_block and not self._buf.strip()):
            self._emit(self._buf, out, force=True)
        self._buf, self._ws, self._in_block, self._done = "", "", False, True
        return _merge(out)

    def parse(self, text: str) -> ParsedOutput:
        """Whole-output parsing: the same events as streaming, collected."""
        events = self.feed(text) + self.finish()
        return ParsedOutput("".join(e.text for e in events if isinstance(e, Content)),
                            [e.call for e in events if isinstance(e, Call)])

    # ---------------------------------------------------------------- internals
    def _held_tail(self) -> int:
        """Length of the tail that may still turn into the start of a block: the longest suffix
        that is a proper prefix of the opening marker, plus the whitespace before it."""
        buf, start = self._buf, self.start
        k = 0
        for n in range(min(len(start) - 1, len(buf)), 0, -1):
            if buf.endswith(start[:n]):
                k = n
                break
        j = len(buf) - k
        while j > 0 and buf[j - 1].isspace():
            j -= 1
        return len(buf) - j

    def _emit(self, text: str, out: list[Event], force: bool = False) -> None:
        if text:
            out.append(Content(text))
            if force or text.strip():
                self._after_block = False

    def _close_block(self, e: int, out: list[Event]) -> None:
        body = self._buf[len(self.start):e]
        try:
            calls = self.parse_block(body)
        except (ValueError, TypeError, KeyError, IndexError, RecursionError):
            calls = None
        if calls:
            self._ws = ""
            for c in calls:
                out.append(Call(self._n_calls, c))
                self._n_calls += 1
            self._buf = self._buf[e + len(self.end):]
            self._after_block = True
        else:
            inner = body.find(self.start)
            cut = len(self.start) + inner if inner >= 0 else e + len(self.end)
            self._emit(self._ws + self._buf[:cut], out, force=True)
            self._ws = ""
            self._buf = self._buf[cut:]
        self._in_block = False


def _merge(events: list[Event]) -> list[Event]:
    out: list[Event] = []
    for ev in events:
        if isinstance(ev, Content) and out and isinstance(out[-1], Content):
            out[-1] = Content(out[-1].text + ev.text)
        else:
            out.append(ev)
    return out


# ---------------------------------------------------------------------------- formats
class HermesParser(ToolCallParser):
    """``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` (Qwen3 / Hermes)."""

    format = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def parse_block(self, body: str) -> list[ToolCall] | None:
        obj = json.loads(body)
        if not isinstance(obj, dict):
            return None
        name = obj.get("name")
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            args = json.loads(args)
        if not isinstance(name, str) or not name.strip() or not isinstance(args, dict):
            return None
        return [ToolCall(name.strip(), _dumps(args))]


class GlmParser(ToolCallParser):
    """``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…</tool_call>`` (GLM).

    Values are written raw when they are strings and as JSON otherwise, so decoding needs the
    tool schema: a parameter declared ``"type": "string"`` stays a string; any other value is
    decoded as JSON when it is JSON (other than a bare JSON string) and kept raw otherwise."""

    format = "glm"
    start, end = "<tool_call>", "</tool_call>"
    KEY_OPEN, KEY_CLOSE, VAL_OPEN, VAL_CLOSE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"

    def parse_block(self, body: str) -> list[ToolCall] | None:
        first = body.find(self.KEY_OPEN)
        name = (body if first < 0 else body[:first]).strip()
        if not name or any(c in name for c in "<>\n"):
            return None
        props = self.properties.get(name, {})
        args: dict[str, Any] = {}
        i = len(body) if first < 0 else first
        while True:
            i = _skip_ws(body, i)
            if i == len(body):
                break
            if not body.startswith(self.KEY_OPEN, i):
                return None
            k_end = body.find(self.KEY_CLOSE, i)
            if k_end < 0:
                return None
            key = body[i + len(self.KEY_OPEN):k_end].strip()
            i = _skip_ws(body, k_end + len(self.KEY_CLOSE))
            if not key or key in args or not body.startswith(self.VAL_OPEN, i):
                return None
            v_end = body.find(self.VAL_CLOSE, i)
            if v_end < 0:
                return None
            raw = body[i + len(self.VAL_OPEN):v_end]
            args[key] = raw if _is_string_type(props.get(key)) else _json_or_raw(raw)
            i = v_end + len(self.VAL_CLOSE)
        return [ToolCall(name, _dumps(args))]


class DsmlParser(ToolCallParser):
    """DeepSeek V4.1 DSML ``calls`` blocks (one block may hold several invokes; a block is
    accepted or rejected as a whole). ``string="false"`` values that are not JSON are kept as
    strings rather than dropping the call."""

    format = "dsml"
    start, end = CALLS_OPEN, CALLS_CLOSE

    def parse_block(self, body: str) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        i = _skip_ws(body, 0)
        while i < len(body):
            head = INVOKE_OPEN + ' name="'
            if not body.startswith(head, i):
                return None
            q = body.find('">', i + len(head))
            if q < 0:
                return None
            name = body[i + len(head):q]
            if not name or any(c in name for c in '"<>\n'):
                return None
            i = _skip_ws(body, q + 2)
            args: dict[str, Any] = {}
            p_head = PARAM_OPEN + ' name="'
            while body.startswith(p_head, i):
                q = body.find('" string="', i + len(p_head))
                if q < 0:
                    return None
                key = body[i + len(p_head):q]
                j = q + len('" string="')
                if body.startswith('true">', j):
                    is_str, j = True, j + len('true">')
                elif body.startswith('false">', j):
                    is_str, j = False, j + len('false">')
                else:
                    return None
                v_end = body.find(PARAM_CLOSE, j)
                if v_end < 0 or not key or key in args or any(c in key for c in '"<>\n'):
                    return None
                raw = body[j:v_end]
                if is_str:
                    args[key] = raw
                else:
                    try:
                        args[key] = json.loads(raw)
                    except ValueError:
                        args[key] = raw
                i = _skip_ws(body, v_end + len(PARAM_CLOSE))
            if not body.startswith(INVOKE_CLOSE, i):
                return None
            calls.append(ToolCall(name, _dumps(args)))
            i = _skip_ws(body, i + len(INVOKE_CLOSE))
        return calls or None


_PARSERS = {"dsml": DsmlParser, "glm": GlmParser, "hermes": HermesParser}


def make_tool_parser(fmt: str, tools: Iterable[dict] | None = None) -> ToolCallParser:
    """A fresh streaming parser for one output in format ``fmt`` (``dsml``, ``glm``, ``hermes``);
    ``tools`` (OpenAI definitions) lets the GLM parser keep string parameters as strings."""
    if fmt not in _PARSERS:
        raise ValueError(f"unknown tool-call format {fmt!r}; known: {', '.join(FORMATS)}")
    return _PARSERS[fmt](tools)


def parse_tool_calls(fmt: str, text: str, tools: Iterable[dict] | None = None) -> ParsedOutput:
    """Parses a whole output: plain content (blocks removed) and the tool calls in order."""
    return make_tool_parser(fmt, tools).parse(text)
