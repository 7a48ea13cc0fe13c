"""STAND: store arithmetic and eviction, Gumbel-top-k law, noise hygiene, tree filling, and
losslessness of its drafts on an exact Markov target (chi-square), including a stale store."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jit_loads import unloaded_after
from tiny_models import FAMILIES

from stree.drafters import DraftContext, STANDDrafter, STANDStore, TargetTop
from stree.drafters.stand import race_top_k
from stree.decoding.loop import generate
from stree.testing import MarkovLM, cell_counts, chi_square
from stree.tree import TreeBudget, TreeShape


def t(*v, dtype=torch.float32):
    return torch.tensor([list(v)], dtype=dtype)


def test_merge_is_the_running_mean_over_the_union_then_top_k():
    store = STANDStore(capacity=8, top_k=3)
    store.update([(5,)], t(1, 2, 3, dtype=torch.long), t(0.5, 0.3, 0.2))
    store.update([(5,)], t(2, 4, 1, dtype=torch.long), t(0.6, 0.3, 0.1))
    ids, probs, count = store.entry((5,))
    # union: 1: .5/2 + .1/2 = .3, 2: .3/2 + .6/2 = .45, 3: .2/2 = .1, 4: .3/2 = .15 -> top 3
    assert ids.tolist() == [2, 1, 4] and torch.allclose(probs, torch.tensor([0.45, 0.3, 0.15])) and count == 2
    store.update([(5,)], t(3, 9, 2, dtype=torch.long), t(0.9, 0.06, 0.04))
    ids, probs, count = store.entry((5,))
    # k = 2: 2/3 old + 1/3 new: 2: .3 + .04/3, 1: .2, 4: .1, 3: .3, 9: .02 -> 3 (.3), 2 (.3133), 1 (.2)
    assert ids.tolist() == [2, 3, 1] and count == 3
    assert torch.allclose(probs, torch.tensor([0.3 + 0.04 / 3, 0.3, 0.2]))
    assert store.entry((4,)) is None and len(store) == 1


def test_repeated_keys_in_one_update_merge_in_order():
    one, two = STANDStore(top_k=4), STANDStore(top_k=4)
    rows = [(t(1, 2, 3, 0, dtype=torch.long), t(0.4, 0.3, 0.2, 0.1)), (t(3, 5, 6, 7, dtype=torch.long), t(0.7, 0.1, 0.1, 0.1)),
            (t(8, 1, 2, 3, dtype=torch.long), t(0.25, 0.25, 0.25, 0.25))]
    one.update([(1, 2), (9,), (1, 2)] , torch.cat([rows[0][0], rows[1][0], rows[2][0]]),
               torch.cat([rows[0][1], rows[1][1], rows[2][1]]))
    for key, (ids, probs) in zip([(1, 2), (9,), (1, 2)], rows):
        two.update([key], ids, probs)
    for key in [(1, 2), (9,)]:
        a, b = one.entry(key), two.entry(key)
        assert a[0].tolist() == b[0].tolist() and torch.equal(a[1], b[1]) and a[2] == b[2]
    assert one.entry((1, 2))[2] == 2


def test_capacity_is_bounded_and_least_recently_updated_entries_go_first():
    store = STANDStore(capacity=10, top_k=2, evict_fraction=0.3)
    dist = (t(1, 2, dtype=torch.long), t(0.5, 0.5))
    for k in range(10):
        store.update([(k,)], *dist)
    store.update([(0,)], *dist)  # refresh key 0: now 1, 2, 3 are the least recently updated
    store.update([(100,)], *dist)
    assert len(store) == 8 and store.entry((100,)) is not None and store.entry((0,)) is not None
    assert all(store.entry((k,)) is None for k in (1, 2, 3))
    for k in range(200, 230):
        store.update([(k,)], *dist)
        assert len(store) <= 10
    assert store.ids.shape == (10, 2)  # packed, preallocated
    # one update with more distinct keys than the store holds keeps the most recent ones
    store.update([(k,) for k in range(300, 340)], dist[0].expand(40, 2), dist[1].expand(40, 2))
    assert len(store) <= 10 and store.entry((339,)) is not None and store.entry((300,)) is None


def test_the_race_is_sequential_sampling_without_replacement():
    """Ordered triples from 5 candidates (stored unnormalised): chi-square against the exact law of
    three sequential draws without replacement from the renormalised entry (60 cells)."""
    drafter = STANDDrafter(STANDStore(top_k=5), seed=1)
    stored = np.array([0.32, 0.2, 0.16, 0.08, 0.04], dtype=np.float32)  # mass 0.8: a truncated entry
    m = 120_000
    order = race_top_k(np.broadcast_to(stored, (m, 5)), 3, drafter._noise_window(m * 5).reshape(m, 5))
    p = stored / stored.sum()
    triples = list(itertools.permutations(range(5), 3))
    exact = torch.tensor([float(p[a] * p[b] / (1 - p[a]) * p[c] / (1 - p[a] - p[b])) for a, b, c in triples])
    index = {tr: i for i, tr in enumerate(triples)}
    counts = torch.bincount(torch.tensor([index[tuple(r)] for r in order.tolist()]), minlength=len(triples))
    assert chi_square(counts, exact)[2] > 1e-3
    # and a zero-probability candidate is never drawn ahead of a positive one
    order = race_top_k(np.broadcast_to(np.array([0.0, 0.5, 0.0, 0.5]), (1000, 4)), 2, np.random.default_rng(0).exponential(size=(1000, 4)))
    assert set(order.flatten().tolist()) == {1, 3}


def test_noise_is_never_reused(monkeypatch):
    store = STANDStore(top_k=4)
    for k in range(6):
        store.update([(k,)], t(k, (k + 1) % 6, (k + 2) % 6, (k + 3) % 6, dtype=torch.long), t(0.4, 0.3, 0.2, 0.1))
    drafter = STANDDrafter(store, TreeShape.full(2, 3), noise_size=50)
    used = []
    real = STANDStore.draft

    def spy(self, tails, plan, stochastic, noise, weak_n=0):
        out = real(self, tails, plan, stochastic, noise, weak_n)
        used.append(noise[: out[-1]].copy())  # the values this draft consumed
        return out
    monkeypatch.setattr(STANDStore, "draft", spy)
    tokens = torch.randint(0, 6, (3, 12))
    for step in range(10):
        drafter.propose(DraftContext(tokens, torch.tensor([4 + step, 5, 12]), [0, 1, 2]), TreeShape.full(2, 3))
    values = np.concatenate(used)
    assert len(values) > 3 * 50  # the buffer was refreshed several times
    assert len(np.unique(values)) == len(values)  # no value used twice


def hand_store():
    return hand_store_of(4)


def hand_store_of(max_n):
    store = STANDStore(top_k=3, max_n=max_n)
    store.update([(1,), (2, 1), (7, 2, 1), (4,)],
                 torch.tensor([[2, 3, 0], [5, 6, 0], [8, 0, 0], [3, 0, 0]]),
                 torch.tensor([[0.5, 0.3, 0.1], [0.6, 0.3, 0.0], [0.9, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    return store


def test_children_come_from_the_longest_match_and_short_entries_prune():
    store = hand_store()
    shape = TreeShape.from_children([3, 2, 1])  # root: 3 children; node 1: 2; node 2: 1
    ctx = DraftContext(torch.tensor([[7, 2, 1], [9, 2, 1], [3, 3, 1]]), torch.tensor([3, 3, 3]), [0, 1, 2])
    tree = STANDDrafter(store, shape, stochastic=False, learn=False).propose(ctx)
    # row 0 matches (7,2,1): one candidate (8), so root slots 2 and 3 are invalid; 8 has no entry
    assert tree.tokens[0, :2].tolist() == [1, 8] and tree.valid[0].tolist() == [True, True, False, False, False, False, False]
    # row 1 matches (2,1): 5 then 6 (the 0-probability slot stays invalid); (…,1,5) has no entry
    assert tree.tokens[1, :3].tolist() == [1, 5, 6] and tree.valid[1].tolist() == [True, True, True, False, False, False, False]
    # row 2 only matches (1,): 2, 3, 0; node 1 (token 2) has no entry, node 2 (token 3) none either
    assert tree.tokens[2, :4].tolist() == [1, 2, 3, 0] and tree.valid[2, :4].all()
    assert tree.child_probs is None  # deterministic drafts: one-hot verification
    # weak: drawn from the entry of an n-gram shorter than max_n (4): row 0's (7, 2, 1) is three tokens, row
    # 1's (2, 1) two, row 2's (1,) one, whatever the stored probability (0.9 for row 0's 8)
    assert tree.weak[:, 1:4].tolist() == [[True, False, False], [True, True, False], [True] * 3]
    assert not tree.weak[:, 4:].any()
    whole = STANDDrafter(hand_store_of(3), shape, stochastic=False, learn=False).propose(ctx)
    assert whole.weak[:, 1:4].tolist() == [[False, False, False], [True, True, False], [True] * 3]
    stochastic = STANDDrafter(store, shape, learn=False).propose(ctx)
    assert not stochastic.weak.any()  # a random draft's size must not depend on its draws: never marked
    assert stochastic.child_probs is not None and not stochastic.with_replacement
    assert stochastic.child_ids[1, 0].tolist() == [5, 6, 0] and torch.allclose(stochastic.child_probs[1, 0], torch.tensor([0.6, 0.3, 0.0]))
    assert sorted(stochastic.tokens[1, 1:3].tolist()) == [5, 6] and stochastic.valid[1].tolist() == tree.valid[1].tolist()


def test_observe_inserts_each_emitted_position_under_its_1_to_4_gram_keys():
    store = STANDStore(top_k=2)
    drafter = STANDDrafter(store, TreeShape.chain(1))
    ctx = DraftContext(torch.tensor([[1, 2, 3, 4, 5, 0, 0]]), torch.tensor([5]), [0])
    before = len(store)
    drafter.propose(ctx)
    assert len(store) == before == 0  # drafting reads a snapshot, never writes
    dists = TargetTop(torch.tensor([[6, 0], [7, 1]]), torch.tensor([[0.9, 0.1], [0.8, 0.2]]), torch.tensor([0.9, 0.8]))
    drafter.observe(ctx, [[6, 7]], [dists])
    assert set(store.keys()) == {(5,), (4, 5), (3, 4, 5), (2, 3, 4, 5), (6,), (5, 6), (4, 5, 6), (3, 4, 5, 6)}
    assert store.entry((2, 3, 4, 5))[0].tolist() == [6, 0] and store.entry((5, 6))[0].tolist() == [7, 1]
    frozen = STANDDrafter(store, TreeShape.chain(1), learn=False)
    assert frozen.target_top_k is None
    frozen.observe(ctx, [[6, 7]], [dists])
    assert store.entry((5,))[2] == 1


def test_generate_feeds_the_first_token_and_every_verify_step():
    """Keys after generation: the prompt's tail followed by what was emitted, nothing else."""
    model = markov()
    store = STANDStore(top_k=4)
    out = generate(model, [[1, 2, 3, 4]], drafter=STANDDrafter(store, TreeShape.chain(2)), max_new_tokens=6,
                   temperature=1.0, seed=0)
    seq = out.sequences[0]
    expected = {tuple(seq[e - n: e]) for e in range(4, len(seq)) for n in range(1, 5)}
    assert set(store.keys()) == expected
    # the entry under the whole prompt is the target's law after it (the prefill's distribution)
    ids, probs, _ = store.entry((1, 2, 3, 4))
    law = model.table[3, 4].float()
    assert torch.allclose(probs, law[ids], atol=1e-6)


def markov(V=5, seed=3):
    torch.manual_seed(seed)  # Dirichlet draws from the global generator
    table = torch.distributions.Dirichlet(torch.full((V,), 0.7, dtype=torch.float64)).sample((V, V))
    return MarkovLM(table)


def stale_store(V, seed):
    """Entries for every 1- and 2-gram from a *different* random table: a deliberately wrong store."""
    wrong = markov(V, seed)
    store = STANDStore(top_k=4)
    for a, b in itertools.product(range(V), repeat=2):
        p, i = torch.topk(wrong.table[a, b].float(), 4)
        store.update([(a, b)], i[None], p[None])
        store.update([(b,)], i[None], p[None])
    return store


FULL = TreeShape.full(3, 2)


@pytest.mark.parametrize("case, shape", [
    ("stale-store", FULL), ("stale-deterministic", FULL), ("learning", FULL),
    # dynamic trees (tests/drafters/test_dynamic.py); TreeBudget(3, 2) keeps fewer children than the
    # store offers: a slot's priority must look past the kept slots
    ("stale-store", TreeBudget(9, 3)), ("stale-store", TreeBudget(3, 2)), ("stale-store", TreeBudget(3, 2, calibrate=False)),
    ("stale-deterministic", TreeBudget(9, 3)), ("learning", TreeBudget(9, 3))])
def test_stand_drafts_are_lossless_on_a_markov_target(case, shape):
    """20k rows, T = 1, full(3,2) trees or tree budgets: the joint of the first 3 tokens against
    the exact law."""
    model = markov()
    prompt = [1, 2, 1, 2, 0, 1, 2, 1]
    if case == "learning":  # warm the store on earlier trajectories, keep learning during the test
        drafter = STANDDrafter(STANDStore(top_k=4), shape, seed=2)
        generate(model, [prompt] * 50, drafter=drafter, max_new_tokens=40, temperature=1.0, seed=1)
    else:
        drafter = STANDDrafter(stale_store(5, seed=9), shape, stochastic=case == "stale-store", learn=False, seed=2)
    out = generate(model, [prompt] * 20_000, drafter=drafter, max_new_tokens=3, temperature=1.0, seed=4)
    accepted = torch.tensor([a[0] for a in out.stats.accepted], dtype=torch.float)
    assert accepted.mean() > 0.2
    assert chi_square(cell_counts(torch.tensor(out.new_tokens), 5), model.joint_law(prompt, 3))[2] > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_with_a_shared_store(family):
    model = FAMILIES[family]()
    store = STANDStore()
    drafter = STANDDrafter(store, TreeShape.full(2, 3))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.vocab_size, (6,), generator=g).tolist() for _ in range(3)]
    accepted = 0
    for trajectory in range(3):  # sequential trajectories sharing one store
        ref = generate(model, prompts, method="autoregressive", max_new_tokens=16)
        out = generate(model, prompts, drafter=drafter, max_new_tokens=16)
        assert out.sequences == ref.sequences
        accepted += sum(map(sum, out.stats.accepted))
    assert accepted > 20 and len(store) > 0


def test_the_named_stand_drafters_verify_their_optimised_trees():
    """The trees calibrated for the shipped target (stree/assets/stand-trees), passed as the tree,
    are what the verifier sees; the named drafters carry none of their own (tree="auto" plans)."""
    import json

    from stree.tools.demo import TARGET
    from stree.drafters.registry import STAND_TREES, make_drafter, stand_tree
    from stree.models import load

    model = load(TARGET, dtype=torch.float32)
    report = json.loads((STAND_TREES / "calibration.json").read_text())
    for name in ("stand", "stand-det"):
        drafter = make_drafter(name)
        shape = stand_tree(name)
        assert drafter.shape is None and shape.n == report["trees"][name]["nodes"] > 13
        seen = []
        # (48 tokens: long enough that the seeded sampled text repeats an n-gram STAND has stored)
        generate(model, [[5, 6, 7, 5, 6]], drafter=drafter, tree=shape, max_new_tokens=48,
                 temperature=0.6 if name == "stand" else 0, seed=0,
                 on_step=lambda rows, tree, result: seen.append(tree.n))
        assert max(seen) == shape.n and set(seen) <= {1, shape.n}  # 1: nothing drafted yet
    with pytest.raises(ValueError, match="STAND trees are 'stand' or 'stand-det'"):
        stand_tree("ngram")


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), vocab=st.integers(2, 10), top_k=st.integers(1, 5), max_n=st.integers(1, 4),
       capacity=st.integers(1, 40), evict_fraction=st.floats(0.01, 1.0), arity=st.integers(1, 3))
def test_compiled_store_equals_the_reference(seed, vocab, top_k, max_n, capacity, evict_fraction, arity):
    """Random updates and observed sequences (repeated keys, short distributions, evictions): the same n-grams, entries,
    counts and stamps, and the same trees, stochastic (same noise) and deterministic."""
    rng = np.random.default_rng(seed)
    ref, fast = (STANDStore(capacity, top_k, max_n, evict_fraction, compiled=c) for c in (False, True))
    plan = TreeShape.full(3, arity).plan
    for _ in range(int(rng.integers(1, 12))):
        m, width = int(rng.integers(1, 20)), min(int(rng.integers(1, top_k + 2)), vocab + 3)
        keys = [tuple(rng.integers(0, vocab, int(rng.integers(1, max_n + 1))).tolist()) for _ in range(m)]
        ids = np.stack([rng.permutation(vocab + 3)[:width] for _ in range(m)])
        probs = rng.dirichlet(np.ones(width), m).astype(np.float32)
        ref.update(keys, ids, probs)
        fast.update(keys, ids, probs)
        seq = rng.integers(0, vocab, int(rng.integers(1, 9)))  # and a drafter's observe: windows of a sequence
        start = int(rng.integers(0, len(seq) + 1))
        ids, probs = ids[: len(seq) - start], probs[: len(seq) - start]
        if len(ids) == len(seq) - start:
            ref.observe(seq, start, ids, probs)
            fast.observe(seq, start, ids, probs)
        assert sorted(ref.keys()) == sorted(fast.keys())
        for key in ref.keys():
            a, b = ref.entry(key), fast.entry(key)
            assert a[0].tolist() == b[0].tolist() and torch.equal(a[1], b[1]) and a[2] == b[2]
            assert ref.stamp[ref.slot(key)] == fast.stamp[fast.slot(key)]
        tails = [rng.integers(0, vocab, int(rng.integers(1, max_n + 1))).tolist() for _ in range(int(rng.integers(1, 4)))]
        noise = rng.exponential(size=len(tails) * len(plan.nodes) * top_k)
        weak_n = int(rng.integers(0, max_n + 1))
        for stochastic in (True, False):
            for x, y in zip(ref.draft(tails, plan, stochastic, noise, weak_n),
                            fast.draft(tails, plan, stochastic, noise, weak_n)):
                assert np.array_equal(x, y)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), vocab=st.integers(1, 6), top_k=st.integers(1, 10), max_n=st.integers(1, 4),
       capacity=st.integers(1, 60))
def test_plain_runs_teach_the_compiled_store_what_they_teach_the_reference(seed, vocab, top_k, max_n, capacity):
    """The compiled merge's shortcut for a law of one entry (a plain step's token, zero-padded to K):
    runs of plain steps over a few ids (token 0 and repeats among them: many rounds, ids the pads
    repeat), between target laws whose tails are zero too, leave the same entries, counts and
    stamps as the reference's full merge."""
    rng = np.random.default_rng(seed)
    ref, fast = (STANDStore(capacity, top_k, max_n, compiled=c) for c in (False, True))
    seq = rng.integers(0, vocab, 4)
    for _ in range(int(rng.integers(1, 8))):
        m = int(rng.integers(1, 40))
        seq = np.concatenate([seq, rng.integers(0, vocab, m)])
        if rng.random() < 0.7:  # a plain run: one-hot laws of the emitted tokens
            ids, probs = seq[-m:, None], np.ones((m, 1), np.float32)
        else:  # the target's laws, some with zero entries after their first
            width = int(rng.integers(1, top_k + 2))
            ids = np.stack([rng.permutation(vocab + width)[:width] for _ in range(m)])
            probs = rng.dirichlet(np.ones(width), m).astype(np.float32)
            probs[rng.random((m, width)) < 0.3] = 0
            ids[probs == 0] = np.where(rng.random(int((probs == 0).sum())) < 0.5, 0, ids[probs == 0])
        ref.observe(seq, len(seq) - m, ids, probs)
        fast.observe(seq, len(seq) - m, ids, probs)
        assert sorted(ref.keys()) == sorted(fast.keys())
        for key in ref.keys():
            a, b = ref.entry(key), fast.entry(key)
            assert a[0].tolist() == b[0].tolist() and torch.equal(a[1], b[1]) and a[2] == b[2], key
            assert ref.stamp[ref.slot(key)] == fast.stamp[fast.slot(key)]


@pytest.mark.parametrize("entry, token, expected", [
    (([5, 5, 5], [0.5, 0, 0]), 7, [7, 5, 0]),  # no 0 held: the first pad's id 0 is new (score 0), not a 5
    (([5, 0, 5], [0.5, 0, 0]), 5, [5, 0, 5]),  # 0 held: every pad repeats it (-1), so the held 5 comes next
])
def test_a_one_entry_law_merges_as_the_full_merge_into_any_entry(entry, token, expected):
    """Entries no merge from an empty store leaves (a repeated id, no id 0), written into both stores:
    one token's law, zero-padded, ranks its pads' id 0 as the full merge does."""
    stores = [STANDStore(capacity=4, top_k=3, max_n=1, compiled=c) for c in (False, True)]
    for store in stores:
        store.update([(1,)], t(9, 8, 6, dtype=torch.long), t(0.5, 0.3, 0.2))
        s = store.slot((1,))
        store.ids[s], store.probs[s] = torch.tensor(entry[0], dtype=torch.int32), torch.tensor(entry[1])
        store.update([(1,)], t(token, dtype=torch.long), t(1.0))
        assert store.entry((1,))[0].tolist() == expected


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "reference"])
def test_it_says_before_drafting_exactly_when_no_row_would_get_more_than_its_root(compiled):
    """``can_draft``, which the decoding loop asks before drafting: False exactly where proposing,
    a static shape or a grown tree, fills no node below any row's root (no row's last tokens
    match an n-gram of the store)."""
    rng = np.random.default_rng(0)
    answers = set()
    for _ in range(100):
        store = STANDStore(64, 3, 3, compiled=compiled)
        m = int(rng.integers(1, 6))
        keys = [tuple(rng.integers(0, 8, int(rng.integers(1, 4))).tolist()) for _ in range(m)]
        store.update(keys, np.stack([rng.permutation(8)[:3] for _ in range(m)]),
                     rng.dirichlet(np.ones(3), m).astype(np.float32))
        rows = [rng.integers(0, 8, int(rng.integers(1, 6))).tolist() for _ in range(int(rng.integers(1, 3)))]
        tokens = torch.zeros(len(rows), 6, dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = torch.tensor(r)
        ctx = DraftContext(tokens, torch.tensor([len(r) for r in rows]), list(range(len(rows))))
        drafter = STANDDrafter(store, TreeShape.full(2, 2), stochastic=bool(rng.integers(2)), learn=False)
        can = drafter.can_draft(ctx)
        for shape in (None, TreeBudget(6)):
            assert can == bool(drafter.propose(ctx, shape).valid[:, 1:].any()), (rows, keys)
        answers.add(can)
    assert answers == {True, False}


def test_store_keys_longer_than_max_n_are_an_error():
    with pytest.raises(ValueError, match="keys must have 1..2 tokens"):
        STANDStore(top_k=2, max_n=2).update([(1, 2, 3)], t(1, 2, dtype=torch.long), t(0.5, 0.5))


def test_a_plain_step_teaches_the_emitted_tokens_alone():
    """observe with target=None (a plain step, where the loop computes no target laws for STAND):
    each emitted token becomes a one-hot law under the n-grams before it, so that the running
    mean of an entry is the tokens' frequencies; the deterministic drafter then drafts it."""
    drafter = STANDDrafter(STANDStore(top_k=3), TreeShape.chain(2), stochastic=False)
    tokens = torch.tensor([[1, 2, 3, 0, 0]])
    drafter.observe(DraftContext(tokens, torch.tensor([3]), [0]), [[4, 5]], None)
    tree = drafter.propose(DraftContext(tokens, torch.tensor([3]), [0]))
    assert tree.tokens.tolist() == [[3, 4, 5]] and bool(tree.valid.all())
    for token in (7, 7, 4):  # frequencies: 7 twice, 4 once (and once before)
        drafter.observe(DraftContext(tokens, torch.tensor([3]), [0]), [[token]], None)
    slot = drafter.store.lookup(np.array([[1, 2, 3, 0]]), np.array([3]))[0]
    ids, probs = drafter.store._np_ids[slot], drafter.store._np_probs[slot]
    assert {int(i): round(float(p), 6) for i, p in zip(ids, probs) if p > 0} == {4: 0.5, 7: 0.5}


@given(st.integers(0, 2**32 - 1))
@settings(max_examples=25, deadline=None)
def test_observing_tokens_the_rows_hold_already_teaches_what_tokens_they_do_not_hold_teach(seed):
    """The decoding loop hands observe the tokens it has just appended to the rows (read as a view of
    the row); any other caller's tokens (not in the rows, or past their room) are copied after the
    context. Both teach the store the same, plain steps' tokens and target laws alike."""
    rng = np.random.default_rng(seed)
    rows, width, vocab = 2, 12, 6
    held, other = (STANDDrafter(STANDStore(top_k=3, capacity=64), TreeShape.chain(2)) for _ in range(2))
    for _ in range(int(rng.integers(1, 6))):
        lengths = rng.integers(0, width, rows)
        emitted = [rng.integers(0, vocab, int(rng.integers(1, width - n + 2))).tolist() for n in lengths.tolist()]
        tokens = torch.from_numpy(rng.integers(0, vocab, (rows, width)))
        appended = tokens.clone()
        for r, (n, e) in enumerate(zip(lengths.tolist(), emitted)):
            fits = min(len(e), width - n)
            appended[r, n: n + fits] = torch.tensor(e[:fits])  # (a row past its room holds part of them)
            tokens[r, n: n + fits] = torch.tensor([(t + 1) % vocab for t in e[:fits]])  # (not what was emitted)
        laws = None
        if rng.random() < 0.5:
            laws = []
            for e in emitted:
                ids = torch.from_numpy(rng.integers(0, vocab, (len(e), 3)))
                probs = torch.from_numpy(rng.dirichlet(np.ones(3), len(e)).astype(np.float32))
                laws.append(TargetTop(ids, probs, probs[:, 0]))
        held.observe(DraftContext(appended, torch.from_numpy(lengths), [0, 1]), emitted, laws)
        other.observe(DraftContext(tokens, torch.from_numpy(lengths), [0, 1]), emitted, laws)
    assert len(held.store) > 0 and sorted(held.store.keys()) == sorted(other.store.keys())
    for key in held.store.keys():
        a, b = held.store.entry(key), other.store.entry(key)
        assert a[0].tolist() == b[0].tolist() and torch.equal(a[1], b[1]) and a[2] == b[2]


def test_build_loads_the_stores_compiled_calls():
    """A decoding loop's setup (``build``) loads the compiled store's calls in a fresh process:
    each loads on first use, and a first draft had taken some 0.4 s inside decoding."""
    assert unloaded_after("stree.drafters.stand_jit", ["draft", "observe", "longest_many"],
                          "from stree.drafters.stand import STANDDrafter, STANDStore",
                          "STANDDrafter(STANDStore(capacity=1024)).build([], 1)") == []
