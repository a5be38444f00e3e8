"""Prometheus metrics of the server (names follow vLLM's, prefixed ``kk_jax:``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        lab = {"model_name": model_name}
        r = self.registry
        self.running = Gauge("kk_jax:num_requests_running", "Requests holding cache pages", ["model_name"],
                             registry=r).labels(**lab)
        self.waiting = Gauge("kk_jax:num_requests_waiting", "Requests queued for admission", ["model_name"],
                             registry=r).labels(**lab)
        self.kv_usage = Gauge("kk_jax:kv_cache_usage_perc", "Fraction of KV pages in use (0-1)", ["model_name"],
                              registry=r).labels(**lab)
        self.kv_pages_free = Gauge("kk_jax:kv_cache_pages_free", "Free KV pages", ["model_name"],
                                   registry=r).labels(**lab)
        self.prompt_tokens = Counter("kk_jax:prompt_tokens", "Prompt tokens processed", ["model_name"],
                                     registry=r).labels(**lab)
        self.generation_tokens = Counter("kk_jax:generation_tokens", "Tokens generated", ["model_name"],
                                         registry=r).labels(**lab)
        self._success = Counter("kk_jax:request_success", "Finished requests by reason",
                                ["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram("kk_jax:time_to_first_token_seconds", "Time to first token", ["model_name"],
                              buckets=_LATENCY_BUCKETS, registry=r).labels(**lab)
        self.itl = Histogram("kk_jax:inter_token_latency_seconds", "Time between output tokens", ["model_name"],
                             buckets=_LATENCY_BUCKETS, registry=r).labels(**lab)
        self.e2e = Histogram("kk_jax:e2e_request_latency_seconds", "Request latency", ["model_name"],
                             buckets=_LATENCY_BUCKETS, registry=r).labels(**lab)
        self.model_name = model_name

    def finished(self, reason: str, prompt_tokens: int) -> None:
        self._success.labels(model_name=self.model_name, finished_reason=reason).inc()
        self.prompt_tokens.inc(prompt_tokens)

    def render(self, stats: dict) -> bytes:
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.kv_pages_free.set(stats["pages_free"])
        self.kv_usage.set(1.0 - stats["pages_free"] / max(1, stats["pages_total"]))
        return generate_latest(self.registry)


class RequestTimer:
    """Feeds TTFT / inter-token latency / end-to-end histograms for one request."""

    def __init__(self, metrics: ServerMetrics, start: float):
        self.m, self.start, self.last = metrics, start, None

    def tokens(self, now: float, n: int) -> None:
        if n <= 0:
            return
        self.m.generation_tokens.inc(n)
        if self.last is None:
            self.m.ttft.observe(now - self.start)
            n -= 1
        elif n:
            per = (now - self.last) / n
            for _ in range(n):
                self.m.itl.observe(per)
        self.last = now

    def done(self, now: float) -> None:
        self.m.e2e.observe(now - self.start)
