"""Tool namespaces: fold ``namespace`` metadata into qualified function names (``ns::name``).

A client may group tools under a namespace, given as a string or as ``{"name", "description"}``,
on the tool object or on its ``function`` object (reference/models.md §6.9)::

    {"type": "function", "namespace": "inventory", "function": {"name": "lookup", ...}}
    -> {"type": "function", "function": {"name": "inventory::lookup", ...}}

The same folding applies to tool definitions, to a named ``tool_choice`` and to the tool calls of
assistant history, so a name the model emits (``inventory::lookup``) matches the definition the
client sent. Normalization returns new objects (the caller's are never mutated), removes every
``namespace`` key and is therefore idempotent. Inputs without namespace metadata come back
unchanged, even when their name already contains ``::``.
"""

from __future__ import annotations

from typing import Any

SEPARATOR = "::"


class ToolNamespaceError(ValueError):
    """A namespace declaration is invalid or contradicts the function name."""


def _parse_namespace(value: Any) -> tuple[str, str | None]:
    """``"ns"`` or ``{"name": "ns", "description": "..."}`` -> (name, description)."""
    description = None
    name = value
    if isinstance(value, dict):
        name, description = value.get("name"), value.get("description")
    if not isinstance(name, str) or not name or SEPARATOR in name:
        raise ToolNamespaceError(f"a tool namespace must be a non-empty string without {SEPARATOR!r}; "
                                 f"got {name!r}")
    if description is not None and not isinstance(description, str):
        raise ToolNamespaceError(f"the description of tool namespace {name!r} must be a string")
    return name, description


def normalize_tool_namespace(tool: Any) -> Any:
    """Qualifies ``tool["function"]["name"]`` with its declared namespace.

    Accepts an OpenAI tool definition or an assistant tool call (both carry a ``function``
    object). Anything that is not a dict with a dict ``function`` is returned as is.

    Rules: the first declaration (tool level before function level) gives the namespace and its
    description; a second declaration must name the same namespace (its description is
    ignored). An already qualified name must carry the same namespace as its prefix. A non-empty
    namespace description is prepended to the function description, separated by a newline.
    Raises :class:`ToolNamespaceError` (a ``ValueError``) with the reason otherwise.
    """
    if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
        return tool
    function = tool["function"]
    declared = [_parse_namespace(v) for v in (tool.get("namespace"), function.get("namespace")) if v is not None]
    if not declared:
        return tool
    namespace, ns_description = declared[0]
    for other, _ in declared[1:]:
        if other != namespace:
            raise ToolNamespaceError(f"conflicting tool namespaces: {namespace!r} on the tool but {other!r} on "
                                     "its function; declare one namespace")

    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ToolNamespaceError(f"a function in namespace {namespace!r} needs a non-empty string name; "
                                 f"got {name!r}")
    if SEPARATOR in name:
        prefix, name = name.split(SEPARATOR, 1)
        if prefix != namespace:
            raise ToolNamespaceError(f"function name {function['name']!r} is qualified with namespace {prefix!r} "
                                     f"but the declared namespace is {namespace!r}")
    if not name or SEPARATOR in name:
        raise ToolNamespaceError(f"function name {function['name']!r} in namespace {namespace!r} must be "
                                 f"non-empty after the namespace and contain no further {SEPARATOR!r}")

    out = dict(tool)
    out.pop("namespace", None)
    fn = dict(function)
    fn.pop("namespace", None)
    fn["name"] = f"{namespace}{SEPARATOR}{name}"
    if ns_description:
        old = fn.get("description")
        if old is not None and not isinstance(old, str):
            raise ToolNamespaceError(f"the description of function {fn['name']!r} must be a string")
        fn["description"] = ns_description + "\n" + (old or "")
    out["function"] = fn
    return out


def normalize_tool_calls(tool_calls: Any) -> Any:
    """Normalizes every call of an assistant ``tool_calls`` history (a list or a tuple; the
    container type is kept). Other values are returned unchanged."""
    if isinstance(tool_calls, (list, tuple)):
        return type(tool_calls)(normalize_tool_namespace(tc) for tc in tool_calls)
    return tool_calls


def normalize_messages_tool_calls(messages: Any) -> Any:
    """Returns the messages with the ``tool_calls`` of each message normalized (new dicts for
    the messages that carry calls; the others are passed through)."""
    if not isinstance(messages, (list, tuple)):
        return messages
    return type(messages)({**m, "tool_calls": normalize_tool_calls(m["tool_calls"])}
                          if isinstance(m, dict) and m.get("tool_calls") else m for m in messages)


def normalize_tool_choice(choice: Any) -> Any:
    """A named ``tool_choice`` (``{"type": "function", "function": {"name", "namespace"?}}``,
    optionally with a tool-level ``namespace``) gets the same qualified name as its definition."""
    return normalize_tool_namespace(choice)


def split_qualified_name(name: str) -> tuple[str | None, str]:
    """``"ns::fn"`` -> ``("ns", "fn")``; an unqualified name -> ``(None, name)``."""
    if SEPARATOR in name:
        ns, rest = name.split(SEPARATOR, 1)
        return ns, rest
    return None, name
