"""Sampling values of each row's own (SamplingParams.stack): every row's law is what its own values
give alone (a greedy row's the one-hot of its argmax), the values follow the rows as they leave a
batch, and decoding keeps each row's law (chi-square, fixed seeds) and each greedy row's tokens."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import FAMILIES

from stree.decoding.loop import generate
from stree.drafters import NGramDrafter
from stree.drafters.stand import STANDDrafter, STANDStore
from stree.sampling.verify import SamplingParams
from stree.testing import MarkovDrafter, MarkovLM, cell_counts, chi_square
from stree.tree import TreeShape

SEEDED_P = 1e-3

row_values = st.builds(SamplingParams, st.floats(0.05, 3.0), st.sampled_from([0, 1, 2, 5, 40, 41]),
                       st.sampled_from([1.0, 1.0, 0.9, 0.5, 0.01]))
greedy_rows = st.builds(SamplingParams, st.just(0.0), st.sampled_from([0, 5]), st.sampled_from([1.0, 0.5]))


def law(params: SamplingParams, logits: torch.Tensor) -> torch.Tensor:
    """What one row's own values give alone: its processed law, or greedy's argmax as a one-hot."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return params.probs(logits)


@settings(deadline=None)
@given(st.lists(st.one_of(row_values, greedy_rows), min_size=1, max_size=5), st.integers(1, 3),
       st.integers(0, 2**31 - 1))
def test_each_rows_law_is_what_its_own_values_give_alone(rows, nodes, seed):
    """Bit for bit, for logits [B, V] and [B, N, V] (V = 40: a top-k of 40 or 41 is no cut); what
    a row draws, and the law its drafter learns from (a greedy row's: the plain softmax)."""
    logits = torch.randn(len(rows), nodes, 40, generator=torch.Generator().manual_seed(seed)) * 3
    stacked = SamplingParams.stack(rows)
    if stacked.rows is None:  # (all greedy, or all alike: the one value they share)
        return
    for shaped in (logits, logits[:, 0]):
        probs, observed = stacked.probs(shaped), stacked.observed(shaped)
        for i, own in enumerate(rows):
            assert torch.equal(probs[i: i + 1], law(own, shaped[i: i + 1]))
            assert torch.equal(observed[i: i + 1], own.observed(shaped[i: i + 1]))
    drawn = stacked.sample(logits[:, 0], torch.Generator().manual_seed(seed))
    for i, own in enumerate(rows):
        assert law(own, logits[i, 0])[drawn[i]] > 0
        assert not own.greedy or drawn[i] == logits[i, 0].argmax()
    picked = stacked.select([len(rows) - 1, 0])
    if picked.rows is not None:
        assert torch.equal(picked.probs(logits[[-1, 0]]), stacked.probs(logits)[[-1, 0]])


def test_rows_that_agree_share_one_value_and_the_rest_is_refused():
    a, b = SamplingParams(0.7, 5), SamplingParams(1.0, 0, 0.9)
    assert SamplingParams.stack([a, a]) is a
    assert SamplingParams.stack([SamplingParams(0.0), SamplingParams(0.0, 5)]).greedy  # greedy ignores the rest
    ab = SamplingParams.stack([a, b, a])
    assert ab.rows == 3 and not ab.greedy and ab.temperature == (0.7, 1.0, 0.7) and ab.top_p == (1.0, 0.9, 1.0)
    assert ab.select([0, 2]) == a and ab.select([1, 0]).rows == 2 and not ab.some_greedy
    assert SamplingParams(temperature=(0.5,), top_k=(0,), top_p=(1.0,)).rows == 1
    mixed = SamplingParams.stack([a, SamplingParams(0.0), b])
    assert mixed.temperature == (0.7, 0.0, 1.0) and mixed.some_greedy and not mixed.greedy
    assert mixed.select([1]).greedy and mixed.select([0, 2]) == ab.select([0, 1])
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


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("drafter", ["autoregressive", "ngram", "stand"])
def test_greedy_rows_among_sampled_ones_decode_their_greedy_tokens(family, drafter):
    """Rows 0 and 3 greedy, 1 and 2 sampled, in one batch (trees of n-gram drafts, verified by the
    one-hot rule; of STAND's drawn drafts, without replacement; or plain steps): the greedy rows'
    tokens are those of the batch decoded greedily, and their log-probabilities the model's own."""
    model = FAMILIES[family]()
    g = torch.Generator().manual_seed(5)
    prompts = [(torch.randint(0, model.vocab_size, (3,), generator=g).tolist() * 3)[: 5 + i] for i in range(4)]
    values = [SamplingParams(0.0), SamplingParams(3.0, 50), SamplingParams(2.5, 0, 0.95), SamplingParams(0.0)]
    make = {"autoregressive": lambda: None, "ngram": NGramDrafter,
            "stand": lambda: STANDDrafter(STANDStore(), stochastic=True)}[drafter]
    kw = dict(max_new_tokens=24, eos_token_id=None, logprobs=2,
              **({"method": "autoregressive"} if drafter == "autoregressive" else {"tree": TreeShape.paper13()}))
    ref = generate(model, prompts, drafter=make(), **kw)
    accepted = sampled = 0
    for seed in range(3):
        out = generate(model, prompts, drafter=make(), sampling=SamplingParams.stack(values), seed=seed, **kw)
        for i in (0, 3):
            assert out.new_tokens[i] == ref.new_tokens[i], (seed, i)
            for got, want in zip(out.logprobs[i], ref.logprobs[i]):
                assert got.token == want.token and got.logprob == pytest.approx(want.logprob, abs=1e-4)
        sampled += out.new_tokens[1:3] != ref.new_tokens[1:3]
        accepted += sum(out.stats.accepted[0]) + sum(out.stats.accepted[3])
    assert sampled  # (the sampled rows did sample)
    assert (accepted > 10) == (drafter != "autoregressive")  # (drafts of the greedy rows' were accepted)
