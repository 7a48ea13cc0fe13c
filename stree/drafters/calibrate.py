"""Data-optimised static trees (STAND, paper 000 appendix A): start from a large heuristic tree,
count how often each node lies on the accepted path while decoding calibration prompts
(:func:`stree.tools.optimize_tree.calibrate`, which decodes them: drafters import no decoding), and
keep the most accepted nodes as a compact tree."""

from __future__ import annotations

import math

import torch

from ..tree import TreeShape

__all__ = ["stand_initial_tree", "AcceptanceCounter", "optimize_tree"]


def stand_initial_tree(levels: int = 20) -> TreeShape:
    """STAND's Algorithm 1: 8 children at the root; max(8 - 2*order, 1) at depth 1; at deeper
    nodes ceil((siblings - 1) / (0.7*order + 1)), at least 2 at depths 2-3 (0 below); the first
    node of each level at least 3. 625 nodes (with the root) and depth 20 for the default 20
    levels. Nodes are numbered level by level, siblings in rank order."""
    parents, depth, order, n_siblings = [-1], [0], [0], [1]
    active = [0]
    for _ in range(levels):
        nxt = []
        for i, v in enumerate(active):
            if depth[v] == 0:
                k = 8
            elif depth[v] == 1:
                k = max(8 - 2 * order[v], 1)
            else:
                k = max(math.ceil((n_siblings[v] - 1) / (order[v] * 0.7 + 1)), 2 if depth[v] <= 3 else 0)
            if i == 0:
                k = max(k, 3)
            for o in range(k):
                parents.append(v)
                depth.append(depth[v] + 1)
                order.append(o)
                n_siblings.append(k)
                nxt.append(len(parents) - 1)
        active = nxt
    return TreeShape(tuple(parents))


class AcceptanceCounter:
    """An ``on_step`` hook for :func:`stree.decoding.loop.generate`: per node of ``shape``, how many
    times it was on a row's accepted path (the root counts every step)."""

    def __init__(self, shape: TreeShape):
        self.shape = shape
        self.counts = torch.zeros(shape.n, dtype=torch.long)

    def __call__(self, rows, tree, result) -> None:
        if tree.n != self.shape.n:  # a step where nothing was drafted ran the root alone
            self.counts[0] += len(rows)
            return
        acc = result.accepted.cpu()
        used = torch.arange(acc.shape[1]) < result.num_accepted.cpu()[:, None]
        self.counts += torch.bincount(acc[used], minlength=self.shape.n)


def optimize_tree(shape: TreeShape, counts, nodes: int = 80) -> TreeShape:
    """Keep the root and the ``nodes`` most accepted nodes, closed under ancestors (ties: shallower,
    then lower sibling rank, then lower index); siblings are renumbered in their original rank
    order so kept child r is the r-th draw. Returned level by level (BFS)."""
    counts = [int(c) for c in counts]
    if len(counts) != shape.n:
        raise ValueError(f"counts has {len(counts)} entries but the tree has {shape.n} nodes")
    if nodes < 0:
        raise ValueError(f"nodes must be >= 0, got {nodes}")
    kids = shape.children()
    rank = [0] * shape.n
    for siblings in kids:
        for r, c in enumerate(siblings):
            rank[c] = r
    ranked = sorted(range(1, shape.n), key=lambda v: (-counts[v], shape.depth[v], rank[v], v))
    kept = {0}
    while len(kept) - 1 < nodes:
        # the best-ranked node whose parent is already kept (a node ranked above its parent waits)
        nxt = next((v for v in ranked if v not in kept and shape.parents[v] in kept), None)
        if nxt is None:
            break
        kept.add(nxt)
    parents, new_id, queue = [-1], {0: 0}, [0]
    for v in queue:
        for c in kids[v]:  # original rank order
            if c in kept:
                new_id[c] = len(parents)
                parents.append(new_id[v])
                queue.append(c)
    return TreeShape(tuple(parents))

