"""Scoring a reasoning step with the model itself (SPECREASON_AND_TTS.md §1-2): SpecReason's judge
and the self-evaluation step-level search uses in place of a process reward model.

- ``"prompt"``: the model reads the step followed by :data:`JUDGE_TEMPLATE` (its question asked as
  the user's next turn in the model's chat format when the tokenizer has one), and the 0-9 score is
  read from its distribution at the next position (``score`` "greedy": the argmax token's digit,
  0 when it is none; "expected": the mean digit, renormalised over the ten digit tokens; the
  probability on digit tokens is reported beside it).
- ``"logprob"``: the mean log-probability (nats) of the step's tokens under the model.
- a callable ``(context, step) -> float``: text when a tokenizer is given, else token-id lists.

All of them score a batch of steps in one forward, on the branches the steps were written from
(nothing is committed: the judge's tokens never enter a trajectory).
"""

from __future__ import annotations

import math

import torch

from .branch import Branch, Scored, log_probs
from .chat import next_turn

__all__ = ["JUDGE_PREFIX", "JUDGE_QUESTION", "JUDGE_TEMPLATE", "JUDGES", "Judge", "SCORE_READINGS", "digit_ids",
           "read_score"]

# The judge turn that follows the step: the paper's instructions (evaluate the last step for
# factual correctness and logical validity only, score 0 to 9) and an answer prefix that leaves
# the score digit as the very next token. Plain text for models without a chat template; with
# one, the question is the user's next message and the prefix opens the model's reply.
JUDGE_QUESTION = ("Evaluate the last reasoning step above solely for its factual correctness and logical validity. "
                  "Ignore style, phrasing and overall usefulness. Give a quality score from 0 to 9.")
JUDGE_PREFIX = "I think the quality score is: "
JUDGE_TEMPLATE = f"\n{JUDGE_QUESTION}\n<think>\n{JUDGE_PREFIX}"
JUDGES = ("prompt", "logprob")
SCORE_READINGS = ("greedy", "expected")


def digit_ids(tokenizer) -> list[int]:
    """The token id of each digit 0..9; a ValueError when one is not a single token."""
    ids = []
    for d in range(10):
        enc = tokenizer.encode(str(d), add_special_tokens=False)
        if len(enc) != 1:
            raise ValueError(f"the prompt judge reads a digit token, but {str(d)!r} encodes to {enc}")
        ids.append(enc[0])
    return ids


def read_score(logits: torch.Tensor, digits: list[int], method: str = "greedy") -> tuple[float, float]:
    """The 0-9 score from next-token ``logits [V]``, and the probability on the digit tokens.
    ``greedy``: the argmax token's digit (0 when it is no digit); ``expected``: the mean digit
    under the distribution renormalised over the ten digits (0 when they hold no mass)."""
    if method not in SCORE_READINGS:
        raise ValueError(f"score must be one of {SCORE_READINGS}, got {method!r}")
    probs = torch.softmax(logits.double(), -1)
    at = probs[digits]
    mass = float(at.sum())
    if method == "greedy":
        top = int(logits.argmax())
        return float(digits.index(top)) if top in digits else 0.0, mass
    if mass == 0:
        return 0.0, 0.0
    return float((at / mass * torch.arange(10, dtype=at.dtype, device=at.device)).sum()), mass


class Judge:
    """``judge`` ("prompt", "logprob" or a callable, see the module) with its ``tokenizer`` (needed
    by "prompt" and by a callable that reads text), the ``score`` reading and the ``template``
    (the default's question becomes the user's next turn, in the model's own chat format, when
    the tokenizer has a chat template)."""

    def __init__(self, judge, tokenizer=None, score: str = "greedy", template: str = JUDGE_TEMPLATE):
        if not (judge in JUDGES or callable(judge)):
            raise ValueError(f"judge must be one of {JUDGES} or a callable (context, step) -> float, got {judge!r}")
        if score not in SCORE_READINGS:
            raise ValueError(f"score must be one of {SCORE_READINGS}, got {score!r}")
        if judge == "prompt":
            if tokenizer is None:
                raise ValueError("the prompt judge encodes its template: pass the tokenizer")
            if not isinstance(template, str) or not template:
                raise ValueError(f"template must be a non-empty string, got {template!r}")
            self.digits = digit_ids(tokenizer)
            turn = next_turn(tokenizer, JUDGE_QUESTION) if template == JUDGE_TEMPLATE else None
            if turn is not None:  # the model's own chat format: its reply ends, the question is asked
                template = turn + ("" if turn.rstrip().endswith("<think>") else "<think>\n") + JUDGE_PREFIX
            self.template = tokenizer.encode(template, add_special_tokens=False)
        self.judge, self.tokenizer, self.score = judge, tokenizer, score
        self.forwards = 0  # the model forwards the judge ran

    def __call__(self, parents: Branch, steps: list[list[int]]) -> tuple[list[tuple[float, float | None]], Scored | None]:
        """Per row of ``parents`` (the branches before their step), ``(score, digit_mass)`` of
        ``steps[r]`` (digit_mass: None but for the prompt judge; an empty step scores -inf), and
        the model's pass over the steps (None for a callable judge): ``parents.extend(steps,
        scored=...)`` keeps a step at no second forward."""
        if self.judge == "prompt":
            self.forwards += 1
            scored = parents.score([s + self.template for s in steps])
            return [read_score(lg[-1], self.digits, self.score) if s else (-math.inf, 0.0)
                    for lg, s in zip(scored.logits, steps)], scored
        if self.judge == "logprob":
            self.forwards += 1
            scored = parents.score(steps)
            return [(float(lp.mean()) if len(lp) else -math.inf, None) for lp in log_probs(scored)], scored
        out = []
        for context, step in zip(parents.contexts, steps):
            if self.tokenizer is not None:
                context, step = self.tokenizer.decode(context), self.tokenizer.decode(step)
            value = self.judge(context, step)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise TypeError(f"the judge returned {value!r}, not a number")
            out.append((float(value), None))
        return out, None
