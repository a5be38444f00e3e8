"""The hot Mosaic GPU kernels are lowered once per distinct call, not once per call site: a
model's N layers call the same kernel N times, and lowering each call separately cost 0.15-0.2 s
apiece (36-layer Qwen3 decode step: 34.6 s of lowering instead of 2.5 s, benchmarks/RESULTS.md
part 9). Lowered for the GPU on CPU; the count of Mosaic GPU custom calls in the module is the
number of kernels lowered."""

import jax
import jax.numpy as jnp

from pallas_kernels.dense_matmul.kernel import matmul_kernel as dense_matmul
from pallas_kernels.mxfp8 import matmul_kernel as mxfp8_matmul
from pallas_kernels.paged_attention import paged_decode_attention_kernel

S = jax.ShapeDtypeStruct


def mosaic_kernels(f, *args) -> int:
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text().count("custom_call @mosaic_gpu")


def test_three_equal_matmul_calls_lower_one_kernel():
    x, w = S((1, 512), jnp.bfloat16), S((256, 512), jnp.bfloat16)
    assert mosaic_kernels(lambda x, a, b, c: dense_matmul(x, a) + dense_matmul(x, b) + dense_matmul(x, c),
                          x, w, w, w) == 1
    w8, s8 = S((256, 512), jnp.float8_e4m3fn), S((512 // 32, 256), jnp.uint8)
    for xq in (x, S((4, 512), jnp.bfloat16)):          # the one-row GEMV, the mma GEMV
        assert mosaic_kernels(lambda x, a, sa, b, sb: mxfp8_matmul(x, a, sa) + mxfp8_matmul(x, b, sb),
                              xq, w8, s8, w8, s8) == 1
    # a different shape is a different kernel
    assert mosaic_kernels(lambda x, a, b: dense_matmul(x, a).sum() + dense_matmul(x, b).sum(),
                          x, w, S((512, 512), jnp.bfloat16)) == 2


def test_equal_attention_calls_lower_one_kernel():
    q = S((2, 4, 64), jnp.bfloat16)
    pages = S((5, 64, 2, 64), jnp.bfloat16)
    table, lens = S((2, 2), jnp.int32), S((2,), jnp.int32)

    def two_layers(q, k0, v0, k1, v1, table, lens):
        return (paged_decode_attention_kernel(q, k0, v0, table, lens)
                + paged_decode_attention_kernel(q, k1, v1, table, lens))

    assert mosaic_kernels(two_layers, q, pages, pages, pages, pages, table, lens) == 1
