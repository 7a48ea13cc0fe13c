"""Sampling values of each row's own (SamplingParams.stack): every row's law is what its own values
give alone, the values follow the rows as they leave a batch, and decoding keeps each row's law
(chi-square, fixed seeds)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stree.decoding.loop import generate
from stree.sampling.verify import SamplingParams
from stree.testing import MarkovDrafter, MarkovLM, cell_counts, chi_square
from stree.tree import TreeShape

SEEDED_P = 1e-3

row_values = st.builds(SamplingParams, st.floats(0.05, 3.0), st.sampled_from([0, 1, 2, 5, 40, 41]),
                       st.sampled_from([1.0, 1.0, 0.9, 0.5, 0.01]))


@settings(deadline=None)
@given(st.lists(row_values, min_size=1, max_size=5), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_each_rows_law_is_what_its_own_values_give_alone(rows, nodes, seed):
    """Bit for bit, for logits [B, V] and [B, N, V] (V = 40: a top-k of 40 or 41 is no cut)."""
    logits = torch.randn(len(rows), nodes, 40, generator=torch.Generator().manual_seed(seed)) * 3
    stacked = SamplingParams.stack(rows)
    for shaped in (logits, logits[:, 0]):
        probs = stacked.probs(shaped)
        for i, own in enumerate(rows):
            assert torch.equal(probs[i: i + 1], own.probs(shaped[i: i + 1]))
    picked = stacked.select([len(rows) - 1, 0])
    assert torch.equal(picked.probs(logits[[-1, 0]]), stacked.probs(logits)[[-1, 0]])


def test_rows_that_agree_share_one_value_and_the_rest_is_refused():
    a, b = SamplingParams(0.7, 5), SamplingParams(1.0, 0, 0.9)
    assert SamplingParams.stack([a, a]) is a
    assert SamplingParams.stack([SamplingParams(0.0), SamplingParams(0.0, 5)]).greedy  # greedy ignores the rest
    ab = SamplingParams.stack([a, b, a])
    assert ab.rows == 3 and not ab.greedy and ab.temperature == (0.7, 1.0, 0.7) and ab.top_p == (1.0, 0.9, 1.0)
    assert ab.select([0, 2]) == a and ab.select([1, 0]).rows == 2
    assert SamplingParams(temperature=(0.5,), top_k=(0,), top_p=(1.0,)).rows == 1
    with pytest.raises(ValueError, match="greedy and sampled rows cannot share a batch"):
        SamplingParams.stack([a, SamplingParams(0.0)])
    with pytest.raises(ValueError, match="modes differ"):
        SamplingParams.stack([a, SamplingParams(0.7, 5, mode="naive")])
    with pytest.raises(TypeError, match="non-empty sequence of SamplingParams"):
        SamplingParams.stack([])
    with pytest.raises(TypeError, match="non-empty sequence of SamplingParams"):
        SamplingParams.stack([ab])
    with pytest.raises(ValueError, match="tuples of one value per row each, of one length"):
        SamplingParams(temperature=(0.5, 1.0), top_k=(0,), top_p=(1.0, 1.0))
    with pytest.raises(ValueError, match="tuples of one value per row each"):
        SamplingParams(temperature=(0.5, 1.0), top_k=0, top_p=1.0)
    with pytest.raises(ValueError, match="row 1: top_p must be in"):
        SamplingParams(temperature=(0.5, 1.0), top_k=(0, 0), top_p=(1.0, 2.0))
    with pytest.raises(ValueError, match="row 0: temperature 0"):
        SamplingParams(temperature=(0.0, 1.0), top_k=(0, 0), top_p=(1.0, 1.0))
    with pytest.raises(ValueError, match="logits have 2 rows but the sampling values 3"):
        ab.probs(torch.zeros(2, 8))
    with pytest.raises(ValueError, match="sampling holds values for 3 rows, but there are 2 prompts"):
        generate(MarkovLM(torch.full((4, 4), 0.25, dtype=torch.float64)), [[1], [2]], sampling=ab, max_new_tokens=2)


def test_decoding_keeps_each_rows_law_as_rows_leave_the_batch():
    """An order-1 Markov table (V = 4) and a mismatched random drafter's trees; rows of three values
    in turn, one of them ending after 2 tokens (the batch is compacted, the values with it): tokens
    3-5 of each of the other two fit the law of their own values, enumerated (chi-square)."""
    V = 4
    torch.manual_seed(1)
    table = torch.distributions.Dirichlet(torch.full((V,), 0.6, dtype=torch.float64)).sample((V,))
    q = torch.distributions.Dirichlet(torch.ones(V)).sample((V,))
    kinds = [(SamplingParams(1.0), 5), (SamplingParams(0.5, 3), 5), (SamplingParams(0.8, 0, 0.7), 2)]
    rows = [kinds[i % 3] for i in range(45_000)]
    prompt = [1, 2, 0]
    out = generate(MarkovLM(table), [prompt] * len(rows), drafter=MarkovDrafter(q, seed=2),
                   tree=TreeShape.from_spec("full:2x2"), max_new_tokens=[budget for _, budget in rows],
                   sampling=SamplingParams.stack([params for params, _ in rows]), seed=11)
    assert out.stats.trees == {7: out.stats.target_forwards}
    for kind, (params, _) in enumerate(kinds[:2]):
        law_table = params.probs(table.log())  # the processed next-token law after each token
        law = MarkovLM(law_table.double() / law_table.double().sum(-1, keepdim=True)).joint_law(prompt, 5).sum((0, 1))
        tokens = torch.tensor([t for t, r in zip(out.new_tokens, rows) if r is kinds[kind]])[:, 2:]
        _, _, pvalue = chi_square(cell_counts(tokens, V), law)  # (0 where a token falls outside the law)
        assert pvalue > SEEDED_P, (kind, pvalue)
