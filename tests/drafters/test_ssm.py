"""SSMDrafter: a model drafting for a model. Greedy identity with tiny Mamba2/hybrid targets and a
tiny Mamba2 drafter; exact laws on Markov targets drafted by a mismatched Markov model."""

import numpy as np
import pytest
import torch
from tiny_models import FAMILIES, mamba2

from stree.drafters import DraftContext
from stree.drafters.ssm import SSMDrafter
from stree.kernels.cpu import mamba_step
from stree.models import Mamba2LM
from stree.models.fused_step import fused_step
from stree.decoding.loop import generate
from stree.testing import MarkovLM, cell_counts, chi_square
from stree.tree import TreeBudget, TreeShape


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["static", "beam"])
def test_greedy_identity(family, mode):
    """Drafted by a second copy of the target (most drafts accepted) and by an unrelated tiny
    Mamba2 (most rejected): the output is the autoregressive one either way."""
    target = FAMILIES[family]()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.vocab_size, (n,), generator=g).tolist() for n in (5, 8)]
    ref = generate(target, prompts, method="autoregressive", max_new_tokens=12)
    for draft_model, min_accepted in [(FAMILIES[family](), 8), (mamba2(vocab_size=target.vocab_size, seed=7), 0)]:
        drafter = SSMDrafter(draft_model, TreeShape.full(2, 2), mode=mode, stochastic=False, beams=2, steps=3,
                             vocab_size=target.vocab_size)
        out = generate(target, prompts, drafter=drafter, max_new_tokens=12)
        assert out.sequences == ref.sequences
        assert sum(map(sum, out.stats.accepted)) >= min_accepted


def markov_pair(V=5):
    torch.manual_seed(11)  # Dirichlet draws from the global generator
    p = torch.distributions.Dirichlet(torch.full((V,), 0.7, dtype=torch.float64)).sample((V, V))
    q = 0.6 * p + 0.4 * torch.distributions.Dirichlet(torch.ones(V, dtype=torch.float64)).sample((V, V))
    return MarkovLM(p), MarkovLM(q / q.sum(-1, keepdim=True))


@pytest.mark.parametrize("mode, stochastic", [("static", True), ("static", False), ("beam", False)])
def test_drafts_are_lossless_on_a_markov_target(mode, stochastic):
    """20k rows at T = 1: the joint of the first 3 tokens against the exact law, drafts accepted."""
    target, draft_model = markov_pair()
    prompt = [1, 2, 1, 2, 0, 1]
    # max_length: room for the prompt, 3 tokens and a tree (the default 4096 holds 650 MB for 20k rows)
    drafter = SSMDrafter(draft_model, TreeShape.full(2, 2), mode=mode, stochastic=stochastic, beams=2, steps=2, seed=3,
                         max_length=32)
    out = generate(target, [prompt] * 20_000, drafter=drafter, max_new_tokens=3, temperature=1.0, seed=5)
    accepted = torch.tensor([sum(a) for a in out.stats.accepted], dtype=torch.float)
    assert accepted.mean() > 0.5
    assert chi_square(cell_counts(torch.tensor(out.new_tokens), 5), target.joint_law(prompt, 3))[2] > 1e-3


def test_the_drafter_cache_follows_the_rows():
    """After the cache advanced over new tokens (and dropped and reordered rows), the drafted law
    equals that of a fresh drafter prefilling the same contexts."""
    model = mamba2(seed=3)
    shape = TreeShape.full(2, 2)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 90, (3, 20), generator=g)
    drafter = SSMDrafter(model, shape, seed=0)
    first = DraftContext(tokens, torch.tensor([6, 9, 4]), [0, 1, 2])
    assert drafter.behind(first) == 9  # nothing read yet: the longest context
    drafter.propose(first)
    assert drafter.behind(first) == 0
    later = DraftContext(tokens, torch.tensor([11, 9, 8]), [2, 0])  # row 1 left; rows advanced by 4 and 5
    assert drafter.behind(later) == 5  # what tree="auto" charges a probe for
    fresh = SSMDrafter(model, shape, seed=0).propose(later)
    advanced = drafter.propose(later)
    assert drafter._fed.tolist() == [8, 11]  # the whole context, root included
    # the root's children law (node 0) comes from the cache alone
    assert torch.allclose(advanced.child_probs[:, 0], fresh.child_probs[:, 0], atol=1e-5)
    assert torch.equal(advanced.child_ids[:, 0], fresh.child_ids[:, 0])
    alone = SSMDrafter(model, shape, seed=0).propose(DraftContext(tokens, torch.tensor([1]), [0]))  # the root alone
    assert alone.tokens[0, 0] == tokens[0, 0]


def test_a_row_far_behind_is_read_from_its_last_window_only(monkeypatch):
    """A context longer than CATCH_WINDOW (a new prompt, or rows decoded plain for a while) is read
    from its last CATCH_WINDOW tokens: one prefill of that many positions, the law of a fresh
    drafter given just those tokens, and ``behind`` (what tree="auto" charges a probe for) says so."""
    monkeypatch.setattr(SSMDrafter, "CATCH_WINDOW", 8)
    model = mamba2(seed=3)
    shape = TreeShape.full(2, 2)
    tokens = torch.randint(0, 90, (2, 40), generator=torch.Generator().manual_seed(4))
    drafter = SSMDrafter(model, shape, seed=0)
    context = DraftContext(tokens, torch.tensor([30, 12]), [0, 1])
    assert drafter.behind(context) == 8
    read = []
    real = model.prefill

    def spy(ids, cache, **kw):
        read.append(ids.shape[1])
        return real(ids, cache, **kw)
    monkeypatch.setattr(model, "prefill", spy)
    far = drafter.propose(context)
    assert read == [8] and drafter._fed.tolist() == [30, 12]
    ends = torch.stack([tokens[0, 22:30], tokens[1, 4:12]])
    fresh = SSMDrafter(model, shape, seed=0).propose(DraftContext(ends, torch.tensor([8, 8]), [0, 1]))
    assert torch.allclose(far.child_probs[:, 0], fresh.child_probs[:, 0], atol=1e-5)
    assert torch.equal(far.child_ids[:, 0], fresh.child_ids[:, 0])
    read.clear()
    later = DraftContext(tokens, torch.tensor([32, 17]), [0, 1])  # 2 and 5 behind: continued, not restarted
    assert drafter.behind(later) == 5
    drafter.propose(later)
    assert read == [5] and drafter._fed.tolist() == [32, 17]
    assert drafter.behind(DraftContext(tokens, torch.tensor([32, 27]), [0, 1])) == 8  # 10 behind: the window


def test_beam_trees_deeper_than_the_shape_fit_in_the_cache():
    """The target's cache is sized for the drafter's own depth (7 beam steps), not the default
    shape's: a deterministic target drafted by itself accepts all 7 drafts every step, so the last
    step starts 1 token short of max_new_tokens with a depth-7 tree."""
    V = 5
    table = torch.zeros(V, V, V, dtype=torch.float64)
    for a in range(V):
        for b in range(V):
            table[a, b, (a + 2 * b + 1) % V] = 1.0
    target = MarkovLM(table)
    drafter = SSMDrafter(MarkovLM(table), mode="beam", beams=2, steps=7)
    ref = generate(target, [[1, 2, 1]], method="autoregressive", max_new_tokens=18)
    # an explicit tree: every step verified (beam mode drafts its own 7-deep trees whatever the shape)
    out = generate(target, [[1, 2, 1]], drafter=drafter, tree=TreeShape.chain(1), max_new_tokens=18)
    assert out.sequences == ref.sequences and out.stats.accepted[0][:2] == [7, 7]
    auto = generate(target, [[1, 2, 1]], drafter=drafter, max_new_tokens=18)  # tree="auto": the same room
    assert auto.sequences == ref.sequences


@pytest.mark.parametrize("mode, depth", [("static", 2), ("beam", 3)])
def test_a_draft_past_max_length_is_refused_before_any_step(mode, depth, monkeypatch):
    """Levels step without checks of their own: the room for the whole draft (context plus the
    tree's depth) is checked once, up front, and a draft that would not fit is a ValueError."""
    model = mamba2(seed=3)
    tokens = torch.randint(0, 90, (1, 40), generator=torch.Generator().manual_seed(2))
    make = lambda: SSMDrafter(model, TreeShape.full(2, 2), mode=mode, beams=2, steps=3, max_length=20)
    make().propose(DraftContext(tokens, torch.tensor([20 - depth]), [0]))  # just fits
    steps = []
    monkeypatch.setattr(model, "step", lambda *a, **kw: steps.append(1))
    with pytest.raises(ValueError, match=f"{21 - depth} tokens and a draft {depth} deep would pass the drafter's "
                                         "max_length 20"):
        make().propose(DraftContext(tokens, torch.tensor([21 - depth]), [0]))
    assert steps == []


@pytest.mark.parametrize("mode", ["static", "beam"])
def test_each_level_costs_one_step_over_its_new_nodes(mode, monkeypatch):
    """Drafting feeds each level with children below once (a step over its nodes, leaves
    included, per batch row) and never re-runs the tree drafted so far; new context tokens off
    the drafted tree, root included, go in as one chain."""
    model = mamba2(seed=3)
    shape = TreeShape.paper13()  # levels [1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]; leaves 3, 6, 8, 9, 10-12
    drafter = SSMDrafter(model, shape, mode=mode, beams=2, steps=3, seed=0)
    tokens = torch.randint(0, 90, (2, 30), generator=torch.Generator().manual_seed(2))
    drafter.propose(DraftContext(tokens, torch.tensor([6, 9]), [0, 1]))
    rows, trees = [], []
    monkeypatch.setattr(model, "step", lambda t, cache, _real=model.step, **kw: rows.append(len(t)) or _real(t, cache, **kw))
    monkeypatch.setattr(model, "prefill", lambda ids, cache, _real=model.prefill, **kw:  # a catch-up's chain
                        trees.append(ids.shape[1]) or _real(ids, cache, **kw))
    drafter.propose(DraftContext(tokens, torch.tensor([9, 12]), [0, 1]))
    assert trees == [3]  # three new context tokens per row, one prefill whose last logits draft the root's children
    assert rows == ([2 * 3, 2 * 3, 2 * 3] if mode == "static" else [2 * 2, 2 * 2])


def _path(tree, row, nodes):
    return tree.tokens[row, nodes].tolist()


@pytest.mark.parametrize("mode", ["static", "beam"])
def test_an_accepted_path_is_not_fed_again(mode, monkeypatch):
    """When the new tokens follow the drafted tree, each row resumes from the state drafting
    left at the deepest fed node on them: the target's last token alone is left (one step),
    or two steps past a leaf drafting never fed, the first without the head (its logits go
    unread); rows off the tree chain-feed their tokens. The laws drafted next equal a fresh
    drafter's on the same contexts. (Drafts level by level: a model without the greedy draft's one
    call, whose resumption test_one_call_drafts_are_the_level_by_level_drafts covers.)"""
    monkeypatch.setattr(Mamba2LM, "fused_draft", lambda self, *a: None)
    model = mamba2(seed=3)
    shape = TreeShape.paper13()
    tokens = torch.randint(0, 90, (3, 40), generator=torch.Generator().manual_seed(4))
    lengths = torch.tensor([6, 9, 7])
    make = lambda: SSMDrafter(model, shape, mode=mode, stochastic=False, beams=2, steps=3)
    drafter = make()
    tree = drafter.propose(DraftContext(tokens, lengths, [0, 1, 2]))
    # row 0 accepts root-1 (a node with children), row 2 the path to the last node (a leaf of the
    # deepest level), row 1 nothing; then each row's bonus token
    paths = {0: [0, 1], 2: tree.leaf_paths(2)[-1]}
    assert paths[2][-1] == tree.n - 1
    for r, nodes in paths.items():
        tokens[r, lengths[r]: lengths[r] + len(nodes) - 1] = torch.tensor(_path(tree, r, nodes[1:]))
    grown = lengths + torch.tensor([len(paths[0]), 1, len(paths[2])])
    context = DraftContext(tokens, grown, [0, 1, 2])
    rows, trees = [], []
    monkeypatch.setattr(model, "step", lambda t, cache, _real=model.step, heads=None, **kw: rows.append(
        (len(t), None if heads is None else len(heads))) or _real(t, cache, heads=heads, **kw))
    monkeypatch.setattr(model, "prefill", lambda ids, cache, _real=model.prefill, **kw:  # a catch-up's chain
                        trees.append(ids.shape[1]) or _real(ids, cache, **kw))
    # rows with 1, 1 and 2 tokens left: one prefill of 2 over all rows, each feeding its own
    drafter.propose(context)
    assert trees == [2] and drafter._fed.tolist() == grown.tolist()
    # the same contexts, each row alone: row 0 one step, row 2 (past a leaf) two steps, the first headless
    for r, steps in ((0, [(1, None)]), (2, [(1, 0), (1, None)])):
        alone = make()
        first = alone.propose(DraftContext(tokens, lengths, [r]))
        assert torch.equal(first.tokens[0], tree.tokens[r])
        rows.clear(), trees.clear()
        resumed = alone.propose(DraftContext(tokens, grown, [r]))
        assert trees == [] and rows[: len(steps)] == steps
        fresh = make()
        assert torch.equal(resumed.tokens, fresh.propose(DraftContext(tokens, grown, [r])).tokens)
        assert torch.allclose(alone._last, fresh._last, atol=1e-5)  # the drafter's logits after the context


@pytest.mark.parametrize("parents", [(-1, 0, 0, 2, 2, 4), (-1, 0, 0, 0, 2, 3, 3, 5, 6), (-1, 0, 0, 2, 1, 3, 4)])
def test_static_drafts_follow_each_nodes_own_path(parents):
    """Drafts against their definition: the law node v's children are drawn from (its top 10,
    attached to the tree) is the drafter's after the context and v's root path, here each path
    prefilled anew. The shapes put leaves before inner nodes within a level (the work cache's
    rows follow the level's nodes, and the step makes the inner nodes' logits alone), and the
    last one a level's inner nodes in another order than its nodes (node 2's child first)."""
    model = mamba2(seed=5)
    shape, kids = TreeShape(parents), TreeShape(parents).children()
    tokens = torch.randint(0, 90, (2, 12), generator=torch.Generator().manual_seed(6))
    lengths = torch.tensor([7, 10])
    tree = SSMDrafter(model, shape, seed=1).propose(DraftContext(tokens, lengths, [0, 1]))
    for row in range(2):
        for v in (v for v in range(shape.n) if kids[v]):
            path, u = [], v
            while u:
                path.insert(0, int(tree.tokens[row, u]))
                u = shape.parents[u]
            seq = torch.tensor([tokens[row, : lengths[row]].tolist() + path])
            law = torch.softmax(model.prefill(seq, model.allocate_cache(1, 64))[0], -1).topk(10)
            assert torch.allclose(tree.child_probs[row, v], law.values, atol=1e-5), (row, v)
            assert tree.child_ids[row, v].tolist() == law.indices.tolist(), (row, v)


def test_a_grown_tree_resumes_from_its_deepest_fed_node(monkeypatch):
    """Dynamic trees too: after the tokens of the path to the deepest node drafting fed, plus a
    bonus token, one step (the bonus) brings the cache to the context, with a fresh drafter's
    logits."""
    model = mamba2(seed=3)
    budget = TreeBudget(12, 4, 3)
    tokens = torch.randint(0, 90, (1, 40), generator=torch.Generator().manual_seed(8))
    make = lambda: SSMDrafter(model, budget, stochastic=False)
    drafter = make()
    tree = drafter.propose(DraftContext(tokens, torch.tensor([6]), [0]))
    fed = np.flatnonzero(drafter._drafted.level[0] >= 0).tolist()
    deepest = max(fed, key=lambda v: int(tree.depth[0, v]))
    path, u = [], deepest
    while u:
        path.insert(0, int(tree.tokens[0, u]))
        u = int(tree.parents[0, u])
    assert len(path) >= 2  # a fed node below the first level
    tokens[0, 6: 6 + len(path)] = torch.tensor(path)
    grown = torch.tensor([6 + len(path) + 1])
    rows, trees = [], []
    monkeypatch.setattr(model, "step", lambda t, cache, _real=model.step, **kw: rows.append(len(t)) or _real(t, cache, **kw))
    monkeypatch.setattr(model, "prefill", lambda ids, cache, _real=model.prefill, **kw:  # a catch-up's chain
                        trees.append(ids.shape[1]) or _real(ids, cache, **kw))
    drafter.propose(DraftContext(tokens, grown, [0]))
    assert trees == [] and rows[0] == 1
    fresh = make()
    fresh.propose(DraftContext(tokens, grown, [0]))
    assert torch.allclose(drafter._last, fresh._last, atol=1e-5)


def test_a_static_plan_keeps_its_host_tensors_on_the_host_whatever_the_default_device():
    """The plan is cached per shape: one made inside a default-device context (the meta device
    stands in for a GPU) must not hand later calls device tensors where the host reads them."""
    from stree.drafters.ssm import _static_plan

    shape = TreeShape((-1, 0, 0, 1, 2, 2, 3))
    with torch.device("meta"):
        plan = _static_plan(shape, 2, "cpu")
    tensors = [t for level in plan for t in (level.frontier, level.nodes, level.draw, level.fork, level.inner)
               if t is not None]
    assert tensors and {t.device.type for t in tensors} == {"cpu"}


def test_build_steps_each_row_count_once_per_drafter_model(monkeypatch):
    """``build`` (run before a call decodes) steps each row count its shapes' levels and the
    batch's catch-up take, and prefills the batch's catch-ups of 4, 8, ... ``CATCH_WINDOW``
    tokens, once per drafter model and cache size in the process: ``LM.generate`` makes a new
    drafter every call, and stepping again in each call cost every call on an H200 a sixth of
    its time."""
    model = mamba2(seed=3)
    stepped, prefilled = [], []
    step, prefill = model.step, model.prefill
    monkeypatch.setattr(model, "step", lambda tokens, cache, **kw: stepped.append(tokens.shape[0]) or
                        step(tokens, cache, **kw))
    monkeypatch.setattr(model, "prefill", lambda ids, cache, **kw: prefilled.append(tuple(ids.shape)) or
                        prefill(ids, cache, **kw))
    shape = TreeShape.full(2, 2)  # levels of 1 and 2 rows a batch row
    SSMDrafter(model, shape).build([shape], 2)
    # the catch-up's 2 rows, with the head and without; the second level's 2 x 2 (the first: the batch's)
    assert sorted(stepped) == [2, 2, 4]
    assert prefilled == [(2, 4), (2, 8), (2, 16), (2, 32), (2, 64)] and SSMDrafter.CATCH_WINDOW == 64
    SSMDrafter(model, shape).build([shape], 2)
    SSMDrafter(model, shape, mode="beam").build([shape], 3)  # (beam drafts have no static levels)
    assert sorted(stepped) == [2, 2, 4] and len(prefilled) == 5
    SSMDrafter(model, shape).build([shape], 3)  # a new batch size: its rows only
    assert sorted(stepped) == [2, 2, 3, 3, 4, 6] and len(prefilled) == 10
    SSMDrafter(model, shape, max_length=128).build([shape], 2)  # another cache size: stepped again
    assert sorted(stepped) == [2, 2, 2, 2, 3, 3, 4, 4, 6] and len(prefilled) == 15
    SSMDrafter(model, shape, max_length=20).build([shape], 2)  # catch-ups only as long as the cache holds
    assert prefilled[15:] == [(2, 4), (2, 8), (2, 16)]
    headed = []
    monkeypatch.setattr(model, "step", lambda tokens, cache, heads=None, **kw: headed.append(
        (tokens.shape[0], None if heads is None else len(heads))) or step(tokens, cache, heads=heads, **kw))
    lopsided = TreeShape((-1, 0, 0, 1))  # node 2 a leaf of a fed level: the step's head on node 1's rows alone
    SSMDrafter(model, lopsided).build([lopsided], 2)
    assert headed == [(4, 2)]  # (the batch's own 2 rows were stepped above)
    SSMDrafter(model, lopsided).build([lopsided], 1)  # a catch-up's step with its head and without, the level's
    assert sorted(headed[1:], key=str) == [(1, 0), (1, None), (2, 1)]


class _LevelByLevel:
    """A model as the drafter sees it without the greedy draft's one call (``draft_greedy``)."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        if name == "draft_greedy":
            raise AttributeError(name)
        return getattr(self._model, name)


@pytest.mark.skipif(not mamba_step.available(), reason="no C++ compiler for the CPU library here")
@pytest.mark.parametrize("parents", [(-1, 0, 1, 2), TreeShape.paper13().parents, (-1, 0, 0, 2, 1, 3, 4)])
def test_one_call_drafts_are_the_level_by_level_drafts(parents, monkeypatch):
    """Greedy drafts of a static shape over three rows, eight times, each row then accepting a random
    part of a random path and a bonus (rows falling behind and reordered once): the one-call drafts
    (the whole head) are the level-by-level drafter's tree for tree, its steps and prefills the
    model's blocks' own (PyTorch and numba, not the C++ the one call shares with the one-call step),
    and rows resume from the state of a node drafting stepped wherever their new tokens followed one."""
    monkeypatch.setattr(Mamba2LM, "fused_step", lambda self, *a: None)
    monkeypatch.setattr(Mamba2LM, "fused_prefill", lambda self, *a: None)
    model = mamba2(seed=3)
    shape = TreeShape(parents)
    gen = torch.Generator().manual_seed(len(parents))
    tokens = torch.randint(0, 90, (3, 120), generator=gen)
    lengths = torch.tensor([6, 9, 7])
    restored = []
    real = mamba_step.MambaStep.draft
    monkeypatch.setattr(mamba_step.MambaStep, "draft", lambda self, *a: restored.append(a[8] is not None)
                        or real(self, *a))
    one, levels = (SSMDrafter(m, shape, stochastic=False) for m in (model, _LevelByLevel(model)))
    rows = [0, 1, 2]
    for turn in range(8):
        if turn == 5:
            rows = [2, 0]  # (a row dropped, the rest reordered)
        context = DraftContext(tokens, lengths, rows)
        got, want = one.propose(context), levels.propose(context)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents), turn
        for i, r in enumerate(rows):  # a path's first k nodes accepted, then a bonus token
            path = got.leaf_paths(i)[int(torch.randint(0, len(got.leaf_paths(i)), (1,), generator=gen))]
            k = int(torch.randint(0, len(path), (1,), generator=gen))
            new = got.tokens[i, path[1: k + 1]].tolist() + [int(torch.randint(0, 90, (1,), generator=gen))]
            tokens[r, lengths[r]: lengths[r] + len(new)] = torch.tensor(new)
            lengths[r] += len(new)
    assert len(restored) == 8 and sum(restored) >= 3


def test_a_cut_head_drafts_among_the_most_frequent_tokens_alone():
    """A drafter whose model ranks its tokens (draft_vocab.json): greedy drafts choose among the first
    ``head_share`` of the vocabulary alone; ``head_share=None`` among every token; a share outside
    (0, 1] is a ValueError."""
    model = mamba2(seed=3)
    model.draft_vocab = torch.randperm(model.vocab_size, generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, 90, (2, 30), generator=torch.Generator().manual_seed(2))
    context = DraftContext(tokens, torch.tensor([9, 12]), [0, 1])
    keep = set(model.draft_vocab[: round(0.25 * model.vocab_size)].tolist())
    cut = SSMDrafter(model, TreeShape.paper13(), stochastic=False).propose(context)
    assert set(cut.tokens[:, 1:].flatten().tolist()) <= keep
    whole = SSMDrafter(model, TreeShape.paper13(), stochastic=False, head_share=None).propose(context)
    assert not set(whole.tokens[:, 1:].flatten().tolist()) <= keep
    for share in (0, 1.5):
        with pytest.raises(ValueError, match="head_share must be in"):
            SSMDrafter(model, head_share=share)


@pytest.mark.skipif(not mamba_step.available(), reason="no C++ compiler for the CPU library here")
def test_the_drafters_of_one_model_cut_its_head_once():
    """``LM.generate`` makes a drafter per call: every drafter of a model drafts among one ids tensor,
    so the one-call step packs that cut of the head once (packed per drafter, each call paid half a
    millisecond and kept another copy); a caller handing new ids each time keeps the step's last
    ``CUTS`` cuts alone."""
    model = mamba2(seed=3)
    model.draft_vocab = torch.randperm(model.vocab_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        step = fused_step(model, model.allocate_cache(1, 8), None, "auto")
    packed, pack = [], step._pack
    step._pack = lambda w: packed.append(w.shape[0]) or pack(w)
    tokens = torch.randint(0, 90, (2, 30), generator=torch.Generator().manual_seed(2))
    drafts = [SSMDrafter(model, TreeShape.paper13(), stochastic=False).propose(
        DraftContext(tokens, torch.tensor([9, 12]), [0, 1])) for _ in range(5)]
    assert packed == [round(0.25 * model.vocab_size)]
    assert all(torch.equal(d.tokens, drafts[0].tokens) for d in drafts)
    for k in range(1, 3 * step.CUTS):
        step.head_cut(torch.arange(k))
    assert len(step._cuts) == step.CUTS and len(packed) == 3 * step.CUTS
    recent = torch.arange(7)
    step.head_cut(recent), step.head_cut(recent)
    assert len(packed) == 3 * step.CUTS + 1 and len(step._cuts) == step.CUTS
