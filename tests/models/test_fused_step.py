"""A Mamba2 model's whole decoding step, and a draft's tree pass, as one call each
(stree.models.fused_step, stree.kernels.cpu.mamba_step): the logits and states of the
block-by-block step (its numba kernels and products), and the logits, replay scratch and committed
states of the layer-by-layer pass, within float32 rounding, for every layout they take and random
trees; parameters changed between steps read anew; bad tokens and rows refused with the cache
untouched; the block-by-block calls wherever they do not apply."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from avx2_build import use_avx2_build
from strategies import accepted_paths, trees
from tiny_models import VOCAB, assert_same_state, count_calls, hybrid, layer_by_layer, mamba2, with_biases

from stree.kernels.cpu import mamba_step
from stree.models.fused_step import fused_step
from stree.models.layers import linear
from stree.sampling.verify import verify_greedy_host
from stree.tools.opcount import count_ops
from stree.tree import TokenTree, TreeShape

pytestmark = pytest.mark.skipif(not mamba_step.available(), reason="no C++ compiler for the CPU library here")

LAYOUTS = {
    "groups": dict(),
    "one group, biases": dict(ngroups=1, bias=True),
    "no conv bias, gate last": dict(conv_bias=False, gate_norm="gate_last"),
    "clamped dt, three layers": dict(dt_limit=(0.01, 0.2), n_layer=3),
    "prefill-only clamp": dict(dt_limit=(0.01, 0.2), dt_limit_prefill_only=True),
}


@pytest.fixture
def ran(monkeypatch):
    """How many steps ran as one call (plain or greedy)."""
    return count_calls(monkeypatch, mamba_step.MambaStep, "_step")


_blockwise = layer_by_layer


def _prefilled(model, batch: int, seed: int = 1):
    cache = model.allocate_cache(batch, 96)
    model.prefill(torch.randint(0, VOCAB, (batch, 5), generator=torch.Generator().manual_seed(seed)), cache)
    return cache


def _steps(model, cache, count: int, seed: int, heads=None):
    gen = torch.Generator().manual_seed(seed)
    return [model.step(torch.randint(0, VOCAB, (cache.batch_size,), generator=gen), cache, heads=heads)
            for _ in range(count)]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_one_call_step_is_the_blockwise_step(layout, batch, ran, monkeypatch):
    model = with_biases(mamba2(**LAYOUTS[layout]))
    cache = _prefilled(model, batch)
    other = cache.clone()
    got = _steps(model, cache, 6, seed=2)
    assert ran[0] == 6
    _blockwise(monkeypatch)
    want = _steps(model, other, 6, seed=2)
    assert ran[0] == 6
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert_same_state(cache, other, tol=2e-5)


# d_state and the conv's taps across the step's paths: the state update's dot products in vectors where
# d_state is a multiple of theirs (16 floats with AVX-512, 8 with AVX2), lane by lane else; a window of
# 4 taps shifted by moves known when compiled, others by a loop
SIZES = {"d_state 32": dict(d_state=32), "d_state 24, 3 taps": dict(d_state=24, d_conv=3),
         "d_state 8, 2 taps": dict(d_conv=2)}


@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("sizes", SIZES)
def test_the_one_call_prefill_and_step_are_the_blockwise_ones_for_state_and_window_sizes(sizes, build, ran,
                                                                                            monkeypatch):
    """Each size through the one-call prefill and steps, built for this CPU and for AVX2 alone
    (``-march=haswell``, where this CPU runs it): the block-by-block prefill's and steps' logits and
    states."""
    if build == "avx2":
        use_avx2_build(monkeypatch)
    model = with_biases(mamba2(**SIZES[sizes]))
    prompt = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(4))
    cache = model.allocate_cache(2, 96)
    got = [model.prefill(prompt, cache)] + _steps(model, cache, 5, seed=5)
    assert ran[0] == 5
    _blockwise(monkeypatch)
    other = model.allocate_cache(2, 96)
    want = [model.prefill(prompt, other)] + _steps(model, other, 5, seed=5)
    assert ran[0] == 5
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    assert_same_state(cache, other, tol=2e-5)


def _pass_and_commit(model, cache, tree, accepted, num):
    logits, tree_pass = model.forward_tree(tree, cache)
    scratch = [t.clone() for t in tree_pass.ssm.parts()]
    model.commit(cache, tree_pass, accepted, num)
    return logits, scratch


MODELS = {layout: with_biases(mamba2(**kw)) for layout, kw in LAYOUTS.items()}


@settings(max_examples=40, deadline=None)
@given(data=st.data(), layout=st.sampled_from(sorted(LAYOUTS)))
def test_the_one_call_tree_pass_is_the_layer_by_layer_pass(data, layout):
    """Random trees (shared or a row's own, chains, stars, bushy), each row's path committed."""
    parents, batch = data.draw(trees(max_n=24))
    model, ran = MODELS[layout], [0]
    n = parents.shape[-1]
    tokens = torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(n))
    tree = TokenTree(parents, tokens)
    accepted, num = data.draw(accepted_paths(parents, batch))
    accepted = accepted[:, : int(num.max())]  # (the strategy's junk columns: a model's commit takes none)
    cache = _prefilled(model, batch)
    other = cache.clone()
    real = mamba_step.MambaStep.tree

    def counted(self, *a):
        ran[0] += 1
        return real(self, *a)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(mamba_step.MambaStep, "tree", counted)
        got = _pass_and_commit(model, cache, tree, accepted, num)
        _blockwise(m)
        want = _pass_and_commit(model, other, tree, accepted, num)
    assert ran[0] == 1
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=2e-5)
    for a, b in zip(got[1], want[1]):  # (xBC, x, dt, B: what replay reads)
        torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6)
    assert_same_state(cache, other, tol=2e-5)


def _greedy_draft(model, cache, parents, batch, data):
    """Random trees whose tokens mostly follow the model's own choices (paths that go deep, and
    siblings holding the same token), some nodes invalid, the root's token the row's."""
    n = parents.shape[-1]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    tokens = torch.randint(0, VOCAB, (batch, n), generator=gen)
    choice = model.forward_tree(TokenTree(parents, tokens), cache.clone())[0].argmax(-1)
    up = parents.expand(batch, n).clamp(min=0)
    follow = torch.rand(batch, n, generator=gen) < data.draw(st.sampled_from([0.0, 0.6, 1.0]))
    tokens = torch.where(follow, choice.gather(1, up), tokens)  # (a child of a followed parent: its choice)
    valid = torch.rand(batch, n, generator=gen) < data.draw(st.sampled_from([0.7, 1.0]))
    valid[:, 0] = True
    return TokenTree(parents, tokens, valid=valid)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), layout=st.sampled_from(sorted(LAYOUTS)))
def test_the_one_call_greedy_iteration_is_the_pass_verification_and_commit(data, layout):
    """Pass, greedy verification and replay in one call (greedy_tree): the pass's logits at the
    paths' nodes, the compiled verification's path, count, bonus, emitted tokens and flags exactly
    (every logit here finite), the states of the
    numba replay's commit within float32 rounding (numba takes dt's softplus in float32, the one
    call in double, as the C++ step), and with ``top_k`` the softmax's top entries at the path's
    nodes and the emitted tokens' own probabilities within float32 rounding."""
    parents, batch = data.draw(trees(max_n=24))
    model = MODELS[layout]
    cache = _prefilled(model, batch)
    tree = _greedy_draft(model, cache, parents, batch, data)
    other = cache.clone()
    top_k = data.draw(st.sampled_from([None, 1, 3, 10, VOCAB + 5]))
    got = model.greedy_tree(tree, cache, top_k=top_k)
    logits, tree_pass = model.forward_tree(tree, other)
    result, emitted, finite = verify_greedy_host(tree, logits)
    model.commit(other, tree_pass, result.accepted, result.num_accepted)
    assert torch.equal(_on_paths(got[0], *got[1:3]), _on_paths(logits, result.accepted, result.num_accepted))
    for a, b in zip(got[1:6], (result.accepted, result.num_accepted, result.bonus, emitted, finite)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert torch.equal(cache.seqlens, other.seqlens) and cache.version > 0
    assert_same_state(cache, other, tol=2e-5)
    assert (got[6] is None) == (top_k is None)
    if top_k is not None:  # the softmax's top entries at each path node, the emitted tokens' own, 0 past the path
        ids, probs, own = got[6]
        k = min(top_k, model.vocab_size)
        assert ids.shape == probs.shape == (batch, emitted.shape[1], k) and own.shape == emitted.shape
        law = torch.softmax(logits, -1)
        real = torch.arange(emitted.shape[1]) < result.num_accepted[:, None]
        at = law[torch.arange(batch)[:, None], result.accepted]  # [b, L, V]
        torch.testing.assert_close(probs[real], at.topk(k, -1).values[real], rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(at.gather(-1, ids)[real], probs[real], rtol=1e-5, atol=1e-9)  # (their ids)
        torch.testing.assert_close(own[real], at.gather(-1, emitted[..., None])[..., 0][real], rtol=1e-5, atol=1e-9)
        assert not ids[~real].any() and not probs[~real].any() and not own[~real].any()


def _on_paths(logits, accepted, num):
    """The logits ``[b, n, V]`` at each row's path nodes (``accepted [b, L]``, the first ``num [b]``
    of each row's), in order, the rows' paths back to back."""
    real = torch.arange(accepted.shape[1]) < num[:, None]
    rows = torch.arange(len(logits))[:, None].expand_as(accepted)
    return logits[rows[real], accepted[real]]


def _branching_draft(model, cache, follow: list[list[int]]):
    """A full tree of three children a node, three levels deep, whose row r at depth d holds the
    model's choice at its parent in child ``follow[r][d]`` (the others other tokens): the walk takes
    that child at every level."""
    shape, batch = TreeShape.full(3, 3), len(follow)  # (node i's children: 3i+1 .. 3i+3)
    tokens = torch.randint(0, VOCAB, (batch, shape.n), generator=torch.Generator().manual_seed(3))
    for d, level in enumerate(((0,), range(1, 4), range(4, 13))):  # (a node's logits read its ancestors' tokens)
        choice = model.forward_tree(TokenTree.from_shape(shape, tokens), cache.clone())[0].argmax(-1)
        for r in range(batch):
            for p in level:
                want = int(choice[r, p])
                for j in range(3):
                    tokens[r, 3 * p + 1 + j] = want if j == follow[r][d] else (want + 1 + j) % VOCAB
    return TokenTree.from_shape(shape, tokens)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_greedy_iteration_whose_walks_leave_the_first_children_makes_their_logits_as_it_goes(layout):
    """The one call makes the head's rows a wave at a time (the chain of first children from where
    each walk waits, mamba_step.cpp's waves): walks that take a second or third child at every level
    (a wave each), beside one that keeps to the first children, verify, commit and give the path
    nodes' logits exactly as the whole pass and the host's verification."""
    model, follow = MODELS[layout], [[1, 1, 1], [0, 0, 0], [2, 0, 1]]
    cache = _prefilled(model, len(follow))
    tree = _branching_draft(model, cache, follow)
    other = cache.clone()
    got = model.greedy_tree(tree, cache)
    logits, tree_pass = model.forward_tree(tree, other)
    result, emitted, finite = verify_greedy_host(tree, logits)
    model.commit(other, tree_pass, result.accepted, result.num_accepted)
    paths = [[0, 2, 8, 26], [0, 1, 4, 13], [0, 3, 10, 32]]  # (children 1+3i..3+3i of node i)
    assert got[1].tolist() == result.accepted.tolist() == paths and got[2].tolist() == [4, 4, 4]
    for a, b in zip(got[2:6], (result.num_accepted, result.bonus, emitted, finite)):
        assert torch.equal(a, b)
    assert torch.equal(_on_paths(got[0], *got[1:3]), _on_paths(logits, result.accepted, result.num_accepted))
    assert_same_state(cache, other, tol=2e-5)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("sizes", [None, (16, 9, 1)])
def test_a_long_paths_replay_split_over_threads_commits_as_on_one_thread(layout, sizes):
    """A greedy iteration replays each (layer, row) of a long accepted path on a thread of its own
    (mamba_step.cpp, REPLAY_SPLIT): the paths and the states exactly as replayed on one thread, the rows
    of a packed draft (each at its own offset in the pass's scratch) too, and the states within float32
    rounding of the block-by-block pass's numba replay (the reference; the suite's workers run one thread
    each, so the split is compared with it here). Chains whose tokens are the model's own choices, so that
    every node is accepted."""
    model, batch, n = MODELS[layout], 3, 16
    cache = _prefilled(model, batch)
    parents = TreeShape.chain(n - 1).parents_tensor().expand(batch, n)
    tokens = torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(0))
    for j in range(1, n):  # (each node the choice after its parent: the whole chain accepted)
        tokens[:, j] = model.forward_tree(TokenTree(parents, tokens), cache.clone())[0][:, j - 1].argmax(-1)
    valid = torch.ones(batch, n, dtype=torch.bool)
    if sizes is not None:
        valid &= torch.arange(n)[None] < torch.tensor(sizes)[:, None]
    tree = TokenTree(parents, tokens, valid=valid, row_sizes=sizes)
    other, reference, threads = cache.clone(), cache.clone(), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = model.greedy_tree(tree, other)
        torch.set_num_threads(2)
        got = model.greedy_tree(tree, cache)
    finally:
        torch.set_num_threads(threads)
    assert got[2].tolist() == list(sizes or [n] * batch)  # (every node of each row's chain accepted)
    for a, b in zip(got[1:6], want[1:6]):
        assert torch.equal(a, b)
    for r, size in enumerate(sizes or [n] * batch):  # (past a packed row's size its logits are not made)
        assert torch.equal(got[0][r, :size], want[0][r, :size])
    assert_same_state(cache, other, tol=0)
    assert not torch.equal(cache.ssm, _prefilled(model, batch).ssm)  # (the replay moved them)
    padded = TokenTree(parents, tokens, valid=valid)  # (the reference scores every node; the rest are invalid)
    logits, tree_pass = model.forward_tree(padded, reference)
    result = verify_greedy_host(padded, logits)[0]
    model.commit(reference, tree_pass, result.accepted, result.num_accepted)
    assert torch.equal(result.num_accepted, got[2])
    assert_same_state(cache, reference, tol=2e-5)


@pytest.mark.parametrize("seed", range(4))
def test_a_greedy_iteration_takes_the_first_of_equal_largest_logits(seed):
    """Logits with many equal largest entries at every node (the final norm keeps one channel, the
    head's column there holds a few values): the one call's walk takes the first of them, as
    torch's argmax in the host verification, across a vocabulary that is no multiple of the lanes."""
    model = mamba2(tie_embeddings=False, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.final_norm.weight.zero_()
        model.final_norm.weight[seed % 3] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[:, seed % 3] = torch.randint(0, 3, (model.lm_head.weight.shape[0],), generator=gen).float()
    cache = _prefilled(model, 2, seed)
    shape = TreeShape.chain(5)
    tokens = torch.randint(0, VOCAB, (2, shape.n), generator=gen)
    for depth in range(shape.n - 1):  # (each node's child the model's choice there: the walk runs the chain)
        choice = model.forward_tree(TokenTree.from_shape(shape, tokens), cache.clone())[0].argmax(-1)
        tokens[:, depth + 1] = choice[:, depth]
    tree = TokenTree.from_shape(shape, tokens)
    logits = model.forward_tree(tree, cache.clone())[0]
    assert (logits == logits.max(-1, keepdim=True).values).sum(-1).min() > 1  # (ties at every node)
    got = model.greedy_tree(tree, cache.clone())
    result, emitted, finite = verify_greedy_host(tree, logits)
    assert got[2].tolist() == result.num_accepted.tolist() == [shape.n, shape.n]
    assert torch.equal(got[4], emitted) and torch.equal(got[3], result.bonus) and finite.all()


def test_a_greedy_iteration_flags_a_row_whose_walk_reads_nan_logits_and_not_one_whose_nan_it_never_reads():
    """Where the walk reads NaN logits (row 0: its root's) the row is flagged; NaN logits at nodes no
    walk reads (row 1: past a draft the root's choice turns down) are never made, the row's path and
    bonus those of the host's verification of the whole pass (which flags every row: its check reads
    every node), as plain decoding, which never feeds that token, decodes."""
    model = mamba2(tie_embeddings=False)
    with torch.no_grad():
        model.embed.weight[7] = float("nan")  # (a node holding token 7 and its descendants: NaN logits)
    cache = model.allocate_cache(2, 96)
    model.prefill(torch.tensor([[1, 2, 3, 4, 5]] * 2), cache)
    choice = int(model.forward_tree(TokenTree.from_shape(TreeShape.chain(0), torch.tensor([[1]])),
                                    cache.select(torch.tensor([1])))[0][0, 0].argmax())
    declined = next(t for t in range(VOCAB) if t not in (choice, 7))
    tree = TokenTree.from_shape(TreeShape.chain(3), torch.tensor([[7, 1, 2, 3], [1, declined, 7, 4]]))
    got = model.greedy_tree(tree, cache.clone())
    result, _, finite = verify_greedy_host(tree, model.forward_tree(tree, cache.clone())[0])
    assert got[5].tolist() == [False, True] and finite.tolist() == [False, False]
    assert got[2].tolist() == result.num_accepted.tolist() == [1, 1]
    assert got[3][1] == result.bonus[1] == choice
    assert got[0][0, 0].isnan().any() and not got[0][1, 0].isnan().any()


def test_a_greedy_iteration_with_a_bad_token_moves_nothing_and_big_trees_take_none():
    model = mamba2()
    cache = _prefilled(model, 2)
    before = cache.clone()
    bad = TokenTree.from_shape(TreeShape.chain(3), torch.tensor([[1, 2, 3, 4], [1, 2, model.vocab_size, 4]]))
    with pytest.raises(ValueError, match="row 1, node 2"):
        model.greedy_tree(bad, cache, validate=False)
    valid = torch.tensor([[True] * 4, [True] * 3 + [False]])
    packed = TokenTree.from_shape(TreeShape.chain(3), bad.tokens, valid=valid, row_sizes=(4, 3))  # (the bad one within)
    with pytest.raises(ValueError, match="row 1, node 2"):
        model.greedy_tree(packed, cache, validate=False)
    assert torch.equal(cache.seqlens, before.seqlens)
    assert_same_state(cache, before, tol=0)
    big = TokenTree.from_shape(TreeShape.chain(64), torch.randint(0, VOCAB, (2, 65)))
    assert model.greedy_tree(big, cache) is None
    assert_same_state(cache, before, tol=0)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), layout=st.sampled_from(sorted(LAYOUTS)))
def test_a_packed_greedy_iteration_scores_each_rows_own_prefix_alone(data, layout):
    """A draft with ``row_sizes`` (each row its own prefix, the rest invalid) in the one call: the
    same paths, counts, bonus, emitted tokens, flags, laws and states, exactly, as the padded draft
    with those nodes invalid, and the same logits at the paths' nodes; the nodes past a row's
    size are not computed: a bad token or a NaN embedding there is neither refused nor flagged."""
    parents, batch = data.draw(trees(max_n=24, batch=data.draw(st.integers(2, 3))))
    model = MODELS[layout]
    cache = _prefilled(model, batch)
    n = parents.shape[-1]
    tree = _greedy_draft(model, cache, parents, batch, data)
    sizes = [data.draw(st.integers(1, n)) for _ in range(batch)]
    sizes[data.draw(st.integers(0, batch - 1))] = n  # (the largest is the tree's)
    keep = tree.valid & (torch.arange(n)[None] < torch.tensor(sizes)[:, None])
    tokens = tree.tokens.clone()
    if min(sizes) < n:  # past the smallest row's size: a token outside the vocabulary, never read
        tokens[sizes.index(min(sizes)), min(sizes):] = model.vocab_size
    packed = TokenTree(parents, tokens, valid=keep, row_sizes=tuple(sizes))
    padded = TokenTree(parents, tree.tokens, valid=keep)
    top_k = data.draw(st.sampled_from([None, 3]))
    other = cache.clone()
    got = model.greedy_tree(packed, cache, validate=False, top_k=top_k)  # (the one call's own token check alone)
    want = model.greedy_tree(padded, other, top_k=top_k)
    for a, b in zip(got[1:6], want[1:6]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert (got[6] is None) == (top_k is None) and (top_k is None or all(map(torch.equal, got[6], want[6])))
    assert torch.equal(_on_paths(got[0], *got[1:3]), _on_paths(want[0], *want[1:3]))
    assert torch.equal(cache.seqlens, other.seqlens)
    assert_same_state(cache, other, tol=0)


def test_a_greedy_iteration_flags_no_row_for_nan_past_its_size_or_at_invalid_nodes():
    """Packed, the nodes past a row's size are not computed; padded, invalid ones are, but no walk
    reads them (the head is never made there): neither flags the row."""
    model = mamba2(tie_embeddings=False)
    with torch.no_grad():
        model.embed.weight[7] = float("nan")
    cache = model.allocate_cache(2, 96)
    model.prefill(torch.tensor([[1, 2, 3, 4, 5]] * 2), cache)
    tokens = torch.tensor([[1, 2, 3, 4], [1, 2, 7, 4]])
    valid = torch.tensor([[True] * 4, [True, True, False, False]])
    packed = TokenTree.from_shape(TreeShape.chain(3), tokens, valid=valid, row_sizes=(4, 2))
    padded = TokenTree.from_shape(TreeShape.chain(3), tokens, valid=valid)
    assert model.greedy_tree(packed, cache.clone())[5].tolist() == [True, True]
    assert model.greedy_tree(padded, cache.clone())[5].tolist() == [True, True]


# (270: unclamped, its 2^n would wrap into an exponent of 2^122, a SiLU of about 0 instead of 270)
@pytest.mark.parametrize("value", [float("nan"), -1e4, 270.0, 1e4])
def test_a_conv_channel_far_out_or_nan_gives_the_blockwise_logits(value, monkeypatch):
    """The SiLUs' exp (a polynomial, its input held to [-87, 88]) at a channel whose conv output is
    NaN or far past that range: SiLU's limits (0, or the input itself) as the blockwise kernels
    give them, and a NaN carried to every logit the channel reaches, where decoding's finiteness
    check reads it, in a step and in a tree pass alike."""
    model = mamba2(**LAYOUTS["one group, biases"])
    with torch.no_grad():
        model.blocks[0].mixer.conv1d.bias[3] = value  # (an x channel of head 0)
    tree = TokenTree.from_shape(TreeShape.full(2, 2), torch.randint(0, VOCAB, (2, 7)))
    cache = _prefilled(model, 2)
    other = cache.clone()
    got = model.step(torch.tensor([3, 4]), cache.clone()), model.forward_tree(tree, cache)[0]
    _blockwise(monkeypatch)
    want = model.step(torch.tensor([3, 4]), other.clone()), model.forward_tree(tree, other)[0]
    for a, b in zip(got, want):
        assert torch.equal(a.isnan(), b.isnan())
        assert a.isnan().any() == (value != value)
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5, equal_nan=True)


def test_rows_with_enough_work_run_in_parallel_with_the_same_results(monkeypatch):
    """A batch whose scan visits a million elements splits its rows over the threads (each row's
    work in its own memory)."""
    model = with_biases(mamba2(d_model=128, d_state=64, headdim=32, ngroups=1))
    tree = TokenTree.from_shape(TreeShape.full(2, 4), torch.randint(0, VOCAB, (4, 31)))  # (4 x 31 x 256 x 64 > 2**20)
    path, num = torch.tensor([[0, 1, 3, 7, 15]] * 4), torch.tensor([5, 3, 1, 4])
    cache = _prefilled(model, 4)
    other = cache.clone()
    torch.set_num_threads(2)
    got = _pass_and_commit(model, cache, tree, path, num)
    _blockwise(monkeypatch)
    want = _pass_and_commit(model, other, tree, path, num)
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=2e-5)
    assert_same_state(cache, other, tol=2e-5)


def test_a_tree_with_a_bad_token_is_refused_and_big_or_prompt_passes_go_layer_by_layer(ran):
    model = mamba2()
    cache = _prefilled(model, 2)
    bad = TokenTree.from_shape(TreeShape.chain(3), torch.tensor([[1, 2, 3, 4], [1, 2, model.vocab_size, 4]]))
    with pytest.raises(ValueError, match="row 1, node 2"):
        model.forward_tree(bad, cache, validate=False)
    calls = []
    real = mamba_step.MambaStep.tree
    with pytest.MonkeyPatch.context() as m:
        m.setattr(mamba_step.MambaStep, "tree", lambda self, *a: calls.append(1) or real(self, *a))
        model.forward_tree(TokenTree.from_shape(TreeShape.chain(64), torch.randint(0, VOCAB, (2, 65))), cache)
        model.prefill(torch.randint(0, VOCAB, (2, 9)), cache)
        model.forward_tree(TokenTree.from_shape(TreeShape.chain(3), torch.randint(0, VOCAB, (2, 4))), cache,
                           scan="chain")
        assert not calls
        model.forward_tree(TokenTree.from_shape(TreeShape.chain(3), torch.randint(0, VOCAB, (2, 4))), cache)
        assert calls == [1]


def test_heads_make_those_rows_logits_alone(ran, monkeypatch):
    model = mamba2()
    cache = _prefilled(model, 3)
    other = cache.clone()
    for heads in (torch.tensor([2, 0]), torch.tensor([1, 1, 1]), torch.zeros(0, dtype=torch.long)):
        got = _steps(model, cache, 2, seed=3, heads=heads)
        with monkeypatch.context() as m:
            _blockwise(m)
            want = _steps(model, other, 2, seed=3, heads=heads)
        for a, b in zip(got, want):
            assert a.shape == (len(heads), model.vocab_size)
            torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
        assert_same_state(cache, other, tol=2e-5)
    assert ran[0] == 6


def test_parameters_changed_between_steps_are_read_anew(ran, monkeypatch):
    model = mamba2()
    cache = _prefilled(model, 2)
    _steps(model, cache, 1, seed=4)
    mixer = model.blocks[1].mixer
    with torch.no_grad():
        mixer.in_proj.weight.mul_(1.1)  # (in place: a new version)
        mixer.dt_bias.add_(0.3)
        model.final_norm.weight.data = model.final_norm.weight.data * 1.2  # (new memory)
    model.blocks[0].norm.weight = torch.nn.Parameter(model.blocks[0].norm.weight.detach() * 0.9)  # (a new object)
    other = cache.clone()
    got = _steps(model, cache, 2, seed=5)
    _blockwise(monkeypatch)
    want = _steps(model, other, 2, seed=5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    assert ran[0] == 3


def test_bad_tokens_and_rows_are_refused_before_anything_moves():
    model = mamba2()
    cache = _prefilled(model, 2)
    before = cache.clone()
    for tokens in (torch.tensor([3, model.vocab_size]), torch.tensor([-1, 3])):
        with pytest.raises(ValueError, match="tokens"):
            model.step(tokens, cache, validate=False)
    with pytest.raises(ValueError, match="heads"):
        model.step(torch.tensor([3, 4]), cache, validate=False, heads=torch.tensor([0, 2]))
    assert torch.equal(cache.conv, before.conv) and torch.equal(cache.ssm, before.ssm)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_greedy_step_is_the_step_and_its_argmax(layout, ran):
    """The one call's choices: torch's argmax of the step's own logits (ties: the head's column of
    few values, the first of equal maxima), the same states and lengths, every row flagged finite
    but the one whose logits are NaN, and nothing moved where a token is out of range."""
    model = with_biases(mamba2(tie_embeddings=False, **LAYOUTS[layout]))
    with torch.no_grad():
        model.lm_head.weight[:, 0] = torch.randint(0, 3, (model.lm_head.weight.shape[0],),
                                                   generator=torch.Generator().manual_seed(2)).float()
        model.lm_head.weight[:, 1:] = 0.0
        model.embed.weight[9] = float("nan")
    cache = _prefilled(model, 3)
    twin = cache.clone()
    gen = torch.Generator().manual_seed(7)
    for step in range(6):
        tokens = torch.randint(10, VOCAB, (3,), generator=gen)
        if step == 3:
            tokens[1] = 9
        logits, choice, counts, finite, laws = model.greedy_step(tokens, cache)
        want = model.step(tokens, twin)
        torch.testing.assert_close(logits, want, rtol=0, atol=0, equal_nan=True)
        assert choice.shape == (3, 1) and counts.tolist() == [1, 1, 1] and laws is None
        assert choice[:, 0].tolist() == [0 if v.isnan().any() else int(v.argmax()) for v in want]
        assert finite.tolist() == [bool(torch.isfinite(v).all()) for v in want] == [True, step < 3, True]  # (NaN from then on)
        assert torch.equal(cache.seqlens, twin.seqlens)
        assert_same_state(cache, twin, tol=0) if step < 3 else None
    before = cache.clone()
    with pytest.raises(ValueError, match="tokens"):
        model.greedy_step(torch.tensor([3, model.vocab_size, 4]), cache, validate=False)
    assert torch.equal(cache.seqlens, before.seqlens) and torch.equal(cache.ssm.nan_to_num(), before.ssm.nan_to_num())
    assert ran[0] == 13


@settings(max_examples=30, deadline=None)
@given(data=st.data(), layout=st.sampled_from(sorted(LAYOUTS)))
def test_a_greedy_steps_laws_are_the_softmaxs_top_entries_at_its_choices(data, layout):
    """With ``top_k``, the greedy step's one call also hands over the law a drafter learns from at each
    row's choice: the softmax's ``top_k`` (cut to the vocabulary) largest probabilities of the step's own
    logits, most likely first, their ids, and the choice's own probability, within float32 rounding
    (the exp a polynomial's), on one thread or split over two (rows apart), written over whatever the
    kept outputs held; the choices, flags and states as without laws."""
    model = MODELS[layout]
    batch = data.draw(st.integers(1, 4))
    top_k = data.draw(st.sampled_from([1, 3, 10, VOCAB + 5]))
    threads = data.draw(st.sampled_from([1, 2]))
    cache = _prefilled(model, batch, seed=data.draw(st.integers(0, 99)))
    twin = cache.clone()
    with torch.no_grad():
        one = fused_step(model, cache, None, "auto").reused()
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(2):  # (the second call writes over the first's kept outputs, poisoned in between)
            tokens = torch.randint(0, VOCAB, (batch,), generator=gen)
            logits, choice, counts, finite, laws = model.greedy_step(tokens, cache, one_call=one, top_k=top_k)
            plain = model.greedy_step(tokens, twin, top_k=None)
            assert torch.equal(logits, plain[0]) and torch.equal(choice, plain[1]) and torch.equal(finite, plain[3])
            assert plain[4] is None
            ids, probs, own = laws
            k = min(top_k, model.vocab_size)
            assert ids.shape == probs.shape == (batch, 1, k) and own.shape == (batch, 1)
            law = torch.softmax(logits, -1)
            torch.testing.assert_close(probs[:, 0], law.topk(k, -1).values, rtol=1e-5, atol=1e-9)
            torch.testing.assert_close(law.gather(-1, ids[:, 0]), probs[:, 0], rtol=1e-5, atol=1e-9)  # (their ids)
            assert all(len(set(row)) == k for row in ids[:, 0].tolist())
            torch.testing.assert_close(own, law.gather(-1, choice), rtol=1e-5, atol=1e-9)
            ids.fill_(-1), probs.fill_(float("nan")), own.fill_(float("nan"))
    finally:
        torch.set_num_threads(before)
    assert_same_state(cache, twin, tol=0) and torch.equal(cache.seqlens, twin.seqlens)


def test_a_greedy_step_is_none_where_the_step_goes_block_by_block():
    model = mamba2(proj_scales=(1.0, 0.5, 1.0, 1.0, 2.0))
    cache = _prefilled(model, 2)
    before = cache.clone()
    assert model.greedy_step(torch.tensor([3, 4]), cache) is None
    assert torch.equal(cache.seqlens, before.seqlens) and torch.equal(cache.ssm, before.ssm)


def test_a_step_is_one_call_and_one_output(monkeypatch):
    """Its PyTorch ops: the logits' allocation and the lengths' increment (block by block, 98)."""
    model = mamba2(n_layer=4)
    cache = _prefilled(model, 2)
    tokens = torch.tensor([3, 4])
    ops = count_ops(lambda: model.step(tokens, cache, validate=False))
    assert ops.compute == 1 and ops.total == 2, ops.by_name
    _blockwise(monkeypatch)
    assert count_ops(lambda: model.step(tokens, cache, validate=False)).total > 40


def test_where_it_does_not_apply_the_step_goes_block_by_block(ran, monkeypatch):
    model = mamba2()
    tokens = torch.tensor([3, 4])
    cache = _prefilled(model, 2)
    with torch.enable_grad():
        assert fused_step(model, cache, tokens, "auto") is None
    with torch.no_grad():
        assert fused_step(model, cache, tokens, "auto") is not None
        assert fused_step(model, cache, tokens, "triton") is None
        assert fused_step(model, cache, tokens.to(torch.int32), "auto") is None
        assert fused_step(model, cache, torch.tensor([[3, 0], [4, 0]])[:, 0], "auto") is not None  # (a column)
        strided = model.allocate_cache(4, 64)
        strided.conv = strided.conv[:, ::2]
        assert fused_step(model, strided, tokens, "auto") is None
        mil = hybrid()
        assert mil.fused_step(_prefilled(mil, 2), tokens, "auto") is None  # (attention layers: not a Mamba2LM)
        falcon_like = mamba2(proj_scales=(1.0, 0.5, 1.0, 1.0, 2.0))
        assert fused_step(falcon_like, _prefilled(falcon_like, 2), tokens, "auto") is None
        monkeypatch.setattr(linear, "PATH", "blas")  # (the products pinned to another path)
        assert fused_step(model, cache, tokens, "auto") is None
    assert ran[0] == 0


def test_compiled_decoding_takes_both_one_call_paths_and_compiles_nothing(ran):
    """torch_compile=True on a float32 Mamba2 model: its steps and greedy iterations (pass,
    verification and commit) are the one-call ones (faster than Inductor's graphs of them), the
    tokens those of eager decoding, no graph compiled."""
    from torch._dynamo.utils import counters

    from stree.decoding.loop import generate
    from stree.drafters.registry import make_drafter

    model = mamba2(seed=3)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 4, 5]]
    kw = dict(tree=TreeShape.chain(3), max_new_tokens=16)
    want = generate(model, prompts, drafter=make_drafter("ngram", vocab_size=model.vocab_size), **kw)
    iterations = []
    real = mamba_step.MambaStep.tree_greedy
    with pytest.MonkeyPatch.context() as m:
        m.setattr(mamba_step.MambaStep, "tree_greedy", lambda self, *a: iterations.append(1) or real(self, *a))
        graphs, steps = counters["stats"]["unique_graphs"], ran[0]
        got = generate(model, prompts, torch_compile=True, drafter=make_drafter("ngram", vocab_size=model.vocab_size),
                       **kw)
    assert got.sequences == want.sequences
    assert len(iterations) == sum(c for n, c in got.stats.trees.items() if n > 1) > 0
    assert ran[0] > steps and counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("torch_compile", [False, True], ids=["eager", "compiled"])
def test_parameters_changed_between_decoding_calls_are_read_anew(torch_compile):
    """A decoding call looks the one call up once, as it begins (its runner; a compiled call's pool
    outlives calls): parameters changed in place between two calls decode in the second as a fresh
    model of those parameters decodes, eager or compiled, greedy steps and greedy trees alike."""
    from stree.decoding.loop import generate

    model, fresh = mamba2(seed=5), mamba2(seed=5)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 4, 5]]
    for method, kw in (("autoregressive", {}), ("stree", dict(tree=TreeShape.chain(3)))):
        before = generate(model, prompts, method=method, max_new_tokens=12, torch_compile=torch_compile, **kw)
        with torch.no_grad():
            for m in (model, fresh):
                m.blocks[1].mixer.in_proj.weight.mul_(1.5)
                m.final_norm.weight.neg_()  # (the logits negated: other tokens)
        after = generate(model, prompts, method=method, max_new_tokens=12, torch_compile=torch_compile, **kw)
        want = generate(fresh, prompts, method=method, max_new_tokens=12, torch_compile=torch_compile, **kw)
        assert after.sequences == want.sequences != before.sequences, method


@settings(max_examples=25, deadline=None)
@given(data=st.data(), layout=st.sampled_from(sorted(LAYOUTS)), batch=st.integers(1, 3))
def test_the_one_call_prefill_is_its_tokens_stepped_one_by_one(data, layout, batch):
    """Rows of different lengths (past a block of 64 tokens): the one call leaves exactly the states,
    and gives exactly the logits after each row's last token, of the one-call steps of its tokens one
    after another (the step's arithmetic, the products over many rows summing in the same order); the
    dt clamped as a prefill clamps it (a model clamping its prefills alone)."""
    model = MODELS[layout]
    lengths = data.draw(st.lists(st.integers(1, 150), min_size=batch, max_size=batch))
    T = max(lengths)
    tokens = torch.randint(0, VOCAB, (batch, T), generator=torch.Generator().manual_seed(sum(lengths)))
    cache = _prefilled(model, batch)
    other = cache.clone()
    with torch.no_grad():  # (a step under autograd is the blocks')
        step = fused_step(model, cache, tokens, "auto")
    counts = np.array(lengths, dtype=np.int64)
    got = step.prefill(tokens.contiguous(), counts, cache.conv, cache.ssm, model.blocks[0].mixer.dt_limit(True))
    clamp = model.blocks[0].mixer.dt_limit(True)
    stepper = mamba_step.MambaStep(step.layers, model.embed.weight, model.final_norm.weight, model.lm_head.weight,
                                   d_state=model.blocks[0].mixer.cfg.d_state, groups=model.blocks[0].mixer.cfg.ngroups,
                                   norm_group=model.blocks[0].mixer.norm.group_size,
                                   gate_first=model.blocks[0].mixer.norm.gate_first, eps=model.blocks[0].norm.eps,
                                   gnorm_eps=model.blocks[0].mixer.norm.eps, final_eps=model.final_norm.eps,
                                   dt_limit=clamp, pack=linear.tiled_copy)
    for row, n in enumerate(lengths):  # (each row alone: its own cache rows)
        conv, ssm = other.conv[:, row: row + 1].clone(), other.ssm[:, row: row + 1].clone()
        for t in range(n):
            want = stepper(tokens[row, t: t + 1].contiguous(), conv, ssm)
        assert torch.equal(got[row], want[0]), (row, n)
        assert torch.equal(cache.conv[:, row], conv[:, 0]) and torch.equal(cache.ssm[:, row], ssm[:, 0])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_prefill_takes_the_one_call_with_the_blockwise_prefills_logits_and_states(layout, monkeypatch):
    """``model.prefill`` of ragged prompts in chunks: one call per chunk, the logits and states those
    of the block-by-block prefill within float32 rounding, the lengths advanced; ``every`` (the logits
    after every token) takes the block-by-block path."""
    model = MODELS[layout]
    ids = torch.randint(0, VOCAB, (3, 90), generator=torch.Generator().manual_seed(3))
    lengths = torch.tensor([90, 33, 70])
    cache, other = model.allocate_cache(3, 128), model.allocate_cache(3, 128)
    calls = [0]
    real = mamba_step.MambaStep.prefill

    def counted(self, *a):
        calls[0] += 1
        return real(self, *a)
    monkeypatch.setattr(mamba_step.MambaStep, "prefill", counted)
    got = model.prefill(ids, cache, lengths=lengths, chunk=40)
    assert calls[0] == 3 and cache.seqlens.tolist() == lengths.tolist() and cache.version > 0
    model.prefill(ids, model.allocate_cache(3, 128), lengths=lengths, every=True)
    assert calls[0] == 3
    _blockwise(monkeypatch)
    want = model.prefill(ids, other, lengths=lengths, chunk=40)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert_same_state(cache, other, tol=2e-5)


def test_a_one_call_prefill_with_a_bad_token_moves_nothing():
    model = mamba2()
    cache = _prefilled(model, 2)
    before = cache.clone()
    tokens = torch.tensor([[1, 2, 3], [4, VOCAB + 7, 5]])
    with torch.no_grad():
        step = fused_step(model, cache, tokens, "auto")
    with pytest.raises(ValueError, match="row 1, position 1"):
        step.prefill(tokens, np.array([3, 3]), cache.conv, cache.ssm, (0.0, float("inf")))
    assert_same_state(cache, before, tol=0)
    # (the bad token past row 1's count: fed no further, read nowhere)
    assert step.prefill(tokens, np.array([3, 1]), cache.conv, cache.ssm, (0.0, float("inf"))).shape == (2, step.vocab)
    assert not torch.equal(cache.ssm, before.ssm)


def test_whether_the_passes_are_one_call_is_asked_with_one_kept_cache_per_model(monkeypatch):
    """Each compiled call's choice asks whether the model's passes are one call: with a one-row cache
    made once per model, dtype and device (allocated at every call, it was half of that choice's
    setup), the answer still following the model."""
    from stree.decoding.autotree import _passes_are_one_call

    model = mamba2(seed=4)
    made, real = [], model.allocate_cache
    monkeypatch.setattr(model, "allocate_cache", lambda *a, **k: made.append(a) or real(*a, **k))
    assert all(_passes_are_one_call(model) for _ in range(3)) and len(made) == 1
    layer_by_layer(monkeypatch)
    assert not _passes_are_one_call(model) and len(made) == 1


def test_a_compiled_greedy_choice_plans_as_an_eager_one_where_the_passes_are_one_call(monkeypatch):
    """torch_compile=True, greedy, where the model's passes are one call: nothing is compiled per tree
    shape, so the choice weighs every size and re-plans its shape (not the fixed sizes and the prior's
    plan of compiled passes); sampled, or where the passes go layer by layer, the fixed sizes."""
    from torch._dynamo.utils import counters

    from stree.decoding.autotree import FIXED, _passes_are_one_call, auto_tree
    from stree.decoding.loop import generate
    from stree.drafters.registry import make_drafter

    model = mamba2(seed=3)
    drafter = make_drafter("ngram", vocab_size=model.vocab_size)
    greedy = auto_tree(model, drafter, 1, mode="compiled")
    assert not greedy.fixed and greedy.sizes != FIXED and max(greedy.sizes) > max(FIXED)
    assert auto_tree(model, drafter, 1, mode="compiled", sampled=True).sizes == FIXED
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 6, 4, 5]] * 2
    want = generate(model, prompts, max_new_tokens=24)
    graphs = counters["stats"]["unique_graphs"]
    got = generate(model, prompts, drafter=make_drafter("ngram", vocab_size=model.vocab_size), max_new_tokens=24,
                   torch_compile=True)
    assert got.sequences == want.sequences and counters["stats"]["unique_graphs"] == graphs  # (nothing compiled)
    layer_by_layer(monkeypatch)
    assert not _passes_are_one_call(model)
