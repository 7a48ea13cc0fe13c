"""The sampled-law check of tree="auto" choices: an order-1 Markov table (V = 4) and a mismatched
random drafter; 40k rows of 5 tokens decoded under a given choice, whose tokens 3-5 must fit the
exact law (the marginal of the first 5) by chi-square."""

import torch

from stree.decoding.loop import generate
from stree.testing import MarkovDrafter, MarkovLM, cell_counts, chi_square

V = 4
PROMPT = [1, 2, 0]


def sampled_under(auto):
    """``(output, p-value)`` of the 40k rows decoded with ``tree=auto`` (fixed seeds)."""
    torch.manual_seed(1)
    table = torch.distributions.Dirichlet(torch.full((V,), 0.6, dtype=torch.float64)).sample((V,))
    q = torch.distributions.Dirichlet(torch.ones(V)).sample((V,))
    model = MarkovLM(table)
    out = generate(model, [PROMPT] * 40_000, drafter=MarkovDrafter(q, seed=2), tree=auto, max_new_tokens=5,
                   temperature=1.0, seed=11)
    law = model.joint_law(PROMPT, 5).sum((0, 1))
    _, _, pvalue = chi_square(cell_counts(torch.tensor(out.new_tokens)[:, 2:], V), law)
    return out, pvalue
