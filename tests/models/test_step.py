"""The single-token step: its own fast path (no tree, no scratch) must compute exactly what a
one-node tree and its commit compute, and without validation it must never wait on the host
(what CUDA-graph capture needs)."""

import pytest
import torch
from host_sync import HostSync, no_host_sync
from tiny_models import FAMILIES, VOCAB

from stree.tree import TokenTree, TreeShape


def _prefilled(model, lengths, seed):
    """Rows of these lengths, prefilled by the default kernels: here the step and the tree pass are
    under test (a Triton prefill, the same tree pass and commit on chains, is in the greedy identity
    tests through the Triton kernels)."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda *shape: torch.randint(0, VOCAB, shape, generator=g, device="cpu").to(model.device)  # noqa: E731
    cache = model.allocate_cache(len(lengths), 24)
    backend, model.kernel_backend = model.kernel_backend, "auto"
    model.prefill(draw(len(lengths), max(lengths)), cache, lengths=torch.tensor(lengths, device=model.device))
    model.kernel_backend = backend
    return cache, draw(len(lengths))


def _committed(cache, row):
    return [t[:, row] for t in (cache.conv, cache.ssm) if t is not None] + [
        t[:, row, : int(cache.seqlens[row])] for t in (cache.k, cache.v) if t is not None]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kernel_backend", ["auto", "triton"])
def test_step_equals_a_one_node_tree_and_its_commit(family, kernel_backend, backend_device):
    model = FAMILIES[family]().to(backend_device)
    model.kernel_backend = kernel_backend
    cache, tok = _prefilled(model, [6, 2, 9], seed=1)
    other = cache.clone()
    for _ in range(2):  # rows at different lengths, steps after steps
        got = model.step(tok, cache)
        tree = TokenTree.from_shape(TreeShape.chain(0), tok[:, None])
        want, tree_pass = model.forward_tree(tree, other)
        model.commit(other, tree_pass, torch.zeros(3, 1, dtype=torch.long, device=backend_device),
                     torch.ones(3, dtype=torch.long, device=backend_device))
        want = want[:, 0]
        assert (got - want).abs().max() <= 1e-5
        assert torch.equal(cache.seqlens, other.seqlens)
        for b in range(3):
            for a, c in zip(_committed(cache, b), _committed(other, b)):
                assert (a - c).abs().max() <= 1e-5
        tok = got.argmax(-1)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_step_with_heads_makes_those_rows_logits_alone_and_moves_every_row(family):
    """``heads``: a drafter's level feeds its leaves for their states only; the step then makes
    the logits of the rows asked for (in that order, repeats allowed), and every row's state
    moves exactly as in a step without it."""
    model = FAMILIES[family]()
    cache, tok = _prefilled(model, [6, 2, 9], seed=3)
    other = cache.clone()
    heads = torch.tensor([2, 0, 2])
    got = model.step(tok, cache, heads=heads)
    want = model.step(tok, other)
    assert got.shape == (3, want.shape[1]) and (got - want[heads]).abs().max() <= 1e-5
    assert torch.equal(cache.seqlens, other.seqlens)
    for b in range(3):
        for a, c in zip(_committed(cache, b), _committed(other, b)):
            assert torch.equal(a, c)
    assert model.step(tok, cache, heads=torch.tensor([], dtype=torch.long)).shape == (0, want.shape[1])


@pytest.mark.parametrize("heads, error, match", [
    (torch.tensor([0.0]), TypeError, "heads must be a 1-D int64 tensor"),
    (torch.tensor([[0]]), TypeError, "heads must be a 1-D int64 tensor"),
    ([0], TypeError, "heads must be a 1-D int64 tensor of row indices, got list"),
    (torch.tensor([0, 3]), ValueError, r"heads must index the 3 rows, got \[0, 3\]"),
    (torch.tensor([-1]), ValueError, "heads must index the 3 rows"),
])
def test_bad_heads_are_named_before_the_state_moves(heads, error, match):
    model = FAMILIES["mamba2"]()
    cache, tok = _prefilled(model, [6, 2, 9], seed=3)
    before = cache.clone()
    with pytest.raises(error, match=match):
        model.step(tok, cache, heads=heads)
    assert torch.equal(cache.ssm, before.ssm) and torch.equal(cache.seqlens, before.seqlens)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kernel_backend", ["torch", "triton"])
def test_unvalidated_step_and_tree_pass_never_wait_on_the_host(family, kernel_backend, backend_device):
    """The paths a device runs ("auto" on the CPU replays compiled, reading host memory by design).
    Without autograd, as decoding runs (where a gradient is wanted the CPU's norms and products
    are PyTorch's own, which round differently from those the decoding paths take)."""
    model = FAMILIES[family]().to(backend_device)
    with backend_device, torch.no_grad():  # the tensors built below: on the kernel's device
        model.kernel_backend = kernel_backend
        cache, tok = _prefilled(model, [5, 3], seed=2)
        reference = cache.clone()
        want = model.step(tok, reference)
        with pytest.raises(HostSync):  # the guard sees the checks a validated step makes
            with no_host_sync():
                model.step(tok, cache.clone())
        with no_host_sync():
            got = model.step(tok, cache, validate=False)
        assert torch.equal(got, want) and torch.equal(cache.seqlens, reference.seqlens)
        tree = TokenTree.from_shape(TreeShape.paper13(), torch.randint(0, VOCAB, (2, 13)))
        index = tree.index
        want, _ = model.forward_tree(tree, cache)
        path, num = torch.tensor([[0, 1, 4], [0, 2, 6]]), torch.tensor([3, 2])
        with no_host_sync():
            got, tree_pass = model.tree_pass(tree, index, cache, "tree", kernel_backend, 3)
            model.commit(cache, tree_pass, path, num, validate=False)
        assert torch.equal(got, want)
        assert cache.seqlens.tolist() == [9, 6]  # prefilled 5 and 3, one step, then 3 and 2 committed


@pytest.mark.parametrize("family", FAMILIES)
def test_unvalidated_step_still_checks_what_costs_no_sync(family):
    model = FAMILIES[family]()
    cache, tok = _prefilled(model, [4, 4], seed=3)
    with pytest.raises(TypeError, match="tokens must be an integer tensor"):
        model.step(tok.float(), cache, validate=False)
    with pytest.raises(ValueError, match=r"tokens must have shape \[batch\]"):
        model.step(tok[:, None], cache, validate=False)
    with pytest.raises(ValueError, match="the cache holds 2 rows but the input has batch 1"):
        model.step(tok[:1], cache, validate=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.step(torch.tensor([1, model.vocab_size]), cache)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_step_after_a_tree_pass_makes_its_commit_an_error(family):
    """The step moved the state on, so the tree pass no longer belongs to it."""
    model = FAMILIES[family]()
    cache, tok = _prefilled(model, [4, 4], seed=5)
    tree = TokenTree.from_shape(TreeShape.chain(2), torch.randint(0, VOCAB, (2, 3)))
    _, tree_pass = model.forward_tree(tree, cache)
    model.step(tok, cache)
    with pytest.raises(ValueError, match="tree_pass is stale"):
        model.commit(cache, tree_pass, torch.zeros(2, 1, dtype=torch.long), torch.ones(2, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_caches_numpy_views_are_its_states_memory(dtype):
    """What the CPU's bound kernels read and advance the states through (made once per cache, not
    converted on every call): the stacked states' and each layer's NumPy views are the tensors'
    memory, so a step through them moves the cache and a write to the cache shows in them; a half
    conv state (read through a float32 copy), a state that requires grad, or a new cache from
    ``select`` gets none of the old ones. A step through the views equals one whose states were
    converted on the call."""
    import numpy as np

    model = FAMILIES["mamba2"]().to(dtype)
    cache, roots = _prefilled(model, [5, 7], seed=3)
    conv, ssm = cache.arrays
    assert ssm is not None and np.shares_memory(ssm, cache.ssm.numpy())
    assert (conv is None) == (dtype != torch.float32)
    layer = cache.layers[1]
    assert layer.arrays is layer.arrays and np.shares_memory(layer.arrays[1], ssm)
    assert np.shares_memory(layer.arrays[1], layer.ssm.numpy()) and layer.arrays[1].shape == tuple(layer.ssm.shape)
    before = layer.ssm.clone()
    cache.ssm[1].add_(1.0)
    assert torch.equal(torch.from_numpy(layer.arrays[1]), before + 1.0)
    cache.ssm[1].sub_(1.0)
    twin = cache.clone()
    assert not np.shares_memory(twin.arrays[1], ssm) and not np.shares_memory(twin.layers[1].arrays[1], ssm)
    logits = model.step(roots, cache)
    assert not torch.equal(cache.layers[1].ssm, before)  # advanced in place through the views
    for state in twin.layers:
        if state is not None:
            state._arrays = (None, None)  # converted on the call instead
    assert torch.equal(model.step(roots, twin), logits)
    for t_new, t_old in zip((cache.conv, cache.ssm), (twin.conv, twin.ssm)):
        assert torch.equal(t_new, t_old)
    grad = type(layer)(layer.conv.float().requires_grad_(), layer.ssm.clone().requires_grad_())
    assert grad.arrays == (None, None)
