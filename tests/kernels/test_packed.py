"""Packed trees, the engines' ``cu_seqlens`` layout: a batch of trees of different sizes laid back
to back without padding (:class:`stree.tree.PackedTrees`). Every backend's tree_scan, tree_conv1d
and tree_attention on the packed trees equal each tree's own call (its state, or its slot of a
pool whose other slots hold NaN), and replay of packed activations writes each tree's accepted
state into its slot as the tree's own replay does; outputs are poisoned (a node a kernel skips
cannot pass). Bad packings are refused naming the argument."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import by, dt_options, parent_lists, ssm_inputs, ssm_shapes

from stree.kernels import replay, tree_attention, tree_conv1d, tree_scan
from stree.testing import root_path
from stree.tree import PackedTrees, pack_trees, packed_trees, tree_index

TOL = 1e-5
BACKENDS = ("torch", "auto", "triton")


@st.composite
def forests(draw, max_n=20):
    """1-4 parent arrays of 1..max_n nodes each (sizes drawn apart: the point is that they differ)."""
    return [draw(parent_lists(draw(st.integers(1, max_n)))) for _ in range(draw(st.integers(1, 4)))]


@st.composite
def slot_tables(draw, batch):
    """(state_indices [batch] or None, slots): distinct slots in random order, some rows padding."""
    if not draw(st.booleans()):
        return None, batch
    slots = batch + draw(st.integers(0, 3))
    order = draw(st.permutations(range(slots)))[:batch]
    pad = draw(st.lists(st.booleans(), min_size=batch, max_size=batch))
    return torch.tensor([-1 if p else s for p, s in zip(pad, order)], dtype=torch.int32), slots


def _pool(rows, state_indices, slots):
    """The rows' states as the packed call reads them: the rows themselves, or a NaN pool with each
    real row in its slot."""
    if state_indices is None:
        return rows
    pool = torch.full((slots, *rows.shape[1:]), float("nan"), dtype=rows.dtype)
    real = torch.nonzero(state_indices >= 0).flatten()
    pool[state_indices[real].long()] = rows[real]
    return pool


def _own(rows, state_indices, r):
    """Tree r's own state for its solo call: its row, zeros for a padding row."""
    if state_indices is not None and state_indices[r] < 0:
        return torch.zeros_like(rows[r:r + 1])
    return rows[r:r + 1]


def _each(trees, packed, call):
    """``call(r, nodes, parents)`` per tree, its outputs ``[1, n_r, ...]`` concatenated in order."""
    cu = packed.cu_seqlens.tolist()
    return torch.cat([call(r, slice(cu[r], cu[r + 1]), torch.tensor(t)) for r, t in enumerate(trees)], dim=1)


def _on(backend, device):
    """Moves tensors and packed trees to the backend's device (anything else stays)."""
    dev = device if backend == "triton" else torch.device("cpu")
    return lambda t: t.to(dev) if isinstance(t, (torch.Tensor, PackedTrees)) else t


@given(trees=forests(max_n=24))
def test_packed_trees_hold_each_trees_own_index(trees):
    packed = pack_trees(trees)
    assert packed.batch == len(trees) and packed.total == sum(map(len, trees))
    assert packed.max_n == max(map(len, trees))
    cu = packed.cu_seqlens.tolist()
    for r, t in enumerate(trees):
        own = tree_index(t)
        for name in ("parents", "depth", "pre", "last"):
            assert getattr(packed, name)[cu[r]:cu[r + 1]].tolist() == getattr(own, name)[0].tolist(), (r, name)
    same = packed_trees(torch.tensor([v for t in trees for v in t]), packed.cu_seqlens.long())
    assert all(torch.equal(getattr(same, k), getattr(packed, k)) for k in ("parents", "depth", "pre", "last"))
    x = torch.randn(1, packed.total, 3)
    padded = packed.unpack(x)
    assert torch.equal(packed.pack(padded), x)
    for r, t in enumerate(trees):  # padding rows zero
        assert not padded[r, len(t):].any()


@settings(max_examples=15)  # each example is a whole forest, every backend
@given(trees=forests(), shape=ssm_shapes(), dt_opts=dt_options(), data=st.data(), seed=st.integers(0, 2**16))
def test_tree_scan_of_packed_trees_is_each_trees_own_scan(trees, shape, dt_opts, data, seed, device, poison):
    packed = pack_trees(trees)
    inp = ssm_inputs(torch.Generator().manual_seed(seed), len(trees), packed.total, shape, dt_opts)
    args = [inp[k][:1] for k in ("x", "dt", "B", "C")]  # [1, total, ...]
    states = inp["initial_state"]
    state_indices, slots = data.draw(slot_tables(len(trees)))
    kw = dict(D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=dt_opts["dt_softplus"], dt_limit=dt_opts["dt_limit"])
    want = _each(trees, packed, lambda r, nodes, parents: tree_scan(
        args[0][:, nodes], args[1][:, nodes], inp["A"], args[2][:, nodes], args[3][:, nodes], parents, **kw,
        initial_state=_own(states, state_indices, r), backend="torch"))
    for backend in BACKENDS:
        to = _on(backend, device)
        got = tree_scan(*map(to, (args[0], args[1], inp["A"], args[2], args[3], packed)), **{k: to(v) for k, v in kw.items()},
                        initial_state=to(_pool(states, state_indices, slots)), state_indices=to(state_indices),
                        backend=backend)
        torch.testing.assert_close(got.cpu(), want, rtol=TOL, atol=TOL, msg=by(backend))


@settings(max_examples=15)  # each example is a whole forest, every backend
@given(trees=forests(), d_conv=st.sampled_from([1, 2, 4]), bias=st.booleans(), data=st.data(),
       seed=st.integers(0, 2**16))
def test_tree_conv1d_of_packed_trees_is_each_trees_own_conv(trees, d_conv, bias, data, seed, device, poison):
    packed = pack_trees(trees)
    gen = torch.Generator().manual_seed(seed)
    dim = 12
    xBC = torch.randn(1, packed.total, dim, generator=gen)
    conv = torch.randn(len(trees), dim, d_conv, generator=gen)
    weight, b = torch.randn(dim, d_conv, generator=gen), torch.randn(dim, generator=gen) if bias else None
    state_indices, slots = data.draw(slot_tables(len(trees)))
    want = _each(trees, packed, lambda r, nodes, parents: tree_conv1d(
        xBC[:, nodes], parents, _own(conv, state_indices, r), weight, b, backend="torch"))
    for backend in BACKENDS:
        to = _on(backend, device)
        got = tree_conv1d(to(xBC), to(packed), to(_pool(conv, state_indices, slots)), to(weight), to(b),
                          state_indices=to(state_indices), backend=backend)
        torch.testing.assert_close(got.cpu(), want, rtol=TOL, atol=TOL, msg=by(backend))


@settings(max_examples=15)  # each example is a whole forest, every backend
@given(trees=forests(), heads=st.sampled_from([(1, 1), (4, 2)]), t_max=st.sampled_from([0, 5, 40]), data=st.data(),
       seed=st.integers(0, 2**16))
def test_tree_attention_of_packed_trees_is_each_trees_own_attention(trees, heads, t_max, data, seed, device, poison):
    packed = pack_trees(trees)
    (hq, hkv), d, batch, total = heads, 8, len(trees), packed.total
    gen = torch.Generator().manual_seed(seed)
    r_ = lambda *size: torch.randn(*size, generator=gen)
    q, k_tree, v_tree = r_(1, total, hq, d), r_(1, total, hkv, d), r_(1, total, hkv, d)
    k_rows, v_rows = r_(batch, t_max, hkv, d), r_(batch, t_max, hkv, d)
    lens = torch.randint(0, t_max + 1, (batch,), generator=gen)
    state_indices, slots = data.draw(slot_tables(batch))
    pad = lambda r: state_indices is not None and state_indices[r] < 0
    want = _each(trees, packed, lambda r, nodes, parents: tree_attention(
        q[:, nodes], k_rows[r:r + 1], v_rows[r:r + 1], lens[r:r + 1] * (not pad(r)), k_tree[:, nodes],
        v_tree[:, nodes], parents, backend="torch"))
    for backend in ("torch", "triton"):
        to = _on(backend, device)
        got = tree_attention(to(q), to(_pool(k_rows, state_indices, slots)), to(_pool(v_rows, state_indices, slots)),
                             to(lens), to(k_tree), to(v_tree), to(packed), state_indices=to(state_indices),
                             backend=backend)
        torch.testing.assert_close(got.cpu(), want, rtol=TOL, atol=TOL, msg=by(backend))


@settings(max_examples=15)  # each example is a whole forest, every backend
@given(trees=forests(), layers=st.integers(1, 2), data=st.data(), seed=st.integers(0, 2**16))
def test_replay_of_packed_trees_writes_each_trees_own_commit_into_its_slot(trees, layers, data, seed, device, poison):
    packed = pack_trees(trees)
    batch, total = len(trees), packed.total
    h, p, s, dim, d_conv = 2, 4, 8, 12, 4
    gen = torch.Generator().manual_seed(seed)
    r_ = lambda *size: torch.randn(*size, generator=gen)
    ssm, conv = r_(layers, batch, h, p, s), r_(layers, batch, dim, d_conv)
    xBC, x, dt, B = r_(layers, 1, total, dim), r_(layers, 1, total, h, p), r_(layers, 1, total, h), r_(layers, 1, total, 1, s)
    A, dt_bias = -torch.rand(layers, h, generator=gen), r_(layers, h)
    # each row's accepted path: a root-to-node path of its own tree, padded past its length
    paths = [root_path(t, data.draw(st.integers(0, len(t) - 1))) for t in trees]
    L = max(map(len, paths))
    accepted = torch.tensor([path + [0] * (L - len(path)) for path in paths])
    num = torch.tensor([len(path) for path in paths])
    state_indices, slots = data.draw(slot_tables(batch))
    cu = packed.cu_seqlens.tolist()
    want_ssm, want_conv = (_pool(t.transpose(0, 1), state_indices, slots).clone() for t in (ssm, conv))
    for r in range(batch):
        if state_indices is not None and state_indices[r] < 0:
            continue
        nodes = slice(cu[r], cu[r + 1])
        new_ssm, new_conv = replay(ssm[:, r:r + 1], conv[:, r:r + 1], xBC[:, :, nodes], x[:, :, nodes], dt[:, :, nodes],
                                   B[:, :, nodes], A, accepted[r:r + 1], num[r:r + 1], dt_bias=dt_bias, backend="torch")
        slot = r if state_indices is None else int(state_indices[r])
        want_ssm[slot], want_conv[slot] = new_ssm[:, 0], new_conv[:, 0]
    for backend in BACKENDS:
        to = _on(backend, device)
        pools = [to(_pool(t.transpose(0, 1), state_indices, slots).transpose(0, 1).contiguous()) for t in (ssm, conv)]
        kw = dict(dt_bias=to(dt_bias), cu_seqlens=to(packed.cu_seqlens), backend=backend)
        if state_indices is None:
            got = replay(*pools, *map(to, (xBC, x, dt, B, A, accepted, num)), **kw)
        else:
            got = replay(*pools, *map(to, (xBC, x, dt, B, A, accepted, num)), state_indices=to(state_indices), **kw)
            assert got[0] is pools[0] and got[1] is pools[1]  # in place
        torch.testing.assert_close(got[0].cpu().transpose(0, 1), want_ssm, rtol=TOL, atol=TOL, equal_nan=True,
                                   msg=by(backend))
        torch.testing.assert_close(got[1].cpu().transpose(0, 1), want_conv, rtol=0, atol=0, equal_nan=True,
                                   msg=by(backend))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_packings_are_refused_naming_the_argument(backend, backend_device):
    with backend_device:  # the tensors built below: on the kernel's device
        with pytest.raises(ValueError, match=r"cu_seqlens gives tree 1 0 nodes"):
            packed_trees(torch.tensor([-1, 0, -1]), torch.tensor([0, 2, 2, 3]))
        with pytest.raises(ValueError, match=r"cu_seqlens must run from 0 to the 3 packed nodes, got 0 \.\. 4"):
            packed_trees(torch.tensor([-1, 0, -1]), torch.tensor([0, 2, 4]))
        with pytest.raises(TypeError, match="cu_seqlens must be an integer tensor"):
            packed_trees(torch.tensor([-1, 0, -1]), torch.tensor([0.0, 2.0, 3.0]))
        with pytest.raises(ValueError, match=r"parents\[1, 1\] = 1; need 0 <= parent < 1"):
            packed_trees(torch.tensor([-1, 0, -1, 1]), torch.tensor([0, 2, 4]))
        with pytest.raises(ValueError, match=r"trees\[1\] is empty"):
            pack_trees([[-1], []])
        with pytest.raises(ValueError, match="larger than the 1024 nodes"):
            pack_trees([[-1], [-1] + list(range(1024))])
        packed = pack_trees([[-1, 0], [-1]])
        xBC, conv, weight = torch.randn(1, 4, 6), torch.randn(2, 6, 4), torch.randn(6, 4)
        with pytest.raises(ValueError,
                           match=r"with packed trees xBC must have shape \[1, total = 3, \.\.\.\], got \(1, 4, 6\)"):
            tree_conv1d(xBC, packed, conv, weight, backend=backend)
        with pytest.raises(ValueError, match=r"conv_state must have shape \(2, 6, 4\)"):
            tree_conv1d(xBC[:, :3], packed, conv[:1], weight, backend=backend)
        h, p, s = 2, 4, 8
        args = (torch.zeros(2, h, p, s), torch.zeros(2, 6, 4), torch.zeros(1, 3, 6), torch.zeros(1, 3, h, p),
                torch.zeros(1, 3, h), torch.zeros(1, 3, 1, s), torch.zeros(h))
        with pytest.raises(ValueError, match=r"accepted\[1, 1\] = 1 is not a node index in \[0, 1\)"):
            replay(*args, torch.tensor([[0, 1], [0, 1]]), torch.tensor([2, 2]), cu_seqlens=packed.cu_seqlens,
                   backend=backend)
        with pytest.raises(ValueError, match=r"cu_seqlens must have shape \(3,\)"):
            replay(*args, torch.tensor([[0, 1], [0, 1]]), torch.tensor([2, 1]), cu_seqlens=torch.tensor([0, 3]),
                   backend=backend)
