"""pallas_kernels.nvfp4: kernel (Mosaic GPU interpret mode) <-> jnp twin <-> NumPy oracle
(independent E2M1 / e4m3 decoding with ModelOpt's low-nibble-first order,
tests/quant/quant_oracle.py)."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "quant"))
import quant_oracle as orc  # noqa: E402

from kk_jax.quant import nvfp4 as q  # noqa: E402
from pallas_kernels import mma_gemv as mma_kernel, row_gemv  # noqa: E402
from pallas_kernels.nvfp4 import gemv, matmul, matmul_kernel, matmul_reference, mma_gemv, operands  # noqa: E402


def make(m, n, k, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)) * np.exp2(rng.integers(-4, 5, (n, k // 16))).repeat(16, 1)
    wq, ws, s2 = q.quantize(w)
    return jnp.asarray(x), wq, ws.T, s2              # the kernels take the scales transposed [K/16, N]


def oracle(x, wq, ws, s2):
    return orc.matmul(np.asarray(x), orc.dequant_nvfp4(wq, orc.as_bytes(ws).T, s2))


def test_reference_matches_oracle():
    x, *w = make(3, 70, 48)
    assert orc.rel_err(matmul_reference(x, *w, out_dtype=jnp.float32), oracle(x, *w)) < 1e-6


@pytest.mark.parametrize("m,n,k,overrides", [
    (1, 64, 64, {}),                           # M = 1; K padded to the 128-code step
    (5, 1, 48, {}),                            # N = 1; K = 48 padded likewise
    (8, 128, 512, dict(tk=128, splits=2)),    # decode split-K
    (24, 128, 1024, {}),                       # 17-64 rows: the engine's 256-code step
    (72, 64, 256, {}),                         # prefill tiling
])
def test_kernel_matches_oracle(m, n, k, overrides):
    x, *w = make(m, n, k, seed=m + n)
    y = matmul_kernel(x, *w, out_dtype=jnp.float32, interpret=True, **overrides)
    assert y.shape == (m, n)
    assert orc.rel_err(y, oracle(x, *w)) < 1e-5


@pytest.mark.parametrize("tk", [128, 256])
def test_engine_operand_order(tk):
    """x's columns in the engine's order: column 32 q + 8 t + 2 c + p of a step is code
    32 (c I + q // 4) + 8 (q % 4) + t + 4 p (I = tk / 128), the code the A fragment puts there."""
    want = np.empty(tk, np.int64)
    for q_ in range(tk // 32):
        for t in range(4):
            for c in range(4):
                for p in range(2):
                    want[32 * q_ + 8 * t + 2 * c + p] = 32 * (c * (tk // 128) + q_ // 4) + 8 * (q_ % 4) + t + 4 * p
    assert sorted(want) == list(range(tk))
    x = np.arange(3 * 2 * tk).reshape(3, 2 * tk)
    got = np.asarray(operands.order_x(jnp.asarray(x), tk))
    np.testing.assert_array_equal(got, x[:, np.concatenate([want, tk + want])])
    with pytest.raises(ValueError, match="K step is one of"):
        operands.order_x(jnp.asarray(x), 64)


@pytest.mark.parametrize("n,k,sms", [(16, 2048, None), (80, 8192, 1), (32, 2560, None)])
def test_one_row_runs_the_gemv(n, k, sms, gemv_spy):
    """One activation row (here with two leading axes) goes to the CUDA-core GEMV. sms = 1: the
    CTAs of one SM share five 16-row items (unevenly) of four K tiles each, so the ring is
    refilled; K = 2560 ends in a partial tile; the checkpoint's codes cover every E2M1 value and
    sign."""
    calls = gemv_spy(gemv, sms, items=n // 16, tiles=-(-k // 2048))
    x, *w = make(1, n, k, seed=n)
    y = matmul_kernel(x[None], *w, out_dtype=jnp.float32, interpret=True)
    assert calls and y.shape == (1, 1, n)
    assert orc.rel_err(y[0], oracle(x, *w)) < 1e-5
    yb = matmul_kernel(x, *w, out_dtype=jnp.bfloat16, interpret=True)   # written by the kernel
    assert yb.dtype == jnp.bfloat16 and orc.rel_err(yb, oracle(x, *w)) < 4e-3


def test_gemv_serves_one_row_of_whole_boxes():
    assert gemv.supported(1, 4096, 4096) and gemv.supported(1, 16, 16384)
    assert gemv.supported(1, 4096, 4608) and gemv.supported(1, 4096, 512)
    assert not gemv.supported(2, 4096, 4096) and not gemv.supported(1, 4100, 4096)
    assert not gemv.supported(1, 4096, 4352 + 64) and not gemv.supported(1, 4096, 256)
    assert not gemv.supported(1, 4096, 16384 + 256)
    x, *w = make(1, 64, 256)
    with pytest.raises(ValueError, match="nvfp4_gemv serves M = 1"):
        gemv.gemv(x, *w, out_dtype=jnp.float32, interpret=True)


@pytest.mark.parametrize("m,n,k,sms,plan", [
    (2, 64, 4096, None, (32, 2, 4, 2)), # two 32-row items of 4 K tiles, each over a cluster of 4
    (5, 128, 16384, None, (32, 2, 8, 2)),  # 4 items of 16 tiles: clusters of 8, 2 tiles each
    (2, 64, 5120, None, (32, 2, 4, 2)),  # 5 tiles over clusters of 4: 2, 1, 1 and 1 tiles
    (4, 64, 1024, None, (32, 3, 1, 2)), # one tile an item: too little K to split
    (3, 128, 6144, 4, (32, 3, 1, 4)),   # 4 items of 6 tiles, 4 SMs: 1 or 2 splits load an SM alike; 3 tiles a CTA
                                         # are too few to split, so one CTA an SM with a 4-slot ring that refills
    (8, 448, 4096, 1, (32, 2, 1, 2)),      # 14 items, 7 a CTA: their 4 tiles each refill the ring across items
    (8, 448, 4096, 2, (64, 2, 1, 2)),      # 7 64-row items over 4 CTAs (unevenly): 14 32-row ones load alike, 2 a CTA more
    (16, 64, 4096, None, (32, 2, 2, 2)),   # two 8-token column blocks
    (11, 448, 4096, 2, (64, 2, 1, 2)),     # the second block partly filled, on ring refills
    (4, 128, 1536, None, (64, 3, 1, 2)),   # K not a multiple of a 32-row tile's 1024 codes: 64-row items
])
def test_few_rows_run_the_mma_gemv(m, n, k, sms, plan, gemv_spy):
    """2-16 activation rows go to the tensor-core GEMV; both item shapes, K splits (the
    interpreter adds the members' sums in XLA, the GPU in the kernel) and the ring's refills give
    the oracle's result."""
    rows = plan[0]
    calls = gemv_spy(mma_gemv, sms, items=n // rows, tiles=k // mma_gemv.FORMAT.tile_k(rows), kernel=mma_kernel,
                     stages=plan[3])
    assert mma_kernel._plan(mma_gemv.FORMAT, n, k, m) == plan
    x, *w = make(m, n, k, seed=n + m)
    y = matmul_kernel(x, *w, out_dtype=jnp.float32, interpret=True)
    assert calls and y.shape == (m, n)
    assert orc.rel_err(y, oracle(x, *w)) < 1e-5
    yb = matmul_kernel(x, *w, out_dtype=jnp.bfloat16, interpret=True)
    assert yb.dtype == jnp.bfloat16 and orc.rel_err(yb, oracle(x, *w)) < 4e-3


def test_mma_gemv_serves_one_to_sixteen_rows():
    assert mma_gemv.supported(1, 4096, 4096) and mma_gemv.supported(16, 64, 512)
    assert not mma_gemv.supported(17, 4096, 4096)
    assert not mma_gemv.supported(4, 4096 + 16, 4096) and not mma_gemv.supported(4, 4096, 4096 + 256)
    x, *w = make(17, 64, 512)
    with pytest.raises(ValueError, match="nvfp4_mma_gemv serves 1 <= M <= 16"):
        mma_gemv.gemv(x, *w, out_dtype=jnp.float32, interpret=True)


@pytest.mark.parametrize("n,k,sms,mma", [
    (192, 2048, 2, True),   # 6 K tiles on the busiest SM either way, a 64-row item for every SM
    (192, 2048, 4, False),  # 3 either way, too few 64-row items
    (64, 7168, 2, True),    # 7 (two 32-row items of 7 tiles) against the row GEMV's 8 (3.5 an item)
    (64, 7168, 4, False),   # 7 against 4
])
def test_one_row_runs_the_gemv_whose_busiest_sm_streams_less(n, k, sms, mma, gemv_spy):
    """One row goes to the mma GEMV where its plan leaves the busiest SM fewer K tiles than the
    row GEMV, or as many on a weight with a 64-row item for every SM, else to the row GEMV; both
    give the oracle's result."""
    mma_calls = gemv_spy(mma_gemv, sms)
    row_calls = gemv_spy(gemv)
    x, *w = make(1, n, k, seed=9)
    y = matmul_kernel(x, *w, out_dtype=jnp.float32, interpret=True)
    assert (len(mma_calls), len(row_calls)) == ((1, 0) if mma else (0, 1))
    assert orc.rel_err(y, oracle(x, *w)) < 1e-5


@pytest.mark.parametrize("sms,tiles", [
    (1, 24),    # 4 items of 3.5 tiles on 3 CTAs: 2 on the busiest, a partial tile counted whole
    (2, 8),     # 4 CTAs of one item, 2 on each SM
    (4, 4),     # one CTA of one item an SM
])
def test_row_gemv_counts_the_busiest_sms_tiles(sms, tiles, monkeypatch):
    monkeypatch.setattr(row_gemv, "num_sms", lambda: sms)
    assert row_gemv.busiest_tiles(gemv.FORMAT, 64, 7168) == tiles


def test_bad_operands_are_named():
    x, wq, ws, s2 = make(2, 64, 128)
    with pytest.raises(ValueError, match=r"w_scale has shape \[7, 64\], expected \[8, 64\] \(transposed\)"):
        matmul(x, wq, ws[:7], s2, backend="xla")
    with pytest.raises(ValueError, match="w_q must be uint8"):
        matmul(x, wq.astype(jnp.int8), ws, s2, backend="pallas", interpret=True)
    with pytest.raises(ValueError, match="w_scale_2 must hold one value"):
        matmul(x, wq, ws, jnp.ones((2,)), backend="xla")
    with pytest.raises(ValueError, match="w_scale_2 must be float32"):
        matmul(x, wq, ws, s2.astype(jnp.bfloat16), backend="pallas", interpret=True)


@pytest.mark.parametrize("m,k", [(1, 4096), (8, 4096), (2048, 4096), (1, 768), (1, 1280)])
def test_lowers_for_hopper(m, k):
    """One row with K = 768 / 1280 stages 5 / 3 rows of x zeros past K in the GEMV's last tile."""
    n = 256
    f = lambda x, w, s, s2: matmul(x, w, s, s2)
    jax.jit(f).trace(jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((n, k // 2), jnp.uint8),
                     jax.ShapeDtypeStruct((k // 16, n), jnp.float8_e4m3fn),
                     jax.ShapeDtypeStruct((), jnp.float32)).lower(lowering_platforms=("cuda",))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (1, 4096, 12288), (1, 256, 1024), (1, 4096, 7168),
                                   (300, 512, 1024), (2, 4096, 4096), (8, 4096, 12288), (5, 2048, 4096),
                                   (3, 12288, 4096), (1, 12288, 4096), (4, 256, 16384),
                                   (16, 4096, 4096), (12, 12288, 4096), (9, 4096, 12288),
                                   (64, 2048, 4096), (40, 512, 384), (24, 4096, 12288), (130, 256, 640),
                                   (8, 1024, 7168), (2, 2048, 5120)])
def test_compiled_kernel_matches_oracle(m, n, k):
    """M = 1 runs the GEMV (K = 1024: a partial last tile; on 12288 rows the mma GEMV); M = 2-16
    the mma GEMV (K split over clusters of 2, 4 and 8 CTAs; 9-16 on two column blocks); 17-64 rows the
    engine's decode tiles (K = 384, 640: 128-code steps, 64-byte swizzle), 130 its prefill tiles."""
    x, *w = make(m, n, k, seed=7)
    assert orc.rel_err(matmul(x, *w, backend="pallas", out_dtype=jnp.float32), oracle(x, *w)) < 1e-4


@pytest.mark.parametrize("interpret", [pytest.param(False, marks=pytest.mark.gpu), True])
def test_gemv_member_scales_and_swiglu(interpret):
    """Per-member global scales (`segments`) and the SwiGLU epilogue (gate scale, then up scale)
    against the plain GEMV of each member with its own scale."""
    from pallas_kernels import row_gemv

    x, wq, ws, _ = make(1, 512, 2048, seed=3)
    x = x.astype(jnp.bfloat16)
    s2 = jnp.asarray([0.5, 3.0], jnp.float32)
    run = lambda *a, **kw: gemv.gemv(*a, out_dtype=jnp.bfloat16, interpret=interpret, **kw)
    parts = [run(x, wq[r], ws[:, r], s2[i]) for i, r in enumerate((slice(0, 384), slice(384, 512)))]
    got = run(x, wq, ws, s2, segments=(384, 128))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.concatenate(parts, axis=1)))
    halves = [run(x, wq[r], ws[:, r], s2[i]) for i, r in enumerate((slice(0, 256), slice(256, 512)))]
    for bad in (dict(segments=(384, 120)), dict(segments=(256, 128, 128))):    # not 16-row members; 3 != 2 scales
        with pytest.raises(ValueError, match="segments"):
            run(x, wq, ws, s2, **bad)
    glu = run(x, wq, ws, s2, glu=True)
    same = np.asarray(glu) == np.asarray(row_gemv.silu_times(*halves))
    assert same.all() if interpret else same.mean() > 0.99          # ex2.approx on the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,n,k", [(130, 2048, 4096), (100, 4096, 2048)])
def test_compiled_prefill_split_k(m, n, k, out_dtype):
    """Small prefill grids in the warp-specialized form: 144- and 112-token tiles with K split
    over 4-8 CTAs (``prefill_ws.config``), partials summed in fp32."""
    from pallas_kernels.mxfp8 import prefill_ws
    from pallas_kernels.mxfp8 import wdequant as wd

    c = prefill_ws.config("nvfp4", m, n, k, out_dtype)
    assert c.splits > 1 and wd.fills_gpu("nvfp4", prefill_ws.ctas(c, m, n))
    x, *w = make(m, n, k, seed=14)
    y = matmul(x, *w, backend="pallas", out_dtype=out_dtype)
    assert orc.rel_err(y.astype(jnp.float32), oracle(x, *w)) < (1e-4 if out_dtype == jnp.float32 else 1e-2)
