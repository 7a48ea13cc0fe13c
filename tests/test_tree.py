import json

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strategies import parent_lists, trees

from stree.tree import TokenTree, TreeShape, ancestor_mask, check_parents, leaf_paths, tree_index


def _naive_mask(parents):
    n = len(parents)
    L = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            L[i, j] = True
            j = parents[j]
    return L


@given(n=st.integers(1, 64), data=st.data())
def test_a_shapes_index_is_the_tensor_paths_index(n, data):
    """A static shape's index is built on the host in plain Python: the same int32 tensors as the
    general path's (which the walk-up test above checks)."""
    parents = data.draw(parent_lists(n))
    got, want = TreeShape(tuple(parents)).index(), tree_index(torch.tensor(parents))
    for name in ("parents", "depth", "pre", "last"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b), name


@given(tree=trees(max_n=60))
def test_ancestor_mask_depth_and_intervals_match_a_walk_up_the_parents(tree):
    parents, batch = tree
    rows = parents.reshape(-1, parents.shape[-1])
    index = tree_index(parents)
    mask = ancestor_mask(parents).reshape(-1, rows.shape[1], rows.shape[1])
    for r, row in enumerate(rows.tolist()):
        expected = _naive_mask(row)
        assert torch.equal(mask[r], expected)
        assert torch.equal(index.ancestor_mask()[r], expected)
        assert index.depth[r].tolist() == (expected.sum(1) - 1).tolist()


@pytest.mark.parametrize(
    "parents, bad",
    [([0, 0, 1], 0), ([-1, 1, 1], 1), ([-1, 0, 3, 1], 2), ([-1, 0, -2], 2), ([-1, 0, 1, 2, 0, 5], 5)],
)
def test_invalid_parents_name_the_first_bad_index(parents, bad):
    with pytest.raises(ValueError, match=f"first bad index {bad}:"):
        check_parents(parents)


def test_invalid_parents_other_errors():
    with pytest.raises(ValueError, match=r"parents\[1, 2\] = 2"):
        check_parents([[-1, 0, 1], [-1, 0, 2]])
    with pytest.raises(TypeError, match="integer dtype"):
        check_parents(torch.tensor([-1.0, 0.0]))
    with pytest.raises(TypeError, match="integer dtype"):
        check_parents(torch.tensor([True, False]))
    with pytest.raises(ValueError, match="at least the root"):
        check_parents(torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"shape \[n\] or \[batch, n\]"):
        check_parents(torch.full((1, 1, 1), -1))


def test_static_shapes():
    assert TreeShape.chain(4).parents == (-1, 0, 1, 2, 3)
    assert TreeShape.chain(0).n == 1
    assert [TreeShape.full(2, d).n for d in (3, 4, 5, 6)] == [15, 31, 63, 127]
    full = TreeShape.full(3, 2)
    assert full.parents == (-1, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3)  # BFS order
    paper = TreeShape.paper13()
    assert paper.parents == (-1, 0, 0, 0, 1, 1, 2, 4, 4, 5, 7, 7, 7)
    assert paper.max_depth == 4
    assert [len(level) for level in ([i for i in range(13) if paper.depth[i] == d] for d in range(1, 5))] == [3] * 4
    assert TreeShape.from_children([3, 2, 1, 0, 2, 1, 0, 3]).parents == paper.parents
    assert TreeShape.from_children([2, 2]).parents == (-1, 0, 0, 1, 1)
    with pytest.raises(ValueError, match=r"counts\[3\] = 1 but the tree has only 3 nodes"):
        TreeShape.from_children([2, 0, 0, 1])
    with pytest.raises(ValueError, match="first bad index 2"):
        TreeShape((-1, 0, 2))


def test_prefixes_of_different_plans_that_begin_alike_are_one_shape_with_one_cache():
    """A choice re-plans every few steps and most new plans begin as the last did: the prefix it
    drafts is then the shape it drafted before, whose index and drafting plan are made already.
    Shapes are still checked: a list of bools, a parent after its child, a negative parent."""
    a, b = TreeShape((-1, 0, 0, 1, 2)), TreeShape((-1, 0, 0, 1, 1))
    assert a.prefix(4) is b.prefix(4) and a.prefix(4).index() is b.prefix(4).index()
    assert a.prefix(4).plan is b.prefix(4).plan and a.prefix(5) is not b.prefix(5)
    for bad in ([True, False], (-1, 0, 2), (-1, -1)):
        with pytest.raises((ValueError, TypeError)):
            TreeShape(bad)


def test_a_shapes_cached_index_is_where_it_was_asked_for_whatever_the_default_device():
    """The cache builds a device's index from its host one: a default-device context (a test's or
    a user's ``with torch.device("cuda")``) once put the host index on the GPU, and every later
    CPU draft of that shape failed ("parents is on cuda:0 but tokens is on cpu"). The meta device
    stands in for the GPU here."""
    shape = TreeShape((-1, 0, 0, 1, 1, 2, 2, 3))  # used by no other test: its cache entries are made here
    with torch.device("meta"):
        assert shape.index("meta").device.type == "meta"
        assert shape.index("cpu").device.type == "cpu"
    tree = TokenTree.from_shape(shape, torch.zeros(1, shape.n, dtype=torch.long))
    assert tree.parents.device.type == "cpu" and tree.index.pre.device.type == "cpu"


def test_leaf_paths_and_children():
    paper = TreeShape.paper13()
    paths = paper.leaf_paths()
    assert paths[0] == [0, 3] and paths[-1] == [0, 1, 4, 7, 12]
    assert sorted(p[-1] for p in paths) == [3, 6, 8, 9, 10, 11, 12]
    assert paper.children()[7] == [10, 11, 12]
    assert leaf_paths([-1]) == [[0]]


@given(parents=st.integers(1, 40).flatmap(parent_lists))
def test_json_round_trip(parents, tmp_path_factory):
    shape = TreeShape(tuple(parents))
    path = tmp_path_factory.mktemp("trees") / "tree.json"
    shape.save(path)
    assert TreeShape.load(path) == shape


def test_malformed_json_is_a_clear_error():
    with pytest.raises(ValueError, match="malformed"):
        TreeShape.from_json("{not json")
    with pytest.raises(ValueError, match="format 'stree.tree_shape'"):
        TreeShape.from_json(json.dumps({"parents": [-1]}))
    with pytest.raises(ValueError, match="first bad index 1"):
        TreeShape.from_json(json.dumps({"format": "stree.tree_shape", "parents": [-1, 1]}))


def test_token_tree_per_row_parents_and_positions():
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]])
    tree = TokenTree(parents, torch.arange(8).view(2, 4))
    assert tree.depth.tolist() == [[0, 1, 1, 2], [0, 1, 2, 3]]
    assert tree.position_ids(torch.tensor([10, 3])).tolist() == [[10, 11, 11, 12], [3, 4, 5, 6]]
    assert torch.equal(tree.ancestor_mask[1], torch.ones(4, 4, dtype=torch.bool).tril())  # a chain
    assert not tree.ancestor_mask[0, 2, 1] and tree.ancestor_mask[0, 3, 1]
    assert tree.leaf_paths(0) == [[0, 2], [0, 1, 3]]  # leaves in index order and tree.leaf_paths(1) == [[0, 1, 2, 3]]
    shared = TokenTree.from_shape(TreeShape.paper13(), torch.zeros(3, 13, dtype=torch.long))
    assert shared.depth.shape == (3, 13) and shared.children()[0] == [1, 2, 3]


def test_token_tree_validation():
    with pytest.raises(ValueError, match=r"tokens must have shape \[B, 3\]"):
        TokenTree(torch.tensor([-1, 0, 0]), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="tokens must be an integer tensor"):
        TokenTree(torch.tensor([-1, 0, 0]), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="parents has 3 rows but tokens has batch 2"):
        TokenTree(torch.tensor([[-1, 0]] * 3), torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"valid\[:, 0\] must be True"):
        TokenTree(torch.tensor([-1, 0]), torch.zeros(1, 2, dtype=torch.long), valid=torch.tensor([[False, True]]))
    with pytest.raises(ValueError, match="first bad index 1"):
        TokenTree(torch.tensor([-1, 5]), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="child_ids and child_probs must be given together"):
        TokenTree(torch.tensor([-1, 0]), torch.zeros(1, 2, dtype=torch.long), child_ids=torch.zeros(1, 2, 3))


def test_tree_specs(tmp_path):
    assert TreeShape.from_spec("paper13") == TreeShape.paper13()
    assert TreeShape.from_spec("chain:4") == TreeShape.chain(4)
    assert TreeShape.from_spec("full:3x2") == TreeShape.full(3, 2)
    path = tmp_path / "t.json"
    TreeShape.from_children([2, 0, 1]).save(path)
    assert TreeShape.from_spec(str(path)) == TreeShape.from_children([2, 0, 1])
    for bad in ["", "full:3", "chain:x", "star:3", str(tmp_path / "missing.json"), "chain:-1"]:
        with pytest.raises(ValueError, match="tree spec"):
            TreeShape.from_spec(bad)


@given(st.lists(st.integers(0, 10**6), min_size=0, max_size=30))
def test_a_shapes_plan_lists_its_internal_nodes_depth_by_depth_parents_first(draws):
    """Every drafter fills a static shape by its plan: each node with children exactly once,
    shallower first and in index order within a depth, each with its children in order; the
    arrays say the same as the lists."""
    parents = [-1] + [d % (i + 1) for i, d in enumerate(draws)]
    shape = TreeShape(tuple(parents))
    plan = shape.plan
    assert shape.plan is plan  # made once per shape
    kids = shape.children()
    internal = [v for v in range(shape.n) if kids[v]]
    order = sorted(internal, key=lambda v: (shape.depth[v], v))
    assert plan.nodes.tolist() == order == [v for level in plan.levels for v in level]
    assert all(shape.depth[v] == d for d, level in enumerate(plan.levels) for v in level)
    assert plan.level_at.tolist() == np.cumsum([0] + [len(level) for level in plan.levels]).tolist()
    for p, v in enumerate(order):
        assert plan.children[plan.child_at[p]: plan.child_at[p + 1]].tolist() == kids[v] == plan.kids[v]
    assert plan.inner.tolist() == [bool(kids[c]) for c in plan.children.tolist()]
    seen = {0}
    for v in order:  # a node's parent is filled before it
        assert v in seen
        seen.update(kids[v])


@given(n=st.integers(1, 40), data=st.data())
def test_a_trees_prefix_is_the_validated_tree_of_its_first_nodes(n, data):
    """``TokenTree.prefix(m)`` (not validated again): the tree built and validated from the first
    ``m`` parents, tokens, valid flags and child laws, of a static shape (whose prefix shape and
    index are the shape's own, cached) or per-row parents; a size outside [1, n] is a ValueError."""
    parents = data.draw(parent_lists(n))
    m = data.draw(st.integers(1, n))
    g = torch.Generator().manual_seed(n)
    tokens, ids = torch.randint(0, 50, (2, n), generator=g), torch.randint(0, 50, (2, n, 3), generator=g)
    valid = torch.rand(2, n, generator=g) < 0.7
    valid[:, 0] = True
    laws = dict(valid=valid, child_ids=ids, child_probs=torch.rand(2, n, 3, generator=g), with_replacement=True,
                weak=np.random.default_rng(n).random((2, n)) < 0.5)
    shape = TreeShape(tuple(parents))
    for tree in (TokenTree.from_shape(shape, tokens, **laws), TokenTree(torch.tensor([parents] * 2), tokens, **laws)):
        got = tree.prefix(m)
        cut = {k: v[:, :m] if isinstance(v, (torch.Tensor, np.ndarray)) else v for k, v in laws.items()}
        want = TokenTree(tree.parents[..., :m], tokens[:, :m], **cut)
        for name in ("parents", "tokens", "valid", "child_ids", "child_probs"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert np.array_equal(got.weak, want.weak) and np.array_equal(tree.to("cpu").weak, tree.weak)
        assert got.with_replacement and got.row_sizes is None and got.n == m
        for name in ("parents", "depth", "pre", "last"):
            assert torch.equal(getattr(got.index, name), getattr(want.index, name)), name
        if tree.static_shape is not None:
            assert got.static_shape == TreeShape(tuple(parents[:m])) and got.static_shape is shape.prefix(m)
            assert got.index is shape.prefix(m).index()
        for bad in (0, n + 1, 1.0, True):
            for owner in (tree, shape):
                with pytest.raises(ValueError, match=f"a prefix has 1 to {n} nodes, got {bad!r}"):
                    owner.prefix(bad)


@given(n=st.integers(1, 20), data=st.data())
def test_a_trees_arrays_are_its_tensors_memory_and_follow_its_fields(n, data):
    """``TokenTree.arrays()``: the tokens and valid flags as NumPy arrays sharing the tensors'
    memory, whether made by the tree, handed over by its maker (``from_arrays``: not copied) or
    cut with it (``prefix``); a field given another tensor gets that tensor's arrays."""
    parents = data.draw(parent_lists(n))
    m = data.draw(st.integers(1, n))
    g = np.random.default_rng(n)
    tokens = g.integers(0, 50, (2, n))
    valid = g.random((2, n)) < 0.7
    valid[:, 0] = True
    shape = TreeShape(tuple(parents))
    made = TokenTree.from_arrays(shape, tokens, valid)
    assert made.arrays()[0] is tokens and made.arrays()[1] is valid
    cut = made.prefix(m)  # (cut from the arrays: the tree's first m nodes all the same)
    assert torch.equal(cut.tokens, torch.from_numpy(tokens[:, :m]))
    assert torch.equal(cut.valid, torch.from_numpy(valid[:, :m]))
    assert cut.static_shape is shape.prefix(m) and torch.equal(cut.parents, torch.tensor(parents[:m]))
    assert np.shares_memory(made.tokens.numpy(), tokens) and torch.equal(made.valid, torch.from_numpy(valid))
    for tree in (made, TokenTree.from_shape(shape, torch.from_numpy(tokens.copy())), made.prefix(m)):
        got_tokens, got_valid = tree.arrays()
        assert np.array_equal(got_tokens, tree.tokens.numpy()) and np.shares_memory(got_tokens, tree.tokens.numpy())
        assert (got_valid is None) == (tree.valid is None)
        if got_valid is not None:
            assert np.array_equal(got_valid, tree.valid.numpy()) and np.shares_memory(got_valid, tree.valid.numpy())
    other = torch.from_numpy(g.integers(0, 50, (2, n)))
    made.tokens, made.valid = other, None
    assert made.arrays()[0] is not tokens and np.array_equal(made.arrays()[0], other.numpy())
    assert made.arrays()[1] is None


def test_a_tree_of_arrays_is_checked_as_one_of_tensors():
    """``from_arrays`` checks what ``from_shape`` checks, with the same errors: integer tokens of
    the shape's width, bool valid flags of the tokens' shape, the root always valid, weak marks
    as host bools of the tokens' shape."""
    shape = TreeShape.paper13()
    tokens, valid = np.zeros((2, shape.n), dtype=np.int64), np.ones((2, shape.n), dtype=bool)
    for bad, error, match in ((tokens.astype(np.float32), TypeError, "tokens must be an integer"),
                              (tokens[:, :5], ValueError, r"tokens must have shape \[B, 13\]")):
        with pytest.raises(error, match=match):
            TokenTree.from_arrays(shape, bad, valid)
        with pytest.raises(error, match=match):
            TokenTree.from_shape(shape, torch.from_numpy(bad), valid=torch.from_numpy(valid))
    root = valid.copy()
    root[1, 0] = False
    for bad, match in ((valid[:1], "valid must be a bool"), (valid.astype(np.int64), "valid must be a bool"),
                       (root, r"valid\[:, 0\] must be True")):
        with pytest.raises(ValueError, match=match):
            TokenTree.from_arrays(shape, tokens, bad)
    for bad in (valid[:1], valid.astype(np.int64), torch.from_numpy(valid)):  # weak: host bools of the tokens' shape
        with pytest.raises(ValueError, match="weak must be a NumPy bool array of shape"):
            TokenTree.from_arrays(shape, tokens, valid, bad)
        with pytest.raises(ValueError, match="weak must be a NumPy bool array of shape"):
            TokenTree.from_shape(shape, torch.from_numpy(tokens), weak=bad)
    tree = TokenTree.from_arrays(shape, tokens, valid)
    want = TokenTree.from_shape(shape, torch.from_numpy(tokens), valid=torch.from_numpy(valid))
    for name in ("parents", "tokens", "valid"):
        assert torch.equal(getattr(tree, name), getattr(want, name))
    assert tree.static_shape is shape and tree.index is want.index and tree.child_ids is None
    assert not tree.with_replacement and tree.row_sizes is None


def test_a_host_tensor_hands_back_its_array_and_any_other_tensor_its_memory():
    """``host_tensor(a)`` is ``a``'s memory as a tensor and ``host_array`` of it is ``a`` itself (no
    conversion: the kernels' ``as_numpy`` takes it too); any other CPU tensor's is its ``.numpy()``,
    a view of it (such as a cut of a host tensor) included."""
    from stree.kernels._common import as_numpy
    from stree.tree import host_array, host_tensor

    a = np.arange(12, dtype=np.int64).reshape(3, 4)
    t = host_tensor(a)
    assert host_array(t) is a and as_numpy(t) is a and np.shares_memory(t.numpy(), a)
    t[0, 0] = 7  # (one memory)
    assert a[0, 0] == 7
    for other in (torch.arange(5), t[:, :2]):
        got = host_array(other)
        assert got is not a and np.array_equal(got, other.numpy()) and np.shares_memory(got, other.numpy())
