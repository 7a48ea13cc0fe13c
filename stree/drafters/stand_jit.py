"""STAND's store and drafts compiled with numba: the same merges, evictions and trees as the
reference in ``stand.py`` (tested equal), with the n-gram -> slot map in arrays
(``jit_table``) instead of a dict, so that a step's draft and its update are one compiled call
each (issue 14's budget for a step's propose and observe; `benchmarks/drafting.py` measures it).

Slot ``s`` of the store holds the n-gram ``key_tok[s, :key_len[s]]`` (``key_len`` 0: free) at
position ``key_slot[s]`` of the hash table ``table``; ``free[:meta[M_FREE]]`` is the stack of
free slots (popped from the top, as the reference pops its list).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .jit_table import DELETED, EMPTY, find, rehash

# meta fields: the update clock, n-grams held, tombstones in the table, free slots on the stack
M_CLOCK, M_LIVE, M_TOMB, M_FREE = range(4)


@njit(cache=True)
def _evict(count_evicted, stamp, key_len, key_slot, table, free, meta, keep, ids, probs, count):
    """Free (and zero) the ``count_evicted`` slots updated least recently (stable in slot order),
    never a slot in ``keep``."""
    order_stamp = stamp.copy()
    for s in keep:
        if s >= 0:
            order_stamp[s] = np.iinfo(np.int64).max
    order = np.argsort(order_stamp, kind="mergesort")
    for j in range(min(count_evicted, len(order))):
        s = order[j]
        if order_stamp[s] == np.iinfo(np.int64).max or key_len[s] == 0:
            continue
        table[key_slot[s]] = DELETED
        key_len[s] = 0
        ids[s, :] = 0
        probs[s, :] = 0
        count[s] = 0
        meta[M_LIVE] -= 1
        meta[M_TOMB] += 1
        free[meta[M_FREE]] = s
        meta[M_FREE] += 1


@njit(cache=True)
def _merge(s, new_ids, new_p, ids, probs, count, all_ids, weight, score, top):
    """Occurrence (``new_ids``, ``new_p``) merged into slot ``s``: the running mean over the union
    of ids, re-truncated to the top K (ties: earlier position first, old entries before new).
    ``all_ids``, ``weight``, ``score`` (2K each) and ``top`` (K) are the caller's scratch."""
    K = ids.shape[1]
    k = np.float32(count[s])
    # A law of one entry, zero-padded (a plain step's token: most merges), skips its pads' sums and
    # scans: each adds an exact zero, and only the first pad can be a new id (0).
    one = True
    for j in range(K):
        all_ids[j] = ids[s, j]
        weight[j] = (probs[s, j] * k) / (k + np.float32(1))
        all_ids[K + j] = new_ids[j]
        weight[K + j] = new_p[j] / (k + np.float32(1))
        if j and (new_ids[j] != 0 or new_p[j] != 0):
            one = False
    summed = K + 1 if one else 2 * K  # the positions scored by their sums
    # an id's score, at its first position, sums its weights in position order (-1 at the others)
    for a in range(summed):
        first = a
        for b in range(a):
            if all_ids[b] == all_ids[a]:
                first = b
                break
        if first == a:
            score[a] = weight[a]
        else:
            score[a] = np.float32(-1)
            score[first] += weight[a]
    if one:  # the pads: id 0 of weight 0, new only at the first pad and only if no earlier position holds it
        zero_new = True
        for b in range(K + 1):
            if all_ids[b] == 0:
                zero_new = False
                break
        for a in range(K + 1, 2 * K):
            score[a] = np.float32(0) if a == K + 1 and zero_new else np.float32(-1)
    # The top K by score, ties to the earlier position: each position in turn inserted after the
    # kept ones of a score at least its own. Past the first ``ranked`` (>= K) positions every score
    # is -1 (a pad repeating id 0): they rank after all of those, never among the top K.
    ranked = min(K + 2, 2 * K) if one else 2 * K
    kept = 0
    for a in range(ranked):
        v = score[a]
        if kept == K and not v > score[top[K - 1]]:
            continue
        i = kept if kept < K else K - 1
        while i > 0 and score[top[i - 1]] < v:
            top[i] = top[i - 1]
            i -= 1
        top[i] = a
        kept = min(kept + 1, K)
    for r in range(K):
        ids[s, r] = all_ids[top[r]]
        probs[s, r] = max(score[top[r]], np.float32(0))
    count[s] += 1


@njit(cache=True)
def update(keys, lens, new_ids, new_p, piece, evict_count, ids, probs, count, stamp, key_tok, key_len, key_slot,
           table, free, meta):
    """Merge occurrence i into n-gram ``keys[i, :lens[i]]``, in rounds of distinct keys (the r-th
    occurrence of a key in round r), each round in pieces of at most ``piece`` keys; a piece
    finding no free slot evicts the least recently updated ones (not its own)."""
    m = len(lens)
    K = ids.shape[1]
    all_ids, weight = np.empty(2 * K, dtype=np.int32), np.empty(2 * K, dtype=np.float32)
    score, top = np.empty(2 * K, dtype=np.float32), np.empty(K, dtype=np.int64)
    size = 2
    while size < 2 * m + 2:
        size *= 2
    seen = np.full(size, EMPTY, dtype=np.int64)
    occurrences = np.zeros(m, dtype=np.int64)
    rnd = np.zeros(m, dtype=np.int64)
    rounds = 0
    for i in range(m):
        first, at = find(seen, keys, lens, keys[i], 0, lens[i])
        if first < 0:
            seen[at] = i
            first = i
        rnd[i] = occurrences[first]
        occurrences[first] += 1
        rounds = max(rounds, rnd[i] + 1)
    # each round's occurrences in order: a counting sort (a scan of all m per round cost a fifth of
    # a plain run's update, whose most frequent token makes a round per occurrence)
    begin = np.zeros(rounds + 1, dtype=np.int64)
    for i in range(m):
        begin[rnd[i] + 1] += 1
    for r in range(rounds):
        begin[r + 1] += begin[r]
    order = np.empty(m, dtype=np.int64)
    fill = begin[:rounds].copy()
    for i in range(m):
        order[fill[rnd[i]]] = i
        fill[rnd[i]] += 1
    for r in range(rounds):
        members = order[begin[r]: begin[r + 1]]
        for lo in range(0, len(members), piece):
            part = members[lo: lo + piece]
            meta[M_CLOCK] += 1
            slots = np.full(len(part), -1, dtype=np.int64)
            for q in range(len(part)):
                slots[q], _ = find(table, key_tok, key_len, keys[part[q]], 0, lens[part[q]])
            for q in range(len(part)):
                if slots[q] >= 0:
                    continue
                i = part[q]
                if meta[M_FREE] == 0:
                    _evict(evict_count, stamp, key_len, key_slot, table, free, meta, slots, ids, probs, count)
                if 2 * (meta[M_LIVE] + meta[M_TOMB] + 1) > len(table):  # too many tombstones: rebuild
                    table[:] = EMPTY
                    rehash(table, key_len, key_tok, key_slot, len(key_len))
                    meta[M_TOMB] = 0
                meta[M_FREE] -= 1
                s = free[meta[M_FREE]]
                _, at = find(table, key_tok, key_len, keys[i], 0, lens[i])
                if table[at] == DELETED:
                    meta[M_TOMB] -= 1
                table[at] = s
                key_slot[s] = at
                key_len[s] = lens[i]
                key_tok[s, : lens[i]] = keys[i, : lens[i]]
                meta[M_LIVE] += 1
                slots[q] = s
            for q in range(len(part)):
                _merge(slots[q], new_ids[part[q]], new_p[part[q]], ids, probs, count, all_ids, weight, score, top)
                stamp[slots[q]] = meta[M_CLOCK]


@njit(cache=True)
def _longest(table, key_tok, key_len, path, plen, max_n):
    for n in range(min(max_n, plen), 0, -1):
        s, _ = find(table, key_tok, key_len, path, plen - n, n)
        if s >= 0:
            return s
    return -1


@njit(cache=True)
def longest_many(table, key_tok, key_len, paths, plens, max_n):
    """The slot of the longest stored suffix of each ``paths[i, :plens[i]]`` (-1: none)."""
    out = np.empty(len(plens), dtype=np.int64)
    for i in range(len(plens)):
        out[i] = _longest(table, key_tok, key_len, paths[i], plens[i], max_n)
    return out


@njit(cache=True)
def draft(tails, tail_len, nodes, level_start, kid_start, kids, has_kids, stochastic, noise, max_n, ids, probs,
          table, key_tok, key_len, weak_n, out_tok, out_ok, out_weak, child_ids, child_probs):
    """Fills the trees of every row (see ``STANDStore.draft``; ``stochastic`` per row); returns the
    noise values used."""
    b, n_nodes = out_tok.shape
    drawing = stochastic.any()
    K = ids.shape[1]
    path = np.zeros((b, n_nodes, max_n), dtype=np.int64)
    plen = np.zeros((b, n_nodes), dtype=np.int64)
    for i in range(b):
        plen[i, 0] = tail_len[i]
        path[i, 0, : tail_len[i]] = tails[i, : tail_len[i]]
        out_tok[i, 0] = tails[i, tail_len[i] - 1]
        out_ok[i, 0] = True
        out_weak[i, :] = False
    todo = np.empty((b * len(nodes), 3), dtype=np.int64)  # (row, position in nodes, slot)
    key = np.empty(K, dtype=np.float64)
    taken = np.zeros(K, dtype=np.bool_)
    used = 0
    for d in range(len(level_start) - 1):
        m, width = 0, 0
        for p in range(level_start[d], level_start[d + 1]):
            v = nodes[p]
            for i in range(b):
                if not out_ok[i, v]:
                    continue
                s = _longest(table, key_tok, key_len, path[i, v], plen[i, v], max_n)
                if s < 0:
                    continue
                todo[m, 0], todo[m, 1], todo[m, 2] = i, p, s
                m += 1
                width = max(width, kid_start[p + 1] - kid_start[p])
        width = min(width, K)
        for j in range(m):
            i, p, s = todo[j, 0], todo[j, 1], todo[j, 2]
            v = nodes[p]
            for c in range(K):
                child_ids[i, v, c] = ids[s, c]
                child_probs[i, v, c] = probs[s, c]
                # the race: the largest probs / Exp(1) come in the order of draws without replacement
                key[c] = probs[s, c] / noise[used + j * K + c] if stochastic[i] else probs[s, c]
                taken[c] = False
            for r in range(min(width, kid_start[p + 1] - kid_start[p])):
                best = -1
                for c in range(K):
                    if not taken[c] and (best < 0 or key[c] > key[best]):
                        best = c
                taken[best] = True
                if probs[s, best] <= 0:
                    continue
                child = kids[kid_start[p] + r]
                out_tok[i, child] = ids[s, best]
                out_ok[i, child] = True
                out_weak[i, child] = not stochastic[i] and key_len[s] <= weak_n
                if has_kids[kid_start[p] + r]:
                    keep = min(plen[i, v], max_n - 1)
                    path[i, child, :keep] = path[i, v, plen[i, v] - keep: plen[i, v]]
                    path[i, child, keep] = ids[s, best]
                    plen[i, child] = keep + 1
        if drawing:
            used += m * K  # (a greedy row's share of the window goes unused: no value serves twice)
    return used


@njit(cache=True)
def observe(seq, start, max_n, top_ids, top_probs, piece, evict_count, ids, probs, count, stamp, key_tok, key_len,
            key_slot, table, free, meta):
    """``update`` with the n-grams ``seq[end - n: end]`` (end >= start, n = 1..max_n, in that
    order), each merged with row ``end - start`` of ``top_ids``/``top_probs`` cut or padded to K."""
    K = ids.shape[1]
    m = 0
    for end in range(start, len(seq)):
        m += min(max_n, end)
    keys = np.zeros((m, max_n), dtype=np.int64)
    lens = np.empty(m, dtype=np.int64)
    new_ids = np.zeros((m, K), dtype=np.int32)
    new_p = np.zeros((m, K), dtype=np.float32)
    width = min(K, top_ids.shape[1])
    q = 0
    for end in range(start, len(seq)):
        for n in range(1, min(max_n, end) + 1):
            keys[q, :n] = seq[end - n: end]
            lens[q] = n
            for c in range(width):
                new_ids[q, c] = top_ids[end - start, c]
                new_p[q, c] = top_probs[end - start, c]
            q += 1
    if m:
        update(keys, lens, new_ids, new_p, piece, evict_count, ids, probs, count, stamp, key_tok, key_len, key_slot,
               table, free, meta)
