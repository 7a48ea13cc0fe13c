"""The paper's full unrolled baseline (``generate(method="unrolled")``): every root-to-leaf path
through the whole model from its own state; same outputs and acceptances as the packed tree, at
the paths' total length in tokens and one state copy per path."""

import pytest
import torch
from tiny_models import FAMILIES

from stree.decoding.loop import generate
from stree.tree import TokenTree, TreeShape
from stree.runtime.unrolled import UnrolledTarget

PROMPTS = [[1, 2, 3, 1, 2, 3], [4, 5, 4, 5]]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("shape", [TreeShape.paper13(), TreeShape.full(2, 3)], ids=["paper13", "binary15"])
def test_unrolled_decoding_equals_the_packed_tree(family, shape):
    model = FAMILIES[family]()
    ref = generate(model, PROMPTS, method="autoregressive", max_new_tokens=16)
    packed = generate(model, PROMPTS, method="stree", tree=shape, max_new_tokens=16)
    unrolled = generate(model, PROMPTS, method="unrolled", tree=shape, max_new_tokens=16)
    assert unrolled.sequences == ref.sequences and unrolled.stats.accepted == packed.stats.accepted
    kw = dict(tree=shape, max_new_tokens=10, temperature=0.8, seed=4)
    assert generate(model, PROMPTS, method="unrolled", **kw).sequences == generate(model, PROMPTS, **kw).sequences


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_node_logits_come_from_each_path_run_whole(family):
    model = FAMILIES[family]()
    shape = TreeShape.full(2, 3)
    cache = model.allocate_cache(2, 64)
    model.prefill(torch.tensor([[7, 8, 9, 10], [11, 12, 13, 14]]), cache)
    tree = TokenTree.from_shape(shape, torch.randint(0, 80, (2, shape.n), generator=torch.Generator().manual_seed(0)))
    packed, _ = model.forward_tree(tree, cache)
    seen = []
    real = model.forward_tree
    model.forward_tree = lambda t, c, **kw: (seen.append(tuple(t.tokens.shape)), real(t, c, **kw))[1]
    try:
        logits, handle = UnrolledTarget(model).forward_tree(tree, cache)
    finally:
        del model.forward_tree
    assert seen == [(2 * 8, 4)]  # 8 root-to-leaf paths of 4 tokens per row: 32 tokens a row
    assert handle.states.batch_size == 16  # one state per path
    assert (logits - packed).abs().max() < 1e-4


def test_unrolled_refuses_graphs_and_compile():
    with pytest.raises(ValueError, match="method='unrolled'"):
        generate(FAMILIES["mamba2"](), PROMPTS, method="unrolled", torch_compile=True, max_new_tokens=4)
