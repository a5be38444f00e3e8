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
from pallas_kernels.fp8_block import gemv, matmul, matmul_kernel, matmul_reference, quantize_activations  # noqa: E402


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


@pytest.mark.parametrize("m", [1, 2048])
@pytest.mark.parametrize("act_quant", [False, True])
def test_lowers_for_hopper(m, act_quant):
    n, k = 256, 4096
    f = lambda x, w, s: matmul(x, w, s, act_quant=act_quant)
    jax.jit(f).trace(jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
                     jax.ShapeDtypeStruct((n // 128, k // 128), jnp.float32)).lower(lowering_platforms=("cuda",))


@pytest.mark.gpu
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (1, 2048, 7168), (300, 512, 1024), (1100, 384, 640), (1100, 2560, 640)])
def test_compiled_kernel_matches_oracle(m, n, k, act_quant):
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


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("k", [640, 600])
def test_compiled_w8a8_prefill_forms_agree_bitwise(out_dtype, k):
    """The warp-specialized W8A8 prefill form (default for M > 64) and the one-warpgroup kernel (a
    plan override selects it) compute the same products in the same promotion order; N = 320,
    M = 300 and K = 600 exercise the padding to 128-row blocks, 128-token tiles and 128-wide K
    groups."""
    x, wq, ws = make(300, 320, k, seed=7)
    y_ws = matmul(x, wq, ws, act_quant=True, backend="pallas", out_dtype=out_dtype)
    y_one = matmul_kernel(x, wq, ws, act_quant=True, out_dtype=out_dtype, stages=2)
    np.testing.assert_array_equal(np.asarray(y_ws, np.float32), np.asarray(y_one, np.float32))
    assert orc.rel_err(y_ws.astype(jnp.float32), oracle_w8a8(x, wq, ws)) < 1e-2
