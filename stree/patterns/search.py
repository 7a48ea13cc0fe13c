"""Step-level test-time search (SPECREASON_AND_TTS.md §2; STAND §5.3): beam search and diverse
verifier tree search (DVTS) over reasoning steps, where every candidate step is sampled with
STree speculative decoding, all branches draft from one STAND store, branches fork by copying
their state, and a scorer (the model judging itself, a log-probability, or a user's process
reward model) picks the steps to keep.

One iteration: every live beam forks ``expand`` candidate rows (``expand * keep`` from the prompt
in the first), all of them decode one step in one batch, the scorer rates them in one forward,
and each group keeps its best ``keep`` (beam search: one group keeping ``width``; DVTS: ``width``
groups keeping one each, so the subtrees stay apart). A kept candidate that ended (EOS, an empty
step, or its trajectory's budget) is complete. The answer is the best-scoring complete or live
trajectory, a trajectory scoring as ``aggregate`` says over its steps' scores.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass

from ..decoding.args import integer
from ..decoding.autotree import tree_room
from .branch import Branch
from .chat import prompt_ids
from ..drafters.base import Drafter
from ..drafters.per_row import PerRowDrafter
from ..drafters.registry import drafter_name, make_drafter, resolve_drafter
from ..drafters.consensus import PathStore
from ..drafters.stand import STANDStore
from .judge import JUDGE_TEMPLATE, Judge

__all__ = ["Candidate", "SearchResult", "SearchStats", "beam_search", "dvts"]

AGGREGATES = ("last", "min", "mean", "sum")


@dataclass
class Candidate:
    """One scored candidate step: ``tokens`` (and ``text`` with a tokenizer), the ``iteration``
    it was drawn at, the ``group`` (DVTS subtree) and ``parent`` (index in ``candidates`` of the
    step it continues; -1 for the prompt), ``score`` (its own) and ``value`` (its trajectory's,
    aggregated), ``tau`` (tokens per target forward while decoding it), and whether it was
    ``kept`` and whether it ``ended`` the trajectory."""

    tokens: list[int]
    text: str | None
    iteration: int
    group: int
    parent: int
    score: float
    value: float
    tau: float
    kept: bool = False
    ended: bool = False


@dataclass
class SearchStats:
    iterations: int = 0
    forks: int = 0  # candidate rows forked from their beams
    scorer_calls: int = 0  # steps scored
    judge_forwards: int = 0
    target_forwards: int = 0  # batched decoding forwards
    tokens: int = 0  # candidate tokens decoded
    row_steps: int = 0  # decoding steps summed over candidate rows
    time_decode: float = 0.0
    time_score: float = 0.0
    time_total: float = 0.0

    @property
    def tau(self) -> float:
        """Tokens per decoding step of a candidate row, pooled over every candidate."""
        return self.tokens / self.row_steps if self.row_steps else float("nan")


@dataclass
class SearchResult:
    """The chosen trajectory's generated ``tokens`` (``text`` with a tokenizer) and ``value``;
    ``steps``: its candidates, first to last (indices into ``candidates``); every scored
    ``candidates``; ``stats``; ``store``: the STAND store the branches shared (None without one)."""

    tokens: list[int]
    text: str | None
    value: float
    steps: list[int]
    candidates: list[Candidate]
    stats: SearchStats
    store: STANDStore | PathStore | None = None


def _aggregate(how: str, scores: list[float]) -> float:
    if how == "last":
        return scores[-1]
    if how == "min":
        return min(scores)
    if how == "sum":
        return sum(scores)
    return sum(scores) / len(scores)


def _drafter(drafter, store, shared: bool):
    """The drafter every branch drafts with, and the store it shares (None: it keeps none); a
    STAND drafter with ``shared`` off is one per branch, each with a fresh store."""
    if not isinstance(shared, bool):
        raise TypeError(f"share_store must be a bool, got {shared!r}")
    if drafter is None or isinstance(drafter, Drafter):
        return drafter, getattr(drafter, "store", None)
    name = drafter_name(drafter) if isinstance(drafter, str) else None
    if name in ("stand", "stand-det") and not shared:
        if store is not None:
            raise ValueError("share_store=False gives every branch a fresh store: it takes no store")
        return PerRowDrafter(lambda: make_drafter(name)), None
    made = resolve_drafter(drafter, store=store)  # a fresh store where none is given
    return made, getattr(made, "store", None)


def _search(model, prompt, groups: int, keep: int, *, expand: int, steps: int, scorer, tokenizer, stop,
            stop_sequences, max_step_tokens: int, max_new_tokens: int, drafter, store, temperature: float,
            top_p: float, seed: int | None, eos_token_id, aggregate: str, score: str,
            judge_template: str, share_store: bool, tree) -> SearchResult:
    """:func:`beam_search` and :func:`dvts`: ``groups`` subtrees keeping ``keep`` trajectories each.
    One function for a reason: the checks, then each iteration's expansion, scoring and selection
    read and update the same branch state, and each of its parts is already a call into
    :class:`~stree.patterns.branch.Branch`."""
    start = time.perf_counter()
    expand = integer("expand", expand, low=1)
    steps = integer("steps", steps, low=1)
    max_step_tokens = integer("max_step_tokens", max_step_tokens, low=1)
    max_new_tokens = integer("max_new_tokens", max_new_tokens, low=1)
    if aggregate not in AGGREGATES:
        raise ValueError(f"aggregate must be one of {AGGREGATES}, got {aggregate!r}")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs the tokenizer")
        prompt = prompt_ids(tokenizer, prompt)
    judge = Judge(scorer, tokenizer, score, judge_template)
    drafter, store = _drafter(drafter, store, share_store)
    eos = getattr(tokenizer, "eos_token_id", None) if eos_token_id is None else eos_token_id
    eos = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
    depth = tree_room(drafter)
    room = len(prompt) + max_new_tokens + max_step_tokens + len(getattr(judge, "template", [])) + depth + 2
    root = Branch.start(model, [list(prompt)], room)
    stats, cands = SearchStats(), []
    # live[g]: group g's beams, as (row of `beams`, candidate index, step scores, tokens so far)
    beams, live = root, [[(0, -1, [], 0)] for _ in range(groups)]
    done: list[int] = []
    gen_kw = dict(temperature=temperature, top_p=top_p, eos_token_id=eos or None, tree=tree)
    if stop is not None:
        gen_kw.update(stop=stop, tokenizer=tokenizer)
    for it in range(steps):
        parents = [(g, b) for g in range(groups) for b in live[g]]
        if not parents:
            break
        per = expand * keep if it == 0 else expand
        rows = [b[0] for _, b in parents for _ in range(per)]
        pre = beams.fork(rows)
        work = pre.fork()
        stats.forks += len(rows)
        budgets = [min(max_step_tokens, max_new_tokens - b[3]) for _, b in parents for _ in range(per)]
        t0 = time.perf_counter()
        out = work.generate(budgets, drafter=drafter, stop_sequences=stop_sequences,
                            seed=None if seed is None else seed + it, **gen_kw)
        stats.time_decode += time.perf_counter() - t0
        stats.target_forwards += out.stats.target_forwards
        stats.tokens += sum(map(len, out.new_tokens))
        stats.row_steps += sum(map(len, out.stats.accepted))
        t0 = time.perf_counter()
        scored, _ = judge(pre, out.new_tokens)
        stats.time_score += time.perf_counter() - t0
        stats.scorer_calls += len(rows)
        new_live: list[list] = [[] for _ in range(groups)]
        by_group: dict[int, list] = {g: [] for g in range(groups)}
        for i, ((g, (_, parent, scores, used)), tokens, reason, (s, _m)) in enumerate(
                zip((p for p in parents for _ in range(per)), out.new_tokens, out.finish_reasons, scored)):
            trail = scores + [s]
            ended = reason == "eos" or not tokens or used + len(tokens) >= max_new_tokens
            text = None if tokenizer is None else tokenizer.decode(tokens)
            cands.append(Candidate(tokens, text, it, g, parent, s, _aggregate(aggregate, trail),
                                   out.stats.row_tau(i), ended=ended))
            by_group[g].append((i, len(cands) - 1, trail, used + len(tokens)))
        for g, options in by_group.items():
            seen = set()
            distinct = []
            for opt in options:  # a step drawn twice from one beam is one candidate
                key = (cands[opt[1]].parent, tuple(cands[opt[1]].tokens))
                if key not in seen:
                    seen.add(key)
                    distinct.append(opt)
            best = sorted(distinct, key=lambda o: -_nan_low(cands[o[1]].value))[:keep]
            for opt in best:
                cand = cands[opt[1]]
                cand.kept = True
                if cand.ended:
                    done.append(opt[1])
                else:
                    new_live[g].append(opt)
        beams = work
        live = new_live
        stats.iterations += 1
    finals = done + [b[1] for group in live for b in group if b[1] >= 0]
    stats.judge_forwards = judge.forwards
    stats.time_total = time.perf_counter() - start
    if not finals:
        return SearchResult([], "" if tokenizer is not None else None, -math.inf, [], cands, stats, store)
    best = max(finals, key=lambda c: (_nan_low(cands[c].value), -c))
    chain = []
    c = best
    while c >= 0:
        chain.append(c)
        c = cands[c].parent
    chain.reverse()
    tokens = [t for c in chain for t in cands[c].tokens]
    text = None if tokenizer is None else tokenizer.decode(tokens)
    return SearchResult(tokens, text, cands[best].value, chain, cands, stats, store)


def _nan_low(v: float) -> float:
    return -math.inf if math.isnan(v) else v


def beam_search(model, prompt, *, width: int = 2, expand: int = 4, steps: int = 8, scorer="prompt",
                tokenizer=None, stop="\n\n", stop_sequences=None, max_step_tokens: int = 64,
                max_new_tokens: int = 512, drafter="stand", store: STANDStore | PathStore | None = None,
                temperature: float = 0.8, top_p: float = 1.0, seed: int | None = 0, eos_token_id=None,
                aggregate: str = "last", score: str = "greedy", judge_template: str = JUDGE_TEMPLATE,
                share_store: bool = True, tree="auto") -> SearchResult:
    """Beam search over steps: ``width`` beams, each expanding ``expand`` sampled candidates per
    iteration, the ``width`` best trajectories over all of them kept, for at most ``steps``
    iterations.

    ``prompt``: text (with ``tokenizer``; the user's message through its chat template when it
    has one) or token ids. A step ends at ``stop`` (text, needs the tokenizer; None: none), at one
    of ``stop_sequences`` (token ids), an EOS or
    ``max_step_tokens``; a trajectory holds at most ``max_new_tokens``. ``scorer``: "prompt" (the
    model judges its own step, the STAND setup; ``score``: "greedy" or "expected" digit),
    "logprob", or a callable ``(context, step) -> float`` (text with a tokenizer, else ids: e.g. a
    process reward model). ``aggregate``: a trajectory's value from its steps' scores ("last",
    "min", "mean", "sum"). ``drafter``: "stand" (default; one store shared by every branch, pass
    ``store`` to share it across calls too; ``share_store=False``: a fresh store per branch and
    step instead, the baseline), any other name :func:`stree.LM.generate` takes ("consensus" shares
    its store likewise; "ssm" needs a model and is not taken here), a Drafter or None
    (autoregressive); ``tree``:
    what the candidates are drafted over (:func:`stree.decoding.loop.decode`'s, default "auto").
    ``temperature``/``top_p``: the candidates' sampling; ``seed`` makes the search repeatable."""
    return _search(model, prompt, 1, integer("width", width, low=1), **_options(locals()))


def dvts(model, prompt, *, width: int = 2, expand: int = 4, steps: int = 8, scorer="prompt",
         tokenizer=None, stop="\n\n", stop_sequences=None, max_step_tokens: int = 64,
         max_new_tokens: int = 512, drafter="stand", store: STANDStore | PathStore | None = None,
         temperature: float = 0.8, top_p: float = 1.0, seed: int | None = 0, eos_token_id=None,
         aggregate: str = "last", score: str = "greedy", judge_template: str = JUDGE_TEMPLATE,
         share_store: bool = True, tree="auto") -> SearchResult:
    """Diverse verifier tree search: ``width`` independent subtrees, each expanding ``expand``
    candidates per iteration and keeping its best one (a beam of its own), all decoded in one
    batch and drafting from one shared store. Arguments as :func:`beam_search`'s (the two
    signatures are tested equal)."""
    return _search(model, prompt, integer("width", width, low=1), 1, **_options(locals()))


def _options(given: dict) -> dict:
    """:func:`beam_search`'s keyword options bar ``width``, from ``given`` (a call's ``locals()``)."""
    params = inspect.signature(beam_search).parameters
    return {name: given[name] for name, p in params.items()
            if p.kind is p.KEYWORD_ONLY and name != "width"}

