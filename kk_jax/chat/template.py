"""Renders HF ``chat_template`` strings with jinja2 in an immutable sandbox (templates come
from checkpoints, i.e. untrusted input)."""

from __future__ import annotations

import json
from functools import lru_cache

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The chat template rejected the messages (or is broken)."""


def _raise(message: str):
    raise ChatTemplateError(message)


@lru_cache(maxsize=8)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                   ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = _raise
    return env.from_string(template)


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **kwargs)
    except ChatTemplateError:
        raise
    except TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError) as e:
        # the template met data of a shape it does not handle (e.g. a non-string name)
        raise ChatTemplateError(f"chat template failed on these messages: {type(e).__name__}: {e}") from None
