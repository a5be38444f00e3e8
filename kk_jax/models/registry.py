"""Architecture name (``config.json`` ``architectures[0]``) -> model class."""

from kk_jax.config import ConfigError
from kk_jax.models.glm5_next import Glm5NextForConditionalGeneration
from kk_jax.models.qwen3 import Qwen3ForCausalLM

MODELS = {"Qwen3ForCausalLM": Qwen3ForCausalLM,
          "Glm5NextForConditionalGeneration": Glm5NextForConditionalGeneration}


def model_class(architecture: str):
    if architecture not in MODELS:
        raise ConfigError(f"unknown architecture {architecture!r}; supported: {', '.join(sorted(MODELS))}")
    return MODELS[architecture]
