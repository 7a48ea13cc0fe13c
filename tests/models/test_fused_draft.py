"""A drafter model's greedy draft as one call (TreeLM.draft_greedy, MambaStep.draft): the new tokens fed
token by token, each node's children its parent's most likely tokens (under a cut of the head, among
those ids alone), every node above the deepest level stepped into its slot, rows restored first from
an earlier draft's slots; all exactly what the model's own one-call steps make, on random trees (float32
and half models); the lengths kept; bad tokens, trees and rows refused with nothing moved."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import parent_lists
from tiny_models import VOCAB, assert_same_state, mamba2

from stree.kernels.cpu import mamba_step
from stree.models.fused_step import fused_step
from stree.tree import TreeShape

pytestmark = pytest.mark.skipif(not mamba_step.available(), reason="no C++ compiler for the CPU library here")

MODELS = {"groups": mamba2(), "clamped, prefill-only, three layers": mamba2(dt_limit=(0.01, 0.2), n_layer=3,
                                                                           dt_limit_prefill_only=True),
          # (a half model's conv states of its dtype, widened and narrowed around the call)
          "float16": mamba2().to(torch.float16),
          "bfloat16, half residual": mamba2(residual_in_fp32=False).to(torch.bfloat16)}


def _reference(model, conv, ssm, fed, parents, ids):
    """One row's draft by the model's own one-call steps on copies of its states ``[layers, 1, ...]``:
    the tokens, and the states after each node stepped (None for the root and the deepest level)."""
    with torch.no_grad():
        step = fused_step(model, model.allocate_cache(1, 8), None, "auto")
    n = len(parents)
    depth = [0] * n
    for v in range(1, n):
        depth[v] = depth[parents[v]] + 1
    for tok in fed:
        logits = step(torch.tensor([tok]), conv, ssm)[0]
    tokens, states, logits_of = [0] * n, [None] * n, {0: logits}
    keep = torch.arange(model.vocab_size) if ids is None else ids
    for v in range(n):  # (parents before children: a node's logits are made before its children's turn)
        kids = [c for c in range(v + 1, n) if parents[c] == v]
        if kids:
            ranked = torch.from_numpy(np.argsort(-logits_of[v][keep].numpy(), kind="stable"))
            for c, j in zip(kids, ranked[: len(kids)].tolist()):
                tokens[c] = int(keep[j])
        for c in kids:
            if depth[c] < max(depth):
                state = (conv if v == 0 else states[v][0]).clone(), (ssm if v == 0 else states[v][1]).clone()
                logits_of[c] = step(torch.tensor([tokens[c]]), *state)[0]
                states[c] = state
    return tokens, states


def _draft(model, cache, nodes, feed, counts, shape, ids=None, restore=None, before=None):
    return model.draft_greedy(feed, np.asarray(counts, dtype=np.int64), shape, cache, nodes, ids,
                              None if restore is None else np.asarray(restore, dtype=np.int64), before)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), layout=st.sampled_from(sorted(MODELS)), batch=st.integers(1, 3), n=st.integers(2, 12),
       cut=st.booleans())
def test_a_one_call_draft_is_the_models_own_steps(data, layout, batch, n, cut):
    """Random trees, rows fed 1 to 70 tokens (past a block of 64), the whole head or a random cut of
    it: the tokens, the cache's states after the feed and every stepped node's state exactly those of
    the model's one-call steps; slots never written stay poisoned."""
    model = MODELS[layout]
    parents = data.draw(parent_lists(n))
    shape = TreeShape(tuple(parents))
    counts = data.draw(st.lists(st.integers(1, 70), min_size=batch, max_size=batch))
    gen = torch.Generator().manual_seed(sum(counts) + n)
    feed = torch.randint(0, VOCAB, (batch, max(counts)), generator=gen)
    ids = torch.randperm(VOCAB, generator=gen)[: data.draw(st.integers(12, VOCAB))] if cut else None
    cache = model.allocate_cache(batch, 256)
    model.prefill(torch.randint(0, VOCAB, (batch, 4), generator=gen), cache)
    before = cache.clone()
    nodes = model.allocate_cache(n * batch, 256)
    nodes.conv.fill_(float("nan"))
    nodes.ssm.fill_(float("nan"))
    drafted, slots = _draft(model, cache, nodes, feed, counts, shape, ids)
    stepped = [v for v in range(n) if slots[v] >= 0]
    assert sorted(slots[stepped].tolist()) == list(range(len(stepped)))
    assert cache.seqlens.tolist() == [4 + c for c in counts]
    for r in range(batch):
        conv, ssm = before.conv[:, r: r + 1].clone(), before.ssm[:, r: r + 1].clone()
        tokens, states = _reference(model, conv, ssm, feed[r, : counts[r]].tolist(), parents, ids)
        assert drafted[r, 1:].tolist() == tokens[1:], r
        assert torch.equal(cache.conv[:, r], conv[:, 0]) and torch.equal(cache.ssm[:, r], ssm[:, 0])
        for v in range(1, n):
            assert (states[v] is None) == (slots[v] < 0), v
            if states[v] is not None:
                row = int(slots[v]) * batch + r
                assert torch.equal(nodes.conv[:, row], states[v][0][:, 0]), v
                assert torch.equal(nodes.ssm[:, row], states[v][1][:, 0]), v
                assert int(nodes.seqlens[row]) == 4 + counts[r] + shape.depth[v]
    if len(stepped) < n:  # (the slots past the stepped nodes': untouched)
        assert torch.isnan(nodes.ssm[:, len(stepped) * batch:]).all()


def test_rows_restored_from_an_earlier_drafts_slots_continue_from_that_node():
    """The next draft restores row 0 to the state after node 2 of the last one (what its new tokens
    followed) and leaves row 1 at its root: each row's states, lengths and drafts are those of the
    steps of its whole context."""
    model = MODELS["groups"]
    shape = TreeShape((-1, 0, 1, 2, 0))
    cache, nodes = model.allocate_cache(2, 64), model.allocate_cache(10, 64)
    model.prefill(torch.tensor([[5, 6, 7], [8, 9, 10]]), cache)
    full = cache.clone()
    first, slots = _draft(model, cache, nodes, torch.tensor([[11], [12]]), [1, 1], shape)
    earlier = nodes.clone()
    # row 0 accepted nodes 1 and 2, then a bonus (33): restored to node 2's slot, 33 fed; row 1 accepted
    # nothing (44, then 45 as the bonus): both fed from its root
    restore = [int(slots[2]) * 2 + 0, -1]
    drafted, _ = _draft(model, cache, nodes, torch.tensor([[33, 33], [44, 45]]), [1, 2], shape, restore=restore,
                        before=earlier)
    assert cache.seqlens.tolist() == [3 + 1 + 2 + 1, 3 + 1 + 2]
    want_cache = full
    whole = torch.tensor([[11] + first[0, 1:3].tolist() + [33], [12, 44, 45, 45]])
    expected, _ = _draft(model, want_cache, model.allocate_cache(10, 64), whole, [4, 3], shape)
    assert torch.equal(drafted, expected)
    assert_same_state(cache, want_cache, tol=0)


def test_bad_tokens_trees_and_rows_are_refused_before_anything_moves():
    model = MODELS["groups"]
    shape = TreeShape((-1, 0, 0))
    cache, nodes = model.allocate_cache(2, 64), model.allocate_cache(6, 64)
    model.prefill(torch.tensor([[1, 2], [3, 4]]), cache)
    kept, kept_nodes = cache.clone(), nodes.clone()
    feed = torch.tensor([[5, 6], [7, model.vocab_size + 3]])
    with pytest.raises(ValueError, match="row 1, position 1"):
        _draft(model, cache, nodes, feed, [2, 2], shape)
    with pytest.raises(ValueError, match="rows restored"):
        _draft(model, cache, nodes, feed, [2, 1], shape, restore=[6, -1], before=nodes)
    with torch.no_grad():
        step = fused_step(model, cache, feed, "auto")
    with pytest.raises(ValueError, match="more children"):  # (the call itself; the model's declines it, below)
        step.draft(feed, np.array([2, 1]), np.array(shape.parents), cache.conv, cache.ssm, nodes.conv, nodes.ssm,
                   step.head_cut(torch.tensor([3])))
    with pytest.raises(ValueError, match="counts must be"):
        _draft(model, cache, nodes, feed, [0, 1], shape)
    with pytest.raises(ValueError, match="nodes of 6 rows"):
        _draft(model, cache, model.allocate_cache(4, 64), feed, [2, 1], shape)
    with pytest.raises(ValueError, match="distinct int64 token ids"):
        _draft(model, cache, nodes, feed, [2, 1], shape, ids=torch.tensor([3, 3, 4]))
    assert_same_state(cache, kept, tol=0)
    assert_same_state(nodes, kept_nodes, tol=0)
    # no one call for a node with more children than the cut's tokens, or than the call draws
    assert _draft(model, cache, nodes, feed, [2, 1], shape, ids=torch.tensor([3])) is None
    wide = TreeShape((-1,) + (0,) * (mamba_step.DRAFT_MAX_CHILDREN + 1))
    assert _draft(model, cache, model.allocate_cache(wide.n * 2, 64), feed, [2, 1], wide) is None
    assert_same_state(cache, kept, tol=0)
    # (the bad token past row 1's count: fed nowhere)
    assert _draft(model, cache, nodes, feed, [2, 1], shape)[0].shape == (2, 3)


def test_where_there_is_no_one_call_the_model_says_so_and_nothing_moves():
    model = mamba2().double()  # (the one call is float32's)
    cache, nodes = model.allocate_cache(1, 16), model.allocate_cache(2, 16)
    assert _draft(model, cache, nodes, torch.tensor([[3]]), [1], TreeShape((-1, 0))) is None
    assert cache.seqlens.tolist() == [0]
