"""stree.models.linear: the packed CPU path against the float64 definition, following weight
changes, staying out of autograd, and as one opaque op under torch.compile."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.profiler import profile

from stree.models.linear import Linear, linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")


def _definition(x, w, b):
    out = x.double() @ w.double().t()
    return out if b is None else out + b.double()


def _ops(fn):
    with profile() as prof:
        fn()
    return {e.name for e in prof.events()}


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 20), d_in=st.integers(1, 80), d_out=st.integers(1, 300), bias=st.booleans(),
       lead=st.sampled_from([(), (2,), (1, 3)]), seed=st.integers(0, 2**16))
def test_equals_the_definition(rows, d_in, d_out, bias, lead, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, rows, d_in, generator=g)
    w, b = torch.randn(d_out, d_in, generator=g), torch.randn(d_out, generator=g) if bias else None
    out = torch.full((*lead, rows, d_out), float("nan"))  # poisoned: every entry must be written
    with torch.no_grad():
        out.copy_(linear(x, w, b))
    assert out.shape == (*lead, rows, d_out)
    assert torch.allclose(out.double(), _definition(x, w, b), rtol=1e-4, atol=1e-4 * d_in ** 0.5)


def test_several_rows_run_on_the_packed_weight_and_one_row_does_not():
    layer = Linear(64, 512)
    with torch.no_grad():
        assert "mkldnn::_linear_pointwise" in _ops(lambda: layer(torch.randn(3, 64)))
        assert "mkldnn::_linear_pointwise" not in _ops(lambda: layer(torch.randn(1, 64)))
        wide = Linear(64, 512, dtype=torch.float64)  # float32 only
        assert "mkldnn::_linear_pointwise" not in _ops(lambda: wide(torch.randn(3, 64, dtype=torch.float64)))


def test_a_changed_weight_is_packed_again():
    layer = Linear(32, 48)
    x = torch.randn(4, 32)
    with torch.no_grad():
        layer(x)
        layer.weight.mul_(-2.0)  # in place: the version counter moves
        assert torch.allclose(layer(x).double(), _definition(x, layer.weight, layer.bias), atol=1e-4)
        layer.weight.data = torch.randn(48, 32)  # new storage
        assert torch.allclose(layer(x).double(), _definition(x, layer.weight, layer.bias), atol=1e-4)
        layer.load_state_dict({"weight": torch.randn(48, 32), "bias": torch.randn(48)})
        assert torch.allclose(layer(x).double(), _definition(x, layer.weight, layer.bias), atol=1e-4)


def test_training_stays_on_autograd():
    layer = Linear(16, 8)
    x = torch.randn(5, 16, requires_grad=True)
    assert "mkldnn::_linear_pointwise" not in _ops(lambda: layer(x))
    layer(x).square().sum().backward()
    ref_w = layer.weight.detach().clone().requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    torch.nn.functional.linear(ref_x, ref_w, layer.bias.detach()).square().sum().backward()
    assert torch.allclose(layer.weight.grad, ref_w.grad) and torch.allclose(x.grad, ref_x.grad)


def test_compiled_is_one_opaque_op_with_the_eager_result():
    layer = Linear(40, 96)
    x = torch.randn(6, 40)
    fn = torch.compile(lambda t: layer(t.relu()) * 2, dynamic=False)
    with torch.no_grad():
        eager = layer(x.relu()) * 2
        assert torch.allclose(fn(x), eager, atol=1e-5)
        assert "stree::packed_linear" in _ops(lambda: fn(x))
        layer.weight.mul_(0.5)  # the compiled graph reads the weight afresh
        assert torch.allclose(fn(x), layer(x.relu()) * 2, atol=1e-5)
