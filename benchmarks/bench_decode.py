"""Decode throughput of a Qwen3-8B-shaped model against the HBM roofline.

Random bf16 weights are drawn on the device (no checkpoint needed). For each batch size the
runner's fused decode loop (``--steps`` tokens per device call) runs over sequences that
already hold ``--context`` tokens of KV. Reported per decode step: time, tokens/s, the
roofline time (bytes of weights + KV read per step / 4.2 TB/s) and its ratio, and host time
(packing/unpacking arrays) as a share of the step. Step time is measured twice: calls one at a
time (each waits for the last one's tokens), and chained as the engine runs a batch that goes on
unchanged (each call dispatched before the last one's tokens are read, its rows continuing on the
device; ``ModelRunner.decode_start(after=)``). Both attention backends (Pallas kernel and
the jnp twin) run in the same process for a side-by-side number, and with
``--dense-decode-backends pallas xla`` the unquantized linears' batch-1 decode matmuls on the
Pallas weight-streaming kernel and on XLA's GEMV. ``--quant fp8_block|mxfp8|nvfp4`` holds every
linear layer but the lm_head quantized (random codes and scales, as a quantized checkpoint would
load; ``--fp8-activations``: block FP8 as W8A8), ``--prefill-tokens N`` also times the prefill
of one N-token prompt in one chunk, and ``--temperature T [--top-p P]`` makes the decode rows
sample (the runner's decode program for that way of drawing, like greedy rows without
sampler branches).

    python benchmarks/bench_decode.py --batch 1 8 64 --context 1024 --json out.json
    python benchmarks/bench_decode.py --quant mxfp8 --batch 1 --prefill-tokens 2048
    python benchmarks/bench_decode.py --tiny          # CPU smoke run with a tiny shape
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time

import jax
import jax.numpy as jnp

from kk_jax.config import EngineConfig, Qwen3Config
from kk_jax.engine.request import SamplingParams
from kk_jax.engine.runner import DecodeRow, ModelRunner, PrefillRow
from kk_jax.models.qwen3 import Qwen3ForCausalLM
from kk_jax.parallel.mesh import make_mesh

from weightless import BLOCKS, model_dir

HBM_BYTES_PER_S = 4.2e12

QWEN3_8B = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                       rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False)
TINY = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                   rope_theta=1e4, max_position_embeddings=4096, tie_word_embeddings=True)


def step_bytes(cfg: Qwen3Config, runner: ModelRunner, batch: int, context: int) -> int:
    """Bytes one decode step must read: every weight except the embedding table (only `batch`
    rows of it are read; a tied table is read once as the lm_head) plus the KV of all sequences."""
    w = runner.weight_bytes
    emb = cfg.vocab_size * cfg.hidden_size * jnp.dtype(jnp.bfloat16).itemsize
    if not cfg.tie_word_embeddings:
        w -= emb
    kv_item = jnp.dtype(runner.pools["layers.0.k"].dtype).itemsize
    kv = batch * context * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * kv_item
    return w + kv


def prefill_flops(cfg: Qwen3Config, tokens: int) -> int:
    """Matmul FLOPs of one prompt: every token through every layer's projections, the lm_head
    for the last token only (attention's own products not counted)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    attn = h * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    return 2 * (tokens * cfg.num_hidden_layers * (attn + 3 * h * cfg.intermediate_size) + h * cfg.vocab_size)


def bench(cfg, backend, batches, context, steps, iters, page_size, tp, trace_dir=None, dense="auto", quant="bf16",
          fp8_activations=False, prefill_tokens=0, sampling=None):
    max_b = max(batches)
    max_len = max(context, prefill_tokens) + steps * (iters + 2) + page_size
    pages_per_seq = math.ceil((context + steps * (iters + 2) + page_size) / page_size)     # decode rows
    prefill_pages = math.ceil(prefill_tokens / page_size)                                 # after theirs
    ecfg = EngineConfig(max_model_len=max_len, max_num_seqs=max_b, max_num_batched_tokens=max(page_size, prefill_tokens),
                        page_size=page_size, num_pages=max_b * pages_per_seq + prefill_pages + 1, tp=tp,
                        decode_steps=steps, kernel_backend=backend, dense_decode_backend=dense,
                        fp8_activations=fp8_activations)
    with model_dir(quant) as ckpt:
        runner = ModelRunner(Qwen3ForCausalLM, cfg, ckpt, jnp.bfloat16, ecfg, make_mesh(tp), progress=False,
                             random_weights_seed=0)
    greedy = SamplingParams(max_tokens=steps, temperature=0.0)
    decode_params = sampling or greedy
    label = (quant + ("-w8a8" if fp8_activations else "")
             + (f"-T{decode_params.temperature:g}" if decode_params.temperature else "")
             + (f"-p{decode_params.top_p:g}" if decode_params.top_p < 1 else ""))
    rows_out = []
    if prefill_tokens:
        prompt = [(7 * i) % cfg.vocab_size for i in range(prefill_tokens)]
        first = 1 + max_b * pages_per_seq
        chunk = [PrefillRow(prompt, 0, list(range(first, first + prefill_pages)), 0, greedy, 0, 0)]
        t0 = time.perf_counter()
        runner.prefill(chunk)                                  # compile + first run
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(iters):
            runner.prefill(chunk)
        wall = (time.perf_counter() - t0) / iters
        flops = prefill_flops(cfg, prefill_tokens)
        rows_out.append(dict(kind="prefill", backend=runner.backend, quant=label, tokens=prefill_tokens,
                             ms=wall * 1e3, tok_per_s=prefill_tokens / wall, matmul_tflops=flops / wall / 1e12,
                             compile_s=compile_s))
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rows_out[-1].items()}), flush=True)
    for b in batches:
        rows = [DecodeRow(token=1, position=context, pages=list(range(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq)),
                          slot=0, budget=steps, stop_ids=[], params=decode_params, seed=0, token_index=0) for i in range(b)]
        t0 = time.perf_counter()
        runner.decode(rows)                                    # compile + first run
        compile_s = time.perf_counter() - t0
        runner.decode(rows)
        host0, t0 = runner.host_seconds, time.perf_counter()
        for _ in range(iters):
            out = runner.decode(rows)
        wall = (time.perf_counter() - t0) / (iters * steps)
        host = (runner.host_seconds - host0) / (iters * steps)
        assert all(len(o.tokens) == steps for o in out)
        chain = chained_step_seconds(runner, rows, steps, iters)
        if trace_dir and b == max_b:
            with jax.profiler.trace(trace_dir):
                runner.decode(rows)
        roof = step_bytes(cfg, runner, b, context) / HBM_BYTES_PER_S
        rows_out.append(dict(backend=runner.backend, dense=runner.dense_backend, quant=label, batch=b, context=context,
                             step_ms=wall * 1e3,
                             tok_per_s=b / wall, roofline_ms=roof * 1e3, roofline_frac=roof / wall,
                             host_frac=host / wall, chained_ms=chain * 1e3, chained_roofline_frac=roof / chain,
                             compile_s=compile_s))
        print_row(rows_out[-1])
    return rows_out


def chained_step_seconds(runner: ModelRunner, rows: list[DecodeRow], steps: int, iters: int) -> float:
    """Seconds per step over `iters` chained calls: each is dispatched before the previous one's
    tokens are read and continues its rows on the device, positions advancing `steps` a call."""
    t0 = time.perf_counter()
    cur = runner.decode_start(rows)
    for c in range(1, iters + 1):
        nxt = None if c == iters else runner.decode_start(
            [dataclasses.replace(r, token=None, position=r.position + c * steps,
                                 token_index=r.token_index + c * steps) for r in rows], after=cur)
        assert all(len(o.tokens) == steps for o in cur.result())
        cur = nxt
    return (time.perf_counter() - t0) / (iters * steps)


HEADER = (f"{'backend':8} {'dense':6} {'weights':15} {'batch':>5} {'ctx':>6} {'step ms':>9} {'tok/s':>10} "
          f"{'roof ms':>9} {'%roof':>6} {'host%':>6} {'chain ms':>9} {'%roof':>6}")


def print_row(r) -> None:
    """One result line, printed as soon as it is measured (a time limit keeps what was done)."""
    print(f"{r['backend']:8} {r['dense']:6} {r['quant']:15} {r['batch']:5d} {r['context']:6d} {r['step_ms']:9.3f} "
          f"{r['tok_per_s']:10.1f} {r['roofline_ms']:9.3f} {100 * r['roofline_frac']:6.1f} "
          f"{100 * r['host_frac']:6.2f} {r['chained_ms']:9.3f} {100 * r['chained_roofline_frac']:6.1f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16, help="decode steps per device call")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--backends", nargs="+", default=None,
                    help="attention kernel backends (default pallas xla; with --tiny xla: the tiny model's "
                         "16-wide heads are not the Pallas kernel's)")
    ap.add_argument("--dense-decode-backends", nargs="+", default=["auto"],
                    help="unquantized linears at decode, per kernel backend: auto | pallas | xla (several: A/B)")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    ap.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke run)")
    ap.add_argument("--trace", default=None, help="write a jax.profiler trace of one call at the largest batch")
    ap.add_argument("--quant", default="bf16", choices=("bf16", *BLOCKS),
                    help="linear layers (all but the lm_head) quantized in this format")
    ap.add_argument("--fp8-activations", action="store_true", help="block FP8 as W8A8 (--quant fp8_block)")
    ap.add_argument("--prefill-tokens", type=int, default=0, help="also time one prompt of this many tokens")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="decode rows sample at this temperature (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0, help="and with this top-p")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.fp8_activations and args.quant != "fp8_block":
        ap.error("--fp8-activations needs --quant fp8_block")
    cfg = TINY if args.tiny else QWEN3_8B
    args.backends = args.backends or (["xla"] if args.tiny else ["pallas", "xla"])
    if args.layers:
        cfg = Qwen3Config(**{**cfg.__dict__, "num_hidden_layers": args.layers})
    print(f"device: {jax.devices()[0].device_kind}  model: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}")
    print(HEADER, flush=True)
    results = []
    for backend in args.backends:
        for dense in args.dense_decode_backends:
            first = backend == args.backends[0] and dense == args.dense_decode_backends[0]
            results += bench(cfg, backend, args.batch, args.context, args.steps, args.iters, args.page_size,
                             args.tp, trace_dir=args.trace if first else None, dense=dense, quant=args.quant,
                             fp8_activations=args.fp8_activations, prefill_tokens=args.prefill_tokens,
                             sampling=SamplingParams(max_tokens=args.steps, temperature=args.temperature,
                                                     top_p=args.top_p))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.trace:
        from trace_summary import print_summary
        print_summary(args.trace)


if __name__ == "__main__":
    main()
