"""Half precision (float16, bfloat16) on the numba-compiled CPU paths ``backend="auto"`` takes.
numba has no half types, so the kernels read float32 copies of half tensors and write float32,
rounded back once, as the PyTorch paths compute in float32 and round once. Each kernel on random
trees and paths: the compiled kernel ran, its outputs (poisoned) match the float64 definitions
within half rounding and the PyTorch path's to a few half ulps, and a half state it advances
holds exactly what the PyTorch path's holds (the conv states only ever hold copied values)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import accepted_paths, ssm_shapes, trees

from stree.kernels import conv_step, replay, selective_state_update, tree_conv1d, tree_scan
from stree.kernels import _common as kernels_common
from stree.kernels.cpu import replay_jit, step_jit, tree_jit
from stree.testing import (max_rel_error, multistep_def, random_ssm_inputs, replay_def, tree_conv1d_def,
                           tree_scan_def)

HALVES = [torch.float16, torch.bfloat16]
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # against float64: about two roundings of the dtype
KERNELS = {"tree_conv_rows": tree_jit, "tree_scan_rows": tree_jit, "conv_step_rows": step_jit,
           "state_update_rows": step_jit, "replay_layers": replay_jit}


@pytest.fixture
def ran(monkeypatch):
    """How often each compiled kernel ran (in the whole test: every example of a hypothesis test)."""
    seen = dict.fromkeys(KERNELS, 0)
    for name, module in KERNELS.items():
        def counted(*a, _real=getattr(module, name), _name=name):
            seen[_name] += 1
            return _real(*a)
        monkeypatch.setattr(module, name, counted)
    return seen


def _new(ran: dict, before: dict) -> dict:
    """The kernels that ran since ``before``, and how often."""
    return {k: ran[k] - before[k] for k in ran if ran[k] != before[k]}


def _inputs(seed: int, batch: int, n: int, shape: dict, dtype: torch.dtype, dim: int = 12, d_conv: int = 4):
    """The model's layout: activations, conv state, conv weight and bias and dt_bias in ``dtype``
    (the last three parameters), A, D and the SSM state in float32."""
    g = torch.Generator().manual_seed(seed)
    inp = random_ssm_inputs(batch, n, shape["nheads"], shape["headdim"], shape["dstate"], shape["ngroups"],
                            dtype=dtype, generator=g)
    inp["dt"] = inp["dt"].to(dtype)
    inp["dt_bias"] = torch.nn.Parameter(inp["dt_bias"].to(dtype))
    inp["xBC"] = torch.randn(batch, n, dim, generator=g).to(dtype)
    inp["conv_state"] = torch.randn(batch, dim, d_conv, generator=g).to(dtype)
    inp["weight"] = torch.nn.Parameter(torch.randn(dim, 1, d_conv, generator=g).to(dtype))
    inp["bias"] = torch.nn.Parameter(torch.randn(dim, generator=g).to(dtype))
    return inp


@pytest.mark.parametrize("dtype", HALVES)
@settings(max_examples=15, deadline=None)
@given(tree=trees(max_n=20), shape=ssm_shapes(), seed=st.integers(0, 2**16))
def test_tree_kernels(dtype, tree, shape, seed, ran, poison):
    parents, batch = tree
    inp = _inputs(seed, batch, parents.shape[-1], shape, dtype)
    conv_args = (inp["xBC"], parents, inp["conv_state"], inp["weight"], inp["bias"])
    scan_args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], parents)
    scan_kw = dict(D=inp["D"], dt_bias=inp["dt_bias"], initial_state=inp["initial_state"])
    before = dict(ran)
    with torch.no_grad():
        conv, scan = tree_conv1d(*conv_args), tree_scan(*scan_args, **scan_kw)
        conv_torch, scan_torch = tree_conv1d(*conv_args, backend="torch"), tree_scan(*scan_args, **scan_kw,
                                                                                      backend="torch")
    assert _new(ran, before) == {"tree_conv_rows": 1, "tree_scan_rows": 1}
    assert conv.dtype == scan.dtype == dtype
    assert max_rel_error(conv, tree_conv1d_def(*conv_args)) <= TOL[dtype]
    assert max_rel_error(scan, tree_scan_def(*scan_args, **scan_kw)) <= TOL[dtype]
    assert max_rel_error(conv, conv_torch) <= TOL[dtype] and max_rel_error(scan, scan_torch) <= TOL[dtype]


@pytest.mark.parametrize("dtype", HALVES)
@settings(max_examples=15, deadline=None)
@given(batch=st.integers(1, 3), shape=ssm_shapes(), seed=st.integers(0, 2**16))
def test_step_kernels_advance_their_states_in_place(dtype, batch, shape, seed, ran, poison):
    inp = _inputs(seed, batch, 1, shape, dtype)
    states, before = {}, dict(ran)
    with torch.no_grad():
        for backend in ("auto", "torch"):
            conv_state, ssm_state = inp["conv_state"].clone(), inp["initial_state"].clone()
            out = conv_step(inp["xBC"][:, 0], conv_state, inp["weight"], inp["bias"], backend=backend)
            y = selective_state_update(ssm_state, inp["x"][:, 0], inp["dt"][:, 0], inp["A"], inp["B"][:, 0],
                                       inp["C"][:, 0], D=inp["D"], dt_bias=inp["dt_bias"], backend=backend)
            states[backend] = out, conv_state, y, ssm_state
    assert _new(ran, before) == {"conv_step_rows": 1, "state_update_rows": 1}
    out, conv_state, y, ssm_state = states["auto"]
    assert out.dtype == y.dtype == conv_state.dtype == dtype and ssm_state.dtype == torch.float32
    want = tree_conv1d_def(inp["xBC"], torch.tensor([-1]), inp["conv_state"], inp["weight"], inp["bias"])[:, 0]
    y_def, state_def = multistep_def(inp["initial_state"], inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"],
                                     D=inp["D"], dt_bias=inp["dt_bias"])
    assert max_rel_error(out, want) <= TOL[dtype] and max_rel_error(y, y_def[:, 0]) <= TOL[dtype]
    assert max_rel_error(ssm_state, state_def) <= 1e-5
    assert torch.equal(conv_state, states["torch"][1])  # the window shifted by one half value: exact
    assert max_rel_error(ssm_state, states["torch"][3]) <= 1e-5


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("in_place", [False, True])
@settings(max_examples=10, deadline=None)
@given(data=st.data(), tree=trees(max_n=20), shape=ssm_shapes(), seed=st.integers(0, 2**16))
def test_replay(dtype, in_place, data, tree, shape, seed, ran, poison):
    parents, batch = tree
    accepted, num = data.draw(accepted_paths(parents, batch))
    inp = _inputs(seed, batch, parents.shape[-1], shape, dtype)
    args = [inp[k] for k in ("initial_state", "conv_state", "xBC", "x", "dt", "B", "A")] + [accepted, num]
    ssm_def, conv_def = replay_def(*args, dt_bias=inp["dt_bias"])
    got, before = {}, dict(ran)
    with torch.no_grad():
        for backend in ("auto", "torch"):
            states = [t.clone() for t in args[:2]]
            out = replay(*states, *args[2:], dt_bias=inp["dt_bias"], backend=backend,
                         out=tuple(states) if in_place else None)
            got[backend] = states if in_place else out
    assert _new(ran, before) == {"replay_layers": 1}
    new_ssm, new_conv = got["auto"]
    assert new_ssm.dtype == torch.float32 and new_conv.dtype == dtype
    assert max_rel_error(new_ssm, ssm_def) <= 1e-5 and max_rel_error(new_ssm, got["torch"][0]) <= 1e-5
    assert torch.equal(new_conv, conv_def.to(dtype)) and torch.equal(new_conv, got["torch"][1])


@pytest.mark.parametrize("dtype", HALVES)
def test_a_half_parameter_changed_in_place_or_given_new_memory_reaches_the_kernel(dtype, ran):
    """The float32 copy of a half parameter is kept between calls: it must follow the parameter
    after an in-place step, a ``.data`` swap to new memory, and a swap to another layout of the
    same memory."""
    parents = torch.tensor([-1, 0, 0, 1, 3])
    conv = torch.nn.Conv1d(8, 8, 4, groups=8).to(dtype)
    xbc, state = torch.randn(1, 5, 8).to(dtype), torch.randn(1, 8, 4).to(dtype)

    def check():
        with torch.no_grad():
            out = tree_conv1d(xbc, parents, state, conv.weight, conv.bias)
        assert max_rel_error(out, tree_conv1d_def(xbc, parents, state, conv.weight.detach(),
                                                  conv.bias.detach())) <= TOL[dtype]

    check()
    with torch.no_grad():
        conv.weight.mul_(-2.0)
        conv.bias.add_(1.0)
    check()
    conv.weight.data = torch.randn(8, 1, 4).to(dtype)
    check()
    assert ran == {**dict.fromkeys(KERNELS, 0), "tree_conv_rows": 3}
    square = torch.nn.Parameter(torch.randn(4, 4).to(dtype))
    first = kernels_common.readable(square).copy()
    square.data = square.data.t()  # the same memory, transposed
    assert (kernels_common.readable(square) == first.T).all()
