"""Typed model configs parsed from a Hugging Face ``config.json`` (one class per architecture).

The field names follow the public checkpoints (reference/qwen3-checkpoint.md). Parsing is
strict where a silent default would produce wrong numerics (unknown ``rope_type``, heads that
do not divide) and lenient about keys that do not affect inference.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp


class ConfigError(ValueError):
    """A checkpoint's config.json cannot be served as written."""


_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}


def resolve_dtype(name: str, config_dtype: str) -> Any:
    """Maps ``--dtype auto|bfloat16|float32`` to a jnp dtype; auto = the config's torch dtype."""
    name = config_dtype if name == "auto" else name
    if name not in _DTYPES:
        raise ConfigError(f"unsupported dtype {name!r}: use auto, bfloat16, float16 or float32")
    return _DTYPES[name]


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """``Qwen3ForCausalLM`` hyper-parameters (model_type ``qwen3``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    torch_dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = ()

    architecture = "Qwen3ForCausalLM"

    @property
    def q_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "Qwen3Config":
        """Parses a transformers-4 (top-level ``rope_theta``) or transformers-5
        (``rope_parameters``) Qwen3 config."""
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in cfg]
        if missing:
            raise ConfigError(f"config.json lacks required keys: {', '.join(missing)}")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"rope_type {rope_type!r} is not supported for qwen3 (only 'default')")
        theta = rope.get("rope_theta", cfg.get("rope_theta"))
        if theta is None:
            raise ConfigError("config.json gives no RoPE base: expected rope_parameters.rope_theta or rope_theta")
        if cfg.get("use_sliding_window") or any(t != "full_attention" for t in cfg.get("layer_types") or []):
            raise ConfigError("sliding-window layers are not supported yet; serve a checkpoint with full attention")
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads", heads)
        if heads % kv_heads:
            raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        eos = cfg.get("eos_token_id")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        )


ARCHITECTURES = {"Qwen3ForCausalLM": Qwen3Config}


def load_model_config(model_dir: str | Path) -> Qwen3Config:
    """Reads ``config.json`` of an HF checkpoint directory and returns its typed config."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found: --model must be a Hugging Face checkpoint directory")
    cfg = json.loads(path.read_text())
    archs = cfg.get("architectures") or []
    known = [a for a in archs if a in ARCHITECTURES]
    if not known:
        raise ConfigError(f"unknown architecture {archs or cfg.get('model_type')!r} in {path}; "
                          f"supported: {', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[known[0]].from_hf(cfg)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Serving limits and resources, with vLLM's flag names and meanings."""

    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    page_size: int = 16
    num_pages: int | None = None          # None: derive from gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"          # auto (= model dtype) | bfloat16 | fp8
    tp: int = 1
    decode_steps: int = 8                 # decode steps per device call (lax.while_loop)
    kernel_backend: str = "auto"          # auto (pallas on GPU, xla elsewhere) | pallas | xla
    seed: int = 0
    compilation_cache_dir: str | None = None

    def __post_init__(self):
        if self.max_model_len < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_model_len, max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"page_size must be a power of two, got {self.page_size}")
        if self.kv_cache_dtype not in ("auto", "bfloat16", "fp8"):
            raise ConfigError(f"kv_cache_dtype must be auto, bfloat16 or fp8, got {self.kv_cache_dtype!r}")
        if self.kernel_backend not in ("auto", "pallas", "xla"):
            raise ConfigError(f"kernel_backend must be auto, pallas or xla, got {self.kernel_backend!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        if self.decode_steps < 1:
            raise ConfigError("decode_steps must be >= 1")
