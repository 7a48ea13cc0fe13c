"""The decoding loop's parts, one at a time: one device-to-host read per step, the op budget of
verification plus bookkeeping, finished rows leaving the batch, SamplingParams."""

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from host_sync import count_host_syncs
from tiny_models import FAMILIES, VOCAB, assert_same_state, layer_by_layer

from stree.decoding.loop import autoregressive_step, decode, generate, speculative_step
from stree.tools.opcount import count_ops
from stree.tree import TokenTree, TreeShape
from stree.sampling.verify import SamplingParams

verify_module = sys.modules["stree.sampling.verify"]
pytestmark = pytest.mark.usefixtures("fixed_products")  # (op counts)

SHAPE = TreeShape.paper13()


def _ready(family, seed=0):
    model = FAMILIES[family]()
    cache = model.allocate_cache(2, 64)
    model.prefill(torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(seed)), cache)
    return model, cache


def _draft(seed, stochastic):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, SHAPE.n), generator=g)
    if not stochastic:
        return TokenTree.from_shape(SHAPE, tokens)
    ids = torch.randint(0, VOCAB, (2, SHAPE.n, 4), generator=g)
    return TokenTree.from_shape(SHAPE, tokens, child_ids=ids, child_probs=torch.rand(2, SHAPE.n, 4, generator=g))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("temperature, top_k", [(0.0, None), (0.0, 10), (1.0, 10)])
def test_a_speculative_step_reads_the_device_once(family, temperature, top_k, monkeypatch):
    """Tree pass, verification, commit and the emitted tokens (with the drafter's target laws):
    one transfer to the host, whatever the sampling rule (after a first step of the shape). The
    verification and replay of a device (the CPU's compiled walk and replay read host memory by
    design)."""
    monkeypatch.setattr(verify_module, "COMPILED_ON_CPU", False)
    model, cache = _ready(family)
    model.kernel_backend = "torch"  # the PyTorch replay, not the CPU's compiled one
    params = SamplingParams(temperature=temperature)
    gen = torch.Generator().manual_seed(0)
    speculative_step(model, cache, _draft(1, temperature > 0), params, gen, top_k=top_k)
    draft = _draft(2, temperature > 0)
    with count_host_syncs() as reads:
        host, result = speculative_step(model, cache, draft, params, gen, top_k=top_k)
    assert reads == ["Tensor.cpu"]
    assert torch.equal(host.counts, result.num_accepted)
    assert (host.top_ids is None) == (top_k is None)


def test_the_read_counter_spares_only_the_numpy_view_of_what_a_counted_read_brought():
    """The counter's one exemption (tests/host_sync.py): a step unpacks its one transfer on the
    host through NumPy. Another tensor's numpy view, and every other read, still count."""
    device, other = torch.arange(4), torch.arange(3)
    with count_host_syncs() as reads:
        device.cpu().numpy()
        other.numpy()
        int(other[0])
    assert reads == ["Tensor.cpu", "Tensor.numpy", "Tensor.__int__"]


@pytest.mark.parametrize("family", FAMILIES)
def test_an_autoregressive_step_reads_the_device_once(family, monkeypatch):
    monkeypatch.setattr(verify_module, "COMPILED_ON_CPU", False)  # (a device's path: the CPU's reads no device)
    model, cache = _ready(family)
    with count_host_syncs() as reads:
        host = autoregressive_step(model, cache, torch.tensor([1, 2]), SamplingParams(), None)
    assert reads == ["Tensor.cpu"] and host.tokens.shape == (2, 1)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("temperature, top_k", [(0.0, None), (0.0, 10), (1.0, 10)])
def test_on_the_cpu_a_step_hands_the_host_what_a_devices_transfer_would(family, temperature, top_k, monkeypatch):
    """The CPU's steps skip the packing for a transfer (and, greedy, verify in one compiled pass):
    the same HostStep, field by field and dtype, and the same verification, as the device path
    gives from the same cache; nothing is copied to the host, which holds it already. A tree
    step's target laws are the same where a drafter reads them (each row's first ``counts[b]``
    tokens; ids of equal probabilities would run in id order on the host, in torch's own on the
    device: these laws have none); the host computes none for the paths' padding, which it leaves 0.
    A Mamba2 model's greedy steps, plain and tree, compute their laws in their one call, their
    probabilities within float32 rounding of the device path's softmax."""
    params = SamplingParams(temperature=temperature)
    got = {}
    for on_host in (True, False):
        monkeypatch.setattr(verify_module, "COMPILED_ON_CPU", on_host)
        model, cache = _ready(family)
        gen = torch.Generator().manual_seed(0)
        # (the shape's first, on a copy: greedy, the host commits in one call, its replay rounding dt's sums
        # as the step does, and the states would part by an ulp)
        speculative_step(model, cache.clone(), _draft(4, temperature > 0), params, gen, top_k=top_k)
        with count_host_syncs() as reads:
            plain = autoregressive_step(model, cache, torch.tensor([1, 2]), params, gen, top_k=top_k)
            host, result = speculative_step(model, cache, _draft(5, temperature > 0), params, gen, top_k=top_k)
        assert reads.count("Tensor.cpu") == (0 if on_host else 2)  # (the host's own: numpy views of CPU tensors)
        got[on_host] = (plain, host, result.accepted, result.num_accepted, result.bonus)
    plain_step, tree_step = got[True][:2]
    real = torch.arange(tree_step.tokens.shape[1]) < tree_step.counts[:, None]
    for a, b in zip(got[True], got[False]):
        for name, x, y in (("", a, b),) if isinstance(a, torch.Tensor) else zip(vars(a), vars(a).values(),
                                                                                    vars(b).values()):
            assert (x is None) == (y is None)
            if x is None:
                continue
            assert x.dtype == y.dtype
            if a is plain_step and name in ("top_probs", "token_probs") and temperature == 0 and family == "mamba2":
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-9)  # (the one-call greedy step's softmax)
            elif a is tree_step and name in ("top_probs", "token_probs") and temperature == 0 and family == "mamba2":
                # (the one-call greedy iteration's softmax: its exp a polynomial's, within float32 rounding)
                torch.testing.assert_close(x[real], y[real], rtol=1e-5, atol=1e-9)
                assert not x[~real].any()
            elif a is tree_step and name in ("top_ids", "top_probs", "token_probs"):
                assert torch.equal(x[real], y[real]) and not x[~real].any()
            else:
                assert torch.equal(x, y)


class _ScoredTree:
    """A model stand-in that returns fixed logits: what is left to count is verification and the
    step's bookkeeping."""

    def __init__(self, logits):
        self.logits = logits

    def forward_tree(self, tree, cache, scan="tree", validate=True):
        return self.logits, None

    def commit(self, cache, tree_pass, accepted, num_accepted, validate=True):
        pass


@pytest.mark.parametrize("top_k", [None, 10])
@pytest.mark.parametrize("temperature, stochastic", [(0.0, False), (1.0, False), (1.0, True)],
                         ids=["greedy", "sampled-deterministic-drafts", "sampled-stochastic-drafts"])
def test_verification_and_bookkeeping_cost_at_most_40_ops(top_k, temperature, stochastic):
    """On the CPU: greedy verification, and sampled verification by the compiled walk."""
    tree = _draft(3, stochastic)
    stub = _ScoredTree(torch.randn(2, SHAPE.n, VOCAB, generator=torch.Generator().manual_seed(4)))
    gen = torch.Generator().manual_seed(0)
    ops = count_ops(lambda: speculative_step(stub, None, tree, SamplingParams(temperature=temperature), gen,
                                             top_k=top_k))
    assert ops.compute <= 40, ops


@pytest.mark.parametrize("batch", [1, 3])
def test_an_autoregressive_iteration_dispatches_at_most_10_ops_beyond_the_models_step(batch):
    """The loop's own work per plain step (the greedy choice, the host step, appending, the rows'
    flags and roots), counted in torch dispatches: the iterations of a longer call beyond a
    shorter one's, less the model's step. Each dispatch, a ``.numpy()`` (two here) or ``.tolist()``
    among them, costs microseconds right after a model pass has swept the caches: at 66 a step (14
    ``.numpy()`` calls, reductions of the rows' flags) the loop took a tenth of a plain step of the
    shipped target on the CPU beside the model, at 22 (the argmax its own compiled call, the
    counts' ones a torch op) the host's path around the step still about a third of the step. Now,
    the choice made in the step's call (``MambaStep.greedy``): three ``.numpy()`` and four arrays
    handed to torch, the step's choices, counts and flags among them."""
    model = FAMILIES["mamba2"]()
    prompts = torch.randint(0, VOCAB, (batch, 6), generator=torch.Generator().manual_seed(0))
    run = lambda n: count_ops(lambda: generate(model, prompts, max_new_tokens=n, method="autoregressive"))  # noqa: E731
    short, long = run(5), run(13)
    cache = model.allocate_cache(batch, 64)
    model.prefill(prompts, cache)
    roots = prompts[:, 0].clone()
    step = count_ops(lambda: model.step(roots, cache, validate=False))
    assert (long.total - short.total) / 8 - step.total <= 10, (long.by_name - short.by_name, step.by_name)


PROMPTS = [[1, 2, 3, 1, 2], [4, 5], [6, 7, 8, 6]]
BUDGETS = [3, 12, 7]  # the rows finish apart: the first, then the third


def _alone(model, budgets=BUDGETS):
    """Each prompt decoded alone to its budget."""
    return [generate(model, [p], method="autoregressive", max_new_tokens=m).sequences[0]
            for p, m in zip(PROMPTS, budgets)]


def _batch_sizes_seen(model, monkeypatch) -> list[int]:
    """The cache rows of every step, tree pass and one-call greedy step or iteration of ``model`` from
    now on (those that ran: a family without the greedy step's call takes a plain step instead)."""
    seen = []
    for name in ("step", "forward_tree", "greedy_tree", "greedy_step"):
        real = getattr(type(model), name)

        def spy(self, tokens, cache, *a, _real=real, **k):
            rows = cache.batch_size
            out = _real(self, tokens, cache, *a, **k)
            if out is not None:
                seen.append(rows)
            return out

        monkeypatch.setattr(type(model), name, spy)
    return seen


@pytest.mark.parametrize("tree", [TreeShape.chain(3), TreeShape.paper13()], ids=["chain3", "paper13"])
def test_greedy_trees_of_a_mamba2_model_take_the_one_call_iteration_and_decode_as_plain_steps(tree, monkeypatch):
    """Greedy decoding of a float32 Mamba2 model on the CPU: every tree's pass, verification and
    commit as one call (MambaStep.tree_greedy), no tree pass or commit of their own (nor has the
    prompts' prefill: one call, MambaStep.prefill), and each row's output the autoregressive one."""
    from stree.kernels.cpu import mamba_step

    if not mamba_step.available():
        pytest.skip("no C++ compiler for the CPU library here")
    model = FAMILIES["mamba2"]()
    alone = _alone(model)
    calls = {"tree_greedy": 0, "prefill": 0, "forward_tree": 0, "commit": 0}
    for owner, name in ((mamba_step.MambaStep, "tree_greedy"), (mamba_step.MambaStep, "prefill"),
                        (type(model), "forward_tree"), (type(model), "commit")):
        real = getattr(owner, name)

        def spy(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(owner, name, spy)
    out = generate(model, PROMPTS, method="stree", max_new_tokens=BUDGETS, tree=tree)
    assert out.sequences == alone
    trees = sum(count for n, count in out.stats.trees.items() if n > 1)
    assert trees > 0 and calls == {"tree_greedy": trees, "prefill": 1, "forward_tree": 0, "commit": 0}, \
        (calls, out.stats.trees)


@pytest.mark.parametrize("method", ["autoregressive", "stree"])
def test_greedy_plain_steps_of_a_mamba2_model_choose_their_tokens_in_the_step_call(method, monkeypatch):
    # (stree: tree="auto", its plain steps as many as this machine's choice takes)
    """Greedy, every plain step of a float32 Mamba2 model on the CPU is one call that also makes each
    row's choice (MambaStep.greedy): no argmax of its own on the host; the outputs are those of
    decoding with the host's argmax. Sampled steps take the same call for its finiteness flags (no
    sum and mask of the logits in torch) and keep the host's draw: the tokens of the step without it."""
    from stree.decoding import steps
    from stree.kernels.cpu import mamba_step

    if not mamba_step.available():
        pytest.skip("no C++ compiler for the CPU library here")
    model = FAMILIES["mamba2"]()
    calls = {"greedy": 0, "greedy_rows_host": 0}
    for owner, name in ((mamba_step.MambaStep, "greedy"), (steps, "greedy_rows_host")):
        real = getattr(owner, name)

        def spy(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(owner, name, spy)
    out = generate(model, PROMPTS, method=method, max_new_tokens=BUDGETS)
    plain = out.stats.trees.get(1, 0)
    # (stree: the choice's cost profile, measured on first use, steps the model too)
    exact = method == "autoregressive"
    assert calls["greedy_rows_host"] == 0 and (calls["greedy"] == plain > 0 if exact else calls["greedy"] >= plain), \
        (calls, out.stats.trees)
    calls["greedy"] = 0
    sampled = generate(model, PROMPTS, method="autoregressive", max_new_tokens=BUDGETS, temperature=1.0, seed=0)
    assert calls["greedy"] == sampled.stats.trees[1] > 0 and calls["greedy_rows_host"] == 0
    monkeypatch.undo()
    monkeypatch.setattr(type(model), "greedy_step", lambda *a, **k: None)  # (the host's argmax instead)
    assert generate(model, PROMPTS, method=method, max_new_tokens=BUDGETS).sequences == out.sequences
    assert generate(model, PROMPTS, method="autoregressive", max_new_tokens=BUDGETS, temperature=1.0,
                    seed=0).sequences == sampled.sequences


def test_a_greedy_plain_step_brings_a_drafters_laws_from_the_step_call():
    """A drafter learning from the target's laws (STAND's top 10) costs a greedy plain step of a
    float32 Mamba2 model on the CPU no torch op: the law comes from the step's one call
    (MambaStep.greedy), where its softmax, top-k and gather as torch ops had cost the shipped
    target's plain steps a sixth more; as the host's argmax (the model's greedy step withheld)."""
    from stree.kernels.cpu import mamba_step
    from stree.runtime.runners import EagerRunner

    if not mamba_step.available():
        pytest.skip("no C++ compiler for the CPU library here")
    model, cache = _ready("mamba2")
    runner, params, roots = EagerRunner(model, cache), SamplingParams(), torch.tensor([1, 2])
    counted = {k: count_ops(lambda k=k: autoregressive_step(model, cache, roots, params, None, runner, k))
               for k in (None, 10, None)}  # (the first None: the kept outputs' first use)
    with_laws, without = counted[10], counted[None]
    assert with_laws.total == without.total, (with_laws.by_name - without.by_name)
    host = autoregressive_step(model, cache, roots, params, None, runner, 10)
    assert host.top_ids.shape == (2, 1, 10) and torch.equal(host.top_ids[:, 0, 0], host.tokens[:, 0])


@pytest.mark.parametrize("method, temperature", [("autoregressive", 0.0), ("autoregressive", 1.0), ("stree", 0.0)],
                         ids=["greedy-steps", "sampled-steps", "greedy-trees"])
def test_a_decoding_call_looks_up_the_models_one_call_once(method, temperature, monkeypatch):
    """Each lookup of a Mamba2 model's one call (stree.models.fused_step) checks every parameter,
    about a twentieth of a plain step of the shipped target: a call's runner looks it up once, and
    its steps, greedy steps and greedy trees take it as it is: a longer call looks it up no more
    often than a shorter one."""
    from stree.kernels.cpu import mamba_step
    from stree.models import fused_step

    if not mamba_step.available():
        pytest.skip("no C++ compiler for the CPU library here")
    model = FAMILIES["mamba2"]()
    lookups, real = [0], fused_step._Plan.holds

    def counted(plan, m):
        lookups[0] += 1
        return real(plan, m)

    monkeypatch.setattr(fused_step._Plan, "holds", counted)
    options = dict(method=method, temperature=temperature, seed=0 if temperature else None)
    if method == "stree":
        options["tree"] = TreeShape.paper13()
    generate(model, PROMPTS[:1], max_new_tokens=4, **options)  # (the first call measures the choice's costs)
    seen = {}
    for n in (4, 16):
        lookups[0] = 0
        out = generate(model, PROMPTS[:1], max_new_tokens=n, **options)
        seen[n] = (lookups[0], sum(c for m, c in out.stats.trees.items() if m > 1))
    assert 0 < seen[16][0] == seen[4][0], seen
    assert method != "stree" or seen[16][1] > 0, seen


@pytest.mark.parametrize("method", ["autoregressive", "stree"])
def test_greedy_iterations_of_a_mamba2_model_allocate_no_tensor(method):
    """Greedy, a float32 Mamba2 model on the CPU: a decoding call's steps and one-call tree
    iterations write into outputs its runner keeps (MambaStep.reused) and advance the cache's
    lengths without a scalar tensor, so a longer call makes no more tensor allocations than a
    shorter one (the profiler's memory events: every allocation and every free)."""
    from torch.profiler import ProfilerActivity, profile

    from stree.kernels.cpu import mamba_step

    if not mamba_step.available():
        pytest.skip("no C++ compiler for the CPU library here")
    model = FAMILIES["mamba2"]()
    options = dict(method=method, tree=TreeShape.paper13() if method == "stree" else "auto")

    def allocations(n: int) -> tuple[int, dict]:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = generate(model, PROMPTS[:1], max_new_tokens=n, **options)
        return sum(e.name == "[memory]" for e in prof.events()), out.stats.trees

    allocations(4)  # (first use: the choice of products, numba's loads)
    (short, _), (long, trees) = allocations(4), allocations(20)
    assert method == "autoregressive" or sum(c for m, c in trees.items() if m > 1) > 0, trees
    assert long == short, (short, long, trees)


@pytest.mark.parametrize("family", FAMILIES)
def test_finished_rows_leave_the_eager_batch(family, monkeypatch):
    """Rows finishing at different steps leave the device batch: the target's steps and tree
    passes after a row finished run on the unfinished rows only (a finished row riding along cost
    the others its share of every step), and every row decodes as it does alone."""
    model = FAMILIES[family]()
    alone = _alone(model)
    for method in ("autoregressive", "stree"):
        seen = _batch_sizes_seen(model, monkeypatch)
        # (an explicit tree: no choice that earlier tests taught moves the steps where the rows finish)
        out = generate(model, PROMPTS, method=method, max_new_tokens=BUDGETS, tree=TreeShape.chain(2))
        assert out.sequences == alone, method
        assert seen[0] == 3 and seen == sorted(seen, reverse=True) and seen[-1] == 1, (method, seen)
        monkeypatch.undo()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["autoregressive", "stree"])
def test_a_given_cache_gets_every_rows_state_back_as_it_leaves(family, method):
    """decode(cache=...) with rows finishing apart: the caller's cache ends holding the state of
    every row, those that left early included (riding along, they had lost it): decoding on from
    it continues each row the output calls exact as one uninterrupted run (autoregressive: all)."""
    model = FAMILIES[family]()
    cache = model.allocate_cache(3, 64)
    for r, p in enumerate(PROMPTS):  # each row's state after all its prompt tokens but the last
        one = model.allocate_cache(1, 64)
        model.prefill(torch.tensor([p[:-1]]), one)
        cache.assign(torch.tensor([r]), one)
    out = generate(model, PROMPTS, cache=cache, method=method, max_new_tokens=BUDGETS)
    assert out.sequences == _alone(model)
    if method == "autoregressive":
        assert out.exact == [True] * 3
    exact = [r for r in range(3) if out.exact[r]]
    if not exact:  # (every row cut inside an accepted path: nothing to continue)
        return
    more = generate(model, [out.sequences[r] for r in exact], cache=cache.select(torch.tensor(exact)),
                    method="autoregressive", max_new_tokens=4)
    whole = _alone(model, [m + 4 for m in BUDGETS])
    assert more.sequences == [whole[r] for r in exact]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_given_cache_holds_every_row_when_the_consumer_stops_early(family):
    """A consumer that stops reading decode's steps after a row left the batch (closing the
    generator): the caller's cache still holds every row's state after its tokens so far."""
    model = FAMILIES[family]()
    cache = model.allocate_cache(3, 64)
    for r, p in enumerate(PROMPTS):
        one = model.allocate_cache(1, 64)
        model.prefill(torch.tensor([p[:-1]]), one)
        cache.assign(torch.tensor([r]), one)
    steps = decode(model, PROMPTS, cache=cache, method="autoregressive", max_new_tokens=BUDGETS)
    for rows in steps:
        if int(rows.produced[2]) == 5:  # the first row left two steps ago, the others decode on
            break
    steps.close()
    now = [rows.seq[r, : int(rows.lengths[r])].tolist() for r in range(3)]
    assert not bool(rows.active[0]) and bool(rows.active[1:].all())
    more = generate(model, now, cache=cache, method="autoregressive", max_new_tokens=3)
    assert more.sequences == [generate(model, [s], method="autoregressive", max_new_tokens=3).sequences[0]
                              for s in now]


def test_sampling_params_are_checked_once_and_shared():
    with pytest.raises(ValueError, match="temperature must be a number >= 0"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="mode must be one of"):
        SamplingParams(mode="fast")
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy
    with pytest.raises(ValueError, match="greedy decoding"):
        SamplingParams().probs(torch.zeros(1, 3))
    logits = torch.tensor([[0.0, 1.0, 3.0]])
    assert torch.allclose(SamplingParams().observed(logits), torch.softmax(logits, -1))  # drafters learn the softmax
    model = FAMILIES["mamba2"]()
    kw = dict(max_new_tokens=6, seed=3)
    a = generate(model, [[1, 2, 3]], sampling=SamplingParams(temperature=0.8, top_k=5), **kw)
    b = generate(model, [[1, 2, 3]], temperature=0.8, top_k=5, **kw)
    assert a.sequences == b.sequences
    with pytest.raises(TypeError, match="sampling must be a SamplingParams"):
        generate(model, [[1]], sampling={"temperature": 1.0}, max_new_tokens=2)


def _followed(model, cache, seed=0):
    """A draft of SHAPE whose first children follow the target's greedy choices (so a path of
    several nodes is accepted), with one later sibling invalid."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, SHAPE.n), generator=g)
    kids = SHAPE.children()
    for _ in range(SHAPE.max_depth):
        logits, _ = model.forward_tree(TokenTree.from_shape(SHAPE, tokens), cache.clone())
        best = logits.argmax(-1)
        for v, children in enumerate(kids):
            if children:
                tokens[:, children[0]] = best[:, v]
    valid = torch.ones(2, SHAPE.n, dtype=torch.bool)
    valid[1, kids[0][-1]] = False
    return TokenTree.from_shape(SHAPE, tokens, valid=valid)


@pytest.mark.parametrize("family, top_k", [(f, None) for f in FAMILIES] + [("mamba2", 0), ("mamba2", 3)])
def test_the_compiled_greedy_iteration_equals_the_eager_step(family, top_k, monkeypatch):
    """Compiled decoding runs a greedy step's tree pass, verification and what the host reads as one
    graph, whose outputs the host takes as they are (nothing packed and unpacked, as for a GPU's
    transfer): the same accepted paths, emitted tokens, target laws and committed state as the eager
    step (the eager calls layer by layer: a float32 Mamba2 model's one-call pass skips the graph)."""
    from unittest import mock

    layer_by_layer(monkeypatch)
    from stree.decoding import steps
    from stree.runtime import CompiledDecode

    model, eager = _ready(family)
    runner = CompiledDecode(model, 2, 64)
    runner.cache.assign(torch.arange(2), eager)
    draft = _followed(model, eager)
    params = SamplingParams(0.0)
    want, want_result = speculative_step(model, eager, draft, params, None, top_k=top_k)
    with mock.patch.object(steps, "unpack", side_effect=AssertionError("unpacked on the host")):
        got, result = speculative_step(model, runner.cache, draft, params, None, top_k=top_k, runner=runner)
    assert [name for _, name in runner._fused] == ["greedy"]  # the fused path ran
    assert int(want_result.num_accepted.max()) >= 3  # (the draft is followed: a long path to compare)
    for a, b in ((result.accepted, want_result.accepted), (result.num_accepted, want_result.num_accepted),
                 (result.bonus, want_result.bonus), (got.tokens, want.tokens), (got.counts, want.counts),
                 (got.finite, want.finite)):
        assert torch.equal(a, b)
    if top_k is not None:
        assert torch.equal(got.top_ids, want.top_ids)
        torch.testing.assert_close(got.top_probs, want.top_probs)
        torch.testing.assert_close(got.token_probs, want.token_probs)
    else:
        assert got.top_ids is None
    assert_same_state(runner.cache, eager)


@settings(max_examples=40, deadline=None)
@given(batch=st.integers(1, 3), nodes=st.integers(1, 6), vocab=st.integers(1, 40), k=st.integers(0, 50),
       ties=st.booleans(), seed=st.integers(0, 999), data=st.data())
def test_the_hosts_path_laws_are_the_top_entries_of_each_real_path_node(batch, nodes, vocab, k, ties, seed, data):
    """``_path_laws`` (the CPU's laws along the accepted paths, compiled): at each row's first
    ``num[b]`` path nodes the law's ``k`` largest probabilities in torch.topk's values, their ids
    holding them (where values tie, the lower id first; elsewhere torch's ids), the emitted token's
    own probability; zeros past the paths. ``k`` 0 (``logprobs=0``): the own probabilities alone."""
    from stree.decoding.steps import _path_laws

    g = torch.Generator().manual_seed(seed)
    x = torch.rand(batch, nodes, vocab, generator=g)
    if ties:  # (equal values, and an underflowed law's zeros)
        x = (x * 4).floor() / 4
    num = torch.tensor([data.draw(st.integers(1, nodes)) for _ in range(batch)])
    accepted = torch.randint(0, nodes, (batch, nodes), generator=g)
    accepted[:, 0] = 0
    tokens = torch.randint(0, vocab, (batch, nodes), generator=g)
    ids, probs, own = _path_laws(x, accepted, num, tokens, k)
    kk = min(k, vocab)
    assert ids.shape == probs.shape == (batch, nodes, kk) and own.shape == (batch, nodes)
    for b in range(batch):
        for t in range(nodes):
            if t >= int(num[b]):
                assert not ids[b, t].any() and not probs[b, t].any() and own[b, t] == 0
                continue
            law = x[b, int(accepted[b, t])]
            want = torch.topk(law, kk)
            assert torch.equal(probs[b, t], want.values) and own[b, t] == law[tokens[b, t]]
            assert torch.equal(law[ids[b, t]], probs[b, t]) and len(set(ids[b, t].tolist())) == kk
            for j in range(kk - 1):  # equal values in id order
                assert probs[b, t, j] > probs[b, t, j + 1] or ids[b, t, j] < ids[b, t, j + 1]
            if len(set(law.tolist())) == vocab:
                assert torch.equal(ids[b, t], want.indices)


def test_sampled_logits_are_masked_only_where_a_position_is_not_finite():
    """On the CPU finite logits go to the draw as they are (no masked copy); a position holding NaN
    or +inf is zeroed and flagged, the others untouched; greedy logits are never masked."""
    from stree.decoding.steps import _finite

    logits = torch.randn(3, 2, 7, generator=torch.Generator().manual_seed(0))
    finite, out = _finite(logits, SamplingParams(0.6))
    assert out is logits and bool(finite.all())
    logits[1, 0, 3], logits[2, 1, 0] = float("nan"), float("inf")
    finite, out = _finite(logits, SamplingParams(0.6))
    assert finite.tolist() == [[True, True], [False, True], [True, False]]
    assert bool((out[1, 0] == 0).all()) and bool((out[2, 1] == 0).all())
    assert torch.equal(out[0], logits[0]) and torch.equal(out[1, 1], logits[1, 1]) and torch.equal(out[2, 0], logits[2, 0])
    assert _finite(logits, SamplingParams(0.0))[1] is logits
