"""Test-time scaling: many sampled trajectories for one problem, drafting from each other through
one shared store, and the usual ways to pick an answer from them (SPECREASON_AND_TTS.md §3)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from .answers import extract_answer, extract_boxed, group_answers, same_answer
from .chat import prompt_ids as prompt_ids_of
from ..drafters.base import Drafter
from ..drafters.consensus import PathStore
from ..drafters.registry import resolve_drafter
from ..drafters.stand import STANDStore
from ..decoding.loop import GenerationStats, generate
from ..tree import TreeBudget, TreeShape

__all__ = ["Trajectories", "sample_trajectories", "majority_vote", "extract_answer", "extract_boxed", "same_answer",
           "best_of_n"]



@dataclass
class Trajectories:
    """``tokens[i]``: trajectory i's generated tokens (``texts[i]`` decoded, when a tokenizer was
    given); ``tau[i]`` its acceptance length; ``stats``: one :class:`GenerationStats` per batch;
    ``store``: the shared drafter store, to pass on to later calls for the same problem."""

    tokens: list[list[int]]
    texts: list[str] | None
    tau: list[float]
    stats: list[GenerationStats]
    store: STANDStore | PathStore | None


def _drafter(drafter, store):
    """The drafter every batch drafts with, and the store they share (None: it keeps none)."""
    if drafter is None or isinstance(drafter, Drafter):
        if store is not None:
            raise ValueError("store is only used with a drafter named here (a Drafter brings its own)")
        return drafter, getattr(drafter, "store", None)
    made = resolve_drafter(drafter, store=store)  # a fresh store where none is given
    return made, getattr(made, "store", None)


def sample_trajectories(model, prompt_ids, n: int, *, drafter="stand", batch_size: int = 1,
                        tree: TreeShape | TreeBudget | None = None, temperature: float = 1.0, top_k: int = 0,
                        top_p: float = 1.0, max_new_tokens: int = 256, eos_token_id=None, seed: int | None = 0,
                        store=None, tokenizer=None) -> Trajectories:
    """``n`` trajectories after one prompt, ``batch_size`` at a time (the last batch may be
    smaller), every batch drafting from one store that persists across batches and, when passed
    in as ``store``, across calls. ``drafter``: ``"stand"`` (the default), any other name
    :func:`stree.LM.generate` takes but the ones that need a drafter model ("consensus" shares its
    store likewise), a :class:`Drafter`, or None (autoregressive). Batch b decodes with seed
    ``seed + b``. ``tree``: the draft tree shape or budget (default: :func:`generate`'s).
    ``prompt_ids``: token ids, or text with ``tokenizer`` (the user's message through its chat
    template when it has one)."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if isinstance(prompt_ids, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs the tokenizer")
        prompt_ids = prompt_ids_of(tokenizer, prompt_ids)
    prompt = [int(t) for t in prompt_ids]
    drafter, store = _drafter(drafter, store)
    method = "autoregressive" if drafter is None else "stree"
    tokens, tau, stats = [], [], []
    for b, start in enumerate(range(0, n, batch_size)):
        rows = min(batch_size, n - start)
        out = generate(model, [prompt] * rows, drafter=drafter, tree=tree, method=method, max_new_tokens=max_new_tokens,
                       temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id,
                       seed=None if seed is None else seed + b)
        tokens += out.new_tokens
        tau += [out.stats.row_tau(i) for i in range(rows)]
        stats.append(out.stats)
    texts = None if tokenizer is None else [tokenizer.decode(t) for t in tokens]
    return Trajectories(tokens, texts, tau, stats, store)


def majority_vote(answers, weights=None, same=same_answer):
    """The winning answer: answers are grouped by ``same`` (default :func:`~stree.patterns.answers.same_answer`,
    math-verify's equivalence, so ``\\frac12`` and ``0.5`` vote together; None for exact strings),
    a group scores its count, or with ``weights`` its total weight. Ties go to the group seen
    first; the group is returned as its first answer. None answers abstain; None if every answer
    abstains."""
    if weights is not None and len(weights) != len(answers):
        raise ValueError(f"need one weight per answer, got {len(weights)} weights for {len(answers)} answers")
    groups = group_answers(answers, (lambda a, b: a == b) if same is None else same)
    total: Counter = Counter()
    for i, g in enumerate(groups):
        if g is not None:
            total[g] += 1 if weights is None else weights[i]
    if not total:
        return None
    return answers[max(total, key=lambda g: (total[g], -g))]


def best_of_n(candidates, scorer):
    """``(best, score)``: the candidate ``scorer`` rates highest (ties: the first)."""
    best, best_score = None, None
    for c in candidates:
        s = scorer(c)
        if best_score is None or s > best_score:
            best, best_score = c, s
    if best_score is None:
        raise ValueError("best_of_n needs at least one candidate")
    return best, best_score
