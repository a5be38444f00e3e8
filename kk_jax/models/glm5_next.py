"""GLM-5.3-Flash text tower (``Glm5NextForConditionalGeneration``) as Flax NNX modules.

Layers follow ``layer_types`` (KDA or DSA attention) and ``mlp_layer_types`` (dense clamped
SwiGLU or MoE with a shared expert); each layer's two sites are wrapped in mHC over
``hc_mult`` residual streams; the streams are averaged at the end, then the final RMSNorm
and lm_head (reference/models.md §1, reference/glm5-checkpoint.md). NNX paths equal the
checkpoint names (``model.language_model.layers.{i}...``); routed experts are stacked at load.

Cache pools per layer: KDA — ``state [H, K, V]`` fp32 and ``conv`` slots; DSA — latent pages,
pooled index-key pages and the indexer's open-group ``tail`` slot. The repeating run of layer
groups (``layer_scan``) is declared stacked before loading and scanned, so that a 45-layer trunk
compiles 9 layer bodies (``layers.scan``). The vision tower
(``model.visual.*``) and the MTP block (layer ``num_hidden_layers``) are not served yet; their
tensors are accepted and skipped (the MTP block is loaded with ``load_mtp``, but nothing runs it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from kk_jax.cache.pools import CacheLayout, PagedSpec, SlotSpec
from kk_jax.config import LINEAR, ConfigError, Glm5NextConfig
from kk_jax.models.attention.kda import KDAAttention
from kk_jax.models.attention.mla_sparse import SparseMLA
from kk_jax.models.attention.paged import AttentionBatch
from kk_jax.models.layers.embed import Embedding
from kk_jax.models.layers.linear import Linear
from kk_jax.models.layers.mhc import mhc_post, mhc_pre
from kk_jax.models.layers.mlp import SwiGLU
from kk_jax.models.layers.moe import MoE
from kk_jax.models.layers.norm import RMSNorm
from kk_jax.models.layers.scan import Plan, repeating_groups, scan_groups, stack_layers


@dataclasses.dataclass(frozen=True)
class Glm5Ops:
    """What the layers need besides weights: the mesh and the kernel backends (fixed per server):
    ``backend`` for attention, experts and kernels in general, ``kda_backend`` for the KDA layers'
    recurrence (``--kda-backend``)."""

    mesh: Mesh
    backend: str
    kda_backend: str


class Glm5DecoderLayer(nnx.Module):
    def __init__(self, cfg: Glm5NextConfig, i: int, dtype):
        hc, d = cfg.hc_mult, cfg.hidden_size
        self.cfg, self.i = cfg, i
        self.kda = cfg.layer_types[i] == LINEAR
        self.moe = cfg.mlp_layer_types[i] == "sparse"
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", nnx.Param(jnp.zeros(((2 + hc) * hc, hc * d), jnp.float32), axes=(None, None)))
            setattr(self, f"hc_{site}_base", nnx.Param(jnp.zeros(((2 + hc) * hc,), jnp.float32), axes=(None,)))
            setattr(self, f"hc_{site}_scale", nnx.Param(jnp.zeros((3,), jnp.float32), axes=(None,)))
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.self_attn = KDAAttention(cfg, dtype) if self.kda else SparseMLA(cfg, dtype)
        if self.moe:
            self.mlp = MoE(d, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.n_shared_experts,
                           cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.norm_topk_prob,
                           cfg.swiglu_limit, dtype)
        else:
            self.mlp = SwiGLU(d, cfg.intermediate_size, dtype, limit=cfg.swiglu_limit)

    def _site(self, name, x):
        c = self.cfg
        return mhc_pre(x, getattr(self, f"hc_{name}_fn")[...], getattr(self, f"hc_{name}_base")[...],
                       getattr(self, f"hc_{name}_scale")[...], hc=c.hc_mult, iters=c.hc_sinkhorn_iters,
                       eps=c.hc_eps, rms_eps=c.rms_norm_eps)

    def __call__(self, x, pools: dict, batch: AttentionBatch, ops: Glm5Ops):
        """x [B, T, hc, D] residual streams -> (x, pools)."""
        p = f"layers.{self.i}."
        post, comb, u = self._site("attn", x)
        h = self.input_layernorm(u)
        if self.kda:
            y, pools[p + "state"], pools[p + "conv"] = self.self_attn(
                h, pools[p + "state"], pools[p + "conv"], batch.slots, batch.valid, ops.kda_backend, ops.mesh)
        else:
            index = (pools[p + "index_k"], pools.get(p + "index_k_scale"))
            y, pools[p + "latent"], index, pools[p + "index_tail"] = self.self_attn(
                h, pools[p + "latent"], index, pools[p + "index_tail"], batch, ops.backend)
            pools[p + "index_k"] = index[0]
            if index[1] is not None:
                pools[p + "index_k_scale"] = index[1]
        x = mhc_post(x, y, post, comb)
        post, comb, u = self._site("ffn", x)
        h = self.post_attention_layernorm(u)
        y = self.mlp(h, ops.mesh, ops.backend, batch.stack_index) if self.moe else self.mlp(h)
        return mhc_post(x, y, post, comb), pools


class SharedHead(nnx.Module):
    def __init__(self, d: int, eps: float, dtype):
        self.norm = RMSNorm(d, eps, dtype)


class Glm5MTP(nnx.Module):
    """The MTP (NextN) block stored as layer ``num_hidden_layers`` (glm5-checkpoint.md): a
    plain pre-norm residual block (no mHC) with its own DSA attention + indexer and MoE.

    Row t embeds token t+1 and takes the trunk's final-normed hidden h_t:
    ``x = eh_proj([enorm(emb); hnorm(h)])``, ``r = x + DSA(input_layernorm(x))``,
    ``out = shared_head.norm(r + MoE(post_attention_layernorm(r)))``; logits = lm_head(out),
    and ``out`` is the hidden recycled into the next draft step."""

    def __init__(self, cfg: Glm5NextConfig, dtype):
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.index = cfg.num_hidden_layers
        self.eh_proj = Linear(2 * d, d, dtype, axes=(None, "embed"))
        self.enorm = RMSNorm(d, eps, dtype)
        self.hnorm = RMSNorm(d, eps, dtype)
        self.input_layernorm = RMSNorm(d, eps, dtype)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype)
        self.self_attn = SparseMLA(cfg, dtype)
        self.mlp = MoE(d, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.n_shared_experts,
                       cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.norm_topk_prob, cfg.swiglu_limit, dtype)
        self.shared_head = SharedHead(d, eps, dtype)

    def __call__(self, emb, h, pools: dict, batch: AttentionBatch, ops: Glm5Ops):
        """emb [B, T, D] (embeddings of the next tokens), h [B, T, D] -> (out [B, T, D], pools)."""
        p = f"layers.{self.index}."
        x = self.eh_proj(jnp.concatenate([self.enorm(emb), self.hnorm(h)], axis=-1))
        index = (pools[p + "index_k"], pools.get(p + "index_k_scale"))
        a, pools[p + "latent"], index, pools[p + "index_tail"] = self.self_attn(
            self.input_layernorm(x), pools[p + "latent"], index, pools[p + "index_tail"], batch, ops.backend)
        pools[p + "index_k"] = index[0]
        if index[1] is not None:
            pools[p + "index_k_scale"] = index[1]
        r = x + a
        return self.shared_head.norm(r + self.mlp(self.post_attention_layernorm(r), ops.mesh, ops.backend)), pools


class Glm5TextModel(nnx.Module):
    def __init__(self, cfg: Glm5NextConfig, dtype, mtp: bool):
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        layers = [Glm5DecoderLayer(cfg, i, dtype) for i in range(cfg.num_hidden_layers)]
        self.layers = nnx.List(layers + ([Glm5MTP(cfg, dtype)] if mtp else []))   # MTP = layer N, as stored
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class Glm5Outer(nnx.Module):
    def __init__(self, cfg: Glm5NextConfig, dtype, mtp: bool):
        self.language_model = Glm5TextModel(cfg, dtype, mtp)


class Glm5NextForConditionalGeneration(nnx.Module):
    """``mtp=True`` also builds (and so loads) the MTP block (:meth:`mtp_hidden`, which no
    decode step calls yet)."""

    config_class = Glm5NextConfig
    has_mtp = True

    def __init__(self, cfg: Glm5NextConfig, dtype, mtp: bool = False):
        self.cfg, self.mtp = cfg, mtp
        self.scan: Plan | None = None            # set by stack_layers
        self.model = Glm5Outer(cfg, dtype, mtp)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype, axes=("vocab", "embed"))

    @staticmethod
    def layer_scan(cfg: Glm5NextConfig) -> Plan | None:
        """The run of identical layer groups (attention kind and MLP kind per layer) to scan:
        for GLM-5.3-Flash layers 3-42, ten groups of DSA + 3 KDA (models.md §1.1)."""
        return repeating_groups(list(zip(cfg.layer_types, cfg.mlp_layer_types)))

    @staticmethod
    def cache_layout(cfg: Glm5NextConfig, kv_dtype, mtp: bool = False, scan: Plan | None = None) -> CacheLayout:
        """KDA: fp32 recurrent state and conv inputs (lossless for bf16 projections). DSA (and the
        MTP block's own DSA when ``mtp``): latent pages and pooled index keys in ``kv_dtype``;
        with fp8, index keys in the serving layout (Hadamard-rotated e4m3 + a power-of-two scale
        per pool: 33 B/token at d = 128). With a ``scan`` plan the run's template layers hold
        their group's pools stacked (``stack = count``) and the other layers of the run none."""
        h, dk = cfg.linear_num_heads, cfg.linear_head_dim
        fp8 = jnp.dtype(kv_dtype) == jnp.dtype(jnp.float8_e4m3fn)
        layout: CacheLayout = {}
        kinds = list(cfg.layer_types) + (["mtp"] if mtp else [])
        first, period, count = scan or (0, 0, 1)
        for i, kind in enumerate(kinds):
            p, stack = f"layers.{i}.", 1
            if first <= i < first + period * count:
                if i >= first + period:
                    continue
                stack = count
            if kind == LINEAR:
                layout[p + "state"] = SlotSpec((h, dk, dk), jnp.float32, ("heads", None, None), stack)
                layout[p + "conv"] = SlotSpec((3, cfg.linear_conv_kernel_dim - 1, h * dk), jnp.float32,
                                              (None, None, "heads"), stack)
            else:
                layout[p + "latent"] = PagedSpec((cfg.kv_lora_rank,), kv_dtype, (None,), stack=stack)
                layout[p + "index_k"] = PagedSpec((cfg.index_head_dim,), kv_dtype, (None,),
                                                  tokens_per_entry=cfg.index_kpool, stack=stack)
                if fp8:
                    layout[p + "index_k_scale"] = PagedSpec((), jnp.float32, (), tokens_per_entry=cfg.index_kpool,
                                                            stack=stack)
                layout[p + "index_tail"] = SlotSpec((2, cfg.index_kpool, cfg.index_head_dim), jnp.float32,
                                                    (None, None, None), stack)
        return layout

    def stack_layers(self, plan: Plan) -> bool:
        """Before loading (on the abstract model): declares the weights of ``plan``'s run stacked
        (``layers.scan``); the forward then scans it over pools laid out by
        ``cache_layout(..., scan=plan)``. False (nothing changed) when the run's layers differ in
        their parameters."""
        if not stack_layers(self.model.language_model.layers, plan):
            return False
        self.scan = plan
        return True

    @staticmethod
    def divisible_sizes(cfg: Glm5NextConfig) -> dict[str, int]:
        return {"linear_num_heads": cfg.linear_num_heads, "num_attention_heads": cfg.num_attention_heads,
                "intermediate_size": cfg.intermediate_size, "moe_intermediate_size": cfg.moe_intermediate_size,
                "vocab_size": cfg.vocab_size}

    @staticmethod
    def ignored_tensors(cfg: Glm5NextConfig, mtp: bool = False) -> tuple[str, ...]:
        """Checkpoint parts not served: the vision tower, and the MTP block unless asked for."""
        return ("model.visual.",) + (() if mtp else (f"model.language_model.layers.{cfg.num_hidden_layers}.",))

    @staticmethod
    def pallas_unsupported(cfg: Glm5NextConfig) -> str | None:
        """None: every GPU kernel of this model takes any size it is built with (head sizes the
        Pallas KDA kernels do not take fall back in ``make_ops``)."""
        return None

    @staticmethod
    def make_ops(cfg: Glm5NextConfig, mesh: Mesh, backend: str, kda_backend: str = "auto") -> Glm5Ops:
        """``kda_backend`` auto follows ``backend``, except that head sizes the Pallas KDA kernels do
        not take (tiny test models) run the jnp recurrence; an explicit pallas for them is an error."""
        from pallas_kernels.kda import pallas_supports

        kda = backend if kda_backend == "auto" else kda_backend
        if kda == "pallas" and not pallas_supports(cfg.linear_head_dim, cfg.linear_head_dim):
            if kda_backend == "pallas":
                raise ConfigError(f"kda_backend 'pallas': the Pallas KDA kernels need a head dim of 64 or 128, "
                                  f"this model's linear_head_dim is {cfg.linear_head_dim} (use auto or xla)")
            kda = "xla"
        return Glm5Ops(mesh, backend, kda)

    def __call__(self, tokens, batch: AttentionBatch, pools: dict, ops: Glm5Ops):
        """tokens [B, T] -> (hidden [B, T, D] after the stream mean and final norm, pools)."""
        lm = self.model.language_model
        x = lm.embed_tokens(tokens)                                                          # [B, T, D]
        x = jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], self.cfg.hc_mult, x.shape[-1]))
        pools = dict(pools)
        first, period, count = self.scan or (0, 0, 0)
        scanned = range(first, first + period * count)                  # empty without a scan
        for i in range(self.cfg.num_hidden_layers):
            if i in scanned and i == first:               # the whole scanned run, at its first layer
                with jax.named_scope(f"layers_{first}_to_{first + period * count - 1}"):
                    x, pools = scan_groups([lm.layers[first + k] for k in range(period)], self.scan, (x, pools), batch,
                                           *self._stacked_sizes(pools),
                                           lambda layer, c, b: layer(*c, b, ops))
            elif i not in scanned:
                with jax.named_scope(f"layer_{i}"):
                    x, pools = lm.layers[i](x, pools, batch, ops)
        h = jnp.mean(x.astype(jnp.float32), axis=2).astype(x.dtype)
        return lm.norm(h), pools

    def _stacked_sizes(self, pools: dict) -> tuple[int, int]:
        """(pages, slots) per layer of the scanned run's stacked pools."""
        first, period, count = self.scan
        sizes = {}
        for k in range(period):
            for entry, what in (("latent", "pages"), ("index_tail", "slots"), ("state", "slots")):
                if f"layers.{first + k}.{entry}" in pools:
                    sizes[what] = pools[f"layers.{first + k}.{entry}"].shape[0] // count
        return sizes.get("pages", 0), sizes.get("slots", 0)

    def mtp_hidden(self, next_tokens, h, batch: AttentionBatch, pools: dict, ops: Glm5Ops,
                   zero_first_embedding: bool = False):
        """One MTP draft step: next_tokens [B, T] (token t+1 of each row t), h [B, T, D] the trunk's
        final-normed hidden -> (MTP hidden [B, T, D], pools); draft logits = ``logits(hidden)``.
        ``zero_first_embedding`` zeroes the embedding at position 0 (DeepSeek-MTP convention of
        newer serving stacks)."""
        lm = self.model.language_model
        emb = lm.embed_tokens(next_tokens)
        if zero_first_embedding:
            emb = jnp.where((batch.positions == 0)[..., None], 0, emb)
        with jax.named_scope("mtp"):
            return lm.layers[self.cfg.num_hidden_layers](emb, h, pools, batch, ops)

    def logits(self, h: jax.Array) -> jax.Array:
        with jax.named_scope("lm_head"):
            return jnp.einsum("...d,vd->...v", h, self.lm_head.weight[...], preferred_element_type=jnp.float32)
