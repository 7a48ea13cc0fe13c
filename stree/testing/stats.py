"""Pearson's chi-square goodness of fit, for the sampling-losslessness tests."""

from __future__ import annotations

import torch


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int, float]:
    """``(statistic, degrees of freedom, p-value)`` of ``counts`` against the exact ``probs``.
    Cells expected below ``min_expected`` are pooled into one cell, as the test requires. A count in
    a cell of probability 0 gives p-value 0."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    total = counts.sum()
    if bool((counts[probs == 0] > 0).any()):
        return float("inf"), 0, 0.0
    expected = probs * total
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(exp) - 1
    pvalue = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, df, pvalue


def cell_counts(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Counts ``[V] * n`` of the rows of ``tokens`` ``[rows, n]`` (each row one cell), for
    :func:`chi_square` against a joint law of n tokens."""
    n = tokens.shape[1]
    flat = torch.zeros(len(tokens), dtype=torch.long)
    for j in range(n):
        flat = flat * vocab_size + tokens[:, j]
    return torch.bincount(flat, minlength=vocab_size**n).reshape((vocab_size,) * n)
