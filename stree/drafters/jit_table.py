"""An open-addressing hash table of n-grams for numba-compiled drafters: ``slots`` (a power of
two long, linear probing) holds ``EMPTY``, ``DELETED`` or an id; id ``k``'s n-gram is
``key_tok[k, :key_len[k]]`` (``key_len`` 0: no n-gram). The callers own the arrays and keep the
table at most half full, tombstones included, so that probing always ends.

numba's on-disk cache (``cache=True``) keys a function on its own file only: after editing this
file, delete the ``__pycache__`` entries of ``ngram_jit`` and ``stand_jit`` (or touch those files)
so that their callers are compiled again against it.
"""

from __future__ import annotations

import numpy as np
from numba import njit

EMPTY, DELETED = -1, -2
_MIX = np.uint64(0x9E3779B97F4A7C15)


@njit(cache=True, inline="always")
def slot_of(arr, start, n, mask):
    h = np.uint64(n)
    for i in range(start, start + n):
        h = (h ^ np.uint64(arr[i])) * _MIX
        h ^= h >> np.uint64(29)
    return np.int64(h & np.uint64(mask))


@njit(cache=True)
def find(slots, key_tok, key_len, arr, start, n):
    """(the id of n-gram ``arr[start: start + n]`` or -1, the slot to insert it at)."""
    mask = len(slots) - 1
    s = slot_of(arr, start, n, mask)
    free = -1
    while True:
        k = slots[s]
        if k == EMPTY:
            return -1, (s if free < 0 else free)
        if k == DELETED:
            if free < 0:
                free = s
        elif key_len[k] == n:
            same = True
            for i in range(n):
                if key_tok[k, i] != arr[start + i]:
                    same = False
                    break
            if same:
                return k, s
        s = (s + 1) & mask


@njit(cache=True)
def rehash(slots, key_len, key_tok, key_slot, n_ids):
    """Every live id placed in the (empty) table ``slots``."""
    for k in range(n_ids):
        if key_len[k] > 0:
            _, s = find(slots, key_tok, key_len, key_tok[k], 0, key_len[k])
            slots[s] = k
            key_slot[k] = s
