"""A decoding pass of a CPU model (float32, float16 or bfloat16) calls its layers' numba kernels
bound to their parameters (stree.kernels.cpu.bound) in place of the checked public kernels: the
same logits and states bit for bit, parameters changed between passes read anew, and the public
kernels wherever the bound ones do not apply (gradients, a tree the tree kernels do not take, a
half norm that rounds before its weight)."""

import pytest
import torch
from tiny_models import FAMILIES, VOCAB, layer_by_layer

from stree.kernels.cpu import bound
from stree.kernels.cpu.tree_jit import JIT_MAX_NODES
from stree.models.layers.mamba2 import Mamba2Mixer
from stree.models.layers.norms import RMSNorm
from stree.tree import TokenTree, TreeShape


@pytest.fixture
def calls(monkeypatch):
    """How often a bound kernel ran, by name (steps and passes layer by layer: a Mamba2 model's as one
    call each are tests/models/test_fused_step.py's)."""
    layer_by_layer(monkeypatch)
    seen = {}
    for cls, names in ((bound.Mamba2LayerJit, ("tree", "step")), (bound.RMSNormJit, ("__call__",))):
        for name in names:
            real = getattr(cls, name)

            def counted(self, *a, _real=real, _name=name, **k):
                seen[_name] = seen.get(_name, 0) + 1
                return _real(self, *a, **k)
            monkeypatch.setattr(cls, name, counted)
    return seen


@pytest.fixture
def public(monkeypatch):
    """A switch: on, every layer takes the public kernels."""
    state = {"on": False}
    for cls in (Mamba2Mixer, RMSNorm):
        real = cls.bound
        monkeypatch.setattr(cls, "bound", lambda self, *a, _real=real: None if state["on"] else _real(self, *a))
    return state


def _passes(model, cache, gen):
    """Logits of a tree pass (13 nodes, two rows) and of two steps, and the states they leave."""
    tree = TokenTree.from_shape(TreeShape.from_spec("paper13"), torch.randint(0, VOCAB, (2, 13), generator=gen))
    logits, tree_pass = model.forward_tree(tree, cache)
    model.commit(cache, tree_pass, torch.tensor([[0, 1, 4], [0, 2, 0]]), torch.tensor([3, 2]))
    out = [logits]
    for _ in range(2):
        out.append(model.step(torch.randint(0, VOCAB, (2,), generator=gen), cache))
    return out + [t for t in (cache.conv, cache.ssm, cache.k, cache.v) if t is not None]


def _prefilled(model):
    cache = model.allocate_cache(2, 96)
    model.prefill(torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1)), cache)
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_decoding_pass_calls_the_bound_kernels_with_the_public_results(family, dtype, calls, public):
    """A half model's too: its activations rounded where the public kernels round theirs."""
    model = FAMILIES[family]().to(dtype)
    cache = _prefilled(model)
    other = cache.clone()
    got = _passes(model, cache, torch.Generator().manual_seed(2))
    assert calls["tree"] >= 1 and calls["step"] >= 2 and calls["__call__"] >= 3
    seen = dict(calls)
    public["on"] = True
    want = _passes(model, other, torch.Generator().manual_seed(2))
    assert calls == seen  # (none ran with the switch on)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_chain_pass_calls_the_bound_kernels_with_the_public_results(calls, public):
    """``scan="chain"`` (``method="chain"``'s passes) takes the bound layer too, its scan the chain's
    recurrence: the same logits and replay as the public kernels (``multistep_update``) bit for
    bit, and a commit from it leaves the same state."""
    model = FAMILIES["mamba2"]()
    results, seen = [], None
    for on in (False, True):
        public["on"] = on
        cache = _prefilled(model)
        chain = TokenTree.from_shape(TreeShape.chain(5), torch.randint(0, VOCAB, (2, 6),
                                                                       generator=torch.Generator().manual_seed(4)))
        logits, tree_pass = model.forward_tree(chain, cache, scan="chain")
        model.commit(cache, tree_pass, torch.tensor([[0, 1, 2, 3], [0, 1, 0, 0]]), torch.tensor([4, 2]))
        results.append((logits, cache.conv.clone(), cache.ssm.clone()))
        seen = calls.get("tree", 0) if seen is None else seen
    assert seen >= 1 and calls["tree"] == seen  # (one a layer with the bound kernels; none with the public)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_parameters_changed_between_passes_are_read_anew(public):
    model = FAMILIES["mamba2"]()
    cache = _prefilled(model)
    _passes(model, cache.clone(), torch.Generator().manual_seed(3))  # (binds every layer)
    mixer = model.blocks[0].mixer
    with torch.no_grad():
        mixer.dt_bias.add_(0.5)
        mixer.conv1d.weight.mul_(0.7)
        mixer.A_log.sub_(0.2)
        mixer.D.add_(0.3)
        mixer.norm.weight.mul_(1.5)
        model.blocks[1].norm.weight.add_(0.25)
        model.final_norm.weight.data = model.final_norm.weight.data * 1.1  # (new memory)
        mixer.conv1d.bias.data = mixer.conv1d.bias.data + 0.1  # (new memory, version 0)
    other = cache.clone()
    got = _passes(model, cache, torch.Generator().manual_seed(4))
    public["on"] = True
    want = _passes(model, other, torch.Generator().manual_seed(4))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_half_norms_rounding_first_gradients_and_long_trees_take_the_public_kernels(calls, public):
    """A half model's norms that round before their weight (HF Llama's, Nemotron-H's mixer norm)
    round where the bound kernels do not: the public kernels, their results."""
    model = FAMILIES["mamba2"]().to(torch.bfloat16)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.round_before_weight = True
    got = _passes(model, _prefilled(model), torch.Generator().manual_seed(5))
    assert calls == {}
    public["on"] = True
    want = _passes(model, _prefilled(model), torch.Generator().manual_seed(5))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    public["on"] = False
    model = FAMILIES["mamba2"]()
    cache = _prefilled(model)
    calls.clear()
    long = TokenTree.from_shape(TreeShape.chain(JIT_MAX_NODES), torch.randint(0, VOCAB, (2, 65)))
    model.forward_tree(long, cache)  # (a prompt's chain: the chain kernel, through the public scan)
    assert "tree" not in calls
    mixer, state = model.blocks[0].mixer, cache.layers[0]
    xBC = torch.zeros(2, 1, mixer.cfg.conv_dim)
    with torch.enable_grad():
        assert mixer.bound("auto", xBC, state) is None and model.blocks[0].norm.bound(xBC, torch.float32) is None
    with torch.no_grad():
        assert mixer.bound("triton", xBC, state) is None
        assert isinstance(mixer.bound("auto", xBC, state), bound.Mamba2LayerJit)


def test_a_shallow_tree_past_the_small_size_takes_the_bound_kernels_with_the_public_results(calls, public):
    """A tree of more than JIT_MAX_NODES nodes whose paths are short (85 nodes, depth 3) is the
    tree kernel's too: the bound one in a pass, with the public kernels' logits and scratch."""
    model = FAMILIES["mamba2"]()
    cache = _prefilled(model)
    shape = TreeShape.full(4, 3)
    assert shape.n > JIT_MAX_NODES
    tokens = torch.randint(0, VOCAB, (2, shape.n), generator=torch.Generator().manual_seed(6))
    tree = TokenTree.from_shape(shape, tokens)
    calls.clear()
    got, got_pass = model.forward_tree(tree, cache)
    assert calls["tree"] == model.kinds().count("ssm")
    public["on"] = True
    want, want_pass = model.forward_tree(tree, cache)
    assert torch.equal(got, want)
    assert all(torch.equal(getattr(got_pass.ssm, f), getattr(want_pass.ssm, f)) for f in ("xBC", "x", "dt", "B"))


def test_parametrized_parameters_are_read_through_their_parametrization(public):
    """The bound layers read their parameters from the modules' parameter dicts (cheaper than the
    attributes); one a parametrization keeps elsewhere is read through it: the same logits and
    states as the public kernels on the parametrized values."""
    from torch.nn.utils import parametrize

    class Scaled(torch.nn.Module):
        def forward(self, w):
            return 1.25 * w

    model = FAMILIES["mamba2"]()
    parametrize.register_parametrization(model.blocks[0].mixer, "dt_bias", Scaled())
    parametrize.register_parametrization(model.blocks[1].norm, "weight", Scaled())
    cache = _prefilled(model)
    other = cache.clone()
    got = _passes(model, cache, torch.Generator().manual_seed(7))
    public["on"] = True
    want = _passes(model, other, torch.Generator().manual_seed(7))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
