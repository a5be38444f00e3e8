"""LLM.profile writes a jax.profiler trace whose ops carry the layer scopes."""


from kk_jax import LLM, SamplingParams


def test_profile_writes_trace_with_layer_names(tiny_ckpt, tmp_path):
    llm = LLM(tiny_ckpt, dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
              profile_dir=tmp_path, progress=False)
    with llm.profile() as out:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
    planes = list(out.rglob("*.xplane.pb"))
    assert planes, list(out.rglob("*"))
    data = planes[0].read_bytes()
    assert b"layer_0" in data and b"lm_head" in data
