"""The numba kernels bound to a layer's parameters (stree.kernels.cpu.bound): on the activations a
model hands them (views of one product's output), the public kernels' results bit for bit, in
float32 and in half precision (a half layer's parameters bound widened, its outputs rounded where
the public kernels round); what they refuse to bind; the unchecked in-place replay of a model's
commit, a half conv state's too. The public kernels are tested against the float64 definitions
elsewhere."""

import math
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import ssm_shapes, trees

from stree.kernels import conv_step, gated_rms_norm, replay, rms_norm, selective_state_update, tree_conv1d, tree_scan
from stree.kernels.cpu import bound
from stree.kernels.cpu.bound import Mamba2LayerJit, RMSNormJit, aligned_array, replay_in_place
from stree.kernels.cpu.replay_jit import SWEEP
from stree.kernels.cpu.tree_jit import JIT_MAX_NODES
from stree.tree import tree_index

K = 4
DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])


def _layer(gen, shape, d_per_dim: bool, conv_bias: bool, gate_first: bool, narrow: bool = False,
           dtype=torch.float32):
    """A layer's parameters (of ``dtype``, A float32, as a model holds them) and sizes: conv over x,
    B, C; a norm over d_inner in ``ngroups`` groups. ``narrow``: MambaInLlama's d_xb variant (a
    group per head, d_state = headdim; x and B one head / group per pair of heads, repeated after
    the conv), where the heads pair up."""
    h, p, g, s = shape["nheads"], shape["headdim"], shape["ngroups"], shape["dstate"]
    narrow = narrow and h % 2 == 0
    if narrow:
        g, s = h, p
    d_inner = h * p
    x_dim = d_inner // 2 if narrow else d_inner
    b_dim = x_dim if narrow else g * s
    dim = x_dim + b_dim + g * s
    rnd = lambda *size: torch.randn(*size, generator=gen)
    params = dict(conv_weight=rnd(dim, 1, K) * 0.5, conv_bias=rnd(dim) * 0.1 if conv_bias else None,
                  A=-torch.rand(h, generator=gen) * 4, D=rnd(h, p) if d_per_dim else rnd(h), dt_bias=rnd(h) * 0.5,
                  norm_weight=rnd(d_inner))
    params = {k: v if v is None or k == "A" else v.to(dtype) for k, v in params.items()}
    wide = {k: v if v is None else v.float() for k, v in params.items()}
    jit = Mamba2LayerJit(**wide, group_size=d_inner // g, eps=1e-5, gate_first=gate_first, x_dim=x_dim,
                         B_dim=b_dim, d_state=s, dtype=dtype)
    return jit, params, dict(d_inner=d_inner, dim=dim, h=h, p=p, g=g, s=s, x_dim=x_dim, b_dim=b_dim)


def _split(proj, sz):
    """z, xBC, dt: views of one product's output, as a Mamba2 layer splits its in_proj."""
    return torch.split(proj, [sz["d_inner"], sz["dim"], sz["h"]], dim=-1)


def _ssm_inputs(conv, sz):
    """x, B, C as the PyTorch path makes them (mamba2.Mamba2Mixer._ssm_inputs)."""
    x, B, C = torch.split(conv, [sz["x_dim"], sz["b_dim"], sz["g"] * sz["s"]], dim=-1)
    x, B = x.unflatten(-1, (sz["x_dim"] // sz["p"], sz["p"])), B.unflatten(-1, (sz["b_dim"] // sz["s"], sz["s"]))
    if sz["x_dim"] != sz["d_inner"]:
        x, B = x.repeat_interleave(sz["h"] // x.shape[-2], dim=-2), B.repeat_interleave(sz["g"] // B.shape[-2], dim=-2)
    return x, B, C.unflatten(-1, (sz["g"], sz["s"]))


@settings(max_examples=30, deadline=None)
@given(tree=trees(max_n=JIT_MAX_NODES), shape=ssm_shapes(), d_per_dim=st.booleans(), conv_bias=st.booleans(),
       gate_first=st.booleans(), narrow=st.booleans(), limit=st.sampled_from([(0.0, math.inf), (0.002, 0.05)]),
       seed=st.integers(0, 99), dtype=DTYPES, rows_in_parallel=st.booleans())
def test_a_tree_pass_matches_the_public_kernels(tree, shape, d_per_dim, conv_bias, gate_first, narrow, limit, seed,
                                                dtype, rows_in_parallel):
    """From the in_proj output: the norm's output and replay's activations, as the public kernels
    make them from the layer's torch views; on the two compiled calls of a serial pass
    (stree.kernels.cpu.layer_jit) or, where rows have the work to run in parallel (made so here
    for small ones), on the separate kernels. Bit for bit but for the SiLU's last bit where these
    small sizes leave it a tail (_silu_tails); at a model's sizes bit for bit (the next test)."""
    with mock.patch.object(bound, "parallel_rows", lambda rows, work: rows_in_parallel and rows > 1):
        _tree_pass_matches(tree, shape, d_per_dim, conv_bias, gate_first, narrow, limit, seed, dtype,
                           exact=rows_in_parallel and tree[1] > 1)


@pytest.mark.parametrize("tiled_state", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tree", [(torch.tensor([-1, 0, 0, 1, 1, 2, 3]), 1), (torch.tensor([-1, 0, 1, 2]), 2)])
def test_at_a_models_sizes_a_tree_pass_matches_the_public_kernels_bit_for_bit(tree, dtype, tiled_state, monkeypatch):
    """Channels in whole vectors of the SiLU (conv 128, d_inner 64: :func:`_silu_tails` none), as
    every Mamba2 checkpoint's are: the serial pass's one SiLU of the conv's output and the gate
    equals the public kernels' two bit for bit; with the scan's state term from the tiled product
    (where it is built) or from the scan's own loops, both sides alike."""
    from stree.kernels.cpu import gemm
    if tiled_state and not gemm.available():
        pytest.skip(f"the tiled product cannot be built here: {gemm.unavailable_reason()}")
    from stree.kernels.cpu import tree_jit
    monkeypatch.setattr(tree_jit, "STATE_NODES", 1 if tiled_state else 1 << 30)  # (these trees are small)
    made = []
    real = gemm.state_term_unchecked
    monkeypatch.setattr(gemm, "state_term_unchecked", lambda *a: made.append(a) or real(*a))
    shape = dict(ngroups=1, nheads=2, headdim=32, dstate=32)
    for seed in range(3):
        _tree_pass_matches(tree, shape, False, True, False, False, (0.0, math.inf), seed, dtype, exact=True)
    assert bool(made) == tiled_state


def _silu_tails(sz) -> bool:
    """Whether torch's vectorised SiLU on the CPU takes the last channels of the conv's output or
    the gate in its scalar loop, whose exp rounds otherwise than the vector lanes': for channels
    not in whole pairs of vectors (64 floats covers AVX-512's and AVX2's), their SiLU depends on
    where they lie, and the serial bound pass takes the two in one call, the public kernels in two."""
    return sz["dim"] % 64 != 0 or sz["d_inner"] % 64 != 0


def _same(a, b, exact: bool) -> bool:
    """Equal; or, where ``exact`` is False, within the SiLU's last bit carried through: a few float32
    roundings, or one rounding of a half type."""
    if exact:
        return torch.equal(a, b)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[a.dtype]
    return a.dtype == b.dtype and torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


def _tree_pass_matches(tree, shape, d_per_dim, conv_bias, gate_first, narrow, limit, seed, dtype, exact=False):
    parents, batch = tree
    gen = torch.Generator().manual_seed(seed)
    jit, prm, sz = _layer(gen, shape, d_per_dim, conv_bias, gate_first, narrow, dtype)
    n = parents.shape[-1]
    index = tree_index(parents).for_batch(batch)
    proj = torch.randn(batch, n, sz["d_inner"] + sz["dim"] + sz["h"], generator=gen).to(dtype)
    conv_state = torch.randn(batch, sz["dim"], K, generator=gen).to(dtype)
    ssm_state = torch.randn(batch, sz["h"], sz["p"], sz["s"], generator=gen)
    states = conv_state.clone(), ssm_state.clone()

    out, scratch = jit.tree(proj, index.parents, conv_state, ssm_state, limit)
    z, xBC, dt = _split(proj, sz)
    x, B, C = _ssm_inputs(tree_conv1d(xBC, parents, conv_state, prm["conv_weight"], prm["conv_bias"]), sz)
    y = tree_scan(x, dt, prm["A"], B, C, parents, D=prm["D"], dt_bias=prm["dt_bias"], dt_limit=limit,
                  initial_state=ssm_state)
    want = gated_rms_norm(y.flatten(-2), z, prm["norm_weight"], sz["d_inner"] // sz["g"], 1e-5, gate_first)
    exact = exact or not _silu_tails(sz)
    assert out.dtype == dtype and _same(out, want, exact)
    assert all(a.dtype == dtype and torch.equal(a, b) for a, b in zip((scratch[0], scratch[2]), (xBC, dt)))
    assert all(a.dtype == dtype and _same(a, b, exact) for a, b in zip((scratch[1], scratch[3]), (x, B)))
    assert torch.equal(conv_state, states[0]) and torch.equal(ssm_state, states[1])  # (read only)
    into = tuple(np.full((batch, n, *tail), np.nan, dtype=np.float32) for tail in jit.scratch_tails())
    again, none = jit.tree(proj, index.parents, conv_state, ssm_state, limit, into)
    assert none is None and torch.equal(again, out)
    # (exactly what the pass keeps when it returns them)
    assert all(torch.equal(torch.from_numpy(a), b.float()) for a, b in zip(into, scratch))


@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 3), shape=ssm_shapes(), d_per_dim=st.booleans(), conv_bias=st.booleans(),
       gate_first=st.booleans(), narrow=st.booleans(), limit=st.sampled_from([(0.0, math.inf), (0.002, 0.05)]),
       seed=st.integers(0, 99), dtype=DTYPES)
def test_a_step_matches_the_public_kernels_bit_for_bit(batch, shape, d_per_dim, conv_bias, gate_first, narrow, limit,
                                                       seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    jit, prm, sz = _layer(gen, shape, d_per_dim, conv_bias, gate_first, narrow, dtype)
    proj = torch.randn(batch, sz["d_inner"] + sz["dim"] + sz["h"], generator=gen).to(dtype)
    conv_state = torch.randn(batch, sz["dim"], K, generator=gen).to(dtype)
    ssm_state = torch.randn(batch, sz["h"], sz["p"], sz["s"], generator=gen)
    conv_ref, ssm_ref = conv_state.clone(), ssm_state.clone()

    out = jit.step(proj, conv_state, ssm_state, limit)
    z, xBC, dt = _split(proj, sz)
    x, B, C = _ssm_inputs(conv_step(xBC, conv_ref, prm["conv_weight"], prm["conv_bias"]), sz)
    y = selective_state_update(ssm_ref, x, dt, prm["A"], B, C, D=prm["D"], dt_bias=prm["dt_bias"], dt_limit=limit)
    want = gated_rms_norm(y.flatten(-2), z, prm["norm_weight"], sz["d_inner"] // sz["g"], 1e-5, gate_first)
    assert out.dtype == dtype and torch.equal(out, want)
    assert torch.equal(conv_state, conv_ref) and torch.equal(ssm_state, ssm_ref)


@pytest.mark.parametrize("shape", [(1, 16), (13, 40), (2, 5, 24)])
def test_an_rms_norm_matches_the_public_kernel_bit_for_bit(shape):
    gen = torch.Generator().manual_seed(len(shape))
    x, weight = torch.randn(*shape, generator=gen), torch.randn(shape[-1] // 2, generator=gen)
    for rows in (x[..., : shape[-1] // 2], x[..., ::2]):  # (views of another tensor's memory)
        assert torch.equal(RMSNormJit(weight, 1e-6)(rows), rms_norm(rows, weight, 1e-6))


def test_only_cpu_float32_parameters_of_matching_shapes_are_bound():
    gen = torch.Generator().manual_seed(0)
    _, prm, sz = _layer(gen, dict(nheads=2, headdim=4, ngroups=1, dstate=4), False, True, True)
    sizes = dict(x_dim=sz["x_dim"], B_dim=sz["b_dim"], d_state=sz["s"])
    kw = dict(group_size=8, eps=1e-5, gate_first=True, **sizes)
    with pytest.raises(TypeError, match="dt_bias must be a CPU float32 tensor"):
        Mamba2LayerJit(**{**prm, "dt_bias": prm["dt_bias"].bfloat16()}, **kw)
    with pytest.raises(TypeError, match="conv_weight must be a CPU float32 tensor"):
        Mamba2LayerJit(**{**prm, "conv_weight": prm["conv_weight"].double()}, **kw)
    with pytest.raises(ValueError, match="conv_bias must have shape"):
        Mamba2LayerJit(**{**prm, "conv_bias": prm["conv_bias"][:-1]}, **kw)
    with pytest.raises(ValueError, match="dt_bias, D and the norm.s channels must come in A.s 2 heads"):
        Mamba2LayerJit(**{**prm, "D": torch.ones(3)}, **kw)
    with pytest.raises(ValueError, match="group_size"):
        Mamba2LayerJit(**prm, **{**kw, "group_size": 3})
    with pytest.raises(ValueError, match="do not split the conv's 16 channels"):
        Mamba2LayerJit(**prm, **{**kw, "B_dim": 6})
    with pytest.raises(TypeError, match="dtype must be float32, float16 or bfloat16, got torch.float64"):
        Mamba2LayerJit(**prm, **kw, dtype=torch.float64)
    with pytest.raises(TypeError, match="weight must be a CPU float32 tensor"):
        RMSNormJit(torch.ones(4, dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match="weight must have shape"):
        RMSNormJit(torch.ones(2, 4), 1e-6)


@settings(max_examples=25, deadline=None)
@given(layers=st.integers(1, 3), batch=st.integers(1, 3), shape=ssm_shapes(), n=st.integers(1, 4 * SWEEP + 3),
       limit=st.sampled_from([(0.0, math.inf), (0.002, 0.05)]), seed=st.integers(0, 99), data=st.data(),
       dtype=DTYPES)
def test_a_commits_replay_in_place_matches_the_public_kernel_bit_for_bit(layers, batch, shape, n, limit, seed, data,
                                                                       dtype):
    """On a stack of layers, every row its own accepted chain (one to several sweeps of SWEEP
    tokens, the last partial or whole), in place on the states: the public replay's new states
    exactly. A half model's conv state and activations: the public replay on them, the in-place one
    on the activations widened (the bound kernels' scratch)."""
    gen = torch.Generator().manual_seed(seed)
    h, p, g, s = shape["nheads"], shape["headdim"], shape["ngroups"], shape["dstate"]
    dim = h * p + 2 * g * s
    rnd = lambda *size: torch.randn(*size, generator=gen)  # noqa: E731
    xBC, x, dt, B = rnd(layers, batch, n, dim), rnd(layers, batch, n, h, p), rnd(layers, batch, n, h), \
        rnd(layers, batch, n, g, s)
    A, dt_bias = -torch.rand(layers, h, generator=gen) * 4, rnd(layers, h) * 0.5
    ssm, conv = rnd(layers, batch, h, p, s), rnd(layers, batch, dim, K).to(dtype)
    num = torch.tensor([data.draw(st.integers(1, n)) for _ in range(batch)])
    accepted = torch.zeros(batch, n, dtype=torch.long)
    for b in range(batch):  # a chain through distinct nodes, root first
        accepted[b, 1: int(num[b])] = torch.randperm(n - 1, generator=gen)[: int(num[b]) - 1] + 1
    acts = [t.to(dtype) for t in (xBC, x, dt, B)]
    want = replay(ssm, conv, *acts, A, accepted, num, dt_bias=dt_bias.to(dtype), dt_limit=limit, validate=False)
    replay_in_place(ssm, conv, *(t.float() for t in acts), A, dt_bias.to(dtype).float(), accepted, num, limit)
    assert conv.dtype == dtype and torch.equal(ssm, want[0]) and torch.equal(conv, want[1])


@pytest.mark.parametrize("shape", [(1, 13, 8, 64), (2, 5, 3, 7), (1,)])
def test_the_scans_output_starts_on_a_64_byte_boundary(shape):
    """The tree scan adds into its output's rows in place, at half speed where they sit off a
    32-byte boundary (NumPy aligns to 16): the bound pass allocates it aligned, as torch does."""
    for _ in range(8):  # (NumPy's own allocations land on either side of a 32-byte boundary)
        y = aligned_array(shape)
        assert y.shape == shape and y.dtype == np.float32 and y.flags.c_contiguous
        assert y.__array_interface__["data"][0] % 64 == 0
