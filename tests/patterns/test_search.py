"""Step-level search (stree.patterns.search): on a MarkovLM with a deterministic scorer, beam search wide
enough to keep every path finds the brute-force best one, and narrower searches keep exactly the
best candidates at every iteration; on the shipped target, branches drafting from one shared STAND
store accept more than branches with stores of their own."""

import itertools

import pytest
import torch

from stree.tools.demo import TARGET
from stree.drafters.stand import STANDStore
from stree.lm import LM
from stree.patterns.search import beam_search, dvts
from stree.testing.markov import MarkovLM
from stree.tree import TreeShape

V, PROMPT = 3, [0, 1]


def _markov():
    table = torch.rand(V, V, generator=torch.Generator().manual_seed(0)) + 0.3
    return MarkovLM((table / table.sum(-1, keepdim=True)).double())


_W = torch.rand(*(V + 1,) * 4, generator=torch.Generator().manual_seed(1)).tolist()


def _score(context, step):
    """A fixed value for every generated path of up to 4 tokens (V marks 'no token')."""
    path = (context[len(PROMPT):] + step + [V] * 4)[:4]
    return _W[path[0]][path[1]][path[2]][path[3]]


def test_a_beam_wide_enough_finds_the_brute_force_best_path():
    """One-token steps, every path kept (27 beams), enough draws that every token shows up: the
    search's answer is the best of all V^3 paths."""
    res = beam_search(_markov(), PROMPT, width=V**3, expand=16, steps=3, scorer=_score, stop=None,
                      max_step_tokens=1, temperature=1.0, drafter=None)
    best = max(itertools.product(range(V), repeat=3), key=lambda p: _score(PROMPT, list(p)))
    assert res.tokens == list(best) and res.value == _score(PROMPT, list(best))
    assert len([c for c in res.candidates if c.iteration == 2 and c.kept]) == V**3


@pytest.mark.parametrize("kind", ["beam", "dvts"])
@pytest.mark.parametrize("drafter", [None, "stand"])
def test_every_iteration_keeps_the_best_candidates(kind, drafter):
    """Checked against the recorded candidates: each group keeps its best ``keep`` distinct
    candidates by value, every kept step continues a kept one, and the answer is the best
    trajectory that ended or survived."""
    search = beam_search if kind == "beam" else dvts
    res = search(_markov(), PROMPT, width=2, expand=3, steps=4, scorer=_score, stop=None, max_step_tokens=2,
                 temperature=1.0, drafter=drafter, aggregate="last", seed=5)
    keep = 2 if kind == "beam" else 1
    cands = res.candidates
    for it in range(res.stats.iterations):
        for g in {c.group for c in cands if c.iteration == it}:
            group = [i for i, c in enumerate(cands) if c.iteration == it and c.group == g]
            distinct = {}
            for i in group:
                distinct.setdefault((cands[i].parent, tuple(cands[i].tokens)), i)
            ranked = sorted(distinct.values(), key=lambda i: -cands[i].value)
            assert {i for i in group if cands[i].kept} == set(ranked[:keep])
            for i in group:
                parent = cands[i].parent
                assert parent == -1 or (cands[parent].kept and not cands[parent].ended)
                before, j = [], parent
                while j >= 0:
                    before = cands[j].tokens + before
                    j = cands[j].parent
                assert cands[i].value == cands[i].score == _score(PROMPT + before, cands[i].tokens)
    finals = [i for i, c in enumerate(cands) if c.kept and (c.ended or c.iteration == res.stats.iterations - 1)]
    best = max(finals, key=lambda i: (cands[i].value, -i))
    assert res.steps[-1] == best and res.value == cands[best].value
    assert res.tokens == [t for i in res.steps for t in cands[i].tokens]
    assert res.stats.scorer_calls == len(cands) == res.stats.forks


def test_values_aggregate_the_steps_scores():
    res = beam_search(_markov(), PROMPT, width=2, expand=2, steps=3, scorer=lambda c, s: float(len(c)),
                      stop=None, max_step_tokens=1, temperature=1.0, drafter=None, aggregate="sum")
    # step k scores the context length before it: 2, 3, 4 -> the trajectory's sum 9
    assert res.value == 9.0 and [res.candidates[i].score for i in res.steps] == [2.0, 3.0, 4.0]


@pytest.fixture(scope="module")
def lm():
    return LM.from_pretrained(TARGET, dtype="float32")


def test_branches_drafting_from_one_store_accept_more(lm):
    """DVTS on the shipped target (sampled steps): with the shared STAND store the candidates after
    the first iteration accept more drafts per step than with a fresh store per branch."""
    taus = {}
    for shared in (True, False):
        res = dvts(lm.model, "def fibonacci(n):", tokenizer=lm.tokenizer, width=2, expand=2, steps=3,
                   max_step_tokens=16, scorer="logprob", share_store=shared, temperature=0.8, seed=0,
                   tree=TreeShape.paper13())  # acceptance is compared: a fixed tree, not tree="auto"'s choice
        later = [c for c in res.candidates if c.iteration > 0]
        taus[shared] = sum(len(c.tokens) for c in later) / sum(len(c.tokens) / c.tau for c in later)
        assert (res.store is not None) == shared
    assert taus[True] > taus[False], taus


def test_self_evaluation_scores_with_the_judge_prompt(lm):
    res = beam_search(lm.model, "def add(a, b):", tokenizer=lm.tokenizer, width=2, expand=2, steps=2,
                      max_step_tokens=8, scorer="prompt", score="expected", seed=1)
    assert res.stats.judge_forwards == res.stats.iterations
    assert all(0 <= c.score <= 9 for c in res.candidates)
    assert res.text == lm.tokenizer.decode(res.tokens)


def test_bad_input():
    model = _markov()
    with pytest.raises(ValueError, match="width must be"):
        beam_search(model, PROMPT, width=0, scorer=_score, stop=None)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'widht'"):
        dvts(model, PROMPT, widht=2, scorer=_score, stop=None)
    with pytest.raises(ValueError, match="aggregate must be one of"):
        dvts(model, PROMPT, aggregate="max", scorer=_score, stop=None)
    with pytest.raises(ValueError, match="a text prompt needs the tokenizer"):
        dvts(model, "hello", scorer=_score, stop=None)
    with pytest.raises(ValueError, match="drafter must be"):
        dvts(model, PROMPT, scorer=_score, stop=None, drafter="magic")
    with pytest.raises(ValueError, match="share_store=False gives every branch a fresh store"):
        dvts(model, PROMPT, scorer=_score, stop=None, share_store=False, store=STANDStore())
