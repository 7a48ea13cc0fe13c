"""Where a row stops before its EOS or its token budget: stop strings on the decoded text (exact
even when a string spans several tokens, or the drafts accepted in one step run past it) and stop
sequences of token ids. Either way the row keeps the fewest tokens that hold the first occurrence
and drops what follows (:meth:`stree.decoding.loop.Rows.finish`)."""

from __future__ import annotations

import numbers

__all__ = ["TextStops", "apply_text_stops", "check_stop_sequences", "held_back", "stop_strings", "token_stop"]


def stop_strings(stop) -> list[str]:
    """``stop`` (None, a string or a list of them) as a list; a TypeError for anything else."""
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise TypeError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return list(stop)


def check_stop_sequences(stop_sequences, vocab_size: int) -> list[tuple[int, ...]]:
    """``stop_sequences`` (None or a list of non-empty token-id lists) as tuples."""
    if stop_sequences is None:
        return []
    if not isinstance(stop_sequences, (list, tuple)):
        raise TypeError(f"stop_sequences must be a list of token-id lists, got {type(stop_sequences).__name__}")
    out = []
    for i, seq in enumerate(stop_sequences):
        if not isinstance(seq, (list, tuple)) or not seq:
            raise ValueError(f"stop_sequences[{i}] must be a non-empty list of token ids, got {seq!r}")
        for t in seq:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab_size:
                raise ValueError(f"stop_sequences[{i}] holds {t!r}, not a token id in [0, {vocab_size})")
        out.append(tuple(int(t) for t in seq))
    return out


def token_stop(tokens: list[int], sequences: list[tuple[int, ...]], seen: int) -> int | None:
    """How many of ``tokens`` to keep: through the end of the first stop sequence that ends past
    position ``seen`` (the tokens before were checked already); None when none does."""
    best = None
    for seq in sequences:
        m = len(seq)
        for end in range(max(seen + 1, m), len(tokens) + 1):
            if tuple(tokens[end - m: end]) == seq:
                best = end if best is None else min(best, end)
                break
    return best


def held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters of ``text`` could still begin a stop string, or are an
    incomplete UTF-8 character: a stream holds them back."""
    hold = 1 if text.endswith("\ufffd") else 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return hold


class TextStops:
    """One row's decoded text, kept up to date step by step, and where a stop string ended it:
    ``cut`` (a character offset, None while no stop string showed) and ``stop`` (the string).

    The text is read incrementally, so that a step costs the same however long the row has grown:
    the text of the tokens before a *mark* is settled, and each step decodes only a window from
    ``CONTEXT`` tokens before the mark to the end, whose text past that of its first ``CONTEXT``
    tokens follows the settled text. A tokenizer joins a token's text to its neighbours' (a
    space dropped before punctuation, a word's pieces, the bytes of one character), so the window
    begins before the mark and the mark moves only to where the window's text is a prefix of what
    follows it; where the window's text no longer begins with its first tokens' (the tokens after
    them changed it), the row is decoded whole again, from a mark at 0."""

    CONTEXT = 8  # tokens decoded before the mark
    SPAN = 64  # unsettled tokens past which the mark moves (a step decodes at most about CONTEXT + SPAN)

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.text, self.seen, self.cut, self.stop = "", 0, None, None
        self._longest = max((len(s) for s in stops), default=0)
        self._mark, self._settled, self._base = 0, "", ""  # the mark, its text, and the window's first tokens'

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _read(self, tokens: list[int]) -> str:
        """The text of ``tokens``, which extend those of the last read (see the class docstring)."""
        start = max(0, self._mark - self.CONTEXT)
        window = self.decode(tokens[start:])
        if not window.startswith(self._base):
            self._mark, self._settled, self._base, start = 0, "", "", 0
            window = self.decode(tokens)
        text = self._settled + window[len(self._base):]
        mark = len(tokens) - self.CONTEXT
        if mark - self._mark >= self.SPAN:
            head, base = self.decode(tokens[start:mark]), self.decode(tokens[max(0, mark - self.CONTEXT): mark])
            # (a window whose first tokens show no text, special tokens all, joins its next one as a row's first)
            if base and head.startswith(self._base) and window.startswith(head) and not head.endswith("\ufffd"):
                self._settled += head[len(self._base):]
                self._mark, self._base = mark, base
        return text

    def update(self, tokens: list[int]) -> int | None:
        """Read the row's generated ``tokens`` (those of the last update and more); when a stop
        string shows, the number of tokens to keep (the fewest whose text holds it) and ``cut`` =
        where the text ends."""
        if len(tokens) == self.seen:
            return None
        before = self._settled  # (the last update found no stop string in its text, which began with this)
        text = self._read(tokens)
        since = max(0, len(before) - self._longest + 1) if text.startswith(before) else 0
        hits = [(i, s) for s in self.stops if (i := text.find(s, since)) >= 0]
        if not hits:
            self.text, self.seen = text, len(tokens)
            return None
        start, stop = min(hits)
        keep = next(k for k in range(self.seen + 1, len(tokens) + 1) if stop in self.decode(tokens[:k]))
        self.text, self.seen, self.cut, self.stop = text[:start], keep, start, stop
        return keep


def apply_text_stops(batch, trackers: list[TextStops]) -> None:
    """End the rows of ``batch`` (the decoding loop's :class:`~stree.decoding.loop.Rows`) whose text
    shows a stop string: every row that grew in the last step and met none yet (one that just
    ended at an EOS or its budget included: its last tokens may hold one)."""
    if not trackers or not trackers[0].stops:
        return
    for r, row in enumerate(trackers):
        if row.cut is None and int(batch.produced[r]) != row.seen:
            keep = row.update(batch.generated(r))
            if keep is not None:
                batch.finish(r, keep)


def finish_reasons(new_tokens: list[list[int]], trackers: list[TextStops], eos, stop_sequences=()) -> list[str]:
    """Why each row ended: "stop" (a stop string cut it, or it ends with one of the token
    ``stop_sequences``), "eos" (its last token is one of ``eos``: an id, ids or None), else
    "length"."""
    eos = set([] if eos is None else [eos] if isinstance(eos, numbers.Integral) else eos)
    sequences = [tuple(q) for q in stop_sequences or ()]
    return ["stop" if tracker.cut is not None or any(tuple(tokens[-len(q):]) == q for q in sequences)
            else "eos" if tokens and tokens[-1] in eos else "length" for tracker, tokens in zip(trackers, new_tokens)]
