"""The acceptance counts of tree="auto" (stree.decoding.acceptance): what verified steps teach
the batch's and each row's counts, the hazards against their formulas, and each node's chance
against its definition."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from stree.decoding.acceptance import PathRates, RowRates, chances, rank_depth
from stree.tree import TokenTree


def tree_of(parents, tokens, valid=None):
    t = torch.tensor
    return TokenTree(t(parents), t(tokens), None if valid is None else t(valid))


def test_rates_count_what_the_verifier_did():
    """Root -> 1 (rank 0), 2 (rank 1), 4 (rank 2, invalid); 1 -> 3. Row 0 accepted node 2, row 1
    nodes 1 and 3, row 2 nothing."""
    parents = [-1, 0, 0, 1, 0]
    tokens = [[9, 10, 11, 12, 13]] * 3
    valid = [[True, True, True, True, False]] * 3
    tree = tree_of(parents, tokens, valid)
    rates = PathRates(decay=1.0)
    emitted = np.array([[11, 7, 0], [10, 12, 5], [4, 0, 0]])
    rates.record(tree, emitted, np.array([2, 3, 1]), np.arange(3))
    acc, reached = rates.accepted, rates.reached
    assert (reached[1, 0], acc[1, 0]) == (3, 1)  # node 1: reached by every row, accepted by row 1
    assert (reached[1, 1], acc[1, 1]) == (2, 1)  # node 2: rows 0 and 2 got there, row 0 took it
    assert (reached[2, 0], acc[2, 0]) == (1, 1)  # node 3 below row 1's accepted node 1
    assert reached[1, 2] == 0 and reached.sum() == 6  # the invalid node is never counted
    rates.record(tree, emitted, np.array([2, 3, 1]), np.array([2]))  # one row only; the others ride along
    assert reached.sum() == 8 and acc.sum() == 3


def test_kept_hazards_follow_every_record():
    """The hazards are kept between records (a step weighs them several times): after each
    record, the batch's and the rows' own are those their counts give, never the last ones."""
    rates, rows = PathRates(decay=0.9), RowRates(0.9)
    tree = tree_of([-1, 0, 0, 1], [[3, 4, 5, 6], [3, 4, 5, 6]])
    ids = np.array([0, 3])
    steps = [([[4, 6, 1], [5, 0, 0]], [3, 2]), ([[7, 0, 0], [4, 6, 2]], [1, 3]), ([[4, 1, 0], [4, 6, 9]], [2, 3])]
    for emitted, counts in steps:
        before = rates.hazard(), rows.hazard(ids, rates.hazard())
        rates.record(tree, np.array(emitted), np.array(counts), np.arange(2), rows, ids)
        batch, w = rates.hazard(), rates.weight
        by_rank = (rates.accepted.sum(0) + w * rates.prior) / (rates.reached.sum(0) + w)
        assert np.array_equal(batch, (rates.accepted + w * by_rank) / (rates.reached + w))
        own = rows.hazard(ids, batch)
        assert np.array_equal(own[1], (rows.accepted[3] + rows.weight * batch) / (rows.reached[3] + rows.weight))
        assert not np.array_equal(batch, before[0]) and not np.array_equal(own, before[1])
        assert rates.hazard() is batch and rows.hazard(ids, batch) is own  # (kept until the next record)
    rows.fade(4)  # the rows' own counts fade, the batch's stay
    faded = rows.hazard(ids, batch)
    assert np.array_equal(faded[1], (rows.accepted[3] + rows.weight * batch) / (rows.reached[3] + rows.weight))
    assert not np.array_equal(faded, own)
    assert rows.hazard(np.array([3, 0]), batch)[0] is not faded[1]  # other rows: their own answer


def test_positional_chances_are_kept_per_version_and_follow_every_record():
    """The positional chances (what best-first plans grow from; a drafter model's choice plans once
    per depth cap) are made once per version of the counts, read-only, and made again after a
    record, by their formula."""
    rates = PathRates(decay=0.9)
    first = rates.positional()
    assert rates.positional() is first and not first.flags.writeable
    rates.record(tree_of([-1, 0, 0], [[3, 4, 5]]), np.array([[5, 1]]), np.array([2]), np.arange(1))
    again = rates.positional()
    h = rates.hazard()
    alive = np.cumprod(np.concatenate([np.ones((h.shape[0], 1)), 1 - h[:, :-1]], 1), 1)
    assert again is not first and not np.array_equal(again, first)
    np.testing.assert_array_equal(again, np.minimum.accumulate(h * alive, axis=1))


def test_rates_fade_and_lean_on_the_prior():
    rates = PathRates(decay=0.5)
    h0 = rates.hazard()
    assert h0[1, 0] == pytest.approx(PathRates.PRIOR[0]) and h0[5, 3] == pytest.approx(PathRates.PRIOR[3])
    tree = tree_of([-1, 0], [[3, 4]])
    for _ in range(30):  # the child is rejected every step
        rates.record(tree, np.array([[5]]), np.array([1]), np.arange(1))
    assert rates.reached[1, 0] == pytest.approx(2.0, rel=1e-6)  # 1 + 1/2 + 1/4 + ...
    assert rates.hazard()[1, 0] < 0.25 < rates.hazard()[1, 1]
    pos = rates.positional()
    assert np.all(np.diff(pos, axis=1) <= 1e-12)  # non-increasing in rank


def path_chance(parents, valid, h, c):
    """A node's chance by the definition: its parent's, times the misses of its valid earlier
    siblings, times its own hazard, never above its latest valid earlier sibling's chance."""
    if c == 0:
        return 1.0
    p = parents[c]
    if not valid[c] or path_chance(parents, valid, h, p) == 0.0:
        return 0.0
    sibs = [s for s in range(1, len(parents)) if parents[s] == p]

    def hz(s):
        depth, v = 0, s
        while v > 0:
            v, depth = parents[v], depth + 1
        return h[min(depth, h.shape[0] - 1), min(sibs.index(s), h.shape[1] - 1)]
    before = [s for s in sibs[: sibs.index(c)] if valid[s]]
    raw = path_chance(parents, valid, h, p) * np.prod([1 - hz(s) for s in before]) * hz(c)
    return min(raw, path_chance(parents, valid, h, before[-1])) if before else raw


@st.composite
def trees_with_hazards(draw):
    n = draw(st.integers(1, 12))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    valid = [True] + [draw(st.booleans()) for _ in range(n - 1)]
    h = np.array(draw(st.lists(st.floats(0.01, 0.99), min_size=4 * 3, max_size=4 * 3))).reshape(4, 3)
    return parents, valid, h


@given(trees_with_hazards())
def test_chances_follow_the_definition(case):
    parents, valid, h = case
    p = np.array([parents], dtype=np.int64)
    rank, depth = rank_depth(p)
    got = chances(p, rank, depth, np.array([valid]), h[None])[0]
    want = [1.0] + [path_chance(parents, valid, h, c) for c in range(1, len(parents))]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


@given(st.lists(st.floats(0, 30), min_size=2 * 17 * 8, max_size=2 * 17 * 8), st.floats(0.5, 4),
       st.lists(st.integers(0, 3), min_size=1, max_size=4))
def test_the_hazards_follow_their_formulas(counts, weight, ids):
    """PathRates' hazards (each depth's rate leaning on its rank's over all depths, which leans on
    the prior) and RowRates' (each row's leaning on the batch's; the batch's alone for a row it
    has no counts for) against their formulas."""
    counts = np.array(counts).reshape(2, 17, 8)
    rates = PathRates(weight=weight)
    rates.accepted, rates.reached = np.minimum(counts[0], counts[1]), counts[1]
    rates.version += 1
    w = weight
    by_rank = (rates.accepted.sum(0) + w * rates.prior) / (rates.reached.sum(0) + w)
    batch = rates.hazard()
    np.testing.assert_allclose(batch, (rates.accepted + w * by_rank) / (rates.reached + w), rtol=1e-12)
    rows = RowRates(0.9, weight=w)
    rows.fade(2)
    rows.accepted, rows.reached = np.stack([rates.accepted, rates.accepted / 2]), np.stack([rates.reached] * 2)
    got = rows.hazard(np.array(ids), batch)
    for i, r in enumerate(ids):
        want = batch if r >= 2 else (rows.accepted[r] + w * batch) / (rows.reached[r] + w)
        np.testing.assert_allclose(got[i], want, rtol=1e-12)
