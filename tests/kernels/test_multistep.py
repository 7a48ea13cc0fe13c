"""``multistep_update``, T recurrence steps from a state that is only read: checked against the
float64 definition on every path: the PyTorch reference, numba on the CPU ("auto" there: the
chain kernel of ``stree.kernels.cpu.tree_jit``) and Triton."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import dt_options, ssm_inputs, ssm_shapes

from stree.kernels import multistep_update
from stree.testing import max_rel_error, multistep_def

FP32_TOL = 1e-5


def _call(inp, dt_opts, backend, device):
    to = lambda t: t.to(device) if t is not None else None
    return multistep_update(to(inp["initial_state"]), to(inp["x"]), to(inp["dt"]), to(inp["A"]), to(inp["B"]),
                            to(inp["C"]), D=to(inp["D"]), dt_bias=to(inp["dt_bias"]),
                            dt_softplus=dt_opts["dt_softplus"], dt_limit=dt_opts["dt_limit"], backend=backend)


@given(batch=st.integers(1, 3), T=st.integers(1, 12), shape=ssm_shapes(), dt_opts=dt_options(),
       D_kind=st.sampled_from(["none", "head", "dim"]), seed=st.integers(0, 2**16))
def test_matches_definition(batch, T, shape, dt_opts, D_kind, seed, device, poison):
    inp = ssm_inputs(torch.Generator().manual_seed(seed), batch, T, shape, dt_opts, D_kind=D_kind)
    y_def, state_def = multistep_def(inp["initial_state"], inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"],
                                     D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=dt_opts["dt_softplus"],
                                     dt_limit=dt_opts["dt_limit"])
    state_before = inp["initial_state"].clone()
    for backend, dev in (("torch", torch.device("cpu")), ("auto", torch.device("cpu")), ("triton", device)):
        y, state = _call(inp, dt_opts, backend, dev)
        assert state.dtype == torch.float32 and y.shape == inp["x"].shape
        assert max_rel_error(y, y_def) <= FP32_TOL, backend
        assert max_rel_error(state, state_def) <= FP32_TOL, backend
    assert torch.equal(inp["initial_state"], state_before)


@pytest.mark.parametrize("backend", ["torch", "auto", "triton"])
def test_single_step_equals_transformers_selective_state_update(backend, device):
    """T = 1 is the autoregressive step; transformers' PyTorch step is an independent reference."""
    from transformers.models.mamba2.modeling_mamba2 import mamba2_selective_state_update

    opts = dict(dt_softplus=True, dt_limit=(0.0, math.inf), use_bias=True)
    inp = ssm_inputs(torch.Generator().manual_seed(7), 3, 1, dict(ngroups=2, nheads=4, headdim=8, dstate=16), opts)
    dev = device if backend == "triton" else torch.device("cpu")
    y, state = _call(inp, opts, backend, dev)
    hf_state = inp["initial_state"].clone()
    p, s = hf_state.shape[2:]
    # transformers' step takes mamba_ssm's tied layout: dt [b, h, p], A [h, p, s], D and dt_bias [h, p].
    y_hf = mamba2_selective_state_update(
        hf_state, inp["x"][:, 0], inp["dt"][:, 0, :, None].expand(-1, -1, p), inp["A"][:, None, None].expand(-1, p, s),
        inp["B"][:, 0], inp["C"][:, 0], D=inp["D"][:, None].expand(-1, p), dt_bias=inp["dt_bias"][:, None].expand(-1, p),
        dt_softplus=True)
    assert max_rel_error(y[:, 0], y_hf) <= FP32_TOL
    assert max_rel_error(state, hf_state) <= FP32_TOL


@pytest.mark.parametrize("backend", ["torch", "auto", "triton"])
def test_small_dt_keeps_full_relative_precision(backend, device):
    """softplus(dt + bias) around 1e-4 (where Mamba2 often runs): a naive log(1 + exp(x)) in fp32
    would be off by ~1e-4 relative; every output element must stay within 1e-5 of float64."""
    g = torch.Generator().manual_seed(9)
    b, h, p, s = 2, 4, 4, 4
    dev = device if backend == "triton" else torch.device("cpu")
    state = torch.zeros(b, h, p, s)
    x, B, C = torch.randn(b, 1, h, p, generator=g), torch.randn(b, 1, 1, s, generator=g), torch.randn(b, 1, 1, s, generator=g)
    dt = torch.full((b, 1, h), -9.0) + torch.rand(b, 1, h, generator=g)
    A = -torch.ones(h)
    y, _ = multistep_update(*(t.to(dev) for t in (state, x, dt, A, B, C)), backend=backend)
    y_def, _ = multistep_def(state, x, dt, A, B, C)
    rel = ((y.cpu().double() - y_def).abs() / y_def.abs()).max().item()
    assert rel <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "auto", "triton"])
def test_half_precision_activations(dtype, backend, device):
    opts = dict(dt_softplus=True, dt_limit=(0.0, math.inf), use_bias=True)
    inp = ssm_inputs(torch.Generator().manual_seed(8), 2, 6, dict(ngroups=1, nheads=2, headdim=16, dstate=16), opts,
                     dtype=dtype)
    dev = device if backend == "triton" else torch.device("cpu")
    y, state = _call(inp, opts, backend, dev)
    y_def, state_def = multistep_def(inp["initial_state"], inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"],
                                     D=inp["D"], dt_bias=inp["dt_bias"])
    assert y.dtype == dtype and state.dtype == torch.float32
    assert max_rel_error(y, y_def) <= 1e-2 and max_rel_error(state, state_def) <= 1e-5


@pytest.mark.parametrize("backend", ["torch", "auto", "triton"])
def test_bad_inputs_raise_clear_errors(backend, backend_device):
    opts = dict(dt_softplus=True, dt_limit=(0.0, math.inf), use_bias=True)
    inp = ssm_inputs(torch.Generator().manual_seed(0), 1, 3, dict(ngroups=1, nheads=2, headdim=4, dstate=4), opts)
    inp = {k: v.to(backend_device) for k, v in inp.items()}

    def call(**kw):
        a = {**inp, **kw}
        return multistep_update(a["initial_state"], a["x"], a["dt"], a["A"], a["B"], a["C"], D=a["D"],
                                dt_bias=a["dt_bias"], backend=backend)

    with pytest.raises(TypeError, match="state must have dtype torch.float32"):
        call(initial_state=inp["initial_state"].bfloat16())
    with pytest.raises(ValueError, match=r"state must have shape \(1, 2, 4, 4\)"):
        call(initial_state=inp["initial_state"][:, :1])
    with pytest.raises(ValueError, match=r"C must have shape"):
        call(C=inp["C"][:, :2])
    with pytest.raises(ValueError, match=r"A must have shape \(2,\)"):
        call(A=inp["A"][:1])
    with pytest.raises(ValueError, match=r"dt_bias is on meta"):
        call(dt_bias=inp["dt_bias"].to("meta"))
    with pytest.raises(ValueError, match=r"x must have shape \[batch, T, nheads, headdim\]"):
        call(x=inp["x"][0])


def test_auto_on_the_cpu_runs_the_compiled_chain_kernel_outside_autograd(monkeypatch):
    """A chain draft's pass (``method="chain"``) verifies through this call: on CPU tensors "auto"
    is the compiled chain kernel, once per call, with the state it ends in; where a gradient is
    wanted it is the PyTorch path (numba's kernels have none)."""
    from stree.kernels.cpu import tree_jit

    calls = []
    real = tree_jit.chain_scan_rows
    monkeypatch.setattr(tree_jit, "chain_scan_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    opts = dict(dt_softplus=True, dt_limit=(0.0, math.inf), use_bias=True)
    inp = ssm_inputs(torch.Generator().manual_seed(3), 2, 5, dict(ngroups=1, nheads=2, headdim=8, dstate=8), opts)
    y, state = _call(inp, opts, "auto", torch.device("cpu"))
    y_ref, state_ref = _call(inp, opts, "torch", torch.device("cpu"))
    assert calls == [1]
    assert max_rel_error(y, y_ref.double()) <= FP32_TOL and max_rel_error(state, state_ref.double()) <= FP32_TOL
    monkeypatch.setattr(tree_jit, "PARALLEL_WORK", 1)  # the rows on numba's threads: the same outputs
    y_par, state_par = _call(inp, opts, "auto", torch.device("cpu"))
    assert torch.equal(y_par, y) and torch.equal(state_par, state)
    inp["x"].requires_grad_(True)
    y, _ = _call(inp, opts, "auto", torch.device("cpu"))
    assert calls == [1, 1] and y.requires_grad
