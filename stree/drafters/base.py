"""The drafter protocol. Drafters see token ids only: never a model or its cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tree import TokenTree, TreeShape


@dataclass
class DraftContext:
    """What a drafter may read: ``tokens`` ``[R, T]`` (CPU, right-padded) and ``lengths`` ``[R]``
    hold every row's prompt and generated tokens, indexed by *stable* row id; ``rows`` lists the
    ids of the rows to draft for, in batch order. A row's last token is the root of its tree.
    Rows only grow between calls, so a drafter may index each row incrementally."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    rows: list[int]

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, i: int, start: int = 0) -> list[int]:
        """Tokens ``start:`` of the i-th drafted row, as a list."""
        r = self.rows[i]
        return self.tokens[r, start: int(self.lengths[r])].tolist()

    def last_tokens(self) -> torch.Tensor:
        rows = torch.tensor(self.rows, dtype=torch.long)
        return self.tokens[rows, self.lengths[rows] - 1]


class Drafter:
    """``propose`` returns a :class:`TokenTree` (CPU) with one row per drafted row, the root token
    equal to the row's last token, siblings numbered in draw order, ``valid`` marking nodes the
    drafter could not fill, and ``child_ids``/``child_probs`` when its drafts are random."""

    #: how many of the target's most likely next tokens ``observe`` wants at each emitted position
    #: (0: none, so the loop skips the top-k)
    target_top_k = 0

    def reset(self) -> None:
        """Forget per-row state: the next ``propose`` starts new rows."""

    def propose(self, context: DraftContext, shape: TreeShape) -> TokenTree:
        raise NotImplementedError

    def observe(self, rows: list[int], tokens: list[list[int]], target_top: list[tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """After a verify step, rows in batch order: each row's emitted tokens and, if
        ``target_top_k``, the top entries ``(ids [len, k], probs [len, k])`` of the processed target
        distribution each emitted token was drawn from (at temperature 0: the softmax of the
        logits). Emitted token i follows the row's context plus emitted tokens 0..i-1."""
