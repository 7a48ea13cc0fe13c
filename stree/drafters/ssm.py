"""A small language model as the drafter (paper 001 §5.2): its own committed cache follows the
rows, and it drafts a tree with its own tree forwards, so it never rolls back.

Any model with the decoding protocol works (``allocate_cache``, ``prefill`` continuing from what
the cache holds, ``step``, ``forward_tree`` returning logits and a pass handle, ``commit`` of that
handle; ``draft_greedy`` where it has one): a distilled 1-2 layer Mamba2 in practice, an exact Markov
table in the tests.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from ..tree import TokenTree, TreeBudget, TreeShape
from .base import DraftContext, Drafter
from .dynamic import Level, SlotRates, grow
from .stand import gumbel_top_k

__all__ = ["SSMDrafter"]

# New tokens up to this many per row (the same count in every row) go in as steps, not as a chain
# pass and commit: for the shipped 1-layer drafter on the CPU two steps measured faster than a
# 2-token chain pass and its commit, compiled and eager alike.
STEPS_UP_TO = 2
# The share of the vocabulary, most frequent first, that greedy drafts in one call choose among, where the
# drafter's checkpoint ranks its tokens (draft_vocab.json): the head is most of a small drafter's step,
# and the shipped target's greedy tokens were the drafter's top one among the most frequent quarter
# nearly as often as among them all (docs/kernels.md).
HEAD_SHARE = 0.25
# per drafter model, what SSMDrafter.build has run in this process: ("step" or "catch-up", row
# count, cache size)
_BUILT: "weakref.WeakKeyDictionary[object, set[tuple]]" = weakref.WeakKeyDictionary()
# per drafter model, the ids its one-call greedy drafts choose among, by (share, vocab_size): one tensor for
# every drafter of the model (LM.generate makes one per call), so that the kernel's cut of the head for
# them (MambaStep.head_cut, by the ids tensor) is made once (it had been cut and packed again for each
# call's new ids, and each copy kept: docs/kernels.md)
_HEAD_IDS: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


@dataclass
class _Drafted:
    """The states drafting left behind: the work caches it stepped, and for each (row, node) of
    the tree which of them (``level``, -1: none) holds the state after that node, at row ``at``."""

    rows: list[int]
    parents: np.ndarray  # [b, n]
    tokens: torch.Tensor  # [b, n] (filled while drafting)
    level: np.ndarray  # [b, n]
    at: np.ndarray  # [b, n]
    caches: list = field(default_factory=list)

    def add(self, cache, nodes: np.ndarray, at: np.ndarray, rows: np.ndarray | None = None) -> None:
        """``cache`` row ``at[i, k]`` holds row i's state after node ``nodes[i, k]`` (``nodes``
        may be one row for all); or, with ``rows`` (all three flat), row ``at[k]`` holds row
        ``rows[k]``'s after ``nodes[k]``. (numpy: a few small index writes per level, which
        cost several times more as torch ops.)"""
        if rows is None:
            rows = np.arange(self.level.shape[0])[:, None]
        self.level[rows, nodes] = len(self.caches)
        self.at[rows, nodes] = at
        self.caches.append(cache)


def _deepest_fed(parents: list, tokens: list, fed: list, new: list) -> tuple[int, int]:
    """On the path of a drafted tree (one row's ``parents`` and ``tokens``) that the tokens ``new``
    follow from the root (a node's first child in index order holding the next one), the deepest
    node drafting fed (``fed[v] >= 0``: its state is kept) and how many of ``new`` reach it; (-1,
    0) where none does. (Plain Python: over a few tokens numpy's calls cost more than the walk.)"""
    node, found, depth = 0, -1, 0
    for k, tok in enumerate(new, 1):
        node = next((c for c in range(node + 1, len(parents)) if parents[c] == node and tokens[c] == tok), -1)
        if node < 0:
            break
        if fed[node] >= 0:
            found, depth = node, k
    return found, depth


class _OneCall(NamedTuple):
    """A one-call draft (:meth:`SSMDrafter._continue`): the shape's parents, each row's tokens,
    each node's slot (-1: not stepped) and the cache holding the slots' states."""

    parents: list
    tokens: list
    slots: list
    nodes: object


class _Level(NamedTuple):
    """One level of a static tree's drafting: ``frontier`` ``[F]``, the nodes whose children it
    draws (the laws' rows, node-major), ``width`` draws each; ``nodes`` ``[m]``, those children,
    child i being draw ``draw[i]`` of the flattened ``[F, width]`` draws. With a step (``fork``
    not None): the work cache copies rows ``fork`` (``[m * b]``, node-major) of the previous
    one, feeds every node (leaves included: a step reads the same weights for a few more rows,
    and the next advance then finds the state of a leaf the target accepted), ``rows`` ``[b, m]``
    being each (row, node)'s row there; ``inner``: the positions in ``nodes`` of those with
    children, the next frontier; ``heads``: the work rows of those (node-major), the only rows
    whose logits the step makes, in the next frontier's order (None: every row, in order)."""

    frontier: torch.Tensor
    width: int
    nodes: torch.Tensor
    draw: torch.Tensor
    fork: torch.Tensor | None
    rows: np.ndarray
    inner: torch.Tensor
    heads: torch.Tensor | None


@functools.lru_cache(maxsize=8)
def _no_rows(device: str) -> torch.Tensor:
    """An empty index on ``device``: the ``heads`` of a step whose logits go unread."""
    return torch.zeros(0, dtype=torch.long, device=device)


@functools.lru_cache(maxsize=64)
def _static_plan(shape: TreeShape, b: int, device: str) -> tuple[_Level, ...]:
    """The levels of drafting ``shape`` for ``b`` rows (its :class:`~stree.tree.ShapePlan`'s,
    depth by depth), with the index tensors each needs, made once per shape and batch size (they
    would otherwise cost more Python than the level's step)."""
    plan = shape.plan
    kids, levels = plan.kids, plan.levels
    host = functools.partial(torch.tensor, device="cpu")  # named: a default-device context must not move them
    out, at = [], {0: 0}  # at: each frontier node's row block in the work cache (the root's: the drafter's own)
    for d, frontier in enumerate(levels):
        width = max(len(kids[v]) for v in frontier)
        new = [(j, r, c) for j, v in enumerate(frontier) for r, c in enumerate(kids[v])]
        nodes = [c for _, _, c in new]
        below = levels[d + 1] if d + 1 < len(levels) else []
        inner = [nodes.index(v) for v in below]  # the next frontier's positions among these nodes
        fork = torch.tensor([at[frontier[j]] * b + i for j, _, _ in new for i in range(b)], device=device) \
            if inner else None
        heads = torch.tensor([k * b + i for k in inner for i in range(b)], device=device) \
            if inner != list(range(len(nodes))) else None
        out.append(_Level(host(frontier), width, host(nodes), host([j * width + r for j, r, _ in new]), fork,
                          np.arange(len(nodes) * b).reshape(-1, b).T, torch.tensor(inner, device=device), heads))
        at = {v: i for v, i in zip(below, inner)}
    return tuple(out)


class SSMDrafter(Drafter):
    """Drafts from ``model``'s own next-token distributions q = softmax(logits / temperature).

    ``mode="static"``: fills ``shape`` level by level, one ``step`` per level over that level's
    parents only (each a row of a copy of the drafter's cache); node v's c children are c draws
    without replacement from q's top ``top_k`` (Gumbel-top-k, the law attached for lossless
    verification), or with ``stochastic=False`` the c most likely tokens (one-hot verification), as
    the rows the context marks greedy (``DraftContext.greedy``) take them under ``stochastic=True``.

    ``mode="beam"``: ``beams`` beams for ``steps`` steps; each step every beam proposes its
    ``beams`` most likely tokens and the best ``beams`` by total log-probability survive. Every
    surviving token becomes a node under its beam's node (1 + beams * steps nodes, parents per
    row), one ``step`` per beam step. Deterministic: one-hot verification.

    ``vocab_size``: draft only ids below it (the target's vocabulary when the drafter's embedding
    is padded past it). The cache holds the state after every context token (``CATCH_WINDOW``:
    after the last of them only, where a row fell further behind). Drafting fed most nodes of the
    tree to work caches (in static mode every level with children below, leaves included; in beam
    mode every beam but the last step's; in a grown tree every node it expanded): when the new
    tokens follow the tree (the accepted path), each row takes the state of the deepest fed node
    on it instead of feeding those tokens again, so mostly the target's own last token is left;
    what is left is fed by steps when each row has as many (up to ``STEPS_UP_TO``), else one
    chain pass and commit. Greedy drafts of a static shape are one call where the model has one
    (``draft_greedy``: a Mamba2 drafter on the CPU), the resumption and the feed included,
    its children chosen among ``head_share`` of the vocabulary, most frequent first (the model's
    ``draft_vocab``, read from its checkpoint's draft_vocab.json; None, or no such file: every id).
    On the CPU, ``stree.runtime.CompiledModel(model)`` in place of ``model`` runs those compiled."""

    # A row more than this many tokens behind (a new context, or one decoded plain for a while) is
    # read from its last CATCH_WINDOW tokens only, from a fresh state: drafts need not come from the
    # exact state (the target verifies them), and a probe after a long plain run would otherwise
    # pay for reading everything (at batch 8, 300 tokens a row cost the drafter 27 target steps).
    CATCH_WINDOW = 64

    def __init__(self, model, shape: TreeShape | None = None, *, mode: str = "static", stochastic: bool = True,
                 temperature: float = 1.0, top_k: int = 10, beams: int = 4, steps: int = 4, seed: int = 0,
                 max_length: int = 4096, vocab_size: int | None = None, head_share: float | None = HEAD_SHARE):
        if mode not in ("static", "beam"):
            raise ValueError(f"mode must be 'static' or 'beam', got {mode!r}")
        if temperature <= 0 or top_k < 1 or beams < 1 or steps < 1:
            raise ValueError(f"need temperature > 0 and top_k, beams, steps >= 1, got {temperature}, {top_k}, "
                             f"{beams}, {steps}")
        self.model, self.shape, self.mode, self.stochastic = model, shape, mode, stochastic
        self.temperature, self.top_k, self.beams, self.steps, self.max_length = temperature, top_k, beams, steps, max_length
        self.draft_depth = steps if mode == "beam" else None
        self.dynamic = self.fills_shapes = mode == "static"
        self.level_model = model if mode == "static" else None
        self.vocab_size = model.vocab_size if vocab_size is None else vocab_size
        if not 1 <= self.vocab_size <= model.vocab_size:
            raise ValueError(f"vocab_size must be in [1, {model.vocab_size}] (the drafter's logits), got {vocab_size}")
        if head_share is not None and not 0 < head_share <= 1:
            raise ValueError(f"head_share must be in (0, 1] or None, got {head_share!r}")
        self.head_ids = self._head_cut(head_share)
        self.generator = torch.Generator().manual_seed(seed)
        self.rates = SlotRates()  # learned acceptance for calibrated TreeBudgets, kept across calls
        self.reset()

    def _head_cut(self, share: float | None) -> torch.Tensor | None:
        """The ids one-call greedy drafts choose among (None: every id): the ``share`` of the
        vocabulary most frequent in the drafter's training text (its checkpoint's draft_vocab.json),
        at most those below ``vocab_size``."""
        ranked = getattr(self.model, "draft_vocab", None)
        if (share is None or ranked is None) and self.vocab_size == self.model.vocab_size:
            return None
        share = None if ranked is None else share
        made = _HEAD_IDS.setdefault(self.model, {})
        hit = made.get((share, self.vocab_size))
        if hit is None or hit[0] is not ranked:  # (made for the ranking the model holds now)
            if share is None:
                ids = torch.arange(self.vocab_size)
            else:
                ids = ranked[ranked < self.vocab_size][: max(1, round(share * self.vocab_size))].contiguous()
            hit = made[(share, self.vocab_size)] = (ranked, ids)
        return hit[1]

    @property
    def random_drafts(self) -> bool:
        return self.stochastic and self.mode == "static"  # (beams take the likeliest tokens)

    def reset(self) -> None:
        self._cache, self._rows, self._fed, self._last = None, [], torch.zeros(0, dtype=torch.long), None
        self._nodes: dict[tuple[int, int], object] = {}  # (rows, nodes) -> a one-call draft's node states
        self._one: _OneCall | None = None  # the last draft, where it was one call
        self._drafted: _Drafted | None = None
        self.rates.forget()

    def observe(self, context: DraftContext, tokens, target) -> None:
        self.rates.record(context.rows, tokens)

    def build(self, shapes, batch: int) -> None:
        """See :meth:`Drafter.build`: a step of ``batch`` rows (a catch-up's, with its head and
        without) and one of each static level's work rows, on scratch caches of the drafter's own
        size, and catch-ups of ``batch`` rows by a prefill of each power of two up to
        ``CATCH_WINDOW`` tokens (the products of each row count it may multiply, measured or
        compiled on first use), once per drafter model, row count and cache size in the process
        (``LM.generate`` makes a drafter per call, and stepping them again in each call cost a
        GPU's calls a sixth of their time)."""
        if self.mode != "static":
            return
        counts = {(batch, None), (batch, 0)}  # (rows, rows with logits: None for all; 0: a catch-up's first step)
        for shape in shapes:
            counts.update((len(level.fork), None if level.heads is None else len(level.heads))
                          for level in _static_plan(shape, batch, str(self.model.device)) if level.fork is not None)
        device = self.model.device
        built = _BUILT.setdefault(self.model, set())
        for rows, heads in sorted(counts - {tuple(key) for kind, *key, size in built if kind == "step"
                                            and size == self.max_length}, key=lambda c: (c[0], c[1] or 0)):
            cache = self.model.allocate_cache(rows, self.max_length)
            self.model.step(torch.zeros(rows, dtype=torch.long, device=device), cache, validate=False,
                            heads=None if heads is None else torch.arange(heads, device=device))
            built.add(("step", rows, heads, self.max_length))
        if ("catch-up", batch, self.max_length) not in built:
            span = 4
            while span <= min(self.CATCH_WINDOW, self.max_length):
                cache = self.model.allocate_cache(batch, self.max_length)
                self.model.prefill(torch.zeros(batch, span, dtype=torch.long, device=device), cache)
                span *= 2
            built.add(("catch-up", batch, self.max_length))

    def behind(self, context: DraftContext) -> int:
        want = context.lengths[torch.tensor(context.rows)]
        known = {r: i for i, r in enumerate(self._rows)}
        if self._cache is None or not all(r in known for r in context.rows):
            return min(int(want.max()), self.CATCH_WINDOW)  # a prefill of the contexts' ends
        return min(int((want - self._fed[torch.tensor([known[r] for r in context.rows])]).max()), self.CATCH_WINDOW)

    def _advance(self, context: DraftContext, depth: int, feed=None) -> torch.Tensor | TokenTree:
        """Bring the cache to each row's whole context (the root included) and return the
        drafter's logits after it, ``[rows, V]``: the root's children are drawn from the same pass
        that fed the new tokens. ``depth``: the levels drafting will add below the root (checked
        here against ``max_length``, so that the level steps need no checks of their own).
        ``feed(tokens [rows, T], counts [rows])``: feeds the new tokens and drafts in one call
        (:meth:`_drafting`), the tree returned; where it returns None the new tokens are fed here."""
        self._one = None  # (the cache moves past the root a one-call draft left it at)
        rows = context.rows
        want = context.lengths[torch.tensor(rows)]
        if int(want.max()) + depth > self.max_length:
            raise ValueError(f"a context of {int(want.max())} tokens and a draft {depth} deep would pass the drafter's "
                             f"max_length {self.max_length}")
        known = {r: i for i, r in enumerate(self._rows)}
        if self._cache is not None and all(r in known for r in rows):
            pos = torch.tensor([known[r] for r in rows])
            if pos.tolist() != list(range(len(self._rows))):
                self._cache, self._fed = self._cache.select(pos.to(self.model.device)), self._fed[pos]
                self._last = None if self._last is None else self._last[pos.to(self._last.device)]
            self._rows = list(rows)
            self._reuse(context, want)
            new = want - self._fed
            if bool((new == 0).all()) and self._last is not None:  # (None: a one-call draft made no logits)
                return self._last
            if bool((new > 0).all()) and int(new.max()) <= self.CATCH_WINDOW:
                m = int(new.max())
                at = (self._fed[:, None] + torch.arange(m)).clamp(max=(want - 1)[:, None])
                fresh = context.tokens[torch.tensor(rows)[:, None], at].to(self.model.device)
                if feed is not None and (tree := feed(fresh, new)) is not None:
                    self._fed = want.clone()
                    return tree
                if m <= STEPS_UP_TO and bool((new == m).all()):  # as many tokens in every row: fast steps
                    # (the last step's logits alone are read: the steps before it skip the head, a fifth
                    # of the shipped 1-layer drafter's step, paid after each accepted leaf drafting never fed)
                    for k in range(m):
                        self._last = self.model.step(fresh[:, k], self._cache, heads=None if k == m - 1 else
                                                     _no_rows(str(self.model.device)))
                else:  # the new tokens fed as a prefill continuing the cache: logits at each row's last only
                    self._last = self.model.prefill(fresh, self._cache, lengths=new)
                self._fed = want.clone()
                return self._last
        # new rows, rows advancing unevenly, or rows far behind: start again from the last
        # CATCH_WINDOW tokens of each context
        self._drafted = None
        self._cache = self.model.allocate_cache(len(rows), self.max_length)
        span = want.clamp(max=self.CATCH_WINDOW)
        at = (want - span)[:, None] + torch.arange(int(span.max()))
        at = torch.minimum(at, (want - 1)[:, None])  # (a shorter row's tail repeats its last token, unread)
        tokens = context.tokens[torch.tensor(rows)[:, None], at].to(self.model.device)
        self._rows, self._fed = list(rows), want.clone()
        if feed is not None and (tree := feed(tokens, span)) is not None:
            return tree
        self._last = self.model.prefill(tokens, self._cache, lengths=span)
        return self._last

    def _reuse(self, context: DraftContext, want: torch.Tensor) -> None:
        """Move each row of the cache (already in ``context.rows`` order) to the deepest node of
        the last drafted tree that its new tokens, all but the last, follow and that drafting
        fed; count those tokens as fed."""
        drafted, self._drafted = self._drafted, None
        if drafted is None:
            return
        parents, tokens, level, at = drafted.parents, drafted.tokens.numpy(), drafted.level, drafted.at
        before = {r: i for i, r in enumerate(drafted.rows)}
        moves: dict[int, tuple[list[int], list[int]]] = {}  # level -> (rows here, rows of its cache)
        for i, r in enumerate(context.rows):
            j, fed = before.get(r), int(self._fed[i])
            if j is None:
                continue
            node, depth = _deepest_fed(parents[j].tolist(), tokens[j].tolist(), level[j].tolist(),
                                       context.tokens[r, fed: int(want[i]) - 1].tolist())
            if node >= 0:
                dst, src = moves.setdefault(int(level[j, node]), ([], []))
                dst.append(i)
                src.append(int(at[j, node]))
                self._fed[i] += depth
        device = self.model.device
        for level, (dst, src) in moves.items():
            self._cache.assign(torch.tensor(dst, device=device),
                               drafted.caches[level].select(torch.tensor(src, device=device)))

    def _feeding(self, b: int, n: int, parents: np.ndarray, tokens: torch.Tensor) -> _Drafted:
        """A record of the states the tree drafted now leaves (``tokens`` may still be filled)."""
        self._drafted = _Drafted(list(self._rows), np.broadcast_to(parents, (b, n)), tokens,
                                 np.full((b, n), -1), np.zeros((b, n), dtype=np.int64))
        return self._drafted

    def _law(self, logits: torch.Tensor) -> torch.Tensor:
        """The drafting law over the target's ids: softmax(logits / temperature), on the CPU."""
        return torch.softmax(logits[..., : self.vocab_size].float().cpu() / self.temperature, -1)

    def _ranked(self, logits: torch.Tensor, drawing: bool) -> torch.Tensor:
        """What a static level's children are taken from: q where some are drawn; else the
        logits themselves, whose top entries are q's (softmax keeps the order)."""
        return self._law(logits) if drawing else logits[..., : self.vocab_size].cpu()

    def _step(self, tokens: torch.Tensor, work, heads: torch.Tensor | None = None) -> torch.Tensor:
        """Feed one token per work row (each row a path of the tree); its next-token logits (of
        rows ``heads`` only, where given). No checks: the tokens are the drafter's own top ids,
        and the room was checked on advance."""
        return self.model.step(tokens.to(self.model.device), work, validate=False, heads=heads)

    def _fork(self, work, rows: torch.Tensor):
        """The work cache's rows ``rows`` (repeats allowed): paths that branch get a copy each."""
        return work.select(rows.to(self.model.device))

    def propose(self, context: DraftContext, shape: TreeShape | TreeBudget | None = None) -> TokenTree:
        feed = None
        if self.mode == "static":
            shape = self.tree_shape(shape)  # checked before the cache advances
            if (isinstance(shape, TreeShape) and shape.n > 1 and hasattr(self.model, "draft_greedy")
                    and not context.random_rows(self.stochastic).any()):
                # (greedy: the whole draft as one call where the model has it, continuing the last one's)
                tree = self._continue(context, shape)
                if tree is not None:
                    return tree
                feed = self._drafting(shape, context.last_tokens())
        last = self._advance(context, self.steps if self.mode == "beam" else shape.max_depth, feed)
        if isinstance(last, TokenTree):
            return last
        roots = context.last_tokens()
        if self.mode == "beam":
            return self._beam(roots, self._law(last))
        random = context.random_rows(self.stochastic)
        if isinstance(shape, TreeBudget):
            return self._grow(roots, self._law(last), shape, context.rows, random)
        return self._static(roots, self._ranked(last, random.any()), shape, random)

    def _drafting(self, shape: TreeShape, roots: torch.Tensor):
        """What :meth:`_advance` calls to feed the new tokens and draft ``shape`` greedily in one
        call (:meth:`~stree.models.base.TreeLM.draft_greedy`, under the head's cut), where the
        cache has no draft to continue from: the tree; None where the model has no such call."""
        def feed(tokens: torch.Tensor, counts: torch.Tensor) -> TokenTree | None:
            b = len(roots)
            nodes = self._node_states(b, shape.n)
            counts = np.ascontiguousarray(counts.numpy(), dtype=np.int64)
            out = self.model.draft_greedy(tokens, counts, shape, self._cache, nodes, self.head_ids, validate=False)
            return None if out is None else self._drafted_now(shape, out, roots.numpy(), nodes)
        return feed

    def _node_states(self, b: int, n: int):
        """The cache a one-call draft of ``n`` nodes over ``b`` rows leaves its nodes' states in
        (one per size, kept: made anew for each draft it cost more than the draft's head)."""
        nodes = self._nodes.get((b, n))
        if nodes is None:
            nodes = self._nodes[(b, n)] = self.model.allocate_cache(n * b, self.max_length)
        return nodes

    def _drafted_now(self, shape: TreeShape, out, roots, nodes) -> TokenTree:
        drafted, slots = out
        drafted.numpy()[:, 0] = roots
        self._last = self._drafted = None
        self._one = _OneCall(list(shape.parents), drafted.tolist(), slots.tolist(), nodes)
        return TokenTree.from_shape(shape, drafted)

    def _continue(self, context: DraftContext, shape: TreeShape) -> TokenTree | None:
        """A one-call draft continuing the last one's (the same rows, each a few new tokens on): each
        row's state restored, in the same call, to that of the deepest node of the last draft that
        its new tokens (all but the last) followed and that drafting stepped, the rest fed. None
        (nothing changed) where the rows are not the last draft's or not all a few tokens on: then
        :meth:`_advance` brings the cache there."""
        one, rows = self._one, context.rows
        if one is None or rows != self._rows or context.tokens.device.type != "cpu":
            return None
        # (plain Python over the few rows and tokens: numpy calls cost more here than the work)
        b, tokens, lengths = len(rows), context.tokens.numpy(), context.lengths.tolist()
        want, fed = [lengths[r] for r in rows], self._fed.tolist()
        restore = [-1] * b
        for i, r in enumerate(rows):
            node, depth = _deepest_fed(one.parents, one.tokens[i], one.slots, tokens[r, fed[i]: want[i] - 1].tolist())
            if node >= 0:
                restore[i], fed[i] = one.slots[node] * b + i, fed[i] + depth
        new = [w - f for w, f in zip(want, fed)]
        if min(new) < 1 or max(new) > self.CATCH_WINDOW or max(want) + shape.max_depth > self.max_length:
            return None
        feed = np.empty((b, max(new)), dtype=np.int64)
        for i, r in enumerate(rows):  # (a shorter row's tail repeats its last token, unread)
            feed[i, : new[i]], feed[i, new[i]:] = tokens[r, fed[i]: want[i]], tokens[r, want[i] - 1]
        nodes = self._node_states(b, shape.n)
        out = self.model.draft_greedy(torch.from_numpy(feed), np.array(new), shape, self._cache, nodes,
                                      self.head_ids, np.array(restore) if max(restore) >= 0 else None, one.nodes,
                                      validate=False)
        if out is None:
            return None
        self._fed = torch.from_numpy(np.array(want))
        return self._drafted_now(shape, out, feed[np.arange(b), np.array(new) - 1], nodes)

    def _grow(self, roots: torch.Tensor, root_q: torch.Tensor, budget: TreeBudget, rows: list[int],
              random: np.ndarray) -> TokenTree:
        """A dynamic tree: the roots' laws are the cache advance's; each deeper level forks its
        kept nodes' parents' rows of a work cache and advances them by one step. The nodes that
        stay in the tree leave their states for the next advance."""
        work = [self._cache]  # the cache each expand call stepped (the roots': the drafter's own)

        def expand(level: Level):
            if level.parent_pos is None:
                q = root_q
            else:
                work.append(self._fork(work[-1], torch.from_numpy(level.parent_pos)))
                q = self._law(self._step(torch.from_numpy(level.tokens), work[-1]))
            probs, ids = torch.topk(q, min(self.top_k, q.shape[-1]), dim=-1)
            return ids.numpy(), probs.numpy()

        states = []

        def placed(call: int, at_rows: np.ndarray, nodes: np.ndarray):
            at = np.nonzero(nodes >= 0)[0]  # the work rows of the entries kept in the tree
            if call and len(at):  # call 0 fed nothing: the roots' states are the cache itself
                states.append((work[call], nodes[at], at, at_rows[at]))

        tree = grow(budget, roots.numpy(), expand, self._draw_order, random, self.rates, rows, placed)
        fed = self._feeding(len(roots), tree.n, tree.parents.numpy(), tree.tokens)
        for cache, nodes, at, at_rows in states:
            fed.add(cache, nodes, at, at_rows)
        return tree

    def _draw_order(self, probs: np.ndarray) -> np.ndarray:
        """Each entry's top-k candidates in the order of Gumbel-top-k draws."""
        u = torch.rand(probs.shape, generator=self.generator, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
        return gumbel_top_k(probs.astype(np.float32), probs.shape[1], (-(-u.log()).log()).float().numpy())

    def _static(self, roots: torch.Tensor, root: torch.Tensor, shape: TreeShape, random: np.ndarray) -> TokenTree:
        """Level by level (:func:`_static_plan`): the root's children come from ``root`` (what
        :meth:`_ranked` made of the logits the cache advance ended on); below, a work cache holds
        one row per (node of the level, batch row), copies of their parents' rows, advanced by
        the level's own tokens with one step. Each level with children below costs one step over
        its new nodes, the head (most of a small model's step) over those with children only. The
        rows ``random`` marks draw their children; the others take q's top."""
        b, n = len(roots), shape.n
        drawing = bool(random.any())
        ranked = torch.from_numpy(~random)[:, None]  # [b, 1]: the rows taking their top entries
        K = max(self.top_k, max(map(len, shape.children())))
        tokens = torch.zeros(b, n, dtype=torch.long)
        tokens[:, 0] = roots
        child_ids = torch.zeros(b, n, K, dtype=torch.long) if drawing else None
        child_probs = torch.zeros(b, n, K) if drawing else None
        q = root[None]  # [F, b, V]: the frontier's laws (or logits, see _ranked), node-major
        work = self._cache
        fed = self._feeding(b, n, np.asarray(shape.parents), tokens)
        for level in _static_plan(shape, b, str(self.model.device)):
            # the whole level at once: node v's c children are the first c of its draws in order
            probs, ids = torch.topk(q, min(K if drawing else level.width, q.shape[-1]), dim=-1)  # [F, b, k]
            F, k, width = probs.shape[0], probs.shape[-1], level.width
            if drawing:
                child_ids[:, level.frontier, :k] = ids.transpose(0, 1)
                child_probs[:, level.frontier, :k] = probs.transpose(0, 1)
                u = torch.rand(probs.shape, generator=self.generator, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
                order = gumbel_top_k(probs.reshape(F * b, k), width, -(-u.log()).log().float().reshape(F * b, k))
                drawn = ids.reshape(F * b, k).gather(1, order).view(F, b, width)
                drawn = torch.where(ranked, ids[..., :width], drawn)
            else:
                drawn = ids[..., :width]
            tokens[:, level.nodes] = drawn.transpose(0, 1).reshape(b, F * width)[:, level.draw]
            if level.fork is None:
                break
            work = self._fork(work, level.fork)
            logits = self._step(tokens[:, level.nodes].t().reshape(-1), work, level.heads)  # (the inner nodes')
            fed.add(work, level.nodes.numpy()[None], level.rows)
            q = self._ranked(logits.view(len(level.inner), b, -1), drawing)
        if not drawing:
            return TokenTree.from_shape(shape, tokens)
        return TokenTree.from_shape(shape, tokens, child_ids=child_ids, child_probs=child_probs)

    def _beam(self, roots: torch.Tensor, root_q: torch.Tensor) -> TokenTree:
        """The first step draws from the law the cache advance ended on; then one work row per
        (batch row, beam), copies of the beams they grew from, advanced by each beam's newest
        token with one step."""
        b, M = len(roots), self.beams
        parents = torch.full((b, 1), -1, dtype=torch.long)
        tokens = roots[:, None].clone()
        beam_nodes = torch.zeros(b, 1, dtype=torch.long)  # node index of each live beam
        beam_score = torch.zeros(b, 1)
        work, q = self._cache, root_q[:, None]
        levels = []  # (work cache, the node each of its rows fed: rows batch-major)
        for step in range(self.steps):
            width_in = beam_nodes.shape[1]
            if step > 0:
                q = self._law(self._step(tokens.gather(1, beam_nodes).reshape(-1), work)).view(b, width_in, -1)
                levels.append((work, beam_nodes))
            logq = q.clamp_min(1e-30).log()
            top_lp, top_id = torch.topk(logq, min(M, q.shape[-1]), dim=-1)  # [b, beams, M]
            score = (beam_score[:, :, None] + top_lp).flatten(1)
            best = torch.topk(score, min(M, score.shape[1]), dim=1).indices  # ties: lower beam, then rank
            width = top_lp.shape[-1]
            from_beam = best // width
            new_tokens = top_id.flatten(1).gather(1, best)
            new_parents = beam_nodes.gather(1, from_beam)
            first = tokens.shape[1]
            parents = torch.cat([parents, new_parents], 1)
            tokens = torch.cat([tokens, new_tokens], 1)
            beam_score = score.gather(1, best)
            beam_nodes = first + torch.arange(best.shape[1]).expand(b, -1)
            if step + 1 < self.steps:
                work = self._fork(work, (torch.arange(b)[:, None] * width_in + from_beam).reshape(-1))
        fed = self._feeding(b, tokens.shape[1], parents.numpy(), tokens)
        for work, nodes in levels:
            fed.add(work, nodes.numpy(), np.arange(nodes.numel()).reshape(b, -1))
        return TokenTree(parents, tokens)
