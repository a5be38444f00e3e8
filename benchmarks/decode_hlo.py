"""The kernels of one decode step as XLA compiles them for the H200, on a machine without a GPU.

The engine's decode loop (``ModelRunner`` in compile-only mode, Qwen3-8B or GLM-5.3-Flash
shape, Pallas kernels) is compiled for a compile-only H200: JAX's deviceless compilation, the
CUDA PJRT plugin given a description of the GPU instead of a device. The program is the one the
H200 runs (same fusions, same Mosaic GPU custom calls; only XLA's autotuned GEMM tilings can
differ, and tokamax ops, which choose their implementation from the process's default device,
appear as their XLA fallbacks), so the number of kernel launches per decode step and what each
fuses can be read and changed on a CPU machine; times still need the GPU (``bench_decode.py``).

Needs the CUDA plugin, not the NVIDIA libraries or a driver:

    pip install jax-cuda13-plugin==0.11.2 jax-cuda13-pjrt==0.11.2    # e.g. into --target DIR
    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python benchmarks/decode_hlo.py --layers 2 [--batch 1] \\
        [--tp 2] [--model glm5] [--quant nvfp4] [--hlo step.txt]

Prints every kernel-launching instruction of one loop iteration (fusions, custom calls,
conditionals), their total and, for Qwen3 (whose layers are alike), the count per layer, and
the host seconds of lowering and compiling the step (start-up cost per decode bucket).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import time

import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh

from kk_jax.config import EngineConfig
from kk_jax.engine.runner import ModelRunner
from kk_jax.models.qwen3 import Qwen3ForCausalLM

from bench_decode import QWEN3_8B
from weightless import BLOCKS, model_dir

# The H200 as XLA's GPU compiler sees it (a GpuTargetConfigProto): SM count, shared memory,
# register file, clock, HBM bandwidth and size, compute capability 9.0.
H200 = """
gpu_device_info {
  threads_per_block_limit: 1024  threads_per_warp: 32  shared_memory_per_block: 49152
  shared_memory_per_core: 233472  threads_per_core_limit: 2048  core_count: 132  fpus_per_core: 128
  block_dim_limit_x: 2147483647  block_dim_limit_y: 65535  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000  l2_cache_size: 52428800  clock_rate_ghz: 1.98
  device_memory_size: 151397597184  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024  thread_dim_limit_y: 1024  thread_dim_limit_z: 64
  device_vendor: "NVIDIA Corporation"
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
device_description_str: "NVIDIA H200"
"""

LAUNCH = re.compile(r"^\s*(\S+) = .*?\b(fusion|custom-call|conditional)\(")


def h200_mesh(tp: int = 1) -> Mesh:
    """A ``tp``-way mesh of compile-only H200s (one host)."""
    topo = topologies.get_topology_desc("h200", "cuda", topology=f"1x1x{tp}", target_config=H200)
    return Mesh(np.array(topo.devices), ("tp",))


def decode_program(layers: int, batch: int, tp: int = 1, steps: int = 8, context: int = 1024,
                   page_size: int = 64, model: str = "qwen3", quant: str = "bf16",
                   program: str = "decode_greedy") -> tuple[str, float, float]:
    """HLO text of the compiled decode loop of a ``layers``-layer Qwen3-8B-shaped model (or
    GLM-5.3-Flash-shaped, ``model="glm5"``: the real KDA / DSA and dense / MoE layer pattern),
    with the seconds spent lowering it and compiling it (host work: the same on any machine
    with this CPU, GPU or not). ``quant`` (Qwen3): every linear but the lm_head in that format,
    as ``bench_decode.py --quant``. ``program``: the runner's decode program for greedy batches
    (what ``bench_decode.py`` runs by default), for sampled or top-k/p/min-p sampled ones, or for
    any sampling parameters (``"decode"``, with the sampler's branches)."""
    if model == "glm5":
        from bench_glm5 import flash_config

        from kk_jax.models.glm5_next import Glm5NextForConditionalGeneration as model_cls
        cfg = flash_config(layers, dense=min(3, layers))
    else:
        model_cls, cfg = Qwen3ForCausalLM, dataclasses.replace(QWEN3_8B, num_hidden_layers=layers)
    max_len = context + steps + page_size
    pages = -(-max_len // page_size)
    ecfg = EngineConfig(max_model_len=max_len, max_num_seqs=batch, max_num_batched_tokens=page_size,
                        page_size=page_size, num_pages=batch * pages + 1, decode_steps=steps, kernel_backend="pallas",
                        tp=tp, scan_layers=False)       # unrolled: one flat loop body to count
    with model_dir(quant) as ckpt:
        runner = ModelRunner(model_cls, cfg, ckpt, jnp.bfloat16, ecfg, h200_mesh(tp), progress=False,
                             compile_only=True)
    t0 = time.perf_counter()
    lowered = runner._lower(program, batch, steps)
    t1 = time.perf_counter()
    hlo = runner._compile(program, batch, steps, lowered=lowered).as_text()
    return hlo, t1 - t0, time.perf_counter() - t1


def loop_body_launches(hlo: str) -> list[tuple[str, str]]:
    """(instruction name, kind) of every kernel-launching instruction of one decode step: the
    body of the while loop that launches the most (the step loop, not a scanned layer loop or
    one inside a kernel's twin)."""
    def launches(body):
        start = hlo.index("\n" + body + " ") + 1
        lines = hlo[start:hlo.index("\n}\n", start)].splitlines()
        return [(m.group(1), m.group(2)) for m in map(LAUNCH.match, lines) if m]
    return max((launches(body) for body in re.findall(r"while\(.*?body=(%[\w.\-]+)", hlo)), key=len)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--model", choices=("qwen3", "glm5"), default="qwen3")
    ap.add_argument("--quant", default="bf16", choices=("bf16", *BLOCKS),
                    help="Qwen3's linear layers (all but the lm_head) quantized in this format")
    ap.add_argument("--program", choices=("decode_greedy", "decode_draw", "decode_draw_filtered", "decode"),
                    default="decode_greedy",
                    help="the decode program of greedy, sampled or filtered-sampled batches, or of any")
    ap.add_argument("--hlo", default=None, help="also write the compiled program's HLO text here")
    args = ap.parse_args()
    if args.quant != "bf16" and args.model != "qwen3":
        ap.error("--quant applies to --model qwen3")
    hlo, lower_s, compile_s = decode_program(args.layers, args.batch, args.tp, model=args.model, quant=args.quant,
                                              program=args.program)
    if args.hlo:
        with open(args.hlo, "w") as f:
            f.write(hlo)
    launches = loop_body_launches(hlo)
    for name, kind in launches:
        print(f"  {kind:12s} {name}")
    # layers are alike: a layer is what lies between its first custom call and the next layer's
    calls = [i for i, (_, kind) in enumerate(launches) if kind == "custom-call"]
    per_call = len(calls) // args.layers
    uniform = args.model == "qwen3" and args.layers > 1 and per_call
    per_layer = f"; {calls[per_call] - calls[0]} per layer" if uniform else ""
    print(f"{len(launches)} kernel launches per decode step of {args.model} at {args.layers} layers, "
          f"batch {args.batch}, tp {args.tp}, {args.quant} "
          f"({len(calls)} custom calls){per_layer}; lowered in {lower_s:.1f} s, compiled in {compile_s:.1f} s")


if __name__ == "__main__":
    main()
