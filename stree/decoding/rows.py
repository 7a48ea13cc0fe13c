"""The host side of a decoding batch: every row's tokens, budget and state (:class:`Rows`), what a
step emits appended and cut at EOS, budgets and stop sequences; the statistics and output of a call."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import torch
from numba import njit

from ..drafters.base import DraftContext, Drafter, TargetTop
from ..tree import TokenTree, host_array, host_tensor
from .steps import HostStep
from .stops import token_stop


@dataclass
class GenerationStats:
    """``target_forwards``: decoding forwards of the target (prefill excluded). ``accepted``: per
    row, the drafts the verifier accepted at each of its steps. ``tau``: tokens emitted per row per
    decoding step, bonus included (1 for autoregressive), after the cuts at EOS and
    ``max_new_tokens``; the first token, which comes from the prefill, counts in ``new_tokens`` but
    not in ``tau``. Times in seconds; ``time_verify`` holds the target's tree forward and the
    verification, ``time_commit`` the commit and the step's transfer to the host."""

    target_forwards: int = 0
    new_tokens: list[int] = field(default_factory=list)
    accepted: list[list[int]] = field(default_factory=list)
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_commit: float = 0.0
    time_total: float = 0.0
    prefilled: bool = True  # the first token of each row came from a prefill (not from a decoding step)
    trees: dict[int, int] = field(default_factory=dict)  # tree nodes -> decoding steps (1: a plain step)
    # measuring this machine's costs for tree="auto" and its products' paths, compiling (once per process), not in
    # time_total
    time_setup: float = 0.0
    packed: int = 0  # of the tree steps, those whose rows each had a size of their own (a packed pass)
    watched: int = 0  # drafts made during plain steps and learned from, not verified (AutoTree.watch_shape)
    rested: bool = False  # whether tree="auto" let the call rest: decoded plainly, its drafter unused (AutoTree.rests)

    @property
    def tau(self) -> float:
        return pooled_tau([self])

    def row_tau(self, row: int) -> float:
        """``tau`` of one row."""
        steps = len(self.accepted[row])
        return (self.new_tokens[row] - self.prefilled) / steps if steps else float("nan")

    @property
    def time_other(self) -> float:
        return self.time_total - self.time_prefill - self.time_draft - self.time_verify - self.time_commit

    @property
    def tokens_per_s(self) -> float:
        return sum(self.new_tokens) / self.time_total if self.time_total > 0 else float("nan")

    def trees_chosen(self) -> str:
        """``trees`` in a few words: the share of plain steps and the tree sizes taken."""
        return trees_chosen(self.trees)

    def summary(self) -> str:
        return (f"tokens {sum(self.new_tokens)} | forwards {self.target_forwards} | tau {self.tau:.2f} | "
                f"{self.tokens_per_s:.1f} tok/s | steps: {self.trees_chosen()} | draft {self.time_draft:.3f}s "
                f"verify {self.time_verify:.3f}s commit {self.time_commit:.3f}s other {self.time_other:.3f}s "
                f"(prefill {self.time_prefill:.3f}s)")


def merged_trees(stats: list[GenerationStats]) -> dict[int, int]:
    """The ``trees`` of several runs together, by size."""
    out: dict[int, int] = {}
    for s in stats:
        for n, k in s.trees.items():
            out[n] = out.get(n, 0) + k
    return dict(sorted(out.items()))


def trees_chosen(trees: dict[int, int]) -> str:
    """Steps per tree size (1: a plain step) in a few words: the share of plain steps and the
    tree sizes taken."""
    steps = sum(trees.values())
    sizes = sorted(n for n in trees if n > 1)
    plain = f"{trees.get(1, 0) / steps:.0%} plain" if steps else "-"
    return plain if not sizes else f"{plain}, trees {sizes[0]}-{sizes[-1]}"


def pooled_tau(stats: list[GenerationStats]) -> float:
    """``tau`` over the rows of several runs together."""
    steps = sum(len(a) for s in stats for a in s.accepted)
    from_steps = sum(n - s.prefilled for s in stats for n in s.new_tokens if n > 0)
    return from_steps / steps if steps else float("nan")


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the law it was drawn from (greedy decoding: the
    model's own distribution, softmax of its logits; sampling: the processed one, after temperature,
    top-k and top-p) and the ``top`` most likely entries of that law, ``(id, logprob)`` best first.
    A token the law rules out (a processed law's zeros) has logprob ``-inf``."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(tokens, token_probs, top_ids, top_probs, k: int) -> list[TokenLogprob]:
    """:class:`TokenLogprob` s of ``tokens`` from the laws a step packed for them (``token_probs``
    ``[L]``, ``top_ids`` / ``top_probs`` ``[L, >= k]``, best first)."""
    out = []
    for t, p, ids, probs in zip(tokens, token_probs, top_ids[:, :k].tolist(), top_probs[:, :k].tolist()):
        out.append(TokenLogprob(int(t), _log(float(p)), tuple((i, _log(q)) for i, q in zip(ids, probs))))
    return out


def _log(p: float) -> float:
    return math.log(p) if p > 0 else float("-inf")


@dataclass
class GenerationOutput:
    """``sequences``: per row, prompt then generated tokens; ``prompt_lengths`` to split them.
    ``exact``: per row, whether the cache holds the row's state after all its tokens but the last
    (False where the row was cut inside a step's accepted path, by an EOS, its budget or a stop,
    or rode along after it finished, where the batch keeps its shape): what continuing from that
    cache needs. ``logprobs``: per row, a :class:`TokenLogprob` per generated token, where the call
    asked for them (``logprobs=k``), else None."""

    sequences: list[list[int]]
    prompt_lengths: list[int]
    stats: GenerationStats
    exact: list[bool] = field(default_factory=list)
    logprobs: list[list[TokenLogprob]] | None = None

    @property
    def new_tokens(self) -> list[list[int]]:
        return [s[n:] for s, n in zip(self.sequences, self.prompt_lengths)]


class Rows:
    """Host-side state of a batch: every row's tokens so far (prompt, then generated), its length,
    the tokens produced, and whether it still decodes; rows finish at an EOS or their
    ``max_new_tokens`` (an int, or one per row). ``exact``: see :class:`GenerationOutput`.
    ``logprobs``: the top entries kept per generated token (None: no log-probabilities kept; else
    ``self.logprobs_of[row]`` holds a :class:`TokenLogprob` per generated token). ``greedy``: per
    row, whether it decodes greedily (None: no row does), what drafters read in
    :class:`DraftContext`."""

    def __init__(self, prompts: list[list[int]], max_new_tokens: list[int], eos: list[int],
                 logprobs: int | None = None, greedy: np.ndarray | None = None):
        B, longest = len(prompts), max(map(len, prompts))
        # grown as tokens come (doubling): max_new_tokens is a limit, not an allocation
        self.seq = torch.zeros(B, longest + min(max(max_new_tokens), 256), dtype=torch.long)
        self.limit = max(len(p) + m for p, m in zip(prompts, max_new_tokens))
        self.lengths = torch.tensor([len(p) for p in prompts])
        # one copy of all prompts, row after row (a tensor per row is dear at batches of thousands)
        flat = np.fromiter(itertools.chain.from_iterable(prompts), dtype=np.int64, count=int(self.lengths.sum()))
        self.seq.numpy()[np.arange(self.seq.shape[1]) < self.lengths.numpy()[:, None]] = flat
        self.prompt_lengths = self.lengths.clone()
        self.produced = torch.zeros(B, dtype=torch.long)
        self.active = torch.ones(B, dtype=torch.bool)
        self.eos = torch.tensor(eos, dtype=torch.long)
        self.max_new_tokens = torch.tensor(max_new_tokens, dtype=torch.long)
        self.exact = torch.ones(B, dtype=torch.bool)
        self.accepted: list[list[int]] = [[] for _ in range(B)]
        self.logprobs = logprobs
        self.logprobs_of: list[list[TokenLogprob]] | None = None if logprobs is None else [[] for _ in range(B)]
        self.greedy = greedy
        # Per step, the host's bookkeeping reads these through NumPy views made once (the tensors are
        # only ever changed in place) and keeps each row's last token and the longest row at hand: right
        # after a model pass has swept the caches, each small NumPy or torch call on the way costs
        # several microseconds, and a step took a dozen of them.
        self._arrays = tuple(t.numpy() for t in (self.eos, self.max_new_tokens, self.lengths, self.produced,
                                                   self.active, self.exact))
        self._seq = self.seq.numpy()  # (made again where the rows grow: _reserve)
        self._last = self._seq[np.arange(B), self.lengths.numpy() - 1]
        self._longest = longest
        self._ids, self._n = np.empty(B, dtype=np.int64), np.empty(B, dtype=np.int64)

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def active_ids(self) -> list[int]:
        return [r for r, a in enumerate(self._arrays[4].tolist()) if a]  # (NumPy's: the view made once)

    def lengths_now(self) -> np.ndarray:
        """Every row's length as it stands, a copy (NumPy)."""
        return self._arrays[2].copy()

    def context(self) -> DraftContext:
        live = self.active_ids()
        return DraftContext(self.seq, self.lengths, live, None if self.greedy is None else self.greedy[live],
                            (self._seq, self._arrays[2]))

    def roots(self) -> torch.Tensor:
        """Every row's last token (a finished row's too: where the batch keeps its shape, it rides
        along)."""
        return torch.from_numpy(self._last.copy())

    def steps_left(self) -> int:
        """The most steps the call may still take: its active rows' most tokens left."""
        left = self.max_new_tokens.numpy() - self.produced.numpy()
        return int(left[self.active.numpy()].max(initial=0))

    def critical(self, live: list[int]) -> np.ndarray:
        """Over the rows ``live`` (active), a mask of those expected to finish last: within a step
        of the most steps left (tokens left at the tokens per step the row's own steps have
        brought so far). The batch decodes until its last row is done, so a tree is worth what it
        brings the one of them that gains least: tokens it brings a row that will finish early
        anyway buy nothing (at batch 8, trees chosen for the rows' summed tokens ran slower than
        plain steps while every row's own tau was high), nor do tokens for one of several rows
        level at the end (at batch 16, trees chosen for one of them ran slower too)."""
        produced, budget = self.produced.tolist(), self.max_new_tokens.tolist()
        # (in Python: a batch's few rows cost a dozen numpy calls several times more)
        left = [(budget[r] - produced[r]) / (max(produced[r], 1) / max(len(self.accepted[r]), 1)) for r in live]
        top = max(left) - 1.0
        return np.array([x >= top for x in left], dtype=bool)

    def emit(self, step: HostStep, drafter: Drafter | None, drafter_k: int | None = None) -> None:
        """Append ``step.tokens[b, :counts[b]]`` to each active row, cut after its first EOS and at
        ``max_new_tokens``; show the drafter what was appended (with the target's top
        ``drafter_k`` entries per token where it learns from them: the step may have packed more,
        for ``logprobs``); retire the finished rows. (One compiled pass over numpy views of the rows'
        tensors, :func:`_append`: a dozen small torch or numpy ops cost several times more here.)"""
        tokens, counts = step.arrays()
        # (room for every token the step brings: the rows take at most that many, within their limit)
        if self._longest + tokens.shape[1] > self.seq.shape[1]:
            self._reserve(min(self.limit, self._longest + tokens.shape[1]))
        eos, max_new, lengths, produced, active, exact = self._arrays
        before = None if drafter is None else lengths.copy()  # the context the drafter saw
        k, longest = _append(tokens, counts, eos, max_new, lengths, produced, active, exact, self._seq, self._last,
                             self._ids, self._n)
        self._longest = max(self._longest, longest)
        if drafter is None and self.logprobs_of is None:
            return
        n_list, id_list = self._n[:k].tolist(), self._ids[:k].tolist()
        if drafter is not None:
            target = None
            if step.top_ids is not None and drafter_k is not None:  # (cut as arrays: a tensor's cut is three ops)
                top_ids, top_probs, token_probs = (host_array(t) for t in (step.top_ids, step.top_probs,
                                                                           step.token_probs))
                target = [TargetTop(host_tensor(top_ids[i, :m, :drafter_k]), host_tensor(top_probs[i, :m, :drafter_k]),
                                    host_tensor(token_probs[i, :m])) for i, m in zip(id_list, n_list)]
            drafter.observe(DraftContext(self.seq, torch.from_numpy(before), id_list, views=(self._seq, before)),
                            [tokens[i, :m].tolist() for i, m in zip(id_list, n_list)], target)
        if self.logprobs_of is not None:
            for i, m in zip(id_list, n_list):
                self.logprobs_of[i] += token_logprobs(tokens[i, :m], step.token_probs[i, :m].tolist(),
                                                      step.top_ids[i, :m], step.top_probs[i, :m], self.logprobs)

    def _reserve(self, length: int) -> None:
        if length > self.seq.shape[1]:
            grown = torch.zeros(self.seq.shape[0], min(self.limit, max(length, 2 * self.seq.shape[1])),
                                dtype=torch.long)
            grown[:, : self.seq.shape[1]] = self.seq
            self.seq, self._seq = grown, grown.numpy()

    def generated(self, row: int) -> list[int]:
        """The tokens row ``row`` generated so far."""
        return self.seq[row, int(self.prompt_lengths[row]): int(self.lengths[row])].tolist()

    def finish(self, row: int, keep: int) -> None:
        """End row ``row`` after its first ``keep`` generated tokens (the later ones are dropped)."""
        if not 0 <= keep <= int(self.produced[row]):
            raise ValueError(f"keep must be in [0, {int(self.produced[row])}], got {keep}")
        if keep < int(self.produced[row]):
            self.exact[row] = False
        if self.logprobs_of is not None:
            del self.logprobs_of[row][keep:]
        self.lengths[row] = self.prompt_lengths[row] + keep
        self._last[row] = self.seq[row, int(self.lengths[row]) - 1]
        self.produced[row] = keep
        self.active[row] = False


@njit(cache=True)
def _append(tokens, counts, eos, max_new, lengths, produced, active, exact, seq, last, ids, n):
    """:meth:`Rows.emit`'s appending, one compiled pass over the active rows (a dozen small numpy
    calls cost several times more): row r takes ``tokens[r, :counts[r]]`` cut after its first EOS
    and at its budget, is retired at EOS or budget, and stops being exact where the cache took
    tokens it drops; ``last[r]`` becomes its last token. Writes the rows that were active to
    ``ids`` and the tokens each took to ``n`` (the first k entries); returns k and the longest
    of their lengths after."""
    k, longest = 0, 0
    for r in range(len(active)):
        if not active[r]:
            continue
        count = counts[r]
        upto, hit = count, False
        for j in range(count):
            for e in eos:
                hit |= tokens[r, j] == e
            if hit:
                upto = j + 1
                break
        room = max_new[r] - produced[r]
        m = min(upto, room)
        for j in range(m):
            seq[r, lengths[r] + j] = tokens[r, j]
        lengths[r] += m
        produced[r] += m
        if m:
            last[r] = tokens[r, m - 1]
        if hit or m == room:  # (an EOS past the budget: retired by the budget)
            active[r] = False
        if m < count:
            exact[r] = False
        ids[k], n[k] = r, m
        k += 1
        longest = max(longest, lengths[r])
    return k, longest


def full_batch(draft: TokenTree, active: torch.Tensor, roots: torch.Tensor) -> TokenTree:
    """The drafted rows (a host draft) in their batch positions; a finished row gets its root alone
    (its other nodes invalid, so nothing of it is accepted). Made in NumPy: as a dozen torch ops a
    batch-2 tree took a sixth of a compiled step of the shipped target, in each of the iterations
    after a row finished where shapes stay fixed (compiled calls, CUDA graphs)."""
    ids = np.flatnonzero(host_array(active))
    tokens, valid = draft.arrays()
    full = np.repeat(host_array(roots)[:, None], draft.n, 1)
    full[ids] = tokens
    real = np.zeros(full.shape, dtype=np.bool_)
    real[:, 0] = True
    real[ids] = True if valid is None else valid
    shape = draft.static_shape
    if shape is not None and draft.child_ids is None and not draft.with_replacement:
        return TokenTree.from_arrays(shape, full, real)
    extra = dict(valid=host_tensor(real), with_replacement=draft.with_replacement)
    if draft.child_ids is not None:
        at = torch.from_numpy(ids)
        extra.update(child_ids=draft.child_ids.new_zeros((len(full), *draft.child_ids.shape[1:])),
                     child_probs=draft.child_probs.new_zeros((len(full), *draft.child_probs.shape[1:])))
        extra["child_ids"][at], extra["child_probs"][at] = draft.child_ids, draft.child_probs
    if shape is not None:  # keep the static shape (and its cached index, and its graphs)
        return TokenTree.from_shape(shape, host_tensor(full), **extra)
    parents = draft.parents
    if parents.dim() == 2:
        parents = parents[:1].repeat(len(full), 1)
        parents[torch.from_numpy(ids)] = draft.parents
    return TokenTree(parents, host_tensor(full), **extra)


def stop_at_sequences(rows: Rows, stops: list[tuple[int, ...]], seen: list[int]) -> None:
    """End every row whose new tokens complete a stop sequence, through its end (``seen[r]``: how
    many of row r's generated tokens were checked before)."""
    if not stops:
        return
    for r in range(rows.batch_size):
        produced = int(rows.produced[r])
        if seen[r] < 0 or produced == seen[r]:
            continue
        keep = token_stop(rows.generated(r), stops, seen[r])
        if keep is None:
            seen[r] = produced
        else:
            rows.finish(r, keep)
            seen[r] = -1  # done


def check_finite(host: HostStep, rows: Rows, where: str) -> None:
    finite = host.finite.tolist()  # (a list: a NumPy reduction costs several times more right after a pass)
    if all(finite):
        return
    bad = [r for r, (ok, live) in enumerate(zip(finite, rows.active.tolist())) if live and not ok]
    if bad:
        raise ValueError(f"the target's logits hold NaN or +inf at {where} (rows {bad}): its weights or activations "
                         "are not finite (stree.models.load checks the weights; fp16 may overflow where bf16 or "
                         "fp32 does not)")
