"""DeepSeek V4.1 prompt encoding (byte-exact with the checkpoint's reference encoder).

DS4.1 ships no jinja chat template: the prompt is built in Python. The rules are in
reference/models.md §6; in short:

* special strings use U+FF5C ``｜`` and U+2581 ``▁`` (``<｜User｜>``, ``<｜begin▁of▁sentence｜>``);
* there is no tool role: tool results become ``<tool_result>…</tool_result>`` blocks of the next
  user turn, ordered like the calls of the preceding assistant message;
* assistant tool calls are written in DSML (``<｜DSML｜ calls>`` …), string arguments raw with
  ``string="true"``, anything else as JSON with ``string="false"``;
* tools are rendered into the system prompt; a numeric reasoning-effort line opens the
  conversation in thinking mode; reasoning of earlier turns is dropped unless tools are present;
* mid-conversation system messages and ``latest_reminder`` messages are part of the format.

Two layers, as in the reference: :func:`encode_messages` renders already-normalized messages;
:func:`apply_chat_template` is the API layer (OpenAI-shaped messages, request ``tools``, the
``thinking`` / ``reasoning_effort`` switches).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from kk_jax.chat.tool_names import normalize_tool_namespace

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
IMAGE = "<｜deepseek_image｜>"
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

# DSML tags (note the space between the marker and the tag name)
CALLS_OPEN, CALLS_CLOSE = f"<{DSML} calls>", f"</{DSML} calls>"
INVOKE_OPEN, INVOKE_CLOSE = f"<{DSML} invoke", f"</{DSML} invoke>"
PARAM_OPEN, PARAM_CLOSE = f"<{DSML} parameter", f"</{DSML} parameter>"

REASONING_EFFORTS = {"low": 50, "high": 75, "xhigh": 75, "max": 100}
DEFAULT_REASONING_EFFORT = "high"
ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")

_RESPONSE_FORMAT_HEAD = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"

TOOLS_TEMPLATE = (
    "## Tools\n"
    "\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    f"\"{CALLS_OPEN}\" block like the following:\n"
    "\n"
    f"{CALLS_OPEN}\n"
    f"{INVOKE_OPEN} name=\"$TOOL_NAME\">\n"
    f"{PARAM_OPEN} name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE{PARAM_CLOSE}\n"
    "...\n"
    f"{INVOKE_CLOSE}\n"
    f"{INVOKE_OPEN} name=\"$TOOL_NAME2\">\n"
    "...\n"
    f"{INVOKE_CLOSE}\n"
    f"{CALLS_CLOSE}\n"
    "\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, "
    "booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n"
    "\n"
    f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside "
    f"{THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n"
    "\n"
    f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n"
    "\n"
    "### Available Tool Schemas\n"
    "\n"
    "{schemas}\n"
    "\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)


def to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# ---------------------------------------------------------------------------------- pieces
def effort_value(effort: str | int | None) -> int:
    """The numeric budget of a reasoning effort (``low``/``high``/``xhigh``/``max`` or 1-100)."""
    if effort is None:
        effort = DEFAULT_REASONING_EFFORT
    if type(effort) is int and 1 <= effort <= 100:
        return effort
    if isinstance(effort, str) and effort in REASONING_EFFORTS:
        return REASONING_EFFORTS[effort]
    raise ValueError(f"invalid reasoning_effort {effort!r} for DeepSeek V4.1: use low, high, xhigh, max "
                     "or an integer in [1, 100]")


def render_tools(functions: list[dict]) -> str:
    return TOOLS_TEMPLATE.replace("{schemas}", "\n".join(to_json(f) for f in functions))


def _arguments_dict(arguments: Any) -> dict:
    """Call arguments as a dict: a dict as is, a JSON string (even double-encoded) decoded;
    anything else is wrapped as ``{"arguments": original}``."""
    value = arguments
    for _ in range(2):
        if isinstance(value, dict) or not isinstance(value, str):
            break
        try:
            value = json.loads(value)
        except ValueError:
            break
    return value if isinstance(value, dict) else {"arguments": arguments}


def render_dsml_parameter(key: str, value: Any) -> str:
    if isinstance(value, str):
        return f'{PARAM_OPEN} name="{key}" string="true">{value}{PARAM_CLOSE}'
    return f'{PARAM_OPEN} name="{key}" string="false">{to_json(value)}{PARAM_CLOSE}'


def render_dsml_calls(calls: list[tuple[str, Any]]) -> str:
    """``[(name, arguments), ...]`` -> the DSML ``calls`` block (no leading separator)."""
    invokes = []
    for name, arguments in calls:
        params = "\n".join(render_dsml_parameter(k, v) for k, v in _arguments_dict(arguments).items())
        invokes.append(f'{INVOKE_OPEN} name="{name}">\n{params}\n{INVOKE_CLOSE}')
    return CALLS_OPEN + "\n" + "\n".join(invokes) + "\n" + CALLS_CLOSE


def _tool_result_text(content: Any) -> str:
    if isinstance(content, list):
        return "\n\n".join(p.get("text", "") if p.get("type") == "text" else f"[Unsupported {p.get('type')}]"
                           for p in content)
    return "" if content is None else content


def _user_text(msg: dict) -> str:
    blocks = msg.get("content_blocks")
    if not blocks:
        return msg.get("content") or ""
    parts = []
    for b in blocks:
        kind = b.get("type")
        if kind == "text":
            parts.append(b.get("text") or "")
        elif kind == "tool_result":
            parts.append(f"<tool_result>{_tool_result_text(b.get('content', ''))}</tool_result>")
        else:
            parts.append(f"[Unsupported {kind}]")
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------------- preprocessing
def merge_tool_messages(messages: list[dict]) -> list[dict]:
    """Turns ``tool`` messages into ``tool_result`` blocks of user messages and merges
    consecutive user content into one user turn (unless the earlier one carries a ``task``)."""
    merged: list[dict] = []
    for original in messages:
        msg = copy.deepcopy(original)
        role = msg.get("role")
        prev = merged[-1] if merged else None
        open_user = prev is not None and prev.get("role") == "user" and "content_blocks" in prev
        if role == "tool":
            block = {"type": "tool_result", "tool_use_id": msg.get("tool_call_id", ""),
                     "content": msg.get("content", "")}
            if open_user:
                prev["content_blocks"].append(block)
            else:
                merged.append({"role": "user", "content_blocks": [block]})
        elif role == "user":
            blocks = msg.get("content_blocks")
            if blocks is None:
                blocks = [{"type": "text", "text": msg.get("content", "")}]
            if open_user and prev.get("task") is None:
                prev["content_blocks"].extend(blocks)
            else:
                msg["content_blocks"] = blocks
                merged.append(msg)
        else:
            merged.append(msg)
    return merged


def _call_id(call: Any) -> str:
    if not isinstance(call, dict):
        return ""
    fn = call.get("function")
    return call.get("id") or (fn.get("id", "") if isinstance(fn, dict) else "")


def sort_tool_results(messages: list[dict]) -> list[dict]:
    """Reorders the tool_result blocks of each user message by the position of their call in the
    most recent assistant ``tool_calls`` (unknown ids count as position 0; stable otherwise).
    Text blocks keep their slots. Mutates and returns ``messages`` (already copies)."""
    order: dict[str, int] = {}
    for msg in messages:
        role = msg.get("role")
        if role == "assistant" and msg.get("tool_calls"):
            order = {}
            for i, call in enumerate(msg["tool_calls"]):
                cid = _call_id(call)
                if cid:
                    order[cid] = i
        elif role == "user" and msg.get("content_blocks"):
            results = [b for b in msg["content_blocks"] if b.get("type") == "tool_result"]
            if len(results) > 1 and order:
                ranked = iter(sorted(results, key=lambda b: order.get(b.get("tool_use_id", ""), 0)))
                msg["content_blocks"] = [next(ranked) if b.get("type") == "tool_result" else b
                                         for b in msg["content_blocks"]]
    return messages


def last_user_index(messages: list[dict]) -> int:
    """Index of the last user turn: a ``user`` message, or a ``system`` message after index 0."""
    for i in range(len(messages) - 1, -1, -1):
        role = messages[i].get("role")
        if role == "user" or (role == "system" and i > 0):
            return i
    return -1


_KEEP_BEFORE_LAST_USER = {"user", "system", "tool", "latest_reminder", "direct_search_results"}


def drop_earlier_reasoning(messages: list[dict]) -> list[dict]:
    """Before the last user turn: assistant messages lose ``reasoning_content``; messages of
    roles outside the conversation skeleton are left out."""
    last = last_user_index(messages)
    out = []
    for i, msg in enumerate(messages):
        role = msg.get("role")
        if role in _KEEP_BEFORE_LAST_USER or i >= last:
            out.append(msg)
        elif role == "assistant":
            out.append({k: v for k, v in msg.items() if k != "reasoning_content"})
    return out


# ---------------------------------------------------------------------------------- rendering
def _render(index: int, messages: list[dict], thinking: bool, keep_thinking: bool,
            reasoning_effort: str | int | None, last_user: int) -> str:
    msg = messages[index]
    role = msg.get("role")
    effort = effort_value(reasoning_effort)           # validated for every message, used at index 0
    effort_line = (f"Reasoning Effort: {effort} (range 1-100, the higher the value, the more thorough the "
                   "reasoning)\n\n") if index == 0 and thinking else ""
    out = SYSTEM if index == 0 and (effort_line or role == "system") else ""
    out += effort_line

    if role == "system":
        if index > 0:
            out += SYSTEM
        out += msg.get("content") or ""
        if msg.get("tools"):
            functions = [normalize_tool_namespace(t)["function"] for t in msg["tools"]]
            out += "\n\n" + render_tools(functions)
        if msg.get("response_format"):
            out += "\n\n" + _RESPONSE_FORMAT_HEAD + to_json(msg["response_format"])
    elif role == "user":
        out += USER + _user_text(msg)
    elif role == "latest_reminder":
        content = msg.get("content")
        out += LATEST_REMINDER + ("" if content is None else content)
    elif role == "assistant":
        prev_task = index > 0 and messages[index - 1].get("task") is not None
        reasoning = ""
        if thinking and not prev_task and (keep_thinking or index > last_user):
            reasoning = (msg.get("reasoning_content") or "") + THINK_END
        calls = ""
        if msg.get("tool_calls"):
            fns = [normalize_tool_namespace(tc)["function"] for tc in msg["tool_calls"]]
            calls = "\n\n" + render_dsml_calls([(f.get("name"), f.get("arguments", {})) for f in fns])
        out += reasoning + (msg.get("content") or "") + calls
        if not msg.get("wo_eos", False):
            out += EOS
    elif role == "tool":
        raise ValueError("DeepSeek V4.1 has no tool role in the prompt: tool messages must be merged into user "
                         "turns first (merge_tool_messages)")
    else:
        raise ValueError(f"unknown role {role!r} for DeepSeek V4.1")

    # generation header: only when nothing but an assistant or a reminder follows
    if index + 1 < len(messages) and messages[index + 1].get("role") not in ("assistant", "latest_reminder"):
        return out
    task = msg.get("task")
    if task is not None:
        if task not in TASK_TOKENS:
            raise ValueError(f"invalid task {task!r}; valid tasks: {', '.join(TASK_TOKENS)}")
        if task == "action":
            out += ASSISTANT + (THINK_START if thinking else THINK_END) + TASK_TOKENS[task]
        else:
            out += TASK_TOKENS[task]
    elif role == "user" or (role == "system" and index > 0):
        open_think = thinking and (keep_thinking or index >= last_user)
        out += ASSISTANT + (THINK_START if open_think else THINK_END)
    return out


def encode_messages(messages: list[dict], thinking_mode: str, context: list[dict] | None = None,
                    drop_thinking: bool = True, add_default_bos_token: bool = True,
                    reasoning_effort: str | int | None = None) -> str:
    """Renders ``messages`` (after ``context``, the already-encoded history) as a DS4.1 prompt.

    ``thinking_mode`` is ``"thinking"`` or ``"chat"``. Messages use the internal shape: roles
    ``system``/``user``/``assistant``/``tool``/``latest_reminder``, ``tools`` on a system
    message, ``tool_calls`` in OpenAI form, ``reasoning_content``, optional ``task``,
    ``wo_eos``, ``content_blocks`` and ``response_format``. Tool names are namespace-normalized.
    """
    if thinking_mode not in ("chat", "thinking"):
        raise ValueError(f"thinking_mode must be 'chat' or 'thinking', got {thinking_mode!r}")
    thinking = thinking_mode == "thinking"
    raw_context = copy.deepcopy(list(context or []))
    new = sort_tool_results(raw_context + merge_tool_messages(messages))[len(raw_context):]
    context = sort_tool_results(merge_tool_messages(raw_context)) if raw_context else []
    full = context + new

    prompt = BOS if add_default_bos_token and not context else ""
    keep_thinking = not drop_thinking or any(m.get("tools") for m in full)
    if thinking and not keep_thinking:
        full = drop_earlier_reasoning(full)
        n_render = len(full) - len(drop_earlier_reasoning(context))
    else:
        n_render = len(new)
    start = len(full) - n_render
    last_user = last_user_index(full)
    for i in range(start, len(full)):
        prompt += _render(i, full, thinking, keep_thinking, reasoning_effort, last_user)
    return prompt


# ---------------------------------------------------------------------------------- API layer
def normalize_api_messages(messages: list[dict]) -> list[dict]:
    """OpenAI-shaped messages -> the encoder's shape (copies): ``developer`` becomes ``system``,
    ``reasoning`` is copied to ``reasoning_content``, list content is flattened (text parts
    joined by a blank line, images as ``<｜deepseek_image｜>``)."""
    out = []
    for original in messages:
        msg = dict(copy.deepcopy(original))
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"Invalid role: {role!r}; DeepSeek V4.1 accepts {', '.join(ROLES)}")
        if role == "developer":
            msg["role"] = "system"
        if "reasoning" in msg:
            msg["reasoning_content"] = msg["reasoning"]
        content = msg.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    parts.append(part.get("text", ""))
                elif kind in ("image_url", "input_image", "image_pil"):
                    parts.append(IMAGE)
                else:
                    raise ValueError(f"DeepSeek V4.1 supports text and image content only; got {kind!r}")
            msg["content"] = "\n\n".join(parts)
        out.append(msg)
    return out


_UNSET: Any = object()


def resolve_thinking(thinking: Any = _UNSET, enable_thinking: Any = _UNSET,
                     reasoning_effort: str | int | None = None) -> tuple[str, str | int]:
    """Request switches -> (thinking_mode, effort). Thinking is on when neither ``thinking`` nor
    ``enable_thinking`` is given; when either is given, it is on if either is truthy. The effort
    ``"none"`` turns thinking off; the effort defaults to high."""
    if thinking is _UNSET and enable_thinking is _UNSET:
        on = True
    else:
        on = bool((thinking if thinking is not _UNSET else None) or
                  (enable_thinking if enable_thinking is not _UNSET else None))
    if reasoning_effort == "none":
        on, reasoning_effort = False, None
    effort = DEFAULT_REASONING_EFFORT if reasoning_effort is None else reasoning_effort
    effort_value(effort)
    return ("thinking" if on else "chat"), effort


def apply_chat_template(messages: list[dict], tools: list[dict] | None = None, *, thinking: Any = _UNSET,
                        enable_thinking: Any = _UNSET, reasoning_effort: str | int | None = None,
                        drop_thinking: bool = True) -> str:
    """The API layer: request ``tools`` go on the first message if it is a system message,
    otherwise on an empty system message inserted in front."""
    conversation = normalize_api_messages(messages)
    if tools:
        if conversation and conversation[0]["role"] == "system":
            conversation[0]["tools"] = tools
        else:
            conversation.insert(0, {"role": "system", "content": "", "tools": tools})
    mode, effort = resolve_thinking(thinking, enable_thinking, reasoning_effort)
    return encode_messages(conversation, thinking_mode=mode, drop_thinking=drop_thinking, reasoning_effort=effort)
