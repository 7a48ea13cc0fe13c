"""STAND (paper 000): a logit n-gram store of the target's own next-token distributions, and
stochastic tree drafts drawn from it by Gumbel-top-k without replacement.

The store maps every 1..4-gram of committed context to the running mean of the target's processed
distributions that followed it, truncated to its top-K entries (K = 10). Drafting looks up the
longest matching n-gram of each node's path context and draws the node's children *without
replacement* from the renormalised entry, attaching the entry as the declared law so the verifier
applies recursive rejection sampling (``stree.verify``: ``without_replacement``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..tree import TokenTree, TreeShape
from .base import DraftContext, Drafter

__all__ = ["STANDStore", "STANDDrafter", "gumbel_top_k"]


class STANDStore:
    """Packed logit n-gram store: ``ids`` ``[capacity, top_k]`` int32, ``probs`` ``[capacity, top_k]``
    float32 (an entry's top-K, most likely first, zeros where it has fewer), ``count`` (occurrences
    merged) and ``stamp`` (update clock) per slot; a dict maps an n-gram (a tuple of token ids,
    n = 1..max_n) to its slot.

    Merge of an occurrence into an entry seen k times: over the union of ids (missing ids count 0),
    ``k/(k+1) * old + 1/(k+1) * new``, then re-truncated to the top-K.

    Eviction: when a new n-gram finds no free slot, the ``evict_fraction`` of slots updated least
    recently are freed at once (least-recently-updated first, in batches so a full store costs one
    sort per batch rather than one per insert)."""

    def __init__(self, capacity: int = 1 << 20, top_k: int = 10, max_n: int = 4, evict_fraction: float = 0.1):
        if capacity < 1 or top_k < 1 or max_n < 1 or not 0 < evict_fraction <= 1:
            raise ValueError(f"need capacity, top_k, max_n >= 1 and 0 < evict_fraction <= 1, got {capacity}, {top_k}, "
                             f"{max_n}, {evict_fraction}")
        self.capacity, self.top_k, self.max_n, self.evict_fraction = capacity, top_k, max_n, evict_fraction
        self.ids = torch.zeros(capacity, top_k, dtype=torch.int32)
        self.probs = torch.zeros(capacity, top_k, dtype=torch.float32)
        self.count = torch.zeros(capacity, dtype=torch.int32)
        self.stamp = torch.zeros(capacity, dtype=torch.int64)
        # NumPy views of the same memory: the per-step work is many tiny ops, cheaper in NumPy
        self._np_ids, self._np_probs = self.ids.numpy(), self.probs.numpy()
        self._np_count, self._np_stamp = self.count.numpy(), self.stamp.numpy()
        self._earlier = np.tril(np.ones((2 * top_k, 2 * top_k), dtype=bool), -1)  # [i, j]: j < i
        self._slot: dict[tuple[int, ...], int] = {}
        self._key: list[tuple[int, ...] | None] = [None] * capacity
        self._free = list(range(capacity - 1, -1, -1))
        self._clock = 0

    def __len__(self) -> int:
        return len(self._slot)

    def clear(self) -> None:
        """Forget every entry (a new problem)."""
        self.__init__(self.capacity, self.top_k, self.max_n, self.evict_fraction)

    def slot(self, key: tuple[int, ...]) -> int | None:
        return self._slot.get(key)

    def entry(self, key: tuple[int, ...]):
        """``(ids, probs, count)`` of an n-gram, or None."""
        s = self._slot.get(tuple(key))
        return None if s is None else (self.ids[s].clone(), self.probs[s].clone(), int(self.count[s]))

    def longest_match(self, context: tuple[int, ...]) -> int | None:
        """Slot of the longest suffix of ``context`` (``max_n`` tokens down to 1) in the store."""
        for n in range(min(self.max_n, len(context)), 0, -1):
            s = self._slot.get(context[len(context) - n:])
            if s is not None:
                return s
        return None

    def _evict(self, keep: set[int]) -> None:
        n = max(1, math.ceil(self.evict_fraction * self.capacity))
        stamp = self.stamp.clone()
        stamp[list(keep)] = torch.iinfo(torch.int64).max
        for s in torch.argsort(stamp)[:n].tolist():
            if s in keep or self._key[s] is None:
                continue
            del self._slot[self._key[s]]
            self._key[s] = None
            self.count[s], self.ids[s], self.probs[s] = 0, 0, 0.0
            self._free.append(s)

    def _slots_for(self, keys: list[tuple[int, ...]]) -> list[int]:
        present = {self._slot[k] for k in keys if k in self._slot}
        slots = []
        for k in keys:
            s = self._slot.get(k)
            if s is None:
                if not self._free:
                    self._evict(present | set(slots))
                s = self._free.pop()
                self._slot[k], self._key[s] = s, k
            slots.append(s)
        return slots

    def update(self, keys: list[tuple[int, ...]], ids, probs) -> None:
        """Merge occurrence i (``ids[i]``, ``probs[i]``: a distribution's top entries, most likely
        first; CPU tensors or NumPy arrays) into ``keys[i]``, in list order (a key occurring twice is
        merged twice, in order)."""
        if len(keys) != len(ids) or ids.shape != probs.shape:
            raise ValueError(f"update needs one (ids, probs) row per key, got {len(keys)} keys, {tuple(ids.shape)}, "
                             f"{tuple(probs.shape)}")
        if not keys:
            return
        K = self.top_k
        new_ids = np.asarray(ids)[:, :K].astype(np.int32)
        new_p = np.asarray(probs)[:, :K].astype(np.float32)
        if new_ids.shape[1] < K:
            pad = ((0, 0), (0, K - new_ids.shape[1]))
            new_ids, new_p = np.pad(new_ids, pad), np.pad(new_p, pad)
        # Rounds of distinct keys: the r-th occurrence of a key goes in round r.
        keys = [tuple(map(int, k)) for k in keys]
        seen: dict[tuple[int, ...], int] = {}
        rounds: list[list[int]] = []
        for i, k in enumerate(keys):
            r = seen.get(k, 0)
            seen[k] = r + 1
            if r == len(rounds):
                rounds.append([])
            rounds[r].append(i)
        # A piece small enough that one eviction batch always frees room for it.
        piece = max(1, self.capacity - math.ceil(self.evict_fraction * self.capacity))
        for members in (r[j: j + piece] for r in rounds for j in range(0, len(r), piece)):
            self._clock += 1
            slots = np.array(self._slots_for([keys[i] for i in members]))
            k = self._np_count[slots].astype(np.float32)[:, None]
            all_ids = np.concatenate([self._np_ids[slots], new_ids[members]], 1)
            weight = np.concatenate([self._np_probs[slots] * k, new_p[members]], 1) / (k + 1)
            same = all_ids[:, :, None] == all_ids[:, None, :]
            total = (same * weight[:, None, :]).sum(-1)
            first = ~(same & self._earlier).any(-1)  # each id once, at its first position
            score = np.where(first, total, -1.0)
            pick = np.argsort(-score, axis=1, kind="stable")[:, :K]
            at = np.arange(len(members))[:, None]
            self._np_ids[slots] = all_ids[at, pick]
            self._np_probs[slots] = score[at, pick].clip(0, None)
            self._np_count[slots] += 1
            self._np_stamp[slots] = self._clock


def gumbel_top_k(probs, k: int, noise):
    """Indices ``[m, k]`` of k draws without replacement from the renormalised rows of ``probs``
    ``[m, K]``, in draw order: the top-k of ``log probs + noise`` with ``noise`` i.i.d. Gumbel(0, 1).
    Entries with probability 0 are never drawn before the positive ones (they rank last). Takes
    (and returns) CPU tensors or NumPy arrays."""
    if isinstance(probs, torch.Tensor):
        return torch.from_numpy(gumbel_top_k(probs.numpy(), k, noise.numpy()))
    with np.errstate(divide="ignore"):
        keys = np.log(probs) + noise
    return np.argsort(-keys, axis=1, kind="stable")[:, :k]


class STANDDrafter(Drafter):
    """Tree drafts from a :class:`STANDStore`, which it also feeds from the verify passes.

    Each node's children: the entry of the longest n-gram (``max_n`` down to 1) matching the
    node's path context; ``stochastic=True`` draws them by Gumbel-top-k without replacement (noise
    from a buffer of ``noise_size`` fresh Gumbel values, regenerated when used up, no value used
    twice) and attaches the entry as the children's law; ``stochastic=False`` takes the top-k by
    stored probability (deterministic drafts, one-hot verification). Slots beyond the entry's
    nonzero candidates, and subtrees of nodes without a match, are invalid.

    ``learn=False`` leaves the store unchanged (a fixed or deliberately stale store). Every emitted
    token's distribution is inserted (the prefill's first token included); prompt positions are
    not, as no distribution was computed for them."""

    def __init__(self, store: STANDStore, shape: TreeShape | None = None, stochastic: bool = True, seed: int = 0,
                 noise_size: int = 1 << 16, learn: bool = True):
        self.store, self.shape, self.stochastic, self.learn = store, shape, stochastic, learn
        self.target_top_k = store.top_k if learn else 0
        self.generator = torch.Generator().manual_seed(seed)
        self._noise = np.empty(0, dtype=np.float32)
        self._noise_size = noise_size
        self._pos = 0
        self._planned = None

    def _plan(self, shape: TreeShape):
        """The shape's children and its nodes by depth (cached: the same shape comes every step)."""
        if self._planned is None or self._planned[0] != shape:
            levels: list[list[int]] = [[] for _ in range(shape.max_depth + 1)]
            for v, d in enumerate(shape.depth):
                levels[d].append(v)
            self._planned = (shape, shape.children(), levels)
        return self._planned[1:]

    def reseed(self, seed: int) -> None:
        super().reseed(seed)
        self._noise, self._pos = np.empty(0, dtype=np.float32), 0  # drawn from the old stream

    def _take_noise(self, n: int) -> np.ndarray:
        if self._pos + n > len(self._noise):
            size = max(self._noise_size, n)
            u = torch.rand(size, generator=self.generator, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
            self._noise, self._pos = (-(-u.log()).log()).float().numpy(), 0
        out = self._noise[self._pos: self._pos + n]
        self._pos += n
        return out

    def propose(self, context: DraftContext, shape: TreeShape | None = None) -> TokenTree:
        shape = self.tree_shape(shape)
        b, n, K, store = len(context), shape.n, self.store.top_k, self.store
        kids, levels = self._plan(shape)
        # NumPy while filling (many tiny writes), handed to torch without a copy
        tokens = np.zeros((b, n), dtype=np.int64)
        valid = np.zeros((b, n), dtype=bool)
        child_ids = np.zeros((b, n, K), dtype=np.int64)
        child_probs = np.zeros((b, n, K), dtype=np.float32)
        paths: dict[tuple[int, int], tuple[int, ...]] = {}
        for i in range(b):
            tail = tuple(context.row(i, start=max(0, int(context.lengths[context.rows[i]]) - store.max_n)))
            paths[i, 0] = tail
            tokens[i, 0], valid[i, 0] = tail[-1], True
        for level in levels:
            # every (row, node) of this depth that can have children, with its store slot
            todo = [(i, v, store.longest_match(paths[i, v])) for v in level if kids[v] for i in range(b) if (i, v) in paths]
            todo = [t for t in todo if t[2] is not None]
            if not todo:
                continue
            rows, nodes, slots = zip(*todo)
            ids, probs = store._np_ids[list(slots)], store._np_probs[list(slots)]
            child_ids[rows, nodes], child_probs[rows, nodes] = ids, probs
            width = min(K, max(len(kids[v]) for v in nodes))  # children past K stay invalid
            if self.stochastic:
                order = gumbel_top_k(probs, width, self._take_noise(probs.size).reshape(probs.shape))
            else:
                order = np.argsort(-probs, axis=1, kind="stable")[:, :width]
            at = np.arange(len(todo))[:, None]
            drawn_ids, drawn_p = ids[at, order].tolist(), probs[at, order].tolist()
            for j, (i, v, _) in enumerate(todo):
                for r, c in enumerate(kids[v][:width]):
                    if drawn_p[j][r] > 0:
                        tokens[i, c], valid[i, c] = drawn_ids[j][r], True
                        paths[i, c] = (paths[i, v] + (drawn_ids[j][r],))[-store.max_n:]
        tokens, valid = torch.from_numpy(tokens), torch.from_numpy(valid)
        if not self.stochastic:
            return TokenTree.from_shape(shape, tokens, valid=valid)
        return TokenTree.from_shape(shape, tokens, valid=valid, child_ids=torch.from_numpy(child_ids),
                         child_probs=torch.from_numpy(child_probs))

    def observe(self, context: DraftContext, tokens, target) -> None:
        if not self.learn:
            return
        keys, ids, probs = [], [], []
        max_n = self.store.max_n
        for i, (emitted, top) in enumerate(zip(tokens, target)):
            length = int(context.lengths[context.rows[i]])
            seq = tuple(context.row(i, start=max(0, length - max_n))) + tuple(emitted)
            start = len(seq) - len(emitted)
            which = []  # the emitted position whose distribution each key gets
            for t in range(len(emitted)):
                end = start + t  # the distribution at position t followed seq[:end]
                for n in range(1, min(max_n, end) + 1):
                    keys.append(seq[end - n: end])
                    which.append(t)
            ids.append(top.ids.numpy()[which])
            probs.append(top.probs.numpy()[which])
        if keys:
            self.store.update(keys, np.concatenate(ids), np.concatenate(probs))
