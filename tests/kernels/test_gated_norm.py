"""The gated RMSNorm after the Mamba2 scan (one Triton launch on CUDA), against its float64
definition: the gate before or after the norm, one or several groups, fp32 and bf16, the
weight multiply in fp32 or after rounding (transformers' hybrids)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from stree.kernels import gated_rms_norm
from stree.testing import gated_rms_norm_def, max_rel_error

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@given(lead=st.sampled_from([(1,), (3,), (2, 5)]), ngroups=st.integers(1, 3), group_size=st.sampled_from([4, 24, 64]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), gate_first=st.booleans(), rounded=st.booleans(),
       eps=st.sampled_from([1e-6, 1e-2]), seed=st.integers(0, 2**16))
def test_gated_rms_norm_matches_the_definition(lead, ngroups, group_size, dtype, gate_first, rounded, eps, seed,
                                                device, poison):
    g = torch.Generator().manual_seed(seed)
    dim = ngroups * group_size
    y, z = torch.randn(*lead, dim, generator=g).to(dtype), (2 * torch.randn(*lead, dim, generator=g)).to(dtype)
    weight = (1 + 0.3 * torch.randn(dim, generator=g)).to(dtype)
    expected = gated_rms_norm_def(y, z, weight, group_size, eps, gate_first)
    outs = {}
    for backend, dev in (("torch", torch.device("cpu")), ("triton", device)):
        out = gated_rms_norm(y.to(dev), z.to(dev), weight.to(dev), group_size, eps, gate_first, rounded,
                             backend=backend)
        assert out.shape == y.shape and out.dtype == dtype
        assert max_rel_error(out, expected) <= TOL[dtype], backend
        outs[backend] = out.cpu()
    # the kernel rounds where the PyTorch path rounds: at most two steps of the output dtype apart
    # (the sums' order may move the first rounding by one step, the weight multiply by another)
    ulp = 1e-6 if dtype == torch.float32 else 2 * 2 ** -7
    assert ((outs["triton"].double() - outs["torch"].double()).abs() <= ulp * outs["torch"].double().abs() + 1e-6).all()


def test_a_strided_input_is_read_as_its_values(device):
    """y and z as the mixer hands them: slices of wider tensors."""
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(3, 40, generator=g)
    y, z, weight = wide[:, :16], wide[:, 20:36], torch.rand(16, generator=g) + 0.5
    out = gated_rms_norm(y.to(device), z.to(device), weight.to(device), 8, 1e-5, backend="triton")
    assert max_rel_error(out, gated_rms_norm_def(y, z, weight, 8, 1e-5)) <= 1e-5


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_inputs_raise_clear_errors(backend, backend_device):
    y, z, w = (t.to(backend_device) for t in (torch.randn(2, 12), torch.randn(2, 12), torch.ones(12)))
    with pytest.raises(ValueError, match="group_size must be a positive int dividing dim = 12, got 5"):
        gated_rms_norm(y, z, w, 5, 1e-5, backend=backend)
    with pytest.raises(ValueError, match=r"z must have shape \(2, 12\)"):
        gated_rms_norm(y, z[:, :6], w, 6, 1e-5, backend=backend)
    with pytest.raises(ValueError, match=r"weight must have shape \(12,\)"):
        gated_rms_norm(y, z, w[:6], 6, 1e-5, backend=backend)
    with pytest.raises(TypeError, match="y must be a float32, float16 or bfloat16 tensor"):
        gated_rms_norm(y.long(), z, w, 6, 1e-5, backend=backend)
    with pytest.raises(ValueError, match="eps must be positive"):
        gated_rms_norm(y, z, w, 6, 0.0, backend=backend)
