"""Greedy rows beside sampled ones (``DraftContext.greedy``): a drafter of random drafts (STAND,
the SSM drafter) drafts a greedy row's likeliest tokens, exactly as its deterministic twin drafts
that row, and draws for the others in the same call, the laws attached; with every row greedy it
drafts as its twin, without laws. Static shapes and grown trees."""

import numpy as np
import pytest
import torch
from tiny_models import mamba2

from stree.drafters import DraftContext, PerRowDrafter, STANDDrafter, STANDStore
from stree.drafters.ssm import SSMDrafter
from stree.tree import TreeBudget, TreeShape

V = 12
GREEDY = np.array([True, False, True, False])
SHAPES = [TreeShape.full(2, 3), TreeBudget(10, 3)]


def random_store(compiled: bool = True) -> STANDStore:
    """An entry of 4 candidates under every 1- and 2-gram of a 12-token vocabulary."""
    g = np.random.default_rng(0)
    store = STANDStore(top_k=4, max_n=2, compiled=compiled)
    keys = [(a,) for a in range(V)] + [(a, b) for a in range(V) for b in range(V)]
    ids = np.stack([g.permutation(V)[:4] for _ in keys])
    probs = g.dirichlet(np.ones(4), len(keys)).astype(np.float32)
    store.update(keys, torch.from_numpy(ids), torch.from_numpy(probs))
    return store


def contexts(greedy):
    tokens = torch.randint(0, V, (4, 9), generator=torch.Generator().manual_seed(1))
    return DraftContext(tokens, torch.tensor([5, 9, 7, 3]), [0, 1, 2, 3], greedy)


def same_row(a, b, r) -> bool:
    valid = lambda t: torch.ones_like(t.tokens[r], dtype=torch.bool) if t.valid is None else t.valid[r]  # noqa: E731
    return (torch.equal(a.parents.expand_as(a.tokens)[r], b.parents.expand_as(b.tokens)[r])
            and torch.equal(valid(a), valid(b)) and torch.equal(a.tokens[r][valid(a)], b.tokens[r][valid(b)]))


def check_twins(make, shape):
    """``make(stochastic, seed)``: a fresh drafter. Greedy rows as the twin's, sampled rows drawn."""
    twin = make(False, 0).propose(contexts(None), shape)
    assert twin.child_probs is None
    drew = False
    for seed in range(6):
        mixed = make(True, seed).propose(contexts(GREEDY), shape)
        assert mixed.child_probs is not None  # (the sampled rows' laws; a greedy row's is never read)
        for r in np.flatnonzero(GREEDY):
            assert same_row(mixed, twin, r), (seed, r)
        drew |= any(not same_row(mixed, twin, r) for r in np.flatnonzero(~GREEDY))
    assert drew  # the sampled rows were drawn, not ranked
    alone = make(True, 0).propose(contexts(np.ones(4, dtype=bool)), shape)
    assert alone.child_probs is None
    assert all(same_row(alone, twin, r) for r in range(4))


@pytest.mark.parametrize("shape", SHAPES, ids=["static", "grown"])
def test_stand_drafts_greedy_rows_as_its_deterministic_twin(shape):
    store = random_store()
    check_twins(lambda stochastic, seed: STANDDrafter(store, stochastic=stochastic, seed=seed, learn=False), shape)


@pytest.mark.parametrize("shape", SHAPES, ids=["static", "grown"])
def test_the_ssm_drafter_drafts_greedy_rows_as_its_deterministic_twin(shape):
    model = mamba2(vocab_size=V, seed=4)
    check_twins(lambda stochastic, seed: SSMDrafter(model, stochastic=stochastic, seed=seed), shape)


def test_stand_compiled_and_reference_drafts_agree_row_by_row():
    """The store's compiled draft and its reference take one flag per row alike."""
    fast, ref = random_store(), random_store(compiled=False)
    plan = TreeShape.full(2, 3).plan
    tails = [[1, 2], [3], [4, 5], [6, 7]]
    noise = np.random.default_rng(3).exponential(size=len(tails) * len(plan.nodes) * 4)
    drafts = ref.draft(tails, plan, ~GREEDY, noise, 0.5), fast.draft(tails, plan, ~GREEDY, noise, 0.5)
    for x, y in zip(*drafts):
        assert np.array_equal(x, y)
    assert not drafts[0][2][~GREEDY].any()  # weak marks on the greedy rows' drafts alone


def test_per_row_drafters_mixing_greedy_and_sampled_rows_verify_one_hot():
    """Rows of one-drafter-per-row: the greedy rows' trees carry no law, so the batch's carries
    none (one-hot verification is exact for drafts of any law)."""
    store = random_store()
    drafter = PerRowDrafter(lambda: STANDDrafter(store, TreeShape.full(2, 3), learn=False))
    tree = drafter.propose(contexts(GREEDY))
    twin = STANDDrafter(store, TreeShape.full(2, 3), stochastic=False, learn=False).propose(contexts(None))
    assert tree.child_probs is None and tree.valid is not None
    assert all(same_row(tree, twin, r) for r in np.flatnonzero(GREEDY))
