"""Final answers: stree's rules (the answer phase after `</think>`, choice letters) around
math-verify's extraction and equivalence, and voting that groups equal values."""

import threading
import time

import pytest

from stree.patterns import answers
from stree.patterns.answers import extract_answer, group_answers, same_answer
from stree.patterns.tts import majority_vote


@pytest.mark.parametrize("text, choices, answer", [
    (r"<think>maybe \boxed{3}</think> so \boxed{4}.", None, "4"),  # a box while thinking is a draft
    (r"<think>maybe \boxed{3}", None, None),  # cut off before the answer phase
    (r"<think>\boxed{3}</think> the answer is 4", None, "4"),
    (r"<think>a</think>b</think> the answer is 5.", None, "5"),  # the last </think> opens the answer
    (r"The final answer is $\frac{1}{2}$. I hope it is correct", None, r"\frac{1}{2}"),
    ("so the answer is 42.", None, "42"),
    ("we get 3, then 17.5 apples and -2", None, "-2"),
    (r"so \boxed{4} and finally \boxed{\frac{1}{2}}.", None, r"4,\frac{1}{2}"),  # math-verify: every box, a set
    ("nothing numeric", None, None),
    ("I pick (B), no wait, C. Done", "ABCD", "C"),
    (r"</think>\boxed{D} (not A)", "ABCD", "D"),  # a box decides over later letters
    ("Answer unclear", "ABCD", None),  # the A of "Answer" is part of a word
])
def test_extract_answer(text, choices, answer):
    assert extract_answer(text, choices) == answer


# Equal and unequal pairs as math-verify judges them (its README's conventions: numbers in any
# notation, algebra up to sympy's simplification, sets unordered, intervals by their ends, percent
# and degrees dropped, an equation's right-hand side against a value).
EQUAL = [(r"\frac12", "0.5"), (r"\frac12", ".5"), (r"\dfrac{1}{2}", "1/2"), (r"x=\frac{2}{4}", r"\frac12"),
         (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt2}"), (r"\sqrt{8}", r"2\sqrt{2}"), ("2^{10}", "1024"),
         ("2^{10}", "1,024"), ("1024", r"1024^\circ"), (r"45\%", "45"), ("a+b", "b + a"), ("2x+x", "3x"),
         (r"\frac{\pi}{2}", r"\pi/2"), (r"\{1,2\}", r"\{2,1\}"), ("(1,2)", "(1,2)")]
UNEQUAL = [("1/2", "1/3"), ("x", "y"), ("2", "2.0001"), (r"\sqrt{2}", "1.4142"), ("(1,2)", "(2,1)"),
           ("[1,2)", "[1,2]"), (r"\{1,2\}", r"\{1,3\}"), ("10", r"\text{10 cm}"), ("yes", "no")]


@pytest.mark.parametrize("a, b", EQUAL)
def test_equal_answers(a, b):
    assert same_answer(a, b) and same_answer(b, a)


@pytest.mark.parametrize("a, b", UNEQUAL)
def test_unequal_answers(a, b):
    assert not same_answer(a, b) and not same_answer(b, a)


def test_answers_math_verify_cannot_read_compare_as_text():
    assert same_answer("yes", " yes") and not same_answer("yes", "no")


def test_grouping_and_voting():
    raw = [r"\frac12", "0.5", "1/3", r"\frac{1}{3}", None, "0.5"]
    assert group_answers(raw) == [0, 0, 2, 2, None, 0]
    assert majority_vote(raw) == r"\frac12"  # {1/2: 3, 1/3: 2}, returned as first written
    assert majority_vote(raw, same=None) == "0.5"  # exact strings: 0.5 twice
    assert majority_vote(raw, weights=[0.1, 0.1, 1.0, 1.0, 5.0, 0.1]) == "1/3"  # an abstention weighs nothing


def test_code_in_an_answer_is_never_run(tmp_path):
    marker = tmp_path / "ran"
    text = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    extract_answer(text)
    same_answer(text, "1")
    assert not marker.exists()


def test_a_tower_of_powers_gives_up_within_the_bound_in_the_main_thread(monkeypatch):
    monkeypatch.setattr(answers, "TIMEOUT_S", 1)
    start = time.perf_counter()
    assert not same_answer(r"9^{9^{9}}", "5")
    assert time.perf_counter() - start < 5.0


def test_other_threads_compare_without_signals():
    result = []
    worker = threading.Thread(target=lambda: result.append(same_answer(r"\frac{1}{4}", "0.25")))
    worker.start()
    worker.join()
    assert result == [True]
