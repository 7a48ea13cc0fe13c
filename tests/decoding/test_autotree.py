"""tree="auto": the choice between trees and plain steps under made-up costs (its acceptance counts
and trees: test_acceptance.py, test_plans.py); and in the decoding loop, greedy identity for every
drafter, the exact sampling law while the choice switches sizes and falls back to plain steps,
explicit trees honoured exactly."""

import itertools
import subprocess
import sys
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from markov_law import sampled_under
from tiny_models import FAMILIES, mamba2

from stree.decoding.acceptance import PathRates, chances, shape_structure
from stree.decoding.autotree import AutoTree
from stree.decoding.plans import plan_shape
from stree.decoding.cost import CostProfile
from stree.drafters.registry import DRAFTER_NAMES, NEEDS_MODEL, make_drafter
from stree.decoding.loop import generate
from stree.sampling.verify import SamplingParams
from stree.tree import TokenTree, TreeShape

SEEDED_P = 1e-3


def tree_of(parents, tokens, valid=None):
    t = torch.tensor
    return TokenTree(t(parents), t(tokens), None if valid is None else t(valid))


# ---- the choice ---------------------------------------------------------------------------
def expensive():
    return CostProfile(1.0, (2, 4, 8, 16), (6.0, 6.5, 7.0, 8.0))


def cheap():
    return CostProfile(1.0, (2, 4, 8, 16), (1.05, 1.1, 1.2, 1.4))


def test_a_drafter_models_plan_is_cut_where_its_levels_cost_more_than_they_bring():
    """Likely nodes best first make a deep chain; a drafter model paying a step per level is
    better served by a bushier tree of fewer levels, which the plan then is, and each prefix's
    drafting is priced by its depth."""
    nodes, depths = (2, 4, 8, 16, 32, 64), (1, 3, 5, 6, 8, 10)
    profile = CostProfile(1.0, nodes, (1.1, 1.2, 1.3, 1.5, 2.0, 3.0), tuple(0.2 + 0.5 * d for d in depths), 0.01,
                          depths)
    rates = PathRates(prior=(0.85, 0.5, 0.4, 0.3, 0.2, 0.1, 0.08, 0.07))
    auto = AutoTree(profile, rates=rates)
    deep = plan_shape(rates, auto.max_nodes)
    assert auto._order.max_depth < deep.max_depth
    hazard = rates.hazard()
    assert auto._best_size(auto._order, auto._drafting(auto._order), hazard)[1] > \
        auto._best_size(deep, auto._drafting(deep), hazard)[1]
    assert auto.draft_cost[8] == pytest.approx(profile.drafting_ms(8, auto.prefix(8).max_depth))
    flat = AutoTree(CostProfile(1.0, nodes, profile.tree_ms, profile.draft_ms), rates=rates)  # drafting by nodes
    assert flat._order.parents == deep.parents


def full_draft(shape, fill=None):
    tokens = torch.arange(shape.n)[None] + 100
    valid = None if fill is None else (torch.arange(shape.n) < fill)[None]
    return TokenTree.from_shape(shape, tokens, valid=valid)


class Rejected(list):
    """The steps of :func:`run_rejecting` that verified a draft; ``lost``: what each of them lost
    by the clock against plain steps for the one token it emitted (its aftermath included), and
    ``probed``: whether it was a probe (else the choice took the tree for its worth)."""

    lost: list
    probed: list

    def probe_losses(self) -> list:
        return [x for x, probe in zip(self.lost, self.probed) if probe]


def run_rejecting(auto, steps, probe_ms=None, behind=None, after_ms=1.0) -> Rejected:
    """``steps`` steps in which the target never accepts a draft. With ``probe_ms`` (ms, or a
    function of the tree's size), the clock: plain steps take 1 ms (``after_ms`` the one right
    after a drafted step) and drafted ones ``probe_ms``; ``behind(i)``: what the drafter has yet
    to read at step i."""
    drafted = Rejected()
    drafted.lost, drafted.probed = [], []
    clock = probe_ms is not None
    after = False
    for i in range(steps):
        plan = auto.plan(None if behind is None else lambda: behind(i))
        draft = None
        probing = auto._probing
        if plan is not None:
            draft = auto.choose(full_draft(plan), np.ones(1, dtype=np.bool_))
            assert draft is not None or not probing  # a probe is verified whatever its worth
        if draft is None:
            plain_ms = (after_ms if after else 1.0) if clock else None
            if after and clock:
                drafted.lost[-1] += after_ms - 1.0
            auto.record(None, elapsed_ms=plain_ms)
            after = False
            continue
        ms = (probe_ms(draft.n) if callable(probe_ms) else probe_ms) if clock else None
        drafted.append(i)
        drafted.lost.append(ms - 1.0 if clock else 0.0)
        drafted.probed.append(probing)
        auto.record(draft, np.array([[999, 0]]), np.array([1]), np.arange(1), elapsed_ms=ms)
        after = True
    return drafted


def test_plain_steps_win_where_trees_cost_too_much_and_probes_follow_the_text():
    """Trees a fifth dearer than a step: once the verified steps show nothing is accepted, plain
    steps, with probes now and then (whatever the rates promise: a fresh call's are the prior's).
    A seeded choice reads no clock: it prices a probe as the profile predicts with its margin,
    which covers what the probes take here (the profile's times), so that together they lose at
    most PROBE_SHARE of the plain steps' time and one probe's loss, spaced evenly, at least PROBE
    plain steps apart."""
    profile = CostProfile(1.0, (2, 4, 8, 16), (1.2, 1.3, 1.5, 1.9))
    auto = AutoTree(profile)
    drafted = run_rejecting(auto, 3000, profile.iteration_ms)
    plain = auto.chosen[1]
    assert plain == 3000 - len(drafted) and len(drafted) >= 10
    assert sum(drafted.probe_losses()) <= AutoTree.PROBE_SHARE * plain * 1.0 + max(drafted.lost)
    gaps = np.diff(drafted).tolist()[2:]  # once the rates have learned that nothing is accepted
    assert min(gaps) > AutoTree.PROBE and max(gaps) <= 2 * min(gaps)


@pytest.mark.parametrize("adaptive", [False, True])
@given(probe=st.floats(1.0, 40.0), after=st.floats(0.5, 3.0), steps=st.integers(1, 3000))
def test_probes_never_lose_more_than_their_share(adaptive, probe, after, steps):
    """The ledger's promise, by the clock, whatever a probe takes and however much it slows the
    plain step after it (the adaptive choice learns both; a seeded one is let through at the
    profile's price, here what its probes take): what probes lose together is at most
    PROBE_SHARE of the plain steps' time, and one probe's loss (its first measurement may
    be clipped: two). (Trees the choice takes for their worth are not probes: the cost scales
    price them.)"""
    if not adaptive:
        probe, after = None, 1.0
    profile = CostProfile(1.0, (2, 4, 8, 16), (1.2, 1.3, 1.5, 1.9) if probe is None else (probe,) * 4)
    auto = AutoTree(profile, adaptive=adaptive)
    drafted = run_rejecting(auto, steps, profile.iteration_ms, after_ms=after)
    plain = steps - len(drafted)
    lost = drafted.probe_losses()
    assert sum(lost) <= AutoTree.PROBE_SHARE * plain * max(1.0, after) + 2 * max(lost, default=0.0) + 1e-9


class ProbesOnly(AutoTree):
    """A choice that takes no tree for its worth: every draft it verifies is a probe."""

    def _pick_sizes(self):
        return 1, super()._pick_sizes()[1]


def run_paying(auto, steps) -> int:
    """``steps`` steps in which a verified draft has three nodes of its first root path accepted,
    each taking what the profile says: a probe there gains the plain steps of the tokens it brings
    beyond its time. Returns the probes."""
    probes = 0
    for _ in range(steps):
        plan = auto.plan()
        draft = None if plan is None else auto.choose(full_draft(plan), np.ones(1, dtype=np.bool_))
        if draft is None:
            auto.record(None, elapsed_ms=1.0)
            continue
        parents, path = draft.static_shape.parents, [0]
        while len(path) < 4 and path[-1] in parents:
            path.append(parents.index(path[-1]))
        emitted = [100 + i for i in path[1:]] + [999]
        probes += 1
        auto.record(draft, np.array([emitted]), np.array([len(emitted)]), np.arange(1),
                    elapsed_ms=auto.profile.iteration_ms(draft.n))
    return probes


def test_what_probes_gained_buys_no_burst_of_probes_later():
    """Probes that pay put their gain in the ledger up to one probe's price only: after text where
    probes brought four tokens for a step and a half each, calls of the same profile (sharing its
    scales) on text where nothing is accepted still lose at most PROBE_SHARE of the plain steps'
    time to probes, and a probe or two (the average the first losing ones bring above zero). (Banked
    whole, the gains had funded a probe every PROBE plain steps in the calls after: n-gram at batch
    2, eager, a process's calls at 0.86-0.90 of plain decoding's pace.)"""
    profile = CostProfile(1.0, (2, 4, 8, 16), (1.5,) * 4)
    scale = {"plain": 1.0, "tree": 1.0}
    paying = ProbesOnly(profile, adaptive=True, scale=scale)
    assert run_paying(paying, 600) >= 20
    assert scale["bank"] <= paying._top() + 1e-9
    later = AutoTree(profile, adaptive=True, scale=scale)
    drafted = run_rejecting(later, 1000, profile.iteration_ms)
    lost = drafted.probe_losses()
    assert len(lost) >= 2
    assert sum(lost) <= AutoTree.PROBE_SHARE * later.chosen[1] + 3 * max(lost) + 1e-9


def test_a_share_of_zero_never_probes():
    class NoProbes(AutoTree):
        PROBE_SHARE = 0.0

    auto = NoProbes(expensive())
    drafted = run_rejecting(auto, 2000)
    assert not any(drafted.probed) and auto.chosen[1] >= 1990  # (the prior's rates draft a few first)
    assert auto.plain_ahead() == AutoTree.NEVER


def test_dear_probes_are_spaced_so_they_cost_a_small_share():
    """Trees at 6 steps: a probe loses ~5 steps against plain ones, so at most one in about
    5 / PROBE_SHARE steps."""
    auto = AutoTree(expensive())
    drafted = run_rejecting(auto, 400)
    assert len(drafted) <= 4 and all(b - a > 90 for a, b in zip(drafted, drafted[1:]))
    loss = sum(auto.cost[2] for _ in drafted)  # each probe's time, all of it beyond the plain steps
    assert loss <= 1.1 * AutoTree.PROBE_SHARE * auto.chosen[1] * auto.cost[1] + auto.cost[2]


def test_cheap_trees_are_drafted_and_cut_to_what_was_filled():
    auto = AutoTree(cheap())
    plan = auto.plan()
    assert plan is not None and plan.n >= 4
    cut = auto.choose(full_draft(plan, fill=2), np.ones(1, dtype=np.bool_))
    assert cut.n == 2 and cut.static_shape.parents == plan.parents[:2]  # the filled prefix only
    assert auto.choose(full_draft(plan, fill=1), np.ones(1, dtype=np.bool_)) is None  # nothing drafted


def train(auto, accept: bool, steps: int = 3 * AutoTree.REPLAN) -> AutoTree:
    """``steps`` steps in which the target accepts every draft's first-child path (or nothing)."""
    for _ in range(steps):
        plan = auto.plan()
        draft = None if plan is None else auto.choose(full_draft(plan), np.ones(1, dtype=np.bool_))
        if draft is None:
            auto.record(None)
            continue
        path, v = [], 0  # the first child all the way down
        kids = draft.static_shape.children()
        while kids[v]:
            v = kids[v][0]
            path.append(int(draft.tokens[0, v]))
        emitted = path + [0] if accept else [999]
        auto.record(draft, np.array([emitted]), np.array([len(emitted)]), np.arange(1))
    return auto


def test_rows_learn_their_own_rates_leaning_on_the_batchs():
    """Row ids 5 and 2 of a batch: 5 accepts its first child at every step, 2 nothing. Each
    row's hazard follows its own record; a row never seen has the batch's."""
    auto = AutoTree(cheap())
    shape = TreeShape.chain(1)
    draft = TokenTree.from_shape(shape, torch.tensor([[1, 10], [1, 10]]))
    for _ in range(20):
        auto.record(draft, np.array([[10, 0], [999, 0]]), np.array([2, 1]), np.arange(2), ids=np.array([5, 2]))
    batch = auto.rates.hazard()
    own = auto.row_rates.hazard(np.array([5, 2, 7]), batch)
    assert own[0, 1, 0] > batch[1, 0] > own[1, 1, 0] and own[0, 1, 0] > 0.8 and own[1, 1, 0] < 0.2
    np.testing.assert_array_equal(own[2], batch)  # id 7: nothing of its own yet
    assert auto.row_rates.reached[5, 1, 0] == pytest.approx(auto.row_rates.reached[2, 1, 0])
    assert auto.row_rates.reached[5, 1, 0] > 10


def test_weak_nodes_are_priced_by_their_own_rates():
    """Where strong drafts are always accepted and weak ones never (a drafter's one-token n-gram
    matches), the same draft is kept when its nodes are strong and declined when they are weak;
    a plan, drafted before its nodes' classes are known, is weighed by the classes pooled."""
    auto = AutoTree(CostProfile(1.0, (2, 4, 8, 16), (1.5, 1.7, 2.0, 2.6)))
    chain = TreeShape.chain(2)
    for _ in range(30):  # first node strong and taken, second weak and refused
        tree = TokenTree.from_arrays(chain, np.array([[1, 10, 11]]), weak=np.array([[False, False, True]]))
        auto.record(tree, np.array([[10, 999, 0]]), np.array([2]), np.arange(1))
    shape = auto.prefix(8)
    tokens = (np.arange(shape.n) + 100)[None]
    strong = TokenTree.from_arrays(shape, tokens, weak=np.zeros((1, shape.n), dtype=bool))
    weak = TokenTree.from_arrays(shape, tokens, weak=np.arange(shape.n)[None] > 0)
    assert auto.choose(strong, np.ones(1, dtype=np.bool_)) is not None
    assert auto.choose(weak, np.ones(1, dtype=np.bool_)) is None
    h = auto.rates.hazard()
    assert h[1, 0] > 0.8 and h[2, PathRates.RANKS] < 0.2  # the strong at depth 1, the weak at depth 2
    assert auto.rates.positional()[2, 0] == pytest.approx(h[2, -PathRates.RANKS])  # planned: pooled, the weak's here


def test_a_batch_choice_serves_the_row_that_finishes_last():
    """The batch decodes until its last row is done: a tree pays only if that row gains. Row 0
    accepts everything, row 1 nothing: trees for row 0's sake, plain steps for row 1's."""
    auto = AutoTree(CostProfile(1.0, (2, 4, 8, 16), (1.5, 1.7, 2.0, 2.6)))
    shape = auto.prefix(8)
    draft = TokenTree.from_shape(shape, torch.arange(16).reshape(2, 8) + 100)
    for _ in range(30):
        auto.record(TokenTree.from_shape(TreeShape.chain(1), torch.tensor([[1, 10], [1, 10]])),
                    np.array([[10, 0], [999, 0]]), np.array([2, 1]), np.arange(2), ids=np.array([0, 1]))
    assert auto.choose(draft, np.array([True, False]), np.array([0, 1])) is not None
    assert auto.choose(draft, np.array([False, True]), np.array([0, 1])) is None
    assert auto._focus == 1  # and the choice before drafting weighs that row's rates from now on
    assert auto._hazard()[1, 0] == pytest.approx(auto.row_rates.hazard(np.array([1]), auto.rates.hazard())[0, 1, 0])


def test_the_row_expected_to_finish_last_is_the_critical_one():
    from stree.decoding.loop import Rows

    rows = Rows([[1, 2], [3], [4, 5, 6]], [20, 20, 10], eos=[])
    rows.produced[:] = torch.tensor([10, 6, 2])
    rows.accepted = [[1] * 4, [0] * 5, [0] * 1]  # tokens per step so far: 2.5, 1.2, 2
    # tokens left over that rate: 10 / 2.5 = 4, 14 / 1.2 = 11.7, 8 / 2 = 4
    assert rows.critical([0, 1, 2]).tolist() == [False, True, False]
    assert rows.critical([0, 2]).tolist() == [True, True]  # level: the batch waits for both
    rows.accepted[2] = [0, 1]
    rows.produced[2] = 3  # 7 left at 1.5 a step: 4.7 steps, row 0's 4 within a step of it
    assert rows.critical([0, 2]).tolist() == [True, True]
    rows.produced[2] = 5  # 5 left at 2.5 a step: 2 steps, more than a step ahead of row 0
    assert rows.critical([0, 2]).tolist() == [True, False]


def test_rows_level_at_the_end_are_served_by_their_mean_gain():
    """Two rows the batch waits for alike, one accepting everything and one nothing: a tree is
    worth what it brings them on average (each row's expected progress: two level rows take
    turns being behind; a row that falls behind is then the only one the batch waits for,
    Rows.critical), and nothing where the row that gains nothing is that one. The row weighed
    before drafting is still the one gaining least. Of three such rows, the least: the slowest
    of several sets the batch's end."""
    auto = AutoTree(CostProfile(1.0, (2, 4, 8, 16), (1.1, 1.2, 1.4, 1.8)))
    shape = auto.prefix(8)
    draft = TokenTree.from_shape(shape, torch.arange(16).reshape(2, 8) + 100)
    for _ in range(30):  # row 0 accepts everything, row 1 nothing
        auto.record(TokenTree.from_shape(TreeShape.chain(1), torch.tensor([[1, 10], [1, 10]])),
                    np.array([[10, 0], [999, 0]]), np.array([2, 1]), np.arange(2), ids=np.array([0, 1]))
    ids = np.array([0, 1])
    assert auto.choose(draft, np.array([False, True]), ids) is None
    assert auto.choose(draft, np.array([True, False]), ids) is not None
    both = auto.choose(draft, np.array([True, True]), ids)
    assert both is not None and auto._focus == 1
    parents, rank, depth = shape_structure(both.static_shape)
    hazard = auto.row_rates.hazard(ids, auto.rates.hazard())
    strong = np.zeros((2, both.n), dtype=np.bool_)
    v = chances(parents, rank, depth, ~strong, strong, hazard)
    sums = v[:, 1:].sum(1)
    assert auto._promised[0] == pytest.approx(sums.mean()) and sums[1] < 0.2 * sums[0]
    three = TokenTree.from_shape(shape, torch.arange(24).reshape(3, 8) + 100)
    assert auto.choose(three, np.ones(3, dtype=np.bool_), np.array([0, 1, 0])) is None


def test_learned_rates_grow_the_tree_and_poor_ones_shrink_it():
    good, bad = train(AutoTree(cheap()), True), train(AutoTree(cheap()), False)
    assert good._pick > 4 and good._order.max_depth > 4
    assert bad._pick == 1 and bad.chosen[1] > 0


def test_fixed_sizes_keep_the_priors_plan_whatever_an_earlier_call_learned():
    """Compiled passes and CUDA graphs are built for the profile's shapes (prefixes of the prior's
    plan): a later call handed learned rates must not plan new shapes (compiled again inside
    decoding); an eager one re-plans from them."""
    learned = train(AutoTree(cheap()), True).rates
    prior = AutoTree(cheap(), sizes=(2, 4, 8))._order
    assert AutoTree(cheap(), sizes=(2, 4, 8), rates=learned)._order == prior
    assert AutoTree(cheap(), rates=learned)._order.parents[:8] != prior.parents


def test_fixed_sizes_only():
    auto = AutoTree(cheap(), sizes=(2, 4, 8))
    order = auto._order
    for fill in (2, 3, 5, 8):
        plan = auto.plan()
        got = auto.choose(full_draft(plan, fill=fill), np.ones(1, dtype=np.bool_))
        assert got is None or got.n in (2, 4, 8)
        auto.record(None)
    assert auto._order is order  # never re-planned: compiled passes and graphs keep their shapes


def test_chains_under_method_chain():
    shape = plan_shape(PathRates(), 9, chain=True)
    assert shape.parents == TreeShape.chain(8).parents


def test_adaptive_costs_follow_the_clock():
    class CostsOnly(AutoTree):
        GAIN_PRIOR = 1e12  # (what the trees bring is not calibrated here: the clock alone moves the choice)

    auto = CostsOnly(cheap(), adaptive=True)
    for _ in range(8 * AutoTree.REPLAN):  # every tree takes 10x what the profile says
        plan = auto.plan()
        draft = None if plan is None else auto.choose(full_draft(plan), np.ones(1, dtype=np.bool_))
        if draft is None:
            auto.record(None, elapsed_ms=1.0)
        else:
            auto.record(draft, np.array([[int(draft.tokens[0, 1]), 0]]), np.array([2]), np.arange(1),
                        elapsed_ms=10 * auto.cost[draft.n])
    assert auto.scale["tree"] > 2 and auto._pick == 1  # trees priced up until plain steps win
    fixed = AutoTree(cheap())  # not adaptive: the clock is ignored
    fixed.record(None, elapsed_ms=100.0)
    assert (fixed.scale["plain"], fixed.scale["tree"], fixed.scale["probe_loss"]) == (1.0, 1.0, 0.0)


class Steady(AutoTree):
    """The ledger at its whole share whatever probes lose (no ``BACKOFF``)."""

    BACKOFF = 0


def run_level_rows(auto, rows: int, steps: int, accept: float, seed: int = 0):
    """``steps`` steps of a batch of ``rows`` rows the batch waits for alike, each accepting its
    tree's first-child path node by node with chance ``accept``, independently (the rest of a
    draft never): the steps that verified a tree, and the least of the rows' tokens at each."""
    rng = np.random.default_rng(seed)
    trees, least = 0, []
    ids = np.arange(rows)
    for _ in range(steps):
        plan = auto.plan()
        draft = None
        if plan is not None:
            draft = auto.choose(TokenTree.from_shape(plan, torch.arange(plan.n).repeat(rows, 1) + 100),
                                np.ones(rows, dtype=np.bool_), ids)
        if draft is None:
            auto.record(None)
            continue
        kids = draft.static_shape.children()
        emitted = np.full((rows, draft.n + 1), 999)
        counts = np.ones(rows, dtype=np.int64)
        for b in range(rows):
            v = 0
            while kids[v] and rng.random() < accept:
                v = kids[v][0]
                emitted[b, counts[b] - 1] = int(draft.tokens[b, v])
                counts[b] += 1
        trees += 1
        least.append(int(counts.min()))
        auto.record(draft, emitted, counts, np.arange(rows), ids=ids)
    return trees, least


def test_what_trees_bring_the_rows_served_calibrates_the_promises():
    """Four rows the batch waits for alike, each accepting half of its drafts: a tree is worth
    the least of four draws, well short of the least of their expectations, which is what the
    rates promise. The choice learns the shortfall (gain_scale) and stops drafting trees that
    costs say would pay only at the promised worth; uncalibrated, it keeps drafting them. At
    batch 1, where the rates promise what trees bring, the scale stays near one, and so at batch 2,
    where a tree is worth the mean of the two rows (plans.rows_worth). (Both ledgers at
    their whole share: this compares what the two draft from what they learn, and the uncalibrated
    choice's probes, which lose on average here, would halve its share and leave it little to learn
    from.)"""
    profile = CostProfile(1.0, (2, 4, 8, 16), (1.05, 1.1, 1.2, 1.4))

    class Uncalibrated(Steady):
        GAIN_PRIOR = 1e12

    calibrated, raw = Steady(profile), Uncalibrated(profile)
    got = run_level_rows(calibrated, 4, 600, 0.5)[0], run_level_rows(raw, 4, 600, 0.5)[0]
    assert calibrated.gain_scale() < 0.75
    assert got[0] < 0.5 * got[1]
    single, pair = AutoTree(profile), Steady(profile)
    run_level_rows(single, 1, 600, 0.5)
    run_level_rows(pair, 2, 600, 0.5)
    assert 0.75 < single.gain_scale() < 1.33 and 0.75 < pair.gain_scale() < 1.33


def test_a_tree_that_loses_dearly_is_weighed_again_at_once():
    """A drafter model paying a step a level, after text it followed all the way (deep trees
    planned), meets text it never follows (a new prompt). A tree that brings nothing then loses
    more than ``DEAR`` plain steps' time (the deep ones several times that), and the next step's
    choice is weighed again at once: a few such trees before smaller trees or plain steps, not
    up to ``REPLAN`` of them drafted on what the old text taught."""
    nodes, depths = (2, 4, 8, 16), (1, 3, 7, 15)
    profile = CostProfile(1.0, nodes, (1.2, 1.4, 2.2, 3.0), tuple(0.3 * d for d in depths), 0.01, depths)
    dear, deepest = [], []
    for seed in range(6):
        auto = AutoTree(profile)
        run_level_rows(auto, 1, 60 + seed, 1.0)  # (the phase sets where the REPLAN period stands)
        sizes, lost = [], []  # each tree's loss against a plain step, as the choice prices it (scales 1)
        while not sizes or sizes[-1] > 1:
            plan = auto.plan()
            draft = None if plan is None else auto.choose(
                TokenTree.from_shape(plan, torch.arange(plan.n)[None] + 100), np.ones(1, dtype=np.bool_), np.arange(1))
            sizes.append(1 if draft is None else draft.n)
            if draft is None:
                auto.record(None)
            else:
                lost.append(auto.cost[draft.n] + auto.draft_cost[draft.n] - auto.cost[1])
                auto.record(draft, np.full((1, draft.n + 1), 999), np.ones(1, dtype=np.int64), np.arange(1),
                            ids=np.arange(1))
        deepest.append(max(sizes))
        dear.append(sum(x > AutoTree.DEAR * auto.cost[1] for x in lost))
    assert max(deepest) == 16  # the old text had taught deep trees
    assert max(dear) <= 3, dear


@pytest.mark.parametrize("fixed", [False, True])
def test_while_trees_win_an_eager_choice_weighs_its_sizes_every_replan_steps(monkeypatch, fixed):
    """After each tree the loop asks how many plain steps lie ahead: an eager choice whose trees
    win weighs its sizes again only every REPLAN steps (its choice after drafting weighs each draft
    under the rates of the moment), and once they stop paying goes plain at most REPLAN steps after
    a choice that weighs them after each tree; a choice of fixed sizes (compiled passes) weighs
    them after each tree."""
    def trained(weighed=None):
        auto = AutoTree(cheap(), sizes=(2, 4, 8, 16) if fixed else None,
                        rates=PathRates(prior=(0.9, 0.5, 0.4, 0.3, 0.2, 0.1, 0.08, 0.07)))
        if weighed is not None:
            real = auto._pick_sizes
            monkeypatch.setattr(auto, "_pick_sizes", lambda: weighed.append(1) or real())
        for _ in range(4 * AutoTree.REPLAN):  # the first child always accepted
            draft = auto.choose(full_draft(auto.plan()), np.ones(1, dtype=np.bool_))
            auto.record(draft, np.array([[int(draft.tokens[0, 1]), 7]]), np.array([2]), np.arange(1))
            assert auto.plain_ahead() == 0
        return auto

    def until_plain(auto, every_tree: bool) -> int:
        for step in range(200):  # nothing accepted any more
            plan = auto.plan()
            draft = None if plan is None else auto.choose(full_draft(plan), np.ones(1, dtype=np.bool_))
            if draft is None:
                return step
            auto.record(draft, np.array([[999]]), np.array([1]), np.arange(1))
            if every_tree and auto._stale:
                auto._replan(None)
            auto.plain_ahead()
        raise AssertionError("never went plain")

    weighed = []
    auto = trained(weighed)
    assert len(weighed) >= 4 * AutoTree.REPLAN if fixed else len(weighed) <= 5
    assert until_plain(auto, False) <= until_plain(trained(), True) + AutoTree.REPLAN


def test_a_calls_first_iteration_teaches_no_cost():
    """The first iteration of a call pays once per call (a drafter's prefill, first-use work): it
    must not move the scales the steady state is priced by."""
    auto = AutoTree(cheap(), adaptive=True)
    auto.plan()
    auto.record(None, elapsed_ms=50.0)
    assert auto.scale["plain"] == 1.0
    auto.plan()
    auto.record(None, elapsed_ms=2.0)
    assert auto.scale["plain"] == pytest.approx(1.0 + AutoTree.ADAPT)


def test_a_shapes_first_pass_in_the_process_teaches_no_cost(monkeypatch):
    """A shape's first tree in the process pays for what is made once per shape (the plan drafters
    fill it by, its index, its structure): neither it nor the plain steps in its wake move the
    scales; the same shape's next tree, and its wake, do. (A probe's time still goes to the
    probes' ledger: what exploring costs, first uses included.)"""
    import weakref
    from stree.decoding import autotree

    monkeypatch.setattr(autotree, "_PRICED", weakref.WeakSet(), raising=False)  # (a new process: no shape priced)
    auto = AutoTree(cheap(), adaptive=True, sizes=(2, 4, 8, 16))
    auto.plan()
    auto.record(None, elapsed_ms=auto.cost[1])  # (a call's first iteration teaches nothing anyway: SETTLE)
    draft = full_draft(TreeShape.chain(3))

    def tree_and_wake(times: float) -> None:
        """The tree at ``times`` its price, then AFTERMATH plain steps at ``times`` a plain step's."""
        auto._predicted = ("tree", auto.cost[draft.n])
        auto.record(draft, np.array([[100 + 1, 7]]), np.array([2]), np.arange(1), elapsed_ms=times * auto.cost[draft.n])
        for _ in range(AutoTree.AFTERMATH):
            auto.record(None, elapsed_ms=times * auto.cost[1])

    before = dict(auto.scale)
    tree_and_wake(3.0)
    assert (auto.scale["tree"], auto.scale["plain"]) == (before["tree"], before["plain"])
    tree_and_wake(3.0)
    assert auto.scale["tree"] > before["tree"] * (1.0 + AutoTree.ADAPT)  # the tree, its wake charged to it
    assert auto.scale["plain"] == before["plain"]  # (a tree's wake is the tree's, never the plain steps')
    auto._predicted = ("plain", auto.cost[1])  # (as plan() names a plain step)
    auto.record(None, elapsed_ms=3.0 * auto.cost[1])  # past the wake: a plain step's own
    assert auto.scale["plain"] > before["plain"]


def test_a_stale_plain_scale_is_weighed_again_while_trees_win():
    """Plain steps priced 3x too dear (one slow plain iteration had done it): trees win every
    step, so no plain step would ever correct the price; one step in PLAIN_EVERY is plain and
    weighed, and the price comes back to what the clock says."""
    auto = AutoTree(cheap(), adaptive=True, rates=PathRates(prior=(0.9, 0.5, 0.4, 0.3, 0.2, 0.1, 0.08, 0.07)),
                    scale={"plain": 3.0, "tree": 1.0})
    plain = []
    for i in range(768):
        plan = auto.plan()
        draft = None if plan is None else auto.choose(full_draft(plan), np.ones(1, dtype=np.bool_))
        if draft is None:
            plain.append(i)
            auto.record(None, elapsed_ms=auto.cost[1])
            continue
        auto.record(draft, np.array([[int(draft.tokens[0, 1]), 7]]), np.array([2]), np.arange(1),
                    elapsed_ms=auto.cost[draft.n])  # the first child accepted: 2 tokens at a tree's price
    assert auto.scale["plain"] < 1.5
    # about AFTERMATH + 1 in PLAIN_EVERY (the first few after a tree are its own), not plain decoding
    assert AutoTree.AFTERMATH + 1 <= len(plain) <= 2 * (AutoTree.AFTERMATH + 1) * 768 // AutoTree.PLAIN_EVERY


def test_plain_steps_right_after_trees_do_not_price_plain_decoding():
    """Trees of two nodes at 1.5 ms, their child accepted two steps in five: 1.4 tokens for 1.5
    ms, where a run of plain steps brings one token a millisecond. A plain step right after a tree
    takes 1.6 ms (what the tree pushed out of the caches), and while trees run those are the only
    plain steps there are: priced by them, trees look the better and run for good. They teach
    nothing, the plain step after them does, and the choice decodes plain."""
    profile = CostProfile(1.0, (2,), (1.5,))
    auto = AutoTree(profile, adaptive=True, sizes=(2,))
    after, late, trees = False, [], 0
    for i in range(3000):
        plan = auto.plan()
        draft = None if plan is None else auto.choose(full_draft(plan), np.ones(1, dtype=np.bool_))
        if draft is None:
            auto.record(None, elapsed_ms=1.6 if after else 1.0)
        else:
            hit, trees = trees % 5 < 2, trees + 1
            emitted = np.array([[int(draft.tokens[0, 1]) if hit else 999, 0]])
            auto.record(draft, emitted, np.array([2 if hit else 1]), np.arange(1), elapsed_ms=auto._predicted[1])
        after = draft is not None
        if i >= 2000:
            late.append(draft is None)
    assert auto.scale["plain"] < 1.1
    assert np.mean(late) > 0.9


def test_a_probe_is_worth_what_the_rows_it_served_got_on_average():
    """Two rows the batch waits for alike; a probe brings the row the choice weighed before
    drafting three tokens and the other one. The probe is worth two tokens, as trees are judged
    (gain_scale: each row's expected progress), and it paid against plain steps."""
    auto = AutoTree(cheap(), adaptive=True, sizes=(2, 4))
    auto.scale["bank"], auto._plain_run = 100.0, AutoTree.PROBE
    plan = auto.plan()
    assert auto._probing and plan is not None
    draft = TokenTree.from_shape(plan, torch.arange(plan.n).repeat(2, 1) + 100)
    cut = auto.choose(draft, np.ones(2, dtype=np.bool_), np.arange(2))
    assert cut is not None and auto._focus == 0
    plain = auto.cost[1] * auto.scale["plain"]
    auto.record(cut, np.zeros((2, 3), dtype=np.int64), np.array([3, 1]), np.arange(2), elapsed_ms=1.5 * plain,
                ids=np.arange(2))
    assert auto.scale["probe_loss"] == pytest.approx(-0.5 * plain)


def run_trees_with_wakes(auto, steps: int, hits: int, wake: list[float], runs: bool = False) -> list[bool]:
    """2-node trees at their predicted time, their child accepted ``hits`` steps in five, each
    followed by plain steps of ``wake`` ms (the drafter has nothing: one by one, or as one of the
    loop's runs with each step's time); other plain steps take 1 ms. Whether each step was plain."""
    trees, plain = 0, []
    for _ in range(steps):
        plan = auto.plan()
        draft = None if plan is None else auto.choose(full_draft(plan), np.ones(1, dtype=np.bool_))
        if draft is None:
            auto.record(None, elapsed_ms=1.0)
        else:
            hit, trees = trees % 5 < hits, trees + 1
            emitted = np.array([[int(draft.tokens[0, 1]) if hit else 999, 0]])
            auto.record(draft, emitted, np.array([2 if hit else 1]), np.arange(1), elapsed_ms=auto._predicted[1])
            if runs:
                auto.plain_steps(len(wake), wake)
            for ms in [] if runs else wake:
                auto.plan()
                auto.record(None, elapsed_ms=ms)
        plain.append(draft is None)
    return plain


def test_what_a_plain_step_right_after_a_tree_takes_beyond_its_own_is_the_trees():
    """Trees of two nodes at 1.5 ms, their child accepted three steps in five: 1.6 tokens for
    1.5 ms beat plain steps of 1 ms, and the choice drafts them. But each is followed by a plain
    step (a draft that came out empty, say) of 1.8 ms: what the tree pushed out of the caches.
    Charged to the tree, 1.6 tokens for 2.3 ms lose, and the choice decodes plain; the plain
    steps' price learns nothing from those steps."""
    auto = AutoTree(CostProfile(1.0, (2,), (1.5,)), adaptive=True, sizes=(2,))
    assert auto._pick == 2
    late = run_trees_with_wakes(auto, 400, 3, [1.8])[300:]
    assert auto.scale["tree"] > 1.3 and auto.scale["plain"] < 1.1
    assert np.mean(late) > 0.9


@pytest.mark.parametrize("runs", [False, True])
def test_the_plain_steps_in_a_trees_wake_are_charged_to_it(runs):
    """Trees of two nodes at 1.5 ms, their child accepted four steps in five: 1.8 tokens, and
    after each the drafter has nothing for three steps (plain steps). Those take 1.3, 1.25 and
    1.2 ms (what the pass pushed out of the caches, coming back), where plain steps in a row take
    1 ms: a tree and its wake bring 4.8 tokens in 5.25 ms, and lose. Charged for the first of
    those steps alone, the next two priced as plain steps, trees looked the better and ran; charged
    for all three, the choice decodes plain, and the plain steps' price is learned from the steps
    past them only. ``runs``: the plain steps come as the loop's runs (:meth:`AutoTree.plain_steps`
    with each step's time), else one by one."""
    auto = AutoTree(CostProfile(1.0, (2,), (1.5,)), adaptive=True, sizes=(2,))
    assert auto._pick == 2
    plain = run_trees_with_wakes(auto, 600, 4, [1.3, 1.25, 1.2], runs)
    assert not all(plain) and auto.scale["plain"] < 1.02
    assert np.mean(plain[400:]) > 0.9

def run_half_wanting(auto, steps: int, declined_ms: float) -> list[bool]:
    """Plain steps of 1 ms; every other draft comes out empty (found wanting: a plain step after
    drafting, ``declined_ms``), the others are 2-node trees of 1.5 ms whose child is always
    accepted. Whether each step drafted."""
    drafts, drafted = 0, []
    for _ in range(steps):
        plan = auto.plan()
        drafted.append(plan is not None)
        if plan is None:
            auto.record(None, elapsed_ms=1.0)
            continue
        drafts += 1
        draft = auto.choose(full_draft(plan, fill=1 if drafts % 2 else None), np.ones(1, dtype=np.bool_))
        if draft is None:
            auto.record(None, elapsed_ms=declined_ms)
        else:
            auto.record(draft, np.array([[int(draft.tokens[0, 1]), 7]]), np.array([2]), np.arange(1), elapsed_ms=1.5)
    return drafted


@pytest.mark.parametrize("declined_ms", [1.0, 2.0])
def test_declined_drafts_teach_their_own_price_not_the_plain_steps(declined_ms):
    """(:func:`run_half_wanting`) Where an empty draft costs no more than a plain step, drafting
    pays (1.5 tokens for 1.25 ms) and goes on. Where it takes 2 ms (drafting dear: a drafter
    catching up), drafting loses (1.5 tokens for 1.75 ms): learned into the plain steps' price,
    those 2 ms had made plain steps look dear and drafting went on; learned apart, the choice
    decodes plain, and a plain step keeps its price."""
    auto = AutoTree(CostProfile(1.0, (2,), (1.5,)), adaptive=True, sizes=(2,))
    late = run_half_wanting(auto, 600, declined_ms)[400:]
    assert auto.scale["plain"] < 1.1
    if declined_ms == 1.0:
        assert np.mean(late) > 0.9
    else:
        assert auto.scale["declined"] > 1.5 and np.mean(late) < 0.1


def test_the_share_of_drafts_verified_carries_over_calls():
    """An adaptive choice hands the share of its drafts verified on to the next call, as it does
    the rates: begun whole at each call, a call's first drafts were chosen as if none would be
    found wanting (compiled, batch 2: a share of 0.68 on average where drafting was chosen, 0.47
    verified). Where half the drafts are found wanting at 2 ms (:func:`run_half_wanting`), the
    next call decodes plain from its first step; with the share whole it would draft. A seeded
    choice starts whole (its choices follow the seed alone)."""
    profile = CostProfile(1.0, (2,), (1.5,))
    auto = AutoTree(profile, adaptive=True, sizes=(2,))
    run_half_wanting(auto, 600, 2.0)
    share = auto.scale["verified"]
    assert share < 0.75
    auto.scale["plain_run"] = 0  # (no probe due)
    after = AutoTree(profile, adaptive=True, sizes=(2,), rates=auto.rates, scale=auto.scale)
    assert after.scale["verified"] == share and after.plan() is None
    whole = AutoTree(profile, adaptive=True, sizes=(2,), rates=auto.rates, scale={**auto.scale, "verified": 1.0})
    assert whole.plan() is not None
    assert AutoTree(profile, sizes=(2,), rates=auto.rates).scale["verified"] == 1.0


def test_a_watched_draft_teaches_the_share_of_drafts_kept_as_the_choice_would_have_judged_it():
    """A watched draft is never verified, and what it teaches the share of drafts kept
    (``scale["verified"]``, which the choice before drafting weighs) is whether the choice would
    have kept it for the rows it served: a drafted chain of cheap trees raises a share that had
    fallen, the same chain where trees cost six steps lowers it, and a draft with nothing past its
    root (the drafter had nothing) teaches nothing. Unlearned, a share that had fallen (drafts
    found wanting for a stretch) kept the choice from drafting, and so from learning it again, until
    a draft was chosen: compiled, batch 1, STAND's choice stayed plain where its trees paid
    (docs/benchmarks.md, 2026-12-02, afternoon)."""
    after = [np.array([6, 1, 2])]
    kept, wanting = (cheap(), 0.2, None, AutoTree.ADAPT * 0.8), (expensive(), 0.8, None, -AutoTree.ADAPT * 0.8)
    empty = (cheap(), 0.8, [[True, False, False]], 0.0)
    for profile, share, valid, moved in (kept, wanting, empty):
        auto = AutoTree(profile, adaptive=True, watch=True)
        auto.scale["verified"] = share
        auto.watched(tree_of([-1, 0, 1], [[5, 6, 7]], valid), after, np.ones(1, dtype=bool), np.arange(1))
        assert auto.scale["verified"] == pytest.approx(share + moved)


def test_nothing_to_draft_counts_as_an_empty_draft_less_its_drafting_and_is_no_probe():
    """Where the drafter says before drafting that it has nothing to draft (``can_draft``), the
    loop calls ``undrafted`` and takes a plain step: for the choice, a draft found wanting, as an
    empty draft is (the share of drafts verified falls the same), priced by the clock among such
    iterations (here 0.8 ms against a plain step's 1 ms predicted, and no drafting: the
    ``declined`` scale falls); a probe that was due waits, its price still in the ledger, for the
    next step, which probes (a probe without a draft would have taught the ledger that probes
    cost nothing)."""
    told, drafted = (AutoTree(cheap(), adaptive=True) for _ in range(2))
    for auto in (told, drafted):
        auto._iterations = AutoTree.SETTLE + 1  # (past a call's first iterations, which teach no cost)
        plan = auto.plan()
        assert plan is not None and auto._predicted[0] == "plain"
    told.undrafted()
    assert drafted.choose(full_draft(plan, fill=1), np.ones(1, dtype=np.bool_)) is None
    assert told._predicted == drafted._predicted and told._predicted[0] == "declined"
    for auto in (told, drafted):
        auto.record(None, elapsed_ms=0.8)
    assert told.scale["verified"] == drafted.scale["verified"] < 1.0
    assert told.scale["declined"] < 1.0 and told.chosen[1] == 1

    dear = AutoTree(expensive(), adaptive=True)
    dear.scale["bank"], dear._plain_run = 100.0, AutoTree.PROBE
    assert dear.plan() is not None and dear._probing
    dear.undrafted()
    dear.record(None, elapsed_ms=1.0)
    assert dear.scale["probes"] == 0 and dear.scale["explored"] == 0 and dear.scale["bank"] == 100.0
    assert dear.scale["verified"] == 1.0
    assert dear.plan() is not None and dear._probing  # the probe, at the next step


def test_plain_runs_teach_the_machines_speed_and_trees_their_own_price():
    """A plain step 1 ms by the profile, 2-node trees bringing 1.95 tokens.

    Trees of 2.2 ms lose. The machine then slows by half (another process): a run of 30 plain
    steps takes 45 ms. That prices trees too, and plain steps still win (learned apart, trees not
    drafted meanwhile kept their old price, looked cheap, and ran where they lost).

    Trees of 1.5 ms win. A run of 30 plain steps in 18 ms (0.6 ms each) says the machine is
    faster, trees too: they still win. Trees that then take 1.5 ms by the clock all the same
    teach their own price, and within a few the choice decodes plain.

    A seeded choice (not adaptive), or a run without its time, teaches nothing."""
    rates = PathRates(prior=(0.95,) + PathRates.PRIOR[1:])
    slow = AutoTree(CostProfile(1.0, (2, 4), (2.2, 2.2)), adaptive=True, rates=rates, sizes=(2,))
    assert slow._pick == 1
    slow.plain_steps(30, [1.5] * 30)
    assert slow.scale["plain"] == pytest.approx(1.5, abs=0.01)
    assert slow.plain_ahead() > 0 and slow._pick == 1
    profile = CostProfile(1.0, (2, 4), (1.5, 1.5))
    for adaptive, ms in ((True, [0.6] * 30), (True, None), (False, [0.6] * 30)):
        auto = AutoTree(profile, adaptive=adaptive, rates=PathRates(prior=rates.prior), sizes=(2,))
        assert auto._pick == 2 and auto.plain_ahead() == 0  # trees win against the profile's plain step
        auto.plain_steps(30, ms)
        assert auto._pick == 2 and auto.plain_ahead() == 0
        if not adaptive or ms is None:
            assert auto.scale["plain"] == 1.0
            continue
        assert auto.scale["plain"] == pytest.approx(0.6, abs=0.01)
        trees = 0
        while trees < 20:
            plan = auto.plan()
            draft = None if plan is None else auto.choose(full_draft(plan), np.ones(1, dtype=np.bool_))
            if draft is None:
                break
            auto.record(draft, np.array([[int(draft.tokens[0, 1]), 0]]), np.array([2]), np.arange(1), elapsed_ms=1.5)
            trees += 1
        assert 2 <= trees < 20 and auto.scale["tree"] > 1.3


def run_loop_rejecting(auto, steps: int, plain_ms: float, tree_ms) -> list[int]:
    """``steps`` steps as the loop takes them (runs of plain steps decided ahead, each with its
    steps' times), the target never accepting a draft: plain steps take ``plain_ms``, a verified
    draft of n nodes ``tree_ms(n)``. The steps that verified a draft."""
    drafted, i = [], 0
    while i < steps:
        ahead = min(auto.plain_ahead(), steps - i)
        if ahead:
            auto.plain_steps(ahead, [plain_ms] * ahead)
            i += ahead
            continue
        plan = auto.plan()
        draft = None if plan is None else auto.choose(full_draft(plan), np.ones(1, dtype=np.bool_))
        if draft is None:
            auto.record(None, elapsed_ms=plain_ms)
        else:
            drafted.append(i)
            auto.record(draft, np.array([[999, 0]]), np.array([1]), np.arange(1), elapsed_ms=tree_ms(draft.n))
        i += 1
    return drafted


def test_a_profile_measured_while_the_cores_were_busy_is_learned_whole_and_dropped_from_the_file(monkeypatch):
    """A cached profile that prices everything at five times its time (measured beside other work):
    plain steps of 1 ms, trees of 1.5-2.2 ms that never bring a token. Trees look cheap against
    plain steps priced at 5 ms, and win; the first plain step weighed among them (PLAIN_EVERY) says
    the plain scale is stale, and the steps after it are weighed too until it is learned (one
    iteration moves a scale by at most a factor CLIP of itself: clipped to [1 / CLIP, CLIP] itself,
    plain steps stayed priced dearer than they were, probes that lost looked paying and came every
    few plain steps), the trees keeping the price they learned by the clock. From then on the
    choice drafts as one whose profile is right does, and once ``STALE_AFTER`` plain steps are
    weighed the profile is dropped from the cache file, once. A profile that says what the steps
    take, or a seeded choice, keeps its file entry."""
    import stree.decoding.autotree as autotree

    forgotten = []
    monkeypatch.setattr(autotree, "forget", forgotten.append)
    true = CostProfile(1.0, (2, 4, 8, 16), (1.5, 1.6, 1.8, 2.2))
    stale = CostProfile(5.0, true.nodes, tuple(5 * t for t in true.tree_ms))
    auto, right = AutoTree(stale, adaptive=True), AutoTree(true, adaptive=True)
    drafted, expected = (run_loop_rejecting(choice, 3000, 1.0, true.iteration_ms) for choice in (auto, right))
    assert auto.scale["plain"] == pytest.approx(0.2, rel=0.05) and auto.scale["tree"] > 0.5
    assert sum(i < 500 for i in drafted) <= 2 * AutoTree.PLAIN_EVERY
    assert sum(i >= 500 for i in drafted) <= sum(i >= 500 for i in expected) + 2
    assert forgotten == [stale]
    run_loop_rejecting(AutoTree(stale), 3000, 1.0, true.iteration_ms)
    assert forgotten == [stale]


def test_adaptive_probes_are_spaced_by_what_they_took_and_the_next_call_goes_on():
    """A profile that says probes are cheap, probes that take 8 ms (a drafter model catching up):
    an adaptive choice charges the ledger the 7 ms they lose, so that they cost at most
    PROBE_SHARE of the plain steps, and a later chooser sharing its scale goes on from there
    (no burst of probes at the start of every call); a seeded (non-adaptive) one cannot know.
    (The ledger at its whole share: the backoff has a test of its own.)"""
    profile = CostProfile(1.0, (2, 4, 8, 16), (1.5, 1.6, 1.8, 2.2))
    auto = Steady(profile, adaptive=True)
    drafted = run_rejecting(auto, 3000, 8.0)
    assert auto.scale["probe_loss"] == pytest.approx(7.0, rel=0.05)
    late = [b - a for a, b in zip(drafted, drafted[1:])][2:]  # once the loss is learned
    assert late and min(late) >= 0.95 * 7.0 / (AutoTree.PROBE_SHARE * 1.0)  # ~350 plain steps
    assert sum(drafted.probe_losses()) <= AutoTree.PROBE_SHARE * auto.chosen[1] + 2 * 7.0
    after = Steady(profile, adaptive=True, rates=auto.rates, scale=auto.scale)
    wait = math.ceil((7.0 - auto.scale["bank"]) / (AutoTree.PROBE_SHARE * after.cost[1] * after.scale["plain"]))
    assert 10 < wait < 351 and run_rejecting(after, wait - 1, 8.0) == []
    assert run_rejecting(after, 2, 8.0) != []  # the wait begun in the last call ends here
    seeded = Steady(profile)
    assert len(run_rejecting(seeded, 3000, 8.0)) > 3 * len(drafted)


def pay_one_probe(auto):
    """A probe falls due and pays: two tokens in 1.5 ms against 1 ms plain steps."""
    auto._plain_run, auto.scale["bank"] = AutoTree.PROBE, auto._probe_price()  # a probe is due
    plan = auto.plan()
    assert auto._probing
    draft = auto.choose(full_draft(plan), np.ones(1, dtype=np.bool_))
    first = draft.static_shape.children()[0][0]
    auto.record(draft, np.array([[int(draft.tokens[0, first]), 999]]), np.array([2]), np.arange(1), elapsed_ms=1.5)


def test_probes_that_pay_on_the_whole_keep_the_whole_share():
    """The share halves for a probe that lost while probes lose on average (``PACE``), not for
    every probe that lost: where a batch's least row often accepts nothing, most probes lose a
    little and the others pay for them, and probing at the whole share is what finds the trees
    that pay. One that pays makes the share whole whatever the average says."""
    auto = AutoTree(CostProfile(1.0, (2, 4), (1.1, 1.2)))
    auto._pace(0.2)  # the first probe loses: nothing says probes pay
    assert auto.scale["losing"] == 1 and not auto.scale["paid"]
    auto._pace(-3.0)
    assert auto.scale["losing"] == 0 and auto.scale["paid"]  # (the next call starts whole: see below)
    for _ in range(5):  # small losses after a large gain: probes still pay on the whole
        auto._pace(0.2)
    assert auto.scale["losing"] == 0 and auto.scale["pace"] < 0
    while auto.scale["pace"] <= 0:  # losses that go on until the average turns
        auto._pace(0.2)
    assert auto.scale["losing"] == 1
    auto._pace(0.2), auto._pace(0.2)
    assert auto.scale["losing"] == AutoTree.BACKOFF
    auto._pace(-0.1)
    assert auto.scale["losing"] == 0


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("probe_ms", [8.0, 1.4])
def test_probes_that_keep_losing_slow_down_and_one_that_pays_brings_them_back(adaptive, probe_ms):
    """Probes that lose against 1 ms plain steps (by the clock; a seeded choice by its profile,
    which says so too), 7 ms each or 0.4 ms (a cheap tree that brought nothing: n-gram's at
    temperature 1.0, which under a rule halving only for losses past a plain step kept the whole
    share for good): each halves the ledger's share (probes lose on average), down to
    PROBE_SHARE / 2**BACKOFF, so over
    20,000 steps they lose at most that share of the plain steps and the few probes' before it,
    with a fifth of the probes the whole share would buy or fewer. Then one probe that pays (two
    tokens in 1.5 ms, the text turned predictable) makes the share whole again."""
    profile = CostProfile(1.0, (2, 4, 8, 16), (probe_ms,) * 4)
    loss = probe_ms - 1.0
    auto = AutoTree(profile, adaptive=adaptive)
    drafted = run_rejecting(auto, 20000, probe_ms)
    assert auto.scale["losing"] == AutoTree.BACKOFF
    least = AutoTree.PROBE_SHARE / 2 ** AutoTree.BACKOFF
    probes = [i for i, probed in zip(drafted, drafted.probed) if probed]  # (a cheap tree's first draft is the prior's)
    gaps = np.diff(probes)[AutoTree.BACKOFF - 1:]  # once BACKOFF probes have lost
    assert len(gaps) >= 3 and min(gaps) >= 0.95 * loss / least
    plain = 20000 - len(drafted)
    assert sum(drafted.probe_losses()) <= least * plain + (AutoTree.BACKOFF + 2) * loss
    steady = run_rejecting(Steady(profile, adaptive=adaptive), 20000, probe_ms)
    assert len(steady) >= 5 * len(drafted)
    if not adaptive:
        return
    pay_one_probe(auto)
    assert auto.scale["losing"] == 0
    assert run_rejecting(auto, int(loss / AutoTree.PROBE_SHARE) + AutoTree.PROBE + 2, probe_ms) != []


def test_each_call_explores_at_the_whole_shares_again_where_the_last_could_back_off():
    """A chooser handed the rates and scale of one whose probes and watched drafts all lost
    (shares at their least) starts watching at the whole share, on a new text, while what it
    learned of the machine and the text goes on: where that call explored drafts enough to back
    off on its own (AGAIN). Its probes start whole too where one of the last call's probes paid;
    where none did, their halvings carry over (n-gram at temperature 1.0 had paid about a probe a
    call at the whole share, 1.5-2% of plain decoding's pace; greedy, where some probe of a call
    pays, no change beyond the noise). A call that explored fewer hands its backoff on: whole to a
    choice that cannot watch (a drafter model's probes, one every few calls, had never halved the
    share within a call and took the whole of it), one halving short of the least at most to one
    that watches (carried whole over calls too short to explore, a benchmark's warm-up, its shares
    had stayed at their least, where a call explores nothing). A seeded choice starts whole at
    every call (its choices follow the seed alone)."""
    profile = CostProfile(1.0, (2, 4, 8, 16), (8.0,) * 4)
    auto = AutoTree(profile, adaptive=True, watch=True)
    assert len(run_rejecting(auto, 20000, 8.0)) >= AutoTree.AGAIN
    least = {"losing": AutoTree.BACKOFF, "watch_idle": AutoTree.BACKOFF}
    auto.scale.update(least, watch_ms=2.0)  # (watches that took 2 ms)
    auto._first_watch = False  # (the share's gap: a call's first watched draft aside, FIRST_WATCH)
    slow_probes, slow_watches = auto._deposit(), auto._watch_gap()
    learned = {k: auto.scale[k] for k in ("probe_loss", "bank", "plain", "tree")}
    assert not auto.scale["paid"]  # (no probe paid: none had a draft accepted)
    carried = AutoTree(profile, adaptive=True, watch=True, rates=auto.rates, scale=dict(auto.scale))
    assert carried.scale["losing"] == AutoTree.BACKOFF and carried.scale["watch_idle"] == 0
    assert carried._deposit() == pytest.approx(slow_probes) and not carried.scale["paid"]
    auto.scale["paid"] = True  # (had one of them paid)
    after = AutoTree(profile, adaptive=True, watch=True, rates=auto.rates, scale=auto.scale)
    assert after.scale["losing"] == after.scale["watch_idle"] == 0
    assert after._deposit() == pytest.approx(slow_probes * 2 ** AutoTree.BACKOFF)
    assert after._watch_gap() == AutoTree.FIRST_WATCH  # (its call's first watched draft)
    after._first_watch = False
    assert after._watch_gap() == pytest.approx(slow_watches / 2 ** AutoTree.BACKOFF, rel=0.02)
    assert {k: after.scale[k] for k in learned} == learned and after.rates is auto.rates
    run_rejecting(after, 2 * AutoTree.PROBE, 8.0)  # (a short call)
    assert after.scale["explored"] < AutoTree.AGAIN
    after.scale.update(least)
    watching = AutoTree(profile, adaptive=True, watch=True, rates=auto.rates, scale=after.scale)
    assert watching.watching and watching.scale["losing"] == watching.scale["watch_idle"] == AutoTree.BACKOFF - 1
    assert watching._deposit() == pytest.approx(slow_probes * 2)
    watching.scale.update({"losing": 1, "watch_idle": 0}, explored=0)
    assert AutoTree(profile, adaptive=True, watch=True, scale=watching.scale).scale["losing"] == 1  # (less: as it was)
    watching.scale.update(least, explored=0)
    kept = AutoTree(profile, adaptive=True, rates=auto.rates, scale=watching.scale)  # (no watching: a drafter model's)
    assert not kept.watching and {k: kept.scale[k] for k in least} == least
    assert kept._deposit() == slow_probes
    seeded = AutoTree(profile, scale={"plain": 1.0, "tree": 1.0, "explored": 0, **least})
    assert seeded.scale["losing"] == 0


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_seeded_choice_probes_only_where_its_call_has_the_steps_left_to_use_what_it_teaches(adaptive):
    """Trees that cost 8 plain steps: the first probe falls due after the plain steps whose
    deposits buy it. A seeded choice (whose rates and ledger are its call's own) told that fewer
    steps are left in its call than those takes no probe then or later, and has the rest of the
    call decided plain at once (plain_ahead); with as many left, or not told, it probes there as
    before. An adaptive choice, whose lessons carry over to the next calls, probes there either way."""
    profile = CostProfile(1.0, (2, 4, 8, 16), (8.0,) * 4)

    def first_probe(steps_in_call, told=True):
        auto = AutoTree(profile, adaptive=adaptive)
        for i in range(steps_in_call):
            auto.plan(None, (lambda: steps_in_call - i) if told else None)
            if auto._probing:
                return i, auto
            auto.record(None, elapsed_ms=1.0)
        return None, auto

    bought, _ = first_probe(10**5)
    assert bought is not None and bought > 10 * AutoTree.PROBE
    assert first_probe(2 * bought)[0] == bought
    late, auto = first_probe(2 * bought - 1)
    if adaptive:
        assert late == bought
        return
    assert late is None and auto.plain_ahead() == AutoTree.NEVER
    assert first_probe(2 * bought - 1, told=False)[0] == bought  # (not told: the ledger alone decides)


def test_the_step_after_a_probe_is_part_of_its_price():
    """Probes that take 3 ms and slow the plain step after them to 1.8 ms (the caches they
    evicted): an adaptive choice charges each 2 + 0.8 ms, and prices plain steps by the others.
    One plain step's worth at most: a step that compiled something is no probe's aftermath."""
    profile = CostProfile(1.0, (2, 4, 8, 16), (1.5, 1.6, 1.8, 2.2))
    auto = AutoTree(profile, adaptive=True)
    drafted = run_rejecting(auto, 3000, 3.0, after_ms=1.8)
    assert auto.scale["probe_loss"] == pytest.approx(2.8, rel=0.05)
    assert auto.scale["plain"] == pytest.approx(1.0, rel=0.02)
    assert sum(drafted.probe_losses()) <= AutoTree.PROBE_SHARE * auto.chosen[1] + 2 * 2.8
    dear = AutoTree(profile, adaptive=True)
    run_rejecting(dear, 3000, 3.0, after_ms=50.0)
    assert dear.scale["probe_loss"] == pytest.approx(3.0, rel=0.05)


def test_one_probe_that_compiled_something_does_not_stop_probing():
    """A probe that took 300 ms (something compiled inside it) is charged at most twice the loss
    known: probes stay within reach, and the next ones bring the loss back. (The ledger at its
    whole share: the backoff has a test of its own.)"""
    profile = CostProfile(1.0, (2, 4, 8, 16), (1.5, 1.6, 1.8, 2.2))
    auto = Steady(profile, adaptive=True)
    drafted = run_rejecting(auto, 400, 2.0)
    calm = auto.scale["probe_loss"]
    assert 0 < calm < 2.0 and drafted
    auto._plain_run, auto.scale["bank"] = AutoTree.PROBE, calm  # a probe is due
    assert run_rejecting(auto, 1, 300.0) == [0]
    charged = calm - auto.scale["bank"]
    assert charged <= 2.0 * max(AutoTree.CLIP * 2.2, calm) + 1e-9
    wait = (charged + auto.scale["probe_loss"]) / auto._deposit()  # the debt, then the next price
    after = run_rejecting(auto, 3000, 2.0)
    assert len(after) >= 3 and after[0] <= wait + 1 and auto.scale["probe_loss"] < 2 * calm + 0.5


def test_a_probe_waits_until_its_drafters_catch_up_is_paid_for():
    """A drafter model 300 tokens behind at 0.05 ms a token (a probe costs 15 ms more than the
    profile's steady state): a seeded choice, which cannot learn that from the clock, prices its
    probes with it and asks the drafter rarely; one that is not behind probes as usual."""
    profile = CostProfile(1.0, (2, 4, 8, 16), (1.5, 1.6, 1.8, 2.2), catch_ms=0.05)
    asked = []

    def run(behind_by, steps):
        return run_rejecting(AutoTree(profile), steps, behind=lambda i: asked.append(i) or behind_by)

    far = run(300, 3000)  # (the first step drafts: the prior's rates say trees pay, until verified steps say not)
    assert len(far) >= 2 and all(b - a >= 15.0 / AutoTree.PROBE_SHARE for a, b in zip(far, far[1:]))
    assert len(asked) <= 2 * len(far) + 2  # asked once the rest of the price is there, not every step
    asked.clear()
    near = run(0, 3000)
    assert near[0] < 10 and len(near) > 3 * len(far)


# ---- watched drafts ---------------------------------------------------------------------------
def test_a_watched_draft_is_learned_as_verification_would_have_found_it():
    """A chain of four and a sibling under the root, for three rows. Row 0's plain steps matched two
    levels and then not: accepted 2 of them (as verified), the third level reached and refused.
    Row 1's two tokens both matched: only the first level is known (the second token stands for
    the bonus), the deeper ones are not counted. Row 2 took the sibling. Row 3 finished before
    emitting anything more: it teaches nothing (it once made the watch raise). The rates hold
    exactly what recording those verified steps holds."""
    parents = [-1, 0, 1, 2, 3, 0]
    tokens = [[5, 6, 7, 8, 9, 4]] * 4
    draft = tree_of(parents, tokens)
    after = [np.array([6, 7, 1, 2, 3, 3]), np.array([6, 7]), np.array([4, 9, 9, 9, 9]), np.array([], dtype=np.int64)]
    watched = AutoTree(cheap(), adaptive=True, watch=True, rates=PathRates(decay=1.0))
    watched.watched(draft, after, np.ones(4, dtype=bool), np.arange(4))
    verified = PathRates(decay=1.0)
    cut = tree_of(parents, tokens[:3], [[True] * 6, [True, True, False, False, False, True], [True] * 6])
    verified.record(cut, np.array([[6, 7, 1], [6, 7, 0], [4, 9, 0]]), np.array([3, 2, 2]), np.arange(3))
    assert np.array_equal(watched.rates.accepted, verified.accepted)
    assert np.array_equal(watched.rates.reached, verified.reached)
    acc, reached = verified.accepted, verified.reached
    assert (reached[1, 0], acc[1, 0], reached[1, 1], acc[1, 1]) == (3, 2, 1, 1)  # level 1: the chain, the sibling
    assert (reached[2, 0], acc[2, 0], reached[3, 0], acc[3, 0], reached[4, 0]) == (1, 1, 1, 0, 0)
    # what the served rows got (three rows: the least, row 1's one accepted draft) calibrates the promises
    assert watched.scale["gain_got"] == 1.0 and watched.scale["gain_said"] > 0.0


def test_watched_drafts_are_spaced_by_what_watching_them_took(monkeypatch):
    """Before any watch, watches are spaced by what drafting one is predicted to cost (nothing
    here: WATCH_EVERY plain steps). What watches take by the clock (drafting them, then learning
    from them) is learned from that prediction a step at a time: one first watch that took fifty
    plain steps (paying for first uses) does not space the next ones by that for good, and
    watches that each take half a plain step come to space them so that watching takes at most
    WATCH_SHARE of the plain steps' time. The choice's clock here advances a tenth of a
    millisecond a reading (learning from a watch: two), as the real one, read under a loaded
    machine, once put past the bound below."""
    import stree.decoding.autotree as autotree

    ticks = itertools.count()
    monkeypatch.setattr(autotree, "time", type("Clock", (), {"perf_counter": lambda: next(ticks) * 1e-4}))
    auto = AutoTree(cheap(), adaptive=True, watch=True, rates=PathRates(prior=(0.02,) * 8))
    assert auto._watch_gap() == AutoTree.WATCH_EVERY
    draft = tree_of([-1, 0, 1], [[5, 6, 7]])
    auto.watched(draft, [np.array([9, 1])], np.ones(1, dtype=bool), np.arange(1))  # (no drafting time: none taught)
    assert auto.scale["watch_ms"] == 0.0 and auto._watch_gap() == AutoTree.WATCH_EVERY
    auto.watched(draft, [np.array([9, 1])], np.ones(1, dtype=bool), np.arange(1), drafting_ms=50.0)
    assert AutoTree.ADAPT * 50.0 <= auto.scale["watch_ms"] < AutoTree.ADAPT * 50.0 + 1.0
    for _ in range(60):  # (drafts that miss: trees stay unwanted, and watches due)
        auto.watched(draft, [np.array([9, 1])], np.ones(1, dtype=bool), np.arange(1), drafting_ms=0.5)
    took = auto.scale["watch_ms"]
    assert took == pytest.approx(0.5 + 0.1, abs=0.01)  # each drafting and its learning, the first one faded
    auto.scale["watch_idle"] = 0  # (the share whole: plain steps kept winning, which backs watches off)
    gap = auto._watch_gap()
    assert gap >= 0.5 / (AutoTree.WATCH_SHARE * 1.0) and took <= gap * AutoTree.WATCH_SHARE * auto.scale["plain"]
    for step in range(gap):
        assert auto.watch_shape() is None, step
        auto.record(None)
    assert auto.watch_shape() is not None


def test_a_watched_draft_has_watch_nodes_and_pays_where_a_prefix_of_it_would_have():
    """A watched draft has WATCH_NODES nodes where the sizes allow, whatever the probe's size: a
    probe's few nodes, two or three levels, settled whether a fresh process's choice ever drafted
    (n-gram, batch 1, greedy: about one process in three decoded its first predictable prompts
    plain, 1.0x against 1.2x). And it would have paid, verified, where a prefix of it of an allowed
    size would have: its path's tokens against that prefix's price (a draft of 16 nodes whose first
    level alone matched pays as a 2-node tree, not as a 16-node one)."""
    pessimist = AutoTree(cheap(), adaptive=True, watch=True, rates=PathRates(prior=(0.02,) * 8))
    for _ in range(AutoTree.FIRST_WATCH):
        pessimist.record(None)
    due = pessimist.watch_shape()
    assert pessimist._probe_size < 16 and due is not None and due.n == 16
    steep = CostProfile(1.0, (2, 4, 8, 16), (1.05, 1.5, 2.0, 3.0))
    auto = AutoTree(steep, adaptive=True, watch=True, rates=PathRates(prior=(0.95,) * 8))
    assert auto._probe_size == 16  # (the best size, whose price the tokens below do not reach)
    chain = TokenTree.from_shape(TreeShape.chain(15), torch.arange(16)[None])
    auto.scale["watch_ms"] = 50.0  # (what watches take: far apart, unless the last would have paid)
    one, served = np.zeros(1, dtype=np.int64), np.ones(1, dtype=bool)
    auto.watched(chain, [np.array([1, 99, 99])], served, one)  # the first draft accepted: 2 tokens
    assert auto._watch_gap() == AutoTree.WATCH_EVERY
    auto.watched(chain, [np.array([99, 99])], served, one)  # none: no prefix pays
    assert auto._watch_gap() > AutoTree.WATCH_EVERY


def test_watches_back_off_while_plain_steps_keep_winning_and_come_back_when_trees_do():
    """Each watched draft after which plain steps still win halves the watches' share (the gap
    doubles), down to WATCH_SHARE / 2**BACKOFF; one that would have paid, verified, restores it and
    has the next one due after WATCH_EVERY plain steps."""
    auto = AutoTree(cheap(), adaptive=True, watch=True, rates=PathRates(prior=(0.02,) * 8))
    chain = tree_of([-1, 0, 1, 2], [[5, 6, 7, 8]])
    gaps = []
    for _ in range(AutoTree.BACKOFF + 2):
        auto.watched(chain, [np.array([1, 2, 3, 4])], np.ones(1, dtype=bool), np.arange(1), drafting_ms=0.5)
        assert not auto.wants_trees()
        auto.scale["watch_ms"] = 0.5  # (the clock held still: the share alone moves the gap)
        gaps.append(auto._watch_gap())
    assert gaps[1:AutoTree.BACKOFF] == [2 * g for g in gaps[: AutoTree.BACKOFF - 1]], gaps
    assert gaps[-1] == gaps[-2] == gaps[0] * 2 ** (AutoTree.BACKOFF - 1), gaps
    while not auto.wants_trees():  # text the drafter follows: every node matches
        auto.watched(chain, [np.array([6, 7, 8, 9])], np.ones(1, dtype=bool), np.arange(1), drafting_ms=0.5)
    auto.scale["watch_ms"] = 0.5
    assert auto.scale["watch_idle"] == 0 and auto._watch_gap() == AutoTree.WATCH_EVERY < gaps[0]
    auto.watched(chain, [np.array([1, 2, 3, 4])], np.ones(1, dtype=bool), np.arange(1), drafting_ms=0.5)
    auto.scale["watch_ms"] = 0.5
    assert auto._watch_gap() * 2 == gaps[0]  # (one that would not have paid: the whole share's gap again)


class NeverProbes(AutoTree):
    PROBE_SHARE = 0.0  # only watched drafts can bring trees back


def test_watched_drafts_bring_trees_back_where_probes_never_come():
    """A choice that learned that drafts fail (plain steps only, and no probes to say otherwise)
    meets text its drafter follows. Watching a draft now and then, during the plain steps, it
    learns that and drafts trees again; without watching it stays plain for good. Watched drafts
    cost drafting alone: at most WATCH_SHARE of the plain steps' time, and one in WATCH_EVERY
    plain steps at most."""
    def run(watch):
        auto = NeverProbes(cheap(), adaptive=True, watch=watch, rates=PathRates(prior=(0.02,) * 8))
        plain = watches = 0
        for _ in range(200):
            if auto.plan() is not None:
                break
            auto.record(None)
            plain += 1
            due = auto.watch_shape()
            if due is not None:
                watches += 1
                draft = TokenTree.from_shape(due, torch.arange(due.n)[None])
                auto.watched(draft, [np.arange(1, due.n + 1)], np.ones(1, dtype=bool), np.zeros(1, dtype=np.int64))
        return plain, watches, auto

    plain, watches, auto = run(True)
    assert plain < 200 and auto.wants_trees() and 1 <= watches <= plain // AutoTree.WATCH_EVERY
    assert auto._watch_gap() >= AutoTree.WATCH_EVERY
    assert run(False)[:2] == (200, 0)



def test_a_choice_told_to_take_no_probes_explores_by_watched_drafts_alone():
    """probes=False, where drafts are watched: no plain step puts anything in the ledger and none
    is ever a probe, however long the plain steps run (trees there cost six steps and nothing is
    accepted), while drafts are still watched; the same choice with probes probes. A choice that
    cannot watch (a seeded one) probes whatever it is told: it has no other way to explore."""
    def run(probes):
        auto = AutoTree(expensive(), adaptive=True, watch=True, probes=probes)
        probed = watched = 0
        for _ in range(1500):
            plan = auto.plan()
            probed += auto._probing
            if plan is not None:
                auto.record(full_draft(plan), np.array([[999, 0]]), np.array([1]), np.arange(1), elapsed_ms=6.0)
                continue
            auto.record(None, elapsed_ms=1.0)
            due = auto.watch_shape()
            if due is not None:
                watched += 1
                draft = TokenTree.from_shape(due, torch.arange(due.n)[None] + 100)
                auto.watched(draft, [np.full(due.n, 999)], np.ones(1, dtype=bool), np.zeros(1, dtype=np.int64))
        return probed, watched, auto

    probed, watched, auto = run(False)
    assert probed == 0 and watched >= 2 and auto.scale["bank"] == 0.0 and not auto.probes
    assert run(True)[0] >= 2
    assert AutoTree(expensive(), probes=False, watch=True).probes  # (seeded: no watching, so probes)


def test_a_choice_told_to_take_no_probes_still_probes_where_probes_paid_on_average():
    """probes=False funds no probe from plain steps, but a probe priced at no loss (an earlier call's
    probes of the profile paid on average) is let through after PROBE plain steps: at batch 2 those
    verified drafts are what correct rates that promise more than the text gives (refused, drafts
    found wanting at every step ran on: docs/benchmarks.md)."""
    scale = {"plain": 1.0, "tree": 1.0, "probes": 3, "probe_loss": -0.5}
    auto = AutoTree(expensive(), adaptive=True, watch=True, probes=False, scale=scale)
    probed = 0
    for _ in range(3 * AutoTree.PROBE):
        plan = auto.plan()
        probed += auto._probing
        if plan is None:
            auto.record(None, elapsed_ms=1.0)
        else:
            auto.record(full_draft(plan), np.array([[999, 0]]), np.array([1]), np.arange(1), elapsed_ms=1.0)
    assert probed >= 1 and auto._deposit() == 0.0


def test_a_calls_first_watched_draft_is_due_within_first_watch_plain_steps():
    """Each call is new text: its first watched draft is due after FIRST_WATCH plain steps, where
    the share (backed off) would space watches further apart; after it, watches keep the share's
    pace again where the draft would not have paid (one in about 200 plain steps here: no second
    one within the call's 128)."""
    auto = NeverProbes(cheap(), adaptive=True, watch=True, rates=PathRates(prior=(0.02,) * 8),
                       scale={"plain": 1.0, "tree": 1.0, "watch_idle": AutoTree.BACKOFF, "watch_ms": 0.5,
                              "explored": 0})
    due_at = []
    for step in range(1, 129):
        assert auto.plan() is None
        auto.record(None)
        due = auto.watch_shape()
        if due is not None:
            due_at.append(step)
            draft = TokenTree.from_shape(due, torch.arange(due.n)[None] + 100)  # (text it does not follow)
            auto.watched(draft, [np.array([1, 2])], np.ones(1, dtype=bool), np.zeros(1, dtype=np.int64),
                         drafting_ms=0.5)
    assert due_at == [AutoTree.FIRST_WATCH]
    assert auto._watch_gap() > 128

def first_path(draft: TokenTree) -> np.ndarray:
    """The tokens of ``draft``'s path of first children below its root (row 0), then a bonus."""
    parents, tokens, path, at = draft.static_shape.parents, draft.tokens[0].tolist(), [], 0
    for v in range(1, draft.n):
        if parents[v] == at:
            path.append(tokens[v])
            at = v
    return np.array(path + [7], dtype=np.int64)


def explore_call(auto: AutoTree, steps: int = 128, follows: bool = False) -> int:
    """One call of ``steps`` steps in which the target accepts no verified draft (plain steps 1 ms,
    drafted ones 2 ms), watching the drafts the choice asks for: text a watched draft does not
    follow, or, with ``follows``, its path of first children. Returns the drafts explored."""
    explored = 0
    for _ in range(steps):
        plan = auto.plan()
        draft = None if plan is None else auto.choose(full_draft(plan), np.ones(1, dtype=np.bool_))
        if draft is not None:
            explored += 1
            auto.record(draft, np.array([[999, 0]]), np.array([1]), np.arange(1), elapsed_ms=2.0)
            continue
        auto.record(None, elapsed_ms=1.0)
        due = auto.watch_shape()
        if due is not None:
            explored += 1
            watched = full_draft(due)
            after = first_path(watched) if follows else np.array([1, 2])
            auto.watched(watched, [after], np.ones(1, dtype=bool), np.zeros(1, dtype=np.int64), drafting_ms=0.5)
    return explored


def test_calls_that_keep_exploring_in_vain_rest_but_one_in_idle_wake_until_a_draft_pays():
    """Sampled text the drafter cannot follow: each call explored at the whole shares again (its
    first watched draft within FIRST_WATCH plain steps, probes), and found nothing every time.
    After IDLE_CALLS such calls in a row, all but one call in IDLE_WAKE rest, one in twice as many after each
    exploring call that found nothing again, up to IDLE_WAKE_MOST (``AutoTree.rests``:
    no choice made, nothing of the shared scales moved but the count of idle calls begun); the one
    that does not starts at the least shares with its first watch. A call in which a watched draft
    would have paid ends the rest: the next one starts whole again (its first watch due at
    FIRST_WATCH), as after a tree taken for its worth. A seeded choice starts whole anyway."""
    profile, rates = cheap(), PathRates(prior=(0.02,) * 8)
    scale = {"plain": 1.0, "tree": 1.0}

    def call(**kw):
        return AutoTree(profile, adaptive=True, watch=True, rates=rates, scale=scale, **kw)

    def begin():  # a call as auto_tree begins it: None where it rests
        return None if AutoTree.rests(scale) else call()

    whole = [explore_call(begin()) for _ in range(AutoTree.IDLE_CALLS)]
    assert min(whole) >= 1 and scale["idle_calls"] == AutoTree.IDLE_CALLS - 1
    # one call in IDLE_WAKE explores, then one in twice as many after each that found nothing, up to IDLE_WAKE_MOST
    expected, wake = [], AutoTree.IDLE_WAKE
    for _ in range(4):
        expected += [True] * (wake - 1) + [False]
        wake = min(2 * wake, AutoTree.IDLE_WAKE_MOST)
    assert expected.count(False) == 4 and len(expected) == 2 + 4 + 8 + 8
    rested, explored = [], []
    for _ in range(len(expected)):
        before = dict(scale)
        auto = begin()
        rested.append(auto is None)
        if auto is None:
            assert {k: v for k, v in scale.items() if k != "quiet"} == {k: v for k, v in before.items() if k != "quiet"}
            continue
        assert scale["idle_calls"] >= AutoTree.IDLE_CALLS and auto._first_watch
        assert auto.scale["losing"] == auto.scale["watch_idle"] == AutoTree.BACKOFF
        assert auto._watch_gap() == AutoTree.FIRST_WATCH  # (its first watch)
        explored.append(explore_call(auto))
        assert auto._watch_gap() > 128  # (then the least share's)
    assert rested == expected and min(explored) >= 1
    seeded = AutoTree(profile, rates=rates, scale=dict(scale))
    assert seeded.scale["losing"] == seeded.scale["watch_idle"] == 0
    # text the drafter follows: the call that does not rest finds it with its first watch
    found = begin()
    while found is None:
        found = begin()
    explore_call(found, follows=True)
    assert scale["found"] and not AutoTree.rests(scale)
    after = call()
    assert scale["idle_calls"] == 0 and after._first_watch and after.scale["watch_idle"] == 0
    assert after._watch_gap() == AutoTree.FIRST_WATCH
    # a tree taken for its worth (not a probe) is a find too
    trusting = AutoTree(profile, adaptive=True, rates=PathRates(prior=(0.9,) * 8), scale={"plain": 1.0, "tree": 1.0})
    plan = trusting.plan()
    assert plan is not None and not trusting._probing and not trusting.scale["found"]
    tree = trusting.choose(full_draft(plan), np.ones(1, dtype=np.bool_))
    trusting.record(tree, np.array([[101, 7]]), np.array([2]), np.arange(1), elapsed_ms=2.0)
    assert trusting.scale["found"]


def test_watched_drafts_that_paid_while_the_choice_still_declines_trees_find_nothing():
    """A watched draft that would have paid in hindsight (its tokens against its iteration's price)
    after which the choice still declines to draft (most of its drafts found wanting, each such
    iteration dear) is watched again soon, but is no find: calls of such watches count toward
    IDLE_CALLS, and the call after IDLE_CALLS of them starts at the least shares. (Counted as finds,
    every call at batch 2 on a 2-core Zen 5 EPYC started whole, each watched draft some three plain
    steps' time, the choice drafting next to nothing.)"""
    profile, rates = cheap(), PathRates(prior=(0.9,) * 8)
    scale = {"plain": 1.0, "tree": 1.0, "declined": 40.0}

    def watch(auto):
        shape = auto.prefix(auto._probe_size)
        draft = full_draft(shape)
        auto.watched(draft, [first_path(draft)], np.ones(1, dtype=bool), np.zeros(1, dtype=np.int64),
                     drafting_ms=0.5)

    for call in range(AutoTree.IDLE_CALLS):
        scale["verified"] = 1e-3  # (the drafts it drafted meanwhile found wanting)
        auto = AutoTree(profile, adaptive=True, watch=True, rates=rates, scale=scale)
        assert not auto.wants_trees()
        for _ in range(2):
            watch(auto)
            assert auto._paid_watch and not auto.wants_trees()
            assert auto._watch_gap() == AutoTree.WATCH_EVERY  # (watched again soon)
        auto.plain_steps(AutoTree.FIRST_WATCH, [1.0] * AutoTree.FIRST_WATCH)
        assert not scale["found"]
    idle = AutoTree(profile, adaptive=True, watch=True, rates=rates, scale=scale)
    assert scale["idle_calls"] == AutoTree.IDLE_CALLS and idle.scale["watch_idle"] == AutoTree.BACKOFF


def test_calls_that_find_nothing_count_as_idle_whether_or_not_they_explored():
    """Calls of FIRST_WATCH steps or more that found no draft that paid count toward IDLE_CALLS also
    where they explored none (batch 2's calls, which watch no first draft and fund no probes; a drafter
    model's calls between its probes): after IDLE_CALLS of them, calls rest."""
    profile, rates = cheap(), PathRates(prior=(0.02,) * 8)
    scale = {"plain": 1.0, "tree": 1.0}
    for call in range(AutoTree.IDLE_CALLS):
        assert not AutoTree.rests(scale)
        auto = AutoTree(profile, adaptive=True, rates=rates, scale=scale)
        auto.plain_steps(AutoTree.FIRST_WATCH, [1.0] * AutoTree.FIRST_WATCH)
        assert scale["explored"] == 0 and not scale["found"] and not scale["paid"]
    assert AutoTree.rests(scale)


def test_short_calls_that_explore_in_vain_leave_the_idle_count_as_it_is():
    """Calls of fewer than FIRST_WATCH steps (a benchmark's warm-up calls of 8 tokens) that explored
    a draft in vain do not count toward IDLE_CALLS: counted, such calls had left greedy choices at
    the least shares before their first call of 128 tokens."""
    profile, rates = cheap(), PathRates(prior=(0.02,) * 8)
    scale = {"plain": 1.0, "tree": 1.0}
    explored = []
    for _ in range(2 * AutoTree.IDLE_CALLS):
        explored.append(explore_call(AutoTree(profile, adaptive=True, watch=True, rates=rates, scale=scale),
                                     steps=AutoTree.FIRST_WATCH - 1))
        assert not scale["found"] and not scale["paid"]
    assert sum(x > 0 for x in explored) >= 1
    fresh = AutoTree(profile, adaptive=True, watch=True, rates=rates, scale=scale)
    assert scale.get("idle_calls", 0) == 0 and fresh._first_watch



def test_a_drafter_models_choices_plan_once_under_the_same_rates(monkeypatch):
    """A drafter model's plan weighs every depth cap; a choice made under the rates (and profile) the
    last one planned under takes that plan without weighing them again, and plans afresh once the
    rates have learned from a step."""
    import stree.decoding.autotree as autotree

    nodes, depths = (2, 4, 8, 16), (1, 3, 5, 6)
    profile = CostProfile(1.0, nodes, (1.1, 1.2, 1.3, 1.5), tuple(0.2 + 0.5 * d for d in depths), 0.01, depths)
    rates = PathRates(prior=(0.85, 0.5, 0.4, 0.3, 0.2, 0.1, 0.08, 0.07))
    planned = []
    real = autotree.plan_shape
    monkeypatch.setattr(autotree, "plan_shape", lambda *a, **k: planned.append(a[1:]) or real(*a, **k))
    first = AutoTree(profile, rates=rates, adaptive=True)
    weighed = len(planned)
    assert weighed > 2  # (the first plan, then one per depth cap)
    second = AutoTree(profile, rates=rates, adaptive=True)
    assert len(planned) == weighed + 1 and second._order is first._order  # (the first plan alone)
    other = AutoTree(CostProfile(1.0, nodes, profile.tree_ms, profile.draft_ms, 0.01, depths), rates=rates,
                     adaptive=True)
    assert len(planned) == 2 * weighed + 1  # (another profile: weighed again)
    tree = TokenTree.from_shape(first._order.prefix(4), torch.zeros(1, 4, dtype=torch.long))
    rates.record(tree, np.zeros((1, 2), dtype=np.int64), np.array([2]), np.arange(1))
    AutoTree(profile, rates=rates, adaptive=True)
    assert len(planned) == 3 * weighed + 1 and other._order is not None


def test_a_choice_under_the_rates_the_last_left_weighs_them_without_reckoning_again(monkeypatch):
    """The expected accepted drafts of a plan's prefixes under one rates' hazards are reckoned once for
    every choice of those rates (a call's choice weighs its sizes at once, under the rates the last
    call left), and again once the rates move (then once for every choice again); a call's rows' own
    rates are made only where a draft is recorded (plain steps never ask for them)."""
    import stree.decoding.autotree as autotree

    reckoned = []
    real = autotree.expected_accepted
    monkeypatch.setattr(autotree, "expected_accepted", lambda *a: reckoned.append(1) or real(*a))
    rates, profile = PathRates(), cheap()
    first = AutoTree(profile, rates=rates, adaptive=True)
    once = len(reckoned)
    second = AutoTree(profile, rates=rates, adaptive=True)
    assert once >= 1 and len(reckoned) == once and second._pick == first._pick
    second.record(None, elapsed_ms=1.0)
    assert second._row_rates is None
    draft = TokenTree.from_shape(second.prefix(4), torch.zeros(1, 4, dtype=torch.long))
    second.record(draft, np.zeros((1, 2), dtype=np.int64), np.array([2]), np.arange(1), ids=np.arange(1))
    assert second._row_rates is not None and rates.version == 1
    AutoTree(profile, rates=rates, adaptive=True)
    moved = len(reckoned)
    AutoTree(profile, rates=rates, adaptive=True)
    assert moved > once and len(reckoned) == moved

def test_adaptive_choices_of_one_profile_hand_on_what_they_learned(monkeypatch):
    """auto_tree's adaptive choosers of one cost profile share one scale and one set of rates across
    calls (a call starts where the last left off), made at the first; another profile's are its own,
    and a seeded choice's are its call's own."""
    import stree.decoding.autotree as autotree

    profiles = {1: CostProfile(1.0, (2, 4), (1.1, 1.2)), 2: CostProfile(1.0, (2, 4), (1.3, 1.5))}
    monkeypatch.setattr(autotree, "cost_profile", lambda model, batch, **kw: profiles[batch])
    monkeypatch.setattr(autotree, "_LEARNED", type(autotree._LEARNED)())
    model, drafter = mamba2(), make_drafter("ngram")
    first, second = (autotree.auto_tree(model, drafter, 1, mode="eager", adaptive=True) for _ in range(2))
    assert second.rates is first.rates and second.scale is first.scale
    other = autotree.auto_tree(model, drafter, 2, mode="eager", adaptive=True)
    assert other.rates is not first.rates and other.scale is not first.scale
    seeded = autotree.auto_tree(model, drafter, 1, mode="eager")
    assert seeded.rates is not first.rates and seeded.scale is not first.scale



def test_auto_tree_looks_its_profile_up_once_per_model_and_arguments(monkeypatch):
    """A decoding call asks auto_tree for its choice once: the profile (and the sizes) it asks for are
    kept per model and arguments, and asked again where the arguments differ, ``refresh`` is given,
    the model was moved to another dtype, or the drafter drafts with another model."""
    import stree.decoding.autotree as autotree

    asked = []
    profile = CostProfile(1.0, (2, 4), (1.1, 1.2), (0.1, 0.2), 0.01, (1, 2))

    def looked_up(model, batch, **kw):
        asked.append((batch, kw["mode"], kw["refresh"]))
        return profile
    monkeypatch.setattr(autotree, "cost_profile", looked_up)
    model, drafter = mamba2(), make_drafter("ngram")
    choices = [autotree.auto_tree(model, drafter, 1, mode="eager", adaptive=True) for _ in range(3)]
    assert asked == [(1, "eager", False)] and all(c.profile is profile for c in choices)
    autotree.auto_tree(model, drafter, 2, mode="eager", adaptive=True)
    autotree.auto_tree(model, drafter, 1, mode="eager", adaptive=True, refresh=True)
    assert asked[1:] == [(2, "eager", False), (1, "eager", True)]
    model.to(torch.float64)
    autotree.auto_tree(model, drafter, 1, mode="eager", adaptive=True)
    assert len(asked) == 4
    small, other = mamba2(n_layer=1, seed=3), mamba2(n_layer=1, seed=4)
    for inner in (small, small, other):
        autotree.auto_tree(model, make_drafter("ssm-static", drafter_model=inner), 1, mode="eager", adaptive=True)
    assert len(asked) == 6

def test_only_a_batch_of_one_forces_a_watch_early_in_each_call(monkeypatch):
    """auto_tree's choices at batch 1 watch a call's first draft within FIRST_WATCH plain steps,
    whatever the share; at batch 2 watches keep the share's pace from the start (there a call's first
    watch and those it led to cost more than the batch's rare paying trees brought), and are all the
    choice explores by (no probes)."""
    import stree.decoding.autotree as autotree

    profile = CostProfile(1.0, (2, 4, 8, 16), (1.05, 1.1, 1.2, 1.4), (5.0, 5.0, 5.0, 5.0))  # (dear drafting)
    monkeypatch.setattr(autotree, "cost_profile", lambda model, batch, **kw: profile)
    monkeypatch.setattr(autotree, "_LEARNED", type(autotree._LEARNED)())
    model, drafter = mamba2(), make_drafter("ngram")
    one, two = (autotree.auto_tree(model, drafter, b, mode="eager", adaptive=True, watch=True) for b in (1, 2))
    assert one._first_watch and one._watch_gap() == AutoTree.FIRST_WATCH
    assert not two._first_watch and two._watch_gap() > AutoTree.FIRST_WATCH
    assert one.probes and not two.probes  # (at batch 2 watched drafts are all it explores by)


# ---- in the loop ------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_auto_is_token_identical_for_every_drafter(family):
    model = FAMILIES[family]()
    small = mamba2(n_layer=1, seed=3)
    g = torch.Generator().manual_seed(0)
    motif = torch.randint(0, model.vocab_size, (5,), generator=g).tolist()
    prompts = [motif * 3, motif[:3] * 2 + [1]]
    ref = generate(model, prompts, method="autoregressive", max_new_tokens=24)
    kinds = set()
    for name in DRAFTER_NAMES:
        for method in ("stree", "chain"):
            drafter = make_drafter(name, drafter_model=small if name in NEEDS_MODEL else None,
                                   vocab_size=model.vocab_size)
            if method == "chain" and name == "ssm-beam":
                continue
            out = generate(model, prompts, drafter=drafter, method=method, max_new_tokens=24)
            assert out.sequences == ref.sequences, (name, method)
            # with made-up costs under which trees pay (not the clock's): trees certainly taken
            drafter = make_drafter(name, drafter_model=small if name in NEEDS_MODEL else None,
                                   vocab_size=model.vocab_size)
            out = generate(model, prompts, drafter=drafter, method=method, max_new_tokens=24,
                           tree=AutoTree(cheap(), chain=method == "chain"))
            assert out.sequences == ref.sequences, (name, method, "cheap trees")
            kinds |= {1 if n == 1 else 2 for n in out.stats.trees}
    assert 2 in kinds


@pytest.mark.parametrize("family", FAMILIES)
def test_seeded_sampling_with_deterministic_drafts_is_token_identical_to_plain_sampling(family):
    """Keyed draws (stree.sampling.keyed): with a seed, every drafter of deterministic drafts emits
    autoregressive decoding's sampled tokens, under the clock's choice and with trees certainly
    taken (made-up costs), trees and chains, and with rows of their own values (one greedy)."""
    model = FAMILIES[family]()
    small = mamba2(n_layer=1, seed=3)
    g = torch.Generator().manual_seed(0)
    motif = torch.randint(0, model.vocab_size, (5,), generator=g).tolist()
    prompts = [motif * 3, motif[:3] * 2 + [1]]
    deep = 0
    # (at 1.0 most drafts are rejected, each bonus drawn at its own depth's position; near 0 the
    # tiny models' peaked laws accept some, so walks go deep; beside a greedy row of its own)
    for sampling in (SamplingParams(1.0), SamplingParams.stack([SamplingParams(0.02), SamplingParams(0.0)])):
        ref = generate(model, prompts, method="autoregressive", max_new_tokens=24, sampling=sampling, seed=11)
        drafters = 0
        for name in DRAFTER_NAMES:
            make = lambda: make_drafter(name, drafter_model=small if name in NEEDS_MODEL else None,
                                        vocab_size=model.vocab_size, temperature=1.0)
            if make().random_drafts:
                continue
            drafters += 1
            for method in ("stree", "chain"):
                if method == "chain" and name == "ssm-beam":
                    continue
                out = generate(model, prompts, drafter=make(), method=method, max_new_tokens=24, sampling=sampling,
                               seed=11)
                assert out.sequences == ref.sequences, (name, method, sampling)
                out = generate(model, prompts, drafter=make(), method=method, max_new_tokens=24, sampling=sampling,
                               seed=11, tree=AutoTree(cheap(), chain=method == "chain"))
                assert out.sequences == ref.sequences, (name, method, sampling, "cheap trees")
                deep += sum(sum(a) for a in out.stats.accepted)
        assert drafters >= 4
    assert deep > 0  # (drafts were accepted: walks went past the root)


def test_a_seed_per_row_gives_each_row_what_it_draws_alone():
    """``seed=[...]``: every row draws with its own seed's keys, so its sampled tokens are those
    of a call of that row alone with that seed (plain steps, and deterministic drafts whatever
    the trees), whatever else shares the batch; a list of one is the int."""
    model = mamba2()
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5], [6, 7, 6, 7]]
    seeds = [5, 17, 5]
    for method, drafter in (("autoregressive", None), ("stree", "ngram"), ("stree", "stand-det")):
        kw = dict(method=method, max_new_tokens=16, temperature=1.0)
        make = lambda: None if drafter is None else make_drafter(drafter, vocab_size=model.vocab_size)
        batch = generate(model, prompts, drafter=make(), seed=seeds, **kw)
        alone = [generate(model, [p], drafter=make(), seed=s, **kw).sequences[0] for p, s in zip(prompts, seeds)]
        assert batch.sequences == alone, (method, drafter)
        assert generate(model, prompts[:1], drafter=make(), seed=[5], **kw).sequences[0] == alone[0]
    with pytest.raises(ValueError, match="seed holds 2 values for 3 rows"):
        generate(model, prompts, seed=[1, 2], temperature=1.0, max_new_tokens=2)
    with pytest.raises(TypeError, match=r"seed\[1\] must be an integer"):
        generate(model, prompts, seed=[1, "2", 3], temperature=1.0, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"seed\[2\] must be in"):
        generate(model, prompts, seed=(1, 2, -3), temperature=1.0, max_new_tokens=2)


def test_only_random_drafts_keep_a_seeded_choice_off_the_clock(monkeypatch):
    """Where the trees cannot change a seeded sampled output (deterministic drafts at keyed draws)
    the choice follows the clock and watches drafts, as greedy and unseeded ones do; random drafts'
    output follows the trees, so theirs follows the seed and the profile alone."""
    import stree.decoding.loop as loop

    made = []
    real = loop.auto_tree
    monkeypatch.setattr(loop, "auto_tree",
                        lambda *a, **kw: made.append((kw["adaptive"], kw["watch"])) or real(*a, **kw))
    model = mamba2()
    for name, seed, temperature in (("ngram", 3, 1.0), ("stand-det", 3, 1.0), ("stand", 3, 1.0), ("stand", None, 1.0),
                                    ("stand", 3, 0.0)):
        generate(model, [[1, 2, 3, 1, 2]], drafter=make_drafter(name, vocab_size=model.vocab_size), seed=seed,
                 temperature=temperature, max_new_tokens=4)
    # (drafts are watched during plain steps where they are deterministic: the plain steps then emit
    # what verifying them would have)
    assert made == [(True, True), (True, True), (False, False), (True, False), (True, True)]


def test_the_loop_learns_from_watched_drafts_and_outputs_stay_the_same():
    """Greedy, the n-gram drafter on looping text, a choice that expects nothing of drafts and
    never probes: the drafts it watches during plain steps bring trees back within the call,
    the output token for token autoregressive decoding's. Without watching it never drafts.
    ``tree="auto"`` watches drafters without a model only (a drafter model's drafting is its
    steps); a seeded sampled call of deterministic drafts may watch too, its tokens keyed draws
    that no tree changes (the same as plain sampled decoding's for the seed)."""
    model = mamba2()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.vocab_size, (4,), generator=g).tolist() * 4 for _ in range(2)]
    ref = generate(model, prompts, method="autoregressive", max_new_tokens=48)

    def pessimist(watch):
        return NeverProbes(cheap(), adaptive=True, watch=watch, rates=PathRates(prior=(0.02,) * 8))

    watching = pessimist(True)
    out = generate(model, prompts, max_new_tokens=48, tree=watching)
    assert out.sequences == ref.sequences
    assert out.stats.watched > 0 and max(out.stats.trees) > 1, out.stats.trees
    assert watching.scale["watch_ms"] > 0.0  # (the loop timed its watches: they space the next)
    plain = generate(model, prompts, max_new_tokens=48, tree=pessimist(False))
    assert plain.sequences == ref.sequences and plain.stats.watched == 0 and set(plain.stats.trees) == {1}
    sampled = dict(max_new_tokens=48, temperature=1.0, seed=1)
    assert generate(model, prompts, **sampled).sequences == generate(model, prompts, method="autoregressive",
                                                                     **sampled).sequences
    ssm = make_drafter("ssm-static", drafter_model=mamba2(n_layer=1, seed=3), vocab_size=model.vocab_size)
    assert generate(model, prompts, max_new_tokens=48, drafter=ssm).stats.watched == 0


def test_the_loop_drafts_only_where_the_drafter_can_and_outputs_stay_the_same():
    """Batch 1 and 2, an n-gram drafter whose ``can_draft`` (and ``can_draft_strong``, which the choice
    asks where drafts weak throughout lose) says False at every third question
    (whether it could draft or not: the loop must take its word; when it is right, test_ngram):
    the loop asks before drafting each tree the choice plans, drafts only where told True, and
    takes a plain step where told False; the output is autoregressive decoding's."""
    from stree.drafters.ngram import NGramDrafter

    model = mamba2()
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 4, 5]]
    for batch in (prompts[:1], prompts):
        log, drafter, answers = [], NGramDrafter(), itertools.cycle([True, True, False])
        propose = drafter.propose
        drafter.can_draft = drafter.can_draft_strong = lambda context: log.append(next(answers)) or log[-1]
        drafter.propose = lambda context, shape: (log.append("drafted"), propose(context, shape))[1]
        out = generate(model, batch, drafter=drafter, tree=AutoTree(cheap()), max_new_tokens=60)
        assert out.sequences == generate(model, batch, method="autoregressive", max_new_tokens=60).sequences
        asked = [x for x in log if x != "drafted"]
        assert asked.count(False) >= 3 and log.count("drafted") == asked.count(True)
        assert all((b == "drafted") == (a is True) for a, b in zip(log, log[1:] + [None]) if a != "drafted")
        assert out.stats.trees.get(1, 0) >= asked.count(False)


def test_the_loop_asks_the_drafter_about_the_rows_the_batch_waits_for():
    """Batch 2, one row with many more tokens to go: the choice weighs a tree by that row alone
    (``Rows.critical``), so the loop asks ``can_draft`` about it alone, and where it cannot draft
    takes a plain step without drafting for the other; the output is autoregressive decoding's."""
    from stree.drafters.ngram import NGramDrafter

    model = mamba2()
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [4, 5, 6, 4, 5, 6, 4, 5]]
    asked, drafter = [], NGramDrafter()
    can_draft, strong = drafter.can_draft, drafter.can_draft_strong
    drafter.can_draft = lambda context: asked.append(list(context.rows)) or can_draft(context)
    drafter.can_draft_strong = lambda context: asked.append(list(context.rows)) or strong(context)
    out = generate(model, prompts, drafter=drafter, tree=AutoTree(cheap()), max_new_tokens=[60, 6])
    assert out.sequences == generate(model, prompts, method="autoregressive", max_new_tokens=[60, 6]).sequences
    assert asked and all(rows == [0] for rows in asked)


def test_the_loop_tells_a_seeded_choice_the_steps_its_call_has_left():
    """Seeded sampling with STAND's random drafts and trees that lose: the choice's first probe
    falls due after s plain steps of a long call (as the steps left it is told say); a call of
    s + 4 tokens, which has 4 steps left there, takes none."""

    class Logged(AutoTree):
        def plan(self, behind=None, left=None):
            shape = super().plan(behind, left)
            self.log.append((left(), self._probing))
            return shape

    model = mamba2()

    def run(max_new_tokens):
        auto = Logged(CostProfile(1.0, (2, 4, 8, 16), (4.0,) * 4))
        auto.log = []
        out = generate(model, [[1, 2, 3, 1, 2, 3]], drafter=make_drafter("stand"), tree=auto, temperature=1.0,
                       seed=3, max_new_tokens=max_new_tokens)
        return auto.log, out

    log, out = run(400)
    s = 400 - next(left for left, probing in log if probing)
    assert 2 * AutoTree.PROBE < s < 200 and set(out.stats.trees) != {1}
    log, out = run(s + 4)
    assert not any(probing for _, probing in log) and set(out.stats.trees) == {1}
    assert sum(out.stats.new_tokens) == s + 4


def test_explicit_trees_are_honoured_exactly(monkeypatch):
    import stree.decoding.autotree as autotree_module

    model = mamba2()
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2]]
    shape = TreeShape.paper13()
    monkeypatch.setattr(autotree_module, "cost_profile", lambda *a, **k: pytest.fail("an explicit tree has no costs"))
    out = generate(model, prompts, tree=shape, max_new_tokens=12)
    assert set(out.stats.trees) == {13}
    ar = generate(model, prompts, method="autoregressive", tree="auto", max_new_tokens=12)  # a no-op there
    assert set(ar.stats.trees) == {1}
    with pytest.raises(ValueError, match="tree must be 'auto'"):
        generate(model, prompts, tree="paper13", max_new_tokens=4)
    with pytest.raises(ValueError, match="drafts trees, but method='chain'"):
        generate(model, prompts, tree=AutoTree(cheap()), method="chain", max_new_tokens=4)


def test_the_same_seed_repeats_the_output_under_auto():
    """Deterministic drafts are verified at keyed draws: a seed gives autoregressive decoding's
    sampled output whatever trees the clock chose (the machine's own profile, which on a loaded
    machine may choose none) and with a profile that makes trees pay. Random drafts (STAND's) are
    verified with a sequential stream, so their trees follow the seed and the profile alone, and
    repeat too."""
    model = mamba2()
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5]]
    plain = generate(model, prompts, max_new_tokens=20, temperature=1.0, seed=3, method="autoregressive")
    a = generate(model, prompts, max_new_tokens=20, temperature=1.0, seed=3)
    b = generate(model, prompts, max_new_tokens=20, temperature=1.0, seed=3, tree=AutoTree(cheap()))
    assert a.sequences == b.sequences == plain.sequences
    assert sum(n for size, n in b.stats.trees.items() if size > 1) > 0  # (trees were verified)
    runs = [generate(model, prompts, max_new_tokens=20, temperature=1.0, seed=3,
                     drafter=make_drafter("stand", vocab_size=model.vocab_size)) for _ in range(2)]
    assert runs[0].sequences == runs[1].sequences and runs[0].stats.trees == runs[1].stats.trees


def test_sampling_law_holds_while_the_choice_switches_and_falls_back():
    """Costs that make the choice move between plain steps and trees of several sizes: the law
    holds (:mod:`markov_law`)."""

    class Quick(AutoTree):
        PROBE = 1  # a probe after one plain step: the choice moves within the first tokens
        PROBE_SHARE = 1.0  # (probes may cost what they like)

    out, pvalue = sampled_under(Quick(CostProfile(1.0, (2, 3, 4, 6), (1.3, 1.5, 1.6, 2.2)), sizes=(2, 3, 4, 6)))
    assert out.stats.trees == {4: 1, 1: 2, 2: 1}  # a tree, plain steps, a probe of another size
    assert pvalue > SEEDED_P, pvalue


@pytest.mark.parametrize("needs_laws", [False, True])
def test_plain_steps_compute_no_target_laws_for_a_drafter_that_learns_from_tokens(needs_laws):
    """A plain step chosen over drafting hands STAND (plain_target False) the emitted tokens alone:
    no target softmax, top-K or larger transfer that autoregressive decoding does not pay. Steps
    with a tree, and every step of a drafter that needs the laws, still get them."""
    class NeverProbe(AutoTree):
        PROBE_SHARE = 0.0

    model = mamba2()
    for auto, plain in ((NeverProbe(expensive()), True), (AutoTree(cheap()), False)):
        drafter = make_drafter("stand", vocab_size=model.vocab_size)
        drafter.plain_target = needs_laws
        seen, observe = [], drafter.observe
        drafter.observe = lambda context, tokens, target: (seen.append(target is None), observe(context, tokens, target))
        out = generate(model, [[1, 2, 3, 1, 2, 3, 1, 2]], drafter=drafter, tree=auto, max_new_tokens=12)
        assert set(out.stats.trees) == ({1} if plain else set(out.stats.trees) - {1}) and len(seen) > 1
        assert seen == [False] + [plain and not needs_laws] * (len(seen) - 1)  # the prefill's token: its law


def test_plain_runs_follow_one_another_where_only_watches_fall_due():
    """Plain steps win and no probe is ever due: each run of plain steps ends where a watched draft
    falls due, and the next run starts with it, no plain step weighed alone between them (its
    plan, the drafter reading its token and the choice learning it made such a step half as dear
    again as a run's). The call's first plain step is the one weighed alone."""
    class WatchOnly(AutoTree):
        PROBE_SHARE = 0.0
        WATCH_SHARE = 1e6  # (watches WATCH_EVERY plain steps apart, whatever they take by the clock)

    auto = WatchOnly(CostProfile(1.0, (2, 4, 8, 16), (60.0, 65.0, 70.0, 80.0)), adaptive=True, watch=True)
    weighed, record = [], auto.record
    auto.record = lambda tree, *args, **kw: (weighed.append(tree is None), record(tree, *args, **kw))[1]
    model = mamba2()
    out = generate(model, [[1, 2, 3, 1, 2, 3, 1, 2]], drafter=make_drafter("ngram", vocab_size=model.vocab_size),
                   tree=auto, max_new_tokens=60)
    assert set(out.stats.trees) == {1} and out.stats.watched >= 3  # (runs ended where each fell due)
    assert weighed == [True]


def test_a_plain_runs_steps_do_the_work_of_autoregressive_steps_and_count_themselves(monkeypatch):
    """A step of a plain run (decided ahead by the choice) neither drafts nor shares a tree nor takes a clock lap of
    its own beyond an autoregressive step's: only the steps weighed alone do (here, the call's first). The run's
    steps are still counted and timed for the choice, and the output is autoregressive decoding's."""
    from stree.decoding import loop

    shared, laps, runs = [], [], []
    share_tree, lap, plain_steps = loop.share_tree, loop._Clock.lap, AutoTree.plain_steps
    monkeypatch.setattr(loop, "share_tree", lambda *a: (shared.append(1), share_tree(*a))[1])
    monkeypatch.setattr(loop._Clock, "lap", lambda self: (laps.append(1), lap(self))[1])
    monkeypatch.setattr(AutoTree, "plain_steps", lambda self, steps, times_ms=None: (
        runs.append((steps, len(times_ms or []))), plain_steps(self, steps, times_ms))[1])

    class PlainOnly(AutoTree):
        PROBE_SHARE = 0.0
        WATCH = False

    model = mamba2()
    prompts, n = [[1, 2, 3, 1, 2, 3, 1, 2]], 40
    auto = PlainOnly(CostProfile(1.0, (2, 4, 8, 16), (60.0, 65.0, 70.0, 80.0)), adaptive=True, watch=True)
    out = generate(model, prompts, drafter=make_drafter("ngram", vocab_size=model.vocab_size), tree=auto,
                   max_new_tokens=n)
    ref_laps = len(laps)
    assert out.sequences == generate(model, prompts, method="autoregressive", max_new_tokens=n).sequences
    assert set(out.stats.trees) == {1} and out.stats.target_forwards == n - 1
    run_steps = sum(steps for steps, _ in runs)
    assert run_steps == n - 2 and all(steps == timed for steps, timed in runs)  # (every step but the first)
    assert len(shared) == out.stats.target_forwards - run_steps == 1
    laps.clear()
    generate(model, prompts, method="autoregressive", max_new_tokens=n)
    assert ref_laps - len(laps) == 1  # (the one step weighed alone: its drafting lap)


def test_where_the_drafter_keeps_having_nothing_it_is_asked_again_after_runs_of_plain_steps():
    """Trees are wanted but the drafter has nothing to draft: after WAIT_AFTER steps in a row asked
    alone, the drafter is asked again after runs of 1, 2, 4, ... (at most WAIT_MOST) plain steps,
    not at every step; once it can draft again, trees come back at the next asking, and the output
    is plain decoding's."""
    model = mamba2()
    drafter = make_drafter("ngram", vocab_size=model.vocab_size)
    asked, can_draft = [], drafter.can_draft  # (the row's length at each asking)
    drafter.can_draft = lambda context: asked.append(int(context.lengths[0])) or len(asked) > 8 and can_draft(context)
    drafter.can_draft_strong = drafter.can_draft  # (what the choice asks where drafts weak throughout lose)
    assert_asked_after_runs(model, drafter, asked)


class Unclocked(AutoTree):
    """A choice by the profile's costs alone (by this machine's clock trees may not pay)."""

    def record(self, tree, tokens=None, counts=None, rows=None, elapsed_ms=None, ids=None):
        super().record(tree, tokens, counts, rows, None, ids)

    def plain_steps(self, steps, times_ms=None):
        super().plain_steps(steps, None)


def assert_asked_after_runs(model, drafter, asked):
    """Decode with ``drafter`` (its first 8 askings, whose row lengths it appends to ``asked``, bring
    nothing) where trees are wanted: the output is plain decoding's; WAIT_AFTER askings one step apart,
    then each after a run of plain steps (until the choice, every draft found wanting, stops wanting
    trees: the ledger's probes ask it then); then trees."""
    auto = Unclocked(cheap(), adaptive=True, rates=PathRates(prior=(0.9,) + (0.3,) * 7))
    prompt = [[1, 2, 3, 1, 2, 3, 1, 2]]
    out = generate(model, prompt, drafter=drafter, tree=auto, max_new_tokens=120)
    assert out.sequences == generate(model, prompt, max_new_tokens=120).sequences
    gaps = np.diff(asked[:AutoTree.WAIT_AFTER + 3]).tolist()
    assert gaps == [1] * (AutoTree.WAIT_AFTER - 1) + [1 + min(1 << i, AutoTree.WAIT_MOST) for i in range(3)], gaps
    assert out.stats.trees.keys() - {1}


def weak_rated(accepted: float) -> PathRates:
    """Rates whose weak nodes were verified 50 times at every depth and rank, a share ``accepted`` of them
    accepted (the strong ones at the prior's)."""
    rates = PathRates(prior=(0.9,) + (0.3,) * 7)
    weak = slice(PathRates.RANKS, 2 * PathRates.RANKS)
    rates.reached[:, weak], rates.accepted[:, weak] = 50.0, 50.0 * accepted
    rates.version += 1
    return rates


def test_where_drafts_weak_throughout_lose_the_drafter_is_asked_for_a_strong_node():
    """The choice weighs a draft weak throughout at its best size against a plain step: where it loses
    (weak nodes seldom accepted), the loop asks the drafter whether it has a draft with a strong node
    (``can_draft_strong``) and drafts nothing where it has not; where such drafts pay, whether it has any
    (``can_draft``), as for a probe, which verifies whatever there is. The output is plain decoding's."""
    assert AutoTree(cheap(), adaptive=True, rates=weak_rated(0.02)).strong_only
    assert not AutoTree(cheap(), adaptive=True, rates=weak_rated(0.98)).strong_only
    model = mamba2()
    prompt = [[1, 2, 3, 1, 2, 3, 1, 2]]
    plain = generate(model, prompt, max_new_tokens=60).sequences
    probed = []
    for accepted, strong, drafts in ((0.02, False, False), (0.02, True, True), (0.98, False, True)):
        drafter = make_drafter("ngram", vocab_size=model.vocab_size)
        auto = Unclocked(cheap(), adaptive=True, rates=weak_rated(accepted))
        proposed, propose = [], drafter.propose  # (whether the choice was probing at each draft)
        drafter.propose = lambda context, shape: proposed.append(auto._probing) or propose(context, shape)
        drafter.can_draft_strong = lambda context: strong
        out = generate(model, prompt, drafter=drafter, tree=auto, max_new_tokens=60)
        assert out.sequences == plain
        assert (False in proposed) is drafts, (accepted, strong)
        probed.append(True in proposed)
    assert probed[0]  # (where only strong drafts are asked for, probes still draft what there is)


def test_where_drafts_keep_being_found_wanting_the_drafter_is_asked_again_after_runs_of_plain_steps():
    """Trees are wanted and the drafter drafts, but nothing it drafts is kept (its drafts hold the root
    alone): as where it has nothing to draft, after WAIT_AFTER such steps in a row it is asked again
    after runs of 1, 2, 4, ... (at most WAIT_MOST) plain steps, not at every step; once its drafts are
    kept again, trees come back, and the output is plain decoding's. (Counted apart, drafts found
    wanting were drafted at every step: n-gram at batch 1 lost a tenth of its gain over plain decoding.)"""
    model = mamba2()
    drafter = make_drafter("ngram", vocab_size=model.vocab_size)
    asked, propose = [], drafter.propose  # (the row's length at each draft)

    def wanting(context, shape):
        asked.append(int(context.lengths[0]))
        draft = propose(context, shape)
        if len(asked) > 8:
            return draft
        valid = torch.zeros_like(draft.tokens, dtype=torch.bool)
        valid[:, 0] = True
        return TokenTree.from_shape(draft.static_shape, draft.tokens, valid=valid)

    drafter.propose = wanting
    drafter.can_draft = drafter.can_draft_strong = lambda context: True
    assert_asked_after_runs(model, drafter, asked)


def test_no_watched_draft_is_drafted_where_the_next_step_drafts_anyway():
    """A watched draft due where the choice wants trees (the next step drafts one) would be
    settled by that tree with nothing seen: none is drafted then, and the plain steps since the
    last one go on counting, so one is drafted at once where trees are no longer wanted."""
    auto = AutoTree(cheap(), adaptive=True, watch=True, rates=PathRates(prior=(0.9,) + (0.3,) * 7))
    auto._unwatched = auto._watch_gap()
    assert auto.wants_trees() and auto.watch_shape() is None
    auto.scale["tree"] = 50.0  # (trees now dear: plain steps win)
    auto._pick, auto._probe_size = auto._pick_sizes()
    assert not auto.wants_trees() and auto.watch_shape() is not None


def test_a_plain_run_lasts_until_the_pending_watched_draft_is_settled():
    """Watches fall due WATCH_EVERY plain steps apart, but the loop drafts no other while one is
    pending, for as many plain steps as its draft is deep: each run of plain steps lasts until the
    pending one is settled, and ends where the next is drafted. (Ended where one fell due alone,
    runs of one step followed one another until the pending one was settled, each run's end taking
    half a step's time more.)"""
    class WatchOnly(AutoTree):
        PROBE_SHARE = 0.0
        WATCH_SHARE = 1e6  # (watches WATCH_EVERY plain steps apart, whatever they take by the clock)

    # (likely first children: the drafts watched are chains deeper than WATCH_EVERY)
    auto = WatchOnly(CostProfile(1.0, (2, 4, 8, 16), (60.0, 65.0, 70.0, 80.0)), adaptive=True, watch=True,
                     rates=PathRates(prior=(0.95, 0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.07)))
    assert auto.prefix(auto._probe_size).max_depth + 1 > AutoTree.WATCH_EVERY
    runs, plain_steps = [], auto.plain_steps
    auto.plain_steps = lambda steps, times_ms=None: (runs.append(steps), plain_steps(steps, times_ms))[1]
    model = mamba2()
    out = generate(model, [[1, 2, 3, 1, 2, 3, 1, 2]], drafter=make_drafter("ngram", vocab_size=model.vocab_size),
                   tree=auto, max_new_tokens=80)
    assert set(out.stats.trees) == {1} and out.stats.watched >= 3
    # each run ends where a watch is drafted (the first run before the first one, the last at the call's end)
    assert len(runs) <= out.stats.watched + 2 and min(runs[1:-1]) > 1, runs


def test_a_watched_draft_settles_once_every_row_has_emitted_past_its_depth():
    """The loop counts plain steps down to a watched draft's settling (reading the rows at every
    step cost a hundredth of a step): each draft is learned from once every row has emitted one
    token past its depth (the bonus's), or finished, never earlier or later, whatever the draft's
    depth; a row that finished early still teaches what it emitted (and the call's end settles
    the one pending then with what its rows emitted)."""
    class WatchOnly(AutoTree):
        PROBE_SHARE = 0.0
        WATCH_SHARE = 1e6  # (watches WATCH_EVERY plain steps apart, whatever they take by the clock)

    auto = WatchOnly(CostProfile(1.0, (2, 4, 8, 16), (60.0, 65.0, 70.0, 80.0)), adaptive=True, watch=True)
    settled, watched = [], auto.watched

    def logged(draft, after, served, ids, drafting_ms=None):
        depth = draft.static_shape.max_depth if draft.static_shape is not None else draft.n - 1
        settled.append((depth, [len(a) for a in after], ids.tolist()))
        return watched(draft, after, served, ids, drafting_ms)

    auto.watched = logged
    model = mamba2()
    out = generate(model, [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 4, 5, 6]], tree=auto, max_new_tokens=[60, 21],
                   drafter=make_drafter("ngram", vocab_size=model.vocab_size))
    assert set(out.stats.trees) == {1} and len(settled) >= 4
    assert len({depth for depth, _, _ in settled}) > 1 or settled[0][0] > 1
    ends = [len(s) - n for s, n in zip(out.sequences, out.prompt_lengths)]
    for depth, seen, ids in settled[:-1]:  # (the last may be one the call's end settled, short)
        assert max(seen) == depth + 1
        assert all(n == depth + 1 or ends[r] < 60 and n <= depth + 1 for n, r in zip(seen, ids))
    assert max(settled[-1][1]) <= settled[-1][0] + 1
    assert any(seen[ids.index(1)] < depth + 1 for depth, seen, ids in settled if 1 in ids)  # (row 1 ended inside one)

def test_a_plain_run_starts_right_after_a_probe():
    """Plain steps win, probes a dozen steps apart: the plain steps after each probe run as a run
    decided at once (its first step weighed alone had taken 0.48 ms beyond a run's 0.6, at batch
    2 compiled), and the probe's wake is still charged to it, from the run's steps' times."""
    class Quick(AutoTree):
        PROBE_SHARE = 5.0  # (trees priced as hopeless, whatever the clock says: probes still come)

    auto = Quick(CostProfile(1.0, (2, 4, 8, 16), (60.0, 65.0, 70.0, 80.0)), adaptive=True)
    events, record, plain_steps, wake = [], auto.record, auto.plain_steps, []
    auto.record = lambda tree, *args, **kw: (events.append("plain" if tree is None else "tree"),
                                             record(tree, *args, **kw))[1]

    def logged_plain_steps(steps, times_ms=None):
        events.append("run")
        before = auto.scale["tree"]
        plain_steps(steps, times_ms)
        wake.append(auto.scale["tree"] != before)

    auto.plain_steps = logged_plain_steps
    model = mamba2()
    out = generate(model, [[1, 2, 3, 1, 2, 3, 1, 2]], drafter=make_drafter("ngram", vocab_size=model.vocab_size),
                   tree=auto, max_new_tokens=80)
    assert events.count("tree") >= 2 and max(out.stats.trees) > 1
    after = [b for a, b in zip(events, events[1:]) if a == "tree"]
    assert after and set(after) == {"run"}
    assert any(w for e, w in zip([e for e in events if e == "run"], wake))

@pytest.mark.parametrize("name", ["ngram", "stand", "ssm-static"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_plain_runs_decided_ahead_change_nothing_but_the_work(name, temperature):
    """Plain steps the chooser decides ahead (no probe due, nothing re-planned) run without
    planning or drafting, the drafter shown their tokens at the run's end in one call: the same
    tokens (greedy, and seeded sampling), the same steps and trees as asking every step."""
    class Quick(AutoTree):
        PROBE_SHARE = 0.5  # probes a dozen steps apart: several within the call

    class StepByStep(Quick):
        def plain_ahead(self, pending=0):
            return 0

    model, small = mamba2(), mamba2(n_layer=1, seed=3)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6]]
    outs, calls = [], []
    for kind in (Quick, StepByStep):
        drafter = make_drafter(name, drafter_model=small if name in NEEDS_MODEL else None, vocab_size=model.vocab_size,
                               temperature=temperature)
        seen, observe = [], drafter.observe
        drafter.observe = lambda context, tokens, target: (seen.append(tokens), observe(context, tokens, target))
        out = generate(model, prompts, drafter=drafter, tree=kind(expensive()), max_new_tokens=60,
                       temperature=temperature, seed=5 if temperature else None)
        outs.append(out)
        calls.append(seen)
    assert outs[0].sequences == outs[1].sequences and outs[0].stats.trees == outs[1].stats.trees
    assert outs[0].stats.accepted == outs[1].stats.accepted and len(outs[0].stats.trees) > 1  # plain and probes
    assert len(calls[0]) < len(calls[1]) and max(len(t) for c in calls[0] for t in c) > 2  # runs shown at once
    joined = lambda c: [sum((step[i] for step in c), []) for i in range(2)]  # noqa: E731
    assert joined(calls[0]) == joined(calls[1])  # every token shown, in order


@pytest.mark.parametrize("name", ["ngram", "stand"])
def test_the_calls_last_plain_run_is_not_taught_to_a_drafter_serving_that_call_alone(name):
    """At a call's end, the tokens of its last run of plain steps are shown to a drafter that may
    draft again (later calls), not to one serving the call alone (``Drafter.serves_one_call``:
    nothing reads what it would learn); the output, the steps and the chooser's record of the run
    are the same."""
    class NeverDrafts(AutoTree):  # every step plain, in one run decided ahead
        def plan(self, behind=None, left=None):
            return None

        def plain_ahead(self, pending=0):
            return self.NEVER

        def watch_shape(self):
            return None

    model = mamba2()
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6]]
    outs, shown, recorded = [], [], []
    for alone in (False, True):
        drafter = make_drafter(name, vocab_size=model.vocab_size)
        drafter.serves_one_call = alone
        seen, observe = [], drafter.observe
        drafter.observe = lambda context, tokens, target: (seen.append(tokens), observe(context, tokens, target))
        auto = NeverDrafts(expensive())
        runs, plain_steps = [], auto.plain_steps
        auto.plain_steps = lambda steps, ms: (runs.append(steps), plain_steps(steps, ms))
        outs.append(generate(model, prompts, drafter=drafter, tree=auto, max_new_tokens=30))
        shown.append(seen)
        recorded.append(runs)
    assert outs[0].sequences == outs[1].sequences and outs[0].stats.trees == outs[1].stats.trees == {1: 29}
    assert recorded[0] == recorded[1] == [28]  # (the first plain step weighed alone, then the run)
    assert shown[0][:-1] == shown[1] and len(shown[1]) == 2  # the prefill's token, the first step's
    assert shown[0][-1] == [t[2:] for t in outs[0].new_tokens]  # the run's 28, to the drafter that outlives the call


def test_a_resting_call_decodes_plainly_and_leaves_a_drafter_serving_it_alone_untouched(monkeypatch):
    """Where ``AutoTree.rests`` says a call rests, ``tree="auto"`` decodes it as plain decoding does:
    its drafter (one serving the call alone) neither reset, built, asked nor shown a token, every step
    plain, the output plain decoding's (sampled at a seed too), and the call's stats say it rested. A
    drafter that may draft again (later calls learn from what it is shown) is never let rest."""
    model = mamba2()
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6]]
    plain = generate(model, prompts, max_new_tokens=30, method="autoregressive")
    # (the process's first call measures the cost profile, drafting with its drafter: not a call's work)
    generate(model, prompts, drafter=make_drafter("ngram", vocab_size=model.vocab_size), max_new_tokens=4)
    monkeypatch.setattr(AutoTree, "rests", classmethod(lambda cls, scale: True))
    for alone in (True, False):
        drafter = make_drafter("ngram", vocab_size=model.vocab_size)
        drafter.serves_one_call = alone
        used = []
        for name in ("reset", "build", "can_draft", "can_draft_strong", "propose", "observe"):
            method = getattr(drafter, name)
            setattr(drafter, name, lambda *a, _name=name, _method=method: used.append(_name) or _method(*a))
        out = generate(model, prompts, drafter=drafter, max_new_tokens=30)
        assert out.sequences == plain.sequences and out.stats.rested is alone
        if alone:
            assert used == [] and out.stats.trees == {1: 29}
        else:
            assert "observe" in used
    # sampled at a seed, a resting call draws what plain decoding draws (keyed draws)
    drafter = make_drafter("ngram", vocab_size=model.vocab_size)
    drafter.serves_one_call = True
    sampled = generate(model, prompts, drafter=drafter, max_new_tokens=30, temperature=1.0, seed=3)
    assert sampled.stats.rested
    assert sampled.sequences == generate(model, prompts, max_new_tokens=30, temperature=1.0, seed=3,
                                         method="autoregressive").sequences


def test_iterations_after_rows_left_the_batch_are_timed_into_the_calls_own_scales():
    """Eager, a finished row leaves the device batch, whose iterations then cost what a smaller
    batch's do: the choice still learns them by the clock (a probe there is charged what it took),
    into scales of the call alone; the scales it carries on to later calls of the profile (its whole
    batch's) are as the rows left them."""
    class Timed(AutoTree):
        def record(self, tree, tokens=None, counts=None, rows=None, elapsed_ms=None, ids=None):
            times.append((self._narrowed, elapsed_ms))
            return super().record(tree, tokens, counts, rows, elapsed_ms, ids)

        def plain_steps(self, steps, times_ms=None):
            times.append((self._narrowed, None if times_ms is None else len(times_ms)))
            return super().plain_steps(steps, times_ms)

        def narrowed(self):
            carried.update(self.scale)  # (the scales as the rows left)
            return super().narrowed()

    model = mamba2()
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 4, 5, 6]]
    times, carried, scale = [], {}, {"plain": 1.0, "tree": 1.0}
    auto = Timed(cheap(), adaptive=True, scale=scale)
    out = generate(model, prompts, tree=auto, max_new_tokens=[40, 8])
    assert out.sequences == generate(model, prompts, method="autoregressive", max_new_tokens=[40, 8]).sequences
    after = [t for narrowed, t in times if narrowed]
    assert len(after) >= 3 and all(t is not None and t > 0 for t in after), times
    assert scale == carried and auto.scale is not scale and auto.scale["steps"] > scale["steps"]


def test_a_probe_teaches_the_share_of_drafts_kept_as_the_choice_would_have_judged_it():
    """A probe is verified whatever it is worth; what it teaches the share of drafts kept is
    whether the choice would have kept it, as a watched draft's does: a full draft where trees
    are cheap raises a share that had fallen, the same draft where trees cost six steps lowers
    it. (Left out, a share that a call's first steps had taken to 0.08, the drafter having nothing
    to draft, stayed there while probes accepted 8 and 14 of 14 nodes: STAND deterministic, batch 1,
    decoded plain for most of each call.)"""
    for profile, share, moved in ((cheap(), 0.2, AutoTree.ADAPT * 0.8), (expensive(), 0.8, -AutoTree.ADAPT * 0.8)):
        auto = AutoTree(profile, adaptive=True)
        auto.scale.update(verified=share, bank=100.0)
        auto._plain_run = AutoTree.PROBE
        plan = auto.plan()
        assert plan is not None and auto._probing
        kept = auto.choose(full_draft(plan), np.ones(1, dtype=np.bool_))
        assert kept is not None  # (a probe is verified whatever it is worth)
        assert auto.scale["verified"] == pytest.approx(share + moved)


def test_the_setup_loads_every_compiled_helper_a_probe_uses():
    """In a fresh process, after the choice's setup (``_load_helpers``), a probe's choice, record
    and a watched draft load no compiled helper of the choice's modules for new argument types: a
    probe's draft weighed as the choice would have kept it had loaded one inside the first probe's
    timed iteration (6.5 ms against 0.9 predicted), and the ledger then priced probes at three
    times their cost and stopped probing for about a thousand plain steps."""
    script = """
import numpy as np, torch
from numba.core.registry import CPUDispatcher
from stree.decoding import acceptance, autotree, plans
from stree.decoding.cost import CostProfile
from stree.tree import TokenTree
autotree._load_helpers()
calls = [f for m in (acceptance, plans) for f in vars(m).values() if isinstance(f, CPUDispatcher)]
before = [len(f.signatures) for f in calls]
auto = autotree.AutoTree(CostProfile(1.0, (2, 4, 8, 16), (1.05, 1.1, 1.2, 1.4)), adaptive=True, watch=True)
auto.scale.update(bank=100.0)
auto._plain_run = auto.PROBE
plan = auto.plan()
assert auto._probing
draft = TokenTree.from_shape(plan, torch.arange(plan.n)[None] + 100)
kept = auto.choose(draft, np.ones(1, dtype=np.bool_), np.arange(1))
auto.record(kept, np.array([[100, 7]]), np.array([2]), np.arange(1), elapsed_ms=1.0, ids=np.arange(1))
auto.watched(draft, [np.array([100, 101])], np.ones(1, dtype=np.bool_), np.arange(1))
print([f.__name__ for f, n in zip(calls, before) if len(f.signatures) != n])
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[]"
