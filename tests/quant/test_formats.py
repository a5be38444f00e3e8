"""kk_jax.quant formats: hand-computed bytes, round-trip error bounds, exact layouts.

The expected bytes below were worked out by hand from the e4m3 / E8M0 / E2M1 bit layouts
and the scale rules documented in each module (ModelOpt's for MXFP8 and NVFP4).
"""

import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant_oracle as orc  # noqa: E402

from kk_jax.quant import fp8_block, mxfp8, nvfp4  # noqa: E402


def u8(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


# ------------------------------------------------------------------ block FP8
def test_fp8_block_known_bytes():
    # one partial 128x128 block: amax 896 -> scale_inv 896 / 448 = 2, values w / 2
    w = np.array([[896, -1, 3.5, 0], [1.0, 0.3, -896, 2]], np.float32)
    q, s = fp8_block.quantize(w)
    assert q.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(s), [[2.0]])
    # 448 = 1.75*2^8 -> 0 1111 110; -0.5 -> 1 0110 000; 1.75 -> 0 0111 110; 0.5 -> 0 0110 000;
    # 0.15 -> nearest 1.25*2^-3 -> 0 0100 010; -448 -> 1 1111 110; 1 -> 0 0111 000
    np.testing.assert_array_equal(u8(q), [[0x7E, 0xB0, 0x3E, 0x00], [0x30, 0x22, 0xFE, 0x38]])


def test_fp8_block_partial_blocks_and_zero_block():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((130, 200)).astype(np.float32)
    w[128:, 128:] = 0.0                                    # the bottom-right partial block is all zero
    w[:128, 128:] *= 1000.0                                 # a block with its own large scale
    q, s = fp8_block.quantize(w)
    assert q.shape == (130, 200) and s.shape == (2, 2)
    assert np.asarray(s)[1, 1] == 1.0 and not u8(q)[128:, 128:].any()
    np.testing.assert_allclose(np.asarray(s)[0, 1], np.abs(w[:128, 128:]).max() / 448.0, rtol=1e-7)
    back = orc.dequant_fp8_block(q, s)
    scale = np.repeat(np.repeat(np.asarray(s, np.float64), 128, 0), 128, 1)[:130, :200]
    assert np.all(np.abs(back - w) <= np.abs(w) * 2.0 ** -4 + scale * 2.0 ** -10)
    np.testing.assert_array_equal(np.asarray(fp8_block.dequantize(q, s)), back.astype(np.float32))


def test_fp8_block_ue8m0_scales_are_powers_of_two():
    w = np.random.default_rng(1).standard_normal((256, 256)).astype(np.float32) * 3.0
    q, s = fp8_block.quantize(w, scale_fmt="ue8m0")
    s = np.asarray(s, np.float64)
    assert np.all(np.log2(s) == np.round(np.log2(s)))
    amax = np.abs(w).reshape(2, 128, 2, 128).max(axis=(1, 3))
    assert np.all(s >= amax / 448.0) and np.all(s < 2 * amax / 448.0)


def test_fp8_block_check_names_the_problem():
    q, s = fp8_block.quantize(np.ones((256, 128), np.float32))
    with pytest.raises(ValueError, match=r"weight_scale_inv has shape \[1, 1\].*needs \[2, 1\]"):
        fp8_block.dequantize(q, s[:1])


# ------------------------------------------------------------------ MXFP8
def test_mxfp8_known_bytes():
    w = np.zeros((1, 96), np.float32)
    w[0, :3] = [3.0, 0.01, -0.5]           # amax 3: ceil(log2(3/448)) = -7 -> E8M0 120, values * 2^7
    w[0, 64] = 448.0                       # amax 448: exponent 0 -> E8M0 127
    w[0, 65] = -(2.0 ** -9)                # e4m3's smallest subnormal
    q, s = mxfp8.quantize(w)               # block 1 (32..63) is all zero -> exponent -127 -> 0
    np.testing.assert_array_equal(np.asarray(s), [[120, 0, 127]])
    want = np.zeros(96, np.uint8)
    # 384 = 1.5*2^8 -> 0 1111 100; 1.28 -> 1.25 -> 0 0111 010; -64 -> 1 1101 000
    want[:3] = [0x7C, 0x3A, 0xE8]
    want[64:66] = [0x7E, 0x81]             # 448 -> 0 1111 110; -2^-9 -> 1 0000 001
    np.testing.assert_array_equal(u8(q)[0], want)
    np.testing.assert_array_equal(np.asarray(mxfp8.dequantize(q, s))[0, :3], [3.0, 1.25 / 128, -0.5])


def test_mxfp8_round_trip_bound_and_layout():
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((64, 256)) * np.exp2(rng.integers(-20, 20, (64, 8))).repeat(32, 1)).astype(np.float32)
    q, s = mxfp8.quantize(w)
    assert q.shape == (64, 256) and s.shape == (64, 8) and s.dtype == jnp.uint8
    back = orc.dequant_mxfp8(q, s)
    scale = np.repeat(orc.decode_e8m0(s), 32, 1)
    assert np.all(np.abs(back) <= 448 * scale)
    assert np.all(np.abs(back - w) <= np.abs(w) * 2.0 ** -4 + scale * 2.0 ** -10)
    np.testing.assert_array_equal(np.asarray(mxfp8.dequantize(q, s)), back.astype(np.float32))


def test_mxfp8_scale_rule_rounds_the_exponent_up():
    amax = np.array([448.0, 449.0, 224.0, 1.0, 0.0], np.float32)
    # 448 -> 2^0; 449 -> 2^1 (448 * 2^0 < 449); 224 -> 2^-1; 1 -> ceil(log2(1/448)) = -8; 0 -> -127
    np.testing.assert_array_equal(np.asarray(mxfp8.e8m0_exponent(amax)), [0, 1, -1, -8, -127])


def test_mxfp8_rejects_k_not_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32, got 48"):
        mxfp8.quantize(np.ones((2, 48), np.float32))
    q, s = mxfp8.quantize(np.ones((2, 64), np.float32))
    with pytest.raises(ValueError, match=r"weight_scale has shape \[2, 1\].*needs \[2, 2\]"):
        mxfp8.dequantize(q, s[:, :1])
    assert np.isnan(np.asarray(mxfp8.dequantize(q, jnp.full((2, 2), 255, jnp.uint8)))).all()


# ------------------------------------------------------------------ NVFP4
def test_nvfp4_known_bytes():
    a = [0.25, 0.75, 2.5, 3.5, 5.0, -6.0, 1.6, 0.0, 0.1, -0.3, 1.25, 1.75, -0.0, 4.5, 3.0, -1.0]
    b = [2688.0, -1344.0] + [0.0] * 14
    w = np.array([a + b], np.float32)      # global amax 2688 = 6 * 448 -> weight_scale_2 = 1
    q, s, s2 = nvfp4.quantize(w)
    assert float(s2) == 1.0 and q.dtype == jnp.uint8 and q.shape == (1, 16)
    np.testing.assert_array_equal(u8(s), [[0x38, 0x7E]])          # block scales 1.0 and 448
    # block a codes (ModelOpt thresholds, ties 0.75/1.75/3.5 up, i.e. to the even code):
    # 0 2 4 6 6 15 3 0 0 9 2 4 0 6 5 10
    # block b: 2688/448 = 6 -> 7, -1344/448 = -3 -> 13; two codes per byte, element 2i low
    np.testing.assert_array_equal(u8(q)[0], [0x20, 0x64, 0xF6, 0x03, 0x90, 0x42, 0x60, 0xA5,
                                             0xD7, 0, 0, 0, 0, 0, 0, 0])
    back = np.asarray(nvfp4.dequantize(q, s, s2))[0]
    np.testing.assert_array_equal(back[:8], [0.0, 1.0, 2.0, 4.0, 4.0, -6.0, 1.5, 0.0])
    np.testing.assert_array_equal(back[16:18], [2688.0, -1344.0])


def test_nvfp4_ties_round_to_the_even_code():
    """A value halfway between two E2M1 values takes the even code (ModelOpt's rule), and
    values just off the midpoint take the nearer one."""
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    for sign in (1.0, -1.0):
        codes = np.asarray(nvfp4.e2m1_codes(sign * mids))
        np.testing.assert_array_equal(codes & 7, [0, 2, 2, 4, 4, 6, 6])
        np.testing.assert_array_equal(np.asarray(nvfp4.e2m1_codes(sign * (mids - 1e-3))) & 7,
                                      [0, 1, 2, 3, 4, 5, 6])
        np.testing.assert_array_equal(np.asarray(nvfp4.e2m1_codes(sign * (mids + 1e-3))) & 7,
                                      [1, 2, 3, 4, 5, 6, 7])


def test_nvfp4_tiny_tensor_keeps_a_normal_global_scale():
    """amax far below fp32's normal range: the global scale stays normal (a subnormal one is
    flushed to 0 on some devices, and 0 * inf dequantizes to NaN); values come back finite."""
    w = np.full((1, 32), 1e-36, np.float32)
    q, s, s2 = nvfp4.quantize(w)
    assert float(s2) == np.finfo(np.float32).tiny
    back = np.asarray(nvfp4.dequantize(q, s, s2))
    assert np.isfinite(back).all() and np.allclose(back, 1e-36, rtol=0.25)


def test_nvfp4_pack_unpack_every_byte():
    every = np.arange(256, dtype=np.uint8).reshape(1, 256)
    codes = np.asarray(nvfp4.unpack(every))
    np.testing.assert_array_equal(codes[0, 0::2], every[0] & 0xF)
    np.testing.assert_array_equal(codes[0, 1::2], every[0] >> 4)
    np.testing.assert_array_equal(np.asarray(nvfp4.pack(codes)), every)
    np.testing.assert_array_equal(np.asarray(nvfp4.e2m1_values(np.arange(16))), orc.decode_e2m1(np.arange(16)))


def test_nvfp4_round_trip_bound():
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((32, 128)) * np.exp2(rng.integers(-6, 6, (32, 8))).repeat(16, 1)).astype(np.float32)
    w[0, :16] = 0.0                                        # zero block: scale 1.0
    w[1, :16] = 1e-9                                       # tiny block: scale clamped to e4m3's 2^-9
    q, s, s2 = nvfp4.quantize(w)
    assert q.shape == (32, 64) and s.shape == (32, 8) and s2.shape == ()
    np.testing.assert_allclose(float(s2), np.abs(w).max() / 2688.0, rtol=1e-7)
    assert orc.decode_e4m3(s)[0, 0] == 1.0 and orc.decode_e4m3(s)[1, 0] == 2.0 ** -9
    back = orc.dequant_nvfp4(q, s, s2)
    s_eff = np.repeat(orc.decode_e4m3(s) * float(s2), 16, 1)
    assert np.all(np.abs(back - w) <= 0.25 * np.abs(w) + 0.25 * s_eff + 1e-30)
    assert np.linalg.norm(back - w) / np.linalg.norm(w) < 0.12
    np.testing.assert_allclose(np.asarray(nvfp4.dequantize(q, s, s2)), back, rtol=1e-6)


def test_nvfp4_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 16, got 24"):
        nvfp4.quantize(np.ones((2, 24), np.float32))
    q, s, s2 = nvfp4.quantize(np.ones((2, 32), np.float32))
    with pytest.raises(ValueError, match=r"weight_scale has shape \[2, 1\].*needs \[2, 2\]"):
        nvfp4.dequantize(q, s[:, :1], s2)
