"""The decoding loop: autoregressive, chain speculative decoding, and STree (Algorithm 1 of the
STree paper).

One iteration of ``stree`` / ``chain``: the drafter proposes a tree rooted at each row's last
token, the target scores every node in one ``forward_tree``, :func:`stree.sampling.verify.verify`
picks the accepted path and the bonus token, ``commit`` replays the accepted path into the cache,
and the accepted drafts plus the bonus are emitted. The bonus becomes the next root.

The loop is thin: its arguments are resolved once (:mod:`.config`); :func:`prefill_rows`,
:func:`autoregressive_step` and :func:`speculative_step` do the device work, each ending in ONE
device-to-host transfer of everything the host needs (the emitted tokens, their counts, and what
the drafter learns from); :class:`~stree.decoding.rows.Rows` keeps the host-side bookkeeping. A
finished row leaves the device batch (:meth:`_Loop.leave`): eager, the cache keeps the unfinished
rows only, so a row that is done costs the others' steps nothing; where shapes must stay fixed
(CUDA graphs, compiled calls, tensor parallelism) it leaves through the ``active`` mask and rides
along with a root-only tree.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from ..drafters.base import DraftContext, Drafter
from ..models.layers import linear
from ..models.layers.linear import following, leading, measure
from ..runtime.compiled import CompiledDecode
from ..runtime.graphs import DecodeGraphs
from ..runtime.runners import DecodeRunner, EagerRunner
from ..sampling.verify import SamplingParams
from ..tree import TokenTree, TreeBudget, TreeShape, host_array, host_tensor
from .autotree import AutoTree, auto_tree
from .config import METHODS, DecodeConfig, laws, resolve
from .distributed import share_tree, tensor_parallel
from .rows import (GenerationOutput, GenerationStats, Rows, check_finite, full_batch, merged_trees, pooled_tau,
                   stop_at_sequences, trees_chosen)
from .steps import HostStep, autoregressive_step, build_calls, check_draft, prefill_rows, speculative_step

__all__ = ["METHODS", "GenerationOutput", "GenerationStats", "HostStep", "Rows", "autoregressive_step", "decode",
           "drain", "generate", "merged_trees", "pooled_tau", "prefill_rows", "speculative_step", "trees_chosen"]


def drain(steps, each=None):
    """Run a :func:`decode` generator to its end, calling ``each`` (if given) on every batch of
    rows it yields; returns its :class:`GenerationOutput`."""
    while True:
        try:
            batch = next(steps)
        except StopIteration as end:
            return end.value
        if each is not None:
            each(batch)


@torch.no_grad()  # a generator: torch enters the mode at every resumption, so callers need none
def decode(model, input_ids, *, drafter: Drafter | None = None, tree: TreeShape | TreeBudget | str | None = "auto",
           method: str = "stree", max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
           top_p: float = 1.0, eos_token_id: int | list[int] | None = None, seed: int | list[int] | None = None,
           mode: str = "auto", max_length: int | None = None, on_step=None,
           sampling: SamplingParams | None = None, time_phases: bool = False,
           cuda_graph: bool | None = None, torch_compile: bool = False, cache=None, stop_sequences=None,
           logprobs: int | None = None):
    """:func:`generate` step by step: a generator that yields the batch's :class:`Rows` after the
    prefill and after every decoding step (a consumer may end rows there, :meth:`Rows.finish`:
    stop strings, streaming) and returns the :class:`GenerationOutput`. The arguments are checked
    when the first step is asked for.

    Decodes up to ``max_new_tokens`` per row (an int, or a list with one per row); a row stops
    after emitting an EOS, or after the first occurrence of one of ``stop_sequences`` (token-id
    lists; the row keeps the sequence, drops the drafts accepted past it).

    ``cache``: continue from it instead of prefilling: it holds, for every row of ``input_ids``
    (then the rows' whole contexts), the state after all but the last token, which the first step
    feeds. It is advanced in place; the output's ``exact`` says which rows it holds exactly.

    ``input_ids``: a ``[B, T]`` tensor or a list of token lists (ragged prompts allowed).
    ``method``: ``stree`` (tree drafts, one tree forward), ``chain`` (chain drafts through the
    chain scan), ``autoregressive``, or ``unrolled`` (the paper's baseline: every root-to-leaf
    path its own sequence through the whole model, see :mod:`stree.runtime.unrolled`; same outputs as
    ``stree``, slower). ``tree``: ``"auto"`` (the default; None means the same) chooses every
    step's tree, or a plain autoregressive step, by expected tokens per second from this
    machine's measured costs and the acceptance learned so far (:mod:`stree.decoding.autotree`; chains
    only under ``method="chain"``; an :class:`~stree.decoding.autotree.AutoTree` passed here makes the
    choice with its own costs and rates, and keeps what it learns); a
    :class:`~stree.tree.TreeShape` is drafted as given every step, and a
    :class:`~stree.tree.TreeBudget` lets a drafter that can grow each step's tree per row. A
    drafter built for a shape of its own (its ``shape``, e.g. ``STANDDrafter(store, shape)``)
    drafts that shape where ``tree`` is left "auto" (the named drafters of
    :func:`~stree.drafters.registry.make_drafter` have none). Tensor-parallel models and
    ``method="unrolled"`` take ``paper13`` (``chain(4)`` for chains) for "auto";
    ``method="autoregressive"`` ignores ``tree``.
    ``drafter`` defaults to :class:`NGramDrafter`. ``sampling`` (a :class:`SamplingParams`, which
    may hold each row's own values: :meth:`SamplingParams.stack`), or ``temperature`` / ``top_k`` /
    ``top_p`` / ``mode``, say how tokens are chosen; ``mode="naive"`` verifies by exact-match
    sampling. ``max_length``: the cache size; by default the longest prompt plus
    ``max_new_tokens`` plus the tree depth (the drafter's ``draft_depth`` when deeper).
    The same ``seed`` gives the same output. Draws are keyed by row and position
    (:mod:`stree.sampling.keyed`): with deterministic drafts (every drafter but STAND's and a drafter
    model's random ones) a seed's output is autoregressive decoding's, whatever trees are verified,
    and the trees follow the clock as in greedy decoding; with random drafts the output follows the
    trees, which then follow the seed and the cached cost profile alone (:mod:`stree.decoding.cost`).
    ``seed`` may hold one int per row: each row then draws what it draws alone with its seed.
    ``time_phases``: on CUDA, time draft / verify /
    commit apart (a device sync per phase; off, only the total is timed there). ``cuda_graph``:
    replay the step, and the tree pass and commit of static tree shapes, from CUDA graphs (by
    default on for a model on CUDA; the graphs and their cache are kept per model, batch size and
    cache size, and reused by later calls). ``torch_compile``: on the CPU, run the step and the
    tree pass of static tree shapes through ``torch.compile`` (the commit is the model's own;
    seconds of compiling per shape, once per process: for long runs; outputs as the eager path's).
    ``on_step(rows, tree, result)``, if given, sees every verify step (row ids, the drafted
    :class:`TokenTree`, the :class:`~stree.sampling.verify.VerifyResult`), e.g. to count accepted nodes.

    A tensor-parallel ``model`` (``stree.models.load(..., tensor_parallel=...)``; every rank
    calls ``decode`` with the same arguments): rank 0 drafts (the other ranks' ``drafter`` is
    not used), verifies and samples, and the ranks follow it (:mod:`stree.decoding.distributed`);
    ``on_step`` is called on rank 0; eager only.

    ``logprobs``: an int k >= 0 keeps, for every generated token, its log-probability and the k
    most likely entries of the law it was drawn from (the output's ``logprobs``,
    :class:`~stree.decoding.rows.TokenLogprob`; greedy decoding: the model's own distribution). They
    come with each step's one transfer to the host; the tokens drawn do not change."""
    config = resolve(model, input_ids, drafter, tree, method, max_new_tokens, temperature, top_k, top_p, eos_token_id,
                     seed, mode, max_length, sampling, cuda_graph, torch_compile, cache, stop_sequences, logprobs)
    return (yield from _Loop(model, config, method, seed, cache, on_step, time_phases).run())


def generate(model, input_ids, *, drafter: Drafter | None = None, tree: TreeShape | TreeBudget | str | None = "auto",
             method: str = "stree", max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, eos_token_id: int | list[int] | None = None, seed: int | list[int] | None = None,
             mode: str = "auto", max_length: int | None = None, on_step=None,
             sampling: SamplingParams | None = None, time_phases: bool = False,
             cuda_graph: bool | None = None, torch_compile: bool = False, cache=None,
             stop_sequences=None, logprobs: int | None = None) -> GenerationOutput:
    """Decode to the end and return the output; every argument as :func:`decode` takes it (the
    two signatures are tested equal)."""
    options = dict(locals())
    del options["model"], options["input_ids"]
    return drain(decode(model, input_ids, **options))


class _Loop:
    """One :func:`decode` call's state: the rows, the cache and runner, the tree chooser and the
    statistics; :meth:`run` is the loop, one iteration at a time."""

    def __init__(self, model, config: DecodeConfig, method: str, seed, cache, on_step, time_phases: bool):
        self.model, self.c, self.cache, self.on_step = model, config, cache, on_step
        self.drafter, self.chooser = config.drafter, config.chooser
        self.rows = Rows(config.prompts, config.budgets, config.eos, config.logprobs,
                         config.params.greedy_mask(len(config.prompts)))
        self.stats = GenerationStats(new_tokens=[0] * self.rows.batch_size, prefilled=cache is None)
        if config.auto and self.drafter is not None and self.chooser is None:
            t0 = time.perf_counter()
            self.chooser = auto_tree(model, self.drafter, self.rows.batch_size, chain=method == "chain",
                                     depth=config.depth, mode="cuda_graph" if config.cuda_graph else
                                     "compiled" if config.torch_compile else "eager",
                                     sampled=not config.params.greedy,
                                     # where the trees cannot change the output: greedy, no seed, or keyed
                                     # draws verifying deterministic drafts (stree.sampling.keyed)
                                     adaptive=config.params.greedy or seed is None or not self.drafter.random_drafts,
                                     watch=(config.params.greedy or not self.drafter.random_drafts)
                                     and self.drafter.level_model is None,
                                     may_rest=self.drafter.serves_one_call)
            self.stats.time_setup = time.perf_counter() - t0
            if self.chooser is None:  # the call rests (AutoTree.rests): plain decoding, the drafter unused
                self.drafter, self.stats.rested = None, True
        # the drafter the loop shows emitted tokens: none where its observe learns nothing (Drafter.observes)
        self.shown = self.drafter if self.drafter is not None and self.drafter.observes else None
        self.clock = _Clock(config.device, detailed=time_phases)
        self.start = self.clock.t
        self.shapes: dict = {}  # the static shapes of received trees (tensor parallelism)
        self.mark: float | None = None  # when the last iteration's time was taken
        self.seen = [0] * self.rows.batch_size  # per row, the generated tokens checked for stop sequences
        # A run of plain steps the chooser has decided ahead, where the drafter needs no target laws
        # after them: the loop neither plans nor drafts, and hands the drafter the run's tokens at its end.
        self.plain_run: _PlainRun | None = None
        self.watch: _Watch | None = None  # a draft made after a plain step, not verified (AutoTree.watch_shape)
        # a speculative loop's plain steps read the weight copies its tree passes use (models.layers.linear)
        self.speculative = config.speculative and not self.stats.rested
        self.plain_scope, self.tree_scope = ((following, leading) if self.speculative
                                             else (contextlib.nullcontext,) * 2)
        # plain steps since the last tree pass: past linear.FOLLOW_WIDE (a step multiplies each weight
        # once) following() has nothing left to follow, and its per-product lookups cost ~1% of a step
        self.since_tree = linear.FOLLOW_WIDE
        # Eager, the device batch holds the unfinished rows only: ``held`` (None: every row, in
        # order) names the batch rows its rows are; ``given``: the caller's cache, which gets each
        # row's state back as the row leaves (and the rest at the end).
        self.compacts = not (config.cuda_graph or config.torch_compile) and tensor_parallel(model) is None
        self.held: np.ndarray | None = None
        self.params = config.params  # the device batch's rows' (sliced as rows leave it, where each has its own)
        self.given = cache

    def draws(self):
        """The call's draws placed at the device batch's rows and the tokens each has generated (None:
        greedy): a row's t-th token is drawn with its keyed uniform t (:mod:`stree.sampling.keyed`)."""
        if self.c.generator is None:
            return None
        ids = np.arange(self.rows.batch_size) if self.held is None else self.held
        return self.c.generator.at(ids, self.rows.produced.numpy()[ids])

    def lap(self, phase: str) -> None:
        setattr(self.stats, f"time_{phase}", getattr(self.stats, f"time_{phase}") + self.clock.lap())

    def run(self):
        c, rows = self.c, self.rows
        linear.settle()  # (products whose trials in use ended take their paths now, not inside a call)
        kind = DecodeGraphs if c.cuda_graph else CompiledDecode if c.torch_compile else None
        pool = kind.for_model(self.model, rows.batch_size, c.max_length) if kind is not None else None
        if self.drafter is not None:
            self.drafter.reset()
        prefill = self.cache is None
        if prefill:
            self.cache = pool.cache if pool is not None else self.model.allocate_cache(rows.batch_size, c.max_length)
        self.runner = pool if pool is not None else EagerRunner(self.model, self.cache, c.target)
        if prefill and (pool is not None or isinstance(self.model, torch.nn.Module)):
            self.build(pool)
        if prefill:
            self.prefill()
        stop_at_sequences(rows, c.stops, self.seen)
        yield rows
        try:
            while True:
                flags = rows.active.tolist()  # (a list: a torch reduction costs several times more after a pass)
                if not any(flags):
                    break
                if not all(flags):
                    self.leave()
                self.iterate()
                yield rows
        finally:  # (also where the consumer stops early: the caller's cache holds every row as it stands)
            if self.held is not None and self.given is not None:
                self.given.assign(torch.from_numpy(self.held).to(c.device), self.cache)
        if self.plain_run is not None:  # (the call's last: a drafter serving this call alone drafts nothing after it)
            self.plain_run.end(rows, None if self.drafter.serves_one_call else self.shown, self.chooser)
        if self.watch is not None:
            self.settle_watch()
        return self.output()

    def leave(self) -> None:
        """Finished rows leave the device batch: eager, the cache keeps the unfinished rows only
        (a copy of their state; the caller's cache, if it gave one, gets the leaving rows' states
        back); where shapes are fixed they ride along, one token a step, parked at length 0 (so
        they never run out of room), their state no longer exact."""
        c, rows = self.c, self.rows
        if not self.compacts:
            rows.exact &= rows.active
            self.cache.seqlens.masked_fill_((~rows.active).to(c.device, non_blocking=True), 0)
            return
        held = np.arange(rows.batch_size) if self.held is None else self.held
        stay = rows.active.numpy()[held]
        if stay.all():
            return
        if self.given is not None and self.cache is not self.given:
            gone = np.flatnonzero(~stay)
            self.given.assign(torch.from_numpy(held[gone]).to(c.device),
                              self.cache.select(torch.from_numpy(gone).to(c.device)))
        self.cache = self.cache.select(torch.from_numpy(np.flatnonzero(stay)).to(c.device))
        self.params = self.params.select(np.flatnonzero(stay).tolist())
        self.held = held[stay]
        self.runner = EagerRunner(self.model, self.cache, c.target)
        if self.chooser is not None:  # (its costs are now a smaller batch's: AutoTree.narrowed)
            self.chooser.narrowed()
            self.mark = None  # (the compaction is not the next iteration's)

    def build(self, pool: DecodeRunner | None) -> None:
        """Before decoding, as setup (their time is not decoding's): compile (CPU) or capture (CUDA
        graphs) the step and the passes of the static shapes this call may verify
        (:func:`~stree.decoding.steps.build_calls`); eager, measure the products of the rows
        its steps and trees may multiply
        (:func:`~stree.models.layers.linear.measure`); and the drafter's calls for drafting them
        (:meth:`~stree.drafters.base.Drafter.build`)."""
        c, chooser, batch = self.c, self.chooser, self.rows.batch_size
        shapes = []
        if self.speculative and c.scan == "tree":
            if isinstance(c.shape, TreeShape):
                shapes = [c.shape]
            elif chooser is not None and chooser.fixed and chooser.fills_shapes:
                shapes = [chooser.prefix(m) for m in chooser.sizes]
        t0 = time.perf_counter()
        if pool is not None:
            plain_ks = {laws(None, c.logprobs), laws(None if self.drafter is None else self.drafter.plain_top_k,
                                                     c.logprobs)}  # (a plain run's steps, and a plain step's alone)
            build_calls(self.model, pool, shapes, c.params, c.top_k, plain_ks)
        elif isinstance(self.model, torch.nn.Module):
            # (rows leaving the batch: any row count up to the whole batch's largest tree) An explicit tree's
            # and plain decoding's too: a process's first pass of an explicit tree had timed its products'
            # paths inside a timed call (about fifteen plain steps' time, batch 2, 2-core EPYC).
            nodes = _most_nodes(c, chooser)
            measure(self.model, range(1, batch * nodes + 1) if self.compacts else
                    [batch * m for m in range(1, nodes + 1)])
        if self.drafter is not None:
            self.drafter.build(shapes, batch)
        self.stats.time_setup += time.perf_counter() - t0
        self.clock.lap()
        self.start = self.clock.t

    def prefill(self) -> None:
        c, rows = self.c, self.rows
        first = prefill_rows(self.model, rows, self.cache, self.params, self.draws(), c.top_k)
        check_finite(first, rows, "the prefill")
        self.stats.time_prefill += self.clock.lap()
        rows.emit(first, self.shown, c.drafter_k)
        self.stats.time_draft += self.clock.lap()

    def iterate(self) -> None:
        """One decoding step: a draft (or none), the target's step over it, the emission, and what
        the chooser learns from it."""
        c, rows, stats = self.c, self.rows, self.stats
        # the iteration's time runs from where the last one's was taken: what the chooser learned from
        # it, the rows' consumer and the drafter's bookkeeping between them count too (left out, a
        # tree's iteration took a sixth more than the choice knew of, compiled, batch 2)
        began = self.mark if self.mark is not None else time.perf_counter()
        roots, live = rows.roots(), rows.active_ids()
        # the device batch's roots: every row's, or, where rows left it (leave), the live rows'
        device_roots = roots if self.held is None else roots[torch.from_numpy(self.held)]
        draft = full = None
        if self.speculative and self.plain_run is not None:
            # (a step decided ahead: nothing to draft, share or time apart (only a choice makes runs, and a
            # tensor-parallel loop has none): an autoregressive step's work, bar the run's count and clock, in
            # most of a batch's steps where trees do not pay)
            self.plain_run.left -= 1
        elif self.speculative:
            if self.drafter is not None:
                draft = _draft(self.drafter, self.chooser, rows, c.shape, roots, live, self.model.vocab_size,
                               self.runner.eager)
                if draft is not None:
                    full = draft if len(live) == len(device_roots) else full_batch(draft, rows.active, roots)
                    full = full.to(c.device)
            full = share_tree(self.model, full, c.device, self.shapes)
            stats.time_draft += self.clock.lap()
        if full is None:  # autoregressive, or a plain step chosen over the tree
            drafter_k = None if self.drafter is None or self.plain_run is not None else self.drafter.plain_top_k
            scope = self.plain_scope if self.since_tree < linear.FOLLOW_WIDE else contextlib.nullcontext
            self.since_tree += 1
            with scope():
                if device_roots.device != c.device:
                    device_roots = device_roots.to(c.device, non_blocking=True)
                host = autoregressive_step(self.model, self.cache, device_roots, self.params, self.draws(), self.runner,
                                           laws(drafter_k, c.logprobs))
            stats.time_verify += self.clock.lap()
        else:
            self.since_tree = 0
            with self.tree_scope():
                host, result = speculative_step(c.target, self.cache, full, self.params, self.draws(), c.scan, c.top_k,
                                                lap=self.lap, runner=self.runner)
            if self.on_step is not None and self.drafter is not None:  # tensor parallelism: rank 0 drafts
                self.on_step(live, draft, _rows_of(result, live) if len(live) < len(device_roots) else result)
            drafter_k = c.drafter_k
        if self.held is not None:
            host = _spread(host, self.held, rows.batch_size)
        if full is None:
            for r in live:
                rows.accepted[r].append(0)
        else:
            counts = host.arrays()[1]
            for r in live:
                rows.accepted[r].append(int(counts[r]) - 1)
        n = 1 if full is None else full.n
        stats.trees[n] = stats.trees.get(n, 0) + 1
        stats.packed += full is not None and full.row_sizes is not None
        stats.target_forwards += 1
        check_finite(host, rows, f"decoding step {stats.target_forwards}")
        rows.emit(host, self.shown if self.plain_run is None else None, drafter_k)
        stop_at_sequences(rows, c.stops, self.seen)
        if self.chooser is not None:
            self.mark = time.perf_counter()
            self.learn(draft, full, host, live, (self.mark - began) * 1e3)
        stats.time_draft += self.clock.lap()  # feeding the drafter is drafting work

    def learn(self, draft, full, host: HostStep, live: list[int], elapsed: float) -> None:
        """What the chooser records of the step: a plain run's progress, a plain step (and whether
        to decide the next ones ahead), or a verified draft; ``elapsed``: the iteration's
        milliseconds."""
        chooser, run = self.chooser, self.plain_run
        if self.watch is not None and (full is not None or self.watch.ready()):
            self.settle_watch()
            if run is not None and chooser.wants_trees():  # (what it taught ends the plain run)
                run.left = 0
        if run is not None:
            run.steps += 1
            run.ms.append(elapsed)
            if run.left == 0:
                run.end(self.rows, self.shown, chooser)
                self.plain_run = None
                self.start_watch()
                # the next run at once where nothing falls due before it ends (no probe, no tree worth
                # drafting): a plain step weighed alone between runs (its plan, the drafter reading its
                # token, the choice learning it) took half as long again as a run's step, and runs end
                # wherever a watched draft falls due (compiled, batch 2, two processes each: 0.88-1.01 of
                # plain decoding's pace before, 0.96-1.06 after)
                ahead = chooser.plain_ahead(self.pending())
                if ahead:
                    self.plain_run = _PlainRun(ahead, self.rows)
        else:
            if full is None:
                chooser.record(None, elapsed_ms=elapsed)
            else:
                at = np.asarray(live)
                tokens, counts = host.arrays()
                if len(live) < len(counts):  # (else the rows are the live ones, in order: no copies)
                    tokens, counts = tokens[at], counts[at]
                chooser.record(draft, tokens, counts, np.arange(len(live)), elapsed, ids=at)
            # after a tree too: the plain step after a probe, weighed alone (its plan, the drafter reading
            # its token, the choice learning it), took most of a run's step more than a run's first step
            # did (compiled, batch 2, 2-core EPYC)
            ahead = (chooser.plain_ahead(self.pending()) if self.drafter is not None and self.drafter.plain_top_k is None
                     else 0)
            if ahead:
                self.plain_run = _PlainRun(ahead, self.rows)
        if full is None and run is None:  # after a plain step weighed alone (a run's end starts its own above)
            self.start_watch()

    def start_watch(self) -> None:
        """Draft and keep, not verify, where the chooser says a watched draft is due."""
        if self.watch is not None or not self.chooser.watching:
            return
        live = self.rows.active_ids()  # (a list: a tensor's any() right after a model step cost several times more)
        if not live:
            return
        shape = self.chooser.watch_shape()
        if shape is not None:
            began = time.perf_counter()
            draft = self.drafter.propose(self.rows.context(), shape)
            check_draft(draft, self.rows.roots()[live], self.model.vocab_size)
            self.watch = _Watch(draft, self.rows, live, (time.perf_counter() - began) * 1e3)

    def pending(self) -> int:
        """The plain steps until the watched draft held is settled (0: none held)."""
        return 0 if self.watch is None else self.watch.left

    def settle_watch(self) -> None:
        self.watch.settle(self.rows, self.chooser)
        self.watch = None
        self.stats.watched += 1

    def output(self) -> GenerationOutput:
        rows, stats = self.rows, self.stats
        self.clock.lap()
        stats.time_total = self.clock.t - self.start
        stats.new_tokens = rows.produced.tolist()
        stats.accepted = rows.accepted
        seq = rows.seq.numpy()  # (numpy rows: a torch slice per row is several times dearer)
        sequences = [seq[i, :n].tolist() for i, n in enumerate(rows.lengths.tolist())]
        return GenerationOutput(sequences, [len(p) for p in self.c.prompts], stats, rows.exact.tolist(),
                                rows.logprobs_of)


class _Clock:
    """Wall time per phase. On CUDA the phases are timed only with ``detailed`` (a device sync
    per lap: it would cost the loop its single sync per step); the total always is."""

    def __init__(self, device: torch.device, detailed: bool):
        self.sync = device.type == "cuda" and detailed
        self.t = time.perf_counter()

    def lap(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt


class _PlainRun:
    """``left`` more plain steps decided ahead (:meth:`AutoTree.plain_ahead`) from the rows as
    they stood before them; ``steps`` taken so far, ``ms`` each one's time."""

    def __init__(self, left: int, rows: Rows):
        self.left, self.steps, self.ms = left, 0, []
        # (a NumPy copy: a torch clone right after a step cost a run's start a tenth of a plain step)
        self.lengths, self.rows = rows.lengths_now(), rows.active_ids()

    def end(self, rows: Rows, drafter: Drafter | None, chooser: AutoTree) -> None:
        """Show the drafter (None: none to show) the run's tokens (as one emission per row: no
        target laws) and let the chooser record its steps."""
        if self.steps:
            if drafter is not None:
                # (NumPy slices: a torch slice and index per row took a fifth of the run's end)
                seq, starts, ends = rows.seq.numpy(), self.lengths.tolist(), rows.lengths.tolist()
                drafter.observe(DraftContext(rows.seq, torch.from_numpy(self.lengths), self.rows),
                                [seq[r, starts[r]: ends[r]].tolist() for r in self.rows], None)
            chooser.plain_steps(self.steps, self.ms)


class _Watch:
    """A draft made after a plain step and not verified (:meth:`AutoTree.watch_shape`): deterministic,
    greedy or at keyed draws (:mod:`stree.sampling.keyed`), the tokens the steps after it emit are
    what verifying it would have emitted, so they say what it
    would have had accepted (:meth:`AutoTree.watched`), at the price of drafting it and learning
    from it (``drafting_ms``: the first, by the clock; the chooser times the second)."""

    def __init__(self, draft: TokenTree, rows: Rows, live: list[int], drafting_ms: float):
        self.draft, self.live, self.drafting_ms = draft, np.asarray(live), drafting_ms
        self.served = rows.critical(live)
        self.start = rows.lengths.numpy()[self.live].copy()
        depth = draft.static_shape.max_depth if draft.static_shape is not None else draft.n - 1
        self.left = depth + 1  # the plain steps until every row has emitted past the draft's depth

    def ready(self) -> bool:
        """After a plain step: whether every row has emitted past the draft's depth, or finished.
        Counted down: a plain step emits one token in every active row (read off the rows at each
        step, it took a hundredth of a plain step where watches were pending most of the time)."""
        self.left -= 1
        return self.left <= 0

    def settle(self, rows: Rows, chooser: AutoTree) -> None:
        seq, ends = rows.seq.numpy(), rows.lengths.numpy()
        chooser.watched(self.draft, [seq[r, s: ends[r]] for r, s in zip(self.live, self.start)], self.served,
                        self.live, self.drafting_ms)


def _draft(drafter: Drafter, chooser: AutoTree | None, rows: Rows, shape, roots: torch.Tensor, live: list[int],
           vocab_size: int, eager: bool) -> TokenTree | None:
    """This step's checked draft for the live rows, or None for a plain step: ``shape`` drafted
    as given (a draft with nothing in it is one node where the loop runs eager), or the
    ``chooser``'s plan, cut to its best prefix (:mod:`stree.decoding.autotree`)."""
    plan = shape if chooser is None else chooser.plan(lambda: drafter.behind(rows.context()), rows.steps_left)
    if plan is None:
        return None
    context = rows.context()
    if chooser is not None:
        # Known before drafting: a plain step, where none of the rows the batch waits for can draft (the
        # choice weighs a tree by them alone, whatever the others' drafts: Rows.critical)
        critical = rows.critical(live)
        can = drafter.can_draft_strong if chooser.strong_only else drafter.can_draft
        if not can(context if critical.all() else context.among(critical)):
            chooser.undrafted()
            return None
    draft = drafter.propose(context, None if plan == "own" else plan)
    check_draft(draft, roots if len(live) == len(roots) else roots[live], vocab_size)  # (no index op when all are live)
    if chooser is not None:
        return chooser.choose(draft, critical, np.asarray(live))
    valid = draft.arrays()[1]  # (numpy: a tensor's any() allocates its answer)
    if eager and valid is not None and not valid[:, 1:].any():
        return TokenTree.from_shape(_ROOT, draft.tokens[:, :1])  # nothing drafted: one node
    return draft


_ROOT = TreeShape.chain(0)  # (made once: checking a parent array costs a dozen small torch ops)


def _most_nodes(c: DecodeConfig, chooser: AutoTree | None) -> int:
    """The most nodes a row of the call's passes may hold: the choice's largest tree, the explicit
    shape's or budget's nodes, else one (plain steps; a drafter drafting trees of its own)."""
    if chooser is not None:
        return chooser.max_nodes
    if not c.speculative:
        return 1
    return c.shape.n if isinstance(c.shape, TreeShape) else c.shape.nodes if isinstance(c.shape, TreeBudget) else 1


def _spread(host: HostStep, held: np.ndarray, batch: int) -> HostStep:
    """A step of the device batch's rows (batch rows ``held``) as one of the whole batch: the
    rows that left get nothing (no tokens, finite). (NumPy: a torch fill and index per part cost
    a one-row step a twentieth of its time, every step after a row left.)"""

    def spread(t: torch.Tensor | None, fill=0) -> torch.Tensor | None:
        if t is None:
            return None
        a = host_array(t)
        out = np.full((batch, *a.shape[1:]), fill, dtype=a.dtype)
        out[held] = a
        return host_tensor(out)

    return HostStep(spread(host.tokens), spread(host.counts), spread(host.finite, True), spread(host.top_ids),
                    spread(host.top_probs), spread(host.token_probs))


def _rows_of(result, rows: list[int]):
    """A VerifyResult restricted to ``rows``."""
    from ..sampling.verify import VerifyResult

    idx = torch.tensor(rows, device=result.accepted.device)
    return VerifyResult(result.accepted[idx], result.num_accepted[idx], result.bonus[idx],
                        None if result.probs is None else result.probs[idx])
