"""Dynamic trees (TreeBudget): the level-by-level planner against a sequential best-first search and
against brute-force path enumeration; losslessness by chi-square for the SSM drafter (STAND's
beside its static trees in test_stand.py) and the test's power against a rule that looks at the
draw; greedy identity on every family."""

import heapq

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tiny_models import FAMILIES, mamba2

from stree.drafters import DraftContext, dynamic
from stree.drafters.dynamic import Level, SlotRates, grow
from stree.drafters.ngram import NGramDrafter
from stree.drafters.ssm import SSMDrafter
from stree.drafters.stand import STANDDrafter, STANDStore
from stree.decoding.loop import generate
from stree.testing import cell_counts, chi_square
from stree.tree import TokenTree, TreeBudget, TreeShape, tree_index, tree_spec

from test_ssm import markov_pair
from test_stand import markov, stale_store

SEEDED_P = 1e-3  # fixed seeds: each chi-square test is deterministic; correct code passes this
WRONG_P = 1e-6  # and the rule that looks at the draw falls below this


def path_law(path: tuple, K: int, V: int, stochastic: bool):
    """A law for every path, a pure function of it: K distinct ids, probabilities (a random
    number of them zero, at least two not, not summing to 1) and a draw order (zeros last)."""
    g = np.random.default_rng([K, V, *path])
    ids = g.choice(V, K, replace=False)
    probs = g.dirichlet(np.ones(K)) * 0.9
    probs[g.integers(2, K + 1):] = 0.0
    if stochastic:
        live = np.flatnonzero(probs > 0)
        order = np.concatenate([g.permutation(live), np.flatnonzero(probs == 0)])
    else:
        order = np.argsort(-probs, kind="stable")
    return ids, probs, order


def planned(roots, budget, K, V, stochastic):
    """The planner over ``path_law``, with the paths it was asked to expand."""
    paths, orders = [], []

    def expand(level: Level):
        nonlocal paths
        if level.parent_pos is None:
            paths = [(int(t),) for t in level.tokens]
        else:
            paths = [paths[p] + (int(t),) for p, t in zip(level.parent_pos, level.tokens)]
        laws = [path_law(p, K, V, stochastic) for p in paths]
        orders[:] = [o for _, _, o in laws]
        return np.stack([i for i, _, _ in laws]), np.stack([p for _, p, _ in laws])

    return grow(budget, np.array(roots), expand, lambda probs: np.stack(orders), stochastic)


def best_first(root, budget, K, V, stochastic):
    """The obvious sequential search: pop the slot of highest priority, add its draw, offer the
    parent's next slot and the child's first. A slot's priority: the node's value times the
    probability the draw has (deterministic) or is expected to have given the earlier draws
    (random: the smallest over this and earlier slots), never above the node's own slot's."""
    value, slot_prio, key, heap, kept = {(root,): 1.0}, {(root,): np.inf}, {(root,): ()}, [], []

    def expected(qs, j):  # E[q(draw j) | draws 0..j-1] = sum q^2 / sum q over the rest
        rest = qs[j:]
        return (rest * rest).sum() / rest.sum() if rest.sum() > 0 else 0.0

    def offer(path, j):
        ids, probs, order = path_law(path, K, V, stochastic)
        qs = (probs / probs.sum())[order]
        if j >= K or qs[j] == 0:
            return
        r = min(expected(qs, i) for i in range(j + 1)) if stochastic else qs[j]
        # ties: shallower first, then by the slot numbers along the path (the planner's creation order)
        heapq.heappush(heap, (-min(value[path] * r, slot_prio[path]), len(path), key[path] + (j,), path, j))

    offer((root,), 0)
    while heap and len(kept) < budget.nodes - 1:
        prio, _, slot_key, path, j = heapq.heappop(heap)
        ids, probs, order = path_law(path, K, V, stochastic)
        child = path + (int(ids[order[j]]),)
        value[child], slot_prio[child] = value[path] * probs[order[j]] / probs.sum(), -prio
        key[child] = slot_key
        kept.append(child)
        offer(path, j + 1)
        if len(child) - 1 < budget.depth:
            offer(child, 0)
    return kept


def tree_paths(tree, row):
    """Every valid non-root node's token path, and the tree's structure checked on the way."""
    parents, tokens, valid = tree.parents[row].tolist(), tree.tokens[row].tolist(), tree.valid[row].tolist()
    paths = {0: (tokens[0],)}
    for v in range(1, tree.n):
        if valid[v]:
            assert valid[parents[v]]
            paths[v] = paths[parents[v]] + (tokens[v],)
        else:
            assert parents[v] == 0  # padding hangs under the root
    return paths


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10**6), B=st.integers(1, 3), N=st.integers(2, 24), depth=st.integers(1, 5),
       K=st.integers(2, 4), extra_v=st.integers(0, 4), stochastic=st.booleans())
# fewer slots kept than drawn: a slot's priority still looks past the kept ones (once got wrong)
@example(seed=1, B=2, N=3, depth=2, K=3, extra_v=1, stochastic=True)
def test_the_planner_keeps_what_best_first_search_keeps(seed, B, N, depth, K, extra_v, stochastic):
    V = K + extra_v
    budget = TreeBudget(N, min(depth, N - 1))
    roots = np.random.default_rng(seed).integers(0, V, B)
    tree = planned(roots, budget, K, V, stochastic)
    assert tree.parents.shape == (B, N)
    ref = tree_index(tree.parents)  # the planner's own index: the validated one's
    for name in ("parents", "depth", "pre", "last"):
        assert torch.equal(getattr(tree.index, name), getattr(ref, name))
    assert tree.index.memo("max_depth", lambda: None) == int(ref.depth.max())
    for r in range(B):
        paths = tree_paths(tree, r)
        want = best_first(int(roots[r]), budget, K, V, stochastic)
        assert sorted(p for v, p in paths.items() if v) == sorted(want)
        kids = tree.children(r)
        for v, path in paths.items():  # each node's children: its first draws, in draw order
            ids, probs, order = path_law(path, K, V, stochastic)
            got = [tree.tokens[r, c].item() for c in kids[v] if tree.valid[r, c]]
            assert got == ids[order[: len(got)]].tolist()
            if stochastic and got:
                assert tree.child_ids[r, v].tolist() == ids.tolist()
                assert torch.allclose(tree.child_probs[r, v].double(), torch.from_numpy(probs), atol=1e-7)


@settings(max_examples=30, deadline=None)
@given(root=st.integers(0, 5), N=st.integers(2, 30), depth=st.integers(1, 3), K=st.integers(2, 3))
def test_deterministic_trees_are_the_most_probable_paths(root, N, depth, K):
    """EAGLE-2's tree: the nodes - 1 most probable paths, found by enumerating them all."""
    V = 6
    budget = TreeBudget(N, min(depth, N - 1))
    scored = {}

    def walk(path, p):
        if len(path) - 1 == budget.depth:
            return
        ids, probs, _ = path_law(path, K, V, False)
        for i, q in zip(ids.tolist(), (probs / probs.sum()).tolist()):
            if q > 0:
                scored[path + (i,)] = p * q
                walk(path + (i,), p * q)

    walk((root,), 1.0)
    want = sorted(scored, key=scored.get, reverse=True)[: N - 1]
    tree = planned([root], budget, K, V, False)
    assert sorted(p for v, p in tree_paths(tree, 0).items() if v) == sorted(want)
    assert tree.child_ids is None  # deterministic drafts verify one-hot


def levelwise(root, budget, K, V, stochastic):
    """Per row, level by level, in plain Python: every kept node of the level offers its slots if
    it is among the level's ``width`` best kept nodes; the best ``nodes - 1`` slots so far stay."""
    entries = {(root,): (np.inf, (), 1.0)}  # path -> (priority, creation key, value)
    level = [(root,)]

    def top(paths, n):
        return sorted(paths, key=lambda p: (-entries[p][0], len(p), entries[p][1]))[:n]

    for d in range(budget.depth):
        for path in top(level, budget.width or len(level)):
            ids, probs, order = path_law(path, K, V, stochastic)
            qs = (probs / probs.sum())[order]
            prio, key, value = entries[path]
            for j in range(min(K, budget.nodes - 1)):
                if qs[j] == 0:
                    break
                rest = [(qs[i:] ** 2).sum() / qs[i:].sum() for i in range(j + 1)]
                r = min(rest) if stochastic else qs[j]  # a raw value: the draw's own probability
                entries[path + (int(ids[order[j]]),)] = (min(prio, value * r), key + (j,), value * qs[j])
        kept = set(top(list(entries), budget.nodes))
        entries = {p: e for p, e in entries.items() if p in kept}  # a dropped slot never comes back
        level = sorted((p for p in kept if len(p) == d + 2), key=lambda p: entries[p][1])
        if not level:
            break
    return sorted(top(list(entries), budget.nodes)[1:])


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10**6), N=st.integers(2, 24), depth=st.integers(1, 5), width=st.integers(1, 3),
       K=st.integers(2, 4), stochastic=st.booleans())
def test_a_width_expands_the_best_nodes_of_each_level(seed, N, depth, width, K, stochastic):
    V = K + 2
    budget = TreeBudget(N, min(depth, N - 1), width)
    roots = np.random.default_rng(seed).integers(0, V, 2)
    tree = planned(roots, budget, K, V, stochastic)
    for r in range(2):
        paths = tree_paths(tree, r)
        assert sorted(p for v, p in paths.items() if v) == levelwise(int(roots[r]), budget, K, V, stochastic)
        parents = [int(tree.parents[r, v]) for v in paths if v]
        for d in range(budget.depth):  # at most ``width`` nodes of a level have children
            assert len({p for p in parents if len(paths[p]) == d + 1}) <= width


@pytest.mark.parametrize("stochastic, calibrate, width", [(True, True, None), (False, True, None),
                                                         (True, False, None), (True, True, 1), (True, False, 1)])
def test_ssm_dynamic_drafts_are_lossless_on_a_markov_target(stochastic, calibrate, width):
    """20k rows at T = 1, a 7-node budget: the joint of the first 3 tokens against the exact law
    (calibrated: the trees of steps 2 and 3 already depend on what was accepted before; width 1:
    one node per level expands, chosen by priority among the level's draws)."""
    target, draft_model = markov_pair()
    prompt = [1, 2, 1, 2, 0, 1]
    # max_length: room for the prompt, 3 tokens and a tree (the default 4096 holds 650 MB for 20k rows)
    drafter = SSMDrafter(draft_model, stochastic=stochastic, top_k=4, seed=3, max_length=32)
    budget = TreeBudget(7, 3, width=width, calibrate=calibrate)
    out = generate(target, [prompt] * 20_000, drafter=drafter, tree=budget, max_new_tokens=3, temperature=1.0, seed=5)
    accepted = torch.tensor([sum(a) for a in out.stats.accepted], dtype=torch.float)
    assert accepted.mean() > 0.5
    assert chi_square(cell_counts(torch.tensor(out.new_tokens), 5), target.joint_law(prompt, 3))[2] > SEEDED_P


class KeepTheLikelierDraw(STANDDrafter):
    """The naive rule in miniature: draw two children without replacement, keep the one the law
    gives more probability, declare it a plain draw. What the planner must never do."""

    def propose(self, context, shape=None):
        two = super().propose(context, TreeShape.full(2, 1))
        law = dict(child_ids=two.child_ids[:, :2], child_probs=two.child_probs[:, :2])
        p = two.child_probs[:, 0]
        mass = torch.stack([(p * (two.child_ids[:, 0] == two.tokens[:, c, None])).sum(1) for c in (1, 2)], 1)
        best = torch.where(two.valid[:, 2] & (mass[:, 1] > mass[:, 0]), two.tokens[:, 2], two.tokens[:, 1])
        tokens = torch.stack([two.tokens[:, 0], best], 1)
        return TokenTree.from_shape(TreeShape.chain(1), tokens, child_ids=law["child_ids"], child_probs=law["child_probs"])


def test_chi_square_rejects_keeping_a_draw_by_its_own_probability():
    """Keeping a child because what it drew is likely makes it no longer a draw from the law
    the verifier is told: the test above, on the same target and store, must reject it."""
    model = markov()
    prompt = [1, 2, 1, 2, 0, 1, 2, 1]
    drafter = KeepTheLikelierDraw(stale_store(5, seed=9), learn=False, seed=2)
    out = generate(model, [prompt] * 40_000, drafter=drafter, tree=TreeShape.chain(1), max_new_tokens=3,
                   temperature=1.0, seed=4)
    assert chi_square(cell_counts(torch.tensor(out.new_tokens), 5), model.joint_law(prompt, 3))[2] < WRONG_P


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity(family):
    """SSM drafter (deterministic and stochastic drafts) and STAND over a budget: the
    autoregressive output, drafts accepted where the drafter is the target's twin (its first
    child is the target's choice; the tiny models' flat laws make the trees wide, not deep)."""
    target = FAMILIES[family]()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.vocab_size, (n,), generator=g).tolist() for n in (5, 8)]
    ref = generate(target, prompts, method="autoregressive", max_new_tokens=14)
    for stochastic in (False, True):
        drafter = SSMDrafter(FAMILIES[family](), stochastic=stochastic, vocab_size=target.vocab_size)
        out = generate(target, prompts, drafter=drafter, tree=TreeBudget(10, 4), max_new_tokens=14)
        assert out.sequences == ref.sequences
        assert sum(map(sum, out.stats.accepted)) >= 10
    store = STANDStore()
    for _ in range(2):
        out = generate(target, prompts, drafter=STANDDrafter(store, TreeBudget(12)), max_new_tokens=14)
        assert out.sequences == ref.sequences


def test_slot_rates_count_what_the_verifier_did():
    """A hand-built tree: root -> a (rank 0), b (rank 1); a -> c (rank 0). Emitting b then d:
    a reached and rejected, b accepted, then b has no children (nothing counted there)."""
    rates = SlotRates()
    rates.cover(2)  # two ranks, at the prior
    prior_acc, prior_reached = rates.accepted.copy(), rates.reached.copy()
    tree = TokenTree(torch.tensor([[-1, 0, 0, 1]]), torch.tensor([[9, 4, 5, 6]]), valid=torch.ones(1, 4, dtype=torch.bool))
    slot = np.array([[[-1, 0], [0, 0.9], [1, 0.3], [0, 0.6]]])
    rates.remember([7], tree, slot)
    rates.record([7], [[5, 8]])
    assert (rates.reached - prior_reached)[0, 7] == 1 and (rates.accepted - prior_acc)[0, 7] == 0  # a, bin 7
    assert (rates.reached - prior_reached)[1, 2] == 1 and (rates.accepted - prior_acc)[1, 2] == 1  # b, bin 2
    assert (rates.reached - prior_reached).sum() == 2
    rates.remember([7], tree, slot)
    rates.record([7], [[4, 6, 1]])  # a then c accepted, c is a leaf
    assert (rates.accepted - prior_acc)[0, 7] == 1 and (rates.accepted - prior_acc)[0, 4] == 1
    rates.record([7], [[4]])  # nothing remembered any more: nothing counted
    assert (rates.reached - prior_reached).sum() == 4
    # a slot's chance: h_j times the chance the slots before it were all rejected (never above an
    # earlier slot's); deterministic drafts' confidence is the token's own probability
    h = rates.accepted / rates.reached
    r, factor = np.empty(2), np.empty(2)
    dynamic._slots(np.array([0.9, 0.1]), False, True, rates.accepted, rates.reached, r, factor)
    assert np.allclose(r, [0.9, 0.1])
    assert np.allclose(factor, [h[0, 7], min(h[0, 7], (1 - h[0, 7]) * h[1, 0])])
    # random drafts' confidence: the expected probability of the next draw, sum q^2 / sum q
    dynamic._slots(np.array([0.2, 0.5, 0.3]), True, False, rates.accepted, rates.reached, r := np.empty(3),
                   factor := np.empty(3))
    assert np.allclose(r, [0.38, min(0.38, 0.34 / 0.8), min(0.38, 0.3)]) and np.allclose(factor, r)


def test_calibration_learns_that_a_twin_drafter_is_right():
    """A drafter that is the target's twin at T = 0: its laws are flat, so raw trees stay wide,
    but its first choice is always accepted and the calibrated trees learn to go deep."""
    target = FAMILIES["hybrid"]()
    prompts = [[1, 2, 3, 4], [9, 8, 7, 6, 5]]
    per_step = {}
    for calibrate in (False, True):
        drafter = SSMDrafter(FAMILIES["hybrid"](), stochastic=False, vocab_size=target.vocab_size)
        out = generate(target, prompts, drafter=drafter, tree=TreeBudget(12, 8, calibrate=calibrate),
                       max_new_tokens=40)
        per_step[calibrate] = sum(map(sum, out.stats.accepted)) / sum(map(len, out.stats.accepted))
    assert per_step[True] > per_step[False] + 1


def test_rows_grow_different_trees_and_the_budget_is_spent():
    """Per-row parents; a row with a confident drafter grows deep, and every node is used when
    the drafter offers enough candidates."""
    target = mamba2()
    seen = []
    drafter = SSMDrafter(mamba2(seed=5), vocab_size=target.vocab_size)
    prompts = [[1, 2, 3, 4], [9, 8, 7, 6, 5]]
    generate(target, prompts, drafter=drafter, tree=TreeBudget(16, 6), max_new_tokens=6,
             on_step=lambda rows, tree, res: seen.append(tree))
    tree = seen[0]
    assert tree.parents.shape == (2, 16) and bool(tree.valid.all())
    assert not torch.equal(tree.parents[0], tree.parents[1])
    assert int(tree.depth.max()) <= 6


def test_budgets_and_specs_are_checked():
    assert tree_spec("dynamic:32") == TreeBudget(32, 31)
    assert tree_spec("dynamic:32x6") == TreeBudget(32, 6)
    assert tree_spec("dynamic:32x6:raw") == TreeBudget(32, 6, calibrate=False)
    assert tree_spec("dynamic:32x6w4") == TreeBudget(32, 6, 4)
    assert tree_spec("dynamic:32w4:raw") == TreeBudget(32, None, 4, calibrate=False)
    assert tree_spec("paper13") == TreeShape.paper13()
    for spec in ("dynamic:1", "dynamic:x", "dynamic:8x8", "dynamic:5000", "dynamic:8:fast", "dynamic:8w0", "dynamic:8x"):
        with pytest.raises(ValueError, match="bad tree spec"):
            tree_spec(spec)
    with pytest.raises(TypeError, match="nodes must be an int"):
        TreeBudget(8.0)
    with pytest.raises(ValueError, match="depth must be in"):
        TreeBudget(8, 0)
    with pytest.raises(TypeError, match="calibrate must be a bool"):
        TreeBudget(8, 2, calibrate="yes")
    with pytest.raises(ValueError, match="width must be >= 1"):
        TreeBudget(8, 2, 0)


def test_a_budget_needs_a_drafter_that_grows_trees(monkeypatch):
    """The n-gram drafter, beam search and method='chain' refuse a budget before any cache."""
    target = mamba2()
    monkeypatch.setattr(type(target), "allocate_cache", lambda *a, **k: pytest.fail("allocated before the check"))
    with pytest.raises(ValueError, match="NGramDrafter drafts static tree shapes"):
        generate(target, [[1, 2, 3]], drafter=NGramDrafter(), tree=TreeBudget(8), max_new_tokens=4)
    with pytest.raises(ValueError, match="SSMDrafter drafts static tree shapes"):
        generate(target, [[1, 2, 3]], drafter=SSMDrafter(mamba2(), mode="beam"), tree=TreeBudget(8), max_new_tokens=4)
    with pytest.raises(ValueError, match="NGramDrafter drafts static tree shapes"):  # called directly, too
        NGramDrafter().propose(DraftContext(torch.tensor([[1, 2, 3]]), torch.tensor([3]), [0]), TreeBudget(8))
    with pytest.raises(ValueError, match="for method='stree'"):
        generate(target, [[1, 2, 3]], method="chain", tree=TreeBudget(8), max_new_tokens=4)
