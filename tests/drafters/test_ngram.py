"""NGramDrafter: longest-suffix continuations, frequency order, back-off, tree filling, and an
index that only ever reads the new tokens of a row."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jit_loads import unloaded_after

from stree.drafters import DraftContext, NGramDrafter
from stree.drafters import ngram as ngram_module
from stree.drafters.ngram_jit import CompiledRowIndex
from stree.tree import TreeShape


def context(rows_tokens):
    T = max(map(len, rows_tokens))
    tokens = torch.zeros(len(rows_tokens), T, dtype=torch.long)
    for i, r in enumerate(rows_tokens):
        tokens[i, : len(r)] = torch.tensor(r)
    return DraftContext(tokens, torch.tensor([len(r) for r in rows_tokens]), list(range(len(rows_tokens))))


def continuations(ctx, suffix):
    """The definition: tokens that followed ``suffix`` in ``ctx``, most frequent then most recent."""
    n, stats = len(suffix), {}
    for j in range(n, len(ctx)):
        if tuple(ctx[j - n: j]) == tuple(suffix):
            c, _ = stats.get(ctx[j], (0, -1))
            stats[ctx[j]] = (c + 1, j)
    return [t for t, _ in sorted(stats.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))]


def expected_children(ctx, k, max_n=4):
    out = []
    for n in range(min(max_n, len(ctx)), 0, -1):
        for t in continuations(ctx, ctx[len(ctx) - n:]):
            if t not in out and len(out) < k:
                out.append(t)
    return out


both = pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "reference"])


@both
def test_children_are_the_longest_matches_continuations_then_backoff(compiled):
    ctx = [5, 1, 2, 3, 9, 1, 2, 3, 7, 4, 2, 3, 8, 1, 2, 3, 7, 0, 1, 2, 3]
    tree = NGramDrafter(compiled=compiled).propose(context([ctx]), TreeShape.full(4, 1))
    # 4-gram (1,2,3)->... : "x 1 2 3" keys; 3-gram (1,2,3) -> 9, 7, 7 ; 2-gram (2,3) adds 8
    assert tree.tokens[0, 0] == 3
    assert tree.tokens[0, 1:4].tolist() == [7, 9, 8] == expected_children(ctx, 4)
    assert tree.valid[0].tolist() == [True] * 4 + [False]  # only 3 distinct continuations exist



@both
def test_a_node_from_a_short_or_ambiguous_match_is_weak(compiled):
    """Weak marks follow the longest match there could be, and whether the match was followed by its
    token alone: a continuation of a two-token match is weak for a drafter matching up to four tokens,
    strong for one matching up to two; a continuation of a whole match that other tokens followed too
    is weak, the first child and the second alike. (Drafting chains for the shipped target, nodes from a
    four-token match its token alone had followed were accepted at 97%, from one others had followed
    too at 48%, from shorter matches at 25-75%.)"""
    ctx = [7, 5, 1, 2, 3, 6, 1, 2]  # (1, 2) -> 3 once; no longer suffix of (.., 1, 2) occurred before
    shape = TreeShape.full(1, 1)
    for max_n, weak in ((4, True), (3, True), (2, False)):
        tree = NGramDrafter(max_n=max_n, compiled=compiled).propose(context([ctx]), shape)
        assert tree.tokens[0, 1] == 3 and tree.valid[0, 1] and bool(tree.weak[0, 1]) is weak, max_n
    alone, both_ = [9, 1, 2, 3, 4, 8, 1, 2, 3], [9, 1, 2, 3, 4, 8, 1, 2, 3, 5, 0, 1, 2, 3]
    tree = NGramDrafter(max_n=3, compiled=compiled).propose(context([alone, both_]), TreeShape.full(2, 1))
    assert tree.tokens[:, 1:3].tolist() == [[4, 0], [5, 4]]  # ((1, 2, 3) -> 4 alone; -> 5 and 4, 5 the later)
    assert tree.valid[:, 1:3].tolist() == [[True, False], [True, True]]
    assert tree.weak[:, 1:3].tolist() == [[False, False], [True, True]]


@both
def test_a_node_below_a_weak_one_is_weak_and_strong_drafts_need_a_strong_first_child(compiled):
    """A node drafted below a weak one is weak whatever its own match (verified, trees rooted in weak nodes
    lost five times in six, their strong-matched nodes included); ``can_draft_strong`` says whether a
    row's first child would be strong, without which its draft is weak throughout."""
    short = [1, 2, 3, 4, 5, 6, 1, 2, 3]  # (6, 1, 2, 3) unseen: (1, 2, 3) -> 4, three tokens; then (1, 2, 3, 4) -> 5
    whole = [1, 2, 3, 4, 5, 6, 7, 2, 3, 4, 5, 1, 2, 3, 4]  # (1, 2, 3, 4) -> 5 alone, then (2, 3, 4, 5) -> 6 and 1
    drafter = NGramDrafter(compiled=compiled)
    tree = drafter.propose(context([short, whole]), TreeShape.chain(2))
    assert tree.tokens[:, 1:].tolist() == [[4, 5], [5, 1]] and tree.valid.all()
    assert tree.weak[:, 1:].tolist() == [[True, True], [False, True]]
    assert drafter.can_draft_strong(context([short, whole]))
    for ctx, can, strong in ((short, True, False), (whole, True, True), ([1, 2, 3], False, False)):
        drafter.reset()
        assert (drafter.can_draft(context([ctx])), drafter.can_draft_strong(context([ctx]))) == (can, strong), ctx

@both
def test_random_contexts_match_the_definition_at_every_depth(compiled):
    g = torch.Generator().manual_seed(0)
    drafter = NGramDrafter(compiled=compiled)
    shape = TreeShape.full(2, 3)
    for trial in range(30):
        ctx = torch.randint(0, 4, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        drafter.reset()
        tree = drafter.propose(context([ctx]), shape)
        kids = shape.children()
        for v in range(shape.n):
            if not kids[v] or not tree.valid[0, v]:
                assert not any(tree.valid[0, c] for c in kids[v])
                continue
            path, u = [], v
            while u > 0:
                path.append(int(tree.tokens[0, u]))
                u = shape.parents[u]
            # the index holds the committed context only: drafted tokens extend the key, not the table;
            # a child is weak where the match it came from was shorter than max_n (4) tokens, or other
            # tokens followed that match too, or its parent is weak
            got = [(int(tree.tokens[0, c]), bool(tree.weak[0, c])) for c in kids[v] if tree.valid[0, c]]
            want = want_from_committed(ctx, path[::-1], len(kids[v]))
            assert got == [(t, n < 4 or several or bool(tree.weak[0, v])) for t, n, several in want], (ctx, v)
            assert not tree.weak[0, [c for c in kids[v] if not tree.valid[0, c]]].any()


def want_from_committed(ctx, path, k, max_n=4):
    """Continuations looked up with the path context's suffix, counted over the committed ``ctx``,
    each with the length of the suffix it followed and whether other tokens followed that suffix too."""
    full = ctx + path
    out = []
    for n in range(min(max_n, len(full)), 0, -1):
        suffix = full[len(full) - n:]
        after = continuations(ctx, suffix)
        for t in after:
            if t not in [u for u, _, _ in out] and len(out) < k:
                out.append((t, n, len(after) > 1))
    return out


@both
def test_no_match_leaves_invalid_slots_and_prunes_their_subtrees(compiled):
    tree = NGramDrafter(compiled=compiled).propose(context([[1, 2, 3]]), TreeShape.full(2, 2))
    # 3 never occurred before, and no shorter suffix of "3" has a continuation
    assert tree.tokens[0, 0] == 3 and tree.valid[0].tolist() == [True] + [False] * 6
    tree = NGramDrafter(compiled=compiled).propose(context([[1, 2, 1]]), TreeShape.full(2, 1))
    assert tree.tokens[0, :2].tolist() == [1, 2] and tree.valid[0].tolist() == [True, True, False]


@both
def test_it_says_before_drafting_exactly_when_no_row_would_get_more_than_its_root(compiled):
    """``can_draft``, which the decoding loop asks before drafting: False exactly where proposing
    fills no node below any row's root (each row's last tokens never occurred before with a
    continuation, or fewer than ``min_n`` of them)."""
    rng = np.random.default_rng(0)
    answers = set()
    for _ in range(300):
        rows = [rng.integers(0, 6, int(rng.integers(1, 8))).tolist() for _ in range(int(rng.integers(1, 3)))]
        drafter = NGramDrafter(max_n=int(rng.integers(2, 4)), min_n=int(rng.integers(1, 3)), compiled=compiled)
        ctx = context(rows)
        can = drafter.can_draft(ctx)
        assert can == bool(drafter.propose(ctx, TreeShape.full(2, 2)).valid[:, 1:].any()), rows
        answers.add(can)
    assert answers == {True, False}


@both
def test_index_reads_each_token_once(monkeypatch, compiled):
    seen = []
    cls = CompiledRowIndex if compiled else ngram_module.RowIndex
    real = cls.extend
    monkeypatch.setattr(cls, "extend", lambda self, new: (seen.extend(new), real(self, new)))
    drafter = NGramDrafter(compiled=compiled)
    tokens = torch.randint(0, 5, (2, 60))
    lengths = torch.tensor([10, 12])
    for _ in range(5):
        drafter.propose(DraftContext(tokens, lengths, [0, 1]), TreeShape.paper13())
        lengths += torch.tensor([3, 1])
    assert len(seen) == int(lengths.sum()) - 4  # every token indexed once (the last step's growth not yet seen)
    fresh = NGramDrafter(compiled=compiled)
    a = drafter.propose(DraftContext(tokens, lengths, [0, 1]), TreeShape.paper13())
    b = fresh.propose(DraftContext(tokens, lengths, [0, 1]), TreeShape.paper13())
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.valid, b.valid)


@both
def test_rows_are_keyed_by_stable_id_and_shrinking_is_an_error(compiled):
    drafter = NGramDrafter(compiled=compiled)
    tokens = torch.tensor([[1, 2, 1, 2, 1], [3, 4, 3, 4, 3]])
    drafter.propose(DraftContext(tokens, torch.tensor([5, 5]), [0, 1]), TreeShape.chain(2))
    only_second = drafter.propose(DraftContext(tokens, torch.tensor([5, 5]), [1]), TreeShape.chain(2))
    assert only_second.tokens.tolist() == [[3, 4, 3]]
    with pytest.raises(ValueError, match="shrank"):
        drafter.propose(DraftContext(tokens, torch.tensor([5, 3]), [1]), TreeShape.chain(2))
    with pytest.raises(ValueError, match="min_n"):
        NGramDrafter(max_n=2, min_n=3)


@both
def test_capacity_bounds_each_rows_index_and_drops_the_stalest_ngrams(compiled):
    drafter = NGramDrafter(max_n=1, capacity=6, evict_fraction=0.5, compiled=compiled)
    seq = [1, 2, 1, 3, 4, 5, 6, 7, 8]
    context = DraftContext(torch.tensor([seq]), torch.tensor([len(seq)]), [0])
    draft = drafter.propose(context, TreeShape.chain(1))
    index = drafter._rows[0]
    # 7 distinct one-grams were followed by a token; the 7th found 6 (update order (2,) (1,) (3,) (4,)
    # (5,) (6,): (1,) moved behind (2,) when it recurred) and the 3 least recently updated went
    assert sorted(index.keys()) == [(4,), (5,), (6,), (7,)]
    assert not bool(draft.valid[0, 1])  # 8 ends the context: nothing followed it
    long = list(range(10, 3000))
    big = NGramDrafter(capacity=100, compiled=compiled)
    big.propose(DraftContext(torch.tensor([long]), torch.tensor([len(long)]), [0]), TreeShape.chain(2))
    assert len(big._rows[0]) <= 100
    with pytest.raises(ValueError, match="capacity"):
        NGramDrafter(capacity=0)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), vocab=st.integers(2, 12), max_n=st.integers(1, 5),
       capacity=st.integers(1, 80), evict_fraction=st.floats(0.01, 1.0))
def test_compiled_index_equals_the_reference(seed, vocab, max_n, capacity, evict_fraction):
    """Same n-grams (eviction included), same rankings, same drafts, step after step."""
    rng = np.random.default_rng(seed)
    ref, fast = (cls(max_n, capacity, evict_fraction) for cls in (ngram_module.RowIndex, CompiledRowIndex))
    plan = TreeShape.full(3, 3).plan
    for _ in range(int(rng.integers(1, 30))):
        new = rng.integers(0, vocab, int(rng.integers(1, 8)))
        ref.extend(new)
        fast.extend(new)
        assert sorted(ref.keys()) == sorted(fast.keys())
        assert all(ref.ranked(k) == fast.ranked(k) for k in ref.keys())
        min_n, weak_n = int(rng.integers(1, max_n + 1)), int(rng.integers(0, max_n + 1))
        drafts = ref.propose(min_n, weak_n, plan, plan.shape.n), fast.propose(min_n, weak_n, plan, plan.shape.n)
        for a, b in zip(*drafts):
            assert np.array_equal(a, b)
        assert ref.continues(min_n) == fast.continues(min_n) == bool(drafts[0][1][1:].any())
        strong = bool(drafts[0][1][1] and not drafts[0][2][1])  # (node 1: the root's first child)
        assert ref.continues(min_n, weak_n) == fast.continues(min_n, weak_n) == strong


def test_compiled_index_grows_and_compacts_like_the_reference(monkeypatch):
    """A long context: the arrays grow (ids, hash slots) and the continuation pool is compacted,
    and the index still equals the reference's."""
    grown = []
    for name in ("_grow_ids", "_rehash", "_compact"):
        real = getattr(CompiledRowIndex, name)
        monkeypatch.setattr(CompiledRowIndex, name, lambda self, *a, _r=real, _n=name: (grown.append(_n), _r(self, *a)))
    rng = np.random.default_rng(0)
    ref, fast = ngram_module.RowIndex(4, 3000, 0.2), CompiledRowIndex(4, 3000, 0.2)
    plan = TreeShape.paper13().plan
    for _ in range(40):
        new = rng.integers(0, 30, 100) if rng.random() < 0.5 else np.repeat(rng.integers(0, 30, 20), 5)
        ref.extend(new)
        fast.extend(new)
        for a, b in zip(ref.propose(1, 1, plan, plan.shape.n), fast.propose(1, 1, plan, plan.shape.n)):
            assert np.array_equal(a, b)
    assert {"_grow_ids", "_rehash", "_compact"} <= set(grown)
    assert sorted(ref.keys()) == sorted(fast.keys())
    assert all(ref.ranked(k) == fast.ranked(k) for k in ref.keys())


def test_a_prompts_indexing_grows_each_array_once(monkeypatch):
    """A fresh row index handed a whole prompt makes room for its n-grams at once: each array grown
    (ids, hash slots, the continuation pool) at most once, not doubled step by step as the compiled
    call runs short (several growths, rehashes and compactions a call's first draft had paid), and
    the index is the reference's."""
    grown = []
    for name in ("_grow_ids", "_rehash", "_compact"):
        real = getattr(CompiledRowIndex, name)
        monkeypatch.setattr(CompiledRowIndex, name, lambda self, *a, _r=real, _n=name: (grown.append(_n), _r(self, *a)))
    prompt = np.random.default_rng(1).integers(0, 200, 600)
    ref, fast = ngram_module.RowIndex(4, 1 << 16, 0.1), CompiledRowIndex(4, 1 << 16, 0.1)
    ref.extend(prompt)
    fast.extend(prompt)
    assert sorted(grown) == ["_compact", "_grow_ids", "_rehash"]
    assert sorted(ref.keys()) == sorted(fast.keys())
    assert all(ref.ranked(k) == fast.ranked(k) for k in ref.keys())


def test_build_loads_every_compiled_call_of_the_index():
    """A decoding loop's setup (``build``) loads the compiled index's calls, growth included, in a
    fresh process: each loads on first use, and the first index to outgrow its arrays inside
    decoding (often tree="auto"'s first probe) had paid some ten milliseconds for it."""
    calls = ["extend", "rehash", "compact", "propose", "continues"]
    assert unloaded_after("stree.drafters.ngram_jit", calls,
                          "from stree.drafters.ngram import NGramDrafter", "NGramDrafter().build([], 1)") == []
