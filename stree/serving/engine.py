"""Continuous batching over state slots: requests join and leave a running batch between
iterations, each decoded speculatively with its own tree, as if it ran alone.

An SSM keeps a request's whole context in a fixed-size state, so the engine holds a pool of
``max_slots`` states (:meth:`~stree.models.base.TreeLM.allocate_cache`, one row per slot) and no
paged cache. A request takes one slot per choice (``n``); its prompt is prefilled into the slot in
chunks of ``MAX_TREE_NODES`` tokens, one chunk per iteration, so a long prompt does not stall the
rows decoding beside it (the prompts admitted in one iteration together, one model call per
chunk); the prefill's last logits give its first token exactly as
:func:`~stree.decoding.loop.decode`'s own prefill would. It then joins a *cohort*: the rows that
decode with the same drafter and tree, each row with its own temperature, top-k and top-p (greedy
rows beside sampled ones, drafted with the drafter's likeliest tokens), stepped together by one
:func:`~stree.decoding.loop.decode` generator continuing from their slots' states (``cache=``).
Rows leave a cohort at their EOS, budget, stop string or cancellation (the slot is free at once:
the generator works on its own copy of the cohort's states, and drops the row from its batch at
the next step). A row joining restarts the cohort's generator between two iterations: the states
come back from the old one's copy (``decode`` hands a given cache every row's state as it
stands), the new one continues from them, and its drafter object (a STAND store, shared by
every request of the cohort) carries over. Each row's output is therefore exactly what decoding
it alone gives (greedy: the same tokens; sampled: the same distribution).

The engine runs in one background thread that owns the model; :meth:`Engine.submit` may be called
from any thread, and a :class:`Request` is read from any thread (or an asyncio loop:
:meth:`Request.attach`).
"""

from __future__ import annotations

import collections
import itertools
import numbers
import os
import queue
import threading
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..decoding.args import integer
from ..decoding.acceptance import PathRates
from ..decoding.autotree import auto_tree
from ..decoding.config import seed_streams
from ..decoding.loop import decode
from ..decoding.rows import TokenLogprob, token_logprobs
from ..decoding.stops import TextStops, held_back, stop_strings
from ..drafters.registry import DRAFTER_ALIASES, DRAFTER_NAMES, NEEDS_MODEL, drafter_name, random_drafts
from ..models.base import MAX_TREE_NODES
from ..sampling.keyed import KeyedDraws
from ..sampling.verify import SamplingParams, check_sampling
from ..tree import tree_spec

__all__ = ["Engine", "EngineClosed", "Event", "Overloaded", "Request"]

# the share of the memory free at start the slot pool (and the cohorts' working copies) may take
MEMORY_SHARE = 0.25
MAX_SLOTS = 256


class Overloaded(RuntimeError):
    """Every slot is busy and the queue of waiting requests is full."""


class EngineClosed(RuntimeError):
    """The engine no longer takes requests."""


@dataclass
class Event:
    """What one choice of a request gained: ``text`` (new characters; text that could still begin
    a stop string is held back until it cannot) and ``token_ids``; ``finish_reason`` on its last
    event: "stop" (a stop string), "eos", "length" or "cancelled". ``logprobs``: a
    :class:`~stree.decoding.rows.TokenLogprob` per token of ``token_ids``, where the request asked
    for them."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Choice:
    """One finished choice: its text and token ids (with their ``logprobs`` where asked for), and
    why it ended."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None


class Request:
    """A submitted request (:meth:`Engine.submit`). Iterate it for its :class:`Event` s, as they
    come; :meth:`result` waits for every choice; :meth:`cancel` ends it (its slots freed at the
    engine's next iteration)."""

    def __init__(self, rid: int, ids: list[int], n: int, settings: "_Settings", budget: int, stops: list[str],
                 seed: int | None, logprobs: int | None = None, prompt_logprobs: int | None = None):
        self.id, self.prompt_ids, self.n = rid, ids, n
        self.settings, self.budget, self.stops, self.seed = settings, budget, stops, seed
        self.logprobs, self.prompt_logprobs = logprobs, prompt_logprobs
        # the seed its draws are keyed by, as decode keys a call's (seed_streams); set when its prompt is read
        self.draws_seed: int | None = None
        # with prompt_logprobs, once the prompt is read (before its first event): None for the first
        # prompt token, then a TokenLogprob for each of the others under the model's own distribution
        self.prompt_scores: list[TokenLogprob | None] | None = None
        self.cancelled = False
        self._events: queue.Queue = queue.Queue()
        self._loop = self._async = None
        self._mutex = threading.Lock()  # (attach and the engine's _put must not interleave: an event lost)
        self._choices: dict[int, Choice] = {}
        self._done = threading.Event()
        self.error: BaseException | None = None

    def cancel(self) -> None:
        self.cancelled = True

    def attach(self, loop, sink) -> None:
        """Deliver events (and None at the end) to ``sink`` (e.g. an ``asyncio.Queue``'s
        ``put_nowait``) on the asyncio ``loop`` instead of the blocking iterator."""
        with self._mutex:
            self._loop, self._async = loop, sink
            while not self._events.empty():  # what came before
                loop.call_soon_threadsafe(sink, self._events.get_nowait())

    def _put(self, item) -> None:
        with self._mutex:
            if self._async is not None:
                self._loop.call_soon_threadsafe(self._async, item)
            else:
                self._events.put(item)

    def _emit(self, event: Event, choice: Choice | None = None) -> None:
        if choice is not None:
            self._choices[choice.index] = choice
        self._put(event)
        if len(self._choices) == self.n:
            self._finish()

    def _fail(self, error: BaseException) -> None:
        self.error = error
        self._finish()

    def _finish(self) -> None:
        self._done.set()
        self._put(None)

    def __iter__(self):
        """The events as they come, once (a second iteration finds none)."""
        while True:
            event = self._events.get()
            if event is None:
                if self.error is not None:
                    raise self.error
                return
            yield event

    def result(self, timeout: float | None = None) -> list[Choice]:
        """Every choice, by index, once all have ended."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish in {timeout} s")
        if self.error is not None:
            raise self.error
        return [self._choices[i] for i in range(self.n)]

    @property
    def done(self) -> bool:
        return self._done.is_set()


@dataclass(frozen=True)
class _Settings:
    """A request's drafter, tree and sampling values (and, for a seeded sampled request of random
    drafts, the request: its output follows its trees, which then depend on its seed alone)."""

    drafter: str | None
    tree: str
    params: SamplingParams
    own: int | None = None

    def cohort(self) -> "_Settings":
        """What rows must share to step together: the drafter, the tree and the sampling mode.
        Rows of different sampling values share one batch, each row's law its own
        (:meth:`SamplingParams.stack`; a greedy row's the argmax's, verified as greedy decoding
        verifies, and drafted with the drafter's likeliest tokens: ``DraftContext.greedy``), but
        not the rows of a seeded request of random drafts (every other request's draws are keyed
        by its own seed: :mod:`stree.sampling.keyed`)."""
        if self.own is not None:
            return self
        return replace(self, params=SamplingParams(1.0, mode=self.params.mode))


@dataclass
class _Row:
    """One choice of a request, in its slot."""

    request: Request
    index: int
    slot: int
    context: list[int]
    budget: int
    tracker: TextStops
    settings: _Settings
    generated: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per generated token, where the request asked for them
    base: int = 0  # generated tokens before the cohort's generator started
    sent: int = 0  # characters of tracker.text already sent
    done: bool = False


class Engine:
    """Continuous batching of ``lm`` (an :class:`~stree.lm.LM`) over ``max_slots`` state slots
    (default: as many as ``MEMORY_SHARE`` of the free memory holds, at most ``MAX_SLOTS``) of
    ``max_length`` tokens each; at most ``max_queue`` requests wait for a slot (beyond:
    :class:`Overloaded`). ``seed``: where the draws of requests without a seed of their own come
    from (default: the OS's entropy). See the module's text for how; :meth:`submit` for a
    request's options."""

    # The prompts admitted in one iteration are read in one model call per chunk (False: a call per
    # prompt, which benchmarks/engine_load.py measures against).
    GROUP_PREFILLS = True

    def __init__(self, lm, *, max_slots: int | None = None, max_length: int = 2048, max_queue: int = 256,
                 seed: int | None = None):
        model = lm.model
        if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 2:
            raise ValueError(f"max_length must be an int >= 2, got {max_length!r}")
        if not isinstance(max_queue, int) or isinstance(max_queue, bool) or max_queue < 0:
            raise ValueError(f"max_queue must be an int >= 0, got {max_queue!r}")
        if max_slots is None:
            max_slots = slots_for_memory(model, max_length)
        if not isinstance(max_slots, int) or isinstance(max_slots, bool) or not 1 <= max_slots <= MAX_SLOTS:
            raise ValueError(f"max_slots must be an int in [1, {MAX_SLOTS}], got {max_slots!r}")
        self.lm, self.model, self.max_slots, self.max_length = lm, model, max_slots, max_length
        self.max_queue = max_queue
        self.pool = model.allocate_cache(max_slots, max_length)
        self.free = list(range(max_slots))
        self._inbox: queue.Queue = queue.Queue()
        self._waiting: collections.deque = collections.deque()
        self._prefilling: list = []
        self._cohorts: dict[_Settings, _Cohort] = {}
        self._drafters: dict[_Settings, object] = {}
        self._ids = itertools.count()
        self._seeds = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1 if seed is None
                                                    else seed)
        self._lock = threading.Lock()
        self._pending = 0  # submitted, not yet in slots
        self._started = _now()
        self._closing = False
        # what /metrics reports (kept under the lock): requests, tokens, row_steps (rows stepped by the
        # target), and the target's steps by tree size (1: plain); tokens of the last minute
        self.counters = collections.Counter()
        self.trees = collections.Counter()
        self._recent: collections.deque = collections.deque()
        self._thread = threading.Thread(target=self._run, name="stree-engine", daemon=True)
        self._thread.start()

    # ---- the callers' side ----------------------------------------------------------------
    def submit(self, prompt, *, max_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, stop=None, drafter: str | None = "ngram", tree: str = "auto", seed: int | None = None,
               n: int = 1, logprobs: int | None = None, prompt_logprobs: int | None = None) -> Request:
        """Queue a completion of ``prompt`` (text, or a list of token ids) and return its
        :class:`Request`. ``max_tokens`` new tokens at most (the prompt and them must fit a
        slot's ``max_length``); ``temperature`` (0: greedy), ``top_p``, ``top_k`` as
        :class:`~stree.sampling.verify.SamplingParams`; ``stop``: a string or strings that end a
        choice; ``drafter``: a drafter name (None: autoregressive); ``tree``: "auto" or a tree
        spec (:func:`~stree.tree.tree_spec`); ``seed``: a sampled request's draws follow it (with
        deterministic drafts, choice i gets ``LM.generate``'s row i with that seed, in any cohort);
        ``n``: choices decoded from the prompt, each in its own slot; ``logprobs``: an int k >= 0
        gives every token its log-probability and the k most likely entries of the law it was drawn
        from (:func:`~stree.decoding.loop.decode`'s ``logprobs``), on the events and choices;
        ``prompt_logprobs``: likewise for the prompt's tokens after its first, under the model's own
        distribution (``Request.prompt_scores``, set before the first event; with it ``max_tokens``
        may be 0: the prompt read and nothing generated, as evaluation harnesses score texts). Every
        argument is checked here (TypeError / ValueError naming it) before anything is queued."""
        ids = self._prompt_ids(prompt)
        if prompt_logprobs is not None:
            prompt_logprobs = integer("prompt_logprobs", prompt_logprobs, low=0, high=self.model.vocab_size)
        for name, value, low in (("max_tokens", max_tokens, 1), ("n", n, 1)):
            if name == "max_tokens" and prompt_logprobs is not None and value == 0:
                continue
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if n > self.max_slots:
            raise ValueError(f"n must be at most max_slots ({self.max_slots}), got {n}")
        check_sampling(temperature, top_k, top_p)
        stops = stop_strings(stop)
        if seed is not None and (not isinstance(seed, numbers.Integral) or isinstance(seed, bool)):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        if seed is not None and not 0 <= seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {seed}")
        if logprobs is not None:
            logprobs = integer("logprobs", logprobs, low=0, high=self.model.vocab_size)
        name = _drafter_name(drafter, self.lm)
        depth = _tree_depth(tree)
        room = self.max_length - len(ids) - depth
        if max_tokens > room:
            raise ValueError(f"max_tokens={max_tokens} does not fit: a slot holds {self.max_length} tokens, the prompt "
                             f"takes {len(ids)}" + (f" and the tree {depth}" if depth else "") + f" (at most {room})")
        params = SamplingParams(float(temperature), int(top_k), float(top_p))
        with self._lock:
            if self._closing:
                raise EngineClosed("the engine is closed")
            if self._pending >= self.max_queue + len(self.free):
                raise Overloaded(f"{self._pending} requests wait for a slot (max_queue {self.max_queue}): try again "
                                 "later")
            self._pending += 1
            rid = next(self._ids)
            self.counters["requests"] += 1
        # (a seeded request whose rows draw random drafts decodes in a cohort of its own: its output
        # follows its trees; every other request's draws follow its own seed in any cohort)
        own = rid if seed is not None and random_drafts(name, params.temperature) else None
        request = Request(rid, ids, int(n), _Settings(name, tree, params, own), int(max_tokens), stops,
                          None if seed is None else int(seed), logprobs, prompt_logprobs)
        self._inbox.put(request)
        return request

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.lm.encode(prompt)[0]
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise TypeError(f"prompt must be a string or a non-empty list of token ids, got {prompt!r}")
        vocab = self.model.vocab_size
        for t in prompt:
            if not isinstance(t, numbers.Integral) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt holds {t!r}, not a token id in [0, {vocab})")
        return [int(t) for t in prompt]

    def metrics(self) -> dict:
        """A snapshot of the counters, the tokens per second of the last minute, tau (tokens per
        row per target step), the queue and the slots."""
        with self._lock:
            now = _now()
            while self._recent and self._recent[0][0] < now - 60:
                self._recent.popleft()
            recent = sum(n for _, n in self._recent)
            span = min(60.0, now - self._started)
            out = dict(self.counters, trees=dict(self.trees), tokens_per_s=recent / span if span > 0 else 0.0)
        out.setdefault("requests", 0)
        out.setdefault("tokens", 0)
        out.setdefault("row_steps", 0)
        out["tau"] = out.get("stepped_tokens", 0) / out["row_steps"] if out["row_steps"] else 0.0
        return dict(out, queue=self.queue_length, free_slots=self.free_slots, slots=self.max_slots)

    def _count(self, tokens: int) -> None:
        if tokens:
            with self._lock:
                self.counters["tokens"] += tokens
                self._recent.append((_now(), tokens))

    @property
    def free_slots(self) -> int:
        return len(self.free)

    @property
    def queue_length(self) -> int:
        return len(self._waiting) + self._inbox.qsize()

    def close(self, timeout: float | None = None) -> None:
        """Take no more requests, finish the ones in flight, and stop the thread."""
        with self._lock:
            self._closing = True
        self._inbox.put(None)
        self._thread.join(timeout)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the engine's thread --------------------------------------------------------------
    def _run(self) -> None:
        closing = False
        while True:
            busy = bool(self._waiting or self._prefilling or self._cohorts)
            if closing and not busy:
                return
            try:
                item = self._inbox.get(block=not busy)
            except queue.Empty:
                item = False
            while item is not False:
                if item is None:
                    closing = True
                else:
                    self._waiting.append(item)
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    item = False
            try:
                self._iterate()
            except Exception as error:  # a bug must not leave callers waiting forever
                self._fail_all(error)

    def _iterate(self) -> None:
        """Admit what fits, one prefill chunk for each prompt being read (one model call for the
        prompts admitted together), one step of every cohort."""
        admitted = []
        while self._waiting and (self._waiting[0].cancelled or len(self.free) >= self._waiting[0].n):
            request = self._waiting.popleft()
            with self._lock:
                self._pending -= 1
            if request.cancelled:
                self._cancelled(request)
                continue
            admitted.append(_Prefill(request, [self.free.pop(0) for _ in range(request.n)]))
        # (a prompt whose log-probabilities are asked for reads every position's logits: alone)
        together = [job for job in admitted if job.request.prompt_logprobs is None and self.GROUP_PREFILLS]
        self._prefilling += ([_PrefillGroup(self, together)] if together else []) + [
            _PrefillGroup(self, [job]) for job in admitted if job not in together]
        for group in list(self._prefilling):
            for job in group.drop_cancelled():
                self.free.extend(job.slots)
                self._cancelled(job.request)
            for job in group.advance() if group.jobs else []:
                for row in job.rows(self):
                    if not row.done:  # (its first token may have ended it)
                        key = row.settings.cohort()
                        cohort = self._cohorts.get(key)
                        if cohort is None:
                            cohort = self._cohorts[key] = _Cohort(self, key)
                        cohort.joining.append(row)
            if not group.jobs:
                self._prefilling.remove(group)
        for key, cohort in list(self._cohorts.items()):
            if not cohort.step():
                del self._cohorts[key]

    def _publish(self, row: _Row, new: list[int], reason: str | None = None,
                 logprobs: list[TokenLogprob] | None = None) -> int | None:
        """Send ``row``'s ``new`` tokens (with their ``logprobs`` where the request asked for them;
        its EOS, budget or the cohort's end as ``reason``); returns how many of its generated
        tokens to keep where a stop string ended it."""
        start = len(row.generated)
        row.generated.extend(new)
        row.context.extend(new)
        if row.logprobs is not None:
            row.logprobs.extend(logprobs)
        self._count(len(new))
        tracker = row.tracker
        keep = tracker.update(row.generated)
        if keep is not None:
            del row.context[len(row.context) - (len(row.generated) - keep):]
            del row.generated[keep:]
            if row.logprobs is not None:
                del row.logprobs[keep:]
            new = new[: max(0, keep - start)]  # (the tokens past the stop are not the choice's)
            reason = "stop"
        elif row.request.cancelled:
            reason = "cancelled"
        elif reason is None and len(row.generated) >= row.budget:
            reason = "length"
        if reason is None:
            ready = len(tracker.text) - held_back(tracker.text, tracker.stops)
        else:
            ready = len(tracker.text)
        text, row.sent = tracker.text[row.sent: max(ready, row.sent)], max(ready, row.sent)
        if reason is None and not new:
            return keep
        sent = None if row.logprobs is None else row.logprobs[start: start + len(new)]
        if reason is None:
            row.request._emit(Event(row.index, text, new, logprobs=sent))
            return keep
        row.done = True
        self.free.append(row.slot)
        choice = Choice(row.index, tracker.text, list(row.generated), reason,
                        None if row.logprobs is None else list(row.logprobs))
        row.request._emit(Event(row.index, text, new, reason, sent), choice)
        return keep

    def _cancelled(self, request: Request) -> None:
        empty = None if request.logprobs is None else []
        for i in range(request.n):
            request._emit(Event(i, "", [], "cancelled", empty), Choice(i, "", [], "cancelled", empty))

    def _fail_all(self, error: Exception) -> None:
        """Every request in flight ends with ``error`` (the engine starts over empty)."""
        rows = [row for c in self._cohorts.values() for row in c.rows + c.joining]
        reading = {job.request for group in self._prefilling for job in group.jobs}
        requests = {row.request for row in rows} | reading | set(self._waiting)
        with self._lock:
            self._pending -= len(self._waiting)
        self._cohorts.clear()
        self._prefilling.clear()
        self._waiting.clear()
        self.free = list(range(self.max_slots))
        for request in requests:
            if not request.done:
                request._fail(RuntimeError(f"the engine failed: {error!r}"))

    def _ends_with_eos(self, tokens: list[int]) -> bool:
        eos = self.lm.eos_token_id
        eos = set() if eos is None else {eos} if isinstance(eos, numbers.Integral) else set(eos)
        return bool(tokens) and tokens[-1] in eos

    def _cohort_drafter(self, settings: _Settings):
        """The drafter of the cohorts of ``settings`` (a :meth:`_Settings.cohort`): one object for
        all of them over the engine's life (a STAND store keeps learning from every request; one
        cohort of given settings runs at a time), a seeded request's of random drafts its own. Drafters of random
        drafts draw for the sampled rows (a drafter model at temperature 1: its drafts are lossless
        under any law) and take their likeliest tokens for the greedy ones."""
        if settings.drafter is None:
            return None
        key = replace(settings, own=None)
        drafter = self._drafters.get(key) if settings.own is None else None
        if drafter is None:
            drafter = self.lm.drafter(settings.drafter, settings.params.temperature, self.max_slots * self.max_length)
            if settings.own is None:
                self._drafters[key] = drafter
        return drafter

    def _seed(self) -> int:
        return int(torch.randint(0, 2**62, (1,), generator=self._seeds))


class _Prefill:
    """A request's prompt being read (``at`` tokens so far, in a row of a :class:`_PrefillGroup`):
    then its first token drawn (as :func:`decode`'s prefill draws it) and the state copied to its
    slots."""

    def __init__(self, request: Request, slots: list[int]):
        self.request, self.slots = request, slots
        self.at = 0
        self.first: list[int] = []
        self.first_logprobs: list[list[TokenLogprob]] | None = None
        self.scores: list[TokenLogprob | None] = [None]  # the prompt's, where asked for

    def finish(self, engine: "Engine", logits: torch.Tensor, cache, row: int) -> None:
        """The prompt is read (``logits [1, V]`` after its last token, its state row ``row`` of
        ``cache``): its first tokens drawn, the state copied to its slots."""
        request, model = self.request, engine.model
        if request.prompt_logprobs is not None:
            request.prompt_scores = self.scores
        if request.budget == 0:  # the prompt alone: its choices end without a token
            return
        settings, seed = request.settings, request.seed
        request.draws_seed = engine._seed() if seed is None else seed_streams(seed)[0]
        logits = logits.expand(request.n, -1)
        # (choice i is row i of a call of the request's seed: its first token drawn at position 0)
        draws = KeyedDraws(request.draws_seed, model.device).at(np.arange(request.n), np.zeros(request.n, np.int64))
        self.first = settings.params.sample(logits, draws).tolist()
        k = request.logprobs
        if k is not None:  # the law decode's prefill packs for it (greedy: the softmax)
            law = settings.params.observed(logits).cpu()
            top = torch.topk(law, min(k, law.shape[-1]), dim=-1)
            self.first_logprobs = [token_logprobs([t], law[i, t: t + 1].tolist(), top.indices[i: i + 1],
                                                  top.values[i: i + 1], k) for i, t in enumerate(self.first)]
        engine.pool.assign(torch.tensor(self.slots, device=model.device),
                           cache.select(torch.full((len(self.slots),), row, dtype=torch.long, device=model.device)))

    def score(self, every: torch.Tensor, at: int) -> None:
        """The log-probabilities of the prompt's tokens after ``at`` that the logits after the
        chunk's tokens (``at`` on) predict: the next chunk's first token is known already."""
        ids, k = self.request.prompt_ids, self.request.prompt_logprobs
        tokens = ids[at + 1: at + 1 + len(every)]
        if not tokens:
            return
        laws = torch.softmax(every[: len(tokens)].float(), -1).cpu()
        top = torch.topk(laws, min(k, laws.shape[-1]), dim=-1)
        self.scores += token_logprobs(tokens, laws[torch.arange(len(tokens)), tokens].tolist(), top.indices,
                                      top.values, k)

    def rows(self, engine: "Engine") -> list[_Row]:
        """The request's choices, each with its first token sent (none where its budget is 0)."""
        request = self.request
        if request.budget == 0:
            engine.free.extend(self.slots)
            empty = None if request.logprobs is None else []
            for i in range(request.n):
                request._emit(Event(i, "", [], "length", empty), Choice(i, "", [], "length", empty))
            return []
        out = []
        for i, (slot, first) in enumerate(zip(self.slots, self.first)):
            row = _Row(request, i, slot, list(request.prompt_ids), request.budget,
                       TextStops(engine.lm.tokenizer, request.stops), request.settings,
                       logprobs=None if request.logprobs is None else [])
            engine._publish(row, [first], "eos" if engine._ends_with_eos([first]) else None,
                            None if self.first_logprobs is None else self.first_logprobs[i])
            out.append(row)
        return out


class _PrefillGroup:
    """Prompts admitted in one iteration, read together: one row each in one cache, each row's next
    ``MAX_TREE_NODES`` tokens an iteration in one model call (a call per prompt cost the engine
    as much time as decoding, prompts arriving in bursts as requests end together). A row leaves
    the group when its prompt is read; a prompt whose log-probabilities are asked for reads alone
    (every position's logits)."""

    def __init__(self, engine: Engine, jobs: list[_Prefill]):
        self.engine, self.jobs = engine, jobs
        self.cache = engine.model.allocate_cache(len(jobs), engine.max_length)

    def drop_cancelled(self) -> list[_Prefill]:
        """Take the cancelled requests' rows out; those jobs."""
        gone = [job for job in self.jobs if job.request.cancelled]
        if gone:
            self._keep([i for i, job in enumerate(self.jobs) if not job.request.cancelled])
        return gone

    def advance(self) -> list[_Prefill]:
        """One chunk of every row; the jobs whose prompts are now read (out of the group)."""
        model, jobs = self.engine.model, self.jobs
        ids = [job.request.prompt_ids for job in jobs]
        counts = [min(MAX_TREE_NODES, len(p) - job.at) for p, job in zip(ids, jobs)]
        width = max(counts)
        chunk = torch.tensor([p[job.at: job.at + c] + [0] * (width - c) for p, job, c in zip(ids, jobs, counts)],
                             device=model.device)  # (right-padded: a row reads its count only)
        every = jobs[0].request.prompt_logprobs is not None  # (then the group's only job)
        out = model.prefill(chunk, self.cache, lengths=torch.tensor(counts), every=every)
        if every:
            jobs[0].score(out[0, : counts[0]], jobs[0].at)
            out = out[:, counts[0] - 1]
        done = []
        for i, (job, c) in enumerate(zip(jobs, counts)):
            job.at += c
            if job.at == len(ids[i]):
                job.finish(self.engine, out[i: i + 1], self.cache, i)
                done.append(job)
        if done:
            self._keep([i for i, job in enumerate(jobs) if job not in done])
        return done

    def _keep(self, rows: list[int]) -> None:
        self.jobs = [self.jobs[i] for i in rows]
        if rows:
            self.cache = self.cache.select(torch.tensor(rows, device=self.engine.model.device))


class _Cohort:
    """The rows stepping together (one :meth:`_Settings.cohort`): one ``decode`` generator over a
    copy of their slots' states, restarted when rows join."""

    def __init__(self, engine: Engine, settings: _Settings):
        self.engine, self.settings = engine, settings
        self.rows: list[_Row] = []
        self.joining: list[_Row] = []
        self.steps = None
        self.batch = None
        self.cache = None
        self.restarts = 0
        self.verified = 0  # tree steps of the cohort's generators (on_step)
        self.drafter = engine._cohort_drafter(settings)

    def step(self) -> bool:
        """One iteration of the cohort; False once it has no rows left."""
        self._leave()
        if self.joining:
            self._restart()
        if self.steps is None:
            return bool(self.joining)
        stepped = int(self.batch.active.sum())
        before = int(self.batch.produced.sum())
        verified = self.verified
        try:
            batch = next(self.steps)
        except StopIteration:
            batch = None
        if stepped:
            plain = self.verified == verified
            with self.engine._lock:
                self.engine.counters.update(row_steps=stepped, stepped_tokens=int(self.batch.produced.sum()) - before)
                if plain:
                    self.engine.trees[1] += 1
        if batch is not None:
            self._read(batch)
            return True
        self._end_all()
        return False

    def _leave(self) -> None:
        """End the rows whose request was cancelled."""
        for row in self.joining:
            if row.request.cancelled:
                self.engine._publish(row, [], "cancelled")
        self.joining = [row for row in self.joining if not row.done]
        for i, row in enumerate(self.rows):
            if not row.done and row.request.cancelled:
                self.engine._publish(row, [], "cancelled")
                if bool(self.batch.active[i]):
                    self.batch.finish(i, int(self.batch.produced[i]))

    def _read(self, batch) -> None:
        engine = self.engine
        for i, row in enumerate(self.rows):
            if row.done:
                continue
            have = len(row.generated) - row.base
            tokens = batch.generated(i)
            new = tokens[have:]
            ended = not bool(batch.active[i])
            reason = None
            if ended:
                reason = "eos" if engine._ends_with_eos(tokens) else "length"
            logprobs = None
            if row.logprobs is not None:  # (the cohort keeps the most any of its rows asked for)
                k = row.request.logprobs
                logprobs = [lp if len(lp.top) <= k else replace(lp, top=lp.top[:k])
                            for lp in batch.logprobs_of[i][have:]]
            keep = engine._publish(row, new, reason, logprobs)
            if keep is not None and bool(batch.active[i]):
                batch.finish(i, keep - row.base)
            elif row.done and bool(batch.active[i]):
                batch.finish(i, int(batch.produced[i]))

    def _restart(self) -> None:
        """Take the live rows' states back from the running generator, add the joining rows, and
        start a generator over them all from their slots."""
        engine, model = self.engine, self.engine.model
        live = [i for i, row in enumerate(self.rows) if not row.done]
        if self.steps is not None:
            self.steps.close()  # decode hands the given cache every row's state as it stands
            if live:
                engine.pool.assign(torch.tensor([self.rows[i].slot for i in live], device=model.device),
                                   self.cache.select(torch.tensor(live, device=model.device)))
        self.rows = [self.rows[i] for i in live] + self.joining
        self.joining = []
        for row in self.rows:
            row.base = len(row.generated)
        slots = torch.tensor([row.slot for row in self.rows], device=model.device)
        self.cache = engine.pool.select(slots)
        settings = self.settings
        if settings.own is not None:  # a seeded request's own cohort: each of its runs a stream of its seed's
            seed = (self.rows[0].request.seed * 1000003 + self.restarts) % 2**62
        else:  # each row draws as row `index` of a call of its request's seed, past the tokens it has
            seed = KeyedDraws([row.request.draws_seed for row in self.rows], model.device,
                              keys=[row.index for row in self.rows], starts=[row.base for row in self.rows])
        self.restarts += 1
        asked = [row.request.logprobs for row in self.rows if row.request.logprobs is not None]
        self.steps = decode(model, [list(row.context) for row in self.rows], drafter=self.drafter,
                            method="autoregressive" if self.drafter is None else "stree",
                            tree=self._tree(),
                            max_new_tokens=[row.budget - len(row.generated) for row in self.rows],
                            sampling=SamplingParams.stack([row.settings.params for row in self.rows]),
                            eos_token_id=engine.lm.eos_token_id, seed=seed, cache=self.cache, on_step=self._verified,
                            logprobs=max(asked) if asked else None)
        self.batch = next(self.steps)

    def _tree(self):
        """The cohort's ``tree``: an explicit one as given; for "auto", a chooser whose costs are
        bracketed between powers of two of the batch size (:func:`auto_tree`'s ``bracketed``): a
        cohort's size changes whenever rows join, and measuring every new size would pause every
        row of the engine. Planned within the room the rows' slots leave, as decode plans."""
        settings = self.settings
        if settings.tree != "auto":
            return tree_spec(settings.tree)
        longest = max(len(row.context) + row.budget - len(row.generated) for row in self.rows) - 1
        depth = getattr(self.drafter, "draft_depth", None) or min(PathRates.DEPTH, self.cache.max_length - longest - 1)
        if self.drafter is None or depth < 1:
            return "auto"  # autoregressive, or no room for a tree: decode steps plainly
        greedy = all(row.settings.params.greedy for row in self.rows)
        return auto_tree(self.engine.model, self.drafter, len(self.rows), mode="eager", sampled=not greedy,
                         depth=depth, adaptive=greedy or not self.drafter.random_drafts, bracketed=True,  # (as decode)
                         watch=(greedy or not self.drafter.random_drafts) and self.drafter.level_model is None)

    def _verified(self, rows, tree, result) -> None:
        """decode's ``on_step``: a tree step, counted by its size."""
        self.verified += 1
        with self.engine._lock:
            self.engine.trees[tree.n] += 1

    def _end_all(self) -> None:
        for row in self.rows:
            if not row.done:
                self.engine._publish(row, [], "length")
        self.rows, self.steps, self.batch, self.cache = [], None, None, None


def _now() -> float:
    return time.monotonic()


def _drafter_name(drafter, lm) -> str | None:
    """``drafter`` checked: a registry name (an alias resolved) or None."""
    if drafter is None:
        return None
    if not isinstance(drafter, str):
        raise TypeError(f"drafter must be a drafter name or None, got {type(drafter).__name__}")
    name = drafter_name(drafter)
    if name not in DRAFTER_NAMES:
        names = ", ".join(map(repr, sorted({*DRAFTER_NAMES, *DRAFTER_ALIASES})))
        raise ValueError(f"drafter must be one of {names} or None, got {drafter!r}")
    if name in NEEDS_MODEL and lm.drafter_model is None:
        raise ValueError(f"drafter {drafter!r} needs a drafter model, and this engine's LM has none")
    return name


def _tree_depth(tree) -> int:
    """The room ``tree`` needs past a context (0 for "auto": it plans within the room left)."""
    if not isinstance(tree, str):
        raise TypeError(f"tree must be 'auto' or a tree spec string, got {type(tree).__name__}")
    if tree == "auto":
        return 0
    return tree_spec(tree).max_depth + 1


def slot_bytes(model, max_length: int) -> tuple[int, int]:
    """What one slot of ``max_length`` tokens holds, in bytes: the SSM layers' states (conv and
    SSM, fixed per request) and the attention layers' KV (preallocated to ``max_length``)."""
    one = model.allocate_cache(1, max_length)
    size = lambda t: 0 if t is None else t.numel() * t.element_size()  # noqa: E731
    return size(one.ssm) + size(one.conv), size(one.k) + size(one.v)


def slots_for_memory(model, max_length: int) -> int:
    """How many slots of ``max_length`` tokens ``MEMORY_SHARE`` of the free memory holds (each
    slot counted twice: the pool and a cohort's working copy)."""
    per_slot = sum(slot_bytes(model, max_length))
    if model.device.type == "cuda":
        free = torch.cuda.mem_get_info(model.device)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(1, min(MAX_SLOTS, int(free * MEMORY_SHARE) // max(1, 2 * per_slot)))
