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

    def update(self, keys: list[tuple[int, ...]], ids: torch.Tensor, probs: torch.Tensor) -> None:
        """Merge occurrence i (``ids[i]``, ``probs[i]``: a distribution's top entries, most likely
        first) into ``keys[i]``, in list order (a key occurring twice is merged twice, in order)."""
        if len(keys) != len(ids) or ids.shape != probs.shape:
            raise ValueError(f"update needs one (ids, probs) row per key, got {len(keys)} keys, {tuple(ids.shape)}, "
                             f"{tuple(probs.shape)}")
        if not keys:
            return
        K = self.top_k
        new_ids, new_p = ids[:, :K].to(torch.int32), probs[:, :K].float()
        if new_ids.shape[1] < K:
            pad = K - new_ids.shape[1]
            new_ids = torch.cat([new_ids, torch.zeros(len(keys), pad, dtype=torch.int32)], 1)
            new_p = torch.cat([new_p, torch.zeros(len(keys), pad)], 1)
        # Rounds of distinct keys: the r-th occurrence of a key goes in round r.
        keys = [tuple(int(t) for t in k) for k in keys]
        seen: dict[tuple[int, ...], int] = {}
        rounds: list[list[int]] = []
        for i, k in enumerate(keys):
            r = seen.get(k, 0)
            seen[k] = r + 1
            if r == len(rounds):
                rounds.append([])
            rounds[r].append(i)
        for members in rounds:
            self._clock += 1
            slots = torch.tensor(self._slots_for([keys[i] for i in members]))
            rows = torch.tensor(members)
            k = self.count[slots].float()[:, None]
            all_ids = torch.cat([self.ids[slots], new_ids[rows]], 1)
            weight = torch.cat([self.probs[slots] * (k / (k + 1)), new_p[rows] / (k + 1)], 1)
            same = all_ids[:, :, None] == all_ids[:, None, :]
            total = (same * weight[:, None, :]).sum(-1)
            earlier = torch.ones(2 * K, 2 * K, dtype=torch.bool).tril(-1)
            first = ~(same & earlier).any(-1)  # each id once, at its first position
            score, pick = torch.topk(torch.where(first, total, -1.0), K, dim=1)
            self.ids[slots] = all_ids.gather(1, pick)
            self.probs[slots] = score.clamp_min(0)
            self.count[slots] += 1
            self.stamp[slots] = self._clock


def gumbel_top_k(probs: torch.Tensor, k: int, noise: torch.Tensor) -> torch.Tensor:
    """Indices ``[m, k]`` of k draws without replacement from the renormalised rows of ``probs``
    ``[m, K]``, in draw order: the top-k of ``log probs + noise`` with ``noise`` i.i.d. Gumbel(0, 1).
    Entries with probability 0 are never drawn before the positive ones (they rank last)."""
    return torch.topk(probs.log() + noise, k, dim=1).indices


class STANDDrafter(Drafter):
    """Tree drafts from a :class:`STANDStore`, which it also feeds from the verify passes.

    Each node's children: the entry of the longest n-gram (``max_n`` down to 1) matching the
    node's path context; ``stochastic=True`` draws them by Gumbel-top-k without replacement (noise
    from a buffer of ``noise_size`` fresh Gumbel values, regenerated when used up, no value used
    twice) and attaches the entry as the children's law; ``stochastic=False`` takes the top-k by
    stored probability (deterministic drafts, one-hot verification). Slots beyond the entry's
    nonzero candidates, and subtrees of nodes without a match, are invalid.

    ``learn=False`` leaves the store unchanged (a fixed or deliberately stale store). Only verify
    steps are inserted (no prefill positions)."""

    def __init__(self, store: STANDStore, shape: TreeShape | None = None, stochastic: bool = True, seed: int = 0,
                 noise_size: int = 1 << 16, learn: bool = True):
        self.store, self.shape, self.stochastic, self.learn = store, shape, stochastic, learn
        self.target_top_k = store.top_k if learn else 0
        self.generator = torch.Generator().manual_seed(seed)
        self._noise = torch.empty(0)
        self._noise_size = noise_size
        self._pos = 0
        self._tails: dict[int, tuple[int, ...]] = {}

    def reset(self) -> None:
        self._tails = {}

    def _take_noise(self, n: int) -> torch.Tensor:
        if self._pos + n > len(self._noise):
            size = max(self._noise_size, n)
            u = torch.rand(size, generator=self.generator, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
            self._noise, self._pos = (-(-u.log()).log()).float(), 0
        out = self._noise[self._pos: self._pos + n]
        self._pos += n
        return out

    def propose(self, context: DraftContext, shape: TreeShape | None = None) -> TokenTree:
        shape = shape or self.shape
        if shape is None:
            raise ValueError("STANDDrafter needs a tree shape (at construction or per call)")
        b, n, K, store = len(context), shape.n, self.store.top_k, self.store
        kids = shape.children()
        tokens = torch.zeros(b, n, dtype=torch.long)
        valid = torch.zeros(b, n, dtype=torch.bool)
        child_ids = torch.zeros(b, n, K, dtype=torch.long)
        child_probs = torch.zeros(b, n, K)
        paths: dict[tuple[int, int], tuple[int, ...]] = {}
        for i in range(b):
            tail = tuple(context.row(i, start=max(0, int(context.lengths[context.rows[i]]) - store.max_n)))
            self._tails[context.rows[i]] = tail
            paths[i, 0] = tail
            tokens[i, 0], valid[i, 0] = tail[-1], True
        for level in _levels(shape):
            # every (row, node) of this depth that can have children, with its store slot
            todo = [(i, v, store.longest_match(paths[i, v])) for v in level if kids[v] for i in range(b) if (i, v) in paths]
            todo = [t for t in todo if t[2] is not None]
            if not todo:
                continue
            slots = torch.tensor([s for _, _, s in todo])
            ids, probs = store.ids[slots].long(), store.probs[slots]
            width = min(K, max(len(kids[v]) for _, v, _ in todo))  # children past K stay invalid
            if self.stochastic:
                order = gumbel_top_k(probs, width, self._take_noise(probs.numel()).view_as(probs))
            else:
                order = torch.topk(probs, width, dim=1).indices
            drawn_ids, drawn_p = ids.gather(1, order).tolist(), probs.gather(1, order).tolist()
            for j, (i, v, _) in enumerate(todo):
                child_ids[i, v], child_probs[i, v] = ids[j], probs[j]
                for r, c in enumerate(kids[v][:width]):
                    if drawn_p[j][r] > 0:
                        tokens[i, c], valid[i, c] = drawn_ids[j][r], True
                        paths[i, c] = (paths[i, v] + (drawn_ids[j][r],))[-store.max_n:]
        if not self.stochastic:
            return TokenTree(shape.parents_tensor(), tokens, valid)
        return TokenTree(shape.parents_tensor(), tokens, valid, child_ids=child_ids, child_probs=child_probs)

    def observe(self, rows, tokens, target_top) -> None:
        if not self.learn:
            return
        keys, ids, probs = [], [], []
        for row, emitted, (top_i, top_p) in zip(rows, tokens, target_top):
            seq = self._tails.get(row, ()) + tuple(emitted)
            start = len(seq) - len(emitted)
            for t in range(len(emitted)):
                end = start + t  # the distribution at position t followed seq[:end]
                for n in range(1, min(self.store.max_n, end) + 1):
                    keys.append(seq[end - n: end])
                    ids.append(top_i[t])
                    probs.append(top_p[t])
            self._tails[row] = seq[-self.store.max_n:]
        if keys:
            self.store.update(keys, torch.stack(ids), torch.stack(probs))


def _levels(shape: TreeShape) -> list[list[int]]:
    levels: list[list[int]] = [[] for _ in range(shape.max_depth + 1)]
    for v, d in enumerate(shape.depth):
        levels[d].append(v)
    return levels
