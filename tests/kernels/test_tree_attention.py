import importlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from strategies import trees

from stree.kernels import tree_attention
from stree.testing import max_rel_error, tree_attention_def
from stree.tree import TreeShape

FP32_TOL = 1e-5


def _inputs(seed, batch, n, hq, hkv, d, t_max, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)
    lens = torch.randint(0, t_max + 1, (batch,), generator=g)
    return dict(q=r(batch, n, hq, d), k_cache=r(batch, t_max, hkv, d), v_cache=r(batch, t_max, hkv, d),
                cache_seqlens=lens, k_tree=r(batch, n, hkv, d), v_tree=r(batch, n, hkv, d))


def _call(inp, parents, backend, device, **kw):
    return tree_attention(**{k: v.to(device) for k, v in inp.items()}, parents=parents.to(device), backend=backend, **kw)


@given(tree=trees(max_n=40), heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3), (6, 2)]),
       d=st.sampled_from([4, 8, 12, 16, 24]), t_max=st.sampled_from([0, 1, 7, 40, 70]),
       scale=st.sampled_from([None, 0.3]), seed=st.integers(0, 2**16))
def test_matches_definition_on_random_trees(tree, heads, d, t_max, scale, seed, device, poison):
    parents, batch = tree
    inp = _inputs(seed, batch, parents.shape[-1], *heads, d, t_max)
    # Rows of one batch see different prefix lengths; this example pins one row to the whole cache.
    inp["cache_seqlens"][0] = t_max
    expected = tree_attention_def(**inp, parents=parents, softmax_scale=scale)
    for backend, dev in (("torch", torch.device("cpu")), ("triton", device)):
        out = _call(inp, parents, backend, dev, softmax_scale=scale)
        assert out.shape == inp["q"].shape and out.dtype == inp["q"].dtype
        assert max_rel_error(out, expected) <= FP32_TOL, backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_multi_tile_tree_and_prefix(dtype, device, poison):
    """Over 64 nodes and 64 prefix positions: several query tiles and key blocks (whose sizes
    differ between fp32 and 16-bit inputs)."""
    gen = torch.Generator().manual_seed(2)
    n = 100
    parents = torch.tensor([-1] + [int(torch.randint(max(0, i - 6), i, (1,), generator=gen)) for i in range(1, n)])
    inp = _inputs(3, 2, n, 4, 2, 16, 150, dtype=dtype)
    inp["cache_seqlens"] = torch.tensor([150, 65])
    expected = tree_attention_def(**inp, parents=parents)
    tol = FP32_TOL if dtype == torch.float32 else 1e-2
    assert max_rel_error(_call(inp, parents, "triton", device), expected) <= tol
    assert max_rel_error(_call(inp, parents, "torch", torch.device("cpu")), expected) <= tol


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chain_equals_causal_attention_over_the_whole_sequence(backend, device):
    """A chain after a prefix is ordinary causal attention over [prefix; chain] (torch's SDPA)."""
    n, t_max, length = 6, 12, 9
    inp = _inputs(4, 2, n, 4, 2, 8, t_max)
    inp["cache_seqlens"] = torch.tensor([length, length])
    dev = device if backend == "triton" else torch.device("cpu")
    out = _call(inp, TreeShape.chain(n - 1).parents_tensor(), backend, dev).cpu()
    k = torch.cat([inp["k_cache"][:, :length], inp["k_tree"]], 1).repeat_interleave(2, dim=2)
    v = torch.cat([inp["v_cache"][:, :length], inp["v_tree"]], 1).repeat_interleave(2, dim=2)
    full = F.scaled_dot_product_attention(
        torch.cat([torch.zeros(2, length, 4, 8), inp["q"]], 1).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        is_causal=True).transpose(1, 2)
    assert max_rel_error(out, full[:, length:]) <= FP32_TOL


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_half_precision(dtype, backend, device):
    if backend == "triton" and dtype == torch.bfloat16 and device.type != "cuda":
        pytest.skip("the Triton interpreter computes bf16 tl.dot wrongly (numpy has no bfloat16); run on CUDA")
    shape = TreeShape.paper13()
    inp = _inputs(5, 2, shape.n, 4, 2, 16, 30, dtype=dtype)
    dev = device if backend == "triton" else torch.device("cpu")
    out = _call(inp, shape.parents_tensor(), backend, dev)
    assert out.dtype == dtype
    assert max_rel_error(out, tree_attention_def(**inp, parents=shape.parents_tensor())) <= 1e-2


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_inputs_raise_clear_errors(backend, backend_device):
    inp = {k: v.to(backend_device) for k, v in _inputs(0, 2, 4, 4, 2, 8, 10).items()}
    with backend_device:  # the tensors built below: on the kernel's device
        parents = torch.tensor([-1, 0, 0, 1])
        call = lambda parents=parents, **kw: tree_attention(**{**inp, **kw}, parents=parents, backend=backend)
        with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 11 must be in \[0, t_max = 10\]"):
            call(cache_seqlens=torch.tensor([3, 11]))
        with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = -1"):
            call(cache_seqlens=torch.tensor([-1, 2]))
        with pytest.raises(TypeError, match="cache_seqlens must have an integer dtype"):
            call(cache_seqlens=torch.tensor([1.0, 2.0]))
        with pytest.raises(ValueError, match=r"q_heads \(4\) must be a multiple of kv_heads \(3\)"):
            call(k_cache=torch.randn(2, 10, 3, 8))
        with pytest.raises(ValueError, match=r"k_tree must have shape \(2, 4, 2, 8\)"):
            call(k_tree=inp["k_tree"][:, :3])
        with pytest.raises(TypeError, match="v_cache must have dtype torch.float32"):
            call(v_cache=inp["v_cache"].half())
        with pytest.raises(ValueError, match="first bad index 3"):
            call(parents=torch.tensor([-1, 0, 0, 3]))
        with pytest.raises(ValueError, match="v_tree is on meta"):
            call(v_tree=inp["v_tree"].to("meta"))


def test_the_cpu_path_reads_the_prefix_as_far_as_the_longest_row(monkeypatch):
    """A cache is sized for the longest sequence it may hold (a serving slot for its whole
    max_length): on the CPU the PyTorch path attends over the prefix up to the longest row's
    length only, directly and through a pool of slots, with the result of a cache of that size."""
    ta = importlib.import_module("stree.kernels.tree_attention")  # (the package's name is the function)
    keys = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(ta.F, "scaled_dot_product_attention", lambda q, k, v, **kw: keys.append(k.shape[2]) or
                        real(q, k, v, **kw))
    n, parents = 5, TreeShape.chain(4).parents_tensor()
    inp = _inputs(5, 2, n, 4, 2, 8, 512)
    inp["cache_seqlens"] = torch.tensor([9, 4])
    short = {**inp, "k_cache": inp["k_cache"][:, :9], "v_cache": inp["v_cache"][:, :9]}
    got, want = _call(inp, parents, "torch", torch.device("cpu")), _call(short, parents, "torch", torch.device("cpu"))
    assert keys == [9 + n, 9 + n] and torch.equal(got, want)
    keys.clear()
    pool = {k: torch.cat([torch.zeros_like(inp[k][:1]), inp[k]]) for k in ("k_cache", "v_cache")}  # rows in slots 1, 2
    slots = tree_attention(**{**inp, **pool}, parents=parents, state_indices=torch.tensor([1, 2]), backend="torch")
    assert keys == [9 + n] and torch.equal(slots, got)
