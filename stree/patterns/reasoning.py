"""SpecReason (paper 002): a small model writes each reasoning step, the base model judges it in
one forward pass, and writes the step itself when the judge rejects it, then with token-level
STree speculative decoding (the paper's SpecReason+Decode).

Steps are the text between ``step_delimiter`` occurrences (kept in the step). Both models keep a
:class:`~stree.patterns.branch.Branch`: the small model's state is snapshotted before it writes (a fork:
O(state) per Mamba layer), the base model scores the step plus the judge prompt without committing
it, and an accepted step is appended to the base model's state, a rejected one is replaced by the
base model's own step, which the small model then reads from its snapshot. After ``think_end``
(when a step shows it) the base model writes the rest alone. The method is lossy by design: an
accepted step is the small model's, not the base model's (SPECREASON_AND_TTS.md §1).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from ..decoding.args import integer
from ..decoding.autotree import tree_room
from .branch import Branch
from .chat import prompt_ids as chat_prompt_ids
from ..drafters.base import Drafter
from ..drafters.registry import resolve_drafter
from .judge import JUDGE_TEMPLATE, Judge

__all__ = ["ReasonOutput", "ReasonStats", "Step", "spec_reason"]

DEFAULT_THRESHOLD = {"prompt": 7.0, "logprob": -1.5}  # a 0-9 score; a mean log-probability in nats


@dataclass
class Step:
    """One reasoning step: its ``tokens`` and ``text``, who wrote the kept version (``by``:
    "small" or "base"), the judge's ``score`` of the small model's attempt (None when none was
    judged) and ``digit_mass`` (the prompt judge's probability on digit tokens)."""

    tokens: list[int]
    text: str
    by: str
    score: float | None = None
    digit_mass: float | None = None


@dataclass
class ReasonStats:
    """Counts and wall time (seconds) by part: ``small`` writing steps, ``judge`` scoring them,
    ``base`` writing rejected steps and the answer, ``sync`` feeding the other model the kept
    steps."""

    steps: int = 0
    judged: int = 0
    accepted: int = 0
    small_tokens: int = 0  # written by the small model, rejected attempts included
    base_tokens: int = 0  # written by the base model
    small_forwards: int = 0  # the small model's decoding forwards
    judge_forwards: int = 0
    base_forwards: int = 0  # the base model's decoding forwards (its tree passes)
    time_small: float = 0.0
    time_judge: float = 0.0
    time_base: float = 0.0
    time_sync: float = 0.0
    time_total: float = 0.0
    scores: list[float] = field(default_factory=list)

    @property
    def share_accepted(self) -> float:
        """Share of judged steps the small model's attempt was kept."""
        return self.accepted / self.judged if self.judged else float("nan")


@dataclass
class ReasonOutput:
    """The generated ``text`` and ``token_ids`` (every kept step, then the answer), the ``steps``,
    and the ``stats``."""

    text: str
    token_ids: list[int]
    steps: list[Step]
    stats: ReasonStats


def _drafter(token_spec, small, temperature: float, name: str = "token_spec") -> Drafter | None:
    if token_spec is False or token_spec is None:
        return None
    if token_spec == "small" and small is None:
        raise ValueError(f"{name}='small' drafts with the small model: not for the small model itself")
    if token_spec is True:  # greedy steps verify greedily: STAND's top-k trees beat its sampled ones there
        token_spec = "stand-det" if temperature == 0 else "stand"
    if token_spec == "small":
        token_spec = "ssm-static"
    return resolve_drafter(token_spec, argument=name, also=("True", "False", "small"), drafter_model=small,
                           model_hint=" (the small model; not for the small model itself)")


def check_threshold(judge, threshold) -> float:
    """The threshold in force: ``threshold``, else the judge's default."""
    if threshold is None:
        return DEFAULT_THRESHOLD.get(judge, 7.0) if isinstance(judge, str) else 7.0
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not math.isfinite(threshold):
        raise ValueError(f"threshold must be a finite number, got {threshold!r}")
    return float(threshold)


@torch.no_grad()
def spec_reason(base, small, tokenizer, prompt: str, *, judge="prompt", threshold: float | None = None,
                score: str = "greedy", step_delimiter: str = "\n\n", max_step_tokens: int = 128,
                max_new_tokens: int = 512, token_spec=True, small_spec=True, temperature: float = 0.0, top_p: float = 1.0,
                seed: int | None = None, eos_token_id=None, judge_template: str = JUDGE_TEMPLATE,
                think_end: str | None = "</think>", base_steps: int = 0) -> ReasonOutput:
    """Answer ``prompt`` (text; the user's message through the tokenizer's chat template when it
    has one) with ``small`` speculating reasoning steps for ``base`` (two models over one
    vocabulary, ``tokenizer`` shared).

    ``judge``: ``"prompt"`` (the base model reads the step followed by ``judge_template`` and
    scores it 0-9 at the next token; ``score`` "greedy" reads the argmax digit, "expected" the
    mean digit), ``"logprob"`` (the base model's mean log-probability of the step's tokens, in
    nats) or a callable ``(context_text, step_text) -> float``. A step is kept when its score is
    ``>= threshold`` (default -1.5 for the log-probability judge, else 7, the paper's).
    ``max_step_tokens``: the cap on one step; ``max_new_tokens``: on all kept tokens (checked
    step by step, the last step is cut to fit). ``token_spec``: how the base model writes its
    steps: True (STree drafting from a STAND store kept across the call: "stand-det" for greedy
    steps, else "stand"), "stand", "stand-det", "ngram",
    "small" (the small model drafting static trees), a Drafter, or False (autoregressive).
    ``small_spec``: the same for the small model's own steps (lossless for its distribution, so
    its steps are what it would write token by token; "small" excluded).
    ``temperature``/``top_p``: both models' sampling; ``seed`` makes a sampled run repeatable.
    ``base_steps``: the first steps are the base model's, unjudged (the paper's early planning
    steps). ``eos_token_id``: ends the answer (default the tokenizer's).

    One function for a reason: the loop over steps (the small model's attempt, the judge, the base
    model's step, the answer) keeps one state per model, and each part is a call into
    :class:`~stree.patterns.branch.Branch`."""
    start = time.perf_counter()
    if base.vocab_size != small.vocab_size:
        raise ValueError(f"base and small must share a vocabulary: {base.vocab_size} vs {small.vocab_size} tokens")
    scorer = Judge(judge, tokenizer, score, judge_template)
    threshold = check_threshold(judge, threshold)
    max_step_tokens = integer("max_step_tokens", max_step_tokens, low=1)
    max_new_tokens = integer("max_new_tokens", max_new_tokens, low=1)
    base_steps = integer("base_steps", base_steps, low=0)
    if not isinstance(step_delimiter, str) or not step_delimiter:
        raise ValueError(f"step_delimiter must be a non-empty string, got {step_delimiter!r}")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"prompt must be a non-empty string, got {prompt!r}")
    prompt_ids = chat_prompt_ids(tokenizer, prompt)
    drafter = _drafter(token_spec, small, temperature)
    small_drafter = _drafter(small_spec, None, temperature, "small_spec")
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    depth = max(tree_room(d) for d in (drafter, small_drafter))
    room = len(prompt_ids) + max_new_tokens + max_step_tokens + len(getattr(scorer, "template", [])) + depth + 2
    base_br, small_br = Branch.start(base, [prompt_ids], room), Branch.start(small, [prompt_ids], room)
    stats, steps, kept = ReasonStats(), [], []
    seeds = iter(range(seed, seed + 10**9)) if seed is not None else None
    decode_kw = dict(temperature=temperature, top_p=top_p, eos_token_id=eos, stop=step_delimiter, tokenizer=tokenizer)
    thinking = True

    def lap(t0: float) -> float:
        return time.perf_counter() - t0

    def base_writes(budget: int, stop: bool):
        t0 = time.perf_counter()
        kw = dict(decode_kw) if stop else {k: v for k, v in decode_kw.items() if k not in ("stop", "tokenizer")}
        out = base_br.generate(budget, drafter=drafter, seed=next(seeds) if seeds else None, **kw)
        stats.base_tokens += len(out.new_tokens[0])
        stats.base_forwards += out.stats.target_forwards
        stats.time_base += lap(t0)
        return out.new_tokens[0], out.finish_reasons[0]

    while len(kept) < max_new_tokens:
        budget = min(max_step_tokens, max_new_tokens - len(kept))
        if not thinking:  # the answer: the base model alone, to the end
            tokens, reason = base_writes(max_new_tokens - len(kept), stop=False)
            steps.append(Step(tokens, tokenizer.decode(tokens), "base"))
            kept += tokens
            break
        if len(steps) < base_steps:
            tokens, reason = base_writes(budget, stop=True)
            step = Step(tokens, tokenizer.decode(tokens), "base")
            t0 = time.perf_counter()
            small_br.extend([tokens])
            stats.time_sync += lap(t0)
        else:
            t0 = time.perf_counter()
            before = small_br.fork()
            out = small_br.generate(budget, drafter=small_drafter, seed=next(seeds) if seeds else None, **decode_kw)
            tokens, reason = out.new_tokens[0], out.finish_reasons[0]
            stats.small_tokens += len(tokens)
            stats.small_forwards += out.stats.target_forwards
            stats.time_small += lap(t0)
            text = tokenizer.decode(tokens)
            t0 = time.perf_counter()
            ((value, mass),), scored = scorer(base_br, [tokens])
            stats.judged += 1
            stats.scores.append(value)
            stats.time_judge += lap(t0)
            if value >= threshold:
                stats.accepted += 1
                step = Step(tokens, text, "small", value, mass)
                t0 = time.perf_counter()
                base_br.extend([tokens], scored=scored)  # the judge's pass already read the step
                stats.time_sync += lap(t0)
            else:
                small_br = before
                tokens, reason = base_writes(budget, stop=True)
                step = Step(tokens, tokenizer.decode(tokens), "base", value, mass)
                t0 = time.perf_counter()
                small_br.extend([tokens])
                stats.time_sync += lap(t0)
        steps.append(step)
        kept += step.tokens
        if reason == "eos" or not step.tokens:
            break
        if think_end is not None and think_end in step.text:
            thinking = False
    stats.steps = len(steps)
    stats.judge_forwards = scorer.forwards
    stats.time_total = lap(start)
    return ReasonOutput(tokenizer.decode(kept), kept, steps, stats)

