"""Exact toy models for losslessness tests: an order-k Markov "LM" that implements the model
protocol, and a random drafter that declares the law it drew from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..drafters.base import DraftContext, Drafter
from ..drafters.stand import gumbel_top_k
from ..tree import TokenTree, TreeShape


@dataclass
class MarkovCache:
    history: torch.Tensor  # [b, max_length] committed tokens
    seqlens: torch.Tensor  # [b]
    max_length: int

    @property
    def batch_size(self) -> int:
        return self.seqlens.shape[0]

    def select(self, rows: torch.Tensor) -> "MarkovCache":
        return MarkovCache(self.history[rows], self.seqlens[rows], self.max_length)  # (indexing copies)

    def clone(self) -> "MarkovCache":
        return self.select(torch.arange(self.batch_size))

    def assign(self, rows: torch.Tensor, other: "MarkovCache") -> None:
        self.history[rows] = other.history
        self.seqlens[rows] = other.seqlens


class MarkovLM:
    """Next-token law ``table[t_{-k}, ..., t_{-1}]`` (``table`` ``[V] * k + [V]``, rows summing to
    1) given the last ``k`` tokens; prompts must hold at least ``k`` tokens. Logits are
    ``log(table)``, so the processed distribution at temperature 1 is the table itself."""

    def __init__(self, table: torch.Tensor):
        V = table.shape[-1]
        if table.dim() < 2 or any(s != V for s in table.shape):
            raise ValueError(f"table must have shape [V] * (k + 1), got {tuple(table.shape)}")
        if bool((table < 0).any()) or not torch.allclose(table.sum(-1), torch.ones((), dtype=table.dtype)):
            raise ValueError("table rows must be probability distributions")
        self.table = table
        self.order = table.dim() - 1
        self.vocab_size = V
        self.logits_table = table.reshape(-1, V).log().float()
        self.device = torch.device("cpu")
        self.dtype = torch.float32

    def joint_law(self, prompt, n: int) -> torch.Tensor:
        """Exact law ``[V] * n`` of the first n tokens sampled after ``prompt``."""
        V, k = self.vocab_size, self.order
        joint = torch.zeros((V,) * n, dtype=torch.float64)
        for idx in torch.cartesian_prod(*[torch.arange(V)] * n).reshape(-1, n).tolist():
            seq, p = list(prompt), 1.0
            for t in idx:
                p *= float(self.table[tuple(seq[-k:])][t])
                seq.append(t)
            joint[tuple(idx)] = p
        return joint

    def allocate_cache(self, batch_size: int, max_length: int) -> MarkovCache:
        return MarkovCache(torch.zeros(batch_size, max_length, dtype=torch.long), torch.zeros(batch_size, dtype=torch.long),
                           max_length)

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        """``last`` ``[..., k]`` oldest first -> logits ``[..., V]``."""
        V = self.vocab_size
        flat = torch.zeros(last.shape[:-1], dtype=torch.long)
        for j in range(self.order):
            flat = flat * V + last[..., j]
        return self.logits_table[flat]

    def _check(self, tokens: torch.Tensor, cache: MarkovCache, new: int):
        if bool(((tokens < 0) | (tokens >= self.vocab_size)).any()):
            raise ValueError(f"tokens outside the vocabulary [0, {self.vocab_size})")
        if int(cache.seqlens.max()) + new > cache.max_length:
            raise ValueError(f"sequence would pass the cache's max_length {cache.max_length}")

    def prefill(self, input_ids: torch.Tensor, cache: MarkovCache, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Append row b's first ``lengths[b]`` tokens to what the cache holds; the logits after each."""
        b, T = input_ids.shape
        lengths = torch.full((b,), T) if lengths is None else lengths.cpu().long()
        start = cache.seqlens.clone()
        if bool((start + lengths < self.order).any()):
            raise ValueError(f"prompts need at least {self.order} tokens for an order-{self.order} table")
        self._check(input_ids, cache, T)
        j = torch.arange(T)
        keep = j < lengths[:, None]  # each row's first lengths[row] tokens, after what it holds
        rows = torch.arange(b)[:, None].expand(b, T)
        cache.history[rows[keep], (start[:, None] + j)[keep]] = input_ids[keep]
        cache.seqlens += lengths
        cols = cache.seqlens[:, None] - self.order + torch.arange(self.order)
        return self._logits(cache.history.gather(1, cols))

    def forward_tree(self, tree: TokenTree, cache: MarkovCache, scan: str = "tree", validate: bool = True):
        """Logits at every node and the pass handle commit takes (here the tree itself)."""
        b, n = tree.tokens.shape
        self._check(tree.tokens, cache, int(tree.index.depth.max()) + 1)
        parents = tree.parents.expand(b, n)
        depth = tree.depth
        cur = torch.arange(n).expand(b, n)
        last = []
        for m in range(self.order):  # the m-th token back from each node along its path
            from_tree = tree.tokens.gather(1, cur)
            back = (cache.seqlens[:, None] - (m - depth)).clamp(0, cache.max_length - 1)
            last.append(torch.where(depth >= m, from_tree, cache.history.gather(1, back)))
            cur = torch.where(cur > 0, parents.gather(1, cur), 0)
        return self._logits(torch.stack(last[::-1], -1)), tree

    def forward_packed(self, tokens: torch.Tensor, trees, cache: MarkovCache, validate: bool = True):
        """Logits ``[1, total, V]`` of trees packed without padding (:class:`~stree.tree.PackedTrees`,
        tree r on row r): the padded trees' (padding nodes are leaves), packed; the handle commit
        takes is the padded tree, whose node indices are each packed tree's own."""
        padded = trees.unpack(tokens[..., None])[..., 0]
        logits, tree = self.forward_tree(TokenTree(trees.padded.parents.long(), padded), cache, validate=validate)
        return trees.pack(logits), tree

    def commit(self, cache: MarkovCache, tree: TokenTree, accepted: torch.Tensor, num_accepted: torch.Tensor,
               validate: bool = True) -> None:
        L = accepted.shape[1]
        keep = torch.arange(L) < num_accepted[:, None]
        rows = torch.arange(len(accepted))[:, None].expand(-1, L)[keep]
        cache.history[rows, (cache.seqlens[:, None] + torch.arange(L))[keep]] = tree.tokens.gather(1, accepted)[keep]
        cache.seqlens += num_accepted

    def step(self, tokens: torch.Tensor, cache: MarkovCache, validate: bool = True,
             heads: torch.Tensor | None = None) -> torch.Tensor:
        tree = TokenTree.from_shape(TreeShape.chain(0), tokens[:, None])
        logits, _ = self.forward_tree(tree, cache)
        self.commit(cache, tree, torch.zeros(len(tokens), 1, dtype=torch.long), torch.ones(len(tokens), dtype=torch.long))
        return logits[:, 0] if heads is None else logits[heads, 0]


class MarkovDrafter(Drafter):
    """Draws each node's children from ``q[node token]`` (``q`` ``[V, V]``), i.i.d. or without
    replacement (Gumbel-top-k, siblings in draw order), and attaches ``q`` as the declared law.
    Children past the support of ``q`` (without replacement) are invalid, and so are those past
    the ``V``-th."""

    def __init__(self, q: torch.Tensor, with_replacement: bool = False, seed: int = 0):
        self.q = q.float()
        self.with_replacement = with_replacement
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, context: DraftContext, shape: TreeShape) -> TokenTree:
        b, n, V = len(context), shape.n, self.q.shape[0]
        tokens = torch.zeros(b, n, dtype=torch.long)
        valid = torch.zeros(b, n, dtype=torch.bool)
        tokens[:, 0], valid[:, 0] = context.last_tokens(), True
        for v, kids in enumerate(shape.children()):
            if not kids:
                continue
            q = self.q[tokens[:, v]]
            if self.with_replacement:
                draws, ok = torch.multinomial(q, len(kids), replacement=True, generator=self.generator), True
            else:
                kids = kids[:V]  # past V draws without replacement nothing is left: those children stay invalid
                u = torch.rand(b, V, generator=self.generator).clamp(1e-12, 1 - 1e-12)
                draws = gumbel_top_k(q, len(kids), -(-u.log()).log())
                ok = q.gather(1, draws) > 0
            tokens[:, kids] = draws
            valid[:, kids] = valid[:, v:v + 1] & ok
        probs = self.q[tokens]
        ids = torch.arange(V).expand(b, n, V)
        return TokenTree(shape.parents_tensor(), tokens, valid, child_ids=ids, child_probs=probs,
                         with_replacement=self.with_replacement)
