"""stree.models.layers.linear: every CPU product (float32's four, and half precision's own or its
float32 copy's) against the float64 definition, the measured choice between them (and a pinned
one), the packed, transposed, tiled and widened copies following weight changes, staying out of
autograd, and one opaque op under torch.compile."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.profiler import profile

import stree.models.layers.linear as lin
from stree.kernels.cpu import gemm
from stree.models.layers.linear import Linear, linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")


@pytest.fixture(autouse=True)
def _no_trials(monkeypatch):
    """No trial another test left (its key's table entry set since) runs here, nor is settled."""
    monkeypatch.setattr(lin, "_TRIALS", {})
    monkeypatch.setattr(lin, "_WON", {})


def _definition(x, w, b):
    out = x.double() @ w.double().t()
    return out if b is None else out + b.double()


def _ops(fn):
    with profile() as prof:
        fn()
    return {e.name for e in prof.events()}


# a product's relative error: float32 accumulation, and a half result's one rounding (2^-11, 2^-8)
_RTOL = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 20), d_in=st.integers(1, 80), d_out=st.integers(1, 300), bias=st.booleans(),
       lead=st.sampled_from([(), (2,), (1, 3)]), seed=st.integers(0, 2**16), path=st.sampled_from(lin.PATHS),
       dtype=st.sampled_from(list(_RTOL)), strided=st.booleans())
def test_equals_the_definition(rows, d_in, d_out, bias, lead, seed, path, dtype, strided):
    """``strided``: x a view with every other column (rows a product reads only once copied)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, rows, d_in * (2 if strided else 1), generator=g).to(dtype)[..., :: 2 if strided else 1]
    w = torch.randn(d_out, d_in, generator=g).to(dtype)
    b = torch.randn(d_out, generator=g).to(dtype) if bias else None
    out = torch.full((*lead, rows, d_out), float("nan"), dtype=dtype)  # poisoned: every entry must be written
    pinned, lin.PATH = lin.PATH, path
    try:
        with torch.no_grad():
            out.copy_(linear(x, w, b))
    finally:
        lin.PATH = pinned
    assert out.shape == (*lead, rows, d_out)
    ref = _definition(x, w, b)
    scale = x.double().abs() @ w.double().abs().t() + (0 if b is None else b.double().abs())
    assert ((out.double() - ref).abs() <= _RTOL[dtype] * scale + 1e-6).all()


def _path(ops: set) -> str:
    """Which float32 product ran: oneDNN's on the packed weight, PyTorch's own (``aten::linear``),
    a bare product on the transposed copy, or none of PyTorch's (the tiled one)."""
    if "mkldnn::_linear_pointwise" in ops:
        return "packed"
    return "blas" if "aten::linear" in ops else "transposed" if ops & {"aten::mm", "aten::addmm"} else "tiled"


_TILED = pytest.mark.skipif(not gemm.available(), reason=f"no tiled product here: {gemm.unavailable_reason()}")


def _fake_clock(monkeypatch, times: dict, choices: str = "_FASTEST"):
    """Each timed product takes ``times[path]`` seconds, ``path`` the float32 product it ran
    (:func:`_path`), or for half precision "wide" where it ran the float32 copy's ("aten::_to_copy"),
    else "own"; the choices made so far (``lin.<choices>``) are forgotten."""
    def seconds(fn):
        ops = _ops(fn)
        if "own" in times:
            return times["wide" if "aten::_to_copy" in ops else "own"]
        return times[_path(ops)]
    monkeypatch.setattr(lin, "_seconds", seconds)
    monkeypatch.setattr(lin, choices, {})
    monkeypatch.setattr(lin, "PATH", "auto")


@pytest.mark.parametrize("blas, packed, transposed, tiled, chosen, without_tiled", [
    (1.0, 0.5, 0.9, 1.0, "packed", "packed"), (1.0, 0.9, 0.5, 1.0, "transposed", "transposed"),
    (1.0, 0.5, 0.4, 0.9, "transposed", "transposed"), (0.8, 0.9, 0.9, 1.0, "blas", "blas"),
    (1.0, 0.9, 0.9, 0.9, "tiled", "blas"), (1.0, 2.0, 0.86, 3.0, "transposed", "blas"),
    (1.0, 0.5, 0.6, 0.4, "tiled", "packed"), (0.86, 0.9, 0.9, 1.0, "tiled", "blas")])
def test_the_product_measured_clearly_fastest_runs(monkeypatch, blas, packed, transposed, tiled, chosen,
                                                   without_tiled):
    """The incumbent, the tiled product where it is built here (else PyTorch's own), is kept unless
    another takes less than ``MARGIN`` of its time: near a tie (the last case, a step's out_proj on
    the AMD EPYC) the tiled product, which a decoding loop does not slow as it slows PyTorch's."""
    chosen = chosen if gemm.available() else without_tiled
    _fake_clock(monkeypatch, dict(blas=blas, packed=packed, transposed=transposed, tiled=tiled))
    monkeypatch.setattr(lin, "TRIALS", False)  # (the choice timed alone; a trial in use: the test below)
    layer = Linear(64, 512)
    x = torch.randn(3, 64)
    with torch.no_grad():
        first = layer(x)  # measures
        assert lin._FASTEST == {(4, 512, 64, True): chosen}  # 3 rows: the bucket up to 4
        assert _path(_ops(lambda: layer(x))) == chosen
        for path, store in (("packed", lin._PACKED), ("transposed", lin._TRANSPOSED), ("tiled", lin._TILED)):
            assert (id(layer.weight) in store) == (chosen == path)  # no copy for a path not taken
        assert torch.allclose(first.double(), _definition(x, layer.weight, layer.bias), atol=1e-4)
        layer(torch.randn(4, 64))  # the same bucket: not measured again
        layer(torch.randn(5, 64))  # another bucket is measured on its own
        for rows in (40, 50, 64):  # power-of-two buckets
            layer(torch.randn(rows, 64))
        layer(torch.randn(2, 64))
        assert set(lin._FASTEST) == {(4, 512, 64, True), (8, 512, 64, True), (64, 512, 64, True), (2, 512, 64, True)}


@pytest.mark.parametrize("in_use, kept", [(0.5, "transposed"), (0.9, "incumbent"), (2.0, "incumbent")])
def test_a_path_faster_alone_is_taken_only_if_clearly_faster_where_it_is_used(monkeypatch, in_use, kept):
    """A path that beat the incumbent timed alone (the transposed copy here) is tried on the next
    ``TRIAL`` products: the incumbent makes each (its result, exactly), the challenger multiplies the
    same rows beside it, each timed where it runs (the fake clock: the transposed copy ``in_use``
    against the incumbent's 1.0). A challenger under ``MARGIN`` of the incumbent's time is taken at
    the next settle() (a decoding call's start), else its copies go. Inside following() products take
    the followed path and are not timed. (On an AMD EPYC a step's 1-row out_proj took 20 us
    transposed against 26 tiled timed alone, 45-57 against 24-30 in a decoding loop.)"""
    incumbent = "tiled" if gemm.available() else "blas"
    kept = incumbent if kept == "incumbent" else kept
    _fake_clock(monkeypatch, dict(blas=1.0, packed=1.0, transposed=0.5, tiled=1.0))
    now, ran = [0.0], []
    costs = {name: 1.0 for name in lin._PRODUCTS} | {"transposed": in_use}

    def timed(name, fn):
        return lambda *args: ran.append(name) or now.__setitem__(0, now[0] + costs[name]) or fn(*args)

    real = dict(lin._PRODUCTS)
    monkeypatch.setattr(lin, "_PRODUCTS", {name: timed(name, fn) for name, fn in real.items()})
    monkeypatch.setattr(lin, "_clock", lambda: now[0])
    layer, key = Linear(64, 512), (1, 512, 64, True)
    with torch.no_grad():
        first = layer(x := torch.randn(1, 64))  # measures (the fake clock profiles: not inside another profile)
        assert lin._FASTEST == {key: incumbent} and key in lin._TRIALS
        assert torch.equal(first, real[incumbent](x, layer.weight, layer.bias))
        for k in range(lin.TRIAL - 1):
            ran.clear()
            x = torch.randn(1, 64)
            assert torch.equal(layer(x), real[incumbent](x, layer.weight, layer.bias))
            assert ran == (["transposed", incumbent] if k % 2 == 0 else [incumbent, "transposed"])
        lin._FASTEST[(16, 512, 64, True)] = incumbent  # (a tree pass's bucket, measured before)
        with lin.leading():
            layer(torch.randn(16, 64))
        with lin.following():
            layer(x)  # (the pass's path, untimed)
        assert len(lin._TRIALS[key].times[0]) == lin.TRIAL - 1 and lin._FASTEST[key] == incumbent
        want = real[incumbent](x, layer.weight, layer.bias)  # (before the verdict: it makes the tiled copy)
        assert torch.equal(layer(x), want)  # the last one
        assert key not in lin._TRIALS and lin._FASTEST[key] == incumbent  # (no path changes before settle())
        assert lin._WON == ({key: "transposed"} if kept == "transposed" else {})
        assert (id(layer.weight) in lin._TRANSPOSED) == (kept == "transposed")  # (a loser's copies go at once)
        ran.clear()
        layer(x)
        assert ran == [incumbent]
        lin.settle()
        assert lin._FASTEST[key] == kept and not lin._WON
        ran.clear()
        layer(x)
        assert ran == [kept]
        assert (id(layer.weight) in lin._TRANSPOSED) == (kept == "transposed")
        assert (id(layer.weight) in lin._TILED) == (incumbent == "tiled")  # (the tree pass's bucket takes it)


def test_measuring_rows_already_measured_walks_no_layer_and_new_rows_or_tables_are_measured(monkeypatch):
    """``measure`` (a decoding call's setup) for the rows it has made sure of, for the same module
    and tables, returns without walking the module's layers: a call asks for the same rows every
    time. Rows in a new bucket are measured, and so is everything again where the tables were
    replaced."""
    import weakref

    from torch import nn

    _fake_clock(monkeypatch, dict(blas=1.0, packed=2.0, transposed=2.0, tiled=2.0))
    monkeypatch.setattr(lin, "_MEASURED", weakref.WeakKeyDictionary())
    made, walked = [], []
    real = lin._product
    monkeypatch.setattr(lin, "_product", lambda x, w, b: made.append((len(x), *w.shape)) or real(x, w, b))
    model = nn.Sequential(Linear(64, 512), Linear(512, 64), Linear(64, 512))  # (two shapes)
    monkeypatch.setattr(model, "modules", lambda: walked.append(1) or nn.Module.modules(model))
    lin.measure(model, range(1, 5))
    assert sorted(made) == sorted((r, *shape) for r in (1, 2, 4) for shape in ((512, 64), (64, 512)))
    assert walked == [1]
    lin.measure(model, [3, 4, 1])  # (buckets 4 and 1: made sure of)
    assert len(made) == 6 and walked == [1]
    lin.measure(model, range(1, 9))  # bucket 8 is new
    assert sorted(made[6:]) == [(8, 64, 512), (8, 512, 64)] and walked == [1, 1]
    monkeypatch.setattr(lin, "_FASTEST", {})  # (a process that has multiplied nothing)
    lin.measure(model, [2])
    assert sorted(made[8:]) == [(2, 64, 512), (2, 512, 64)] and walked == [1, 1, 1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("half, wide, chosen, one_row", [(1.0, 0.5, True, True), (1.0, 0.9, True, False),
                                                         (0.7, 0.9, False, False), (1.0, 2.0, False, False)])
def test_a_half_product_runs_on_a_float32_copy_where_that_measured_clearly_faster(monkeypatch, dtype, half, wide,
                                                                                   chosen, one_row):
    """The incumbent, kept unless the other takes less than ``MARGIN`` of its time: for several
    rows, where the tiled product is built, the float32 copy's (a decoding loop slows PyTorch's
    own half product of a few rows more than the tiled one: docs/benchmarks.md); for one row,
    which reads each weight once, PyTorch's own (half the bytes)."""
    chosen = chosen if gemm.available() else half * lin.MARGIN > wide
    _fake_clock(monkeypatch, dict(own=half, wide=wide), "_WIDER")
    layer = Linear(64, 512, dtype=dtype)
    x = torch.randn(3, 64, dtype=dtype)
    with torch.no_grad():
        first = layer(x)  # measures
        assert lin._WIDER == {(4, 512, 64, True, dtype): chosen}
        assert ("aten::_to_copy" in _ops(lambda: layer(x))) == chosen
        assert (id(layer.weight) in lin._WIDE and id(layer.bias) in lin._WIDE) == chosen  # no copy kept otherwise
        if chosen:
            assert lin._WIDE[id(layer.weight)][1].dtype == torch.float32
        assert layer(x).dtype == dtype
        ref = _definition(x, layer.weight, layer.bias)
        assert torch.allclose(first.double(), ref, rtol=_RTOL[dtype], atol=_RTOL[dtype] * 8)
        layer(torch.randn(4, 64, dtype=dtype))  # the same bucket: not measured again
        layer(torch.randn(1, 64, dtype=dtype))  # a step's row: measured on its own
        assert lin._WIDER == {(4, 512, 64, True, dtype): chosen, (1, 512, 64, True, dtype): one_row}


def test_plain_steps_of_a_speculative_loop_follow_the_tree_pass_for_a_while(monkeypatch):
    """Inside following(), a product takes the path its weight's last product inside leading()
    took (the tree pass), for FOLLOW_WIDE products, then its own; products in neither block
    (autoregressive decoding, prefills) take their own and set nothing. Each weight follows its
    own last leading product."""
    monkeypatch.setattr(lin, "PATH", "auto")
    monkeypatch.setattr(lin, "_LAST", {})
    layer, other = Linear(64, 512), Linear(64, 256)
    # 16 rows: packed (as measured on the CPU), a step's row: BLAS
    monkeypatch.setattr(lin, "_FASTEST", {(16, 512, 64, True): "packed", (1, 512, 64, True): "blas",
                                          (16, 256, 64, True): "blas", (1, 256, 64, True): "blas"})

    def packed(fn):
        return "mkldnn::_linear_pointwise" in _ops(fn)

    step, tree = torch.randn(1, 64), torch.randn(16, 64)
    with torch.no_grad():
        assert packed(lambda: layer(tree))  # in neither block: sets nothing
        with lin.following():
            assert not packed(lambda: layer(step))
        with lin.leading():
            assert packed(lambda: layer(tree)) and not packed(lambda: other(tree))
        assert not packed(lambda: layer(step))  # outside the blocks: its own path
        with lin.following():
            taken = [packed(lambda: layer(step)) for _ in range(lin.FOLLOW_WIDE + 2)]
            assert not packed(lambda: other(step))  # its own last leading product was BLAS
        assert taken == [True] * lin.FOLLOW_WIDE + [False] * 2
        with lin.leading():
            layer(tree)  # a new pass: followed again
        with lin.following():
            assert packed(lambda: layer(step))
        monkeypatch.setattr(lin, "FOLLOW_WIDE", 0)
        with lin.leading():
            layer(tree)
        with lin.following():
            assert not packed(lambda: layer(step))


def test_where_every_product_takes_one_path_the_plain_steps_follow_nothing(monkeypatch):
    """Where every product measured takes the same path and none is on trial, following() sets no
    role: no product could take another path there, and its lookups would cost each product of the
    steps after a pass. A trial (whose products inside the block go untimed) or paths that differ
    make it a block again."""
    monkeypatch.setattr(lin, "PATH", "auto")
    monkeypatch.setattr(lin, "_LAST", {})
    monkeypatch.setattr(lin, "_FASTEST", {(16, 512, 64, True): "blas", (1, 512, 64, True): "blas"})
    layer, step, tree = Linear(64, 512), torch.randn(1, 64), torch.randn(16, 64)
    with torch.no_grad():
        with lin.leading():
            layer(tree)
        with lin.following():
            assert lin._ROLE.get() is None
            layer(step)
        assert lin._LAST[id(layer.weight)] == ["blas", 0]  # (nothing counted as followed)
        monkeypatch.setitem(lin._TRIALS, (1, 512, 64, True), lin._Trial("packed", "blas"))
        with lin.following():
            assert lin._ROLE.get() == "follow"
        del lin._TRIALS[(1, 512, 64, True)]
        lin._FASTEST[(1, 512, 64, True)] = "packed"  # (paths that differ)
        with lin.following():
            assert lin._ROLE.get() == "follow"


@_TILED
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tree_pass_s_rows_take_the_tiled_product_as_they_lie_and_lead_the_steps_after(monkeypatch, dtype):
    """A contiguous ``[b, n, in]`` (a tree pass's) whose rows take the tiled product is multiplied
    without a reshape or a view of PyTorch's (a half one on its float32 copy), inside leading()
    sets the path the steps after it follow, and equals the product of its rows flattened."""
    monkeypatch.setattr(lin, "PATH", "auto")
    monkeypatch.setattr(lin, "_LAST", {})
    monkeypatch.setattr(lin, "_FASTEST", {(16, 512, 64, True): "tiled", (1, 512, 64, True): "blas"})
    monkeypatch.setattr(lin, "_WIDER", {(16, 512, 64, True, torch.bfloat16): True,
                                        (1, 512, 64, True, torch.bfloat16): True})
    layer = Linear(64, 512).to(dtype)
    tree, step = torch.randn(2, 8, 64, dtype=dtype), torch.randn(1, 64, dtype=dtype)
    with torch.no_grad():
        with lin.leading():
            ops = _ops(lambda: layer(tree))
            out = layer(tree)
        assert not ops & {"aten::reshape", "aten::view", "aten::linear", "aten::_unsafe_view"}, ops
        assert torch.equal(out, layer(tree.reshape(16, 64)).view(2, 8, 512))
        with lin.following():
            assert "aten::linear" not in _ops(lambda: layer(step))  # (followed the tiled path)
        assert "aten::linear" in _ops(lambda: layer(step))  # (its own, BLAS)


def test_a_plain_step_follows_only_a_path_not_clearly_slower_for_its_rows(monkeypatch):
    """Each path's time is kept with the choice; a plain step follows the tree pass's path only
    where that, timed alone for the step's rows, takes at most 1 / MARGIN of its own path's time
    (oneDNN's packed product of a row or two can cost several times BLAS's)."""
    monkeypatch.setattr(lin, "PATH", "auto")
    monkeypatch.setattr(lin, "_LAST", {})
    near, far = Linear(64, 512), Linear(64, 256)
    monkeypatch.setattr(lin, "_FASTEST", {(16, 512, 64, True): "packed", (1, 512, 64, True): "blas",
                                          (16, 256, 64, True): "packed", (1, 256, 64, True): "blas"})
    monkeypatch.setattr(lin, "_TIMES", {(1, 512, 64, True): {"blas": 1.0, "packed": 1.1, "transposed": 0.9},
                                        (1, 256, 64, True): {"blas": 1.0, "packed": 3.0, "transposed": 0.9}})
    step, tree = torch.randn(1, 64), torch.randn(16, 64)
    with torch.no_grad():
        with lin.leading():
            near(tree), far(tree)
        with lin.following():
            assert _path(_ops(lambda: near(step))) == "packed"  # 1.1 against 1.0: followed
            assert _path(_ops(lambda: far(step))) == "blas"  # 3.0 against 1.0: its own
    monkeypatch.setattr(lin, "_TIMES", {})
    monkeypatch.setattr(lin, "_FASTEST", {})
    layer = Linear(64, 128)
    with torch.no_grad():
        layer(step)  # measured: every path's time kept
    assert set(lin._TIMES[(1, 128, 64, True)]) == set(lin._candidates()) == (
        set(lin._PRODUCTS) - ({"tiled"} if not gemm.available() else set()))


@pytest.mark.parametrize("path", ["blas", "packed", "transposed", pytest.param("tiled", marks=_TILED)])
def test_a_pinned_path_is_taken_without_measuring(monkeypatch, path):
    monkeypatch.setattr(lin, "PATH", path)
    monkeypatch.setattr(lin, "_FASTEST", {})
    layer = Linear(64, 512)
    with torch.no_grad():
        for rows in (1, 3):
            assert _path(_ops(lambda: layer(torch.randn(rows, 64)))) == path
    assert lin._FASTEST == {}
    wide = Linear(64, 512, dtype=torch.float64)  # float32 and half precision only
    with torch.no_grad():
        assert "mkldnn::_linear_pointwise" not in _ops(lambda: wide(torch.randn(3, 64, dtype=torch.float64)))
    monkeypatch.setattr(lin, "_WIDER", {})
    half = Linear(64, 512, dtype=torch.float16)  # "blas": PyTorch's own half product; else the float32 copy's
    with torch.no_grad():
        ops = _ops(lambda: half(torch.randn(3, 64, dtype=torch.float16)))
    assert ("aten::_to_copy" in ops) == (path != "blas") and (path == "blas" or _path(ops) == path)
    assert lin._WIDER == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measure_makes_each_buckets_choices_once_per_weight_shape(monkeypatch, dtype):
    """``measure`` times, for each weight shape (layers of one shape share it) and each bucket of
    the rows named, the choice a first product would; products after it time nothing."""
    monkeypatch.setattr(lin, "PATH", "auto")
    monkeypatch.setattr(lin, "_FASTEST", {})
    monkeypatch.setattr(lin, "_WIDER", {})
    timed = []
    real = lin._fastest
    monkeypatch.setattr(lin, "_fastest", lambda paths, *best: timed.append(1) or real(paths, *best))
    model = torch.nn.Sequential(Linear(8, 16), Linear(8, 16), Linear(16, 4, bias=False)).to(dtype)
    lin.measure(model, [1, 3, 4, 5])  # buckets 1, 4 and 8, for 2 shapes
    table = lin._WIDER if dtype != torch.float32 else lin._FASTEST
    half = () if dtype == torch.float32 else (dtype,)
    assert set(table) == {(b, *shape, *half) for b in (1, 4, 8) for shape in ((16, 8, True), (4, 16, False))}
    done = len(timed)
    assert done >= 6  # (a half weight that took its float32 copy also timed the copy's own products)
    lin.measure(model, [2, 7])  # bucket 2 is new, 8 is known
    assert (2, 16, 8, True, *half) in table and len(table) == 8
    after = len(timed)
    with torch.no_grad():
        for rows in (1, 2, 3, 5, 8):
            for layer in model:
                layer(torch.randn(rows, layer.in_features, dtype=dtype))
    assert len(timed) == after
    monkeypatch.setattr(lin, "PATH", "blas")
    lin.measure(model, [16])
    assert len(timed) == after and len(table) == 8


def test_an_unknown_pinned_path_is_refused_on_import():
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-c", "import stree.models.layers.linear"], capture_output=True, text=True,
                         env={**os.environ, "STREE_LINEAR": "fast"})
    assert run.returncode != 0 and "STREE_LINEAR must be one of" in run.stderr and "'fast'" in run.stderr


@pytest.mark.parametrize("path", ["packed", pytest.param("tiled", marks=_TILED)])
def test_a_changed_weight_is_packed_again(monkeypatch, path):
    monkeypatch.setattr(lin, "PATH", path)
    layer = Linear(32, 48)
    x = torch.randn(4, 32)
    with torch.no_grad():
        layer(x)
        layer.weight.mul_(-2.0)  # in place: the version counter moves
        assert torch.allclose(layer(x).double(), _definition(x, layer.weight, layer.bias), atol=1e-4)
        layer.weight.data = torch.randn(48, 32)  # new storage
        assert torch.allclose(layer(x).double(), _definition(x, layer.weight, layer.bias), atol=1e-4)
        layer.load_state_dict({"weight": torch.randn(48, 32), "bias": torch.randn(48)})
        assert torch.allclose(layer(x).double(), _definition(x, layer.weight, layer.bias), atol=1e-4)


def test_a_changed_half_weight_is_copied_again(monkeypatch):
    monkeypatch.setattr(lin, "PATH", "packed")
    layer = Linear(32, 48, dtype=torch.bfloat16)
    x = torch.randn(4, 32, dtype=torch.bfloat16)

    def close():
        return torch.allclose(layer(x).double(), _definition(x, layer.weight, layer.bias), rtol=8e-3, atol=0.05)

    with torch.no_grad():
        layer(x)
        layer.weight.mul_(-2.0)  # in place: the version counter moves
        assert close()
        layer.bias.data = torch.randn(48, dtype=torch.bfloat16)  # new storage
        assert close()
        layer.load_state_dict({"weight": torch.randn(48, 32), "bias": torch.randn(48)})
        assert close()


def test_training_stays_on_autograd():
    layer = Linear(16, 8)
    x = torch.randn(5, 16, requires_grad=True)
    assert "mkldnn::_linear_pointwise" not in _ops(lambda: layer(x))
    layer(x).square().sum().backward()
    ref_w = layer.weight.detach().clone().requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    torch.nn.functional.linear(ref_x, ref_w, layer.bias.detach()).square().sum().backward()
    assert torch.allclose(layer.weight.grad, ref_w.grad) and torch.allclose(x.grad, ref_x.grad)


@pytest.mark.parametrize("path", ["auto", "packed", "transposed", "tiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_compiled_is_one_opaque_op_with_the_eager_result(monkeypatch, dtype, path):
    """One graph (``fullgraph``), pinned paths too: asking whether the tiled product is built, where
    torch.compile traces, had broken a compiled step's graph at every product (3.5x its time)."""
    monkeypatch.setattr(lin, "PATH", path)
    layer = Linear(40, 96, dtype=dtype)
    x = torch.randn(6, 40, dtype=dtype)
    fn = torch.compile(lambda t: layer(t.relu()) * 2, dynamic=False, fullgraph=True)
    atol = 1e-5 if dtype == torch.float32 else 1e-2
    with torch.no_grad():
        eager = layer(x.relu()) * 2
        assert fn(x).dtype == dtype and torch.allclose(fn(x), eager, atol=atol)
        assert "stree::cpu_linear" in _ops(lambda: fn(x))
        layer.weight.mul_(0.5)  # the compiled graph reads the weight afresh
        assert torch.allclose(fn(x), layer(x.relu()) * 2, atol=atol)


def test_a_parametrized_weight_is_read_as_the_attribute():
    """A Linear reads its weight and bias from its parameter dict (cheaper than the attribute); where
    a parametrization keeps the weight elsewhere, from the attribute: the parametrized product."""
    from torch.nn.utils import parametrize

    class Doubled(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    layer = Linear(6, 5)
    parametrize.register_parametrization(layer, "weight", Doubled())
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = layer(x)
    assert torch.allclose(out, x @ (2 * layer.parametrizations.weight.original).t() + layer.bias, atol=1e-6)
