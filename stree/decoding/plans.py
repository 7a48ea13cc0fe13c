"""Trees from acceptance chances (:mod:`stree.decoding.acceptance`), for ``tree="auto"``
(:mod:`stree.decoding.autotree`): the best tree of n nodes is the n likeliest, grown best first
(:func:`best_first`, :func:`plan_shape`); before drafting, the size of such a plan with the most
expected tokens per millisecond (:func:`best_size`); after drafting, the prefix of the draft with
the most (:func:`best_prefix`, weighed in one call by :func:`weigh`), or each row's own prefix for
a packed pass (:func:`best_rows`); and drafts cut to those prefixes (``TokenTree.prefix``,
:func:`cut_rows`).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
from numba import njit

from ..tree import TokenTree, TreeShape, shape_of
from .acceptance import PathRates, chances

__all__ = ["best_first", "best_prefix", "best_rows", "best_size", "cut_rows", "expected_accepted", "plan_shape",
           "remade", "rows_worth", "weigh"]


# Up to this many rows the batch waits for, a tree is worth their mean gain; with more, the least
# of them (AutoTree's docstring): two level rows take turns being behind, and the least of two draws
# priced trees short of what either row progressed (batch-2 choices stayed plain for whole calls);
# the slowest of many rows sets the batch's end, and weighed by their mean, trees that lost ran at
# batches 8 and 16 (docs/benchmarks.md, 2026-12-02).
MEAN_ROWS = 2


@njit(cache=True)
def _batch_gain(gain, active):
    """What a tree's gains ``gain[b]`` (its expected drafts accepted, per row) are worth to the
    batch: the active rows' mean up to ``MEAN_ROWS`` of them, else their least (see above)."""
    total, least, rows = 0.0, np.inf, 0
    for b in range(gain.shape[0]):
        if active[b]:
            total += gain[b]
            least = min(least, gain[b])
            rows += 1
    if rows == 0:
        return 0.0
    return total / rows if rows <= MEAN_ROWS else least


def rows_worth(values) -> float:
    """:func:`_batch_gain` of the active rows' ``values`` (a non-empty sequence), in Python: a
    step's few rows, right after a model pass, cost a NumPy reduction several times more."""
    return sum(values) / len(values) if len(values) <= MEAN_ROWS else min(values)


@njit(cache=True)
def best_prefix(v, active, cost, allow_plain):
    """The prefix size m (1: a plain step) maximising expected tokens per millisecond, ``cost[m]``
    being an iteration of m nodes (inf: not allowed), for the gain of the active rows
    (:func:`_batch_gain`): the active rows are those the batch waits for, and it is done when the
    last of them is."""
    gain = np.zeros(v.shape[0])
    best, best_rate = 1, (1.0 / cost[1] if allow_plain else -1.0)
    for m in range(2, v.shape[1] + 1):
        for b in range(v.shape[0]):
            gain[b] += v[b, m - 1]
        rate = (1.0 + _batch_gain(gain, active)) / cost[m]
        if rate > best_rate * (1.0 + 1e-9):
            best, best_rate = m, rate
    return best


@njit(cache=True)
def expected_accepted(parents, rank, depth, h):
    """The drafts a shape's prefix of m nodes is expected to have accepted (index m - 2: its
    nodes' chances under the hazards ``h``, summed), every node valid and strong (``h`` the pooled
    hazards: a shape is weighed before it is drafted); in one call, as a choice weighs its sizes
    right after a model pass."""
    n = parents.shape[1]
    v = chances(parents, rank, depth, np.ones((1, n), dtype=np.bool_), np.zeros((1, n), dtype=np.bool_),
                h.reshape((1, h.shape[0], h.shape[1])))
    out = np.empty(n - 1)
    total = 0.0
    for c in range(1, n):
        total += v[0, c]
        out[c - 1] = total
    return out


@njit(cache=True)
def best_size(expected, gain_scale, sizes, cost, draft_cost, tree_scale, n):
    """Before drafting, the size among ``sizes`` (ascending; those up to ``n``, a plan's nodes)
    with the most expected tokens per millisecond, (1 + ``gain_scale`` ``expected[m - 2]``) /
    ((``cost[m]`` + ``draft_cost[m]``) ``tree_scale``), ``expected[m - 2]`` being the drafts a
    prefix of m nodes is expected to have accepted; the smallest of near-equal rates. Returns the
    size, its rate and its expected tokens (``sizes[0]`` and a rate of 0 where no size fits).
    (numba: a choice weighs the sizes after nearly every step; as NumPy's small-array calls this
    was about a sixth of what weighing them cost.)"""
    best, best_rate = sizes[0], 0.0
    for k in range(len(sizes)):
        m = sizes[k]
        if m > n:
            break
        rate = (1.0 + gain_scale * expected[m - 2]) / ((cost[m] + draft_cost[m]) * tree_scale)
        if rate > best_rate * (1.0 + 1e-9):
            best, best_rate = m, rate
    return best, best_rate, 1.0 + gain_scale * expected[min(best, n) - 2]


@njit(cache=True)
def weigh(parents, rank, depth, valid, weak, h, active, n, cost, tree_scale, plain_ms, allow_plain, gain):
    """A draft's first ``n`` nodes weighed after drafting (:meth:`~stree.decoding.autotree.AutoTree.choose`,
    in one call: as some twenty small NumPy calls it cost a drafted iteration about a seventh of a
    compiled step, and each call apart runs cold right after a model pass): every node's chance
    (:func:`~stree.decoding.acceptance.chances`) times ``gain``, the best prefix size m by them
    (:func:`best_prefix`) against ``cost[m]`` times ``tree_scale`` (at 1, ``plain_ms``), the active
    row gaining least by the unscaled chances (an index of the rows: the focus) and what the prefix
    of m nodes promises the active rows (their unscaled chances summed, :func:`_batch_gain`).
    Returns ``(m, focus, promised, v, raw, scaled)``, ``v`` the scaled chances, ``raw`` the
    unscaled, ``scaled`` the costs weighed; m is 0 where no active row has a valid node past the
    root among the ``n`` (nothing else is then made)."""
    B = valid.shape[0]
    scaled = np.empty(n + 1)
    drafted = False
    for b in range(B):
        if active[b]:
            for c in range(1, n):
                drafted = drafted or valid[b, c]
    if not drafted:
        return 0, -1, 0.0, np.zeros((B, n)), np.zeros((B, n)), scaled
    for m in range(n + 1):
        scaled[m] = cost[m] * tree_scale
    scaled[1] = plain_ms
    v = chances(parents[:, :n], rank[:, :n], depth[:, :n], valid[:, :n], weak[:, :n], h)
    focus, least = -1, np.inf
    for b in range(B):
        if active[b]:
            total = 0.0
            for c in range(1, n):
                total += v[b, c]
            if total < least:
                focus, least = b, total
    raw = v.copy()
    for b in range(B):
        for c in range(1, n):
            v[b, c] *= gain
    m = best_prefix(v, active, scaled, allow_plain)
    promised = np.zeros(B)
    for b in range(B):
        for c in range(1, m):
            promised[b] += raw[b, c]
    return m, focus, _batch_gain(promised, active), v, raw, scaled


@njit(cache=True)
def best_rows(v, active, cost):
    """Each row's own prefix size (a packed pass: :attr:`TokenTree.row_sizes`) maximising expected
    tokens per millisecond for the active row that gains least, ``cost[t]`` being an iteration of
    t nodes in all: for every level L an active row's prefix gains, each row takes its smallest
    prefix gaining L (an inactive row, short of it, its smallest gaining what the largest size an
    active row takes would), so no node is paid for beyond what the least of the active rows
    gains. Returns the sizes and their rate (sizes all 1 and rate -1 where no level is reachable
    by every active row)."""
    B, n = v.shape
    gain = np.zeros((B, n + 1))  # gain[b, m]: a prefix of m nodes
    for b in range(B):
        for m in range(2, n + 1):
            gain[b, m] = gain[b, m - 1] + v[b, m - 1]
    best = np.ones(B, dtype=np.int64)
    best_rate = -1.0
    sizes = np.ones(B, dtype=np.int64)
    for a in range(B):
        if not active[a]:
            continue
        for k in range(2, n + 1):
            level = gain[a, k]
            if level <= 0.0:
                continue
            top, least, ok = 1, np.inf, True
            for b in range(B):
                sizes[b] = 0
                for m in range(1, n + 1):
                    if gain[b, m] >= level * (1.0 - 1e-12):
                        sizes[b] = m
                        break
                if active[b]:
                    if sizes[b] == 0:
                        ok = False
                        break
                    top = max(top, sizes[b])
                    least = min(least, gain[b, sizes[b]])
            if not ok:
                continue
            total = 0
            for b in range(B):
                if not active[b]:
                    if sizes[b] == 0 or sizes[b] > top:  # (short of the level: what it gains within top)
                        sizes[b] = 1
                        while gain[b, sizes[b]] < gain[b, top] * (1.0 - 1e-12):
                            sizes[b] += 1
                total += sizes[b]
            rate = (1.0 + least) / cost[total]
            if rate > best_rate * (1.0 + 1e-9):
                best_rate = rate
                best[:] = sizes
    return best, best_rate


@njit(cache=True)
def best_first(a, nodes):
    """The ``nodes`` likeliest nodes under positional chances ``a[d, j]``, best first (ties: the
    shallower, then the one offered first): parents, ranks, depths. A node's children and later
    siblings are offered only once it is taken, which is exact because a chance never exceeds
    the parent's or an earlier sibling's."""
    D, K = a.shape[0] - 1, a.shape[1]
    parents = np.full(nodes, -1, dtype=np.int64)
    value = np.zeros(nodes)
    value[0] = 1.0
    cap = 2 * nodes + 2
    cv = np.zeros(cap)  # each candidate's chance, parent, depth and rank
    cp, cd, cj = np.zeros(cap, dtype=np.int64), np.zeros(cap, dtype=np.int64), np.zeros(cap, dtype=np.int64)
    live = np.zeros(cap, dtype=np.bool_)
    m = 0
    if D >= 1:
        cv[0], cp[0], cd[0], cj[0], live[0], m = a[1, 0], 0, 1, 0, True, 1
    count = 1
    while count < nodes:
        best = -1
        for i in range(m):
            if live[i] and (best < 0 or cv[i] > cv[best] or (cv[i] == cv[best] and cd[i] < cd[best])):
                best = i
        if best < 0 or cv[best] <= 0.0:
            break
        live[best] = False
        k = count
        parents[k], value[k] = cp[best], cv[best]
        count += 1
        d, j = cd[best], cj[best]
        if d + 1 <= D:
            cv[m], cp[m], cd[m], cj[m], live[m] = value[k] * a[d + 1, 0], k, d + 1, 0, True
            m += 1
        if j + 1 < K:
            cv[m], cp[m], cd[m], cj[m], live[m] = value[cp[best]] * a[d, j + 1], cp[best], d, j + 1, True
            m += 1
    return parents[:count]


@njit(cache=True)
def _capped(a, depth, chain):
    """A copy of positional chances ``a`` with the levels below ``depth`` at 0 (and for a chain
    every rank past the first): in one call, as a re-plan runs right after a model pass."""
    out = a.copy()
    for d in range(depth + 1, a.shape[0]):
        out[d, :] = 0.0
    if chain:
        out[:, 1:] = 0.0
    return out


def plan_shape(rates: PathRates, nodes: int, chain: bool = False, depth: int = PathRates.DEPTH) -> TreeShape:
    """The best-first tree of at most ``nodes`` nodes and ``depth`` levels under ``rates``
    (``chain``: one child per node)."""
    made = _BY_RATES.get(rates)
    if made is None or made[0] != rates.version:
        made = _BY_RATES[rates] = (rates.version, {})
    shape = made[1].get((nodes, chain, depth))
    if shape is not None:
        return shape
    a = _capped(rates.positional(), depth, chain)
    key = (a.tobytes(), nodes)
    shape = _PLANS.get(key)
    if shape is None:
        shape = shape_of(tuple(best_first(a, nodes).tolist()))
        if len(_PLANS) >= 512:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = shape
    made[1][(nodes, chain, depth)] = shape
    return shape


# Plans by the acceptance chances they were grown from: a call's chooser plans from where the last
# call's rates (and the prior) left off, several depth caps each, and would otherwise grow and
# check the same shapes again at every call.
_PLANS: dict[tuple[bytes, int], TreeShape] = {}
# and per rates, the plans asked for under their current version, by size, chain and depth: a call's choice
# plans at once from the rates the last call left, and capping their chances again and keying them as
# bytes was a fifth of what setting the choice up took, cold after decoding (docs/benchmarks.md)
_BY_RATES: "weakref.WeakKeyDictionary[PathRates, tuple[int, dict]]" = weakref.WeakKeyDictionary()


def cut_rows(draft: TokenTree, sizes: np.ndarray) -> TokenTree:
    """Row r of ``draft`` cut to its first ``sizes[r]`` nodes: the draft cut to the largest, the
    nodes past each row's own size invalid, and the sizes kept for a packed pass."""
    top = int(sizes.max())
    draft = draft if top == draft.n else draft.prefix(top)
    keep = torch.arange(top)[None] < torch.from_numpy(sizes)[:, None]
    valid = keep if draft.valid is None else draft.valid & keep
    return remade(draft, valid=valid, child_ids=draft.child_ids, child_probs=draft.child_probs,
                   with_replacement=draft.with_replacement, row_sizes=tuple(int(s) for s in sizes), weak=draft.weak)


def remade(draft: TokenTree, **fields) -> TokenTree:
    """``draft``'s parents (its static shape where it has one) and tokens, with ``fields``."""
    if draft.static_shape is not None:
        return TokenTree.from_shape(draft.static_shape, draft.tokens, **fields)
    return TokenTree(draft.parents, draft.tokens, **fields)
