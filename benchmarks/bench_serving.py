"""Load test of a live server: N concurrent streaming clients, some cancelled mid-stream.

Each client sends a chat or completion request with a random prompt and output length and
reads the SSE stream; ``--cancel-frac`` of them hang up after a few chunks. Reports request
throughput, output tokens/s and TTFT / inter-token-latency percentiles, and checks that no
request failed, every non-cancelled stream is complete and well-formed, and the server's KV
page pool is back to its initial free count.

    python benchmarks/bench_serving.py                       # starts the default tiny server itself
    python benchmarks/bench_serving.py --url http://127.0.0.1:8000 --clients 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import httpx


async def one_client(client: httpx.AsyncClient, i: int, rng: random.Random, model: str, cancel: bool,
                     max_prompt_words: int, max_tokens: int) -> dict:
    words = " ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat", "today", "while", "it", "rained"])
                     for _ in range(rng.randint(1, max_prompt_words)))
    n_out = rng.randint(4, max_tokens)
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": model, "max_tokens": n_out, "temperature": rng.choice([0.0, 0.8]), "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": words}]} if chat else {"prompt": words})
    t0 = time.perf_counter()
    stamps, text, usage, done, finish = [], "", None, False, None
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {await r.aread()!r}"}
        async for line in r.aiter_lines():
            if not line:
                continue
            if not line.startswith("data: "):
                return {"error": f"malformed SSE line {line!r}"}
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices", []):
                piece = ch["delta"].get("content") if chat else ch["text"]
                if piece:
                    stamps.append(time.perf_counter())
                    text += piece
                finish = ch.get("finish_reason") or finish
            if cancel and len(stamps) >= 2:
                return {"cancelled": True}
    if not done or usage is None or finish != "length" or usage["completion_tokens"] != n_out:
        return {"error": f"incomplete stream: done={done} finish={finish} usage={usage} wanted {n_out}"}
    return {"cancelled": False, "tokens": usage["completion_tokens"], "start": t0, "stamps": stamps,
            "end": time.perf_counter()}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] * 1e3 if xs else float("nan")


async def run(url: str, clients: int, cancel_frac: float, seed: int, model: str, max_prompt_words: int,
              max_tokens: int) -> dict:
    rng = random.Random(seed)
    cancel = set(rng.sample(range(clients), int(round(cancel_frac * clients))))
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*[one_client(client, i, random.Random(rng.random()), model, i in cancel,
                                                    max_prompt_words, max_tokens) for i in range(clients)])
        wall = time.perf_counter() - t0
    errors = [r["error"] for r in results if "error" in r]
    full = [r for r in results if not r.get("cancelled") and "error" not in r]
    ttft = [r["stamps"][0] - r["start"] for r in full if r["stamps"]]
    itl = [b - a for r in full for a, b in zip(r["stamps"], r["stamps"][1:])]
    tokens = sum(r["tokens"] for r in full)
    return {"clients": clients, "cancelled": len(cancel), "completed": len(full), "errors": errors,
            "wall_s": wall, "req_per_s": len(full) / wall, "out_tok_per_s": tokens / wall,
            "ttft_ms": {q: pct(ttft, q) for q in (50, 90, 99)}, "itl_ms": {q: pct(itl, q) for q in (50, 90, 99)}}


def report(res: dict) -> None:
    print(f"clients {res['clients']}  completed {res['completed']}  cancelled {res['cancelled']}  "
          f"errors {len(res['errors'])}  wall {res['wall_s']:.2f}s")
    print(f"request throughput {res['req_per_s']:.2f} req/s   output {res['out_tok_per_s']:.1f} tok/s")
    for k in ("ttft_ms", "itl_ms"):
        print(f"{k:8} " + "  ".join(f"p{q} {v:8.2f}" for q, v in res[k].items()))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server; default: start the tiny default server here")
    ap.add_argument("--model", default=None)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--cancel-frac", type=float, default=0.2)
    ap.add_argument("--max-prompt-words", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    server = None
    if args.url is None:
        import sys
        from pathlib import Path
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "server"))
        from conftest import LiveServer, wait_pages_free
        server = LiveServer(["--max-model-len", "512", "--max-num-seqs", "32", "--max-num-batched-tokens", "256",
                             "--served-model-name", "tiny", "--log-level", "warning"])
        args.url, args.model = server.url, "tiny"
    try:
        res = asyncio.run(run(args.url, args.clients, args.cancel_frac, args.seed, args.model, args.max_prompt_words,
                              args.max_tokens))
        if server is not None:
            res["pages_back"] = wait_pages_free(server.engine)
    finally:
        if server is not None:
            server.stop()
    report(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    ok = not res["errors"] and res["completed"] == res["clients"] - res["cancelled"] and res.get("pages_back", True)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
