"""SpecReason (stree.patterns.reasoning) on the shipped pair with scripted judges: accepting every step gives
the small model's greedy text, rejecting every step the base model's (token identity, with and
without token-level speculation); threshold boundaries; the judge prompt as specified; the score
readings; the answer after the end of thinking."""

import math

import pytest
import torch

from stree.patterns.branch import Branch
from stree.tools.demo import DRAFTER, TARGET
from stree.drafters import STANDDrafter, STANDStore
from stree.decoding.loop import generate
from stree.patterns.judge import JUDGE_TEMPLATE, Judge, digit_ids, read_score
from stree.lm import LM
from stree.models import load
from stree.patterns.reasoning import spec_reason
from stree.tree import TreeShape

PROMPT = "def fibonacci(n):"
N = 48


@pytest.fixture(scope="module")
def pair():
    lm = LM.from_pretrained(TARGET, dtype="float32")
    return lm.model, load(DRAFTER, dtype=torch.float32), lm.tokenizer


def _greedy(model, tok, n=N):
    return generate(model, [tok.encode(PROMPT)], method="autoregressive", max_new_tokens=n).new_tokens[0]


def _reason(pair, **kw):
    base, small, tok = pair
    kw.setdefault("max_new_tokens", N)
    kw.setdefault("eos_token_id", [])
    return spec_reason(base, small, tok, PROMPT, **kw)


def shaped():
    """A deterministic STAND drafter built for a tree of its own: drafted every step, whatever
    tree="auto" would choose (so the speculative path is certain to run)."""
    return STANDDrafter(STANDStore(), TreeShape.paper13(), stochastic=False)


@pytest.mark.parametrize("small_spec", [True, False, "shaped"])
def test_accepting_every_step_gives_the_small_models_text(pair, small_spec):
    base, small, tok = pair
    spec = shaped() if small_spec == "shaped" else small_spec
    out = _reason(pair, judge=lambda context, step: 9.0, max_step_tokens=16, small_spec=spec)
    assert out.token_ids == _greedy(small, tok)
    assert out.text == tok.decode(out.token_ids)
    assert len(out.steps) > 2 and all(s.by == "small" for s in out.steps)
    assert out.stats.share_accepted == 1.0 and out.stats.base_tokens == 0
    if small_spec == "shaped":
        assert out.stats.small_forwards < N  # speculative: fewer forwards than tokens
    else:  # tree="auto" steps plainly where trees do not pay: never more forwards than tokens
        assert (out.stats.small_forwards <= N) and (small_spec or out.stats.small_forwards == N)


@pytest.mark.parametrize("token_spec", [False, True, "small", "ngram", "shaped"])
def test_rejecting_every_step_gives_the_base_models_text(pair, token_spec):
    base, small, tok = pair
    spec = shaped() if token_spec == "shaped" else token_spec
    out = _reason(pair, judge=lambda context, step: 0.0, threshold=1, token_spec=spec)
    assert out.token_ids == _greedy(base, tok)
    assert all(s.by == "base" and s.score == 0.0 for s in out.steps)
    assert out.stats.accepted == 0 and out.stats.base_tokens == N and out.stats.judged == len(out.steps)
    st = out.stats  # the wall-time split: every part measured, together within the total
    assert min(st.time_small, st.time_judge, st.time_base, st.time_sync) > 0
    assert st.time_small + st.time_judge + st.time_base + st.time_sync <= st.time_total
    if token_spec == "shaped":
        assert out.stats.base_forwards < N  # speculative: fewer forwards than tokens
    elif token_spec:  # tree="auto" steps plainly where trees do not pay here: never more forwards
        assert out.stats.base_forwards <= N


def test_the_threshold_is_inclusive(pair):
    seen = []

    def judge(context, step):
        seen.append((context, step))
        return 5.0

    assert _reason(pair, judge=judge, threshold=5.0).stats.share_accepted == 1.0
    assert _reason(pair, judge=judge, threshold=math.nextafter(5.0, 6.0)).stats.share_accepted == 0.0
    context, step = seen[1]
    assert context.startswith(PROMPT) and step and context == PROMPT + seen[0][1]  # the text so far, then the step


def test_the_judge_prompt_is_the_step_then_the_template(pair, monkeypatch):
    """The base model reads its context's last token, the step, the encoded template, in one tree
    pass, and the score is read at the position after the template."""
    base, small, tok = pair
    fed = []
    real = type(base).forward_tree

    def spy(self, tree, cache, *a, **kw):
        fed.append(tree.tokens[0].tolist())
        return real(self, tree, cache, *a, **kw)

    monkeypatch.setattr(type(base), "forward_tree", spy)
    out = _reason(pair, judge="prompt", token_spec=False, max_new_tokens=12)
    template = tok.encode(JUDGE_TEMPLATE, add_special_tokens=False)
    first = out.steps[0]
    judged = [f for f in fed if f[-len(template):] == template]
    assert len(judged) == out.stats.judge_forwards == out.stats.judged
    assert judged[0] == [tok.encode(PROMPT)[-1]] + (first.tokens if first.by == "small" else judged[0][1:-len(template)]) + template


def test_score_readings():
    digits = list(range(10, 20))
    logits = torch.full((30,), -30.0)
    logits[digits[7]], logits[digits[3]] = 2.0, 2.0 - math.log(3)  # p(7) = 3 p(3)
    score, mass = read_score(logits, digits, "greedy")
    assert score == 7.0 and mass == pytest.approx(1.0, abs=1e-6)
    score, _ = read_score(logits, digits, "expected")
    assert score == pytest.approx(0.75 * 7 + 0.25 * 3, abs=1e-6)
    logits[0] = 10.0  # a non-digit token on top: greedy reads 0; expected ignores it, mass reports it
    score, mass = read_score(logits, digits, "greedy")
    assert score == 0.0 and mass < 0.01
    assert read_score(logits, digits, "expected")[0] == pytest.approx(6.0, abs=1e-6)


def test_the_logprob_judge_is_the_mean_log_probability(pair):
    base, small, tok = pair
    out = _reason(pair, judge="logprob", threshold=-100.0, max_new_tokens=10)
    step = out.steps[0].tokens
    lp = Branch.start(base, [tok.encode(PROMPT)], 64).logprobs([step])[0]
    assert out.steps[0].score == pytest.approx(float(lp.mean()), abs=1e-5)
    assert out.stats.judge_forwards == out.stats.judged


def test_after_the_end_of_thinking_the_base_model_answers(pair):
    """A step showing ``think_end`` ends the speculated part; the base model writes the rest of
    the budget from there, as its own greedy continuation."""
    base, small, tok = pair
    first = _reason(pair, judge=lambda c, s: 9.0, max_step_tokens=16).steps[0]
    marker = first.text.strip()[:4]
    out = _reason(pair, judge=lambda c, s: 9.0, max_step_tokens=16, think_end=marker)
    assert [s.by for s in out.steps] == ["small", "base"]
    ids = tok.encode(PROMPT) + out.steps[0].tokens
    rest = generate(base, [ids], method="autoregressive", max_new_tokens=N - len(out.steps[0].tokens))
    assert out.steps[1].tokens == rest.new_tokens[0]


def test_bad_input(pair):
    base, small, tok = pair
    with pytest.raises(ValueError, match="judge must be one of"):
        _reason(pair, judge="vibes")
    with pytest.raises(ValueError, match="score must be one of"):
        _reason(pair, score="mean")
    with pytest.raises(TypeError, match="the judge returned 'yes', not a number"):
        _reason(pair, judge=lambda c, s: "yes", threshold=1)
    with pytest.raises(ValueError, match="token_spec must be"):
        _reason(pair, token_spec="fast")
    with pytest.raises(ValueError, match="small_spec='small' drafts with the small model"):
        _reason(pair, small_spec="small")
    with pytest.raises(ValueError, match="max_step_tokens must be"):
        _reason(pair, max_step_tokens=0)
    with pytest.raises(ValueError, match="base and small must share a vocabulary"):
        spec_reason(base, _OtherVocabulary(base.vocab_size + 8), tok, PROMPT)
    with pytest.raises(ValueError, match="the prompt judge encodes its template: pass the tokenizer"):
        Judge("prompt")
    assert len(digit_ids(tok)) == 10


class _OtherVocabulary:
    def __init__(self, vocab_size):
        self.vocab_size = vocab_size


def test_sampled_steps_repeat_with_the_seed(pair):
    kw = dict(judge="logprob", threshold=-2.0, temperature=0.8, top_p=0.95, max_new_tokens=32)
    a, b, c = (_reason(pair, seed=s, **kw) for s in (5, 5, 6))
    assert a.token_ids == b.token_ids and [s.by for s in a.steps] == [s.by for s in b.steps]
    assert a.token_ids != c.token_ids


def test_every_speculation_setting_has_room(pair):
    """The states are sized for the deepest tree either model drafts (STAND's optimised trees reach
    depth 20), whatever the judge's template length."""
    for token_spec, small_spec in ((False, True), ("ngram", "stand-det"), (True, False)):
        out = _reason(pair, judge="logprob", threshold=-2.0, token_spec=token_spec, small_spec=small_spec,
                      max_new_tokens=40, max_step_tokens=40)
        assert len(out.token_ids) == 40
