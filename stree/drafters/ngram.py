"""Prompt-lookup drafting: continuations of the context's own n-grams, longest match first."""

from __future__ import annotations

import bisect
import itertools
import math

import numpy as np

from ..tree import ShapePlan, TokenTree, TreeShape
from .base import DraftContext, Drafter


class RowIndex:
    """The reference index (pure Python; ``ngram_jit.CompiledRowIndex`` is the fast one, tested
    equal to it). For one row: every n-gram (n = 1..max_n) of its context mapped to the tokens
    that followed it, ranked (most frequent first, then most recent), extended only by the tokens added since
    last time. The ranking is kept up to date as tokens arrive: a token's count only grows, and
    its occurrence is the newest, so it moves in front of every token with no higher count -- one
    binary search, no sort when drafting reads it.

    At most ``capacity`` n-grams are kept: past it, the ``evict_fraction`` updated least recently
    go (the dict keeps update order: an updated n-gram moves to the end)."""

    def __init__(self, max_n: int, capacity: int, evict_fraction: float):
        self.max_n, self.capacity = max_n, capacity
        self.evict = max(1, math.ceil(evict_fraction * capacity))
        self.tokens: list[int] = []
        # n-gram -> (token -> minus its count, tokens ranked); minus, so that the ranked list is
        # ascending in it and bisect can place a token with the dict's own __getitem__
        self.next: dict[tuple[int, ...], tuple[dict[int, int], list[int]]] = {}

    @property
    def ntoks(self) -> int:
        return len(self.tokens)

    def extend(self, new: np.ndarray) -> None:
        toks = self.tokens
        for tok in new.tolist():
            j = len(toks)
            for n in range(1, min(self.max_n, j) + 1):
                key = tuple(toks[j - n: j])
                entry = self.next.pop(key, None)
                if entry is None:
                    entry = ({}, [])
                self.next[key] = entry  # now the most recently updated
                minus, ranked = entry
                count = minus.get(tok, 0) - 1
                if count < -1:
                    ranked.remove(tok)
                minus[tok] = count
                ranked.insert(bisect.bisect_left(ranked, count, key=minus.__getitem__), tok)
            toks.append(tok)
            if len(self.next) > self.capacity:
                for key in list(itertools.islice(self.next, self.evict)):
                    del self.next[key]

    def __len__(self) -> int:
        return len(self.next)

    def keys(self) -> list[tuple[int, ...]]:
        return list(self.next)

    def ranked(self, key: tuple[int, ...]) -> list[int]:
        entry = self.next.get(key)
        return [] if entry is None else list(entry[1])

    def candidates(self, suffix: tuple[int, ...], k: int, min_n: int) -> list[tuple[int, int, bool]]:
        """Up to ``k`` distinct continuations, each with the length of the match it came from and
        whether other tokens followed that match too: those of the longest matching suffix first
        (most frequent, then most recent), then shorter suffixes' to fill the remaining slots."""
        if len(suffix) < min_n:
            return []
        entry = self.next.get(suffix)
        if entry is not None and len(entry[1]) >= k:  # the common case: the longest suffix alone fills the slots
            return [(tok, len(suffix), len(entry[1]) > 1) for tok in entry[1][:k]]
        out: list[tuple[int, int, bool]] = []
        for n in range(len(suffix), min_n - 1, -1):
            entry = self.next.get(suffix[len(suffix) - n:])
            if entry is None:
                continue
            for tok in entry[1]:
                if all(tok != t for t, _, _ in out):
                    out.append((tok, n, len(entry[1]) > 1))
                    if len(out) == k:
                        return out
        return out

    def continues(self, min_n: int, weak_n: int = -1) -> bool:
        """Whether the context's last tokens have a continuation (a draft's root a child); where
        ``weak_n`` >= 0, one not weak (:meth:`propose`)."""
        found = self.candidates(tuple(self.tokens[-self.max_n:]), 1, min_n)
        return bool(found) and (weak_n < 0 or (found[0][1] > weak_n and not found[0][2]))

    def propose(self, min_n: int, weak_n: int, plan: ShapePlan, n_nodes: int, out: tuple | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One row's draft on the plan's shape: tokens, which nodes were filled and which of them are
        weak: from a match of at most ``weak_n`` tokens, or one other tokens followed too, or below a weak
        node (also written to ``out`` where given)."""
        toks, ok, weak, suffix = [0] * n_nodes, [False] * n_nodes, [False] * n_nodes, [()] * n_nodes
        toks[0], ok[0], suffix[0] = self.tokens[-1], True, tuple(self.tokens[-self.max_n:])
        for v in plan.nodes.tolist():  # parents come first
            if not ok[v]:
                continue
            kids = plan.kids[v]
            for child, (tok, n, several) in zip(kids, self.candidates(suffix[v], len(kids), min_n)):
                toks[child], ok[child], weak[child] = tok, True, n <= weak_n or several or weak[v]
                if plan.kids[child]:
                    suffix[child] = (suffix[v] + (tok,))[-self.max_n:]
        if out is not None:
            out[0][:], out[1][:], out[2][:] = toks, ok, weak
        return np.array(toks, dtype=np.int64), np.array(ok, dtype=bool), np.array(weak, dtype=bool)


class NGramDrafter(Drafter):
    """Deterministic drafts from the row's own context (prompt + generated): each node's children
    are the distinct continuations of the longest suffix (n = ``max_n``..``min_n``) of the path
    context that occurred before, most frequent first; slots with no candidate are invalid. Nodes
    drafted from a match shorter than ``max_n`` tokens, or from a match other tokens followed too, and the
    nodes below them, are marked weak (``TokenTree.weak``), and ``tree="auto"`` prices such nodes by
    their own rates: drafting chains for the shipped target on its held-out prompts, nodes from a
    four-token match only their token had followed were accepted at 97%, from one other tokens had
    followed too at 48%, from a shorter match at 25-75% (``benchmarks/ngram_matches.py``); trees the
    choice verified whose first child was weak lost five times in six, accepting 0.3-0.5 drafts on
    average there, their whole-match nodes included.

    Memory is bounded per row: at most ``capacity`` n-grams (about 250 bytes each; the default
    65536 covers 16k tokens of context at ``max_n`` 4), the ``evict_fraction`` least recently
    updated dropped when it is reached."""

    def __init__(self, max_n: int = 4, min_n: int = 1, capacity: int = 1 << 16, evict_fraction: float = 0.1,
                 compiled: bool = True):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if not isinstance(capacity, int) or capacity < 1 or not 0 < evict_fraction <= 1:
            raise ValueError(f"need an int capacity >= 1 and 0 < evict_fraction <= 1, got {capacity!r}, "
                             f"{evict_fraction!r}")
        self.max_n, self.min_n = max_n, min_n
        self.capacity, self.evict_fraction = capacity, evict_fraction
        self.compiled = compiled
        self._rows: dict = {}

    def reset(self) -> None:
        self._rows = {}

    def _index(self, row: int, tokens: np.ndarray, length: int):
        index = self._rows.get(row)
        if index is None:
            if self.compiled:
                from .ngram_jit import CompiledRowIndex  # numba compiles (or loads) on first use only

                index = CompiledRowIndex(self.max_n, self.capacity, self.evict_fraction)
            else:
                index = RowIndex(self.max_n, self.capacity, self.evict_fraction)
            self._rows[row] = index
        if length < index.ntoks:
            raise ValueError(f"row {row}'s context shrank from {index.ntoks} to {length} tokens; "
                             "call reset() before drafting for new rows")
        if length > index.ntoks:
            index.extend(tokens[row, index.ntoks: length])
        return index

    def can_draft(self, context: DraftContext) -> bool:
        """Whether any row's last tokens occurred before with a continuation (else its draft is its root)."""
        return self._continues(context, -1)

    def can_draft_strong(self, context: DraftContext) -> bool:
        """Whether any row's last ``max_n`` tokens occurred before followed by one token alone (a first
        child not weak; without one, a draft is weak throughout)."""
        return self._continues(context, self.max_n - 1)

    def _continues(self, context: DraftContext, weak_n: int) -> bool:
        tokens, lengths = context.arrays()
        return any(self._index(row, tokens, int(lengths[row])).continues(self.min_n, weak_n) for row in context.rows)

    def build(self, shapes, batch: int) -> None:
        """Load the compiled index's calls (:func:`~.ngram_jit.warm`): setup, not a decoding step's."""
        if self.compiled:
            from .ngram_jit import warm

            warm()

    def propose(self, context: DraftContext, shape: TreeShape) -> TokenTree:
        shape = self.tree_shape(shape)  # a clear error for a missing shape or a budget
        tokens, lengths = context.arrays()  # NumPy: a torch index costs more than a NumPy one
        out_tok = np.empty((len(context), shape.n), dtype=np.int64)
        out_ok = np.empty((len(context), shape.n), dtype=bool)
        out_weak = np.empty((len(context), shape.n), dtype=bool)
        for i, row in enumerate(context.rows):
            index = self._index(row, tokens, int(lengths[row]))
            index.propose(self.min_n, self.max_n - 1, shape.plan, shape.n, (out_tok[i], out_ok[i], out_weak[i]))
        return TokenTree.from_arrays(shape, out_tok, out_ok, out_weak)
