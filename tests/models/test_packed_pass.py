"""A batch of trees of different sizes in one model pass (``forward_packed``, the packed layout
engines use): each row's logits are its own ``forward_tree``'s, and committing each row's path
leaves the state its own commit leaves, for every family and kernel backend."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import parent_lists
from tiny_models import FAMILIES, VOCAB

from stree.testing import root_path
from stree.tree import TokenTree, pack_trees

TOL = 1e-4


def _prefilled(model, lengths, seed):
    """A cache of rows of these lengths, prefilled by the default kernels (the interpreted Triton
    ones are for the passes under test)."""
    g = torch.Generator().manual_seed(seed)
    cache = model.allocate_cache(len(lengths), 48)
    ids = torch.randint(0, VOCAB, (len(lengths), max(lengths)), generator=g).to(model.device)
    backend, model.kernel_backend = model.kernel_backend, "auto"
    model.prefill(ids, cache, lengths=torch.tensor(lengths, device=model.device))
    model.kernel_backend = backend
    return cache


def _committed(cache, row):
    """Row ``row``'s states and its KV entries up to its length (slots past it are scratch)."""
    return [t[:, row] for t in (cache.conv, cache.ssm) if t is not None] + [
        t[:, row, : int(cache.seqlens[row])] for t in (cache.k, cache.v) if t is not None]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kernel_backend", ["auto", "triton"])
@settings(max_examples=3)
@given(data=st.data())
def test_a_packed_pass_is_each_rows_own_pass_and_commit(family, kernel_backend, data, backend_device):
    model = FAMILIES[family]().to(backend_device)
    model.kernel_backend = kernel_backend
    lengths = [5, 2, 9]
    trees = [data.draw(parent_lists(data.draw(st.integers(1, 12)))) for _ in lengths]
    packed = pack_trees(trees, device=backend_device)
    g = torch.Generator().manual_seed(len(trees[0]))
    tokens = torch.randint(0, VOCAB, (1, packed.total), generator=g).to(backend_device)
    paths = [root_path(t, data.draw(st.integers(0, len(t) - 1))) for t in trees]
    L = max(map(len, paths))
    accepted = torch.tensor([p + [0] * (L - len(p)) for p in paths], device=backend_device)
    num = torch.tensor([len(p) for p in paths], device=backend_device)

    cache = _prefilled(model, lengths, 1)
    logits, tree_pass = model.forward_packed(tokens, packed, cache)
    model.commit(cache, tree_pass, accepted, num)
    assert cache.seqlens.tolist() == [n + len(p) for n, p in zip(lengths, paths)]

    cu = packed.cu_seqlens.tolist()
    # each row's own pass by the default kernels (the interpreted Triton ones' own passes are held
    # to these by tests/models/test_protocol.py)
    model.kernel_backend = "auto"
    for r, parents in enumerate(trees):
        own = _prefilled(model, lengths, 1).select(torch.tensor([r], device=backend_device))
        tree = TokenTree(torch.tensor(parents, device=backend_device), tokens[:, cu[r]:cu[r + 1]])
        want, own_pass = model.forward_tree(tree, own)
        torch.testing.assert_close(logits[0, cu[r]:cu[r + 1]], want[0], rtol=TOL, atol=TOL, msg=f"row {r}")
        model.commit(own, own_pass, accepted[r:r + 1, :len(paths[r])], num[r:r + 1])
        for got, expected in zip(_committed(cache, r), _committed(own, 0)):
            torch.testing.assert_close(got, expected, rtol=TOL, atol=TOL, msg=f"row {r}")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_packed_pass_multiplies_the_packed_nodes_alone_and_scans_on_the_bound_kernels(family):
    """On the CPU the products of a packed pass see its ``total`` nodes, not the padded ``batch *
    max_n`` (the point of packing), while its Mamba2 layers run the bound kernels on the padded
    layout: their scratch is padded and commit replays it with them (the generic path those layers
    took before had cost a packed pass about twice a padded one: docs/decoding.md)."""
    model = FAMILIES[family]()
    packed = pack_trees([[-1, 0, 1, 1, 0], [-1], [-1, 0]])
    rows = []
    hooks = [m.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[:-1].numel()))
             for m in model.modules() if isinstance(m, torch.nn.Linear)]
    cache = _prefilled(model, [4, 3, 6], 0)
    rows.clear()
    _, tree_pass = model.forward_packed(torch.randint(0, VOCAB, (1, packed.total)), packed, cache)
    for h in hooks:
        h.remove()
    assert rows and set(rows) == {packed.total}
    ssm_layers = sum(kind == "ssm" for kind in model.kinds())
    assert tree_pass.ssm.kernels is not None and None not in tree_pass.ssm.kernels
    assert tuple(tree_pass.ssm.x.shape[:3]) == (ssm_layers, packed.batch, packed.max_n)


def test_bad_packed_passes_are_refused():
    model = FAMILIES["hybrid"]()
    cache = _prefilled(model, [3, 4], 0)
    packed = pack_trees([[-1, 0, 0], [-1]])
    with pytest.raises(TypeError, match="trees must be PackedTrees"):
        model.forward_packed(torch.zeros(1, 4, dtype=torch.long), [[-1, 0, 0], [-1]], cache)
    with pytest.raises(ValueError, match=r"tokens must have shape \[1, 4\]"):
        model.forward_packed(torch.zeros(2, 2, dtype=torch.long), packed, cache)
    with pytest.raises(ValueError, match="the cache holds 2 rows but the input has batch 3"):
        model.forward_packed(torch.zeros(1, 5, dtype=torch.long), pack_trees([[-1], [-1], [-1, 0, 1]]), cache)
    _, tree_pass = model.forward_packed(torch.zeros(1, 4, dtype=torch.long), packed, cache)
    with pytest.raises(ValueError, match=r"accepted\[1, 1\] = 1 is not a node index in \[0, 1\)"):
        model.commit(cache, tree_pass, torch.tensor([[0, 1], [0, 1]]), torch.tensor([2, 2]))
    _, tree_pass = model.forward_packed(torch.zeros(1, 5, dtype=torch.long), pack_trees([[-1, 0, 0, 1], [-1]]), cache)
    with pytest.raises(ValueError, match=r"accepted\[0\] is not a root path: node 3 is not a child of node 2"):
        model.commit(cache, tree_pass, torch.tensor([[0, 2, 3], [0, 0, 0]]), torch.tensor([3, 1]))
