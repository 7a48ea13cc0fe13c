"""Final answers of reasoning traces, for voting across trajectories (SPECREASON_AND_TTS.md §3):
find the answer, normalise its LaTeX, and reduce it to one canonical form so that ``\\frac12``,
``0.5`` and ``\\dfrac{1}{2}`` vote together.

The answer phase is the text after the last ``</think>``: a box inside the thinking is a draft.
A trace that opens ``<think>`` and never closes it was cut off before answering and has none.
"""

from __future__ import annotations

import re
import string
from functools import lru_cache

__all__ = ["extract_boxed", "extract_answer", "normalize_answer", "canonical_answer"]

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"


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
    end = _closing_brace(body, 0)
    return None if end is None else body[1:end].strip()


def _closing_brace(s: str, start: int) -> int | None:
    """Index of the ``}`` matching the ``{`` at ``start``."""
    depth = 0
    for j in range(start, len(s)):
        depth += s[j] == "{"
        depth -= s[j] == "}"
        if depth == 0:
            return j
    return None


def extract_answer(text: str, choices: str | None = None) -> str | None:
    """The final answer of a trace: in the answer phase, the last ``\\boxed``; else "final answer
    is $X$"; else "the answer is X"; else the last number. With ``choices`` (e.g. ``"ABCD"``) the
    last standalone choice letter instead. None when there is none."""
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    elif "<think>" in text:
        return None
    if choices is not None:
        letters = re.findall(rf"(?<![A-Za-z])([{re.escape(choices)}])(?![A-Za-z])", extract_boxed(text) or text)
        return letters[-1] if letters else None
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    for pattern in (r"final answer is \$(.+?)\$", r"the answer is:?\s*\$?([^\s$]+(?:\s*[^\s$.]+)*)"):
        found = re.findall(pattern, text, flags=re.IGNORECASE)
        if found:
            return found[-1].strip().rstrip(".")
    numbers = re.findall(_NUMBER, text)
    return numbers[-1] if numbers else None


def _brace_shorthand(s: str, command: str, args: int) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\sqrt2`` -> ``\\sqrt{2}``: single-character arguments
    written without braces get them."""
    out, i = [], 0
    while True:
        at = s.find(command, i)
        if at < 0:
            return "".join(out) + s[i:]
        out.append(s[i:at + len(command)])
        j = at + len(command)
        for _ in range(args):
            if j < len(s) and s[j] == "{":
                end = _closing_brace(s, j)
                if end is None:
                    break
                out.append(s[j:end + 1])
                j = end + 1
            elif j < len(s) and s[j].isalnum():
                out.append("{" + s[j] + "}")
                j += 1
        i = j


def normalize_answer(answer: str) -> str:
    """Formatting removed, meaning kept: spacing commands, ``\\left``/``\\right``, ``$``, degree and
    percent signs, ``\\text{}`` wrappers, a trailing period, ``dfrac``/``tfrac``, thousands commas,
    a leading ``x =``; brace shorthand completed and ``.5`` written ``0.5``."""
    s = answer.strip().rstrip(".").strip().strip("$").strip()
    s = re.sub(r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}", r"\1", s)
    for junk in ("\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\$", "\\%", "%",
                 "^{\\circ}", "^\\circ", "°"):
        s = s.replace(junk, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = re.sub(r"^[A-Za-z]=(?=.)", "", s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    s = re.sub(r"(?<![\d.])\.(\d)", r"0.\1", s)
    return _brace_shorthand(_brace_shorthand(s, "\\frac", 2), "\\sqrt", 1)


_NAMES = {"sqrt", "pi"}
_MAX_EXPONENT = 64  # 9^{9^{9}} must not be evaluated


def _expand_frac(s: str) -> str | None:
    """``\\frac{A}{B}`` -> ``((A)/(B))``, nested ones too; None when the braces do not pair up."""
    at = s.find("\\frac{")
    if at < 0:
        return s
    num_start = at + len("\\frac")
    num_end = _closing_brace(s, num_start)
    if num_end is None or s[num_end + 1:num_end + 2] != "{":
        return None
    den_end = _closing_brace(s, num_end + 1)
    if den_end is None:
        return None
    parts = [_expand_frac(s[num_start + 1:num_end]), _expand_frac(s[num_end + 2:den_end]), _expand_frac(s[den_end + 1:])]
    if None in parts:
        return None
    return f"{s[:at]}(({parts[0]})/({parts[1]})){parts[2]}"


def _to_sympy_text(s: str) -> str | None:
    """The small LaTeX subset answers use, as sympy input; None for anything else. Only digits,
    single letters, ``sqrt``, ``pi``, operators and parentheses get through, and a dot only inside
    a number, so no attribute access or call of anything else can reach ``eval``."""
    s = _expand_frac(s)
    if s is None:
        return None
    for old, new in {"\\cdot": "*", "\\times": "*", "\\pi": " pi ", "\\sqrt": "sqrt", "^": "**", "{": "(",
                     "}": ")"}.items():
        s = s.replace(old, new)
    if "\\" in s or not re.fullmatch(r"[0-9A-Za-z+\-*/(). ]+", s) or re.search(r"\.(?!\d)|(?<!\d)\.", s):
        return None
    if any(len(w) > 1 and w not in _NAMES for w in re.findall(r"[A-Za-z]+", s)):
        return None
    return s


@lru_cache(maxsize=4096)
def canonical_answer(answer: str | None) -> str | None:
    """One string per mathematical value: the normalised answer simplified by sympy when it is a
    short expression in numbers, single-letter variables, fractions, square roots, powers (small
    exponents) and pi, floats made rational; else the normalised string."""
    if answer is None:
        return None
    s = normalize_answer(answer)
    text = _to_sympy_text(s) if len(s) <= 80 else None
    if text is None:
        return s
    import sympy
    from sympy.parsing.sympy_parser import implicit_multiplication_application, parse_expr, standard_transformations

    names = {c: sympy.Symbol(c) for c in string.ascii_letters}  # not sympy's E, I, N, S, O, Q
    names.update(sqrt=sympy.sqrt, pi=sympy.pi)
    try:
        expr = parse_expr(text, local_dict=names, evaluate=False,
                          transformations=standard_transformations + (implicit_multiplication_application,))
        if any(isinstance(p, sympy.Pow) and (not p.exp.is_Number or abs(p.exp) > _MAX_EXPONENT)
               for p in sympy.preorder_traversal(expr)):
            return s
        value = sympy.simplify(sympy.nsimplify(expr, rational=True))
        return s if value.has(sympy.zoo, sympy.oo, sympy.nan) else str(value)
    except Exception:  # model text: any parse or simplify failure means "compare as written"
        return s
