"""Requests, their sampling parameters and the outputs handed back to callers."""

from __future__ import annotations

import dataclasses
import enum
from typing import Sequence

MAX_LOGPROBS = 20


class RequestError(ValueError):
    """A request that cannot be served as given; the message says what to change."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """vLLM-compatible sampling parameters.

    temperature 0 means greedy. top_k -1 (or 0) disables top-k; top_p 1 and min_p 0 disable
    theirs. ``seed`` makes a request's random draws its own, whatever else is batched with it.
    The logits they sample from are not bit-exact across batches: XLA picks its matmul and
    reduction tilings by the batch's shape, so what is batched with a request moves its logits
    at the rounding level (about 1e-6 for Qwen3, in fp32 and bf16). A bf16 MoE model (GLM-5.3)
    can turn such a difference into another expert choice and so another greedy or seeded token.
    ``logprobs`` = n returns the sampled token's logprob and the top-n alternatives.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        def bad(param, msg):
            raise RequestError(msg, param)
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            bad("temperature", f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", f"top_k must be -1 (disabled) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad("logprobs", f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if any(not s for s in self.stop):
            bad("stop", "stop strings must be non-empty")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class TokenLogprob:
    """Logprob of a generated token and the top alternatives {token_id: logprob}."""

    token_id: int
    logprob: float
    top: dict[int, float]


@dataclasses.dataclass
class RequestOutput:
    """State of a request after a step: cumulative text/tokens plus what is new since the last output."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None          # "stop" | "length" | "abort" | None while running
    new_text: str = ""
    new_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt: str | None = None


@dataclasses.dataclass
class Request:
    """Engine-side state of one sequence."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int                                   # per-request sampling seed (given or drawn)
    arrival: int                                # admission order, for FCFS and preemption
    prompt: str | None = None
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    status: Status = Status.WAITING
    pages: list[int] = dataclasses.field(default_factory=list)
    slot: int = 0                               # per-sequence state slot (0: none / dummy)
    num_computed: int = 0                       # tokens whose K/V are in the cache
    finish_reason: str | None = None
    num_preemptions: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_tokens - len(self.output_token_ids)
