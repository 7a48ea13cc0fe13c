"""Consensus drafting across trajectories (paper 003): continuations that other trajectories of
the same problem wrote after the current suffix, merged into a DAG and read out greedily.

A :class:`PathStore` keeps every trajectory's tokens with the probability each had when it was
generated, and indexes every k-gram under its exact key, k wildcard keys (one position masked)
and the k - 1 keys of the (k+1)-gram before it with an inner token left out, so that a query
finds the windows within edit distance 1 of its k-token suffix (the paper's fuzzy matching: one
substitution, one token more, one token fewer; insertions and deletions keep the last token
aligned, since the continuation follows it) with 3k hash probes. :class:`ConsensusDrafter`
turns the matches into a DAG with one node per (layer, token), edge weights
``alpha * sum p + (1 - alpha) * freq``, and fills the requested tree shape: ``extraction="path"``
along the DAG's edges (a chain is a path-constrained greedy extraction, wider nodes keep their
top-b successors), ``"paper"`` by the paper's Algorithm 1, each layer's tokens ranked by their
total in-weight whatever the edge. Drafts are deterministic: verification is one-hot.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from ..tree import TokenTree, TreeShape
from .base import DraftContext, Drafter

__all__ = ["Candidate", "PathStore", "ConsensusDAG", "ConsensusDrafter", "EXTRACTIONS"]

EXTRACTIONS = ("path", "paper")

_MASK = -1  # the wildcard in an index key (token ids are >= 0)
_LONGER = -2  # first entry of the keys of (k+1)-grams with one token left out


@dataclass
class Candidate:
    """A continuation found for a query: ``tokens`` and the probabilities their trajectory gave them,
    ``weight`` 1 for an exact match, ``fuzzy_weight`` for a match within edit distance 1."""

    tokens: list[int]
    probs: list[float]
    weight: float
    path: int


class PathStore:
    """Trajectories of one problem, searchable by suffix; shared by the rows of a batch and by
    trajectories decoded one after another (pass the same store), emptied with :meth:`clear`.

    A path starts with the ``k`` context tokens before its first generated token (so that first
    token can be matched) and only generated tokens are ever returned as continuations: windows
    of n = 1..k tokens are indexed when a generated token follows them.

    Memory is bounded: past ``capacity`` stored tokens (about 4 KB each with the index), the
    oldest tokens go, oldest paths first, until ``evict_fraction`` of the capacity is free; every
    path keeps its last ``k`` tokens, so it can still be extended and matched."""

    def __init__(self, k: int = 3, fuzzy: bool = True, capacity: int = 1 << 18, evict_fraction: float = 0.25):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if not isinstance(capacity, int) or capacity < 1 or not 0 < evict_fraction <= 1:
            raise ValueError(f"need an int capacity >= 1 and 0 < evict_fraction <= 1, got {capacity!r}, {evict_fraction!r}")
        self.k, self.fuzzy, self.capacity, self.evict_fraction = k, fuzzy, capacity, evict_fraction
        self.clear()

    def clear(self) -> None:
        self.tokens: list[list[int]] = []  # each path's kept tokens; tokens[pid][0] is at position start[pid]
        self.probs: list[list[float]] = []
        self.start: list[int] = []
        self.first_generated: list[int] = []  # the position of each path's first generated token
        self.size = 0
        self._index: dict[tuple[int, ...], list[tuple[int, int]]] = defaultdict(list)

    def __len__(self) -> int:
        return len(self.tokens)

    def open(self, context: list[int]) -> int:
        """A new path after ``context`` (only its last ``k`` tokens are kept); returns its id."""
        self.tokens.append([int(t) for t in context[-self.k:]])
        self.probs.append([float("nan")] * len(self.tokens[-1]))
        self.start.append(0)
        self.first_generated.append(len(self.tokens[-1]))
        self.size += len(self.tokens[-1])
        return len(self.tokens) - 1

    def _index_position(self, pid: int, e: int) -> None:
        """Index the windows that end before position ``e`` of path ``pid`` (a generated token)."""
        toks, at = self.tokens[pid], e - self.start[pid]
        for n in range(1, min(self.k, at) + 1):
            key = tuple(toks[at - n: at])
            self._index[key].append((pid, e))
            if self.fuzzy and n == self.k and n >= 2:
                for j in range(n):
                    self._index[key[:j] + (_MASK,) + key[j + 1:]].append((pid, e))
        if self.fuzzy and self.k >= 2 and at >= self.k + 1:  # a query one token shorter than this window
            longer = tuple(toks[at - self.k - 1: at])
            # Left out: not the first token (that gives the exact key), nor the last (the
            # continuation follows the window's last token, which must be the query's).
            for j in range(1, self.k):
                self._index[(_LONGER,) + longer[:j] + longer[j + 1:]].append((pid, e))

    def extend(self, pid: int, tokens: list[int], probs: list[float]) -> None:
        """Append generated tokens with the probabilities they were drawn with."""
        if len(tokens) != len(probs):
            raise ValueError(f"extend needs one probability per token, got {len(tokens)} tokens and {len(probs)}")
        toks = self.tokens[pid]
        for tok, p in zip(tokens, probs):
            # windows are indexed once a token follows them, so every hit has a continuation
            self._index_position(pid, self.start[pid] + len(toks))
            toks.append(int(tok))
            self.probs[pid].append(float(p))
        self.size += len(tokens)
        if self.size > self.capacity:
            self._evict()

    def _evict(self) -> None:
        """Drop the oldest tokens (oldest paths first, each keeping its last ``k``) until the store
        is ``evict_fraction`` below capacity, then rebuild the index over what is left."""
        target = self.capacity - max(1, math.ceil(self.evict_fraction * self.capacity))
        for pid in range(len(self.tokens)):
            if self.size <= target:
                break
            drop = min(len(self.tokens[pid]) - self.k, self.size - target)
            if drop > 0:
                del self.tokens[pid][:drop], self.probs[pid][:drop]
                self.start[pid] += drop
                self.size -= drop
        self._index = defaultdict(list)
        for pid, toks in enumerate(self.tokens):
            first = max(self.first_generated[pid], self.start[pid] + 1)
            for e in range(first, self.start[pid] + len(toks)):
                self._index_position(pid, e)

    def candidates(self, suffix: list[int], length: int, *, exclude: int | None = None, min_k: int = 1,
                   fuzzy_weight: float = 0.5, limit: int = 64) -> list[Candidate]:
        """Continuations (up to ``length`` tokens) of the longest suffix of ``suffix`` (``k`` down to
        ``min_k`` tokens) that occurs in a path other than ``exclude``: at the full ``k``, exact
        occurrences and, if ``fuzzy``, the windows within edit distance 1 (one token substituted,
        one left out, one inserted); at most ``limit``, exact before fuzzy, most recent first."""
        for n in range(min(self.k, len(suffix)), min_k - 1, -1):
            key = tuple(int(t) for t in suffix[len(suffix) - n:])
            probes = [(key, 1.0)]
            if self.fuzzy and n == self.k and n >= 2:
                probes += [(key[:j] + (_MASK,) + key[j + 1:], fuzzy_weight) for j in range(n)]  # substituted
                probes += [(key[:j] + key[j + 1:], fuzzy_weight) for j in range(n - 1)]  # one fewer in the path
                probes.append(((_LONGER,) + key, fuzzy_weight))  # one more in the path
            found: list[Candidate] = []
            seen: set[tuple[int, int]] = set()
            for probe, weight in probes:
                for pid, e in reversed(self._index.get(probe, ())):
                    if pid == exclude or (pid, e) in seen:
                        continue
                    seen.add((pid, e))
                    at = e - self.start[pid]
                    found.append(Candidate(self.tokens[pid][at: at + length], self.probs[pid][at: at + length], weight,
                                           pid))
                    if len(found) == limit:
                        return found
            if found:
                return found
        return []


class ConsensusDAG:
    """Candidates merged by (layer, token): layer d holds the tokens seen d positions after the
    match; an edge u -> v weighs ``alpha * sum_i w_i p_i(v) + (1 - alpha) * sum_i w_i / n`` over
    the candidates i with that transition (``w_i`` the match weight, ``p_i(v)`` the probability
    their trajectory gave v, unknown counted as 0, ``n`` the number of candidates). Layer 0 is the
    virtual root (the current token)."""

    ROOT = (0, _MASK)

    def __init__(self, candidates: list[Candidate], alpha: float = 1.0):
        if not 0 <= alpha <= 1:
            raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
        self.edges: dict[tuple[int, int], dict[int, float]] = {}
        self.in_weight: dict[tuple[int, int], float] = {}
        n = max(len(candidates), 1)
        for c in candidates:
            u, by_p, by_count = self.ROOT, alpha * c.weight, (1 - alpha) * c.weight / n
            for d, (tok, p) in enumerate(zip(c.tokens, c.probs), start=1):
                w = by_p * p + by_count if p == p else by_count  # p is NaN when unknown
                out = self.edges.get(u)
                if out is None:
                    out = self.edges[u] = {}
                out[tok] = out.get(tok, 0.0) + w
                v = (d, tok)
                self.in_weight[v] = self.in_weight.get(v, 0.0) + w
                u = v

    def successors(self, node: tuple[int, int], limit: int) -> list[int]:
        """The ``limit`` best next tokens after ``node``: by edge weight, then the successor's total
        in-weight, then token id (deterministic)."""
        out = self.edges.get(node)
        if not out:
            return []
        d = node[0] + 1
        return sorted(out, key=lambda v: (-out[v], -self.in_weight[d, v], v))[:limit]

    def layer_best(self, layer: int, limit: int) -> list[int]:
        """The paper's extraction (Algorithm 1): the ``limit`` tokens of ``layer`` with the highest
        total in-weight, whatever edge leads to them (ties: the token id)."""
        at = [(w, v) for (d, v), w in self.in_weight.items() if d == layer]
        return [v for _, v in sorted(at, key=lambda x: (-x[0], x[1]))[:limit]]

    def greedy_path(self, length: int) -> list[int]:
        """Path-constrained greedy extraction: from the root, the best successor, up to ``length``."""
        path, node = [], self.ROOT
        while len(path) < length:
            nxt = self.successors(node, 1)
            if not nxt:
                break
            path.append(nxt[0])
            node = (node[0] + 1, nxt[0])
        return path


class ConsensusDrafter(Drafter):
    """Drafts for each row from the other trajectories in ``store`` (other rows of the batch and
    earlier trajectories; the row's own path too with ``include_self``): the last ``k`` tokens are
    the query, backing off to ``min_k``; the matches' continuations (up to the tree depth) form a
    :class:`ConsensusDAG`; node v's children are the best successors of v's DAG node, in rank
    order (``extraction="paper"``: the best tokens of the child's layer, see :meth:`ConsensusDAG.layer_best`).
    Slots with no successor are invalid. Deterministic drafts (one-hot verification)."""

    target_top_k = 0  # it weighs paths by the probability the target gave each emitted token

    def __init__(self, store: PathStore | None = None, *, min_k: int = 1, alpha: float = 1.0,
                 fuzzy_weight: float = 0.5, max_candidates: int = 64, include_self: bool = False,
                 shape: TreeShape | None = None, extraction: str = "path"):
        if extraction not in EXTRACTIONS:
            raise ValueError(f"extraction must be one of {EXTRACTIONS}, got {extraction!r}")
        self.extraction = extraction
        self.store = store if store is not None else PathStore()
        if not 1 <= min_k <= self.store.k:
            raise ValueError(f"need 1 <= min_k <= k = {self.store.k}, got min_k={min_k}")
        if max_candidates < 1:
            raise ValueError(f"max_candidates must be >= 1, got {max_candidates}")
        self.min_k, self.alpha, self.fuzzy_weight = min_k, alpha, fuzzy_weight
        self.max_candidates, self.include_self, self.shape = max_candidates, include_self, shape
        self._live: dict[int, tuple[int, int]] = {}  # row id -> (path id, context length it ends at)

    def reset(self) -> None:
        self._live = {}  # the rows' paths stay in the store as earlier trajectories

    def for_measuring(self) -> "ConsensusDrafter":
        """The same drafter over a fresh store of the same settings (its store keeps every path)."""
        s = self.store
        return ConsensusDrafter(PathStore(s.k, s.fuzzy, s.capacity, s.evict_fraction), min_k=self.min_k,
                                alpha=self.alpha, fuzzy_weight=self.fuzzy_weight, max_candidates=self.max_candidates,
                                include_self=self.include_self, shape=self.shape, extraction=self.extraction)

    def observe(self, context: DraftContext, tokens, target) -> None:
        for i, (emitted, top) in enumerate(zip(tokens, target)):
            r = context.rows[i]
            length = int(context.lengths[r])
            pid, end = self._live.get(r, (None, None))
            if end != length:  # a row this drafter has not followed: a new trajectory
                pid = self.store.open(context.row(i, start=max(0, length - self.store.k)))
            self.store.extend(pid, emitted, top.token_probs.tolist())
            self._live[r] = (pid, length + len(emitted))

    def dag(self, context: DraftContext, i: int, length: int) -> ConsensusDAG:
        r = context.rows[i]
        own = self._live.get(r, (None, None))[0]
        suffix = context.row(i, start=max(0, int(context.lengths[r]) - self.store.k))
        cands = self.store.candidates(suffix, length, exclude=None if self.include_self else own, min_k=self.min_k,
                                      fuzzy_weight=self.fuzzy_weight, limit=self.max_candidates)
        return ConsensusDAG(cands, self.alpha)

    def propose(self, context: DraftContext, shape: TreeShape | None = None) -> TokenTree:
        shape = self.tree_shape(shape)
        kids = shape.children()
        tokens = torch.zeros(len(context), shape.n, dtype=torch.long)
        valid = torch.zeros(len(context), shape.n, dtype=torch.bool)
        for i in range(len(context)):
            dag = self.dag(context, i, shape.max_depth)
            toks, ok = tokens[i].tolist(), valid[i].tolist()
            toks[0], ok[0] = int(context.tokens[context.rows[i], int(context.lengths[context.rows[i]]) - 1]), True
            node = {0: ConsensusDAG.ROOT}
            for v in range(shape.n):  # parents come first
                if not ok[v] or not kids[v]:
                    continue
                nxt = (dag.successors(node[v], len(kids[v])) if self.extraction == "path"
                       else dag.layer_best(node[v][0] + 1, len(kids[v])))
                for child, tok in zip(kids[v], nxt):
                    toks[child], ok[child] = tok, True
                    node[child] = (node[v][0] + 1, tok)
            tokens[i], valid[i] = torch.tensor(toks), torch.tensor(ok)
        return TokenTree.from_shape(shape, tokens, valid=valid)
