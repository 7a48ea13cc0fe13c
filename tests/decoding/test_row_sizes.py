"""Each row its own tree size under tree="auto": the sizes against a brute-force search of every
choice, the chooser taking them only where packed passes pay, the packed tree itself, and in the
decoding loop greedy identity for both test families and the exact sampling law while the rows'
sizes scatter."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from markov_law import sampled_under
from tiny_models import FAMILIES

from stree.decoding.autotree import AutoTree
from stree.decoding.plans import best_rows
from stree.decoding.cost import CostProfile
from stree.decoding.loop import generate
from stree.drafters.registry import make_drafter
from stree.tree import TokenTree, TreeShape, pack_trees

SEEDED_P = 1e-3


@st.composite
def chances_and_costs(draw):
    B, n = draw(st.integers(1, 3)), draw(st.integers(2, 5))
    # each row's node chances, non-increasing along the prefix as a best-first plan's are
    v = np.array([[1.0] + sorted(draw(st.lists(st.floats(0, 1), min_size=n - 1, max_size=n - 1)), reverse=True)
                  for _ in range(B)])
    steps = draw(st.lists(st.floats(0, 3), min_size=B * n, max_size=B * n))
    cost = np.concatenate([[np.inf], 1.0 + np.cumsum(steps)])  # cost[t] of t nodes in all, never falling
    return v, cost


@given(chances_and_costs())
def test_row_sizes_maximise_what_the_least_row_gains_per_millisecond(case):
    """Over every choice of sizes (each row at least a 2-node tree), the best rate of
    (1 + the least row's expected drafts accepted) / cost(all nodes) is best_rows's."""
    v, cost = case
    B, n = v.shape
    sizes, rate = best_rows(v, np.ones(B, dtype=np.bool_), cost)
    gain = lambda b, m: v[b, 1:m].sum()  # noqa: E731
    least = lambda ms: min(gain(b, m) for b, m in enumerate(ms))  # noqa: E731
    rates = [(1 + least(ms)) / cost[sum(ms)] for ms in itertools.product(range(2, n + 1), repeat=B) if least(ms) > 0]
    best = max(rates, default=-1.0)
    assert rate == pytest.approx(best, rel=1e-9)
    if rate > 0:
        assert (1 + least(sizes)) / cost[sizes.sum()] == pytest.approx(rate, rel=1e-9)


def test_rows_the_batch_does_not_wait_for_take_no_more_than_the_others_nor_what_they_did_not_draft():
    v = np.array([[1.0, 0.9, 0.8, 0.7, 0.6], [1.0, 0.1, 0.1, 0.1, 0.1], [1.0, 0.5, 0.2, 0.1, 0.1],
                  [1.0, 0.3, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    cost = 1.0 + 0.01 * np.arange(26.0)
    sizes, _ = best_rows(v, np.array([True, False, True, False, False]), cost)
    assert sizes.tolist() == [2, 5, 5, 2, 1]


# ---- the choice ---------------------------------------------------------------------------
def trained(per_row=None, adaptive=False) -> AutoTree:
    """A chooser whose row 0 accepted its first child at every step and row 1 at every other."""
    auto = AutoTree(CostProfile(1.0, (2, 4, 8, 16), (1.05, 1.1, 1.2, 1.4)), per_row=per_row, adaptive=adaptive)
    step = TokenTree.from_shape(TreeShape.chain(1), torch.tensor([[1, 10], [1, 10]]))
    for i in range(30):
        auto.record(step, np.array([[10, 0], [10 if i % 2 else 999, 0]]), np.array([2, 1 + i % 2]), np.arange(2),
                    ids=np.array([0, 1]))
    return auto


def test_rows_of_different_acceptance_get_sizes_of_their_own_where_packed_passes_pay():
    """Both rows count: the row that accepts more reaches the level the other can gain with fewer
    nodes, so a packed pass of fewer nodes brings the same; where packed passes cost too much,
    or the choice is told not to, both rows share one size."""
    auto = trained(per_row=True)
    draft = TokenTree.from_shape(auto.prefix(8), torch.arange(16).reshape(2, 8) + 100)
    both, ids = np.array([True, True]), np.array([0, 1])
    cut = auto.choose(draft, both, ids)
    assert cut.row_sizes is not None and cut.row_sizes[0] < cut.row_sizes[1] == cut.n
    assert auto._predicted[0] == "packed"
    assert cut.valid.sum(1).tolist() == list(cut.row_sizes)  # past a row's size, nodes are invalid
    assert torch.equal(cut.tokens, draft.tokens[:, : cut.n])
    auto.scale["packed"] = 100.0
    assert auto.choose(draft, both, ids).row_sizes is None
    assert trained(per_row=False).choose(draft, both, ids).row_sizes is None

def test_rows_take_sizes_of_their_own_by_default_only_where_switched_on_and_the_choice_follows_the_clock(monkeypatch):
    assert not trained(adaptive=True).per_row  # off by default: on the CPU measured, packed passes lost
    monkeypatch.setattr(AutoTree, "PER_ROW", True)
    assert trained(adaptive=True).per_row and not trained().per_row  # (the clock learns what packing costs)
    assert not AutoTree(CostProfile(1.0, (2, 4), (1.1, 1.2)), sizes=(2, 4), adaptive=True).per_row  # fixed shapes


def test_packed_passes_learn_their_cost_from_the_clock():
    auto = trained(per_row=True, adaptive=True)
    draft = TokenTree.from_shape(auto.prefix(8), torch.arange(16).reshape(2, 8) + 100)
    kinds = []
    for _ in range(6):  # packed passes take twice what was predicted, padded ones what was
        cut = auto.choose(draft, np.array([True, True]), np.array([0, 1]))
        kind, predicted = auto._predicted
        kinds.append(kind)
        assert (cut.row_sizes is not None) == (kind == "packed")
        auto.record(cut, np.array([[100, 0], [999, 0]]), np.array([1, 1]), np.arange(2),
                    elapsed_ms=predicted * (2 if kind == "packed" else 1), ids=np.array([0, 1]))
    assert kinds[0] == "packed" and "tree" in kinds  # once packed passes are known dear, padded ones win
    assert auto.scale["packed"] > 1.1 and auto.scale["tree"] == pytest.approx(1.0)


# ---- the packed tree ------------------------------------------------------------------------
def test_a_tree_with_row_sizes_packs_each_rows_prefix():
    shape = TreeShape.paper13()
    tokens = torch.arange(26).reshape(2, 13)
    valid = torch.arange(13)[None] < torch.tensor([[5], [13]])
    tree = TokenTree.from_shape(shape, tokens, valid=valid, row_sizes=(5, 13))
    packed_tokens, trees = tree.packed()
    assert torch.equal(packed_tokens[0], torch.cat([tokens[0, :5], tokens[1]]))
    want = pack_trees([shape.parents[:5], shape.parents])
    assert torch.equal(trees.parents, want.parents) and torch.equal(trees.cu_seqlens, want.cu_seqlens)
    assert tree.packed()[1] is trees  # built once per shape and sizes
    free = TokenTree(shape.parents_tensor(), tokens, valid=valid, row_sizes=(5, 13))  # not a static shape
    assert torch.equal(free.packed()[1].parents, want.parents)
    assert tree.to("cpu").row_sizes == (5, 13)


@pytest.mark.parametrize("row_sizes, error, match", [
    ((5,), TypeError, "a tuple of 2 ints"), ([5, 13], TypeError, "a tuple of 2 ints"),
    ((5.0, 13), TypeError, "a tuple of 2 ints"), ((0, 13), ValueError, r"in \[1, 13\]"),
    ((5, 12), ValueError, "13 the largest"), ((4, 13), ValueError, "past its row's size invalid"),
])
def test_bad_row_sizes_are_refused(row_sizes, error, match):
    valid = torch.arange(13)[None] < torch.tensor([[5], [13]])
    with pytest.raises(error, match=match):
        TokenTree.from_shape(TreeShape.paper13(), torch.zeros(2, 13, dtype=torch.long), valid=valid,
                             row_sizes=row_sizes)
    with pytest.raises(ValueError, match="no row_sizes"):
        TokenTree.from_shape(TreeShape.paper13(), torch.zeros(2, 13, dtype=torch.long)).packed()


# ---- in the loop ------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_is_unchanged_when_rows_take_sizes_of_their_own(family, monkeypatch):
    """Rows of a repeating motif and of noise, under costs where trees and packed passes pay: the
    rows' sizes part, each such step is one packed pass (a float32 Mamba2 model's: its one-call greedy
    iteration, each row's prefix alone), and every row is what plain decoding gives."""
    from stree.kernels.cpu import mamba_step

    model = FAMILIES[family]()
    passes = []
    packed = type(model).forward_packed
    monkeypatch.setattr(type(model), "forward_packed", lambda *a, **k: passes.append(a[2].batch) or packed(*a, **k))
    one_call = mamba_step.MambaStep.tree_greedy
    monkeypatch.setattr(mamba_step.MambaStep, "tree_greedy",  # (a[8]: the rows' sizes)
                        lambda *a, **k: (passes.append(a[8]) if a[8] is not None else None) or one_call(*a, **k))
    g = torch.Generator().manual_seed(0)
    motif = torch.randint(0, model.vocab_size, (5,), generator=g).tolist()
    noise = torch.randint(0, model.vocab_size, (12,), generator=g).tolist()
    prompts = [motif * 3, noise, motif[:3] * 2 + [1], noise[:7]]
    budgets = [24, 6, 24, 6]  # (the noise rows end early: the batch waits for the motif rows)
    ref = generate(model, prompts, method="autoregressive", max_new_tokens=budgets)
    auto = AutoTree(CostProfile(1.0, (2, 4, 8, 16), (1.05, 1.1, 1.2, 1.4)), per_row=True)
    out = generate(model, prompts, drafter=make_drafter("ngram", vocab_size=model.vocab_size), tree=auto,
                   max_new_tokens=budgets)
    assert out.sequences == ref.sequences
    assert out.stats.packed == len(passes) > 0


def test_sampling_law_holds_while_the_rows_sizes_scatter():
    """Every tree cut to random sizes per row and scored packed: the law holds (:mod:`markov_law`)."""
    draws = np.random.default_rng(5)

    class Scattered(AutoTree):
        def _row_sizes(self, v, active, cost, m):
            sizes = draws.integers(1, v.shape[1] + 1, size=v.shape[0])
            sizes[draws.integers(v.shape[0])] = v.shape[1]
            return sizes

    out, pvalue = sampled_under(Scattered(CostProfile(1.0, (2, 3, 4, 6), (1.01, 1.02, 1.03, 1.04)), per_row=True))
    assert out.stats.packed == sum(n for s, n in out.stats.trees.items() if s > 1) > 0
    assert pvalue > SEEDED_P, pvalue
