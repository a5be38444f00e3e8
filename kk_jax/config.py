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


def read_json(path: Path, missing=None):
    """The JSON document at ``path``, ``missing`` if there is no such file; ConfigError naming
    the file if it is not valid JSON."""
    if not path.is_file():
        return missing
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


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


LINEAR, SPARSE = "linear_attention", "deepseek_sparse_attention"


@dataclasses.dataclass(frozen=True)
class Glm5NextConfig:
    """``Glm5NextForConditionalGeneration`` text tower (reference/glm5-checkpoint.md, models.md §1).

    Per layer: ``layer_types[i]`` is KDA (``linear_attention``) or DSA
    (``deepseek_sparse_attention``: NoPE MLA + C4 pooled indexer); ``mlp_layer_types[i]`` is a
    dense SwiGLU or an MoE; every layer is wrapped in mHC with ``hc_mult`` streams.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    swiglu_limit: float
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_kpool: int
    index_kpool_always_select_tail: bool
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    linear_lower_bound: float
    hc_mult: int
    hc_eps: float
    hc_sinkhorn_iters: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = ()

    architecture = "Glm5NextForConditionalGeneration"

    @property
    def num_key_value_heads(self) -> int:          # MLA: one latent shared by all heads
        return self.num_attention_heads

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "Glm5NextConfig":
        t = dict(cfg.get("text_config") or cfg)
        lin = t.get("linear_attn_config") or {}
        n = t.get("num_hidden_layers")
        if n is None:
            raise ConfigError("config.json text_config lacks num_hidden_layers")
        layer_types = tuple(t.get("layer_types") or [SPARSE if i % 4 == 3 else LINEAR for i in range(n)])
        mlp_types = tuple(t.get("mlp_layer_types") or ["dense"] * min(3, n) + ["sparse"] * max(0, n - 3))
        problems = []
        if len(layer_types) != n or any(x not in (LINEAR, SPARSE) for x in layer_types):
            problems.append(f"layer_types must list {n} entries of {LINEAR!r}/{SPARSE!r}, got {list(layer_types)}")
        if len(mlp_types) != n or any(x not in ("dense", "sparse") for x in mlp_types):
            problems.append(f"mlp_layer_types must list {n} entries of 'dense'/'sparse', got {list(mlp_types)}")
        if any(x != "full" for x in (t.get("indexer_types") or [])):
            problems.append("indexer_types 'shared' (cross-layer top-k reuse) is not supported yet")
        if int(t.get("qk_rope_head_dim", 0)) != 0:
            problems.append(f"qk_rope_head_dim must be 0 (NoPE MLA), got {t.get('qk_rope_head_dim')}")
        if int(t.get("n_group", 1)) != 1 or int(t.get("topk_group", 1)) != 1:
            problems.append("group-limited routing (n_group/topk_group != 1) is not supported")
        kpool = int(t.get("index_kpool", 16))
        if int(t.get("index_topk", 2048)) % kpool:
            problems.append(f"index_topk={t.get('index_topk')} must be a multiple of index_kpool={kpool}")
        if problems:
            raise ConfigError("inconsistent GLM-5.3 config: " + "; ".join(problems))
        eos = t.get("eos_token_id", cfg.get("eos_token_id"))
        return cls(
            vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], num_hidden_layers=n,
            layer_types=layer_types, mlp_layer_types=mlp_types,
            intermediate_size=t["intermediate_size"], moe_intermediate_size=t["moe_intermediate_size"],
            n_routed_experts=t["n_routed_experts"], num_experts_per_tok=t["num_experts_per_tok"],
            n_shared_experts=t.get("n_shared_experts", 1), routed_scaling_factor=float(t["routed_scaling_factor"]),
            norm_topk_prob=bool(t.get("norm_topk_prob", True)), swiglu_limit=float(t.get("swiglu_limit", 10.0)),
            num_attention_heads=t["num_attention_heads"], q_lora_rank=t["q_lora_rank"],
            kv_lora_rank=t["kv_lora_rank"], qk_nope_head_dim=t["qk_nope_head_dim"], v_head_dim=t["v_head_dim"],
            index_n_heads=t["index_n_heads"], index_head_dim=t["index_head_dim"], index_topk=t["index_topk"],
            index_kpool=kpool, index_kpool_always_select_tail=bool(t.get("index_kpool_always_select_tail", True)),
            linear_num_heads=lin.get("num_heads", t.get("linear_num_heads", 64)),
            linear_head_dim=lin.get("head_dim", t.get("linear_head_dim", 128)),
            linear_conv_kernel_dim=lin.get("short_conv_kernel_size", t.get("linear_conv_kernel_dim", 4)),
            linear_lower_bound=float(lin.get("gate_lower_bound", t.get("linear_lower_bound", -5.0))),
            hc_mult=t.get("hc_mult", 4), hc_eps=float(t.get("hc_eps", 1e-6)),
            hc_sinkhorn_iters=t.get("hc_sinkhorn_iters", 20), rms_norm_eps=float(t.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=t.get("max_position_embeddings", 1 << 20),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", t.get("tie_word_embeddings", False))),
            torch_dtype=str(cfg.get("dtype") or t.get("dtype") or cfg.get("torch_dtype") or "bfloat16"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        )


ARCHITECTURES = {"Qwen3ForCausalLM": Qwen3Config, "Glm5NextForConditionalGeneration": Glm5NextConfig}


def load_model_config(model_dir: str | Path) -> Qwen3Config:
    """Reads ``config.json`` of an HF checkpoint directory and returns its typed config."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found: --model must be a Hugging Face checkpoint directory")
    cfg = read_json(path)
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
    decode_steps: int = 8                 # decode steps per device call (one loop on the device)
    kernel_backend: str = "auto"          # auto (pallas on GPU, xla elsewhere) | pallas | xla
    kda_backend: str = "auto"             # KDA layers only: auto (= kernel_backend) | pallas | xla
    dense_decode_backend: str = "auto"   # unquantized linears at batch-1 decode: auto (pallas with the Pallas kernels on a GPU) | pallas | xla
    sampler_programs: str = "auto"       # three more decode programs per batch bucket, without sampler
                                          # branches: all-greedy batches, sampled ones, sampled with top-k /
                                          # top-p / min-p (batches asking for top logprobs take the general
                                          # one): auto (on a GPU, where a branch costs a device->host round
                                          # trip each step and makes the call synchronous) | on | off
    decode_tail_program: str = "auto"    # a second, 4-step decode program per batch bucket for calls whose
                                          # rows all have at most 4 tokens left (a decode program runs all its
                                          # steps, masked once its rows stop): auto (on a GPU) | on | off
    pipeline_decode: bool = True          # dispatch the next decode call of an unchanged batch before
                                          # reading this one's tokens (the host's work overlaps the device's)
    seed: int = 0
    compilation_cache_dir: str | None = None
    load_mtp: bool = False                # also load the model's MTP (NextN) block and its cache pools
                                          # (loaded only: no decode step runs it yet)
    scan_layers: bool = True              # a model's repeating layer groups run as one scanned body
                                          # (compiled once; off: every layer unrolled)
    fp8_activations: bool = False         # block-FP8 linears run W8A8 (activations to e4m3 per 1x128 group,
                                          # the release's reference numerics; routed MoE experts stay W8A16);
                                          # off = W8A16, closer to bf16

    def __post_init__(self):
        if self.max_model_len < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_model_len, max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ConfigError(f"page_size must be a power of two, got {self.page_size}")
        if self.kv_cache_dtype not in ("auto", "bfloat16", "fp8"):
            raise ConfigError(f"kv_cache_dtype must be auto, bfloat16 or fp8, got {self.kv_cache_dtype!r}")
        for name in ("kernel_backend", "kda_backend"):
            if getattr(self, name) not in ("auto", "pallas", "xla"):
                raise ConfigError(f"{name} must be auto, pallas or xla, got {getattr(self, name)!r}")
        if self.dense_decode_backend not in ("auto", "pallas", "xla"):
            raise ConfigError(f"dense_decode_backend must be auto, pallas or xla, got {self.dense_decode_backend!r}")
        for name in ("sampler_programs", "decode_tail_program"):
            if getattr(self, name) not in ("auto", "on", "off"):
                raise ConfigError(f"{name} must be auto, on or off, got {getattr(self, name)!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        if self.decode_steps < 1:
            raise ConfigError("decode_steps must be >= 1")
