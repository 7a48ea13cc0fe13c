"""The norms of a decoding pass against their float64 definitions: the gated RMSNorm after the
Mamba2 scan (one Triton launch on CUDA, one numba call on the CPU; the gate before or after the
norm, one or several groups, fp32 and half, the weight multiply in fp32 or after rounding as
transformers' hybrids do it) and the plain RMSNorm (one numba call on the CPU)."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from stree.kernels import gated_rms_norm, rms_norm
from stree.kernels.cpu import norm_jit
from stree.testing import gated_rms_norm_def, max_rel_error, rms_norm_def

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
    for backend, dev in (("torch", torch.device("cpu")), ("triton", device), ("auto", torch.device("cpu"))):
        out = gated_rms_norm(y.to(dev), z.to(dev), weight.to(dev), group_size, eps, gate_first, rounded,
                             backend=backend)
        assert out.shape == y.shape and out.dtype == dtype
        assert max_rel_error(out, expected) <= TOL[dtype], backend
        outs[backend] = out.cpu()
    # the kernel rounds where the PyTorch path rounds: at most two steps of the output dtype apart
    # (the sums' order may move the first rounding by one step, the weight multiply by another)
    ulp = 1e-6 if dtype == torch.float32 else 2 * 2 ** -7
    for other in ("triton", "auto"):  # (auto: numba's, on the CPU)
        assert ((outs[other].double() - outs["torch"].double()).abs() <= ulp * outs["torch"].double().abs()
                + 1e-6).all(), other


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


@given(lead=st.sampled_from([(1,), (4,), (2, 7)]), dim=st.sampled_from([1, 8, 96, 256]), weighted=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), eps=st.sampled_from([1e-6, 1e-2]),
       seed=st.integers(0, 2**16))
def test_rms_norm_matches_the_definition(lead, dim, weighted, dtype, eps, seed, poison):
    """The CPU's numba call ("auto") and F.rms_norm ("torch") against the float64 definition, and
    within a rounding of each other (outputs poisoned: every entry must be written)."""
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(*lead, dim, generator=g)).to(dtype)
    weight = (1 + 0.3 * torch.randn(dim, generator=g)).to(dtype) if weighted else None
    expected = rms_norm_def(x, weight, eps)
    outs = {}
    for backend in ("auto", "torch"):
        out = rms_norm(x, weight, eps, backend=backend)
        assert out.shape == x.shape and out.dtype == dtype
        assert max_rel_error(out, expected) <= TOL.get(dtype, 2e-3), backend
        outs[backend] = out.double()
    ulp = 1e-6 if dtype == torch.float32 else 2 ** -7
    assert ((outs["auto"] - outs["torch"]).abs() <= ulp * outs["torch"].abs() + 1e-6).all()


def test_the_compiled_rows_write_every_entry_from_their_own_row_alone():
    """Each row's norm depends on that row only, bit for bit (a step and a tree pass norm a token
    alike), and writes every entry of a NaN-filled output; the gated norm's weight row is the
    group's (row r % groups of the ``[groups, group]`` weight)."""
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(13, 96, generator=g), torch.rand(96, generator=g) + 0.5
    out = np.full((13, 96), np.nan, dtype=np.float32)
    norm_jit.rms_norm_rows(x.numpy(), weight.numpy(), True, 1e-5, out)
    assert max_rel_error(torch.from_numpy(out), rms_norm_def(x, weight, 1e-5)) <= 1e-6
    for r in (0, 5, 12):
        alone = np.full((1, 96), np.nan, dtype=np.float32)
        norm_jit.rms_norm_rows(x[r:r + 1].numpy(), weight.numpy(), True, 1e-5, alone)
        assert np.array_equal(alone[0], out[r])
    y, z = torch.randn(5, 3 * 32, generator=g), torch.randn(5, 3 * 32, generator=g)
    w = torch.rand(96, generator=g) + 0.5
    for gate_first in (True, False):
        gate = torch.nn.functional.silu(z)
        out = np.full((15, 32), np.nan, dtype=np.float32)
        norm_jit.gated_rms_norm_rows(y.reshape(15, 32).numpy(), gate.reshape(15, 32).numpy(), w.reshape(3, 32).numpy(),
                                     True, 1e-5, gate_first, out)
        ref = gated_rms_norm_def(y, z, w, 32, 1e-5, gate_first)
        assert max_rel_error(torch.from_numpy(out).reshape(5, 96), ref) <= 1e-6
        alone = np.full((3, 32), np.nan, dtype=np.float32)
        norm_jit.gated_rms_norm_rows(y[2:3].reshape(3, 32).numpy(), gate[2:3].reshape(3, 32).numpy(),
                                     w.reshape(3, 32).numpy(), True, 1e-5, gate_first, alone)
        assert np.array_equal(alone, out[6:9])


def test_gradients_and_compiling_take_the_pytorch_path():
    """Where a gradient is wanted (training a drafter) the norms are PyTorch's, so autograd sees
    them; inside torch.compile likewise (Inductor fuses them: one graph, no break for a numba call)."""
    x = torch.randn(3, 16, requires_grad=True)
    w = torch.nn.Parameter(torch.rand(16) + 0.5)
    out = rms_norm(x, w, 1e-5)
    assert out.grad_fn is not None
    out.square().sum().backward()
    ref_x, ref_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.nn.functional.rms_norm(ref_x, (16,), ref_w, 1e-5).square().sum().backward()
    assert torch.allclose(x.grad, ref_x.grad, atol=1e-5) and torch.allclose(w.grad, ref_w.grad, atol=1e-5)
    y, z = torch.randn(3, 16, requires_grad=True), torch.randn(3, 16)
    assert gated_rms_norm(y, z, w, 8, 1e-5).grad_fn is not None
    with torch.no_grad():  # (nothing wants a gradient: the numba calls, no autograd graph)
        assert rms_norm(x, w, 1e-5).grad_fn is None
        fn = torch.compile(lambda t: rms_norm(t, w, 1e-5) * 2 + gated_rms_norm(t, t, w, 8, 1e-5), dynamic=False,
                           fullgraph=True)
        eager = rms_norm(x, w, 1e-5) * 2 + gated_rms_norm(x, x, w, 8, 1e-5)
        assert torch.allclose(fn(x), eager, atol=1e-5)


def test_rms_norm_bad_inputs_raise_clear_errors():
    x = torch.randn(2, 12)
    with pytest.raises(TypeError, match="x must be a float32, float16 or bfloat16 tensor"):
        rms_norm(x.long(), None, 1e-5)
    with pytest.raises(ValueError, match=r"weight must have shape \(12,\)"):
        rms_norm(x, torch.ones(6), 1e-5)
    with pytest.raises(ValueError, match="eps must be positive"):
        rms_norm(x, None, 0.0)
    with pytest.raises(ValueError, match="backend must be one of"):
        rms_norm(x, None, 1e-5, backend="fast")
