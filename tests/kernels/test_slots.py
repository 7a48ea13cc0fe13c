"""The engine convention of the tree and step kernels: the committed states are a pool of slots,
row b's in slot ``state_indices[b]`` (any order; a negative id is a padding row with no state).
Every backend's tree_scan, tree_conv1d and tree_attention (a KV prefix per slot) on the pool
equal the padded call on the rows' own states (zeros, or no prefix, for padding rows), and the step's conv_step and selective_state_update advance the
named slots in place as the padded call advances the rows, on random trees and pools whose
other slots hold NaN (a read of a slot not named, or of one for a padding row, cannot pass, and
a write there shows); bad slot tables are refused. (replay's: tests/kernels/test_replay.py.)"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import by, dt_options, ssm_inputs, ssm_shapes, trees

from stree.kernels import conv_step, selective_state_update, tree_attention, tree_conv1d, tree_scan

TOL = 1e-5
BACKENDS = ("torch", "auto", "triton")


@st.composite
def slot_tables(draw, batch, seed):
    """(state_indices [batch], slots): distinct slots in random order, some rows padding."""
    slots = batch + draw(st.integers(0, 3))
    order = torch.randperm(slots, generator=torch.Generator().manual_seed(seed))[:batch]
    pad = torch.tensor(draw(st.lists(st.booleans(), min_size=batch, max_size=batch)))
    return torch.where(pad, -1, order).int(), slots


def _pool(rows: torch.Tensor, state_indices: torch.Tensor, slots: int) -> torch.Tensor:
    """A pool of NaN with each real row's state in its slot."""
    pool = torch.full((slots, *rows.shape[1:]), float("nan"), dtype=rows.dtype)
    real = torch.nonzero(state_indices >= 0).flatten()
    pool[state_indices[real].long()] = rows[real]
    return pool


def _padded(rows: torch.Tensor, state_indices: torch.Tensor) -> torch.Tensor:
    """The rows' states as the padded call takes them: zeros for padding rows."""
    return torch.where((state_indices >= 0).view(-1, *([1] * (rows.dim() - 1))), rows, torch.zeros(()))


@given(data=st.data(), tree=trees(max_n=24), shape=ssm_shapes(), dt_opts=dt_options(), seed=st.integers(0, 2**16))
def test_tree_scan_from_slots_matches_the_padded_call(data, tree, shape, dt_opts, seed, device, poison):
    parents, batch = tree
    inp = ssm_inputs(torch.Generator().manual_seed(seed), batch, parents.shape[-1], shape, dt_opts)
    state_indices, slots = data.draw(slot_tables(batch, seed))
    kw = dict(D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=dt_opts["dt_softplus"], dt_limit=dt_opts["dt_limit"])
    args = [inp[k] for k in ("x", "dt", "A", "B", "C")] + [parents]
    want = tree_scan(*args, **kw, initial_state=_padded(inp["initial_state"], state_indices), backend="torch")
    pool = _pool(inp["initial_state"], state_indices, slots)
    for backend in BACKENDS:
        dev = device if backend == "triton" else torch.device("cpu")
        to = lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t
        got = tree_scan(*map(to, args), **{k: to(v) for k, v in kw.items()}, initial_state=to(pool),
                        state_indices=to(state_indices), backend=backend)
        torch.testing.assert_close(got.cpu(), want, rtol=TOL, atol=TOL, msg=by(backend))


@given(data=st.data(), tree=trees(max_n=24), d_conv=st.sampled_from([1, 2, 4]), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_tree_conv1d_from_slots_matches_the_padded_call(data, tree, d_conv, bias, seed, device, poison):
    parents, batch = tree
    gen = torch.Generator().manual_seed(seed)
    dim = 12
    xBC = torch.randn(batch, parents.shape[-1], dim, generator=gen)
    conv = torch.randn(batch, dim, d_conv, generator=gen)
    weight, b = torch.randn(dim, d_conv, generator=gen), torch.randn(dim, generator=gen) if bias else None
    state_indices, slots = data.draw(slot_tables(batch, seed))
    want = tree_conv1d(xBC, parents, _padded(conv, state_indices), weight, b, backend="torch")
    pool = _pool(conv, state_indices, slots)
    for backend in BACKENDS:
        dev = device if backend == "triton" else torch.device("cpu")
        to = lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t
        got = tree_conv1d(to(xBC), to(parents), to(pool), to(weight), to(b), state_indices=to(state_indices),
                          backend=backend)
        torch.testing.assert_close(got.cpu(), want, rtol=TOL, atol=TOL, msg=by(backend))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_slot_tables_are_refused(backend, backend_device):
    inp = ssm_inputs(torch.Generator().manual_seed(0), 2, 3, dict(nheads=2, headdim=4, ngroups=1, dstate=4),
                     dict(dt_softplus=True, dt_limit=(0.0, float("inf")), use_bias=False))
    inp = {k: v if v is None else v.to(backend_device) for k, v in inp.items()}
    with backend_device:  # the tensors built below: on the kernel's device
        parents = torch.tensor([-1, 0, 0])
        xBC, pool = torch.randn(2, 3, 12), torch.randn(3, 12, 4)
        weight = torch.randn(12, 4)
        for indices, match in (([0, 3], r"state_indices\[1\] = 3 is not a slot in \[0, 3\)"),
                               ([2, 2], "names a slot twice"), ([0], r"state_indices must have shape \(2,\)"),
                               ([0.0, 1.0], "state_indices")):
            with pytest.raises((ValueError, TypeError), match=match):
                tree_conv1d(xBC, parents, pool, weight, state_indices=torch.tensor(indices), backend=backend)
        with pytest.raises(ValueError, match=r"conv_state must be a pool \[slots, dim, d_conv\]"):
            tree_conv1d(xBC, parents, pool[0], weight, state_indices=torch.tensor([0, 1]), backend=backend)
        with pytest.raises(ValueError, match=r"initial_state must be a pool \[slots"):
            tree_scan(*[inp[k] for k in ("x", "dt", "A", "B", "C")], parents, state_indices=torch.tensor([0, 1]),
                      backend=backend)


@given(data=st.data(), batch=st.integers(1, 4), shape=ssm_shapes(), dt_opts=dt_options(), seed=st.integers(0, 2**16))
def test_step_kernels_advance_their_slots_in_place(data, batch, shape, dt_opts, seed, device, poison):
    gen = torch.Generator().manual_seed(seed)
    inp = ssm_inputs(gen, batch, 1, shape, dt_opts)
    x, dt, B, C = inp["x"][:, 0], inp["dt"][:, 0], inp["B"][:, 0], inp["C"][:, 0]
    dim, d_conv = 12, 4
    xbc, conv, weight = torch.randn(batch, dim, generator=gen), torch.randn(batch, dim, d_conv, generator=gen), \
        torch.randn(dim, d_conv, generator=gen)
    state_indices, slots = data.draw(slot_tables(batch, seed))
    real = (state_indices >= 0).view(-1, 1, 1)
    kw = dict(D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=dt_opts["dt_softplus"], dt_limit=dt_opts["dt_limit"])
    ref_state, ref_conv = _padded(inp["initial_state"], state_indices), _padded(conv, state_indices)
    want_y = selective_state_update(ref_state, x, dt, inp["A"], B, C, **kw, backend="torch").masked_fill(~real, 0)
    want_conv_out = conv_step(xbc, ref_conv, weight, backend="torch")
    for backend in BACKENDS:
        dev = device if backend == "triton" else torch.device("cpu")
        to = lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t
        pool, conv_pool = _pool(inp["initial_state"], state_indices, slots), _pool(conv, state_indices, slots)
        want_pool, want_conv_pool = pool.clone(), conv_pool.clone()
        real_rows = torch.nonzero(state_indices >= 0).flatten()
        want_pool[state_indices[real_rows].long()] = ref_state[real_rows]
        want_conv_pool[state_indices[real_rows].long()] = ref_conv[real_rows]
        pool, conv_pool = to(pool), to(conv_pool)
        y = selective_state_update(pool, to(x), to(dt), to(inp["A"]), to(B), to(C), **{k: to(v) for k, v in kw.items()},
                                   state_indices=to(state_indices), backend=backend)
        out = conv_step(to(xbc), conv_pool, to(weight), state_indices=to(state_indices), backend=backend)
        torch.testing.assert_close(y.cpu(), want_y, rtol=TOL, atol=TOL, msg=by(backend))
        torch.testing.assert_close(pool.cpu(), want_pool, rtol=TOL, atol=TOL, equal_nan=True, msg=by(backend))
        torch.testing.assert_close(out.cpu(), want_conv_out, rtol=TOL, atol=TOL, msg=by(backend))
        torch.testing.assert_close(conv_pool.cpu(), want_conv_pool, rtol=0, atol=0, equal_nan=True, msg=by(backend))


@given(data=st.data(), tree=trees(max_n=20), heads=st.sampled_from([(1, 1), (4, 2)]), t_max=st.sampled_from([0, 5, 40]),
       seed=st.integers(0, 2**16))
def test_tree_attention_over_slots_matches_the_padded_call(data, tree, heads, t_max, seed, device, poison):
    parents, batch = tree
    n, (hq, hkv), d = parents.shape[-1], heads, 8
    gen = torch.Generator().manual_seed(seed)
    r = lambda *size: torch.randn(*size, generator=gen)
    q, k_tree, v_tree = r(batch, n, hq, d), r(batch, n, hkv, d), r(batch, n, hkv, d)
    k_rows, v_rows = r(batch, t_max, hkv, d), r(batch, t_max, hkv, d)
    lens = torch.randint(0, t_max + 1, (batch,), generator=gen)
    state_indices, slots = data.draw(slot_tables(batch, seed))
    want = tree_attention(q, _padded(k_rows, state_indices), _padded(v_rows, state_indices),
                          torch.where(state_indices >= 0, lens, 0), k_tree, v_tree, parents, backend="torch")
    k_pool, v_pool = _pool(k_rows, state_indices, slots), _pool(v_rows, state_indices, slots)
    for backend in ("torch", "triton"):
        dev = device if backend == "triton" else torch.device("cpu")
        to = lambda t: t.to(dev)
        got = tree_attention(to(q), to(k_pool), to(v_pool), to(lens), to(k_tree), to(v_tree), to(parents),
                             state_indices=to(state_indices), backend=backend)
        torch.testing.assert_close(got.cpu(), want, rtol=TOL, atol=TOL, msg=by(backend))
