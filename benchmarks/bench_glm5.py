"""GLM-5.3-Flash-shaped decode and prefill on the engine, and the memory plan of the full model.

Full width (hidden 4096, 64 KDA heads x 128, MLA 64 heads, 288 experts top-8, indexer 32 x 128)
at reduced depth (``--layers``, the real 3:1 KDA:DSA pattern, dense first layers), random bf16
weights drawn on the device, routed experts in ``--experts`` format (quantized ones held as
serving holds them). Decode: the fused decode loop over sequences already holding each
``--context`` of tokens, every row fed its own random token; reported per step against an HBM
roofline per GPU (weights actually read — all non-expert weights plus the distinct experts the batch
routes to, expected value under independent routing — plus the KV the step reads: selected
latents, all pooled index keys, KDA state read + write; weights and KDA state split over ``--tp``
GPUs, DSA caches replicated) / 4.2 TB/s. Prefill: tokens/s of one
sequence's prompt of each ``--context`` random tokens, in chunks of ``--prefill-tokens``.

``--memory-plan`` prints the per-GPU bytes of the full 45-layer model by component (no device
needed): e.g. 2 x H200 with NVFP4 experts.

    python benchmarks/bench_glm5.py --memory-plan --tp 2 --experts nvfp4 --max-seqs 64 --context 32768
    python benchmarks/bench_glm5.py --layers 8 --experts nvfp4 --batch 1 8 64 --context 8192 32768 --json out.json
    python benchmarks/bench_glm5.py --tiny --batch 1 2 --context 64        # CPU smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import time

HBM_BYTES_PER_S = 4.2e12
GIB = 1 << 30
EXPERT_BYTES_PER_PARAM = {"bf16": 2.0, "fp8_block": 1.0 + 4 / (128 * 128), "mxfp8": 1.0 + 1 / 32,
                          "nvfp4": 0.5 + 1 / 16}


def flash_config(layers: int, dense: int = 3):
    from kk_jax.config import Glm5NextConfig

    types = tuple("deepseek_sparse_attention" if i % 4 == 3 else "linear_attention" for i in range(layers))
    return Glm5NextConfig(
        vocab_size=154880, hidden_size=4096, num_hidden_layers=layers, layer_types=types,
        mlp_layer_types=tuple("dense" if i < dense else "sparse" for i in range(layers)),
        intermediate_size=12288, moe_intermediate_size=2048, n_routed_experts=288, num_experts_per_tok=8,
        n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, swiglu_limit=10.0,
        num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=256, v_head_dim=256,
        index_n_heads=32, index_head_dim=128, index_topk=2048, index_kpool=4, index_kpool_always_select_tail=True,
        linear_num_heads=64, linear_head_dim=128, linear_conv_kernel_dim=4, linear_lower_bound=-5.0, hc_mult=4,
        hc_eps=1e-6, hc_sinkhorn_iters=20, rms_norm_eps=1e-5, max_position_embeddings=1 << 20)


def tiny_config():
    return dataclasses.replace(
        flash_config(4, dense=1), vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=2, num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32,
        qk_nope_head_dim=16, v_head_dim=16, index_n_heads=8, index_head_dim=16, index_topk=8, linear_num_heads=4,
        linear_head_dim=16)


def layer_params(c) -> dict[str, list[int]]:
    """Parameter counts per component, one entry per layer (index = layer)."""
    d, qkv = c.hidden_size, c.linear_num_heads * c.linear_head_dim
    h, nope, vd = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim
    kda = 4 * d * qkv + 3 * qkv * 4 + 2 * (d * c.linear_head_dim + c.linear_head_dim * qkv) + d * c.linear_num_heads
    dsa = (d * c.q_lora_rank + c.q_lora_rank * h * nope + d * c.kv_lora_rank + c.kv_lora_rank * h * (nope + vd)
           + h * vd * d + c.q_lora_rank * c.index_n_heads * c.index_head_dim + 2 * d * c.index_head_dim
           + d * c.index_n_heads)
    expert = 3 * d * c.moe_intermediate_size
    out = {"attention": [], "dense_mlp": [], "routed_experts": [], "shared_expert_router": [], "mhc_norms": []}
    for i in range(c.num_hidden_layers):
        out["attention"].append(kda if c.layer_types[i] == "linear_attention" else dsa)
        sparse = c.mlp_layer_types[i] == "sparse"
        out["dense_mlp"].append(0 if sparse else 3 * d * c.intermediate_size)
        out["routed_experts"].append(c.n_routed_experts * expert if sparse else 0)
        out["shared_expert_router"].append(expert * c.n_shared_experts + c.n_routed_experts * d if sparse else 0)
        out["mhc_norms"].append(2 * ((2 + c.hc_mult) * c.hc_mult * c.hc_mult * d) + 2 * d)
    return out


def memory_plan(c, tp: int, experts: str, max_seqs: int, context: int, kv_fp8: bool) -> dict[str, float]:
    """Bytes per GPU by component for serving ``max_seqs`` sequences of ``context`` tokens."""
    p = layer_params(c)
    n_dsa = sum(t != "linear_attention" for t in c.layer_types)
    n_kda = c.num_hidden_layers - n_dsa
    plan = {
        "embedding + lm_head (bf16)": 2 * c.vocab_size * c.hidden_size * 2 / tp,
        "attention weights (bf16)": sum(p["attention"]) * 2 / tp,
        "dense MLPs (bf16)": sum(p["dense_mlp"]) * 2 / tp,
        f"routed experts ({experts})": sum(p["routed_experts"]) * EXPERT_BYTES_PER_PARAM[experts] / tp,
        "shared experts + routers (bf16)": sum(p["shared_expert_router"]) * 2 / tp,
        "mHC (fp32) + norms": sum(p["mhc_norms"]) * 4,
    }
    latent = c.kv_lora_rank * (1 if kv_fp8 else 2) + (33 if kv_fp8 else c.index_head_dim * 2 / c.index_kpool)
    plan["DSA cache (latent + pooled index keys)"] = n_dsa * latent * context * max_seqs  # replicated per GPU
    state = c.linear_num_heads * c.linear_head_dim ** 2 * 4 + 3 * 3 * c.linear_num_heads * c.linear_head_dim * 4
    plan["KDA state + conv (fp32)"] = n_kda * state * max_seqs / tp
    plan["total"] = sum(plan.values())
    return plan


def step_bytes(c, runner, batch: int, context: int, experts: str = "bf16", tp: int = 1) -> float:
    """Bytes one decode step reads per GPU (expected): see the module docstring. Weights and KDA
    state are split over ``tp`` GPUs; the DSA caches are replicated, so every GPU reads them."""
    p = layer_params(c)
    itemsize, per_param = 2, EXPERT_BYTES_PER_PARAM[experts]
    expert = 3 * c.hidden_size * c.moe_intermediate_size * per_param
    distinct = c.n_routed_experts * (1 - (1 - c.num_experts_per_tok / c.n_routed_experts) ** batch)
    n_moe = sum(t == "sparse" for t in c.mlp_layer_types)
    weights = runner.weight_bytes - sum(p["routed_experts"]) * per_param + n_moe * distinct * expert
    weights -= c.vocab_size * c.hidden_size * itemsize          # only `batch` embedding rows are read
    n_dsa = sum(t != "linear_attention" for t in c.layer_types)
    n_kda = c.num_hidden_layers - n_dsa
    selected = min(context, c.index_topk + c.index_kpool - 1)
    dsa = n_dsa * batch * (selected * c.kv_lora_rank * itemsize + context / c.index_kpool * c.index_head_dim * itemsize)
    kda = n_kda * batch * 2 * c.linear_num_heads * c.linear_head_dim ** 2 * 4
    return (weights + kda) / tp + dsa


def emit(rows: list, row: dict) -> None:
    """Records a result row and prints it at once (a long run stopped by a time limit keeps what it measured)."""
    rows.append(row)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


def experts_only_checkpoint(directory, experts: str):
    """A weightless checkpoint directory whose quantization config quantizes the routed experts
    (and nothing else) in ``experts`` format, so that random-weight runs hold them as serving
    does (the GLM-5.3 NVFP4 re-quantization keeps attention, dense and shared MLPs in bf16)."""
    from weightless import quantized_dir

    exclude = ("*self_attn*", "*shared_experts*", "*.mlp.gate_proj", "*.mlp.up_proj", "*.mlp.down_proj")
    return quantized_dir(directory, experts, exclude)


def bench(c, backend: str, batches, contexts, steps: int, iters: int, tp: int, prefill_tokens: int,
          page_size: int, experts: str = "bf16", trace_dir: str | None = None, scan: bool = True):
    import tempfile
    from pathlib import Path

    import jax
    import jax.numpy as jnp
    import numpy as np

    from kk_jax.config import EngineConfig
    from kk_jax.engine.request import SamplingParams
    from kk_jax.engine.runner import DecodeRow, ModelRunner, PrefillRow
    from kk_jax.models.glm5_next import Glm5NextForConditionalGeneration
    from kk_jax.parallel.mesh import make_mesh

    max_b = max(batches)
    max_len = max(contexts) + steps * (iters + 2) + page_size
    per_seq = math.ceil(max_len / page_size)
    ecfg = EngineConfig(max_model_len=max_len, max_num_seqs=max_b, max_num_batched_tokens=prefill_tokens or 16,
                        page_size=page_size, num_pages=max_b * per_seq + 1, tp=tp, decode_steps=steps,
                        kernel_backend=backend, scan_layers=scan)
    t0 = time.perf_counter()
    model_dir = None if experts == "bf16" else experts_only_checkpoint(Path(tempfile.mkdtemp()), experts)
    runner = ModelRunner(Glm5NextForConditionalGeneration, c, model_dir, jnp.bfloat16, ecfg, make_mesh(tp),
                         progress=False, random_weights_seed=0)
    print(f"runner ready in {time.perf_counter() - t0:.1f} s (weights {runner.weight_bytes / 2**30:.1f} GiB, "
          f"start-up compiles included)", flush=True)
    greedy = SamplingParams(max_tokens=steps, temperature=0.0)
    pages = lambda i: list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))
    rows = []
    # distinct random tokens: every row routes to its own experts, as real traffic does
    rng = np.random.default_rng(0)

    def prefill(n_tokens: int) -> None:
        """One sequence's prompt of ``n_tokens`` random tokens, in chunks of ``prefill_tokens``."""
        prompt = [int(x) for x in rng.integers(0, c.vocab_size, n_tokens)]
        for s in range(0, n_tokens, prefill_tokens):
            runner.prefill([PrefillRow(prompt[s:s + prefill_tokens], s, pages(0), 1, greedy, 0, 0)])

    t0 = time.perf_counter()
    if prefill_tokens:
        prefill(prefill_tokens)
    compile_s = time.perf_counter() - t0
    for context in contexts if prefill_tokens else ():
        t0 = time.perf_counter()
        prefill(context)
        prefill_s = time.perf_counter() - t0
        emit(rows, dict(kind="prefill", backend=runner.backend, experts=experts, tokens=context,
                        chunk=prefill_tokens, seconds=prefill_s, tok_per_s=context / prefill_s,
                        first_chunk_s=compile_s))
    if trace_dir and prefill_tokens:
        with jax.profiler.trace(f"{trace_dir}/prefill"):
            prefill(prefill_tokens)
    for context in contexts:
        for b in batches:
            drows = [DecodeRow(token=int(rng.integers(0, c.vocab_size)), position=context, pages=pages(i),
                               slot=i + 1, budget=steps, stop_ids=[], params=greedy, seed=0, token_index=0)
                     for i in range(b)]
            runner.decode(drows)
            host0, t0 = runner.host_seconds, time.perf_counter()
            for _ in range(iters):
                runner.decode(drows)
            wall = (time.perf_counter() - t0) / (iters * steps)
            host = (runner.host_seconds - host0) / (iters * steps)
            roof = step_bytes(c, runner, b, context, experts, tp) / HBM_BYTES_PER_S
            emit(rows, dict(kind="decode", backend=runner.backend, experts=experts, batch=b, context=context,
                            step_ms=wall * 1e3, tok_per_s=b / wall, roofline_ms=roof * 1e3,
                            roofline_frac=roof / wall, host_frac=host / wall))
            if trace_dir and b == max_b and context == contexts[-1]:
                with jax.profiler.trace(f"{trace_dir}/decode"):
                    runner.decode(drows)
    emit(rows, dict(kind="compile", scan=scan, programs=len(runner._compiled), seconds=runner.compile_seconds))
    return rows


def main():
    from kk_jax.engine.runner import claim_device_memory

    # weights, pools and a prefill chunk's activations of a full-width model need more than JAX's
    # default 75 % of the GPU
    claim_device_memory(0.95)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("kk_jax").setLevel(logging.INFO)           # per-program compile times
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--memory-plan", action="store_true")
    ap.add_argument("--experts", default="nvfp4", choices=sorted(EXPERT_BYTES_PER_PARAM),
                    help="routed-expert format, for the memory plan and the random-weight runs")
    ap.add_argument("--max-seqs", type=int, default=64)
    ap.add_argument("--kv-fp8", action="store_true")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--context", type=int, nargs="+", default=[8192])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--prefill-tokens", type=int, default=2048, help="prefill chunk (0: no prefill)")
    ap.add_argument("--page-size", type=int, default=256)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--trace", default=None, help="trace one prefill and one decode call (largest batch) "
                    "into DIR/prefill and DIR/decode and print where the GPU time goes")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-scan", dest="scan", action="store_false", help="unroll every layer (EngineConfig.scan_layers)")
    a = ap.parse_args()
    if a.memory_plan:
        context = max(a.context)
        plan = memory_plan(flash_config(45), a.tp, a.experts, a.max_seqs, context, a.kv_fp8)
        print(f"GLM-5.3-Flash, 45 layers, tp={a.tp}, experts {a.experts}, {a.max_seqs} x {context} tokens, "
              f"KV {'fp8' if a.kv_fp8 else 'bf16'}: per GPU")
        for k, v in plan.items():
            print(f"  {k:45s} {v / GIB:8.2f} GiB")
        result = plan
    else:
        c = tiny_config() if a.tiny else flash_config(a.layers)
        page = 16 if a.tiny else a.page_size
        result = bench(c, a.backend, a.batch, a.context, a.steps, a.iters, a.tp,
                       min(a.prefill_tokens, min(a.context)), page, a.experts, a.trace, a.scan)
        if a.trace:
            from trace_summary import print_summary
            for part in ("prefill", "decode") if a.prefill_tokens else ("decode",):
                print(f"== trace: {part} ==")
                print_summary(f"{a.trace}/{part}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
