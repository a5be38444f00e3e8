"""Validation of the tool fields of an OpenAI chat request: ``tools``, ``tool_choice`` and the
tool calls / tool results of the history. Everything is checked before a prompt is built, and a
problem is reported as :class:`ToolRequestError` (the reason plus the request field it is in),
which the server answers with a 400.

Namespaced tools come back qualified (``ns::name``, :mod:`kk_jax.chat.tool_names`), so the
prompt, the named ``tool_choice`` and the calls returned to the client all use one name.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from kk_jax.chat.tool_names import ToolNamespaceError, normalize_tool_choice, normalize_tool_namespace

# letters, digits, '_', '-', '.', optionally qualified once as "ns::name"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+(::[A-Za-z0-9_.\-]+)?")
MAX_NAME = 128
CHOICE_MODES = ("auto", "none", "required")


class ToolRequestError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    mode: str                      # "auto" | "none" | "required" | "function"
    name: str | None = None        # the qualified function name when mode == "function"

    @property
    def forces_call(self) -> bool:
        return self.mode in ("required", "function")


def _check_schema(params: Any, where: str) -> None:
    if not isinstance(params, dict):
        raise ToolRequestError(f"{where}.parameters must be a JSON Schema object, got {type(params).__name__}",
                               "tools")
    if "type" in params and params["type"] != "object":
        raise ToolRequestError(f"{where}.parameters.type must be 'object' (function arguments are a JSON object), "
                               f"got {params['type']!r}", "tools")
    props = params.get("properties")
    if props is not None and (not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values())):
        raise ToolRequestError(f"{where}.parameters.properties must map parameter names to JSON Schema objects",
                               "tools")
    required = params.get("required")
    if required is not None and (not isinstance(required, list) or not all(isinstance(r, str) for r in required)):
        raise ToolRequestError(f"{where}.parameters.required must be a list of parameter names", "tools")
    try:
        json.dumps(params)
    except (TypeError, ValueError, RecursionError) as e:
        raise ToolRequestError(f"{where}.parameters is not JSON-serialisable: {e}", "tools") from None


def check_function_name(name: Any, where: str, param: str) -> str:
    if not isinstance(name, str) or not name:
        raise ToolRequestError(f"{where}: the function name must be a non-empty string, got {name!r}", param)
    if len(name) > MAX_NAME or not _NAME.fullmatch(name):
        raise ToolRequestError(f"{where}: function name {name!r} is invalid: use at most {MAX_NAME} letters, digits, "
                               "'_', '-' or '.', optionally qualified once as 'namespace::name'", param)
    return name


def validate_tools(tools: Any) -> list[dict]:
    """Checks OpenAI tool definitions; returns namespace-normalized copies."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolRequestError("tools must be a list of tool definitions", "tools")
    out, seen = [], {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ToolRequestError(f"{where} must be an object", "tools")
        if tool.get("type") != "function":
            raise ToolRequestError(f"{where}.type must be 'function', got {tool.get('type')!r}", "tools")
        if not isinstance(tool.get("function"), dict):
            raise ToolRequestError(f"{where}.function must be an object with name, description and parameters",
                                   "tools")
        try:
            tool = normalize_tool_namespace(tool)
        except ToolNamespaceError as e:
            raise ToolRequestError(f"{where}: {e}", "tools") from None
        fn = tool["function"]
        name = check_function_name(fn.get("name"), where, "tools")
        if "description" in fn and fn["description"] is not None and not isinstance(fn["description"], str):
            raise ToolRequestError(f"{where}.function.description must be a string", "tools")
        if fn.get("parameters") is not None:
            _check_schema(fn["parameters"], f"{where}.function")
        if name in seen:
            raise ToolRequestError(f"{where}: function name {name!r} is already used by tools[{seen[name]}]; "
                                   "tool names must be unique", "tools")
        seen[name] = i
        out.append(tool)
    return out


def resolve_tool_choice(choice: Any, tools: list[dict]) -> ToolChoice:
    """``tool_choice`` against the (validated) tools: auto / none / required / a named function."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in CHOICE_MODES:
            raise ToolRequestError(f"tool_choice {choice!r} is not supported: use 'auto', 'none', 'required' or "
                                   "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if choice == "required" and not tools:
            raise ToolRequestError("tool_choice 'required' needs a non-empty `tools` list", "tool_choice")
        if choice == "auto" and not tools:
            return ToolChoice("none")
        return ToolChoice(choice)
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("function"),
                                                                                             dict):
        raise ToolRequestError("a named tool_choice must look like {'type': 'function', 'function': {'name': ...}}",
                               "tool_choice")
    try:
        choice = normalize_tool_choice(choice)
    except ToolNamespaceError as e:
        raise ToolRequestError(f"tool_choice: {e}", "tool_choice") from None
    name = check_function_name(choice["function"].get("name"), "tool_choice", "tool_choice")
    names = [t["function"]["name"] for t in tools]
    if name not in names:
        raise ToolRequestError(f"tool_choice names function {name!r}, which is not in `tools` "
                               f"({', '.join(map(repr, names)) or 'none given'})", "tool_choice")
    return ToolChoice("function", name)


def validate_history(messages: list[dict]) -> list[dict]:
    """Assistant tool calls get qualified names and must carry JSON-object arguments; tool
    messages must name the call they answer. Returns new message dicts where changed."""
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "tool" and not m.get("tool_call_id"):
            raise ToolRequestError(f"messages[{i}]: a tool message needs the `tool_call_id` of the call it answers",
                                   f"messages.{i}.tool_call_id")
        if m.get("tool_calls"):
            if role != "assistant":
                raise ToolRequestError(f"messages[{i}]: only assistant messages carry tool_calls, not {role!r}",
                                       f"messages.{i}.tool_calls")
            calls = []
            for j, tc in enumerate(m["tool_calls"]):
                where, param = f"messages[{i}].tool_calls[{j}]", f"messages.{i}.tool_calls"
                try:
                    tc = normalize_tool_namespace(tc)
                except ToolNamespaceError as e:
                    raise ToolRequestError(f"{where}: {e}", param) from None
                fn = tc["function"]
                check_function_name(fn.get("name"), where, param)
                args = fn.get("arguments", "{}")
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError as e:
                        raise ToolRequestError(f"{where}.function.arguments is not valid JSON: {e}", param) from None
                if not isinstance(args, dict):
                    raise ToolRequestError(f"{where}.function.arguments must be a JSON object, got "
                                           f"{type(args).__name__}", param)
                if isinstance(fn.get("arguments"), str) and not fn["arguments"].strip():
                    tc = {**tc, "function": {**fn, "arguments": "{}"}}
                calls.append(tc)
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out
