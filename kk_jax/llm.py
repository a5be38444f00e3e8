"""``LLM``: the offline / notebook API over the serving engine (vLLM's ``LLM`` habits)."""

from __future__ import annotations

import contextlib
import itertools
from pathlib import Path
from typing import Iterable, Sequence

import jax

from kk_jax.checkpoint.default import batch_limits, default_model_dir
from kk_jax.config import EngineConfig
from kk_jax.engine.core import LLMEngine
from kk_jax.engine.request import RequestOutput, SamplingParams


class LLM:
    """Loads a checkpoint (default: the embedded tiny GLM-5.3, see kk_jax.checkpoint.default) and generates.

    >>> llm = LLM()
    >>> llm.generate("Hello", SamplingParams(max_tokens=8, temperature=0))[0].text
    """

    def __init__(self, model: str | Path | None = None, *, tp: int = 1, dtype: str = "auto",
                 max_model_len: int = 2048, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None,
                 num_pages: int | None = None, gpu_memory_utilization: float = 0.9, kv_cache_dtype: str = "auto",
                 page_size: int = 16, decode_steps: int = 8, kernel_backend: str = "auto",
                 kda_backend: str = "auto", dense_decode_backend: str = "auto", sampler_programs: str = "auto",
                 seed: int = 0,
                 scan_layers: bool = True,
                 load_mtp: bool = False, fp8_activations: bool = False, profile_dir: str | Path | None = None,
                 progress: bool = True):
        limits = batch_limits(model, max_num_seqs, max_num_batched_tokens)
        config = EngineConfig(max_model_len=max_model_len, **limits, page_size=page_size, num_pages=num_pages, gpu_memory_utilization=gpu_memory_utilization,
                              kv_cache_dtype=kv_cache_dtype, tp=tp, decode_steps=decode_steps,
                              kernel_backend=kernel_backend, kda_backend=kda_backend,
                              dense_decode_backend=dense_decode_backend, sampler_programs=sampler_programs,
                              seed=seed, scan_layers=scan_layers,
                              load_mtp=load_mtp,
                              fp8_activations=fp8_activations)
        self.engine = LLMEngine(model or default_model_dir(), dtype=dtype, config=config, progress=progress)
        self.tokenizer = self.engine.tokenizer
        self.profile_dir = Path(profile_dir) if profile_dir else None
        self._ids = itertools.count()

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generates for one prompt or a list of prompts (text or token ids); outputs in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        final: dict[str, RequestOutput] = {}
        try:
            for rid, prompt, p in zip(ids, prompts, plist):
                self.engine.add_request(rid, list(prompt) if not isinstance(prompt, str) else prompt, p)
            mine = set(ids)
            while len(final) < len(ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in mine:
                        final[out.request_id] = out
        except BaseException:                 # an error or an interrupt (Ctrl-C): nothing of this call stays queued
            for rid in ids:
                if rid not in final:
                    self.engine.abort(rid)
            raise
        return [final[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             add_generation_prompt: bool = True, **template_kwargs) -> list[RequestOutput]:
        """Applies the checkpoint's chat template to one conversation or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt,
                                                      **template_kwargs) for c in convs]
        return self.generate(prompts, params)

    @contextlib.contextmanager
    def profile(self, profile_dir: str | Path | None = None) -> Iterable[Path]:
        """Writes a ``jax.profiler`` trace of everything run inside the block (layer names are
        ``jax.named_scope``s: ``layer_{i}``, ``lm_head``)."""
        out = Path(profile_dir or self.profile_dir or "profiles")
        out.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(out))
        try:
            yield out
        finally:
            jax.profiler.stop_trace()
