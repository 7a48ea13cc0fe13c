"""Which drafted nodes the target accepts, learned from verified steps only (:class:`PathRates`),
for ``tree="auto"`` (:mod:`stree.decoding.autotree`): the hazard h(d, j) that a drafted child of
sibling rank j at depth d is accepted, given that its parent was and that its earlier siblings were
not (invalid nodes, which a drafter could not fill, are not counted: the draft itself says which
nodes exist). Counts fade by ``decay`` per step, start from a prior, and a depth that has seen
little leans on its rank's rate over all depths. A node is accepted with chance prod over its path
of h(d, j) prod_{i<j} (1 - h(d, i)) (Sequoia's positional acceptance, per depth: :func:`chances`);
a tree's expected tokens per iteration is 1 (the bonus) plus its nodes' chances. Each row of a
batch also keeps its own counts (:class:`RowRates`), leaning on the batch's.

A drafter may say which nodes it drafted from weak evidence (``TokenTree.weak``: the n-gram
drafter's one-token matches, a third as often right as its four-token ones): those are counted
apart, a class of their own, and a drafted tree's weak nodes are priced by their class's hazards
(the strong ones by theirs). The hazards are ``[DEPTH + 1, (CLASSES + 1) * RANKS]``: each class's
``RANKS`` columns, then those of all classes pooled, which weigh a shape before anything is drafted
(:meth:`PathRates.positional`, :func:`pooled`). A drafter that never marks a node leaves the weak
class empty, and its hazards are those of one class.

Also here, as arrays for the compiled helpers: a tree's parents, sibling ranks and depths
(:func:`structure`), and what greedy verification would have accepted of a draft from the tokens
emitted after it (:func:`walk`: a draft watched rather than verified).
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit

from ..tree import TokenTree, TreeShape, filled_mask

__all__ = ["PathRates", "RowRates", "chances", "pooled", "rank_depth", "shape_structure", "structure", "valid_mask",
           "walk", "weak_class", "weak_mask"]

RANKS = 8  # sibling ranks told apart (later ranks share the last): PathRates.RANKS
CLASSES = 2  # a node is strong (0) or weak (1): TokenTree.weak
# A weak node's prior against a strong one's of the same rank: the n-gram drafter's top draft was the
# next token at a third of the positions whose longest match was one token, at 95% where it was four
# (docs/benchmarks.md; its weak nodes are those of matches shorter than four tokens or contested, docs/drafters.md);
# the counts take over within a few verified steps.
WEAK_PRIOR = 0.5


class PathRates:
    """Hazards h(d, j) by depth d (1..``DEPTH``, deeper levels share the last) and sibling rank j
    (0..``RANKS - 1``, later ranks share the last), learned from verified steps (see the module
    docstring). ``prior[j]`` is worth ``weight`` observations of rank j over all depths, and the
    rank's rate ``weight`` observations at each depth."""

    DEPTH, RANKS = 16, RANKS
    PRIOR = (0.6, 0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.07)

    def __init__(self, decay: float = 0.97, weight: float = 2.0, prior=PRIOR):
        if not 0 < decay <= 1 or weight <= 0 or len(prior) != self.RANKS or not all(0 < p < 1 for p in prior):
            raise ValueError(f"need 0 < decay <= 1, weight > 0 and {self.RANKS} prior rates in (0, 1), got "
                             f"{decay!r}, {weight!r}, {prior!r}")
        self.decay, self.weight, self.prior = decay, weight, np.asarray(prior, dtype=np.float64)
        self._priors = np.concatenate([self.prior, self.prior * WEAK_PRIOR])  # each class's columns'
        # counts by depth and class-and-rank column (a strong node's rank j at j, a weak one's at RANKS + j)
        self.accepted = np.zeros((self.DEPTH + 1, CLASSES * self.RANKS))
        self.reached = np.zeros((self.DEPTH + 1, CLASSES * self.RANKS))
        self.version = 0  # bumped by every record
        self._hazard: tuple[int, np.ndarray] | None = None  # (version, hazard()): a step weighs them several times
        self._positional: tuple[int, np.ndarray] | None = None  # (version, positional()): a plan per depth cap reads it

    def hazard(self) -> np.ndarray:
        """``[DEPTH + 1, (CLASSES + 1) * RANKS]`` (row 0 unused; see the module docstring); one array
        per version, not to be written to."""
        if self._hazard is None or self._hazard[0] != self.version:
            self._hazard = (self.version, _hazards(self.accepted, self.reached, self._priors, self.weight))
        return self._hazard[1]

    def positional(self) -> np.ndarray:
        """The chance that rank j's child is the accepted one, given its parent was: h(d, j)
        prod_{i<j} (1 - h(d, i)), made non-increasing in j (best-first growth needs it), from the
        pooled hazards (a plan is drafted before its nodes' classes are known). One read-only
        array per version."""
        if self._positional is None or self._positional[0] != self.version:
            out = _positional(pooled(self.hazard()))
            out.setflags(write=False)
            self._positional = (self.version, out)
        return self._positional[1]

    def record(self, tree: TokenTree, tokens: np.ndarray, counts: np.ndarray, rows: np.ndarray,
               per_row: "RowRates | None" = None, ids: np.ndarray | None = None) -> None:
        """Learn from one verified step: ``tree`` (CPU, the batch's), and for each batch row in
        ``rows`` the emitted ``tokens[b, :counts[b]]`` (the accepted drafts, then the bonus);
        ``per_row`` also learns each row's own, under its id ``ids[b]``."""
        self.version += 1
        if per_row is None:
            ids, row_accepted, row_reached, row_decay = _NO_IDS, _NO_ROWS, _NO_ROWS, 1.0
        else:
            ids = np.asarray(ids, dtype=np.int64)
            per_row.make_room(max(ids.tolist(), default=-1) + 1)  # (a list: see _record)
            row_accepted, row_reached, row_decay = per_row.accepted, per_row.reached, per_row.decay
        parents, rank, depth = structure(tree)
        valid = valid_mask(tree)
        weak = weak_mask(tree)
        # (C order always: a strided tree and a contiguous one would each cost numba a compile; the
        # fading too, in the same call: four small NumPy calls cost more than the walk)
        # (the hazards too, which the next choice reads: one call cold after a model pass, not two)
        # (and the rows' own, which the next choice reads too: a cold call fewer; computed while the rows are the
        # batch's, as the choice after drafting asks for them)
        hazard, row_hazard = _record(parents, rank, depth, np.ascontiguousarray(tree.arrays()[0]),
                                     np.ascontiguousarray(valid), np.ascontiguousarray(weak), tokens, counts, rows,
                                     self.accepted, self.reached, self.decay, ids, row_accepted, row_reached, row_decay,
                                     self._priors, self.weight, 0.0 if per_row is None else per_row.weight)
        self._hazard = (self.version, hazard)
        if per_row is not None:
            per_row.keep(ids, hazard, row_hazard)


class RowRates:
    """The counts of :class:`PathRates` per batch row of one decoding call, under the row's id:
    rows of one batch accept very differently (at batch 8, rows' own tau from 2.1 to 5.5), and a
    row's hazard leans on the batch's by ``weight`` observations."""

    def __init__(self, decay: float, weight: float = 4.0):
        self.decay, self.weight = decay, weight
        self.accepted = np.zeros((0, PathRates.DEPTH + 1, CLASSES * RANKS))
        self.reached = np.zeros_like(self.accepted)
        self.version = 0  # bumped by every fade (each record of PathRates that learns rows' own fades first)
        self._hazard: tuple | None = None  # ((version, ids, batch), hazard(ids, batch))

    def fade(self, rows: int) -> None:
        """One step's decay; room for ids below ``rows``."""
        self.make_room(rows)
        self.accepted *= self.decay
        self.reached *= self.decay

    def make_room(self, rows: int) -> None:
        """Room for ids below ``rows``, before a step's counts (which :meth:`PathRates.record` fades
        and adds to at once)."""
        self.version += 1
        if rows > len(self.accepted):
            grow = np.zeros((rows - len(self.accepted), *self.accepted.shape[1:]))
            self.accepted, self.reached = np.concatenate([self.accepted, grow]), np.concatenate([self.reached, grow])

    def hazard(self, ids: np.ndarray, batch: np.ndarray) -> np.ndarray:
        """``[len(ids), DEPTH + 1, (CLASSES + 1) * RANKS]``: each row's hazards, ``batch`` (the batch's) where it
        has seen little. The last answer is kept (not to be written to): a step asks for the same
        rows' several times."""
        ids = np.asarray(ids)
        key = (self.version, ids.tobytes(), batch)
        hit = self._hazard
        if hit is not None and hit[0][0] == key[0] and hit[0][1] == key[1] and hit[0][2] is batch:
            return hit[1]
        out = _row_hazards(self.accepted, self.reached, ids.astype(np.int64, copy=False), batch, self.weight)
        self._hazard = (key, out)
        return out

    def keep(self, ids: np.ndarray, batch: np.ndarray, hazard: np.ndarray) -> None:
        """Take ``hazard`` as :meth:`hazard`'s answer for ``ids`` and ``batch`` at this version (made by
        :meth:`PathRates.record` with the counts it learned)."""
        self._hazard = ((self.version, np.asarray(ids).tobytes(), batch), hazard)


_NO_ROWS = np.zeros((0, PathRates.DEPTH + 1, CLASSES * RANKS))
_NO_IDS = np.zeros(0, dtype=np.int64)


# (numba: the hazards are re-made after every verified step, and with NumPy's small-array calls
# each took a tenth of what the choice after drafting cost)
@njit(cache=True)
def _hazards(accepted, reached, prior, w):
    """:meth:`PathRates.hazard`: each depth's rate leaning on its column's over all depths; then the
    classes' counts pooled, leaning on the strong class's prior. (The pooled counts summed once into
    a table first: summed again at each read, with a division per entry besides, this took a fifth of
    what learning from a verified tree cost.)"""
    D, K = accepted.shape
    J = K + RANKS
    a_all, r_all = _with_pooled(accepted), _with_pooled(reached)
    out = np.empty((D, J))
    for j in range(J):
        a, r = 0.0, 0.0
        for d in range(D):
            a += a_all[d, j]
            r += r_all[d, j]
        by_rank = (a + w * prior[j % K]) / (r + w)
        for d in range(D):
            out[d, j] = (a_all[d, j] + w * by_rank) / (r_all[d, j] + w)
    return out


@njit(cache=True)
def _with_pooled(counts):
    """``counts`` ``[D, K]`` and, after its columns, each rank's summed over the classes ``[D, RANKS]``."""
    D, K = counts.shape
    out = np.zeros((D, K + RANKS))
    for d in range(D):
        for j in range(K):
            out[d, j] = counts[d, j]
            out[d, K + j % RANKS] += counts[d, j]
    return out


def pooled(h: np.ndarray) -> np.ndarray:
    """The pooled columns of hazards ``h`` (``[..., RANKS]``, a contiguous copy's view)."""
    return np.ascontiguousarray(h[..., -RANKS:])


def weak_class(h: np.ndarray) -> np.ndarray:
    """The weak class's columns of hazards ``h`` (``[..., RANKS]``, a contiguous copy)."""
    return np.ascontiguousarray(h[..., RANKS: 2 * RANKS])


@njit(cache=True)
def _positional(h):
    """:meth:`PathRates.positional` (numba: re-made after every verified tree, and as NumPy's
    small-array calls a fifth of a re-plan)."""
    D, K = h.shape
    out = np.empty((D, K))
    for d in range(D):
        alive, last = 1.0, np.inf
        for j in range(K):
            last = min(h[d, j] * alive, last)
            out[d, j] = last
            alive *= 1.0 - h[d, j]
    return out


@njit(cache=True)
def _row_hazards(accepted, reached, ids, batch, w):
    """:meth:`RowRates.hazard`: row ``ids[i]``'s counts leaning on the batch's hazards (the batch's
    alone for an id it has no counts for), each class's and pooled. (Indexed in place: a view of the
    row's counts per entry cost two thirds of what learning from a verified tree did.)"""
    D, J = batch.shape
    K = J - RANKS
    out = np.empty((len(ids), D, J))
    for i in range(len(ids)):
        row = ids[i]
        if row >= accepted.shape[0]:
            out[i] = batch
            continue
        for d in range(D):
            for k in range(RANKS):
                a, r = 0.0, 0.0
                for j in range(k, K, RANKS):
                    x, y = accepted[row, d, j], reached[row, d, j]
                    out[i, d, j] = (x + w * batch[d, j]) / (y + w)
                    a += x
                    r += y
                out[i, d, K + k] = (a + w * batch[d, K + k]) / (r + w)
    return out


def valid_mask(tree: TokenTree) -> np.ndarray:
    valid = tree.arrays()[1]
    return np.ones(tuple(tree.tokens.shape), dtype=np.bool_) if valid is None else valid


def weak_mask(tree: TokenTree) -> np.ndarray:
    """Which nodes the drafter drafted from weak evidence (none where it did not say)."""
    return filled_mask(*tree.tokens.shape, False) if tree.weak is None else tree.weak


@functools.lru_cache(maxsize=256)
def shape_structure(shape: TreeShape) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    parents = np.asarray(shape.parents, dtype=np.int64)[None]
    return (parents, *rank_depth(parents))


def structure(tree: TokenTree) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Parents, sibling rank and depth of every node, ``[B or 1, n]`` each (a static shape's
    once per shape)."""
    if tree.static_shape is not None:
        return shape_structure(tree.static_shape)
    parents = np.ascontiguousarray(tree.parents.cpu().numpy().reshape(-1, tree.n), dtype=np.int64)
    return (parents, *rank_depth(parents))


@njit(cache=True)
def rank_depth(parents):
    R, n = parents.shape
    rank = np.zeros((R, n), dtype=np.int64)
    depth = np.zeros((R, n), dtype=np.int64)
    kids = np.zeros(n, dtype=np.int64)
    for r in range(R):
        kids[:] = 0
        for c in range(1, n):
            p = parents[r, c]
            rank[r, c] = kids[p]
            kids[p] += 1
            depth[r, c] = depth[r, p] + 1
    return rank, depth


@njit(cache=True)
def _record(parents, rank, depth, tokens, valid, weak, emitted, counts, rows, accepted, reached, decay, ids,
            row_accepted, row_reached, row_decay, prior, w, row_w):
    """Fade the counts (the batch's by ``decay``, the rows' own by ``row_decay``), then walk each
    row's accepted path down its tree by the emitted tokens: at every accepted node, its valid
    children up to the accepted one were reached (all of them below the last), each in its class's
    columns. Counted for the batch, and for row b under ``ids[b]`` too where ``row_accepted`` has rows. Returns the
    batch's hazards after it (:func:`_hazards` at ``prior`` and ``w``) and, where rows are counted, those of the
    rows ``ids`` (:func:`_row_hazards` at ``row_w``; else an empty array)."""
    D = accepted.shape[0] - 1
    n = tokens.shape[1]
    per_row = row_accepted.shape[0] > 0
    for counts_ in (accepted, reached):
        flat = counts_.reshape(-1)
        for i in range(flat.size):
            flat[i] *= decay
    for counts_ in (row_accepted, row_reached):
        flat = counts_.reshape(-1)
        for i in range(flat.size):
            flat[i] *= row_decay
    for b in rows:
        s = b if parents.shape[0] > 1 else 0
        u = 0
        for t in range(counts[b]):
            hit = -1
            for c in range(u + 1, n):
                if parents[s, c] != u or not valid[b, c]:
                    continue
                d, j = min(depth[s, c], D), min(rank[s, c], RANKS - 1) + RANKS * weak[b, c]
                reached[d, j] += 1.0
                if per_row:
                    row_reached[ids[b], d, j] += 1.0
                if t < counts[b] - 1 and tokens[b, c] == emitted[b, t]:
                    accepted[d, j] += 1.0
                    if per_row:
                        row_accepted[ids[b], d, j] += 1.0
                    hit = c
                    break
            if hit < 0:
                break
            u = hit
    hazard = _hazards(accepted, reached, prior, w)
    if not per_row:
        return hazard, np.empty((0, hazard.shape[0], hazard.shape[1]))
    return hazard, _row_hazards(row_accepted, row_reached, ids, hazard, row_w)


@njit(cache=True)
def walk(parents, tokens, valid, emitted, seen):
    """Each row's count had its tree been verified greedily (accepted drafts, plus the bonus), from
    the first ``seen[b]`` tokens the row ``emitted`` after the root: the path of valid nodes
    matching them, child by child."""
    B, n = tokens.shape
    counts = np.ones(B, dtype=np.int64)
    for b in range(B):
        s = b if parents.shape[0] > 1 else 0
        u = 0
        for t in range(seen[b]):
            hit = -1
            for c in range(u + 1, n):
                if parents[s, c] == u and valid[b, c] and tokens[b, c] == emitted[b, t]:
                    hit = c
                    break
            if hit < 0:
                break
            u = hit
            counts[b] += 1
    return counts


@njit(cache=True)
def chances(parents, rank, depth, valid, weak, h):
    """Each node's chance to be accepted (0 for invalid nodes and their subtrees), ``[B, n]``,
    never above an earlier sibling's (as :meth:`PathRates.positional`: a rank the verified steps
    have not reached yet keeps its prior, which must not outbid a rank they have judged).
    ``h``: the hazards ``[B or 1, DEPTH + 1, K]``, each row's or one for all, a node priced by
    its class's columns (``weak``: the classes' and pooled columns, ``K = (CLASSES + 1) * RANKS``;
    given pooled hazards alone, every node is strong, and later ranks share the last column)."""
    B, n = valid.shape
    D, K = h.shape[1] - 1, h.shape[2]
    v = np.zeros((B, n))
    alive = np.ones(n)
    last = np.zeros(n)  # the chance of each node's latest valid child
    for b in range(B):
        s = b if parents.shape[0] > 1 else 0
        v[b, 0] = 1.0
        alive[:] = 1.0
        last[:] = np.inf
        for c in range(1, n):
            p = parents[s, c]
            if not valid[b, c] or v[b, p] == 0.0:
                continue
            j = min(min(rank[s, c], RANKS - 1) + RANKS * weak[b, c], K - 1)
            x = h[b if h.shape[0] > 1 else 0, min(depth[s, c], D), j]
            v[b, c] = min(v[b, p] * alive[p] * x, last[p])
            last[p] = v[b, c]
            alive[p] *= 1.0 - x
    return v
