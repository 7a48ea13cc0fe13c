"""A half (float16, bfloat16) Mamba2 model's step, prefill, tree pass and greedy iteration as one call
each (stree.models.fused_step, stree.kernels.cpu.mamba_step): they apply, every logit they hand on
holds a value of the model's dtype, and they agree with the block-by-block calls, and a tree pass with
the steps along each node's path, to the dtype's rounding (a tree's scan sums in another order than a
step's state update); a prefill is its tokens stepped bit for bit, and a greedy iteration its own
pass, verification and commit. (Its drafts: tests/models/test_fused_draft.py.)"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import trees
from tiny_models import VOCAB, count_calls, layer_by_layer, mamba2, with_biases

from stree.kernels.cpu import mamba_step
from stree.models import fused_step as fused_step_module
from stree.models.fused_step import fused_draft, fused_step
from stree.sampling.verify import verify_greedy_host
from stree.tree import TokenTree, TreeShape

pytestmark = pytest.mark.skipif(not mamba_step.available(), reason="no C++ compiler for the CPU library here")

LAYOUTS = {"float32 residual": dict(),
           "half residual, one group, biases, gate last": dict(residual_in_fp32=False, ngroups=1, bias=True,
                                                               gate_norm="gate_last")}
MODELS = {(dtype, layout): with_biases(mamba2(**kw)).to(dtype)
          for dtype in (torch.float16, torch.bfloat16) for layout, kw in LAYOUTS.items()}


def _counted(monkeypatch, name: str) -> list:
    return count_calls(monkeypatch, mamba_step.MambaStep, name)


def _assert_rounded_and_near(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """``got`` (float32, or a prefill's of ``dtype``) holds values of ``dtype``, most of them ``want``'s
    exactly, every one within two of the dtype's steps of it (a product or SiLU summed in another order
    can round the other way)."""
    want = want.float()
    assert got.dtype in (torch.float32, dtype)
    got = got.float()
    assert torch.equal(got, got.to(dtype).float())
    assert (got - want).abs().le(2 * torch.finfo(dtype).eps * want.abs().clamp(min=1)).all()
    assert got.eq(want).float().mean() > 0.9


def _one_call(model, cache):
    with torch.no_grad():
        return fused_step(model, cache, None, "auto")


@pytest.mark.parametrize("key", sorted(MODELS, key=str), ids=str)
def test_a_half_models_prefill_and_steps_are_one_call_near_the_blockwise_ones(key, monkeypatch):
    dtype, _ = key
    model = MODELS[key]
    ids = torch.randint(0, VOCAB, (2, 70), generator=torch.Generator().manual_seed(1))
    steps = torch.randint(0, VOCAB, (6, 2), generator=torch.Generator().manual_seed(2))
    prefills, stepped = _counted(monkeypatch, "prefill"), _counted(monkeypatch, "_step")
    cache, other = model.allocate_cache(2, 96), model.allocate_cache(2, 96)
    got = [model.prefill(ids, cache)] + [model.step(t, cache) for t in steps]
    assert prefills[0] == 1 and stepped[0] == 6 and cache.conv.dtype == dtype
    layer_by_layer(monkeypatch)
    want = [model.prefill(ids, other)] + [model.step(t, other) for t in steps]
    assert prefills[0] == 1 and stepped[0] == 6
    for a, b in zip(got, want):
        _assert_rounded_and_near(a, b, dtype)
    torch.testing.assert_close(cache.conv.float(), other.conv.float(), atol=0.05, rtol=4 * torch.finfo(dtype).eps)
    torch.testing.assert_close(cache.ssm, other.ssm, atol=0.05, rtol=4 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("key", sorted(MODELS, key=str), ids=str)
def test_a_half_models_prefill_is_its_tokens_stepped_bit_for_bit(key):
    model = MODELS[key]
    lengths = [70, 3]
    ids = torch.randint(0, VOCAB, (2, 70), generator=torch.Generator().manual_seed(3))
    cache = model.allocate_cache(2, 96)
    got = model.prefill(ids, cache, lengths=torch.tensor(lengths))
    step = _one_call(model, cache)
    for row, n in enumerate(lengths):
        fresh = model.allocate_cache(1, 96)
        for t in range(n):
            want = step(ids[row, t: t + 1].contiguous(), fresh.conv, fresh.ssm)
        assert torch.equal(got[row], want[0])
        assert torch.equal(cache.conv[:, row], fresh.conv[:, 0]) and torch.equal(cache.ssm[:, row], fresh.ssm[:, 0])


def _path(parents: list[int], v: int) -> list[int]:
    path = [v]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@settings(max_examples=30, deadline=None)
@given(data=st.data(), key=st.sampled_from(sorted(MODELS, key=str)))
def test_a_half_models_tree_pass_and_greedy_iteration_are_its_steps_along_each_path(data, key):
    """Random trees: the one-call pass's logits at every node are near the one-call steps' along the
    node's path from the row's state, and the layer-by-layer pass's; a greedy iteration over a draft
    that mostly follows them is the pass, greedy verification and commit: its path, emitted tokens
    and the logits at its path nodes exactly, its states within float32 rounding (the commit's
    replay takes the softplus in float32, the one call in double)."""
    dtype, _ = key
    model = MODELS[key]
    parents, batch = data.draw(trees(max_n=12))
    n = parents.shape[-1]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    cache = model.allocate_cache(batch, 64)
    model.prefill(torch.randint(0, VOCAB, (batch, 5), generator=gen), cache)
    tree = TokenTree(parents, torch.randint(0, VOCAB, (batch, n), generator=gen))
    with pytest.MonkeyPatch.context() as m:
        passes = _counted(m, "tree")
        logits, _ = model.forward_tree(tree, cache.clone())
        assert passes[0] == 1
        layer_by_layer(m)
        _assert_rounded_and_near(logits, model.forward_tree(tree, cache.clone())[0], dtype)
    step, rows = _one_call(model, cache), parents.expand(batch, n).tolist()
    stepped = torch.empty_like(logits)
    for r in range(batch):
        for v in range(n):
            conv, ssm = cache.conv[:, r: r + 1].clone(), cache.ssm[:, r: r + 1].clone()
            for u in _path(rows[r], v):
                stepped[r, v] = step(tree.tokens[r, u: u + 1].contiguous(), conv, ssm)[0]
    _assert_rounded_and_near(logits, stepped, dtype)
    # a draft whose child follows its parent's choice mostly: paths that go deep
    choice = logits.argmax(-1).gather(1, parents.expand(batch, n).clamp(min=0))
    follow = torch.rand(batch, n, generator=gen) < 0.7
    draft = TokenTree(parents, torch.where(follow, choice, tree.tokens))
    after, other = cache.clone(), cache.clone()
    with pytest.MonkeyPatch.context() as m:
        iterations = _counted(m, "tree_greedy")
        got = model.greedy_tree(draft, after)
        assert iterations[0] == 1
    logits, tree_pass = model.forward_tree(draft, other)
    result, emitted, finite = verify_greedy_host(draft, logits)
    model.commit(other, tree_pass, result.accepted, result.num_accepted)
    for a, b in zip(got[1:6], (result.accepted, result.num_accepted, result.bonus, emitted, finite)):
        assert torch.equal(a, b)
    real = torch.arange(emitted.shape[1]) < result.num_accepted[:, None]
    rows_of = torch.arange(batch)[:, None].expand_as(result.accepted)
    at = rows_of[real], result.accepted[real]
    assert torch.equal(got[0][at], logits[at])
    assert torch.equal(after.conv, other.conv) and torch.equal(after.seqlens, other.seqlens)
    torch.testing.assert_close(after.ssm, other.ssm, atol=2e-5, rtol=2e-5)


def test_a_half_model_whose_norms_round_before_their_weight_or_whose_conv_states_are_float32_steps_by_blocks():
    tokens = torch.tensor([3, 4])
    rounding = mamba2(norm_round_before_weight=True).to(torch.float16)
    with torch.no_grad():
        assert fused_step(rounding, rounding.allocate_cache(2, 8), tokens, "auto") is None
        model = MODELS[torch.float16, "float32 residual"]
        cache = model.allocate_cache(2, 8)
        assert fused_step(model, cache, tokens, "auto") is not None
        cache.conv = cache.conv.float()
        assert fused_step(model, cache, tokens, "auto") is None


def test_a_draft_whose_node_slots_are_of_another_dtype_than_the_cache_is_not_one_call():
    """(The call reads every conv state as the cache's dtype: slots of another would be misread.)"""
    model = MODELS[torch.float16, "float32 residual"]
    cache = model.allocate_cache(1, 64)
    args = (torch.tensor([[5]]), np.array([1], dtype=np.int64), np.array([-1, 0, 1], dtype=np.int64))
    with torch.no_grad():
        nodes = model.allocate_cache(3, 64)
        assert fused_draft(model, cache.clone(), *args, nodes, None, None, None, "auto") is not None
        nodes.conv = nodes.conv.float()
        assert fused_draft(model, cache.clone(), *args, nodes, None, None, None, "auto") is None


def _without_half_packs(monkeypatch, model) -> None:
    """The model's one call made anew with its products' weights packed as float32 alone (no half packs)."""
    layer, step = mamba_step.MambaLayer.__init__, mamba_step.MambaStep.__init__
    monkeypatch.setattr(mamba_step.MambaLayer, "__init__", lambda self, *a, half=None, **k: layer(self, *a, **k))
    monkeypatch.setattr(mamba_step.MambaStep, "__init__", lambda self, *a, head_half=None, **k: step(self, *a, **k))
    model.__dict__.pop("_stree_fused_step", None)


@pytest.mark.parametrize("key", sorted(MODELS, key=str), ids=str)
def test_a_half_models_products_read_half_packs_for_few_rows_with_the_float32_packs_sums(key, monkeypatch):
    """A half model's one call packs its products' weights in its dtype too, and its products of up to eight
    rows (a step of one or two rows, a pass of two nodes, a draft's levels, an iteration's head waves) read
    them: every output and state the same bits as with the float32 packs alone."""
    dtype, _ = key
    model = MODELS[key]
    gen = torch.Generator().manual_seed(11)
    prompt, steps = torch.randint(0, VOCAB, (2, 9), generator=gen), torch.randint(0, VOCAB, (3, 2), generator=gen)
    pair = TokenTree(torch.tensor([-1, 0]), torch.randint(0, VOCAB, (1, 2), generator=gen))
    tree = TokenTree(torch.tensor([-1, 0, 0, 1, 1]), torch.randint(0, VOCAB, (2, 5), generator=gen))
    shape = TreeShape([-1, 0, 0, 1])

    def run():
        with torch.no_grad():
            cache = model.allocate_cache(2, 64)
            out = [model.prefill(prompt, cache)] + [model.step(t, cache) for t in steps]
            one = model.allocate_cache(1, 64)
            out += [model.prefill(prompt[:1], one), model.step(steps[0, :1], one)]
            out += [model.forward_tree(pair, one.clone())[0], model.greedy_tree(pair, one.clone())[1]]
            out += [model.forward_tree(tree, cache.clone())[0], *model.greedy_tree(tree, cache)[1:6]]
            nodes = model.allocate_cache(shape.n, 64)
            out += [*model.draft_greedy(steps[0, :1, None].contiguous(), np.ones(1, dtype=np.int64), shape, one, nodes),
                    cache.conv, cache.ssm, one.conv, one.ssm, nodes.conv, nodes.ssm]
            return out

    model.__dict__.pop("_stree_fused_step", None)
    with torch.no_grad():
        step = fused_step(model, model.allocate_cache(1, 8), None, "auto")
    assert step.head_h.dtype == dtype and all(layer.arrays["in_h"].dtype == dtype for layer in step.layers)
    got = run()
    _without_half_packs(monkeypatch, model)
    with torch.no_grad():
        assert fused_step(model, model.allocate_cache(1, 8), None, "auto").head_h is None
    want = run()
    for a, b in zip(got, want, strict=True):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    model.__dict__.pop("_stree_fused_step", None)


def test_half_packs_of_some_products_alone_or_of_another_dtype_are_refused(monkeypatch):
    """(The call reads every half pack as the model's dtype: a layer without one, or a pack of the other half
    dtype, would be misread.)"""
    model = MODELS[torch.float16, "float32 residual"]
    layer = mamba_step.MambaLayer.__init__
    monkeypatch.setattr(mamba_step.MambaLayer, "__init__", lambda self, *a, half=None, **k: layer(self, *a, **k))
    model.__dict__.pop("_stree_fused_step", None)
    with torch.no_grad(), pytest.raises(TypeError, match="half"):
        fused_step(model, model.allocate_cache(1, 8), None, "auto")
    monkeypatch.setattr(mamba_step.MambaLayer, "__init__", lambda self, *a, half=None, **k: layer(
        self, *a, **k, half=None if half is None else tuple(t.to(torch.bfloat16) for t in half)))
    model.__dict__.pop("_stree_fused_step", None)
    with torch.no_grad(), pytest.raises(TypeError, match="half"):
        fused_step(model, model.allocate_cache(1, 8), None, "auto")
    model.__dict__.pop("_stree_fused_step", None)


def test_a_half_models_products_of_up_to_eight_rows_read_the_half_packs_alone(monkeypatch):
    """In decoding the float32 packs come cold (the steps read the half packs), so a half model's products of
    up to 8 rows read the half packs (mamba_step.HALF_ROWS, the layout's default), more rows the float32 ones:
    with the float32 packs poisoned (NaN), steps at batch 1 and 2 and a greedy iteration of an 8-node tree at
    batch 1 are what they are unpoisoned, and a pass of 9 nodes reads NaN; with ``half_rows`` past 9 (as
    measure_half_rows may set it) that pass reads the half packs alone, the same sums as unpoisoned."""
    model = MODELS[torch.float16, "float32 residual"]
    gen = torch.Generator().manual_seed(5)
    prompt, steps = torch.randint(0, VOCAB, (2, 12), generator=gen), torch.randint(0, VOCAB, (2, 2), generator=gen)
    eight = TokenTree(torch.tensor([-1, 0, 0, 1, 1, 2, 3, 3]), torch.randint(0, VOCAB, (1, 8), generator=gen))
    nine = TokenTree(torch.tensor([-1, 0, 0, 1, 1, 2, 3, 3, 4]), torch.randint(0, VOCAB, (1, 9), generator=gen))
    with torch.no_grad():
        cache = model.allocate_cache(2, 64)
        model.prefill(prompt, cache)

    def run():
        with torch.no_grad():
            two, one = cache.clone(), model.allocate_cache(1, 64)
            one.conv.copy_(cache.conv[:, :1]), one.ssm.copy_(cache.ssm[:, :1])
            one.seqlens.copy_(cache.seqlens[:1])
            out = [model.step(t, two) for t in steps] + [model.step(steps[0, :1], one)]
            out += [*model.greedy_tree(eight, one.clone())[1:6], model.forward_tree(nine, one.clone())[0]]
            return out

    want = run()
    model.__dict__.pop("_stree_fused_step", None)
    real = fused_step_module._pack
    monkeypatch.setattr(fused_step_module, "_pack", lambda w: real(w) if w.dtype != torch.float32
                        else torch.full_like(real(w), float("nan")))
    got = run()
    with torch.no_grad():
        fused_step(model, model.allocate_cache(1, 8), None, "auto").half_rows = 9
    wider = run()
    model.__dict__.pop("_stree_fused_step", None)
    for a, b in zip(got[:-1], want[:-1], strict=True):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    assert want[-1].isfinite().all() and got[-1].isnan().all()
    for a, b in zip(wider, want, strict=True):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))


def test_the_half_packs_rows_are_measured_once_per_step_where_the_model_has_them(monkeypatch):
    """measure_half_rows times a plain step and a 16-node pass with each choice (the default, or the half
    packs for every row count) and sets the faster on the model's step, once per step made (a second
    call times nothing; a step made again, its parameters changed, is measured again); a float32 model,
    which has no half packs, is left alone; a bad value is refused."""
    model = MODELS[torch.float16, "float32 residual"]
    model.__dict__.pop("_stree_fused_step", None)
    passes = _counted(monkeypatch, "tree")
    rows = fused_step_module.measure_half_rows(model)
    with torch.no_grad():
        step = fused_step(model, model.allocate_cache(1, 8), None, "auto")
    assert rows in (mamba_step.HALF_ROWS, 1 << 30) and step.half_rows == rows
    assert passes[0] == 2 * (fused_step_module.HALF_ROWS_ROUNDS + 1)
    assert fused_step_module.measure_half_rows(model) == rows and passes[0] == 2 * (fused_step_module.HALF_ROWS_ROUNDS + 1)
    model.__dict__.pop("_stree_fused_step", None)  # (as a changed parameter makes the step again)
    with torch.no_grad():
        assert fused_step(model, model.allocate_cache(1, 8), None, "auto").half_rows == mamba_step.HALF_ROWS
    fused_step_module.measure_half_rows(model)
    assert passes[0] == 4 * (fused_step_module.HALF_ROWS_ROUNDS + 1)
    model.__dict__.pop("_stree_fused_step", None)
    assert fused_step_module.measure_half_rows(with_biases(mamba2())) is None and passes[0] == 4 * (
        fused_step_module.HALF_ROWS_ROUNDS + 1)
    with pytest.raises(ValueError, match="half_rows"):
        step.half_rows = -1
