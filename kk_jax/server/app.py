"""The FastAPI application: OpenAI-compatible routes over an AsyncEngine."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import AsyncIterator

import jax
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kk_jax.chat.encoders import ChatEncoder, RoleError
from kk_jax.chat.openai_tools import (ToolChoice, ToolRequestError, resolve_tool_choice, validate_history,
                                      validate_tools)
from kk_jax.chat.template import ChatTemplateError
from kk_jax.chat.tool_parsers import Call, Content, ToolCall
from kk_jax.engine.async_engine import AsyncEngine, EngineDeadError, StepFailed
from kk_jax.engine.request import RequestError, RequestOutput, SamplingParams
from kk_jax.server import protocol as P
from kk_jax.server.errors import (APIError, api_error_handler, error_response, http_error_handler,
                                  unexpected_handler, validation_handler)
from kk_jax.server.metrics import RequestTimer, ServerMetrics


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...]
    model_path: str
    max_model_len: int
    api_key: str | None = None
    profile_dir: str | None = None
    max_body_bytes: int = 8 << 20


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@dataclasses.dataclass
class ToolPlan:
    """How one chat request uses tools: the (normalized) definitions shown to the model, the
    resolved ``tool_choice``, ``parallel_tool_calls`` and the tool-call opening prefilled into the
    assistant turn when a call is forced (fed to the output parser ahead of the model's text)."""

    encoder: ChatEncoder
    tools: list[dict]
    choice: ToolChoice
    parallel: bool
    prefill: str = ""

    def parser(self):
        return self.encoder.tool_parser(self.tools)


class CallSelector:
    """Which parsed calls are returned: only the named function under a named ``tool_choice``;
    only the first call when ``parallel_tool_calls`` is false. Assigns OpenAI call ids."""

    def __init__(self, plan: ToolPlan):
        self.plan, self.count = plan, 0

    def take(self, call: ToolCall) -> dict | None:
        if self.plan.choice.mode == "function" and call.name != self.plan.choice.name:
            return None
        if not self.plan.parallel and self.count >= 1:
            return None
        self.count += 1
        return {"id": P.new_id("call").replace("-", "_"), "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}


def create_app(engine: AsyncEngine, cfg: ServerConfig) -> FastAPI:
    app = FastAPI(title="kk_jax", version="0.1.0",
                  description="OpenAI-compatible server of the kk_jax JAX/Pallas engine")
    app.add_exception_handler(RequestValidationError, validation_handler)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, unexpected_handler)
    metrics = ServerMetrics(cfg.served_model_names[0])
    tok = engine.engine.tokenizer
    profiling = {"on": False}

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > cfg.max_body_bytes):
            return error_response(413, f"request body exceeds the {cfg.max_body_bytes}-byte limit "
                                       "(--max-request-body-bytes)")
        return await call_next(request)

    async def auth(request: Request):
        if cfg.api_key and request.headers.get("authorization") != f"Bearer {cfg.api_key}":
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'")

    def check_model(name: str | None) -> str:
        if name is not None and name not in cfg.served_model_names and name != cfg.model_path:
            raise APIError(404, f"The model `{name}` does not exist.", "model")
        return cfg.served_model_names[0]

    # ------------------------------------------------------------------ helpers
    def check_request(req) -> None:
        """400 for request fields this server does not implement, once per request."""
        if req.presence_penalty or req.frequency_penalty:
            raise APIError(400, "presence_penalty and frequency_penalty are not supported; leave them at 0",
                           "presence_penalty" if req.presence_penalty else "frequency_penalty")
        for name, value in (req.model_extra or {}).items():
            if name in P.UNSUPPORTED and value not in P.UNSUPPORTED[name]:
                raise APIError(400, f"{name} is not supported; leave it out", name)
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")
        if getattr(req, "echo", False) and req.logprobs is not None:
            raise APIError(400, "echo with logprobs (the prompt's logprobs) is not supported; drop one of them",
                           "echo")

    def sampling(req, max_tokens: int, logprobs: int | None, seed: int | None) -> SamplingParams:
        try:
            return SamplingParams(max_tokens=max_tokens,
                                  temperature=1.0 if req.temperature is None else req.temperature,
                                  top_k=-1 if req.top_k in (None, 0) else req.top_k,
                                  top_p=1.0 if req.top_p is None else req.top_p,
                                  min_p=0.0 if req.min_p is None else req.min_p, seed=seed,
                                  stop=[req.stop] if isinstance(req.stop, str) else (req.stop or []),
                                  stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos,
                                  logprobs=logprobs)
        except RequestError as e:
            raise APIError(400, str(e), e.param) from None

    def check_ids(ids: list[int], param: str, what: str) -> None:
        try:
            engine.engine.check_token_ids(ids, param, what)
        except RequestError as e:
            raise APIError(400, str(e), e.param) from None

    def prompt_ids(prompt: str | list[int]) -> list[int]:
        ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise APIError(400, "the prompt is empty", "prompt")
        check_ids(ids, "prompt", "prompt token ids")         # before anything decodes them (echo)
        if len(ids) >= cfg.max_model_len:
            raise APIError(400, f"This model's maximum context length is {cfg.max_model_len} tokens. However, "
                                f"your prompt has {len(ids)} tokens; shorten it", "prompt")
        return ids

    def max_tokens_for(requested: int | None, n_prompt: int) -> int:
        room = cfg.max_model_len - n_prompt
        if requested is None:
            return room
        if requested > room:
            raise APIError(400, f"This model's maximum context length is {cfg.max_model_len} tokens. However, you "
                                f"requested {n_prompt + requested} tokens ({n_prompt} in the prompt, {requested} "
                                f"for the completion). Reduce max_tokens to at most {room}.", "max_tokens")
        return requested

    def token_str(i: int) -> str:
        return tok.decode([i], skip_special_tokens=False)

    async def run(items) -> AsyncIterator[tuple[int, RequestOutput]]:
        """engine.stream with metrics; maps engine errors to API errors."""
        start = time.perf_counter()
        timers = [RequestTimer(metrics, start) for _ in items]
        try:
            async for i, out in engine.stream(items):
                now = time.perf_counter()
                timers[i].tokens(now, len(out.new_token_ids))
                if out.finished:
                    timers[i].done(now)
                    metrics.finished(out.finish_reason, len(out.prompt_token_ids))
                yield i, out
        except RequestError as e:
            raise APIError(400, str(e), e.param) from None
        except EngineDeadError as e:
            raise APIError(503, str(e)) from None
        except StepFailed as e:
            raise APIError(500, str(e)) from None

    async def collect(raw: Request, items) -> list[RequestOutput]:
        """Runs to completion unless the client goes away (then everything is aborted)."""
        finals: dict[int, RequestOutput] = {}

        async def consume():
            async for i, out in run(items):
                if out.finished:
                    finals[i] = out

        task = asyncio.create_task(consume())
        # after the body is read, the next ASGI message is http.disconnect (if the client leaves)
        gone = asyncio.create_task(raw.receive())
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()                  # aborts the requests and frees their pages,
                await asyncio.wait({task})     # which is done once the task has ended
        if task.cancelled():
            raise APIError(400, "client disconnected")
        task.result()
        return [finals[i] for i in range(len(items))]

    def usage(outs: list[RequestOutput], prompt_counts: list[int]) -> dict:
        """OpenAI usage: each prompt counted once (not once per choice of ``n``), every completion."""
        p = sum(prompt_counts)
        c = sum(len(o.token_ids) for o in outs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def completion_logprobs(out: RequestOutput, new_only: bool, offset: int) -> dict | None:
        if out.logprobs is None:
            return None
        lps = out.logprobs[len(out.token_ids) - len(out.new_token_ids):] if new_only else out.logprobs
        tokens = [token_str(lp.token_id) for lp in lps]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{token_str(k): v for k, v in lp.top.items()} for lp in lps],
                "text_offset": offsets}

    def chat_logprobs(out: RequestOutput, new_only: bool, top: int) -> dict | None:
        if out.logprobs is None:
            return None
        lps = out.logprobs[len(out.token_ids) - len(out.new_token_ids):] if new_only else out.logprobs

        def entry(i, lp):
            s = token_str(i)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}
        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(k, v) for k, v in list(lp.top.items())[:top]]} for lp in lps]}

    async def streaming_response(items, envelope: dict, stream_options, head: list[list[dict]], choices,
                                 prompt_counts: list[int]) -> StreamingResponse:
        """SSE stream as OpenAI sends it: ``head`` chunks, one chunk per choice update from
        ``choices(i, output)``, an optional usage chunk (``choices: []``), then ``[DONE]``.
        The first output is awaited before the response starts, so request errors are plain
        HTTP errors rather than events inside a started stream."""
        include_usage = bool(stream_options and stream_options.include_usage)
        agen = run(items)
        first = await _first(agen)

        def chunk(chs: list[dict]) -> str:
            return sse({**envelope, "choices": chs, **({"usage": None} if include_usage else {})})

        async def events():
            finals: dict[int, RequestOutput] = {}
            for chs in head:
                yield chunk(chs)
            try:
                async for i, out in _chain(first, agen):
                    for ch in choices(i, out):
                        yield chunk([ch])
                    if out.finished:
                        finals[i] = out
            except APIError as e:
                yield sse({"error": {"message": e.message, "type": "APIError", "param": e.param, "code": e.status}})
                return
            if include_usage:
                outs = [finals[i] for i in range(len(items))]
                yield sse({**envelope, "choices": [], "usage": usage(outs, prompt_counts)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    # ------------------------------------------------------------------ routes
    @app.get("/health")
    async def health():
        if not engine.alive:
            return error_response(503, "the engine is not running")
        return Response(status_code=200)

    @app.get("/v1/models", dependencies=[Depends(auth)], response_model=P.ModelList)
    async def models():
        return P.ModelList(data=[P.ModelCard(id=n, root=cfg.model_path, max_model_len=cfg.max_model_len)
                                 for n in cfg.served_model_names])

    @app.post("/v1/completions", dependencies=[Depends(auth)], response_model=P.CompletionResponse)
    async def completions(req: P.CompletionRequest, raw: Request):
        model = check_model(req.model)
        check_request(req)
        p = req.prompt
        if isinstance(p, list) and not p:
            raise APIError(400, "prompt must not be empty", "prompt")
        prompts = [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)
        ids = [prompt_ids(x) for x in prompts]
        items, meta = [], []
        for pi, pid in enumerate(ids):
            mt = max_tokens_for(req.max_tokens, len(pid))
            for k in range(req.n):
                seed = None if req.seed is None else req.seed + k
                items.append((P.new_id("cmpl-req"), pid, sampling(req, mt, req.logprobs, seed)))
                meta.append(pi)
        echo = [tok.decode(pid, skip_special_tokens=False) if req.echo else "" for pid in ids]
        rid, created = P.new_id("cmpl"), int(time.time())

        if not req.stream:
            outs = await collect(raw, items)
            choices = []
            for i, o in enumerate(outs):
                pre = echo[meta[i]]
                choices.append({"index": i, "text": pre + o.text, "finish_reason": o.finish_reason,
                                "logprobs": completion_logprobs(o, False, len(pre))})
            return {"id": rid, "object": "text_completion", "created": created, "model": model,
                    "choices": choices, "usage": usage(outs, [len(pid) for pid in ids])}

        sent = {i: len(echo[meta[i]]) for i in range(len(items))}

        def choices(i: int, out: RequestOutput) -> list[dict]:
            if not out.new_text and not out.finished and not (out.logprobs and out.new_token_ids):
                return []
            lp = completion_logprobs(out, True, sent[i])
            sent[i] += len(out.new_text)
            return [{"index": i, "text": out.new_text, "logprobs": lp,
                     "finish_reason": out.finish_reason if out.finished else None}]

        head = [[{"index": i, "text": echo[meta[i]], "logprobs": None, "finish_reason": None}]
                for i in range(len(items))] if req.echo else []
        envelope = {"id": rid, "object": "text_completion", "created": created, "model": model}
        return await streaming_response(items, envelope, req.stream_options, head, choices,
                                        [len(pid) for pid in ids])

    def chat_prompt(req: P.ChatCompletionRequest) -> tuple[list[int], ToolPlan | None]:
        """Prompt ids of a chat request and its tool plan (None when no tools are in play)."""
        enc = tok.chat_encoder
        if enc is None:
            raise APIError(400, "this checkpoint has no chat_template in tokenizer_config.json; use completions "
                                "with a plain prompt instead", "messages")
        if req.response_format is not None and req.response_format.type != "text":
            raise APIError(400, f"response_format type {req.response_format.type!r} is not supported; use 'text'",
                           "response_format")
        messages = [m.to_dict() for m in req.messages]
        try:
            enc.check_roles(messages)
            tools = validate_tools(req.tools)
            choice = resolve_tool_choice(req.tool_choice, tools)
            messages = validate_history(messages)
        except RoleError as e:
            raise APIError(400, str(e), f"messages.{e.index}.role") from None
        except ToolRequestError as e:
            raise APIError(400, str(e), e.param) from None
        use_tools = tools if choice.mode != "none" else []
        if use_tools and enc.tool_format is None:
            raise APIError(400, "this model's chat template has no tool-call format; remove `tools` (or set "
                                "tool_choice to 'none')", "tools")
        kwargs = dict(req.chat_template_kwargs or {})
        if req.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        prefill = ""
        try:
            text = enc.encode(messages, tools=use_tools or None, add_generation_prompt=req.add_generation_prompt,
                              **kwargs)
            if choice.forces_call and req.add_generation_prompt:
                suffix, prefill = enc.forced_call_prefix(text, choice.name)
                text += suffix
        except RoleError as e:
            raise APIError(400, str(e), f"messages.{e.index}.role") from None
        except (ChatTemplateError, ValueError, TypeError) as e:
            raise APIError(400, str(e), "messages") from None
        plan = ToolPlan(enc, use_tools, choice, req.parallel_tool_calls is not False, prefill) if use_tools else None
        return prompt_ids(text), plan

    def tool_message(plan: ToolPlan, text: str) -> tuple[dict, bool]:
        """The assistant message of a finished output with its tool calls parsed out."""
        parser, pick = plan.parser(), CallSelector(plan)
        events = parser.feed(plan.prefill) + parser.feed(text) + parser.finish()
        content = "".join(e.text for e in events if isinstance(e, Content))
        calls = [c for c in (pick.take(e.call) for e in events if isinstance(e, Call)) if c is not None]
        msg = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            msg["tool_calls"] = calls
        return msg, bool(calls)

    def tool_stream(plan: ToolPlan, n: int, top: int):
        """Per-output SSE choice updates with tool calls parsed out of the text as it streams:
        content deltas, one ``tool_calls`` delta per call (id, name and full arguments) as soon
        as the call is complete, and ``finish_reason: "tool_calls"`` when any call was made."""
        parsers = [plan.parser() for _ in range(n)]
        pickers = [CallSelector(plan) for _ in range(n)]
        pending = [parsers[i].feed(plan.prefill) for i in range(n)]

        def choices(i: int, out: RequestOutput) -> list[dict]:
            events, pending[i] = pending[i] + parsers[i].feed(out.new_text), []
            if out.finished:
                events += parsers[i].finish()
            lp = chat_logprobs(out, True, top) if out.logprobs and out.new_token_ids else None
            out_choices = []
            for ev in events:
                if isinstance(ev, Content):
                    delta = {"content": ev.text}
                else:
                    call = pickers[i].take(ev.call)
                    if call is None:
                        continue
                    delta = {"tool_calls": [{"index": pickers[i].count - 1, **call}]}
                out_choices.append({"index": i, "delta": delta, "logprobs": lp, "finish_reason": None})
                lp = None
            if lp is not None:
                out_choices.append({"index": i, "delta": {"content": ""}, "logprobs": lp, "finish_reason": None})
            if out.finished:
                reason = "tool_calls" if pickers[i].count else out.finish_reason
                out_choices.append({"index": i, "delta": {}, "logprobs": None, "finish_reason": reason})
            return out_choices
        return choices

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)], response_model=P.ChatCompletionResponse)
    async def chat(req: P.ChatCompletionRequest, raw: Request):
        model = check_model(req.model)
        check_request(req)
        ids, plan = chat_prompt(req)
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", "top_logprobs")
        mt = max_tokens_for(req.max_completion_tokens or req.max_tokens, len(ids))
        n_lp = (req.top_logprobs or 0) if req.logprobs else None
        items = [(P.new_id("chat-req"), ids, sampling(req, mt, n_lp, None if req.seed is None else req.seed + k))
                 for k in range(req.n)]
        rid, created = P.new_id("chatcmpl"), int(time.time())
        top = req.top_logprobs or 0

        if not req.stream:
            outs = await collect(raw, items)
            choices = []
            for i, o in enumerate(outs):
                msg, called = tool_message(plan, o.text) if plan else ({"role": "assistant", "content": o.text}, False)
                choices.append({"index": i, "message": msg, "logprobs": chat_logprobs(o, False, top),
                                "finish_reason": "tool_calls" if called else o.finish_reason})
            return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                    "choices": choices, "usage": usage(outs, [len(ids)])}

        def text_choices(i: int, out: RequestOutput) -> list[dict]:
            out_choices = []
            if out.new_text or (out.logprobs and out.new_token_ids):
                out_choices.append({"index": i, "delta": {"content": out.new_text},
                                    "logprobs": chat_logprobs(out, True, top), "finish_reason": None})
            if out.finished:
                out_choices.append({"index": i, "delta": {}, "logprobs": None, "finish_reason": out.finish_reason})
            return out_choices

        choices = text_choices if plan is None else tool_stream(plan, len(items), top)
        head = [[{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
                for i in range(len(items))]
        envelope = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        return await streaming_response(items, envelope, req.stream_options, head, choices, [len(ids)])

    @app.post("/tokenize", response_model=P.TokenizeResponse)
    async def tokenize(req: P.TokenizeRequest):
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of `prompt` or `messages`", "prompt")
        if req.prompt is not None:
            ids = tok.encode(req.prompt)
        else:
            try:
                ids = tok.encode(tok.apply_chat_template([m.to_dict() for m in req.messages],
                                                         add_generation_prompt=req.add_generation_prompt))
            except RoleError as e:
                raise APIError(400, str(e), f"messages.{e.index}.role") from None
            except (ChatTemplateError, ValueError, TypeError) as e:
                raise APIError(400, str(e), "messages") from None
        return {"count": len(ids), "max_model_len": cfg.max_model_len, "tokens": ids}

    @app.post("/detokenize", response_model=P.DetokenizeResponse)
    async def detokenize(req: P.DetokenizeRequest):
        check_model(req.model)
        check_ids(req.tokens, "tokens", "token ids")
        return {"prompt": tok.decode(req.tokens)}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(engine.stats()), media_type="text/plain; version=0.0.4")

    @app.post("/start_profile")
    async def start_profile():
        if not cfg.profile_dir:
            raise APIError(400, "profiling is off: start the server with --profile-dir DIR")
        if profiling["on"]:
            raise APIError(400, "a profile is already being recorded; POST /stop_profile first")
        Path(cfg.profile_dir).mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(cfg.profile_dir)
        profiling["on"] = True
        return {"status": "profiling", "profile_dir": cfg.profile_dir}

    @app.post("/stop_profile")
    async def stop_profile():
        if not profiling["on"]:
            raise APIError(400, "no profile is being recorded; POST /start_profile first")
        jax.profiler.stop_trace()
        profiling["on"] = False
        return {"status": "stopped", "profile_dir": cfg.profile_dir}

    return app


async def _first(agen):
    """Pulls the first item so that validation errors surface before the stream starts (as a
    plain HTTP error rather than inside an already-started SSE response)."""
    try:
        return await agen.__anext__()
    except StopAsyncIteration:
        return None


async def _chain(first, agen):
    if first is not None:
        yield first
    async for item in agen:
        yield item
