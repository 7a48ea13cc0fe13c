"""Log-probabilities of generated tokens (``decode(..., logprobs=k)``): each token's and the top k
of the law it was drawn from, against the model stepped one token at a time, through plain steps
and verified trees of every kind of step; the tokens drawn are the same as without them."""

import math

import pytest
import torch
from tiny_models import FAMILIES, mamba2

from stree.decoding.loop import generate
from stree.drafters import NGramDrafter
from stree.drafters.registry import make_drafter
from stree.sampling.verify import process_logits
from stree.tree import TreeShape

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 3, 9, 3, 9], [1, 2, 3, 4, 1, 2, 3]]


def stepped_laws(model, prompt, tokens, **sampling):
    """The law each of ``tokens`` was drawn from, feeding them one by one after ``prompt``:
    greedy, the softmax of the logits; sampled, the processed law."""
    cache = model.allocate_cache(1, len(prompt) + len(tokens) + 1)
    logits = model.prefill(torch.tensor([prompt]), cache)
    laws = []
    for t in tokens:
        laws.append((process_logits(logits, **sampling) if sampling else torch.softmax(logits.float(), -1))[0].double())
        logits = model.step(torch.tensor([t]), cache)
    return laws


def check_logprobs(out, model, prompts, k, **sampling):
    for r, prompt in enumerate(prompts):
        tokens, lps = out.new_tokens[r], out.logprobs[r]
        assert [lp.token for lp in lps] == tokens
        for lp, law in zip(lps, stepped_laws(model, prompt, tokens, **sampling)):
            assert lp.logprob == pytest.approx(math.log(law[lp.token]), abs=1e-4)
            top = torch.topk(law, k)
            assert [i for i, _ in lp.top] == top.indices.tolist()
            assert [p for _, p in lp.top] == pytest.approx(top.values.log().tolist(), abs=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("how", ["autoregressive", "paper13", "auto", "stand-det"])
def test_greedy_logprobs_are_the_models_own_along_every_kind_of_step(family, how):
    model = FAMILIES[family]()
    kw = dict(max_new_tokens=12, eos_token_id=None)
    if how == "autoregressive":
        kw["method"] = "autoregressive"
    elif how == "paper13":
        kw.update(drafter=NGramDrafter(), tree=TreeShape.paper13())
    elif how == "auto":
        kw.update(drafter=NGramDrafter())
    else:  # a drafter learning from the target's top entries: fewer of them than logprobs keeps
        kw.update(drafter=make_drafter("stand-det", tokens=64), tree=TreeShape.paper13())
    plain = generate(model, PROMPTS, **kw)
    if how == "stand-det":
        kw["drafter"] = make_drafter("stand-det", tokens=64)
    out = generate(model, PROMPTS, logprobs=12, **kw)
    assert out.new_tokens == plain.new_tokens and plain.logprobs is None
    if how in ("paper13", "stand-det"):
        assert any(n > 1 for n in out.stats.trees) and any(sum(a) for a in out.stats.accepted)
    check_logprobs(out, model, PROMPTS, 12)


def test_sampled_logprobs_are_the_processed_laws_and_the_draws_do_not_change():
    model = mamba2(seed=3)
    sampling = dict(temperature=0.8, top_k=0, top_p=1.0)
    kw = dict(max_new_tokens=10, eos_token_id=None, seed=11, drafter=NGramDrafter(), tree=TreeShape.paper13(),
              **sampling)
    plain = generate(model, PROMPTS, **kw)
    out = generate(model, PROMPTS, logprobs=3, **kw)
    assert out.new_tokens == plain.new_tokens
    check_logprobs(out, model, PROMPTS, 3, **sampling)


def test_a_truncated_law_gives_minus_infinity_past_its_support():
    model = mamba2(seed=4)
    out = generate(model, PROMPTS[:1], max_new_tokens=6, eos_token_id=None, seed=2, temperature=1.0, top_k=2,
                   method="autoregressive", logprobs=4)
    for lp in out.logprobs[0]:
        assert math.isfinite(lp.logprob)
        assert [math.isfinite(p) for _, p in lp.top] == [True, True, False, False]
        assert sum(math.exp(p) for _, p in lp.top) == pytest.approx(1.0, abs=1e-5)


def test_rows_cut_by_a_stop_sequence_keep_the_logprobs_of_their_tokens():
    model = mamba2()
    full = generate(model, PROMPTS, max_new_tokens=12, eos_token_id=None, method="autoregressive", logprobs=0)
    stop = full.new_tokens[0][3:5]
    out = generate(model, PROMPTS, max_new_tokens=12, eos_token_id=None, drafter=NGramDrafter(),
                   tree=TreeShape.paper13(), logprobs=0, stop_sequences=[stop])
    for r in range(len(PROMPTS)):
        assert [lp.token for lp in out.logprobs[r]] == out.new_tokens[r]
        assert all(lp.top == () for lp in out.logprobs[r])
    assert len(out.new_tokens[0]) <= 5


@pytest.mark.parametrize("value, error", [(-1, ValueError), ("vocab + 1", ValueError), ("2", TypeError),
                                          (True, TypeError)])
def test_bad_logprobs_are_refused(value, error):
    model = mamba2()
    if value == "vocab + 1":
        value = model.vocab_size + 1
    with pytest.raises(error, match="logprobs"):
        generate(model, PROMPTS, max_new_tokens=2, logprobs=value)
