"""CUDA-graph replays of step and of a tree pass must equal the eager calls, state included.
Capture needs a GPU; off one only the argument errors are checked."""

import pytest
import torch
from tiny_models import FAMILIES, VOCAB

from stree.decoding.loop import generate
from stree.runtime import GraphedCommit, GraphedStep, GraphedTreePass
from stree.tree import TokenTree, TreeShape

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (run benchmarks/gpu_check.sh)")


def _pair(family, lengths=(6, 3)):
    """A model on the GPU and two identical prefilled caches."""
    model = FAMILIES[family]().cuda()
    g = torch.Generator().manual_seed(4)
    cache = model.allocate_cache(len(lengths), 40)
    ids = torch.randint(0, VOCAB, (len(lengths), max(lengths)), generator=g).cuda()
    model.prefill(ids, cache, lengths=torch.tensor(lengths))
    return model, cache, cache.clone()


def _states(cache):
    return [t for t in (cache.conv, cache.ssm, cache.k, cache.v, cache.seqlens) if t is not None]


@cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_graphed_step_equals_eager_steps_without_host_syncs(family):
    model, cache, eager = _pair(family)
    graphed = GraphedStep(model, cache)
    assert torch.equal(cache.seqlens, eager.seqlens)  # warm-up and capture left the state as it was
    tok = torch.tensor([5, 7], device="cuda")
    for _ in range(6):
        want = model.step(tok, eager)
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = graphed(tok, validate=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert (got - want).abs().max() <= 1e-5
        assert torch.equal(cache.seqlens, eager.seqlens)
        tok = want.argmax(-1)
    for b in range(2):
        n = int(cache.seqlens[b])
        for a, c in zip(_states(cache), _states(eager)):
            row = a[:, b] if a.dim() > 1 else a[b]
            other = c[:, b] if c.dim() > 1 else c[b]
            if a is cache.k or a is cache.v:
                row, other = row[:, :n], other[:, :n]
            assert (row.float() - other.float()).abs().max() <= 1e-5


@cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_graphed_tree_pass_then_commit_equals_eager(family):
    model, cache, eager = _pair(family)
    shape = TreeShape.paper13()
    graphed = GraphedTreePass(model, cache, shape)
    accepted = torch.tensor([[0, 2, 6], [0, 1, 0]], device="cuda")
    num = torch.tensor([3, 1], device="cuda")
    for seed in range(2):
        tokens = torch.randint(0, VOCAB, (2, shape.n), generator=torch.Generator().manual_seed(seed)).cuda()
        tree = TokenTree.from_shape(shape, tokens)
        want, eager_pass = model.forward_tree(tree, eager)
        got, tree_pass = graphed(tokens)
        assert (got - want).abs().max() <= 1e-5
        model.commit(eager, eager_pass, accepted, num)
        model.commit(cache, tree_pass, accepted, num)
        assert torch.equal(cache.seqlens, eager.seqlens)
        assert all((a.float() - c.float()).abs().max() <= 1e-5
                   for a, c in zip(_states(cache)[:2], _states(eager)[:2]))


@pytest.mark.parametrize("cls, extra", [(GraphedStep, ()), (GraphedTreePass, (TreeShape.chain(2),))])
def test_graphs_refuse_a_model_off_cuda(cls, extra):
    model = FAMILIES["mamba2"]()
    with pytest.raises(ValueError, match="CUDA graphs need a model on a CUDA device, got cpu"):
        cls(model, model.allocate_cache(1, 8), *extra)


@cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_graphed_commit_equals_eager(family):
    model, cache, eager = _pair(family)
    shape = TreeShape.paper13()
    tree_graph = GraphedTreePass(model, cache, shape)
    commit_graph = GraphedCommit(model, tree_graph)
    accepted = torch.tensor([[0, 2, 6, 0, 0], [0, 1, 4, 7, 10]], device="cuda")
    num = torch.tensor([3, 5], device="cuda")
    for seed in range(2):
        tokens = torch.randint(0, VOCAB, (2, shape.n), generator=torch.Generator().manual_seed(seed)).cuda()
        _, eager_pass = model.forward_tree(TokenTree.from_shape(shape, tokens), eager)
        model.commit(eager, eager_pass, accepted, num)
        _, tree_pass = tree_graph(tokens)
        commit_graph(tree_pass, accepted, num)
        assert torch.equal(cache.seqlens, eager.seqlens)
        assert all((a.float() - c.float()).abs().max() <= 1e-5 for a, c in zip(_states(cache)[:2], _states(eager)[:2]))


@cuda
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["autoregressive", "stree"])
def test_generate_from_graphs_is_token_identical(family, method):
    """The loop with graphs (the default on CUDA) and without, rows finishing at different steps,
    twice (the second call reuses the graphs and their cache)."""
    model = FAMILIES[family]().cuda()
    prompts = [[1, 2, 3, 1, 2], [4, 5], [6, 7, 8, 6]]
    ref = generate(model, prompts, method="autoregressive", max_new_tokens=12, cuda_graph=False)
    eos = ref.new_tokens[1][2]
    want = generate(model, prompts, method=method, max_new_tokens=12, eos_token_id=eos, cuda_graph=False)
    for _ in range(2):
        got = generate(model, prompts, method=method, max_new_tokens=12, eos_token_id=eos)
        assert got.sequences == want.sequences


@cuda
@pytest.mark.parametrize("family", ["mamba2", "hybrid"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_graphed_call_captures_its_graphs_before_decoding(monkeypatch, family, temperature):
    """A model whose costs are known (another instance of the same config measured them; in a
    new process: the cache file) but which has captured nothing: the call captures the step and
    every fixed size's tree pass and commit before its prefill, as setup, and nothing while it
    decodes; a second call captures nothing. (Captured inside decoding, each first use of a size
    cost a timed call its warm-up runs and Triton's compiles.)"""
    import stree.runtime.graphs as graphs
    from stree.decoding.loop import decode, drain
    from stree.drafters import NGramDrafter

    captures = []
    real = graphs._capture
    monkeypatch.setattr(graphs, "_capture", lambda *a, **k: captures.append(1) or real(*a, **k))
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 4, 5, 4]]
    kw = dict(max_new_tokens=10, temperature=temperature, seed=0)
    want = generate(FAMILIES[family]().cuda(), prompts, drafter=NGramDrafter(), **kw).sequences
    fresh = FAMILIES[family]().cuda()
    for call in range(2):
        before = len(captures)
        steps = decode(fresh, prompts, drafter=NGramDrafter(), **kw)
        next(steps)  # the prefill, and before it the build
        built = len(captures)
        out = drain(steps)
        assert len(captures) == built  # nothing captured while decoding
        if call == 0:
            assert built > before + 2 and out.stats.time_setup > 0  # the step and the sizes' passes, as setup
        else:
            assert built == before
        assert out.sequences == want


def test_generate_refuses_graphs_off_cuda():
    model = FAMILIES["mamba2"]()
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for models elsewhere")
    with pytest.raises(ValueError, match="cuda_graph=True needs a stree model on a CUDA device"):
        generate(model, [[1, 2]], max_new_tokens=2, cuda_graph=True)
