"""Async front of the engine: one background thread runs the jitted steps, asyncio callers
submit requests and receive their outputs as a stream.

The engine itself is single-threaded: only the engine thread changes it. Callers never wait
for a device step: ``submit`` validates and tokenizes a request in the caller
(``LLMEngine.prepare_request``, so bad input raises at once and changes nothing) and leaves it
in an inbox; ``abort`` leaves a note there; the engine thread takes both in between steps. An
exception inside a step ends every request in flight with an error (their pages are freed) and
the loop goes on serving new requests.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import AsyncIterator

from kk_jax.engine.core import LLMEngine
from kk_jax.engine.request import Request, RequestError, RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread is not running (shut down)."""


class StepFailed(RuntimeError):
    """The device step that carried this request raised; the request was aborted."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = threading.Lock()            # held by the engine thread while it steps
        self._wake = threading.Condition()       # guards the inbox, the abort notes and _streams
        self._inbox: dict[str, Request] = {}     # submitted, not yet queued in the engine
        self._aborts: set[str] = set()           # queued in the engine, to abort before the next step
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kk_jax-engine", daemon=True)
        self.step_listeners: list = []          # callables(outputs, seconds) for metrics
        self._thread.start()

    # ------------------------------------------------------------------ caller side
    async def stream(self, items: list[tuple[str, str | list[int], SamplingParams]]
                     ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Submits several requests (e.g. the ``n`` choices of one API call) and yields
        ``(index, output)`` as any of them advances, until all have finished.

        Every request is validated before any is queued: a bad one raises RequestError and
        nothing runs. Leaving the iteration early (client disconnect, cancellation) aborts
        the unfinished ones and frees their pages at once.
        """
        subs: list[tuple[str, asyncio.Queue]] = []
        try:
            for rid, prompt, params in items:
                subs.append((rid, self.submit(rid, prompt, params)))
        except BaseException:
            for rid, _ in subs:
                self.abort(rid)
            raise
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, queue: asyncio.Queue):
            while True:
                item = await queue.get()
                merged.put_nowait((i, item))
                if isinstance(item, BaseException) or item.finished:
                    return

        tasks = [asyncio.create_task(pump(i, q)) for i, (_, q) in enumerate(subs)]
        remaining = len(subs)
        try:
            while remaining:
                i, item = await merged.get()
                if isinstance(item, BaseException):
                    raise item
                remaining -= item.finished
                yield i, item
        finally:
            for t in tasks:
                t.cancel()
            for rid, _ in subs:
                self.abort(rid)          # no-op for requests that finished

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> asyncio.Queue:
        """Validates and enqueues one request; returns the queue that receives its outputs
        (RequestOutputs, the last with finished=True, or an exception)."""
        loop = asyncio.get_running_loop()
        req = self.engine.prepare_request(request_id, prompt, params)
        queue: asyncio.Queue = asyncio.Queue()
        with self._wake:
            if self._stop:
                raise EngineDeadError("the engine is shutting down")
            if request_id in self._streams:
                raise RequestError(f"request id {request_id!r} is already in use", "request_id")
            self._inbox[request_id] = req
            self._streams[request_id] = (loop, queue)
            self._wake.notify()
        return queue

    def abort(self, request_id: str) -> None:
        """Stops delivering to the request at once; the engine frees what it holds before its
        next step."""
        with self._wake:
            if self._streams.pop(request_id, None) is None:
                return
            if self._inbox.pop(request_id, None) is None:
                self._aborts.add(request_id)
                self._wake.notify()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop

    def shutdown(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=30)

    def call(self, fn, *args):
        """Runs ``fn(engine, *args)`` in between the engine's steps (waits for one in flight)."""
        with self._lock:
            return fn(self.engine, *args)

    def stats(self) -> dict:
        """The engine's counters, read without waiting for a step in flight."""
        return self.engine.stats()

    # ------------------------------------------------------------------ engine thread
    def _deliver(self, request_id: str, item) -> None:
        with self._wake:
            target = self._streams.get(request_id)
            if target is None:
                return
            if isinstance(item, BaseException) or item.finished:
                del self._streams[request_id]
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:      # the caller's loop is closed
            pass

    def _end_all(self, error: BaseException) -> None:
        """Aborts every request with a stream and ends the stream with ``error`` (engine thread)."""
        with self._wake:
            rids = list(self._streams)
        for rid in rids:
            self.engine.abort(rid)
            self._deliver(rid, error)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._stop or self._inbox or self._aborts or self.engine.has_unfinished()):
                    self._wake.wait()
                inbox, aborts, stop = list(self._inbox.values()), self._aborts, self._stop
                self._inbox, self._aborts = {}, set()
            with self._lock:
                for rid in aborts:
                    self.engine.abort(rid)
                for req in inbox:
                    try:
                        self.engine.enqueue(req)
                    except RequestError as e:
                        self._deliver(req.request_id, e)
                if stop:
                    self._end_all(EngineDeadError("the engine shut down"))
                    return
                t0 = time.perf_counter()
                try:
                    outs = self.engine.step()
                except Exception as e:      # a failed step must not kill the loop
                    log.exception("engine step failed; aborting its requests")
                    self._end_all(StepFailed(f"internal engine error: {e}"))
                    continue
                dt = time.perf_counter() - t0
            for out in outs:
                self._deliver(out.request_id, out)
            for listener in self.step_listeners:
                listener(outs, dt)
