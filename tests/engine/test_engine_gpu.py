"""On an NVIDIA GPU: the Pallas backend (tokamax prefill + our paged-decode kernel) gives the
same greedy tokens as the jnp backend. Skipped without a GPU.

Both kernels compute in bf16 precision (fp32 accumulation), so the comparison is made on a
bf16 model, over the first tokens (a late near-tie may flip under different rounding)."""

import pytest

from kk_jax import LLM, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=[128, 256], ids=["hidden128", "hidden256"])
def ckpt64(tmp_path_factory, request):
    from checkpoints.make_tiny import make_tiny

    # head_dim 64: the smallest the Mosaic GPU attention kernels take; hidden 256: every decode
    # matmul runs the one-row GEMV, with the RMSNorms and residual adds fused into it
    hidden = request.param
    return make_tiny(tmp_path_factory.mktemp(f"tiny-hd64-{hidden}"), arch="qwen3", seed=4, dtype="float32",
                     hidden_size=hidden, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=2 * hidden)


def test_pallas_backend_matches_xla_backend(ckpt64):
    prompts = [[1, 2, 3, 4, 5], list(range(10, 90)), [7], list(range(200, 330))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = {}
    for backend in ("pallas", "xla"):
        llm = LLM(ckpt64, dtype="bfloat16", kernel_backend=backend, max_model_len=256, max_num_seqs=4,
                  max_num_batched_tokens=128, page_size=64, progress=False)
        assert llm.engine.runner.backend == backend
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert [t[:8] for t in outs["pallas"]] == [t[:8] for t in outs["xla"]]


@pytest.mark.parametrize("algo", ["fp8_block", "mxfp8", "nvfp4"])
def test_quantized_pallas_backend_matches_xla_backend(tmp_path_factory, algo):
    """Quantized linears on the GPU kernels (prefill chunks of 65-256 rows take the
    warp-specialized forms, whose last token tile runs past the rows; decode the GEMVs) give
    the greedy tokens of their jnp twins.

    Not W8A8 (``fp8_activations``): its fp8 ``wgmma`` accumulates in reduced precision (about
    3e-4 of the output's scale against the exact twin, which the kernel test bounds), and every
    layer re-quantizes its activations to 3-bit mantissas, so on a random model the difference
    grows to other greedy tokens within the first few."""
    from checkpoints.make_tiny import make_tiny
    from checkpoints.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp(f"q-{algo}")
    src = make_tiny(root / "bf16", arch="qwen3", seed=4, dtype="float32", hidden_size=256, num_heads=4,
                    num_kv_heads=2, head_dim=64, intermediate_size=512)
    ckpt = quantize_checkpoint(src, root / algo, algo)
    prompts = [list(range(10, 90)), list(range(200, 330)), [7]]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outs = {}
    for backend in ("pallas", "xla"):
        llm = LLM(ckpt, dtype="bfloat16", kernel_backend=backend, max_model_len=256, max_num_seqs=4,
                  max_num_batched_tokens=256, page_size=64, progress=False)
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert [t[:8] for t in outs["pallas"]] == [t[:8] for t in outs["xla"]]


def test_tiny_default_size_runs_the_jnp_kernels(tiny_ckpt):
    """head_dim 16 (the tiny checkpoints): auto on a GPU picks the jnp kernels and generates."""
    llm = LLM(tiny_ckpt, dtype="bfloat16", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=128,
              progress=False)
    assert llm.engine.runner.backend == "xla"
    out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
