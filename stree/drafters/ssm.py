"""A small language model as the drafter (paper 001 §5.2): its own committed cache follows the
rows, and it drafts a tree with its own tree forwards, so it never rolls back.

Any model with the decoding protocol works (``allocate_cache``, ``prefill``, ``forward_tree``
returning logits and a pass handle, ``commit`` of that handle): a distilled 1-2 layer Mamba2 in practice, an exact Markov table in the tests.
"""

from __future__ import annotations

import torch

import numpy as np

from ..tree import TokenTree, TreeBudget, TreeShape
from .base import DraftContext, Drafter
from .dynamic import Level, SlotRates, grow
from .stand import gumbel_top_k

__all__ = ["SSMDrafter"]


class SSMDrafter(Drafter):
    """Drafts from ``model``'s own next-token distributions q = softmax(logits / temperature).

    ``mode="static"``: fills ``shape`` level by level, one ``step`` per level over that level's
    parents only (each a row of a copy of the drafter's cache); node v's c children are c draws
    without replacement from q's top ``top_k`` (Gumbel-top-k, the law attached for lossless
    verification), or with ``stochastic=False`` the c most likely tokens (one-hot verification).

    ``mode="beam"``: ``beams`` beams for ``steps`` steps; each step every beam proposes its
    ``beams`` most likely tokens and the best ``beams`` by total log-probability survive. Every
    surviving token becomes a node under its beam's node (1 + beams * steps nodes, parents per
    row), one ``step`` per beam step. Deterministic: one-hot verification.

    ``vocab_size``: draft only ids below it (the target's vocabulary when the drafter's embedding
    is padded past it). The cache holds every context token but the last (the root, fed while
    drafting); new tokens are fed by one step when each row has one, else one chain pass and commit.
    On the CPU, ``stree.models.CompiledModel(model)`` in place of ``model`` runs those compiled."""

    def __init__(self, model, shape: TreeShape | None = None, *, mode: str = "static", stochastic: bool = True,
                 temperature: float = 1.0, top_k: int = 10, beams: int = 4, steps: int = 4, seed: int = 0,
                 max_length: int = 4096, vocab_size: int | None = None):
        if mode not in ("static", "beam"):
            raise ValueError(f"mode must be 'static' or 'beam', got {mode!r}")
        if temperature <= 0 or top_k < 1 or beams < 1 or steps < 1:
            raise ValueError(f"need temperature > 0 and top_k, beams, steps >= 1, got {temperature}, {top_k}, "
                             f"{beams}, {steps}")
        self.model, self.shape, self.mode, self.stochastic = model, shape, mode, stochastic
        self.temperature, self.top_k, self.beams, self.steps, self.max_length = temperature, top_k, beams, steps, max_length
        self.draft_depth = steps if mode == "beam" else None
        self.dynamic = mode == "static"
        self.vocab_size = model.vocab_size if vocab_size is None else vocab_size
        if not 1 <= self.vocab_size <= model.vocab_size:
            raise ValueError(f"vocab_size must be in [1, {model.vocab_size}] (the drafter's logits), got {vocab_size}")
        self.generator = torch.Generator().manual_seed(seed)
        self.rates = SlotRates()  # learned acceptance for calibrated TreeBudgets, kept across calls
        self.reset()

    def reset(self) -> None:
        self._cache, self._rows, self._fed, self._last = None, [], torch.zeros(0, dtype=torch.long), None
        self.rates.forget()

    def observe(self, context: DraftContext, tokens, target) -> None:
        self.rates.record(context.rows, tokens)

    def _advance(self, context: DraftContext) -> torch.Tensor:
        """Bring the cache to each row's whole context (the root included) and return the
        drafter's law after it, ``[rows, V]``: the root's children are drawn from the same pass
        that fed the new tokens."""
        rows = context.rows
        want = context.lengths[torch.tensor(rows)]
        known = {r: i for i, r in enumerate(self._rows)}
        if self._cache is not None and all(r in known for r in rows):
            pos = torch.tensor([known[r] for r in rows])
            if pos.tolist() != list(range(len(self._rows))):
                self._cache, self._fed = self._cache.select(pos.to(self.model.device)), self._fed[pos]
                self._last = self._last[pos.to(self._last.device)]
            self._rows = list(rows)
            new = want - self._fed
            if bool((new == 0).all()):
                return self._law(self._last)
            if bool((new > 0).all()):
                m = int(new.max())
                at = (self._fed[:, None] + torch.arange(m)).clamp(max=(want - 1)[:, None])
                fresh = context.tokens[torch.tensor(rows)[:, None], at].to(self.model.device)
                if m == 1:  # one token per row: the fast step
                    self._last = self.model.step(fresh[:, 0], self._cache)
                else:  # a chain pass over the new tokens, each row committing its own count
                    logits, tree_pass = self.model.forward_tree(TokenTree.from_shape(TreeShape.chain(m - 1), fresh),
                                                                self._cache)
                    num = new.to(self.model.device)
                    self.model.commit(self._cache, tree_pass,
                                      torch.arange(m, device=num.device).expand(len(rows), m).contiguous(), num)
                    self._last = logits[torch.arange(len(rows), device=num.device), num - 1]
                self._fed = want.clone()
                return self._law(self._last)
        # new rows, or rows advancing unevenly: start again from the contexts
        self._cache = self.model.allocate_cache(len(rows), self.max_length)
        self._last = self.model.prefill(context.tokens[torch.tensor(rows), : int(want.max())].to(self.model.device),
                                        self._cache, lengths=want)
        self._rows, self._fed = list(rows), want.clone()
        return self._law(self._last)

    def _law(self, logits: torch.Tensor) -> torch.Tensor:
        """The drafting law over the target's ids: softmax(logits / temperature), on the CPU."""
        return torch.softmax(logits[..., : self.vocab_size].float().cpu() / self.temperature, -1)

    def _q(self, tokens: torch.Tensor, work) -> torch.Tensor:
        """Feed one token per work row (each row a path of the tree); its next-token law."""
        return self._law(self.model.step(tokens.to(self.model.device), work))

    def _fork(self, work, rows: torch.Tensor):
        """The work cache's rows ``rows`` (repeats allowed): paths that branch get a copy each."""
        return work.select(rows.to(self.model.device))

    def propose(self, context: DraftContext, shape: TreeShape | TreeBudget | None = None) -> TokenTree:
        if self.mode == "static":
            shape = self.tree_shape(shape)  # checked before the cache advances
        root_q = self._advance(context)
        roots = context.last_tokens()
        if self.mode == "beam":
            return self._beam(roots, root_q)
        if isinstance(shape, TreeBudget):
            return self._grow(roots, root_q, shape, context.rows)
        return self._static(roots, root_q, shape)

    def _grow(self, roots: torch.Tensor, root_q: torch.Tensor, budget: TreeBudget, rows: list[int]) -> TokenTree:
        """A dynamic tree: the roots' laws are the cache advance's; each deeper level forks its
        kept nodes' parents' rows of a work cache and advances them by one step."""
        work = [self._cache]

        def expand(level: Level):
            if level.parent_pos is None:
                q = root_q
            else:
                work[0] = self._fork(work[0], torch.from_numpy(level.parent_pos))
                q = self._q(torch.from_numpy(level.tokens), work[0])
            probs, ids = torch.topk(q, min(self.top_k, q.shape[-1]), dim=-1)
            return ids.numpy(), probs.numpy()

        return grow(budget, roots.numpy(), expand, self._draw_order, self.stochastic, self.rates, rows)

    def _draw_order(self, probs: np.ndarray) -> np.ndarray:
        """Each row's top-k entries in draw order: Gumbel-top-k draws, or as ranked."""
        if not self.stochastic:
            return np.broadcast_to(np.arange(probs.shape[1]), probs.shape)
        u = torch.rand(probs.shape, generator=self.generator, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
        return gumbel_top_k(probs.astype(np.float32), probs.shape[1], (-(-u.log()).log()).float().numpy())

    def _static(self, roots: torch.Tensor, root_q: torch.Tensor, shape: TreeShape) -> TokenTree:
        """Level by level: the root's children come from the law the cache advance ended on;
        below, a work cache holds one row per (frontier node, batch row), copies of their
        parents' rows, advanced by the frontier's own tokens with one step. Each level costs one
        step over its new nodes."""
        b, n, kids = len(roots), shape.n, shape.children()
        K = max(self.top_k, max(map(len, kids)))
        tokens = torch.zeros(b, n, dtype=torch.long)
        tokens[:, 0] = roots
        child_ids = torch.zeros(b, n, K, dtype=torch.long)
        child_probs = torch.zeros(b, n, K)
        frontier = [0] if kids[0] else []  # nodes whose children are drawn next; rows node-major
        q = root_q[None]
        work = self._cache
        while frontier:
            # the whole level at once: node v's c children are the first c of its draws in order
            F, width = len(frontier), max(len(kids[v]) for v in frontier)
            probs, ids = torch.topk(q, min(K, q.shape[-1]), dim=-1)  # [F, b, k]
            k = probs.shape[-1]
            child_ids[:, frontier, :k], child_probs[:, frontier, :k] = ids.transpose(0, 1), probs.transpose(0, 1)
            if self.stochastic:
                u = torch.rand(probs.shape, generator=self.generator, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
                order = gumbel_top_k(probs.reshape(F * b, k), width, -(-u.log()).log().float().reshape(F * b, k))
                drawn = ids.reshape(F * b, k).gather(1, order).view(F, b, width)
            else:
                drawn = ids[..., :width]
            for j, v in enumerate(frontier):
                tokens[:, kids[v]] = drawn[j, :, : len(kids[v])]
            nxt = [(j, c) for j, v in enumerate(frontier) for c in kids[v] if kids[c]]
            if not nxt:
                break
            work = self._fork(work, torch.tensor([j * b + r for j, _ in nxt for r in range(b)]))
            frontier = [c for _, c in nxt]
            q = self._q(tokens[:, frontier].t().reshape(-1), work).view(len(frontier), b, -1)
        if not self.stochastic:
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
        for step in range(self.steps):
            width_in = beam_nodes.shape[1]
            if step > 0:
                q = self._q(tokens.gather(1, beam_nodes).reshape(-1), work).view(b, width_in, -1)
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
        return TokenTree(parents, tokens)
