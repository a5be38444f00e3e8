"""Benchmark: paged decode attention on one GPU (ours vs XLA reference vs jax Triton).

Shapes: batch {1, 8, 64} x context {1K, 4K, 16K (batch <= 8)}, Hq=32, Hkv=8, D=128,
page_size 64, bf16 pools, plus one float8_e4m3fn row (batch 64 x 4K). Every
sequence is full (kv_len = context) and its pages are a shuffled, non-contiguous
draw from the pool (page 0 is the dummy page).

Implementations, measured in the same run on the same inputs:
  ours    pallas_kernels.paged_attention (Mosaic GPU kernel + its small XLA
          pre/post ops: q scaling/padding, split combine)
  xla     the pure-jnp reference (backend="xla": gathers all pages, fp32 softmax)
  triton  jax.experimental.pallas.ops.gpu.paged_attention (Triton lowering), pools
          converted to its [Hkv, P, page_size, D] layout outside the timed region
          (its q pre-scaled by 1/sqrt(D), it has no scale argument; fp8 via its
          per-token scale pages); k_splits / pages_per_compute_block: 16 / 8, or
          16 / 4 when a split holds >= 16 pages (8 overflows SMEM), plus 4 / 4 at
          batch 64 x 4K; the best is kept.

Timing: one jitted function runs the op K times back to back (K = 8..40, about
1.5 ms of work), call i on its own q and its own page table. The tables are
fresh shuffles drawn from R disjoint page sets (R * bytes per call >= 4 x the
60 MB L2), so XLA cannot merge identical calls (a first run that reused tables
showed merged Triton calls and merged reference gathers) and the L2 cannot
serve one call's data to the next. Per-op time = median wall time of the jitted call / K: the jit call's
fixed dispatch cost is spread over the K calls and counted (conservative for
small shapes). Effective TB/s = bytes of K+V that must be read
(sum(kv_len) * Hkv * D * 2 * itemsize) / time.

Correctness: ours and triton are compared with the reference on the GPU
(relative L2 error of the output) for every row; a ragged-length check (kv_len
0, 1, partial blocks) runs the default large-batch plan. --sweep also times a
few kernel plans at batch 64 x 4K.

Usage: PYTHONPATH=. python3 benchmarks/bench_paged_attention.py [--json PATH]
       [--sweep] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention import (paged_decode_attention,
                                            paged_decode_attention_kernel)

HQ, HKV, D, PAGE = 32, 8, 128, 64
L2_BYTES = 60 * 2**20


def calls_per_timing(nbytes):
  """Back-to-back calls per timed jit call: about 1.5 ms of work, 8..40 calls."""
  est_us = nbytes / 3.0e6
  return int(min(40, max(8, math.ceil(1500 / est_us))))


def make_case(batch, ctx, pool_dtype, seed=0):
  """Pool, K distinct q tensors and K distinct page tables, kv_lens = ctx.

  The tables draw from R disjoint page sets (R * bytes per call >= 4 x L2) and
  each is a fresh shuffle, so no two calls see the same (q, table) pair: XLA
  cannot merge calls (common-subexpression elimination), and the L2 cannot
  serve one call's data to the next.
  """
  rng = np.random.default_rng(seed)
  pages_per_seq = ctx // PAGE
  itemsize = jnp.dtype(pool_dtype).itemsize
  bytes_per_call = batch * ctx * HKV * D * itemsize * 2
  sets = min(64, max(1, math.ceil(4 * L2_BYTES / bytes_per_call)))
  kcalls = calls_per_timing(bytes_per_call)
  num_pages = 1 + sets * batch * pages_per_seq
  key = jax.random.key(seed)
  kk, kv, kq = jax.random.split(key, 3)
  shape = (num_pages, PAGE, HKV, D)
  k = jax.random.normal(kk, shape, jnp.bfloat16)
  v = jax.random.normal(kv, shape, jnp.bfloat16)
  if pool_dtype != jnp.bfloat16:
    k = (k * 0.5).astype(pool_dtype)
    v = (v * 0.5).astype(pool_dtype)
  perm = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
  per_set = batch * pages_per_seq
  tables = []
  for t in range(max(sets, kcalls)):
    pages = perm[(t % sets) * per_set:(t % sets + 1) * per_set]
    tables.append(jnp.asarray(rng.permutation(pages).reshape(batch, pages_per_seq)))
  qs = [jax.random.normal(k_, (batch, HQ, D), jnp.bfloat16)
        for k_ in jax.random.split(kq, kcalls)]
  lens = jnp.full((batch,), ctx, jnp.int32)
  scales = dict(k_scale=2.0, v_scale=2.0) if pool_dtype != jnp.bfloat16 else {}
  return dict(k=k, v=v, tables=tables, qs=qs, lens=lens, scales=scales,
              bytes=bytes_per_call, kcalls=kcalls, sets=sets)


def time_op(op, qs, pools, tables, lens, *, kcalls, reps=3):
  """Seconds per op: median wall time of one jitted call that runs the op
  `kcalls` times back to back (call i on qs[i], tables[i]), divided by kcalls.

  op(q, pools, table, lens) -> out; every array is a jit argument (no captured
  constants). The fixed dispatch cost of the jit call (tens of us) is spread
  over the calls and counted, so small shapes are measured conservatively.
  """
  @jax.jit
  def run(qs, pools, tables, lens):
    return [op(qs[i], pools, tables[i], lens) for i in range(kcalls)]

  args = (qs[:kcalls], pools, tables[:kcalls], lens)
  jax.block_until_ready(run(*args))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(run(*args))
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts) / kcalls


def rel_err(a, b):
  a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def triton_ops(case, batch):
  """jax's Triton paged_attention on the [Hkv, P, page, D] layout (converted once,
  outside the timed region). Returns (pools, [(config, op)])."""
  from jax.experimental.pallas.ops.gpu import paged_attention as tpa
  kt = jnp.transpose(case["k"], (2, 0, 1, 3))
  vt = jnp.transpose(case["v"], (2, 0, 1, 3))
  if case["scales"]:
    ks = jnp.full(kt.shape[:3], case["scales"]["k_scale"], jnp.float32)
    vs = jnp.full(kt.shape[:3], case["scales"]["v_scale"], jnp.float32)
    pools = (kt, vt, ks, vs)
  else:
    pools = (kt, vt)
  max_pages = case["tables"][0].shape[1]
  # (k_splits, pages_per_compute_block); 8 pages per block overflows SMEM when a
  # split holds >= 16 pages, so long splits use 4.
  if max_pages >= 256:
    configs = [(16, 4)]
  elif (batch, max_pages) == (64, 64):
    configs = [(16, 8), (4, 4)]
  else:
    configs = [(16, 8)]
  ops = []
  for k_splits, ppcb in configs:
    k_splits = min(k_splits, max_pages)

    def op(q, pools, table, lens, k_splits=k_splits, ppcb=ppcb):
      kt, vt, *sc = pools
      # The Triton kernel has no softmax-scale argument: pre-scale q.
      qq = (q.astype(jnp.float32) / math.sqrt(D)).astype(q.dtype)
      return tpa.paged_attention(
          qq, kt, vt, table, lens,
          k_scales_pages=sc[0] if sc else None, v_scales_pages=sc[1] if sc else None,
          k_splits=k_splits, pages_per_compute_block=ppcb)
    ops.append((f"k_splits={k_splits},ppcb={ppcb}", op))
  return pools, ops


def bench_row(batch, ctx, pool_dtype, *, variants=None, with_xla=True,
              with_triton=True):
  case = make_case(batch, ctx, pool_dtype)
  nbytes = case["bytes"]
  sc = case["scales"]
  kc = case["kcalls"]
  row = dict(batch=batch, context=ctx, dtype=jnp.dtype(pool_dtype).name,
             bytes=nbytes, page_sets=case["sets"], calls_per_timing=kc)
  qs, tables, lens = case["qs"], case["tables"], case["lens"]
  pools = (case["k"], case["v"])
  ref = jax.jit(lambda q, k, v, t, l: paged_decode_attention(
      q, k, v, t, l, backend="xla", **sc))(qs[0], *pools, tables[0], lens)

  from pallas_kernels.paged_attention import kernel as pk
  tb, ns, splits = pk.plan(batch, HKV, ctx // PAGE, PAGE, D, pool_dtype, 16)
  row["ours_cfg"] = f"block={tb},stages={ns},splits={splits}"
  for name, kw in (variants or {"ours": {}}).items():
    def op(q, pools, table, lens, kw=kw):
      return paged_decode_attention_kernel(q, *pools, table, lens, **kw, **sc)
    try:
      out = jax.jit(op)(qs[0], pools, tables[0], lens)
      row[f"{name}_err"] = rel_err(out, ref)
      sec = time_op(op, qs, pools, tables, lens, kcalls=kc)
      row[f"{name}_us"] = sec * 1e6
      row[f"{name}_tbs"] = nbytes / sec / 1e12
    except Exception as e:  # keep the run going; report the failure
      row[f"{name}_error"] = repr(e)[:300]
      traceback.print_exc()
  if with_xla:
    def xop(q, pools, table, lens):
      return paged_decode_attention(q, *pools, table, lens, backend="xla", **sc)
    try:
      sec = time_op(xop, qs, pools, tables, lens, kcalls=kc, reps=3)
      row["xla_us"], row["xla_tbs"] = sec * 1e6, nbytes / sec / 1e12
    except Exception as e:
      row["xla_error"] = repr(e)[:300]
      traceback.print_exc()
  if with_triton:
    best = None
    try:
      tpools, tops = triton_ops(case, batch)
    except Exception as e:
      tops = []
      row["triton_error"] = repr(e)[:300]
    for cfg, op in tops:
      try:
        out = jax.jit(op)(qs[0], tpools, tables[0], lens)
        err = rel_err(out, ref)
        sec = time_op(op, qs, tpools, tables, lens, kcalls=kc)
        if best is None or sec < best[0]:
          best = (sec, cfg, err)
      except Exception as e:
        row.setdefault("triton_error", repr(e)[:300])
        traceback.print_exc()
    if best is not None:
      row["triton_us"], row["triton_tbs"] = best[0] * 1e6, nbytes / best[0] / 1e12
      row["triton_cfg"], row["triton_err"] = best[1], best[2]
  return row


def check_ragged(batch, ctx, kernel=paged_decode_attention_kernel):
  """Ragged lengths (0, 1, partial blocks, full) through the default plan vs the
  reference, on the GPU."""
  rng = np.random.default_rng(1)
  lens = rng.integers(0, ctx + 1, batch).astype(np.int32)
  lens[:4] = [0, 1, 64, ctx]
  case = make_case(batch, ctx, jnp.bfloat16)
  args_ = (case["qs"][0], case["k"], case["v"], case["tables"][0], jnp.asarray(lens))
  out = jax.jit(kernel)(*args_)
  ref = jax.jit(functools.partial(paged_decode_attention, backend="xla"))(*args_)
  out_np = np.asarray(jnp.asarray(out, jnp.float32))
  return dict(check=f"ragged kv_lens, batch {batch} x {ctx}, default plan",
              rel_err=rel_err(out, ref), zero_row_ok=bool(np.all(out_np[0] == 0.0)),
              finite=bool(np.isfinite(out_np).all()))


def fmt(v, spec):
  return format(v, spec) if isinstance(v, (int, float)) else "n/a"


def print_table(rows, names=("ours",)):
  print(time.strftime("%H:%M:%S"), flush=True)
  hdr = f"{'batch':>5} {'ctx':>6} {'dtype':>13} {'MB':>8} |"
  for n in (*names, "xla", "triton"):
    hdr += f" {n + ' us':>12} {'TB/s':>5} |"
  hdr += " err(ours) err(triton)"
  print(hdr)
  for r in rows:
    line = f"{r['batch']:>5} {r['context']:>6} {r['dtype']:>13} {r['bytes'] / 1e6:>8.1f} |"
    for n in (*names, "xla", "triton"):
      line += f" {fmt(r.get(n + '_us'), '12.1f')} {fmt(r.get(n + '_tbs'), '5.2f')} |"
    line += f" {fmt(r.get(names[0] + '_err'), '9.1e')} {fmt(r.get('triton_err'), '11.1e')}"
    print(line, flush=True)


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--json", default="bench_paged_attention.json")
  ap.add_argument("--sweep", action="store_true",
                  help="also time kernel variants (stages, block, splits)")
  ap.add_argument("--quick", action="store_true", help="main shape only")
  args = ap.parse_args(argv)
  print("device:", jax.devices()[0].device_kind, "| jax", jax.__version__, flush=True)

  # Most important first (the run may be cut short; JSON is saved after each row).
  shapes = [(64, 4096, jnp.bfloat16), (64, 4096, jnp.float8_e4m3fn),
            (8, 4096, jnp.bfloat16), (1, 16384, jnp.bfloat16), (8, 16384, jnp.bfloat16),
            (64, 1024, jnp.bfloat16), (1, 4096, jnp.bfloat16), (8, 1024, jnp.bfloat16),
            (1, 1024, jnp.bfloat16)]
  if args.quick:
    shapes = shapes[:1]
  rows, sweep_rows = [], []

  def save():
    with open(args.json, "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                     rows=rows, sweep=sweep_rows), f, indent=1)

  for batch, ctx, dtype in shapes:
    rows.append(bench_row(batch, ctx, dtype))
    print_table(rows[-1:])
    save()

  ragged = check_ragged(64, 4096)
  print(json.dumps(ragged), flush=True)
  sweep_rows.append(ragged)
  save()

  if args.sweep:
    variants = {"tb128_ns3": dict(block_tokens=128, num_stages=3),
                "tb64_ns3_2cta": dict(block_tokens=64, num_stages=3)}
    sweep_rows.append(bench_row(64, 4096, jnp.bfloat16, variants=variants,
                                with_xla=False, with_triton=False))
    print(json.dumps(sweep_rows[-1]), flush=True)
    save()

  print("\n== paged decode attention, Hq=32 Hkv=8 D=128 page=64 ==")
  print_table(sorted(rows, key=lambda r: (r['dtype'] != 'bfloat16', r['batch'],
                                          r['context'])))
  save()
  print("wrote", args.json)


if __name__ == "__main__":
  sys.exit(main())
