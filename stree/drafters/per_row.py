"""One drafter per row: rows never draft from one another's tokens. The baseline a shared store
(STAND across trajectories, branches of a search) is measured against."""

from __future__ import annotations

import torch

from ..tree import TokenTree, TreeShape
from .base import DraftContext, Drafter

__all__ = ["PerRowDrafter"]


class PerRowDrafter(Drafter):
    """``factory()`` makes a fresh drafter for each row on its first draft; :meth:`reset` (each
    decoding call) forgets them all. Every row's drafter must fill the same static shape."""

    def __init__(self, factory):
        probe = factory()
        if not isinstance(probe, Drafter):
            raise TypeError(f"factory must return a Drafter, got {type(probe).__name__}")
        self.factory, self.shape, self.draft_depth = factory, probe.shape, probe.draft_depth
        self.target_top_k, self.plain_target = probe.target_top_k, probe.plain_target
        self._rows: dict[int, Drafter] = {}
        self._seed = 0

    def reset(self) -> None:
        self._rows = {}

    def reseed(self, seed: int) -> None:
        self._seed = seed
        for r, drafter in self._rows.items():
            drafter.reseed(seed + r)

    def _of(self, row: int) -> Drafter:
        if row not in self._rows:
            drafter = self._rows[row] = self.factory()
            drafter.reset()
            drafter.reseed(self._seed + row)
        return self._rows[row]

    def propose(self, context: DraftContext, shape: TreeShape | None = None) -> TokenTree:
        shape = self.tree_shape(shape)
        trees = [self._of(r).propose(DraftContext(context.tokens, context.lengths, [r]), shape) for r in context.rows]
        cat = lambda name: None if getattr(trees[0], name) is None else torch.cat([getattr(t, name) for t in trees])
        extra = {name: cat(name) for name in ("valid", "child_ids", "child_probs") if cat(name) is not None}
        return TokenTree.from_shape(shape, cat("tokens"), with_replacement=trees[0].with_replacement, **extra)

    def observe(self, context: DraftContext, tokens, target) -> None:
        for i, r in enumerate(context.rows):
            self._of(r).observe(DraftContext(context.tokens, context.lengths, [r]), [tokens[i]],
                                None if target is None else [target[i]])
