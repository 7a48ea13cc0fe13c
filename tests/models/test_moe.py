"""The mixture-of-experts feed-forward: the grouped-matmul path against the float64 definition
(each token through its own top-k experts, written out here as a loop), and the module's checks."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stree.models.moe import TopKMoE, grouped_mm_fits, moe_grouped, moe_reference


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
    assert not grouped_mm_fits(32, 12, torch.bfloat16)
    torch.manual_seed(0)
    moe = TopKMoE(30, 5, 2, 6)
    x = torch.randn(2, 7, 30)
    want = definition(x.reshape(-1, 30), moe.router.layer.weight, moe.input_linear.weight, moe.output_linear.weight, 2)
    assert (moe(x).reshape(-1, 30).double() - want).abs().max() < 1e-4


def test_top_k_is_checked():
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, num_local_experts = 4\], got 5"):
        TopKMoE(16, 4, 5, 8)
