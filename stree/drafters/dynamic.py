"""Dynamic trees: each step, each row grows its own tree under a :class:`~stree.tree.TreeBudget`,
most valuable frontier first (EAGLE-2's idea, made lossless for drafts drawn without replacement).

A node v offers its children as *slots* in draw order: slot j holds the j-th draw without
replacement from v's law (for deterministic drafts: the j-th most likely token). Each slot has a
confidence ``r_j``: for deterministic drafts the token's own probability; for random drafts the
probability the j-th draw is expected to have given the draws before it (``sum q^2 / sum q``
over the tokens not drawn yet, never above an earlier slot's). A slot's *factor* is ``r_j``
(``calibrate=False``: EAGLE-2's rule) or, by default, its learned chance of acceptance given its
rank and confidence (:class:`SlotRates`, counted over the verified steps so far). A node's value
is the product of the factors along its path (raw random drafts: of the drawn tokens' own
probabilities), and a slot's priority is ``min(value(v) * factor_j, priority of v's own slot)``.
The tree keeps the ``nodes - 1`` slots of highest priority (ties: shallower first, then in
creation order) among those whose parent is kept. Uncalibrated deterministic trees are exactly
the ``nodes - 1`` most probable paths.

Why a slot's priority never looks at what the slot drew: whether slot j is kept must not depend
on its own draw, or the kept children are no longer draws from the law the verifier is told (a
child kept only when likely is a biased draw). ``r_j`` depends on the draws before j alone, and
the learned rates on earlier steps alone, so each node's child count is a stopping time of its
draws and recursive rejection sampling stays exact (``tests/drafters/test_dynamic.py`` shows the
chi-square test rejecting the other rule).

Priorities never increase from a parent to its children or from a slot to the next (the mins
above), so the kept set is the best-first expansion's: it is computed level by level (one
``expand`` per depth over every kept node of that depth, e.g. one drafter-model step), keeping
the best ``nodes - 1`` of everything offered so far after each level; a node dropped later drops
its whole subtree.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import torch
from numba import njit

from ..tree import TokenTree, TreeBudget, TreeIndex

__all__ = ["Level", "SlotRates", "grow"]


class Level(NamedTuple):
    """The kept nodes of one depth, in creation order: ``tokens`` and ``parent_pos`` (each node's
    parent's position in the previous level's arrays; None for the roots, one per row in batch
    order)."""

    tokens: np.ndarray
    parent_pos: np.ndarray | None


#: ``expand(level) -> (ids, probs)``, ``[m, K]`` each: the law each node's children are drawn
#: from (probabilities not necessarily summing to 1, zeros where it has fewer than K entries).
Expand = Callable[[Level], "tuple[np.ndarray, np.ndarray]"]
#: ``draw_order(probs) -> [m, K]``: each entry's candidates in the order of random draws (zero entries last).
DrawOrder = Callable[[np.ndarray], np.ndarray]


def grow(budget: TreeBudget, roots: np.ndarray, expand: Expand, draw_order: DrawOrder, stochastic,
         rates: "SlotRates | None" = None, row_ids: list[int] | None = None, placed=None) -> TokenTree:
    """Grow one tree per root under ``budget`` (see the module docstring). Rows that are offered
    fewer than ``budget.nodes - 1`` nodes are padded with invalid nodes under the root.
    ``stochastic`` (a bool, or one per root): the rows whose children are drawn (``draw_order``);
    the others take their entries by probability. Where any row draws, every expanded node
    carries its law as ``child_ids``/``child_probs``. With
    ``rates`` (and a calibrated budget), a slot's factor is its learned chance of acceptance
    instead of ``r_j``; the tree is remembered under ``row_ids`` for :meth:`SlotRates.record`.
    Each level's bookkeeping runs compiled (:func:`_level`); ``expand`` and ``draw_order`` are
    the drafter's. ``placed(call, rows, nodes)``, if given, learns where the entries of each
    ``expand`` call (numbered from 0) ended up: their batch rows and node numbers (-1: dropped)."""
    B, N = len(roots), budget.nodes
    stochastic = np.ascontiguousarray(np.broadcast_to(stochastic, (B,)), dtype=np.bool_)
    rates = rates if budget.calibrate else None
    pool = _Pool(B, N)
    pool.token[:B] = roots
    laws: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (pool ids, ids, probs) per level
    frontier, parent_pos = np.arange(B), None
    for d in range(budget.max_depth):
        ids, probs = expand(Level(pool.token[frontier], parent_pos))
        ids, probs = np.ascontiguousarray(ids, dtype=np.int64), np.ascontiguousarray(probs, dtype=np.float64)
        laws.append((frontier, ids, probs))
        drawing = stochastic[pool.row[frontier]]
        if drawing.all():
            order = draw_order(probs)
        else:  # (greedy rows: by probability)
            order = np.argsort(-probs, axis=1, kind="stable")
            if drawing.any():
                order[drawing] = draw_order(probs[drawing])
        order = np.ascontiguousarray(order, dtype=np.int64)
        if rates is not None:
            rates.cover(ids.shape[1])
        pool.reserve(len(frontier) * min(ids.shape[1], N - 1))
        acc, reached = (rates.accepted, rates.reached) if rates is not None else (_NO_RATES, _NO_RATES)
        pool.count, kept, frontier, parent_pos = _level(
            pool.row, pool.parent, pool.token, pool.prio, pool.value, pool.rank, pool.conf, pool.count, B, frontier,
            ids, probs, order, stochastic, N, budget.width or N, rates is not None, acc, reached)
        if d + 1 == budget.max_depth or not len(frontier):
            break
    c = pool.count
    row, parent = pool.row[:c], pool.parent[:c]
    tree, node = _tree(kept, row, parent, pool.token[:c], laws, B, N, stochastic)
    if placed is not None:
        for call, (pool_ids, _, _) in enumerate(laws):
            placed(call, row[pool_ids], node[pool_ids])
    if rates is not None and row_ids is not None:
        at = np.nonzero(kept & (parent >= 0))[0]
        slot = np.full((B, N, 2), -1.0)
        slot[row[at], node[at]] = np.stack([pool.rank[at], pool.conf[at]], 1)
        rates.remember(row_ids, tree, slot)
    return tree


_NO_RATES = np.ones((1, 1))


class _Pool:
    """Every node offered so far (the roots first), as arrays with room to grow: its row, parent
    entry, token, priority, value, and slot (rank among its siblings, confidence ``r_j``)."""

    def __init__(self, B: int, N: int):
        self.count = B
        self._size(max(4 * B * N, 64))
        self.row[:B], self.parent[:B], self.prio[:B], self.value[:B] = np.arange(B), -1, np.inf, 1.0
        self.rank[:B], self.conf[:B] = -1, 0.0

    def _size(self, n: int, old: "_Pool | None" = None) -> None:
        for name, dtype in (("row", np.int64), ("parent", np.int64), ("token", np.int64), ("prio", np.float64),
                            ("value", np.float64), ("rank", np.int64), ("conf", np.float64)):
            a = np.zeros(n, dtype=dtype)
            if old is not None:
                a[: self.count] = getattr(self, name)[: self.count]
            setattr(self, name, a)

    def reserve(self, extra: int) -> None:
        if self.count + extra > len(self.row):
            self._size(2 * (self.count + extra), self)


@njit(cache=True)
def _slots(qs, stochastic, use_rates, acc, reached, r, factor):
    """One node's slots from its renormalised law in draw order ``qs`` (over every draw: the best
    not drawn yet may lie past the slots kept). ``r``, each slot's confidence: deterministic
    drafts, ``qs`` itself (descending); random drafts, the probability draw j is expected to have
    given the draws before it, ``sum q^2 / sum q`` over the tokens not drawn yet, never above an
    earlier slot's (0 once nothing is left). ``factor``, what its priority weighs it by: ``r``,
    or with rates the learned chance ``h_j * prod_{i<j} (1 - h_i)`` (the hazard ``h`` of the
    slot's rank and confidence bin), never above an earlier slot's."""
    K = len(qs)
    if stochastic:
        mass, square = 0.0, 0.0
        for j in range(K - 1, -1, -1):
            mass += qs[j]
            square += qs[j] * qs[j]
            r[j] = square / mass if mass > 0 else 0.0
        for j in range(1, K):
            r[j] = min(r[j], r[j - 1])
    else:
        r[:] = qs
    if not use_rates:
        factor[:] = r
        return
    bins = acc.shape[1]
    alive = 1.0
    for j in range(K):
        b = min(int(r[j] * bins), bins - 1)
        h = acc[j, b] / reached[j, b]
        factor[j] = 0.0 if r[j] <= 0 else h * alive
        if j > 0:
            factor[j] = min(factor[j], factor[j - 1])
        alive *= 1.0 - h


@njit(cache=True)
def _level(row, parent, token, prio, value, rank, conf, count, B, frontier, ids, probs, order, stochastic, N,
           width, use_rates, acc, reached):
    """Offer the slots of every ``frontier`` entry (its law ``ids``/``probs``, draw ``order``) to
    the pool, keep each row's best N entries, and pick the next frontier: the new kept entries,
    at most ``width`` per row, best first (``stochastic``: per row, whether its draws are
    random). Returns the pool size, the kept mask, the next frontier (creation order) and each of
    its entries' parent's position in ``frontier``."""
    m, K = probs.shape
    S = min(K, N - 1)  # no node has more than N - 1 children
    first = count
    qs, r, factor = np.empty(K), np.empty(K), np.empty(K)
    for f in range(m):
        total = probs[f].sum()
        if total <= 0:
            continue
        for j in range(K):
            qs[j] = probs[f, order[f, j]] / total
        src = frontier[f]
        _slots(qs, stochastic[row[src]], use_rates, acc, reached, r, factor)
        for j in range(S):
            if r[j] <= 0:
                break
            row[count], parent[count], token[count] = row[src], src, ids[f, order[f, j]]
            rank[count], conf[count] = j, r[j]
            prio[count] = min(prio[src], value[src] * factor[j])
            # a random draw's own probability may steer its subtree (it is in the tree already);
            # a learned chance is the node's worth
            value[count] = value[src] * (factor[j] if use_rates else qs[j])
            count += 1
    # each row's best N: by row, then priority, then creation (stable sorts)
    by = np.argsort(-prio[:count], kind="mergesort")
    by = by[np.argsort(row[by], kind="mergesort")]
    kept = np.zeros(count, dtype=np.bool_)
    taken = np.zeros(B, dtype=np.int64)
    expanding = np.zeros(B, dtype=np.int64)
    chosen = np.zeros(count, dtype=np.bool_)
    for i in by:
        if taken[row[i]] < N:
            taken[row[i]] += 1
            kept[i] = True
            if i >= first and expanding[row[i]] < width:  # the level's best ``width`` expand
                expanding[row[i]] += 1
                chosen[i] = True
    nxt = np.nonzero(chosen)[0]
    pos = np.full(count, -1, dtype=np.int64)
    for i in range(len(frontier)):
        pos[frontier[i]] = i
    return count, kept, nxt, pos[parent[nxt]]


def _tree(kept, row, parent, token, laws, B: int, N: int, stochastic: np.ndarray) -> tuple[TokenTree, np.ndarray]:
    """The kept pool entries as a [B, N] tree: each row's nodes in creation order (parents come
    before children, siblings in draw order), the rest invalid padding under the root; and each
    pool entry's node number (-1: not kept)."""
    idx = np.nonzero(kept)[0]  # pool order is creation order, rows interleaved
    idx = idx[np.argsort(row[idx], kind="stable")]
    start = np.searchsorted(row[idx], np.arange(B))
    node = np.full(len(row), -1)
    node[idx] = np.arange(len(idx)) - start[row[idx]]
    tokens = np.repeat(np.asarray(token[:B])[:, None], N, 1)
    parents = np.zeros((B, N), dtype=np.int64)
    parents[:, 0] = -1
    valid = np.zeros((B, N), dtype=bool)
    r, v = row[idx], node[idx]
    tokens[r, v], valid[r, v] = token[idx], True
    inner = parent[idx] >= 0
    parents[r[inner], v[inner]] = node[parent[idx[inner]]]
    extra = {}
    if stochastic.any():
        K = max(ids.shape[1] for _, ids, _ in laws)
        child_ids, child_probs = np.zeros((B, N, K), dtype=np.int64), np.zeros((B, N, K), dtype=np.float32)
        for pool_ids, ids, probs in laws:
            held = kept[pool_ids]
            at = pool_ids[held]
            child_ids[row[at], node[at], : ids.shape[1]] = ids[held]
            child_probs[row[at], node[at], : ids.shape[1]] = probs[held]
        extra = dict(child_ids=torch.from_numpy(child_ids), child_probs=torch.from_numpy(child_probs))
    # the index from the construction (no validation, no pointer doubling: ~130 ops a step less),
    # with its deepest level known on the host (no device sync for it)
    depth, pre, last = _preorder(parents)
    as32 = lambda a: torch.from_numpy(a.astype(np.int32))
    index = TreeIndex(as32(parents), as32(depth), as32(pre), as32(last))
    index.memo("max_depth", lambda: int(depth.max()))
    tree = TokenTree.from_index(index, torch.from_numpy(parents), torch.from_numpy(tokens),
                                valid=torch.from_numpy(valid), **extra)
    return tree, node


@njit(cache=True)
def _preorder(parents):
    """Depth, pre-order rank (children in index order) and subtree end of every node of valid
    parent arrays ``[B, N]``: :func:`stree.tree.tree_index` in O(N) per row."""
    B, N = parents.shape
    depth = np.zeros((B, N), dtype=np.int64)
    size = np.ones((B, N), dtype=np.int64)
    pre = np.zeros((B, N), dtype=np.int64)
    after = np.empty(N, dtype=np.int64)  # the pre-order rank the node's next child takes
    for b in range(B):
        for v in range(N - 1, 0, -1):
            size[b, parents[b, v]] += size[b, v]
        after[0] = 1
        for v in range(1, N):
            p = parents[b, v]
            depth[b, v] = depth[b, p] + 1
            pre[b, v] = after[p]
            after[p] += size[b, v]
            after[v] = pre[b, v] + 1
    return depth, pre, pre + size - 1


class SlotRates:
    """The learned chance that a drafted child is accepted, by its rank among its siblings (draw
    order) and the confidence ``r_j`` its slot was offered with (``BINS`` equal bins of [0, 1]):
    the hazard h = P(accepted | parent accepted, earlier siblings rejected), counted over verified
    steps (:meth:`record`) on a prior worth 2 steps at the bin's middle. A slot's chance is
    ``h_j * prod_{i<j} (1 - h_i)`` (:func:`_slots`). Why learn it: the drafter's probability misjudges acceptance --
    at temperature 0 a confident top token is the target's choice far more often than its
    probability says, and a random draw from a good drafter is accepted almost whatever its own
    probability -- while the rates depend only on past steps, so drafts stay lossless."""

    BINS = 8

    def __init__(self):
        self.accepted = np.zeros((0, self.BINS))
        self.reached = np.zeros((0, self.BINS))
        self._last: dict[int, tuple] = {}  # row id -> its last tree's (kids, tokens, slot)

    def cover(self, ranks: int) -> None:
        """Room for ``ranks`` sibling ranks (new ranks start at the prior)."""
        if ranks > len(self.reached):
            extra = ranks - len(self.reached)
            mid = (np.arange(self.BINS) + 0.5) / self.BINS
            self.accepted = np.concatenate([self.accepted, np.tile(2.0 * mid, (extra, 1))])
            self.reached = np.concatenate([self.reached, np.full((extra, self.BINS), 2.0)])

    def _bin(self, r: float) -> int:  # as the compiled planner bins (``_slots``)
        return min(int(r * self.BINS), self.BINS - 1)

    def forget(self) -> None:
        """Drop the remembered trees (new rows); the learned rates stay."""
        self._last = {}

    def remember(self, row_ids: list[int], tree: TokenTree, slot: np.ndarray) -> None:
        """Each row's tree and its nodes' (rank, confidence), until the row's next emission."""
        parents, tokens, valid = tree.parents.numpy(), tree.tokens.numpy(), tree.valid.numpy()
        for i, r in enumerate(row_ids):
            kids: dict[int, list[int]] = {}
            for c in np.nonzero(valid[i, 1:])[0] + 1:  # index order: siblings in draw order
                kids.setdefault(int(parents[i, c]), []).append(int(c))
            self._last[r] = (kids, tokens[i], slot[i])

    def record(self, row_ids: list[int], emitted: list[list[int]]) -> None:
        """Count what the verifier did with each row's remembered tree: walking the emitted tokens
        from the root, a child whose token was emitted was accepted (rejected siblings never come
        back, and the residual never emits them), the siblings before it were reached and
        rejected; a node none of whose children was emitted had them all rejected."""
        for r, tokens in zip(row_ids, emitted):
            last = self._last.pop(r, None)
            if last is None:
                continue
            kids, tree_tokens, slot = last
            u = 0
            for t in tokens:
                hit = None
                for c in kids.get(u, ()):
                    j, b = int(slot[c, 0]), self._bin(slot[c, 1])
                    self.reached[j, b] += 1
                    if tree_tokens[c] == t:
                        self.accepted[j, b] += 1
                        hit = c
                        break
                if hit is None:
                    break
                u = hit
