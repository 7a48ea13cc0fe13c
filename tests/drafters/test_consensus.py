"""Consensus-DAG drafter (paper 003): exact, fuzzy and backed-off suffix matches, the DAG's merge
arithmetic and extraction on hand-built paths, tree filling, and losslessness on a Markov target."""

import pytest
import torch

from stree.drafters import ConsensusDAG, ConsensusDrafter, DraftContext, PathStore, TargetTop
from stree.drafters.consensus import Candidate
from stree.decoding.loop import generate
from stree.testing import MarkovLM, cell_counts, chi_square
from stree.tree import TreeShape


def path(store, context, tokens, probs):
    pid = store.open(context)
    store.extend(pid, tokens, probs)
    return pid


def found(cands):
    return [(c.tokens, c.probs, c.weight, c.path) for c in cands]


def test_exact_fuzzy_and_backed_off_matches():
    store = PathStore(k=3)
    p0 = path(store, [0, 1, 2, 3], [4, 5, 6, 7], [0.9, 0.8, 0.7, 0.6])
    assert store.tokens[p0] == [1, 2, 3, 4, 5, 6, 7]  # only the last k context tokens are kept
    assert found(store.candidates([3, 4, 5], 4)) == [([6, 7], [0.7, 0.6], 1.0, p0)]
    assert found(store.candidates([8, 4, 5], 4, fuzzy_weight=0.25)) == [([6, 7], [0.7, 0.6], 0.25, p0)]
    assert found(store.candidates([3, 8, 5], 1)) == [([6], [0.7], 0.5, p0)]
    # no 3-gram within one substitution: back off to 2 tokens, then 1
    assert found(store.candidates([8, 8, 5], 4)) == [([6, 7], [0.7, 0.6], 1.0, p0)]
    assert store.candidates([8, 8, 5], 4, min_k=2) == [] and store.candidates([8, 8, 8], 4) == []
    # context tokens are never continuations; the first generated token is
    assert store.candidates([1, 2], 4) == [] and found(store.candidates([2, 3], 2)) == [([4, 5], [0.9, 0.8], 1.0, p0)]
    assert store.candidates([3, 4, 5], 4, exclude=p0) == []
    assert store.candidates([6, 7], 4) == []  # the path's end has no continuation yet
    assert PathStore(k=3, fuzzy=False).candidates([8, 4, 5], 4) == []


def test_fuzzy_matches_are_within_edit_distance_one_with_the_last_token_aligned():
    """The paper's fuzzy matching: a path holding one token more, or one fewer, inside the query's
    window matches; leaving out the window's last token does not (the continuation would not
    follow the query's last token)."""
    store = PathStore(k=3)
    longer = path(store, [0], [1, 2, 9, 3, 4, 5], [0.5] * 6)  # 9 inserted between 2 and 3
    # (1, 2, 9) is one substitution away too: substitutions are probed first
    assert found(store.candidates([1, 2, 3], 2, fuzzy_weight=0.25)) == [([3, 4], [0.5, 0.5], 0.25, longer),
                                                                        ([4, 5], [0.5, 0.5], 0.25, longer)]
    store = PathStore(k=3)
    shorter = path(store, [0], [1, 3, 4, 5], [0.5] * 4)  # the query's 2 missing
    assert found(store.candidates([1, 2, 3], 2, fuzzy_weight=0.25)) == [([4, 5], [0.5, 0.5], 0.25, shorter)]
    store = PathStore(k=3)
    path(store, [0], [1, 2, 7], [0.5] * 3)
    assert store.candidates([1, 2, 3], 2) == []  # (1, 2) + 7 is not the query with its last 3 left out
    assert PathStore(k=3, fuzzy=False).candidates([1, 2, 3], 2) == []


def test_exact_before_fuzzy_most_recent_first_and_the_limit():
    store = PathStore(k=3)
    a = path(store, [1, 2, 3], [9, 1, 2, 3, 8], [0.5] * 5)  # (1,2,3) -> 9 and later -> 8
    b = path(store, [7, 2, 3], [4], [0.5])  # fuzzy for (1,2,3)
    c = path(store, [1, 2, 3], [5], [0.5])
    got = [(x.tokens[0], x.weight, x.path) for x in store.candidates([1, 2, 3], 1)]
    assert got == [(5, 1.0, c), (8, 1.0, a), (9, 1.0, a), (4, 0.5, b)]
    assert [x.tokens[0] for x in store.candidates([1, 2, 3], 1, limit=2)] == [5, 8]


def hand_candidates():
    return [Candidate([10, 11, 12], [0.5, 0.4, 0.3], 1.0, 0), Candidate([10, 11, 13], [0.5, 0.2, 0.9], 1.0, 1),
            Candidate([14, 11, 12], [0.3, 0.6, 0.5], 0.5, 2)]


def test_dag_merges_layers_and_weighs_edges():
    dag = ConsensusDAG(hand_candidates(), alpha=1.0)
    root = ConsensusDAG.ROOT
    assert dict(dag.edges[root]) == pytest.approx({10: 1.0, 14: 0.15})
    assert dict(dag.edges[1, 10]) == pytest.approx({11: 0.6}) and dict(dag.edges[1, 14]) == pytest.approx({11: 0.3})
    # (2, 11) is one node: both layer-1 tokens lead into it
    assert dag.in_weight[2, 11] == pytest.approx(0.9)
    assert dict(dag.edges[2, 11]) == pytest.approx({12: 0.3 + 0.25, 13: 0.9})
    assert dag.greedy_path(3) == [10, 11, 13] and dag.greedy_path(2) == [10, 11]
    assert dag.successors(root, 5) == [10, 14] and dag.successors((3, 13), 2) == []
    # alpha = 0: frequencies only (weighted count / 3 candidates): 12 (1.5/3) beats 13 (1/3)
    freq = ConsensusDAG(hand_candidates(), alpha=0.0)
    assert dict(freq.edges[2, 11]) == pytest.approx({12: 0.5, 13: 1 / 3}) and freq.greedy_path(3) == [10, 11, 12]


def test_successor_ties_break_by_in_weight_then_token():
    cands = [Candidate([1, 5], [0.5, 0.2], 1.0, 0), Candidate([1, 6], [0.5, 0.2], 1.0, 1),
             Candidate([2, 6], [0.1, 0.3], 1.0, 2), Candidate([3, 7], [0.1, 0.2], 1.0, 3)]
    dag = ConsensusDAG(cands)
    assert dag.successors((1, 1), 2) == [6, 5]  # equal edges; 6 has more in-weight (0.5 vs 0.2)
    assert dag.successors((0, -1), 3) == [1, 2, 3]  # 2 and 3 tie on everything: lower id first


def consensus_store():
    store = PathStore(k=3)
    path(store, [7, 8, 9], [10, 11, 12], [0.5, 0.4, 0.3])
    path(store, [7, 8, 9], [10, 11, 13], [0.5, 0.2, 0.9])
    path(store, [6, 8, 9], [14, 11, 12], [0.3, 0.6, 0.5])
    return store


def test_the_papers_extraction_takes_each_layers_heaviest_token():
    """Algorithm 1: per layer the token with the most in-weight, whatever edge leads to it; the
    path extraction follows edges from the chosen token."""
    cands = [Candidate([1, 2, 3], [0.7, 0.1, 0.1], 1.0, 0), Candidate([4, 5, 6], [0.5, 0.9, 0.9], 1.0, 1)]
    dag = ConsensusDAG(cands, alpha=1.0)
    assert [dag.layer_best(d, 1)[0] for d in (1, 2, 3)] == [1, 5, 6]
    assert dag.greedy_path(3) == [1, 2, 3] and dag.layer_best(2, 2) == [5, 2] and dag.layer_best(4, 1) == []
    store = PathStore(k=1)
    for c in cands:
        path(store, [8], c.tokens, c.probs)
    ctx = DraftContext(torch.tensor([[8]]), torch.tensor([1]), [0])
    paper = ConsensusDrafter(store, extraction="paper").propose(ctx, TreeShape.chain(3))
    assert paper.tokens[0].tolist() == [8, 1, 5, 6]
    assert ConsensusDrafter(store).propose(ctx, TreeShape.chain(3)).tokens[0].tolist() == [8, 1, 2, 3]
    with pytest.raises(ValueError, match="extraction must be one of"):
        ConsensusDrafter(extraction="best")


def test_drafts_fill_the_shape_along_dag_edges():
    ctx = DraftContext(torch.tensor([[1, 7, 8, 9], [5, 5, 5, 5]]), torch.tensor([4, 4]), [0, 1])
    drafter = ConsensusDrafter(consensus_store())
    chain = drafter.propose(ctx, TreeShape.chain(3))
    assert chain.tokens[0].tolist() == [9, 10, 11, 13] and chain.valid[0].all()
    assert chain.valid[1].tolist() == [True, False, False, False] and chain.tokens[1, 0] == 5  # no match
    tree = drafter.propose(ctx, TreeShape.from_children([3, 1, 1]))  # root: 3 slots; nodes 1, 2: 1 child
    assert tree.tokens[0, :5].tolist() == [9, 10, 14, 0, 11] and tree.tokens[0, 5] == 11
    assert tree.valid[0].tolist() == [True, True, True, False, True, True]
    assert tree.child_probs is None  # deterministic: one-hot verification


def test_rows_draft_from_each_other_not_from_themselves():
    drafter = ConsensusDrafter()
    tokens = torch.zeros(2, 12, dtype=torch.long)
    tokens[:, :3] = torch.tensor([1, 2, 3])
    ctx = DraftContext(tokens, torch.tensor([3, 3]), [0, 1])
    top = lambda p: [TargetTop(torch.zeros(len(p), 0, dtype=torch.long), torch.zeros(len(p), 0), torch.tensor(p))]
    drafter.observe(DraftContext(tokens, torch.tensor([3, 3]), [0]), [[4, 5, 6, 1, 2, 3]], top([0.1] * 6))
    tokens[0, 3:9] = torch.tensor([4, 5, 6, 1, 2, 3])
    ctx = DraftContext(tokens, torch.tensor([9, 3]), [0, 1])
    shape = TreeShape.chain(2)
    assert drafter.propose(ctx, shape).tokens.tolist() == [[3, 0, 0], [3, 4, 5]]
    assert drafter.propose(ctx, shape).valid[0].tolist() == [True, False, False]
    own = ConsensusDrafter(drafter.store, include_self=True)
    own._live = dict(drafter._live)
    assert own.propose(ctx, shape).tokens[0].tolist() == [3, 4, 5]
    assert drafter.store.probs[0][3:] == pytest.approx([0.1] * 6)
    drafter.reset()  # row 0's path is now an earlier trajectory: row 0 may draft from it
    assert drafter.propose(ctx, shape).tokens[0].tolist() == [3, 4, 5]


@pytest.mark.parametrize("extraction", ["path", "paper"])
def test_consensus_drafts_are_lossless_on_a_markov_target(extraction):
    """Rows sharing one prompt draft from earlier trajectories and from each other at T = 1: the
    joint of the first 3 tokens of 6k rows against the exact law (chi-square, p > 1e-3), with
    drafts actually accepted."""
    torch.manual_seed(5)
    model = MarkovLM(torch.distributions.Dirichlet(torch.full((5,), 0.5, dtype=torch.float64)).sample((5, 5)))
    prompt = [1, 2, 1, 2, 0, 1, 2, 1]
    drafter = ConsensusDrafter(min_k=2, extraction=extraction)
    shape = TreeShape.full(2, 2)
    generate(model, [prompt] * 100, drafter=drafter, tree=shape, max_new_tokens=30, temperature=1.0, seed=1)
    out = generate(model, [prompt] * 6000, drafter=drafter, tree=shape, max_new_tokens=3, temperature=1.0, seed=3)
    accepted = torch.tensor([sum(a) for a in out.stats.accepted], dtype=torch.float)
    assert accepted.mean() > 1.0
    assert chi_square(cell_counts(torch.tensor(out.new_tokens), 5), model.joint_law(prompt, 3))[2] > 1e-3


def test_generate_records_the_probability_each_emitted_token_had():
    torch.manual_seed(1)
    model = MarkovLM(torch.distributions.Dirichlet(torch.full((4,), 1.0, dtype=torch.float64)).sample((4, 4)))
    store = PathStore(k=3)
    prompts = [[0, 1, 2, 3], [3, 2, 1]]
    out = generate(model, prompts, drafter=ConsensusDrafter(store), tree=TreeShape.full(2, 2), max_new_tokens=12,
                   temperature=1.0, seed=0)
    assert len(store) == 2
    for prompt, seq, toks, probs in zip(prompts, out.sequences, store.tokens, store.probs):
        assert toks == seq[len(prompt) - 3:]  # the k context tokens, then everything emitted
        law = [float(model.table[seq[t - 2], seq[t - 1], seq[t]]) for t in range(len(prompt), len(seq))]
        assert probs[3:] == pytest.approx(law, abs=1e-6)


def test_capacity_drops_the_oldest_tokens_and_keeps_paths_extendable():
    """Past ``capacity`` tokens the oldest go (oldest paths first, each keeping its last k); what
    is left is found exactly as a store that only ever held it would find it."""
    store = PathStore(k=2, capacity=20, evict_fraction=0.5)
    old = path(store, [0, 1], [2, 3, 4, 5, 6, 7, 8, 9], [0.5] * 8)  # 10 tokens
    new = path(store, [20, 21], [22, 23, 24, 25, 26, 27, 28], [0.4] * 7)  # 9 tokens: 19 stored
    assert store.size == 19 and found(store.candidates([3, 4], 2)) == [([5, 6], [0.5, 0.5], 1.0, old)]
    store.extend(new, [29, 30], [0.4, 0.4])  # 21 > 20: down to 10
    assert store.size == 10 and store.tokens[old] == [8, 9] and store.candidates([3, 4], 2) == []
    assert found(store.candidates([24, 25], 2)) == [([26, 27], [0.4, 0.4], 1.0, new)]
    store.extend(old, [40], [0.9])  # the trimmed path goes on: its last k tokens were kept
    assert found(store.candidates([8, 9], 1)) == [([40], [0.9], 1.0, old)]
    for i in range(200):
        store.extend(new, [100 + i], [0.1])
        assert store.size <= 20
    with pytest.raises(ValueError, match="capacity"):
        PathStore(capacity=0)
