"""When ``backend="auto"`` takes the numba-compiled tree kernels (stree.kernels.cpu.tree_jit), and what
they keep of the PyTorch path's behaviour; their values are tested against the float64
definitions with the other backends (test_tree_scan.py, test_tree_conv1d.py)."""

import math

import pytest
import torch
from strategies import ssm_inputs

from stree.kernels import tree_conv1d, tree_scan
from stree.kernels import _common as kernels_common
from stree.kernels.cpu import tree_jit
from stree.testing import max_rel_error, tree_scan_def
from stree.tree import TreeShape

SHAPE = dict(ngroups=2, nheads=4, headdim=8, dstate=8)
OPTS = dict(dt_softplus=True, dt_limit=(0.0, math.inf), use_bias=True)


def _scan(inp, parents, **kw):
    return tree_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], parents, D=inp["D"], dt_bias=inp["dt_bias"],
                     initial_state=inp["initial_state"], **kw)


@pytest.fixture
def calls(monkeypatch):
    """How often each compiled kernel ran."""
    seen = {"scan": 0, "conv": 0, "chain": 0}
    for name, key in (("tree_scan_rows", "scan"), ("tree_conv_rows", "conv"), ("chain_scan_rows", "chain")):
        real = getattr(tree_jit, name)

        def counted(*a, _real=real, _key=key):
            seen[_key] += 1
            return _real(*a)
        monkeypatch.setattr(tree_jit, name, counted)
    return seen


@pytest.mark.parametrize("n", [1, 13, tree_jit.JIT_MAX_NODES, tree_jit.JIT_MAX_NODES + 1])
@pytest.mark.parametrize("chain", [True, False])
def test_auto_compiles_small_trees_long_chains_and_every_conv(n, chain, calls, monkeypatch):
    """The scan: a tree of at most JIT_MAX_NODES nodes takes the tree kernel, a longer chain (a
    prompt) the chain kernel, a longer deep tree (a chain with a fork, on two threads) the PyTorch
    path. The conv takes its kernel at any size."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    parents = TreeShape.chain(n - 1).parents_tensor()
    if not chain and n > 2:  # the last node forks off its grandparent
        parents[-1] = n - 3
    inp = ssm_inputs(torch.Generator().manual_seed(n), 2, n, SHAPE, OPTS)
    y = _scan(inp, parents)
    small, long_chain = n <= tree_jit.JIT_MAX_NODES, n > tree_jit.JIT_MAX_NODES and chain
    assert (calls["scan"], calls["chain"]) == (int(small), int(long_chain))
    assert max_rel_error(y, tree_scan_def(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], parents, D=inp["D"],
                                          dt_bias=inp["dt_bias"], initial_state=inp["initial_state"])) <= 1e-5
    conv_state, xbc = torch.randn(2, 16, 4), torch.randn(2, n, 16)
    weight, bias = torch.randn(16, 4), torch.randn(16)
    out = tree_conv1d(xbc, parents, conv_state, weight, bias)
    assert calls["conv"] == 1
    assert max_rel_error(out, tree_conv1d(xbc, parents, conv_state, weight, bias, backend="torch")) <= 1e-5


def _deep_and_shallow(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two trees of ``n`` nodes: a chain with its last node forked off its grandparent (mean depth
    about half the nodes) and a bushy one (each node's parent among the 4 before it, the
    first ``n // 8`` nodes under the root: mean depth a small share of the nodes)."""
    deep = TreeShape.chain(n - 1).parents_tensor()
    deep[-1] = n - 3
    g = torch.Generator().manual_seed(n)
    shallow = torch.tensor([-1] + [0 if i <= n // 8 else i - 1 - int(torch.randint(0, 4, (), generator=g))
                                   for i in range(1, n)])
    return deep, shallow


@pytest.mark.parametrize("n", [tree_jit.JIT_MAX_NODES + 1, 200])
def test_a_larger_tree_takes_the_tree_kernel_where_it_is_shallow(n, calls, monkeypatch):
    """Past JIT_MAX_NODES nodes the tree kernel's work is the nodes' depths, the PyTorch path's
    the square of the node count over the threads: a shallow tree takes the kernel (the same
    values as the definition), a deep one the batched products, and the line between them moves
    with the threads (SHALLOW / threads of the node count, as the nodes' mean depth)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    deep, shallow = _deep_and_shallow(n)
    inp = ssm_inputs(torch.Generator().manual_seed(n), 2, n, SHAPE, OPTS)
    for parents, kernel in ((deep, 0), (shallow, 1)):
        calls["scan"] = 0
        y = _scan(inp, parents)
        assert calls["scan"] == kernel and calls["chain"] == 0
        assert max_rel_error(y, tree_scan_def(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], parents,
                                              D=inp["D"], dt_bias=inp["dt_bias"],
                                              initial_state=inp["initial_state"])) <= 1e-5
    mean = float(TreeShape(tuple(shallow.tolist())).index().depth.float().mean())
    monkeypatch.setattr(torch, "get_num_threads", lambda: math.ceil(tree_jit.SHALLOW * n / mean) + 1)
    calls["scan"] = 0
    _scan(inp, shallow)  # (as many threads as make its mean depth too deep: the batched products)
    assert calls["scan"] == 0


def test_autograd_takes_the_pytorch_path_and_half_inputs_the_compiled_one(calls):
    """Training differentiates the tree scan: a tensor that needs gradients is never handed to
    numba. Half inputs are, through float32 copies (test_half_jit.py)."""
    parents = TreeShape.paper13().parents_tensor()
    inp = ssm_inputs(torch.Generator().manual_seed(0), 1, parents.shape[-1], SHAPE, OPTS)
    inp["x"].requires_grad_(True)
    _scan(inp, parents).sum().backward()
    assert calls["scan"] == 0 and inp["x"].grad is not None and bool(inp["x"].grad.abs().sum() > 0)
    with torch.no_grad():
        _scan(inp, parents)  # outside autograd the same tensors are compiled
    assert calls["scan"] == 1
    half = {k: (v.half() if k in ("x", "B", "C") else v) for k, v in inp.items()}
    with torch.no_grad():
        _scan(half, parents)
    assert calls["scan"] == 2


def test_a_nan_reaches_the_outputs_below_it():
    """The compiled kernels may reorder sums but assume nothing about finiteness: a NaN in a node's
    inputs must reach its own output and its descendants' (decoding checks the logits for it),
    and no other node's."""
    shape = TreeShape.paper13()
    parents = shape.parents_tensor()
    inp = ssm_inputs(torch.Generator().manual_seed(1), 1, shape.n, SHAPE, OPTS)
    inp["x"][0, 1, 0, 0] = float("nan")
    y = _scan(inp, parents)
    below = [i for i in range(shape.n) if 1 in _path(shape.parents, i)]
    nan = torch.isnan(y[0]).flatten(1).any(1)
    assert nan.nonzero().flatten().tolist() == below
    xbc = torch.randn(1, shape.n, 8)
    xbc[0, 1, 3] = float("nan")
    out = tree_conv1d(xbc, parents, torch.randn(1, 8, 4), torch.randn(8, 4))
    assert bool(torch.isnan(out[0, 1, 3])) and not bool(torch.isnan(out[0, 0]).any())


def _path(parents, i):
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path


def test_a_parameter_changed_in_place_or_given_new_memory_reaches_the_kernel():
    """The numpy view of a parameter is kept between calls (a decoding pass hands the kernels
    every layer's parameters): what it holds must always be the parameter's values now, after an
    optimiser's in-place step, a ``.data`` swap to new memory, and a swap to another layout of the
    same memory."""
    shape = TreeShape.paper13()
    parents = shape.parents_tensor()
    conv = torch.nn.Conv1d(8, 8, 4, groups=8)
    xbc, state = torch.randn(1, shape.n, 8), torch.randn(1, 8, 4)

    def check():
        with torch.no_grad():
            out = tree_conv1d(xbc, parents, state, conv.weight, conv.bias)
            ref = tree_conv1d(xbc, parents, state, conv.weight.detach().clone(), conv.bias.detach().clone(),
                              backend="torch")
        assert max_rel_error(out, ref) <= 1e-6

    check()
    with torch.no_grad():
        conv.weight.mul_(-2.0)
        conv.bias.add_(1.0)
    check()
    conv.weight.data = torch.randn(8, 1, 4)
    check()
    square = torch.nn.Parameter(torch.randn(4, 4))
    first = kernels_common.as_numpy(square).copy()
    square.data = square.data.t()  # the same memory, transposed
    assert (kernels_common.as_numpy(square) == first.T).all()


def _drivers_run(monkeypatch, names) -> list:
    """The list each of the drivers ``names`` appends its name to when it runs (it still runs)."""
    ran = []
    for name in names:
        def counted(*a, _real=getattr(tree_jit, name), _name=name):
            ran.append(_name)
            return _real(*a)
        monkeypatch.setattr(tree_jit, name, counted)
    return ran


def test_one_row_runs_alone_and_several_in_parallel_with_the_same_values(monkeypatch):
    """A single row takes the serial driver (a process decoding one row never compiles the
    parallel one), several rows with enough work the parallel driver (every call here, with
    ``PARALLEL_WORK`` at 1); each row comes out bit-identical either way, as both run the same row
    loops. (The conv without its SiLU: torch's SiLU computes a tensor's last partial vector with
    scalar code on AVX-512, so its bits depend on the tensor's length.)"""
    monkeypatch.setattr(tree_jit, "PARALLEL_WORK", 1)
    ran = _drivers_run(monkeypatch, ("_scan_serial", "_scan_parallel", "_conv_serial", "_conv_parallel"))
    shape = TreeShape.paper13()
    rows = torch.stack([TreeShape.chain(shape.n - 1).parents_tensor(), shape.parents_tensor(),
                        TreeShape.full(3, 2).parents_tensor()[: shape.n]])
    inp = ssm_inputs(torch.Generator().manual_seed(3), 3, shape.n, SHAPE, OPTS)
    xbc, state, weight, bias = torch.randn(3, shape.n, 16), torch.randn(3, 16, 4), torch.randn(16, 4), torch.randn(16)
    together = _scan(inp, rows), tree_conv1d(xbc, rows, state, weight, bias, activation=None)
    assert ran == ["_scan_parallel", "_conv_parallel"]
    for b in range(3):
        ran.clear()
        alone = {k: (v if v.dim() < 2 or k in ("A", "D", "dt_bias") else v[b: b + 1]) for k, v in inp.items()}
        assert torch.equal(_scan(alone, rows[b]), together[0][b: b + 1])
        alone_conv = tree_conv1d(xbc[b: b + 1], rows[b], state[b: b + 1], weight, bias, activation=None)
        assert torch.equal(alone_conv, together[1][b: b + 1])
        assert ran == ["_scan_serial", "_conv_serial"]


def test_a_long_chain_runs_its_rows_and_heads_alone_or_in_parallel_with_the_same_values(monkeypatch):
    """The chain kernel's drivers: the (row, head) pairs in parallel where the work pays for the
    threads, one row's heads too (a prompt's prefill is one row), else one after another; the same
    bits either way, as every head is the same loop over its own chain."""
    monkeypatch.setattr(tree_jit, "PARALLEL_WORK", 1)
    ran = _drivers_run(monkeypatch, ("_chain_serial", "_chain_parallel"))
    n = tree_jit.JIT_MAX_NODES + 9
    chain = TreeShape.chain(n - 1).parents_tensor()
    inp = ssm_inputs(torch.Generator().manual_seed(5), 3, n, SHAPE, OPTS)
    assert inp["x"].shape[2] > 1  # (heads to run apart)
    together = _scan(inp, chain)
    assert ran == ["_chain_parallel"]
    for b in range(3):
        alone = {k: (v if v.dim() < 2 or k in ("A", "D", "dt_bias") else v[b: b + 1]) for k, v in inp.items()}
        for work, driver in ((1, "_chain_parallel"), (1 << 62, "_chain_serial")):
            ran.clear()
            monkeypatch.setattr(tree_jit, "PARALLEL_WORK", work)
            assert torch.equal(_scan(alone, chain), together[b: b + 1])
            assert ran == [driver]


def test_rows_run_in_parallel_only_where_their_work_pays_for_the_threads(monkeypatch):
    """Several rows of little work (a small model's batch-2 tree) run on the serial driver: a
    parallel region's start, and numba's threads spinning after it, cost more than the rows
    save. Past ``PARALLEL_WORK`` elements (rows x nodes x heads x headdim x d_state for a scan,
    rows x nodes x channels x taps for the conv) they run in parallel."""
    ran = _drivers_run(monkeypatch, ("_scan_serial", "_scan_parallel", "_conv_serial", "_conv_parallel"))
    shape = TreeShape.paper13()
    inp = ssm_inputs(torch.Generator().manual_seed(4), 2, shape.n, SHAPE, OPTS)
    xbc, state, weight = torch.randn(2, shape.n, 16), torch.randn(2, 16, 4), torch.randn(16, 4)
    scan_work = inp["x"].numel() * inp["B"].shape[-1]
    assert scan_work < tree_jit.PARALLEL_WORK
    _scan(inp, shape.parents_tensor())
    tree_conv1d(xbc, shape.parents_tensor(), state, weight, None, activation=None)
    assert ran == ["_scan_serial", "_conv_serial"]
    ran.clear()
    monkeypatch.setattr(tree_jit, "PARALLEL_WORK", scan_work)  # the scan's work reaches it, the conv's does not
    _scan(inp, shape.parents_tensor())
    tree_conv1d(xbc, shape.parents_tensor(), state, weight, None, activation=None)
    assert xbc.numel() * 4 < scan_work and ran == ["_scan_parallel", "_conv_serial"]


def test_autograd_takes_the_pytorch_path_for_a_long_chain_too(calls):
    """A prompt's chain scanned for training (gradients wanted) is never handed to numba."""
    n = tree_jit.JIT_MAX_NODES + 3
    inp = ssm_inputs(torch.Generator().manual_seed(6), 1, n, SHAPE, OPTS)
    inp["x"].requires_grad_(True)
    _scan(inp, TreeShape.chain(n - 1).parents_tensor()).sum().backward()
    assert calls["chain"] == 0 and bool(inp["x"].grad.abs().sum() > 0)


@pytest.mark.skipif(not tree_jit.gemm.available(), reason="the tiled product cannot be built here")
def test_the_state_term_from_the_tiled_product_or_the_scans_own_loops_alike(monkeypatch):
    """The scan's state term comes from the tiled product where it is built (``gemm.takes_state``),
    else from the scan's own dot products: both within float32 rounding of the float64 definition,
    and of each other, on the serial driver and the parallel one."""
    shape = TreeShape.paper13()
    parents = shape.parents_tensor()
    inp = ssm_inputs(torch.Generator().manual_seed(5), 3, shape.n, SHAPE, OPTS)
    want = tree_scan_def(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], parents, D=inp["D"],
                         dt_bias=inp["dt_bias"], initial_state=inp["initial_state"])
    made = []
    real = tree_jit.state_terms
    monkeypatch.setattr(tree_jit, "state_terms", lambda *a: made.append(real(*a)) or made[-1])
    tiled = _scan(inp, parents, dt_softplus=True)
    monkeypatch.setattr(tree_jit.gemm, "takes_state", lambda d_state: False)
    own = _scan(inp, parents, dt_softplus=True)
    monkeypatch.setattr(tree_jit, "PARALLEL_WORK", 1)
    own_parallel = _scan(inp, parents, dt_softplus=True)
    assert made[0] is not None and made[1:] == [None, None]  # (the tiled product's, then the scan's own)
    for out in (tiled, own, own_parallel):
        assert max_rel_error(out, want) < 1e-5
    assert max_rel_error(tiled, own) < 1e-5


def test_a_small_trees_state_term_is_the_scans_own():
    """Below ``STATE_NODES`` nodes a row the product's call and packing cost more than the scan's own
    dot products: it is not asked, however many rows (a row's values never depend on the others)."""
    small = TreeShape.full(2, 1)  # (3 nodes)
    assert small.n < tree_jit.STATE_NODES
    inp = ssm_inputs(torch.Generator().manual_seed(6), 8, small.n, SHAPE, OPTS)
    C = inp["C"].numpy()
    assert tree_jit.state_terms(C, inp["initial_state"].numpy(), SHAPE["nheads"], SHAPE["headdim"]) is None
    assert not tree_jit.tiled_state(tree_jit.STATE_NODES - 1, 8)
    assert tree_jit.tiled_state(tree_jit.STATE_NODES, 8) == tree_jit.gemm.available()
