"""The trees of tree="auto" from acceptance chances (stree.decoding.plans): the best-first plan
against enumeration, the best size of a plan and the best prefix of a draft by tokens per
millisecond, and a draft weighed in one call against its steps apart."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from stree.decoding.acceptance import PathRates, chances, rank_depth
from stree.tree import TokenTree
from stree.decoding.plans import best_first, best_prefix, best_size, expected_accepted, rows_worth, weigh


@given(st.lists(st.floats(0.05, 0.95), min_size=9, max_size=9), st.integers(2, 30))
def test_best_first_takes_the_likeliest_nodes(hazards, nodes):
    """Against enumeration of every node of the 3-deep, 3-wide tree: the plan's chances sum to
    the largest sum any closed set of that many nodes has (the top values)."""
    rates = PathRates()
    h = np.zeros((rates.DEPTH + 1, rates.RANKS))
    h[1:4, :3] = np.array(hazards).reshape(3, 3)
    alive = np.cumprod(np.concatenate([np.ones((h.shape[0], 1)), 1 - h[:, :-1]], 1), 1)
    a = np.minimum.accumulate(h * alive, axis=1)
    a[4:] = 0.0  # nothing deeper than 3
    values = []
    for depth in (1, 2, 3):
        for ranks in itertools.product(range(3), repeat=depth):
            values.append(np.prod([a[d + 1, j] for d, j in enumerate(ranks)]))
    top = sorted(values, reverse=True)[: nodes - 1]
    parents = best_first(a, nodes)
    p = parents[None].astype(np.int64)
    rank, depth = rank_depth(p)
    got = [np.prod([a[depth[0, v], rank[0, v]] for v in path]) for path in _paths(parents[:len(top) + 1])]
    assert len(parents) == len(top) + 1
    assert sum(got) == pytest.approx(sum(top), rel=1e-9)
    assert all(parents[i] < i for i in range(1, len(parents)))


def _paths(parents):
    out = []
    for c in range(1, len(parents)):
        path, v = [], c
        while v > 0:
            path.append(v)
            v = parents[v]
        out.append(path)
    return out


@given(st.lists(st.lists(st.floats(0, 1), min_size=6, max_size=6), min_size=1, max_size=3),
       st.lists(st.floats(0.5, 20), min_size=6, max_size=6), st.booleans(), st.data())
def test_best_prefix_maximises_tokens_per_millisecond(chances, costs, allow_plain, data):
    """For the active rows' gain: of two rows their mean, of more their least (plans.rows_worth; the
    inactive rows' chances count for nothing)."""
    v = np.array(chances)
    v[:, 0] = 1.0
    cost = np.array([np.inf] + costs)
    active = np.array(data.draw(st.lists(st.booleans(), min_size=len(v), max_size=len(v))))
    active[data.draw(st.integers(0, len(v) - 1))] = True
    m = best_prefix(v, active, cost, allow_plain)
    def rate(k):
        gains = v[active, 1:k].sum(1)
        return (1 + (gains.mean() if len(gains) <= 2 else gains.min())) / cost[k] if k > 1 else 1 / cost[1]

    candidates = range(1 if allow_plain else 2, 7)
    assert rate(m) == pytest.approx(max(rate(k) for k in candidates), rel=1e-9)


def test_a_batch_weighs_two_rows_by_their_mean_and_more_by_their_least():
    assert rows_worth([3.0]) == 3.0 and rows_worth([3.0, 1.0]) == 2.0 and rows_worth([3.0, 1.0, 2.0]) == 1.0


@st.composite
def weighed_drafts(draw):
    """Rows of one draft (a shape of its own per row or one for all), the rows that count, the
    nodes weighed, the costs and their scales, whether a plain step may win, the gain scale, and
    hazards per row or one for all (each class's columns and the pooled ones)."""
    rows, n = draw(st.integers(1, 3)), draw(st.integers(2, 10))
    shapes = draw(st.integers(1, rows).filter(lambda k: k in (1, rows)))
    parents = np.array([[-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)] for _ in range(shapes)])
    valid = np.array([[True] + [draw(st.booleans()) for _ in range(n - 1)] for _ in range(rows)])
    weak = np.array([[False] + [draw(st.booleans()) for _ in range(n - 1)] for _ in range(rows)])
    active = np.array([draw(st.booleans()) for _ in range(rows)])
    active[draw(st.integers(0, rows - 1))] = True
    h = np.array(draw(st.lists(st.floats(0.01, 0.99), min_size=4 * 24, max_size=4 * 24)))
    hazards = np.stack([h.reshape(4, 24) ** (1 + r) for r in range(draw(st.sampled_from([1, rows])))])
    cost = np.array([np.inf] + draw(st.lists(st.floats(0.5, 20), min_size=n, max_size=n)))
    scales = (draw(st.floats(0.5, 2.0)), draw(st.floats(0.5, 20)))
    return (parents, valid, weak, active, hazards, draw(st.integers(2, n)), cost, scales, draw(st.booleans()),
            draw(st.floats(0.2, 2.0)))


@given(weighed_drafts())
def test_a_draft_weighed_in_one_call_is_its_steps_weighed_apart(case):
    """What AutoTree.choose reads off a draft's first k nodes (one compiled call) against its steps
    apart: whether an active row drafted anything there (else m is 0), the chances, the costs at
    the trees' scale (at 1 a plain step's), the best prefix by the chances times the gain scale,
    the active row gaining least (the first of equals), and what the prefix promises the active
    rows (unscaled: of two rows their mean, of more their least)."""
    parents, valid, weak, active, h, k, cost, (tree_scale, plain), allow_plain, gain = case
    rank, depth = rank_depth(parents)
    m, focus, promised, v, raw, weighed = weigh(parents, rank, depth, valid, weak, h, active, k, cost, tree_scale,
                                                plain, allow_plain, gain)
    if not valid[active, 1:k].any():
        assert m == 0
        return
    want_cost = cost[: k + 1] * tree_scale
    want_cost[1] = plain
    np.testing.assert_array_equal(weighed, want_cost)
    parents, rank, depth, valid = parents[:, :k], rank[:, :k], depth[:, :k], valid[:, :k]
    want_raw = chances(parents, rank, depth, np.ascontiguousarray(valid), np.ascontiguousarray(weak[:, :k]), h)
    np.testing.assert_array_equal(raw, want_raw)
    scaled = want_raw.copy()
    scaled[:, 1:] *= gain
    np.testing.assert_array_equal(v, scaled)
    assert m == best_prefix(scaled, active, want_cost, allow_plain)
    assert focus == np.flatnonzero(active)[int(np.argmin(want_raw[active, 1:].sum(1)))]
    want = want_raw[active, 1:m].sum(1)
    assert promised == pytest.approx(want.mean() if active.sum() <= 2 else want.min(), rel=1e-12, abs=1e-15)


@given(st.lists(st.floats(0, 1), min_size=1, max_size=15), st.floats(0.2, 2.0),
       st.lists(st.integers(2, 20), min_size=1, max_size=8, unique=True), st.lists(st.floats(0.5, 20), min_size=21,
                                                                                 max_size=21),
       st.floats(0.0, 3.0), st.floats(0.5, 2.0))
def test_best_size_maximises_tokens_per_millisecond_over_the_sizes_that_fit(chances, gain, sizes, costs, drafting,
                                                                            scale):
    """Before drafting, the size of a plan of n nodes (the drafts each prefix is expected to have
    accepted: cumulative chances) against its definition: among the allowed sizes up to n, the
    one with the most (1 + gain x expected) per millisecond of pass and drafting at the trees'
    scale, the smallest of near-equal rates; the smallest allowed size, at a rate of 0, where
    none fits."""
    expected = np.cumsum(chances)  # expected[m - 2]: a prefix of m nodes
    n = len(chances) + 1
    sizes = np.array(sorted(sizes), dtype=np.int64)
    cost = np.array([np.inf] + costs)
    draft = np.linspace(0.0, drafting, 21)
    got = best_size(expected, gain, sizes, cost, draft, scale, n)
    rate = lambda m: (1 + gain * expected[m - 2]) / ((cost[m] + draft[m]) * scale)  # noqa: E731
    fits = [int(m) for m in sizes if m <= n]
    if not fits:
        assert got[:2] == (sizes[0], 0.0)
        return
    top = max(rate(m) for m in fits)
    want = min(m for m in fits if rate(m) * (1 + 1e-9) >= top)
    assert got[0] == want or rate(int(got[0])) == pytest.approx(top, rel=1e-8)
    assert got[1] == pytest.approx(rate(int(got[0])), rel=1e-12)
    assert got[2] == pytest.approx(1 + gain * expected[int(got[0]) - 2], rel=1e-12)


@given(st.lists(st.integers(0, 30), min_size=1, max_size=12), st.lists(st.floats(0.01, 0.99), min_size=12, max_size=12))
def test_a_shapes_expected_drafts_are_its_chances_summed_prefix_by_prefix(picks, h):
    """What a plan's prefixes are expected to have accepted (before drafting, every node valid):
    the running sum of its nodes' chances past the root."""
    parents = np.array([[-1] + [p % i for i, p in enumerate(picks, 1)]])
    rank, depth = rank_depth(parents)
    hazard = np.array(h).reshape(4, 3)
    want = np.cumsum(chances(parents, rank, depth, np.ones(parents.shape, dtype=np.bool_),
                             np.zeros(parents.shape, dtype=np.bool_), hazard[None])[0, 1:])
    np.testing.assert_array_equal(expected_accepted(parents, rank, depth, hazard), want)


def test_a_plan_under_unchanged_rates_is_made_once(monkeypatch):
    """plan_shape keeps each rates' plans by size, chain and depth while the rates stay as they are (a
    call's choice plans at once from the rates the last call left): asked again, it caps nothing; once
    the rates learn from a step, asked again it plans afresh, and what it plans is what a fresh copy
    of those rates gives."""
    import stree.decoding.plans as plans

    rates = PathRates(prior=(0.9, 0.6, 0.4, 0.3, 0.2, 0.1, 0.05, 0.05))
    capped = []
    real = plans._capped
    monkeypatch.setattr(plans, "_capped", lambda *a: capped.append(a[1:]) or real(*a))
    first = plans.plan_shape(rates, 12)
    assert plans.plan_shape(rates, 12) is first and len(capped) == 1
    chain = plans.plan_shape(rates, 12, chain=True)
    assert chain.max_depth == 11 and len(capped) == 2  # (another chain, depth or size: its own)
    tree = TokenTree.from_shape(first, torch.zeros(1, first.n, dtype=torch.long))
    rates.record(tree, np.zeros((1, 1), dtype=np.int64), np.array([1]), np.arange(1))  # (nothing accepted)
    again = plans.plan_shape(rates, 12)
    assert len(capped) == 3
    fresh = PathRates(prior=rates.prior)
    fresh.accepted, fresh.reached, fresh.version = rates.accepted.copy(), rates.reached.copy(), 1
    assert again == plans.plan_shape(fresh, 12) and again != first
