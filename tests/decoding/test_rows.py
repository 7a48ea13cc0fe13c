"""The rows' host bookkeeping: what a step emits, appended as a plain per-row reading of the rule
says (cut after the first EOS and at the budget, retired, exactness), and what the drafter is
shown of it."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stree.decoding.rows import Rows, full_batch
from stree.decoding.steps import HostStep
from stree.drafters.base import Drafter
from stree.tree import TokenTree, TreeShape


class _Watcher(Drafter):
    def __init__(self):
        self.seen = []

    def observe(self, context, tokens, target=None):
        self.seen.append(([int(context.lengths[r]) for r in context.rows], [list(t) for t in tokens]))


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 4), st.integers(1, 5), st.lists(st.integers(0, 5), max_size=2), st.integers(0, 2**31 - 1))
def test_emit_appends_as_the_rule_reads_row_by_row(batch, width, eos, seed):
    g = np.random.default_rng(seed)
    prompts = [g.integers(0, 6, g.integers(1, 4)).tolist() for _ in range(batch)]
    budgets = g.integers(1, 9, batch).tolist()
    rows, watcher = Rows(prompts, budgets, eos), _Watcher()
    want = [list(p) for p in prompts]
    live, exact = [True] * batch, [True] * batch
    for _ in range(6):
        tokens = torch.from_numpy(g.integers(0, 6, (batch, width)))
        counts = torch.from_numpy(g.integers(1, width + 1, batch))
        before = [len(w) for w in want]
        expect_seen = ([before[r] for r in range(batch) if live[r]], [])
        for r in range(batch):
            if not live[r]:
                continue
            got = tokens[r, : counts[r]].tolist()
            cut = next((j + 1 for j, t in enumerate(got) if t in eos), len(got))
            take = got[: min(cut, budgets[r] - (len(want[r]) - len(prompts[r])))]
            want[r] += take
            expect_seen[1].append(take)
            exact[r] &= len(take) == len(got)
            live[r] = not any(t in eos for t in take) and len(want[r]) - len(prompts[r]) < budgets[r]
        rows.emit(HostStep(tokens, counts, torch.ones(batch, dtype=torch.bool)), watcher)
        if expect_seen[0]:
            assert watcher.seen[-1] == expect_seen
        for r in range(batch):
            assert rows.seq[r, : int(rows.lengths[r])].tolist() == want[r]
            assert int(rows.produced[r]) == len(want[r]) - len(prompts[r])
        assert rows.active.tolist() == live and rows.exact.tolist() == exact
        assert rows.active_ids() == [r for r in range(batch) if live[r]]
        assert rows.roots().tolist() == [w[-1] for w in want]  # the next step's roots
        if not any(live):
            break
        if g.random() < 0.3:  # a consumer ends a row (a stop string): its root is its new last token
            r = int(g.choice([r for r in range(batch) if live[r]]))
            keep = int(g.integers(0, len(want[r]) - len(prompts[r]) + 1))
            exact[r] &= keep == len(want[r]) - len(prompts[r])
            rows.finish(r, keep)
            want[r], live[r] = want[r][: len(prompts[r]) + keep], False
            assert rows.roots().tolist() == [w[-1] for w in want]
            assert rows.active_ids() == [r for r in range(batch) if live[r]]


def test_rows_grow_past_their_first_allocation_and_roots_are_copies():
    """A budget past the first allocation (256 tokens beyond the longest prompt): the rows grow as
    tokens come, ragged rows keep their own tokens, ``roots`` hands out a copy, and a drafter's
    context reads the rows' memory as it now is."""
    prompts, budgets = [[1, 2, 3], [4]], [400, 300]
    rows = Rows(prompts, budgets, [])
    want = [list(p) for p in prompts]
    first = rows.seq.shape[1]
    g = np.random.default_rng(0)
    while bool(rows.active.any()):
        tokens = torch.from_numpy(g.integers(5, 9, (2, 7)))
        counts = torch.from_numpy(g.integers(1, 8, 2))
        for r in range(2):
            room = budgets[r] - (len(want[r]) - len(prompts[r]))
            want[r] += tokens[r, : min(int(counts[r]), room)].tolist() if room > 0 else []
        rows.emit(HostStep(tokens, counts, torch.ones(2, dtype=torch.bool)), None)
        roots = rows.roots()
        assert roots.tolist() == [w[-1] for w in want]
        roots.fill_(-1)  # (the caller's to keep: the rows' own are untouched)
        assert rows.roots().tolist() == [w[-1] for w in want]
        tokens, lengths = rows.context().arrays()  # (the rows' own views, grown or not)
        assert np.shares_memory(tokens, rows.seq.numpy()) and np.shares_memory(lengths, rows.lengths.numpy())
    assert rows.seq.shape[1] > first
    assert [rows.seq[r, : int(rows.lengths[r])].tolist() for r in range(2)] == want


def test_a_drafter_reads_the_steps_laws_cut_per_row_as_their_arrays():
    """What a drafter learning from the target is shown: each row's top entries and token
    probabilities cut to the tokens it took (``TargetTop``), whose arrays (``host_array``) are the
    step's memory, not copies; the context's arrays are the rows' before the step."""
    from stree.drafters.base import TargetTop
    from stree.tree import host_array, host_tensor

    class Laws(Drafter):
        def observe(self, context, tokens, target=None):
            self.seen = (context.arrays(), [list(t) for t in tokens], target)

    rows, drafter = Rows([[1, 2], [3]], [5, 1], []), Laws()
    g = np.random.default_rng(0)
    top_ids, top_probs, token_probs = g.integers(0, 9, (2, 3, 4)), g.random((2, 3, 4)), g.random((2, 3))
    step = HostStep(torch.tensor([[4, 5, 6], [7, 8, 9]]), torch.tensor([3, 2]), torch.ones(2, dtype=torch.bool),
                    host_tensor(top_ids), host_tensor(top_probs), torch.from_numpy(token_probs))
    rows.emit(step, drafter, drafter_k=2)
    (seq, lengths), tokens, target = drafter.seen
    assert lengths.tolist() == [2, 1] and np.shares_memory(seq, rows.seq.numpy())  # (before the step)
    assert tokens == [[4, 5, 6], [7]]  # (the second row's budget: one token)
    for row, (got, m) in enumerate(zip(target, (3, 1))):
        assert isinstance(got, TargetTop)
        for part, whole, cut in ((got.ids, top_ids, top_ids[row, :m, :2]),
                                 (got.probs, top_probs, top_probs[row, :m, :2]),
                                 (got.token_probs, token_probs, token_probs[row, :m])):
            array = host_array(part)
            assert np.array_equal(array, cut) and np.array_equal(part.numpy(), cut)
            assert np.shares_memory(array, whole)


@settings(max_examples=120, deadline=None)
@given(st.integers(1, 4), st.sampled_from(["static", "shared", "per-row"]), st.booleans(), st.booleans(),
       st.booleans(), st.integers(0, 2**31 - 1))
def test_a_full_batch_tree_holds_each_drafted_row_in_place_and_a_lone_root_elsewhere(batch, kind, valid, stochastic,
                                                                                     replace, seed):
    """The loop's tree for a batch whose finished rows ride along (compiled calls, CUDA graphs):
    read node by node, each live row is its draft's row (tokens, validity, children's laws),
    each finished row its root alone, every other node of it invalid; the shape, the parents and
    whether children were drawn with replacement are the draft's."""
    g = np.random.default_rng(seed)
    active = torch.from_numpy(g.random(batch) < 0.6)
    live = np.flatnonzero(active.numpy())
    if not len(live):
        active[int(g.integers(batch))] = True
        live = np.flatnonzero(active.numpy())
    shape = TreeShape.from_spec(str(g.choice(["paper13", "chain:3", "full:2x2"])))
    roots = torch.from_numpy(g.integers(0, 50, batch))
    tokens = torch.from_numpy(g.integers(0, 50, (len(live), shape.n)))
    tokens[:, 0] = roots[torch.from_numpy(live)]
    extra = {}
    if valid:
        extra["valid"] = torch.from_numpy(g.random((len(live), shape.n)) < 0.7)
        extra["valid"][:, 0] = True
    if stochastic:
        extra.update(child_ids=torch.from_numpy(g.integers(0, 50, (len(live), shape.n, 2))),
                     child_probs=torch.from_numpy(g.random((len(live), shape.n, 2)).astype(np.float32)),
                     with_replacement=replace)
    parents = torch.tensor(shape.parents)
    if kind == "static":
        draft = TokenTree.from_shape(shape, tokens, **extra)
    else:
        draft = TokenTree(parents if kind == "shared" else parents.repeat(len(live), 1), tokens, **extra)
    full = full_batch(draft, active, roots)
    assert full.static_shape == draft.static_shape and full.with_replacement == (stochastic and replace)
    assert tuple(full.tokens.shape) == (batch, shape.n) and full.valid is not None
    for r in range(batch):
        at = list(live).index(r) if r in live else None
        assert full.parents.reshape(-1, shape.n)[r if full.parents.dim() == 2 else 0].tolist() == list(shape.parents)
        for i in range(shape.n):
            if at is None:
                assert int(full.tokens[r, i]) == int(roots[r]) and bool(full.valid[r, i]) == (i == 0)
                if stochastic:
                    assert not full.child_ids[r, i].any() and not full.child_probs[r, i].any()
                continue
            assert int(full.tokens[r, i]) == int(tokens[at, i])
            assert bool(full.valid[r, i]) == (not valid or bool(extra["valid"][at, i]))
            if stochastic:
                assert full.child_ids[r, i].tolist() == extra["child_ids"][at, i].tolist()
                assert full.child_probs[r, i].tolist() == extra["child_probs"][at, i].tolist()
            else:
                assert full.child_ids is None
