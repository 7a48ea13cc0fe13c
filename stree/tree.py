"""Token trees: parent arrays, their validation, and the derived indices every tree kernel uses.

A tree of ``n`` nodes is a parent array in topological order: ``parents[0] == -1`` (the root) and
``0 <= parents[i] < i``. Kernels never see an ``n x n`` mask; they get a :class:`TreeIndex`
(depth plus a pre-order interval per node), from which "j is an ancestor-or-self of i" is the
two comparisons ``pre[j] <= pre[i] <= last[j]``.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

__all__ = [
    "check_parents",
    "ancestor_mask",
    "TreeIndex",
    "tree_index",
    "PackedTrees",
    "pack_trees",
    "packed_trees",
    "check_cu_seqlens",
    "leaf_paths",
    "MAX_TREE_NODES",
    "check_size",
    "TreeShape",
    "ShapePlan",
    "TreeBudget",
    "tree_spec",
    "TokenTree",
    "host_array",
    "host_tensor",
]


# The most nodes a tree (or a prefill chunk) may have: the kernels' limit, and what keeps the n x n
# ancestor masks small. Checked before anything of size n x n exists.
MAX_TREE_NODES = 1024


def check_size(n: int, what: str = "tree") -> None:
    if n > MAX_TREE_NODES:
        raise ValueError(f"a {what} of {n} nodes is larger than the {MAX_TREE_NODES} nodes the kernels handle")


def check_parents(parents, name: str = "parents") -> torch.Tensor:
    """Validate a parent array (``[n]`` or ``[rows, n]``, n <= MAX_TREE_NODES) and return it as
    int64.

    Raises ``TypeError`` for a non-integer array and ``ValueError`` naming the first bad index.
    """
    if not isinstance(parents, torch.Tensor):
        try:
            parents = torch.as_tensor(parents)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"{name} must be an integer tensor or sequence, got {type(parents).__name__}") from exc
    if parents.dtype.is_floating_point or parents.dtype.is_complex or parents.dtype == torch.bool:
        raise TypeError(f"{name} must have an integer dtype, got {parents.dtype}")
    if parents.dim() not in (1, 2):
        raise ValueError(f"{name} must have shape [n] or [batch, n], got {tuple(parents.shape)}")
    n = parents.shape[-1]
    if n == 0:
        raise ValueError(f"{name} must hold at least the root node, got an empty array")
    check_size(n)
    p = parents.reshape(-1, n).long()
    idx = torch.arange(n, device=p.device)
    bad = (p < 0) | (p >= idx)
    bad[:, 0] = p[:, 0] != -1
    if bool(bad.any()):
        row, i = (int(v) for v in torch.nonzero(bad)[0])
        where = f"{name}[{row}, {i}]" if parents.dim() == 2 else f"{name}[{i}]"
        rule = "the root must have parent -1" if i == 0 else f"need 0 <= parent < {i} (topological order)"
        raise ValueError(f"invalid parent array: first bad index {i}: {where} = {int(p[row, i])}; {rule}")
    return p.reshape(parents.shape)


def _ancestor_mask_rows(p: torch.Tensor) -> torch.Tensor:
    """``[rows, n]`` valid parents -> ``[rows, n, n]`` bool, ``L[r, i, j]`` = j ancestor-or-self of i.

    Pointer doubling: after step k, ``L`` holds the ancestors within distance ``< 2**k`` and
    ``jump`` the ``2**k``-th ancestor, so ``ceil(log2 n)`` gathers cover any depth.
    """
    rows, n = p.shape
    L = torch.eye(n, dtype=torch.bool, device=p.device).expand(rows, n, n).clone()
    jump = p.clone()
    reach = 1
    while reach < n:
        has = jump >= 0
        src = jump.clamp(min=0)
        L |= torch.gather(L, 1, src[:, :, None].expand(rows, n, n)) & has[:, :, None]
        jump = torch.where(has, torch.gather(jump, 1, src), jump)
        reach *= 2
    return L


def ancestor_mask(parents) -> torch.Tensor:
    """Bool mask ``[..., n, n]``: entry ``(i, j)`` is True iff j is i or an ancestor of i."""
    p = check_parents(parents)
    n = p.shape[-1]
    return _ancestor_mask_rows(p.reshape(-1, n)).reshape(*p.shape, n)


@dataclass(frozen=True)
class TreeIndex:
    """Validated tree in the form kernels consume; ``rows`` is 1 (shared by the batch) or batch.

    ``pre`` is the pre-order rank (children visited in index order) and ``last`` the largest
    pre-order rank in the node's subtree, so the subtree of j is the interval ``[pre[j], last[j]]``.
    All tensors are int32 ``[rows, n]`` on one device.
    """

    parents: torch.Tensor
    depth: torch.Tensor
    pre: torch.Tensor
    last: torch.Tensor
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def memo(self, key, fn):
        """``fn()`` computed once per tree: the tensors every layer of a pass derives alike."""
        if key not in self._memo:
            self._memo[key] = fn()
        return self._memo[key]

    @property
    def rows(self) -> int:
        return self.parents.shape[0]

    @property
    def n(self) -> int:
        return self.parents.shape[1]

    @property
    def device(self) -> torch.device:
        return self.parents.device

    def ancestor_mask(self) -> torch.Tensor:
        """``[rows, n, n]`` bool, from the intervals (what the kernels compute in registers)."""
        def build():
            pre_i = self.pre[:, :, None]
            return (self.pre[:, None, :] <= pre_i) & (pre_i <= self.last[:, None, :])
        return self.memo("ancestor_mask", build)

    def is_chain(self) -> bool:
        """Whether every row is a chain (node i the child of node i - 1)."""
        return self.memo("is_chain", lambda: bool((self.depth == torch.arange(self.n, device=self.device)).all()))

    def for_batch(self, batch: int, name: str = "parents") -> "TreeIndex":
        if self.rows not in (1, batch):
            raise ValueError(f"{name} has {self.rows} rows but the inputs have batch {batch}; use one shared row or one per batch row")
        return self

    @classmethod
    def root_only(cls, device) -> "TreeIndex":
        """The one-node tree, built without validation or host-to-device copies (so it can be made
        inside a CUDA-graph capture): what an autoregressive step attends with."""
        zero = torch.zeros(1, 1, dtype=torch.int32, device=device)
        return cls(zero - 1, zero, zero, zero)

    def to(self, device) -> "TreeIndex":
        """The same index on ``device``; what is known on the host (the deepest level, the largest
        sibling rank) comes along."""
        device = torch.device(device)
        if self.device == device:
            return self
        moved = TreeIndex(*(t.to(device, non_blocking=True) for t in (self.parents, self.depth, self.pre, self.last)))
        for key in ("max_depth", "max_sibling_rank"):
            if key in self._memo:
                moved._memo[key] = self._memo[key]
        return moved

    def row_stride(self) -> int:
        """Stride between batch rows for kernels: 0 when one tree is shared by the whole batch."""
        return 0 if self.rows == 1 else self.parents.stride(0)


def tree_index(parents) -> TreeIndex:
    """Validate ``parents`` (``[n]`` or ``[rows, n]``) and compute its :class:`TreeIndex`."""
    if isinstance(parents, TreeIndex):
        return parents
    p = check_parents(parents)
    n = p.shape[-1]
    p = p.reshape(-1, n)
    L = _ancestor_mask_rows(p)
    Li = L.long()
    depth = Li.sum(-1) - 1
    size = Li.sum(-2)
    # left[a]: total size of a's siblings that come before it; pre[i] = depth[i] + sum over
    # i's ancestors-or-self of left (every earlier sibling subtree along the path precedes i).
    same_parent = p[:, :, None] == p[:, None, :]
    earlier = torch.ones(n, n, dtype=torch.bool, device=p.device).tril(-1)
    left = ((same_parent & earlier).long() * size[:, None, :]).sum(-1)
    pre = depth + (Li * left[:, None, :]).sum(-1)
    last = pre + size - 1
    as32 = lambda t: t.to(torch.int32).contiguous()
    return TreeIndex(as32(p), as32(depth), as32(pre), as32(last))


@dataclass(frozen=True)
class PackedTrees:
    """Trees of different sizes laid back to back without padding: how engines hand kernels a
    batch of requests (``cu_seqlens``), here each request with a tree of its own.

    Tree r owns packed nodes ``cu_seqlens[r] .. cu_seqlens[r + 1] - 1``, numbered inside it from 0
    (its root): ``parents``, ``depth``, ``pre`` and ``last`` (int32 ``[total]``) are each tree's own
    :class:`TreeIndex` values end to end, so a kernel program of tree r offsets its pointers by
    ``cu_seqlens[r]`` and runs the one-tree code on ``cu_seqlens[r + 1] - cu_seqlens[r]`` nodes.
    ``padded`` is the same trees as one ``[batch, max_n]`` TreeIndex (each padding node a leaf under
    its root, after every real node in pre-order: the real nodes' values are the packed ones) for
    the padded reference calls; :meth:`unpack` and :meth:`pack` move tensors between the layouts.
    Made by :func:`pack_trees` (parent arrays on the host) or :func:`packed_trees` (tensors).
    """

    parents: torch.Tensor
    depth: torch.Tensor
    pre: torch.Tensor
    last: torch.Tensor
    cu_seqlens: torch.Tensor
    max_n: int
    padded: TreeIndex
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def batch(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    @property
    def total(self) -> int:
        return self.parents.shape[0]

    @property
    def device(self) -> torch.device:
        return self.parents.device

    def memo(self, key, fn):
        """``fn()`` computed once per packing (as :meth:`TreeIndex.memo`)."""
        if key not in self._memo:
            self._memo[key] = fn()
        return self._memo[key]

    @property
    def tree_ids(self) -> torch.Tensor:
        """The tree each packed node belongs to, int64 ``[total]``."""
        return self.memo("tree_ids", lambda: torch.repeat_interleave(
            torch.arange(self.batch, device=self.device), self.cu_seqlens.diff().long()))

    def _flat(self) -> torch.Tensor:
        """Packed node -> its position in the flattened ``[batch, max_n]`` layout."""
        def build():
            local = torch.arange(self.total, device=self.device) - self.cu_seqlens.long()[self.tree_ids]
            return self.tree_ids * self.max_n + local
        return self.memo("flat", build)

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        """``[1, total, ...]`` -> ``[batch, max_n, ...]``, padding nodes zero."""
        out = t.new_zeros(self.batch * self.max_n, *t.shape[2:])
        return out.index_copy_(0, self._flat(), t[0]).view(self.batch, self.max_n, *t.shape[2:])

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """``[batch, max_n, ...]`` -> ``[1, total, ...]`` (the real nodes)."""
        return t.reshape(self.batch * self.max_n, *t.shape[2:]).index_select(0, self._flat())[None]

    def to(self, device) -> "PackedTrees":
        """The same trees on ``device`` (not validated again)."""
        device = torch.device(device)
        if self.device == device:
            return self
        move = lambda t: t.to(device, non_blocking=True)
        return PackedTrees(*map(move, (self.parents, self.depth, self.pre, self.last, self.cu_seqlens)), self.max_n,
                           self.padded.to(device))


def check_cu_seqlens(cu_seqlens, total: int) -> list[int]:
    """Each packed tree's node count from ``cu_seqlens`` (int ``[batch + 1]``, 0 first, rising, ``total``
    last); one device-to-host copy."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must be an integer tensor, got {getattr(cu_seqlens, 'dtype', type(cu_seqlens))}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must have shape [batch + 1] with batch >= 1, got {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != total:
        raise ValueError(f"cu_seqlens must run from 0 to the {total} packed nodes, got {cu[0]} .. {cu[-1]}")
    sizes = [b - a for a, b in zip(cu, cu[1:])]
    for r, size in enumerate(sizes):
        if size < 1:
            raise ValueError(f"cu_seqlens gives tree {r} {size} nodes: every tree has at least its root")
        check_size(size, f"tree (tree {r} of cu_seqlens)")
    return sizes


def packed_trees(parents, cu_seqlens) -> PackedTrees:
    """Validate trees packed as engines pass them: ``parents`` ``[total]`` (each tree's own parent
    array, numbered from its root) and ``cu_seqlens`` ``[batch + 1]``; a bad tree is named with the
    index inside it (``parents[tree, node]``)."""
    if not isinstance(parents, torch.Tensor):
        raise TypeError(f"parents must be an integer tensor [total], got {type(parents).__name__}")
    if parents.dim() != 1:
        raise ValueError(f"packed parents must have shape [total], got {tuple(parents.shape)}")
    sizes = check_cu_seqlens(cu_seqlens, parents.shape[0])
    return _pack(parents, cu_seqlens, sizes)


def pack_trees(trees: Sequence, device=None) -> PackedTrees:
    """:class:`PackedTrees` of parent arrays (sequences, tensors or :class:`TreeShape`), in order."""
    if isinstance(trees, (str, bytes)) or not isinstance(trees, Sequence) or not trees:
        raise ValueError(f"trees must be a non-empty sequence of parent arrays, got {trees!r}")
    arrays = [t.parents if isinstance(t, TreeShape) else t for t in trees]
    for r, a in enumerate(arrays):
        if not isinstance(a, torch.Tensor) and not isinstance(a, Sequence):
            raise TypeError(f"trees[{r}] must be a parent array, got {type(a).__name__}")
    flat = [torch.as_tensor(a).reshape(-1).tolist() for a in arrays]
    sizes = [len(a) for a in flat]
    cu = torch.tensor([0, *np.cumsum(sizes).tolist()], dtype=torch.int32, device=device)
    for r, size in enumerate(sizes):
        if size < 1:
            raise ValueError(f"trees[{r}] is empty: every tree has at least its root")
        check_size(size, f"tree (trees[{r}])")
    return _pack(torch.tensor([v for a in flat for v in a], device=device), cu, sizes)


@functools.lru_cache(maxsize=256)
def _packed_prefixes(shape: "TreeShape", sizes: tuple[int, ...], device: torch.device) -> PackedTrees:
    """The first ``sizes[r]`` nodes of ``shape`` for each row r, packed (prefixes of a parent
    array are trees); kept per shape, sizes and device, as a decode loop asks for the same again."""
    return pack_trees([shape.parents[:s] for s in sizes], device)


def _pack(parents: torch.Tensor, cu_seqlens: torch.Tensor, sizes: list[int]) -> PackedTrees:
    device, batch, max_n = parents.device, len(sizes), max(sizes)
    sizes_t = torch.tensor(sizes, device=device)
    tree = torch.repeat_interleave(torch.arange(batch, device=device), sizes_t)
    flat = tree * max_n + torch.arange(parents.shape[0], device=device) - cu_seqlens.long()[tree]
    # padding nodes: children of their tree's root (valid, and after every real node in pre-order)
    grid = torch.zeros(batch * max_n, dtype=torch.long, device=device).index_copy_(0, flat, parents.long())
    index = tree_index(check_parents(grid.view(batch, max_n)))
    take = lambda t: t.reshape(-1).index_select(0, flat)
    # a root's subtree interval reaches over the padding: clip it to the tree's own nodes
    last = torch.minimum(take(index.last), (sizes_t - 1).to(torch.int32)[tree])
    packed = PackedTrees(take(index.parents), take(index.depth), take(index.pre), last.contiguous(),
                         cu_seqlens.to(torch.int32), max_n, index)
    packed._memo.update(flat=flat, tree_ids=tree)
    return packed


def leaf_paths(parents: Sequence[int]) -> list[list[int]]:
    """Root-to-leaf node lists of one tree, leaves in index order (the unrolled baseline's batch)."""
    p = [int(v) for v in check_parents(torch.as_tensor(list(parents))).tolist()]
    has_child = set(p[1:])
    paths = []
    for leaf in (i for i in range(len(p)) if i not in has_child):
        path = [leaf]
        while p[path[-1]] >= 0:
            path.append(p[path[-1]])
        paths.append(path[::-1])
    return paths


# (a choice of tree sizes drafts prefixes of its plans, and plans change: 8 n-gram calls then 8
# STAND calls had built 48 and 116 indexes, the STAND ones with the 64 places full)
@functools.lru_cache(maxsize=1024)
def _shape_index(shape: "TreeShape", device: torch.device) -> TreeIndex:
    if device.type != "cpu":  # built on the host (no device sync), then copied once
        return _shape_index(shape, torch.device("cpu")).to(device)
    index = _host_index(shape.parents)
    index.memo("max_depth", lambda: shape.max_depth)
    return index


def _check_prefix(m, n: int) -> None:
    if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= n:
        raise ValueError(f"a prefix has 1 to {n} nodes, got {m!r}")


@functools.lru_cache(maxsize=1024)
def shape_of(parents: tuple[int, ...]) -> "TreeShape":
    """The process's one :class:`TreeShape` of ``parents`` (a tuple), checked once: what a shape
    keeps (its index, the plan drafters fill it by, its prefixes) is then made once however many
    plans name it (a choice re-plans every few steps, and most new plans begin as the last did)."""
    return TreeShape(parents)


def _host_index(parents: tuple[int, ...]) -> TreeIndex:
    """:func:`tree_index` of a validated parent tuple, in plain Python: a few dozen nodes walked
    once cost far less than the dozen tensor ops the general path takes."""
    n = len(parents)
    depth, size = [0] * n, [1] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    for i in range(n - 1, 0, -1):
        size[parents[i]] += size[i]
    pre, free = [0] * n, [1] * n  # free[v]: the pre-order rank v's next child takes
    for i in range(1, n):
        pre[i] = free[parents[i]]
        free[parents[i]] += size[i]
        free[i] = pre[i] + 1
    rows = lambda v: torch.tensor([v], dtype=torch.int32, device="cpu")  # (named: a default-device context)
    return TreeIndex(rows(list(parents)), rows(depth), rows(pre), rows([p + s - 1 for p, s in zip(pre, size)]))


@functools.lru_cache(maxsize=128)
def filled_mask(rows: int, n: int, value: bool) -> np.ndarray:
    """A read-only bool mask ``[rows, n]`` of ``value`` throughout, made once per shape: the mask a
    draft without one stands for (every node valid, none weak), read by each iteration's compiled
    calls, where a new array per iteration cost a tenth of a greedy iteration's host work."""
    out = np.full((rows, n), value, dtype=np.bool_)
    out.setflags(write=False)
    return out


def host_tensor(a: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy(a)`` that remembers ``a``: :func:`host_array` hands it back without a
    dispatcher call (a ``.numpy()`` is four, microseconds each where a decoding step's host work
    runs right after a model pass). The tensor must keep its memory (no ``set_``, no resize)."""
    t = torch.from_numpy(a)
    t._host_array = a
    return t


def host_array(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as an array: the one :func:`host_tensor` made it from, else ``.numpy()``."""
    a = getattr(t, "_host_array", None)
    return t.numpy() if a is None else a


@dataclass(frozen=True)
class TreeShape:
    """A static tree topology (no tokens), shared by all rows of a batch."""

    parents: tuple[int, ...]

    def __post_init__(self):
        p = self.parents
        # (plain ints checked in plain Python: a choice of tree sizes makes shapes as it plans; the
        # tensor check names what is wrong)
        if not (isinstance(p, (tuple, list)) and 0 < len(p) <= MAX_TREE_NODES and set(map(type, p)) == {int}
                and p[0] == -1 and (len(p) == 1 or min(p[1:]) >= 0 and all(map(int.__lt__, p[1:], range(1, len(p)))))):
            p = check_parents(list(p)).tolist()
        object.__setattr__(self, "parents", tuple(p))

    @property
    def n(self) -> int:
        return len(self.parents)

    @cached_property
    def depth(self) -> tuple[int, ...]:
        d = [0] * self.n
        for i in range(1, self.n):
            d[i] = d[self.parents[i]] + 1
        return tuple(d)

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in range(self.n)]
        for i in range(1, self.n):
            kids[self.parents[i]].append(i)
        return kids

    @cached_property
    def plan(self) -> "ShapePlan":
        """What a drafter fills this shape by, made once per shape (a decode loop drafts the same
        shape every step)."""
        return ShapePlan(self)

    def leaf_paths(self) -> list[list[int]]:
        return leaf_paths(self.parents)

    def parents_tensor(self, device=None) -> torch.Tensor:
        return torch.tensor(self.parents, dtype=torch.long, device=device)

    def index(self, device=None) -> TreeIndex:
        """The shape's TreeIndex on ``device``, built once per shape and device (a decode loop
        drafts the same shape every step); its deepest level is known without a device sync."""
        if device is None or getattr(device, "type", None) == "cpu":
            return self._cpu_index  # (kept on the shape: hashing it and a device, per draft, cost microseconds)
        return _shape_index(self, torch.device(device))

    @cached_property
    def _cpu_index(self) -> TreeIndex:
        return _shape_index(self, torch.device("cpu"))

    def prefix(self, m: int) -> "TreeShape":
        """The first ``m`` nodes (parents come first: a tree), made once per shape and size."""
        known = self._prefixes.get(m) if type(m) is int else None  # (kept on the shape, as the index)
        if known is None:
            _check_prefix(m, self.n)  # (before the cache, which takes 1.0 and True for 1)
            known = self._prefixes[m] = shape_of(self.parents[:m])
        return known

    @cached_property
    def _prefixes(self) -> dict:
        return {}

    @classmethod
    def chain(cls, depth: int) -> "TreeShape":
        """The root followed by ``depth`` nodes in a line (vanilla speculative decoding)."""
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        check_size(depth + 1)
        return cls(tuple(range(-1, depth)))

    @classmethod
    def full(cls, width: int, depth: int) -> "TreeShape":
        """Complete ``width``-ary tree with ``depth`` levels below the root, in BFS order."""
        if width < 1 or depth < 0:
            raise ValueError(f"full tree needs width >= 1 and depth >= 0, got width={width}, depth={depth}")
        n, level = 0, 1
        for _ in range(depth + 1):  # summed level by level: full:1000x1000 never computes 1000**1000
            n += level
            if n > MAX_TREE_NODES:
                raise ValueError(f"a full:{width}x{depth} tree has more than the {MAX_TREE_NODES} nodes the kernels "
                                 "handle")
            level *= width
        return cls((-1,) + tuple((i - 1) // width for i in range(1, n)))

    @classmethod
    def from_children(cls, counts: Sequence[int]) -> "TreeShape":
        """BFS-numbered tree where node i has ``counts[i]`` children (missing entries mean 0)."""
        parents = [-1]
        for i, c in enumerate(counts):
            if c < 0:
                raise ValueError(f"counts[{i}] must be >= 0, got {c}")
            if c and i >= len(parents):
                raise ValueError(f"counts[{i}] = {c} but the tree has only {len(parents)} nodes before it")
            check_size(len(parents) + c)
            parents.extend([i] * c)
        return cls(tuple(parents))

    @classmethod
    def paper13(cls) -> "TreeShape":
        """The 13-node static tree of the STree paper (4 levels, 3 nodes per level)."""
        return cls((-1, 0, 0, 0, 1, 1, 2, 4, 4, 5, 7, 7, 7))

    @classmethod
    def from_spec(cls, spec: str) -> "TreeShape":
        """``paper13``, ``chain:D``, ``full:WxD`` (width W, depth D) or a path to a JSON file."""
        if not isinstance(spec, str) or not spec:
            raise ValueError(f"tree spec must be a non-empty string, got {spec!r}")
        kind, _, arg = spec.partition(":")
        try:
            if spec == "paper13":
                return cls.paper13()
            if kind == "chain" and arg:
                return cls.chain(int(arg))
            if kind == "full" and arg:
                width, depth = arg.lower().split("x")
                return cls.full(int(width), int(depth))
        except ValueError as exc:
            raise ValueError(f"bad tree spec {spec!r}: {exc}") from exc
        if spec.endswith(".json"):
            if not Path(spec).is_file():
                raise ValueError(f"tree spec {spec!r}: no such file")
            return cls.load(spec)
        raise ValueError(f"bad tree spec {spec!r}: use paper13, chain:D, full:WxD or a .json file (or dynamic:N "
                         "where a drafter grows its own trees)")

    def to_json(self) -> str:
        return json.dumps({"format": "stree.tree_shape", "version": 1, "parents": list(self.parents)})

    @classmethod
    def from_json(cls, text: str) -> "TreeShape":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"tree shape JSON is malformed: {exc}") from exc
        if not isinstance(data, dict) or data.get("format") != "stree.tree_shape" or "parents" not in data:
            raise ValueError("tree shape JSON must be an object with format 'stree.tree_shape' and a 'parents' list")
        return cls(tuple(data["parents"]))

    def save(self, path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path) -> "TreeShape":
        return cls.from_json(Path(path).read_text())


class ShapePlan:
    """A shape's internal nodes (those with children) depth by depth, each depth in index order,
    with every node's children in draw order: the order in which every drafter fills a static
    shape (a node's children are drafted from its path, so parents come first). As lists for the
    reference paths, and as arrays for the compiled ones: ``nodes`` (the internal nodes, depth by
    depth), ``level_at`` (where each depth starts in ``nodes``), ``child_at`` (where each
    internal node's children start in ``children``), ``children`` and ``inner`` (whether each
    child has children of its own)."""

    def __init__(self, shape: "TreeShape"):
        self.shape, self.kids = shape, shape.children()
        self.levels: list[list[int]] = [[] for _ in range(shape.max_depth)]
        for v, d in enumerate(shape.depth):
            if self.kids[v]:
                self.levels[d].append(v)
        nodes = [v for level in self.levels for v in level]
        flat = [c for v in nodes for c in self.kids[v]]
        self.nodes = np.array(nodes, dtype=np.int64)
        self.level_at = np.cumsum([0] + [len(level) for level in self.levels]).astype(np.int64)
        self.child_at = np.cumsum([0] + [len(self.kids[v]) for v in nodes]).astype(np.int64)
        self.children = np.array(flat, dtype=np.int64)
        self.inner = np.array([bool(self.kids[c]) for c in flat], dtype=np.bool_)


@dataclass(frozen=True)
class TreeBudget:
    """A tree the drafter grows anew each step, for each row, under a budget of ``nodes`` nodes
    (the root included) and at most ``depth`` levels below the root (default ``nodes - 1``): the
    drafter expands its most probable frontier first (EAGLE-2's idea; see
    :mod:`stree.drafters.dynamic`). ``width``: expand at most this many nodes per level and row
    (each expansion costs a model drafter a row of its step; EAGLE-2's top-k; default: every node
    that may still get children, the exact best-first tree). ``calibrate``: weigh each drafted
    child by its learned chance of acceptance given its rank and the drafter's confidence,
    instead of the drafter's probability alone (EAGLE-2's). Only drafters with
    ``dynamic = True`` take one."""

    nodes: int
    depth: int | None = None
    width: int | None = None
    calibrate: bool = True

    def __post_init__(self):
        if not isinstance(self.calibrate, bool):
            raise TypeError(f"TreeBudget calibrate must be a bool, got {type(self.calibrate).__name__}")
        for name in ("nodes", "depth", "width"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise TypeError(f"TreeBudget {name} must be an int, got {type(v).__name__}")
        if not 2 <= self.nodes <= MAX_TREE_NODES:
            raise ValueError(f"TreeBudget nodes must be in [2, {MAX_TREE_NODES}] (the root and at least one draft), "
                             f"got {self.nodes}")
        if self.depth is None:
            object.__setattr__(self, "depth", self.nodes - 1)
        if not 1 <= self.depth <= self.nodes - 1:
            raise ValueError(f"TreeBudget depth must be in [1, nodes - 1 = {self.nodes - 1}], got {self.depth}")
        if self.width is not None and self.width < 1:
            raise ValueError(f"TreeBudget width must be >= 1 (or None: no limit), got {self.width}")

    @property
    def n(self) -> int:
        """The nodes of every drafted tree (rows that grow fewer are padded with invalid nodes)."""
        return self.nodes

    @property
    def max_depth(self) -> int:
        return self.depth


def tree_spec(spec: str) -> "TreeShape | TreeBudget":
    """:meth:`TreeShape.from_spec`, or ``dynamic:N[xD][wE][:raw]`` for a :class:`TreeBudget` of N
    nodes, at most D levels deep, at most E expansions per level, ``:raw`` weighed by the
    drafter's probabilities alone (``calibrate=False``)."""
    if isinstance(spec, str) and spec.startswith("dynamic:"):
        m = re.fullmatch(r"dynamic:(\d+)(?:x(\d+))?(?:w(\d+))?(:raw)?", spec.lower())
        if m is None:
            raise ValueError(f"bad tree spec {spec!r}: use dynamic:N, dynamic:NxD, dynamic:NxDwE, ...:raw")
        nodes, depth, width, raw = m.groups()
        try:
            return TreeBudget(int(nodes), depth and int(depth), width and int(width), calibrate=raw is None)
        except ValueError as exc:
            raise ValueError(f"bad tree spec {spec!r}: {exc}") from exc
    return TreeShape.from_spec(spec)


def _check_weak(weak, shape: tuple) -> None:
    if not isinstance(weak, np.ndarray) or weak.dtype != np.bool_ or weak.shape != tuple(shape):
        raise ValueError(f"weak must be a NumPy bool array of shape {tuple(shape)}, got "
                         f"{getattr(weak, 'dtype', type(weak))} {getattr(weak, 'shape', '')}")


@dataclass
class TokenTree:
    """Draft tokens on a tree: ``parents`` ``[N]`` (shared) or ``[B, N]``, ``tokens`` ``[B, N]``.

    Node 0 is the root: the last chosen token not yet fed to the model. ``valid`` marks padding
    nodes a drafter could not fill (never accepted). ``child_ids``/``child_probs`` ``[B, N, K]``
    carry, for stochastic drafts, the distribution each node's children were drawn from.
    ``row_sizes`` (host ints, one per row; the largest ``N``): row r's tree is its first
    ``row_sizes[r]`` nodes, the rest invalid, and a tree pass may score the rows packed without
    padding (:meth:`packed`) instead of ``B x N`` nodes. ``weak`` (a host-side NumPy bool array
    ``[B, N]``, or None): the nodes the drafter drafted from weak evidence, which ``tree="auto"``
    prices by their own acceptance rates (:mod:`stree.decoding.acceptance`); verification ignores it.
    """

    parents: torch.Tensor
    tokens: torch.Tensor
    valid: torch.Tensor | None = None
    child_ids: torch.Tensor | None = None
    child_probs: torch.Tensor | None = None
    with_replacement: bool = False
    row_sizes: tuple[int, ...] | None = None
    weak: np.ndarray | None = None
    _index: TreeIndex | None = field(default=None, init=False, repr=False, compare=False)
    _shape: TreeShape | None = field(default=None, init=False, repr=False, compare=False)  # from_shape's
    # (tokens, valid, their arrays): arrays()'s, while the fields are those tensors
    _arrays: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self._index is None:
            self.parents = check_parents(self.parents)
        if not isinstance(self.tokens, torch.Tensor) or self.tokens.dtype.is_floating_point or self.tokens.dtype == torch.bool:
            raise TypeError(f"tokens must be an integer tensor [B, N], got {getattr(self.tokens, 'dtype', type(self.tokens))}")
        if self.tokens.dim() != 2 or self.tokens.shape[1] != self.n:
            raise ValueError(f"tokens must have shape [B, {self.n}], got {tuple(self.tokens.shape)}")
        if self.parents.dim() == 2 and self.parents.shape[0] != self.batch_size:
            raise ValueError(f"parents has {self.parents.shape[0]} rows but tokens has batch {self.batch_size}")
        if self.parents.device != self.tokens.device:
            raise ValueError(f"parents is on {self.parents.device} but tokens is on {self.tokens.device}")
        if self.valid is not None:
            if self.valid.dtype != torch.bool or tuple(self.valid.shape) != tuple(self.tokens.shape):
                raise ValueError(f"valid must be a bool tensor of shape {tuple(self.tokens.shape)}")
            root = self.valid.numpy()[:, 0] if self.valid.device.type == "cpu" else self.valid.select(1, 0).tolist()
            if not all(root):  # (numpy, or a list: cheaper than a reduction op on a small draft)
                raise ValueError("valid[:, 0] must be True: the root is always a real token")
        if (self.child_ids is None) != (self.child_probs is None):
            raise ValueError("child_ids and child_probs must be given together")
        if self.row_sizes is not None:
            self._check_row_sizes()
        if self.weak is not None:
            _check_weak(self.weak, tuple(self.tokens.shape))
        if self.child_ids is not None and (
            self.child_ids.shape != self.child_probs.shape or tuple(self.child_ids.shape[:2]) != tuple(self.tokens.shape)
        ):
            raise ValueError(f"child_ids and child_probs must have shape [B, N, K] with [B, N] = {tuple(self.tokens.shape)}")

    def _check_row_sizes(self) -> None:
        sizes = self.row_sizes
        if not isinstance(sizes, tuple) or len(sizes) != self.batch_size or not all(
                isinstance(s, int) and not isinstance(s, bool) for s in sizes):
            raise TypeError(f"row_sizes must be a tuple of {self.batch_size} ints, got {sizes!r}")
        if min(sizes) < 1 or max(sizes) != self.n:
            raise ValueError(f"row_sizes must lie in [1, {self.n}] with {self.n} the largest, got {sizes}")
        if self.valid is None:
            raise ValueError(f"valid must mark every node past its row's size invalid (row_sizes {sizes})")
        past = torch.arange(self.n, device=self.valid.device) >= torch.tensor(sizes, device=self.valid.device)[:, None]
        if bool(self.valid[past].any()):
            raise ValueError(f"valid must mark every node past its row's size invalid (row_sizes {sizes})")

    def packed(self) -> tuple[torch.Tensor, "PackedTrees"]:
        """The rows' trees of ``row_sizes`` packed without padding: ``tokens`` ``[1, total]`` and
        their :class:`PackedTrees` (built once per static shape and sizes)."""
        if self.row_sizes is None:
            raise ValueError("this tree has no row_sizes to pack")
        device = self.tokens.device
        if self._shape is not None:
            trees = _packed_prefixes(self._shape, self.row_sizes, device)
        else:
            rows = self.parents.expand(self.batch_size, self.n)
            trees = pack_trees([rows[r, :s] for r, s in enumerate(self.row_sizes)], device)
        return trees.pack(self.tokens), trees

    def arrays(self) -> tuple[np.ndarray, np.ndarray | None]:
        """A CPU tree's ``tokens`` and ``valid`` (None where it is) as NumPy arrays, their memory (not
        to be written to): made once per tree, or handed over by its maker (:meth:`from_arrays`).
        The host's verification, the choice of its size and what it learns each read them, and
        each ``.numpy()`` is four dispatcher calls, microseconds each right after a model pass."""
        hit = self._arrays
        if hit is None or hit[0] is not self.tokens or hit[1] is not self.valid:
            hit = self._arrays = (self.tokens, self.valid, self.tokens.numpy(),
                                  None if self.valid is None else self.valid.numpy())
        return hit[2], hit[3]

    @classmethod
    def from_arrays(cls, shape: "TreeShape", tokens: np.ndarray, valid: np.ndarray | None = None,
                    weak: np.ndarray | None = None) -> "TokenTree":
        """:meth:`from_shape` of a drafter's CPU arrays ``tokens`` ``[B, N]`` (integers), ``valid``
        and ``weak`` (bool, or None), which the tree then holds (not copied) and hands out as :meth:`arrays`;
        checked as :meth:`from_shape` checks its tensors, on the arrays (a drafter's tree made
        through the tensors' checks cost a tenth of a plain step of a small model on the CPU)."""
        if not isinstance(tokens, np.ndarray) or tokens.dtype.kind not in "iu":
            raise TypeError(f"tokens must be an integer array [B, N], got {getattr(tokens, 'dtype', type(tokens))}")
        if tokens.ndim != 2 or tokens.shape[1] != shape.n:
            raise ValueError(f"tokens must have shape [B, {shape.n}], got {tokens.shape}")
        if valid is not None:
            if not isinstance(valid, np.ndarray) or valid.dtype != np.bool_ or valid.shape != tokens.shape:
                raise ValueError(f"valid must be a bool array of shape {tokens.shape}")
            if not all(valid[:, 0].tolist()):
                raise ValueError("valid[:, 0] must be True: the root is always a real token")
        if weak is not None:
            _check_weak(weak, tokens.shape)
        tree = cls.__new__(cls)  # (fields set directly: checked above, the parents with the shape)
        index = tree._index = shape.index()
        tree.parents = index.memo("parents_long", lambda: index.parents[0].long())
        tree.tokens, tree.valid = torch.from_numpy(tokens), None if valid is None else torch.from_numpy(valid)
        tree.child_ids = tree.child_probs = tree.row_sizes = None
        tree.with_replacement, tree._shape, tree.weak = False, shape, weak
        tree._arrays = (tree.tokens, tree.valid, tokens, valid)
        return tree

    @property
    def n(self) -> int:
        return self.parents.shape[-1]

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def static_shape(self) -> TreeShape | None:
        """The :class:`TreeShape` every row shares when the tree was made by :meth:`from_shape`
        (compiled passes and CUDA graphs are made per static shape), else None."""
        return self._shape

    @property
    def index(self) -> TreeIndex:
        """Validated kernel index, computed once per tree."""
        if self._index is None:
            self._index = tree_index(self.parents)
        return self._index

    @property
    def depth(self) -> torch.Tensor:
        return self.index.depth.long().expand(self.batch_size, self.n)

    @property
    def ancestor_mask(self) -> torch.Tensor:
        return self.index.ancestor_mask().expand(self.batch_size, self.n, self.n)

    def position_ids(self, prefix_len) -> torch.Tensor:
        """RoPE positions ``prefix_len + depth``; ``prefix_len`` is an int or a ``[B]`` tensor."""
        prefix = torch.as_tensor(prefix_len, device=self.tokens.device).reshape(-1, 1)
        return prefix + self.depth

    def children(self, row: int = 0) -> list[list[int]]:
        p = self.parents if self.parents.dim() == 1 else self.parents[row]
        return TreeShape(tuple(p.tolist())).children()

    def leaf_paths(self, row: int = 0) -> list[list[int]]:
        p = self.parents if self.parents.dim() == 1 else self.parents[row]
        return leaf_paths(p.tolist())

    def to(self, device) -> "TokenTree":
        """The tree on ``device``, not validated again; a static shape's cached index is reused."""
        device = torch.device(device)
        if self.tokens.device == device:
            return self
        move = lambda t: None if t is None else t.to(device, non_blocking=True)
        tree = TokenTree.__new__(TokenTree)  # fields set directly: this tree was validated already
        tree.parents, tree.tokens, tree.valid = move(self.parents), move(self.tokens), move(self.valid)
        tree.child_ids, tree.child_probs, tree.with_replacement = move(self.child_ids), move(self.child_probs), self.with_replacement
        tree.row_sizes, tree.weak = self.row_sizes, self.weak
        tree._shape, tree._arrays = self._shape, None
        tree._index = self._shape.index(device) if self._shape is not None else self.index.to(device)
        return tree

    def prefix(self, m: int) -> "TokenTree":
        """The first ``m`` nodes of every row (parents come first: a tree), with their tokens and
        the laws they carry; not validated again, as this tree was (a decode loop cuts its draft
        to the size it chose every step, where validating the cut cost as much as drafting)."""
        _check_prefix(m, self.n)
        cut = lambda t: None if t is None else t[:, :m]  # noqa: E731
        tree = TokenTree.__new__(TokenTree)
        tree.child_ids, tree.child_probs = cut(self.child_ids), cut(self.child_probs)
        tree.with_replacement, tree.row_sizes, tree.weak = self.with_replacement, None, cut(self.weak)
        if self._arrays is not None and self._arrays[0] is self.tokens and self._arrays[1] is self.valid:
            # the cut of this tree's arrays, handed to torch: a slice is a dispatcher call, an array's is not
            tokens, valid = cut(self._arrays[2]), cut(self._arrays[3])
            tree.tokens, tree.valid = torch.from_numpy(tokens), None if valid is None else torch.from_numpy(valid)
            tree._arrays = (tree.tokens, tree.valid, tokens, valid)
        else:
            tree.tokens, tree.valid, tree._arrays = cut(self.tokens), cut(self.valid), None
        if self._shape is not None:
            tree._shape = self._shape.prefix(m)
            tree._index = index = tree._shape.index(self.tokens.device)
            tree.parents = index.memo("parents_long", lambda: index.parents[0].long())
        else:
            tree._shape, tree._index, tree.parents = None, None, self.parents[..., :m]
        return tree

    @classmethod
    def from_shape(cls, shape: TreeShape, tokens: torch.Tensor, **kwargs) -> "TokenTree":
        """A tree of a static shape: its parents and index come from the shape's cache (validated
        when the shape was made), so a decode loop pays for neither each step."""
        index = shape.index(tokens.device)
        tree = cls.from_index(index, index.memo("parents_long", lambda: index.parents[0].long()), tokens, **kwargs)
        tree._shape = shape
        return tree

    @classmethod
    def from_index(cls, index: TreeIndex, parents: torch.Tensor, tokens: torch.Tensor, **kwargs) -> "TokenTree":
        """A tree whose builder computed its index (and guarantees it describes ``parents``, a
        valid parent array): neither is validated or derived again."""
        tree = cls.__new__(cls)
        tree._index, tree._shape = index, None
        cls.__init__(tree, parents, tokens, **kwargs)
        return tree
