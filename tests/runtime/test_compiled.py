"""The compiled decode path (torch.compile of step, tree pass and commit, for the CPU) must equal
the eager calls, state included, and compile each function once per shape."""

import functools
import re

import pytest
import torch
from tiny_models import FAMILIES, VOCAB, layer_by_layer
from torch._dynamo.utils import counters

from stree.decoding.autotree import FIXED
from stree.drafters.registry import make_drafter
from stree.decoding.loop import generate
from stree.checkpoints.io import load, save
from stree.runtime import CompiledDecode, CompiledModel
from stree.testing import MarkovLM
from stree.tree import TokenTree, TreeShape

MAX_LENGTH = 256  # what generate's pool allocates for these prompts: the same shapes, no new compile


@pytest.fixture(autouse=True)
def _graphs(monkeypatch):
    """The compiled graphs themselves: a float32 Mamba2 model's steps and draft passes are one call
    each, which compiled decoding takes too (tests/models/test_fused_step.py)."""
    layer_by_layer(monkeypatch)


@functools.lru_cache(maxsize=None)
def _shared(family, seed=0):
    """One model per family and seed for the file: what one test compiled, the next reuses."""
    return FAMILIES[family](seed=seed)


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request):
    return _shared(request.param)


def _pair(model, lengths=(6, 3)):
    """Two identical prefilled caches."""
    g = torch.Generator().manual_seed(4)
    cache = model.allocate_cache(len(lengths), MAX_LENGTH)
    model.prefill(torch.randint(0, VOCAB, (len(lengths), max(lengths)), generator=g), cache, lengths=torch.tensor(lengths))
    return cache, cache.clone()


def _assert_same_state(cache, eager):
    assert torch.equal(cache.seqlens, eager.seqlens)
    for name in ("conv", "ssm"):
        a, b = getattr(cache, name), getattr(eager, name)
        assert (a - b).abs().max() <= 1e-5, name
    if cache.k is not None:
        for b in range(cache.batch_size):
            n = int(cache.seqlens[b])
            assert (cache.k[:, b, :n] - eager.k[:, b, :n]).abs().max() <= 1e-5
            assert (cache.v[:, b, :n] - eager.v[:, b, :n]).abs().max() <= 1e-5


def test_compiled_step_equals_eager_steps(model):
    cache, eager = _pair(model)
    compiled = CompiledModel(model)
    tok = torch.tensor([5, 7])
    for _ in range(4):
        want = model.step(tok, eager)
        got = compiled.step(tok, cache)
        assert (got - want).abs().max() <= 1e-5
        _assert_same_state(cache, eager)
        tok = want.argmax(-1)


@pytest.mark.parametrize("tree_kind", ["static", "parents"])
def test_compiled_tree_pass_then_commit_equals_eager(model, tree_kind):
    """A static shape's pass is compiled; a tree given by its parents takes the eager pass."""
    cache, eager = _pair(model)
    compiled = CompiledModel(model)
    shape = TreeShape.paper13()
    accepted = torch.tensor([[0, 2, 6, 0, 0], [0, 1, 4, 7, 10]])
    num = torch.tensor([3, 5])
    for seed in range(3):
        tokens = torch.randint(0, VOCAB, (2, shape.n), generator=torch.Generator().manual_seed(seed))
        want, eager_pass = model.forward_tree(TokenTree.from_shape(shape, tokens), eager)
        tree = (TokenTree.from_shape(shape, tokens) if tree_kind == "static"
                else TokenTree(torch.tensor(shape.parents), tokens))
        got, handle = compiled.forward_tree(tree, cache)
        assert (got - want).abs().max() <= 1e-5
        _assert_same_state(cache, eager)  # the pass changed no committed state
        model.commit(eager, eager_pass, accepted, num)
        compiled.commit(cache, handle, accepted, num)
        _assert_same_state(cache, eager)
        with pytest.raises(ValueError, match="tree_pass is stale"):
            compiled.commit(cache, handle, accepted, num)
    with pytest.raises(ValueError, match="is not a root path"):
        _, handle = compiled.forward_tree(TokenTree.from_shape(shape, tokens), cache)
        compiled.commit(cache, handle, torch.tensor([[0, 2, 4], [0, 1, 4]]), torch.tensor([3, 3]))


@pytest.mark.parametrize("method", ["autoregressive", "stree"])
def test_generate_compiled_is_token_identical_and_compiles_once(model, method):
    """Rows finishing at different steps; the second call compiles nothing new."""
    prompts = [[1, 2, 3, 1, 2], [4, 5]]
    ref = generate(model, prompts, method="autoregressive", max_new_tokens=12)
    eos = ref.new_tokens[1][2]
    graphs = counters["stats"]["unique_graphs"]
    first = generate(model, prompts, method=method, max_new_tokens=12, eos_token_id=eos, torch_compile=True)
    # at most one graph per compiled function it uses, none twice: the step; under tree="auto" also
    # the tree pass and commit of every fixed size, which the cost profile compiles and times
    assert counters["stats"]["unique_graphs"] - graphs <= (1 if method == "autoregressive" else 1 + 2 * len(FIXED))
    want = generate(model, prompts, method=method, max_new_tokens=12, eos_token_id=eos)
    assert first.sequences == want.sequences
    graphs = counters["stats"]["unique_graphs"]
    got = generate(model, prompts, method=method, max_new_tokens=12, eos_token_id=eos, torch_compile=True)
    assert got.sequences == want.sequences
    assert counters["stats"]["unique_graphs"] == graphs


# each family, drafter kind and verification (greedy, sampled) once; the SSM drafter both ways
@pytest.mark.parametrize("family, drafter, temperature", [("mamba2", "ngram", 1.0), ("hybrid", "ngram", 0.0),
                                                          ("mamba2", "ssm-static", 0.0), ("mamba2", "ssm-static", 1.0)])
def test_a_compiled_call_builds_its_calls_before_decoding(family, drafter, temperature):
    """A model whose costs are known (here: another instance of the same config measured them;
    in a new process: the cache file) but which has compiled nothing yet: the call compiles the
    step and every fixed size's pass before its prefill, as setup, and a compiled drafter model
    its steps for drafting them, and nothing while it decodes; a second call builds nothing. (The
    SSM drafter drafts an explicit tree for one row: a batch's rows finishing at different steps
    leave fewer rows, whose steps a compiled drafter model compiles when they come.)"""
    from stree.decoding.loop import decode, drain

    def make(model, small):
        return make_drafter(drafter, drafter_model=None if drafter == "ngram" else small, vocab_size=model.vocab_size)

    # the costs measured (and the fixed sizes compiled) for this config, by the file's shared models
    measured = _shared(family)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [4, 5, 4, 5, 4]][: 1 if drafter == "ssm-static" else 2]
    kw = dict(max_new_tokens=10, temperature=temperature, seed=0, torch_compile=True)
    if drafter == "ssm-static":  # drafted every step (this pair's costs would have it decode plain)
        kw["tree"] = TreeShape.paper13()
    want = generate(measured, prompts, drafter=make(measured, CompiledModel.of(_shared("mamba2", 1))), **kw).sequences
    fresh = FAMILIES[family]()
    fresh_drafter = make(fresh, CompiledModel(FAMILIES["mamba2"](seed=1)))
    for call in range(2):
        graphs = counters["stats"]["unique_graphs"]
        steps = decode(fresh, prompts, drafter=fresh_drafter, **kw)
        next(steps)  # the prefill, and before it the build
        built = counters["stats"]["unique_graphs"]
        out = drain(steps)
        assert counters["stats"]["unique_graphs"] == built  # nothing compiled while decoding
        if call == 0:
            assert built > graphs and out.stats.time_setup > 0  # the step and the passes, as setup
        else:
            assert built == graphs
        assert out.sequences == want  # (sampled: the same seed, costs and so trees)


def test_compiled_tree_pass_checks_its_tokens(model):
    tree_pass, _ = CompiledDecode(model, 2, MAX_LENGTH).tree(TreeShape.chain(2))
    with pytest.raises(ValueError, match=r"tokens must have shape \(2, 3\) \(this pass's tree\), got \(2, 4\)"):
        tree_pass(torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tree_pass(torch.full((2, 3), model.vocab_size))


def test_generate_refuses_compile_where_it_does_not_apply():
    with pytest.raises(TypeError, match="torch_compile must be a bool, got 'yes'"):
        generate(FAMILIES["mamba2"](), [[1, 2]], max_new_tokens=2, torch_compile="yes")
    markov = MarkovLM(torch.softmax(torch.randn(VOCAB, VOCAB, dtype=torch.float64), -1))
    with pytest.raises(ValueError, match="torch_compile=True is for stree models on the CPU"):
        generate(markov, [[1, 2]], max_new_tokens=2, torch_compile=True)


def test_ssm_drafter_on_the_compiled_model_drafts_as_on_the_eager_one(model):
    """Its steps and chain passes compiled: the same drafts (deterministic mode), so the same
    accepted counts at every step."""
    drafter_model = FAMILIES["mamba2"](seed=1)
    prompts = [[1, 2, 3, 1, 2], [4, 5]]
    runs = [generate(model, prompts, max_new_tokens=10, tree=TreeShape.paper13(),
                     drafter=make_drafter("ssm-static", drafter_model=m, vocab_size=model.vocab_size))
            for m in (drafter_model, CompiledModel(drafter_model))]
    assert runs[0].sequences == runs[1].sequences
    assert runs[0].stats.accepted == runs[1].stats.accepted


def test_compiled_model_refuses_what_it_cannot_compile():
    with pytest.raises(ValueError, match="the compiled decode path is for stree models on the CPU"):
        CompiledModel(MarkovLM(torch.softmax(torch.randn(VOCAB, VOCAB, dtype=torch.float64), -1)))
    model = FAMILIES["mamba2"]()
    compiled = CompiledModel(model)
    cache = model.allocate_cache(1, 8)
    model.double()  # its graphs (guards on torch's own modules skipped) would not know
    with pytest.raises(ValueError, match="the model is now torch.float64 on cpu but was compiled for torch.float32"):
        compiled.step(torch.tensor([1]), cache)


def test_compiled_model_lays_conv_taps_along_the_channels_in_the_same_parameters(tmp_path):
    """Every Mamba2 conv weight taps-major once wrapped (Inductor vectorises the tree conv's taps
    along the channels only so), the same Parameters with the same values; laid out so again
    before a call after something brought nn.Conv1d's layout back (the graph asserts the strides
    it was compiled for); saved, the same weights."""
    model = FAMILIES["hybrid"](seed=7)
    mixers = [m for m in model.modules() if hasattr(m, "compile_layout")]
    params = [m.conv1d.weight for m in mixers]
    values = [p.detach().clone() for p in params]
    assert mixers and all(p.stride(0) != 1 for p in params)
    compiled = CompiledModel(model)

    def laid_out():
        for m, p, v in zip(mixers, params, values):
            assert m.conv1d.weight is p and torch.equal(p.detach(), v)
            assert p.stride(0) == 1 and p.reshape(p.shape[0], -1).t().is_contiguous()

    laid_out()
    shape = TreeShape.paper13()
    for seed in range(2):
        cache, eager = _pair(model)
        tokens = torch.randint(0, VOCAB, (2, shape.n), generator=torch.Generator().manual_seed(seed))
        want, _ = model.forward_tree(TokenTree.from_shape(shape, tokens), eager)
        got, _ = compiled.forward_tree(TokenTree.from_shape(shape, tokens), cache)
        assert (got - want).abs().max() <= 1e-5
        laid_out()
        with torch.no_grad():
            for p in params:
                p.data = p.data.contiguous()
    save(model, tmp_path)
    loaded = load(tmp_path)
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


def test_a_compiled_step_calls_no_batched_product(model):
    """A step's work beside its linear layers is elementwise (the conv's taps, the state update,
    the norms): Inductor fuses it into its own loops. The conv step as a batched product over the
    channels was an extern call in each layer, and its ``[dim, b]`` output left the loops after it
    reading strided."""
    cache, _ = _pair(model)
    compiled = CompiledModel.of(model)
    compiled.step(torch.tensor([5, 7]), cache)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        compiled.step(torch.tensor([5, 7]), cache)
    names = {e.key for e in prof.key_averages()}
    assert any(n.startswith("graph_0_cpp_fused") or "CompiledFxGraph" in n for n in names)  # (it ran compiled)
    assert not names & {"aten::bmm", "aten::baddbmm"}, sorted(names)


def test_each_compiled_model_has_its_own_graphs():
    """Two models of one config: each compiles its own step (no guard has to tell them apart),
    and each gives its own model's logits."""
    models = [FAMILIES["mamba2"](seed=s) for s in (5, 6)]
    tok = torch.tensor([3])
    for m in models:
        graphs = counters["stats"]["unique_graphs"]
        cache, eager = _pair(m, lengths=(4,))
        assert (CompiledModel.of(m).step(tok, cache) - m.step(tok, eager)).abs().max() <= 1e-5
        assert counters["stats"]["unique_graphs"] == graphs + 1


def test_every_batch_and_shape_is_compiled_once_past_dynamos_recompile_limit():
    """One process decoding several batch sizes with several tree sizes each: every pass gets a
    graph of its own (one shared copy of the function reached dynamo's limit of 8 at the ninth
    and ran the rest eager), and tokens given as a view (a draft cut to a prefix) compile nothing
    again. (A one-layer model: what is counted is graphs, and each costs its layers' kernels to build.)"""
    model = FAMILIES["mamba2"](seed=7, n_layer=1)
    compiled = CompiledModel(model)
    for batch in (1, 2, 3):
        cache = model.allocate_cache(batch, 16)
        for n in (1, 2, 3):
            tree = TokenTree.from_shape(TreeShape.chain(n), torch.randint(0, VOCAB, (batch, n + 1)))
            graphs = counters["stats"]["unique_graphs"]
            got, _ = compiled.forward_tree(tree, cache)
            assert counters["stats"]["unique_graphs"] == graphs + 1, (batch, n)
            assert (got - model.forward_tree(tree, cache)[0]).abs().max() <= 1e-5
            wide = torch.randint(0, VOCAB, (batch, n + 4))
            view = TokenTree.from_shape(TreeShape.chain(n), wide[:, : n + 1])
            got, _ = compiled.forward_tree(view, cache)
            assert counters["stats"]["unique_graphs"] == graphs + 1, (batch, n)
            assert (got - model.forward_tree(view, cache)[0]).abs().max() <= 1e-5


def test_a_compiled_call_guards_its_inputs_not_the_model(monkeypatch):
    """The guards a compiled call keeps read its inputs (tokens, the cache's tensors), every
    tensor's sizes and strides (the parameters' too) and the global state, not the model's modules
    nor module globals (most of a call's guard work); what they left out still reaches the graph:
    parameters changed in place or given new memory are read afresh, and a hybrid's cache of
    another length (its keys and values) compiles a graph of its own."""
    import stree.runtime.compiled as compiled_module

    kept, dropped = [], []

    def recording(entries):
        keep = compiled_module._inputs_only(entries)
        for entry, k in zip(entries, keep):
            (kept if k else dropped).append((entry.guard_type, entry.name))
        return keep

    monkeypatch.setattr(compiled_module, "_OPTIONS", {"guard_filter_fn": recording})
    model = FAMILIES["hybrid"](seed=8)
    compiled = CompiledModel(model)
    tok = torch.tensor([5, 7])

    def agree(length):
        cache, eager = _pair(model)
        if length != MAX_LENGTH:
            cache, eager = model.allocate_cache(2, length), model.allocate_cache(2, length)
        assert (compiled.step(tok, cache) - model.step(tok, eager)).abs().max() <= 1e-5
        _assert_same_state(cache, eager)

    agree(MAX_LENGTH)
    names = [name for _, name in kept]
    assert "tokens" in names and any(name.startswith("cache.") for name in names)
    assert any(kind == "TENSOR_MATCH" and name.startswith("model") for kind, name in kept)
    assert any(name.startswith("model") for _, name in dropped)
    assert not any(_READS_CODE.search(name) for kind, name in kept if kind != "TENSOR_MATCH")
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.05)
    agree(MAX_LENGTH)
    model.load_state_dict({k: v.clone() * 0.9 for k, v in model.state_dict().items()}, assign=True)
    agree(MAX_LENGTH)
    graphs = counters["stats"]["unique_graphs"]
    agree(2 * MAX_LENGTH)
    assert counters["stats"]["unique_graphs"] == graphs + 1


def test_a_parameter_of_other_strides_compiles_again_not_misread():
    """The graphs assert nothing about their inputs' sizes and strides (Inductor's per-call
    asserts are off): the parameters' guards do. A weight given the same values in another layout
    (column-major) fails its guard, and the call compiles a graph of its own that reads it right,
    where one reading it with the old strides would read its transpose."""
    model = FAMILIES["mamba2"](seed=11, n_layer=1)
    compiled = CompiledModel(model)
    tok = torch.tensor([5, 7])
    cache, eager = _pair(model)
    assert (compiled.step(tok, cache) - model.step(tok, eager)).abs().max() <= 1e-5
    weight = model.backbone.layers[0].mixer.out_proj.weight  # (the old strides read its memory in bounds, wrongly)
    with torch.no_grad():
        weight.data = weight.data.t().contiguous().t()
    graphs = counters["stats"]["unique_graphs"]
    assert (compiled.step(tok, cache) - model.step(tok, eager)).abs().max() <= 1e-5
    assert counters["stats"]["unique_graphs"] == graphs + 1
    _assert_same_state(cache, eager)


_READS_CODE = re.compile(r"\bmodel\b|G\[|\btype\(")  # a guard reading the model, a global or a class


def test_every_compiled_function_filters_its_guards(monkeypatch):
    """Not only the first function a process compiles: torch.compile pops the guard filter out of
    the options it is handed, and one dict shared by every compile gave it to the first alone (the
    others kept the model's, the globals' and the classes' guards: ~300 us a fused iteration). (The
    tensors' own guards are kept, the parameters' too: the previous test.)"""
    import stree.runtime.compiled as compiled_module

    filtered = []

    def recording(entries):
        keep = compiled_module._inputs_only(entries)
        filtered.append([(entry.guard_type, entry.name) for entry, k in zip(entries, keep) if k])
        return keep

    monkeypatch.setattr(compiled_module, "_OPTIONS", {"guard_filter_fn": recording})
    model = FAMILIES["mamba2"](seed=9, n_layer=1)
    compiled = CompiledModel(model)
    for batch in (1, 2):  # a step and a tree pass of each batch size: four functions of their own
        cache = model.allocate_cache(batch, 16)
        tok = torch.full((batch,), 5)
        assert (compiled.step(tok, cache.clone()) - model.step(tok, cache)).abs().max() <= 1e-5
        tree = TokenTree.from_shape(TreeShape.chain(2), torch.randint(0, VOCAB, (batch, 3)))
        assert (compiled.forward_tree(tree, cache)[0] - model.forward_tree(tree, cache)[0]).abs().max() <= 1e-5
    assert len(filtered) == 4
    for kept in filtered:
        assert ("TENSOR_MATCH", "tokens") in kept
        assert not any(_READS_CODE.search(name) for kind, name in kept if kind != "TENSOR_MATCH")
