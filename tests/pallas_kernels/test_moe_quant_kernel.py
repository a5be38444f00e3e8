"""pallas_kernels.moe_quant: routing -> tiles, and the grouped quantized-expert matmul
(Mosaic GPU interpret mode and the jnp twin) against an independent NumPy oracle that
dequantizes each routed expert with tests/quant/quant_oracle.py and multiplies per token-slot."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "quant"))
import quant_oracle as orc  # noqa: E402

from kk_jax.quant import fp8_block, mxfp8, nvfp4  # noqa: E402
from pallas_kernels.moe_quant import gather_rows, grouped_matmul, route_tiles  # noqa: E402
from pallas_kernels.moe_quant import tiles as tiles_mod  # noqa: E402


def experts(fmt, e, n, k, seed=0):
    """(stacked operands in the kernel's layout, NumPy dequantized [E, N, K] float64). nvfp4 and mxfp8 weights are exact
    in bf16; block FP8's are rounded to bf16 once, as the W8A16 kernels do."""
    rng = np.random.default_rng(seed)
    ops, dense = [], []
    for _ in range(e):
        w = rng.standard_normal((n, k)) * np.exp2(rng.integers(-3, 4, (n, 1)))
        if fmt == "nvfp4":
            q = nvfp4.quantize(w)
            dense.append(orc.dequant_nvfp4(*q))
        elif fmt == "mxfp8":
            q = mxfp8.quantize(w)
            dense.append(orc.dequant_mxfp8(*q))
        else:
            q = fp8_block.quantize(w)
            dense.append(orc.bf16_round(orc.dequant_fp8_block(*q)))       # the kernel's bf16 weight (W8A16)
        ops.append(q)
    stacked = [jnp.stack([jnp.asarray(o[i]) for o in ops]) for i in range(len(ops[0]))]
    if fmt != "fp8_block":                      # per-block scales transposed: [E, K/b, N]
        stacked[1] = jnp.swapaxes(stacked[1], 1, 2)
    return tuple(stacked), np.stack(dense)


def oracle(x, idx, dense):
    """[N·k, N_out]: token n's slot j times expert idx[n, j]."""
    tok = np.repeat(np.arange(idx.shape[0]), idx.shape[1])
    return np.stack([orc.matmul(x[t:t + 1], dense[e])[0] for t, e in zip(tok, idx.reshape(-1))])


@pytest.mark.parametrize("pairwise_max", [2048, 0])          # ranks by comparison / by sort
def test_route_tiles_cover_every_slot_once(monkeypatch, pairwise_max):
    monkeypatch.setattr(tiles_mod, "PAIRWISE_MAX", pairwise_max)
    idx = jnp.asarray([[3, 1], [1, 0], [1, 3], [2, 1]], jnp.int32)
    t = route_tiles(idx, num_experts=5, bm=2)
    te, sor, rop = map(np.asarray, t)
    assert te.shape == (4 + 5,) and sor.shape == (18,)          # ceil(8/2) + min(5, 8)
    flat = np.asarray(idx).reshape(-1)
    # every slot sits in exactly one row, of a tile of its own expert
    assert sorted(sor[sor >= 0].tolist()) == list(range(8))
    for p, r in enumerate(rop):
        assert sor[r] == p and te[r // 2] == flat[p]
    # expert 1 has 4 slots -> 2 tiles; 0, 2, 3 one each; unused tiles are -1 at the end
    assert te.tolist() == [0, 1, 1, 2, 3, -1, -1, -1, -1]
    # slots of one expert keep routing order: expert 1's slots 1, 2, 4, 7 fill its two tiles
    assert sor[2:6].tolist() == [1, 2, 4, 7]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "fp8_block"])
@pytest.mark.parametrize("backend", ["pallas", "xla"])
def test_grouped_matmul_matches_oracle(fmt, backend):
    e, n, k, tokens, top = 6, 128, 256, 5, 3
    ops, dense = experts(fmt, e, n, k, seed=len(fmt))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    idx = np.stack([rng.choice(e, top, replace=False) for _ in range(tokens)]).astype(np.int32)
    tiles = route_tiles(jnp.asarray(idx), e, bm=8)
    rows = gather_rows(jnp.asarray(x), tiles, top)
    y = grouped_matmul(rows, tiles.tile_expert, fmt, *ops, backend=backend, out_dtype=jnp.float32,
                       interpret=True)
    got = np.asarray(y)[np.asarray(tiles.row_of_pair)]
    assert orc.rel_err(got, oracle(x, idx, dense)) < 1e-5


def test_expert_offset_selects_a_layer_of_stacked_experts():
    """Weights of two layers stacked [2·E, ...]: offset E uses the second layer's experts."""
    e, n, k = 3, 64, 128
    ops, dense = experts("nvfp4", 2 * e, n, k, seed=3)
    idx = np.asarray([[0, 2], [1, 0]], np.int32)
    x = np.random.default_rng(2).standard_normal((2, k)).astype(np.float32)
    tiles = route_tiles(jnp.asarray(idx), e, bm=8)
    y = grouped_matmul(gather_rows(jnp.asarray(x), tiles, 2), tiles.tile_expert, "nvfp4", *ops,
                       expert_offset=jnp.int32(e), out_dtype=jnp.float32, interpret=True)
    got = np.asarray(y)[np.asarray(tiles.row_of_pair)]
    assert orc.rel_err(got, oracle(x, idx + e, dense)) < 1e-5


def test_split_k_and_wide_tiles():
    """K split over CTAs (partials summed) and 16-row tiles with an expert spanning two tiles."""
    e, n, k = 2, 64, 512
    ops, dense = experts("mxfp8", e, n, k, seed=5)
    idx = np.asarray([[0]] * 20 + [[1]], np.int32)
    x = np.random.default_rng(4).standard_normal((21, k)).astype(np.float32)
    tiles = route_tiles(jnp.asarray(idx), e, bm=16)
    y = grouped_matmul(gather_rows(jnp.asarray(x), tiles, 1), tiles.tile_expert, "mxfp8", *ops,
                       out_dtype=jnp.float32, interpret=True)
    got = np.asarray(y)[np.asarray(tiles.row_of_pair)]
    assert orc.rel_err(got, oracle(x, idx, dense)) < 1e-5
    from pallas_kernels.moe_quant import grouped_matmul_kernel
    y2 = grouped_matmul_kernel(gather_rows(jnp.asarray(x), tiles, 1), tiles.tile_expert, "mxfp8", *ops,
                               out_dtype=jnp.float32, interpret=True, tk=128, splits=2)
    assert orc.rel_err(np.asarray(y2)[np.asarray(tiles.row_of_pair)], oracle(x, idx, dense)) < 1e-5


def test_bad_operands_are_named():
    ops, _ = experts("nvfp4", 2, 64, 64)
    te = jnp.zeros((1,), jnp.int32)
    x = jnp.zeros((8, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="unknown expert format"):
        grouped_matmul(x, te, "int4", *ops, backend="xla")
    with pytest.raises(ValueError, match="do not stack the 2 experts"):
        grouped_matmul(x, te, "nvfp4", ops[0], ops[1][:1], ops[2], backend="xla")
    with pytest.raises(ValueError, match="w_scale has shape"):
        grouped_matmul(x, te, "nvfp4", ops[0], ops[1][:, :2], ops[2], backend="pallas")


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_both_backends_apply_the_same_rules(backend):
    """Shapes the kernel cannot tile are refused by the jnp twin too; T = 0 tiles give an empty
    result; a tile whose expert (after the offset) is outside the stacked experts is skipped
    like a -1 tile, and the other tiles are unaffected; integer activations are refused."""
    run = dict(backend=backend, interpret=True, out_dtype=jnp.float32)
    ops, dense = experts("nvfp4", 2, 64, 256)
    te = jnp.zeros((1,), jnp.int32)
    bad = {"K % 128 == 0": (jnp.zeros((8, 192)), te, experts("nvfp4", 2, 64, 192)[0]),
           "N % 64 == 0": (jnp.zeros((8, 256)), te, experts("nvfp4", 2, 96, 256)[0]),
           "row tiles of 12 rows": (jnp.zeros((12, 256)), te, ops),
           r"weight_scale_2 must be \[E=2\]": (jnp.zeros((8, 256)), te, (*ops[:2], ops[2][:, None])),
           "tile_expert must be an int32 \[T\]": (jnp.zeros((8, 256)), te[:, None], ops)}
    for msg, (x, t, o) in bad.items():
        with pytest.raises(ValueError, match=msg):
            grouped_matmul(x, t, "nvfp4", *o, **run)
    with pytest.raises(ValueError, match="x must be a floating-point array"):
        grouped_matmul(jnp.zeros((8, 256), jnp.int32), te, "nvfp4", *ops, **run)
    assert grouped_matmul(jnp.zeros((0, 256)), te[:0], "nvfp4", *ops, **run).shape == (0, 64)
    x = np.random.default_rng(1).standard_normal((16, 256)).astype(np.float32)
    for tiles, offset in (([1, 5], 0), ([1, 0], -1)):      # past the last expert; below the first
        y = np.asarray(grouped_matmul(jnp.asarray(x), jnp.asarray(tiles, jnp.int32), "nvfp4", *ops,
                                      expert_offset=jnp.int32(offset), **run))
        assert orc.rel_err(y[:8], orc.matmul(x[:8], dense[1 + offset])) < 1e-5
        if backend == "xla":                                 # the kernel leaves skipped rows unspecified
            np.testing.assert_array_equal(y[8:], 0.0)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("rows", [9 * 8, 352 * 8])
def test_lowers_for_hopper(rows, fmt):
    e, n, k = 288, 2048, 4096
    S = jax.ShapeDtypeStruct
    ops = ((S((e, n, k // 2), jnp.uint8), S((e, k // 16, n), jnp.float8_e4m3fn), S((e,), jnp.float32))
           if fmt == "nvfp4" else (S((e, n, k), jnp.float8_e4m3fn), S((e, k // 32, n), jnp.uint8)))
    f = lambda x, te, *o: grouped_matmul(x, te, fmt, *o)
    jax.jit(f).trace(S((rows, k), jnp.bfloat16), S((rows // 8,), jnp.int32), *ops).lower(lowering_platforms=("cuda",))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "fp8_block"])
def test_compiled_kernel_matches_oracle(fmt):
    e, n, k, tokens, top = 16, 256, 1024, 12, 4
    ops, dense = experts(fmt, e, n, k, seed=9)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    idx = np.stack([rng.choice(e, top, replace=False) for _ in range(tokens)]).astype(np.int32)
    tiles = route_tiles(jnp.asarray(idx), e, bm=8)
    y = grouped_matmul(gather_rows(jnp.asarray(x), tiles, top), tiles.tile_expert, fmt, *ops, out_dtype=jnp.float32)
    got = np.asarray(y)[np.asarray(tiles.row_of_pair)]
    assert orc.rel_err(got, oracle(x, idx, dense)) < 1e-4


@pytest.mark.parametrize("fmt,k", [("nvfp4", 2048), ("nvfp4", 2304), ("mxfp8", 1280), ("fp8_block", 1536)])
def test_routed_gemv_matches_oracle(fmt, k):
    """One GEMV per token-slot against its expert (layer offset included); K past a whole tile
    (nvfp4 2304, mxfp8 1280, fp8_block 1536) reads zeros there."""
    from pallas_kernels.moe_quant import routed_gemv
    e, n, tokens, top = 4, 32, 3, 2
    ops, dense = experts(fmt, 2 * e, n, k, seed=11)
    rng = np.random.default_rng(12)
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    idx = np.stack([rng.choice(e, top, replace=False) for _ in range(tokens)]).astype(np.int32)
    slots = jnp.asarray(np.repeat(x, top, axis=0), jnp.bfloat16)
    y = routed_gemv(slots, jnp.asarray(idx.reshape(-1)), fmt, *ops, expert_offset=jnp.int32(e),
                    out_dtype=jnp.float32, interpret=True)
    assert y.shape == (tokens * top, n)
    assert orc.rel_err(np.asarray(y), oracle(x, idx + e, dense)) < 1e-5


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "fp8_block"])
def test_routed_gemv_lowers_for_hopper(fmt):
    from pallas_kernels.moe_quant import routed_gemv
    e, n, k, slots = 288, 2048, 4096, 64
    S = jax.ShapeDtypeStruct
    codes = S((e, n, k // 2), jnp.uint8) if fmt == "nvfp4" else S((e, n, k), jnp.float8_e4m3fn)
    scales = {"nvfp4": (S((e, k // 16, n), jnp.float8_e4m3fn), S((e,), jnp.float32)),
              "mxfp8": (S((e, k // 32, n), jnp.uint8),), "fp8_block": (S((e, n // 128, k // 128), jnp.float32),)}[fmt]
    f = lambda x, ex, *o: routed_gemv(x, ex, fmt, *o, out_dtype=jnp.float32)
    jax.jit(f).trace(S((slots, k), jnp.bfloat16), S((slots,), jnp.int32), codes, *scales).lower(
        lowering_platforms=("cuda",))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "fp8_block"])
def test_compiled_routed_gemv_matches_oracle(fmt):
    from pallas_kernels.moe_quant import routed_gemv
    e, n, k, tokens, top = 16, 256, 2304 if fmt == "nvfp4" else 1536, 5, 4
    ops, dense = experts(fmt, e, n, k, seed=13)
    rng = np.random.default_rng(13)
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    idx = np.stack([rng.choice(e, top, replace=False) for _ in range(tokens)]).astype(np.int32)
    y = routed_gemv(jnp.asarray(np.repeat(x, top, axis=0), jnp.bfloat16), jnp.asarray(idx.reshape(-1)), fmt, *ops,
                    out_dtype=jnp.float32)
    assert orc.rel_err(np.asarray(y), oracle(x, idx, dense)) < 1e-4


def test_routed_gemv_bad_operands_are_named():
    from pallas_kernels.moe_quant import routed_gemv
    ops, _ = experts("mxfp8", 2, 32, 1024)
    x = jnp.zeros((4, 1024), jnp.bfloat16)
    with pytest.raises(ValueError, match="x \\(4, 1024\\), experts \\(2,\\)"):
        routed_gemv(x, jnp.zeros((2,), jnp.int32), "mxfp8", *ops, interpret=True)
    small, _ = experts("nvfp4", 2, 32, 256)
    with pytest.raises(ValueError, match="nvfp4 experts of \\[32, 256\\] do not fit the row GEMV"):
        routed_gemv(jnp.zeros((2, 256), jnp.bfloat16), jnp.zeros((2,), jnp.int32), "nvfp4", *small)
