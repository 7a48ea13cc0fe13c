"""The n-gram drafter's index, compiled with numba: the same n-grams, ranks, eviction and drafts
as the pure-Python reference (``ngram.RowIndex``), held in flat arrays so that drafting an
81-node tree is one compiled call instead of dozens of interpreted node visits (issue 14's budget
for a step's propose and observe; `benchmarks/drafting.py` measures it).

Layout, for one row:
- ``toks[:ntoks]``: the context.
- keys: ``key_tok[id, :key_len[id]]`` the n-gram (``key_len`` 0: a free id), ``key_stamp[id]``
  its last update (a global counter: the reference dict's update order), ``key_slot[id]`` its
  slot in the hash table ``slots`` (open addressing, linear probing; ``EMPTY``, ``DELETED`` or an id).
- continuations: ``pool_tok/pool_cnt[c_start[id]: c_start[id] + c_len[id]]``, ranked (count
  descending, then most recent first), in a region of ``c_cap[id]`` entries; a full region
  moves to a new one twice its size at the pool's end, and the dead space is reclaimed by
  compaction when the pool is full.
- ``meta``: the counters below (``M_*``), in one array so that compiled calls update them in place.

The compiled calls never grow an array: when one lacks room, ``extend`` stops before the update
that needs it and says which; the Python side grows it and calls again from there.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import njit

from .jit_table import DELETED, EMPTY, find, rehash

# meta fields
M_POS, M_N, M_STAMP, M_LIVE, M_TOMB, M_IDS, M_FREE, M_POOL = range(8)
# extend's answers
DONE, NEED_IDS, NEED_SLOTS, NEED_POOL = range(4)
FIRST_REGION = 4


@njit(cache=True)
def _evict(slots, key_len, key_stamp, key_slot, free_ids, meta, count):
    """Drop the ``count`` n-grams updated least recently."""
    live = np.nonzero(key_len[: meta[M_IDS]] > 0)[0]
    order = np.argsort(key_stamp[live])
    for j in range(min(count, len(live))):
        k = live[order[j]]
        slots[key_slot[k]] = DELETED
        key_len[k] = 0
        free_ids[meta[M_FREE]] = k
        meta[M_FREE] += 1
        meta[M_LIVE] -= 1
        meta[M_TOMB] += 1


@njit(cache=True)
def extend(toks, end, max_n, capacity, evict, slots, key_tok, key_len, key_stamp, key_slot, free_ids,
           c_start, c_len, c_cap, pool_tok, pool_cnt, meta):
    """Index ``toks[meta[M_POS]: end]`` (resuming at n-gram length ``meta[M_N]`` of the first):
    each token counted as the continuation of the 1..max_n tokens before it. Returns DONE, or what
    it ran out of (the update that needs it not started)."""
    while meta[M_POS] < end:
        j = meta[M_POS]
        tok = toks[j]
        while meta[M_N] <= min(max_n, j):
            n = meta[M_N]
            k, slot = find(slots, key_tok, key_len, toks, j - n, n)
            if k < 0:
                if meta[M_FREE] == 0 and meta[M_IDS] == len(key_len):
                    return NEED_IDS
                if 2 * (meta[M_LIVE] + meta[M_TOMB] + 1) > len(slots):
                    return NEED_SLOTS
                if meta[M_POOL] + FIRST_REGION > len(pool_tok):
                    return NEED_POOL
                if meta[M_FREE] > 0:
                    meta[M_FREE] -= 1
                    k = free_ids[meta[M_FREE]]
                else:
                    k = meta[M_IDS]
                    meta[M_IDS] += 1
                if slots[slot] == DELETED:
                    meta[M_TOMB] -= 1
                slots[slot] = k
                key_slot[k] = slot
                key_len[k] = n
                key_tok[k, :n] = toks[j - n: j]
                c_start[k], c_len[k], c_cap[k] = meta[M_POOL], 0, FIRST_REGION
                meta[M_POOL] += FIRST_REGION
                meta[M_LIVE] += 1
            start, length = c_start[k], c_len[k]
            pos = -1
            for i in range(length):
                if pool_tok[start + i] == tok:
                    pos = i
                    break
            if pos < 0:  # a new continuation, count 1: it goes last among the count-1 ones' front
                if length == c_cap[k]:
                    if meta[M_POOL] + 2 * length > len(pool_tok):
                        return NEED_POOL
                    new = meta[M_POOL]
                    pool_tok[new: new + length] = pool_tok[start: start + length]
                    pool_cnt[new: new + length] = pool_cnt[start: start + length]
                    c_start[k], c_cap[k] = new, 2 * length
                    meta[M_POOL] += 2 * length
                    start = new
                pos = length
                length += 1
                c_len[k] = length
                count = 1
            else:
                count = pool_cnt[start + pos] + 1
            # move it in front of every continuation with no higher count (it is the newest)
            lo, hi = 0, pos
            while lo < hi:
                mid = (lo + hi) // 2
                if pool_cnt[start + mid] <= count:
                    hi = mid
                else:
                    lo = mid + 1
            for i in range(pos, lo, -1):
                pool_tok[start + i] = pool_tok[start + i - 1]
                pool_cnt[start + i] = pool_cnt[start + i - 1]
            pool_tok[start + lo] = tok
            pool_cnt[start + lo] = count
            meta[M_STAMP] += 1
            key_stamp[k] = meta[M_STAMP]
            meta[M_N] += 1
        meta[M_POS] += 1
        meta[M_N] = 1
        if meta[M_LIVE] > capacity:
            _evict(slots, key_len, key_stamp, key_slot, free_ids, meta, evict)
    return DONE


@njit(cache=True)
def _candidates(suffix, slen, k, min_n, slots, key_tok, key_len, c_start, c_len, pool_tok, out, out_n, out_many):
    """Fills ``out[:m]`` with up to ``k`` distinct continuations of ``suffix[:slen]``, longest
    matching suffix first, ``out_n[:m]`` with the length of the match each came from and
    ``out_many[:m]`` with whether other tokens followed that match too; returns m."""
    if slen < min_n:
        return 0
    key, _ = find(slots, key_tok, key_len, suffix, 0, slen)
    if key >= 0 and c_len[key] >= k:
        out[:k] = pool_tok[c_start[key]: c_start[key] + k]
        out_n[:k] = slen
        out_many[:k] = c_len[key] > 1
        return k
    m = 0
    for n in range(slen, min_n - 1, -1):
        key, _ = find(slots, key_tok, key_len, suffix, slen - n, n)
        if key < 0:
            continue
        for i in range(c_start[key], c_start[key] + c_len[key]):
            tok = pool_tok[i]
            seen = False
            for q in range(m):
                if out[q] == tok:
                    seen = True
                    break
            if not seen:
                out[m] = tok
                out_n[m] = n
                out_many[m] = c_len[key] > 1
                m += 1
                if m == k:
                    return m
    return m


@njit(cache=True)
def continues(toks, ntoks, max_n, min_n, slots, key_tok, key_len, c_start, c_len, pool_tok, weak_n):
    """Whether the last ``max_n`` tokens (or fewer, down to ``min_n``) have a continuation; where
    ``weak_n`` >= 0, one not weak (from a match of more than ``weak_n`` tokens that no other token
    followed: a draft's first child, which a draft without is weak throughout)."""
    first = max(0, ntoks - max_n)
    out, out_n, out_many = np.empty(1, dtype=np.int64), np.empty(1, dtype=np.int64), np.empty(1, dtype=np.bool_)
    m = _candidates(toks[first: ntoks], ntoks - first, 1, min_n, slots, key_tok, key_len, c_start, c_len, pool_tok,
                    out, out_n, out_many)
    return m > 0 and (weak_n < 0 or (out_n[0] > weak_n and not out_many[0]))


@njit(cache=True)
def propose(toks, ntoks, max_n, min_n, slots, key_tok, key_len, c_start, c_len, pool_tok,
            plan_node, plan_kids, kids, has_kids, weak_n, out_tok, out_ok, out_weak):
    """Drafts one row on a static shape: node 0 the last token; the children of internal node
    ``plan_node[p]`` (parents first) are ``kids[plan_kids[p]: plan_kids[p + 1]]``, filled with the
    continuations of their parent's path suffix. ``out_ok`` marks the filled nodes, ``out_weak``
    those drafted from a match of at most ``weak_n`` tokens or from one other tokens followed too, and
    every node below such a one."""
    n_nodes = len(out_tok)
    suffix = np.zeros((n_nodes, max_n), dtype=np.int64)
    slen = np.zeros(n_nodes, dtype=np.int64)
    cand = np.empty(len(kids) + 1, dtype=np.int64)
    cand_n = np.empty(len(kids) + 1, dtype=np.int64)
    cand_many = np.empty(len(kids) + 1, dtype=np.bool_)
    out_tok[:] = 0
    out_ok[:] = False
    out_weak[:] = False
    first = max(0, ntoks - max_n)
    slen[0] = ntoks - first
    suffix[0, : slen[0]] = toks[first: ntoks]
    out_tok[0] = toks[ntoks - 1]
    out_ok[0] = True
    for p in range(len(plan_node)):
        v = plan_node[p]
        if not out_ok[v]:
            continue
        lo = plan_kids[p]
        m = _candidates(suffix[v], slen[v], plan_kids[p + 1] - lo, min_n, slots, key_tok, key_len, c_start, c_len,
                        pool_tok, cand, cand_n, cand_many)
        for c in range(m):
            child = kids[lo + c]
            out_tok[child] = cand[c]
            out_ok[child] = True
            out_weak[child] = cand_n[c] <= weak_n or cand_many[c] or out_weak[v]
            if has_kids[lo + c]:
                keep = min(slen[v], max_n - 1)  # the parent's last tokens, then this one
                suffix[child, :keep] = suffix[v, slen[v] - keep: slen[v]]
                suffix[child, keep] = cand[c]
                slen[child] = keep + 1
    return out_tok


@njit(cache=True)
def compact(c_start, c_len, c_cap, key_len, n_ids, pool_tok, pool_cnt, size):
    """The live regions copied into fresh pool arrays of ``size`` entries; returns them and the
    entries used."""
    new_tok = np.empty(size, dtype=np.int64)
    new_cnt = np.empty(size, dtype=np.int64)
    used = 0
    for k in range(n_ids):
        if key_len[k] > 0:
            n = c_len[k]
            new_tok[used: used + n] = pool_tok[c_start[k]: c_start[k] + n]
            new_cnt[used: used + n] = pool_cnt[c_start[k]: c_start[k] + n]
            c_start[k] = used
            c_cap[k] = max(FIRST_REGION, n)
            used += c_cap[k]
    return new_tok, new_cnt, used


class CompiledRowIndex:
    """One row's index in arrays, grown here in Python when a compiled call runs out of room."""

    def __init__(self, max_n: int, capacity: int, evict_fraction: float):
        self.max_n, self.capacity = max_n, capacity
        self.evict = max(1, math.ceil(evict_fraction * capacity))
        self.toks = np.zeros(256, dtype=np.int64)
        self.ntoks = 0
        ids = 256
        self.slots = np.full(4 * ids, EMPTY, dtype=np.int64)
        self.key_tok = np.zeros((ids, max_n), dtype=np.int64)
        self.key_len = np.zeros(ids, dtype=np.int64)
        self.key_stamp = np.zeros(ids, dtype=np.int64)
        self.key_slot = np.zeros(ids, dtype=np.int64)
        self.free_ids = np.zeros(ids, dtype=np.int64)
        self.c_start, self.c_len, self.c_cap = (np.zeros(ids, dtype=np.int64) for _ in range(3))
        self.pool_tok = np.zeros(FIRST_REGION * ids, dtype=np.int64)
        self.pool_cnt = np.zeros(FIRST_REGION * ids, dtype=np.int64)
        self.meta = np.zeros(8, dtype=np.int64)
        self.meta[M_N] = 1

    def __len__(self) -> int:
        return int(self.meta[M_LIVE])

    def extend(self, new: np.ndarray) -> None:
        end = self.ntoks + len(new)
        if end > len(self.toks):
            self.toks = np.concatenate([self.toks, np.zeros(max(end, 2 * len(self.toks)) - len(self.toks), np.int64)])
        self.toks[self.ntoks: end] = new
        self.ntoks = end
        self._reserve(len(new))
        while True:
            need = extend(self.toks, end, self.max_n, self.capacity, self.evict, self.slots, self.key_tok,
                          self.key_len, self.key_stamp, self.key_slot, self.free_ids, self.c_start, self.c_len,
                          self.c_cap, self.pool_tok, self.pool_cnt, self.meta)
            if need == DONE:
                return
            if need == NEED_IDS:
                self._grow_ids()
            elif need == NEED_SLOTS:
                self._rehash(max(len(self.slots), 4 * (len(self) + 1)))
            else:
                self._compact()

    def _reserve(self, count: int) -> None:
        """Room, made at once, for the n-grams of ``count`` more tokens (each token at most ``max_n`` new
        ones, up to the capacity). (Where the arrays grew only as the compiled call ran short, a prompt's
        indexing took a call's first draft several growths, rehashes and compactions: a fifth to a third
        of a millisecond on a 2-core Zen 5 EPYC, where a plain step took a tenth.) Continuations that
        outgrow their regions may still need a compaction there."""
        live, ids, free = int(self.meta[M_LIVE]), int(self.meta[M_IDS]), int(self.meta[M_FREE])
        new_keys = max(min(live + self.max_n * count, self.capacity + self.max_n) - live, 0)
        if ids + new_keys - free > len(self.key_len):
            self._grow_ids(ids + new_keys - free - len(self.key_len))
        if 2 * (live + int(self.meta[M_TOMB]) + new_keys + 1) > len(self.slots):
            self._rehash(4 * (live + new_keys + 1))
        if int(self.meta[M_POOL]) + FIRST_REGION * new_keys > len(self.pool_tok):
            self._compact(FIRST_REGION * new_keys)

    def _grow_ids(self, least: int = 1):
        more = max(len(self.key_len), least)
        grow = lambda a: np.concatenate([a, np.zeros((more,) + a.shape[1:], a.dtype)])  # noqa: E731
        for name in ("key_tok", "key_len", "key_stamp", "key_slot", "free_ids", "c_start", "c_len", "c_cap"):
            setattr(self, name, grow(getattr(self, name)))

    def _rehash(self, size: int):
        self.slots = np.full(1 << max(size - 1, 1).bit_length(), EMPTY, dtype=np.int64)
        rehash(self.slots, self.key_len, self.key_tok, self.key_slot, self.meta[M_IDS])
        self.meta[M_TOMB] = 0

    def _compact(self, extra: int = 0):
        """The live regions moved to the pool's front (the pool grown where they fill half of it), with
        room for a move and ``extra`` entries more."""
        live = int((self.c_cap[: self.meta[M_IDS]] * (self.key_len[: self.meta[M_IDS]] > 0)).sum())
        size = max(len(self.pool_tok), 2 * live + 2 * int(self.c_cap.max()) + FIRST_REGION + extra)
        self.pool_tok, self.pool_cnt, used = compact(self.c_start, self.c_len, self.c_cap, self.key_len,
                                                     self.meta[M_IDS], self.pool_tok, self.pool_cnt, size)
        self.meta[M_POOL] = used

    def keys(self) -> list[tuple[int, ...]]:
        ids = np.nonzero(self.key_len[: self.meta[M_IDS]])[0]
        return [tuple(self.key_tok[k, : self.key_len[k]].tolist()) for k in ids]

    def ranked(self, key: tuple[int, ...]) -> list[int]:
        """The continuations of ``key`` ranked (a test's view)."""
        k, _ = find(self.slots, self.key_tok, self.key_len, np.array(key, dtype=np.int64), 0, len(key))
        return [] if k < 0 else self.pool_tok[self.c_start[k]: self.c_start[k] + self.c_len[k]].tolist()

    def continues(self, min_n: int, weak_n: int = -1) -> bool:
        return bool(continues(self.toks, self.ntoks, self.max_n, min_n, self.slots, self.key_tok, self.key_len,
                              self.c_start, self.c_len, self.pool_tok, weak_n))

    def propose(self, min_n: int, weak_n: int, plan, n_nodes: int, out: tuple | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The draft's tokens, validity and weakness ``[n_nodes]`` (as ``ngram.RowIndex.propose``),
        written to ``out`` where given (a row of the caller's arrays)."""
        out_tok, out_ok, out_weak = out if out is not None else (
            np.empty(n_nodes, dtype=np.int64), np.empty(n_nodes, dtype=np.bool_), np.empty(n_nodes, dtype=np.bool_))
        propose(self.toks, self.ntoks, self.max_n, min_n, self.slots, self.key_tok, self.key_len, self.c_start,
                self.c_len, self.pool_tok, plan.nodes, plan.child_at, plan.children, plan.inner, weak_n, out_tok,
                out_ok, out_weak)
        return out_tok, out_ok, out_weak


@functools.cache
def warm() -> None:
    """Run every compiled call of the index once per process, as setup: each loads from numba's
    cache on first use (a few milliseconds each: extending past the first arrays' room, rehashing,
    compacting), which otherwise landed in whichever decoding step first grew an index: often
    ``tree="auto"``'s first probe after plain steps, charged some ten milliseconds, after which
    the choice probed again only hundreds of steps later."""
    from ..tree import TreeShape

    shape = TreeShape.chain(2)
    for capacity in (1 << 16, 64):  # (n-grams past the first arrays' room; then ones evicted)
        index = CompiledRowIndex(4, capacity, 0.5)
        index.extend(np.arange(1200, dtype=np.int64) * 7919 % 4099)  # (distinct n-grams)
        index.extend(np.arange(600, dtype=np.int64) % 7)  # (continuations outgrowing their regions)
        index.propose(1, 1, shape.plan, shape.n)
        index.continues(1)
        index.continues(1, 3)
