"""The mixture-of-experts feed-forward: the grouped-matmul path against the float64 definition
(each token through its own top-k experts, written out here as a loop), and the module's checks."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stree.models.layers.moe import (GroupedMoE, TopKMoE, experts_grouped, experts_reference, grouped_mm_fits,
                                     route_grouped_sigmoid, route_softmax)


def moe_grouped(x, router, gate_up, down, top_k):
    return experts_grouped(x, *route_softmax(x, router, top_k), gate_up, down, "silu_gated")


def moe_reference(x, router, gate_up, down, top_k):
    return experts_reference(x, *route_softmax(x, router, top_k), gate_up, down, "silu_gated")


def definition(x, router, gate_up, down, top_k):
    """float64, one token and one expert at a time."""
    x, router, gate_up, down = (t.double() for t in (x, router, gate_up, down))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        logits = router @ x[t]
        top = logits.topk(top_k)
        weights = top.values.softmax(0)
        for w, e in zip(weights, top.indices):
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += w * (down[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def _weights(seed, tokens, experts, d, inter):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, d, generator=g), torch.randn(experts, d, generator=g),
            torch.randn(experts, 2 * inter, d, generator=g) / d ** 0.5, torch.randn(experts, d, inter, generator=g) / inter ** 0.5)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(1, 70), experts=st.integers(1, 9), d=st.sampled_from([8, 16, 32]),
       inter=st.sampled_from([4, 8, 24]), data=st.data())
def test_grouped_path_equals_the_definition(seed, tokens, experts, d, inter, data):
    top_k = data.draw(st.integers(1, experts))
    args = _weights(seed, tokens, experts, d, inter)
    want = definition(*args, top_k)
    for fn in (moe_grouped, moe_reference):
        got = fn(*args, top_k)
        assert (got.double() - want).abs().max() < 1e-4 * (1 + want.abs().max()), fn.__name__


def test_bf16_grouped_path_equals_the_reference_path():
    args = [t.bfloat16() for t in _weights(1, 40, 8, 32, 16)]
    assert torch.equal(moe_grouped(*args, 3), moe_reference(*args, 3))


def test_module_uses_the_reference_where_rows_are_not_16_byte_multiples():
    assert grouped_mm_fits(32, 8, torch.float32) and not grouped_mm_fits(30, 8, torch.float32)
    assert not grouped_mm_fits(32, 8, torch.float32, "meta")
    assert not grouped_mm_fits(32, 12, torch.bfloat16)
    torch.manual_seed(0)
    moe = TopKMoE(30, 5, 2, 6)
    x = torch.randn(2, 7, 30)
    want = definition(x.reshape(-1, 30), moe.router.layer.weight, moe.input_linear.weight, moe.output_linear.weight, 2)
    assert (moe(x).reshape(-1, 30).double() - want).abs().max() < 1e-4


def test_top_k_is_checked():
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, 4 experts\], got 5"):
        TopKMoE(16, 4, 5, 8)
    with pytest.raises(ValueError, match="topk_group 1 groups"):
        GroupedMoE(16, 8, 3, 8, 8, n_group=4, topk_group=1)


def grouped_sigmoid_definition(x, router, bias, top_k, n_group, topk_group, normalize, scale):
    """float64, one token at a time: groups ranked by their two best biased scores, experts by
    biased score within the kept groups, weights from the unbiased scores."""
    x, router, bias = x.double(), router.double(), bias.double()
    E = router.shape[0]
    size = E // n_group
    out_w = []
    for t in range(x.shape[0]):
        scores = torch.sigmoid(router @ x[t])
        biased = scores + bias
        group_score = [sorted(biased[g * size:(g + 1) * size].tolist())[-2:] for g in range(n_group)]
        kept = sorted(range(n_group), key=lambda g: -sum(group_score[g]))[:topk_group]
        allowed = [e for e in range(E) if e // size in kept]
        chosen = sorted(allowed, key=lambda e: -float(biased[e]))[:top_k]
        w = scores[chosen]
        if normalize:
            w = w / w.sum()
        out_w.append(sorted(zip(chosen, (w * scale).tolist())))
    return out_w


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(1, 20), groups=st.sampled_from([(1, 1), (2, 1), (4, 2), (4, 4)]),
       top_k=st.integers(1, 3), normalize=st.booleans())
def test_grouped_sigmoid_routing_equals_the_definition(seed, tokens, groups, top_k, normalize):
    n_group, topk_group = groups
    g = torch.Generator().manual_seed(seed)
    E, d = 8, 16
    x, router, bias = torch.randn(tokens, d, generator=g), torch.randn(E, d, generator=g), torch.randn(E, generator=g)
    top_k = min(top_k, topk_group * E // n_group)
    weights, experts = route_grouped_sigmoid(x, router, bias, top_k, n_group, topk_group, normalize, 2.5)
    got = [sorted(zip(e.tolist(), w.tolist())) for e, w in zip(experts, weights)]
    want = grouped_sigmoid_definition(x, router, bias, top_k, n_group, topk_group, normalize, 2.5)
    for a, b in zip(got, want):
        assert [e for e, _ in a] == [e for e, _ in b]
        assert max(abs(u - v) for (_, u), (_, v) in zip(a, b)) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the grouped matmul on CUDA needs a GPU (benchmarks/gpu_check.sh)")
def test_grouped_path_on_cuda_equals_the_reference():
    args = [t.cuda().bfloat16() for t in _weights(2, 64, 8, 64, 32)]
    weights, experts = route_softmax(args[0], args[1], 3)
    want = experts_reference(args[0], weights, experts, args[2], args[3], "silu_gated").float()
    if grouped_mm_fits(64, 32, torch.bfloat16, "cuda"):
        got = experts_grouped(args[0], weights, experts, args[2], args[3], "silu_gated").float()
        assert (got - want).abs().max() < 2e-2 * (1 + want.abs().max())
    moe = TopKMoE(64, 8, 3, 32, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 13, 64, device="cuda", dtype=torch.bfloat16)
    w, e = route_softmax(x.reshape(-1, 64), moe.router.layer.weight, 3)
    ref = experts_reference(x.reshape(-1, 64), w, e, moe.input_linear.weight, moe.output_linear.weight, "silu_gated")
    assert (moe(x).reshape(-1, 64).float() - ref.float()).abs().max() < 2e-2 * (1 + ref.float().abs().max())
