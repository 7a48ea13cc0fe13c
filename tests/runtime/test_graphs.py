"""CUDA-graph replays of step and of a tree pass must equal the eager calls, state included.
Capture needs a GPU; off one the argument errors are checked, and the greedy iteration's graphs
run through a stand-in for capture (:class:`_Replayed`) that checks what surrounds them."""

import dataclasses

import pytest
import torch
from tiny_models import FAMILIES, VOCAB, assert_same_state

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


class _Replayed:
    """A stand-in for a captured graph on the CPU: a replay runs the captured function again and
    writes its outputs into the first run's tensors, as a real graph's outputs are its own memory.
    What it checks is what surrounds the graphs: static inputs copied in, outputs read where the
    graph wrote them, the commit reading the paths the iteration wrote, results kept across
    replays; what it cannot is the capture itself (the CUDA case below)."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self):
        _write_into(self.out, self.fn())


def _write_into(dst, src):
    if isinstance(dst, torch.Tensor):
        if dst is not src:
            dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            _write_into(d, s)
    elif dataclasses.is_dataclass(dst):
        for f in dataclasses.fields(dst):
            _write_into(getattr(dst, f.name), getattr(src, f.name))


@pytest.fixture(params=["stand-in", "cuda"])
def graph_device(request, monkeypatch):
    """The device greedy iterations are graphed on: the CPU with :class:`_Replayed` for capture,
    or CUDA (skipped without it)."""
    import stree.runtime.graphs as graphs

    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("CUDA graphs need a GPU (run benchmarks/gpu_check.sh)")
        return "cuda"

    def capture(model, cache, fn, warmup):  # (a capture runs nothing: the state stays as it was)
        saved, version = [t.clone() for t in graphs._recurrent_state(cache)], cache.version
        out = fn()
        for t, s in zip(graphs._recurrent_state(cache), saved):
            t.copy_(s)
        cache.version = version
        return _Replayed(fn, out), out

    monkeypatch.setattr(graphs, "_capture", capture)
    return "cpu"


def _followed(model, cache, seed):
    """A paper13 draft whose first children follow the target's greedy choices (long accepted
    paths), with nodes invalid that differ by seed: seed 1 cuts row 0's path at its root."""
    shape = TreeShape.paper13()
    tokens = torch.randint(0, VOCAB, (2, shape.n), generator=torch.Generator().manual_seed(seed))
    kids = shape.children()
    for _ in range(shape.max_depth):
        logits, _ = model.forward_tree(TokenTree.from_shape(shape, tokens.to(model.device)), cache.clone())
        best = logits.argmax(-1).cpu()
        for v, children in enumerate(kids):
            if children:
                tokens[:, children[0]] = best[:, v]
    valid = torch.ones(2, shape.n, dtype=torch.bool)
    valid[1 - seed % 2, kids[0][-1 if seed % 2 == 0 else 0]] = False
    return TokenTree.from_shape(shape, tokens, valid=valid).to(model.device)


@pytest.mark.parametrize("family, top_k", [(f, None) for f in FAMILIES] + [("hybrid", 3)])
@torch.no_grad()
def test_a_graphed_greedy_iteration_equals_the_eager_step(graph_device, family, top_k):
    """Greedy decoding on CUDA graphs runs a tree pass, its verification and the host's packed
    outputs as one graph and the commit as a second, which reads the accepted paths where the
    first wrote them: three iterations in a row give the eager step's paths, tokens, laws and
    state, and each iteration's result stays as it was after the next replays."""
    from stree.decoding.loop import speculative_step
    from stree.runtime import DecodeGraphs
    from stree.sampling.verify import SamplingParams

    model = FAMILIES[family]().to(graph_device)
    eager = model.allocate_cache(2, 64)
    model.prefill(torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1)).to(graph_device), eager)
    runner = DecodeGraphs(model, 2, 64)
    runner.cache.assign(torch.arange(2, device=graph_device), eager)
    params, kept = SamplingParams(0.0), []
    for seed in range(3):
        draft = _followed(model, eager, seed)
        want, want_result = speculative_step(model, eager, draft, params, None, top_k=top_k)
        got, result = speculative_step(model, runner.cache, draft, params, None, top_k=top_k, runner=runner)
        assert list(runner._fused) == [(draft.static_shape, "greedy")]  # the graphed iteration ran
        assert int(want_result.num_accepted.max()) >= 3  # (a long path to compare)
        for a, b in ((got.tokens, want.tokens), (got.counts, want.counts), (got.finite, want.finite)):
            assert torch.equal(a, b.cpu())
        kept.append(((result.accepted, result.num_accepted, result.bonus),
                     tuple(t.clone() for t in (want_result.accepted, want_result.num_accepted, want_result.bonus))))
        if top_k is not None:  # (a drafter reads a row's first counts[b] entries: past them each path has its own)
            for b, n in enumerate(want.counts.tolist()):
                assert torch.equal(got.top_ids[b, :n], want.top_ids[b, :n])
                torch.testing.assert_close(got.top_probs[b, :n], want.top_probs[b, :n])
                torch.testing.assert_close(got.token_probs[b, :n], want.token_probs[b, :n])
        else:
            assert got.top_ids is None
        assert_same_state(runner.cache, eager, 1e-4)
    for got, want in kept:  # (results are copies: the graphs' outputs are the next iteration's)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("top_k", [None, 3])
@torch.no_grad()
def test_a_graphed_greedy_step_equals_the_eager_step(graph_device, top_k):
    """A greedy step on CUDA graphs is one graph with its token's choice and the host's packed
    outputs, built before decoding (``build_calls``: nothing is captured while stepping): the eager
    step's tokens, laws and state, step after step."""
    import stree.runtime.graphs as graphs
    from stree.decoding.steps import autoregressive_step, build_calls
    from stree.runtime import DecodeGraphs
    from stree.sampling.verify import SamplingParams

    model = FAMILIES["hybrid"]().to(graph_device)
    eager = model.allocate_cache(2, 64)
    model.prefill(torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2)).to(graph_device), eager)
    runner, params = DecodeGraphs(model, 2, 64), SamplingParams(0.0)
    build_calls(model, runner, [], params, step_top_ks={None, top_k})
    runner.cache.assign(torch.arange(2, device=graph_device), eager)
    captures, real = [], graphs._capture
    graphs._capture = lambda *a, **k: captures.append(1) or real(*a, **k)
    try:
        roots = torch.tensor([3, 9], device=graph_device)
        for _ in range(4):
            want = autoregressive_step(model, eager, roots, params, None, top_k=top_k)
            got = autoregressive_step(model, runner.cache, roots, params, None, runner=runner, top_k=top_k)
            assert torch.equal(got.tokens, want.tokens.cpu()) and torch.equal(got.finite, want.finite.cpu())
            assert got.counts.tolist() == [1, 1]
            if top_k is not None:
                assert torch.equal(got.top_ids, want.top_ids.cpu())
                torch.testing.assert_close(got.top_probs, want.top_probs.cpu())
                torch.testing.assert_close(got.token_probs, want.token_probs.cpu())
            else:
                assert got.top_ids is None
            assert_same_state(runner.cache, eager, 1e-4)
            roots = got.tokens[:, 0].to(graph_device)
    finally:
        graphs._capture = real
    assert captures == [] and "step" not in runner.built  # (greedy: the plain step's graph is not needed)
