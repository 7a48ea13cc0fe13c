"""Final answers of reasoning traces, found and compared for voting across trajectories
(SPECREASON_AND_TTS.md §3) with Hugging Face's math-verify, the checker the reasoning-evaluation
ecosystem uses: LaTeX and plain answers (a box first), sets, intervals, units and percent, and
equivalence by sympy, so that ``\\frac12``, ``0.5`` and ``\\dfrac{1}{2}`` are one answer.

stree's own rules stay where math-verify has none: the answer phase is the text after the last
``</think>`` (a box inside the thinking is a draft; a trace that opens ``<think>`` and never
closes it was cut off before answering and has none), and multiple-choice letters.

math-verify bounds sympy's work with ``signal.alarm``, which only the main thread may set: there
a parse or comparison gives up after ``TIMEOUT_S`` (a tower such as ``9^{9^{9}}`` compares as
different from everything); in other threads it runs without that bound.
"""

from __future__ import annotations

import re
import threading
from functools import lru_cache

__all__ = ["TIMEOUT_S", "extract_answer", "extract_boxed", "group_answers", "same_answer"]

TIMEOUT_S = 2


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def extract_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (nested braces kept, e.g. ``\\frac{a}{b}``), or of
    ``\\boxed x`` up to the next ``$``; None when there is no box or its braces never close."""
    at = text.rfind("\\boxed")
    if at < 0:
        return None
    rest = text[at + len("\\boxed"):]
    body = rest.lstrip()
    if not body.startswith("{"):
        if rest == body:  # "\boxedfoo" is another command
            return None
        answer = body.split("$", 1)[0].strip()
        return answer or None
    depth = 0
    for j, c in enumerate(body):
        depth += (c == "{") - (c == "}")
        if depth == 0:
            return body[1:j].strip()
    return None


@lru_cache(maxsize=4096)
def _parse(text: str) -> tuple:
    """math-verify's parse of ``text``: ``(value, the answer as written)``, or ``()``."""
    from math_verify import parse

    return tuple(parse(text, parsing_timeout=_timeout()))


def extract_answer(text: str, choices: str | None = None) -> str | None:
    """The final answer of a trace, as written: in the answer phase, what math-verify finds (boxes
    first, several of them one answer, their set; then a stated answer, then the last number or
    expression); with ``choices``
    (e.g. ``"ABCD"``) the last standalone choice letter instead (in the box when there is one).
    None when there is none."""
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    elif "<think>" in text:
        return None
    if choices is not None:
        letters = re.findall(rf"(?<![A-Za-z])([{re.escape(choices)}])(?![A-Za-z])", extract_boxed(text) or text)
        return letters[-1] if letters else None
    parsed = _parse(text)
    return str(parsed[1]) if len(parsed) > 1 else None


def _value(answer: str) -> tuple:
    """An extracted answer's parse (as math: it is read as LaTeX between dollars)."""
    return _parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")


def same_answer(a: str, b: str) -> bool:
    """Whether two answers are one value by math-verify (either way round: it reads its first
    argument as the reference), or, where it parses neither, the same text but for spacing."""
    from math_verify import verify

    if a == b:
        return True
    va, vb = _value(a), _value(b)
    if not va or not vb:
        return not va and not vb and a.split() == b.split()
    timeout = _timeout()
    return verify(list(va), list(vb), timeout_seconds=timeout) or verify(list(vb), list(va), timeout_seconds=timeout)


def group_answers(answers, same=same_answer) -> list[int | None]:
    """Each answer's group: the index of the first answer ``same`` finds it equal to (None for a
    None answer). Groups are compared through their first answer."""
    firsts: list[int] = []
    out: list[int | None] = []
    for i, a in enumerate(answers):
        if a is None:
            out.append(None)
            continue
        group = next((f for f in firsts if same(answers[f], a)), None)
        if group is None:
            firsts.append(i)
            group = i
        out.append(group)
    return out
