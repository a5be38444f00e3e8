"""pallas_kernels.dense_matmul: kernel (Mosaic GPU interpret mode) <-> jnp twin <-> NumPy.

Shapes cover M = 1, N = 1 (padded to the 64-row tile), K not a multiple of the K step, the
split-K decode path and a full 64-row token tile; the kernel is also lowered for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import row_gemv
from pallas_kernels.dense_matmul import MAX_ROWS, gemv, matmul, matmul_kernel, matmul_reference


def make(m, n, k, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, k)), jnp.bfloat16)
    return x, w


def oracle(x, w):
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64).T


def rel_err(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("m,n,k,overrides", [
    (1, 64, 64, {}),                           # M = 1, one K step
    (3, 1, 96, {}),                            # N = 1 row; K = 96 padded to the 64-column step
    (8, 128, 512, dict(tk=128, splits=2)),    # split-K partials summed by the wrapper
    (64, 192, 256, {}),                        # a full 64-token tile, three row blocks
])
def test_kernel_matches_oracle(m, n, k, overrides):
    x, w = make(m, n, k, seed=m + n)
    y = matmul_kernel(x, w, out_dtype=jnp.float32, interpret=True, **overrides)
    assert y.shape == (m, n)
    assert rel_err(y, oracle(x, w)) < 1e-5
    assert rel_err(y, np.asarray(matmul_reference(x, w, out_dtype=jnp.float32), np.float64)) < 1e-5


@pytest.mark.parametrize("n,k,sms", [(16, 512, None), (80, 1280, 1)])
def test_one_row_runs_the_gemv(n, k, sms, gemv_spy):
    """One row goes to the CUDA-core GEMV (fp32 and bf16 written by the kernel). sms = 1: the
    CTAs of one SM share five 16-row items (unevenly) of three K tiles each, the last partial,
    so the ring is refilled."""
    calls = gemv_spy(gemv, sms, items=n // 16, tiles=-(-k // 512))
    x, w = make(1, n, k, seed=n)
    y = matmul_kernel(x, w, out_dtype=jnp.float32, interpret=True)
    assert calls and y.shape == (1, n) and rel_err(y, oracle(x, w)) < 1e-5
    yb = matmul_kernel(x, w, interpret=True)
    assert yb.dtype == jnp.bfloat16 and rel_err(yb, oracle(x, w)) < 4e-3
    assert not gemv.supported(2, n, k) and not gemv.supported(1, n, k + 64)


def test_leading_dims_and_dtype():
    x, w = make(6, 64, 128, seed=3)
    y = matmul(x.reshape(2, 3, 128), w, backend="pallas", interpret=True)
    assert y.shape == (2, 3, 64) and y.dtype == jnp.bfloat16
    assert rel_err(y.reshape(6, 64), oracle(x, w)) < 1e-2


def test_decode_rows_are_not_padded_in_hbm():
    """Up to 8 rows the kernel reads x as it is (TMA zero-fills the rest of the token tile): no
    pad op runs before it. More rows are padded to the token tile, and the engine rejects an
    unpadded row count that TMA's 8-row tiling cannot take."""
    from pallas_kernels.mxfp8 import wdequant as wd

    def pads(m):                                 # pad ops in the program lowered for the GPU
        x, w = make(m, 128, 256)
        lowered = jax.jit(lambda x, w: matmul_kernel(x, w)).trace(x, w).lower(lowering_platforms=("cuda",))
        return lowered.as_text().count("stablehlo.pad")

    assert pads(1) == 0 and pads(5) == 0
    assert pads(12) == 1
    x, w = make(12, 128, 256)
    with pytest.raises(ValueError, match="not padded"):
        wd.wdequant_matmul(x, w, (), fmt="bf16", p=wd.plan(12, 128, 256, "bf16"), out_dtype=jnp.float32,
                           interpret=True)


def test_bad_input():
    x, w = make(2, 64, 128)
    with pytest.raises(ValueError, match="bfloat16"):
        matmul(x, w.astype(jnp.float32), backend="xla")
    with pytest.raises(ValueError, match="features"):
        matmul(x[:, :64], w, backend="pallas", interpret=True)
    with pytest.raises(ValueError, match="at most"):
        matmul(jnp.zeros((MAX_ROWS + 1, 128), jnp.bfloat16), w, backend="pallas", interpret=True)
    with pytest.raises(ValueError, match="backend"):
        matmul(x, w, backend="triton")


@pytest.mark.parametrize("m", [1, 16, 64])
def test_lowers_for_hopper(m):
    """Mosaic GPU lowering (layout inference included) for the decode tilings."""
    n, k = 4096, 4096
    jax.jit(lambda x, w: matmul(x, w)).trace(jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                                             jax.ShapeDtypeStruct((n, k), jnp.bfloat16)).lower(lowering_platforms=("cuda",))


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 12288, 4096), (1, 4096, 12288), (16, 4096, 12288), (64, 6144, 4096),
                                   (5, 1, 96)])
def test_compiled_kernel_matches_oracle(m, n, k):
    x, w = make(m, n, k, seed=11)
    assert rel_err(matmul(x, w, backend="pallas", out_dtype=jnp.float32), oracle(x, w)) < 1e-4


def fused_reference(x, w, g, res, eps):
    """RMSNorm of x (the models' math), the bf16 product, the bf16 residual add."""
    xf = x.astype(jnp.float32)
    xn = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps) * g.astype(jnp.float32)).astype(jnp.bfloat16)
    y = jnp.einsum("mk,nk->mn", xn, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    return y if res is None else res + y


@pytest.mark.parametrize("k,with_res", [(1280, True), (1024, False)])
def test_gemv_fuses_rms_norm_and_residual(k, with_res):
    """The GEMV normalises x in every CTA (partial last tile at K = 1280) and adds the residual
    after rounding, as the separate XLA ops do."""
    rng = np.random.default_rng(k)
    x, w = make(1, 512, k, seed=k)
    g = jnp.asarray(1 + rng.standard_normal(k) / 10, jnp.bfloat16)
    res = jnp.asarray(rng.standard_normal((1, 512)), jnp.bfloat16) if with_res else None
    y = gemv.gemv(x * 3, w, out_dtype=jnp.bfloat16, norm_weight=g, eps=1e-6, residual=res, interpret=True)
    assert rel_err(y, np.asarray(fused_reference(x * 3, w, g, res, 1e-6), np.float64)) < 4e-3
    with pytest.raises(ValueError, match="fuses RMSNorm"):
        gemv.gemv(x, w, out_dtype=jnp.float32, residual=jnp.zeros((1, 512), jnp.bfloat16), interpret=True)


def swiglu_reference(x, w, g, eps):
    """silu(gate) * up of the separate ops' gate and up halves (bf16), in fp32, rounded once."""
    y = fused_reference(x, w, g, None, eps).astype(jnp.float32)
    gate, up = y[:, :y.shape[1] // 2], y[:, y.shape[1] // 2:]
    return np.asarray((gate * jax.nn.sigmoid(gate) * up).astype(jnp.bfloat16), np.float64)


@pytest.mark.parametrize("n,k,sms,interpret", [
    (512, 1024, None, True), (224, 1280, 1, True),
    pytest.param(24576, 4096, None, False, marks=pytest.mark.gpu),
    pytest.param(1024, 1024, None, False, marks=pytest.mark.gpu)])
def test_gemv_fuses_swiglu(n, k, sms, interpret, monkeypatch):
    """[gate; up] rows in, silu(gate) * up out: a CTA takes a gate item, then its up item. With
    one SM (3 CTAs) the 7 pairs spread unevenly, so CTAs carry a gate across several pairs; K =
    1280 ends in a partial tile. The output is the epilogue applied to the unfused GEMV's own
    gate and up (compiled: up to ex2.approx's rare last-bit flips), and close to the separate ops."""
    if sms:
        monkeypatch.setattr(row_gemv, "num_sms", lambda: sms)
    rng = np.random.default_rng(n + k)
    x, w = make(1, n, k, seed=n + k)
    g = jnp.asarray(1 + rng.standard_normal(k) / 10, jnp.bfloat16)
    run = lambda w, **kw: gemv.gemv(x, w, out_dtype=jnp.bfloat16, norm_weight=g, eps=1e-6, interpret=interpret, **kw)
    y, plain = run(w, glu=True), run(w)
    assert y.shape == (1, n // 2) and y.dtype == jnp.bfloat16
    same = np.asarray(y) == np.asarray(row_gemv.silu_times(plain[:, :n // 2], plain[:, n // 2:]))
    assert same.all() if interpret else same.mean() > 0.99
    assert rel_err(y, swiglu_reference(x, w, g, 1e-6)) < 4e-3
    with pytest.raises(ValueError, match="SwiGLU"):
        run(w[:n - 16], glu=True)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 12288)])
def test_compiled_gemv_fusions(n, k):
    rng = np.random.default_rng(n + k)
    x, w = make(1, n, k, seed=n + k)
    g = jnp.asarray(1 + rng.standard_normal(k) / 10, jnp.bfloat16)
    res = jnp.asarray(rng.standard_normal((1, n)), jnp.bfloat16)
    want = np.asarray(fused_reference(x * 3, w, g, res, 1e-6), np.float64)
    if k <= 8192:
        y = gemv.gemv(x * 3, w, out_dtype=jnp.bfloat16, norm_weight=g, eps=1e-6, residual=res)
        assert rel_err(y, want) < 4e-3
    y = gemv.gemv(x, w, out_dtype=jnp.bfloat16, residual=res)
    assert rel_err(y, np.asarray(res + jnp.einsum("mk,nk->mn", x, w, preferred_element_type=jnp.float32)
                                 .astype(jnp.bfloat16), np.float64)) < 4e-3
