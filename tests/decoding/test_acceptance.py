"""The acceptance counts of tree="auto" (stree.decoding.acceptance): what verified steps teach
the batch's and each row's counts, the hazards against their formulas, and each node's chance
against its definition."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from stree.decoding.acceptance import CLASSES, RANKS, WEAK_PRIOR, PathRates, RowRates, chances, pooled, rank_depth
from stree.tree import TokenTree


def tree_of(parents, tokens, valid=None, weak=None):
    t = torch.tensor
    return TokenTree(t(parents), t(tokens), None if valid is None else t(valid),
                     weak=None if weak is None else np.array(weak))


def with_pooled(counts):
    """Counts ``[..., D, CLASSES * RANKS]`` and, after them, each rank's over every class."""
    return np.concatenate([counts, counts.reshape(*counts.shape[:-1], CLASSES, RANKS).sum(-2)], -1)


def hazards_by_formula(rates):
    """Each column's rate at each depth leaning (``weight``) on its rate over all depths, which leans
    on its prior: a strong rank's, a weak one's at WEAK_PRIOR of it, the pooled columns the strong."""
    acc, reached, w = with_pooled(rates.accepted), with_pooled(rates.reached), rates.weight
    prior = np.concatenate([rates.prior, rates.prior * WEAK_PRIOR, rates.prior])
    by_rank = (acc.sum(0) + w * prior) / (reached.sum(0) + w)
    return (acc + w * by_rank) / (reached + w)


def row_hazards_by_formula(rows, row, batch):
    return (with_pooled(rows.accepted[row]) + rows.weight * batch) / (with_pooled(rows.reached[row]) + rows.weight)


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


def test_weak_nodes_are_counted_in_their_own_class_and_pooled_with_the_strong():
    """Root -> 1 (rank 0, weak), 2 (rank 1, strong); 1 -> 3 (weak). Row 0 accepts 1 then 3, row 1
    nothing. Weak nodes' counts land in the weak columns (RANKS + rank), the pooled hazards see
    both classes, and a tree without weak marks leaves the weak columns at their prior and the
    strong ones equal to the pooled."""
    tree = tree_of([-1, 0, 0, 1], [[9, 10, 11, 12]] * 2, weak=[[False, True, False, True]] * 2)
    rates = PathRates(decay=1.0)
    rates.record(tree, np.array([[10, 12, 5], [4, 0, 0]]), np.array([3, 1]), np.arange(2))
    acc, reached = rates.accepted, rates.reached
    assert (reached[1, RANKS], acc[1, RANKS]) == (2, 1)  # node 1: weak rank 0, reached by both, taken by row 0
    assert (reached[1, 1], acc[1, 1]) == (1, 0)  # node 2: strong rank 1, reached by row 1 alone
    assert (reached[2, RANKS], acc[2, RANKS]) == (1, 1)  # node 3: weak, below row 0's accepted node 1
    assert reached[:, :RANKS].sum() == 1 and reached.sum() == 4
    np.testing.assert_allclose(rates.hazard(), hazards_by_formula(rates), rtol=1e-12)
    plain = PathRates(decay=1.0)
    plain.record(tree_of([-1, 0, 0, 1], [[9, 10, 11, 12]] * 2), np.array([[10, 12, 5], [4, 0, 0]]), np.array([3, 1]),
                 np.arange(2))
    h = plain.hazard()
    np.testing.assert_array_equal(h[:, :RANKS], pooled(h))  # one class: the strong columns are the pooled
    np.testing.assert_allclose(h[:, RANKS: 2 * RANKS], np.broadcast_to(plain.prior * WEAK_PRIOR, (17, RANKS)))
    np.testing.assert_array_equal(pooled(h), pooled(rates.hazard()))  # the same counts, classes aside


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
        batch = rates.hazard()
        np.testing.assert_allclose(batch, hazards_by_formula(rates), rtol=1e-12)
        own = rows.hazard(ids, batch)
        np.testing.assert_allclose(own[1], row_hazards_by_formula(rows, 3, batch), rtol=1e-12)
        assert not np.array_equal(batch, before[0]) and not np.array_equal(own, before[1])
        assert rates.hazard() is batch and rows.hazard(ids, batch) is own  # (kept until the next record)
    rows.fade(4)  # the rows' own counts fade, the batch's stay
    faded = rows.hazard(ids, batch)
    np.testing.assert_allclose(faded[1], row_hazards_by_formula(rows, 3, batch), rtol=1e-12)
    assert not np.array_equal(faded, own)
    assert rows.hazard(np.array([3, 0]), batch)[0] is not faded[1]  # other rows: their own answer


def test_a_record_leaves_the_recorded_rows_own_hazards_made(monkeypatch):
    """PathRates.record makes the recorded rows' own hazards in its compiled call too (the choice
    after the next draft asks for them: one cold call fewer): RowRates.hazard answers for those
    rows without making them again, with what their counts give."""
    from stree.decoding import acceptance

    rates, rows = PathRates(decay=0.9), RowRates(0.9, weight=2.5)
    tree = tree_of([-1, 0, 0, 1], [[3, 4, 5, 6], [3, 4, 5, 6]])
    ids = [0, 3]
    rates.record(tree, np.array([[4, 6, 1], [5, 0, 0]]), np.array([3, 2]), np.arange(2), rows, ids)
    batch = rates.hazard()
    want = [row_hazards_by_formula(rows, r, batch) for r in ids]
    monkeypatch.setattr(acceptance, "_row_hazards", lambda *args: pytest.fail("the rows' hazards were made again"))
    own = rows.hazard(np.array(ids), batch)
    for i in range(len(ids)):
        np.testing.assert_allclose(own[i], want[i], rtol=1e-12)


def test_positional_chances_are_kept_per_version_and_follow_every_record():
    """The positional chances (what best-first plans grow from; a drafter model's choice plans once
    per depth cap) are made once per version of the counts, read-only, and made again after a
    record, by their formula."""
    rates = PathRates(decay=0.9)
    first = rates.positional()
    assert rates.positional() is first and not first.flags.writeable
    rates.record(tree_of([-1, 0, 0], [[3, 4, 5]]), np.array([[5, 1]]), np.array([2]), np.arange(1))
    again = rates.positional()
    h = pooled(rates.hazard())
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


def path_chance(parents, valid, weak, h, c):
    """A node's chance by the definition: its parent's, times the misses of its valid earlier
    siblings, times its own hazard (its class's column for its sibling rank, ranks past the last
    sharing it), never above its latest valid earlier sibling's chance."""
    if c == 0:
        return 1.0
    p = parents[c]
    if not valid[c] or path_chance(parents, valid, weak, h, p) == 0.0:
        return 0.0
    sibs = [s for s in range(1, len(parents)) if parents[s] == p]

    def hz(s):
        depth, v = 0, s
        while v > 0:
            v, depth = parents[v], depth + 1
        column = min(min(sibs.index(s), RANKS - 1) + RANKS * weak[s], h.shape[1] - 1)
        return h[min(depth, h.shape[0] - 1), column]
    before = [s for s in sibs[: sibs.index(c)] if valid[s]]
    raw = path_chance(parents, valid, weak, h, p) * np.prod([1 - hz(s) for s in before]) * hz(c)
    return min(raw, path_chance(parents, valid, weak, h, before[-1])) if before else raw


@st.composite
def trees_with_hazards(draw):
    """Up to 12 nodes (ranks past the last column's), weak or not, and the hazards of 4 depths:
    each class's columns and the pooled ones, or pooled ones of a few ranks (every node strong)."""
    n = draw(st.integers(1, 12))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    valid = [True] + [draw(st.booleans()) for _ in range(n - 1)]
    columns = draw(st.sampled_from([3, (CLASSES + 1) * RANKS]))
    weak = [False] + [columns > RANKS and draw(st.booleans()) for _ in range(n - 1)]
    h = np.array(draw(st.lists(st.floats(0.01, 0.99), min_size=4 * columns, max_size=4 * columns))).reshape(4, columns)
    return parents, valid, weak, h


@given(trees_with_hazards())
def test_chances_follow_the_definition(case):
    parents, valid, weak, h = case
    p = np.array([parents], dtype=np.int64)
    rank, depth = rank_depth(p)
    got = chances(p, rank, depth, np.array([valid]), np.array([weak]), h[None])[0]
    want = [1.0] + [path_chance(parents, valid, weak, h, c) for c in range(1, len(parents))]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)


@given(st.integers(0, 2**32 - 1), st.floats(0.5, 4), st.lists(st.integers(0, 3), min_size=1, max_size=4))
def test_the_hazards_follow_their_formulas(seed, weight, ids):
    """PathRates' hazards (each column's rate leaning on its rate over all depths, which leans on
    its prior; each class's and pooled) and RowRates' (each row's leaning on the batch's; the
    batch's alone for a row it has no counts for) against their formulas."""
    rng = np.random.default_rng(seed)
    counts = rng.uniform(0, 30, (2, 17, CLASSES * RANKS)) * (rng.random((2, 17, CLASSES * RANKS)) < 0.7)
    rates = PathRates(weight=weight)
    rates.accepted, rates.reached = np.minimum(counts[0], counts[1]), counts[1]
    rates.version += 1
    w = weight
    batch = rates.hazard()
    np.testing.assert_allclose(batch, hazards_by_formula(rates), rtol=1e-12)
    rows = RowRates(0.9, weight=w)
    rows.fade(2)
    rows.accepted, rows.reached = np.stack([rates.accepted, rates.accepted / 2]), np.stack([rates.reached] * 2)
    got = rows.hazard(np.array(ids), batch)
    for i, r in enumerate(ids):
        want = batch if r >= 2 else row_hazards_by_formula(rows, r, batch)
        np.testing.assert_allclose(got[i], want, rtol=1e-12)
