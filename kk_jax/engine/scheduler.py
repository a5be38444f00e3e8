"""Continuous-batching scheduler (host side).

Each step is either a prefill step (chunks of prompts, at most ``max_num_batched_tokens``
padded tokens) or a decode step (every running sequence, ``decode_steps`` tokens each).
When both kinds of work exist the two alternate, so long prompts never stall streaming
decodes for more than one step. Pages are allocated before a step runs; when they run out,
the most recently admitted running sequence is preempted by recompute (pages freed, its
prompt + generated tokens queued for prefill again), vLLM's default policy.
"""

from __future__ import annotations

import collections
import dataclasses
import math

from kk_jax.cache.pages import PageAllocator, SlotAllocator
from kk_jax.engine.request import Request, Status
from kk_jax.engine.runner import Buckets


@dataclasses.dataclass
class PrefillWork:
    request: Request
    start: int
    length: int


@dataclasses.dataclass
class DecodeWork:
    request: Request
    budget: int


@dataclasses.dataclass
class Schedule:
    prefill: list[PrefillWork] = dataclasses.field(default_factory=list)
    decode: list[DecodeWork] = dataclasses.field(default_factory=list)
    preempted: list[Request] = dataclasses.field(default_factory=list)


class Scheduler:
    def __init__(self, pages: PageAllocator, buckets: Buckets, *, page_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, decode_steps: int,
                 slots: SlotAllocator | None = None):
        """``slots``: per-sequence state slots for models that keep recurrent state (one per
        admitted request, held until it finishes or is preempted); None for pure-KV models."""
        self.pages, self.buckets, self.slots = pages, buckets, slots
        self.page_size, self.max_num_seqs = page_size, max_num_seqs
        self.budget, self.max_model_len, self.decode_steps = max_num_batched_tokens, max_model_len, decode_steps
        self.waiting: collections.deque[Request] = collections.deque()   # not yet admitted (or preempted)
        self.running: list[Request] = []                                  # admitted, hold pages
        self._last_was_prefill = False
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Drops a request from the queues and frees its pages (finish or abort)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)

    def _release(self, req: Request) -> None:
        if req.pages:
            self.pages.free(req.pages)
            req.pages = []
        if req.slot:
            self.slots.free(req.slot)
            req.slot = 0
        req.num_computed = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ pages
    def _pages_for(self, req: Request, num_tokens: int) -> int:
        """Extra pages ``req`` needs so that ``num_tokens`` positions fit."""
        return max(0, math.ceil(num_tokens / self.page_size) - len(req.pages))

    def _grow(self, req: Request, num_tokens: int, sched: Schedule, protect: set[int]) -> bool:
        """Allocates pages up to ``num_tokens``, preempting newer running requests if needed."""
        need = self._pages_for(req, num_tokens)
        while need > self.pages.num_free:
            victims = [r for r in self.running if id(r) not in protect and r is not req]
            if not victims:
                return False
            victim = max(victims, key=lambda r: r.arrival)
            self._preempt(victim, sched)
        if need:
            req.pages += self.pages.allocate(need)
        return True

    def extend(self, wants: list[tuple[Request, int]]) -> bool:
        """Pages so that each request holds ``num_tokens`` positions, for all or none of them and
        without preempting anyone (a decode call dispatched ahead)."""
        need = [self._pages_for(req, n) for req, n in wants]
        if sum(need) > self.pages.num_free:
            return False
        for (req, _), k in zip(wants, need):
            if k:
                req.pages += self.pages.allocate(k)
        return True

    def only_decoding(self) -> bool:
        """Whether the next schedule would be a decode of every running request: none is still
        prefilling and no waiting one could be admitted."""
        return (all(r.num_computed == r.num_tokens - 1 for r in self.running)
                and not (self.waiting and len(self.running) < self.max_num_seqs))

    def _preempt(self, req: Request, sched: Schedule) -> None:
        self.running.remove(req)
        self._release(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        sched.preempted.append(req)

    # ------------------------------------------------------------------ policy
    def schedule(self) -> Schedule:
        # one uncomputed token left = ready to decode (decode computes that token's K/V)
        prefilling = [r for r in self.running if r.num_computed < r.num_tokens - 1]
        decoding = [r for r in self.running if r.num_computed == r.num_tokens - 1]
        want_prefill = bool(prefilling or (self.waiting and len(self.running) < self.max_num_seqs))
        if want_prefill and not (decoding and self._last_was_prefill):
            sched = self._schedule_prefill(prefilling)
            if sched.prefill:
                self._last_was_prefill = True
                return sched
        self._last_was_prefill = False
        return self._schedule_decode()

    def _schedule_prefill(self, prefilling: list[Request]) -> Schedule:
        sched = Schedule()
        protect: set[int] = set()
        t_bucket = None
        candidates = list(prefilling)
        while True:
            if len(candidates) <= len(sched.prefill):
                if not self.waiting or len(self.running) >= self.max_num_seqs:
                    break
                req = self.waiting.popleft()
                req.status = Status.RUNNING
                if self.slots is not None:
                    req.slot = self.slots.allocate()
                self.running.append(req)
                candidates.append(req)
            req = candidates[len(sched.prefill)]
            remaining = req.num_tokens - req.num_computed
            if t_bucket is None:
                length = min(remaining, self.budget)
                t_bucket = self.buckets.prefill_tokens(length)
            else:
                length = min(remaining, t_bucket)
                if self.buckets.prefill_batch(len(sched.prefill) + 1, t_bucket) is None:
                    self._unadmit(req, sched)
                    break
            if not self._grow(req, req.num_computed + length, sched, protect):
                self._unadmit(req, sched)
                break
            protect.add(id(req))
            sched.prefill.append(PrefillWork(req, req.num_computed, length))
        return sched

    def _unadmit(self, req: Request, sched: Schedule) -> None:
        """Puts back a request that was admitted in this step but got no work."""
        if req.num_computed == 0 and not req.pages and req in self.running:
            self.running.remove(req)
            self._release(req)
            req.status = Status.WAITING
            self.waiting.appendleft(req)

    def _schedule_decode(self) -> Schedule:
        sched = Schedule()
        protect: set[int] = set()
        for req in sorted(self.running, key=lambda r: r.arrival):
            if req not in self.running or req.num_computed < req.num_tokens - 1:
                continue
            budget = min(self.decode_steps, req.remaining_tokens, self.max_model_len - req.num_tokens)
            # positions num_tokens-1 .. num_tokens-2+budget get written in this call
            if not self._grow(req, req.num_tokens - 1 + budget, sched, protect):
                fit = len(req.pages) * self.page_size - (req.num_tokens - 1)
                if fit <= 0:
                    self._preempt(req, sched)
                    continue
                budget = fit
            protect.add(id(req))
            sched.decode.append(DecodeWork(req, budget))
        sched.decode = [w for w in sched.decode if w.request in self.running]
        return sched
