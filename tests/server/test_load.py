"""A short load test: concurrent streaming clients, 20% cancelled, pool back to full."""

import asyncio
import sys
from pathlib import Path

from conftest import wait_pages_free

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_serving import run  # noqa: E402


def test_concurrent_streams_with_cancellations(live):
    res = asyncio.run(run(live.url, clients=24, cancel_frac=0.2, seed=1, model="tiny", max_prompt_words=30,
                          max_tokens=40))
    assert res["errors"] == []
    assert res["completed"] == 24 - res["cancelled"] and res["cancelled"] == 5
    assert wait_pages_free(live.engine)
