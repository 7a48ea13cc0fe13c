"""The decoding protocol, checked the same way for every model family: a tree pass equals
feeding each node's root path token by token, and commit leaves exactly the sequential state."""

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from host_sync import flag_kernel_launches
from strategies import parent_lists
from tiny_models import FAMILIES, VOCAB, layer_by_layer
from torch.utils._python_dispatch import TorchDispatchMode

from stree.models.layers.linear import measure
from stree.testing import root_path, sequential_logits
from stree.tree import TokenTree, TreeShape


def _prefilled(model, lengths, g):
    cache = model.allocate_cache(len(lengths), 48)
    ids = torch.randint(0, VOCAB, (len(lengths), max(lengths)), generator=g, device="cpu").to(model.device)
    model.prefill(ids, cache, lengths=torch.tensor(lengths, device=model.device), chunk=4)  # several chunks, rows ending apart
    assert cache.seqlens.tolist() == lengths
    return cache


def _state_tensors(cache):
    return [t for t in (cache.conv, cache.ssm, cache.k, cache.v) if t is not None]


def _committed_state(cache, row):
    """Row ``row``'s SSM states and its KV entries up to its length (slots past it are scratch)."""
    return [t[:, row] for t in (cache.conv, cache.ssm) if t is not None] + [
        t[:, row, : int(cache.seqlens[row])] for t in (cache.k, cache.v) if t is not None]


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=5)
@given(n=st.integers(1, 10), data=st.data(), per_row=st.booleans())
def test_forward_tree_equals_feeding_each_root_path(family, n, data, per_row):
    model = FAMILIES[family]()
    g = torch.Generator().manual_seed(n)
    cache = _prefilled(model, [6, 2, 9], g)
    rows = [data.draw(parent_lists(n)) for _ in range(3)] if per_row else [data.draw(parent_lists(n))] * 3
    tree = TokenTree(torch.tensor(rows) if per_row else torch.tensor(rows[0]),
                     torch.randint(0, VOCAB, (3, n), generator=g))
    before = [t.clone() for t in _state_tensors(cache)]
    logits, _ = model.forward_tree(tree, cache)
    assert all(torch.equal(a, b) for a, b in zip(before, _state_tensors(cache)))  # committed state untouched
    for b in range(3):
        for i in range(n):
            expected, _ = sequential_logits(model, cache, b, tree.tokens[b, root_path(rows[b], i)].tolist())
            assert (logits[b, i] - expected).abs().max() <= 1e-4, (b, i)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kernel_backend", ["auto", "triton"])
def test_commit_leaves_the_sequential_state(family, kernel_backend, backend_device):
    model = FAMILIES[family]().to(backend_device)
    model.kernel_backend = kernel_backend
    g = torch.Generator().manual_seed(5)
    draw = lambda *shape: torch.randint(0, VOCAB, shape, generator=g, device="cpu").to(backend_device)  # noqa: E731
    cache = _prefilled(model, [7, 3, 5], g)
    start = cache.clone()
    tree = TokenTree.from_shape(TreeShape.paper13(), draw(3, 13))
    _, tree_pass = model.forward_tree(tree, cache)
    paths = [[0, 2, 6], [0, 1, 4, 7, 12], [0]]
    model.commit(cache, tree_pass, torch.tensor([p + [0] * (5 - len(p)) for p in paths], device=backend_device),
                 torch.tensor([len(p) for p in paths], device=backend_device))
    assert cache.seqlens.tolist() == [10, 8, 6]
    tree2 = TokenTree.from_shape(TreeShape.full(2, 2), draw(3, 7))
    logits, _ = model.forward_tree(tree2, cache)
    model.kernel_backend = "auto"  # the sequential reference need not run under the interpreter
    for b in range(3):
        committed = tree.tokens[b, paths[b]].tolist()
        _, ref = sequential_logits(model, start, b, committed)
        for got, want in zip(_committed_state(cache, b), _committed_state(ref, 0)):
            # in_proj over many nodes vs one token rounds differently: close, not bitwise
            assert (got - want).abs().max() <= 1e-5
        for i in range(7):
            expected, _ = sequential_logits(model, start, b, committed + tree2.tokens[b, root_path(tree2.parents.tolist(), i)].tolist())
            assert (logits[b, i] - expected).abs().max() <= 1e-4, (b, i)


@pytest.mark.parametrize("family", FAMILIES)
def test_chain_and_unrolled_scans_agree_with_tree(family):
    model = FAMILIES[family]()
    g = torch.Generator().manual_seed(6)
    cache = _prefilled(model, [5, 8], g)
    shape = TreeShape.paper13()
    tree = TokenTree(torch.tensor([list(shape.parents), [-1, 0, 1, 1, 0, 4, 5, 2, 3, 3, 9, 6, 11]]),
                     torch.randint(0, VOCAB, (2, 13), generator=g))
    logits = lambda t, scan="tree": model.forward_tree(t, cache, scan=scan)[0]
    assert (logits(tree, "unrolled") - logits(tree)).abs().max() <= 1e-5
    chain = TokenTree.from_shape(TreeShape.chain(5), torch.randint(0, VOCAB, (2, 6), generator=g))
    assert (logits(chain, "chain") - logits(chain)).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="scan='chain' needs a chain tree"):
        model.forward_tree(tree, cache, scan="chain")


@pytest.mark.parametrize("family", FAMILIES)
def test_training_forward_equals_step_by_step_logits_and_has_gradients(family):
    """``model(ids)`` (training) gives at position t the logits of feeding ids[:t+1] one by one."""
    model = FAMILIES[family]()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(7))
    logits = model(ids)
    assert logits.requires_grad and logits.shape == (2, 9, model.vocab_size)
    cache = model.allocate_cache(2, 9)
    for t in range(9):
        assert (logits[:, t] - model.step(ids[:, t], cache)).abs().max() <= 1e-4, t
    logits.sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert [n for n, g in grads.items() if g is None or not bool(g.abs().sum() > 0)] == []
    with pytest.raises(ValueError, match="1 <= T <= 1024"):
        model(torch.zeros(1, 1025, dtype=torch.long))


class _LargestOutput(TorchDispatchMode):
    """Records the largest tensor any torch operation of the library produces (the Triton
    interpreter's own copies, inside a kernel launch, are not the library's)."""

    def __init__(self, launch):
        super().__init__()
        self.largest = 0
        self.launch = launch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not self.launch["active"]:
                self.largest = max(self.largest, t.numel())
        return out


# Sizes where one SSM state per node ([b, n, h, p, s]) outgrows every legitimate tensor of the pass.
WIDE_STATE = {"mamba2": dict(d_state=64), "hybrid": dict(d_inner=128, d_xb=64, d_state=32)}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kernel_backend", ["auto", "triton"])
def test_forward_tree_never_materialises_a_per_node_ssm_state(family, kernel_backend, backend_device):
    model = FAMILIES[family](**WIDE_STATE[family]).to(backend_device)
    model.kernel_backend = kernel_backend
    cache = model.allocate_cache(2, 20)
    model.prefill(torch.randint(0, VOCAB, (2, 4), device=backend_device), cache)
    shape = TreeShape.paper13()
    tree = TokenTree.from_shape(shape, torch.randint(0, VOCAB, (2, shape.n), device=backend_device))
    per_node_states = 2 * shape.n * cache.ssm[0, 0].numel()
    # the products' first-use timing (its cache-eviction buffer included) is setup, not the pass
    measure(model, [2 * shape.n])
    with flag_kernel_launches() as launch, _LargestOutput(launch) as seen:
        model.forward_tree(tree, cache)
    assert 0 < seen.largest < per_node_states / 2, (seen.largest, per_node_states)


def test_prefill_runs_the_head_on_each_rows_last_fed_token_only(monkeypatch):
    """The head is most of a small model's prefill: a chunk computes logits at one node per row (block
    by block; the one-call prefill's head is tests/models/test_fused_step.py's)."""
    layer_by_layer(monkeypatch)
    model = FAMILIES["mamba2"]()
    seen = []
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape)))
    cache = model.allocate_cache(2, 64)
    logits = model.prefill(torch.randint(0, model.vocab_size, (2, 40)), cache, lengths=torch.tensor([40, 17]),
                           chunk=16)
    assert seen == [(2, 32), (2, 32), (1, 32)]  # chunks 0-15 and 16-31 hold both rows, 32-39 row 0 alone
    assert logits.shape == (2, model.vocab_size)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prefill_gives_the_logits_after_every_token_on_request(family):
    """``every=True``: rows of 11 and 7 tokens in chunks of 4, the logits after each of a row's
    tokens are those of feeding it token by token, and the state is the plain prefill's."""
    model = FAMILIES[family]()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, 11), generator=g)
    lengths = [11, 7]
    plain = model.allocate_cache(2, 32)
    last = model.prefill(ids, plain, lengths=torch.tensor(lengths), chunk=4)
    cache = model.allocate_cache(2, 32)
    every = model.prefill(ids, cache, lengths=torch.tensor(lengths), chunk=4, every=True)
    assert every.shape == (2, 11, model.vocab_size) and cache.seqlens.tolist() == lengths
    for row, n in enumerate(lengths):
        stepped = model.allocate_cache(1, 32)
        for t in range(n):
            want = model.step(ids[row, t: t + 1], stepped)[0]
            assert torch.allclose(every[row, t], want, atol=1e-5), (row, t)
        assert torch.allclose(every[row, n - 1], last[row], atol=1e-5)
        for a, b in zip(_committed_state(cache, row), _committed_state(plain, row)):
            assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prefill_continues_from_what_the_cache_holds(family):
    """Rows of 9 and 6 tokens fed as 5 + 4 and 3 + 3 (the second call appends to the cache, as a
    drafter model catching up does): the logits after each row's last token and the state they
    leave are those of one prefill of the whole rows (the poisoned way: a prefill that restarted
    from an empty cache, or wrote at position 0, differs)."""
    model = FAMILIES[family]()
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (2, 9), generator=g)
    whole = model.allocate_cache(2, 32)
    want = model.prefill(ids, whole, lengths=torch.tensor([9, 6]))
    parts = model.allocate_cache(2, 32)
    model.prefill(ids[:, :5], parts, lengths=torch.tensor([5, 3]))
    rest = torch.stack([ids[0, 5:9], torch.cat([ids[1, 3:6], ids[1, :1]])])  # row 1 right-padded
    got = model.prefill(rest, parts, lengths=torch.tensor([4, 3]))
    assert parts.seqlens.tolist() == [9, 6]
    assert torch.allclose(got, want, atol=1e-5)
    for row in range(2):
        for a, b in zip(_committed_state(parts, row), _committed_state(whole, row)):
            assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("unbound", [None, 1])
def test_a_pass_writing_its_scratch_in_place_equals_one_stacking_it(family, unbound, monkeypatch):
    """On the CPU the bound Mamba2 layers write their replay scratch into the pass's stacked one
    (stree.models.layers.mamba2._slots) instead of each returning its own for a stack after them:
    the same tensors bit for bit, the same commit. ``unbound``: that SSM layer takes the public
    kernels and returns its own, copied in beside the others'. (Layer by layer: a float32 Mamba2
    model's draft pass as one call writes its scratch at once.)"""
    from stree.models.layers import mamba2 as m2

    layer_by_layer(monkeypatch)
    model = FAMILIES[family]()
    g = torch.Generator().manual_seed(3)
    cache = _prefilled(model, [5, 7], g)
    tree = TokenTree.from_shape(TreeShape.paper13(), torch.randint(0, VOCAB, (2, 13), generator=g))
    path, num = torch.tensor([[0, 1, 4], [0, 2, 0]]), torch.tensor([3, 2])
    mixers = [blk.mixer for blk, kind in zip(model.blocks, model.kinds()) if kind == "ssm"]
    if unbound is not None:
        real = m2.Mamba2Mixer.bound
        monkeypatch.setattr(m2.Mamba2Mixer, "bound",
                            lambda self, *a: None if self is mixers[unbound] else real(self, *a))
    runs, placed, real_slots = [], [], m2._slots
    monkeypatch.setattr(m2, "_slots", lambda *a: placed.append(a[1]) or real_slots(*a))
    for place in (True, False):
        if not place:
            monkeypatch.setattr(m2, "_slots", lambda *a: None)
        work = cache.clone()
        logits, tree_pass = model.forward_tree(tree, work)
        assert tree_pass.ssm.x.shape[0] == len(mixers)
        model.commit(work, tree_pass, path, num)
        runs.append((logits, tree_pass.ssm.parts(), _state_tensors(work)))
    assert placed == [k for k in range(len(mixers)) if k != unbound]  # (the bound layers, in order)
    (l1, s1, c1), (l2, s2, c2) = runs
    assert torch.equal(l1, l2)
    assert all(torch.equal(a, b) for a, b in zip(s1, s2)) and all(torch.equal(a, b) for a, b in zip(c1, c2))


@pytest.mark.parametrize("family", [f for f in FAMILIES if "ssm" in FAMILIES[f]().kinds()])
def test_a_commit_of_a_pass_that_returned_its_activations_replays_with_the_passs_own_parameters(family):
    """A pass whose Mamba2 layers returned their activations (the PyTorch path: compiled calls, a
    GPU) returns the layers' A and dt_bias as it computed them beside them, and the commit replays
    with those, reading no parameter (keying on the eight of the shipped target had cost a compiled
    tree iteration a sixth of a step): bit for bit the replay of the pass's scratch with the layers'
    parameters."""
    import stree.models.layers.mamba2 as layer_module
    from stree.kernels.cpu.bound import replay_in_place

    model = FAMILIES[family]()
    g = torch.Generator().manual_seed(4)
    cache = _prefilled(model, [6, 3], g)
    tree = TokenTree.from_shape(TreeShape.paper13(), torch.randint(0, VOCAB, (2, 13), generator=g))
    index, depth = model.check_tree(tree, cache, "tree", True)
    _, tree_pass = model.tree_pass(tree, index, cache, "tree", "torch", depth)
    mixers = [blk.mixer for blk, kind in zip(model.blocks, model.kinds()) if kind == "ssm"]
    A, dt_bias = torch.stack([m.A() for m in mixers]), torch.stack([m.dt_bias.float() for m in mixers])
    assert tree_pass.ssm.kernels is None
    assert torch.equal(tree_pass.ssm.A, A) and torch.equal(tree_pass.ssm.dt_bias, dt_bias)
    paths = torch.tensor([[0, 1, 4, 7], [0, 3, 0, 0]]), torch.tensor([4, 2])
    want = cache.clone()
    replay_in_place(want.ssm, want.conv, *tree_pass.ssm.parts(), A, dt_bias, *paths, mixers[0].dt_limit(False))
    with mock.patch.object(layer_module, "value_key", side_effect=AssertionError("a parameter read again")):
        model.commit(cache, tree_pass, *paths)
    assert torch.equal(cache.ssm, want.ssm) and torch.equal(cache.conv, want.conv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_commit_replays_with_the_parameters_and_arrays_of_the_passs_bound_kernels(dtype):
    """A CPU tree pass whose every Mamba2 layer ran its bound kernels leaves them and their NumPy
    scratch to its commit, which converts neither again (the op budgets): the new states are those
    of the replay on the pass's scratch tensors with the layers' parameters, bit for bit; and after
    a parameter changes in place, with its new value."""
    import stree.models.layers.mamba2 as layer_module
    from stree.kernels.cpu.bound import replay_in_place

    model = FAMILIES["mamba2"]().to(dtype)
    g = torch.Generator().manual_seed(2)
    cache = _prefilled(model, [7, 3], g)
    paths = torch.tensor([[0, 1, 4, 7], [0, 2, 0, 0]]), torch.tensor([4, 2])
    mixers = [blk.mixer for blk in model.blocks]
    for change in (False, True):
        if change:
            with torch.no_grad():
                mixers[0].A_log.add_(0.25)
                mixers[-1].dt_bias.sub_(0.5)
        tree = TokenTree.from_shape(TreeShape.paper13(), torch.randint(0, VOCAB, (2, 13), generator=g))
        _, tree_pass = model.forward_tree(tree, cache)
        assert len(tree_pass.ssm.kernels) == len(mixers) and None not in tree_pass.ssm.kernels
        want = cache.clone()
        replay_in_place(want.ssm, want.conv, *tree_pass.ssm.parts(), torch.stack([m.A() for m in mixers]),
                        torch.stack([m.dt_bias.float() for m in mixers]), *paths, mixers[0].dt_limit(False))
        with mock.patch.object(layer_module, "replay_in_place", side_effect=AssertionError("converted again")):
            model.commit(cache, tree_pass, *paths)
        assert cache.conv.dtype == dtype and torch.equal(cache.ssm, want.ssm) and torch.equal(cache.conv, want.conv)
