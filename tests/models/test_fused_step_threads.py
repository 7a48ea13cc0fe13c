"""The one-call functions (stree.kernels.cpu.mamba_step) give the same bits whatever the threads: a
step, a prefill, a tree pass, a greedy iteration and a draft on two threads (the rows, a tree row's
nodes in its conv and scan (its conv's channels where it has fewer nodes than threads), a prompt's conv
channels and scan heads, norms and roundings split between them where the work is large enough: trees of 4
nodes or more, of one with a head's state of 32, prompts of 128 tokens or more for these models) equal the
same calls on one, where every loop runs in order on the calling thread."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import trees
from tiny_models import VOCAB, mamba2, with_biases

from stree.kernels.cpu import mamba_step
from stree.tree import TokenTree, TreeShape

pytestmark = pytest.mark.skipif(not mamba_step.available(), reason="no C++ compiler for the CPU library here")

MODELS = {"float32": with_biases(mamba2()),
          # (a head's state of 32: a tree of one node already splits, by channels, where a row has fewer nodes
          # than threads)
          "float32, d_state 32": with_biases(mamba2(d_state=32)),
          "float16, half residual, one group": with_biases(mamba2(residual_in_fp32=False, ngroups=1)).to(torch.float16),
          "bfloat16": mamba2().to(torch.bfloat16)}


def _on(threads: int, call):
    """``call()`` with torch (and so the one call) on ``threads`` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            return call()
    finally:
        torch.set_num_threads(before)


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y) or (x.is_floating_point() and torch.equal(x.isnan(), y.isnan())
                                         and torch.equal(x.nan_to_num(), y.nan_to_num()))
        elif x is not None:
            assert np.array_equal(x, y)


@settings(max_examples=25, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(MODELS)))
def test_every_one_call_is_the_same_on_one_thread_and_on_two(data, name):
    model = MODELS[name]
    parents, batch = data.draw(trees(max_n=12))
    n = parents.shape[-1]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    prompt = torch.randint(0, VOCAB, (batch, 150), generator=gen)
    lengths = torch.randint(1, 151, (batch,), generator=gen)
    tokens = torch.randint(0, VOCAB, (batch, n), generator=gen)
    step = torch.randint(0, VOCAB, (batch,), generator=gen)

    def run():
        cache = model.allocate_cache(batch, 200)
        out = [model.prefill(prompt, cache, lengths=lengths), model.step(step, cache)]
        # (a pass of other tokens first: its scratch, kept by the thread from call to call, holds other values
        # than the one-thread run's, so that a node the split left out could not pass for computed)
        model.forward_tree(TokenTree(parents, tokens.flip(-1)), cache.clone())
        logits, _ = model.forward_tree(TokenTree(parents, tokens), cache.clone())
        # a draft that mostly follows the pass's choices, so that the greedy iteration's paths go deep
        choice = logits.argmax(-1).gather(1, parents.expand(batch, n).clamp(min=0))
        follow = torch.rand(batch, n, generator=torch.Generator().manual_seed(0)) < 0.7
        iteration = model.greedy_tree(TokenTree(parents, torch.where(follow, choice, tokens)), cache)
        accepted, count = iteration[1], iteration[2]
        on_path = torch.arange(accepted.shape[1]) < count[:, None]  # (the logits the call makes: its paths')
        path_logits = iteration[0][torch.arange(batch)[:, None].expand_as(accepted)[on_path], accepted[on_path]]
        row = (parents if parents.dim() == 1 else parents[0]).tolist()
        shape = TreeShape(row if n > 1 else [-1, 0, 1, 1])
        nodes = model.allocate_cache(shape.n * batch, 200)
        draft = model.draft_greedy(tokens[:, :1].contiguous(), np.ones(batch, dtype=np.int64), shape, cache, nodes,
                                   None, None, None)
        return [*out, logits, path_logits, *iteration[1:6], *draft, cache.conv, cache.ssm, cache.seqlens, nodes.conv,
                nodes.ssm]

    _same(_on(1, run), _on(2, run))
