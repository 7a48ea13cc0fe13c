"""STAND (paper 000): a logit n-gram store of the target's own next-token distributions, and
stochastic tree drafts drawn from it without replacement (the exponential race, i.e. Gumbel-top-k).

The store maps every 1..4-gram of committed context to the running mean of the target's processed
distributions that followed it, truncated to its top-K entries (K = 10). Drafting looks up the
longest matching n-gram of each node's path context and draws the node's children *without
replacement* from the renormalised entry, attaching the entry as the declared law so the verifier
applies recursive rejection sampling (``stree.sampling.verify``: ``without_replacement``).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from ..tree import ShapePlan, TokenTree, TreeBudget, TreeShape, host_array
from .base import DraftContext, Drafter, TargetTop
from .dynamic import Level, SlotRates, grow

__all__ = ["STANDStore", "STANDDrafter", "gumbel_top_k", "race_top_k"]


class STANDStore:
    """Packed logit n-gram store: ``ids`` ``[capacity, top_k]`` int32, ``probs`` ``[capacity, top_k]``
    float32 (an entry's top-K, most likely first, zeros where it has fewer), ``count`` (occurrences
    merged) and ``stamp`` (update clock) per slot; a dict maps an n-gram (a tuple of token ids,
    n = 1..max_n) to its slot.

    Merge of an occurrence into an entry seen k times: over the union of ids (missing ids count 0),
    ``k/(k+1) * old + 1/(k+1) * new``, then re-truncated to the top-K.

    Eviction: when a new n-gram finds no free slot, the ``evict_fraction`` of slots updated least
    recently are freed at once (least-recently-updated first, then in slot order, in batches so a
    full store costs one sort per batch rather than one per insert).

    ``compiled=True`` (the default) keeps the n-gram -> slot map in arrays and runs updates and
    drafts compiled (``stand_jit``); ``False`` is the pure-Python/NumPy reference, tested equal."""

    def __init__(self, capacity: int = 1 << 20, top_k: int = 10, max_n: int = 4, evict_fraction: float = 0.1,
                 compiled: bool = True):
        if capacity < 1 or top_k < 1 or max_n < 1 or not 0 < evict_fraction <= 1:
            raise ValueError(f"need capacity, top_k, max_n >= 1 and 0 < evict_fraction <= 1, got {capacity}, {top_k}, "
                             f"{max_n}, {evict_fraction}")
        self.capacity, self.top_k, self.max_n, self.evict_fraction = capacity, top_k, max_n, evict_fraction
        self.compiled = compiled
        self.ids = torch.zeros(capacity, top_k, dtype=torch.int32)
        self.probs = torch.zeros(capacity, top_k, dtype=torch.float32)
        self.count = torch.zeros(capacity, dtype=torch.int32)
        self.stamp = torch.zeros(capacity, dtype=torch.int64)
        # NumPy views of the same memory: the per-step work is many tiny ops, cheaper in NumPy
        self._np_ids, self._np_probs = self.ids.numpy(), self.probs.numpy()
        self._np_count, self._np_stamp = self.count.numpy(), self.stamp.numpy()
        if compiled:
            from . import stand_jit  # numba compiles (or loads) on first use only

            self._jit = stand_jit
            self._table = np.full(1 << (4 * capacity - 1).bit_length(), stand_jit.EMPTY, dtype=np.int32)
            self._key_tok = np.zeros((capacity, max_n), dtype=np.int32)
            self._key_len = np.zeros(capacity, dtype=np.int64)
            self._key_slot = np.zeros(capacity, dtype=np.int64)
            self._free_stack = np.arange(capacity - 1, -1, -1, dtype=np.int64)
            self._meta = np.zeros(4, dtype=np.int64)
            self._meta[stand_jit.M_FREE] = capacity
        else:
            self._earlier = np.tril(np.ones((2 * top_k, 2 * top_k), dtype=bool), -1)  # [i, j]: j < i
            self._slot: dict[tuple[int, ...], int] = {}
            self._key: list[tuple[int, ...] | None] = [None] * capacity
            self._free = list(range(capacity - 1, -1, -1))
            self._clock = 0

    def __len__(self) -> int:
        return int(self._meta[self._jit.M_LIVE]) if self.compiled else len(self._slot)

    def keys(self) -> list[tuple[int, ...]]:
        """Every n-gram held."""
        if not self.compiled:
            return list(self._slot)
        return [tuple(self._key_tok[s, :n].tolist()) for s, n in enumerate(self._key_len.tolist()) if n]

    def clear(self) -> None:
        """Forget every entry (a new problem)."""
        self.__init__(self.capacity, self.top_k, self.max_n, self.evict_fraction, self.compiled)

    def slot(self, key: tuple[int, ...]) -> int | None:
        if not self.compiled:
            return self._slot.get(key)
        if not 1 <= len(key) <= self.max_n:
            return None
        s, _ = self._jit.find(self._table, self._key_tok, self._key_len, np.array(key, dtype=np.int64), 0, len(key))
        return None if s < 0 else int(s)

    def entry(self, key: tuple[int, ...]):
        """``(ids, probs, count)`` of an n-gram, or None."""
        s = self.slot(tuple(key))
        return None if s is None else (self.ids[s].clone(), self.probs[s].clone(), int(self.count[s]))

    def longest_match(self, context: tuple[int, ...]) -> int | None:
        """Slot of the longest suffix of ``context`` (``max_n`` tokens down to 1) in the store."""
        for n in range(min(self.max_n, len(context)), 0, -1):
            s = self.slot(context[len(context) - n:])
            if s is not None:
                return s
        return None

    def lookup(self, paths: np.ndarray, plens: np.ndarray) -> np.ndarray:
        """:meth:`longest_match` of each ``paths[i, :plens[i]]`` (int64 ``[m, max_n]``, ``[m]``), as
        slots (-1: no match)."""
        if self.compiled:
            return self._jit.longest_many(self._table, self._key_tok, self._key_len, paths, plens, self.max_n)
        found = (self.longest_match(tuple(p[:n].tolist())) for p, n in zip(paths, plens.tolist()))
        return np.array([-1 if s is None else s for s in found], dtype=np.int64)

    def _evict(self, keep: set[int]) -> None:
        n = max(1, math.ceil(self.evict_fraction * self.capacity))
        stamp = self.stamp.clone()
        stamp[list(keep)] = torch.iinfo(torch.int64).max
        for s in torch.argsort(stamp, stable=True)[:n].tolist():
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
        lens = np.array([len(k) for k in keys], dtype=np.int64)
        key_arr = np.zeros((len(keys), max(self.max_n, int(lens.max(initial=0)))), dtype=np.int64)
        for i, k in enumerate(keys):
            key_arr[i, : len(k)] = k
        self.update_arrays(key_arr, lens, ids, probs)

    def observe(self, seq: np.ndarray, start: int, ids: np.ndarray, probs: np.ndarray) -> None:
        """Merge the distribution at each position ``end >= start`` of ``seq`` (row ``end - start``
        of ``ids``/``probs``) under the 1..max_n tokens before it."""
        if len(ids) != len(seq) - start or ids.shape != probs.shape:
            raise ValueError(f"observe needs one (ids, probs) row per position from {start} of {len(seq)}, "
                             f"got {tuple(ids.shape)}, {tuple(probs.shape)}")
        if not self.compiled:
            keys, lens, which = ngram_windows(seq.tolist(), start, self.max_n)
            return self.update_arrays(keys, lens, ids[which], probs[which])
        self._jit.observe(seq, start, self.max_n, ids, probs, *self._compiled_state())

    def _piece(self) -> int:
        """A piece of one update small enough that one eviction batch always frees room for it."""
        return max(1, self.capacity - math.ceil(self.evict_fraction * self.capacity))

    def _compiled_state(self) -> tuple:
        """The compiled update's arguments after the occurrences: eviction sizes, then the arrays."""
        return (self._piece(), math.ceil(self.evict_fraction * self.capacity), self._np_ids, self._np_probs,
                self._np_count, self._np_stamp, self._key_tok, self._key_len, self._key_slot, self._table,
                self._free_stack, self._meta)

    def update_arrays(self, keys: np.ndarray, lens: np.ndarray, ids, probs) -> None:
        """:meth:`update` with n-gram i given as ``keys[i, :lens[i]]``."""
        if not len(lens):
            return
        if lens.min() < 1 or lens.max() > self.max_n:
            raise ValueError(f"keys must have 1..{self.max_n} tokens, got lengths {sorted(set(lens.tolist()))}")
        K = self.top_k
        new_ids = np.asarray(ids)[:, :K].astype(np.int32)
        new_p = np.asarray(probs)[:, :K].astype(np.float32)
        if new_ids.shape[1] < K:
            pad = ((0, 0), (0, K - new_ids.shape[1]))
            new_ids, new_p = np.pad(new_ids, pad), np.pad(new_p, pad)
        if self.compiled:
            return self._jit.update(keys, lens, new_ids, new_p, *self._compiled_state())
        piece = self._piece()
        # Rounds of distinct keys: the r-th occurrence of a key goes in round r.
        keys = [tuple(keys[i, :n].tolist()) for i, n in enumerate(lens.tolist())]
        seen: dict[tuple[int, ...], int] = {}
        rounds: list[list[int]] = []
        for i, k in enumerate(keys):
            r = seen.get(k, 0)
            seen[k] = r + 1
            if r == len(rounds):
                rounds.append([])
            rounds[r].append(i)
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


    def draft(self, tails: list[list[int]], plan: ShapePlan, stochastic: np.ndarray, noise: np.ndarray,
              weak_n: int = 0):
        """Trees for rows whose contexts end with ``tails`` (their last ``max_n`` tokens or fewer):
        each internal node's children are drawn from the entry of the longest n-gram matching its
        path, depth by depth -- for the rows ``stochastic`` marks, without replacement, the race of
        ``probs / noise`` (``noise`` i.i.d. Exp(1), K values per matched node of the level, in
        order, where any row draws); for the others the top entries. Returns tokens, valid, weak
        (the other rows' nodes drawn from the entry of an n-gram of at most ``weak_n`` tokens: a
        random draft's size must not depend on its draws, so its nodes are never marked), child_ids,
        child_probs and the noise values used."""
        b, n, K = len(tails), plan.shape.n, self.top_k
        # (not np.broadcast_to, a Python function of a dozen NumPy calls: a tenth of a draft's time)
        flags = np.asarray(stochastic, dtype=np.bool_)
        stochastic = np.full(b, bool(flags)) if flags.ndim == 0 else np.ascontiguousarray(flags).reshape(b)
        tokens, valid, weak = np.zeros((b, n), dtype=np.int64), np.zeros((b, n), dtype=bool), np.zeros((b, n), bool)
        child_ids, child_probs = np.zeros((b, n, K), dtype=np.int64), np.zeros((b, n, K), dtype=np.float32)
        if self.compiled:
            tail_arr = np.zeros((b, self.max_n), dtype=np.int64)
            for i, t in enumerate(tails):
                tail_arr[i, : len(t)] = t
            used = self._jit.draft(tail_arr, np.array([len(t) for t in tails], dtype=np.int64), plan.nodes, plan.level_at,
                                   plan.child_at, plan.children, plan.inner,
                                   stochastic, noise, self.max_n, self._np_ids, self._np_probs, self._table,
                                   self._key_tok, self._key_len, weak_n, tokens, valid, weak, child_ids, child_probs)
            return tokens, valid, weak, child_ids, child_probs, used
        paths: dict[tuple[int, int], tuple[int, ...]] = {}
        for i, tail in enumerate(tails):
            paths[i, 0] = tuple(tail)
            tokens[i, 0], valid[i, 0] = tail[-1], True
        used = 0
        for level in plan.levels:
            # every (row, node) of this depth that can have children, with its store slot
            todo = [(i, v, self.longest_match(paths[i, v])) for v in level for i in range(b) if (i, v) in paths]
            todo = [t for t in todo if t[2] is not None]
            if not todo:
                continue
            rows, nodes, slots = zip(*todo)
            ids, probs = self._np_ids[list(slots)], self._np_probs[list(slots)]
            child_ids[rows, nodes], child_probs[rows, nodes] = ids, probs
            width = min(K, max(len(plan.kids[v]) for v in nodes))  # children past K stay invalid
            order = np.argsort(-probs, axis=1, kind="stable")[:, :width]
            if stochastic.any():
                drawn = race_top_k(probs, width, noise[used: used + probs.size].reshape(probs.shape))
                order = np.where(stochastic[list(rows)][:, None], drawn, order)
                used += probs.size
            at = np.arange(len(todo))[:, None]
            drawn_ids, drawn_p = ids[at, order].tolist(), probs[at, order].tolist()
            for j, (i, v, slot) in enumerate(todo):
                short = len(self._key[slot]) <= weak_n  # (the n-gram whose entry the children come from)
                for r, c in enumerate(plan.kids[v][:width]):
                    if drawn_p[j][r] > 0:
                        tokens[i, c], valid[i, c] = drawn_ids[j][r], True
                        weak[i, c] = not stochastic[i] and short
                        paths[i, c] = (paths[i, v] + (drawn_ids[j][r],))[-self.max_n:]
        return tokens, valid, weak, child_ids, child_probs, used


def ngram_windows(seq: list[int], start: int, max_n: int):
    """For each position ``end >= start`` of ``seq`` and n = 1..min(max_n, end), in that order: the
    n-gram ``seq[end - n: end]`` that the distribution at ``end`` followed (``keys [m, max_n]``,
    left-aligned, and ``lens [m]``) and ``end - start`` (``which [m]``)."""
    keys, lens, which = [], [], []
    for end in range(start, len(seq)):
        for n in range(1, min(max_n, end) + 1):
            keys.append(seq[end - n: end] + [0] * (max_n - n))
            lens.append(n)
            which.append(end - start)
    return (np.array(keys, dtype=np.int64).reshape(-1, max_n), np.array(lens, dtype=np.int64),
            np.array(which, dtype=np.int64))


def race_top_k(probs: np.ndarray, k: int, noise: np.ndarray) -> np.ndarray:
    """Indices ``[m, k]`` of k draws without replacement from the renormalised rows of ``probs``
    ``[m, K]``, in draw order: the k largest ``probs / noise`` with ``noise`` i.i.d. Exp(1) (the
    exponential race; the same as Gumbel-top-k, ``log p - log E`` being ``log p`` plus Gumbel
    noise, but a division rounds the same everywhere, so compiled and reference drafts agree
    bit for bit). Entries with probability 0 are never drawn before the positive ones."""
    return np.argsort(-(probs / noise), axis=1, kind="stable")[:, :k]


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
    node's path context; ``stochastic=True`` draws them without replacement by the exponential race
    (noise from a buffer of ``noise_size`` fresh Exp(1) values, regenerated when used up, no value used
    twice) and attaches the entry as the children's law; ``stochastic=False`` takes the top-k by
    stored probability (deterministic drafts, one-hot verification), as the rows the context marks
    greedy (``DraftContext.greedy``) take it under ``stochastic=True``. Slots beyond the entry's
    nonzero candidates, and subtrees of nodes without a match, are invalid. A deterministic row's
    nodes drawn from the entry of an n-gram shorter than ``max_n`` are weak (``TokenTree.weak``):
    drafting chains for the shipped target on its held-out prompts, the nodes of a four-token entry
    were accepted at 94-97%, of a shorter one at 45-75%, whatever their stored probability.

    ``learn=False`` leaves the store unchanged (a fixed or deliberately stale store). Every emitted
    token's distribution is inserted (the prefill's first token included); prompt positions are
    not, as no distribution was computed for them.

    A :class:`TreeBudget` in place of ``shape`` grows each row's tree from the store's path
    probabilities (:mod:`stree.drafters.dynamic`); children are drawn as in a static shape."""

    dynamic = True
    # After a plain step the store learns the emitted token alone (a one-hot law, which the running
    # mean of an entry turns into the tokens' frequencies): plain steps, chosen where speculation
    # does not pay, must cost what autoregressive steps cost, and the target's top-K is most of the
    # difference (its softmax, top-K and a larger transfer each step).
    plain_target = False

    def __init__(self, store: STANDStore, shape: TreeShape | None = None, stochastic: bool = True, seed: int = 0,
                 noise_size: int = 1 << 16, learn: bool = True):
        self.store, self.shape, self.stochastic, self.learn = store, shape, stochastic, learn
        self.target_top_k = store.top_k if learn else None
        self.generator = torch.Generator().manual_seed(seed)
        self._noise = np.empty(0)
        self._noise_size = noise_size
        self._pos = 0
        self.rates = SlotRates()  # learned acceptance for calibrated TreeBudgets, kept across calls
        self._ones_kept = np.ones((0, 1), np.float32)  # (_ones)

    def reset(self) -> None:
        self.rates.forget()

    def for_measuring(self) -> "STANDDrafter":
        """The same drafter over a fresh, empty store of the same sizes (its own store outlives
        every call)."""
        store = self.store
        fresh = STANDStore(store.capacity, store.top_k, store.max_n, store.evict_fraction, store.compiled)
        return STANDDrafter(fresh, self.shape, self.stochastic, learn=self.learn)

    @property
    def random_drafts(self) -> bool:
        return self.stochastic

    def reseed(self, seed: int) -> None:
        super().reseed(seed)
        self._noise, self._pos = np.empty(0), 0  # drawn from the old stream

    def build(self, shapes, batch: int) -> None:
        """Load the store's compiled calls (:func:`_warm`): setup, not a decoding step's."""
        if self.store.compiled:
            _warm(self.store.top_k, self.store.max_n)

    def _noise_window(self, n: int) -> np.ndarray:
        """The next ``n`` unused Exp(1) values (a fresh buffer when fewer are left); the caller
        marks how many it used (``_pos``), so no value serves twice."""
        if self._pos + n > len(self._noise):
            size = max(self._noise_size, n)
            u = torch.rand(size, generator=self.generator, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
            self._noise, self._pos = (-u.log()).numpy(), 0
        return self._noise[self._pos: self._pos + n]

    def propose(self, context: DraftContext, shape: TreeShape | TreeBudget | None = None) -> TokenTree:
        shape = self.tree_shape(shape)
        if isinstance(shape, TreeBudget):
            return self._grow(context, shape)
        plan = shape.plan
        tokens, lengths = context.arrays()  # NumPy: a torch index costs more than a NumPy one
        max_n = self.store.max_n
        tails = [tokens[r, max(0, int(lengths[r]) - max_n): int(lengths[r])].tolist() for r in context.rows]
        bound = len(tails) * len(plan.nodes) * self.store.top_k  # K values per matched node at most
        random = context.random_rows(self.stochastic)
        noise = self._noise_window(bound) if random.any() else np.empty(0)
        tokens, valid, weak, child_ids, child_probs, used = self.store.draft(tails, plan, random, noise, max_n - 1)
        self._pos += used
        if not random.any():
            return TokenTree.from_arrays(shape, tokens, valid, weak)
        return TokenTree.from_shape(shape, torch.from_numpy(tokens), valid=torch.from_numpy(valid),
                                    child_ids=torch.from_numpy(child_ids), child_probs=torch.from_numpy(child_probs),
                                    weak=weak)

    def _tails(self, context: DraftContext) -> tuple[np.ndarray, np.ndarray]:
        """Each row's last ``max_n`` tokens (or fewer), left-aligned, and how many."""
        max_n = self.store.max_n
        tokens, lengths = context.arrays()
        paths = np.zeros((len(context), max_n), dtype=np.int64)
        plens = np.zeros(len(context), dtype=np.int64)
        for i, r in enumerate(context.rows):
            tail = tokens[r, max(0, int(lengths[r]) - max_n): int(lengths[r])]
            paths[i, : len(tail)], plens[i] = tail, len(tail)
        return paths, plens

    def can_draft(self, context: DraftContext) -> bool:
        """Whether some row's last tokens match an n-gram of the store with a law (else every
        row's tree, static or grown, is its root alone)."""
        slots, probs = self.store.lookup(*self._tails(context)), self.store._np_probs
        return any(s >= 0 and probs[s, 0] > 0 for s in slots.tolist())  # (a few rows: NumPy's small calls cost more)

    def _grow(self, context: DraftContext, budget: TreeBudget) -> TokenTree:
        """A dynamic tree: each kept node's law is the entry of the longest n-gram matching its
        path (none: no children), its children drawn by the race as in a static shape."""
        max_n = self.store.max_n
        paths, plens = self._tails(context)  # each node's last max_n tokens, left-aligned
        roots = paths[np.arange(len(context)), plens - 1]

        def expand(level: Level):
            nonlocal paths, plens
            if level.parent_pos is not None:  # a child's path: its parent's, shifted, then its token
                p, n = paths[level.parent_pos], plens[level.parent_pos]
                full = n == max_n
                p[full] = np.roll(p[full], -1, axis=1)
                n = np.minimum(n + 1, max_n)
                p[np.arange(len(n)), n - 1] = level.tokens
                paths, plens = p, n
            slots = self.store.lookup(paths, plens)
            found = slots >= 0
            ids = np.where(found[:, None], self.store._np_ids[slots], 0).astype(np.int64)
            probs = np.where(found[:, None], self.store._np_probs[slots], 0.0)
            return ids, probs

        return grow(budget, roots, expand, self._draw_order, context.random_rows(self.stochastic), self.rates,
                    context.rows)

    def _draw_order(self, probs: np.ndarray) -> np.ndarray:
        """Each entry's K candidates in the order of draws: the race over fresh noise."""
        order = race_top_k(probs, probs.shape[1], self._noise_window(probs.size).reshape(probs.shape))
        self._pos += probs.size
        return order

    def observe(self, context: DraftContext, tokens, target) -> None:
        self.rates.record(context.rows, tokens)
        if not self.learn:
            return
        max_n = self.store.max_n
        tokens_np, lengths = context.arrays()
        for i, (r, emitted) in enumerate(zip(context.rows, tokens)):  # row by row, in batch order
            length, m = int(lengths[r]), len(emitted)
            start = max(0, length - max_n)
            # The decoding loop hands the tokens it has just appended to the row: then the window is a view of
            # the row, the tokens' own array too (copied, with the ones of a plain step's law, they took about
            # half of an observed token's time right after a model pass, at every step a tree or a plain step
            # weighed alone)
            seq = tokens_np[r, start: length + m]
            if len(seq) != length + m - start or seq[length - start:].tolist() != list(emitted):
                seq = np.concatenate([tokens_np[r, start: length], np.asarray(emitted, dtype=np.int64)])
            if target is None:  # a plain step: the emitted tokens alone
                ids, probs = seq[len(seq) - m:, None], self._ones(m)
            else:
                ids, probs = host_array(target[i].ids), host_array(target[i].probs)
            self.store.observe(seq, len(seq) - m, ids, probs)

    def _ones(self, m: int) -> np.ndarray:
        """``[m, 1]`` float32 ones (a plain step's law of each emitted token), a view of an array kept."""
        if len(self._ones_kept) < m:
            self._ones_kept = np.ones((max(m, 2 * len(self._ones_kept)), 1), np.float32)
        return self._ones_kept[:m]


@functools.cache
def _warm(top_k: int, max_n: int) -> None:
    """Run a small store through every compiled call once per process: each loads from numba's
    cache on first use (a first draft hundreds of times a later one's time: docs/decoding.md),
    which otherwise landed inside the first decoding steps of a process whose cost profile was
    read from its file (``tree="auto"`` learning from such a step priced trees or plain steps
    wrongly)."""
    store = STANDStore(capacity=64, top_k=top_k, max_n=max_n)  # (small: it evicts)
    drafter = STANDDrafter(store, TreeShape.paper13())
    seq = torch.arange(160).mul(7919).remainder(4099)[None]  # (distinct n-grams)
    for start in range(8, 150, 2):
        context = DraftContext(seq, torch.tensor([start]), [0], greedy=np.array([start % 4 == 0]))
        drafter.propose(context)
        drafter.propose(context, TreeBudget(8))
        emitted = [seq[0, start: start + 2].tolist()]
        laws = [TargetTop(torch.arange(2 * top_k).view(2, top_k), torch.full((2, top_k), 1.0 / top_k),
                          torch.full((2,), 1.0 / top_k))]
        drafter.observe(context, emitted, laws if start % 3 else None)
