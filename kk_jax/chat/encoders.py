"""Chat encoders: one interface from OpenAI-shaped messages (+ tools) to the prompt text, chosen
by the checkpoint's config.

* :class:`TemplateChatEncoder` renders the checkpoint's jinja ``chat_template`` (Qwen3, GLM-5.3
  and any other HF checkpoint). Its tool-call format is recognised from the template: GLM's
  ``<arg_key>``/``<arg_value>`` tags, or Hermes-style JSON inside ``<tool_call>`` (Qwen3).
* :class:`DeepseekV41ChatEncoder` runs the Python encoder of :mod:`kk_jax.chat.deepseek_v41`
  (DS4.1 ships no jinja template) and parses DSML tool calls.

Every encoder folds tool namespaces (``ns::name``, :mod:`kk_jax.chat.tool_names`) in tool
definitions and in the tool-call history before rendering, lists the message roles it accepts,
and can prefill the assistant turn with the opening of a tool call when the request demands one
(``tool_choice`` ``required`` or a named function).
"""

from __future__ import annotations

import json
from typing import Any

from kk_jax.chat import deepseek_v41 as ds41
from kk_jax.chat.template import render_chat
from kk_jax.chat.tool_names import normalize_messages_tool_calls, normalize_tool_namespace
from kk_jax.chat.tool_parsers import ToolCallParser, make_tool_parser

BASE_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class ChatEncoder:
    """Interface. ``encode`` raises ``ValueError`` (with the reason) for input it cannot render."""

    name = "base"
    tool_format: str | None = None          # "hermes" | "glm" | "dsml" | None (no tool calling)
    roles: frozenset[str] = BASE_ROLES

    def encode(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
               **kwargs) -> str:
        raise NotImplementedError

    def tool_parser(self, tools: list[dict] | None = None) -> ToolCallParser:
        if self.tool_format is None:
            raise ValueError(f"the {self.name} chat encoder has no tool-call format")
        return make_tool_parser(self.tool_format, tools)

    def forced_call_prefix(self, prompt: str, name: str | None) -> tuple[str, str]:
        """Text to append to ``prompt`` so that the assistant turn starts a tool call (of
        function ``name`` when given), and the part of it that belongs to the call (fed to
        the tool parser ahead of the model's output)."""
        raise NotImplementedError

    def check_roles(self, messages: list[dict]) -> None:
        for i, m in enumerate(messages):
            role = m.get("role")
            if role not in self.roles:
                only = " (only DeepSeek V4.1 models accept it)" if role == "latest_reminder" else ""
                raise RoleError(i, f"messages[{i}]: role {role!r} is not supported by this model{only}; "
                                   f"use one of {', '.join(sorted(self.roles))}")


class RoleError(ValueError):
    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index


def _text(content: Any) -> str:
    """Message content as one string: text parts concatenated, None as empty."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    raise ValueError(f"message content must be a string or a list of text parts, got {type(content).__name__}")


def _arguments_for_template(arguments: Any) -> Any:
    """OpenAI sends call arguments as a JSON string; templates iterate them as a mapping."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments


def detect_tool_format(template: str | None) -> str | None:
    if not template:
        return None
    if "<arg_key>" in template:
        return "glm"
    if "<tool_call>" in template:
        return "hermes"
    return None


class TemplateChatEncoder(ChatEncoder):
    """The checkpoint's jinja chat template (HF ``apply_chat_template`` semantics)."""

    def __init__(self, template: str, *, bos_token: str = "", eos_token: str = "", name: str = "template",
                 tool_format: str | None = None):
        self.template = template
        self.bos_token, self.eos_token, self.name = bos_token, eos_token, name
        self.tool_format = tool_format if tool_format is not None else detect_tool_format(template)
        self.thinks = "<think>" in template

    def _prepare(self, messages: list[dict]) -> list[dict]:
        out = []
        for m in normalize_messages_tool_calls(list(messages)):
            m = dict(m)
            if m.get("role") == "developer":
                m["role"] = "system"
            m["content"] = _text(m.get("content"))
            if "reasoning" in m and "reasoning_content" not in m:
                m["reasoning_content"] = m["reasoning"]
            if m.get("tool_calls"):
                calls = []
                for tc in m["tool_calls"]:
                    tc = dict(tc)
                    if isinstance(tc.get("function"), dict):
                        fn = dict(tc["function"])
                        fn["arguments"] = _arguments_for_template(fn.get("arguments", {}))
                        tc["function"] = fn
                    calls.append(tc)
                m["tool_calls"] = calls
            out.append(m)
        return out

    def encode(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
               **kwargs) -> str:
        self.check_roles(messages)
        if tools:
            tools = [normalize_tool_namespace(t) for t in tools]
        extra = {"tools": tools} if tools else {}
        return render_chat(self.template, self._prepare(messages), add_generation_prompt=add_generation_prompt,
                           bos_token=self.bos_token, eos_token=self.eos_token, **extra, **kwargs)

    def forced_call_prefix(self, prompt: str, name: str | None) -> tuple[str, str]:
        if self.tool_format == "hermes":
            think = "<think>\n\n</think>\n\n" if self.thinks and not prompt.rstrip().endswith("</think>") else ""
            call = "<tool_call>\n" + ("" if name is None else '{"name": ' + json.dumps(name, ensure_ascii=False)
                                      + ', "arguments": ')
            return think + call, call
        if self.tool_format == "glm":
            think = "</think>" if prompt.endswith("<think>") else ""
            call = "<tool_call>" + (name or "")
            return think + call, call
        raise ValueError(f"the {self.name} chat template has no tool-call format")


class DeepseekV41ChatEncoder(ChatEncoder):
    """DeepSeek V4.1: the Python prompt encoder and DSML tool calls. Request switches (in
    ``chat_template_kwargs`` or the top-level ``reasoning_effort``): ``thinking`` /
    ``enable_thinking`` (default on), ``reasoning_effort`` (low/high/xhigh/max, 1-100, or
    none = thinking off) and ``drop_thinking`` (default true)."""

    name = "deepseek_v41"
    tool_format = "dsml"
    roles = BASE_ROLES | {"latest_reminder"}

    def encode(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
               **kwargs) -> str:
        self.check_roles(messages)
        unknown = set(kwargs) - {"thinking", "enable_thinking", "reasoning_effort", "drop_thinking"}
        if unknown:
            raise ValueError(f"unknown DeepSeek V4.1 chat options {sorted(unknown)}; accepted: thinking, "
                             "enable_thinking, reasoning_effort, drop_thinking")
        prompt = ds41.apply_chat_template(messages, tools, **kwargs)
        if not add_generation_prompt:
            # the generation header is what follows the last user turn; without it the prompt
            # ends where that turn's text ends
            for tail in (ds41.ASSISTANT + ds41.THINK_START, ds41.ASSISTANT + ds41.THINK_END):
                if prompt.endswith(tail):
                    return prompt[:-len(tail)]
        return prompt

    def forced_call_prefix(self, prompt: str, name: str | None) -> tuple[str, str]:
        think = ds41.THINK_END if prompt.endswith(ds41.THINK_START) else ""
        call = ds41.CALLS_OPEN + "\n" + ("" if name is None else f'{ds41.INVOKE_OPEN} name="{name}">\n')
        return think + "\n\n" + call, call


# ------------------------------------------------------------------------------ selection
def _pick_template(template: Any) -> str | None:
    """HF allows ``chat_template`` to be a list of ``{"name", "template"}``: take ``default``."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) and template else None


def model_type_of(config: dict) -> str:
    mt = config.get("model_type") or (config.get("text_config") or {}).get("model_type") or ""
    return str(mt)


def chat_encoder_for(config: dict, template: str | None, *, bos_token: str = "",
                     eos_token: str = "") -> ChatEncoder | None:
    """The encoder for a checkpoint: DS4.1 by its config (``model_type`` ``deepseek_v41``),
    everything else through its chat template (None when it has none)."""
    model_type = model_type_of(config)
    archs = [str(a) for a in config.get("architectures") or []]
    if model_type == "deepseek_v41" or any(a.startswith("DeepseekV41") for a in archs):
        return DeepseekV41ChatEncoder()
    template = _pick_template(template)
    if template is None:
        return None
    name = {"qwen3": "qwen3", "glm5_next": "glm5", "glm5_next_text": "glm5"}.get(model_type, model_type or "template")
    fmt = "glm" if name == "glm5" else None
    return TemplateChatEncoder(template, bos_token=bos_token, eos_token=eos_token, name=name, tool_format=fmt)

