"""STAND's initial tree, per-node acceptance counting, and the top-K tree optimiser."""

import collections

import pytest
import torch
from tiny_models import mamba2

from stree.drafters import STANDDrafter, STANDStore
from stree.drafters.calibrate import AcceptanceCounter, optimize_tree, stand_initial_tree
from stree.decoding.loop import generate
from stree.testing import MarkovLM
from stree.tree import TreeShape
from stree.tools.optimize_tree import calibrate, optimize_static_tree


def test_initial_tree_is_algorithm_1():
    tree = stand_initial_tree()
    assert tree.n == 625 and tree.max_depth == 20
    per_depth = [c for _, c in sorted(collections.Counter(tree.depth).items())]
    assert per_depth == [1, 8, 24, 64, 141, 170, 68, 39, 14] + [8] * 12
    kids = tree.children()
    # depth-1 children: max(8 - 2*order, 1), the level's first node at least 3
    assert [len(kids[c]) for c in kids[0]] == [8, 6, 4, 2, 1, 1, 1, 1]


def test_optimizer_keeps_the_most_accepted_nodes_closed_and_renumbered():
    shape = TreeShape.full(3, 2)  # 1,2,3 under the root; 4-6 under 1; 7-9 under 2; 10-12 under 3
    counts = [100, 50, 50, 10, 30, 5, 5, 20, 20, 0, 0, 0, 0]
    kept = optimize_tree(shape, counts, nodes=4)
    assert kept.parents == (-1, 0, 0, 1, 2)  # 1, 2, 4, 7: ties go to the lower sibling rank (7 over 8)
    assert optimize_tree(shape, counts, nodes=2).parents == (-1, 0, 0)
    # a tie between depths goes to the shallower node: 3 (depth 1) over 4 (depth 2) at count 30
    counts[3] = 30
    assert optimize_tree(shape, counts, nodes=3).parents == (-1, 0, 0, 0)
    # a child counted above its parent waits for the parent (ancestor closure), and kept siblings
    # are renumbered in their original rank order: 2's children 8 and 9 become ranks 0 and 1
    counts = [100, 0, 40, 0, 0, 0, 0, 0, 60, 55, 0, 0, 0]
    assert optimize_tree(shape, counts, nodes=3).parents == (-1, 0, 1, 1)
    assert optimize_tree(shape, counts, nodes=50).n == 13
    with pytest.raises(ValueError, match="counts has 3 entries"):
        optimize_tree(shape, [1, 2, 3])


def test_counter_counts_accepted_paths():
    shape = TreeShape.full(2, 2)
    counter = AcceptanceCounter(shape)

    class Result:
        accepted = torch.tensor([[0, 2, 5, 0], [0, 1, 0, 0], [0, 0, 0, 0]])
        num_accepted = torch.tensor([3, 2, 1])

    counter([0, 1, 2], type("T", (), {"n": 7})(), Result())
    assert counter.counts.tolist() == [3, 1, 1, 0, 0, 1, 0]


def test_calibration_on_a_markov_target_gives_a_tree_that_decodes():
    torch.manual_seed(0)
    table = torch.distributions.Dirichlet(torch.full((6,), 0.3, dtype=torch.float64)).sample((6,))
    model = MarkovLM(table)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 6, (4,), generator=g).tolist() for _ in range(4)]
    drafter = STANDDrafter(STANDStore(top_k=4))
    initial = stand_initial_tree()
    counts = calibrate(model, prompts, drafter, initial, temperature=0.6, max_new_tokens=60)
    for v in range(1, initial.n):  # a node is accepted only after its parent
        assert counts[v] <= counts[initial.parents[v]]
    assert counts[1:].sum() > 0
    shape, _ = optimize_static_tree(model, prompts, drafter, initial=initial, nodes=20, temperature=0.6,
                                    max_new_tokens=60)
    assert shape.n == 21
    out = generate(model, prompts, drafter=STANDDrafter(STANDStore(top_k=4), shape), max_new_tokens=40,
                   temperature=0.6, seed=3)
    assert out.stats.tau > 1


def test_the_625_node_tree_runs_through_a_model():
    model = mamba2()
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    ref = generate(model, [prompt], method="autoregressive", max_new_tokens=12)
    drafter = STANDDrafter(STANDStore(), stand_initial_tree())
    generate(model, [prompt], drafter=drafter, max_new_tokens=12)  # fills the store
    sizes = []
    out = generate(model, [prompt], drafter=drafter, max_new_tokens=12, on_step=lambda r, tree, res: sizes.append(tree.n))
    assert out.sequences == ref.sequences
    assert 625 in sizes  # full 625-node verify passes happened
