"""Decoding states as handles (stree.patterns.branch) and the loop's plumbing under them: continuing from
a cache, forks that do not touch each other, scoring without committing, stop sequences cut
exactly even when accepted drafts run past them, a budget per row."""

import pytest
import torch
from tiny_models import FAMILIES, VOCAB

from stree.patterns.branch import Branch
from stree.drafters.registry import make_drafter
from stree.decoding.loop import generate
from stree.testing.markov import MarkovLM
from stree.tree import TreeShape

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9]]


def _reference(model, n=40):
    return generate(model, PROMPTS, method="autoregressive", max_new_tokens=n).sequences


def _same_state(branch: Branch, row: int, model) -> None:
    """The row's state equals a fresh prefill of its context: same next-token logits after it."""
    fresh = Branch.start(model, [branch.contexts[row]], branch.cache.max_length)
    mine = branch.fork([row]).logits([[5, 6]])[0]
    torch.testing.assert_close(mine, fresh.logits([[5, 6]])[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("drafter", [None, "ngram", "stand"])
def test_continuing_a_cache_decodes_as_from_scratch(family, drafter):
    """generate(cache=...) from every split point gives the tokens of one uninterrupted run."""
    model = FAMILIES[family]()
    ref = _reference(model)
    for split in (1, 6, 13):
        contexts = [r[: len(p) + split] for r, p in zip(ref, PROMPTS)]
        branch = Branch.start(model, contexts, 100)
        out = generate(model, contexts, cache=branch.cache, max_new_tokens=40 - split, drafter=None if drafter is None
                       else make_drafter(drafter), method="autoregressive" if drafter is None else "stree")
        assert out.sequences == ref and not out.stats.prefilled


@pytest.mark.parametrize("family", FAMILIES)
def test_forks_decode_apart_and_continue_exactly(family):
    """Two forks decoded differently leave each other and the parent alone; the state after a
    generate (rows cut inside accepted paths and rows carried along included) is the state of
    its context from scratch, and decoding on from it continues the uninterrupted run."""
    model = FAMILIES[family]()
    ref = _reference(model)
    parent = Branch.start(model, PROMPTS, 100)
    before = parent.logits([[3], [4]])
    a, b = parent.fork([0, 0, 1]), parent.fork([1])
    out = a.generate([5, 11, 2], drafter=make_drafter("stand"))  # budgets cut inside accepted paths
    b.generate(9, temperature=1.0, seed=3)
    assert [len(t) for t in out.new_tokens] == [5, 11, 2] and out.finish_reasons == ["length"] * 3
    for i, r in enumerate([0, 0, 1]):
        assert a.contexts[i] == ref[r][: len(a.contexts[i])]
        _same_state(a, i, model)
    _same_state(b, 0, model)
    for x, y in zip(parent.logits([[3], [4]]), before):
        assert torch.equal(x, y)
    a.generate(10, drafter=make_drafter("ngram"))
    assert [c == ref[r][: len(c)] for c, r in zip(a.contexts, [0, 0, 1])] == [True] * 3


@pytest.mark.parametrize("family", FAMILIES)
def test_extend_then_score_equals_a_fresh_context(family):
    model = FAMILIES[family]()
    branch = Branch.start(model, PROMPTS, 64)
    branch.extend([[9, 10, 11], []])
    assert branch.contexts == [PROMPTS[0] + [9, 10, 11], PROMPTS[1]]
    for row in (0, 1):
        _same_state(branch, row, model)
    # log-probs: the log-softmax of the logits after each prefix, one step at a time
    cont = [4, 5, 6]
    got = branch.fork([1]).logprobs([cont])[0]
    want = []
    for i, t in enumerate(cont):
        lg = Branch.start(model, [PROMPTS[1] + cont[:i]], 64).logits([[]])[0][0]
        want.append(torch.log_softmax(lg, -1)[t])
    torch.testing.assert_close(got, torch.stack(want), atol=1e-4, rtol=1e-4)


def test_logits_of_a_suffix_longer_than_one_pass_go_through_a_fork(monkeypatch):
    import stree.patterns.branch as br

    model = FAMILIES["mamba2"]()
    branch = Branch.start(model, [PROMPTS[0]], 64)
    whole = branch.logits([list(range(1, 12))])[0]
    monkeypatch.setattr(br, "MAX_TREE_NODES", 4)
    chunked = branch.logits([list(range(1, 12))])[0]
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-4)
    assert branch.contexts == [PROMPTS[0]]
    with pytest.raises(ValueError, match="at most 4 tokens"):
        br.feed_chains(model, branch.cache, [list(range(6))], commit=False)


def _first_occurrence_inside_a_step(gen: list[int], accepted: list[int]) -> list[int]:
    """The shortest run of ``gen`` that first occurs ending at a token emitted before the end of
    its decoding step (so drafts accepted in that step run past it)."""
    ends, n = set(), 1  # the prefill emitted one token, then each step its accepted drafts and the bonus
    for a in accepted:
        n += a + 1
        ends.add(n)
    for e in range(2, len(gen)):
        if e + 1 in ends:
            continue
        for size in range(2, e + 1):
            seq = gen[e - size + 1: e + 1]
            if all(gen[i: i + size] != seq for i in range(e - size + 1)):
                return seq
    raise AssertionError("no such run")


@pytest.mark.parametrize("method", ["stree", "autoregressive"])
def test_stop_sequences_cut_exactly_where_drafts_run_past(method):
    """A multi-token stop sequence whose first occurrence ends inside an accepted path: the row
    keeps through it, drops the drafts accepted past it, and its state continues the run exactly."""
    model = FAMILIES["hybrid"]()
    ref = _reference(model)[0]
    n = len(PROMPTS[0])
    gen = ref[n:]
    # a fixed tree, drafted every step: the stop must fall inside an accepted path (tree="auto" may step plainly)
    run = generate(model, [PROMPTS[0]], drafter=make_drafter("ngram"), tree=TreeShape.paper13(), max_new_tokens=40)
    assert run.new_tokens[0] == gen
    stop = _first_occurrence_inside_a_step(gen, run.stats.accepted[0])
    end = next(e for e in range(len(gen)) if gen[e - len(stop) + 1: e + 1] == stop)
    assert len(stop) > 1
    branch = Branch.start(model, [PROMPTS[0]], 100)
    drafting = dict(drafter=make_drafter("ngram"), tree=TreeShape.paper13()) if method == "stree" else {}
    out = branch.generate(40, stop_sequences=[stop, [VOCAB - 1] * 5], method=method, **drafting)
    assert out.new_tokens[0] == gen[: end + 1] and out.finish_reasons == ["stop"]
    branch.generate(8)
    assert branch.contexts[0] == ref[: len(branch.contexts[0])]


def test_a_budget_per_row():
    model = FAMILIES["hybrid"]()
    out = generate(model, PROMPTS, max_new_tokens=[3, 7])
    assert [len(t) for t in out.new_tokens] == [3, 7]
    with pytest.raises(ValueError, match="max_new_tokens holds 1 values for 2 rows"):
        generate(model, PROMPTS, max_new_tokens=[3])
    with pytest.raises(ValueError, match=r"max_new_tokens\[1\] must be"):
        generate(model, PROMPTS, max_new_tokens=[3, 0])


def test_markov_branches():
    """The model protocol alone (a MarkovLM): fork, extend, generate."""
    table = torch.softmax(torch.randn(4, 4, 4, generator=torch.Generator().manual_seed(0)), -1).double()
    model = MarkovLM(table)
    ref = generate(model, [[0, 1, 2]], method="autoregressive", max_new_tokens=12).sequences[0]
    branch = Branch.start(model, [[0, 1, 2]], 32)
    f = branch.fork([0, 0])
    f.generate([4, 6])
    f.extend([ref[7:9], []])
    f.generate(3)
    assert f.contexts == [ref[:12], ref[:12]]
    assert branch.contexts == [[0, 1, 2]]


def test_bad_input_names_the_argument():
    model = FAMILIES["mamba2"]()
    branch = Branch.start(model, PROMPTS, 24)
    with pytest.raises(ValueError, match=r"rows holds 2, not a row index in \[0, 2\)"):
        branch.fork([0, 2])
    with pytest.raises(ValueError, match="new_tokens must hold one token list per row"):
        branch.extend([[1]])
    with pytest.raises(ValueError, match=rf"new_tokens\[0\] holds {model.vocab_size}, not a token id"):
        branch.extend([[model.vocab_size], []])
    with pytest.raises(ValueError, match="row 0 holds 8 tokens: 20 more pass the branch's max_length 24"):
        branch.extend([[1] * 20, []])
    with pytest.raises(ValueError, match="stop strings are matched on text: pass the tokenizer"):
        branch.generate(4, stop="\n")
    with pytest.raises(ValueError, match="max_length must be an int >= the longest prompt"):
        Branch.start(model, PROMPTS, 4)
    with pytest.raises(ValueError, match="cache row 0 holds 7 tokens; continuing a context of 9 tokens needs 8"):
        generate(model, [PROMPTS[0] + [1], PROMPTS[1]], cache=branch.cache, max_new_tokens=2)
    with pytest.raises(ValueError, match="max_length is the size of a new cache"):
        generate(model, PROMPTS, cache=branch.cache, max_new_tokens=2, max_length=30)
    with pytest.raises(ValueError, match=r"stop_sequences\[0\] must be a non-empty list"):
        generate(model, PROMPTS, max_new_tokens=2, stop_sequences=[[]])
    with pytest.raises(ValueError, match=r"stop_sequences\[0\] holds -1"):
        generate(model, PROMPTS, max_new_tokens=2, stop_sequences=[[-1]])
    assert branch.contexts == PROMPTS  # nothing moved


@pytest.mark.parametrize("family", FAMILIES)
def test_extend_commits_a_scored_prefix_without_a_second_forward(family, monkeypatch):
    """A prefix of a scored suffix is committed from the scoring pass (no forward); a pass the
    cache moved past, or a suffix the tokens do not begin, is fed again; the state is exact."""
    model = FAMILIES[family]()
    branch = Branch.start(model, PROMPTS, 64)
    scored = branch.score([[9, 10, 11, 12], [4, 5]])
    forwards = []
    real = type(model).forward_tree
    monkeypatch.setattr(type(model), "forward_tree", lambda *a, **kw: forwards.append(1) or real(*a, **kw))
    branch.extend([[9, 10], [4, 5]], scored=scored)
    assert not forwards and branch.contexts == [PROMPTS[0] + [9, 10], PROMPTS[1] + [4, 5]]
    for row in (0, 1):
        _same_state(branch, row, model)
    forwards.clear()
    branch.extend([[1], [2]], scored=scored)  # stale: the cache moved since
    assert len(forwards) == 1
    again = branch.score([[3, 4], [5]])
    branch.extend([[4], [5]], scored=again)  # row 0 does not begin its suffix
    assert len(forwards) == 3 and branch.contexts[0][-2:] == [1, 4]
    for row in (0, 1):
        _same_state(branch, row, model)
