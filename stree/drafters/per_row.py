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
        self._random = probe.random_drafts
        self._rows: dict[int, Drafter] = {}
        self._seed = 0

    @property
    def random_drafts(self) -> bool:
        return self._random

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
        greedy = context.greedy
        trees = [self._of(r).propose(DraftContext(context.tokens, context.lengths, [r],
                                                  None if greedy is None else greedy[i: i + 1]), shape)
                 for i, r in enumerate(context.rows)]
        extra = {}
        if any(t.valid is not None for t in trees):
            extra["valid"] = torch.cat([torch.ones_like(t.tokens, dtype=torch.bool) if t.valid is None else t.valid
                                        for t in trees])
        # Laws only where every row has one: greedy rows beside drawing ones draft without, and
        # one-hot verification is exact for drafts of any law (each sibling judged given the others)
        if all(t.child_ids is not None for t in trees):
            extra.update(child_ids=torch.cat([t.child_ids for t in trees]),
                         child_probs=torch.cat([t.child_probs for t in trees]))
        return TokenTree.from_shape(shape, torch.cat([t.tokens for t in trees]),
                                    with_replacement=trees[0].with_replacement, **extra)

    def observe(self, context: DraftContext, tokens, target) -> None:
        for i, r in enumerate(context.rows):
            self._of(r).observe(DraftContext(context.tokens, context.lengths, [r]), [tokens[i]],
                                None if target is None else [target[i]])
