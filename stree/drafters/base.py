"""The drafter protocol. Drafters see token ids only: never a model or its cache."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from ..tree import TokenTree, TreeBudget, TreeShape


@dataclass
class DraftContext:
    """What a drafter may read: ``tokens`` ``[R, T]`` (CPU, right-padded) and ``lengths`` ``[R]``
    hold every row's prompt and generated tokens, indexed by *stable* row id; ``rows`` lists the
    ids of the rows to draft for, in batch order. A row's last token is the root of its tree.
    Rows only grow between calls, so a drafter may index each row incrementally. ``greedy``: per
    drafted row (batch order), whether it decodes greedily (None: no row does); a drafter whose
    drafts are random drafts its likeliest tokens for those rows (:meth:`random_rows`), as
    greedy verification takes the target's top token only and random drafts would waste slots."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    rows: list[int]
    greedy: np.ndarray | None = None
    # tokens and lengths as NumPy arrays (arrays()), where the maker has them at hand
    views: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.rows)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``tokens`` and ``lengths`` as NumPy arrays (their memory, not to be written to), made once
        per context: a drafter asked whether it can draft and then to draft reads them twice, and
        each ``.numpy()`` is four dispatcher calls, microseconds each right after a model pass."""
        if self.views is None:
            self.views = (self.tokens.numpy(), self.lengths.numpy())
        return self.views

    def among(self, keep: np.ndarray) -> "DraftContext":
        """The context of the drafted rows ``keep`` marks (a bool mask over ``rows``)."""
        return dataclasses.replace(self, rows=[r for r, k in zip(self.rows, keep.tolist()) if k],
                                   greedy=None if self.greedy is None else self.greedy[keep])

    def row(self, i: int, start: int = 0) -> list[int]:
        """Tokens ``start:`` of the i-th drafted row, as a list."""
        r = self.rows[i]
        return self.tokens[r, start: int(self.lengths[r])].tolist()

    def random_rows(self, stochastic: bool) -> np.ndarray:
        """``[len(rows)]`` bool: the rows a drafter of random drafts (``stochastic``) draws for;
        the others (greedy rows, or every row of a deterministic drafter) take its top entries."""
        if not stochastic:
            return np.zeros(len(self.rows), dtype=bool)
        return np.ones(len(self.rows), dtype=bool) if self.greedy is None else ~np.asarray(self.greedy, dtype=bool)

    def last_tokens(self) -> torch.Tensor:
        rows = torch.tensor(self.rows, dtype=torch.long)
        return self.tokens[rows, self.lengths[rows] - 1]


class TargetTop(NamedTuple):
    """For one row, the processed target distributions its emitted tokens were drawn from, one row
    per token: the ``target_top_k`` most likely entries (``ids``, ``probs`` ``[len, k]``, most likely
    first) and ``token_probs`` ``[len]``, the probability of the token actually emitted."""

    ids: torch.Tensor
    probs: torch.Tensor
    token_probs: torch.Tensor


class Drafter:
    """``propose`` returns a :class:`TokenTree` (CPU) with one row per drafted row, the root token
    equal to the row's last token, siblings numbered in draw order, ``valid`` marking nodes the
    drafter could not fill, and ``child_ids``/``child_probs`` when its drafts are random."""

    #: how many of the target's most likely next tokens ``observe`` receives per emitted position
    #: (0: only the emitted tokens' probabilities; None: no target distributions at all, which
    #: spares each step computing them)
    target_top_k: int | None = None
    #: whether ``observe`` needs those distributions after a plain step too (one the decoding loop
    #: chose over drafting: ``tree="auto"`` found speculation not paying). False spares every such
    #: step computing and moving them, and ``observe`` gets ``target=None`` for it
    plain_target = True

    @property
    def plain_top_k(self) -> int | None:
        """The target entries ``observe`` receives after a plain step (None: no distributions)."""
        return self.target_top_k if self.plain_target else None

    #: the tree shape ``propose`` fills when the call passes none (None: every call must pass one)
    shape: TreeShape | TreeBudget | None = None
    #: whether ``propose`` also takes a :class:`TreeBudget` (a tree grown per step and row)
    dynamic = False
    #: the depth of the trees it proposes when that is not the shape's (e.g. beam search)
    draft_depth: int | None = None
    #: whether ``propose`` drafts the static shape it is given (else trees of its own making)
    fills_shapes = True
    #: a model the drafter runs one step per tree level on (what drafting a shape costs, for
    #: ``tree="auto"``); None: drafting costs little next to the target
    level_model = None

    #: the drafter's own random stream (None: it draws nothing)
    generator: torch.Generator | None = None

    #: whether the drafter serves one decoding call alone (made for it, dropped after it: ``LM.generate``'s
    #: drafter by name): what ``observe`` would learn after the call's last draft is never read, so the
    #: loop does not show it the tokens of the call's last run of plain steps
    serves_one_call = False

    @property
    def random_drafts(self) -> bool:
        """Whether the drafter's trees may carry random drafts (``child_probs``, verified by the
        rejection rules): then a seeded sampled call's output follows the trees it verifies. Every
        other drafter's trees are deterministic, verified at keyed draws (:mod:`stree.sampling.keyed`):
        a seed's output is then the same whatever the trees."""
        return self.generator is not None

    def reset(self) -> None:
        """Forget per-row state: the next ``propose`` starts new rows."""

    def for_measuring(self) -> "Drafter":
        """A drafter of this kind that the cost profile (:mod:`stree.decoding.cost`) drafts and observes
        with: this one, where :meth:`reset` forgets what observing taught it; a drafter whose
        learning outlives a reset (a store shared across calls) gives a fresh copy, so that
        measuring leaves what it learned, and so the output of a seeded call, untouched."""
        return self

    def build(self, shapes: list[TreeShape], batch: int) -> None:
        """Before decoding: run once each call that drafting ``shapes`` for ``batch`` rows will make
        of a model the drafter steps (a compiled one compiles each row count on first use, which
        would otherwise land inside decoding). Drafters without a model build nothing."""

    def behind(self, context: DraftContext) -> int:
        """How many of the rows' tokens the drafter has yet to read before it can draft (the
        most over ``context.rows``): a drafter model's catch-up after plain steps, or its whole
        context for rows it has not seen. 0 for drafters that read the context as they draft."""
        return 0

    def can_draft(self, context: DraftContext) -> bool:
        """Whether :meth:`propose` may fill a node below some row's root: False only where the
        drafter knows, for less than drafting costs, that every row of ``context`` would get its
        root alone (a prompt-lookup drafter whose last token has not occurred before). The
        decoding loop then takes a plain step without drafting. The default: True (it cannot tell)."""
        return True

    def can_draft_strong(self, context: DraftContext) -> bool:
        """As :meth:`can_draft`, for a node not marked weak (``TokenTree.weak``): False where the
        drafter knows, for less than drafting costs, that every row's draft would be its root alone
        or weak throughout. ``tree="auto"`` asks this where it has learned that drafts weak throughout
        do not pay. The default: :meth:`can_draft` (a drafter that marks no node weak)."""
        return self.can_draft(context)

    def reseed(self, seed: int) -> None:
        """Restart the drafter's random stream from ``seed`` (``generate(seed=...)`` derives it,
        independent of the verifier's stream)."""
        if self.generator is not None:
            self.generator.manual_seed(seed)

    def tree_shape(self, shape: TreeShape | TreeBudget | None) -> TreeShape | TreeBudget:
        """``shape``, else the drafter's own; a ValueError when neither is set, or for a budget
        the drafter cannot grow."""
        shape = shape or self.shape
        if shape is None:
            raise ValueError(f"{type(self).__name__} needs a tree shape (at construction or per call)")
        check_budget(self, shape)
        return shape

    def propose(self, context: DraftContext, shape: TreeShape | TreeBudget) -> TokenTree:
        raise NotImplementedError

    @property
    def observes(self) -> bool:
        """Whether :meth:`observe` is the drafter's own: the base's learns nothing (a drafter that reads
        its context as it drafts, the n-gram one, keeps it), and the decoding loop shows emitted tokens
        only to a drafter that observes, sparing each step the context and token lists it would build."""
        return getattr(self.observe, "__func__", None) is not Drafter.observe

    def observe(self, context: DraftContext, tokens: list[list[int]], target: list[TargetTop]) -> None:
        """Called each time tokens are emitted (the prefill's first token, then every verify step):
        ``context`` holds the rows *before* the emission, ``tokens`` each row's emitted tokens (in
        ``context.rows`` order) and ``target`` their :class:`TargetTop` (at temperature 0: from the
        softmax of the logits; None after a plain step where ``plain_target`` is False). Emitted
        token i follows the row's context plus tokens 0..i-1. The ``target`` tensors may be the
        step's own outputs, overwritten by a later step (a decoding call's one-call greedy
        iterations keep theirs): a drafter copies what it keeps."""


def check_budget(drafter, shape) -> None:
    """A ValueError when ``shape`` is a :class:`TreeBudget` that ``drafter`` cannot grow."""
    if isinstance(shape, TreeBudget) and not getattr(drafter, "dynamic", False):
        raise ValueError(f"{type(drafter).__name__} drafts static tree shapes; a TreeBudget (dynamic:N) needs a drafter "
                         "that grows its own trees: STAND or the SSM drafter in static mode")
