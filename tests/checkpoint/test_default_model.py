"""The embedded default model: a tiny GLM-5.3 written once into the cache directory, with small
batch limits unless the caller sets them; real checkpoints keep the serving defaults."""

import json

from kk_jax.checkpoint import default
from kk_jax.config import EngineConfig


def test_default_model_is_a_tiny_glm5_written_once(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = default.default_model_dir()
    assert path == tmp_path / "kk_jax" / "tiny-glm5"
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Glm5NextForConditionalGeneration"]
    assert "chat_template" in json.loads((path / "tokenizer_config.json").read_text())
    stamp = (path / "config.json").stat().st_mtime_ns
    assert default.default_model_dir() == path and (path / "config.json").stat().st_mtime_ns == stamp


def test_batch_limits_depend_on_whether_the_model_is_the_demo():
    assert default.batch_limits(None, None, None) == default.DEMO_LIMITS
    serving = {"max_num_seqs": EngineConfig.max_num_seqs, "max_num_batched_tokens": EngineConfig.max_num_batched_tokens}
    assert default.batch_limits("/ckpt", None, None) == serving == {"max_num_seqs": 64, "max_num_batched_tokens": 512}
    assert default.batch_limits(None, 3, 40) == {"max_num_seqs": 3, "max_num_batched_tokens": 40}
