"""kk_jax: a JAX/Pallas serving engine for hybrid frontier LLMs on NVIDIA GPUs."""

from kk_jax.engine.request import RequestOutput, SamplingParams
from kk_jax.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
