"""Answer extraction, normalisation and canonical forms for voting across trajectories."""

import time

import pytest
import sympy.parsing.sympy_parser as sympy_parser

from stree.answers import canonical_answer, extract_answer, normalize_answer
from stree.tts import majority_vote


@pytest.mark.parametrize("text, choices, answer", [
    (r"<think>maybe \boxed{3}</think> so \boxed{4}.", None, "4"),  # a box while thinking is a draft
    (r"<think>maybe \boxed{3}", None, None),
    (r"<think>\boxed{3}</think> the answer is 4", None, "4"),  # cut off before the answer phase
    (r"<think>a</think>b</think> the answer is 5.", None, "5"),  # the last </think> opens the answer
    (r"The final answer is $\frac{1}{2}$. I hope it is correct", None, r"\frac{1}{2}"),
    ("so the answer is 42.", None, "42"),
    ("we get 3, then 17.5 apples and -2", None, "-2"),
    ("nothing numeric", None, None),
    ("I pick (B), no wait, C. Done", "ABCD", "C"),
    (r"</think>\boxed{D} (not A)", "ABCD", "D"),  # a box decides over later letters
    ("Answer unclear", "ABCD", None),  # the A of "Answer" is part of a word
])
def test_extract_answer(text, choices, answer):
    assert extract_answer(text, choices) == answer


@pytest.mark.parametrize("raw, normal", [
    (r" $\dfrac12$. ", r"\frac{1}{2}"),
    (r"\left( 1, 2 \right)", "(1,2)"),
    (r"90^\circ", "90"),
    (r"45\%", "45"),
    (r"\text{10 cm}", "10cm"),
    ("1,234,567", "1234567"),
    ("1,2", "1,2"),  # not a thousands separator: a pair stays a pair
    ("x = .5", "0.5"),
    (r"\sqrt2+\frac{a}b", r"\sqrt{2}+\frac{a}{b}"),
])
def test_normalize_answer(raw, normal):
    assert normalize_answer(raw) == normal


@pytest.mark.parametrize("group", [
    [r"\frac12", "0.5", ".5", r"\dfrac{1}{2}", "1/2", r"x=\frac{2}{4}"],
    [r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt2}", r"\sqrt{\frac{1}{2}}", "0.5\\sqrt{2}"],
    [r"\sqrt{8}", r"2\sqrt{2}", r"2 \cdot \sqrt 2"],
    ["2^{10}", "1024", "1,024", r"1024^\circ"],
    ["a+b", "b + a"],
    ["2x+x", "3x", r"3\times x"],
    [r"\frac{\pi}{2}", r"\pi/2", r"0.5\pi"],
])
def test_equal_values_share_one_canonical_form(group):
    forms = {canonical_answer(a) for a in group}
    assert len(forms) == 1, forms


@pytest.mark.parametrize("a, b", [("1/2", "1/3"), ("x", "y"), ("2", "2.0001"), (r"\sqrt{2}", "1.4142"), ("E", "e"),
                                  ("(1,2)", "(2,1)")])
def test_different_values_stay_apart(a, b):
    assert canonical_answer(a) != canonical_answer(b)


@pytest.mark.parametrize("text", ["__import__('os').system('true')", "x.n(5)", "(1).real", "exec(1)", "ab*2",
                                  r"\sqrt[3]{8}", r"\frac{1}", "1/0", "(("])
def test_text_outside_the_whitelist_is_never_evaluated(text, monkeypatch):
    canonical_answer.cache_clear()
    parsed = []
    real = sympy_parser.parse_expr
    monkeypatch.setattr(sympy_parser, "parse_expr", lambda s, **kw: parsed.append(s) or real(s, **kw))
    assert canonical_answer(text) == normalize_answer(text)
    whitelisted = {"1/0", "(("}  # these reach the parser; it fails or gives no finite value
    assert bool(parsed) == (text in whitelisted)
    canonical_answer.cache_clear()


def test_towers_of_powers_are_not_evaluated():
    canonical_answer.cache_clear()
    start = time.perf_counter()
    assert canonical_answer(r"9^{9^{9}}") == r"9^{9^{9}}"
    assert canonical_answer(r"2^{100}") == r"2^{100}"  # exponent past the limit: compared as written
    assert time.perf_counter() - start < 2.0


def test_majority_vote_groups_equal_values():
    answers = [r"\frac12", "0.5", "1/3", r"\frac{1}{3}", "0.5"]
    assert majority_vote(answers) == r"\frac12"  # {1/2: 3, 1/3: 2}, returned as first written
    assert majority_vote(answers, key=None) == "0.5"  # exact strings: 0.5 twice, first tie
    assert majority_vote(answers, weights=[0.1, 0.1, 1.0, 1.0, 0.1]) == "1/3"
