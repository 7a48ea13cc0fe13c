import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from strategies import trees

from stree.kernels import tree_conv1d
from stree.testing import max_rel_error, tree_conv1d_def
from stree.tree import TreeShape

FP32_TOL = 1e-5


def _inputs(seed, batch, n, dim, d_conv, dtype=torch.float32, state_layout="contiguous"):
    g = torch.Generator().manual_seed(seed)
    xbc = torch.randn(batch, n, dim, generator=g).to(dtype)
    if state_layout == "channels_last":  # mamba_ssm allocates (B, K, dim) and transposes
        conv_state = torch.randn(batch, d_conv, dim, generator=g).to(dtype).transpose(1, 2)
    else:
        conv_state = torch.randn(batch, dim, d_conv, generator=g).to(dtype)
    weight = torch.randn(dim, d_conv, generator=g)
    bias = torch.randn(dim, generator=g)
    return xbc, conv_state, weight, bias


@given(tree=trees(), dim=st.sampled_from([1, 7, 24, 130]), d_conv=st.sampled_from([1, 2, 3, 4]),
       with_bias=st.booleans(), activation=st.sampled_from(["silu", None]),
       layout=st.sampled_from(["contiguous", "channels_last"]), seed=st.integers(0, 2**16))
def test_matches_definition_on_random_trees(tree, dim, d_conv, with_bias, activation, layout, seed, device, poison):
    parents, batch = tree
    xbc, conv_state, weight, bias = _inputs(seed, batch, parents.shape[-1], dim, d_conv, state_layout=layout)
    bias = bias if with_bias else None
    expected = tree_conv1d_def(xbc, parents, conv_state, weight, bias, activation)
    state_before = conv_state.clone()
    for backend, dev in (("torch", torch.device("cpu")), ("auto", torch.device("cpu")), ("triton", device)):
        out = tree_conv1d(xbc.to(dev), parents.to(dev), conv_state.to(dev), weight.to(dev),
                          bias.to(dev) if bias is not None else None, activation, backend=backend)
        assert out.shape == xbc.shape and out.dtype == xbc.dtype
        assert max_rel_error(out, expected) <= FP32_TOL, backend
    assert torch.equal(conv_state, state_before)


@pytest.mark.parametrize("backend", ["torch", "auto", "triton"])
def test_chain_equals_torch_conv1d_over_the_sequence(backend, device):
    """On a chain, the tree conv is the ordinary causal conv continuing from the conv state."""
    n, dim, d_conv = 9, 16, 4
    xbc, conv_state, weight, bias = _inputs(0, 2, n, dim, d_conv)
    dev = device if backend == "triton" else torch.device("cpu")
    out = tree_conv1d(xbc.to(dev), TreeShape.chain(n - 1).parents_tensor(dev), conv_state.to(dev),
                      weight[:, None].to(dev), bias.to(dev), backend=backend).cpu()
    seq = torch.cat([conv_state[:, :, 1:], xbc.transpose(1, 2)], dim=2)  # the last d_conv-1 old inputs
    expected = F.silu(F.conv1d(seq, weight[:, None], bias, groups=dim)).transpose(1, 2)
    assert max_rel_error(out, expected) <= FP32_TOL


@pytest.mark.parametrize("n", [1, 9, 300])
@pytest.mark.parametrize("d_conv", [1, 2, 4])
@pytest.mark.parametrize("activation", ["silu", None])
def test_chains_of_every_length_match_the_definition(n, d_conv, activation, poison):
    """A chain (a prefill) takes the PyTorch path's causal conv over its window rows, with or
    without a bias, for every kernel width (one tap: no state read), shared by the batch or one
    chain per row."""
    xbc, conv_state, weight, bias = _inputs(n, 2, n, 24, d_conv, state_layout="channels_last")
    chain = TreeShape.chain(n - 1).parents_tensor()
    for parents in (chain, torch.stack([chain, chain])):
        for b in (bias, None):
            out = tree_conv1d(xbc, parents, conv_state, weight, b, activation, backend="torch")
            assert out.shape == xbc.shape and out.is_contiguous()
            assert max_rel_error(out, tree_conv1d_def(xbc, parents, conv_state, weight, b, activation)) <= FP32_TOL
    half = tree_conv1d(xbc.bfloat16(), chain, conv_state.bfloat16(), weight, bias, activation, backend="torch")
    assert half.dtype == torch.bfloat16 and half.is_contiguous()
    assert max_rel_error(half, tree_conv1d_def(xbc.bfloat16(), chain, conv_state.bfloat16(), weight, bias,
                                               activation)) <= 1e-2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_half_precision(dtype, backend, device):
    shape = TreeShape.paper13()
    xbc, conv_state, weight, bias = _inputs(1, 2, shape.n, 32, 4, dtype=dtype)
    dev = device if backend == "triton" else torch.device("cpu")
    out = tree_conv1d(xbc.to(dev), shape.parents_tensor(dev), conv_state.to(dev), weight.to(dev), bias.to(dev),
                      backend=backend)
    assert out.dtype == dtype
    assert max_rel_error(out, tree_conv1d_def(xbc, shape.parents_tensor(), conv_state, weight, bias)) <= 1e-2


@pytest.mark.parametrize("backend", ["torch", "auto", "triton"])
def test_bad_inputs_raise_clear_errors(backend, backend_device):
    xbc, conv_state, weight, bias = (t.to(backend_device) for t in _inputs(0, 1, 4, 8, 4))
    with backend_device:  # the tensors built below: on the kernel's device
        parents = torch.tensor([-1, 0, 0, 1])
        call = lambda **kw: tree_conv1d(**{**dict(xBC=xbc, parents=parents, conv_state=conv_state, weight=weight,
                                                  bias=bias), **kw}, backend=backend)
        with pytest.raises(ValueError, match="first bad index 2"):
            call(parents=torch.tensor([-1, 0, 5, 1]))
        with pytest.raises(ValueError, match=r"conv_state must have shape \(1, 8, 4\)"):
            call(conv_state=conv_state[:, :, :3])
        with pytest.raises(ValueError, match=r"weight must have shape"):
            call(weight=weight[0])
        with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
            call(bias=bias[:5])
        with pytest.raises(ValueError, match="activation must be one of"):
            call(activation="gelu")
        with pytest.raises(TypeError, match="xBC must be float32"):
            call(xBC=xbc.long())
        with pytest.raises(ValueError, match="conv_state is on meta"):
            call(conv_state=conv_state.to("meta"))


@pytest.mark.parametrize("n", [2, 9])
def test_compiled_chains_gather_their_windows(n):
    """Under torch.compile a chain (every 2-node tree is one) gathers its windows as any tree does,
    which Inductor fuses with the taps and the SiLU; eager it stays the causal conv. The values
    are the definition's either way."""
    xbc, conv_state, weight, bias = _inputs(n, 2, n, 24, 4)
    shape = TreeShape.chain(n - 1)
    chain = shape.index()  # (as a model's pass hands it: an index checked once)
    graphs = []

    def capture(gm, example_inputs):  # a dynamo backend that only records the graph it is handed
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda x, s: tree_conv1d(x, chain, s, weight, bias, backend="torch"),
                             backend=capture, fullgraph=True)
    out = compiled(xbc, conv_state)
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    assert targets and not any("conv" in t for t in targets), targets
    expected = tree_conv1d_def(xbc, shape.parents_tensor(), conv_state, weight, bias, "silu")
    assert max_rel_error(out, expected) <= FP32_TOL
    with torch.profiler.profile() as prof:  # eager: one conv op
        eager = tree_conv1d(xbc, chain, conv_state, weight, bias, backend="torch")
    assert any("conv" in e.name for e in prof.events())
    assert max_rel_error(eager, out) <= FP32_TOL
