"""Prompt-lookup drafting: continuations of the context's own n-grams, longest match first."""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from ..tree import TokenTree, TreeShape
from .base import DraftContext, Drafter


class _RowIndex:
    """For one row: every n-gram (n = 1..max_n) of its context mapped to the tokens that followed
    it, with their counts and last positions; extended only by the tokens added since last time.
    Each n-gram's continuations, ranked, are kept until a new token changes them: a step adds a
    few tokens, so a draft re-ranks a few n-grams, not every one it visits.

    At most ``capacity`` n-grams are kept: past it, the ``evict_fraction`` updated least recently
    go (the dict keeps update order: an updated n-gram moves to the end)."""

    def __init__(self, max_n: int, capacity: int, evict_fraction: float):
        self.max_n, self.capacity = max_n, capacity
        self.evict = max(1, math.ceil(evict_fraction * capacity))
        self.tokens: list[int] = []
        self.next: dict[tuple[int, ...], dict[int, list[int]]] = {}
        self.ranked: dict[tuple[int, ...], list[int]] = {}

    def extend(self, new: list[int]) -> None:
        toks = self.tokens
        for tok in new:
            j = len(toks)
            for n in range(1, min(self.max_n, j) + 1):
                key = tuple(toks[j - n: j])
                self.ranked.pop(key, None)
                seen = self.next.pop(key, None)
                if seen is None:
                    seen = {}
                self.next[key] = seen  # now the most recently updated
                entry = seen.get(tok)
                if entry is None:
                    seen[tok] = [1, j]
                else:
                    entry[0] += 1
                    entry[1] = j
            toks.append(tok)
            if len(self.next) > self.capacity:
                for key in list(itertools.islice(self.next, self.evict)):
                    del self.next[key]
                    self.ranked.pop(key, None)

    def _ranked(self, key: tuple[int, ...]) -> list[int] | None:
        ranked = self.ranked.get(key)
        if ranked is None:
            seen = self.next.get(key)
            if not seen:
                return None
            ranked = self.ranked[key] = [tok for tok, _ in sorted(seen.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))]
        return ranked

    def candidates(self, suffix: tuple[int, ...], k: int, min_n: int) -> list[int]:
        """Up to ``k`` distinct continuations: those of the longest matching suffix first (most
        frequent, then most recent), then shorter suffixes' to fill the remaining slots."""
        if min_n <= len(suffix) <= self.max_n:  # the common case: the longest suffix alone fills the slots
            ranked = self._ranked(suffix)
            if ranked is not None and len(ranked) >= k:
                return ranked[:k]
        out: list[int] = []
        for n in range(min(len(suffix), self.max_n), min_n - 1, -1):
            ranked = self._ranked(suffix[len(suffix) - n:])
            if ranked is None:
                continue
            for tok in ranked:
                if tok not in out:
                    out.append(tok)
                    if len(out) == k:
                        return out
        return out


class NGramDrafter(Drafter):
    """Deterministic drafts from the row's own context (prompt + generated): each node's children
    are the distinct continuations of the longest suffix (n = ``max_n``..``min_n``) of the path
    context that occurred before, most frequent first; slots with no candidate are invalid.

    Memory is bounded per row: at most ``capacity`` n-grams (about 250 bytes each; the default
    65536 covers 16k tokens of context at ``max_n`` 4), the ``evict_fraction`` least recently
    updated dropped when it is reached."""

    def __init__(self, max_n: int = 4, min_n: int = 1, capacity: int = 1 << 16, evict_fraction: float = 0.1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if not isinstance(capacity, int) or capacity < 1 or not 0 < evict_fraction <= 1:
            raise ValueError(f"need an int capacity >= 1 and 0 < evict_fraction <= 1, got {capacity!r}, {evict_fraction!r}")
        self.max_n, self.min_n = max_n, min_n
        self.capacity, self.evict_fraction = capacity, evict_fraction
        self._rows: dict[int, _RowIndex] = {}
        self._planned = None

    def reset(self) -> None:
        self._rows = {}

    def _index(self, context: DraftContext, i: int) -> _RowIndex:
        index = self._rows.get(context.rows[i])
        if index is None:
            index = self._rows[context.rows[i]] = _RowIndex(self.max_n, self.capacity, self.evict_fraction)
        length = int(context.lengths[context.rows[i]])
        if length < len(index.tokens):
            raise ValueError(f"row {context.rows[i]}'s context shrank from {len(index.tokens)} to {length} tokens; "
                             "call reset() before drafting for new rows")
        index.extend(context.row(i, start=len(index.tokens)))
        return index

    def _plan(self, shape: TreeShape):
        """The shape's nodes with children, parents first, each with its children and which of
        those have children of their own (cached: the same shape comes every step)."""
        if self._planned is None or self._planned[0] != shape:
            kids = shape.children()
            self._planned = (shape, [(v, kids[v], [bool(kids[c]) for c in kids[v]]) for v in range(shape.n) if kids[v]])
        return self._planned[1]

    def propose(self, context: DraftContext, shape: TreeShape) -> TokenTree:
        plan, n, max_n, min_n = self._plan(shape), shape.n, self.max_n, self.min_n
        tokens, valid = [], []
        for i in range(len(context)):
            index = self._index(context, i)
            toks, ok, suffix = [0] * n, [False] * n, [()] * n
            toks[0], ok[0], suffix[0] = index.tokens[-1], True, tuple(index.tokens[-max_n:])
            for v, kids, inner in plan:  # parents come first: BFS / topological order
                if not ok[v]:
                    continue
                for child, tok, has_kids in zip(kids, index.candidates(suffix[v], len(kids), min_n), inner):
                    toks[child], ok[child] = tok, True
                    if has_kids:
                        suffix[child] = (suffix[v] + (tok,))[-max_n:]
            tokens.append(toks)
            valid.append(ok)
        # via NumPy: torch.tensor of nested lists costs ~5x more
        return TokenTree.from_shape(shape, torch.from_numpy(np.array(tokens, dtype=np.int64)),
                                    valid=torch.from_numpy(np.array(valid, dtype=bool)))
