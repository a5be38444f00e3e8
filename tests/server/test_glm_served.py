"""A tiny GLM-5.3 served end to end: its own chat template, the openai client, streaming."""

import pytest
from conftest import LiveServer, wait_pages_free
from openai import OpenAI


@pytest.fixture(scope="module")
def glm_server(tmp_path_factory):
    from checkpoints.make_tiny import make_tiny

    ckpt = make_tiny(tmp_path_factory.mktemp("glm-served"), arch="glm5_next", seed=5, num_layers=4,
                     first_dense_layers=1)
    srv = LiveServer(["--model", str(ckpt), "--served-model-name", "glm", "--max-model-len", "96",
                      "--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--decode-steps", "4",
                      "--log-level", "warning"])
    yield srv
    srv.stop()


def test_glm_chat_streaming_and_not(glm_server):
    client = OpenAI(base_url=glm_server.url + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
    r = client.chat.completions.create(model="glm", messages=msgs, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    tok = glm_server.engine.engine.tokenizer
    prompt = tok.apply_chat_template(msgs)
    assert prompt.startswith("[gMASK]<sop>") and "<|assistant|>" in prompt     # GLM's template, not ChatML
    assert r.usage.prompt_tokens == len(tok.encode(prompt))
    chunks = list(client.chat.completions.create(model="glm", messages=msgs, max_tokens=12, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert wait_pages_free(glm_server.engine)


def test_served_glm_scans_its_repeating_layers_unless_told_not_to(glm_server):
    from kk_jax.server.cli import parser

    assert glm_server.engine.engine.runner.layout["layers.1.state"].stack == 2     # layers 1-2: one scanned body
    assert parser().parse_args([]).scan_layers and not parser().parse_args(["--no-scan-layers"]).scan_layers


def test_flags_reach_the_engine_config():
    from kk_jax.server.cli import engine_config, parser

    assert engine_config(parser().parse_args([])).sampler_programs == "auto"
    cfg = engine_config(parser().parse_args(["--sampler-programs", "off", "--decode-steps", "4", "--no-scan-layers"]))
    assert (cfg.sampler_programs, cfg.decode_steps, cfg.scan_layers) == ("off", 4, False)
