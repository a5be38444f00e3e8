"""LLMEngine: requests in, incremental outputs out; one ``step()`` = one device call.

The engine validates a request completely before it touches any queue or pool (DESIGN rule
6), runs the scheduler's decision through the runner, and turns sampled tokens into text,
finish reasons and logprobs. Nothing here knows about HTTP.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import jax

from kk_jax.cache.pages import PageAllocator, SlotAllocator
from kk_jax.checkpoint.default import cache_root
from kk_jax.config import EngineConfig, load_model_config, resolve_dtype
from kk_jax.engine.request import (Request, RequestError, RequestOutput, SamplingParams, Status,
                                   TokenLogprob)
from kk_jax.engine.runner import (MAX_STOP_IDS, DecodeRow, ModelRunner, PendingDecode, PrefillRow, Sampled,
                                  claim_device_memory)
from kk_jax.engine.scheduler import DecodeWork, Scheduler
from kk_jax.models.registry import model_class
from kk_jax.parallel.mesh import make_mesh
from kk_jax.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger(__name__)


def enable_compilation_cache(path: str | None) -> None:
    """Turns on JAX's persistent compilation cache (default ``<cache root>/xla``), so a
    restarted server reloads its bucket programs instead of compiling them again."""
    jax.config.update("jax_compilation_cache_dir", str(path or cache_root() / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


class _Tracked:
    """Per-request output state kept beside the scheduler's Request."""

    def __init__(self, req: Request, tokenizer: Tokenizer):
        self.req = req
        self.detok = IncrementalDetokenizer(tokenizer)
        self.text = ""              # final text (stop string removed)
        self.emitted_text = 0       # chars of text already reported
        self.emitted_limit = 0      # chars of text that may be reported (holds back a possible stop prefix)
        self.emitted_tokens = 0


class LLMEngine:
    def __init__(self, model: str | Path, *, dtype: str = "auto", config: EngineConfig = EngineConfig(),
                 progress: bool = True, warmup: bool = True):
        self.model_dir = Path(model)
        self.config = config
        enable_compilation_cache(config.compilation_cache_dir)
        claim_device_memory(config.gpu_memory_utilization)
        self.model_config = load_model_config(self.model_dir)
        self.tokenizer = Tokenizer(self.model_dir)
        self.dtype = resolve_dtype(dtype, self.model_config.torch_dtype)
        self.mesh = make_mesh(config.tp)
        self.runner = ModelRunner(model_class(self.model_config.architecture), self.model_config, self.model_dir,
                                  self.dtype, config, self.mesh, progress=progress)
        self.pages = PageAllocator(self.runner.num_pages)
        self.slots = SlotAllocator(config.max_num_seqs + 1) if self.runner.has_slots else None
        self.scheduler = Scheduler(self.pages, self.runner.buckets, page_size=config.page_size,
                                   max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_model_len=config.max_model_len, decode_steps=config.decode_steps,
                                   slots=self.slots)
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids or self.model_config.eos_token_ids)
        self._rng = random.Random(config.seed)
        self._tracked: dict[str, _Tracked] = {}
        self._ahead: tuple[PendingDecode, list[DecodeWork]] | None = None   # a decode call in flight
        self._chain_broken = False
        self._arrivals = 0
        self.num_aborted = 0
        t0 = time.perf_counter()
        self.warmup_report = self.runner.warmup() if warmup else []
        if warmup:
            log.info("warm-up compiled %d programs in %.1fs", len(self.warmup_report), time.perf_counter() - t0)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """Validates and queues a request; raises RequestError without changing any state."""
        self.enqueue(self.prepare_request(request_id, prompt, params))

    def prepare_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Request:
        """Validates a request and tokenizes its prompt without touching the engine's queues (a
        caller on another thread may run it while a step is in flight); raises RequestError."""
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
        if not ids:
            raise RequestError("the prompt is empty: give at least one token", "prompt")
        self.check_token_ids(ids, "prompt", "prompt token ids")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise RequestError(f"the prompt has {len(ids)} tokens but this model's maximum context length is "
                               f"{limit} tokens (--max-model-len); shorten the prompt", "prompt")
        if len(ids) + params.max_tokens > limit:
            raise RequestError(f"this model's maximum context length is {limit} tokens, but {len(ids)} prompt "
                               f"tokens + max_tokens={params.max_tokens} = {len(ids) + params.max_tokens}; "
                               f"set max_tokens <= {limit - len(ids)}", "max_tokens")
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        stop_ids = self._stop_ids(params)
        if len(stop_ids) > MAX_STOP_IDS:
            raise RequestError(f"at most {MAX_STOP_IDS - len(self.eos_token_ids)} stop_token_ids are supported",
                               "stop_token_ids")
        seed = params.seed if params.seed is not None else self._rng.randrange(1 << 32)
        return Request(request_id, ids, params, seed=seed, arrival=-1, prompt=text)

    def enqueue(self, req: Request) -> None:
        """Queues a prepared request (the stepping thread); RequestError if its id is in use."""
        if req.request_id in self._tracked:
            raise RequestError(f"request id {req.request_id!r} is already in use", "request_id")
        req.arrival = self._arrivals
        self._arrivals += 1
        self._tracked[req.request_id] = _Tracked(req, self.tokenizer)
        self.scheduler.add(req)

    def check_token_ids(self, ids, param: str, what: str | None = None) -> None:
        """RequestError naming ``param`` if any id lies outside the vocabulary [0, vocab)."""
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"{what or param} {bad[:5]} are outside the vocabulary [0, {vocab})", param)

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            ids += [t for t in self.eos_token_ids if t not in ids]
        return ids

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stops a request and frees its pages at once; returns its final output."""
        tr = self._tracked.pop(request_id, None)
        if tr is None:
            return None
        self.num_aborted += 1
        self.scheduler.remove(tr.req)
        self._finish(tr, "abort")
        return self._output(tr)

    def has_unfinished(self) -> bool:
        return bool(self._tracked)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Runs one device call; returns an output for every request that progressed or finished."""
        touched: list[_Tracked] = []
        if self._ahead is not None and all(w.request.status == Status.FINISHED for w in self._ahead[1]):
            self._ahead[0].result()             # every row ended while the call ran: read it, schedule anew
            self._ahead = None
        if self._ahead is None:
            self._chain_broken = False
            sched = self.scheduler.schedule()
            if self.slots is not None:
                self.runner.zero_slots(self.slots.take_dirty())     # a reused slot starts from zero
            if sched.prefill:
                rows = [PrefillRow(w.request.all_token_ids[w.start:w.start + w.length], w.start, w.request.pages,
                                   w.request.slot, w.request.params, w.request.seed, len(w.request.output_token_ids))
                        for w in sched.prefill]
                for w, res in zip(sched.prefill, self.runner.prefill(rows)):
                    req = w.request
                    req.num_computed = w.start + w.length
                    if req.num_computed == req.num_tokens:        # prompt complete: keep the sample
                        touched.append(self._append(req, res))
            elif sched.decode:
                rows = [DecodeRow(w.request.all_token_ids[-1], w.request.num_tokens - 1, w.request.pages,
                                  w.request.slot, w.budget,
                                  self._stop_ids(w.request.params), w.request.params, w.request.seed,
                                  len(w.request.output_token_ids)) for w in sched.decode]
                self._ahead = self.runner.decode_start(rows), sched.decode
        if self._ahead is not None:
            call, works = self._ahead
            chain = self.config.pipeline_decode and not self._chain_broken
            self._ahead, self._chain_broken = self._dispatch_next(call, works) if chain else None, False
            for w, res in zip(works, call.result()):
                if w.request.status == Status.FINISHED:         # stopped or aborted while the call ran
                    continue
                w.request.num_computed += len(res.tokens)
                touched.append(self._append(w.request, res))
                # the device stopped a row the host goes on with: the call ahead ran it masked, and
                # the row continues from the host's state once that call is read
                self._chain_broken |= w.request.status != Status.FINISHED and len(res.tokens) < w.budget
        outs = []
        for tr in touched:
            if tr.req.status == Status.FINISHED:
                self.scheduler.remove(tr.req)
                del self._tracked[tr.req.request_id]
            outs.append(self._output(tr))
        return outs

    def _dispatch_next(self, call: PendingDecode, works: list[DecodeWork]):
        """Dispatches the next decode call of ``works``' rows before ``call``'s tokens are read,
        when the batch surely goes on without a new member: nothing waits to be admitted or
        prefilled. Each row with tokens left after its budget continues on the device from the token
        ``call`` leaves it (a row that hit a stop id stays masked; one that a stop string or an
        abort ends has its tokens dropped). Rows that have ended, or whose length ends with
        ``call``, are left out, unless a request waits for the sequence slot such a row frees
        (then the next schedule admits that request first) or the rest would fit a smaller batch
        bucket (a chained call keeps ``call``'s bucket; a fresh one runs the smaller, cheaper one).
        Returns (call, works), or None."""
        if not self.scheduler.only_decoding():
            return None
        nxt, first, follows = [], [], []   # the next call's works, each row's start position and row of ``call``
        for i, w in enumerate(works):
            req = w.request
            n_tokens = req.num_tokens + w.budget             # once ``call`` has run its whole budget
            budget = min(self.config.decode_steps, req.remaining_tokens - w.budget,
                         self.config.max_model_len - n_tokens)
            if req.status == Status.FINISHED:                 # a stop string or an abort while ``call`` ran
                continue
            if req.status != Status.RUNNING or (budget < 1 and self.scheduler.waiting):
                return None
            if budget >= 1:
                nxt.append(DecodeWork(req, budget))
                first.append(n_tokens - 1)
                follows.append(i)
        if not nxt or self.runner.buckets.decode_batch(len(nxt)) != call.batch:   # a smaller bucket: a fresh call
            return None
        if not self.scheduler.extend([(w.request, pos + w.budget) for w, pos in zip(nxt, first)]):
            return None
        rows = [DecodeRow(None, pos, w.request.pages, w.request.slot, w.budget, self._stop_ids(w.request.params),
                          w.request.params, w.request.seed, len(w.request.output_token_ids) + works[i].budget,
                          follows=i)
                for w, pos, i in zip(nxt, first, follows)]
        return self.runner.decode_start(rows, after=call), nxt

    def _append(self, req: Request, res: Sampled) -> _Tracked:
        tr = self._tracked[req.request_id]
        p = req.params
        stop_ids = set(self._stop_ids(p))
        for tok, lp, tids, tlps in zip(res.tokens, res.logprobs, res.top_ids, res.top_logprobs):
            req.output_token_ids.append(tok)
            if p.logprobs is not None:
                req.logprobs.append(TokenLogprob(tok, lp, dict(zip(tids[:p.logprobs], tlps[:p.logprobs]))))
            before = len(tr.detok.text)
            tr.detok.add([tok])
            if tok in stop_ids:
                self._finish(tr, "stop")
                break
            if p.stop and self._stop_string(tr, before):
                self._finish(tr, "stop", keep_text=True)
                break
            if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.config.max_model_len:
                self._finish(tr, "length")
                break
        if req.status != Status.FINISHED:
            hold = max((len(s) for s in p.stop), default=1) - 1     # may be the start of a stop string
            tr.text = tr.detok.text
            tr.emitted_limit = len(tr.text) - hold
        req.num_computed = min(req.num_computed, req.num_tokens - 1)
        return tr

    def _stop_string(self, tr: _Tracked, before: int) -> bool:
        text = tr.detok.text
        longest = max(len(s) for s in tr.req.params.stop)
        start = max(0, before - longest + 1)
        hits = [i for i in (text.find(s, start) for s in tr.req.params.stop) if i >= 0]
        if not hits:
            return False
        tr.text = text[:min(hits)]
        return True

    def _finish(self, tr: _Tracked, reason: str, keep_text: bool = False) -> None:
        req = tr.req
        req.status = Status.FINISHED
        req.finish_reason = reason
        if not keep_text:
            tr.text = tr.detok.text
        tr.emitted_limit = len(tr.text)

    def _output(self, tr: _Tracked) -> RequestOutput:
        req = tr.req
        limit = max(tr.emitted_text, tr.emitted_limit)
        new_text = tr.text[tr.emitted_text:limit]
        new_tokens = req.output_token_ids[tr.emitted_tokens:]
        tr.emitted_text, tr.emitted_tokens = limit, len(req.output_token_ids)
        finished = req.status == Status.FINISHED
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            text=tr.text if finished else tr.text[:limit], token_ids=list(req.output_token_ids),
            finished=finished, finish_reason=req.finish_reason, new_text=new_text, new_token_ids=new_tokens,
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None, prompt=req.prompt)

    def stats(self) -> dict:
        """Counters for metrics: pages, queue sizes, host time per device call."""
        r = self.runner
        return {"pages_total": self.pages.capacity, "pages_free": self.pages.num_free,
                "running": self.num_running, "waiting": self.num_waiting, "aborted": self.num_aborted,
                "preemptions": self.scheduler.num_preemptions, "device_calls": r.device_calls,
                "host_seconds": r.host_seconds, "compile_seconds": r.compile_seconds}
