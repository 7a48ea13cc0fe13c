import importlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import dt_options, ssm_inputs, ssm_shapes, trees

from stree.drafters.calibrate import stand_initial_tree
from stree.kernels import MAX_TREE_NODES, multistep_update, tree_scan, tree_scan_torch
from stree.kernels.cpu import tree_jit
from stree.kernels.tree_scan import CHAIN_BLOCK, FUSED_NODES, PATH_SUMS
from stree.testing import max_rel_error, tree_scan_def
from stree.tree import TreeShape, tree_index

FP32_TOL = 1e-5


def _run(inp, parents, dt_opts, backend, device):
    to = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t
    return tree_scan(to(inp["x"]), to(inp["dt"]), to(inp["A"]), to(inp["B"]), to(inp["C"]), to(parents),
                     D=to(inp["D"]), dt_bias=to(inp["dt_bias"]), dt_softplus=dt_opts["dt_softplus"],
                     dt_limit=dt_opts["dt_limit"], initial_state=to(inp.get("initial_state")), backend=backend)


def _definition(inp, parents, dt_opts):
    return tree_scan_def(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], parents, D=inp["D"],
                         dt_bias=inp["dt_bias"], dt_softplus=dt_opts["dt_softplus"], dt_limit=dt_opts["dt_limit"],
                         initial_state=inp.get("initial_state"))


@given(tree=trees(), shape=ssm_shapes(), dt_opts=dt_options(), D_kind=st.sampled_from(["none", "head", "dim"]),
       with_state=st.booleans(), seed=st.integers(0, 2**16))
def test_matches_definition_on_random_trees(tree, shape, dt_opts, D_kind, with_state, seed, device, poison):
    parents, batch = tree
    n = parents.shape[-1]
    inp = ssm_inputs(torch.Generator().manual_seed(seed), batch, n, shape, dt_opts, D_kind=D_kind)
    if not with_state:
        inp["initial_state"] = None
    expected = _definition(inp, parents, dt_opts)
    for backend, dev in (("torch", torch.device("cpu")), ("auto", torch.device("cpu")), ("triton", device)):
        y = _run(inp, parents, dt_opts, backend, dev)
        assert y.dtype == torch.float32 and y.shape == inp["x"].shape
        assert max_rel_error(y, expected) <= FP32_TOL, backend


@pytest.mark.parametrize("n", [65, 130, 625])
def test_multi_tile_trees(n, device, poison):
    """Trees over 32 nodes span several row and column tiles of the Triton kernel; 625 is STAND's
    initial tree (depth 20), the largest a decoding step uses."""
    gen = torch.Generator().manual_seed(n)
    if n == 625:
        parents = stand_initial_tree().parents_tensor()
    else:
        parents = torch.tensor([-1] + [int(torch.randint(max(0, i - 8), i, (1,), generator=gen)) for i in range(1, n)])
    # two p-blocks and two d_state slices as well; at 625 nodes (40 row tiles, each looping over all
    # earlier column tiles) one head and one block each, to keep the interpreter's time down
    shape = dict(ngroups=1, nheads=2, headdim=72, dstate=40) if n < 625 else dict(ngroups=1, nheads=1, headdim=16,
                                                                                  dstate=8)
    opts = dict(dt_softplus=True, dt_limit=(0.0, math.inf), use_bias=True)
    inp = ssm_inputs(gen, 1, n, shape, opts)
    expected = _definition(inp, parents, opts)
    assert max_rel_error(_run(inp, parents, opts, "triton", device), expected) <= FP32_TOL
    assert max_rel_error(_run(inp, parents, opts, "torch", torch.device("cpu")), expected) <= FP32_TOL


@settings(max_examples=6, deadline=None)
@given(n=st.integers(CHAIN_BLOCK + 1, 2 * CHAIN_BLOCK + 7), shape=ssm_shapes(), dt_opts=dt_options(),
       D_kind=st.sampled_from(["none", "head", "dim"]), with_state=st.booleans(), per_row=st.booleans(),
       seed=st.integers(0, 2**16))
def test_long_chains_scan_block_by_block(n, shape, dt_opts, D_kind, with_state, per_row, seed, poison, monkeypatch):
    """A chain longer than CHAIN_BLOCK (a prefill) runs block by block on the PyTorch path, each
    block from the state the ones before it left, and as its recurrence in the compiled CPU
    kernel under "auto": the same outputs as the definition. A batch whose rows are not all
    chains keeps the whole-tree masks on both."""
    module = importlib.import_module("stree.kernels.tree_scan")  # (the package's tree_scan is the function)
    blocks, recurrences = [], []
    real = module._chain_blocks
    monkeypatch.setattr(module, "_chain_blocks", lambda *a: blocks.append(1) or real(*a))
    recurrence = tree_jit.chain_scan_rows
    monkeypatch.setattr(tree_jit, "chain_scan_rows", lambda *a: recurrences.append(1) or recurrence(*a))
    chain = TreeShape.chain(n - 1).parents_tensor()
    parents = torch.stack([chain, chain]) if per_row else chain
    inp = ssm_inputs(torch.Generator().manual_seed(seed), 2, n, shape, dt_opts, D_kind=D_kind)
    if not with_state:
        inp["initial_state"] = None
    for backend in ("torch", "auto"):
        assert max_rel_error(_run(inp, parents, dt_opts, backend, torch.device("cpu")),
                             _definition(inp, parents, dt_opts)) <= FP32_TOL, backend
    assert len(blocks) == 1 and len(recurrences) == 1
    mixed = torch.stack([chain, torch.cat([chain[:-1], torch.tensor([n - 3])])])  # row 1: the last node forks
    for backend in ("torch", "auto"):
        assert max_rel_error(_run(inp, mixed, dt_opts, backend, torch.device("cpu")),
                             _definition(inp, mixed, dt_opts)) <= FP32_TOL, backend
    assert len(blocks) == 1 and len(recurrences) == 1


@settings(max_examples=40, deadline=None)
@given(tree=trees(max_n=FUSED_NODES), heads=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_path_sums_are_the_ancestor_masks_product(tree, heads, seed):
    """What a compiled pass sums Atree with (gathers level by level, one tree for the batch or one
    per row) is the ancestor mask's product, in float64; it is made with the masks, for the
    trees a compiled pass fuses only."""
    module = importlib.import_module("stree.kernels.tree_scan")
    parents, batch = tree
    index = tree_index(parents)
    v = torch.randn(batch, index.n, heads, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    mask, _, paths = module._masks(index)
    assert paths.shape == (index.rows, int(index.depth.max()) + 1, index.n)
    assert torch.allclose(module._path_sums(v, paths), mask.double() @ v, rtol=1e-12, atol=1e-12)
    assert module._masks(tree_index(torch.arange(-1, FUSED_NODES)))[2] is None  # (FUSED_NODES + 1 nodes)


@settings(max_examples=8, deadline=None)
@given(tree=trees(max_n=FUSED_NODES + 8), shape=ssm_shapes(), dt_opts=dt_options(), with_state=st.booleans(),
       seed=st.integers(0, 2**16))
def test_traced_trees_match_the_definition(tree, shape, dt_opts, with_state, seed, monkeypatch):
    """Traced by torch.compile (the compiled decode path), a tree of at most FUSED_NODES nodes
    multiplies by broadcast products summed and (PATH_SUMS nodes in all its rows or more) sums
    Atree along each node's path level by level, which Inductor fuses, a larger one by batched
    matmuls: the definition's outputs either way, one tree for the batch or one per row.
    (``aot_eager`` runs the traced graph with PyTorch's own kernels: the formula is under test
    here, Inductor in tests/runtime.)"""
    module = importlib.import_module("stree.kernels.tree_scan")
    fused, real, real_sums = [], module._product, module._path_sums
    monkeypatch.setattr(module, "_product", lambda a, b: fused.append(1) or real(a, b))
    monkeypatch.setattr(module, "_path_sums", lambda v, paths: fused.append(2) or real_sums(v, paths))
    parents, batch = tree
    n = parents.shape[-1]
    inp = ssm_inputs(torch.Generator().manual_seed(seed), batch, n, shape, dt_opts, D_kind="head")
    if not with_state:
        inp["initial_state"] = None
    expected = _definition(inp, parents, dt_opts)
    torch._dynamo.reset()  # (a graph per example: past dynamo's recompile limit it would run eager)
    traced = torch.compile(lambda: _run(inp, parents, dt_opts, "torch", torch.device("cpu")), backend="aot_eager",
                           dynamic=False)
    assert max_rel_error(traced(), expected) <= FP32_TOL
    assert (1 in fused, 2 in fused) == (n <= FUSED_NODES, n <= FUSED_NODES and batch * n >= PATH_SUMS)
    fused.clear()
    assert max_rel_error(_run(inp, parents, dt_opts, "torch", torch.device("cpu")), expected) <= FP32_TOL
    assert not fused  # (eager: the batched matmuls)


def test_tree_index_knows_a_chain():
    chain = TreeShape.chain(5).parents_tensor()
    assert tree_index(chain).is_chain() and tree_index(torch.stack([chain, chain])).is_chain()
    assert not tree_index(torch.tensor([-1, 0, 0])).is_chain()
    assert not tree_index(torch.stack([chain, torch.tensor([-1, 0, 1, 2, 3, 3])])).is_chain()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_half_precision_inputs(dtype, backend, device, poison):
    if backend == "triton" and dtype == torch.bfloat16 and device.type != "cuda":
        pytest.skip("the Triton interpreter computes bf16 tl.dot wrongly (numpy has no bfloat16); run on CUDA")
    shape_ = TreeShape.paper13()
    shape = dict(ngroups=2, nheads=4, headdim=16, dstate=16)
    opts = dict(dt_softplus=True, dt_limit=(0.0, math.inf), use_bias=True)
    inp = ssm_inputs(torch.Generator().manual_seed(1), 2, shape_.n, shape, opts, dtype=dtype)
    y = _run(inp, shape_.parents_tensor(), opts, backend, device if backend == "triton" else torch.device("cpu"))
    assert y.dtype == dtype
    assert max_rel_error(y, _definition(inp, shape_.parents_tensor(), opts)) <= (1e-2 if dtype == torch.bfloat16 else 2e-3)


def test_chain_equals_multistep_and_transformers_chunk_scan(device):
    """On a chain the tree scan is Mamba2's SSD with an initial state: compare with our fused
    recurrence and with transformers' independent PyTorch chunk scan."""
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    n = 23
    shape = dict(ngroups=2, nheads=4, headdim=8, dstate=16)
    opts = dict(dt_softplus=True, dt_limit=(0.0, math.inf), use_bias=True)
    inp = ssm_inputs(torch.Generator().manual_seed(3), 2, n, shape, opts)
    chain = TreeShape.chain(n - 1).parents_tensor()
    y_tree = _run(inp, chain, opts, "triton", device).cpu()
    y_ref = _run(inp, chain, opts, "torch", torch.device("cpu"))
    y_ms, _ = multistep_update(inp["initial_state"].to(device), inp["x"].to(device), inp["dt"].to(device),
                               inp["A"].to(device), inp["B"].to(device), inp["C"].to(device), D=inp["D"].to(device),
                               dt_bias=inp["dt_bias"].to(device), backend="triton")
    y_hf = mamba2_chunk_scan(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk_size=8, D=inp["D"],
                             dt_bias=inp["dt_bias"], initial_states=inp["initial_state"], dt_softplus=True)
    assert y_hf.abs().max() > 0.1  # a real signal, not two zero tensors agreeing
    for y in (y_tree, y_ref, y_ms.cpu()):
        assert max_rel_error(y, y_hf) <= FP32_TOL


def test_strided_views_as_a_model_produces_them(device):
    """x, B, C sliced out of one conv output and dt out of the in_proj output, as the Mamba2 layer
    does: the kernel must follow the strides, not assume contiguity."""
    g = torch.Generator().manual_seed(6)
    shape = TreeShape.paper13()
    b, n, h, p, grp, s = 2, shape.n, 4, 8, 2, 8
    xbc = torch.randn(b, n, h * p + 2 * grp * s, generator=g)
    zxbcdt = torch.randn(b, n, 5 + h, generator=g)
    x = xbc[..., : h * p].unflatten(-1, (h, p))
    B = xbc[..., h * p : h * p + grp * s].unflatten(-1, (grp, s))
    C = xbc[..., h * p + grp * s :].unflatten(-1, (grp, s))
    dt = zxbcdt[..., 5:]
    assert not (x.is_contiguous() or B.is_contiguous() or dt.is_contiguous())
    A, D, x0 = -torch.rand(h, generator=g) * 4, torch.randn(h, generator=g), torch.randn(b, h, p, s, generator=g)
    parents = shape.parents_tensor()
    expected = tree_scan_def(x, dt, A, B, C, parents, D=D, initial_state=x0)
    for backend, dev in (("triton", device), ("auto", torch.device("cpu"))):
        y = tree_scan(*(t.to(dev) for t in (x, dt, A, B, C, parents)), D=D.to(dev), initial_state=x0.to(dev),
                      backend=backend)
        assert max_rel_error(y, expected) <= FP32_TOL, backend


def test_inputs_on_two_devices_are_refused(device):
    other = "cpu" if device.type == "cuda" else "meta"
    a = {k: v.to(device) for k, v in _args().items()}
    with pytest.raises(ValueError, match=f"parents is on {other}"):
        tree_scan(*(a[k] for k in ("x", "dt", "A", "B", "C")), a["parents"].to(other), backend="triton")
    with pytest.raises(ValueError, match=f"C is on {other}"):
        tree_scan(*(a[k] for k in ("x", "dt", "A", "B")), a["C"].to(other), a["parents"], backend="triton")


def test_tree_index_is_accepted_and_shared_across_batch(device):
    shape = TreeShape.full(3, 2)
    opts = dict(dt_softplus=True, dt_limit=(0.0, math.inf), use_bias=False)
    inp = ssm_inputs(torch.Generator().manual_seed(4), 3, shape.n, dict(ngroups=1, nheads=2, headdim=4, dstate=4), opts)
    parents = shape.parents_tensor()
    by_index = _run(inp, tree_index(parents.to(device)), opts, "triton", device)
    per_row = _run(inp, parents.expand(3, -1).contiguous(), opts, "triton", device)
    torch.testing.assert_close(by_index, per_row, rtol=0, atol=0)


def test_inputs_are_not_modified(device):
    shape = TreeShape.paper13()
    opts = dict(dt_softplus=True, dt_limit=(0.0, math.inf), use_bias=True)
    inp = ssm_inputs(torch.Generator().manual_seed(5), 1, shape.n, dict(ngroups=1, nheads=2, headdim=4, dstate=4), opts)
    inp = {k: v.to(device) for k, v in inp.items()}
    before = {k: v.clone() for k, v in inp.items()}
    _run(inp, shape.parents_tensor(device), opts, "triton", device)
    for k in inp:
        assert torch.equal(inp[k], before[k]), k


def _args(n=5, batch=1, nheads=2, headdim=4, dstate=4, ngroups=1, device=None):
    """Inputs drawn on the CPU, then on ``device`` (default: torch's default device)."""
    device = torch.get_default_device() if device is None else device
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, device="cpu").to(device)
    return dict(x=r(batch, n, nheads, headdim), dt=r(batch, n, nheads), A=-r(nheads).abs(),
                B=r(batch, n, ngroups, dstate), C=r(batch, n, ngroups, dstate), parents=torch.arange(-1, n - 1).to(device))


def _call(backend, **kw):
    a = _args()
    a.update(kw)
    return tree_scan(a.pop("x"), a.pop("dt"), a.pop("A"), a.pop("B"), a.pop("C"), a.pop("parents"), **a, backend=backend)


@pytest.mark.parametrize("backend", ["torch", "auto", "triton"])
def test_bad_inputs_raise_clear_errors(backend, backend_device):
    torch.manual_seed(0)
    with backend_device:  # the tensors built below: on the kernel's device
        a = _args()
        with pytest.raises(ValueError, match=r"first bad index 3"):
            _call(backend, parents=torch.tensor([-1, 0, 1, 3, 2]))
        with pytest.raises(ValueError, match=r"root must have parent -1"):
            _call(backend, parents=torch.tensor([0, 0, 1, 2, 3]))
        with pytest.raises(TypeError, match="parents must have an integer dtype"):
            _call(backend, parents=torch.tensor([-1.0, 0, 1, 2, 3]))
        with pytest.raises(ValueError, match="parents describes 4 nodes"):
            _call(backend, parents=torch.tensor([-1, 0, 1, 2]))
        with pytest.raises(ValueError, match=r"dt must have shape \(1, 5, 2\)"):
            _call(backend, dt=a["dt"][:, :4])
        with pytest.raises(TypeError, match="B must have dtype torch.float32"):
            _call(backend, B=a["B"].half())
        with pytest.raises(ValueError, match=r"nheads \(2\) must be a multiple of ngroups \(3\)"):
            _call(backend, B=torch.randn(1, 5, 3, 4), C=torch.randn(1, 5, 3, 4))
        with pytest.raises(TypeError, match="initial_state must have dtype torch.float32"):
            _call(backend, initial_state=torch.zeros(1, 2, 4, 4, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match=r"D must have shape"):
            _call(backend, D=torch.ones(3))
        with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16"):
            _call(backend, x=a["x"].double())
        with pytest.raises(ValueError, match="dt_limit must satisfy lo <= hi"):
            _call(backend, dt_limit=(1.0, 0.5))
        with pytest.raises(ValueError, match=r"dt is on meta but x is on (cpu|cuda)"):
            _call(backend, dt=a["dt"].to("meta"))
        with pytest.raises(ValueError, match=r"parents is on meta but x is on (cpu|cuda)"):
            _call(backend, parents=a["parents"].to("meta"))
        with pytest.raises(ValueError, match="backend must be one of"):
            tree_scan(*[a[k] for k in ("x", "dt", "A", "B", "C", "parents")], backend="cuda")


def test_more_than_max_tree_nodes_is_refused():
    n = MAX_TREE_NODES + 1
    a = _args(n=n)
    with pytest.raises(ValueError, match=rf"at most {MAX_TREE_NODES} nodes, got n = {n}"):
        tree_scan_torch(a["x"], a["dt"], a["A"], a["B"], a["C"], a["parents"])


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    from stree.kernels import _common

    monkeypatch.setattr(_common, "TRITON_INTERPRETED", False)
    a = _args()
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1 set before stree.kernels is imported"):
        tree_scan(*(a[k] for k in ("x", "dt", "A", "B", "C", "parents")), backend="triton")
    assert tree_scan(*(a[k] for k in ("x", "dt", "A", "B", "C", "parents"))).shape == a["x"].shape  # auto -> torch
