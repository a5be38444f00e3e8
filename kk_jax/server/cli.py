"""``python serve.py``: flags with vLLM's spellings, engine start-up, uvicorn."""

from __future__ import annotations

import argparse
import logging
import sys

from kk_jax.config import EngineConfig


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="serve.py", description="OpenAI-compatible kk_jax server")
    ap.add_argument("--model", default=None, help="HF checkpoint directory (default: the embedded tiny GLM-5.3)")
    ap.add_argument("--served-model-name", nargs="+", default=None,
                    help="name(s) clients use in `model` (default: the --model argument)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="default 64 (8 for the embedded demo model)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="default 512 (128 for the embedded demo model)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--num-pages", type=int, default=None, help="KV pages (default: from --gpu-memory-utilization)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "fp8"])
    ap.add_argument("--decode-steps", type=int, default=8, help="decode steps per device call")
    ap.add_argument("--kernel-backend", default="auto", choices=["auto", "pallas", "xla"])
    ap.add_argument("--kda-backend", default="auto", choices=["auto", "pallas", "xla"],
                    help="KDA layers only (GLM-5.3); auto follows --kernel-backend; fixed for the server's lifetime")
    ap.add_argument("--dense-decode-backend", default="auto", choices=["auto", "pallas", "xla"],
                    help="unquantized linears at batch-1 decode: pallas = the weight-streaming Mosaic GPU "
                         "kernel, xla = XLA's GEMV; auto (default) = pallas when --kernel-backend resolves "
                         "to pallas on a GPU")
    ap.add_argument("--sampler-programs", default="auto", choices=["auto", "on", "off"],
                    help="per batch bucket, decode programs without sampler branches for greedy, sampled and "
                         "top-k/p/min-p sampled batches (a branch costs a device->host round trip each step); "
                         "auto = on a GPU; off compiles one decode program per bucket instead of four")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-scan-layers", dest="scan_layers", action="store_false",
                    help="compile every layer on its own instead of scanning repeating layer groups "
                         "(slower start-up; for comparisons)")
    ap.add_argument("--fp8-activations", action="store_true",
                    help="block-FP8 checkpoints: W8A8 (activations quantized to e4m3 per 1x128 group, the release's "
                         "reference numerics) instead of the default W8A16")
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    ap.add_argument("--profile-dir", default=None, help="where POST /start_profile writes jax.profiler traces")
    ap.add_argument("--max-request-body-bytes", type=int, default=8 << 20)
    ap.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return ap


def engine_config(args) -> EngineConfig:
    """The engine's configuration from the parsed flags."""
    from kk_jax.checkpoint.default import batch_limits

    limits = batch_limits(args.model, args.max_num_seqs, args.max_num_batched_tokens)
    return EngineConfig(max_model_len=args.max_model_len, **limits, page_size=args.page_size,
                        num_pages=args.num_pages, gpu_memory_utilization=args.gpu_memory_utilization,
                        kv_cache_dtype=args.kv_cache_dtype, tp=args.tp, decode_steps=args.decode_steps,
                        kernel_backend=args.kernel_backend, kda_backend=args.kda_backend,
                        dense_decode_backend=args.dense_decode_backend, sampler_programs=args.sampler_programs,
                        seed=args.seed, scan_layers=args.scan_layers, fp8_activations=args.fp8_activations)


def build(args):
    """Loads the model, warms every bucket up and returns (app, async engine)."""
    from kk_jax.checkpoint.default import SERVED_NAME, default_model_dir
    from kk_jax.engine.async_engine import AsyncEngine
    from kk_jax.engine.core import LLMEngine
    from kk_jax.server.app import ServerConfig, create_app

    model = args.model or str(default_model_dir())
    engine = LLMEngine(model, dtype=args.dtype, config=engine_config(args))
    for kind, b, t, secs in engine.warmup_report:
        logging.getLogger("kk_jax").info("compiled %-7s batch=%-3d tokens=%-4d %.2fs", kind, b, t, secs)
    names = tuple(args.served_model_name or [args.model or SERVED_NAME])
    cfg = ServerConfig(served_model_names=names, model_path=model, max_model_len=args.max_model_len,
                       api_key=args.api_key, profile_dir=args.profile_dir, max_body_bytes=args.max_request_body_bytes)
    async_engine = AsyncEngine(engine)
    return create_app(async_engine, cfg), async_engine


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    try:
        app, async_engine = build(args)
    except ValueError as e:           # configuration, checkpoint and parallelism errors name the fix
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        async_engine.shutdown()
    return 0
