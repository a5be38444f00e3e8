"""The on-device sampler against its definition on small, hand-checkable distributions."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kk_jax.engine.request import SamplingParams
from kk_jax.engine.sampler import DRAW, DRAW_FILTERED, GREEDY, SamplingArrays, _filter_by_radix, _filter_by_sort, draw_mode, sample

LOGITS = jnp.log(jnp.array([[0.5, 0.25, 0.15, 0.1]], jnp.float32))


def draw(params: SamplingParams, n=400, logits=LOGITS):
    sa = SamplingArrays.from_params([params] * n, [params.seed or 0] * n, n)
    fn = jax.jit(lambda lg, sa, idx: sample(lg, sa, idx)[0])
    return np.asarray(fn(jnp.repeat(logits, n, 0), sa, jnp.arange(n, dtype=jnp.int32)))


def test_greedy_picks_argmax():
    assert (draw(SamplingParams(temperature=0.0)) == 0).all()


def test_temperature_one_follows_the_distribution():
    counts = np.bincount(draw(SamplingParams(temperature=1.0, seed=3), n=4000), minlength=4) / 4000
    np.testing.assert_allclose(counts, [0.5, 0.25, 0.15, 0.1], atol=0.03)


def test_top_k_top_p_min_p_restrict_the_support():
    assert set(draw(SamplingParams(temperature=1.0, top_k=2, seed=1))) == {0, 1}
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.7, seed=1))) == {0, 1}    # 0.5 + 0.25 >= 0.7
    assert set(draw(SamplingParams(temperature=1.0, min_p=0.4, seed=1))) == {0, 1}    # p >= 0.2
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.4, seed=1))) == {0}


def test_logprobs_are_of_the_unmodified_distribution():
    sa = SamplingArrays.from_params([SamplingParams(temperature=0.5, top_k=1, logprobs=4)], [0], 1)
    tok, lp, top_ids, top_lp = sample(LOGITS, sa, jnp.zeros((1,), jnp.int32))
    assert int(tok[0]) == 0
    np.testing.assert_allclose(float(lp[0]), np.log(0.5), rtol=1e-5)
    np.testing.assert_allclose(np.exp(np.asarray(top_lp[0])), [0.5, 0.25, 0.15, 0.1], rtol=1e-5)
    assert list(np.asarray(top_ids[0])) == [0, 1, 2, 3]


def test_samples_depend_on_seed_and_token_index_only():
    a = draw(SamplingParams(temperature=1.0, seed=5), n=64)
    b = draw(SamplingParams(temperature=1.0, seed=5), n=64)
    c = draw(SamplingParams(temperature=1.0, seed=6), n=64)
    assert (a == b).all() and (a != c).any()


def test_alternatives_are_computed_only_when_a_row_asks():
    logits = jnp.repeat(LOGITS, 2, 0)
    idx = jnp.zeros((2,), jnp.int32)
    off = SamplingArrays.from_params([SamplingParams(temperature=0.0)] * 2, [0, 0], 2)
    tok, lp, top_ids, top_lp = jax.jit(sample)(logits, off, idx)
    assert (np.asarray(top_ids) == 0).all() and (np.asarray(top_lp) == 0).all()
    np.testing.assert_allclose(np.asarray(lp), np.log(0.5), rtol=1e-5)     # the sampled logprob stays
    mixed = SamplingArrays.from_params([SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=2)],
                                       [0, 0], 2)
    _, _, top_ids, top_lp = jax.jit(sample)(logits, mixed, idx)
    assert list(np.asarray(top_ids[1])) == [0, 1, 2, 3]
    np.testing.assert_allclose(np.exp(np.asarray(top_lp[1])), [0.5, 0.25, 0.15, 0.1], rtol=1e-5)


def test_huge_temperature_is_clamped_not_overflowed():
    import warnings

    from kk_jax.engine.request import SamplingParams
    from kk_jax.engine.sampler import F32_MAX, SamplingArrays

    with warnings.catch_warnings():
        warnings.simplefilter("error")                       # no overflow in the float32 cast
        sa = SamplingArrays.from_params([SamplingParams(temperature=1e300)], [0], 1)
    assert float(sa.temperature[0]) == F32_MAX


def test_greedy_rows_next_to_sampled_rows_stay_greedy_and_rows_stay_independent():
    """A batch mixing greedy and sampled rows (with and without top-k) takes the sampling
    branches; greedy rows still pick the argmax, and a sampled row draws what it draws alone."""
    n = 64
    logits = jnp.repeat(LOGITS[:, ::-1], n, 0)                        # argmax is token 3
    idx = jnp.arange(n, dtype=jnp.int32)
    fn = jax.jit(lambda lg, sa, i: sample(lg, sa, i)[0])
    for hot in (SamplingParams(temperature=1.0, seed=9), SamplingParams(temperature=1.0, top_k=3, seed=9)):
        alone = np.asarray(fn(logits, SamplingArrays.from_params([hot] * n, [9] * n, n), idx))
        params = [hot if i % 2 else SamplingParams(temperature=0.0) for i in range(n)]
        mixed = np.asarray(fn(logits, SamplingArrays.from_params(params, [9] * n, n), idx))
        assert (mixed[0::2] == 3).all() and (mixed[1::2] == alone[1::2]).all()
        assert len(set(alone)) > 1 and (hot.top_k <= 0 or 0 not in set(alone))   # top-3 drops token 0


def test_chosen_logprob_is_log_softmax_of_the_chosen_token():
    logits = jax.random.normal(jax.random.key(0), (5, 1000), jnp.float32) * 4
    sa = SamplingArrays.from_params([SamplingParams(temperature=1.0, seed=2)] * 5, [2] * 5, 5)
    tok, lp, _, _ = jax.jit(sample)(logits, sa, jnp.arange(5, dtype=jnp.int32))
    want = jnp.take_along_axis(jax.jit(jax.nn.log_softmax)(logits), tok[:, None], axis=-1)[:, 0]
    np.testing.assert_allclose(np.asarray(lp), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_draw_mode_is_told_apart_on_the_host():
    def mode(*params):
        return draw_mode(SamplingArrays.from_params(list(params), [0] * len(params), len(params)))
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)
    assert mode(greedy, None, greedy) == GREEDY
    assert mode(greedy, hot) == DRAW
    assert mode(hot, SamplingParams(temperature=0.7, top_p=0.9)) == DRAW_FILTERED
    assert mode(hot, SamplingParams(temperature=0.5, top_k=5)) == DRAW_FILTERED
    assert mode(SamplingParams(temperature=0.5, min_p=0.1)) == DRAW_FILTERED
    assert mode(greedy, SamplingParams(temperature=0.0, top_p=0.5)) == GREEDY      # filters of a cold row
    assert mode(SamplingParams(temperature=1e-50)) == GREEDY                      # 0 in float32, as on the device
    assert mode(SamplingParams(temperature=0.7, top_p=1 - 1e-9)) == DRAW          # 1.0 in float32
    assert mode(SamplingParams(temperature=1e-40)) == GREEDY                      # subnormal: flushed to 0
    assert mode(SamplingParams(temperature=0.7, min_p=1e-40)) == DRAW
    assert mode(greedy, SamplingParams(temperature=0.0, logprobs=3)) is None
    assert mode(hot, SamplingParams(temperature=0.0, logprobs=1)) is None


@pytest.mark.parametrize("params", [
    [SamplingParams(temperature=0.0)] * 3,
    [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.0), SamplingParams(temperature=2.0)],
    [SamplingParams(temperature=0.8, top_p=0.7), SamplingParams(temperature=1.0, top_k=3),
     SamplingParams(temperature=0.0, min_p=0.2)],
])
def test_static_draw_has_no_branches_and_matches_the_branching_one(params):
    """A program drawn one known way is branch-free (XLA would copy a branch index to the host
    each step); the general one chooses with a switch and a cond. On a batch whose `draw_mode` is
    that way, both give the same outputs."""
    logits = jax.random.normal(jax.random.key(1), (3, 500), jnp.float32) * 3
    sa = SamplingArrays.from_params(params, [7, 8, 9], 3)
    idx = jnp.array([0, 4, 9], jnp.int32)
    mode = draw_mode(sa)
    outs = {}
    for m in (mode, None):
        fn = jax.jit(functools.partial(sample, mode=m))
        text = fn.lower(logits, sa, idx).as_text()
        assert text.count("stablehlo.case") + text.count("stablehlo.if") == (0 if m is not None else 2)
        outs[m] = [np.asarray(o) for o in fn(logits, sa, idx)]
    tokens, logprobs, top_ids, top_lp = outs[mode]
    np.testing.assert_array_equal(tokens, outs[None][0])
    np.testing.assert_array_equal(top_ids, outs[None][2])
    np.testing.assert_array_equal(top_lp, outs[None][3])
    # XLA may fuse the two programs' log-softmax reductions differently (on the H200: 2e-7 apart)
    np.testing.assert_allclose(logprobs, outs[None][1], rtol=1e-6)
    cold = [i for i, p in enumerate(params) if p.temperature == 0]
    np.testing.assert_array_equal(tokens[cold], np.argmax(np.asarray(logits), -1)[cold])


def _kept_by_definition(x: np.ndarray, top_p: float, top_k: int, min_p: float) -> np.ndarray:
    """float64 NumPy: which tokens of one row the filters keep (descending order, ties kept with
    their value; top_p 1 keeps everything)."""
    order = np.argsort(-x, kind="stable")
    vals = x[order]
    p = np.exp(vals - vals[0]) / np.exp(vals - vals[0]).sum()
    keep = np.ones(len(x), bool)
    if top_p < 1:
        keep &= (np.cumsum(p) - p) < top_p
    if top_k > 0:
        keep &= np.arange(len(x)) < top_k
    keep &= p >= min_p * p[0]
    keep[0] = True
    return x >= vals[keep].min()


@pytest.mark.parametrize("filter_fn", [_filter_by_radix, _filter_by_sort])
def test_filter_keeps_what_the_definitions_keep(filter_fn):
    """Both ways of filtering against sorting in float64, over random rows (every third rounded to
    integers: many ties at the thresholds) and every mix of the three filters."""
    rng = np.random.default_rng(0)
    for trial in range(12):
        b, v = 8, int(rng.integers(50, 3000))
        x = (rng.standard_normal((b, v)) * rng.uniform(0.5, 6)).astype(np.float32)
        if trial % 3 == 0:
            x = np.round(x)
        params = [SamplingParams(temperature=1.0, top_p=float(rng.choice([1.0, 0.99, 0.9, 0.5, 0.1])),
                                 top_k=int(rng.choice([0, 1, 5, 50, v + 10])), min_p=float(rng.choice([0.0, 0.05, 0.5])))
                  for _ in range(b)]
        sa = SamplingArrays.from_params(params, [0] * b, b)
        got = ~np.isinf(np.asarray(jax.jit(filter_fn)(jnp.asarray(x), sa)))
        for i, sp in enumerate(params):
            np.testing.assert_array_equal(got[i], _kept_by_definition(x[i].astype(np.float64), sp.top_p, sp.top_k,
                                                                      sp.min_p), err_msg=f"trial {trial} row {i} {sp}")


@pytest.mark.parametrize("filter_fn", [_filter_by_radix, _filter_by_sort])
def test_filter_keeps_ties_and_extreme_values(filter_fn):
    x = np.array([[3.0, 1.0, 3.0, -2.0, 3.0, -np.inf, 0.5]], np.float32)
    for top_p, top_k, kept in ((0.3, 0, [0, 2, 4]), (1.0, 2, [0, 2, 4]), (1.0, 4, [0, 1, 2, 4]), (1.0, 0, range(7))):
        sa = SamplingArrays.from_params([SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k)], [0], 1)
        got = np.nonzero(~np.isinf(np.asarray(filter_fn(jnp.asarray(x), sa)[0])))[0]
        want = [i for i in kept if i != 5]                       # -inf stays -inf
        assert list(got) == want, (top_p, top_k, got)
    zeros = np.array([[2.0, 0.0, -0.0, -1.0]], np.float32)      # -0.0 ties with +0.0
    sa = SamplingArrays.from_params([SamplingParams(temperature=1.0, top_k=2)], [0], 1)
    assert list(np.nonzero(~np.isinf(np.asarray(filter_fn(jnp.asarray(zeros), sa)[0])))[0]) == [0, 1, 2]
    nan = np.array([[1.0, np.nan, 3.0, 2.0]], np.float32)        # NaN is never above a number; its
    sa = SamplingArrays.from_params([SamplingParams(temperature=1.0, top_k=2)], [0], 1)   # NaN probabilities
    assert list(np.nonzero(np.asarray(filter_fn(jnp.asarray(nan), sa)[0]) > -np.inf)[0]) == [2]  # keep the top
