"""KDA on one GPU: our Pallas kernels vs fla 0.6.0 (Triton), same shapes, same run.

    python benchmarks/bench_kda.py [--out kda.json] [--budget-s 420] [--no-fla] [--quick]

1. Correctness of the compiled Pallas kernels against the pure-jnp reference (backend="xla"):
   varlen prefill (lengths 1..2048, H=4), prefill B=1 T=8K H=32 D=128, decode and verify
   N=64 H=32. Relative L2 errors are printed; the script exits non-zero if one is too big.
2. Prefill (bf16 q/k/v, fp32 GLM safe gate g in [-5, 0), l2norm in kernel, final state out):
   ours (`chunk_kda(backend="pallas")`, also split at T=32K into its XLA prep, its Mosaic GPU
   intra-chunk kernel and its Mosaic GPU scan) vs fla `chunk_kda(safe_gate=True, lower_bound=-5)` and, at B=1
   H=32, tokamax's pure-XLA `xla_chunked` KDA.
3. Decode, one token per sequence, fp32 state H=32 D=128: ours per call (pool donated) and
   per step inside a 16-step on-device loop vs fla `fused_recurrent_kda` per call; effective
   state traffic = N*H*K*V*4 bytes read + written.
Times are medians (JAX: back-to-back calls, block at the end; fla: triton do_bench). Items
that would overrun --budget-s are skipped and listed. Prints a table, writes JSON.
--scope-profile TxH adds the intra-chunk kernel's per-scope times from Mosaic GPU's in-kernel
profiler (what each phase of one CTA costs; GPU only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")  # leave room for torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kda import chunk_kda, kda_decode, kda_verify
from pallas_kernels.kda import kernel as kk

T0 = time.time()
TINY = False   # --tiny: CPU smoke test of this script (interpret mode, small shapes)


def sz(x, small):
  return small if TINY else x


def rel(a, b):
  a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
  if not np.all(np.isfinite(a)):
    return float("inf")
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def inputs(lead, h, d, seed=0):
  """Host float32 arrays: q, k, v ~ N(0,1); g = -5*sigmoid(x) (GLM safe gate); beta sigmoid."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal(lead + (h, d), np.float32)
  k = rng.standard_normal(lead + (h, d), np.float32)
  v = rng.standard_normal(lead + (h, d), np.float32)
  g = (-5.0 / (1.0 + np.exp(-rng.standard_normal(lead + (h, d), np.float32) - 1.0)))
  beta = 1.0 / (1.0 + np.exp(-rng.standard_normal(lead + (h,), np.float32)))
  return q, k, v, g.astype(np.float32), beta.astype(np.float32)


def to_jax(q, k, v, g, beta):
  bf = jnp.bfloat16
  return (jnp.asarray(q, bf), jnp.asarray(k, bf), jnp.asarray(v, bf), jnp.asarray(g),
          jnp.asarray(beta, bf))


def time_jax(fn, *args, iters=10, reps=5):
  """Median seconds per call of an already-jitted fn (back-to-back calls; one with --tiny)."""
  iters, reps = (1, 1) if TINY else (iters, reps)
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    ts.append((time.perf_counter() - t) / iters)
  return float(np.median(ts))


def time_decode(step, pool, args, iters=20, reps=5):
  """Median seconds per call of step(pool, *args) -> (o, pool) with the pool donated (one
  call with --tiny)."""
  iters, reps = (1, 1) if TINY else (iters, reps)
  _, pool = step(pool, *args)
  jax.block_until_ready(pool)
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    for _ in range(iters):
      _o, pool = step(pool, *args)
    jax.block_until_ready(pool)
    ts.append((time.perf_counter() - t) / iters)
  return float(np.median(ts)), pool


class Fla:
  """fla 0.6.0 through torch on the same GPU (absent -> every call returns None)."""

  def __init__(self, enabled):
    self.ok = False
    if not enabled:
      self.why = "disabled (--no-fla)"
      return
    try:
      import torch
      import triton
      from fla.ops.kda import chunk_kda as fla_chunk
      from fla.ops.kda import fused_recurrent_kda as fla_rec
    except Exception as e:  # noqa: BLE001 - report and continue without fla
      self.why = f"import failed: {type(e).__name__}: {e}"
      return
    self.torch, self.triton, self.chunk, self.rec = torch, triton, fla_chunk, fla_rec
    self.ok, self.why = True, ""

  def _t(self, x, dtype):
    return self.torch.from_numpy(np.ascontiguousarray(x)).cuda().to(dtype)

  def prefill_ms(self, q, k, v, g, beta):
    if not self.ok:
      return None
    t, bf = self.torch, self.torch.bfloat16
    tq, tk, tv, tb = (self._t(x, bf) for x in (q, k, v, beta))
    tg = self._t(g, t.float32)

    def run():
      return self.chunk(tq, tk, tv, tg, tb, output_final_state=True,
                        use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5.0)

    with t.inference_mode():
      return float(self.triton.testing.do_bench(run, warmup=25, rep=100,
                                                return_mode="median"))

  def decode_ms(self, q, k, v, g, beta, state):
    if not self.ok:
      return None
    t, bf = self.torch, self.torch.bfloat16
    tq, tk, tv, tb = (self._t(x[:, None], bf) for x in (q, k, v, beta))
    tg = self._t(g[:, None], t.float32)
    ts = self._t(state, t.float32)

    def run():
      return self.rec(tq, tk, tv, tg, tb, initial_state=ts, output_final_state=True,
                      use_qk_l2norm_in_kernel=True)

    with t.inference_mode():
      return float(self.triton.testing.do_bench(run, warmup=25, rep=100,
                                                return_mode="median"))


def tokamax_prefill_ms(q, k, v, g, beta):
  """tokamax 0.0.17 `kimi_delta_attention(implementation="xla_chunked")` on the same shape.

  That implementation only takes the raw gate with the fused activation, so it gets f = g
  with A_log = 0, dt_bias = 0 and lower_bound -5 (same work, a different gate value); its
  layout is [H, B, T, K], transposed outside the timed call. None when tokamax is absent."""
  try:
    from tokamax._src.ops.kda.api import kimi_delta_attention
  except ImportError:
    return None
  h, dk = q.shape[2], q.shape[3]
  t = lambda x: jnp.asarray(np.moveaxis(x, 2, 0), jnp.bfloat16)
  f = jax.jit(lambda q, k, v, g, b: kimi_delta_attention(
      q, k, v, g, b, a_log=jnp.zeros((h,), jnp.float32),
      delta_time_bias=jnp.zeros((h * dk,), jnp.float32), output_final_state=True,
      use_qk_l2norm=True, use_gate_in_kernel=True, lower_bound=-5.0,
      implementation="xla_chunked"))
  return time_jax(f, t(q), t(k), t(v), jnp.asarray(np.moveaxis(g, 2, 0)), t(beta),
                  iters=3, reps=3) * 1e3


def check(results, failures, cases=None):
  """Compiled Pallas kernels vs the jnp reference (cases: prefixes of case names to run)."""
  kw = {"output_final_state": True, "use_qk_l2norm": True}
  lens = sz((1, 15, 16, 63, 64, 65, 200, 2048, 777), (1, 65, 70))
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
  args = to_jax(*inputs((1, sum(lens)), 4, 128, seed=1))
  init = jnp.asarray(np.random.default_rng(2).standard_normal((len(lens), 4, 128, 128)) * .3,
                     jnp.float32)
  rows = []
  for name, a, extra in (
      ("prefill varlen H=4 D=128 (9 seqs, 3349 tok, init)", args,
       {"cu_seqlens": cu, "initial_state": init}),
      ("prefill B=1 T=8192 H=32 D=128",
       to_jax(*inputs((1, sz(8192, 128)), sz(32, 1), 128, seed=3)), {}),
      ("prefill B=1 T=32768 H=32 D=128",
       to_jax(*inputs((1, sz(32768, 192)), sz(32, 1), 128, seed=4)), {}),
  ):
    if cases is not None and not any(name.startswith(p) for p in cases):
      continue
    f = jax.jit(lambda *x, extra=extra: chunk_kda(*x, backend="pallas", interpret=TINY, **kw,
                                                  **extra))
    r = jax.jit(lambda *x, extra=extra: chunk_kda(*x, backend="xla", **kw, **extra))
    (o, s), (o_r, s_r) = f(*a), r(*a)
    rows.append((name, rel(o, o_r), rel(s, s_r)))
  n, h, d = sz(64, 2), sz(32, 1), 128
  if cases is not None and not any(p.startswith(("decode", "verify")) for p in cases):
    return _print_check(rows, results, failures)
  q, k, v, g, beta = (jnp.asarray(x) for x in inputs((n,), h, d, seed=5))
  pool = jnp.asarray(np.random.default_rng(6).standard_normal((n + 1, h, d, d)) * .3,
                     jnp.float32)
  slots = jnp.arange(1, n + 1, dtype=jnp.int32)
  o, p = jax.jit(lambda *x: kda_decode(*x, backend="pallas", interpret=TINY,
                                       use_qk_l2norm=True))(
      q, k, v, g, beta, pool, slots)
  o_r, p_r = kda_decode(q, k, v, g, beta, pool, slots, backend="xla", use_qk_l2norm=True)
  rows.append(("decode N=64 H=32 D=128", rel(o, o_r), rel(p, p_r)))
  q, k, v, g, beta = (jnp.asarray(x) for x in inputs((n, 4), h, d, seed=7))
  o, st = jax.jit(lambda *x: kda_verify(*x, backend="pallas", interpret=TINY,
                                        use_qk_l2norm=True))(
      q, k, v, g, beta, pool, slots)
  o_r, st_r = kda_verify(q, k, v, g, beta, pool, slots, backend="xla", use_qk_l2norm=True)
  rows.append(("verify N=64 Ts=4 H=32 D=128", rel(o, o_r), rel(st, st_r)))
  _print_check(rows, results, failures)


def _print_check(rows, results, failures):
  print("\n== correctness: compiled Pallas vs jnp reference (relative L2) ==")
  for name, eo, es in rows:
    tol = 2e-2 if name.startswith("prefill") else 1e-4
    ok = eo < tol and es < tol
    print(f"{name:52s} o {eo:.2e}  state {es:.2e}  {'ok' if ok else 'FAIL'}")
    results["check"].append({"case": name, "rel_o": eo, "rel_state": es, "ok": ok})
    if not ok:
      failures.append(name)


def bench_prefill(results, fla, budget, quick, shapes=None, tokamax=True):
  shapes = shapes or [(1, 8192, 32), (1, 32768, 32), (1, 8192, 64), (1, 32768, 64),
                      (4, 8192, 32)]
  if quick:
    shapes = shapes[:2]
  if TINY:
    shapes = [(1, 128, 1), (1, 256, 1)]
  print("\n== prefill (ms) ==")
  for b, t, h in shapes:
    if time.time() - T0 > budget:
      results["skipped"].append(f"prefill B={b} T={t} H={h}")
      continue
    host = inputs((b, t), h, 128, seed=t + h)
    a = to_jax(*host)
    f = jax.jit(lambda *x: chunk_kda(*x, backend="pallas", interpret=TINY,
                                     output_final_state=True, use_qk_l2norm=True))
    ours = time_jax(f, *a) * 1e3
    row = {"B": b, "T": t, "H": h, "D": 128, "ours_ms": ours}
    if (b, t, h) == sz((1, 32768, 32), (1, 256, 1)):
      row.update(_stage_split(a))
    row["fla_ms"] = fla.prefill_ms(*host)
    if tokamax and b == 1 and h == sz(32, 1):
      row["tokamax_xla_chunked_ms"] = tokamax_prefill_ms(*host)
    row["ratio_ours_over_fla"] = (ours / row["fla_ms"]) if row["fla_ms"] else None
    results["prefill"].append(row)
    print(json.dumps(row))


def _stage_inputs(a):
  """The stages of our B=1 prefill (bf16 q / k, as the benchmark's inputs) as separate jitted
  functions with their real inputs: prep (beta's transpose, and the chunk cumsum kernel where
  the intra-chunk kernel does not take the cumsum itself), the Mosaic GPU intra-chunk kernel
  (l2norm and scale of q / k included), the scan.
  Returns (prep, prep's args, intra, intra's args, scan, scan's args)."""
  q, _k, _v, _g, _beta = a
  b, t, h, d = q.shape
  c = kk.CHUNK
  f32 = jnp.float32

  r = lambda x: x.reshape((b * t // c, c) + x.shape[2:])

  def decays(g, beta):
    return kk._chunk_decays(r(g.astype(f32)), r(beta.astype(f32)), interpret=TINY)

  def prep(g, beta):
    """What the prefill computes before the intra-chunk kernel (q / k / v enter that kernel
    as they are: their chunk layout is a reshape, no copy; so does g where the kernel takes
    its cumsum, and returning it would time a copy)."""
    gam, beta_t = decays(g, beta)
    return (beta_t,) if kk._cumsum_in_kernel(d) else (gam, beta_t)

  chunked = tuple(jax.block_until_ready(r(x)) for x in a[:3])
  ins = chunked + jax.block_until_ready(jax.jit(decays)(*a[3:]))
  prep_j = jax.jit(prep)
  intra = jax.jit(lambda *x: kk._intra_call(*x, interpret=TINY, scale=d ** -0.5, l2norm=True))
  ops = jax.block_until_ready(intra(*ins))
  n = b
  cs = jnp.arange(n, dtype=jnp.int32) * (t // c)
  ncs = jnp.full((n,), t // c, jnp.int32)
  scan = jax.jit(lambda *o: kk._scan_call(*o, cs, ncs, None, None, out_dtype=jnp.bfloat16,
                                          num_ckpt=0, vt=kk._scan_v_tile(n, h, _v.shape[-1]),
                                          interpret=TINY))
  return prep_j, a[3:], intra, ins, scan, ops


def _stage_split(a):
  """Times the three stages of our prefill separately (B=1, fixed length)."""
  prep, a, intra, ins, scan, ops = _stage_inputs(a)
  return {"ours_prep_ms": time_jax(prep, *a) * 1e3,
          "ours_intra_ms": time_jax(intra, *ins) * 1e3,
          "ours_scan_ms": time_jax(scan, *ops) * 1e3}


def scope_profile(t, h):
  """Per-scope time of the intra-chunk kernel from Mosaic GPU's in-kernel profiler (one
  trace per CTA; the kernel's jax.named_scope regions): mean and median µs per CTA."""
  import collections
  import glob
  import tempfile

  from jax.experimental.pallas import mosaic_gpu as plgpu
  a = to_jax(*inputs((1, t), h, 128, seed=1))
  _prep, _a, _intra, ins, _scan, _ops = _stage_inputs(a)
  d = tempfile.mkdtemp(prefix="kda_scopes_")
  plain = plgpu.CompilerParams
  plgpu.CompilerParams = lambda **kw: plain(**kw, profile_space=64, profile_dir=d)
  kk._intra_call.clear_cache()            # the timed stages traced it without the profiler
  try:
    jax.block_until_ready(jax.jit(lambda *x: kk._intra_call(*x, interpret=False, scale=128 ** -0.5,
                                                         l2norm=True))(*ins))
  finally:
    plgpu.CompilerParams = plain
  events = json.loads(Path(sorted(glob.glob(d + "/*.json"))[-1]).read_text())["traceEvents"]
  spans, open_at = collections.defaultdict(list), {}
  for e in events:
    key = (e["tid"], e["name"])
    if e["ph"] == "B":
      open_at[key] = e["ts"]
    else:
      spans[e["name"]].append(e["ts"] - open_at.pop(key))
  print(f"\n== intra-chunk kernel scopes, T={t} H={h} (us per CTA) ==")
  for name, v in spans.items():
    print(f"  {name:12s} mean {np.mean(v):8.2f}  median {np.median(v):8.2f}  CTAs {len(v)}")


def bench_decode(results, fla, budget):
  h, d = sz(32, 1), 128
  print("\n== decode, one token per sequence, fp32 state (us) ==")
  for n in sz((1, 8, 64, 256), (1, 2)):
    if time.time() - T0 > budget:
      results["skipped"].append(f"decode N={n}")
      continue
    host = inputs((n,), h, d, seed=n)
    q, k, v, g, beta = (jnp.asarray(x) for x in host)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    state = np.random.default_rng(n).standard_normal((n, h, d, d)).astype(np.float32) * .3
    pool = jnp.concatenate([jnp.zeros((1, h, d, d), jnp.float32), jnp.asarray(state)])
    slots = jnp.arange(1, n + 1, dtype=jnp.int32)
    step = jax.jit(lambda p, *x, slots=slots: kda_decode(*x, p, slots, backend="pallas",
                                            interpret=TINY, use_qk_l2norm=True),
                   donate_argnums=0)
    per_call, pool = time_decode(step, pool, (q, k, v, g, beta))

    def loop(p, *x, steps=16, slots=slots):
      def body(_, p):
        return kda_decode(*x, p, slots, backend="pallas", interpret=TINY, use_qk_l2norm=True)[1]
      return lax_fori(steps, body, p)

    loop_j = jax.jit(loop, donate_argnums=0)
    pool = jax.block_until_ready(loop_j(pool, q, k, v, g, beta))
    ts = []
    for _ in range(5):
      t = time.perf_counter()
      pool = loop_j(pool, q, k, v, g, beta)
      jax.block_until_ready(pool)
      ts.append((time.perf_counter() - t) / 16)
    in_loop = float(np.median(ts))
    byts = 2 * n * h * d * d * 4
    row = {"N": n, "H": h, "D": d, "ours_us_per_call": per_call * 1e6,
               "ours_us_per_step_in_loop": in_loop * 1e6,
               "ours_TBps_in_loop": byts / in_loop / 1e12}
    kernel_us, pool = decode_kernel_us(loop_j, pool, (q, k, v, g, beta), steps=16)
    if kernel_us:
      row["ours_kernel_us"] = kernel_us
      row["ours_kernel_TBps"] = byts / (kernel_us * 1e-6) / 1e12
    fms = fla.decode_ms(*host, state)
    row["fla_us_per_call"] = fms * 1e3 if fms else None
    row["fla_TBps"] = byts / (fms * 1e-3) / 1e12 if fms else None
    row["ratio_ours_loop_over_fla"] = (in_loop * 1e3 / fms) if fms else None
    results["decode"].append(row)
    print(json.dumps(row))


def decode_kernel_us(loop_j, pool, args, steps, calls=3):
  """Mean GPU µs of the decode kernel alone (the Mosaic GPU `kda_stream` launches in a profiler
  trace of `calls` runs of the `steps`-step loop), without the XLA input preparation and the loop
  around it; (None, pool) without a GPU. Returns the donated pool's successor."""
  if jax.default_backend() != "gpu":
    return None, pool
  import tempfile

  from trace_summary import summarize
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for _ in range(calls):
        pool = loop_j(pool, *args)
      jax.block_until_ready(pool)
    rows = [r for dev in summarize(d, top=1000) for r in dev["top"] if "kda_stream" in r[0]]
  count = sum(r[1] for r in rows)
  return (sum(r[2] for r in rows) / count if count else None), pool


def lax_fori(n, body, x):
  return jax.lax.fori_loop(0, n, body, x)


def table(results):
  print("\n== summary ==")
  print("prefill  B     T   H | ours ms (prep + intra + scan)     | fla ms | ours/fla | tokamax ms")
  for r in results["prefill"]:
    split = (f" ({r['ours_prep_ms']:.2f} + {r['ours_intra_ms']:.2f} + {r['ours_scan_ms']:.2f})"
             if "ours_intra_ms" in r else "")
    fla = f"{r['fla_ms']:.3f}" if r["fla_ms"] else "n/a"
    ratio = f"{r['ratio_ours_over_fla']:.2f}x" if r["ratio_ours_over_fla"] else "n/a"
    tok = f"{r['tokamax_xla_chunked_ms']:.3f}" if r.get("tokamax_xla_chunked_ms") else "n/a"
    print(f"        {r['B']:2d} {r['T']:6d} {r['H']:3d} | {r['ours_ms']:8.3f}{split:24s} | "
          f"{fla:>6s} | {ratio} | {tok}")
  print("decode   N | ours us/call | ours us/step (loop) TB/s | kernel us TB/s | fla us/call TB/s | loop/fla")
  for r in results["decode"]:
    fla = (f"{r['fla_us_per_call']:8.1f} {r['fla_TBps']:.2f}" if r["fla_us_per_call"]
           else "n/a")
    ratio = (f"{r['ratio_ours_loop_over_fla']:.2f}x" if r["ratio_ours_loop_over_fla"]
             else "n/a")
    kern = (f"{r['ours_kernel_us']:8.1f} {r['ours_kernel_TBps']:.2f}" if r.get("ours_kernel_us")
            else "n/a")
    print(f"       {r['N']:3d} | {r['ours_us_per_call']:12.1f} | "
          f"{r['ours_us_per_step_in_loop']:10.1f} {r['ours_TBps_in_loop']:.2f} | {kern} | {fla} | {ratio}")
  if results["skipped"]:
    print("skipped (time budget):", ", ".join(results["skipped"]))


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="kda_bench.json")
  ap.add_argument("--budget-s", type=float, default=420.0,
                  help="skip items that would start after this many seconds (a device call is <= 600 s)")
  ap.add_argument("--no-fla", action="store_true")
  ap.add_argument("--no-check", action="store_true")
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--tiny", action="store_true", help="CPU smoke test (interpret mode)")
  ap.add_argument("--no-decode", action="store_true")
  ap.add_argument("--no-prefill", action="store_true")
  ap.add_argument("--no-tokamax", action="store_true")
  ap.add_argument("--check-cases", default=None,
                  help="comma-separated case-name prefixes, e.g. 'prefill varlen,prefill B=1 T=8192'")
  ap.add_argument("--prefill-shapes", default=None, help="e.g. 1x8192x32,1x32768x32 (BxTxH)")
  ap.add_argument("--scope-profile", default=None, metavar="TxH",
                  help="also print the intra-chunk kernel's per-scope times (GPU only), e.g. 8192x4")
  args = ap.parse_args()
  if args.tiny:
    global TINY
    TINY = True
    # the interpreter evaluates jnp inside its callbacks; with asynchronous CPU dispatch such a
    # computation can queue behind the jitted call waiting for it (the tests set the same)
    jax.config.update("jax_cpu_enable_async_dispatch", False)
  dev = jax.devices()[0]
  results = {"device": str(getattr(dev, "device_kind", dev)), "jax": jax.__version__,
                 "check": [], "prefill": [], "decode": [], "skipped": []}
  fla = Fla(not args.no_fla)
  results["fla"] = "fla-core 0.6.0" if fla.ok else f"absent: {fla.why}"
  print("device:", results["device"], "| jax", jax.__version__, "|", results["fla"])
  failures = []
  if not args.no_check:
    check(results, failures,
          None if args.check_cases is None else args.check_cases.split(","))
  if not args.no_decode:
    bench_decode(results, fla, args.budget_s)
  shapes = None
  if args.prefill_shapes:
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.prefill_shapes.split(",")]
  if not args.no_prefill:
    bench_prefill(results, fla, args.budget_s, args.quick, shapes, tokamax=not args.no_tokamax)
  if args.scope_profile:
    scope_profile(*(int(x) for x in args.scope_profile.split("x")))
  table(results)
  results["wall_s"] = time.time() - T0
  Path(args.out).write_text(json.dumps(results, indent=1))
  print("wrote", args.out, f"({results['wall_s']:.0f} s)")
  if failures:
    print("CORRECTNESS FAILURES:", failures)
    sys.exit(1)


if __name__ == "__main__":
  main()
