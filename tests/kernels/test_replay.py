import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import accepted_paths, by, dt_options, ssm_inputs, ssm_shapes, trees
from host_sync import count_kernel_launches

from stree.kernels import replay, tree_conv1d, tree_scan
from stree.testing import max_rel_error, replay_def
from stree.tree import TreeShape

FP32_TOL = 1e-5


def _replay_inputs(seed, batch, n, shape, dt_opts, dim=12, d_conv=4, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    inp = ssm_inputs(gen, batch, n, shape, dt_opts, dtype=dtype)
    inp["xBC"] = torch.randn(batch, n, dim, generator=gen).to(dtype)
    inp["conv_state"] = torch.randn(batch, dim, d_conv, generator=gen).to(dtype)
    return inp


def _call(inp, accepted, num, dt_opts, backend, device):
    to = lambda t: t.to(device) if t is not None else None
    return replay(to(inp["initial_state"]), to(inp["conv_state"]), to(inp["xBC"]), to(inp["x"]), to(inp["dt"]),
                  to(inp["B"]), to(inp["A"]), to(accepted), to(num), dt_bias=to(inp["dt_bias"]),
                  dt_softplus=dt_opts["dt_softplus"], dt_limit=dt_opts["dt_limit"], backend=backend)


@given(data=st.data(), tree=trees(max_n=30), shape=ssm_shapes(), dt_opts=dt_options(),
       d_conv=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**16))
def test_matches_definition_and_reads_only_the_accepted_path(data, tree, shape, dt_opts, d_conv, seed, device, poison):
    parents, batch = tree
    n = parents.shape[-1]
    accepted, num = data.draw(accepted_paths(parents, batch))
    inp = _replay_inputs(seed, batch, n, shape, dt_opts, d_conv=d_conv)
    ssm_def, conv_def = replay_def(inp["initial_state"], inp["conv_state"], inp["xBC"], inp["x"], inp["dt"], inp["B"],
                                   inp["A"], accepted, num, dt_bias=inp["dt_bias"], dt_softplus=dt_opts["dt_softplus"],
                                   dt_limit=dt_opts["dt_limit"])
    # NaN in every node off the accepted paths: a replay that reads them cannot come out finite.
    on_path = torch.zeros(batch, n, dtype=torch.bool)
    for b in range(batch):
        on_path[b, accepted[b, : num[b]]] = True
    for key in ("x", "dt", "B", "xBC"):
        inp[key] = inp[key].masked_fill(~on_path.view(batch, n, *([1] * (inp[key].dim() - 2))), float("nan"))
    before = {k: v.clone() for k, v in inp.items() if v is not None}
    for backend, dev in (("torch", torch.device("cpu")), ("auto", torch.device("cpu")), ("triton", device)):
        new_ssm, new_conv = _call(inp, accepted, num, dt_opts, backend, dev)
        assert new_ssm.dtype == torch.float32 and new_conv.dtype == inp["conv_state"].dtype
        assert max_rel_error(new_ssm, ssm_def) <= FP32_TOL, backend
        assert torch.equal(new_conv.cpu(), conv_def.float()), backend  # a pure copy: exact
    for k, v in before.items():
        torch.testing.assert_close(inp[k], v, rtol=0, atol=0, equal_nan=True, msg=f"{k} was modified")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_replayed_state_reproduces_the_tree_outputs_at_the_accepted_node(backend, device):
    """The verify pass's y and conv output at the last accepted node, recomputed from the
    replayed states with one more step, must match: the state really is the one at that node."""
    shape = TreeShape.paper13()
    opts = dict(dt_softplus=True, dt_limit=(0.0, math.inf), use_bias=True)
    dims = dict(ngroups=1, nheads=2, headdim=8, dstate=8)
    inp = _replay_inputs(11, 1, shape.n, dims, opts)
    dev = device if backend == "triton" else torch.device("cpu")
    inp = {k: (v.to(dev) if v is not None else None) for k, v in inp.items()}
    parents = shape.parents_tensor(dev)
    accepted = torch.tensor([[0, 1, 4, 7, 11]], device=dev)
    num = torch.tensor([5], device=dev)
    node = 11
    weight, bias = torch.randn(12, 4).to(dev), torch.randn(12).to(dev)
    conv_out = tree_conv1d(inp["xBC"], parents, inp["conv_state"], weight, bias, backend=backend)
    y = tree_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], parents, D=inp["D"], dt_bias=inp["dt_bias"],
                  initial_state=inp["initial_state"], backend=backend)
    new_ssm, new_conv = _call(inp, accepted, num, opts, backend, dev)
    y_node = torch.einsum("bhps,bs->bhp", new_ssm, inp["C"][:, node, 0]) + inp["D"][:, None] * inp["x"][:, node]
    assert max_rel_error(y_node, y[:, node]) <= FP32_TOL
    conv_node = torch.nn.functional.silu((new_conv * weight).sum(-1) + bias)
    assert max_rel_error(conv_node, conv_out[:, node]) <= FP32_TOL


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_inputs_raise_clear_errors(backend, backend_device):
    opts = dict(dt_softplus=True, dt_limit=(0.0, math.inf), use_bias=False)
    inp = _replay_inputs(0, 2, 5, dict(ngroups=1, nheads=2, headdim=4, dstate=4), opts)
    inp = {k: v if v is None else v.to(backend_device) for k, v in inp.items()}
    with backend_device:  # the tensors built below: on the kernel's device
        accepted = torch.tensor([[0, 1, 2], [0, 3, -1]])
        num = torch.tensor([3, 2])

        def call(accepted=accepted, num=num, **kw):
            a = {**inp, **kw}
            return replay(a["initial_state"], a["conv_state"], a["xBC"], a["x"], a["dt"], a["B"], a["A"], accepted, num,
                          backend=backend)

        call()
        with pytest.raises(ValueError, match=r"num_accepted\[1\] = 0 must be in \[1, 3\]"):
            call(num=torch.tensor([3, 0]))
        with pytest.raises(ValueError, match=r"num_accepted\[0\] = 4 must be in \[1, 3\]"):
            call(num=torch.tensor([4, 2]))
        with pytest.raises(ValueError, match=r"accepted\[1, 2\] = -1 is not a node index in \[0, 5\)"):
            call(num=torch.tensor([3, 3]))
        with pytest.raises(TypeError, match="accepted must have an integer dtype"):
            call(accepted=accepted.float())
        with pytest.raises(ValueError, match=r"accepted must have shape \[batch, L\]"):
            call(accepted=accepted[0])
        with pytest.raises(TypeError, match="ssm_state must have dtype torch.float32"):
            call(initial_state=inp["initial_state"].half())
        with pytest.raises(ValueError, match=r"xBC must have shape \(2, 5, 12\)"):
            call(xBC=inp["xBC"][:, :4])
        with pytest.raises(ValueError, match=r"conv_state must have shape \(2, 12, 4\)"):
            call(conv_state=inp["conv_state"][:1])
        with pytest.raises(ValueError, match=r"num_accepted is on meta"):
            call(num=num.to("meta"))


@pytest.mark.parametrize("backend", ["torch", "auto-cpu", "triton"])
@pytest.mark.parametrize("in_place", [False, True])
def test_every_layer_in_one_call(backend, in_place, device):
    """A stack of layers, each with its own A and dt_bias, replayed in one call (one Triton
    launch; on the CPU by default one compiled call), written in place when out= names the states:
    each layer equals its definition."""
    opts = dict(dt_softplus=True, dt_limit=(0.0, math.inf), use_bias=True)
    dims = dict(ngroups=2, nheads=4, headdim=40, dstate=8)  # two channel blocks per head
    shape = TreeShape.paper13()
    accepted, num = torch.tensor([[0, 2, 6, 10], [0, 0, 0, 0], [0, 1, 4, 7]]), torch.tensor([4, 1, 3])
    layers = [_replay_inputs(20 + l, 3, shape.n, dims, opts, dim=300, d_conv=4) for l in range(3)]  # 2 conv blocks
    stack = {k: torch.stack([inp[k] for inp in layers]) for k in ("initial_state", "conv_state", "xBC", "x", "dt", "B",
                                                                 "A", "dt_bias")}
    dev = device if backend == "triton" else torch.device("cpu")
    backend = "auto" if backend == "auto-cpu" else backend
    stack = {k: v.to(dev) for k, v in stack.items()}
    out = (stack["initial_state"], stack["conv_state"]) if in_place else None
    with count_kernel_launches() as launches:
        new_ssm, new_conv = replay(stack["initial_state"], stack["conv_state"], stack["xBC"], stack["x"], stack["dt"],
                                   stack["B"], stack["A"], accepted.to(dev), num.to(dev), dt_bias=stack["dt_bias"],
                                   out=out, backend=backend)
    assert launches["count"] == (1 if backend == "triton" else 0)
    if in_place:
        assert new_ssm is stack["initial_state"] and new_conv is stack["conv_state"]
    for l, inp in enumerate(layers):
        ssm_def, conv_def = replay_def(inp["initial_state"], inp["conv_state"], inp["xBC"], inp["x"], inp["dt"],
                                       inp["B"], inp["A"], accepted, num, dt_bias=inp["dt_bias"])
        assert max_rel_error(new_ssm[l], ssm_def) <= FP32_TOL, l
        assert torch.equal(new_conv[l].cpu(), conv_def.float()), l


@given(data=st.data(), tree=trees(max_n=20), shape=ssm_shapes(), dt_opts=dt_options(), layers=st.sampled_from([0, 2]),
       seed=st.integers(0, 2**16))
def test_slots_of_a_pool_match_the_padded_path(data, tree, shape, dt_opts, layers, seed, device, poison):
    """Engine convention: the states are a pool of slots, row b's in slot state_indices[b] (in any
    order, padding rows negative). Every backend writes each real row's new states into its slot,
    equal to what the padded call returns for that row; padding rows and unnamed slots keep every
    bit (the pool holds NaN there: a read of them cannot pass unseen either)."""
    parents, batch = tree
    n = parents.shape[-1]
    accepted, num = data.draw(accepted_paths(parents, batch))
    lead = (layers,) if layers else ()
    inp = _replay_inputs(seed, batch, n, shape, dt_opts)
    if layers:  # the same activations for every layer, each layer its own states
        for key in ("x", "dt", "B", "xBC", "initial_state", "conv_state"):
            inp[key] = torch.stack([inp[key] * (1 + 0.5 * i) for i in range(layers)])
        for key in ("A", "dt_bias"):
            inp[key] = None if inp[key] is None else inp[key].expand(layers, -1).contiguous()
    ref_ssm, ref_conv = _call(inp, accepted, num, dt_opts, "torch", torch.device("cpu"))
    slots = batch + data.draw(st.integers(0, 3))
    order = torch.randperm(slots, generator=torch.Generator().manual_seed(seed))[:batch]
    pad = torch.tensor(data.draw(st.lists(st.booleans(), min_size=batch, max_size=batch)))
    state_indices = torch.where(pad, -1, order).int()
    dim = len(lead)
    for backend, dev in (("torch", torch.device("cpu")), ("auto", torch.device("cpu")), ("triton", device)):
        pool_ssm = torch.full((*lead, slots, *inp["initial_state"].shape[dim + 1:]), float("nan"))
        pool_conv = torch.full((*lead, slots, *inp["conv_state"].shape[dim + 1:]), float("nan"))
        real = torch.nonzero(~pad).flatten()
        pool_ssm.index_copy_(dim, order[real], inp["initial_state"].index_select(dim, real))
        pool_conv.index_copy_(dim, order[real], inp["conv_state"].index_select(dim, real))
        want_ssm, want_conv = pool_ssm.clone(), pool_conv.clone()
        want_ssm.index_copy_(dim, order[real], ref_ssm.index_select(dim, real))
        want_conv.index_copy_(dim, order[real], ref_conv.index_select(dim, real))
        to = lambda t: t.to(dev) if t is not None else None
        pool_ssm, pool_conv = to(pool_ssm), to(pool_conv)
        got = replay(pool_ssm, pool_conv, to(inp["xBC"]), to(inp["x"]), to(inp["dt"]), to(inp["B"]), to(inp["A"]),
                     to(accepted), to(num), dt_bias=to(inp["dt_bias"]), dt_softplus=dt_opts["dt_softplus"],
                     dt_limit=dt_opts["dt_limit"], state_indices=to(state_indices), backend=backend)
        assert got[0] is pool_ssm and got[1] is pool_conv, backend  # in place
        torch.testing.assert_close(pool_ssm.cpu(), want_ssm, rtol=FP32_TOL, atol=FP32_TOL, equal_nan=True,
                                   msg=by(backend))
        assert torch.equal(pool_conv.cpu().nan_to_num(7.0), want_conv.nan_to_num(7.0)), backend


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_slots_are_refused(backend, backend_device):
    inp = _replay_inputs(0, 2, 3, dict(nheads=2, headdim=4, ngroups=1, dstate=4), dict(dt_softplus=True,
                                                                                       dt_limit=(0.0, math.inf),
                                                                                       use_bias=False))
    inp = {k: v if v is None else v.to(backend_device) for k, v in inp.items()}
    with backend_device:  # the tensors built below: on the kernel's device
        accepted, num = torch.tensor([[0, 1], [0, 2]]), torch.tensor([2, 2])
        pool_ssm, pool_conv = torch.zeros(3, 2, 4, 4), torch.zeros(3, 12, 4)
        args = (inp["xBC"], inp["x"], inp["dt"], inp["B"], inp["A"], accepted, num)
        for indices, match in (([0, 3], r"state_indices\[1\] = 3 is not a slot in \[0, 3\)"),
                               ([1, 1], "names a slot twice"), ([0], "state_indices")):
            with pytest.raises(ValueError, match=match):
                replay(pool_ssm, pool_conv, *args, state_indices=torch.tensor(indices), backend=backend)
        with pytest.raises(ValueError, match="out must be None"):
            replay(pool_ssm, pool_conv, *args, state_indices=torch.tensor([0, 1]), out=(pool_ssm, pool_conv),
                   backend=backend)
        with pytest.raises(ValueError, match=r"ssm_state must have shape \[slots"):
            replay(pool_ssm[0], pool_conv, *args, state_indices=torch.tensor([0, 1]), backend=backend)
