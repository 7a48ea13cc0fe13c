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


def two_token_law(model, prompt: list[int], **sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact laws (float64) of the first token sampled after ``prompt`` ``[V]`` and of the
    second given the first ``[V, V]``, under ``sampling`` (temperature, top_k, top_p), from the
    model's own prefill and step; their joint is ``first[:, None] * second``."""
    from ..sampling.verify import process_logits

    cache = model.allocate_cache(1, len(prompt) + 2)
    first = process_logits(model.prefill(torch.tensor([prompt]), cache), **sampling)[0].double()
    second = torch.stack([process_logits(model.step(torch.tensor([t]), cache.clone()), **sampling)[0].double()
                          for t in range(model.vocab_size)])
    return first, second
