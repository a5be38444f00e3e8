"""Quantized-weight matmul on the H200: our Pallas kernels against XLA, side by side.

    python benchmarks/bench_quant_matmul.py [--json PATH] [--ms 1,8,64,2048] [--nk 4096x4096,12288x4096]
    python benchmarks/bench_quant_matmul.py --cpu-smoke      # tiny shapes, interpret mode (tests the script)

For every (M, N, K) it times, in one process on one GPU:

* ``xla_bf16``   XLA ``dot`` on bf16 weights with a bf16 result (the unquantized baseline: what a
  bf16 layer computes, fp32 sums rounded once) and ``xla_bf16_f32out``, the same product as an fp32
  result cast to bf16 (XLA runs the cast as a second kernel: up to 21 % slower at M >= 2048 and
  7-27 % at M = 1 on the H200, RESULTS.md 2026-12-02 part 34); ratios are taken against the
  faster of the two
* per format (``fp8_block`` W8A16, ``mxfp8``, ``nvfp4``): ``pallas`` (ours, weights stay quantized)
  and ``xla_deq`` (the jnp twin: dequantize to bf16, then XLA ``dot``, both inside one jit)
* ``fp8_block`` W8A8 (``act_quant``; activations quantized per 1x128 inside the timed call)
  and, for M >= 1024, ``xla_fp8``: XLA's per-tensor fp8 x fp8 dot (no block scales; the
  1487 TFLOP/s ceiling), with the activation quantization outside the timed region.
* a grouped (MoE) evaluation at decode and prefill token counts (``run_moe``): tokamax
  ``ragged_dot`` on bf16 weights and on fp8-quantized ones (qwix), dequantize-then-``ragged_dot``,
  and our grouped dequantizing kernel (``pallas_kernels.moe_quant``) per format.

Each timed call runs the op on R independent weight copies inside one jit (so decode shapes
stream from HBM, not from the 60 MB L2, and launch gaps are amortised); time per op is the
median over repetitions divided by R. With ``--device-time``, every row also gets ``dev_us``:
the GPU's busy time per op from a ``jax.profiler`` trace (every kernel of the op summed: split-K
sums, activation quantization, casts), which host dispatch between calls does not inflate (at
4096x4096, M = 1, the wall-clock time of a call was two-thirds idle GPU). TB/s counts the
quantized weight bytes (incl. scales) plus activations and output; ``check`` is the relative L2 error of the GPU result against
the jnp twin of the same numerics (pass < 1e-2). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kk_jax.quant import fp8_block as q_fp8, mxfp8 as q_mx, nvfp4 as q_nv  # noqa: E402
from kk_jax.models.layers.moe import ROUTED_GEMV_MAX_SLOTS, dequantize_stacked, routed_subset, tile_rows  # noqa: E402
from pallas_kernels import fp8_block, mxfp8, nvfp4  # noqa: E402
from pallas_kernels.moe_quant import gather_rows, grouped_matmul, route_tiles, routed_gemv, routed_gemv_supported  # noqa: E402

FORMATS = ("fp8_block", "mxfp8", "nvfp4")


def quantize_sets(fmt, ws):
    """Quantized operands (tuple per weight copy) on the device, in the kernels' layout (MXFP8 /
    NVFP4 block scales transposed)."""
    fns = {"fp8_block": lambda w: q_fp8.quantize(w), "mxfp8": lambda w: q_mx.quantize(w),
           "nvfp4": lambda w: q_nv.quantize(w)}
    f = jax.jit(lambda w: tuple(o.T if i == 1 and fmt != "fp8_block" else o for i, o in enumerate(fns[fmt](w))))
    return [tuple(f(w)) for w in ws]


def op_fn(fmt, path, interpret):
    """fn(x, *operands) for a format and path."""
    if fmt == "bf16":
        return lambda x, w: jnp.einsum("mk,nk->mn", x, w)
    if fmt == "bf16_f32out":
        return lambda x, w: jnp.einsum("mk,nk->mn", x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    if fmt == "fp8_dot":
        return lambda xq, wq: jax.lax.dot_general(xq, wq, (((1,), (1,)), ((), ())),
                                                  preferred_element_type=jnp.bfloat16)
    backend = "pallas" if path in ("pallas", "pallas_w8a8") else "xla"
    kw = dict(backend=backend, interpret=interpret and backend == "pallas")
    if fmt == "fp8_block":
        aq = path.endswith("w8a8")
        return lambda x, w, s: fp8_block.matmul(x, w, s, act_quant=aq, **kw)
    if fmt == "mxfp8":
        return lambda x, w, s: mxfp8.matmul(x, w, s, **kw)
    return lambda x, w, s, s2: nvfp4.matmul(x, w, s, s2, **kw)


@functools.lru_cache(maxsize=1)
def jit_many(fn):
    """One jit running ``fn`` on every copy in ``sets``, kept for the trace timing that follows the
    wall-clock one of the same op."""
    return jax.jit(lambda x, sets: tuple(fn(x, *ops) for ops in sets))


def device_us(fn, x, sets, calls=20) -> float | None:
    """GPU busy µs per op over ``calls`` traced calls of :func:`jit_many` (None without a GPU)."""
    if jax.default_backend() != "gpu":
        return None
    from trace_summary import summarize

    many = jit_many(fn)
    jax.block_until_ready(many(x, sets))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                y = many(x, sets)
            jax.block_until_ready(y)
        busy = sum(p["busy_us"] for p in summarize(d, top=0))
    return busy / (calls * len(sets))


def timed(fn, x, sets, reps, warm_s=0.2, min_s=0.03):
    """Median seconds per op: ``reps`` timings of back-to-back calls that run fn on every copy
    in ``sets`` (one jit), each timing covering at least ``min_s`` of GPU work. Before timing,
    the op runs for ``warm_s`` so that the GPU leaves its idle clocks (a first H200 run of this
    script, 2026-11-29, timed everything at a ~30 us floor because it measured a few hundred
    microseconds right after each compile, with the SM clock still near idle)."""
    many = jit_many(fn)
    out = jax.block_until_ready(many(x, sets))                  # compile
    t_end, calls = time.perf_counter() + warm_s, 0
    while time.perf_counter() < t_end or calls < 2:
        y = many(x, sets)
        calls += 1
        if calls % 8 == 0:
            jax.block_until_ready(y)
    jax.block_until_ready(y)
    t0 = time.perf_counter()
    jax.block_until_ready(many(x, sets))
    per_call = max(time.perf_counter() - t0, 1e-6)
    n_calls = int(max(1, min(1000, min_s / per_call)))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n_calls):
            y = many(x, sets)
        jax.block_until_ready(y)
        ts.append((time.perf_counter() - t0) / (n_calls * len(sets)))
    return statistics.median(ts), out[0]


def _smoke_timed(fn, x, sets, reps):
    """CPU smoke run: one call, no warm-up (interpret mode is slow)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(jit_many(fn)(x, sets))
    return (time.perf_counter() - t0) / len(sets), out[0]


def nbytes(arrs) -> int:
    return int(sum(a.size * a.dtype.itemsize for a in arrs))


def rel_err(a, b) -> float:
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def run_dense(ms, nks, reps, interpret, budget_bytes, log, device_time=False):
    rows = []
    for n, k in nks:
        wbytes_q = n * k                                           # fp8 bytes per copy
        r = int(max(2, min(8, budget_bytes // max(wbytes_q, 1))))
        key = jax.random.key(n * 7 + k)
        ws = [(0.02 * jax.random.normal(jax.random.fold_in(key, i), (n, k), jnp.float32)).astype(jnp.bfloat16)
              for i in range(r)]
        qsets = {f: quantize_sets(f, ws) for f in FORMATS}
        for m in ms:
            x = jax.random.normal(jax.random.fold_in(key, 1000 + m), (m, k), jnp.float32).astype(jnp.bfloat16)
            flops = 2.0 * m * n * k
            act = m * k * 2 + m * n * 2

            def record(fmt, path, fn, sets, ref=None, wb=None, xin=x):
                try:
                    t, y = timed(fn, xin, sets, reps)
                    err = rel_err(y, ref) if ref is not None else None
                    wb = nbytes(sets[0]) if wb is None else wb
                    row = dict(fmt=fmt, path=path, M=m, N=n, K=k, us=t * 1e6, tbs=(wb + act) / t / 1e12,
                               tflops=flops / t / 1e12, check=err, copies=len(sets))
                    if device_time:
                        row["dev_us"] = device_us(fn, xin, sets)
                except Exception as e:                                      # keep measuring the rest
                    row = dict(fmt=fmt, path=path, M=m, N=n, K=k, error=f"{type(e).__name__}: {str(e)[:300]}")
                    traceback.print_exc(limit=3)
                rows.append(row)
                log(row)
                return row

            for path in ("xla_bf16", "xla_bf16_f32out"):
                record("bf16", path, op_fn("bf16" if path == "xla_bf16" else "bf16_f32out", "xla", interpret),
                       [(w,) for w in ws])
            for fmt in FORMATS:
                sets = qsets[fmt]
                twin = op_fn(fmt, "xla_deq", interpret)
                ref = jax.jit(twin)(x, *sets[0])
                record(fmt, "pallas", op_fn(fmt, "pallas", interpret), sets, ref)
                record(fmt, "xla_deq", twin, sets)
            sets = qsets["fp8_block"]
            ref8 = jax.jit(lambda x, w, s: fp8_block.matmul(x, w, s, act_quant=True, backend="xla"))(x, *sets[0])
            record("fp8_block", "pallas_w8a8", op_fn("fp8_block", "pallas_w8a8", interpret), sets, ref8)
            if m >= 1024:
                xq = x.astype(jnp.float8_e4m3fn)
                record("fp8_dot", "xla_fp8", op_fn("fp8_dot", "xla", interpret), [(s[0],) for s in sets],
                       xin=xq, wb=n * k)
    return rows


def run_moe(interpret, reps, log, experts=288, k=4096, n=2048, top=8, token_counts=(1, 8, 64, 2048), routings=8):
    """One grouped expert projection ([E, N, K] experts, GLM-5.3-Flash's gate/up shape) over
    routed tokens (``top`` random distinct experts per token; ``routings`` different routings
    per timed call, so decode calls do not find their few experts in L2):

    * ``tokamax_bf16``: tokamax ``ragged_dot`` on bf16 experts (tokens sorted by expert)
    * ``tokamax_fp8_1x128``: tokamax's quantized ``ragged_dot`` (qwix fp8, one scale per output
      channel and 128-wide K tile), first token count only
    * per format, ``deq+tokamax``: the engine's previous path (routed experts gathered when
      N·k < E, else all, dequantized in jnp, then the bf16 ``ragged_dot``)
    * per format, ``grouped``: ``pallas_kernels.moe_quant`` (row tiles of one expert, dequantized
      in the kernel)
    * per format, ``routed``: ``moe_quant.routed_gemv`` (one row GEMV per token-slot), up to
      ``ROUTED_GEMV_MAX_SLOTS`` x 4 token-slots (the engine takes it up to that limit)

    TB/s counts the bytes of the distinct experts a call touches (incl. scales) + x + y; ``check``
    compares each path with the first one of its format (grouped against deq+tokamax)."""
    rows = []
    try:
        import qwix
        import tokamax
    except Exception as e:                                                     # noqa: BLE001
        rows.append(dict(fmt="moe", path="tokamax", error=f"tokamax unavailable: {e}"))
        return rows

    key = jax.random.key(7)
    w = (0.02 * jax.random.normal(key, (experts, n, k), jnp.float32)).astype(jnp.bfloat16)     # HF [E, N, K]
    w_t = jnp.swapaxes(w, 1, 2)                                                # [E, K, N] for ragged_dot
    impl = None if not interpret else "xla"
    quant = {}                  # per format, the operands in the engine's stacked layout (moe.Experts)
    for fmt, mod in (("fp8_block", q_fp8), ("mxfp8", q_mx), ("nvfp4", q_nv)):
        ops = jax.jit(jax.vmap(mod.quantize))(w)
        quant[fmt] = tuple(jnp.swapaxes(o, 1, 2) if i == 1 and fmt != "fp8_block" else o for i, o in enumerate(ops))
    per_expert = {"bf16": n * k * 2, **{f: nbytes(ops) // experts for f, ops in quant.items()}}

    def ragged(x, idx, rhs):
        flat = idx.reshape(-1)
        order = jnp.argsort(flat)
        sizes = jnp.bincount(flat, length=rhs.shape[0]).astype(jnp.int32)
        y = tokamax.ragged_dot(x[order // top], rhs, sizes, implementation=impl)
        return jnp.zeros_like(y).at[order].set(y)                              # token-slot order

    def deq_tokamax(fmt):
        def fn(x, idx, *ops):
            if idx.size < experts:
                idx, ids = routed_subset(idx, experts)
                ops = tuple(o[ids] for o in ops)
            return ragged(x, idx, dequantize_stacked(fmt, ops, dtype=jnp.bfloat16))
        return fn

    def grouped(fmt):
        def fn(x, idx, *ops):
            tiles = route_tiles(idx, experts, tile_rows(idx.size, experts))
            y = grouped_matmul(gather_rows(x, tiles, top), tiles.tile_expert, fmt, *ops, interpret=interpret)
            return y[tiles.row_of_pair]
        return fn

    def routed(fmt):
        def fn(x, idx, *ops):
            return routed_gemv(jnp.repeat(x, top, axis=0), idx.reshape(-1), fmt, *ops, interpret=interpret)
        return fn

    for ti, m in enumerate(token_counts):
        x = jax.random.normal(jax.random.fold_in(key, m), (m, k), jnp.float32).astype(jnp.bfloat16)
        idxs = [jnp.argsort(jax.random.uniform(jax.random.fold_in(key, 100 * m + r), (m, experts)), axis=-1)[:, :top]
                .astype(jnp.int32) for r in range(routings)]
        touched = statistics.mean(len(np.unique(np.asarray(i))) for i in idxs)
        cands = [("tokamax_bf16", "bf16", lambda x, idx, r: ragged(x, idx, r), (w_t,))]
        if ti == 0:
            wq = qwix.quantize(w_t, jnp.float8_e4m3fn, tiled_axes={0: 1, 1: 128, 2: 1})
            per_expert["qwix_fp8"] = nbytes(jax.tree.leaves(wq)) // experts
            cands.append(("tokamax_fp8_1x128", "qwix_fp8", lambda x, idx, r: ragged(x, idx, r), (wq,)))
        for fmt, ops in quant.items():
            cands += [(f"{fmt}_deq+tokamax", fmt, deq_tokamax(fmt), ops), (f"{fmt}_grouped", fmt, grouped(fmt), ops)]
            if m * top <= 4 * ROUTED_GEMV_MAX_SLOTS and routed_gemv_supported(fmt, n, k):
                cands.append((f"{fmt}_routed", fmt, routed(fmt), ops))
        refs = {}                       # per format: the first path's result (grouped vs deq+tokamax)
        for name, fmt, fn, ops in cands:
            try:
                t, y = timed(lambda x, idx, *o, fn=fn: fn(x, idx, *o), x, [(i, *ops) for i in idxs], reps)
                y = jnp.asarray(y, jnp.float32)
                ref = refs.setdefault(fmt, y)
                wb = touched * per_expert[fmt]
                row = dict(fmt="moe", path=name, M=m, N=n, K=k, G=experts, us=t * 1e6, experts_touched=touched,
                           tbs=(wb + m * k * 2 + m * top * n * 2) / t / 1e12, tflops=2.0 * m * top * n * k / t / 1e12,
                           check=rel_err(y, ref))
            except Exception as e:                                             # noqa: BLE001
                row = dict(fmt="moe", path=name, M=m, N=n, K=k, G=experts, error=f"{type(e).__name__}: {str(e)[:300]}")
                traceback.print_exc(limit=3)
            rows.append(row)
            log(row)
    return rows


def fmt_row(r) -> str:
    if "error" in r:
        return f"{r['fmt']:<10} {r['path']:<18} {r.get('M', ''):>6} {r.get('N', ''):>6} {r.get('K', ''):>6}  ERROR {r['error'][:90]}"
    chk = "" if r.get("check") is None else f"{r['check']:.1e}" + (" ok" if r["check"] < 1e-2 else " FAIL")
    dev = f"{r['dev_us']:>10.1f}" if r.get("dev_us") else f"{'':>10}"
    return (f"{r['fmt']:<10} {r['path']:<18} {r['M']:>6} {r['N']:>6} {r['K']:>6} {r['us']:>10.1f} {dev} "
            f"{r['tbs']:>7.2f} {r['tflops']:>8.1f}  {chk}")


HEADER = (f"{'format':<10} {'path':<18} {'M':>6} {'N':>6} {'K':>6} {'us':>10} {'dev_us':>10} {'TB/s':>7} "
          f"{'TFLOP/s':>8}  check")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1,8,64,2048")
    ap.add_argument("--nk", default="4096x4096,12288x4096")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget-mb", type=int, default=160, help="fp8 weight bytes per timed call (> the 60 MB L2)")
    ap.add_argument("--json", default="bench_quant_matmul.json")
    ap.add_argument("--no-moe", action="store_true")
    ap.add_argument("--moe-tokens", default="1,8,64,2048", help="routed tokens per grouped-expert call (top-8)")
    ap.add_argument("--no-dense", action="store_true", help="only the grouped-expert rows")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
    ap.add_argument("--device-time", action="store_true",
                    help="also trace decode-shaped rows (M <= 64) for GPU busy time per op")
    args = ap.parse_args(argv)
    interpret = args.cpu_smoke
    if args.cpu_smoke:
        ms, nks, reps, budget = [1, 72], [(128, 256)], 1, 1
        global timed
        timed = _smoke_timed
    else:
        ms = [int(v) for v in args.ms.split(",")]
        nks = [tuple(int(v) for v in s.split("x")) for s in args.nk.split(",")]
        reps, budget = args.reps, args.budget_mb << 20
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}", flush=True)
    print(HEADER, flush=True)
    log = lambda r: print(fmt_row(r), flush=True)
    t0 = time.perf_counter()
    rows = []
    if not args.no_moe:                 # first: the grouped-expert question (item 4) is the cheapest to answer
        rows += run_moe(interpret, reps, log, token_counts=tuple(int(v) for v in args.moe_tokens.split(",")),
                        **({} if not args.cpu_smoke else dict(experts=4, k=256, n=128, top=2, routings=2)))
    if not args.no_dense:
        rows += run_dense(ms, nks, reps, interpret, budget, log, device_time=args.device_time)
    # side-by-side summary: ours vs XLA dequantize-then-dot and vs bf16 at each shape
    print("\nsummary (speed-up of pallas over xla_deq / over the faster XLA bf16 form):", flush=True)
    idx = {(r["fmt"], r["path"], r.get("M"), r.get("N"), r.get("K")): r for r in rows if "error" not in r}
    t = lambda row: row.get("dev_us") or row["us"]
    for (fmt, path, m, n, k), r in list(idx.items()):           # the baseline: the faster bf16 form
        if path == "xla_bf16_f32out" and t(r) < t(idx.get(("bf16", "xla_bf16", m, n, k), r)):
            idx[("bf16", "xla_bf16", m, n, k)] = r
    for (fmt, path, m, n, k), r in sorted(idx.items(), key=lambda kv: (kv[0][3] or 0, kv[0][4] or 0, kv[0][2] or 0)):
        if path not in ("pallas", "pallas_w8a8"):
            continue
        deq, bf = idx.get((fmt, "xla_deq", m, n, k)), idx.get(("bf16", "xla_bf16", m, n, k))
        fp8 = idx.get(("fp8_dot", "xla_fp8", m, n, k))
        parts = [f"{fmt:<10} {path:<12} M={m:<5} {n}x{k}: {r['us']:.1f} us"]
        if deq:
            parts.append(f"x{deq['us'] / r['us']:.2f} vs xla_deq")
        if bf:
            parts.append(f"x{bf['us'] / r['us']:.2f} vs bf16")
        if bf and r.get("dev_us") and bf.get("dev_us"):
            parts.append(f"device time {r['dev_us']:.1f} us, x{bf['dev_us'] / r['dev_us']:.2f} vs bf16")
        if fp8 and path == "pallas_w8a8":
            parts.append(f"{r['tflops']:.0f} vs xla_fp8 {fp8['tflops']:.0f} TFLOP/s")
        print("  " + ", ".join(parts), flush=True)
    out = dict(device=dev.device_kind, jax=jax.__version__, date=time.strftime("%Y-%m-%d"),
               seconds=time.perf_counter() - t0, rows=rows)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json} ({time.perf_counter() - t0:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
