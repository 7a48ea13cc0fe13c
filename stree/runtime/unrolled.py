"""The baseline STree replaces (paper 001, Table 2), end to end: every root-to-leaf path of a draft
tree runs through the whole model as its own sequence, from its own copy of its row's state, so
the cost is the paths' total length (32 / 90 / 192 tokens for the 15 / 31 / 63-node binary trees)
and the memory one state per path. ``generate(method="unrolled")`` decodes with it; its outputs
are the packed tree's (the same logits at every node), only slower.

:class:`UnrolledTarget` wraps a model with the two calls a decoding step makes, ``forward_tree``
and ``commit``: the tree's node logits are read off the paths, and commit keeps, per row, the
state of a path that holds the accepted one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.cache import ModelCache
from ..tree import TokenTree, TreeShape, leaf_paths


@dataclass
class UnrolledPass:
    """What commit needs: the paths' own states (a copy per path), their tree pass, and which row
    and which tree nodes each path is."""

    states: ModelCache
    tree_pass: object
    paths: list[list[int]]
    owner: list[int]


class UnrolledTarget:
    """``model`` scoring trees path by path (see the module docstring)."""

    def __init__(self, model):
        self.model = model

    def forward_tree(self, tree: TokenTree, cache: ModelCache, scan: str = "tree", validate: bool = True):
        parents = tree.index.parents.cpu().tolist()  # the paths are built on the host: a baseline
        paths, owner = [], []
        for b in range(tree.batch_size):
            for path in leaf_paths(parents[b if len(parents) > 1 else 0]):
                paths.append(path)
                owner.append(b)
        length = max(map(len, paths))
        device = tree.tokens.device
        nodes = torch.tensor([p + [p[-1]] * (length - len(p)) for p in paths], device=device)
        rows = torch.tensor(owner, device=device)
        real = torch.tensor([[t < len(p) for t in range(length)] for p in paths], device=device)
        states = cache.select(rows)  # one state per path
        chains = TokenTree.from_shape(TreeShape.chain(length - 1), tree.tokens[rows[:, None], nodes])
        path_logits, tree_pass = self.model.forward_tree(chains, states, validate=validate)
        logits = path_logits.new_empty(tree.batch_size, tree.n, path_logits.shape[-1])
        # a node on several paths gets the same logits from each (same prefix, same state)
        logits[rows[:, None].expand_as(nodes)[real], nodes[real]] = path_logits[real]
        return logits, UnrolledPass(states, tree_pass, paths, owner)

    def commit(self, cache: ModelCache, handle: UnrolledPass, accepted: torch.Tensor, num_accepted: torch.Tensor,
               validate: bool = True) -> None:
        """Per row, replay the accepted prefix on a path that holds the accepted path, and make
        that path's state the row's."""
        last = accepted.gather(1, (num_accepted - 1)[:, None].long())[:, 0].tolist()
        num = num_accepted.tolist()
        chosen, counts = [], []
        for p, (path, b) in enumerate(zip(handle.paths, handle.owner)):
            mine = len(chosen) == b and len(path) >= num[b] and path[num[b] - 1] == last[b]
            if mine:
                chosen.append(p)
            counts.append(num[b] if mine else 1)
        device = accepted.device
        width = handle.tree_pass.max_depth + 1
        steps = torch.arange(width, device=device).expand(len(handle.paths), -1)
        self.model.commit(handle.states, handle.tree_pass, steps, torch.tensor(counts, device=device),
                          validate=validate)
        cache.assign(torch.arange(cache.batch_size, device=device), handle.states.select(
            torch.tensor(chosen, device=device)))
