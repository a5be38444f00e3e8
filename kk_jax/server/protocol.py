"""Pydantic request/response models of the OpenAI API subset we serve (vLLM-compatible
extensions: ``top_k``, ``min_p``, ``ignore_eos``, ``stop_token_ids``)."""

from __future__ import annotations

import time
import typing
import uuid
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kk_jax.engine.request import MAX_LOGPROBS

MAX_N = 32
# OpenAI / vLLM request fields this server does not implement: {name: the values that mean "off"};
# any other value is refused with a 400 rather than silently ignored
UNSUPPORTED = {"logit_bias": (None, {}), "best_of": (None, 1), "suffix": (None, ""), "repetition_penalty": (None, 1),
               "min_tokens": (None, 0), "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
               "guided_grammar": (None,), "logits_processors": (None, [])}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions (OpenAI + vLLM extensions)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """``null`` for a field that is not nullable here (``n``, ``stream``, ``echo``, ...) means
        its default, as OpenAI's and vLLM's APIs take it."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if v is not None or k not in fields or type(None) in typing.get_args(fields[k].annotation)}

    model: Optional[str] = None
    temperature: Optional[Annotated[float, Field(ge=0.0)]] = None
    top_p: Optional[Annotated[float, Field(gt=0.0, le=1.0)]] = None
    top_k: Optional[Annotated[int, Field(ge=-1)]] = None
    min_p: Optional[Annotated[float, Field(ge=0.0, le=1.0)]] = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    seed: Optional[int] = None
    ignore_eos: bool = False
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    user: Optional[str] = None


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[Annotated[int, Field(ge=1)]] = 16
    echo: bool = False
    logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]] = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCallIn(BaseModel):
    """A function call of an assistant message in the history. ``arguments`` is a JSON
    object text (OpenAI) or the object itself; ``namespace`` qualifies the name (``ns::name``)."""

    name: str
    arguments: Union[str, dict] = "{}"
    namespace: Optional[Union[str, dict]] = None


class ToolCallIn(BaseModel):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCallIn
    namespace: Optional[Union[str, dict]] = None


class ChatMessage(BaseModel):
    """A chat message. ``latest_reminder`` is accepted only by models whose encoder has that role
    (DeepSeek V4.1); ``tool`` messages answer the call with id ``tool_call_id``."""

    role: Literal["system", "developer", "user", "assistant", "tool", "latest_reminder"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCallIn]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def to_dict(self) -> dict:
        """The message as the chat encoders take it (absent fields left out)."""
        return self.model_dump(exclude_none=True)


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    max_completion_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    logprobs: bool = False
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]] = None
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[str, dict]] = None
    parallel_tool_calls: Optional[bool] = None
    reasoning_effort: Optional[Union[str, int]] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict] = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[Optional[float]] = []
    top_logprobs: list[Optional[dict[str, float]]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: Optional[list[TokenLogprobOut]] = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCallOut]] = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kk_jax"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(BaseModel):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[Annotated[list[ChatMessage], Field(min_length=1)]] = None
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo
