"""The decoding definition for models: feed tokens one at a time with ``step``."""

from __future__ import annotations

import torch


def sequential_logits(model, cache, row: int, tokens):
    """Logits after feeding ``tokens`` one by one to a copy of row ``row`` of ``cache``; returns
    ``(logits [V], the copied single-row cache)``. ``cache`` itself is not changed."""
    sub = cache.select(torch.tensor([row], device=cache.seqlens.device))
    logits = None
    for t in tokens:
        logits = model.step(torch.tensor([t], device=sub.seqlens.device), sub)
    return logits[0], sub
