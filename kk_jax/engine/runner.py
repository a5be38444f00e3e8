"""Model runner: owns weights, cache pools and one compiled program per shape bucket.

The runner turns scheduler decisions into padded device arrays and calls ahead-of-time
compiled steps (DESIGN rules 2-4):

* ``prefill``: ``[B, T]`` chunk tokens per step for (B, T) in a fixed bucket set, samples the
  next token at each row's last chunk position.
* ``decode``: ``decode_steps`` steps of ``[B]`` tokens inside one loop (model → sample →
  append → stop check), with the pages for those steps reserved beforehand; ``decode_greedy``,
  ``decode_draw`` and ``decode_draw_filtered`` are the same loop for batches drawn one known way
  (`DRAW_PROGRAMS`; no sampler branches). Each decode kind may also have a
  ``TAIL_DECODE_STEPS``-step program for the last tokens of rows.

Both take ``(weights, pools, rows)`` (``rows``: the step's per-row inputs packed into one int32
array by ``row_layout``), return ``(pools, outputs)`` and donate ``pools``.
Weights are flattened once at load into a leaf tuple; the NNX module is re-assembled inside
the trace, so no pytree walk of modules happens per call.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kk_jax.cache.pools import (CacheLayout, SlotSpec, abstract_pools, allocate_pools, bytes_per_page, pool_sharding,
                                zero_slots)
from kk_jax.checkpoint.loader import (Stack, TensorSpec, abstract_params, expected_tensors, load_params, random_params,
                                      tensor_spec)
from kk_jax.config import ConfigError, EngineConfig
from kk_jax.engine.request import MAX_LOGPROBS
from kk_jax.engine.row_inputs import RowLayout
from kk_jax.engine.sampler import DRAW, DRAW_FILTERED, GREEDY, SamplingArrays, draw_mode, sample
from kk_jax.models.attention.paged import AttentionBatch
from kk_jax.models.layers.linear import mark_wide_scales, prepare_linears
from kk_jax.models.layers.moe import prepare_experts
from kk_jax.models.layers.scan import member_paths
from kk_jax.parallel.mesh import check_divisible
from kk_jax.quant.config import detect

log = logging.getLogger(__name__)

MAX_STOP_IDS = 16
# Steps of the short decode program, for calls whose rows all have at most this many tokens
# left. A decode program runs a fixed number of steps: a loop of known trip count runs on the
# device without host tests (a data-dependent loop tests its condition on the host, a
# device->host copy and a wait per test, and makes the call synchronous), so a call whose rows
# all stop early runs its remaining steps masked.
TAIL_DECODE_STEPS = 4
# the decode programs without sampler branches, by the `draw_mode` they draw with ("decode" has
# the branches and takes every batch)
DRAW_PROGRAMS = {"decode_greedy": GREEDY, "decode_draw": DRAW, "decode_draw_filtered": DRAW_FILTERED}
WARMUP_THREADS = 8           # concurrent start-up compiles (each holds a program's compiler state)
JAX_DEFAULT_MEM_FRACTION = 0.75     # share of a GPU JAX's allocator may use unless told otherwise


def claim_device_memory(utilization: float) -> None:
    """Lets JAX's GPU allocator use ``utilization`` of each GPU, which is what
    ``--gpu-memory-utilization`` means to vLLM users (JAX's own default is 75 %). Sets
    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` unless the user did; it only takes effect if JAX has not
    started its GPU backend yet."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(utilization))


def memory_budget(bytes_limit: int, utilization: float) -> float:
    """Bytes of one GPU the engine may fill (weights, pools, activations): ``utilization`` of the
    GPU, never more than the allocator's ``bytes_limit`` (which is its fraction of the GPU)."""
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_DEFAULT_MEM_FRACTION))
    return min(bytes_limit, bytes_limit * utilization / fraction)


class StepError(ValueError):
    """A step's metadata does not fit the cache (checked on the host before any device work)."""


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def resolve_backend(name: str, platform: str) -> str:
    """``auto`` = Pallas kernels on an NVIDIA GPU (``platform`` of the mesh's devices), the jnp
    twins elsewhere (and on a GPU for models whose sizes the kernels do not take:
    ``pallas_unsupported`` of the model class)."""
    if name != "auto":
        return name
    return "pallas" if platform == "gpu" else "xla"


def kv_dtype(name: str, model_dtype):
    return {"auto": model_dtype, "bfloat16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}[name]


def checkpoint_tensors(flat) -> tuple[dict, dict[str, Stack]]:
    """Expected checkpoint tensors {name: TensorSpec} for the model's flat NNX state, and, for
    stacked routed experts (``hf_experts`` metadata ``(proj, E)`` or ``(proj, E, suffix)`` on an
    ``[E, a, b]`` or ``[E]`` param), the :class:`Stack` of per-expert checkpoint names
    (``...experts.{e}.{proj}.{suffix}``, suffix ``weight`` by default) each stacked param is
    built from. Float experts are stacked transposed (HF ``[b, a]`` per expert); params with
    ``hf_orientation`` metadata (quantized experts) keep the checkpoint's ``[a, b]``. Quantized
    expert tensors (``quant_dtype`` metadata: codes and scales) must have that exact dtype, so a
    mis-shaped or mistyped one is reported by the loader before any device work."""
    expected, stacks = {}, {}
    for path, var in flat:
        name = ".".join(map(str, path))
        meta = var.get_metadata()
        spec = meta.get("hf_experts")
        if spec is None:
            expected[name] = tensor_spec(var)      # (shape, axes) + exact dtype of quantized tensors
            continue
        proj, n, suffix = (*spec, "weight")[:3]
        base = ".".join(map(str, path[:-1]))
        names = [f"{base}.{e}.{proj}.{suffix}" for e in range(n)]
        transpose = not meta.get("hf_orientation", False)
        order = reversed if transpose else tuple
        per_expert = TensorSpec(tuple(order(var.shape[1:])), tuple(order(tuple(var.axes)[1:])),
                                meta.get("quant_dtype"))
        for n_ in names:
            expected[n_] = per_expert
        stacks[name] = Stack(tuple(names), transpose=transpose)
    return expected, stacks


def param_stacks(flat, expert_stacks: dict[str, Stack]) -> dict[str, tuple[TensorSpec, Stack]]:
    """The model's parameters that the loader assembles from several checkpoint tensors: stacked
    routed experts (per-expert HF tensors) and the layers of a scanned group
    (``stacked_layers`` metadata), each {param name: (its spec, Stack of checkpoint names)}."""
    out = {}
    for path, var in flat:
        name, layers = ".".join(map(str, path)), var.get_metadata().get("stacked_layers")
        if layers:
            members = (".".join(map(str, p)) for p in member_paths(path, layers))
            part = Stack(tuple(expert_stacks.get(m, m) for m in members))
        else:
            part = expert_stacks.get(name, name)
        if isinstance(part, Stack):
            out[name] = (TensorSpec(tuple(var.shape), tuple(var.get_metadata()["axes"])), part)
    return out


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The fixed shapes compiled at start-up."""

    decode: tuple[int, ...]                      # batch sizes
    prefill: tuple[tuple[int, int], ...]         # (batch, tokens per row), B*T <= token budget

    @staticmethod
    def make(max_num_seqs: int, max_num_batched_tokens: int) -> "Buckets":
        top = pow2_at_least(max_num_seqs)
        decode = tuple(1 << i for i in range(top.bit_length()))
        t_min = min(16, pow2_at_least(max_num_batched_tokens))
        ts = sorted({1 << i for i in range(t_min.bit_length() - 1, 31) if (1 << i) < max_num_batched_tokens}
                    | {max_num_batched_tokens})
        ts = [t for t in ts if t >= t_min]
        prefill = tuple((b, t) for t in ts for b in decode if b * t <= max_num_batched_tokens)
        return Buckets(decode, prefill)

    def decode_batch(self, n: int) -> int:
        return next(b for b in self.decode if b >= n)

    def prefill_tokens(self, chunk: int) -> int:
        """Smallest token bucket holding ``chunk`` tokens."""
        return next(t for (_, t) in self.prefill if t >= chunk)

    def prefill_batch(self, n: int, t: int) -> int | None:
        return next((b for (b, tt) in self.prefill if tt == t and b >= n), None)


@dataclasses.dataclass
class PrefillRow:
    tokens: list[int]            # the chunk
    start: int                   # position of tokens[0]
    pages: list[int]
    slot: int                    # state slot (0 when the model keeps no per-sequence state)
    params: object               # SamplingParams
    seed: int
    token_index: int             # index of the token sampled at the chunk end


@dataclasses.dataclass
class DecodeRow:
    token: int | None            # last token (its K/V not yet in the cache); None: the last token row
                                 # ``follows`` of the call this one follows sampled (``decode_start(after=)``)
    position: int
    pages: list[int]
    slot: int
    budget: int                  # max tokens to generate in this call
    stop_ids: list[int]
    params: object
    seed: int
    token_index: int
    follows: int | None = None   # with token None: the row of ``after`` this one continues (None: its own)


@dataclasses.dataclass
class Sampled:
    """Host copies of sampler outputs for one row: generated tokens with their logprobs."""

    tokens: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclasses.dataclass
class PendingDecode:
    """A dispatched decode call: ``result()`` waits for its sampled tokens; ``carry`` (each row's
    last token, and whether it may go on) stays on the device for a chained call."""
    runner: "ModelRunner"
    num_rows: int
    batch: int                   # the batch bucket
    out: object                  # (n_gen, (tokens, logprobs, top ids, top logprobs)), host memory
    carry: tuple                 # ([B] int32 last tokens, [B] bool ran its budget without a stop id)
    host_s: float                # host time spent packing its inputs
    _result: list[Sampled] | None = None

    def result(self) -> list[Sampled]:
        if self._result is None:
            n_gen, (toks, lps, top_ids, top_lps) = jax.device_get(self.out)
            h = time.perf_counter()
            self._result = [Sampled(toks[:n, i].tolist(), lps[:n, i].tolist(), top_ids[:n, i].tolist(),
                                    top_lps[:n, i].tolist()) for i, n in enumerate(n_gen[:self.num_rows].tolist())]
            self.runner._account(self.host_s + time.perf_counter() - h)
        return self._result


def check_fp8_activations(model_dir: Path | None) -> None:
    """W8A8 applies to block-FP8 weights only: refuse the flag for any other checkpoint."""
    qcfg = detect(model_dir) if model_dir is not None else None
    if qcfg is None or qcfg.method != "fp8_block":
        what = "random weights" if model_dir is None else (f"a {qcfg.method} checkpoint" if qcfg else
                                                           "an unquantized checkpoint")
        raise ConfigError(f"fp8_activations (W8A8) needs a block-FP8 checkpoint "
                          f"(quantization_config.quant_method 'fp8' with weight_block_size); got {what}")


@functools.cache
def row_layout(kind: str, t: int, max_pages: int) -> RowLayout:
    """Per-row inputs of a step program: a prefill chunk of ``t`` tokens or a decode call (any
    ``t``), with the page table of ``max_pages`` entries and the ``SamplingArrays`` fields."""
    i32 = np.int32
    if kind == "prefill":
        head = (("tokens", (t,), i32), ("positions", (t,), i32), ("valid", (t,), np.bool_),
                ("page_table", (max_pages,), i32), ("kv_lens", (), i32), ("slots", (), i32), ("last_idx", (), i32))
    else:
        head = (("tokens", (), i32), ("follows", (), i32), ("positions", (), i32),
                ("page_table", (max_pages,), i32), ("slots", (), i32), ("active", (), np.bool_), ("budget", (), i32),
                ("stop_ids", (MAX_STOP_IDS,), i32))
    sa = SamplingArrays.from_params([None], [0], 1)
    sampling = tuple((f.name, (), getattr(sa, f.name).dtype.type) for f in dataclasses.fields(sa))
    return RowLayout(head + sampling + (("token_index", (), i32),))


def unpack_rows(layout: RowLayout, packed: jax.Array) -> tuple[dict[str, jax.Array], SamplingArrays]:
    """Inside a step: the packed inputs by name, and the sampling fields as ``SamplingArrays``."""
    x = layout.unpack(packed)
    return x, SamplingArrays(**{f.name: x[f.name] for f in dataclasses.fields(SamplingArrays)})


class ModelRunner:
    def __init__(self, model_cls, model_cfg, model_dir: Path | None, dtype, cfg: EngineConfig, mesh: Mesh,
                 progress: bool = True, random_weights_seed: int | None = None, compile_only: bool = False):
        """Loads weights from ``model_dir``, or draws random ones on the device when
        ``random_weights_seed`` is given (benchmarks of full-size shapes without a checkpoint).
        ``compile_only``: weights and pools are shapes and shardings only, nothing is allocated
        or loaded; the runner lowers and compiles its steps (e.g. for a compile-only GPU mesh,
        ``benchmarks/decode_hlo.py``) but cannot run them."""
        self.cfg, self.mesh, self.model_cfg = cfg, mesh, model_cfg
        self.compile_only = compile_only
        check_divisible(mesh, **model_cls.divisible_sizes(model_cfg))
        platform = mesh.devices.flat[0].platform
        self.backend = resolve_backend(cfg.kernel_backend, platform)
        unsupported = model_cls.pallas_unsupported(model_cfg) if self.backend == "pallas" else None
        if unsupported and cfg.kernel_backend == "pallas":
            raise ConfigError(f"kernel_backend 'pallas': {unsupported} (use auto or xla)")
        if unsupported:
            log.warning("running the jnp kernels (kernel_backend xla): %s", unsupported)
            self.backend = "xla"
        on_gpu = platform == "gpu"
        self.dense_backend = cfg.dense_decode_backend
        if self.dense_backend == "auto":      # the weight-streaming kernel: 1.035x per Qwen3-8B decode step
            self.dense_backend = "pallas" if self.backend == "pallas" and on_gpu else "xla"
        if self.dense_backend == "pallas" and not on_gpu:
            raise ConfigError("dense_decode_backend 'pallas' runs a Mosaic GPU kernel and needs an NVIDIA GPU; "
                              f"the mesh's devices are {platform!r} (use xla)")
        # a decode program per way of drawing, without sampler branches, where a branch costs a
        # device->host round trip per step and makes the call synchronous (GPUs; on the CPU the
        # branch is host code anyway)
        wanted = lambda mode: mode == "on" or (mode == "auto" and on_gpu)      # auto | on | off
        self.decode_programs = ("decode", *DRAW_PROGRAMS) if wanted(cfg.sampler_programs) else ("decode",)
        # step counts of the decode programs: a short program spares the tail calls of requests
        # the masked steps of a full one, where a device call is dear (GPUs)
        tail = wanted(cfg.decode_tail_program)
        self.decode_step_counts = tuple(sorted({cfg.decode_steps, min(TAIL_DECODE_STEPS, cfg.decode_steps)}
                                               if tail else {cfg.decode_steps}))
        if cfg.kda_backend == "pallas" and not on_gpu:
            raise ConfigError(f"kda_backend 'pallas' runs the Mosaic GPU KDA kernels and needs an NVIDIA GPU; "
                              f"the mesh's devices are {platform!r} (use auto or xla)")
        self.ops = model_cls.make_ops(model_cfg, mesh, self.backend, kda_backend=cfg.kda_backend)
        self.max_pages_per_seq = math.ceil(cfg.max_model_len / cfg.page_size)
        self.buckets = Buckets.make(cfg.max_num_seqs, cfg.max_num_batched_tokens)

        if cfg.load_mtp and not getattr(model_cls, "has_mtp", False):
            raise ValueError(f"{model_cls.__name__} has no MTP block; drop load_mtp")
        extra = {"mtp": True} if cfg.load_mtp else {}        # MTP block: built, loaded and cached
        # quantized linears and routed experts (block FP8 / MXFP8 / NVFP4) as the checkpoint declares them
        if cfg.fp8_activations:
            check_fp8_activations(model_dir)
        abstract = nnx.eval_shape(lambda: prepare_experts(prepare_linears(
            model_cls(model_cfg, dtype, **extra), model_dir, backend=self.backend, mesh=mesh,
            act_quant=cfg.fp8_activations, dense_backend=self.dense_backend), model_dir, mesh=mesh))
        scan_plan = getattr(model_cls, "layer_scan", lambda _: None)(model_cfg) if cfg.scan_layers else None
        t0 = time.perf_counter()
        from_checkpoint = random_weights_seed is None and not compile_only
        if from_checkpoint:                 # checkpoint names of the per-layer, per-expert model
            expected, expert_stacks = checkpoint_tensors(nnx.to_flat_state(nnx.state(abstract)))
        if scan_plan and not abstract.stack_layers(scan_plan):
            log.warning("layers %s differ in their parameters (e.g. quantized in some, not others): "
                        "every layer is compiled on its own", scan_plan)
            scan_plan = None
        self.graphdef, state = nnx.split(abstract)
        flat = nnx.to_flat_state(state)
        if from_checkpoint:
            params = load_params(model_dir, expected, dtype, mesh, progress=progress,
                                 ignore=model_cls.ignored_tensors(model_cfg, **extra),
                                 stacks=param_stacks(flat, expert_stacks))
        else:                               # drawn in the model's own (stacked) shapes
            expected = expected_tensors(flat)
            params = (abstract_params(expected, dtype, mesh) if compile_only else
                      random_params(expected, dtype, mesh, random_weights_seed, stacked=frozenset(
                          ".".join(map(str, p)) for p, v in flat if "stacked_layers" in v.get_metadata())))
        pure = {}
        for path, var in flat:
            node = pure
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = params.pop(".".join(map(str, path)))
        nnx.replace_by_pure_dict(state, pure)
        if not compile_only:                # a static flag of MXFP8 layers whose scales the 2-16-row GEMV cannot take
            model = nnx.merge(self.graphdef, state)
            if wide := mark_wide_scales(model):
                log.warning("MXFP8 scales above 2^7 (blocks with weights beyond 2^16) in %s: their 2-16-row "
                            "calls run the dequantizing engine instead of the mma GEMV", ", ".join(wide))
                self.graphdef, state = nnx.split(model)
        self.weights, self.treedef = jax.tree.flatten(state)
        self.weights = tuple(self.weights)
        self.weight_bytes = sum(math.prod(w.shape) * jnp.dtype(w.dtype).itemsize for w in self.weights)
        log.info("loaded %d tensors (%.1f MB) in %.2fs", len(expected), self.weight_bytes / 1e6,
                 time.perf_counter() - t0)

        self.layout: CacheLayout = model_cls.cache_layout(model_cfg, kv_dtype(cfg.kv_cache_dtype, dtype), **extra,
                                                          **({"scan": scan_plan} if scan_plan else {}))
        self.num_pages = cfg.num_pages or self._pages_from_budget()
        if self.num_pages - 1 < self.max_pages_per_seq:
            raise ValueError(f"the KV cache holds {self.num_pages - 1} pages of {cfg.page_size} tokens, fewer than "
                             f"one sequence of max_model_len={cfg.max_model_len} needs ({self.max_pages_per_seq}); "
                             "raise --num-pages/--gpu-memory-utilization or lower --max-model-len")
        self.pools = (abstract_pools if compile_only else allocate_pools)(
            self.layout, num_pages=self.num_pages, page_size=cfg.page_size, num_slots=cfg.max_num_seqs + 1, mesh=mesh)
        self.pool_shardings = {n: pool_sharding(s, mesh) for n, s in self.layout.items()}
        self.has_slots = any(isinstance(s, SlotSpec) for s in self.layout.values())
        self._compiled: dict = {}
        self.compile_seconds = 0.0
        self._compile_lock = threading.Lock()
        self.host_seconds = 0.0      # host time spent packing inputs and unpacking outputs
        self.device_calls = 0
        self._no_carry_cache: dict[int, tuple[jax.Array, jax.Array]] = {}

    # ---------------------------------------------------------------- memory
    def _pages_from_budget(self) -> int:
        """Pages that fit in gpu_memory_utilization of device memory after the weights."""
        stats = {} if self.compile_only else (self.mesh.devices.flat[0].memory_stats() or {})
        if not stats.get("bytes_limit"):   # CPU: no memory statistics; size for max_num_seqs full-length sequences
            return self.cfg.max_num_seqs * self.max_pages_per_seq + 1
        free = memory_budget(stats["bytes_limit"], self.cfg.gpu_memory_utilization) - stats.get("bytes_in_use", 0)
        per_page = bytes_per_page(self.layout, self.cfg.page_size) / self.mesh.shape["tp"]
        # keep room for activations of the largest prefill bucket
        return max(2, int(free * 0.9 // per_page))

    # ---------------------------------------------------------------- step functions
    def _model(self, weights):
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, list(weights)))

    def _prefill_fn(self, layout, weights, pools, packed):
        x, sa = unpack_rows(layout, packed)
        model = self._model(weights)
        batch = AttentionBatch(x["positions"], x["valid"], x["page_table"], x["kv_lens"], x["slots"])
        h, pools = model(x["tokens"], batch, pools, self.ops)
        h_last = jnp.take_along_axis(h, x["last_idx"][:, None, None], axis=1)[:, 0]       # [B, hidden]
        return pools, sample(model.logits(h_last), sa, x["token_index"])

    def _decode_fn(self, mode, n_steps, layout, weights, pools, packed, prev_tokens, prev_alive):
        """``n_steps`` (static) steps in one loop of known trip count, which XLA runs without
        consulting the host; a row stops at a stop id or after ``budget`` tokens and its later
        steps are masked. ``mode`` (static): how the batch's tokens are drawn (`sample`).

        A row that ``follows`` row j >= 0 of the previous call continues it on the device: its token
        is ``prev_tokens[j]`` and it runs only if ``prev_alive[j]``. Returns, besides the pools and the
        sampled outputs, each row's last token and whether it ran its whole budget without a
        stop id (the next call's ``prev_tokens`` / ``prev_alive``)."""
        x, sa = unpack_rows(layout, packed)
        follows = x["follows"]
        chained, src = follows >= 0, jnp.maximum(follows, 0)
        page_table, slots, budget, stop_ids = x["page_table"], x["slots"], x["budget"], x["stop_ids"]
        model = self._model(weights)
        b = packed.shape[0]
        k = min(MAX_LOGPROBS, self.model_cfg.vocab_size)
        outs = (jnp.zeros((n_steps, b), jnp.int32), jnp.zeros((n_steps, b), jnp.float32),
                jnp.zeros((n_steps, b, k), jnp.int32), jnp.zeros((n_steps, b, k), jnp.float32))

        def step(i, c):
            pools, tokens, positions, active, token_index, n_gen, stopped_any, outs = c
            batch = AttentionBatch(positions[:, None], active[:, None], page_table,
                                   jnp.where(active, positions + 1, 0), slots)
            h, pools = model(tokens[:, None], batch, pools, self.ops)
            nxt, lp, top_ids, top_lp = sample(model.logits(h[:, 0]), sa, token_index, mode=mode)
            outs = tuple(o.at[i].set(v) for o, v in zip(outs, (nxt, lp, top_ids, top_lp)))
            n_gen = n_gen + active
            stopped = jnp.any(nxt[:, None] == stop_ids, axis=-1)
            inc = active.astype(jnp.int32)
            new_active = active & ~stopped & (n_gen < budget)
            return (pools, jnp.where(active, nxt, tokens), positions + inc, new_active, token_index + inc, n_gen,
                    stopped_any | (active & stopped), outs)

        tokens = jnp.where(chained, prev_tokens[src], x["tokens"])
        active = x["active"] & (budget > 0) & (~chained | prev_alive[src])
        init = (pools, tokens, x["positions"], active, x["token_index"], jnp.zeros((b,), jnp.int32),
                jnp.zeros((b,), jnp.bool_), outs)
        pools, last, _, _, _, n_gen, stopped_any, outs = jax.lax.fori_loop(0, n_steps, step, init)
        return pools, (n_gen, outs), (last, active & ~stopped_any & (n_gen == budget))

    # ---------------------------------------------------------------- compilation
    def _abstract_inputs(self, kind: str, b: int, t: int):
        weights = tuple(jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=w.sharding) for w in self.weights)
        pools = {n: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for n, a in self.pools.items()}
        width = row_layout(kind, t, self.max_pages_per_seq).width
        rep = NamedSharding(self.mesh, P())
        packed = jax.ShapeDtypeStruct((b, width), jnp.int32, sharding=rep)
        if kind == "prefill":
            return weights, pools, packed
        return (weights, pools, packed, jax.ShapeDtypeStruct((b,), jnp.int32, sharding=rep),
                jax.ShapeDtypeStruct((b,), jnp.bool_, sharding=rep))

    def _lower(self, kind: str, b: int, t: int):
        """``t``: tokens per row of a prefill program, steps of a decode one. The sampled outputs
        land in pinned host memory: the program copies them out on its stream, sparing a
        separate device->host transfer and its wait (~0.4 ms a call on the H200)."""
        layout = row_layout(kind, t, self.max_pages_per_seq)
        fn = (functools.partial(self._prefill_fn, layout) if kind == "prefill" else
              functools.partial(self._decode_fn, DRAW_PROGRAMS.get(kind), t, layout))
        host = NamedSharding(self.mesh, P(), memory_kind="pinned_host")
        carry = () if kind == "prefill" else (NamedSharding(self.mesh, P()),)   # chained calls' inputs
        jitted = jax.jit(fn, donate_argnums=(1,), out_shardings=(self.pool_shardings, host, *carry))
        return jitted.lower(*self._abstract_inputs(kind, b, t))

    def _compile(self, kind: str, b: int, t: int, lowered=None):
        """The executable of one bucket, compiled (from ``lowered`` when given) on first use."""
        key = (kind, b, t)
        if key not in self._compiled:
            t0 = time.perf_counter()
            exe = (lowered or self._lower(kind, b, t)).compile()
            dt = time.perf_counter() - t0
            with self._compile_lock:
                self._compiled[key] = exe
                self.compile_seconds += dt
            log.info("compiled %s B=%d T=%d in %.2fs", kind, b, t, dt)
        return self._compiled[key]

    def zero_slots(self, slots: list[int]) -> None:
        """Zeroes the given state slots in every slot pool. The slot list is padded to a fixed
        length with the dummy slot 0, so this compiles once."""
        if not slots:
            return
        padded = np.zeros((self.cfg.max_num_seqs + 1,), np.int32)
        padded[: len(slots)] = slots
        self.pools = zero_slots(self.pools, self.layout, padded)

    def warmup(self) -> list[tuple[str, int, int, float]]:
        """Compiles every bucket; returns (kind, B, T, seconds) per program.

        Programs are traced one after another, then compiled by up to ``WARMUP_THREADS``
        threads at once (XLA compiles outside the GIL): the demo model's 15 programs take ~76 s on
        2 CPU cores. Each decode bucket has one program per ``decode_programs`` and
        ``decode_step_counts``."""
        report = []
        if self.has_slots:
            t0 = time.perf_counter()
            self.zero_slots([0])
            report.append(("zero_slots", self.cfg.max_num_seqs + 1, 1, time.perf_counter() - t0))
        shapes = ([(kind, b, n) for b in self.buckets.decode for kind in self.decode_programs
                   for n in self.decode_step_counts]
                  + [("prefill", b, t) for b, t in self.buckets.prefill])
        lowered = [self._lower(*shape) for shape in shapes]

        def compile_one(item):
            shape, low = item
            t0 = time.perf_counter()
            self._compile(*shape, lowered=low)
            return (*shape, time.perf_counter() - t0)

        with ThreadPoolExecutor(max(1, min(WARMUP_THREADS, os.cpu_count() or 1))) as pool:
            report += list(pool.map(compile_one, zip(shapes, lowered)))
        return report

    # ---------------------------------------------------------------- execution
    def _page_table(self, rows_pages: list[list[int]], b: int) -> np.ndarray:
        table = np.zeros((b, self.max_pages_per_seq), np.int32)
        for i, pages in enumerate(rows_pages):
            table[i, : len(pages)] = pages
        return table

    @staticmethod
    def _sampling(rows, b: int) -> SamplingArrays:
        """The rows' sampling parameters (host arrays); padded rows are greedy."""
        return SamplingArrays.from_params([r.params for r in rows] + [None] * (b - len(rows)),
                                          [r.seed for r in rows] + [0] * (b - len(rows)), b)

    @staticmethod
    def _slots(rows, b: int) -> np.ndarray:
        slots = np.zeros((b,), np.int32)
        slots[: len(rows)] = [r.slot for r in rows]
        return slots

    def validate(self, rows: list[PrefillRow] | list[DecodeRow]) -> None:
        """Checks everything a step will address before the pools are donated (DESIGN rule 6):
        pages cover every position written, page and slot ids are in range and owned by one
        row each, and state slots are given when the model keeps per-sequence state. A
        rejected step raises StepError and leaves every pool exactly as it was."""
        if self.compile_only:
            raise RuntimeError("this runner is compile-only: its weights and pools are not on a device")
        problems, seen_pages, seen_slots = [], set(), set()
        if not rows or len(rows) > max(self.buckets.decode[-1], max(b for b, _ in self.buckets.prefill)):
            problems.append(f"a step needs 1..max_num_seqs rows, got {len(rows)}")
        for i, r in enumerate(rows):
            last = (r.start + len(r.tokens) if isinstance(r, PrefillRow) else r.position + r.budget) - 1
            if isinstance(r, PrefillRow) and not r.tokens:
                problems.append(f"row {i}: empty chunk")
            need = last // self.cfg.page_size + 1
            if len(r.pages) < need or need > self.max_pages_per_seq:
                problems.append(f"row {i}: positions up to {last} need {need} pages, it has {len(r.pages)} "
                                f"(at most {self.max_pages_per_seq})")
            bad = [p for p in r.pages if not 0 < p < self.num_pages or p in seen_pages]
            if bad:
                problems.append(f"row {i}: page ids {bad[:4]} are out of range, the dummy page, or shared")
            seen_pages.update(r.pages)
            if self.has_slots:
                if not 0 < r.slot <= self.cfg.max_num_seqs or r.slot in seen_slots:
                    problems.append(f"row {i}: state slot {r.slot} is missing, out of range or shared")
                seen_slots.add(r.slot)
        if problems:
            raise StepError("step rejected before touching the cache: " + "; ".join(problems))

    def prefill(self, rows: list[PrefillRow]) -> list[Sampled]:
        """Runs one chunk per row; returns each row's token sampled at its chunk end."""
        self.validate(rows)
        h0 = time.perf_counter()
        t = self.buckets.prefill_tokens(max(len(r.tokens) for r in rows))
        b = self.buckets.prefill_batch(len(rows), t)
        tokens = np.zeros((b, t), np.int32)
        positions = np.zeros((b, t), np.int32)
        valid = np.zeros((b, t), bool)
        kv_lens = np.zeros((b,), np.int32)
        last = np.zeros((b,), np.int32)
        tidx = np.zeros((b,), np.int32)
        for i, r in enumerate(rows):
            n = len(r.tokens)
            tokens[i, :n] = r.tokens
            positions[i, :n] = np.arange(r.start, r.start + n)
            valid[i, :n] = True
            kv_lens[i] = r.start + n
            last[i] = n - 1
            tidx[i] = r.token_index
        fn = self._compile("prefill", b, t)
        packed = row_layout("prefill", t, self.max_pages_per_seq).pack(b, dict(
            tokens=tokens, positions=positions, valid=valid, page_table=self._page_table([r.pages for r in rows], b),
            kv_lens=kv_lens, slots=self._slots(rows, b), last_idx=last, token_index=tidx,
            **vars(self._sampling(rows, b))))
        h1 = time.perf_counter()
        self.pools, out = fn(self.weights, self.pools, packed)
        nxt, lp, top_ids, top_lp = jax.device_get(out)
        h2 = time.perf_counter()
        res = [Sampled([int(nxt[i])], [float(lp[i])], [top_ids[i].tolist()], [top_lp[i].tolist()])
               for i in range(len(rows))]
        self._account(h1 - h0 + time.perf_counter() - h2)
        return res

    def decode(self, rows: list[DecodeRow]) -> list[Sampled]:
        """Runs up to ``decode_steps`` tokens per row in one device call."""
        return self.decode_start(rows).result()

    def decode_start(self, rows: list[DecodeRow], after: PendingDecode | None = None) -> PendingDecode:
        """Dispatches a decode call without waiting for it. With ``after`` (a call still in flight
        or done), a row whose ``token`` is None continues row ``follows`` of ``after`` (default: its
        own index) on the device: it takes the last token that row sampled and runs only if that
        row ran its whole budget without a stop id; the caller gives it the position, token index
        and pages that follow from that budget, and takes ``after``'s tokens as they are. Such a
        call keeps ``after``'s batch bucket (the device reads ``after``'s rows by index)."""
        self.validate(rows)
        h0 = time.perf_counter()
        follows = np.array([-1 if r.token is not None else i if r.follows is None else r.follows
                            for i, r in enumerate(rows)], np.int32)
        ahead = np.array([r.token is None for r in rows])
        chained = bool(ahead.any())
        if chained and (after is None or follows[ahead].min() < 0 or follows.max() >= after.num_rows
                        or len(rows) > after.batch):
            raise StepError("a row without a token continues a row of `after`: give `after` and a row index "
                            "below its number of rows")
        b = after.batch if chained else self.buckets.decode_batch(len(rows))
        tokens = np.zeros((b,), np.int32)
        positions = np.zeros((b,), np.int32)
        active = np.zeros((b,), bool)
        budget = np.zeros((b,), np.int32)
        stop = np.full((b, MAX_STOP_IDS), -1, np.int32)
        tidx = np.zeros((b,), np.int32)
        for i, r in enumerate(rows):
            tokens[i], positions[i], active[i], budget[i], tidx[i] = r.token or 0, r.position, True, r.budget, \
                r.token_index
            stop[i, : len(r.stop_ids)] = r.stop_ids
        sa = self._sampling(rows, b)
        mode = draw_mode(sa)                # its program without sampler branches, where there is one
        kind = next((k for k, m in DRAW_PROGRAMS.items() if m == mode and k in self.decode_programs), "decode")
        need = max(r.budget for r in rows)
        steps = next((n for n in self.decode_step_counts if n >= need), self.decode_step_counts[-1])
        fn = self._compile(kind, b, steps)
        packed = row_layout("decode", steps, self.max_pages_per_seq).pack(b, dict(
            tokens=tokens, follows=np.concatenate([follows, np.full((b - len(rows),), -1, np.int32)]),
            positions=positions,
            page_table=self._page_table([r.pages for r in rows], b), slots=self._slots(rows, b), active=active,
            budget=budget, stop_ids=stop, token_index=tidx, **vars(sa)))
        prev = after.carry if chained else self._no_carry(b)
        h1 = time.perf_counter()
        self.pools, out, carry = fn(self.weights, self.pools, packed, *prev)
        return PendingDecode(self, len(rows), b, out, carry, h1 - h0)

    def _no_carry(self, b: int) -> tuple[jax.Array, jax.Array]:
        """The ``prev_tokens`` / ``prev_alive`` of a call that follows none (kept on the device)."""
        if b not in self._no_carry_cache:
            rep = NamedSharding(self.mesh, P())
            self._no_carry_cache[b] = (jax.device_put(np.zeros((b,), np.int32), rep),
                                       jax.device_put(np.zeros((b,), bool), rep))
        return self._no_carry_cache[b]

    def _account(self, host_s: float) -> None:
        self.host_seconds += host_s
        self.device_calls += 1
