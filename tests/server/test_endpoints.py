"""Disconnects free pages; health, metrics, profiling, tokenize/detokenize, OpenAPI schema; callers
never wait for a device step."""

import asyncio
import json
import logging
import socket
import threading
import time

import httpx
import pytest
from conftest import wait_pages_free

from kk_jax.engine.request import SamplingParams


@pytest.fixture
def slow_engine(live):
    """Paces the engine (20 ms after every step) so a request is surely still running when the
    client hangs up; the tiny model would otherwise finish 100 tokens within milliseconds."""
    pace = lambda outs, secs: time.sleep(0.02)
    live.engine.step_listeners.append(pace)
    yield live
    live.engine.step_listeners.remove(pace)


def test_client_disconnect_mid_stream_frees_pages(slow_engine):
    live = slow_engine
    aborted = live.engine.call(lambda e: e.num_aborted)
    with httpx.Client(base_url=live.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "Tell me a long story", "max_tokens": 100,
                                                        "stream": True, "ignore_eos": True}) as r:
            lines = r.iter_lines()                   # keep the iterator: dropping it closes the stream
            assert next(lines).startswith("data: ")
            with live.engine._lock:                  # hold the engine between steps: the request is mid-stream
                st = live.engine.engine.stats()
                assert st["pages_free"] < st["pages_total"] and st["running"] == 1
                r.close()                            # the client hangs up
    assert wait_pages_free(live.engine)
    assert live.engine.call(lambda e: e.num_aborted) == aborted + 1


def test_non_streaming_disconnect_frees_pages(slow_engine, caplog):
    """All 8 choices are aborted, and the handler ends without an error of its own."""
    live = slow_engine
    aborted = live.engine.call(lambda e: e.num_aborted)
    body = json.dumps({"prompt": "hi", "max_tokens": 120, "n": 8, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", live.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    engine, deadline = live.engine.engine, time.time() + 30
    held = lambda: engine.num_running + engine.num_waiting
    # the choices reach the engine in batches as the server submits them: wait for all 8
    while (engine.num_running == 0 or held() < 8) and time.time() < deadline:
        time.sleep(0.001)
    with live.engine._lock:                          # the 8 choices are in the engine; the client hangs up
        assert engine.num_running > 0 and held() == 8
        sock.close()
    assert wait_pages_free(live.engine)
    assert live.engine.call(lambda e: e.num_aborted) == aborted + 8
    time.sleep(0.2)                                  # the handler sees the disconnect and returns
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_health_and_metrics(live):
    with httpx.Client(base_url=live.url, timeout=30) as c:
        assert c.get("/health").status_code == 200
        c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        text = c.get("/metrics").text
    for name in ["kk_jax:num_requests_running", "kk_jax:num_requests_waiting", "kk_jax:kv_cache_usage_perc",
                 "kk_jax:prompt_tokens_total", "kk_jax:generation_tokens_total",
                 "kk_jax:time_to_first_token_seconds_bucket", "kk_jax:inter_token_latency_seconds_bucket",
                 'kk_jax:request_success_total{finished_reason="length",model_name="tiny"}']:
        assert name in text, name
    gen = [float(line.split()[-1]) for line in text.splitlines() if line.startswith("kk_jax:generation_tokens_total")]
    assert gen and gen[0] >= 3


def test_profile_endpoints_write_a_trace(live):
    with httpx.Client(base_url=live.url, timeout=60) as c:
        assert c.post("/stop_profile").status_code == 400
        r = c.post("/start_profile")
        assert r.status_code == 200
        assert c.post("/start_profile").status_code == 400
        c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert c.post("/stop_profile").status_code == 200
    from pathlib import Path
    assert list(Path(r.json()["profile_dir"]).rglob("*.xplane.pb"))


def test_tokenize_detokenize(live):
    with httpx.Client(base_url=live.url, timeout=30) as c:
        t = c.post("/tokenize", json={"prompt": "Hello world"}).json()
        assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 128
        assert c.post("/detokenize", json={"tokens": t["tokens"]}).json()["prompt"] == "Hello world"
        m = c.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
        assert m["count"] > t["count"] // 2
        assert c.post("/tokenize", json={}).status_code == 400
        assert c.post("/detokenize", json={"tokens": [-1]}).status_code == 400


def test_openapi_schema(live):
    schema = httpx.get(live.url + "/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize"} <= set(schema["paths"])
    json.dumps(schema)


def test_callers_never_wait_for_a_step_in_flight(live):
    """While a device call runs (held here for 1.5 s), a submit, an abort and /metrics return at
    once: requests wait in an inbox, not on the engine lock. Both requests still finish."""
    runner = live.engine.engine.runner
    inside, release = threading.Event(), threading.Event()

    def slow_start(rows, after=None):
        call = type(runner).decode_start(runner, rows, after)
        result = call.result

        def slow_result():
            inside.set()
            release.wait(1.5)
            return result()
        call.result = slow_result
        return call

    async def submit_and_abort():
        t0 = time.perf_counter()
        live.engine.submit("responsive-1", "hello there", SamplingParams(max_tokens=2))
        live.engine.abort("responsive-1")
        return time.perf_counter() - t0

    runner.decode_start = slow_start
    try:
        with httpx.Client(base_url=live.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": "Tell me", "max_tokens": 12,
                                                            "stream": True, "ignore_eos": True}) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                assert inside.wait(10)                       # a decode call is in flight
                t0 = time.perf_counter()
                assert "kk_jax:num_requests_running" in c.get("/metrics").text
                metrics_s = time.perf_counter() - t0
                submit_s = asyncio.run(submit_and_abort())
                assert not release.is_set()
                assert metrics_s < 0.5 and submit_s < 0.5, (metrics_s, submit_s)
                release.set()
                assert [line for line in lines if line][-1] == "data: [DONE]"
    finally:
        release.set()
        del runner.decode_start
    assert wait_pages_free(live.engine)
