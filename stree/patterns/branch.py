"""Explicit decoding states for step-wise patterns (SpecReason, step-level search): a
:class:`Branch` is a model, a cache and one token context per row, the cache holding each row's
state after all its context but the last token (which the next forward feeds).

What makes these patterns cheap on SSMs: :meth:`Branch.fork` copies a fixed-size state per Mamba
layer whatever the context length (plus the K/V of the few attention layers); :meth:`Branch.logits`
scores a continuation in one tree forward without committing it (the judge's read-out);
:meth:`Branch.generate` continues decoding from the state, with stop strings, a budget per row and
speculative decoding, and leaves the state exactly after what it kept. An SSM cannot rewind, so
rows cut inside an accepted path are rebuilt from a snapshot taken before decoding (O(state)) and
fed what they kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..decoding.loop import GenerationStats, decode, drain
from ..decoding.stops import TextStops, apply_text_stops, finish_reasons, stop_strings
from ..models.cache import chain_chunks
from ..tree import MAX_TREE_NODES, TokenTree, TreeShape

__all__ = ["Branch", "BranchOutput", "Scored", "log_probs"]


@dataclass
class Scored:
    """What :meth:`Branch.score` computed: per row the ``logits`` ``[len(suffix) + 1, V]`` after
    the context and each prefix of its suffix, and the uncommitted pass, which
    :meth:`Branch.extend` may commit a prefix of instead of feeding it again."""

    logits: list[torch.Tensor]
    suffixes: list[list[int]]
    tree_pass: object = None  # None when the suffixes took more than one pass (scored on a fork)
    version: int | None = None


@dataclass
class BranchOutput:
    """Per row: the ``new_tokens`` kept (through a stop string or sequence, which they hold),
    ``finish_reasons`` ("stop", "eos" or "length"); the decoding ``stats``."""

    new_tokens: list[list[int]]
    finish_reasons: list[str]
    stats: GenerationStats


def _rows(index, n: int, name: str = "rows") -> list[int]:
    rows = list(range(n)) if index is None else index
    if not isinstance(rows, (list, tuple)) or not rows:
        raise TypeError(f"{name} must be a non-empty list of row indices, got {index!r}")
    for r in rows:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < n:
            raise ValueError(f"{name} holds {r!r}, not a row index in [0, {n})")
    return list(rows)


def _token_lists(name: str, lists, n: int, vocab_size: int, allow_empty: bool = True) -> list[list[int]]:
    if not isinstance(lists, (list, tuple)) or len(lists) != n:
        raise ValueError(f"{name} must hold one token list per row ({n}), got {lists!r:.80}")
    out = []
    for i, seq in enumerate(lists):
        seq = seq.tolist() if isinstance(seq, torch.Tensor) else seq
        if not isinstance(seq, (list, tuple)) or (not seq and not allow_empty):
            raise ValueError(f"{name}[{i}] must be a {'' if allow_empty else 'non-empty '}list of token ids, "
                             f"got {seq!r:.80}")
        for t in seq:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
                raise ValueError(f"{name}[{i}] holds {t!r}, not a token id in [0, {vocab_size})")
        out.append(list(seq))
    return out


def _select(cache, rows: list[int]):
    return cache.select(torch.tensor(rows, device=cache.seqlens.device))


def feed_chains(model, cache, chains: list[list[int]], commit: bool = True):
    """Feed row r the tokens ``chains[r]`` (at least one each) as chains of tree passes; returns
    each row's logits ``[len(chains[r]), V]`` (fp32, after each token) and the last pass. ``commit``:
    advance the cache over them (else the chains must fit one pass, and the cache is left as it
    was: the pass can still be committed)."""
    longest = max(map(len, chains))
    if not commit and longest > MAX_TREE_NODES:
        raise ValueError(f"scoring without committing takes at most {MAX_TREE_NODES} tokens a row, got {longest}")
    out: list[list[torch.Tensor]] = [[] for _ in chains]
    for start, end, rows, counts, sub in chain_chunks(cache, torch.tensor([len(c) for c in chains]), longest,
                                                      MAX_TREE_NODES):
        width, ids = end - start, rows.tolist()
        parts = [chains[r][start: end] for r in ids]
        tokens = torch.tensor([p + [p[-1]] * (width - len(p)) for p in parts], device=model.device)
        tree = TokenTree.from_shape(TreeShape.chain(width - 1), tokens)
        logits, tree_pass = model.forward_tree(tree, sub)
        for i, (r, p) in enumerate(zip(ids, parts)):
            out[r].append(logits[i, : len(p)].float())
        if commit:
            model.commit(sub, tree_pass, torch.arange(width, device=model.device).expand(len(ids), -1),
                         counts.to(model.device))
    return [torch.cat(parts) for parts in out], tree_pass


def log_probs(scored: Scored) -> list[torch.Tensor]:
    """Each row's log-probability of each token of its scored suffix."""
    return [torch.log_softmax(lg[:-1], -1).gather(1, torch.tensor(c, dtype=torch.long, device=lg.device)[:, None])[:, 0]
            for lg, c in zip(scored.logits, scored.suffixes)]


class Branch:
    """``model`` with a ``cache`` whose row r holds the state after ``contexts[r][:-1]``. Build one
    with :meth:`start`; every method keeps that invariant."""

    def __init__(self, model, cache, contexts: list[list[int]]):
        self.model, self.cache, self.contexts = model, cache, contexts

    @classmethod
    @torch.no_grad()
    def start(cls, model, prompts: list[list[int]], max_length: int) -> "Branch":
        """Prefill ``prompts`` (all but each one's last token) into a new cache of ``max_length``
        tokens a row: room for the prompts and all that will be decoded or scored after them."""
        prompts = _token_lists("prompts", prompts, len(prompts) if isinstance(prompts, (list, tuple)) else -1,
                               model.vocab_size, allow_empty=False)
        if not prompts:
            raise ValueError("prompts holds no rows")
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < max(map(len, prompts)):
            raise ValueError(f"max_length must be an int >= the longest prompt ({max(map(len, prompts))}), "
                             f"got {max_length!r}")
        cache = model.allocate_cache(len(prompts), max_length)
        ids = [r for r, p in enumerate(prompts) if len(p) > 1]
        if ids:
            sub = cache if len(ids) == len(prompts) else _select(cache, ids)
            longest = max(len(prompts[r]) for r in ids) - 1
            padded = torch.tensor([prompts[r][:-1] + [0] * (longest + 1 - len(prompts[r])) for r in ids])
            model.prefill(padded.to(model.device), sub, lengths=torch.tensor([len(prompts[r]) - 1 for r in ids]))
            if sub is not cache:
                cache.assign(torch.tensor(ids, device=cache.seqlens.device), sub)
        return cls(model, cache, [list(p) for p in prompts])

    def __len__(self) -> int:
        return len(self.contexts)

    @property
    def room(self) -> int:
        """Tokens the fullest row can still take."""
        return self.cache.max_length - max(map(len, self.contexts)) + 1

    def fork(self, rows: list[int] | None = None) -> "Branch":
        """A new branch of copies of ``rows`` (indices, repeats allowed; default all): decoding
        either one leaves the other as it was."""
        rows = _rows(rows, len(self))
        return Branch(self.model, _select(self.cache, rows), [list(self.contexts[r]) for r in rows])

    @torch.no_grad()
    def extend(self, new_tokens: list[list[int]], scored: Scored | None = None) -> None:
        """Append ``new_tokens[r]`` (possibly empty) to row r's context, advancing its state.
        ``scored``: a :meth:`score` of this branch since which nothing moved; when every row's new
        tokens begin its scored suffix, its pass is committed instead of feeding them again."""
        new = _token_lists("new_tokens", new_tokens, len(self), self.model.vocab_size)
        ids = [r for r, t in enumerate(new) if t]
        if not ids:
            return
        self._check_room([len(new[r]) for r in ids], ids)
        if scored is not None and self._commit_scored(new, scored):
            return
        sub = self if len(ids) == len(self) else self.fork(ids)
        feed_chains(self.model, sub.cache, [[sub.contexts[i][-1]] + new[r][:-1] for i, r in enumerate(ids)])
        if sub is not self:
            self.cache.assign(torch.tensor(ids, device=self.cache.seqlens.device), sub.cache)
        for r in ids:
            self.contexts[r] = self.contexts[r] + new[r]

    def _commit_scored(self, new: list[list[int]], scored: Scored) -> bool:
        """Commit the prefix ``new`` of ``scored``'s pass, if it is one and the pass is current."""
        if (scored.tree_pass is None or scored.version is None or scored.version != self.cache.version
                or len(scored.suffixes) != len(self)
                or any(not t or s[: len(t)] != t for t, s in zip(new, scored.suffixes))):
            return False
        device = self.model.device
        width = max(len(s) for s in scored.suffixes) + 1
        counts = torch.tensor([len(t) for t in new], device=device)
        self.model.commit(self.cache, scored.tree_pass, torch.arange(width, device=device).expand(len(self), -1), counts)
        self.contexts = [c + t for c, t in zip(self.contexts, new)]
        return True

    @torch.no_grad()
    def score(self, suffixes: list[list[int]]) -> Scored:
        """Row r's next-token logits after its context and each prefix of ``suffixes[r]``:
        ``[len(suffixes[r]) + 1, V]`` fp32, the last after the whole suffix. Nothing is
        committed (one tree forward when every row fits one; else a fork is fed), but a prefix
        of the suffixes can be, by :meth:`extend`, at no second forward."""
        suffixes = _token_lists("suffixes", suffixes, len(self), self.model.vocab_size)
        self._check_room([len(s) + 1 for s in suffixes], range(len(self)))
        chains = [[c[-1]] + s for c, s in zip(self.contexts, suffixes)]
        if max(map(len, chains)) <= MAX_TREE_NODES:
            logits, tree_pass = feed_chains(self.model, self.cache, chains, commit=False)
            return Scored(logits, suffixes, tree_pass, getattr(self.cache, "version", None))
        return Scored(feed_chains(self.model, self.fork().cache, chains)[0], suffixes)

    def logits(self, suffixes: list[list[int]]) -> list[torch.Tensor]:
        """:meth:`score`'s logits alone."""
        return self.score(suffixes).logits

    def logprobs(self, continuations: list[list[int]]) -> list[torch.Tensor]:
        """Row r's log-probability of each token of ``continuations[r]`` after its context (the
        target's own distribution: temperature 1, nothing truncated), without committing."""
        return log_probs(self.score(continuations))


    @torch.no_grad()
    def generate(self, max_new_tokens, *, stop=None, tokenizer=None, stop_sequences=None, drafter=None,
                 method: str | None = None, **kwargs) -> BranchOutput:
        """Decode every row on from its context (``max_new_tokens``: an int or one per row) and
        append what it kept; the state follows exactly. ``stop``: strings ending a row at their
        first occurrence in its new text (needs ``tokenizer``); ``stop_sequences``: token-id
        lists doing the same on ids. ``drafter`` and the other arguments are
        :func:`stree.decoding.loop.decode`'s (``method``: "stree" with a drafter, else
        "autoregressive", by default)."""
        stops = stop_strings(stop)
        if stops and tokenizer is None:
            raise ValueError("stop strings are matched on text: pass the tokenizer")
        method = method or ("autoregressive" if drafter is None else "stree")
        snapshot = self.cache.clone()
        trackers = [TextStops(tokenizer, stops) for _ in self.contexts]
        steps = decode(self.model, self.contexts, cache=self.cache, max_new_tokens=max_new_tokens, drafter=drafter,
                       method=method, stop_sequences=stop_sequences, **kwargs)
        out = drain(steps, lambda batch: apply_text_stops(batch, trackers))
        new = out.new_tokens
        redo = [r for r, ok in enumerate(out.exact) if not ok]
        if redo:  # cut inside an accepted path, or carried along after finishing: rebuild from the snapshot
            rebuilt = Branch(self.model, _select(snapshot, redo), [self.contexts[r] for r in redo])
            rebuilt.extend([new[r] for r in redo])
            self.cache.assign(torch.tensor(redo, device=self.cache.seqlens.device), rebuilt.cache)
        self.contexts = [list(s) for s in out.sequences]
        return BranchOutput(new, finish_reasons(new, trackers, kwargs.get("eos_token_id"), stop_sequences), out.stats)

    def _check_room(self, needs, rows) -> None:
        for need, r in zip(needs, rows):
            if len(self.contexts[r]) - 1 + need > self.cache.max_length:
                raise ValueError(f"row {r} holds {len(self.contexts[r])} tokens: {need} more pass the branch's "
                                 f"max_length {self.cache.max_length}")
