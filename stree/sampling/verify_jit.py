"""Verification on the CPU, compiled with numba: the walk of :func:`stree.sampling.verify.verify`
one row at a time, computing each one-node rule only where the walk goes (:func:`walk`), and the
greedy and naive rules' walk down the nodes' choices (:func:`follow`: one pass where the PyTorch
walk costs a dozen small ops and a gather per level), and greedy verification whole
(:func:`greedy_walk`: the argmax of the nodes on the path only, the finiteness check and the
emitted tokens in the same pass).

The PyTorch path builds the acceptance tables of every node (``[B, N, V]`` per sibling rank, a
dozen ops each) and then walks them; on the CPU this compiled walk visits the accepted path and
the rejected siblings along it, updating one dense ``p`` (and ``q``) per node it stands on. Same
rules, same coins (one uniform per node, the coin of node c decides c), same draw order: the
accepted paths are the reference's, and the residual it returns is the reference's residual at
the last accepted node (tested equal in tests/sampling/test_verify.py). Works in float64.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["RULE_CODES", "follow", "greedy_rows", "greedy_walk", "inverse_cdf_rows", "keyed_walk", "walk"]

RULE_CODES = {"one_hot": 0, "iid": 1, "without_replacement": 2}


@njit(cache=True)
def _normalize_into(src, dst, fallback):
    """dst = src / sum(src), or ``fallback`` where src holds no mass."""
    s = 0.0
    for i in range(len(src)):
        s += src[i]
    if s > 0:
        for i in range(len(src)):
            dst[i] = src[i] / s
    else:
        for i in range(len(src)):
            dst[i] = fallback[i]


@njit(cache=True)
def _child_drafting(tree, v, valid, tokens, token):
    """Node v's first valid child, in draw order (``tree[v]``: its children by rank, -1 past the
    last), holding ``token``; -1 where none does."""
    for r in range(tree.shape[1]):
        c = tree[v, r]
        if c < 0:
            break
        if valid[c] and tokens[c] == token:
            return c
    return -1


@njit(cache=True)
def follow(choice, tokens, valid, kids, path, num):
    """For each row b: from the root, move to the first valid child (in draw order, ``kids[b or
    0, v]``, -1 past the last) whose token is its parent's ``choice``; stop at the first node
    with none. Writes the path (``path[b, :num[b]]``, root first, 0 past it) and its length."""
    B = choice.shape[0]
    for b in range(B):
        tree = kids[min(b, kids.shape[0] - 1)]
        v, n = 0, 1
        path[b, :] = 0
        while True:
            nxt = _child_drafting(tree, v, valid[b], tokens[b], choice[b, v])
            if nxt < 0:
                break
            v = nxt
            path[b, n] = v
            n += 1
        num[b] = n


@njit(cache=True)
def greedy_walk(logits, tokens, valid, kids, path, num, emitted, bonus, finite):
    """Greedy verification of float32 ``logits [B, N, V]`` in one pass: :func:`follow` with each
    node's choice the argmax of its logits (the first of equal maxima, as ``torch.argmax``),
    taken only at the nodes the walk stands on. Also writes each row's emitted tokens
    (``emitted[b, :num[b]]``: the accepted drafts below the root, then the bonus, the argmax at
    the last node; the root's token past them), the bonus alone (``bonus[b]``) and whether every
    logit of the row is free of NaN and +inf (``finite[b]``; -inf, a token ruled out, is
    allowed)."""
    B, N, V = logits.shape
    for b in range(B):
        ok = True
        for n in range(N):
            ok &= _finite_row(logits[b, n])
        finite[b] = ok
        num[b] = _walk_row(logits[b], kids[min(b, kids.shape[0] - 1)], valid[b], tokens[b], _NO_DRAWS, path[b],
                           emitted[b])
        bonus[b] = emitted[b, num[b] - 1]


_NO_DRAWS = np.empty(0)  # (a greedy walk's: it draws nothing)


@njit(cache=True)
def greedy_rows(logits, tokens, finite):
    """A plain greedy step's :func:`greedy_walk`: each row's argmax of float32 ``logits [B, V]``
    into ``tokens[b, 0]`` and whether the row is free of NaN and +inf into ``finite[b]``."""
    for b in range(logits.shape[0]):
        finite[b] = _finite_row(logits[b])
        tokens[b, 0] = _argmax(logits[b])


@njit(cache=True)
def _finite_row(row):
    """Whether ``row`` is free of NaN and +inf (-inf, a token ruled out, is allowed)."""
    ok = True
    for i in range(len(row)):
        ok &= row[i] < np.inf  # (False for NaN too)
    return ok


@njit(cache=True)
def _argmax(row):
    """The first index of ``row``'s largest entry, as ``torch.argmax`` (NaN aside)."""
    choice, best = 0, row[0]
    for i in range(1, len(row)):
        if row[i] > best:
            choice, best = i, row[i]
    return choice


@njit(cache=True)
def _walk_row(laws, tree, valid, tokens, draws, path, emitted):
    """One row's walk from the root down the children holding each node's choice: the argmax of
    its ``laws[v]`` (logits) where ``draws`` is empty, else the inverse CDF of its law at the draw
    of its depth. Writes the path and the emitted tokens (the accepted drafts, then the last
    node's choice; the root's token past them); returns the path's length."""
    v, n = 0, 1
    path[:] = 0
    while True:
        row = laws[v]
        if len(draws):
            choice = _inverse_cdf(row, draws[n - 1])
        else:
            choice = _argmax(row)
        nxt = _child_drafting(tree, v, valid, tokens, choice)
        if nxt < 0:
            break
        v = nxt
        path[n] = v
        emitted[n - 1] = tokens[v]
        n += 1
    emitted[n - 1] = choice
    for j in range(n, len(path)):
        emitted[j] = tokens[0]
    return n


@njit(cache=True)
def walk(probs, tokens, valid, kids, child_ids, child_probs, rule, coins, path, num, residual):
    """For each row b: from the root, try each valid child of the current node in draw order
    (``kids[b or 0, v]``: the children by rank, -1 past the last), accept child c when
    ``coins[b, c]`` is below its acceptance probability given the earlier siblings' rejections,
    and move to it; stop at the first node none of whose children is accepted. Writes the path
    (``path[b, :num[b]]``, root first) and that node's residual law (``residual[b]``).

    probs ``[B, N, V]``, tokens ``[B, N]``, valid ``[B, N]``, child_ids / child_probs
    ``[B, N, K]`` (the law each node's children were drawn from; unused by the one-hot rule)."""
    B, N, V = probs.shape
    p = np.empty(V)
    q = np.empty(V)
    work = np.empty(V)
    for b in range(B):
        tree = kids[min(b, kids.shape[0] - 1)]
        v = 0
        path[b, 0] = 0
        n = 1
        while True:
            for i in range(V):
                p[i] = probs[b, v, i]
            if rule != 0:
                q[:] = 0.0
                s = 0.0
                for k in range(child_ids.shape[2]):
                    w = max(float(child_probs[b, v, k]), 0.0)
                    q[child_ids[b, v, k]] += w
                    s += w
                if s > 0:
                    for i in range(V):
                        q[i] /= s
            nxt = -1
            for r in range(tree.shape[1]):
                c = tree[v, r]
                if c < 0:
                    break
                if not valid[b, c]:
                    continue  # padding: never accepted, changes nothing
                x = tokens[b, c]
                if rule == 0:
                    drafted, a = True, p[x]
                else:
                    drafted = q[x] > 0  # a token its law could not produce is never accepted
                    a = min(1.0, p[x] / q[x]) if drafted else 0.0
                if drafted and coins[b, c] < a:
                    nxt = c
                    break
                if not drafted:
                    continue
                if rule == 0:
                    for i in range(V):
                        work[i] = p[i]
                    work[x] = 0.0
                else:
                    for i in range(V):
                        work[i] = max(p[i] - q[i], 0.0)
                _normalize_into(work, p, p)  # p itself where the rejection had probability 0
                if rule == 2:
                    for i in range(V):
                        work[i] = q[i]
                    work[x] = 0.0
                    s = 0.0
                    for i in range(V):
                        s += work[i]
                    for i in range(V):
                        q[i] = work[i] / s if s > 0 else 0.0
            if nxt < 0:
                break
            v = nxt
            path[b, n] = v
            n += 1
        num[b] = n
        for i in range(V):
            residual[b, i] = p[i]


@njit(cache=True)
def _inverse_cdf(row, u):
    """The first index at which the float64 running sum of ``row`` exceeds ``u`` times its total;
    where none does (``u`` times the total rounded up to it) the last entry above 0: an entry of 0
    is never taken. (The last index for a row without mass, a NaN one: the finiteness check
    reports its step.)"""
    total, last = 0.0, len(row) - 1
    for i in range(len(row)):
        total += row[i]
        if row[i] > 0:
            last = i
    at = u * total
    s = 0.0
    for i in range(len(row)):
        s += row[i]
        if s > at:
            return i
    return last


@njit(cache=True)
def inverse_cdf_rows(probs, u, out):
    """``out[r]``: :func:`_inverse_cdf` of ``probs[r]`` at ``u[r]``."""
    for r in range(probs.shape[0]):
        out[r] = _inverse_cdf(probs[r], u[r])


@njit(cache=True)
def keyed_walk(probs, tokens, valid, kids, u, path, num, emitted):
    """The naive rule at keyed uniforms (:mod:`stree.sampling.keyed`) in one pass: :func:`follow`
    with the choice of a node at depth d the inverse CDF of its law ``probs[b, v]`` at ``u[b, d]``,
    taken only at the nodes the walk stands on. Writes the path, its length and each row's emitted
    tokens as :func:`greedy_walk` does (the accepted drafts, then the last node's choice)."""
    for b in range(probs.shape[0]):
        num[b] = _walk_row(probs[b], kids[min(b, kids.shape[0] - 1)], valid[b], tokens[b], u[b], path[b], emitted[b])
