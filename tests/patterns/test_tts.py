"""Test-time scaling: trajectories share one drafter store (later ones draft better), every drafter
is greedy-identical, and the answer-selection helpers."""

import pytest
import torch
from tiny_models import FAMILIES

from stree.drafters import NGramDrafter, PathStore, STANDStore
from stree.decoding.loop import generate
from stree.testing import MarkovLM
from stree.tree import TreeShape
from stree.patterns.tts import best_of_n, extract_boxed, majority_vote, sample_trajectories


def peaked_markov():
    torch.manual_seed(0)  # Dirichlet draws from the global generator
    return MarkovLM(torch.distributions.Dirichlet(torch.full((12,), 0.2, dtype=torch.float64)).sample((12, 12)))


# these tests compare acceptance across trajectories: a fixed tree, not tree="auto"'s choice
TREE = TreeShape.paper13()


@pytest.mark.parametrize("drafter", ["stand", "consensus"])
def test_later_trajectories_draft_from_earlier_ones(drafter):
    model = peaked_markov()
    out = sample_trajectories(model, [1, 2, 3, 1], 8, drafter=drafter, max_new_tokens=120, temperature=1.0, seed=0,
                              tree=TREE)
    assert len(out.tokens) == 8 and all(len(t) == 120 for t in out.tokens)
    later = sum(out.tau[4:8]) / 4
    assert later > out.tau[0] + 0.5, out.tau
    assert len(out.store) > 0
    # the returned store carries over: a new call starts where this one ended
    again = sample_trajectories(model, [1, 2, 3, 1], 1, drafter=drafter, max_new_tokens=120, temperature=1.0,
                                seed=9, store=out.store, tree=TREE)
    fresh = sample_trajectories(model, [1, 2, 3, 1], 1, drafter=drafter, max_new_tokens=120, temperature=1.0, seed=9,
                                tree=TREE)
    assert again.tau[0] > fresh.tau[0] + 0.5


def test_batches_share_the_store_and_seed_per_batch():
    model = peaked_markov()
    out = sample_trajectories(model, [1, 2, 3, 1], 8, drafter="stand", batch_size=4, max_new_tokens=60, seed=0,
                              tree=TREE)
    assert len(out.stats) == 2 and len(out.tau) == 8
    assert sum(out.tau[4:]) > sum(out.tau[:4])
    same = sample_trajectories(model, [1, 2, 3, 1], 8, drafter="stand", batch_size=4, max_new_tokens=60, seed=0,
                               tree=TREE)
    assert same.tokens == out.tokens
    other = sample_trajectories(model, [1, 2, 3, 1], 8, drafter="stand", batch_size=4, max_new_tokens=60, seed=1,
                                tree=TREE)
    assert other.tokens != out.tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_identity_with_every_drafter(family):
    model = FAMILIES[family]()
    prompt = torch.randint(0, model.vocab_size, (6,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = generate(model, [prompt], method="autoregressive", max_new_tokens=14).new_tokens[0]
    for drafter in ["stand", "ngram", "consensus", NGramDrafter(max_n=2), None]:
        out = sample_trajectories(model, prompt, 3, drafter=drafter, batch_size=2, temperature=0.0, max_new_tokens=14,
                                  tree=TREE if drafter is not None else None)
        assert out.tokens == [ref] * 3, drafter
        if drafter == "consensus":
            assert out.tau[2] > 1  # the second batch copies the first


def test_bad_arguments():
    model = peaked_markov()
    with pytest.raises(ValueError, match="n must be"):
        sample_trajectories(model, [1, 2], 0)
    with pytest.raises(ValueError, match="batch_size"):
        sample_trajectories(model, [1, 2], 2, batch_size=0)
    with pytest.raises(ValueError, match="drafter must be one of"):
        sample_trajectories(model, [1, 2], 2, drafter="eagle")
    with pytest.raises(TypeError, match="PathStore"):
        sample_trajectories(model, [1, 2], 2, drafter="consensus", store=STANDStore(capacity=4))
    with pytest.raises(TypeError, match="STANDStore"):
        sample_trajectories(model, [1, 2], 2, drafter="stand", store=PathStore())
    with pytest.raises(ValueError, match="takes no store"):
        sample_trajectories(model, [1, 2], 2, drafter="ngram", store=PathStore())


class Decoder:
    def decode(self, ids):
        return " ".join(map(str, ids))


def test_texts_are_decoded_with_the_tokenizer():
    out = sample_trajectories(peaked_markov(), [1, 2], 2, max_new_tokens=3, tokenizer=Decoder())
    assert out.texts == [" ".join(map(str, t)) for t in out.tokens]


def test_majority_vote():
    assert majority_vote(["4", "5", "5", None, "4", "5"]) == "5"
    assert majority_vote(["4", "5", "5", "4"]) == "4"  # tie: the first seen
    assert majority_vote([None, None]) is None and majority_vote([]) is None
    assert majority_vote(["4", "5", "5"], weights=[0.9, 0.3, 0.4]) == "4"
    with pytest.raises(ValueError, match="one weight per answer"):
        majority_vote(["4"], weights=[1, 2])


@pytest.mark.parametrize("text, answer", [
    (r"so \boxed{4} and finally \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
    (r"\boxed{ {a}{b} }", "{a}{b}"),
    (r"the answer is $\boxed 7$ indeed", "7"),
    (r"\boxed{\sqrt{2}", None),  # never closed
    ("no box here", None),
    (r"\boxedx", None),
])
def test_extract_boxed(text, answer):
    assert extract_boxed(text) == answer


def test_best_of_n():
    assert best_of_n(["a", "bbb", "cc", "ddd"], len) == ("bbb", 3)
    with pytest.raises(ValueError, match="at least one"):
        best_of_n([], len)
