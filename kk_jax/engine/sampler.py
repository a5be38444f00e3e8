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
        # subnormal temperatures and min-p are 0: the device flushes them so, and `draw_mode` must
        # see what the device sees
        tiny = np.finfo(np.float32).tiny
        t[t < tiny], m[m < tiny] = 0.0, 0.0
        return SamplingArrays(t, k, p, m, s, lp)


RADIX_BITS = 4                            # bits of the threshold found per pass of `_filter_by_radix`
assert 32 % RADIX_BITS == 0
RADIX_MAX_ROWS = 16                       # `_filter`: batches of more rows sort


def _order_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 keys in the same order (negative floats' bits flipped, the sign bit set on
    the rest): thresholds on values become thresholds on integers, found bit by bit. -0.0 keys as
    +0.0 (equal values tie) and NaN as -inf (never above a number, as a comparison would have it)."""
    x = jnp.where(jnp.isnan(x), -jnp.inf, jnp.where(x == 0, 0.0, x))
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _largest_keys_holding(keys: jax.Array, weights: jax.Array, targets: jax.Array) -> jax.Array:
    """For each row b and search s, the largest uint32 t with sum(weights[s, b, keys[b] >= t]) >=
    targets[s, b] (0 when even t = 0 falls short): keys [B, V] u32, weights [S, B, V] f32, targets
    [S, B] -> [S, B] u32. A radix search from the top bit, RADIX_BITS a pass: each pass weighs the
    2^RADIX_BITS thresholds that extend the prefix found so far by one digit, in one reduction over
    V, and keeps the largest digit that still holds the target; no sort."""
    digits = jnp.arange(1 << RADIX_BITS, dtype=jnp.uint32)
    prefix = jnp.zeros(targets.shape, jnp.uint32)
    for shift in range(32 - RADIX_BITS, -1, -RADIX_BITS):
        cand = prefix[..., None] + (digits << shift)                                   # [S, B, D]
        held = jnp.sum(jnp.where(keys[None, :, None, :] >= cand[..., None], weights[:, :, None, :], 0.0),
                       axis=-1)                                                       # [S, B, D]
        fit = jnp.max(jnp.where(held >= targets[..., None], digits, 0), axis=-1)
        prefix = prefix + (fit << shift)
    return prefix


def _filter(scaled: jax.Array, sa: SamplingArrays) -> jax.Array:
    """Masks tokens outside top-k / top-p / min-p with -inf. scaled [B, V] fp32.

    In the order of descending value, top-p keeps a token while the probability before it is below
    top_p (top_p 1: every token), top-k the first k, min-p those with probability >= min_p times
    the largest; all keep the top token, and ties of a kept value stay with it. Batches of up to
    RADIX_MAX_ROWS rows find the thresholds without sorting the vocabulary (`_filter_by_radix`),
    larger ones sort it (`_filter_by_sort`): on the H200 the radix search made a sampled top-p decode
    step 2.8-3 % faster at 1 and 8 rows and 2.5 % slower at 64 (RESULTS.md, 2026-12-01 part 26)."""
    return (_filter_by_radix if scaled.shape[0] <= RADIX_MAX_ROWS else _filter_by_sort)(scaled, sa)


def _filter_by_sort(scaled: jax.Array, sa: SamplingArrays) -> jax.Array:
    """`_filter` by sorting each row."""
    vocab = scaled.shape[-1]
    vals = -jnp.sort(-scaled, axis=-1)                                   # [B, V] descending
    probs = jax.nn.softmax(vals, axis=-1)
    cum = jnp.cumsum(probs, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    # top_p 1 keeps all: in float32 the cumulative sum may reach 1.0 before the tail
    keep = ((cum - probs) < sa.top_p[:, None]) | (sa.top_p[:, None] >= 1.0)
    keep &= (sa.top_k[:, None] <= 0) | (rank < sa.top_k[:, None])
    keep &= probs >= sa.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)
    cutoff = jnp.min(jnp.where(keep, vals, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled >= cutoff, scaled, -jnp.inf)


def _filter_by_radix(scaled: jax.Array, sa: SamplingArrays) -> jax.Array:
    """`_filter` without a sort: the smallest value top-p keeps is the largest v with
    P(x >= v) >= top_p, the smallest top-k keeps the largest v with #(x >= v) >= k; both by
    `_largest_keys_holding` over order-preserving integer keys."""
    vocab = scaled.shape[-1]
    keys = _order_keys(scaled)
    probs = jax.nn.softmax(scaled, axis=-1)
    top_k = jnp.minimum(jnp.where(sa.top_k > 0, sa.top_k, 0), vocab).astype(jnp.float32)
    by_p, by_k = _largest_keys_holding(keys, jnp.stack([probs, jnp.ones_like(probs)]),
                                       jnp.stack([sa.top_p, top_k]))
    by_p = jnp.where(sa.top_p < 1.0, by_p, 0)
    by_k = jnp.where(top_k > 0, by_k, 0)
    by_min_p = jnp.min(jnp.where(probs >= sa.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True), keys,
                                 jnp.uint32(0xFFFFFFFF)), axis=-1)
    cutoff = jnp.minimum(jnp.maximum(jnp.maximum(by_p, by_k), by_min_p), jnp.max(keys, axis=-1))
    return jnp.where(keys >= cutoff[:, None], scaled, -jnp.inf)


GREEDY, DRAW, DRAW_FILTERED = 0, 1, 2     # how a batch's tokens are drawn (`sample`'s branches)


def _filtered_rows(sa: SamplingArrays):
    """Rows that sample with top-k / top-p / min-p: the one predicate of the host's `draw_mode`
    (NumPy arrays) and the device's branch (traced arrays)."""
    return (sa.temperature > 0) & ((sa.top_k > 0) | (sa.top_p < 1.0) | (sa.min_p > 0.0))


def draw_mode(sa: SamplingArrays) -> int | None:
    """The branch `sample` takes for this batch, decided on the host from the same float32 / int32
    arrays the device reads (subnormals already 0, so it is the device's choice): GREEDY when no
    row is hot, DRAW_FILTERED when a hot row has top-k / top-p / min-p, else DRAW. None when a row
    asks for alternatives (the top-20), which only the program with device-side branches computes."""
    if np.any(sa.top_logprobs > 0):
        return None
    hot = sa.temperature > 0
    if not hot.any():
        return GREEDY
    return DRAW_FILTERED if np.any(_filtered_rows(sa)) else DRAW


def sample(logits: jax.Array, sa: SamplingArrays, token_index: jax.Array, *, mode: int | None = None):
    """logits [B, V] fp32; token_index [B] (index of the token being generated per request).

    Returns tokens [B] i32, logprob [B] f32, top_ids [B, 20] i32, top_logprobs [B, 20] f32.

    ``mode`` (static, the host's `draw_mode`: GREEDY, DRAW or DRAW_FILTERED): the batch is drawn
    that way and its alternatives are zeros, with no device-side branch: XLA runs a branch by
    copying its index to the host and waiting (~30-70 us a step on the H200 at batch 1), which also
    makes the whole call synchronous. ``mode=None``: a `lax.switch` picks how to draw (every row
    greedy: no scaling or noise; sampling; sampling with top-k / top-p / min-p, `_filter`) and a
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
        branch = jnp.where(jnp.any(sa.temperature > 0),
                           jnp.where(jnp.any(_filtered_rows(sa)), DRAW_FILTERED, DRAW), GREEDY)
        tokens = jax.lax.switch(branch, branches, logits)
        top_ids, top_lp = jax.lax.cond(jnp.any(sa.top_logprobs > 0), top, no_top, logits)
    # the chosen token's log-softmax, as jax.nn.log_softmax computes it, without writing [B, V]
    peak = jnp.max(logits, axis=-1)
    log_total = jnp.log(jnp.sum(jnp.exp(logits - peak[:, None]), axis=-1))
    chosen = (jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - peak) - log_total
    return tokens, chosen, top_ids, top_lp
