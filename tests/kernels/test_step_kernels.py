"""The two kernels of a Mamba2 decode step, each advancing its state in place: ``conv_step`` (the
conv of one new token) and ``selective_state_update`` (one recurrence step). Checked against
the float64 definitions (a one-node tree's conv; one step of the multistep recurrence) on every
path: the PyTorch reference, numba on the CPU ("auto" there) and Triton."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import dt_options, ssm_inputs, ssm_shapes

from stree.kernels import conv_step, replay, selective_state_update
from stree.kernels.cpu.replay_jit import SWEEP
from stree.testing import max_rel_error, multistep_def, tree_conv1d_def

FP32_TOL = 1e-5


@given(batch=st.integers(1, 3), dim=st.sampled_from([1, 7, 48, 300]), d_conv=st.sampled_from([1, 2, 4]),
       with_bias=st.booleans(), activation=st.sampled_from([None, "silu"]), seed=st.integers(0, 2**16))
def test_conv_step_matches_a_one_node_tree_and_shifts_the_state(batch, dim, d_conv, with_bias, activation, seed,
                                                                 device, poison):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, dim, generator=g)
    state = torch.randn(batch, dim, d_conv, generator=g)
    weight, bias = torch.randn(dim, 1, d_conv, generator=g), torch.randn(dim, generator=g) if with_bias else None
    expected = tree_conv1d_def(x[:, None], torch.tensor([-1]), state, weight, bias, activation)[:, 0]
    shifted = torch.cat([state[..., 1:], x[..., None]], -1)
    for backend, dev in (("torch", torch.device("cpu")), ("auto", torch.device("cpu")), ("triton", device)):
        s = state.clone().to(dev)
        out = conv_step(x.to(dev), s, weight.to(dev), None if bias is None else bias.to(dev), activation,
                        backend=backend)
        assert out.shape == (batch, dim) and out.dtype == x.dtype
        assert max_rel_error(out, expected) <= FP32_TOL, backend
        assert torch.equal(s.cpu(), shifted), backend  # a pure shift: exact


@given(batch=st.integers(1, 3), shape=ssm_shapes(), dt_opts=dt_options(), D_kind=st.sampled_from(["head", "dim"]),
       seed=st.integers(0, 2**16))
def test_selective_state_update_is_one_step_of_the_recurrence(batch, shape, dt_opts, D_kind, seed, device, poison):
    inp = ssm_inputs(torch.Generator().manual_seed(seed), batch, 1, shape, dt_opts, D_kind=D_kind)
    kw = dict(D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=dt_opts["dt_softplus"], dt_limit=dt_opts["dt_limit"])
    y_def, state_def = multistep_def(inp["initial_state"], inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], **kw)
    for backend, dev in (("torch", torch.device("cpu")), ("auto", torch.device("cpu")), ("triton", device)):
        to = lambda t: t.to(dev) if t is not None else None
        state = inp["initial_state"].clone().to(dev)
        y = selective_state_update(state, to(inp["x"][:, 0]), to(inp["dt"][:, 0]), to(inp["A"]), to(inp["B"][:, 0]),
                                   to(inp["C"][:, 0]), **{k: to(v) if isinstance(v, torch.Tensor) else v
                                                          for k, v in kw.items()}, backend=backend)
        assert y.shape == inp["x"][:, 0].shape and y.dtype == inp["x"].dtype
        assert max_rel_error(y, y_def[:, 0]) <= FP32_TOL, backend
        assert max_rel_error(state, state_def) <= FP32_TOL, backend


@given(batch=st.integers(1, 3), shape=ssm_shapes(), dt_opts=dt_options(), seed=st.integers(0, 2**16))
def test_a_step_and_a_replay_of_one_token_leave_the_same_state_on_the_cpu(batch, shape, dt_opts, seed):
    """The compiled CPU step and replay round alike (float32, no fused multiply-adds): from the same
    activations, a plain step and the commit of a one-token path leave bit-identical states."""
    inp = ssm_inputs(torch.Generator().manual_seed(seed), batch, 1, shape, dt_opts)
    kw = dict(dt_bias=inp["dt_bias"], dt_softplus=dt_opts["dt_softplus"], dt_limit=dt_opts["dt_limit"])
    stepped = inp["initial_state"].clone()
    selective_state_update(stepped, inp["x"][:, 0], inp["dt"][:, 0], inp["A"], inp["B"][:, 0], inp["C"][:, 0],
                           D=inp["D"], **kw)
    dim = 4
    replayed, _ = replay(inp["initial_state"], torch.zeros(batch, dim, 4), torch.zeros(batch, 1, dim), inp["x"],
                         inp["dt"], inp["B"], inp["A"], torch.zeros(batch, 1, dtype=torch.long),
                         torch.ones(batch, dtype=torch.long), **kw)
    assert torch.equal(stepped, replayed)


@pytest.mark.parametrize("heads, headdim, dstate, groups", [(8, 64, 32, 1), (4, 12, 24, 2)])
@given(batch=st.integers(2, 4), seed=st.integers(0, 2**16))
@settings(max_examples=10, deadline=None)
def test_a_rows_step_on_the_cpu_is_the_same_alone_and_in_a_batch(heads, headdim, dstate, groups, batch, seed):
    """x, B and C as a model hands them over: views of one conv output per row (strided across
    rows). Each row's outputs and state in a batch are bit-identical to its step alone: the
    kernel sums each row as it would alone (it did not where a batch's views were strided)."""
    g = torch.Generator().manual_seed(seed)
    conv = torch.randn(batch, heads * headdim + 2 * groups * dstate, generator=g)
    x, B, C = torch.split(conv, [heads * headdim, groups * dstate, groups * dstate], dim=-1)
    x, B, C = x.unflatten(-1, (heads, headdim)), B.unflatten(-1, (groups, dstate)), C.unflatten(-1, (groups, dstate))
    dt, A = torch.randn(batch, heads, generator=g), -torch.rand(heads, generator=g) - 0.5
    D, dt_bias = torch.randn(heads, generator=g), torch.randn(heads, generator=g)
    state = torch.randn(batch, heads, headdim, dstate, generator=g)
    batched = state.clone()
    y = selective_state_update(batched, x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True)
    for r in range(batch):
        alone = state[r: r + 1].clone()
        y_r = selective_state_update(alone, x[r: r + 1], dt[r: r + 1], A, B[r: r + 1], C[r: r + 1], D=D,
                                     dt_bias=dt_bias, dt_softplus=True)
        assert torch.equal(y[r], y_r[0]) and torch.equal(batched[r], alone[0]), r


@pytest.mark.parametrize("tokens", [3, SWEEP, 5 * SWEEP + 1])
@given(batch=st.integers(1, 2), shape=ssm_shapes(), dt_opts=dt_options(), seed=st.integers(0, 2**16))
@settings(max_examples=10, deadline=None)
def test_a_replay_of_a_path_leaves_the_state_of_as_many_steps_on_the_cpu(tokens, batch, shape, dt_opts, seed):
    """A decoding path and a prompt's (``SWEEP`` tokens a pass along the state, the last pass
    partial or whole) replay with the step's roundings, token after token: the commit of a path
    leaves the bit-identical state of stepping its tokens one by one."""
    inp = ssm_inputs(torch.Generator().manual_seed(seed), batch, tokens, shape, dt_opts)
    kw = dict(dt_bias=inp["dt_bias"], dt_softplus=dt_opts["dt_softplus"], dt_limit=dt_opts["dt_limit"])
    stepped = inp["initial_state"].clone()
    for t in range(tokens):
        selective_state_update(stepped, inp["x"][:, t], inp["dt"][:, t], inp["A"], inp["B"][:, t], inp["C"][:, t],
                               D=inp["D"], **kw)
    dim = 4
    path = torch.arange(tokens).expand(batch, -1)
    replayed, _ = replay(inp["initial_state"], torch.zeros(batch, dim, 4), torch.zeros(batch, tokens, dim), inp["x"],
                         inp["dt"], inp["B"], inp["A"], path, torch.full((batch,), tokens), **kw)
    assert torch.equal(stepped, replayed)


@pytest.mark.parametrize("backend", ["torch", "auto", "triton"])
def test_bad_inputs_raise_clear_errors(backend, backend_device):
    torch.manual_seed(0)
    with backend_device:  # the tensors built below: on the kernel's device
        x, state, w = torch.randn(2, 6), torch.randn(2, 6, 4), torch.randn(6, 4)
        with pytest.raises(ValueError, match=r"conv_state must have shape \(2, 6, 4\)"):
            conv_step(x, state[:1], w, backend=backend)
        with pytest.raises(ValueError, match="activation must be one of"):
            conv_step(x, state, w, activation="relu", backend=backend)
        ssm = torch.randn(2, 4, 8, 3)
        args = (torch.randn(2, 4, 8), torch.randn(2, 4), -torch.rand(4), torch.randn(2, 2, 3), torch.randn(2, 2, 3))
        with pytest.raises(ValueError, match="state must be contiguous"):
            selective_state_update(ssm.transpose(2, 3).contiguous().transpose(2, 3), *args, backend=backend)
        with pytest.raises(TypeError, match="state must have dtype torch.float32"):
            selective_state_update(ssm.half(), *args, backend=backend)
        with pytest.raises(ValueError, match=r"dt must have shape \(2, 4\)"):
            selective_state_update(ssm, args[0], args[1][:, :3], *args[2:], backend=backend)
