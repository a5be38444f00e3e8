"""pallas_kernels.fp8_block: W8A16 and W8A8 kernels (Mosaic GPU interpret mode) <-> jnp twins
<-> NumPy oracle (independent e4m3 decoding, tests/quant/quant_oracle.py).

W8A16 numerics: weights ``bf16(f32(e4m3) * scale)``, bf16 activations, fp32 accumulation.
W8A8: activations quantized per token and 128-wide K group; the oracle recomputes
``sum_b (xq_b @ wq_b^T) * sx[:, b] * sw[:, b]`` from the decoded bytes.
"""

import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "quant"))
import quant_oracle as orc  # noqa: E402

from kk_jax.quant import fp8_block as q  # noqa: E402
from pallas_kernels import mma_gemv as mma_kernel  # noqa: E402
from pallas_kernels.fp8_block import (gemv, matmul, matmul_kernel, matmul_reference, mma_gemv,  # noqa: E402
                                      quantize_activations, w8a8_ws)
from pallas_kernels.fp8_block.act_quant import quantize as quantize_activations_padded  # noqa: E402


def make(m, n, k, seed=0):
    """x [m, k]; a block-FP8 weight whose 128x128 blocks differ in scale by up to 2^12."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    nb, kb = math.ceil(n / 128), math.ceil(k / 128)
    mag = np.exp2(rng.integers(-6, 7, (nb, kb))).repeat(128, 0).repeat(128, 1)[:n, :k]
    wq, ws = q.quantize(rng.standard_normal((n, k)) * 0.05 * mag)
    return jnp.asarray(x), wq, ws


def oracle_w8a16(x, wq, ws):
    return orc.matmul(np.asarray(x), orc.bf16_round(orc.dequant_fp8_block(wq, ws)))


def oracle_w8a8(x, wq, ws):
    xq, sx = quantize_activations(x)
    xd, wd = orc.decode_e4m3(xq), orc.decode_e4m3(wq)
    sx, sw = np.asarray(sx, np.float64), np.asarray(ws, np.float64)
    y = np.zeros((x.shape[0], wq.shape[0]))
    for b in range(sx.shape[1]):
        cols = slice(128 * b, 128 * (b + 1))
        part = xd[:, cols] @ wd[:, cols].T
        y += part * sx[:, b:b + 1] * np.repeat(sw[:, b], 128)[None, : wq.shape[0]]
    return y


@pytest.mark.parametrize("act_quant", [False, True])
def test_reference_matches_oracle(act_quant):
    x, wq, ws = make(4, 200, 300)                       # partial 128-blocks on both axes
    oracle = oracle_w8a8 if act_quant else oracle_w8a16
    y = matmul_reference(x, wq, ws, act_quant=act_quant, out_dtype=jnp.float32)
    assert orc.rel_err(y, oracle(x, wq, ws)) < 1e-6


@pytest.mark.parametrize("m,n,k,overrides", [
    (1, 64, 64, {}),                              # M = 1, K smaller than the 128-step
    (5, 1, 40, {}),                               # N = 1; K = 40 padded to the 32-wide step
    (8, 256, 1024, dict(splits=2)),               # decode split-K
    (100, 192, 256, {}),                          # prefill tiling, N not a multiple of 128
])
@pytest.mark.parametrize("act_quant", [False, True])
def test_kernel_matches_oracle(m, n, k, overrides, act_quant):
    x, wq, ws = make(m, n, k, seed=m + n)
    y = matmul_kernel(x, wq, ws, act_quant=act_quant, out_dtype=jnp.float32, interpret=True, **overrides)
    assert y.shape == (m, n)
    oracle = oracle_w8a8 if act_quant else oracle_w8a16
    assert orc.rel_err(y, oracle(x, wq, ws)) < 1e-5


@pytest.mark.parametrize("n,k,sms", [(16, 1024, None), (272, 4096, 1), (144, 1536, None)])
def test_one_row_runs_the_gemv(n, k, sms, gemv_spy):
    """One W8A16 activation row goes to the CUDA-core GEMV, bf16-rounded weights as the twin's
    (fp32 and bf16 written by the kernel). sms = 1: the CTAs of one SM share seventeen 16-row
    items (unevenly) in three 128-row scale blocks, four K tiles of eight column blocks each, so
    the ring is refilled; K = 1536 ends in a partial tile; the blocks' scales span 2^-6 .. 2^6."""
    calls = gemv_spy(gemv, sms, items=n // 16, tiles=-(-k // 1024))
    x, wq, ws = make(1, n, k, seed=n)
    y = matmul_kernel(x, wq, ws, out_dtype=jnp.float32, interpret=True)
    assert calls and y.shape == (1, n)
    assert orc.rel_err(y, oracle_w8a16(x, wq, ws)) < 1e-5
    yb = matmul_kernel(x, wq, ws, out_dtype=jnp.bfloat16, interpret=True)
    assert yb.dtype == jnp.bfloat16 and orc.rel_err(yb, oracle_w8a16(x, wq, ws)) < 4e-3
    yq = matmul_kernel(x, wq, ws, act_quant=True, out_dtype=jnp.float32, interpret=True)
    assert len(calls) == 2 and orc.rel_err(yq, oracle_w8a8(x, wq, ws)) < 1e-5   # W8A8 keeps its kernel
    assert not gemv.supported(2, n, k) and not gemv.supported(1, n, k + 256)
    assert not gemv.supported(1, n, 512)                  # a scale box wider than the scale rows


@pytest.mark.parametrize("m,n,k,sms,plan", [
    (2, 64, 2048, None, (32, 3, 2, 2)),    # two 32-row items of 4 tiles in one 128-row block, each over a cluster of 2
    (16, 64, 2560, None, (32, 2, 2, 2)),   # 5 tiles over clusters of 2: 3 and 2 tiles, two column blocks
    (5, 448, 1536, 2, (64, 2, 1, 2)),      # 7 64-row items (the last half a 128-row block) over 4 CTAs, 6 tiles each
    (8, 448, 2048, 1, (32, 2, 1, 2)),      # 14 32-row items, 7 a CTA: their 4 tiles each refill the ring across items
    (12, 128, 1536, None, (32, 3, 1, 2)),  # two 8-token column blocks, the second partly filled
    (16, 320, 1536, 2, (64, 3, 1, 2)),     # two full column blocks on ring refills
])
def test_mma_gemv_matches_oracle(m, n, k, sms, plan, gemv_spy):
    """The tensor-core GEMV's weights are bf16(f32(w_q) * scale) as the twin's (fp32 and bf16
    out): each tile reads its 4 (32-row items) or 2 (64-row) of a slot's 4 block scales, K splits
    add their sums, the ring refills; the blocks' scales span 2^-6 .. 2^6."""
    rows = plan[0]
    calls = gemv_spy(mma_gemv, sms, items=n // rows, tiles=k // mma_gemv.FORMAT.tile_k(rows), kernel=mma_kernel,
                     stages=plan[3])
    assert mma_kernel._plan(mma_gemv.FORMAT, n, k, m) == plan
    x, wq, ws = make(m, n, k, seed=n + m)
    x = x.astype(jnp.bfloat16)
    y = mma_gemv.gemv(x, wq, ws, out_dtype=jnp.float32, interpret=True)
    assert calls and y.shape == (m, n)
    assert orc.rel_err(y, oracle_w8a16(x, wq, ws)) < 1e-6
    yb = mma_gemv.gemv(x, wq, ws, out_dtype=jnp.bfloat16, interpret=True)
    assert yb.dtype == jnp.bfloat16 and orc.rel_err(yb, oracle_w8a16(x, wq, ws)) < 4e-3


def test_few_rows_run_the_mma_gemv(gemv_spy):
    """2-16 W8A16 rows go to the mma GEMV, 9-16 where K splits at most 2 ways; W8A8 keeps its
    kernel; K a multiple of 512 (a TMA box of 4 block scales), N of 64."""
    assert mma_gemv.supported(2, 4096, 2048) and mma_gemv.supported(8, 6144, 4096)
    assert mma_gemv.supported(8, 576, 4096) and mma_gemv.supported(16, 4096, 4096)
    assert mma_gemv.supported(16, 4096, 12288) and not mma_gemv.supported(16, 12288, 4096 + 256)
    assert mma_gemv.supported(1, 12288, 4096) and not mma_gemv.supported(17, 12288, 4096)
    assert not mma_gemv.supported(16, 1024, 7168) and not mma_gemv.supported(8, 576 + 32, 4096)
    calls = gemv_spy(mma_gemv)
    x, wq, ws = make(4, 128, 1024, seed=4)
    y = matmul_kernel(x, wq, ws, out_dtype=jnp.float32, interpret=True)
    assert len(calls) == 1 and orc.rel_err(y, oracle_w8a16(x, wq, ws)) < 1e-6
    yq = matmul_kernel(x, wq, ws, act_quant=True, out_dtype=jnp.float32, interpret=True)
    assert len(calls) == 1 and orc.rel_err(yq, oracle_w8a8(x, wq, ws)) < 1e-5
    x, wq, ws = make(4, 64, 768, seed=2)                  # K = 768: the engine
    assert orc.rel_err(matmul_kernel(x, wq, ws, out_dtype=jnp.float32, interpret=True), oracle_w8a16(x, wq, ws)) < 1e-5
    assert len(calls) == 1
    with pytest.raises(ValueError, match="fp8_block_mma_gemv serves 1 <= M <= 16 .*K % 512 == 0"):
        mma_gemv.gemv(x.astype(jnp.bfloat16), wq, ws, out_dtype=jnp.float32, interpret=True)


@pytest.mark.parametrize("n,k,sms,mma", [
    (192, 1024, 2, True),   # 6 K tiles on the busiest SM either way, a 64-row item for every SM
    (192, 1024, 4, False),  # 4 against the row GEMV's 3
    (64, 1536, 2, True),    # 3 (a 32-row item of 3 tiles) against 4 (two 16-row items of 1.5 tiles)
    (64, 1536, 4, False),   # 3 against 2
])
def test_one_row_runs_the_gemv_whose_busiest_sm_streams_less(n, k, sms, mma, gemv_spy):
    """One W8A16 row goes to the mma GEMV where its plan leaves the busiest SM fewer K tiles than
    the row GEMV, or as many on a weight with a 64-row item for every SM, else to the row GEMV;
    both give the oracle's result."""
    mma_calls = gemv_spy(mma_gemv, sms)
    row_calls = gemv_spy(gemv)
    x, wq, ws = make(1, n, k, seed=8)
    y = matmul_kernel(x, wq, ws, out_dtype=jnp.float32, interpret=True)
    assert (len(mma_calls), len(row_calls)) == ((1, 0) if mma else (0, 1))
    assert orc.rel_err(y, oracle_w8a16(x, wq, ws)) < 1e-6


def test_activation_quantization_rule():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 200)).astype(np.float32))
    x = x.at[1, 128:].set(0.0)                        # an all-zero group gets scale 1
    xq, sx = quantize_activations(x)
    assert xq.shape == (3, 200) and sx.shape == (3, 2)
    amax = np.abs(np.asarray(x)).reshape(3, -1)
    want = np.stack([amax[:, :128].max(1), np.pad(amax[:, 128:], ((0, 0), (0, 56))).max(1)], 1) / 448.0
    want[1, 1] = 1.0
    np.testing.assert_allclose(np.asarray(sx), want, rtol=1e-7)
    back = orc.decode_e4m3(xq) * np.repeat(np.asarray(sx, np.float64), 128, 1)[:, :200]
    assert np.max(np.abs(back - np.asarray(x))) <= np.max(amax) * 2.0 ** -4


def test_bad_operands_are_named():
    x, wq, ws = make(2, 64, 256)
    with pytest.raises(ValueError, match=r"w_scale_inv has shape \[1, 1\], expected \[1, 2\]"):
        matmul(x, wq, ws[:, :1], backend="xla")
    with pytest.raises(ValueError, match="w_scale_inv must be float32"):
        matmul(x, wq, ws.astype(jnp.bfloat16), backend="pallas", interpret=True)
    with pytest.raises(ValueError, match="support 128x128 weight blocks"):
        matmul(x, wq, jnp.ones((1, 4), jnp.float32), block=(64, 64), backend="pallas")
    for block in ((0, 128), (128,), (128.0, 128)):
        with pytest.raises(ValueError, match="block must be two positive ints"):
            matmul(x, wq, ws, block=block, backend="xla")


@pytest.mark.parametrize("m", [1, 2048])
@pytest.mark.parametrize("act_quant", [False, True])
def test_lowers_for_hopper(m, act_quant):
    n, k = 256, 4096
    f = lambda x, w, s: matmul(x, w, s, act_quant=act_quant)
    jax.jit(f).trace(jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
                     jax.ShapeDtypeStruct((n // 128, k // 128), jnp.float32)).lower(lowering_platforms=("cuda",))


@pytest.mark.gpu
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (1, 2048, 7168), (1, 12288, 4096), (300, 512, 1024), (1100, 384, 640),
                                   (1100, 2560, 640), (2, 12288, 4096), (8, 7168, 2048), (9, 24576, 4096),
                                   (16, 10240, 4096), (5, 4096, 4096), (12, 4096, 12288), (8, 6144, 2560),
                                   (1, 576, 4096), (8, 576, 4096), (8, 3072, 1536)])
def test_compiled_kernel_matches_oracle(m, n, k, act_quant):
    """W8A16: one row on the GEMV (on 12288 and 576 rows the mma GEMV); on the mma GEMV 2-16 rows
    (32- and 64-row items, K splits, two column blocks; 576 rows: GLM-5.3's MLA kv_a), 12 rows of
    4096 on the engine; the prefill forms. W8A8: its kernels."""
    x, wq, ws = make(m, n, k, seed=5)
    y = matmul(x, wq, ws, act_quant=act_quant, backend="pallas", out_dtype=jnp.float32)
    oracle = oracle_w8a8 if act_quant else oracle_w8a16
    assert orc.rel_err(y, oracle(x, wq, ws)) < (2e-3 if act_quant else 1e-4)   # fp8 MMA accumulates in reduced precision


@pytest.mark.gpu
def test_compiled_prefill_bf16_output():
    """The warp-specialized prefill form with a bf16 output tile (deeper pipeline than fp32); 2560
    weight rows x 1100 tokens are a grid of 100 CTAs, enough for that form (``wdequant.fills_gpu``)."""
    x, wq, ws = make(1100, 2560, 640, seed=6)
    y = matmul(x, wq, ws, backend="pallas", out_dtype=jnp.bfloat16)
    assert orc.rel_err(y.astype(jnp.float32), oracle_w8a16(x, wq, ws)) < 1e-2


def test_padded_activation_quantization_rejects_a_short_padding():
    x = jnp.ones((100, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 64 and at least M=100"):
        quantize_activations_padded(x, mp=96)
    with pytest.raises(ValueError, match="multiple of 64"):
        quantize_activations_padded(x, mp=130)
    with pytest.raises(ValueError, match="bfloat16 or float32, got float16"):
        quantize_activations_padded(x.astype(jnp.float16), mp=128)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("m,k,mp", [(100, 300, 128), (130, 640, 256), (2048, 4096, 2048)])
def test_compiled_activation_quantization_is_the_jnp_one(m, k, mp, dtype):
    """The one-pass kernel that feeds the warp-specialized W8A8 form gives the jnp quantization
    bit for bit (an all-zero group, values over six decades, K and M needing padding), xq = 0
    and sx = 1 on the padded tokens and zeros in the padded columns."""
    x = jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.float32)
    x = (x * jnp.exp(jax.random.uniform(jax.random.PRNGKey(k), (m, 1), minval=-7, maxval=7))).astype(dtype)
    x = x.at[1, :128].set(0)
    xq, sxt = quantize_activations_padded(x, mp=mp)
    rq, rs = quantize_activations(x)
    kb = rs.shape[1]
    assert xq.shape == (mp, kb * 128) and sxt.shape == (kb, mp)
    f32 = lambda a: np.asarray(a.astype(jnp.float32))
    np.testing.assert_array_equal(f32(xq[:m, :k]), f32(rq))
    np.testing.assert_array_equal(np.asarray(sxt[:, :m]), np.asarray(rs.T))
    assert not f32(xq[m:]).any() and not f32(xq[:, k:]).any()
    np.testing.assert_array_equal(np.asarray(sxt[:, m:]), 1.0)


def test_w8a8_tiles_follow_the_measured_waves():
    """192-token tiles (3 math warpgroups) where their grid's waves take less time, 128-token ones
    where padding or a short last wave costs more (one H200, kernel alone, RESULTS.md part 40:
    2 faster at 100-1000 tokens on 4096 and 12288 rows, 3 at 2048); the ring holds 4 steps
    except with three fp32 output tiles."""
    picks = {(m, n): w8a8_ws.warpgroups(m, n) for m in (100, 256, 1000, 2048, 8192) for n in (4096, 12288)}
    assert picks == {(100, 4096): 2, (256, 4096): 2, (1000, 4096): 2, (2048, 4096): 3, (8192, 4096): 3,
                     (100, 12288): 2, (256, 12288): 2, (1000, 12288): 2, (2048, 12288): 3, (8192, 12288): 3}
    assert [w8a8_ws.stages(w, d) for w in (2, 3) for d in (jnp.bfloat16, jnp.float32)] == [4, 4, 4, 3]


@pytest.mark.gpu
@pytest.mark.parametrize("wgs", [2, 3])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,n,k", [(300, 320, 640), (300, 320, 600), (2200, 512, 256)])
def test_compiled_w8a8_prefill_forms_agree_bitwise(out_dtype, m, n, k, wgs, monkeypatch):
    """The warp-specialized W8A8 prefill form (default for M > 64), with 2 or 3 math warpgroups,
    and the one-warpgroup kernel (a plan override selects it) compute the same products in the
    same promotion order; N = 320, M = 300 and K = 600 exercise the padding to 128-row blocks,
    token tiles and 128-wide K groups (3 weight blocks: no cluster), whose stores past [M, N]
    are dropped; 2200 x 512: 2-CTA clusters and a shorter last launch group of token tiles
    (``prefill_ws.tile_of``)."""
    monkeypatch.setattr(w8a8_ws, "warpgroups", lambda m_, n_: wgs)
    x, wq, ws = make(m, n, k, seed=7)
    y_ws = matmul(x, wq, ws, act_quant=True, backend="pallas", out_dtype=out_dtype)
    y_one = matmul_kernel(x, wq, ws, act_quant=True, out_dtype=out_dtype, stages=2)
    np.testing.assert_array_equal(np.asarray(y_ws, np.float32), np.asarray(y_one, np.float32))
    assert orc.rel_err(y_ws.astype(jnp.float32), oracle_w8a8(x, wq, ws)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,n,k", [(130, 2048, 4096), (100, 4096, 2048)])
def test_compiled_prefill_split_k(m, n, k, out_dtype):
    """Small prefill grids in the warp-specialized form: 144- and 112-token tiles with K split
    over 4-8 CTAs (``prefill_ws.config``), partials summed in fp32."""
    from pallas_kernels.mxfp8 import prefill_ws
    from pallas_kernels.mxfp8 import wdequant as wd

    c = prefill_ws.config("fp8_block", m, n, k, out_dtype)
    assert c.splits > 1 and wd.fills_gpu("fp8_block", prefill_ws.ctas(c, m, n))
    x, wq, ws = make(m, n, k, seed=14)
    y = matmul(x, wq, ws, backend="pallas", out_dtype=out_dtype)
    assert orc.rel_err(y.astype(jnp.float32), oracle_w8a16(x, wq, ws)) < (1e-4 if out_dtype == jnp.float32 else 1e-2)
