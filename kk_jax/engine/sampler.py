"""On-device sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Runs inside the jitted step. A request's randomness depends only on its seed and the index
of the token being sampled, never on its batch row or neighbours, so sampled outputs are
reproducible under any batching. Logprobs are those of the unmodified model distribution
(vLLM's default).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kk_jax.engine.request import MAX_LOGPROBS, SamplingParams

F32_MAX = float(np.finfo(np.float32).max)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
    """Per-row sampling parameters [B]."""

    temperature: jax.Array   # f32, 0 = greedy
    top_k: jax.Array         # i32, <= 0 disables
    top_p: jax.Array         # f32
    min_p: jax.Array         # f32
    seed: jax.Array          # u32
    top_logprobs: jax.Array  # i32, alternatives requested (0 also when logprobs are off)

    @staticmethod
    def from_params(params: list[SamplingParams | None], seeds: list[int], rows: int) -> "SamplingArrays":
        """Host-side packing; padded rows (None) sample greedily."""
        t = np.zeros(rows, np.float32); k = np.zeros(rows, np.int32)
        p = np.ones(rows, np.float32); m = np.zeros(rows, np.float32); s = np.zeros(rows, np.uint32)
        lp = np.zeros(rows, np.int32)
        for i, (sp, seed) in enumerate(zip(params, seeds)):
            if sp is None:
                continue
            # a temperature beyond float32 samples as uniformly as the largest float32 one
            t[i], p[i], m[i], s[i] = min(sp.temperature, F32_MAX), sp.top_p, sp.min_p, seed % (1 << 32)
            k[i] = min(sp.top_k, np.iinfo(np.int32).max)        # top_k beyond the vocabulary = no top-k
            lp[i] = sp.logprobs or 0
        return SamplingArrays(t, k, p, m, s, lp)


def _filter(scaled: jax.Array, sa: SamplingArrays) -> jax.Array:
    """Masks tokens outside top-k / top-p / min-p with -inf. scaled [B, V] fp32."""
    vocab = scaled.shape[-1]
    vals = -jnp.sort(-scaled, axis=-1)                                   # [B, V] descending
    probs = jax.nn.softmax(vals, axis=-1)
    cum = jnp.cumsum(probs, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    keep = (cum - probs) < sa.top_p[:, None]
    keep &= (sa.top_k[:, None] <= 0) | (rank < sa.top_k[:, None])
    keep &= probs >= sa.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)
    cutoff = jnp.min(jnp.where(keep, vals, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled >= cutoff, scaled, -jnp.inf)


GREEDY, DRAW, DRAW_FILTERED = 0, 1, 2     # how a batch's tokens are drawn (`sample`'s branches)


def draw_mode(sa: SamplingArrays) -> int | None:
    """The branch `sample` takes for this batch, decided on the host from the same float32 / int32
    arrays the device reads (so it is the device's choice exactly): GREEDY when no row is hot,
    DRAW_FILTERED when a hot row has top-k / top-p / min-p, else DRAW. None when a row asks for
    alternatives (the top-20), which only the program with device-side branches computes."""
    if np.any(sa.top_logprobs > 0):
        return None
    hot = sa.temperature > 0
    if not hot.any():
        return GREEDY
    return DRAW_FILTERED if np.any(hot & ((sa.top_k > 0) | (sa.top_p < 1.0) | (sa.min_p > 0.0))) else DRAW


def sample(logits: jax.Array, sa: SamplingArrays, token_index: jax.Array, *, mode: int | None = None):
    """logits [B, V] fp32; token_index [B] (index of the token being generated per request).

    Returns tokens [B] i32, logprob [B] f32, top_ids [B, 20] i32, top_logprobs [B, 20] f32.

    ``mode`` (static, the host's `draw_mode`: GREEDY, DRAW or DRAW_FILTERED): the batch is drawn
    that way and its alternatives are zeros, with no device-side branch: XLA runs a branch by
    copying its index to the host and waiting (~30-70 us a step on the H200 at batch 1), which also
    makes the whole call synchronous. ``mode=None``: a `lax.switch` picks how to draw (every row
    greedy: no scaling or noise; sampling; sampling with top-k / top-p / min-p, a full sort) and a
    `lax.cond` whether to compute the top-20 (over a 152K vocabulary a full segmented sort on the
    GPU, ~1 ms per step at batch 64 on the H200, a tenth of the step). Both give the same outputs
    wherever ``mode`` is the batch's `draw_mode`.
    """
    logits = logits.astype(jnp.float32)
    n_top = min(MAX_LOGPROBS, logits.shape[-1])

    def argmax(logits):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw_rows(logits, filtered):
        temp = jnp.where(sa.temperature > 0, sa.temperature, 1.0)
        scaled = logits / temp[:, None]
        if filtered:
            scaled = _filter(scaled, sa)

        def draw(row_logits, seed, idx):
            key = jax.random.fold_in(jax.random.key(seed), idx)
            return jax.random.categorical(key, row_logits).astype(jnp.int32)

        drawn = jax.vmap(draw)(scaled, sa.seed, token_index)
        return jnp.where(sa.temperature > 0, drawn, argmax(logits))

    def no_top(logits):
        return (jnp.zeros(logits.shape[:-1] + (n_top,), jnp.int32),
                jnp.zeros(logits.shape[:-1] + (n_top,), logits.dtype))

    def top(logits):
        vals, ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), n_top)
        return ids.astype(jnp.int32), vals

    branches = [argmax, functools.partial(draw_rows, filtered=False), functools.partial(draw_rows, filtered=True)]
    if mode is not None:
        tokens, (top_ids, top_lp) = branches[mode](logits), no_top(logits)
    else:
        hot = sa.temperature > 0
        needs_filter = jnp.any(hot & ((sa.top_k > 0) | (sa.top_p < 1.0) | (sa.min_p > 0.0)))
        branch = jnp.where(jnp.any(hot), jnp.where(needs_filter, DRAW_FILTERED, DRAW), GREEDY)
        tokens = jax.lax.switch(branch, branches, logits)
        top_ids, top_lp = jax.lax.cond(jnp.any(sa.top_logprobs > 0), top, no_top, logits)
    # the chosen token's log-softmax, as jax.nn.log_softmax computes it, without writing [B, V]
    peak = jnp.max(logits, axis=-1)
    log_total = jnp.log(jnp.sum(jnp.exp(logits - peak[:, None]), axis=-1))
    chosen = (jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - peak) - log_total
    return tokens, chosen, top_ids, top_lp
