"""pallas_kernels.mxfp8: kernel (Mosaic GPU interpret mode) <-> jnp twin <-> NumPy oracle.

The oracle decodes e4m3 / E8M0 bytes itself (tests/quant/quant_oracle.py). Shapes cover
M = 1, N = 1 (padded to the 64-row tile), K not a multiple of 64 (padded), the split-K decode
path and the prefill path. The kernels are also lowered for CUDA (Mosaic GPU's layout
inference and lowering run on CPU), which catches code that interpret mode accepts but the
H200 compiler would not.
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "quant"))
import quant_oracle as orc  # noqa: E402

from kk_jax.quant import mxfp8 as q  # noqa: E402
from pallas_kernels.common import SMEM_PER_CTA, max_active_clusters, num_sms  # noqa: E402
from pallas_kernels import mma_gemv as mma_kernel  # noqa: E402
from pallas_kernels.mxfp8 import gemv, matmul, matmul_kernel, matmul_reference, mma_gemv  # noqa: E402


def make(m, n, k, seed=0):
    """x [m, k] and an MXFP8 weight whose 32-blocks span 2^-8 .. 2^8 in magnitude."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)) * np.exp2(rng.integers(-8, 9, (n, k // 32))).repeat(32, 1)
    wq, ws = q.quantize(w)
    return jnp.asarray(x), wq, ws.T                  # the kernels take the scales transposed [K/32, N]


def oracle(x, wq, ws):
    return orc.matmul(np.asarray(x), orc.dequant_mxfp8(wq, np.asarray(ws).T))


@pytest.mark.parametrize("m,n,k", [(3, 64, 96), (1, 130, 256)])
def test_reference_matches_oracle(m, n, k):
    x, wq, ws = make(m, n, k)
    assert orc.rel_err(matmul_reference(x, wq, ws, out_dtype=jnp.float32), oracle(x, wq, ws)) < 1e-6


@pytest.mark.parametrize("m,n,k,overrides", [
    (1, 64, 64, {}),                           # M = 1, one K step
    (5, 1, 96, {}),                            # N = 1 row; K = 96 padded to 128
    (8, 128, 512, dict(tk=128, splits=2)),    # decode: split-K partials summed by the wrapper
    (72, 64, 128, {}),                         # prefill tiling (bm = 128)
])
def test_kernel_matches_oracle(m, n, k, overrides):
    x, wq, ws = make(m, n, k, seed=m + n)
    y = matmul_kernel(x, wq, ws, out_dtype=jnp.float32, interpret=True, **overrides)
    assert y.shape == (m, n)
    want = oracle(x, wq, ws)
    assert orc.rel_err(y, want) < 1e-5
    assert orc.rel_err(y, matmul_reference(x, wq, ws, out_dtype=jnp.float32)) < 1e-5


@pytest.mark.parametrize("n,k,sms", [(16, 1024, None), (80, 4096, 1), (32, 1280, None)])
def test_one_row_runs_the_gemv(n, k, sms, gemv_spy):
    """One activation row goes to the CUDA-core GEMV (fp32 and bf16 written by the kernel). sms =
    1: the CTAs of one SM share five 16-row items (unevenly) of four K tiles each, so the ring
    is refilled; K = 1280 ends in a partial tile; the weight's 32-blocks span 2^-8 .. 2^8."""
    calls = gemv_spy(gemv, sms, items=n // 16, tiles=-(-k // 1024))
    x, wq, ws = make(1, n, k, seed=n)
    y = matmul_kernel(x, wq, ws, out_dtype=jnp.float32, interpret=True)
    assert calls and y.shape == (1, n)
    assert orc.rel_err(y, oracle(x, wq, ws)) < 1e-5
    yb = matmul_kernel(x, wq, ws, out_dtype=jnp.bfloat16, interpret=True)
    assert yb.dtype == jnp.bfloat16 and orc.rel_err(yb, oracle(x, wq, ws)) < 4e-3
    assert not gemv.supported(2, n, k) and not gemv.supported(1, n, k + 128)


def test_one_row_past_the_gemvs_k_runs_the_mma_gemv(gemv_spy):
    """One row whose K the CUDA-core GEMV cannot stage (past 16384) runs the mma GEMV, not the
    engine."""
    rows, few = gemv_spy(gemv), gemv_spy(mma_gemv)
    x, wq, ws = make(1, 64, 16896, seed=5)
    assert not gemv.supported(1, 64, 16896) and mma_gemv.supported(1, 64, 16896)
    y = matmul_kernel(x, wq, ws, out_dtype=jnp.float32, interpret=True)
    assert (len(rows), len(few)) == (0, 1) and orc.rel_err(y, oracle(x, wq, ws)) < 1e-5


@pytest.mark.parametrize("m,n,k,sms,plan", [
    (2, 64, 2048, None, (32, 3, 2, 2)),    # two 32-row items of 4 K tiles, each over a cluster of 2
    (6, 128, 8192, None, (32, 3, 8, 2)),   # 4 items of 16 tiles: clusters of 8, 2 tiles each
    (8, 64, 7168, None, (32, 3, 4, 2)),    # 14 tiles over clusters of 4: 4, 4, 3 and 3 tiles
    (3, 64, 1536, None, (32, 3, 1, 2)),    # 3 tiles: no even split
    (3, 128, 3072, 4, (32, 3, 1, 4)),   # 4 items of 6 tiles, 4 SMs: 1 or 2 splits load an SM alike; 3 tiles a CTA
                                         # are too few to split, so one CTA an SM with a 4-slot ring that refills
    (8, 448, 3072, 1, (32, 2, 1, 2)),      # 14 items, 7 a CTA: their 6 tiles each refill the ring across items
    (8, 448, 1536, 2, (64, 2, 1, 2)),      # 7 64-row items over 4 CTAs (unevenly)
    (12, 64, 1536, None, (32, 3, 1, 2)),   # two 8-token column blocks, the second partly filled
    (16, 320, 3072, 2, (64, 3, 1, 2)),     # two full column blocks on ring refills
    (4, 128, 768, None, (64, 3, 1, 2)),    # K not a multiple of a 32-row tile's 512 codes: 64-row items
])
def test_few_rows_run_the_mma_gemv(m, n, k, sms, plan, gemv_spy):
    """2-16 activation rows go to the tensor-core GEMV (fp32 and bf16 out); both item shapes, K
    splits (added by XLA in the interpreter, by the kernel on the GPU) and ring refills; 32-blocks
    span 2^-8 .. 2^8."""
    rows = plan[0]
    calls = gemv_spy(mma_gemv, sms, items=n // rows, tiles=k // mma_gemv.FORMAT.tile_k(rows), kernel=mma_kernel,
                     stages=plan[3])
    assert mma_kernel._plan(mma_gemv.FORMAT, n, k, m) == plan
    x, wq, ws = make(m, n, k, seed=n + m)
    y = matmul_kernel(x, wq, ws, out_dtype=jnp.float32, interpret=True)
    assert calls and y.shape == (m, n)
    assert orc.rel_err(y, oracle(x, wq, ws)) < 1e-5
    yb = matmul_kernel(x, wq, ws, out_dtype=jnp.bfloat16, interpret=True)
    assert yb.dtype == jnp.bfloat16 and orc.rel_err(yb, oracle(x, wq, ws)) < 4e-3
    assert not mma_gemv.supported(17, n, k) and not mma_gemv.supported(m, n + 16, k)
    with pytest.raises(ValueError, match=r"mxfp8_mma_gemv serves 1 <= M <= 16 \(9-16 where K splits 2 ways at most\)"):
        mma_gemv.gemv(jnp.zeros((17, k), x.dtype), wq, ws, out_dtype=jnp.float32, interpret=True)


def test_plan_splits_k_where_each_cta_keeps_six_tiles(monkeypatch):
    """Of equally loaded plans: a K split where each CTA of it still streams 6 tiles
    (4096x12288: 24 8-bit tiles, 2 splits, two CTAs an SM), else one CTA alone on its SM, with a
    4-slot ring where it streams more than 4 tiles (4096x4096: 8 8-bit tiles, 4 NVFP4 ones), at
    every token count and in every format (H200 timings, RESULTS.md part 50)."""
    from pallas_kernels.fp8_block import mma_gemv as fp8_mma
    from pallas_kernels.nvfp4 import mma_gemv as nvfp4_mma

    monkeypatch.setattr(mma_kernel, "num_sms", lambda: 132)
    for fmt in (mma_gemv.FORMAT, fp8_mma.FORMAT, nvfp4_mma.FORMAT):
        for m in (1, 2, 8, 16):
            assert mma_kernel._plan(fmt, 4096, 12288, m)[2:] == (2, 2)
            assert mma_kernel._plan(fmt, 4096, 4096, m)[2:] == (1, 2 if fmt is nvfp4_mma.FORMAT else 4)  # NVFP4: 4 tiles
    assert mma_kernel._plan(mma_gemv.FORMAT, 4096, 12288, 8) == (32, 3, 2, 2)
    assert mma_kernel._plan(mma_gemv.FORMAT, 4096, 12288, 16) == (32, 2, 2, 2)   # 3 CTAs of 2 splits do not fit


def test_nine_to_sixteen_rows_split_k_at_most_twice():
    """MXFP8 takes 9-16 rows where K splits at most 2 ways (4096x12288: 2; 4096x4096: 1); where
    the plan needs clusters of 4 (2048x4096) it keeps the engine, NVFP4 not."""
    from pallas_kernels.nvfp4 import mma_gemv as nvfp4_mma

    assert mma_gemv.supported(16, 4096, 4096) and mma_gemv.supported(16, 4096, 12288)
    assert mma_gemv.supported(9, 24576, 4096)
    assert mma_kernel._plan(mma_gemv.FORMAT, 2048, 4096, 16) == (32, 2, 4, 2)
    assert not mma_gemv.supported(16, 2048, 4096) and mma_gemv.supported(8, 2048, 4096)
    assert nvfp4_mma.supported(16, 2048, 4096)
    x, wq, ws = make(16, 2048, 4096, seed=5)
    with pytest.raises(ValueError, match="got M=16, N=2048, K=4096"):
        mma_gemv.gemv(x, wq, ws, out_dtype=jnp.float32, interpret=True)


def test_plan_keeps_clusters_the_gpu_can_place(monkeypatch):
    """Clusters of 4 that need more places than the GPU's clusters offer are not taken (the
    H200's counts: 92 clusters of 4 at 3 CTAs an SM; 3072x4096 has 96 32-row items, which then
    take one CTA each). Clusters past what fewer CTAs an SM hold share SMs: 2048x4096's 64
    clusters of 4 put a third CTA on some SMs (62 fit at two), so 2 splits, one CTA an SM, run
    instead; NVFP4 2048x9728's 32 clusters of 4 keep 2 ring slots, so that the two past the 30
    that one CTA an SM holds share SMs rather than wait for the others."""
    from pallas_kernels.nvfp4 import gemv as nvfp4_row, mma_gemv as nvfp4_mma

    h200 = {(4, 3): 92, (8, 3): 45, (4, 2): 62, (8, 2): 30, (4, 1): 30, (8, 1): 15}
    monkeypatch.setattr(mma_kernel, "num_sms", lambda: 132)
    monkeypatch.setattr(mma_kernel, "max_active_clusters", lambda s, per_sm: h200.get((s, per_sm), 132 * per_sm // s))
    assert mma_kernel._plan(mma_gemv.FORMAT, 3072, 4096, 8) == (32, 3, 1, 4)
    assert mma_kernel._plan(mma_gemv.FORMAT, 2048, 4096, 8) == (32, 3, 2, 2)
    assert mma_kernel._plan(nvfp4_mma.FORMAT, 4096, 4096, 8) == (32, 3, 1, 2)   # 4 tiles: 2 slots
    assert mma_kernel._plan(nvfp4_mma.FORMAT, 2048, 9728, 8) == (64, 3, 4, 2)
    assert mma_kernel._load(32, 4, 2, 4) == (2, 1, 1 + 2)       # 2 of 32 clusters share SMs
    assert mma_kernel._load(16, 4, 2, 4) == (1, 1, 1)
    assert mma_kernel._load(64, 8, 3, 4) == (3, 1, 2 * 2 + 2)   # 64 clusters of 4: 62 fit at two an SM
    assert not mma_kernel.takes_one_row(nvfp4_mma.FORMAT, nvfp4_row.FORMAT, 1024, 4096)   # 1 + 2 tiles against 2
    assert mma_kernel.takes_one_row(nvfp4_mma.FORMAT, nvfp4_row.FORMAT, 512, 4096)        # 1 against 2
    monkeypatch.setattr(mma_kernel, "max_active_clusters", lambda s, per_sm: 132 * per_sm // s)
    assert mma_kernel._plan(mma_gemv.FORMAT, 3072, 4096, 8) == (32, 3, 4, 2)
    assert mma_kernel._plan(mma_gemv.FORMAT, 2048, 4096, 8) == (32, 3, 4, 2)
    assert mma_kernel._load(32, 4, 2, 4) == (1, 1, 1)


def test_plan_picks_the_item_rows(monkeypatch):
    """32-row items where they load the busiest SM no more than 64-row ones and leave no more
    items to a CTA; 64-row items where the 32-row ones pile up (H200 counts, RESULTS.md part
    49)."""
    from pallas_kernels.fp8_block import mma_gemv as fp8_mma
    from pallas_kernels.nvfp4 import mma_gemv as nvfp4_mma

    monkeypatch.setattr(mma_kernel, "num_sms", lambda: 132)
    for fmt in (mma_gemv.FORMAT, fp8_mma.FORMAT, nvfp4_mma.FORMAT):
        assert mma_kernel._plan(fmt, 12288, 4096, 8) == (32, 3, 1, 2)     # 384 items, one a CTA
        assert mma_kernel._plan(fmt, 24576, 4096, 2) == (64, 3, 1, 2)     # 768 32-row items would be 2 a CTA
    assert mma_kernel._plan(nvfp4_mma.FORMAT, 12288, 4096, 16) == (64, 2, 1, 2)   # 2 CTAs an SM: 16 tiles either way
    assert mma_kernel._plan(nvfp4_mma.FORMAT, 24576, 4096, 16) == (32, 2, 1, 2)   # 24 tiles against 32


def test_cluster_places_without_a_gpu():
    """No GPU driver to ask: every place an SM offers counts."""
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU answers for itself (test_cluster_places_from_the_driver)")
    assert max_active_clusters(4, 3) == num_sms() * 3 // 4 and max_active_clusters(8, 1) == num_sms() // 8


@pytest.mark.gpu
def test_cluster_places_from_the_driver():
    """The driver's answer: clusters of 2 fill every place; those of 4 and 8 may fall short (the
    H200: 92 clusters of 4 at 3 CTAs an SM, 45 of 8)."""
    assert max_active_clusters(2, 3) == num_sms() * 3 // 2
    assert 0 < max_active_clusters(4, 3) <= num_sms() * 3 // 4 and 0 < max_active_clusters(8, 1) <= num_sms() // 8
    if "H200" in jax.devices()[0].device_kind:
        assert (max_active_clusters(4, 3), max_active_clusters(8, 3)) == (92, 45)


def test_bf16_output_and_leading_dims():
    x, wq, ws = make(6, 64, 128, seed=3)
    y = matmul(x.reshape(2, 3, 128).astype(jnp.bfloat16), wq, ws, interpret=True)
    assert y.shape == (2, 3, 64) and y.dtype == jnp.bfloat16
    assert orc.rel_err(y.reshape(6, 64), oracle(x, wq, ws)) < 1e-2


@pytest.mark.parametrize("bad,msg", [
    (lambda wq, ws: (wq, ws[:-1]), r"w_scale has shape \[3, 64\], expected \[4, 64\] \(transposed\)"),
    (lambda wq, ws: (wq.astype(jnp.bfloat16), ws), "w_q must be float8_e4m3fn"),
    (lambda wq, ws: (wq, ws.astype(jnp.int8)), "w_scale must be uint8"),
    (lambda wq, ws: (wq[:, :120], ws[:3]), "K=120 is not a multiple of 32"),
])
def test_bad_operands_are_named(bad, msg):
    x, wq, ws = make(2, 64, 128)
    w2, s2 = bad(wq, ws)
    with pytest.raises(ValueError, match=msg):
        matmul(x[:, : w2.shape[1]], w2, s2, backend="xla")
    with pytest.raises(ValueError, match=msg):
        matmul(x[:, : w2.shape[1]], w2, s2, backend="pallas", interpret=True)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_staged_scale_tiles_fill_the_tma_alignment(fmt):
    """Each pipeline stage's scale tile (tk / block rows of 64 bytes) is at least 128 bytes, the
    SMEM alignment TMA needs: a 64-byte tile (MXFP8 at tk = 32) put every second stage's copy
    at a misaligned address (CUDA_ERROR_MISALIGNED_ADDRESS on the H200)."""
    from pallas_kernels.mxfp8 import wdequant as wd

    step = wd.MIN_STEP[fmt]                        # 64 for MXFP8; NVFP4's operand order needs 128
    for m in (1, 8, 64, 300):
        for k in (step, 2 * step, 3 * step, 4096):
            p = wd.plan(m, 256, k, fmt)
            assert p.tk // wd.SCALE_BLOCK[fmt] * 64 >= 128 and p.tk >= step, (m, k, p)
    assert wd.plan(64, 256, 4096, fmt, budget=1).tk >= step    # nothing fits: still no narrower step
    with pytest.raises(ValueError, match="multiple"):
        wd.plan(1, 256, step + 32, fmt)            # the wrappers pad such K to a multiple of the step
    with pytest.raises(ValueError, match=f"at least {step}"):
        wd.plan(1, 256, 4096, fmt, tk=32)


def test_decode_split_sizes_per_format():
    """Decode splits K as far as the format's CTA cap allows (each CTA at least two K steps,
    splits dividing the steps): the register-dequantizing formats (MXFP8, NVFP4, block FP8) go
    to many short CTAs up to 16 token rows, bf16 and 64-row tiles stay at the smaller cap."""
    from pallas_kernels.mxfp8 import wdequant as wd

    for n, k in ((12288, 4096), (4096, 12288), (4096, 4096)):
        for m in (1, 16, 64):
            for fmt in ("mxfp8", "nvfp4", "bf16", "fp8_block"):
                p = wd.plan(m, n, k, fmt)
                nk, ctas = k // p.tk, n // wd.BN
                cap = wd.decode_cta_cap(fmt, p.bm)
                assert nk % p.splits == 0 and nk // p.splits >= 2 and ctas * p.splits <= cap, (n, k, fmt, p)
                bigger = [s for s in range(p.splits + 1, nk + 1)
                          if nk % s == 0 and nk // s >= 2 and ctas * s <= cap]
                assert not bigger, (n, k, fmt, p, bigger)
        for fmt in wd.REGISTER_DEQUANT:
            assert wd.plan(1, n, k, fmt).splits > wd.plan(1, n, k, "bf16").splits
            assert wd.plan(64, n, k, fmt).splits <= wd.plan(16, n, k, fmt).splits
    assert wd.decode_cta_cap("mxfp8", 16) == 4 * wd.decode_cta_cap("mxfp8", 64) == 4 * wd.decode_cta_cap("bf16", 8)
    assert wd.plan(1, 12288, 4096, "nvfp4", max_ctas=3 * wd.NUM_SMS).splits == 2


@pytest.mark.parametrize("m,k", [(1, 4096), (8, 4096), (64, 4096), (2048, 4096), (1, 256), (1, 768)])
def test_lowers_for_hopper(m, k):
    """Mosaic GPU lowering (layout inference included) for the decode and prefill tilings; one
    row with K = 256 / 768 stages 3 / 1 rows of x zeros past K in the GEMV's last tile."""
    n = 256
    f = lambda x, w, s: matmul(x, w, s)
    jax.jit(f).trace(jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
                     jax.ShapeDtypeStruct((k // 32, n), jnp.uint8)).lower(lowering_platforms=("cuda",))


def widen(ws, n_row=3, k_block=1):
    """ws [K/32, N] with one 32-block scaled past 2^16: an E8M0 byte above ``mma_gemv.MAX_SCALE``."""
    return ws.at[k_block, n_row].set(mma_gemv.MAX_SCALE + 6)


def test_wide_scales_leave_the_mma_gemv(gemv_spy):
    """A scale byte above 134 overflows the mma GEMV's bf16 factor 2^(s - 7): such 2-16-row calls
    run the engine instead (read from concrete scales, or the caller's ``wide_scales``); traced
    scales count as narrow unless the caller says otherwise."""
    calls = gemv_spy(mma_gemv)
    x, wq, ws = make(4, 128, 512, seed=3)
    wide = widen(ws)
    assert mma_gemv.wide_scales(wide) and not mma_gemv.wide_scales(ws)
    assert not jax.jit(lambda s: jnp.int32(mma_gemv.wide_scales(s)))(wide)
    y = matmul(x, wq, wide, out_dtype=jnp.float32, interpret=True)
    assert not calls and orc.rel_err(y, oracle(x, wq, wide)) < 1e-5
    y = matmul(x, wq, ws, out_dtype=jnp.float32, interpret=True, wide_scales=True)
    assert not calls and orc.rel_err(y, oracle(x, wq, ws)) < 1e-5
    matmul(x, wq, ws, out_dtype=jnp.float32, interpret=True)
    assert len(calls) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(4, 4096, 4096), (16, 12288, 4096)])
def test_compiled_wide_scales_match_oracle(m, n, k):
    """On the GPU a 32-block past 2^16 would come out of the mma GEMV wrong (its bf16 factor's
    exponent field overflows into the sign: byte 140 makes it about -2^-123, and the block's
    products vanish; relative error 1.0 on the H200); the engine it takes instead is exact."""
    x, wq, ws = make(m, n, k, seed=5)
    wide = widen(ws, n_row=n - 1, k_block=k // 64)
    y = matmul(x, wq, wide, backend="pallas", out_dtype=jnp.float32)
    assert orc.rel_err(y, oracle(x, wq, wide)) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (1, 2048, 1536), (1, 512, 256), (1, 512, 768), (8, 1, 96),
                                   (300, 512, 1024), (1100, 384, 640),
                                   (1100, 2560, 640), (2, 4096, 4096), (8, 4096, 12288), (5, 2048, 4096),
                                   (3, 12288, 4096), (4, 256, 8192), (8, 6144, 4096),
                                   (16, 4096, 4096), (12, 12288, 4096), (9, 4096, 12288), (16, 2048, 4096),
                                   (8, 1024, 7168), (2, 6144, 2560)])
def test_compiled_kernel_matches_oracle(m, n, k):
    """M = 2-16 on the mma GEMV (K split over clusters of 2, 4 and 8 CTAs; 9-16 on two column
    blocks), but 16 x 2048 x 4096 on the engine (only 2 CTAs of that plan fit an SM)."""
    x, wq, ws = make(m, n, k, seed=11)
    y = matmul(x, wq, ws, backend="pallas", out_dtype=jnp.float32)
    assert orc.rel_err(y, oracle(x, wq, ws)) < 1e-4


@pytest.mark.gpu
def test_compiled_prefill_bf16_output():
    """The warp-specialized prefill form with a bf16 output tile (deeper pipeline than fp32); 2560
    weight rows x 1100 tokens (MXFP8 takes that form on every grid, ``wdequant.fills_gpu``)."""
    x, wq, ws = make(1100, 2560, 640, seed=12)
    y = matmul(x, wq, ws, backend="pallas", out_dtype=jnp.bfloat16)
    assert orc.rel_err(y.astype(jnp.float32), oracle(x, wq, ws)) < 1e-2


@pytest.mark.gpu
def test_compiled_prefill_last_launch_group_short():
    """2300 tokens are 9 token tiles of 256: the launch order's groups of 8 leave a last group of
    one (``prefill_ws.tile_of``)."""
    x, wq, ws = make(2300, 384, 256, seed=13)
    y = matmul(x, wq, ws, backend="pallas", out_dtype=jnp.float32)
    assert orc.rel_err(y, oracle(x, wq, ws)) < 1e-4


@pytest.mark.parametrize("n_units,m_blocks,group", [(1, 1, 8), (32, 32, 8), (3, 9, 8), (96, 5, 8), (7, 20, 16), (4, 3, 1)])
def test_prefill_launch_order_covers_every_tile_once(n_units, m_blocks, group):
    """`launch_order` is a bijection onto the (weight unit, token tile) grid, and the CTAs of one
    group of token tiles run one weight unit's tiles back to back."""
    from pallas_kernels.mxfp8 import prefill_ws as ws

    tiles = [tuple(int(v) for v in ws.launch_order(t, n_units, m_blocks, group)) for t in range(n_units * m_blocks)]
    assert sorted(tiles) == [(u, mb) for u in range(n_units) for mb in range(m_blocks)]
    size = min(group, m_blocks)
    assert [mb for _, mb in tiles[:size]] == list(range(size)) and {u for u, _ in tiles[:size]} == {0}


def test_prefill_ws_tiles_fit_shared_memory():
    """The warp-specialized prefill form: 128-row weight blocks only, a K step that divides K, and
    a pipeline as deep as the output tile leaves room for (fp32 outputs take twice the bytes)."""
    from pallas_kernels.mxfp8 import prefill_ws as ws

    assert ws.config("mxfp8", 2048, 12288, 4096, jnp.bfloat16) == (256, 64, 4, 1, 1)
    assert ws.config("mxfp8", 2048, 12288, 4096, jnp.float32) == (256, 64, 2, 1, 1)
    assert ws.config("fp8_block", 2048, 12288, 4096, jnp.bfloat16) == (256, 128, 2, 1, 1)
    assert ws.config("fp8_block", 2048, 512, 4032, jnp.bfloat16) == (256, 64, 2, 3, 1)   # K = 63 steps of 64: 32 CTAs x 3
    assert ws.config("mxfp8", 2048, 4032, 4096, jnp.bfloat16) is None                # N not a multiple of 128
    assert ws.config("nvfp4", 2048, 12288, 4096, jnp.bfloat16) == (256, 128, 2, 1, 2)
    assert ws.config("nvfp4", 2048, 12288, 4096, jnp.float32) == (128, 128, 2, 1, 2)    # 256-token fp32 tiles do not fit
    assert ws.config("nvfp4", 2048, 12288, 4032, jnp.bfloat16) is None              # K not a multiple of 128
    for fmt in ws.FORMATS:
        for m in (65, 100, 130, 256, 512, 1100, 4096):
            for n, k in ((512, 1024), (4096, 4096), (12288, 4096), (4096, 12288)):
                for out in (jnp.bfloat16, jnp.float32):
                    c = ws.config(fmt, m, n, k, out)
                    out_bytes = 4 if c.splits > 1 else jnp.dtype(out).itemsize
                    assert ws.smem_bytes(fmt, c.bm, c.tk, c.stages, out_bytes) <= SMEM_PER_CTA, (fmt, m, n, k, c)
                    tiles = -(-m // c.bm)
                    assert c.bm % 16 == 0 and c.bm <= 256 and tiles * c.bm < m + 16 * tiles   # tight token tiles
                    assert k // c.tk % c.splits == 0
                    assert c.splits == 1 or k // c.tk // c.splits >= ws.MIN_SPLIT_STEPS
                    assert n // ws.RB % c.cluster == 0


def test_prefill_ws_small_grids_split_k():
    """Grids smaller than the GPU take tighter token tiles and K splits, up to one CTA per SM
    (one H200: 96-512 tokens through 4096-row weights 1.5-3.5x faster, RESULTS.md part 36);
    grids that fill it keep 256-token tiles."""
    from pallas_kernels.mxfp8 import prefill_ws as ws
    from pallas_kernels.mxfp8 import wdequant as wd

    assert ws.config("nvfp4", 130, 4096, 12288, jnp.bfloat16) == (144, 128, 2, 4, 2)
    assert ws.config("nvfp4", 256, 4096, 4096, jnp.bfloat16) == (128, 128, 2, 2, 2)
    assert ws.config("nvfp4", 512, 4096, 4096, jnp.bfloat16) == (128, 128, 2, 1, 2)
    assert ws.config("mxfp8", 130, 4096, 4096, jnp.bfloat16) == (144, 64, 4, 4, 2)
    assert ws.config("mxfp8", 130, 12288, 4096, jnp.bfloat16) == (144, 64, 4, 1, 2)    # 96 CTAs: no room for 2 splits
    assert ws.config("mxfp8", 512, 12288, 4096, jnp.bfloat16) == (256, 64, 4, 1, 1)    # 192 CTAs fill the GPU
    assert ws.config("fp8_block", 256, 4096, 4096, jnp.bfloat16) == (128, 128, 2, 2, 1)
    for fmt in ws.FORMATS:
        for m, n, k in ((96, 4096, 4096), (130, 4096, 12288), (256, 4096, 12288), (100, 2048, 4096)):
            c = ws.config(fmt, m, n, k, jnp.bfloat16)
            assert wd.NUM_SMS // 2 < ws.ctas(c, m, n) <= wd.NUM_SMS, (fmt, m, n, k, c)


def test_prefill_ws_clusters_share_token_tiles():
    """Pairs of CTAs along N share each token tile by multicast: NVFP4 on every grid, MXFP8 only
    when the tokens are one tile, block FP8 never, and only where N has an even number of 128-row
    blocks (one H200, RESULTS.md part 37)."""
    from pallas_kernels.mxfp8 import prefill_ws as ws

    for m in (96, 130, 256, 512, 2048):
        assert ws.config("nvfp4", m, 4096, 4096, jnp.bfloat16).cluster == 2
        assert ws.config("fp8_block", m, 12288, 4096, jnp.bfloat16).cluster == 1
        assert ws.config("nvfp4", m, 384, 4096, jnp.bfloat16).cluster == 1          # 3 weight blocks
        c = ws.config("mxfp8", m, 12288, 4096, jnp.bfloat16)
        assert c.cluster == (2 if m <= c.bm else 1), (m, c)


def test_small_grids_choose_the_engine_per_format():
    """MXFP8's warp-specialized form wins on every grid measured, so it takes them all; block FP8's
    loses on grids below about half the SMs, which keep the one-warpgroup engine; with K splits
    (``prefill_ws.config``) its grids reach that size wherever K has the steps for it."""
    from pallas_kernels.mxfp8 import prefill_ws as ws
    from pallas_kernels.mxfp8 import wdequant as wd

    assert wd.fills_gpu("mxfp8", 1024 // 128)
    assert not wd.fills_gpu("fp8_block", 4096 // 128)                  # 32 CTAs
    assert wd.fills_gpu("fp8_block", 24576 // 128)
    c = ws.config("fp8_block", 130, 4096, 4096, jnp.bfloat16)         # 32 CTAs without the split
    assert c.splits == 4 and wd.fills_gpu("fp8_block", ws.ctas(c, 130, 4096))
    assert not wd.fills_gpu("fp8_block", ws.ctas(ws.config("fp8_block", 130, 512, 512, jnp.bfloat16), 130, 512))


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,n,k", [(130, 2048, 4096), (100, 4096, 2048)])
def test_compiled_prefill_split_k(m, n, k, out_dtype):
    """Small prefill grids in the warp-specialized form: 144- and 112-token tiles with K split
    over 4-8 CTAs (``prefill_ws.config``), partials summed in fp32."""
    from pallas_kernels.mxfp8 import prefill_ws
    from pallas_kernels.mxfp8 import wdequant as wd

    c = prefill_ws.config("mxfp8", m, n, k, out_dtype)
    assert c.splits > 1 and wd.fills_gpu("mxfp8", prefill_ws.ctas(c, m, n))
    x, wq, ws = make(m, n, k, seed=14)
    y = matmul(x, wq, ws, backend="pallas", out_dtype=out_dtype)
    assert orc.rel_err(y.astype(jnp.float32), oracle(x, wq, ws)) < (1e-4 if out_dtype == jnp.float32 else 1e-2)
